//! Test helper, not a tool: windows on CUDA device memory across processes
//! of one host (CUDA IPC), run under `rmacomm-run` by
//! `tests/window_processes.rs` and by the GPU suite (`scripts/gpu_suite.sh`).
//!
//! `gpu-window-scenario SCENARIO`, scenarios:
//! - `ring`: torchcomms' window ring on device memory, with host-ordered
//!   signals (synchronous `device_put`, `signal`, `wait_signal`) and
//!   stream-ordered ones (`device_put` on a stream, `signal_on_stream`,
//!   `wait_signal_on_stream`), for 1, 1000 and 1 Mi f32 elements; then
//!   `device_get`, out-of-bounds puts and gets, `map_remote_device`, and a
//!   put captured in a CUDA graph and replayed 10 times; then put, stream
//!   signal and stream wait captured together and replayed 10 times (the
//!   signals as kernels: every replay signals and waits again).
//! - `bw [MAX_BYTES]`: rank 0's `device_put` bandwidth into rank 1 from
//!   64 KiB to MAX_BYTES (256 MiB), synchronous and queued on a stream, beside the same copies
//!   into rank 0's own memory (no IPC: the copy-engine ceiling) in the same
//!   run; JSON lines on stdout.
//! - `lat`: signal round trips between the two ranks: host signals
//!   (`signal` / `wait_signal`), stream signals each round trip waited
//!   for on the host, and stream signals queued 1000 deep (the GPU hands
//!   off between the ranks' streams alone); JSON lines on stdout.
//!
//! - `proxy`: the window's stream proxy (stream-ordered operations with
//!   peers the device does not reach), between processes of one GPU with
//!   UNIFIED access off (every peer as on another host) and device memory
//!   registered through the transport: the ring ordered on a stream
//!   (`put_on_stream`, `signal_on_stream`, `wait_signal_on_stream`,
//!   `get_on_stream`) for 4 KiB, 1 MiB and 16 MiB, every byte checked;
//!   then (2 ranks) rank 0's 16 MiB puts queued on a stream beside the same
//!   puts from the host, and signal round trips through the proxy beside
//!   host signals; JSON lines on stdout.
//!
//! - `gpus`: ranks on several GPUs (with `GPU_PER_RANK=1`): the
//!   `ring` across them where the GPUs reach each other; where they do not
//!   (`RMACOMM_STANDIN_P2P=0`), `tensor_register_device` fails with
//!   `Error::Unreachable` on every rank and the stream-ordered ring of
//!   `proxy` runs on the same (UNIFIED) window through the transport.
//!
//! - `nccl`: NCCL's own one-sided API (2.29+) through
//!   `rmacomm_window::nccl_rma::NcclRma`, on cuMem/VMM memory: a ring of
//!   three rounds, each rank putting into its left neighbour's second
//!   window, then round k putting k + 1 pieces into its right neighbour's
//!   first, rank 0's last piece held back on its stream until after it has
//!   queued its signal, so a wait that counted NCCL's signals wrong passes early
//!   and finds old data; then the refusals (a rank outside the
//!   communicator, a put past the peer's buffer, a source past this
//!   rank's, a window not registered, memory in a window already,
//!   cuMemAlloc memory, buffers of different sizes, a signal that never
//!   comes). Under `NCCL_SCENARIO_PUT_FAILS=1` (with a library whose puts
//!   fail) it checks instead that a failed put breaks the `NcclRma`. Under
//!   `NCCL_SCENARIO_STUCK_SIGNAL=1` (two ranks) rank 0 queues a put and a
//!   signal to rank 1 behind a stream wait on a host word nobody writes (a
//!   peer whose stream is stuck, as behind a third rank that died), so
//!   rank 1's queued wait for that signal never ends by itself: on both
//!   ranks `deregister` fails within the `NcclRma`'s timeout (3 s) and the
//!   drop of the `NcclRma` returns (the communicator aborted: rank 1's
//!   stream is free again; rank 0's stream still waits, so its windows'
//!   memory is leaked). With a library older
//!   than 2.29 each rank prints `refused: ...` and succeeds: the caller
//!   checks the reason. One rank per GPU (NCCL's rule); one rank puts to
//!   itself, which checks the calls but not the counting (one stream
//!   orders everything).
//!
//! - `dead_replay`: a signal + wait captured in a CUDA graph whose replay
//!   waits for a rank that stops replaying (released after the 2 s
//!   timeout) and for one that dies (released at once).
//!
//! With `GPU_PER_RANK=1` rank r uses GPU r mod the device count
//! (else GPU 0). With `GPU_WINDOW_ALLOC=vmm` every registered tensor is cuMem/VMM memory
//! in 2 MiB mappings (as PyTorch's expandable segments are): peers map it
//! through its mappings' descriptors instead of a CUDA IPC handle.
//!
//! Without a GPU each rank prints why and succeeds, unless
//! `RMACOMM_EXPECT_GPU=1` (the GPU suite), where that is a failure.

// Unsafe only where a scenario registers part of an allocation by address.
#![deny(unsafe_code)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use rmacomm_window::cuda::device::{DeviceMemory, Stream};
use rmacomm_window::cuda::driver::Context;
use rmacomm_window::{Error, Group, GroupOptions, Window, WindowOptions};

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

fn main() {
    let filter = std::env::var("RMACOMM_LOG").unwrap_or_else(|_| "warn".into());
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).try_init();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let rank: usize = std::env::var("RANK").ok().and_then(|v| v.parse().ok()).expect("launched by rmacomm-run");
    // GPU_PER_RANK=1: rank r on GPU r mod the device count (hosts
    // with several GPUs), else every rank on GPU 0.
    let per_rank = std::env::var("GPU_PER_RANK").is_ok_and(|v| v == "1");
    let ordinal = match rmacomm_window::cuda::driver::probe() {
        Ok(d) if per_rank && d.devices > 0 => (rank % d.devices) as u32,
        _ => 0,
    };
    let result = match Context::open_shared(ordinal) {
        Err(e) if std::env::var("RMACOMM_EXPECT_GPU").is_ok_and(|v| v == "1") => Err(format!("no GPU: {e}")),
        Err(e) => {
            println!("rank {rank} skipped (no GPU: {e})");
            return;
        }
        Ok(ctx) => setup().and_then(|(g, w)| match args.first().map(String::as_str) {
            Some("ring") => ring(&g, w, &ctx),
            Some("lat") => lat(&g, w, &ctx),
            Some("bw") => bw(&g, w, &ctx, args.get(1).map_or(Ok(256 << 20), |m| m.parse().map_err(s))),
            Some("proxy") => {
                drop(w);
                proxy(&g, &ctx)
            }
            Some("nccl") => {
                drop(w);
                nccl(&g, &ctx)
            }
            Some("dead") => dead(&g, w, &ctx),
            Some("dead_replay") => {
                drop(w);
                dead_replay(&g, &ctx)
            }
            Some("gpus") => gpus(&g, w, &ctx),
            other => Err(format!("unknown scenario {other:?}")),
        }),
    };
    match result {
        Ok(()) => println!("rank {rank} ok"),
        Err(e) => {
            eprintln!("rank {rank} FAILED: {e}");
            std::process::exit(1);
        }
    }
}

