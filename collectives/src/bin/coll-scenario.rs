//! Test helper, not a tool: the multi-process collective scenarios the
//! integration tests (`tests/collectives_processes.rs`) run, one process
//! per rank with torchrun's variables. Each checks itself and exits
//! non-zero (with a message) when something is wrong.
//!
//! `coll-scenario SCENARIO`: `all` (every operation, torchcomms'
//! conventions), `mismatch`, `killed`, `gpu` (the native GPU collectives
//! on CUDA device memory, `GpuComm`: through CUDA IPC on one host, in
//! transport mode across hosts; prints the mode; skips, saying why,
//! without a CUDA driver or NVRTC; `GPU_PER_RANK=1`: rank r on GPU r mod
//! the device count). `COLL_PATH=separate` turns the UNIFIED same-host
//! path off.

use std::time::{Duration, Instant};

use rmacomm_collectives::{new_comm, Comm, CommOptions, DType, Error, ReduceOp};
use rmacomm_window::WindowOptions;

type R = Result<(), String>;

fn ensure(cond: bool, msg: impl FnOnce() -> String) -> R {
    if cond {
        Ok(())
    } else {
        Err(msg())
    }
}

fn s<E: std::fmt::Display>(e: E) -> String {
    e.to_string()
}

fn opts() -> CommOptions {
    let unified = std::env::var("COLL_PATH").map_or(true, |v| v != "separate");
    CommOptions::new()
        .timeout(Duration::from_secs(30))
        .slot_bytes(64 << 10)
        .window(WindowOptions::new().unified(unified))
}

/// Runs the scenario named by the first argument, as this process's rank.
pub fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let rank: usize = std::env::var("RANK").ok().and_then(|v| v.parse().ok()).expect("RANK");
    let t0 = Instant::now();
    let r = match args.first().map(String::as_str) {
        Some("all") => all(),
        Some("mismatch") => mismatch(),
        Some("killed") => killed(),
        Some("gpu") => gpu(),
        Some("gpu_killed") => gpu_killed(),
        Some("gpu_killed_replay") => gpu_killed_replay(),
        Some("gpu_replay_teardown") => gpu_replay_teardown(),
        Some("gpu_slow_reader") => gpu_slow_reader(),
        Some("time") => time(&args[1..]),
        other => Err(format!("unknown scenario {other:?}")),
    };
    match r {
        Ok(()) => println!("rank {rank} ok ({:?})", t0.elapsed()),
        Err(e) => {
            eprintln!("rank {rank} FAILED: {e}");
            std::process::exit(1);
        }
    }
}

/// `count` elements of `dtype`, all equal to `v`.
fn full(dtype: DType, count: usize, v: f64) -> Vec<u8> {
    let one: Vec<u8> = match dtype {
        DType::F32 => (v as f32).to_le_bytes().to_vec(),
        DType::F64 => v.to_le_bytes().to_vec(),
        DType::I32 => (v as i32).to_le_bytes().to_vec(),
        DType::I64 => (v as i64).to_le_bytes().to_vec(),
        DType::I8 => vec![v as i8 as u8],
        DType::U8 => vec![v as u8],
        DType::F16 => rmacomm_collectives::kernels::half::f16::from_f64(v).to_le_bytes().to_vec(),
        DType::BF16 => rmacomm_collectives::kernels::half::bf16::from_f64(v).to_le_bytes().to_vec(),
        other => unreachable!("{other:?}"),
    };
    one.repeat(count)
}

fn check_full(what: &str, buf: &[u8], dtype: DType, v: f64) -> R {
    let want = full(dtype, buf.len() / dtype.size(), v);
    if buf != want.as_slice() {
        let es = dtype.size();
        let bad = buf.chunks(es).zip(want.chunks(es)).position(|(a, b)| a != b).unwrap_or(0);
        return Err(format!("{what}: element {bad} is {:?}, want {v} ({dtype:?})", &buf[bad * es..(bad + 1) * es]));
    }
    Ok(())
}

