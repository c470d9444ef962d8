//! Same-host attachment: how a peer context obtains this context's shared
//! descriptors (key table, doorbell table, memory segments, CQ event fds).
//!
//! Descriptors travel only by `SCM_RIGHTS` over an abstract unix socket
//! (`<unix name>.attach`), never by opening `/proc/<pid>/fd/<n>` or
//! `pidfd_getfd` with numbers a peer reported: a forged endpoint can then
//! name whatever process it likes and we still map only what the process
//! that answers on the socket hands us. Every request carries the target
//! QP's number and connection token (the same secret that admits a QP
//! connection); the server also checks with `SO_PEERCRED` that the client
//! runs as the same user, and the client reads the server's pid the same
//! way (that pid, not the endpoint's, is the one `process_vm_writev` uses).
//!
//! What a client receives is checked before it is used: a segment must be a
//! memfd carrying the expected name and sealed against shrinking and growing
//! (so the owner can never make a mapper fault), at least as long as needed;
//! an event fd must be an event fd (ringing it writes 8 bytes).
//!
//! # Organization
//! - [`Request`] / [`Reply`]: the fixed-size frames, sans-IO (encode, decode,
//!   every field validated).
//! - [`serve`]: the server task on the context's progress runtime.
//! - [`call`]: one request from a client, with a deadline.
//! - [`check_segment`], [`check_eventfd`]: what a client checks.

use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::{Arc, Weak};
use std::time::Duration;

use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer, SendAncillaryMessage};
use tokio::io::Interest;

use super::context::CtxShared;

/// Request frame length.
pub(crate) const REQ_LEN: usize = 40;
/// Reply frame length.
pub(crate) const REPLY_LEN: usize = 16;
const REQ_MAGIC: [u8; 8] = *b"RMACATCH";
const REPLY_MAGIC: [u8; 8] = *b"RMACATOK";
const VERSION: u16 = 1;
/// At most this many descriptors travel in one frame.
const MAX_FDS: usize = 3;
/// A request and its reply must be done within this long.
const DEADLINE: Duration = Duration::from_secs(5);
/// Attach connections served at once; more are closed at once (a peer
/// retries or stages; a flood cannot pin descriptors).
const MAX_CONCURRENT: usize = 64;

/// What a client asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Want {
    /// The key table (read-only), the deregistration fence table and,
    /// when doorbells are on, the doorbell table.
    Tables,
    /// The shared segment with this unique id, which must back a region
    /// registered in the context.
    Segment(u64),
    /// The event fd of the target QP's receive CQ (for doorbell rings).
    RecvCqWaker,
    /// Here is the event fd of the client's send CQ with this unique id,
    /// for the target QP to ring when it claims a doorbell record.
    SendCqWaker(u64),
}

/// A request: the target QP, its token, and what is wanted.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct Request {
    pub(crate) qpn: u32,
    pub(crate) token: [u8; 16],
    pub(crate) want: Want,
}

impl std::fmt::Debug for Request {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The token is a secret: never printed.
        f.debug_struct("Request").field("qpn", &format_args!("{:#x}", self.qpn)).field("want", &self.want).finish()
    }
}

impl Request {
    pub(crate) fn encode(&self) -> [u8; REQ_LEN] {
        let (kind, arg) = match self.want {
            Want::Tables => (1u16, 0u64),
            Want::Segment(uid) => (2, uid),
            Want::RecvCqWaker => (3, 0),
            Want::SendCqWaker(cq) => (4, cq),
        };
        let mut o = [0u8; REQ_LEN];
        o[0..8].copy_from_slice(&REQ_MAGIC);
        o[8..10].copy_from_slice(&VERSION.to_le_bytes());
        o[10..12].copy_from_slice(&kind.to_le_bytes());
        o[12..16].copy_from_slice(&self.qpn.to_le_bytes());
        o[16..32].copy_from_slice(&self.token);
        o[32..40].copy_from_slice(&arg.to_le_bytes());
        o
    }

