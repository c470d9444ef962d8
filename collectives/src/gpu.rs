//! Collectives on CUDA device memory with the native backend (issue 13):
//! same-host ranks (one GPU or several) over a window of device memory
//! whose peers are mapped through CUDA IPC, reductions by the NVRTC
//! kernels, everything queued on the caller's stream (signals and waits
//! are stream memory operations), so nothing waits on the host.
//!
//! Every rank has two slot regions, used in turn (one *use* per chunk of a
//! collective): a use writes into this rank's region, then every rank
//! signals every peer and waits for every peer (an *exchange*), then reads
//! what it needs from every rank's region. No exchange closes a use: the
//! region is written again two uses later, after the next use's exchange,
//! which every peer signals only once it has queued everything of this use
//! (its reads included) before it on its stream.
//!
//! `all_reduce` of a buffer, per chunk of at most the slot size:
//! 1. the chunk is copied into this rank's region;
//! 2. exchange (inputs ready);
//! 3. each rank reduces its share (1/n of the chunk's elements) of all
//!    ranks' regions, read in place through IPC, into its own share of its
//!    region (one k-input kernel: `rmacomm_<op>_n_<dtype>`, or
//!    `rmacomm_sum_full_<dtype>` for AVG and PREMUL_SUM; no other rank
//!    reads that share before step 4);
//! 4. exchange (results ready);
//! 5. each rank copies every share from its owner's region into the
//!    buffer.
//!
//! The signals are 64-bit counts written with `cuStreamWriteValue64` and
//! waited for with `cuStreamWaitValue64` (≥), into host memory every rank
//! of the host maps and registers with its device: the exchange's in the
//! window's signal slots, send/recv's in its value slots, and this rank's
//! `done` word in a segment of its own. So a watchdog can end the waits of
//! a call whose peer died or never made it, with no driver call
//! (the window's `StreamWatch`: the call fails, naming the rank, within
//! the timeout).
//! `RMACOMM_GPU_FLAGS=device` puts them in a flag area after the slot
//! regions instead, in device memory the peers write through their IPC
//! mapping (as before 2026-12-01; measured the same on the H200), where
//! nothing ends a wait for a peer that is gone.
//!
//! # Across hosts (transport mode)
//!
//! Where some rank is on another host ([`GpuComm::new`] sees that the
//! window's peers are not all UNIFIED), where some rank cannot map a
//! peer's slots (GPUs of one host without peer access between them, CUDA
//! IPC refused: every rank learns it at the registration, warns, and
//! starts again in this mode), or where [`GpuComm::new_through_transport`]
//! asks for it, nothing is read in place: the slot memory is registered
//! through the transport, and a rank *puts* what a peer needs into the
//! peer's region (`Window::put_on_stream`, run by the window's stream proxy
//! at the stream's point; the stream waits until the data is placed), then
//! the exchange's signals (the proxy's) follow. Each use's region is laid
//! out for that: all_reduce/reduce stage the chunk, put share p to rank p
//! (which gathers the n inputs of its share), reduce, put the reduced share
//! to every rank (the root only, for reduce), exchange, copy out;
//! broadcast puts the root's chunk to every rank; all_gather puts this
//! rank's block to every rank; all_to_all and reduce_scatter put block j
//! to rank j. The reuse argument is the same: a rank puts into a peer's
//! region of use k only after the peer's signal of use k-1, which the peer
//! queued after its reads of use k-2. The reductions read local memory
//! only. A failed put or signal is the window's stream error: the next call
//! fails with it.
//!
//! On the soft provider the slot memory is *host* memory (a shared segment
//! registered with the device, `cuMemHostRegister`): the stream copies the
//! caller's data into it and the kernels read and write it through its
//! device mapping, and the transport's engine moves host bytes only — it
//! makes no CUDA call at all, so no driver lock can hold up a stream that
//! waits for it (with device slots it copied them through the driver: the
//! hang of docs/gpu.md, "Known problem"). It is the staging NCCL's network
//! proxy uses without GPUDirect RDMA. With a verbs provider the slots stay
//! device memory, which the HCA reaches itself (DMA-BUF or nvidia-peermem).
//! `RMACOMM_GPU_SLOTS=host` or `=device` overrides either choice.
//!
//! On a device without 64-bit stream memory operations IPC mode signals
//! with the kernels below from the start (the `done` word too: a spin-wait
//! kernel and `rmacomm_signal_next`), and uploads the pointer tables;
//! transport mode is refused there (the stream proxy waits on them).
//!
//! # CUDA graphs
//!
//! In IPC mode the collectives and send/recv can be captured into a CUDA
//! graph (nothing in transport mode: the stream proxy is not capturable;
//! refused before anything is queued). A stream
//! memory operation's value is fixed when captured, so from the first
//! capture on the exchange's signals are kernels (`rmacomm_signal_next`
//! adds one to this rank's word in the peer's flag area,
//! `rmacomm_wait_next` waits for one more than the device's count of that
//! peer's signals taken, kept in host memory the device maps and set from
//! the host's counts at the switch): every replay signals and waits
//! again. send/recv likewise: a chunk waits with `rmacomm_wait_reach` until
//! the receiver's count of chunks taken (in this rank's flag area) reaches
//! this rank's count of chunks sent (in the receiver's), then adds one to
//! the latter; the receiver waits for one more than its device count of
//! chunks taken, then adds one to its count in the sender's area. And every
//! call then starts from the same region and uses an even
//! number of them (an odd one gets one more exchange, nothing written), so
//! replays and eager calls can follow each other in any order and still
//! alternate the regions. A captured call stays out of the `done` word's
//! count: the caller orders its replays with the communicator's other calls
//! (replaying on the stream they use, as `torch.cuda.graph` does, orders
//! them), as with NCCL. Replays are watched all the same: each kernel wait
//! first writes what it waits for into the window's want word of its slot
//! (host memory), so the watchdog sees a replay's wait in flight and for
//! whom (a gone peer: released at once; nothing moving for the timeout:
//! overdue), though no host call issued it — except with
//! `RMACOMM_GPU_FLAGS=device`, where nothing watches.
//!
//! # The end
//!
//! No exchange closes a call's last use, so a rank done first may drop its
//! communicator while a slower peer still copies out of its slots (a
//! peer's last reads follow its last wait, which this rank's signal ended).
//! CUDA leaves a read of memory freed under an IPC mapping undefined. So,
//! with the words in host memory, each rank counts its collective calls
//! whose reads have run, in the window's value slot 2n (a stream write of
//! the host's count after each call's last read; a signal kernel once the
//! kernels serve, inside captured calls too, so that every replay counts),
//! and a drop first waits until every peer's count reaches its own (read
//! through the peer's mapped signal buffer, no driver call), or the peer is
//! gone (a peer that left, or died, reads nothing more), for at most the
//! window's timeout (then it warns and frees anyway). A peer that is merely
//! slower costs the drop what its reads take; ranks that never make the
//! same calls cost the timeout. send/recv need none of it (a sender writes
//! into the receiver's inbox, which the receiver reads only after the
//! chunk's count has landed); with `RMACOMM_GPU_FLAGS=device` nothing is
//! counted and a drop does not wait.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rmacomm_kernels::{DType, ReduceOp};
use rmacomm_window::cuda::device::{DeviceMemory, HostRegistration, SharedModule, Stream};
use rmacomm_window::cuda::driver::{Arg, Context, DevicePtr};
use rmacomm_window::{Group, Window, WindowOptions};

use crate::error::{Error, Result};

type RdmaMemory = rmacomm_transport::RdmaMemory;

/// Bytes per slot region (two per rank), unless `RMACOMM_GPU_SLOT_BYTES`
/// says otherwise.
pub const DEFAULT_GPU_SLOT_BYTES: usize = 64 << 20;

/// Same-host collectives on device memory (module docs).
pub struct GpuComm {
    win: Window,
    ctx: Arc<Context>,
    module: SharedModule,
    /// Every rank's slot memory (two regions, then the flag area), as
    /// mapped here.
    slots: Vec<DevicePtr>,
    slot: usize,
    /// The region the next use writes (0 or 1), the same on every rank.
    parity: usize,
    /// Signals in device memory (the flag area) rather than the window's
    /// host slots.
    device_flags: bool,
    /// Signals sent to / taken from each peer through the flag area.
    sent: Vec<u64>,
    taken: Vec<u64>,
    /// send/recv: chunks sent to / received from each peer.
    p2p_sent: Vec<u64>,
    p2p_recv: Vec<u64>,
    /// Why a call failed midway, after which none runs.
    broken: Option<String>,
    /// Collective calls queued, each ending with a write of its number to
    /// this rank's `done` word, and the stream of the last one: a call on
    /// another stream first waits for that word (the regions' reuse rests
    /// on stream order).
    calls: u64,
    /// A call has entered and not yet left (its `done` write not queued).
    open: bool,
    /// Host words: collective calls (captured ones too, counted once)
    /// whose count of reads run is queued (module docs: the end).
    reads: u64,
    last_stream: Option<usize>,
    /// Device memory for the k-input kernel's pointer table.
    table: DeviceMemory,
    /// The device has stream memory operations (the table is written with
    /// them).
    memops: bool,
    rank: usize,
    size: usize,
    /// Transport mode (module docs): this rank's slot memory registered
    /// for the transport, what its puts move from. Dropped before `own`.
    src: Option<Arc<RdmaMemory>>,
    /// Transport mode: this rank's slot memory (the window's registration
    /// of it goes with the window, the first field).
    own: Option<Own>,
    /// IPC mode: what CUDA graph capture needs (module docs: CUDA graphs).
    graphs: Option<Graphs>,
    /// IPC mode with signals in host memory (module docs): where
    /// send/recv's words and the `done` word are, and the watchdog.
    host_words: Option<HostWords>,
}

