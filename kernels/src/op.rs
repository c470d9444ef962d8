//! [`ReduceOp`]: what a reduction computes, and which dtypes allow it.

use std::fmt;
use std::str::FromStr;

use crate::{DType, Error};

/// A reduction op, as in torch.distributed / NCCL.
///
/// Every op is commutative and associative up to floating-point rounding,
/// so any schedule (ring, tree, shared-memory one-pass) may combine in any
/// order; the kernels combine N inputs left to right (`in0`, `in1`, ...).
///
/// | op | integers | floats (`f16`/`bf16` computed in `f32`) |
/// | --- | --- | --- |
/// | `Sum` | wrapping add | add |
/// | `Product` | wrapping mul | mul |
/// | `Min` / `Max` | min / max | IEEE 754-2019 `minimum` / `maximum`: NaN if either input is NaN, `-0.0 < +0.0`, ±inf ordered as usual |
/// | `Band` / `Bor` / `Bxor` | and / or / xor | refused: [`Error::UnsupportedOp`] |
/// | `Avg` | combined as `Sum`; the finishing step divides by n, truncating toward zero (torch's integer division) | combined as `Sum`; finishing divides by n |
/// | `PremulSum(f)` | each *input* is multiplied by `f` (integral, wrapping) before it is summed | each input is multiplied by `f` (rounded to the dtype, `f32` for `f16`/`bf16`) before it is summed |
///
/// `Avg` and `PremulSum` need a step outside the combine: see
/// [`Reducer::prepare`](crate::Reducer::prepare),
/// [`Reducer::finish`](crate::Reducer::finish) and
/// [`Reducer::reduce_full`](crate::Reducer::reduce_full), which fuses both.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub enum ReduceOp {
    /// Sum (integers wrap).
    Sum,
    /// Product (integers wrap).
    Product,
    /// Minimum (NaN propagates).
    Min,
    /// Maximum (NaN propagates).
    Max,
    /// Bitwise and (integers only).
    Band,
    /// Bitwise or (integers only).
    Bor,
    /// Bitwise xor (integers only).
    Bxor,
    /// Sum, then divide by the number of contributions.
    Avg,
    /// Sum of the inputs each multiplied by the factor first (NCCL's
    /// `ncclRedOpCreatePreMulSum`).
    PremulSum(f64),
}

/// 2^63: integer factors must lie in `[-2^63, 2^63)` to convert to i64.
const I64_BOUND: f64 = 9_223_372_036_854_775_808.0;

impl ReduceOp {
    /// The op's lower-case name (`"sum"`, `"premul_sum"`).
    pub const fn name(&self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Product => "product",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Band => "band",
            ReduceOp::Bor => "bor",
            ReduceOp::Bxor => "bxor",
            ReduceOp::Avg => "avg",
            ReduceOp::PremulSum(_) => "premul_sum",
        }
    }

    /// Checks that the op is defined for `dtype`: bitwise ops need an
    /// integer type, and a `PremulSum` factor must fit it.
    pub fn check(&self, dtype: DType) -> Result<(), Error> {
        match *self {
            ReduceOp::Band | ReduceOp::Bor | ReduceOp::Bxor if dtype.is_float() => Err(Error::UnsupportedOp {
                op: self.name(),
                dtype,
                hint: "bitwise ops need an integer dtype; reduce the same bytes as u8 if bitwise is what you mean",
            }),
            ReduceOp::PremulSum(f) if !f.is_finite() && dtype.is_integer() => {
                Err(Error::InvalidFactor { factor: f, dtype, reason: "integer dtypes need a finite integral factor" })
            }
            ReduceOp::PremulSum(f)
                if dtype.is_integer() && (f.fract() != 0.0 || !(-I64_BOUND..I64_BOUND).contains(&f)) =>
            {
                Err(Error::InvalidFactor {
                    factor: f,
                    dtype,
                    reason: "integer dtypes need an integral factor within i64's range (it is applied as a \
                             wrapping integer multiply); use a float dtype for fractional factors",
                })
            }
            _ => Ok(()),
        }
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReduceOp::PremulSum(factor) => write!(f, "premul_sum({factor})"),
            op => f.write_str(op.name()),
        }
    }
}

impl FromStr for ReduceOp {
    type Err = Error;

    /// Parses the factor-less ops by name, case-insensitively, with torch's
    /// spellings (`SUM`, `PRODUCT`/`prod`, `MIN`, `MAX`, `BAND`, `BOR`,
    /// `BXOR`, `AVG`/`mean`). `PremulSum` carries a value and is built in code.
    fn from_str(s: &str) -> Result<Self, Error> {
        Ok(match s.trim().to_ascii_lowercase().as_str() {
            "sum" => ReduceOp::Sum,
            "product" | "prod" => ReduceOp::Product,
            "min" => ReduceOp::Min,
            "max" => ReduceOp::Max,
            "band" => ReduceOp::Band,
            "bor" => ReduceOp::Bor,
            "bxor" => ReduceOp::Bxor,
            "avg" | "mean" => ReduceOp::Avg,
            _ => return Err(Error::UnknownOp(s.to_owned())),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bitwise_ops_on_floats_are_refused() {
        for d in DType::ALL {
            for op in [ReduceOp::Band, ReduceOp::Bor, ReduceOp::Bxor] {
                assert_eq!(op.check(d).is_ok(), d.is_integer(), "{op} on {d}");
            }
        }
        let e = ReduceOp::Bxor.check(DType::BF16).unwrap_err();
        assert!(e.to_string().contains("bxor is not defined for bf16"), "{e}");
    }

    #[test]
    fn premul_factors_must_fit_integers() {
        assert!(ReduceOp::PremulSum(0.5).check(DType::F16).is_ok());
        assert!(ReduceOp::PremulSum(f64::NAN).check(DType::F32).is_ok());
        assert!(ReduceOp::PremulSum(-3.0).check(DType::U8).is_ok());
        for bad in [0.5, f64::NAN, f64::INFINITY, 1e19] {
            assert!(matches!(ReduceOp::PremulSum(bad).check(DType::I32), Err(Error::InvalidFactor { .. })), "{bad}");
        }
    }

    #[test]
    fn names_parse() {
        for op in [ReduceOp::Sum, ReduceOp::Product, ReduceOp::Min, ReduceOp::Max, ReduceOp::Avg, ReduceOp::Bxor] {
            assert_eq!(op.name().parse::<ReduceOp>().unwrap(), op);
        }
        assert_eq!("PROD".parse::<ReduceOp>().unwrap(), ReduceOp::Product);
        assert_eq!(ReduceOp::PremulSum(0.25).to_string(), "premul_sum(0.25)");
        assert!(matches!("premul_sum".parse::<ReduceOp>(), Err(Error::UnknownOp(_))));
    }
}
