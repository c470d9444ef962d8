//! The `nccl` / `rccl` fallback backends (issue 13): `new_comm("nccl")`
//! makes the rdma communicator (bootstrap, CPU tensors, windows) and, beside
//! it, an NCCL communicator through the run-time loaded library, used for
//! CUDA tensors by all_reduce, reduce, broadcast, all_gather_single,
//! reduce_scatter_single, all_to_all_single, send and recv, queued on
//! torch's current stream of the tensor's device (as torch's NCCL process
//! group queues them). Other collectives on CUDA tensors raise
//! `UnavailableError` naming the call.
//!
//! Setting it up never hangs on a rank that dies or never joins: NCCL's
//! init is bounded by the communicator's timeout, and every rank then
//! reports how its init went through the bootstrap store, so each names
//! the ranks that failed (and why) or never reported.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pyo3::prelude::*;
use rmacomm_collectives::ReduceOp;
use rmacomm_window::cuda::nccl::{Flavor, Library};
use rmacomm_window::cuda::nccl_comm::{self, DataType, NcclComm, RedOp, UniqueId};
use rmacomm_window::cuda::CudaError;
use rmacomm_window::Group;

use crate::cuda_tensor::{self, CudaTensor};
use crate::elem::Elem;
use crate::errors::{py_err, ErrKind, Failure};

/// A communicator's NCCL side.
pub(crate) struct NcclState {
    pub(crate) backend: &'static str,
    pub(crate) device: u32,
    comm: Mutex<NcclComm>,
}

fn unavailable(msg: String) -> PyErr {
    Failure::new(ErrKind::Unavailable, msg).into()
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Option<[u8; 128]> {
    let b = s.as_bytes();
    if b.len() != 256 {
        return None;
    }
    let mut out = [0u8; 128];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(std::str::from_utf8(&b[2 * i..2 * i + 2]).ok()?, 16).ok()?;
    }
    Some(out)
}

/// How much longer than its own init's timeout a rank waits for the other
/// ranks' init results: their inits started when the unique id's exchange
/// ended on each, within this much of one another (a store round trip),
/// so their deadlines pass no later.
const REPORT_GRACE: Duration = Duration::from_secs(5);

