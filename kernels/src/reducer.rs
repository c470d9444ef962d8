//! [`Reducer`]: one (device, dtype, op) with its kernels chosen, and the
//! entry points the collectives call: combine in place, combine 2 or N
//! inputs into an output, prepare/finish for `PremulSum`/`Avg`, each on
//! byte slices and on raw pointers.

use std::ptr;

use crate::arith::Params;
use crate::dispatch::{Kernels, MapFn, ReduceFn};
use crate::parallel::{self, Shared};
use crate::{DType, Device, Error, ReduceOp, Result};

/// The default least output size that streams when [`Reducer::nontemporal`]
/// is on; smaller outputs are stored ordinarily.
///
/// Streaming pays only once the data no longer fits the last-level cache:
/// on this project's CI machine (AMD EPYC Zen 4 VM, 1 MiB L2 per core,
/// 32 MiB L3) a streamed 2-input f32 sum lost to ordinary stores at 1, 2,
/// 4 and 16 MiB outputs (down to a third of the speed at 2 MiB) and gained
/// up to a third at 64 MiB (in one run of two; the VM is shared and noisy).
/// Set the machine's own figure, ideally its L3 size, with
/// [`Reducer::nontemporal_min_bytes`].
pub const NONTEMPORAL_MIN_BYTES: usize = 32 << 20;

/// Outputs at least this large are split over [`Reducer::threads`] threads
/// (each taking at least 1 MiB); smaller ones run on the calling thread.
pub const PARALLEL_MIN_BYTES: usize = 4 << 20;

/// Inputs up to this count are passed to the kernels without allocating.
const INLINE_INPUTS: usize = 16;

/// Reductions of one op on one dtype: build it once per collective call,
/// then call its entry points on each chunk.
///
/// Building checks the op against the dtype (bitwise ops on floats and
/// `PremulSum` factors an integer type cannot hold are errors) and picks
/// the monomorphised kernels, so calls dispatch once and never per element.
///
/// # Entry points and `Avg` / `PremulSum`
///
/// The combining calls — [`reduce_into`](Self::reduce_into),
/// [`reduce`](Self::reduce), [`reduce_n`](Self::reduce_n) — apply the op's
/// *combine*: for `Avg` and `PremulSum` that is `Sum`. A schedule that
/// combines in steps (ring, tree) calls [`prepare`](Self::prepare) on each
/// rank's own contribution before it enters the reduction (`PremulSum`
/// multiplies it by the factor: the factor is applied to **inputs before
/// summing**, as NCCL does), and [`finish`](Self::finish) once on the
/// combined result (`Avg` divides by the number of contributions; integers
/// truncate toward zero). Both are no-ops for the other ops.
///
/// [`reduce_full`](Self::reduce_full) is all three in one pass, for a
/// schedule that sees every contribution at once (the shared-memory
/// all_reduce: `out = finish(prepare(in0) + prepare(in1) + ...)`, with
/// `n` the number of inputs).
///
/// # Buffers
///
/// Lengths are in bytes and must be equal and a multiple of the dtype's
/// size; buffers need no alignment. The raw-pointer variants (`*_raw`) are
/// for memory that must not be borrowed as a Rust slice (peers' shared
/// memory, registered buffers).
#[derive(Debug, Clone)]
pub struct Reducer {
    device: Device,
    dtype: DType,
    op: ReduceOp,
    kernels: Kernels,
    threads: usize,
    nontemporal: bool,
    nontemporal_min: usize,
    avx2: bool,
}

impl Reducer {
    /// A CPU reducer for `op` on `dtype`, with the default thread count and
    /// ordinary stores.
    ///
    /// Errors: [`Error::UnsupportedOp`] for a bitwise op on a float dtype,
    /// [`Error::InvalidFactor`] for a `PremulSum` factor the dtype cannot
    /// hold.
    pub fn new(dtype: DType, op: ReduceOp) -> Result<Self> {
        Self::on(Device::Cpu, dtype, op)
    }

    /// A reducer on `device`. Only [`Device::Cpu`] has a backend in this
    /// build; others return [`Error::DeviceUnavailable`].
    pub fn on(device: Device, dtype: DType, op: ReduceOp) -> Result<Self> {
        if device != Device::Cpu {
            return Err(Error::DeviceUnavailable { device });
        }
        op.check(dtype)?;
        Ok(Reducer {
            device,
            dtype,
            op,
            kernels: Kernels::select(dtype, op, true),
            threads: parallel::default_threads(),
            nontemporal: false,
            nontemporal_min: NONTEMPORAL_MIN_BYTES,
            avx2: true,
        })
    }

