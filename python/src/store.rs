//! The bootstrap store of `new_comm(store=...)`: rmacomm's `TcpStore`
//! (used natively), or any Python object with torch's store methods,
//! bridged into the Rust [`Store`] trait by calls back into Python.
//!
//! # A Python object as the store
//!
//! [`PyStoreAdapter`] implements [`Store`] by taking the GIL and calling
//! the object: `set(key, value)`, `get(key) -> bytes`,
//! `wait(keys, timedelta)`, and, when the object has them, `add`, `check`,
//! `delete_key`, `multi_get` and `compare_set` (torch.distributed's
//! `TCPStore`, `FileStore` and `HashStore` have all of them). Bootstrap is
//! a few dozen store calls per communicator or window, so a call into
//! Python per store operation costs nothing that matters.
//!
//! Groups need an atomic `add` (barrier counters). An object without one
//! gets it emulated with one key per rank: rank r adds to `<key>/#add/<r>`
//! (only r writes it, so a plain set of its running total is atomic), and
//! the counter is the sum of every rank's key. A barrier's "am I last"
//! test then may be true on several ranks, never on none: each rank
//! writes before it reads, so the last writer sees every write. Telling
//! whether a key exists uses `check` when the object has it, else a `wait`
//! of 1 ms.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pyo3::exceptions::PyTypeError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};
use rmacomm_window::{Error, Result, Store, TcpStore};

use crate::errors::{defer, py_err};
use crate::timeout;

/// A Python object used as a [`Store`].
pub(crate) struct PyStoreAdapter {
    obj: Py<PyAny>,
    rank: usize,
    size: usize,
    has_add: bool,
    has_check: bool,
    has_delete: bool,
    has_multi_get: bool,
    has_compare_set: bool,
    /// This rank's totals of emulated counters.
    added: Mutex<HashMap<String, i64>>,
}

impl fmt::Debug for PyStoreAdapter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PyStoreAdapter").field("rank", &self.rank).field("add", &self.has_add).finish()
    }
}

/// What the Python method raised, as a store error (a
/// `KeyboardInterrupt` or `SystemExit` is also kept to be raised again).
fn failed(py: Python<'_>, op: &'static str, key: &str, e: PyErr) -> Error {
    let text = e.to_string();
    let timeout = text.to_ascii_lowercase().contains("timeout")
        || e.get_type(py).name().is_ok_and(|n| n.to_string().to_ascii_lowercase().contains("timeout"));
    if !e.is_instance_of::<pyo3::exceptions::PyException>(py) {
        defer(e);
    }
    if timeout {
        return Error::Timeout {
            waiting_for: format!("store key '{key}' (the Python store said: {text})"),
            after: Duration::ZERO,
        };
    }
    Error::InvalidArgument { op, reason: format!("the Python store's {op}({key:?}) raised {text}") }
}

impl PyStoreAdapter {
    fn call<'py, T>(
        &self,
        py: Python<'py>,
        op: &'static str,
        key: &str,
        f: impl FnOnce(&Bound<'py, PyAny>) -> PyResult<T>,
    ) -> Result<T> {
        f(self.obj.bind(py)).map_err(|e| failed(py, op, key, e))
    }

    fn keys<'py>(py: Python<'py>, keys: &[&str]) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, keys)
    }

    /// Whether `key` is set, at once.
    fn exists(&self, py: Python<'_>, key: &str) -> Result<bool> {
        if self.has_check {
            return self.call(py, "check", key, |o| {
                o.call_method1(intern!(py, "check"), (Self::keys(py, &[key])?,))?.extract()
            });
        }
        let td = timeout::to_timedelta(py, Duration::from_millis(1)).map_err(|e| failed(py, "wait", key, e))?;
        match self
            .obj
            .bind(py)
            .call_method1(intern!(py, "wait"), (Self::keys(py, &[key]).map_err(|e| failed(py, "wait", key, e))?, td))
        {
            Ok(_) => Ok(true),
            Err(e) if e.is_instance_of::<pyo3::exceptions::PyException>(py) => Ok(false),
            Err(e) => Err(failed(py, "wait", key, e)),
        }
    }

    fn get_bytes(&self, py: Python<'_>, key: &str) -> Result<Vec<u8>> {
        self.call(py, "get", key, |o| {
            let v = o.call_method1(intern!(py, "get"), (key,))?;
            match v.extract::<Vec<u8>>() {
                Ok(b) => Ok(b),
                Err(_) => Ok(v.extract::<String>()?.into_bytes()),
            }
        })
    }
}

