//! `Window`: one-sided put / signal / wait_signal / get between the ranks
//! of a [`Group`], with torchcomms' window semantics, on the transport.

use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rmacomm_transport::{
    MappedBuffer, RdmaMemory, RdmaRemoteBuffer, RdmaTransport, TransportConfig, TransportError, View, ViewMut,
};

use crate::error::{Error, Result};
use crate::group::Group;
use crate::unified::{Slot, SLOT};

mod ctran;
#[allow(unsafe_code)]
mod device;
#[allow(unsafe_code)]
mod proxy;
mod release;
mod watch;
use crate::work::Work;
pub use ctran::{Cmp, SignalOp};
pub use proxy::stream_proxy_blocks;
pub use release::{PeerWatch, StreamRelease};
pub use watch::{MissingFn, ProgressFn, Stall, Stalled, StreamWatch, KERNEL_WAIT};

/// How this rank reaches a peer's registered buffer (torchcomms'
/// `get_attr(rank).access_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum AccessType {
    /// The peer's buffer is mapped here: loads and stores reach it
    /// ([`Window::map_remote_tensor`]); puts and gets are copies by the
    /// calling thread, signals atomics. Same-host peers (and this rank).
    Unified,
    /// The peer's buffer is reached through the transport only.
    Separate,
}

/// What [`Window::get_attr`] says about a peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct WindowAttr {
    /// How the peer's buffer is reached.
    pub access_type: AccessType,
}

/// Settings of a [`Window`]; code wins over the environment.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct WindowOptions {
    timeout: Option<Duration>,
    transport: Option<TransportConfig>,
    worker_threads: usize,
    unified: bool,
    spin: Duration,
    signal_slots: usize,
    watch_stream_waits: bool,
    max_in_flight: usize,
}

/// How long a UNIFIED `wait_signal` spins before it sleeps (default).
pub const DEFAULT_SPIN: Duration = Duration::from_micros(50);

impl Default for WindowOptions {
    fn default() -> Self {
        WindowOptions {
            timeout: None,
            transport: None,
            worker_threads: 1,
            unified: true,
            spin: DEFAULT_SPIN,
            signal_slots: 0,
            watch_stream_waits: true,
            max_in_flight: MAX_IN_FLIGHT,
        }
    }
}

impl WindowOptions {
    /// Options with every value from the environment or its default.
    pub fn new() -> Self {
        Self::default()
    }

    /// Timeout of every operation (default: the group's, i.e.
    /// `RMACOMM_TIMEOUT_SECONDS`, else 600 s).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// Settings of the transports (one per peer); its timeout and
    /// `max_in_flight` are replaced by the window's.
    pub fn transport(mut self, config: TransportConfig) -> Self {
        self.transport = Some(config);
        self
    }

    /// Whether same-host peers are reached through shared memory (UNIFIED,
    /// the default) or, like other hosts, through the transport only
    /// (`false`: every peer SEPARATE; for comparisons and tests).
    pub fn unified(mut self, on: bool) -> Self {
        self.unified = on;
        self
    }

    /// Value-signal slots per rank (the ctran form's `signal_slots`;
    /// default 0): 64-bit words peers `signal_value` into (SET or ADD) and
    /// the owner `wait_signal_until`s. Every rank passes the same number.
    pub fn signal_slots(mut self, n: usize) -> Self {
        self.signal_slots = n;
        self
    }

    /// How long a UNIFIED `wait_signal` spins on its slot before it sleeps
    /// on a futex (default [`DEFAULT_SPIN`]; zero: sleep at once).
    pub fn spin(mut self, spin: Duration) -> Self {
        self.spin = spin;
        self
    }

    /// Worker threads of the window's tokio runtime (default 1): they run
    /// the transports' completion drivers and the signals' tasks.
    pub fn worker_threads(mut self, n: usize) -> Self {
        self.worker_threads = n.max(1);
        self
    }

    /// Most puts, gets and signals in flight to one peer (default 65,536;
    /// at least 1). An async one issued while all are taken waits for its
    /// slot and its completion in the call (back-pressure), so that every
    /// operation is posted when its call returns, in call order.
    pub fn max_in_flight(mut self, n: usize) -> Self {
        self.max_in_flight = n.max(1);
        self
    }

    /// Whether a device registration's `wait_signal_on_stream`s are watched
    /// (default true: a watchdog releases them when the peer is gone or the
    /// timeout passed; `watch` module). Off where the caller watches its
    /// streams itself (GpuComm watches its calls).
    pub fn watch_stream_waits(mut self, on: bool) -> Self {
        self.watch_stream_waits = on;
        self
    }
}

/// The piece size of [`Window::put_bytes`]'s staging (two pieces in flight).
pub const BOUNCE_CHUNK: usize = 1 << 20;

/// Operations one transport may have in flight. A put posts when it is
/// called only while a slot is free, and the ordering of signals behind
/// puts relies on posting order (see [`Window::signal`]): so this is large.
const MAX_IN_FLIGHT: usize = 1 << 16;

/// The most a rank's signal words may take (64 Mi value-signal slots).
const MAX_SIGNAL_BYTES: usize = 1 << 30;

/// One peer's connection. For a peer the two are the same transport; for
/// this rank itself they are a loopback pair in this process, so that
/// put/signal/get to self take the same path as to anyone else.
struct Link {
    /// Puts, gets and signals to the peer go out here.
    out: Arc<RdmaTransport>,
    /// The peer's signals arrive here.
    inbound: Arc<RdmaTransport>,
}

/// The registered tensor of every rank.
struct Registration {
    mem: RdmaMemory,
    /// Per rank: its buffer and its element size.
    peers: Vec<(RdmaRemoteBuffer, usize)>,
    /// Per rank: its buffer mapped here (UNIFIED peers whose memory is a
    /// shared segment).
    maps: Vec<Option<MappedBuffer>>,
}