/// IPC mode's words in host memory (module docs), and the watchdog that
/// releases the streams waiting on them (`Window`'s `StreamWatch`: one
/// lane, the calls, whose progress is the `done` word).
struct HostWords {
    /// Stopped first (field order), before the memory goes.
    watch: rmacomm_window::StreamWatch,
    /// Per peer: the send/recv chunks this rank's stream waits for from it
    /// (data) and the chunks it waits for it to have taken (credit), for
    /// naming whom a timed-out call waited for.
    expect: Arc<Vec<(AtomicU64, AtomicU64)>>,
    /// `data[r][p]`: the device address (mapped here) of rank r's word
    /// counting chunks p sent it; `credit[r][p]`: of its word counting
    /// chunks p took of what r sent it (the window's value slots p and
    /// n + p of rank r).
    data: Vec<Vec<DevicePtr>>,
    credit: Vec<Vec<DevicePtr>>,
    /// Per peer: the device address of this rank's want word (what a
    /// kernel waiting on the slot writes first, so the watchdog sees a
    /// replay's waits: `rmacomm_window::StreamRelease`) of its data and
    /// credit word (value slots p and n + p here).
    wants: Vec<(DevicePtr, DevicePtr)>,
    /// The device address of this rank's count of collective calls whose
    /// reads of the peers' regions have run (value slot 2n here), which the
    /// peers read before their slots go (module docs: the end).
    reads: DevicePtr,
    /// The `done` word's registration for the device, dropped before the
    /// segment.
    done_dev: HostRegistration,
    _done: Arc<RdmaMemory>,
}

/// CUDA graph capture in IPC mode (module docs): the signal kernels, the
/// device's counts of each peer's signals and send/recv chunks taken (host
/// memory the device maps: the host sets them at the switch), and the
/// region every call starts from once the kernels serve (`None` before the
/// first capture).
struct Graphs {
    signals: std::result::Result<SharedModule, String>,
    /// Dropped before `taken` (field order).
    taken_dev: HostRegistration,
    taken: RdmaMemory,
    ranks: usize,
    base: Option<usize>,
}

impl Drop for GpuComm {
    fn drop(&mut self) {
        if let Some(h) = &self.host_words {
            // Everything queued runs (or the watchdog releases it) before
            // the memory it uses goes: a free would wait for it forever.
            h.watch.drain();
            self.readers_done();
        }
        if self.host_slots() {
            // The device may still be reading or writing host slots (a free
            // of device memory synchronizes by itself; unmapping host memory
            // need not).
            let _ = self.ctx.synchronize();
        }
    }
}

/// Transport mode's slot memory (module docs).
enum Own {
    /// Device memory: what a verbs HCA reads and writes itself.
    Device(DeviceMemory),
    /// A shared segment of host memory, mapped for the device: on the soft
    /// provider, whose engine would otherwise copy device memory through
    /// the driver while streams wait for it. `reg` (the mapping) is
    /// dropped before `seg`.
    Host { reg: HostRegistration, seg: Arc<RdmaMemory> },
}

impl Own {
    /// Where the device reaches it.
    fn ptr(&self) -> DevicePtr {
        match self {
            Own::Device(m) => m.ptr(),
            Own::Host { reg, .. } => reg.device_ptr(),
        }
    }
}

impl Graphs {
    /// The signal kernels (loaded now: nothing may load during a capture)
    /// and the taken counts, zeroed.
    fn new(op: &'static str, win: &Window, ctx: &Arc<Context>, n: usize) -> Result<Graphs> {
        let signals = rmacomm_kernels::cuda::compile_signals(&ctx.arch()).map_err(|e| e.to_string()).and_then(|out| {
            let image = out.image();
            // SAFETY: an image NVRTC just compiled for this device.
            unsafe { SharedModule::load(ctx, &image) }.map_err(|e| e.to_string())
        });
        // The counts, then a word kernel waits write what they wait for
        // into where nothing watches it (device flags: module docs).
        let taken = win.alloc(16 * n + 8).map_err(Error::window(op))?;
        // SAFETY: the segment is kept by `taken`, dropped after the
        // registration (field order).
        let taken_dev = unsafe { ctx.register_host(taken.as_ptr(), taken.len()) }.map_err(cuda(op))?;
        Ok(Graphs { signals, taken, taken_dev, ranks: n, base: None })
    }

    /// Where the device keeps its count of `peer`'s signals taken.
    fn taken_ptr(&self, peer: usize) -> DevicePtr {
        self.taken_dev.device_ptr() + 8 * peer as u64
    }

    /// Where the device keeps its count of `peer`'s send/recv chunks taken
    /// (after the `n` counts of signals).
    fn recv_taken_ptr(&self, peer: usize) -> DevicePtr {
        self.taken_dev.device_ptr() + 8 * (self.ranks + peer) as u64
    }

    /// A word nothing reads, for the want of kernel waits on device flags.
    fn sink_ptr(&self) -> DevicePtr {
        self.taken_dev.device_ptr() + 16 * self.ranks as u64
    }
}

impl HostWords {
    /// The words of this rank and its peers (`win` has a device
    /// registration: every peer UNIFIED), this rank's `done` word, and the
    /// watchdog (module docs).
    fn new(op: &'static str, win: &Window, ctx: &Arc<Context>, timeout: Duration) -> Result<HostWords> {
        let n = win.size();
        let word = |r: usize, disp: usize| win.device_value_slot(r, disp).map_err(Error::window(op));
        let table = |base: usize| -> Result<Vec<Vec<DevicePtr>>> {
            (0..n).map(|r| (0..n).map(|p| word(r, base + p)).collect()).collect()
        };
        let (data, credit) = (table(0)?, table(n)?);
        let reads = word(win.rank(), 2 * n)?;
        let want = |disp: usize| win.device_value_want(disp).map_err(Error::window(op));
        let wants = (0..n).map(|p| Ok((want(p)?, want(n + p)?))).collect::<Result<Vec<_>>>()?;
        let done = Arc::new(win.alloc(64).map_err(Error::window(op))?);
        // SAFETY: the segment is kept by `_done`, dropped after the
        // registration (field order).
        let done_dev = unsafe { ctx.register_host(done.as_ptr(), done.len()) }.map_err(cuda(op))?;
        let mem = done.clone();
        let read = Arc::new(move |_lane: usize| mem.atomic_u64(0).map_or(0, |w| w.load(Ordering::Acquire)));
        let expect: Arc<Vec<(AtomicU64, AtomicU64)>> =
            Arc::new((0..n).map(|_| (AtomicU64::new(0), AtomicU64::new(0))).collect());
        let (release, e) = (win.stream_release(), expect.clone());
        // Peers whose send/recv counts (value slots p and n + p here) are
        // behind what the stream waits for, or what a kernel waits for (a
        // replay's).
        let missing = Arc::new(move || {
            let behind = |disp: usize, want: u64| {
                (want > 0 && release.value(disp).is_some_and(|v| v < want)) || release.value_waited(disp)
            };
            (0..n)
                .filter(|&p| behind(p, e[p].0.load(Ordering::Acquire)) || behind(n + p, e[p].1.load(Ordering::Acquire)))
                .collect()
        });
        let watch =
            rmacomm_window::StreamWatch::start(read, timeout, win.peer_watch(), win.stream_release(), Some(missing))
                .map_err(|e| Error::Unavailable {
                    backend: "native GPU".into(),
                    reason: format!("{op}: the watchdog thread: {e}"),
                })?;
        Ok(HostWords { watch, expect, data, credit, wants, reads, done_dev, _done: done })
    }

    /// The stream will wait for `n` chunks from `peer` in all (recv), or
    /// for `peer` to have taken `n` (send).
    fn expect(&self, peer: usize, data: Option<u64>, credit: Option<u64>) {
        let (d, c) = &self.expect[peer];
        if let Some(n) = data {
            d.store(n, Ordering::Release);
        }
        if let Some(n) = credit {
            c.store(n, Ordering::Release);
        }
    }

    /// Why the watchdog failed the communicator, as the collective's error.
    fn error(&self) -> Option<Error> {
        let s = self.watch.stalled()?;
        let (op, seq) = (s.op, s.seq);
        // A kernel's wait with no call of the host's in flight: a replay of
        // a CUDA graph this communicator's calls were captured in.
        let replay = op == rmacomm_window::KERNEL_WAIT;
        let (op, call) = if replay {
            ("graph replay", "a CUDA graph replay of this GPU communicator's captured calls".to_string())
        } else if seq == 0 {
            // Marked by a peer with nothing in flight here.
            (op, "a call of this GPU communicator".to_string())
        } else {
            (op, format!("call #{seq} ({op}) of this GPU communicator"))
        };
        Some(match &s.stall {
            rmacomm_window::Stall::Overdue { missing, after } => Error::Timeout {
                op,
                seq,
                missing: missing.clone(),
                waiting_for: format!(
                    "{} to run on its stream; its streams were released: what they computed since is garbage, make \
                     a new communicator",
                    if replay { format!("{call} (its wait for count {seq})") } else { format!("call #{seq}") }
                ),
                after: *after,
            },
            rmacomm_window::Stall::PeerReleased { peer } => Error::Unusable {
                op,
                reason: format!(
                    "rank {peer} failed {call} and released its streams (what they computed since, here too, is \
                     garbage): make a new communicator"
                ),
            },
            rmacomm_window::Stall::Gone { peer, error } => Error::Unusable {
                op,
                reason: format!(
                    "rank {peer} is gone ({error}) while {call} waited for it; its streams were released (what they \
                     computed since is garbage): make a new communicator"
                ),
            },
            _ => Error::Unusable { op, reason: s.to_string() },
        })
    }
}