/// A device window whose peer dies: rank 1 exits once registered (and
/// prints its line first); rank 0's `wait_signal_on_stream` for it is
/// released by the window's watchdog as soon as the connection breaks
/// (well inside the 30 s timeout): the stream's synchronize returns, and
/// the next stream operation fails with the reason, naming rank 1.
fn dead(g: &Group, mut w: Window, ctx: &Arc<Context>) -> R {
    w.tensor_register_device(ctx.alloc_shared(4096).map_err(s)?, 4).map_err(s)?;
    g.barrier(None).map_err(s)?;
    if g.rank() == 1 {
        // Exits once rank 0's wait is queued (a second barrier, through the
        // store): exiting at once raced it, and a wait queued after the
        // death was seen failed at once, not released.
        g.barrier(None).map_err(s)?;
        println!("rank 1 ok");
        // No destructor runs (as in a crash): the kernel closes its sockets.
        std::process::exit(0);
    }
    let stream = ctx.stream().map_err(s)?;
    let t0 = Instant::now();
    w.wait_signal_on_stream(1, &stream).map_err(s)?;
    g.barrier(None).map_err(s)?;
    stream.synchronize().map_err(s)?;
    let released = t0.elapsed();
    let e = w.wait_signal_on_stream(1, &stream).err().ok_or("a stream wait after rank 1 died was queued")?;
    println!("dead: released after {released:?}; then: {e}");
    ensure(matches!(&e, Error::StreamFailed { peer: 1, .. }) && e.to_string().contains("rank 1"), || e.to_string())?;
    ensure(released < Duration::from_secs(15), || format!("released after {released:?}"))?;
    // Its memory is no one's any more: no new view of it.
    let e = w.map_remote_device(1).err().ok_or("map_remote_device of a dead rank succeeded")?;
    ensure(matches!(e, Error::Rma { peer: 1, .. }), || e.to_string())?;
    // The deregistration (which synchronizes the device) returns too.
    let t1 = Instant::now();
    drop(w);
    ensure(t1.elapsed() < Duration::from_secs(15), || format!("the drop took {:?}", t1.elapsed()))
}

/// The watchdog on waits no host call issued: a signal + wait captured in
/// a CUDA graph (kernel signals) and replayed (two ranks).
/// 1. Rank 1 stops replaying (a rank that never makes the call): rank 0's
///    replay waits for it, and is released once it has waited the
///    window's timeout (2 s) with nothing moving; rank 0's stream
///    operations fail then, and so do rank 1's (rank 0 marked it).
/// 2. On a new window, rank 1 exits while rank 0 replays: released as soon
///    as rank 1's connection breaks, naming it.
///
/// Before, both replays waited forever (kernel waits were not watched).
fn dead_replay(g: &Group, ctx: &Arc<Context>) -> R {
    if nvrtc_missing(g, "dead_replay")? {
        return Ok(());
    }
    let (rank, peer) = (g.rank(), 1 - g.rank());
    let stream = ctx.stream().map_err(s)?;
    // A never-ending replay would hang this process: fail it.
    std::thread::spawn(|| {
        std::thread::sleep(Duration::from_secs(45));
        eprintln!("FAILED: a replay was not released in 45 s");
        std::process::exit(1);
    });
    let ping = |timeout: u64| -> Result<(Window, rmacomm_window::cuda::device::Graph), String> {
        let mut w = Window::new(g, WindowOptions::new().timeout(Duration::from_secs(timeout))).map_err(s)?;
        w.tensor_register_device(ctx.alloc_shared(4096).map_err(s)?, 4).map_err(s)?;
        stream.begin_capture().map_err(s)?;
        let captured = w.signal_on_stream(peer, &stream).and_then(|()| w.wait_signal_on_stream(peer, &stream));
        let graph = stream.end_capture().map_err(s)?;
        captured.map_err(|e| format!("signal + wait under capture: {e}"))?;
        // SAFETY: the window (its signal memory) outlives the graph.
        #[allow(unsafe_code)]
        unsafe { graph.launch(&stream) }.map_err(s)?;
        wait_stream(&stream, &|| "the first replay".into())?;
        g.barrier(None).map_err(s)?;
        Ok((w, graph))
    };
    // Replays `graph` (its wait for rank 1 never ends), returns how long
    // the release took and the error of the next stream wait.
    let released = |w: &Window, graph: &rmacomm_window::cuda::device::Graph, what: &str| -> Result<_, String> {
        let t0 = Instant::now();
        // SAFETY: as above.
        #[allow(unsafe_code)]
        unsafe { graph.launch(&stream) }.map_err(s)?;
        wait_stream(&stream, &|| what.to_string())?;
        let after = t0.elapsed();
        let e = w.wait_signal_on_stream(1, &stream).err().ok_or_else(|| format!("a stream wait after {what}"))?;
        Ok((after, e))
    };
    let (w, graph) = ping(2)?;
    if rank == 0 {
        let (released, e) = released(&w, &graph, "a replay rank 1 never matches")?;
        println!("dead_replay: overdue replay released after {released:?}; then: {e}");
        ensure(released >= Duration::from_millis(1900), || format!("released after {released:?}"))?;
        ensure(released < Duration::from_secs(15), || format!("released after {released:?}"))?;
        ensure(e.to_string().contains("CUDA graph replay") && e.to_string().contains("[1]"), || e.to_string())?;
    } else {
        // Rank 0's release marks this rank, whose watchdog releases it in
        // turn: its stream operations fail.
        let t0 = Instant::now();
        while w.stream_release().released().is_none() {
            ensure(t0.elapsed() < Duration::from_secs(15), || "rank 0 did not mark rank 1".into())?;
            std::thread::sleep(Duration::from_millis(20));
        }
        let e = w.signal_on_stream(0, &stream).err().ok_or("a stream signal after the release was queued")?;
        ensure(matches!(e, Error::StreamFailed { .. }), || e.to_string())?;
    }
    g.barrier(None).map_err(s)?;
    drop(graph);
    drop(w);
    let (w, graph) = ping(30)?;
    if rank == 1 {
        println!("rank 1 ok");
        // No destructor runs (as in a crash): the kernel closes its sockets.
        std::process::exit(0);
    }
    let (released, e) = released(&w, &graph, "a replay waiting for the dead rank 1")?;
    println!("dead_replay: released after {released:?}; then: {e}");
    ensure(matches!(&e, Error::StreamFailed { peer: 1, .. }) && e.to_string().contains("CUDA graph replay"), || {
        e.to_string()
    })?;
    ensure(released < Duration::from_secs(15), || format!("released after {released:?}"))?;
    let t1 = Instant::now();
    drop(graph);
    drop(w);
    ensure(t1.elapsed() < Duration::from_secs(15), || format!("the drop took {:?}", t1.elapsed()))
}

