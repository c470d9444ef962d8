//! Transport settings.

use std::time::Duration;

use crate::TransportError;
use ibverbx::soft::SoftConfig;
use ibverbx::{LoadBalancing, ProviderKind, VirtualQpConfig};

/// Settings of an [`RdmaTransport`](crate::RdmaTransport). The environment
/// fills the defaults (`RMACOMM_PROVIDER`, `RMACOMM_TIMEOUT_SECONDS`); code
/// wins.
///
/// Start from [`TransportConfig::default()`] and change what you need, with
/// the `with_*` setters or by assigning the public fields:
///
/// ```
/// use std::time::Duration;
/// use rmacomm_transport::TransportConfig;
///
/// let config = TransportConfig::default().with_qps(4).with_timeout(Some(Duration::from_secs(60)));
/// let mut same = TransportConfig::default();
/// same.qps = 4;
/// same.timeout = Some(Duration::from_secs(60));
/// assert_eq!(config, same);
/// ```
///
/// The struct is `#[non_exhaustive]`, so that settings can be added without
/// breaking callers; a struct literal outside this crate is therefore
/// rejected, even with `..Default::default()`:
///
/// ```compile_fail,E0639
/// use rmacomm_transport::TransportConfig;
///
/// let config = TransportConfig { qps: 4, ..TransportConfig::default() };
/// ```
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
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
    /// Most writes and reads in flight on one transport (posted, or
    /// abandoned by their callers and not yet completed). A call made while
    /// all are taken waits for one to free (backpressure) instead of
    /// queueing without bound. At least 1.
    pub max_in_flight: usize,
    /// Same-host peers (soft provider, shared segments): a `write` or a
    /// `read` of at most this many bytes, made while nothing
    /// else is in flight on the transport, is copied by the calling thread
    /// through a mapping of the peer's region (checked against the peer's
    /// live key, like [`MappedBuffer`](crate::MappedBuffer)) and its future
    /// is ready at once: no work request, completion or wake-up. A `write`
    /// with `notify` is copied the same way and counted into a page of the
    /// peer's that its `wait_for_write` polls (no work request either; a
    /// peer whose wait sleeps rather than spins is woken by a zero-byte
    /// work request). Zero turns this off. Default 1 MiB (the soft
    /// provider's inline-copy budget), or `RMACOMM_DIRECT_COPY_MAX` (bytes).
    pub direct_copy_max: usize,
    /// Soft-provider settings (link, addresses, ...) when the soft provider
    /// is used; `None` takes them from the environment (`RMACOMM_SOFT_*`).
    /// Transports with different settings use different soft contexts.
    pub soft: Option<SoftConfig>,
    /// The connection's local ACK timeout exponent (1..=31, as
    /// `NCCL_IB_TIMEOUT`): a peer that answers nothing for 4.096 µs ×
    /// 2^`ack_timeout` × 8 tries breaks the connection
    /// ([`PeerClosed`](crate::TransportError::PeerClosed)); a call's own
    /// `timeout` ends only that call. Default 20 (about 4.3 s a try, 34 s
    /// in all: NCCL's), or `RMACOMM_IB_TIMEOUT`. With the soft provider the
    /// peer's *process* answers (there is no NIC to answer for it), so a
    /// stopped or starved peer process counts as silent: verbs' usual 16
    /// (2.1 s) broke connections to a peer paused for a moment.
    pub ack_timeout: u8,
}

/// NCCL's default local ACK timeout exponent (`NCCL_IB_TIMEOUT`).
pub const DEFAULT_ACK_TIMEOUT: u8 = 20;

/// `RMACOMM_IB_TIMEOUT` (1..=31; unset: none), or why it is not one.
pub(crate) fn env_ack_timeout() -> Result<Option<u8>, TransportError> {
    let Ok(v) = std::env::var("RMACOMM_IB_TIMEOUT") else { return Ok(None) };
    v.trim().parse::<u8>().ok().filter(|t| (1..=31).contains(t)).map(Some).ok_or_else(|| {
        TransportError::invalid(
            "RdmaTransport::new",
            format!("RMACOMM_IB_TIMEOUT='{v}' is not an ACK timeout exponent (1..=31, as NCCL_IB_TIMEOUT)"),
        )
    })
}

