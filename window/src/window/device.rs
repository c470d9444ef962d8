//! Windows on CUDA device memory (issue 13): every rank registers device
//! memory, same-host peers map each other's through CUDA IPC, and puts and
//! gets are device-to-device copies by the copy engine — on the window's
//! own stream (complete when the call returns), or queued on the caller's
//! stream. Signals stay the window's: host-ordered ([`Window::signal`]
//! after a synchronous put), or stream-ordered
//! ([`Window::signal_on_stream`] / [`Window::wait_signal_on_stream`]:
//! `cuStreamWriteValue64` / `cuStreamWaitValue64` on the same 64-bit slots
//! of host shared memory, registered with the device).
//!
//! A CUDA graph fixes a stream memory operation's value when it is
//! captured, so a replay would write the same count again and wait for the
//! same one. A stream signal or wait issued while its stream is capturing
//! therefore switches the window to *kernel signals*, for good: a signal is
//! `rmacomm_signal_next` (one more in the peer's slot, counted there), a
//! wait `rmacomm_wait_next` (the signals taken from each peer are counted
//! in host memory registered with the device), so every replay signals and
//! waits once more. The same kernels are what a device without stream
//! memory operations gets from the start. From then on host
//! `wait_signal`s count in the same registered words (host and stream
//! waits from one peer must not be in flight at once, as host and stream
//! signals to one peer must not), and host `signal`s still add one to the
//! peer's slot.
//!
//! Peers on other hosts are not reached by these (IPC) registrations:
//! registering fails there with an error naming the peer. Device memory
//! from [`Window::alloc_cuda`], registered with `tensor_register`, reaches
//! every peer through the transport instead (staged through pinned host
//! chunks by the soft provider, DMA-BUF on a verbs device); its
//! stream-ordered operations ([`Window::put_on_stream`],
//! [`Window::get_on_stream`], and `signal_on_stream` /
//! `wait_signal_on_stream` whenever no device tensor is registered) are run
//! by the window's stream proxy (module `proxy`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use rmacomm_cuda::device::{DeviceMemory, DeviceView, HostRegistration, IpcMapping, SharedModule, Stream};
use rmacomm_cuda::driver::{Arg, Context, DevicePtr};
use rmacomm_cuda::vmm::Export;

use super::Window;
use crate::error::{Error, Result};
use crate::unified::SLOT;
use rmacomm_transport::RdmaMemory;

/// A peer's allocation opened here, shared with views that outlive the
/// registration; `None` for memory of this process.
type Mapping = Option<Arc<IpcMapping>>;

/// The memory a device registration holds.
#[derive(Debug)]
enum Tensor {
    /// Given to the window; given back by `tensor_deregister_device`.
    Owned(DeviceMemory),
    /// The caller's (a PyTorch tensor): only its address and length.
    Borrowed,
}

/// Every rank's registered device memory, as this rank reaches it.
pub(super) struct DeviceRegistration {
    tensor: Tensor,
    ctx: Arc<Context>,
    /// Per rank: its registered bytes and element size.
    peers: Vec<(usize, usize)>,
    /// Per rank: where its registered memory is in this process.
    ptrs: Vec<DevicePtr>,
    /// The peers' allocations opened here (closed on drop).
    /// Per rank: its allocation opened here (none for this process's own).
    ipc: Vec<Mapping>,
    /// Synchronous puts and gets run here.
    stream: Stream,
    /// Per rank: the device address of this rank's slot in its signal
    /// buffer (where `signal_on_stream` writes), and of its slot in this
    /// rank's own signal buffer (where `wait_signal_on_stream` waits); or
    /// why stream-ordered signals cannot be had.
    slots: std::result::Result<Vec<(DevicePtr, DevicePtr)>, String>,
    /// Kernel signals (module docs): switched on for good by the first
    /// stream signal or wait captured into a graph, or from the start on a
    /// device without stream memory operations.
    kernel_signals: AtomicBool,
    /// Per peer: its signals taken by kernel waits, in host memory the
    /// device reaches.
    taken: PinnedWords,
    /// Per slot of this rank's signal buffer (counting, then value slots):
    /// what the last kernel wait on it waited for (`rmacomm_wait_next`
    /// writes it first), so that a watchdog sees kernel waits in flight —
    /// a CUDA graph's replays, which the host never issues (`watch`
    /// module).
    want: Arc<PinnedWords>,
    /// The signal kernels, compiled and loaded at registration.
    signal_module: OnceLock<std::result::Result<SharedModule, String>>,
    /// The watchdog of stream waits (`watch` module), where it could be
    /// started.
    watch: Option<WaitWatch>,
    /// How long the drop waits for the device (the window's timeout).
    ends_after: std::time::Duration,
    _host: Vec<HostRegistration>,
}

/// Streams whose waits the watchdog follows at once, at most this many per
/// registration (a lane whose stream has run all its waits serves the next
/// new stream; waits of streams beyond, while every lane is busy, are not
/// watched).
const LANES: usize = 64;

/// A stream as a watchdog lane: its handle, and the thread for the
/// per-thread default stream.
type LaneKey = (usize, Option<std::thread::ThreadId>);

/// `wait_signal_on_stream`'s watchdog (`super::watch`): each stream a lane
/// whose progress word (registered host memory) the stream writes after
/// each of its waits.
struct WaitWatch {
    watch: super::StreamWatch,
    progress: Arc<PinnedWords>,
    /// Per lane: the stream (its handle, and the thread for a per-thread
    /// default stream) and the last number issued.
    lanes: std::sync::Mutex<Vec<(LaneKey, u64)>>,
}