    /// Sets the most threads one call may use for outputs of at least
    /// [`PARALLEL_MIN_BYTES`] (0 counts as 1). The default is
    /// `RMACOMM_REDUCE_THREADS` if set, else 1 on machines with at most 2
    /// cores and half the cores (at most 8) on larger ones.
    pub fn threads(mut self, threads: usize) -> Self {
        self.threads = threads.max(1);
        self
    }

    /// Streams outputs of at least [`NONTEMPORAL_MIN_BYTES`] (or what
    /// [`nontemporal_min_bytes`](Self::nontemporal_min_bytes) set) with
    /// non-temporal stores (x86_64; ordinary stores elsewhere).
    ///
    /// Turn it on when the result is large and this core will not read it
    /// again soon: a final result bound for a NIC or another process, or an
    /// output larger than the last-level cache. Leave it off when the next
    /// step reads the output (a ring's next send from cache). It applies to
    /// [`reduce`](Self::reduce), [`reduce_n`](Self::reduce_n) and
    /// [`reduce_full`](Self::reduce_full); the in-place calls read their
    /// destination anyway and store ordinarily.
    pub fn nontemporal(mut self, on: bool) -> Self {
        self.nontemporal = on;
        self
    }

    /// Sets the least output size that streams when
    /// [`nontemporal`](Self::nontemporal) is on (default
    /// [`NONTEMPORAL_MIN_BYTES`]); the last-level cache's size is a good
    /// value. 0 streams every output.
    pub fn nontemporal_min_bytes(mut self, bytes: usize) -> Self {
        self.nontemporal_min = bytes;
        self
    }

    /// Whether to use the AVX2 copy of the kernels where the CPU has it
    /// (detected at run time; the default). Off, the kernels compiled for
    /// the build's target run (SSE2 on a default x86_64 build): for
    /// comparison and tests. No effect off x86_64, and none on `f16`/`bf16`
    /// widening, which the `half` crate dispatches itself.
    pub fn avx2(mut self, on: bool) -> Self {
        self.avx2 = on;
        self.kernels = Kernels::select(self.dtype, self.op, on);
        self
    }

    /// The device.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The op.
    pub fn op(&self) -> ReduceOp {
        self.op
    }

    /// The most threads a call may use.
    pub fn thread_count(&self) -> usize {
        self.threads
    }

    /// `dst[i] = op(dst[i], src[i])`.
    pub fn reduce_into(&self, dst: &mut [u8], src: &[u8]) -> Result<()> {
        self.check_len("reduce_into", dst.len(), [src.len()])?;
        // SAFETY: both slices are valid for their (equal) length, and a
        // `&mut` and a `&` never overlap or change under us.
        unsafe { self.run_inplace(dst.as_mut_ptr(), src.as_ptr(), dst.len()) };
        Ok(())
    }

    /// `out[i] = op(a[i], b[i])`.
    pub fn reduce(&self, out: &mut [u8], a: &[u8], b: &[u8]) -> Result<()> {
        self.check_len("reduce", out.len(), [a.len(), b.len()])?;
        // SAFETY: all valid for the common length; the `&mut` overlaps none.
        unsafe { self.run(self.kernels.combine, out.as_mut_ptr(), &[a.as_ptr(), b.as_ptr()], out.len(), 2) };
        Ok(())
    }

    /// `out[i] = op(in0[i], in1[i], ..., in_{k-1}[i])` in one pass: every
    /// input is read once and the output stored once.
    pub fn reduce_n(&self, out: &mut [u8], inputs: &[&[u8]]) -> Result<()> {
        self.reduce_slices("reduce_n", self.kernels.combine, out, inputs)
    }

    /// `out = finish(prepare(in0) op prepare(in1) op ...)` in one pass, `n`
    /// being `inputs.len()`: the whole reduction of raw contributions
    /// (`Avg`: the average; `PremulSum(f)`: `f*in0 + f*in1 + ...`; other
    /// ops: as [`reduce_n`](Self::reduce_n)). `f16`/`bf16` accumulate in
    /// `f32` and round once.
    pub fn reduce_full(&self, out: &mut [u8], inputs: &[&[u8]]) -> Result<()> {
        self.reduce_slices("reduce_full", self.kernels.full, out, inputs)
    }

    /// Prepares a rank's own contribution in place before it is combined:
    /// `PremulSum(f)` multiplies it by `f`; a no-op for the other ops.
    pub fn prepare(&self, buf: &mut [u8]) -> Result<()> {
        self.check_len("prepare", buf.len(), [])?;
        // SAFETY: the slice is valid and exclusively ours for its length.
        unsafe { self.run_map(self.kernels.prepare, buf.as_mut_ptr(), buf.len(), 1) };
        Ok(())
    }

