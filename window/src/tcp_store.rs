//! `TcpStore`: the store torch.distributed users know, hosted by one rank.

use std::fmt;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread;
use std::time::{Duration, Instant};

use rand::Rng;

use crate::error::{Error, Result};
use crate::hash_store::HashStore;
use crate::store::{check_key, check_keys, check_value, Store};
use crate::tcp_server::TcpStoreServer;
use crate::wire::{self, Request, Response};

/// How long a hosting store waits, when dropped, for its clients to hang up.
const DEFAULT_LINGER: Duration = Duration::from_secs(30);
/// Extra time a client gives the server beyond a wait's own timeout.
const REPLY_SLACK: Duration = Duration::from_secs(30);

/// Ports this process's hosting stores serve on (how many on each): a
/// second host on one of them (a second `Group::from_env`, beside
/// `new_comm`'s) joins the first as its client instead of failing to bind
/// its own process's port ("pick another MASTER_PORT", while the other
/// ranks joined and waited out the timeout).
static HOSTED: Mutex<Vec<u16>> = Mutex::new(Vec::new());

/// A [`Store`] over TCP, like torch.distributed's `TCPStore`.
///
/// The master (rank 0) hosts the data on a [`TcpStoreServer`] running on its
/// own threads and reaches it in-process; the others connect as clients,
/// retrying with a bounded exponential back-off until `timeout`, since rank 0
/// may start later than they do. A client keeps one connection, used by one
/// request at a time; a broken connection fails that request with
/// [`Error::Disconnected`] and the next request reconnects.
///
/// The store has no authentication: it is meant for a cluster's private
/// network, as torch's is.
pub struct TcpStore {
    backend: Backend,
    addr: String,
    timeout: Duration,
}

enum Backend {
    Host { server: TcpStoreServer, store: Arc<HashStore>, expected_clients: usize, linger: Duration },
    Client(Mutex<Option<TcpStream>>),
}

impl fmt::Debug for TcpStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let role = match &self.backend {
            Backend::Host { .. } => "host",
            Backend::Client(_) => "client",
        };
        f.debug_struct("TcpStore").field("addr", &self.addr).field("role", &role).finish()
    }
}

impl TcpStore {
    /// Hosts (`is_master`) or joins the store at `host:port`.
    ///
    /// The master listens on `port` on every interface, or only on `host`
    /// when that is a loopback address (`127.0.0.1`, `::1`: a one-host job,
    /// whose store other hosts need not reach — it holds the transport's
    /// connection URLs) (port 0 picks a free
    /// one, see [`port`](Self::port)); `world_size`, when known, is how many
    /// processes use the store, so that the master, when dropped, waits (up to
    /// 30 s, see [`set_linger`](Self::set_linger)) until the other
    /// `world_size - 1` have connected and hung up: an early exit of rank 0
    /// would otherwise cut replies the others still wait for. A client tries to
    /// connect for up to `timeout`, which is also how long it waits for a reply
    /// to a request that does not wait on keys.
    pub fn new(host: &str, port: u16, world_size: Option<usize>, is_master: bool, timeout: Duration) -> Result<Self> {
        if is_master {
            let loopback = host
                .trim_start_matches('[')
                .trim_end_matches(']')
                .parse::<std::net::IpAddr>()
                .ok()
                .filter(|ip| ip.is_loopback());
            let bound = match loopback {
                Some(ip) => TcpStoreServer::bind((ip, port)),
                None => TcpStoreServer::bind_any(port),
            };
            let server = match bound {
                Ok(s) => s,
                Err(e @ Error::Listen { .. }) => {
                    if port != 0 && HOSTED.lock().unwrap_or_else(|p| p.into_inner()).contains(&port) {
                        tracing::debug!(
                            port,
                            "TCP store: this process hosts the store on this port already; joining it"
                        );
                        let local = if loopback.is_some() { host } else { "127.0.0.1" };
                        return Self::connect(local, port, timeout);
                    }
                    return Err(e);
                }
                Err(e) => return Err(e),
            };
            HOSTED.lock().unwrap_or_else(|p| p.into_inner()).push(server.local_addr().port());
            let store = server.store().clone();
            let addr = format!("{host}:{}", server.local_addr().port());
            let expected_clients = world_size.map_or(0, |n| n.saturating_sub(1));
            Ok(TcpStore {
                backend: Backend::Host { server, store, expected_clients, linger: DEFAULT_LINGER },
                addr,
                timeout,
            })
        } else {
            Self::connect(host, port, timeout)
        }
    }

