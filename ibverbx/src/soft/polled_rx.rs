//! Receiving on the polling thread (tcp).
//!
//! Over tcp, what a waiter wants (a peer's notification, the ACK of its own
//! write) arrives on a socket that the soft provider's threads read: each
//! message costs one of them a wake-up, which on these machines costs as
//! much as the rest of the round trip (a blocking tcp ping-pong's half
//! round trip is about 27 µs here, a polling one 4 µs). A busy-poller of a
//! CQ ([`CompletionQueue::drive`](crate::CompletionQueue::drive)) therefore
//! receives itself what is already waiting on its QPs' connections, the
//! common small requests (WRITE of at most [`POLLED_MAX`] bytes, with or
//! without immediate; zero-byte notifies) and ACKs, and leaves everything
//! else (NAKs to send, RNR waits, READs, atomics, payloads still on their
//! way, anything malformed) to the connection's thread, which handles it as
//! always.
//!
//! Each connection has one gate, a lock that whoever reads the connection
//! holds for a whole frame: the thread takes it after the socket became
//! readable and reads without blocking; the poller only tries it. Frames are
//! therefore read whole and in order by one side at a time, and the
//! responder's pending ACKs live under the gate too (the receive
//! completions they cover are held by the QP, taken and released in that
//! order), so their order is the wire's whichever side read. The poller
//! looks at a frame and what follows it (one `MSG_PEEK`), checks it and
//! that all of it is there before it consumes anything: what it declines stays
//! in the socket for the thread.
//!
//! Receiving first is not enough: the kernel wakes the connection's thread
//! as data arrives, whoever reads it, and that wake-up (on a core the
//! poller occupies) is the cost. So while a poller drives a connection its
//! socket's `SO_RCVLOWAT` is raised ([`LOWAT`]): tcp then signals no
//! readiness for small arrivals (FIN, errors and larger backlogs still
//! wake), and the thread sleeps through them. It is lowered again, which
//! signals what is already there (`tcp_set_rcvlowat` calls
//! `tcp_data_ready`), whenever the thread should take over:
//! - the poller saw something it leaves to the thread (bytes still waiting
//!   after its pass);
//! - the thread itself takes the gate (it reads only at the normal mark);
//! - a poller stops spinning to sleep
//!   ([`CompletionQueue::drive_stop`](crate::CompletionQueue::drive_stop));
//! - no poller drove the connection for [`STALE`] (it went on to other work
//!   without sleeping): the thread, woken when the mark was raised, checks
//!   on a timer while it is raised.
//!
//! So nothing waits longer than [`STALE`] for the thread once pollers are
//! gone, and not at all while one spins.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};

/// The largest WRITE payload a poller receives itself.
pub(crate) const POLLED_MAX: u32 = 4096;

/// The receive low-water mark while a poller drives a connection: above
/// any frame it receives itself, small enough that a backlog of larger
/// ones still wakes the thread at once.
pub(crate) const LOWAT: i32 = 256 << 10;

/// How long a raised mark outlives the last poll.
pub(crate) const STALE: Duration = Duration::from_millis(1);

/// A connection a busy-poller may receive on.
pub(crate) trait PolledRx: Send + Sync {
    /// Receives what the poller may; true when it did something.
    fn drive(&self) -> bool;
    /// The poller stops: the connection's thread takes over (unless it or
    /// another poller holds the gate, which then does).
    fn release(&self);
}

/// The poller's own descriptor of a connection's socket (a duplicate: the
/// number stays valid whatever the connection's thread does with its own),
/// and the state of its low-water mark.
#[derive(Debug)]
pub(crate) struct RxFd {
    fd: OwnedFd,
    /// `SO_RCVLOWAT` is [`LOWAT`] (changed under the gate only).
    raised: AtomicBool,
    /// When a poller last drove the connection (µs, [`now_us`]; read
    /// from the clock every 32nd pass).
    last: AtomicU64,
    passes: std::sync::atomic::AtomicU32,
    /// Wakes the connection's thread when the mark is raised, so that it
    /// watches for pollers that are gone.
    pub(crate) kick: tokio::sync::Notify,
}

/// Microseconds since the first call in this process (a cheap clock for
/// [`STALE`]).
fn now_us() -> u64 {
    static T0: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    T0.get_or_init(std::time::Instant::now).elapsed().as_micros() as u64
}

impl RxFd {
    pub(crate) fn dup(fd: std::os::fd::BorrowedFd<'_>) -> io::Result<RxFd> {
        Ok(RxFd {
            fd: fd.try_clone_to_owned()?,
            raised: AtomicBool::new(false),
            last: AtomicU64::new(0),
            passes: Default::default(),
            kick: tokio::sync::Notify::new(),
        })
    }

