//! Process and network-namespace plumbing shared by the multi-process
//! tests: peers that speak JSON lines on stdin/stdout, and pairs of network
//! namespaces joined by a veth pair.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// A peer process whose stdout lines are collected by a thread.
#[derive(Debug)]
pub struct Peer {
    /// The process.
    pub child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
    name: &'static str,
}

impl Peer {
    /// Starts `exe args` (behind `prefix`, e.g. `ip netns exec NS`).
    pub fn spawn(name: &'static str, exe: &str, prefix: &[String], args: &[&str], env: &[(&str, &str)]) -> Peer {
        let mut cmd = if prefix.is_empty() {
            Command::new(exe)
        } else {
            let mut c = Command::new(&prefix[0]);
            c.args(&prefix[1..]).arg(exe);
            c
        };
        cmd.args(args).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::inherit());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn peer process");
        let stdout = child.stdout.take().expect("piped");
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

    /// The next stdout line; panics after `timeout`.
    pub fn line(&self, timeout: Duration) -> String {
        self.lines.recv_timeout(timeout).unwrap_or_else(|_| panic!("{}: no output within {timeout:?}", self.name))
    }

    /// Writes one line to the peer's stdin.
    pub fn send(&mut self, line: &str) {
        let s = self.stdin.as_mut().expect("stdin");
        writeln!(s, "{line}").expect("write to peer");
        s.flush().expect("flush to peer");
    }

    /// Closes the peer's stdin (peers that wait for EOF then finish).
    pub fn close_stdin(&mut self) {
        self.stdin = None;
    }

    /// Collects the remaining lines and whether the peer exited with 0,
    /// killing it if it outlives `timeout`.
    pub fn finish(mut self, timeout: Duration) -> (Vec<String>, bool) {
        let deadline = Instant::now() + timeout;
        let mut out = Vec::new();
        loop {
            while let Ok(l) = self.lines.try_recv() {
                out.push(l);
            }
            if let Some(st) = self.child.try_wait().expect("wait") {
                // Up to the end of its stdout (the reader thread hangs up
                // there): a loaded machine may not have read the last
                // lines yet.
                let eof = Instant::now() + Duration::from_secs(5);
                while let Ok(l) = self.lines.recv_timeout(eof.saturating_duration_since(Instant::now())) {
                    out.push(l);
                }
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

/// Starts two peers, hands each the other's first line (its hello), and
/// returns both.
pub fn introduce(mut a: Peer, mut b: Peer) -> (Peer, Peer) {
    let ha = a.line(Duration::from_secs(30));
    let hb = b.line(Duration::from_secs(30));
    a.send(&hb);
    b.send(&ha);
    (a, b)
}

/// Two network namespaces joined by a veth pair (10.213.N.1/24 and .2);
/// removed on drop.
#[derive(Debug)]
pub struct NetnsPair {
    /// First namespace.
    pub a: String,
    /// Second namespace.
    pub b: String,
    /// The address of `a`'s end of the veth pair (`10.213.N.1`).
    pub addr_a: String,
    /// The address of `b`'s end (`10.213.N.2`).
    pub addr_b: String,
    /// The name of `a`'s veth interface (for `RMACOMM_SOCKET_IFNAME`).
    pub dev_a: String,
    /// The name of `b`'s veth interface.
    pub dev_b: String,
}

impl NetnsPair {
    /// Creates the pair, or says why it cannot (not root, no iproute2).
    pub fn create() -> Result<NetnsPair, String> {
        let out = Command::new("id").arg("-u").output().map_err(|e| e.to_string())?;
        if String::from_utf8_lossy(&out.stdout).trim() != "0" {
            return Err("not root".into());
        }
        if Command::new("ip").arg("-V").output().is_err() {
            return Err("the `ip` command (iproute2) is not installed".into());
        }
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let id = (std::process::id() % 10_000) * 10 + NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % 10;
        let (a, b) = (format!("rmc{id}a"), format!("rmc{id}b"));
        let (va, vb) = (format!("rmv{id}a"), format!("rmv{id}b"));
        let net = id % 250 + 1;
        let pair = NetnsPair {
            a: a.clone(),
            b: b.clone(),
            addr_a: format!("10.213.{net}.1"),
            addr_b: format!("10.213.{net}.2"),
            dev_a: va.clone(),
            dev_b: vb.clone(),
        };
        let ip = |args: &[&str]| -> Result<(), String> {
            let o = Command::new("ip").args(args).output().map_err(|e| e.to_string())?;
            if o.status.success() {
                Ok(())
            } else {
                Err(format!("ip {}: {}", args.join(" "), String::from_utf8_lossy(&o.stderr).trim()))
            }
        };
        let ipa = format!("{}/24", pair.addr_a);
        let ipb = format!("{}/24", pair.addr_b);
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

    /// The command prefix that runs a program in namespace `ns`.
    pub fn prefix(ns: &str) -> Vec<String> {
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
