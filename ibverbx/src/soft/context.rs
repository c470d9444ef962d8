//! A soft context: its progress engine, listeners and key tables.
//!
//! Each context runs one progress thread with a single-threaded tokio
//! runtime. Idle, it sleeps in epoll; requester and responder tasks of every
//! QP of the context run there. It listens on TCP (other hosts) and on an
//! abstract unix socket (same host; abstract names are per network
//! namespace, exactly the scope of "same host").

use std::any::Any;
use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::address::{HostId, SoftAddress};
use super::config::SoftConfig;
use super::cq::SoftCq;
use super::host::{host_id, local_ipv4_addrs};
use super::keytable::{stored_access, KeyTable, SlotData, SLOT_MASK, STORED_DEVICE};
use super::mr::{SoftMr, SoftMrHandle};
use super::peer::PeerMap;
use super::qp::{Refusal, SoftQp};
use super::wire::{Hello, HelloStatus, HELLO_LEN};
use crate::device::{DeviceAttr, Gid, LinkLayer, Mtu, PortAttr, PortState};
use crate::provider::{ContextOps, CqOps, MrOps, PdOps, Placement, QpOps};
use crate::shm::find_segment;
use crate::{AccessFlags, DeviceMemory, Error, QpInitAttr, Result};

/// State shared by everything made from one soft context.
pub(crate) struct CtxShared {
    pub(crate) uid: u64,
    pub(crate) host: HostId,
    pub(crate) pid: u32,
    pub(crate) rt: tokio::runtime::Handle,
    shutdown: Mutex<Option<tokio::sync::oneshot::Sender<()>>>,
    pub(crate) tcp_addrs: Vec<SocketAddr>,
    pub(crate) unix_name: String,
    pub(crate) keytable: KeyTable,
    /// Peers' copies in progress per key (see `fence.rs`).
    pub(crate) fences: super::fence::FenceTable,
    /// Doorbell slots of this context's QPs (`None`: doorbells off).
    pub(crate) doorbells: Option<super::doorbell::DoorbellTable>,
    /// Doorbell records claimed here, and records of ours retracted to go
    /// through the connection (tests and diagnostics).
    pub(crate) db_claimed: std::sync::atomic::AtomicU64,
    pub(crate) db_retracted: std::sync::atomic::AtomicU64,
    /// Peer event fds rung by this context (a sleeping peer woken).
    pub(crate) db_rings: std::sync::atomic::AtomicU64,
    /// Peer segments mapped, attach requests refused (diagnostics).
    pub(crate) segs_mapped: std::sync::atomic::AtomicU64,
    pub(crate) segs_unmapped: std::sync::atomic::AtomicU64,
    /// Bytes the posting threads copied themselves (WRITE/READ on an idle QP).
    pub(crate) inline_copied: std::sync::atomic::AtomicU64,
    /// Bytes copied into and out of same-host peers' device memory here.
    pub(crate) peer_device_bytes: std::sync::atomic::AtomicU64,
    pub(crate) device_copies: std::sync::atomic::AtomicU64,
    pub(crate) device_copy_waits: std::sync::atomic::AtomicU64,
    /// Request frames written by posting threads themselves.
    pub(crate) poster_frames: std::sync::atomic::AtomicU64,
    /// Request frames written by the progress engine.
    pub(crate) engine_frames: std::sync::atomic::AtomicU64,
    pub(crate) attach_refused: std::sync::atomic::AtomicU64,
    /// Unauthenticated connections closed to stay under the cap.
    pub(crate) handshakes_evicted: std::sync::atomic::AtomicU64,
    /// Duplicates of peers' CQ event fds, shared per peer CQ.
    pub(crate) wakers: super::doorbell::Wakers,
    mrs: RwLock<HashMap<u32, Arc<SoftMr>>>,
    pub(crate) qps: Mutex<HashMap<u32, Weak<SoftQp>>>,
    next_qpn: AtomicU32,
    next_pd: AtomicU32,
    /// Attached peer contexts; an entry dies with the last QP using it.
    peers: Mutex<HashMap<(u32, u64), Weak<PeerMap>>>,
    pub(crate) config: SoftConfig,
    /// Busy-poll bookkeeping: when the engine last did something, and a
    /// wake-up for the spinner.
    epoch: std::time::Instant,
    last_activity_us: std::sync::atomic::AtomicU64,
    activity: Arc<tokio::sync::Notify>,
}

