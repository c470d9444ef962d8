//! Every entry point, op and dtype against the scalar reference, on the
//! AVX2 and the baseline copies of the kernels: odd lengths across block
//! boundaries, unaligned byte offsets, N = 1..=8 inputs (fused passes up to
//! 4, then the accumulator block), the finishing steps, the special values, the non-temporal and
//! multi-threaded paths, the raw-pointer variants with aliasing, and the
//! errors.

mod reference;

use half::{bf16, f16};
use reference::{assert_same, ops_for, values, Rng, Val};
use rmacomm_kernels::{as_bytes, as_bytes_mut, DType, Device, Error, ReduceOp, Reducer};

/// Lengths in elements: empty, tiny, odd, and across the 512-element block.
const LENS: [usize; 6] = [0, 1, 7, 33, 511, 1037];

/// Copies `data` into a fresh buffer at byte offset `offset` and returns
/// the buffer; `&buf[offset..]` is then misaligned by `offset`.
fn at_offset(data: &[u8], offset: usize) -> Vec<u8> {
    let mut buf = vec![0xA5u8; offset + data.len()];
    buf[offset..].copy_from_slice(data);
    buf
}

#[test]
fn every_op_and_dtype_matches_the_reference() {
    let mut rng = Rng::new(1);
    for (dtype, avx2) in DType::ALL.into_iter().flat_map(|d| [(d, true), (d, false)]) {
        for op in ops_for(dtype) {
            let r = Reducer::new(dtype, op).unwrap().avx2(avx2);
            for (li, &len) in LENS.iter().enumerate() {
                let offset = li % 4; // 0..=3 bytes: every misalignment of a 4-byte type
                let inputs: Vec<Vec<u8>> = (0..8).map(|_| values(dtype, len, &mut rng)).collect();
                let what = |call: &str| format!("{call} {op} {dtype} avx2 {avx2} len {len} offset {offset}");

                // reduce_into: dst = op(dst, src)
                let mut dst = at_offset(&inputs[0], offset);
                let src = at_offset(&inputs[1], 3 - offset);
                r.reduce_into(&mut dst[offset..], &src[3 - offset..]).unwrap();
                let want = reference::reduce(dtype, op, &[&inputs[0], &inputs[1]], false);
                assert_same(dtype, &dst[offset..], &want, &what("reduce_into"));

                // reduce: out = op(a, b)
                let mut out = at_offset(&vec![0; inputs[0].len()], offset);
                let (a, b) = (at_offset(&inputs[0], 1), at_offset(&inputs[1], 2));
                r.reduce(&mut out[offset..], &a[1..], &b[2..]).unwrap();
                assert_same(dtype, &out[offset..], &want, &what("reduce"));

                for n in 1..=8 {
                    let ins: Vec<Vec<u8>> = (0..n).map(|k| at_offset(&inputs[k], (k + offset) % 4)).collect();
                    let views: Vec<&[u8]> = ins.iter().enumerate().map(|(k, b)| &b[(k + offset) % 4..]).collect();
                    let plain: Vec<&[u8]> = inputs[..n].iter().map(Vec::as_slice).collect();
                    let mut out = at_offset(&vec![0; inputs[0].len()], offset);

                    r.reduce_n(&mut out[offset..], &views).unwrap();
                    let want = reference::reduce(dtype, op, &plain, false);
                    assert_same(dtype, &out[offset..], &want, &what(&format!("reduce_n({n})")));

                    r.reduce_full(&mut out[offset..], &views).unwrap();
                    let want = reference::reduce(dtype, op, &plain, true);
                    assert_same(dtype, &out[offset..], &want, &what(&format!("reduce_full({n})")));

                    let mut buf = at_offset(&inputs[0], offset);
                    r.finish(&mut buf[offset..], n).unwrap();
                    let want = reference::map(dtype, &inputs[0], |x| reference::finish(op, x, n));
                    assert_same(dtype, &buf[offset..], &want, &what(&format!("finish({n})")));
                }

                let mut buf = at_offset(&inputs[2], offset);
                r.prepare(&mut buf[offset..]).unwrap();
                let want = reference::map(dtype, &inputs[2], |x| reference::prepare(dtype, op, x));
                assert_same(dtype, &buf[offset..], &want, &what("prepare"));
            }
        }
    }
}

