//! KV-cache blocks from a "prefill" process into a "decode" process through
//! two transfer agents, timed: one request of `--blocks` scattered blocks of
//! `--block-size` bytes with one notification, the same without one, and
//! the same blocks read back as one read request.
//!
//! ```text
//! cargo run --release -p rmacomm-agent --example agent_kv -- --blocks 256 --block-size 16384
//! RMACOMM_SOFT_LINK=tcp cargo run --release -p rmacomm-agent --example agent_kv -- --blocks 64 --block-size 1048576
//! ```
//!
//! This process is prefill; it starts decode (itself, `--decode`). Decode
//! registers a cache of `2 × blocks` slots and prints its metadata and a
//! shuffled list of slots; prefill writes its blocks there, `--rounds`
//! times plus one warm-up. Each round, decode waits for the request's
//! notification, checks every byte, and answers `ack` (a notification the
//! other way) before prefill starts the next round; that wait is not timed.
//! A round's time runs from `transfer` to its future resolving: every
//! block placed and the notification in decode's ring. Prints the median
//! and best round of each. `--qps N` stripes each connection over N QPs;
//! `--busy-poll-us U` makes waits spin for up to U µs first.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use futures::StreamExt;
use rmacomm_agent::{AgentConfig, Op, RemoteBlock, TransferAgent};
use rmacomm_transport::TransportConfig;

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).map_or(default, |v| v.parse().expect(name))
}

