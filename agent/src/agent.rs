//! [`TransferAgent`]: one per process — its public surface: registration,
//! peers, requests and notifications. The shared state lives in `shared`,
//! connection making in `dial` (this side's) and `listener` (the peer's).

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use futures::FutureExt;
use rmacomm_transport::{RdmaMemory, RdmaRemoteBuffer, RdmaTransport, View};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::task::AbortHandle;

use crate::block::{LocalBlock, LocalMem};
use crate::dial::connection;
use crate::listener::{bind_listeners, serve, MAX_HANDSHAKES};
use crate::metadata::{check_name, new_token, Metadata, PeerRegion, Region, MAX_REGIONS};
use crate::notifications::{Notification, Notifications, Queue};
use crate::plan::{self, PieceIn};
use crate::ring::{self, MAX_MESSAGE};
use crate::shared::{Link, Shared, State};
use crate::stats::{AgentStats, Counters};
use crate::transfer::{Posting, Transfer};
use crate::{AgentConfig, AgentError, Op, RemoteBlock};

/// A transfer agent: one per process, many peers, memory registered once.
///
/// Peers learn this agent from its [`metadata`](Self::metadata) (a string
/// to publish through a [`Store`](rmacomm_window::Store) with
/// [`publish_metadata`](crate::publish_metadata), or by hand) and add it
/// with [`add_peer`](Self::add_peer). The first transfer toward a peer makes
/// the connection — one [`RdmaTransport`] (one virtual QP) per peer, over
/// shared memory for a peer on this host and TCP otherwise on the soft
/// provider — through a handshake with the peer's listener; a peer that
/// connects to this agent first is added from the metadata its handshake
/// carries. Memory [`register`](Self::register)ed once is usable toward
/// every peer.
///
/// Must be created inside a tokio runtime: the listener and each
/// connection's two small tasks run there.
pub struct TransferAgent {
    sh: Arc<Shared>,
    listeners: Vec<AbortHandle>,
}

impl fmt::Debug for TransferAgent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let st = self.sh.lock();
        let mut peers: Vec<&String> = st.peers.keys().collect();
        peers.sort();
        f.debug_struct("TransferAgent")
            .field("name", &self.sh.name)
            .field("listening", &self.sh.control)
            .field("regions", &st.regions.len())
            .field("peers", &peers)
            .finish()
    }
}

impl TransferAgent {
    /// Creates an agent named `name` (unique among the agents that will
    /// talk to each other; 1 to 256 bytes) and starts its handshake
    /// listener. Must be called inside a tokio runtime.
    pub fn new(name: &str, config: AgentConfig) -> Result<TransferAgent, AgentError> {
        check_name(name).map_err(|r| AgentError::invalid("TransferAgent::new", r))?;
        if config.notification_slots == 0 || config.notification_slots > ring::MAX_SLOTS {
            return Err(AgentError::invalid(
                "TransferAgent::new",
                format!("notification_slots must be 1 to {}", ring::MAX_SLOTS),
            ));
        }
        let rt = tokio::runtime::Handle::try_current().map_err(|_| {
            AgentError::invalid(
                "TransferAgent::new",
                "must be called inside a tokio runtime (the agent's tasks run there)",
            )
        })?;
        let anchor = RdmaTransport::new(config.transport.clone()).map_err(AgentError::Device)?;
        let (std_listeners, control) = bind_listeners(&config, &anchor)?;
        let sh = Arc::new(Shared {
            name: name.into(),
            token: new_token(),
            control,
            config,
            anchor,
            // Region ids start at random: a peer still holding blocks of an
            // earlier incarnation of this agent (its process restarted) then
            // names no region of this one, instead of whatever was
            // registered in the same order.
            st: Mutex::new(State {
                next_region: rand::Rng::gen_range(&mut rand::thread_rng(), 1..1 << 31),
                ..State::default()
            }),
            queue: Arc::new(Queue::default()),
            counters: Arc::new(Counters::default()),
            next_attempt: AtomicU64::new(1),
            handshakes: Arc::new(Semaphore::new(MAX_HANDSHAKES)),
        });
        let _enter = rt.enter();
        let mut listeners = Vec::new();
        for l in std_listeners {
            let l = TcpListener::from_std(l).map_err(|e| AgentError::os("listen", &e))?;
            listeners.push(tokio::spawn(serve(l, Arc::downgrade(&sh))).abort_handle());
        }
        Ok(TransferAgent { sh, listeners })
    }

