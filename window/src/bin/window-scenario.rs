//! Test helper, not a tool: the multi-process window scenarios the
//! integration tests (`tests/window_processes.rs`) run under `rmacomm-run`.
//! Each checks itself and exits non-zero (with a message) when something is
//! wrong.
//!
//! `window-scenario SCENARIO [ARGS]`, scenarios: `ring COUNTS ITERS`
//! (COUNTS comma-separated), `signals`, `bounds`, `get`, `killed`, `ctran`, `leave`.
//! `WINDOW_PATH=separate` turns the UNIFIED same-host path off (every peer
//! through the transport); by default same-host ranks are UNIFIED.

#![forbid(unsafe_code)]

use std::time::{Duration, Instant};

use rmacomm_transport::RdmaMemory;
use rmacomm_window::{AccessType, Cmp, Error, Group, GroupOptions, SignalOp, Window, WindowOptions};

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
    let args: Vec<String> = std::env::args().skip(1).collect();
    let rank: usize = std::env::var("RANK").ok().and_then(|v| v.parse().ok()).expect("launched by rmacomm-run");
    let result = setup().and_then(|(g, w)| match args.first().map(String::as_str) {
        Some("ring") => ring(&g, w, &args[1], args[2].parse().expect("ITERS")),
        Some("signals") => signals(&g, w),
        Some("bounds") => bounds(&g, w),
        Some("get") => get(&g, w),
        Some("killed") => killed(&g, w),
        Some("leave") => leave(&g, w),
        Some("ctran") => {
            drop(w);
            ctran(&g)
        }
        other => Err(format!("unknown scenario {other:?}")),
    });
    match result {
        Ok(()) => println!("rank {rank} ok"),
        Err(e) => {
            eprintln!("rank {rank} FAILED: {e}");
            std::process::exit(1);
        }
    }
}

/// Whether same-host peers are UNIFIED in this run.
fn unified() -> bool {
    std::env::var("WINDOW_PATH").map_or(true, |v| v != "separate")
}

fn setup() -> Result<(Group, Window), String> {
    let g = Group::from_env_with(GroupOptions::new().timeout(Duration::from_secs(60))).map_err(s)?;
    let opts = WindowOptions::new().timeout(Duration::from_secs(30)).unified(unified());
    let w = Window::new(&g, opts).map_err(s)?;
    for p in 0..g.size() {
        let want = if unified() || p == g.rank() { AccessType::Unified } else { AccessType::Separate };
        let got = w.get_attr(p).map_err(s)?.access_type;
        ensure(got == want, || format!("attr of {p}: {got:?}, want {want:?}"))?;
    }
    Ok((g, w))
}

/// The bytes of one element of `value` in the element type `dtype`.
fn elem(dtype: &str, value: usize) -> Vec<u8> {
    match dtype {
        "f32" => (value as f32).to_le_bytes().to_vec(),
        "i32" => (value as i32).to_le_bytes().to_vec(),
        "i8" => vec![value as i8 as u8],
        _ => unreachable!(),
    }
}