fn all() -> R {
    let mut direct = new_comm("rdma", opts()).map_err(s)?;
    let mut ring = new_comm("rdma", opts().hint("rmacomm::algo", "ring")).map_err(s)?;
    let mut oneshot = new_comm("rdma", opts().hint("rmacomm::algo", "oneshot")).map_err(s)?;
    let mut twoshot = new_comm("rdma", opts().hint("rmacomm::algo", "direct")).map_err(s)?;
    let mut tree = new_comm("rdma", opts().hint("rmacomm::algo", "tree")).map_err(s)?;
    let mut recursive = new_comm("rdma", opts().hint("rmacomm::algo", "recursive")).map_err(s)?;
    let (rank, n) = (direct.rank(), direct.size());
    let nf = n as f64;
    let counts = [0usize, 4, 1024, 1 << 20];
    let dtypes = [DType::F32, DType::I32, DType::I8];
    // all_reduce: SUM = n(n+1)/2, MAX = n, AVG = (n+1)/2 (integers truncate
    // the average), both algorithms.
    for c in [&mut direct, &mut ring, &mut oneshot, &mut twoshot] {
        for &count in &counts {
            for &dt in &dtypes {
                for (op, want) in [
                    (ReduceOp::Sum, nf * (nf + 1.0) / 2.0),
                    (ReduceOp::Max, nf),
                    (ReduceOp::Avg, if dt == DType::F32 { (nf + 1.0) / 2.0 } else { ((n * (n + 1) / 2) / n) as f64 }),
                ] {
                    let mut buf = full(dt, count, rank as f64 + 1.0);
                    c.all_reduce(&mut buf, dt, op).map_err(|e| format!("all_reduce {count} {dt:?} {op:?}: {e}"))?;
                    check_full(&format!("all_reduce {count} {dt:?} {op:?} ({})", c.name()), &buf, dt, want)?;
                }
            }
        }
    }
    // Every element type, SUM and MAX.
    for dt in rmacomm_collectives::DType::ALL {
        let mut buf = full(dt, 333, rank as f64 + 1.0);
        direct.all_reduce(&mut buf, dt, ReduceOp::Sum).map_err(|e| format!("{dt:?}: {e}"))?;
        check_full("all_reduce every dtype", &buf, dt, nf * (nf + 1.0) / 2.0)?;
        let mut buf = full(dt, 333, rank as f64 + 1.0);
        ring.all_reduce(&mut buf, dt, ReduceOp::Max).map_err(|e| format!("{dt:?}: {e}"))?;
        check_full("all_reduce every dtype", &buf, dt, nf)?;
    }
    // PREMUL_SUM(2) = n(n+1); PRODUCT, MIN, and the bitwise ops on integers.
    for dt in [DType::F32, DType::I32, DType::I64, DType::F64] {
        let mut buf = full(dt, 1000, rank as f64 + 1.0);
        direct.all_reduce(&mut buf, dt, ReduceOp::PremulSum(2.0)).map_err(s)?;
        check_full("premul_sum", &buf, dt, nf * (nf + 1.0))?;
    }
    let mut buf = full(DType::I64, 77, rank as f64 + 1.0);
    ring.all_reduce(&mut buf, DType::I64, ReduceOp::Product).map_err(s)?;
    check_full("product", &buf, DType::I64, (1..=n).product::<usize>() as f64)?;
    let mut buf = full(DType::F32, 77, rank as f64 + 1.0);
    direct.all_reduce(&mut buf, DType::F32, ReduceOp::Min).map_err(s)?;
    check_full("min", &buf, DType::F32, 1.0)?;
    let mut buf = full(DType::U8, 33, (1u32 << rank) as f64);
    direct.all_reduce(&mut buf, DType::U8, ReduceOp::Bor).map_err(s)?;
    check_full("bor", &buf, DType::U8, ((1u32 << n) - 1) as f64)?;
    match direct.all_reduce(&mut full(DType::F32, 4, 1.0), DType::F32, ReduceOp::Band) {
        Err(Error::Kernel { .. }) => {}
        other => return Err(format!("BAND on f32: {other:?}")),
    }
    // all_gather: slot i = i + 1 (single, list, and v with uneven sizes).
    for &count in &counts[..3] {
        let input = full(DType::F32, count, rank as f64 + 1.0);
        for c in [&mut direct, &mut ring, &mut recursive] {
            let mut out = vec![0u8; n * input.len()];
            c.all_gather_single(&mut out, &input).map_err(s)?;
            for i in 0..n {
                let part = &out[i * input.len()..(i + 1) * input.len()];
                check_full(&format!("all_gather_single ({})", c.name()), part, DType::F32, i as f64 + 1.0)?;
            }
        }
        let mut outs: Vec<Vec<u8>> = (0..n).map(|i| vec![0u8; 4 * count * (i + 1)]).collect();
        let input = full(DType::F32, count * (rank + 1), rank as f64 + 1.0);
        let mut refs: Vec<&mut [u8]> = outs.iter_mut().map(|v| v.as_mut_slice()).collect();
        ring.all_gather_v(&mut refs, &input).map_err(s)?;
        for (i, o) in outs.iter().enumerate() {
            check_full("all_gather_v", o, DType::F32, i as f64 + 1.0)?;
        }
    }
    // reduce_scatter as all_reduce (single; list with uneven sizes).
    for &count in &counts[..3] {
        for &dt in &dtypes {
            let input = full(dt, count * n, rank as f64 + 1.0);
            for c in [&mut direct, &mut ring, &mut recursive] {
                let mut out = vec![0u8; count * dt.size()];
                c.reduce_scatter_single(&mut out, &input, dt, ReduceOp::Sum).map_err(s)?;
                check_full(&format!("reduce_scatter_single ({})", c.name()), &out, dt, nf * (nf + 1.0) / 2.0)?;
            }
            let ins: Vec<Vec<u8>> = (0..n).map(|j| full(dt, count + j, rank as f64 + 1.0)).collect();
            let refs: Vec<&[u8]> = ins.iter().map(Vec::as_slice).collect();
            let mut out = vec![0u8; (count + rank) * dt.size()];
            ring.reduce_scatter_v(&mut out, &refs, dt, ReduceOp::Max).map_err(s)?;
            check_full("reduce_scatter_v", &out, dt, nf)?;
        }
    }
    // reduce to every root; broadcast of 99 from root 0, and from the last.
    for root in 0..n {
        let mut buf = full(DType::I32, 1000, rank as f64 + 1.0);
        direct.reduce(&mut buf, DType::I32, ReduceOp::Sum, root).map_err(s)?;
        let want = if rank == root { nf * (nf + 1.0) / 2.0 } else { rank as f64 + 1.0 };
        check_full("reduce", &buf, DType::I32, want)?;
    }
    for c in [&mut direct, &mut tree] {
        for root in 0..n {
            for count in [1 << 20, 5, 0] {
                let mut buf = full(DType::F32, count, if rank == root { 99.0 } else { 0.0 });
                c.broadcast(&mut buf, root).map_err(s)?;
                check_full(&format!("broadcast from {root} ({})", c.name()), &buf, DType::F32, 99.0)?;
            }
        }
    }
    // all_to_all_single: section i = i + 1; v with uneven splits (rank r
    // sends r + j + 1 elements to j).
    for &count in &counts[..3] {
        let input = full(DType::I32, count * n, rank as f64 + 1.0);
        let mut out = vec![0u8; input.len()];
        direct.all_to_all_single(&mut out, &input).map_err(s)?;
        for i in 0..n {
            check_full("all_to_all_single", &out[i * count * 4..(i + 1) * count * 4], DType::I32, i as f64 + 1.0)?;
        }
    }
    let isplit: Vec<usize> = (0..n).map(|j| 4 * (rank + j + 1)).collect();
    let osplit: Vec<usize> = (0..n).map(|i| 4 * (i + rank + 1)).collect();
    let input = full(DType::I32, isplit.iter().sum::<usize>() / 4, rank as f64 + 1.0);
    let mut out = vec![0u8; osplit.iter().sum()];
    ring.all_to_all_v_single(&mut out, &input, &osplit, &isplit).map_err(s)?;
    let mut at = 0;
    for (i, l) in osplit.iter().enumerate() {
        check_full("all_to_all_v_single", &out[at..at + l], DType::I32, i as f64 + 1.0)?;
        at += l;
    }
    // scatter and gather from root 1 % n.
    let root = 1 % n;
    let ins: Vec<Vec<u8>> = (0..n).map(|j| full(DType::F32, 300, j as f64 + 7.0)).collect();
    let refs: Vec<&[u8]> = ins.iter().map(Vec::as_slice).collect();
    let mut out = vec![0u8; 1200];
    direct.scatter(&mut out, (rank == root).then_some(refs.as_slice()), root).map_err(s)?;
    check_full("scatter", &out, DType::F32, rank as f64 + 7.0)?;
    let mut outs: Vec<Vec<u8>> = (0..n).map(|_| vec![0u8; 1200]).collect();
    let mut orefs: Vec<&mut [u8]> = outs.iter_mut().map(|v| v.as_mut_slice()).collect();
    let input = full(DType::F32, 300, rank as f64 + 1.0);
    direct.gather((rank == root).then_some(orefs.as_mut_slice()), &input, root).map_err(s)?;
    if rank == root {
        for (i, o) in outs.iter().enumerate() {
            check_full("gather", o, DType::F32, i as f64 + 1.0)?;
        }
    }
    // send/recv around the ring, even ranks sending first; then a batch.
    if n > 1 {
        let (right, left) = ((rank + 1) % n, (rank + n - 1) % n);
        let data = full(DType::I8, 200_000, rank as f64);
        let mut got = vec![0u8; 200_000];
        if rank % 2 == 0 {
            direct.send(&data, right).map_err(s)?;
            direct.recv(&mut got, left).map_err(s)?;
        } else {
            direct.recv(&mut got, left).map_err(s)?;
            direct.send(&data, right).map_err(s)?;
        }
        check_full("send/recv", &got, DType::I8, left as f64)?;
        let mut from_left = vec![0u8; 100_000];
        let mut from_right = vec![0u8; 100];
        let to_right = full(DType::I8, 100_000, rank as f64);
        let to_left = full(DType::I8, 100, rank as f64 + 50.0);
        let b = direct.batch_op_create().recv(&mut from_left, left).send(&to_right, right);
        let b = if n > 2 { b.send(&to_left, left).recv(&mut from_right, right) } else { b };
        b.issue(&mut direct).map_err(s)?;
        check_full("batch", &from_left, DType::I8, left as f64)?;
        if n > 2 {
            check_full("batch", &from_right, DType::I8, right as f64 + 50.0)?;
        }
    }
    direct.barrier().map_err(s)?;
    // Async: operations queued on a worker thread, waited late (in reverse),
    // buffers owned by the operations and handed back.
    let a = rmacomm_collectives::AsyncComm::new(direct);
    let works: Vec<_> = (0..8)
        .map(|i| {
            let buf = full(DType::I32, 10_000 * (i + 1), (rank + i) as f64);
            a.submit(move |c| {
                let mut buf = buf;
                c.all_reduce(&mut buf, DType::I32, ReduceOp::Sum).map(|()| buf)
            })
        })
        .collect();
    for (i, mut w) in works.into_iter().enumerate().rev() {
        let buf = w.wait(None).map_err(s)?;
        let want: usize = (0..n).map(|r| r + i).sum();
        check_full("async all_reduce", &buf, DType::I32, want as f64)?;
    }
    let mut direct = a.into_inner();
    // A non-contiguous split running collectives while the parent runs its
    // own on another thread.
    let evens: Vec<usize> = (0..n).step_by(2).collect();
    let sub = direct.split(&evens).map_err(s)?;
    std::thread::scope(|sc| -> R {
        let h = sc.spawn(move || -> R {
            if let Some(mut sub) = sub {
                let k = sub.size() as f64;
                for _ in 0..20 {
                    let mut buf = full(DType::F32, 10_000, 1.0);
                    sub.all_reduce(&mut buf, DType::F32, ReduceOp::Sum).map_err(s)?;
                    check_full("split all_reduce", &buf, DType::F32, k)?;
                }
                sub.finalize().map_err(s)?;
            }
            Ok(())
        });
        for _ in 0..20 {
            let mut buf = full(DType::F32, 10_000, rank as f64 + 1.0);
            ring.all_reduce(&mut buf, DType::F32, ReduceOp::Sum).map_err(s)?;
            check_full("parent all_reduce beside the split", &buf, DType::F32, nf * (nf + 1.0) / 2.0)?;
        }
        h.join().map_err(|_| "split thread panicked".to_string())?
    })?;
    direct.finalize().map_err(s)?;
    ring.finalize().map_err(s)?;
    for c in [&mut oneshot, &mut twoshot, &mut tree, &mut recursive] {
        c.finalize().map_err(s)?;
    }
    ensure(direct.barrier().is_err(), || "an operation after finalize".into())
}

