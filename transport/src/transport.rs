//! `RdmaTransport`: one connection to one peer, driven by tokio.

use std::collections::VecDeque;
use std::fmt;
use std::future::Future;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use futures::future::Either;
use ibverbx::{
    MemoryRegion, ProviderKind, RecvWr, SendFlags, SendOp, SendWr, Sge, VirtualCq, VirtualQp, WcOpcode, WcStatus,
    WorkCompletion,
};
use tokio::io::unix::AsyncFd;
use tokio::sync::{oneshot, Notify, OwnedSemaphorePermit, Semaphore, TryAcquireError};

use crate::direct::DirectMaps;
use crate::domain::{domain, Domain};
use crate::memory::{Held, View, ViewMut};
use crate::notes::{self, Notes};
use crate::{url, RdmaRemoteBuffer, TransportConfig, TransportError};

type Reply = oneshot::Sender<Result<(), TransportError>>;
type ReplyRx = oneshot::Receiver<Result<(), TransportError>>;

struct Pending {
    op: &'static str,
    /// The remote range the WR names (address, length, key), for its error
    /// (formatted only then: nothing is allocated per WR).
    remote: Option<(u64, u64, u32)>,
    /// Taken when the result is delivered early (the transport broke or was
    /// dropped); the entry itself stays until the WR's completion.
    tx: Option<Reply>,
    /// Generation of the slab slot: a WR id is `gen << 32 | slot`, so a
    /// completion never resolves a later user of the same slot.
    gen: u32,
    /// The registration the WR reads or writes, held until the WR's virtual
    /// completion. That completion comes only once every physical fragment
    /// has completed or been flushed, fragments still queued in the virtual
    /// QP's planner included, so a caller that drops its future and then its
    /// `RdmaMemory` (a cancellation, a timeout) never has a fragment posted
    /// with a dead key (which would break the connection) nor a late READ
    /// land in memory that went back to the allocator (nor, with the
    /// registration's owner held too, memory a freed tensor gave back).
    _mem: Option<Held>,
    /// The operation's in-flight slot, given back with the entry.
    _slot: OwnedSemaphorePermit,
}

/// Posted WRs awaiting their completion, by id. Entries leave only with
/// their WR's completion (or with the transport), so the table is bounded
/// by `max_in_flight`.
#[derive(Default)]
struct PendingSet {
    slots: slab::Slab<Pending>,
    next_gen: u32,
}

impl PendingSet {
    fn insert(
        &mut self,
        op: &'static str,
        remote: Option<(u64, u64, u32)>,
        tx: Reply,
        mem: Option<Held>,
        slot: OwnedSemaphorePermit,
    ) -> u64 {
        // 31 bits: bit 63 of an id marks receives.
        let gen = self.next_gen & 0x7fff_ffff;
        self.next_gen = self.next_gen.wrapping_add(1);
        let slot = self.slots.insert(Pending { op, remote, tx: Some(tx), gen, _mem: mem, _slot: slot });
        (u64::from(gen) << 32) | slot as u64
    }

    fn remove(&mut self, id: u64) -> Option<Pending> {
        let slot = (id & 0xffff_ffff) as usize;
        match self.slots.get(slot) {
            Some(p) if u64::from(p.gen) == id >> 32 => Some(self.slots.remove(slot)),
            _ => None,
        }
    }

    /// Resolves every caller still waiting, keeping the entries (and the
    /// memory they hold) until the WRs' completions or the transport's end.
    fn resolve_all(&mut self, e: impl Fn(&'static str) -> TransportError) {
        for (_, p) in self.slots.iter_mut() {
            if let Some(tx) = p.tx.take() {
                let _ = tx.send(Err(e(p.op)));
            }
        }
    }
}

#[derive(Default)]
struct State {
    pending: PendingSet,
    broken: Option<TransportError>,
    /// `broken` was guessed from a flushed receive, before the failure that
    /// caused the flush was known; that failure, once it arrives, replaces it.
    broken_guessed: bool,
    /// The transport was dropped: calls still pending end with `Aborted`.
    dropped: bool,
    waiters: VecDeque<Reply>,
    /// Waits that timed out or were dropped since the last prune; their
    /// closed senders are still in `waiters`.
    abandoned: usize,
}

impl State {
    /// Hands one notification to the oldest live waiter, or banks it.
    fn deliver_notification(&mut self, banked: &AtomicU64) {
        self.deliver_notifications(1, banked);
    }

    /// Hands `n` notifications to the oldest live waiters, one each, and
    /// banks the rest at once: the work is bounded by the waiters, not by
    /// `n` (a count a peer wrote into a shared page, whatever it says).
    fn deliver_notifications(&mut self, mut n: u64, banked: &AtomicU64) {
        while n > 0 {
            let Some(w) = self.waiters.pop_front() else { break };
            if w.send(Ok(())).is_ok() {
                n -= 1;
            } else {
                self.abandoned = self.abandoned.saturating_sub(1);
            }
        }
        if n > 0 {
            banked.fetch_add(n, Ordering::Release);
        }
    }

    /// What a `wait_for_write` that finds the transport broken returns: the
    /// cause, or `Aborted` once the transport was dropped (as the waits in
    /// the table get).
    fn wait_error(&self) -> Option<TransportError> {
        match &self.broken {
            Some(_) if self.dropped => Some(TransportError::Aborted { op: "wait_for_write" }),
            e => e.clone(),
        }
    }

    /// Counts one abandoned wait; once they are half the table, removes
    /// them all (amortised O(1) a wait, and the table stays within twice
    /// the live waits).
    fn abandon_waiter(&mut self) {
        self.abandoned += 1;
        if self.abandoned * 2 >= self.waiters.len() {
            self.waiters.retain(|w| !w.is_closed());
            self.abandoned = 0;
        }
    }
}

// Field order is drop order: the QP goes (and with it every physical WR)
// before `st` lets go of the memory the pending WRs hold.
struct Inner {
    domain: Arc<Domain>,
    cq: VirtualCq,
    qp: VirtualQp,
    config: TransportConfig,
    st: Mutex<State>,
    /// `max_in_flight` permits; each operation holds one from its post to
    /// its completion.
    slots: Arc<Semaphore>,
    /// Who the peer is, for errors (set by `connect`).
    peer: OnceLock<String>,
    /// Where `connect` stands: one of the `CONN_*` values.
    conn: AtomicU8,
    shutdown: Notify,
    /// Posts in progress: the soft provider may copy inside a post while
    /// holding the virtual QP's lock; the driver stands aside meanwhile
    /// rather than queue on that lock (the posting caller reaps its own
    /// completion when it awaits).
    posting: std::sync::atomic::AtomicUsize,
    /// When a thread last spun driving the provider (µs since `born`;
    /// 0: none is). While one does, the driver task does not arm the
    /// completion channel: every completion would write it and wake the
    /// task, on a core the spinner needs, for completions the spinner
    /// takes anyway.
    spun_at: AtomicU64,
    /// A spinner stopped to sleep: the driver arms the channel again.
    spin_quit: Notify,
    born: std::time::Instant,
    /// Set (after `broken`) once the transport is broken: `error()` reads
    /// it without the lock (UNIFIED window operations ask on every call).
    broken_flag: std::sync::atomic::AtomicBool,
    /// The peer's regions mapped here, for same-host copies by the caller.
    direct: Arc<DirectMaps>,
    /// The runtime `connect` ran on (the driver's): mappings are made there,
    /// whatever thread posts.
    rt: OnceLock<tokio::runtime::Handle>,
    /// Notifications counted in shared memory, both ways (same host).
    notes: Notes,
    /// Notifications nobody waited for yet, kept for later waits. Changed
    /// only under `st`'s lock; read without it by spinning waits.
    banked: AtomicU64,
}

/// An RDMA connection to one peer (make one transport per peer).
///
/// Both sides create a transport, [`bind`](Self::bind) it, exchange the URLs
/// through whatever channel they have, and [`connect`](Self::connect) to the
/// other's URL. Then either side writes into or reads from the other's
/// registered memory ([`RdmaMemory`](crate::RdmaMemory)); a write with
/// `notify` lets the peer's [`wait_for_write`](Self::wait_for_write) return.
///
/// Every future is `Send`, never blocks a runtime thread (completions wake
/// it through the CQ's completion channel), and may be raced against a
/// timeout; many thousands may be in flight at once.
pub struct RdmaTransport {
    inner: Arc<Inner>,
}

// Futures hold `Arc<Inner>`, not the transport: dropping the transport
// (below) aborts them.

impl fmt::Debug for RdmaTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RdmaTransport")
            .field("device", &self.inner.domain.device)
            .field("connected", &self.connected())
            .finish()
    }
}

const RECV_BIT: u64 = 1 << 63;

