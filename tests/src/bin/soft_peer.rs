//! A soft-provider peer process for multi-process and multi-namespace tests.
//!
//! Usage: `soft_peer target|initiator [--mem shm|heap] [--sizes N,N,...]`
//! `soft_peer hold` connects and then waits to be killed.
//! `--wait-eof` (target): after the script, wait for stdin to close before
//! printing the counters.
//! `soft_peer victim` is a third process that only registers a region
//! (0xAA bytes) and, when its stdin closes, reports whether it is intact;
//! `soft_peer forge` takes the victim's line and then the real peer's, and
//! connects to the peer with an endpoint forged to name the victim's pid,
//! key table descriptor and region (see `soft_multiprocess.rs`).
//!
//! Each side prints one JSON line with its QP endpoint and region, reads the
//! peer's line from stdin, connects, and runs its part of the script:
//! the initiator writes each size with WRITE_WITH_IMM (immediate = size
//! index), reads it back, runs atomics, and finishes with a SEND; the target
//! verifies every byte of each write when its immediate arrives. Every
//! result is a JSON line on stdout; the exit status is 0 only if all
//! checks passed.

use std::io::{BufRead, Write};
use std::time::Duration;

use ibverbx::{
    AccessFlags, AtomicOp, MemoryRegion, QpEndpoint, QpInitAttr, RecvWr, SendFlags, SendOp, SendWr, WcOpcode, WcStatus,
    WorkCompletion,
};
use rmacomm_tests::pattern;
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize)]
struct Hello {
    endpoint: QpEndpoint,
    addr: u64,
    rkey: u32,
    len: u64,
    /// Descriptor numbers of this process's soft key table and doorbell
    /// table (what a forger would put in an endpoint).
    #[serde(default)]
    fds: Vec<i32>,
}

/// Descriptor numbers of this process's memfd segments named for `uids`.
fn segment_fds(uids: &[u64]) -> Vec<i32> {
    let mut out = Vec::new();
    for uid in uids {
        let name = format!("rmacomm-seg-{uid:016x}");
        for e in std::fs::read_dir("/proc/self/fd").into_iter().flatten().flatten() {
            let target = std::fs::read_link(e.path()).map(|p| p.to_string_lossy().into_owned()).unwrap_or_default();
            if target.contains(&name) {
                out.push(e.file_name().to_string_lossy().parse().unwrap_or(-1));
                break;
            }
        }
    }
    out
}

const WAIT: Duration = Duration::from_secs(60);

fn fail(msg: String) -> ! {
    println!("{}", serde_json::json!({ "error": msg }));
    std::process::exit(1);
}

fn wait1(cq: &ibverbx::CompletionQueue) -> WorkCompletion {
    let mut wc = [WorkCompletion::empty(); 1];
    match cq.wait(&mut wc, Some(WAIT), Duration::ZERO) {
        Ok(1) => wc[0],
        Ok(_) => fail(format!("no completion within {WAIT:?}")),
        Err(e) => fail(format!("poll: {e}")),
    }
}

