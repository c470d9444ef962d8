//! The handshake listener: answers peers' hellos (checks the token, learns
//! the caller, breaks crossing ties, completes the connection), and binds
//! where the transport is reachable.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

use rmacomm_transport::RdmaTransport;
use tokio::net::{TcpListener, TcpStream};

use crate::connection::Prepared;
use crate::handshake::{self, Answer, Hello, Reply};
use crate::metadata::{same_token, Metadata};
use crate::shared::{Link, Shared};
use crate::{AgentConfig, AgentError};

/// How long a peer that connected to the listener has to send its hello.
const HELLO_DEADLINE: Duration = Duration::from_secs(10);
/// The refusal of a hello whose token is not this agent's: the caller
/// reached another agent than the one it meant (the same port on another
/// interface or host), or one that took a dead agent's port; it tries the
/// peer's other addresses.
pub(crate) const WRONG_TOKEN: &str = "wrong token: the caller holds stale or foreign metadata of this agent";
/// Handshakes answered at once; more connections are closed unanswered.
pub(crate) const MAX_HANDSHAKES: usize = 64;

impl Shared {
    /// Answers a hello: the reply, and what then completes the connection.
    pub(crate) fn on_hello(
        self: &Arc<Self>,
        h: Hello,
    ) -> (Reply, Option<impl std::future::Future<Output = ()> + Send + 'static>) {
        let refuse = |reason: String| (Reply::Refused { reason }, None);
        if h.v != handshake::VERSION {
            return refuse(format!("handshake version {} (this agent speaks {})", h.v, handshake::VERSION));
        }
        if !same_token(&h.token, &self.token) {
            return refuse(WRONG_TOKEN.into());
        }
        let meta = match Metadata::decode(&h.from) {
            Ok(m) => m,
            Err(e) => return refuse(e.to_string()),
        };
        if meta.name == self.name {
            return refuse(format!("the caller is named {:?} too; agent names must be unique", self.name));
        }
        let (name, peer_token) = (meta.name.clone(), meta.token.clone());
        self.learn(meta);
        let attempt = {
            let mut st = self.lock();
            let Some(e) = st.peers.get_mut(&name) else { return refuse("this agent is shutting down".into()) };
            match handshake::on_hello(e.state(), &self.name, &name, h.replaces) {
                Answer::Accept => {}
                Answer::Crossing => return (Reply::Crossing, None),
                Answer::Busy => return (Reply::Busy, None),
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
        let id: u64 = rand::random();
        let reply = Reply::Accepted { url: prepared.url.clone(), ring: prepared.ring(), slots, id };
        let sh = self.clone();
        let finish = async move {
            let connect = prepared.finish(id, &name, &peer_token, &h.url, h.ring, h.slots, &sh);
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

/// Accepts handshakes until the agent is dropped (which aborts this task).
pub(crate) async fn serve(listener: TcpListener, agent: Weak<Shared>) {
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
pub(crate) fn bind_listeners(
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
