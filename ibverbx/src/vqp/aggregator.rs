//! Completion aggregator: folds the completions of the physical WRs a
//! virtual send WR became into one virtual completion (sans-IO).
//!
//! Virtual completions leave in posting order: a finished WR waits behind
//! an unfinished earlier one. A virtual WR's status is its first error,
//! where a real error beats a flush (a flush is only the consequence of an
//! error elsewhere); the aggregator also remembers the virtual QP's first
//! error overall.

use std::collections::VecDeque;

use crate::{WcOpcode, WcStatus, WorkCompletion};

/// Which kind of physical WR completed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    /// A data fragment (or the whole WR on the control QP).
    Data,
    /// A control WR that follows the data (a notify or the immediate's side
    /// channel).
    Control,
}

#[derive(Debug)]
struct Entry {
    wr_id: u64,
    opcode: WcOpcode,
    byte_len: u32,
    signaled: bool,
    data_left: u32,
    ctrl_left: u32,
    status: Option<WcStatus>,
}

impl Entry {
    fn done(&self) -> bool {
        self.data_left == 0 && self.ctrl_left == 0
    }
}

/// The send-direction aggregator of one virtual QP.
#[derive(Debug)]
pub struct CompletionAggregator {
    qp_num: u32,
    head_id: u64,
    entries: VecDeque<Entry>,
    first_error: Option<WcStatus>,
}

impl CompletionAggregator {
    /// An aggregator whose completions carry `qp_num`.
    pub fn new(qp_num: u32) -> Self {
        CompletionAggregator { qp_num, head_id: 0, entries: VecDeque::new(), first_error: None }
    }

    /// Registers a virtual WR made of `data_parts` + `ctrl_parts` physical
    /// WRs (at least one in all); returns its id.
    pub fn begin(
        &mut self,
        wr_id: u64,
        opcode: WcOpcode,
        byte_len: u32,
        signaled: bool,
        data_parts: u32,
        ctrl_parts: u32,
    ) -> u64 {
        debug_assert!(data_parts + ctrl_parts > 0, "a virtual WR needs at least one physical WR");
        let id = self.head_id + self.entries.len() as u64;
        self.entries.push_back(Entry {
            wr_id,
            opcode,
            byte_len,
            signaled,
            data_left: data_parts,
            ctrl_left: ctrl_parts,
            status: None,
        });
        id
    }

    fn entry(&mut self, id: u64) -> Option<&mut Entry> {
        let i = id.checked_sub(self.head_id)?;
        self.entries.get_mut(usize::try_from(i).ok()?)
    }

    /// One physical WR of virtual WR `id` finished with `status`.
    pub fn complete(&mut self, id: u64, part: Part, status: WcStatus) {
        if status != WcStatus::Success {
            match self.first_error {
                None => self.first_error = Some(status),
                Some(WcStatus::WrFlushErr) if status != WcStatus::WrFlushErr => self.first_error = Some(status),
                _ => {}
            }
        }
        let Some(e) = self.entry(id) else {
            debug_assert!(false, "completion for unknown virtual WR {id}");
            return;
        };
        let left = match part {
            Part::Data => &mut e.data_left,
            Part::Control => &mut e.ctrl_left,
        };
        debug_assert!(*left > 0, "more completions than physical WRs for virtual WR {id}");
        *left = left.saturating_sub(1);
        if status != WcStatus::Success {
            match e.status {
                None => e.status = Some(status),
                Some(WcStatus::WrFlushErr) if status != WcStatus::WrFlushErr => e.status = Some(status),
                _ => {}
            }
        }
    }

    /// Whether every data part of `id` has completed successfully (spray's
    /// notify gate). A retired WR counts as open.
    pub fn data_done(&self, id: u64) -> bool {
        match id.checked_sub(self.head_id).and_then(|i| self.entries.get(i as usize)) {
            Some(e) => e.data_left == 0 && e.status.is_none(),
            None => true,
        }
    }

    /// The next virtual completion, in posting order. Unsignaled WRs that
    /// succeeded retire silently.
    pub fn poll(&mut self) -> Option<WorkCompletion> {
        while self.entries.front().is_some_and(Entry::done) {
            let e = self.entries.pop_front().expect("front exists");
            self.head_id += 1;
            let status = e.status.unwrap_or(WcStatus::Success);
            if e.signaled || status != WcStatus::Success {
                return Some(WorkCompletion {
                    wr_id: e.wr_id,
                    status,
                    opcode: e.opcode,
                    byte_len: if status == WcStatus::Success { e.byte_len } else { 0 },
                    imm_data: None,
                    qp_num: self.qp_num,
                    vendor_err: 0,
                });
            }
        }
        None
    }

