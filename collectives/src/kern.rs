//! The reductions the collectives call: a thin layer over
//! `rmacomm-kernels`' [`Reducer`].

use rmacomm_kernels::Reducer;
pub(crate) use rmacomm_kernels::{DType, Error, ReduceOp};

/// Refuses an op the dtype cannot take (a bitwise op on floats, a
/// fractional PREMUL_SUM factor on integers) before anything moves.
pub(crate) fn check(dtype: DType, op: ReduceOp) -> Result<(), Error> {
    op.check(dtype)
}

/// The reducer that combines contributions (`Avg` and `PremulSum` combine
/// as sums: [`scaler`] and [`finish`] apply the rest).
pub(crate) fn reducer(dtype: DType, op: ReduceOp) -> Result<Reducer, Error> {
    Reducer::new(dtype, op)
}

/// What scales each rank's own contribution before it is combined, for
/// the ops that scale: `PremulSum(f)` by the rank's own `f`, a float `Avg`
/// by 1/n. NCCL's order — Σ f·xᵢ, not f·Σ xᵢ — which differs beyond
/// rounding: an f16 average of 40000 and 40000 is 40000, where summing
/// first overflows to inf; and ranks' factors may differ.
pub(crate) fn scaler(dtype: DType, op: ReduceOp, n: usize) -> Result<Option<Reducer>, Error> {
    match op {
        ReduceOp::PremulSum(_) => Reducer::new(dtype, op).map(Some),
        ReduceOp::Avg if dtype.is_float() => Reducer::new(dtype, ReduceOp::PremulSum(1.0 / n as f64)).map(Some),
        _ => Ok(None),
    }
}

/// `out` = the combination of `inputs` (in rank order, `out` among them),
/// `len` bytes each, in one pass.
///
/// # Safety
/// `out` is valid for writes and every input for reads of `len` bytes;
/// nothing else writes any of them during the call (peers' chunks in this
/// rank's window are not overwritten before they are acknowledged); inputs
/// other than `out` do not overlap `out`.
pub(crate) unsafe fn combine_raw(r: &Reducer, out: *mut u8, inputs: &[*const u8], len: usize) -> Result<(), Error> {
    if inputs.len() < 2 {
        return Ok(());
    }
    // SAFETY: the caller's contract, which is the kernel's.
    unsafe { r.reduce_n_raw(out, inputs, len) }
}

/// The last step on a combined result of `n` contributions: an integer
/// `Avg` divides by `n` (truncating, as torch does; the sum wraps, as
/// NCCL's does). Everything else was scaled before it was combined
/// ([`scaler`]).
pub(crate) fn finish(r: &Reducer, n: usize, out: &mut [u8]) -> Result<(), Error> {
    match r.op() {
        ReduceOp::Avg if !r.dtype().is_float() => r.finish(out, n),
        _ => Ok(()),
    }
}
