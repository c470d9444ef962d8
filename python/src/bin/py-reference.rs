//! Benchmark helper, not a tool: the Rust side of the Python benchmark
//! (`python/bench.sh`). Times, from Rust, exactly what
//! `tests/scenarios.py bench` times from Python, so that the two figures of
//! one run show what the bindings add per call:
//!
//! - `pingpong ITERS`: an 8-byte put + signal, answered by the peer's
//!   wait_signal and its own put + signal, between ranks 0 and 1 of a
//!   torchcomms-form window; prints the half round trip on rank 0.
//!
//! - `self ITERS`: one rank alone, so that no other process's scheduling
//!   shows: put + signal + wait_signal to itself, and all_reduce of 4 KiB
//!   and 1 MiB; the difference to Python's figures is what a call costs in
//!   the bindings.
//!
//! Run under `rmacomm-run --nproc-per-node 2` (`pingpong`) or `1` (`self`).

use std::time::{Duration, Instant};

use rmacomm_collectives::{new_comm, CommOptions, DType, ReduceOp};
use rmacomm_window::{Group, Window, WindowOptions};

type R = Result<(), Box<dyn std::error::Error>>;

/// The mean time of `f` over `iters` calls, after a tenth as many.
fn time(iters: usize, mut f: impl FnMut() -> R) -> Result<Duration, Box<dyn std::error::Error>> {
    for _ in 0..iters / 10 {
        f()?;
    }
    let t0 = Instant::now();
    for _ in 0..iters {
        f()?;
    }
    Ok(t0.elapsed() / iters as u32)
}

fn alone(iters: usize) -> R {
    let mut comm = new_comm("rdma", CommOptions::new())?;
    let mut win = comm.new_window()?;
    win.tensor_register(win.alloc(128)?, 8)?;
    let src = win.alloc(8)?;
    let t = time(iters, || {
        win.put(src.view(0, 8)?, 0, 0, false)?;
        win.signal(0, false)?;
        win.wait_signal(0, None)?;
        Ok(())
    })?;
    println!("self_put_signal_wait_us {:.3}", t.as_secs_f64() * 1e6);
    for size in [4096usize, 1 << 20] {
        let mut buf = vec![0u8; size];
        let n = if size == 4096 { iters } else { iters / 100 };
        let t = time(n, || Ok(comm.all_reduce(&mut buf, DType::F32, ReduceOp::Sum)?))?;
        println!("self_all_reduce_{size}_us {:.3}", t.as_secs_f64() * 1e6);
    }
    let _ = win.tensor_deregister()?;
    Ok(())
}

fn main() -> R {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let iters: usize = args.get(1).map_or(Ok(20_000), |a| a.parse())?;
    match args.first().map(String::as_str) {
        Some("pingpong") => {}
        Some("self") => return alone(iters),
        _ => return Err("usage: py-reference pingpong|self ITERS".into()),
    }
    let group = Group::from_env()?;
    let (r, peer) = (group.rank(), 1 - group.rank());
    let mut win = Window::new(&group, WindowOptions::new())?;
    win.tensor_register(win.alloc(128)?, 8)?;
    let src = win.alloc(8)?;
    let mut per = std::time::Duration::ZERO;
    for n in [2_000, iters] {
        group.barrier(None)?;
        let t0 = Instant::now();
        for _ in 0..n {
            if r == 0 {
                win.put(src.view(0, 8)?, peer, 0, false)?;
                win.signal(peer, false)?;
                win.wait_signal(peer, None)?;
            } else {
                win.wait_signal(peer, None)?;
                win.put(src.view(0, 8)?, peer, 0, false)?;
                win.signal(peer, false)?;
            }
        }
        per = t0.elapsed() / n as u32;
    }
    if r == 0 {
        println!("put8_half_rtt_us {:.2}", per.as_secs_f64() * 1e6 / 2.0);
    }
    group.barrier(None)?;
    let _ = win.tensor_deregister()?;
    Ok(())
}
