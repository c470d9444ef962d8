//! Windows through NCCL's own one-sided API (NCCL 2.29+): registration
//! with `ncclCommWindowRegister`, puts with `ncclPutSignal`, signals with
//! `ncclSignal`, waits with `ncclWaitSignal`, all queued on CUDA streams —
//! copy engines over NVLink/PCIe and NCCL's proxy over the network, no SMs.
//!
//! rmacomm's signal rule holds here as on its own windows: the n-th
//! `signal(d)` of rank s satisfies the n-th `wait_signal(s)` on d, and
//! every put s made to d before that signal is in place when the wait is
//! over. NCCL counts differently: each `ncclPutSignal` is a signal too, and
//! `ncclWaitSignal` waits for a number of them. So `signal(d)` also
//! publishes, through the group's store, how many NCCL signals s has queued
//! to d in all (puts included), and `wait_signal(s)` reads that total and
//! queues a wait for the ones not yet waited for. Two consequences, unlike
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
//! Refused before NCCL sees it, on every rank (registration is
//! collective): buffers of different sizes (rmacomm's rule, NCCL 2.29's),
//! memory that is not cuMem/VMM (NCCL's rule for windows; here a
//! [`DeviceMemory`] from `Context::alloc_vmm`) or not 4096-byte aligned,
//! memory already in a window, an `NcclRma` broken by an earlier failure;
//! and, with nothing queued, a put whose target range leaves the peer's
//! buffer, whose source (named by window and offset: NCCL puts only from
//! registered memory) leaves this rank's, a window not registered, a rank
//! outside the communicator. After an NCCL one-sided call failed (NCCL may
//! have counted it), every later one fails naming it: make a new
//! communicator. The calls are not capturable in CUDA graphs (the counts
//! go through the store when the call is made, not when a graph replays).
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

/// ncclWaitSignal counts in a C int.
const MAX_COUNT: u64 = i32::MAX as u64;

/// A window registered on an [`NcclRma`]: an index into it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowId(usize);

struct Registered {
    win: NcclWindow,
    /// Kept allocated while registered.
    mem: Arc<DeviceMemory>,
}

impl Registered {
    fn len(&self) -> usize {
        self.win.len()
    }
}

/// NCCL's one-sided API on one communicator, with rmacomm's signal
/// semantics (module docs). Windows are registered on it collectively
/// ([`register`](Self::register)); signals belong to the communicator, as
/// NCCL's do, whatever windows the puts went to. Dropping it waits for its
/// device's work, deregisters its windows and destroys the communicator. A
/// signal never waited for leaves its total (a few bytes) in the store.
pub struct NcclRma {
    comm: NcclComm,
    store: Arc<dyn Store>,
    prefix: String,
    rank: usize,
    size: usize,
    timeout: Duration,
    windows: Vec<Option<Registered>>,
    /// Per destination: NCCL signals queued to it (puts and signals), and
    /// the total last published to it.
    queued: Vec<u64>,
    announced: Vec<u64>,
    /// Per destination: signals published (the next key).
    sent: Vec<u64>,
    /// Per source: NCCL signals waited for, and waits queued (the next key).
    waited_total: Vec<u64>,
    waited: Vec<u64>,
    /// The first NCCL call that failed (NCCL may have counted it, so the
    /// counts can no longer be trusted).
    broken: Option<(&'static str, rmacomm_cuda::CudaError)>,
    /// Memory of registrations NCCL still had in progress at the timeout:
    /// kept until the communicator (declared before, so dropped first) has
    /// ended them.
    orphans: Vec<Arc<DeviceMemory>>,
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
    /// peer: for its signal total, and for the device's work (which may
    /// wait for the peer's signals) in `deregister` and the drop.
    pub fn new(comm: NcclComm, group: &Group, timeout: Duration) -> Result<NcclRma> {
        // Every refusal goes through the exchange, so every rank learns it
        // (none is left waiting for a rank that gave up alone).
        let mine = if comm.size() != group.size() || comm.rank() != group.rank() {
            format!(
                "err the NCCL communicator is rank {} of {}, the group rank {} of {}",
                comm.rank(),
                comm.size(),
                group.rank(),
                group.size()
            )
        } else {
            match comm.window_api() {
                Ok(()) => format!("ok {:016x}", rand::random::<u64>()),
                Err(e) => format!("err {e}"),
            }
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
            queued: vec![0; n],
            announced: vec![0; n],
            sent: vec![0; n],
            waited_total: vec![0; n],
            waited: vec![0; n],
            broken: None,
            orphans: Vec::new(),
        })
    }

