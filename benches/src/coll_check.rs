//! The correctness check of a collective (nccl-tests' `-c 1`): inputs
//! filled with a known pattern, every element of the result compared with
//! a reference computed here, element by element.
//!
//! The pattern's values are small integers (1 ..= 5), exact in every
//! dtype, so sums, minima and maxima must match exactly; floating-point
//! products, averages and pre-multiplied sums are compared with a relative
//! tolerance of the dtype (any reduction order is legal), integers always
//! exactly (their arithmetic wraps, as the kernels' does). Sans-IO.

use rmacomm_collectives::kernels::half::{bf16, f16};
use rmacomm_collectives::{DType, ReduceOp};

use crate::coll::Coll;

/// One element's value: floats as `f64`, integers as `i64`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Num {
    /// A floating-point element.
    F(f64),
    /// An integer element (already wrapped to its dtype's width).
    I(i64),
}

impl std::fmt::Display for Num {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Num::F(x) => write!(f, "{x}"),
            Num::I(x) => write!(f, "{x}"),
        }
    }
}

/// Element `k` of rank `rank`'s input in the check with `seed`: 1 ..= 5.
pub fn value(seed: u64, rank: usize, k: usize) -> i64 {
    let h = (k as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)
        ^ seed
        ^ (rank as u64).wrapping_add(1).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    let h = (h ^ (h >> 31)).wrapping_mul(0x94d0_49bb_1331_11eb);
    1 + ((h >> 33) % 5) as i64
}

/// `x` wrapped to the width of the integer `dtype` (sign-extended back).
fn wrap(dtype: DType, x: i64) -> i64 {
    match dtype {
        DType::I8 => x as i8 as i64,
        DType::U8 => x as u8 as i64,
        DType::I32 => x as i32 as i64,
        _ => x,
    }
}

/// Writes `v` as one element of `dtype` (native endian, as the kernels
/// read it) into `dst` (exactly one element long).
pub fn encode(dtype: DType, v: Num, dst: &mut [u8]) {
    let x = match v {
        Num::F(x) => x,
        Num::I(i) => i as f64,
    };
    let i = match v {
        Num::F(x) => x as i64,
        Num::I(i) => i,
    };
    match dtype {
        DType::F32 => dst.copy_from_slice(&(x as f32).to_ne_bytes()),
        DType::F64 => dst.copy_from_slice(&x.to_ne_bytes()),
        DType::F16 => dst.copy_from_slice(&f16::from_f64(x).to_ne_bytes()),
        DType::BF16 => dst.copy_from_slice(&bf16::from_f64(x).to_ne_bytes()),
        DType::I8 => dst[0] = i as i8 as u8,
        DType::U8 => dst[0] = i as u8,
        DType::I32 => dst.copy_from_slice(&(i as i32).to_ne_bytes()),
        _ => dst.copy_from_slice(&i.to_ne_bytes()),
    }
}

/// Reads one element of `dtype` from `src`.
pub fn decode(dtype: DType, src: &[u8]) -> Num {
    let a = |n: usize| -> [u8; 8] {
        let mut b = [0u8; 8];
        b[..n].copy_from_slice(&src[..n]);
        b
    };
    match dtype {
        DType::F32 => Num::F(f32::from_ne_bytes(a(4)[..4].try_into().expect("4 bytes")) as f64),
        DType::F64 => Num::F(f64::from_ne_bytes(a(8))),
        DType::F16 => Num::F(f16::from_ne_bytes([src[0], src[1]]).to_f64()),
        DType::BF16 => Num::F(bf16::from_ne_bytes([src[0], src[1]]).to_f64()),
        DType::I8 => Num::I(src[0] as i8 as i64),
        DType::U8 => Num::I(src[0] as i64),
        DType::I32 => Num::I(i32::from_ne_bytes(a(4)[..4].try_into().expect("4 bytes")) as i64),
        _ => Num::I(i64::from_ne_bytes(a(8))),
    }
}