impl std::fmt::Debug for CtxShared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SoftContext")
            .field("uid", &format_args!("{:#x}", self.uid))
            .field("tcp", &self.tcp_addrs)
            .finish()
    }
}

/// A sealed segment holding a device region's IPC export: its length
/// (4 bytes, native order), then the bytes.
fn export_segment(blob: &[u8]) -> Result<Arc<crate::shm::ShmSegment>> {
    let seg = crate::shm::ShmSegment::create(4 + blob.len())?;
    // SAFETY: a fresh mapping of at least 4 + blob.len() bytes that no one
    // else has yet.
    unsafe {
        std::ptr::copy_nonoverlapping((blob.len() as u32).to_ne_bytes().as_ptr(), seg.ptr(), 4);
        std::ptr::copy_nonoverlapping(blob.as_ptr(), seg.ptr().add(4), blob.len());
    }
    Ok(seg)
}

impl CtxShared {
    pub(crate) fn open(config: SoftConfig) -> Result<Arc<CtxShared>> {
        let uid: u64 = rand::random();
        let pid = std::process::id();
        let (tcp, tcp_addrs) = tcp_listeners(&config)?;
        let unix_name = format!("rmacomm-soft-{pid}-{uid:016x}");
        let uaddr = <std::os::unix::net::SocketAddr as std::os::linux::net::SocketAddrExt>::from_abstract_name(
            unix_name.as_bytes(),
        )
        .map_err(|e| Error::os("bind(unix)", e))?;
        let unix = std::os::unix::net::UnixListener::bind_addr(&uaddr).map_err(|e| Error::os("bind(unix)", e))?;
        unix.set_nonblocking(true).map_err(|e| Error::os("bind(unix)", e))?;
        let attach_listener = super::attach::bind(&unix_name).map_err(|e| Error::os("bind(unix attach)", e))?;

        let rt = match config.progress_threads {
            0 | 1 => tokio::runtime::Builder::new_current_thread(),
            n => {
                let mut b = tokio::runtime::Builder::new_multi_thread();
                b.worker_threads(n);
                b
            }
        }
        .enable_all()
        .thread_name("rmacomm-soft")
        .build()
        .map_err(|e| Error::os("soft progress engine", e))?;
        let handle = rt.handle().clone();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        std::thread::Builder::new()
            .name(format!("rmacomm-soft-{uid:04x}"))
            .spawn(move || {
                rt.block_on(async {
                    let _ = stop_rx.await;
                });
                rt.shutdown_background();
            })
            .map_err(|e| Error::os("soft progress engine", e))?;

        let ctx = Arc::new(CtxShared {
            uid,
            host: host_id(),
            pid,
            rt: handle,
            shutdown: Mutex::new(Some(stop_tx)),
            tcp_addrs,
            unix_name,
            keytable: KeyTable::new()?,
            fences: super::fence::FenceTable::new()?,
            doorbells: if config.doorbell {
                super::doorbell::DoorbellTable::new().map_err(|e| tracing::debug!("soft doorbells off: {e}")).ok()
            } else {
                None
            },
            db_claimed: std::sync::atomic::AtomicU64::new(0),
            db_retracted: std::sync::atomic::AtomicU64::new(0),
            db_rings: std::sync::atomic::AtomicU64::new(0),
            segs_mapped: std::sync::atomic::AtomicU64::new(0),
            segs_unmapped: std::sync::atomic::AtomicU64::new(0),
            inline_copied: std::sync::atomic::AtomicU64::new(0),
            peer_device_bytes: std::sync::atomic::AtomicU64::new(0),
            device_copies: std::sync::atomic::AtomicU64::new(0),
            device_copy_waits: std::sync::atomic::AtomicU64::new(0),
            poster_frames: std::sync::atomic::AtomicU64::new(0),
            engine_frames: std::sync::atomic::AtomicU64::new(0),
            attach_refused: std::sync::atomic::AtomicU64::new(0),
            handshakes_evicted: std::sync::atomic::AtomicU64::new(0),
            wakers: Default::default(),
            mrs: RwLock::new(HashMap::new()),
            qps: Mutex::new(HashMap::new()),
            next_qpn: AtomicU32::new((rand::random::<u32>() & 0xffff) | 0x100),
            next_pd: AtomicU32::new(1),
            peers: Mutex::new(HashMap::new()),
            config,
            epoch: std::time::Instant::now(),
            last_activity_us: std::sync::atomic::AtomicU64::new(0),
            activity: Arc::new(tokio::sync::Notify::new()),
        });
        if !ctx.config.busy_poll.is_zero() {
            ctx.rt.spawn(spin(Arc::downgrade(&ctx), ctx.activity.clone(), ctx.config.busy_poll.as_micros() as u64));
        }
        let weak = Arc::downgrade(&ctx);
        ctx.rt.spawn(super::attach::serve(weak.clone(), attach_listener));
        let pending = Arc::new(Mutex::new(Handshakes::default()));
        for l in tcp {
            let (w, p) = (weak.clone(), pending.clone());
            ctx.rt.spawn(async move {
                let l = match tokio::net::TcpListener::from_std(l) {
                    Ok(l) => l,
                    Err(e) => return tracing::error!("soft tcp listener: {e}"),
                };
                loop {
                    let r = l.accept().await.map(|(s, a)| {
                        let _ = s.set_nodelay(true);
                        (s, a.to_string())
                    });
                    match admit_handshake(&w, &p, r, "tcp") {
                        None => return,
                        Some(d) if !d.is_zero() => tokio::time::sleep(d).await,
                        Some(_) => {}
                    }
                }
            });
        }
        ctx.rt.spawn(async move {
            let l = match tokio::net::UnixListener::from_std(unix) {
                Ok(l) => l,
                Err(e) => return tracing::error!("soft unix listener: {e}"),
            };
            loop {
                let r = l.accept().await.map(|(s, _)| (s, "unix".to_owned()));
                match admit_handshake(&weak, &pending, r, "unix") {
                    None => return,
                    Some(d) if !d.is_zero() => tokio::time::sleep(d).await,
                    Some(_) => {}
                }
            }
        });
        Ok(ctx)
    }

