//! What the transport layer costs: RDMA WRITE bandwidth and single-write
//! latency through `RdmaTransport`, beside the same writes posted on a raw
//! `ibverbx::VirtualQp` with the same configuration, in the same run,
//! between two processes, at the sizes of torchcomms' published table.
//!
//! ```text
//! cargo run --release -p rmacomm-transport --example transport_bench            # soft: shm and tcp
//! cargo run --release -p rmacomm-transport --example transport_bench -- --link tcp --json
//! cargo run --release -p rmacomm-transport --example transport_bench -- --provider verbs   # an HCA (loopback)
//! ```
//!
//! Bandwidth keeps 16 writes in flight; latency is the median time of one
//! write from the call to its completion (data placed at the peer). Every
//! run reads the peer's buffers back at the end and checks them.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ibverbx::soft::{SoftConfig, SoftLink, SoftProvider};
use ibverbx::{
    AccessFlags, MemoryRegion, SendFlags, SendOp, SendWr, VirtualCq, VirtualQp, VirtualQpEndpoint, WorkCompletion,
};
use rmacomm_transport::{RdmaMemory, RdmaRemoteBuffer, RdmaTransport, TransportConfig};
use serde::{Deserialize, Serialize};

const SIZES: [usize; 5] = [8 << 10, 64 << 10, 1 << 20, 16 << 20, 256 << 20];
const WINDOW: usize = 16;

#[derive(Serialize, Deserialize)]
struct Hello {
    url: String,
    rb: RdmaRemoteBuffer,
    vqp: VirtualQpEndpoint,
    raw_addr: u64,
    raw_rkey: u32,
}

/// The transport's settings; the raw virtual QP gets the same ones.
fn tconfig() -> TransportConfig {
    TransportConfig::default().with_timeout(Some(Duration::from_secs(60)))
}

/// Where the bytes go: the soft provider over one link, or the verbs
/// provider (an HCA; `RMACOMM_IB_HCA` picks it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Via {
    Soft(SoftLink),
    Verbs,
}

impl Via {
    fn name(self) -> &'static str {
        match self {
            Via::Soft(SoftLink::Tcp) => "tcp",
            Via::Soft(_) => "shm",
            Via::Verbs => "verbs",
        }
    }

    fn parse(s: &str) -> Via {
        if s == "verbs" {
            Via::Verbs
        } else {
            Via::Soft(SoftLink::parse(s).expect("shm, tcp or verbs"))
        }
    }

    fn device(self) -> ibverbx::Device {
        match self {
            Via::Soft(link) => SoftProvider::new(SoftConfig { link, ..SoftConfig::default() }).device(),
            Via::Verbs => match ibverbx::devices_of(ibverbx::ProviderKind::Verbs) {
                Ok(mut d) if !d.is_empty() => d.remove(0),
                Ok(_) => panic!("the verbs provider lists no device"),
                Err(e) => {
                    eprintln!("transport_bench: {e}");
                    std::process::exit(2);
                }
            },
        }
    }
}

/// The transport over `via`.
fn transport(via: Via) -> RdmaTransport {
    let cfg = match via {
        Via::Soft(link) => tconfig()
            .with_provider(ibverbx::ProviderKind::Soft)
            .with_soft(Some(SoftConfig { link, ..SoftConfig::default() })),
        Via::Verbs => tconfig().with_provider(ibverbx::ProviderKind::Verbs),
    };
    RdmaTransport::new(cfg).unwrap_or_else(|e| {
        eprintln!("transport_bench: {e}");
        std::process::exit(2);
    })
}

struct Raw {
    cq: VirtualCq,
    qp: VirtualQp,
    mem: MemoryRegion,
}

fn raw(via: Via, len: usize) -> Raw {
    let ctx = via.device().open().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = VirtualCq::new(&ctx, tconfig().cq_depth).unwrap();
    let qp = VirtualQp::new(&pd, &cq, &tconfig().virtual_qp_config()).unwrap();
    let mem = MemoryRegion::alloc(&pd, len, AccessFlags::all_remote()).unwrap();
    Raw { cq, qp, mem }
}

/// One side's transport, raw virtual QP and buffers, and the hello that
/// describes them to the other side.
fn side(link: Via, len: usize) -> (RdmaTransport, RdmaMemory, Raw, Hello) {
    let t = transport(link);
    let mem = RdmaMemory::alloc_for(&t, len).unwrap();
    let r = raw(link, len);
    let me = Hello {
        url: t.bind().unwrap(),
        rb: mem.remote_buffer(),
        vqp: r.qp.endpoint().unwrap(),
        raw_addr: r.mem.addr(),
        raw_rkey: r.mem.rkey(),
    };
    (t, mem, r, me)
}

