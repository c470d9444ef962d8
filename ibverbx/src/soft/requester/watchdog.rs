//! The requester's watchdog: fails the oldest awaited request when the
//! peer stays silent for the ACK timeout.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use super::Shared;
use crate::qp_attr::QpState;
use crate::wc::WcStatus;

/// Fails the oldest awaited request when the peer stays silent for the ACK
/// timeout (a stopped or unreachable peer).
///
/// It holds the link (its socket) while it runs, so it ends as soon as the
/// QP is reset, in error or destroyed — woken by the state change, not at
/// its next look (with a long ACK timeout that look came seconds later, and
/// churned QPs' sockets piled up meanwhile).
pub(super) async fn watchdog(sh: Arc<Shared>, timeout: Duration, reader: tokio::task::JoinHandle<()>) {
    let tick = (timeout / 4).clamp(Duration::from_millis(5), Duration::from_secs(1));
    let mut state = sh.qp.state_tx.subscribe();
    loop {
        tokio::select! {
            _ = tokio::time::sleep(tick) => {}
            changed = state.changed() => {
                if changed.is_err() {
                    // The QP is gone.
                    reader.abort();
                    return;
                }
            }
        }
        if sh.stale() || reader.is_finished() || matches!(*sh.qp.state_tx.borrow(), QpState::Reset | QpState::Err) {
            reader.abort();
            return;
        }
        let last_rx = Duration::from_millis(sh.last_rx_ms.load(Ordering::Relaxed));
        let silent = sh.epoch.elapsed().saturating_sub(last_rx);
        let oldest = sh.lock().inflight.iter().filter(|f| f.awaiting.is_some()).map(|f| f.sent_at.elapsed()).max();
        if let Some(age) = oldest {
            if age >= timeout && silent >= timeout {
                reader.abort();
                sh.fail_link(
                    WcStatus::RetryExcErr,
                    &format!("no response from the peer for {} ms", timeout.as_millis()),
                );
                sh.flush();
                return;
            }
        }
    }
}
