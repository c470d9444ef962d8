//! `rdma_bench kv`: the prefill process (the client: measures and prints)
//! and the decode process (the server), each one `rmacomm_agent`
//! `TransferAgent`.
//!
//! Decode registers a cache of `2 × N` slots of the largest shape once and
//! hands its metadata to prefill over the bootstrap connection; prefill
//! registers its N blocks once and adds decode (decode learns prefill from
//! the agent's handshake). A request is one `transfer` of N pieces with
//! one notification. Before each request prefill tells decode to wait for
//! it (`Wait`); decode blocks in `notifications().next()` as an engine
//! would, reads CLOCK_MONOTONIC when the notification arrives and sends
//! that time back. On one host both processes read the same clock, so the
//! time is exactly `transfer` called → notification taken at decode;
//! across hosts (and for reads and requests without a notification) it is
//! `transfer` called → the request's future resolved at prefill. The
//! bootstrap traffic between requests is not timed.

use std::io::Write;
use std::net::TcpListener;
use std::time::Duration;

use futures::StreamExt;
use rmacomm_agent::{AgentConfig, LocalBlock, Op as AgentOp, RemoteBlock, TransferAgent};
use rmacomm_transport::{RdmaMemory, TransportConfig};
use serde::{Deserialize, Serialize};

use crate::bootstrap::{hello_answer_timeout, parse_peer, Control};
use crate::cli::KvArgs;
use crate::device::{link_used, requested_provider, resolve, Resolved};
use crate::engine::OP_TIMEOUT;
use crate::error::{BenchError, Result};
use crate::host::HostInfo;
use crate::kv::{
    fill_block, iterations, kv_table_header, kv_table_row, shapes, slots, KvOp, KvRecord, KvRunInfo, UNTOUCHED,
};
use crate::report::RULE;
use crate::run::{accept, connect_with_retry, lb_name, link_name, provider_name, LocalServer};
use crate::size::format_size;
use crate::stats::{percentile, summarize_latency};

/// Bumped when the messages below change.
const KV_PROTOCOL_VERSION: u32 = 1;

/// The client's settings, first on the bootstrap connection.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct KvHello {
    version: u32,
    provider: String,
    link: String,
    qps: u32,
    lb: String,
    frag_size: u64,
    busy_poll_us: Option<u64>,
    /// The largest request: decode registers twice this.
    max_bytes: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "req", rename_all = "snake_case")]
enum KvRequest {
    /// The next shape: decode refills its cache (untouched marks; for
    /// reads, the blocks in their slots).
    Shape {
        blocks: u64,
        block_size: u64,
        slots: Vec<u64>,
        op: KvOp,
    },
    /// Take the notification of request `round` and say when it came.
    Wait {
        round: u64,
    },
    /// Check that the slots hold request `round`'s blocks, and that no
    /// other slot changed.
    Check {
        round: u64,
    },
    Bye,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "reply", rename_all = "snake_case")]
enum KvReply {
    /// Decode's agent is up.
    Ready {
        metadata: String,
        region: u32,
        host: HostInfo,
        provider: String,
        device: String,
    },
    ShapeSet,
    /// CLOCK_MONOTONIC when the notification was taken, ns.
    Arrived {
        t_ns: u64,
    },
    Checked,
    /// `wrong`: the bytes were wrong (exit status 3), not the run.
    Error {
        message: String,
        wrong: bool,
    },
}

/// CLOCK_MONOTONIC in ns: one clock for every process of a host (unlike
/// `Instant`, whose value cannot leave the process).
fn now_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

fn reply(ctl: &mut Control, what: &str) -> Result<KvReply> {
    match ctl.recv::<KvReply>(what)? {
        KvReply::Error { message, wrong: true } => Err(BenchError::Verification(format!("decode: {message}"))),
        KvReply::Error { message, .. } => Err(BenchError::Run(format!("decode: {message}"))),
        r => Ok(r),
    }
}

/// One worker runs the agent's tasks (drainer, notifier, handshake
/// listener); the calling thread polls the measured request itself.
fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().map_err(BenchError::run)
}

