//! One connection to one peer: its transport (one virtual QP), the two
//! notification rings, and the two tasks that serve them — the notifier,
//! which places this side's notifications in the peer's ring one at a time
//! and in order, and the drainer, which takes the peer's notifications off
//! this side's ring as they land.

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use rmacomm_transport::{RdmaMemory, RdmaRemoteBuffer, RdmaTransport, TransportConfig};
use tokio::sync::{mpsc, oneshot};

use crate::notifications::{Notification, Queue};
use crate::ring::{self, Credit};
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
}

impl Prepared {
    pub(crate) fn new(config: &TransportConfig, slots: u32) -> Result<Prepared, rmacomm_transport::TransportError> {
        let transport = RdmaTransport::new(config.clone())?;
        let url = transport.bind()?;
        let ring_in = RdmaMemory::alloc_for(&transport, ring::ring_len(slots))?;
        Ok(Prepared { transport, url, ring_in, slots_in: slots, timeout: config.timeout })
    }

    /// Where the peer's notifications are to land.
    pub(crate) fn ring(&self) -> RdmaRemoteBuffer {
        self.ring_in.remote_buffer()
    }

    /// Connects to the peer's transport and starts the connection's tasks;
    /// `id` names the connection on both sides.
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn finish(
        self,
        id: u64,
        peer: &str,
        peer_url: &str,
        ring_out: RdmaRemoteBuffer,
        slots_out: u32,
        queue: Arc<Queue>,
        counters: Arc<Counters>,
    ) -> Result<Arc<Conn>, AgentError> {
        if slots_out == 0 || slots_out > ring::MAX_SLOTS || ring_out.len < ring::ring_len(slots_out) as u64 {
            return Err(AgentError::Unreachable {
                peer: peer.into(),
                reason: format!("its notification ring ({} bytes, {slots_out} slots) is malformed", ring_out.len),
            });
        }
        self.transport
            .connect(peer_url)
            .await
            .map_err(|e| AgentError::Unreachable { peer: peer.into(), reason: e.to_string() })?;
        let staging = RdmaMemory::alloc_for(&self.transport, ring::HEAD + ring::SLOT)
            .map_err(|e| AgentError::from_transport(peer, e))?;
        let (tx, rx) = mpsc::unbounded_channel();
        let conn = Arc::new(Conn {
            id,
            peer: peer.into(),
            transport: self.transport,
            ring_out,
            notify_tx: tx,
            broken: AtomicBool::new(false),
        });
        let weak = Arc::downgrade(&conn);
        let out = Outgoing {
            conn: weak.clone(),
            peer: peer.into(),
            staging,
            ring: ring_out,
            slots: slots_out,
            credit: Credit::new(slots_out),
            timeout: self.timeout,
        };
        tokio::spawn(notifier(out, rx, counters.clone()));
        let inc = Incoming { conn: weak, peer: peer.into(), ring: self.ring_in, slots: self.slots_in, next: 0 };
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
    pub(crate) transport: RdmaTransport,
    /// The peer's ring for this side's notifications.
    pub(crate) ring_out: RdmaRemoteBuffer,
    pub(crate) notify_tx: mpsc::UnboundedSender<Job>,
    /// The drainer found the connection broken, or the ring corrupt.
    broken: AtomicBool,
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
}

/// The notifier's side of a connection.
struct Outgoing {
    conn: Weak<Conn>,
    peer: String,
    /// Word 0: where `consumed` is read into; from `HEAD`: the slot image.
    staging: RdmaMemory,
    ring: RdmaRemoteBuffer,
    slots: u32,
    credit: Credit,
    timeout: Option<Duration>,
}

/// Places notifications in the peer's ring one at a time, each once the
/// previous completed: so they are counted at the peer in this order
/// whatever the striping, and a slot is read there only once it is whole.
/// Ends when the connection and every transfer holding a sender are gone.
async fn notifier(mut out: Outgoing, mut jobs: mpsc::UnboundedReceiver<Job>, counters: Arc<Counters>) {
    while let Some(job) = jobs.recv().await {
        let r = send_one(&mut out, &job.message).await;
        if r.is_ok() {
            Counters::add(&counters.notifications_sent, 1);
        }
        let _ = job.done.send(r);
    }
}

async fn send_one(out: &mut Outgoing, message: &[u8]) -> Result<(), AgentError> {
    let peer = out.peer.clone();
    let conn = |out: &Outgoing| out.conn.upgrade().ok_or_else(|| AgentError::PeerRemoved { peer: out.peer.clone() });
    let started = Instant::now();
    let mut backoff = Duration::from_micros(20);
    while !out.credit.has_room() {
        // The peer's agent has not (as far as we know) taken the notification
        // in the slot we need off its ring: ask how many it consumed.
        let c = conn(out)?;
        let word = out.ring.slice(0, 8).expect("the ring has a head");
        let read = c.transport.read_with_timeout(out.staging.view_mut(0, 8).expect("8 bytes"), &word, out.timeout);
        drop(c);
        read.await.map_err(|e| AgentError::from_transport(&peer, e))?;
        let mut v = [0u8; 8];
        out.staging.read_into(0, &mut v).map_err(|e| AgentError::from_transport(&peer, e))?;
        out.credit.update(u64::from_le_bytes(v));
        if out.credit.has_room() {
            break;
        }
        if let Some(t) = out.timeout {
            if started.elapsed() >= t {
                return Err(AgentError::Timeout { peer, op: "notification (the peer's ring stays full)", after: t });
            }
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_millis(2));
    }
    let seq = out.credit.next();
    let image = ring::encode(seq, message);
    let dst =
        out.ring.slice(ring::slot_offset(seq, out.slots) as u64, image.len() as u64).expect("a slot fits the ring");
    let c = conn(out)?;
    out.staging.write_from(ring::HEAD, &image).map_err(|e| AgentError::from_transport(&peer, e))?;
    let write = c.transport.write(out.staging.view(ring::HEAD, image.len()).expect("fits"), &dst, true);
    drop(c);
    write.await.map_err(|e| AgentError::from_transport(&peer, e))?;
    out.credit.sent();
    Ok(())
}

/// The drainer's side of a connection.
struct Incoming {
    conn: Weak<Conn>,
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
