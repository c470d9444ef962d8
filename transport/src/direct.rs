//! Same-host copies by the calling thread (see
//! [`TransportConfig::direct_copy_max`](crate::TransportConfig::direct_copy_max)).
//!
//! The peer's regions are mapped here lazily, one mapping per key: the first
//! operation on a key goes through the QP while a task maps the whole
//! region the key registers; later operations are plain copies. An
//! operation outside a mapping (the key now names a larger region) grows it
//! to the hull of both (a key covers one contiguous region, so the hull of
//! two slices it registers is registered too). A key that cannot be mapped (another host, memory
//! outside a shared segment) or whose copy failed (the peer deregistered
//! it) is not tried again: its operations take the QP, which reports what
//! went wrong the way it always does. Every [`PRUNE_EVERY`] new keys the
//! mappings of regions the peer deregistered since are dropped (a peer that
//! allocates and frees per request would otherwise have every freed region
//! kept mapped here), and the keys given up are forgotten.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use crate::{MappedBuffer, RdmaRemoteBuffer};

/// Keys tracked at most; operations on further keys take the QP.
const MAX_KEYS: usize = 4096;

/// Every this many new keys, the mappings of regions the peer no longer
/// registers are dropped (each holds the peer's freed memory mapped here).
const PRUNE_EVERY: usize = 64;

/// How long a mapping may take before its key is given up.
const MAP_TIMEOUT: Duration = Duration::from_secs(30);

enum Slot {
    /// A mapping is being made; `have` is the one it replaces, still used
    /// for what it covers.
    Mapping {
        have: Option<Arc<MappedBuffer>>,
    },
    Mapped(Arc<MappedBuffer>),
    Never,
}

/// Hashes a key by one multiplication (Fibonacci hashing). Keys are the
/// peer's, at most [`MAX_KEYS`] of them, and looked up on every direct copy:
/// SipHash's resistance to chosen keys is not needed here and cost a third
/// of a small copy's bookkeeping.
#[derive(Default)]
struct KeyHasher(u64);

impl std::hash::Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(*b)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }

    fn write_u32(&mut self, k: u32) {
        self.0 = u64::from(k).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

type Keys = HashMap<u32, Slot, std::hash::BuildHasherDefault<KeyHasher>>;

/// The peer's regions mapped here, by key.
#[derive(Default)]
pub(crate) struct DirectMaps {
    by_key: Mutex<Keys>,
    /// New keys since the last prune.
    added: std::sync::atomic::AtomicUsize,
}

/// Drops the keys whose region the peer has deregistered (their mappings
/// keep its freed memory mapped here, and they count against
/// [`MAX_KEYS`]), and the keys given up (a later operation may try again).
fn prune(keys: &mut Keys) {
    keys.retain(|_, slot| match slot {
        Slot::Mapped(m) => m.is_registered(),
        Slot::Mapping { .. } => true,
        Slot::Never => false,
    });
}

/// Where `want` lies in `m`: its offset there, when `m` covers all of it.
fn offset_in(m: &MappedBuffer, want: &RdmaRemoteBuffer) -> Option<usize> {
    let r = m.remote_buffer();
    let end = want.addr.checked_add(want.len)?;
    (want.addr >= r.addr && end <= r.addr + r.len).then(|| (want.addr - r.addr) as usize)
}

impl DirectMaps {
    fn lock(&self) -> std::sync::MutexGuard<'_, Keys> {
        self.by_key.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The mapping holding all of `want` and `want`'s offset in it; else
    /// `None`, after starting (through `map`, on `rt`) a mapping that will
    /// hold it, when none is under way.
    pub(crate) fn lookup<F>(
        self: &Arc<Self>,
        want: &RdmaRemoteBuffer,
        rt: &tokio::runtime::Handle,
        map: impl FnOnce(RdmaRemoteBuffer) -> F,
    ) -> Option<(Arc<MappedBuffer>, usize)>
    where
        F: std::future::Future<Output = Option<MappedBuffer>> + Send + 'static,
    {
        let mut keys = self.lock();
        let hull = match keys.get(&want.key) {
            Some(Slot::Mapped(m)) => match offset_in(m, want) {
                Some(off) => return Some((m.clone(), off)),
                None => {
                    let r = m.remote_buffer();
                    let start = r.addr.min(want.addr);
                    let end = (r.addr + r.len).max(want.addr.saturating_add(want.len));
                    RdmaRemoteBuffer { addr: start, len: end - start, key: want.key }
                }
            },
            Some(Slot::Mapping { have: Some(m) }) => return offset_in(m, want).map(|off| (m.clone(), off)),
            Some(Slot::Mapping { have: None } | Slot::Never) => return None,
            None => {
                use std::sync::atomic::Ordering;
                if self.added.fetch_add(1, Ordering::Relaxed) + 1 >= PRUNE_EVERY || keys.len() >= MAX_KEYS {
                    self.added.store(0, Ordering::Relaxed);
                    prune(&mut keys);
                }
                if keys.len() >= MAX_KEYS {
                    return None;
                }
                *want
            }
        };
        let have = match keys.remove(&want.key) {
            Some(Slot::Mapped(m)) => Some(m),
            _ => None,
        };
        keys.insert(want.key, Slot::Mapping { have });
        drop(keys);
        let fut = map(hull);
        let this: Weak<Self> = Arc::downgrade(self);
        rt.spawn(async move {
            let slot = match tokio::time::timeout(MAP_TIMEOUT, fut).await {
                Ok(Some(m)) => Slot::Mapped(Arc::new(m)),
                _ => Slot::Never,
            };
            if let Some(this) = this.upgrade() {
                this.lock().insert(hull.key, slot);
            }
        });
        None
    }

    /// A copy through `key`'s mapping failed (the peer no longer registers
    /// it): the key takes the QP from now on.
    pub(crate) fn give_up(&self, key: u32) {
        self.lock().insert(key, Slot::Never);
    }

    /// Keys mapped now (a diagnostic for tests).
    pub(crate) fn mapped(&self) -> usize {
        self.lock().values().filter(|s| matches!(s, Slot::Mapped(_))).count()
    }
}
