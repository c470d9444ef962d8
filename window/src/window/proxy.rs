//! Stream-ordered operations with peers the device does not reach itself
//! (issue 13): a peer on another host, or any peer of a window whose
//! device memory went through the transport (`Window::alloc_cuda` /
//! `register_cuda` registered with `tensor_register`).
//!
//! Such an operation is run by the window's *stream proxy*, a host thread,
//! at the point of the CUDA stream where it was queued, as NCCL's proxy
//! runs network operations:
//!
//! 1. the stream writes the operation's sequence number into its *ready*
//!    word (`cuStreamWriteValue64`, after a system-wide fence: everything
//!    queued before on the stream has run and is visible);
//! 2. the proxy sees it and runs the operation on the host — a put is an
//!    RDMA WRITE of the device memory, a get an RDMA READ, a signal the
//!    window's signal, a wait takes the peer's next signal;
//! 3. then it writes the sequence number into the operation's *done* word,
//!    which the stream waits for (`cuStreamWaitValue64 ≥`) after a put, a
//!    get or a wait: work queued after them runs once the data is placed
//!    (put), has landed (get), or the peer's data has (wait). A signal does
//!    not hold the stream.
//!
//! The words are 2 × [`RING`] 64-bit words of host memory registered with
//! the device, an operation's pair chosen by its sequence number, so at
//! most `RING` operations are outstanding (the issuing call waits for room,
//! up to the window's timeout). A failed operation (a timeout, a peer gone)
//! still writes its done word — the stream is never left waiting on the
//! proxy — and its error is kept: [`Window::stream_error`] returns it, and
//! every later stream operation of the window — issued later, or queued
//! before and reached after — fails with [`Error::StreamFailed`] instead of
//! running (a signal behind a failed put would tell the peer that data is
//! there which never came; like NCCL's asynchronous errors, the window is
//! done for). The words are never freed: the device may read them after the
//! window is gone (a stream that has not yet reached its wait). A window
//! that goes with nothing outstanding hands them, with their state, to the
//! next window's proxy on the device (sequence numbers go on from there, so
//! no stale word is mistaken for a new one); a process holds as many blocks
//! of 16 KiB as it had proxies alive at once.
//!
//! A wait for a peer on another host takes the peer's next signal when the
//! stream reaches it (one for a same-host peer claims its number when
//! issued): host and stream waits from one peer must not be in flight at
//! once, as on the IPC path. Memory a proxied put or get held is let go on
//! `rmacomm_cuda::reaper`'s thread: its last reference may free device
//! memory, which may wait for the device, and the runtime thread that ran
//! the operation is one a stream may be waiting for.
//!
//! The host issues; it does not wait for the stream: `put_on_stream`
//! returns at once with a [`Work`] that completes when the proxy has run
//! the operation. Operations run in each stream's order; operations of
//! different streams are independent (the proxy runs whichever the device
//! reaches, so one stream's wait never holds up another's put).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rmacomm_cuda::device::Stream;
use rmacomm_cuda::driver::Context;
use rmacomm_transport::{RdmaMemory, RdmaTransport, TransportError};
use tokio::sync::oneshot;

use super::device::PinnedWords;
use super::Window;
use crate::error::{Error, Result};
use crate::unified::{Slot, SLOT};
use crate::work::Work;

/// Operations outstanding at most (ready and done words each).
pub(super) const RING: usize = 1024;

/// How long the proxy sleeps between looks once nothing moved for the
/// window's spin time.
const NAP: Duration = Duration::from_micros(50);

type RmaFuture = Pin<Box<dyn Future<Output = std::result::Result<(), TransportError>> + Send>>;