/// torchcomms' window ring test: rank r puts `count` elements of its value
/// into rank r+1 at element offset r*count, signals it, waits for r-1's
/// signal and checks the region r-1 wrote.
fn ring(g: &Group, mut w: Window, counts: &str, iters: usize) -> R {
    let (rank, size) = (g.rank(), g.size());
    let (right, left) = ((rank + 1) % size, (rank + size - 1) % size);
    let start = Instant::now();
    let mut cases = 0;
    for count in counts.split(',').map(|c| c.parse::<usize>().expect("COUNT")) {
        for dtype in ["f32", "i32", "i8"] {
            let es = elem(dtype, 0).len();
            w.tensor_register(w.alloc(size * count * es).map_err(s)?, es).map_err(s)?;
            let src = w.alloc(count * es).map_err(s)?;
            for async_put in [false, true] {
                for async_signal in [false, true] {
                    for it in 0..iters {
                        let value = |r: usize| r + 10 * it + if async_put { 50 } else { 0 };
                        src.write_from(0, &elem(dtype, value(rank)).repeat(count)).map_err(s)?;
                        let what =
                            || format!("count {count} {dtype} async put {async_put} signal {async_signal} iter {it}");
                        let put = w.put(src.view(0, count * es).map_err(s)?, right, rank * count, async_put);
                        let put = put.map_err(|e| format!("{}: {e}", what()))?;
                        // The signal is issued before the put's Work is
                        // waited: it must still arrive after the data.
                        let sig = w.signal(right, async_signal).map_err(|e| format!("{}: {e}", what()))?;
                        w.wait_signal(left, None).map_err(|e| format!("{}: {e}", what()))?;
                        let mut got = vec![0u8; count * es];
                        let own = w.map_remote_tensor(rank).map_err(s)?;
                        own.read_into(left * count * es, &mut got).map_err(s)?;
                        let want = elem(dtype, value(left)).repeat(count);
                        if got != want {
                            let bad = got.chunks(es).zip(want.chunks(es)).position(|(a, b)| a != b).unwrap();
                            return Err(format!("{}: element {bad} from rank {left} wrong", what()));
                        }
                        put.wait(None).map_err(s)?;
                        sig.wait(None).map_err(s)?;
                        ensure(put.is_completed() && sig.is_completed(), || "works not completed".into())?;
                        // Rank `left` must not overwrite the region before it is checked.
                        g.barrier(None).map_err(s)?;
                        if unified() && size > 2 {
                            // Through the mapping of a peer's buffer: what a
                            // third rank put there (left's left into left).
                            let ll = (left + size - 1) % size;
                            let m = w.map_remote_tensor(left).map_err(s)?;
                            ensure(m.is_peer() && m.len() >= size * count * es, || "peer map".into())?;
                            m.read_into(ll * count * es, &mut got).map_err(s)?;
                            ensure(got == elem(dtype, value(ll)).repeat(count), || {
                                format!("{}: rank {ll}'s put into {left} not seen through the mapping: {got:?}", what())
                            })?;
                            // Nobody puts the next iteration's value before it is checked.
                            g.barrier(None).map_err(s)?;
                        }
                        cases += 1;
                    }
                }
            }
            drop(src);
            w.tensor_deregister().map_err(s)?;
        }
    }
    eprintln!("ring: {cases} iterations in {:?}", start.elapsed());
    Ok(())
}

/// Signals banked before the wait, many signals then many waits, to every
/// rank and to self; a wait with nothing coming times out clearly.
fn signals(g: &Group, w: Window) -> R {
    let (rank, size) = (g.rank(), g.size());
    const N: usize = 100;
    for p in 0..size {
        for i in 0..N {
            w.signal(p, i % 2 == 0).map_err(s)?;
        }
    }
    // Every signal to me has been issued (and, for the synchronous ones,
    // delivered) before anyone waits.
    g.barrier(None).map_err(s)?;
    for p in 0..size {
        for i in 0..N {
            w.wait_signal(p, Some(Duration::from_secs(10))).map_err(|e| format!("wait {i} from {p}: {e}"))?;
        }
    }
    g.barrier(None).map_err(s)?;
    let left = (rank + size - 1) % size;
    let t0 = Instant::now();
    match w.wait_signal(left, Some(Duration::from_millis(300))) {
        Err(e @ Error::Rma { .. }) => {
            let msg = e.to_string();
            println!("timeout error: {msg}");
            ensure(
                msg.contains("wait_signal") && msg.contains(&format!("rank {left}")) && msg.contains("timed out"),
                || msg.clone(),
            )?;
        }
        other => return Err(format!("a wait with no signal coming: {other:?}")),
    }
    ensure(t0.elapsed() < Duration::from_secs(3), || format!("the timeout took {:?}", t0.elapsed()))?;
    // The window is still usable after a timed-out wait (once every rank's
    // timed-out wait is over: the signal would satisfy a late one).
    g.barrier(None).map_err(s)?;
    w.signal(left, false).map_err(s)?;
    w.wait_signal((rank + 1) % size, None).map_err(s)?;
    g.barrier(None).map_err(s)
}

