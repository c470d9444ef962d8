//! `Window`: torchcomms' one-sided window (`comm.new_window()`): register a
//! tensor, put into peers' tensors at element offsets, signal, wait for
//! signals, get, map a same-host peer's tensor.

use std::collections::HashMap;
use std::sync::Arc;

use pyo3::prelude::*;
use rmacomm_window::{Window, WindowOptions};

use crate::comm::CommShared;
use crate::cuda_tensor;
use crate::enums::PyWindowAttr;
use crate::errors::py_err;
use crate::tensor::Tensor;
use crate::timeout;
use crate::window_core::{sync_bound, WinCore};
use crate::work::{PyWork, State};

/// A one-sided window over a communicator's ranks (torchcomms'
/// `TorchCommWindow`), made by `comm.new_window()`.
///
/// Every rank registers a tensor (`tensor_register`, collective); then any
/// rank puts into any rank's tensor, signals it, and the target waits for
/// the signal, after which the data is in its tensor. Same-host peers are
/// UNIFIED: their tensors are mapped here (`map_remote_tensor`) and puts
/// are copies by the calling thread.
#[pyclass(frozen, module = "rmacomm", name = "Window")]
pub(crate) struct PyWindow {
    core: Arc<WinCore>,
}

impl PyWindow {
    pub(crate) fn create(
        py: Python<'_>,
        s: &Arc<CommShared>,
        tensor: Option<&Bound<'_, PyAny>>,
        unified: bool,
    ) -> PyResult<PyWindow> {
        let timeout = s.timeout;
        let (win, meta) = py
            .detach(|| {
                let win = Window::new(&s.meta, WindowOptions::new().timeout(timeout).unified(unified))?;
                let all: Vec<usize> = (0..s.size).collect();
                Ok::<_, rmacomm_window::Error>((win, s.meta.split(&all)?.expect("every rank is listed")))
            })
            .map_err(py_err)?;
        let w = PyWindow { core: WinCore::new(win, meta, timeout) };
        if let Some(t) = tensor.filter(|t| !t.is_none()) {
            w.tensor_register(py, t)?;
        }
        Ok(w)
    }
}

impl PyWindow {
    /// `stream=` belongs to windows of CUDA tensors, and so do operations
    /// without a CUDA tensor to a window of CUDA tensors.
    fn host_only(&self, op: &str, stream: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        if matches!(op, "put" | "get") && self.core.device().is_some() {
            return Err(crate::errors::Failure::new(
                crate::errors::ErrKind::Argument,
                format!("{op}: this window holds CUDA tensors; pass a CUDA tensor (host memory is not staged)"),
            )
            .into());
        }
        if stream.is_some_and(|s| !s.is_none()) {
            return Err(crate::errors::Failure::new(
                crate::errors::ErrKind::Argument,
                format!("{op}: stream= orders operations on CUDA tensors; this window holds host memory"),
            )
            .into());
        }
        Ok(())
    }
}

#[pymethods]
impl PyWindow {
    /// Registers `tensor` as this rank's window memory (collective: every
    /// rank calls it; sizes and dtypes may differ per rank). Same-host peers
    /// map it when it lives in shared memory (`comm.empty`); other memory is
    /// reached through the transport only. Do not resize the tensor while it
    /// is registered (torch's `resize_` may move its storage: peers would
    /// write the freed memory); `comm.empty` tensors cannot be resized.
    ///
    /// A CUDA torch tensor (every rank registers one): with every peer on
    /// this host (UNIFIED), peers map it through CUDA IPC, and puts, gets,
    /// signals and waits are queued on a CUDA stream (`stream=`, default
    /// torch's current stream). With a peer on another host (or
    /// `unified=False`) it is registered through the transport (staged
    /// through pinned host memory on the soft provider): puts, gets,
    /// signals and waits are still ordered on `stream` (the window's proxy
    /// thread runs each when the stream reaches it), and peers' tensors are
    /// not mapped.
    fn tensor_register(&self, py: Python<'_>, tensor: &Bound<'_, PyAny>) -> PyResult<()> {
        // A tensor refused here (read-only, not contiguous, no tensor):
        // this rank still takes its part, so that its peers hear why.
        let cuda = cuda_tensor::of(tensor, "tensor").map_err(|e| self.core.register_refused(py, e))?;
        if let Some(t) = cuda {
            return self.core.register_cuda(py, t);
        }
        let mut t = Tensor::new(tensor, "tensor", true).map_err(|e| self.core.register_refused(py, e))?;
        self.core.register(py, &mut t)
    }

    /// Ends the registration (collective): waits for this rank's pending
    /// operations, then for every rank.
    fn tensor_deregister(&self, py: Python<'_>) -> PyResult<()> {
        self.core.deregister(py)
    }