fn setup() -> Result<(Group, Window), String> {
    let g = Group::from_env_with(GroupOptions::new().timeout(Duration::from_secs(60))).map_err(s)?;
    let w = Window::new(&g, WindowOptions::new().timeout(Duration::from_secs(30))).map_err(s)?;
    Ok((g, w))
}

/// Memory for a registered tensor: cuMemAlloc, or VMM in 2 MiB mappings
/// under `GPU_WINDOW_ALLOC=vmm`.
fn tensor_mem(ctx: &Arc<Context>, len: usize) -> Result<DeviceMemory, String> {
    if std::env::var("GPU_WINDOW_ALLOC").is_ok_and(|v| v == "vmm") {
        let mem = ctx.alloc_vmm(len, 2 << 20).map_err(s)?;
        ensure(mem.is_vmm(), || "alloc_vmm gave no VMM memory".into())?;
        return Ok(mem);
    }
    ctx.alloc_shared(len).map_err(s)
}

fn f32s(value: usize, count: usize) -> Vec<u8> {
    (value as f32).to_le_bytes().repeat(count)
}

/// Checks that rank `from`'s `count` elements at element `from * count` of
/// this rank's registered memory are `value`.
fn check(w: &Window, from: usize, count: usize, value: usize, what: &dyn Fn() -> String) -> R {
    let own = w.local_device_tensor().ok_or("no local device tensor")?;
    let mut got = vec![0u8; count * 4];
    own.read_into(from * count * 4, &mut got).map_err(s)?;
    let want = f32s(value, count);
    if got != want {
        let bad = got.chunks(4).zip(want.chunks(4)).position(|(a, b)| a != b).unwrap();
        return Err(format!("{}: element {bad} from rank {from} is {:?}, want {value}", what(), &got[bad * 4..][..4]));
    }
    Ok(())
}

fn ring(g: &Group, mut w: Window, ctx: &Arc<Context>) -> R {
    let (rank, size) = (g.rank(), g.size());
    let (right, left) = ((rank + 1) % size, (rank + size - 1) % size);
    let stream = ctx.stream().map_err(s)?;
    let start = Instant::now();
    for count in [1usize, 1000, 1 << 20] {
        w.tensor_register_device(tensor_mem(ctx, size * count * 4).map_err(s)?, 4).map_err(s)?;
        ensure(w.get_device() == "cuda" && w.get_size() == size * count * 4, || "get_device / get_size".into())?;
        let src = ctx.alloc_shared(count * 4).map_err(s)?;
        for it in 0..5 {
            for on_stream in [false, true] {
                let value = |r: usize| r * 1000 + it * 10 + usize::from(on_stream) + 1;
                let what = || format!("count {count} iteration {it} on stream {on_stream}");
                src.write_from(0, &f32s(value(rank), count)).map_err(s)?;
                if on_stream {
                    w.device_put(src.all(), right, rank * count, Some(&stream))
                        .map_err(|e| format!("{}: {e}", what()))?;
                    w.signal_on_stream(right, &stream).map_err(|e| format!("{}: {e}", what()))?;
                    w.wait_signal_on_stream(left, &stream).map_err(|e| format!("{}: {e}", what()))?;
                    wait_stream(&stream, &what)?;
                } else {
                    w.device_put(src.all(), right, rank * count, None).map_err(|e| format!("{}: {e}", what()))?;
                    w.signal(right, false).map_err(|e| format!("{}: {e}", what()))?;
                    w.wait_signal(left, None).map_err(|e| format!("{}: {e}", what()))?;
                }
                check(&w, left, count, value(left), &what)?;
                // Nobody overwrites a region before its owner checked it.
                g.barrier(None).map_err(s)?;
            }
        }
        // device_get: what this rank put into `right` comes back.
        let back = ctx.alloc_shared(count * 4).map_err(s)?;
        w.device_get(back.all(), right, rank * count, None).map_err(s)?;
        let mut got = vec![0u8; count * 4];
        back.read_into(0, &mut got).map_err(s)?;
        ensure(got == f32s(rank * 1000 + 40 + 2, count), || format!("device_get of count {count}"))?;
        // Out of bounds: an error naming the peer, nothing moved.
        for (op, r) in [
            ("device_put", w.device_put(src.all(), right, size * count, None)),
            ("device_get", w.device_get(back.all(), right, size * count - count / 2, None)),
        ] {
            match r {
                Err(e @ Error::Bounds { .. }) => {
                    let m = e.to_string();
                    ensure(m.contains(op) && m.contains(&format!("rank {right}")), || m.clone())?;
                }
                other => return Err(format!("{op} out of bounds, count {count}: {other:?}")),
            }
        }
        let (_, len) = w.map_remote_device(right).map_err(s)?;
        ensure(len == size * count * 4, || format!("map_remote_device length {len}"))?;
        g.barrier(None).map_err(s)?;
        let mem = w.tensor_deregister_device().map_err(s)?;
        ensure(mem.is_some_and(|m| m.len() == size * count * 4), || "deregister gives the memory back".into())?;
    }
    graph(g, &mut w, ctx, &stream)?;
    graph_signals(g, ctx)?;
    two_windows_one_allocation(g, ctx)?;
    eprintln!("device ring: {:?}", start.elapsed());
    Ok(())
}