/// What the proxy runs once the stream reaches it.
enum Job {
    /// A transport operation, started (posted) only then: its data is
    /// ready only then. The memory it moves is kept here, to be dropped on
    /// the reaper's thread once the operation is done (the last reference
    /// may free device memory, which may wait for the device: a runtime
    /// thread that did so would never run the operation a stream waits
    /// for).
    Rma(Box<dyn FnOnce() -> RmaFuture + Send>, Option<Arc<RdmaMemory>>),
    /// A signal to a UNIFIED peer: one more in this rank's slot there (the
    /// slot's address, in a mapping that outlives the proxy).
    AddSlot(usize),
    /// A wait for a UNIFIED peer's signal: its slot here reaching `want`
    /// (claimed when the wait was issued, so waits take signals in the
    /// order they were issued).
    WaitSlot { slot: usize, want: u64, link: Arc<RdmaTransport> },
    /// Nothing (an operation whose stream wait could not be queued: its
    /// ready word still comes, and is taken).
    Skip,
}

/// The one slot of `RING` an operation uses.
fn index(seq: u64) -> usize {
    (seq % RING as u64) as usize
}

/// A slot of the window's signal buffers at `addr`.
///
/// # Safety
/// `addr` is the start of a 16-byte signal slot in memory mapped while
/// the returned slot is used.
unsafe fn slot_at<'a>(addr: usize) -> Slot<'a> {
    // SAFETY: the caller's contract; slots are 16-byte aligned, their
    // words 8- and 4-byte aligned.
    let u64_at = |o: usize| Ok::<_, ()>(unsafe { AtomicU64::from_ptr((addr + o) as *mut u64) });
    // SAFETY: as above.
    let u32_at = |o: usize| Ok::<_, ()>(unsafe { AtomicU32::from_ptr((addr + o) as *mut u32) });
    Slot::at(0, u64_at, u32_at).expect("infallible")
}

