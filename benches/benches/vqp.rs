//! VirtualQp benchmarks on the soft provider.
//!
//! - `post/*`: the cost of posting one single-fragment RDMA WRITE (64 B)
//!   through a virtual QP against a plain physical post. Only the posting
//!   calls are timed, in batches that fit the send queues; completions are
//!   drained outside the timing.
//! - `write16m/*`: one 16 MiB RDMA_WRITE_WITH_IMM to a second process over
//!   soft/TCP, until its send completion (data placed remotely), with 1
//!   QP, 4 QPs spray and 4 QPs DQPLB, all in the same run against the same
//!   peer process (this binary re-executed with `VQP_BENCH_PEER=1`).
//!
//! Run: `cargo bench -p rmacomm-bench --bench vqp`.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput};
use ibverbx::{
    AccessFlags, LoadBalancing, MemoryRegion, QpCaps, QpInitAttr, RecvWr, SendFlags, SendOp, SendWr, VirtualCq,
    VirtualQp, VirtualQpConfig, VirtualQpEndpoint, WorkCompletion,
};
use serde::{Deserialize, Serialize};

const BATCH: u64 = 64;
const BIG: usize = 16 << 20;
const WAIT: Option<Duration> = Some(Duration::from_secs(60));

fn vcfg(qps: u32, lb: LoadBalancing, window: u32, frag: u32) -> VirtualQpConfig {
    VirtualQpConfig {
        total_qps: qps,
        load_balancing: lb,
        max_msg_cnt_per_qp: window,
        max_msg_size: frag,
        ..VirtualQpConfig::default()
    }
}

/// Waits for exactly `n` virtual completions on `cq` while `peer` progresses.
fn drain_virtual(cq: &VirtualCq, n: u64, peer: &VirtualCq) {
    let mut buf = [WorkCompletion::empty(); 64];
    let mut got = 0;
    let start = Instant::now();
    while got < n {
        let k = cq.wait(&mut buf, Some(Duration::from_millis(1)), Duration::ZERO).expect("poll");
        for wc in &buf[..k] {
            assert!(wc.is_ok(), "{wc:?}");
        }
        got += k as u64;
        peer.progress().expect("peer progress");
        assert!(start.elapsed() < Duration::from_secs(60), "completions stopped coming");
    }
}

fn bench_post(c: &mut Criterion) {
    let dev = ibverbx::soft_device();
    let ctx_a = dev.open().unwrap();
    let ctx_b = dev.open().unwrap();
    let (pa, pb) = (ctx_a.alloc_pd().unwrap(), ctx_b.alloc_pd().unwrap());
    let src = MemoryRegion::alloc(&pa, 4096, AccessFlags::all_remote()).unwrap();
    let dst = MemoryRegion::alloc(&pb, 4096, AccessFlags::all_remote()).unwrap();
    let sge = [src.sge(0, 64).unwrap()];
    let write = SendOp::RdmaWrite { remote_addr: dst.addr(), rkey: dst.rkey() };
    let mut g = c.benchmark_group("post");
    g.throughput(Throughput::Elements(1));

    // Plain physical QP.
    {
        let cq_a = ctx_a.create_cq(1024).unwrap();
        let cq_b = ctx_b.create_cq(1024).unwrap();
        let attr = QpInitAttr { caps: QpCaps { max_send_wr: 256, ..QpCaps::default() }, sq_sig_all: false };
        let a = pa.create_qp(&attr, &cq_a, &cq_a).unwrap();
        let b = pb.create_qp(&attr, &cq_b, &cq_b).unwrap();
        a.connect(&b.endpoint().unwrap()).unwrap();
        b.connect(&a.endpoint().unwrap()).unwrap();
        g.bench_function("physical_write", |bn| {
            bn.iter_custom(|iters| {
                let mut t = Duration::ZERO;
                let mut left = iters;
                let mut wcs = [WorkCompletion::empty(); 64];
                while left > 0 {
                    let n = left.min(BATCH);
                    let start = Instant::now();
                    for i in 0..n {
                        a.post_send(&[SendWr { wr_id: i, op: write, sg_list: &sge, flags: SendFlags::SIGNALED }])
                            .unwrap();
                    }
                    t += start.elapsed();
                    let mut got = 0;
                    while got < n {
                        got += cq_a.wait(&mut wcs, WAIT, Duration::ZERO).unwrap() as u64;
                    }
                    left -= n;
                }
                t
            })
        });
    }

    // Virtual QPs, one fragment per WR.
    for (name, qps, lb) in [
        ("virtual_1qp", 1, LoadBalancing::Dqplb),
        ("virtual_4qp_spray", 4, LoadBalancing::Spray),
        ("virtual_4qp_dqplb", 4, LoadBalancing::Dqplb),
    ] {
        let cfg = vcfg(qps, lb, BATCH as u32, 1 << 20);
        let cq_a = VirtualCq::new(&ctx_a, 4096).unwrap();
        let cq_b = VirtualCq::new(&ctx_b, 4096).unwrap();
        let a = VirtualQp::new(&pa, &cq_a, &cfg).unwrap();
        let b = VirtualQp::new(&pb, &cq_b, &cfg).unwrap();
        a.connect(&b.endpoint().unwrap()).unwrap();
        b.connect(&a.endpoint().unwrap()).unwrap();
        g.bench_function(name, |bn| {
            bn.iter_custom(|iters| {
                let mut t = Duration::ZERO;
                let mut left = iters;
                while left > 0 {
                    let n = left.min(BATCH);
                    let start = Instant::now();
                    for i in 0..n {
                        a.post_send(&[SendWr { wr_id: i, op: write, sg_list: &sge, flags: SendFlags::SIGNALED }])
                            .unwrap();
                    }
                    t += start.elapsed();
                    drain_virtual(&cq_a, n, &cq_b);
                    left -= n;
                }
                t
            })
        });
    }
    g.finish();
}