/// Rank 0 all-reduces 4 elements, the others 8: every rank fails with a
/// mismatch or timeout error naming the operation, none hangs.
fn mismatch() -> R {
    let mut c = new_comm("rdma", opts().timeout(Duration::from_secs(3))).map_err(s)?;
    let count = if c.rank() == 0 { 4 } else { 8 };
    let mut buf = full(DType::F32, count, 1.0);
    let t0 = Instant::now();
    match c.all_reduce(&mut buf, DType::F32, ReduceOp::Sum) {
        Err(e @ (Error::Mismatch { .. } | Error::Timeout { .. })) => {
            let msg = e.to_string();
            println!("mismatch error after {:?}: {msg}", t0.elapsed());
            ensure(msg.contains("all_reduce #1"), || msg.clone())?;
        }
        other => return Err(format!("mismatched all_reduce: {other:?}")),
    }
    ensure(t0.elapsed() < Duration::from_secs(10), || format!("took {:?}", t0.elapsed()))?;
    let e = c.barrier().unwrap_err().to_string();
    ensure(e.contains("unusable"), || e.clone())?;
    // A new communicator works.
    let mut c2 = new_comm("rdma", opts()).map_err(s)?;
    let mut buf = full(DType::F32, 16, 1.0);
    c2.all_reduce(&mut buf, DType::F32, ReduceOp::Sum).map_err(s)?;
    check_full("after a mismatch", &buf, DType::F32, c2.size() as f64)?;
    c2.finalize().map_err(s)
}