/// Sets up the NCCL side (collective over `group`): every rank loads the
/// library and opens `device`; rank 0 makes the unique id; one exchange
/// carries it, or any rank's reason it cannot (then every rank fails,
/// naming that rank); then NCCL's init, bounded by the group's timeout,
/// and a report of its outcome from every rank ([`verdict`]).
pub(crate) fn setup(py: Python<'_>, backend: &str, device: u32, group: &Group) -> PyResult<NcclState> {
    let (flavor, backend) = match backend {
        "rccl" => (Flavor::Rccl, "rccl"),
        _ => (Flavor::Nccl, "nccl"),
    };
    let (rank, size) = (group.rank(), group.size());
    type Prep = (Arc<Library>, Arc<rmacomm_window::cuda::driver::Context>, Option<UniqueId>);
    let prep = || -> Result<Prep, String> {
        let lib = Arc::new(Library::load(flavor).map_err(|e| e.to_string())?);
        let ctx = cuda_tensor::context(device).map_err(|f| f.msg)?;
        let id = if rank == 0 { Some(nccl_comm::unique_id(&lib).map_err(|e| e.to_string())?) } else { None };
        Ok((lib, ctx, id))
    };
    let prep = py.detach(prep);
    let blob = match &prep {
        Ok((_, _, Some(id))) => format!("ok {}", hex(&id.0)),
        Ok(_) => "ok".to_string(),
        Err(why) => format!("err {why}"),
    };
    let all = py.detach(|| group.exchange("nccl_bootstrap", blob.as_bytes())).map_err(py_err)?;
    for (r, v) in all.iter().enumerate() {
        if let Some(why) = String::from_utf8_lossy(v).strip_prefix("err ") {
            return Err(unavailable(format!("new_comm(\"{backend}\"): rank {r} cannot use it: {why}")));
        }
    }
    let (lib, ctx, _) = prep.expect("every rank said ok");
    let text = String::from_utf8_lossy(&all[0]).into_owned();
    let id = text
        .strip_prefix("ok ")
        .and_then(unhex)
        .ok_or_else(|| Failure::new(ErrKind::Comm, "new_comm: rank 0 sent a malformed NCCL unique id"))?;
    let timeout = group.timeout();
    let start = Instant::now();
    let init = py.detach(|| NcclComm::init(lib, ctx, &UniqueId(id), rank, size, timeout));
    let mine = match &init {
        Ok(_) => "ok".to_string(),
        Err(e @ CudaError::Timeout { .. }) => format!("late {e}"),
        Err(e) => format!("err {e}"),
    };
    // Keys of this communicator only (its unique id's digest), in the
    // group's space; a few bytes per rank are left there.
    let keys: Vec<String> = (0..size).map(|r| format!("nccl_init/{:016x}/{r}", digest(&id))).collect();
    let store = group.store();
    let reports = py.detach(|| -> rmacomm_window::Result<Vec<Option<String>>> {
        store.set(&keys[rank], mine.as_bytes())?;
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let left = timeout.saturating_add(REPORT_GRACE.min(timeout)).saturating_sub(start.elapsed());
        let text = |b: Vec<u8>| String::from_utf8_lossy(&b).into_owned();
        match store.multi_get(&refs, left) {
            Ok(all) => Ok(all.into_iter().map(|b| Some(text(b))).collect()),
            Err(rmacomm_window::Error::Timeout { .. }) => {
                refs.iter().map(|k| store.try_get(k).map(|v| v.map(text))).collect()
            }
            Err(e) => Err(e),
        }
    });
    let reports = match reports {
        Ok(r) => r,
        Err(e) => {
            if let Ok(c) = init {
                c.abort();
            }
            return Err(py_err(e));
        }
    };
    match verdict(backend, timeout, &reports) {
        None => {
            let comm = init.expect("this rank reported ok");
            Ok(NcclState { backend, device, comm: Mutex::new(comm) })
        }
        Some(f) => {
            // Another rank gave up on the communicator: its work would
            // never finish, so it ends at once.
            if let Ok(c) = init {
                c.abort();
            }
            Err(f.into())
        }
    }
}

/// Every rank's init result (`None`: none came within the wait) → `None`
/// when all succeeded, else the error every rank raises: the ranks that
/// never reported (a `TimeoutError`: dead, or never at init), else the
/// ranks whose init failed, with the first's reason (a `TimeoutError` when
/// all of them timed out, else `UnavailableError`).
fn verdict(backend: &str, timeout: Duration, reports: &[Option<String>]) -> Option<Failure> {
    let missing: Vec<usize> = (0..reports.len()).filter(|&r| reports[r].is_none()).collect();
    let failed: Vec<(usize, bool, &str)> = reports
        .iter()
        .enumerate()
        .filter_map(|(r, v)| {
            let v = v.as_deref()?;
            v.strip_prefix("late ").map(|w| (r, true, w)).or_else(|| v.strip_prefix("err ").map(|w| (r, false, w)))
        })
        .collect();
    let op = format!("new_comm(\"{backend}\")");
    if !missing.is_empty() {
        let also = match failed.first() {
            Some((r, _, why)) => format!("; rank {r}'s own init: {why}"),
            None => String::new(),
        };
        return Some(Failure::new(
            ErrKind::Timeout,
            format!(
                "{op}: {} did not join the NCCL communicator within {timeout:?} (no init result came from {}: \
                 it died, or never reached NCCL's init){also}",
                ranks(&missing),
                if missing.len() == 1 { "it" } else { "them" },
            ),
        ));
    }
    let (r, _, why) = *failed.iter().find(|f| !f.1).or(failed.first())?;
    let others: Vec<usize> = failed.iter().map(|f| f.0).filter(|&o| o != r).collect();
    let also = if others.is_empty() { String::new() } else { format!(" ({} failed too)", ranks(&others)) };
    let kind = if failed.iter().all(|f| f.1) { ErrKind::Timeout } else { ErrKind::Unavailable };
    Some(Failure::new(kind, format!("{op}: rank {r}'s NCCL init failed{also}: {why}")))
}

/// "rank 1" / "ranks [1, 3]".
fn ranks(rs: &[usize]) -> String {
    match rs {
        [r] => format!("rank {r}"),
        _ => format!("ranks {rs:?}"),
    }
}

