//! The posting thread's handle on the requester ([`FastNotify`]): small
//! requests written on the connection by the posting thread itself.

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::inflight::{Expect, Inflight};
use super::{with_psn, Shared};
use crate::soft::raw_io::extend_raw;
use crate::soft::wire::{Frame, HEADER_LEN};
use crate::wc::{WcOpcode, WcStatus};

/// Requests sent by the posting thread itself on an idle QP (same host:
/// WRITE_WITH_IMM notifies after a direct copy, doorbell records; TCP:
/// small WRITEs; both: small SENDs): one thread hand-off less per message.
/// The progress engine still reads the acknowledgement.
pub(crate) struct FastNotify {
    pub(super) sh: Arc<Shared>,
    pub(super) fd: OwnedFd,
}

impl std::fmt::Debug for FastNotify {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FastNotify").field("fd", &self.fd).finish()
    }
}

/// What a fast notify should report when its ACK comes back.
pub(crate) struct FastWr<'a> {
    pub(crate) wr_id: u64,
    pub(crate) opcode: WcOpcode,
    pub(crate) signaled: bool,
    pub(crate) byte_len: u32,
    /// A `Notify` or a `Send` frame (its PSN is filled in here).
    pub(crate) frame: Frame,
    /// SEND payload pieces (at most 4 KiB in all).
    pub(crate) payload: &'a [(usize, usize)],
}

impl FastNotify {
    /// Sends the frame if the connection is free and the socket takes it at
    /// once; returns false (nothing sent, nothing queued) otherwise. The
    /// caller holds the QP's only outstanding-WR slot.
    pub(crate) fn try_send(&self, wr: FastWr<'_>) -> bool {
        let sh = &self.sh;
        if sh.wire_busy.compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed).is_err() {
            return false;
        }
        if sh.lock().broken.is_some() {
            sh.wire_busy.store(false, Ordering::Release);
            return false;
        }
        let psn = sh.next_psn.load(Ordering::Relaxed);
        let frame = with_psn(wr.frame, psn);
        let mut buf = Vec::with_capacity(HEADER_LEN + frame.payload_len());
        buf.extend_from_slice(&frame.encode());
        // SAFETY: each piece is a checked live local region, read before
        // this call returns.
        unsafe { extend_raw(&mut buf, wr.payload) };
        // Queued before the bytes leave, so that the ACK finds it.
        sh.lock().inflight.push_back(Inflight {
            awaiting: Some((psn, Expect::Ack)),
            touches_memory: !matches!(frame, Frame::Notify { .. }),
            ..Inflight::new(wr.wr_id, wr.opcode, wr.signaled, wr.byte_len)
        });
        let fd = self.fd.as_raw_fd();
        // SAFETY: fd is our own descriptor of the connected socket; buf is
        // a live buffer of buf.len() bytes.
        let n = unsafe { libc::send(fd, buf.as_ptr().cast(), buf.len(), libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) };
        if n <= 0 {
            // Nothing left: undo, and let the engine send it.
            sh.lock().inflight.pop_back();
            sh.wire_busy.store(false, Ordering::Release);
            return false;
        }
        sh.next_psn.store((psn + 1) & 0x00ff_ffff, Ordering::Relaxed);
        sh.qp.ctx.poster_frames.fetch_add(1, Ordering::Relaxed);
        // A partial write: the frame must be finished before anyone else
        // writes; wait for room (briefly: a socket drains fast). A peer
        // that stops reading for the configured limit is treated as dead,
        // as an unacknowledged request would be: the loop always ends.
        if let Err(why) = finish_frame(fd, &buf, n as usize, sh.qp.ctx.config.partial_frame_limit) {
            sh.wire_busy.store(false, Ordering::Release);
            sh.fail_link(WcStatus::RetryExcErr, why);
            sh.flush();
            return true;
        }
        sh.wire_busy.store(false, Ordering::Release);
        true
    }
}

