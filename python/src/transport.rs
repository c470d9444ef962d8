//! The RDMA transport (torchcomms' `RdmaTransport` on rmacomm): one
//! connection to one peer; `RdmaMemory` registers a tensor, a `View` is a
//! byte range of it, an `RdmaRemoteBuffer` names a peer's registered
//! memory (picklable, to send through any channel).
//!
//! Every operation has a blocking form (the GIL released, Ctrl-C
//! interrupts the wait) and an asyncio form (`await t.write_async(...)`),
//! bridged natively: the operation runs on this module's tokio runtime and
//! completes an asyncio future with `loop.call_soon_threadsafe`; no
//! executor thread waits for it. Cancelling the asyncio future does not
//! cancel the transfer (its memory stays registered until it completes).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyCFunction, PyDict, PyTuple, PyType};
use pyo3::IntoPyObjectExt;
use rmacomm_transport::{RdmaRemoteBuffer, RdmaTransport, TransportConfig, TransportError};

use crate::errors::{py_err, Failure};
use crate::memory::{self, Borrowed, Owner, Registered};
use crate::runtime::rt;
use crate::tensor::Tensor;
use crate::timeout;
use crate::wait;

/// Runs `fut` to completion on the runtime, the GIL released, in slices.
fn block<T: Send>(py: Python<'_>, fut: impl Future<Output = Result<T, TransportError>> + Send) -> PyResult<T> {
    let mut fut = Box::pin(fut);
    let r =
        wait::sliced(py, None, |slice| rt().block_on(async { tokio::time::timeout(slice, fut.as_mut()).await.ok() }))?;
    r.expect("no deadline").map_err(py_err)
}

/// Sets an asyncio future's result or exception unless it was cancelled
/// (called on the event loop's thread).
#[pyfunction]
fn complete(fut: &Bound<'_, PyAny>, ok: bool, value: &Bound<'_, PyAny>) -> PyResult<()> {
    let py = fut.py();
    if fut.call_method0(intern!(py, "done"))?.is_truthy()? {
        return Ok(());
    }
    if ok {
        fut.call_method1(intern!(py, "set_result"), (value,))?;
    } else {
        fut.call_method1(intern!(py, "set_exception"), (value,))?;
    }
    Ok(())
}

/// The running asyncio loop and a new future of it.
fn loop_future(py: Python<'_>) -> PyResult<(Bound<'_, PyAny>, Bound<'_, PyAny>)> {
    let lp = py
        .import(intern!(py, "asyncio"))?
        .call_method0(intern!(py, "get_running_loop"))
        .map_err(|_| PyRuntimeError::new_err("the *_async methods must be awaited inside a running asyncio loop"))?;
    let f = lp.call_method0(intern!(py, "create_future"))?;
    Ok((lp, f))
}

/// An asyncio future completed by `fut`, run on the runtime.
pub(crate) fn spawn<'py, T, E>(
    py: Python<'py>,
    fut: impl Future<Output = Result<T, E>> + Send + 'static,
) -> PyResult<Bound<'py, PyAny>>
where
    T: for<'a> IntoPyObject<'a> + Send + 'static,
    E: Into<Failure> + Send + 'static,
{
    let (lp, f) = loop_future(py)?;
    let (lp, pf) = (lp.unbind(), f.clone().unbind());
    let cb = wrap_pyfunction!(complete, py)?.unbind();
    rt().spawn(async move {
        let r = fut.await;
        Python::attach(|py| {
            let (ok, v): (bool, Py<PyAny>) = match r {
                Ok(v) => match v.into_py_any(py) {
                    Ok(o) => (true, o),
                    Err(e) => (false, e.into_value(py).into_any()),
                },
                Err(e) => (false, PyErr::from(e.into()).into_value(py).into_any()),
            };
            // A closed loop has nobody to tell.
            let _ = lp.bind(py).call_method1(intern!(py, "call_soon_threadsafe"), (cb, pf, ok, v));
        });
    });
    Ok(f)
}

/// Registered memory: a numpy array or CPU torch tensor registered for
/// RDMA, zero-copy (the tensor is kept alive while registered; do not
/// resize it). Peers read and write it through its remote buffer.
#[pyclass(frozen, module = "rmacomm", name = "RdmaMemory")]
pub(crate) struct PyRdmaMemory {
    pub(crate) reg: Arc<Registered>,
    tensor: Py<PyAny>,
}

