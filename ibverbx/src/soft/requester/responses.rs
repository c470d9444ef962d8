//! The response reader: reads the peer's answers (ACK, NAK, RNR wait,
//! READ and atomic responses) and completes the WRs they answer.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Instant;

use tokio::io::AsyncReadExt;

use super::execute::write_u64;
use super::inflight::Expect;
use super::{Reader, Shared};
use crate::qp_attr::QpState;
use crate::soft::device_io::{recv_to, write_device, Failed};
use crate::soft::mr::Target;
use crate::soft::polled_rx::{PolledRx, RxFd};
use crate::soft::raw_io::HasSock;
use crate::soft::wire::{Frame, Syndrome, HEADER_LEN};
use crate::wc::WcStatus;
use crate::AccessFlags;

/// The response connection's gate (see `polled_rx.rs`): held by whoever
/// reads it, for a whole frame.
struct Gate {
    lock: tokio::sync::Mutex<()>,
    /// The reader is gone: a busy-poller leaves the connection alone.
    closed: AtomicBool,
    /// Busy-pollers' descriptor of the socket (tcp only, when enabled).
    fd: Option<RxFd>,
    sh: Weak<Shared>,
}

/// Marks the gate closed however the reader ends (aborted by the watchdog
/// too).
struct Closing(Arc<Gate>);

impl Drop for Closing {
    fn drop(&mut self) {
        self.0.closed.store(true, Ordering::Release);
    }
}

impl PolledRx for Gate {
    /// Takes the ACKs already waiting in the socket that answer what is
    /// outstanding; anything else is left to the reader (which fails the
    /// link on what does not match).
    fn drive(&self) -> bool {
        let Some(fd) = &self.fd else { return false };
        let Ok(_g) = self.lock.try_lock() else { return false };
        if self.closed.load(Ordering::Acquire) {
            return false;
        }
        let Some(sh) = self.sh.upgrade() else { return false };
        fd.begin();
        // Nothing is answered when nothing was asked (a lock is cheaper
        // than the look into the socket).
        if !sh.lock().inflight.iter().any(|x| x.awaiting.is_some()) {
            return false;
        }
        let max_msg = sh.qp.ctx.config.max_msg_size;
        let mut n = 0;
        // Whether it stopped at a frame it leaves to the reader.
        let declined = loop {
            if n == 16 {
                break false;
            }
            // One ACK, and whether anything follows it.
            let mut look = [0u8; HEADER_LEN + 1];
            let there = fd.peek(&mut look);
            if there < HEADER_LEN {
                break false;
            }
            let mut hdr = [0u8; HEADER_LEN];
            hdr.copy_from_slice(&look[..HEADER_LEN]);
            let Ok(Frame::Ack { psn }) = Frame::decode(&hdr, max_msg) else { break true };
            if !complete_ack(&sh, psn) {
                break true;
            }
            // SAFETY: hdr is a live local; its bytes were peeked.
            if let Err(e) = unsafe { fd.take(&[(hdr.as_mut_ptr() as usize, HEADER_LEN)]) } {
                // Not reached: end the connection, as a read error would.
                tracing::debug!("soft QP {:#x}: polled ACK read failed: {e}", sh.qp.qpn);
                fd.shut();
                break true;
            }
            sh.touch();
            sh.qp.ctx.touch();
            n += 1;
            // Nothing followed it: the next pass looks again.
            if there == HEADER_LEN {
                break false;
            }
        };
        if declined {
            fd.lower();
        }
        n > 0
    }

    fn release(&self) {
        if let (Some(fd), Ok(_g)) = (&self.fd, self.lock.try_lock()) {
            fd.lower();
        }
    }
}

/// An ACK of `psn`: completes the oldest outstanding request when it is
/// that one and awaits an ACK, or every request it covers cumulatively;
/// false (nothing done) when it answers nothing outstanding.
fn complete_ack(sh: &Shared, psn: u32) -> bool {
    let mut q = sh.lock();
    let Some(x) = q.inflight.iter_mut().find(|x| x.awaiting.is_some() && x.status.is_none()) else {
        return false;
    };
    match x.awaiting {
        Some((p, Expect::Ack)) if p == psn => {
            x.status = Some(WcStatus::Success);
            x.awaiting = None;
            sh.emit(&mut q);
            drop(q);
            sh.progress.notify_waiters();
            true
        }
        Some((p, _)) if p != psn => {
            drop(q);
            ack_covers(sh, psn)
        }
        _ => false,
    }
}

