//! The soft RC queue pair: state machine, posting, flushing.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::{mpsc, watch, Notify};

use super::context::{CtxShared, SoftPd};
use super::cq::SoftCq;
use super::mr::LocalSeg;
use crate::endpoint::{QpEndpoint, SoftAddress};
use crate::provider::{CqOps, QpOps};
use crate::qp_attr::{QpCaps, QpState, QpTransition, RtrAttr, RtsAttr};
use crate::wc::{WcOpcode, WcStatus, WorkCompletion};
use crate::wr::{RecvWr, SendOp, SendWr};
use crate::{AccessFlags, Error, Gid, QpInitAttr, Result};

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

/// What the posting thread needs to copy directly to a same-host peer
/// (`peer`), or to write small requests on the connection itself.
#[derive(Debug)]
pub(crate) struct FastPath {
    /// The same-host peer's mapped tables; `None` over TCP.
    pub(crate) peer: Option<Arc<super::peer::PeerMap>>,
    pub(crate) remote_pd: u32,
    /// Sending notifications from the posting thread (unix-socket links).
    pub(crate) notify: Option<Arc<super::requester::FastNotify>>,
}

#[derive(Debug)]
struct QpSt {
    state: QpState,
    access: AccessFlags,
    rtr: Option<RtrAttr>,
    sq_tx: Option<mpsc::UnboundedSender<SqEntry>>,
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
    /// Incremented by every transition to RESET: connections accepted in an
    /// earlier epoch belong to a previous life of the QP and are closed.
    epoch: std::sync::atomic::AtomicU64,
    /// Set by the requester while a same-host link with a mapped peer is up.
    fast: std::sync::RwLock<Option<Arc<FastPath>>>,
    /// This QP's doorbell: notifications to it through shared memory.
    db: Option<RxDoorbell>,
    /// Doorbell WRs this QP posted that are not finished yet (shared with
    /// the send CQ's registration).
    pub(crate) db_tx_pending: Arc<AtomicU32>,
    /// Long runs of direct copies stream past the cache (`copy.rs`).
    pub(crate) stream: super::copy::StreamDetector,
}

/// The receiving side of a doorbell (see `doorbell.rs`).
struct RxDoorbell {
    index: u32,
    slot: super::doorbell::SlotRef,
    /// The requester's send CQ event fd with that CQ's unique id, as the
    /// requester passed it over the attach socket.
    tx_wake: Mutex<Option<(u64, Arc<std::os::fd::OwnedFd>)>>,
}

