//! CUDA torch tensors for windows (issue 13): a tensor on an NVIDIA device
//! read as its device address, length, element type, shape and device; the
//! stream an operation is ordered on (the `stream=` argument, else torch's
//! current stream of the tensor's device); the device's primary context
//! (the one torch uses), opened once per device through rmacomm's run-time
//! loaded driver.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use rmacomm_window::cuda::device::Stream;
use rmacomm_window::cuda::driver::{Context, DevicePtr};

use crate::elem::Elem;
use crate::errors::{ErrKind, Failure};
use crate::tensor::{elem_of_torch_dtype, is_torch_tensor, torch_module};

/// A contiguous CUDA torch tensor.
pub(crate) struct CudaTensor {
    pub(crate) obj: Py<PyAny>,
    pub(crate) ptr: DevicePtr,
    pub(crate) nbytes: usize,
    pub(crate) elem: &'static Elem,
    pub(crate) shape: Vec<usize>,
    pub(crate) device: u32,
}

/// `obj` as a CUDA tensor when it is a torch tensor on a CUDA device;
/// `None` for anything else (CPU tensors, numpy arrays: the host path).
pub(crate) fn of(obj: &Bound<'_, PyAny>, arg: &str) -> PyResult<Option<CudaTensor>> {
    let py = obj.py();
    if !is_torch_tensor(obj)? || !obj.getattr(intern!(py, "is_cuda"))?.is_truthy()? {
        return Ok(None);
    }
    let dtype = obj.getattr(intern!(py, "dtype"))?;
    let elem = elem_of_torch_dtype(&dtype)?
        .ok_or_else(|| PyTypeError::new_err(format!("{arg}: torch dtype {dtype} is not a type rmacomm moves")))?;
    if !obj.call_method0(intern!(py, "is_contiguous"))?.is_truthy()? {
        return Err(PyValueError::new_err(format!("{arg} is not contiguous; pass {arg}.contiguous()")));
    }
    crate::tensor::lazy_view(obj, arg)?;
    let ptr: u64 = obj.call_method0(intern!(py, "data_ptr"))?.extract()?;
    let numel: usize = obj.call_method0(intern!(py, "numel"))?.extract()?;
    let shape: Vec<usize> = obj.getattr(intern!(py, "shape"))?.extract()?;
    let device: u32 = obj.getattr(intern!(py, "device"))?.getattr(intern!(py, "index"))?.extract()?;
    Ok(Some(CudaTensor { obj: obj.clone().unbind(), ptr, nbytes: numel * elem.size, elem, shape, device }))
}

/// Device `ordinal`'s primary context, opened once.
pub(crate) fn context(ordinal: u32) -> Result<Arc<Context>, Failure> {
    static CTXS: Mutex<Option<HashMap<u32, Arc<Context>>>> = Mutex::new(None);
    let mut g = CTXS.lock().unwrap_or_else(|e| e.into_inner());
    let map = g.get_or_insert_with(HashMap::new);
    if let Some(c) = map.get(&ordinal) {
        return Ok(c.clone());
    }
    let c = Context::open_shared(ordinal)
        .map_err(|e| Failure::new(ErrKind::Unavailable, format!("CUDA device {ordinal}: {e}")))?;
    map.insert(ordinal, c.clone());
    Ok(c)
}

/// The stream an operation on device `ordinal` is ordered on: `stream`
/// (a `torch.cuda.Stream`, or a raw `CUstream` as an int), else torch's
/// current stream of the device.
pub(crate) fn stream(py: Python<'_>, stream: Option<&Bound<'_, PyAny>>, ordinal: u32) -> PyResult<Stream> {
    let raw: usize = match stream.filter(|s| !s.is_none()) {
        Some(s) => match s.extract::<usize>() {
            Ok(v) => v,
            Err(_) => s.getattr(intern!(py, "cuda_stream")).and_then(|v| v.extract()).map_err(|_| {
                PyTypeError::new_err("stream must be a torch.cuda.Stream or a CUstream handle (an int)")
            })?,
        },
        None => {
            let torch = torch_module(py)?.ok_or_else(|| PyTypeError::new_err("torch is not imported"))?;
            let cur = torch.getattr(intern!(py, "cuda"))?.call_method1(intern!(py, "current_stream"), (ordinal,))?;
            cur.getattr(intern!(py, "cuda_stream"))?.extract()?
        }
    };
    let ctx = context(ordinal)?;
    // SAFETY: a stream handle torch made (or the caller's raw handle),
    // alive while its Python object is: the caller holds it for the call,
    // and work queued on it needs no handle afterwards. Checked to be a
    // stream of this device: work for this device's memory queued on
    // another GPU's stream would not be ordered with this device's work.
    unsafe { Stream::from_raw_checked(ctx, raw) }
        .map_err(|e| Failure::new(ErrKind::Argument, format!("stream: {e}")).into())
}

/// Refuses a CUDA tensor on another device than the one `op` runs on (the
/// registered tensor's): its work would be queued on the wrong GPU's
/// stream, unordered with the work torch queues for the tensor.
pub(crate) fn same_device(op: &str, t: &CudaTensor, device: u32, what: &str) -> Result<(), Failure> {
    if t.device == device {
        return Ok(());
    }
    Err(Failure::new(
        ErrKind::Argument,
        format!(
            "{op}: the tensor is on cuda:{}, {what} on cuda:{device}; move it with .to(\"cuda:{device}\")",
            t.device
        ),
    ))
}

/// Warns once per process (a `RuntimeWarning`) when stream operations that
/// a host thread completes run under CUDA's lazy module loading
/// (`rmacomm_cuda::lazy_loading_hazard`).
pub(crate) fn warn_lazy_loading(py: Python<'_>) {
    static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    let Some(hazard) = rmacomm_window::cuda::lazy_loading_hazard() else { return };
    if !WARNED.swap(true, std::sync::atomic::Ordering::Relaxed) {
        let category = py.get_type::<pyo3::exceptions::PyRuntimeWarning>();
        let msg = std::ffi::CString::new(hazard).unwrap_or_default();
        let _ = PyErr::warn(py, &category, &msg, 1);
    }
}
