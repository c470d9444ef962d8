//! The response reader: reads the peer's answers (ACK, NAK, RNR wait,
//! READ and atomic responses) and completes the WRs they answer.

use std::sync::Arc;
use std::time::Instant;

use tokio::io::AsyncReadExt;

use super::execute::write_u64;
use super::inflight::Expect;
use super::{Reader, Shared};
use crate::qp_attr::QpState;
use crate::soft::raw_io::recv_exact;
use crate::soft::wire::{Frame, Syndrome, HEADER_LEN};
use crate::wc::WcStatus;
use crate::AccessFlags;

/// Reads responses, completes the WRs they answer.
pub(super) async fn read_responses(sh: Arc<Shared>, mut r: Reader, rnr_retry: u8) {
    let max_msg = sh.qp.ctx.config.max_msg_size;
    loop {
        let mut hdr = [0u8; HEADER_LEN];
        if let Err(e) = r.read_exact(&mut hdr).await {
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
                    let p = match s.ptr(sh.qp.pd, AccessFlags::LOCAL_WRITE) {
                        Ok(p) => p as usize,
                        Err(st) => return sh.fail_link(st, "read destination became invalid"),
                    };
                    // SAFETY: p..p+len is a live, checked local registration.
                    if let Err(e) = unsafe { recv_exact(&mut *r, p, s.len as usize).await } {
                        return sh.fail_link(WcStatus::RetryExcErr, &format!("read response: {e}"));
                    }
                }
                WcStatus::Success
            }
            (Frame::AtomicResp { orig, .. }, Expect::Atomic) => {
                match segs.first().map(|s| s.ptr(sh.qp.pd, AccessFlags::LOCAL_WRITE)) {
                    Some(Ok(p)) => {
                        write_u64(p as usize, orig);
                        WcStatus::Success
                    }
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
        if status != WcStatus::Success {
            sh.qp.set_error(&format!("peer answered {status}"));
        }
        let mut q = sh.lock();
        if let Some(f) = q.inflight.iter_mut().find(|x| x.awaiting.is_some_and(|a| a.0 == psn)) {
            f.status = Some(status);
            f.awaiting = None;
        }
        sh.emit(&mut q);
        drop(q);
        sh.progress.notify_waiters();
        if status != WcStatus::Success {
            sh.lock().broken.get_or_insert(status);
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