/// `connect` never called, or it failed before touching the QP.
const CONN_IDLE: u8 = 0;
/// A `connect` call is running.
const CONN_CONNECTING: u8 = 1;
const CONN_CONNECTED: u8 = 2;
/// A `connect` failed (or was dropped) after moving the QP towards a peer;
/// the QP cannot be pointed at another one.
const CONN_FAILED: u8 = 3;

/// Holds the `connect` claim; dropped without [`ConnectClaim::succeeded`]
/// (an error, or the future dropped mid-way) it releases the claim:
/// back to idle while the QP is untouched, else to failed.
struct ConnectClaim<'a> {
    conn: &'a AtomicU8,
    qp_touched: bool,
    done: bool,
}

impl ConnectClaim<'_> {
    fn succeeded(mut self) {
        self.conn.store(CONN_CONNECTED, Ordering::Release);
        self.done = true;
    }
}

impl Drop for ConnectClaim<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.conn.store(if self.qp_touched { CONN_FAILED } else { CONN_IDLE }, Ordering::Release);
        }
    }
}

impl RdmaTransport {
    /// Creates a transport on the configured provider and device.
    ///
    /// Fails when `config.provider` is `Auto` and `RMACOMM_PROVIDER` holds
    /// something else than `auto`, `verbs` or `soft`.
    pub fn new(config: TransportConfig) -> Result<RdmaTransport, TransportError> {
        if config.provider == ProviderKind::Auto {
            // `TransportConfig::default()` fell back to auto on a bad value;
            // report it here rather than run on a provider nobody chose.
            ProviderKind::from_env()?;
        }
        if config.timeout.is_none() {
            // Likewise a bad RMACOMM_TIMEOUT_SECONDS (`inf`, `-5`, `abc`):
            // refused rather than run without the timeout asked for.
            crate::config::env_timeout()?;
        }
        // A bad RMACOMM_IB_TIMEOUT: refused, not replaced by the default.
        crate::config::env_ack_timeout()?;
        if config.recv_depth == 0 {
            // No receive posted: the peer's notifying writes would be
            // retried (receiver not ready) forever.
            return Err(TransportError::invalid("RdmaTransport::new", "recv_depth must be at least 1"));
        }
        if config.max_in_flight == 0 || config.max_in_flight > Semaphore::MAX_PERMITS {
            return Err(TransportError::invalid(
                "RdmaTransport::new",
                format!("max_in_flight must be between 1 and {}", Semaphore::MAX_PERMITS),
            ));
        }
        let d = domain(config.provider, config.device.as_deref(), config.soft.as_ref())?;
        let vcfg = config.virtual_qp_config();
        vcfg.validate()?;
        let cq = VirtualCq::new(&d.ctx, config.cq_depth)?;
        let qp = VirtualQp::new(&d.pd, &cq, &vcfg)?;
        Ok(RdmaTransport {
            inner: Arc::new(Inner {
                domain: d,
                cq,
                qp,
                slots: Arc::new(Semaphore::new(config.max_in_flight)),
                config,
                st: Mutex::new(State::default()),
                peer: OnceLock::new(),
                conn: AtomicU8::new(CONN_IDLE),
                shutdown: Notify::new(),
                posting: std::sync::atomic::AtomicUsize::new(0),
                spun_at: AtomicU64::new(0),
                spin_quit: Notify::new(),
                born: std::time::Instant::now(),
                broken_flag: std::sync::atomic::AtomicBool::new(false),
                direct: Arc::default(),
                rt: OnceLock::new(),
                notes: Notes::default(),
                banked: AtomicU64::new(0),
            }),
        })
    }

    /// True when a provider with a usable device is present (the soft
    /// provider always is).
    pub fn supported() -> bool {
        ibverbx::devices().map(|d| !d.is_empty()).unwrap_or(false)
    }

    /// The soft provider's counters of the context this transport's device
    /// uses (shared by every transport and memory on it; `None` on
    /// another provider): how bytes moved (direct copies, peers' device
    /// memory, the connection).
    pub fn soft_stats(&self) -> Option<ibverbx::soft::SoftStats> {
        ibverbx::soft::stats(&self.domain().ctx)
    }

    pub(crate) fn domain(&self) -> &Arc<Domain> {
        &self.inner.domain
    }