/// Out-of-bounds puts and gets fail before anything moves; puts that end
/// exactly at the end work. Rank r registers (r+1)*16 i32 elements.
fn bounds(g: &Group, mut w: Window) -> R {
    let (rank, size) = (g.rank(), g.size());
    let (right, left) = ((rank + 1) % size, (rank + size - 1) % size);
    let elems = |r: usize| (r + 1) * 16;
    w.tensor_register_len(w.alloc(elems(rank) * 4).map_err(s)?, elems(rank) * 4, 4).map_err(s)?;
    let src = w.alloc(64 * 4).map_err(s)?;
    src.write_from(0, &7i32.to_le_bytes().repeat(64)).map_err(s)?;
    let n = elems(right);
    for (off, len) in [(n - 1, 2), (n, 1), (0, n + 1), (usize::MAX / 2, 1)] {
        if len > 64 {
            continue;
        }
        match w.put(src.view(0, len * 4).map_err(s)?, right, off, false) {
            Err(e @ Error::Bounds { .. }) => {
                let msg = e.to_string();
                ensure(
                    msg.contains("put")
                        && msg.contains(&format!("rank {right}"))
                        && msg.contains(&format!("{} bytes", n * 4)),
                    || msg.clone(),
                )?;
                if off == n - 1 {
                    println!("bounds error: {msg}");
                }
            }
            other => return Err(format!("put of {len} at {off} into {n} elements: {other:?}")),
        }
        let mut dst = w.alloc(len * 4).map_err(s)?;
        match w.get(dst.view_mut(0, len * 4).map_err(s)?, right, off, true) {
            Err(Error::Bounds { op: "get", peer, .. }) if peer == right => {}
            other => return Err(format!("get of {len} at {off} from {n} elements: {other:?}")),
        }
        dst = w.alloc(4).map_err(s)?;
        drop(dst);
    }
    // Rank out of range.
    ensure(matches!(w.put(src.view(0, 4).map_err(s)?, size, 0, false), Err(Error::InvalidArgument { .. })), || {
        "rank".into()
    })?;
    // The last two elements: fits exactly.
    w.put(src.view(0, 8).map_err(s)?, right, n - 2, true).map_err(s)?.wait(None).map_err(s)?;
    w.signal(right, false).map_err(s)?;
    w.wait_signal(left, None).map_err(s)?;
    let mut mine = vec![0u8; elems(rank) * 4];
    w.local_tensor().unwrap().read_into(0, &mut mine).map_err(s)?;
    let split = mine.len() - 8;
    ensure(mine[..split].iter().all(|b| *b == 0), || "bytes written outside the fitting put".into())?;
    ensure(mine[split..] == 7i32.to_le_bytes().repeat(2)[..], || "the fitting put did not land".into())?;
    // map_remote_tensor: for self its own buffer; for a UNIFIED peer its
    // buffer (its registered size), for a SEPARATE one a clear error.
    ensure(w.map_remote_tensor(rank).map_err(s)?.len() == elems(rank) * 4, || "own map".into())?;
    ensure(w.local_tensor().unwrap().len() >= elems(rank) * 4, || "own tensor".into())?;
    match w.map_remote_tensor(right) {
        Ok(m) if unified() => {
            ensure(m.len() == elems(right) * 4 && m.elem_size() == 4, || format!("map of {right}: {m:?}"))?;
            let mut tail = [0u8; 8];
            m.read_into(m.len() - 8, &mut tail).map_err(s)?;
            ensure(tail[..] == 7i32.to_le_bytes().repeat(2)[..], || "the mapping does not see the put".into())?;
            ensure(m.read_into(m.len() - 7, &mut tail).is_err(), || "read past the mapped tensor".into())?;
        }
        Err(e @ Error::Unsupported { .. }) if right != rank && !unified() => {
            let msg = e.to_string();
            ensure(msg.contains(&format!("rank {right}")) && msg.contains("SEPARATE"), || msg.clone())?;
        }
        other if right != rank => return Err(format!("map_remote_tensor({right}): {other:?}")),
        _ => {}
    }
    g.barrier(None).map_err(s)?;
    w.tensor_deregister().map_err(s)?;
    Ok(())
}

