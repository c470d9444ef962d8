//! `TransferAgent`: the Rust transfer agent (`rmacomm-agent`) for Python —
//! one agent per process, many peers, memory registered once, a request
//! is a list of (local block, remote block) pieces moved as one unit and
//! followed by one notification.
//!
//! Local memory is registered zero-copy, as `RdmaMemory` does (numpy
//! arrays, CPU torch tensors, `RdmaMemory` objects), or by address
//! (`register_address`, what NIXL's descriptors need). A piece's local
//! side is found by its address among this agent's regions, so any
//! array or tensor viewing registered memory — a slice, a reshaped view —
//! is a valid local block.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use futures::StreamExt;
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyCFunction, PyDict, PyTuple};
use rmacomm_agent::{AgentConfig, Op, OwnedBlock, RemoteBlock, TransferAgent};
use rmacomm_transport::TransportConfig;

use crate::agent_transfer::{failure, PyAgentTransfer};
use crate::errors::{py_err, ErrKind, Failure};
use crate::memory::{self, Borrowed, Owner, Registered};
use crate::runtime::rt;
use crate::tensor::Tensor;
use crate::timeout;
use crate::transport::PyRdmaMemory;
use crate::wait;

/// A region of this agent: the registration and what it was made from.
struct Region {
    id: u32,
    start: usize,
    len: usize,
    reg: Arc<Registered>,
    /// The array, tensor or `RdmaMemory` registered (None: by address).
    obj: Option<Py<PyAny>>,
}

/// The agent, dropped inside the runtime (its listener and connections
/// are tasks there).
struct Entered(Option<TransferAgent>);

impl Drop for Entered {
    fn drop(&mut self) {
        let _g = rt().enter();
        drop(self.0.take());
    }
}

/// A transfer agent (rmacomm-agent): one per process, many peers, memory
/// registered once; a request moves a list of (local block, remote block)
/// pieces as one unit, then delivers one notification to the peer.
///
/// Args:
///     name: unique among the agents that talk to each other (1 to 256 bytes).
///     qps: QPs each peer's connection stripes over (default 1).
///     timeout: timedelta or seconds bounding every piece and notification
///         (default RMACOMM_TIMEOUT_SECONDS, else none).
///     connect_timeout: how long making a connection may take (default:
///         `timeout`, else 30 s).
///     notification_slots: notifications per peer that may be in flight
///         before the sender waits for the receiver's agent (default 32).
///     listen_addr: "host:port" of the handshake listener (default: the
///         soft transport's addresses; set it on hardware hosts).
///     frag_size: bytes per fragment a large piece is cut into.
///     max_in_flight: fragments in flight per connection.
///     busy_poll: timedelta or seconds to spin before sleeping.
#[pyclass(frozen, module = "rmacomm", name = "TransferAgent")]
pub(crate) struct PyTransferAgent {
    agent: Entered,
    /// Sorted by start address.
    regions: Mutex<Vec<Region>>,
    /// Notifications taken off the agent's queue for an asyncio wait that
    /// was cancelled before they arrived: the next taker gets them first.
    stash: Stash,
}

type Stash = Arc<Mutex<VecDeque<(String, Vec<u8>)>>>;

fn lock_stash(s: &Stash) -> std::sync::MutexGuard<'_, VecDeque<(String, Vec<u8>)>> {
    s.lock().unwrap_or_else(|e| e.into_inner())
}

fn parse_op(op: &Bound<'_, PyAny>) -> PyResult<(Op, &'static str)> {
    let s: String = op.extract().map_err(|_| PyTypeError::new_err("op must be \"WRITE\" or \"READ\""))?;
    match s.to_ascii_uppercase().as_str() {
        "WRITE" => Ok((Op::Write, "WRITE")),
        "READ" => Ok((Op::Read, "READ")),
        _ => Err(PyValueError::new_err(format!("op must be \"WRITE\" or \"READ\", not {s:?}"))),
    }
}

/// A name or metadata given as str or bytes.
fn text(obj: &Bound<'_, PyAny>, arg: &str) -> PyResult<String> {
    if let Ok(b) = obj.cast::<PyBytes>() {
        return String::from_utf8(b.as_bytes().to_vec())
            .map_err(|_| PyValueError::new_err(format!("{arg} is not UTF-8 text")));
    }
    obj.extract::<String>().map_err(|_| PyTypeError::new_err(format!("{arg} must be str or bytes")))
}

