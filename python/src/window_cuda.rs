//! Windows on CUDA torch tensors (issue 13): same-host peers' tensors
//! mapped through CUDA IPC, puts and gets as device-to-device copies, and
//! signals and waits ordered on a CUDA stream (`stream=`, default torch's
//! current stream of the tensor's device), as torch orders GPU work.
//!
//! Where some peer is not UNIFIED (another host, or `unified=False`), or
//! some rank cannot map a peer's tensor (GPUs without peer access between
//! them, CUDA IPC refused: every rank learns it at registration), the
//! tensors are registered through the transport instead (*staged*: the
//! soft provider copies through pinned host chunks, a verbs HCA reaches
//! the GPU). Their puts, gets, signals and waits are still ordered on
//! `stream`: the window's stream proxy (a host thread) runs each when the
//! stream reaches it, and the stream waits for puts, gets and waits to
//! finish (so the calls return at once; without `async_op` a put or get
//! synchronizes the stream). Peers' tensors are not mapped.

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use crate::cuda_tensor::{self, CudaTensor};
use crate::errors::{py_err, ErrKind, Failure};
use crate::tensor::{torch_dtype, Kind};
use crate::window_core::{PeerMeta, Reg, WinCore};
use crate::work::State;

/// Keeps a peer's IPC mapping alive for a tensor viewing it.
#[pyclass(frozen, name = "_CudaMappingHolder", module = "rmacomm._rmacomm")]
struct MappingHolder {
    _keep: Option<std::sync::Arc<rmacomm_window::cuda::device::IpcMapping>>,
}

impl WinCore {
    /// The CUDA device of the registered tensor, when it is a CUDA tensor.
    pub(crate) fn device(&self) -> Option<u32> {
        self.reg.lock().unwrap_or_else(|e| e.into_inner()).as_ref().and_then(|r| r.device)
    }

    /// Whether the registered CUDA tensor went through the transport.
    pub(crate) fn staged(&self) -> bool {
        self.reg.lock().unwrap_or_else(|e| e.into_inner()).as_ref().is_some_and(|r| r.staged)
    }

    fn need_device(&self, op: &str) -> Result<u32, Failure> {
        self.device().ok_or_else(|| {
            Failure::new(
                ErrKind::Argument,
                format!("{op}: a CUDA tensor needs a CUDA tensor registered (tensor_register of a CUDA tensor)"),
            )
        })
    }

    /// Registers a CUDA tensor (collective): every rank a CUDA tensor, every
    /// peer on this host (CUDA IPC).
    pub(crate) fn register_cuda(&self, py: Python<'_>, t: CudaTensor) -> PyResult<()> {
        if self.reg.lock().unwrap_or_else(|e| e.into_inner()).is_some() {
            return Err(Failure::new(
                ErrKind::Argument,
                "a tensor is registered already; call tensor_deregister first",
            )
            .into());
        }
        // Refused or not, this rank takes its part in the exchange (its
        // peers hear why at once).
        let offer = match t.nbytes {
            0 => Err(Failure::new(ErrKind::Argument, "tensor: an empty tensor cannot be registered").into()),
            _ => cuda_tensor::context(t.device).map(|ctx| (t.elem, t.shape.clone(), ctx)).map_err(PyErr::from),
        };
        let (peers, ctx) = self.exchange_meta(py, true, offer)?;
        let (ptr, len, es, dev) = (t.ptr, t.nbytes, t.elem.size, t.device);
        // Every rank decides alike: in a group on one host with UNIFIED
        // access every peer is UNIFIED, in any other every rank has a peer
        // that is not.
        let mut staged = !self.with(py, false, |w| w.all_unified());
        if !staged {
            // SAFETY: the tensor's memory stays allocated while `Reg` holds
            // the tensor, which `deregister` lets go only after the window's
            // deregistration (a barrier: no peer reaches it any more).
            match self.exclusive(py, move |w| unsafe { w.tensor_register_device_ptr(ctx, ptr, len, es) })? {
                Ok(()) => {}
                // Every rank gets it alike (GPUs without peer access, CUDA
                // IPC refused): all register through the transport instead.
                Err(e @ rmacomm_window::Error::Unreachable { .. }) => {
                    let category = py.get_type::<pyo3::exceptions::PyRuntimeWarning>();
                    let msg = std::ffi::CString::new(format!("{e}: staged through the transport instead"));
                    // Every rank goes on to register (a warning made an error
                    // here would leave the peers waiting).
                    let _ = PyErr::warn(py, &category, &msg.unwrap_or_default(), 1);
                    staged = true;
                }
                Err(e) => return Err(py_err(e)),
            }
        }
        if staged {
            self.exclusive(py, move |w| {
                // SAFETY: the tensor's memory stays allocated while `Reg`
                // holds the tensor, which `deregister` lets go only after
                // the window's deregistration (and the region's drop).
                match unsafe { w.register_cuda(ptr, len, dev) } {
                    Ok(mem) => w.tensor_register_len(mem, len, es),
                    // Its part still taken: the peers hear why at once.
                    Err(e) => Err(w.tensor_register_failed(e)),
                }
            })?
            .map_err(py_err)?;
        }
        *self.reg.lock().unwrap_or_else(|e| e.into_inner()) =
            Some(Reg { tensor: t.obj, kind: Kind::Torch, peers, device: Some(dev), staged });
        Ok(())
    }