/// The reduction of `vals` (one per rank, in rank order) with `op`, as
/// the kernels define it, rounded to `dtype`.
pub fn reduce_ref(dtype: DType, op: ReduceOp, vals: &[i64]) -> Num {
    let n = vals.len() as i64;
    if dtype.is_float() {
        let it = vals.iter().map(|&v| v as f64);
        let x = match op {
            ReduceOp::Product => it.product(),
            ReduceOp::Min => it.fold(f64::INFINITY, f64::min),
            ReduceOp::Max => it.fold(f64::NEG_INFINITY, f64::max),
            ReduceOp::Avg => it.sum::<f64>() / n as f64,
            ReduceOp::PremulSum(f) => it.map(|v| v * f).sum(),
            _ => it.sum(),
        };
        // Rounded once to the dtype, as a check of the stored result.
        let mut b = [0u8; 8];
        encode(dtype, Num::F(x), &mut b[..dtype.size()]);
        return decode(dtype, &b[..dtype.size()]);
    }
    let w = |x: i64| wrap(dtype, x);
    let x = match op {
        ReduceOp::Product => vals.iter().fold(1i64, |a, &v| w(a.wrapping_mul(v))),
        ReduceOp::Min => vals.iter().copied().min().unwrap_or(0),
        ReduceOp::Max => vals.iter().copied().max().unwrap_or(0),
        ReduceOp::Band => vals.iter().fold(-1i64, |a, &v| a & v),
        ReduceOp::Bor => vals.iter().fold(0i64, |a, &v| a | v),
        ReduceOp::Bxor => vals.iter().fold(0i64, |a, &v| a ^ v),
        ReduceOp::Avg => w(vals.iter().fold(0i64, |a, &v| w(a.wrapping_add(v)))) / n.max(1),
        ReduceOp::PremulSum(f) => {
            let f = w(f as i64);
            vals.iter().fold(0i64, |a, &v| w(a.wrapping_add(w(f.wrapping_mul(v)))))
        }
        _ => vals.iter().fold(0i64, |a, &v| w(a.wrapping_add(v))),
    };
    Num::I(w(x))
}

/// Relative tolerance of a floating-point result (a few roundings of the
/// dtype per rank: any reduction order is legal).
fn tolerance(dtype: DType, n: usize) -> f64 {
    let ulp = match dtype {
        DType::F64 => f64::EPSILON,
        DType::F32 => f32::EPSILON as f64,
        DType::F16 => 1.0 / 1024.0,
        DType::BF16 => 1.0 / 128.0,
        _ => 0.0,
    };
    ulp * 2.0 * n.max(1) as f64
}

/// Whether `got` is `want` (within the tolerance for floats).
pub fn same(dtype: DType, n: usize, got: Num, want: Num) -> bool {
    match (got, want) {
        (Num::I(g), Num::I(w)) => g == w,
        (Num::F(g), Num::F(w)) => g == w || (g - w).abs() <= tolerance(dtype, n) * w.abs().max(1.0),
        _ => false,
    }
}

/// Fills `buf` (whole elements) with rank `rank`'s input of the check.
pub fn fill_input(dtype: DType, seed: u64, rank: usize, buf: &mut [u8]) {
    let es = dtype.size();
    for (k, e) in buf.chunks_exact_mut(es).enumerate() {
        encode(dtype, Num::I(value(seed, rank, k)), e);
    }
}

/// What a check found on one rank.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct CheckResult {
    /// Elements that differ from the reference.
    pub wrong: u64,
    /// The first of them: index, value found, value expected.
    pub first: Option<(usize, Num, Num)>,
}

/// Everything a check needs to know about the call it checks.
#[derive(Debug, Clone, Copy)]
pub struct CheckSpec {
    /// The collective.
    pub coll: Coll,
    /// Element type.
    pub dtype: DType,
    /// Reduction (reducing collectives only).
    pub op: ReduceOp,
    /// The pattern's seed.
    pub seed: u64,
    /// Ranks.
    pub n: usize,
    /// This rank.
    pub me: usize,
    /// Broadcast's root.
    pub root: usize,
}

