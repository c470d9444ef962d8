//! f32 SUM throughput beside a plain memcpy of the same output size:
//! 2 inputs (`reduce`) and 4 inputs (`reduce_n`) at 4 KiB (L1), 1 MiB (L2)
//! and 64 MiB (memory), plus the in-place form, the baseline (non-AVX2)
//! kernels where the data is cached, and the non-temporal and 2-thread
//! variants at the sizes where they apply.
//!
//! Throughput is output bytes per second (GB/s, decimal) for every entry,
//! memcpy included, so `memcpy time / reduce time` is the ratio to read.
//! Memory traffic differs: memcpy reads 1 and writes 1 buffer, a 2-input
//! reduction reads 2, a 4-input one reads 4.
//!
//! Run: `cargo bench -p rmacomm-kernels --bench reduce`.

use std::hint::black_box;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput};
use rmacomm_kernels::{as_bytes, as_bytes_mut, DType, ReduceOp, Reducer};

const SIZES: [(usize, &str); 3] = [(4 << 10, "4KiB"), (1 << 20, "1MiB"), (64 << 20, "64MiB")];

fn f32_sum(c: &mut Criterion) {
    let mut group = c.benchmark_group("f32_sum");
    group.warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(2)).sample_size(20);
    let plain = Reducer::new(DType::F32, ReduceOp::Sum).unwrap().threads(1);
    for (bytes, name) in SIZES {
        let n = bytes / 4;
        let inputs: Vec<Vec<f32>> = (0..4).map(|k| (0..n).map(|i| (i % 1000) as f32 + k as f32).collect()).collect();
        let mut out = vec![0f32; n];
        group.throughput(Throughput::BytesDecimal(bytes as u64));

        group.bench_function(BenchmarkId::new("memcpy", name), |b| {
            b.iter(|| out.copy_from_slice(black_box(&inputs[0])))
        });
        group.bench_function(BenchmarkId::new("reduce_2", name), |b| {
            b.iter(|| {
                plain.reduce(as_bytes_mut(&mut out), as_bytes(black_box(&inputs[0])), as_bytes(&inputs[1])).unwrap()
            })
        });
        let views: Vec<&[u8]> = inputs.iter().map(|x| as_bytes(x)).collect();
        group.bench_function(BenchmarkId::new("reduce_n_4", name), |b| {
            b.iter(|| plain.reduce_n(as_bytes_mut(&mut out), black_box(&views)).unwrap())
        });
        group.bench_function(BenchmarkId::new("reduce_into", name), |b| {
            b.iter(|| plain.reduce_into(as_bytes_mut(&mut out), as_bytes(black_box(&inputs[1]))).unwrap())
        });
        if bytes <= 1 << 20 {
            // Where the data is cached the instruction set shows; from memory it does not.
            let base = plain.clone().avx2(false);
            group.bench_function(BenchmarkId::new("reduce_2_baseline", name), |b| {
                b.iter(|| {
                    base.reduce(as_bytes_mut(&mut out), as_bytes(black_box(&inputs[0])), as_bytes(&inputs[1])).unwrap()
                })
            });
            group.bench_function(BenchmarkId::new("reduce_n_4_baseline", name), |b| {
                b.iter(|| base.reduce_n(as_bytes_mut(&mut out), black_box(&views)).unwrap())
            });
        }
        if bytes >= 1 << 20 {
            // Streamed whatever the size, to show where it pays (see NONTEMPORAL_MIN_BYTES).
            let nt = plain.clone().nontemporal(true).nontemporal_min_bytes(0);
            group.bench_function(BenchmarkId::new("reduce_2_nt", name), |b| {
                b.iter(|| {
                    nt.reduce(as_bytes_mut(&mut out), as_bytes(black_box(&inputs[0])), as_bytes(&inputs[1])).unwrap()
                })
            });
            group.bench_function(BenchmarkId::new("reduce_n_4_nt", name), |b| {
                b.iter(|| nt.reduce_n(as_bytes_mut(&mut out), black_box(&views)).unwrap())
            });
        }
        if bytes >= rmacomm_kernels::PARALLEL_MIN_BYTES {
            let two = plain.clone().threads(2);
            group.bench_function(BenchmarkId::new("reduce_2_threads2", name), |b| {
                b.iter(|| {
                    two.reduce(as_bytes_mut(&mut out), as_bytes(black_box(&inputs[0])), as_bytes(&inputs[1])).unwrap()
                })
            });
            group.bench_function(BenchmarkId::new("reduce_n_4_threads2", name), |b| {
                b.iter(|| two.reduce_n(as_bytes_mut(&mut out), black_box(&views)).unwrap())
            });
        }
    }
    group.finish();
}

fn main() {
    let mut c = Criterion::default().configure_from_args();
    f32_sum(&mut c);
    c.final_summary();
}
