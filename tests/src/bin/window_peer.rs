//! A window rank for the two-"host" tests (`tests/window_netns.rs`): one
//! process per network namespace, its group set up by hand from `RANK`,
//! `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR` and
//! `MASTER_PORT` (rank 0 hosts the `TcpStore`).
//!
//! `window_peer RING_ITERS`: checks that the TcpStore works across the
//! namespaces, that the peer is another host and SEPARATE (`get_attr`,
//! `map_remote_tensor` refused naming it), then runs the window ring (put +
//! signal / wait_signal, 1 Mi f32 and 4 i8 elements, sync and async) and
//! gets of the peer's buffer, checking every element, and the ctran form
//! (allocate, SET behind a put, ADDs, wait_signal_until, get_tensor refused
//! for the other host); with `WINDOW_PEER_MEM=cuda` also the ring ordered
//! on a CUDA stream (the window's stream proxy). Prints one line per
//! step and `rank R ok` at the end; on any failure `rank R FAILED: why`
//! and exit status 1. `WINDOW_PEER_DAMAGE=R`: rank R flips a byte of what
//! it received before checking it (to show that the check fails).

#![forbid(unsafe_code)]

use std::time::{Duration, Instant};

use rmacomm_window::{AccessType, Cmp, Error, Group, GroupOptions, SignalOp, Window, WindowOptions};

type R = Result<(), String>;

fn s<E: std::fmt::Display>(e: E) -> String {
    e.to_string()
}

fn ensure(cond: bool, msg: impl FnOnce() -> String) -> R {
    if cond {
        Ok(())
    } else {
        Err(msg())
    }
}

fn main() {
    let filter = std::env::var("RMACOMM_LOG").unwrap_or_else(|_| "warn".into());
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).try_init();
    let iters: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(4);
    let rank = std::env::var("RANK").unwrap_or_default();
    let fail = |e: String| -> ! {
        // On both streams: the test reads stdout, a person stderr. Exits
        // without dropping the group: rank 0's store would linger (up to
        // 30 s) for a peer that waits on it, while exiting cuts the peer's
        // store connection at once.
        println!("rank {rank} FAILED: {e}");
        eprintln!("rank {rank} FAILED: {e}");
        std::process::exit(1);
    };
    let g = Group::from_env_with(GroupOptions::new().timeout(Duration::from_secs(60))).unwrap_or_else(|e| fail(s(e)));
    match run(&g, iters) {
        Ok(()) => println!("rank {rank} ok"),
        Err(e) => fail(e),
    }
}

fn run(g: &Group, iters: usize) -> R {
    let t0 = Instant::now();
    let (rank, size) = (g.rank(), g.size());
    ensure(size == 2, || format!("this test runs 2 ranks, WORLD_SIZE says {size}"))?;
    let peer = 1 - rank;
    ensure(!g.same_host(peer) && g.local_size() == 1, || {
        format!(
            "rank {peer} should be on another host (network namespace): host ids {:?} and {:?}",
            g.host_id(rank),
            g.host_id(peer)
        )
    })?;
    store_across_hosts(g)?;
    println!("store ok");

    let mut w = Window::new(g, WindowOptions::new().timeout(Duration::from_secs(30))).map_err(s)?;
    let attr = w.get_attr(peer).map_err(s)?;
    ensure(attr.access_type == AccessType::Separate, || format!("get_attr({peer}) is {attr:?}, not Separate"))?;
    println!("attr {peer}: separate");

    ring(g, &mut w, iters)?;
    gets(g, &mut w)?;
    stream_ring(g, &mut w, iters)?;
    ctran(g)?;
    println!("done in {:?}", t0.elapsed());
    Ok(())
}

