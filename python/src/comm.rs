//! `new_comm` and the communicator's state: the Rust `Comm` behind a
//! mutex, its worker for async operations, and the group its windows are
//! made over. The Python methods are in [`collectives`](crate::collectives).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use rmacomm_collectives::{Comm, CommOptions};
use rmacomm_window::{Group, LaunchEnv, Store};

use crate::errors::{py_err, ErrKind, Failure};
use crate::store;
use crate::tensor::Tensor;
use crate::timeout;
use crate::work::{PyWork, State};
use crate::worker::{Op, Worker};

/// What a `Comm` object holds.
pub(crate) struct CommShared {
    pub(crate) comm: Arc<Mutex<Comm>>,
    /// A split of the communicator's group for windows: group operations
    /// of its own, so that creating a window never waits for the
    /// communicator's mutex (held by a running collective).
    pub(crate) meta: Group,
    pub(crate) rank: usize,
    pub(crate) size: usize,
    pub(crate) name: String,
    pub(crate) timeout: Duration,
    pub(crate) worker: Worker,
    /// The NCCL / RCCL side of a `new_comm("nccl")` communicator.
    pub(crate) nccl: std::sync::OnceLock<crate::nccl_backend::NcclState>,
    /// The native backend's GPU collectives (made by the first collective
    /// on CUDA tensors: every rank reaches it at the same call).
    pub(crate) gpu: Mutex<Option<rmacomm_collectives::GpuComm>>,
    /// send/recv of CUDA tensors: a GPU communicator per pair of ranks
    /// (made by the pair's first send/recv, which only the two reach: a
    /// two-rank group in the store's key space for the pair, as torch
    /// makes NCCL point-to-point communicators).
    pub(crate) gpu_pairs: Mutex<std::collections::HashMap<usize, rmacomm_collectives::GpuComm>>,
}

impl Drop for CommShared {
    /// The GPU side's ends wait for the device, and for peers up to the
    /// timeout (NCCL's finalize, then abort; GpuComm's drain of what its
    /// watchdog releases): with the GIL released when this thread holds it
    /// (a `Comm`'s deallocation), so other Python threads run meanwhile.
    fn drop(&mut self) {
        let gpu = self.gpu.get_mut().unwrap_or_else(|e| e.into_inner()).take();
        let pairs = std::mem::take(self.gpu_pairs.get_mut().unwrap_or_else(|e| e.into_inner()));
        let nccl = self.nccl.take();
        if gpu.is_none() && pairs.is_empty() && nccl.is_none() {
            return;
        }
        crate::runtime::end_without_gil(move || drop((gpu, pairs, nccl)));
    }
}

/// A communicator (torchcomms' `TorchComm`): every collective over the
/// ranks of a job, on CPU numpy arrays and torch tensors. Made by
/// `rmacomm.new_comm`.
#[pyclass(frozen, module = "rmacomm", name = "Comm")]
pub(crate) struct PyComm {
    pub(crate) shared: Arc<CommShared>,
}

impl PyComm {
    pub(crate) fn from_comm(py: Python<'_>, comm: Comm) -> PyResult<PyComm> {
        let meta = py
            .detach(|| {
                let all: Vec<usize> = (0..comm.size()).collect();
                comm.group().split(&all)
            })
            .map_err(py_err)?
            .expect("every rank is listed");
        Ok(PyComm {
            shared: Arc::new(CommShared {
                rank: comm.rank(),
                size: comm.size(),
                name: comm.name().to_string(),
                timeout: comm.timeout(),
                comm: Arc::new(Mutex::new(comm)),
                meta,
                worker: Worker::default(),
                nccl: std::sync::OnceLock::new(),
                gpu: Mutex::new(None),
                gpu_pairs: Mutex::new(std::collections::HashMap::new()),
            }),
        })
    }
}