    /// Virtual WRs not yet retired.
    pub fn outstanding(&self) -> usize {
        self.entries.len()
    }

    /// The first error any physical WR reported (a real error preferred
    /// over a flush).
    pub fn first_error(&self) -> Option<WcStatus> {
        self.first_error
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn posting_order_and_unsignaled() {
        let mut a = CompletionAggregator::new(7);
        let x = a.begin(10, WcOpcode::RdmaWrite, 100, true, 3, 0);
        let y = a.begin(11, WcOpcode::RdmaWrite, 5, false, 1, 0);
        let z = a.begin(12, WcOpcode::RdmaRead, 50, true, 2, 0);
        a.complete(z, Part::Data, WcStatus::Success);
        a.complete(z, Part::Data, WcStatus::Success);
        a.complete(y, Part::Data, WcStatus::Success);
        assert_eq!(a.poll(), None, "x is not done: nothing may overtake it");
        a.complete(x, Part::Data, WcStatus::Success);
        a.complete(x, Part::Data, WcStatus::Success);
        assert_eq!(a.poll(), None);
        a.complete(x, Part::Data, WcStatus::Success);
        let w = a.poll().unwrap();
        assert_eq!((w.wr_id, w.byte_len, w.qp_num, w.status), (10, 100, 7, WcStatus::Success));
        let w = a.poll().unwrap();
        assert_eq!((w.wr_id, w.opcode), (12, WcOpcode::RdmaRead));
        assert_eq!(a.poll(), None);
        assert_eq!(a.outstanding(), 0);
    }

    #[test]
    fn first_error_wins_and_real_errors_beat_flushes() {
        let mut a = CompletionAggregator::new(1);
        let x = a.begin(1, WcOpcode::RdmaWrite, 10, false, 3, 1);
        let y = a.begin(2, WcOpcode::RdmaWrite, 10, false, 1, 0);
        assert!(!a.data_done(x));
        a.complete(x, Part::Data, WcStatus::WrFlushErr);
        a.complete(x, Part::Data, WcStatus::RemAccessErr);
        a.complete(x, Part::Data, WcStatus::RetryExcErr);
        assert!(!a.data_done(x), "a failed WR never opens its notify gate");
        a.complete(x, Part::Control, WcStatus::WrFlushErr);
        a.complete(y, Part::Data, WcStatus::WrFlushErr);
        assert_eq!(a.first_error(), Some(WcStatus::RemAccessErr));
        let w = a.poll().unwrap();
        assert_eq!((w.wr_id, w.status, w.byte_len), (1, WcStatus::RemAccessErr, 0));
        assert_eq!(a.poll().unwrap().status, WcStatus::WrFlushErr, "errors are reported even when unsignaled");
    }

    #[test]
    fn spray_gate_opens_after_data() {
        let mut a = CompletionAggregator::new(1);
        let x = a.begin(1, WcOpcode::RdmaWrite, 10, true, 2, 1);
        a.complete(x, Part::Data, WcStatus::Success);
        assert!(!a.data_done(x));
        a.complete(x, Part::Data, WcStatus::Success);
        assert!(a.data_done(x));
        assert_eq!(a.poll(), None, "the notify is still outstanding");
        a.complete(x, Part::Control, WcStatus::Success);
        assert!(a.poll().is_some());
        assert!(a.data_done(x), "retired WRs count as open");
    }

    proptest! {
        /// Physical completions in any order give virtual completions once
        /// each, in posting order.
        #[test]
        fn any_completion_order(parts in proptest::collection::vec(1u32..5, 1..30), seed in any::<u64>()) {
            let mut a = CompletionAggregator::new(0);
            let mut phys = Vec::new();
            for (i, &n) in parts.iter().enumerate() {
                let id = a.begin(i as u64, WcOpcode::RdmaWrite, n, true, n, 0);
                phys.extend((0..n).map(|_| id));
            }
            let mut x = seed | 1;
            let mut out = Vec::new();
            while !phys.is_empty() {
                x ^= x << 13; x ^= x >> 7; x ^= x << 17;
                let id = phys.swap_remove((x as usize) % phys.len());
                a.complete(id, Part::Data, WcStatus::Success);
                out.extend(std::iter::from_fn(|| a.poll()));
            }
            prop_assert_eq!(out.iter().map(|w| w.wr_id).collect::<Vec<_>>(), (0..parts.len() as u64).collect::<Vec<_>>());
            prop_assert!(out.iter().zip(&parts).all(|(w, &n)| w.byte_len == n));
        }
    }
}
