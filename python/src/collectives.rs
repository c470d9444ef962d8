//! The Python methods of `Comm` (every torchcomms collective, with
//! torchcomms' argument names and order) and of its point-to-point batch.
//!
//! Each method reads its tensors with the GIL held (checks, element types,
//! sizes, errors naming the argument), then runs the Rust collective on
//! their bytes ([`CommShared::run`]). An input that overlaps an output
//! (an in-place all_gather whose input is a slice of the output) is copied
//! first: the Rust API takes a shared and a mutable slice, which must not
//! alias. Outputs that overlap each other are refused.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use rmacomm_collectives::{Comm, DType};

use crate::array;
use crate::comm::{CommShared, PyComm};
use crate::ctran_window::PyCtranWindow;
use crate::cuda_tensor;
use crate::errors::py_err;
use crate::reduce_op::PyReduceOp;
use crate::tensor::{self, Raw, Tensor};
use crate::timeout;
use crate::window::PyWindow;
use crate::work::PyWork;

/// An input's bytes: the tensor itself, or a copy when it overlaps an
/// output.
enum Src {
    Raw(Raw),
    Owned(Vec<u8>),
}

impl Src {
    fn new(input: Raw, outputs: &[Raw]) -> Src {
        if outputs.iter().any(|o| o.overlaps(input)) {
            // SAFETY: the tensor is alive (the caller's argument) and the
            // GIL is held: nothing else in this process runs Python now.
            Src::Owned(unsafe { input.slice() }.to_vec())
        } else {
            Src::Raw(input)
        }
    }

    /// # Safety
    /// A `Raw` input is alive and not written while the slice is used.
    unsafe fn bytes(&self) -> &[u8] {
        match self {
            // SAFETY: forwarded.
            Src::Raw(r) => unsafe { r.slice() },
            Src::Owned(v) => v,
        }
    }
}

fn disjoint(arg: &str, outs: &[Raw]) -> PyResult<()> {
    for (i, a) in outs.iter().enumerate() {
        for (j, b) in outs.iter().enumerate().skip(i + 1) {
            if a.overlaps(*b) {
                return Err(PyValueError::new_err(format!("{arg}[{i}] and {arg}[{j}] overlap; outputs must not")));
            }
        }
    }
    Ok(())
}

fn reduction(t: &Tensor<'_>, arg: &str) -> PyResult<DType> {
    t.elem.reduction_dtype(arg).map_err(PyTypeError::new_err)
}

fn same_len(t: &Tensor<'_>, arg: &str, want: usize, why: &str) -> PyResult<()> {
    if t.nbytes != want {
        return Err(PyValueError::new_err(format!("{arg} has {} bytes; {why} ({want} bytes)", t.nbytes)));
    }
    Ok(())
}

/// Mutable slices of disjoint outputs.
///
/// # Safety
/// Every range is alive, unaliased by the others (checked by `disjoint`)
/// and by the inputs (copied by `Src::new`), and nothing else uses it while
/// the slices live.
unsafe fn slices_mut<'a>(outs: &[Raw]) -> Vec<&'a mut [u8]> {
    // SAFETY: forwarded.
    outs.iter().map(|r| unsafe { r.slice_mut() }).collect()
}

/// The reduction type of a CUDA tensor's elements.
fn native_dtype(op: &str, t: &crate::cuda_tensor::CudaTensor) -> PyResult<DType> {
    t.elem.dtype.ok_or_else(|| {
        crate::errors::Failure::new(
            crate::errors::ErrKind::Argument,
            format!("{op}: {} tensors cannot be reduced", t.elem.name),
        )
        .into()
    })
}

