//! The transport's one error type.

use std::io;
use std::sync::Arc;
use std::time::Duration;

use ibverbx::WcStatus;

/// Errors of [`RdmaTransport`](crate::RdmaTransport) calls.
///
/// Which ones leave the transport usable: `Timeout`, `InvalidArgument`,
/// `ResourceExhausted`, `Unsupported` and `Os` do; after `PeerClosed`,
/// `Completion`, `RemoteAccess` and `Broken` every later call fails at once
/// and only a new transport reconnects.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    /// The operation did not finish in time. The transport stays usable; the
    /// operation may still complete in the background (its memory stays
    /// registered until it has).
    #[error("{op} timed out after {after:?}; raise the timeout or check that the peer is alive")]
    Timeout {
        /// The operation.
        op: &'static str,
        /// How long it waited.
        after: Duration,
    },
    /// The peer's process exited or dropped its transport (or the network
    /// path to it is gone). Every later call fails with this at once.
    #[error("{peer}: the peer closed the connection (or became unreachable); create a new transport to connect again")]
    PeerClosed {
        /// Who the peer was (provider, QP number, pid or address).
        peer: String,
    },
    /// A work request failed with this completion status. The connection is
    /// lost: every later call fails with this at once.
    #[error("{op} failed with completion status \"{status}\" ({peer}); the connection is lost: create a new transport and connect again")]
    Completion {
        /// The operation whose failure broke the connection.
        op: &'static str,
        /// The status of the first failure (the root cause, not the flushes
        /// it caused).
        status: WcStatus,
        /// Who the peer was.
        peer: String,
    },
    /// The connection failed for another reason (a refused `connect`, a
    /// completion queue that overflowed, a completion channel error). Every
    /// later call fails with this at once.
    #[error("transport broken: {0}; create a new transport and connect again")]
    Broken(String),
    /// The transport was dropped while the operation was pending.
    #[error("{op} aborted: the transport was dropped while it was pending")]
    Aborted {
        /// The operation.
        op: &'static str,
    },
    /// An argument was wrong; nothing was sent.
    #[error("{op}: invalid argument: {reason}")]
    InvalidArgument {
        /// The operation.
        op: &'static str,
        /// What was wrong.
        reason: String,
    },
    /// The peer refused the access: unknown or revoked key, out of bounds, or
    /// missing permission. The transport is broken afterwards.
    #[error("{op} with {peer}: remote access error at {remote} (the remote buffer's key is wrong or revoked, or the range is outside it); create a new transport to continue")]
    RemoteAccess {
        /// The operation.
        op: &'static str,
        /// The peer (its address, as the transport knows it).
        peer: String,
        /// The remote range the operation named (`addr+len key`).
        remote: String,
    },
    /// A queue, table or device resource is full; nothing was changed.
    #[error("out of resources: {what}; wait for operations in flight to finish, create fewer transports, or raise the limit")]
    ResourceExhausted {
        /// Which resource, and the call that found it full.
        what: String,
    },
    /// A call into the operating system failed (creating a queue, mapping
    /// memory, a descriptor); nothing was changed.
    #[error("{op} failed: {source}; check the process's limits (ulimit -n, locked memory) and retry")]
    Os {
        /// The call that failed.
        op: &'static str,
        /// The operating system's error (shared, so that the enum stays
        /// `Clone`; equal when the kinds are).
        #[source]
        source: Arc<io::Error>,
    },
    /// Not possible with this provider, device or build.
    #[error("unsupported: {0}")]
    Unsupported(String),
}

impl TransportError {
    pub(crate) fn invalid(op: &'static str, reason: impl Into<String>) -> Self {
        TransportError::InvalidArgument { op, reason: reason.into() }
    }

    /// Whether the transport that returned this is unusable from now on
    /// (make a new one to reconnect).
    pub fn is_broken(&self) -> bool {
        matches!(
            self,
            TransportError::PeerClosed { .. }
                | TransportError::Completion { .. }
                | TransportError::Broken(_)
                | TransportError::RemoteAccess { .. }
        )
    }
}

// By hand because `io::Error` has no `PartialEq`: OS errors compare by kind,
// as `ibverbx::Error` does, so tests can `assert_eq!` on every variant.
impl PartialEq for TransportError {
    fn eq(&self, other: &Self) -> bool {
        use TransportError::*;
        match (self, other) {
            (Timeout { op: a, after: x }, Timeout { op: b, after: y }) => a == b && x == y,
            (PeerClosed { peer: a }, PeerClosed { peer: b }) => a == b,
            (Completion { op: a, status: s, peer: x }, Completion { op: b, status: t, peer: y }) => {
                a == b && s == t && x == y
            }
            (Broken(a), Broken(b)) | (Unsupported(a), Unsupported(b)) => a == b,
            (Aborted { op: a }, Aborted { op: b }) | (RemoteAccess { op: a, .. }, RemoteAccess { op: b, .. }) => a == b,
            (InvalidArgument { op: a, reason: x }, InvalidArgument { op: b, reason: y }) => a == b && x == y,
            (ResourceExhausted { what: a }, ResourceExhausted { what: b }) => a == b,
            (Os { op: a, source: x }, Os { op: b, source: y }) => a == b && x.kind() == y.kind(),
            _ => false,
        }
    }
}

impl Eq for TransportError {}

impl From<ibverbx::Error> for TransportError {
    fn from(e: ibverbx::Error) -> Self {
        match e {
            ibverbx::Error::InvalidArgument { verb, reason } => TransportError::InvalidArgument { op: verb, reason },
            ibverbx::Error::Unavailable { .. } => TransportError::Unsupported(e.to_string()),
            ibverbx::Error::Os { verb, source } => TransportError::Os { op: verb, source },
            ibverbx::Error::Exhausted { verb, reason } => {
                TransportError::ResourceExhausted { what: format!("{verb}: {reason}") }
            }
            ibverbx::Error::Timeout { verb, millis } => {
                TransportError::Timeout { op: verb, after: Duration::from_millis(millis) }
            }
            other => TransportError::Broken(other.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn os_errors_compare_by_kind_and_keep_their_source() {
        let a = TransportError::from(ibverbx::Error::Os {
            verb: "create_qp",
            source: Arc::new(io::Error::from_raw_os_error(libc_emfile())),
        });
        let b = TransportError::Os { op: "create_qp", source: Arc::new(io::Error::from_raw_os_error(libc_emfile())) };
        assert_eq!(a, b);
        assert!(std::error::Error::source(&a).is_some());
        assert!(a.to_string().contains("ulimit"), "{a}");
        assert!(!a.is_broken());
    }

    fn libc_emfile() -> i32 {
        24 // EMFILE on Linux
    }

    #[test]
    fn only_real_breakage_says_to_make_a_new_transport() {
        let closed = TransportError::PeerClosed { peer: "the soft peer's QP 0x1".into() };
        assert!(closed.to_string().contains("peer closed the connection"), "{closed}");
        assert!(closed.to_string().contains("create a new transport"), "{closed}");
        assert!(closed.is_broken());
        for usable in [
            TransportError::Timeout { op: "write", after: Duration::from_secs(1) },
            TransportError::ResourceExhausted { what: "post_send: send queue full".into() },
            TransportError::invalid("write", "too long"),
        ] {
            assert!(!usable.to_string().contains("new transport"), "{usable}");
            assert!(!usable.is_broken());
        }
    }
}