/// Registers a checked tensor's memory zero-copy (published to same-host
/// peers), the registration holding the tensor, or the rmacomm allocation
/// it lies in; `what` names the argument in errors.
pub(crate) fn register_tensor(py: Python<'_>, t: &Tensor<'_>, what: &str) -> PyResult<Arc<Registered>> {
    let reg = register_private(py, t, what)?;
    reg.publish();
    Ok(reg)
}

/// As [`register_tensor`], not published: nothing else finds (and holds)
/// the registration, so its key dies with its last holder — an agent's
/// region, whose deregistration must end peers' access.
pub(crate) fn register_private(py: Python<'_>, t: &Tensor<'_>, what: &str) -> PyResult<Arc<Registered>> {
    let raw = t.raw();
    if raw.len == 0 {
        return Err(PyValueError::new_err(format!("{what}: an empty tensor cannot be registered")));
    }
    let owner = match memory::find(raw.ptr, raw.len) {
        Some(r) => Owner::Mem(r),
        None => Owner::Py(t.keep()),
    };
    // SAFETY: a numpy array or torch tensor (checked by Tensor::new), or an
    // rmacomm allocation, keeps its memory at one address while the owner
    // lives; the registration holds the owner.
    let b = unsafe { Borrowed::new(raw.ptr, raw.len, owner) };
    py.detach(|| Registered::register(b)).map_err(py_err)
}

#[pymethods]
impl PyRdmaMemory {
    #[new]
    fn new(py: Python<'_>, tensor: &Bound<'_, PyAny>) -> PyResult<Self> {
        // Writable memory only: peers write a registration, and so do this
        // side's reads (a numpy array over `bytes` was written through).
        let t = Tensor::new(tensor, "tensor", true)?;
        let reg = register_tensor(py, &t, "tensor")?;
        Ok(PyRdmaMemory { reg, tensor: t.keep() })
    }

    /// A view of `length` bytes at byte `offset` (default: all of it), the
    /// local side of a write or read.
    #[pyo3(signature = (offset=0, length=None))]
    fn to_view(&self, offset: usize, length: Option<usize>) -> PyResult<PyView> {
        let len = length.unwrap_or(self.reg.mem.len().saturating_sub(offset));
        self.reg.mem.view(offset, len).map_err(py_err)?;
        Ok(PyView { reg: self.reg.clone(), offset, len })
    }

    /// What a peer needs to write or read this memory (send it over any
    /// channel: it pickles).
    fn to_remote_buffer(&self) -> PyRemoteBuffer {
        PyRemoteBuffer { rb: self.reg.mem.remote_buffer() }
    }

    /// The registered tensor.
    #[getter]
    fn tensor(&self, py: Python<'_>) -> Py<PyAny> {
        self.tensor.clone_ref(py)
    }

    fn __len__(&self) -> usize {
        self.reg.mem.len()
    }

    fn __repr__(&self) -> String {
        format!("<rmacomm.RdmaMemory {} bytes at {:#x}>", self.reg.mem.len(), self.reg.mem.as_ptr() as usize)
    }
}

/// A byte range of an `RdmaMemory` (from `to_view`).
#[pyclass(frozen, module = "rmacomm", name = "RdmaView")]
pub(crate) struct PyView {
    reg: Arc<Registered>,
    offset: usize,
    len: usize,
}

#[pymethods]
impl PyView {
    /// Byte offset in the memory.
    #[getter]
    fn offset(&self) -> usize {
        self.offset
    }

    fn __len__(&self) -> usize {
        self.len
    }

    fn __repr__(&self) -> String {
        format!("<rmacomm.RdmaView {} bytes at offset {}>", self.len, self.offset)
    }
}

/// A peer's registered memory: address, length and key. Picklable, and
/// `str()` / `RdmaRemoteBuffer.parse()` round-trip it as text.
#[pyclass(frozen, from_py_object, module = "rmacomm", name = "RdmaRemoteBuffer")]
#[derive(Clone, Copy)]
pub(crate) struct PyRemoteBuffer {
    rb: RdmaRemoteBuffer,
}

#[pymethods]
impl PyRemoteBuffer {
    #[new]
    fn new(addr: u64, len: u64, key: u32) -> Self {
        PyRemoteBuffer { rb: RdmaRemoteBuffer { addr, len, key } }
    }

    /// Parses `str(buffer)`.
    #[classmethod]
    fn parse(_cls: &Bound<'_, PyType>, s: &str) -> PyResult<Self> {
        RdmaRemoteBuffer::parse(s)
            .map(|rb| PyRemoteBuffer { rb })
            .ok_or_else(|| PyValueError::new_err(format!("{s:?} is not a remote buffer (addr:len:key in hex)")))
    }