    /// Connects to a store hosted elsewhere (by a master `TcpStore` or a
    /// standalone [`TcpStoreServer`]).
    pub fn connect(host: &str, port: u16, timeout: Duration) -> Result<Self> {
        let addr = if host.contains(':') && !host.starts_with('[') {
            format!("[{host}]:{port}")
        } else {
            format!("{host}:{port}")
        };
        let stream = connect_with_backoff(&addr, timeout)?;
        Ok(TcpStore { backend: Backend::Client(Mutex::new(Some(stream))), addr, timeout })
    }

    /// The port the store is served on (the one picked, when the master asked for port 0).
    pub fn port(&self) -> u16 {
        match &self.backend {
            Backend::Host { server, .. } => server.local_addr().port(),
            Backend::Client(_) => self.addr.rsplit(':').next().and_then(|p| p.parse().ok()).unwrap_or(0),
        }
    }

    /// The address the store listens on, for the master.
    pub fn local_addr(&self) -> Option<std::net::SocketAddr> {
        match &self.backend {
            Backend::Host { server, .. } => Some(server.local_addr()),
            Backend::Client(_) => None,
        }
    }

    /// Whether this process hosts the store.
    pub fn is_master(&self) -> bool {
        matches!(self.backend, Backend::Host { .. })
    }

    /// How long a dropped master keeps serving for clients that have not hung up yet.
    pub fn set_linger(&mut self, linger: Duration) {
        if let Backend::Host { linger: l, .. } = &mut self.backend {
            *l = linger;
        }
    }

    fn host_store(&self) -> Option<&HashStore> {
        match &self.backend {
            Backend::Host { store, .. } => Some(store),
            Backend::Client(_) => None,
        }
    }

    /// Sends `op`'s request and reads its reply; `wait` is how long the server may hold it.
    fn call(&self, op: &'static str, req: &Request, wait: Duration) -> Result<Response> {
        let Backend::Client(conn) = &self.backend else { unreachable!("host requests are served in-process") };
        let mut guard: MutexGuard<'_, Option<TcpStream>> = conn.lock().unwrap_or_else(|p| p.into_inner());
        if guard.is_none() {
            *guard = Some(connect_with_backoff(&self.addr, self.timeout)?);
        }
        let stream = guard.as_mut().expect("connected above");
        let read_timeout = wait.saturating_add(REPLY_SLACK).max(self.timeout);
        let result = roundtrip(stream, req, self.timeout, read_timeout);
        match result {
            Ok(resp) => Ok(resp),
            Err(e) => {
                // The stream's position in the protocol is unknown now: drop it.
                *guard = None;
                let addr = self.addr.clone();
                Err(match e {
                    CallError::Send(e) if timed_out(&e) => Error::Disconnected {
                        addr,
                        reason: format!(
                            "{op}: the request could not be sent within {:?}, the host stopped reading it (is rank \
                             0 stopped or overloaded?)",
                            self.timeout
                        ),
                    },
                    CallError::Send(e) => {
                        Error::Disconnected { addr, reason: format!("{op}: sending the request: {e}") }
                    }
                    CallError::Receive(e) if timed_out(&e) => {
                        Error::Disconnected { addr, reason: format!("{op}: no reply within {read_timeout:?}") }
                    }
                    CallError::Receive(e) => {
                        Error::Disconnected { addr, reason: format!("{op}: reading the reply: {e}") }
                    }
                    CallError::Wire(e) => Error::Protocol(format!("{op} reply from {addr}: {}", e.0)),
                })
            }
        }
    }
}