/// Runs `op` on two `f32`-valued inputs of `dtype` through `reduce`.
fn pair(dtype: DType, op: ReduceOp, a: &[f64], b: &[f64]) -> Vec<u8> {
    let enc = |xs: &[f64]| {
        let mut out = vec![0u8; xs.len() * dtype.size()];
        for (i, &x) in xs.iter().enumerate() {
            let v = if dtype == DType::F64 { Val::F64(x) } else { Val::F32(x as f32) };
            reference::store(dtype, v, &mut out, i);
        }
        out
    };
    let (a, b) = (enc(a), enc(b));
    let mut out = vec![0u8; a.len()];
    Reducer::new(dtype, op).unwrap().reduce(&mut out, &a, &b).unwrap();
    out
}

fn decode(dtype: DType, bytes: &[u8]) -> Vec<f64> {
    (0..bytes.len() / dtype.size())
        .map(|i| match reference::load(dtype, bytes, i) {
            Val::F32(x) => x.into(),
            Val::F64(x) => x,
            Val::Int(_) => unreachable!(),
        })
        .collect()
}

#[test]
fn min_max_propagate_nan_order_infinities_and_signed_zeros() {
    let (nan, inf) = (f64::NAN, f64::INFINITY);
    let a = [nan, 1.0, nan, -inf, inf, 0.0, -0.0, -0.0, 3.0, -inf, inf];
    let b = [1.0, nan, nan, 5.0, -2.0, -0.0, 0.0, -0.0, -inf, inf, nan];
    for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        let min = decode(dtype, &pair(dtype, ReduceOp::Min, &a, &b));
        let max = decode(dtype, &pair(dtype, ReduceOp::Max, &a, &b));
        for i in [0, 1, 2, 10] {
            assert!(min[i].is_nan() && max[i].is_nan(), "{dtype} NaN at {i}: {} {}", min[i], max[i]);
        }
        assert_eq!([min[3], max[3]], [-inf, 5.0], "{dtype}");
        assert_eq!([min[4], max[4]], [-2.0, inf], "{dtype}");
        for i in [5, 6, 7] {
            // -0.0 < +0.0 whatever the order: min is -0.0, max is +0.0
            // unless both are -0.0.
            assert!(min[i] == 0.0 && min[i].is_sign_negative(), "{dtype} min at {i}");
            assert_eq!(max[i].is_sign_negative(), i == 7, "{dtype} max at {i}");
        }
        assert_eq!([min[8], max[8]], [-inf, 3.0], "{dtype}");
        assert_eq!([min[9], max[9]], [-inf, inf], "{dtype}");
    }
}

#[test]
fn integer_sum_and_product_wrap() {
    let r = Reducer::new(DType::I32, ReduceOp::Sum).unwrap();
    let mut dst = [i32::MAX, i32::MIN, -1];
    r.reduce_into(as_bytes_mut(&mut dst), as_bytes(&[1i32, -1, 1])).unwrap();
    assert_eq!(dst, [i32::MIN, i32::MAX, 0]);

    let r = Reducer::new(DType::U8, ReduceOp::Product).unwrap();
    let mut out = [0u8; 3];
    r.reduce_n(&mut out, &[&[16, 255, 3], &[16, 2, 200], &[1, 1, 2]]).unwrap();
    assert_eq!(out, [0, 254, 176]); // 256 % 256, 510 % 256, 1200 % 256

    let r = Reducer::new(DType::I64, ReduceOp::Sum).unwrap();
    let mut out = [0i64; 1];
    let (a, b) = ([i64::MAX], [i64::MAX]);
    r.reduce(as_bytes_mut(&mut out), as_bytes(&a), as_bytes(&b)).unwrap();
    assert_eq!(out, [-2]);

    let r = Reducer::new(DType::I8, ReduceOp::Sum).unwrap();
    let mut out = [0i8; 1];
    r.reduce_n(as_bytes_mut(&mut out), &[as_bytes(&[100i8]), as_bytes(&[100i8]), as_bytes(&[100i8])]).unwrap();
    assert_eq!(out, [44]); // 300 - 256
}