    /// Records engine activity (for busy-polling); cheap when it is off.
    pub(crate) fn touch(&self) {
        if !self.config.busy_poll.is_zero() {
            self.last_activity_us.store(self.epoch.elapsed().as_micros() as u64, Ordering::Relaxed);
            self.activity.notify_one();
        }
    }

    /// Looks up a local MR by key (lkey or rkey).
    pub(crate) fn mr(&self, key: u32) -> Option<Arc<SoftMr>> {
        self.mrs.read().unwrap_or_else(|e| e.into_inner()).get(&key).cloned()
    }

    pub(crate) fn deregister(&self, key: u32) {
        self.keytable.revoke(key);
        // No same-host peer is still copying after a check that passed
        // before the revocation.
        self.fences.wait_idle(key);
        self.mrs.write().unwrap_or_else(|e| e.into_inner()).remove(&key);
    }

    fn register(
        self: &Arc<Self>,
        pd: u32,
        addr: *mut u8,
        len: usize,
        access: AccessFlags,
        owner: Option<Arc<dyn Any + Send + Sync>>,
        device: Option<Arc<dyn DeviceMemory>>,
    ) -> Result<Arc<dyn MrOps>> {
        if !access.is_consistent() {
            return Err(Error::invalid("reg_mr", "REMOTE_WRITE and REMOTE_ATOMIC need LOCAL_WRITE too"));
        }
        if addr.is_null() && len > 0 {
            return Err(Error::invalid("reg_mr", "null address"));
        }
        let a = addr as usize;
        if (a as u64).checked_add(len as u64).is_none() {
            return Err(Error::invalid("reg_mr", format!("{a:#x}+{len} wraps around the address space")));
        }
        // Device memory is in no shared segment (its addresses are no host
        // addresses): staged for every peer, unless it exports itself to
        // same-host peers; then the segment holds the export (module docs
        // of `peer`), published like a region's segment.
        let seg = match &device {
            None => find_segment(a, len),
            Some(d) => match d.ipc_export(a as u64, len) {
                Some(Ok(blob)) if blob.len() <= crate::IPC_EXPORT_MAX => match export_segment(&blob) {
                    Ok(seg) => Some((seg, 0)),
                    Err(e) => {
                        tracing::warn!("{}: no segment for the IPC export ({e}); staging", d.describe());
                        None
                    }
                },
                Some(Ok(blob)) => {
                    tracing::warn!("{}: an IPC export of {} bytes is too long; staging", d.describe(), blob.len());
                    None
                }
                Some(Err(e)) => {
                    tracing::info!("{} exports no IPC handle ({e}); same-host peers stage", d.describe());
                    None
                }
                None => None,
            },
        };
        let placement = match (&device, &seg) {
            (Some(_), _) => Placement::Staged,
            (None, Some(_)) => Placement::SharedSegment,
            (None, None) => Placement::ProcessVm,
        };
        let (seg_uid, seg_off) = seg.as_ref().map_or((0, 0), |(s, off)| (s.uid(), *off as u64));
        let mut mrs = self.mrs.write().unwrap_or_else(|e| e.into_inner());
        if mrs.len() >= (SLOT_MASK as usize) {
            return Err(Error::exhausted("reg_mr", "the soft key table is full (16383 regions per context)"));
        }
        // Random keys; the low bits pick a free slot of the shared table.
        let key = loop {
            let k: u32 = rand::random();
            if k & SLOT_MASK != 0 && !mrs.keys().any(|o| o & SLOT_MASK == k & SLOT_MASK) {
                break k;
            }
        };
        let mut mr = SoftMr::new(key, pd, a as u64, len, access, placement, seg.map(|(s, _)| s), owner);
        let mut stored = stored_access(access);
        if let Some(d) = device {
            mr = mr.with_device(d);
            stored |= STORED_DEVICE;
        }
        let mr = Arc::new(mr);
        self.keytable.publish(&SlotData {
            rkey: key,
            pd,
            access: stored,
            addr: a as u64,
            len: len as u64,
            seg_uid,
            seg_off,
        });
        mrs.insert(key, mr.clone());
        Ok(Arc::new(SoftMrHandle { mr, ctx: self.clone() }))
    }