fn raws(ts: &[Tensor<'_>]) -> Vec<Raw> {
    ts.iter().map(Tensor::raw).collect()
}

#[pymethods]
impl PyComm {
    /// This rank in the communicator.
    fn get_rank(&self) -> usize {
        self.shared.rank
    }

    /// Ranks in the communicator.
    fn get_size(&self) -> usize {
        self.shared.size
    }

    /// The communicator's name.
    fn get_name(&self) -> String {
        self.shared.name.clone()
    }

    /// "rdma", or "nccl" / "rccl" for a communicator made with that
    /// backend.
    fn get_backend(&self) -> &'static str {
        self.shared.nccl.get().map_or("rdma", |n| n.backend)
    }

    /// "cpu", or "cuda:N" for an NCCL communicator: the device whose memory
    /// its collectives move.
    fn get_device(&self) -> String {
        self.shared.nccl.get().map_or_else(|| "cpu".to_string(), |n| format!("cuda:{}", n.device))
    }

    /// The timeout of every operation, as a timedelta.
    fn get_timeout<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        timeout::to_timedelta(py, self.shared.timeout)
    }

    /// Ends the communicator (collective: a barrier); later operations
    /// raise `CommError`.
    fn finalize(&self, py: Python<'_>) -> PyResult<()> {
        self.shared.run(py, "finalize", false, None, &[], |c: &mut Comm| c.finalize())?;
        Ok(())
    }

    /// A communicator of the ranks listed (collective over this one: every
    /// rank passes the same list). Returns it on the listed ranks (numbered
    /// by their position in the list) and None on the others. It has this
    /// one's settings but for the `name` (default: this one's plus
    /// "/split"), `timeout` and `hints` given.
    #[pyo3(signature = (ranks, name=None, hints=None, timeout=None))]
    fn split(
        &self,
        py: Python<'_>,
        ranks: Vec<usize>,
        name: Option<String>,
        hints: Option<HashMap<String, String>>,
        timeout: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Option<PyComm>> {
        let timeout = timeout::duration(timeout, "timeout")?;
        // After the async operations issued before it, as every rank runs
        // them (it took the communicator while the worker waited for it
        // in one of them: both ranks waited for each other).
        self.shared.after_async(py)?;
        let comm = self.shared.comm.clone();
        let sub = py
            .detach(move || {
                let c = comm.lock().unwrap_or_else(|e| e.into_inner());
                // The parent's settings, with the name, timeout and hints
                // given here.
                let mut opts = c.options().clone().name(name.unwrap_or_else(|| format!("{}/split", c.name())));
                if let Some(t) = timeout {
                    opts = opts.timeout(t);
                }
                for (k, v) in hints.unwrap_or_default() {
                    opts = opts.hint(k, v);
                }
                c.split_with(&ranks, opts)
            })
            .map_err(py_err)?;
        sub.map(|c| PyComm::from_comm(py, c)).transpose()
    }

    /// A batch of sends and receives issued together (`send`, `recv`,
    /// then `issue`): they progress together, so a rank may send to and
    /// receive from the same peers in any order without deadlock.
    fn batch_op_create(&self) -> PyBatch {
        PyBatch { shared: self.shared.clone(), ops: Mutex::new(Vec::new()) }
    }

    /// A one-sided window over this communicator's ranks, torchcomms' form
    /// (collective). With `tensor`, registers it at once. `unified=False`
    /// reaches same-host peers through the transport too (SEPARATE), as
    /// peers on other hosts are (for comparisons and tests).
    #[pyo3(signature = (tensor=None, *, unified=true))]
    fn new_window(&self, py: Python<'_>, tensor: Option<&Bound<'_, PyAny>>, unified: bool) -> PyResult<PyWindow> {
        PyWindow::create(py, &self.shared, tensor, unified)
    }

    /// A window of the ctran form (collective): `window_size` bytes of
    /// shared memory on every rank and `signal_size` 64-bit value-signal
    /// slots. `cpu_buf` must be True (CPU memory is the only kind).
    /// `unified` as for `new_window`.
    #[pyo3(signature = (window_size, cpu_buf=true, signal_size=64, *, unified=true))]
    fn window_allocate(
        &self,
        py: Python<'_>,
        window_size: usize,
        cpu_buf: bool,
        signal_size: usize,
        unified: bool,
    ) -> PyResult<PyCtranWindow> {
        if !cpu_buf {
            return Err(PyValueError::new_err("window_allocate: cpu_buf=False (device memory) is not available"));
        }
        PyCtranWindow::create(py, &self.shared, window_size, signal_size, unified)
    }

    /// A zero-filled array in shared memory (same as `rmacomm.empty`):
    /// what to register in windows and send from; `device="cuda[:N]"`: a
    /// zero-filled CUDA torch tensor (IPC-able, for windows of CUDA tensors).
    #[pyo3(signature = (shape, dtype=None, *, like=None, device=None))]
    fn empty<'py>(
        &self,
        py: Python<'py>,
        shape: &Bound<'py, PyAny>,
        dtype: Option<&Bound<'py, PyAny>>,
        like: Option<&Bound<'py, PyAny>>,
        device: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        array::empty(py, shape, dtype, like, device)
    }

    /// Sends `tensor` to rank `dst` (matched, in order, by its `recv`).
    #[pyo3(signature = (tensor, dst, async_op=false, hints=None, timeout=None))]
    fn send(
        &self,
        py: Python<'_>,
        tensor: &Bound<'_, PyAny>,
        dst: usize,
        async_op: bool,
        hints: Option<HashMap<String, String>>,
        timeout: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyWork> {
        let _ = hints;
        if let Some(t) = cuda_tensor::of(tensor, "tensor")? {
            if self.shared.nccl.get().is_some() {
                self.gpu("send", &[&t])?.send(py, &t, dst)?;
            } else {
                let (p, len) = (t.ptr, t.nbytes);
                // SAFETY: as in native_all_reduce.
                self.native_p2p(py, "send", dst, t.device, move |c, peer, s| unsafe { c.send(p, len, peer, s) })?;
            }
            return Ok(PyWork::done());
        }
        let t = Tensor::new(tensor, "tensor", false)?;
        let r = t.raw();
        self.shared.run(py, "send", async_op, timeout::duration(timeout, "timeout")?, &[&t], move |c| {
            // SAFETY: the tensor is alive until the operation ends (the
            // caller's argument, or kept by the worker) and read only.
            c.send(unsafe { r.slice() }, dst)
        })
    }

    /// Receives from rank `src` into `tensor`.
    #[pyo3(signature = (tensor, src, async_op=false, hints=None, timeout=None))]
    fn recv(
        &self,
        py: Python<'_>,
        tensor: &Bound<'_, PyAny>,
        src: usize,
        async_op: bool,
        hints: Option<HashMap<String, String>>,
        timeout: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyWork> {
        let _ = hints;
        if let Some(t) = cuda_tensor::of(tensor, "tensor")? {
            if self.shared.nccl.get().is_some() {
                self.gpu("recv", &[&t])?.recv(py, &t, src)?;
            } else {
                let (p, len) = (t.ptr, t.nbytes);
                // SAFETY: as in native_all_reduce, for the written tensor.
                self.native_p2p(py, "recv", src, t.device, move |c, peer, s| unsafe { c.recv(p, len, peer, s) })?;
            }
            return Ok(PyWork::done());
        }
        let t = Tensor::new(tensor, "tensor", true)?;
        let r = t.raw();
        self.shared.run(py, "recv", async_op, timeout::duration(timeout, "timeout")?, &[&t], move |c| {
            // SAFETY: alive until the end (as in send) and written only here.
            c.recv(unsafe { r.slice_mut() }, src)
        })
    }

    /// Broadcasts `tensor` from `root` into every rank's `tensor`.
    #[pyo3(signature = (tensor, root, async_op=false, hints=None, timeout=None))]
    fn broadcast(
        &self,
        py: Python<'_>,
        tensor: &Bound<'_, PyAny>,
        root: usize,
        async_op: bool,
        hints: Option<HashMap<String, String>>,
        timeout: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyWork> {
        let _ = hints;
        if let Some(t) = cuda_tensor::of(tensor, "tensor")? {
            if self.shared.nccl.get().is_some() {
                self.gpu("broadcast", &[&t])?.broadcast(py, &t, root)?;
            } else {
                let (p, len) = (t.ptr, t.nbytes);
                // SAFETY: as in native_all_reduce.
                self.native(py, "broadcast", t.device, move |c, s| unsafe { c.broadcast(p, len, root, s) })?;
            }
            return Ok(PyWork::done());
        }
        let t = Tensor::new(tensor, "tensor", true)?;
        let r = t.raw();
        self.shared.run(py, "broadcast", async_op, timeout::duration(timeout, "timeout")?, &[&t], move |c| {
            // SAFETY: as in recv.
            c.broadcast(unsafe { r.slice_mut() }, root)
        })
    }

    /// Reduces every rank's `tensor` with `op`, in place on every rank.
    #[pyo3(signature = (tensor, op, async_op=false, hints=None, timeout=None))]
    fn all_reduce(
        &self,
        py: Python<'_>,
        tensor: &Bound<'_, PyAny>,
        op: PyReduceOp,
        async_op: bool,
        hints: Option<HashMap<String, String>>,
        timeout: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyWork> {
        let _ = hints;
        if let Some(t) = cuda_tensor::of(tensor, "tensor")? {
            if self.shared.nccl.get().is_none() {
                self.native_all_reduce(py, &t, op.op)?;
            } else {
                self.gpu("all_reduce", &[&t])?.all_reduce(py, &t, op.op)?;
            }
            return Ok(PyWork::done());
        }
        let t = Tensor::new(tensor, "tensor", true)?;
        let (r, dt, op) = (t.raw(), reduction(&t, "tensor")?, op.op);
        self.shared.run(py, "all_reduce", async_op, timeout::duration(timeout, "timeout")?, &[&t], move |c| {
            // SAFETY: as in recv.
            c.all_reduce(unsafe { r.slice_mut() }, dt, op)
        })
    }

    /// Reduces every rank's `tensor` with `op` into `root`'s `tensor`.
    #[pyo3(signature = (tensor, root, op, async_op=false, hints=None, timeout=None))]
    #[allow(clippy::too_many_arguments)]
    fn reduce(
        &self,
        py: Python<'_>,
        tensor: &Bound<'_, PyAny>,
        root: usize,
        op: PyReduceOp,
        async_op: bool,
        hints: Option<HashMap<String, String>>,
        timeout: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyWork> {
        let _ = hints;
        if let Some(t) = cuda_tensor::of(tensor, "tensor")? {
            if self.shared.nccl.get().is_none() {
                let dt = native_dtype("reduce", &t)?;
                let (ptr, len, op) = (t.ptr, t.nbytes, op.op);
                // SAFETY: as in native_all_reduce.
                self.native(py, "reduce", t.device, move |c, s| unsafe { c.reduce(ptr, len, dt, op, root, s) })?;
            } else {
                self.gpu("reduce", &[&t])?.reduce(py, &t, op.op, root)?;
            }
            return Ok(PyWork::done());
        }
        let t = Tensor::new(tensor, "tensor", true)?;
        let (r, dt, op) = (t.raw(), reduction(&t, "tensor")?, op.op);
        self.shared.run(py, "reduce", async_op, timeout::duration(timeout, "timeout")?, &[&t], move |c| {
            // SAFETY: as in recv.
            c.reduce(unsafe { r.slice_mut() }, dt, op, root)
        })
    }

    /// Gathers every rank's `tensor` into `tensor_list` (one per rank;
    /// uneven sizes make it all_gather_v).
    #[pyo3(signature = (tensor_list, tensor, async_op=false, hints=None, timeout=None))]
    fn all_gather(
        slf: &Bound<'_, Self>,
        py: Python<'_>,
        tensor_list: &Bound<'_, PyAny>,
        tensor: &Bound<'_, PyAny>,
        async_op: bool,
        hints: Option<HashMap<String, String>>,
        timeout: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyWork> {
        if cuda_tensor::of(tensor, "tensor")?.is_some() {
            return composed(py, "all_gather", (slf, tensor_list, tensor, false));
        }
        slf.get().gather_list(py, "all_gather", tensor_list, tensor, async_op, hints, timeout, false)
    }

    /// all_gather with per-rank sizes.
    #[pyo3(signature = (tensor_list, tensor, async_op=false, hints=None, timeout=None))]
    fn all_gather_v(
        slf: &Bound<'_, Self>,
        py: Python<'_>,
        tensor_list: &Bound<'_, PyAny>,
        tensor: &Bound<'_, PyAny>,
        async_op: bool,
        hints: Option<HashMap<String, String>>,
        timeout: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyWork> {
        if cuda_tensor::of(tensor, "tensor")?.is_some() {
            return composed(py, "all_gather", (slf, tensor_list, tensor, true));
        }
        slf.get().gather_list(py, "all_gather_v", tensor_list, tensor, async_op, hints, timeout, true)
    }

    /// Gathers every rank's `input` into `output` (size × input, rank
    /// order).
    #[pyo3(signature = (output, input, async_op=false, hints=None, timeout=None))]
    fn all_gather_single(
        &self,
        py: Python<'_>,
        output: &Bound<'_, PyAny>,
        input: &Bound<'_, PyAny>,
        async_op: bool,
        hints: Option<HashMap<String, String>>,
        timeout: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyWork> {
        let _ = hints;
        if let (Some(o), Some(i)) = (cuda_tensor::of(output, "output")?, cuda_tensor::of(input, "input")?) {
            if self.shared.nccl.get().is_some() {
                self.gpu("all_gather_single", &[&o, &i])?.all_gather_single(py, &o, &i, self.shared.size)?;
            } else {
                let n = self.shared.size;
                self.native_pair(py, "all_gather_single", &o, &i, i.nbytes, (n, 1), None)?;
            }
            return Ok(PyWork::done());
        }
        let o = Tensor::new(output, "output", true)?;
        let i = Tensor::new(input, "input", false)?;
        tensor::same_elem(&o, "output", i.elem, "input")?;
        // Saturating: a product that wrapped could match a small output.
        same_len(&o, "output", i.nbytes.saturating_mul(self.shared.size), "all_gather_single needs size × input")?;
        let (or, src) = (o.raw(), Src::new(i.raw(), &[o.raw()]));
        // SAFETY: alive until the end; the input is copied if it overlaps
        // the output.
        self.shared.run(
            py,
            "all_gather_single",
            async_op,
            timeout::duration(timeout, "timeout")?,
            &[&o, &i],
            move |c| c.all_gather_single(unsafe { or.slice_mut() }, unsafe { src.bytes() }),
        )
    }

    /// Reduces `input_list[j]` of every rank into rank j's `output`.
    #[pyo3(signature = (output, input_list, op, async_op=false, hints=None, timeout=None))]
    #[allow(clippy::too_many_arguments)]
    fn reduce_scatter(
        slf: &Bound<'_, Self>,
        py: Python<'_>,
        output: &Bound<'_, PyAny>,
        input_list: &Bound<'_, PyAny>,
        op: PyReduceOp,
        async_op: bool,
        hints: Option<HashMap<String, String>>,
        timeout: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyWork> {
        if cuda_tensor::of(output, "output")?.is_some() {
            return composed(py, "reduce_scatter", (slf, output, input_list, op, false));
        }
        slf.get().scatter_list(py, "reduce_scatter", output, input_list, op, async_op, hints, timeout, false)
    }

    /// reduce_scatter with per-rank sizes.
    #[pyo3(signature = (output, input_list, op, async_op=false, hints=None, timeout=None))]
    #[allow(clippy::too_many_arguments)]
    fn reduce_scatter_v(
        slf: &Bound<'_, Self>,
        py: Python<'_>,
        output: &Bound<'_, PyAny>,
        input_list: &Bound<'_, PyAny>,
        op: PyReduceOp,
        async_op: bool,
        hints: Option<HashMap<String, String>>,
        timeout: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyWork> {
        if cuda_tensor::of(output, "output")?.is_some() {
            return composed(py, "reduce_scatter", (slf, output, input_list, op, true));
        }
        slf.get().scatter_list(py, "reduce_scatter_v", output, input_list, op, async_op, hints, timeout, true)
    }

    /// Reduces block j (of size equal blocks) of every rank's `input` into
    /// rank j's `output`.
    #[pyo3(signature = (output, input, op, async_op=false, hints=None, timeout=None))]
    #[allow(clippy::too_many_arguments)]
    fn reduce_scatter_single(
        &self,
        py: Python<'_>,
        output: &Bound<'_, PyAny>,
        input: &Bound<'_, PyAny>,
        op: PyReduceOp,
        async_op: bool,
        hints: Option<HashMap<String, String>>,
        timeout: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyWork> {
        let _ = hints;
        if let (Some(o), Some(i)) = (cuda_tensor::of(output, "output")?, cuda_tensor::of(input, "input")?) {
            if self.shared.nccl.get().is_some() {
                let call = self.gpu("reduce_scatter_single", &[&o, &i])?;
                call.reduce_scatter_single(py, &o, &i, op.op, self.shared.size)?;
            } else {
                let n = self.shared.size;
                self.native_pair(py, "reduce_scatter_single", &o, &i, o.nbytes, (1, n), Some(op.op))?;
            }
            return Ok(PyWork::done());
        }
        let o = Tensor::new(output, "output", true)?;
        let i = Tensor::new(input, "input", false)?;
        tensor::same_elem(&i, "input", o.elem, "output")?;
        same_len(&i, "input", o.nbytes.saturating_mul(self.shared.size), "reduce_scatter_single needs size × output")?;
        let (dt, op) = (reduction(&o, "output")?, op.op);
        let (or, src) = (o.raw(), Src::new(i.raw(), &[o.raw()]));
        // SAFETY: as in all_gather_single.
        self.shared.run(
            py,
            "reduce_scatter_single",
            async_op,
            timeout::duration(timeout, "timeout")?,
            &[&o, &i],
            move |c| c.reduce_scatter_single(unsafe { or.slice_mut() }, unsafe { src.bytes() }, dt, op),
        )
    }

    /// Block j of every rank's `input` goes to rank j, which receives
    /// rank i's block into block i of its `output`.
    #[pyo3(signature = (output, input, async_op=false, hints=None, timeout=None))]
    fn all_to_all_single(
        &self,
        py: Python<'_>,
        output: &Bound<'_, PyAny>,
        input: &Bound<'_, PyAny>,
        async_op: bool,
        hints: Option<HashMap<String, String>>,
        timeout: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyWork> {
        let _ = hints;
        if let (Some(o), Some(i)) = (cuda_tensor::of(output, "output")?, cuda_tensor::of(input, "input")?) {
            if self.shared.nccl.get().is_some() {
                self.gpu("all_to_all_single", &[&o, &i])?.all_to_all_single(py, &o, &i, self.shared.size)?;
            } else {
                let n = self.shared.size;
                // Split along the first dimension, as torch does: whole rows.
                let row = match i.shape.first() {
                    Some(&rows) if rows > 0 => i.nbytes / rows,
                    _ => i.elem.size,
                };
                if !i.nbytes.is_multiple_of(n.saturating_mul(row.max(1))) {
                    return Err(crate::errors::Failure::new(
                        crate::errors::ErrKind::Argument,
                        format!(
                            "all_to_all_single: input: {} bytes do not split into {n} equal parts of whole rows",
                            i.nbytes
                        ),
                    )
                    .into());
                }
                self.native_pair(py, "all_to_all_single", &o, &i, i.nbytes / n, (n, n), None)?;
            }
            return Ok(PyWork::done());
        }
        let mut o = Tensor::new(output, "output", true)?;
        let mut i = Tensor::new(input, "input", false)?;
        tensor::same_elem(&o, "output", i.elem, "input")?;
        same_len(&o, "output", i.nbytes, "all_to_all_single needs it as large as input")?;
        // Split along the first dimension, as torch does: each rank's block
        // is whole rows of both (a block cutting an element or a row moved
        // bytes that belong together to different ranks, silently).
        let n = self.shared.size;
        for (t, arg) in [(&mut i, "input"), (&mut o, "output")] {
            let row = t.row_bytes()?;
            if !t.nbytes.is_multiple_of(n.saturating_mul(row.max(1))) {
                return Err(PyValueError::new_err(format!(
                    "all_to_all_single: {arg}: {} bytes do not split into {n} equal parts of whole rows",
                    t.nbytes
                )));
            }
        }
        let (or, src) = (o.raw(), Src::new(i.raw(), &[o.raw()]));
        // SAFETY: as in all_gather_single.
        self.shared.run(
            py,
            "all_to_all_single",
            async_op,
            timeout::duration(timeout, "timeout")?,
            &[&o, &i],
            move |c| c.all_to_all_single(unsafe { or.slice_mut() }, unsafe { src.bytes() }),
        )
    }

    /// all_to_all_single with per-rank sizes: `input_split_sizes[j]` rows
    /// (first-dimension slices, as torch counts them) of `input` go to rank
    /// j, `output_split_sizes[i]` rows of `output` come from rank i. Empty
    /// or None: equal splits.
    #[pyo3(signature = (output, input, output_split_sizes, input_split_sizes, async_op=false, hints=None, timeout=None))]
    #[allow(clippy::too_many_arguments)]
    fn all_to_all_v_single(
        &self,
        py: Python<'_>,
        output: &Bound<'_, PyAny>,
        input: &Bound<'_, PyAny>,
        output_split_sizes: Option<Vec<usize>>,
        input_split_sizes: Option<Vec<usize>>,
        async_op: bool,
        hints: Option<HashMap<String, String>>,
        timeout: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyWork> {
        let _ = hints;
        let mut o = Tensor::new(output, "output", true)?;
        let mut i = Tensor::new(input, "input", false)?;
        tensor::same_elem(&o, "output", i.elem, "input")?;
        let n = self.shared.size;
        let splits = |t: &mut Tensor<'_>, s: Option<Vec<usize>>, arg: &str| -> PyResult<Vec<usize>> {
            let row = t.row_bytes()?;
            match s.filter(|s| !s.is_empty()) {
                // Checked: a product that wrapped could look like a valid
                // split (2**62 + 1 rows of 4 bytes are 4 bytes).
                Some(s) => s
                    .iter()
                    .map(|&r| {
                        r.checked_mul(row).ok_or_else(|| {
                            PyValueError::new_err(format!(
                                "all_to_all_v_single: {arg}: {r} rows of {row} bytes are past 2**64 bytes"
                            ))
                        })
                    })
                    .collect(),
                None => {
                    if !t.nbytes.is_multiple_of(n.saturating_mul(row.max(1))) {
                        return Err(PyValueError::new_err(format!(
                            "{arg}: {} bytes do not split into {n} equal parts of whole rows",
                            t.nbytes
                        )));
                    }
                    Ok(vec![t.nbytes / n; n])
                }
            }
        };
        let os = splits(&mut o, output_split_sizes, "output_split_sizes")?;
        let is = splits(&mut i, input_split_sizes, "input_split_sizes")?;
        let (or, src) = (o.raw(), Src::new(i.raw(), &[o.raw()]));
        // SAFETY: as in all_gather_single.
        self.shared.run(
            py,
            "all_to_all_v_single",
            async_op,
            timeout::duration(timeout, "timeout")?,
            &[&o, &i],
            move |c| c.all_to_all_v_single(unsafe { or.slice_mut() }, unsafe { src.bytes() }, &os, &is),
        )
    }

    /// `input_tensor_list[j]` goes to rank j, which receives rank i's into
    /// `output_tensor_list[i]`.
    #[pyo3(signature = (output_tensor_list, input_tensor_list, async_op=false, hints=None, timeout=None))]
    fn all_to_all(
        slf: &Bound<'_, Self>,
        py: Python<'_>,
        output_tensor_list: &Bound<'_, PyAny>,
        input_tensor_list: &Bound<'_, PyAny>,
        async_op: bool,
        hints: Option<HashMap<String, String>>,
        timeout: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyWork> {
        let _ = hints;
        if let Ok(first) = input_tensor_list.get_item(0) {
            if cuda_tensor::of(&first, "input_tensor_list[0]")?.is_some() {
                return composed(py, "all_to_all", (slf, output_tensor_list, input_tensor_list));
            }
        }
        let this = slf.get();
        let outs = tensor::list(output_tensor_list, "output_tensor_list", true)?;
        let ins = tensor::list(input_tensor_list, "input_tensor_list", false)?;
        if let Some(first) = ins.first() {
            for (k, t) in ins.iter().enumerate().skip(1) {
                tensor::same_elem(t, &format!("input_tensor_list[{k}]"), first.elem, "input_tensor_list[0]")?;
            }
            for (k, t) in outs.iter().enumerate() {
                tensor::same_elem(t, &format!("output_tensor_list[{k}]"), first.elem, "input_tensor_list[0]")?;
            }
        }
        let ors = raws(&outs);
        disjoint("output_tensor_list", &ors)?;
        let srcs: Vec<Src> = ins.iter().map(|t| Src::new(t.raw(), &ors)).collect();
        let keep: Vec<&Tensor<'_>> = outs.iter().chain(&ins).collect();
        this.shared.run(py, "all_to_all", async_op, timeout::duration(timeout, "timeout")?, &keep, move |c| {
            // SAFETY: alive until the end, outputs disjoint, overlapping
            // inputs copied.
            let mut o = unsafe { slices_mut(&ors) };
            // SAFETY: as above.
            let i: Vec<&[u8]> = srcs.iter().map(|s| unsafe { s.bytes() }).collect();
            c.all_to_all(&mut o, &i)
        })
    }

    /// Waits until every rank has called it.
    #[pyo3(signature = (async_op=false, hints=None, timeout=None))]
    fn barrier(
        &self,
        py: Python<'_>,
        async_op: bool,
        hints: Option<HashMap<String, String>>,
        timeout: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyWork> {
        let _ = hints;
        self.shared.run(py, "barrier", async_op, timeout::duration(timeout, "timeout")?, &[], |c| c.barrier())
    }

    /// Rank j receives `input_tensor_list[j]` of `root` (given on the root
    /// only; None or [] elsewhere) into `output_tensor`.
    #[pyo3(signature = (output_tensor, input_tensor_list, root, async_op=false, hints=None, timeout=None))]
    #[allow(clippy::too_many_arguments)]
    fn scatter(
        slf: &Bound<'_, Self>,
        py: Python<'_>,
        output_tensor: &Bound<'_, PyAny>,
        input_tensor_list: Option<&Bound<'_, PyAny>>,
        root: usize,
        async_op: bool,
        hints: Option<HashMap<String, String>>,
        timeout: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyWork> {
        let _ = hints;
        if cuda_tensor::of(output_tensor, "output_tensor")?.is_some() {
            let list = input_tensor_list.filter(|l| !l.is_none());
            return composed(py, "scatter", (slf, output_tensor, list, root));
        }
        let this = slf.get();
        let o = Tensor::new(output_tensor, "output_tensor", true)?;
        let ins = match input_tensor_list.filter(|l| !l.is_none()) {
            Some(l) => tensor::list(l, "input_tensor_list", false)?,
            None => Vec::new(),
        };
        for (k, t) in ins.iter().enumerate() {
            tensor::same_elem(t, &format!("input_tensor_list[{k}]"), o.elem, "output_tensor")?;
        }
        let or = o.raw();
        let srcs: Option<Vec<Src>> = (!ins.is_empty()).then(|| ins.iter().map(|t| Src::new(t.raw(), &[or])).collect());
        let mut keep: Vec<&Tensor<'_>> = ins.iter().collect();
        keep.push(&o);
        this.shared.run(py, "scatter", async_op, timeout::duration(timeout, "timeout")?, &keep, move |c| {
            // SAFETY: alive until the end; inputs overlapping the output
            // copied.
            let i: Option<Vec<&[u8]>> = srcs.as_ref().map(|s| s.iter().map(|s| unsafe { s.bytes() }).collect());
            // SAFETY: as above.
            c.scatter(unsafe { or.slice_mut() }, i.as_deref(), root)
        })
    }

    /// `root` receives rank i's `input_tensor` into
    /// `output_tensor_list[i]` (given on the root only; None or []
    /// elsewhere).
    #[pyo3(signature = (output_tensor_list, input_tensor, root, async_op=false, hints=None, timeout=None))]
    #[allow(clippy::too_many_arguments)]
    fn gather(
        slf: &Bound<'_, Self>,
        py: Python<'_>,
        output_tensor_list: Option<&Bound<'_, PyAny>>,
        input_tensor: &Bound<'_, PyAny>,
        root: usize,
        async_op: bool,
        hints: Option<HashMap<String, String>>,
        timeout: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyWork> {
        let _ = hints;
        if cuda_tensor::of(input_tensor, "input_tensor")?.is_some() {
            let list = output_tensor_list.filter(|l| !l.is_none());
            return composed(py, "gather", (slf, list, input_tensor, root));
        }
        let this = slf.get();
        let i = Tensor::new(input_tensor, "input_tensor", false)?;
        let outs = match output_tensor_list.filter(|l| !l.is_none()) {
            Some(l) => tensor::list(l, "output_tensor_list", true)?,
            None => Vec::new(),
        };
        for (k, t) in outs.iter().enumerate() {
            tensor::same_elem(t, &format!("output_tensor_list[{k}]"), i.elem, "input_tensor")?;
        }
        let ors = raws(&outs);
        disjoint("output_tensor_list", &ors)?;
        let src = Src::new(i.raw(), &ors);
        let mut keep: Vec<&Tensor<'_>> = outs.iter().collect();
        keep.push(&i);
        this.shared.run(py, "gather", async_op, timeout::duration(timeout, "timeout")?, &keep, move |c| {
            // SAFETY: alive until the end, outputs disjoint, an
            // overlapping input copied.
            let mut o = unsafe { slices_mut(&ors) };
            let outs = (!o.is_empty()).then_some(&mut o[..]);
            // SAFETY: as above.
            c.gather(outs, unsafe { src.bytes() }, root)
        })
    }

    fn __repr__(&self) -> String {
        format!("<rmacomm.Comm {:?} rank {} of {}>", self.shared.name, self.shared.rank, self.shared.size)
    }
}

/// The list and `_v` forms of CUDA tensors: composed of the single forms
/// (`rmacomm._cuda_lists`: one staging tensor, one collective, copies out),
/// queued on torch's current stream like the single forms.
fn composed<'py, A: pyo3::call::PyCallArgs<'py>>(py: Python<'py>, f: &str, args: A) -> PyResult<PyWork> {
    py.import("rmacomm._cuda_lists")?.getattr(f)?.call1(args)?;
    Ok(PyWork::done())
}

impl PyComm {
    /// Runs `f` on the native backend's GPU communicator of device
    /// `device` (made by the first collective on CUDA tensors: every rank
    /// reaches it at the same call) with torch's current stream, the GIL
    /// released.
    fn native<F>(&self, py: Python<'_>, op: &'static str, device: u32, f: F) -> PyResult<()>
    where
        F: FnOnce(
                &mut rmacomm_collectives::GpuComm,
                &rmacomm_window::cuda::device::Stream,
            ) -> Result<(), rmacomm_collectives::Error>
            + Send,
    {
        let stream = cuda_tensor::stream(py, None, device)?;
        let ctx = cuda_tensor::context(device)?;
        let s = &self.shared;
        let mut transport = false;
        let r = py.detach(|| -> Result<(), rmacomm_collectives::Error> {
            let mut g = s.gpu.lock().unwrap_or_else(|e| e.into_inner());
            if g.is_none() {
                refuse_setup_under_capture(op, &stream)?;
                *g = Some(rmacomm_collectives::GpuComm::new(&s.meta, ctx, None, s.timeout)?);
            }
            let c = g.as_mut().expect("set above");
            // Device slots only: host slots move with no driver call.
            transport = c.through_transport() && !c.host_slots();
            if c.context().ordinal() != device as i32 {
                return Err(rmacomm_collectives::Error::InvalidArgument {
                    op,
                    reason: format!(
                        "the tensor is on cuda:{device}, this communicator's GPU collectives on cuda:{}",
                        c.context().ordinal()
                    ),
                });
            }
            f(c, &stream)
        });
        if transport {
            cuda_tensor::warn_lazy_loading(py);
        }
        r.map_err(py_err)
    }

    /// Runs `f(comm, peer's rank in it, stream)` on the GPU communicator of
    /// this rank and `peer` (made by the pair's first send/recv: only the
    /// two join it, through a two-rank group under the pair's own store
    /// prefix), with torch's current stream, the GIL released.
    fn native_p2p<F>(&self, py: Python<'_>, op: &'static str, peer: usize, device: u32, f: F) -> PyResult<()>
    where
        F: FnOnce(
                &mut rmacomm_collectives::GpuComm,
                usize,
                &rmacomm_window::cuda::device::Stream,
            ) -> Result<(), rmacomm_collectives::Error>
            + Send,
    {
        let s = &self.shared;
        if peer >= s.size || peer == s.rank {
            return Err(crate::errors::Failure::new(
                crate::errors::ErrKind::Argument,
                format!("{op}: rank {peer} is not a peer of rank {} of {}", s.rank, s.size),
            )
            .into());
        }
        let stream = cuda_tensor::stream(py, None, device)?;
        let ctx = cuda_tensor::context(device)?;
        let (lo, hi) = (s.rank.min(peer), s.rank.max(peer));
        let (me, them) = if s.rank == lo { (0, 1) } else { (1, 0) };
        let mut transport = false;
        let r = py.detach(|| -> Result<(), rmacomm_collectives::Error> {
            let mut pairs = s.gpu_pairs.lock().unwrap_or_else(|e| e.into_inner());
            let c = match pairs.entry(peer) {
                std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::hash_map::Entry::Vacant(v) => {
                    refuse_setup_under_capture(op, &stream)?;
                    let store: std::sync::Arc<dyn rmacomm_window::Store> = std::sync::Arc::new(
                        rmacomm_window::PrefixStore::new(format!("gpu-p2p/{lo}-{hi}/"), s.meta.store()),
                    );
                    let opts = rmacomm_window::GroupOptions::new().timeout(s.timeout);
                    let g = rmacomm_window::Group::with_options(me, 2, store, opts)
                        .map_err(|e| rmacomm_collectives::Error::Window { op, source: e })?;
                    // Slots of 4 MiB: a pair's communicator only sends and
                    // receives (its inboxes are the slot size, at most 4 MiB).
                    v.insert(rmacomm_collectives::GpuComm::new(&g, ctx, Some(4 << 20), s.timeout)?)
                }
            };
            if c.context().ordinal() != device as i32 {
                return Err(rmacomm_collectives::Error::InvalidArgument {
                    op,
                    reason: format!(
                        "the tensor is on cuda:{device}, this pair's GPU send/recv on cuda:{}",
                        c.context().ordinal()
                    ),
                });
            }
            // Device slots only: host slots move with no driver call.
            transport = c.through_transport() && !c.host_slots();
            f(c, them, &stream)
        });
        if transport {
            cuda_tensor::warn_lazy_loading(py);
        }
        r.map_err(py_err)
    }

    /// all_reduce of a CUDA tensor with the native backend (docs/gpu.md).
    fn native_all_reduce(
        &self,
        py: Python<'_>,
        t: &crate::cuda_tensor::CudaTensor,
        op: rmacomm_collectives::ReduceOp,
    ) -> PyResult<()> {
        let dt = native_dtype("all_reduce", t)?;
        let (ptr, len) = (t.ptr, t.nbytes);
        // SAFETY: the tensor is alive for the call, and the work is queued
        // on torch's current stream, which orders the reuse of its memory.
        self.native(py, "all_reduce", t.device, move |c, s| unsafe { c.all_reduce(ptr, len, dt, op, s) })
    }

    /// The two-tensor collectives on CUDA tensors with the native backend:
    /// same dtype, `output` `out_blocks` × and `input` `in_blocks` × a
    /// block of `block` bytes.
    #[allow(clippy::too_many_arguments)]
    fn native_pair(
        &self,
        py: Python<'_>,
        op: &'static str,
        o: &crate::cuda_tensor::CudaTensor,
        i: &crate::cuda_tensor::CudaTensor,
        block: usize,
        (out_blocks, in_blocks): (usize, usize),
        red: Option<rmacomm_collectives::ReduceOp>,
    ) -> PyResult<()> {
        if o.elem.name != i.elem.name
            || o.nbytes != block.saturating_mul(out_blocks)
            || i.nbytes != block.saturating_mul(in_blocks)
        {
            return Err(crate::errors::Failure::new(
                crate::errors::ErrKind::Argument,
                format!(
                    "{op}: output ({} {} B) and input ({} {} B) do not fit: {out_blocks} and {in_blocks} blocks of \
                     {block} B of one dtype",
                    o.elem.name, o.nbytes, i.elem.name, i.nbytes
                ),
            )
            .into());
        }
        if o.device != i.device {
            return Err(crate::errors::Failure::new(
                crate::errors::ErrKind::Argument,
                format!("{op}: output and input are on different GPUs"),
            )
            .into());
        }
        let (op_, ip) = (o.ptr, i.ptr);
        let dt = match red {
            Some(_) => Some(native_dtype(op, o)?),
            None => None,
        };
        // SAFETY: both tensors are alive for the call, their sizes checked,
        // the work queued on torch's current stream.
        self.native(py, op, o.device, move |c, s| unsafe {
            match (op, red, dt) {
                ("all_gather_single", _, _) => c.all_gather(op_, ip, block, s),
                ("all_to_all_single", _, _) => c.all_to_all(op_, ip, block, s),
                (_, Some(r), Some(d)) => c.reduce_scatter(op_, ip, block, d, r, s),
                _ => unreachable!("the callers pass a reduction for reduce_scatter"),
            }
        })
    }

    /// The NCCL side, for a collective on CUDA tensors.
    fn gpu(&self, op: &'static str, ts: &[&crate::cuda_tensor::CudaTensor]) -> PyResult<crate::nccl_backend::Call<'_>> {
        match self.shared.nccl.get() {
            Some(st) => st.call(op, ts),
            None => Err(crate::errors::Failure::new(
                crate::errors::ErrKind::Unavailable,
                format!(
                    "{op}: CUDA tensors need a communicator made with new_comm(\"nccl\") for this call (this one \
                     is rdma: all_reduce, reduce, broadcast, send, recv and the _single forms take CUDA tensors \
                     natively; windows take them on any communicator)"
                ),
            )
            .into()),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn gather_list(
        &self,
        py: Python<'_>,
        name: &'static str,
        tensor_list: &Bound<'_, PyAny>,
        tensor: &Bound<'_, PyAny>,
        async_op: bool,
        hints: Option<HashMap<String, String>>,
        timeout: Option<&Bound<'_, PyAny>>,
        v: bool,
    ) -> PyResult<PyWork> {
        let _ = hints;
        let i = Tensor::new(tensor, "tensor", false)?;
        let outs = tensor::list(tensor_list, "tensor_list", true)?;
        for (k, t) in outs.iter().enumerate() {
            tensor::same_elem(t, &format!("tensor_list[{k}]"), i.elem, "tensor")?;
        }
        let ors = raws(&outs);
        disjoint("tensor_list", &ors)?;
        let src = Src::new(i.raw(), &ors);
        let mut keep: Vec<&Tensor<'_>> = outs.iter().collect();
        keep.push(&i);
        self.shared.run(py, name, async_op, timeout::duration(timeout, "timeout")?, &keep, move |c| {
            // SAFETY: alive until the end, outputs disjoint, an
            // overlapping input copied.
            let mut o = unsafe { slices_mut(&ors) };
            // SAFETY: as above.
            let input = unsafe { src.bytes() };
            if v {
                c.all_gather_v(&mut o, input)
            } else {
                c.all_gather(&mut o, input)
            }
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn scatter_list(
        &self,
        py: Python<'_>,
        name: &'static str,
        output: &Bound<'_, PyAny>,
        input_list: &Bound<'_, PyAny>,
        op: PyReduceOp,
        async_op: bool,
        hints: Option<HashMap<String, String>>,
        timeout: Option<&Bound<'_, PyAny>>,
        v: bool,
    ) -> PyResult<PyWork> {
        let _ = hints;
        let o = Tensor::new(output, "output", true)?;
        let ins = tensor::list(input_list, "input_list", false)?;
        for (k, t) in ins.iter().enumerate() {
            tensor::same_elem(t, &format!("input_list[{k}]"), o.elem, "output")?;
        }
        let (dt, op) = (reduction(&o, "output")?, op.op);
        let or = o.raw();
        let srcs: Vec<Src> = ins.iter().map(|t| Src::new(t.raw(), &[or])).collect();
        let mut keep: Vec<&Tensor<'_>> = ins.iter().collect();
        keep.push(&o);
        self.shared.run(py, name, async_op, timeout::duration(timeout, "timeout")?, &keep, move |c| {
            // SAFETY: alive until the end; inputs overlapping the output
            // copied.
            let i: Vec<&[u8]> = srcs.iter().map(|s| unsafe { s.bytes() }).collect();
            // SAFETY: as above.
            let out = unsafe { or.slice_mut() };
            if v {
                c.reduce_scatter_v(out, &i, dt, op)
            } else {
                c.reduce_scatter(out, &i, dt, op)
            }
        })
    }
}

/// A batch of point-to-point operations (torchcomms' `BatchSendRecv`):
/// `send(tensor, dst)` and `recv(tensor, src)` add to it, `issue()` runs
/// them all together. Operations on one pair and direction match in the
/// order they were added.
#[pyclass(frozen, module = "rmacomm", name = "BatchSendRecv")]
pub(crate) struct PyBatch {
    shared: Arc<CommShared>,
    /// (is a send, tensor, peer)
    ops: Mutex<Vec<(bool, Py<PyAny>, usize)>>,
}

#[pymethods]
impl PyBatch {
    /// Adds a send of `tensor` to `dst`.
    fn send(&self, tensor: Bound<'_, PyAny>, dst: usize) -> PyResult<()> {
        Tensor::new(&tensor, "tensor", false)?;
        self.ops.lock().unwrap_or_else(|e| e.into_inner()).push((true, tensor.unbind(), dst));
        Ok(())
    }

    /// Adds a receive into `tensor` from `src`.
    fn recv(&self, tensor: Bound<'_, PyAny>, src: usize) -> PyResult<()> {
        Tensor::new(&tensor, "tensor", true)?;
        self.ops.lock().unwrap_or_else(|e| e.into_inner()).push((false, tensor.unbind(), src));
        Ok(())
    }

    /// Runs every operation added, together; the batch is empty after.
    #[pyo3(signature = (async_op=false, hints=None, timeout=None))]
    fn issue(
        &self,
        py: Python<'_>,
        async_op: bool,
        hints: Option<HashMap<String, String>>,
        timeout: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyWork> {
        let _ = hints;
        let ops = std::mem::take(&mut *self.ops.lock().unwrap_or_else(|e| e.into_inner()));
        let mut tensors = Vec::with_capacity(ops.len());
        for (k, (send, t, _)) in ops.iter().enumerate() {
            tensors.push(Tensor::new(t.bind(py), &format!("batch op {k}"), !send)?);
        }
        let recvs: Vec<Raw> = ops.iter().zip(&tensors).filter(|((s, _, _), _)| !s).map(|(_, t)| t.raw()).collect();
        disjoint("receive", &recvs)?;
        let plan: Vec<(bool, usize, Src, Raw)> = ops
            .iter()
            .zip(&tensors)
            .map(|((send, _, peer), t)| {
                let src = if *send { Src::new(t.raw(), &recvs) } else { Src::Owned(Vec::new()) };
                (*send, *peer, src, t.raw())
            })
            .collect();
        let keep: Vec<&Tensor<'_>> = tensors.iter().collect();
        self.shared.run(py, "batch", async_op, timeout::duration(timeout, "timeout")?, &keep, move |c| {
            let mut b = c.batch_op_create();
            for (send, peer, src, raw) in &plan {
                b = if *send {
                    // SAFETY: alive until the end; a send overlapping a
                    // receive was copied.
                    b.send(unsafe { src.bytes() }, *peer)
                } else {
                    // SAFETY: alive until the end; receives are disjoint.
                    b.recv(unsafe { raw.slice_mut() }, *peer)
                };
            }
            b.issue(c)
        })
    }
}

/// The native GPU backend's first call on a communicator (or pair) sets up
/// device memory, which a CUDA graph capture does not allow (it would
/// invalidate torch's capture): refused, naming the way out, before
/// anything is allocated.
fn refuse_setup_under_capture(
    op: &'static str,
    stream: &rmacomm_window::cuda::device::Stream,
) -> Result<(), rmacomm_collectives::Error> {
    let capturing = stream.is_capturing().map_err(|source| rmacomm_collectives::Error::Window {
        op,
        source: rmacomm_window::Error::Cuda { op, source },
    })?;
    if capturing {
        return Err(rmacomm_collectives::Error::InvalidArgument {
            op,
            reason: "the first GPU operation of a communicator sets up its device memory, which a CUDA graph \
                     capture does not allow: run one eagerly before capturing (a warm-up, as with NCCL)"
                .into(),
        });
    }
    Ok(())
}
