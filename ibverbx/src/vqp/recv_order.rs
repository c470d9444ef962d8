//! Receive-side ordering: matches arrivals on the control QP with the DQPLB
//! tracker's finished messages and releases receive completions in order
//! (sans-IO).
//!
//! Under DQPLB the application's immediate travels as a zero-byte
//! RDMA_WRITE_WITH_IMM on the control (notify) QP, posted right after the
//! message's fragments without waiting for them. It consumes the
//! application's next receive WR, like any WRITE_WITH_IMM, but may arrive
//! before the fragments: it is held until the tracker has finished the
//! matching message. Both sides are FIFO (the control QP is one RC QP; the
//! tracker finishes messages in sequence order), so the k-th such arrival
//! belongs to the k-th finished message that carries the USER bit. SENDs
//! arriving behind a held completion wait too, keeping posting order.

use std::collections::VecDeque;

use crate::{WcOpcode, WcStatus, WorkCompletion};

#[derive(Debug)]
struct Held {
    wc: WorkCompletion,
    needs_message: bool,
}

/// The receive-direction sequencer of one virtual QP.
#[derive(Debug, Default)]
pub struct RecvSequencer {
    held: VecDeque<Held>,
    /// Finished USER messages not yet matched with a released arrival.
    unmatched: u64,
    /// The virtual QP failed: no message will finish any more.
    failed: bool,
}

impl RecvSequencer {
    /// An empty sequencer.
    pub fn new() -> Self {
        RecvSequencer::default()
    }

    /// A receive completion from the control QP. `needs_message`: it is a
    /// DQPLB immediate that may only be released once its message finished.
    ///
    /// After [`fail`](Self::fail) no message finishes any more, so an
    /// immediate that was still in the CQ then is released at once: as it
    /// came if its message had already finished, else flushed. The
    /// receiver cannot vouch for data it never saw complete (the virtual
    /// WRITE_WITH_IMM did not complete), and holding it would keep every
    /// flushed receive behind it from being reported.
    pub fn on_arrival(&mut self, mut wc: WorkCompletion, needs_message: bool) {
        let mut needs_message = needs_message && wc.status == WcStatus::Success;
        if needs_message && self.failed && self.unmatched <= self.waiting() as u64 {
            needs_message = false;
            flush(&mut wc, WcStatus::WrFlushErr);
        }
        self.held.push_back(Held { wc, needs_message });
    }

    /// The tracker finished a message that carries the USER bit.
    pub fn on_message_finished(&mut self) {
        self.unmatched += 1;
    }

    /// The next receive completion to report.
    pub fn poll(&mut self) -> Option<WorkCompletion> {
        let h = self.held.front()?;
        if h.needs_message {
            if self.unmatched == 0 {
                return None;
            }
            self.unmatched -= 1;
        }
        self.held.pop_front().map(|h| h.wc)
    }

    /// Completions held back waiting for their message.
    pub fn waiting(&self) -> usize {
        self.held.iter().filter(|h| h.needs_message).count()
    }

    /// The virtual QP failed with `status`: the held immediates whose data
    /// never completed fail (the first with `status`, later ones flushed).
    /// With `report` and none of them, one completion with `status` and
    /// `wr_id` 0 is queued so that the receiver learns of the failure even
    /// without a receive in flight.
    ///
    /// The first `unmatched` held immediates are not failed: their messages
    /// finished (a whole CQ batch is routed before the QP is drained, so a
    /// message's last fragment and an unrelated error can come together),
    /// and they are released as they came.
    pub fn fail(&mut self, status: WcStatus, qp_num: u32, report: bool) {
        self.failed = true;
        let finished = usize::try_from(self.unmatched).unwrap_or(usize::MAX);
        let mut first = report;
        for h in self.held.iter_mut().filter(|h| h.needs_message).skip(finished) {
            h.needs_message = false;
            flush(&mut h.wc, if first { status } else { WcStatus::WrFlushErr });
            first = false;
        }
        if first {
            self.held.push_back(Held {
                wc: WorkCompletion {
                    wr_id: 0,
                    status,
                    opcode: WcOpcode::RecvRdmaWithImm,
                    byte_len: 0,
                    imm_data: None,
                    qp_num,
                    vendor_err: 0,
                },
                needs_message: false,
            });
        }
    }
}