/// Rank 1 exits in the middle of the collectives; the others fail within
/// the timeout with an error naming the operation and rank 1.
fn killed() -> R {
    let mut c: Comm = new_comm("rdma", opts().timeout(Duration::from_secs(5))).map_err(s)?;
    let mut buf = full(DType::F32, 1 << 16, 1.0);
    c.all_reduce(&mut buf, DType::F32, ReduceOp::Sum).map_err(s)?;
    // Every rank is done with it (acknowledgements included) before rank 1 goes.
    c.group().barrier(None).map_err(s)?;
    if c.rank() == 1 {
        println!("rank 1 ok (exiting)");
        std::process::exit(0);
    }
    let t0 = Instant::now();
    let mut r = Ok(());
    for _ in 0..100 {
        r = c.all_reduce(&mut buf, DType::F32, ReduceOp::Sum);
        if r.is_err() {
            break;
        }
    }
    let msg = match r {
        Err(e) => e.to_string(),
        Ok(()) => return Err("all_reduce with a dead rank succeeded".into()),
    };
    println!("killed error after {:?}: {msg}", t0.elapsed());
    ensure(msg.contains("all_reduce") && msg.contains('1'), || msg.clone())?;
    ensure(t0.elapsed() < Duration::from_secs(15), || format!("took {:?}", t0.elapsed()))
}

/// The native GPU collectives (IPC mode) with a rank that dies: rank 1
/// exits once its GpuComm is made; rank 0's all_reduce, queued after, waits
/// on its stream for rank 1's signals until the watchdog sees the
/// connection to rank 1 break (well before the 60 s timeout), fails the
/// call and releases the stream (its synchronize returns); the next call
/// fails naming rank 1, and the drop returns.
/// The launcher's group, device 0's context (with `GPU_PER_RANK=1` GPU r
/// mod the device count for rank r) and a GpuComm of 64 KiB slots on them
/// (60 s timeouts); `None` (said why) without a CUDA driver or NVRTC.
#[allow(clippy::type_complexity)]
fn gpu_comm() -> Result<
    Option<(
        rmacomm_window::Group,
        std::sync::Arc<rmacomm_window::cuda::driver::Context>,
        rmacomm_collectives::GpuComm,
    )>,
    String,
> {
    let g = rmacomm_window::Group::from_env_with(rmacomm_window::GroupOptions::new().timeout(Duration::from_secs(60)))
        .map_err(s)?;
    let per_rank = std::env::var("GPU_PER_RANK").is_ok_and(|v| v == "1");
    let ordinal = match rmacomm_window::cuda::driver::probe() {
        Ok(d) if per_rank && d.devices > 0 => (g.rank() % d.devices) as u32,
        _ => 0,
    };
    let ctx = match rmacomm_window::cuda::driver::Context::open_shared(ordinal) {
        Ok(c) => c,
        Err(e) => {
            println!("gpu skipped: no CUDA driver ({e})");
            return Ok(None);
        }
    };
    if let Err(e) = rmacomm_window::cuda::nvrtc::Nvrtc::get() {
        println!("gpu skipped: no NVRTC for the kernels ({e})");
        return Ok(None);
    }
    let c = rmacomm_collectives::GpuComm::new(&g, ctx.clone(), Some(64 << 10), Duration::from_secs(60)).map_err(s)?;
    Ok(Some((g, ctx, c)))
}

