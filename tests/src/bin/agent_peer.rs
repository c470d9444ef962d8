//! A transfer-agent process for the multi-process tests
//! (`tests/agent_multiprocess.rs`): a decode process that many prefill
//! processes write KV blocks into.
//!
//! `agent_peer decode --prefills P --requests R --blocks B --block-size S [--hold]`
//! registers a cache of `2·P·R·B` blocks and prints one line:
//! `{"meta": its metadata, "region": id, "slots": [per prefill: R·B slots]}`
//! (the test hands it to the prefills). It then waits for `P·R` request
//! notifications (each a tag `{"prefill","request"}`), checks every byte of
//! each request's blocks in their slots and prints `{"verified": tag}`,
//! then waits for each prefill's `done`, asks each connection's path
//! (same host or not), says `bye` to each and prints `{"ok": …}`. With
//! `--hold` it only prints its line and waits to be killed.
//!
//! `agent_peer prefill --id I --requests R --blocks B --block-size S [--stream]`
//! reads decode's line, writes its `R` requests concurrently (block `b` of
//! request `r` into the slot decode assigned, each request notifying with
//! its tag), reads all blocks back with `R` concurrent read requests and
//! checks them, sends `done`, waits for decode's `bye` and prints
//! `{"ok": …}`. With `--stream` it keeps three requests in flight until one
//! fails and prints
//! `{"failed": error, "peer": named peer}`, then tries one more and prints
//! `{"again": its error, "again_secs": how long it took}`.
//! Any failure prints `{"error": why}` and exits 1. `AGENT_PEER_QPS` and
//! `AGENT_PEER_LB` (`dqplb`, `spray`) set the transports' QPs and striping
//! (fragments of 64 KiB, so that blocks are striped), `AGENT_PEER_TIMEOUT_S`
//! their timeout and the connection timeout (30 s).

#![forbid(unsafe_code)]

use std::collections::BTreeSet;
use std::io::{BufRead, Write};
use std::time::{Duration, Instant};

use futures::StreamExt;
use ibverbx::LoadBalancing;
use rmacomm_agent::{AgentConfig, Op, RemoteBlock, TransferAgent};
use rmacomm_tests::pattern;
use rmacomm_transport::TransportConfig;
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize)]
struct DecodeHello {
    meta: String,
    region: u32,
    slots: Vec<Vec<usize>>,
}

#[derive(Serialize, Deserialize, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
struct Tag {
    prefill: usize,
    request: usize,
}

fn fail(msg: String) -> ! {
    println!("{}", serde_json::json!({ "error": msg }));
    std::process::exit(1);
}

fn say(v: serde_json::Value) {
    println!("{v}");
    std::io::stdout().flush().unwrap();
}

/// Block `b` of request `r` of prefill `p`.
fn block(p: usize, r: usize, b: usize, size: usize) -> Vec<u8> {
    pattern(size, ((p as u64) << 40 | (r as u64) << 20 | b as u64) + 1)
}

/// A deterministic shuffle of `0..n` (the paged cache's free list).
fn shuffled(n: usize) -> Vec<usize> {
    let mut v: Vec<usize> = (0..n).collect();
    let mut x = 0x2545_f491_4f6c_dd1du64;
    for i in (1..n).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.swap(i, (x % (i as u64 + 1)) as usize);
    }
    v
}

fn config() -> AgentConfig {
    let qps: u32 = std::env::var("AGENT_PEER_QPS").ok().and_then(|q| q.parse().ok()).unwrap_or(1);
    let timeout: u64 = std::env::var("AGENT_PEER_TIMEOUT_S").ok().and_then(|t| t.parse().ok()).unwrap_or(30);
    let lb = std::env::var("AGENT_PEER_LB").ok().and_then(|l| LoadBalancing::parse(&l)).unwrap_or_default();
    AgentConfig::default()
        .with_transport(
            TransportConfig::default()
                .with_qps(qps)
                .with_load_balancing(lb)
                .with_frag_size(64 << 10)
                .with_timeout(Some(Duration::from_secs(timeout))),
        )
        .with_connect_timeout(Duration::from_secs(timeout))
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let filter = std::env::var("RMACOMM_LOG").unwrap_or_else(|_| "warn".into());
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).try_init();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let opt = |name: &str, default: usize| -> usize {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .map_or(default, |v| v.parse().unwrap_or_else(|_| fail(format!("{name} {v}"))))
    };
    let flag = |name: &str| args.iter().any(|a| a == name);
    let (requests, blocks, size) = (opt("--requests", 4), opt("--blocks", 64), opt("--block-size", 16 << 10));
    match args.first().map(String::as_str) {
        Some("decode") => decode(opt("--prefills", 2), requests, blocks, size, flag("--hold")).await,
        Some("prefill") => prefill(opt("--id", 0), requests, blocks, size, flag("--stream")).await,
        _ => fail("usage: agent_peer decode|prefill ...".into()),
    }
}