impl RxDoorbell {
    /// Rings the requester's send CQ; when it has not given us its event fd
    /// (or gave another CQ's), tells it to stop using the doorbell (its
    /// progress thread then finishes the WR).
    fn wake_tx(&self, ctx: &CtxShared) {
        let slot = self.slot.get();
        let cq = slot.tx_cq.load(Ordering::Acquire);
        let g = self.tx_wake.lock().unwrap_or_else(|e| e.into_inner());
        match g.as_ref() {
            Some((c, fd)) if *c == cq => {
                super::doorbell::ring(fd);
                ctx.db_rings.fetch_add(1, Ordering::Relaxed);
            }
            _ => {
                tracing::debug!("soft doorbell: the requester's send CQ {cq:#x} is unknown here; it falls back");
                slot.no_tx_wake.store(1, Ordering::Release);
            }
        }
    }
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
                accepted: None,
            }),
            state_tx,
            rq: Mutex::new(VecDeque::new()),
            rq_notify: Notify::new(),
            sq_outstanding: AtomicU32::new(0),
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

    pub(crate) fn set_fast(&self, f: Option<FastPath>) {
        *self.fast.write().unwrap_or_else(|e| e.into_inner()) = f.map(Arc::new);
    }

    /// Runs a small same-host WRITE/READ/atomic in the calling thread when
    /// nothing else is outstanding (so order is kept). Returns false when
    /// the WR must go through the progress engine instead; errors always do,
    /// so that error handling lives in one place.
    fn try_fast(&self, wr: &SendWr<'_>, len: u64) -> bool {
        use super::peer::Direct;
        use crate::wr::AtomicOp;
        if len as usize > self.ctx.config.inline_copy_max || self.ctx.config.chaos_seed.is_some() {
            return false;
        }
        let (raddr, rkey, need) = match wr.op {
            SendOp::RdmaWrite { remote_addr, rkey } => (remote_addr, rkey, AccessFlags::REMOTE_WRITE),
            SendOp::RdmaRead { remote_addr, rkey } => (remote_addr, rkey, AccessFlags::REMOTE_READ),
            SendOp::Atomic { remote_addr, rkey, .. } => (remote_addr, rkey, AccessFlags::REMOTE_ATOMIC),
            _ => return false,
        };
        if len == 0 || wr.flags.fence {
            return false;
        }
        let Some(fast) = self.fast.read().unwrap_or_else(|e| e.into_inner()).clone() else { return false };
        let local_need = wr.op.local_access();
        // Local pieces, inline ones included: their keys and bounds are
        // checked (and the regions held) before anything reads them.
        let mut local: [(usize, usize); 16] = [(0, 0); 16];
        let mut _keep: [Option<Arc<super::mr::SoftMr>>; 16] = Default::default();
        for (i, s) in wr.sg_list.iter().enumerate() {
            let Some(mr) = self.ctx.mr(s.lkey) else { return false };
            let Some(p) = mr.check(self.pd, s.addr, s.length as u64, local_need) else { return false };
            local[i] = (p as usize, s.length as usize);
            _keep[i] = Some(mr);
        }
        let local = &local[..wr.sg_list.len()];
        let Some(peer) = &fast.peer else { return false };
        let Ok(Direct::Ptr(p, _map)) = peer.resolve(fast.remote_pd, rkey, raddr, len, need) else { return false };
        let mut off = 0;
        match wr.op {
            SendOp::RdmaWrite { .. } => {
                let stream = self.stream.observe(raddr, len);
                for &(l, n) in local {
                    // SAFETY: l..l+n is a checked live local region (or the
                    // caller's inline buffer); p+off..p+off+n lies in the
                    // peer's checked, mapped region.
                    unsafe { super::copy::copy((p + off) as *mut u8, l as *const u8, n, stream) };
                    off += n;
                }
            }
            SendOp::RdmaRead { .. } => {
                let stream = self.stream.observe(raddr, len);
                for &(l, n) in local {
                    // SAFETY: as above, direction reversed.
                    unsafe { super::copy::copy(l as *mut u8, (p + off) as *const u8, n, stream) };
                    off += n;
                }
            }
            SendOp::Atomic { op, .. } => {
                // SAFETY: 8-byte aligned (checked at post) inside the mapped
                // peer region; every soft atomic on it uses AtomicU64.
                let cell = unsafe { &*(p as *const std::sync::atomic::AtomicU64) };
                let orig = match op {
                    AtomicOp::FetchAdd { add } => cell.fetch_add(add, Ordering::AcqRel),
                    AtomicOp::CompareSwap { compare, swap } => {
                        match cell.compare_exchange(compare, swap, Ordering::AcqRel, Ordering::Acquire) {
                            Ok(v) | Err(v) => v,
                        }
                    }
                };
                // SAFETY: local[0] is the checked 8-byte result buffer.
                unsafe { std::ptr::write_unaligned(local[0].0 as *mut u64, orig) };
            }
            _ => unreachable!("filtered above"),
        }
        if wr.flags.signaled || self.sq_sig_all {
            self.push_send_wc(WorkCompletion {
                wr_id: wr.wr_id,
                status: WcStatus::Success,
                opcode: wr.op.wc_opcode(),
                byte_len: len as u32,
                imm_data: None,
                qp_num: self.qpn,
                vendor_err: 0,
            });
        }
        true
    }

    /// Requests sent by the posting thread on an idle QP: same host,
    /// WRITE_WITH_IMM (data copied directly, then the notify); over TCP,
    /// small WRITEs and WRITE_WITH_IMMs with their payload; on both, small
    /// SENDs. False when the WR must go through the engine (nothing has
    /// been sent then; a direct copy already made is simply made again).
    fn try_fast_notify(&self, wr: &SendWr<'_>, len: u64) -> bool {
        use super::requester::FastWr;
        use super::wire::Frame;
        if self.ctx.config.chaos_seed.is_some() || wr.flags.fence {
            return false;
        }
        let Some(fast) = self.fast.read().unwrap_or_else(|e| e.into_inner()).clone() else { return false };
        let Some(notify) = fast.notify.clone() else { return false };
        let mut local: [(usize, usize); 16] = [(0, 0); 16];
        let mut _keep: [Option<Arc<super::mr::SoftMr>>; 16] = Default::default();
        if !self.local_pieces(wr, &mut local, &mut _keep) {
            return false;
        }
        let local = &local[..wr.sg_list.len()];
        let (frame, payload): (Frame, &[(usize, usize)]) = match wr.op {
            SendOp::RdmaWrite { remote_addr, rkey } | SendOp::RdmaWriteWithImm { remote_addr, rkey, .. }
                if fast.peer.is_none() && len <= 4096 =>
            {
                let imm = match wr.op {
                    SendOp::RdmaWriteWithImm { imm, .. } => Some(imm),
                    _ => None,
                };
                (Frame::Write { psn: 0, raddr: remote_addr, rkey, len: len as u32, imm }, local)
            }
            SendOp::RdmaWriteWithImm { remote_addr, rkey, imm } => {
                if len as usize > self.ctx.config.inline_copy_max
                    || !copy_direct(&fast, local, remote_addr, rkey, len, &self.stream)
                {
                    return false;
                }
                (Frame::Notify { psn: 0, len: len as u32, imm }, &[])
            }
            SendOp::Send | SendOp::SendWithImm { .. } if len <= 4096 => {
                let imm = match wr.op {
                    SendOp::SendWithImm { imm } => Some(imm),
                    _ => None,
                };
                (Frame::Send { psn: 0, len: len as u32, imm }, local)
            }
            _ => return false,
        };
        notify.try_send(FastWr {
            wr_id: wr.wr_id,
            opcode: wr.op.wc_opcode(),
            signaled: wr.flags.signaled || self.sq_sig_all,
            byte_len: len as u32,
            frame,
            payload,
        })
    }

    /// The local pieces of a WR about to be sent by the posting thread:
    /// checked registrations (kept alive in `keep`), for inline WRs too.
    fn local_pieces(
        &self,
        wr: &SendWr<'_>,
        local: &mut [(usize, usize); 16],
        keep: &mut [Option<Arc<super::mr::SoftMr>>; 16],
    ) -> bool {
        for (i, s) in wr.sg_list.iter().enumerate() {
            if s.length == 0 {
                local[i] = (s.addr as usize, 0);
                continue;
            }
            let Some(mr) = self.ctx.mr(s.lkey) else { return false };
            let Some(p) = mr.check(self.pd, s.addr, s.length as u64, AccessFlags::empty()) else { return false };
            local[i] = (p as usize, s.length as usize);
            keep[i] = Some(mr);
        }
        true
    }

    /// WRITE_WITH_IMM on an idle same-host QP through the peer QP's
    /// doorbell: data copied here, the notification left in shared memory
    /// for the peer's CQ poll (see `doorbell.rs`). False when the WR must
    /// take another path (nothing is published then).
    fn try_doorbell(&self, wr: &SendWr<'_>, len: u64) -> bool {
        let SendOp::RdmaWriteWithImm { remote_addr, rkey, imm } = wr.op else { return false };
        if self.ctx.config.chaos_seed.is_some() || wr.flags.fence || len as usize > self.ctx.config.inline_copy_max {
            return false;
        }
        let Some(fast) = self.fast.read().unwrap_or_else(|e| e.into_inner()).clone() else { return false };
        let Some(notify) = fast.notify.clone() else { return false };
        if !notify.doorbell_ready() {
            return false;
        }
        let mut local: [(usize, usize); 16] = [(0, 0); 16];
        let mut _keep: [Option<Arc<super::mr::SoftMr>>; 16] = Default::default();
        if !self.local_pieces(wr, &mut local, &mut _keep)
            || !copy_direct(&fast, &local[..wr.sg_list.len()], remote_addr, rkey, len, &self.stream)
        {
            return false;
        }
        notify.post_doorbell(wr.wr_id, wr.op.wc_opcode(), wr.flags.signaled || self.sq_sig_all, len as u32, imm)
    }

    /// Marks this QP's doorbell open (RTR/RTS) or closed for requesters.
    /// Closing also voids a record still posted (the QP leaves service, or
    /// is reset for another connection): its requester then fails that WR
    /// instead of a later life of this QP claiming it.
    fn db_open(&self, open: bool) {
        if let Some(db) = &self.db {
            super::doorbell_proto::set_open(db.slot.get(), open);
        }
    }

    /// Publishes how many receives are posted (under the RQ lock).
    pub(crate) fn db_note_rq(&self, n: usize) {
        if let Some(db) = &self.db {
            db.slot.get().rq_len.store(n.min(u32::MAX as usize) as u32, Ordering::Release);
        }
    }

    /// Picks up a doorbell record addressed to this QP when one is posted
    /// and a receive is there: pushes its receive completion, then rings
    /// the requester if it sleeps. Called by this QP's receive-CQ polls
    /// and by its responder before it takes a receive for a later request.
    pub(crate) fn db_claim(&self) {
        use super::doorbell_proto::{claim, ring_tx, Claim};
        let Some(db) = &self.db else { return };
        let slot = db.slot.get();
        if slot.state.load(Ordering::Acquire) & 3 != super::doorbell::POSTED {
            return;
        }
        let in_service = matches!(self.state(), QpState::Rtr | QpState::Rts);
        let take_rq = || {
            let rq = self.rq.lock().unwrap_or_else(|e| e.into_inner());
            (!rq.is_empty()).then_some(rq)
        };
        let Claim::Claimed { imm, len, guard: mut rq } = claim(slot, in_service, take_rq) else { return };
        let r = rq.pop_front().expect("checked non-empty");
        self.db_note_rq(rq.len());
        self.ctx.db_claimed.fetch_add(1, Ordering::Relaxed);
        // Pushed under the RQ lock: no later receive completion overtakes it.
        self.push_recv_wc(WorkCompletion {
            wr_id: r.wr_id,
            status: WcStatus::Success,
            opcode: WcOpcode::RecvRdmaWithImm,
            byte_len: len,
            imm_data: Some(imm),
            qp_num: self.qpn,
            vendor_err: 0,
        });
        drop(rq);
        if ring_tx(slot) {
            db.wake_tx(&self.ctx);
        }
    }

    /// This QP's receive CQ is being armed: requesters ring it after their
    /// next record (the caller polls once more after arming).
    pub(crate) fn db_arm_rx(&self) {
        if let Some(db) = &self.db {
            super::doorbell_proto::arm_rx(db.slot.get());
        }
    }

    fn fast_notify(&self) -> Option<Arc<super::requester::FastNotify>> {
        self.fast.read().unwrap_or_else(|e| e.into_inner()).as_ref().and_then(|f| f.notify.clone())
    }

    /// Completes this QP's doorbell WRs that the peer has claimed.
    pub(crate) fn db_check_tx(&self) {
        if self.db_tx_pending.load(Ordering::Acquire) == 0 {
            return;
        }
        if let Some(n) = self.fast_notify() {
            n.check_doorbell();
        }
    }

    /// This QP's send CQ is being armed: the peer rings it when it claims.
    pub(crate) fn db_arm_tx(&self) {
        if self.db_tx_pending.load(Ordering::Acquire) == 0 {
            return;
        }
        if let Some(n) = self.fast_notify() {
            n.arm_doorbell();
        }
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

    /// Records the event fd of the requester's send CQ `cq`, given over the
    /// attach socket; false when this QP has no doorbell.
    pub(crate) fn set_tx_waker(&self, cq: u64, fd: Arc<std::os::fd::OwnedFd>) -> bool {
        match &self.db {
            Some(db) => {
                *db.tx_wake.lock().unwrap_or_else(|e| e.into_inner()) = Some((cq, fd));
                true
            }
            None => false,
        }
    }

    pub(crate) fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }

    pub(crate) fn remote_access(&self) -> AccessFlags {
        self.lock().access
    }

    /// The PD of the peer QP (same-host direct checks use it).
    pub(crate) fn remote_pd(&self) -> u32 {
        self.lock().rtr.as_ref().and_then(|r| r.remote.soft.as_ref()).map_or(0, |s| s.pd)
    }

    /// The RNR NAK period this QP (as a responder) reports at.
    pub(crate) fn rnr_period(&self) -> std::time::Duration {
        let code = self.lock().rtr.as_ref().map_or(12, |r| r.min_rnr_timer);
        crate::qp_attr::rnr_timer_duration(code).max(std::time::Duration::from_micros(100))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, QpSt> {
        self.st.lock().unwrap_or_else(|e| e.into_inner())
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
        let mut st = self.lock();
        if matches!(st.state, QpState::Err | QpState::Reset) {
            return;
        }
        tracing::debug!(qpn = self.qpn, "soft QP enters the error state: {why}");
        st.state = QpState::Err;
        drop(st);
        self.db_open(false);
        self.set_fast(None);
        self.state_tx.send_replace(QpState::Err);
        self.flush_rq();
    }

    fn flush_rq(&self) {
        // Pushed under the RQ lock: a poster flushing its late receive (QP
        // already in ERR) cannot slip its completion between these.
        let mut rq = self.rq.lock().unwrap_or_else(|e| e.into_inner());
        self.db_note_rq(0);
        for r in rq.drain(..) {
            self.push_recv_wc(self.flush_wc(r.wr_id, WcOpcode::Recv));
        }
        drop(rq);
        self.rq_notify.notify_waiters();
    }

    fn resolve(&self, sges: &[crate::Sge]) -> Vec<LocalSeg> {
        sges.iter()
            .map(|s| LocalSeg {
                mr: if s.length == 0 { None } else { self.ctx.mr(s.lkey) },
                addr: s.addr,
                len: s.length,
            })
            .collect()
    }

    /// Copies an inline WR's data. Its SGEs must lie in live regions of
    /// this QP's PD named by their lkeys: inline data is read by the
    /// library, so an unchecked address would let safe code read any memory.
    fn copy_inline(&self, sges: &[crate::Sge], len: u64) -> Result<Vec<u8>> {
        let mut data: Vec<u8> = Vec::with_capacity(len as usize);
        for (i, s) in sges.iter().enumerate() {
            if s.length == 0 {
                continue;
            }
            let mr = self.ctx.mr(s.lkey);
            let Some(p) = mr.as_ref().and_then(|mr| mr.check(self.pd, s.addr, s.length as u64, AccessFlags::empty()))
            else {
                return Err(Error::invalid(
                    "post_send",
                    format!(
                        "inline SGE {i} ({:#x}+{} bytes, lkey {:#x}) is not inside a registered region of this \
                         QP's PD with that lkey; inline data must come from registered memory",
                        s.addr, s.length, s.lkey
                    ),
                ));
            };
            let n = s.length as usize;
            let at = data.len();
            // SAFETY: p..p+n was just checked against a live region held by
            // `mr`; the destination has room (capacity is the sum of the
            // SGE lengths). Copied through raw pointers: peers may write the
            // region concurrently, so it is never borrowed as a slice.
            unsafe {
                std::ptr::copy_nonoverlapping(p, data.as_mut_ptr().add(at), n);
                data.set_len(at + n);
            }
        }
        Ok(data)
    }

    fn check_send_wr(&self, wr: &SendWr<'_>) -> Result<u64> {
        if wr.sg_list.len() > self.caps.max_send_sge as usize {
            return Err(Error::invalid(
                "post_send",
                format!("{} SGEs exceed max_send_sge {}", wr.sg_list.len(), self.caps.max_send_sge),
            ));
        }
        let len: u64 = wr.sg_list.iter().map(|s| s.length as u64).sum();
        if len > self.ctx.config.max_msg_size as u64 {
            return Err(Error::invalid(
                "post_send",
                format!("message of {len} bytes exceeds max_msg_sz {}", self.ctx.config.max_msg_size),
            ));
        }
        if wr.flags.inline {
            if len > self.caps.max_inline_data as u64 {
                return Err(Error::invalid(
                    "post_send",
                    format!("{len} inline bytes exceed max_inline_data {}", self.caps.max_inline_data),
                ));
            }
            if matches!(wr.op, SendOp::RdmaRead { .. } | SendOp::Atomic { .. }) {
                return Err(Error::invalid("post_send", "RDMA READ and atomics cannot be inline"));
            }
        }
        if let SendOp::Atomic { remote_addr, .. } = wr.op {
            if wr.sg_list.len() != 1 || wr.sg_list[0].length != 8 {
                return Err(Error::invalid("post_send", "an atomic needs exactly one 8-byte SGE"));
            }
            if remote_addr % 8 != 0 {
                return Err(Error::invalid(
                    "post_send",
                    format!("atomic address {remote_addr:#x} is not 8-byte aligned"),
                ));
            }
        }
        Ok(len)
    }
}

