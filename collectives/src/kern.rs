//! The reductions the collectives call (a thin layer over the kernels).
//! TEMPORARY scalar stand-in until rmacomm-kernels lands.

use std::fmt;

/// Element types.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// f32
    F32,
    /// f64
    F64,
    /// i8
    I8,
    /// u8
    U8,
    /// i32
    I32,
    /// i64
    I64,
}

impl DType {
    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            DType::I8 | DType::U8 => 1,
            DType::F32 | DType::I32 => 4,
            DType::F64 | DType::I64 => 8,
        }
    }
    fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64)
    }
}

/// Reduction operations.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ReduceOp {
    /// sum
    Sum,
    /// product
    Product,
    /// min
    Min,
    /// max
    Max,
    /// bitwise and
    Band,
    /// bitwise or
    Bor,
    /// bitwise xor
    Bxor,
    /// average
    Avg,
    /// sum of inputs premultiplied by the factor
    PremulSum(f64),
}

/// Kernel errors.
#[derive(Debug, Clone)]
pub struct Error(String);

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Error {}

pub(crate) fn check(dtype: DType, op: ReduceOp) -> Result<(), Error> {
    if matches!(op, ReduceOp::Band | ReduceOp::Bor | ReduceOp::Bxor) && dtype.is_float() {
        return Err(Error(format!("{op:?} needs an integer dtype, not {dtype:?}")));
    }
    Ok(())
}

macro_rules! each {
    ($t:ty, $out:expr, $inp:expr, $f:expr) => {{
        let s = std::mem::size_of::<$t>();
        for (o, i) in $out.chunks_exact_mut(s).zip($inp.chunks_exact(s)) {
            let a = <$t>::from_le_bytes(o.try_into().unwrap());
            let b = <$t>::from_le_bytes(i.try_into().unwrap());
            let r: $t = $f(a, b);
            o.copy_from_slice(&r.to_le_bytes());
        }
    }};
}

macro_rules! int_op {
    ($t:ty, $op:expr, $out:expr, $inp:expr) => {
        match $op {
            ReduceOp::Sum | ReduceOp::Avg | ReduceOp::PremulSum(_) => {
                each!($t, $out, $inp, |a: $t, b: $t| a.wrapping_add(b))
            }
            ReduceOp::Product => each!($t, $out, $inp, |a: $t, b: $t| a.wrapping_mul(b)),
            ReduceOp::Min => each!($t, $out, $inp, |a: $t, b: $t| a.min(b)),
            ReduceOp::Max => each!($t, $out, $inp, |a: $t, b: $t| a.max(b)),
            ReduceOp::Band => each!($t, $out, $inp, |a: $t, b: $t| a & b),
            ReduceOp::Bor => each!($t, $out, $inp, |a: $t, b: $t| a | b),
            ReduceOp::Bxor => each!($t, $out, $inp, |a: $t, b: $t| a ^ b),
        }
    };
}

macro_rules! float_op {
    ($t:ty, $op:expr, $out:expr, $inp:expr) => {
        match $op {
            ReduceOp::Sum | ReduceOp::Avg | ReduceOp::PremulSum(_) => each!($t, $out, $inp, |a: $t, b: $t| a + b),
            ReduceOp::Product => each!($t, $out, $inp, |a: $t, b: $t| a * b),
            ReduceOp::Min => {
                each!($t, $out, $inp, |a: $t, b: $t| if a.is_nan() || b.is_nan() { <$t>::NAN } else { a.min(b) })
            }
            ReduceOp::Max => {
                each!($t, $out, $inp, |a: $t, b: $t| if a.is_nan() || b.is_nan() { <$t>::NAN } else { a.max(b) })
            }
            _ => unreachable!("checked"),
        }
    };
}

/// `out = op(out, input)` element-wise.
pub(crate) fn reduce_into(dtype: DType, op: ReduceOp, out: &mut [u8], input: &[u8]) -> Result<(), Error> {
    check(dtype, op)?;
    match dtype {
        DType::F32 => float_op!(f32, op, out, input),
        DType::F64 => float_op!(f64, op, out, input),
        DType::I8 => int_op!(i8, op, out, input),
        DType::U8 => int_op!(u8, op, out, input),
        DType::I32 => int_op!(i32, op, out, input),
        DType::I64 => int_op!(i64, op, out, input),
    }
    Ok(())
}

/// AVG divides by `n`, PREMUL_SUM multiplies by its factor.
pub(crate) fn finish(dtype: DType, op: ReduceOp, n: usize, out: &mut [u8]) -> Result<(), Error> {
    let (mul, div) = match op {
        ReduceOp::Avg => (1.0, n as f64),
        ReduceOp::PremulSum(f) => (f, 1.0),
        _ => return Ok(()),
    };
    let copy = out.to_vec();
    macro_rules! scale_f {
        ($t:ty) => {
            each!($t, out, copy, |a: $t, _b: $t| ((a as f64) * mul / div) as $t)
        };
    }
    macro_rules! scale_i {
        ($t:ty) => {
            each!($t, out, copy, |a: $t, _b: $t| if div != 1.0 { a / (div as $t) } else { a.wrapping_mul(mul as $t) })
        };
    }
    match dtype {
        DType::F32 => scale_f!(f32),
        DType::F64 => scale_f!(f64),
        DType::I8 => scale_i!(i8),
        DType::U8 => scale_i!(u8),
        DType::I32 => scale_i!(i32),
        DType::I64 => scale_i!(i64),
    }
    Ok(())
}
