//! Fragment planner: cuts a virtual work request into fragments and decides
//! which physical QP carries each one (sans-IO).
//!
//! Two FIFO lanes feed the physical QPs. The **data** lane holds fragments
//! that may go to any data QP: each is posted round-robin on the next data
//! QP with room (fewer than `max_per_qp` WRs outstanding). The **control**
//! lane holds WRs pinned to one QP (notifies, SENDs, atomics, and with a
//! single QP everything), in order; its head may wait for a *gate* (spray:
//! "all fragments of virtual WR n have completed") without holding up the
//! data lane. What finds no room stays queued until [`complete`]
//! frees some.
//!
//! [`complete`]: FragmentPlanner::complete

use std::collections::VecDeque;

/// One piece of a message: `len` bytes at `offset` from its start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fragment {
    /// Offset from the start of the message.
    pub offset: u64,
    /// Length in bytes.
    pub len: u32,
}

/// Cuts `len` bytes into fragments of at most `max` bytes, in order. An
/// empty message is one empty fragment (it still has to travel, e.g. to
/// carry an immediate).
pub fn fragments(len: u64, max: u32) -> impl Iterator<Item = Fragment> {
    let max = max.max(1) as u64;
    let count = if len == 0 { 1 } else { len.div_ceil(max) };
    (0..count).map(move |i| {
        let offset = i * max;
        Fragment { offset, len: (len - offset).min(max) as u32 }
    })
}

/// Which lane an operation waits in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lane {
    /// Any data QP with room.
    Data,
    /// The control QP, in order.
    Control,
}

/// The planner. `T` is whatever the driver needs to post an operation.
#[derive(Debug)]
pub struct FragmentPlanner<T> {
    max_per_qp: u32,
    control_max: u32,
    outstanding: Vec<u32>,
    n_data: usize,
    control: usize,
    rr: usize,
    data: VecDeque<T>,
    ctrl: VecDeque<(T, Option<u64>)>,
}

impl<T> FragmentPlanner<T> {
    /// A planner over `n_data` data QPs (indices `0..n_data`). With
    /// `separate_control` the control QP is index `n_data`, else it is data
    /// QP 0. At most `max_per_qp` operations are outstanding per QP.
    pub fn new(n_data: usize, separate_control: bool, max_per_qp: u32) -> Self {
        assert!(n_data > 0 && max_per_qp > 0, "a planner needs at least one QP and a window of one");
        let total = n_data + usize::from(separate_control);
        FragmentPlanner {
            max_per_qp,
            control_max: max_per_qp,
            outstanding: vec![0; total],
            n_data,
            control: if separate_control { n_data } else { 0 },
            rr: 0,
            data: VecDeque::new(),
            ctrl: VecDeque::new(),
        }
    }

    /// Limits the control QP to `n` outstanding operations (at least 1).
    pub fn with_control_window(mut self, n: u32) -> Self {
        self.control_max = n.max(1);
        self
    }

    /// Index of the control QP.
    pub fn control_qp(&self) -> usize {
        self.control
    }

    /// Queues a fragment for any data QP.
    pub fn push_data(&mut self, op: T) {
        self.data.push_back(op);
    }

    /// Queues an operation for the control QP. With `gate: Some(n)` it (and
    /// everything behind it in the control lane) waits until the driver's
    /// `gate_open(n)` says yes.
    pub fn push_control(&mut self, op: T, gate: Option<u64>) {
        self.ctrl.push_back((op, gate));
    }

    /// Whether an operation pushed on `lane` now would be posted by the next
    /// call to [`next`](Self::next) (nothing queued ahead of it, and room).
    pub fn can_post_now(&self, lane: Lane) -> bool {
        match lane {
            Lane::Control => self.ctrl.is_empty() && self.outstanding[self.control] < self.control_max,
            Lane::Data => self.data.is_empty() && self.outstanding[..self.n_data].iter().any(|&o| o < self.max_per_qp),
        }
    }

    /// The next operation to post and the QP to post it on, or `None` when
    /// nothing queued can go now. The caller posts it and later reports its
    /// completion with [`complete`](Self::complete).
    pub fn next(&mut self, mut gate_open: impl FnMut(u64) -> bool) -> Option<(usize, T)> {
        if let Some((_, gate)) = self.ctrl.front() {
            let open = match gate {
                None => true,
                Some(g) => gate_open(*g),
            };
            if open && self.outstanding[self.control] < self.control_max {
                let (op, _) = self.ctrl.pop_front().expect("front exists");
                self.outstanding[self.control] += 1;
                return Some((self.control, op));
            }
        }
        if !self.data.is_empty() {
            for k in 0..self.n_data {
                let qp = (self.rr + k) % self.n_data;
                if self.outstanding[qp] < self.max_per_qp {
                    let op = self.data.pop_front().expect("not empty");
                    self.outstanding[qp] += 1;
                    self.rr = (qp + 1) % self.n_data;
                    return Some((qp, op));
                }
            }
        }
        None
    }

    /// An operation posted on `qp` has completed (successfully or not).
    pub fn complete(&mut self, qp: usize) {
        debug_assert!(self.outstanding[qp] > 0, "completion on QP {qp} with nothing outstanding");
        self.outstanding[qp] = self.outstanding[qp].saturating_sub(1);
    }

