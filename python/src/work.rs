//! `Work`: the handle every operation returns (torchcomms' `TorchWork`).
//!
//! One type for every source of completion: an operation that finished in
//! the call, an async collective on the communicator's worker, a pending
//! window operation (the window's own `Work`, owned here: see
//! [`window_core`](crate::window_core)), or an async `wait_signal`, which
//! takes its signal when the handle is waited for or polled.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use pyo3::prelude::*;
use rmacomm_window::Cmp;

use crate::errors::{ErrKind, Failure};
use crate::timeout;
use crate::wait;
use crate::window_core::{WinCore, WinPending};
use crate::worker::Completion;

/// Where a `Work`'s result comes from.
pub(crate) enum State {
    Done(Result<(), Failure>),
    Coll(Arc<Completion>),
    Win(WinPending),
    /// torchcomms form: the next signal from `peer`, within `timeout`
    /// (`None`: the window's) of the first wait on the handle or poll of
    /// it (`end`, fixed then: `Some(None)` when past the clock's range).
    WaitSignal {
        core: Arc<WinCore>,
        peer: usize,
        timeout: Option<Duration>,
        end: Option<Option<Instant>>,
    },
    /// ctran form: slot `disp` compares to `value` as `cmp` says (the
    /// timeout as in `WaitSignal`).
    WaitValue {
        core: Arc<WinCore>,
        disp: usize,
        value: u64,
        cmp: Cmp,
        timeout: Option<Duration>,
        end: Option<Option<Instant>>,
    },
}

/// A `Work`'s shared state (the window keeps a weak reference to pending
/// ones, to finish them before a registration changes).
pub(crate) struct WorkCell {
    state: Mutex<State>,
}

impl WorkCell {
    pub(crate) fn new(state: State) -> Arc<WorkCell> {
        Arc::new(WorkCell { state: Mutex::new(state) })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether the operation has finished, without blocking (`false` while
    /// another thread is waiting for it).
    pub(crate) fn poll(&self) -> bool {
        let Ok(mut st) = self.state.try_lock() else { return false };
        let done = match &mut *st {
            State::Done(_) => return true,
            State::Coll(c) => c.try_get(),
            State::Win(p) => p.is_completed().then(|| p.result()),
            State::WaitSignal { core, peer, timeout, end } => {
                let (end, total) = fixed_end(end, *timeout, core, Instant::now());
                core.try_wait_signal(*peer, end, total)
            }
            State::WaitValue { core, disp, value, cmp, timeout, end } => {
                let (end, total) = fixed_end(end, *timeout, core, Instant::now());
                core.try_wait_value(*disp, *value, *cmp, end, total)
            }
        };
        match done {
            Some(r) => {
                *st = State::Done(r);
                true
            }
            None => false,
        }
    }

    /// Waits (the GIL released, interruptible) at most `limit` (`None`: no
    /// limit of its own; the operation's timeout still applies) and
    /// returns the result; a `TimeoutError` if `limit` passed first (the
    /// operation stays pending).
    pub(crate) fn wait(&self, py: Python<'_>, limit: Option<Duration>) -> PyResult<()> {
        match self.wait_within(py, limit)? {
            Some(r) => r.map_err(PyErr::from),
            None => {
                // Which operation (a window's put/get/signal names its peer).
                let what = match &*self.lock() {
                    State::Win(p) => format!(" of {}", p.describe()),
                    State::WaitSignal { peer, .. } => format!(" of wait_signal from rank {peer}"),
                    State::WaitValue { disp, .. } => format!(" of wait_signal on slot {disp}"),
                    State::Done(_) | State::Coll(_) => String::new(),
                };
                Err(Failure::new(
                    ErrKind::Timeout,
                    format!(
                        "Work.wait{what}: not complete after {:?} (the timeout of this wait); the operation is still \
                         pending, wait again or raise the timeout",
                        limit.unwrap_or_default()
                    ),
                )
                .into())
            }
        }
    }

    /// [`wait`](Self::wait), with `None` when `limit` passed first, for
    /// callers that name the operation in their own timeout error.
    pub(crate) fn wait_within(&self, py: Python<'_>, limit: Option<Duration>) -> PyResult<Option<Result<(), Failure>>> {
        let start = Instant::now();
        // A limit past what the clock can add (timeout=sys.maxsize, a
        // common "forever") is no limit: `Instant + Duration` panics there.
        let deadline = limit.and_then(|l| start.checked_add(l));
        wait::sliced(py, deadline, |slice| {
            let mut st = self.lock();
            let done = match &mut *st {
                State::Done(r) => return Some(r.clone()),
                State::Coll(c) => c.wait_for(slice),
                State::Win(p) => p.wait_slice(slice),
                // A lazy signal wait's deadline is fixed at its first wait or
                // poll (kept in the state: a later wait does not restart it).
                State::WaitSignal { core, peer, timeout, end } => {
                    let (end, total) = fixed_end(end, *timeout, core, start);
                    core.wait_signal_slice(*peer, slice, end, total)
                }
                State::WaitValue { core, disp, value, cmp, timeout, end } => {
                    let (end, total) = fixed_end(end, *timeout, core, start);
                    core.wait_value_slice(*disp, *value, *cmp, slice, end, total)
                }
            };
            let r = done?;
            *st = State::Done(r.clone());
            Some(r)
        })
    }
}

/// A lazy signal wait's deadline and timeout (`timeout`, else the
/// window's): `end` as fixed by its first wait or poll, else fixed now, at
/// `from` (`None` inside: a timeout past the clock's range, no deadline).
fn fixed_end(
    end: &mut Option<Option<Instant>>,
    timeout: Option<Duration>,
    core: &WinCore,
    from: Instant,
) -> (Option<Instant>, Duration) {
    let total = timeout.unwrap_or(core.timeout);
    (*end.get_or_insert_with(|| from.checked_add(total)), total)
}

/// The handle of an operation (torchcomms' `TorchWork`): `is_completed()`
/// asks without blocking, `wait()` blocks until it is done and raises its
/// error. Synchronous operations return one that is already complete.
#[pyclass(frozen, name = "Work", module = "rmacomm")]
pub(crate) struct PyWork {
    pub(crate) cell: Arc<WorkCell>,
}

impl PyWork {
    pub(crate) fn done() -> PyWork {
        PyWork { cell: WorkCell::new(State::Done(Ok(()))) }
    }

    pub(crate) fn of(state: State) -> PyWork {
        PyWork { cell: WorkCell::new(state) }
    }
}

#[pymethods]
impl PyWork {
    /// True once the operation has finished (successfully or not); never
    /// blocks.
    fn is_completed(&self) -> bool {
        self.cell.poll()
    }

    /// Blocks until the operation has finished (releasing the GIL; Ctrl-C
    /// interrupts it) and raises its error if it failed. `timeout`
    /// (timedelta or seconds) bounds this wait only: when it passes,
    /// `rmacomm.TimeoutError` is raised and the operation stays pending.
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        let limit = timeout::duration(timeout, "timeout")?;
        self.cell.wait(py, limit)
    }

    fn __repr__(&self) -> String {
        format!("<rmacomm.Work completed={}>", self.cell.poll())
    }
}