/// Both ranks write through the store hosted in rank 0's namespace, wait
/// for each other's keys (1 MiB values), and count with `add`.
fn store_across_hosts(g: &Group) -> R {
    let store = g.store();
    let value = |r: usize| (0..1 << 20).map(|i: usize| (i * 7 + r * 13) as u8).collect::<Vec<u8>>();
    store.set(&format!("netns/{}", g.rank()), &value(g.rank())).map_err(s)?;
    let got = store.multi_get(&["netns/0", "netns/1"], Duration::from_secs(30)).map_err(s)?;
    for (r, v) in got.iter().enumerate() {
        ensure(*v == value(r), || format!("store value of rank {r} came back wrong ({} bytes)", v.len()))?;
    }
    store.add("netns/count", 1).map_err(s)?;
    store.wait(&["netns/count"], Duration::from_secs(30)).map_err(s)?;
    g.barrier(None).map_err(s)?;
    let n = store.add("netns/count", 0).map_err(s)?;
    ensure(n == 2, || format!("the store counted {n} ranks, not 2"))
}

/// A buffer of the window's: host memory, or CUDA device memory (GPU 0)
/// when `WINDOW_PEER_MEM=cuda` (then every byte crosses through the
/// transport's device staging).
fn alloc(w: &Window, len: usize) -> Result<rmacomm_transport::RdmaMemory, String> {
    if std::env::var("WINDOW_PEER_MEM").is_ok_and(|v| v == "cuda") {
        let m = w.alloc_cuda(len, 0).map_err(s)?;
        ensure(m.device().is_some(), || "alloc_cuda gave host memory".to_string())?;
        Ok(m)
    } else {
        w.alloc(len).map_err(s)
    }
}

/// Element `i` of what `rank` puts in iteration `it`: differs per element,
/// rank and iteration, so a shifted, stale or foreign region shows.
fn elem(dtype: &str, rank: usize, it: usize, i: usize) -> Vec<u8> {
    match dtype {
        // Below 2^24: exact in f32.
        "f32" => (((rank * 500 + it * 50) << 12) as f32 + (i % 4093) as f32).to_le_bytes().to_vec(),
        "i8" => vec![(rank * 61 + it * 17 + i * 3) as i8 as u8],
        _ => unreachable!(),
    }
}

fn data(dtype: &str, rank: usize, it: usize, count: usize) -> Vec<u8> {
    (0..count).flat_map(|i| elem(dtype, rank, it, i)).collect()
}

/// torchcomms' ring on two ranks, i.e. both directions at once: each rank
/// puts `count` elements into the other's buffer at element offset
/// `rank * count`, signals it, waits for its signal and checks the region
/// the other wrote.
fn ring(g: &Group, w: &mut Window, iters: usize) -> R {
    let (rank, peer) = (g.rank(), 1 - g.rank());
    let damage: Option<usize> = std::env::var("WINDOW_PEER_DAMAGE").ok().and_then(|v| v.parse().ok());
    let t0 = Instant::now();
    let mut n = 0;
    for (count, dtype) in [(1usize << 20, "f32"), (4, "i8")] {
        let es = elem(dtype, 0, 0, 0).len();
        w.tensor_register(alloc(w, 2 * count * es)?, es).map_err(s)?;
        let src = alloc(w, count * es)?;
        // The peer's buffer cannot be mapped from another host. (Any error
        // kind: which one is the window's choice; it must name the peer.)
        match w.map_remote_tensor(peer) {
            Err(e) => {
                let msg = e.to_string();
                ensure(msg.contains(&format!("rank {peer}")), || format!("the error does not name the peer: {msg}"))?;
                println!("map_remote_tensor({peer}) refused: {msg}");
            }
            Ok(v) => return Err(format!("map_remote_tensor({peer}) mapped {} bytes of another host", v.len())),
        }
        for it in 0..iters {
            let (async_put, async_signal) = (it % 2 == 1, it % 4 >= 2);
            let what = || format!("{count} x {dtype}, iteration {it} (async put {async_put}, signal {async_signal})");
            src.write_from(0, &data(dtype, rank, it, count)).map_err(s)?;
            let put = w.put(src.view(0, count * es).map_err(s)?, peer, rank * count, async_put);
            let put = put.map_err(|e| format!("{}: put: {e}", what()))?;
            let sig = w.signal(peer, async_signal).map_err(|e| format!("{}: signal: {e}", what()))?;
            w.wait_signal(peer, None).map_err(|e| format!("{}: wait_signal: {e}", what()))?;
            if damage == Some(rank) {
                damage_one_byte(w, (peer * count + DAMAGED_ELEMENT) * es)?;
            }
            let mut got = vec![0u8; count * es];
            w.local_tensor().expect("registered").read_into(peer * count * es, &mut got).map_err(s)?;
            let want = data(dtype, peer, it, count);
            if got != want {
                let bad = got.chunks(es).zip(want.chunks(es)).position(|(a, b)| a != b).unwrap_or(0);
                return Err(format!(
                    "{}: element {bad} from rank {peer} is {:?}, expected {:?}",
                    what(),
                    &got[bad * es..(bad + 1) * es],
                    &want[bad * es..(bad + 1) * es]
                ));
            }
            put.wait(None).map_err(|e| format!("{}: put: {e}", what()))?;
            sig.wait(None).map_err(|e| format!("{}: signal: {e}", what()))?;
            // The peer must not overwrite the region before it is checked.
            g.barrier(None).map_err(s)?;
            n += 1;
        }
        drop(src);
        w.tensor_deregister().map_err(s)?;
    }
    println!("ring ok: {n} iterations in {:?}", t0.elapsed());
    Ok(())
}