/// The peer: registers both buffers, connects, keeps its virtual CQ
/// progressing until stdin closes.
async fn serve(link: Via) {
    let max = *SIZES.iter().max().unwrap();
    let (t, mem, r, me) = side(link, max);
    println!("{}", serde_json::to_string(&me).unwrap());
    std::io::stdout().flush().unwrap();
    let mut line = String::new();
    std::io::stdin().lock().read_line(&mut line).unwrap();
    let peer: Hello = serde_json::from_str(&line).unwrap();
    r.qp.connect(&peer.vqp).unwrap();
    t.connect(&peer.url).await.unwrap();
    // Answer checksum requests ("t" or "r" and a length) until stdin closes.
    let mut lines = std::io::stdin().lock().lines();
    while let Some(Ok(l)) = lines.next() {
        let (which, n) = l.split_once(' ').unwrap();
        let n: usize = n.parse().unwrap();
        let mut buf = vec![0u8; n];
        if which == "t" {
            mem.read_into(0, &mut buf).unwrap();
        } else {
            r.mem.read(0, &mut buf).unwrap();
        }
        println!("{}", checksum(&buf));
        std::io::stdout().flush().unwrap();
        let mut wc = [WorkCompletion::empty(); 16];
        let _ = r.cq.poll(&mut wc);
    }
}

fn checksum(b: &[u8]) -> u64 {
    b.chunks(8).fold(0xcbf2_9ce4_8422_2325u64, |h, c| {
        let mut w = [0u8; 8];
        w[..c.len()].copy_from_slice(c);
        (h ^ u64::from_le_bytes(w)).wrapping_mul(0x100_0000_01b3)
    })
}

type WriteFut<'a> =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), rmacomm_transport::TransportError>> + Send + 'a>>;

struct Row {
    link: &'static str,
    bytes: usize,
    raw_bw: f64,
    t_bw: f64,
    raw_lat: f64,
    t_lat: f64,
}

fn median(mut v: Vec<Duration>) -> f64 {
    v.sort();
    v[v.len() / 2].as_secs_f64() * 1e6
}

