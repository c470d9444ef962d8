//! The runs: client (measures and prints), server (answers one client),
//! and `--local`, where the client starts `rdma_bench` itself as the
//! server process.

use std::io::{BufRead, BufReader, IsTerminal, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::bootstrap::{
    hello_answer_timeout, parse_peer, Control, Hello, Region, Reply, Request, SideInfo, PROTOCOL_VERSION,
};
use crate::cli::{BenchArgs, LbArg, LinkArg, ProviderArg};
use crate::device::{link_used, requested_provider, resolve};
use crate::engine::{checksum, fill, Dir, Engine, EngineConfig};
use crate::error::{BenchError, Result};
use crate::plan::{plan, Measure, Plan};
use crate::report::{table_header, table_row, Kind, Record, RunInfo, RULE};
use crate::size::{format_size, sweep_sizes};
use crate::stats::{summarize_bandwidth, summarize_latency, BandwidthSummary};
use crate::transport_engine::TransportEngine;
use crate::verbs_engine::VerbsEngine;
use crate::window_engine::{Role, WindowEngine};

/// The measured operations (see [`crate::Command`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Window put bandwidth.
    Put,
    /// Window put + signal ping-pong latency.
    PutLat,
    /// Window get bandwidth.
    Get,
    /// Transport write bandwidth.
    Write,
    /// Transport read bandwidth.
    Read,
    /// Transport write ping-pong latency.
    WriteLat,
    /// Transport read latency.
    ReadLat,
    /// Raw virtual QP write bandwidth.
    VerbsWrite,
    /// Raw virtual QP write ping-pong latency.
    VerbsWriteLat,
    /// Raw virtual QP read bandwidth.
    VerbsRead,
}

impl Op {
    /// The name on the command line and in records.
    pub fn name(self) -> &'static str {
        match self {
            Op::Put => "put",
            Op::PutLat => "put_lat",
            Op::Get => "get",
            Op::Write => "write",
            Op::Read => "read",
            Op::WriteLat => "write_lat",
            Op::ReadLat => "read_lat",
            Op::VerbsWrite => "verbs_write",
            Op::VerbsWriteLat => "verbs_write_lat",
            Op::VerbsRead => "verbs_read",
        }
    }

    /// Bandwidth or latency table.
    pub fn kind(self) -> Kind {
        match self {
            Op::Put | Op::Get | Op::Write | Op::Read | Op::VerbsWrite | Op::VerbsRead => Kind::Bandwidth,
            Op::PutLat | Op::WriteLat | Op::ReadLat | Op::VerbsWriteLat => Kind::Latency,
        }
    }

    fn raw(self) -> bool {
        matches!(self, Op::VerbsWrite | Op::VerbsWriteLat | Op::VerbsRead)
    }

    fn window(self) -> bool {
        matches!(self, Op::Put | Op::PutLat | Op::Get)
    }

    fn dir(self) -> Dir {
        match self {
            Op::Get | Op::Read | Op::ReadLat | Op::VerbsRead => Dir::Read,
            _ => Dir::Write,
        }
    }

    fn title(self) -> &'static str {
        match self {
            Op::Put => "Put BW Test through the Window",
            Op::PutLat => "Put + Signal Latency Test through the Window",
            Op::Get => "Get BW Test through the Window",
            Op::Write => "RDMA_Write BW Test through RdmaTransport",
            Op::Read => "RDMA_Read BW Test through RdmaTransport",
            Op::WriteLat => "RDMA_Write Latency Test through RdmaTransport",
            Op::ReadLat => "RDMA_Read Latency Test through RdmaTransport",
            Op::VerbsWrite => "RDMA_Write BW Test on the raw VirtualQp",
            Op::VerbsWriteLat => "RDMA_Write Latency Test on the raw VirtualQp",
            Op::VerbsRead => "RDMA_Read BW Test on the raw VirtualQp",
        }
    }
}

pub(crate) fn provider_name(p: ProviderArg) -> &'static str {
    match p {
        ProviderArg::Auto => "auto",
        ProviderArg::Verbs => "verbs",
        ProviderArg::Soft => "soft",
    }
}

