//! `AgentTransfer`: the Python handle of one request of a
//! `TransferAgent`, and the task that drives the request.
//!
//! # Why a task drives every request
//!
//! The Rust `Transfer` moves on only when polled (it connects, posts, and
//! hands its notification over once a poll sees every piece placed). A
//! Python program may poll (`status()`, NIXL's `check_xfer_state` loop),
//! wait, await, or drop the handle and only wait for the peer's reply; so
//! the request is handed to a task on the module's runtime that polls it
//! to the end, and the handle reads the outcome from a `watch` channel.
//! The cost is one task spawn per request and the runtime thread's
//! wake-up, small beside a request's round trips.
//!
//! # The task owns what the request uses
//!
//! Requests are made of `OwnedBlock`s (the registrations' memory is in an
//! `Arc`), so a request is a `Transfer<'static>` that holds its memory
//! until its pieces are done; the task also keeps the registrations
//! themselves ([`Owned`]) until the request ends.

use std::sync::Arc;
use std::time::{Duration, Instant};

use pyo3::intern;
use pyo3::prelude::*;
use rmacomm_agent::{AgentError, Transfer};
use tokio::sync::watch;

use crate::errors::{ErrKind, Failure};
use crate::memory::Registered;
use crate::runtime::rt;
use crate::timeout;
use crate::transport::spawn;
use crate::wait;

/// A request with the registrations its pieces use.
struct Owned {
    transfer: Transfer<'static>,
    _regs: Vec<Arc<Registered>>,
}

/// `None` while the request runs.
type Outcome = Option<Result<(), Failure>>;

/// An agent error of request `op` ("WRITE", "READ", "notify") as a
/// Python-bound failure whose message names the operation (the agent's
/// message names the peer).
pub(crate) fn failure(op: &str, peer: &str, e: AgentError) -> Failure {
    let named = e.peer().is_some();
    let mut f = Failure::from(e);
    // The agent's argument errors say "with peer …" themselves.
    let named = named || f.msg.contains(&format!("with peer {peer:?}"));
    f.msg = if named { format!("{op}: {}", f.msg) } else { format!("{op} with peer {peer:?}: {}", f.msg) };
    f
}

/// One request of a `TransferAgent` (from `transfer` or `notify`). It runs
/// on its own: `status()` only looks, and dropping the handle cancels
/// nothing (the pieces land and the notification is sent).
///
/// `status()` is "PROC" while it runs, "DONE" once every piece is placed
/// and the notification (if any) is in the peer's ring, "ERR" if it
/// failed (`wait()` or `error()` gives the exception, which names the
/// peer). `await handle` works inside asyncio.
#[pyclass(frozen, module = "rmacomm", name = "AgentTransfer")]
pub(crate) struct PyAgentTransfer {
    rx: watch::Receiver<Outcome>,
    peer: String,
    op: &'static str,
    ops: usize,
}

impl PyAgentTransfer {
    /// Hands `transfer` to a task on the runtime, which keeps `regs` (the
    /// registrations its pieces use) until it ends.
    pub(crate) fn drive(transfer: Transfer<'static>, regs: Vec<Arc<Registered>>, op: &'static str) -> Self {
        let (peer, ops) = (transfer.peer().to_owned(), transfer.ops());
        let (tx, rx) = watch::channel(None);
        let mut owned = Owned { transfer, _regs: regs };
        let p = peer.clone();
        rt().spawn(async move {
            let r = (&mut owned.transfer).await;
            drop(owned);
            let _ = tx.send(Some(r.map_err(|e| failure(op, &p, e))));
        });
        PyAgentTransfer { rx, peer, op, ops }
    }

    fn outcome(&self) -> Outcome {
        self.rx.borrow().clone()
    }
}

/// Waits for the outcome of `rx` (the task always sends one; a runtime
/// that shut down is reported as an error).
async fn finished(mut rx: watch::Receiver<Outcome>) -> Result<(), Failure> {
    match rx.wait_for(Option::is_some).await {
        Ok(v) => v.clone().expect("waited for Some"),
        Err(_) => Err(Failure::new(ErrKind::Comm, "the transfer's task ended without a result (runtime shut down)")),
    }
}

#[pymethods]
impl PyAgentTransfer {
    /// "PROC", "DONE" or "ERR" (NIXL's states), without waiting.
    fn status(&self) -> &'static str {
        match self.outcome() {
            None => "PROC",
            Some(Ok(())) => "DONE",
            Some(Err(_)) => "ERR",
        }
    }

    /// Whether the request has ended (done or failed).
    fn done(&self) -> bool {
        self.outcome().is_some()
    }

    /// The exception the request failed with, else None.
    fn error(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        match self.outcome() {
            Some(Err(f)) => Some(PyErr::from(f).into_value(py).into_any()),
            _ => None,
        }
    }

    /// Waits until the request ends (the GIL released, Ctrl-C
    /// interrupts), for at most `timeout` (timedelta or seconds; default:
    /// no limit of its own, the agent's `timeout` bounds every piece).
    /// Raises the request's error, which names the peer; a
    /// `TimeoutError` if `timeout` passed first (the request goes on).
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        let limit = timeout::duration(timeout, "timeout")?;
        // Past the clock's range (timeout=sys.maxsize): no deadline, not a panic.
        let deadline = limit.and_then(|t| Instant::now().checked_add(t));
        let rx = self.rx.clone();
        let r = wait::sliced(py, deadline, |slice: Duration| {
            rt().block_on(async { tokio::time::timeout(slice, finished(rx.clone())).await.ok() })
        })?;
        match r {
            Some(r) => r.map_err(PyErr::from),
            None => Err(Failure::new(
                ErrKind::Timeout,
                format!(
                    "AgentTransfer.wait: the {} with peer {:?} is not done after {:?} (the timeout of this wait); it \
                     goes on",
                    self.op,
                    self.peer,
                    limit.unwrap_or_default()
                ),
            )
            .into()),
        }
    }

    /// `await handle`: the asyncio form of `wait()` (completed from the
    /// runtime through `loop.call_soon_threadsafe`; no thread waits).
    fn __await__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let fut = spawn(py, finished(self.rx.clone()))?;
        fut.call_method0(intern!(py, "__await__"))
    }

    /// The peer's name.
    #[getter]
    fn peer(&self) -> &str {
        &self.peer
    }

    /// "WRITE", "READ" or "NOTIFY".
    #[getter]
    fn op(&self) -> &'static str {
        self.op
    }

    /// Writes or reads posted: the pieces after coalescing (pieces
    /// adjacent on both sides count once).
    #[getter]
    fn ops(&self) -> usize {
        self.ops
    }

    fn __repr__(&self) -> String {
        format!("<rmacomm.AgentTransfer {} with {:?}, {} ops: {}>", self.op, self.peer, self.ops, self.status())
    }
}
