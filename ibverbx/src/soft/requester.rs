//! The requester side of a soft QP: executes posted send WRs in order and
//! turns responses into completions.
//!
//! Plain writes, reads and atomics to a same-host peer's shared segment are
//! done here directly (the peer's CPU is not involved); everything else is a
//! request frame on the connection, answered by the peer's responder.
//! Completions leave in posting order whatever finished first.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use std::os::fd::{AsRawFd, OwnedFd};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use tokio::sync::{mpsc, Notify};

use super::config::SoftLink;
use super::mr::LocalSeg;
use super::peer::{Direct, Held, PeerMap};
use super::qp::{SoftQp, SqEntry};
use super::raw_io::{recv_exact, send_all, HasSock, SockRead, SockWrite};
use super::wire::{Frame, Hello, HelloStatus, Syndrome, HEADER_LEN, HELLO_LEN};
use crate::endpoint::SoftAddress;
use crate::qp_attr::{ack_timeout_duration, QpState, RtrAttr, RtsAttr};
use crate::wc::{WcOpcode, WcStatus, WorkCompletion};
use crate::wr::{AtomicOp, SendOp};
use crate::AccessFlags;

// Payloads move through the socket's descriptor (`raw_io`), headers
// through AsyncRead/AsyncWrite.
type Reader = Box<dyn SockRead>;
type Writer = Box<dyn SockWrite>;

/// What an in-flight stream request waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    Ack,
    Read(u32),
    Atomic,
}

#[derive(Debug)]
struct Inflight {
    wr_id: u64,
    opcode: WcOpcode,
    signaled: bool,
    byte_len: u32,
    status: Option<WcStatus>,
    /// Set while a response is awaited.
    awaiting: Option<(u32, Expect)>,
    /// A staged request that changes or reads target memory (not a bare
    /// notify): later direct placements must wait until it has executed.
    touches_memory: bool,
    segs: Vec<LocalSeg>,
    sent_at: Instant,
    rnr_waits: u32,
    /// A doorbell WR not yet claimed or retracted: (record sequence, imm).
    db: Option<(u64, u32)>,
}

impl Inflight {
    /// A WR just taken on: nothing sent, nothing awaited yet.
    fn new(wr_id: u64, opcode: WcOpcode, signaled: bool, byte_len: u32) -> Inflight {
        Inflight {
            wr_id,
            opcode,
            signaled,
            byte_len,
            status: None,
            awaiting: None,
            segs: Vec::new(),
            sent_at: Instant::now(),
            rnr_waits: 0,
            touches_memory: false,
            db: None,
        }
    }
}

#[derive(Debug, Default)]
struct SqState {
    inflight: VecDeque<Inflight>,
    /// Set once the connection is gone: later WRs fail with this status.
    broken: Option<WcStatus>,
}

pub(crate) struct Shared {
    qp: Arc<SoftQp>,
    q: Mutex<SqState>,
    progress: Notify,
    last_rx_ms: AtomicU64,
    epoch: Instant,
    /// Held while a frame is being written: the requester task and the
    /// posting thread (fast notifies) take turns on the connection.
    wire_busy: AtomicBool,
    /// Next request PSN; taken with `wire_busy` held, so PSN order is wire
    /// order.
    next_psn: AtomicU32,
    /// The peer QP's doorbell, once the same-host link is up and both ends
    /// can ring each other.
    db: std::sync::OnceLock<TxDoorbell>,
    /// Asks the requester task to retract a pending doorbell record and
    /// send it on the connection.
    db_settle: Notify,
    /// Wakes the idle doorbell watcher.
    db_wake: Notify,
    db_watch_idle: AtomicBool,
    /// Doorbell records posted (activity, for the watcher).
    db_posts: AtomicU64,
}