/// Reads responses, completes the WRs they answer.
pub(super) async fn read_responses(sh: Arc<Shared>, mut r: Reader, rnr_retry: u8) {
    let max_msg = sh.qp.ctx.config.max_msg_size;
    let polled = sh.qp.ctx.config.polled_rx && r.sock().is_tcp();
    let gate = Arc::new(Gate {
        lock: Default::default(),
        closed: AtomicBool::new(false),
        fd: if polled { RxFd::dup(r.sock().fd()).ok() } else { None },
        sh: Arc::downgrade(&sh),
    });
    if gate.fd.is_some() {
        let weak: Weak<Gate> = Arc::downgrade(&gate);
        sh.qp.rx_register(true, weak);
    }
    let _closing = Closing(gate.clone());
    loop {
        let mut hdr = [0u8; HEADER_LEN];
        let sock = r.sock();
        let watch = async {
            match &gate.fd {
                Some(fd) => fd.watch().await,
                None => std::future::pending().await,
            }
        };
        let ready = tokio::select! {
            r = sock.readable() => r,
            _ = watch => {
                // Pollers went on to other work: take the connection back.
                if let Some(fd) = gate.fd.as_ref().filter(|fd| fd.stale()) {
                    let _g = gate.lock.lock().await;
                    fd.lower();
                }
                continue;
            }
        };
        // Whoever holds the gate reads whole frames: a busy-poller may have
        // taken what made the socket readable. This thread reads at the
        // normal mark.
        let _g = gate.lock.lock().await;
        if let Some(fd) = &gate.fd {
            fd.lower();
        }
        let got = ready.and_then(|()| match r.sock().try_recv(&mut hdr) {
            Ok(0) => Err(std::io::ErrorKind::UnexpectedEof.into()),
            r => r,
        });
        let got = match got {
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted) => continue,
            Ok(n) if n < HEADER_LEN => r.read_exact(&mut hdr[n..]).await.map(|_| ()),
            r => r.map(|_| ()),
        };
        if let Err(e) = got {
            let awaiting = sh.lock().inflight.iter().any(|f| f.awaiting.is_some());
            let why = if e.kind() == std::io::ErrorKind::UnexpectedEof {
                "the peer closed the connection".to_string()
            } else {
                format!("read from peer: {e}")
            };
            if awaiting || !matches!(*sh.qp.state_tx.borrow(), QpState::Err | QpState::Reset) {
                sh.fail_link(WcStatus::RetryExcErr, &why);
            }
            return;
        }
        sh.touch();
        sh.qp.ctx.touch();
        let f = match Frame::decode(&hdr, max_msg) {
            Ok(f) if !f.is_request() => f,
            Ok(f) => {
                return sh.fail_link(WcStatus::BadRespErr, &format!("peer sent a request frame {f:?} as a response"))
            }
            Err(e) => return sh.fail_link(WcStatus::BadRespErr, &format!("malformed response: {e}")),
        };
        // Decide under the lock; read payloads without it.
        let (psn, expect, segs) = {
            let q = sh.lock();
            let Some(x) = q.inflight.iter().find(|x| x.awaiting.is_some() && x.status.is_none()) else {
                drop(q);
                return sh.fail_link(WcStatus::BadRespErr, &format!("unsolicited response {f:?}"));
            };
            let (psn, expect) = x.awaiting.expect("checked");
            let segs = if matches!(f, Frame::ReadResp { .. } | Frame::AtomicResp { .. }) {
                x.segs.clone()
            } else {
                Vec::new()
            };
            (psn, expect, segs)
        };
        if f.psn() != psn {
            // A cumulative ACK (the responder batches them) also answers
            // every request ahead of its PSN, all of which must be ones an
            // ACK answers.
            if matches!(f, Frame::Ack { .. }) && ack_covers(&sh, f.psn()) {
                continue;
            }
            return sh
                .fail_link(WcStatus::BadRespErr, &format!("response for PSN {} while {psn} is outstanding", f.psn()));
        }
        let status = match (f, expect) {
            (Frame::Ack { .. }, Expect::Ack) => WcStatus::Success,
            (Frame::ReadResp { len, .. }, Expect::Read(want)) if len == want => {
                // The segments were checked at post (LOCAL_WRITE) and are
                // kept alive by `segs`.
                for s in &segs {
                    if s.len == 0 {
                        continue;
                    }
                    let t = match s.target(sh.qp.pd, AccessFlags::LOCAL_WRITE) {
                        Ok(t) => t,
                        Err(st) => return sh.fail_link(st, "read destination became invalid"),
                    };
                    // SAFETY: the target is a live, checked local registration.
                    match unsafe { recv_to(&mut *r, &t, s.len as usize).await } {
                        Ok(()) => {}
                        Err(Failed::Io(e)) => {
                            return sh.fail_link(WcStatus::RetryExcErr, &format!("read response: {e}"));
                        }
                        Err(Failed::Copy(e)) => {
                            return sh
                                .fail_link(WcStatus::LocProtErr, &format!("read response into device memory: {e}"));
                        }
                    }
                }
                WcStatus::Success
            }
            (Frame::AtomicResp { orig, .. }, Expect::Atomic) => {
                match segs.first().map(|s| s.target(sh.qp.pd, AccessFlags::LOCAL_WRITE)) {
                    Some(Ok(Target::Host(p))) => {
                        write_u64(p, orig);
                        WcStatus::Success
                    }
                    // SAFETY: the WR's checked 8-byte local segment, held
                    // by `segs`.
                    Some(Ok(Target::Device(dev, a))) => match unsafe { write_device(&*dev, a, &orig.to_ne_bytes()) } {
                        Ok(()) => WcStatus::Success,
                        Err(_) => WcStatus::LocProtErr,
                    },
                    _ => WcStatus::LocProtErr,
                }
            }
            (Frame::Nak { syndrome, .. }, _) => match syndrome {
                Syndrome::RemoteAccess => WcStatus::RemAccessErr,
                Syndrome::InvalidRequest => WcStatus::RemInvReqErr,
                Syndrome::RemoteOp => WcStatus::RemOpErr,
            },
            (Frame::RnrWait { .. }, _) => {
                let mut q = sh.lock();
                let Some(f) = q.inflight.iter_mut().find(|x| x.awaiting.is_some_and(|a| a.0 == psn)) else {
                    continue;
                };
                f.rnr_waits += 1;
                f.sent_at = Instant::now();
                if rnr_retry == 7 || f.rnr_waits <= rnr_retry as u32 {
                    continue;
                }
                WcStatus::RnrRetryExcErr
            }
            (other, _) => {
                return sh.fail_link(WcStatus::BadRespErr, &format!("response {other:?} does not match the request"));
            }
        };
        let mut q = sh.lock();
        if let Some(f) = q.inflight.iter_mut().find(|x| x.awaiting.is_some_and(|a| a.0 == psn)) {
            f.status = Some(status);
            f.awaiting = None;
        }
        if status != WcStatus::Success {
            // The WR has its status before the QP goes to ERR: the state
            // change wakes the requester task, which flushes whatever has
            // none yet (on another thread of the engine, or a poster's,
            // at once). The error completion is seen only after ERR.
            q.broken.get_or_insert(status);
            drop(q);
            sh.qp.set_error_in(sh.life, &format!("peer answered {status}"));
            q = sh.lock();
        }
        sh.emit(&mut q);
        drop(q);
        sh.progress.notify_waiters();
        if status != WcStatus::Success {
            sh.flush();
            return;
        }
    }
}

