//! The soft RC queue pair: its state, creation, connection admission,
//! moving to ERR and flushing.
//!
//! # Organization
//! - this file: [`SoftQp`] and the state every path shares
//! - `ops`: the verbs it answers (endpoint, modify, post_send/post_recv)
//! - `fast_path`: WRs run or sent by the posting thread itself
//! - `doorbell_rx`: the receiving side of this QP's doorbell

mod doorbell_rx;
mod fast_path;
mod ops;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::{mpsc, watch, Notify};

use super::context::{CtxShared, SoftPd};
use super::cq::SoftCq;
use super::mr::LocalSeg;
use crate::provider::{CqOps, QpOps};
use crate::qp_attr::{QpCaps, QpState, RtrAttr};
use crate::wc::{WcOpcode, WcStatus, WorkCompletion};
use crate::wr::SendOp;
use crate::{AccessFlags, Error, QpInitAttr, Result};
use doorbell_rx::RxDoorbell;

pub(crate) use fast_path::FastPath;

/// A send WR as the engine sees it: local buffers resolved (and so kept
/// alive), inline data copied.
#[derive(Debug)]
pub(crate) struct SqEntry {
    pub(crate) wr_id: u64,
    pub(crate) op: SendOp,
    pub(crate) segs: Vec<LocalSeg>,
    pub(crate) inline: Option<Vec<u8>>,
    pub(crate) signaled: bool,
    pub(crate) fence: bool,
    pub(crate) len: u64,
}

/// What the responder holds of the receive queue. No doorbell record is
/// claimed while `taken` is not zero ([`db_claim_in_order`](SoftQp::db_claim_in_order)):
/// its completion would overtake those of receives taken before it. The
/// held completions are made visible when their ACK is written
/// ([`rx_release`](SoftQp::rx_release)), or, on the QP's error, before the
/// queue's flush completions ([`flush_rq_in`](SoftQp::flush_rq_in)).
#[derive(Default)]
pub(crate) struct RxPending {
    /// Taken off the queue and not yet completed (held or not) or given
    /// back.
    taken: u32,
    /// Completions of received requests, in the order their receives were
    /// taken, waiting for their ACK.
    held: Vec<WorkCompletion>,
}

/// A posted receive.
#[derive(Debug)]
pub(crate) struct RecvEntry {
    pub(crate) wr_id: u64,
    pub(crate) segs: Vec<LocalSeg>,
}

impl RecvEntry {
    pub(crate) fn capacity(&self) -> u64 {
        self.segs.iter().map(|s| s.len as u64).sum()
    }
}

#[derive(Debug)]
struct QpSt {
    state: QpState,
    access: AccessFlags,
    rtr: Option<RtrAttr>,
    sq_tx: Option<mpsc::UnboundedSender<SqEntry>>,
    /// WRs handed to this life's requester task and not yet executed by it
    /// (shared with the task): while it is 0 every posted WR is on the wire
    /// or finished, so the posting thread may write the next frame itself.
    sq_backlog: Arc<AtomicU32>,
    /// The connection admitted in this life of the QP: (epoch, remote QP).
    accepted: Option<(u64, u32)>,
}

/// Why a connection to a QP was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// The QP is in ERR (it may be reset and reused: the peer retries).
    ErrState,
    /// Another remote QP than the one set at RTR.
    WrongPeer,
    /// This life of the QP already has its connection.
    AlreadyConnected,
}

pub(crate) struct SoftQp {
    pub(crate) qpn: u32,
    token: [u8; 16],
    pub(crate) pd: u32,
    pub(crate) ctx: Arc<CtxShared>,
    caps: QpCaps,
    sq_sig_all: bool,
    send_cq: Arc<dyn CqOps>,
    recv_cq: Arc<dyn CqOps>,
    st: Mutex<QpSt>,
    pub(crate) state_tx: watch::Sender<QpState>,
    pub(crate) rq: Mutex<VecDeque<RecvEntry>>,
    pub(crate) rq_notify: Notify,
    pub(crate) sq_outstanding: AtomicU32,
    /// The receives the responder has taken and not completed yet, and the
    /// completions it holds until the ACK covering them is written
    /// (`responder::Acks`): see [`RxPending`].
    rx: Mutex<RxPending>,
    /// Incremented by every transition to RESET: connections accepted in an
    /// earlier epoch belong to a previous life of the QP and are closed.
    epoch: std::sync::atomic::AtomicU64,
    /// Set by the requester while a same-host link with a mapped peer is up.
    fast: std::sync::RwLock<Option<Arc<FastPath>>>,
    /// This QP's doorbell: notifications to it through shared memory.
    db: Option<RxDoorbell>,
    /// Set by the requester once its connection is up: `Some(Some(_))` to
    /// a same-host peer whose tables are mapped, `Some(None)` to any other;
    /// `None` before (and after a reset). `map_remote` waits on it.
    pub(crate) map_target: watch::Sender<Option<Option<Arc<super::remote::MapTarget>>>>,
    /// Doorbell WRs this QP posted that are not finished yet (shared with
    /// the send CQ's registration).
    pub(crate) db_tx_pending: Arc<AtomicU32>,
    /// Long runs of direct copies stream past the cache (`copy.rs`).
    pub(crate) stream: super::copy::StreamDetector,
}

