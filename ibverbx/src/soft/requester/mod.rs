//! The requester side of a soft QP: executes posted send WRs in order and
//! turns responses into completions.
//!
//! Plain writes, reads and atomics to a same-host peer's shared segment are
//! done here directly (the peer's CPU is not involved); everything else is a
//! request frame on the connection, answered by the peer's responder.
//! Completions leave in posting order whatever finished first.
//!
//! # Organization
//! - this file: the state the requester's tasks and the posting thread
//!   share (`Shared`) and the requester task (`run`)
//! - `connect`: opening the connection (hello exchange, same-host peer)
//! - `inflight`: the in-flight WRs and how they finish (emit, flush, fail)
//! - `execute`: one WR on the engine (direct placement or a request frame)
//! - `device_batch`: device-to-device copies of consecutive WRs, one wait
//! - `responses`: the response reader; `watchdog`: the ACK timeout
//! - `fast_notify`: requests written by the posting thread itself
//! - `doorbell_tx`: the requesting side of the peer QP's doorbell

mod connect;
mod device_batch;
mod doorbell_tx;
mod execute;
mod fast_notify;
mod inflight;
mod responses;
mod watchdog;

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use tokio::sync::{mpsc, Notify};

use super::peer::PeerMap;
use super::qp::{SoftQp, SqEntry};
use super::raw_io::{SockRead, SockWrite};
use super::wire::Frame;
use crate::qp_attr::{ack_timeout_duration, QpState, RtrAttr, RtsAttr};
use crate::wc::WcStatus;
use connect::connect;
use doorbell_tx::{abandon_db, db_watch, settle_db, TxDoorbell};
use execute::execute;
use inflight::SqState;
use responses::read_responses;
use watchdog::watchdog;

pub(crate) use fast_notify::{FastNotify, FastWr};

// Payloads move through the socket's descriptor (`raw_io`), headers
// through AsyncRead/AsyncWrite.
type Reader = Box<dyn SockRead>;
type Writer = Box<dyn SockWrite>;

/// What the requester task, its response reader and watchdog, the doorbell
/// watcher and the posting thread ([`FastNotify`]) share.
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
    /// The connection's socket (another descriptor of it): shut down when
    /// the link fails, so that a frame being written to a peer that stopped
    /// reading fails too, instead of holding the requester task forever.
    sock: std::sync::OnceLock<std::os::fd::OwnedFd>,
    /// The QP's life (reset epoch) this requester serves: once the QP is
    /// reset, its tasks (the response reader and watchdog may outlive the
    /// requester's) leave the QP alone — it may be connected again already.
    life: u64,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, SqState> {
        self.q.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether the QP was reset since this requester began (its life is
    /// over).
    fn stale(&self) -> bool {
        self.qp.epoch() != self.life
    }

    fn touch(&self) {
        self.last_rx_ms.store(self.epoch.elapsed().as_millis() as u64, Ordering::Relaxed);
    }
}

struct Link {
    writer: Writer,
    peer: Option<Arc<PeerMap>>,
    /// The peer QP and its token (segment requests on the attach socket
    /// present them).
    peer_qpn: u32,
    token: [u8; 16],
    /// The peer QP's protection domain, from this life's RTR: its keys are
    /// checked in it (never read from the QP again, whose RTR may be a
    /// later life's by then).
    remote_pd: u32,
}

/// The requester task of one QP in its life `life` (reset epoch); ends
/// when the QP is reset or destroyed.
pub(crate) async fn run(
    qp: Arc<SoftQp>,
    mut rx: mpsc::UnboundedReceiver<SqEntry>,
    backlog: Arc<AtomicU32>,
    (rtr, rts): (RtrAttr, RtsAttr),
    life: u64,
) {
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
        sock: std::sync::OnceLock::new(),
        life,
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
            if let Some(fd) = dup.as_ref().and_then(|d| d.try_clone().ok()) {
                let _ = sh.sock.set(fd);
            }
            let notify = dup.map(|fd| Arc::new(FastNotify { sh: sh.clone(), fd }));
            let fast = (peer.is_some() || notify.is_some()).then(|| super::qp::FastPath {
                peer: peer.clone(),
                remote_pd: remote.pd,
                notify,
            });
            let target = peer.clone().map(|peer| {
                Arc::new(crate::soft::remote::MapTarget {
                    peer,
                    remote_pd: remote.pd,
                    peer_qpn: rtr.remote.qpn,
                    token: remote.token,
                })
            });
            // Connecting may take long (retries): a QP reset meanwhile is
            // another life's, which this link must not serve.
            if !qp.publish_link(life, fast, target) {
                return;
            }
            let reader = tokio::spawn(read_responses(sh.clone(), r, rts.rnr_retry));
            if let Some(t) = ack_timeout {
                tokio::spawn(watchdog(sh.clone(), t, reader));
            }
            Some(Link { writer: w, peer, peer_qpn: rtr.remote.qpn, token: remote.token, remote_pd: remote.pd })
        }
        Err(why) => {
            tracing::warn!(qpn = qp.qpn, "soft QP cannot reach its peer QP {:#x}: {why}", rtr.remote.qpn);
            sh.lock().broken = Some(WcStatus::RetryExcErr);
            if !qp.publish_link(life, None, None) {
                return;
            }
            None
        }
    };
    let mut batch = device_batch::DeviceBatch::new(sh.clone(), backlog.clone());
    let mut chaos = qp.ctx.config.chaos_seed.map(|seed| {
        static NTH: AtomicU64 = AtomicU64::new(0);
        rand::rngs::StdRng::seed_from_u64(
            seed ^ NTH.fetch_add(1, Ordering::Relaxed).wrapping_mul(0x9e37_79b9_7f4a_7c15),
        )
    });
    loop {
        if sh.stale() {
            // Reset, and perhaps in its next life already (the Reset state
            // itself unseen): this life's WRs are dropped.
            return abandon_db(&sh);
        }
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
                // On the wire (or finished): the posting thread may write
                // the next request once nothing else waits here. A WR that
                // joined the batch of device copies leaves the backlog when
                // the batch ends: it takes the WRs already posted behind
                // it, then waits for the device, before anything else.
                if !execute(&sh, &mut link, e, &mut batch).await {
                    backlog.fetch_sub(1, Ordering::AcqRel);
                }
                while batch.open() {
                    let Ok(e) = rx.try_recv() else { break };
                    if !execute(&sh, &mut link, e, &mut batch).await {
                        backlog.fetch_sub(1, Ordering::AcqRel);
                    }
                }
                batch.drain(&mut link).await;
            }
        }
    }
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