/// Synchronizes the stream, or fails after 30 s (a stream-ordered wait
/// whose signal never comes would block forever).
fn wait_stream(stream: &Stream, what: &dyn Fn() -> String) -> R {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::scope(|sc| {
        sc.spawn(move || {
            let _ = tx.send(stream.synchronize());
        });
        match rx.recv_timeout(Duration::from_secs(30)) {
            Ok(r) => r.map_err(|e| format!("{}: {e}", what())),
            Err(_) => {
                eprintln!("{}: the stream did not finish in 30 s (a signal never came)", what());
                std::process::exit(1);
            }
        }
    })
}

/// A put captured in a CUDA graph, replayed 10 times with new data each
/// time; host-ordered signals between replays.
fn graph(g: &Group, w: &mut Window, ctx: &Arc<Context>, stream: &Stream) -> R {
    let (rank, size) = (g.rank(), g.size());
    let (right, left) = ((rank + 1) % size, (rank + size - 1) % size);
    const COUNT: usize = 4096;
    w.tensor_register_device(tensor_mem(ctx, size * COUNT * 4).map_err(s)?, 4).map_err(s)?;
    let src = ctx.alloc_shared(COUNT * 4).map_err(s)?;
    stream.begin_capture().map_err(s)?;
    let put = w.device_put(src.all(), right, rank * COUNT, Some(stream));
    let graph = stream.end_capture().map_err(s)?;
    put.map_err(|e| format!("device_put under capture: {e}"))?;
    for i in 0..10 {
        let what = || format!("graph replay {i}");
        let value = |r: usize| 7000 + r * 100 + i;
        src.write_from(0, &f32s(value(rank), COUNT)).map_err(s)?;
        // SAFETY: `src` and the registration (the peer's mapped memory) live
        // until after the last replay.
        #[allow(unsafe_code)]
        unsafe { graph.launch(stream) }.map_err(s)?;
        wait_stream(stream, &what)?;
        w.signal(right, false).map_err(s)?;
        w.wait_signal(left, None).map_err(s)?;
        check(w, left, COUNT, value(left), &what)?;
        g.barrier(None).map_err(s)?;
    }
    drop(graph);
    w.tensor_deregister_device().map_err(s)?;
    Ok(())
}

/// Whether NVRTC, which compiles the signal kernels of CUDA graphs, is
/// missing (CI's first stage): then `what` is skipped with the reason, and
/// an error where it is expected (`RMACOMM_EXPECT_NVRTC=1`: the GPU suite).
fn nvrtc_missing(g: &Group, what: &str) -> Result<bool, String> {
    let Err(e) = rmacomm_window::cuda::nvrtc::Nvrtc::get() else { return Ok(false) };
    if std::env::var("RMACOMM_EXPECT_NVRTC").is_ok_and(|v| v == "1") {
        return Err(format!("signals in a CUDA graph need NVRTC: {e}"));
    }
    println!("rank {} {what} skipped (no NVRTC: {e})", g.rank());
    Ok(true)
}

/// A ring step captured whole — put, stream signal, stream wait — and
/// replayed 10 times with new data each time, nothing on the host between
/// replays but a barrier. A stream round before the capture (stream memory
/// operations), one after it (kernels now), a host wait for a stream
/// signal and a last stream round check that the counts carry over.
fn graph_signals(g: &Group, ctx: &Arc<Context>) -> R {
    if nvrtc_missing(g, "graph signals")? {
        return Ok(());
    }
    let (rank, size) = (g.rank(), g.size());
    let (right, left) = ((rank + 1) % size, (rank + size - 1) % size);
    const COUNT: usize = 4096;
    let stream = ctx.stream().map_err(s)?;
    let mut w = Window::new(g, WindowOptions::new().timeout(Duration::from_secs(30))).map_err(s)?;
    w.tensor_register_device(tensor_mem(ctx, size * COUNT * 4).map_err(s)?, 4).map_err(s)?;
    let src = ctx.alloc_shared(COUNT * 4).map_err(s)?;
    let round = |w: &Window, what: &str| -> R {
        w.signal_on_stream(right, &stream).map_err(s)?;
        w.wait_signal_on_stream(left, &stream).map_err(s)?;
        wait_stream(&stream, &|| what.to_string())
    };
    round(&w, "a stream round before the capture")?;
    stream.begin_capture().map_err(s)?;
    let captured = w
        .device_put(src.all(), right, rank * COUNT, Some(&stream))
        .and_then(|()| w.signal_on_stream(right, &stream))
        .and_then(|()| w.wait_signal_on_stream(left, &stream));
    let graph = stream.end_capture().map_err(s)?;
    captured.map_err(|e| format!("put / signal / wait under capture: {e}"))?;
    for i in 0..10 {
        let what = || format!("graph replay {i} of put + signal + wait");
        let value = |r: usize| 9000 + r * 100 + i;
        src.write_from(0, &f32s(value(rank), COUNT)).map_err(s)?;
        // SAFETY: `src`, the registration and the window's signal memory
        // live until after the last replay has run.
        #[allow(unsafe_code)]
        unsafe { graph.launch(&stream) }.map_err(s)?;
        wait_stream(&stream, &what)?;
        check(&w, left, COUNT, value(left), &what)?;
        g.barrier(None).map_err(s)?;
    }
    drop(graph);
    round(&w, "a stream round after the capture")?;
    // A stream signal taken by a host wait: both count the same signals.
    w.signal_on_stream(right, &stream).map_err(s)?;
    wait_stream(&stream, &|| "a stream signal before a host wait".into())?;
    w.wait_signal(left, None).map_err(|e| format!("a host wait after the capture: {e}"))?;
    round(&w, "a stream round after a host wait")?;
    g.barrier(None).map_err(s)?;
    w.tensor_deregister_device().map_err(s)?;
    // The counts the device kept go back to the host for the window's
    // next registration (stream memory operations again, where there are).
    w.tensor_register_device(tensor_mem(ctx, size * COUNT * 4).map_err(s)?, 4).map_err(s)?;
    round(&w, "a stream round in the next registration")?;
    w.signal(right, false).map_err(s)?;
    w.wait_signal(left, None).map_err(|e| format!("a host round in the next registration: {e}"))?;
    g.barrier(None).map_err(s)?;
    w.tensor_deregister_device().map_err(s)?;
    Ok(())
}

