//! [`CudaError`]: what went wrong loading or calling a GPU library.

use std::path::PathBuf;

/// A GPU library that could not be loaded or used. Every message names the
/// library (and the file or symbol) so that the fix is clear: install it,
/// point the `RMACOMM_*_LIB` variable at it, or use another backend.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CudaError {
    /// No file of the library could be opened.
    #[error(
        "{lib} is not available: {tried} ({hint})",
        tried = tried.join("; ")
    )]
    NotFound {
        /// The library in words ("the CUDA driver (libcuda.so.1)").
        lib: &'static str,
        /// What was tried, each with why it failed.
        tried: Vec<String>,
        /// How to point rmacomm at it.
        hint: &'static str,
    },
    /// The library was opened but lacks a function rmacomm needs (too old a
    /// version, or not the library it claims to be).
    #[error("{lib} at {path} has no symbol {symbol}: {reason}")]
    MissingSymbol {
        /// The library in words.
        lib: &'static str,
        /// The file opened.
        path: PathBuf,
        /// The function looked for.
        symbol: &'static str,
        /// dlsym's message.
        reason: String,
    },
    /// A call into the library failed.
    #[error("{lib}: {call} failed with {code} ({name})")]
    Call {
        /// The library in words.
        lib: &'static str,
        /// The function called.
        call: &'static str,
        /// The library's status code.
        code: i32,
        /// The code's name or description, from the library where it has one.
        name: String,
    },
    /// A call into the library did not complete within its time limit
    /// (NCCL's non-blocking calls, polled until then); `detail` says which
    /// rank waited and what was done about it.
    #[error("{lib}: {call} did not complete within {after:?}: {detail}")]
    Timeout {
        /// The library in words.
        lib: &'static str,
        /// The function called.
        call: &'static str,
        /// How long it was given.
        after: std::time::Duration,
        /// The rank, what it waited for, and what was left behind.
        detail: String,
    },
    /// The library is there but too old for what was asked.
    #[error("{lib} {have} is too old: {what} needs {need} or newer")]
    TooOld {
        /// The library in words.
        lib: &'static str,
        /// Its version.
        have: String,
        /// The version needed.
        need: String,
        /// What needs it.
        what: &'static str,
    },
    /// Compilation of CUDA C failed (NVRTC); the log says why.
    #[error("NVRTC could not compile {name} for {arch}: {log}")]
    Compile {
        /// The program's name.
        name: String,
        /// The target (`sm_90`, `compute_90`).
        arch: String,
        /// NVRTC's log.
        log: String,
    },
}

/// `Result` with [`CudaError`].
pub type Result<T> = std::result::Result<T, CudaError>;