pub(crate) fn link_name(l: LinkArg) -> &'static str {
    match l {
        LinkArg::Auto => "auto",
        LinkArg::Shm => "shm",
        LinkArg::Tcp => "tcp",
    }
}

pub(crate) fn lb_name(l: LbArg) -> &'static str {
    match l {
        LbArg::Dqplb => "dqplb",
        LbArg::Spray => "spray",
    }
}

/// Default busy-poll: latency tests spin (as perftest), bandwidth tests
/// sleep in the kernel except where the polling thread itself copies.
fn busy_poll(op: Op, us: Option<u64>) -> Duration {
    match (us, op.kind()) {
        (Some(us), _) => Duration::from_micros(us),
        (None, Kind::Latency) => Duration::from_millis(200),
        (None, Kind::Bandwidth) => Duration::ZERO,
    }
}

/// The engine for `hello`; `origin` says where its provider came from;
/// `role` is this side's (the window's ranks differ).
fn engine_for(
    op: Op,
    hello: &Hello,
    origin: &str,
    (ib_dev, cuda): (Option<&str>, Option<u32>),
    role: Role,
) -> Result<Box<dyn Engine>> {
    if cuda.is_some() && (op.raw() || op.window()) {
        return Err(BenchError::Config(format!(
            "--use-cuda: {} does not take device memory; the transport tests (write, read, write_lat, read_lat) do",
            op.name()
        )));
    }
    let resolved = resolve(&hello.provider, origin, &hello.link, ib_dev)?;
    let lb = ibverbx::LoadBalancing::parse(&hello.lb)
        .ok_or_else(|| BenchError::Config(format!("--lb {}: expected dqplb or spray", hello.lb)))?;
    let frag = u32::try_from(hello.frag_size)
        .ok()
        .filter(|f| *f > 0)
        .ok_or_else(|| BenchError::Config(format!("--frag-size {} must be 1 B .. 4 GiB - 1", hello.frag_size)))?;
    if hello.tx_depth > MAX_TX_DEPTH {
        return Err(BenchError::Config(format!("-t {}: at most {MAX_TX_DEPTH} operations in flight", hello.tx_depth)));
    }
    if hello.max_bytes == 0 || hello.max_bytes > u32::MAX as u64 {
        // Checked by the client too; here for the server, which takes it
        // from the client's hello.
        return Err(BenchError::Config(format!("the largest size {} is not 1 B .. 4 GiB - 1", hello.max_bytes)));
    }
    if hello.qps == 0 || hello.qps > 256 {
        return Err(BenchError::Config(format!("-q {}: the number of QPs must be 1..=256", hello.qps)));
    }
    let cfg = EngineConfig {
        resolved,
        max: hello.max_bytes,
        qps: hello.qps,
        lb,
        frag,
        depth: hello.tx_depth.max(1) as usize,
        busy_poll: busy_poll(op, hello.busy_poll_us),
        spin_small: hello.busy_poll_us.is_none() && op.kind() == Kind::Bandwidth,
        cuda,
    };
    Ok(if op.raw() {
        Box::new(VerbsEngine::new(cfg)?)
    } else if op.window() {
        Box::new(WindowEngine::new(cfg, role)?)
    } else {
        Box::new(TransportEngine::new(cfg)?)
    })
}

/// The most operations in flight `-t` may ask for (what the transport's
/// default in-flight budget allows many times over).
const MAX_TX_DEPTH: u32 = 1 << 16;

/// The sizes a run measures.
fn sizes(op: Op, a: &BenchArgs) -> Result<Vec<u64>> {
    let v = if a.all {
        // Window bandwidth sweeps start where bandwidth matters; small puts
        // are put_lat's.
        let min = a.min.unwrap_or(if op.window() && op.kind() == Kind::Bandwidth { 64 << 10 } else { 2 });
        sweep_sizes(min, a.max)
    } else {
        vec![a.size.unwrap_or(if op.kind() == Kind::Latency { 2 } else { 65536 })]
    };
    if v.is_empty() || v.iter().any(|&s| s == 0 || s > u32::MAX as u64) {
        return Err(BenchError::Config(format!(
            "sizes must be 1 B .. 4 GiB - 1 and --min must not exceed --max (got {v:?})"
        )));
    }
    Ok(v)
}

