//! What a tensor argument is: a numpy array (read through the buffer
//! protocol) or a CPU torch tensor (through its methods), as a pointer, a
//! length, an element type and a shape, with the checks every operation
//! needs and errors that name the argument.

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyType};

use crate::buffer::Export;
use crate::elem::{self, Elem};

/// Which library a tensor belongs to: results are returned as the same.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Numpy,
    Torch,
}

/// A tensor argument, checked (contiguous, on the CPU).
pub(crate) struct Tensor<'py> {
    pub(crate) obj: Bound<'py, PyAny>,
    pub(crate) ptr: *mut u8,
    pub(crate) nbytes: usize,
    pub(crate) elem: &'static Elem,
    pub(crate) kind: Kind,
    /// Asked when needed (from the buffer export, or torch's `shape`).
    shape: Option<Vec<usize>>,
    /// Keeps a numpy array's memory from being resized during the call.
    export: Option<Export>,
}

/// A byte range of a tensor, `Send` so that a call can use it with the GIL
/// released.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Raw {
    pub(crate) ptr: *mut u8,
    pub(crate) len: usize,
}

// SAFETY: a Raw is an address and a length; whoever turns it into a slice
// (below, unsafe) promises the memory is alive and unaliased for that use.
unsafe impl Send for Raw {}
// SAFETY: as above.
unsafe impl Sync for Raw {}

impl Raw {
    fn base(self) -> *mut u8 {
        if self.len == 0 || self.ptr.is_null() {
            std::ptr::NonNull::dangling().as_ptr()
        } else {
            self.ptr
        }
    }

    /// The bytes as a slice.
    ///
    /// # Safety
    /// The memory is alive for `'a` and nobody writes it meanwhile.
    // The communicator's API takes slices; see the crate's docs on the
    // contract Python callers follow (as with torch: no other use of a
    // tensor while an operation on it runs).
    #[allow(clippy::disallowed_methods)]
    pub(crate) unsafe fn slice<'a>(self) -> &'a [u8] {
        // SAFETY: forwarded; a zero-length slice gets a dangling, aligned
        // pointer (torch reports 0 for empty tensors).
        unsafe { std::slice::from_raw_parts(self.base(), self.len) }
    }

    /// The bytes as a mutable slice.
    ///
    /// # Safety
    /// The memory is alive for `'a` and nothing else reads or writes it
    /// meanwhile.
    #[allow(clippy::disallowed_methods, clippy::mut_from_ref)]
    pub(crate) unsafe fn slice_mut<'a>(self) -> &'a mut [u8] {
        // SAFETY: forwarded, as in `slice`.
        unsafe { std::slice::from_raw_parts_mut(self.base(), self.len) }
    }

    /// Whether the two ranges share a byte.
    pub(crate) fn overlaps(self, other: Raw) -> bool {
        let (a, b) = (self.ptr as usize, other.ptr as usize);
        self.len > 0 && other.len > 0 && a < b + other.len && b < a + self.len
    }
}

static NDARRAY: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static TORCH: PyOnceLock<TorchTypes> = PyOnceLock::new();