    /// The provider this transport's device belongs to: `"soft"` (the
    /// userspace provider: its engine moves every byte, device memory's
    /// through the CUDA driver) or a verbs provider's name (`"mlx5"`, ...:
    /// the HCA moves the bytes).
    pub fn provider(&self) -> &'static str {
        self.inner.domain.provider
    }

    /// The URL to give the peer: printable, and carrying an unguessable
    /// token without which a connection is refused.
    pub fn bind(&self) -> Result<String, TransportError> {
        let ep = self.inner.qp.endpoint()?;
        let d = &self.inner.domain;
        let page = (d.provider == "soft")
            .then(|| self.inner.notes.own_page(|| crate::RdmaMemory::alloc_in(d.clone(), notes::PAGE).ok()))
            .flatten();
        Ok(url::encode(d.provider, &ep, page))
    }

    /// Connects to the peer's URL. Must be called inside a tokio runtime
    /// (the completion driver runs there). Resolves once this side's
    /// connection to the peer is accepted.
    ///
    /// One transport connects once, to one peer. A second `connect` — while
    /// one is in progress, after one succeeded, or after one failed once it
    /// had reached the peer — fails at once with
    /// [`TransportError::InvalidArgument`] and leaves the transport as it
    /// is. An error rather than a wait for the first call: code that races
    /// two connects on one transport (say, a NIXL- or torchcomms-style
    /// agent connecting twice to one peer) has a bug, which sharing the
    /// first call's result would hide. Make one transport per peer, and a
    /// new one to reconnect. A `connect` that fails before reaching the
    /// peer (a malformed URL, another provider, no runtime) may be retried.
    ///
    /// Errors never contain the URL or its tokens.
    pub async fn connect(&self, peer_url: &str) -> Result<(), TransportError> {
        let mut claim = self.claim_connect()?;
        let (provider, ep, notes) = url::decode(peer_url)?;
        if provider != self.inner.domain.provider {
            return Err(TransportError::invalid(
                "connect",
                format!("the peer uses the {provider} provider, this side {}", self.inner.domain.provider),
            ));
        }
        let rt = tokio::runtime::Handle::try_current()
            .map_err(|_| TransportError::Unsupported("connect must be called inside a tokio runtime".into()))?;
        let peer = url::describe(&provider, &ep);
        let named = |e: ibverbx::Error| match TransportError::from(e) {
            TransportError::InvalidArgument { reason, .. } => {
                TransportError::InvalidArgument { op: "connect", reason: format!("{reason} (connecting to {peer})") }
            }
            TransportError::Broken(m) => TransportError::Broken(format!("connecting to {peer}: {m}")),
            other => other,
        };
        // A peer that does not match (another QP count, load balancing) is
        // refused before any QP is touched: the transport may connect to
        // another.
        self.inner.qp.check_endpoint(&ep).map_err(named)?;
        claim.qp_touched = true;
        // Set once the peer is taken (they are set-once): a URL refused
        // above leaves neither its name nor its notification page behind
        // for the connect that follows.
        let _ = self.inner.peer.set(peer.clone());
        if let Some(page) = notes {
            let _ = self.inner.notes.peer.set(page);
        }
        self.inner.qp.connect(&ep).map_err(|e| match TransportError::from(e) {
            TransportError::InvalidArgument { op, reason } => {
                TransportError::InvalidArgument { op, reason: format!("{reason} (connecting to {peer})") }
            }
            TransportError::Broken(m) => TransportError::Broken(format!("connecting to {peer}: {m}")),
            other => other,
        })?;
        let recvs: Vec<RecvWr<'_>> =
            (0..self.inner.config.recv_depth as u64).map(|i| RecvWr { wr_id: RECV_BIT | i, sg_list: &[] }).collect();
        self.inner.qp.post_recv(&recvs)?;
        rt.spawn(drive(self.inner.clone()));
        let _ = self.inner.rt.set(rt);
        // A zero-byte write proves the peer accepted this side's connection
        // (a wrong token or a dead peer fails it).
        let slot = self.inner.slots.clone().try_acquire_owned().map_err(|_| TransportError::ResourceExhausted {
            what: "connect: no in-flight slot is free on a fresh transport".into(),
        })?;
        let rx = self.inner.post(
            Op {
                name: "connect",
                op: SendOp::RdmaWrite { remote_addr: 0, rkey: 0 },
                sge: None,
                mem: None,
                local_off: 0,
            },
            slot,
        )?;
        let t = self.inner.config.timeout.unwrap_or(Duration::from_secs(30));
        match self.inner.finish(rx, "connect", Deadline::After(t)).await {
            Ok(()) => {
                claim.succeeded();
                Ok(())
            }
            Err(e) => {
                // The outer error says what to do next; say it once.
                let why = match e {
                    TransportError::Broken(m) => m,
                    TransportError::PeerClosed { .. } => "the peer closed the connection or is unreachable".into(),
                    TransportError::Completion { status, .. } => format!("completion status \"{status}\""),
                    other => other.to_string(),
                };
                Err(TransportError::Broken(format!("connection to {peer} refused or lost: {why}")))
            }
        }
    }

    /// Takes the one `connect` of this transport, or says why not.
    fn claim_connect(&self) -> Result<ConnectClaim<'_>, TransportError> {
        let conn = &self.inner.conn;
        match conn.compare_exchange(CONN_IDLE, CONN_CONNECTING, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => Ok(ConnectClaim { conn, qp_touched: false, done: false }),
            Err(state) => Err(TransportError::invalid(
                "connect",
                match state {
                    CONN_CONNECTING => {
                        "a connect is already in progress on this transport; one transport serves one \
                                        peer (make another transport for another peer)"
                    }
                    CONN_CONNECTED => {
                        "already connected; one transport serves one peer (make another transport \
                                       for another peer)"
                    }
                    _ => "an earlier connect of this transport failed; create a new transport to connect again",
                },
            )),
        }
    }

    /// The error that broke the connection (the peer closed it, an
    /// operation failed), once one did: every later operation fails with it.
    pub fn error(&self) -> Option<TransportError> {
        if !self.inner.broken_flag.load(Ordering::Acquire) {
            return None;
        }
        self.inner.lock().broken.clone()
    }

    /// The TCP addresses at which this transport's device accepts the soft
    /// provider's connections, best first (the interfaces
    /// `RMACOMM_SOCKET_IFNAME` or `RMACOMM_SOFT_ADDR` select): the
    /// addresses a peer on another host reaches this process at. Empty on
    /// a hardware provider. For control planes that run beside the
    /// transport (an agent's handshake listener) and should be reachable
    /// where the transport is.
    pub fn tcp_addrs(&self) -> Vec<std::net::SocketAddr> {
        match self.inner.qp.endpoint() {
            Ok(ep) => ep.data.first().and_then(|q| q.soft.as_ref()).map(|s| s.tcp.clone()).unwrap_or_default(),
            Err(_) => Vec::new(),
        }
    }

    /// True once `connect` succeeded and nothing has broken since.
    pub fn connected(&self) -> bool {
        self.inner.is_connected() && self.inner.lock().broken.is_none()
    }

    /// Writes `local` into the peer's `remote` buffer (zero-copy); resolves
    /// when the data is placed. With `notify`, the peer's
    /// [`wait_for_write`](Self::wait_for_write) is satisfied once.
    ///
    /// The write is posted when this is called if one of the transport's
    /// `max_in_flight` slots is free, else when the future, polled, gets
    /// one (backpressure: memory stays bounded however many calls are
    /// made). The future does not borrow the transport, so dropping the
    /// transport resolves it with [`TransportError::Aborted`].
    ///
    /// Dropping the future (or timing out) never breaks the transport: the
    /// write goes on, keeping `local`'s registration alive (and its slot)
    /// until it completes, even when the `RdmaMemory` itself is dropped.
    pub fn write<'a>(
        &self,
        local: View<'a>,
        remote: &RdmaRemoteBuffer,
        notify: bool,
    ) -> impl Future<Output = Result<(), TransportError>> + Send + 'a {
        self.write_with_timeout(local, remote, notify, self.inner.config.timeout)
    }

    /// [`write`](Self::write) with its own timeout (`None`: wait forever).
    pub fn write_with_timeout<'a>(
        &self,
        local: View<'a>,
        remote: &RdmaRemoteBuffer,
        notify: bool,
        timeout: Option<Duration>,
    ) -> impl Future<Output = Result<(), TransportError>> + Send + 'a {
        let op = write_op(remote, notify);
        let started = self.start(self.prepare("write", local.mem, local.offset, local.len, remote, op));
        self.run(started, "write", timeout, local)
    }

    /// [`write`](Self::write) from memory the future owns (an `Arc`), so
    /// that the future is `'static`: for writes started by one task and
    /// awaited by another, or kept in a table. `offset` and `len` name the
    /// bytes of `local` to send. Posted when called (or once a slot frees),
    /// like `write`.
    pub fn write_owned(
        &self,
        local: Arc<crate::RdmaMemory>,
        offset: usize,
        len: usize,
        remote: &RdmaRemoteBuffer,
        notify: bool,
    ) -> impl Future<Output = Result<(), TransportError>> + Send + 'static {
        let started = self.start_owned_write(&local, offset, len, remote, notify);
        self.run(started, "write", self.inner.config.timeout, local)
    }

    /// Validates and starts a write from `local[offset..offset+len]`.
    fn start_owned_write(
        &self,
        local: &crate::RdmaMemory,
        offset: usize,
        len: usize,
        remote: &RdmaRemoteBuffer,
        notify: bool,
    ) -> Result<Start, TransportError> {
        let op = write_op(remote, notify);
        self.start(local.view(offset, len).and_then(|_| self.prepare("write", local, offset, len, remote, op)))
    }

    /// [`write`](Self::write), only if it is posted (or copied) now:
    /// `None` when every in-flight slot is taken, and then nothing was
    /// posted. For a caller that must know its writes were posted in the
    /// order it made them (a notification behind the data it announces):
    /// `write` would post later, when its future is polled and a slot frees.
    pub fn try_write<'a>(
        &self,
        local: View<'a>,
        remote: &RdmaRemoteBuffer,
        notify: bool,
    ) -> Option<impl Future<Output = Result<(), TransportError>> + Send + 'a> {
        let op = write_op(remote, notify);
        let started = self.start(self.prepare("write", local.mem, local.offset, local.len, remote, op));
        // Not posted: the operation (and the registration it held) goes.
        if matches!(started, Ok(Start::Waiting(_))) {
            return None;
        }
        Some(self.run(started, "write", self.inner.config.timeout, local))
    }

    /// [`write_owned`](Self::write_owned), only if it is posted (or
    /// copied) now: `None` when every in-flight slot is taken, and then
    /// nothing was posted (see [`try_write`](Self::try_write)).
    pub fn try_write_owned(
        &self,
        local: Arc<crate::RdmaMemory>,
        offset: usize,
        len: usize,
        remote: &RdmaRemoteBuffer,
        notify: bool,
    ) -> Option<impl Future<Output = Result<(), TransportError>> + Send + 'static> {
        let started = self.start_owned_write(&local, offset, len, remote, notify);
        if matches!(started, Ok(Start::Waiting(_))) {
            return None;
        }
        Some(self.run(started, "write", self.inner.config.timeout, local))
    }

    /// Reads the peer's `remote` buffer into `local` (zero-copy). Posted when
    /// called or once a slot frees, like [`write`](Self::write); a dropped
    /// read keeps `local`'s registration until the data has landed.
    pub fn read<'a>(
        &self,
        local: ViewMut<'a>,
        remote: &RdmaRemoteBuffer,
    ) -> impl Future<Output = Result<(), TransportError>> + Send + 'a {
        self.read_with_timeout(local, remote, self.inner.config.timeout)
    }

    /// [`read`](Self::read) with its own timeout.
    pub fn read_with_timeout<'a>(
        &self,
        local: ViewMut<'a>,
        remote: &RdmaRemoteBuffer,
        timeout: Option<Duration>,
    ) -> impl Future<Output = Result<(), TransportError>> + Send + 'a {
        let op = SendOp::RdmaRead { remote_addr: remote.addr, rkey: remote.key };
        let started = self.start(self.prepare("read", local.mem, local.offset, local.len, remote, op));
        self.run(started, "read", timeout, local)
    }

    /// [`read`](Self::read) into memory the future owns (an `Arc`), so that
    /// the future is `'static` (see [`write_owned`](Self::write_owned)).
    pub fn read_owned(
        &self,
        local: Arc<crate::RdmaMemory>,
        offset: usize,
        len: usize,
        remote: &RdmaRemoteBuffer,
    ) -> impl Future<Output = Result<(), TransportError>> + Send + 'static {
        let op = SendOp::RdmaRead { remote_addr: remote.addr, rkey: remote.key };
        let prepared = local.view_mut(offset, len).and_then(|_| self.prepare("read", &local, offset, len, remote, op));
        let started = self.start(prepared);
        self.run(started, "read", self.inner.config.timeout, local)
    }

    /// Adds `add` to the 64-bit word at `remote` (8 bytes, 8-byte aligned)
    /// in the peer's memory, atomically with respect to the peer's other
    /// atomics, and stores the old value in `local` (8 bytes): an RDMA
    /// fetch-and-add. Posted and completed in order with this transport's
    /// other operations, like [`write`](Self::write).
    pub fn fetch_add<'a>(
        &self,
        local: ViewMut<'a>,
        remote: &RdmaRemoteBuffer,
        add: u64,
        timeout: Option<Duration>,
    ) -> impl Future<Output = Result<(), TransportError>> + Send + 'a {
        let op = SendOp::Atomic { remote_addr: remote.addr, rkey: remote.key, op: ibverbx::AtomicOp::FetchAdd { add } };
        let prepared = if local.len != 8 || remote.len != 8 || !remote.addr.is_multiple_of(8) {
            Err(TransportError::invalid("fetch_add", "the local and remote words must be 8 bytes, the remote aligned"))
        } else {
            self.prepare("fetch_add", local.mem, local.offset, local.len, remote, op)
        };
        let started = self.start(prepared);
        self.run(started, "fetch_add", timeout, local)
    }

    /// Maps the peer's `remote` buffer into this process when the peer is on
    /// this host and its memory is a shared segment (the soft provider's
    /// default allocation): `Some` [`MappedBuffer`](crate::MappedBuffer),
    /// through which copies and atomics are plain loads and stores by the
    /// calling thread. `None` for a peer on another host, memory outside a
    /// shared segment, or a hardware provider: use `write` / `read`. Fails
    /// when the peer does not register `remote`. Needs a connected
    /// transport; runs under the transport's timeout.
    pub fn map_remote(
        &self,
        remote: &RdmaRemoteBuffer,
    ) -> impl Future<Output = Result<Option<crate::MappedBuffer>, TransportError>> + Send + 'static {
        const OP: &str = "map_remote";
        let remote = *remote;
        let connected = self.inner.is_connected();
        let fut = self.inner.qp.map_remote(remote.key, remote.addr, remote.len);
        let timeout = self.inner.config.timeout;
        async move {
            if !connected {
                return Err(TransportError::invalid(OP, "not connected"));
            }
            let mapped = match timeout {
                None => fut.await,
                Some(t) => {
                    tokio::time::timeout(t, fut).await.map_err(|_| TransportError::Timeout { op: OP, after: t })?
                }
            };
            Ok(mapped?.map(|m| crate::MappedBuffer::new(m, remote)))
        }
    }

    /// Waits for one notifying write from the peer. A counting semaphore:
    /// each write with `notify` satisfies exactly one wait, and
    /// notifications that arrive first are kept for later waits. Waits are
    /// served oldest first, except that with
    /// [`busy_poll`](TransportConfig::busy_poll) a wait made while no other
    /// waits spins before it joins the queue (a wait made during its spin
    /// may be served first).
    pub fn wait_for_write(&self) -> impl Future<Output = Result<(), TransportError>> + Send + 'static {
        self.wait_for_write_with_timeout(self.inner.config.timeout)
    }

    /// Gives back one notification that a
    /// [`wait_for_write`](Self::wait_for_write) returned but whose caller
    /// could not use it (a wrapper whose own future was cancelled meanwhile,
    /// as an asyncio wait): the oldest wait gets it, else the next one. Only
    /// for a notification a wait returned: one given back otherwise
    /// satisfies a wait that no write notified.
    pub fn put_back_notification(&self) {
        self.inner.lock().deliver_notification(&self.inner.banked);
    }

    /// [`wait_for_write`](Self::wait_for_write) with its own timeout.
    pub fn wait_for_write_with_timeout(
        &self,
        timeout: Option<Duration>,
    ) -> impl Future<Output = Result<(), TransportError>> + Send + 'static {
        const OP: &str = "wait_for_write";
        self.inner.reap_notes();
        let early = {
            let mut st = self.inner.lock();
            if self.inner.take_banked(&st) {
                Err(Ok(()))
            } else if let Some(e) = &st.broken {
                Err(Err(e.clone()))
            } else if !self.inner.is_connected() {
                Err(Err(TransportError::invalid(OP, "not connected")))
            } else if !self.inner.config.busy_poll.is_zero() && st.waiters.is_empty() {
                // Nobody waits ahead of this call: it spins first (when
                // polled), taking a notification as one comes, and joins
                // the table only if none did.
                Ok(None)
            } else {
                let (tx, rx) = oneshot::channel();
                st.waiters.push_back(tx);
                Ok(Some(rx))
            }
        };
        // A notification taken above belongs to this future once polled: a
        // future dropped unpolled (the losing branch of a select, a caller
        // that failed before awaiting it) gives it back.
        let taken = Banked(matches!(early, Err(Ok(()))).then(|| self.inner.clone()));
        // The guard exists from here on, so that a future dropped before
        // its first poll is counted as abandoned too.
        let waiter = early.map(|rx| Waiter { inner: self.inner.clone(), rx });
        async move {
            taken.keep();
            let mut w = match waiter {
                Ok(w) => w,
                Err(r) => return r,
            };
            // The timeout counts from here, the spin included.
            let deadline = timeout.map(|t| (t, ibverbx::deadline_after(t)));
            let until = deadline.map(|(_, at)| at);
            let spun = w.rx.is_none();
            if spun {
                let inner = w.inner.clone();
                if let Some(r) = inner.spin_sliced(until, |u| inner.spin_for_note(u)).await {
                    return r;
                }
                let mut st = w.inner.lock();
                if w.inner.take_banked(&st) {
                    return Ok(());
                } else if let Some(e) = st.wait_error() {
                    return Err(e);
                }
                let (tx, rx) = oneshot::channel();
                st.waiters.push_back(tx);
                w.rx = Some(rx);
            }
            let inner = &w.inner;
            let rx = w.rx.as_mut().expect("set above");
            // Reap pending notifications here first (see `finish`).
            let aborted = || Err(TransportError::Aborted { op: OP });
            let res = match inner.reap_until(rx, !spun, until) {
                Some(r) => r,
                None => {
                    // Asleep from here: a same-host writer wakes it through
                    // the QP. Marked first, then the counter read again
                    // (see `notes`).
                    let _parked = Parked::new(inner.clone());
                    match rx.try_recv() {
                        Ok(r) => r,
                        Err(oneshot::error::TryRecvError::Closed) => aborted(),
                        Err(oneshot::error::TryRecvError::Empty) => match deadline {
                            None => (&mut *rx).await.unwrap_or_else(|_| aborted()),
                            Some((t, at)) => {
                                match tokio::time::timeout_at(tokio::time::Instant::from_std(at), &mut *rx).await {
                                    Ok(r) => r.unwrap_or_else(|_| aborted()),
                                    // A notification that raced the timeout is
                                    // taken; one that comes later is handed on by
                                    // the Waiter's drop.
                                    Err(_) => match rx.try_recv() {
                                        Ok(r) => r,
                                        Err(_) => return Err(TransportError::Timeout { op: OP, after: t }),
                                    },
                                }
                            }
                        },
                    }
                }
            };
            w.rx = None;
            res
        }
    }

    /// The mapping of the peer's memory that holds all of `remote`, and the
    /// offset of `remote` in it: for copies by the calling thread to a
    /// same-host peer (the transport's own direct copies, see
    /// [`TransportConfig::direct_copy_max`], use the same mappings). `None`
    /// while the mapping is being made (this call starts it, on the runtime
    /// `connect` ran on; a later call finds it), and for good when the peer
    /// is on another host, `remote` is not in a shared segment or a copy
    /// through its key failed. One mapping per key, of the whole region the
    /// key registers. Every copy through it checks the peer's live key.
    pub fn cached_mapping(&self, remote: &RdmaRemoteBuffer) -> Option<(Arc<crate::MappedBuffer>, usize)> {
        self.inner.cached_mapping(remote)
    }

    /// Regions of the peer mapped here for same-host copies by the calling
    /// thread (see [`cached_mapping`](Self::cached_mapping)), the peer's
    /// notification page included (the first direct copy maps it: every
    /// one looks at it). A diagnostic.
    pub fn direct_mappings(&self) -> usize {
        self.inner.direct.mapped()
    }

    /// Notifications from the peer taken from shared memory (a same-host
    /// peer's direct notifying writes, see
    /// [`TransportConfig::direct_copy_max`]) rather than through the QP.
    /// A diagnostic.
    pub fn direct_notifications(&self) -> u64 {
        self.inner.notes.seen.load(Ordering::Acquire)
    }

    /// Operations posted (or being posted) and not yet completed, those
    /// whose callers timed out or dropped their futures included: never
    /// more than [`TransportConfig::max_in_flight`]. A diagnostic.
    pub fn in_flight(&self) -> usize {
        self.inner.lock().pending.slots.len()
    }

    /// In-flight slots free now: this many operations posted next are
    /// posted at once (none waits for a slot), as long as nobody else posts
    /// in between. A diagnostic, and what a caller that must know its
    /// operations were posted in order checks first.
    pub fn free_slots(&self) -> usize {
        self.inner.slots.available_permits()
    }

    /// Entries in the table of `wait_for_write` calls: the waiting ones plus
    /// at most as many abandoned (timed out, dropped) ones not yet pruned.
    /// A diagnostic.
    pub fn waiters(&self) -> usize {
        self.inner.lock().waiters.len()
    }

    /// Validates an operation (nothing is posted yet).
    fn prepare<'m>(
        &self,
        name: &'static str,
        mem: &'m crate::RdmaMemory,
        offset: usize,
        len: usize,
        remote: &RdmaRemoteBuffer,
        op: SendOp,
    ) -> Result<Prepared<'m>, TransportError> {
        self.check(name, mem, len, remote)?;
        let sge = mem.mr().sge(offset, len)?;
        // The registration is held (an Arc) only by an operation posted.
        Ok((Op { name, op, sge: (len > 0).then_some(sge), mem: None, local_off: offset }, mem))
    }

    /// The future of a started operation: ready at once when it was copied
    /// here (no transport reference, no state), else [`Inner::complete`].
    fn run<'a, K: Send + 'a>(
        &self,
        started: Result<Start, TransportError>,
        name: &'static str,
        timeout: Option<Duration>,
        keep: K,
    ) -> impl Future<Output = Result<(), TransportError>> + Send + 'a {
        match started {
            Ok(Start::Done) => Either::Left(std::future::ready(Ok(()))),
            started => Either::Right(self.inner.clone().complete(started, name, timeout, keep)),
        }
    }

    /// Copies a validated operation here when it can (see
    /// [`TransportConfig::direct_copy_max`]), else posts it now if a slot is
    /// free; else the caller's future waits for one.
    fn start(&self, prepared: Result<Prepared<'_>, TransportError>) -> Result<Start, TransportError> {
        let (mut op, mem) = prepared?;
        match self.inner.try_direct(&op, mem.mr()) {
            Direct::Done => return Ok(Start::Done),
            // Copied and counted in; a zero-byte wake-up goes through the
            // QP, and the operation completes with it.
            Direct::Wake => {
                let wake = Op {
                    name: op.name,
                    op: SendOp::RdmaWriteWithImm { remote_addr: 0, rkey: 0, imm: notes::WAKE_IMM },
                    sge: None,
                    mem: None,
                    local_off: 0,
                };
                return match self.inner.slots.clone().try_acquire_owned() {
                    Ok(slot) => self.inner.post(wake, slot).map(Start::Posted),
                    // Another thread took the last slot since the in-flight
                    // check: the wake-up must not depend on this call's
                    // future being polled (the notification is counted), so
                    // a task posts it once a slot frees. The write is done.
                    Err(TryAcquireError::NoPermits) => {
                        self.inner.clone().wake_later(wake);
                        Ok(Start::Done)
                    }
                    Err(TryAcquireError::Closed) => Err(self.inner.closed_error(op.name)),
                };
            }
            Direct::No => op.mem = Some(mem.hold()),
        }
        match self.inner.slots.clone().try_acquire_owned() {
            Ok(slot) => self.inner.post(op, slot).map(Start::Posted),
            Err(TryAcquireError::NoPermits) => Ok(Start::Waiting(op)),
            Err(TryAcquireError::Closed) => Err(self.inner.closed_error(op.name)),
        }
    }

    fn check(
        &self,
        op: &'static str,
        mem: &crate::RdmaMemory,
        len: usize,
        remote: &RdmaRemoteBuffer,
    ) -> Result<(), TransportError> {
        // `broken_flag` follows `broken`; `post` checks again under the lock.
        if self.inner.broken_flag.load(Ordering::Acquire) {
            if let Some(e) = &self.inner.lock().broken {
                return Err(e.clone());
            }
        }
        if !self.inner.is_connected() {
            return Err(TransportError::invalid(op, "not connected; call connect first"));
        }
        if !Arc::ptr_eq(&mem.domain, &self.inner.domain) {
            return Err(TransportError::invalid(
                op,
                "the memory is registered on another device than this transport's",
            ));
        }
        if len as u64 > remote.len {
            return Err(TransportError::invalid(
                op,
                format!("the local view is {len} bytes, longer than the remote buffer of {}", remote.len),
            ));
        }
        if !remote.is_addressable() {
            // No registration ends past the top of the address space: a
            // confused description, refused before anything is posted
            // (posted, it would break the connection as a remote access
            // error).
            return Err(TransportError::invalid(
                op,
                format!("the remote buffer {remote} ends past the top of the address space"),
            ));
        }
        Ok(())
    }
}

