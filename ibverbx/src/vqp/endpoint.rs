//! The serialisable description of a virtual QP that its peer connects to.

use serde::{Deserialize, Serialize};

use super::config::LoadBalancing;
use crate::QpEndpoint;

/// Everything a peer needs to connect its [`VirtualQp`](crate::VirtualQp)
/// to this one: the data QPs in order (data QP i connects to the peer's
/// data QP i), the notify QP when there is more than one data QP, and the
/// settings both ends must share. Serialise it (serde) and exchange it like
/// a [`QpEndpoint`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VirtualQpEndpoint {
    /// The load-balancing scheme (must match the peer's).
    pub load_balancing: LoadBalancing,
    /// Outstanding WRs per physical QP (must match: it sizes the peer's
    /// receive queues and reorder window).
    pub max_msg_cnt_per_qp: u32,
    /// First DQPLB sequence number this end sends.
    pub initial_seq: u32,
    /// The data QPs, in order.
    pub data: Vec<QpEndpoint>,
    /// The notify QP (`None` with a single data QP).
    pub notify: Option<QpEndpoint>,
}