    /// Changes how long [`wait_signal`](Self::wait_signal) waits for a
    /// peer's signal total (and `deregister` and the drop for the device).
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// The library, as "NCCL (libnccl.so.2) 2.30.7".
    pub fn library(&self) -> String {
        self.comm.library()
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

    /// Registers `mem` as this rank's buffer of a new window (collective
    /// over the group given to [`new`](Self::new): every rank registers, in
    /// the same order, a buffer of the same size). Before NCCL is called,
    /// every rank learns every rank's size, memory kind, alignment, whether
    /// the memory is in a window already and whether its `NcclRma` is
    /// broken, and all refuse together (naming the rank) if any is wrong;
    /// after it, whether every rank got a window. The memory stays
    /// allocated while registered.
    pub fn register(&mut self, group: &Group, mem: Arc<DeviceMemory>) -> Result<WindowId> {
        const OP: &str = "register";
        self.check_group(OP, group)?;
        let (base, end) = (mem.ptr(), mem.ptr() + mem.len() as u64);
        let fresh = !self.windows.iter().flatten().any(|w| {
            let (b, e) = (w.win.ptr(), w.win.ptr() + w.len() as u64);
            base < e && b < end
        });
        let mine = format!(
            "{} {} {} {} {}",
            mem.len(),
            u8::from(mem.is_vmm()),
            u8::from(mem.ptr().is_multiple_of(ALIGN)),
            u8::from(fresh),
            u8::from(self.broken.is_none())
        );
        let all = group.exchange("nccl_rma_register", mine.as_bytes())?;
        let mut len = None;
        for (r, v) in all.iter().enumerate() {
            let text = String::from_utf8_lossy(v);
            let f: Vec<&str> = text.split(' ').collect();
            let Some(n) = f.first().and_then(|n| n.parse::<usize>().ok()).filter(|_| f.len() == 5) else {
                return Err(Error::Protocol(format!("register: rank {r}'s NCCL window description is malformed")));
            };
            let refuse = |reason: String| Err(Error::PeerFailed { op: OP, peer: r, reason });
            if f[1] != "1" {
                return refuse(
                    "its buffer is not cuMem/VMM memory, which NCCL windows need (ncclMemAlloc, \
                     Context::alloc_vmm)"
                        .into(),
                );
            }
            if f[2] != "1" {
                return refuse(format!("its buffer is not {ALIGN}-byte aligned (NCCL_WIN_REQUIRED_ALIGNMENT)"));
            }
            if f[3] != "1" {
                return refuse("its buffer overlaps one of its windows already (NCCL registers a buffer once)".into());
            }
            if f[4] != "1" {
                return refuse("an earlier NCCL call of its NcclRma failed".into());
            }
            match len {
                None => len = Some(n),
                Some(l) if l != n => {
                    return Err(Error::Mismatch {
                        op: "register (NCCL window)".into(),
                        detail: format!("rank 0's buffer is {l} bytes, rank {r}'s {n}: NCCL windows are one size here"),
                    })
                }
                Some(_) => {}
            }
        }
        #[allow(unsafe_code)]
        // SAFETY: `mem` is kept (in `Registered`) until deregistration and
        // is in no other window (checked above).
        let got = unsafe { self.comm.window_register(&mem) };
        let blob = match &got {
            Ok(_) => "ok".to_string(),
            Err(e) => format!("err {e}"),
        };
        let all = group.exchange("nccl_rma_registered", blob.as_bytes());
        let win = match (got, all) {
            (Ok(win), Ok(all)) => {
                let bad = all
                    .iter()
                    .enumerate()
                    .find_map(|(r, v)| String::from_utf8_lossy(v).strip_prefix("err ").map(|why| (r, why.to_string())));
                if let Some((peer, reason)) = bad {
                    #[allow(unsafe_code)]
                    // SAFETY: just registered; nothing was queued on it.
                    let _ = unsafe { self.comm.window_deregister(win) };
                    return Err(Error::PeerFailed { op: OP, peer, reason });
                }
                win
            }
            (Ok(win), Err(e)) => {
                #[allow(unsafe_code)]
                // SAFETY: as above.
                let _ = unsafe { self.comm.window_deregister(win) };
                return Err(e);
            }
            (Err(e), _) => {
                if matches!(e, rmacomm_cuda::CudaError::Timeout { .. }) {
                    self.orphans.push(mem);
                }
                return Err(Error::Cuda { op: "register (ncclCommWindowRegister)", source: e });
            }
        };
        self.windows.push(Some(Registered { win, mem }));
        Ok(WindowId(self.windows.len() - 1))
    }

    fn window(&self, op: &'static str, id: WindowId) -> Result<&Registered> {
        self.windows
            .get(id.0)
            .and_then(Option::as_ref)
            .ok_or_else(|| Error::invalid(op, format!("window {} is not registered here", id.0)))
    }

    /// Deregisters a window (collective over the group, so that no rank's
    /// queued put still uses it): every rank waits for its device's work,
    /// then for every other rank, then deregisters. Device work not done
    /// within the timeout (a wait for a signal of a peer that died) fails
    /// it with [`Error::Timeout`], the window still registered (dropping
    /// the `NcclRma` then aborts the communicator).
    pub fn deregister(&mut self, group: &Group, id: WindowId) -> Result<()> {
        const OP: &str = "deregister";
        self.check_group(OP, group)?;
        let ctx = self.window(OP, id)?.mem.context().clone();
        let after = self.timeout;
        match ctx.synchronize_within(after) {
            Some(r) => r.map_err(|e| Error::Cuda { op: "deregister (cuCtxSynchronize)", source: e })?,
            None => {
                return Err(Error::Timeout {
                    waiting_for: format!(
                        "deregister: rank {}'s device work (queued NCCL puts, signals and waits) to finish \
                         (the NcclRma's timeout: set_timeout)",
                        self.rank
                    ),
                    after,
                })
            }
        }
        group.barrier(None)?;
        let r = self.windows[id.0].take().expect("checked");
        #[allow(unsafe_code)]
        // SAFETY: every rank's device work is done (synchronized before
        // the barrier): nothing queued uses the window.
        let done = unsafe { self.comm.window_deregister(r.win) };
        done.map_err(|e| Error::Cuda { op: "deregister (ncclCommWindowDeregister)", source: e })
    }

    fn peer(&self, op: &'static str, peer: usize) -> Result<()> {
        if peer >= self.size {
            return Err(Error::invalid(op, format!("rank {peer} is not below the communicator's size {}", self.size)));
        }
        Ok(())
    }

    /// Room for one more NCCL signal to `dst` before the next published
    /// total (a wait counts them in a C int).
    fn room(&self, op: &'static str, dst: usize) -> Result<()> {
        if self.queued[dst] - self.announced[dst] >= MAX_COUNT - 1 {
            return Err(Error::invalid(op, format!("too many puts to rank {dst} without a signal: signal it first")));
        }
        Ok(())
    }

    /// Puts `len` bytes at byte `src_offset` of this rank's buffer of
    /// window `src` (NCCL puts from registered memory only) into `dst`'s
    /// buffer of window `target` at byte `offset`, queued on `stream`.
    /// Nothing is queued on an error. The source bytes are read when the
    /// stream runs the put: leave them unchanged until then (windows stay
    /// registered until then: [`deregister`](Self::deregister) waits).
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
        if src_offset.checked_add(len).is_none_or(|end| end > source.len()) {
            return Err(Error::invalid(
                OP,
                format!(
                    "the source, {len} bytes at offset {src_offset}, is past this rank's {}-byte buffer of window {}",
                    source.len(),
                    src.0
                ),
            ));
        }
        let from = source.win.ptr() + src_offset as u64;
        // Every rank's buffer of a window is this size (`register`).
        let cap = self.window(OP, target)?.len();
        if offset.checked_add(len).is_none_or(|end| end > cap) {
            return Err(Error::Bounds {
                op: OP,
                peer: dst,
                reason: format!("{len} bytes at offset {offset} of its {cap}-byte buffer of window {}", target.0),
            });
        }
        self.room(OP, dst)?;
        let win = &self.windows[target.0].as_ref().expect("checked").win;
        #[allow(unsafe_code)]
        // SAFETY: the source lies in this rank's registered window and the
        // target range in the peer's (every rank's buffer is `cap` bytes),
        // both checked above; both stay registered until the stream ran it
        // (`deregister` and `Drop` wait for the device first).
        let r = unsafe { self.comm.put_signal(from, len, dst, win, offset, stream) };
        r.map_err(|e| self.failed("put (ncclPutSignal)", e))?;
        self.queued[dst] += 1;
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
        self.room(OP, dst)?;
        let r = self.comm.signal(dst, stream);
        r.map_err(|e| self.failed("signal (ncclSignal)", e))?;
        self.queued[dst] += 1;
        // The running total: a write the store took but reported failed,
        // or one repeated, only leaves a stale key behind (the peer counts
        // from totals, not from the values' sum).
        let key = self.key(self.rank, dst, self.sent[dst]);
        self.store.set(&key, self.queued[dst].to_string().as_bytes())?;
        self.sent[dst] += 1;
        self.announced[dst] = self.queued[dst];
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
        let done = self.waited_total[src];
        let total = String::from_utf8_lossy(&raw)
            .parse::<u64>()
            .ok()
            .filter(|t| *t > done && t - done <= MAX_COUNT)
            .ok_or_else(|| Error::Protocol(format!("wait_signal: rank {src}'s signal total is malformed")))?;
        let r = self.comm.wait_signal(src, (total - done) as u32, stream);
        r.map_err(|e| self.failed("wait_signal (ncclWaitSignal)", e))?;
        self.waited_total[src] = total;
        self.waited[src] += 1;
        // The wait is queued: a key left behind costs store memory only.
        if let Err(e) = self.store.delete(&key) {
            tracing::warn!("NCCL window: could not delete {key} from the store: {e}");
        }
        Ok(())
    }
}