    pub(crate) fn alloc_qpn(&self) -> u32 {
        self.next_qpn.fetch_add(1, Ordering::Relaxed) & 0x00ff_ffff
    }

    /// The segment with unique id `uid` if it backs a region registered
    /// here (the only segments the attach socket hands out).
    pub(crate) fn registered_segment(&self, uid: u64) -> Option<Arc<crate::shm::ShmSegment>> {
        let mrs = self.mrs.read().unwrap_or_else(|e| e.into_inner());
        mrs.values()
            .find_map(|mr| mr.seg.as_ref().filter(|s| s.uid() == uid && mr.valid.load(Ordering::Acquire)).cloned())
    }

    /// The mapping of a same-host peer's tables, attached once per peer
    /// context. `pid` is the peer's pid as the kernel reported it on the QP
    /// connection (the endpoint's own claim is never used), `qpn` the peer
    /// QP whose token `addr` carries.
    pub(crate) async fn peer(&self, addr: &SoftAddress, qpn: u32, pid: u32) -> Result<Arc<PeerMap>> {
        let key = (pid, addr.ctx_uid);
        if let Some(p) = self.peers.lock().unwrap_or_else(|e| e.into_inner()).get(&key).and_then(Weak::upgrade) {
            return Ok(p);
        }
        let p = Arc::new(PeerMap::attach(addr, qpn, pid).await?);
        let mut peers = self.peers.lock().unwrap_or_else(|e| e.into_inner());
        peers.retain(|_, w| w.strong_count() > 0);
        if let Some(other) = peers.get(&key).and_then(Weak::upgrade) {
            return Ok(other);
        }
        peers.insert(key, Arc::downgrade(&p));
        Ok(p)
    }
}

impl Drop for CtxShared {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = tx.send(());
        }
    }
}