impl PyTransferAgent {
    fn agent(&self) -> &TransferAgent {
        self.agent.0.as_ref().expect("taken only on drop")
    }

    fn unstash(&self) -> Option<(String, Vec<u8>)> {
        lock_stash(&self.stash).pop_front()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Region>> {
        self.regions.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers `reg` with the agent and lists it.
    fn add_region(&self, reg: Arc<Registered>, obj: Option<Py<PyAny>>) -> PyResult<u32> {
        let id = self.agent().register(&reg.mem).map_err(py_err)?;
        let mut regions = self.lock();
        if !regions.iter().any(|r| r.id == id) {
            let (start, len) = (reg.mem.as_ptr() as usize, reg.mem.len());
            let at = regions.partition_point(|r| r.start <= start);
            regions.insert(at, Region { id, start, len, reg, obj });
        }
        Ok(id)
    }
}

/// The region of `regions` (sorted by start) that holds `ptr..ptr+len`.
fn find_region(regions: &[Region], ptr: usize, len: usize) -> Option<usize> {
    let end = ptr.checked_add(len)?;
    let holds = |r: &Region| r.start <= ptr && end <= r.start + r.len;
    let i = regions.partition_point(|r| r.start <= ptr);
    if i > 0 && holds(&regions[i - 1]) {
        return Some(i - 1);
    }
    // Nested or overlapping registrations: look at the others.
    regions[..i].iter().rposition(holds)
}

#[pymethods]
impl PyTransferAgent {
    #[new]
    #[pyo3(signature = (name, *, qps=None, timeout=None, connect_timeout=None, notification_slots=None,
                        listen_addr=None, frag_size=None, max_in_flight=None, busy_poll=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        name: &str,
        qps: Option<u32>,
        timeout: Option<&Bound<'_, PyAny>>,
        connect_timeout: Option<&Bound<'_, PyAny>>,
        notification_slots: Option<u32>,
        listen_addr: Option<&str>,
        frag_size: Option<u32>,
        max_in_flight: Option<usize>,
        busy_poll: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let mut t = TransportConfig::default();
        if let Some(q) = qps {
            t = t.with_qps(q);
        }
        if let Some(d) = timeout::duration(timeout, "timeout")? {
            t = t.with_timeout(Some(d));
        }
        if let Some(f) = frag_size {
            t = t.with_frag_size(f);
        }
        if let Some(m) = max_in_flight {
            t = t.with_max_in_flight(m);
        }
        if let Some(b) = timeout::duration(busy_poll, "busy_poll")? {
            t = t.with_busy_poll(b);
        }
        let piece_timeout = t.timeout;
        let mut cfg = AgentConfig::default().with_transport(t);
        match timeout::duration(connect_timeout, "connect_timeout")? {
            Some(c) => cfg = cfg.with_connect_timeout(c),
            None => {
                if let Some(p) = piece_timeout {
                    cfg = cfg.with_connect_timeout(p);
                }
            }
        }
        if let Some(n) = notification_slots {
            cfg = cfg.with_notification_slots(n);
        }
        if let Some(a) = listen_addr {
            let addr: SocketAddr = a.parse().map_err(|_| {
                PyValueError::new_err(format!("listen_addr {a:?} is not host:port (e.g. \"10.0.0.5:0\")"))
            })?;
            cfg = cfg.with_listen_addr(Some(addr));
        }
        let _g = rt().enter();
        let agent = TransferAgent::new(name, cfg).map_err(py_err)?;
        Ok(PyTransferAgent { agent: Entered(Some(agent)), regions: Mutex::new(Vec::new()), stash: Stash::default() })
    }

    /// The agent's name.
    #[getter]
    fn name(&self) -> &str {
        self.agent().name()
    }

    /// This agent's metadata (a printable string: name, handshake
    /// addresses, registered regions, a token). Give it to peers
    /// (`add_peer`); take it again after registering more memory. It is a
    /// credential: whoever holds it can read and write the regions.
    fn metadata(&self) -> String {
        self.agent().metadata()
    }

    /// Registers memory zero-copy — a numpy array, a torch tensor (CPU or
    /// CUDA) or an `RdmaMemory` (contiguous; kept alive while registered;
    /// do not resize it) — and returns its region id, by which peers name
    /// blocks of it. Usable toward every peer. A CUDA tensor's blocks move
    /// through the transport: device to device through CUDA IPC with a peer
    /// on this host, staged through pinned host memory with one on another
    /// (soft provider); a transfer does not wait for work queued on torch's
    /// streams (synchronize first).
    ///
    /// Each region is a registration of the agent's own (a key of its own,
    /// not shared with the `RdmaMemory` given or with other regions over
    /// the same memory): after `deregister` and the transfers in flight,
    /// peers' transfers into it fail. Registering the same object again
    /// returns its region. Read-only memory (a numpy array over `bytes`) is
    /// refused: peers write registered regions.
    fn register(&self, py: Python<'_>, memory: &Bound<'_, PyAny>) -> PyResult<u32> {
        // The same object again: its region.
        if let Some(r) = self.lock().iter().find(|r| r.obj.as_ref().is_some_and(|o| o.bind(py).is(memory))) {
            return Ok(r.id);
        }
        if let Ok(m) = memory.cast::<PyRdmaMemory>() {
            let held = &m.get().reg;
            let (ptr, len) = (held.mem.as_ptr(), held.mem.len());
            // SAFETY: the RdmaMemory's registration, held by the new one,
            // keeps its memory allocated at this address.
            let b = unsafe { Borrowed::new(ptr, len, Owner::Mem(held.clone())) };
            let reg = py.detach(|| Registered::register(b)).map_err(py_err)?;
            return self.add_region(reg, Some(memory.clone().unbind()));
        }
        if let Some(t) = crate::cuda_tensor::of(memory, "memory")? {
            let reg = py.detach(|| Registered::cuda(t)).map_err(py_err)?;
            // Kept as the object registered: registering it again, and
            // `deregister(tensor)`, find its region (they did not).
            return self.add_region(reg, Some(memory.clone().unbind()));
        }
        let t = Tensor::new(memory, "memory", true)?;
        let reg = crate::transport::register_private(py, &t, "memory")?;
        self.add_region(reg, Some(t.keep()))
    }

    /// Registers `length` bytes at address `addr` of this process (NIXL's
    /// registration of raw descriptors) and returns the region id. Nothing
    /// keeps that memory alive: the caller must keep it allocated, at that
    /// address, until `deregister` and every transfer using it are done —
    /// as with NIXL, and as with any address handed to C.
    ///
    /// `device=N`: the address is CUDA device memory of GPU `N` (NIXL's
    /// "VRAM" descriptors: `(addr, len, devId)`), checked with the driver
    /// (device memory of that GPU, inside one allocation); its blocks move
    /// as a registered CUDA tensor's do.
    #[pyo3(signature = (addr, length, device=None))]
    fn register_address(&self, py: Python<'_>, addr: usize, length: usize, device: Option<u32>) -> PyResult<u32> {
        if addr == 0 || length == 0 {
            return Err(PyValueError::new_err(format!(
                "register_address: address {addr:#x}, length {length}: neither may be 0"
            )));
        }
        if addr.checked_add(length).is_none() {
            return Err(PyValueError::new_err("register_address: addr + length overflows"));
        }
        if let Some(gpu) = device {
            // SAFETY: the caller's promise, as below, for device memory.
            let reg = py.detach(|| unsafe { Registered::cuda_address(addr as u64, length, gpu) }).map_err(py_err)?;
            return self.add_region(reg, None);
        }
        let ptr = addr as *mut u8;
        let owner = memory::find(ptr, length).map(Owner::Mem).unwrap_or(Owner::Caller);
        // SAFETY: the caller's promise (the docstring, docs/python.md):
        // the range stays allocated at this address until the
        // registration is dropped, which happens after deregister and
        // after every transfer that used it ended (they hold the Arc).
        let b = unsafe { Borrowed::new(ptr, length, owner) };
        let reg = py.detach(|| Registered::register(b)).map_err(py_err)?;
        self.add_region(reg, None)
    }

    /// Forgets a region (given by id, or as the object registered): it
    /// leaves the metadata and may no longer be a local block. Transfers
    /// in flight keep its memory registered until they end. Returns
    /// whether it was registered.
    fn deregister(&self, region: &Bound<'_, PyAny>) -> PyResult<bool> {
        // Only an int is an id: a 0-d array or one-element tensor converts
        // to one too, and is the object registered.
        let id = if region.is_exact_instance_of::<pyo3::types::PyInt>() { region.extract::<u32>().ok() } else { None };
        let gone = {
            let mut regions = self.lock();
            let at = regions.iter().position(|r| match (id, &r.obj) {
                (Some(id), _) => r.id == id,
                (None, Some(o)) => o.bind(region.py()).is(region),
                (None, None) => false,
            });
            at.map(|i| regions.remove(i))
        };
        Ok(match gone {
            Some(r) => {
                self.agent().deregister(&r.reg.mem);
                true
            }
            None => false,
        })
    }

    /// This agent's regions: a list of (id, address, length).
    fn regions(&self) -> Vec<(u32, usize, usize)> {
        self.lock().iter().map(|r| (r.id, r.start, r.len)).collect()
    }

    /// Adds (or refreshes) a peer from its metadata (str or bytes) and
    /// returns its name. Connects nothing: the first transfer does.
    fn add_peer(&self, metadata: &Bound<'_, PyAny>) -> PyResult<String> {
        let m = text(metadata, "metadata")?;
        self.agent().add_peer(m.trim()).map_err(py_err)
    }

    /// Forgets a peer and closes its connection (its transfers in flight
    /// fail). Returns whether it was known.
    fn remove_peer(&self, name: &Bound<'_, PyAny>) -> PyResult<bool> {
        let n = text(name, "name")?;
        let _g = rt().enter();
        Ok(self.agent().remove_peer(&n))
    }

    /// The known peers' names, sorted.
    fn peers(&self) -> Vec<String> {
        self.agent().peers()
    }

    /// The regions peer `name` published: a list of (id, address in the
    /// peer, length).
    fn peer_regions(&self, name: &Bound<'_, PyAny>) -> PyResult<Vec<(u32, u64, u64)>> {
        let n = text(name, "name")?;
        let regions = self.agent().peer_regions(&n).map_err(py_err)?;
        Ok(regions.into_iter().map(|r| (r.id, r.addr, r.len)).collect())
    }

    /// Whether a live connection to peer `name` exists now.
    fn is_connected(&self, name: &Bound<'_, PyAny>) -> PyResult<bool> {
        Ok(self.agent().is_connected(&text(name, "name")?))
    }

    /// Connects to peer `name` now (optional: the first transfer does),
    /// waiting with the GIL released.
    fn connect(&self, py: Python<'_>, name: &Bound<'_, PyAny>) -> PyResult<()> {
        let n = text(name, "name")?;
        let mut fut = Box::pin(self.agent().connect(&n));
        let r = wait::sliced(py, None, |slice| {
            rt().block_on(async { tokio::time::timeout(slice, fut.as_mut()).await.ok() })
        })?;
        r.expect("no deadline").map_err(|e| failure("connect", &n, e).into())
    }

    /// Starts a request: `op` "WRITE" (local blocks into the peer's) or
    /// "READ" (the peer's into local blocks) of every piece — a pair
    /// `(local, (region, offset, length))`, `local` being a numpy array /
    /// CPU torch tensor inside memory registered with this agent, or an
    /// `(address, length)` pair inside it; the remote block names the
    /// peer's region — as one unit, then, with `notify` (bytes, up to 4
    /// KiB), one notification to the peer once all of them are placed.
    ///
    /// Everything is checked first: an error raised here (ArgumentError,
    /// naming the piece and the peer) means nothing moved. Returns an
    /// `AgentTransfer` that runs on its own.
    #[pyo3(signature = (op, peer, pieces, notify=None))]
    fn transfer(
        &self,
        py: Python<'_>,
        op: &Bound<'_, PyAny>,
        peer: &Bound<'_, PyAny>,
        pieces: &Bound<'_, PyAny>,
        notify: Option<&[u8]>,
    ) -> PyResult<PyAgentTransfer> {
        let (op, opname) = parse_op(op)?;
        let peer = text(peer, "peer")?;
        let mut keep: Vec<Arc<Registered>> = Vec::new();
        let mut slot: HashMap<u32, usize> = HashMap::new();
        let mut planned: Vec<(usize, usize, usize, RemoteBlock)> = Vec::new();
        // The pieces are read first, without the regions' lock: reading
        // them runs Python code (a generator, a tensor's attributes) that
        // may let another thread in, which then waited for the lock while
        // holding the GIL (a deadlock).
        let mut wanted: Vec<(usize, usize, (u32, u64, u64))> = Vec::new();
        for (i, item) in pieces.try_iter()?.enumerate() {
            let item = item?;
            let bad = || {
                PyTypeError::new_err(format!(
                    "pieces[{i}] must be a pair (local, (region, offset, length)), local being an array, a tensor \
                         or (address, length)"
                ))
            };
            let (l, r): (Bound<'_, PyAny>, Bound<'_, PyAny>) = item.extract().map_err(|_| bad())?;
            let (ptr, len) = if l.is_instance_of::<PyTuple>() {
                l.extract::<(usize, usize)>().map_err(|_| bad())?
            } else if let Some(t) = crate::cuda_tensor::of(&l, &format!("pieces[{i}][0]"))? {
                // A CUDA tensor: its device address, found in a
                // registered CUDA tensor's region.
                (t.ptr as usize, t.nbytes)
            } else {
                let t = Tensor::new(&l, &format!("pieces[{i}][0]"), op == Op::Read)?;
                (t.ptr as usize, t.nbytes)
            };
            let remote: (u32, u64, u64) = r.extract().map_err(|_| bad())?;
            wanted.push((ptr, len, remote));
        }
        {
            let regions = self.lock();
            for (i, &(ptr, len, (region, offset, length))) in wanted.iter().enumerate() {
                let k = find_region(&regions, ptr, len).ok_or_else(|| {
                    PyErr::from(Failure::new(
                        ErrKind::Argument,
                        format!(
                            "{opname} with peer {peer:?}: piece {i}: the local memory ({len} bytes at {ptr:#x}) lies in \
                             no region registered with this agent (register it first); nothing was transferred"
                        ),
                    ))
                })?;
                let reg = &regions[k];
                let s = *slot.entry(reg.id).or_insert_with(|| {
                    keep.push(reg.reg.clone());
                    keep.len() - 1
                });
                planned.push((s, ptr - reg.start, len, RemoteBlock::new(region, offset, length)));
            }
        }
        let pieces = planned
            .iter()
            .map(|&(s, off, len, rb)| OwnedBlock::new(keep[s].mem.clone(), off, len).map(|b| (b, rb)))
            .collect::<Result<Vec<(OwnedBlock, RemoteBlock)>, _>>()
            .map_err(|e| PyErr::from(failure(opname, &peer, e)))?;
        let agent = self.agent();
        let t = py.detach(|| {
            let _g = rt().enter();
            agent.transfer(op, &peer, &pieces, notify)
        });
        drop(pieces);
        let t = t.map_err(|e| PyErr::from(failure(opname, &peer, e)))?;
        Ok(PyAgentTransfer::drive(t, keep, opname))
    }

    /// Sends peer `peer` a notification (bytes, up to 4 KiB) that moves no
    /// data; returns its `AgentTransfer` (it is sent whether or not the
    /// handle is kept).
    fn notify(&self, peer: &Bound<'_, PyAny>, message: &[u8]) -> PyResult<PyAgentTransfer> {
        let peer = text(peer, "peer")?;
        let _g = rt().enter();
        let t = self.agent().notify(&peer, message).map_err(|e| PyErr::from(failure("NOTIFY", &peer, e)))?;
        Ok(PyAgentTransfer::drive(t, Vec::new(), "NOTIFY"))
    }

    /// Takes every notification received and not yet taken, without
    /// waiting: a list of (peer name, message bytes), in arrival order.
    fn get_notifications<'py>(&self, py: Python<'py>) -> Vec<(String, Bound<'py, PyBytes>)> {
        let mut out: Vec<(String, Vec<u8>)> = lock_stash(&self.stash).drain(..).collect();
        out.extend(self.agent().try_notifications().into_iter().map(|n| (n.peer, n.message)));
        out.into_iter().map(|(p, m)| (p, PyBytes::new(py, &m))).collect()
    }

