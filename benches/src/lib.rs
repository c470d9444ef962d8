//! rmacomm benchmarks: `rdma_bench`, a perftest-style bandwidth and latency
//! tool for rmacomm's layers, and the pieces it is made of.
//!
//! # Quick start
//! ```text
//! cargo run --release -p rmacomm-bench --bin rdma_bench -- write -a --local
//! cargo run --release -p rmacomm-bench --bin rdma_bench -- verbs_write -a --link tcp --json
//! cargo run --release -p rmacomm-bench --bin rdma_bench -- put -a --min 64K --local
//! cargo run --release -p rmacomm-bench --bin rdma_bench -- all_reduce -a --nproc 2
//! rmacomm-run --nproc-per-node 4 rdma_bench all_gather -s 1M   # ranks from a launcher
//! rdma_bench write_lat --server                 # host A: prints the port
//! rdma_bench write_lat --client hostA:18515     # host B
//! ```
//! Collectives (`all_reduce`, `all_gather`, `reduce_scatter`,
//! `all_to_all`, `broadcast`: `rmacomm_collectives::Comm` over N rank
//! processes, nccl-tests' columns and bus bandwidth, every size checked
//! against a reference), a KV-cache transfer through the transfer agent
//! (`kv`: one request of N blocks into shuffled slots of another process,
//! one notification), operations of the window (`put`, `put_lat`, `get`: two ranks of an
//! `rmacomm_window::Group`, the server rank 0 hosting its `TcpStore`),
//! through the transport (`write`, `read`, `write_lat`, `read_lat`) and on
//! the raw virtual QP (`verbs_write`, `verbs_write_lat`, `verbs_read`)
//! print perftest's tables; every run
//! checks the bytes each size moved and exits non-zero (3) if they
//! are wrong, 2 for options that cannot work here (e.g. `--provider verbs`
//! without an RDMA device), 1 when the run breaks.
//!
//! # Features
//! `--json` / `--out-json` (one object per size), `--plot FILE.svg`,
//! `-a` sweeps with a progress bar on terminals, `-b` bidirectional,
//! `-D` seconds per size, `-q`/`--lb`/`--frag-size` for the virtual QP.
//! `benches/compare.sh` sets the figures beside peers' (memcpy, iperf3,
//! UCX, Open MPI, perftest) as ratios.
//!
//! # Thread safety
//! A run is two processes (a collective run: N ranks, plus the `--nproc`
//! launcher waiting for them); each uses one measuring thread (plus the
//! transport's or the window's runtime worker, or the raw server's
//! responder thread).
//!
//! # Resource cleanup
//! The `--local` server process is killed if the client fails, the
//! `--nproc` ranks if one of them fails or the launcher dies; buffers
//! are deregistered when each process exits.
//!
//! # Organization
//! Sans-IO, unit-tested: `size` (parsing, sweeps), `stats` (latency and
//! bandwidth figures), `checksum`, `plan` (iterations), `report` (tables,
//! JSON), `plot` (SVG), `coll` (collectives' sizes, counts, bus factors),
//! `coll_check` (the collectives' reference results), `coll_report`
//! (their table and JSON), `kv` (the KV-cache benchmark's shapes, slots,
//! blocks and records). `coll_run` runs the ranks and the `--nproc`
//! launcher; `kv_run` the KV-cache benchmark's prefill and decode
//! processes over `rmacomm_agent`. I/O: `cli`, `device` (provider and device
//! choice), `bootstrap` (the TCP control connection), `engine` with
//! `window_engine`, `transport_engine` and `verbs_engine` (the three
//! measured layers), `run` (client, server, `--local`).

#![forbid(unsafe_code)]

mod bootstrap;
mod checksum;
mod cli;
mod coll;
mod coll_check;
mod coll_report;
mod coll_run;
mod device;
mod engine;
mod error;
mod host;
mod kv;
mod kv_run;
mod plan;
mod plot;
mod report;
mod run;
mod size;
mod stats;
mod transport_engine;
mod verbs_engine;
mod window_engine;