    /// A put of a CUDA tensor, queued on `stream`; with `async_op` false the
    /// stream is synchronized before this returns (the data is placed).
    pub(crate) fn put_cuda(
        self: &std::sync::Arc<Self>,
        py: Python<'_>,
        t: &CudaTensor,
        dst: usize,
        offset: usize,
        async_op: bool,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<State> {
        let dev = self.need_device("put")?;
        cuda_tensor::same_device("put", t, dev, "the window's registered tensor")?;
        let s = cuda_tensor::stream(py, stream, dev)?;
        let (ptr, len) = (t.ptr, t.nbytes);
        if self.staged() {
            return self.staged_rma(py, &s, "put", (ptr, len, t.device, t.obj.clone_ref(py)), dst, offset, async_op);
        }
        // SAFETY: the tensor is alive for the call; queued work on the
        // stream that made (or uses) it is ordered before torch reuses its
        // memory, as for torch's own collectives.
        self.with(py, false, |w| unsafe { w.device_put_ptr(ptr, len, dst, offset, Some(&s)) }).map_err(py_err)?;
        if !async_op {
            py.detach(|| s.synchronize())
                .map_err(|e| Failure::new(ErrKind::Comm, format!("put with rank {dst}: {e}")))?;
        }
        Ok(State::Done(Ok(())))
    }

    /// A get into a CUDA tensor, queued on `stream` (synchronized without
    /// `async_op`).
    pub(crate) fn get_cuda(
        self: &std::sync::Arc<Self>,
        py: Python<'_>,
        t: &CudaTensor,
        src: usize,
        offset: usize,
        async_op: bool,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<State> {
        let dev = self.need_device("get")?;
        cuda_tensor::same_device("get", t, dev, "the window's registered tensor")?;
        let s = cuda_tensor::stream(py, stream, dev)?;
        let (ptr, len) = (t.ptr, t.nbytes);
        if self.staged() {
            return self.staged_rma(py, &s, "get", (ptr, len, t.device, t.obj.clone_ref(py)), src, offset, async_op);
        }
        // SAFETY: as for put_cuda, for the destination tensor.
        self.with(py, false, |w| unsafe { w.device_get_ptr(ptr, len, src, offset, Some(&s)) }).map_err(py_err)?;
        if !async_op {
            py.detach(|| s.synchronize())
                .map_err(|e| Failure::new(ErrKind::Comm, format!("get with rank {src}: {e}")))?;
        }
        Ok(State::Done(Ok(())))
    }

    /// A put (`op` "put") or get of the CUDA tensor `(ptr, len, device,
    /// tensor)` through the transport, at this point of `stream`: the
    /// tensor is registered for the operation (and kept alive by it, since
    /// it may run after the caller let go), which the window's stream proxy
    /// runs once the stream reaches it; work queued on `stream` afterwards
    /// waits for it. Without `async_op` the stream is synchronized and the
    /// result returned.
    #[allow(clippy::too_many_arguments)]
    fn staged_rma(
        self: &std::sync::Arc<Self>,
        py: Python<'_>,
        s: &rmacomm_window::cuda::device::Stream,
        op: &'static str,
        (ptr, len, dev, tensor): (u64, usize, u32, Py<PyAny>),
        peer: usize,
        offset: usize,
        async_op: bool,
    ) -> PyResult<State> {
        cuda_tensor::warn_lazy_loading(py);
        let core = self.clone();
        self.with(py, true, move |w| -> Result<State, Failure> {
            // SAFETY: the caller's tensor is alive for the call; the
            // operation runs in `stream`'s order, and work queued there
            // afterwards (torch's reuse of the tensor's memory included)
            // waits for it, as for torch's own collectives.
            let mem = unsafe { w.register_cuda(ptr, len, dev) }.map_err(Failure::from)?;
            let mem = std::sync::Arc::new(mem.keep_alive(tensor));
            let work = if op == "put" {
                w.put_on_stream(mem, 0, len, peer, offset, s)
            } else {
                w.get_on_stream(mem, 0, len, peer, offset, s)
            }
            .map_err(Failure::from)?;
            if async_op {
                return Ok(core.settle(work, None));
            }
            s.synchronize().map_err(|e| {
                Failure::new(ErrKind::Comm, format!("{op} with rank {peer}: synchronizing the stream: {e}"))
            })?;
            work.wait(None).map_err(Failure::from)?;
            Ok(State::Done(Ok(())))
        })
        .map_err(PyErr::from)
    }

    /// A signal queued on `stream` (after the puts queued there before).
    pub(crate) fn signal_cuda(
        self: &std::sync::Arc<Self>,
        py: Python<'_>,
        dst: usize,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<State> {
        let dev = self.need_device("signal")?;
        let s = cuda_tensor::stream(py, stream, dev)?;
        if self.staged() {
            // The window's stream proxy signals once the stream reaches
            // this point; the Work carries its result.
            cuda_tensor::warn_lazy_loading(py);
            let core = self.clone();
            let st =
                self.with(py, true, move |w| w.signal_on_stream_tracked(dst, &s).map(|work| core.settle(work, None)));
            return st.map_err(py_err);
        }
        self.with(py, false, |w| w.signal_on_stream(dst, &s)).map_err(py_err)?;
        Ok(State::Done(Ok(())))
    }

    /// A wait for the next signal from `peer`, queued on `stream`: work
    /// queued there afterwards sees the peer's data.
    pub(crate) fn wait_signal_cuda(
        self: &std::sync::Arc<Self>,
        py: Python<'_>,
        peer: usize,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<State> {
        let dev = self.need_device("wait_signal")?;
        let s = cuda_tensor::stream(py, stream, dev)?;
        if self.staged() {
            // The stream waits until the window's stream proxy has taken
            // the peer's signal; the Work carries the proxy's result.
            cuda_tensor::warn_lazy_loading(py);
            let core = self.clone();
            let st = self
                .with(py, true, move |w| w.wait_signal_on_stream_tracked(peer, &s).map(|work| core.settle(work, None)));
            return st.map_err(py_err);
        }
        self.with(py, false, |w| w.wait_signal_on_stream(peer, &s)).map_err(py_err)?;
        Ok(State::Done(Ok(())))
    }

    /// A peer's registered CUDA tensor, mapped here (CUDA IPC), as a torch
    /// tensor of the dtype and shape it registered; the mapping lives as long
    /// as the tensor (the peer's writes stop meaning anything once it
    /// deregisters and frees its memory).
    pub(crate) fn map_remote_cuda<'py>(
        &self,
        py: Python<'py>,
        rank: usize,
        meta: &PeerMeta,
    ) -> PyResult<Bound<'py, PyAny>> {
        let dev = self.need_device("map_remote_tensor")?;
        let (ptr, len, keep) = self
            .with(py, false, |w| Ok::<_, rmacomm_window::Error>((w.map_remote_device(rank)?, w.device_mapping(rank)?)))
            .map(|((p, l), k)| (p, l, k))
            .map_err(py_err)?;
        let torch = crate::tensor::torch_module(py)?.ok_or_else(|| Failure::new(ErrKind::Unavailable, "no torch"))?;
        // Bytes first (every dtype, bfloat16 included, views them), through
        // the CUDA array interface, which torch maps without a copy.
        let iface = PyDict::new(py);
        iface.set_item("shape", PyTuple::new(py, [len])?)?;
        iface.set_item("typestr", "|u1")?;
        iface.set_item("data", (ptr, false))?;
        iface.set_item("version", 3)?;
        iface.set_item("strides", py.None())?;
        let holder = py.import(intern!(py, "types"))?.getattr(intern!(py, "SimpleNamespace"))?.call0()?;
        holder.setattr("__cuda_array_interface__", iface)?;
        // The tensor keeps the holder, the holder the IPC mapping: the
        // peer's memory stays mapped here as long as the tensor lives, past
        // tensor_deregister.
        holder.setattr("_mapping", Py::new(py, MappingHolder { _keep: keep })?)?;
        let kw = PyDict::new(py);
        kw.set_item("device", format!("cuda:{dev}"))?;
        let bytes = torch.call_method("as_tensor", (holder,), Some(&kw))?;
        let dtype = torch_dtype(py, meta.elem)?;
        let shape = PyTuple::new(py, &meta.shape)?;
        bytes.call_method1(intern!(py, "view"), (dtype,))?.call_method1(intern!(py, "reshape"), (shape,))
    }
}
