//! The GPU's copy-engine ceiling: device-to-device `cuMemcpyDtoD` bandwidth
//! by size, the physical limit the GPU window put targets are measured
//! against (issue 13: same-GPU put ≥ 0.9× this from 1 MiB up).
//!
//! `cargo run --release -p rmacomm-cuda --example copy_ceiling` (or the
//! binary the GPU suite carries); prints one line per size and, with
//! `--json`, JSON lines. Exits with a clear error where there is no GPU.
//!
//! `--staging` measures instead the per-call cost of the copies the soft
//! provider's engine makes for device memory in the transport
//! (`rmacomm_cuda::staging::Staging`: device to device with a stream
//! synchronize, and uploads / downloads through the pinned stages) beside a
//! bare `cuMemcpyDtoDAsync` + `cuStreamSynchronize`, 64 KiB–16 MiB: on an
//! H200 the transport moved device memory at ~50 µs per 1 MiB fragment,
//! and these say how much of that the copies are.

use std::time::Instant;

use rmacomm_cuda::driver::Context;
use rmacomm_cuda::staging::Staging;

/// Per-call cost of each staged copy, by size (module docs).
fn staging(json: bool) -> Result<(), rmacomm_cuda::CudaError> {
    let ctx = Context::open_shared(0)?;
    let max = 16usize << 20;
    let (a, b) = (ctx.alloc_shared(max)?, ctx.alloc_shared(max)?);
    let st = Staging::new(ctx.clone())?;
    let stream = ctx.stream()?;
    let mut host = vec![1u8; max];
    println!("# {} ({}), per-call cost of staged copies (µs) and bandwidth (GB/s)", ctx.name(), ctx.arch());
    let mut next = 64usize << 10;
    while next <= max {
        let size = next;
        next *= 4;
        let iters = ((1usize << 30) / size).clamp(20, 2000);
        type Copy<'a> = Box<dyn Fn() -> Result<(), rmacomm_cuda::CudaError> + 'a>;
        let host_ptr = host.as_mut_ptr();
        // Every range below lies in a live allocation of at least `size`
        // bytes, or in `host`, which outlives the loop.
        let cases: [(&str, Copy<'_>); 4] = [
            (
                "bare_dtod_sync",
                Box::new(|| {
                    // SAFETY: see above.
                    unsafe { stream.copy_async(b.ptr(), a.ptr(), size)? };
                    stream.synchronize()
                }),
            ),
            (
                "staging_copy_device",
                Box::new(|| {
                    // SAFETY: see above.
                    unsafe { st.copy_device(b.ptr(), a.ptr(), size) }
                }),
            ),
            (
                "staging_upload",
                Box::new(|| {
                    // SAFETY: see above.
                    unsafe { st.upload_raw(a.ptr(), host_ptr, size) }
                }),
            ),
            (
                "staging_download",
                Box::new(|| {
                    // SAFETY: see above.
                    unsafe { st.download_raw(a.ptr(), host_ptr, size) }
                }),
            ),
        ];
        for (name, f) in cases.iter() {
            f()?;
            let t = Instant::now();
            for _ in 0..iters {
                f()?;
            }
            let secs = t.elapsed().as_secs_f64();
            let (us, gbps) = (secs / iters as f64 * 1e6, (size * iters) as f64 / secs / 1e9);
            if json {
                println!(
                    "{{\"test\":\"{name}\",\"bytes\":{size},\"us_per_call\":{us:.2},\"GBps\":{gbps:.2},\"device\":\"{}\"}}",
                    ctx.name()
                );
            } else {
                println!("{name:<20} {size:>10} B  {us:>9.2} µs/call  {gbps:>8.1} GB/s");
            }
        }
    }
    Ok(())
}

fn main() {
    let json = std::env::args().any(|a| a == "--json");
    if std::env::args().any(|a| a == "--staging") {
        if let Err(e) = staging(json) {
            eprintln!("copy_ceiling --staging: {e}");
            std::process::exit(1);
        }
        return;
    }
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