/// The requesting side of a peer QP's doorbell.
pub(crate) struct TxDoorbell {
    slot: super::doorbell::SlotRef,
    /// The peer's receive CQ event fd (duplicated).
    rx_waker: Arc<OwnedFd>,
    /// The peer QP's life this doorbell was opened in (its records carry it).
    gen: u32,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, SqState> {
        self.q.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Pops finished WRs from the head and emits their completions.
    fn emit(&self, q: &mut SqState) {
        while q.inflight.front().is_some_and(|f| f.status.is_some()) {
            let f = q.inflight.pop_front().expect("front exists");
            let status = f.status.expect("checked");
            // Free the slot before the completion is visible: a poster that
            // sees the completion may post again at once.
            self.qp.sq_outstanding.fetch_sub(1, Ordering::AcqRel);
            if status != WcStatus::Success || f.signaled {
                self.qp.push_send_wc(WorkCompletion {
                    wr_id: f.wr_id,
                    status,
                    opcode: f.opcode,
                    byte_len: if status == WcStatus::Success { f.byte_len } else { 0 },
                    imm_data: None,
                    qp_num: self.qp.qpn,
                    vendor_err: 0,
                });
            }
        }
    }

    /// Marks the first awaited request as failed with `status`, breaks the
    /// link and moves the QP to ERR.
    fn fail_link(&self, status: WcStatus, why: &str) {
        let mut q = self.lock();
        if q.broken.is_none() {
            tracing::warn!(qpn = self.qp.qpn, "soft QP connection failed: {why}");
        }
        q.broken.get_or_insert(WcStatus::RetryExcErr);
        self.qp.set_fast(None);
        // The oldest unanswered request gets the status: a WR on the wire,
        // or a doorbell record the peer never claimed (one it claimed
        // completes normally, and the next in line gets the status).
        for f in q.inflight.iter_mut().filter(|f| f.status.is_none() && (f.awaiting.is_some() || f.db.is_some())) {
            if let Some((k, _)) = f.db.take() {
                self.qp.db_tx_pending.fetch_sub(1, Ordering::AcqRel);
                if self.db.get().is_some_and(|db| db.retract(k) == Err(true)) {
                    f.status = Some(WcStatus::Success);
                    continue;
                }
            }
            f.status = Some(status);
            f.awaiting = None;
            break;
        }
        drop(q);
        self.qp.set_error(why);
        self.progress.notify_waiters();
    }

    /// Flushes everything not yet finished (QP in ERR). A doorbell record
    /// the peer already claimed completes normally.
    fn flush(&self) {
        let mut q = self.lock();
        for f in q.inflight.iter_mut().filter(|f| f.status.is_none()) {
            f.status = Some(WcStatus::WrFlushErr);
            f.awaiting = None;
            if let Some((k, _)) = f.db.take() {
                self.qp.db_tx_pending.fetch_sub(1, Ordering::AcqRel);
                if self.db.get().is_some_and(|db| db.retract(k) == Err(true)) {
                    f.status = Some(WcStatus::Success);
                }
            }
        }
        self.emit(&mut q);
    }

    /// Completes doorbell WRs whose record the peer has claimed.
    fn check_db(&self) {
        if self.qp.db_tx_pending.load(Ordering::Acquire) == 0 {
            return;
        }
        let Some(db) = self.db.get() else { return };
        let slot = db.slot.get();
        let mut q = self.lock();
        let mut done = false;
        for f in q.inflight.iter_mut().filter(|f| f.status.is_none()) {
            if let Some((k, _)) = f.db {
                if super::doorbell_proto::claimed(slot, k) {
                    f.db = None;
                    f.status = Some(WcStatus::Success);
                    self.qp.db_tx_pending.fetch_sub(1, Ordering::AcqRel);
                    done = true;
                }
            }
        }
        if done {
            self.emit(&mut q);
        }
    }

    fn touch(&self) {
        self.last_rx_ms.store(self.epoch.elapsed().as_millis() as u64, Ordering::Relaxed);
    }
}

/// How long the posting thread waits for room to finish a frame it began
/// writing before it gives the connection up.
const PARTIAL_FRAME_LIMIT: Duration = Duration::from_secs(30);

struct Link {
    writer: Writer,
    peer: Option<Arc<PeerMap>>,
    /// The peer QP and its token (segment requests on the attach socket
    /// present them).
    peer_qpn: u32,
    token: [u8; 16],
}

/// The requester task of one QP; ends when the QP is reset or destroyed.
pub(crate) async fn run(qp: Arc<SoftQp>, mut rx: mpsc::UnboundedReceiver<SqEntry>, rtr: RtrAttr, rts: RtsAttr) {
    let remote = rtr.remote.soft.clone().expect("checked at RTR");
    let ack_timeout = ack_timeout_duration(rts.timeout).map(|d| d * (rts.retry_cnt as u32 + 1));
    let sh = Arc::new(Shared {
        qp: qp.clone(),
        q: Mutex::new(SqState::default()),
        progress: Notify::new(),
        last_rx_ms: AtomicU64::new(0),
        epoch: Instant::now(),
        wire_busy: AtomicBool::new(false),
        next_psn: AtomicU32::new(rts.sq_psn & 0x00ff_ffff),
        db: std::sync::OnceLock::new(),
        db_settle: Notify::new(),
        db_wake: Notify::new(),
        db_watch_idle: AtomicBool::new(false),
        db_posts: AtomicU64::new(0),
    });
    let mut state_rx = qp.state_tx.subscribe();
    let mut link = match connect(&qp, &remote, rtr.remote.qpn, &rts, ack_timeout).await {
        Ok((r, w, peer, dup)) => {
            if let Some(p) = &peer {
                if qp.ctx.config.doorbell && qp.ctx.config.chaos_seed.is_none() && dup.is_some() {
                    match TxDoorbell::open(&qp, p, &remote, rtr.remote.qpn).await {
                        Ok(db) => {
                            let _ = sh.db.set(db);
                            tokio::spawn(db_watch(Arc::downgrade(&sh)));
                        }
                        Err(e) => tracing::debug!(qpn = qp.qpn, "soft doorbell not used: {e}"),
                    }
                }
            }
            // The posting thread may write small requests itself (and, on
            // the same host, copy directly).
            let notify = dup.map(|fd| Arc::new(FastNotify { sh: sh.clone(), fd }));
            if peer.is_some() || notify.is_some() {
                qp.set_fast(Some(super::qp::FastPath { peer: peer.clone(), remote_pd: remote.pd, notify }));
            }
            let reader = tokio::spawn(read_responses(sh.clone(), r, rts.rnr_retry));
            if let Some(t) = ack_timeout {
                tokio::spawn(watchdog(sh.clone(), t, reader));
            }
            Some(Link { writer: w, peer, peer_qpn: rtr.remote.qpn, token: remote.token })
        }
        Err(why) => {
            tracing::warn!(qpn = qp.qpn, "soft QP cannot reach its peer QP {:#x}: {why}", rtr.remote.qpn);
            sh.lock().broken = Some(WcStatus::RetryExcErr);
            None
        }
    };
    let mut chaos = qp.ctx.config.chaos_seed.map(|seed| {
        static NTH: AtomicU64 = AtomicU64::new(0);
        rand::rngs::StdRng::seed_from_u64(
            seed ^ NTH.fetch_add(1, Ordering::Relaxed).wrapping_mul(0x9e37_79b9_7f4a_7c15),
        )
    });
    loop {
        let state = *state_rx.borrow_and_update();
        match state {
            QpState::Reset => return abandon_db(&sh),
            QpState::Err => sh.flush(),
            _ => {}
        }
        tokio::select! {
            biased;
            r = state_rx.changed() => {
                if r.is_err() {
                    return;
                }
            }
            _ = sh.db_settle.notified() => settle_db(&sh, &mut link).await,
            e = rx.recv() => {
                let Some(e) = e else { return };
                if let Some(rng) = chaos.as_mut() {
                    let max = qp.ctx.config.chaos_max_delay.as_micros() as u64;
                    let d = rng.gen_range(0..=max);
                    if d > 0 {
                        tokio::time::sleep(Duration::from_micros(d)).await;
                    }
                }
                qp.ctx.touch();
                execute(&sh, &mut link, e).await;
            }
        }
    }
}

/// Opens the connection: unix socket + direct placement on the same host,
/// TCP otherwise; retries until the ACK timeout budget runs out.
async fn connect(
    qp: &SoftQp,
    remote: &SoftAddress,
    remote_qpn: u32,
    rts: &RtsAttr,
    ack_timeout: Option<Duration>,
) -> Result<(Reader, Writer, Option<Arc<PeerMap>>, Option<OwnedFd>), String> {
    let same_host = remote.host == qp.ctx.host;
    let use_shm = match qp.ctx.config.link {
        SoftLink::Auto => same_host,
        SoftLink::Shm if !same_host => return Err("RMACOMM_SOFT_LINK=shm but the peer is on another host".into()),
        SoftLink::Shm => true,
        SoftLink::Tcp => false,
    };
    let hello = Hello { src_qpn: qp.qpn, dst_qpn: remote_qpn, token: remote.token, rnr_retry: rts.rnr_retry.min(7) };
    let deadline = Instant::now() + ack_timeout.unwrap_or(Duration::from_secs(30)).max(Duration::from_secs(2));
    let mut last_err = String::new();
    while Instant::now() < deadline {
        let attempt = async {
            if use_shm {
                let addr = <std::os::unix::net::SocketAddr as std::os::linux::net::SocketAddrExt>::from_abstract_name(
                    remote.unix.as_bytes(),
                )
                .map_err(|e| e.to_string())?;
                let s =
                    std::os::unix::net::UnixStream::connect_addr(&addr).map_err(|e| format!("unix connect: {e}"))?;
                // Who really serves that socket: the direct path trusts the
                // kernel's word, never the endpoint's pid.
                let cred = rustix::net::sockopt::socket_peercred(&s).map_err(|e| format!("SO_PEERCRED: {e}"))?;
                let same_user = cred.uid == rustix::process::geteuid();
                let served_by = same_user.then(|| cred.pid.as_raw_nonzero().get() as u32);
                s.set_nonblocking(true).map_err(|e| e.to_string())?;
                // A second descriptor of the same socket, for notifies sent
                // by the posting thread (it stays valid whatever the task
                // does with its own).
                let dup = s.try_clone().ok().map(OwnedFd::from);
                let s = tokio::net::UnixStream::from_std(s).map_err(|e| e.to_string())?;
                let (r, w) = s.into_split();
                Ok::<(Reader, Writer, Option<OwnedFd>, Option<u32>), String>((Box::new(r), Box::new(w), dup, served_by))
            } else {
                let mut err = String::from("no TCP address");
                for a in &remote.tcp {
                    match tokio::time::timeout(Duration::from_secs(2), tokio::net::TcpStream::connect(a)).await {
                        Ok(Ok(s)) => {
                            let _ = s.set_nodelay(true);
                            // A second descriptor for the posting thread's
                            // small requests (as for the unix socket).
                            let (s, dup) = match s.into_std() {
                                Ok(std_s) => {
                                    let dup = std_s.try_clone().ok().map(OwnedFd::from);
                                    match tokio::net::TcpStream::from_std(std_s) {
                                        Ok(s) => (s, dup),
                                        Err(e) => {
                                            err = format!("tcp connect {a}: {e}");
                                            continue;
                                        }
                                    }
                                }
                                Err(e) => {
                                    err = format!("tcp connect {a}: {e}");
                                    continue;
                                }
                            };
                            let (r, w) = s.into_split();
                            return Ok((Box::new(r) as Reader, Box::new(w) as Writer, dup, None));
                        }
                        Ok(Err(e)) => err = format!("tcp connect {a}: {e}"),
                        Err(_) => err = format!("tcp connect {a}: timed out"),
                    }
                }
                Err(err)
            }
        };
        match attempt.await {
            Ok((mut r, mut w, dup, served_by)) => {
                w.write_all(&hello.encode()).await.map_err(|e| format!("hello: {e}"))?;
                let mut buf = [0u8; HELLO_LEN];
                tokio::time::timeout(Duration::from_secs(10), r.read_exact(&mut buf))
                    .await
                    .map_err(|_| "no reply to hello within 10 s".to_string())?
                    .map_err(|e| format!("hello reply: {e}"))?;
                match HelloStatus::decode(&buf).map_err(|e| e.to_string())? {
                    HelloStatus::Ok => {}
                    HelloStatus::BadToken => {
                        return Err("peer refused the connection: unknown QP or wrong token".into());
                    }
                    HelloStatus::BadState => {
                        // The peer QP is in ERR; it may be reset and reused.
                        last_err = "peer QP is in the error state".into();
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        continue;
                    }
                }
                let peer = match served_by {
                    Some(pid) => match qp.ctx.peer(remote, remote_qpn, pid).await {
                        Ok(p) => Some(p),
                        Err(e) => {
                            tracing::info!("same-host peer's tables cannot be mapped ({e}); staging every transfer");
                            None
                        }
                    },
                    None if use_shm => {
                        tracing::info!("same-host peer runs as another user; staging every transfer");
                        None
                    }
                    None => None,
                };
                return Ok((r, w, peer, dup));
            }
            Err(e) => {
                last_err = e;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
    Err(last_err)
}

/// Finds where a same-host access goes: a mapped segment (mapped first if
/// it is not yet), the peer's other memory, or the connection. A direct
/// path is returned only once every earlier staged request is answered,
/// and the key is checked again after that wait: the region may have been
/// revoked meanwhile, and nothing is copied into a revoked region.
#[allow(clippy::too_many_arguments)]
async fn place(
    sh: &Shared,
    peer: Option<&PeerMap>,
    (peer_qpn, token): (u32, [u8; 16]),
    pd: u32,
    rkey: u32,
    raddr: u64,
    len: u64,
    need: AccessFlags,
) -> Result<Direct, WcStatus> {
    let Some(p) = peer else { return Ok(Direct::Staged) };
    if len == 0 {
        // Zero bytes: nothing to place and, as in verbs, no key check.
        return Ok(Direct::Vm(raddr, Held::default()));
    }
    let mut d = p.resolve(pd, rkey, raddr, len, need)?;
    if let Direct::Unmapped(uid) = d {
        if p.map_segment(uid, peer_qpn, token).await {
            sh.qp.ctx.segs_mapped.fetch_add(1, Ordering::Relaxed);
        }
        d = p.resolve(pd, rkey, raddr, len, need)?;
    }
    if matches!(d, Direct::Staged | Direct::Unmapped(_)) {
        return Ok(Direct::Staged);
    }
    drop(d);
    if !memory_ordered(sh).await {
        return Err(WcStatus::WrFlushErr);
    }
    match p.resolve(pd, rkey, raddr, len, need)? {
        Direct::Unmapped(_) => Ok(Direct::Staged),
        d => Ok(d),
    }
}

fn local_ptrs(sh: &Shared, e: &SqEntry) -> Result<Vec<(usize, usize)>, WcStatus> {
    if let Some(d) = &e.inline {
        return Ok(vec![(d.as_ptr() as usize, d.len())]);
    }
    let need = e.op.local_access();
    e.segs.iter().map(|s| s.ptr(sh.qp.pd, need).map(|p| (p as usize, s.len as usize))).collect()
}

/// Copies the local pieces to `dst` (gather); `stream`: past the cache.
fn gather_to(dst: usize, local: &[(usize, usize)], stream: bool) {
    let mut off = 0;
    for &(p, l) in local {
        // SAFETY: p..p+l lies in a live, checked local registration (or the
        // inline copy); dst..dst+total was checked against the peer's MR and
        // lies in a live mapping.
        unsafe { super::copy::copy((dst + off) as *mut u8, p as *const u8, l, stream) };
        off += l;
    }
}

/// Copies from `src` into the local pieces (scatter).
fn scatter_from(src: usize, local: &[(usize, usize)], stream: bool) {
    let mut off = 0;
    for &(p, l) in local {
        // SAFETY: as in gather_to, directions swapped.
        unsafe { super::copy::copy(p as *mut u8, (src + off) as *const u8, l, stream) };
        off += l;
    }
}

/// Waits until no earlier staged request that touches target memory is
/// still unanswered, so that a direct placement cannot overtake it: the
/// responder executes requests in order, and so must the two paths together.
/// Returns false when the QP failed meanwhile (the WR is then flushed, not
/// placed).
async fn memory_ordered(sh: &Shared) -> bool {
    loop {
        let progressed = sh.progress.notified();
        tokio::pin!(progressed);
        progressed.as_mut().enable();
        {
            let q = sh.lock();
            let pending = q.inflight.iter().any(|f| f.awaiting.is_some() && f.touches_memory);
            if q.broken.is_some() || *sh.qp.state_tx.borrow() == QpState::Err {
                return false;
            }
            if !pending {
                return true;
            }
        }
        progressed.await;
    }
}

/// Completes a WR that needs no response. An error waits until every
/// earlier request has been answered: as a NAK acknowledges everything
/// before it on hardware, earlier WRs still complete normally.
async fn finish(sh: &Arc<Shared>, mut inf: Inflight, status: WcStatus) {
    if status != WcStatus::Success && status != WcStatus::WrFlushErr {
        loop {
            let progressed = sh.progress.notified();
            tokio::pin!(progressed);
            progressed.as_mut().enable();
            {
                let q = sh.lock();
                let earlier_pending = q.inflight.iter().any(|f| f.awaiting.is_some());
                if !earlier_pending || q.broken.is_some() || *sh.qp.state_tx.borrow() == QpState::Err {
                    break;
                }
            }
            progressed.await;
        }
    }
    // The QP is in ERR before the error completion can be seen.
    if status != WcStatus::Success {
        sh.qp.set_error(&format!("send WR failed: {status}"));
    }
    inf.status = Some(status);
    let mut q = sh.lock();
    q.inflight.push_back(inf);
    sh.emit(&mut q);
    drop(q);
    if status != WcStatus::Success {
        sh.flush();
    }
}

async fn execute(sh: &Arc<Shared>, link: &mut Option<Link>, e: SqEntry) {
    // A doorbell record still pending goes first: claimed, or retracted and
    // put on the wire ahead of this WR.
    settle_db(sh, link).await;
    let mut inf = Inflight::new(e.wr_id, e.op.wc_opcode(), e.signaled, e.len as u32);
    if sh.qp.state_tx.borrow().eq(&QpState::Err) {
        return finish(sh, inf, WcStatus::WrFlushErr).await;
    }
    let local = match local_ptrs(sh, &e) {
        Ok(l) => l,
        Err(st) => return finish(sh, inf, st).await,
    };
    let broken = sh.lock().broken;
    let Some(l) = link.as_mut().filter(|_| broken.is_none()) else {
        return finish(sh, inf, broken.unwrap_or(WcStatus::RetryExcErr)).await;
    };
    if e.fence {
        loop {
            let notified = sh.progress.notified();
            let pending =
                sh.lock().inflight.iter().any(|f| matches!(f.awaiting, Some((_, Expect::Read(_) | Expect::Atomic))));
            if !pending {
                break;
            }
            notified.await;
        }
    }
    let len = e.len;
    let pd = remote_pd(&sh.qp);
    // Direct placement where the peer's memory is mapped here (after every
    // earlier staged request, and checked again after that wait).
    let (peer, at) = (l.peer.clone(), (l.peer_qpn, l.token));
    let direct = |rkey: u32, raddr: u64, need: AccessFlags| place(sh, peer.as_deref(), at, pd, rkey, raddr, len, need);
    let frame = match e.op {
        SendOp::RdmaWrite { remote_addr, rkey } | SendOp::RdmaWriteWithImm { remote_addr, rkey, .. } => {
            let imm = match e.op {
                SendOp::RdmaWriteWithImm { imm, .. } => Some(imm),
                _ => None,
            };
            let placed = match direct(rkey, remote_addr, AccessFlags::REMOTE_WRITE).await {
                Err(st) => return finish(sh, inf, st).await,
                Ok(Direct::Ptr(p, _keep)) => {
                    gather_to(p, &local, sh.qp.stream.observe(remote_addr, len));
                    true
                }
                Ok(Direct::Vm(a, _held)) => {
                    let r = l.peer.as_ref().expect("vm implies a peer").vm_copy(true, &local, a, len as usize);
                    match r {
                        Ok(done) => done,
                        Err(st) => return finish(sh, inf, st).await,
                    }
                }
                Ok(Direct::Staged | Direct::Unmapped(_)) => false,
            };
            match (placed, imm) {
                (true, None) => return finish(sh, inf, WcStatus::Success).await,
                (true, Some(imm)) => Frame::Notify { psn: 0, len: len as u32, imm },
                (false, imm) => Frame::Write { psn: 0, raddr: remote_addr, rkey, len: len as u32, imm },
            }
        }
        SendOp::Send => Frame::Send { psn: 0, len: len as u32, imm: None },
        SendOp::SendWithImm { imm } => Frame::Send { psn: 0, len: len as u32, imm: Some(imm) },
        SendOp::RdmaRead { remote_addr, rkey } => match direct(rkey, remote_addr, AccessFlags::REMOTE_READ).await {
            Err(st) => return finish(sh, inf, st).await,
            Ok(Direct::Ptr(p, _keep)) => {
                scatter_from(p, &local, sh.qp.stream.observe(remote_addr, len));
                return finish(sh, inf, WcStatus::Success).await;
            }
            Ok(Direct::Vm(a, _held)) => {
                match l.peer.as_ref().expect("vm implies a peer").vm_copy(false, &local, a, len as usize) {
                    Ok(true) => return finish(sh, inf, WcStatus::Success).await,
                    Ok(false) => Frame::ReadReq { psn: 0, raddr: remote_addr, rkey, len: len as u32 },
                    Err(st) => return finish(sh, inf, st).await,
                }
            }
            Ok(Direct::Staged | Direct::Unmapped(_)) => {
                Frame::ReadReq { psn: 0, raddr: remote_addr, rkey, len: len as u32 }
            }
        },
        SendOp::Atomic { remote_addr, rkey, op } => {
            let (cmp_swap, a, b) = match op {
                AtomicOp::FetchAdd { add } => (false, add, 0),
                AtomicOp::CompareSwap { compare, swap } => (true, compare, swap),
            };
            match direct(rkey, remote_addr, AccessFlags::REMOTE_ATOMIC).await {
                Err(st) => return finish(sh, inf, st).await,
                Ok(Direct::Ptr(p, _keep)) => {
                    // SAFETY: p is 8-byte aligned (checked at post) and inside
                    // the peer's mapped MR; other processes use atomics on it too.
                    let cell = unsafe { &*(p as *const std::sync::atomic::AtomicU64) };
                    let orig = if cmp_swap {
                        match cell.compare_exchange(a, b, Ordering::AcqRel, Ordering::Acquire) {
                            Ok(v) | Err(v) => v,
                        }
                    } else {
                        cell.fetch_add(a, Ordering::AcqRel)
                    };
                    write_u64(local[0].0, orig);
                    return finish(sh, inf, WcStatus::Success).await;
                }
                Ok(_) => Frame::Atomic { psn: 0, raddr: remote_addr, rkey, cmp_swap, a, b },
            }
        }
    };
    // Stream request: PSN, queue entry and bytes on the wire in one turn.
    while sh.wire_busy.compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed).is_err() {
        tokio::task::yield_now().await;
    }
    // A doorbell record published since the check at the top (by another
    // posting thread) goes before this frame.
    settle_db_held(sh, link).await;
    if sh.lock().broken.is_some() {
        sh.wire_busy.store(false, Ordering::Release);
        return finish(sh, inf, WcStatus::WrFlushErr).await;
    }
    let Some(l) = link.as_mut() else {
        sh.wire_busy.store(false, Ordering::Release);
        return finish(sh, inf, WcStatus::RetryExcErr).await;
    };
    let psn = sh.next_psn.load(Ordering::Relaxed);
    sh.next_psn.store((psn + 1) & 0x00ff_ffff, Ordering::Relaxed);
    let frame = with_psn(frame, psn);
    let expect = match frame {
        Frame::ReadReq { len, .. } => Expect::Read(len),
        Frame::Atomic { .. } => Expect::Atomic,
        _ => Expect::Ack,
    };
    inf.awaiting = Some((psn, expect));
    inf.touches_memory = !matches!(frame, Frame::Notify { .. });
    inf.segs = e.segs;
    inf.sent_at = Instant::now();
    {
        let mut q = sh.lock();
        q.inflight.push_back(inf);
    }
    let payload: &[(usize, usize)] = if frame.payload_len() > 0 { &local } else { &[] };
    let sent = send_frame(&mut l.writer, &frame, payload).await;
    sh.wire_busy.store(false, Ordering::Release);
    if let Err(err) = sent {
        sh.fail_link(WcStatus::RetryExcErr, &format!("write to peer: {err}"));
        sh.flush();
    }
}

/// Requests sent by the posting thread itself on an idle QP (same host:
/// WRITE_WITH_IMM notifies after a direct copy, doorbell records; TCP:
/// small WRITEs; both: small SENDs): one thread hand-off less per message.
/// The progress engine still reads the acknowledgement.
pub(crate) struct FastNotify {
    sh: Arc<Shared>,
    fd: OwnedFd,
}

impl std::fmt::Debug for FastNotify {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FastNotify").field("fd", &self.fd).finish()
    }
}

/// What a fast notify should report when its ACK comes back.
pub(crate) struct FastWr<'a> {
    pub(crate) wr_id: u64,
    pub(crate) opcode: WcOpcode,
    pub(crate) signaled: bool,
    pub(crate) byte_len: u32,
    /// A `Notify` or a `Send` frame (its PSN is filled in here).
    pub(crate) frame: Frame,
    /// SEND payload pieces (at most 4 KiB in all).
    pub(crate) payload: &'a [(usize, usize)],
}

impl FastNotify {
    /// Sends the frame if the connection is free and the socket takes it at
    /// once; returns false (nothing sent, nothing queued) otherwise. The
    /// caller holds the QP's only outstanding-WR slot.
    pub(crate) fn try_send(&self, wr: FastWr<'_>) -> bool {
        let sh = &self.sh;
        if sh.wire_busy.compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed).is_err() {
            return false;
        }
        if sh.lock().broken.is_some() {
            sh.wire_busy.store(false, Ordering::Release);
            return false;
        }
        let psn = sh.next_psn.load(Ordering::Relaxed);
        let frame = with_psn(wr.frame, psn);
        let mut buf = Vec::with_capacity(HEADER_LEN + frame.payload_len());
        buf.extend_from_slice(&frame.encode());
        // SAFETY: each piece is a checked live local region, read before
        // this call returns.
        unsafe { extend_raw(&mut buf, wr.payload) };
        // Queued before the bytes leave, so that the ACK finds it.
        sh.lock().inflight.push_back(Inflight {
            awaiting: Some((psn, Expect::Ack)),
            touches_memory: !matches!(frame, Frame::Notify { .. }),
            ..Inflight::new(wr.wr_id, wr.opcode, wr.signaled, wr.byte_len)
        });
        let fd = self.fd.as_raw_fd();
        // SAFETY: fd is our own descriptor of the connected socket; buf is
        // a live buffer of buf.len() bytes.
        let n = unsafe { libc::send(fd, buf.as_ptr().cast(), buf.len(), libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) };
        if n <= 0 {
            // Nothing left: undo, and let the engine send it.
            sh.lock().inflight.pop_back();
            sh.wire_busy.store(false, Ordering::Release);
            return false;
        }
        sh.next_psn.store((psn + 1) & 0x00ff_ffff, Ordering::Relaxed);
        let mut done = n as usize;
        // A partial write: the frame must be finished before anyone else
        // writes; wait for room (briefly: a socket drains fast). A peer
        // that stops reading for PARTIAL_FRAME_LIMIT is treated as dead,
        // as an unacknowledged request would be: the loop always ends.
        let give_up = Instant::now() + PARTIAL_FRAME_LIMIT;
        while done < buf.len() {
            if Instant::now() > give_up {
                sh.wire_busy.store(false, Ordering::Release);
                sh.fail_link(WcStatus::RetryExcErr, "the peer stopped reading in the middle of a frame");
                sh.flush();
                return true;
            }
            let mut pfd = libc::pollfd { fd, events: libc::POLLOUT, revents: 0 };
            // SAFETY: pfd is a valid pollfd array of length 1.
            unsafe { libc::poll(&mut pfd, 1, 1000) };
            // SAFETY: as for the first send, on the unsent rest of buf.
            let n = unsafe {
                libc::send(fd, buf[done..].as_ptr().cast(), buf.len() - done, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL)
            };
            if n > 0 {
                done += n as usize;
            } else if std::io::Error::last_os_error().kind() != std::io::ErrorKind::WouldBlock {
                sh.wire_busy.store(false, Ordering::Release);
                sh.fail_link(WcStatus::RetryExcErr, "write to peer failed in the middle of a frame");
                sh.flush();
                return true;
            }
        }
        sh.wire_busy.store(false, Ordering::Release);
        true
    }
}