fn main() {
    let filter = std::env::var("RMACOMM_LOG").unwrap_or_else(|_| "warn".into());
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).try_init();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let role = args.first().cloned().unwrap_or_default();
    let opt = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned();
    let shm = opt("--mem").as_deref() != Some("heap");
    let sizes: Vec<usize> = opt("--sizes")
        .map(|s| s.split(',').map(|x| x.parse().expect("size")).collect())
        .unwrap_or_else(|| vec![0, 1, 4095, 4096, 4097, 1 << 20, 64 << 20]);
    // Each size has its own offset, so that the target can still be
    // checking one write while the next one lands.
    let offsets: Vec<usize> = sizes.iter().scan(0, |acc, &n| Some(std::mem::replace(acc, *acc + n))).collect();
    let max = sizes.iter().sum::<usize>() + 4096;

    let dev = ibverbx::devices().unwrap_or_else(|e| fail(format!("devices: {e}"))).remove(0);
    let ctx = dev.open().unwrap_or_else(|e| fail(format!("open: {e}")));
    let pd = ctx.alloc_pd().unwrap();
    let scq = ctx.create_cq(256).unwrap();
    let rcq = ctx.create_cq(256).unwrap();
    let qp = pd.create_qp(&QpInitAttr::default(), &scq, &rcq).unwrap();
    let region = if shm {
        MemoryRegion::alloc(&pd, max, AccessFlags::all_remote()).unwrap()
    } else {
        MemoryRegion::register(&pd, vec![0u8; max], AccessFlags::all_remote()).unwrap()
    };
    if role == "victim" {
        return victim(&qp, &region);
    }
    if role == "forge" {
        return forge(&qp, &scq, &region);
    }
    qp.modify(&ibverbx::QpTransition::Init(ibverbx::InitAttr::default())).unwrap();
    if role == "target" {
        for i in 0..=sizes.len() {
            qp.post_recv(&[RecvWr { wr_id: i as u64, sg_list: &[region.sge(max - 4096, 4096).unwrap()] }]).unwrap();
        }
    }
    let me = hello(&qp, &region);
    println!("{}", serde_json::to_string(&me).unwrap());
    std::io::stdout().flush().unwrap();
    let mut line = String::new();
    std::io::stdin().lock().read_line(&mut line).unwrap();
    let peer: Hello = serde_json::from_str(&line).unwrap_or_else(|e| fail(format!("peer hello: {e}")));
    qp.connect(&peer.endpoint).unwrap_or_else(|e| fail(format!("connect: {e}")));

    match role.as_str() {
        "target" => {
            for _ in 0..sizes.len() {
                let wc = wait1(&rcq);
                if wc.status != WcStatus::Success || wc.opcode != WcOpcode::RecvRdmaWithImm {
                    fail(format!("unexpected completion {wc:?}"));
                }
                let idx = wc.imm_data.unwrap_or(u32::MAX) as usize;
                let n = *sizes.get(idx).unwrap_or_else(|| fail(format!("bad immediate {idx}")));
                if wc.byte_len as usize != n {
                    fail(format!("byte_len {} for a write of {n}", wc.byte_len));
                }
                let mut got = vec![0u8; n];
                region.read(offsets[idx], &mut got).unwrap();
                if got != pattern(n, idx as u64) {
                    let at = got.iter().zip(pattern(n, idx as u64)).position(|(a, b)| *a != b).unwrap_or(0);
                    fail(format!(
                        "data of the {n}-byte write differs at byte {at}: got {:?}",
                        &got[at..(at + 8).min(n)]
                    ));
                }
                println!("{}", serde_json::json!({ "verified": n }));
            }
            let wc = wait1(&rcq);
            let mut got = vec![0u8; 4];
            region.read(max - 4096, &mut got).unwrap();
            if wc.status != WcStatus::Success || got != b"done" {
                fail(format!("final send: {wc:?} {got:?}"));
            }
            if args.iter().any(|a| a == "--wait-eof") {
                // Report only when told (stdin closed): e.g. at the end of
                // a flood that is still under way.
                println!("{}", serde_json::json!({ "done": true }));
                std::io::stdout().flush().unwrap();
                let mut rest = String::new();
                while std::io::stdin().lock().read_line(&mut rest).map(|n| n > 0).unwrap_or(false) {
                    rest.clear();
                }
            }
            print_stats(&ctx);
            println!("{}", serde_json::json!({ "ok": true }));
        }
        "initiator" => {
            let back = MemoryRegion::alloc(&pd, max, AccessFlags::LOCAL_WRITE).unwrap();
            for (i, &n) in sizes.iter().enumerate() {
                let data = pattern(n, i as u64);
                let off = offsets[i];
                region.write(off, &data).unwrap();
                let s = [region.sge(off, n).unwrap()];
                let op =
                    SendOp::RdmaWriteWithImm { remote_addr: peer.addr + off as u64, rkey: peer.rkey, imm: i as u32 };
                qp.post_send(&[SendWr { wr_id: i as u64, op, sg_list: &s, flags: SendFlags::SIGNALED }]).unwrap();
                let wc = wait1(&scq);
                if !wc.is_ok() {
                    fail(format!("write of {n}: {wc:?}"));
                }
                let b = [back.sge(0, n).unwrap()];
                let op = SendOp::RdmaRead { remote_addr: peer.addr + off as u64, rkey: peer.rkey };
                qp.post_send(&[SendWr { wr_id: 1000 + i as u64, op, sg_list: &b, flags: SendFlags::SIGNALED }])
                    .unwrap();
                let wc = wait1(&scq);
                let mut got = vec![0u8; n];
                back.read(0, &mut got).unwrap();
                if !wc.is_ok() || got != data {
                    fail(format!("read back of {n}: {wc:?}"));
                }
            }
            // Atomics on the word after the largest size.
            let word = (peer.addr + max as u64 - 2048) & !7;
            let r = [back.sge(0, 8).unwrap()];
            for k in 0..100u64 {
                let op = SendOp::Atomic { remote_addr: word, rkey: peer.rkey, op: AtomicOp::FetchAdd { add: 2 } };
                qp.post_send(&[SendWr { wr_id: 5000 + k, op, sg_list: &r, flags: SendFlags::SIGNALED }]).unwrap();
                let wc = wait1(&scq);
                let mut v = [0u8; 8];
                back.read(0, &mut v).unwrap();
                if !wc.is_ok() || u64::from_ne_bytes(v) != 2 * k {
                    fail(format!("fetch-add {k}: {wc:?} returned {}", u64::from_ne_bytes(v)));
                }
            }
            region.write(max - 4096, b"done").unwrap();
            let s = [region.sge(max - 4096, 4).unwrap()];
            qp.post_send(&[SendWr { wr_id: 9999, op: SendOp::Send, sg_list: &s, flags: SendFlags::SIGNALED }]).unwrap();
            let wc = wait1(&scq);
            if !wc.is_ok() {
                fail(format!("final send: {wc:?}"));
            }
            print_stats(&ctx);
            println!("{}", serde_json::json!({ "ok": true }));
        }
        "hold" => {
            println!("{}", serde_json::json!({ "ready": true }));
            std::io::stdout().flush().unwrap();
            std::thread::sleep(Duration::from_secs(600));
        }
        "stream" => {
            // Writes to the peer until an operation fails, then reports it.
            let s = [region.sge(0, 65536).unwrap()];
            println!("{}", serde_json::json!({ "ready": true }));
            std::io::stdout().flush().unwrap();
            let start = std::time::Instant::now();
            for i in 0u64.. {
                let op = SendOp::RdmaWriteWithImm { remote_addr: peer.addr, rkey: peer.rkey, imm: 0 };
                if let Err(e) = qp.post_send(&[SendWr { wr_id: i, op, sg_list: &s, flags: SendFlags::SIGNALED }]) {
                    fail(format!("post: {e}"));
                }
                let wc = wait1(&scq);
                if !wc.is_ok() {
                    println!(
                        "{}",
                        serde_json::json!({ "failed": format!("{}", wc.status), "after_ms": start.elapsed().as_millis() as u64 })
                    );
                    return;
                }
            }
        }
        r => fail(format!("unknown role {r:?}: use target, initiator, hold, stream, victim or forge")),
    }
}