    /// Waits for the next notification (the GIL released, Ctrl-C
    /// interrupts), for at most `timeout` (timedelta or seconds; default
    /// no limit): (peer name, message bytes). `TimeoutError` if none came.
    #[pyo3(signature = (timeout=None))]
    fn wait_notification<'py>(
        &self,
        py: Python<'py>,
        timeout: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<(String, Bound<'py, PyBytes>)> {
        let limit = timeout::duration(timeout, "timeout")?;
        if let Some((peer, msg)) = self.unstash() {
            return Ok((peer, PyBytes::new(py, &msg)));
        }
        // Past the clock's range (timeout=sys.maxsize): no deadline, not a panic.
        let deadline = limit.and_then(|t| Instant::now().checked_add(t));
        let mut stream = self.agent().notifications();
        let stash = &self.stash;
        let r = wait::sliced(py, deadline, |slice| {
            // A cancelled async wait that had taken one meanwhile put it
            // here: looked at between slices.
            if let Some(n) = lock_stash(stash).pop_front() {
                return Some(Some(n));
            }
            rt().block_on(async { tokio::time::timeout(slice, stream.next()).await.ok() })
                .map(|n| n.map(|n| (n.peer, n.message)))
        })?;
        match r {
            Some(Some((peer, msg))) => Ok((peer, PyBytes::new(py, &msg))),
            Some(None) => Err(Failure::new(ErrKind::Comm, "wait_notification: the agent is closed").into()),
            None => Err(Failure::new(
                ErrKind::Timeout,
                format!("wait_notification: no notification within {:?}", limit.unwrap_or_default()),
            )
            .into()),
        }
    }

