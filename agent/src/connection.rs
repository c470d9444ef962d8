//! One connection to one peer: its transport (one virtual QP), the two
//! notification rings, and the two tasks that serve them — the notifier,
//! which places this side's notifications in the peer's ring one at a time
//! and in order, and the drainer, which takes the peer's notifications off
//! this side's ring as they land.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use futures::FutureExt;
use ibverbx::LoadBalancing;
use rmacomm_transport::{MappedBuffer, RdmaMemory, RdmaRemoteBuffer, RdmaTransport, TransportConfig};
use tokio::sync::{mpsc, oneshot};

use crate::notifications::{Notification, Queue};
use crate::ring::{self, Credit};
use crate::shared::Shared;
use crate::stats::Counters;
use crate::AgentError;

/// A notification waiting for the notifier, with where its result goes.
pub(crate) struct Job {
    pub(crate) message: Vec<u8>,
    pub(crate) done: oneshot::Sender<Result<(), AgentError>>,
}

/// A connection whose transport and ring exist, before the peer's answer.
pub(crate) struct Prepared {
    transport: RdmaTransport,
    pub(crate) url: String,
    ring_in: RdmaMemory,
    slots_in: u32,
    timeout: Option<Duration>,
    /// Notifying writes are counted at the peer in the order they were
    /// posted, each after every write posted before it: one QP, or DQPLB's
    /// receive sequencer (not spray).
    ordered: bool,
}

impl Prepared {
    pub(crate) fn new(config: &TransportConfig, slots: u32) -> Result<Prepared, rmacomm_transport::TransportError> {
        let transport = RdmaTransport::new(config.clone())?;
        let url = transport.bind()?;
        let ring_in = RdmaMemory::alloc_for(&transport, ring::ring_len(slots))?;
        let ordered = config.qps <= 1 || config.load_balancing == LoadBalancing::Dqplb;
        Ok(Prepared { transport, url, ring_in, slots_in: slots, timeout: config.timeout, ordered })
    }

    /// Where the peer's notifications are to land.
    pub(crate) fn ring(&self) -> RdmaRemoteBuffer {
        self.ring_in.remote_buffer()
    }

    /// Connects to the peer's transport and starts the connection's tasks;
    /// `id` names the connection on both sides.
    #[allow(clippy::too_many_arguments)]
    /// `peer_token`: the token of the peer's metadata this connection is
    /// made with (which incarnation of the peer it reaches).
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn finish(
        self,
        id: u64,
        peer: &str,
        peer_token: &str,
        peer_url: &str,
        ring_out: RdmaRemoteBuffer,
        slots_out: u32,
        sh: &Arc<Shared>,
    ) -> Result<Arc<Conn>, AgentError> {
        let (queue, counters) = (sh.queue.clone(), sh.counters.clone());
        if slots_out == 0
            || slots_out > ring::MAX_SLOTS
            || ring_out.len < ring::ring_len(slots_out) as u64
            || !ring_out.is_addressable()
        {
            return Err(AgentError::Unreachable {
                peer: peer.into(),
                reason: format!("its notification ring ({} bytes, {slots_out} slots) is malformed", ring_out.len),
            });
        }
        self.transport
            .connect(peer_url)
            .await
            .map_err(|e| AgentError::Unreachable { peer: peer.into(), reason: e.to_string() })?;
        // One slot image per ring slot (the image of notification `seq`
        // waits in slot `seq % slots` until the peer consumed it, so
        // pipelined notifications never overwrite one still being sent),
        // and a word the credit is read into.
        let staging = RdmaMemory::alloc_for(&self.transport, ring::HEAD + slots_out as usize * ring::SLOT)
            .map_err(|e| AgentError::from_transport(peer, e))?;
        // The peer's notification ring maps here when it is on this host:
        // then its blocks can be copied by the caller too.
        let same_host = matches!(self.transport.map_remote(&ring_out).await, Ok(Some(_)));
        let (tx, rx) = mpsc::unbounded_channel();
        let conn = Arc::new(Conn {
            id,
            peer: peer.into(),
            peer_token: peer_token.into(),
            transport: self.transport,
            ring_out,
            slots_out,
            staging: Arc::new(staging),
            notify_tx: tx,
            broken: AtomicBool::new(false),
            lane: Mutex::new(Lane { credit: Credit::new(slots_out), queued: 0 }),
            ordered: self.ordered,
            overflowing: Arc::new(AtomicUsize::new(0)),
            same_host,
            timeout: self.timeout,
            counters: counters.clone(),
        });
        let weak = Arc::downgrade(&conn);
        let out = Outgoing { conn: weak.clone(), peer: peer.into() };
        tokio::spawn(notifier(out, rx));
        let inc = Incoming {
            conn: weak,
            sh: Arc::downgrade(sh),
            peer: peer.into(),
            ring: self.ring_in,
            slots: self.slots_in,
            next: 0,
        };
        tokio::spawn(drainer(inc, queue, counters));
        Ok(conn)
    }
}