fn agent_config(r: &Resolved, h: &KvHello) -> Result<AgentConfig> {
    let lb = ibverbx::LoadBalancing::parse(&h.lb)
        .ok_or_else(|| BenchError::Config(format!("--lb {}: expected dqplb or spray", h.lb)))?;
    let frag = u32::try_from(h.frag_size)
        .ok()
        .filter(|f| *f > 0)
        .ok_or_else(|| BenchError::Config(format!("--frag-size {} must be 1 .. 4 GiB", h.frag_size)))?;
    if h.qps == 0 || h.qps > 256 {
        return Err(BenchError::Config(format!("-q {}: the number of QPs must be 1..=256", h.qps)));
    }
    let tc = TransportConfig::default()
        .with_provider(r.kind)
        .with_device(Some(r.device.name().to_owned()))
        .with_qps(h.qps)
        .with_load_balancing(lb)
        .with_frag_size(frag)
        .with_timeout(Some(OP_TIMEOUT))
        .with_busy_poll(Duration::from_micros(h.busy_poll_us.unwrap_or(0)))
        .with_soft(r.soft.clone());
    Ok(AgentConfig::default().with_transport(tc))
}

/// The blocks request `round` should have left in decode's cache.
fn check_cache(cache: &RdmaMemory, size: usize, slots: &[u64], round: u64) -> Result<()> {
    let mut want = vec![0u8; size];
    let mut got = vec![0u8; size];
    let mut of_slot = vec![None; 2 * slots.len()];
    for (b, &s) in slots.iter().enumerate() {
        of_slot[s as usize] = Some(b as u64);
    }
    for (s, b) in of_slot.iter().enumerate() {
        cache.read_into(s * size, &mut got)?;
        match b {
            Some(b) => {
                fill_block(round, *b, &mut want);
                if got != want {
                    return Err(BenchError::Verification(format!(
                        "{} x {}: request {round}: block {b} in slot {s} differs from what prefill sent",
                        slots.len(),
                        format_size(size as u64)
                    )));
                }
            }
            None => {
                if let Some(i) = got.iter().position(|&x| x != UNTOUCHED) {
                    return Err(BenchError::Verification(format!(
                        "{} x {}: request {round}: slot {s}, which no block names, changed (byte {i})",
                        slots.len(),
                        format_size(size as u64)
                    )));
                }
            }
        }
    }
    Ok(())
}

/// The decode side: serves one prefill, then returns.
fn serve(a: &KvArgs, listener: TcpListener) -> Result<()> {
    let mut ctl = Control::new(accept(&listener)?)?;
    let r = serve_session(a, &mut ctl);
    if let Err(e) = &r {
        let (message, wrong) = match e {
            BenchError::Verification(m) => (m.clone(), true),
            e => (e.to_string(), false),
        };
        let _ = ctl.send(&KvReply::Error { message, wrong });
    }
    r
}

fn serve_session(a: &KvArgs, ctl: &mut Control) -> Result<()> {
    let hello: KvHello = ctl.recv("the client's hello")?;
    if hello.version != KV_PROTOCOL_VERSION {
        return Err(BenchError::Config(format!(
            "the client speaks kv protocol {}, this server {KV_PROTOCOL_VERSION}: use the same rdma_bench on both",
            hello.version
        )));
    }
    let origin = format!("the client's provider {}", hello.provider);
    let resolved = resolve(&hello.provider, &origin, &hello.link, a.ib_dev.as_deref())?;
    let rt = runtime()?;
    let _enter = rt.enter();
    let agent = TransferAgent::new("decode", agent_config(&resolved, &hello)?)?;
    let cache_len = usize::try_from(2 * hello.max_bytes).map_err(BenchError::run)?;
    let cache = agent.alloc(cache_len)?;
    let region = agent.register(&cache)?;
    ctl.send(&KvReply::Ready {
        metadata: agent.metadata(),
        region,
        host: HostInfo::current(),
        provider: resolved.provider_name().to_owned(),
        device: resolved.device.name().to_owned(),
    })?;
    let mut notifications = agent.notifications();
    let mut shape: Option<(usize, Vec<u64>)> = None;
    loop {
        // None: the client went away after its last request. A message
        // that is not a request is an error (and the server's exit status).
        let Some(req) = ctl.recv_or_end::<KvRequest>("a request")? else { return Ok(()) };
        match req {
            KvRequest::Shape { blocks, block_size, slots, op } => {
                let size = usize::try_from(block_size).map_err(BenchError::run)?;
                if slots.len() as u64 != blocks || 2 * blocks * block_size > cache_len as u64 {
                    return Err(BenchError::run(format!("shape {blocks} x {block_size} does not fit the cache")));
                }
                let marks = vec![UNTOUCHED; size];
                for s in 0..2 * slots.len() {
                    cache.write_from(s * size, &marks)?;
                }
                if op == KvOp::Read {
                    let mut block = vec![0u8; size];
                    for (b, &s) in slots.iter().enumerate() {
                        fill_block(0, b as u64, &mut block);
                        cache.write_from(s as usize * size, &block)?;
                    }
                }
                shape = Some((size, slots));
                ctl.send(&KvReply::ShapeSet)?;
            }
            KvRequest::Wait { round } => {
                let n = rt
                    .block_on(async { tokio::time::timeout(OP_TIMEOUT, notifications.next()).await })
                    .map_err(|_| BenchError::Run(format!("request {round}: no notification within 60 s")))?
                    .ok_or_else(|| BenchError::run("the agent went away"))?;
                let t_ns = now_ns();
                if n.message != format!("kv {round}").into_bytes() {
                    return Err(BenchError::Run(format!(
                        "request {round}: the notification says {:?}",
                        String::from_utf8_lossy(&n.message)
                    )));
                }
                ctl.send(&KvReply::Arrived { t_ns })?;
            }
            KvRequest::Check { round } => {
                let (size, slots) = shape.as_ref().ok_or_else(|| BenchError::run("a check before any shape"))?;
                // Test hook (the check must notice): damage one byte of
                // block 0 before checking.
                if std::env::var_os("RDMA_BENCH_TEST_CORRUPT").is_some_and(|v| v == "kv") {
                    let at = slots[0] as usize * size + size / 2;
                    let mut x = [0u8; 1];
                    cache.read_into(at, &mut x)?;
                    cache.write_from(at, &[x[0] ^ 0x5a])?;
                }
                check_cache(&cache, *size, slots, round)?;
                ctl.send(&KvReply::Checked)?;
            }
            KvRequest::Bye => return Ok(()),
        }
    }
}