/// torch's tensor type and its dtype objects (compared by identity).
struct TorchTypes {
    tensor: Py<PyType>,
    dtypes: Vec<(Py<PyAny>, &'static Elem)>,
    module: Py<PyModule>,
}

fn ndarray(py: Python<'_>) -> PyResult<&Bound<'_, PyType>> {
    NDARRAY
        .get_or_try_init(py, || Ok::<_, PyErr>(py.import("numpy")?.getattr("ndarray")?.cast_into::<PyType>()?.unbind()))
        .map(|t| t.bind(py))
}

/// torch's types, once torch has been imported by the program (rmacomm
/// never imports torch itself for a numpy program).
fn torch(py: Python<'_>) -> PyResult<Option<&TorchTypes>> {
    if let Some(t) = TORCH.get(py) {
        return Ok(Some(t));
    }
    let modules = py.import(intern!(py, "sys"))?.getattr(intern!(py, "modules"))?;
    let Some(torch) = modules.cast::<PyDict>()?.get_item("torch")? else { return Ok(None) };
    let mut dtypes = Vec::new();
    for e in &elem::ELEMS {
        if let Ok(d) = torch.getattr(e.name) {
            dtypes.push((d.unbind(), e));
        }
    }
    let types = TorchTypes {
        tensor: torch.getattr("Tensor")?.cast_into::<PyType>()?.unbind(),
        dtypes,
        module: torch.cast_into::<PyModule>()?.unbind(),
    };
    let _ = TORCH.set(py, types);
    Ok(TORCH.get(py))
}

/// Whether `obj` is a torch tensor (torch's cached type; false when the
/// program never imported torch).
pub(crate) fn is_torch_tensor(obj: &Bound<'_, PyAny>) -> PyResult<bool> {
    match torch(obj.py())? {
        Some(t) => obj.is_instance(t.tensor.bind(obj.py()).as_any()),
        None => Ok(false),
    }
}

/// The torch module, if the program imported it.
pub(crate) fn torch_module(py: Python<'_>) -> PyResult<Option<Bound<'_, PyModule>>> {
    Ok(torch(py)?.map(|t| t.module.bind(py).clone()))
}

/// The torch dtype object of `e`.
pub(crate) fn torch_dtype<'py>(py: Python<'py>, e: &'static Elem) -> PyResult<Bound<'py, PyAny>> {
    let t = torch(py)?.ok_or_else(|| PyTypeError::new_err("torch is not imported"))?;
    t.dtypes
        .iter()
        .find(|(_, x)| *x == e)
        .map(|(d, _)| d.bind(py).clone())
        .ok_or_else(|| PyTypeError::new_err(format!("torch has no dtype {}", e.name)))
}

/// Whether `obj` is a torch dtype object; its element type if so.
pub(crate) fn elem_of_torch_dtype(obj: &Bound<'_, PyAny>) -> PyResult<Option<&'static Elem>> {
    let Some(t) = torch(obj.py())? else { return Ok(None) };
    Ok(t.dtypes.iter().find(|(d, _)| d.bind(obj.py()).is(obj)).map(|(_, e)| *e))
}

impl<'py> Tensor<'py> {
    /// Reads a tensor argument named `arg`. `writable`: an output (a
    /// read-only numpy array is refused).
    pub(crate) fn new(obj: &Bound<'py, PyAny>, arg: &str, writable: bool) -> PyResult<Tensor<'py>> {
        let py = obj.py();
        // A program without numpy (torch alone) is fine: nothing is an
        // ndarray then.
        if let Ok(nd) = ndarray(py) {
            if obj.is_instance(nd.as_any())? {
                return Self::numpy(obj, arg, writable);
            }
        }
        if let Some(t) = torch(py)? {
            if obj.is_instance(t.tensor.bind(py).as_any())? {
                return Self::torch(obj, arg, t);
            }
        }
        Err(PyTypeError::new_err(format!(
            "{arg} must be a numpy array or a torch tensor, not {}",
            obj.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into())
        )))
    }

    fn numpy(obj: &Bound<'py, PyAny>, arg: &str, writable: bool) -> PyResult<Tensor<'py>> {
        let export = Export::of(obj).map_err(|e| {
            PyTypeError::new_err(format!("{arg}: numpy array whose memory cannot be read as a buffer: {e}"))
        })?;
        let l = export.layout();
        if !l.c_contiguous {
            return Err(PyValueError::new_err(format!(
                "{arg} is not contiguous (shape {:?}); pass np.ascontiguousarray({arg})",
                export.shape()
            )));
        }
        if writable && l.readonly {
            return Err(PyValueError::new_err(format!("{arg} is read-only, and this operation writes it")));
        }
        let elem = elem::from_format(l.format, l.itemsize).map_err(|m| PyTypeError::new_err(format!("{arg}: {m}")))?;
        let (ptr, nbytes) = (l.ptr, l.len);
        Ok(Tensor { obj: obj.clone(), ptr, nbytes, elem, kind: Kind::Numpy, shape: None, export: Some(export) })
    }

    fn torch(obj: &Bound<'py, PyAny>, arg: &str, t: &TorchTypes) -> PyResult<Tensor<'py>> {
        let py = obj.py();
        let dtype = obj.getattr(intern!(py, "dtype"))?;
        let elem =
            t.dtypes.iter().find(|(d, _)| d.bind(py).is(&dtype)).map(|(_, e)| *e).ok_or_else(|| {
                PyTypeError::new_err(format!("{arg}: torch dtype {dtype} is not a type rmacomm moves"))
            })?;
        if !obj.getattr(intern!(py, "is_cpu"))?.is_truthy()? {
            return Err(PyValueError::new_err(format!(
                "{arg} is on device {}; here rmacomm moves CPU tensors (CUDA tensors go to windows, to all_reduce, \
                 broadcast, all_gather_single, reduce_scatter_single, all_to_all_single, and with \
                 new_comm(\"nccl\") also to reduce, send, recv)",
                obj.getattr(intern!(py, "device"))?
            )));
        }
        if !obj.call_method0(intern!(py, "is_contiguous"))?.is_truthy()? {
            return Err(PyValueError::new_err(format!("{arg} is not contiguous; pass {arg}.contiguous()")));
        }
        lazy_view(obj, arg)?;
        let ptr: usize = obj.call_method0(intern!(py, "data_ptr"))?.extract()?;
        let numel: usize = obj.call_method0(intern!(py, "numel"))?.extract()?;
        Ok(Tensor {
            obj: obj.clone(),
            ptr: ptr as *mut u8,
            nbytes: numel * elem.size,
            elem,
            kind: Kind::Torch,
            shape: None,
            export: None,
        })
    }

    /// The bytes, to use with the GIL released.
    pub(crate) fn raw(&self) -> Raw {
        Raw { ptr: self.ptr, len: self.nbytes }
    }

    /// Its shape.
    pub(crate) fn shape(&mut self) -> PyResult<Vec<usize>> {
        if let Some(s) = &self.shape {
            return Ok(s.clone());
        }
        let s: Vec<usize> = match &self.export {
            Some(e) => e.shape(),
            None => self.obj.getattr(intern!(self.obj.py(), "shape"))?.extract()?,
        };
        self.shape = Some(s.clone());
        Ok(s)
    }

    /// Bytes per row (the first dimension), for split sizes counted in rows
    /// as torch does; the element size for a 0-d tensor.
    pub(crate) fn row_bytes(&mut self) -> PyResult<usize> {
        let shape = self.shape()?;
        Ok(match shape.first() {
            Some(&rows) if rows > 0 => self.nbytes / rows,
            // No rows: the other dimensions may be anything (numpy does not
            // bound them), so their product is checked.
            Some(_) => crate::array::nbytes(&shape[1..], self.elem).ok_or_else(|| {
                PyValueError::new_err(format!("a tensor of shape {shape:?}: its rows' byte size is past 2**64"))
            })?,
            None => self.elem.size,
        })
    }

    /// A keep-alive reference, for an operation that outlives the call.
    pub(crate) fn keep(&self) -> Py<PyAny> {
        self.obj.clone().unbind()
    }
}

/// Reads a list of tensors named `arg` (`arg[i]` in errors).
pub(crate) fn list<'py>(obj: &Bound<'py, PyAny>, arg: &str, writable: bool) -> PyResult<Vec<Tensor<'py>>> {
    let mut out = Vec::new();
    for (i, item) in obj.try_iter()?.enumerate() {
        out.push(Tensor::new(&item?, &format!("{arg}[{i}]"), writable)?);
    }
    Ok(out)
}

/// Checks that `t` holds elements of `want`'s type.
pub(crate) fn same_elem(t: &Tensor<'_>, arg: &str, want: &'static Elem, other: &str) -> PyResult<()> {
    if t.elem != want {
        return Err(PyTypeError::new_err(format!(
            "{arg} has dtype {}, but {other} has {}; both must have the same dtype",
            t.elem.name, want.name
        )));
    }
    Ok(())
}

/// Refuses a torch conjugate or negative view (`x.conj()` of a complex
/// tensor, `torch._neg_view`): contiguous, but its memory holds the values
/// before conjugation or negation, which torch applies lazily — moved as
/// bytes they would be wrong, silently (torch.distributed refuses them
/// too).
pub(crate) fn lazy_view(obj: &Bound<'_, PyAny>, arg: &str) -> PyResult<()> {
    let py = obj.py();
    for (flag, what, fix) in
        [(intern!(py, "is_conj"), "conjugate", "resolve_conj"), (intern!(py, "is_neg"), "negative", "resolve_neg")]
    {
        if obj.hasattr(flag)? && obj.call_method0(flag)?.is_truthy()? {
            return Err(PyValueError::new_err(format!(
                "{arg} is a {what} view (its memory holds the values before the {what} torch applies lazily); \
                 pass {arg}.{fix}()"
            )));
        }
    }
    Ok(())
}