/// 64-bit FNV-1a of a unique id: its communicator's name in the store.
fn digest(id: &[u8]) -> u64 {
    id.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3))
}

/// NCCL's type for an element type.
fn data_type(op: &str, e: &Elem) -> PyResult<DataType> {
    Ok(match e.name {
        "float32" => DataType::F32,
        "float64" => DataType::F64,
        "float16" => DataType::F16,
        "bfloat16" => DataType::Bf16,
        "int8" => DataType::I8,
        "uint8" | "bool" => DataType::U8,
        "int32" => DataType::I32,
        "uint32" => DataType::U32,
        "int64" => DataType::I64,
        "uint64" => DataType::U64,
        other => {
            return Err(Failure::new(ErrKind::Argument, format!("{op}: NCCL has no type for {other} tensors")).into())
        }
    })
}

/// NCCL's reduction for a ReduceOp.
fn red_op(op: &str, r: ReduceOp) -> PyResult<RedOp> {
    Ok(match r {
        ReduceOp::Sum => RedOp::Sum,
        ReduceOp::Product => RedOp::Prod,
        ReduceOp::Min => RedOp::Min,
        ReduceOp::Max => RedOp::Max,
        ReduceOp::Avg => RedOp::Avg,
        other => {
            return Err(unavailable(format!(
                "{op}: the NCCL backend has no {other:?} (NCCL reduces with SUM, PRODUCT, MIN, MAX, AVG)"
            )))
        }
    })
}

/// What a collective on CUDA tensors runs on.
pub(crate) struct Call<'a> {
    st: &'a NcclState,
    op: &'static str,
}