/// The times of one shape.
struct ShapeTimes {
    /// To decode's arrival where that is measured, else `local`.
    samples: Vec<f64>,
    /// `transfer` → future resolved, µs.
    local: Vec<f64>,
    /// Operations one request posted.
    ops: u64,
}

/// Prefill's agent, its blocks, decode's cache region.
struct Prefill<'a> {
    rt: &'a tokio::runtime::Runtime,
    agent: &'a TransferAgent,
    kv: &'a RdmaMemory,
    region: u32,
    info: &'a KvRunInfo,
}

impl Prefill<'_> {
    /// One request; returns (µs to the figure `info.until()` names,
    /// µs to the future resolving, operations posted).
    fn request<'b, L: LocalBlock<'b>>(
        &self,
        ctl: &mut Control,
        round: u64,
        pieces: &[(L, RemoteBlock)],
    ) -> Result<(f64, f64, u64)> {
        let notify = self.info.notify;
        if notify {
            ctl.send(&KvRequest::Wait { round })?;
        }
        let op = match self.info.op {
            KvOp::Write => AgentOp::Write,
            KvOp::Read => AgentOp::Read,
        };
        let tag = format!("kv {round}");
        let (t0, t1, ops) = self.rt.block_on(async {
            let t0 = now_ns();
            let t = self.agent.transfer(op, "decode", pieces, notify.then_some(tag.as_bytes()))?;
            let ops = t.ops() as u64;
            t.await?;
            Ok::<_, BenchError>((t0, now_ns(), ops))
        })?;
        let local = (t1 - t0) as f64 / 1e3;
        let mut until = local;
        if notify {
            match reply(ctl, "the notification's arrival")? {
                KvReply::Arrived { t_ns } if self.info.until() == "notification at decode" => {
                    until = t_ns.saturating_sub(t0) as f64 / 1e3;
                }
                KvReply::Arrived { .. } => {}
                other => return Err(BenchError::Run(format!("unexpected reply {other:?}"))),
            }
        }
        Ok((until, local, ops))
    }

    fn shape(&self, ctl: &mut Control, blocks: u64, size: u64, iters: u64, warmup: u64) -> Result<ShapeTimes> {
        let slots = slots(blocks, self.info.contiguous, blocks ^ size.rotate_left(20));
        ctl.send(&KvRequest::Shape { blocks, block_size: size, slots: slots.clone(), op: self.info.op })?;
        match reply(ctl, "the shape's setup")? {
            KvReply::ShapeSet => {}
            other => return Err(BenchError::Run(format!("unexpected reply {other:?}"))),
        }
        let sz = size as usize;
        let remote = |b: usize| RemoteBlock::new(self.region, slots[b] * size, size);
        let rounds = warmup + iters;
        let mut out = ShapeTimes { samples: Vec::new(), local: Vec::new(), ops: 0 };
        let mut block = vec![0u8; sz];
        for round in 0..rounds {
            let checked = self.info.check || round + 1 == rounds;
            let (until, local, ops) = match self.info.op {
                KvOp::Write => {
                    if checked {
                        for b in 0..blocks {
                            fill_block(round, b, &mut block);
                            self.kv.write_from(b as usize * sz, &block)?;
                        }
                    }
                    let pieces: Vec<_> = (0..blocks as usize)
                        .map(|b| Ok((self.kv.view(b * sz, sz)?, remote(b))))
                        .collect::<Result<_>>()?;
                    let r = self.request(ctl, round, &pieces)?;
                    if checked {
                        ctl.send(&KvRequest::Check { round })?;
                        match reply(ctl, "decode's check")? {
                            KvReply::Checked => {}
                            other => return Err(BenchError::Run(format!("unexpected reply {other:?}"))),
                        }
                    }
                    r
                }
                KvOp::Read => {
                    if checked {
                        self.kv.write_from(0, &vec![0u8; blocks as usize * sz])?;
                    }
                    let pieces: Vec<_> = (0..blocks as usize)
                        .map(|b| Ok((self.kv.view_mut(b * sz, sz)?, remote(b))))
                        .collect::<Result<_>>()?;
                    let r = self.request(ctl, round, &pieces)?;
                    drop(pieces);
                    if checked {
                        let mut got = vec![0u8; sz];
                        for b in 0..blocks {
                            fill_block(0, b, &mut block);
                            self.kv.read_into(b as usize * sz, &mut got)?;
                            if got != block {
                                return Err(BenchError::Verification(format!(
                                    "{blocks} x {}: request {round}: block {b} read from slot {} differs",
                                    format_size(size),
                                    slots[b as usize]
                                )));
                            }
                        }
                    }
                    r
                }
            };
            out.ops = ops;
            if round >= warmup {
                out.samples.push(until);
                out.local.push(local);
            }
        }
        Ok(out)
    }
}