fn gpu_killed() -> R {
    let Some((g, ctx, mut c)) = gpu_comm()? else { return Ok(()) };
    ensure(!c.through_transport(), || "the two ranks are not in IPC mode".into())?;
    let stream = ctx.stream().map_err(s)?;
    let buf = ctx.alloc_shared(200_000).map_err(s)?;
    g.barrier(None).map_err(s)?;
    if g.rank() == 1 {
        println!("rank 1 ok (dying)");
        // No destructor runs (as in a crash): the kernel closes its sockets.
        std::process::exit(0);
    }
    let t0 = Instant::now();
    // SAFETY: buf holds 50,000 f32 and outlives the synchronize.
    unsafe { c.all_reduce(buf.ptr(), 200_000, DType::F32, ReduceOp::Sum, &stream) }.map_err(s)?;
    stream.synchronize().map_err(s)?;
    let released = t0.elapsed();
    // SAFETY: refused before anything is queued.
    let e = unsafe { c.all_reduce(buf.ptr(), 4, DType::F32, ReduceOp::Sum, &stream) };
    let msg = e.err().map(|e| e.to_string()).ok_or("an all_reduce after rank 1 died succeeded")?;
    println!("gpu_killed error after {released:?}: {msg}");
    ensure(msg.contains("rank 1 is gone") && msg.contains("all_reduce"), || msg.clone())?;
    ensure(released < Duration::from_secs(20), || format!("released after {released:?}"))?;
    let t1 = Instant::now();
    drop(c);
    ensure(t1.elapsed() < Duration::from_secs(20), || format!("the drop took {:?}", t1.elapsed()))?;
    Ok(())
}

/// `count` f32 equal to `v`, as bytes.
fn f32s_of(count: usize, v: f32) -> Vec<u8> {
    (0..count).flat_map(|_| v.to_le_bytes()).collect()
}

/// Captures `f`'s calls on `stream` into a CUDA graph.
fn capture(
    stream: &rmacomm_window::cuda::device::Stream,
    f: impl FnOnce() -> Result<(), rmacomm_collectives::Error>,
) -> Result<rmacomm_window::cuda::device::Graph, String> {
    stream.begin_capture().map_err(s)?;
    let captured = f();
    let graph = stream.end_capture().map_err(s)?;
    captured.map_err(s)?;
    Ok(graph)
}

/// Replays `graph` on `stream` and waits for it.
fn replay(graph: &rmacomm_window::cuda::device::Graph, stream: &rmacomm_window::cuda::device::Stream) -> R {
    // SAFETY: the callers keep everything the graph uses alive until after
    // the synchronize.
    unsafe { graph.launch(stream) }.map_err(s)?;
    stream.synchronize().map_err(s)
}

/// `gpu_killed_replay` (IPC mode, two ranks or more): an all_reduce
/// captured into a CUDA graph and replayed once (checked); then the last
/// rank exits, and the others replay the graph three more times: each
/// replay's kernel waits for the dead rank's signals — which no host call
/// issued, so only the watchdog's look at what the kernels wait for (their
/// want words) ends them: every replay returns within moments (the later
/// ones too: a live peer's signal kernel wraps the poison, which the
/// watchdog writes again), the next call fails naming the rank, and the
/// drops return. Before, the first replay waited forever.
fn gpu_killed_replay() -> R {
    let Some((g, ctx, mut c)) = gpu_comm()? else { return Ok(()) };
    ensure(!c.through_transport(), || "the ranks are not in IPC mode".into())?;
    let (n, dying) = (g.size(), g.size() - 1);
    let stream = ctx.stream().map_err(s)?;
    let elems = 50_000usize;
    let buf = ctx.alloc_shared(elems * 4).map_err(s)?;
    buf.write_from(0, &f32s_of(elems, 1.0)).map_err(s)?;
    // SAFETY: buf holds 50,000 f32 and outlives every replay (the graph is
    // dropped first).
    let graph = capture(&stream, || unsafe { c.all_reduce(buf.ptr(), elems * 4, DType::F32, ReduceOp::Sum, &stream) })?;
    replay(&graph, &stream)?;
    let mut got = vec![0u8; elems * 4];
    buf.read_into(0, &mut got).map_err(s)?;
    ensure(got == f32s_of(elems, n as f32), || "the first replay's sum is wrong".into())?;
    g.barrier(None).map_err(s)?;
    if g.rank() == dying {
        println!("rank {dying} ok (dying)");
        // No destructor runs (as in a crash): the kernel closes its sockets.
        std::process::exit(0);
    }
    // A replay that is never released would hang this process: fail it.
    std::thread::spawn(|| {
        std::thread::sleep(Duration::from_secs(40));
        eprintln!("FAILED: a replay waiting for the dead rank was not released in 40 s");
        std::process::exit(1);
    });
    let t0 = Instant::now();
    for _ in 0..3 {
        replay(&graph, &stream)?;
    }
    let released = t0.elapsed();
    // SAFETY: refused before anything is queued.
    let e = unsafe { c.all_reduce(buf.ptr(), 4, DType::F32, ReduceOp::Sum, &stream) };
    let msg = e.err().map(|e| e.to_string()).ok_or("an all_reduce after the rank died succeeded")?;
    println!("gpu_killed_replay error after {released:?}: {msg}");
    let named = msg.contains(&format!("rank {dying} is gone")) && msg.contains("CUDA graph replay");
    // Or a live peer released first (it saw the death) and marked this rank.
    ensure(named || msg.contains("released its streams"), || msg.clone())?;
    ensure(c.check().is_err(), || "check() is Ok after the release".into())?;
    ensure(released < Duration::from_secs(20), || format!("released after {released:?}"))?;
    let t1 = Instant::now();
    drop(graph);
    drop(c);
    ensure(t1.elapsed() < Duration::from_secs(20), || format!("the drops took {:?}", t1.elapsed()))?;
    Ok(())
}

