//! DQPLB immediates and the receiver's sequence tracker (sans-IO).
//!
//! Every DQPLB fragment is an RDMA_WRITE_WITH_IMM whose immediate is
//!
//! ```text
//!  31   30   29..24     23..0
//! LAST USER  reserved   sequence number (wrapping at 2^24)
//! ```
//!
//! `LAST` marks the last fragment of a message; `USER` says the message was
//! the application's RDMA_WRITE_WITH_IMM (its immediate travels on the
//! notify QP, see [`VirtualQp`](crate::VirtualQp)), clear for a plain WRITE.
//! Sequence numbers are consecutive over *all* fragments of all messages,
//! plain or not, so the tracker never waits for a number that will not
//! come — mixing WRITE and WRITE_WITH_IMM cannot stall it.
//!
//! The tracker records arrivals in a window starting at the next expected
//! number, advances over the contiguous run and reports each message whose
//! last fragment it passed, in order, whatever order the fragments arrived
//! in. A hole that persists for `timeout` while later fragments wait is
//! reported as lost rather than waited on forever.

use std::collections::btree_map::Entry;
use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

/// Bits of the sequence number.
pub const SEQ_BITS: u32 = 24;
/// Mask of the sequence number.
pub const SEQ_MASK: u32 = (1 << SEQ_BITS) - 1;
/// Last fragment of a message.
pub const LAST_BIT: u32 = 1 << 31;
/// The message is the application's WRITE_WITH_IMM.
pub const USER_BIT: u32 = 1 << 30;
const RESERVED: u32 = !(SEQ_MASK | LAST_BIT | USER_BIT);

/// A decoded DQPLB immediate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DqplbImm {
    /// Sequence number (24 bits).
    pub seq: u32,
    /// Last fragment of its message.
    pub last: bool,
    /// The message carries the application's immediate.
    pub user: bool,
}

impl DqplbImm {
    /// The 32-bit immediate.
    pub fn encode(self) -> u32 {
        (self.seq & SEQ_MASK) | if self.last { LAST_BIT } else { 0 } | if self.user { USER_BIT } else { 0 }
    }

    /// Parses an immediate; reserved bits must be zero.
    pub fn decode(imm: u32) -> Result<DqplbImm, TrackerError> {
        if imm & RESERVED != 0 {
            return Err(TrackerError::Malformed { imm });
        }
        Ok(DqplbImm { seq: imm & SEQ_MASK, last: imm & LAST_BIT != 0, user: imm & USER_BIT != 0 })
    }
}

/// The next sequence number after `seq`.
pub fn next_seq(seq: u32) -> u32 {
    seq.wrapping_add(1) & SEQ_MASK
}

/// What the tracker found wrong. Each is fatal for the virtual QP.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TrackerError {
    /// Reserved immediate bits were set: the peer does not speak DQPLB.
    #[error("immediate {imm:#010x} is not a DQPLB immediate (reserved bits set); do both ends use DQPLB?")]
    Malformed {
        /// The immediate.
        imm: u32,
    },
    /// The sequence number was seen already.
    #[error("DQPLB sequence number {seq} arrived twice")]
    Duplicate {
        /// The number.
        seq: u32,
    },
    /// The sequence number is further ahead than the sender's window allows.
    #[error("DQPLB sequence number {seq} is outside the window of {window} after {expected}")]
    OutOfWindow {
        /// The number.
        seq: u32,
        /// The next number expected.
        expected: u32,
        /// The window.
        window: usize,
    },
    /// A fragment is missing while later ones wait.
    #[error(
        "DQPLB fragment {expected} did not arrive within {waited:?} while {held} later fragment(s) waited; it was lost"
    )]
    Timeout {
        /// The missing number.
        expected: u32,
        /// How long the hole persisted.
        waited: Duration,
        /// Later fragments held.
        held: usize,
    },
}

/// A message whose fragments have all arrived.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FinishedMessage {
    /// The message carries the application's immediate (USER bit).
    pub user: bool,
    /// Bytes of all its fragments.
    pub bytes: u64,
    /// Sequence number of its last fragment.
    pub last_seq: u32,
}

#[derive(Debug, Clone, Copy)]
struct Slot {
    len: u32,
    last: bool,
    user: bool,
}

