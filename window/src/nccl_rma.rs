//! Windows through NCCL's own one-sided API (NCCL 2.29+): registration
//! with `ncclCommWindowRegister`, puts with `ncclPutSignal`, signals with
//! `ncclSignal`, waits with `ncclWaitSignal`, all queued on CUDA streams —
//! copy engines over NVLink/PCIe and NCCL's proxy over the network, no SMs.
//!
//! rmacomm's window semantics hold here as on its own windows: the n-th
//! `signal(d)` of rank s satisfies the n-th `wait_signal(s)` on d, and
//! every put s made to d before that signal is in place when the wait is
//! over. NCCL counts differently: each `ncclPutSignal` is a signal too, and
//! `ncclWaitSignal` waits for a number of them. So `signal(d)` tells d,
//! through the group's store, how many NCCL signals it closes (its puts to
//! d since the previous signal, plus itself), and `wait_signal(s)` reads
//! that count before it queues the wait: its host call returns once s has
//! *queued* that signal (not once it ran; the stream wait does that), or
//! fails after the timeout naming s. (torchcomms' NCCL window waits for one
//! NCCL signal per `wait_signal`; after a put and a signal in one round the
//! next round's wait can pass early.)
//!
//! NCCL's rules, checked here before NCCL sees them: a put's source is in
//! a window this rank registered (a put names it by window and offset),
//! the target range fits the peer's buffer
//! (sizes exchanged at registration; nothing is sent otherwise), peers are
//! ranks of the communicator. NCCL wants cuMem/VMM memory for windows
//! (`ncclMemAlloc`, PyTorch's expandable segments) and says so with its
//! error. One-sided calls are not capturable in CUDA graphs (NCCL's note).
//!
//! The library must be 2.29 or later ([`rmacomm_cuda::nccl::WINDOW_API`]);
//! an older one is refused on every rank, naming its version.

use std::sync::Arc;
use std::time::Duration;

use rmacomm_cuda::device::{DeviceMemory, Stream};
use rmacomm_cuda::nccl_comm::{NcclComm, NcclWindow};

use crate::{Error, Group, Result, Store};

/// A window registered on an [`NcclRma`]: an index into it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowId(usize);

struct Registered {
    win: NcclWindow,
    /// Kept alive while registered.
    _mem: Arc<DeviceMemory>,
    /// Every rank's buffer length, by rank.
    sizes: Vec<usize>,
}

/// NCCL's one-sided API on one communicator, with rmacomm's signal
/// semantics (module docs). Windows are registered on it collectively
/// ([`register`](Self::register)); signals belong to the communicator, as
/// NCCL's do, whatever windows the puts went to.
pub struct NcclRma {
    comm: NcclComm,
    store: Arc<dyn Store>,
    prefix: String,
    rank: usize,
    size: usize,
    timeout: Duration,
    windows: Vec<Option<Registered>>,
    /// Per destination: puts since the last signal to it.
    pending: Vec<u64>,
    /// Per destination: signals sent; per source: signals waited for.
    sent: Vec<u64>,
    waited: Vec<u64>,
}

impl std::fmt::Debug for NcclRma {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NcclRma(rank {} of {}, {:?})", self.rank, self.size, self.comm)
    }
}

fn nccl(op: &'static str) -> impl Fn(rmacomm_cuda::CudaError) -> Error {
    move |source| Error::Cuda { op, source }
}

impl NcclRma {
    /// Takes `comm` (collective over `group`, whose ranks are the
    /// communicator's): every rank checks that NCCL's window API is usable
    /// and learns whether every other rank's is; any refusal fails every
    /// rank, naming the rank and its reason. `timeout` bounds waits for a
    /// peer's signal count.
    pub fn new(comm: NcclComm, group: &Group, timeout: Duration) -> Result<NcclRma> {
        const OP: &str = "NcclRma::new";
        if comm.size() != group.size() || comm.rank() != group.rank() {
            return Err(Error::invalid(
                OP,
                format!(
                    "the NCCL communicator is rank {} of {}, the group rank {} of {}",
                    comm.rank(),
                    comm.size(),
                    group.rank(),
                    group.size()
                ),
            ));
        }
        let mine = match comm.window_api() {
            Ok(()) => format!("ok {:016x}", rand::random::<u64>()),
            Err(e) => format!("err {e}"),
        };
        let all = group.exchange("nccl_rma", mine.as_bytes())?;
        let mut prefix = None;
        for (r, v) in all.iter().enumerate() {
            let v = String::from_utf8_lossy(v);
            if let Some(why) = v.strip_prefix("err ") {
                return Err(Error::PeerFailed { op: "NCCL windows", peer: r, reason: why.to_string() });
            }
            if r == 0 {
                prefix = v.strip_prefix("ok ").map(|t| format!("nccl_rma/{t}/"));
            }
        }
        let prefix = prefix.ok_or_else(|| Error::Protocol("rank 0's NCCL window token is malformed".into()))?;
        let n = group.size();
        Ok(NcclRma {
            comm,
            store: group.store(),
            prefix,
            rank: group.rank(),
            size: n,
            timeout,
            windows: Vec::new(),
            pending: vec![0; n],
            sent: vec![0; n],
            waited: vec![0; n],
        })
    }

    /// The communicator (for its collectives).
    pub fn comm(&mut self) -> &mut NcclComm {
        &mut self.comm
    }

