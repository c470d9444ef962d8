//! Python exceptions for rmacomm's errors: one type per category, each
//! carrying the Rust error's message (which names the operation, the peer
//! and what to do next).
//!
//! ```text
//! Exception
//! └── CommError                       every rmacomm error
//!     ├── TimeoutError                also builtins.TimeoutError
//!     ├── ArgumentError               also ValueError: a bad argument, nothing moved
//!     ├── MismatchError               ranks called different operations / arguments
//!     ├── PeerError                   a peer died or the connection broke
//!     └── UnavailableError            a backend or feature this build lacks
//! ```
//!
//! The types are made at import with `type(name, bases, ns)`: pyo3's
//! exception macro takes one base, and `TimeoutError` needs two.

use std::sync::Mutex;

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};
use rmacomm_transport::TransportError;

/// An error category: which Python exception type it becomes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ErrKind {
    Comm,
    Timeout,
    Argument,
    Mismatch,
    Peer,
    Unavailable,
}

/// An rmacomm error on its way to Python: `Send`, so that it can come back
/// from a call made without the GIL or be kept in a `Work`.
#[derive(Debug, Clone)]
pub(crate) struct Failure {
    pub(crate) kind: ErrKind,
    pub(crate) msg: String,
}

impl Failure {
    pub(crate) fn new(kind: ErrKind, msg: impl Into<String>) -> Self {
        Failure { kind, msg: msg.into() }
    }
}

struct Types {
    comm: Py<PyType>,
    timeout: Py<PyType>,
    argument: Py<PyType>,
    mismatch: Py<PyType>,
    peer: Py<PyType>,
    unavailable: Py<PyType>,
}

static TYPES: PyOnceLock<Types> = PyOnceLock::new();

/// Whether `e` is an rmacomm error (`CommError` or a subclass): an
/// operation's own failure, not an interrupt or another exception raised
/// while waiting.
pub(crate) fn is_comm_error(py: Python<'_>, e: &PyErr) -> bool {
    TYPES.get(py).is_some_and(|t| e.is_instance(py, t.comm.bind(py)))
}

/// A Python exception raised inside a callback into Python (a store
/// method) that must not be swallowed into an rmacomm error: a
/// `KeyboardInterrupt` or `SystemExit`. Raised again instead of the error
/// the Rust call returned.
static PENDING: Mutex<Option<PyErr>> = Mutex::new(None);

/// Keeps `e` to raise instead of the next error that reaches Python.
pub(crate) fn defer(e: PyErr) {
    let mut p = PENDING.lock().unwrap_or_else(|e| e.into_inner());
    if p.is_none() {
        *p = Some(e);
    }
}

fn make(
    py: Python<'_>,
    m: &Bound<'_, PyModule>,
    name: &str,
    bases: &[&Bound<'_, PyAny>],
    doc: &str,
) -> PyResult<Py<PyType>> {
    let ns = PyDict::new(py);
    ns.set_item("__module__", "rmacomm")?;
    ns.set_item("__doc__", doc)?;
    let ty = py.get_type::<PyType>().call1((name, PyTuple::new(py, bases)?, ns))?;
    m.add(name, &ty)?;
    Ok(ty.cast_into::<PyType>()?.unbind())
}

/// Creates the exception types and adds them to the module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    let builtins = py.import("builtins")?;
    let exception = builtins.getattr("Exception")?;
    let comm = make(
        py,
        m,
        "CommError",
        &[&exception],
        "An rmacomm operation failed. The message names the operation, the peer rank where one is \
         involved, and what to do next. Subclasses say which kind of failure it was.",
    )?;
    let c = comm.bind(py).as_any().clone();
    let types = Types {
        timeout: make(
            py,
            m,
            "TimeoutError",
            &[&c, &builtins.getattr("TimeoutError")?],
            "An operation did not complete within its timeout: a peer that never took part, is slow, or died \
             unnoticed. Also a builtins.TimeoutError.",
        )?,
        argument: make(
            py,
            m,
            "ArgumentError",
            &[&c, &builtins.getattr("ValueError")?],
            "An argument was wrong on this rank (out of bounds, wrong size, an op the dtype does not allow); \
             nothing was moved. Also a ValueError.",
        )?,
        mismatch: make(
            py,
            m,
            "MismatchError",
            &[&c],
            "Ranks called different operations, or the same one with different arguments; every rank must call \
             collective operations in the same order with matching arguments.",
        )?,
        peer: make(
            py,
            m,
            "PeerError",
            &[&c],
            "A peer's process exited or its connection broke; the communicator or window cannot reach it any \
             more.",
        )?,
        unavailable: make(
            py,
            m,
            "UnavailableError",
            &[&c],
            "A backend or feature that this build or this machine does not provide (e.g. backend 'nccl').",
        )?,
        comm,
    };
    let _ = TYPES.set(py, types);
    Ok(())
}

