//! A scalar reference for every (op, dtype): one element at a time, written
//! independently of the kernels (branches instead of selects, i128 for
//! integer wrapping, `half`'s own conversions), to compare them against.

#![allow(dead_code, unreachable_pub)]

use half::{bf16, f16};
use rmacomm_kernels::{DType, ReduceOp};

/// One element's value while it is computed.
#[derive(Debug, Clone, Copy)]
pub enum Val {
    /// f32, and f16/bf16 widened to f32.
    F32(f32),
    F64(f64),
    /// Integers, held in range for their dtype.
    Int(i128),
}

pub fn load(dtype: DType, bytes: &[u8], i: usize) -> Val {
    let s = dtype.size();
    let b = &bytes[i * s..(i + 1) * s];
    match dtype {
        DType::F32 => Val::F32(f32::from_ne_bytes(b.try_into().unwrap())),
        DType::F64 => Val::F64(f64::from_ne_bytes(b.try_into().unwrap())),
        DType::F16 => Val::F32(f16::from_ne_bytes(b.try_into().unwrap()).to_f32()),
        DType::BF16 => Val::F32(bf16::from_ne_bytes(b.try_into().unwrap()).to_f32()),
        DType::I8 => Val::Int(i8::from_ne_bytes(b.try_into().unwrap()).into()),
        DType::U8 => Val::Int(b[0].into()),
        DType::I32 => Val::Int(i32::from_ne_bytes(b.try_into().unwrap()).into()),
        DType::I64 => Val::Int(i64::from_ne_bytes(b.try_into().unwrap()).into()),
        _ => unreachable!(),
    }
}

pub fn store(dtype: DType, v: Val, bytes: &mut [u8], i: usize) {
    let s = dtype.size();
    let b = &mut bytes[i * s..(i + 1) * s];
    match (dtype, v) {
        (DType::F32, Val::F32(x)) => b.copy_from_slice(&x.to_ne_bytes()),
        (DType::F64, Val::F64(x)) => b.copy_from_slice(&x.to_ne_bytes()),
        (DType::F16, Val::F32(x)) => b.copy_from_slice(&f16::from_f32(x).to_ne_bytes()),
        (DType::BF16, Val::F32(x)) => b.copy_from_slice(&bf16::from_f32(x).to_ne_bytes()),
        (DType::I8, Val::Int(x)) => b.copy_from_slice(&(x as i8).to_ne_bytes()),
        (DType::U8, Val::Int(x)) => b[0] = x as u8,
        (DType::I32, Val::Int(x)) => b.copy_from_slice(&(x as i32).to_ne_bytes()),
        (DType::I64, Val::Int(x)) => b.copy_from_slice(&(x as i64).to_ne_bytes()),
        other => unreachable!("{other:?}"),
    }
}

/// An integer wrapped into its dtype's range.
fn wrap(dtype: DType, x: i128) -> i128 {
    match dtype {
        DType::I8 => (x as i8).into(),
        DType::U8 => (x as u8).into(),
        DType::I32 => (x as i32).into(),
        DType::I64 => (x as i64).into(),
        _ => unreachable!(),
    }
}

/// IEEE 754-2019 minimum/maximum, written with branches.
fn fminmax<F: Copy + PartialOrd + std::ops::Add<Output = F>>(
    a: F,
    b: F,
    max: bool,
    is_nan: fn(F) -> bool,
    neg: fn(F) -> bool,
) -> F {
    if is_nan(a) || is_nan(b) {
        return a + b;
    }
    if a == b {
        // Equal, or +0 and -0: min takes the negative one, max the other.
        return if neg(a) != max { a } else { b };
    }
    if (a < b) != max {
        a
    } else {
        b
    }
}

/// `op(a, b)` for the combining op (`Avg` and `PremulSum` sum).
pub fn combine(dtype: DType, op: ReduceOp, a: Val, b: Val) -> Val {
    use ReduceOp::*;
    match (a, b) {
        (Val::F32(a), Val::F32(b)) => Val::F32(match op {
            Sum | Avg | PremulSum(_) => a + b,
            Product => a * b,
            Min => fminmax(a, b, false, f32::is_nan, f32::is_sign_negative),
            Max => fminmax(a, b, true, f32::is_nan, f32::is_sign_negative),
            _ => unreachable!("{op:?} on floats"),
        }),
        (Val::F64(a), Val::F64(b)) => Val::F64(match op {
            Sum | Avg | PremulSum(_) => a + b,
            Product => a * b,
            Min => fminmax(a, b, false, f64::is_nan, f64::is_sign_negative),
            Max => fminmax(a, b, true, f64::is_nan, f64::is_sign_negative),
            _ => unreachable!("{op:?} on floats"),
        }),
        (Val::Int(a), Val::Int(b)) => Val::Int(wrap(
            dtype,
            match op {
                Sum | Avg | PremulSum(_) => a + b,
                Product => a.wrapping_mul(b),
                Min => a.min(b),
                Max => a.max(b),
                Band => a & b,
                Bor => a | b,
                Bxor => a ^ b,
                _ => unreachable!(),
            },
        )),
        other => unreachable!("{other:?}"),
    }
}

