//! Transport settings.

use std::time::Duration;

use ibverbx::soft::SoftConfig;
use ibverbx::{LoadBalancing, ProviderKind, VirtualQpConfig};

/// Settings of an [`RdmaTransport`](crate::RdmaTransport). The environment
/// fills the defaults (`RMACOMM_PROVIDER`, `RMACOMM_TIMEOUT_SECONDS`); code
/// wins.
#[derive(Debug, Clone, PartialEq)]
pub struct TransportConfig {
    /// Provider: auto (hardware if present, else soft), verbs or soft.
    /// The default comes from `RMACOMM_PROVIDER` (unset: auto). An invalid
    /// value there cannot fail `default()`, so it makes
    /// [`RdmaTransport::new`](crate::RdmaTransport::new) fail instead while
    /// this is `Auto`: a typo never silently picks a provider.
    pub provider: ProviderKind,
    /// Device name (`mlx5_0`, `soft0`); `None` takes the first.
    pub device: Option<String>,
    /// Physical QPs per connection.
    pub qps: u32,
    /// How messages are striped over the QPs.
    pub load_balancing: LoadBalancing,
    /// Fragment size: larger writes are cut into pieces of this size.
    pub frag_size: u32,
    /// Most WRs outstanding per physical QP.
    pub max_outstanding_per_qp: u32,
    /// Completion queue depth.
    pub cq_depth: usize,
    /// Receives kept posted for notifications.
    pub recv_depth: u32,
    /// Default timeout of every call; `None` waits forever.
    pub timeout: Option<Duration>,
    /// Before a pending call sleeps, it polls for its completion for up to
    /// this long (burning the calling worker thread meanwhile): lower latency
    /// for small operations. Zero (the default) never spins.
    pub busy_poll: Duration,
    /// Soft-provider settings (link, addresses, ...) when the soft provider
    /// is used; `None` takes them from the environment (`RMACOMM_SOFT_*`).
    /// Transports with different settings use different soft contexts.
    pub soft: Option<SoftConfig>,
}

impl Default for TransportConfig {
    fn default() -> Self {
        let timeout = std::env::var("RMACOMM_TIMEOUT_SECONDS")
            .ok()
            .and_then(|v| v.parse::<f64>().ok())
            .filter(|s| *s > 0.0)
            .map(Duration::from_secs_f64);
        TransportConfig {
            provider: ProviderKind::from_env().unwrap_or_default(),
            device: None,
            qps: 1,
            load_balancing: LoadBalancing::Dqplb,
            frag_size: 1 << 20,
            max_outstanding_per_qp: 64,
            cq_depth: 8192,
            recv_depth: 512,
            timeout,
            busy_poll: Duration::ZERO,
            soft: None,
        }
    }
}

impl TransportConfig {
    /// The virtual QP settings a transport with this configuration uses
    /// (for tools that drive a raw `VirtualQp` the same way, to compare).
    pub fn virtual_qp_config(&self) -> VirtualQpConfig {
        VirtualQpConfig {
            total_qps: self.qps,
            max_msg_cnt_per_qp: self.max_outstanding_per_qp,
            max_msg_size: self.frag_size,
            load_balancing: self.load_balancing,
            max_recv_wr: self.recv_depth,
            ..VirtualQpConfig::default()
        }
    }
}