impl Store for PyStoreAdapter {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        Python::attach(|py| {
            self.call(py, "set", key, |o| o.call_method1(intern!(py, "set"), (key, PyBytes::new(py, value))).map(drop))
        })
    }

    fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        Python::attach(|py| if self.exists(py, key)? { self.get_bytes(py, key).map(Some) } else { Ok(None) })
    }

    fn multi_get(&self, keys: &[&str], timeout: Duration) -> Result<Vec<Vec<u8>>> {
        self.wait(keys, timeout)?;
        Python::attach(|py| {
            if self.has_multi_get {
                let first = keys.first().copied().unwrap_or("");
                return self.call(py, "multi_get", first, |o| {
                    let vals = o.call_method1(intern!(py, "multi_get"), (Self::keys(py, keys)?,))?;
                    vals.try_iter()?.map(|v| v?.extract::<Vec<u8>>()).collect()
                });
            }
            keys.iter().map(|k| self.get_bytes(py, k)).collect()
        })
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let first = keys.first().copied().unwrap_or("");
        Python::attach(|py| {
            let r = self.call(py, "wait", first, |o| {
                o.call_method1(intern!(py, "wait"), (Self::keys(py, keys)?, timeout::to_timedelta(py, timeout)?))
                    .map(drop)
            });
            r.map_err(|e| match e {
                Error::Timeout { waiting_for, .. } => Error::Timeout { waiting_for, after: timeout },
                e => e,
            })
        })
    }

    fn check(&self, keys: &[&str]) -> Result<bool> {
        Python::attach(|py| {
            for k in keys {
                if !self.exists(py, k)? {
                    return Ok(false);
                }
            }
            Ok(true)
        })
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        Python::attach(|py| {
            if self.has_add {
                return self.call(py, "add", key, |o| o.call_method1(intern!(py, "add"), (key, delta))?.extract());
            }
            let mine = {
                let mut added = self.added.lock().unwrap_or_else(|e| e.into_inner());
                let v = added.entry(key.to_string()).or_insert(0);
                *v += delta;
                *v
            };
            self.set_in(py, &format!("{key}/#add/{}", self.rank), mine)?;
            let mut total = mine;
            for r in (0..self.size).filter(|&r| r != self.rank) {
                let k = format!("{key}/#add/{r}");
                if self.exists(py, &k)? {
                    let v = self.get_bytes(py, &k)?;
                    total += std::str::from_utf8(&v).ok().and_then(|s| s.parse::<i64>().ok()).unwrap_or(0);
                }
            }
            Ok(total)
        })
    }

    fn compare_set(&self, key: &str, expected: Option<&[u8]>, desired: &[u8]) -> Result<Option<Vec<u8>>> {
        if !self.has_compare_set {
            return Err(Error::Unsupported {
                op: "compare_set",
                reason: "the Python store object has no compare_set method".into(),
            });
        }
        Python::attach(|py| {
            let before = if self.exists(py, key)? { Some(self.get_bytes(py, key)?) } else { None };
            if before.as_deref() != expected {
                return Ok(before);
            }
            let exp = PyBytes::new(py, expected.unwrap_or_default());
            self.call(py, "compare_set", key, |o| {
                o.call_method1(intern!(py, "compare_set"), (key, exp, PyBytes::new(py, desired))).map(drop)
            })?;
            Ok(before)
        })
    }

    fn delete(&self, key: &str) -> Result<bool> {
        if !self.has_delete {
            // Without delete_key, a finished group's keys stay in the store.
            return Ok(false);
        }
        Python::attach(|py| {
            if !self.has_add {
                for r in 0..self.size {
                    let k = format!("{key}/#add/{r}");
                    self.call(py, "delete_key", &k, |o| o.call_method1(intern!(py, "delete_key"), (&k,)).map(drop))?;
                }
            }
            self.call(py, "delete_key", key, |o| o.call_method1(intern!(py, "delete_key"), (key,))?.extract())
        })
    }
}

impl PyStoreAdapter {
    fn set_in(&self, py: Python<'_>, key: &str, v: i64) -> Result<()> {
        self.call(py, "set", key, |o| {
            o.call_method1(intern!(py, "set"), (key, PyBytes::new(py, v.to_string().as_bytes()))).map(drop)
        })
    }
}

/// The store `obj` names, for `new_comm(store=obj)` as rank `rank` of `size`.
pub(crate) fn from_py(obj: &Bound<'_, PyAny>, rank: usize, size: usize) -> PyResult<Arc<dyn Store>> {
    if let Ok(t) = obj.cast::<PyTcpStore>() {
        return Ok(t.get().inner.clone());
    }
    let has = |m: &str| obj.hasattr(m).unwrap_or(false);
    let missing: Vec<&str> = ["set", "get", "wait"].into_iter().filter(|m| !has(m)).collect();
    if !missing.is_empty() {
        return Err(PyTypeError::new_err(format!(
            "store: {} has no {} method(s); a store needs set(key, value), get(key) and wait(keys, timeout)",
            obj.get_type().name()?,
            missing.join(", ")
        )));
    }
    Ok(Arc::new(PyStoreAdapter {
        obj: obj.clone().unbind(),
        rank,
        size,
        has_add: has("add"),
        has_check: has("check"),
        has_delete: has("delete_key"),
        has_multi_get: has("multi_get"),
        has_compare_set: has("compare_set"),
        added: Mutex::new(HashMap::new()),
    }))
}

