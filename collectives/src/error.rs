//! The crate's error type.

use std::time::Duration;

/// Errors of [`Comm`](crate::Comm) operations. Each names the operation
/// (with its sequence number on this communicator) and, where one is
/// involved, the peer ranks.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An argument was wrong on this rank; nothing was sent.
    #[error("{op}: invalid argument: {reason}")]
    InvalidArgument {
        /// The operation.
        op: &'static str,
        /// What was wrong.
        reason: String,
    },
    /// Ranks called different collectives, or the same one with different
    /// sizes or types: detected from what a peer sent.
    #[error("{op} #{seq}: mismatched call: {reason}")]
    Mismatch {
        /// The operation on this rank.
        op: &'static str,
        /// Its sequence number on this communicator.
        seq: u64,
        /// What the peer sent instead.
        reason: String,
    },
    /// Peers did not take part in time (a rank that never called the
    /// operation, or one that died).
    #[error("{op} #{seq}: timed out after {after:?} waiting for ranks {missing:?} ({waiting_for}); check that every rank calls the same collectives in the same order, or raise the timeout (the one set in code, else RMACOMM_TIMEOUT_SECONDS)")]
    Timeout {
        /// The operation.
        op: &'static str,
        /// Its sequence number on this communicator.
        seq: u64,
        /// The ranks that had not sent or taken their part.
        missing: Vec<usize>,
        /// What this rank waited for.
        waiting_for: String,
        /// How long it waited.
        after: Duration,
    },
    /// The backend is not available in this build or on this machine.
    #[error("backend {backend:?} is not available: {reason}")]
    Unavailable {
        /// The backend asked for.
        backend: String,
        /// Why, and what to use instead.
        reason: String,
    },
    /// A window or group operation underneath failed.
    #[error("{op}: {source}")]
    Window {
        /// The collective.
        op: &'static str,
        /// What the window said.
        #[source]
        source: rmacomm_window::Error,
    },
    /// A reduction kernel refused the arguments (e.g. a bitwise op on floats).
    #[error("{op}: {source}")]
    Kernel {
        /// The collective.
        op: &'static str,
        /// What the kernel said.
        #[source]
        source: rmacomm_kernels::Error,
    },
    /// A wait with its own limit ([`CommWork::wait`](crate::CommWork::wait))
    /// ended before the operation did: it goes on; wait again. Nothing is
    /// wrong with the communicator.
    #[error("{op}: not finished after {after:?}; the operation goes on: wait again")]
    Pending {
        /// The wait.
        op: &'static str,
        /// Its limit.
        after: Duration,
    },
    /// The communicator was finalized, or an earlier error left it unusable.
    #[error("{op}: the communicator is unusable: {reason}")]
    Unusable {
        /// The operation refused.
        op: &'static str,
        /// Why.
        reason: String,
    },
}

/// The crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub(crate) fn invalid(op: &'static str, reason: impl Into<String>) -> Self {
        Error::InvalidArgument { op, reason: reason.into() }
    }

    pub(crate) fn window(op: &'static str) -> impl FnOnce(rmacomm_window::Error) -> Error {
        move |source| Error::Window { op, source }
    }
}