impl NcclState {
    /// Checks that `t` is on this communicator's device.
    pub(crate) fn call(&self, op: &'static str, ts: &[&CudaTensor]) -> PyResult<Call<'_>> {
        if let Some(t) = ts.iter().find(|t| t.device != self.device) {
            return Err(Failure::new(
                ErrKind::Argument,
                format!("{op}: the tensor is on cuda:{}, the communicator on cuda:{}", t.device, self.device),
            )
            .into());
        }
        Ok(Call { st: self, op })
    }
}

impl Call<'_> {
    fn run(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut NcclComm, &rmacomm_window::cuda::device::Stream) -> rmacomm_window::cuda::Result<()> + Send,
    ) -> PyResult<()> {
        let stream = cuda_tensor::stream(py, None, self.st.device)?;
        let op = self.op;
        py.detach(|| {
            let mut c = self.st.comm.lock().unwrap_or_else(|e| e.into_inner());
            f(&mut c, &stream)
        })
        .map_err(|e| {
            // A call NCCL still had in progress at the timeout (a peer gone).
            let kind = if matches!(e, CudaError::Timeout { .. }) { ErrKind::Timeout } else { ErrKind::Comm };
            Failure::new(kind, format!("{op}: {e}")).into()
        })
    }

    fn same(&self, a: &CudaTensor, b: &CudaTensor, bytes: usize, why: &str) -> PyResult<()> {
        if a.elem.name != b.elem.name || b.nbytes != bytes {
            return Err(Failure::new(
                ErrKind::Argument,
                format!(
                    "{}: {why} ({} {} bytes and {} {} bytes)",
                    self.op, a.elem.name, a.nbytes, b.elem.name, b.nbytes
                ),
            )
            .into());
        }
        Ok(())
    }

    /// all_reduce in place.
    pub(crate) fn all_reduce(&self, py: Python<'_>, t: &CudaTensor, op: ReduceOp) -> PyResult<()> {
        let (dt, ro) = (data_type(self.op, t.elem)?, red_op(self.op, op)?);
        let (p, n) = (t.ptr, t.nbytes / t.elem.size);
        // SAFETY: the tensor is alive for the call and the work is queued on
        // torch's current stream, which orders its memory's reuse.
        self.run(py, |c, s| unsafe { c.all_reduce(p, p, n, dt, ro, s) })
    }

    /// reduce into `root`'s tensor, in place.
    pub(crate) fn reduce(&self, py: Python<'_>, t: &CudaTensor, op: ReduceOp, root: usize) -> PyResult<()> {
        let (dt, ro) = (data_type(self.op, t.elem)?, red_op(self.op, op)?);
        let (p, n) = (t.ptr, t.nbytes / t.elem.size);
        // SAFETY: as in all_reduce.
        self.run(py, |c, s| unsafe { c.reduce(p, p, n, dt, ro, root, s) })
    }

    /// broadcast from `root`, in place.
    pub(crate) fn broadcast(&self, py: Python<'_>, t: &CudaTensor, root: usize) -> PyResult<()> {
        let dt = data_type(self.op, t.elem)?;
        let (p, n) = (t.ptr, t.nbytes / t.elem.size);
        // SAFETY: as in all_reduce.
        self.run(py, |c, s| unsafe { c.broadcast(p, p, n, dt, root, s) })
    }

    /// all_gather_single: `output` is size × `input`.
    pub(crate) fn all_gather_single(
        &self,
        py: Python<'_>,
        o: &CudaTensor,
        i: &CudaTensor,
        size: usize,
    ) -> PyResult<()> {
        self.same(i, o, i.nbytes.saturating_mul(size), "output must be size × input, of the same dtype")?;
        let dt = data_type(self.op, i.elem)?;
        let (op_, ip, n) = (o.ptr, i.ptr, i.nbytes / i.elem.size);
        // SAFETY: as in all_reduce, for both tensors (sizes checked).
        self.run(py, |c, s| unsafe { c.all_gather(ip, op_, n, dt, s) })
    }

    /// reduce_scatter_single: `input` is size × `output`.
    pub(crate) fn reduce_scatter_single(
        &self,
        py: Python<'_>,
        o: &CudaTensor,
        i: &CudaTensor,
        op: ReduceOp,
        size: usize,
    ) -> PyResult<()> {
        self.same(o, i, o.nbytes.saturating_mul(size), "input must be size × output, of the same dtype")?;
        let (dt, ro) = (data_type(self.op, o.elem)?, red_op(self.op, op)?);
        let (op_, ip, n) = (o.ptr, i.ptr, o.nbytes / o.elem.size);
        // SAFETY: as in all_gather_single.
        self.run(py, |c, s| unsafe { c.reduce_scatter(ip, op_, n, dt, ro, s) })
    }

    /// all_to_all_single: equal blocks, one NCCL group of sends and recvs.
    pub(crate) fn all_to_all_single(
        &self,
        py: Python<'_>,
        o: &CudaTensor,
        i: &CudaTensor,
        size: usize,
    ) -> PyResult<()> {
        self.same(i, o, i.nbytes, "output must be as large as input, of the same dtype")?;
        if !i.nbytes.is_multiple_of(size * i.elem.size) {
            return Err(Failure::new(
                ErrKind::Argument,
                format!("{}: {} bytes do not split into {size} blocks of whole elements", self.op, i.nbytes),
            )
            .into());
        }
        let dt = data_type(self.op, i.elem)?;
        let block = i.nbytes / size;
        let n = block / i.elem.size;
        let sends: Vec<_> = (0..size).map(|p| (i.ptr + (p * block) as u64, n, p)).collect();
        let recvs: Vec<_> = (0..size).map(|p| (o.ptr + (p * block) as u64, n, p)).collect();
        // SAFETY: as in all_gather_single (every block inside its tensor).
        self.run(py, |c, s| unsafe { c.send_recv(&sends, &recvs, dt, s) })
    }

    /// send to `peer`.
    pub(crate) fn send(&self, py: Python<'_>, t: &CudaTensor, peer: usize) -> PyResult<()> {
        let dt = data_type(self.op, t.elem)?;
        let (p, n) = (t.ptr, t.nbytes / t.elem.size);
        // SAFETY: as in all_reduce.
        self.run(py, |c, s| unsafe { c.send_recv(&[(p, n, peer)], &[], dt, s) })
    }

    /// recv from `peer`.
    pub(crate) fn recv(&self, py: Python<'_>, t: &CudaTensor, peer: usize) -> PyResult<()> {
        let dt = data_type(self.op, t.elem)?;
        let (p, n) = (t.ptr, t.nbytes / t.elem.size);
        // SAFETY: as in all_reduce.
        self.run(py, |c, s| unsafe { c.send_recv(&[], &[(p, n, peer)], dt, s) })
    }
}