#[test]
fn avg_finishing_divides_and_integers_truncate_toward_zero() {
    let r = Reducer::new(DType::I32, ReduceOp::Avg).unwrap();
    let mut out = [0i32; 4];
    let ins = [[7i32, -7, 1, i32::MAX], [0, 0, 0, i32::MAX], [0, 0, 0, 0]];
    let views: Vec<&[u8]> = ins.iter().map(|x| as_bytes(x)).collect();
    r.reduce_full(as_bytes_mut(&mut out), &views).unwrap();
    // 7/3 = 2, -7/3 = -2 (toward zero), 1/3 = 0, and the wrapped sum -2 / 3 = 0.
    assert_eq!(out, [2, -2, 0, 0]);

    // In steps: the combine sums, finish divides.
    let mut acc = ins[0];
    r.reduce_into(as_bytes_mut(&mut acc), as_bytes(&ins[1])).unwrap();
    assert_eq!(acc, [7, -7, 1, -2]);
    r.finish(as_bytes_mut(&mut acc), 2).unwrap();
    assert_eq!(acc, [3, -3, 0, -1]);

    let r = Reducer::new(DType::F32, ReduceOp::Avg).unwrap();
    let mut out = [0f32; 2];
    r.reduce_full(as_bytes_mut(&mut out), &[as_bytes(&[1.0f32, 7.0]), as_bytes(&[2.0f32, -8.0])]).unwrap();
    assert_eq!(out, [1.5, -0.5]);

    let r = Reducer::new(DType::U8, ReduceOp::Avg).unwrap();
    let mut buf = [255u8, 10];
    r.finish(&mut buf, 4).unwrap();
    assert_eq!(buf, [63, 2]);
}

#[test]
fn premul_sum_multiplies_each_input_before_summing() {
    let r = Reducer::new(DType::F32, ReduceOp::PremulSum(0.5)).unwrap();
    let mut out = [0f32; 2];
    let (a, b, c) = ([1.0f32, 3.0], [2.0f32, 5.0], [4.0f32, f32::MAX]);
    r.reduce_full(as_bytes_mut(&mut out), &[as_bytes(&a), as_bytes(&b), as_bytes(&c)]).unwrap();
    // 0.5*MAX + 0.5*5 + 0.5*3 is finite; summing first would overflow to inf.
    assert_eq!(out, [3.5, 0.5 * f32::MAX]);

    // The combining calls sum; prepare premultiplies a contribution.
    let mut acc = a;
    r.prepare(as_bytes_mut(&mut acc)).unwrap();
    assert_eq!(acc, [0.5, 1.5]);
    let mut b2 = b;
    r.prepare(as_bytes_mut(&mut b2)).unwrap();
    r.reduce_into(as_bytes_mut(&mut acc), as_bytes(&b2)).unwrap();
    assert_eq!(acc, [1.5, 4.0]);
    r.finish(as_bytes_mut(&mut acc), 2).unwrap(); // a no-op for PremulSum
    assert_eq!(acc, [1.5, 4.0]);

    let r = Reducer::new(DType::I8, ReduceOp::PremulSum(3.0)).unwrap();
    let mut out = [0i8; 2];
    r.reduce_full(as_bytes_mut(&mut out), &[as_bytes(&[1i8, 40]), as_bytes(&[2i8, 10])]).unwrap();
    assert_eq!(out, [9, (150i32 - 256) as i8]);
}