impl From<Failure> for PyErr {
    fn from(f: Failure) -> PyErr {
        if let Some(e) = PENDING.lock().unwrap_or_else(|e| e.into_inner()).take() {
            return e;
        }
        Python::attach(|py| match TYPES.get(py) {
            Some(t) => {
                let ty = match f.kind {
                    ErrKind::Comm => &t.comm,
                    ErrKind::Timeout => &t.timeout,
                    ErrKind::Argument => &t.argument,
                    ErrKind::Mismatch => &t.mismatch,
                    ErrKind::Peer => &t.peer,
                    ErrKind::Unavailable => &t.unavailable,
                };
                PyErr::from_type(ty.bind(py).clone(), f.msg)
            }
            None => pyo3::exceptions::PyRuntimeError::new_err(f.msg),
        })
    }
}

fn transport_kind(e: &TransportError) -> ErrKind {
    match e {
        TransportError::Timeout { .. } => ErrKind::Timeout,
        TransportError::InvalidArgument { .. } => ErrKind::Argument,
        TransportError::Unsupported(_) => ErrKind::Unavailable,
        e if e.is_broken() => ErrKind::Peer,
        TransportError::Aborted { .. } => ErrKind::Peer,
        _ => ErrKind::Comm,
    }
}

fn window_kind(e: &rmacomm_window::Error) -> ErrKind {
    use rmacomm_window::Error as W;
    match e {
        W::Timeout { .. } => ErrKind::Timeout,
        W::InvalidArgument { .. } | W::Bounds { .. } | W::Env { .. } | W::NoLaunchEnv => ErrKind::Argument,
        W::Mismatch { .. } => ErrKind::Mismatch,
        W::Connect { .. } | W::Disconnected { .. } | W::Closed { .. } | W::PeerFailed { .. } => ErrKind::Peer,
        W::Unsupported { .. } | W::Unreachable { .. } => ErrKind::Unavailable,
        W::Cuda {
            source:
                rmacomm_window::cuda::CudaError::NotFound { .. }
                | rmacomm_window::cuda::CudaError::MissingSymbol { .. }
                | rmacomm_window::cuda::CudaError::TooOld { .. },
            ..
        } => ErrKind::Unavailable,
        W::Cuda { source: rmacomm_window::cuda::CudaError::Timeout { .. }, .. } => ErrKind::Timeout,
        W::Rma { source, .. } | W::Transport { source, .. } => transport_kind(source),
        _ => ErrKind::Comm,
    }
}

impl From<rmacomm_window::Error> for Failure {
    fn from(e: rmacomm_window::Error) -> Self {
        Failure { kind: window_kind(&e), msg: e.to_string() }
    }
}

impl From<TransportError> for Failure {
    fn from(e: TransportError) -> Self {
        Failure { kind: transport_kind(&e), msg: e.to_string() }
    }
}

impl From<rmacomm_collectives::Error> for Failure {
    fn from(e: rmacomm_collectives::Error) -> Self {
        use rmacomm_collectives::Error as C;
        let kind = match &e {
            C::InvalidArgument { .. } | C::Kernel { .. } => ErrKind::Argument,
            C::Mismatch { .. } => ErrKind::Mismatch,
            C::Timeout { .. } | C::Pending { .. } => ErrKind::Timeout,
            C::Unavailable { .. } => ErrKind::Unavailable,
            C::Window { source, .. } => window_kind(source),
            _ => ErrKind::Comm,
        };
        Failure { kind, msg: e.to_string() }
    }
}

impl From<rmacomm_agent::AgentError> for Failure {
    fn from(e: rmacomm_agent::AgentError) -> Self {
        use rmacomm_agent::AgentError as A;
        let kind = match &e {
            A::InvalidArgument { .. }
            | A::UnknownPeer { .. }
            | A::UnknownRegion { .. }
            | A::OutOfBounds { .. }
            | A::BadMetadata { .. } => ErrKind::Argument,
            A::Unreachable { .. } | A::PeerLost { .. } | A::Refused { .. } | A::PeerRemoved { .. } => ErrKind::Peer,
            A::Timeout { .. } => ErrKind::Timeout,
            A::Transport { source, .. } | A::Device(source) => transport_kind(source),
            A::Store(source) => window_kind(source),
            _ => ErrKind::Comm,
        };
        Failure { kind, msg: e.to_string() }
    }
}

/// Converts an error of the Rust crates straight into a Python exception.
pub(crate) fn py_err(e: impl Into<Failure>) -> PyErr {
    e.into().into()
}