/// `PremulSum`'s premultiplication of one input; the identity otherwise.
pub fn prepare(dtype: DType, op: ReduceOp, x: Val) -> Val {
    let ReduceOp::PremulSum(f) = op else { return x };
    match x {
        Val::F32(x) => Val::F32(x * f as f32),
        Val::F64(x) => Val::F64(x * f),
        Val::Int(x) => Val::Int(wrap(dtype, x.wrapping_mul(wrap(dtype, f as i128)))),
    }
}

/// `Avg`'s division by `n`; the identity otherwise.
pub fn finish(op: ReduceOp, x: Val, n: usize) -> Val {
    if op != ReduceOp::Avg {
        return x;
    }
    match x {
        Val::F32(x) => Val::F32(x / n as f32),
        Val::F64(x) => Val::F64(x / n as f64),
        // Rust's `/` truncates toward zero, as torch's integer division.
        Val::Int(x) => Val::Int(x / n as i128),
    }
}

/// `out[i] = op(inputs[0][i], inputs[1][i], ...)`, combined left to right;
/// with `full`, each input prepared and the result finished with
/// `n = inputs.len()`.
pub fn reduce(dtype: DType, op: ReduceOp, inputs: &[&[u8]], full: bool) -> Vec<u8> {
    let len = inputs[0].len();
    let mut out = vec![0u8; len];
    for i in 0..len / dtype.size() {
        let pre = |x| if full { prepare(dtype, op, x) } else { x };
        let mut acc = pre(load(dtype, inputs[0], i));
        for input in &inputs[1..] {
            acc = combine(dtype, op, acc, pre(load(dtype, input, i)));
        }
        if full {
            acc = finish(op, acc, inputs.len());
        }
        store(dtype, acc, &mut out, i);
    }
    out
}

/// Applies `f` to every element of `buf` (the reference `prepare`/`finish`).
pub fn map(dtype: DType, buf: &[u8], f: impl Fn(Val) -> Val) -> Vec<u8> {
    let mut out = buf.to_vec();
    for i in 0..buf.len() / dtype.size() {
        store(dtype, f(load(dtype, buf, i)), &mut out, i);
    }
    out
}

/// Asserts two buffers hold the same elements: bit-equal, except that any
/// NaN equals any NaN.
#[track_caller]
pub fn assert_same(dtype: DType, got: &[u8], want: &[u8], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for i in 0..got.len() / dtype.size() {
        let s = dtype.size();
        let (g, w) = (&got[i * s..(i + 1) * s], &want[i * s..(i + 1) * s]);
        if g == w {
            continue;
        }
        let both_nan = match (load(dtype, got, i), load(dtype, want, i)) {
            (Val::F32(a), Val::F32(b)) => a.is_nan() && b.is_nan(),
            (Val::F64(a), Val::F64(b)) => a.is_nan() && b.is_nan(),
            _ => false,
        };
        assert!(
            both_nan,
            "{what}: element {i} of {}: got {:?}, want {:?}",
            got.len() / s,
            load(dtype, got, i),
            load(dtype, want, i)
        );
    }
}

/// Every op valid for `dtype`, with a few `PremulSum` factors.
pub fn ops_for(dtype: DType) -> Vec<ReduceOp> {
    use ReduceOp::*;
    let mut ops = vec![Sum, Product, Min, Max, Avg];
    if dtype.is_integer() {
        ops.extend([Band, Bor, Bxor, PremulSum(3.0), PremulSum(-1.0)]);
    } else {
        ops.extend([PremulSum(0.5), PremulSum(-3.25)]);
    }
    ops
}

/// A small deterministic generator (xorshift*), so failures reproduce.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
}

/// `len` elements of `dtype` drawn from values that exercise the ops:
/// special floats (NaN, ±inf, ±0, subnormal, max), integer extremes, small
/// values (so products and sums stay finite), and raw random bits.
pub fn values(dtype: DType, len: usize, rng: &mut Rng) -> Vec<u8> {
    let mut out = vec![0u8; len * dtype.size()];
    for i in 0..len {
        let r = rng.next();
        let pick = r % 16;
        let small = ((r >> 8) % 41) as i64 - 20;
        let frac = ((r >> 20) % 1024) as f64 / 64.0 - 8.0;
        let v = match dtype {
            DType::F32 | DType::F64 | DType::F16 | DType::BF16 => {
                let x = match pick {
                    0 => f64::NAN,
                    1 => f64::INFINITY,
                    2 => f64::NEG_INFINITY,
                    3 => 0.0,
                    4 => -0.0,
                    5 => small as f64,
                    6..=11 => frac,
                    _ => f64::from_bits(r), // any value, NaN payloads included
                };
                match dtype {
                    DType::F32 => Val::F32(if pick >= 12 { f32::from_bits(r as u32) } else { x as f32 }),
                    DType::F64 => Val::F64(x),
                    DType::F16 => Val::F32(if pick >= 12 { f16::from_bits(r as u16).to_f32() } else { x as f32 }),
                    _ => Val::F32(if pick >= 12 { bf16::from_bits(r as u16).to_f32() } else { x as f32 }),
                }
            }
            _ => Val::Int(wrap(
                dtype,
                match pick {
                    0 => i128::from(i64::MAX),
                    1 => i128::from(i64::MIN),
                    2 => -1,
                    3 => 0,
                    4..=9 => small.into(),
                    _ => i128::from(r as i64),
                },
            )),
        };
        store(dtype, v, &mut out, i);
    }
    out
}