/// How far ahead (in fragments) an arrival is kept in the dense window.
const NEAR: usize = 4096;

/// The receiver's reorder state for one virtual QP direction.
#[derive(Debug)]
pub struct SeqTracker {
    expected: u32,
    /// How many sequence numbers the run has passed (`expected` unwrapped).
    base: u64,
    /// Fragments beyond a hole less than [`NEAR`] ahead, by distance: the
    /// dense window where reordering happens (cheap to index).
    near: VecDeque<Option<Slot>>,
    /// How many of `near` are held.
    near_held: usize,
    /// Fragments further ahead, by unwrapped sequence number: sparse, so
    /// memory follows the fragments held, not how far ahead one claims to
    /// be (a dense window sized by one arrival 2^23 ahead was 64 MiB, kept
    /// for the life of the transport). Moved into `near` as the run nears.
    far: BTreeMap<u64, Slot>,
    max_window: usize,
    msg_bytes: u64,
    finished: VecDeque<FinishedMessage>,
    gap_since: Option<Instant>,
    timeout: Duration,
}

impl SeqTracker {
    /// A tracker expecting `initial_seq` first. `max_window` bounds how far
    /// ahead an arrival may be (the sender's outstanding fragments at most);
    /// `timeout` is how long a hole may persist.
    pub fn new(initial_seq: u32, max_window: usize, timeout: Duration) -> Self {
        SeqTracker {
            expected: initial_seq & SEQ_MASK,
            base: 0,
            near: VecDeque::new(),
            near_held: 0,
            far: BTreeMap::new(),
            max_window: max_window.clamp(1, 1 << (SEQ_BITS - 1)),
            msg_bytes: 0,
            finished: VecDeque::new(),
            gap_since: None,
            timeout,
        }
    }

    /// The next sequence number the contiguous run waits for.
    pub fn expected(&self) -> u32 {
        self.expected
    }

    /// Fragments received beyond a hole.
    pub fn held(&self) -> usize {
        self.near_held + self.far.len()
    }

    /// Records the arrival of a fragment with immediate `imm` and `len`
    /// bytes at `now`, and advances over the contiguous run.
    pub fn on_arrival(&mut self, imm: u32, len: u32, now: Instant) -> Result<(), TrackerError> {
        let d = DqplbImm::decode(imm)?;
        let dist = (d.seq.wrapping_sub(self.expected) & SEQ_MASK) as usize;
        if dist >= self.max_window {
            return Err(TrackerError::OutOfWindow { seq: d.seq, expected: self.expected, window: self.max_window });
        }
        let slot = Slot { len, last: d.last, user: d.user };
        if dist == 0 && self.held() == 0 {
            // In order, nothing held (the common case): straight through.
            self.pass(slot);
            self.gap_since = None;
            return Ok(());
        }
        if dist < NEAR {
            if self.near.len() <= dist {
                self.near.resize(dist + 1, None);
            }
            if self.near[dist].is_some() {
                return Err(TrackerError::Duplicate { seq: d.seq });
            }
            self.near[dist] = Some(slot);
            self.near_held += 1;
        } else {
            match self.far.entry(self.base + dist as u64) {
                Entry::Occupied(_) => return Err(TrackerError::Duplicate { seq: d.seq }),
                Entry::Vacant(v) => {
                    v.insert(slot);
                }
            }
        }
        let advanced = self.advance();
        if self.held() == 0 {
            self.gap_since = None;
        } else if advanced || self.gap_since.is_none() {
            self.gap_since = Some(now);
        }
        Ok(())
    }

    fn advance(&mut self) -> bool {
        let mut moved = false;
        loop {
            let mut step = false;
            while let Some(Some(slot)) = self.near.front().copied() {
                self.near.pop_front();
                self.near_held -= 1;
                step = true;
                self.pass(slot);
            }
            if !step {
                return moved;
            }
            moved = true;
            // Far fragments the run has come near to (they may continue it).
            while let Some(e) = self.far.first_entry().filter(|e| *e.key() - self.base < NEAR as u64) {
                let dist = (*e.key() - self.base) as usize;
                let slot = e.remove();
                if self.near.len() <= dist {
                    self.near.resize(dist + 1, None);
                }
                self.near[dist] = Some(slot);
                self.near_held += 1;
            }
        }
    }

