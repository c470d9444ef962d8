//! Soft-provider bandwidth and latency between two processes, each figure
//! beside its ceiling measured in the same run.
//!
//! ```text
//! cargo run --release -p ibverbx --example soft_bw                 # shm and tcp, 64 KiB … 256 MiB
//! cargo run --release -p ibverbx --example soft_bw -- --link tcp --sizes 1M,16M --json
//! ```
//!
//! The parent is the initiator; it starts itself again as the target
//! process. RDMA WRITE bandwidth is set beside a single-thread memcpy of the
//! same size (shm link) or a plain TCP socket stream between the same two
//! processes (tcp link). Latency is half the round trip of an 8-byte
//! WRITE_WITH_IMM ping-pong (busy-polled), beside a plain 8-byte TCP
//! ping-pong between the same processes.

use std::io::{BufRead, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ibverbx::soft::{SoftConfig, SoftLink, SoftProvider};
use ibverbx::{
    AccessFlags, CompletionQueue, MemoryRegion, QpEndpoint, QpInitAttr, QueuePair, RecvWr, SendFlags, SendOp, SendWr,
    WorkCompletion,
};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize)]
struct Hello {
    endpoint: QpEndpoint,
    addr: u64,
    rkey: u32,
    raw_port: u16,
}

const LAT_ITERS: usize = 20_000;
const DEPTH: usize = 16;

fn parse_size(s: &str) -> usize {
    let s = s.trim();
    let (num, mul) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1 << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<usize>().expect("size") * mul
}

fn human(n: usize) -> String {
    if n >= 1 << 20 {
        format!("{}MiB", n >> 20)
    } else if n >= 1 << 10 {
        format!("{}KiB", n >> 10)
    } else {
        format!("{n}B")
    }
}

fn wait(cq: &CompletionQueue, out: &mut [WorkCompletion], spin: bool) -> usize {
    let spin = if spin { Duration::from_secs(3600) } else { Duration::ZERO };
    let n = cq.wait(out, Some(Duration::from_secs(60)), spin).expect("poll");
    assert!(n > 0, "no completion within 60 s");
    for wc in &out[..n] {
        assert!(wc.is_ok(), "{wc:?}");
    }
    n
}

struct Side {
    scq: CompletionQueue,
    rcq: CompletionQueue,
    qp: QueuePair,
    mem: MemoryRegion,
}

fn setup(link: SoftLink, len: usize) -> Side {
    let dev = SoftProvider::new(SoftConfig { link, ..SoftConfig::default() }).device();
    let ctx = dev.open().expect("open soft0");
    let pd = ctx.alloc_pd().unwrap();
    let scq = ctx.create_cq(4096).unwrap();
    let rcq = ctx.create_cq(4096).unwrap();
    let qp = pd
        .create_qp(
            &QpInitAttr {
                caps: ibverbx::QpCaps { max_send_wr: 1024, max_recv_wr: 1024, ..Default::default() },
                sq_sig_all: false,
            },
            &scq,
            &rcq,
        )
        .unwrap();
    let mem = MemoryRegion::alloc(&pd, len, AccessFlags::all_remote()).unwrap();
    qp.modify(&ibverbx::QpTransition::Init(ibverbx::InitAttr::default())).unwrap();
    Side { scq, rcq, qp, mem }
}

fn post_recvs(s: &Side, n: usize) {
    for i in 0..n {
        s.qp.post_recv(&[RecvWr { wr_id: i as u64, sg_list: &[] }]).unwrap();
    }
}

/// One 8-byte WRITE_WITH_IMM of the latency ping-pong; every 256th is
/// signaled, so that the send queue drains.
fn ping(s: &Side, peer: &Hello, src: &[ibverbx::Sge], n: u64) {
    let op = SendOp::RdmaWriteWithImm { remote_addr: peer.addr, rkey: peer.rkey, imm: 0 };
    let flags = SendFlags { signaled: n.is_multiple_of(256), ..SendFlags::UNSIGNALED };
    s.qp.post_send(&[SendWr { wr_id: n, op, sg_list: src, flags }]).unwrap();
}