    /// The agent's name.
    pub fn name(&self) -> &str {
        &self.sh.name
    }

    /// This agent's metadata: a printable string with its name, the
    /// addresses of its handshake listener, the regions registered so far
    /// and an unguessable token. Hand it to peers (their
    /// [`add_peer`](Self::add_peer)). It is a credential: whoever holds it
    /// can read and write the registered regions. Take it again after
    /// registering more memory.
    pub fn metadata(&self) -> String {
        self.sh.metadata().encode()
    }

    /// Allocates `len` bytes of registered memory on the agent's device
    /// (not yet [`register`](Self::register)ed with the agent).
    pub fn alloc(&self, len: usize) -> Result<RdmaMemory, AgentError> {
        RdmaMemory::alloc_for(&self.sh.anchor, len).map_err(AgentError::Device)
    }

    /// Allocates `len` zeroed bytes of CUDA device memory on GPU `gpu`,
    /// registered on the agent's device (not yet
    /// [`register`](Self::register)ed with the agent): KV-cache blocks in
    /// GPU memory. Transfers move it through the transport: a peer on this
    /// host copies device to device through CUDA IPC (soft provider), one
    /// on another host through pinned staging (soft) or the HCA (verbs).
    /// No CUDA: an error naming the driver.
    pub fn alloc_cuda(&self, len: usize, gpu: u32) -> Result<RdmaMemory, AgentError> {
        RdmaMemory::alloc_cuda_for(&self.sh.anchor, len, gpu).map_err(AgentError::Device)
    }

    /// Makes `mem` a region of this agent: usable as the local side of
    /// pieces toward every peer, and published in the metadata (so that
    /// peers name blocks of it) under the returned id. Registering the same
    /// memory again returns its id. The agent does not keep `mem` alive:
    /// drop it only after [`deregister`](Self::deregister) and once peers
    /// no longer use it.
    pub fn register(&self, mem: &RdmaMemory) -> Result<u32, AgentError> {
        if !mem.is_usable_with(&self.sh.anchor) {
            return Err(AgentError::invalid(
                "register",
                "the memory is on another device than the agent's transports (allocate it with TransferAgent::alloc, \
                 or keep the agent's transport config at its default)",
            ));
        }
        let rb = mem.remote_buffer();
        let mut st = self.sh.lock();
        if let Some(r) = st.regions.iter().find(|r| r.remote() == rb) {
            return Ok(r.id);
        }
        if st.regions.len() >= MAX_REGIONS {
            return Err(AgentError::invalid("register", format!("an agent registers at most {MAX_REGIONS} regions")));
        }
        let mut id = st.next_region;
        while id == 0 || st.regions.iter().any(|r| r.id == id) {
            id = id.wrapping_add(1);
        }
        st.next_region = id.wrapping_add(1);
        st.regions.push(Region { id, addr: rb.addr, len: rb.len, key: rb.key });
        Ok(id)
    }

    /// Forgets `mem`'s region: it leaves the metadata and may no longer be
    /// the local side of a piece. Peers holding older metadata still name
    /// it; their transfers fail once the memory is dropped. Returns whether
    /// it was registered.
    pub fn deregister(&self, mem: &RdmaMemory) -> bool {
        let rb = mem.remote_buffer();
        let mut st = self.sh.lock();
        let before = st.regions.len();
        st.regions.retain(|r| r.remote() != rb);
        st.regions.len() != before
    }

    /// Adds (or refreshes) a peer from its metadata and returns its name.
    /// Connects nothing: the first transfer does. Adding a newer metadata
    /// of a known peer updates its regions; metadata of a new incarnation
    /// (the peer's process restarted) replaces the peer and its connection.
    pub fn add_peer(&self, metadata: &str) -> Result<String, AgentError> {
        let meta = Metadata::decode(metadata)?;
        if meta.name == self.sh.name {
            return Err(AgentError::invalid(
                "add_peer",
                "this is the metadata of this agent (or of one with its name)",
            ));
        }
        let name = meta.name.clone();
        self.sh.learn(meta);
        Ok(name)
    }

