//! The soft provider's part of a QP's endpoint ([`SoftAddress`]) and the
//! host identity it carries ([`HostId`]); the generic
//! [`QpEndpoint`](crate::QpEndpoint) holds it as `soft`.
//!
//! Their serialised form is part of the endpoint's: a field added later
//! needs `#[serde(default)]` so that older peers' endpoints still parse.

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

/// Identity of a host as the soft provider sees it: two processes share
/// memory directly only when all three match.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct HostId {
    /// `/proc/sys/kernel/random/boot_id`.
    pub boot_id: String,
    /// Inode of `/proc/self/ns/ipc`.
    pub ipc_ns: u64,
    /// Inode of `/proc/self/ns/net`.
    pub net_ns: u64,
}

/// Soft-provider part of an endpoint.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SoftAddress {
    /// Host identity, to choose between the shared-memory and TCP links.
    pub host: HostId,
    /// Process id of the owning process, for diagnostics only: a peer uses
    /// the pid the kernel reports for the socket it connected to
    /// (`SO_PEERCRED`), never this claim.
    pub pid: u32,
    /// Unique id of the owning context.
    pub ctx_uid: u64,
    /// Addresses of the context's TCP listener, best first.
    pub tcp: Vec<SocketAddr>,
    /// Abstract unix-socket name of the context's same-host listener.
    pub unix: String,
    /// Unused since peers obtain descriptors by `SCM_RIGHTS` over the
    /// context's attach socket (always -1; kept so that the serialised form
    /// stays the same). A value here is never acted on.
    pub keytable_fd: i32,
    /// Unique id of the key table segment (checked against the fd's name).
    pub keytable_uid: u64,
    /// Protection domain the QP belongs to.
    pub pd: u32,
    /// Connection token: a connection must present it to reach this QP.
    pub token: [u8; 16],
    /// Unused, as `keytable_fd` (always -1).
    #[serde(default = "no_fd")]
    pub doorbell_fd: i32,
    /// Unique id of the doorbell table segment.
    #[serde(default)]
    pub doorbell_uid: u64,
    /// This QP's slot in it (0: none).
    #[serde(default)]
    pub doorbell_slot: u32,
    /// Unique id of the context's deregistration fence table (checked
    /// against the descriptor the attach socket passes).
    #[serde(default)]
    pub fence_uid: u64,
}

impl std::fmt::Debug for SoftAddress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Every field but the token, which admits a connection to the QP and
        // so must not reach logs. Destructured so that a field added later
        // must be listed here.
        let SoftAddress {
            host,
            pid,
            ctx_uid,
            tcp,
            unix,
            keytable_fd,
            keytable_uid,
            pd,
            token: _,
            doorbell_fd,
            doorbell_uid,
            doorbell_slot,
            fence_uid,
        } = self;
        f.debug_struct("SoftAddress")
            .field("host", host)
            .field("pid", pid)
            .field("ctx_uid", ctx_uid)
            .field("tcp", tcp)
            .field("unix", unix)
            .field("keytable_fd", keytable_fd)
            .field("keytable_uid", keytable_uid)
            .field("pd", pd)
            .field("token", &format_args!("<redacted>"))
            .field("doorbell_fd", doorbell_fd)
            .field("doorbell_uid", doorbell_uid)
            .field("doorbell_slot", doorbell_slot)
            .field("fence_uid", fence_uid)
            .finish()
    }
}

fn no_fd() -> i32 {
    -1
}
