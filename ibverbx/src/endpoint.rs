//! The serialisable description of a QP that its peer needs to connect.

use serde::{Deserialize, Serialize};

use crate::device::Gid;
// Defined with the provider that reads them; named here too, where the
// public API has always had them.
pub use crate::soft::{HostId, SoftAddress};

/// What a peer needs to move its QP to RTR against this one. Serialise it
/// (serde) and send it through whatever out-of-band channel the application
/// has; it holds no secret beyond the soft provider's connection token, which
/// only admits a connection to this QP.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct QpEndpoint {
    /// QP number.
    pub qpn: u32,
    /// Initial PSN the peer should expect.
    pub psn: u32,
    /// Port LID (InfiniBand; 0 on RoCE and soft).
    pub lid: u16,
    /// GID of the port (RoCE / routed InfiniBand).
    pub gid: Gid,
    /// Active MTU of the local port, in bytes.
    pub mtu: u32,
    /// Soft-provider addressing; `None` for hardware QPs.
    pub soft: Option<SoftAddress>,
}