    /// Operations outstanding on `qp`.
    pub fn outstanding(&self, qp: usize) -> u32 {
        self.outstanding[qp]
    }

    /// Operations queued in both lanes.
    pub fn pending(&self) -> usize {
        self.data.len() + self.ctrl.len()
    }

    /// Removes every queued operation (the QP is going to the error state).
    pub fn drain(&mut self) -> Vec<T> {
        let mut v: Vec<T> = self.data.drain(..).collect();
        v.extend(self.ctrl.drain(..).map(|(op, _)| op));
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn control_window_limits_only_the_control_lane() {
        let mut p = FragmentPlanner::new(2, true, 4).with_control_window(1);
        for i in 0..3 {
            p.push_control(i, None);
            p.push_data(10 + i);
        }
        // One control op goes; the others wait for its completion while data flows.
        let mut posted = Vec::new();
        while let Some((qp, op)) = p.next(|_| true) {
            posted.push((qp, op));
        }
        assert_eq!(posted.iter().filter(|(qp, _)| *qp == 2).count(), 1);
        assert_eq!(posted.iter().filter(|(qp, _)| *qp < 2).count(), 3);
        p.complete(2);
        assert_eq!(p.next(|_| true), Some((2, 1)));
    }

    #[test]
    fn fragments_cover_the_message() {
        assert_eq!(fragments(0, 10).collect::<Vec<_>>(), vec![Fragment { offset: 0, len: 0 }]);
        assert_eq!(fragments(10, 10).count(), 1);
        let f: Vec<_> = fragments(25, 10).collect();
        assert_eq!(
            f,
            vec![Fragment { offset: 0, len: 10 }, Fragment { offset: 10, len: 10 }, Fragment { offset: 20, len: 5 }]
        );
    }

    #[test]
    fn round_robin_over_qps_with_room() {
        let mut p = FragmentPlanner::new(3, true, 2);
        for i in 0..10 {
            p.push_data(i);
        }
        let mut got = Vec::new();
        while let Some((qp, op)) = p.next(|_| true) {
            got.push((qp, op));
        }
        assert_eq!(got, vec![(0, 0), (1, 1), (2, 2), (0, 3), (1, 4), (2, 5)]);
        assert_eq!(p.pending(), 4);
        p.complete(1);
        assert_eq!(p.next(|_| true), Some((1, 6)));
        assert_eq!(p.next(|_| true), None);
        p.complete(2);
        p.complete(0);
        // Round-robin resumes after the last QP used (1): 2 first, then 0.
        assert_eq!(p.next(|_| true), Some((2, 7)));
        assert_eq!(p.next(|_| true), Some((0, 8)));
        assert_eq!(p.drain(), vec![9]);
    }

    #[test]
    fn gated_control_waits_without_blocking_data() {
        let mut p = FragmentPlanner::new(2, true, 4);
        p.push_control("notify-1", Some(1));
        p.push_control("send", None);
        p.push_data("frag");
        assert_eq!(p.next(|_| false), Some((0, "frag")));
        assert_eq!(p.next(|_| false), None);
        assert_eq!(p.next(|g| g == 1), Some((2, "notify-1")));
        assert_eq!(p.next(|_| false), Some((2, "send")));
    }

    #[test]
    fn shared_control_qp_counts_against_qp0() {
        let mut p = FragmentPlanner::new(1, false, 1);
        p.push_control('a', None);
        p.push_control('b', None);
        assert!(!p.can_post_now(Lane::Control));
        assert_eq!(p.next(|_| true), Some((0, 'a')));
        assert_eq!(p.next(|_| true), None);
        p.complete(0);
        assert_eq!(p.next(|_| true), Some((0, 'b')));
    }

    proptest! {
        /// Whatever the interleaving of completions, no QP ever exceeds its
        /// window, every fragment is posted exactly once and in FIFO order.
        #[test]
        fn window_and_fifo_hold(n_data in 1usize..6, max in 1u32..5, n_ops in 0usize..60,
                                picks in proptest::collection::vec(0usize..64, 0..200)) {
            let mut p = FragmentPlanner::new(n_data, n_data > 1, max);
            for i in 0..n_ops {
                p.push_data(i);
            }
            let mut inflight: Vec<usize> = Vec::new();
            let mut posted = Vec::new();
            let mut picks = picks.into_iter();
            loop {
                while let Some((qp, op)) = p.next(|_| true) {
                    prop_assert!(qp < n_data);
                    prop_assert!(p.outstanding(qp) <= max);
                    posted.push(op);
                    inflight.push(qp);
                }
                if inflight.is_empty() {
                    break;
                }
                let k = picks.next().unwrap_or(0) % inflight.len();
                p.complete(inflight.swap_remove(k));
            }
            prop_assert_eq!(posted, (0..n_ops).collect::<Vec<_>>());
        }

        #[test]
        fn fragments_partition(len in 0u64..100_000, max in 1u32..5000) {
            let mut next = 0;
            for f in fragments(len, max) {
                prop_assert_eq!(f.offset, next);
                prop_assert!(f.len <= max);
                prop_assert!(f.len > 0 || len == 0);
                next += f.len as u64;
            }
            prop_assert_eq!(next, len);
        }
    }
}
