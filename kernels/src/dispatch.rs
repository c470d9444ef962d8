//! [`Kernels`]: the monomorphised functions of one (dtype, op), chosen once
//! when a [`Reducer`](crate::Reducer) is built, so that a call dispatches
//! through one function pointer and no element ever branches on the op.
//! The instruction set (the AVX2 copy of the native kernels, where the CPU
//! has it) is chosen here too.

use std::ops::Range;

use crate::arith::{Band, Bits, Bor, Bxor, DivBy, Id, Map, Max, Min, Native, Op, Params, Prod, Scale, Sum};
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
    /// With `avx2`, the AVX2 copy of the native kernels if this CPU has
    /// AVX2 (detected at run time); else the baseline copy.
    pub(crate) fn select(dtype: DType, op: ReduceOp, avx2: bool) -> Kernels {
        #[cfg(target_arch = "x86_64")]
        if avx2 && std::arch::is_x86_feature_detected!("avx2") {
            return select_for::<Avx2>(dtype, op);
        }
        let _ = avx2;
        select_for::<Baseline>(dtype, op)
    }
}

fn select_for<I: Isa>(dtype: DType, op: ReduceOp) -> Kernels {
    match dtype {
        DType::F32 => arithmetic::<I, f32>(op),
        DType::F64 => arithmetic::<I, f64>(op),
        DType::I8 => integer::<I, i8>(op),
        DType::U8 => integer::<I, u8>(op),
        DType::I32 => integer::<I, i32>(op),
        DType::I64 => integer::<I, i64>(op),
        DType::F16 => half::<F16>(op),
        DType::BF16 => half::<BF16>(op),
    }
}

/// One compiled copy of the native kernels.
trait Isa {
    fn inplace<T: Native, O: Op<T>>() -> InplaceFn;
    fn reduce<T: Native, O: Op<T>, P: Map<T>, Q: Map<T>>() -> ReduceFn;
    fn map<T: Native, M: Map<T>>() -> MapFn;
}

/// The copy compiled for the baseline target.
struct Baseline;

impl Isa for Baseline {
    fn inplace<T: Native, O: Op<T>>() -> InplaceFn {
        native::baseline::inplace::<T, O>
    }
    fn reduce<T: Native, O: Op<T>, P: Map<T>, Q: Map<T>>() -> ReduceFn {
        native::baseline::reduce::<T, O, P, Q>
    }
    fn map<T: Native, M: Map<T>>() -> MapFn {
        native::baseline::map::<T, M>
    }
}

/// The AVX2 copy: only selected after `is_x86_feature_detected!("avx2")`,
/// which is what makes calling these `#[target_feature]` functions sound.
#[cfg(target_arch = "x86_64")]
struct Avx2;

#[cfg(target_arch = "x86_64")]
impl Isa for Avx2 {
    fn inplace<T: Native, O: Op<T>>() -> InplaceFn {
        native::avx2::inplace::<T, O>
    }
    fn reduce<T: Native, O: Op<T>, P: Map<T>, Q: Map<T>>() -> ReduceFn {
        native::avx2::reduce::<T, O, P, Q>
    }
    fn map<T: Native, M: Map<T>>() -> MapFn {
        native::avx2::map::<T, M>
    }
}

fn integer<I: Isa, T: Bits>(op: ReduceOp) -> Kernels {
    match op {
        ReduceOp::Band => plain::<I, T, Band>(),
        ReduceOp::Bor => plain::<I, T, Bor>(),
        ReduceOp::Bxor => plain::<I, T, Bxor>(),
        op => arithmetic::<I, T>(op),
    }
}

fn arithmetic<I: Isa, T: Native>(op: ReduceOp) -> Kernels {
    match op {
        ReduceOp::Sum => plain::<I, T, Sum>(),
        ReduceOp::Product => plain::<I, T, Prod>(),
        ReduceOp::Min => plain::<I, T, Min>(),
        ReduceOp::Max => plain::<I, T, Max>(),
        ReduceOp::Avg => Kernels {
            full: I::reduce::<T, Sum, Id, DivBy<T>>(),
            finish: Some(I::map::<T, DivBy<T>>()),
            ..plain::<I, T, Sum>()
        },
        ReduceOp::PremulSum(_) => Kernels {
            full: I::reduce::<T, Sum, Scale<T>, Id>(),
            prepare: Some(I::map::<T, Scale<T>>()),
            ..plain::<I, T, Sum>()
        },
        ReduceOp::Band | ReduceOp::Bor | ReduceOp::Bxor => {
            unreachable!("ReduceOp::check refuses bitwise ops on float dtypes")
        }
    }
}

fn plain<I: Isa, T: Native, O: Op<T>>() -> Kernels {
    Kernels {
        inplace: I::inplace::<T, O>(),
        combine: I::reduce::<T, O, Id, Id>(),
        full: I::reduce::<T, O, Id, Id>(),
        prepare: None,
        finish: None,
    }
}

fn half<H: Half>(op: ReduceOp) -> Kernels {
    fn plain<H: Half, O: Op<f32>>() -> Kernels {
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
