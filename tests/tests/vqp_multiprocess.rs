//! VirtualQp between two processes on the soft provider, under seeded
//! chaos: DQPLB and spray, 1, 4 and 16 QPs, 1 KiB … 64 MiB, shared memory
//! and TCP. The peers (`vqp_peer`) verify every byte, and that completions
//! arrive once, in order, with the user's immediate.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const PEER: &str = env!("CARGO_BIN_EXE_vqp_peer");
const SIZES: &str = "1024,4097,65536,1048576,67108864";

struct Peer {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
    name: &'static str,
}

impl Peer {
    fn spawn(name: &'static str, args: &[&str], env: &[(&str, &str)]) -> Peer {
        let mut cmd = Command::new(PEER);
        cmd.args(args).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::inherit());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn vqp_peer");
        let stdout = child.stdout.take().unwrap();
        let stdin = child.stdin.take();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Peer { child, stdin, lines: rx, name }
    }

    fn line(&self, timeout: Duration) -> String {
        self.lines.recv_timeout(timeout).unwrap_or_else(|_| panic!("{}: no output within {timeout:?}", self.name))
    }

    fn send(&mut self, line: &str) {
        let s = self.stdin.as_mut().unwrap();
        writeln!(s, "{line}").unwrap();
        s.flush().unwrap();
    }

    /// Collects the remaining lines and the exit status; a peer that
    /// outlives `timeout` is killed and the test fails rather than hangs.
    fn finish(mut self, timeout: Duration) -> (Vec<String>, bool) {
        let deadline = Instant::now() + timeout;
        let mut out = Vec::new();
        loop {
            out.extend(self.lines.try_iter());
            if let Some(st) = self.child.try_wait().unwrap() {
                std::thread::sleep(Duration::from_millis(20));
                out.extend(self.lines.try_iter());
                return (out, st.success());
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                panic!("{} did not finish within {timeout:?}; output so far: {out:?}", self.name);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn run_pair(lb: &str, qps: u32, link: &str, seed: u64) {
    let qps = qps.to_string();
    let seed = seed.to_string();
    let args = ["--lb", lb, "--qps", &qps, "--sizes", SIZES];
    // The peers' soft QPs warn when the other process exits first; only
    // errors are worth showing here.
    let log = std::env::var("RMACOMM_LOG").unwrap_or_else(|_| "error".into());
    let env = [("RMACOMM_SOFT_CHAOS", seed.as_str()), ("RMACOMM_SOFT_LINK", link), ("RMACOMM_LOG", log.as_str())];
    let mut t = Peer::spawn("target", &[&["target"], &args[..]].concat(), &env);
    let mut i = Peer::spawn("initiator", &[&["initiator"], &args[..]].concat(), &env);
    let ht = t.line(Duration::from_secs(30));
    let hi = i.line(Duration::from_secs(30));
    t.send(&hi);
    i.send(&ht);
    let (ti, ok_i) = i.finish(Duration::from_secs(240));
    t.stdin = None; // lets the target finish
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