/// With `WINDOW_PEER_MEM=cuda`: the ring ordered on a CUDA stream
/// (`put_on_stream`, `signal_on_stream`, `wait_signal_on_stream`,
/// `get_on_stream`), which the window's stream proxy runs across the hosts
/// at the stream's point; once the stream is synchronized, the peer's data
/// is in this rank's buffer and the get's in `back`.
fn stream_ring(g: &Group, w: &mut Window, iters: usize) -> R {
    if !std::env::var("WINDOW_PEER_MEM").is_ok_and(|v| v == "cuda") {
        return Ok(());
    }
    const COUNT: usize = (1 << 20) + 3;
    let (rank, peer) = (g.rank(), 1 - g.rank());
    let stream = rmacomm_window::cuda::driver::Context::open_shared(0).and_then(|c| c.stream()).map_err(s)?;
    w.tensor_register(alloc(w, 2 * COUNT)?, 1).map_err(s)?;
    let src = std::sync::Arc::new(alloc(w, COUNT)?);
    let back = std::sync::Arc::new(alloc(w, COUNT)?);
    for it in 0..iters {
        let what = |step: &str| format!("stream ring iteration {it}: {step}");
        src.write_from(0, &data("i8", rank, it, COUNT)).map_err(s)?;
        let put = w.put_on_stream(src.clone(), 0, COUNT, peer, rank * COUNT, &stream);
        let put = put.map_err(|e| format!("{}: {e}", what("put_on_stream")))?;
        w.signal_on_stream(peer, &stream).map_err(|e| format!("{}: {e}", what("signal_on_stream")))?;
        w.wait_signal_on_stream(peer, &stream).map_err(|e| format!("{}: {e}", what("wait_signal_on_stream")))?;
        let get = w.get_on_stream(back.clone(), 0, COUNT, peer, rank * COUNT, &stream);
        let get = get.map_err(|e| format!("{}: {e}", what("get_on_stream")))?;
        stream.synchronize().map_err(|e| format!("{}: {e}", what("synchronize")))?;
        put.wait(None).map_err(|e| format!("{}: {e}", what("put")))?;
        get.wait(None).map_err(|e| format!("{}: {e}", what("get")))?;
        let mut got = vec![0u8; COUNT];
        w.local_tensor().expect("registered").read_into(peer * COUNT, &mut got).map_err(s)?;
        ensure(got == data("i8", peer, it, COUNT), || what(&format!("what rank {peer} put is wrong")))?;
        back.read_into(0, &mut got).map_err(s)?;
        ensure(got == data("i8", rank, it, COUNT), || what(&format!("the get from rank {peer} is wrong")))?;
        g.barrier(None).map_err(s)?;
    }
    if let Some(e) = w.stream_error() {
        return Err(format!("stream ring: a stream operation failed: {e}"));
    }
    drop((src, back));
    w.tensor_deregister().map_err(s)?;
    println!("stream ring ok: {iters} iterations");
    Ok(())
}

/// Which element `WINDOW_PEER_DAMAGE` damages.
const DAMAGED_ELEMENT: usize = 3;

