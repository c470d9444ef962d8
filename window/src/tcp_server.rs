//! `TcpStoreServer`: serves a [`HashStore`] over TCP, one thread per client.
//!
//! Threads rather than tokio: a bootstrap store has one connection per rank,
//! its requests mostly wait on a condition variable, and a blocking server
//! works the same whether or not the hosting program runs a runtime.

use std::collections::HashMap;
use std::fmt;
use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::hash_store::{HashStore, WaitError};
use crate::store::Store;
use crate::wire::{self, Request, Response, MAX_FRAME_LEN};

/// Most clients served at once; later ones are closed at once. A bootstrap
/// store sees one connection per rank, and a thread each.
pub const MAX_CLIENTS: usize = 8192;

/// Longest wait a client may ask for; longer requests are cut to it.
const MAX_WAIT: Duration = Duration::from_secs(7 * 24 * 3600);

/// How long the rest of a frame may take once its first byte came: a
/// connection that stops mid-frame (a probe, a foreign protocol whose first
/// bytes read as a length) is closed rather than holding its thread. Between
/// frames a client may be silent for as long as it likes.
const FRAME_TIMEOUT: Duration = Duration::from_secs(60);

/// A TCP store server running on its own threads.
///
/// Dropping it (or [`shutdown`](Self::shutdown)) stops accepting, closes
/// every connection and wakes pending waits with an error. A malformed frame
/// closes only the connection it came on.
pub struct TcpStoreServer {
    shared: Arc<Shared>,
    addr: SocketAddr,
    /// The accepting thread, and a second handle on its listening socket to wake it with.
    acceptor: Option<(JoinHandle<()>, TcpListener)>,
}

struct Shared {
    store: Arc<HashStore>,
    stop: AtomicBool,
    /// Clones of the live connections, so that shutdown can close them.
    conns: Mutex<HashMap<u64, TcpStream>>,
    next_id: AtomicU64,
    /// Connections open (every one: `MAX_CLIENTS` counts them).
    active: AtomicUsize,
    /// Clients — connections that sent a valid request — so far, and those
    /// still connected: what a host's linger waits for. A connection that
    /// never sent one (a port scan, another protocol) is not waited for.
    seen: AtomicUsize,
    clients: AtomicUsize,
}

impl fmt::Debug for TcpStoreServer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TcpStoreServer")
            .field("addr", &self.addr)
            .field("clients", &self.shared.clients.load(Ordering::Relaxed))
            .finish()
    }
}

impl TcpStoreServer {
    /// Binds `addr` (port 0 picks a free port; see [`local_addr`](Self::local_addr))
    /// and starts serving a new, empty store.
    pub fn bind(addr: impl ToSocketAddrs + fmt::Debug) -> Result<Self> {
        let listener =
            TcpListener::bind(&addr).map_err(|e| Error::Listen { addr: format!("{addr:?}"), reason: e.to_string() })?;
        Self::serve(listener, Arc::new(HashStore::new()))
    }

    /// Binds `port` on every interface (IPv6 and IPv4 where the host allows,
    /// else IPv4 only), as torch.distributed's TCPStore does.
    pub fn bind_any(port: u16) -> Result<Self> {
        let listener = TcpListener::bind((Ipv6Addr::UNSPECIFIED, port))
            .or_else(|_| TcpListener::bind((Ipv4Addr::UNSPECIFIED, port)))
            .map_err(|e| Error::Listen { addr: format!("port {port}"), reason: e.to_string() })?;
        Self::serve(listener, Arc::new(HashStore::new()))
    }

