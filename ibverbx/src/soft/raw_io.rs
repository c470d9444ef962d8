//! Socket I/O to and from raw memory: payloads move between a connection
//! and registered regions without a Rust reference to the region.
//!
//! Peers (and the application, and other WRs) may read or write a
//! registered region at any time, so a `&[u8]` or `&mut [u8]` over it would
//! promise an immutability or exclusivity that does not hold. The payload
//! bytes are moved by `recv`/`sendmsg` on the socket's descriptor instead: a
//! system call writing memory creates no reference. Readiness comes from
//! tokio (try the call, wait for readiness only after `WouldBlock`, which
//! `try_io` clears). Headers still go through `AsyncRead`/`AsyncWrite` on
//! the same sockets: neither buffers, so the two interleave.
//!
//! rustix and nix take `&mut [u8]`/`&[MaybeUninit<u8>]` for `recv` and
//! `IoSlice`s (slices again) for `sendmsg`, so this module calls libc.

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::task::{ready, Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, Interest};
use tokio::net::{tcp, unix, TcpStream, UnixStream};

use super::wire::{Frame, HEADER_LEN};

/// Header plus one piece per SGE (at most 16).
const MAX_IOV: usize = 17;

/// The socket under a stream or one of its halves.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Sock<'a> {
    Tcp(&'a TcpStream),
    Unix(&'a UnixStream),
}

impl Sock<'_> {
    fn poll_ready(&self, cx: &mut Context<'_>, interest: Interest) -> Poll<io::Result<()>> {
        match (self, interest.is_readable()) {
            (Sock::Tcp(s), true) => s.poll_read_ready(cx),
            (Sock::Tcp(s), false) => s.poll_write_ready(cx),
            (Sock::Unix(s), true) => s.poll_read_ready(cx),
            (Sock::Unix(s), false) => s.poll_write_ready(cx),
        }
    }

    /// Whether bytes can be read without waiting (a peek; an error or EOF
    /// counts as readable: the next read reports it).
    pub(crate) fn readable_now(&self) -> bool {
        let fd = match self {
            Sock::Tcp(s) => s.as_raw_fd(),
            Sock::Unix(s) => s.as_raw_fd(),
        };
        let mut b = 0u8;
        // SAFETY: fd is the live socket's descriptor; b is a live one-byte
        // buffer; MSG_PEEK leaves the byte in the socket.
        let n = unsafe { libc::recv(fd, (&mut b as *mut u8).cast(), 1, libc::MSG_PEEK | libc::MSG_DONTWAIT) };
        n != -1 || std::io::Error::last_os_error().kind() != io::ErrorKind::WouldBlock
    }

    /// Waits until the socket is readable (or has an error or EOF to
    /// report).
    pub(crate) async fn readable(&self) -> io::Result<()> {
        std::future::poll_fn(|cx| self.poll_ready(cx, Interest::READABLE)).await
    }

    /// Reads what is there into `buf` without waiting (`WouldBlock` when
    /// nothing is, which clears the readiness [`readable`](Self::readable)
    /// waits for); 0 at EOF.
    pub(crate) fn try_recv(&self, buf: &mut [u8]) -> io::Result<usize> {
        let mut op = |fd: RawFd| {
            // SAFETY: buf is a live, exclusive slice of buf.len() bytes.
            byte_count(unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), 0) })
        };
        match self {
            Sock::Tcp(s) => s.try_io(Interest::READABLE, || op(s.as_raw_fd())),
            Sock::Unix(s) => s.try_io(Interest::READABLE, || op(s.as_raw_fd())),
        }
    }

    /// The socket's descriptor.
    pub(crate) fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        use std::os::fd::AsFd;
        match self {
            Sock::Tcp(s) => s.as_fd(),
            Sock::Unix(s) => s.as_fd(),
        }
    }

    /// A tcp connection's socket (not a unix one).
    pub(crate) fn is_tcp(&self) -> bool {
        matches!(self, Sock::Tcp(_))
    }

    /// Runs `op` once without waiting: `None` when it would block (which
    /// clears the readiness that [`poll_io`](Self::poll_io) waits for).
    fn try_now<R>(&self, mut op: impl FnMut(RawFd) -> io::Result<R>) -> Option<io::Result<R>> {
        loop {
            let r = match self {
                Sock::Tcp(s) => s.try_io(Interest::READABLE, || op(s.as_raw_fd())),
                Sock::Unix(s) => s.try_io(Interest::READABLE, || op(s.as_raw_fd())),
            };
            match r {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return None,
                r => return Some(r),
            }
        }
    }

    /// Runs `op` on the descriptor until it does something other than
    /// `WouldBlock`, waiting for `interest` in between.
    fn poll_io<R>(
        &self,
        cx: &mut Context<'_>,
        interest: Interest,
        mut op: impl FnMut(RawFd) -> io::Result<R>,
    ) -> Poll<io::Result<R>> {
        loop {
            ready!(self.poll_ready(cx, interest))?;
            let r = match self {
                Sock::Tcp(s) => s.try_io(interest, || op(s.as_raw_fd())),
                Sock::Unix(s) => s.try_io(interest, || op(s.as_raw_fd())),
            };
            match r {
                Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted) => continue,
                r => return Poll::Ready(r),
            }
        }
    }
}