impl FastNotify {
    /// Whether the next WR may go through the peer's doorbell: one is set
    /// up, the peer QP is open with a receive posted, nothing of ours is
    /// pending there, and the peer can ring us.
    pub(crate) fn doorbell_ready(&self) -> bool {
        let Some(db) = self.sh.db.get() else { return false };
        let s = db.slot.get();
        s.open.load(Ordering::Acquire) == 1
            && s.gen.load(Ordering::Acquire) == db.gen
            && s.rq_len.load(Ordering::Acquire) > 0
            && s.no_tx_wake.load(Ordering::Relaxed) == 0
            && super::doorbell::is_free(s.state.load(Ordering::Acquire))
            && self.sh.qp.db_tx_pending.load(Ordering::Acquire) == 0
    }

    /// Publishes a WRITE_WITH_IMM's notification (its data is placed
    /// already) in the peer's doorbell; rings the peer if it sleeps. The
    /// caller holds the QP's only outstanding-WR slot.
    pub(crate) fn post_doorbell(&self, wr_id: u64, opcode: WcOpcode, signaled: bool, len: u32, imm: u32) -> bool {
        let sh = &self.sh;
        let Some(db) = sh.db.get() else { return false };
        let slot = db.slot.get();
        // The wire's turn: an engine WR posted concurrently either settles
        // this record before its own frame, or is queued ahead of it.
        if sh.wire_busy.compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed).is_err() {
            return false;
        }
        use super::doorbell_proto::{publish, ring_rx, Published};
        let done = |r: bool| {
            sh.wire_busy.store(false, Ordering::Release);
            r
        };
        // Queued before the record is visible, so that a claim finds it.
        let enqueue = |k: u64| {
            let mut q = sh.lock();
            if q.broken.is_some() {
                return false;
            }
            q.inflight.push_back(Inflight { db: Some((k, imm)), ..Inflight::new(wr_id, opcode, signaled, len) });
            sh.qp.db_tx_pending.fetch_add(1, Ordering::AcqRel);
            true
        };
        let dequeue = |k: u64| {
            let mut q = sh.lock();
            if q.inflight.back().is_some_and(|f| f.db.is_some_and(|d| d.0 == k)) {
                q.inflight.pop_back();
                sh.qp.db_tx_pending.fetch_sub(1, Ordering::AcqRel);
            }
        };
        // A record voided because the peer QP closed meanwhile is left to
        // the watcher, which fails the WR.
        match publish(slot, imm, len, db.gen, enqueue, dequeue) {
            Published::No => return done(false),
            Published::Posted(_) | Published::Voided(_) => {}
        }
        done(true);
        if ring_rx(slot) {
            super::doorbell::ring(&db.rx_waker);
            sh.qp.ctx.db_rings.fetch_add(1, Ordering::Relaxed);
        }
        sh.db_posts.fetch_add(1, Ordering::SeqCst);
        std::sync::atomic::fence(Ordering::SeqCst);
        if sh.db_watch_idle.load(Ordering::SeqCst) && sh.db_watch_idle.swap(false, Ordering::AcqRel) {
            sh.db_wake.notify_one();
        }
        true
    }

    /// Completes doorbell WRs the peer has claimed.
    pub(crate) fn check_doorbell(&self) {
        self.sh.check_db();
    }

    /// Our send CQ is being armed: the peer rings it when it claims (the
    /// caller polls once more after arming).
    pub(crate) fn arm_doorbell(&self) {
        if let Some(db) = self.sh.db.get() {
            super::doorbell_proto::arm_tx(db.slot.get());
        }
    }
}

