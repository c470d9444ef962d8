//! Element arithmetic the kernels are monomorphised over: the binary ops
//! ([`Op`]: `Sum`, `Prod`, `Min`, `Max`, `Band`, `Bor`, `Bxor`) and the
//! per-element maps ([`Map`]: identity, `PremulSum`'s scale, `Avg`'s
//! division), on the compute types (`f16`/`bf16` compute in `f32`).
//!
//! Everything here is branch-free per element (selects, not jumps) so that
//! the loops calling it vectorise; the op is chosen once per call by which
//! instantiation runs, never per element.

/// Run-time values some maps need, passed to every kernel.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Params {
    /// `PremulSum`'s factor (checked by `ReduceOp::check` to fit the dtype).
    pub(crate) factor: f64,
    /// `Avg`'s number of contributions (at least 1).
    pub(crate) count: usize,
}

/// A compute type: what a value is while it is being combined.
pub(crate) trait Native: Copy + Default + Send + Sync + 'static {
    /// The divisor for `Avg`, prepared once per call.
    type Divisor: Copy + Send + Sync + 'static;
    fn add(self, b: Self) -> Self;
    fn mul(self, b: Self) -> Self;
    fn min(self, b: Self) -> Self;
    fn max(self, b: Self) -> Self;
    /// `PremulSum`'s factor as this type (integers: wrapping).
    fn from_factor(f: f64) -> Self;
    fn divisor(n: usize) -> Self::Divisor;
    /// `self / n` (integers truncate toward zero).
    fn div(self, d: Self::Divisor) -> Self;
}

/// Integer compute types: the bitwise ops.
pub(crate) trait Bits: Native {
    fn and(self, b: Self) -> Self;
    fn or(self, b: Self) -> Self;
    fn xor(self, b: Self) -> Self;
}

macro_rules! int_native {
    ($t:ty, $divisor:ty, |$x:ident, $d:ident| $div:expr) => {
        impl Native for $t {
            type Divisor = $divisor;
            #[inline(always)]
            fn add(self, b: Self) -> Self {
                self.wrapping_add(b)
            }
            #[inline(always)]
            fn mul(self, b: Self) -> Self {
                self.wrapping_mul(b)
            }
            #[inline(always)]
            fn min(self, b: Self) -> Self {
                Ord::min(self, b)
            }
            #[inline(always)]
            fn max(self, b: Self) -> Self {
                Ord::max(self, b)
            }
            #[inline(always)]
            fn from_factor(f: f64) -> Self {
                // Integral and within i64 (ReduceOp::check); the narrowing
                // `as` wraps, which is the same factor modulo 2^bits.
                f as i64 as $t
            }
            #[inline(always)]
            fn divisor(n: usize) -> $divisor {
                n as $divisor
            }
            #[inline(always)]
            fn div(self, $d: $divisor) -> Self {
                let $x = self;
                $div
            }
        }
        impl Bits for $t {
            #[inline(always)]
            fn and(self, b: Self) -> Self {
                self & b
            }
            #[inline(always)]
            fn or(self, b: Self) -> Self {
                self | b
            }
            #[inline(always)]
            fn xor(self, b: Self) -> Self {
                self ^ b
            }
        }
    };
}

// Up to 32 bits, divide in f64: the correctly rounded quotient of a value
// below 2^31 by an integer never crosses an integer boundary (the gap to
// the next integer, at least 1/n, exceeds half an ulp there), so `as`'s
// truncation toward zero gives exactly the integer quotient, and x86 has a
// vector f64 divide but no vector integer divide.
int_native!(i8, f64, |x, d| (x as f64 / d) as i8);
int_native!(u8, f64, |x, d| (x as f64 / d) as u8);
int_native!(i32, f64, |x, d| (x as f64 / d) as i32);
// i64 does not fit f64's mantissa: integer division (scalar; Avg's
// finishing step on i64 is the one slow map).
int_native!(i64, i64, |x, d| x / d);