impl QpOps for SoftQp {
    fn qp_num(&self) -> u32 {
        self.qpn
    }

    fn state(&self) -> QpState {
        self.lock().state
    }

    fn caps(&self) -> QpCaps {
        self.caps
    }

    fn endpoint(&self) -> Result<QpEndpoint> {
        let ctx = &self.ctx;
        Ok(QpEndpoint {
            qpn: self.qpn,
            psn: 0,
            lid: 0,
            gid: match ctx.tcp_addrs.first().map(|a| a.ip()) {
                Some(std::net::IpAddr::V4(v4)) => Gid::from_ipv4(v4),
                _ => Gid::default(),
            },
            mtu: 4096,
            soft: Some(SoftAddress {
                host: ctx.host.clone(),
                pid: ctx.pid,
                ctx_uid: ctx.uid,
                tcp: ctx.tcp_addrs.clone(),
                unix: ctx.unix_name.clone(),
                keytable_fd: -1,
                keytable_uid: ctx.keytable.uid(),
                pd: self.pd,
                token: self.token,
                doorbell_fd: -1,
                doorbell_uid: ctx.doorbells.as_ref().map_or(0, |t| t.uid()),
                doorbell_slot: self.db.as_ref().map_or(0, |d| d.index),
                fence_uid: ctx.fences.uid(),
            }),
        })
    }