    pub(crate) fn decode(b: &[u8; REQ_LEN]) -> Result<Request, String> {
        if b[0..8] != REQ_MAGIC {
            return Err("bad magic".into());
        }
        let version = u16::from_le_bytes([b[8], b[9]]);
        if version != VERSION {
            return Err(format!("version {version} (this build speaks {VERSION})"));
        }
        let kind = u16::from_le_bytes([b[10], b[11]]);
        let qpn = u32::from_le_bytes(b[12..16].try_into().expect("4 bytes"));
        let token: [u8; 16] = b[16..32].try_into().expect("16 bytes");
        let arg = u64::from_le_bytes(b[32..40].try_into().expect("8 bytes"));
        let want = match (kind, arg) {
            (1, 0) => Want::Tables,
            (2, uid) if uid != 0 => Want::Segment(uid),
            (3, 0) => Want::RecvCqWaker,
            (4, cq) => Want::SendCqWaker(cq),
            _ => return Err(format!("bad request kind {kind} with argument {arg:#x}")),
        };
        if qpn > 0x00ff_ffff {
            return Err(format!("QP number {qpn:#x} is out of range"));
        }
        Ok(Request { qpn, token, want })
    }
}

/// How the server answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Status {
    /// Here are the descriptors.
    Ok,
    /// Unknown QP or wrong token.
    Refused,
    /// No such segment registered (any more), or no doorbell.
    NotFound,
    /// The request (or the descriptor sent with it) was not acceptable.
    Malformed,
}

/// A reply: the status and how many descriptors come with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Reply {
    pub(crate) status: Status,
    pub(crate) nfds: u32,
}

impl Reply {
    pub(crate) fn encode(&self) -> [u8; REPLY_LEN] {
        let st: u32 = match self.status {
            Status::Ok => 0,
            Status::Refused => 1,
            Status::NotFound => 2,
            Status::Malformed => 3,
        };
        let mut o = [0u8; REPLY_LEN];
        o[0..8].copy_from_slice(&REPLY_MAGIC);
        o[8..12].copy_from_slice(&st.to_le_bytes());
        o[12..16].copy_from_slice(&self.nfds.to_le_bytes());
        o
    }

    pub(crate) fn decode(b: &[u8; REPLY_LEN]) -> Result<Reply, String> {
        if b[0..8] != REPLY_MAGIC {
            return Err("bad reply magic".into());
        }
        let status = match u32::from_le_bytes(b[8..12].try_into().expect("4 bytes")) {
            0 => Status::Ok,
            1 => Status::Refused,
            2 => Status::NotFound,
            3 => Status::Malformed,
            s => return Err(format!("bad reply status {s}")),
        };
        let nfds = u32::from_le_bytes(b[12..16].try_into().expect("4 bytes"));
        if nfds as usize > MAX_FDS || (status != Status::Ok && nfds != 0) {
            return Err(format!("bad reply: {nfds} descriptors with status {status:?}"));
        }
        Ok(Reply { status, nfds })
    }
}

/// The attach socket's name for a context whose QP listener is `unix`.
pub(crate) fn socket_name(unix: &str) -> String {
    format!("{unix}.attach")
}

/// Binds the attach listener (abstract: per network namespace, exactly the
/// scope of "same host").
pub(crate) fn bind(unix: &str) -> std::io::Result<std::os::unix::net::UnixListener> {
    use std::os::linux::net::SocketAddrExt;
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(socket_name(unix).as_bytes())?;
    let l = std::os::unix::net::UnixListener::bind_addr(&addr)?;
    l.set_nonblocking(true)?;
    Ok(l)
}

fn euid() -> u32 {
    rustix::process::geteuid().as_raw()
}

/// Reads exactly `buf.len()` bytes, keeping any descriptors that come with
/// them (at most [`MAX_FDS`]; more is an error, and they are closed).
async fn recv_frame(s: &tokio::net::UnixStream, buf: &mut [u8], fds: &mut Vec<OwnedFd>) -> std::io::Result<()> {
    let mut got = 0;
    while got < buf.len() {
        let n = s
            .async_io(Interest::READABLE, || {
                let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
                let mut cmsg = RecvAncillaryBuffer::new(&mut space);
                let mut iov = [IoSliceMut::new(&mut buf[got..])];
                let r = rustix::net::recvmsg(s, &mut iov, &mut cmsg, RecvFlags::CMSG_CLOEXEC)?;
                for m in cmsg.drain() {
                    if let RecvAncillaryMessage::ScmRights(rights) = m {
                        fds.extend(rights);
                    }
                }
                if r.flags.contains(rustix::net::ReturnFlags::CTRUNC) {
                    return Err(std::io::Error::other("too many descriptors"));
                }
                Ok(r.bytes)
            })
            .await?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        if fds.len() > MAX_FDS {
            return Err(std::io::Error::other("too many descriptors"));
        }
        got += n;
    }
    Ok(())
}