async fn decode(prefills: usize, requests: usize, blocks: usize, size: usize, hold: bool) {
    let t0 = Instant::now();
    let agent = TransferAgent::new("decode", config()).unwrap_or_else(|e| fail(format!("new: {e}")));
    let per = requests * blocks;
    let cache = agent.alloc(2 * prefills * per * size).unwrap_or_else(|e| fail(format!("alloc: {e}")));
    let region = agent.register(&cache).unwrap_or_else(|e| fail(format!("register: {e}")));
    let free = shuffled(2 * prefills * per);
    let slots: Vec<Vec<usize>> = (0..prefills).map(|p| free[p * per..(p + 1) * per].to_vec()).collect();
    let hello = DecodeHello { meta: agent.metadata(), region, slots: slots.clone() };
    say(serde_json::to_value(&hello).unwrap());
    if hold {
        tokio::time::sleep(Duration::from_secs(600)).await;
        return;
    }
    let mut stream = agent.notifications();
    let mut seen = BTreeSet::new();
    let mut done = BTreeSet::new();
    let mut got = vec![0u8; size];
    while seen.len() < prefills * requests || done.len() < prefills {
        let n = match tokio::time::timeout(Duration::from_secs(120), stream.next()).await {
            Ok(Some(n)) => n,
            _ => fail(format!("only {} requests and {} prefills done arrived", seen.len(), done.len())),
        };
        if let Some(p) = n.message.strip_prefix(b"done ") {
            done.insert(String::from_utf8_lossy(p).into_owned());
            continue;
        }
        let tag: Tag = serde_json::from_slice(&n.message).unwrap_or_else(|e| fail(format!("a notification: {e}")));
        if n.peer != format!("prefill-{}", tag.prefill) {
            fail(format!("{tag:?} came from {}", n.peer));
        }

        if !seen.insert(tag) {
            fail(format!("{tag:?} notified twice"));
        }
        // Every byte of every block of the request, in the slot decode
        // assigned it: the notification came after all of them landed.
        for b in 0..blocks {
            let slot = slots[tag.prefill][tag.request * blocks + b];
            cache.read_into(slot * size, &mut got).unwrap();
            if got != block(tag.prefill, tag.request, b, size) {
                fail(format!("{tag:?}: block {b} in slot {slot} differs"));
            }
        }
        say(serde_json::json!({ "verified": tag }));
    }
    // The prefills wait for this side's `bye` (over the connections they
    // made): ask them the path first, while they are surely alive.
    let mut same_host = serde_json::Map::new();
    for p in agent.peers() {
        let s = agent.peer_same_host(&p).await.unwrap_or_else(|e| fail(format!("peer_same_host: {e}")));
        same_host.insert(p.clone(), s.into());
        agent.notify(&p, b"bye").unwrap().await.unwrap_or_else(|e| fail(format!("bye to {p}: {e}")));
    }
    let st = agent.stats();
    say(serde_json::json!({
        "ok": true, "same_host": same_host, "received": st.notifications_received,
        "connections": st.connections, "secs": t0.elapsed().as_secs_f64()
    }));
}