struct Queue {
    /// Issued, not yet seen by the proxy thread.
    new: Vec<Pending>,
    shutdown: bool,
    /// Issued and not finished.
    outstanding: usize,
    /// Per slot: free, taken by an outstanding operation, or given up
    /// before its stream wrote the ready word (that write may still come:
    /// never used again). Operations of different streams finish in any
    /// order, so the next free slot is looked for.
    slots: Vec<SlotState>,
    /// Slots given up.
    poisoned: usize,
    /// The last sequence number given out.
    next: u64,
    /// The first failure: every later operation fails with it.
    failed: Option<Error>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum SlotState {
    Free,
    Taken,
    Poisoned,
}

struct Shared {
    q: Mutex<Queue>,
    cv: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        self.q.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// One operation's completion: its done word is written and its result
/// sent when it drops, whatever happened (finished, failed, cancelled by
/// the runtime's or the proxy's end).
struct Guard {
    shared: Arc<Shared>,
    words: &'static PinnedWords,
    seq: u64,
    op: &'static str,
    peer: usize,
    /// The stream wrote the ready word.
    reached: bool,
    tx: Option<oneshot::Sender<Result<()>>>,
    /// The stream may wait for this operation: nothing may wait for the
    /// device on the reaper's thread meanwhile (`rmacomm_cuda::reaper`);
    /// released after the done word is written.
    _host: rmacomm_cuda::reaper::HostWait,
}

impl Guard {
    fn finish(mut self, r: Result<()>) {
        let tx = self.tx.take();
        if let Err(e) = &r {
            let mut q = self.shared.lock();
            q.failed.get_or_insert_with(|| e.clone());
        }
        drop(self);
        if let Some(tx) = tx {
            let _ = tx.send(r);
        }
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        let i = index(self.seq);
        self.words.word(RING + i).fetch_max(self.seq, Ordering::AcqRel);
        if let Some(tx) = self.tx.take() {
            let _ = tx.send(Err(Error::Rma {
                op: self.op,
                peer: self.peer,
                source: TransportError::Aborted { op: self.op },
            }));
        }
        let mut q = self.shared.lock();
        q.outstanding -= 1;
        if self.reached {
            q.slots[i] = SlotState::Free;
        } else {
            q.slots[i] = SlotState::Poisoned;
            q.poisoned += 1;
        }
        drop(q);
        self.shared.cv.notify_all();
    }
}

struct Pending {
    guard: Guard,
    job: Job,
    /// For a slot wait: when it gives up.
    deadline: Option<Instant>,
}

/// The proxy of one window (module docs).
pub(super) struct StreamProxy {
    ctx: Arc<Context>,
    words: &'static PinnedWords,
    shared: Arc<Shared>,
    timeout: Duration,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for StreamProxy {
    fn drop(&mut self) {
        self.shared.lock().shutdown = true;
        self.shared.cv.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        // With nothing outstanding (no operation still running on the
        // runtime; a second is given to those that are) the words go back
        // to the pool with their state: the
        // next window's sequence numbers continue from here, so no word
        // written for an operation of this window (a ready word a stream
        // has yet to write: its slot is poisoned; a done word a stream has
        // yet to read: it holds an older number) can be taken for one of
        // the next. Otherwise they stay leaked.
        let mut q = self.shared.lock();
        let deadline = Instant::now() + Duration::from_secs(1);
        while q.outstanding > 0 {
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            q = self.shared.cv.wait_timeout(q, deadline - now).unwrap_or_else(|e| e.into_inner()).0;
        }
        if q.outstanding == 0 {
            let block = Block { words: self.words, next: q.next, slots: q.slots.clone(), poisoned: q.poisoned };
            drop(q);
            pool().push((self.ctx.ordinal(), block));
        }
    }
}

/// A proxy's words and the state that goes with them (module docs).
struct Block {
    words: &'static PinnedWords,
    next: u64,
    slots: Vec<SlotState>,
    poisoned: usize,
}

/// Words of proxies that are gone, per device, for the next ones.
fn pool() -> MutexGuard<'static, Vec<(i32, Block)>> {
    static POOL: Mutex<Vec<(i32, Block)>> = Mutex::new(Vec::new());
    POOL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Blocks of proxy words made so far in this process (each 2 × [`RING`]
/// words of registered host memory; reused, never freed).
static BLOCKS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// How many blocks of stream-proxy words this process has made: windows
/// that are gone hand theirs to later ones (for tests and diagnostics).
pub fn stream_proxy_blocks() -> usize {
    BLOCKS.load(Ordering::Relaxed)
}

impl StreamProxy {
    fn new(
        ctx: Arc<Context>,
        rt: tokio::runtime::Handle,
        timeout: Duration,
        spin: Duration,
    ) -> std::result::Result<StreamProxy, String> {
        let reused = {
            let mut p = pool();
            let i = p.iter().position(|(ord, b)| *ord == ctx.ordinal() && b.poisoned < RING / 2);
            i.map(|i| p.swap_remove(i).1)
        };
        let block = match reused {
            Some(b) => b,
            None => {
                let words: &'static PinnedWords = Box::leak(Box::new(PinnedWords::new(&ctx, 2 * RING)?));
                BLOCKS.fetch_add(1, Ordering::Relaxed);
                Block { words, next: 0, slots: vec![SlotState::Free; RING], poisoned: 0 }
            }
        };
        let words = block.words;
        let shared = Arc::new(Shared {
            q: Mutex::new(Queue {
                new: Vec::new(),
                shutdown: false,
                outstanding: 0,
                slots: block.slots,
                poisoned: block.poisoned,
                next: block.next,
                failed: None,
            }),
            cv: Condvar::new(),
        });
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name("rmacomm-stream-proxy".into())
            .spawn(move || {
                let run = std::panic::AssertUnwindSafe(|| run(s.clone(), words, rt, timeout, spin));
                if std::panic::catch_unwind(run).is_err() {
                    // Never leave a stream waiting: what was issued is
                    // released (the guards write the done words), and what
                    // comes later is refused.
                    let mut q = s.lock();
                    q.shutdown = true;
                    q.failed.get_or_insert_with(|| Error::Protocol("the window's stream proxy thread panicked".into()));
                    let orphans = std::mem::take(&mut q.new);
                    drop(q);
                    drop(orphans);
                }
            })
            .map_err(|e| format!("starting the stream proxy thread: {e}"))?;
        Ok(StreamProxy { ctx, words, shared, timeout, thread: Some(thread) })
    }

    /// Operations issued and not finished.
    pub(super) fn outstanding(&self) -> usize {
        self.shared.lock().outstanding
    }

    fn failed(&self) -> Option<Error> {
        self.shared.lock().failed.clone()
    }

    /// Queues `job` at this point of `stream` (and, with `hold`, the
    /// stream's wait for it); its result comes on the receiver.
    fn issue(
        &self,
        op: &'static str,
        peer: usize,
        stream: &Stream,
        job: Job,
        hold: bool,
    ) -> Result<oneshot::Receiver<Result<()>>> {
        // Before the stream can wait for this operation (outside the
        // queue's lock: it waits while the reaper is dropping something).
        let host = rmacomm_cuda::reaper::host_wait_until(ibverbx::deadline_after(self.timeout)).map_err(|why| {
            Error::Timeout { waiting_for: format!("{op} with rank {peer}: {why}"), after: self.timeout }
        })?;
        let seq = {
            let mut q = self.shared.lock();
            if let Some(e) = &q.failed {
                return Err(Error::StreamFailed { op, peer, earlier: Box::new(e.clone()) });
            }
            if q.shutdown {
                return Err(unsupported(op, "the window's stream proxy has stopped"));
            }
            let deadline = ibverbx::deadline_after(self.timeout);
            while q.outstanding + q.poisoned >= RING {
                let now = Instant::now();
                if now >= deadline || q.poisoned >= RING {
                    return Err(Error::Timeout {
                        waiting_for: format!(
                            "{op}: room among the {RING} stream operations the window keeps outstanding \
                             (synchronize the streams that carry them)"
                        ),
                        after: self.timeout,
                    });
                }
                q = self.shared.cv.wait_timeout(q, deadline - now).unwrap_or_else(|e| e.into_inner()).0;
            }
            // A free slot exists (counted above); its words only grow, as
            // the sequence numbers do.
            loop {
                q.next += 1;
                if q.slots[index(q.next)] == SlotState::Free {
                    break;
                }
            }
            let i = index(q.next);
            q.slots[i] = SlotState::Taken;
            q.outstanding += 1;
            q.next
        };
        let (tx, rx) = oneshot::channel();
        let mut guard = Guard {
            shared: self.shared.clone(),
            words: self.words,
            seq,
            op,
            peer,
            reached: false,
            tx: None,
            _host: host,
        };
        let i = index(seq);
        // SAFETY: a word of registered host memory that is never freed.
        if let Err(e) = unsafe { stream.write_value64(self.words.device_ptr(i), seq) } {
            // Nothing will write the ready word: the slot stays usable.
            guard.reached = true;
            return Err(Error::Cuda { op, source: e });
        }
        let mut job = job;
        let mut result = Ok(rx);
        if hold {
            // SAFETY: as above.
            if let Err(e) = unsafe { stream.wait_value64_geq(self.words.device_ptr(RING + i), seq) } {
                // The ready word comes: the proxy takes it and does nothing.
                job = Job::Skip;
                result = Err(Error::Cuda { op, source: e });
            }
        }
        if result.is_ok() {
            guard.tx = Some(tx);
        }
        let mut q = self.shared.lock();
        if q.shutdown {
            // The proxy thread is gone: released here (its guard writes
            // the done word), never queued where nobody takes it.
            drop(q);
            drop(Pending { guard, job, deadline: None });
            return Err(unsupported(op, "the window's stream proxy has stopped"));
        }
        q.new.push(Pending { guard, job, deadline: None });
        drop(q);
        self.shared.cv.notify_all();
        result
    }
}

/// The proxy thread: runs each operation once its stream has reached it.
fn run(
    shared: Arc<Shared>,
    words: &'static PinnedWords,
    rt: tokio::runtime::Handle,
    timeout: Duration,
    spin: Duration,
) {
    let mut active: Vec<Pending> = Vec::new();
    let mut moved = Instant::now();
    loop {
        {
            let mut q = shared.lock();
            active.append(&mut q.new);
            if q.shutdown {
                drop(q);
                // Their guards write the done words (and say aborted).
                drop(active);
                return;
            }
            if active.is_empty() {
                drop(shared.cv.wait_timeout(q, Duration::from_millis(100)).unwrap_or_else(|e| e.into_inner()));
                moved = Instant::now();
                continue;
            }
        }
        let now = Instant::now();
        for mut p in std::mem::take(&mut active) {
            if !p.guard.reached {
                if words.word(index(p.guard.seq)).load(Ordering::Acquire) < p.guard.seq {
                    active.push(p);
                    continue;
                }
                p.guard.reached = true;
                moved = now;
            }
            let Pending { guard, job, deadline } = p;
            let (op, peer) = (guard.op, guard.peer);
            // Reached after an earlier operation failed: not run (a signal
            // would tell the peer that data is there which never came).
            let failed = shared.lock().failed.clone();
            if let Some(e) = failed {
                guard.finish(Err(Error::StreamFailed { op, peer, earlier: Box::new(e) }));
                continue;
            }
            match job {
                Job::Rma(start, keep) => {
                    rt.spawn(async move {
                        let r = start().await;
                        guard.finish(r.map_err(|source| Error::Rma { op, peer, source }));
                        // Only the last reference may free anything.
                        if let Some(mem) = keep.and_then(Arc::into_inner) {
                            rmacomm_cuda::reaper::defer(mem);
                        }
                    });
                }
                Job::AddSlot(at) => {
                    // SAFETY: a slot of a peer's signal buffer, mapped while
                    // the window lives, which outlives this thread.
                    unsafe { slot_at(at) }.add(1);
                    guard.finish(Ok(()));
                }
                Job::WaitSlot { slot, want, link } => {
                    // SAFETY: a slot of this rank's signal buffer (as above).
                    let s = unsafe { slot_at(slot) };
                    if s.value.load(Ordering::Acquire) >= want {
                        moved = now;
                        guard.finish(Ok(()));
                    } else if let Some(e) = link.error() {
                        guard.finish(Err(Error::Rma { op, peer, source: e }));
                    } else if deadline.is_some_and(|d| now >= d) {
                        guard.finish(Err(Error::Rma {
                            op,
                            peer,
                            source: TransportError::Timeout { op, after: timeout },
                        }));
                    } else {
                        let deadline = deadline.or(now.checked_add(timeout));
                        active.push(Pending { guard, job: Job::WaitSlot { slot, want, link }, deadline });
                    }
                }
                Job::Skip => guard.finish(Ok(())),
            }
        }
        if active.is_empty() {
            continue;
        }
        if now.duration_since(moved) < spin {
            std::thread::yield_now();
        } else {
            std::thread::sleep(NAP);
        }
    }
}

fn unsupported(op: &'static str, reason: impl Into<String>) -> Error {
    Error::Unsupported { op, reason: reason.into() }
}

impl Window {
    /// The stream proxy for `stream`'s device (started on first use), or
    /// `None` where the device has no 64-bit stream memory operations (the
    /// caller then synchronizes the stream and runs the operation on the
    /// host, which orders it no less).
    fn stream_proxy(&self, op: &'static str, stream: &Stream) -> Result<Option<Arc<StreamProxy>>> {
        if stream.is_capturing().map_err(|source| Error::Cuda { op, source })? {
            return Err(unsupported(
                op,
                "a stream operation with a peer the device does not reach (another host, or memory registered \
                 through the transport) runs on the window's proxy thread, which a CUDA graph replay would not \
                 run again; capture only windows of same-host device tensors (tensor_register_device)",
            ));
        }
        let ctx = stream.context();
        if !ctx.stream_mem_ops().map_err(|source| Error::Cuda { op, source })? {
            return Ok(None);
        }
        let mut slot = self.proxy.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = slot.as_ref() {
            if p.ctx.ordinal() != ctx.ordinal() {
                return Err(Error::invalid(
                    op,
                    format!(
                        "the stream is on GPU {}, but this window's stream operations run on GPU {}",
                        ctx.ordinal(),
                        p.ctx.ordinal()
                    ),
                ));
            }
            return Ok(Some(p.clone()));
        }
        let p = StreamProxy::new(ctx.clone(), self.rt.handle().clone(), self.timeout, self.spin)
            .map_err(|why| unsupported(op, format!("starting the stream proxy: {why}")))?;
        let p = Arc::new(p);
        *slot = Some(p.clone());
        Ok(Some(p))
    }

    /// The first failure of a stream operation run by the window's proxy
    /// (module docs of `proxy`): once there is one, every later stream
    /// operation with a peer the device does not reach fails with it.
    pub fn stream_error(&self) -> Option<Error> {
        self.proxy.lock().unwrap_or_else(|e| e.into_inner()).as_ref().and_then(|p| p.failed())
    }

    /// Stream operations issued to the proxy and not finished.
    pub(super) fn proxy_outstanding(&self) -> usize {
        self.proxy.lock().unwrap_or_else(|e| e.into_inner()).as_ref().map_or(0, |p| p.outstanding())
    }

    /// Warns once per process (`tracing`) when a proxied operation's bytes
    /// are device memory the engine copies through the driver (`mem`, or
    /// this rank's tensor, which peers' puts reach through its engine)
    /// while CUDA loads modules lazily (`rmacomm_cuda::lazy_loading_hazard`).
    /// Host memory moves with no driver call: no hazard.
    fn warn_lazy_loading(&self, mem: Option<&RdmaMemory>) {
        static WARNED: std::sync::Once = std::sync::Once::new();
        if WARNED.is_completed() {
            return;
        }
        let device = mem.is_some_and(RdmaMemory::is_device) || self.local_tensor().is_some_and(RdmaMemory::is_device);
        if let (true, Some(hazard)) = (device, rmacomm_cuda::lazy_loading_hazard()) {
            WARNED.call_once(|| tracing::warn!("{hazard}"));
        }
    }

    fn proxied(&self, op: &'static str, peer: usize, rx: oneshot::Receiver<Result<()>>) -> Work<'_> {
        let aborted = move || Err(Error::Rma { op, peer, source: TransportError::Aborted { op } });
        let fut = async move { rx.await.unwrap_or_else(|_| aborted()) };
        Work::new(self.rt.handle().clone(), op, peer, Box::pin(fut))
    }

    /// Writes `len` bytes of `src` at byte `src_offset` (device memory from
    /// [`alloc_cuda`](Self::alloc_cuda) or
    /// [`register_cuda`](Self::register_cuda); host memory works too) into
    /// `dst_rank`'s registered buffer at element `target_offset_nelems`,
    /// in `stream`'s order: after everything queued on `stream` before,
    /// and before anything queued there after (the stream waits until the
    /// data is placed). Returns at once; the [`Work`] completes when the
    /// data is placed, with the error if it could not be. Bounds are
    /// checked first ([`Error::Bounds`], nothing queued).
    ///
    /// This is the put of windows registered through the transport
    /// (`tensor_register`); windows of same-host device tensors
    /// (`tensor_register_device`) use [`device_put`](Self::device_put).
    /// Not capturable in a CUDA graph ([`Error::Unsupported`]). A device
    /// without stream memory operations synchronizes `stream` and puts
    /// from the host (complete when this returns).
    pub fn put_on_stream(
        &self,
        src: Arc<RdmaMemory>,
        src_offset: usize,
        len: usize,
        dst_rank: usize,
        target_offset_nelems: usize,
        stream: &Stream,
    ) -> Result<Work<'_>> {
        const OP: &str = "put_on_stream";
        let remote = self.target(OP, dst_rank, target_offset_nelems, len)?;
        src.view(src_offset, len).map_err(|source| Error::Transport { op: OP, source })?;
        let Some(proxy) = self.stream_proxy(OP, stream)? else {
            stream.synchronize().map_err(|source| Error::Cuda { op: OP, source })?;
            let v = src.view(src_offset, len).map_err(|source| Error::Transport { op: OP, source })?;
            self.put(v, dst_rank, target_offset_nelems, false)?;
            return Ok(Work::done(self.rt.handle().clone(), OP, dst_rank, Ok(())));
        };
        self.warn_lazy_loading(Some(&src));
        let (t, keep) = (self.links[dst_rank].out.clone(), Some(src.clone()));
        let start = move || -> RmaFuture { Box::pin(t.write_owned(src, src_offset, len, &remote, false)) };
        let rx = proxy.issue(OP, dst_rank, stream, Job::Rma(Box::new(start), keep), true)?;
        Ok(self.proxied(OP, dst_rank, rx))
    }

    /// Reads `len` bytes from `src_rank`'s registered buffer at element
    /// `source_offset_nelems` into `dst` at byte `dst_offset`, in
    /// `stream`'s order (after the work queued before; work queued after
    /// sees the data). As [`put_on_stream`](Self::put_on_stream) otherwise.
    pub fn get_on_stream(
        &self,
        dst: Arc<RdmaMemory>,
        dst_offset: usize,
        len: usize,
        src_rank: usize,
        source_offset_nelems: usize,
        stream: &Stream,
    ) -> Result<Work<'_>> {
        const OP: &str = "get_on_stream";
        let remote = self.target(OP, src_rank, source_offset_nelems, len)?;
        dst.view(dst_offset, len).map_err(|source| Error::Transport { op: OP, source })?;
        let Some(proxy) = self.stream_proxy(OP, stream)? else {
            stream.synchronize().map_err(|source| Error::Cuda { op: OP, source })?;
            let v = dst.view_mut(dst_offset, len).map_err(|source| Error::Transport { op: OP, source })?;
            self.get(v, src_rank, source_offset_nelems, false)?;
            return Ok(Work::done(self.rt.handle().clone(), OP, src_rank, Ok(())));
        };
        self.warn_lazy_loading(Some(&dst));
        let (t, keep) = (self.links[src_rank].out.clone(), Some(dst.clone()));
        let start = move || -> RmaFuture { Box::pin(t.read_owned(dst, dst_offset, len, &remote)) };
        let rx = proxy.issue(OP, src_rank, stream, Job::Rma(Box::new(start), keep), true)?;
        Ok(self.proxied(OP, src_rank, rx))
    }

    /// [`signal_on_stream`](Self::signal_on_stream), returning a [`Work`]
    /// that completes once the signal is sent — at once where the device
    /// writes it (a window of same-host device tensors), when the stream
    /// proxy has sent it otherwise — with its error, if any.
    pub fn signal_on_stream_tracked(&self, dst_rank: usize, stream: &Stream) -> Result<Work<'_>> {
        if self.dev.is_none() {
            return self.proxy_signal(dst_rank, stream);
        }
        self.signal_on_stream(dst_rank, stream)?;
        Ok(Work::done(self.rt.handle().clone(), "signal_on_stream", dst_rank, Ok(())))
    }