/// A one-sided communication window over the ranks of a group
/// (torchcomms' window: put / signal / wait_signal / get).
///
/// # Data path
/// Every peer, this rank and same-host ranks included, is reached through
/// an [`RdmaTransport`] (one per peer, two for this rank: a loopback pair):
/// the SEPARATE path. On the soft provider a same-host put is still one
/// memcpy by the calling thread into the peer's shared segment.
///
/// # Runtime
/// The window owns a multi-threaded tokio runtime (one worker thread by
/// default, [`WindowOptions::worker_threads`]) that drives the transports'
/// completions and the signals. Blocking calls (`wait_signal`, synchronous
/// operations, [`Work::wait`]) run on the caller's thread with `block_on`:
/// call them from plain threads, not from inside a tokio runtime.
///
/// # Ordering
/// Per (source, destination) pair, the n-th [`signal`](Self::signal) from
/// s satisfies the n-th [`wait_signal`](Self::wait_signal) on d (early
/// signals are banked), and it is delivered only after every put s issued
/// to d before that signal has been placed: when `wait_signal(s)` returns
/// on d, those puts' data is visible. Puts not separated by a signal may be
/// placed in any order. Signals from different sources are independent.
///
/// # Thread safety
/// `Window` is `Send + Sync`; operations may be issued from several threads
/// ("issued before" then means happens-before in the issuing process).
/// `tensor_register` / `tensor_deregister` take `&mut self`, so no
/// operation ([`Work`] borrows the window) is alive across them.
pub struct Window {
    // Field order is drop order: the stream proxy first (its thread ends,
    // its operations' done words are written), then the registration and
    // the transports, before the runtime that drives them.
    /// Runs stream-ordered operations with peers the device does not reach
    /// (started on first use; `proxy` module).
    proxy: std::sync::Mutex<Option<Arc<proxy::StreamProxy>>>,
    reg: Option<Registration>,
    /// A registration of device memory (instead of `reg`).
    dev: Option<device::DeviceRegistration>,
    links: Vec<Link>,
    /// The 8 bytes every signal writes (their content is not read).
    signal_src: Arc<RdmaMemory>,
    /// Peers' signals land here, one [`SLOT`] per source rank.
    signal_dst: Arc<RdmaMemory>,
    /// Why a watchdog released the streams waiting on `signal_dst`
    /// (`release` module), after which its slots are no signals.
    released: Arc<std::sync::OnceLock<Error>>,
    /// Per peer: this rank's slot in the peer's signal buffer.
    signal_slots: Vec<RdmaRemoteBuffer>,
    /// Per peer: its signal buffer mapped here, for UNIFIED pairs (both
    /// sides mapped the other's): then signals are atomics on the slot.
    signal_maps: Vec<Option<Arc<MappedBuffer>>>,
    /// Per source: signals taken by `wait_signal` on UNIFIED pairs (and
    /// waited for by streams; shared with `StreamRelease`).
    consumed: Arc<Vec<AtomicU64>>,
    /// Per destination: signals sent on UNIFIED pairs (the value a
    /// stream-ordered signal writes).
    sent: Vec<AtomicU64>,
    /// Per peer: its whole signal buffer (counting slots, then value slots).
    signal_bufs: Vec<RdmaRemoteBuffer>,
    /// Value-signal slots per rank (the ctran form).
    value_slots: usize,
    /// Whether device registrations watch their stream waits.
    watch_stream_waits: bool,
    spin: Duration,
    /// Signal tasks not yet finished.
    signals_in_flight: Arc<AtomicUsize>,
    /// Per peer reached through the transport: the end of the last value
    /// signal issued to it (its sender drops when that signal's task ends).
    /// Each value signal waits for the one before: two SETs in flight at
    /// once could land in either order, the earlier value winning.
    value_chain: Vec<std::sync::Mutex<Option<tokio::sync::oneshot::Receiver<()>>>>,
    /// Every connection has one QP (no striping): its writes are placed in
    /// posting order, so a SEPARATE signal needs no fence write.
    in_order: bool,
    /// Where `put_bytes` stages unregistered memory (allocated on first use).
    bounce: std::sync::Mutex<Option<RdmaMemory>>,
    timeout: Duration,
    group: Group,
    rt: tokio::runtime::Runtime,
}

impl fmt::Debug for Window {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Window")
            .field("rank", &self.group.rank())
            .field("size", &self.group.size())
            .field("registered_bytes", &self.reg.as_ref().map(|r| r.mem.len()))
            .field("timeout", &self.timeout)
            .finish()
    }
}

fn os(op: &'static str, e: std::io::Error) -> Error {
    Error::Transport { op, source: TransportError::Os { op: "tokio runtime", source: Arc::new(e) } }
}

