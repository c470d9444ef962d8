//! Deregistration fences: a same-host peer (or this process's own
//! responder, [`FenceTable::enter`]) never copies into (or out of) a
//! region after its owner's deregistration has returned.
//!
//! A peer checks a key in the owner's key table and then copies, with no
//! lock between the two that the owner could take: the check may pass just
//! before the owner revokes the key and frees the memory. So each key-table
//! slot has a counter in a second, peer-writable table (the key table itself
//! is mapped read-only by peers). A peer raises the slot's counter *before*
//! it checks the key and lowers it after the copy; the owner revokes the key
//! and then waits for the counter to read zero. Both sides put a full fence
//! between their store and their load (Dekker's pattern), so either the
//! peer sees the revocation and does not copy, or the owner sees the peer
//! in the slot and waits for the copy to finish.
//!
//! Counters are held across an await only by the engine's batches of
//! device copies (`requester::device_batch`), until the batch's wait for
//! the device, which comes as soon as no further WR is already posted
//! (at most 64 WRs and 256 MiB, or one larger WR alone), and never while
//! the engine waits for a peer;
//! every other copy is synchronous. The
//! owner's wait is bounded ([`WAIT_LIMIT`]): a peer that died between its
//! increment and its decrement cannot block deregistration forever (a peer
//! that may write our memory is trusted not to lie here on purpose).

use std::sync::atomic::{fence, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::keytable::{SLOTS, SLOT_MASK};
use crate::shm::ShmSegment;
use crate::Result;

/// Bytes of a fence table: one 32-bit counter per key-table slot.
pub(crate) const TABLE_BYTES: usize = SLOTS * 4;
/// The longest an owner waits for copies on a key it revoked.
pub(crate) const WAIT_LIMIT: Duration = Duration::from_secs(2);

fn counter(base: *const u8, key: u32) -> *const AtomicU32 {
    // Within the table: the index is masked to SLOTS.
    base.wrapping_add((key & SLOT_MASK) as usize * 4).cast()
}

/// The owner's table.
#[derive(Debug)]
pub(crate) struct FenceTable {
    seg: Arc<ShmSegment>,
}

impl FenceTable {
    pub(crate) fn new() -> Result<FenceTable> {
        Ok(FenceTable { seg: ShmSegment::create(TABLE_BYTES)? })
    }

    pub(crate) fn uid(&self) -> u64 {
        self.seg.uid()
    }

    /// The table's descriptor, to pass to a same-host peer.
    pub(crate) fn borrow_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.seg.borrow_fd()
    }

    /// Enters key `key`'s slot of this (the owner's own) table, as a
    /// peer's [`FenceView::enter`] does: this process's responder holds it
    /// while it writes a peer's payload into the region, so that the
    /// owner's deregistration waits for that write (one system call or
    /// device copy; the guard is never held across a wait).
    pub(crate) fn enter(&self, key: u32) -> LocalFence<'_> {
        // SAFETY: the counter lies in our live mapping of TABLE_BYTES bytes
        // (kept by `self`, which the guard borrows), accessed atomically.
        let c = unsafe { &*counter(self.seg.ptr(), key) };
        raise(c);
        LocalFence(c)
    }

    /// After `key` was revoked: waits until no peer is inside a copy that
    /// checked it. False when the wait gave up after [`WAIT_LIMIT`].
    pub(crate) fn wait_idle(&self, key: u32) -> bool {
        // Pairs with the fence in `FenceView::enter`: our revocation (before
        // this call) and our load of the counter are ordered.
        fence(Ordering::SeqCst);
        // SAFETY: the counter lies in our live mapping of TABLE_BYTES bytes,
        // and is only accessed atomically.
        let c = unsafe { &*counter(self.seg.ptr(), key) };
        if c.load(Ordering::Acquire) == 0 {
            return true;
        }
        let start = Instant::now();
        let mut spins = 0u32;
        while c.load(Ordering::Acquire) != 0 {
            if start.elapsed() > WAIT_LIMIT {
                tracing::warn!(
                    "soft deregistration of key {key:#x}: a same-host peer still counts a copy after {WAIT_LIMIT:?} \
                     (it may have died mid-copy); going on"
                );
                return false;
            }
            spins += 1;
            if spins < 1000 {
                std::hint::spin_loop();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
        true
    }
}

/// Counts a copy into a slot, before its key is checked.
fn raise(c: &AtomicU32) {
    c.fetch_add(1, Ordering::SeqCst);
    // Pairs with the fence in `FenceTable::wait_idle`: this store and the
    // key check after it are ordered.
    fence(Ordering::SeqCst);
}

/// A peer's fence table as mapped here.
pub(crate) struct FenceView {
    base: usize,
    keep: Arc<dyn Send + Sync>,
}

impl std::fmt::Debug for FenceView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FenceView").field("base", &format_args!("{:#x}", self.base)).finish()
    }
}

impl std::fmt::Debug for FenceGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FenceGuard").field("counter", &format_args!("{:#x}", self.counter)).finish()
    }
}

impl FenceView {
    /// # Safety
    /// `base` must be a page-aligned mapping of at least [`TABLE_BYTES`],
    /// writable, kept alive by `keep`.
    pub(crate) unsafe fn new(base: *const u8, keep: Arc<dyn Send + Sync>) -> FenceView {
        FenceView { base: base as usize, keep }
    }

    /// Enters key `key`'s slot: call before checking the key; the copy must
    /// be done before the guard is dropped.
    pub(crate) fn enter(&self, key: u32) -> FenceGuard {
        let c = counter(self.base as *const u8, key);
        // SAFETY: in the live mapping (kept by `keep`), accessed atomically.
        raise(unsafe { &*c });
        FenceGuard { counter: c as usize, _keep: self.keep.clone() }
    }
}

/// [`FenceTable::enter`]'s guard: the owner's own counter, borrowed.
pub(crate) struct LocalFence<'a>(&'a AtomicU32);

impl Drop for LocalFence<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Release);
    }
}

/// Held while a copy that checked a key is in progress.
pub(crate) struct FenceGuard {
    counter: usize,
    _keep: Arc<dyn Send + Sync>,
}

impl Drop for FenceGuard {
    fn drop(&mut self) {
        // SAFETY: the counter's mapping is kept alive by `_keep`.
        unsafe { &*(self.counter as *const AtomicU32) }.fetch_sub(1, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_owner_waits_for_a_copy_in_progress() {
        let t = FenceTable::new().unwrap();
        let keep: Arc<dyn Send + Sync> = t.seg.clone();
        // SAFETY: the table's own mapping, kept by `keep`.
        let v = unsafe { FenceView::new(t.seg.ptr(), keep) };
        assert!(t.wait_idle(0x1234_0005));
        let g = v.enter(0x1234_0005);
        let other = v.enter(0x1234_0006);
        drop(other);
        let start = Instant::now();
        std::thread::scope(|s| {
            s.spawn(move || {
                std::thread::sleep(Duration::from_millis(100));
                drop(g);
            });
            assert!(t.wait_idle(0x9999_0005), "same slot, other high bits: same counter");
        });
        assert!(start.elapsed() >= Duration::from_millis(90), "the owner did not wait for the copy");
    }
}