/// Whether `psn` lies ahead of the oldest outstanding request within
/// half the 24-bit PSN space.
fn psn_ahead(oldest: u32, psn: u32) -> bool {
    let d = psn.wrapping_sub(oldest) & 0x00ff_ffff;
    d != 0 && d < 0x0080_0000
}

/// Completes, as a cumulative ACK of `psn` does, every outstanding request
/// from the oldest up to `psn`, when they all await an ACK and `psn` is
/// one of them; false (nothing completed) otherwise.
fn ack_covers(sh: &Shared, psn: u32) -> bool {
    let mut q = sh.lock();
    let mut oldest = None;
    let mut found = false;
    for x in q.inflight.iter().filter(|x| x.awaiting.is_some() && x.status.is_none()) {
        let (p, expect) = x.awaiting.expect("filtered");
        let first = *oldest.get_or_insert(p);
        if !matches!(expect, Expect::Ack) || (p != psn && !psn_ahead(p, psn)) || (p != first && !psn_ahead(first, p)) {
            return false;
        }
        if p == psn {
            found = true;
            break;
        }
    }
    if !found {
        return false;
    }
    for x in q.inflight.iter_mut().filter(|x| x.awaiting.is_some() && x.status.is_none()) {
        let (p, _) = x.awaiting.expect("filtered");
        x.status = Some(WcStatus::Success);
        x.awaiting = None;
        if p == psn {
            break;
        }
    }
    sh.emit(&mut q);
    drop(q);
    sh.progress.notify_waiters();
    true
}

#[cfg(test)]
mod tests {
    use super::psn_ahead;

    #[test]
    fn psns_ahead_wrap_around_the_24_bit_space() {
        assert!(psn_ahead(5, 6));
        assert!(psn_ahead(5, 5 + 0x7f_ffff));
        assert!(!psn_ahead(5, 5));
        assert!(!psn_ahead(6, 5));
        assert!(psn_ahead(0xff_fffe, 1));
        assert!(!psn_ahead(1, 0xff_fffe));
    }
}
