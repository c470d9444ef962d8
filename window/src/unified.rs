//! The UNIFIED (same-host) signal: a slot of shared memory that the source
//! updates with an atomic and the destination watches, spinning for a
//! bounded time and then sleeping on a futex in the same slot, so an idle
//! waiter burns no core.
//!
//! A slot is 16 bytes: the 64-bit value (a count of signals, or a ctran
//! value signal), a 32-bit futex word the source bumps to wake sleepers,
//! and a 32-bit count of sleepers (so that a source whose destination
//! spins, or does not wait, makes no system call). The source stores the
//! value and then reads the sleeper count; a sleeper raises the count and
//! then reads the value — both with sequentially consistent atomics, so at
//! least one of them sees the other (Dekker): either the sleeper sees the
//! new value and does not sleep, or the source sees the sleeper and wakes it
//! (bumping the futex word first, so a wake that comes between the
//! sleeper's check and its `futex_wait` makes the wait return at once).

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rustix::thread::futex;

use crate::error::Result;

/// Bytes per slot.
pub(crate) const SLOT: usize = 16;
const SEQ: usize = 8;
const SLEEPERS: usize = 12;

/// The longest one futex sleep lasts when every writer wakes the waiter:
/// between sleeps the waiter checks that the peer is still there.
pub(crate) const SLICE: Duration = Duration::from_millis(20);

/// One slot, wherever it is mapped.
#[derive(Clone, Copy)]
pub(crate) struct Slot<'a> {
    pub(crate) value: &'a AtomicU64,
    seq: &'a AtomicU32,
    sleepers: &'a AtomicU32,
}

impl<'a> Slot<'a> {
    /// The slot at `off` of a region, from its word accessors.
    pub(crate) fn at<E>(
        off: usize,
        u64_at: impl Fn(usize) -> std::result::Result<&'a AtomicU64, E>,
        u32_at: impl Fn(usize) -> std::result::Result<&'a AtomicU32, E>,
    ) -> std::result::Result<Slot<'a>, E> {
        Ok(Slot { value: u64_at(off)?, seq: u32_at(off + SEQ)?, sleepers: u32_at(off + SLEEPERS)? })
    }

    /// After the value changed: wakes the sleepers, if any.
    pub(crate) fn wake(&self) {
        if self.sleepers.load(Ordering::SeqCst) != 0 {
            self.seq.fetch_add(1, Ordering::SeqCst);
            let _ = futex::wake(self.seq, futex::Flags::empty(), i32::MAX as u32);
        }
    }

    /// Adds `n` to the value (release: what this thread wrote before is
    /// visible to whoever sees the new value) and wakes the sleepers.
    pub(crate) fn add(&self, n: u64) {
        self.value.fetch_add(n, Ordering::SeqCst);
        self.wake();
    }

    /// Sets the value and wakes the sleepers.
    pub(crate) fn set(&self, v: u64) {
        self.value.swap(v, Ordering::SeqCst);
        self.wake();
    }

    /// Waits until `ready()` (which reads the value with acquire ordering,
    /// and may take what it finds: it is called again only after it said
    /// false) is true: spins for `spin`, then sleeps on the futex in slices
    /// of at most `slice` (short when writers may not wake it: RDMA writes
    /// from another host), calling `alive()` between them. `Ok(false)` at
    /// `deadline`.
    pub(crate) fn wait(
        &self,
        spin: Duration,
        slice: Duration,
        deadline: Instant,
        mut ready: impl FnMut() -> bool,
        mut alive: impl FnMut() -> Result<()>,
    ) -> Result<bool> {
        if ready() {
            return Ok(true);
        }
        let start = Instant::now();
        let spin_until = start + spin.min(deadline.saturating_duration_since(start));
        let mut n = 0u32;
        loop {
            std::hint::spin_loop();
            if ready() {
                return Ok(true);
            }
            n = n.wrapping_add(1);
            if n.is_multiple_of(64) && Instant::now() >= spin_until {
                break;
            }
        }
        loop {
            alive()?;
            let now = Instant::now();
            if now >= deadline {
                return Ok(ready());
            }
            self.sleepers.fetch_add(1, Ordering::SeqCst);
            let seen = self.seq.load(Ordering::SeqCst);
            // `ready` may take what it finds (a counted signal): call it
            // once per look and act on that answer.
            let done = ready();
            if !done {
                let t = (deadline - now).min(slice);
                let ts = rustix::time::Timespec { tv_sec: t.as_secs() as i64, tv_nsec: t.subsec_nanos() as i64 };
                // EAGAIN (the word moved), EINTR, ETIMEDOUT: all mean look again.
                let _ = futex::wait(self.seq, futex::Flags::empty(), seen, Some(&ts));
            }
            self.sleepers.fetch_sub(1, Ordering::SeqCst);
            if done || ready() {
                return Ok(true);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Signals that arrive while the waiter sleeps on the futex are each
    /// taken exactly once (a waiter that took one on waking and then looked
    /// again would need more signals than were sent, and time out).
    #[test]
    fn every_signal_satisfies_exactly_one_wait_awake_or_asleep() {
        let (value, seq, sleepers) = (AtomicU64::new(0), AtomicU32::new(0), AtomicU32::new(0));
        let slot = Slot { value: &value, seq: &seq, sleepers: &sleepers };
        let taken = AtomicU64::new(0);
        let take = || {
            let (have, t) = (value.load(Ordering::Acquire), taken.load(Ordering::Acquire));
            have > t && taken.compare_exchange(t, t + 1, Ordering::AcqRel, Ordering::Acquire).is_ok()
        };
        const N: u64 = 40;
        std::thread::scope(|s| {
            s.spawn(|| {
                for i in 0..N {
                    // Every other signal comes after the waiter is asleep.
                    if i % 2 == 0 {
                        std::thread::sleep(Duration::from_millis(3));
                    }
                    slot.add(1);
                }
            });
            for i in 0..N {
                let deadline = Instant::now() + Duration::from_secs(10);
                assert!(slot.wait(Duration::ZERO, SLICE, deadline, take, || Ok(())).unwrap(), "wait {i} timed out");
            }
        });
        assert_eq!(taken.load(Ordering::SeqCst), N);
        let deadline = Instant::now() + Duration::from_millis(30);
        assert!(!slot.wait(Duration::from_micros(10), SLICE, deadline, take, || Ok(())).unwrap(), "no signal is left");
        assert_eq!(sleepers.load(Ordering::SeqCst), 0);
    }

    /// A signal that lands just before the waiter would sleep (here: from
    /// the liveness check, which runs right before) is taken by that look,
    /// and the wait returns with it rather than look for another one.
    #[test]
    fn a_signal_found_on_the_way_to_sleep_ends_the_wait() {
        let (value, seq, sleepers) = (AtomicU64::new(0), AtomicU32::new(0), AtomicU32::new(0));
        let slot = Slot { value: &value, seq: &seq, sleepers: &sleepers };
        let taken = AtomicU64::new(0);
        let take = || {
            let (have, t) = (value.load(Ordering::Acquire), taken.load(Ordering::Acquire));
            have > t && taken.compare_exchange(t, t + 1, Ordering::AcqRel, Ordering::Acquire).is_ok()
        };
        let posted = std::cell::Cell::new(false);
        let alive = || {
            if !posted.replace(true) {
                slot.add(1);
            }
            Ok(())
        };
        let deadline = Instant::now() + Duration::from_millis(200);
        assert!(slot.wait(Duration::ZERO, SLICE, deadline, take, alive).unwrap(), "the signal was taken and lost");
        assert_eq!(taken.load(Ordering::SeqCst), 1);
    }
}
