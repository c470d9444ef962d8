//! The transport's one error type.

use std::time::Duration;

/// Errors of [`RdmaTransport`](crate::RdmaTransport) calls.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    /// The operation did not finish in time. The transport stays usable; the
    /// operation may still complete in the background.
    #[error("{op} timed out after {after:?}; raise the timeout or check that the peer is alive")]
    Timeout {
        /// The operation.
        op: &'static str,
        /// How long it waited.
        after: Duration,
    },
    /// The connection failed (peer gone, network error, QP in error). Every
    /// later call fails with this at once; make a new transport to reconnect.
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
    #[error("{op}: remote access error (the remote buffer's key is wrong or revoked, or the range is outside it)")]
    RemoteAccess {
        /// The operation.
        op: &'static str,
    },
    /// Not possible with this provider, device or build.
    #[error("unsupported: {0}")]
    Unsupported(String),
}

impl TransportError {
    pub(crate) fn invalid(op: &'static str, reason: impl Into<String>) -> Self {
        TransportError::InvalidArgument { op, reason: reason.into() }
    }
}

impl From<ibverbx::Error> for TransportError {
    fn from(e: ibverbx::Error) -> Self {
        match e {
            ibverbx::Error::InvalidArgument { verb, reason } => TransportError::InvalidArgument { op: verb, reason },
            ibverbx::Error::Unavailable { .. } => TransportError::Unsupported(e.to_string()),
            other => TransportError::Broken(other.to_string()),
        }
    }
}
