//! The shared key table: a context's memory regions as same-host peers see
//! them.
//!
//! Each context publishes its MRs in a memfd segment of fixed-size slots.
//! A peer on the same host maps it read-only and validates an rkey, the
//! bounds and the access flags itself before copying directly, so that a
//! plain RDMA WRITE needs no CPU of the target process. Deregistration clears
//! the slot, so the key stops working for the next access at once.
//!
//! Slots are written under a sequence lock (odd while changing) and read
//! with atomics only, because writer and readers are different processes.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use crate::shm::ShmSegment;
use crate::{AccessFlags, Result};

/// Slots per table. The slot index is the low bits of the key; the other
/// bits of the key are random.
pub(crate) const SLOTS: usize = 1 << 14;
pub(crate) const SLOT_MASK: u32 = (SLOTS - 1) as u32;
const SLOT_BYTES: usize = 64;
pub(crate) const TABLE_BYTES: usize = SLOTS * SLOT_BYTES;

/// One published MR.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SlotData {
    pub(crate) rkey: u32,
    pub(crate) pd: u32,
    pub(crate) access: u32,
    pub(crate) addr: u64,
    pub(crate) len: u64,
    /// 0 when the MR is not in a shared segment. Peers obtain the segment
    /// itself through the attach socket, never by a descriptor number.
    pub(crate) seg_uid: u64,
    pub(crate) seg_off: u64,
}

#[repr(C)]
struct Slot {
    seq: AtomicU32,
    rkey: AtomicU32,
    pd: AtomicU32,
    access: AtomicU32,
    addr: AtomicU64,
    len: AtomicU64,
    seg_uid: AtomicU64,
    _pad: [AtomicU32; 2],
    seg_off: AtomicU64,
}

const _: () = assert!(std::mem::size_of::<Slot>() <= SLOT_BYTES);

/// A view of a key table (ours or a peer's) at `base`.
#[derive(Debug)]
pub(crate) struct KeyTableView {
    base: *const u8,
}

// SAFETY: the view only touches the mapping through atomics.
unsafe impl Send for KeyTableView {}
// SAFETY: as above.
unsafe impl Sync for KeyTableView {}

impl KeyTableView {
    /// # Safety
    /// `base` must point to a live mapping of at least `TABLE_BYTES`,
    /// 8-byte aligned, for as long as the view is used.
    pub(crate) unsafe fn new(base: *const u8) -> Self {
        KeyTableView { base }
    }

    fn slot(&self, key: u32) -> &Slot {
        let idx = (key & SLOT_MASK) as usize;
        // SAFETY: idx < SLOTS, the mapping holds SLOTS slots, and Slot is
        // made of atomics, valid for any bit pattern.
        unsafe { &*(self.base.add(idx * SLOT_BYTES) as *const Slot) }
    }

    /// Reads the slot for `rkey`; `None` unless it holds exactly that key.
    pub(crate) fn lookup(&self, rkey: u32) -> Option<SlotData> {
        let s = self.slot(rkey);
        for _ in 0..64 {
            let seq1 = s.seq.load(Ordering::Acquire);
            if seq1 & 1 == 1 {
                std::hint::spin_loop();
                continue;
            }
            let d = SlotData {
                rkey: s.rkey.load(Ordering::Relaxed),
                pd: s.pd.load(Ordering::Relaxed),
                access: s.access.load(Ordering::Relaxed),
                addr: s.addr.load(Ordering::Relaxed),
                len: s.len.load(Ordering::Relaxed),
                seg_uid: s.seg_uid.load(Ordering::Relaxed),
                seg_off: s.seg_off.load(Ordering::Relaxed),
            };
            std::sync::atomic::fence(Ordering::Acquire);
            if s.seq.load(Ordering::Relaxed) == seq1 {
                return (d.rkey == rkey && d.access != 0).then_some(d);
            }
        }
        None
    }
}

impl KeyTableView {
    /// The segments that back the regions published now (a peer drops its
    /// mappings of the others).
    pub(crate) fn live_segments(&self) -> std::collections::HashSet<u64> {
        let mut out = std::collections::HashSet::new();
        for i in 0..SLOTS as u32 {
            let s = self.slot(i);
            if s.access.load(Ordering::Relaxed) == 0 {
                continue;
            }
            let rkey = s.rkey.load(Ordering::Relaxed);
            if let Some(d) = self.lookup(rkey) {
                if d.seg_uid != 0 {
                    out.insert(d.seg_uid);
                }
            }
        }
        out
    }
}