const CLIENT_SEED: u64 = 0xc11e;
const SERVER_SEED: u64 = 0x5e4e;

/// Set in the environment of a `--local` server process.
pub(crate) const LOCAL_ENV: &str = "RDMA_BENCH_LOCAL_SERVER";

/// Waits for the client; a `--local` server gives up after a minute, so
/// that it never outlives a client that died before connecting.
pub(crate) fn accept(listener: &TcpListener) -> Result<TcpStream> {
    if std::env::var_os(LOCAL_ENV).is_none() {
        return Ok(listener.accept()?.0);
    }
    listener.set_nonblocking(true)?;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match listener.accept() {
            Ok((s, _)) => {
                s.set_nonblocking(false)?;
                return Ok(s);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => return Err(BenchError::Run(format!("no client connected: {e}"))),
        }
    }
}

/// Serves one client on `listener`, then returns.
fn serve(op: Op, a: &BenchArgs, listener: TcpListener) -> Result<()> {
    let stream = accept(&listener)?;
    let mut ctl = Control::new(stream)?;
    let r = serve_session(op, a, &mut ctl);
    if let Err(e) = &r {
        let _ = ctl.send(&Reply::Error { message: e.to_string() });
    }
    r
}

fn serve_session(op: Op, a: &BenchArgs, ctl: &mut Control) -> Result<()> {
    let hello: Hello = ctl.recv("the client's hello")?;
    if hello.version != PROTOCOL_VERSION {
        return Err(BenchError::Config(format!(
            "the client speaks bootstrap protocol {}, this server {PROTOCOL_VERSION}: use the same rdma_bench on both",
            hello.version
        )));
    }
    if hello.op != op.name() {
        return Err(BenchError::Config(format!(
            "the client runs {}, this server was started for {}; start both with the same operation",
            hello.op,
            op.name()
        )));
    }
    // The client chose the provider (its flag or its environment).
    let origin = format!("the client's provider {}", hello.provider);
    let mut e = engine_for(op, &hello, &origin, (a.ib_dev.as_deref(), a.use_cuda), Role::Server)?;
    fill(e.as_ref(), SERVER_SEED, u64::MAX)?;
    ctl.send(&e.info()?)?;
    let peer: SideInfo = ctl.recv("the client's endpoint")?;
    e.connect(&peer, &ctl.peer_host()?)?;
    e.start_serving();
    loop {
        // None: the client went away after its last request. A message
        // that is not a request is an error (and the server's exit status).
        let Some(req) = ctl.recv_or_end::<Request>("a request")? else { return Ok(()) };
        match req {
            Request::Bandwidth { size, plan } => {
                let times = e.bandwidth(op.dir(), size, plan)?;
                let s = summarize_bandwidth(size, &times)
                    .ok_or_else(|| BenchError::run("the server's direction measured nothing"))?;
                ctl.send(&Reply::Bandwidth {
                    iterations: s.iterations,
                    avg_bps: s.avg_bps,
                    peak_bps: s.peak_bps,
                    msg_rate_mpps: s.msg_rate_mpps,
                })?;
            }
            Request::Echo { size, count } => {
                e.echo(size, count)?;
                ctl.send(&Reply::EchoDone)?;
            }
            Request::Fill { seed, len } => {
                fill(e.as_ref(), seed, len)?;
                ctl.send(&Reply::Filled)?;
            }
            Request::Checksum { region, len } => {
                // Test hook (the client must notice and fail loudly):
                // RDMA_BENCH_TEST_CORRUPT=N damages one byte of what the
                // N-byte messages left in the destination; any other value
                // reports a wrong checksum.
                let corrupt = std::env::var("RDMA_BENCH_TEST_CORRUPT").ok();
                let at_size = corrupt.as_deref().and_then(|v| v.parse::<u64>().ok());
                if region == Region::Dst && at_size == Some(len) && len > 1 {
                    let mut b = [0u8; 1];
                    e.read_at(e.max() + len / 2, &mut b)?;
                    e.write_at(e.max() + len / 2, &[b[0] ^ 0x5a])?;
                }
                let mut value = checksum(e.as_ref(), region, len)?;
                if corrupt.is_some() && at_size.is_none() {
                    value ^= 1;
                }
                ctl.send(&Reply::Checksum { value })?;
            }
            Request::Bye => return Ok(()),
        }
    }
}

