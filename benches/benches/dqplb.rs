//! The DQPLB receiver's per-fragment cost: `SeqTracker::on_arrival` plus
//! draining finished messages, for fragments arriving in order and
//! reordered (each group of 16 reversed, as 16 QPs finishing in reverse
//! would deliver them). Four fragments per message; the last carries
//! LAST, every fourth message the USER bit. Reported per fragment.
//!
//! Run: `cargo bench -p rmacomm-bench --bench dqplb`.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput};
use ibverbx::vqp_proto::{DqplbImm, SeqTracker, SEQ_MASK};

/// Fragments per measured batch.
const BATCH: u32 = 1024;
const FRAGS_PER_MSG: u32 = 4;

/// The immediate of fragment `i` of a batch starting at sequence `first`.
fn immediate(first: u32, i: u32) -> u32 {
    let last = i % FRAGS_PER_MSG == FRAGS_PER_MSG - 1;
    // Every fourth message carries the application's immediate.
    let user = i % (4 * FRAGS_PER_MSG) == FRAGS_PER_MSG - 1;
    DqplbImm { seq: first.wrapping_add(i) & SEQ_MASK, last, user }.encode()
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("dqplb_tracker");
    g.throughput(Throughput::Elements(u64::from(BATCH)));
    for (name, group) in [("in_order", 1usize), ("reversed_16", 16)] {
        g.bench_function(name, |b| {
            let mut tracker = SeqTracker::new(0, 4096, Duration::from_secs(10));
            let mut first = 0u32;
            let now = Instant::now();
            // Arrival order within a batch.
            let mut order: Vec<u32> = (0..BATCH).collect();
            for chunk in order.chunks_mut(group) {
                chunk.reverse();
            }
            b.iter(|| {
                for &i in &order {
                    tracker.on_arrival(immediate(first, i), 65536, now).expect("valid arrival");
                    while let Some(m) = tracker.poll_finished() {
                        black_box(m);
                    }
                }
                first = first.wrapping_add(BATCH) & SEQ_MASK;
            });
            assert_eq!(tracker.held(), 0);
        });
    }
    g.finish();
}

fn main() {
    let mut c = Criterion::default().configure_from_args();
    bench(&mut c);
    c.final_summary();
}