    /// [`wait_signal_on_stream`](Self::wait_signal_on_stream), returning a
    /// [`Work`] that completes once the stream proxy has taken the signal
    /// (at once where the device waits itself), with its error, if any (a
    /// timeout, a peer gone).
    pub fn wait_signal_on_stream_tracked(&self, peer_rank: usize, stream: &Stream) -> Result<Work<'_>> {
        if self.dev.is_none() {
            return self.proxy_wait(peer_rank, stream);
        }
        self.wait_signal_on_stream(peer_rank, stream)?;
        Ok(Work::done(self.rt.handle().clone(), "wait_signal_on_stream", peer_rank, Ok(())))
    }

    /// `signal_on_stream` without a device registration: the proxy signals
    /// once the stream reaches it (after the puts queued there before have
    /// been placed: the stream waited for them).
    pub(super) fn proxy_signal(&self, dst_rank: usize, stream: &Stream) -> Result<Work<'_>> {
        const OP: &str = "signal_on_stream";
        self.check_rank(OP, dst_rank)?;
        self.not_released(OP, dst_rank)?;
        let Some(proxy) = self.stream_proxy(OP, stream)? else {
            stream.synchronize().map_err(|source| Error::Cuda { op: OP, source })?;
            self.signal(dst_rank, false)?;
            return Ok(Work::done(self.rt.handle().clone(), OP, dst_rank, Ok(())));
        };
        self.warn_lazy_loading(None);
        self.peer_alive(dst_rank).map_err(|source| Error::Rma { op: OP, peer: dst_rank, source })?;
        let job = match &self.signal_maps[dst_rank] {
            Some(m) => Job::AddSlot(m.as_ptr() as usize + SLOT * self.rank()),
            None => {
                let (t, src, slot) =
                    (self.links[dst_rank].out.clone(), self.signal_src.clone(), self.signal_slots[dst_rank]);
                let in_order = self.in_order;
                // As `signal`: with one QP per connection the notifying
                // write is placed after everything before it; else a
                // write without notification, completed first, fences.
                let start = move || -> RmaFuture {
                    Box::pin(async move {
                        if !in_order {
                            t.write_owned(src.clone(), 0, 8, &slot, false).await?;
                        }
                        t.write_owned(src, 0, 8, &slot, true).await
                    })
                };
                Job::Rma(Box::new(start), None)
            }
        };
        let rx = proxy.issue(OP, dst_rank, stream, job, false)?;
        self.sent[dst_rank].fetch_add(1, Ordering::AcqRel);
        Ok(self.proxied(OP, dst_rank, rx))
    }