    /// The run passes `slot`, the fragment it expected.
    fn pass(&mut self, slot: Slot) {
        self.msg_bytes += slot.len as u64;
        if slot.last {
            self.finished.push_back(FinishedMessage {
                user: slot.user,
                bytes: self.msg_bytes,
                last_seq: self.expected,
            });
            self.msg_bytes = 0;
        }
        self.expected = next_seq(self.expected);
        self.base += 1;
    }

    /// The next finished message, in sequence order.
    pub fn poll_finished(&mut self) -> Option<FinishedMessage> {
        self.finished.pop_front()
    }

    /// When [`check`](Self::check) would fail if nothing arrives, if a hole
    /// is open (and the timeout is one the clock can count).
    pub fn deadline(&self) -> Option<Instant> {
        self.gap_since.and_then(|t| t.checked_add(self.timeout))
    }

    /// Fails when a hole has persisted for the timeout at `now`.
    pub fn check(&self, now: Instant) -> Result<(), TrackerError> {
        match self.gap_since {
            Some(t) if now.saturating_duration_since(t) >= self.timeout => Err(TrackerError::Timeout {
                expected: self.expected,
                waited: now.saturating_duration_since(t),
                held: self.held(),
            }),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The immediates of a run of messages: `sizes[i]` fragments each,
    /// message i carrying the USER bit when `user[i]`.
    fn imms(start: u32, sizes: &[usize], user: &[bool]) -> Vec<u32> {
        let mut seq = start;
        let mut v = Vec::new();
        for (i, &n) in sizes.iter().enumerate() {
            for k in 0..n {
                v.push(DqplbImm { seq, last: k + 1 == n, user: user[i] }.encode());
                seq = next_seq(seq);
            }
        }
        v
    }

    fn run(t: &mut SeqTracker, order: &[u32]) -> Vec<FinishedMessage> {
        let now = Instant::now();
        let mut out = Vec::new();
        for &imm in order {
            t.on_arrival(imm, 10, now).unwrap();
            while let Some(m) = t.poll_finished() {
                out.push(m);
            }
        }
        out
    }

    /// One arrival as far ahead as the window allows holds one slot: the
    /// dense window it replaced grew to 2^23 slots (64 MiB) for it, and kept
    /// that capacity for the life of the transport.
    #[test]
    fn a_far_arrival_holds_one_slot() {
        let far = (1u32 << 23) - 1;
        let mut t = SeqTracker::new(0, 1 << 23, Duration::from_secs(1));
        let now = Instant::now();
        t.on_arrival(DqplbImm { seq: far, last: true, user: true }.encode(), 1, now).unwrap();
        assert_eq!((t.held(), t.far.len(), t.near.len()), (1, 1, 0));
        assert_eq!(
            t.on_arrival(DqplbImm { seq: far, last: true, user: true }.encode(), 1, now),
            Err(TrackerError::Duplicate { seq: far })
        );
        assert!(matches!(
            t.on_arrival(DqplbImm { seq: 1 << 23, last: true, user: true }.encode(), 1, now),
            Err(TrackerError::OutOfWindow { .. })
        ));
        // The run still completes through it.
        for seq in 0..far {
            t.on_arrival(DqplbImm { seq, last: false, user: false }.encode(), 1, now).unwrap();
        }
        assert_eq!(t.held(), 0);
        assert_eq!(t.poll_finished().map(|m| (m.user, m.bytes, m.last_seq)), Some((true, far as u64 + 1, far)));
        assert_eq!(t.expected(), far + 1);
    }

    /// Fragments on both sides of the dense window's edge, in reverse: each
    /// is kept once, where it belongs, and the run passes all of them in
    /// order (far ones moving into the dense window as the run nears).
    #[test]
    fn far_and_near_arrivals_interleave() {
        let n = (NEAR as u32) * 2 + 7;
        let mut t = SeqTracker::new(0, 1 << 20, Duration::from_secs(1));
        let now = Instant::now();
        let order: Vec<u32> = (0..n).rev().collect();
        for &seq in &order {
            t.on_arrival(DqplbImm { seq, last: true, user: seq % 2 == 0 }.encode(), seq, now).unwrap();
            if seq > 0 {
                assert_eq!(t.held(), (n - seq) as usize);
                assert_eq!(t.poll_finished(), None);
            }
        }
        let got: Vec<_> = std::iter::from_fn(|| t.poll_finished()).collect();
        assert_eq!(got.len(), n as usize);
        assert!(got.iter().enumerate().all(|(i, m)| m.last_seq == i as u32 && m.bytes == i as u64));
        assert_eq!((t.held(), t.near.len(), t.far.len()), (0, 0, 0));
    }

    #[test]
    fn encode_decode() {
        let i = DqplbImm { seq: 0xabcdef, last: true, user: false };
        assert_eq!(i.encode(), 0x80ab_cdef);
        assert_eq!(DqplbImm::decode(0x80ab_cdef).unwrap(), i);
        assert_eq!(DqplbImm::decode(0x0100_0000), Err(TrackerError::Malformed { imm: 0x0100_0000 }));
    }

    #[test]
    fn in_order_and_reversed() {
        let v = imms(0, &[3, 1, 2], &[true, false, true]);
        let mut t = SeqTracker::new(0, 64, Duration::from_secs(1));
        let got = run(&mut t, &v);
        assert_eq!(
            got.iter().map(|m| (m.user, m.bytes)).collect::<Vec<_>>(),
            vec![(true, 30), (false, 10), (true, 20)]
        );
        let mut rev = v.clone();
        rev.reverse();
        let mut t = SeqTracker::new(0, 64, Duration::from_secs(1));
        // Nothing finishes until seq 0 lands (last), then all three at once:
        // several notify bits drained in one run.
        let now = Instant::now();
        for &imm in &rev[..rev.len() - 1] {
            t.on_arrival(imm, 10, now).unwrap();
            assert_eq!(t.poll_finished(), None);
        }
        t.on_arrival(rev[rev.len() - 1], 10, now).unwrap();
        let drained: Vec<_> = std::iter::from_fn(|| t.poll_finished()).collect();
        assert_eq!(drained.len(), 3);
        assert_eq!(drained.iter().map(|m| m.last_seq).collect::<Vec<_>>(), vec![2, 3, 5]);
        assert_eq!(t.held(), 0);
        assert_eq!(t.deadline(), None);
    }

    #[test]
    fn wraps_at_2_pow_24() {
        let start = SEQ_MASK - 2;
        let v = imms(start, &[5, 2], &[true, true]);
        assert_eq!(DqplbImm::decode(v[3]).unwrap().seq, 0);
        let mut order = v.clone();
        order.swap(0, 4);
        order.swap(2, 6);
        let mut t = SeqTracker::new(start, 16, Duration::from_secs(1));
        let got = run(&mut t, &order);
        assert_eq!(got.len(), 2);
        assert_eq!(got[0].last_seq, 1);
        assert_eq!(got[1].last_seq, 3);
        assert_eq!(t.expected(), 4);
    }

    #[test]
    fn mixed_plain_and_imm_messages_do_not_stall() {
        // WRITE (2 fragments), WRITE_WITH_IMM (1), WRITE (1), WRITE_WITH_IMM (3):
        // plain writes still consume sequence numbers, so the tracker never
        // waits for a number that was not sent.
        let v = imms(100, &[2, 1, 1, 3], &[false, true, false, true]);
        let mut order = v.clone();
        order.rotate_left(3);
        let mut t = SeqTracker::new(100, 16, Duration::from_secs(1));
        let got = run(&mut t, &order);
        assert_eq!(got.iter().map(|m| m.user).collect::<Vec<_>>(), vec![false, true, false, true]);
        assert_eq!(t.held(), 0);
    }

    #[test]
    fn lost_fragment_is_a_timeout_not_a_hang() {
        let v = imms(0, &[4], &[true]);
        let mut t = SeqTracker::new(0, 16, Duration::from_millis(100));
        let t0 = Instant::now();
        t.on_arrival(v[0], 1, t0).unwrap();
        // v[1] is lost.
        t.on_arrival(v[2], 1, t0).unwrap();
        t.on_arrival(v[3], 1, t0).unwrap();
        assert_eq!(t.poll_finished(), None);
        assert_eq!(t.deadline(), Some(t0 + Duration::from_millis(100)));
        assert!(t.check(t0 + Duration::from_millis(99)).is_ok());
        match t.check(t0 + Duration::from_millis(100)) {
            Err(TrackerError::Timeout { expected: 1, held: 2, .. }) => {}
            other => panic!("expected a timeout, got {other:?}"),
        }
    }

    #[test]
    fn progress_restarts_the_hole_timer() {
        let v = imms(0, &[4], &[true]);
        let mut t = SeqTracker::new(0, 16, Duration::from_millis(100));
        let t0 = Instant::now();
        t.on_arrival(v[1], 1, t0).unwrap();
        t.on_arrival(v[3], 1, t0).unwrap();
        let t1 = t0 + Duration::from_millis(80);
        t.on_arrival(v[0], 1, t1).unwrap(); // advances to 2; hole at 2 remains
        assert_eq!(t.deadline(), Some(t1 + Duration::from_millis(100)));
        t.on_arrival(v[2], 1, t1).unwrap();
        assert_eq!(t.deadline(), None);
        assert!(t.poll_finished().is_some());
    }

    #[test]
    fn duplicates_and_far_numbers_are_errors() {
        let mut t = SeqTracker::new(0, 8, Duration::from_secs(1));
        let now = Instant::now();
        t.on_arrival(DqplbImm { seq: 3, last: false, user: false }.encode(), 0, now).unwrap();
        assert_eq!(
            t.on_arrival(DqplbImm { seq: 3, last: false, user: false }.encode(), 0, now),
            Err(TrackerError::Duplicate { seq: 3 })
        );
        assert!(matches!(
            t.on_arrival(DqplbImm { seq: 8, last: false, user: false }.encode(), 0, now),
            Err(TrackerError::OutOfWindow { .. })
        ));
        // A number just behind `expected` (already delivered) is far ahead modulo 2^24.
        t.on_arrival(DqplbImm { seq: 0, last: true, user: false }.encode(), 0, now).unwrap();
        assert!(matches!(
            t.on_arrival(DqplbImm { seq: 0, last: true, user: false }.encode(), 0, now),
            Err(TrackerError::OutOfWindow { .. })
        ));
    }

    /// What `qps` RC QPs fed round-robin can deliver: each QP in order,
    /// the QPs interleaved at random.
    fn shuffled(len: usize, qps: usize, seed: u64) -> Vec<usize> {
        let mut x = seed | 1;
        let mut queues: Vec<std::collections::VecDeque<usize>> = vec![Default::default(); qps];
        for i in 0..len {
            queues[i % qps].push_back(i);
        }
        let mut out = Vec::with_capacity(len);
        while out.len() < len {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let live: Vec<usize> = (0..qps).filter(|&q| !queues[q].is_empty()).collect();
            let q = live[(x as usize) % live.len()];
            out.push(queues[q].pop_front().expect("live queue"));
        }
        out
    }

    proptest! {
        /// Any interleaving of per-QP FIFOs yields every message once, in
        /// order, with the right flags and byte counts; wrapping included.
        #[test]
        fn any_permutation(sizes in proptest::collection::vec(1usize..6, 1..40),
                           user_bits in proptest::collection::vec(any::<bool>(), 40),
                           start in prop_oneof![Just(0u32), Just(SEQ_MASK - 7), 0..SEQ_MASK],
                           qps in 1usize..17, seed in any::<u64>()) {
            let user = &user_bits[..sizes.len()];
            let v = imms(start, &sizes, user);
            let order = shuffled(v.len(), qps, seed);
            let mut t = SeqTracker::new(start, 1 << 23, Duration::from_secs(1));
            let now = Instant::now();
            let mut got = Vec::new();
            for &i in &order {
                t.on_arrival(v[i], i as u32, now).unwrap();
                got.extend(std::iter::from_fn(|| t.poll_finished()));
            }
            prop_assert_eq!(got.len(), sizes.len());
            let mut first = 0usize;
            for (m, (&n, &u)) in got.iter().zip(sizes.iter().zip(user)) {
                prop_assert_eq!(m.user, u);
                let expect: u64 = (first..first + n).map(|i| i as u64).sum();
                prop_assert_eq!(m.bytes, expect);
                first += n;
            }
            prop_assert_eq!(t.held(), 0);
            prop_assert!(t.check(now + Duration::from_secs(10)).is_ok());
        }
    }
}
