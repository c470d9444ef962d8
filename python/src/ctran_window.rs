//! `CtranWindow`: the ctran form of the window (`comm.window_allocate`): a
//! window that owns `window_size` bytes of shared memory on every rank and
//! an array of 64-bit value-signal slots; puts at byte displacements,
//! value signals (SET / ADD) and waits with a comparison, `get_tensor`.

use std::collections::HashMap;
use std::sync::Arc;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use rmacomm_transport::RdmaMemory;
use rmacomm_window::{Window, WindowOptions};

use crate::array::{self, Keep};
use crate::comm::CommShared;
use crate::enums::{PyWindowAttr, SignalCmpOp, SignalOp};
use crate::errors::{py_err, ErrKind, Failure};
use crate::memory::{Borrowed, Owner, Registered};
use crate::tensor::{Kind, Tensor};
use crate::timeout;
use crate::window_core::{sync_bound, WinCore};
use crate::work::{PyWork, State};

/// A window of the ctran form (torchcomms' ncclx `TorchCommWindow` from
/// `window_allocate`), made by `comm.window_allocate(window_size)`.
///
/// Every rank owns `window_size` bytes (zeroed shared memory) and
/// `signal_size` value-signal slots. A rank puts bytes into a peer's buffer
/// at a byte displacement, then sets or adds to one of the peer's slots;
/// the peer waits until its slot compares to a value.
#[pyclass(frozen, module = "rmacomm", name = "CtranWindow")]
pub(crate) struct PyCtranWindow {
    core: Arc<WinCore>,
    /// This rank's buffer (also registered, once more, by the window).
    own: Arc<Registered>,
    size: usize,
}

impl PyCtranWindow {
    pub(crate) fn create(
        py: Python<'_>,
        s: &Arc<CommShared>,
        window_size: usize,
        signal_size: usize,
        unified: bool,
    ) -> PyResult<PyCtranWindow> {
        let timeout = s.timeout;
        let (win, meta, own) = py
            .detach(move || -> Result<_, Failure> {
                let opts = WindowOptions::new().timeout(timeout).signal_slots(signal_size).unified(unified);
                let mut win = Window::new(&s.meta, opts)?;
                // Allocated after the window: a rank that cannot have its
                // buffer still takes part in the registration, so that its
                // peers hear why at once rather than wait for it.
                let own = Registered::alloc(window_size);
                let mem = own.as_ref().map_err(|e| e.clone()).and_then(|keep| {
                    let (ptr, len) = (keep.mem.as_ptr(), window_size.max(1));
                    // SAFETY: the allocation is `len` bytes or more at a
                    // fixed address, kept by the registration's owner.
                    let b = unsafe { Borrowed::new(ptr, len, Owner::Mem(keep.clone())) };
                    RdmaMemory::register(b)
                });
                let why = |source| rmacomm_window::Error::Transport { op: "window_allocate", source };
                win.register_buffer(mem.map_err(why), window_size)?;
                let all: Vec<usize> = (0..s.size).collect();
                let own = own.expect("its failure failed the registration");
                Ok((win, s.meta.split(&all)?.expect("every rank is listed"), own))
            })
            .map_err(PyErr::from)?;
        Ok(PyCtranWindow { core: WinCore::new(win, meta, timeout), own, size: window_size })
    }
}