/// Two windows at once over the two halves of one allocation per rank (as
/// PyTorch's caching allocator places tensors in one segment): each peer's
/// allocation is opened once in this process and shared by both windows.
#[allow(unsafe_code)]
fn two_windows_one_allocation(g: &Group, ctx: &Arc<Context>) -> R {
    let (rank, size) = (g.rank(), g.size());
    let (right, left) = ((rank + 1) % size, (rank + size - 1) % size);
    const COUNT: usize = 256;
    let half = size * COUNT * 4;
    let mem = tensor_mem(ctx, 2 * half)?;
    let mut wins = Vec::new();
    for h in 0..2 {
        let mut w = Window::new(g, WindowOptions::new().timeout(Duration::from_secs(30))).map_err(s)?;
        // SAFETY: `mem` outlives both windows (deregistered below first).
        unsafe { w.tensor_register_device_ptr(ctx.clone(), mem.ptr() + (h * half) as u64, half, 4) }
            .map_err(|e| format!("window {h} over half {h} of one allocation: {e}"))?;
        wins.push(w);
    }
    let src = ctx.alloc_shared(COUNT * 4).map_err(s)?;
    for (h, w) in wins.iter().enumerate() {
        src.write_from(0, &f32s(rank * 10 + h + 1, COUNT)).map_err(s)?;
        w.device_put(src.all(), right, rank * COUNT, None).map_err(s)?;
        w.signal(right, false).map_err(s)?;
        w.wait_signal(left, None).map_err(s)?;
        let mut got = vec![0u8; COUNT * 4];
        mem.read_into(h * half + left * COUNT * 4, &mut got).map_err(s)?;
        ensure(got == f32s(left * 10 + h + 1, COUNT), || format!("window {h} over one allocation: wrong data"))?;
    }
    g.barrier(None).map_err(s)?;
    for mut w in wins {
        w.tensor_deregister_device().map_err(s)?;
    }
    Ok(())
}

/// Signal round trips between ranks 0 and 1, µs per round trip (scenario
/// docs).
fn lat(g: &Group, mut w: Window, ctx: &Arc<Context>) -> R {
    let rank = g.rank();
    ensure(g.size() == 2, || "lat runs on 2 ranks".into())?;
    let peer = 1 - rank;
    w.tensor_register_device(tensor_mem(ctx, 4096).map_err(s)?, 1).map_err(s)?;
    let stream = ctx.stream().map_err(s)?;
    let what = || "stream round trips".to_string();
    let host = |w: &Window| -> R {
        if rank == 0 {
            w.signal(peer, false).map_err(s)?;
            w.wait_signal(peer, None).map_err(s)
        } else {
            w.wait_signal(peer, None).map_err(s)?;
            w.signal(peer, false).map(drop).map_err(s)
        }
    };
    let queued = |w: &Window| -> R {
        if rank == 0 {
            w.signal_on_stream(peer, &stream).map_err(s)?;
            w.wait_signal_on_stream(peer, &stream).map_err(s)
        } else {
            w.wait_signal_on_stream(peer, &stream).map_err(s)?;
            w.signal_on_stream(peer, &stream).map_err(s)
        }
    };
    let mut row = Vec::new();
    for (name, iters) in [("host_us", 2000usize), ("stream_synced_us", 300), ("stream_queued_us", 1000)] {
        g.barrier(None).map_err(s)?;
        let t = Instant::now();
        for _ in 0..iters {
            match name {
                "host_us" => host(&w)?,
                "stream_synced_us" => {
                    queued(&w)?;
                    wait_stream(&stream, &what)?;
                }
                _ => queued(&w)?,
            }
        }
        wait_stream(&stream, &what)?;
        row.push(format!("\"{name}\":{:.2}", t.elapsed().as_secs_f64() * 1e6 / iters as f64));
    }
    if rank == 0 {
        println!("{{\"test\":\"window_device_signal_rtt\",{},\"device\":\"{}\"}}", row.join(","), ctx.name());
    }
    g.barrier(None).map_err(s)?;
    w.tensor_deregister_device().map_err(s)?;
    Ok(())
}

/// Seconds for `iters` runs of `f` and then `finish` (waiting for what was
/// queued), after two warm-up runs.
fn timed(iters: usize, mut f: impl FnMut() -> R, finish: impl Fn() -> R) -> Result<f64, String> {
    f()?;
    f()?;
    finish()?;
    let t = Instant::now();
    for _ in 0..iters {
        f()?;
    }
    finish()?;
    Ok(t.elapsed().as_secs_f64())
}

fn bw(g: &Group, mut w: Window, ctx: &Arc<Context>, max: Result<usize, String>) -> R {
    let rank = g.rank();
    ensure(g.size() == 2, || "bw runs on 2 ranks".into())?;
    let max = max?;
    ensure(max >= 64 << 10, || "MAX_BYTES is at least 64 KiB".into())?;
    // Bytes moved per point: 8 GiB at the default, less for a small MAX.
    let budget = (8usize << 30).min(max * 64);
    w.tensor_register_device(tensor_mem(ctx, max).map_err(s)?, 1).map_err(s)?;
    g.barrier(None).map_err(s)?;
    if rank == 0 {
        let src: DeviceMemory = ctx.alloc_shared(max).map_err(s)?;
        let stream = ctx.stream().map_err(s)?;
        let mut size = 64usize << 10;
        while size <= max {
            let iters = (budget / size).clamp(10, 2000);
            let v = src.view(0, size).expect("fits");
            let done = || stream.synchronize().map_err(s);
            let sync = timed(iters, || w.device_put(v, 1, 0, None).map_err(s), done)?;
            let queued = timed(iters, || w.device_put(v, 1, 0, Some(&stream)).map_err(s), done)?;
            // The ceiling in the same run: the same copies into this rank's
            // own registered memory (a plain cuMemcpyDtoDAsync, no IPC).
            let ceiling = timed(iters, || w.device_put(v, 0, 0, Some(&stream)).map_err(s), done)?;
            let gbps = |t: f64| (size * iters) as f64 / t / 1e9;
            println!(
                "{{\"test\":\"window_device_put\",\"bytes\":{size},\"sync_GBps\":{:.2},\"stream_GBps\":{:.2},\
                 \"local_GBps\":{:.2},\"stream_ratio\":{:.3},\"device\":\"{}\"}}",
                gbps(sync),
                gbps(queued),
                gbps(ceiling),
                gbps(queued) / gbps(ceiling),
                ctx.name()
            );
            size *= 4;
        }
    }
    g.barrier(None).map_err(s)?;
    w.tensor_deregister_device().map_err(s)?;
    Ok(())
}

