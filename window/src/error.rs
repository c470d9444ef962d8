//! The window crate's one error type.

use std::time::Duration;

/// Result with the crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Errors of stores, launcher detection, groups and windows.
///
/// Every message says what to do next. The type is `Clone + PartialEq` so that
/// tests can compare errors; I/O errors are carried as their text.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Something did not arrive in time: a store key, or the other ranks of a
    /// group operation.
    #[error(
        "timed out after {after:?} waiting for {waiting_for}; check that every rank is alive and calls the same \
         group operations in the same order, or raise the timeout (the one set in code, else RMACOMM_TIMEOUT_SECONDS)"
    )]
    Timeout {
        /// What was awaited: `store key 'k'`, or a group operation and the ranks missing from it.
        waiting_for: String,
        /// How long it waited.
        after: Duration,
    },
    /// A TCP store client could not reach the store host within its timeout.
    #[error(
        "could not reach the TCP store at {addr} within {after:?} ({reason}); check that rank 0 is running and \
         that MASTER_ADDR/MASTER_PORT point at it"
    )]
    Connect {
        /// The address tried.
        addr: String,
        /// How long it kept trying.
        after: Duration,
        /// The last connection error.
        reason: String,
    },
    /// The store host could not listen on its port (or start its threads).
    #[error("cannot serve the TCP store on {addr} ({reason}); pick another MASTER_PORT or stop what holds this one")]
    Listen {
        /// The address or port it tried.
        addr: String,
        /// The operating system's error.
        reason: String,
    },
    /// A TCP store connection broke during a request. The next call reconnects.
    #[error(
        "lost the connection to the TCP store at {addr} ({reason}); the store host (rank 0) probably exited or \
         failed, look at its output"
    )]
    Disconnected {
        /// The store's address.
        addr: String,
        /// What happened.
        reason: String,
    },
    /// The peer of a store connection sent bytes that are not this protocol.
    #[error("malformed store message: {0}; check that both sides run the same rmacomm version")]
    Protocol(String),
    /// A file store operation failed on the file system.
    #[error("file store at {path}: {reason}; check that the directory exists, is writable and is shared by all ranks")]
    File {
        /// The file or directory involved.
        path: String,
        /// The operating system's error.
        reason: String,
    },
    /// An argument was wrong; nothing was changed.
    #[error("{op}: invalid argument: {reason}")]
    InvalidArgument {
        /// The operation.
        op: &'static str,
        /// What was wrong.
        reason: String,
    },
    /// A launcher environment variable is missing, malformed or contradicts another.
    #[error("environment variable {var}: {problem}")]
    Env {
        /// The variable at fault.
        var: String,
        /// What is wrong with it and what to set instead.
        problem: String,
    },
    /// No launcher environment was found.
    #[error(
        "no launcher environment found: start the program with rmacomm-run, torchrun, mpirun or srun, or set \
         RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, or build the group with Group::new and an explicit store"
    )]
    NoLaunchEnv,
    /// Ranks called a collective group operation with different arguments.
    #[error("{op}: ranks disagree: {detail}; every rank of the group must call it with the same arguments")]
    Mismatch {
        /// The operation, with its sequence number in the group.
        op: String,
        /// Which ranks passed what.
        detail: String,
    },
    /// A window operation with a peer failed in the transport: the peer's
    /// process exited (`the peer closed the connection`), the operation
    /// timed out, or the connection broke.
    #[error("{op} with rank {peer}: {source}")]
    Rma {
        /// The window operation (`put`, `signal`, `wait_signal`, `get`, ...).
        op: &'static str,
        /// The peer rank.
        peer: usize,
        /// What the transport said.
        #[source]
        source: rmacomm_transport::TransportError,
    },
    /// A local transport call failed (creating a transport, binding, memory).
    #[error("{op}: {source}")]
    Transport {
        /// The window operation.
        op: &'static str,
        /// What the transport said.
        #[source]
        source: rmacomm_transport::TransportError,
    },
    /// A put or get does not fit the peer's registered buffer; nothing was moved.
    #[error("{op} with rank {peer}: out of bounds: {reason}; nothing was moved")]
    Bounds {
        /// `put` or `get`.
        op: &'static str,
        /// The peer rank.
        peer: usize,
        /// The sizes involved.
        reason: String,
    },
    /// Something this build or this path cannot do yet.
    #[error("{op}: not available: {reason}")]
    Unsupported {
        /// The operation.
        op: &'static str,
        /// Why, and what to use instead.
        reason: String,
    },
    /// Some rank cannot map a peer's device memory (no peer access between
    /// their GPUs, or CUDA IPC refused): every rank of the registration
    /// returns the same one, so all can register through the transport
    /// instead ([`Window::register_cuda`](crate::Window::register_cuda) and
    /// [`tensor_register`](crate::Window::tensor_register)), as GpuComm and
    /// the Python window do.
    #[error(
        "{op}: rank {rank} cannot map a peer's device memory ({reason}); register it through the transport \
         instead (register_cuda, then tensor_register)"
    )]
    Unreachable {
        /// The operation.
        op: &'static str,
        /// The lowest rank that could not map.
        rank: usize,
        /// What it could not map, and why.
        reason: String,
    },
    /// Another rank failed its part of a collective window operation (so
    /// this rank fails it too, rather than go on with a peer that did not).
    #[error("{op}: rank {peer} failed its part: {reason}")]
    PeerFailed {
        /// The operation.
        op: &'static str,
        /// The rank that failed.
        peer: usize,
        /// Its error.
        reason: String,
    },
    /// A stream operation run by the window's stream proxy was not run: an
    /// earlier one of the window failed (its error is `earlier`).
    #[error(
        "{op} with rank {peer}: not run, because an earlier stream operation of this window failed ({earlier}); \
         data after it cannot be trusted: make a new window"
    )]
    StreamFailed {
        /// The operation that was not run.
        op: &'static str,
        /// Its peer.
        peer: usize,
        /// The first failure of the window's stream operations.
        earlier: Box<Error>,
    },
    /// A CUDA driver call of a window on device memory failed (or there is
    /// no driver): the message names the call and the driver's error.
    #[error("{op}: {source}")]
    Cuda {
        /// The window operation.
        op: &'static str,
        /// What the driver (or its loader) said.
        #[source]
        source: rmacomm_cuda::CudaError,
    },
    /// The store was shut down while the call was pending.
    #[error("the store was shut down while {op} was pending; keep the store host alive until every rank is done")]
    Closed {
        /// The pending operation.
        op: &'static str,
    },
}

impl Error {
    pub(crate) fn invalid(op: &'static str, reason: impl Into<String>) -> Self {
        Error::InvalidArgument { op, reason: reason.into() }
    }

    pub(crate) fn key_timeout(key: &str, after: Duration) -> Self {
        Error::Timeout { waiting_for: format!("store key '{key}'"), after }
    }

    pub(crate) fn env(var: &str, problem: impl Into<String>) -> Self {
        Error::Env { var: var.to_string(), problem: problem.into() }
    }
}