impl TxDoorbell {
    /// Maps the peer QP's slot, obtains its receive CQ's event fd and gives
    /// it ours (both over the attach socket). Fails (and the QP notifies
    /// through the connection only) when the peer has no slot or will not
    /// exchange event fds.
    async fn open(qp: &SoftQp, peer: &PeerMap, remote: &SoftAddress, remote_qpn: u32) -> Result<TxDoorbell, String> {
        let slot = peer.doorbell(remote).map_err(|e| e.to_string())?;
        let s = slot.get();
        let rx_cq = s.rx_cq.load(Ordering::Acquire);
        let rx_waker = match qp.ctx.wakers.lookup(peer.pid(), rx_cq) {
            Some(w) => w,
            None => {
                let fd = peer
                    .recv_cq_waker(remote_qpn, remote.token)
                    .await
                    .map_err(|e| format!("cannot reach the peer's CQ: {e}"))?;
                qp.ctx.wakers.insert(peer.pid(), rx_cq, fd)
            }
        };
        let (efd, cq) = qp.send_cq_fd();
        peer.give_send_cq_waker(remote_qpn, remote.token, cq, efd)
            .await
            .map_err(|e| format!("the peer did not take our CQ's event fd: {e}"))?;
        s.tx_cq.store(cq, Ordering::Release);
        s.tx_armed.store(0, Ordering::Release);
        s.no_tx_wake.store(0, Ordering::Release);
        let gen = s.gen.load(Ordering::Acquire);
        Ok(TxDoorbell { slot, rx_waker, gen })
    }

