//! Windows through NCCL's own one-sided API (NCCL 2.29+): registration
//! with `ncclCommWindowRegister`, puts with `ncclPutSignal`, signals with
//! `ncclSignal`, waits with `ncclWaitSignal`, all queued on CUDA streams —
//! copy engines over NVLink/PCIe and NCCL's proxy over the network, no SMs.
//!
//! rmacomm's signal rule holds here as on its own windows: the n-th
//! `signal(d)` of rank s satisfies the n-th `wait_signal(s)` on d, and
//! every put s made to d before that signal is in place when the wait is
//! over. NCCL counts differently: each `ncclPutSignal` is a signal too, and
//! `ncclWaitSignal` waits for a number of them. So `signal(d)` tells d,
//! through the group's store, how many NCCL signals it closes (its puts to
//! d since the previous signal, plus itself), and `wait_signal(s)` reads
//! that count before it queues the wait. Two consequences, unlike
//! rmacomm's own windows: the host call of `wait_signal(s)` returns only
//! once s has *queued* its signal (the stream wait then waits for it to
//! run), or fails after the timeout naming s — a program that queues a
//! wait before the matching signal on both ranks' hosts (on different
//! streams) waits for the timeout; and a rank's puts to a peer and its
//! signal to that peer go on one stream (NCCL orders them there; across
//! streams, order them with events). torchcomms' NCCL window waits for one
//! NCCL signal per `wait_signal`: after a put and a signal in one round,
//! the next round's wait can pass before its data arrives.
//!
//! Refused before NCCL sees it, on every rank where it is collective:
//! buffers of different sizes, memory that is not cuMem/VMM (NCCL's rule
//! for windows: `ncclMemAlloc`, PyTorch's expandable segments,
//! `Context::alloc_vmm`) or not 4096-byte aligned; and, with nothing
//! queued, a put whose target range leaves the peer's buffer, whose source
//! (named by window and offset: NCCL puts only from registered memory)
//! leaves this rank's, a window not registered, a rank outside the
//! communicator. After an NCCL call failed (it may have been counted),
//! every later one-sided call fails naming it: make a new communicator.
//! One-sided calls are not capturable in CUDA graphs (NCCL's note).
//!
//! The library must be 2.29 or later ([`rmacomm_cuda::nccl::WINDOW_API`]);
//! an older one is refused on every rank, naming its version.

use std::sync::Arc;
use std::time::Duration;

use rmacomm_cuda::device::{DeviceMemory, Stream};
use rmacomm_cuda::nccl_comm::{NcclComm, NcclWindow};

use crate::{Error, Group, Result, Store};

/// `NCCL_WIN_REQUIRED_ALIGNMENT`.
const ALIGN: u64 = 4096;

/// A window registered on an [`NcclRma`]: an index into it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowId(usize);

struct Registered {
    win: NcclWindow,
    /// Kept alive while registered.
    _mem: Arc<DeviceMemory>,
    /// Every rank's buffer length (one size).
    len: usize,
}

/// NCCL's one-sided API on one communicator, with rmacomm's signal
/// semantics (module docs). Windows are registered on it collectively
/// ([`register`](Self::register)); signals belong to the communicator, as
/// NCCL's do, whatever windows the puts went to. Dropping it deregisters
/// its windows, which NCCL does collectively: drop it on every rank. A
/// signal never waited for leaves its count (a few bytes) in the store.
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
    /// The first NCCL call that failed (NCCL may have counted it, so the
    /// counts can no longer be trusted).
    broken: Option<(&'static str, rmacomm_cuda::CudaError)>,
}