/// The busy-poll task: after activity it yields in a loop, which makes the
/// single-threaded runtime poll epoll without blocking, until the engine has
/// been idle for `busy_poll`; then it sleeps until the next activity.
async fn spin(ctx: std::sync::Weak<CtxShared>, activity: Arc<tokio::sync::Notify>, limit: u64) {
    loop {
        activity.notified().await;
        loop {
            let Some(c) = ctx.upgrade() else { return };
            let idle =
                (c.epoch.elapsed().as_micros() as u64).saturating_sub(c.last_activity_us.load(Ordering::Relaxed));
            drop(c);
            if idle >= limit {
                break;
            }
            tokio::task::yield_now().await;
        }
    }
}

/// The TCP listeners of a context and the addresses it advertises:
/// `RMACOMM_SOFT_ADDR` (one address, or all when unspecified), else
/// `RMACOMM_SOCKET_IFNAME` (one listener per selected address, so nothing
/// listens on the other interfaces), else every interface.
fn tcp_listeners(config: &SoftConfig) -> Result<(Vec<std::net::TcpListener>, Vec<SocketAddr>)> {
    let bind = |ip: IpAddr, port: u16| -> Result<(std::net::TcpListener, SocketAddr)> {
        let l = std::net::TcpListener::bind(SocketAddr::new(ip, port)).map_err(|e| Error::os("bind(tcp)", e))?;
        l.set_nonblocking(true).map_err(|e| Error::os("bind(tcp)", e))?;
        let a = l.local_addr().map_err(|e| Error::os("bind(tcp)", e))?;
        Ok((l, a))
    };
    let selected = match (config.bind_addr, &config.socket_ifname) {
        (Some(ip), _) if !ip.is_unspecified() => vec![ip],
        (None, Some(spec)) => {
            let f = super::ifname::IfnameFilter::parse(spec).map_err(|e| Error::invalid("open soft context", e))?;
            super::host::selected_ipv4_addrs(&f, spec).map_err(|e| Error::invalid("open soft context", e))?
        }
        _ => {
            let (l, a) = bind(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0)?;
            let addrs = local_ipv4_addrs().into_iter().map(|ip| SocketAddr::new(ip, a.port())).collect();
            return Ok((vec![l], addrs));
        }
    };
    let mut ls = Vec::new();
    let mut addrs = Vec::new();
    for ip in selected {
        // The same port on every address when it is free (easier to read
        // in a firewall rule); any port otherwise.
        let port = addrs.first().map_or(0, |a: &SocketAddr| a.port());
        let (l, a) = bind(ip, port).or_else(|_| bind(ip, 0))?;
        ls.push(l);
        addrs.push(a);
    }
    Ok((ls, addrs))
}

/// Connections accepted whose hello has not been read yet hold descriptors
/// that nobody authenticated: at most this many at once.
pub(crate) const MAX_PENDING_HANDSHAKES: usize = 128;
/// A connection must send its hello within this long (a real peer sends it
/// at once).
const HELLO_DEADLINE: Duration = Duration::from_secs(3);

/// The unauthenticated connections of a context, oldest first: each
/// one's task (to abort; `None` until it is spawned) and its socket's
/// descriptor (to peek at).
///
/// A listed descriptor is open: its [`Unadmitted`] guard takes it off the
/// list (under the lock) before the socket closes, and an evicted one is
/// taken off before its task is aborted.
#[derive(Debug, Default)]
struct Handshakes {
    next: u64,
    live: std::collections::BTreeMap<u64, (Option<tokio::task::AbortHandle>, std::os::fd::RawFd)>,
}

impl Handshakes {
    /// Closes one pending handshake: the oldest whose whole hello is not
    /// already waiting in its socket (idle connections go first, so a flood
    /// of them that outruns the handshake tasks cannot push out a real peer
    /// whose hello arrived with its connection), else the oldest. False when
    /// there is none.
    fn evict(&mut self) -> bool {
        let idle = self
            .live
            .iter()
            .find(|(_, (_, fd))| {
                // SAFETY: a listed descriptor is open (the guard unlists it
                // before its socket closes, under this lock, which `&mut
                // self` holds); the borrow ends with the peek.
                !hello_waiting(unsafe { std::os::fd::BorrowedFd::borrow_raw(*fd) })
            })
            .map(|(id, _)| *id);
        let victim = match idle {
            Some(id) => self.live.remove(&id),
            None => self.live.pop_first().map(|(_, v)| v),
        };
        match victim {
            Some((Some(h), _)) => {
                h.abort();
                true
            }
            Some((None, fd)) => {
                // Not spawned yet: its read ends at once, finds the
                // connection unlisted and closes it.
                // SAFETY: listed until just now, so still open (see above).
                let _ = rustix::net::shutdown(
                    unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) },
                    rustix::net::Shutdown::Both,
                );
                true
            }
            None => false,
        }
    }
}

