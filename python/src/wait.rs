//! Blocking waits that release the GIL and stay interruptible: the wait
//! runs in slices of at most [`SLICE`], and between slices the thread takes
//! the GIL back to run Python's signal handlers (`Ctrl-C` raises
//! `KeyboardInterrupt` within a slice).

use std::time::{Duration, Instant};

use pyo3::prelude::*;

/// The longest stretch a wait runs without looking at signals.
pub(crate) const SLICE: Duration = Duration::from_millis(100);

/// Calls `step(slice)` with the GIL released until it returns `Some`, or
/// until `deadline` (`None`: no deadline of its own) has passed; `Ok(None)`
/// then. `step` must return within about `slice`.
pub(crate) fn sliced<T: Send>(
    py: Python<'_>,
    deadline: Option<Instant>,
    mut step: impl FnMut(Duration) -> Option<T> + Send,
) -> PyResult<Option<T>> {
    loop {
        let slice = match deadline {
            Some(d) => d.saturating_duration_since(Instant::now()).min(SLICE),
            None => SLICE,
        };
        if let Some(v) = py.detach(|| step(slice)) {
            return Ok(Some(v));
        }
        py.check_signals()?;
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Ok(None);
        }
    }
}

/// Aborts `task` when the asyncio future `fut` is cancelled
/// (`asyncio.wait_for`'s timeout): the wait it serves ends then, instead of
/// going on to take what the next wait should get.
pub(crate) fn abort_on_cancel(py: Python<'_>, fut: &Bound<'_, PyAny>, task: tokio::task::AbortHandle) -> PyResult<()> {
    use pyo3::intern;
    use pyo3::types::{PyCFunction, PyDict, PyTuple};
    let on_done = PyCFunction::new_closure(
        py,
        None,
        None,
        move |args: &Bound<'_, PyTuple>, _: Option<&Bound<'_, PyDict>>| -> PyResult<()> {
            let py = args.py();
            if args.get_item(0)?.call_method0(intern!(py, "cancelled"))?.is_truthy()? {
                task.abort();
            }
            Ok(())
        },
    )?;
    fut.call_method1(intern!(py, "add_done_callback"), (on_done,))?;
    Ok(())
}