/// The stream proxy between the ranks (scenario docs).
/// Ranks on several GPUs (`GPU_PER_RANK=1`): where the GPUs reach
/// each other, the device ring through CUDA IPC across them; where they do
/// not (`RMACOMM_STANDIN_P2P=0`), `tensor_register_device` is
/// `Error::Unreachable` on every rank, naming the same rank, and the ring
/// on a stream goes through the transport on the same (UNIFIED) window,
/// every byte checked.
fn gpus(g: &Group, mut w: Window, ctx: &Arc<Context>) -> R {
    if std::env::var("RMACOMM_STANDIN_P2P").map_or(true, |v| v != "0") {
        println!("gpus: rank {} on cuda:{}, through CUDA IPC", g.rank(), ctx.ordinal());
        return ring(g, w, ctx);
    }
    match w.tensor_register_device(tensor_mem(ctx, 1 << 20)?, 4) {
        Err(e @ Error::Unreachable { rank: 0, .. }) => println!("gpus: rank {} refused: {e}", g.rank()),
        other => return Err(format!("tensor_register_device across GPUs without peer access: {other:?}")),
    }
    let stream = ctx.stream().map_err(s)?;
    stream_ring(g, &mut w, &stream, false)?;
    println!("gpus: rank {} on cuda:{}, through the transport", g.rank(), ctx.ordinal());
    Ok(())
}

fn proxy(g: &Group, ctx: &Arc<Context>) -> R {
    let opts = WindowOptions::new().timeout(Duration::from_secs(30)).unified(false);
    let mut w = Window::new(g, opts).map_err(s)?;
    let stream = ctx.stream().map_err(s)?;
    let start = Instant::now();
    stream_ring(g, &mut w, &stream, true)?;
    eprintln!("proxy ring: {:?}", start.elapsed());
    proxy_timings(g, &mut w, ctx, &stream)
}

/// The ring ordered on `stream` through the transport (device memory
/// registered with `tensor_register`): `put_on_stream`, `signal_on_stream`,
/// `wait_signal_on_stream`, `get_on_stream` for 4 KiB, 1 MiB and 16 MiB,
/// every byte checked; `ipc`: the soft provider opens every peer's tensor
/// through CUDA IPC at registration (else it stages every transfer).
fn stream_ring(g: &Group, w: &mut Window, stream: &Stream, ipc: bool) -> R {
    let (rank, size) = (g.rank(), g.size());
    let (right, left) = ((rank + 1) % size, (rank + size - 1) % size);
    for count in [4096usize, 1 << 20, 16 << 20] {
        let before = rmacomm_window::cuda::device::ipc_mappings_open();
        w.tensor_register(w.alloc_cuda(size * count, 0).map_err(s)?, 1).map_err(s)?;
        // Every peer's tensor is opened by the registration, not by the
        // first operation (which a stream would be waiting for).
        let opened = rmacomm_window::cuda::device::ipc_mappings_open();
        ensure(!ipc || before > 0 || opened == size - 1, || {
            format!("{opened} peer allocations open after the first tensor_register, want {}", size - 1)
        })?;
        let src = Arc::new(w.alloc_cuda(count, 0).map_err(s)?);
        let back = Arc::new(w.alloc_cuda(count, 0).map_err(s)?);
        for it in 0..3 {
            let data = |r: usize| (0..count).map(|i| (i * 7 + r * 31 + it * 3 + i / 4096) as u8).collect::<Vec<u8>>();
            let what = || format!("proxy ring: {count} bytes, iteration {it}");
            let fail = |e: Error| format!("{}: {e}", what());
            src.write_from(0, &data(rank)).map_err(s)?;
            let put = w.put_on_stream(src.clone(), 0, count, right, rank * count, stream).map_err(fail)?;
            w.signal_on_stream(right, stream).map_err(fail)?;
            w.wait_signal_on_stream(left, stream).map_err(fail)?;
            let get = w.get_on_stream(back.clone(), 0, count, right, rank * count, stream).map_err(fail)?;
            wait_stream(stream, &what)?;
            put.wait(None).map_err(fail)?;
            get.wait(None).map_err(fail)?;
            let mut got = vec![0u8; count];
            w.local_tensor().expect("registered").read_into(left * count, &mut got).map_err(s)?;
            ensure(got == data(left), || format!("{}: what rank {left} put is wrong", what()))?;
            back.read_into(0, &mut got).map_err(s)?;
            ensure(got == data(rank), || format!("{}: the get from rank {right} is wrong", what()))?;
            g.barrier(None).map_err(s)?;
        }
        drop((src, back));
        w.tensor_deregister().map_err(s)?;
    }
    Ok(())
}

fn proxy_timings(g: &Group, w: &mut Window, ctx: &Arc<Context>, stream: &Stream) -> R {
    let (rank, size) = (g.rank(), g.size());
    if let Some(e) = w.stream_error() {
        return Err(format!("a stream operation failed: {e}"));
    }
    if size != 2 {
        return Ok(());
    }
    let peer = 1 - rank;
    let what = || "proxy timings".to_string();
    // Bandwidth: rank 0's puts into rank 1, queued on a stream, then the
    // same puts from the host (each complete before the next).
    const BYTES: usize = 16 << 20;
    const PUTS: usize = 20;
    w.tensor_register(w.alloc_cuda(BYTES, 0).map_err(s)?, 1).map_err(s)?;
    let src = Arc::new(w.alloc_cuda(BYTES, 0).map_err(s)?);
    if rank == 0 {
        let queued = timed(
            PUTS,
            || w.put_on_stream(src.clone(), 0, BYTES, 1, 0, stream).map(drop).map_err(s),
            || wait_stream(stream, &what),
        )?;
        let view = || src.view(0, BYTES).map_err(s);
        let host = timed(PUTS, || w.put(view()?, 1, 0, false).map(drop).map_err(s), || Ok(()))?;
        let mbps = |secs: f64| (PUTS * BYTES) as f64 / secs / 1e6;
        println!(
            "{{\"test\":\"window_proxy_put\",\"bytes\":{BYTES},\"stream_MBps\":{:.0},\"host_MBps\":{:.0},\"device\":\"{}\"}}",
            mbps(queued),
            mbps(host),
            ctx.name()
        );
    }
    g.barrier(None).map_err(s)?;
    // Signal round trips: through the proxy, queued 1000 deep (the streams
    // hand off between the ranks' proxies alone), then host signals.
    let mut row = Vec::new();
    for (name, iters) in [("stream_queued_us", 1000usize), ("host_us", 1000)] {
        g.barrier(None).map_err(s)?;
        let t = Instant::now();
        for _ in 0..iters {
            let signal = || match name {
                "host_us" => w.signal(peer, false).map(drop),
                _ => w.signal_on_stream(peer, stream),
            };
            let wait = || match name {
                "host_us" => w.wait_signal(peer, None),
                _ => w.wait_signal_on_stream(peer, stream),
            };
            if rank == 0 {
                signal().and_then(|()| wait()).map_err(s)?;
            } else {
                wait().and_then(|()| signal()).map_err(s)?;
            }
        }
        wait_stream(stream, &what)?;
        row.push(format!("\"{name}\":{:.2}", t.elapsed().as_secs_f64() * 1e6 / iters as f64));
    }
    if rank == 0 {
        println!("{{\"test\":\"window_proxy_signal_rtt\",{},\"device\":\"{}\"}}", row.join(","), ctx.name());
    }
    g.barrier(None).map_err(s)?;
    drop(src);
    w.tensor_deregister().map_err(s)?;
    if let Some(e) = w.stream_error() {
        return Err(format!("a stream operation failed: {e}"));
    }
    Ok(())
}