impl Drop for NcclRma {
    /// Nothing queued may still use a window when it goes, and nothing may
    /// wait without a limit: the device's work gets the timeout, then the
    /// windows are deregistered (and the communicator ended, by its own
    /// drop). Work still queued then — a wait for a signal that never
    /// comes, from a peer that died — is cut short: the communicator is
    /// aborted (NCCL's device work exits; its windows go with it) and the
    /// device's work waited for once more; what still runs after that (a
    /// stream waiting on something else) keeps the windows' memory, leaked
    /// rather than freed under it. Both are said on stderr, as the
    /// communicator's own abort is.
    fn drop(&mut self) {
        let mems = self.windows.iter().flatten().map(|w| &w.mem).chain(&self.orphans);
        let Some(ctx) = mems.map(|m| m.context().clone()).next() else { return };
        let after = self.timeout;
        if ctx.synchronize_within(after).is_some() {
            for r in self.windows.drain(..).flatten() {
                #[allow(unsafe_code)]
                // SAFETY: the device's work is done (above).
                let _ = unsafe { self.comm.window_deregister(r.win) };
            }
            return;
        }
        let (rank, size) = (self.rank, self.size);
        eprintln!(
            "rmacomm: dropping the NCCL windows (rank {rank} of {size}): device work still queued after {after:?} \
             (a wait for a peer's signal that never came?): aborting the NCCL communicator"
        );
        self.comm.abort_in_place();
        if ctx.synchronize_within(after).is_none() {
            eprintln!(
                "rmacomm: dropping the NCCL windows (rank {rank} of {size}): device work still queued {after:?} after \
                 the abort: the windows' memory is leaked, not freed while the device may use it"
            );
            for r in self.windows.drain(..).flatten() {
                std::mem::forget(r.mem);
            }
            for m in self.orphans.drain(..) {
                std::mem::forget(m);
            }
        }
    }
}