    fn serve(listener: TcpListener, store: Arc<HashStore>) -> Result<Self> {
        let addr =
            listener.local_addr().map_err(|e| Error::Listen { addr: "the listener".into(), reason: e.to_string() })?;
        let shared = Arc::new(Shared {
            store,
            stop: AtomicBool::new(false),
            conns: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(0),
            active: AtomicUsize::new(0),
            seen: AtomicUsize::new(0),
            clients: AtomicUsize::new(0),
        });
        let waker =
            listener.try_clone().map_err(|e| Error::Listen { addr: addr.to_string(), reason: e.to_string() })?;
        let s = shared.clone();
        let acceptor = thread::Builder::new()
            .name("rmacomm-store-accept".into())
            .spawn(move || accept_loop(listener, s))
            .map_err(|e| Error::Listen { addr: addr.to_string(), reason: format!("cannot start a thread: {e}") })?;
        tracing::debug!(%addr, "TCP store serving");
        Ok(TcpStoreServer { shared, addr, acceptor: Some((acceptor, waker)) })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The served data, for in-process access by the host.
    pub(crate) fn store(&self) -> &Arc<HashStore> {
        &self.shared.store
    }

    /// Clients connected now (connections that sent a valid request).
    pub fn clients(&self) -> usize {
        self.shared.clients.load(Ordering::Acquire)
    }

    /// Waits until at least `expected` clients have connected and all of them
    /// have hung up, or `linger` passes. Lets the host outlive the last reply.
    pub fn wait_for_clients_to_leave(&self, expected: usize, linger: Duration) -> bool {
        let deadline = ibverbx::deadline_after(linger);
        loop {
            let s = &self.shared;
            if s.seen.load(Ordering::Acquire) >= expected && s.clients.load(Ordering::Acquire) == 0 {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            thread::sleep(Duration::from_millis(5));
        }
    }

    /// Stops serving: no new connections, open ones closed, waiters woken.
    pub fn shutdown(&mut self) {
        let Some((acceptor, waker)) = self.acceptor.take() else { return };
        self.shared.stop.store(true, Ordering::Release);
        self.shared.store.close();
        wake_acceptor(&waker, self.addr);
        let _ = acceptor.join();
        // The socket closes with its last handle: now, not when the server is dropped.
        drop(waker);
        for (_, c) in self.shared.conns.lock().unwrap_or_else(|p| p.into_inner()).drain() {
            let _ = c.shutdown(Shutdown::Both);
        }
    }
}

impl Drop for TcpStoreServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Ends the acceptor's blocking `accept`.
///
/// Shutting the listening socket down for reading wakes it without a network
/// path (on Linux `accept` then fails with `EINVAL`, and every later call
/// too, so a wake cannot be missed). Where that is refused, a connection of
/// our own does it; a listener on `[::]` may then have no IPv6 loopback to
/// be reached on (IPv6 disabled by sysctl still lets it bind `[::]` and take
/// IPv4 clients), so IPv4 loopback is tried after it.
fn wake_acceptor(listener: &TcpListener, addr: SocketAddr) {
    if rustix::net::shutdown(listener, rustix::net::Shutdown::Read).is_ok() {
        return;
    }
    let port = addr.port();
    let targets: Vec<SocketAddr> = match addr {
        SocketAddr::V6(a) if a.ip().is_unspecified() => {
            vec![(Ipv6Addr::LOCALHOST, port).into(), (Ipv4Addr::LOCALHOST, port).into()]
        }
        SocketAddr::V4(a) if a.ip().is_unspecified() => vec![(Ipv4Addr::LOCALHOST, port).into()],
        a => vec![a],
    };
    for target in targets {
        if TcpStream::connect_timeout(&target, Duration::from_secs(1)).is_ok() {
            return;
        }
    }
    tracing::warn!(%addr, "TCP store: could not wake the acceptor; shutdown waits for the next connection");
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    for conn in listener.incoming() {
        if shared.stop.load(Ordering::Acquire) {
            break;
        }
        let stream = match conn {
            Ok(s) => s,
            Err(e) => {
                // EMFILE and friends: back off instead of spinning.
                tracing::warn!("TCP store: accept failed: {e}");
                thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        if shared.active.load(Ordering::Acquire) >= MAX_CLIENTS {
            tracing::warn!("TCP store: refusing a client, {MAX_CLIENTS} are connected already");
            continue;
        }
        let _ = stream.set_nodelay(true);
        let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
        if let Ok(clone) = stream.try_clone() {
            shared.conns.lock().unwrap_or_else(|p| p.into_inner()).insert(id, clone);
        }
        shared.active.fetch_add(1, Ordering::AcqRel);
        let s = shared.clone();
        let spawned = thread::Builder::new().name("rmacomm-store-conn".into()).spawn(move || {
            let peer = stream.peer_addr().map(|a| a.to_string()).unwrap_or_default();
            match serve_client(stream, &s) {
                Ok(()) => tracing::trace!(%peer, "TCP store client left"),
                Err(e) => tracing::warn!(%peer, "TCP store: closing client connection: {e}"),
            }
            s.conns.lock().unwrap_or_else(|p| p.into_inner()).remove(&id);
            s.active.fetch_sub(1, Ordering::AcqRel);
        });
        if spawned.is_err() {
            tracing::warn!("TCP store: cannot start a client thread");
            shared.conns.lock().unwrap_or_else(|p| p.into_inner()).remove(&id);
            shared.active.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// Serves one client until it hangs up (`Ok`) or misbehaves (`Err`).
fn serve_client(stream: TcpStream, shared: &Shared) -> io::Result<()> {
    let mut counted = false;
    let r = serve_requests(stream, shared, &mut counted);
    if counted {
        shared.clients.fetch_sub(1, Ordering::AcqRel);
    }
    r
}

fn serve_requests(mut stream: TcpStream, shared: &Shared, counted: &mut bool) -> io::Result<()> {
    let mut header = [0u8; 4];
    let mut body = Vec::new();
    loop {
        // The first byte without a limit (clients idle between requests),
        // the rest of the frame within FRAME_TIMEOUT.
        stream.set_read_timeout(None)?;
        match stream.read(&mut header[..1]) {
            Ok(0) => return Ok(()),
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
        stream.set_read_timeout(Some(FRAME_TIMEOUT))?;
        stream.read_exact(&mut header[1..]).map_err(mid_frame)?;
        if shared.stop.load(Ordering::Acquire) {
            return Ok(());
        }
        let len = wire::frame_len(header).map_err(invalid_data)?;
        debug_assert!(len <= MAX_FRAME_LEN);
        body.clear();
        // Grow with what actually arrives, so a header promising 64 MiB costs nothing until the bytes come.
        let got = (&mut stream).take(len as u64).read_to_end(&mut body).map_err(mid_frame)?;
        if got < len {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "truncated frame"));
        }
        let req = wire::decode_request(&body).map_err(invalid_data)?;
        if !*counted {
            *counted = true;
            shared.clients.fetch_add(1, Ordering::AcqRel);
            shared.seen.fetch_add(1, Ordering::AcqRel);
        }
        let Some(resp) = handle(&shared.store, req) else {
            // Shutting down: closing tells the client more than any reply.
            return Ok(());
        };
        stream.write_all(&wire::encode_response(&resp))?;
    }
}

/// A read inside a frame that timed out says so.
fn mid_frame(e: io::Error) -> io::Error {
    if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) {
        return io::Error::new(e.kind(), format!("the rest of a frame did not come within {FRAME_TIMEOUT:?}"));
    }
    e
}

fn invalid_data(e: wire::WireError) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e.0)
}

fn refs(keys: &[String]) -> Vec<&str> {
    keys.iter().map(String::as_str).collect()
}

/// One request against the store (limits were checked by the decoder);
/// `None` when the store is shutting down.
fn handle(store: &HashStore, req: Request) -> Option<Response> {
    let result = match req {
        Request::Set { key, value } => store.set(&key, &value).map(|()| Response::Ok),
        Request::TryGet { key } => store.try_get(&key).map(Response::Value),
        Request::MultiGet { keys, timeout_ms } => {
            match store.multi_get_raw(&refs(&keys), wait_time(timeout_ms), max_values_len(keys.len())) {
                Ok(values) => Ok(Response::Values(values)),
                Err(e) => wait_response(e).map(Ok)?,
            }
        }
        Request::Wait { keys, timeout_ms } => match store.wait_raw(&refs(&keys), wait_time(timeout_ms)) {
            Ok(()) => Ok(Response::Ok),
            Err(e) => wait_response(e).map(Ok)?,
        },
        Request::Check { keys } => store.check(&refs(&keys)).map(Response::Bool),
        Request::Add { key, delta } => store.add(&key, delta).map(Response::Int),
        Request::CompareSet { key, expected, desired } => {
            store.compare_set(&key, expected.as_deref(), &desired).map(Response::Value)
        }
        Request::Delete { key } => store.delete(&key).map(Response::Bool),
    };
    Some(result.unwrap_or_else(|e| match e {
        Error::InvalidArgument { reason, .. } => Response::Error(reason),
        other => Response::Error(other.to_string()),
    }))
}

/// Most value bytes a `Values` reply to `n` keys carries: one frame, less
/// its opcode, its count and each value's length field.
fn max_values_len(n: usize) -> usize {
    MAX_FRAME_LEN.saturating_sub(16 + 4 * n)
}

fn wait_time(ms: u64) -> Duration {
    Duration::from_millis(ms).min(MAX_WAIT)
}

fn wait_response(e: WaitError) -> Option<Response> {
    match e {
        WaitError::Timeout(key) => Some(Response::Timeout { key }),
        WaitError::Closed(_) => None,
        WaitError::TooLarge { total } => Some(Response::Error(format!(
            "the values asked for add up to {total} bytes, more than one reply carries ({MAX_FRAME_LEN} bytes); \
             fetch fewer keys per call"
        ))),
    }
}
