//! KV-cache block transfer between a "prefill" and a "decode" process.
//!
//! ```text
//! cargo run --release -p rmacomm-transport --example kv_transfer
//! ```
//!
//! The prefill process (this one) starts the decode process (itself again,
//! with `--decode`). Decode registers a KV cache of fixed-size blocks and
//! tells prefill, through the pipe that stands in for a real control
//! channel, its transport URL, its cache's remote buffer and the list of
//! block slots it reserved for the request. Prefill writes its computed
//! blocks into those slots, each write notifying; decode waits for one
//! notification per block, verifies every byte, and prints
//! `verified N blocks`. The exit status is 0 only if verification passed.
//! The transfer runs twice and the second is timed: the first pays for the
//! first touch of decode's freshly allocated pages.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use rmacomm_transport::{RdmaMemory, RdmaRemoteBuffer, RdmaTransport, TransportConfig};
use serde::{Deserialize, Serialize};

const BLOCK: usize = 256 << 10; // 256 KiB: e.g. 16 tokens × 32 layers × 8 heads × 64 dims × 2 (K,V) × fp16 / 8
const CACHE_BLOCKS: usize = 512;
const REQUEST_BLOCKS: usize = 192;

#[derive(Serialize, Deserialize)]
struct DecodeHello {
    url: String,
    cache: RdmaRemoteBuffer,
    slots: Vec<usize>,
}

#[derive(Serialize, Deserialize)]
struct PrefillHello {
    url: String,
    /// Which logical block goes to which slot, so decode can verify.
    blocks: Vec<(usize, usize)>,
}

/// The content of logical block `b` of request `r` (stands in for K/V).
fn block_bytes(r: u64, b: usize) -> Vec<u8> {
    let mut x = (r << 32 | b as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..BLOCK)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn config() -> TransportConfig {
    TransportConfig::default().with_qps(4).with_timeout(Some(Duration::from_secs(60)))
}

async fn decode() -> Result<(), String> {
    let t = RdmaTransport::new(config()).map_err(|e| e.to_string())?;
    let cache = RdmaMemory::alloc(BLOCK * CACHE_BLOCKS).map_err(|e| e.to_string())?;
    // Reserve scattered slots, as a paged KV cache would.
    let slots: Vec<usize> = (0..REQUEST_BLOCKS).map(|i| (i * 37 + 11) % CACHE_BLOCKS).collect();
    let hello = DecodeHello { url: t.bind().map_err(|e| e.to_string())?, cache: cache.remote_buffer(), slots };
    println!("{}", serde_json::to_string(&hello).unwrap());
    std::io::stdout().flush().unwrap();
    let mut line = String::new();
    std::io::stdin().lock().read_line(&mut line).map_err(|e| e.to_string())?;
    let p: PrefillHello = serde_json::from_str(&line).map_err(|e| format!("prefill hello: {e}"))?;
    t.connect(&p.url).await.map_err(|e| e.to_string())?;
    // Round 1 warms the cache pages up (first touch); round 2 is timed.
    for _ in 0..p.blocks.len() {
        t.wait_for_write().await.map_err(|e| format!("waiting for blocks: {e}"))?;
    }
    let start = Instant::now();
    for _ in 0..p.blocks.len() {
        t.wait_for_write().await.map_err(|e| format!("waiting for blocks: {e}"))?;
    }
    let secs = start.elapsed().as_secs_f64();
    let mut got = vec![0u8; BLOCK];
    for &(b, slot) in &p.blocks {
        cache.read_into(slot * BLOCK, &mut got).map_err(|e| e.to_string())?;
        if got != block_bytes(1, b) {
            return Err(format!("block {b} in slot {slot} differs"));
        }
    }
    let bytes = (p.blocks.len() * BLOCK) as f64;
    println!(
        "decode: verified {} blocks ({} MiB) in {:.1} ms, {:.2} GB/s",
        p.blocks.len(),
        (p.blocks.len() * BLOCK) >> 20,
        secs * 1e3,
        bytes / secs / 1e9
    );
    Ok(())
}

async fn prefill() -> Result<(), String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut child = Command::new(exe)
        .arg("--decode")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot start the decode process: {e}"))?;
    let mut to_decode = child.stdin.take().unwrap();
    let mut from_decode = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    from_decode.read_line(&mut line).map_err(|e| e.to_string())?;
    let d: DecodeHello = serde_json::from_str(&line).map_err(|e| format!("decode hello: {e}"))?;

    let t = RdmaTransport::new(config()).map_err(|e| e.to_string())?;
    // "Computed" KV blocks of the request, in prefill's own registered memory.
    let kv = RdmaMemory::alloc(BLOCK * REQUEST_BLOCKS).map_err(|e| e.to_string())?;
    for b in 0..REQUEST_BLOCKS {
        kv.write_from(b * BLOCK, &block_bytes(1, b)).map_err(|e| e.to_string())?;
    }
    let blocks: Vec<(usize, usize)> = d.slots.iter().enumerate().map(|(b, &s)| (b, s)).collect();
    let hello = PrefillHello { url: t.bind().map_err(|e| e.to_string())?, blocks: blocks.clone() };
    writeln!(to_decode, "{}", serde_json::to_string(&hello).unwrap()).map_err(|e| e.to_string())?;
    to_decode.flush().map_err(|e| e.to_string())?;
    t.connect(&d.url).await.map_err(|e| e.to_string())?;

    // All block writes in flight at once; each notifies decode. Twice: the
    // first round touches decode's fresh pages, the second is timed.
    let mut secs = 0.0;
    for _round in 0..2 {
        let start = Instant::now();
        let mut writes = Vec::with_capacity(blocks.len());
        for &(b, slot) in &blocks {
            let dst = d.cache.slice((slot * BLOCK) as u64, BLOCK as u64).ok_or("slot outside the cache")?;
            writes.push(t.write(kv.view(b * BLOCK, BLOCK).map_err(|e| e.to_string())?, &dst, true));
        }
        for w in writes {
            w.await.map_err(|e| format!("block write: {e}"))?;
        }
        secs = start.elapsed().as_secs_f64();
    }
    println!(
        "prefill: wrote {} blocks of {} KiB in {:.1} ms, {:.2} GB/s",
        blocks.len(),
        BLOCK >> 10,
        secs * 1e3,
        (blocks.len() * BLOCK) as f64 / secs / 1e9
    );
    for l in from_decode.lines().map_while(Result::ok) {
        println!("{l}");
    }
    let status = child.wait().map_err(|e| e.to_string())?;
    if !status.success() {
        return Err("the decode process failed its verification".into());
    }
    Ok(())
}

#[tokio::main]
async fn main() {
    let r = if std::env::args().any(|a| a == "--decode") { decode().await } else { prefill().await };
    if let Err(e) = r {
        eprintln!("kv_transfer: {e}");
        std::process::exit(1);
    }
}