async fn run_link(link: Via, quick: bool) -> Vec<Row> {
    let name = link.name();
    let max = *SIZES.iter().max().unwrap();
    let exe = std::env::current_exe().unwrap();
    let mut child = Command::new(exe)
        .args(["--serve", name])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn the peer process");
    let mut cin = child.stdin.take().unwrap();
    let mut cout = BufReader::new(child.stdout.take().unwrap());
    let (t, mem, r, me) = side(link, max);
    writeln!(cin, "{}", serde_json::to_string(&me).unwrap()).unwrap();
    cin.flush().unwrap();
    let mut line = String::new();
    cout.read_line(&mut line).unwrap();
    let peer: Hello = serde_json::from_str(&line).unwrap();
    r.qp.connect(&peer.vqp).unwrap();
    t.connect(&peer.url).await.unwrap();

    let data: Vec<u8> = (0..max).map(|i| (i * 13 + 7) as u8).collect();
    mem.write_from(0, &data).unwrap();
    r.mem.write(0, &data).unwrap();
    let budget = if quick { 128 << 20 } else { 1 << 30 };
    let mut rows = Vec::new();
    for &size in &SIZES {
        let iters = (budget / size).clamp(8, 20_000);
        let lat_iters = (iters / 4).clamp(8, 2_000);
        let sge = [r.mem.sge(0, size).unwrap()];
        let op = SendOp::RdmaWrite { remote_addr: peer.raw_addr, rkey: peer.raw_rkey };
        let mut wc = [WorkCompletion::empty(); WINDOW];
        let mut raw_run = |n: usize, window: usize| {
            let start = Instant::now();
            let (mut posted, mut done) = (0, 0);
            let mut lats = Vec::new();
            while done < n {
                while posted < n && posted - done < window {
                    r.qp.post_send(&[SendWr { wr_id: posted as u64, op, sg_list: &sge, flags: SendFlags::SIGNALED }])
                        .unwrap();
                    posted += 1;
                }
                let t0 = Instant::now();
                let k = r.cq.wait(&mut wc, Some(Duration::from_secs(60)), Duration::ZERO).unwrap();
                assert!(k > 0 && wc[..k].iter().all(|w| w.is_ok()), "{:?}", &wc[..k]);
                done += k;
                if window == 1 {
                    lats.push(t0.elapsed());
                }
            }
            (start.elapsed(), lats)
        };
        raw_run((iters / 10).max(2), WINDOW);
        let (d, _) = raw_run(iters, WINDOW);
        let raw_bw = (size * iters) as f64 / d.as_secs_f64() / 1e9;
        let raw_lat = {
            let mut v = Vec::with_capacity(lat_iters);
            for _ in 0..lat_iters {
                let t0 = Instant::now();
                raw_run(1, 1);
                v.push(t0.elapsed());
            }
            median(v)
        };

        let rb = peer.rb.slice(0, size as u64).unwrap();
        let t_run = |n: usize| {
            let t = &t;
            let mem = &mem;
            async move {
                let start = Instant::now();
                let mut inflight: VecDeque<WriteFut<'_>> = VecDeque::with_capacity(WINDOW);
                for _ in 0..n {
                    if inflight.len() == WINDOW {
                        inflight.pop_front().unwrap().await.unwrap();
                    }
                    inflight.push_back(Box::pin(t.write(mem.view(0, size).unwrap(), &rb, false)));
                }
                for f in inflight {
                    f.await.unwrap();
                }
                start.elapsed()
            }
        };
        t_run((iters / 10).max(2)).await;
        let d = t_run(iters).await;
        let t_bw = (size * iters) as f64 / d.as_secs_f64() / 1e9;
        let mut v = Vec::with_capacity(lat_iters);
        for _ in 0..lat_iters {
            let t0 = Instant::now();
            t.write(mem.view(0, size).unwrap(), &rb, false).await.unwrap();
            v.push(t0.elapsed());
        }
        let t_lat = median(v);
        eprintln!(
            "  {name} {:>8} B: raw {raw_bw:6.2} GB/s {raw_lat:8.1} us | transport {t_bw:6.2} GB/s {t_lat:8.1} us",
            size
        );
        rows.push(Row { link: name, bytes: size, raw_bw, t_bw, raw_lat, t_lat });
    }
    // Verify what landed on both paths.
    for which in ["t", "r"] {
        writeln!(cin, "{which} {max}").unwrap();
        cin.flush().unwrap();
        let mut l = String::new();
        cout.read_line(&mut l).unwrap();
        let got: u64 = l.trim().parse().unwrap();
        assert_eq!(got, checksum(&data), "the peer's {which} buffer differs from what was written");
    }
    drop(cin);
    let _ = child.wait();
    rows
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let opt = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned();
    if let Some(l) = opt("--serve") {
        return serve(Via::parse(&l)).await;
    }
    let links: Vec<Via> = if opt("--provider").as_deref() == Some("verbs") {
        vec![Via::Verbs]
    } else {
        opt("--link").map_or_else(
            || vec![Via::Soft(SoftLink::Shm), Via::Soft(SoftLink::Tcp)],
            |s| s.split(',').map(Via::parse).collect(),
        )
    };
    let quick = args.iter().any(|a| a == "--quick");
    let json = args.iter().any(|a| a == "--json");
    let mut rows = Vec::new();
    for l in links {
        rows.extend(run_link(l, quick).await);
    }
    if json {
        for r in &rows {
            println!(
                "{}",
                serde_json::json!({"link": r.link, "bytes": r.bytes, "raw_bw_GBps": r.raw_bw, "transport_bw_GBps": r.t_bw,
                    "bw_ratio": r.t_bw / r.raw_bw, "raw_lat_us": r.raw_lat, "transport_lat_us": r.t_lat})
            );
        }
        return;
    }
    println!(
        "{:<5} {:>10} {:>13} {:>13} {:>7} {:>13} {:>13} {:>8}",
        "link", "bytes", "raw GB/s", "transport", "ratio", "raw lat us", "transport", "cost"
    );
    for r in &rows {
        println!(
            "{:<5} {:>10} {:>13.2} {:>13.2} {:>7.2} {:>13.1} {:>13.1} {:>7.1}%",
            r.link,
            r.bytes,
            r.raw_bw,
            r.t_bw,
            r.t_bw / r.raw_bw,
            r.raw_lat,
            r.t_lat,
            (1.0 - r.raw_bw / r.t_bw.max(1e-9)).abs() * 100.0 * if r.t_bw < r.raw_bw { 1.0 } else { -1.0 }
        );
    }
}