/// `RMACOMM_TIMEOUT_SECONDS` (seconds, fractions allowed; unset: none), or
/// why it is not a timeout.
pub(crate) fn env_timeout() -> Result<Option<Duration>, TransportError> {
    let Ok(v) = std::env::var("RMACOMM_TIMEOUT_SECONDS") else { return Ok(None) };
    v.trim()
        .parse::<f64>()
        .ok()
        .filter(|s| s.is_finite() && *s > 0.0 && *s < 1e9)
        .map(|s| Some(Duration::from_secs_f64(s)))
        .ok_or_else(|| {
            TransportError::invalid(
                "RdmaTransport::new",
                format!("RMACOMM_TIMEOUT_SECONDS='{v}' is not a positive number of seconds (below 1e9)"),
            )
        })
}

impl Default for TransportConfig {
    fn default() -> Self {
        // A bad value leaves no timeout here; `RdmaTransport::new` reports it.
        let timeout = env_timeout().ok().flatten();
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
            max_in_flight: 4096,
            direct_copy_max: std::env::var("RMACOMM_DIRECT_COPY_MAX")
                .ok()
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(1 << 20),
            soft: None,
            // A bad value gives the default here; `RdmaTransport::new` reports it.
            ack_timeout: env_ack_timeout().ok().flatten().unwrap_or(DEFAULT_ACK_TIMEOUT),
        }
    }
}

/// Builder-style setters: each sets one field and returns the config.
impl TransportConfig {
    /// Sets [`provider`](Self::provider).
    pub fn with_provider(mut self, provider: ProviderKind) -> Self {
        self.provider = provider;
        self
    }

    /// Sets [`device`](Self::device) (`None`: the provider's first).
    pub fn with_device(mut self, device: Option<String>) -> Self {
        self.device = device;
        self
    }

    /// Sets [`qps`](Self::qps).
    pub fn with_qps(mut self, qps: u32) -> Self {
        self.qps = qps;
        self
    }

    /// Sets [`load_balancing`](Self::load_balancing).
    pub fn with_load_balancing(mut self, load_balancing: LoadBalancing) -> Self {
        self.load_balancing = load_balancing;
        self
    }

    /// Sets [`frag_size`](Self::frag_size).
    pub fn with_frag_size(mut self, frag_size: u32) -> Self {
        self.frag_size = frag_size;
        self
    }

    /// Sets [`max_outstanding_per_qp`](Self::max_outstanding_per_qp).
    pub fn with_max_outstanding_per_qp(mut self, max_outstanding_per_qp: u32) -> Self {
        self.max_outstanding_per_qp = max_outstanding_per_qp;
        self
    }

    /// Sets [`cq_depth`](Self::cq_depth).
    pub fn with_cq_depth(mut self, cq_depth: usize) -> Self {
        self.cq_depth = cq_depth;
        self
    }

    /// Sets [`recv_depth`](Self::recv_depth).
    pub fn with_recv_depth(mut self, recv_depth: u32) -> Self {
        self.recv_depth = recv_depth;
        self
    }

    /// Sets [`timeout`](Self::timeout) (`None`: wait forever).
    pub fn with_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.timeout = timeout;
        self
    }

    /// Sets [`ack_timeout`](Self::ack_timeout) (1..=31).
    pub fn with_ack_timeout(mut self, ack_timeout: u8) -> Self {
        self.ack_timeout = ack_timeout;
        self
    }

    /// Sets [`busy_poll`](Self::busy_poll).
    pub fn with_busy_poll(mut self, busy_poll: Duration) -> Self {
        self.busy_poll = busy_poll;
        self
    }

    /// Sets [`max_in_flight`](Self::max_in_flight).
    pub fn with_max_in_flight(mut self, max_in_flight: usize) -> Self {
        self.max_in_flight = max_in_flight;
        self
    }

    /// Sets [`direct_copy_max`](Self::direct_copy_max) (0: off).
    pub fn with_direct_copy_max(mut self, direct_copy_max: usize) -> Self {
        self.direct_copy_max = direct_copy_max;
        self
    }

    /// Sets [`soft`](Self::soft) (`None`: from the environment).
    pub fn with_soft(mut self, soft: Option<SoftConfig>) -> Self {
        self.soft = soft;
        self
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
            ack_timeout: self.ack_timeout,
            ..VirtualQpConfig::default()
        }
    }
}