    /// Registers `mem` as this rank's buffer of a new window (collective
    /// over the group given to [`new`](Self::new): every rank registers, in
    /// the same order; lengths may differ by rank). The memory stays
    /// allocated while registered.
    pub fn register(&mut self, group: &Group, mem: Arc<DeviceMemory>) -> Result<WindowId> {
        let all = group.exchange("nccl_rma_register", mem.len().to_string().as_bytes())?;
        let sizes = all
            .iter()
            .enumerate()
            .map(|(r, v)| {
                String::from_utf8_lossy(v)
                    .parse::<usize>()
                    .map_err(|_| Error::Protocol(format!("rank {r}'s NCCL window length is malformed")))
            })
            .collect::<Result<Vec<_>>>()?;
        let win = self.comm.window_register(&mem).map_err(nccl("register (ncclCommWindowRegister)"))?;
        self.windows.push(Some(Registered { win, _mem: mem, sizes }));
        Ok(WindowId(self.windows.len() - 1))
    }

    fn window(&self, op: &'static str, id: WindowId) -> Result<&Registered> {
        self.windows
            .get(id.0)
            .and_then(Option::as_ref)
            .ok_or_else(|| Error::invalid(op, format!("window {} is not registered here", id.0)))
    }

    /// Deregisters a window (collective, as registration was).
    pub fn deregister(&mut self, id: WindowId) -> Result<()> {
        self.window("deregister", id)?;
        let r = self.windows[id.0].take().expect("checked");
        self.comm.window_deregister(r.win).map_err(nccl("deregister (ncclCommWindowDeregister)"))
    }

    fn peer(&self, op: &'static str, peer: usize) -> Result<()> {
        if peer >= self.size {
            return Err(Error::invalid(op, format!("rank {peer} is not below the communicator's size {}", self.size)));
        }
        Ok(())
    }

    /// Puts `len` bytes at byte `src_offset` of this rank's buffer of
    /// window `src` (NCCL puts from registered memory only) into `dst`'s
    /// buffer of window `target` at byte `offset`, queued on `stream`.
    /// Nothing is queued on an error. The source bytes are read when the
    /// stream runs the put: leave them unchanged until then.
    #[allow(clippy::too_many_arguments)]
    pub fn put(
        &mut self,
        src: WindowId,
        src_offset: usize,
        len: usize,
        dst: usize,
        target: WindowId,
        offset: usize,
        stream: &Stream,
    ) -> Result<()> {
        const OP: &str = "put";
        self.peer(OP, dst)?;
        let source = self.window(OP, src)?;
        if src_offset.checked_add(len).is_none_or(|end| end > source.win.len()) {
            return Err(Error::invalid(
                OP,
                format!(
                    "the source, {len} bytes at offset {src_offset}, is past this rank's {}-byte buffer of window {}",
                    source.win.len(),
                    src.0
                ),
            ));
        }
        let from = source.win.ptr() + src_offset as u64;
        let cap = self.window(OP, target)?.sizes[dst];
        if offset.checked_add(len).is_none_or(|end| end > cap) {
            return Err(Error::Bounds {
                op: OP,
                peer: dst,
                reason: format!("{len} bytes at offset {offset} of its {cap}-byte buffer of window {}", target.0),
            });
        }
        if self.pending[dst] >= i32::MAX as u64 - 1 {
            // ncclWaitSignal counts in a C int.
            return Err(Error::invalid(
                OP,
                format!("{} puts to rank {dst} without a signal: signal it first", self.pending[dst]),
            ));
        }
        let win = &self.windows[target.0].as_ref().expect("checked").win;
        self.comm.put_signal(from, len, dst, win, offset, stream).map_err(nccl("put (ncclPutSignal)"))?;
        self.pending[dst] += 1;
        Ok(())
    }

    fn key(&self, src: usize, dst: usize, n: u64) -> String {
        format!("{}sig/{src}/{dst}/{n}", self.prefix)
    }

    /// Signals `dst`, queued on `stream` after this rank's earlier puts to
    /// it; `dst`'s matching [`wait_signal`](Self::wait_signal) then finds
    /// their data in place.
    pub fn signal(&mut self, dst: usize, stream: &Stream) -> Result<()> {
        const OP: &str = "signal";
        self.peer(OP, dst)?;
        self.comm.signal(dst, stream).map_err(nccl("signal (ncclSignal)"))?;
        let count = self.pending[dst] + 1;
        let key = self.key(self.rank, dst, self.sent[dst]);
        self.store.set(&key, count.to_string().as_bytes())?;
        self.sent[dst] += 1;
        self.pending[dst] = 0;
        Ok(())
    }

    /// Queues on `stream` a wait for `src`'s next signal (and so for the
    /// puts it made before it). The call itself returns once `src` has
    /// queued that signal, or fails after the timeout naming `src`.
    pub fn wait_signal(&mut self, src: usize, stream: &Stream) -> Result<()> {
        const OP: &str = "wait_signal";
        self.peer(OP, src)?;
        let n = self.waited[src];
        let key = self.key(src, self.rank, n);
        let raw = self.store.get(&key, self.timeout).map_err(|e| match e {
            Error::Timeout { after, .. } => Error::Timeout {
                waiting_for: format!("wait_signal: signal #{n} from rank {src} (it never signalled this rank)"),
                after,
            },
            other => other,
        })?;
        let count = String::from_utf8_lossy(&raw)
            .parse::<u32>()
            .map_err(|_| Error::Protocol(format!("wait_signal: rank {src}'s signal count is malformed")))?;
        self.comm.wait_signal(src, count, stream).map_err(nccl("wait_signal (ncclWaitSignal)"))?;
        self.waited[src] += 1;
        self.store.delete(&key)?;
        Ok(())
    }
}

impl Drop for NcclRma {
    fn drop(&mut self) {
        for r in self.windows.drain(..).flatten() {
            let _ = self.comm.window_deregister(r.win);
        }
    }
}