#[test]
fn f16_and_bf16_accumulate_in_f32_and_round_once() {
    // In f16, 2048 + 1 rounds back to 2048 (spacing 2, ties to even); in f32
    // the sum 2048 + 1 + 1 = 2050 is exact and representable in f16.
    let ins: Vec<[f16; 1]> = [2048.0f32, 1.0, 1.0].iter().map(|&x| [f16::from_f32(x)]).collect();
    let views: Vec<&[u8]> = ins.iter().map(|x| as_bytes(x)).collect();
    let mut out = [f16::ZERO];
    Reducer::new(DType::F16, ReduceOp::Sum).unwrap().reduce_n(as_bytes_mut(&mut out), &views).unwrap();
    assert_eq!(out[0].to_f32(), 2050.0);

    // bf16 has 8 bits of mantissa: 256 + 1 + 1 = 258 only without rounding
    // in between.
    let ins: Vec<[bf16; 1]> = [256.0f32, 1.0, 1.0].iter().map(|&x| [bf16::from_f32(x)]).collect();
    let views: Vec<&[u8]> = ins.iter().map(|x| as_bytes(x)).collect();
    let mut out = [bf16::ZERO];
    Reducer::new(DType::BF16, ReduceOp::Sum).unwrap().reduce_n(as_bytes_mut(&mut out), &views).unwrap();
    assert_eq!(out[0].to_f32(), 258.0);

    // Avg divides the f32 sum before rounding: (2048 + 1 + 1) / 3.
    let ins: Vec<[f16; 1]> = [2048.0f32, 1.0, 1.0].iter().map(|&x| [f16::from_f32(x)]).collect();
    let views: Vec<&[u8]> = ins.iter().map(|x| as_bytes(x)).collect();
    let mut out = [f16::ZERO];
    Reducer::new(DType::F16, ReduceOp::Avg).unwrap().reduce_full(as_bytes_mut(&mut out), &views).unwrap();
    assert_eq!(out[0], f16::from_f32(2050.0 / 3.0));
}

/// Large inputs for the paths that only run above a size threshold.
fn large(dtype: DType, bytes: usize, seed: u64) -> Vec<u8> {
    values(dtype, bytes / dtype.size(), &mut Rng::new(seed))
}

#[test]
fn nontemporal_path_matches_the_plain_path() {
    for dtype in [DType::F32, DType::BF16, DType::I8, DType::F64] {
        for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Avg] {
            let plain = Reducer::new(dtype, op).unwrap().threads(1);
            // Every output streams (the default threshold is 32 MiB).
            let nt = plain.clone().nontemporal(true).nontemporal_min_bytes(0);
            // Small, odd, and 300 KiB + a bit; none a multiple of 16 bytes.
            for len in [3 * 8, 1037 * 8, (300 << 10) + 3 * 8] {
                let ins: Vec<Vec<u8>> = (0..5).map(|k| large(dtype, len, k)).collect();
                let views: Vec<&[u8]> = ins.iter().map(Vec::as_slice).collect();
                for n in 1..=5 {
                    for offset in [0, 1, 8] {
                        let what = |call: &str| format!("nt {call} {op} {dtype} len {len} n {n} +{offset}");
                        let mut want = vec![0u8; len];
                        let mut got = vec![0u8; len + offset];
                        plain.reduce_full(&mut want, &views[..n]).unwrap();
                        nt.reduce_full(&mut got[offset..], &views[..n]).unwrap();
                        assert_same(dtype, &got[offset..], &want, &what("reduce_full"));
                        plain.reduce_n(&mut want, &views[..n]).unwrap();
                        nt.reduce_n(&mut got[offset..], &views[..n]).unwrap();
                        assert_same(dtype, &got[offset..], &want, &what("reduce_n"));
                    }
                }
                let mut got = vec![0u8; len];
                nt.reduce(&mut got, &ins[0], &ins[1]).unwrap();
                assert_same(dtype, &got, &reference::reduce(dtype, op, &views[..2], false), "nt reduce vs reference");
            }
        }
    }
}