    fn modify(&self, t: &QpTransition) -> Result<()> {
        let mut st = self.lock();
        if !t.allowed_from(st.state) {
            return Err(Error::state(
                "modify_qp",
                format!("{:?} → {:?} is not a valid transition", st.state, t.target()),
            ));
        }
        match t {
            QpTransition::Init(a) => {
                st.access = a.access;
            }
            QpTransition::Rtr(a) => {
                if a.remote.soft.is_none() {
                    return Err(Error::invalid("modify_qp(RTR)", "the remote endpoint is not a soft-provider QP"));
                }
                st.rtr = Some(a.clone());
            }
            QpTransition::Rts(a) => {
                if st.sq_tx.is_none() {
                    let rtr = st.rtr.clone().expect("RTR precedes RTS");
                    let (tx, rx) = mpsc::unbounded_channel();
                    st.sq_tx = Some(tx);
                    let me =
                        self.ctx.qps.lock().unwrap_or_else(|e| e.into_inner()).get(&self.qpn).and_then(|w| w.upgrade());
                    let me = me.ok_or_else(|| Error::state("modify_qp(RTS)", "QP is being destroyed"))?;
                    let rts: RtsAttr = *a;
                    self.ctx.rt.spawn(super::requester::run(me, rx, rtr, rts));
                }
            }
            QpTransition::Err => {
                drop(st);
                self.set_error("modify_qp(ERR)");
                return Ok(());
            }
            QpTransition::Reset => {
                self.epoch.fetch_add(1, Ordering::AcqRel);
                st.sq_tx = None;
                st.rtr = None;
                st.state = QpState::Reset;
                drop(st);
                self.set_fast(None);
                self.db_open(false);
                if let Some(db) = &self.db {
                    super::doorbell_proto::new_life(db.slot.get());
                }
                self.state_tx.send_replace(QpState::Reset);
                self.rq.lock().unwrap_or_else(|e| e.into_inner()).clear();
                self.db_note_rq(0);
                self.rq_notify.notify_waiters();
                return Ok(());
            }
        }
        st.state = t.target();
        let s = st.state;
        drop(st);
        if matches!(s, QpState::Rtr | QpState::Rts) {
            self.db_open(true);
        }
        self.state_tx.send_replace(s);
        Ok(())
    }

