//! Agent settings.

use std::net::SocketAddr;
use std::time::Duration;

use rmacomm_transport::TransportConfig;

/// Notification slots per peer when not set: how many notifications to one
/// peer may have landed and not yet been taken off its ring by its agent.
pub const DEFAULT_NOTIFICATION_SLOTS: u32 = 32;

/// Settings of a [`TransferAgent`](crate::TransferAgent). Start from
/// [`AgentConfig::default()`] and change what you need.
///
/// ```
/// use std::time::Duration;
/// use rmacomm_agent::AgentConfig;
/// use rmacomm_transport::TransportConfig;
///
/// let config = AgentConfig::default()
///     .with_transport(TransportConfig::default().with_qps(4).with_timeout(Some(Duration::from_secs(30))))
///     .with_connect_timeout(Duration::from_secs(10));
/// assert_eq!(config.transport.qps, 4);
/// ```
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct AgentConfig {
    /// Settings of the transport made for each peer (QPs, striping,
    /// fragment size, in-flight limit, and the timeout every piece and
    /// notification runs under).
    pub transport: TransportConfig,
    /// Where the handshake listener binds (it answers peers connecting for
    /// the first time). `None`: on each address the transport's soft TCP
    /// listener advertises (the interfaces `RMACOMM_SOCKET_IFNAME` selects),
    /// or on the loopback when there is none. Set it on hosts with a
    /// hardware provider; port 0 picks a free port.
    pub listen_addr: Option<SocketAddr>,
    /// Notification slots per peer (each 4 KiB + 64 B of registered memory
    /// on each side). A sender whose slots toward a peer are all full waits
    /// for that peer's agent to take notifications off (it does so as they
    /// arrive, into the queue [`notifications`](crate::TransferAgent::notifications)
    /// reads). 1 to 4096.
    pub notification_slots: u32,
    /// How long making a connection may take (the handshake and the
    /// transport's connect), before a transfer fails with
    /// [`AgentError::Timeout`](crate::AgentError::Timeout).
    pub connect_timeout: Duration,
}

impl Default for AgentConfig {
    fn default() -> Self {
        let transport = TransportConfig::default();
        let connect_timeout = transport.timeout.unwrap_or(Duration::from_secs(30));
        AgentConfig { transport, listen_addr: None, notification_slots: DEFAULT_NOTIFICATION_SLOTS, connect_timeout }
    }
}

impl AgentConfig {
    /// Sets [`transport`](Self::transport).
    pub fn with_transport(mut self, transport: TransportConfig) -> Self {
        self.transport = transport;
        self
    }

    /// Sets [`listen_addr`](Self::listen_addr).
    pub fn with_listen_addr(mut self, listen_addr: Option<SocketAddr>) -> Self {
        self.listen_addr = listen_addr;
        self
    }

    /// Sets [`notification_slots`](Self::notification_slots).
    pub fn with_notification_slots(mut self, slots: u32) -> Self {
        self.notification_slots = slots;
        self
    }

    /// Sets [`connect_timeout`](Self::connect_timeout).
    pub fn with_connect_timeout(mut self, connect_timeout: Duration) -> Self {
        self.connect_timeout = connect_timeout;
        self
    }
}