/// `gpu_replay_teardown` (IPC mode, three ranks): ranks leave normally,
/// one after another, while others still replay CUDA graphs — none of
/// which may be taken for a death. All three replay a captured all_reduce
/// (checked); rank 2 then synchronizes and drops its communicator while
/// ranks 0 and 1 replay a captured send/recv ping-pong between them 15
/// times (checked; rank 0's waits for rank 1 in flight ~60 ms each); then
/// rank 0 replays a last recv, in flight while rank 1 replays the matching
/// send and leaves (checked: its signal landed before it left), and rank 0
/// is still usable. (A watchdog that released on any gone peer failed
/// every one of these.)
fn gpu_replay_teardown() -> R {
    let Some((g, ctx, mut c)) = gpu_comm()? else { return Ok(()) };
    ensure(!c.through_transport() && g.size() == 3, || "not three ranks in IPC mode".into())?;
    let rank = g.rank();
    let stream = ctx.stream().map_err(s)?;
    let elems = 10_000usize;
    let buf = ctx.alloc_shared(elems * 4).map_err(s)?;
    buf.write_from(0, &f32s_of(elems, 1.0)).map_err(s)?;
    let fetch = |m: &rmacomm_window::cuda::device::DeviceMemory| -> Result<Vec<u8>, String> {
        let mut v = vec![0u8; elems * 4];
        m.read_into(0, &mut v).map_err(s)?;
        Ok(v)
    };
    // SAFETY: buf holds `elems` f32 and outlives every replay.
    let all = capture(&stream, || unsafe { c.all_reduce(buf.ptr(), elems * 4, DType::F32, ReduceOp::Sum, &stream) })?;
    for _ in 0..3 {
        replay(&all, &stream)?;
    }
    ensure(fetch(&buf)? == f32s_of(elems, 27.0), || "three replays of the all_reduce".into())?;
    g.barrier(None).map_err(s)?;
    if rank == 2 {
        stream.synchronize().map_err(s)?;
        drop(all);
        drop(c);
        println!("rank 2 left");
        return Ok(());
    }
    let peer = 1 - rank;
    let (mine, theirs) = (ctx.alloc_shared(elems * 4).map_err(s)?, ctx.alloc_shared(elems * 4).map_err(s)?);
    mine.write_from(0, &f32s_of(elems, 10.0 + rank as f32)).map_err(s)?;
    let len = 1024;
    // SAFETY: mine and theirs hold `elems` f32 and outlive every replay.
    let ping = capture(&stream, || unsafe {
        if rank == 0 {
            c.send(mine.ptr(), len, peer, &stream)?;
            c.recv(theirs.ptr(), len, peer, &stream)
        } else {
            c.recv(theirs.ptr(), len, peer, &stream)?;
            c.send(mine.ptr(), len, peer, &stream)
        }
    })?;
    // SAFETY: as above.
    let last = capture(&stream, || unsafe {
        if rank == 1 {
            c.send(mine.ptr(), len, peer, &stream)
        } else {
            c.recv(theirs.ptr(), len, peer, &stream)
        }
    })?;
    let want = f32s_of(len / 4, 10.0 + peer as f32);
    for i in 0..15 {
        theirs.write_from(0, &vec![0u8; len]).map_err(s)?;
        if rank == 1 {
            // Rank 0's replay waits for this one meanwhile (in flight when
            // its watchdog looks).
            std::thread::sleep(Duration::from_millis(60));
        }
        replay(&ping, &stream)?;
        ensure(fetch(&theirs)?[..len] == want[..], || format!("ping-pong replay {i}"))?;
        c.check().map_err(|e| format!("after ping-pong replay {i}: {e}"))?;
    }
    theirs.write_from(0, &vec![0u8; len]).map_err(s)?;
    if rank == 1 {
        // Rank 0's recv waits for this send meanwhile: rank 1 sends and
        // leaves while rank 0's replay is in flight.
        std::thread::sleep(Duration::from_millis(100));
        replay(&last, &stream)?;
        drop((ping, last));
        drop(c);
        println!("rank 1 left");
        return Ok(());
    }
    replay(&last, &stream)?;
    ensure(fetch(&theirs)?[..len] == want[..], || "the last recv, after rank 1 left".into())?;
    // The watchdog has seen both ranks gone by now.
    std::thread::sleep(Duration::from_millis(300));
    c.check().map_err(|e| format!("rank 0 was failed after its peers left normally: {e}"))?;
    drop((ping, last, all));
    Ok(())
}