    /// `wait_signal_on_stream` without a device registration: the stream
    /// waits until the proxy has taken the peer's next signal.
    pub(super) fn proxy_wait(&self, peer_rank: usize, stream: &Stream) -> Result<Work<'_>> {
        const OP: &str = "wait_signal_on_stream";
        self.check_rank(OP, peer_rank)?;
        // A released slot holds no signal (`release` module).
        self.not_released(OP, peer_rank)?;
        let Some(proxy) = self.stream_proxy(OP, stream)? else {
            stream.synchronize().map_err(|source| Error::Cuda { op: OP, source })?;
            self.wait_signal(peer_rank, None)?;
            return Ok(Work::done(self.rt.handle().clone(), OP, peer_rank, Ok(())));
        };
        self.warn_lazy_loading(None);
        let link = self.links[peer_rank].inbound.clone();
        if self.signal_maps[peer_rank].is_some() {
            let want = self.consumed[peer_rank].fetch_add(1, Ordering::AcqRel) + 1;
            let slot = self.signal_dst.as_ptr() as usize + SLOT * peer_rank;
            return match proxy.issue(OP, peer_rank, stream, Job::WaitSlot { slot, want, link }, true) {
                Ok(rx) => Ok(self.proxied(OP, peer_rank, rx)),
                Err(e) => {
                    self.consumed[peer_rank].fetch_sub(1, Ordering::AcqRel);
                    Err(e)
                }
            };
        }
        let start = move || -> RmaFuture { Box::pin(link.wait_for_write()) };
        let rx = proxy.issue(OP, peer_rank, stream, Job::Rma(Box::new(start), None), true)?;
        Ok(self.proxied(OP, peer_rank, rx))
    }
}