/// A stream, or one half of it, whose socket the raw I/O can reach.
pub(crate) trait HasSock {
    fn sock(&self) -> Sock<'_>;
}

impl HasSock for TcpStream {
    fn sock(&self) -> Sock<'_> {
        Sock::Tcp(self)
    }
}

impl HasSock for UnixStream {
    fn sock(&self) -> Sock<'_> {
        Sock::Unix(self)
    }
}

impl HasSock for tcp::OwnedReadHalf {
    fn sock(&self) -> Sock<'_> {
        Sock::Tcp(self.as_ref())
    }
}

impl HasSock for tcp::OwnedWriteHalf {
    fn sock(&self) -> Sock<'_> {
        Sock::Tcp(self.as_ref())
    }
}

impl HasSock for unix::OwnedReadHalf {
    fn sock(&self) -> Sock<'_> {
        Sock::Unix(self.as_ref())
    }
}

impl HasSock for unix::OwnedWriteHalf {
    fn sock(&self) -> Sock<'_> {
        Sock::Unix(self.as_ref())
    }
}

impl<T: HasSock + ?Sized> HasSock for Box<T> {
    fn sock(&self) -> Sock<'_> {
        (**self).sock()
    }
}

/// The reading half of a connection.
pub(crate) trait SockRead: AsyncRead + HasSock + Unpin + Send {}
impl<T: AsyncRead + HasSock + Unpin + Send> SockRead for T {}

/// The writing half of a connection.
pub(crate) trait SockWrite: AsyncWrite + HasSock + Unpin + Send {}
impl<T: AsyncWrite + HasSock + Unpin + Send> SockWrite for T {}

/// Reads exactly `len` bytes from the socket into `addr..addr+len`
/// (zero-copy: straight from the socket buffer into that memory).
///
/// # Safety
/// `addr..addr+len` must stay valid for writes until the returned future
/// completes or is dropped. Others may access it concurrently (their reads
/// then see torn data, as with a NIC), but nothing may hold a Rust
/// reference to it.
pub(crate) async unsafe fn recv_exact<R: HasSock + ?Sized>(r: &mut R, addr: usize, len: usize) -> io::Result<()> {
    // SAFETY: the caller's contract.
    unsafe { recv_exact_while(r, addr, len, || Some(())).await }
}

/// [`recv_exact`] into memory that may stop being registered meanwhile:
/// `enter` is called before each receive into it and its guard held for
/// that receive only (never across a wait); `None` (the memory is no
/// longer registered) ends the read with [`io::ErrorKind::PermissionDenied`],
/// nothing more written.
///
/// # Safety
/// As [`recv_exact`], for as long as `enter` returns guards.
pub(crate) async unsafe fn recv_exact_while<R, G, F>(r: &mut R, addr: usize, len: usize, enter: F) -> io::Result<()>
where
    R: HasSock + ?Sized,
    F: Fn() -> Option<G>,
{
    let enter = &enter;
    let mut done = 0;
    let mut mark = Mark::new(r.sock(), len);
    let m = &mut mark;
    // `move`: the closure owns `&mut R` (Send) rather than borrowing `&R`
    // (which would need R: Sync).
    let got = std::future::poll_fn(move |cx| {
        let sock = r.sock();
        while done < len {
            let (at, want) = (addr + done, len - done);
            let op = move |fd| {
                let Some(_registered) = enter() else {
                    return Err(super::device_io::deregistered());
                };
                // SAFETY: at..at+want is valid for writes while the guard
                // is held (the caller's contract) and recv writes at most
                // want bytes.
                byte_count(unsafe { libc::recv(fd, at as *mut libc::c_void, want, 0) })
            };
            let n = match sock.try_now(op) {
                Some(r) => r?,
                None => {
                    m.wait_for(want);
                    ready!(sock.poll_io(cx, Interest::READABLE, op))?
                }
            };
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::UnexpectedEof.into()));
            }
            done += n;
        }
        Poll::Ready(Ok(()))
    })
    .await;
    drop(mark);
    got
}