/// The target process: answers RDMA passively, echoes ping-pongs, sinks the
/// raw TCP stream and answers raw ping-pongs.
fn serve(link: SoftLink, len: usize) {
    let s = setup(link, len);
    post_recvs(&s, 1024);
    let raw = TcpListener::bind("127.0.0.1:0").unwrap();
    let me = Hello {
        endpoint: s.qp.endpoint().unwrap(),
        addr: s.mem.addr(),
        rkey: s.mem.rkey(),
        raw_port: raw.local_addr().unwrap().port(),
    };
    println!("{}", serde_json::to_string(&me).unwrap());
    std::io::stdout().flush().unwrap();
    let mut line = String::new();
    std::io::stdin().lock().read_line(&mut line).unwrap();
    let peer: Hello = serde_json::from_str(&line).unwrap();
    s.qp.connect(&peer.endpoint).unwrap();
    let buf_len = len;
    std::thread::spawn(move || {
        for conn in raw.incoming() {
            let mut c = conn.unwrap();
            c.set_nodelay(true).unwrap();
            let mut cmd = [0u8; 9];
            if c.read_exact(&mut cmd).is_err() {
                continue;
            }
            let n = u64::from_le_bytes(cmd[1..].try_into().unwrap()) as usize;
            if cmd[0] == b'S' {
                // Stream sink: read n bytes into one buffer, then ack.
                let mut buf = vec![0u8; buf_len.min(1 << 28)];
                let mut left = n;
                while left > 0 {
                    let m = left.min(buf.len());
                    let k = c.read(&mut buf[..m]).unwrap();
                    assert!(k > 0);
                    left -= k;
                }
                c.write_all(&[1]).unwrap();
            } else {
                // Ping-pong: n rounds of 8 bytes.
                let mut b = [0u8; 8];
                for _ in 0..n {
                    c.read_exact(&mut b).unwrap();
                    c.write_all(&b).unwrap();
                }
            }
        }
    });
    // Echo every WRITE_WITH_IMM back until the parent closes stdin.
    let src = [s.mem.sge(0, 8).unwrap()];
    let mut wc = [WorkCompletion::empty(); 64];
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let st = stop.clone();
    std::thread::spawn(move || {
        let mut l = String::new();
        let _ = std::io::stdin().lock().read_line(&mut l);
        st.store(true, std::sync::atomic::Ordering::SeqCst);
    });
    let mut sent = 0u64;
    let mut busy = false;
    while !stop.load(std::sync::atomic::Ordering::SeqCst) {
        // Spin only while ping-pongs are flowing: an idle target must not
        // take a core from the initiator during the bandwidth runs.
        let spin = if busy { Duration::from_millis(50) } else { Duration::ZERO };
        let n = s.rcq.wait(&mut wc, Some(Duration::from_millis(200)), spin).unwrap();
        busy = n > 0;
        for _ in 0..n {
            s.qp.post_recv(&[RecvWr { wr_id: 0, sg_list: &[] }]).unwrap();
            sent += 1;
            ping(&s, &peer, &src, sent);
        }
        let mut scq = [WorkCompletion::empty(); 16];
        let _ = s.scq.poll(&mut scq);
    }
}

struct Row {
    link: &'static str,
    test: &'static str,
    size: usize,
    ours: f64,
    ceiling: f64,
    unit: &'static str,
    ceiling_name: &'static str,
}