/// Marks a held immediate failed: no data of its message is vouched for.
fn flush(wc: &mut WorkCompletion, status: WcStatus) {
    wc.status = status;
    wc.byte_len = 0;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wc(wr_id: u64, opcode: WcOpcode) -> WorkCompletion {
        WorkCompletion { wr_id, opcode, imm_data: Some(wr_id as u32), ..WorkCompletion::empty() }
    }

    #[test]
    fn immediates_wait_for_their_message_and_sends_keep_order() {
        let mut s = RecvSequencer::new();
        s.on_arrival(wc(1, WcOpcode::RecvRdmaWithImm), true);
        s.on_arrival(wc(2, WcOpcode::Recv), false);
        s.on_arrival(wc(3, WcOpcode::RecvRdmaWithImm), true);
        assert_eq!(s.poll(), None);
        s.on_message_finished();
        assert_eq!(s.poll().map(|w| w.wr_id), Some(1));
        assert_eq!(s.poll().map(|w| w.wr_id), Some(2));
        assert_eq!(s.poll(), None);
        // Data first, immediate later: released at once.
        s.on_message_finished();
        s.on_message_finished();
        assert_eq!(s.poll().map(|w| w.wr_id), Some(3));
        s.on_arrival(wc(4, WcOpcode::RecvRdmaWithImm), true);
        assert_eq!(s.poll().map(|w| w.wr_id), Some(4));
        assert_eq!(s.waiting(), 0);
    }

    #[test]
    fn failure_releases_held_immediates() {
        let mut s = RecvSequencer::new();
        s.on_arrival(wc(1, WcOpcode::RecvRdmaWithImm), true);
        s.on_arrival(wc(2, WcOpcode::RecvRdmaWithImm), true);
        s.fail(WcStatus::RespTimeoutErr, 9, true);
        assert_eq!(s.poll().map(|w| (w.wr_id, w.status)), Some((1, WcStatus::RespTimeoutErr)));
        assert_eq!(s.poll().map(|w| (w.wr_id, w.status)), Some((2, WcStatus::WrFlushErr)));
        s.fail(WcStatus::RespTimeoutErr, 9, true);
        assert_eq!(s.poll().map(|w| (w.wr_id, w.status, w.qp_num)), Some((0, WcStatus::RespTimeoutErr, 9)));
        s.fail(WcStatus::WrFlushErr, 9, false);
        assert_eq!(s.poll(), None);
    }

    /// `route` feeds a whole CQ batch before the virtual QP is drained: the
    /// last fragment of a message and an unrelated error in one batch must
    /// not cost the finished message its immediate.
    #[test]
    fn failure_spares_immediates_whose_message_finished() {
        let mut s = RecvSequencer::new();
        s.on_arrival(wc(1, WcOpcode::RecvRdmaWithImm), true);
        s.on_arrival(wc(2, WcOpcode::RecvRdmaWithImm), true);
        s.on_message_finished();
        s.fail(WcStatus::RespTimeoutErr, 9, true);
        assert_eq!(s.poll().map(|w| (w.wr_id, w.status, w.imm_data)), Some((1, WcStatus::Success, Some(1))));
        assert_eq!(s.poll().map(|w| (w.wr_id, w.status)), Some((2, WcStatus::RespTimeoutErr)));
        assert_eq!(s.poll(), None);

        // Nothing left to blame: the failure is reported on its own.
        let mut s = RecvSequencer::new();
        s.on_arrival(wc(1, WcOpcode::RecvRdmaWithImm), true);
        s.on_message_finished();
        s.fail(WcStatus::RespTimeoutErr, 9, true);
        assert_eq!(s.poll().map(|w| (w.wr_id, w.status)), Some((1, WcStatus::Success)));
        assert_eq!(s.poll().map(|w| (w.wr_id, w.status, w.qp_num)), Some((0, WcStatus::RespTimeoutErr, 9)));
        assert_eq!(s.poll(), None);
    }

    /// An immediate that reaches the sequencer after the failure (it was
    /// still in the CQ) is flushed unless its message finished first; it
    /// never holds up what is behind it.
    #[test]
    fn immediates_arriving_after_the_failure_do_not_wait() {
        let mut s = RecvSequencer::new();
        s.on_message_finished();
        s.fail(WcStatus::WrFlushErr, 9, false);
        assert_eq!(s.poll(), None);
        // Its message had finished: the data is all there.
        s.on_arrival(wc(1, WcOpcode::RecvRdmaWithImm), true);
        // Its message never finished, and now never will.
        s.on_arrival(wc(2, WcOpcode::RecvRdmaWithImm), true);
        s.on_arrival(WorkCompletion { status: WcStatus::WrFlushErr, ..wc(3, WcOpcode::Recv) }, false);
        assert_eq!(s.poll().map(|w| (w.wr_id, w.status)), Some((1, WcStatus::Success)));
        assert_eq!(s.poll().map(|w| (w.wr_id, w.status, w.byte_len)), Some((2, WcStatus::WrFlushErr, 0)));
        assert_eq!(s.poll().map(|w| (w.wr_id, w.status)), Some((3, WcStatus::WrFlushErr)));
        assert_eq!(s.poll(), None);
        assert_eq!(s.waiting(), 0);
    }
}