    /// Takes record `k` back if the peer has not claimed it: `Ok` when
    /// retracted, `Err(true)` when it was claimed, `Err(false)` otherwise.
    fn retract(&self, k: u64) -> Result<(), bool> {
        super::doorbell_proto::retract(self.slot.get(), k)
    }
}

/// Resolves a pending doorbell WR from the requester task: completed if
/// the peer claimed it, else retracted and sent as a notify on the
/// connection (so that it stays ahead of everything sent after it).
async fn settle_db(sh: &Arc<Shared>, link: &mut Option<Link>) {
    if sh.qp.db_tx_pending.load(Ordering::Acquire) == 0 {
        return;
    }
    while sh.wire_busy.compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed).is_err() {
        tokio::task::yield_now().await;
    }
    settle_db_held(sh, link).await;
    sh.wire_busy.store(false, Ordering::Release);
}

/// [`settle_db`] with `wire_busy` held by the caller (so that no record can
/// be published between this and the caller's own frame).
async fn settle_db_held(sh: &Arc<Shared>, link: &mut Option<Link>) {
    if sh.qp.db_tx_pending.load(Ordering::Acquire) == 0 {
        return;
    }
    sh.check_db();
    let Some(db) = sh.db.get() else { return };
    loop {
        let pending = sh.lock().inflight.iter().find_map(|f| f.db.filter(|_| f.status.is_none()));
        let Some((k, imm)) = pending else { return };
        match db.retract(k) {
            Ok(()) => {}
            Err(true) => {
                sh.check_db();
                continue;
            }
            Err(false) => {
                // Voided by the peer: its QP left service (or was reset)
                // before claiming it. As a request to a vanished QP on
                // hardware: RETRY_EXC_ERR, the QP goes to ERR.
                sh.fail_link(WcStatus::RetryExcErr, "the peer QP left service before claiming a doorbell record");
                sh.flush();
                return;
            }
        }
        sh.qp.ctx.db_retracted.fetch_add(1, Ordering::Relaxed);
        let psn = sh.next_psn.load(Ordering::Relaxed);
        let len = {
            let mut q = sh.lock();
            // A connection failure may have resolved it meanwhile.
            let Some(f) = q.inflight.iter_mut().find(|f| f.db.is_some_and(|d| d.0 == k)) else { continue };
            f.db = None;
            f.awaiting = Some((psn, Expect::Ack));
            f.sent_at = Instant::now();
            sh.qp.db_tx_pending.fetch_sub(1, Ordering::AcqRel);
            f.byte_len
        };
        sh.next_psn.store((psn + 1) & 0x00ff_ffff, Ordering::Relaxed);
        let frame = Frame::Notify { psn, len, imm };
        let sent = match link.as_mut() {
            Some(l) => send_frame(&mut l.writer, &frame, &[]).await,
            None => Err(std::io::Error::new(std::io::ErrorKind::NotConnected, "no connection")),
        };
        if let Err(err) = sent {
            sh.fail_link(WcStatus::RetryExcErr, &format!("write to peer: {err}"));
            sh.flush();
            return;
        }
    }
}

