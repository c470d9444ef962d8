//! VirtualQp between two processes on the soft provider, under seeded
//! chaos: DQPLB and spray, 1, 4 and 16 QPs, 1 KiB … 64 MiB, shared memory
//! and TCP. The peers (`vqp_peer`) verify every byte, and that completions
//! arrive once, in order, with the user's immediate.

use std::time::Duration;

use rmacomm_tests::harness::{introduce, Peer};

const PEER: &str = env!("CARGO_BIN_EXE_vqp_peer");
const SIZES: &str = "1024,4097,65536,1048576,67108864";

fn run_pair(lb: &str, qps: u32, link: &str, seed: u64) {
    let qps = qps.to_string();
    let seed = seed.to_string();
    let args = ["--lb", lb, "--qps", &qps, "--sizes", SIZES];
    // The peers' soft QPs warn when the other process exits first; only
    // errors are worth showing here.
    let log = std::env::var("RMACOMM_LOG").unwrap_or_else(|_| "error".into());
    let env = [("RMACOMM_SOFT_CHAOS", seed.as_str()), ("RMACOMM_SOFT_LINK", link), ("RMACOMM_LOG", log.as_str())];
    let t = Peer::spawn("target", PEER, &[], &[&["target"], &args[..]].concat(), &env);
    let i = Peer::spawn("initiator", PEER, &[], &[&["initiator"], &args[..]].concat(), &env);
    let (mut t, i) = introduce(t, i);
    let (ti, ok_i) = i.finish(Duration::from_secs(240));
    t.close_stdin(); // lets the target finish
    let (tt, ok_t) = t.finish(Duration::from_secs(30));
    assert!(ok_i && ok_t, "{lb} {qps} QPs {link}\ninitiator: {ti:?}\ntarget: {tt:?}");
    let n = SIZES.split(',').count();
    assert_eq!(tt.iter().filter(|l| l.contains("verified")).count(), n, "target: {tt:?}");
    let imms = tt.iter().filter(|l| l.contains("\"imm\"")).count();
    assert_eq!(imms, n.div_ceil(2), "target: {tt:?}");
    assert!(ti.iter().any(|l| l.contains("read_back")), "initiator: {ti:?}");
    if lb == "dqplb" && qps != "1" {
        // The chaos did reorder fragments across the physical QPs.
        let stats = tt.iter().find(|l| l.contains("out_of_order")).expect("target stats");
        let v: serde_json::Value = serde_json::from_str(stats).unwrap();
        assert!(v["out_of_order"].as_u64().unwrap() > 0, "no fragment arrived out of order: {stats}");
    }
}

#[test]
fn dqplb_shm_1_4_16_qps() {
    for (qps, seed) in [(1, 11), (4, 12), (16, 13)] {
        run_pair("dqplb", qps, "shm", seed);
    }
}

#[test]
fn spray_shm_1_4_16_qps() {
    for (qps, seed) in [(1, 21), (4, 22), (16, 23)] {
        run_pair("spray", qps, "shm", seed);
    }
}

#[test]
fn dqplb_tcp_4_qps() {
    run_pair("dqplb", 4, "tcp", 31);
}

#[test]
fn spray_tcp_16_qps() {
    run_pair("spray", 16, "tcp", 41);
}