/// `nccl` under `NCCL_SCENARIO_STUCK_SIGNAL=1` (module docs).
fn nccl_stuck_signal(
    g: &Group,
    ctx: &Arc<Context>,
    mut rma: rmacomm_window::nccl_rma::NcclRma,
    stream: Stream,
    src: rmacomm_window::nccl_rma::WindowId,
    dst: rmacomm_window::nccl_rma::WindowId,
    len: usize,
) -> R {
    let rank = g.rank();
    if g.size() != 2 {
        return Err("NCCL_SCENARIO_STUCK_SIGNAL runs on two ranks".into());
    }
    rma.set_timeout(Duration::from_secs(3));
    if rank == 0 {
        // A host word the stream waits on and nobody writes: leaked, so it
        // outlives everything the process does (the stream never gets past
        // it).
        let word: &'static std::sync::atomic::AtomicU64 = Box::leak(Box::new(std::sync::atomic::AtomicU64::new(0)));
        #[allow(unsafe_code)]
        // SAFETY: the word is leaked (lives as long as the process).
        let reg = unsafe { ctx.register_host(word.as_ptr().cast(), 8) }.map_err(s)?;
        let reg = Box::leak(Box::new(reg));
        #[allow(unsafe_code)]
        // SAFETY: a registered host word, never freed.
        unsafe { stream.wait_value64_geq(reg.device_ptr(), 1) }.map_err(s)?;
        rma.put(src, 0, len, 1, dst, 0, &stream).map_err(s)?;
        rma.signal(1, &stream).map_err(s)?;
        println!("rank 0: a put and a signal queued behind a stream wait that never ends");
    } else {
        rma.wait_signal(0, &stream).map_err(s)?;
    }
    let start = Instant::now();
    match rma.deregister(g, dst) {
        Err(e @ Error::Timeout { .. }) if e.to_string().contains("deregister") => {
            println!("rank {rank}: deregister failed after {:?}: {e}", start.elapsed());
        }
        other => return Err(format!("a deregistration behind a wait that never ends: {other:?}")),
    }
    let start = Instant::now();
    drop(rma);
    println!("rank {rank}: dropped the NcclRma in {:?}", start.elapsed());
    if rank == 1 {
        wait_stream(&stream, &|| "rank 1's stream after the drop".to_string())?;
        println!("rank 1: its stream is free again");
    } else {
        // Still waiting, for good: the stand-in's cuStreamDestroy would wait
        // for it (CUDA's returns at once).
        std::mem::forget(stream);
    }
    g.barrier(None).map_err(s)
}

