//! The GPU's copy-engine ceiling: device-to-device `cuMemcpyDtoD` bandwidth
//! by size, the physical limit the GPU window put targets are measured
//! against (issue 13: same-GPU put ≥ 0.9× this from 1 MiB up).
//!
//! `cargo run --release -p rmacomm-cuda --example copy_ceiling` (or the
//! binary the GPU suite carries); prints one line per size and, with
//! `--json`, JSON lines. Exits with a clear error where there is no GPU.

use std::time::Instant;

use rmacomm_cuda::driver::Context;

fn main() {
    let json = std::env::args().any(|a| a == "--json");
    let ctx = match Context::open(0) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("copy_ceiling: no GPU to measure: {e}");
            std::process::exit(2);
        }
    };
    println!("# {} ({}), cuMemcpyDtoD, bytes moved per second (GB/s = 1e9 B/s)", ctx.name(), ctx.arch());
    let max = 1usize << 30;
    let (src, dst) = match (ctx.alloc(max), ctx.alloc(max)) {
        (Ok(s), Ok(d)) => (s, d),
        (Err(e), _) | (_, Err(e)) => {
            eprintln!("copy_ceiling: {e}");
            std::process::exit(1);
        }
    };
    let mut size = 64 << 10;
    while size <= max {
        let iters = ((4usize << 30) / size).clamp(5, 2000);
        let run = |n: usize| -> Result<f64, rmacomm_cuda::CudaError> {
            ctx.synchronize()?;
            let t = Instant::now();
            for _ in 0..n {
                ctx.copy(&dst, &src, size)?;
            }
            ctx.synchronize()?;
            Ok(t.elapsed().as_secs_f64())
        };
        let secs = run(2).and_then(|_| run(iters)).unwrap_or_else(|e| {
            eprintln!("copy_ceiling: {e}");
            std::process::exit(1);
        });
        let gbps = (size * iters) as f64 / secs / 1e9;
        if json {
            println!("{{\"test\":\"cuMemcpyDtoD\",\"bytes\":{size},\"GBps\":{gbps:.2},\"device\":\"{}\"}}", ctx.name());
        } else {
            println!("{size:>12} B  {gbps:>8.1} GB/s");
        }
        size *= 4;
    }
}