/// The requester is reset: its doorbell records are dropped with every
/// other outstanding WR (verbs' RESET), and taken back from the slot.
fn abandon_db(sh: &Shared) {
    let Some(db) = sh.db.get() else { return };
    let mut q = sh.lock();
    for f in q.inflight.iter_mut() {
        if let Some((k, _)) = f.db.take() {
            let _ = db.retract(k);
            sh.qp.db_tx_pending.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// Watches a connection's doorbell: a record the peer leaves unclaimed for
/// [`STALE`](super::doorbell::STALE), or one whose QP closed, is handed to
/// the requester task to go through the connection. Sleeps while the
/// doorbell is unused.
async fn db_watch(sh: std::sync::Weak<Shared>) {
    use super::doorbell::STALE;
    let mut idle_ticks = 0u32;
    let mut last_posts = 0u64;
    loop {
        tokio::time::sleep(STALE).await;
        let Some(s) = sh.upgrade() else { return };
        if matches!(*s.qp.state_tx.borrow(), QpState::Reset) {
            return;
        }
        let posts = s.db_posts.load(Ordering::Relaxed);
        if posts != last_posts {
            last_posts = posts;
            idle_ticks = 0;
        } else {
            idle_ticks += 1;
        }
        if s.qp.db_tx_pending.load(Ordering::Acquire) > 0 {
            s.check_db();
            let closed = s.db.get().is_some_and(|db| db.slot.get().open.load(Ordering::Acquire) == 0);
            let old = s.lock().inflight.iter().any(|f| f.db.is_some() && f.sent_at.elapsed() >= STALE);
            if closed || old {
                s.db_settle.notify_one();
            }
            continue;
        }
        if idle_ticks < 50 {
            continue;
        }
        // Unused for 50 ticks: sleep until the next record (a post after
        // the flag is set wakes us) or the QP leaves service.
        idle_ticks = 0;
        let mut state_rx = s.qp.state_tx.subscribe();
        let notified = s.db_wake.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        s.db_watch_idle.store(true, Ordering::SeqCst);
        std::sync::atomic::fence(Ordering::SeqCst);
        if s.db_posts.load(Ordering::SeqCst) != last_posts {
            s.db_watch_idle.store(false, Ordering::Release);
            continue;
        }
        tokio::select! {
            _ = notified => {}
            _ = state_rx.changed() => {}
        }
        s.db_watch_idle.store(false, Ordering::Release);
    }
}

fn remote_pd(qp: &SoftQp) -> u32 {
    qp.remote_pd()
}

fn write_u64(p: usize, v: u64) {
    // SAFETY: p is a checked 8-byte local SGE of an atomic WR.
    unsafe { std::ptr::write_unaligned(p as *mut u64, v) };
}

fn with_psn(f: Frame, psn: u32) -> Frame {
    match f {
        Frame::Write { raddr, rkey, len, imm, .. } => Frame::Write { psn, raddr, rkey, len, imm },
        Frame::Send { len, imm, .. } => Frame::Send { psn, len, imm },
        Frame::ReadReq { raddr, rkey, len, .. } => Frame::ReadReq { psn, raddr, rkey, len },
        Frame::Atomic { raddr, rkey, cmp_swap, a, b, .. } => Frame::Atomic { psn, raddr, rkey, cmp_swap, a, b },
        Frame::Notify { len, imm, .. } => Frame::Notify { psn, len, imm },
        other => other,
    }
}

/// Appends the raw pieces `(addr, len)` to `buf`, copied through raw
/// pointers: registered memory may be written by peers meanwhile, so it is
/// never borrowed as a slice.
///
/// # Safety
/// Every piece must be valid for reads.
unsafe fn extend_raw(buf: &mut Vec<u8>, pieces: &[(usize, usize)]) {
    for &(p, l) in pieces {
        buf.reserve(l);
        let at = buf.len();
        // SAFETY: the source is valid for reads (the caller's contract) and
        // the destination has room for l more bytes (reserved above).
        unsafe {
            std::ptr::copy_nonoverlapping(p as *const u8, buf.as_mut_ptr().add(at), l);
            buf.set_len(at + l);
        }
    }
}

/// Writes a header and its payload, straight from registered memory.
/// Small frames are staged and go out in one write.
pub(crate) async fn send_frame<W: HasSock + ?Sized>(
    w: &mut W,
    f: &Frame,
    payload: &[(usize, usize)],
) -> std::io::Result<()> {
    let hdr = f.encode();
    let total: usize = payload.iter().map(|p| p.1).sum();
    if total <= 4096 {
        let mut buf = Vec::with_capacity(HEADER_LEN + total);
        buf.extend_from_slice(&hdr);
        // SAFETY: each piece is a checked, live registration (or inline copy).
        unsafe { extend_raw(&mut buf, payload) };
        // SAFETY: no raw pieces.
        return unsafe { send_all(w, &buf, &[]).await };
    }
    // SAFETY: as above; the WR (or the responder's MR handle) keeps the
    // regions alive until this returns.
    unsafe { send_all(w, &hdr, payload).await }
}

/// Reads responses, completes the WRs they answer.
async fn read_responses(sh: Arc<Shared>, mut r: Reader, rnr_retry: u8) {
    let max_msg = sh.qp.ctx.config.max_msg_size;
    loop {
        let mut hdr = [0u8; HEADER_LEN];
        if let Err(e) = r.read_exact(&mut hdr).await {
            let awaiting = sh.lock().inflight.iter().any(|f| f.awaiting.is_some());
            let why = if e.kind() == std::io::ErrorKind::UnexpectedEof {
                "the peer closed the connection".to_string()
            } else {
                format!("read from peer: {e}")
            };
            if awaiting || !matches!(*sh.qp.state_tx.borrow(), QpState::Err | QpState::Reset) {
                sh.fail_link(WcStatus::RetryExcErr, &why);
            }
            return;
        }
        sh.touch();
        sh.qp.ctx.touch();
        let f = match Frame::decode(&hdr, max_msg) {
            Ok(f) if !f.is_request() => f,
            Ok(f) => {
                return sh.fail_link(WcStatus::BadRespErr, &format!("peer sent a request frame {f:?} as a response"))
            }
            Err(e) => return sh.fail_link(WcStatus::BadRespErr, &format!("malformed response: {e}")),
        };
        // Decide under the lock; read payloads without it.
        let (psn, expect, segs) = {
            let q = sh.lock();
            let Some(x) = q.inflight.iter().find(|x| x.awaiting.is_some() && x.status.is_none()) else {
                drop(q);
                return sh.fail_link(WcStatus::BadRespErr, &format!("unsolicited response {f:?}"));
            };
            let (psn, expect) = x.awaiting.expect("checked");
            let segs = if matches!(f, Frame::ReadResp { .. } | Frame::AtomicResp { .. }) {
                x.segs.clone()
            } else {
                Vec::new()
            };
            (psn, expect, segs)
        };
        if f.psn() != psn {
            return sh
                .fail_link(WcStatus::BadRespErr, &format!("response for PSN {} while {psn} is outstanding", f.psn()));
        }
        let status = match (f, expect) {
            (Frame::Ack { .. }, Expect::Ack) => WcStatus::Success,
            (Frame::ReadResp { len, .. }, Expect::Read(want)) if len == want => {
                // The segments were checked at post (LOCAL_WRITE) and are
                // kept alive by `segs`.
                for s in &segs {
                    if s.len == 0 {
                        continue;
                    }
                    let p = match s.ptr(sh.qp.pd, AccessFlags::LOCAL_WRITE) {
                        Ok(p) => p as usize,
                        Err(st) => return sh.fail_link(st, "read destination became invalid"),
                    };
                    // SAFETY: p..p+len is a live, checked local registration.
                    if let Err(e) = unsafe { recv_exact(&mut *r, p, s.len as usize).await } {
                        return sh.fail_link(WcStatus::RetryExcErr, &format!("read response: {e}"));
                    }
                }
                WcStatus::Success
            }
            (Frame::AtomicResp { orig, .. }, Expect::Atomic) => {
                match segs.first().map(|s| s.ptr(sh.qp.pd, AccessFlags::LOCAL_WRITE)) {
                    Some(Ok(p)) => {
                        write_u64(p as usize, orig);
                        WcStatus::Success
                    }
                    _ => WcStatus::LocProtErr,
                }
            }
            (Frame::Nak { syndrome, .. }, _) => match syndrome {
                Syndrome::RemoteAccess => WcStatus::RemAccessErr,
                Syndrome::InvalidRequest => WcStatus::RemInvReqErr,
                Syndrome::RemoteOp => WcStatus::RemOpErr,
            },
            (Frame::RnrWait { .. }, _) => {
                let mut q = sh.lock();
                let Some(f) = q.inflight.iter_mut().find(|x| x.awaiting.is_some_and(|a| a.0 == psn)) else {
                    continue;
                };
                f.rnr_waits += 1;
                f.sent_at = Instant::now();
                if rnr_retry == 7 || f.rnr_waits <= rnr_retry as u32 {
                    continue;
                }
                WcStatus::RnrRetryExcErr
            }
            (other, _) => {
                return sh.fail_link(WcStatus::BadRespErr, &format!("response {other:?} does not match the request"));
            }
        };
        if status != WcStatus::Success {
            sh.qp.set_error(&format!("peer answered {status}"));
        }
        let mut q = sh.lock();
        if let Some(f) = q.inflight.iter_mut().find(|x| x.awaiting.is_some_and(|a| a.0 == psn)) {
            f.status = Some(status);
            f.awaiting = None;
        }
        sh.emit(&mut q);
        drop(q);
        sh.progress.notify_waiters();
        if status != WcStatus::Success {
            sh.lock().broken.get_or_insert(status);
            sh.flush();
            return;
        }
    }
}

/// Fails the oldest awaited request when the peer stays silent for the ACK
/// timeout (a stopped or unreachable peer).
async fn watchdog(sh: Arc<Shared>, timeout: Duration, reader: tokio::task::JoinHandle<()>) {
    let tick = (timeout / 4).max(Duration::from_millis(5));
    loop {
        tokio::time::sleep(tick).await;
        if reader.is_finished() || matches!(*sh.qp.state_tx.borrow(), QpState::Reset | QpState::Err) {
            reader.abort();
            return;
        }
        let last_rx = Duration::from_millis(sh.last_rx_ms.load(Ordering::Relaxed));
        let silent = sh.epoch.elapsed().saturating_sub(last_rx);
        let oldest = sh.lock().inflight.iter().filter(|f| f.awaiting.is_some()).map(|f| f.sent_at.elapsed()).max();
        if let Some(age) = oldest {
            if age >= timeout && silent >= timeout {
                reader.abort();
                sh.fail_link(
                    WcStatus::RetryExcErr,
                    &format!("no response from the peer for {} ms", timeout.as_millis()),
                );
                sh.flush();
                return;
            }
        }
    }
}