/// Test hook (`WINDOW_PEER_DAMAGE=RANK`): flips one byte of what the peer
/// put, so that the test can see the check fail.
fn damage_one_byte(w: &Window, at: usize) -> R {
    let mem = w.local_tensor().expect("registered");
    let mut b = [0u8];
    mem.read_into(at, &mut b).map_err(s)?;
    mem.write_from(at, &[b[0] ^ 0x20]).map_err(s)
}

/// Gets of the peer's registered buffer (sync and async, several offsets)
/// read exactly what it holds.
fn gets(g: &Group, w: &mut Window) -> R {
    const N: usize = (1 << 20) + 5;
    let (rank, peer) = (g.rank(), 1 - g.rank());
    let pattern = |r: usize| (0..N).map(|i| (i * 31 + r * 101 + i / 4096) as u8).collect::<Vec<u8>>();
    let mem = alloc(w, N)?;
    mem.write_from(0, &pattern(rank)).map_err(s)?;
    w.tensor_register_len(mem, N, 1).map_err(s)?;
    g.barrier(None).map_err(s)?;
    let dst = alloc(w, N)?;
    let theirs = pattern(peer);
    for (off, len, async_op) in [(0, N, false), (3, 4096, true), (N - 1, 1, false), (1000, 300_000, true)] {
        let work = w.get(dst.view_mut(0, len).map_err(s)?, peer, off, async_op).map_err(s)?;
        work.wait(None).map_err(s)?;
        let mut got = vec![0u8; len];
        dst.read_into(0, &mut got).map_err(s)?;
        ensure(got == theirs[off..off + len], || format!("get of {len} bytes at {off} from rank {peer}: wrong data"))?;
    }
    g.barrier(None).map_err(s)?;
    w.tensor_deregister().map_err(s)?;
    println!("get ok");
    Ok(())
}

/// The ctran form across the hosts: `allocate`, a put followed by a SET
/// value signal (the data is there when the value is), ADDs from both ranks
/// into both, `wait_signal_until` with EQ and GE, `get_tensor` of the peer
/// refused (SEPARATE), the own view readable.
fn ctran(g: &Group) -> R {
    let (rank, peer) = (g.rank(), 1 - g.rank());
    let w = Window::allocate(g, 1 << 20, 4, WindowOptions::new().timeout(Duration::from_secs(30))).map_err(s)?;
    ensure(w.get_size() == 1 << 20 && w.get_device() == "cpu", || "size/device".into())?;
    let src = w.alloc(1 << 20).map_err(s)?;
    for it in 1..=10u64 {
        src.write_from(0, &vec![(rank as u64 * 16 + it) as u8; 1 << 20]).map_err(s)?;
        let put = w.put(src.view(0, 1 << 20).map_err(s)?, peer, 0, it % 2 == 0).map_err(s)?;
        w.signal_value(0, it, peer, SignalOp::Set, it % 3 == 0).map_err(s)?;
        w.wait_signal_until(0, it, Cmp::Eq, None).map_err(|e| format!("ctran iter {it}: {e}"))?;
        let mut got = vec![0u8; 1 << 20];
        w.get_tensor(rank, 0, 1 << 20).map_err(s)?.read_into(0, &mut got).map_err(s)?;
        let want = (peer as u64 * 16 + it) as u8;
        ensure(got.iter().all(|b| *b == want), || format!("ctran iter {it}: the put before the SET is not there"))?;
        put.wait(None).map_err(s)?;
        for p in [rank, peer] {
            w.signal_value(1, 2, p, SignalOp::Add, false).map_err(s)?;
        }
        w.wait_signal_until(1, 4 * it, Cmp::Ge, None).map_err(|e| format!("ctran add {it}: {e}"))?;
        g.barrier(None).map_err(s)?;
    }
    match w.get_tensor(peer, 0, 16) {
        Err(e @ Error::Unsupported { .. }) => {
            ensure(e.to_string().contains(&format!("rank {peer}")), || e.to_string())?;
        }
        other => return Err(format!("get_tensor of the other host: {other:?}")),
    }
    g.barrier(None).map_err(s)?;
    println!("ctran ok");
    Ok(())
}