/// The reference value of element `k` of rank `s.me`'s output, whose
/// length is `out_elems` elements.
pub fn expected(s: &CheckSpec, out_elems: usize, k: usize) -> Num {
    let n = s.n.max(1);
    let red = |idx: usize| {
        let vals: Vec<i64> = (0..n).map(|r| value(s.seed, r, idx)).collect();
        reduce_ref(s.dtype, s.op, &vals)
    };
    let plain = |v: i64| reduce_ref(s.dtype, ReduceOp::Sum, &[v]);
    match s.coll {
        Coll::AllReduce => red(k),
        Coll::ReduceScatter => red(s.me * out_elems + k),
        Coll::AllGather => {
            let c = out_elems / n;
            plain(value(s.seed, k / c, k % c))
        }
        Coll::AllToAll => {
            let c = out_elems / n;
            plain(value(s.seed, k / c, s.me * c + k % c))
        }
        Coll::Broadcast => plain(value(s.seed, s.root, k)),
    }
}

/// Compares `out` (rank `s.me`'s output) with the reference.
pub fn check_output(s: &CheckSpec, out: &[u8]) -> CheckResult {
    let es = s.dtype.size();
    let elems = out.len() / es;
    let mut r = CheckResult::default();
    for (k, e) in out.chunks_exact(es).enumerate() {
        let got = decode(s.dtype, e);
        let want = expected(s, elems, k);
        if !same(s.dtype, s.n, got, want) {
            r.wrong += 1;
            if r.first.is_none() {
                r.first = Some((k, got, want));
            }
        }
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(coll: Coll, dtype: DType, op: ReduceOp, n: usize, me: usize) -> CheckSpec {
        CheckSpec { coll, dtype, op, seed: 7, n, me, root: 1 }
    }

    #[test]
    fn values_are_small_and_vary() {
        let v: Vec<i64> = (0..1000).map(|k| value(3, 0, k)).collect();
        assert!(v.iter().all(|x| (1..=5).contains(x)));
        for want in 1..=5 {
            assert!(v.contains(&want), "{want} never drawn");
        }
        let other: Vec<i64> = (0..1000).map(|k| value(3, 1, k)).collect();
        assert_ne!(v, other, "ranks must differ");
        assert_ne!(v, (0..1000).map(|k| value(4, 0, k)).collect::<Vec<_>>(), "seeds must differ");
    }

    #[test]
    fn every_dtype_round_trips() {
        for d in DType::ALL {
            let mut b = vec![0u8; d.size()];
            for v in [1i64, 5, 100] {
                encode(d, Num::I(v), &mut b);
                let got = decode(d, &b);
                let want = if d.is_float() { Num::F(v as f64) } else { Num::I(v) };
                assert_eq!(got, want, "{d}");
            }
        }
    }

    #[test]
    fn references_follow_the_kernels() {
        let v = [3i64, 5, 4];
        assert_eq!(reduce_ref(DType::F32, ReduceOp::Sum, &v), Num::F(12.0));
        assert_eq!(reduce_ref(DType::F32, ReduceOp::Product, &v), Num::F(60.0));
        assert_eq!(reduce_ref(DType::F64, ReduceOp::Avg, &v), Num::F(4.0));
        assert_eq!(reduce_ref(DType::BF16, ReduceOp::Max, &v), Num::F(5.0));
        assert_eq!(reduce_ref(DType::F16, ReduceOp::PremulSum(0.5), &v), Num::F(6.0));
        assert_eq!(reduce_ref(DType::I32, ReduceOp::Avg, &[3, 4]), Num::I(3), "truncates");
        assert_eq!(reduce_ref(DType::I8, ReduceOp::Product, &[5, 5, 5, 5]), Num::I(625i64 as i8 as i64));
        assert_eq!(reduce_ref(DType::U8, ReduceOp::Bxor, &[3, 5]), Num::I(6));
        assert_eq!(reduce_ref(DType::I64, ReduceOp::Band, &[3, 5]), Num::I(1));
        assert_eq!(reduce_ref(DType::U8, ReduceOp::PremulSum(-1.0), &[1, 1]), Num::I(254));
        // bf16 rounds 5^4 = 625 to 624.
        assert_eq!(reduce_ref(DType::BF16, ReduceOp::Product, &[5, 5, 5, 5]), Num::F(624.0));
    }

    #[test]
    fn tolerance_is_relative_for_floats_and_exact_for_integers() {
        assert!(same(DType::F32, 2, Num::F(1000.0), Num::F(1000.0001)));
        assert!(!same(DType::F32, 2, Num::F(1000.0), Num::F(1000.1)));
        assert!(same(DType::BF16, 2, Num::F(624.0), Num::F(625.0)));
        assert!(!same(DType::I32, 2, Num::I(1), Num::I(2)));
        assert!(!same(DType::F32, 2, Num::F(f64::NAN), Num::F(1.0)));
    }

    /// Simulates each collective on the inputs `fill_input` makes and
    /// checks that the output is accepted, and a damaged one refused.
    #[test]
    fn simulated_collectives_pass_and_damage_is_found() {
        let (n, elems) = (3, 12);
        for d in [DType::F32, DType::BF16, DType::I8] {
            let es = d.size();
            let inputs: Vec<Vec<u8>> = (0..n)
                .map(|r| {
                    let mut b = vec![0u8; elems * es];
                    fill_input(d, 7, r, &mut b);
                    b
                })
                .collect();
            let el = |r: usize, k: usize| -> i64 {
                match decode(d, &inputs[r][k * es..(k + 1) * es]) {
                    Num::F(x) => x as i64,
                    Num::I(i) => i,
                }
            };
            for me in 0..n {
                let c = elems / n;
                // all_reduce (sum) and reduce_scatter (max).
                let mut ar = vec![0u8; elems * es];
                for k in 0..elems {
                    encode(d, Num::I((0..n).map(|r| el(r, k)).sum()), &mut ar[k * es..(k + 1) * es]);
                }
                let s = spec(Coll::AllReduce, d, ReduceOp::Sum, n, me);
                assert_eq!(check_output(&s, &ar).wrong, 0, "{d} all_reduce");
                let mut rs = vec![0u8; c * es];
                for k in 0..c {
                    let m = (0..n).map(|r| el(r, me * c + k)).max().unwrap();
                    encode(d, Num::I(m), &mut rs[k * es..(k + 1) * es]);
                }
                assert_eq!(check_output(&spec(Coll::ReduceScatter, d, ReduceOp::Max, n, me), &rs).wrong, 0);
                // all_gather: rank j's first c elements at block j.
                let ag: Vec<u8> = (0..n).flat_map(|j| inputs[j][..c * es].to_vec()).collect();
                assert_eq!(check_output(&spec(Coll::AllGather, d, ReduceOp::Sum, n, me), &ag).wrong, 0);
                // all_to_all: block me of rank j's input at block j.
                let a2a: Vec<u8> = (0..n).flat_map(|j| inputs[j][me * c * es..(me + 1) * c * es].to_vec()).collect();
                assert_eq!(check_output(&spec(Coll::AllToAll, d, ReduceOp::Sum, n, me), &a2a).wrong, 0);
                // broadcast from root 1.
                assert_eq!(check_output(&spec(Coll::Broadcast, d, ReduceOp::Sum, n, me), &inputs[1]).wrong, 0);
                // One damaged element is found and named.
                let mut bad = ar.clone();
                bad[5 * es] ^= 0x40;
                let r = check_output(&s, &bad);
                assert_eq!((r.wrong, r.first.map(|f| f.0)), (1, Some(5)), "{d}");
                // The inputs themselves are not an all_reduce.
                assert!(check_output(&s, &inputs[me]).wrong > 0);
            }
        }
    }
}
