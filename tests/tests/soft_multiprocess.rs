//! The soft provider between real processes: same host (shared memory and
//! TCP) and two network namespaces joined by a veth pair (TCP over a real
//! interface). Every byte is verified by the peers themselves.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const PEER: &str = env!("CARGO_BIN_EXE_soft_peer");

struct Peer {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
    name: &'static str,
}

impl Peer {
    fn spawn(name: &'static str, prefix: &[String], args: &[&str], env: &[(&str, &str)]) -> Peer {
        let mut cmd = if prefix.is_empty() {
            Command::new(PEER)
        } else {
            let mut c = Command::new(&prefix[0]);
            c.args(&prefix[1..]).arg(PEER);
            c
        };
        cmd.args(args).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::inherit());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn soft_peer");
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

    /// Collects the remaining lines and the exit status, killing the peer
    /// if it outlives `timeout`.
    fn finish(mut self, timeout: Duration) -> (Vec<String>, bool) {
        let deadline = Instant::now() + timeout;
        let mut out = Vec::new();
        loop {
            while let Ok(l) = self.lines.try_recv() {
                out.push(l);
            }
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

/// Starts target and initiator, swaps their endpoints, and checks both
/// succeed with every size verified.
fn run_pair(prefix_t: &[String], prefix_i: &[String], args: &[&str], env: &[(&str, &str)]) {
    let mut t = Peer::spawn("target", prefix_t, &[&["target"], args].concat(), env);
    let mut i = Peer::spawn("initiator", prefix_i, &[&["initiator"], args].concat(), env);
    let ht = t.line(Duration::from_secs(30));
    let hi = i.line(Duration::from_secs(30));
    t.send(&hi);
    i.send(&ht);
    let (ti, ok_i) = i.finish(Duration::from_secs(180));
    let (tt, ok_t) = t.finish(Duration::from_secs(30));
    assert!(ok_i && ok_t, "initiator: {ti:?}\ntarget: {tt:?}");
    let verified = tt.iter().filter(|l| l.contains("verified")).count();
    let expected = args.iter().position(|a| *a == "--sizes").map(|p| args[p + 1].split(',').count()).unwrap_or(7);
    assert_eq!(verified, expected, "target output: {tt:?}");
    assert!(ti.iter().any(|l| l.contains("\"ok\":true")), "{ti:?}");
}

#[test]
fn shm_two_processes_shared_segments() {
    run_pair(&[], &[], &["--mem", "shm"], &[("RMACOMM_SOFT_LINK", "shm")]);
}

#[test]
fn shm_two_processes_heap_memory() {
    // Heap regions go by process_vm_writev/readv (or staged if refused).
    run_pair(&[], &[], &["--mem", "heap"], &[("RMACOMM_SOFT_LINK", "shm")]);
}

#[test]
fn tcp_two_processes() {
    run_pair(&[], &[], &["--mem", "heap"], &[("RMACOMM_SOFT_LINK", "tcp")]);
}

/// Two network namespaces joined by a veth pair; removed on drop.
struct NetnsPair {
    a: String,
    b: String,
}

impl NetnsPair {
    fn create() -> Result<NetnsPair, String> {
        let out = Command::new("id").arg("-u").output().map_err(|e| e.to_string())?;
        if String::from_utf8_lossy(&out.stdout).trim() != "0" {
            return Err("not root".into());
        }
        if Command::new("ip").arg("-V").output().is_err() {
            return Err("the `ip` command (iproute2) is not installed".into());
        }
        let id = std::process::id() % 100_000;
        let (a, b) = (format!("rmc{id}a"), format!("rmc{id}b"));
        let (va, vb) = (format!("rmv{id}a"), format!("rmv{id}b"));
        let net = id % 250 + 1;
        let pair = NetnsPair { a: a.clone(), b: b.clone() };
        let ip = |args: &[&str]| -> Result<(), String> {
            let o = Command::new("ip").args(args).output().map_err(|e| e.to_string())?;
            if o.status.success() {
                Ok(())
            } else {
                Err(format!("ip {}: {}", args.join(" "), String::from_utf8_lossy(&o.stderr).trim()))
            }
        };
        let ipa = format!("10.213.{net}.1/24");
        let ipb = format!("10.213.{net}.2/24");
        ip(&["netns", "add", &a])?;
        ip(&["netns", "add", &b])?;
        ip(&["link", "add", &va, "type", "veth", "peer", "name", &vb])?;
        ip(&["link", "set", &va, "netns", &a])?;
        ip(&["link", "set", &vb, "netns", &b])?;
        ip(&["-n", &a, "addr", "add", &ipa, "dev", &va])?;
        ip(&["-n", &b, "addr", "add", &ipb, "dev", &vb])?;
        for (ns, dev) in [(&a, &va), (&b, &vb)] {
            ip(&["-n", ns, "link", "set", dev, "up"])?;
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
        }
        Ok(pair)
    }

    fn prefix(ns: &str) -> Vec<String> {
        vec!["ip".into(), "netns".into(), "exec".into(), ns.into()]
    }
}

impl Drop for NetnsPair {
    fn drop(&mut self) {
        for ns in [&self.a, &self.b] {
            let _ = Command::new("ip").args(["netns", "del", ns]).output();
        }
    }
}

#[test]
fn tcp_two_network_namespaces() {
    let ns = match NetnsPair::create() {
        Ok(ns) => ns,
        Err(why) => {
            println!("skipped: two network namespaces need root and iproute2 ({why})");
            return;
        }
    };
    // Different network namespaces are different hosts to the soft
    // provider: auto picks TCP, across the veth pair.
    run_pair(&NetnsPair::prefix(&ns.a), &NetnsPair::prefix(&ns.b), &["--mem", "shm"], &[("RMACOMM_SOFT_LINK", "auto")]);
}

/// A peer killed mid-stream: the survivor's next operations fail with an
/// error completion, never hang.
fn dead_peer(link: &str) {
    let env = [("RMACOMM_SOFT_LINK", link)];
    let mut t = Peer::spawn("holder", &[], &["hold", "--sizes", "65536"], &env);
    let mut i = Peer::spawn("streamer", &[], &["stream", "--sizes", "65536"], &env);
    let ht = t.line(Duration::from_secs(30));
    let hi = i.line(Duration::from_secs(30));
    t.send(&hi);
    i.send(&ht);
    assert!(t.line(Duration::from_secs(30)).contains("ready"));
    assert!(i.line(Duration::from_secs(30)).contains("ready"));
    // The holder never posts receives: WRITE_WITH_IMM waits in RNR, which is
    // fine — what matters is what happens when the holder dies.
    std::thread::sleep(Duration::from_millis(200));
    t.child.kill().unwrap();
    let (out, _) = i.finish(Duration::from_secs(30));
    let failed = out.iter().find(|l| l.contains("failed")).unwrap_or_else(|| panic!("no failure reported: {out:?}"));
    assert!(
        failed.contains("retry") || failed.contains("Flush") || failed.contains("RNR"),
        "unexpected failure: {failed}"
    );
}

#[test]
fn dead_peer_shm() {
    dead_peer("shm");
}

#[test]
fn dead_peer_tcp() {
    dead_peer("tcp");
}