/// `gpu_slow_reader` (IPC mode, the stand-in with
/// `RMACOMM_STANDIN_COPY_DELAY=<ms>@1`: rank 1's copies are slow): after an
/// all_reduce's last exchange every rank still copies its peers' shares
/// out of their slots, so rank 0, done first, drops its communicator while
/// rank 1 reads rank 0's slots — first after an eager all_reduce, then
/// (a new communicator) after two replays of a captured one. Rank 1's sums
/// are checked: a drop that freed the slots before rank 1 had read them
/// (the stand-in fills a freed exported allocation with 0xff: NaN) fails
/// them. Rank 0 says how long its drops waited.
fn gpu_slow_reader() -> R {
    let Some((g, ctx, mut c)) = gpu_comm()? else { return Ok(()) };
    ensure(!c.through_transport(), || "the ranks are not in IPC mode".into())?;
    let (n, rank) = (g.size(), g.rank());
    let stream = ctx.stream().map_err(s)?;
    // Two uses of the 64 KiB slots: no exchange follows the last one's
    // reads (one use, captured, gets one more: module docs).
    let elems = 24_576usize;
    let buf = ctx.alloc_shared(elems * 4).map_err(s)?;
    let sum = (1..=n).sum::<usize>() as f32;
    let check = |what: &str, want: f32| -> R {
        let mut got = vec![0u8; elems * 4];
        buf.read_into(0, &mut got).map_err(s)?;
        let bad = got.chunks(4).filter(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]) != want).count();
        ensure(bad == 0, || format!("{what}: {bad} of {elems} elements are not {want}"))
    };
    let leave = |c: rmacomm_collectives::GpuComm, what: &str| {
        let t0 = Instant::now();
        drop(c);
        println!("rank {rank} dropped its communicator {what} after {:?}", t0.elapsed());
    };
    buf.write_from(0, &f32s_of(elems, rank as f32 + 1.0)).map_err(s)?;
    // SAFETY: buf holds `elems` f32 and outlives the synchronize.
    unsafe { c.all_reduce(buf.ptr(), elems * 4, DType::F32, ReduceOp::Sum, &stream) }.map_err(s)?;
    stream.synchronize().map_err(s)?;
    check("the eager all_reduce", sum)?;
    leave(c, "(eager all_reduce)");
    let c = rmacomm_collectives::GpuComm::new(&g, ctx.clone(), Some(64 << 10), Duration::from_secs(60));
    let mut c = c.map_err(s)?;
    buf.write_from(0, &f32s_of(elems, rank as f32 + 1.0)).map_err(s)?;
    // SAFETY: buf outlives every replay (the graph is dropped first).
    let graph = capture(&stream, || unsafe { c.all_reduce(buf.ptr(), elems * 4, DType::F32, ReduceOp::Sum, &stream) })?;
    replay(&graph, &stream)?;
    replay(&graph, &stream)?;
    check("two replays of the captured all_reduce", sum * n as f32)?;
    drop(graph);
    leave(c, "(replays)");
    Ok(())
}

/// Not a test: `time OP ALGO SIZES...` prints the mean time of `OP`
/// (all_reduce f32 SUM, all_gather, all_to_all) per size in bytes, after
/// warm-up, on rank 0 (a quick look; rdma_bench is the benchmark).
fn time(args: &[String]) -> R {
    let (op, algo) = (args[0].as_str(), args[1].as_str());
    let slot = std::env::var("SLOT_BYTES").ok().and_then(|v| v.parse().ok()).unwrap_or(1 << 20);
    let mut c = new_comm("rdma", opts().slot_bytes(slot).hint("rmacomm::algo", algo)).map_err(s)?;
    let n = c.size();
    for size in args[2..].iter().map(|a| a.parse::<usize>().expect("size")) {
        let iters = (200_000_000 / size.max(4096)).clamp(5, 2000);
        let mut buf = full(DType::F32, size / 4, 1.0);
        let mut out = vec![0u8; size * n];
        let mut run = |c: &mut Comm| -> R {
            match op {
                "all_reduce" => c.all_reduce(&mut buf, DType::F32, ReduceOp::Sum).map_err(s),
                "all_gather" => c.all_gather_single(&mut out, &buf).map_err(s),
                "all_to_all" => c.all_to_all_single(&mut out[..size], &buf).map_err(s),
                _ => Err(format!("unknown op {op}")),
            }
        };
        for _ in 0..iters.min(20) {
            run(&mut c)?;
        }
        c.barrier().map_err(s)?;
        let t0 = Instant::now();
        for _ in 0..iters {
            run(&mut c)?;
        }
        let per = t0.elapsed() / iters as u32;
        if c.rank() == 0 {
            println!("{op} {algo} {n} ranks {size} B: {per:?}");
        }
    }
    c.finalize().map_err(s)
}

