//! The state an agent's tasks share: its identity, its registered regions
//! and its peer table, where each peer's link (idle, connecting, ready)
//! and connection live.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, MutexGuard};

use rmacomm_transport::RdmaTransport;
use tokio::sync::{watch, Semaphore};

use crate::connection::Conn;
use crate::handshake::LinkState;
use crate::metadata::{same_token, Metadata, Region};
use crate::notifications::Queue;
use crate::stats::Counters;
use crate::{AgentConfig, AgentError};

/// What the agent's tasks share.
pub(crate) struct Shared {
    pub(crate) name: String,
    pub(crate) token: String,
    pub(crate) control: Vec<SocketAddr>,
    pub(crate) config: AgentConfig,
    /// Never connected: pins the device every transport of the agent uses
    /// (so registrations checked against it are usable by all of them).
    pub(crate) anchor: RdmaTransport,
    pub(crate) st: Mutex<State>,
    pub(crate) queue: Arc<Queue>,
    pub(crate) counters: Arc<Counters>,
    pub(crate) next_attempt: AtomicU64,
    pub(crate) handshakes: Arc<Semaphore>,
}

#[derive(Default)]
pub(crate) struct State {
    pub(crate) regions: Vec<Region>,
    pub(crate) next_region: u32,
    pub(crate) peers: HashMap<String, PeerEntry>,
}

pub(crate) struct PeerEntry {
    pub(crate) meta: Metadata,
    pub(crate) link: Link,
    /// Why the last connection attempt failed (cleared by a success).
    pub(crate) failed: Option<AgentError>,
    /// The id of the last connection made (what a new hello replaces).
    pub(crate) last_conn: Option<u64>,
    /// Bumped on every change of `link`: what waiters for a connection
    /// sleep on.
    pub(crate) changed: watch::Sender<u64>,
}

pub(crate) enum Link {
    Idle,
    /// Attempt `attempt` is making a connection: this side's hello
    /// (`mine`), or an answer to the peer's.
    Connecting {
        mine: bool,
        attempt: u64,
    },
    Ready(Arc<Conn>),
}

impl PeerEntry {
    pub(crate) fn new(meta: Metadata) -> Self {
        PeerEntry { meta, link: Link::Idle, failed: None, last_conn: None, changed: watch::Sender::new(0) }
    }

    pub(crate) fn set(&mut self, link: Link) {
        self.link = link;
        self.changed.send_modify(|v| *v += 1);
    }

    pub(crate) fn state(&self) -> LinkState {
        match &self.link {
            Link::Idle => LinkState::Idle,
            Link::Connecting { mine, .. } => LinkState::Connecting { mine: *mine },
            Link::Ready(c) => LinkState::Ready { id: c.id, usable: c.usable() },
        }
    }

    pub(crate) fn attempt(&self) -> Option<u64> {
        match self.link {
            Link::Connecting { attempt, .. } => Some(attempt),
            _ => None,
        }
    }
}

impl Shared {
    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        self.st.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn metadata(&self) -> Metadata {
        let regions = self.lock().regions.clone();
        Metadata::new(&self.name, &self.token, self.control.clone(), regions)
    }

    /// Adds a peer, or refreshes what is known of it.
    pub(crate) fn learn(&self, meta: Metadata) {
        let mut st = self.lock();
        match st.peers.get_mut(&meta.name) {
            Some(e) if same_token(&e.meta.token, &meta.token) => e.meta = meta,
            Some(e) => {
                // Another incarnation: the old connection leads nowhere.
                e.meta = meta;
                e.failed = None;
                e.last_conn = None;
                e.set(Link::Idle);
            }
            None => {
                st.peers.insert(meta.name.clone(), PeerEntry::new(meta));
            }
        }
    }

    /// Drops connection `id` to `peer` from the table, if it is still there
    /// (its ring was found corrupt): its transport goes with the last
    /// request holding it, so the peer sees the connection end; this
    /// side's next request connects again.
    pub(crate) fn drop_conn(&self, peer: &str, id: u64) {
        let mut st = self.lock();
        if let Some(e) = st.peers.get_mut(peer).filter(|e| matches!(&e.link, Link::Ready(c) if c.id == id)) {
            e.set(Link::Idle);
        }
    }

    /// Ends connection attempt `attempt` to `peer` with its result, unless
    /// the link has moved on since (another attempt replaced it).
    pub(crate) fn settle(&self, peer: &str, attempt: u64, r: Result<Arc<Conn>, AgentError>) {
        let mut st = self.lock();
        let Some(e) = st.peers.get_mut(peer) else { return };
        if e.attempt() != Some(attempt) {
            return;
        }
        match r {
            Ok(c) => {
                Counters::add(&self.counters.connections, 1);
                e.failed = None;
                e.last_conn = Some(c.id);
                e.set(Link::Ready(c));
            }
            Err(err) => {
                e.failed = Some(err);
                e.set(Link::Idle);
            }
        }
    }
}