impl Window {
    /// Creates the window of `group`'s ranks. Collective: every rank calls
    /// it (as the n-th group operation on each). Creates one transport per
    /// peer, exchanges their URLs through the group and connects every
    /// pair (both sides connect); returns once all connections are up.
    ///
    /// The window works in a group of its own (a split of `group` with
    /// every rank), so its keys never meet the caller's.
    pub fn new(group: &Group, opts: WindowOptions) -> Result<Window> {
        const OP: &str = "Window::new";
        let all: Vec<usize> = (0..group.size()).collect();
        let mut group = group.split(&all)?.expect("every rank is in the list");
        let timeout = opts.timeout.unwrap_or(group.timeout());
        group.set_timeout(timeout);
        let (me, n) = (group.rank(), group.size());
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(opts.worker_threads)
            .thread_name("rmacomm-window")
            .enable_all()
            .build()
            .map_err(|e| os(OP, e))?;
        let config =
            opts.transport.unwrap_or_default().with_timeout(Some(timeout)).with_max_in_flight(opts.max_in_flight);
        let in_order = config.qps == 1;
        let transport =
            || RdmaTransport::new(config.clone()).map(Arc::new).map_err(|e| Error::Transport { op: OP, source: e });
        let mut links = Vec::with_capacity(n);
        for p in 0..n {
            let out = transport()?;
            let inbound = if p == me { transport()? } else { out.clone() };
            links.push(Link { out, inbound });
        }
        let bound = |t: &RdmaTransport| t.bind().map_err(|e| Error::Transport { op: OP, source: e });
        let signal_src =
            Arc::new(RdmaMemory::alloc_for(&links[me].out, 8).map_err(|e| Error::Transport { op: OP, source: e })?);
        // Counting slots, value slots, then one control slot (where a peer
        // that released its streams says so: `release` module).
        let signal_bytes = n
            .checked_add(opts.signal_slots)
            .and_then(|k| k.checked_add(1))
            .and_then(|k| k.checked_mul(SLOT))
            .filter(|&b| b <= MAX_SIGNAL_BYTES);
        // A count too large is refused after the exchange below, so that the
        // peers learn of it (a Mismatch, or this error on every rank) rather
        // than wait for this rank until their timeout.
        let signal_dst = Arc::new(
            RdmaMemory::alloc_for(&links[me].out, signal_bytes.unwrap_or(SLOT * (n + 1)))
                .map_err(|e| Error::Transport { op: OP, source: e })?,
        );
        // Line 0: my signal buffer; line 1 + p: the URL of my transport for
        // p; last: my signal_slots (every rank must pass the same).
        let mut blob = signal_dst.remote_buffer().to_string();
        for link in &links {
            blob.push('\n');
            blob.push_str(&bound(&link.out)?);
        }
        blob.push_str(&format!("\nsignal_slots {}", opts.signal_slots));
        let self_in_url = bound(&links[me].inbound)?;
        let all = group.exchange("window", blob.as_bytes())?;
        let mut peer_urls = Vec::with_capacity(n);
        let mut signal_slots = Vec::with_capacity(n);
        let mut signal_bufs = Vec::with_capacity(n);
        let texts: Vec<_> = all.iter().map(|v| String::from_utf8_lossy(v)).collect();
        // Checked on every rank before any is used: a rank passing another
        // signal_slots would signal into words its peer never waits on.
        let slots_of = |t: &str| t.lines().last().and_then(|l| l.strip_prefix("signal_slots ")?.parse::<usize>().ok());
        if let Some(p) = (0..n).find(|&p| slots_of(&texts[p]) != Some(opts.signal_slots)) {
            let theirs = slots_of(&texts[p]).map_or_else(|| "no valid count".to_owned(), |k| k.to_string());
            return Err(Error::Mismatch {
                op: OP.to_owned(),
                detail: format!("this rank ({me}) passed signal_slots {}, rank {p} {theirs}", opts.signal_slots),
            });
        }
        let signal_bytes = signal_bytes.ok_or_else(|| {
            Error::invalid(OP, format!("signal_slots({}) is more than a window holds", opts.signal_slots))
        })?;
        for (p, text) in texts.iter().enumerate() {
            let lines: Vec<&str> = text.lines().collect();
            let bad = || Error::Protocol(format!("{OP}: rank {p} sent a malformed window descriptor"));
            if lines.len() != n + 2 {
                return Err(bad());
            }
            let need = signal_bytes as u64;
            let buf = RdmaRemoteBuffer::parse(lines[0]).filter(|rb| rb.len >= need).ok_or_else(bad)?;
            signal_slots.push(buf.slice((SLOT * me) as u64, 8).expect("checked"));
            signal_bufs.push(buf);
            peer_urls.push(if p == me { self_in_url.clone() } else { lines[1 + me].to_string() });
        }
        let own_out_url = all[me].split(|b| *b == b'\n').nth(1 + me).map(|u| String::from_utf8_lossy(u).into_owned());
        let own_out_url = own_out_url.expect("checked above");
        rt.block_on(async {
            let connects = links.iter().enumerate().map(|(p, link)| {
                let (url, own_out_url) = (&peer_urls[p], &own_out_url);
                async move {
                    let r = if p == me {
                        let (a, b) = tokio::join!(link.out.connect(url), link.inbound.connect(own_out_url));
                        a.and(b)
                    } else {
                        link.out.connect(url).await
                    };
                    r.map_err(|e| Error::Rma { op: "Window::new (connect)", peer: p, source: e })
                }
            });
            futures::future::try_join_all(connects).await
        })?;
        let signal_maps =
            unify(&group, &rt, &links, &signal_bufs, opts.unified)?.into_iter().map(|m| m.map(Arc::new)).collect();
        Ok(Window {
            proxy: std::sync::Mutex::new(None),
            reg: None,
            dev: None,
            links,
            signal_src,
            signal_dst,
            released: Arc::new(std::sync::OnceLock::new()),
            signal_slots,
            signal_maps,
            consumed: Arc::new((0..n).map(|_| AtomicU64::new(0)).collect()),
            sent: (0..n).map(|_| AtomicU64::new(0)).collect(),
            signal_bufs,
            value_slots: opts.signal_slots,
            watch_stream_waits: opts.watch_stream_waits,
            spin: opts.spin,
            signals_in_flight: Arc::new(AtomicUsize::new(0)),
            value_chain: (0..n).map(|_| std::sync::Mutex::new(None)).collect(),
            bounce: std::sync::Mutex::new(None),
            in_order,
            timeout,
            group,
            rt,
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.group.rank()
    }

    /// Ranks in the window.
    pub fn size(&self) -> usize {
        self.group.size()
    }

    /// The timeout of every operation.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Allocates `len` zeroed bytes of registered memory on the window's
    /// device (a shared segment on the soft provider): what
    /// [`tensor_register`](Self::tensor_register) takes and what puts read.
    /// `RdmaMemory::alloc` gives the same when the transports use the
    /// default settings.
    pub fn alloc(&self, len: usize) -> Result<RdmaMemory> {
        RdmaMemory::alloc_for(&self.links[self.rank()].out, len)
            .map_err(|e| Error::Transport { op: "alloc", source: e })
    }

    /// Allocates `len` zeroed bytes of CUDA device memory on GPU `gpu`,
    /// registered on this window's transports: a tensor for
    /// [`tensor_register`](Self::tensor_register) or a source of
    /// [`put`](Self::put) that reaches every peer, on this host or another,
    /// through the transport (the soft provider stages the bytes through
    /// pinned host chunks, a verbs HCA reaches the GPU through DMA-BUF).
    /// Signals are host-ordered; a peer's buffer is never mapped here.
    /// For same-host peers, [`tensor_register_device`](Self::tensor_register_device)
    /// maps device memory through CUDA IPC instead (copy-engine puts,
    /// stream-ordered signals). No CUDA: an error naming the driver.
    pub fn alloc_cuda(&self, len: usize, gpu: u32) -> Result<RdmaMemory> {
        RdmaMemory::alloc_cuda_for(&self.links[self.rank()].out, len, gpu)
            .map_err(|e| Error::Transport { op: "alloc_cuda", source: e })
    }

    /// Whether `rank`'s signal words are mapped here (a same-host peer with
    /// UNIFIED access on): a [`put`](Self::put) to it through the transport
    /// is then complete when it returns (so that a later signal follows
    /// it), async or not. False for a rank outside the window.
    pub fn signals_mapped(&self, rank: usize) -> bool {
        self.signal_maps.get(rank).is_some_and(|m| m.is_some())
    }

    /// Whether every peer is UNIFIED (same host, signals in shared memory):
    /// what [`tensor_register_device`](Self::tensor_register_device) needs.
    pub fn all_unified(&self) -> bool {
        self.signal_maps.iter().enumerate().all(|(p, m)| p == self.rank() || m.is_some())
    }

    /// Registers `mem` as this rank's tensor of elements of `elem_size`
    /// bytes: all of it, whole elements (`RdmaMemory::alloc` rounds up to
    /// whole pages; use [`tensor_register_len`](Self::tensor_register_len)
    /// for an exact size). Collective: every rank calls it; sizes and
    /// element sizes may differ per rank. Offsets of puts and gets count
    /// elements of the *peer's* element size, and are checked against the
    /// peer's registered size.
    pub fn tensor_register(&mut self, mem: RdmaMemory, elem_size: usize) -> Result<()> {
        let len = mem.len().checked_div(elem_size).map_or(0, |n| n * elem_size);
        self.tensor_register_len(mem, len, elem_size)
    }

    /// Reads one byte of every rank's new tensor reached through the
    /// transport (not UNIFIED; this rank's own included) into the bounce
    /// buffer, so that the soft
    /// provider maps a same-host peer's memory (and opens its device
    /// memory through CUDA IPC) now, on the registering thread, rather
    /// than in the engine during the first operation: a stream may be
    /// waiting for that operation (the stream proxy), and opening device
    /// memory takes a driver lock that a kernel launch queued behind the
    /// waiting stream holds (seen on an H200: the process hung). A failure
    /// here is left to the first operation to report.
    fn open_peers(&self, peers: &[(RdmaRemoteBuffer, usize)]) {
        // This rank's own tensor too: its puts to itself go through its
        // loopback link, which maps the segment (and checks the device
        // memory with the driver) on first use just the same.
        let targets: Vec<usize> = (0..peers.len()).filter(|p| self.signal_maps[*p].is_none()).collect();
        if targets.is_empty() {
            return;
        }
        let mut bounce = self.bounce.lock().unwrap_or_else(|e| e.into_inner());
        if bounce.is_none() {
            match self.alloc(2 * BOUNCE_CHUNK) {
                Ok(b) => *bounce = Some(b),
                Err(_) => return,
            }
        }
        let b = bounce.as_ref().expect("set above");
        for p in targets {
            let (rb, _) = &peers[p];
            let (Ok(dst), Some(src)) = (b.view_mut(0, 1), rb.slice(0, 1)) else { continue };
            let read = self.links[p].out.read_with_timeout(dst, &src, Some(self.timeout));
            if let Err(e) = self.rt.block_on(read) {
                tracing::debug!("tensor_register: opening rank {p}'s tensor ahead of use failed ({e})");
            }
        }
    }

    /// [`tensor_register`](Self::tensor_register) of the first `len` bytes
    /// of `mem` only (a whole number of elements): peers' puts and gets
    /// beyond them fail with [`Error::Bounds`].
    ///
    /// A rank whose arguments are refused still takes part in the
    /// registration's exchange: every peer fails with
    /// [`Error::PeerFailed`] naming it, at once, instead of waiting for it
    /// until the timeout.
    pub fn tensor_register_len(&mut self, mem: RdmaMemory, len: usize, elem_size: usize) -> Result<()> {
        self.register_offer("tensor_register", Ok(mem), len, elem_size, false)
    }

    /// Takes this rank's part in a registration that it cannot make (its
    /// memory could not be had: `why`), so that the peers' calls of
    /// [`tensor_register`](Self::tensor_register) fail at once with
    /// [`Error::PeerFailed`] naming this rank and `why`, rather than wait
    /// for it until the timeout. Collective, in place of this rank's
    /// `tensor_register`; returns `why`.
    pub fn tensor_register_failed(&mut self, why: Error) -> Error {
        match self.register_offer("tensor_register", Err(why), 0, 1, false) {
            Err(e) => e,
            Ok(()) => unreachable!("a registration without memory never succeeds"),
        }
    }

    /// The registration of host memory: `mem` (or why this rank has none)
    /// for `len` bytes of `elem_size`-byte elements; `len` 0 only where
    /// `empty` allows it (ctran's `window_allocate(0)`). Whatever this
    /// rank's arguments, it exchanges a descriptor or its error. `op`
    /// names the call in errors.
    pub(crate) fn register_offer(
        &mut self,
        op: &'static str,
        mem: Result<RdmaMemory>,
        len: usize,
        elem_size: usize,
        empty: bool,
    ) -> Result<()> {
        // The exchanges keep one name, whichever call registers.
        const OP: &str = "tensor_register";
        if self.reg.is_some() || self.dev.is_some() {
            return Err(Error::invalid(op, "a tensor is registered already; call tensor_deregister first"));
        }
        let mem = mem.and_then(|mem| {
            if (len == 0 && !empty) || len.checked_rem(elem_size) != Some(0) || len > mem.len() {
                return Err(Error::invalid(
                    op,
                    format!(
                        "{len} bytes of elements of {elem_size} bytes in {} registered bytes: the element size and \
                         the length must be positive, the length a multiple of the element size within the memory",
                        mem.len()
                    ),
                ));
            }
            Ok(mem)
        });
        let blob = match &mem {
            Ok(mem) => format!("{}\n{elem_size}", mem.remote_buffer().slice(0, len as u64).expect("checked above")),
            Err(e) => format!("err\n{e}"),
        };
        let all = self.group.exchange(OP, blob.as_bytes())?;
        // This rank's own failure first; else the first peer's.
        let mem = mem?;
        if let Some((p, why)) = all.iter().enumerate().find_map(|(p, v)| Some((p, v.strip_prefix(b"err\n")?))) {
            return Err(Error::PeerFailed { op, peer: p, reason: String::from_utf8_lossy(why).into_owned() });
        }
        let mut peers = Vec::with_capacity(all.len());
        for (p, value) in all.iter().enumerate() {
            let text = String::from_utf8_lossy(value);
            // An element size of 0 is no registration's (it would divide
            // by zero in bounds checks).
            let parsed = text.split_once('\n').and_then(|(rb, es)| {
                Some((RdmaRemoteBuffer::parse(rb)?, es.parse::<usize>().ok().filter(|&es| es > 0)?))
            });
            peers.push(parsed.ok_or_else(|| Error::Protocol(format!("{op}: rank {p} sent a malformed descriptor")))?);
        }
        // UNIFIED peers' tensors, mapped here when they are shared segments.
        let maps: Result<Vec<_>> = peers
            .iter()
            .enumerate()
            .map(|(p, (rb, _))| match self.signal_maps[p] {
                Some(_) => self.rt.block_on(self.links[p].out.map_remote(rb)).map_err(|source| Error::Rma {
                    op,
                    peer: p,
                    source,
                }),
                None => Ok(None),
            })
            .collect();
        self.open_peers(&peers);
        // Every rank says how its mapping went before any returns: no rank
        // leaves (and may drop its window, deregistering its memory) while
        // a peer is still mapping that memory, and a rank's failure fails
        // the registration everywhere, naming it.
        let verdict = match &maps {
            Ok(_) => String::new(),
            Err(e) => e.to_string(),
        };
        let all = self.group.exchange("tensor_register/mapped", verdict.as_bytes())?;
        let maps = maps?;
        if let Some((p, why)) = all.iter().enumerate().find(|(_, v)| !v.is_empty()) {
            return Err(Error::PeerFailed { op, peer: p, reason: String::from_utf8_lossy(why).into_owned() });
        }
        self.reg = Some(Registration { mem, peers, maps });
        Ok(())
    }

    /// Ends the registration and gives the memory back. Collective: waits
    /// (up to the window's timeout) for this rank's operations still in
    /// flight, detached ones included, then for every rank (a barrier), so
    /// no peer still reaches the buffer when it returns.
    pub fn tensor_deregister(&mut self) -> Result<RdmaMemory> {
        const OP: &str = "tensor_deregister";
        if self.reg.is_none() {
            return Err(Error::invalid(OP, "no tensor is registered"));
        }
        let start = Instant::now();
        let busy = |w: &Window| {
            w.signals_in_flight.load(Ordering::Acquire) > 0
                || w.proxy_outstanding() > 0
                || w.links.iter().any(|l| l.out.in_flight() > 0 || l.inbound.in_flight() > 0)
        };
        while busy(self) {
            if start.elapsed() >= self.timeout {
                return Err(Error::Timeout {
                    waiting_for: format!(
                        "{OP}: this rank's operations in flight ({} on streams: synchronize the streams that \
                         carry them)",
                        self.proxy_outstanding()
                    ),
                    after: self.timeout,
                });
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let reg = self.reg.take().expect("checked above");
        drop(reg.maps);
        if let Err(e) = self.group.barrier(None) {
            self.reg = Some(Registration { maps: (0..reg.peers.len()).map(|_| None).collect(), ..reg });
            return Err(e);
        }
        Ok(reg.mem)
    }

    /// This rank's registered memory (to fill or read it locally).
    pub fn local_tensor(&self) -> Option<&RdmaMemory> {
        self.reg.as_ref().map(|r| &r.mem)
    }

    fn check_rank(&self, op: &'static str, rank: usize) -> Result<()> {
        if rank >= self.size() {
            return Err(Error::invalid(op, format!("rank {rank} is not in this window of {} ranks", self.size())));
        }
        Ok(())
    }

    /// The part of `rank`'s buffer an operation of `len` bytes at element
    /// `offset` touches, or the error saying why it does not fit.
    fn target(&self, op: &'static str, rank: usize, offset: usize, len: usize) -> Result<RdmaRemoteBuffer> {
        self.check_rank(op, rank)?;
        let reg = self
            .reg
            .as_ref()
            .ok_or_else(|| Error::invalid(op, "no tensor is registered; call tensor_register (collective) first"))?;
        let (rb, es) = reg.peers[rank];
        let start = offset.checked_mul(es).map(|s| s as u64);
        start.and_then(|s| rb.slice(s, len as u64)).ok_or_else(|| Error::Bounds {
            op,
            peer: rank,
            reason: format!(
                "{len} bytes at element offset {offset} ({es} B elements) end past rank {rank}'s registered \
                 buffer of {} bytes ({} elements)",
                rb.len,
                rb.len / es as u64
            ),
        })
    }

    /// Wraps a transport future in a [`Work`]; a synchronous operation
    /// waits for it here and returns its error directly.
    fn work<'a>(
        &self,
        op: &'static str,
        peer: usize,
        fut: impl Future<Output = Result<(), TransportError>> + Send + 'a,
        async_op: bool,
    ) -> Result<Work<'a>> {
        let fut = async move { fut.await.map_err(|source| Error::Rma { op, peer, source }) };
        let work = Work::new(self.rt.handle().clone(), op, peer, Box::pin(fut));
        if !async_op {
            work.wait(None)?;
        }
        Ok(work)
    }

    /// Writes `src` into `dst_rank`'s registered buffer at element
    /// `target_offset_nelems` (of `dst_rank`'s element size): an RDMA
    /// WRITE, posted before this returns. Does not signal.
    ///
    /// A put that does not fit the destination's buffer fails here with
    /// [`Error::Bounds`] and moves nothing. With `async_op`, the returned
    /// [`Work`] tells when the data is placed; without, this returns once
    /// it is (an error is returned directly). `src` must not change until
    /// then.
    pub fn put<'a>(
        &'a self,
        src: View<'a>,
        dst_rank: usize,
        target_offset_nelems: usize,
        async_op: bool,
    ) -> Result<Work<'a>> {
        const OP: &str = "put";
        let remote = self.target(OP, dst_rank, target_offset_nelems, src.len())?;
        if src.is_empty() {
            // Nothing to place (a mapping refused a zero-byte range at the
            // buffer's end as "no longer registered").
            return self.done(OP, dst_rank, Ok(()), async_op);
        }
        if !src.memory().is_device() {
            if let Some((mem, off)) = self.own_span(dst_rank, &remote) {
                return self.done(OP, dst_rank, mem.copy_from(off, src), async_op);
            }
        }
        // Device memory is not the host's to copy: it takes the transport
        // (a peer's mapped host buffer is a transport target too).
        let mapped = if src.memory().is_device() { None } else { self.mapped(dst_rank, &remote) };
        if let Some((m, off)) = mapped {
            let r = self.peer_alive(dst_rank).and_then(|()| m.put(src, off));
            return self.done(OP, dst_rank, r, async_op);
        }
        // With UNIFIED signals to the peer (atomics, which pass anything in
        // flight), a put through the transport is complete before it
        // returns, so that a later signal follows it.
        let async_op = async_op && self.signal_maps[dst_rank].is_none();
        let t = &self.links[dst_rank].out;
        if async_op {
            // Posted now, or not at all: with every in-flight slot taken the
            // transport's future would post when first polled — after a
            // signal issued next (which then overtook it), or never, for a
            // Work dropped unwaited.
            if let Some(fut) = t.try_write(src, &remote, false) {
                return self.work(OP, dst_rank, fut, true);
            }
        }
        // Synchronous, or every slot taken: this put waits for its slot and
        // its completion in the call (back-pressure).
        let fut = t.write_with_timeout(src, &remote, false, Some(self.timeout));
        self.work(OP, dst_rank, fut, false)
    }