/// Gets read the right bytes, sync and async, from every rank and self.
fn get(g: &Group, mut w: Window) -> R {
    let (rank, size) = (g.rank(), g.size());
    const N: usize = 4096 + 3;
    let pattern = |r: usize| (0..N).map(|i| (r * 7 + i * 13) as u8).collect::<Vec<u8>>();
    let mem = w.alloc(N).map_err(s)?;
    mem.write_from(0, &pattern(rank)).map_err(s)?;
    w.tensor_register(mem, 1).map_err(s)?;
    g.barrier(None).map_err(s)?;
    let dst = w.alloc(N).map_err(s)?;
    for p in 0..size {
        for (off, len, async_op) in [(0, N, false), (5, 1000, true), (N - 1, 1, true), (17, 3000, false)] {
            let work = w.get(dst.view_mut(0, len).map_err(s)?, p, off, async_op).map_err(s)?;
            work.wait(Some(Duration::from_secs(20))).map_err(s)?;
            let mut got = vec![0u8; len];
            dst.read_into(0, &mut got).map_err(s)?;
            ensure(got == pattern(p)[off..off + len], || format!("get {len} at {off} from {p}"))?;
        }
    }
    // Many async gets in flight at once, waited after.
    let bufs: Vec<RdmaMemory> = (0..size).map(|_| w.alloc(N).map_err(s)).collect::<Result<_, _>>()?;
    let works = bufs
        .iter()
        .enumerate()
        .map(|(p, b)| w.get(b.view_mut(0, N).map_err(s)?, p, 0, true).map_err(s))
        .collect::<Result<Vec<_>, _>>()?;
    for wk in &works {
        wk.wait(None).map_err(s)?;
    }
    drop(works);
    for (p, b) in bufs.iter().enumerate() {
        let mut got = vec![0u8; N];
        b.read_into(0, &mut got).map_err(s)?;
        ensure(got == pattern(p), || format!("concurrent get from {p}"))?;
    }
    g.barrier(None).map_err(s)?;
    w.tensor_deregister().map_err(s)?;
    Ok(())
}

/// Rank 1 exits abruptly (no destructor runs, as after a kill); rank 0's
/// wait for its signal fails with a clear error within the timeout.
fn killed(g: &Group, mut w: Window) -> R {
    w.tensor_register(w.alloc(4096).map_err(s)?, 1).map_err(s)?;
    g.barrier(None).map_err(s)?;
    if g.rank() == 1 {
        // Let rank 0 be waiting already.
        std::thread::sleep(Duration::from_millis(300));
        println!("rank 1 ok");
        std::process::exit(0);
    }
    if g.rank() != 0 {
        return Ok(());
    }
    let t0 = Instant::now();
    let limit = Duration::from_secs(20);
    match w.wait_signal(1, Some(limit)) {
        Err(e) => {
            let msg = e.to_string();
            println!("killed peer error after {:?}: {msg}", t0.elapsed());
            ensure(msg.contains("wait_signal with rank 1"), || msg.clone())?;
        }
        Ok(()) => return Err("a signal from a dead peer".into()),
    }
    ensure(t0.elapsed() <= limit + Duration::from_secs(2), || format!("took {:?}", t0.elapsed()))?;
    // Later operations towards it fail too, without hanging.
    let r = w.signal(1, false).map(drop);
    println!("signal to the dead peer: {r:?}");
    ensure(r.is_err(), || "a signal to a dead peer succeeded".into())?;
    // A UNIFIED peer's pages stay mapped after it died: mapping them is
    // refused rather than reading what it left.
    if unified() {
        let m = w.map_remote_tensor(1).map(drop);
        println!("map_remote_tensor of the dead peer: {m:?}");
        ensure(m.is_err(), || "map_remote_tensor of a dead peer succeeded".into())?;
    }
    // No collective deregister with a dead peer: the window just goes.
    drop(w);
    Ok(())
}