impl Inner {
    fn is_connected(&self) -> bool {
        self.conn.load(Ordering::Acquire) == CONN_CONNECTED
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.st.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Copies `op` through a mapping of the peer's region, when the peer is
    /// on this host, the operation is a write or a read of at most
    /// `direct_copy_max` bytes and nothing is in flight (which it would
    /// overtake); a notifying write is then counted into the peer's
    /// notification page (see `notes`). `No` leaves `op` to the QP (a key
    /// not mapped yet, or one whose copy failed: the QP then reports it).
    fn try_direct(&self, op: &Op, mem: &MemoryRegion) -> Direct {
        let len = op.sge.as_ref().map_or(0, |s| s.length as usize);
        // Device memory: the host copies none of it (the QP stages it).
        if len > self.config.direct_copy_max || self.config.direct_copy_max == 0 || mem.device().is_some() {
            return Direct::No;
        }
        let (addr, key, write, notify) = match op.op {
            SendOp::RdmaWrite { remote_addr, rkey } => (remote_addr, rkey, true, false),
            SendOp::RdmaWriteWithImm { remote_addr, rkey, imm: 0 } => (remote_addr, rkey, true, true),
            SendOp::RdmaRead { remote_addr, rkey } => (remote_addr, rkey, false, false),
            _ => return Direct::No,
        };
        // A zero-byte plain write (connect's probe) proves something only
        // through the QP.
        if (len == 0 && !notify)
            || self.slots.available_permits() != self.config.max_in_flight
            || self.broken_flag.load(Ordering::Acquire)
        {
            return Direct::No;
        }
        // Every direct copy needs the peer's page (mapped on first use, in
        // the background like the data's regions): a notifying write counts
        // into it, and it is how any copy sees at once that the peer
        // dropped its transport. (Plain copies once looked at it only when a
        // notifying write had mapped it: to a peer that dropped its
        // transport, they landed and said Ok until the driver saw the QP
        // fail.)
        let page = self.notes.peer_page(|p| self.cached_mapping(p).map(|(m, _)| m));
        // The peer dropped its transport (its page says so at once, before
        // this side's driver sees the connection go): the connection is
        // over. A copy would land in (or read) memory the peer may already
        // use with another connection, and succeed; so would a WR its QP
        // still serves until it is torn down.
        if page.is_some_and(|p| if notify { notes::closed(p) } else { notes::poisoned(p) }) {
            self.break_with(TransportError::PeerClosed { peer: self.peer() });
            return Direct::No;
        }
        // The data's mapping is asked for (started, if new) whether or not
        // the page is mapped yet.
        let data = (len > 0).then(|| self.cached_mapping(&RdmaRemoteBuffer { addr, len: len as u64, key }));
        if page.is_none() {
            return Direct::No;
        }
        let page = page.filter(|_| notify);
        if let Some(data) = data {
            let Some((m, off)) = data else {
                return Direct::No;
            };
            let copied = if write {
                m.map().write_from(off, mem, op.local_off, len)
            } else {
                m.map().read_into(off, mem, op.local_off, len)
            };
            if copied.is_err() {
                self.direct.give_up(key);
                return Direct::No;
            }
        }
        match page.map(notes::count_in) {
            // Counted in, and a waiter of the peer sleeps: wake it.
            Some(Some(true)) => Direct::Wake,
            // Copied, so the QP would copy it again: harmless, and it
            // notifies. (Not reached: the page's words were checked.)
            Some(None) => Direct::No,
            _ => Direct::Done,
        }
    }

    /// Takes one banked notification, if there is one (`_st`: under the
    /// state lock).
    fn take_banked(&self, _st: &State) -> bool {
        let b = self.banked.load(Ordering::Acquire);
        if b > 0 {
            self.banked.store(b - 1, Ordering::Release);
        }
        b > 0
    }

    /// Takes the notifications the peer counted into this side's page and
    /// hands them to waiters (or banks them). True when it found some.
    fn reap_notes(&self) -> bool {
        let Some(count) = self.notes.counted() else { return false };
        if count == self.notes.seen.load(Ordering::Acquire) {
            return false;
        }
        let mut st = self.lock();
        // `seen` also moves without the lock, by one (`take_note`).
        let mut seen = self.notes.seen.load(Ordering::Acquire);
        let count = loop {
            let count = self.notes.counted().unwrap_or(seen);
            if count <= seen {
                return true;
            }
            match self.notes.seen.compare_exchange(seen, count, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => break count,
                Err(now) => seen = now,
            }
        };
        st.deliver_notifications(count - seen, &self.banked);
        true
    }

    /// Posts the wake-up `wake` from a task on the driver's runtime once a
    /// slot frees (nothing to do once the transport is closed).
    fn wake_later(self: Arc<Self>, wake: Op) {
        let Some(rt) = self.rt.get().cloned() else { return };
        rt.spawn(async move {
            if let Ok(slot) = self.slots.clone().acquire_owned().await {
                if let Ok(rx) = self.post(wake, slot) {
                    let _ = rx.await;
                }
            }
        });
    }

    /// Takes one notification straight from this side's page, without the
    /// state lock (a spinning wait with nobody ahead of it).
    fn take_note(&self) -> bool {
        let Some(count) = self.notes.counted() else { return false };
        let seen = self.notes.seen.load(Ordering::Acquire);
        count > seen && self.notes.seen.compare_exchange(seen, seen + 1, Ordering::AcqRel, Ordering::Relaxed).is_ok()
    }

    /// See [`RdmaTransport::cached_mapping`].
    fn cached_mapping(&self, want: &RdmaRemoteBuffer) -> Option<(Arc<crate::MappedBuffer>, usize)> {
        if self.domain.provider != "soft" {
            return None;
        }
        let rt = self.rt.get()?;
        // The whole region the key registers, so that one mapping serves
        // every slice of it: a copy outside a partial mapping would take
        // the QP until a larger one was made.
        let map = |hull: RdmaRemoteBuffer| {
            let f = self.qp.map_remote_region(hull.key, hull.addr);
            async move {
                let m = f.await.ok().flatten()?;
                let r = RdmaRemoteBuffer { addr: m.remote_addr(), len: m.len() as u64, key: hull.key };
                // Not all of what was asked (it is not registered): the QP
                // reports that.
                let covers = r.addr <= hull.addr && hull.addr.saturating_add(hull.len) <= r.addr + r.len;
                covers.then(|| crate::MappedBuffer::new(m, r))
            }
        };
        self.direct.lookup(want, rt, map)
    }

    /// Records and posts one WR holding `slot`; returns its completion
    /// receiver.
    fn post(&self, op: Op, slot: OwnedSemaphorePermit) -> Result<ReplyRx, TransportError> {
        let (tx, rx) = oneshot::channel();
        let id = {
            let mut st = self.lock();
            if let Some(e) = &st.broken {
                return Err(if st.dropped { TransportError::Aborted { op: op.name } } else { e.clone() });
            }
            let len = op.sge.as_ref().map_or(0, |s| u64::from(s.length));
            let remote = match op.op {
                SendOp::RdmaWrite { remote_addr, rkey }
                | SendOp::RdmaWriteWithImm { remote_addr, rkey, .. }
                | SendOp::RdmaRead { remote_addr, rkey } => Some((remote_addr, len, rkey)),
                SendOp::Atomic { remote_addr, rkey, .. } => Some((remote_addr, 8, rkey)),
                _ => None,
            };
            st.pending.insert(op.name, remote, tx, op.mem, slot)
        };
        let sge = op.sge.as_slice();
        self.posting.fetch_add(1, Ordering::AcqRel);
        let posted = self.qp.post_send(&[SendWr { wr_id: id, op: op.op, sg_list: sge, flags: SendFlags::SIGNALED }]);
        self.posting.fetch_sub(1, Ordering::AcqRel);
        if let Err(e) = posted {
            self.lock().pending.remove(id);
            return Err(e.into());
        }
        Ok(rx)
    }

    /// Why no slot can be had: the slots close when the transport breaks or
    /// is dropped.
    fn closed_error(&self, op: &'static str) -> TransportError {
        let st = self.lock();
        match &st.broken {
            Some(e) if !st.dropped => e.clone(),
            _ => TransportError::Aborted { op },
        }
    }

    /// The future of an operation: waits for a slot if it has none yet,
    /// posts, then waits for the completion. `_keep` borrows the local
    /// memory for as long as the future lives.
    async fn complete<K: Send>(
        self: Arc<Self>,
        started: Result<Start, TransportError>,
        op: &'static str,
        timeout: Option<Duration>,
        _keep: K,
    ) -> Result<(), TransportError> {
        let _keep = _keep;
        let (rx, deadline) = match started? {
            Start::Done => return Ok(()),
            // The clock is read only if the operation must wait.
            Start::Posted(rx) => (rx, timeout.map_or(Deadline::Never, Deadline::After)),
            Start::Waiting(o) => {
                let deadline = timeout.map_or(Deadline::Never, |t| Deadline::At(t, far(t)));
                let acquire = self.slots.clone().acquire_owned();
                let slot = match deadline {
                    Deadline::At(after, at) => match tokio::time::timeout_at(at, acquire).await {
                        Ok(r) => r,
                        Err(_) => return Err(TransportError::Timeout { op, after }),
                    },
                    _ => acquire.await,
                };
                let slot = slot.map_err(|_| self.closed_error(op))?;
                (self.post(o, slot)?, deadline)
            }
        };
        self.finish(rx, op, deadline).await
    }

    /// Polls the CQ once from the calling task and resolves what it finds:
    /// an operation that completed while being posted (the soft provider's
    /// same-host copies) then needs no wake-up of the driver task at all.
    /// True when it found something.
    fn progress(&self) -> bool {
        let mut found = self.reap_notes();
        let mut wcs = [WorkCompletion::empty(); 16];
        loop {
            let n = match self.cq.poll(&mut wcs) {
                Ok(n) => n,
                Err(e) => {
                    self.break_with(e.into());
                    return true;
                }
            };
            for wc in &wcs[..n] {
                self.dispatch(wc);
            }
            found |= n > 0;
            if n < wcs.len() {
                return found;
            }
        }
    }

    /// Spins for up to `busy_poll`, calling `round(poll_cq, every_64th)`
    /// until it returns something: `poll_cq` says whether this round polls
    /// the CQ (see `cq_poll_every`; other rounds look only at the
    /// notification page). The clock is read every 64 rounds: a read costs
    /// as much as a round, and would delay seeing what arrives.
    /// It stops at `until` (the calling operation's deadline) if that comes
    /// first.
    fn spin<R>(&self, until: Option<Instant>, mut round: impl FnMut(bool, bool) -> Option<R>) -> Option<R> {
        let spin_until = ibverbx::deadline_after(self.config.busy_poll);
        let spin_until = until.map_or(spin_until, |u| u.min(spin_until));
        let every = self.cq_poll_every();
        // What this thread waits for is delivered by the soft provider's
        // progress threads (nothing comes through the page): let them have
        // the core every 64 rounds (a few µs), or on a machine with fewer
        // free cores than spinning threads they wait for the end of this
        // one's time slice (milliseconds: the tail of tcp latencies).
        let yields = every == 1 && self.domain.provider == "soft";
        if yields {
            self.spinning();
        }
        let mut n = 0u32;
        loop {
            n = n.wrapping_add(1);
            // Over tcp, receive what waits for this side on its own
            // connections here (the provider's thread would need a
            // wake-up); a no-op elsewhere.
            if yields && n.is_multiple_of(8) {
                self.cq.drive();
            }
            std::hint::spin_loop();
            if let Some(r) = round(n.is_multiple_of(every), n.is_multiple_of(64)) {
                return Some(r);
            }
            if n.is_multiple_of(64) {
                if std::time::Instant::now() >= spin_until {
                    // About to sleep: the provider's threads and the
                    // driver task take over.
                    if yields {
                        self.cq.drive_stop();
                        self.spun_at.store(0, Ordering::Release);
                        self.spin_quit.notify_one();
                    }
                    return None;
                }
                if yields {
                    self.spinning();
                    std::thread::yield_now();
                }
            }
        }
    }

    /// The spin of a `wait_for_write` with nobody ahead of it: takes a
    /// notification from the page as it comes, or the first one banked
    /// meanwhile (here or by the driver task); `None` when none came (or
    /// another caller's wait took it).
    /// Runs `slice` (a spin to the instant it is given) until it finds
    /// something or [`busy_poll`](TransportConfig::busy_poll) has passed
    /// (`until` at most), yielding to the runtime every [`SPIN_SLICE`]: a
    /// timeout around the call (Python's waits check for Ctrl-C in such
    /// slices) and the worker's other tasks get their turn during a long
    /// busy poll, which spun inside one poll before.
    async fn spin_sliced<R>(
        &self,
        until: Option<Instant>,
        mut slice: impl FnMut(Option<Instant>) -> Option<R>,
    ) -> Option<R> {
        if self.config.busy_poll.is_zero() {
            // No spin (the default): one look, no clock read (every
            // operation's completion passes here).
            return slice(until);
        }
        let end = ibverbx::deadline_after(self.config.busy_poll);
        let end = until.map_or(end, |u| u.min(end));
        loop {
            let r = slice(Some(end.min(ibverbx::deadline_after(SPIN_SLICE))));
            if r.is_some() || Instant::now() >= end {
                return r;
            }
            tokio::task::yield_now().await;
        }
    }

    fn spin_for_note(&self, until: Option<Instant>) -> Option<Result<(), TransportError>> {
        self.spin(until, |poll_cq, every_64th| {
            if self.take_note() {
                return Some(Ok(()));
            }
            let found = poll_cq && self.progress();
            if found
                || self.banked.load(Ordering::Acquire) > 0
                || (every_64th && self.broken_flag.load(Ordering::Acquire))
            {
                let st = self.lock();
                if self.take_banked(&st) {
                    return Some(Ok(()));
                }
                return st.wait_error().map(Err);
            }
            None
        })
    }

    /// Notes that a thread spins driving the provider (see `spun_at`).
    fn spinning(&self) {
        self.spun_at.store((self.born.elapsed().as_micros() as u64).max(1), Ordering::Release);
    }

    /// How long the driver task should leave the completion channel
    /// unarmed: a thread spun within the last millisecond (it may return to
    /// its caller without sleeping; a spinner that sleeps says so at once).
    fn spinner_recent(&self) -> Option<Duration> {
        const RECENT: u64 = 1000;
        let at = self.spun_at.load(Ordering::Acquire);
        let ago = (self.born.elapsed().as_micros() as u64).saturating_sub(at);
        (at > 0 && ago < RECENT).then(|| Duration::from_micros(RECENT - ago))
    }

    /// How many spin rounds per CQ poll: every round, unless the peer
    /// notifies through this side's page (it did so once: a same-host peer
    /// with direct copies), whose word is read every round while the CQ,
    /// whose poll costs as much as dozens of such reads, is polled every
    /// 32nd (QP completions then are a fallback, or writes to other memory).
    fn cq_poll_every(&self) -> u32 {
        if self.notes.seen.load(Ordering::Relaxed) > 0 {
            32
        } else {
            1
        }
    }

    /// Polls the CQ from the calling task until `rx` has its result or
    /// `busy_poll` has passed (one poll when it is zero: no clock read).
    fn reap_until(
        &self,
        rx: &mut oneshot::Receiver<Result<(), TransportError>>,
        spin: bool,
        until: Option<Instant>,
    ) -> Option<Result<(), TransportError>> {
        // An earlier caller's poll may have resolved this one already.
        if let Ok(r) = rx.try_recv() {
            return Some(r);
        }
        self.progress();
        if let Ok(r) = rx.try_recv() {
            return Some(r);
        }
        if self.config.busy_poll.is_zero() || !spin {
            return None;
        }
        self.spin(until, |poll_cq, _| {
            if poll_cq {
                self.progress();
            } else {
                self.reap_notes();
            }
            rx.try_recv().ok()
        })
    }

    /// Waits for the completion of WR `id` until `deadline`.
    async fn finish(&self, mut rx: ReplyRx, op: &'static str, mut deadline: Deadline) -> Result<(), TransportError> {
        // A caller that busy-polls reads the clock anyway: its time spinning
        // counts against its timeout.
        if let (Deadline::After(t), false) = (deadline, self.config.busy_poll.is_zero()) {
            deadline = Deadline::At(t, far(t));
        }
        // Reap here first (and, with busy_poll, keep reaping for a while):
        // no wake-up of the driver task is needed for what is found.
        let until = match deadline {
            Deadline::At(_, at) => Some(at.into_std()),
            _ => None,
        };
        if let Some(r) = self.spin_sliced(until, |u| self.reap_until(&mut rx, true, u)).await {
            return r;
        }
        let deadline = match deadline {
            Deadline::Never => None,
            Deadline::After(t) => Some((t, far(t))),
            Deadline::At(t, at) => Some((t, at)),
        };
        let r = match deadline {
            None => (&mut rx).await,
            Some((after, at)) => match tokio::time::timeout_at(at, &mut rx).await {
                Ok(r) => r,
                Err(_) => {
                    // The WR stays posted, its entry (holding the memory and
                    // the slot) until its completion, which nobody awaits.
                    return rx.try_recv().unwrap_or(Err(TransportError::Timeout { op, after }));
                }
            },
        };
        r.unwrap_or(Err(TransportError::Aborted { op }))
    }

    /// Marks the transport broken and fails everything pending with `e`
    /// (the entries stay until their WRs' flushes; see [`PendingSet`]).
    fn break_with(&self, e: TransportError) {
        self.break_with_first(e, || {});
    }

    /// [`break_with`](Self::break_with), running `first` once the transport
    /// is marked broken and before anything pending is failed.
    fn break_with_first(&self, e: TransportError, first: impl FnOnce()) {
        let mut st = self.lock();
        if st.broken.is_none() || st.broken_guessed {
            tracing::warn!("rmacomm transport broken: {e}");
            st.broken = Some(e.clone());
            st.broken_guessed = false;
        }
        let e = st.broken.clone().expect("set above");
        self.broken_flag.store(true, Ordering::Release);
        first();
        st.pending.resolve_all(|_| e.clone());
        for w in st.waiters.drain(..) {
            let _ = w.send(Err(e.clone()));
        }
        st.abandoned = 0;
        drop(st);
        // Calls waiting for a slot fail now rather than post into a dead QP.
        self.slots.close();
    }

    fn peer(&self) -> String {
        self.peer.get().cloned().unwrap_or_else(|| "the peer".into())
    }

    /// The error a failed completion of `op` stands for. The virtual QP
    /// remembers its first failure: the WRs it flushed report
    /// `WrFlushErr`, which says nothing of the cause.
    fn completion_error(&self, op: &'static str, status: WcStatus, remote: Option<(u64, u64, u32)>) -> TransportError {
        let root = match self.qp.error() {
            Some((s, _)) if s != WcStatus::WrFlushErr => s,
            _ => status,
        };
        match root {
            WcStatus::RemAccessErr if status == WcStatus::RemAccessErr => TransportError::RemoteAccess {
                op,
                peer: self.peer(),
                remote: remote.map_or_else(
                    || "the remote buffer".to_owned(),
                    |(addr, len, key)| format!("{addr:#x}+{len} key {key:#x}"),
                ),
            },
            // The soft provider's dead peer (closed socket, exited process)
            // and, on hardware, an unanswered peer: both mean it is gone.
            // A flush with no known cause is the provider moving the QP to
            // the error state on its own, which it does when the link to
            // the peer went away while nothing was in flight.
            WcStatus::RetryExcErr | WcStatus::WrFlushErr => TransportError::PeerClosed { peer: self.peer() },
            s => TransportError::Completion { op, status: s, peer: self.peer() },
        }
    }

    fn dispatch(&self, wc: &WorkCompletion) {
        let is_recv = matches!(wc.opcode, WcOpcode::Recv | WcOpcode::RecvRdmaWithImm) || wc.wr_id & RECV_BIT != 0;
        if is_recv {
            if wc.status != WcStatus::Success {
                // Pending writes and reads get their own completions (with
                // the real status); only waiters and later calls fail here.
                // A flushed receive says the connection is gone, not why: the
                // send that failed (if one was in flight) tells, maybe later.
                // Without it, a peer that went away is the likely cause.
                let known = self.qp.error().is_some_and(|(s, _)| s != WcStatus::WrFlushErr);
                let cause = self.completion_error("wait_for_write", wc.status, None);
                let mut st = self.lock();
                if st.broken.is_none() {
                    st.broken_guessed = !known;
                }
                let e = st.broken.get_or_insert(cause).clone();
                self.broken_flag.store(true, Ordering::Release);
                for w in st.waiters.drain(..) {
                    let _ = w.send(Err(e.clone()));
                }
                st.abandoned = 0;
                return;
            }
            let _ = self.qp.post_recv(&[RecvWr { wr_id: wc.wr_id, sg_list: &[] }]);
            if wc.imm_data == Some(notes::WAKE_IMM) {
                // Counts nothing itself: the notification is in the page.
                self.reap_notes();
            } else {
                self.lock().deliver_notification(&self.banked);
            }
            return;
        }
        // The entry goes only now, with the WR's (virtual) completion: its
        // memory and slot were held until every fragment was done.
        let p = self.lock().pending.remove(wc.wr_id);
        let op = p.as_ref().map_or("operation", |p| p.op);
        let remote = p.as_ref().and_then(|p| p.remote);
        let tx = p.and_then(|mut p| p.tx.take());
        let res = match wc.status {
            WcStatus::Success => Ok(()),
            s => Err(self.completion_error(op, s, remote)),
        };
        let Err(e) = &res else {
            if let Some(tx) = tx {
                let _ = tx.send(res);
            }
            return;
        };
        let broken = match e {
            TransportError::RemoteAccess { peer, remote, .. } => {
                TransportError::Broken(format!("an earlier {op} with {peer} hit a remote access error at {remote}"))
            }
            other => other.clone(),
        };
        // Broken first, so that whoever the result wakes sees it; then this
        // operation's own error, the cause, before the rest fail with the
        // consequence: a request whose later pieces (or notification) were
        // woken first would report "broken" instead of what broke it.
        self.break_with_first(broken, move || {
            if let Some(tx) = tx {
                let _ = tx.send(res);
            }
        });
    }
}

/// The completion channel's fd, watched by the reactor. Holding the
/// `Inner` keeps the VirtualCq, which owns the fd, alive.
struct CqFd(Arc<Inner>);

impl AsRawFd for CqFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.cq.as_raw_fd()
    }
}