    /// Address in the peer.
    #[getter]
    fn addr(&self) -> u64 {
        self.rb.addr
    }

    /// Length in bytes.
    #[getter]
    fn len(&self) -> u64 {
        self.rb.len
    }

    /// Remote key.
    #[getter]
    fn key(&self) -> u32 {
        self.rb.key
    }

    /// The sub-buffer of `length` bytes at byte `offset`.
    fn slice(&self, offset: u64, length: u64) -> PyResult<Self> {
        self.rb
            .slice(offset, length)
            .map(|rb| PyRemoteBuffer { rb })
            .ok_or_else(|| PyValueError::new_err(format!("{offset}+{length} is outside the {} bytes", self.rb.len)))
    }

    fn __reduce__<'py>(&self, py: Python<'py>) -> PyResult<(Bound<'py, PyType>, (u64, u64, u32))> {
        Ok((py.get_type::<PyRemoteBuffer>(), (self.rb.addr, self.rb.len, self.rb.key)))
    }

    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        other.extract::<PyRef<'_, PyRemoteBuffer>>().is_ok_and(|o| o.rb == self.rb)
    }

    fn __hash__(&self) -> u64 {
        self.rb.addr ^ self.rb.len.rotate_left(17) ^ u64::from(self.rb.key).rotate_left(41)
    }

    fn __str__(&self) -> String {
        self.rb.to_string()
    }

    fn __repr__(&self) -> String {
        format!("RdmaRemoteBuffer.parse({:?})", self.rb.to_string())
    }
}

/// An RDMA connection to one peer (torchcomms' `RdmaTransport`): both
/// sides make one, `bind()` it, exchange the URLs, and `connect` to the
/// other's. Then either side writes into or reads from the other's
/// registered memory; a write with `notify` satisfies one `wait_for_write`
/// on the peer.
///
/// Args:
///     timeout: timedelta or seconds: every operation's limit (default
///         RMACOMM_TIMEOUT_SECONDS, else none).
///     busy_poll: timedelta or seconds to spin before sleeping while
///         waiting (lower latency, more CPU; default 0).
#[pyclass(frozen, module = "rmacomm", name = "RdmaTransport")]
pub(crate) struct PyRdmaTransport {
    t: Arc<RdmaTransport>,
}

type WaitFuture = std::pin::Pin<Box<dyn Future<Output = Result<(), TransportError>> + Send>>;

impl PyRdmaTransport {
    /// `wait_for_write` with `t`, else the transport's timeout.
    fn wait_fut(&self, t: Option<Duration>) -> WaitFuture {
        match t {
            Some(t) => Box::pin(self.t.wait_for_write_with_timeout(Some(t))),
            None => Box::pin(self.t.wait_for_write()),
        }
    }
}

fn view_of(v: &PyView) -> Result<rmacomm_transport::View<'_>, TransportError> {
    v.reg.mem.view(v.offset, v.len)
}

#[pymethods]
impl PyRdmaTransport {
    #[new]
    #[pyo3(signature = (timeout=None, busy_poll=None))]
    fn new(timeout: Option<&Bound<'_, PyAny>>, busy_poll: Option<&Bound<'_, PyAny>>) -> PyResult<Self> {
        let mut cfg = TransportConfig::default();
        if let Some(t) = timeout::duration(timeout, "timeout")? {
            cfg = cfg.with_timeout(Some(t));
        }
        if let Some(b) = timeout::duration(busy_poll, "busy_poll")? {
            cfg = cfg.with_busy_poll(b);
        }
        let _rt = rt().enter();
        Ok(PyRdmaTransport { t: Arc::new(RdmaTransport::new(cfg).map_err(py_err)?) })
    }

    /// Whether a provider is usable (the soft provider always is).
    #[staticmethod]
    fn supported() -> bool {
        RdmaTransport::supported()
    }

    /// The URL to give the peer (carries an unguessable token).
    fn bind(&self) -> PyResult<String> {
        self.t.bind().map_err(py_err)
    }

    /// Connects to the peer's URL (once per transport).
    fn connect(&self, py: Python<'_>, url: &str) -> PyResult<()> {
        block(py, self.t.connect(url))
    }