#[pymethods]
impl PyCtranWindow {
    /// Writes `tensor` into `dst_rank`'s buffer at byte `target_disp`.
    /// Without `async_op` it returns once the data is placed, or raises
    /// `TimeoutError` when `timeout` passes first (the put goes on).
    #[pyo3(signature = (tensor, dst_rank, target_disp, async_op=false, hints=None, timeout=None))]
    #[allow(clippy::too_many_arguments)]
    fn put(
        &self,
        py: Python<'_>,
        tensor: &Bound<'_, PyAny>,
        dst_rank: usize,
        target_disp: usize,
        async_op: bool,
        hints: Option<HashMap<String, String>>,
        timeout: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyWork> {
        let _ = hints;
        let bound = sync_bound(timeout, async_op, self.core.timeout)?;
        let t = Tensor::new(tensor, "tensor", false)?;
        let sliced = !async_op && bound.is_none();
        let st = self.core.put(py, &t, dst_rank, target_disp, async_op, bound.is_some(), sliced)?;
        self.core.finish(py, st, bound, "put", dst_rank, sliced)
    }

    /// Reads `src_rank`'s buffer at byte `source_disp` into `tensor`.
    /// Without `async_op`, `timeout` bounds how long this waits
    /// (`TimeoutError`; the get goes on and may still write `tensor`).
    #[pyo3(signature = (tensor, src_rank, source_disp, async_op=false, hints=None, timeout=None))]
    #[allow(clippy::too_many_arguments)]
    fn get(
        &self,
        py: Python<'_>,
        tensor: &Bound<'_, PyAny>,
        src_rank: usize,
        source_disp: usize,
        async_op: bool,
        hints: Option<HashMap<String, String>>,
        timeout: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyWork> {
        let _ = hints;
        let bound = sync_bound(timeout, async_op, self.core.timeout)?;
        let t = Tensor::new(tensor, "tensor", true)?;
        let sliced = !async_op && bound.is_none();
        let st = self.core.get(py, &t, src_rank, source_disp, async_op, bound.is_some(), sliced)?;
        self.core.finish(py, st, bound, "get", src_rank, sliced)
    }

    /// Sets (`op=SignalOp.SET`) or adds to (`SignalOp.ADD`) `dst_rank`'s
    /// value slot `signal_disp`, once every put this rank issued to
    /// `dst_rank` before it is placed. Without `async_op`, `timeout`
    /// bounds how long this waits for it (`TimeoutError`; it goes on).
    #[pyo3(signature = (signal_disp, signal_val, dst_rank, async_op=false, op=SignalOp::Set, hints=None, timeout=None))]
    #[allow(clippy::too_many_arguments)]
    fn signal(
        &self,
        py: Python<'_>,
        signal_disp: usize,
        signal_val: u64,
        dst_rank: usize,
        async_op: bool,
        op: SignalOp,
        hints: Option<HashMap<String, String>>,
        timeout: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyWork> {
        let _ = hints;
        let bound = sync_bound(timeout, async_op, self.core.timeout)?;
        // Issued async when this call bounds its wait, or when it would
        // wait for a peer it does not map (`finish` waits in slices).
        let sliced = !async_op && bound.is_none();
        let issue_async = async_op || bound.is_some() || !self.core.unified(py, dst_rank);
        let core = self.core.clone();
        let st = self
            .core
            .with(py, false, move |w| {
                w.signal_value(signal_disp, signal_val, dst_rank, op.into(), issue_async)
                    .map(|work| core.settle(work, None))
            })
            .map_err(py_err)?;
        self.core.finish(py, st, bound, "signal", dst_rank, sliced)
    }

    /// Waits until this rank's slot `signal_disp` compares to `signal_val`
    /// as `cmp_op` says (default `SignalCmpOp.GE`), for at most `timeout`
    /// (default: the communicator's). What the signalling ranks put before
    /// their signals is visible then. With `async_op`, returns a Work that
    /// waits when waited for (or polled).
    #[pyo3(signature = (signal_disp, signal_val, cmp_op=SignalCmpOp::Ge, async_op=false, hints=None, timeout=None))]
    #[allow(clippy::too_many_arguments)]
    fn wait_signal(
        &self,
        py: Python<'_>,
        signal_disp: usize,
        signal_val: u64,
        cmp_op: SignalCmpOp,
        async_op: bool,
        hints: Option<HashMap<String, String>>,
        timeout: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyWork> {
        let _ = hints;
        let slots = self.core.with(py, false, |w| w.signal_slots());
        if signal_disp >= slots {
            return Err(Failure::new(
                ErrKind::Argument,
                format!("wait_signal: signal slot {signal_disp} of a window with {slots} value-signal slots"),
            )
            .into());
        }
        let timeout = timeout::duration(timeout, "timeout")?;
        let w = PyWork::of(State::WaitValue {
            core: self.core.clone(),
            disp: signal_disp,
            value: signal_val,
            cmp: cmp_op.into(),
            timeout,
            end: None,
        });
        if async_op {
            return Ok(w);
        }
        w.cell.wait(py, None)?;
        Ok(w)
    }

    /// The current value of this rank's slot `signal_disp`.
    fn read_signal(&self, py: Python<'_>, signal_disp: usize) -> PyResult<u64> {
        self.core.with(py, false, |w| w.read_signal(signal_disp)).map_err(py_err)
    }

    /// Sets this rank's own slot `signal_disp` (e.g. back to 0 between
    /// phases); nobody is signalled.
    #[pyo3(signature = (signal_disp, value=0))]
    fn reset_signal(&self, py: Python<'_>, signal_disp: usize, value: u64) -> PyResult<()> {
        self.core.with(py, false, |w| w.reset_signal(signal_disp, value)).map_err(py_err)
    }

    /// A view of `rank`'s buffer, zero-copy: `sizes` elements of `dtype`
    /// starting at element `offset` (of `dtype`). This rank's own buffer,
    /// or a same-host peer's mapped here (else `UnavailableError`). A torch
    /// dtype gives a torch tensor, anything else a numpy array.
    #[pyo3(signature = (rank, sizes, dtype=None, offset=0))]
    fn get_tensor<'py>(
        &self,
        py: Python<'py>,
        rank: usize,
        sizes: &Bound<'py, PyAny>,
        dtype: Option<&Bound<'py, PyAny>>,
        offset: usize,
    ) -> PyResult<Bound<'py, PyAny>> {
        let shape = array::parse_shape(sizes)?;
        let (e, kind) = match dtype.filter(|d| !d.is_none()) {
            Some(d) => array::parse_dtype(d)?,
            None => (crate::elem::by_name("uint8").expect("in the table"), None),
        };
        let kind = kind.unwrap_or(Kind::Numpy);
        // Checked: a size or offset that wrapped would pass the bounds
        // checks below (and the window's) and make a view outside the
        // buffer.
        let (len, start) = match (array::nbytes(&shape, e), offset.checked_mul(e.size)) {
            (Some(len), Some(start)) if start.checked_add(len).is_some() => (len, start),
            _ => {
                return Err(PyValueError::new_err(format!(
                    "get_tensor: {shape:?} elements of {} at element {offset} of rank {rank}'s buffer: the byte range \
                     is past 2**64; the buffer has {} bytes",
                    e.name, self.size
                )))
            }
        };
        if rank == self.core.rank {
            if start + len > self.size {
                return Err(PyValueError::new_err(format!(
                    "get_tensor: {len} bytes at byte {start} end past this rank's buffer of {} bytes",
                    self.size
                )));
            }
            let ptr = self.own.mem.as_ptr().wrapping_add(start);
            return array::make(py, ptr, shape, e, kind, Keep::Alloc(self.own.clone()));
        }
        let (map, ptr) = self.core.dup(
            py,
            &format!("get_tensor of rank {rank}"),
            move |w| w.get_tensor(rank, start, len).map(|m| (m.as_ptr() as usize, m.len())),
            len,
        )?;
        array::make(py, ptr, shape, e, kind, Keep::Peer(map))
    }

    /// How this rank reaches `peer_rank`'s buffer
    /// (`WinAccessType.UNIFIED`: mapped here).
    fn get_attr(&self, py: Python<'_>, peer_rank: usize) -> PyResult<PyWindowAttr> {
        let a = self.core.with(py, false, |w| w.get_attr(peer_rank)).map_err(py_err)?;
        Ok(PyWindowAttr { access_type: a.access_type.into() })
    }

    /// Bytes of this rank's buffer (`window_size`).
    fn get_size(&self) -> usize {
        self.size
    }

    /// "cpu".
    fn get_device(&self) -> &'static str {
        "cpu"
    }

    fn __repr__(&self) -> String {
        format!("<rmacomm.CtranWindow rank {} of {}, {} bytes>", self.core.rank, self.core.size, self.size)
    }
}