/// Writes `buf` whole, the descriptors attached to its first byte.
async fn send_frame(s: &tokio::net::UnixStream, buf: &[u8], fds: &[BorrowedFd<'_>]) -> std::io::Result<()> {
    let mut sent = 0;
    while sent < buf.len() {
        let first = sent == 0;
        let n = s
            .async_io(Interest::WRITABLE, || {
                let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
                let mut cmsg = SendAncillaryBuffer::new(&mut space);
                if first && !fds.is_empty() && !cmsg.push(SendAncillaryMessage::ScmRights(fds)) {
                    return Err(std::io::Error::other("descriptor buffer too small"));
                }
                let iov = [IoSlice::new(&buf[sent..])];
                Ok(rustix::net::sendmsg(s, &iov, &mut cmsg, rustix::net::SendFlags::NOSIGNAL)?)
            })
            .await?;
        sent += n;
    }
    Ok(())
}

/// Serves attach requests until the context is gone.
pub(crate) async fn serve(ctx: Weak<CtxShared>, l: std::os::unix::net::UnixListener) {
    let l = match tokio::net::UnixListener::from_std(l) {
        Ok(l) => l,
        Err(e) => return tracing::error!("soft attach listener: {e}"),
    };
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONCURRENT));
    loop {
        let s = match l.accept().await {
            Ok((s, _)) => s,
            Err(e) => {
                // EMFILE and friends: back off instead of spinning.
                tracing::warn!("soft attach accept: {e}");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let Ok(permit) = slots.clone().try_acquire_owned() else {
            tracing::warn!("soft attach: {MAX_CONCURRENT} requests in progress; closing a new one");
            continue;
        };
        let cred = match rustix::net::sockopt::socket_peercred(&s) {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!("soft attach: cannot read the client's credentials: {e}");
                continue;
            }
        };
        let Some(c) = ctx.upgrade() else { return };
        if cred.uid.as_raw() != euid() {
            c.attach_refused.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            tracing::warn!(
                "soft attach: refused a client running as uid {} (pid {}): same-host peers must share the user",
                cred.uid.as_raw(),
                cred.pid.as_raw_nonzero()
            );
            continue;
        }
        let pid = cred.pid.as_raw_nonzero().get() as u32;
        tokio::spawn(async move {
            let _permit = permit;
            if tokio::time::timeout(DEADLINE, handle(&c, &s, pid)).await.is_err() {
                tracing::debug!("soft attach: request from pid {pid} not done within {DEADLINE:?}; closed");
            }
        });
    }
}