impl WaitWatch {
    fn start(w: &Window, ctx: &Arc<Context>, want: Arc<PinnedWords>) -> std::result::Result<WaitWatch, String> {
        let progress = Arc::new(PinnedWords::new(ctx, LANES)?);
        let words = progress.clone();
        let read = Arc::new(move |lane: usize| words.word(lane).load(Ordering::Acquire));
        let release = w.stream_release().kernel_waits(want);
        let watch = super::StreamWatch::start(read, w.timeout, w.peer_watch(), release, None)
            .map_err(|e| format!("the watchdog thread: {e}"))?;
        Ok(WaitWatch { watch, progress, lanes: std::sync::Mutex::new(Vec::new()) })
    }

    /// Queues `wait` (a stream wait on `stream`, by `op`) watched: the
    /// watchdog learns of the lane's next number first, then the wait is
    /// queued, then the stream writes the number (also when queueing the
    /// wait failed, so that the lane goes on). A new stream takes a lane of
    /// its own, or one whose stream has run everything it was given; with
    /// every lane busy, it is not watched (logged once).
    fn watched(&self, op: &'static str, stream: &Stream, wait: impl FnOnce() -> Result<()>) -> Result<()> {
        // CU_STREAM_PER_THREAD (2) is another stream on each thread.
        let key = (stream.raw(), if stream.raw() == 2 { Some(std::thread::current().id()) } else { None });
        let mut lanes = self.lanes.lock().unwrap_or_else(|e| e.into_inner());
        // A lane whose stream has run everything it was given (its word
        // holds its last number) can serve another stream: its numbers go
        // on growing, and the old stream writes it no more.
        let idle = |lanes: &[(LaneKey, u64)]| {
            (0..lanes.len()).find(|&l| self.progress.word(l).load(Ordering::Acquire) >= lanes[l].1)
        };
        let lane = match lanes.iter().position(|(k, _)| *k == key) {
            Some(l) => l,
            None if lanes.len() < LANES => {
                lanes.push((key, 0));
                lanes.len() - 1
            }
            None => match idle(&lanes) {
                Some(l) => {
                    lanes[l].0 = key;
                    l
                }
                None => {
                    static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
                    if !WARNED.swap(true, Ordering::Relaxed) {
                        tracing::warn!(
                            "{op}: more than {LANES} streams have stream waits in flight on one window at once: \
                             waits of the others are not watched"
                        );
                    }
                    drop(lanes);
                    return wait();
                }
            },
        };
        let seq = lanes[lane].1 + 1;
        self.watch.issued(lane, seq, op);
        let r = wait();
        // SAFETY: word `lane` of the progress words, registered host memory
        // alive with the registration (deregistration synchronizes first).
        let written = unsafe { stream.write_value64(self.progress.device_ptr(lane), seq) }.map_err(cuda(op));
        lanes[lane].1 = seq;
        r.and(written)
    }
}

/// Zeroed 64-bit words in page-aligned host memory registered with the
/// device (freed after the registration is dropped).
pub(super) struct PinnedWords {
    ptr: *mut u64,
    /// Words (the allocation may hold more: whole pages).
    n: usize,
    layout: std::alloc::Layout,
    reg: Option<HostRegistration>,
}

// SAFETY: the words are only reached through atomics (host) and by the
// device; the pointer is owned.
unsafe impl Send for PinnedWords {}
// SAFETY: as above.
unsafe impl Sync for PinnedWords {}

impl PinnedWords {
    pub(super) fn new(ctx: &Arc<Context>, n: usize) -> std::result::Result<PinnedWords, String> {
        let layout = std::alloc::Layout::from_size_align((8 * n.max(1)).div_ceil(4096) * 4096, 4096)
            .map_err(|e| e.to_string())?;
        // SAFETY: a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) }.cast::<u64>();
        if ptr.is_null() {
            return Err("out of host memory for the signal counts".into());
        }
        let mut w = PinnedWords { ptr, n, layout, reg: None };
        // SAFETY: the allocation lives until after the registration drops
        // (Drop below).
        w.reg = Some(unsafe { ctx.register_host(ptr.cast(), layout.size()) }.map_err(|e| e.to_string())?);
        Ok(w)
    }

    pub(super) fn word(&self, i: usize) -> &std::sync::atomic::AtomicU64 {
        assert!(i < self.n, "word {i} of {}", self.n);
        // SAFETY: inside the allocation (checked above), 8-byte aligned,
        // live as long as `self`.
        unsafe { std::sync::atomic::AtomicU64::from_ptr(self.ptr.add(i)) }
    }

    /// Words.
    pub(super) fn len(&self) -> usize {
        self.n
    }

    pub(super) fn device_ptr(&self, i: usize) -> DevicePtr {
        assert!(i < self.n, "word {i} of {}", self.n);
        self.reg.as_ref().map_or(0, |r| r.device_ptr()) + 8 * i as u64
    }
}

impl std::fmt::Debug for PinnedWords {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PinnedWords({} words)", self.n)
    }
}

impl Drop for PinnedWords {
    fn drop(&mut self) {
        drop(self.reg.take());
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.ptr.cast(), self.layout) };
    }
}

impl Drop for DeviceRegistration {
    /// Waits (at most the window's timeout: `ends_after`) for the device to
    /// run what was queued on the registration's memory and signal slots —
    /// CUDA graph replays included, which no host call counted — before
    /// the slots are unregistered and the window's connections close:
    /// peers then see this rank's last signals before it is gone (a gone
    /// peer a kernel still waits for counts as dead: `watch` module).
    fn drop(&mut self) {
        let ended = self.ctx.synchronize_within(self.ends_after).is_some();
        if !ended {
            tracing::warn!(
                "dropping a device window: the device had not run its queued work after {:?} (a stream waits for \
                 something that never comes?); its memory is unregistered anyway",
                self.ends_after
            );
        }
    }
}

