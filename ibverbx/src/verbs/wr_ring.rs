//! The per-queue record of posted WRs: what each completion maps back to,
//! and the memory regions each WR keeps alive until then.
//!
//! The provider gives the HCA its own `wr_id` — a sequence number, with the
//! top bit marking receive queues — and keeps the user's `wr_id`, the
//! opcode and `Arc`s of the named regions in a slot. An RC queue completes
//! in order, so a completion for sequence `s` also retires every older unsignaled slot
//! (unsignaled WRs produce no completion of their own). Sans-IO: the types
//! of the kept values are generic so tests use plain ones.

use std::collections::VecDeque;

use crate::wc::WcOpcode;

/// Bit 63 of a hardware `wr_id`: the WR was posted to the receive queue.
pub(crate) const RECV_BIT: u64 = 1 << 63;

/// One posted WR.
#[derive(Debug)]
pub(crate) struct Slot<K> {
    pub(crate) seq: u64,
    /// The caller's `wr_id`.
    pub(crate) wr_id: u64,
    /// What a completion of this WR reports (hardware leaves the opcode
    /// undefined in error completions).
    pub(crate) opcode: WcOpcode,
    /// Whether the WR will produce a completion (counted against the CQ).
    pub(crate) counted: bool,
    /// Values kept alive until the WR completes.
    pub(crate) _keep: Vec<K>,
}

/// The slots of one queue, in posting order.
#[derive(Debug)]
pub(crate) struct WrRing<K> {
    next_seq: u64,
    recv: bool,
    slots: VecDeque<Slot<K>>,
}

impl<K> WrRing<K> {
    pub(crate) fn new(recv: bool) -> Self {
        WrRing { next_seq: 0, recv, slots: VecDeque::new() }
    }

    /// WRs posted and not yet retired.
    pub(crate) fn len(&self) -> usize {
        self.slots.len()
    }

    /// Records a WR; returns the hardware `wr_id` to post it with.
    pub(crate) fn push(&mut self, wr_id: u64, opcode: WcOpcode, counted: bool, keep: Vec<K>) -> u64 {
        let seq = self.next_seq;
        self.next_seq = (self.next_seq + 1) & !RECV_BIT;
        self.slots.push_back(Slot { seq, wr_id, opcode, counted, _keep: keep });
        if self.recv {
            seq | RECV_BIT
        } else {
            seq
        }
    }

    /// Retires the slot of hardware `wr_id` and every older uncounted one
    /// (they produce no completion of their own). Returns the slot and how
    /// many counted slots were retired (it, or none), or `None` for a
    /// `wr_id` this ring does not hold (a completion of a previous life of
    /// the QP).
    ///
    /// An older *counted* slot stays: its completion came first but is
    /// being translated by another thread polling the same CQ (the CQ is
    /// polled without a lock around the translation). Retiring it here lost
    /// that completion.
    pub(crate) fn complete(&mut self, hw_wr_id: u64) -> Option<(Slot<K>, usize)> {
        if (hw_wr_id & RECV_BIT != 0) != self.recv {
            return None;
        }
        let seq = hw_wr_id & !RECV_BIT;
        let pos = self.slots.iter().position(|s| s.seq == seq)?;
        let mut i = 0;
        self.slots.retain(|s| {
            i += 1;
            i > pos || s.counted
        });
        let pos = self.slots.iter().position(|s| s.seq == seq)?;
        let slot = self.slots.remove(pos)?;
        let counted = slot.counted as usize;
        Some((slot, counted))
    }

    /// Forgets the WRs from hardware `wr_id` on (they were not posted: the
    /// HCA refused them); returns how many of them were counted.
    pub(crate) fn unpost_from(&mut self, hw_wr_id: u64) -> usize {
        let seq = hw_wr_id & !RECV_BIT;
        let Some(pos) = self.slots.iter().position(|s| s.seq == seq) else { return 0 };
        let counted = self.slots.iter().skip(pos).filter(|s| s.counted).count();
        self.slots.truncate(pos);
        self.next_seq = seq;
        counted
    }

    /// Drops every slot (QP reset or destroyed); returns how many were counted.
    pub(crate) fn clear(&mut self) -> usize {
        let counted = self.slots.iter().filter(|s| s.counted).count();
        self.slots.clear();
        counted
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    #[test]
    fn completion_retires_older_unsignaled_slots_and_their_keepalives() {
        let mem = Arc::new(());
        let mut r = WrRing::new(false);
        let a = r.push(10, WcOpcode::RdmaWrite, false, vec![mem.clone()]);
        let b = r.push(11, WcOpcode::RdmaWrite, false, vec![mem.clone()]);
        let c = r.push(12, WcOpcode::Send, true, vec![mem.clone()]);
        assert_eq!((a, b, c), (0, 1, 2));
        assert_eq!(Arc::strong_count(&mem), 4);
        let (slot, counted) = r.complete(c).unwrap();
        assert_eq!((slot.wr_id, slot.opcode, counted), (12, WcOpcode::Send, 1));
        drop(slot);
        assert_eq!(Arc::strong_count(&mem), 1, "every retired WR let go of the region");
        assert_eq!(r.len(), 0);
        assert!(r.complete(c).is_none(), "a stale completion maps to nothing");
    }

    #[test]
    fn an_older_signaled_wr_completed_after_a_newer_one_is_still_found() {
        // Two threads polling one CQ: thread 1 took A's completion, thread
        // 2 took B's and translated it first. A must still map to its slot.
        let mut r: WrRing<()> = WrRing::new(false);
        let u = r.push(9, WcOpcode::RdmaWrite, false, vec![]);
        let a = r.push(10, WcOpcode::RdmaWrite, true, vec![]);
        let v = r.push(11, WcOpcode::RdmaWrite, false, vec![]);
        let b = r.push(12, WcOpcode::Send, true, vec![]);
        let (slot, counted) = r.complete(b).unwrap();
        assert_eq!((slot.wr_id, counted), (12, 1));
        let (slot, counted) = r.complete(a).unwrap();
        assert_eq!((slot.wr_id, counted), (10, 1));
        assert_eq!(r.len(), 0, "the unsignaled WRs before B retired with it");
        assert!(r.complete(u).is_none() && r.complete(v).is_none());
    }

    #[test]
    fn receive_ids_carry_the_recv_bit() {
        let mut r: WrRing<()> = WrRing::new(true);
        let id = r.push(7, WcOpcode::Recv, true, vec![]);
        assert_eq!(id, RECV_BIT);
        assert!(r.complete(0).is_none(), "a send id never matches a receive ring");
        assert_eq!(r.complete(id).unwrap().0.wr_id, 7);
    }

    #[test]
    fn refused_wrs_are_forgotten_and_their_sequence_reused() {
        let mut r: WrRing<()> = WrRing::new(false);
        r.push(1, WcOpcode::Send, true, vec![]);
        let bad = r.push(2, WcOpcode::Send, true, vec![]);
        r.push(3, WcOpcode::Send, false, vec![]);
        assert_eq!(r.unpost_from(bad), 1);
        assert_eq!(r.len(), 1);
        assert_eq!(r.push(4, WcOpcode::Send, true, vec![]), bad);
        assert_eq!(r.clear(), 2);
        assert_eq!(r.len(), 0);
    }
}