fn block(round: usize, b: usize, size: usize) -> Vec<u8> {
    let mut x = ((round as u64) << 32 | b as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..size)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn config() -> AgentConfig {
    let qps = arg("--qps", 1) as u32;
    let spin = Duration::from_micros(arg("--busy-poll-us", 0) as u64);
    AgentConfig::default().with_transport(
        TransportConfig::default().with_qps(qps).with_busy_poll(spin).with_timeout(Some(Duration::from_secs(60))),
    )
}

async fn decode(blocks: usize, size: usize, rounds: usize) -> Result<(), String> {
    let agent = TransferAgent::new("decode", config()).map_err(|e| e.to_string())?;
    let cache = agent.alloc(2 * blocks * size).map_err(|e| e.to_string())?;
    let region = agent.register(&cache).map_err(|e| e.to_string())?;
    let mut slots: Vec<usize> = (0..2 * blocks).collect();
    let mut x = 0x2545_f491_4f6c_dd1du64;
    for i in (1..slots.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        slots.swap(i, (x % (i as u64 + 1)) as usize);
    }
    slots.truncate(blocks);
    println!("{}", serde_json::json!({ "meta": agent.metadata(), "region": region, "slots": slots }));
    std::io::stdout().flush().unwrap();
    let mut stream = agent.notifications();
    let mut got = vec![0u8; size];
    for round in 0..=rounds {
        let n = stream.next().await.ok_or("the agent went away")?;
        if n.message != format!("round {round}").into_bytes() {
            return Err(format!("round {round}: notification {:?}", String::from_utf8_lossy(&n.message)));
        }
        for (b, &s) in slots.iter().enumerate() {
            cache.read_into(s * size, &mut got).map_err(|e| e.to_string())?;
            if got != block(round, b, size) {
                return Err(format!("round {round}: block {b} in slot {s} differs"));
            }
        }
        agent.notify(&n.peer, b"ack").map_err(|e| e.to_string())?.await.map_err(|e| e.to_string())?;
    }
    // Stay for the reads.
    let n = stream.next().await.ok_or("the agent went away")?;
    if n.message != b"bye" {
        return Err("no bye".into());
    }
    Ok(())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

async fn prefill(blocks: usize, size: usize, rounds: usize) -> Result<(), String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut child = Command::new(exe)
        .args(std::env::args().skip(1))
        .arg("--decode")
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot start the decode process: {e}"))?;
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).map_err(|e| e.to_string())?;
    let hello: serde_json::Value = serde_json::from_str(&line).map_err(|e| format!("decode hello: {e}"))?;
    let region = hello["region"].as_u64().ok_or("no region")? as u32;
    let slots: Vec<usize> = serde_json::from_value(hello["slots"].clone()).map_err(|e| e.to_string())?;

    let agent = TransferAgent::new("prefill", config()).map_err(|e| e.to_string())?;
    let kv = agent.alloc(blocks * size).map_err(|e| e.to_string())?;
    agent.register(&kv).map_err(|e| e.to_string())?;
    agent.add_peer(hello["meta"].as_str().ok_or("no metadata")?).map_err(|e| e.to_string())?;
    agent.connect("decode").await.map_err(|e| e.to_string())?;
    let same_host = agent.peer_same_host("decode").await.map_err(|e| e.to_string())?;
    let remote = |b: usize| RemoteBlock::new(region, (slots[b] * size) as u64, size as u64);
    let mut acks = agent.notifications();
    let mut times = Vec::new();
    let mut wtimes = Vec::new();
    for round in 0..=rounds {
        for b in 0..blocks {
            kv.write_from(b * size, &block(round, b, size)).map_err(|e| e.to_string())?;
        }
        let pieces: Vec<_> = (0..blocks).map(|b| (kv.view(b * size, size).unwrap(), remote(b))).collect();
        // The same request without a notification first (decode does not
        // look), then with one.
        let t0 = Instant::now();
        agent
            .transfer(Op::Write, "decode", &pieces, None)
            .map_err(|e| e.to_string())?
            .await
            .map_err(|e| e.to_string())?;
        let alone = t0.elapsed().as_secs_f64();
        let tag = format!("round {round}");
        let t0 = Instant::now();
        agent
            .transfer(Op::Write, "decode", &pieces, Some(tag.as_bytes()))
            .map_err(|e| e.to_string())?
            .await
            .map_err(|e| e.to_string())?;
        if round > 0 {
            times.push(t0.elapsed().as_secs_f64());
            wtimes.push(alone);
        }
        let ack = acks.next().await.ok_or("the agent went away")?;
        if ack.message != b"ack" {
            return Err("decode did not acknowledge".into());
        }
    }
    let back = agent.alloc(blocks * size).map_err(|e| e.to_string())?;
    agent.register(&back).map_err(|e| e.to_string())?;
    let mut rtimes = Vec::new();
    for round in 0..=rounds {
        let pieces: Vec<_> = (0..blocks).map(|b| (back.view_mut(b * size, size).unwrap(), remote(b))).collect();
        let t0 = Instant::now();
        agent
            .transfer(Op::Read, "decode", &pieces, None)
            .map_err(|e| e.to_string())?
            .await
            .map_err(|e| e.to_string())?;
        if round > 0 {
            rtimes.push(t0.elapsed().as_secs_f64());
        }
    }
    let mut got = vec![0u8; size];
    for b in 0..blocks {
        back.read_into(b * size, &mut got).map_err(|e| e.to_string())?;
        if got != block(rounds, b, size) {
            return Err(format!("read back: block {b} differs"));
        }
    }
    agent.notify("decode", b"bye").map_err(|e| e.to_string())?.await.map_err(|e| e.to_string())?;
    let bytes = (blocks * size) as f64;
    let link = if same_host { "same host (shm)" } else { "tcp" };
    for (what, t) in [("write + notification", times), ("write, no notification", wtimes), ("read", rtimes)] {
        let (med, best) = (median(t.clone()), t.iter().copied().fold(f64::INFINITY, f64::min));
        println!(
            "{blocks} x {} KiB {what} over {link}: median {:.3} ms ({:.2} GB/s, {:.2} us/block), best {:.3} ms, {} rounds",
            size >> 10,
            med * 1e3,
            bytes / med / 1e9,
            med * 1e6 / blocks as f64,
            best * 1e3,
            t.len()
        );
    }
    let status = child.wait().map_err(|e| e.to_string())?;
    if !status.success() {
        return Err("the decode process failed".into());
    }
    Ok(())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let (blocks, size, rounds) = (arg("--blocks", 256), arg("--block-size", 16 << 10), arg("--rounds", 20));
    let r = if std::env::args().any(|a| a == "--decode") {
        decode(blocks, size, rounds).await
    } else {
        prefill(blocks, size, rounds).await
    };
    if let Err(e) = r {
        eprintln!("agent_kv: {e}");
        std::process::exit(1);
    }
}