impl std::fmt::Debug for NcclRma {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NcclRma(rank {} of {}, {:?})", self.rank, self.size, self.comm)
    }
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
            broken: None,
        })
    }

    /// Changes how long [`wait_signal`](Self::wait_signal) waits for a
    /// peer's signal count.
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    fn check_group(&self, op: &'static str, group: &Group) -> Result<()> {
        if group.size() != self.size || group.rank() != self.rank {
            return Err(Error::invalid(
                op,
                "the group is not the one this NcclRma was made with (rank or size differ)",
            ));
        }
        Ok(())
    }

    /// Fails when an earlier NCCL call failed.
    fn usable(&self, op: &'static str, peer: usize) -> Result<()> {
        match &self.broken {
            None => Ok(()),
            Some((first, e)) => {
                Err(Error::StreamFailed { op, peer, earlier: Box::new(Error::Cuda { op: first, source: e.clone() }) })
            }
        }
    }

    /// An NCCL one-sided call's error: remembered (later calls fail with
    /// it), then returned.
    fn failed(&mut self, op: &'static str, e: rmacomm_cuda::CudaError) -> Error {
        if self.broken.is_none() {
            self.broken = Some((op, e.clone()));
        }
        Error::Cuda { op, source: e }
    }

    /// The communicator (for its collectives).
    pub fn comm(&mut self) -> &mut NcclComm {
        &mut self.comm
    }

    /// Registers `mem` as this rank's buffer of a new window (collective
    /// over the group given to [`new`](Self::new): every rank registers, in
    /// the same order, a buffer of the same size). Before NCCL is called,
    /// every rank learns every rank's size, memory kind and alignment, and
    /// all refuse together (naming the rank) if any is wrong; after it,
    /// whether every rank got a window. The memory stays allocated while
    /// registered.
    pub fn register(&mut self, group: &Group, mem: Arc<DeviceMemory>) -> Result<WindowId> {
        const OP: &str = "register";
        self.check_group(OP, group)?;
        let mine = format!("{} {} {}", mem.len(), u8::from(mem.is_vmm()), u8::from(mem.ptr().is_multiple_of(ALIGN)));
        let all = group.exchange("nccl_rma_register", mine.as_bytes())?;
        let mut len = None;
        for (r, v) in all.iter().enumerate() {
            let text = String::from_utf8_lossy(v);
            let f: Vec<&str> = text.split(' ').collect();
            let Some(n) = f.first().and_then(|n| n.parse::<usize>().ok()).filter(|_| f.len() == 3) else {
                return Err(Error::Protocol(format!("register: rank {r}'s NCCL window description is malformed")));
            };
            if f[1] != "1" {
                return Err(Error::PeerFailed {
                    op: OP,
                    peer: r,
                    reason: "its buffer is not cuMem/VMM memory, which NCCL windows need (ncclMemAlloc, PyTorch's \
                             expandable segments, Context::alloc_vmm)"
                        .into(),
                });
            }
            if f[2] != "1" {
                return Err(Error::PeerFailed {
                    op: OP,
                    peer: r,
                    reason: format!("its buffer is not {ALIGN}-byte aligned (NCCL_WIN_REQUIRED_ALIGNMENT)"),
                });
            }
            match len {
                None => len = Some(n),
                Some(l) if l != n => {
                    return Err(Error::Mismatch {
                        op: "register (NCCL window)".into(),
                        detail: format!("rank 0's buffer is {l} bytes, rank {r}'s {n}: NCCL windows are one size"),
                    })
                }
                Some(_) => {}
            }
        }
        #[allow(unsafe_code)]
        // SAFETY: `mem` is kept (in `Registered`) until deregistration.
        let got = unsafe { self.comm.window_register(&mem) };
        let blob = match &got {
            Ok(_) => "ok".to_string(),
            Err(e) => format!("err {e}"),
        };
        let all = group.exchange("nccl_rma_registered", blob.as_bytes());
        let failed = |e: rmacomm_cuda::CudaError| Error::Cuda { op: "register (ncclCommWindowRegister)", source: e };
        let win = match (got, all) {
            (Ok(win), Ok(all)) => {
                let bad = all
                    .iter()
                    .enumerate()
                    .find_map(|(r, v)| String::from_utf8_lossy(v).strip_prefix("err ").map(|why| (r, why.to_string())));
                if let Some((peer, reason)) = bad {
                    let _ = self.comm.window_deregister(win);
                    return Err(Error::PeerFailed { op: OP, peer, reason });
                }
                win
            }
            (Ok(win), Err(e)) => {
                let _ = self.comm.window_deregister(win);
                return Err(e);
            }
            (Err(e), _) => return Err(failed(e)),
        };
        self.windows.push(Some(Registered { win, _mem: mem, len: len.unwrap_or(0) }));
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
        self.comm
            .window_deregister(r.win)
            .map_err(|e| Error::Cuda { op: "deregister (ncclCommWindowDeregister)", source: e })
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
        self.usable(OP, dst)?;
        let source = self.window(OP, src)?;
        if src_offset.checked_add(len).is_none_or(|end| end > source.len) {
            return Err(Error::invalid(
                OP,
                format!(
                    "the source, {len} bytes at offset {src_offset}, is past this rank's {}-byte buffer of window {}",
                    source.len, src.0
                ),
            ));
        }
        let from = source.win.ptr() + src_offset as u64;
        let cap = self.window(OP, target)?.len;
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
        #[allow(unsafe_code)]
        // SAFETY: the source lies in this rank's registered window (kept
        // allocated while registered) and the target range in the peer's
        // (every rank's buffer is `cap` bytes), both checked above.
        let r = unsafe { self.comm.put_signal(from, len, dst, win, offset, stream) };
        r.map_err(|e| self.failed("put (ncclPutSignal)", e))?;
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
        self.usable(OP, dst)?;
        let r = self.comm.signal(dst, stream);
        r.map_err(|e| self.failed("signal (ncclSignal)", e))?;
        let count = self.pending[dst] + 1;
        let key = self.key(self.rank, dst, self.sent[dst]);
        if let Err(e) = self.store.set(&key, count.to_string().as_bytes()) {
            // The NCCL signal is queued but unannounced: the next signal
            // to `dst` closes it too.
            self.pending[dst] = count;
            return Err(e);
        }
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
        self.usable(OP, src)?;
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
            .ok()
            .filter(|c| (1..=i32::MAX as u32).contains(c))
            .ok_or_else(|| Error::Protocol(format!("wait_signal: rank {src}'s signal count is malformed")))?;
        let r = self.comm.wait_signal(src, count, stream);
        r.map_err(|e| self.failed("wait_signal (ncclWaitSignal)", e))?;
        self.waited[src] += 1;
        // The wait is queued: a key left behind costs store memory only.
        if let Err(e) = self.store.delete(&key) {
            tracing::warn!("NCCL window: could not delete {key} from the store: {e}");
        }
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