#[derive(Serialize, Deserialize)]
struct PeerHello {
    endpoints: Vec<VirtualQpEndpoint>,
    addr: u64,
    rkey: u32,
}

fn configs() -> Vec<(&'static str, VirtualQpConfig)> {
    // 16 MiB over 4 QPs: one 4 MiB fragment per QP; the 1-QP case posts
    // the same four fragments in order on its one QP.
    let frag = 4 << 20;
    vec![
        ("1qp", vcfg(1, LoadBalancing::Spray, 8, frag)),
        ("4qp_spray", vcfg(4, LoadBalancing::Spray, 8, frag)),
        ("4qp_dqplb", vcfg(4, LoadBalancing::Dqplb, 8, frag)),
    ]
}

/// Spray with many small messages in flight: ctran's one notify at a time
/// (`max_notify_in_flight: 1`) against ours (one per window slot).
fn notify_configs() -> Vec<(&'static str, VirtualQpConfig)> {
    let c = |n| VirtualQpConfig { max_notify_in_flight: n, ..vcfg(4, LoadBalancing::Spray, 16, 16 << 10) };
    vec![("notify_1_in_flight", c(1)), ("notify_16_in_flight", c(16))]
}

const SMALL_MSG: usize = 64 << 10;
const SMALL_MSGS: usize = 256;

/// The peer process: owns the target region, keeps its virtual CQ
/// progressing and its receives posted until stdin closes.
fn peer_main() {
    let ctx = ibverbx::soft_device().open().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let region = MemoryRegion::alloc(&pd, BIG, AccessFlags::all_remote()).unwrap();
    let cq = VirtualCq::new(&ctx, 8192).unwrap();
    let qps: Vec<VirtualQp> =
        configs().iter().chain(&notify_configs()).map(|(_, c)| VirtualQp::new(&pd, &cq, c).unwrap()).collect();
    let recvs: Vec<RecvWr<'_>> = (0..128).map(|i| RecvWr { wr_id: i, sg_list: &[] }).collect();
    for q in &qps {
        q.post_recv(&recvs).unwrap();
    }
    let hello = PeerHello {
        endpoints: qps.iter().map(|q| q.endpoint().unwrap()).collect(),
        addr: region.addr(),
        rkey: region.rkey(),
    };
    println!("{}", serde_json::to_string(&hello).unwrap());
    std::io::stdout().flush().unwrap();
    let mut line = String::new();
    std::io::stdin().lock().read_line(&mut line).unwrap();
    let theirs: Vec<VirtualQpEndpoint> = serde_json::from_str(&line).unwrap();
    for (q, e) in qps.iter().zip(&theirs) {
        q.connect(e).unwrap();
    }
    let done = Arc::new(AtomicBool::new(false));
    let d = done.clone();
    std::thread::spawn(move || {
        let mut rest = String::new();
        let _ = std::io::stdin().lock().read_line(&mut rest);
        d.store(true, Ordering::Release);
    });
    let mut wcs = [WorkCompletion::empty(); 64];
    while !done.load(Ordering::Acquire) {
        let n = cq.wait(&mut wcs, Some(Duration::from_millis(50)), Duration::ZERO).unwrap();
        for wc in &wcs[..n] {
            if let Some(q) = qps.iter().find(|q| q.qp_num() == wc.qp_num) {
                q.post_recv(&[RecvWr { wr_id: wc.wr_id, sg_list: &[] }]).unwrap();
            }
        }
    }
}