/// A live connection, owned by the agent's peer table (transfers borrow it
/// while they post). Dropped, it drops the transport: transfers still
/// pending on it end with [`AgentError::PeerRemoved`], the peer's with
/// [`AgentError::PeerLost`], and both tasks end.
pub(crate) struct Conn {
    /// Chosen by the side that accepted the handshake; a later hello names
    /// the connection it replaces by it.
    pub(crate) id: u64,
    pub(crate) peer: String,
    /// The token of the peer's metadata: which incarnation of the peer
    /// this connection reaches (a secret: never shown).
    pub(crate) peer_token: String,
    pub(crate) transport: RdmaTransport,
    /// The peer's ring for this side's notifications, and its slots.
    pub(crate) ring_out: RdmaRemoteBuffer,
    pub(crate) slots_out: u32,
    /// Word 0: where the peer's `consumed` is read into; from `HEAD`, one
    /// slot image per ring slot.
    staging: Arc<RdmaMemory>,
    /// Notifications that must wait (for ring credit, or, under spray, for
    /// the previous one to complete) go to the notifier task.
    notify_tx: mpsc::UnboundedSender<Job>,
    /// The drainer found the connection broken, or the ring corrupt.
    broken: AtomicBool,
    /// Claiming a notification's seq and posting it happen under this
    /// lock, so that seq order is post order. Pieces of a request whose
    /// notification is posted right behind them are posted under it too.
    lane: Mutex<Lane>,
    /// See [`Prepared::ordered`].
    pub(crate) ordered: bool,
    /// Requests whose pieces did not all get an in-flight slot when posted
    /// (some wait for one, and are posted later by the request's polls):
    /// while any is in flight, no notification is posted right behind its
    /// pieces, as it could pass pieces still waiting.
    pub(crate) overflowing: Arc<AtomicUsize>,
    /// The peer's memory maps here (same host, shared segments).
    pub(crate) same_host: bool,
    timeout: Option<Duration>,
    counters: Arc<Counters>,
}

/// The notification lane of a connection (see [`Conn::lane`]).
pub(crate) struct Lane {
    credit: Credit,
    /// Notifications handed to the notifier and not yet posted: while there
    /// are any, later ones queue behind them.
    queued: usize,
}

impl fmt::Debug for Conn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Conn").field("peer", &self.peer).field("transport", &self.transport).finish()
    }
}

impl Conn {
    /// Whether transfers may still use it (else a new one is made).
    pub(crate) fn usable(&self) -> bool {
        !self.broken.load(Ordering::Acquire) && self.transport.error().is_none()
    }

    fn mark_broken(&self) {
        self.broken.store(true, Ordering::Release);
    }

