//! Benchmark helper, not a tool: the Rust side of the Python benchmark
//! (`python/bench.sh`). Times, from Rust, exactly what
//! `tests/scenarios.py bench` times from Python, so that the two figures of
//! one run show what the bindings add per call:
//!
//! - `pingpong ITERS`: an 8-byte put + signal, answered by the peer's
//!   wait_signal and its own put + signal, between ranks 0 and 1 of a
//!   torchcomms-form window; prints the half round trip on rank 0.
//!
//! Run under `rmacomm-run --nproc-per-node 2` (torchrun's variables).

use std::time::Instant;

use rmacomm_window::{Group, Window, WindowOptions};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) != Some("pingpong") {
        return Err("usage: py-reference pingpong ITERS".into());
    }
    let iters: usize = args.get(1).map_or(Ok(20_000), |a| a.parse())?;
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