    /// Finishes a combined result of `n` contributions in place: `Avg`
    /// divides by `n` (integers: truncating toward zero, as torch does); a
    /// no-op for the other ops. `n` must be at least 1.
    pub fn finish(&self, buf: &mut [u8], n: usize) -> Result<()> {
        self.check_len("finish", buf.len(), [])?;
        Self::check_count("finish", n)?;
        // SAFETY: the slice is valid and exclusively ours for its length.
        unsafe { self.run_map(self.kernels.finish, buf.as_mut_ptr(), buf.len(), n) };
        Ok(())
    }

    /// [`reduce_into`](Self::reduce_into) on raw pointers, `len` bytes.
    ///
    /// # Safety
    ///
    /// `dst` is valid for reads and writes and `src` for reads of `len`
    /// bytes (any alignment), and for the duration of the call nothing else
    /// writes either range nor reads `dst` (for shared memory: the peers
    /// have been synchronised with, e.g. by a signal). `src` may equal
    /// `dst`; a partial overlap gives unspecified values in `dst`.
    pub unsafe fn reduce_into_raw(&self, dst: *mut u8, src: *const u8, len: usize) -> Result<()> {
        self.check_len("reduce_into_raw", len, [])?;
        // SAFETY: the caller's contract.
        unsafe { self.run_inplace(dst, src, len) };
        Ok(())
    }

    /// [`reduce`](Self::reduce) on raw pointers, `len` bytes.
    ///
    /// # Safety
    ///
    /// `a` and `b` are valid for reads and `out` for writes of `len` bytes
    /// (any alignment); for the duration of the call nothing else writes
    /// any of them nor reads `out`. `out` may equal `a` or `b` (it is then
    /// combined in place); a partial overlap gives unspecified values in
    /// `out`.
    pub unsafe fn reduce_raw(&self, out: *mut u8, a: *const u8, b: *const u8, len: usize) -> Result<()> {
        self.check_len("reduce_raw", len, [])?;
        // SAFETY: the caller's contract; every op is commutative, so
        // `out == b` may combine `a` into it.
        unsafe {
            if out.cast_const() == a {
                self.run_inplace(out, b, len);
            } else if out.cast_const() == b {
                self.run_inplace(out, a, len);
            } else {
                self.run(self.kernels.combine, out, &[a, b], len, 2);
            }
        }
        Ok(())
    }

    /// [`reduce_n`](Self::reduce_n) on raw pointers, `len` bytes each.
    ///
    /// # Safety
    ///
    /// Every input is valid for reads and `out` for writes of `len` bytes
    /// (any alignment); for the duration of the call nothing else writes
    /// any of them nor reads `out`. `out` may equal one or more inputs; a
    /// partial overlap gives unspecified values in `out`.
    pub unsafe fn reduce_n_raw(&self, out: *mut u8, inputs: &[*const u8], len: usize) -> Result<()> {
        self.check_len("reduce_n_raw", len, [])?;
        Self::check_count("reduce_n_raw", inputs.len())?;
        // SAFETY: the caller's contract.
        unsafe { self.run(self.kernels.combine, out, inputs, len, inputs.len()) };
        Ok(())
    }

    /// [`reduce_full`](Self::reduce_full) on raw pointers, `len` bytes each.
    ///
    /// # Safety
    ///
    /// As [`reduce_n_raw`](Self::reduce_n_raw).
    pub unsafe fn reduce_full_raw(&self, out: *mut u8, inputs: &[*const u8], len: usize) -> Result<()> {
        self.check_len("reduce_full_raw", len, [])?;
        Self::check_count("reduce_full_raw", inputs.len())?;
        // SAFETY: the caller's contract.
        unsafe { self.run(self.kernels.full, out, inputs, len, inputs.len()) };
        Ok(())
    }

    /// [`prepare`](Self::prepare) on a raw pointer, `len` bytes.
    ///
    /// # Safety
    ///
    /// `buf` is valid for reads and writes of `len` bytes (any alignment)
    /// and nothing else accesses them during the call.
    pub unsafe fn prepare_raw(&self, buf: *mut u8, len: usize) -> Result<()> {
        self.check_len("prepare_raw", len, [])?;
        // SAFETY: the caller's contract.
        unsafe { self.run_map(self.kernels.prepare, buf, len, 1) };
        Ok(())
    }

    /// [`finish`](Self::finish) on a raw pointer, `len` bytes.
    ///
    /// # Safety
    ///
    /// As [`prepare_raw`](Self::prepare_raw).
    pub unsafe fn finish_raw(&self, buf: *mut u8, len: usize, n: usize) -> Result<()> {
        self.check_len("finish_raw", len, [])?;
        Self::check_count("finish_raw", n)?;
        // SAFETY: the caller's contract.
        unsafe { self.run_map(self.kernels.finish, buf, len, n) };
        Ok(())
    }

