//! [`TransferAgent`]: one per process; its peers, its registered regions,
//! and how connections to peers are made (lazily, by a handshake with the
//! peer's listener, one transport per peer).

use std::collections::HashMap;
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use futures::FutureExt;
use rmacomm_transport::{RdmaMemory, RdmaRemoteBuffer, RdmaTransport, View};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Semaphore};
use tokio::task::AbortHandle;

use crate::block::LocalBlock;
use crate::connection::{Conn, Prepared};
use crate::handshake::{self, Hello, LinkState, Reply};
use crate::metadata::{check_name, new_token, same_token, Metadata, PeerRegion, Region, MAX_REGIONS};
use crate::notifications::{Notification, Notifications, Queue};
use crate::plan::{self, PieceIn};
use crate::ring::{self, MAX_MESSAGE};
use crate::stats::{AgentStats, Counters};
use crate::transfer::{Posting, Transfer};
use crate::{AgentConfig, AgentError, Op, RemoteBlock};

/// How long a peer that connected to the listener has to send its hello.
const HELLO_DEADLINE: Duration = Duration::from_secs(10);
/// Handshakes answered at once; more connections are closed unanswered.
const MAX_HANDSHAKES: usize = 64;
/// How long one of a peer's listener addresses is tried.
const ADDRESS_TIMEOUT: Duration = Duration::from_secs(3);

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

/// What the agent's tasks share.
pub(crate) struct Shared {
    name: String,
    token: String,
    control: Vec<SocketAddr>,
    config: AgentConfig,
    /// Never connected: pins the device every transport of the agent uses
    /// (so registrations checked against it are usable by all of them).
    anchor: RdmaTransport,
    st: Mutex<State>,
    queue: Arc<Queue>,
    counters: Arc<Counters>,
    next_attempt: AtomicU64,
    handshakes: Arc<Semaphore>,
}

#[derive(Default)]
struct State {
    regions: Vec<Region>,
    next_region: u32,
    peers: HashMap<String, PeerEntry>,
}

struct PeerEntry {
    meta: Metadata,
    link: Link,
    /// Why the last connection attempt failed (cleared by a success).
    failed: Option<AgentError>,
    /// Bumped on every change of `link`: what waiters for a connection
    /// sleep on.
    changed: watch::Sender<u64>,
}

enum Link {
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
    fn new(meta: Metadata) -> Self {
        PeerEntry { meta, link: Link::Idle, failed: None, changed: watch::Sender::new(0) }
    }

    fn set(&mut self, link: Link) {
        self.link = link;
        self.changed.send_modify(|v| *v += 1);
    }

    fn state(&self) -> LinkState {
        match self.link {
            Link::Idle => LinkState::Idle,
            Link::Connecting { mine, .. } => LinkState::Connecting { mine },
            Link::Ready(_) => LinkState::Ready,
        }
    }

    fn attempt(&self) -> Option<u64> {
        match self.link {
            Link::Connecting { attempt, .. } => Some(attempt),
            _ => None,
        }
    }
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
            st: Mutex::new(State { next_region: 1, ..State::default() }),
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
        let id = st.next_region;
        st.next_region += 1;
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