/// One request on an accepted attach connection.
async fn handle(ctx: &CtxShared, s: &tokio::net::UnixStream, pid: u32) {
    let mut buf = [0u8; REQ_LEN];
    let mut fds = Vec::new();
    if let Err(e) = recv_frame(s, &mut buf, &mut fds).await {
        return tracing::debug!("soft attach from pid {pid}: {e}");
    }
    let reply = |status| Reply { status, nfds: 0 }.encode();
    let req = match Request::decode(&buf) {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!("soft attach from pid {pid}: malformed request ({e})");
            ctx.attach_refused.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let _ = send_frame(s, &reply(Status::Malformed), &[]).await;
            return;
        }
    };
    let expected_fds = usize::from(matches!(req.want, Want::SendCqWaker(_)));
    if fds.len() != expected_fds {
        tracing::warn!("soft attach from pid {pid}: {} descriptors with {:?}", fds.len(), req.want);
        ctx.attach_refused.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let _ = send_frame(s, &reply(Status::Malformed), &[]).await;
        return;
    }
    let qp = ctx.qps.lock().unwrap_or_else(|e| e.into_inner()).get(&req.qpn).and_then(Weak::upgrade);
    let qp = match qp {
        Some(qp) if qp.token_matches(&req.token) => qp,
        _ => {
            tracing::warn!("soft attach from pid {pid} refused: unknown QP {:#x} or wrong token", req.qpn);
            ctx.attach_refused.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let _ = send_frame(s, &reply(Status::Refused), &[]).await;
            return;
        }
    };
    match req.want {
        Want::Tables => {
            let kt = match ctx.keytable.read_only_fd() {
                Ok(fd) => fd,
                Err(e) => {
                    tracing::warn!("soft attach: cannot reopen the key table read-only: {e}");
                    let _ = send_frame(s, &reply(Status::NotFound), &[]).await;
                    return;
                }
            };
            let mut out = vec![kt.as_fd(), ctx.fences.borrow_fd()];
            if let Some(t) = &ctx.doorbells {
                out.push(t.borrow_fd());
            }
            let r = Reply { status: Status::Ok, nfds: out.len() as u32 };
            let _ = send_frame(s, &r.encode(), &out).await;
        }
        Want::Segment(uid) => match ctx.registered_segment(uid) {
            Some(seg) => {
                let _ = send_frame(s, &Reply { status: Status::Ok, nfds: 1 }.encode(), &[seg.borrow_fd()]).await;
            }
            None => {
                let _ = send_frame(s, &reply(Status::NotFound), &[]).await;
            }
        },
        Want::RecvCqWaker => {
            let fd = qp.recv_cq_fd();
            let _ = send_frame(s, &Reply { status: Status::Ok, nfds: 1 }.encode(), &[fd]).await;
        }
        Want::SendCqWaker(cq) => {
            let fd = fds.pop().expect("one descriptor, checked above");
            if let Err(e) = check_eventfd(&fd) {
                tracing::warn!("soft attach from pid {pid}: send CQ waker refused: {e}");
                ctx.attach_refused.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let _ = send_frame(s, &reply(Status::Malformed), &[]).await;
                return;
            }
            let w = ctx.wakers.insert(pid, cq, fd);
            let status = if qp.set_tx_waker(cq, w) { Status::Ok } else { Status::NotFound };
            let _ = send_frame(s, &reply(status), &[]).await;
        }
    }
}

/// What an attach call brings back.
#[derive(Debug)]
pub(crate) struct Answer {
    pub(crate) status: Status,
    pub(crate) fds: Vec<OwnedFd>,
    /// The server's pid as the kernel reports it (`SO_PEERCRED`).
    pub(crate) pid: u32,
}

/// Sends one request to the attach socket of the context whose QP listener
/// is `unix`, with `send` attached, and waits for the answer.
pub(crate) async fn call(unix: &str, req: &Request, send: Option<BorrowedFd<'_>>) -> Result<Answer, String> {
    let what = format!("attach {:?} of QP {:#x}", req.want, req.qpn);
    let fut = async {
        use std::os::linux::net::SocketAddrExt;
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(socket_name(unix).as_bytes())
            .map_err(|e| e.to_string())?;
        let s = std::os::unix::net::UnixStream::connect_addr(&addr).map_err(|e| format!("connect: {e}"))?;
        s.set_nonblocking(true).map_err(|e| e.to_string())?;
        let s = tokio::net::UnixStream::from_std(s).map_err(|e| e.to_string())?;
        let cred = rustix::net::sockopt::socket_peercred(&s).map_err(|e| format!("SO_PEERCRED: {e}"))?;
        if cred.uid.as_raw() != euid() {
            return Err(format!("the server runs as uid {}, not as this user", cred.uid.as_raw()));
        }
        let pid = cred.pid.as_raw_nonzero().get() as u32;
        let sends: Vec<BorrowedFd<'_>> = send.into_iter().collect();
        send_frame(&s, &req.encode(), &sends).await.map_err(|e| format!("send: {e}"))?;
        let mut buf = [0u8; REPLY_LEN];
        let mut fds = Vec::new();
        recv_frame(&s, &mut buf, &mut fds).await.map_err(|e| format!("reply: {e}"))?;
        let reply = Reply::decode(&buf)?;
        if fds.len() != reply.nfds as usize {
            return Err(format!("reply announced {} descriptors and carried {}", reply.nfds, fds.len()));
        }
        Ok(Answer { status: reply.status, fds, pid })
    };
    match tokio::time::timeout(DEADLINE, fut).await {
        Ok(r) => r.map_err(|e| format!("{what}: {e}")),
        Err(_) => Err(format!("{what}: no answer within {DEADLINE:?}")),
    }
}