/// Whether a whole hello waits unread in the socket (a peek, not waiting).
fn hello_waiting(fd: std::os::fd::BorrowedFd<'_>) -> bool {
    let mut buf = [0u8; HELLO_LEN];
    let flags = rustix::net::RecvFlags::PEEK | rustix::net::RecvFlags::DONTWAIT;
    matches!(rustix::net::recv(fd, &mut buf[..], flags), Ok((n, _)) if n == HELLO_LEN)
}

/// An accepted connection whose hello has not been read: listed in the
/// context's pending handshakes while it is held, and taken off the list
/// (under the lock) before its socket closes, whichever way the task ends
/// (eviction's abort included).
struct Unadmitted<S> {
    s: Option<S>,
    id: u64,
    pending: Arc<Mutex<Handshakes>>,
}

impl<S> Unadmitted<S> {
    /// The connection, taken off the list; `None` when it was evicted
    /// meanwhile (its abort not yet effective, as its task was running).
    fn admit(mut self) -> Option<S> {
        let listed = self.pending.lock().unwrap_or_else(|e| e.into_inner()).live.remove(&self.id).is_some();
        let s = self.s.take();
        s.filter(|_| listed)
    }
}

impl<S> Drop for Unadmitted<S> {
    fn drop(&mut self) {
        if self.s.is_some() {
            self.pending.lock().unwrap_or_else(|e| e.into_inner()).live.remove(&self.id);
        }
    }
}

/// Starts the handshake of an accepted connection, closing a pending one
/// (an idle one first: [`Handshakes::evict`]) when
/// [`MAX_PENDING_HANDSHAKES`] are already waiting (so a flood of idle
/// connections cannot lock out a peer that sends its hello at once). An
/// accept error such as EMFILE also closes a pending handshake, to free a
/// descriptor; the caller then backs off for the returned time. `None` when
/// the context is gone.
fn admit_handshake<S>(
    ctx: &Weak<CtxShared>,
    pending: &Arc<Mutex<Handshakes>>,
    accepted: std::io::Result<(S, String)>,
    kind: &str,
) -> Option<Duration>
where
    S: AsyncRead + AsyncWrite + super::raw_io::HasSock + Unpin + Send + 'static,
{
    let c = ctx.upgrade()?;
    let (s, peer) = match accepted {
        Ok(x) => x,
        Err(e) => {
            let freed = pending.lock().unwrap_or_else(|e| e.into_inner()).evict();
            c.handshakes_evicted.fetch_add(u64::from(freed), Ordering::Relaxed);
            tracing::warn!("soft {kind} accept: {e}");
            // An error that persists must not spin the progress thread.
            return Some(Duration::from_millis(if freed { 1 } else { 10 }));
        }
    };
    let fd = std::os::fd::AsRawFd::as_raw_fd(&s.sock().fd());
    // Listed before its task can run (and end), spawned without the lock
    // (a task dropped at once, as on a closing runtime, takes it in its
    // guard's drop).
    let id = {
        let mut g = pending.lock().unwrap_or_else(|e| e.into_inner());
        let id = g.next;
        g.next += 1;
        g.live.insert(id, (None, fd));
        id
    };
    let conn = Unadmitted { s: Some(s), id, pending: pending.clone() };
    let task = c.rt.spawn(accept_conn(c.clone(), conn, peer));
    let mut g = pending.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(e) = g.live.get_mut(&id) {
        e.0 = Some(task.abort_handle());
    }
    while g.live.len() > MAX_PENDING_HANDSHAKES {
        g.evict();
        c.handshakes_evicted.fetch_add(1, Ordering::Relaxed);
    }
    Some(Duration::ZERO)
}