impl Drop for TcpStore {
    fn drop(&mut self) {
        if let Backend::Host { server, expected_clients, linger, .. } = &mut self.backend {
            {
                let mut hosted = HOSTED.lock().unwrap_or_else(|p| p.into_inner());
                let port = server.local_addr().port();
                if let Some(i) = hosted.iter().position(|&p| p == port) {
                    hosted.swap_remove(i);
                }
            }
            if !server.wait_for_clients_to_leave(*expected_clients, *linger) {
                tracing::warn!(
                    "TCP store host: {} client(s) still connected after {linger:?}; shutting down anyway",
                    server.clients()
                );
            }
            server.shutdown();
        }
    }
}

enum CallError {
    Send(io::Error),
    Receive(io::Error),
    Wire(wire::WireError),
}

/// Whether a socket timeout (`SO_SNDTIMEO`/`SO_RCVTIMEO`) ended the call.
fn timed_out(e: &io::Error) -> bool {
    matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut)
}

/// One request and its reply. Both directions are bounded: a request larger
/// than the socket buffers to a host that stopped reading (SIGSTOP, a hung
/// rank 0) would otherwise block in `write_all` for ever. The send timeout
/// applies to each `send`, so it bounds the time without progress, as the
/// store timeout means "how long to wait for the host".
fn roundtrip(
    stream: &mut TcpStream,
    req: &Request,
    write_timeout: Duration,
    read_timeout: Duration,
) -> Result<Response, CallError> {
    // A zero timeout means "none" to the socket: 1 ms is the shortest real one.
    stream.set_write_timeout(Some(write_timeout.max(Duration::from_millis(1)))).map_err(CallError::Send)?;
    stream.write_all(&wire::encode_request(req)).map_err(CallError::Send)?;
    stream.set_read_timeout(Some(read_timeout.max(Duration::from_millis(1)))).map_err(CallError::Receive)?;
    let mut header = [0u8; 4];
    stream.read_exact(&mut header).map_err(CallError::Receive)?;
    let len = wire::frame_len(header).map_err(CallError::Wire)?;
    let mut body = Vec::new();
    let got = stream.take(len as u64).read_to_end(&mut body).map_err(CallError::Receive)?;
    if got < len {
        return Err(CallError::Receive(io::Error::new(io::ErrorKind::UnexpectedEof, "reply cut short")));
    }
    wire::decode_response(&body).map_err(CallError::Wire)
}

/// Connects, retrying with exponential back-off (10 ms doubling to 1 s, with
/// jitter) until `timeout`. Names resolve again on each try, since a
/// scheduler's DNS entry may appear late.
fn connect_with_backoff(addr: &str, timeout: Duration) -> Result<TcpStream> {
    let start = Instant::now();
    let mut delay = Duration::from_millis(10);
    let mut last_err;
    loop {
        match try_connect(addr, timeout.saturating_sub(start.elapsed())) {
            Ok(s) => return Ok(s),
            Err(e) => last_err = e,
        }
        let left = timeout.saturating_sub(start.elapsed());
        if left.is_zero() {
            return Err(Error::Connect { addr: addr.to_string(), after: timeout, reason: last_err });
        }
        let jitter = rand::thread_rng().gen_range(0..=delay.as_millis() as u64 / 4);
        thread::sleep((delay + Duration::from_millis(jitter)).min(left));
        delay = (delay * 2).min(Duration::from_secs(1));
    }
}

fn try_connect(addr: &str, left: Duration) -> Result<TcpStream, String> {
    let addrs: Vec<SocketAddr> = addr.to_socket_addrs().map_err(|e| format!("cannot resolve {addr}: {e}"))?.collect();
    let mut last = format!("{addr} resolves to no address");
    for a in addrs {
        match TcpStream::connect_timeout(&a, left.clamp(Duration::from_millis(1), Duration::from_secs(5))) {
            Ok(s) => {
                let _ = s.set_nodelay(true);
                return Ok(s);
            }
            Err(e) => last = format!("{a}: {e}"),
        }
    }
    Err(last)
}