    /// Writes `tensor` into `dst_rank`'s tensor at element
    /// `target_offset_nelems` (of `dst_rank`'s dtype). Without `async_op`
    /// it returns once the data is placed, or raises `TimeoutError` when
    /// `timeout` passes first (the put goes on). Does not signal.
    ///
    /// A CUDA tensor (into a window of CUDA tensors) is copied device to
    /// device, queued on `stream` (default: torch's current stream); without
    /// `async_op` the stream is synchronized before this returns (`timeout`
    /// does not apply to CUDA tensors: the window's timeout bounds the
    /// stream's waits).
    #[pyo3(signature = (tensor, dst_rank, target_offset_nelems, async_op=false, hints=None, timeout=None, stream=None))]
    #[allow(clippy::too_many_arguments)]
    fn put(
        &self,
        py: Python<'_>,
        tensor: &Bound<'_, PyAny>,
        dst_rank: usize,
        target_offset_nelems: usize,
        async_op: bool,
        hints: Option<HashMap<String, String>>,
        timeout: Option<&Bound<'_, PyAny>>,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyWork> {
        let _ = hints;
        let bound = sync_bound(timeout, async_op, self.core.timeout)?;
        if let Some(t) = cuda_tensor::of(tensor, "tensor")? {
            self.core.same_dtype("put", dst_rank, t.elem)?;
            let st = self.core.put_cuda(py, &t, dst_rank, target_offset_nelems, async_op, stream)?;
            return Ok(self.core.handle(st));
        }
        self.host_only("put", stream)?;
        let t = Tensor::new(tensor, "tensor", false)?;
        self.core.same_dtype("put", dst_rank, t.elem)?;
        let sliced = !async_op && bound.is_none();
        let st = self.core.put(py, &t, dst_rank, target_offset_nelems, async_op, bound.is_some(), sliced)?;
        self.core.finish(py, st, bound, "put", dst_rank, sliced)
    }

    /// Signals `peer_rank`: satisfies one `wait_signal` for this rank
    /// there, once every put this rank issued to `peer_rank` before it is
    /// placed. Without `async_op`, `timeout` bounds how long this waits
    /// for the signal to be placed (`TimeoutError`; it goes on). On a
    /// window of CUDA tensors the signal is queued on `stream` (default:
    /// torch's current stream), after the puts queued there (`timeout`
    /// does not apply).
    #[pyo3(signature = (peer_rank, async_op=false, hints=None, timeout=None, stream=None))]
    #[allow(clippy::too_many_arguments)]
    fn signal(
        &self,
        py: Python<'_>,
        peer_rank: usize,
        async_op: bool,
        hints: Option<HashMap<String, String>>,
        timeout: Option<&Bound<'_, PyAny>>,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyWork> {
        let _ = hints;
        let bound = sync_bound(timeout, async_op, self.core.timeout)?;
        if self.core.device().is_some() {
            let st = self.core.signal_cuda(py, peer_rank, stream)?;
            return Ok(self.core.handle(st));
        }
        self.host_only("signal", stream)?;
        // Issued async when this call bounds its wait, or when it would
        // wait for a peer it does not map (`finish` waits in slices).
        let sliced = !async_op && bound.is_none();
        let issue_async = async_op || bound.is_some() || !self.core.unified(py, peer_rank);
        let core = self.core.clone();
        let st = self
            .core
            .with(py, false, move |w| w.signal(peer_rank, issue_async).map(|work| core.settle(work, None)))
            .map_err(py_err)?;
        self.core.finish(py, st, bound, "signal", peer_rank, sliced)
    }