#[test]
fn multithreaded_path_matches_the_single_threaded_path() {
    for dtype in [DType::F32, DType::F16, DType::I32, DType::U8] {
        for op in [ReduceOp::Sum, ReduceOp::Min, ReduceOp::Avg] {
            let len = (5 << 20) + 5 * 8; // above PARALLEL_MIN_BYTES: up to 5 ranges of 1 MiB
            let ins: Vec<Vec<u8>> = (0..4).map(|k| large(dtype, len, 10 + k)).collect();
            let views: Vec<&[u8]> = ins.iter().map(Vec::as_slice).collect();
            let one = Reducer::new(dtype, op).unwrap().threads(1);
            for threads in [2, 3, 7] {
                let many = one.clone().threads(threads);
                for nt in [false, true] {
                    let many = many.clone().nontemporal(nt).nontemporal_min_bytes(0);
                    let what = |call: &str| format!("{call} {op} {dtype} threads {threads} nt {nt}");
                    let (mut want, mut got) = (vec![0u8; len], vec![0u8; len]);
                    one.reduce_n(&mut want, &views).unwrap();
                    many.reduce_n(&mut got, &views).unwrap();
                    assert_same(dtype, &got, &want, &what("reduce_n"));
                    one.reduce_full(&mut want, &views[..3]).unwrap();
                    many.reduce_full(&mut got, &views[..3]).unwrap();
                    assert_same(dtype, &got, &want, &what("reduce_full"));
                    one.finish(&mut want, 3).unwrap();
                    many.finish(&mut got, 3).unwrap();
                    assert_same(dtype, &got, &want, &what("finish"));
                    one.reduce_into(&mut want, &ins[1]).unwrap();
                    many.reduce_into(&mut got, &ins[1]).unwrap();
                    assert_same(dtype, &got, &want, &what("reduce_into"));
                }
            }
            // And against the reference once.
            let mut got = vec![0u8; len];
            one.clone().threads(4).reduce(&mut got, &ins[0], &ins[1]).unwrap();
            assert_same(dtype, &got, &reference::reduce(dtype, op, &views[..2], false), "mt reduce vs reference");
        }
    }
}

#[test]
fn raw_pointers_reduce_in_place_when_the_output_is_an_input() {
    let mut rng = Rng::new(7);
    for dtype in [DType::F32, DType::F16, DType::I64, DType::U8] {
        for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Avg, ReduceOp::PremulSum(2.0)] {
            let r = Reducer::new(dtype, op).unwrap();
            let len = 1037 * dtype.size();
            let ins: Vec<Vec<u8>> = (0..8).map(|_| values(dtype, 1037, &mut rng)).collect();
            let views: Vec<&[u8]> = ins.iter().map(Vec::as_slice).collect();
            let what = |call: &str| format!("{call} {op} {dtype}");

            for which in 0..2 {
                let mut bufs = ins.clone();
                let out = bufs[which].as_mut_ptr();
                let (a, b) = (bufs[0].as_ptr(), bufs[1].as_ptr());
                // SAFETY: every pointer is valid for len bytes; out is a or b.
                unsafe { r.reduce_raw(out, a, b, len).unwrap() };
                let want = reference::reduce(dtype, op, &views[..2], false);
                assert_same(dtype, &bufs[which], &want, &what(&format!("reduce_raw out=input{which}")));
            }

            for (n, which) in [(3, 0), (3, 2), (4, 0), (4, 3), (8, 0), (8, 5), (8, 7)] {
                for full in [false, true] {
                    let mut bufs = ins[..n].to_vec();
                    let ptrs: Vec<*const u8> = bufs.iter().map(|b| b.as_ptr()).collect();
                    let out = bufs[which].as_mut_ptr();
                    // SAFETY: every pointer is valid for len bytes; out is one of them.
                    unsafe {
                        if full {
                            r.reduce_full_raw(out, &ptrs, len).unwrap();
                        } else {
                            r.reduce_n_raw(out, &ptrs, len).unwrap();
                        }
                    }
                    let want = reference::reduce(dtype, op, &views[..n], full);
                    let call = format!("reduce_n_raw(n {n}, full {full}) out=input{which}");
                    assert_same(dtype, &bufs[which], &want, &what(&call));
                }
            }

            let mut buf = ins[0].clone();
            // SAFETY: valid for len bytes, src == dst allowed.
            unsafe { r.reduce_into_raw(buf.as_mut_ptr(), buf.as_ptr(), len).unwrap() };
            let want = reference::reduce(dtype, op, &[&ins[0], &ins[0]], false);
            assert_same(dtype, &buf, &want, &what("reduce_into_raw src=dst"));

            let mut buf = ins[3].clone();
            // SAFETY: valid for len bytes.
            unsafe {
                r.prepare_raw(buf.as_mut_ptr(), len).unwrap();
                r.finish_raw(buf.as_mut_ptr(), len, 4).unwrap();
            }
            let want = reference::map(dtype, &ins[3], |x| reference::finish(op, reference::prepare(dtype, op, x), 4));
            assert_same(dtype, &buf, &want, &what("prepare_raw + finish_raw"));
        }
    }
}