impl std::fmt::Debug for SoftQp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SoftQp").field("qpn", &format_args!("{:#x}", self.qpn)).field("state", &self.state()).finish()
    }
}

fn soft_cq(cq: &Arc<dyn CqOps>) -> &SoftCq {
    cq.as_any().downcast_ref::<SoftCq>().expect("checked at QP creation")
}

impl SoftQp {
    pub(crate) fn create(
        pd: &SoftPd,
        attr: &QpInitAttr,
        send_cq: &Arc<dyn CqOps>,
        recv_cq: &Arc<dyn CqOps>,
    ) -> Result<Arc<SoftQp>> {
        for cq in [send_cq, recv_cq] {
            match cq.as_any().downcast_ref::<SoftCq>() {
                Some(c) if c.ctx_uid == pd.ctx.uid => {}
                _ => return Err(Error::invalid("create_qp", "the CQs must come from the same soft context as the PD")),
            }
        }
        let c = attr.caps;
        if c.max_send_wr == 0 || c.max_send_wr > 1 << 16 || c.max_recv_wr > 1 << 16 {
            return Err(Error::invalid("create_qp", "max_send_wr must be 1..=65536 and max_recv_wr at most 65536"));
        }
        if c.max_send_sge > 16 || c.max_recv_sge > 16 || c.max_inline_data > 4096 {
            return Err(Error::invalid("create_qp", "at most 16 SGEs and 4096 inline bytes per WR"));
        }
        let qpn = pd.ctx.alloc_qpn();
        let (state_tx, _) = watch::channel(QpState::Reset);
        let db = pd.ctx.doorbells.as_ref().and_then(|t| t.alloc()).map(|(index, slot)| {
            slot.get().rx_cq.store(soft_cq(recv_cq).uid, Ordering::Release);
            RxDoorbell { index, slot, tx_wake: Mutex::new(None) }
        });
        let qp = Arc::new(SoftQp {
            qpn,
            token: rand::random(),
            pd: pd.id,
            ctx: pd.ctx.clone(),
            caps: c,
            sq_sig_all: attr.sq_sig_all,
            send_cq: send_cq.clone(),
            recv_cq: recv_cq.clone(),
            st: Mutex::new(QpSt {
                state: QpState::Reset,
                access: AccessFlags::empty(),
                rtr: None,
                sq_tx: None,
                sq_backlog: Arc::default(),
                accepted: None,
            }),
            state_tx,
            map_target: watch::channel(None).0,
            rq: Mutex::new(VecDeque::new()),
            rq_notify: Notify::new(),
            sq_outstanding: AtomicU32::new(0),
            rx: Mutex::new(RxPending::default()),
            epoch: std::sync::atomic::AtomicU64::new(0),
            fast: std::sync::RwLock::new(None),
            db,
            db_tx_pending: Arc::new(AtomicU32::new(0)),
            stream: Default::default(),
        });
        pd.ctx.qps.lock().unwrap_or_else(|e| e.into_inner()).insert(qpn, Arc::downgrade(&qp));
        if pd.ctx.doorbells.is_some() {
            use super::cq::DbReg;
            let (rx, tx) = (qp.db.as_ref().map(|d| d.slot.clone()), Some(qp.db_tx_pending.clone()));
            if Arc::ptr_eq(send_cq, recv_cq) {
                soft_cq(recv_cq).db_register(DbReg { qp: Arc::downgrade(&qp), rx, tx });
            } else {
                soft_cq(recv_cq).db_register(DbReg { qp: Arc::downgrade(&qp), rx, tx: None });
                soft_cq(send_cq).db_register(DbReg { qp: Arc::downgrade(&qp), rx: None, tx });
            }
        }
        Ok(qp)
    }

    pub(crate) fn token_matches(&self, t: &[u8; 16]) -> bool {
        // Constant-time compare: the token is the only thing that admits a
        // connection.
        self.token.iter().zip(t).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
    }

