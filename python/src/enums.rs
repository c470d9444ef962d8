//! The small enums of the window API: `WinAccessType` (and the
//! `WindowAttr` that carries it), `SignalOp`, `SignalCmpOp`.

use pyo3::prelude::*;
use rmacomm_window::{AccessType, Cmp};

/// How this rank reaches a peer's registered buffer (torchcomms'
/// `TorchCommWinAccessType`): `UNIFIED` — mapped here (same host), loads and
/// stores reach it and `map_remote_tensor` works; `SEPARATE` — only through
/// the transport (`put` / `get`).
#[pyclass(eq, eq_int, hash, frozen, module = "rmacomm", name = "WinAccessType")]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum WinAccessType {
    #[pyo3(name = "UNIFIED")]
    Unified,
    #[pyo3(name = "SEPARATE")]
    Separate,
}

impl From<AccessType> for WinAccessType {
    fn from(a: AccessType) -> Self {
        match a {
            AccessType::Unified => WinAccessType::Unified,
            _ => WinAccessType::Separate,
        }
    }
}

/// What `win.get_attr(peer_rank)` returns.
#[pyclass(frozen, module = "rmacomm", name = "WindowAttr")]
pub(crate) struct PyWindowAttr {
    /// How this rank reaches the peer's buffer.
    #[pyo3(get)]
    pub(crate) access_type: WinAccessType,
}

#[pymethods]
impl PyWindowAttr {
    fn __repr__(&self) -> String {
        format!(
            "WindowAttr(access_type=WinAccessType.{})",
            if self.access_type == WinAccessType::Unified { "UNIFIED" } else { "SEPARATE" }
        )
    }
}

/// What a ctran-form value signal does to the destination's slot: `SET`
/// stores the value, `ADD` adds it (atomically, wrapping).
#[pyclass(eq, eq_int, hash, frozen, from_py_object, module = "rmacomm", name = "SignalOp")]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum SignalOp {
    #[pyo3(name = "SET")]
    Set,
    #[pyo3(name = "ADD")]
    Add,
}

impl From<SignalOp> for rmacomm_window::SignalOp {
    fn from(o: SignalOp) -> Self {
        match o {
            SignalOp::Set => rmacomm_window::SignalOp::Set,
            SignalOp::Add => rmacomm_window::SignalOp::Add,
        }
    }
}

/// How a ctran-form `wait_signal` compares its slot with the value
/// (NVSHMEM's comparisons): slot `==`, `!=`, `>=`, `>`, `<=`, `<` value.
#[pyclass(eq, eq_int, hash, frozen, from_py_object, module = "rmacomm", name = "SignalCmpOp")]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum SignalCmpOp {
    #[pyo3(name = "EQ")]
    Eq,
    #[pyo3(name = "NE")]
    Ne,
    #[pyo3(name = "GE")]
    Ge,
    #[pyo3(name = "GT")]
    Gt,
    #[pyo3(name = "LE")]
    Le,
    #[pyo3(name = "LT")]
    Lt,
}

impl From<SignalCmpOp> for Cmp {
    fn from(c: SignalCmpOp) -> Self {
        match c {
            SignalCmpOp::Eq => Cmp::Eq,
            SignalCmpOp::Ne => Cmp::Ne,
            SignalCmpOp::Ge => Cmp::Ge,
            SignalCmpOp::Gt => Cmp::Gt,
            SignalCmpOp::Le => Cmp::Le,
            SignalCmpOp::Lt => Cmp::Lt,
        }
    }
}
