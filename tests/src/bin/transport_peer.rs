//! An `RdmaTransport` peer process for multi-process tests.
//!
//! `transport_peer server|client [--sizes N,...] [--mem host|cuda|vmm|mixed]`,
//! `transport_peer hold`,
//! `transport_peer stream`. Each prints `{"url":…, "rb":…}`, reads the
//! peer's line, connects, and runs its part: the client writes each size
//! with notify into its own slice of the server's buffer and reads it back;
//! the server waits for each notification and verifies every byte. `hold`
//! connects and waits to be killed; `stream` writes until an error and
//! reports which. `--mem cuda`: every buffer is CUDA device memory
//! (`RdmaMemory::alloc_cuda`, GPU 0, or `--gpu N`); `vmm`: every buffer is cuMem/VMM
//! device memory in 2 MiB mappings (PyTorch's expandable segments),
//! registered with `RdmaMemory::register_cuda`; `mixed`: the server's and the
//! client's source are device memory, the client's read-back buffer host
//! memory.

use std::io::{BufRead, Write};
use std::time::{Duration, Instant};

use rmacomm_tests::pattern;
use rmacomm_transport::{RdmaMemory, RdmaRemoteBuffer, RdmaTransport, TransportConfig, TransportError};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize)]
struct Hello {
    url: String,
    rb: RdmaRemoteBuffer,
}

fn fail(msg: String) -> ! {
    println!("{}", serde_json::json!({ "error": msg }));
    std::process::exit(1);
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let filter = std::env::var("RMACOMM_LOG").unwrap_or_else(|_| "warn".into());
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).try_init();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let role = args.first().cloned().unwrap_or_default();
    let opt = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned();
    let sizes: Vec<usize> = opt("--sizes")
        .map(|s| s.split(',').map(|x| x.parse().expect("size")).collect())
        .unwrap_or_else(|| vec![1, 64, 4095, 4096, 4097, 8192, 64 << 10, 1 << 20, 64 << 20]);
    let offsets: Vec<usize> = sizes.iter().scan(0, |acc, &n| Some(std::mem::replace(acc, *acc + n))).collect();
    let total = sizes.iter().sum::<usize>().max(1 << 20);
    let qps: u32 = opt("--qps").map_or(1, |q| q.parse().expect("qps"));

    let cfg = TransportConfig::default().with_qps(qps).with_timeout(Some(Duration::from_secs(60)));
    let t = RdmaTransport::new(cfg).unwrap_or_else(|e| fail(format!("new: {e}")));
    let kind = opt("--mem").unwrap_or_else(|| "host".into());
    let gpu: u32 = opt("--gpu").map_or(0, |g| g.parse().expect("gpu"));
    let alloc = |device: bool| {
        if device && kind == "vmm" {
            let ctx =
                rmacomm_window::cuda::driver::Context::open_shared(gpu).unwrap_or_else(|e| fail(format!("CUDA: {e}")));
            let vmm = ctx.alloc_vmm(total, 2 << 20).unwrap_or_else(|e| fail(format!("alloc_vmm: {e}")));
            // SAFETY: the memory lives as long as the process (leaked below).
            let mem = unsafe { RdmaMemory::register_cuda(vmm.ptr(), total, gpu) }
                .unwrap_or_else(|e| fail(format!("register_cuda of VMM memory: {e}")));
            Box::leak(Box::new(vmm));
            mem
        } else if device {
            RdmaMemory::alloc_cuda(total, gpu).unwrap_or_else(|e| fail(format!("alloc_cuda: {e}")))
        } else {
            RdmaMemory::alloc(total).unwrap_or_else(|e| fail(format!("alloc: {e}")))
        }
    };
    let mem = alloc(kind != "host");
    if kind != "host" && mem.device().is_none() {
        fail("alloc_cuda gave host memory".into());
    }
    let me = Hello { url: t.bind().unwrap(), rb: mem.remote_buffer() };
    println!("{}", serde_json::to_string(&me).unwrap());
    std::io::stdout().flush().unwrap();
    let mut line = String::new();
    std::io::stdin().lock().read_line(&mut line).unwrap();
    let peer: Hello = serde_json::from_str(&line).unwrap_or_else(|e| fail(format!("peer hello: {e}")));
    t.connect(&peer.url).await.unwrap_or_else(|e| fail(format!("connect: {e}")));

    match role.as_str() {
        "server" => {
            for (i, &n) in sizes.iter().enumerate() {
                t.wait_for_write().await.unwrap_or_else(|e| fail(format!("wait_for_write: {e}")));
                let mut got = vec![0u8; n];
                mem.read_into(offsets[i], &mut got).unwrap();
                if got != pattern(n, i as u64) {
                    fail(format!("the {n}-byte write differs"));
                }
                println!("{}", serde_json::json!({ "verified": n }));
            }
            // Stay until the client has read everything back.
            t.wait_for_write().await.unwrap_or_else(|e| fail(format!("final wait: {e}")));
            println!("{}", serde_json::json!({ "ok": true }));
        }
        "client" => {
            let back = alloc(kind == "cuda" || kind == "vmm");
            for (i, &n) in sizes.iter().enumerate() {
                let off = offsets[i];
                let data = pattern(n, i as u64);
                mem.write_from(off, &data).unwrap();
                let rb = peer.rb.slice(off as u64, n as u64).unwrap();
                t.write(mem.view(off, n).unwrap(), &rb, true).await.unwrap_or_else(|e| fail(format!("write {n}: {e}")));
                t.read(back.view_mut(off, n).unwrap(), &rb).await.unwrap_or_else(|e| fail(format!("read {n}: {e}")));
                let mut got = vec![0u8; n];
                back.read_into(off, &mut got).unwrap();
                if got != data {
                    fail(format!("read back of {n} differs"));
                }
            }
            t.write(mem.view(0, 1).unwrap(), &peer.rb, true).await.unwrap_or_else(|e| fail(format!("final: {e}")));
            // Which path the bytes took (the soft provider's counters).
            if let Some(st) = t.soft_stats() {
                println!("{}", serde_json::json!({ "peer_device_bytes": st.peer_device_bytes }));
            }
            println!("{}", serde_json::json!({ "ok": true }));
        }
        "hold" => {
            println!("{}", serde_json::json!({ "ready": true }));
            std::io::stdout().flush().unwrap();
            tokio::time::sleep(Duration::from_secs(600)).await;
        }
        "stream" => {
            println!("{}", serde_json::json!({ "ready": true }));
            std::io::stdout().flush().unwrap();
            let start = Instant::now();
            let n = total.min(1 << 20);
            loop {
                let r =
                    t.write_with_timeout(mem.view(0, n).unwrap(), &peer.rb, true, Some(Duration::from_secs(3))).await;
                if let Err(e) = r {
                    let kind = match e {
                        TransportError::PeerClosed { .. } => "peer_closed",
                        ref e if e.is_broken() => "broken",
                        TransportError::Timeout { .. } => "timeout",
                        _ => "other",
                    };
                    println!(
                        "{}",
                        serde_json::json!({ "failed": kind, "error": e.to_string(), "after_ms": start.elapsed().as_millis() as u64 })
                    );
                    // A broken transport fails fast from now on.
                    let t0 = Instant::now();
                    let again = t.write(mem.view(0, 8).unwrap(), &peer.rb, false).await;
                    println!(
                        "{}",
                        serde_json::json!({ "again": again.is_err(), "again_ms": t0.elapsed().as_millis() as u64 })
                    );
                    return;
                }
            }
        }
        r => fail(format!("unknown role {r:?}")),
    }
}