macro_rules! float_native {
    ($t:ty, $bits:ty) => {
        impl Native for $t {
            type Divisor = $t;
            #[inline(always)]
            fn add(self, b: Self) -> Self {
                self + b
            }
            #[inline(always)]
            fn mul(self, b: Self) -> Self {
                self * b
            }
            /// IEEE 754-2019 `minimum`: NaN if either is NaN, and
            /// `-0.0 < +0.0`, so the result does not depend on the order
            /// of the operands (ranks combining in different orders agree).
            #[inline(always)]
            fn min(self, b: Self) -> Self {
                let m = if self < b { self } else { b };
                // Equal values: the same bits, except ±0 where OR-ing the
                // bits picks -0.0.
                let m = if self == b { <$t>::from_bits(self.to_bits() | b.to_bits()) } else { m };
                // Unordered: a + b is a quiet NaN.
                if self.is_nan() || b.is_nan() {
                    self + b
                } else {
                    m
                }
            }
            /// IEEE 754-2019 `maximum`: NaN if either is NaN, and
            /// `+0.0 > -0.0`.
            #[inline(always)]
            fn max(self, b: Self) -> Self {
                let m = if self > b { self } else { b };
                let m = if self == b { <$t>::from_bits(self.to_bits() & b.to_bits()) } else { m };
                if self.is_nan() || b.is_nan() {
                    self + b
                } else {
                    m
                }
            }
            #[inline(always)]
            fn from_factor(f: f64) -> Self {
                f as $t
            }
            #[inline(always)]
            fn divisor(n: usize) -> $t {
                n as $t
            }
            #[inline(always)]
            fn div(self, d: $t) -> Self {
                self / d
            }
        }
    };
}
float_native!(f32, u32);
float_native!(f64, u64);

/// A binary op on compute type `T`, as a zero-sized type so that each
/// (op, type) pair is its own instantiation.
pub(crate) trait Op<T>: Send + Sync + 'static {
    fn apply(a: T, b: T) -> T;
}

macro_rules! ops {
    ($($name:ident: $bound:ident => $method:ident),*) => {$(
        #[derive(Debug, Clone, Copy)]
        pub(crate) struct $name;
        impl<T: $bound> Op<T> for $name {
            #[inline(always)]
            fn apply(a: T, b: T) -> T {
                a.$method(b)
            }
        }
    )*};
}
ops!(Sum: Native => add, Prod: Native => mul, Min: Native => min, Max: Native => max,
     Band: Bits => and, Bor: Bits => or, Bxor: Bits => xor);

/// A per-element map on compute type `T`, built once per call from
/// [`Params`].
pub(crate) trait Map<T>: Copy + Send + Sync + 'static {
    fn new(params: &Params) -> Self;
    fn map(self, x: T) -> T;
}

/// The identity map (combining steps).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Id;

impl<T> Map<T> for Id {
    #[inline(always)]
    fn new(_: &Params) -> Self {
        Id
    }
    #[inline(always)]
    fn map(self, x: T) -> T {
        x
    }
}

/// `PremulSum`'s premultiplication of an input.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Scale<T>(T);

impl<T: Native> Map<T> for Scale<T> {
    #[inline(always)]
    fn new(p: &Params) -> Self {
        Scale(T::from_factor(p.factor))
    }
    #[inline(always)]
    fn map(self, x: T) -> T {
        x.mul(self.0)
    }
}

/// `Avg`'s division of the sum by the number of contributions.
#[derive(Debug, Clone, Copy)]
pub(crate) struct DivBy<T: Native>(T::Divisor);

impl<T: Native> Map<T> for DivBy<T> {
    #[inline(always)]
    fn new(p: &Params) -> Self {
        DivBy(T::divisor(p.count))
    }
    #[inline(always)]
    fn map(self, x: T) -> T {
        x.div(self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float_min_max_follow_ieee_minimum_maximum() {
        let nan = f32::NAN;
        for (a, b) in [(nan, 1.0), (1.0, nan), (nan, f32::INFINITY), (f32::NEG_INFINITY, nan), (nan, nan)] {
            assert!(Native::min(a, b).is_nan() && Native::max(a, b).is_nan(), "{a} {b}");
        }
        for (a, b) in [(0.0f32, -0.0f32), (-0.0, 0.0)] {
            assert_eq!(Native::min(a, b).to_bits(), (-0.0f32).to_bits());
            assert_eq!(Native::max(a, b).to_bits(), 0.0f32.to_bits());
        }
        assert_eq!(Native::min(f32::NEG_INFINITY, -1e38), f32::NEG_INFINITY);
        assert_eq!(Native::max(f64::INFINITY, 1e308), f64::INFINITY);
        assert_eq!(Native::min(2.5f64, -7.0), -7.0);
    }

    #[test]
    fn integer_avg_truncates_toward_zero() {
        let d3 = <i32 as Native>::divisor(3);
        assert_eq!([7i32.div(d3), (-7i32).div(d3), i32::MIN.div(d3)], [2, -2, i32::MIN / 3]);
        assert_eq!((-7i64).div(<i64 as Native>::divisor(2)), -3);
        assert_eq!(255u8.div(<u8 as Native>::divisor(1000)), 0);
        assert_eq!((-128i8).div(<i8 as Native>::divisor(1)), -128);
    }

    #[test]
    fn integer_factor_wraps() {
        assert_eq!(<u8 as Native>::from_factor(-1.0), 255);
        assert_eq!(<i8 as Native>::from_factor(300.0), 44);
    }
}
