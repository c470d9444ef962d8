//! rmacomm Python bindings (pyo3): the extension module `rmacomm._rmacomm`
//! behind the `rmacomm` package — torchcomms' communicator (`new_comm`,
//! every collective), its one-sided windows in both forms, and the RDMA
//! transport, on numpy arrays and CPU torch tensors, zero-copy.
//!
//! The Python-facing documentation is `docs/python.md`, the package's
//! docstrings and `rmacomm/_rmacomm.pyi`; this file says how the Rust side
//! is organised and which promises it relies on.
//!
//! # Organization
//!
//! - Values that cross the boundary: `tensor` (what a numpy array or torch
//!   tensor is: pointer, bytes, element type, shape; the buffer protocol by
//!   hand in `buffer`), `elem` (element types and their numpy / torch /
//!   reduction names), `timeout` (timedelta or seconds), `errors` (one
//!   exception type per error category).
//! - Memory: `memory` (registrations of Python memory and of rmacomm's own
//!   shared-memory allocations, and the table that finds the registration
//!   an address lies in), `array` (numpy arrays and torch tensors over
//!   memory this module owns), `mapping` (a private mapping of a peer's
//!   mapped window memory, so that arrays never outlive what they alias).
//! - Blocking: `wait` (waits in slices with the GIL released, checking
//!   for Ctrl-C between them), `work` (the `Work` handle), `worker`
//!   (the thread that runs a communicator's async collectives).
//! - The API: `comm` and `collectives` (`new_comm`, `Comm`, batches),
//!   `reduce_op` and `enums`, `window_core` (what both window forms
//!   share, and the owning design of their pending operations), `window`
//!   (torchcomms' form) and `ctran_window` (ctran's form), `store` (a
//!   Python object as the bootstrap store; `TcpStore`), `transport`
//!   (`RdmaTransport`, `RdmaMemory`, views, remote buffers; blocking and
//!   asyncio forms) and its tokio runtime in `runtime`, `agent`
//!   (`TransferAgent`: the transfer agent of `rmacomm-agent`) and
//!   `agent_transfer` (a request's handle, and the task that drives it).
//!
//! # Thread safety
//!
//! Every class is `Send + Sync` (pyo3 requires it) and usable from several
//! Python threads. Every call that may wait releases the GIL; locks of this
//! crate are only taken with the GIL released or with `try_lock`, so that a
//! thread holding one never waits for the GIL while another thread holding
//! the GIL waits for the lock (a store implemented in Python needs the GIL
//! inside collective bootstrap calls).
//!
//! # Unsafe code
//!
//! This crate is FFI: it reads Python memory through raw pointers, hands
//! it to the transport (registrations), makes slices of it for the
//! communicator's byte-slice API, and maps peers' memory. Each `unsafe`
//! block says why it holds; the rules Python callers must follow (do not
//! resize or free a tensor an operation is using; do not touch a buffer
//! while an async operation on it is pending) are the same as torch's, and
//! `docs/python.md` states them.

mod agent;
mod agent_transfer;
mod array;
mod buffer;
mod collectives;
mod comm;
mod ctran_window;
mod cuda_tensor;
mod elem;
mod enums;
mod errors;
mod mapping;
mod memory;
mod nccl_backend;
mod reduce_op;
mod runtime;
mod store;
mod tensor;
mod timeout;
mod transport;
mod wait;
mod window;
mod window_core;
mod window_cuda;
mod work;
mod worker;

use pyo3::prelude::*;

/// The extension module; `rmacomm/__init__.py` re-exports it.
#[pymodule]
fn _rmacomm(m: &Bound<'_, PyModule>) -> PyResult<()> {
    errors::register(m)?;
    m.add_class::<comm::PyComm>()?;
    m.add_class::<collectives::PyBatch>()?;
    m.add_class::<work::PyWork>()?;
    m.add_class::<reduce_op::PyReduceOp>()?;
    m.add_class::<enums::WinAccessType>()?;
    m.add_class::<enums::SignalOp>()?;
    m.add_class::<enums::SignalCmpOp>()?;
    m.add_class::<enums::PyWindowAttr>()?;
    m.add_class::<window::PyWindow>()?;
    m.add_class::<ctran_window::PyCtranWindow>()?;
    m.add_class::<array::PyMemoryHolder>()?;
    m.add_class::<store::PyTcpStore>()?;
    m.add_class::<transport::PyRdmaTransport>()?;
    m.add_class::<transport::PyRdmaMemory>()?;
    m.add_class::<transport::PyView>()?;
    m.add_class::<transport::PyRemoteBuffer>()?;
    m.add_class::<agent::PyTransferAgent>()?;
    m.add_class::<agent_transfer::PyAgentTransfer>()?;
    m.add_function(wrap_pyfunction!(comm::new_comm, m)?)?;
    m.add_function(wrap_pyfunction!(array::empty, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