    /// `connect` for asyncio.
    fn connect_async<'py>(&self, py: Python<'py>, url: String) -> PyResult<Bound<'py, PyAny>> {
        let t = self.t.clone();
        spawn(py, async move { t.connect(&url).await })
    }

    /// Writes `view` into the peer's `remote` buffer (zero-copy); returns
    /// once the data is placed. With `notify`, the peer's `wait_for_write`
    /// returns once for it.
    #[pyo3(signature = (view, remote, notify=false))]
    fn write(&self, py: Python<'_>, view: PyRef<'_, PyView>, remote: PyRemoteBuffer, notify: bool) -> PyResult<()> {
        let v = view_of(&view).map_err(py_err)?;
        block(py, self.t.write(v, &remote.rb, notify))
    }

    /// `write` for asyncio.
    #[pyo3(signature = (view, remote, notify=false))]
    fn write_async<'py>(
        &self,
        py: Python<'py>,
        view: PyRef<'py, PyView>,
        remote: PyRemoteBuffer,
        notify: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        let (t, reg, off, len) = (self.t.clone(), view.reg.clone(), view.offset, view.len);
        spawn(py, async move {
            let v = reg.mem.view(off, len)?;
            t.write(v, &remote.rb, notify).await
        })
    }

    /// Reads the peer's `remote` buffer into `view` (zero-copy).
    fn read(&self, py: Python<'_>, view: PyRef<'_, PyView>, remote: PyRemoteBuffer) -> PyResult<()> {
        let v = view.reg.mem.view_mut(view.offset, view.len).map_err(py_err)?;
        block(py, self.t.read(v, &remote.rb))
    }

    /// `read` for asyncio.
    fn read_async<'py>(
        &self,
        py: Python<'py>,
        view: PyRef<'py, PyView>,
        remote: PyRemoteBuffer,
    ) -> PyResult<Bound<'py, PyAny>> {
        let (t, reg, off, len) = (self.t.clone(), view.reg.clone(), view.offset, view.len);
        spawn(py, async move {
            let v = reg.mem.view_mut(off, len)?;
            t.read(v, &remote.rb).await
        })
    }

    /// Waits for one notifying write from the peer (early ones are kept),
    /// for at most `timeout` (default: the transport's).
    #[pyo3(signature = (timeout=None))]
    fn wait_for_write(&self, py: Python<'_>, timeout: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        let fut = self.wait_fut(timeout::duration(timeout, "timeout")?);
        block(py, fut)
    }

    /// `wait_for_write` for asyncio. A cancelled wait (as
    /// `asyncio.wait_for`'s timeout cancels it) loses nothing: it leaves the
    /// queue at once, and a notification it took meanwhile goes back to the
    /// next wait.
    #[pyo3(signature = (timeout=None))]
    fn wait_for_write_async<'py>(
        &self,
        py: Python<'py>,
        timeout: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let timeout = timeout::duration(timeout, "timeout")?;
        // The loop first: a call refused for want of one takes no
        // notification.
        let (lp, f) = loop_future(py)?;
        let fut = self.wait_fut(timeout);
        let (t, lp, pf) = (self.t.clone(), lp.unbind(), f.clone().unbind());
        let task = rt().spawn(async move {
            let r = fut.await;
            let got = r.is_ok();
            Python::attach(|py| {
                let back = t.clone();
                // On the loop's thread, where the future's state is final.
                let settle = move |args: &Bound<'_, PyTuple>, _: Option<&Bound<'_, PyDict>>| -> PyResult<()> {
                    let py = args.py();
                    let f = pf.bind(py);
                    let done = f.call_method0(intern!(py, "done"))?.is_truthy()?;
                    match (&r, done) {
                        (Ok(()), true) => back.put_back_notification(),
                        (Ok(()), false) => {
                            f.call_method1(intern!(py, "set_result"), (py.None(),))?;
                        }
                        (Err(e), false) => {
                            f.call_method1(intern!(py, "set_exception"), (py_err(e.clone()).into_value(py),))?;
                        }
                        (Err(_), true) => {}
                    }
                    Ok(())
                };
                let posted = PyCFunction::new_closure(py, None, None, settle)
                    .and_then(|cb| lp.bind(py).call_method1(intern!(py, "call_soon_threadsafe"), (cb,)));
                if posted.is_err() && got {
                    // The loop is closed: nobody takes it there.
                    t.put_back_notification();
                }
            });
        });
        // Cancelled: the wait ends now (a notification that raced the end
        // is passed on by the transport itself).
        crate::wait::abort_on_cancel(py, &f, task.abort_handle())?;
        Ok(f)
    }

    /// Whether `connect` succeeded and nothing has broken since.
    fn connected(&self) -> bool {
        self.t.connected()
    }

    fn __repr__(&self) -> String {
        format!("<rmacomm.RdmaTransport connected={}>", self.t.connected())
    }
}
