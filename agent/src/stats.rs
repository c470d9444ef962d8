//! Counters of what an agent did, for tests and monitoring.

use std::sync::atomic::{AtomicU64, Ordering};

/// What an agent has done since it was created
/// ([`TransferAgent::stats`](crate::TransferAgent::stats)).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct AgentStats {
    /// Transfers started (requests that passed their checks).
    pub transfers: u64,
    /// Pieces those requests named.
    pub pieces: u64,
    /// Writes and reads posted to transports for them, after coalescing:
    /// pieces adjacent on both sides count once. (The transport may cut one
    /// into fragments of `frag_size` and stripe them over its QPs.)
    pub ops_posted: u64,
    /// Bytes those operations moved (or were to move).
    pub bytes: u64,
    /// Notifications placed in peers' rings.
    pub notifications_sent: u64,
    /// Notifications received from peers (taken or not).
    pub notifications_received: u64,
    /// Connections made, by either side's handshake.
    pub connections: u64,
}

#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) transfers: AtomicU64,
    pub(crate) pieces: AtomicU64,
    pub(crate) ops_posted: AtomicU64,
    pub(crate) bytes: AtomicU64,
    pub(crate) notifications_sent: AtomicU64,
    pub(crate) notifications_received: AtomicU64,
    pub(crate) connections: AtomicU64,
}

impl Counters {
    pub(crate) fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Ordering::Relaxed);
    }

    pub(crate) fn snapshot(&self) -> AgentStats {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        AgentStats {
            transfers: g(&self.transfers),
            pieces: g(&self.pieces),
            ops_posted: g(&self.ops_posted),
            bytes: g(&self.bytes),
            notifications_sent: g(&self.notifications_sent),
            notifications_received: g(&self.notifications_received),
            connections: g(&self.connections),
        }
    }
}
