//! The `nccl` / `rccl` fallback backends (issue 13): `new_comm("nccl")`
//! makes the rdma communicator (bootstrap, CPU tensors, windows) and, beside
//! it, an NCCL communicator through the run-time loaded library, used for
//! CUDA tensors by all_reduce, reduce, broadcast, all_gather_single,
//! reduce_scatter_single, all_to_all_single, send and recv, queued on
//! torch's current stream of the tensor's device (as torch's NCCL process
//! group queues them). Other collectives on CUDA tensors raise
//! `UnavailableError` naming the call.

use std::sync::{Arc, Mutex};

use pyo3::prelude::*;
use rmacomm_collectives::ReduceOp;
use rmacomm_window::cuda::nccl::{Flavor, Library};
use rmacomm_window::cuda::nccl_comm::{self, DataType, NcclComm, RedOp, UniqueId};
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

/// Sets up the NCCL side (collective over `group`): every rank loads the
/// library and opens `device`; rank 0 makes the unique id; one exchange
/// carries it, or any rank's reason it cannot (then every rank fails,
/// naming that rank); then `ncclCommInitRank`.
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
    let comm = py
        .detach(|| NcclComm::init(lib, ctx, &UniqueId(id), rank, size, timeout))
        .map_err(|e| unavailable(format!("new_comm(\"{backend}\"): {e}")))?;
    Ok(NcclState { backend, device, comm: Mutex::new(comm) })
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
        .map_err(|e| Failure::new(ErrKind::Comm, format!("{op}: {e}")).into())
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