/// Polls completions and resolves futures; sleeps on the completion channel
/// when there is nothing to do. Ends when the transport is dropped.
async fn drive(inner: Arc<Inner>) {
    // SAFETY: the fd belongs to `inner.cq`, which the CqFd keeps alive (and
    // unchanged) for as long as the AsyncFd exists.
    let fd = match unsafe { AsyncFd::register_with_interest(CqFd(inner.clone()), tokio::io::Interest::READABLE) } {
        Ok(fd) => fd,
        Err(e) => {
            return inner.break_with(TransportError::Broken(format!("cannot watch the completion channel: {e}")));
        }
    };
    let mut wcs = [WorkCompletion::empty(); 64];
    loop {
        if let Some(d) = inner.spinner_recent() {
            tokio::select! {
                _ = tokio::time::sleep(d) => {}
                _ = inner.spin_quit.notified() => {}
                _ = inner.shutdown.notified() => return,
            }
            continue;
        }
        if inner.posting.load(Ordering::Acquire) > 0 {
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_micros(100)) => continue,
                _ = inner.shutdown.notified() => return,
            }
        }
        // Arm, then poll: a completion after the poll makes the fd readable.
        if let Err(e) = inner.cq.req_notify() {
            return inner.break_with(e.into());
        }
        let n = match inner.cq.poll(&mut wcs) {
            Ok(n) => n,
            Err(e) => return inner.break_with(e.into()),
        };
        for wc in &wcs[..n] {
            inner.dispatch(wc);
        }
        if n > 0 {
            continue;
        }
        let deadline = inner.cq.next_deadline();
        let sleep = async {
            match deadline {
                Some(d) => tokio::time::sleep_until(d.into()).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            r = fd.readable() => match r {
                Ok(mut g) => {
                    let _ = inner.cq.take_event();
                    g.clear_ready();
                }
                Err(e) => return inner.break_with(TransportError::Broken(format!("completion channel: {e}"))),
            },
            _ = sleep => {}
            _ = inner.shutdown.notified() => return,
        }
    }
}