impl DeviceRegistration {
    /// The signal kernels, compiled (once per process) and loaded by the
    /// registration, so that no module is loaded while a stream captures;
    /// where NVRTC is missing, only kernel signals fail.
    fn signal_module(&self) -> &std::result::Result<SharedModule, String> {
        self.signal_module.get_or_init(|| {
            let image = rmacomm_kernels::cuda::compile_signals(&self.ctx.arch()).map_err(|e| e.to_string())?.image();
            // SAFETY: an image NVRTC just compiled for this device.
            unsafe { SharedModule::load(&self.ctx, &image) }.map_err(|e| e.to_string())
        })
    }

    /// The want words of this rank's slots (field docs).
    pub(super) fn want_words(&self) -> Arc<PinnedWords> {
        self.want.clone()
    }

    /// `rank`'s registered bytes.
    pub(super) fn registered_len(&self, rank: usize) -> usize {
        self.peers[rank].0
    }
}

impl std::fmt::Debug for DeviceRegistration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceRegistration").field("peers", &self.peers).field("tensor", &self.tensor).finish()
    }
}

fn cuda(op: &'static str) -> impl Fn(rmacomm_cuda::CudaError) -> Error {
    move |source| Error::Cuda { op, source }
}

/// Makes memory at `ptr` of rank `p`, a rank of this process, reachable by
/// `ctx`'s kernels: nothing to do on the same GPU; peer access on another
/// (ranks as threads on several GPUs), or why it cannot be.
fn reach_local(ctx: &Arc<Context>, p: usize, ptr: DevicePtr, export: &Export) -> std::result::Result<(), String> {
    let dev = ctx.pointer_info(ptr).map_err(|e| format!("rank {p}'s memory: {e}"))?.device;
    if dev == ctx.ordinal() {
        return Ok(());
    }
    if matches!(export, Export::Vmm(_)) {
        return Err(format!(
            "rank {p}'s memory is cuMem/VMM memory of cuda:{dev} in this process, and this rank is on cuda:{}: ranks \
             of one process on different GPUs need cuMemAlloc memory (peer access does not reach VMM mappings)",
            ctx.ordinal()
        ));
    }
    let theirs = Context::open_shared(dev as u32).map_err(|e| format!("rank {p}'s GPU cuda:{dev}: {e}"))?;
    if !ctx.can_access_peer(&theirs).map_err(|e| e.to_string())? {
        return Err(format!(
            "rank {p}'s memory is on cuda:{dev}, which cuda:{} cannot reach (no peer access between the two GPUs)",
            ctx.ordinal()
        ));
    }
    ctx.enable_peer_access(&theirs).map_err(|e| format!("peer access from cuda:{} to cuda:{dev}: {e}", ctx.ordinal()))
}

impl Window {
    /// Registers `len` bytes of the caller's CUDA device memory at `ptr` on
    /// GPU `gpu` (a tensor's `data_ptr()`) on this window's transports, as
    /// [`alloc_cuda`](Self::alloc_cuda) memory: a tensor to register, or
    /// the source of a put (the destination of a get) that reaches any peer.
    ///
    /// # Safety
    /// The memory must stay allocated until the returned value is dropped
    /// (or, registered, deregistered) and every operation on it has
    /// finished.
    pub unsafe fn register_cuda(&self, ptr: u64, len: usize, gpu: u32) -> Result<RdmaMemory> {
        // SAFETY: forwarded to the caller.
        unsafe { RdmaMemory::register_cuda_for(&self.links[self.rank()].out, ptr, len, gpu) }
            .map_err(|e| Error::Transport { op: "register_cuda", source: e })
    }

    /// Registers `len` bytes of host memory at `ptr` on this window's
    /// transports (a tensor to register, or the source of a put / the
    /// destination of a get). Memory inside a shared segment this process
    /// allocated ([`alloc`](Self::alloc)) stays part of it: same-host peers
    /// write it with one copy. Registering the same bytes twice is allowed
    /// (e.g. once as the tensor, once as a put's source).
    ///
    /// # Safety
    /// `ptr..ptr + len` must stay mapped and writable until the returned
    /// value is dropped (or, registered, deregistered) and every operation
    /// on it has finished; peers may write it at any time.
    pub unsafe fn register_host(&self, ptr: *mut u8, len: usize) -> Result<RdmaMemory> {
        // SAFETY: forwarded to the caller.
        unsafe { RdmaMemory::register_raw_for(&self.links[self.rank()].out, ptr, len) }
            .map_err(|e| Error::Transport { op: "register_host", source: e })
    }