/// The receive low-water mark of a tcp socket while a long payload is read:
/// raised to what is still missing, so that the reader wakes once when it
/// is all there rather than at every arriving segment (at 1 MiB payloads
/// about three wake-ups per payload became one: tcp `write` and `read` at
/// 1 MiB +30-40 %). Back at 1 when the read ends or is dropped. The kernel
/// still wakes the reader early under memory pressure, at a closing window,
/// FIN or error, so a raised mark never strands bytes; nonblocking reads
/// ignore it. Readers hold the connection's gate meanwhile (see
/// `polled_rx.rs`), so pollers never see the mark raised this way.
struct Mark {
    fd: Option<RawFd>,
    set: libc::c_int,
}

/// Payloads at least this long wait with a raised mark.
const MARK_MIN: usize = 64 << 10;
/// The highest mark set (the kernel caps it at half of `tcp_rmem`'s
/// largest buffer, and grows the socket's receive buffer to fit it).
const MARK_MAX: usize = 4 << 20;

impl Mark {
    fn new(sock: Sock<'_>, len: usize) -> Mark {
        let fd = match sock {
            Sock::Tcp(s) if len >= MARK_MIN => Some(s.as_raw_fd()),
            _ => None,
        };
        Mark { fd, set: 1 }
    }

    fn put(&mut self, v: libc::c_int) {
        if let Some(fd) = self.fd {
            if v != self.set {
                // SAFETY: SO_RCVLOWAT reads one int from a live local.
                unsafe {
                    libc::setsockopt(
                        fd,
                        libc::SOL_SOCKET,
                        libc::SO_RCVLOWAT,
                        (&v as *const libc::c_int).cast(),
                        std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                    )
                };
                self.set = v;
            }
        }
    }

    fn wait_for(&mut self, missing: usize) {
        if missing >= MARK_MIN {
            self.put(missing.min(MARK_MAX) as libc::c_int);
        } else {
            self.put(1);
        }
    }
}

impl Drop for Mark {
    fn drop(&mut self) {
        self.put(1);
    }
}

/// A syscall's byte count, or the error it set.
fn byte_count(n: isize) -> io::Result<usize> {
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

/// Writes `head`, then the raw pieces `(addr, len)` in order, all of them,
/// with as few `sendmsg` calls as the socket allows.
///
/// # Safety
/// Every piece must stay valid for reads until the returned future
/// completes or is dropped (others may write it meanwhile: the peer then
/// gets torn data, as from a NIC).
pub(crate) async unsafe fn send_all<W: HasSock + ?Sized>(
    w: &mut W,
    head: &[u8],
    pieces: &[(usize, usize)],
) -> io::Result<()> {
    // SAFETY: the caller's contract.
    unsafe { send_all_while(w, head, pieces, || Some(())).await }
}

/// [`send_all`] from memory that may stop being registered meanwhile, as
/// [`recv_exact_while`] receives into it: `enter` around each `sendmsg`,
/// `None` ends it with [`io::ErrorKind::PermissionDenied`] (the frame is
/// then torn: the connection must close).
///
/// # Safety
/// As [`send_all`], for as long as `enter` returns guards.
pub(crate) async unsafe fn send_all_while<W, G, F>(
    w: &mut W,
    head: &[u8],
    pieces: &[(usize, usize)],
    enter: F,
) -> io::Result<()>
where
    W: HasSock + ?Sized,
    F: Fn() -> Option<G>,
{
    let total = head.len() + pieces.iter().map(|p| p.1).sum::<usize>();
    let mut sent = 0;
    let enter = &enter;
    // `move`: as in `recv_exact`.
    std::future::poll_fn(move |cx| {
        let sock = w.sock();
        while sent < total {
            let n = ready!(sock.poll_io(cx, Interest::WRITABLE, |fd| {
                let Some(_registered) = enter() else {
                    return Err(super::device_io::deregistered());
                };
                let mut iov = [libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 }; MAX_IOV];
                let all = std::iter::once((head.as_ptr() as usize, head.len())).chain(pieces.iter().copied());
                let k = fill_iov(all, sent, &mut iov);
                // SAFETY: all-zero is a valid msghdr (no name, no control).
                let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
                msg.msg_iov = iov.as_mut_ptr();
                msg.msg_iovlen = k as _;
                // SAFETY: the iovecs cover the unsent rest of `head` (a live
                // slice) and of the pieces (valid for reads: the caller's
                // contract); MSG_NOSIGNAL: a closed peer is an error, not
                // SIGPIPE.
                byte_count(unsafe { libc::sendmsg(fd, &msg, libc::MSG_NOSIGNAL) })
            }))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            sent += n;
        }
        Poll::Ready(Ok(()))
    })
    .await
}