/// A validated operation and the registration it names.
type Prepared<'m> = (Op, &'m crate::RdmaMemory);

/// A validated operation, waiting for its slot or being posted.
struct Op {
    name: &'static str,
    op: SendOp,
    /// `None` for zero bytes.
    sge: Option<Sge>,
    /// The registration `sge` names, with its owner (moved into the
    /// pending entry).
    mem: Option<Held>,
    /// Where `sge` starts in `mem`.
    local_off: usize,
}

/// The WR of a write to `remote`, notifying (a WRITE_WITH_IMM) or not.
fn write_op(remote: &RdmaRemoteBuffer, notify: bool) -> SendOp {
    if notify {
        SendOp::RdmaWriteWithImm { remote_addr: remote.addr, rkey: remote.key, imm: 0 }
    } else {
        SendOp::RdmaWrite { remote_addr: remote.addr, rkey: remote.key }
    }
}

/// The instant `t` from now (far away for a timeout past what the clock
/// counts: `Duration::MAX` is how some callers say "never").
fn far(t: Duration) -> tokio::time::Instant {
    tokio::time::Instant::from_std(ibverbx::deadline_after(t))
}

/// When a pending operation gives up waiting.
#[derive(Clone, Copy)]
enum Deadline {
    Never,
    /// This long from when it first has to wait (no clock read for an
    /// operation that completed while being posted).
    After(Duration),
    /// Allowed this long, ending then.
    At(Duration, tokio::time::Instant),
}