    /// The regions peer `name` published, by id.
    pub fn peer_regions(&self, name: &str) -> Result<Vec<PeerRegion>, AgentError> {
        let st = self.sh.lock();
        let e = st.peers.get(name).ok_or_else(|| AgentError::UnknownPeer { name: name.into() })?;
        let mut v: Vec<PeerRegion> = e.meta.regions.iter().map(|r| PeerRegion { id: r.id, len: r.len }).collect();
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
                    format!("the notification is {} bytes; at most {MAX_MESSAGE}", m.len()),
                ));
            }
        }
        let st = self.sh.lock();
        let entry = st.peers.get(peer).ok_or_else(|| AgentError::UnknownPeer { name: peer.into() })?;
        let mut locals: Vec<&'a RdmaMemory> = Vec::new();
        let mut index: HashMap<usize, usize> = HashMap::new();
        let mut ins = Vec::with_capacity(pieces.len());
        let mut bytes = 0u64;
        for (i, (l, r)) in pieces.iter().enumerate() {
            let (mem, off, len) = l.parts();
            let at = mem as *const RdmaMemory as usize;
            let local = match index.get(&at) {
                Some(&k) => k,
                None => {
                    let rb = mem.remote_buffer();
                    if !st.regions.iter().any(|r| r.remote() == rb) {
                        return Err(AgentError::invalid(
                            "transfer",
                            format!(
                                "piece {i}: the local memory is not registered with this agent (register it first)"
                            ),
                        ));
                    }
                    locals.push(mem);
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
        let ready = match &entry.link {
            Link::Ready(c) if c.usable() => Some(c.clone()),
            _ => None,
        };
        drop(st);
        let c = &self.sh.counters;
        Counters::add(&c.transfers, 1);
        Counters::add(&c.pieces, pieces.len() as u64);
        Counters::add(&c.bytes, bytes);
        let posting = Posting { op, plan, locals, remotes, notify: notify.map(<[u8]>::to_vec), counters: c.clone() };
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

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.st.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn metadata(&self) -> Metadata {
        let regions = self.lock().regions.clone();
        Metadata::new(&self.name, &self.token, self.control.clone(), regions)
    }

    /// Adds a peer, or refreshes what is known of it.
    fn learn(&self, meta: Metadata) {
        let mut st = self.lock();
        match st.peers.get_mut(&meta.name) {
            Some(e) if same_token(&e.meta.token, &meta.token) => e.meta = meta,
            Some(e) => {
                // Another incarnation: the old connection leads nowhere.
                e.meta = meta;
                e.failed = None;
                e.set(Link::Idle);
            }
            None => {
                st.peers.insert(meta.name.clone(), PeerEntry::new(meta));
            }
        }
    }

    /// Ends connection attempt `attempt` to `peer` with its result, unless
    /// the link has moved on since (another attempt replaced it).
    fn settle(&self, peer: &str, attempt: u64, r: Result<Arc<Conn>, AgentError>) {
        let mut st = self.lock();
        let Some(e) = st.peers.get_mut(peer) else { return };
        if e.attempt() != Some(attempt) {
            return;
        }
        match r {
            Ok(c) => {
                Counters::add(&self.counters.connections, 1);
                e.failed = None;
                e.set(Link::Ready(c));
            }
            Err(err) => {
                e.failed = Some(err);
                e.set(Link::Idle);
            }
        }
    }

    /// Answers a hello: the reply, and what then completes the connection.
    fn on_hello(self: &Arc<Self>, h: Hello) -> (Reply, Option<impl std::future::Future<Output = ()> + Send + 'static>) {
        let refuse = |reason: String| (Reply::Refused { reason }, None);
        if h.v != handshake::VERSION {
            return refuse(format!("handshake version {} (this agent speaks {})", h.v, handshake::VERSION));
        }
        if !same_token(&h.token, &self.token) {
            return refuse("wrong token: the caller holds stale or foreign metadata of this agent".into());
        }
        let meta = match Metadata::decode(&h.from) {
            Ok(m) => m,
            Err(e) => return refuse(e.to_string()),
        };
        if meta.name == self.name {
            return refuse(format!("the caller is named {:?} too; agent names must be unique", self.name));
        }
        let name = meta.name.clone();
        self.learn(meta);
        let attempt = {
            let mut st = self.lock();
            let Some(e) = st.peers.get_mut(&name) else { return refuse("this agent is shutting down".into()) };
            if !handshake::on_hello(e.state(), &self.name, &name) {
                return (Reply::Crossing, None);
            }
            let attempt = self.next_attempt.fetch_add(1, Ordering::Relaxed);
            e.set(Link::Connecting { mine: false, attempt });
            attempt
        };
        let slots = self.config.notification_slots;
        let prepared = match Prepared::new(&self.config.transport, slots) {
            Ok(p) => p,
            Err(e) => {
                let err = AgentError::from_transport(&name, e.clone());
                self.settle(&name, attempt, Err(err));
                return refuse(format!("it could not make a transport: {e}"));
            }
        };
        let reply = Reply::Accepted { url: prepared.url.clone(), ring: prepared.ring(), slots };
        let sh = self.clone();
        let finish = async move {
            let connect = prepared.finish(&name, &h.url, h.ring, h.slots, sh.queue.clone(), sh.counters.clone());
            let r = match tokio::time::timeout(sh.config.connect_timeout, connect).await {
                Ok(r) => r,
                Err(_) => {
                    Err(AgentError::Timeout { peer: name.clone(), op: "connect", after: sh.config.connect_timeout })
                }
            };
            sh.settle(&name, attempt, r);
        };
        (reply, Some(finish))
    }
}

/// A live connection to `peer`, made if there is none; waits for one being
/// made (by this side or by the peer's handshake). The attempt itself runs
/// in its own task, so that dropping the caller leaves the link consistent.
pub(crate) async fn connection(sh: Arc<Shared>, peer: String) -> Result<Arc<Conn>, AgentError> {
    let timeout = sh.config.connect_timeout;
    let deadline = tokio::time::Instant::now() + timeout;
    let mut waited = false;
    loop {
        let mut changed = {
            let mut st = sh.lock();
            let e = st.peers.get_mut(&peer).ok_or_else(|| AgentError::UnknownPeer { name: peer.clone() })?;
            match &e.link {
                Link::Ready(c) if c.usable() => return Ok(c.clone()),
                Link::Connecting { .. } => {}
                Link::Idle | Link::Ready(_) => {
                    // An attempt this call waited for failed: that is the answer.
                    if let (true, Some(err)) = (waited, &e.failed) {
                        return Err(err.clone());
                    }
                    let attempt = sh.next_attempt.fetch_add(1, Ordering::Relaxed);
                    e.set(Link::Connecting { mine: true, attempt });
                    tokio::spawn(initiate(sh.clone(), peer.clone(), e.meta.clone(), attempt));
                }
            }
            e.changed.subscribe()
        };
        waited = true;
        match tokio::time::timeout_at(deadline, changed.changed()).await {
            Err(_) => return Err(AgentError::Timeout { peer, op: "connect", after: timeout }),
            // Ok(Err): the peer was removed; the next look says so.
            Ok(_) => continue,
        }
    }
}

/// Connection attempt `attempt` by this side's hello.
async fn initiate(sh: Arc<Shared>, peer: String, meta: Metadata, attempt: u64) {
    let timeout = sh.config.connect_timeout;
    let r = match tokio::time::timeout(timeout, hello(&sh, &peer, &meta)).await {
        Ok(r) => r,
        Err(_) => Err(AgentError::Timeout { peer: peer.clone(), op: "connect", after: timeout }),
    };
    match r {
        Ok(Some(conn)) => sh.settle(&peer, attempt, Ok(conn)),
        Ok(None) => {
            // A crossing the peer won: its hello replaces this attempt. If
            // that never happens (its attempt failed), this one fails.
            let mut changed = {
                let st = sh.lock();
                match st.peers.get(&peer) {
                    Some(e) if e.attempt() == Some(attempt) => e.changed.subscribe(),
                    _ => return,
                }
            };
            let _ = tokio::time::timeout(timeout, async {
                while changed.changed().await.is_ok() {
                    if sh.lock().peers.get(&peer).and_then(PeerEntry::attempt) != Some(attempt) {
                        return;
                    }
                }
            })
            .await;
            let reason = "both agents connected at once and the peer's connection never came".to_string();
            sh.settle(&peer, attempt, Err(AgentError::Unreachable { peer: peer.clone(), reason }));
        }
        Err(e) => sh.settle(&peer, attempt, Err(e)),
    }
}

/// Sends this side's hello to `peer` and completes the connection it
/// accepts; `None` when the peer answers that it is connecting too and
/// wins the tie.
async fn hello(sh: &Arc<Shared>, peer: &str, meta: &Metadata) -> Result<Option<Arc<Conn>>, AgentError> {
    let slots = sh.config.notification_slots;
    let prepared = Prepared::new(&sh.config.transport, slots).map_err(|e| AgentError::from_transport(peer, e))?;
    let h = Hello {
        v: handshake::VERSION,
        token: meta.token.clone(),
        from: sh.metadata().encode(),
        url: prepared.url.clone(),
        ring: prepared.ring(),
        slots,
    };
    let unreachable = |reason: String| AgentError::Unreachable { peer: peer.into(), reason };
    let mut stream = dial(&meta.control).await.map_err(unreachable)?;
    handshake::write_frame(&mut stream, &h).await.map_err(|e| unreachable(format!("the handshake failed ({e})")))?;
    let reply: Reply = handshake::read_frame(&mut stream)
        .await
        .map_err(|e| unreachable(format!("its agent closed the handshake ({e})")))?;
    match reply {
        Reply::Accepted { url, ring, slots } => {
            prepared.finish(peer, &url, ring, slots, sh.queue.clone(), sh.counters.clone()).await.map(Some)
        }
        Reply::Crossing => Ok(None),
        Reply::Refused { reason } => Err(unreachable(format!("its agent refused the connection: {reason}"))),
    }
}

/// Connects to the first of a peer's listener addresses that answers.
async fn dial(addrs: &[SocketAddr]) -> Result<TcpStream, String> {
    let mut why = Vec::new();
    for a in addrs {
        match tokio::time::timeout(ADDRESS_TIMEOUT, TcpStream::connect(a)).await {
            Ok(Ok(s)) => {
                let _ = s.set_nodelay(true);
                return Ok(s);
            }
            Ok(Err(e)) => why.push(format!("{a}: {e}")),
            Err(_) => why.push(format!("{a}: no answer within {ADDRESS_TIMEOUT:?}")),
        }
    }
    Err(format!("no agent listens at its addresses ({}); is its process alive?", why.join("; ")))
}

/// Accepts handshakes until the agent is dropped (which aborts this task).
async fn serve(listener: TcpListener, agent: Weak<Shared>) {
    loop {
        let stream = match listener.accept().await {
            Ok((s, _)) => s,
            Err(e) => {
                tracing::warn!("agent listener: accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let Some(sh) = agent.upgrade() else { return };
        // A full table closes the connection unanswered: its caller sees
        // the handshake fail and its transfer fails, naming this agent.
        let Ok(permit) = sh.handshakes.clone().try_acquire_owned() else { continue };
        drop(sh);
        let agent = agent.clone();
        tokio::spawn(async move {
            let _permit = permit;
            answer(agent, stream).await;
        });
    }
}

async fn answer(agent: Weak<Shared>, mut stream: TcpStream) {
    let _ = stream.set_nodelay(true);
    let h: Hello = match tokio::time::timeout(HELLO_DEADLINE, handshake::read_frame(&mut stream)).await {
        Ok(Ok(h)) => h,
        _ => return,
    };
    let Some(sh) = agent.upgrade() else { return };
    let (reply, finish) = sh.on_hello(h);
    drop(sh);
    if handshake::write_frame(&mut stream, &reply).await.is_err() {
        // The caller gave up; the transport's connect fails in its time.
        tracing::debug!("agent listener: the caller left before the reply");
    }
    if let Some(f) = finish {
        f.await;
    }
}

/// Binds the handshake listener(s) and says which addresses to publish.
fn bind_listeners(
    config: &AgentConfig,
    anchor: &RdmaTransport,
) -> Result<(Vec<std::net::TcpListener>, Vec<SocketAddr>), AgentError> {
    let bind = |a: SocketAddr| -> Result<(std::net::TcpListener, SocketAddr), AgentError> {
        let l = std::net::TcpListener::bind(a).map_err(|e| AgentError::os("bind the agent listener", &e))?;
        l.set_nonblocking(true).map_err(|e| AgentError::os("bind the agent listener", &e))?;
        let bound = l.local_addr().map_err(|e| AgentError::os("bind the agent listener", &e))?;
        Ok((l, bound))
    };
    let mut ips: Vec<IpAddr> = Vec::new();
    for a in anchor.tcp_addrs() {
        if !ips.contains(&a.ip()) {
            ips.push(a.ip());
        }
    }
    if ips.is_empty() {
        ips.push(IpAddr::V4(Ipv4Addr::LOCALHOST));
    }
    if let Some(want) = config.listen_addr {
        let (l, bound) = bind(want)?;
        let adv = if bound.ip().is_unspecified() {
            ips.iter().map(|ip| SocketAddr::new(*ip, bound.port())).collect()
        } else {
            vec![bound]
        };
        return Ok((vec![l], adv));
    }
    let mut ls = Vec::new();
    let mut adv: Vec<SocketAddr> = Vec::new();
    for ip in ips {
        // One port on every address where it is free.
        let port = adv.first().map_or(0, |a| a.port());
        let (l, bound) = bind(SocketAddr::new(ip, port)).or_else(|_| bind(SocketAddr::new(ip, 0)))?;
        ls.push(l);
        adv.push(bound);
    }
    Ok((ls, adv))
}