fn hello(qp: &ibverbx::QueuePair, region: &MemoryRegion) -> Hello {
    let endpoint = qp.endpoint().unwrap();
    let soft = endpoint.soft.as_ref().expect("soft provider");
    let fds = segment_fds(&[soft.keytable_uid, soft.doorbell_uid]);
    Hello { endpoint, addr: region.addr(), rkey: region.rkey(), len: region.len() as u64, fds }
}

/// A bystander: its region must never change.
fn victim(qp: &ibverbx::QueuePair, region: &MemoryRegion) {
    region.write(0, &vec![0xAA; region.len()]).unwrap();
    println!("{}", serde_json::to_string(&hello(qp, region)).unwrap());
    std::io::stdout().flush().unwrap();
    let mut line = String::new();
    while std::io::stdin().lock().read_line(&mut line).map(|n| n > 0).unwrap_or(false) {
        line.clear();
    }
    let mut got = vec![0u8; region.len()];
    region.read(0, &mut got).unwrap();
    let changed = got.iter().filter(|b| **b != 0xAA).count();
    println!("{}", serde_json::json!({ "victim_bytes_changed": changed }));
}

/// Connects to the peer with its endpoint forged to name the victim, then
/// writes to the victim's region with the victim's key.
fn forge(qp: &ibverbx::QueuePair, scq: &ibverbx::CompletionQueue, region: &MemoryRegion) {
    let read = || {
        let mut line = String::new();
        std::io::stdin().lock().read_line(&mut line).unwrap();
        serde_json::from_str::<Hello>(&line).unwrap_or_else(|e| fail(format!("hello: {e}")))
    };
    let v = read();
    println!("{}", serde_json::to_string(&hello(qp, region)).unwrap());
    std::io::stdout().flush().unwrap();
    let peer = read();
    let vs = v.endpoint.soft.clone().unwrap();
    let mut ep = peer.endpoint.clone();
    let s = ep.soft.as_mut().unwrap();
    s.pid = vs.pid;
    s.ctx_uid = vs.ctx_uid;
    s.keytable_uid = vs.keytable_uid;
    s.doorbell_uid = vs.doorbell_uid;
    s.keytable_fd = v.fds.first().copied().unwrap_or(-1);
    s.doorbell_fd = v.fds.get(1).copied().unwrap_or(-1);
    s.pd = vs.pd;
    qp.connect(&ep).unwrap_or_else(|e| fail(format!("connect: {e}")));
    region.write(0, &[0x55; 4096]).unwrap();
    let sg = [region.sge(0, 4096).unwrap()];
    let op = SendOp::RdmaWrite { remote_addr: v.addr, rkey: v.rkey };
    qp.post_send(&[SendWr { wr_id: 1, op, sg_list: &sg, flags: SendFlags::SIGNALED }]).unwrap();
    let wc = wait1(scq);
    println!("{}", serde_json::json!({ "forged_write": format!("{}", wc.status) }));
}

/// This side's soft doorbell counters, as a JSON line.
fn print_stats(ctx: &ibverbx::Context) {
    if let Some(s) = ibverbx::soft::stats(ctx) {
        println!(
            "{}",
            serde_json::json!({
                "doorbell_claimed": s.doorbell_claimed,
                "doorbell_retracted": s.doorbell_retracted,
                "doorbell_rings": s.doorbell_rings,
                "peer_segments_mapped": s.peer_segments_mapped,
                "attach_refused": s.attach_refused,
                "handshakes_evicted": s.handshakes_evicted,
                "open_fds": std::fs::read_dir("/proc/self/fd").map(|d| d.count()).unwrap_or(0)
            })
        );
    }
}