/// What [`Inner::try_direct`] did.
enum Direct {
    /// Nothing: the operation takes the QP.
    No,
    /// Copied (and counted in, when notifying): nothing to wait for.
    Done,
    /// Copied and counted in; the peer has a waiter asleep, to be woken
    /// through the QP.
    Wake,
}

/// How an operation left its call.
enum Start {
    /// Copied by the calling thread (same host): nothing to wait for.
    Done,
    Posted(ReplyRx),
    /// No slot was free: the future posts once it gets one.
    Waiting(Op),
}

/// A notification a wait took before its future was first polled: given
/// The longest a busy poll spins before it yields to the runtime once.
const SPIN_SLICE: Duration = Duration::from_millis(5);

/// back when the future is dropped unpolled.
struct Banked(Option<Arc<Inner>>);

impl Banked {
    /// The future was polled: the notification is its own.
    fn keep(mut self) {
        self.0 = None;
    }
}

impl Drop for Banked {
    fn drop(&mut self) {
        if let Some(inner) = self.0.take() {
            inner.lock().deliver_notification(&inner.banked);
        }
    }
}

/// A `wait_for_write` in progress. Dropped before it got its notification
/// (a timeout, a cancelled future) it closes its receiver, hands on a
/// notification that raced the drop, and counts itself abandoned so that
/// the waiter table is pruned.
struct Waiter {
    inner: Arc<Inner>,
    rx: Option<ReplyRx>,
}

