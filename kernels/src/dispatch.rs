//! [`Kernels`]: the monomorphised functions of one (dtype, op), chosen once
//! when a [`Reducer`](crate::Reducer) is built, so that a call dispatches
//! through one function pointer and no element ever branches on the op.

use std::ops::Range;

use crate::arith::{Band, Bits, Bor, Bxor, DivBy, Id, Max, Min, Native, Params, Prod, Scale, Sum};
use crate::halfs::{self, Half, BF16, F16};
use crate::{native, DType, ReduceOp};

/// `dst = op(dst, src)` over an element range.
pub(crate) type InplaceFn = unsafe fn(*mut u8, *const u8, Range<usize>);
/// `out = post(op(pre(in0), pre(in1), ...))` over an element range;
/// `bool`: stream the output.
pub(crate) type ReduceFn = unsafe fn(*mut u8, &[*const u8], Range<usize>, bool, &Params);
/// `buf = map(buf)` over an element range.
pub(crate) type MapFn = unsafe fn(*mut u8, Range<usize>, &Params);

/// The kernels of one (dtype, op).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Kernels {
    /// Combine in place (`Avg` and `PremulSum` combine as `Sum`).
    pub(crate) inplace: InplaceFn,
    /// Combine N inputs into an output.
    pub(crate) combine: ReduceFn,
    /// Premultiply, combine and finish in one pass.
    pub(crate) full: ReduceFn,
    /// Premultiply a contribution (`PremulSum` only).
    pub(crate) prepare: Option<MapFn>,
    /// Finish a combined result (`Avg` only).
    pub(crate) finish: Option<MapFn>,
}

impl Kernels {
    /// The kernels for `op` on `dtype`; `op.check(dtype)` must have passed.
    pub(crate) fn select(dtype: DType, op: ReduceOp) -> Kernels {
        match dtype {
            DType::F32 => arithmetic::<f32>(op),
            DType::F64 => arithmetic::<f64>(op),
            DType::I8 => integer::<i8>(op),
            DType::U8 => integer::<u8>(op),
            DType::I32 => integer::<i32>(op),
            DType::I64 => integer::<i64>(op),
            DType::F16 => half::<F16>(op),
            DType::BF16 => half::<BF16>(op),
        }
    }
}

fn integer<T: Bits>(op: ReduceOp) -> Kernels {
    match op {
        ReduceOp::Band => plain::<T, Band>(),
        ReduceOp::Bor => plain::<T, Bor>(),
        ReduceOp::Bxor => plain::<T, Bxor>(),
        op => arithmetic::<T>(op),
    }
}

fn arithmetic<T: Native>(op: ReduceOp) -> Kernels {
    match op {
        ReduceOp::Sum => plain::<T, Sum>(),
        ReduceOp::Product => plain::<T, Prod>(),
        ReduceOp::Min => plain::<T, Min>(),
        ReduceOp::Max => plain::<T, Max>(),
        ReduceOp::Avg => Kernels {
            full: native::reduce::<T, Sum, Id, DivBy<T>>,
            finish: Some(native::map::<T, DivBy<T>>),
            ..plain::<T, Sum>()
        },
        ReduceOp::PremulSum(_) => Kernels {
            full: native::reduce::<T, Sum, Scale<T>, Id>,
            prepare: Some(native::map::<T, Scale<T>>),
            ..plain::<T, Sum>()
        },
        ReduceOp::Band | ReduceOp::Bor | ReduceOp::Bxor => {
            unreachable!("ReduceOp::check refuses bitwise ops on float dtypes")
        }
    }
}

fn plain<T: Native, O: crate::arith::Op<T>>() -> Kernels {
    Kernels {
        inplace: native::inplace::<T, O>,
        combine: native::reduce::<T, O, Id, Id>,
        full: native::reduce::<T, O, Id, Id>,
        prepare: None,
        finish: None,
    }
}

fn half<H: Half>(op: ReduceOp) -> Kernels {
    fn plain<H: Half, O: crate::arith::Op<f32>>() -> Kernels {
        Kernels {
            inplace: halfs::inplace::<H, O>,
            combine: halfs::reduce::<H, O, Id, Id>,
            full: halfs::reduce::<H, O, Id, Id>,
            prepare: None,
            finish: None,
        }
    }
    match op {
        ReduceOp::Sum => plain::<H, Sum>(),
        ReduceOp::Product => plain::<H, Prod>(),
        ReduceOp::Min => plain::<H, Min>(),
        ReduceOp::Max => plain::<H, Max>(),
        ReduceOp::Avg => Kernels {
            full: halfs::reduce::<H, Sum, Id, DivBy<f32>>,
            finish: Some(halfs::map::<H, DivBy<f32>>),
            ..plain::<H, Sum>()
        },
        ReduceOp::PremulSum(_) => Kernels {
            full: halfs::reduce::<H, Sum, Scale<f32>, Id>,
            prepare: Some(halfs::map::<H, Scale<f32>>),
            ..plain::<H, Sum>()
        },
        ReduceOp::Band | ReduceOp::Bor | ReduceOp::Bxor => {
            unreachable!("ReduceOp::check refuses bitwise ops on float dtypes")
        }
    }
}
