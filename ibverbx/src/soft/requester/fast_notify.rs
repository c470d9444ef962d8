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

/// How long the posting thread waits for room to finish a frame it began
/// writing before it gives the connection up.
const PARTIAL_FRAME_LIMIT: Duration = Duration::from_secs(30);

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
        let mut done = n as usize;
        // A partial write: the frame must be finished before anyone else
        // writes; wait for room (briefly: a socket drains fast). A peer
        // that stops reading for PARTIAL_FRAME_LIMIT is treated as dead,
        // as an unacknowledged request would be: the loop always ends.
        let give_up = Instant::now() + PARTIAL_FRAME_LIMIT;
        while done < buf.len() {
            if Instant::now() > give_up {
                sh.wire_busy.store(false, Ordering::Release);
                sh.fail_link(WcStatus::RetryExcErr, "the peer stopped reading in the middle of a frame");
                sh.flush();
                return true;
            }
            let mut pfd = libc::pollfd { fd, events: libc::POLLOUT, revents: 0 };
            // SAFETY: pfd is a valid pollfd array of length 1.
            unsafe { libc::poll(&mut pfd, 1, 1000) };
            // SAFETY: as for the first send, on the unsent rest of buf.
            let n = unsafe {
                libc::send(fd, buf[done..].as_ptr().cast(), buf.len() - done, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL)
            };
            if n > 0 {
                done += n as usize;
            } else if std::io::Error::last_os_error().kind() != std::io::ErrorKind::WouldBlock {
                sh.wire_busy.store(false, Ordering::Release);
                sh.fail_link(WcStatus::RetryExcErr, "write to peer failed in the middle of a frame");
                sh.flush();
                return true;
            }
        }
        sh.wire_busy.store(false, Ordering::Release);
        true
    }
}