fn run_link(link: SoftLink, sizes: &[usize], rows: &mut Vec<Row>, quick: bool, spin_bw: bool) {
    let name = if link == SoftLink::Shm { "shm" } else { "tcp" };
    let max = *sizes.iter().max().unwrap();
    let exe = std::env::current_exe().unwrap();
    let mut child = Command::new(exe)
        .args(["--serve", name, "--len", &max.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn target process");
    let mut cin = child.stdin.take().unwrap();
    let mut cout = std::io::BufReader::new(child.stdout.take().unwrap());
    let s = setup(link, max);
    post_recvs(&s, 1024);
    let me = Hello { endpoint: s.qp.endpoint().unwrap(), addr: s.mem.addr(), rkey: s.mem.rkey(), raw_port: 0 };
    writeln!(cin, "{}", serde_json::to_string(&me).unwrap()).unwrap();
    cin.flush().unwrap();
    let mut line = String::new();
    cout.read_line(&mut line).unwrap();
    let peer: Hello = serde_json::from_str(&line).unwrap();
    s.qp.connect(&peer.endpoint).unwrap();
    let budget: usize = if quick { 256 << 20 } else { 2 << 30 };

    for &size in sizes {
        let iters = (budget / size).clamp(8, 200_000);
        // Pattern in, checksum out: the data is verified at the end.
        let data: Vec<u8> = (0..size).map(|i| (i * 7 + size) as u8).collect();
        s.mem.write(0, &data).unwrap();
        let sge = [s.mem.sge(0, size).unwrap()];
        let op = SendOp::RdmaWrite { remote_addr: peer.addr, rkey: peer.rkey };
        let mut wc = [WorkCompletion::empty(); DEPTH];
        let mut run = |n: usize| {
            let t = Instant::now();
            let (mut posted, mut done) = (0, 0);
            while done < n {
                while posted < n && posted - done < DEPTH {
                    s.qp.post_send(&[SendWr { wr_id: posted as u64, op, sg_list: &sge, flags: SendFlags::SIGNALED }])
                        .unwrap();
                    posted += 1;
                }
                // Spin where this thread copies (same-host sizes up to the
                // posting-thread limit); sleep where the engine thread does.
                done += wait(&s.scq, &mut wc, spin_bw && size <= SoftConfig::default().inline_copy_max);
            }
            t.elapsed()
        };
        run((iters / 10).max(2));
        let t = run(iters);
        let ours = (size * iters) as f64 / t.as_secs_f64() / 1e9;
        // Read the target's copy back and compare.
        let back = s.mem.sge(0, size).unwrap();
        s.mem.write(0, &vec![0u8; size]).unwrap();
        s.qp.post_send(&[SendWr {
            wr_id: 0,
            op: SendOp::RdmaRead { remote_addr: peer.addr, rkey: peer.rkey },
            sg_list: &[back],
            flags: SendFlags::SIGNALED,
        }])
        .unwrap();
        wait(&s.scq, &mut wc[..1], false);
        let mut got = vec![0u8; size];
        s.mem.read(0, &mut got).unwrap();
        assert!(got == data, "data at the target differs after the {size}-byte benchmark");

        let ceiling = if link == SoftLink::Shm {
            let a = vec![1u8; size];
            let mut b = vec![2u8; size];
            for _ in 0..(iters / 10).max(2) {
                b.copy_from_slice(&a);
            }
            let t = Instant::now();
            for _ in 0..iters {
                b.copy_from_slice(std::hint::black_box(&a));
                std::hint::black_box(&mut b);
            }
            (size * iters) as f64 / t.elapsed().as_secs_f64() / 1e9
        } else {
            let total = size * iters;
            let mut c = TcpStream::connect(("127.0.0.1", peer.raw_port)).unwrap();
            c.set_nodelay(true).unwrap();
            let mut cmd = vec![b'S'];
            cmd.extend_from_slice(&(total as u64).to_le_bytes());
            c.write_all(&cmd).unwrap();
            let t = Instant::now();
            for _ in 0..iters {
                c.write_all(&data).unwrap();
            }
            let mut ack = [0u8; 1];
            c.read_exact(&mut ack).unwrap();
            total as f64 / t.elapsed().as_secs_f64() / 1e9
        };
        rows.push(Row {
            link: name,
            test: "write_bw",
            size,
            ours,
            ceiling,
            unit: "GB/s",
            ceiling_name: if link == SoftLink::Shm { "memcpy" } else { "tcp socket" },
        });
        eprintln!("  {name} write {:>7}: {ours:6.2} GB/s  ceiling {ceiling:6.2} GB/s", human(size));
    }

    // Latency: 8-byte WRITE_WITH_IMM ping-pong, busy-polled (sleeping
    // threads wake slowly on virtual machines).
    let lat_spin = true;
    let iters = if quick { LAT_ITERS / 10 } else { LAT_ITERS };
    let src = [s.mem.sge(0, 8).unwrap()];
    let mut wc = [WorkCompletion::empty(); 1];
    let mut rtts = Vec::with_capacity(iters);
    let mut sent = 0u64;
    for i in 0..iters + iters / 10 {
        let t = Instant::now();
        sent += 1;
        ping(&s, &peer, &src, sent);
        wait(&s.rcq, &mut wc, lat_spin);
        s.qp.post_recv(&[RecvWr { wr_id: 0, sg_list: &[] }]).unwrap();
        if i >= iters / 10 {
            rtts.push(t.elapsed());
        }
        let mut scq = [WorkCompletion::empty(); 4];
        let _ = s.scq.poll(&mut scq);
    }
    rtts.sort();
    let ours = rtts[rtts.len() / 2].as_secs_f64() * 1e6 / 2.0;
    let mut c = TcpStream::connect(("127.0.0.1", peer.raw_port)).unwrap();
    c.set_nodelay(true).unwrap();
    let mut cmd = vec![b'P'];
    cmd.extend_from_slice(&(iters as u64).to_le_bytes());
    c.write_all(&cmd).unwrap();
    let mut raw = Vec::with_capacity(iters);
    let mut b = [0u8; 8];
    for _ in 0..iters {
        let t = Instant::now();
        c.write_all(&b).unwrap();
        c.read_exact(&mut b).unwrap();
        raw.push(t.elapsed());
    }
    raw.sort();
    let ceiling = raw[raw.len() / 2].as_secs_f64() * 1e6 / 2.0;
    eprintln!("  {name} 8B write_with_imm latency: {ours:.2} us (tcp socket ping-pong {ceiling:.2} us)");
    rows.push(Row {
        link: name,
        test: "write_imm_lat",
        size: 8,
        ours,
        ceiling,
        unit: "us",
        ceiling_name: "tcp socket",
    });
    drop(cin);
    let _ = child.wait();
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let opt = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned();
    if let Some(l) = opt("--serve") {
        let link = SoftLink::parse(&l).expect("link");
        let len: usize = opt("--len").unwrap().parse().unwrap();
        return serve(link, len);
    }
    let sizes: Vec<usize> = opt("--sizes")
        .map(|s| s.split(',').map(parse_size).collect())
        .unwrap_or_else(|| vec![64 << 10, 1 << 20, 16 << 20, 256 << 20]);
    let links: Vec<SoftLink> = opt("--link")
        .map(|s| s.split(',').map(|l| SoftLink::parse(l).expect("--link shm|tcp")).collect())
        .unwrap_or_else(|| vec![SoftLink::Shm, SoftLink::Tcp]);
    let quick = args.iter().any(|a| a == "--quick");
    let json = args.iter().any(|a| a == "--json");
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    eprintln!("rmacomm soft provider, two processes on this host ({cores} cores)");
    let mut rows = Vec::new();
    for link in links {
        // Busy-poll the CQ as perftest does, except where the TCP link's
        // progress threads need both cores.
        let spin = match opt("--busy-poll").as_deref() {
            Some("on") => true,
            Some("off") => false,
            _ => link == SoftLink::Shm,
        };
        run_link(link, &sizes, &mut rows, quick, spin);
    }
    if json {
        for r in &rows {
            println!(
                "{}",
                serde_json::json!({"link": r.link, "test": r.test, "bytes": r.size, "rmacomm": r.ours,
                    "ceiling": r.ceiling, "ceiling_is": r.ceiling_name, "unit": r.unit,
                    "ratio": if r.unit == "us" { r.ceiling / r.ours } else { r.ours / r.ceiling }})
            );
        }
        return;
    }
    println!(
        "{:<5} {:<14} {:>8} {:>12} {:>12} {:>14} {:>7}",
        "link", "test", "bytes", "rmacomm", "ceiling", "ceiling is", "ratio"
    );
    for r in &rows {
        // Ratio > 1 is better than the ceiling: bandwidth ours/ceiling,
        // latency ceiling/ours.
        let ratio = if r.unit == "us" { r.ceiling / r.ours } else { r.ours / r.ceiling };
        println!(
            "{:<5} {:<14} {:>8} {:>7.2} {:<4} {:>7.2} {:<4} {:>14} {:>7.2}",
            r.link,
            r.test,
            human(r.size),
            r.ours,
            r.unit,
            r.ceiling,
            r.unit,
            r.ceiling_name,
            ratio
        );
    }
}