    /// Forgets a peer and closes its connection: its transfers still in
    /// flight fail with [`AgentError::PeerRemoved`], the peer's toward this
    /// agent with [`AgentError::PeerLost`]. A peer that still holds this
    /// agent's metadata may connect again, which adds it back. Returns
    /// whether the peer was known.
    pub fn remove_peer(&self, name: &str) -> bool {
        let gone = self.sh.lock().peers.remove(name);
        gone.is_some()
    }

    /// The names of the known peers, sorted.
    pub fn peers(&self) -> Vec<String> {
        let mut v: Vec<String> = self.sh.lock().peers.keys().cloned().collect();
        v.sort();
        v
    }

    /// Whether a live connection to peer `name` exists now. A connection
    /// the peer closed is seen as closed within moments (the transport
    /// notices); a transfer that raced that moment fails with
    /// [`AgentError::PeerLost`] and the next one connects again.
    pub fn is_connected(&self, name: &str) -> bool {
        matches!(self.sh.lock().peers.get(name).map(|e| &e.link), Some(Link::Ready(c)) if c.usable())
    }

    /// The regions peer `name` published (id, address in the peer, length), by id.
    pub fn peer_regions(&self, name: &str) -> Result<Vec<PeerRegion>, AgentError> {
        let st = self.sh.lock();
        let e = st.peers.get(name).ok_or_else(|| AgentError::UnknownPeer { name: name.into() })?;
        let mut v: Vec<PeerRegion> =
            e.meta.regions.iter().map(|r| PeerRegion { id: r.id, addr: r.addr, len: r.len }).collect();
        v.sort_by_key(|r| r.id);
        Ok(v)
    }

    /// Connects to peer `name` now rather than on the first transfer (a
    /// warm-up); resolves at once when connected.
    pub async fn connect(&self, name: &str) -> Result<(), AgentError> {
        connection(self.sh.clone(), name.to_owned()).await.map(drop)
    }

    /// Whether the connection to peer `name` (made if needed) takes the
    /// same-host path: the peer's memory can be mapped here (the soft
    /// provider's shared-memory link), rather than reached over TCP or a
    /// NIC.
    pub async fn peer_same_host(&self, name: &str) -> Result<bool, AgentError> {
        let conn = connection(self.sh.clone(), name.to_owned()).await?;
        let mapped = conn.transport.map_remote(&conn.ring_out).await;
        mapped.map(|m| m.is_some()).map_err(|e| AgentError::from_transport(name, e))
    }