    /// Writes `src`, memory that need not be registered (a `Vec`, a slice),
    /// into `dst_rank`'s buffer at element `target_offset_nelems`, bounds
    /// checked first as for [`put`](Self::put). Complete when it returns
    /// (the bytes are placed). UNIFIED peers: one copy into the mapped
    /// buffer. Others: staged through the window's registered bounce
    /// buffer in [`BOUNCE_CHUNK`] pieces, two in flight, so copying one
    /// piece overlaps the RDMA write of the previous one. Staged puts of
    /// one window run one at a time.
    pub fn put_bytes(&self, src: &[u8], dst_rank: usize, target_offset_nelems: usize) -> Result<()> {
        const OP: &str = "put_bytes";
        let remote = self.target(OP, dst_rank, target_offset_nelems, src.len())?;
        if src.is_empty() {
            return Ok(());
        }
        if let Some((mem, off)) = self.own_span(dst_rank, &remote) {
            return mem.write_from(off, src).map_err(|source| Error::Rma { op: OP, peer: dst_rank, source });
        }
        let rma = |source| Error::Rma { op: OP, peer: dst_rank, source };
        if let Some((m, off)) = self.mapped(dst_rank, &remote) {
            return self.peer_alive(dst_rank).and_then(|()| m.write_from(off, src)).map_err(rma);
        }
        let mut bounce = self.bounce.lock().unwrap_or_else(|e| e.into_inner());
        if bounce.is_none() {
            *bounce = Some(self.alloc(2 * BOUNCE_CHUNK)?);
        }
        let b = bounce.as_ref().expect("set above");
        let t = &self.links[dst_rank].out;
        let timeout = Some(self.timeout);
        let r = self
            .rt
            .block_on(async {
                let mut pending: [Option<_>; 2] = [None, None];
                for (i, piece) in src.chunks(BOUNCE_CHUNK).enumerate() {
                    let half = i % 2;
                    if let Some(f) = pending[half].take() {
                        f.await?;
                    }
                    b.write_from(half * BOUNCE_CHUNK, piece)?;
                    let to = remote.slice((i * BOUNCE_CHUNK) as u64, piece.len() as u64).expect("inside remote");
                    // Posted now; awaited when its half is needed again.
                    let write = t.write_with_timeout(b.view(half * BOUNCE_CHUNK, piece.len())?, &to, false, timeout);
                    pending[half] = Some(Box::pin(write));
                }
                for f in pending.iter_mut().filter_map(Option::take) {
                    f.await?;
                }
                Ok(())
            })
            .map_err(rma);
        if r.is_err() {
            // Writes of this call may still be in flight (a timed-out
            // piece, the other half's): they read the bounce buffer until
            // they end, so the next put_bytes must not refill it — it would
            // send its bytes to this call's target. The transport keeps
            // this buffer registered and allocated until they end; the
            // next call allocates another.
            *bounce = None;
        }
        r
    }