    fn reduce_slices(&self, op: &'static str, kernel: ReduceFn, out: &mut [u8], inputs: &[&[u8]]) -> Result<()> {
        Self::check_count(op, inputs.len())?;
        self.check_len(op, out.len(), inputs.iter().map(|s| s.len()))?;
        let mut inline = [ptr::null::<u8>(); INLINE_INPUTS];
        let heap: Vec<*const u8>;
        let ptrs: &[*const u8] = if inputs.len() <= INLINE_INPUTS {
            for (p, s) in inline.iter_mut().zip(inputs) {
                *p = s.as_ptr();
            }
            &inline[..inputs.len()]
        } else {
            heap = inputs.iter().map(|s| s.as_ptr()).collect();
            &heap
        };
        // SAFETY: every slice is valid for the common length; the `&mut`
        // overlaps none of the inputs.
        unsafe { self.run(kernel, out.as_mut_ptr(), ptrs, out.len(), inputs.len()) };
        Ok(())
    }

    fn check_len(&self, op: &'static str, len: usize, others: impl IntoIterator<Item = usize>) -> Result<()> {
        if let Some(other) = others.into_iter().find(|&l| l != len) {
            return Err(Error::InvalidArgument {
                op,
                reason: format!("buffers of {len} and {other} bytes; every buffer of one call has the same length"),
            });
        }
        if !len.is_multiple_of(self.dtype.size()) {
            return Err(Error::InvalidArgument {
                op,
                reason: format!(
                    "{len} bytes is not a whole number of {} elements ({} bytes each)",
                    self.dtype,
                    self.dtype.size()
                ),
            });
        }
        Ok(())
    }

    fn check_count(op: &'static str, n: usize) -> Result<()> {
        if n == 0 {
            return Err(Error::InvalidArgument {
                op,
                reason: "no contributions: pass at least one input (and n >= 1 to finish)".into(),
            });
        }
        Ok(())
    }

    fn parallel_threads(&self, len: usize) -> usize {
        if len >= PARALLEL_MIN_BYTES {
            self.threads
        } else {
            1
        }
    }

    /// # Safety
    ///
    /// As `reduce_into_raw`, with `len` checked.
    unsafe fn run_inplace(&self, dst: *mut u8, src: *const u8, len: usize) {
        let (size, elems, kernel) = (self.dtype.size(), len / self.dtype.size(), self.kernels.inplace);
        let threads = self.parallel_threads(len);
        if threads <= 1 {
            // SAFETY: the caller's contract for 0..elems.
            unsafe { kernel(dst, src, 0..elems) };
            return;
        }
        let shared = Shared::new((dst, src));
        parallel::for_each_range(elems, size, threads, &|r| {
            let (dst, src) = shared.get();
            // SAFETY: the caller's contract; the ranges are disjoint.
            unsafe { kernel(dst, src, r) }
        });
    }

    /// # Safety
    ///
    /// As `reduce_n_raw`, with `len` checked and `inputs` not empty; `count`
    /// is `Avg`'s number of contributions.
    unsafe fn run(&self, kernel: ReduceFn, out: *mut u8, inputs: &[*const u8], len: usize, count: usize) {
        let params = Params { factor: self.factor(), count };
        let (size, elems) = (self.dtype.size(), len / self.dtype.size());
        let nt = self.nontemporal && len >= self.nontemporal_min;
        let threads = self.parallel_threads(len);
        if threads <= 1 {
            // SAFETY: the caller's contract for 0..elems.
            unsafe { kernel(out, inputs, 0..elems, nt, &params) };
            return;
        }
        let shared = Shared::new((out, inputs));
        parallel::for_each_range(elems, size, threads, &|r| {
            let (out, inputs) = shared.get();
            // SAFETY: the caller's contract; the ranges are disjoint, and
            // each thread fences its own streaming stores.
            unsafe { kernel(out, inputs, r, nt, &params) }
        });
    }

    /// # Safety
    ///
    /// As `prepare_raw`, with `len` checked.
    unsafe fn run_map(&self, kernel: Option<MapFn>, buf: *mut u8, len: usize, count: usize) {
        let Some(kernel) = kernel else { return };
        let params = Params { factor: self.factor(), count };
        let (size, elems) = (self.dtype.size(), len / self.dtype.size());
        let threads = self.parallel_threads(len);
        if threads <= 1 {
            // SAFETY: the caller's contract for 0..elems.
            unsafe { kernel(buf, 0..elems, &params) };
            return;
        }
        let shared = Shared::new(buf);
        parallel::for_each_range(elems, size, threads, &|r| {
            // SAFETY: the caller's contract; the ranges are disjoint.
            unsafe { kernel(shared.get(), r, &params) }
        });
    }

    fn factor(&self) -> f64 {
        match self.op {
            ReduceOp::PremulSum(f) => f,
            _ => 1.0,
        }
    }
}