/// A TCP key-value store, as torch's `TCPStore`: the master (usually rank
/// 0) serves it on `port` (0 picks a free one, see `port`), the others
/// connect. Pass it to `new_comm(store=...)`; it also has torch's store
/// methods.
///
/// Args:
///     host: the master's host name or address.
///     port: its port.
///     world_size: processes using it (the master keeps serving, when
///         dropped, until the others have hung up; up to 30 s).
///     is_master: serve it from this process.
///     timeout: timedelta or seconds: how long to try to connect, and the
///         default of `wait` / `get` (default 300 s).
#[pyclass(frozen, module = "rmacomm", name = "TcpStore")]
pub(crate) struct PyTcpStore {
    inner: Arc<dyn Store>,
    port: u16,
    timeout: Duration,
}

#[pymethods]
impl PyTcpStore {
    #[new]
    #[pyo3(signature = (host, port, world_size=None, is_master=false, timeout=None))]
    fn new(
        py: Python<'_>,
        host: String,
        port: u16,
        world_size: Option<usize>,
        is_master: bool,
        timeout: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let timeout = timeout::duration(timeout, "timeout")?.unwrap_or(Duration::from_secs(300));
        let s = py.detach(|| TcpStore::new(&host, port, world_size, is_master, timeout)).map_err(py_err)?;
        Ok(PyTcpStore { port: s.port(), inner: Arc::new(s), timeout })
    }

    /// The port it is served on.
    #[getter]
    fn port(&self) -> u16 {
        self.port
    }

    /// Sets `key` to `value` (bytes or str).
    fn set(&self, py: Python<'_>, key: &str, value: &Bound<'_, PyAny>) -> PyResult<()> {
        let v = bytes_or_str(value, "set", "value")?;
        py.detach(|| self.inner.set(key, &v)).map_err(py_err)
    }

    /// The value of `key`, waiting for it up to the store's timeout.
    fn get<'py>(&self, py: Python<'py>, key: &str) -> PyResult<Bound<'py, PyBytes>> {
        let v = py.detach(|| self.inner.get(key, self.timeout)).map_err(py_err)?;
        Ok(PyBytes::new(py, &v))
    }

    /// Waits until every key is set (default: the store's timeout).
    #[pyo3(signature = (keys, timeout=None))]
    fn wait(&self, py: Python<'_>, keys: Vec<String>, timeout: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        let t = timeout::duration(timeout, "timeout")?.unwrap_or(self.timeout);
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        py.detach(|| self.inner.wait(&refs, t)).map_err(py_err)
    }

    /// Whether every key is set, at once.
    fn check(&self, py: Python<'_>, keys: Vec<String>) -> PyResult<bool> {
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        py.detach(|| self.inner.check(&refs)).map_err(py_err)
    }

    /// Adds `amount` to the counter `key` (absent counts as 0); the new value.
    fn add(&self, py: Python<'_>, key: &str, amount: i64) -> PyResult<i64> {
        py.detach(|| self.inner.add(key, amount)).map_err(py_err)
    }

    /// The values of `keys`, waiting for them.
    fn multi_get<'py>(&self, py: Python<'py>, keys: Vec<String>) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let vals = py.detach(|| self.inner.multi_get(&refs, self.timeout)).map_err(py_err)?;
        Ok(vals.iter().map(|v| PyBytes::new(py, v)).collect())
    }

    /// Sets `key` to `desired` if it holds `expected` (b"" for absent, as
    /// torch); returns the value it holds after.
    fn compare_set<'py>(
        &self,
        py: Python<'py>,
        key: &str,
        expected: &Bound<'py, PyAny>,
        desired: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        // str or bytes, as torch's Store (str in its signature) and `set`.
        let expected = bytes_or_str(expected, "compare_set", "expected")?;
        let desired = bytes_or_str(desired, "compare_set", "desired")?;
        let exp = (!expected.is_empty()).then_some(expected.as_slice());
        let before = py.detach(|| self.inner.compare_set(key, exp, &desired)).map_err(py_err)?;
        let now = if before.as_deref() == exp { desired } else { before.unwrap_or_default() };
        Ok(PyBytes::new(py, &now))
    }

    /// Removes `key`; whether it was set.
    fn delete_key(&self, py: Python<'_>, key: &str) -> PyResult<bool> {
        py.detach(|| self.inner.delete(key)).map_err(py_err)
    }

    fn __repr__(&self) -> String {
        format!("<rmacomm.TcpStore port {}>", self.port)
    }
}

/// A store value given as bytes (or a bytes-like object) or str (UTF-8).
fn bytes_or_str(v: &Bound<'_, PyAny>, op: &str, arg: &str) -> PyResult<Vec<u8>> {
    if let Ok(t) = v.extract::<String>() {
        return Ok(t.into_bytes());
    }
    v.extract::<Vec<u8>>().map_err(|_| {
        pyo3::exceptions::PyTypeError::new_err(format!(
            "{op}: {arg} must be bytes or str, not {}",
            v.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into())
        ))
    })
}
