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
/// as sums; [`finish`] applies the rest).
pub(crate) fn reducer(dtype: DType, op: ReduceOp) -> Result<Reducer, Error> {
    Reducer::new(dtype, op)
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

/// The last step on a combined result of `n` contributions: `Avg` divides
/// by `n`; `PremulSum(f)` multiplies by `f` (Σ f·xᵢ = f·Σ xᵢ: exact for
/// integers, which wrap; for floats the rounding may differ in the last
/// bit from premultiplying each input).
pub(crate) fn finish(r: &Reducer, n: usize, out: &mut [u8]) -> Result<(), Error> {
    match r.op() {
        ReduceOp::Avg => r.finish(out, n),
        ReduceOp::PremulSum(_) => r.prepare(out),
        _ => Ok(()),
    }
}