/// Reads a hello, checks the token, and hands the connection to the QP's
/// responder.
async fn accept_conn<S>(ctx: Arc<CtxShared>, mut conn: Unadmitted<S>, peer: String)
where
    S: AsyncRead + AsyncWrite + super::raw_io::HasSock + Unpin + Send + 'static,
{
    let mut buf = [0u8; HELLO_LEN];
    let r = match conn.s.as_mut() {
        Some(s) => tokio::time::timeout(HELLO_DEADLINE, s.read_exact(&mut buf)).await,
        None => return,
    };
    // From here on the connection is no longer an anonymous one: it is
    // never evicted (it is closed below unless its token is right). One
    // evicted meanwhile (its abort not yet effective, as this task was
    // running) ends here, never at an await inside its responder.
    let Some(mut s) = conn.admit() else {
        return tracing::debug!("soft connection from {peer}: evicted while it sent its hello; closing");
    };
    match r {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => return tracing::debug!("soft connection from {peer} closed during hello: {e}"),
        Err(_) => return tracing::debug!("soft connection from {peer}: no hello within {HELLO_DEADLINE:?}; closing"),
    }
    let hello = match Hello::decode(&buf) {
        Ok(h) => h,
        Err(e) => return tracing::warn!("soft connection from {peer} refused: {e}"),
    };
    let qp = ctx.qps.lock().unwrap_or_else(|e| e.into_inner()).get(&hello.dst_qpn).and_then(Weak::upgrade);
    drop(ctx);
    let qp = match qp {
        Some(qp) if qp.token_matches(&hello.token) => qp,
        _ => {
            tracing::warn!("soft connection from {peer} refused: unknown QP {:#x} or wrong token", hello.dst_qpn);
            let _ = s.write_all(&HelloStatus::BadToken.encode()).await;
            return;
        }
    };
    match qp.admit(hello.src_qpn) {
        Ok(_) => {}
        Err(Refusal::ErrState) => {
            let _ = s.write_all(&HelloStatus::BadState.encode()).await;
            return tracing::warn!(
                "soft connection from {peer} refused: QP {:#x} is in the error state",
                hello.dst_qpn
            );
        }
        Err(why) => {
            let _ = s.write_all(&HelloStatus::BadToken.encode()).await;
            return tracing::warn!(
                "soft connection from {peer} (QP {:#x}) refused by QP {:#x}: {}",
                hello.src_qpn,
                hello.dst_qpn,
                match why {
                    Refusal::WrongPeer => "not the remote QP it was connected to at RTR",
                    _ => "it already has its connection (one per reset)",
                }
            );
        }
    }
    if s.write_all(&HelloStatus::Ok.encode()).await.is_err() {
        return;
    }
    super::responder::run(qp, s, hello, peer).await;
}

/// A soft device context.
#[derive(Debug)]
pub(crate) struct SoftContext {
    pub(crate) shared: Arc<CtxShared>,
}

impl ContextOps for SoftContext {
    fn query_device(&self) -> Result<DeviceAttr> {
        Ok(DeviceAttr {
            max_mr_size: u64::MAX,
            max_qp: 1 << 20,
            max_qp_wr: 1 << 16,
            max_sge: 16,
            max_cqe: 1 << 22,
            max_mr: SLOT_MASK,
            max_qp_rd_atom: 16,
            phys_port_cnt: 1,
            max_msg_sz: self.shared.config.max_msg_size,
            max_inline_data: 4096,
        })
    }

    fn query_port(&self, port: u8) -> Result<PortAttr> {
        if port != 1 {
            return Err(Error::invalid("query_port", format!("port {port} does not exist (soft devices have port 1)")));
        }
        Ok(PortAttr {
            state: PortState::Active,
            max_mtu: Mtu::Mtu4096,
            active_mtu: Mtu::Mtu4096,
            link_layer: LinkLayer::Soft,
            lid: 0,
            gid_tbl_len: 1,
            rate_gbps: None,
        })
    }

    fn query_gid(&self, port: u8, index: u32) -> Result<Gid> {
        if port != 1 || index != 0 {
            return Err(Error::invalid("query_gid", format!("no GID {index} on port {port}")));
        }
        Ok(match self.shared.tcp_addrs.first().map(|a| a.ip()) {
            Some(IpAddr::V4(v4)) => Gid::from_ipv4(v4),
            Some(IpAddr::V6(v6)) => Gid(v6.octets()),
            None => Gid::default(),
        })
    }