/// Fills `iov` with the pieces `(addr, len)` past their first `skip`
/// bytes, as many as fit; returns how many it filled.
pub(crate) fn fill_iov(
    pieces: impl IntoIterator<Item = (usize, usize)>,
    mut skip: usize,
    iov: &mut [libc::iovec],
) -> usize {
    let mut k = 0;
    for (a, l) in pieces {
        if skip >= l {
            skip -= l;
            continue;
        }
        if k == iov.len() {
            break;
        }
        iov[k] = libc::iovec { iov_base: (a + skip) as *mut libc::c_void, iov_len: l - skip };
        skip = 0;
        k += 1;
    }
    k
}

/// Appends the raw pieces `(addr, len)` to `buf`, copied through raw
/// pointers: registered memory may be written by peers meanwhile, so it is
/// never borrowed as a slice.
///
/// # Safety
/// Every piece must be valid for reads.
pub(crate) unsafe fn extend_raw(buf: &mut Vec<u8>, pieces: &[(usize, usize)]) {
    for &(p, l) in pieces {
        buf.reserve(l);
        let at = buf.len();
        // SAFETY: the source is valid for reads (the caller's contract) and
        // the destination has room for l more bytes (reserved above).
        unsafe {
            std::ptr::copy_nonoverlapping(p as *const u8, buf.as_mut_ptr().add(at), l);
            buf.set_len(at + l);
        }
    }
}

/// Writes a header and its payload, straight from registered memory.
/// Small frames are staged and go out in one write.
///
/// # Safety
/// Every payload piece `(addr, len)` must stay valid for reads until the
/// returned future completes or is dropped.
pub(crate) async unsafe fn send_frame<W: HasSock + ?Sized>(
    w: &mut W,
    f: &Frame,
    payload: &[(usize, usize)],
) -> std::io::Result<()> {
    // SAFETY: the caller's contract.
    unsafe { send_frame_while(w, f, payload, || Some(())).await }
}

