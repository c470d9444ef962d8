//! Making a connection from this side: the first transfer toward a peer
//! (or `connect`) starts an attempt in its own task — a hello to the
//! peer's listener — and waits for the link to become ready.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpStream;

use crate::connection::{Conn, Prepared};
use crate::handshake::{self, Hello, Reply};
use crate::listener::WRONG_TOKEN;
use crate::metadata::Metadata;
use crate::shared::{Link, PeerEntry, Shared};
use crate::AgentError;

/// How long one of a peer's listener addresses is tried.
const ADDRESS_TIMEOUT: Duration = Duration::from_secs(3);
/// The least time an address gets when the connect timeout is shared out
/// among many.
const MIN_ADDRESS_TIMEOUT: Duration = Duration::from_millis(250);

/// A live connection to `peer`, made if there is none; waits for one being
/// made (by this side or by the peer's handshake). The attempt itself runs
/// in its own task, so that dropping the caller leaves the link consistent.
pub(crate) async fn connection(sh: Arc<Shared>, peer: String) -> Result<Arc<Conn>, AgentError> {
    let timeout = sh.config.connect_timeout;
    let deadline = tokio::time::Instant::from_std(ibverbx::deadline_after(timeout));
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
                    let replaces = e.last_conn;
                    e.set(Link::Connecting { mine: true, attempt });
                    tokio::spawn(initiate(sh.clone(), peer.clone(), e.meta.clone(), attempt, replaces));
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
async fn initiate(sh: Arc<Shared>, peer: String, meta: Metadata, attempt: u64, replaces: Option<u64>) {
    let timeout = sh.config.connect_timeout;
    let r = match tokio::time::timeout(timeout, hello(&sh, &peer, &meta, attempt, replaces)).await {
        Ok(r) => r,
        Err(_) => Err(AgentError::Timeout { peer: peer.clone(), op: "connect", after: timeout }),
    };
    match r {
        Ok(Some(conn)) => sh.settle(&peer, attempt, Ok(conn)),
        Ok(None) => {
            // A crossing the peer won: its hello replaces this attempt (or
            // already did: the attempt went stale). If that never happens
            // (its attempt failed), this one fails.
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
/// accepts; `None` when the attempt is no longer current (the peer's
/// hello replaced it). A busy peer, or one that answers that it is
/// connecting too and wins the tie, is asked again while the attempt is
/// current.
async fn hello(
    sh: &Arc<Shared>,
    peer: &str,
    meta: &Metadata,
    attempt: u64,
    replaces: Option<u64>,
) -> Result<Option<Arc<Conn>>, AgentError> {
    let slots = sh.config.notification_slots;
    let prepared = Prepared::new(&sh.config.transport, slots).map_err(|e| AgentError::from_transport(peer, e))?;
    let unreachable = |reason: String| AgentError::Unreachable { peer: peer.into(), reason };
    let current = || sh.lock().peers.get(peer).and_then(PeerEntry::attempt) == Some(attempt);
    let mut backoff = Duration::from_millis(2);
    // The address whose agent answered last: a busy peer is asked there
    // again.
    let mut good = None;
    loop {
        if !current() {
            return Ok(None);
        }
        let h = Hello {
            v: handshake::VERSION,
            token: meta.token.clone(),
            from: sh.metadata().encode(),
            url: prepared.url.clone(),
            ring: prepared.ring(),
            slots,
            replaces,
        };
        let per_address =
            ADDRESS_TIMEOUT.min(sh.config.connect_timeout / meta.control.len().max(1) as u32).max(MIN_ADDRESS_TIMEOUT);
        let (at, reply) = exchange(&meta.control, good, &h, per_address).await.map_err(unreachable)?;
        good = Some(at);
        match reply {
            Reply::Accepted { url, ring, slots, id } => {
                return prepared.finish(id, peer, &meta.token, &url, ring, slots, sh).await.map(Some);
            }
            // The peer is connecting to this side and wins the tie: its
            // hello replaces this attempt (then `current` says so). Asked
            // again meanwhile, so that if the peer's own attempt fails (it
            // cannot reach this side's addresses) it accepts this one,
            // instead of this side waiting for it until the timeout.
            Reply::Crossing | Reply::Busy => {
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_millis(100));
            }
            Reply::Refused { reason } => {
                return Err(unreachable(format!("its agent refused the connection: {reason}")));
            }
        }
    }
}

/// Sends `h` to the peer's listener addresses in turn (`first` first, then
/// the others in order) until one's agent answers it with anything but
/// [`WRONG_TOKEN`]: an address that refuses the connection, does not
/// answer within `per_address`, fails the handshake, or where another
/// agent listens is passed over (the first that accepted TCP was taken,
/// and another agent's refusal was the answer). Returns the address's
/// index and its reply.
async fn exchange(
    addrs: &[SocketAddr],
    first: Option<usize>,
    h: &Hello,
    per_address: Duration,
) -> Result<(usize, Reply), String> {
    let mut why = Vec::new();
    let mut other_agent = false;
    let order = first.into_iter().chain((0..addrs.len()).filter(|&i| Some(i) != first));
    for i in order {
        let a = addrs[i];
        let one = async {
            let mut s = TcpStream::connect(a).await.map_err(|e| e.to_string())?;
            let _ = s.set_nodelay(true);
            handshake::write_frame(&mut s, h).await.map_err(|e| format!("the handshake failed ({e})"))?;
            handshake::read_frame::<_, Reply>(&mut s).await.map_err(|e| format!("its agent closed the handshake ({e})"))
        };
        match tokio::time::timeout(per_address, one).await {
            Ok(Ok(Reply::Refused { reason })) if reason == WRONG_TOKEN => {
                other_agent = true;
                why.push(format!("{a}: another agent answered"));
            }
            Ok(Ok(reply)) => return Ok((i, reply)),
            Ok(Err(e)) => why.push(format!("{a}: {e}")),
            Err(_) => why.push(format!("{a}: no answer within {per_address:?}")),
        }
    }
    let hint =
        if other_agent { "the metadata is stale (the agent restarted) or foreign" } else { "is its process alive?" };
    Err(format!("no agent of this metadata answers at its addresses ({}); {hint}", why.join("; ")))
}
