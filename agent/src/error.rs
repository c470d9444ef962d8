//! The agent's one error type.

use std::time::Duration;

use rmacomm_transport::TransportError;

/// Errors of [`TransferAgent`](crate::TransferAgent) calls and
/// [`Transfer`](crate::Transfer)s.
///
/// The argument errors (`InvalidArgument`, `UnknownPeer`, `UnknownRegion`,
/// `OutOfBounds`) come from [`TransferAgent::transfer`](crate::TransferAgent::transfer)
/// itself, before anything is posted: nothing moved. The others end a
/// transfer that may have moved some of its pieces (never silently: the
/// transfer fails and sends no notification).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AgentError {
    /// An argument was wrong; nothing was transferred.
    #[error("{op}: invalid argument: {reason}")]
    InvalidArgument {
        /// The call.
        op: &'static str,
        /// What was wrong, naming the piece where one was.
        reason: String,
    },
    /// No peer of this name was added (or it was removed).
    #[error("unknown peer {name:?}: add it first with add_peer(its metadata)")]
    UnknownPeer {
        /// The name asked for.
        name: String,
    },
    /// A remote block names a region the peer's metadata does not list;
    /// nothing was transferred.
    #[error(
        "piece {piece}: peer {peer:?} publishes no region {region}; if it registered memory since, add its current \
         metadata again (add_peer); nothing was transferred"
    )]
    UnknownRegion {
        /// The peer.
        peer: String,
        /// Index of the piece in the request.
        piece: usize,
        /// The region it named.
        region: u32,
    },
    /// A remote block reaches outside its region; nothing was transferred.
    #[error(
        "piece {piece}: bytes {offset}..{offset}+{len} are outside region {region} of peer {peer:?} ({region_len} \
         bytes); nothing was transferred"
    )]
    OutOfBounds {
        /// The peer.
        peer: String,
        /// Index of the piece in the request.
        piece: usize,
        /// The region.
        region: u32,
        /// Where the block starts in the region.
        offset: u64,
        /// Its length.
        len: u64,
        /// The region's length.
        region_len: u64,
    },
    /// The connection to the peer could not be made: its agent is gone (no
    /// process listens at its metadata's addresses), refused this agent, or
    /// did not answer in time. Nothing was transferred.
    #[error("cannot connect to peer {peer:?}: {reason}")]
    Unreachable {
        /// The peer.
        peer: String,
        /// Why, for a person.
        reason: String,
    },
    /// The connection broke under a transfer: the peer's process exited or
    /// dropped its agent, or the path to it failed. The transfer's pieces
    /// may be partly placed; no notification was sent. The next transfer to
    /// the peer connects again (and fails with `Unreachable` if it is gone).
    #[error("peer {peer:?} was lost mid-transfer ({}); transfers in flight to it failed and sent no notification", lost_reason(.source))]
    PeerLost {
        /// The peer.
        peer: String,
        /// The transport's error.
        source: TransportError,
    },
    /// The peer refused a write or read: the block's region is no longer
    /// registered there (it was deregistered, or its memory dropped, since
    /// the metadata naming it was added). Nothing more of the request is
    /// moved and no notification is sent; the peer's other regions stay
    /// usable. Refused by the peer's device (a remote access error), the
    /// connection is reset: other transfers in flight on it fail with
    /// `PeerLost`, and the next one connects again.
    #[error("peer {peer:?} refused the {op}: {reason}")]
    Refused {
        /// The peer.
        peer: String,
        /// The operation ("write" or "read").
        op: &'static str,
        /// Why, for a person.
        reason: String,
    },
    /// A transfer or connection to the peer did not finish in time (the
    /// transport's timeout, [`AgentConfig::connect_timeout`](crate::AgentConfig::connect_timeout)).
    #[error("{op} with peer {peer:?} timed out after {after:?}; check that the peer is alive, or raise the timeout")]
    Timeout {
        /// The peer.
        peer: String,
        /// What timed out.
        op: &'static str,
        /// After how long.
        after: Duration,
    },
    /// The peer was removed ([`remove_peer`](crate::TransferAgent::remove_peer)),
    /// the agent dropped, or the connection replaced, while the transfer was
    /// pending.
    #[error("peer {peer:?} was removed (or its connection closed) while the transfer was pending")]
    PeerRemoved {
        /// The peer.
        peer: String,
    },
    /// A string given as agent metadata is not one.
    #[error("not agent metadata: {reason}; pass the string another agent's metadata() returned, unchanged")]
    BadMetadata {
        /// What is wrong with it.
        reason: String,
    },
    /// Another transport error (a full queue, an OS resource).
    #[error("peer {peer:?}: {source}")]
    Transport {
        /// The peer.
        peer: String,
        /// The transport's error.
        source: TransportError,
    },
    /// The agent's device could not be opened, or memory allocated on it.
    #[error("the agent's device: {0}")]
    Device(TransportError),
    /// A call into the operating system failed (the handshake listener).
    #[error("{op} failed: {message}")]
    Os {
        /// The call.
        op: &'static str,
        /// The error kind (so that errors compare).
        kind: std::io::ErrorKind,
        /// The OS's message.
        message: String,
    },
    /// The bootstrap store failed (publishing or looking up metadata).
    #[error("store: {0}")]
    Store(#[from] rmacomm_window::Error),
}