    /// Admits the connection of remote QP `src_qpn` (its token already
    /// checked). A QP takes connections in every state but ERR (its peer may
    /// reach RTS before this QP leaves RESET; requests then wait for RTR),
    /// but only one per life (reset epoch), and only from the remote QP set
    /// at RTR once that is set: a token holder cannot pile up connections.
    pub(crate) fn admit(&self, src_qpn: u32) -> Result<u64, Refusal> {
        let mut st = self.lock();
        if st.state == QpState::Err {
            return Err(Refusal::ErrState);
        }
        if st.rtr.as_ref().is_some_and(|r| r.remote.qpn != src_qpn) {
            return Err(Refusal::WrongPeer);
        }
        let epoch = self.epoch();
        if st.accepted.is_some_and(|(e, _)| e == epoch) {
            return Err(Refusal::AlreadyConnected);
        }
        st.accepted = Some((epoch, src_qpn));
        Ok(epoch)
    }

    /// The remote QP set at RTR, once it is.
    pub(crate) fn rtr_remote_qpn(&self) -> Option<u32> {
        self.lock().rtr.as_ref().map(|r| r.remote.qpn)
    }

    /// The send CQ's event fd and unique id (the peer rings it after
    /// claiming).
    pub(crate) fn send_cq_fd(&self) -> (std::os::fd::BorrowedFd<'_>, u64) {
        let cq = soft_cq(&self.send_cq);
        (cq.event_fd(), cq.uid)
    }