/// Writes the rest of a frame (`buf[done..]`) on the non-blocking socket
/// `fd`, waiting for room, for at most `limit`. Errors say why the
/// connection must be given up: the peer stopped reading for `limit` in
/// the middle of the frame, or the socket failed.
fn finish_frame(fd: libc::c_int, buf: &[u8], mut done: usize, limit: Duration) -> Result<(), &'static str> {
    let give_up = Instant::now() + limit;
    while done < buf.len() {
        let left = give_up.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err("the peer stopped reading in the middle of a frame");
        }
        let mut pfd = libc::pollfd { fd, events: libc::POLLOUT, revents: 0 };
        let slice_ms = left.as_millis().clamp(1, 1000) as libc::c_int;
        // SAFETY: pfd is a valid pollfd array of length 1.
        unsafe { libc::poll(&mut pfd, 1, slice_ms) };
        // SAFETY: fd is the caller's descriptor of a connected socket; the
        // pointer and length describe the unsent rest of the live buf.
        let n = unsafe {
            libc::send(fd, buf[done..].as_ptr().cast(), buf.len() - done, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL)
        };
        if n > 0 {
            done += n as usize;
        } else if n < 0 && std::io::Error::last_os_error().kind() != std::io::ErrorKind::WouldBlock {
            return Err("write to peer failed in the middle of a frame");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::io::Read;
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixStream;
    use std::time::{Duration, Instant};

    use super::finish_frame;

    /// A connected pair whose writing end is non-blocking with a full send
    /// buffer; returns (writer, reader, a frame, how much of it was sent).
    fn stalled_pair() -> (UnixStream, UnixStream, Vec<u8>, usize) {
        let (w, r) = UnixStream::pair().unwrap();
        w.set_nonblocking(true).unwrap();
        let frame = vec![0x5a; 1 << 20];
        // SAFETY: w is a live socket; frame is a live buffer of its length.
        let n = unsafe {
            libc::send(w.as_raw_fd(), frame.as_ptr().cast(), frame.len(), libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL)
        };
        assert!(n > 0 && (n as usize) < frame.len(), "the socket took {n} of {} bytes at once", frame.len());
        (w, r, frame, n as usize)
    }

    #[test]
    fn a_peer_that_stops_reading_mid_frame_is_given_up_within_the_limit() {
        let (w, _r, frame, sent) = stalled_pair();
        let t = Instant::now();
        let got = finish_frame(w.as_raw_fd(), &frame, sent, Duration::from_millis(300));
        let took = t.elapsed();
        assert_eq!(got, Err("the peer stopped reading in the middle of a frame"));
        assert!(took >= Duration::from_millis(300), "gave up after {took:?}, before the limit");
        assert!(took < Duration::from_secs(5), "gave up only after {took:?}");
    }

    #[test]
    fn a_slow_reader_gets_the_whole_frame() {
        let (w, mut r, frame, sent) = stalled_pair();
        let reader = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            let mut got = Vec::new();
            let mut chunk = vec![0u8; 4096];
            while got.len() < frame.len() {
                let n = r.read(&mut chunk).unwrap();
                assert!(n > 0);
                got.extend_from_slice(&chunk[..n]);
                std::thread::sleep(Duration::from_micros(50));
            }
            got
        });
        let frame2 = vec![0x5a; 1 << 20];
        assert_eq!(finish_frame(w.as_raw_fd(), &frame2, sent, Duration::from_secs(30)), Ok(()));
        assert_eq!(reader.join().unwrap(), frame2);
    }

    #[test]
    fn a_closed_peer_fails_the_frame_at_once() {
        let (w, r, frame, sent) = stalled_pair();
        drop(r);
        let t = Instant::now();
        assert_eq!(
            finish_frame(w.as_raw_fd(), &frame, sent, Duration::from_secs(30)),
            Err("write to peer failed in the middle of a frame")
        );
        assert!(t.elapsed() < Duration::from_secs(2));
    }
}
