//! The receiving side of this QP's doorbell ([`RxDoorbell`]): opening and
//! closing it with the QP's state, publishing the receive queue's length,
//! claiming records into receive completions, and waking the requester.
//!
//! The protocol on one slot lives in `doorbell_proto.rs`; the requesting
//! side in `requester/doorbell_tx.rs`.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use super::SoftQp;
use crate::provider::QpOps;
use crate::qp_attr::QpState;
use crate::soft::context::CtxShared;
use crate::wc::{WcOpcode, WcStatus, WorkCompletion};

/// The receiving side of a doorbell (see `doorbell.rs`).
pub(super) struct RxDoorbell {
    pub(super) index: u32,
    pub(super) slot: crate::soft::doorbell::SlotRef,
    /// The requester's send CQ event fd with that CQ's unique id, as the
    /// requester passed it over the attach socket.
    pub(super) tx_wake: Mutex<Option<(u64, Arc<std::os::fd::OwnedFd>)>>,
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
                crate::soft::doorbell::ring(fd);
                ctx.db_rings.fetch_add(1, Ordering::Relaxed);
            }
            _ => {
                tracing::debug!("soft doorbell: the requester's send CQ {cq:#x} is unknown here; it falls back");
                slot.no_tx_wake.store(1, Ordering::Release);
            }
        }
    }
}

impl SoftQp {
    /// Marks this QP's doorbell open (RTR/RTS) or closed for requesters.
    /// Closing also voids a record still posted (the QP leaves service, or
    /// is reset for another connection): its requester then fails that WR
    /// instead of a later life of this QP claiming it.
    pub(super) fn db_open(&self, open: bool) {
        if let Some(db) = &self.db {
            crate::soft::doorbell_proto::set_open(db.slot.get(), open);
        }
    }

    /// Publishes how many receives are posted (under the RQ lock).
    pub(crate) fn db_note_rq(&self, n: usize) {
        if let Some(db) = &self.db {
            db.slot.get().rq_len.store(n.min(u32::MAX as usize) as u32, Ordering::Release);
        }
    }

    /// [`db_claim`](Self::db_claim), but nothing while the responder holds
    /// receives it has not completed ([`rx_busy`](Self::rx_busy)): they
    /// were taken before any the record would take, so the record's
    /// completion goes behind theirs, and the responder claims it when it
    /// releases them. (With one posting thread, the responder holds only
    /// requests sent before the record was posted: the requester posts a
    /// record once all it sent before is acknowledged, and the responder
    /// releases just after writing that ACK. With several threads posting
    /// on one QP, the record may come after requests still held.)
    pub(crate) fn db_claim_in_order(&self) {
        // Nothing to claim (the common case) is seen without a lock.
        let Some(db) = &self.db else { return };
        if db.slot.get().state.load(Ordering::Acquire) & 3 != crate::soft::doorbell::POSTED {
            return;
        }
        if !self.rx_busy() {
            self.db_claim();
        }
    }

    /// Picks up a doorbell record addressed to this QP when one is posted
    /// and a receive is there: pushes its receive completion, then rings
    /// the requester if it sleeps. Called by this QP's receive-CQ polls
    /// and by its responder before it takes a receive for a later request.
    pub(crate) fn db_claim(&self) {
        use crate::soft::doorbell_proto::{claim, ring_tx, Claim};
        let Some(db) = &self.db else { return };
        let slot = db.slot.get();
        if slot.state.load(Ordering::Acquire) & 3 != crate::soft::doorbell::POSTED {
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
            crate::soft::doorbell_proto::arm_rx(db.slot.get());
        }
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
}