/// The native GPU collectives on device memory (`GpuComm`, 64 KiB slots):
/// all_reduce (f32 SUM and AVG, i32 MAX; 50,000 elements: several chunks),
/// reduce to each root, broadcast from each root, all_gather,
/// all_to_all and reduce_scatter of 20,000-element blocks, every result
/// checked on the host.
fn gpu() -> R {
    let Some((g, ctx, mut c)) = gpu_comm()? else { return Ok(()) };
    let (rank, n) = (g.rank(), g.size());
    println!("gpu mode: {} (cuda:{})", if c.through_transport() { "transport" } else { "ipc" }, ctx.ordinal());
    println!("gpu slots: {}", if c.host_slots() { "host" } else { "device" });
    let stream = ctx.stream().map_err(s)?;
    let f32s = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let i32s = |v: &[i32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let elems = 50_000usize;
    let buf = ctx.alloc_shared(elems * 4).map_err(s)?;
    let (b, big, out) =
        (20_000usize, ctx.alloc_shared(n * 20_000 * 4).map_err(s)?, ctx.alloc_shared(n * 20_000 * 4).map_err(s)?);
    let small = ctx.alloc_shared(b * 4).map_err(s)?;
    let fetch = |m: &rmacomm_window::cuda::device::DeviceMemory, len: usize| -> Result<Vec<u8>, String> {
        stream.synchronize().map_err(s)?;
        let mut v = vec![0u8; len];
        m.read_into(0, &mut v).map_err(s)?;
        Ok(v)
    };
    let x = |r: usize, i: usize| ((r + 1) * 10 + i % 7) as f32;
    for (op, want) in [
        (ReduceOp::Sum, (0..elems).map(|i| (0..n).map(|r| x(r, i)).sum()).collect::<Vec<f32>>()),
        (ReduceOp::Avg, (0..elems).map(|i| (0..n).map(|r| x(r, i)).sum::<f32>() / n as f32).collect()),
    ] {
        buf.write_from(0, &f32s(&(0..elems).map(|i| x(rank, i)).collect::<Vec<_>>())).map_err(s)?;
        // SAFETY: buf holds `elems` f32 and outlives the synchronize.
        unsafe { c.all_reduce(buf.ptr(), elems * 4, DType::F32, op, &stream) }.map_err(s)?;
        ensure(fetch(&buf, elems * 4)? == f32s(&want), || format!("gpu all_reduce f32 {op:?}"))?;
    }
    let y = |r: usize, i: usize| (r as i32 + 1) * 1000 - (i % 13) as i32;
    buf.write_from(0, &i32s(&(0..elems).map(|i| y(rank, i)).collect::<Vec<_>>())).map_err(s)?;
    // SAFETY: as above.
    unsafe { c.all_reduce(buf.ptr(), elems * 4, DType::I32, ReduceOp::Max, &stream) }.map_err(s)?;
    let want: Vec<i32> = (0..elems).map(|i| (0..n).map(|r| y(r, i)).max().unwrap_or(0)).collect();
    ensure(fetch(&buf, elems * 4)? == i32s(&want), || "gpu all_reduce i32 MAX".into())?;
    for root in 0..n {
        let mine: Vec<f32> = (0..elems).map(|i| x(rank, i)).collect();
        buf.write_from(0, &f32s(&mine)).map_err(s)?;
        // SAFETY: as above.
        unsafe { c.reduce(buf.ptr(), elems * 4, DType::F32, ReduceOp::Sum, root, &stream) }.map_err(s)?;
        let want: Vec<f32> =
            if rank == root { (0..elems).map(|i| (0..n).map(|r| x(r, i)).sum()).collect() } else { mine };
        ensure(fetch(&buf, elems * 4)? == f32s(&want), || format!("gpu reduce to {root}"))?;
        small.write_from(0, &i32s(&(0..b).map(|i| y(rank, i)).collect::<Vec<_>>())).map_err(s)?;
        // SAFETY: small holds b i32.
        unsafe { c.broadcast(small.ptr(), b * 4, root, &stream) }.map_err(s)?;
        ensure(fetch(&small, b * 4)? == i32s(&(0..b).map(|i| y(root, i)).collect::<Vec<_>>()), || {
            format!("gpu broadcast from {root}")
        })?;
    }
    let v = |r: usize, i: usize| (r * 1_000_000 + i) as i32;
    small.write_from(0, &i32s(&(0..b).map(|i| v(rank, i)).collect::<Vec<_>>())).map_err(s)?;
    // SAFETY: out holds n blocks, small one.
    unsafe { c.all_gather(out.ptr(), small.ptr(), b * 4, &stream) }.map_err(s)?;
    let want: Vec<i32> = (0..n).flat_map(|p| (0..b).map(move |i| v(p, i))).collect();
    ensure(fetch(&out, n * b * 4)? == i32s(&want), || "gpu all_gather".into())?;
    let inp: Vec<i32> = (0..n).flat_map(|j| (0..b).map(move |i| v(rank * 10 + j, i))).collect();
    big.write_from(0, &i32s(&inp)).map_err(s)?;
    // SAFETY: both hold n blocks.
    unsafe { c.all_to_all(out.ptr(), big.ptr(), b * 4, &stream) }.map_err(s)?;
    let want: Vec<i32> = (0..n).flat_map(|p| (0..b).map(move |i| v(p * 10 + rank, i))).collect();
    ensure(fetch(&out, n * b * 4)? == i32s(&want), || "gpu all_to_all".into())?;
    // SAFETY: big holds n blocks, small one.
    unsafe { c.reduce_scatter(small.ptr(), big.ptr(), b * 4, DType::I32, ReduceOp::Sum, &stream) }.map_err(s)?;
    let want: Vec<i32> = (0..b).map(|i| (0..n).map(|r| v(r * 10 + rank, i)).sum()).collect();
    ensure(fetch(&small, b * 4)? == i32s(&want), || "gpu reduce_scatter".into())?;
    g.barrier(None).map_err(s)?;
    drop(c);
    println!("gpu ok");
    Ok(())
}