/// [`send_frame`] of a payload in a region that its owner may deregister
/// meanwhile (a READ response): `enter` around each read of it, as in
/// [`send_all_while`].
///
/// # Safety
/// As [`send_frame`], for as long as `enter` returns guards.
pub(crate) async unsafe fn send_frame_while<W, G, F>(
    w: &mut W,
    f: &Frame,
    payload: &[(usize, usize)],
    enter: F,
) -> std::io::Result<()>
where
    W: HasSock + ?Sized,
    F: Fn() -> Option<G>,
{
    let hdr = f.encode();
    let total: usize = payload.iter().map(|p| p.1).sum();
    if total <= 4096 {
        let mut buf = Vec::with_capacity(HEADER_LEN + total);
        buf.extend_from_slice(&hdr);
        {
            let Some(_registered) = enter() else { return Err(super::device_io::deregistered()) };
            // SAFETY: each piece is valid for reads while the guard is held
            // (the caller's contract).
            unsafe { extend_raw(&mut buf, payload) };
        }
        // SAFETY: no raw pieces.
        return unsafe { send_all(w, &buf, &[]).await };
    }
    // SAFETY: the caller's contract, passed on.
    unsafe { send_all_while(w, &hdr, payload, enter).await }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::future::Future;

    /// Raw sends and receives interleave with AsyncRead/AsyncWrite on the
    /// same sockets, over TCP and unix sockets, across partial transfers.
    #[test]
    fn raw_and_async_io_interleave() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let (a, b) = tokio::join!(TcpStream::connect(l.local_addr().unwrap()), l.accept());
            let (tcp_a, tcp_b) = (a.unwrap(), b.unwrap().0);
            let (unix_a, unix_b) = UnixStream::pair().unwrap();
            check(tcp_a, tcp_b).await;
            let (ua, ub) = (unix_a.into_split(), unix_b.into_split());
            check_halves(ua, ub).await;
        });

        async fn check(mut a: TcpStream, mut b: TcpStream) {
            // Bigger than the socket buffers: both sides make progress in
            // pieces.
            let src: Vec<u8> = (0..8 << 20).map(|i| (i * 7 + i / 4096) as u8).collect();
            let mut dst = vec![0u8; src.len()];
            let pieces = [(src.as_ptr() as usize, 1000), (src.as_ptr() as usize + 1000, src.len() - 1000)];
            let (p, n) = (dst.as_mut_ptr() as usize, dst.len());
            let send = async {
                // SAFETY: `src` outlives the future and nobody writes it.
                unsafe { send_all(&mut a, b"head", &pieces).await }.unwrap();
                a.write_all(b"tail").await.unwrap();
            };
            let recv = async {
                let mut h = [0u8; 4];
                b.read_exact(&mut h).await.unwrap();
                assert_eq!(&h, b"head");
                // SAFETY: `dst` outlives the future and is not borrowed
                // until it completes.
                unsafe { recv_exact(&mut b, p, n).await }.unwrap();
                b.read_exact(&mut h).await.unwrap();
                assert_eq!(&h, b"tail");
            };
            tokio::join!(send, recv);
            assert!(dst == src);
            drop(a);
            let mut one = 0u8;
            // SAFETY: `one` is a live local.
            let e = unsafe { recv_exact(&mut b, &mut one as *mut u8 as usize, 1).await };
            assert_eq!(e.unwrap_err().kind(), io::ErrorKind::UnexpectedEof);
        }

        async fn check_halves(
            (_ra, mut wa): (unix::OwnedReadHalf, unix::OwnedWriteHalf),
            (mut rb, _wb): (unix::OwnedReadHalf, unix::OwnedWriteHalf),
        ) {
            let src = vec![5u8; 300_000];
            let mut dst = vec![0u8; src.len() + 2];
            let (p, n) = (dst.as_mut_ptr() as usize, dst.len());
            let send = async {
                // SAFETY: as above.
                unsafe { send_all(&mut wa, b"hi", &[(src.as_ptr() as usize, src.len()), (0, 0)]).await }.unwrap();
            };
            // SAFETY: as above.
            let recv = async { unsafe { recv_exact(&mut rb, p, n).await }.unwrap() };
            tokio::join!(send, recv);
            assert_eq!(&dst[..2], b"hi");
            assert!(dst[2..] == src[..]);
        }
    }

    fn lowat(s: &TcpStream) -> libc::c_int {
        let mut v: libc::c_int = -1;
        let mut l = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: SO_RCVLOWAT writes one int into a live local.
        let r = unsafe {
            libc::getsockopt(
                s.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVLOWAT,
                (&mut v as *mut libc::c_int).cast(),
                &mut l,
            )
        };
        assert_eq!(r, 0);
        v
    }

    /// A long payload arriving in many pieces wakes its tcp reader about
    /// once, not per piece (the raised low-water mark), lands whole, and
    /// leaves the mark at 1 when it is done and when it is abandoned.
    #[test]
    fn a_long_payload_wakes_its_tcp_reader_once() {
        use std::io::Write;
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let at = l.local_addr().unwrap();
            let writer = std::thread::spawn(move || std::net::TcpStream::connect(at).unwrap());
            let mut b = l.accept().await.unwrap().0;
            let mut a = writer.join().unwrap();
            a.set_nodelay(true).unwrap();
            const PIECES: usize = 32;
            const PIECE: usize = 32 << 10;
            let src: Vec<u8> = (0..PIECES * PIECE).map(|i| (i * 13 + i / 997) as u8).collect();
            let mut dst = vec![0u8; src.len()];
            let (p, n) = (dst.as_mut_ptr() as usize, dst.len());
            let send = {
                let src = src.clone();
                let mut a = a.try_clone().unwrap();
                std::thread::spawn(move || {
                    for c in src.chunks(PIECE) {
                        a.write_all(c).unwrap();
                        std::thread::sleep(std::time::Duration::from_millis(2));
                    }
                })
            };
            let mut polls = 0;
            {
                // SAFETY: `dst` outlives the future and is not borrowed
                // until it completes.
                let mut recv = std::pin::pin!(unsafe { recv_exact(&mut b, p, n) });
                std::future::poll_fn(|cx| {
                    polls += 1;
                    recv.as_mut().poll(cx)
                })
                .await
                .unwrap();
            }
            send.join().unwrap();
            assert!(dst == src);
            // Without the mark: one wake-up per piece.
            assert!(polls <= 4, "{polls} polls for {PIECES} pieces");
            assert_eq!(lowat(&b), 1);

            // Abandoned halfway (the connection is going away): the mark
            // is back at 1 all the same.
            a.write_all(&src[..PIECE]).unwrap();
            {
                // SAFETY: as above; the future is dropped before `dst` is used.
                let recv = unsafe { recv_exact(&mut b, p, n) };
                let gone = tokio::time::timeout(std::time::Duration::from_millis(50), recv).await;
                assert!(gone.is_err(), "the rest never comes");
            }
            assert_eq!(lowat(&b), 1);
        });
    }
}