    /// The notification lane, locked.
    pub(crate) fn lane(&self) -> MutexGuard<'_, Lane> {
        self.lane.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The mappings holding `regions` (each with the region's offset in
    /// it) when every one of them is mapped here; else `None`, after the
    /// transport started mapping those not mapped yet: a later request may
    /// find them (see [`RdmaTransport::cached_mapping`], whose mappings the
    /// transport's own same-host copies share).
    pub(crate) fn mapped(&self, regions: &[(u32, RdmaRemoteBuffer)]) -> Option<Vec<(Arc<MappedBuffer>, usize)>> {
        if !self.same_host {
            return None;
        }
        // Every region is asked for, so that all of them start mapping.
        let maps: Vec<_> = regions.iter().map(|(_, r)| self.transport.cached_mapping(r)).collect();
        maps.into_iter().collect()
    }

    /// Posts `message` as this side's next notification now, behind what
    /// was posted before, if the peer's ring has room and no notification
    /// waits at the notifier; the future resolves when it is in the peer's
    /// ring. `None`: post it through the notifier ([`Job`]).
    pub(crate) fn try_notify_now(
        &self,
        lane: &mut Lane,
        message: &[u8],
    ) -> Option<BoxFuture<'static, Result<(), AgentError>>> {
        if lane.queued > 0 || !lane.credit.has_room() {
            return None;
        }
        self.post_notification(lane, message)
    }

    /// Hands `message` to the notifier, behind the notifications already
    /// there; `done` gets its result.
    pub(crate) fn queue_notification(
        &self,
        lane: &mut Lane,
        message: Vec<u8>,
        done: oneshot::Sender<Result<(), AgentError>>,
    ) -> Result<(), AgentError> {
        self.notify_tx.send(Job { message, done }).map_err(|_| AgentError::PeerRemoved { peer: self.peer.clone() })?;
        lane.queued += 1;
        Ok(())
    }

    /// Posts the notification of the next seq and claims the seq (the lane
    /// has room) — only if the transport posts it now: `None`, with nothing
    /// claimed or posted, when every in-flight slot is taken. A seq is
    /// never claimed by a write still to be posted: the peer counts
    /// notifications in the order they are posted, and one posted later
    /// (when a dropped transfer's future was never polled again, or behind
    /// the next one) would leave the peer reading a slot that holds none.
    fn post_notification(&self, lane: &mut Lane, message: &[u8]) -> Option<BoxFuture<'static, Result<(), AgentError>>> {
        let seq = lane.credit.next();
        let image = ring::encode(seq, message);
        let at = ring::HEAD + (seq % u64::from(self.slots_out)) as usize * ring::SLOT;
        let dst = self
            .ring_out
            .slice(ring::slot_offset(seq, self.slots_out) as u64, image.len() as u64)
            .expect("a slot fits the ring");
        let peer = self.peer.clone();
        if let Err(e) = self.staging.write_from(at, &image) {
            return Some(futures::future::ready(Err(AgentError::from_transport(&peer, e))).boxed());
        }
        let write = self.transport.try_write_owned(self.staging.clone(), at, image.len(), &dst, true)?;
        lane.credit.sent();
        let counters = self.counters.clone();
        Some(
            async move {
                write.await.map_err(|e| AgentError::from_transport(&peer, e))?;
                Counters::add(&counters.notifications_sent, 1);
                Ok(())
            }
            .boxed(),
        )
    }
}

/// The notifier's side of a connection.
struct Outgoing {
    conn: Weak<Conn>,
    peer: String,
}

/// Posts the notifications that could not be posted at once: when the
/// peer's ring had no room, or, under spray striping (where notifying
/// writes may be counted out of order), one at a time, each once the
/// previous completed. Ends when the connection and every transfer holding
/// a sender are gone.
async fn notifier(out: Outgoing, mut jobs: mpsc::UnboundedReceiver<Job>) {
    while let Some(job) = jobs.recv().await {
        let r = match post_one(&out, &job.message).await {
            Ok(posted) => posted.await,
            Err(e) => {
                if let Some(c) = out.conn.upgrade() {
                    c.lane().queued -= 1;
                }
                Err(e)
            }
        };
        let _ = job.done.send(r);
    }
}

/// A `Timeout` naming `op` once `timeout` has passed since `started`.
fn check_timeout(peer: &str, started: Instant, timeout: Option<Duration>, op: &'static str) -> Result<(), AgentError> {
    match timeout {
        Some(t) if started.elapsed() >= t => Err(AgentError::Timeout { peer: peer.to_owned(), op, after: t }),
        _ => Ok(()),
    }
}