/// What `/proc/self/fd/<fd>` points at.
fn fd_target(fd: &OwnedFd) -> Result<String, String> {
    std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))
        .map(|p| p.to_string_lossy().into_owned())
        .map_err(|e| format!("readlink: {e}"))
}

/// Checks that `fd` is the sealed memfd segment `uid` of at least `min_len`
/// bytes; returns its length.
pub(crate) fn check_segment(fd: &OwnedFd, uid: u64, min_len: usize) -> Result<usize, String> {
    let target = fd_target(fd)?;
    let name = crate::shm::segment_name(uid);
    if !target.starts_with(&format!("/memfd:{name}")) {
        return Err(format!("descriptor is {target:?}, not segment {uid:#x}"));
    }
    let seals = rustix::fs::fcntl_get_seals(fd).map_err(|e| format!("F_GET_SEALS: {e}"))?;
    let need = rustix::fs::SealFlags::SHRINK | rustix::fs::SealFlags::GROW;
    if !seals.contains(need) {
        return Err(format!("segment {uid:#x} is not sealed against resizing (seals {seals:?})"));
    }
    let len = rustix::fs::fstat(fd).map_err(|e| format!("fstat: {e}"))?.st_size as usize;
    if len < min_len {
        return Err(format!("segment {uid:#x} is {len} bytes, shorter than {min_len}"));
    }
    Ok(len)
}

/// Checks that `fd` is an event fd (a doorbell ring writes 8 bytes to it).
pub(crate) fn check_eventfd(fd: &OwnedFd) -> Result<(), String> {
    let target = fd_target(fd)?;
    if target == "anon_inode:[eventfd]" {
        Ok(())
    } else {
        Err(format!("descriptor is {target:?}, not an event fd"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn request_round_trip_and_token_redacted() {
        for want in [Want::Tables, Want::Segment(0x1234), Want::RecvCqWaker, Want::SendCqWaker(9)] {
            let r = Request { qpn: 0x1234, token: [0xab; 16], want };
            assert_eq!(Request::decode(&r.encode()).unwrap(), r);
            assert!(!format!("{r:?}").to_lowercase().contains("ab, 0xab") && !format!("{r:?}").contains("171"));
        }
        let bad = Request { qpn: 1, token: [0; 16], want: Want::Segment(0) }.encode();
        assert!(Request::decode(&bad).is_err(), "segment 0 is never valid");
    }

    #[test]
    fn reply_validated() {
        let ok = Reply { status: Status::Ok, nfds: 3 };
        assert_eq!(Reply::decode(&ok.encode()).unwrap(), ok);
        assert!(Reply::decode(&Reply { status: Status::Ok, nfds: 4 }.encode()).is_err());
        assert!(Reply::decode(&Reply { status: Status::Refused, nfds: 1 }.encode()).is_err());
    }

    proptest! {
        #[test]
        fn random_requests_never_panic(b in proptest::collection::vec(any::<u8>(), REQ_LEN)) {
            let _ = Request::decode(&b.try_into().unwrap());
        }

        #[test]
        fn random_replies_never_panic(b in proptest::collection::vec(any::<u8>(), REPLY_LEN)) {
            let _ = Reply::decode(&b.try_into().unwrap());
        }
    }

    #[test]
    fn unsealed_or_foreign_descriptors_are_refused() {
        // A memfd with the right name but no seals (a peer could shrink it
        // under our mapping).
        let name = crate::shm::segment_name(0x77);
        let fd = rustix::fs::memfd_create(name.as_str(), rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&fd, 4096).unwrap();
        let e = check_segment(&fd, 0x77, 4096).unwrap_err();
        assert!(e.contains("not sealed"), "{e}");
        // Another segment's name.
        let e = check_segment(&fd, 0x78, 4096).unwrap_err();
        assert!(e.contains("not segment"), "{e}");
        // Not an event fd.
        assert!(check_eventfd(&fd).unwrap_err().contains("not an event fd"));
        // A real, sealed segment passes; a longer need fails.
        let seg = crate::shm::ShmSegment::create(8192).unwrap();
        let dup = seg.borrow_fd().try_clone_to_owned().unwrap();
        assert_eq!(check_segment(&dup, seg.uid(), 8192).unwrap(), 8192);
        assert!(check_segment(&dup, seg.uid(), 8193).unwrap_err().contains("shorter"));
        let efd = rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC).unwrap();
        check_eventfd(&efd).unwrap();
    }
}