/// NCCL's window API through `NcclRma` (module docs: `nccl`).
fn nccl(g: &Group, ctx: &Arc<Context>) -> R {
    use rmacomm_window::cuda::nccl::{Flavor, Library};
    use rmacomm_window::cuda::nccl_comm::{self, NcclComm, UniqueId};
    use rmacomm_window::nccl_rma::NcclRma;

    let (rank, size) = (g.rank(), g.size());
    let (right, left) = ((rank + 1) % size, (rank + size - 1) % size);
    let lib = Arc::new(Library::load(Flavor::Nccl).map_err(s)?);
    let id = if rank == 0 {
        nccl_comm::unique_id(&lib).map_err(s)?.0.iter().map(|b| format!("{b:02x}")).collect::<String>()
    } else {
        String::new()
    };
    let all = g.exchange("nccl_id", id.as_bytes()).map_err(s)?;
    let mut raw = [0u8; 128];
    for (i, b) in raw.iter_mut().enumerate() {
        *b = u8::from_str_radix(std::str::from_utf8(&all[0][2 * i..2 * i + 2]).map_err(s)?, 16).map_err(s)?;
    }
    let comm = NcclComm::init(lib.clone(), ctx.clone(), &UniqueId(raw), rank, size, g.timeout()).map_err(s)?;
    let mut rma = match NcclRma::new(comm, g, Duration::from_secs(60)) {
        Ok(r) => r,
        Err(e) => {
            println!("rank {rank} refused: {e}");
            return Ok(());
        }
    };
    let stream = ctx.stream().map_err(s)?;
    let count = 4096usize;
    // NCCL windows are cuMem/VMM memory, one size on every rank.
    let vmm = |len: usize| ctx.alloc_vmm(len, 2 << 20).map(Arc::new).map_err(s);
    let dst_mem = vmm(size * count * 4)?;
    let dst = rma.register(g, dst_mem.clone()).map_err(s)?;
    let aux_mem = vmm(size * count * 4)?;
    let aux = rma.register(g, aux_mem.clone()).map_err(s)?;
    let src_mem = vmm(count * 4)?;
    let src = rma.register(g, src_mem.clone()).map_err(s)?;
    if std::env::var("NCCL_SCENARIO_PUT_FAILS").is_ok_and(|v| v == "1") {
        // The library fails every put: the NcclRma is broken after the
        // first, and says so for every later call, on every rank.
        match rma.put(src, 0, 4, right, dst, 0, &stream) {
            Err(e) if e.to_string().contains("put (ncclPutSignal)") => {}
            other => return Err(format!("a failing put: {other:?}")),
        }
        match rma.signal(right, &stream) {
            Err(e) if e.to_string().contains("earlier stream operation") => {}
            other => return Err(format!("a signal after a failed put: {other:?}")),
        }
        match rma.register(g, vmm(4096)?) {
            Err(e) if e.to_string().contains("an earlier NCCL call") => {}
            other => return Err(format!("a registration after a failed put: {other:?}")),
        }
        println!("rank {rank}: a failed put broke the NcclRma");
        return Ok(());
    }
    if std::env::var("NCCL_SCENARIO_STUCK_SIGNAL").is_ok_and(|v| v == "1") {
        return nccl_stuck_signal(g, ctx, rma, stream, src, dst, count * 4);
    }
    // The gate: a host word rank 0's stream waits on; opened on every way
    // out (a stream must not be left waiting on unregistered memory).
    struct Gate(Box<std::sync::atomic::AtomicU64>);
    impl Drop for Gate {
        fn drop(&mut self) {
            self.0.store(u64::MAX, std::sync::atomic::Ordering::SeqCst);
        }
    }
    let gate = Box::new(std::sync::atomic::AtomicU64::new(0));
    #[allow(unsafe_code)]
    // SAFETY: the word outlives the registration (the guard below opens
    // it, then the registration drops, then the word).
    let gate_reg = unsafe { ctx.register_host(gate.as_ptr().cast(), 8) }.map_err(s)?;
    let gate = Gate(gate);
    let start = Instant::now();
    let check_from = |mem: &DeviceMemory, from: usize, want: usize, what: &str| -> R {
        let mut got = vec![0u8; count * 4];
        mem.read_into(from * count * 4, &mut got).map_err(s)?;
        let expect = f32s(want, count);
        match got.chunks(4).zip(expect.chunks(4)).position(|(a, b)| a != b) {
            None => Ok(()),
            Some(bad) => {
                Err(format!("{what}: element {bad} from rank {from} is {:?}, want {want}", &got[bad * 4..][..4]))
            }
        }
    };
    for round in 0..3usize {
        let value = |r: usize| 1000 * round + r + 1;
        let what = || format!("NCCL window ring, round {round}");
        let fail = |e: Error| format!("{}: {e}", what());
        src_mem.write_from(0, &f32s(value(rank), count)).map_err(s)?;
        // To the left, into the other window: two destinations (from 3
        // ranks) and two target windows count apart.
        rma.put(src, 0, count * 4, left, aux, rank * count * 4, &stream).map_err(fail)?;
        let pieces = round + 1;
        let per = count.div_ceil(pieces);
        for p in 0..pieces {
            let (a, b) = (p * per, ((p + 1) * per).min(count));
            if p == pieces - 1 && pieces > 1 && rank == 0 && size > 1 {
                // Rank 0's last piece runs only when its host opens the
                // gate, after it has queued its signal and paused: rank 1
                // waits for it, and a wait that passed early (counting
                // NCCL's signals wrong) reads the old data meanwhile. (Not
                // with one rank: its own wait follows on the same stream.)
                #[allow(unsafe_code)]
                // SAFETY: a registered host word, live until the stream
                // is synchronized (below).
                unsafe { stream.wait_value64_geq(gate_reg.device_ptr(), round as u64) }.map_err(s)?;
            }
            rma.put(src, a * 4, (b - a) * 4, right, dst, (rank * count + a) * 4, &stream).map_err(fail)?;
        }
        rma.signal(right, &stream).map_err(fail)?;
        if left != right {
            rma.signal(left, &stream).map_err(fail)?;
        }
        if pieces > 1 && rank == 0 && size > 1 {
            std::thread::sleep(Duration::from_millis(300));
            gate.0.store(round as u64, std::sync::atomic::Ordering::SeqCst);
        }
        rma.wait_signal(left, &stream).map_err(fail)?;
        if left != right {
            rma.wait_signal(right, &stream).map_err(fail)?;
        }
        wait_stream(&stream, &what)?;
        check_from(&dst_mem, left, value(left), &what())?;
        check_from(&aux_mem, right, value(right), &format!("{} (the other window)", what()))?;
        g.barrier(None).map_err(s)?;
    }
    drop(gate);
    drop(gate_reg);
    let refused = |what: &str, r: Result<(), Error>, want: &str| -> R {
        match r {
            Err(e) if e.to_string().contains(want) => Ok(()),
            other => Err(format!("{what}: {other:?}, want an error saying {want:?}")),
        }
    };
    let (dlen, slen) = (dst_mem.len(), src_mem.len());
    refused("a rank outside", rma.put(src, 0, 4, size, dst, 0, &stream), "not below the communicator's size")?;
    refused("past the peer's buffer", rma.put(src, 0, 8, right, dst, dlen - 4, &stream), "out of bounds")?;
    refused("past the source", rma.put(src, slen - 4, 8, right, dst, 0, &stream), "past this rank's")?;
    let gone = rma.register(g, vmm(4096)?).map_err(s)?;
    rma.deregister(g, gone).map_err(s)?;
    refused("a deregistered window", rma.put(src, 0, 4, right, gone, 0, &stream), "not registered")?;
    // Collective refusals, on every rank before NCCL is called.
    refused("memory in a window already", rma.register(g, dst_mem.clone()).map(drop), "overlaps one of its windows")?;
    let plain = Arc::new(ctx.alloc_shared(4096).map_err(s)?);
    refused("cuMemAlloc memory", rma.register(g, plain).map(drop), "not cuMem/VMM memory")?;
    if size > 1 {
        let uneven = vmm(if rank == 0 { 4 << 20 } else { 2 << 20 })?;
        refused("buffers of different sizes", rma.register(g, uneven).map(drop), "NCCL windows are one size")?;
    }
    rma.set_timeout(Duration::from_secs(2));
    refused("a signal never sent", rma.wait_signal(left, &stream), &format!("from rank {left}"))?;
    g.barrier(None).map_err(s)?;
    for w in [src, aux, dst] {
        rma.deregister(g, w).map_err(s)?;
    }
    println!("rank {rank}: NCCL windows ({}) ring of 3 rounds and refusals in {:?}", rma.library(), start.elapsed());
    Ok(())
}