    fn set_lowat(&self, v: libc::c_int) -> bool {
        // SAFETY: SO_RCVLOWAT reads one int from a live local.
        let r = unsafe {
            libc::setsockopt(
                self.fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVLOWAT,
                (&v as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        r == 0
    }

    /// A poller begins a pass (under the gate): raises the mark if it is
    /// not raised yet, and wakes the thread to watch it.
    pub(crate) fn begin(&self) {
        if self.passes.fetch_add(1, Ordering::Relaxed).is_multiple_of(32) || !self.raised() {
            self.last.store(now_us(), Ordering::Relaxed);
        }
        if !self.raised.load(Ordering::Relaxed) && self.set_lowat(LOWAT) {
            self.raised.store(true, Ordering::Release);
            self.kick.notify_one();
        }
    }

    /// Lowers the mark (under the gate), which signals what is waiting.
    pub(crate) fn lower(&self) {
        if self.raised.load(Ordering::Acquire) {
            self.raised.store(false, Ordering::Release);
            if !self.set_lowat(1) {
                // Not reached (a valid socket): keep it in the pollers'
                // hands rather than guess.
                self.raised.store(true, Ordering::Release);
            }
        }
    }

    pub(crate) fn raised(&self) -> bool {
        self.raised.load(Ordering::Acquire)
    }

    /// Raised, and no poller drove the connection for [`STALE`].
    pub(crate) fn stale(&self) -> bool {
        self.raised() && now_us().saturating_sub(self.last.load(Ordering::Relaxed)) >= STALE.as_micros() as u64
    }

    /// Resolves when the connection's thread should look at the mark:
    /// every [`STALE`] while it is raised, after the next raise otherwise.
    pub(crate) async fn watch(&self) {
        if self.raised() {
            tokio::time::sleep(STALE).await;
        } else {
            self.kick.notified().await;
        }
    }

    /// Copies the next bytes into `buf` without consuming them; how many
    /// there were (at most `buf.len()`).
    pub(crate) fn peek(&self, buf: &mut [u8]) -> usize {
        // SAFETY: buf is a live, exclusive slice of buf.len() bytes.
        let n = unsafe {
            libc::recv(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), libc::MSG_PEEK | libc::MSG_DONTWAIT)
        };
        n.max(0) as usize
    }

    /// Consumes the pieces `(addr, len)` in order, in one call when it can;
    /// their bytes must be waiting (peeked).
    ///
    /// # Safety
    /// Every piece must be valid for writes, and not borrowed.
    pub(crate) unsafe fn take(&self, pieces: &[(usize, usize)]) -> io::Result<()> {
        let len: usize = pieces.iter().map(|p| p.1).sum();
        let mut done = 0;
        while done < len {
            let mut iov = [libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 }; 2];
            let k = super::raw_io::fill_iov(pieces.iter().copied(), done, &mut iov);
            // SAFETY: all-zero is a valid msghdr (no name, no control).
            let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
            msg.msg_iov = iov.as_mut_ptr();
            msg.msg_iovlen = k as _;
            // SAFETY: the iovecs cover the rest of the pieces, valid for
            // writes (the caller's contract).
            let n = unsafe { libc::recvmsg(self.fd.as_raw_fd(), &mut msg, libc::MSG_DONTWAIT) };
            match n {
                0 => return Err(io::ErrorKind::UnexpectedEof.into()),
                n if n < 0 => {
                    let e = io::Error::last_os_error();
                    if e.kind() != io::ErrorKind::Interrupted {
                        return Err(e);
                    }
                }
                n => done += n as usize,
            }
        }
        Ok(())
    }

    /// Writes all of `buf`, waiting (at most a second in all) while the
    /// socket is full.
    pub(crate) fn send_all(&self, buf: &[u8]) -> io::Result<()> {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(1);
        let mut done = 0;
        while done < buf.len() {
            // SAFETY: buf[done..] is a live slice; MSG_NOSIGNAL: a closed
            // peer is an error, not SIGPIPE.
            let n = unsafe {
                libc::send(
                    self.fd.as_raw_fd(),
                    buf[done..].as_ptr().cast(),
                    buf.len() - done,
                    libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
                )
            };
            if n >= 0 {
                done += n as usize;
                continue;
            }
            let e = io::Error::last_os_error();
            match e.kind() {
                io::ErrorKind::Interrupted => {}
                io::ErrorKind::WouldBlock if std::time::Instant::now() < deadline => {
                    let mut pfd = libc::pollfd { fd: self.fd.as_raw_fd(), events: libc::POLLOUT, revents: 0 };
                    // SAFETY: one valid pollfd.
                    unsafe { libc::poll(&mut pfd, 1, 10) };
                }
                _ => return Err(e),
            }
        }
        Ok(())
    }

    /// Ends the connection both ways (its thread then sees it closed).
    pub(crate) fn shut(&self) {
        // SAFETY: shutdown on our own descriptor.
        unsafe { libc::shutdown(self.fd.as_raw_fd(), libc::SHUT_RDWR) };
    }
}
