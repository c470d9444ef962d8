//! Same-host notifications: a notifying write to a peer on this host, copied
//! by the calling thread (see
//! [`TransportConfig::direct_copy_max`](crate::TransportConfig::direct_copy_max)),
//! is announced by adding one to a counter in a page the peer shares,
//! instead of a WRITE_WITH_IMM through the QP.
//!
//! Each transport on the soft provider allocates one small page in a shared
//! segment when it is bound and names it in its URL. The peer maps it
//! (lazily, like any region it copies to) and counts its notifications in
//! the page's first word; this side takes them from there whenever it polls
//! (a `wait_for_write`, any call that reaps completions). What the counter
//! says arrives after the data: the copy comes first, the counter's increment
//! is a release and its read an acquire.
//!
//! A waiter that stops polling and sleeps (on the completion channel,
//! through the driver task) is *parked*; the page's second word counts the
//! parked waiters. The writer adds to the counter and then reads the parked
//! count; a waiter adds itself to the parked count and then reads the
//! counter, both sequentially consistent, so at least one sees the other:
//! either the waiter finds the notification before it sleeps, or the writer
//! sees it parked and wakes it with a zero-byte WRITE_WITH_IMM carrying
//! [`WAKE_IMM`], which counts nothing and makes the waiter's side read the
//! counter. A busy-polling waiter is not parked, so its notifications cost
//! no work request at all.
//!
//! A transport that is dropped marks its page parked for good, so the peer's
//! notifying writes post their wake-ups through the QP, which fails; a page
//! whose owner deregistered it is never counted in (the write takes the QP).
//! Either way the write reports the peer's end, as the QP path does.

use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use crate::{MappedBuffer, RdmaMemory, RdmaRemoteBuffer};

/// The immediate of a wake-up: a zero-byte WRITE_WITH_IMM that is not a
/// notification (those carry 0) but tells the receiver to read its counter.
pub(crate) const WAKE_IMM: u32 = 0x5741_4b45;

/// Notifications counted in by the peer (its writes).
const COUNT: usize = 0;
/// Waiters of the page's owner that sleep (the owner writes it); a cache
/// line away from the counter the peer writes.
const PARKED: usize = 64;
/// Bytes of a page.
pub(crate) const PAGE: usize = 128;

/// This side's page, with its two words resolved once (waiters read the
/// counter in a tight loop).
struct OwnPage {
    count: NonNull<AtomicU64>,
    parked: NonNull<AtomicU64>,
    /// Owns the memory both words point into; never moved out.
    mem: RdmaMemory,
}

// SAFETY: the pointers are into `mem`'s mapping, which stays at one address
// for as long as `mem` (owned here) lives; they are used only as shared
// references to atomics, which are Send and Sync.
unsafe impl Send for OwnPage {}
// SAFETY: as above.
unsafe impl Sync for OwnPage {}

impl OwnPage {
    fn new(mem: RdmaMemory) -> Option<OwnPage> {
        let count = NonNull::from(mem.atomic_u64(COUNT).ok()?);
        let parked = NonNull::from(mem.atomic_u64(PARKED).ok()?);
        Some(OwnPage { count, parked, mem })
    }

    fn count(&self) -> &AtomicU64 {
        // SAFETY: see `unsafe impl Send`: valid while `self.mem` lives,
        // which is at least as long as the borrow of `self`.
        unsafe { self.count.as_ref() }
    }

    fn parked(&self) -> &AtomicU64 {
        // SAFETY: as in `count`.
        unsafe { self.parked.as_ref() }
    }
}

/// This side's page and the peer's.
#[derive(Default)]
pub(crate) struct Notes {
    /// Where the peer counts its notifications and this side its parked
    /// waiters (set by `bind`, on the soft provider).
    own: OnceLock<OwnPage>,
    /// Notifications taken from the counter so far (changed under the
    /// transport's state lock).
    pub(crate) seen: AtomicU64,
    /// The peer's page, from its URL.
    pub(crate) peer: OnceLock<RdmaRemoteBuffer>,
    /// The peer's page mapped here, once it is.
    peer_map: OnceLock<Arc<MappedBuffer>>,
}

impl Notes {
    /// Allocates this side's page (once); its remote buffer goes into the
    /// URL. `None` when it cannot be had: the peer then notifies through
    /// the QP.
    pub(crate) fn own_page(&self, alloc: impl FnOnce() -> Option<RdmaMemory>) -> Option<RdmaRemoteBuffer> {
        if self.own.get().is_none() {
            if let Some(p) = alloc().and_then(OwnPage::new) {
                let _ = self.own.set(p);
            }
        }
        self.own.get().map(|p| p.mem.remote_buffer())
    }

    /// The count the peer has reached (sequentially consistent: see the
    /// module docs).
    pub(crate) fn counted(&self) -> Option<u64> {
        self.own.get().map(|p| p.count().load(Ordering::SeqCst))
    }

    /// Marks one more waiter of this side asleep (`true`) or awake.
    pub(crate) fn park(&self, parked: bool) {
        if let Some(p) = self.own.get() {
            if parked {
                p.parked().fetch_add(1, Ordering::SeqCst);
            } else {
                p.parked().fetch_sub(1, Ordering::SeqCst);
            }
        }
    }

    /// Marks this side gone (the transport was dropped): the parked count
    /// stays above zero for good, so a same-host peer's notifying write
    /// always posts its wake-up through the QP, which fails now.
    pub(crate) fn poison(&self) {
        if let Some(p) = self.own.get() {
            p.parked().fetch_add(1 << 32, Ordering::SeqCst);
        }
    }

    /// The peer's page, mapped, once `map` found it (`map` is asked while it
    /// is not).
    pub(crate) fn peer_page(
        &self,
        map: impl FnOnce(&RdmaRemoteBuffer) -> Option<Arc<MappedBuffer>>,
    ) -> Option<&MappedBuffer> {
        if self.peer_map.get().is_none() {
            let m = map(self.peer.get()?)?;
            let whole = m.remote_buffer() == *self.peer.get()? && m.len() >= PAGE;
            if !whole || m.atomic_u64(COUNT).is_err() || m.atomic_u64(PARKED).is_err() {
                return None;
            }
            let _ = self.peer_map.set(m);
        }
        self.peer_map.get().map(|m| &**m)
    }
}

/// Whether the peer whose `page` this is dropped its transport (it marks
/// the parked count for good: [`Notes::poison`]), or deregistered the page.
pub(crate) fn closed(page: &MappedBuffer) -> bool {
    !page.is_registered() || poisoned(page)
}

/// Whether the peer dropped its transport: [`closed`] without the key
/// lookup (one load of a word in this mapping), for plain copies, which
/// pay it on every call (the lookup cost small writes a quarter of their
/// rate). A drop poisons the page before its memory goes.
pub(crate) fn poisoned(page: &MappedBuffer) -> bool {
    page.atomic_u64(PARKED).map_or(true, |p| p.load(Ordering::Acquire) >= 1 << 32)
}

/// Counts one notification into the peer's `page`; true when one of the
/// peer's waiters is asleep and must be woken through the QP.
pub(crate) fn count_in(page: &MappedBuffer) -> Option<bool> {
    let count = page.atomic_u64(COUNT).ok()?;
    let parked = page.atomic_u64(PARKED).ok()?;
    count.fetch_add(1, Ordering::SeqCst);
    Some(parked.load(Ordering::SeqCst) > 0)
}
