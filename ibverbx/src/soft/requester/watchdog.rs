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
pub(super) async fn watchdog(sh: Arc<Shared>, timeout: Duration, reader: tokio::task::JoinHandle<()>) {
    let tick = (timeout / 4).max(Duration::from_millis(5));
    loop {
        tokio::time::sleep(tick).await;
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