    /// Starts a request: moves every piece — `(local slice, remote block)`,
    /// written from the local slice into the peer's block for
    /// [`Op::Write`], read from the block into the slice for [`Op::Read`] —
    /// as one unit, then, with `notify`, delivers that message (up to
    /// [`MAX_MESSAGE`] bytes) to the peer once all of them are placed.
    ///
    /// Everything is checked first, and an error here means nothing moved:
    /// an unknown peer, a piece whose two sides differ in length, a local
    /// slice of memory not [`register`](Self::register)ed, a remote block
    /// outside the peer's published regions, a message too long. Pieces
    /// adjacent on both sides are coalesced into one operation; the rest
    /// are posted together (the transport stripes and pipelines them).
    ///
    /// The returned [`Transfer`] resolves when every piece is placed (and
    /// the notification has landed), or with the first error, which names
    /// the peer: a dead peer is found within the transport's timeout.
    /// Requests to one peer may complete in any order; the peer receives
    /// their notifications in the order their transfers saw completion.
    pub fn transfer<'a, L: LocalBlock<'a>>(
        &self,
        op: Op,
        peer: &str,
        pieces: &[(L, RemoteBlock)],
        notify: Option<&[u8]>,
    ) -> Result<Transfer<'a>, AgentError> {
        if let Some(m) = notify {
            if m.len() > MAX_MESSAGE {
                return Err(AgentError::invalid(
                    "transfer",
                    format!("with peer {peer:?}: the notification is {} bytes; at most {MAX_MESSAGE}", m.len()),
                ));
            }
        }
        let st = self.sh.lock();
        let entry = st.peers.get(peer).ok_or_else(|| AgentError::UnknownPeer { name: peer.into() })?;
        let mut locals: Vec<LocalMem<'a>> = Vec::new();
        let mut index: HashMap<usize, usize> = HashMap::new();
        let mut ins = Vec::with_capacity(pieces.len());
        let mut bytes = 0u64;
        for (i, (l, r)) in pieces.iter().enumerate() {
            let (local_mem, off, len) = l.parts();
            let mem = local_mem.get();
            let at = mem as *const RdmaMemory as usize;
            let local = match index.get(&at) {
                Some(&k) => k,
                None => {
                    let rb = mem.remote_buffer();
                    if !st.regions.iter().any(|r| r.remote() == rb) {
                        return Err(AgentError::invalid(
                            "transfer",
                            format!(
                                "with peer {peer:?}: piece {i}: the local memory is not registered with this agent \
                                 (register it first)"
                            ),
                        ));
                    }
                    locals.push(local_mem.clone());
                    index.insert(at, locals.len() - 1);
                    locals.len() - 1
                }
            };
            ins.push(PieceIn { local, local_off: off, local_len: len, remote: *r });
            bytes += len as u64;
        }
        let plan = plan::plan(peer, &ins, |id| entry.meta.region(id).map(|r| r.len))?;
        let mut remotes: Vec<(u32, RdmaRemoteBuffer)> = Vec::new();
        for o in &plan {
            if !remotes.iter().any(|(id, _)| *id == o.region) {
                remotes.push((o.region, entry.meta.region(o.region).expect("planned").remote()));
            }
        }
        let peer_token = entry.meta.token.clone();
        let ready = match &entry.link {
            Link::Ready(c) if c.usable() => Some(c.clone()),
            _ => None,
        };
        drop(st);
        let c = &self.sh.counters;
        Counters::add(&c.transfers, 1);
        Counters::add(&c.pieces, pieces.len() as u64);
        Counters::add(&c.bytes, bytes);
        let posting =
            Posting { op, plan, locals, remotes, peer_token, notify: notify.map(<[u8]>::to_vec), counters: c.clone() };
        match ready {
            Some(conn) => Transfer::posted(peer, &conn, posting),
            None => Ok(Transfer::connecting(peer, connection(self.sh.clone(), peer.to_owned()).boxed(), posting)),
        }
    }

    /// Sends peer `peer` a notification that moves no data (a request with
    /// no pieces).
    pub fn notify(&self, peer: &str, message: &[u8]) -> Result<Transfer<'static>, AgentError> {
        self.transfer::<View<'static>>(Op::Write, peer, &[], Some(message))
    }

    /// The notifications peers send this agent, as an async stream of
    /// [`Notification`]s, each yielded once (streams and
    /// [`try_notifications`](Self::try_notifications) share one queue).
    pub fn notifications(&self) -> Notifications {
        Notifications::new(self.sh.queue.clone())
    }

    /// Takes every notification received and not yet taken, without
    /// waiting (for callers that poll).
    pub fn try_notifications(&self) -> Vec<Notification> {
        self.sh.queue.drain()
    }

    /// Notifications received and not yet taken.
    pub fn pending_notifications(&self) -> usize {
        self.sh.queue.len()
    }

    /// What the agent has done so far.
    pub fn stats(&self) -> AgentStats {
        self.sh.counters.snapshot()
    }
}

