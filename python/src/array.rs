//! numpy arrays and torch tensors over memory this module owns: rmacomm's
//! shared-memory allocations (`empty`), a ctran window's own buffer, and
//! peers' window memory mapped here.
//!
//! The array's base object is a [`PyMemoryHolder`] exposing
//! `__array_interface__`; it owns what keeps the memory mapped (an `Arc`
//! of the allocation, or a private mapping of a peer's pages), so the
//! memory lives exactly as long as any array or tensor over it. torch
//! tensors are made from the numpy array (`torch.from_numpy`, which keeps
//! it), then viewed as the torch dtype where numpy lacks it (bfloat16).

use std::sync::Arc;

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use crate::elem::{self, Elem};
use crate::errors::py_err;
use crate::mapping::DupMapping;
use crate::memory::Registered;
use crate::tensor::{self, Kind};

/// What keeps a holder's memory mapped.
#[derive(Debug)]
pub(crate) enum Keep {
    Alloc(#[allow(dead_code)] Arc<Registered>),
    Peer(#[allow(dead_code)] DupMapping),
}

/// The owner of memory that numpy arrays made by rmacomm view (their
/// `.base`). Not made directly.
#[pyclass(frozen, name = "_MemoryHolder", module = "rmacomm._rmacomm")]
pub(crate) struct PyMemoryHolder {
    ptr: usize,
    shape: Vec<usize>,
    typestr: String,
    _keep: Keep,
}

#[pymethods]
impl PyMemoryHolder {
    /// numpy's array interface (version 3) of the memory.
    #[getter]
    fn __array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("version", 3)?;
        d.set_item("shape", PyTuple::new(py, &self.shape)?)?;
        d.set_item("typestr", &self.typestr)?;
        d.set_item("data", (self.ptr, false))?;
        d.set_item("strides", py.None())?;
        Ok(d)
    }

    fn __repr__(&self) -> String {
        format!("<rmacomm memory at {:#x}, shape {:?}, {}>", self.ptr, self.shape, self.typestr)
    }
}

/// An array of `kind` over `ptr` (inside what `keep` keeps), of `shape`
/// and element type `e`.
pub(crate) fn make<'py>(
    py: Python<'py>,
    ptr: *mut u8,
    shape: Vec<usize>,
    e: &'static Elem,
    kind: Kind,
    keep: Keep,
) -> PyResult<Bound<'py, PyAny>> {
    if kind == Kind::Numpy && e.np_kind.is_none() {
        return Err(PyTypeError::new_err(format!(
            "numpy has no {} type; ask for a torch tensor (a torch dtype, or like= a torch tensor)",
            e.name
        )));
    }
    let holder = Bound::new(py, PyMemoryHolder { ptr: ptr as usize, shape, typestr: e.typestr(), _keep: keep })?;
    let np = py.import(intern!(py, "numpy"))?;
    let arr = np.call_method1(intern!(py, "asarray"), (holder,))?;
    if kind == Kind::Numpy {
        return Ok(arr);
    }
    let torch = tensor::torch_module(py)?
        .ok_or_else(|| PyTypeError::new_err("a torch tensor was asked for, but torch is not imported"))?;
    let t = torch.call_method1(intern!(py, "from_numpy"), (arr,))?;
    if e.np_kind.is_none() {
        return t.call_method1(intern!(py, "view"), (tensor::torch_dtype(py, e)?,));
    }
    Ok(t)
}

/// A dtype argument: a string, a numpy dtype or type, or a torch dtype;
/// with the kind it asks for (torch for a torch dtype).
pub(crate) fn parse_dtype(obj: &Bound<'_, PyAny>) -> PyResult<(&'static Elem, Option<Kind>)> {
    let py = obj.py();
    if let Ok(s) = obj.extract::<String>() {
        return elem::by_name(&s)
            .map(|e| (e, None))
            .ok_or_else(|| PyTypeError::new_err(format!("dtype {s:?} is not a type rmacomm moves")));
    }
    if let Some(e) = tensor::elem_of_torch_dtype(obj)? {
        return Ok((e, Some(Kind::Torch)));
    }
    let name: String = py
        .import(intern!(py, "numpy"))?
        .call_method1(intern!(py, "dtype"), (obj,))
        .and_then(|d| d.getattr(intern!(py, "name"))?.extract())
        .map_err(|_| PyTypeError::new_err(format!("dtype: {obj} is not a numpy or torch dtype")))?;
    elem::by_name(&name)
        .map(|e| (e, Some(Kind::Numpy)))
        .ok_or_else(|| PyTypeError::new_err(format!("dtype {name} is not a type rmacomm moves")))
}

/// A shape argument: an int or a sequence of ints.
pub(crate) fn parse_shape(obj: &Bound<'_, PyAny>) -> PyResult<Vec<usize>> {
    if let Ok(n) = obj.extract::<usize>() {
        return Ok(vec![n]);
    }
    obj.extract::<Vec<usize>>().map_err(|_| PyValueError::new_err("shape must be an int or a sequence of ints >= 0"))
}