    fn post_send(&self, wrs: &[SendWr<'_>]) -> Result<()> {
        let mut lens = Vec::with_capacity(wrs.len());
        for wr in wrs {
            lens.push(self.check_send_wr(wr)?);
        }
        let st = self.lock();
        let st_is_rts = st.state == QpState::Rts;
        let tx = match (st.state, &st.sq_tx) {
            (QpState::Rts | QpState::Err, Some(tx)) => tx.clone(),
            (s, _) => {
                return Err(Error::state("post_send", format!("QP {:#x} is in {s:?}; it must be in RTS", self.qpn)))
            }
        };
        drop(st);
        let n = wrs.len() as u32;
        // A doorbell WR the peer has claimed but nobody has polled for yet
        // finishes here, so that this WR finds the QP idle.
        if n == 1 && st_is_rts && self.db_tx_pending.load(Ordering::Acquire) > 0 {
            self.db_check_tx();
        }
        if n == 1 && st_is_rts && self.sq_outstanding.load(Ordering::Acquire) == 0 {
            if self.try_fast(&wrs[0], lens[0]) {
                return Ok(());
            }
            // Claim the only slot, then try to send the notification here.
            if self.sq_outstanding.compare_exchange(0, 1, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                if self.try_doorbell(&wrs[0], lens[0]) || self.try_fast_notify(&wrs[0], lens[0]) {
                    return Ok(());
                }
                self.sq_outstanding.fetch_sub(1, Ordering::AcqRel);
            }
        }
        let before = self.sq_outstanding.fetch_add(n, Ordering::AcqRel);
        if before + n > self.caps.max_send_wr {
            self.sq_outstanding.fetch_sub(n, Ordering::AcqRel);
            return Err(Error::exhausted(
                "post_send",
                format!("send queue full: {before} outstanding, max_send_wr {}", self.caps.max_send_wr),
            ));
        }
        // Every entry is built (inline data copied out of checked regions)
        // before the first is queued, so that a bad inline SGE posts nothing.
        let mut entries = Vec::with_capacity(wrs.len());
        for (wr, len) in wrs.iter().zip(lens) {
            let (segs, inline) = if wr.flags.inline {
                match self.copy_inline(wr.sg_list, len) {
                    Ok(data) => (Vec::new(), Some(data)),
                    Err(e) => {
                        self.sq_outstanding.fetch_sub(n, Ordering::AcqRel);
                        return Err(e);
                    }
                }
            } else {
                (self.resolve(wr.sg_list), None)
            };
            entries.push(SqEntry {
                wr_id: wr.wr_id,
                op: wr.op,
                segs,
                inline,
                signaled: wr.flags.signaled || self.sq_sig_all,
                fence: wr.flags.fence,
                len,
            });
        }
        for e in entries {
            if let Err(mpsc::error::SendError(e)) = tx.send(e) {
                // The engine is gone (context shutting down): flush.
                self.sq_outstanding.fetch_sub(1, Ordering::AcqRel);
                self.push_send_wc(self.flush_wc(e.wr_id, e.op.wc_opcode()));
            }
        }
        Ok(())
    }

    fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<()> {
        let state = self.state();
        if state == QpState::Reset {
            return Err(Error::state("post_recv", format!("QP {:#x} is in RESET; move it to INIT first", self.qpn)));
        }
        for wr in wrs {
            if wr.sg_list.len() > self.caps.max_recv_sge as usize {
                return Err(Error::invalid(
                    "post_recv",
                    format!("{} SGEs exceed max_recv_sge {}", wr.sg_list.len(), self.caps.max_recv_sge),
                ));
            }
        }
        let mut rq = self.rq.lock().unwrap_or_else(|e| e.into_inner());
        if rq.len() + wrs.len() > self.caps.max_recv_wr as usize {
            return Err(Error::exhausted(
                "post_recv",
                format!("receive queue full: {} posted, max_recv_wr {}", rq.len(), self.caps.max_recv_wr),
            ));
        }
        for wr in wrs {
            rq.push_back(RecvEntry { wr_id: wr.wr_id, segs: self.resolve(wr.sg_list) });
        }
        self.db_note_rq(rq.len());
        drop(rq);
        if state == QpState::Err {
            self.flush_rq();
        } else {
            self.rq_notify.notify_waiters();
        }
        Ok(())
    }
}

impl Drop for SoftQp {
    fn drop(&mut self) {
        self.db_open(false);
        self.ctx.qps.lock().unwrap_or_else(|e| e.into_inner()).remove(&self.qpn);
    }
}

/// Copies the local pieces straight into the peer's memory at
/// `remote_addr` (checked against its key table); false when there is no
/// direct path (nothing copied then).
fn copy_direct(
    fast: &FastPath,
    local: &[(usize, usize)],
    remote_addr: u64,
    rkey: u32,
    len: u64,
    stream: &super::copy::StreamDetector,
) -> bool {
    use super::peer::Direct;
    if len == 0 {
        return true;
    }
    let Some(peer) = &fast.peer else { return false };
    let Ok(Direct::Ptr(p, _map)) = peer.resolve(fast.remote_pd, rkey, remote_addr, len, AccessFlags::REMOTE_WRITE)
    else {
        return false;
    };
    let stream = stream.observe(remote_addr, len);
    let mut off = 0;
    for &(l, n) in local {
        // SAFETY: l..l+n is a checked live local region (or the caller's
        // inline buffer); p+off.. lies in the peer's checked, mapped region.
        unsafe { super::copy::copy((p + off) as *mut u8, l as *const u8, n, stream) };
        off += n;
    }
    true
}