/// The server started by `--local`.
pub(crate) struct LocalServer {
    child: Child,
}

impl LocalServer {
    pub(crate) fn spawn(op: &str, ib_dev: Option<&str>, cuda: Option<u32>) -> Result<(LocalServer, u16)> {
        let exe = std::env::current_exe()?;
        let mut cmd = Command::new(exe);
        cmd.arg(op).args(["--server", "--port", "0"]);
        if let Some(d) = ib_dev {
            cmd.args(["-d", d]);
        }
        if let Some(g) = cuda {
            cmd.args(["--use-cuda", &g.to_string()]);
        }
        cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::inherit());
        // The server gives up if this client never connects.
        cmd.env(LOCAL_ENV, "1");
        let child = cmd.spawn().map_err(|e| BenchError::Run(format!("starting the local server: {e}")))?;
        // Owned at once: dropping it on any error below ends the process.
        let mut srv = LocalServer { child };
        let out = srv.child.stdout.take().expect("piped");
        let mut line = String::new();
        BufReader::new(out).read_line(&mut line)?;
        let port = line
            .split_whitespace()
            .find_map(|w| w.rsplit_once(':').and_then(|(_, p)| p.trim_end_matches(';').parse::<u16>().ok()))
            .ok_or_else(|| BenchError::Run(format!("the local server did not say its port (it said {line:?})")))?;
        Ok((srv, port))
    }

    pub(crate) fn finish(mut self) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(st) = self.child.try_wait()? {
                return if st.success() {
                    Ok(())
                } else {
                    Err(BenchError::Run(format!("the local server exited with {st}")))
                };
            }
            if Instant::now() > deadline {
                return Err(BenchError::run("the local server did not exit"));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for LocalServer {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

pub(crate) fn connect_with_retry(host: &str, port: u16) -> Result<TcpStream> {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        match TcpStream::connect((host, port)) {
            Ok(s) => return Ok(s),
            Err(e) if Instant::now() > deadline => {
                return Err(BenchError::Run(format!("cannot reach the server at {host}:{port}: {e}")))
            }
            Err(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    }
}

/// Where the output goes: tables or JSON lines on stdout, the JSON file.
struct Output {
    json: bool,
    gbits: bool,
    file: Option<std::fs::File>,
    records: Vec<Record>,
}

impl Output {
    fn header(&self, text: &str) {
        if self.json {
            eprintln!("{text}");
        } else {
            println!("{text}");
        }
    }

    fn row(&mut self, r: Record, pb: &ProgressBar) -> Result<()> {
        let line = if self.json { r.to_json() } else { table_row(&r, self.gbits) };
        pb.suspend(|| println!("{line}"));
        if let Some(f) = self.file.as_mut() {
            writeln!(f, "{}", r.to_json()).map_err(|e| BenchError::run(format!("--out-json: {e}")))?;
        }
        self.records.push(r);
        Ok(())
    }
}

fn progress(n: usize, json: bool) -> ProgressBar {
    if n < 2 || json || !std::io::stdout().is_terminal() {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::with_draw_target(Some(n as u64), ProgressDrawTarget::stderr());
    pb.set_style(
        ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} sizes {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    pb
}

/// The client side of a run (local or remote server).
fn client(op: Op, a: &BenchArgs) -> Result<()> {
    let sizes = sizes(op, a)?;
    let max = *sizes.iter().max().expect("sizes");
    if a.bidirectional && op.kind() == Kind::Latency {
        return Err(BenchError::Config("-b/--bidirectional applies to bandwidth tests".into()));
    }
    // Lossy, so that a value that is not UTF-8 is refused rather than taken
    // for an unset variable.
    let env = std::env::var_os("RMACOMM_PROVIDER").map(|v| v.to_string_lossy().into_owned());
    let (provider, origin) = requested_provider(a.provider.map(provider_name), env.as_deref())?;
    let hello = Hello {
        version: PROTOCOL_VERSION,
        op: op.name().into(),
        max_bytes: max,
        qps: a.qps,
        lb: lb_name(a.lb).into(),
        frag_size: a.frag_size,
        provider: provider.into(),
        link: link_name(a.link).into(),
        tx_depth: a.tx_depth,
        busy_poll_us: a.busy_poll_us,
    };
    // Fail here, before any server starts, when the provider or device
    // cannot be had.
    let mut e = engine_for(op, &hello, &origin, (a.ib_dev.as_deref(), a.use_cuda), Role::Client)?;
    fill(e.as_ref(), CLIENT_SEED, u64::MAX)?;
    let (local, host, port) = match &a.client {
        Some(peer) => {
            let (h, p) = parse_peer(peer, a.port).map_err(BenchError::Config)?;
            (None, h, p)
        }
        None => {
            let (srv, port) = LocalServer::spawn(op.name(), a.ib_dev.as_deref(), a.use_cuda)?;
            (Some(srv), "127.0.0.1".to_owned(), port)
        }
    };
    let mut ctl = Control::new(connect_with_retry(&host, port)?)?;
    // The server answers its hello within this, or is not one.
    ctl.set_timeout(Some(hello_answer_timeout()))?;
    ctl.send(&hello)?;
    let server: SideInfo = match ctl.recv::<serde_json::Value>("the server's endpoint")? {
        v if v.get("reply").is_some() => {
            let msg = v.get("message").and_then(|m| m.as_str()).unwrap_or("unknown error").to_owned();
            return Err(BenchError::Run(format!("server: {msg}")));
        }
        v => serde_json::from_value(v).map_err(BenchError::run)?,
    };
    ctl.set_timeout(Some(crate::bootstrap::reply_timeout()))?;
    let me = e.info()?;
    ctl.send(&me)?;
    e.connect(&server, &host)?;

    let same_host = me.host.same_host(&server.host);
    let resolved = resolve(&hello.provider, &origin, &hello.link, a.ib_dev.as_deref())?;
    let link = link_used(&resolved, same_host);
    let info = RunInfo {
        op: op.name().into(),
        provider: me.provider.clone(),
        link: link.into(),
        qps: a.qps,
        lb: hello.lb.clone(),
    };
    let file = match &a.out_json {
        Some(p) => {
            Some(std::fs::File::create(p).map_err(|e| BenchError::Config(format!("--out-json {}: {e}", p.display())))?)
        }
        None => None,
    };
    let mut out = Output { json: a.json, gbits: a.report_gbits, file, records: Vec::new() };
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let placement = match &a.client {
        Some(p) => format!("client of {p}"),
        None => "local (client and a server process on this host)".into(),
    };
    let layer = if op.raw() {
        "raw ibverbx::VirtualQp (no transport layer)"
    } else if op.window() {
        "rmacomm_window::Window (2 ranks: the server is rank 0, hosting the group's TcpStore)"
    } else {
        "rmacomm_transport::RdmaTransport"
    };
    let label = if op.window() { "Window access   " } else { "Memory          " };
    let access = e.describe().map(|d| format!("\n {label}: {d}")).unwrap_or_default();
    let half = match op {
        Op::ReadLat => "  (a read is a round trip: not halved)",
        _ if op.kind() == Kind::Latency => "  (half round trip)",
        _ => "",
    };
    let header = format!(
        "{RULE}\n                    {}{}\n Layer           : {layer}{access}\n Provider        : {}   Device: {} (server: {} {})\n \
         Link            : {link}{}\n Placement       : {placement}, {cores} cores here\n \
         Number of qps   : {}   Load balancing: {}   Fragment size: {} B\n TX depth        : {}   Sizes: {}{}\n{RULE}",
        op.title(),
        if a.bidirectional { " (bidirectional)" } else { "" },
        me.provider,
        me.device,
        server.provider,
        server.device,
        if hello.link == "auto" && resolved.soft.is_some() {
            if same_host {
                " (auto: both ends on one host)"
            } else {
                " (auto: the ends are on different hosts)"
            }
        } else {
            ""
        },
        a.qps,
        hello.lb,
        a.frag_size,
        if op.kind() == Kind::Bandwidth { a.tx_depth } else { 1 },
        if sizes.len() == 1 {
            format_size(sizes[0])
        } else {
            format!("{} .. {}", format_size(sizes[0]), format_size(max))
        },
        half,
    );
    out.header(&header);
    out.header(&table_header(op.kind(), a.report_gbits));

    let pb = progress(sizes.len(), a.json);
    let mut copies = crate::report::DeviceCounters::default();
    for &size in &sizes {
        pb.set_message(format_size(size));
        // Fresh patterns on both sides, so that this size's check covers
        // only what this size moved.
        fill(e.as_ref(), CLIENT_SEED ^ size.rotate_left(17), size)?;
        ctl.send(&Request::Fill { seed: SERVER_SEED ^ size.rotate_left(17), len: size })?;
        match ctl.reply("the server's refill")? {
            Reply::Filled => {}
            other => return Err(BenchError::Run(format!("unexpected reply {other:?}"))),
        }
        let p = plan(op.kind(), size, a.iters, a.warmup, a.duration);
        let rec = match op.kind() {
            Kind::Bandwidth => {
                // The server's part: its own direction (which ends its
                // batches as this side does), or answering this side's
                // batch ends.
                let syncs = e.peer_syncs(op.dir());
                if a.bidirectional {
                    ctl.send(&Request::Bandwidth { size, plan: p })?;
                } else if syncs > 0 {
                    ctl.send(&Request::Echo { size: 0, count: syncs })?;
                }
                let before = e.device_counters();
                let times = e.bandwidth(op.dir(), size, p)?;
                let device = e.device_counters().zip(before).map(|(after, before)| after.since(before));
                if let Some(c) = device.filter(|c| c.waits > 0) {
                    copies.copies += c.copies;
                    copies.waits += c.waits;
                    copies.bytes += c.bytes;
                }
                if !a.bidirectional && syncs > 0 {
                    match ctl.reply("the server's answers to the batch ends")? {
                        Reply::EchoDone => {}
                        other => return Err(BenchError::Run(format!("unexpected reply {other:?}"))),
                    }
                }
                let mut s = summarize_bandwidth(size, &times)
                    .ok_or_else(|| BenchError::run(format!("{size} B: nothing was measured")))?;
                if a.bidirectional {
                    match ctl.reply("the server's direction")? {
                        Reply::Bandwidth { iterations, avg_bps, peak_bps, msg_rate_mpps } => {
                            s = s.plus(BandwidthSummary { iterations, avg_bps, peak_bps, msg_rate_mpps });
                        }
                        other => return Err(BenchError::Run(format!("unexpected reply {other:?}"))),
                    }
                }
                Record::bandwidth(&info, size, &s).with_device(device)
            }
            Kind::Latency => {
                let samples = latency(op, e.as_mut(), &mut ctl, size, p)?;
                let s = summarize_latency(&samples)
                    .ok_or_else(|| BenchError::run(format!("{size} B: nothing was measured")))?;
                Record::latency(&info, size, &s)
            }
        };
        verify(op, a, e.as_ref(), &mut ctl, size)?;
        out.row(rec, &pb)?;
        pb.inc(1);
    }
    pb.finish_and_clear();
    let msg = if sizes.len() == 1 {
        format!("data verified: the {} each destination received match their source", format_size(sizes[0]))
    } else {
        "data verified: after every size, each destination matched its source".to_owned()
    };
    let msg = match copies.waits {
        0 => msg,
        w => format!(
            "{msg}\n device to device with the peer (soft provider): {} copies, {w} waits for the device, {:.2} MiB per wait",
            copies.copies,
            copies.bytes as f64 / w as f64 / (1u64 << 20) as f64
        ),
    };
    if out.json {
        eprintln!("{msg}");
    } else {
        println!("{RULE}\n {msg}");
    }
    let _ = ctl.send(&Request::Bye);
    drop(ctl);
    // Before waiting for the server: a window's group store, hosted by the
    // server, keeps serving until this side has hung up.
    drop(e);
    if let Some(srv) = local {
        srv.finish()?;
    }
    if let Some(p) = &a.plot {
        crate::plot::write_svg(p, &out.records).map_err(BenchError::Run)?;
        eprintln!("plot: {}", p.display());
    }
    Ok(())
}

/// Latency samples of one size in µs (ping-pong: half round trip).
fn latency(op: Op, e: &mut dyn Engine, ctl: &mut Control, size: u64, p: Plan) -> Result<Vec<f64>> {
    let mut run = |count: u64| -> Result<Vec<f64>> {
        if op == Op::ReadLat {
            return e.read_lat(size, count);
        }
        ctl.send(&Request::Echo { size, count })?;
        let rtts = e.ping(size, count)?;
        match ctl.reply("the end of the echo")? {
            Reply::EchoDone => Ok(rtts.into_iter().map(|r| r / 2.0).collect()),
            other => Err(BenchError::Run(format!("unexpected reply {other:?}"))),
        }
    };
    let warm = run(p.warmup)?;
    let count = match p.measure {
        Measure::Count(n) => n,
        Measure::Seconds(s) => {
            // Size the count from the warm-up (a ping-pong partner cannot
            // be stopped mid-way).
            let per = warm.iter().sum::<f64>() / warm.len().max(1) as f64;
            let factor = if op == Op::ReadLat { 1.0 } else { 2.0 };
            ((s * 1e6 / (per * factor).max(0.01)) as u64).clamp(1, 10_000_000)
        }
    };
    run(count)
}

/// The check after each size: the destination of every direction that
/// moved data holds the source's first `len` bytes.
fn verify(op: Op, a: &BenchArgs, e: &dyn Engine, ctl: &mut Control, len: u64) -> Result<()> {
    // (region at the server, region here, what it is)
    let mut checks: Vec<(Region, Region, &str)> = Vec::new();
    match op.dir() {
        Dir::Write => checks.push((Region::Dst, Region::Src, "the server's destination against the client's source")),
        Dir::Read => checks.push((Region::Src, Region::Dst, "the client's destination against the server's source")),
    }
    let echoed = matches!(op, Op::WriteLat | Op::VerbsWriteLat | Op::PutLat);
    if a.bidirectional || echoed {
        match op.dir() {
            Dir::Write => {
                checks.push((Region::Src, Region::Dst, "the client's destination against the server's source"))
            }
            Dir::Read => {
                checks.push((Region::Dst, Region::Src, "the server's destination against the client's source"))
            }
        }
    }
    for (theirs, mine, what) in checks {
        ctl.send(&Request::Checksum { region: theirs, len })?;
        let remote = match ctl.reply("a checksum")? {
            Reply::Checksum { value } => value,
            other => return Err(BenchError::Run(format!("unexpected reply {other:?}"))),
        };
        let local = checksum(e, mine, len)?;
        if remote != local {
            return Err(BenchError::Verification(format!(
                "{} B messages: {what}: the first {len} bytes differ (checksum {remote:#018x} vs {local:#018x})",
                len
            )));
        }
    }
    Ok(())
}

/// Runs one operation as the command line says.
pub fn run_op(op: Op, a: &BenchArgs) -> Result<()> {
    if a.server {
        let listener = TcpListener::bind(("0.0.0.0", a.port))
            .map_err(|e| BenchError::Config(format!("cannot listen on port {}: {e}", a.port)))?;
        let port = listener.local_addr()?.port();
        println!(
            "rdma_bench server: listening on 0.0.0.0:{port}; run `rdma_bench {} --client THIS_HOST:{port}`",
            op.name()
        );
        std::io::stdout().flush()?;
        return serve(op, a, listener);
    }
    client(op, a)
}