fn bench_write16m(c: &mut Criterion) {
    let exe = std::env::current_exe().unwrap();
    let mut child = Command::new(exe)
        .env("VQP_BENCH_PEER", "1")
        .env("RMACOMM_SOFT_LINK", "tcp")
        .env("RMACOMM_LOG", "error")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn the peer");
    let mut stdin = child.stdin.take().unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    let peer: PeerHello = serde_json::from_str(&line).unwrap();

    let provider = ibverbx::soft::SoftProvider::new(ibverbx::soft::SoftConfig {
        link: ibverbx::soft::SoftLink::Tcp,
        ..ibverbx::soft::SoftConfig::from_env()
    });
    let ctx = provider.device().open().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let src = MemoryRegion::alloc(&pd, BIG, AccessFlags::all_remote()).unwrap();
    src.write(0, &vec![0x5a; BIG]).unwrap();
    let cq = VirtualCq::new(&ctx, 8192).unwrap();
    let cfgs = configs();
    let ncfgs = notify_configs();
    let qps: Vec<VirtualQp> = cfgs.iter().chain(&ncfgs).map(|(_, c)| VirtualQp::new(&pd, &cq, c).unwrap()).collect();
    let mine: Vec<VirtualQpEndpoint> = qps.iter().map(|q| q.endpoint().unwrap()).collect();
    writeln!(stdin, "{}", serde_json::to_string(&mine).unwrap()).unwrap();
    stdin.flush().unwrap();
    for (q, e) in qps.iter().zip(&peer.endpoints) {
        q.connect(e).unwrap();
    }

    let sge = [src.sge(0, BIG).unwrap()];
    let mut g = c.benchmark_group("write16m");
    g.throughput(Throughput::Bytes(BIG as u64));
    g.sample_size(20);
    g.measurement_time(Duration::from_secs(8));
    let mut wcs = [WorkCompletion::empty(); 4];
    for ((name, _), q) in cfgs.iter().zip(&qps) {
        g.bench_with_input(BenchmarkId::new("tcp", name), q, |bn, q| {
            bn.iter(|| {
                let op = SendOp::RdmaWriteWithImm { remote_addr: peer.addr, rkey: peer.rkey, imm: 1 };
                q.post_send(&[SendWr { wr_id: 1, op, sg_list: &sge, flags: SendFlags::SIGNALED }]).unwrap();
                let n = cq.wait(&mut wcs, WAIT, Duration::ZERO).unwrap();
                assert!(n == 1 && wcs[0].is_ok(), "{:?}", &wcs[..n]);
            })
        });
    }
    g.finish();

    // Many small spray messages in flight: notifies one at a time (ctran)
    // against several in flight.
    let mut g = c.benchmark_group("spray_small_messages");
    g.throughput(Throughput::Bytes((SMALL_MSG * SMALL_MSGS) as u64));
    g.sample_size(20);
    g.measurement_time(Duration::from_secs(8));
    let mut wcs = [WorkCompletion::empty(); 64];
    for ((name, _), q) in ncfgs.iter().zip(&qps[cfgs.len()..]) {
        g.bench_with_input(BenchmarkId::new("tcp", name), q, |bn, q| {
            bn.iter(|| {
                for m in 0..SMALL_MSGS {
                    let sge = [src.sge(m * SMALL_MSG, SMALL_MSG).unwrap()];
                    let op = SendOp::RdmaWriteWithImm {
                        remote_addr: peer.addr + (m * SMALL_MSG) as u64,
                        rkey: peer.rkey,
                        imm: m as u32,
                    };
                    q.post_send(&[SendWr { wr_id: m as u64, op, sg_list: &sge, flags: SendFlags::SIGNALED }]).unwrap();
                }
                let mut done = 0;
                while done < SMALL_MSGS {
                    let n = cq.wait(&mut wcs, WAIT, Duration::ZERO).unwrap();
                    assert!(n > 0 && wcs[..n].iter().all(|w| w.is_ok()), "{:?}", &wcs[..n]);
                    done += n;
                }
            })
        });
    }
    g.finish();
    drop(stdin);
    let _ = child.wait();
}

fn main() {
    if std::env::var_os("VQP_BENCH_PEER").is_some() {
        peer_main();
        return;
    }
    let mut c = Criterion::default().configure_from_args();
    bench_post(&mut c);
    bench_write16m(&mut c);
    c.final_summary();
}