    /// The receive CQ's event fd (a same-host requester rings it after
    /// publishing a doorbell record).
    pub(crate) fn recv_cq_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        soft_cq(&self.recv_cq).event_fd()
    }

    pub(crate) fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }

    pub(crate) fn remote_access(&self) -> AccessFlags {
        self.lock().access
    }

    /// The RNR NAK period this QP (as a responder) reports at.
    pub(crate) fn rnr_period(&self) -> std::time::Duration {
        let code = self.lock().rtr.as_ref().map_or(12, |r| r.min_rnr_timer);
        crate::qp_attr::rnr_timer_duration(code).max(std::time::Duration::from_micros(100))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, QpSt> {
        self.st.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Lets busy-pollers of the send CQ (`send`: ACKs) or the receive CQ
    /// (requests) receive on one of this QP's connections.
    pub(crate) fn rx_register(&self, send: bool, rx: std::sync::Weak<dyn super::polled_rx::PolledRx>) {
        soft_cq(if send { &self.send_cq } else { &self.recv_cq }).rx_register(rx);
    }

    pub(crate) fn push_send_wc(&self, wc: WorkCompletion) {
        soft_cq(&self.send_cq).push(wc);
    }

    pub(crate) fn push_recv_wc(&self, wc: WorkCompletion) {
        soft_cq(&self.recv_cq).push(wc);
    }

    pub(crate) fn flush_wc(&self, wr_id: u64, opcode: WcOpcode) -> WorkCompletion {
        WorkCompletion {
            wr_id,
            status: WcStatus::WrFlushErr,
            opcode,
            byte_len: 0,
            imm_data: None,
            qp_num: self.qpn,
            vendor_err: 0,
        }
    }

    /// Moves the QP to ERR (from any engine task): flushes the receive queue
    /// and tells the requester to flush the send queue.
    pub(crate) fn set_error(&self, why: &str) {
        self.set_error_if(None, why);
    }

    /// Gives back `n` send-queue slots (never below zero: a reset may have
    /// freed them all meanwhile).
    pub(crate) fn sq_release(&self, n: u32) {
        let _ = self.sq_outstanding.fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| Some(v.saturating_sub(n)));
    }

    /// [`set_error`](Self::set_error) from a task of the QP's life `life`
    /// (reset epoch): nothing if the QP was reset since (a link of an
    /// earlier life ending is no news to the QP, which may be connected
    /// again already).
    pub(crate) fn set_error_in(&self, life: u64, why: &str) {
        self.set_error_if(Some(life), why);
    }

    fn set_error_if(&self, life: Option<u64>, why: &str) {
        let mut st = self.lock();
        // The epoch moves under this lock (modify's reset): no reset (and
        // no next life) comes between this decision and the state it
        // publishes.
        let epoch = self.epoch();
        if matches!(st.state, QpState::Err | QpState::Reset) || life.is_some_and(|l| l != epoch) {
            return;
        }
        tracing::debug!(qpn = self.qpn, "soft QP enters the error state: {why}");
        st.state = QpState::Err;
        self.db_open(false);
        self.set_fast(None);
        self.state_tx.send_replace(QpState::Err);
        drop(st);
        self.flush_rq_in(Some(epoch));
    }

    /// Publishes a requester's link of life `life` (its fast path and
    /// mapping target), unless the QP was reset since: false then.
    pub(crate) fn publish_link(
        &self,
        life: u64,
        fast: Option<FastPath>,
        target: Option<Arc<crate::soft::remote::MapTarget>>,
    ) -> bool {
        let _st = self.lock();
        if self.epoch() != life {
            return false;
        }
        if fast.is_some() {
            self.set_fast(fast);
        }
        self.map_target.send_replace(Some(target));
        true
    }

    fn flush_rq(&self) {
        self.flush_rq_in(None);
    }

    fn rx(&self) -> std::sync::MutexGuard<'_, RxPending> {
        self.rx.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Pops the next receive for the responder (the caller holds the RQ
    /// lock, as `rq`), counted as taken until it is completed
    /// ([`rx_hold`](Self::rx_hold), [`rx_failed`](Self::rx_failed)) or
    /// given back ([`give_back_recv`](Self::give_back_recv)).
    pub(crate) fn rx_take(&self, rq: &mut VecDeque<RecvEntry>) -> Option<RecvEntry> {
        let r = rq.pop_front()?;
        self.rx().taken += 1;
        self.db_note_rq(rq.len());
        Some(r)
    }

    /// Holds the completion of a taken receive until its ACK is written.
    pub(crate) fn rx_hold(&self, wc: WorkCompletion) {
        self.rx().held.push(wc);
    }

    /// Completes a taken receive with an error at once.
    pub(crate) fn rx_failed(&self, wc: WorkCompletion) {
        let mut rx = self.rx();
        self.push_recv_wc(wc);
        rx.taken -= 1;
    }

    /// Makes the held completions visible (their ACK is written, or the
    /// connection ended), then claims the doorbell record that polls left
    /// behind them, if no receive is still being filled.
    pub(crate) fn rx_release(&self) {
        if self.push_held(&mut self.rx()) {
            self.db_claim_in_order();
        }
    }

    /// Pushes the held completions (their receives leave `taken`); false
    /// when there were none.
    fn push_held(&self, rx: &mut RxPending) -> bool {
        if rx.held.is_empty() {
            return false;
        }
        rx.taken -= rx.held.len() as u32;
        for wc in rx.held.drain(..) {
            self.push_recv_wc(wc);
        }
        true
    }

    /// Whether the responder holds receives (taken, not yet completed).
    pub(crate) fn rx_busy(&self) -> bool {
        self.rx().taken > 0
    }

    /// Gives back receive `r`, taken in life `life` for a message whose
    /// connection failed before it arrived whole: the next message of this
    /// life takes it again (as an HCA keeps the WQE for the requester's
    /// retry), a later error flushes it, and a reset since has discarded it.
    /// Only the order of flush completions may differ from posting order:
    /// when the error came while the message was arriving (a stalled
    /// requester), this receive is flushed after the ones behind it, once
    /// its responder has stopped writing into it.
    pub(crate) fn give_back_recv(&self, life: u64, r: RecvEntry) {
        // Under the RQ lock, as flush_rq_in: an error published before it
        // flushed (or will flush, after this) the rest of the queue.
        {
            let mut rq = self.rq.lock().unwrap_or_else(|e| e.into_inner());
            let mut rx = self.rx();
            rx.taken -= 1;
            if self.epoch() != life {
                // Discarded by the reset.
            } else if *self.state_tx.borrow() == QpState::Err {
                self.push_recv_wc(self.flush_wc(r.wr_id, WcOpcode::Recv));
            } else {
                drop(rx);
                rq.push_front(r);
                self.db_note_rq(rq.len());
                drop(rq);
                self.rq_notify.notify_waiters();
            }
        }
        // A record that polls left while this receive was taken (of this
        // life or the next).
        self.db_claim_in_order();
    }

    /// Flushes the receive queue — only the receives of life `life` when
    /// given (a reset since cleared those, and the next life's are not
    /// this error's).
    fn flush_rq_in(&self, life: Option<u64>) {
        // Pushed under the RQ lock: a poster flushing its late receive (QP
        // already in ERR) cannot slip its completion between these.
        let mut rq = self.rq.lock().unwrap_or_else(|e| e.into_inner());
        if life.is_some_and(|l| l != self.epoch()) {
            return;
        }
        // The completions held for their ACK first: their receives were
        // taken before any still queued (the ACK will not come now).
        self.push_held(&mut self.rx());
        self.db_note_rq(0);
        for r in rq.drain(..) {
            self.push_recv_wc(self.flush_wc(r.wr_id, WcOpcode::Recv));
        }
        drop(rq);
        self.rq_notify.notify_waiters();
    }
}

impl Drop for SoftQp {
    fn drop(&mut self) {
        self.db_open(false);
        if let (Some(t), Some(db)) = (&self.ctx.doorbells, &self.db) {
            t.release(db.index);
        }
        self.ctx.qps.lock().unwrap_or_else(|e| e.into_inner()).remove(&self.qpn);
    }
}