    /// Waits for the next signal from `peer_rank` (the n-th wait takes the
    /// n-th signal; early ones are kept), for at most `timeout` (default:
    /// the communicator's). When it returns, what the peer put before that
    /// signal is in this rank's tensor. With `async_op`, returns a Work
    /// that takes the signal when waited for (or polled).
    ///
    /// On a window of CUDA tensors the wait is queued on `stream` (default:
    /// torch's current stream) and this returns at once: work queued there
    /// afterwards sees the peer's data. With every peer on this host (IPC)
    /// the window's watchdog releases the stream when the peer dies, or
    /// when the signal has not come the window's timeout after the wait
    /// was queued (and after the stream's previous wait passed): every
    /// later stream operation of the window then raises the reason (what
    /// the stream computed since is garbage). On a staged window (a peer on
    /// another host, or `unified=False`) the window's stream proxy waits
    /// at most the timeout from when the stream reaches the wait, then
    /// releases the stream: the returned Work (`wait()`) raises that error,
    /// and so does every later stream operation of the window.
    #[pyo3(signature = (peer_rank, async_op=false, hints=None, timeout=None, stream=None))]
    #[allow(clippy::too_many_arguments)]
    fn wait_signal(
        &self,
        py: Python<'_>,
        peer_rank: usize,
        async_op: bool,
        hints: Option<HashMap<String, String>>,
        timeout: Option<&Bound<'_, PyAny>>,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyWork> {
        let _ = hints;
        if self.core.device().is_some() {
            let st = self.core.wait_signal_cuda(py, peer_rank, stream)?;
            return Ok(self.core.handle(st));
        }
        self.host_only("wait_signal", stream)?;
        if peer_rank >= self.core.size {
            return Err(crate::errors::Failure::new(
                crate::errors::ErrKind::Argument,
                format!("wait_signal: rank {peer_rank} is not in this window of {} ranks", self.core.size),
            )
            .into());
        }
        let timeout = timeout::duration(timeout, "timeout")?;
        let w = PyWork::of(State::WaitSignal { core: self.core.clone(), peer: peer_rank, timeout, end: None });
        if async_op {
            return Ok(w);
        }
        w.cell.wait(py, None)?;
        Ok(w)
    }

    /// Reads `src_rank`'s tensor at element `source_offset_nelems` (of its
    /// dtype) into `tensor`. Without `async_op`, `timeout` bounds how long
    /// this waits (`TimeoutError`; the get goes on and may still write
    /// `tensor`). A CUDA tensor is filled device to device, queued on
    /// `stream` (`timeout` does not apply, as for `put`).
    #[pyo3(signature = (tensor, src_rank, source_offset_nelems, async_op=false, hints=None, timeout=None, stream=None))]
    #[allow(clippy::too_many_arguments)]
    fn get(
        &self,
        py: Python<'_>,
        tensor: &Bound<'_, PyAny>,
        src_rank: usize,
        source_offset_nelems: usize,
        async_op: bool,
        hints: Option<HashMap<String, String>>,
        timeout: Option<&Bound<'_, PyAny>>,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyWork> {
        let _ = hints;
        let bound = sync_bound(timeout, async_op, self.core.timeout)?;
        if let Some(t) = cuda_tensor::of(tensor, "tensor")? {
            self.core.same_dtype("get", src_rank, t.elem)?;
            let st = self.core.get_cuda(py, &t, src_rank, source_offset_nelems, async_op, stream)?;
            return Ok(self.core.handle(st));
        }
        self.host_only("get", stream)?;
        let t = Tensor::new(tensor, "tensor", true)?;
        self.core.same_dtype("get", src_rank, t.elem)?;
        let sliced = !async_op && bound.is_none();
        let st = self.core.get(py, &t, src_rank, source_offset_nelems, async_op, bound.is_some(), sliced)?;
        self.core.finish(py, st, bound, "get", src_rank, sliced)
    }

    /// `rank`'s registered tensor, aliasing its memory (zero-copy), with the
    /// dtype and shape `rank` registered, as the kind this rank registered
    /// (numpy or torch). This rank's own: the tensor itself. A same-host
    /// peer's: its memory mapped here; what anyone puts there is seen at
    /// once. A SEPARATE peer: `UnavailableError`.
    fn map_remote_tensor<'py>(&self, py: Python<'py>, rank: usize) -> PyResult<Bound<'py, PyAny>> {
        self.core.map_remote_tensor(py, rank)
    }

    /// How this rank reaches `peer_rank`'s tensor: `WindowAttr.access_type`
    /// is `WinAccessType.UNIFIED` (mapped here) or `SEPARATE`.
    fn get_attr(&self, py: Python<'_>, peer_rank: usize) -> PyResult<PyWindowAttr> {
        let a = self.core.with(py, false, |w| w.get_attr(peer_rank)).map_err(py_err)?;
        Ok(PyWindowAttr { access_type: a.access_type.into() })
    }

    /// Bytes this rank registered (0 when nothing is).
    fn get_size(&self, py: Python<'_>) -> usize {
        self.core.with(py, false, |w| w.get_size())
    }

    /// "cuda" while a CUDA tensor is registered, else "cpu".
    fn get_device(&self) -> &'static str {
        if self.core.device().is_some() {
            "cuda"
        } else {
            "cpu"
        }
    }

    /// The registered tensor (None when nothing is registered).
    fn get_tensor(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        self.core.reg.lock().unwrap_or_else(|e| e.into_inner()).as_ref().map(|r| r.tensor.clone_ref(py))
    }

    fn __repr__(&self) -> String {
        format!("<rmacomm.Window rank {} of {}>", self.core.rank, self.core.size)
    }
}