impl CommShared {
    /// Waits for the async operations issued before (every rank runs its
    /// operations in issue order), and leaves their results to their
    /// `Work`s: an earlier operation's failure is not this call's (it used
    /// to raise it instead of running this call, which its peers then
    /// waited for). One that broke the communicator fails this call on its
    /// own. Interrupts (Ctrl-C) still raise.
    pub(crate) fn after_async(&self, py: Python<'_>) -> PyResult<()> {
        if let Some(last) = self.worker.busy() {
            if let Err(e) = PyWork::of(State::Coll(last)).cell.wait(py, None) {
                if !crate::errors::is_comm_error(py, &e) {
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    /// Runs `op` (a collective): on this thread with the GIL released,
    /// after any async operation issued before it; on the worker when
    /// `async_op`, or when a `timeout` for this call bounds the wait. The
    /// worker keeps `keep` (the tensors' references) until `op` is done.
    pub(crate) fn run(
        &self,
        py: Python<'_>,
        name: &str,
        async_op: bool,
        timeout: Option<Duration>,
        keep: &[&Tensor<'_>],
        op: impl FnOnce(&mut Comm) -> Result<(), rmacomm_collectives::Error> + Send + 'static,
    ) -> PyResult<PyWork> {
        let s = self;
        if async_op || timeout.is_some() {
            let refs: Vec<Py<PyAny>> = keep.iter().map(|t| t.keep()).collect();
            let op: Op = Box::new(move |c: &mut Comm| {
                let r = op(c).map_err(Failure::from);
                drop(refs);
                r
            });
            let done = s.worker.submit(&s.comm, &s.name, op).map_err(PyErr::from)?;
            let w = PyWork::of(State::Coll(done));
            if !async_op {
                w.cell.wait(py, timeout).map_err(|e| rename_timeout(py, e, name, timeout))?;
                return Ok(PyWork::done());
            }
            return Ok(w);
        }
        let op = move |c: &mut Comm| op(c).map_err(Failure::from);
        s.after_async(py)?;
        let comm = &s.comm;
        let r = py.detach(move || op(&mut comm.lock().unwrap_or_else(|e| e.into_inner())));
        py.check_signals()?;
        r.map_err(PyErr::from)?;
        Ok(PyWork::done())
    }
}

fn rename_timeout(py: Python<'_>, e: PyErr, name: &str, timeout: Option<Duration>) -> PyErr {
    if e.get_type(py).name().is_ok_and(|n| n == "TimeoutError") && e.to_string().contains("Work.wait") {
        return Failure::new(
            ErrKind::Timeout,
            format!(
                "{name}: not complete after {:?} (this call's timeout); it goes on in the background and later \
                 operations of the communicator queue behind it",
                timeout.unwrap_or_default()
            ),
        )
        .into();
    }
    e
}

/// Which rank and size a store-bootstrapped communicator has: the
/// launcher's variables (torchrun, rmacomm-run, Open MPI, Slurm), which
/// `rank` / `world_size` override.
fn rank_and_size(rank: Option<usize>, size: Option<usize>) -> PyResult<(usize, usize)> {
    if let (Some(r), Some(s)) = (rank, size) {
        return Ok((r, s));
    }
    // The store is given: MASTER_ADDR/MASTER_PORT need not be set.
    let env = LaunchEnv::detect(&|k: &str| {
        std::env::var(k).ok().or_else(|| match k {
            "MASTER_ADDR" => Some("unused".into()),
            "MASTER_PORT" => Some("1".into()),
            _ => None,
        })
    })
    .map_err(py_err)?;
    Ok((rank.unwrap_or(env.rank), size.unwrap_or(env.world_size)))
}

/// Creates a communicator (collective: every rank calls it), torchcomms'
/// `new_comm`.
///
/// Args:
///     backend: "rdma" (also "rmacomm"), or "nccl" / "rccl": the rdma
///         communicator plus an NCCL (RCCL) one, loaded at run time, for
///         CUDA tensors in all_reduce, reduce, broadcast, all_gather_single,
///         reduce_scatter_single, all_to_all_single, send and recv (queued
///         on torch's current stream). A missing library, driver or device
///         on any rank: `rmacomm.UnavailableError` naming it. NCCL's init
///         is bounded by `timeout`: a rank that dies or never reaches it is
///         a `rmacomm.TimeoutError` naming it on the others, a rank whose
///         init fails an `UnavailableError` naming it.
///     device: "cpu" (a string or a torch.device); for "nccl", "cuda:N"
///         (default: torch's current CUDA device).
///     store: the bootstrap store: `rmacomm.TcpStore`, a
///         torch.distributed store, or any object with set/get/wait (and
///         add, check, delete_key when it has them). Default: bootstrap
///         from the launcher's environment (torchrun, rmacomm-run, mpirun,
///         srun: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); rank 0 hosts
///         the store.
///     name: the communicator's name (default "rdma<n>").
///     timeout: timedelta or seconds: every operation's limit (default
///         RMACOMM_TIMEOUT_SECONDS, else 600 s).
///     hints: string map; "rmacomm::algo" = "oneshot" | "direct" | "ring"
///         picks the all_reduce algorithm.
///     abort_process_on_timeout_or_error: print the error and abort the
///         process instead of raising (default RMACOMM_ABORT_ON_ERROR, else
///         False), so that a launcher stops every rank.
///     rank, world_size: with a store, this rank and the job's size when
///         no launcher variables say so.
#[pyfunction]
#[pyo3(signature = (
    backend="rdma", device=None, *, store=None, name=None, timeout=None, hints=None,
    abort_process_on_timeout_or_error=None, rank=None, world_size=None
))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn new_comm(
    py: Python<'_>,
    backend: &str,
    device: Option<&Bound<'_, PyAny>>,
    store: Option<&Bound<'_, PyAny>>,
    name: Option<String>,
    timeout: Option<&Bound<'_, PyAny>>,
    hints: Option<HashMap<String, String>>,
    abort_process_on_timeout_or_error: Option<bool>,
    rank: Option<usize>,
    world_size: Option<usize>,
) -> PyResult<PyComm> {
    let gpu = matches!(backend, "nccl" | "rccl");
    let mut ordinal = None;
    if let Some(d) = device.filter(|d| !d.is_none()) {
        let d = d.str()?.to_string();
        if gpu {
            // "cuda" alone is torch's current device, as torch.device("cuda")
            // means (each rank of a host on its own GPU after set_device).
            ordinal = cuda_ordinal(&d)?;
        } else if d != "cpu" && !d.starts_with("cpu:") {
            return Err(Failure::new(
                ErrKind::Unavailable,
                format!(
                    "device {d:?}: an rdma communicator's device is CPU memory only (CUDA tensors work \
                     with it as they are: windows and native GPU collectives; or backend=\"nccl\"); use \
                     device=\"cpu\""
                ),
            )
            .into());
        }
    }
    let mut opts = CommOptions::new();
    if let Some(t) = timeout::duration(timeout, "timeout")? {
        opts = opts.timeout(t);
    }
    if let Some(n) = name {
        opts = opts.name(n);
    }
    for (k, v) in hints.unwrap_or_default() {
        opts = opts.hint(k, v);
    }
    if let Some(a) = abort_process_on_timeout_or_error {
        opts = opts.abort_process_on_timeout_or_error(a);
    }
    let requested = backend.to_string();
    // The NCCL backends ride on the rdma communicator (bootstrap, CPU
    // tensors, windows).
    let backend = if gpu { "rdma".to_string() } else { requested.clone() };
    let comm = match store.filter(|s| !s.is_none()) {
        None => {
            if rank.is_some() || world_size.is_some() {
                return Err(PyValueError::new_err("rank and world_size are for a store-bootstrapped communicator"));
            }
            py.detach(|| rmacomm_collectives::new_comm(&backend, opts)).map_err(py_err)?
        }
        Some(s) => {
            if backend != "rdma" && backend != "rmacomm" {
                // The library's error for other backends, before any wait.
                let e = py.detach(|| rmacomm_collectives::new_comm(&backend, CommOptions::new()).err());
                return Err(py_err(e.expect("only rdma and rmacomm are available")));
            }
            let (r, n) = rank_and_size(rank, world_size)?;
            let store: Arc<dyn Store> = store::from_py(s, r, n)?;
            let group = py.detach(|| Group::new(r, n, store)).map_err(py_err)?;
            py.detach(|| Comm::new(&group, opts)).map_err(py_err)?
        }
    };
    let c = PyComm::from_comm(py, comm)?;
    if gpu {
        let ordinal = match ordinal {
            Some(o) => o,
            None => current_cuda_device(py)?,
        };
        let st = crate::nccl_backend::setup(py, &requested, ordinal, &c.shared.meta)?;
        let _ = c.shared.nccl.set(st);
    }
    Ok(c)
}

/// The ordinal of a device named "cuda:N" (or a torch.device); `None` for
/// "cuda" (torch's current device).
fn cuda_ordinal(d: &str) -> PyResult<Option<u32>> {
    match d.strip_prefix("cuda") {
        Some("") => Ok(None),
        Some(rest) => rest.strip_prefix(':').and_then(|n| n.parse().ok()).map(Some).ok_or_else(|| {
            Failure::new(ErrKind::Argument, format!("device {d:?}: expected \"cuda\" or \"cuda:N\"")).into()
        }),
        None => Err(Failure::new(
            ErrKind::Argument,
            format!("device {d:?}: the nccl backend moves CUDA tensors; use device=\"cuda:N\""),
        )
        .into()),
    }
}

/// torch's current CUDA device when torch is imported and has CUDA, else 0.
fn current_cuda_device(py: Python<'_>) -> PyResult<u32> {
    let Some(torch) = crate::tensor::torch_module(py)? else { return Ok(0) };
    let cuda = torch.getattr("cuda")?;
    if !cuda.call_method0("is_available")?.is_truthy()? {
        return Ok(0);
    }
    cuda.call_method0("current_device")?.extract()
}
