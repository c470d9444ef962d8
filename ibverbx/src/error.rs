//! The crate's one error type.

use std::io;
use std::sync::Arc;

/// Errors returned by ibverbx calls.
///
/// Each variant names the verb that failed. Errors that come from the
/// operating system carry the `io::Error` (behind an `Arc`, so that the enum
/// stays `Clone` and tests can compare kinds).
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A verb failed with an operating-system error.
    #[error("{verb} failed: {source}")]
    Os {
        /// The verb that failed, e.g. `"reg_mr"`.
        verb: &'static str,
        /// The underlying error.
        #[source]
        source: Arc<io::Error>,
    },
    /// An argument was out of range or inconsistent; nothing was changed.
    #[error("{verb}: invalid argument: {reason}")]
    InvalidArgument {
        /// The verb that rejected the argument.
        verb: &'static str,
        /// What was wrong and how to fix it.
        reason: String,
    },
    /// The object is not in a state that allows the verb (e.g. post_send on a
    /// QP that is not in RTS).
    #[error("{verb}: invalid state: {reason}")]
    InvalidState {
        /// The verb that was refused.
        verb: &'static str,
        /// The state that refused it.
        reason: String,
    },
    /// A queue or table is full (send queue, receive queue, key table).
    #[error("{verb}: out of resources: {reason}")]
    Exhausted {
        /// The verb that found no room.
        verb: &'static str,
        /// Which resource ran out.
        reason: String,
    },
    /// The completion queue overflowed: completions were generated faster than
    /// they were polled and at least one could not be stored. The CQ is
    /// unusable afterwards; size CQs for every WR that can be outstanding.
    #[error("completion queue overflow: {dropped} completion(s) did not fit in a CQ of {capacity}; make the CQ larger or poll it more often")]
    CqOverflow {
        /// The CQ's capacity.
        capacity: usize,
        /// How many completions did not fit.
        dropped: u64,
    },
    /// The provider cannot be used here (library missing, no device, ...).
    #[error("provider {provider} unavailable: {reason}")]
    Unavailable {
        /// The provider's name.
        provider: &'static str,
        /// Why, in words a user can act on.
        reason: String,
    },
    /// A wait ran out of time.
    #[error("{verb}: timed out after {millis} ms")]
    Timeout {
        /// The verb that waited.
        verb: &'static str,
        /// How long it waited.
        millis: u64,
    },
}

impl Error {
    pub(crate) fn os(verb: &'static str, source: io::Error) -> Self {
        Error::Os { verb, source: Arc::new(source) }
    }

    pub(crate) fn last_os(verb: &'static str) -> Self {
        Self::os(verb, io::Error::last_os_error())
    }

    pub(crate) fn invalid(verb: &'static str, reason: impl Into<String>) -> Self {
        Error::InvalidArgument { verb, reason: reason.into() }
    }

    pub(crate) fn state(verb: &'static str, reason: impl Into<String>) -> Self {
        Error::InvalidState { verb, reason: reason.into() }
    }

    pub(crate) fn exhausted(verb: &'static str, reason: impl Into<String>) -> Self {
        Error::Exhausted { verb, reason: reason.into() }
    }
}

impl PartialEq for Error {
    fn eq(&self, other: &Self) -> bool {
        use Error::*;
        match (self, other) {
            (Os { verb: a, source: x }, Os { verb: b, source: y }) => a == b && x.kind() == y.kind(),
            (InvalidArgument { verb: a, reason: x }, InvalidArgument { verb: b, reason: y })
            | (InvalidState { verb: a, reason: x }, InvalidState { verb: b, reason: y })
            | (Exhausted { verb: a, reason: x }, Exhausted { verb: b, reason: y }) => a == b && x == y,
            (CqOverflow { capacity: a, dropped: x }, CqOverflow { capacity: b, dropped: y }) => a == b && x == y,
            (Unavailable { provider: a, reason: x }, Unavailable { provider: b, reason: y }) => a == b && x == y,
            (Timeout { verb: a, millis: x }, Timeout { verb: b, millis: y }) => a == b && x == y,
            _ => false,
        }
    }
}

/// Result alias for ibverbx.
pub type Result<T, E = Error> = std::result::Result<T, E>;