/// Whether transport mode puts its slots in host memory: with the soft
/// provider (its engine moves every byte, and device memory's only through
/// the CUDA driver), unless `RMACOMM_GPU_SLOTS=device`; never with a verbs
/// provider (its HCA reaches device memory), unless `RMACOMM_GPU_SLOTS=host`.
fn host_slots(win: &Window) -> bool {
    match std::env::var("RMACOMM_GPU_SLOTS").as_deref() {
        Ok("host") => true,
        Ok("device") => false,
        _ => win.provider() == "soft",
    }
}

impl std::fmt::Debug for GpuComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mode = match &self.own {
            Some(Own::Host { .. }) => "transport, host slots",
            Some(Own::Device(_)) => "transport, device slots",
            None => "IPC",
        };
        write!(f, "GpuComm(rank {} of {}, {} B slots, {mode}, {})", self.rank, self.size, self.slot, self.ctx.name())
    }
}

/// The flag area after the two regions: one 8-byte word per rank, then
/// this rank's `done` word, then send/recv's words (per rank: chunks it
/// sent here, chunks it took of what this rank sent it); whole 256-byte
/// lines. The send/recv inboxes follow it ([`GpuComm::send`]).
fn flag_bytes(ranks: usize) -> usize {
    (8 * (3 * ranks + 1)).div_ceil(256) * 256
}

/// Bytes of one send/recv chunk (each rank's inbox per peer): 4 MiB, or
/// the slot size when it is smaller, and at most 64 MiB of inboxes in all
/// (64 KiB at least).
fn p2p_chunk(slot: usize, ranks: usize) -> usize {
    slot.min(4 << 20).min(((64 << 20) / ranks.max(1)).max(64 << 10)) / 64 * 64
}

/// The kernels of `op` on `dtype` and the element size, or why a reduction
/// of `len` bytes cannot be had.
fn reduction(
    what: &'static str,
    op: ReduceOp,
    dtype: DType,
    len: usize,
) -> Result<(rmacomm_kernels::cuda::Entries, usize)> {
    op.check(dtype).map_err(|source| Error::Kernel { op: what, source })?;
    let es = dtype.size();
    if !len.is_multiple_of(es) {
        return Err(Error::invalid(what, format!("{len} bytes are not whole {dtype} elements")));
    }
    let e = rmacomm_kernels::cuda::entries(op, dtype).map_err(|source| Error::Kernel { op: what, source })?;
    Ok((e, es))
}

/// The op that combines contributions already scaled by
/// [`GpuComm::scale_own`]: PREMUL_SUM's sum with factor 1 (still rounded
/// once), the op itself otherwise.
fn combined(op: ReduceOp) -> ReduceOp {
    match op {
        ReduceOp::PremulSum(_) => ReduceOp::PremulSum(1.0),
        op => op,
    }
}

fn cuda(op: &'static str) -> impl Fn(rmacomm_window::cuda::CudaError) -> Error {
    move |source| Error::Window { op, source: rmacomm_window::Error::Cuda { op, source } }
}

impl GpuComm {
    /// The GPU communicator of `group`'s ranks on `ctx`'s device
    /// (collective): two slot regions per rank and the kernels compiled
    /// for the device (NVRTC, cached per architecture). With every rank on
    /// this host, a device window whose peers map each other's slots
    /// through CUDA IPC; with some rank on another host, slots registered
    /// through the transport (module docs: transport mode).
    pub fn new(group: &Group, ctx: Arc<Context>, slot_bytes: Option<usize>, timeout: Duration) -> Result<GpuComm> {
        Self::build(group, ctx, slot_bytes, timeout, false)
    }

    /// [`new`](Self::new) in transport mode whatever the hosts: what ranks
    /// on different hosts get, here also between ranks of one host (to
    /// test it, or to compare it with IPC). `RMACOMM_GPU_TRANSPORT=1` makes
    /// `new` do the same (every rank must set it alike).
    pub fn new_through_transport(
        group: &Group,
        ctx: Arc<Context>,
        slot_bytes: Option<usize>,
        timeout: Duration,
    ) -> Result<GpuComm> {
        Self::build(group, ctx, slot_bytes, timeout, true)
    }

    fn build(
        group: &Group,
        ctx: Arc<Context>,
        slot_bytes: Option<usize>,
        timeout: Duration,
        transport: bool,
    ) -> Result<GpuComm> {
        const OP: &str = "GpuComm::new";
        let slot = slot_bytes
            .or_else(|| std::env::var("RMACOMM_GPU_SLOT_BYTES").ok().and_then(|v| v.parse().ok()))
            .unwrap_or(DEFAULT_GPU_SLOT_BYTES)
            .max(4096)
            / 64
            * 64;
        let transport = transport || std::env::var("RMACOMM_GPU_TRANSPORT").is_ok_and(|v| v == "1");
        // Every rank must lay its slot memory out alike and signal the same
        // way: a peer's words are found at this rank's offsets (a larger
        // slot on one rank put its writes past the other's memory), and a
        // rank waiting on device flags never sees host signals.
        let flags = if std::env::var("RMACOMM_GPU_FLAGS").is_ok_and(|v| v == "device") { "device" } else { "host" };
        let mine = format!("slot {slot} bytes, {flags} flags, transport mode {transport}");
        let all = group.exchange("GpuComm::new/layout", mine.as_bytes()).map_err(Error::window(OP))?;
        if let Some((p, theirs)) = all.iter().enumerate().find(|(_, v)| v.as_slice() != mine.as_bytes()) {
            return Err(Error::Mismatch {
                op: OP,
                seq: 0,
                reason: format!(
                    "rank {} has {mine}, rank {p} {} (slot_bytes, RMACOMM_GPU_SLOT_BYTES, RMACOMM_GPU_FLAGS and \
                     RMACOMM_GPU_TRANSPORT must be the same on every rank)",
                    group.rank(),
                    String::from_utf8_lossy(theirs)
                ),
            });
        }
        let n = group.size();
        // IPC mode's send/recv words: the window's value slots p (chunks
        // from p) and n + p (chunks p took); 2n: collective calls whose
        // reads have run (module docs: the end).
        // GpuComm watches its calls itself (HostWords).
        let opts =
            WindowOptions::new().timeout(timeout).unified(!transport).signal_slots(2 * n + 1).watch_stream_waits(false);
        let mut win = Window::new(group, opts).map_err(Error::window(OP))?;
        // Every rank sees the same: all peers UNIFIED, or some rank not.
        let transport = transport || !win.all_unified();
        let mut device_flags = flags == "device";
        if slot < 16 * (n + 2) {
            return Err(Error::invalid(
                OP,
                format!("slots of {slot} bytes are too small for {n} ranks (at least {} bytes)", 16 * (n + 2)),
            ));
        }
        let bytes = 2 * slot + flag_bytes(n) + n * p2p_chunk(slot, n);
        let (rank, size) = (win.rank(), win.size());
        let (slots, src, own) = if transport {
            device_flags = false;
            // Host memory (a shared segment) the device maps: the transport
            // moves it with no driver call (module docs).
            let host = || -> Result<Own> {
                let seg = Arc::new(win.alloc(bytes).map_err(Error::window(OP))?);
                let (ptr, len) = (seg.as_ptr(), seg.len());
                // SAFETY: the segment is kept by `seg`, held in `own` and by
                // both registrations below (keep_alive), so it outlives the
                // device's mapping (dropped first: field order) and every
                // operation on the registrations.
                let reg = unsafe { ctx.register_host(ptr, len) }.map_err(cuda(OP))?;
                Ok(Own::Host { reg, seg })
            };
            let own = match host_slots(&win).then(host) {
                Some(Ok(own)) => own,
                fallback => {
                    if let Some(Err(e)) = fallback {
                        // Each rank's slot memory is its own business (peers
                        // put into either kind alike).
                        tracing::warn!(
                            "{OP}: no host slots ({e}); device slots instead, which the transport's engine copies \
                             through the CUDA driver (docs/gpu.md: set CUDA_MODULE_LOADING=EAGER)"
                        );
                    }
                    Own::Device(ctx.alloc_shared(bytes).map_err(cuda(OP))?)
                }
            };
            // The slot memory twice on the window's transports: as this
            // rank's tensor (what peers put into) and as the source of its
            // puts.
            let register = || match &own {
                // SAFETY: device memory kept in `own`, dropped after the
                // window and `src` (field order).
                Own::Device(mem) => unsafe { win.register_cuda(mem.ptr(), mem.len(), ctx.ordinal() as u32) },
                Own::Host { seg, .. } => {
                    // SAFETY: the segment is kept alive by the registration
                    // itself.
                    unsafe { win.register_host(seg.as_ptr(), seg.len()) }.map(|m| m.keep_alive(seg.clone()))
                }
            };
            let reg = register().map_err(Error::window(OP))?;
            let src = register().map_err(Error::window(OP))?;
            win.tensor_register(reg, 1).map_err(Error::window(OP))?;
            let mine = own.ptr();
            let slots = (0..size).map(|p| if p == rank { mine } else { 0 }).collect();
            (slots, Some(Arc::new(src)), Some(own))
        } else {
            let mem = ctx.alloc_shared(bytes).map_err(cuda(OP))?;
            match win.tensor_register_device(mem, 1) {
                Ok(()) => {}
                // Every rank gets it alike: some rank cannot map a peer's
                // slots (GPUs without peer access, CUDA IPC refused), so
                // all go through the transport, as NCCL falls back from
                // P2P to shared memory.
                Err(e @ rmacomm_window::Error::Unreachable { .. }) => {
                    tracing::warn!("{OP}: {e}; the collectives go through the transport (transport mode) instead");
                    drop(win);
                    return Self::build(group, ctx, slot_bytes, timeout, true);
                }
                Err(e) => return Err(Error::window(OP)(e)),
            }
            let slots = (0..size).map(|p| win.map_remote_device(p).map(|m| m.0)).collect::<Result<Vec<_>, _>>();
            (slots.map_err(Error::window(OP))?, None, None)
        };
        let host_words = if transport || device_flags {
            None
        } else {
            // Every rank learns whether every rank has its words: one that
            // failed alone would leave its peers waiting in their first call.
            let words = HostWords::new(OP, &win, &ctx, timeout);
            let verdict = words.as_ref().err().map(ToString::to_string).unwrap_or_default();
            let all = group.exchange("GpuComm::new/host words", verdict.as_bytes()).map_err(Error::window(OP))?;
            if let Some((p, why)) = all.iter().enumerate().find(|(_, v)| !v.is_empty()) {
                return Err(Error::Unavailable {
                    backend: "native GPU".into(),
                    reason: format!(
                        "{OP}: rank {p} cannot keep its signals in host memory ({}); RMACOMM_GPU_FLAGS=device on every \
                         rank keeps them in device memory",
                        String::from_utf8_lossy(why)
                    ),
                });
            }
            Some(words?)
        };
        let memops = ctx.stream_mem_ops().unwrap_or(false);
        let graphs = if transport {
            if !memops {
                return Err(Error::Unavailable {
                    backend: "native GPU".into(),
                    reason: format!(
                        "{OP}: transport mode (ranks on other hosts, or GPUs without peer access between them) needs \
                         64-bit stream memory operations, which {} lacks (the stream proxy waits on them)",
                        ctx.name()
                    ),
                });
            }
            None
        } else {
            let mut g = Graphs::new(OP, &win, &ctx, size)?;
            if !memops {
                // The signal kernels from the start (module docs).
                if let Err(e) = &g.signals {
                    return Err(Error::Unavailable {
                        backend: "native GPU".into(),
                        reason: format!(
                            "{OP}: {} has no 64-bit stream memory operations, and the signal kernels that stand in \
                             for them are missing ({e})",
                            ctx.name()
                        ),
                    });
                }
                g.base = Some(0);
            }
            Some(g)
        };
        let out = rmacomm_kernels::cuda::compile(&ctx.arch()).map_err(|source| Error::Kernel { op: OP, source })?;
        let image = out.image();
        // SAFETY: a cubin NVRTC just wrote for this device's architecture.
        let module = unsafe { SharedModule::load(&ctx, &image) }.map_err(cuda(OP))?;
        let table = ctx.alloc_shared(8 * size).map_err(cuda(OP))?;
        let (sent, taken) = (vec![0; size], vec![0; size]);
        let (p2p_sent, p2p_recv) = (vec![0; size], vec![0; size]);
        Ok(GpuComm {
            win,
            ctx,
            module,
            slots,
            slot,
            parity: 0,
            device_flags,
            sent,
            taken,
            p2p_sent,
            p2p_recv,
            broken: None,
            calls: 0,
            open: false,
            reads: 0,
            last_stream: None,
            memops,
            table,
            rank,
            size,
            src,
            own,
            graphs,
            host_words,
        })
    }