/// Prefill: starts (or reaches) decode, measures every shape, prints.
fn client(a: &KvArgs) -> Result<()> {
    let shapes = shapes(a.blocks, a.block_size);
    if shapes.is_empty() {
        return Err(BenchError::Config(format!(
            "no shape of the sweep fits its {} limit with --blocks {} --block-size {}: give both to measure a larger \
             request",
            format_size(crate::kv::SWEEP_MAX_BYTES),
            a.blocks.map_or("(swept)".into(), |n| n.to_string()),
            a.block_size.map_or("(swept)".into(), format_size),
        )));
    }
    if shapes.iter().any(|&(n, b)| n == 0 || b == 0) {
        return Err(BenchError::Config("--blocks and --block-size must be at least 1".into()));
    }
    // Saturating: a product past u64 would wrap to a small request.
    let max = shapes.iter().map(|&(n, b)| n.saturating_mul(b)).max().expect("shapes");
    if max > 16 << 30 {
        return Err(BenchError::Config(format!(
            "a request of {} is more than this tool registers (decode registers twice the largest request)",
            format_size(max)
        )));
    }
    let env = std::env::var_os("RMACOMM_PROVIDER").map(|v| v.to_string_lossy().into_owned());
    let (provider, origin) = requested_provider(a.provider.map(provider_name), env.as_deref())?;
    let hello = KvHello {
        version: KV_PROTOCOL_VERSION,
        provider: provider.into(),
        link: link_name(a.link).into(),
        qps: a.qps,
        lb: lb_name(a.lb).into(),
        frag_size: a.frag_size,
        busy_poll_us: a.busy_poll_us,
        max_bytes: max,
    };
    // Fails here, before decode starts, when the provider cannot be had.
    let resolved = resolve(&hello.provider, &origin, &hello.link, a.ib_dev.as_deref())?;
    let config = agent_config(&resolved, &hello)?;
    let (local, host, port) = match &a.client {
        Some(peer) => {
            let (h, p) = parse_peer(peer, a.port).map_err(BenchError::Config)?;
            (None, h, p)
        }
        None => {
            let (srv, port) = LocalServer::spawn("kv", a.ib_dev.as_deref(), None)?;
            (Some(srv), "127.0.0.1".to_owned(), port)
        }
    };
    let mut ctl = Control::new(connect_with_retry(&host, port)?)?;
    // The server answers its hello within this, or is not one.
    ctl.set_timeout(Some(hello_answer_timeout()))?;
    ctl.send(&hello)?;
    let (metadata, region, decode_host, decode_provider, decode_device) = match reply(&mut ctl, "decode's metadata")? {
        KvReply::Ready { metadata, region, host, provider, device } => (metadata, region, host, provider, device),
        other => return Err(BenchError::Run(format!("unexpected reply {other:?}"))),
    };
    ctl.set_timeout(None)?;
    let rt = runtime()?;
    let _enter = rt.enter();
    let agent = TransferAgent::new("prefill", config)?;
    let kv = agent.alloc(usize::try_from(max).map_err(BenchError::run)?)?;
    agent.register(&kv)?;
    agent.add_peer(&metadata)?;
    rt.block_on(agent.connect("decode"))?;
    let mapped = rt.block_on(agent.peer_same_host("decode"))?;
    let link = link_used(&resolved, mapped);
    let info = KvRunInfo {
        op: a.op,
        contiguous: a.contiguous,
        notify: !a.no_notify,
        provider: resolved.provider_name().to_owned(),
        link: link.into(),
        qps: a.qps,
        check: a.check,
        one_clock: HostInfo::current().same_host(&decode_host),
    };
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let placement = match &a.client {
        Some(p) => format!("prefill, decode at {p}"),
        None => "local (prefill here, decode in a second process on this host)".into(),
    };
    let header = format!(
        "{RULE}\n                    KV-cache transfer through rmacomm_agent::TransferAgent\n \
         Request         : one {} of N blocks into {} slots of a 2N-slot cache, {}\n \
         Time            : transfer called -> {}\n \
         Provider        : {}   Device: {} (decode: {} {})\n Link            : {link}{}\n \
         Placement       : {placement}, {cores} cores here\n \
         Number of qps   : {}   Load balancing: {}   Fragment size: {} B\n \
         Shapes          : {}\n Check           : {}\n{RULE}",
        a.op.name(),
        if a.contiguous { "contiguous" } else { "shuffled, never adjacent," },
        if info.notify { "one notification" } else { "no notification" },
        match (info.until(), a.op, info.notify) {
            ("notification at decode", _, _) => "the notification taken at decode (CLOCK_MONOTONIC of this host)",
            (_, KvOp::Write, true) => "the transfer completed at prefill (decode is on another host: no common clock)",
            _ => "the transfer completed at prefill",
        },
        info.provider,
        resolved.device.name(),
        decode_provider,
        decode_device,
        if mapped { " (decode's memory mapped)" } else { "" },
        a.qps,
        hello.lb,
        a.frag_size,
        shapes.iter().map(|&(n, b)| format!("{n} x {}", format_size(b))).collect::<Vec<_>>().join(", "),
        if a.check {
            "every request: every block in its slot, no other slot changed"
        } else {
            "the last request of each shape (--check: every request)"
        },
    );
    let mut file = match &a.out_json {
        Some(p) => {
            Some(std::fs::File::create(p).map_err(|e| BenchError::Config(format!("--out-json {}: {e}", p.display())))?)
        }
        None => None,
    };
    let say = |text: &str| if a.json { eprintln!("{text}") } else { println!("{text}") };
    say(&header);
    say(&kv_table_header());
    let prefill = Prefill { rt: &rt, agent: &agent, kv: &kv, region, info: &info };
    for &(blocks, size) in &shapes {
        let (iters, warmup) = iterations(blocks * size, a.iters, a.warmup);
        let t = prefill.shape(&mut ctl, blocks, size, iters, warmup)?;
        let s = summarize_latency(&t.samples).ok_or_else(|| BenchError::run("nothing was measured"))?;
        let mut sorted = t.samples.clone();
        sorted.sort_by(f64::total_cmp);
        let rec = KvRecord::new(&info, blocks, size, t.ops, &s, &t.local, percentile(&sorted, 0.9));
        println!("{}", if a.json { rec.to_json() } else { kv_table_row(&rec) });
        if let Some(f) = file.as_mut() {
            writeln!(f, "{}", rec.to_json())?;
        }
    }
    let msg = if a.check {
        "data verified: every request's blocks were in their slots, and no other slot changed"
    } else {
        "data verified: each shape's last request's blocks were in their slots, and no other slot changed"
    };
    if a.json {
        eprintln!("{msg}");
    } else {
        println!("{RULE}\n {msg}");
    }
    let _ = ctl.send(&KvRequest::Bye);
    drop(ctl);
    drop(agent);
    if let Some(srv) = local {
        srv.finish()?;
    }
    Ok(())
}

/// Runs `rdma_bench kv` as the command line says.
pub fn run_kv(a: &KvArgs) -> Result<()> {
    if a.server {
        let listener = TcpListener::bind(("0.0.0.0", a.port))
            .map_err(|e| BenchError::Config(format!("cannot listen on port {}: {e}", a.port)))?;
        let port = listener.local_addr()?.port();
        println!("rdma_bench server: listening on 0.0.0.0:{port}; run `rdma_bench kv --client THIS_HOST:{port}`");
        std::io::stdout().flush()?;
        return serve(a, listener);
    }
    client(a)
}