pub use bootstrap::{parse_peer, Control, Hello, Region, Reply, Request, SideInfo, PROTOCOL_VERSION};
pub use checksum::{pattern_chunk, Checksum};
pub use cli::{AlgoArg, BenchArgs, BindArg, Cli, CollArgs, Command, KvArgs, LbArg, LinkArg, PlotArgs, ProviderArg};
pub use coll::{default_iters, default_warmup, parse_dtype, parse_redop, redop_name, sweep, Coll};
pub use coll_check::{
    check_output, decode, encode, expected, fill_input, reduce_ref, same, value, CheckResult, CheckSpec, Num,
};
pub use coll_report::{coll_table_header, coll_table_row, CollRecord};
pub use coll_run::run_coll;
pub use device::{link_used, resolve, Resolved};
pub use error::{BenchError, Result};
pub use host::HostInfo;
pub use kv::{
    fill_block, iterations as kv_iterations, kv_table_header, kv_table_row, shapes as kv_shapes, slots as kv_slots,
    KvOp, KvRecord, KvRunInfo, KV_BUDGET, SWEEP_BLOCKS, SWEEP_BLOCK_SIZES, SWEEP_MAX_BYTES, UNTOUCHED,
};
pub use kv_run::run_kv;
pub use plan::{plan, Measure, Plan, BW_BUDGET, LAT_BUDGET};
pub use plot::{series_name, write_coll_svg, write_svg};
pub use report::{table_header, table_row, Kind, Record, RunInfo, RULE};
pub use run::{run_op, Op};
pub use size::{format_size, parse_size, size_arg, sweep_sizes};
pub use stats::{
    percentile, summarize_bandwidth, summarize_latency, BandwidthSummary, LatencySummary, Timings, EXACT_PEAK_MAX,
    GBIT, MB,
};

/// Runs `rdma_bench` with the given command line; returns the exit status.
pub fn main_with(cli: Cli) -> i32 {
    let r = match cli.command {
        Command::AllReduce(a) => run_coll(Coll::AllReduce, &a),
        Command::AllGather(a) => run_coll(Coll::AllGather, &a),
        Command::ReduceScatter(a) => run_coll(Coll::ReduceScatter, &a),
        Command::AllToAll(a) => run_coll(Coll::AllToAll, &a),
        Command::Broadcast(a) => run_coll(Coll::Broadcast, &a),
        Command::Put(a) => run_op(Op::Put, &a),
        Command::PutLat(a) => run_op(Op::PutLat, &a),
        Command::Get(a) => run_op(Op::Get, &a),
        Command::Write(a) => run_op(Op::Write, &a),
        Command::Read(a) => run_op(Op::Read, &a),
        Command::WriteLat(a) => run_op(Op::WriteLat, &a),
        Command::ReadLat(a) => run_op(Op::ReadLat, &a),
        Command::VerbsWrite(a) => run_op(Op::VerbsWrite, &a),
        Command::VerbsWriteLat(a) => run_op(Op::VerbsWriteLat, &a),
        Command::VerbsRead(a) => run_op(Op::VerbsRead, &a),
        Command::Kv(a) => run_kv(&a),
        Command::Plot(p) => plot_files(&p),
    };
    match r {
        Ok(()) => 0,
        // Already reported by the rank that failed.
        Err(e @ BenchError::Exit { .. }) => e.exit_code(),
        Err(e) => {
            eprintln!("rdma_bench: error: {e}");
            e.exit_code()
        }
    }
}

fn plot_files(p: &PlotArgs) -> Result<()> {
    let mut records = Vec::new();
    let mut colls = Vec::new();
    for f in &p.inputs {
        let text = std::fs::read_to_string(f).map_err(|e| BenchError::Config(format!("{}: {e}", f.display())))?;
        for (i, line) in text.lines().enumerate().filter(|(_, l)| l.trim_start().starts_with('{')) {
            let bad = |e: serde_json::Error| {
                BenchError::Config(format!("{}:{}: not an rdma_bench record: {e}", f.display(), i + 1))
            };
            // Collective records carry a time per call; the others do not.
            let v: serde_json::Value = serde_json::from_str(line).map_err(bad)?;
            if v.get("time_us").is_some() {
                colls.push(serde_json::from_value::<CollRecord>(v).map_err(bad)?);
            } else {
                records.push(serde_json::from_value::<Record>(v).map_err(bad)?);
            }
        }
    }
    if !colls.is_empty() && !records.is_empty() {
        return Err(BenchError::Config(
            "these files mix collective records (time_us) with point-to-point ones: plot them separately".into(),
        ));
    }
    if colls.is_empty() {
        write_svg(&p.out, &records).map_err(BenchError::Run)?;
    } else {
        write_coll_svg(&p.out, &colls).map_err(BenchError::Run)?;
    }
    eprintln!("plot: {} ({} records)", p.out.display(), records.len() + colls.len());
    Ok(())
}
