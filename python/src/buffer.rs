//! The buffer protocol (PEP 3118), declared here because the stable ABI
//! this module is built for (abi3, Python 3.9) only gained it in 3.11.
//!
//! `PyObject_GetBuffer` / `PyBuffer_Release` and the `Py_buffer` layout
//! below are CPython's public C API, unchanged since Python 3.0 and part of
//! the stable ABI since 3.11, exported by every CPython the wheel loads in.
//! Asking a numpy array for its buffer takes tens of nanoseconds, where
//! `__array_interface__` takes microseconds (it builds a dict): it is the
//! per-call cost of every operation on a numpy array.

use std::ffi::{c_char, c_int, c_void, CStr};

use pyo3::ffi::{PyObject, Py_ssize_t};
use pyo3::prelude::*;

#[repr(C)]
struct PyBufferRaw {
    buf: *mut c_void,
    obj: *mut PyObject,
    len: Py_ssize_t,
    itemsize: Py_ssize_t,
    readonly: c_int,
    ndim: c_int,
    format: *mut c_char,
    shape: *mut Py_ssize_t,
    strides: *mut Py_ssize_t,
    suboffsets: *mut Py_ssize_t,
    internal: *mut c_void,
}

/// `PyBUF_STRIDES | PyBUF_FORMAT` (`PyBUF_RECORDS_RO`): any layout, read
/// only asked; contiguity and writability are checked here so that the
/// error can name the argument.
const PYBUF_RECORDS_RO: c_int = 0x0010 | 0x0008 | 0x0004;

extern "C" {
    fn PyObject_GetBuffer(obj: *mut PyObject, view: *mut PyBufferRaw, flags: c_int) -> c_int;
    fn PyBuffer_Release(view: *mut PyBufferRaw);
}

/// A buffer export of a Python object, released on drop. Holding it keeps
/// the exporter from resizing or freeing the memory (numpy and bytearray
/// refuse to while exported). Lives only while the GIL is held (not
/// `Send`): it is taken and released inside one call.
pub(crate) struct Export {
    // Boxed: the exporter may keep pointers into the struct (`internal`).
    raw: Box<PyBufferRaw>,
}

/// What an export says about the memory.
#[derive(Debug)]
pub(crate) struct Layout<'a> {
    pub(crate) ptr: *mut u8,
    pub(crate) len: usize,
    pub(crate) itemsize: usize,
    pub(crate) readonly: bool,
    pub(crate) format: &'a str,
    pub(crate) c_contiguous: bool,
}

impl Export {
    /// Asks `obj` for its buffer (strided, with its format).
    pub(crate) fn of(obj: &Bound<'_, PyAny>) -> PyResult<Export> {
        let mut raw = Box::new(PyBufferRaw {
            buf: std::ptr::null_mut(),
            obj: std::ptr::null_mut(),
            len: 0,
            itemsize: 0,
            readonly: 0,
            ndim: 0,
            format: std::ptr::null_mut(),
            shape: std::ptr::null_mut(),
            strides: std::ptr::null_mut(),
            suboffsets: std::ptr::null_mut(),
            internal: std::ptr::null_mut(),
        });
        // SAFETY: `obj` is a live object and the GIL is held (the Bound
        // proves both); `raw` is a writable Py_buffer of CPython's layout.
        let rc = unsafe { PyObject_GetBuffer(obj.as_ptr(), &mut *raw, PYBUF_RECORDS_RO) };
        if rc != 0 {
            return Err(PyErr::fetch(obj.py()));
        }
        Ok(Export { raw })
    }

    /// Entry `i` of the export's `shape` or `strides` array.
    fn dim(&self, p: *mut Py_ssize_t, i: usize) -> isize {
        debug_assert!(!p.is_null() && i < self.raw.ndim.max(0) as usize);
        // SAFETY: a successful export with PyBUF_STRIDES has `ndim` shape
        // and stride entries, alive until the release (`self` lives).
        unsafe { *p.add(i) }
    }

    /// The exported memory's shape.
    pub(crate) fn shape(&self) -> Vec<usize> {
        let r = &*self.raw;
        if r.ndim == 0 {
            // A 0-d array (numpy exports it without a shape): shape ().
            return Vec::new();
        }
        if r.shape.is_null() {
            return vec![(r.len / r.itemsize.max(1)) as usize];
        }
        (0..r.ndim.max(0) as usize).map(|i| self.dim(r.shape, i).max(0) as usize).collect()
    }

    /// The exported memory's layout.
    pub(crate) fn layout(&self) -> Layout<'_> {
        let r = &*self.raw;
        let ndim = r.ndim.max(0) as usize;
        let itemsize = r.itemsize.max(0) as usize;
        // C order: each dimension's stride is the product of the later
        // dimensions' sizes (dimensions of size 1 may have any stride).
        let c_contiguous = r.suboffsets.is_null()
            && (r.shape.is_null() || r.strides.is_null() || {
                let mut want = itemsize as isize;
                let mut ok = true;
                let mut empty = false;
                for i in (0..ndim).rev() {
                    let d = self.dim(r.shape, i);
                    empty |= d == 0;
                    if d != 1 && self.dim(r.strides, i) != want {
                        ok = false;
                    }
                    want *= d;
                }
                ok || empty
            });
        let format = if r.format.is_null() {
            "B"
        } else {
            // SAFETY: a NUL-terminated string owned by the exporter, alive
            // until the release (the returned layout borrows self).
            unsafe { CStr::from_ptr(r.format) }.to_str().unwrap_or("?unknown")
        };
        Layout {
            ptr: r.buf.cast(),
            len: r.len.max(0) as usize,
            itemsize,
            readonly: r.readonly != 0,
            format,
            c_contiguous,
        }
    }
}

impl Drop for Export {
    fn drop(&mut self) {
        // SAFETY: `raw` holds a successful export not yet released; the
        // GIL is held (an Export never leaves the call that made it: it is
        // not Send, and lives inside a `Tensor<'py>`).
        unsafe { PyBuffer_Release(&mut *self.raw) };
    }
}
