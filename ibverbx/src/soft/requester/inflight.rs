//! The requester's in-flight WRs: what each waits for, and how they finish
//! (completions in posting order, flushes, a failed link).

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::time::Instant;

use super::Shared;
use crate::soft::mr::LocalSeg;
use crate::wc::{WcOpcode, WcStatus, WorkCompletion};

/// What an in-flight stream request waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Expect {
    Ack,
    Read(u32),
    Atomic,
}

#[derive(Debug)]
pub(super) struct Inflight {
    pub(super) wr_id: u64,
    pub(super) opcode: WcOpcode,
    pub(super) signaled: bool,
    pub(super) byte_len: u32,
    pub(super) status: Option<WcStatus>,
    /// Set while a response is awaited.
    pub(super) awaiting: Option<(u32, Expect)>,
    /// A staged request that changes or reads target memory (not a bare
    /// notify): later direct placements must wait until it has executed.
    pub(super) touches_memory: bool,
    pub(super) segs: Vec<LocalSeg>,
    pub(super) sent_at: Instant,
    pub(super) rnr_waits: u32,
    /// A doorbell WR not yet claimed or retracted: (record sequence, imm).
    pub(super) db: Option<(u64, u32)>,
}

impl Inflight {
    /// A WR just taken on: nothing sent, nothing awaited yet.
    pub(super) fn new(wr_id: u64, opcode: WcOpcode, signaled: bool, byte_len: u32) -> Inflight {
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
pub(super) struct SqState {
    pub(super) inflight: VecDeque<Inflight>,
    /// Set once the connection is gone: later WRs fail with this status.
    pub(super) broken: Option<WcStatus>,
}

impl Shared {
    /// Pops finished WRs from the head and emits their completions.
    pub(super) fn emit(&self, q: &mut SqState) {
        if self.stale() {
            // The QP was reset: its WRs of that life were dropped without
            // completions (and their slots freed by the reset).
            q.inflight.retain(|f| f.status.is_none());
            return;
        }
        while q.inflight.front().is_some_and(|f| f.status.is_some()) {
            let f = q.inflight.pop_front().expect("front exists");
            let status = f.status.expect("checked");
            // Free the slot before the completion is visible: a poster that
            // sees the completion may post again at once.
            self.qp.sq_release(1);
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
    pub(super) fn fail_link(&self, status: WcStatus, why: &str) {
        if self.stale() {
            // The QP was reset: this link's end is no news to it (and it
            // may be connected again already).
            return;
        }
        let mut q = self.lock();
        let first = q.broken.is_none();
        if first {
            tracing::warn!(qpn = self.qp.qpn, "soft QP connection failed: {why}");
        }
        q.broken.get_or_insert(WcStatus::RetryExcErr);
        self.qp.set_fast(None);
        // The oldest unanswered request gets the status: a WR on the wire,
        // or a doorbell record the peer never claimed (one it claimed
        // completes normally, and the next in line gets the status). Only
        // at the first failure: one that follows it (the response reader
        // finding the socket shut down by the first) leaves the rest to
        // the flush.
        let unanswered = |f: &&mut Inflight| f.status.is_none() && (f.awaiting.is_some() || f.db.is_some());
        if first {
            for f in q.inflight.iter_mut().filter(unanswered) {
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
        }
        drop(q);
        // A frame being written when the link failed (the watchdog's
        // verdict on a peer that stopped reading) fails now, and the peer
        // learns that this side is gone.
        if let Some(fd) = self.sock.get() {
            let _ = rustix::net::shutdown(fd, rustix::net::Shutdown::Both);
        }
        self.qp.set_error_in(self.life, why);
        self.progress.notify_waiters();
    }

    /// Flushes everything not yet finished (QP in ERR). A doorbell record
    /// the peer already claimed completes normally.
    pub(super) fn flush(&self) {
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
        drop(q);
        // Whatever waits for an answer (a fence, direct placement behind
        // staged requests) sees that none is awaited any more.
        self.progress.notify_waiters();
    }
}