impl Drop for TransferAgent {
    fn drop(&mut self) {
        for l in &self.listeners {
            l.abort();
        }
        self.sh.queue.close();
        // Closes every connection (transfers still in flight end with
        // PeerRemoved) unless a pending connection attempt still holds
        // the shared state; it lets go within its timeout.
        let peers = std::mem::take(&mut self.sh.lock().peers);
        drop(peers);
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use rmacomm_transport::RdmaMemory;

    use super::*;
    use crate::connection::Conn;
    use crate::ring;

    fn conn_to(a: &TransferAgent, peer: &str) -> Option<Arc<Conn>> {
        match a.sh.lock().peers.get(peer).map(|e| &e.link) {
            Some(Link::Ready(c)) => Some(c.clone()),
            _ => None,
        }
    }

    /// A peer's metadata whose first address reaches another agent (the
    /// same port on another interface, or a process that took a dead
    /// agent's port): the hello goes on to the next address. The other
    /// agent's wrong-token refusal was the answer ("stale or foreign
    /// metadata"), the right agent never tried.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_address_where_another_agent_answers_is_passed_over() {
        let config = AgentConfig::default()
            .with_transport(rmacomm_transport::TransportConfig::default().with_timeout(Some(Duration::from_secs(30))));
        let decode = TransferAgent::new("decode", config.clone()).unwrap();
        let stranger = TransferAgent::new("stranger", config.clone()).unwrap();
        let prefill = TransferAgent::new("prefill", config).unwrap();
        let mut meta = decode.sh.metadata();
        meta.control.insert(0, stranger.sh.control[0]);
        prefill.add_peer(&meta.encode()).unwrap();
        prefill.notify("decode", b"through the second address").unwrap().await.unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while decode.try_notifications().is_empty() {
            assert!(Instant::now() < deadline, "decode got no notification");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // Only the stranger's addresses: the error says the metadata is
        // not this agent's, not that its process is gone.
        let mut meta = decode.sh.metadata();
        meta.name = "ghost".into();
        meta.control = stranger.sh.control.clone();
        prefill.add_peer(&meta.encode()).unwrap();
        let e = prefill.notify("ghost", b"x").unwrap().await.unwrap_err();
        assert!(e.to_string().contains("another agent answered") && e.to_string().contains("stale"), "{e}");
    }

    /// Both agents connect at once; "a" wins the tie, but its own hello
    /// never reaches "b" (its metadata of b names a listener that never
    /// answers). b asks again meanwhile, and once a's attempt has failed a
    /// accepts b's: b's request is delivered (it waited for a's connection
    /// until its whole timeout, then failed).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_crossing_lost_to_a_peer_whose_own_attempt_fails_is_asked_again() {
        let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let config = |secs| {
            AgentConfig::default()
                .with_transport(
                    rmacomm_transport::TransportConfig::default().with_timeout(Some(Duration::from_secs(30))),
                )
                .with_connect_timeout(Duration::from_secs(secs))
        };
        let a = TransferAgent::new("a", config(1)).unwrap();
        let b = TransferAgent::new("b", config(30)).unwrap();
        b.add_peer(&a.metadata()).unwrap();
        let mut of_b = b.sh.metadata();
        of_b.control = vec![silent.local_addr().unwrap()];
        a.add_peer(&of_b.encode()).unwrap();
        // a's attempt first (it waits on the silent listener), then b's.
        let mut from_a = a.notify("b", b"from a").unwrap();
        assert!(matches!(from_a.status(), crate::TransferStatus::InProgress));
        tokio::time::sleep(Duration::from_millis(50)).await;
        b.notify("a", b"from b").unwrap().await.unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let got = a.try_notifications();
            if let Some(n) = got.first() {
                assert_eq!((n.peer.as_str(), n.message.as_slice()), ("b", b"from b".as_slice()));
                break;
            }
            assert!(Instant::now() < deadline, "a got no notification");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        drop(from_a);
    }

    /// A notification slot the receiver finds corrupt (a peer of another
    /// version, or a bug) ends the connection for both sides: the sender
    /// sees it broken. The receiver only marked it unusable and kept the
    /// transport, so the sender's later notifications completed unread,
    /// then waited forever for ring credit.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_corrupt_ring_ends_the_connection_for_the_sender_too() {
        let config = AgentConfig::default()
            .with_transport(rmacomm_transport::TransportConfig::default().with_timeout(Some(Duration::from_secs(30))));
        let decode = TransferAgent::new("decode", config.clone()).unwrap();
        let prefill = TransferAgent::new("prefill", config).unwrap();
        prefill.add_peer(&decode.metadata()).unwrap();
        prefill.notify("decode", b"first").unwrap().await.unwrap();
        let c = conn_to(&prefill, "decode").expect("connected");
        // Slot 1 (the next one) overwritten with garbage, counted as a
        // notification.
        let junk = RdmaMemory::alloc_for(&c.transport, 64).unwrap();
        junk.write_from(0, &[0xA5; 64]).unwrap();
        let slot = c.ring_out.slice(ring::slot_offset(1, c.slots_out) as u64, 64).unwrap();
        c.transport.write(junk.view(0, 64).unwrap(), &slot, true).await.unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while c.usable() {
            assert!(
                Instant::now() < deadline,
                "the sender's connection stayed up after the receiver found its ring corrupt"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(conn_to(&decode, "prefill").is_none_or(|d| d.id != c.id), "decode kept the corrupt connection");
        // The next request connects again and is delivered.
        drop(c);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if prefill.notify("decode", b"again").unwrap().await.is_ok() {
                break;
            }
            assert!(Instant::now() < deadline, "no new connection within 10 s");
        }
        let first = decode.try_notifications();
        assert_eq!(first.iter().map(|n| n.message.as_slice()).collect::<Vec<_>>()[..1], [b"first".as_slice()]);
    }
}