    /// Reads from `src_rank`'s registered buffer at element
    /// `source_offset_nelems` (of `src_rank`'s element size) into `dst`: an
    /// RDMA READ. Bounds are checked first, as for [`put`](Self::put).
    pub fn get<'a>(
        &'a self,
        dst: ViewMut<'a>,
        src_rank: usize,
        source_offset_nelems: usize,
        async_op: bool,
    ) -> Result<Work<'a>> {
        const OP: &str = "get";
        let remote = self.target(OP, src_rank, source_offset_nelems, dst.len())?;
        if dst.is_empty() {
            return self.done(OP, src_rank, Ok(()), async_op);
        }
        if !dst.memory().is_device() {
            if let Some((mem, off)) = self.own_span(src_rank, &remote) {
                return self.done(OP, src_rank, mem.copy_into(off, dst), async_op);
            }
        }
        // As in `put`: device memory takes the transport.
        let mapped = if dst.memory().is_device() { None } else { self.mapped(src_rank, &remote) };
        if let Some((m, off)) = mapped {
            let r = self.peer_alive(src_rank).and_then(|()| m.get(dst, off));
            return self.done(OP, src_rank, r, async_op);
        }
        let t = &self.links[src_rank].out;
        // As for put: an async get is posted in the call; with every
        // in-flight slot taken it waits in the call instead (its future
        // would post only when polled: never, for a Work dropped unwaited).
        let async_op = async_op && t.free_slots() > 0;
        let fut = t.read_with_timeout(dst, &remote, Some(self.timeout));
        self.work(OP, src_rank, fut, async_op)
    }

    /// Signals `dst_rank`: satisfies one [`wait_signal`](Self::wait_signal)
    /// for this rank there, once every put this rank issued to `dst_rank`
    /// before this call has been placed.
    ///
    /// How: a signal first writes 8 bytes into this rank's slot of the
    /// peer's signal buffer without notification and waits for that write's
    /// completion. The transport completes operations in posting order and a
    /// completion means the data is placed, so by then every earlier put to
    /// the peer is placed. Then it writes the 8 bytes again, with a
    /// notification, which the peer's `wait_signal` counts. That costs one
    /// round trip more than a bare notification; it is correct on any
    /// number of physical QPs and either load balancing.
    ///
    /// The signal runs on the window's runtime whether or not the returned
    /// [`Work`] is waited for.
    pub fn signal(&self, dst_rank: usize, async_op: bool) -> Result<Work<'_>> {
        const OP: &str = "signal";
        self.check_rank(OP, dst_rank)?;
        if let Some(m) = &self.signal_maps[dst_rank] {
            let off = SLOT * self.rank();
            let r = self
                .peer_alive(dst_rank)
                .and_then(|()| Slot::at(off, |o| m.atomic_u64(o), |o| m.atomic_u32(o)))
                .map(|slot| {
                    self.sent[dst_rank].fetch_add(1, Ordering::AcqRel);
                    slot.add(1)
                });
            return self.done(OP, dst_rank, r, async_op);
        }
        if self.in_order {
            // One QP per connection: RC places its writes in posting order,
            // so the notifying write lands after every earlier put. No
            // fence, no round trip of its own.
            let v = self.signal_src.view(0, 8).map_err(|source| Error::Transport { op: OP, source })?;
            let t = &self.links[dst_rank].out;
            // Posted now (after every earlier put: see `put`), or, with every
            // slot taken, waited for in the call.
            if async_op {
                if let Some(fut) = t.try_write(v, &self.signal_slots[dst_rank], true) {
                    return self.work(OP, dst_rank, fut, true);
                }
            }
            let fut = t.write_with_timeout(v, &self.signal_slots[dst_rank], true, Some(self.timeout));
            return self.work(OP, dst_rank, fut, false);
        }
        let (t, src, slot) = (self.links[dst_rank].out.clone(), self.signal_src.clone(), self.signal_slots[dst_rank]);
        let timeout = Some(self.timeout);
        let counter = InFlight::enter(&self.signals_in_flight);
        let task = self.rt.spawn(async move {
            let _counter = counter;
            let v = src.view(0, 8)?;
            t.write_with_timeout(v, &slot, false, timeout).await?;
            t.write_with_timeout(v, &slot, true, timeout).await
        });
        let fut = async move { task.await.unwrap_or(Err(TransportError::Aborted { op: OP })) };
        self.work(OP, dst_rank, fut, async_op)
    }

    /// Waits for the next signal from `peer_rank` (the n-th call takes the
    /// n-th signal; signals that came first were kept), for at most
    /// `timeout` (`None`: the window's). Fails with an error naming the
    /// peer when it times out or the peer is gone.
    pub fn wait_signal(&self, peer_rank: usize, timeout: Option<Duration>) -> Result<()> {
        const OP: &str = "wait_signal";
        self.check_rank(OP, peer_rank)?;
        if self.signal_maps[peer_rank].is_some() {
            return self.wait_unified(peer_rank, timeout.unwrap_or(self.timeout));
        }
        let t = Some(timeout.unwrap_or(self.timeout));
        self.rt.block_on(self.links[peer_rank].inbound.wait_for_write_with_timeout(t)).map_err(|source| Error::Rma {
            op: OP,
            peer: peer_rank,
            source,
        })
    }

    /// How this rank reaches `rank`'s buffer: [`AccessType::Unified`] for
    /// this rank and for same-host peers whose buffer is mapped here (with
    /// no tensor registered: whose signal buffer is), else
    /// [`AccessType::Separate`].
    pub fn get_attr(&self, rank: usize) -> Result<WindowAttr> {
        self.check_rank("get_attr", rank)?;
        let unified = rank == self.rank()
            || match (&self.reg, &self.dev) {
                (Some(reg), _) => reg.maps[rank].is_some(),
                (None, Some(_)) => true,
                (None, None) => self.signal_maps[rank].is_some(),
            };
        Ok(WindowAttr { access_type: if unified { AccessType::Unified } else { AccessType::Separate } })
    }

    /// A local view of `rank`'s registered buffer, aliasing it: this rank's
    /// own buffer, or a UNIFIED peer's mapped here (what the peer and
    /// others put there is seen at once). For a SEPARATE peer (another
    /// host, or memory outside a shared segment) an [`Error::Unsupported`]
    /// naming the peer: use get.
    pub fn map_remote_tensor(&self, rank: usize) -> Result<MappedTensor<'_>> {
        const OP: &str = "map_remote_tensor";
        self.check_rank(OP, rank)?;
        let reg = self
            .reg
            .as_ref()
            .ok_or_else(|| Error::invalid(OP, "no tensor is registered; call tensor_register (collective) first"))?;
        let (rb, elem_size) = reg.peers[rank];
        if rank == self.rank() {
            return Ok(MappedTensor { inner: Mapped::Local(&reg.mem), elem_size, offset: 0, len: rb.len as usize });
        }
        match &reg.maps[rank] {
            // A dead peer's pages stay mapped: its connection says it is gone.
            Some(m) => {
                self.peer_alive(rank).map_err(|source| Error::Rma { op: OP, peer: rank, source })?;
                Ok(MappedTensor { inner: Mapped::Peer(m), elem_size, offset: 0, len: m.len() })
            }
            None => Err(Error::Unsupported {
                op: OP,
                reason: format!(
                    "rank {rank}'s buffer cannot be mapped here: it is SEPARATE (get_attr: {}), so only put and \
                     get reach it",
                    if self.signal_maps[rank].is_some() {
                        "same host, but its memory is not a shared segment"
                    } else {
                        "on another host, or UNIFIED access is off"
                    }
                ),
            }),
        }
    }

    /// On the UNIFIED path nothing else notices that a peer is gone (its
    /// memory stays mapped): the transport's connection does.
    fn peer_alive(&self, rank: usize) -> Result<(), TransportError> {
        match self.links[rank].out.error() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// The mapping of `rank`'s tensor and the byte offset of `remote` in it.
    /// `remote` in this rank's own registered host memory (the memory and
    /// the offset), when `rank` is this rank: its puts and gets to itself
    /// are moves within this process (`RdmaMemory::copy_from`). Through the mapping of its
    /// own segment (or the loopback link) they copied between two views of
    /// the same pages, which a source overlapping the target (a put from the
    /// registered tensor into itself) corrupted: a forward copy read bytes
    /// it had just written through the other view.
    fn own_span(&self, rank: usize, remote: &RdmaRemoteBuffer) -> Option<(&RdmaMemory, usize)> {
        let reg = self.reg.as_ref().filter(|r| rank == self.rank() && !r.mem.is_device())?;
        // `target` checked `remote` inside this rank's registered buffer.
        Some((&reg.mem, (remote.addr - reg.peers[rank].0.addr) as usize))
    }

    fn mapped(&self, rank: usize, remote: &RdmaRemoteBuffer) -> Option<(&MappedBuffer, usize)> {
        let reg = self.reg.as_ref()?;
        let m = reg.maps[rank].as_ref()?;
        Some((m, (remote.addr - reg.peers[rank].0.addr) as usize))
    }

    /// A `Work` for an operation done in the call (UNIFIED): a synchronous
    /// one returns its error directly.
    fn done(&self, op: &'static str, peer: usize, r: Result<(), TransportError>, async_op: bool) -> Result<Work<'_>> {
        let r = r.map_err(|source| Error::Rma { op, peer, source });
        if !async_op {
            r.clone()?;
        }
        Ok(Work::done(self.rt.handle().clone(), op, peer, r))
    }

    /// `wait_signal` on a UNIFIED pair: takes one signal from the slot.
    fn wait_unified(&self, peer: usize, timeout: Duration) -> Result<()> {
        const OP: &str = "wait_signal";
        let rma = |source| Error::Rma { op: OP, peer, source };
        let slot =
            Slot::at(SLOT * peer, |o| self.signal_dst.atomic_u64(o), |o| self.signal_dst.atomic_u32(o)).map_err(rma)?;
        let consumed = self.kernel_wait_count(peer).unwrap_or(&self.consumed[peer]);
        let take = || loop {
            let (have, taken) = (slot.value.load(Ordering::Acquire), consumed.load(Ordering::Acquire));
            if have <= taken {
                return false;
            }
            if consumed.compare_exchange(taken, taken + 1, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                return true;
            }
        };
        let link = &self.links[peer].inbound;
        let alive = || match link.error() {
            Some(e) => Err(rma(e)),
            None => self.not_released(OP, peer),
        };
        let deadline = ibverbx::deadline_after(timeout);
        // A stream-ordered signal (device memory registered) writes the
        // slot without waking sleepers: they look again often.
        let slice = if self.dev.is_some() { ctran::SEPARATE_SLICE } else { crate::unified::SLICE };
        // A released slot holds no signal (`release` module).
        self.not_released(OP, peer)?;
        if slot.wait(self.spin, slice, deadline, take, alive)? {
            return self.not_released(OP, peer);
        }
        Err(rma(TransportError::Timeout { op: OP, after: timeout }))
    }
}

/// Maps the signal buffer of every same-host peer (and this rank's own),
/// and keeps the mappings of the pairs where both sides mapped the other's:
/// those signal through shared memory (UNIFIED). One all-gather.
fn unify(
    group: &Group,
    rt: &tokio::runtime::Runtime,
    links: &[Link],
    signal_bufs: &[RdmaRemoteBuffer],
    enabled: bool,
) -> Result<Vec<Option<MappedBuffer>>> {
    const OP: &str = "Window::new (map same-host peers)";
    let (me, n) = (group.rank(), group.size());
    let mut maps = Vec::with_capacity(n);
    for p in 0..n {
        let m = if enabled && (p == me || group.same_host(p)) {
            match rt.block_on(links[p].out.map_remote(&signal_bufs[p])) {
                Ok(m) => m,
                Err(e) => {
                    tracing::info!("rank {me}: cannot map rank {p}'s signals ({e}); the pair is SEPARATE");
                    None
                }
            }
        } else {
            None
        };
        maps.push(m);
    }
    let mine: String = maps.iter().map(|m| if m.is_some() { '1' } else { '0' }).collect();
    let all = group.exchange("unified", mine.as_bytes())?;
    for (p, theirs) in all.iter().enumerate() {
        if theirs.len() != n {
            return Err(Error::Protocol(format!("{OP}: rank {p} sent a malformed map of {} ranks", theirs.len())));
        }
        if theirs[me] != b'1' {
            maps[p] = None;
        }
    }
    Ok(maps)
}

/// What [`Window::map_remote_tensor`] returns: a rank's registered buffer,
/// aliased here (this rank's own memory, or a same-host peer's mapped).
/// Others write it at any time, so it is read and written by copies (or
/// through [`as_ptr`](Self::as_ptr) by code that knows the element type).
#[derive(Debug)]
pub struct MappedTensor<'a> {
    inner: Mapped<'a>,
    elem_size: usize,
    /// Where this view starts in the rank's buffer, and its length (bytes).
    offset: usize,
    len: usize,
}

