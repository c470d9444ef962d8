//! The one error type of `rdma_bench`, and the exit status it maps to.

use std::fmt;

/// Why a run failed.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum BenchError {
    /// The options cannot work here (no such device, verbs without an
    /// HCA, a size the buffers cannot hold). Exit status 2.
    Config(String),
    /// The run broke (peer gone, transport error, timeout). Exit status 1.
    Run(String),
    /// The data at the destination is not what was sent. Exit status 3.
    Verification(String),
    /// Exit with this status, the reason having been printed already (a
    /// rank of a collective run that failed, or that leaves the report of
    /// a failure every rank saw to rank 0).
    Exit {
        /// The rank that failed.
        rank: usize,
        /// Its exit status.
        code: i32,
    },
}

impl BenchError {
    /// A run error with context.
    pub fn run(what: impl fmt::Display) -> BenchError {
        BenchError::Run(what.to_string())
    }

    /// The process exit status for this error.
    pub fn exit_code(&self) -> i32 {
        match self {
            BenchError::Config(_) => 2,
            BenchError::Run(_) => 1,
            BenchError::Verification(_) => 3,
            BenchError::Exit { code, .. } => *code,
        }
    }
}

impl fmt::Display for BenchError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BenchError::Config(m) => write!(f, "{m}"),
            BenchError::Run(m) => write!(f, "{m}"),
            BenchError::Verification(m) => write!(f, "DATA VERIFICATION FAILED: {m}"),
            BenchError::Exit { rank, code } => write!(f, "rank {rank} exited with status {code}"),
        }
    }
}

impl std::error::Error for BenchError {}

impl From<ibverbx::Error> for BenchError {
    fn from(e: ibverbx::Error) -> Self {
        BenchError::Run(format!("verbs: {e}"))
    }
}

impl From<rmacomm_transport::TransportError> for BenchError {
    fn from(e: rmacomm_transport::TransportError) -> Self {
        BenchError::Run(format!("transport: {e}"))
    }
}

impl From<rmacomm_window::Error> for BenchError {
    fn from(e: rmacomm_window::Error) -> Self {
        BenchError::Run(format!("window: {e}"))
    }
}

impl From<rmacomm_agent::AgentError> for BenchError {
    fn from(e: rmacomm_agent::AgentError) -> Self {
        BenchError::Run(format!("agent: {e}"))
    }
}

impl From<std::io::Error> for BenchError {
    fn from(e: std::io::Error) -> Self {
        BenchError::Run(format!("bootstrap connection: {e}"))
    }
}

/// Results of this crate.
pub type Result<T> = std::result::Result<T, BenchError>;