    /// Calls queued so far (the n-th is call number n), outside CUDA graph
    /// captures: what [`call_done`](Self::call_done) takes.
    pub fn calls_queued(&self) -> u64 {
        self.calls
    }

    /// Whether call number `call` has run on its stream, read from host
    /// memory with no driver call: `Some(Ok(()))` once it has,
    /// `Some(Err(_))` once the watchdog failed the communicator (a peer
    /// gone, or the timeout passed: module docs), `None` meanwhile — and
    /// always where nothing watches (`RMACOMM_GPU_FLAGS=device`, transport
    /// mode: there the window's stream proxy fails what waits too long).
    pub fn call_done(&self, call: u64) -> Option<Result<()>> {
        let h = self.host_words.as_ref()?;
        match h.watch.done(0, call)? {
            Ok(()) => Some(Ok(())),
            Err(_) => h.error().map(Err),
        }
    }

    /// `Ok` while this communicator is usable; else the error its next call
    /// would fail with: the watchdog failed it (a peer gone, or waits
    /// overdue, in a call or in a CUDA graph's replay), or a call failed
    /// midway. Reads host memory only.
    pub fn check(&self) -> Result<()> {
        self.usable("check")
    }

    /// Whether this communicator moves data through the transport (module
    /// docs: transport mode) rather than CUDA IPC.
    pub fn through_transport(&self) -> bool {
        self.src.is_some()
    }