    /// `wait_notification` for asyncio (no timeout of its own: wrap it in
    /// `asyncio.wait_for`). A cancelled wait stops waiting at once (it
    /// took no notification); one that had taken a notification just as
    /// it was cancelled leaves it to the next call that takes
    /// notifications (a synchronous wait already running looks between
    /// its 100 ms slices; an async wait started before waits for the one
    /// after).
    fn wait_notification_async<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let lp = py.import(intern!(py, "asyncio"))?.call_method0(intern!(py, "get_running_loop")).map_err(|_| {
            PyRuntimeError::new_err("wait_notification_async must be awaited inside a running asyncio loop")
        })?;
        let fut = lp.call_method0(intern!(py, "create_future"))?;
        if let Some((peer, msg)) = self.unstash() {
            fut.call_method1(intern!(py, "set_result"), ((peer, PyBytes::new(py, &msg)),))?;
            return Ok(fut);
        }
        let mut stream = self.agent().notifications();
        let stash = self.stash.clone();
        let (lp, pf) = (lp.unbind(), fut.clone().unbind());
        let task = rt().spawn(async move {
            let n = stream.next().await.map(|n| (n.peer, n.message));
            Python::attach(|py| {
                let (keep, got) = (stash.clone(), n.clone());
                // Runs on the loop's thread, where the future's state is
                // final: a cancelled wait's notification goes to the stash.
                let settle = move |args: &Bound<'_, PyTuple>, _: Option<&Bound<'_, PyDict>>| -> PyResult<()> {
                    let py = args.py();
                    let f = pf.bind(py);
                    let done = f.call_method0(intern!(py, "done"))?.is_truthy()?;
                    match (&got, done) {
                        (Some(n), true) => lock_stash(&keep).push_back(n.clone()),
                        (Some((peer, msg)), false) => {
                            f.call_method1(intern!(py, "set_result"), ((peer, PyBytes::new(py, msg)),))?;
                        }
                        (None, false) => {
                            let e = PyErr::from(Failure::new(
                                ErrKind::Comm,
                                "wait_notification_async: the agent is closed",
                            ));
                            f.call_method1(intern!(py, "set_exception"), (e.into_value(py),))?;
                        }
                        (None, true) => {}
                    }
                    Ok(())
                };
                let posted = PyCFunction::new_closure(py, None, None, settle)
                    .and_then(|cb| lp.bind(py).call_method1(intern!(py, "call_soon_threadsafe"), (cb,)));
                if let (Err(_), Some(n)) = (posted, n) {
                    // The loop is closed: nobody will take it there.
                    lock_stash(&stash).push_back(n);
                }
            });
        });
        // Cancelled (asyncio.wait_for's timeout): the wait ends now. It
        // used to stay first in the queue's line of waiters and take the
        // next notification, which then sat in the stash while a wait
        // already running waited on. Taking one is synchronous within the
        // task's poll, so aborting at its await loses none.
        wait::abort_on_cancel(py, &fut, task.abort_handle())?;
        Ok(fut)
    }

    /// Notifications received and not yet taken.
    fn pending_notifications(&self) -> usize {
        lock_stash(&self.stash).len() + self.agent().pending_notifications()
    }

    /// Counters: transfers, pieces, ops_posted (after coalescing), bytes,
    /// notifications_sent, notifications_received, connections.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.agent().stats();
        let d = PyDict::new(py);
        d.set_item("transfers", s.transfers)?;
        d.set_item("pieces", s.pieces)?;
        d.set_item("ops_posted", s.ops_posted)?;
        d.set_item("bytes", s.bytes)?;
        d.set_item("notifications_sent", s.notifications_sent)?;
        d.set_item("notifications_received", s.notifications_received)?;
        d.set_item("connections", s.connections)?;
        Ok(d)
    }

    fn __repr__(&self) -> String {
        let a = self.agent();
        format!("<rmacomm.TransferAgent {:?} with {} regions, peers {:?}>", a.name(), self.lock().len(), a.peers())
    }
}
