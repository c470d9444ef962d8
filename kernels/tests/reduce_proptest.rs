//! Random inputs (any bytes: every NaN payload, subnormal and extreme
//! integer), random op, dtype, input count (1 to 8), length, misalignment
//! and kernel copy (AVX2 or baseline): every entry point equals the scalar
//! reference.

mod reference;

use proptest::prelude::*;
use proptest::test_runner::FileFailurePersistence;
use reference::assert_same;
use rmacomm_kernels::{DType, ReduceOp, Reducer};

/// A case: dtype, op, the inputs' bytes (1 to 8 of them, equal lengths), a
/// byte offset for the output buffer, and whether to use the AVX2 kernels.
fn case() -> impl Strategy<Value = (DType, ReduceOp, Vec<Vec<u8>>, usize, bool)> {
    (0..DType::ALL.len(), 0..10usize, 1..=8usize, 0..1100usize, 0..8usize, any::<bool>()).prop_flat_map(
        |(d, o, n, len, offset, avx2)| {
            let dtype = DType::ALL[d];
            let ops = reference::ops_for(dtype);
            let op = ops[o % ops.len()];
            let input = proptest::collection::vec(any::<u8>(), len * dtype.size());
            (Just(dtype), Just(op), proptest::collection::vec(input, n), Just(offset), Just(avx2))
        },
    )
}

fn misaligned(data: &[u8], offset: usize) -> Vec<u8> {
    let mut buf = vec![0u8; offset + data.len()];
    buf[offset..].copy_from_slice(data);
    buf
}

proptest! {
    // Failures are saved beside this file (tests/ has no lib.rs for the
    // default source-parallel location).
    #![proptest_config(ProptestConfig {
        cases: 512,
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource("regressions"))),
        ..ProptestConfig::default()
    })]

    #[test]
    fn random_inputs_match_the_scalar_reference((dtype, op, inputs, offset, avx2) in case()) {
        let r = Reducer::new(dtype, op).unwrap().avx2(avx2);
        let views: Vec<&[u8]> = inputs.iter().map(Vec::as_slice).collect();
        let len = inputs[0].len();
        let mut out = vec![0u8; offset + len];

        r.reduce_n(&mut out[offset..], &views).unwrap();
        assert_same(dtype, &out[offset..], &reference::reduce(dtype, op, &views, false), "reduce_n");

        r.reduce_full(&mut out[offset..], &views).unwrap();
        assert_same(dtype, &out[offset..], &reference::reduce(dtype, op, &views, true), "reduce_full");

        let mut dst = misaligned(&inputs[0], offset);
        let src = views.get(1).copied().unwrap_or(views[0]);
        r.reduce_into(&mut dst[offset..], src).unwrap();
        assert_same(dtype, &dst[offset..], &reference::reduce(dtype, op, &[views[0], src], false), "reduce_into");

        r.reduce(&mut out[offset..], views[0], src).unwrap();
        assert_same(dtype, &out[offset..], &reference::reduce(dtype, op, &[views[0], src], false), "reduce");

        let mut buf = misaligned(&inputs[0], offset);
        r.prepare(&mut buf[offset..]).unwrap();
        r.finish(&mut buf[offset..], inputs.len()).unwrap();
        let want = reference::map(dtype, &inputs[0], |x| {
            reference::finish(op, reference::prepare(dtype, op, x), inputs.len())
        });
        assert_same(dtype, &buf[offset..], &want, "prepare + finish");
    }
}