#[derive(Debug, Clone, Copy)]
enum Mapped<'a> {
    Local(&'a RdmaMemory),
    Peer(&'a MappedBuffer),
}

impl<'a> MappedTensor<'a> {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// The `len` bytes at byte `offset` of this view, or `None` when they
    /// do not fit.
    pub fn slice(&self, offset: usize, len: usize) -> Option<MappedTensor<'a>> {
        offset.checked_add(len).filter(|&end| end <= self.len)?;
        Some(MappedTensor { inner: self.inner, elem_size: self.elem_size, offset: self.offset + offset, len })
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The element size the owner registered it with.
    pub fn elem_size(&self) -> usize {
        self.elem_size
    }

    /// Elements.
    pub fn numel(&self) -> usize {
        self.len() / self.elem_size
    }

    /// Whether it is a peer's memory mapped here (not this rank's own).
    pub fn is_peer(&self) -> bool {
        matches!(self.inner, Mapped::Peer(_))
    }

    /// The first byte (raw access only: others write it concurrently).
    pub fn as_ptr(&self) -> *mut u8 {
        let base = match &self.inner {
            Mapped::Local(mem) => mem.as_ptr(),
            Mapped::Peer(m) => m.as_ptr(),
        };
        base.wrapping_add(self.offset)
    }

    fn check(&self, op: &'static str, offset: usize, n: usize) -> Result<()> {
        if offset.checked_add(n).is_none_or(|end| end > self.len()) {
            return Err(Error::invalid(op, format!("{offset}+{n} is outside the tensor of {} bytes", self.len())));
        }
        Ok(())
    }

    /// Copies bytes out, from byte `offset`.
    pub fn read_into(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        const OP: &str = "map_remote_tensor (read)";
        self.check(OP, offset, dst.len())?;
        match &self.inner {
            Mapped::Local(mem) => mem.read_into(self.offset + offset, dst),
            Mapped::Peer(m) => m.read_into(self.offset + offset, dst),
        }
        .map_err(|source| Error::Transport { op: OP, source })
    }

    /// Copies bytes in, at byte `offset` (a store into the owner's buffer).
    pub fn write_from(&self, offset: usize, src: &[u8]) -> Result<()> {
        const OP: &str = "map_remote_tensor (write)";
        self.check(OP, offset, src.len())?;
        match &self.inner {
            Mapped::Local(mem) => mem.write_from(self.offset + offset, src),
            Mapped::Peer(m) => m.write_from(self.offset + offset, src),
        }
        .map_err(|source| Error::Transport { op: OP, source })
    }
}

/// Counts a signal task from its spawn to its end (or its drop).
struct InFlight(Arc<AtomicUsize>);

impl InFlight {
    fn enter(counter: &Arc<AtomicUsize>) -> Self {
        counter.fetch_add(1, Ordering::AcqRel);
        InFlight(counter.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_and_works_are_send_and_sync() {
        fn both<T: Send + Sync>() {}
        both::<Window>();
        both::<Work<'static>>();
    }
}