/// The table this context owns and writes.
#[derive(Debug)]
pub(crate) struct KeyTable {
    seg: Arc<ShmSegment>,
    view: KeyTableView,
}

impl KeyTable {
    pub(crate) fn new() -> Result<KeyTable> {
        let seg = ShmSegment::create(TABLE_BYTES)?;
        // SAFETY: the segment is TABLE_BYTES long, page aligned, and lives in
        // `self` as long as the view.
        let view = unsafe { KeyTableView::new(seg.ptr()) };
        Ok(KeyTable { seg, view })
    }

    /// A read-only descriptor of the table, for a peer: it can map the
    /// table to check keys but never change it.
    pub(crate) fn read_only_fd(&self) -> std::io::Result<std::os::fd::OwnedFd> {
        let f = std::fs::File::open(format!("/proc/self/fd/{}", self.seg.fd()))?;
        Ok(f.into())
    }

    pub(crate) fn uid(&self) -> u64 {
        self.seg.uid()
    }

    #[cfg(test)]
    pub(crate) fn view(&self) -> &KeyTableView {
        &self.view
    }

    /// Publishes an MR. `access` must be non-zero (`LOCAL_WRITE` at least is
    /// recorded as a bit of its own so that an empty slot reads as absent).
    pub(crate) fn publish(&self, d: &SlotData) {
        let s = self.view.slot(d.rkey);
        let seq = s.seq.load(Ordering::Relaxed);
        s.seq.store(seq.wrapping_add(1), Ordering::Relaxed);
        std::sync::atomic::fence(Ordering::Release);
        s.rkey.store(d.rkey, Ordering::Relaxed);
        s.pd.store(d.pd, Ordering::Relaxed);
        s.access.store(d.access, Ordering::Relaxed);
        s.addr.store(d.addr, Ordering::Relaxed);
        s.len.store(d.len, Ordering::Relaxed);
        s.seg_uid.store(d.seg_uid, Ordering::Relaxed);
        s.seg_off.store(d.seg_off, Ordering::Relaxed);
        s.seq.store(seq.wrapping_add(2), Ordering::Release);
    }

    /// Clears the slot of `rkey`.
    pub(crate) fn revoke(&self, rkey: u32) {
        let s = self.view.slot(rkey);
        let seq = s.seq.load(Ordering::Relaxed);
        s.seq.store(seq.wrapping_add(1), Ordering::Relaxed);
        std::sync::atomic::fence(Ordering::Release);
        s.rkey.store(0, Ordering::Relaxed);
        s.access.store(0, Ordering::Relaxed);
        s.len.store(0, Ordering::Relaxed);
        s.seq.store(seq.wrapping_add(2), Ordering::Release);
    }
}

/// The access bits as stored: verbs flags plus a "present" bit.
pub(crate) fn stored_access(a: AccessFlags) -> u32 {
    a.bits() | 0x8000_0000
}

/// The bit of a slot's `access` that marks device memory: peers never copy
/// into or out of it directly (its addresses are no host addresses), they
/// send through the connection.
pub(crate) const STORED_DEVICE: u32 = 0x4000_0000;

impl SlotData {
    /// Whether the region is device memory.
    pub(crate) fn is_device(&self) -> bool {
        self.access & STORED_DEVICE != 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn publish_lookup_revoke() {
        let t = KeyTable::new().unwrap();
        let d = SlotData {
            rkey: 0xabcd_0005,
            pd: 3,
            access: stored_access(AccessFlags::REMOTE_WRITE | AccessFlags::LOCAL_WRITE),
            addr: 0x1000,
            len: 4096,
            seg_uid: 0,
            seg_off: 0,
        };
        t.publish(&d);
        assert_eq!(t.view().lookup(d.rkey), Some(d));
        // Same slot, other key bits: absent.
        assert_eq!(t.view().lookup(0x1234_0005), None);
        t.revoke(d.rkey);
        assert_eq!(t.view().lookup(d.rkey), None);
    }
}