    /// The provider of this window's transports: `"soft"` (its engine
    /// moves every byte, device memory's through the CUDA driver) or a
    /// verbs provider's name (the HCA moves them).
    pub fn provider(&self) -> &'static str {
        self.links[self.rank()].out.provider()
    }

    /// Registers device memory as this rank's tensor of elements of
    /// `elem_size` bytes (all of `mem`, whole elements). Collective, like
    /// [`tensor_register`](Self::tensor_register): every rank registers
    /// device memory, sizes may differ. Every peer must be UNIFIED (same
    /// host, shared-memory signals): its memory is mapped here through CUDA
    /// IPC (or, for ranks of this process on another GPU, peer access).
    /// Fails on every rank, naming the rank at fault, when any rank cannot
    /// register or map: [`Error::Unreachable`] on every rank when all that
    /// failed is mapping some peer's memory (GPUs without peer access
    /// between them, CUDA IPC refused), which the transport reaches
    /// instead ([`register_cuda`](Self::register_cuda) and
    /// [`tensor_register`](Self::tensor_register): staged by the soft
    /// provider).
    pub fn tensor_register_device(&mut self, mem: DeviceMemory, elem_size: usize) -> Result<()> {
        let len = mem.len().checked_div(elem_size).map_or(0, |n| n * elem_size);
        let (ctx, ptr) = (mem.context().clone(), mem.ptr());
        self.register_device(ctx, ptr, len, elem_size, Tensor::Owned(mem))
    }

    /// [`tensor_register_device`](Self::tensor_register_device) of memory
    /// the window does not own: `len` bytes at device address `ptr` of
    /// `ctx`'s device (a PyTorch tensor's `data_ptr()`); it may be part of a
    /// larger allocation (the allocation is what IPC exports).
    ///
    /// # Safety
    /// The memory must stay allocated until
    /// [`tensor_deregister_device`](Self::tensor_deregister_device) has
    /// returned (on every rank: peers write it until then).
    pub unsafe fn tensor_register_device_ptr(
        &mut self,
        ctx: Arc<Context>,
        ptr: DevicePtr,
        len: usize,
        elem_size: usize,
    ) -> Result<()> {
        self.register_device(ctx, ptr, len, elem_size, Tensor::Borrowed)
    }

    fn register_device(
        &mut self,
        ctx: Arc<Context>,
        ptr: DevicePtr,
        len: usize,
        elem_size: usize,
        tensor: Tensor,
    ) -> Result<()> {
        const OP: &str = "tensor_register_device";
        if self.reg.is_some() || self.dev.is_some() {
            return Err(Error::invalid(OP, "a tensor is registered already; deregister it first"));
        }
        let (me, n) = (self.rank(), self.size());
        // What this rank offers, or why it cannot: every rank says one or
        // the other in the same exchange, so a failure never leaves a peer
        // waiting.
        let offer = || -> std::result::Result<String, String> {
            // A released window's signals are gone for good (every rank
            // learns it here, in the exchange).
            if let Some(why) = self.released.get() {
                return Err(format!("this window's streams were released ({why}): make a new window"));
            }
            if len == 0 || len.checked_rem(elem_size) != Some(0) {
                return Err(format!(
                    "{len} bytes of elements of {elem_size} bytes: both must be positive, the length a multiple of \
                     the element size"
                ));
            }
            if let Some(p) = (0..n).find(|&p| p != me && self.signal_maps[p].is_none()) {
                return Err(format!(
                    "rank {p} is not a same-host (UNIFIED) peer; tensor_register_device reaches peers through \
                     CUDA IPC only (for peers on other hosts, register memory from Window::alloc_cuda with \
                     tensor_register: the transport moves it)"
                ));
            }
            // The memory must be the context's device's: copies and signals
            // are queued on that device's streams.
            let info = ctx.pointer_info(ptr).map_err(|e| e.to_string())?;
            if info.device != ctx.ordinal() {
                return Err(format!(
                    "{len} bytes at {ptr:#x} are memory of cuda:{}, not of cuda:{} (the device given with it)",
                    info.device,
                    ctx.ordinal()
                ));
            }
            // cuMemAlloc memory exports its IPC handle; VMM memory (PyTorch's
            // expandable segments) its mappings' descriptors.
            let (export, offset) = ctx.export_range(ptr, len).map_err(|e| e.to_string())?;
            Ok(format!("ok {} {offset} {len} {elem_size} {} {ptr}", export.to_text(), std::process::id()))
        };
        let blob = offer().unwrap_or_else(|why| format!("err {why}"));
        let all = self.group.exchange(OP, blob.as_bytes())?;
        let mut offers = Vec::with_capacity(n);
        for (p, v) in all.iter().enumerate() {
            let text = String::from_utf8_lossy(v);
            if let Some(why) = text.strip_prefix("err ") {
                return Err(Error::PeerFailed { op: OP, peer: p, reason: why.to_string() });
            }
            let f: Vec<&str> = text.split(' ').collect();
            let parsed = (f.len() == 7 && f[0] == "ok")
                .then(|| {
                    Some((
                        Export::from_text(f[1])?,
                        f[2].parse::<u64>().ok()?,
                        f[3].parse::<usize>().ok()?,
                        // An element size of 0 is no registration's (it
                        // would divide by zero in bounds checks), nor a
                        // length that is no whole number of elements.
                        f[4].parse::<usize>()
                            .ok()
                            .filter(|&es| es > 0 && f[3].parse::<usize>().is_ok_and(|l| l % es == 0))?,
                        f[5].parse::<u32>().ok()?,
                        f[6].parse::<u64>().ok()?,
                    ))
                })
                .flatten();
            offers.push(parsed.ok_or_else(|| Error::Protocol(format!("{OP}: rank {p} sent a malformed descriptor")))?);
        }
        // Map every peer's memory; the same process (ranks as threads)
        // shares the address space, so its pointer is used as it is.
        let mapped = || -> Result<(Vec<DevicePtr>, Vec<Mapping>)> {
            let (mut ptrs, mut ipc) = (Vec::with_capacity(n), Vec::new());
            for (p, (export, offset, their_len, _, pid, their_ptr)) in offers.iter().enumerate() {
                let (offset, their_len, pid, their_ptr) = (*offset, *their_len, *pid, *their_ptr);
                if p == me || pid == std::process::id() {
                    if p != me {
                        // A rank of this process on another GPU: its memory
                        // is reached through peer access.
                        reach_local(&ctx, p, their_ptr, export).map_err(|reason| Error::Unreachable {
                            op: OP,
                            rank: me,
                            reason,
                        })?;
                    }
                    ptrs.push(their_ptr);
                    ipc.push(None);
                    continue;
                }
                let m = ctx.open_export(export, pid).map_err(|source| Error::Unreachable {
                    op: OP,
                    rank: me,
                    reason: format!(
                        "rank {p}'s memory cannot be opened on cuda:{} (CUDA IPC): {source}",
                        ctx.ordinal()
                    ),
                })?;
                // The peer's range must lie in what is mapped here: the VMM
                // mappings (mapped whole), or the allocation the IPC handle
                // named (its size as the driver reports it).
                let mapped = match m.mapped_len() {
                    Some(mapped) => mapped,
                    None => ctx.pointer_info(m.ptr()).map(|i| i.size).map_err(cuda(OP))?,
                };
                if offset.checked_add(their_len as u64).is_none_or(|end| end > mapped as u64) {
                    return Err(Error::Protocol(format!(
                        "{OP}: rank {p} offered {their_len} bytes at offset {offset} of the {mapped} bytes it exported"
                    )));
                }
                ptrs.push(m.ptr() + offset);
                ipc.push(Some(Arc::new(m)));
            }
            Ok((ptrs, ipc))
        };
        let mapped = mapped().and_then(|m| {
            let words = |len: usize| {
                PinnedWords::new(&ctx, len).map_err(|e| Error::Unsupported {
                    op: OP,
                    reason: format!("registering the signal counts with the device: {e}"),
                })
            };
            Ok((m, (words(n)?, Arc::new(words(n + self.value_slots)?))))
        });
        const UNREACHABLE: &str = "unreachable ";
        let verdict = match &mapped {
            Ok(_) => String::new(),
            Err(Error::Unreachable { reason, .. }) => format!("{UNREACHABLE}{reason}"),
            Err(e) => e.to_string(),
        };
        let all = self.group.exchange("tensor_register_device/mapped", verdict.as_bytes())?;
        // Every rank decides alike from the verdicts: any failure but an
        // unreachable peer fails the registration; else a rank that could
        // not map some peer makes it Unreachable on every rank (so all can
        // go through the transport instead).
        let failed = |unreachable: bool| {
            all.iter().enumerate().find(|(_, v)| !v.is_empty() && v.starts_with(UNREACHABLE.as_bytes()) == unreachable)
        };
        if let Some((p, why)) = failed(false) {
            return Err(match mapped {
                Err(e) if !matches!(e, Error::Unreachable { .. }) => e,
                _ => Error::PeerFailed { op: OP, peer: p, reason: String::from_utf8_lossy(why).into_owned() },
            });
        }
        if let Some((p, why)) = failed(true) {
            let reason = String::from_utf8_lossy(&why[UNREACHABLE.len()..]).into_owned();
            return Err(Error::Unreachable { op: OP, rank: p, reason });
        }
        let ((ptrs, ipc), (taken, want)) = mapped?;
        let stream = ctx.stream().map_err(cuda(OP))?;
        let (slots, host) = match self.device_slots(&ctx) {
            Ok((s, h)) => (Ok(s), h),
            Err(why) => (Err(why), Vec::new()),
        };
        let peers = offers.iter().map(|o| (o.2, o.3)).collect();
        let memops = ctx.stream_mem_ops().unwrap_or(false);
        for p in 0..n {
            taken.word(p).store(self.consumed[p].load(Ordering::Acquire), Ordering::Release);
        }
        let watch = match self.watch_stream_waits.then(|| WaitWatch::start(self, &ctx, want.clone())) {
            None => None,
            Some(Ok(w)) => Some(w),
            Some(Err(why)) => {
                tracing::warn!("{OP}: stream waits are not watched ({why}): a peer that dies leaves them waiting");
                None
            }
        };
        self.dev = Some(DeviceRegistration {
            tensor,
            ctx,
            peers,
            ptrs,
            ipc,
            stream,
            slots,
            kernel_signals: AtomicBool::new(!memops),
            taken,
            want,
            signal_module: OnceLock::new(),
            watch,
            ends_after: self.timeout,
            _host: host,
        });
        if let Some(d) = &self.dev {
            let _ = d.signal_module();
        }
        Ok(())
    }

    /// Registers the signal buffers with the device: this rank's own and
    /// each peer's mapped here, for stream-ordered signals.
    #[allow(clippy::type_complexity)]
    fn device_slots(
        &self,
        ctx: &Arc<Context>,
    ) -> std::result::Result<(Vec<(DevicePtr, DevicePtr)>, Vec<HostRegistration>), String> {
        let me = self.rank();
        // SAFETY: the signal buffers are mapped as long as the window lives,
        // and the registrations are dropped with the device registration,
        // before the window.
        let own = unsafe { ctx.register_host(self.signal_dst.as_ptr(), self.signal_dst.len()) }
            .map_err(|e| format!("registering this rank's signal buffer: {e}"))?;
        let mut host = Vec::new();
        let mut slots = Vec::with_capacity(self.size());
        for p in 0..self.size() {
            let wait_at = own.device_ptr() + (SLOT * p) as u64;
            let signal_at = if p == me {
                own.device_ptr() + (SLOT * me) as u64
            } else {
                let m = self.signal_maps[p].as_ref().ok_or_else(|| format!("rank {p}'s signals are not mapped"))?;
                // SAFETY: as above.
                let r = unsafe { ctx.register_host(m.as_ptr(), m.len()) }
                    .map_err(|e| format!("registering rank {p}'s signal buffer: {e}"))?;
                let at = r.device_ptr() + (SLOT * me) as u64;
                host.push(r);
                at
            };
            slots.push((signal_at, wait_at));
        }
        host.push(own);
        Ok((slots, host))
    }

    /// Ends a device registration. Collective: waits for the device to
    /// finish everything queued in the context (puts queued on the caller's
    /// streams included), then for every rank (a barrier), so no peer still
    /// reaches the memory. Gives back memory given to
    /// [`tensor_register_device`](Self::tensor_register_device) (`None`
    /// for [`tensor_register_device_ptr`](Self::tensor_register_device_ptr)).
    pub fn tensor_deregister_device(&mut self) -> Result<Option<DeviceMemory>> {
        const OP: &str = "tensor_deregister_device";
        let reg = self.dev.as_ref().ok_or_else(|| Error::invalid(OP, "no device tensor is registered"))?;
        reg.ctx.synchronize().map_err(cuda(OP))?;
        if reg.kernel_signals.load(Ordering::Acquire) {
            // The device kept the counts: back to the host's for the next
            // registration (its stream signals may write counts again).
            let me = self.rank();
            for p in 0..self.size() {
                self.consumed[p].store(reg.taken.word(p).load(Ordering::Acquire), Ordering::Release);
                if let Some(Ok(slot)) = self.signal_maps[p].as_ref().map(|m| m.atomic_u64(SLOT * me)) {
                    self.sent[p].store(slot.load(Ordering::Acquire), Ordering::Release);
                }
            }
        }
        self.group.barrier(None)?;
        let mut reg = self.dev.take().expect("checked above");
        Ok(match std::mem::replace(&mut reg.tensor, Tensor::Borrowed) {
            Tensor::Owned(m) => Some(m),
            Tensor::Borrowed => None,
        })
    }

    /// This rank's registered device memory, when it was given to the
    /// window.
    pub fn local_device_tensor(&self) -> Option<&DeviceMemory> {
        match &self.dev.as_ref()?.tensor {
            Tensor::Owned(m) => Some(m),
            Tensor::Borrowed => None,
        }
    }

    /// Where `rank`'s registered device memory is mapped in this process
    /// and its length (the device form of
    /// [`map_remote_tensor`](Self::map_remote_tensor): kernels may load and
    /// store there). A peer whose connection broke (it died) is an error:
    /// its memory is no one's any more. (A view taken earlier gives no such
    /// guarantee.)
    pub fn map_remote_device(&self, rank: usize) -> Result<(DevicePtr, usize)> {
        const OP: &str = "map_remote_device";
        self.check_rank(OP, rank)?;
        let reg = self.device_reg(OP)?;
        self.live_peer(OP, rank)?;
        Ok((reg.ptrs[rank], reg.peers[rank].0))
    }

    fn live_peer(&self, op: &'static str, rank: usize) -> Result<()> {
        if rank == self.rank() {
            return Ok(());
        }
        self.peer_alive(rank).map_err(|source| Error::Rma { op, peer: rank, source })
    }

    /// The mapping of `rank`'s allocation in this process, to keep it
    /// mapped past deregistration (a view handed to a user, e.g. a torch
    /// tensor over the peer's memory, holds it); `None` for this process's
    /// own memory.
    pub fn device_mapping(&self, rank: usize) -> Result<Option<Arc<IpcMapping>>> {
        const OP: &str = "map_remote_device";
        self.check_rank(OP, rank)?;
        let reg = self.device_reg(OP)?;
        self.live_peer(OP, rank)?;
        Ok(reg.ipc[rank].clone())
    }

    fn device_reg(&self, op: &'static str) -> Result<&DeviceRegistration> {
        self.dev.as_ref().ok_or_else(|| {
            Error::invalid(op, "no device tensor is registered; call tensor_register_device (collective) first")
        })
    }

    /// The device address in `rank`'s memory of `len` bytes at element
    /// `offset`, or the error saying why they do not fit.
    fn device_target(&self, op: &'static str, rank: usize, offset: usize, len: usize) -> Result<DevicePtr> {
        self.check_rank(op, rank)?;
        let reg = self.device_reg(op)?;
        let (size, es) = reg.peers[rank];
        let start = offset.checked_mul(es).filter(|s| s.checked_add(len).is_some_and(|e| e <= size));
        let start = start.ok_or_else(|| Error::Bounds {
            op,
            peer: rank,
            reason: format!(
                "{len} bytes at element offset {offset} ({es} B elements) end past rank {rank}'s registered \
                 device buffer of {size} bytes ({} elements)",
                size / es
            ),
        })?;
        self.peer_alive(rank).map_err(|source| Error::Rma { op, peer: rank, source })?;
        Ok(reg.ptrs[rank] + start as u64)
    }

    /// A copy of `len` bytes on `stream` (queued), or on the window's
    /// stream (complete when this returns).
    ///
    /// # Safety
    /// Both ranges are device memory valid until the copy has run.
    unsafe fn device_copy(
        &self,
        op: &'static str,
        dst: DevicePtr,
        src: DevicePtr,
        len: usize,
        stream: Option<&Stream>,
    ) -> Result<()> {
        let reg = self.device_reg(op)?;
        if len == 0 {
            return Ok(());
        }
        let s = stream.unwrap_or(&reg.stream);
        // SAFETY: the caller's contract.
        unsafe { s.copy_async(dst, src, len) }.map_err(cuda(op))?;
        if stream.is_none() {
            reg.stream.synchronize().map_err(cuda(op))?;
        }
        Ok(())
    }

    /// Copies `src` (device memory) into `dst_rank`'s registered device
    /// memory at element `target_offset_nelems` of `dst_rank`'s element
    /// size. Bounds are checked first ([`Error::Bounds`], nothing moved).
    /// Without a stream the data is placed when this returns, so a
    /// [`signal`](Self::signal) after it follows it; with a stream the copy
    /// is queued there, and [`signal_on_stream`](Self::signal_on_stream)
    /// on the same stream follows it.
    pub fn device_put(
        &self,
        src: DeviceView<'_>,
        dst_rank: usize,
        target_offset_nelems: usize,
        stream: Option<&Stream>,
    ) -> Result<()> {
        // SAFETY: a view of live device memory; a queued copy that outlives
        // it is waited for by cuMemFree, which synchronizes.
        unsafe { self.device_put_ptr(src.ptr(), src.len(), dst_rank, target_offset_nelems, stream) }
    }

    /// [`device_put`](Self::device_put) from a raw device address.
    ///
    /// # Safety
    /// `len` bytes at `src` must be device memory of the window's device (or
    /// one with peer access) valid until the copy has run.
    pub unsafe fn device_put_ptr(
        &self,
        src: DevicePtr,
        len: usize,
        dst_rank: usize,
        target_offset_nelems: usize,
        stream: Option<&Stream>,
    ) -> Result<()> {
        const OP: &str = "device_put";
        let dst = self.device_target(OP, dst_rank, target_offset_nelems, len)?;
        // SAFETY: `dst` is inside the peer's registered memory (checked);
        // `src` is the caller's contract.
        unsafe { self.device_copy(OP, dst, src, len, stream) }
    }

    /// Copies from `src_rank`'s registered device memory at element
    /// `source_offset_nelems` into `dst` (device memory); bounds checked
    /// first. Synchronous without a stream, queued on it with one.
    pub fn device_get(
        &self,
        dst: DeviceView<'_>,
        src_rank: usize,
        source_offset_nelems: usize,
        stream: Option<&Stream>,
    ) -> Result<()> {
        // SAFETY: as for device_put.
        unsafe { self.device_get_ptr(dst.ptr(), dst.len(), src_rank, source_offset_nelems, stream) }
    }

    /// [`device_get`](Self::device_get) into a raw device address.
    ///
    /// # Safety
    /// As for [`device_put_ptr`](Self::device_put_ptr), for `dst`.
    pub unsafe fn device_get_ptr(
        &self,
        dst: DevicePtr,
        len: usize,
        src_rank: usize,
        source_offset_nelems: usize,
        stream: Option<&Stream>,
    ) -> Result<()> {
        const OP: &str = "device_get";
        let src = self.device_target(OP, src_rank, source_offset_nelems, len)?;
        // SAFETY: `src` is inside the peer's registered memory (checked);
        // `dst` is the caller's contract.
        unsafe { self.device_copy(OP, dst, src, len, stream) }
    }

    fn stream_slots(&self, op: &'static str, rank: usize, stream: &Stream) -> Result<(DevicePtr, DevicePtr)> {
        self.check_rank(op, rank)?;
        self.not_released(op, rank)?;
        let reg = self.device_reg(op)?;
        if !Arc::ptr_eq(stream.context(), &reg.ctx) && stream.context().ordinal() != reg.ctx.ordinal() {
            return Err(Error::invalid(op, "the stream belongs to another device than the registered memory"));
        }
        let slots = reg.slots.as_ref().map_err(|why| Error::Unsupported { op, reason: why.clone() })?;
        self.peer_alive(rank).map_err(|source| Error::Rma { op, peer: rank, source })?;
        Ok(slots[rank])
    }

    /// The device address (as this rank reaches it) of value slot `disp`
    /// of `rank`'s signal buffer (the ctran form's slots: a window made
    /// with [`WindowOptions::signal_slots`](crate::WindowOptions::signal_slots)),
    /// for stream memory operations and kernels: host memory every rank of
    /// the device registration maps, which a
    /// [`StreamRelease`](super::StreamRelease) can release.
    pub fn device_value_slot(&self, rank: usize, disp: usize) -> Result<DevicePtr> {
        const OP: &str = "device_value_slot";
        self.check_rank(OP, rank)?;
        let off = self.value_slot_index(OP, rank, disp)?;
        let slots =
            self.device_reg(OP)?.slots.as_ref().map_err(|why| Error::Unsupported { op: OP, reason: why.clone() })?;
        let me = self.rank();
        // Slot `me` of a peer's buffer (where this rank signals it), slot
        // `me` of this rank's own: the buffers' starts follow.
        let base = if rank == me { slots[me].1 } else { slots[rank].0 } - (SLOT * me) as u64;
        Ok(base + off as u64)
    }

    /// The device address of this rank's *want* word for its value slot
    /// `disp`: what a kernel waiting on that slot (`rmacomm_wait_next`,
    /// `rmacomm_wait_reach`) writes first, so that the watchdog sees the
    /// wait in flight ([`StreamRelease::value_waited`](super::StreamRelease::value_waited)).
    /// A kernel that waits on a value slot through it needs the slot's
    /// value only to grow (counts): a want left above a value set lower
    /// looks like a wait in flight, overdue after the timeout.
    pub fn device_value_want(&self, disp: usize) -> Result<DevicePtr> {
        const OP: &str = "device_value_want";
        let reg = self.device_reg(OP)?;
        let i = self.value_slot_index(OP, self.rank(), disp)? / SLOT;
        Ok(reg.want.device_ptr(i))
    }

    /// The signal kernels when this window's stream signals are kernels
    /// (module docs), switching to them for good when `stream` is
    /// capturing a graph; `None` while stream memory operations serve.
    fn kernel_signals(&self, op: &'static str, stream: &Stream) -> Result<Option<&SharedModule>> {
        let reg = self.device_reg(op)?;
        let module = reg.signal_module();
        if !reg.kernel_signals.load(Ordering::Acquire) {
            if !stream.is_capturing().map_err(cuda(op))? {
                return Ok(None);
            }
            if module.is_ok()
                && reg.kernel_signals.compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire).is_ok()
            {
                // The kernels go on from the counts the host kept (of waits
                // queued so far: they run before anything queued after them).
                for p in 0..self.size() {
                    reg.taken.word(p).store(self.consumed[p].load(Ordering::Acquire), Ordering::Release);
                }
            }
        }
        module.as_ref().map(Some).map_err(|why| Error::Unsupported {
            op,
            reason: format!(
                "stream signals in a CUDA graph (or without stream memory operations) run as kernels: {why}"
            ),
        })
    }

    /// With kernel signals (module docs), the count of `peer`'s signals
    /// taken, which kernel waits keep on the device: host waits count there
    /// too, so that both take each signal once.
    pub(super) fn kernel_wait_count(&self, peer: usize) -> Option<&std::sync::atomic::AtomicU64> {
        let d = self.dev.as_ref()?;
        d.kernel_signals.load(Ordering::Acquire).then(|| d.taken.word(peer))
    }

    /// Queues a signal to `dst_rank` on `stream`: it is delivered after
    /// everything queued there before (puts included), and satisfies one
    /// [`wait_signal`](Self::wait_signal) or
    /// [`wait_signal_on_stream`](Self::wait_signal_on_stream) there. The
    /// slot is written with the count of signals this rank sent to
    /// `dst_rank` (`cuStreamWriteValue64`), so host signals and stream
    /// signals to one peer must not overlap: synchronize the stream before
    /// a host [`signal`](Self::signal) to the same peer. Inside a CUDA graph
    /// capture (and from then on) it is a kernel adding one to the slot, so
    /// every replay signals again (module docs).
    ///
    /// With no device tensor registered (a window of transport-registered
    /// memory, or none), the window's stream proxy signals once the stream
    /// reaches this point; host and stream signals then mix freely, and a
    /// failure is kept for [`stream_error`](Self::stream_error).
    pub fn signal_on_stream(&self, dst_rank: usize, stream: &Stream) -> Result<()> {
        const OP: &str = "signal_on_stream";
        if self.dev.is_none() {
            return self.proxy_signal(dst_rank, stream).map(drop);
        }
        let (at, _) = self.stream_slots(OP, dst_rank, stream)?;
        if let Some(m) = self.kernel_signals(OP, stream)? {
            // SAFETY: the kernel's one parameter, a slot of a registered
            // signal buffer, mapped while the window lives.
            unsafe { m.launch_on(stream, "rmacomm_signal_next", 1, 32, &[Arg::U64(at)]) }.map_err(cuda(OP))?;
            self.sent[dst_rank].fetch_add(1, Ordering::AcqRel);
            return Ok(());
        }
        let count = self.sent[dst_rank].fetch_add(1, Ordering::AcqRel) + 1;
        // SAFETY: a slot of a registered signal buffer, mapped while the
        // window lives (deregistration synchronizes the context first).
        unsafe { stream.write_value64(at, count) }.map_err(|e| {
            self.sent[dst_rank].fetch_sub(1, Ordering::AcqRel);
            Error::Cuda { op: OP, source: e }
        })
    }

    /// Queues a wait for the next signal from `peer_rank` on `stream`: work
    /// queued there after this runs once the signal has arrived (the n-th
    /// wait, host or stream, takes the n-th signal). A watchdog
    /// (`watch` module) ends the wait once `peer_rank`'s connection broke
    /// (it died) or the window's timeout has passed since the wait was
    /// queued: it releases every stream waiting on this rank's signal
    /// buffer, and the window's later operations fail with the reason
    /// ([`Error::StreamFailed`]). Inside a CUDA graph capture (and from
    /// then on) it is a kernel that waits for one more signal than the
    /// device has counted taken, so every replay waits again (module docs);
    /// the watchdog sees those waits too (the kernel writes what it waits
    /// for into host memory first) and releases them alike — a replay's
    /// wait for a gone peer at once, one for a live peer after the timeout
    /// since it started waiting.
    ///
    /// With no device tensor registered, the stream waits until the
    /// window's stream proxy has taken the peer's next signal; the proxy
    /// waits at most the window's timeout from when the stream reaches the
    /// wait, then releases the stream and keeps the error for
    /// [`stream_error`](Self::stream_error).
    pub fn wait_signal_on_stream(&self, peer_rank: usize, stream: &Stream) -> Result<()> {
        const OP: &str = "wait_signal_on_stream";
        if self.dev.is_none() {
            return self.proxy_wait(peer_rank, stream).map(drop);
        }
        let (_, at) = self.stream_slots(OP, peer_rank, stream)?;
        if let Some(m) = self.kernel_signals(OP, stream)? {
            let reg = self.device_reg(OP)?;
            let (taken, want) = (reg.taken.device_ptr(peer_rank), reg.want.device_ptr(peer_rank));
            // SAFETY: the kernel's parameters: this rank's count of the
            // peer's signals and its want word (registered host memory,
            // alive with the registration) and the peer's slot of this
            // rank's buffer.
            return unsafe {
                m.launch_on(stream, "rmacomm_wait_next", 1, 32, &[Arg::U64(taken), Arg::U64(at), Arg::U64(want)])
            }
            .map_err(cuda(OP));
        }
        let want = self.consumed[peer_rank].fetch_add(1, Ordering::AcqRel) + 1;
        let wait = || {
            // SAFETY: as for signal_on_stream.
            unsafe { stream.wait_value64_geq(at, want) }.map_err(|e| {
                self.consumed[peer_rank].fetch_sub(1, Ordering::AcqRel);
                Error::Cuda { op: OP, source: e }
            })
        };
        match &self.device_reg(OP)?.watch {
            Some(w) => w.watched(OP, stream, wait),
            None => wait(),
        }
    }
}