fn owned(keys: &[&str]) -> Vec<String> {
    keys.iter().map(|k| k.to_string()).collect()
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Maps a reply that is not the expected kind.
fn unexpected(op: &'static str, resp: Response, timeout: Duration) -> Error {
    match resp {
        Response::Timeout { key } => Error::key_timeout(&key, timeout),
        Response::Error(reason) => Error::InvalidArgument { op, reason },
        other => Error::Protocol(format!("unexpected reply to {op}: {other:?}")),
    }
}

impl Store for TcpStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        if let Some(s) = self.host_store() {
            return s.set(key, value);
        }
        check_key("set", key)?;
        check_value("set", value)?;
        match self.call("set", &Request::Set { key: key.into(), value: value.to_vec() }, Duration::ZERO)? {
            Response::Ok => Ok(()),
            r => Err(unexpected("set", r, self.timeout)),
        }
    }

    fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        if let Some(s) = self.host_store() {
            return s.try_get(key);
        }
        check_key("try_get", key)?;
        match self.call("try_get", &Request::TryGet { key: key.into() }, Duration::ZERO)? {
            Response::Value(v) => Ok(v),
            r => Err(unexpected("try_get", r, self.timeout)),
        }
    }

    fn multi_get(&self, keys: &[&str], timeout: Duration) -> Result<Vec<Vec<u8>>> {
        if let Some(s) = self.host_store() {
            return s.multi_get(keys, timeout);
        }
        check_keys("multi_get", keys)?;
        match self.call("multi_get", &Request::MultiGet { keys: owned(keys), timeout_ms: millis(timeout) }, timeout)? {
            Response::Values(v) if v.len() == keys.len() => Ok(v),
            r => Err(unexpected("multi_get", r, timeout)),
        }
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        if let Some(s) = self.host_store() {
            return s.wait(keys, timeout);
        }
        check_keys("wait", keys)?;
        match self.call("wait", &Request::Wait { keys: owned(keys), timeout_ms: millis(timeout) }, timeout)? {
            Response::Ok => Ok(()),
            r => Err(unexpected("wait", r, timeout)),
        }
    }

    fn check(&self, keys: &[&str]) -> Result<bool> {
        if let Some(s) = self.host_store() {
            return s.check(keys);
        }
        check_keys("check", keys)?;
        match self.call("check", &Request::Check { keys: owned(keys) }, Duration::ZERO)? {
            Response::Bool(b) => Ok(b),
            r => Err(unexpected("check", r, self.timeout)),
        }
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        if let Some(s) = self.host_store() {
            return s.add(key, delta);
        }
        check_key("add", key)?;
        match self.call("add", &Request::Add { key: key.into(), delta }, Duration::ZERO)? {
            Response::Int(v) => Ok(v),
            r => Err(unexpected("add", r, self.timeout)),
        }
    }

    fn compare_set(&self, key: &str, expected: Option<&[u8]>, desired: &[u8]) -> Result<Option<Vec<u8>>> {
        if let Some(s) = self.host_store() {
            return s.compare_set(key, expected, desired);
        }
        check_key("compare_set", key)?;
        check_value("compare_set", desired)?;
        if let Some(e) = expected {
            check_value("compare_set", e)?;
        }
        let req =
            Request::CompareSet { key: key.into(), expected: expected.map(<[u8]>::to_vec), desired: desired.to_vec() };
        match self.call("compare_set", &req, Duration::ZERO)? {
            Response::Value(v) => Ok(v),
            r => Err(unexpected("compare_set", r, self.timeout)),
        }
    }

    fn delete(&self, key: &str) -> Result<bool> {
        if let Some(s) = self.host_store() {
            return s.delete(key);
        }
        check_key("delete", key)?;
        match self.call("delete", &Request::Delete { key: key.into() }, Duration::ZERO)? {
            Response::Bool(b) => Ok(b),
            r => Err(unexpected("delete", r, self.timeout)),
        }
    }
}
