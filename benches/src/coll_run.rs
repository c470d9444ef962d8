//! Collective runs: the ranks (each a process holding one
//! `rmacomm_collectives::Comm`, made by `new_comm("rdma", ..)` from
//! torchrun's variables) and, without a launcher, the `--nproc` launcher
//! that starts them as processes of this same program.
//!
//! Each size: a barrier, the warm-up, a barrier, `-n` calls back to back
//! timed on every rank (nccl-tests' method), the per-iteration times
//! gathered to rank 0 (average and slowest), then one more call on the
//! check pattern whose result every rank compares with the reference
//! (`coll_check`); the wrong-element counts are gathered too.

use std::ffi::OsString;
use std::io::Write;
use std::net::{Ipv4Addr, TcpListener};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rmacomm_collectives::{new_comm, Comm, CommOptions, DType, ReduceOp, DEFAULT_SLOT_BYTES};
use rmacomm_transport::TransportConfig;
use rmacomm_window::WindowOptions;

use crate::cli::{BindArg, CollArgs, LinkArg, ProviderArg};
use crate::coll::{default_iters, default_warmup, redop_name, sweep, Coll};
use crate::coll_check::{check_output, fill_input, CheckSpec};
use crate::coll_report::{coll_table_header, coll_table_row, CollRecord};
use crate::device::{link_used, requested_provider, resolve};
use crate::error::{BenchError, Result};
use crate::report::RULE;
use crate::size::{format_size, sweep_sizes};

/// Set by the `--nproc` launcher in the environment of the ranks it
/// starts: they run as ranks whatever their command line says.
const RANK_ENV: &str = "RDMA_BENCH_COLL_RANK";

/// The default single size.
const DEFAULT_SIZE: u64 = 1 << 20;

/// The largest size a run accepts (per buffer).
const MAX_SIZE: u64 = 4 << 30;

/// The operation timeout when `RMACOMM_TIMEOUT_SECONDS` does not set one:
/// a broken run fails within this, a correct one never comes near it.
const TIMEOUT: Duration = Duration::from_secs(120);

fn provider_name(p: ProviderArg) -> &'static str {
    match p {
        ProviderArg::Auto => "auto",
        ProviderArg::Verbs => "verbs",
        ProviderArg::Soft => "soft",
    }
}

fn link_name(l: LinkArg) -> &'static str {
    match l {
        LinkArg::Auto => "auto",
        LinkArg::Shm => "shm",
        LinkArg::Tcp => "tcp",
    }
}

/// Whether a launcher's variables make this process one rank of a run.
fn launched() -> bool {
    ["RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK"].iter().any(|v| std::env::var_os(v).is_some())
}

/// Checks the options that do not depend on the ranks (`n` = `None`) or
/// that do, once their number is known; every problem is a `Config`
/// error naming the option.
fn validate(coll: Coll, a: &CollArgs, n: Option<usize>) -> Result<()> {
    let cfg = |m: String| Err(BenchError::Config(m));
    let name = coll.name();
    if let Some(op) = a.op {
        if !coll.reduces() {
            return cfg(format!("--op {op}: {name} does not reduce (--op applies to all_reduce and reduce_scatter)"));
        }
        if let Err(e) = op.check(a.dtype) {
            return cfg(format!("--op {op} with --dtype {}: {e}", a.dtype));
        }
    }
    if a.algo.is_some() && coll != Coll::AllReduce {
        return cfg(format!("--algo applies to all_reduce only (the hint rmacomm::algo); {name} has one algorithm"));
    }
    if a.root.is_some() && !coll.rooted() {
        return cfg(format!("--root applies to broadcast; {name} has no root"));
    }
    if a.iters == Some(0) {
        return cfg("-n 0: measure at least one iteration".into());
    }
    if a.slot_bytes == Some(0) {
        return cfg("--slot-bytes 0: a slot holds at least one byte".into());
    }
    if a.all && a.min > a.max {
        return cfg(format!("--min {} must not exceed --max {}", a.min, a.max));
    }
    if a.all && sweep_sizes(a.min, a.max).is_empty() {
        return cfg(format!(
            "-a --min {} --max {}: no size to sweep (sizes are powers of two in that range)",
            a.min, a.max
        ));
    }
    let biggest = if a.all { a.max } else { a.size.unwrap_or(DEFAULT_SIZE) };
    if biggest > MAX_SIZE || (!a.all && biggest == 0) {
        return cfg(format!("sizes must be 1 B .. 4 GiB (got {biggest})"));
    }
    if let Some(n) = n {
        if n == 0 {
            return cfg("--nproc 0: a run needs at least one rank".into());
        }
        let root = a.root.unwrap_or(0);
        if root >= n {
            return cfg(format!("--root {root}: not a rank of this run of {n} (0 .. {})", n - 1));
        }
        let unit = coll.unit(a.dtype, n);
        if let Some(s) = a.size.filter(|s| s % unit != 0) {
            let what = if unit == a.dtype.size() as u64 {
                format!("{name} of {} needs a multiple of {unit} B (whole elements)", a.dtype)
            } else {
                format!("{name} of {} over {n} ranks needs a multiple of {unit} B (whole elements per rank)", a.dtype)
            };
            return cfg(format!("-s {s}: {what}"));
        }
    }
    Ok(())
}