    fn alloc_pd(&self) -> Result<Arc<dyn PdOps>> {
        let id = self.shared.next_pd.fetch_add(1, Ordering::Relaxed);
        Ok(Arc::new(SoftPd { id, ctx: self.shared.clone() }))
    }

    fn create_cq(&self, cqe: usize) -> Result<Arc<dyn CqOps>> {
        if cqe == 0 || cqe > 1 << 22 {
            return Err(Error::invalid("create_cq", format!("{cqe} entries: use 1..=4194304")));
        }
        Ok(Arc::new(SoftCq::new(cqe, self.shared.uid)?))
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// A soft protection domain.
#[derive(Debug)]
pub(crate) struct SoftPd {
    pub(crate) id: u32,
    pub(crate) ctx: Arc<CtxShared>,
}

impl PdOps for SoftPd {
    unsafe fn reg_mr(
        &self,
        addr: *mut u8,
        len: usize,
        access: AccessFlags,
        owner: Option<Arc<dyn Any + Send + Sync>>,
    ) -> Result<Arc<dyn MrOps>> {
        self.ctx.register(self.id, addr, len, access, owner, None)
    }

    unsafe fn reg_device_mr(
        &self,
        dev: Arc<dyn DeviceMemory>,
        addr: u64,
        len: usize,
        access: AccessFlags,
        owner: Option<Arc<dyn Any + Send + Sync>>,
    ) -> Result<Arc<dyn MrOps>> {
        let Ok(a) = usize::try_from(addr) else {
            return Err(Error::invalid(
                "reg_mr",
                format!("device address {addr:#x} does not fit this host's pointers"),
            ));
        };
        self.ctx.register(self.id, a as *mut u8, len, access, owner, Some(dev))
    }

    fn create_qp(
        &self,
        attr: &QpInitAttr,
        send_cq: &Arc<dyn CqOps>,
        recv_cq: &Arc<dyn CqOps>,
    ) -> Result<Arc<dyn QpOps>> {
        let qp = SoftQp::create(self, attr, send_cq, recv_cq)?;
        Ok(qp)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixStream;

    /// A listed connection (not spawned) and the peer end that sends.
    fn listed(h: &mut Handshakes) -> (u64, UnixStream, UnixStream) {
        let (ours, theirs) = UnixStream::pair().unwrap();
        let id = h.next;
        h.next += 1;
        h.live.insert(id, (None, ours.as_raw_fd()));
        (id, ours, theirs)
    }

    #[test]
    fn eviction_spares_connections_whose_hello_is_waiting() {
        let mut h = Handshakes::default();
        // The oldest sent its whole hello with its connection (a real peer
        // whose task has not run yet); the next sent part of one; the
        // newest nothing.
        let (real, _real_s, mut real_peer) = listed(&mut h);
        real_peer.write_all(&[7; HELLO_LEN]).unwrap();
        let (part, _part_s, mut part_peer) = listed(&mut h);
        part_peer.write_all(&[7; HELLO_LEN - 1]).unwrap();
        let (idle, _idle_s, mut idle_peer) = listed(&mut h);
        assert!(h.evict());
        assert!(!h.live.contains_key(&part), "a partial hello is no hello: {:?}", h.live.keys());
        assert!(h.live.contains_key(&real) && h.live.contains_key(&idle), "{:?}", h.live.keys());
        // An unspawned one's socket is shut down: its peer reads EOF.
        let mut b = [0u8; 1];
        assert_eq!(part_peer.read(&mut b).unwrap(), 0);
        assert!(h.evict());
        assert!(h.live.contains_key(&real) && !h.live.contains_key(&idle));
        assert_eq!(idle_peer.read(&mut b).unwrap(), 0);
        // Only hellos left: the oldest goes.
        let (newer, _newer_s, mut newer_peer) = listed(&mut h);
        newer_peer.write_all(&[7; HELLO_LEN]).unwrap();
        assert!(h.evict());
        assert!(!h.live.contains_key(&real) && h.live.contains_key(&newer));
        assert!(h.evict());
        assert!(!h.evict(), "nothing left to evict");
    }
}