    /// Transport mode: `len` bytes of this rank's slot memory at `from`
    /// into rank `p`'s at `to`, in the stream's order (the stream waits
    /// until they are placed); to this rank, a copy.
    #[allow(clippy::too_many_arguments)]
    fn put(&self, op: &'static str, from: u64, len: usize, p: usize, to: u64, stream: &Stream) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        if p == self.rank {
            return self.copy(op, self.slots[p] + to, self.slots[p] + from, len, stream);
        }
        let src = self.src.as_ref().expect("transport mode").clone();
        self.win.put_on_stream(src, from as usize, len, p, to as usize, stream).map(drop).map_err(Error::window(op))
    }

    /// Whether this communicator's slots are host memory the device maps
    /// (transport mode on the soft provider: module docs).
    pub fn host_slots(&self) -> bool {
        matches!(self.own, Some(Own::Host { .. }))
    }

    /// Transport mode: a failed stream operation of an earlier call fails
    /// this one.
    fn check_stream(&self, op: &'static str) -> Result<()> {
        match self.win.stream_error() {
            Some(e) => Err(Error::window(op)(e)),
            None => Ok(()),
        }
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The device's context.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// Every peer signals every other; then the stream waits for all.
    fn exchange(&mut self, op: &'static str, stream: &Stream) -> Result<()> {
        let peers = (0..self.size).filter(|p| *p != self.rank);
        if !self.device_flags {
            for p in peers.clone() {
                self.win.signal_on_stream(p, stream).map_err(Error::window(op))?;
            }
            for p in peers {
                self.win.wait_signal_on_stream(p, stream).map_err(Error::window(op))?;
            }
            return Ok(());
        }
        let flags = |r: usize| self.slots[r] + 2 * self.slot as u64;
        if let Some(Graphs { signals: Ok(m), base: Some(_), .. }) = &self.graphs {
            // The signal kernels (module docs: CUDA graphs): counts the
            // device keeps, so that every replay signals and waits again.
            let g = self.graphs.as_ref().expect("matched above");
            for p in peers.clone() {
                let word = flags(p) + 8 * self.rank as u64;
                // SAFETY: this rank's word of the peer's flag area, mapped
                // while the window lives.
                unsafe { m.launch_on(stream, "rmacomm_signal_next", 1, 32, &[Arg::U64(word)]) }.map_err(cuda(op))?;
            }
            for p in peers {
                let args =
                    [Arg::U64(g.taken_ptr(p)), Arg::U64(flags(self.rank) + 8 * p as u64), Arg::U64(g.sink_ptr())];
                // SAFETY: this rank's count of p's signals and the sink
                // (host memory mapped for the device, alive with the
                // communicator) and p's word of this rank's flag area.
                unsafe { m.launch_on(stream, "rmacomm_wait_next", 1, 32, &args) }.map_err(cuda(op))?;
            }
            return Ok(());
        }
        for p in peers.clone() {
            // SAFETY: this rank's word of the peer's flag area, mapped while
            // the window lives (dropping it synchronizes the context first).
            unsafe { stream.write_value64(flags(p) + 8 * self.rank as u64, self.sent[p] + 1) }.map_err(cuda(op))?;
            self.sent[p] += 1;
        }
        for p in peers {
            // SAFETY: as above, the peer's word of this rank's flag area.
            unsafe { stream.wait_value64_geq(flags(self.rank) + 8 * p as u64, self.taken[p] + 1) }.map_err(cuda(op))?;
            self.taken[p] += 1;
        }
        Ok(())
    }

    /// After a collective call's reads of the peers' regions: one more in
    /// this rank's count of them (host words; module docs: the end), by the
    /// signal kernel once they serve (so a captured call's replays count
    /// too), else by a stream write of the host's count.
    fn reads_run(&mut self, op: &'static str, stream: &Stream) -> Result<()> {
        let Some(word) = self.host_words.as_ref().map(|h| h.reads) else { return Ok(()) };
        match self.kernels() {
            // SAFETY: this rank's value slot, host memory mapped for the
            // device while the window lives.
            Some(m) => unsafe { m.launch_on(stream, "rmacomm_signal_next", 1, 32, &[Arg::U64(word)]) },
            // SAFETY: as above.
            None => unsafe { stream.write_value64(word, self.reads + 1) },
        }
        .map_err(cuda(op))?;
        self.reads += 1;
        Ok(())
    }

    /// Before this rank's slots go (module docs: the end): waits until
    /// every peer's count of collective calls whose reads have run reaches
    /// this rank's, or the peer is gone (then it reads nothing more), for
    /// at most the window's timeout (then warns and lets them go).
    fn readers_done(&self) {
        const OP: &str = "GpuComm drop";
        if self.host_words.is_none() {
            return;
        }
        let (disp, timeout) = (2 * self.size, self.win.timeout());
        let released = self.win.stream_release().released().is_some();
        let target = match self.kernels() {
            Some(_) if !released => {
                // Replays no host call counted: the device's own count,
                // once it ran what was queued.
                if self.ctx.synchronize_within(timeout).is_none() {
                    tracing::warn!(
                        "{OP} (rank {}): the device had not run its queued work after {timeout:?}",
                        self.rank
                    );
                }
                self.win.read_peer_signal(self.rank, disp).unwrap_or(self.reads)
            }
            _ => self.reads,
        };
        if target == 0 {
            return;
        }
        let peers = self.win.peer_watch();
        // No deadline for a timeout past what the clock counts (Duration::MAX: wait for ever).
        let deadline = std::time::Instant::now().checked_add(timeout);
        loop {
            let behind: Vec<(usize, u64)> = (0..self.size)
                .filter(|p| *p != self.rank && peers.gone_among(&[*p]).is_none())
                .filter_map(|p| self.win.read_peer_signal(p, disp).ok().filter(|v| *v < target).map(|v| (p, v)))
                .collect();
            if behind.is_empty() {
                return;
            }
            if deadline.is_some_and(|d| std::time::Instant::now() >= d) {
                let who: Vec<String> = behind.iter().map(|(p, v)| format!("rank {p} at {v}")).collect();
                tracing::warn!(
                    "{OP} (rank {}): {} had not run the reads of this rank's slots that {target} collective calls \
                     make after {timeout:?}; its slots are freed anyway",
                    self.rank,
                    who.join(", ")
                );
                return;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// This rank's `done` word (host memory; else last in its flag area).
    fn done_word(&self) -> DevicePtr {
        match &self.host_words {
            Some(h) => h.done_dev.device_ptr(),
            None => self.slots[self.rank] + (2 * self.slot + 8 * self.size) as u64,
        }
    }

    /// Before a call's work: the watchdog learns of it (before any of its
    /// waits is queued); on a stream other than the last call's, wait for
    /// the last call to have run.
    fn enter(&mut self, op: &'static str, stream: &Stream) -> Result<()> {
        if let Some(h) = &self.host_words {
            h.watch.issued(0, self.calls + 1, op);
        }
        self.open = true;
        if self.last_stream.is_some_and(|s| s != stream.raw()) {
            let (done, calls) = (self.done_word(), self.calls);
            if !self.memops {
                // No stream memory operations: the spin-wait kernel.
                // SAFETY: the kernel's parameters: this rank's own flag
                // area (alive with the window) and a count.
                return unsafe {
                    self.module.launch_on(stream, "rmacomm_wait_geq", 1, 32, &[Arg::U64(done), Arg::U64(calls)])
                }
                .map_err(cuda(op));
            }
            // SAFETY: this rank's own flag area, alive with the window.
            unsafe { stream.wait_value64_geq(done, calls) }.map_err(cuda(op))?;
        }
        Ok(())
    }

    /// After a call's work: its number into the `done` word.
    fn leave(&mut self, op: &'static str, stream: &Stream) -> Result<()> {
        match self.kernels().filter(|_| !self.memops) {
            // No stream memory operations: one more, by the signal kernel
            // (the word counts calls; only this rank writes it).
            // SAFETY: as in `enter`.
            Some(m) => unsafe { m.launch_on(stream, "rmacomm_signal_next", 1, 32, &[Arg::U64(self.done_word())]) },
            // SAFETY: as in `enter`.
            None => unsafe { stream.write_value64(self.done_word(), self.calls + 1) },
        }
        .map_err(cuda(op))?;
        self.calls += 1;
        self.open = false;
        self.last_stream = Some(stream.raw());
        Ok(())
    }

    /// A call that failed after [`enter`](Self::enter) still writes its
    /// number into the `done` word, after whatever it queued: its waits may
    /// be queued already, and the watchdog, which releases them, knows the
    /// call is over when the number lands.
    fn close_failed(&mut self, op: &'static str, stream: &Stream, r: Result<()>) -> Result<()> {
        if r.is_err() && self.open {
            let _ = self.leave(op, stream);
        }
        r
    }

    /// Runs a collective call's uses (module docs): `f(self, off, clen,
    /// at)` for each chunk of `len` bytes of at most `step`, `at` the
    /// region's offset, between [`enter`](Self::enter) and
    /// [`leave`](Self::leave).
    fn uses(
        &mut self,
        op: &'static str,
        len: usize,
        step: usize,
        stream: &Stream,
        mut f: impl FnMut(&mut Self, usize, usize, u64) -> Result<()>,
    ) -> Result<()> {
        self.usable(op)?;
        let capturing = self.capture(op, stream)?;
        if self.through_transport() {
            self.check_stream(op)?;
        }
        let base = self.graphs.as_ref().and_then(|g| g.base);
        let reads = self.reads;
        let mut run = || -> Result<()> {
            // A captured call stays out of the done word's count (its
            // replays are not the host's to count: the caller orders them).
            if !capturing {
                self.enter(op, stream)?;
            }
            if let Some(b) = base {
                self.parity = b;
            }
            let (mut off, mut n) = (0, 0);
            while off < len {
                let clen = step.min(len - off);
                let at = self.next_region();
                f(self, off, clen, at)?;
                off += clen;
                n += 1;
            }
            if base.is_some() && n % 2 == 1 {
                // Every call an even number of uses from the same region
                // (module docs): one more exchange, nothing written.
                self.next_region();
                self.exchange(op, stream)?;
            }
            self.reads_run(op, stream)?;
            if capturing {
                return Ok(());
            }
            self.leave(op, stream)
        };
        let r = run();
        if r.is_err() && self.open && self.reads == reads {
            // What the failed call queued of its reads runs before the
            // count (stream order).
            let _ = self.reads_run(op, stream);
        }
        let r = self.close_failed(op, stream, r);
        self.mark(op, r)
    }

    /// Refuses a call of `what` on a stream that is capturing a CUDA graph,
    /// before anything is queued (the capture and this communicator stay
    /// usable).
    fn not_capturing(&self, op: &'static str, what: &str, stream: &Stream) -> Result<()> {
        if stream.is_capturing().map_err(cuda(op))? {
            return Err(Error::invalid(
                op,
                format!(
                    "the stream is capturing a CUDA graph, and {what} of the native GPU backend is not capturable \
                     (its signal counts are fixed when queued: a replay would not wait for the peers); call it \
                     outside the capture, or use the nccl backend for captured collectives"
                ),
            ));
        }
        Ok(())
    }

    /// Whether `stream` is capturing a CUDA graph, which the collectives of
    /// IPC mode allow (module docs: CUDA graphs): the first capture
    /// switches this communicator to the signal kernels for good. Refused,
    /// before anything is queued, in transport mode (the stream proxy is
    /// not capturable), on a device without stream memory operations, or
    /// without the signal kernels.
    fn capture(&mut self, op: &'static str, stream: &Stream) -> Result<bool> {
        if !stream.is_capturing().map_err(cuda(op))? {
            return Ok(false);
        }
        let why = match &self.graphs {
            None => {
                Some("collectives in transport mode (across hosts, or between GPUs without peer access)".to_string())
            }
            Some(_) if !self.memops => Some("collectives on a device without stream memory operations".to_string()),
            Some(Graphs { signals: Err(e), .. }) => Some(format!("collectives without the signal kernels ({e})")),
            Some(_) => None,
        };
        if let Some(what) = why {
            return self.not_capturing(op, &what, stream).map(|()| false);
        }
        let g = self.graphs.as_mut().expect("checked above");
        if g.base.is_none() {
            // The kernels go on from the host's counts of waits queued so
            // far (they run before anything queued after them); signals
            // need none (each adds one to the count the peer's word holds).
            let n = self.size;
            let counts = self.taken.iter().chain(&self.p2p_recv);
            for (i, t) in counts.enumerate().take(2 * n) {
                let word = g.taken.atomic_u64(8 * i);
                let word = word.map_err(|source| Error::window(op)(rmacomm_window::Error::Transport { op, source }))?;
                word.store(*t, std::sync::atomic::Ordering::Release);
            }
            g.base = Some(self.parity);
        }
        Ok(true)
    }

    /// The signal kernels, once they serve (after the first capture).
    fn kernels(&self) -> Option<&SharedModule> {
        match &self.graphs {
            Some(Graphs { signals: Ok(m), base: Some(_), .. }) => Some(m),
            _ => None,
        }
    }

    /// A call that failed midway leaves the ranks' counts out of step:
    /// every later call fails, saying so.
    fn usable(&self, op: &'static str) -> Result<()> {
        if let Some(e) = self.host_words.as_ref().and_then(HostWords::error) {
            return Err(e);
        }
        match &self.broken {
            Some(why) => Err(Error::Unavailable {
                backend: "native GPU".into(),
                reason: format!(
                    "{op}: this GPU communicator stopped when an earlier call failed midway ({why}); the ranks' \
                     signal counts are out of step: make a new communicator"
                ),
            }),
            None => Ok(()),
        }
    }

    fn mark(&mut self, op: &'static str, r: Result<()>) -> Result<()> {
        if let Err(e) = &r {
            self.broken.get_or_insert_with(|| format!("{op}: {e}"));
        }
        r
    }

    /// Block j (`clen` bytes at `off` of the j-th `len`-byte block of
    /// `input`) into slot j of this rank's region at `at`: what
    /// all_to_all and reduce_scatter send.
    #[allow(clippy::too_many_arguments)]
    fn blocks_in(
        &self,
        op: &'static str,
        input: DevicePtr,
        len: usize,
        off: usize,
        clen: usize,
        at: u64,
        stream: &Stream,
    ) -> Result<()> {
        for p in 0..self.size {
            let dst = self.slots[self.rank] + at + (p * clen) as u64;
            self.copy(op, dst, input + (p * len + off) as u64, clen, stream)?;
        }
        Ok(())
    }

    /// Transport mode, all_to_all and reduce_scatter: block j of the chunk
    /// staged at the region's start, then put to rank j, which receives
    /// block i from rank i at slot i of the region's second half; then the
    /// exchange. Returns where that second half starts.
    #[allow(clippy::too_many_arguments)]
    fn blocks_out(
        &mut self,
        op: &'static str,
        input: DevicePtr,
        len: usize,
        off: usize,
        clen: usize,
        at: u64,
        stream: &Stream,
    ) -> Result<u64> {
        self.blocks_in(op, input, len, off, clen, at, stream)?;
        self.blocks_send(op, clen, at, stream)
    }

    /// Transport mode: the blocks staged at the region's start (by
    /// [`blocks_in`](Self::blocks_in)) put to their ranks, then the
    /// exchange (see [`blocks_out`](Self::blocks_out)).
    fn blocks_send(&mut self, op: &'static str, clen: usize, at: u64, stream: &Stream) -> Result<u64> {
        let recv = at + (self.size * clen) as u64;
        for p in 0..self.size {
            self.put(op, at + (p * clen) as u64, clen, p, recv + (self.rank * clen) as u64, stream)?;
        }
        self.exchange(op, stream)?;
        Ok(recv)
    }

    /// The region the next use writes (the same on every rank): its offset
    /// in each rank's slot memory.
    fn next_region(&mut self) -> u64 {
        let at = (self.parity * self.slot) as u64;
        self.parity ^= 1;
        at
    }

    /// The elements of a chunk of `elems` that rank `r` reduces.
    fn share(&self, r: usize, elems: usize) -> (usize, usize) {
        (r * elems / self.size, (r + 1) * elems / self.size)
    }

    /// Scales this rank's own staged contribution (`count` elements at
    /// `at`) in place by PREMUL_SUM's factor before any rank combines it:
    /// each rank its own factor, NCCL's Σ fᵣ·xᵣ (the reduction then sums
    /// them: [`combined`]). Nothing for the other ops.
    fn scale_own(
        &self,
        what: &'static str,
        e: &rmacomm_kernels::cuda::Entries,
        op: ReduceOp,
        at: DevicePtr,
        count: usize,
        stream: &Stream,
    ) -> Result<()> {
        match op {
            // One input, this factor, in place (elementwise).
            ReduceOp::PremulSum(f) if f != 1.0 && count > 0 => {
                self.reduce_kernel(what, e, op, at, &[at], count, stream)
            }
            _ => Ok(()),
        }
    }

    /// `out[i] = op(inputs[0][i], ..)` for `count` elements, queued: the
    /// pointer table uploaded, then one k-input kernel.
    #[allow(clippy::too_many_arguments)]
    fn reduce_kernel(
        &self,
        what: &'static str,
        e: &rmacomm_kernels::cuda::Entries,
        op: ReduceOp,
        out: DevicePtr,
        inputs: &[DevicePtr],
        count: usize,
        stream: &Stream,
    ) -> Result<()> {
        if self.memops {
            // One 64-bit stream write per pointer: a copy from pageable host
            // memory may wait for the stream to get there, holding up the
            // host while the peers wait for its next signals.
            for (j, p) in inputs.iter().enumerate() {
                // SAFETY: word j of the table (n words); the stream orders
                // the write after the kernel that read the previous table.
                unsafe { stream.write_value64(self.table.ptr() + 8 * j as u64, *p) }.map_err(cuda(what))?;
            }
        } else {
            let table: Vec<u8> = inputs.iter().flat_map(|p| p.to_ne_bytes()).collect();
            // SAFETY: the table holds n pointers; the stream orders this
            // upload after the kernel that read the previous table.
            unsafe { stream.upload_async(self.table.ptr(), &table) }.map_err(cuda(what))?;
        }
        let grid = count.div_ceil(256).min(4096) as u32;
        let (n, count) = (inputs.len(), count as u64);
        let (tab, k) = (Arg::U64(self.table.ptr()), Arg::U32(n as u32));
        let (name, args) = match (&e.full, op) {
            (Some(full), ReduceOp::PremulSum(f)) => {
                (full, vec![Arg::U64(out), tab, k, Arg::U64(count), Arg::F64(f), Arg::U64(1)])
            }
            (Some(full), _) => (full, vec![Arg::U64(out), tab, k, Arg::U64(count), Arg::F64(1.0), Arg::U64(n as u64)]),
            (None, _) => (&e.nary, vec![Arg::U64(out), tab, k, Arg::U64(count)]),
        };
        // SAFETY: the entry point's parameters, in order; every pointer is
        // inside a rank's slot memory mapped here, or the caller's buffer.
        unsafe { self.module.launch_on(stream, name, grid, 256, &args) }.map_err(cuda(what))
    }

    fn copy(&self, what: &'static str, dst: DevicePtr, src: DevicePtr, len: usize, stream: &Stream) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        if self.host_slots() {
            // SAFETY: as below; host slots are reached through their device
            // mapping, a copy of either kind.
            return unsafe { stream.copy_any_async(dst, src, len) }.map_err(cuda(what));
        }
        // SAFETY: the callers pass ranges inside slot memory or the caller's
        // buffers (their contract).
        unsafe { stream.copy_async(dst, src, len) }.map_err(cuda(what))
    }

    /// Offset in a rank's slot memory of send/recv word `i` of its flag
    /// area: `data(p)` = chunks `p` sent here, `credit(p)` = chunks `p`
    /// took of what was sent to it.
    fn p2p_word(&self, i: usize) -> u64 {
        (2 * self.slot + 8 * (self.size + 1) + 8 * i) as u64
    }

    fn data_word(&self, from: usize) -> u64 {
        self.p2p_word(from)
    }

    fn credit_word(&self, from: usize) -> u64 {
        self.p2p_word(self.size + from)
    }

    /// The device address (mapped here) of rank `at`'s word counting chunks
    /// `from` sent it: host memory (module docs), or `at`'s flag area.
    fn data_at(&self, at: usize, from: usize) -> DevicePtr {
        match &self.host_words {
            Some(h) => h.data[at][from],
            None => self.slots[at] + self.data_word(from),
        }
    }

    /// The device address of rank `at`'s word counting chunks `from` took
    /// of what `at` sent it.
    fn credit_at(&self, at: usize, from: usize) -> DevicePtr {
        match &self.host_words {
            Some(h) => h.credit[at][from],
            None => self.slots[at] + self.credit_word(from),
        }
    }

    /// Where a kernel waiting on this rank's data / credit word for `peer`
    /// writes what it waits for (host words: the window's want words, which
    /// the watchdog reads; device flags: a word nothing reads).
    fn want_at(&self, peer: usize) -> (DevicePtr, DevicePtr) {
        match (&self.host_words, &self.graphs) {
            (Some(h), _) => h.wants[peer],
            (None, Some(g)) => (g.sink_ptr(), g.sink_ptr()),
            (None, None) => (0, 0),
        }
    }

    /// Offset in a rank's slot memory of its inbox for chunks from `from`
    /// (this rank's own is the transport mode's outbox).
    fn inbox(&self, from: usize) -> u64 {
        (2 * self.slot + flag_bytes(self.size) + from * p2p_chunk(self.slot, self.size)) as u64
    }

    /// Writes `value` into send/recv word `word` (an offset in the flag
    /// area, `addr` where it is mapped here) of rank `p`, on the stream:
    /// through the mapping, or, in transport mode, staged in this rank's
    /// own copy of that word and put.
    fn post_word(
        &self,
        op: &'static str,
        p: usize,
        (word, addr): (u64, DevicePtr),
        value: u64,
        stream: &Stream,
    ) -> Result<()> {
        if self.through_transport() {
            // This rank's own copy of the word is not used otherwise (its
            // data and credit words for itself): the put reads it after
            // the write (stream order), and completes before the next.
            // SAFETY: a word of this rank's slot memory, alive with it.
            unsafe { stream.write_value64(self.slots[self.rank] + word, value) }.map_err(cuda(op))?;
            return self.put(op, word, 8, p, word, stream);
        }
        // SAFETY: the peer's word, mapped while the window lives.
        unsafe { stream.write_value64(addr, value) }.map_err(cuda(op))
    }

    /// Sends `len` bytes at `buf` (device memory) to rank `dst`'s matching
    /// [`recv`](Self::recv), queued on `stream`. The bytes go in chunks of
    /// up to 4 MiB (the slot size when smaller) through `dst`'s inbox for
    /// this rank — copied through the IPC mapping, or put through the
    /// transport — each announced with a count in `dst`'s flag area; a
    /// chunk waits until `dst` took the one before (its count back here),
    /// so a message of one chunk is buffered and a send returns, on its
    /// stream, without waiting for the receiver; a longer one needs the
    /// receiver to be receiving (order sends and receives as with NCCL: a
    /// ring of longer messages sends on even ranks first and receives on
    /// odd ones). Sends to one peer are received in order.
    ///
    /// # Safety
    /// `len` bytes at `buf` must be device memory of this device valid until
    /// the stream has run the send.
    pub unsafe fn send(&mut self, buf: DevicePtr, len: usize, dst: usize, stream: &Stream) -> Result<()> {
        const OP: &str = "send";
        self.p2p_chunks(OP, dst, len, stream, |c, off, clen| {
            if let Some(m) = c.kernels() {
                // The signal kernels (module docs: CUDA graphs): wait until
                // dst took every chunk this rank sent it (its count here
                // reaching this rank's count there), copy, count one more.
                let sent = c.data_at(dst, c.rank);
                let args = [Arg::U64(c.credit_at(c.rank, dst)), Arg::U64(sent), Arg::U64(c.want_at(dst).1)];
                // SAFETY: a word of this rank's flag area, this rank's word
                // of dst's, and a want word here, mapped while the window
                // lives.
                unsafe { m.launch_on(stream, "rmacomm_wait_reach", 1, 32, &args) }.map_err(cuda(OP))?;
                let to = c.inbox(c.rank);
                c.copy(OP, c.slots[dst] + to, buf + off as u64, clen, stream)?;
                // SAFETY: as above.
                return unsafe { m.launch_on(stream, "rmacomm_signal_next", 1, 32, &[Arg::U64(sent)]) }
                    .map_err(cuda(OP));
            }
            let n = c.p2p_sent[dst] + 1;
            if n > 1 {
                // dst took the chunk before: its inbox is free again.
                let at = c.credit_at(c.rank, dst);
                if let Some(h) = &c.host_words {
                    h.expect(dst, None, Some(n - 1));
                }
                // SAFETY: a word of this rank's (flag area or host words).
                unsafe { stream.wait_value64_geq(at, n - 1) }.map_err(cuda(OP))?;
            }
            let to = c.inbox(c.rank);
            if c.through_transport() {
                c.copy(OP, c.slots[c.rank] + to, buf + off as u64, clen, stream)?;
                c.put(OP, to, clen, dst, to, stream)?;
            } else {
                c.copy(OP, c.slots[dst] + to, buf + off as u64, clen, stream)?;
            }
            c.post_word(OP, dst, (c.data_word(c.rank), c.data_at(dst, c.rank)), n, stream)?;
            c.p2p_sent[dst] = n;
            Ok(())
        })
    }

    /// Receives `len` bytes from rank `src`'s matching [`send`](Self::send)
    /// into `buf` (device memory), queued on `stream`.
    ///
    /// # Safety
    /// As for [`send`](Self::send), for `buf` written.
    pub unsafe fn recv(&mut self, buf: DevicePtr, len: usize, src: usize, stream: &Stream) -> Result<()> {
        const OP: &str = "recv";
        self.p2p_chunks(OP, src, len, stream, |c, off, clen| {
            let own = c.slots[c.rank];
            if let (Some(m), Some(g)) = (c.kernels(), c.graphs.as_ref()) {
                // The signal kernels: wait for one more chunk than the
                // device counted taken, copy, count it taken at src.
                let args =
                    [Arg::U64(g.recv_taken_ptr(src)), Arg::U64(c.data_at(c.rank, src)), Arg::U64(c.want_at(src).0)];
                // SAFETY: this rank's count of src's chunks taken and a want
                // word (host memory mapped for the device) and src's word
                // of this rank's flag area.
                unsafe { m.launch_on(stream, "rmacomm_wait_next", 1, 32, &args) }.map_err(cuda(OP))?;
                c.copy(OP, buf + off as u64, own + c.inbox(src), clen, stream)?;
                let credit = c.credit_at(src, c.rank);
                // SAFETY: this rank's word of src's flag area, mapped while
                // the window lives.
                return unsafe { m.launch_on(stream, "rmacomm_signal_next", 1, 32, &[Arg::U64(credit)]) }
                    .map_err(cuda(OP));
            }
            let n = c.p2p_recv[src] + 1;
            if let Some(h) = &c.host_words {
                h.expect(src, Some(n), None);
            }
            // SAFETY: a word of this rank's (flag area or host words).
            unsafe { stream.wait_value64_geq(c.data_at(c.rank, src), n) }.map_err(cuda(OP))?;
            c.copy(OP, buf + off as u64, own + c.inbox(src), clen, stream)?;
            c.post_word(OP, src, (c.credit_word(c.rank), c.credit_at(src, c.rank)), n, stream)?;
            c.p2p_recv[src] = n;
            Ok(())
        })
    }

    /// send / recv with `peer`: `f(self, off, clen)` for each chunk of
    /// `len` bytes, between [`enter`](Self::enter) and
    /// [`leave`](Self::leave).
    fn p2p_chunks(
        &mut self,
        op: &'static str,
        peer: usize,
        len: usize,
        stream: &Stream,
        mut f: impl FnMut(&mut Self, usize, usize) -> Result<()>,
    ) -> Result<()> {
        if peer >= self.size || peer == self.rank {
            return Err(Error::invalid(
                op,
                format!("rank {peer} is not a peer of rank {} of {}", self.rank, self.size),
            ));
        }
        self.usable(op)?;
        let capturing = self.capture(op, stream)?;
        if self.through_transport() {
            self.check_stream(op)?;
        }
        let chunk = p2p_chunk(self.slot, self.size);
        let mut run = || -> Result<()> {
            if !capturing {
                self.enter(op, stream)?;
            }
            let mut off = 0;
            while off < len {
                let clen = chunk.min(len - off);
                f(self, off, clen)?;
                off += clen;
            }
            if capturing {
                return Ok(());
            }
            self.leave(op, stream)
        };
        let r = run();
        let r = self.close_failed(op, stream, r);
        self.mark(op, r)
    }

    /// Broadcasts `root`'s `len` bytes at `buf` into every rank's `buf`,
    /// queued on `stream` (collective).
    ///
    /// # Safety
    /// As for [`all_reduce`](Self::all_reduce).
    pub unsafe fn broadcast(&mut self, buf: DevicePtr, len: usize, root: usize, stream: &Stream) -> Result<()> {
        const OP: &str = "broadcast";
        if root >= self.size {
            return Err(Error::invalid(OP, format!("root {root} is not a rank of {}", self.size)));
        }
        if self.through_transport() {
            return self.uses(OP, len, self.slot, stream, |c, off, clen, at| {
                let own = c.slots[c.rank];
                if c.rank == root {
                    c.copy(OP, own + at, buf + off as u64, clen, stream)?;
                    for p in (0..c.size).filter(|p| *p != root) {
                        c.put(OP, at, clen, p, at, stream)?;
                    }
                }
                c.exchange(OP, stream)?;
                if c.rank != root {
                    c.copy(OP, buf + off as u64, own + at, clen, stream)?;
                }
                Ok(())
            });
        }
        self.uses(OP, len, self.slot, stream, |c, off, clen, at| {
            if c.rank == root {
                c.copy(OP, c.slots[root] + at, buf + off as u64, clen, stream)?;
            }
            c.exchange(OP, stream)?;
            if c.rank != root {
                c.copy(OP, buf + off as u64, c.slots[root] + at, clen, stream)?;
            }
            Ok(())
        })
    }

    /// Gathers every rank's `len` bytes at `input` into `output` (size ×
    /// `len`, rank order), queued on `stream` (collective).
    ///
    /// # Safety
    /// As for [`all_reduce`](Self::all_reduce), for both buffers.
    pub unsafe fn all_gather(
        &mut self,
        output: DevicePtr,
        input: DevicePtr,
        len: usize,
        stream: &Stream,
    ) -> Result<()> {
        const OP: &str = "all_gather_single";
        if self.through_transport() {
            let step = (self.slot / self.size).max(1);
            return self.uses(OP, len, step, stream, |c, off, clen, at| {
                let (me, own) = (c.rank, c.slots[c.rank]);
                let mine = at + (me * clen) as u64;
                c.copy(OP, own + mine, input + off as u64, clen, stream)?;
                for p in (0..c.size).filter(|p| *p != me) {
                    c.put(OP, mine, clen, p, mine, stream)?;
                }
                c.exchange(OP, stream)?;
                for p in 0..c.size {
                    c.copy(OP, output + (p * len + off) as u64, own + at + (p * clen) as u64, clen, stream)?;
                }
                Ok(())
            });
        }
        self.uses(OP, len, self.slot, stream, |c, off, clen, at| {
            c.copy(OP, c.slots[c.rank] + at, input + off as u64, clen, stream)?;
            c.exchange(OP, stream)?;
            for p in 0..c.size {
                c.copy(OP, output + (p * len + off) as u64, c.slots[p] + at, clen, stream)?;
            }
            Ok(())
        })
    }

    /// Block j (of `size` blocks of `len` bytes) of every rank's `input`
    /// goes to rank j, into block i (from rank i) of its `output`, queued
    /// on `stream` (collective).
    ///
    /// # Safety
    /// As for [`all_reduce`](Self::all_reduce); both buffers hold size ×
    /// `len` bytes.
    pub unsafe fn all_to_all(
        &mut self,
        output: DevicePtr,
        input: DevicePtr,
        len: usize,
        stream: &Stream,
    ) -> Result<()> {
        const OP: &str = "all_to_all_single";
        if self.through_transport() {
            let step = (self.slot / (2 * self.size)).max(1);
            return self.uses(OP, len, step, stream, |c, off, clen, at| {
                let recv = c.blocks_out(OP, input, len, off, clen, at, stream)?;
                for p in 0..c.size {
                    c.copy(
                        OP,
                        output + (p * len + off) as u64,
                        c.slots[c.rank] + recv + (p * clen) as u64,
                        clen,
                        stream,
                    )?;
                }
                Ok(())
            });
        }
        let step = (self.slot / self.size).max(1);
        self.uses(OP, len, step, stream, |c, off, clen, at| {
            c.blocks_in(OP, input, len, off, clen, at, stream)?;
            c.exchange(OP, stream)?;
            for p in 0..c.size {
                let src = c.slots[p] + at + (c.rank * clen) as u64;
                c.copy(OP, output + (p * len + off) as u64, src, clen, stream)?;
            }
            Ok(())
        })
    }

    /// Reduces block j (of `size` blocks of `len` bytes) of every rank's
    /// `input` with `op` into rank j's `output` (`len` bytes), queued on
    /// `stream` (collective).
    ///
    /// # Safety
    /// As for [`all_to_all`](Self::all_to_all); `output` holds `len` bytes.
    pub unsafe fn reduce_scatter(
        &mut self,
        output: DevicePtr,
        input: DevicePtr,
        len: usize,
        dtype: DType,
        op: ReduceOp,
        stream: &Stream,
    ) -> Result<()> {
        const OP: &str = "reduce_scatter_single";
        let (e, es) = reduction(OP, op, dtype, len)?;
        if self.through_transport() {
            let step = (self.slot / (2 * self.size) / es * es).max(es);
            return self.uses(OP, len, step, stream, |c, off, clen, at| {
                c.blocks_in(OP, input, len, off, clen, at, stream)?;
                c.scale_own(OP, &e, op, c.slots[c.rank] + at, c.size * clen / es, stream)?;
                let recv = c.blocks_send(OP, clen, at, stream)?;
                let own = c.slots[c.rank];
                let inputs: Vec<DevicePtr> = (0..c.size).map(|p| own + recv + (p * clen) as u64).collect();
                c.reduce_kernel(OP, &e, combined(op), output + off as u64, &inputs, clen / es, stream)
            });
        }
        let step = (self.slot / self.size / es * es).max(es);
        self.uses(OP, len, step, stream, |c, off, clen, at| {
            c.blocks_in(OP, input, len, off, clen, at, stream)?;
            c.scale_own(OP, &e, op, c.slots[c.rank] + at, c.size * clen / es, stream)?;
            c.exchange(OP, stream)?;
            let inputs: Vec<DevicePtr> = c.slots.iter().map(|s| s + at + (c.rank * clen) as u64).collect();
            c.reduce_kernel(OP, &e, combined(op), output + off as u64, &inputs, clen / es, stream)
        })
    }

    /// Reduces every rank's `len` bytes at `buf` (elements of `dtype`) with
    /// `op`, in place on every rank, queued on `stream` (collective: every
    /// rank calls it with the same length, type and op).
    ///
    /// # Safety
    /// `len` bytes at `buf` must be device memory of this device valid until
    /// the stream has run the operation, not used by other work meanwhile.
    pub unsafe fn all_reduce(
        &mut self,
        buf: DevicePtr,
        len: usize,
        dtype: DType,
        op: ReduceOp,
        stream: &Stream,
    ) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { self.reduce_into("all_reduce", buf, len, dtype, op, None, stream) }
    }

    /// Reduces every rank's `len` bytes at `buf` with `op` into `root`'s
    /// `buf`, queued on `stream` (collective); the other ranks' buffers
    /// are left as they were.
    ///
    /// # Safety
    /// As for [`all_reduce`](Self::all_reduce).
    pub unsafe fn reduce(
        &mut self,
        buf: DevicePtr,
        len: usize,
        dtype: DType,
        op: ReduceOp,
        root: usize,
        stream: &Stream,
    ) -> Result<()> {
        if root >= self.size {
            return Err(Error::invalid("reduce", format!("root {root} is not a rank of {}", self.size)));
        }
        // SAFETY: the caller's contract.
        unsafe { self.reduce_into("reduce", buf, len, dtype, op, Some(root), stream) }
    }

    /// all_reduce (`root` None) or reduce: the shares are reduced as in
    /// the module docs, then copied back on every rank or on `root` only.
    ///
    /// # Safety
    /// As for [`all_reduce`](Self::all_reduce).
    #[allow(clippy::too_many_arguments)]
    unsafe fn reduce_into(
        &mut self,
        op_name: &'static str,
        buf: DevicePtr,
        len: usize,
        dtype: DType,
        op: ReduceOp,
        root: Option<usize>,
        stream: &Stream,
    ) -> Result<()> {
        let what = op_name;
        let (e, es) = reduction(what, op, dtype, len)?;
        let (me, n) = (self.rank, self.size);
        let gets_result = root.is_none_or(|r| r == me);
        if self.through_transport() {
            // A region: the staged chunk, n inputs of this rank's share
            // (one per rank, `stride` apart), the reduced chunk.
            let step = (self.slot.saturating_sub(n * es) / 3 / es * es).max(es);
            return self.uses(what, len, step, stream, |c, off, clen, at| {
                let elems = clen / es;
                let stride = (elems.div_ceil(n) * es) as u64;
                let (stage, inputs, results) = (at, at + clen as u64, at + clen as u64 + n as u64 * stride);
                let own = c.slots[me];
                c.copy(what, own + stage, buf + off as u64, clen, stream)?;
                c.scale_own(what, &e, op, own + stage, elems, stream)?;
                // Share p of my chunk to rank p, as its input from me.
                for p in 0..n {
                    let (a, b) = c.share(p, elems);
                    c.put(what, stage + (a * es) as u64, (b - a) * es, p, inputs + me as u64 * stride, stream)?;
                }
                c.exchange(what, stream)?;
                let (a, b) = c.share(me, elems);
                if b > a {
                    let ins: Vec<DevicePtr> = (0..n).map(|r| own + inputs + r as u64 * stride).collect();
                    c.reduce_kernel(what, &e, combined(op), own + results + (a * es) as u64, &ins, b - a, stream)?;
                    // My reduced share to every rank that gets the result.
                    for p in (0..n).filter(|p| *p != me && root.is_none_or(|r| r == *p)) {
                        let at = results + (a * es) as u64;
                        c.put(what, at, (b - a) * es, p, at, stream)?;
                    }
                }
                c.exchange(what, stream)?;
                if gets_result {
                    c.copy(what, buf + off as u64, own + results, clen, stream)?;
                }
                Ok(())
            });
        }
        self.uses(what, len, self.slot / es * es, stream, |c, off, clen, at| {
            let elems = clen / es;
            // 1. My input.
            // SAFETY: inside the caller's buffer and my region.
            unsafe { stream.copy_async(c.slots[me] + at, buf + off as u64, clen) }.map_err(cuda(what))?;
            c.scale_own(what, &e, op, c.slots[me] + at, elems, stream)?;
            // 2. Everyone's inputs are in place.
            c.exchange(what, stream)?;
            // 3. My share of every input, reduced in place into my share of
            //    my region (elementwise: each element is read, then written).
            let (s0, s1) = c.share(me, elems);
            if s1 > s0 {
                let share = at + (s0 * es) as u64;
                let inputs: Vec<DevicePtr> = c.slots.iter().map(|p| p + share).collect();
                c.reduce_kernel(what, &e, combined(op), c.slots[me] + share, &inputs, s1 - s0, stream)?;
            }
            // 4. Everyone's results are in place.
            c.exchange(what, stream)?;
            // 5. Every share into my buffer (the root's only, for reduce).
            for p in (0..n).filter(|_| gets_result) {
                let (a, b) = c.share(p, elems);
                if b > a {
                    let src = c.slots[p] + at + (a * es) as u64;
                    // SAFETY: inside rank p's region and my buffer.
                    unsafe { stream.copy_async(buf + (off + a * es) as u64, src, (b - a) * es) }.map_err(cuda(what))?;
                }
            }
            Ok(())
        })
    }
}