async fn prefill(id: usize, requests: usize, blocks: usize, size: usize, stream: bool) {
    let name = format!("prefill-{id}");
    let agent = TransferAgent::new(&name, config()).unwrap_or_else(|e| fail(format!("new: {e}")));
    let kv = agent.alloc(requests * blocks * size).unwrap_or_else(|e| fail(format!("alloc: {e}")));
    agent.register(&kv).unwrap_or_else(|e| fail(format!("register: {e}")));
    for r in 0..requests {
        for b in 0..blocks {
            kv.write_from((r * blocks + b) * size, &block(id, r, b, size)).unwrap();
        }
    }
    let mut line = String::new();
    std::io::stdin().lock().read_line(&mut line).unwrap();
    let d: DecodeHello = serde_json::from_str(&line).unwrap_or_else(|e| fail(format!("decode hello: {e}")));
    agent.add_peer(&d.meta).unwrap_or_else(|e| fail(format!("add_peer: {e}")));
    let slots = &d.slots[id];
    let remote = |r: usize, b: usize| RemoteBlock::new(d.region, (slots[r * blocks + b] * size) as u64, size as u64);
    let tag = |r: usize| serde_json::to_vec(&Tag { prefill: id, request: r }).unwrap();

    if stream {
        let pieces: Vec<_> = (0..blocks).map(|b| (kv.view(b * size, size).unwrap(), remote(0, b))).collect();
        // Three requests in flight at all times, so that the kill lands
        // in the middle of some.
        let mut flight = futures::stream::FuturesUnordered::new();
        let mut done = 0u64;
        let e = loop {
            while flight.len() < 3 {
                flight.push(agent.transfer(Op::Write, "decode", &pieces, Some(&tag(0))).unwrap());
            }
            match flight.next().await.expect("three in flight") {
                Ok(()) => {
                    done += 1;
                    if done == 3 {
                        say(serde_json::json!({ "streaming": true }));
                    }
                }
                Err(e) => break e,
            }
        };
        drop(flight);
        say(serde_json::json!({ "failed": e.to_string(), "peer": e.peer() }));
        let t = Instant::now();
        let again = agent.transfer(Op::Write, "decode", &pieces, None).unwrap().await.err();
        say(serde_json::json!({ "again": again.map(|e| e.to_string()), "again_secs": t.elapsed().as_secs_f64() }));
        return;
    }

    // The requests, all in flight at once.
    let t0 = Instant::now();
    let writes: Vec<_> = (0..requests)
        .map(|r| {
            let pieces: Vec<_> =
                (0..blocks).map(|b| (kv.view((r * blocks + b) * size, size).unwrap(), remote(r, b))).collect();
            agent.transfer(Op::Write, "decode", &pieces, Some(&tag(r))).unwrap_or_else(|e| fail(format!("{e}")))
        })
        .collect();
    for (r, res) in futures::future::join_all(writes).await.into_iter().enumerate() {
        res.unwrap_or_else(|e| fail(format!("request {r}: {e}")));
    }
    let write_secs = t0.elapsed().as_secs_f64();

    // Read every block back, one read request per write request.
    let back = agent.alloc(requests * blocks * size).unwrap();
    agent.register(&back).unwrap();
    let t1 = Instant::now();
    let reads: Vec<_> = (0..requests)
        .map(|r| {
            let pieces: Vec<_> =
                (0..blocks).map(|b| (back.view_mut((r * blocks + b) * size, size).unwrap(), remote(r, b))).collect();
            agent.transfer(Op::Read, "decode", &pieces, None).unwrap_or_else(|e| fail(format!("{e}")))
        })
        .collect();
    for (r, res) in futures::future::join_all(reads).await.into_iter().enumerate() {
        res.unwrap_or_else(|e| fail(format!("read request {r}: {e}")));
    }
    let read_secs = t1.elapsed().as_secs_f64();
    let mut got = vec![0u8; size];
    for r in 0..requests {
        for b in 0..blocks {
            back.read_into((r * blocks + b) * size, &mut got).unwrap();
            if got != block(id, r, b, size) {
                fail(format!("read back: request {r} block {b} differs"));
            }
        }
    }
    agent
        .notify("decode", format!("done {name}").as_bytes())
        .unwrap()
        .await
        .unwrap_or_else(|e| fail(format!("done: {e}")));
    match tokio::time::timeout(Duration::from_secs(60), agent.notifications().next()).await {
        Ok(Some(n)) if n.peer == "decode" && n.message == b"bye" => {}
        other => fail(format!("waiting for decode's bye: {other:?}")),
    }
    let st = agent.stats();
    say(serde_json::json!({
        "ok": true, "write_secs": write_secs, "read_secs": read_secs,
        "ops_posted": st.ops_posted, "pieces": st.pieces, "sent": st.notifications_sent
    }));
}