/// Bytes of an array of `shape` with elements `e`; `None` past `usize`
/// (a size that wrapped would pass bounds checks it fails).
pub(crate) fn nbytes(shape: &[usize], e: &Elem) -> Option<usize> {
    shape.iter().try_fold(e.size, |a, &d| a.checked_mul(d))
}

/// The kind `like` asks for.
pub(crate) fn kind_of(like: &Bound<'_, PyAny>) -> PyResult<Kind> {
    let py = like.py();
    if let Some(torch) = tensor::torch_module(py)? {
        if like.is_instance(&torch.getattr(intern!(py, "Tensor"))?)? {
            return Ok(Kind::Torch);
        }
    }
    if like.is_instance(&py.import(intern!(py, "numpy"))?.getattr(intern!(py, "ndarray"))?)? {
        return Ok(Kind::Numpy);
    }
    Err(PyTypeError::new_err("like must be a numpy array or a torch tensor"))
}

/// Allocates a zeroed array in shared memory.
pub(crate) fn alloc<'py>(
    py: Python<'py>,
    shape: &Bound<'py, PyAny>,
    dtype: Option<&Bound<'py, PyAny>>,
    like: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    let shape = parse_shape(shape)?;
    let (e, dkind) = match dtype.filter(|d| !d.is_none()) {
        Some(d) => parse_dtype(d)?,
        None => (elem::by_name("float32").expect("in the table"), None),
    };
    let kind = match like {
        Some(l) => kind_of(l)?,
        None => dkind.unwrap_or(Kind::Numpy),
    };
    let bytes = nbytes(&shape, e).ok_or_else(|| PyValueError::new_err(format!("shape {shape:?} is too large")))?;
    let mem = py.detach(|| Registered::alloc(bytes)).map_err(py_err)?;
    let ptr = mem.mem.as_ptr();
    make(py, ptr, shape, e, kind, Keep::Alloc(mem))
}

/// A zero-filled numpy array or torch tensor in shared memory: the memory
/// to register in windows (same-host peers map it: UNIFIED access) and to
/// send from with no copy or registration per call.
///
/// Args:
///     shape: an int or a sequence of ints.
///     dtype: a numpy dtype or type, a torch dtype, or a name
///         ("float32", "bfloat16", "torch.int64"); default float32.
///     like: a numpy array or torch tensor: return the same kind. Default:
///         a torch tensor for a torch dtype, else a numpy array.
///     device: None or "cpu" (shared memory, as above), or "cuda" /
///         "cuda:N" / a torch.device: a zero-filled torch tensor from
///         torch's caching allocator on that GPU (cudaMalloc'd memory,
///         which CUDA IPC exports: what windows of CUDA tensors register).
#[pyfunction]
#[pyo3(signature = (shape, dtype=None, *, like=None, device=None))]
pub(crate) fn empty<'py>(
    py: Python<'py>,
    shape: &Bound<'py, PyAny>,
    dtype: Option<&Bound<'py, PyAny>>,
    like: Option<&Bound<'py, PyAny>>,
    device: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    if let Some(d) = device.filter(|d| !d.is_none()) {
        let name = d.str()?.to_string();
        if name.starts_with("cuda") {
            return cuda_empty(py, shape, dtype, d);
        }
        if name != "cpu" && !name.starts_with("cpu:") {
            return Err(PyValueError::new_err(format!("empty: device {name:?}: \"cpu\" or \"cuda[:N]\"")));
        }
    }
    alloc(py, shape, dtype, like)
}

/// `torch.zeros(shape, dtype, device)` on a CUDA device.
fn cuda_empty<'py>(
    py: Python<'py>,
    shape: &Bound<'py, PyAny>,
    dtype: Option<&Bound<'py, PyAny>>,
    device: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyAny>> {
    let torch = py.import("torch").map_err(|e| {
        crate::errors::Failure::new(
            crate::errors::ErrKind::Unavailable,
            format!(
                "empty(device={}): CUDA tensors need torch: {e}",
                device.str().map(|s| s.to_string()).unwrap_or_default()
            ),
        )
    })?;
    let e = match dtype.filter(|d| !d.is_none()) {
        Some(d) => parse_dtype(d)?.0,
        None => elem::by_name("float32").expect("in the table"),
    };
    let kw = PyDict::new(py);
    kw.set_item("dtype", crate::tensor::torch_dtype(py, e)?)?;
    kw.set_item("device", device)?;
    let shape: Vec<usize> = match shape.extract::<usize>() {
        Ok(n) => vec![n],
        Err(_) => shape.extract()?,
    };
    torch.call_method("zeros", (shape,), Some(&kw))
}