/// The ctran form: `allocate` with per-rank sizes, value signals (SET and
/// ADD, from every rank, self included), every comparison of
/// `wait_signal_until`, `get_tensor`, bounds, sizes.
fn ctran(g: &Group) -> R {
    let (rank, size) = (g.rank(), g.size());
    let (right, left) = ((rank + 1) % size, (rank + size - 1) % size);
    const SLOTS: usize = 4;
    let bytes = |r: usize| (r + 1) * 4096 + 8;
    let opts = WindowOptions::new().timeout(Duration::from_secs(30)).unified(unified());
    let w = Window::allocate(g, bytes(rank), SLOTS, opts).map_err(s)?;
    ensure(w.get_size() == bytes(rank) && w.get_device() == "cpu" && w.signal_slots() == SLOTS, || {
        format!("size {} device {} slots {}", w.get_size(), w.get_device(), w.signal_slots())
    })?;
    let src = w.alloc(4096).map_err(s)?;
    const ITERS: u64 = 20;
    for it in 1..=ITERS {
        // SET, ordered behind a put: the data is there when the value is.
        let byte = (rank as u64 * 31 + it) as u8;
        src.write_from(0, &vec![byte; 4096]).map_err(s)?;
        let put = w.put(src.view(0, 4096).map_err(s)?, right, 8, it % 2 == 0).map_err(s)?;
        w.signal_value(0, it, right, SignalOp::Set, it % 3 == 0).map_err(s)?;
        w.wait_signal_until(0, it, Cmp::Eq, None).map_err(|e| format!("iter {it}: {e}"))?;
        let mut got = vec![0u8; 4096];
        w.map_remote_tensor(rank).map_err(s)?.read_into(8, &mut got).map_err(s)?;
        let want = (left as u64 * 31 + it) as u8;
        ensure(got.iter().all(|b| *b == want), || format!("iter {it}: the put before the SET is not there"))?;
        put.wait(None).map_err(s)?;
        // ADD from every rank (self too) into slot 1 of every rank.
        for p in 0..size {
            w.signal_value(1, 1, p, SignalOp::Add, p % 2 == 1).map_err(s)?;
        }
        w.wait_signal_until(1, it * size as u64, Cmp::Ge, None).map_err(|e| format!("iter {it} add: {e}"))?;
        // Nobody overwrites the region before it is checked.
        g.barrier(None).map_err(s)?;
    }
    // Every rank's ADDs are in: slot 1 holds ITERS * size; each comparison.
    let total = ITERS * size as u64;
    let short = Some(Duration::from_millis(1));
    for (cmp, v) in [(Cmp::Eq, total), (Cmp::Ne, total + 1), (Cmp::Ge, total), (Cmp::Gt, total - 1)] {
        w.wait_signal_until(1, v, cmp, short).map_err(|e| format!("{cmp:?} {v}: {e}"))?;
    }
    for (cmp, v) in [(Cmp::Le, total), (Cmp::Lt, total + 1)] {
        w.wait_signal_until(1, v, cmp, short).map_err(|e| format!("{cmp:?} {v}: {e}"))?;
    }
    ensure(w.read_signal(1).map_err(s)? == total, || "read_signal".into())?;
    for (cmp, v) in [(Cmp::Eq, total + 1), (Cmp::Ne, total), (Cmp::Gt, total), (Cmp::Lt, total)] {
        match w.wait_signal_until(1, v, cmp, Some(Duration::from_millis(30))) {
            Err(e @ Error::Timeout { .. }) => {
                let msg = e.to_string();
                ensure(msg.contains("slot 1") && msg.contains(&format!("holds {total}")), || msg.clone())?;
                if cmp == Cmp::Eq {
                    println!("value timeout: {msg}");
                }
            }
            other => return Err(format!("{cmp:?} {v} with the slot at {total}: {other:?}")),
        }
    }
    // Bounds: slots and sizes.
    match w.signal_value(SLOTS, 1, right, SignalOp::Set, false) {
        Err(Error::Bounds { op: "signal_value", .. }) => {}
        other => return Err(format!("signal_value past the slots: {other:?}")),
    }
    ensure(matches!(w.wait_signal_until(SLOTS, 0, Cmp::Eq, short), Err(Error::Bounds { .. })), || {
        "wait_signal_until past the slots".into()
    })?;
    ensure(
        matches!(w.put(src.view(0, 16).map_err(s)?, right, bytes(right) - 8, false), Err(Error::Bounds { .. })),
        || "put past the end".into(),
    )?;
    // get_tensor: a view of a byte range of a peer's buffer.
    g.barrier(None).map_err(s)?;
    match w.get_tensor(right, 8, 4096) {
        Ok(t) if unified() => {
            let mut got = vec![0u8; 4096];
            t.read_into(0, &mut got).map_err(s)?;
            let want = (rank as u64 * 31 + ITERS) as u8;
            ensure(got.iter().all(|b| *b == want), || "get_tensor does not show my last put".into())?;
            ensure(t.read_into(1, &mut got).is_err(), || "read past the get_tensor view".into())?;
        }
        Err(Error::Unsupported { .. }) if !unified() && right != rank => {}
        other if right != rank => return Err(format!("get_tensor({right}): {other:?}")),
        _ => {}
    }
    ensure(matches!(w.get_tensor(rank, bytes(rank) - 4, 8), Err(Error::Bounds { .. })), || "get_tensor bounds".into())?;
    g.barrier(None).map_err(s)?;
    Ok(())
}

