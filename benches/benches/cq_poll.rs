//! What polling costs: one poll of an empty CQ (the busy-poll loop's
//! price per turn) and draining a full batch of 64 completions, on a
//! physical soft CQ and on a virtual CQ.
//!
//! Run: `cargo bench -p rmacomm-bench --bench cq_poll`.

use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput};
use ibverbx::{
    AccessFlags, CompletionQueue, MemoryRegion, QpCaps, QpInitAttr, QueuePair, SendFlags, SendOp, SendWr, VirtualCq,
    VirtualQp, VirtualQpConfig, WorkCompletion,
};

const BATCH: usize = 64;
const WAIT: Option<Duration> = Some(Duration::from_secs(60));

fn bench(c: &mut Criterion) {
    let dev = ibverbx::soft_device();
    let ctx_a = dev.open().unwrap();
    let ctx_b = dev.open().unwrap();
    let (pa, pb) = (ctx_a.alloc_pd().unwrap(), ctx_b.alloc_pd().unwrap());
    let src = MemoryRegion::alloc(&pa, 4096, AccessFlags::all_remote()).unwrap();
    let dst = MemoryRegion::alloc(&pb, 4096, AccessFlags::all_remote()).unwrap();
    let sge = [src.sge(0, 8).unwrap()];
    let write = SendOp::RdmaWrite { remote_addr: dst.addr(), rkey: dst.rkey() };
    let post = |post_one: &dyn Fn(u64)| {
        for i in 0..BATCH as u64 {
            post_one(i);
        }
    };

    let mut g = c.benchmark_group("cq_poll");

    // Physical soft CQ.
    let cq_a = ctx_a.create_cq(1024).unwrap();
    let cq_b = ctx_b.create_cq(1024).unwrap();
    let attr = QpInitAttr { caps: QpCaps { max_send_wr: 256, ..QpCaps::default() }, sq_sig_all: false };
    let a: QueuePair = pa.create_qp(&attr, &cq_a, &cq_a).unwrap();
    let b = pb.create_qp(&attr, &cq_b, &cq_b).unwrap();
    a.connect(&b.endpoint().unwrap()).unwrap();
    b.connect(&a.endpoint().unwrap()).unwrap();
    let mut wcs = [WorkCompletion::empty(); BATCH];
    g.throughput(Throughput::Elements(1));
    g.bench_function("physical_empty", |bn| bn.iter(|| assert_eq!(cq_a.poll(&mut wcs).unwrap(), 0)));
    g.throughput(Throughput::Elements(BATCH as u64));
    g.bench_function("physical_full_64", |bn| {
        bn.iter_custom(|iters| {
            let mut t = Duration::ZERO;
            for _ in 0..iters {
                post(&|i| {
                    a.post_send(&[SendWr { wr_id: i, op: write, sg_list: &sge, flags: SendFlags::SIGNALED }]).unwrap()
                });
                settle();
                let start = Instant::now();
                let n = cq_a.poll(&mut wcs).unwrap();
                t += start.elapsed();
                drain(&cq_a, n);
            }
            t
        })
    });

    // Virtual CQ over one physical QP.
    let cfg = VirtualQpConfig { total_qps: 1, max_msg_cnt_per_qp: 128, ..VirtualQpConfig::default() };
    let vcq_a = VirtualCq::new(&ctx_a, 4096).unwrap();
    let vcq_b = VirtualCq::new(&ctx_b, 4096).unwrap();
    let va = VirtualQp::new(&pa, &vcq_a, &cfg).unwrap();
    let vb = VirtualQp::new(&pb, &vcq_b, &cfg).unwrap();
    va.connect(&vb.endpoint().unwrap()).unwrap();
    vb.connect(&va.endpoint().unwrap()).unwrap();
    g.throughput(Throughput::Elements(1));
    g.bench_function("virtual_empty", |bn| bn.iter(|| assert_eq!(vcq_a.poll(&mut wcs).unwrap(), 0)));
    g.throughput(Throughput::Elements(BATCH as u64));
    g.bench_function("virtual_full_64", |bn| {
        bn.iter_custom(|iters| {
            let mut t = Duration::ZERO;
            for _ in 0..iters {
                post(&|i| {
                    va.post_send(&[SendWr { wr_id: i, op: write, sg_list: &sge, flags: SendFlags::SIGNALED }]).unwrap()
                });
                settle();
                let start = Instant::now();
                let n = vcq_a.poll(&mut wcs).unwrap();
                t += start.elapsed();
                let mut got = n;
                while got < BATCH {
                    got += vcq_a.wait(&mut wcs[..BATCH - got], WAIT, Duration::ZERO).unwrap();
                }
            }
            t
        })
    });
    g.finish();
}

/// Lets a posted batch complete (untimed): the soft provider completes
/// same-host 8-byte writes at post time or within microseconds, so the CQ
/// holds the whole batch when the timed poll comes.
fn settle() {
    std::thread::sleep(Duration::from_micros(300));
}

/// Takes out (untimed) what the timed poll left of a batch.
fn drain(cq: &CompletionQueue, mut got: usize) {
    let mut wcs = [WorkCompletion::empty(); BATCH];
    while got < BATCH {
        got += cq.wait(&mut wcs[..BATCH - got], WAIT, Duration::ZERO).unwrap();
    }
}

fn main() {
    let mut c = Criterion::default().configure_from_args();
    bench(&mut c);
    c.final_summary();
}