/// The transport error in words, without its advice (a transport error says
/// to make a new transport; the agent does that itself).
fn lost_reason(e: &TransportError) -> String {
    match e {
        TransportError::PeerClosed { .. } => "the peer closed the connection or became unreachable".into(),
        TransportError::Completion { op, status, .. } => format!("a {op} failed with completion status \"{status}\""),
        TransportError::RemoteAccess { op, .. } => format!("a {op} was refused by the peer (remote access error)"),
        TransportError::Broken(m) => m.clone(),
        other => other.to_string(),
    }
}

impl AgentError {
    pub(crate) fn invalid(op: &'static str, reason: impl Into<String>) -> Self {
        AgentError::InvalidArgument { op, reason: reason.into() }
    }

    pub(crate) fn os(op: &'static str, e: &std::io::Error) -> Self {
        AgentError::Os { op, kind: e.kind(), message: e.to_string() }
    }

    /// A transport error met by an operation toward `peer`, named for it.
    pub(crate) fn from_transport(peer: &str, e: TransportError) -> Self {
        let peer = peer.to_owned();
        match e {
            TransportError::Timeout { op, after } => AgentError::Timeout { peer, op, after },
            TransportError::Aborted { .. } => AgentError::PeerRemoved { peer },
            TransportError::RemoteAccess { op, .. } => AgentError::Refused {
                peer,
                op,
                reason:
                    "a remote access error: the block's region is no longer registered there (deregistered, or its \
                         memory dropped); the connection was reset, so transfers in flight to the peer failed and \
                         sent no notification"
                        .into(),
            },
            e if e.is_broken() => AgentError::PeerLost { peer, source: e },
            e => AgentError::Transport { peer, source: e },
        }
    }

    /// A consequence of an earlier failure rather than its cause: the
    /// connection was already broken by another operation (whose own
    /// error says what broke it).
    pub(crate) fn is_consequence(&self) -> bool {
        matches!(self, AgentError::PeerLost { source: TransportError::Broken(_), .. })
    }

    /// The peer this error is about, where it names one.
    pub fn peer(&self) -> Option<&str> {
        match self {
            AgentError::UnknownPeer { name: peer }
            | AgentError::UnknownRegion { peer, .. }
            | AgentError::OutOfBounds { peer, .. }
            | AgentError::Unreachable { peer, .. }
            | AgentError::PeerLost { peer, .. }
            | AgentError::Refused { peer, .. }
            | AgentError::Timeout { peer, .. }
            | AgentError::PeerRemoved { peer }
            | AgentError::Transport { peer, .. } => Some(peer),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lost_peer_is_named_and_the_transport_advice_is_left_out() {
        let e = AgentError::from_transport(
            "decode-0",
            TransportError::PeerClosed { peer: "the soft peer's QP 0x1".into() },
        );
        assert!(matches!(e, AgentError::PeerLost { .. }), "{e:?}");
        let s = e.to_string();
        assert!(s.contains("\"decode-0\"") && s.contains("closed the connection"), "{s}");
        assert!(!s.contains("new transport"), "{s}");
        assert_eq!(e.peer(), Some("decode-0"));
        let t = AgentError::from_transport("p", TransportError::Timeout { op: "write", after: Duration::from_secs(2) });
        assert_eq!(t, AgentError::Timeout { peer: "p".into(), op: "write", after: Duration::from_secs(2) });
        assert_eq!(
            AgentError::from_transport("p", TransportError::Aborted { op: "read" }),
            AgentError::PeerRemoved { peer: "p".into() }
        );
        let r = AgentError::from_transport(
            "decode-0",
            TransportError::RemoteAccess { op: "write", peer: "soft qp 7".into(), remote: "0x1000+8 key 0x5".into() },
        );
        assert!(matches!(r, AgentError::Refused { op: "write", .. }), "{r:?}");
        let s = r.to_string();
        assert!(s.starts_with("peer \"decode-0\" refused the write: ") && s.contains("no longer registered"), "{s}");
        assert_eq!(r.peer(), Some("decode-0"));
        assert!(!r.is_consequence());
        let broken = TransportError::Broken("an earlier write hit a remote access error".into());
        assert!(AgentError::from_transport("decode-0", broken).is_consequence());
    }
}