/// Waits for room in the peer's ring, and for an in-flight slot, and posts
/// the notification (taking it off the lane's queue count in the same
/// step).
async fn post_one(out: &Outgoing, message: &[u8]) -> Result<BoxFuture<'static, Result<(), AgentError>>, AgentError> {
    let peer = out.peer.clone();
    let started = Instant::now();
    let mut backoff = Duration::from_micros(20);
    loop {
        let c = out.conn.upgrade().ok_or_else(|| AgentError::PeerRemoved { peer: peer.clone() })?;
        let slots_taken = {
            let mut lane = c.lane();
            if lane.credit.has_room() {
                match c.post_notification(&mut lane, message) {
                    Some(posted) => {
                        lane.queued -= 1;
                        return Ok(posted);
                    }
                    None => true,
                }
            } else {
                false
            }
        };
        if slots_taken {
            // Every in-flight slot is taken (the transfers' pieces): look
            // again shortly. Later notifications queue behind this one.
            check_timeout(&peer, started, c.timeout, "notification (no in-flight slot frees)")?;
            drop(c);
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_millis(2));
            continue;
        }
        // The peer's agent has not (as far as we know) taken the
        // notification in the slot we need off its ring: ask how many it
        // consumed (an 8-byte read into the staging head).
        let word = c.ring_out.slice(0, 8).expect("the ring has a head");
        let read = c.transport.read_with_timeout(c.staging.view_mut(0, 8).expect("8 bytes"), &word, c.timeout);
        read.await.map_err(|e| AgentError::from_transport(&peer, e))?;
        let mut v = [0u8; 8];
        c.staging.read_into(0, &mut v).map_err(|e| AgentError::from_transport(&peer, e))?;
        let has_room = {
            let mut lane = c.lane();
            lane.credit.update(u64::from_le_bytes(v));
            lane.credit.has_room()
        };
        if !has_room {
            check_timeout(&peer, started, c.timeout, "notification (the peer's ring stays full)")?;
            drop(c);
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_millis(2));
        }
    }
}

/// The drainer's side of a connection.
struct Incoming {
    conn: Weak<Conn>,
    /// The agent, whose table drops a connection whose ring is corrupt.
    sh: Weak<Shared>,
    peer: String,
    ring: RdmaMemory,
    slots: u32,
    next: u64,
}

/// Takes each notification off this side's ring as its write is counted,
/// queues it, and publishes how many were consumed (the peer reads that
/// before reusing a slot). Ends with the connection.
async fn drainer(mut inc: Incoming, queue: Arc<Queue>, counters: Arc<Counters>) {
    loop {
        let wait = match inc.conn.upgrade() {
            Some(c) => c.transport.wait_for_write_with_timeout(None),
            None => return,
        };
        if let Err(e) = wait.await {
            tracing::debug!("connection to {} ended: {e}", inc.peer);
            if let Some(c) = inc.conn.upgrade() {
                c.mark_broken();
            }
            return;
        }
        match take(&mut inc) {
            Ok(message) => {
                Counters::add(&counters.notifications_received, 1);
                queue.push(Notification { peer: inc.peer.clone(), message });
            }
            Err(why) => {
                tracing::warn!("dropping the connection to {}: {why}", inc.peer);
                if let Some(c) = inc.conn.upgrade() {
                    c.mark_broken();
                    // Dropped for real: the peer sees the connection end
                    // (it went on writing notifications nobody read, each
                    // one's request done, until the ring filled and its
                    // requests waited for credit that never came).
                    if let Some(sh) = inc.sh.upgrade() {
                        sh.drop_conn(&inc.peer, c.id);
                    }
                }
                return;
            }
        }
    }
}

/// Reads notification `inc.next` (its write has been counted, so it is
/// whole) and marks it consumed.
fn take(inc: &mut Incoming) -> Result<Vec<u8>, String> {
    let off = ring::slot_offset(inc.next, inc.slots);
    let mut h = [0u8; ring::HEADER];
    inc.ring.read_into(off, &mut h).map_err(|e| e.to_string())?;
    let len = ring::decode_header(&h, inc.next)?;
    let mut message = vec![0u8; len];
    inc.ring.read_into(off + ring::HEADER, &mut message).map_err(|e| e.to_string())?;
    inc.next += 1;
    inc.ring.atomic_u64(0).map_err(|e| e.to_string())?.store(inc.next, Ordering::Release);
    Ok(message)
}