/// Rank 1 drops its window (its memory deregistered, its connections
/// closed) while rank 0 keeps putting into it: rank 0's put fails with an
/// error naming the operation and the peer, within the timeout; nothing
/// hangs, nothing panics.
fn leave(g: &Group, mut w: Window) -> R {
    w.tensor_register(w.alloc(1 << 20).map_err(s)?, 1).map_err(s)?;
    g.barrier(None).map_err(s)?;
    if g.rank() == 1 {
        std::thread::sleep(Duration::from_millis(200));
        drop(w);
        println!("rank 1 left");
        // Stay alive a while: the failure must come from the deregistration
        // and the closed connections, not from a process exit.
        std::thread::sleep(Duration::from_millis(1500));
        return Ok(());
    }
    if g.rank() != 0 {
        return Ok(());
    }
    let src = w.alloc(64 << 10).map_err(s)?;
    let t0 = Instant::now();
    let mut puts = 0u64;
    loop {
        match w.put(src.view(0, 64 << 10).map_err(s)?, 1, 0, false) {
            Ok(_) => puts += 1,
            Err(e) => {
                let msg = e.to_string();
                println!("leave error after {puts} puts, {:?}: {msg}", t0.elapsed());
                ensure(msg.contains("put with rank 1"), || msg.clone())?;
                break;
            }
        }
        if t0.elapsed() > Duration::from_secs(20) {
            return Err("puts into a window that was dropped kept succeeding".into());
        }
    }
    // Signals fail too once the peer's connections are gone (one issued
    // while it is still tearing down may land), and the window can still
    // be dropped.
    let t1 = Instant::now();
    while w.signal(1, false).is_ok() {
        ensure(t1.elapsed() < Duration::from_secs(10), || "signals to a peer that left kept succeeding".into())?;
        std::thread::sleep(Duration::from_millis(5));
    }
    drop(w);
    Ok(())
}