/// Runs `coll` as the command line says: as one rank under a launcher,
/// else as the launcher of `--nproc` ranks.
pub fn run_coll(coll: Coll, a: &CollArgs) -> Result<()> {
    validate(coll, a, None)?;
    if std::env::var_os(RANK_ENV).is_some() || (a.nproc.is_none() && launched()) {
        return rank_main(coll, a);
    }
    let n = a.nproc.unwrap_or(2);
    validate(coll, a, Some(n))?;
    launch(n)
}

/// Starts `n` ranks of this program with this command line and torchrun's
/// variables, rank 0's stdout as ours (the others' is dropped; every
/// rank's stderr is ours); waits for them. When one fails, the others get
/// a few seconds to fail too (a wrong result fails every rank at once),
/// then are killed; the first failure's exit status is ours.
fn launch(n: usize) -> Result<()> {
    let exe = std::env::current_exe()?;
    let args: Vec<OsString> = std::env::args_os().skip(1).collect();
    let port = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|l| l.local_addr())
        .map_err(|e| BenchError::Run(format!("cannot find a free port for the ranks' store: {e}")))?
        .port();
    let mut ranks = Ranks(Vec::with_capacity(n));
    for r in 0..n {
        let mut cmd = Command::new(&exe);
        cmd.args(&args)
            .env(RANK_ENV, "1")
            .env("RANK", r.to_string())
            .env("WORLD_SIZE", n.to_string())
            .env("LOCAL_RANK", r.to_string())
            .env("LOCAL_WORLD_SIZE", n.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .stdin(Stdio::null())
            .stdout(if r == 0 { Stdio::inherit() } else { Stdio::null() })
            .stderr(Stdio::inherit());
        let child = cmd.spawn().map_err(|e| BenchError::Run(format!("starting rank {r}: {e}")))?;
        ranks.0.push(Some(child));
    }
    // (rank, exit status or None for a signal, when)
    let mut failed: Option<(usize, Option<i32>, Instant)> = None;
    loop {
        let mut running = 0;
        for (r, slot) in ranks.0.iter_mut().enumerate() {
            let Some(c) = slot else { continue };
            match c.try_wait()? {
                Some(st) => {
                    *slot = None;
                    if !st.success() && failed.is_none() {
                        failed = Some((r, st.code(), Instant::now()));
                    }
                }
                None => running += 1,
            }
        }
        if running == 0 {
            break;
        }
        if failed.is_some_and(|(_, _, at)| at.elapsed() > Duration::from_secs(5)) {
            // Dropping the handles kills them.
            ranks.0.iter_mut().for_each(|s| drop(s.take().map(Rank)));
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    match failed {
        None => Ok(()),
        // The rank printed its error: exit as it did.
        Some((rank, Some(code), _)) => Err(BenchError::Exit { rank, code }),
        Some((rank, None, _)) => Err(BenchError::Run(format!("rank {rank} was killed by a signal"))),
    }
}

/// A rank process, killed if still running when dropped.
struct Rank(Child);

impl Drop for Rank {
    fn drop(&mut self) {
        if self.0.try_wait().ok().flatten().is_none() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// The ranks of a launch; those still running are killed on drop (an
/// error of the launcher never leaves them behind).
struct Ranks(Vec<Option<Child>>);

impl Drop for Ranks {
    fn drop(&mut self) {
        self.0.iter_mut().for_each(|s| drop(s.take().map(Rank)));
    }
}

/// Binds this process to one CPU: the local rank's position among those
/// it may run on (modulo their number). Returns the CPU.
fn bind_to_core() -> Result<usize> {
    use rustix::thread::{sched_getaffinity, sched_setaffinity, CpuSet};
    let local = ["LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"]
        .iter()
        .find_map(|v| std::env::var(v).ok().and_then(|s| s.trim().parse::<usize>().ok()))
        .ok_or_else(|| BenchError::Config("--bind-to core: no LOCAL_RANK to pick a core by".into()))?;
    let allowed = sched_getaffinity(None).map_err(|e| BenchError::Run(format!("--bind-to core: {e}")))?;
    let cpus: Vec<usize> = (0..CpuSet::MAX_CPU).filter(|&c| allowed.is_set(c)).collect();
    let cpu = *cpus
        .get(local % cpus.len().max(1))
        .ok_or_else(|| BenchError::Run("--bind-to core: this process may run on no CPU".into()))?;
    let mut one = CpuSet::new();
    one.set(cpu);
    sched_setaffinity(None, &one).map_err(|e| BenchError::Run(format!("--bind-to core: CPU {cpu}: {e}")))?;
    Ok(cpu)
}

/// The buffers of one rank, allocated once for the largest size.
struct Buffers {
    input: Vec<u8>,
    output: Vec<u8>,
}

/// One call of `coll`; all_reduce and broadcast work in place in `input`.
fn call(
    comm: &mut Comm,
    coll: Coll,
    input: &mut [u8],
    output: &mut [u8],
    dtype: DType,
    op: ReduceOp,
    root: usize,
) -> rmacomm_collectives::Result<()> {
    match coll {
        Coll::AllReduce => comm.all_reduce(input, dtype, op),
        Coll::AllGather => comm.all_gather_single(output, input),
        Coll::ReduceScatter => comm.reduce_scatter_single(output, input, dtype, op),
        Coll::AllToAll => comm.all_to_all_single(output, input),
        Coll::Broadcast => comm.broadcast(input, root),
    }
}

fn coll_err(what: &str) -> impl Fn(rmacomm_collectives::Error) -> BenchError + '_ {
    move |e| BenchError::Run(format!("{what}: {e}"))
}

/// Every rank's `v`, gathered to every rank (8 bytes each).
fn gather_u64(comm: &mut Comm, v: u64) -> Result<Vec<u64>> {
    let mut all = vec![0u8; 8 * comm.size()];
    comm.all_gather_single(&mut all, &v.to_ne_bytes()).map_err(coll_err("gathering the figures"))?;
    Ok(all.chunks_exact(8).map(|c| u64::from_ne_bytes(c.try_into().expect("8 bytes"))).collect())
}

/// Where a rank's output goes: rank 0 prints, the others stay quiet.
struct Out {
    print: bool,
    json: bool,
    file: Option<std::fs::File>,
    records: Vec<CollRecord>,
}

impl Out {
    fn header(&self, text: &str) {
        if !self.print {
            return;
        }
        if self.json {
            eprintln!("{text}");
        } else {
            println!("{text}");
        }
    }

    fn row(&mut self, r: CollRecord) -> Result<()> {
        if !self.print {
            return Ok(());
        }
        println!("{}", if self.json { r.to_json() } else { coll_table_row(&r) });
        std::io::stdout().flush()?;
        if let Some(f) = self.file.as_mut() {
            writeln!(f, "{}", r.to_json())?;
        }
        self.records.push(r);
        Ok(())
    }
}

/// One rank of the run.
fn rank_main(coll: Coll, a: &CollArgs) -> Result<()> {
    if std::env::var_os(RANK_ENV).is_some() {
        // A rank started by `launch` ends with its launcher.
        let _ = rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL));
    }
    // This host's cores, before a binding narrows what this process sees.
    let cores = std::thread::available_parallelism().map_or(0, |c| c.get());
    // Before the communicator's threads exist: they inherit it.
    let bound = match a.bind_to {
        BindArg::None => None,
        BindArg::Core => Some(bind_to_core()?),
    };
    let env = std::env::var_os("RMACOMM_PROVIDER").map(|v| v.to_string_lossy().into_owned());
    let (provider, origin) = requested_provider(a.provider.map(provider_name), env.as_deref())?;
    let resolved = resolve(provider, &origin, link_name(a.link), None)?;
    let tc = TransportConfig::default()
        .with_provider(resolved.kind)
        .with_device(Some(resolved.device.name().to_owned()))
        .with_soft(resolved.soft.clone());
    let mut opts = CommOptions::new().window(WindowOptions::new().transport(tc).unified(!a.separate));
    if std::env::var_os("RMACOMM_TIMEOUT_SECONDS").is_none() {
        opts = opts.timeout(TIMEOUT);
    }
    if let Some(al) = a.algo {
        opts = opts.hint("rmacomm::algo", al.name());
    }
    if let Some(s) = a.slot_bytes {
        opts = opts.slot_bytes(s as usize);
    }
    let mut comm = new_comm("rdma", opts).map_err(coll_err("new_comm(\"rdma\")"))?;
    let (me, n) = (comm.rank(), comm.size());
    validate(coll, a, Some(n))?;
    let (dtype, op, root) = (a.dtype, a.op.unwrap_or(ReduceOp::Sum), a.root.unwrap_or(0));
    // The default size rounded down to whole elements per rank, as the
    // sweep's (1 MiB is not a multiple of 4 B × 3 ranks: the first call was
    // refused); a size the user gave was checked by `validate`.
    let sizes = match (a.all, a.size) {
        (true, _) => sweep(coll, dtype, n, &sweep_sizes(a.min, a.max)),
        (false, Some(s)) => vec![s],
        (false, None) => sweep(coll, dtype, n, &[DEFAULT_SIZE]),
    };
    let max = *sizes.iter().max().expect("at least one size");
    let (in_max, out_max) = coll.buffers(max as usize, n);
    let out_max = if matches!(coll, Coll::AllReduce | Coll::Broadcast) { 0 } else { out_max };
    let mut bufs = Buffers { input: vec![0u8; in_max], output: vec![0u8; out_max] };

    let same_host = (0..n).all(|p| p == me || comm.group().same_host(p));
    let link = link_used(&resolved, same_host);
    let file = match (&a.out_json, me) {
        (Some(p), 0) => {
            Some(std::fs::File::create(p).map_err(|e| BenchError::Config(format!("--out-json {}: {e}", p.display())))?)
        }
        _ => None,
    };
    let mut out = Out { print: me == 0, json: a.json, file, records: Vec::new() };
    let cpus = gather_u64(&mut comm, bound.map_or(u64::MAX, |c| c as u64))?;
    let binding = match bound {
        None => "none (the scheduler places the ranks)".to_owned(),
        Some(_) => format!("core: rank r on CPU {}", cpus.iter().map(|c| c.to_string()).collect::<Vec<_>>().join(", ")),
    };
    out.header(&header(coll, a, n, resolved.device.name(), resolved.provider_name(), link, &sizes, &binding, cores));
    out.header(&coll_table_header());

    let corrupt_at = std::env::var("RDMA_BENCH_TEST_CORRUPT").ok().and_then(|v| v.parse::<u64>().ok());
    for &size in &sizes {
        let (il, ol) = coll.buffers(size as usize, n);
        let ol = if bufs.output.is_empty() { 0 } else { ol };
        let (input, output) = (&mut bufs.input[..il], &mut bufs.output[..ol]);
        let iters = a.iters.unwrap_or_else(|| default_iters(size));
        let warm = a.warmup.unwrap_or_else(|| default_warmup(iters));
        // Timed data: zeros for all_reduce (a repeated in-place sum stays
        // finite), a pattern elsewhere; written, so every page is mapped.
        if coll == Coll::AllReduce {
            input.fill(0);
        } else {
            fill_input(dtype, 1, me, input);
        }
        output.fill(0);
        let what = format!("{} of {}", coll.name(), format_size(size));
        comm.barrier().map_err(coll_err(&what))?;
        for _ in 0..warm {
            call(&mut comm, coll, input, output, dtype, op, root).map_err(coll_err(&what))?;
        }
        comm.barrier().map_err(coll_err(&what))?;
        let t0 = Instant::now();
        for _ in 0..iters {
            call(&mut comm, coll, input, output, dtype, op, root).map_err(coll_err(&what))?;
        }
        let per_iter = t0.elapsed().as_secs_f64() / iters as f64;
        let times: Vec<f64> = gather_u64(&mut comm, per_iter.to_bits())?.into_iter().map(f64::from_bits).collect();
        let avg = times.iter().sum::<f64>() / n as f64;
        let slowest = times.iter().copied().fold(0.0, f64::max);

        let wrong = if a.check == 1 {
            let seed = size.rotate_left(17) ^ 0xc0_11ec;
            let spec = CheckSpec { coll, dtype, op, seed, n, me, root };
            // A broadcast's receivers start from other values, so that
            // a buffer left as it was cannot pass.
            fill_input(dtype, if coll == Coll::Broadcast && me != root { !seed } else { seed }, me, input);
            output.fill(0xa5);
            call(&mut comm, coll, input, output, dtype, op, root).map_err(coll_err(&what))?;
            let result: &mut [u8] = if output.is_empty() { input } else { output };
            // Test hook: damage one element of the last rank's result at
            // this size; the check must fail loudly.
            if corrupt_at == Some(size) && me == n - 1 {
                let at = (result.len() / 2) / dtype.size() * dtype.size();
                result[at] ^= 0x5a;
            }
            let r = check_output(&spec, result);
            if let Some((k, got, want)) = r.first {
                eprintln!(
                    "rdma_bench: rank {me}: {what}: {} wrong elements; the first, element {k}, is {got}, expected {want}",
                    r.wrong
                );
            }
            Some(gather_u64(&mut comm, r.wrong)?.iter().sum::<u64>())
        } else {
            None
        };
        let algbw = size as f64 / avg / 1e9;
        out.row(CollRecord {
            op: coll.name().into(),
            bytes: size,
            count: coll.count(size, dtype, n),
            dtype: dtype.name().into(),
            redop: redop_name(coll, op),
            root: coll.rooted().then_some(root as u64),
            algo: a.algo.map(|al| al.name().to_owned()),
            ranks: n as u64,
            iterations: iters,
            time_us: avg * 1e6,
            time_max_us: Some(slowest * 1e6),
            algbw_GBps: algbw,
            busbw_GBps: algbw * coll.bus_factor(n),
            wrong,
            provider: resolved.provider_name().into(),
            link: link.into(),
            peer: None,
        })?;
        if let Some(w) = wrong.filter(|&w| w > 0) {
            if me != 0 {
                // Rank 0 reports it; this rank said what it found.
                return Err(BenchError::Exit { rank: me, code: 3 });
            }
            return Err(BenchError::Verification(format!(
                "{what}: {w} elements of the result differ from the reference over {n} ranks (see the ranks' \
                 messages above)"
            )));
        }
    }
    let msg = match a.check {
        1 if sizes.len() == 1 => "results checked: every rank's output matched the reference".to_owned(),
        1 => "results checked: after every size, every rank's output matched the reference".to_owned(),
        _ => "results not checked (-c 0)".to_owned(),
    };
    if out.print {
        if out.json {
            eprintln!("{msg}");
        } else {
            println!("{RULE}\n {msg}");
        }
    }
    comm.finalize().map_err(coll_err("finalize"))?;
    if let (Some(p), true) = (&a.plot, out.print) {
        crate::plot::write_coll_svg(p, &out.records).map_err(BenchError::Run)?;
        eprintln!("plot: {}", p.display());
    }
    Ok(())
}

/// The header block: what ran, where, and how it was timed.
#[allow(clippy::too_many_arguments)]
fn header(
    coll: Coll,
    a: &CollArgs,
    n: usize,
    device: &str,
    provider: &str,
    link: &str,
    sizes: &[u64],
    binding: &str,
    cores: usize,
) -> String {
    let ranks = if std::env::var_os(RANK_ENV).is_some() {
        format!("{n} processes on this host (started by rdma_bench --nproc {n})")
    } else {
        format!("{n} processes (a launcher's RANK/WORLD_SIZE)")
    };
    let path = if a.separate {
        "SEPARATE for every peer (--separate: through the transport)"
    } else if link == "shm" {
        "UNIFIED (same-host peers' memory mapped)"
    } else {
        "SEPARATE across hosts / over tcp (through the transport)"
    };
    let op = match coll.reduces() {
        true => format!("   Op: {}", redop_name(coll, a.op.unwrap_or(ReduceOp::Sum)).unwrap_or_default()),
        false => String::new(),
    };
    let algo = match (coll, a.algo) {
        (Coll::AllReduce, Some(al)) => format!("   Algorithm: {} (hint rmacomm::algo)", al.name()),
        (Coll::AllReduce, None) => "   Algorithm: the library's (oneshot up to 64 KiB, then direct)".into(),
        _ => String::new(),
    };
    let root = if coll.rooted() { format!("   Root: {}", a.root.unwrap_or(0)) } else { String::new() };
    let size_text = match sizes {
        [one] => format_size(*one),
        many => format!("{} .. {}", format_size(many[0]), format_size(many[many.len() - 1])),
    };
    let iters = match (a.iters, a.warmup) {
        (Some(i), Some(w)) => format!("{i}, warm-up {w}"),
        (Some(i), None) => format!("{i}, warm-up {}", default_warmup(i)),
        (None, Some(w)) => format!("about 256 MiB per size (20 .. 1000), warm-up {w}"),
        (None, None) => "about 256 MiB per size (20 .. 1000), warm-up a tenth (5 .. 100)".into(),
    };
    let factor = match coll {
        Coll::AllReduce => "2(n-1)/n",
        Coll::Broadcast => "1",
        _ => "(n-1)/n",
    };
    format!(
        "{RULE}\n                    {} through rmacomm_collectives::Comm\n \
         Layer           : new_comm(\"rdma\"): collectives on one-sided windows\n \
         Ranks           : {ranks}, {cores} cores here\n \
         Binding         : {binding}\n \
         Provider        : {provider}   Device: {device}   Link: {link}\n \
         Window path     : {path}\n \
         Type            : {}{op}{algo}{root}\n \
         Slot bytes      : {}\n \
         Sizes           : {size_text}   Iterations: {iters}\n \
         Time            : per iteration, calls back to back after a barrier, averaged over the ranks\n \
         Bandwidth       : algbw = size / time, busbw = algbw x {factor} (nccl-tests), GB = 10^9 B\n \
         Check           : {}\n{RULE}",
        coll.name(),
        a.dtype,
        a.slot_bytes
            .map_or_else(|| format!("{} (the library's default)", format_size(DEFAULT_SLOT_BYTES as u64)), format_size),
        if a.check == 1 {
            "each size once more on a known pattern, every element against the reference (-c 1)"
        } else {
            "none (-c 0)"
        },
    )
}