#[test]
fn errors_are_returned_before_anything_is_written() {
    for op in [ReduceOp::Band, ReduceOp::Bor, ReduceOp::Bxor] {
        let e = Reducer::new(DType::F32, op).unwrap_err();
        assert!(matches!(e, Error::UnsupportedOp { dtype: DType::F32, .. }), "{e}");
        assert!(e.to_string().contains("integer dtype"), "{e}");
    }
    assert!(matches!(Reducer::new(DType::I32, ReduceOp::PremulSum(0.5)), Err(Error::InvalidFactor { .. })));
    let e = Reducer::on(Device::Cuda(0), DType::F32, ReduceOp::Sum).unwrap_err();
    assert_eq!(e, Error::DeviceUnavailable { device: Device::Cuda(0) });
    assert!(e.to_string().contains("cuda:0") && e.to_string().contains("Device::Cpu"), "{e}");

    let r = Reducer::new(DType::F32, ReduceOp::Sum).unwrap();
    let mut dst = [7u8; 8];
    let bad = [
        r.reduce_into(&mut dst, &[0; 4]),
        r.reduce(&mut dst, &[0; 8], &[0; 12]),
        r.reduce_n(&mut dst, &[]),
        r.reduce_n(&mut dst, &[&[0; 8], &[0; 7]]),
        r.reduce_full(&mut dst[..6], &[&[0; 6]]),
        r.finish(&mut dst, 0),
        r.prepare(&mut dst[..3]),
    ];
    for e in bad {
        assert!(matches!(e, Err(Error::InvalidArgument { .. })), "{e:?}");
    }
    assert_eq!(dst, [7; 8]);
    let e = r.reduce_into(&mut dst, &[0; 4]).unwrap_err().to_string();
    assert!(e.contains("reduce_into") && e.contains("8 and 4 bytes"), "{e}");
    // SAFETY: the length check fails before any pointer is used.
    let e = unsafe { r.reduce_n_raw(dst.as_mut_ptr(), &[], 8) };
    assert!(matches!(e, Err(Error::InvalidArgument { op: "reduce_n_raw", .. })));
}

#[test]
fn typed_buffers_reduce_through_byte_views() {
    let r = Reducer::new(DType::F64, ReduceOp::Product).unwrap();
    let mut acc = [1.5f64, -2.0, 0.0];
    r.reduce_into(as_bytes_mut(&mut acc), as_bytes(&[2.0f64, 4.0, -1.0])).unwrap();
    assert_eq!(acc, [3.0, -8.0, -0.0]);
    assert!(acc[2].is_sign_negative());
}

#[test]
fn reducers_are_send_sync_and_cheap_to_share() {
    fn assert_send_sync<T: Send + Sync + Clone>() {}
    assert_send_sync::<Reducer>();
    let r = Reducer::new(DType::I32, ReduceOp::Sum).unwrap();
    std::thread::scope(|s| {
        for k in 0..2i32 {
            let r = &r;
            s.spawn(move || {
                let mut acc = [k; 4];
                r.reduce_into(as_bytes_mut(&mut acc), as_bytes(&[1i32; 4])).unwrap();
                assert_eq!(acc, [k + 1; 4]);
            });
        }
    });
}