impl Drop for Waiter {
    fn drop(&mut self) {
        let Some(mut rx) = self.rx.take() else { return };
        rx.close();
        let raced = matches!(rx.try_recv(), Ok(Ok(())));
        let mut st = self.inner.lock();
        if raced {
            st.deliver_notification(&self.inner.banked);
        } else {
            st.abandon_waiter();
        }
    }
}

/// A `wait_for_write` asleep (see `notes`): marked in this side's page
/// while it lives, the counter read once more after marking.
struct Parked(Arc<Inner>);

impl Parked {
    fn new(inner: Arc<Inner>) -> Parked {
        inner.notes.park(true);
        inner.reap_notes();
        Parked(inner)
    }
}

impl Drop for Parked {
    fn drop(&mut self) {
        self.0.notes.park(false);
    }
}

impl Drop for RdmaTransport {
    fn drop(&mut self) {
        let mut st = self.inner.lock();
        st.broken.get_or_insert(TransportError::Broken("the transport was dropped".into()));
        self.inner.broken_flag.store(true, Ordering::Release);
        st.dropped = true;
        // The entries (and the memory they hold) stay until `Inner` goes,
        // after its QP: a WR may still be running in the provider.
        st.pending.resolve_all(|op| TransportError::Aborted { op });
        for w in st.waiters.drain(..) {
            let _ = w.send(Err(TransportError::Aborted { op: "wait_for_write" }));
        }
        drop(st);
        self.inner.slots.close();
        // Same-host peers wake this side through the QP from now on, and
        // so learn that it is gone.
        self.inner.notes.poison();
        // Stop the QP and the driver.
        self.inner.qp.fail();
        self.inner.shutdown.notify_one();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reused_slot_ignores_the_completion_of_its_previous_user() {
        let mut p = PendingSet::default();
        let slots = Arc::new(Semaphore::new(2));
        let slot = || slots.clone().try_acquire_owned().unwrap();
        let (tx, _rx) = oneshot::channel();
        let old = p.insert("write", None, tx, None, slot());
        // The call timed out: its entry goes, the WR stays posted.
        assert!(p.remove(old).is_some());
        let (tx, _rx2) = oneshot::channel();
        let new = p.insert("read", None, tx, None, slot());
        assert_eq!(old & 0xffff_ffff, new & 0xffff_ffff, "the slot is reused");
        assert_ne!(old, new);
        // The old WR's late completion finds nothing; the new one its own.
        assert!(p.remove(old).is_none());
        assert_eq!(p.remove(new).map(|e| e.op), Some("read"));
        assert!(p.remove(new).is_none());
        assert_eq!(new & RECV_BIT, 0);
        // Each entry gave its slot back with it.
        assert_eq!(slots.available_permits(), 2);
    }
}
