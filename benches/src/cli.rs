//! The command line: `rdma_bench OP [options]`, options named and meaning
//! what they mean in perftest.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

use rmacomm_collectives::{DType, ReduceOp};

use crate::coll::{parse_dtype, parse_redop};
use crate::kv::KvOp;
use crate::size::size_arg;

/// perftest-style bandwidth and latency of rmacomm's layers.
#[derive(Debug, Parser)]
#[command(
    name = "rdma_bench",
    version,
    about = "perftest-style bandwidth and latency of rmacomm's layers: the Window, RdmaTransport and the raw VirtualQp",
    long_about = None
)]
pub struct Cli {
    /// What to measure.
    #[command(subcommand)]
    pub command: Command,
}

/// The commands: one per measured operation, and helpers.
///
/// Collectives of `rmacomm_collectives::Comm` (N ranks, nccl-tests'
/// columns), operations of the one-sided window (`rmacomm_window::Window`),
/// through the transport layer (`RdmaTransport`) and on the raw virtual QP
/// (`ibverbx::VirtualQp`, no transport layer) sit side by side.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// all_reduce in place (nccl-tests' all_reduce_perf).
    #[command(name = "all_reduce")]
    AllReduce(CollArgs),
    /// all_gather_single: size / N bytes from every rank to every rank.
    #[command(name = "all_gather")]
    AllGather(CollArgs),
    /// reduce_scatter_single: size bytes in, size / N reduced bytes out.
    #[command(name = "reduce_scatter")]
    ReduceScatter(CollArgs),
    /// all_to_all_single: size bytes in and out, size / N per peer.
    #[command(name = "all_to_all")]
    AllToAll(CollArgs),
    /// broadcast of size bytes from --root.
    #[command(name = "broadcast")]
    Broadcast(CollArgs),
    /// Window put bandwidth: puts into the peer's registered tensor, each
    /// batch (warm-up, measured part) ended by a signal the peer answers.
    #[command(name = "put")]
    Put(BenchArgs),
    /// Window put latency: put + signal, answered by wait_signal + put +
    /// signal (ping-pong), half the round trip.
    #[command(name = "put_lat")]
    PutLat(BenchArgs),
    /// Window get bandwidth: gets from the peer's registered tensor.
    #[command(name = "get")]
    Get(BenchArgs),
    /// RDMA WRITE bandwidth through RdmaTransport.
    #[command(name = "write")]
    Write(BenchArgs),
    /// RDMA READ bandwidth through RdmaTransport.
    #[command(name = "read")]
    Read(BenchArgs),
    /// RDMA WRITE latency through RdmaTransport: notifying-write ping-pong,
    /// half the round trip.
    #[command(name = "write_lat")]
    WriteLat(BenchArgs),
    /// RDMA READ latency through RdmaTransport: one read, call to
    /// completion (a read is a round trip; not halved, as in perftest).
    #[command(name = "read_lat")]
    ReadLat(BenchArgs),
    /// RDMA WRITE bandwidth on the raw VirtualQp.
    #[command(name = "verbs_write")]
    VerbsWrite(BenchArgs),
    /// RDMA WRITE_WITH_IMM ping-pong latency on the raw VirtualQp, half the
    /// round trip.
    #[command(name = "verbs_write_lat")]
    VerbsWriteLat(BenchArgs),
    /// RDMA READ bandwidth on the raw VirtualQp.
    #[command(name = "verbs_read")]
    VerbsRead(BenchArgs),
    /// KV-cache transfer through the transfer agent (`rmacomm_agent`): a
    /// prefill process sends one request of N blocks into N shuffled slots
    /// of a decode process's cache, with one notification; the time runs
    /// from `transfer` to the notification's arrival at decode.
    #[command(name = "kv")]
    Kv(KvArgs),
    /// Draws JSON-lines results (from `--json` or `--out-json`) of one or
    /// more runs into one SVG.
    #[command(name = "plot")]
    Plot(PlotArgs),
}

/// `rdma_bench plot`.
#[derive(Debug, Args)]
pub struct PlotArgs {
    /// The SVG to write.
    #[arg(short, long)]
    pub out: PathBuf,
    /// JSON-lines files written by `--json`/`--out-json`.
    #[arg(required = true)]
    pub inputs: Vec<PathBuf>,
}

/// Which provider: hardware verbs, the soft provider, or hardware when an
/// HCA exists.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ProviderArg {
    /// An HCA when one exists, else the soft provider.
    Auto,
    /// An HCA (rdma-core); an error without one.
    Verbs,
    /// The soft provider (shared memory / TCP).
    Soft,
}

/// The soft provider's link.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LinkArg {
    /// Shared memory on the same host, TCP otherwise.
    Auto,
    /// Shared memory only.
    Shm,
    /// TCP, also on the same host.
    Tcp,
}

/// Load balancing over several QPs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LbArg {
    /// Sequence-numbered WRITE_WITH_IMM fragments.
    Dqplb,
    /// Plain WRITE fragments and a notify after them.
    Spray,
}

/// Options of every measured operation.
#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    /// Both ends on this host, in two processes (the default when no peer
    /// is given): this process spawns `rdma_bench` itself as the server.
    #[arg(long, conflicts_with_all = ["server", "client"])]
    pub local: bool,
    /// Be the server of a two-host run: print the port, serve one client,
    /// exit. Sizes, QPs and the rest come from the client.
    #[arg(long, conflicts_with = "client")]
    pub server: bool,
    /// Be the client of a two-host run: the server's `HOST[:PORT]`.
    #[arg(long, value_name = "HOST[:PORT]")]
    pub client: Option<String>,
    /// Bootstrap TCP port (server: where to listen, 0 = any; client: the
    /// default when HOST has none).
    #[arg(short = 'p', long, default_value_t = 18515)]
    pub port: u16,
    /// Message size (K, M, G suffixes: powers of 1024). Default 64K for
    /// bandwidth, 2 for latency, as perftest.
    #[arg(short = 's', long, value_parser = size_arg)]
    pub size: Option<u64>,
    /// Sweep sizes: powers of two from --min to --max.
    #[arg(short = 'a', long)]
    pub all: bool,
    /// Smallest size of a sweep [default: 2; 64K for put and get, whose
    /// sweep is 64 KiB … 256 MiB].
    #[arg(long, value_parser = size_arg)]
    pub min: Option<u64>,
    /// Largest size of a sweep.
    #[arg(long, value_parser = size_arg, default_value = "256M")]
    pub max: u64,
    /// Measured iterations per size (default: about 2 GiB moved per size
    /// for bandwidth, between 8 and 5000 iterations; 8..1000 for latency).
    #[arg(short = 'n', long, value_parser = clap::value_parser!(u64).range(1..))]
    pub iters: Option<u64>,
    /// Measure each size for this many seconds instead of a fixed count.
    #[arg(short = 'D', long, conflicts_with = "iters")]
    pub duration: Option<f64>,
    /// Iterations before measuring (default: a tenth of the iterations,
    /// 2..=500).
    #[arg(long)]
    pub warmup: Option<u64>,
    /// Operations in flight (bandwidth tests).
    #[arg(short = 't', long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..))]
    pub tx_depth: u32,
    /// Physical QPs per connection.
    #[arg(short = 'q', long, default_value_t = 1)]
    pub qps: u32,
    /// Load balancing over several QPs.
    #[arg(long, value_enum, default_value_t = LbArg::Dqplb)]
    pub lb: LbArg,
    /// Fragment size: longer messages are cut into pieces of this size.
    #[arg(long, value_parser = size_arg, default_value = "1M")]
    pub frag_size: u64,
    /// Provider [default: `RMACOMM_PROVIDER`, else auto].
    #[arg(long, value_enum)]
    pub provider: Option<ProviderArg>,
    /// Soft provider link.
    #[arg(long, value_enum, default_value_t = LinkArg::Auto)]
    pub link: LinkArg,
    /// Device name (`mlx5_0`, `soft0`); default: the first the provider
    /// lists.
    #[arg(short = 'd', long)]
    pub ib_dev: Option<String>,
    /// Both directions at once (bandwidth tests): the figures add up.
    #[arg(short = 'b', long)]
    pub bidirectional: bool,
    /// This side's buffer in CUDA device memory on this GPU (perftest's
    /// `--use_cuda`; with `--local` both sides). The transport tests only
    /// (write, read, write_lat, read_lat): on the soft provider the bytes
    /// are staged through pinned host chunks, on verbs the HCA reaches the
    /// GPU (DMA-BUF, else nvidia-peermem).
    #[arg(long, value_name = "GPU", alias = "use_cuda")]
    pub use_cuda: Option<u32>,
    /// Bandwidth in Gb/sec (10^9 bits) instead of MB/sec (perftest's
    /// `--report_gbits` too).
    #[arg(long, alias = "report_gbits")]
    pub report_gbits: bool,
    /// Busy-poll for completions for up to this many microseconds before
    /// sleeping (default: latency tests spin, bandwidth tests spin only
    /// where this thread copies the data itself).
    #[arg(long, value_name = "USEC")]
    pub busy_poll_us: Option<u64>,
    /// One JSON object per size on stdout instead of the table (the header
    /// goes to stderr).
    #[arg(long)]
    pub json: bool,
    /// Also write the JSON lines to this file.
    #[arg(long, value_name = "FILE")]
    pub out_json: Option<PathBuf>,
    /// Draw bandwidth/latency against size into this SVG.
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<PathBuf>,
}

/// An all-reduce algorithm hint (`rmacomm::algo`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum AlgoArg {
    /// Every rank sends its whole buffer to every rank and reduces all of
    /// them itself (the library's default up to 64 KiB).
    Oneshot,
    /// Reduce-scatter then all-gather, every pair at once (the default
    /// above 64 KiB).
    Direct,
    /// Reduce-scatter and all-gather around the ring.
    Ring,
}

impl AlgoArg {
    /// The hint's value.
    pub fn name(self) -> &'static str {
        match self {
            AlgoArg::Oneshot => "oneshot",
            AlgoArg::Direct => "direct",
            AlgoArg::Ring => "ring",
        }
    }
}

/// Where each rank process may run (Open MPI's `--bind-to`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BindArg {
    /// Anywhere this process may run (as torchrun and rmacomm-run start
    /// ranks).
    None,
    /// One core each: local rank r on the r-th CPU this process may run
    /// on (modulo their number), as Open MPI binds 2 ranks by default.
    Core,
}

/// Options of the collectives (nccl-tests' meanings where they have one).
///
/// The ranks are processes: under a launcher that sets torchrun's variables
/// (`rmacomm-run --nproc-per-node N`, `torchrun`, or `mpirun -x
/// MASTER_ADDR -x MASTER_PORT`) each process is one rank and rank 0
/// prints; otherwise `rdma_bench` starts `--nproc` rank processes of itself
/// on this host (default 2) and waits for them.
#[derive(Debug, Clone, Args)]
pub struct CollArgs {
    /// Start this many rank processes on this host (default 2 when no
    /// launcher's variables are set; given, it wins over them).
    #[arg(long, value_name = "N", alias = "np")]
    pub nproc: Option<usize>,
    /// Size in bytes (K, M, G suffixes): nccl-tests' size, the larger of a
    /// rank's input and output [default: 1M].
    #[arg(short = 's', long, value_parser = size_arg, conflicts_with = "all")]
    pub size: Option<u64>,
    /// Sweep sizes: powers of two from --min to --max (rounded down to
    /// whole elements per rank, as nccl-tests does).
    #[arg(short = 'a', long)]
    pub all: bool,
    /// Smallest size of a sweep.
    #[arg(long, value_parser = size_arg, default_value = "4")]
    pub min: u64,
    /// Largest size of a sweep.
    #[arg(long, value_parser = size_arg, default_value = "64M")]
    pub max: u64,
    /// Measured iterations per size (default: about 256 MiB per size,
    /// 20 ..= 1000).
    #[arg(short = 'n', long)]
    pub iters: Option<u64>,
    /// Iterations before measuring (default: a tenth of -n, 5 ..= 100).
    #[arg(short = 'w', long)]
    pub warmup: Option<u64>,
    /// Element type: f32, f64, f16, bf16, i8, u8, i32, i64 (torch names
    /// too).
    #[arg(long, value_parser = parse_dtype, default_value = "f32")]
    pub dtype: DType,
    /// Reduction (all_reduce, reduce_scatter): sum, prod, min, max, avg,
    /// band, bor, bxor, premul_sum:FACTOR [default: sum].
    #[arg(long, value_parser = parse_redop)]
    pub op: Option<ReduceOp>,
    /// all_reduce algorithm, passed as the hint rmacomm::algo [default:
    /// the library's choice].
    #[arg(long, value_enum)]
    pub algo: Option<AlgoArg>,
    /// Root rank (broadcast) [default: 0].
    #[arg(long)]
    pub root: Option<usize>,
    /// Check the result once per size (nccl-tests' -c): 1 = yes, 0 = no.
    #[arg(short = 'c', long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(0..=1))]
    pub check: u8,
    /// The communicator's pipelining chunk (CommOptions::slot_bytes)
    /// [default: the library's, 1 MiB].
    #[arg(long, value_parser = size_arg)]
    pub slot_bytes: Option<u64>,
    /// Provider [default: `RMACOMM_PROVIDER`, else auto].
    #[arg(long, value_enum)]
    pub provider: Option<ProviderArg>,
    /// Soft provider link (tcp: every pair SEPARATE through the transport).
    #[arg(long, value_enum, default_value_t = LinkArg::Auto)]
    pub link: LinkArg,
    /// Reach same-host peers through the transport too (the window's
    /// SEPARATE path; default: UNIFIED, mapped shared memory).
    #[arg(long)]
    pub separate: bool,
    /// Bind each rank process to one core (`core`) or not (`none`).
    #[arg(long, value_enum, default_value_t = BindArg::None)]
    pub bind_to: BindArg,
    /// One JSON object per size on stdout instead of the table (the header
    /// goes to stderr).
    #[arg(long)]
    pub json: bool,
    /// Also write the JSON lines to this file.
    #[arg(long, value_name = "FILE")]
    pub out_json: Option<PathBuf>,
    /// Draw time and bus bandwidth against size into this SVG.
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<PathBuf>,
}

/// Options of `rdma_bench kv`.
///
/// This process is prefill (the client); decode is the server: started as
/// a second process on this host by default (`--local`), or on another
/// host with `--server` there and `--client HOST` here.
#[derive(Debug, Clone, Args)]
pub struct KvArgs {
    /// Both ends on this host, in two processes (the default when no peer
    /// is given): this process spawns `rdma_bench kv --server` as decode.
    #[arg(long, conflicts_with_all = ["server", "client"])]
    pub local: bool,
    /// Be the decode side of a two-host run: print the port, serve one
    /// prefill, exit. Everything else comes from the client.
    #[arg(long, conflicts_with = "client")]
    pub server: bool,
    /// Be the prefill side of a two-host run: the decode side's
    /// `HOST[:PORT]`.
    #[arg(long, value_name = "HOST[:PORT]")]
    pub client: Option<String>,
    /// Bootstrap TCP port (server: where to listen, 0 = any; client: the
    /// default when HOST has none).
    #[arg(short = 'p', long, default_value_t = 18515)]
    pub port: u16,
    /// Blocks a request (N) [default: sweep 64, 256, 1024].
    #[arg(long, value_name = "N")]
    pub blocks: Option<u64>,
    /// Bytes a block (B; K, M suffixes) [default: sweep 4K, 16K, 256K, 1M;
    /// a sweep leaves out requests over 64 MiB].
    #[arg(long, value_name = "B", value_parser = size_arg)]
    pub block_size: Option<u64>,
    /// Slots 0 .. N in order (the agent coalesces the request into one
    /// operation) instead of shuffled slots that never touch.
    #[arg(long)]
    pub contiguous: bool,
    /// No notification: the time runs until the transfer completes at
    /// prefill.
    #[arg(long)]
    pub no_notify: bool,
    /// Prefill writes into decode's slots, or reads them (time: until the
    /// read completes at prefill; a notification still goes to decode).
    #[arg(long, value_enum, default_value_t = KvOp::Write)]
    pub op: KvOp,
    /// Measured requests a shape (default: about 1 GiB a shape, 20 ..= 500).
    #[arg(short = 'n', long)]
    pub iters: Option<u64>,
    /// Requests before measuring (default: a tenth of -n, 2 ..= 50).
    #[arg(long)]
    pub warmup: Option<u64>,
    /// Check every request's bytes at the destination and that no other
    /// slot changed (default: the last request's only).
    #[arg(long)]
    pub check: bool,
    /// Physical QPs per connection.
    #[arg(short = 'q', long, default_value_t = 1)]
    pub qps: u32,
    /// Load balancing over several QPs.
    #[arg(long, value_enum, default_value_t = LbArg::Dqplb)]
    pub lb: LbArg,
    /// Fragment size: longer operations are cut into pieces of this size.
    #[arg(long, value_parser = size_arg, default_value = "1M")]
    pub frag_size: u64,
    /// Provider [default: `RMACOMM_PROVIDER`, else auto].
    #[arg(long, value_enum)]
    pub provider: Option<ProviderArg>,
    /// Soft provider link.
    #[arg(long, value_enum, default_value_t = LinkArg::Auto)]
    pub link: LinkArg,
    /// Device name (`mlx5_0`, `soft0`); default: the first the provider
    /// lists.
    #[arg(short = 'd', long)]
    pub ib_dev: Option<String>,
    /// Busy-poll for completions for up to this many microseconds before
    /// sleeping [default: 0].
    #[arg(long, value_name = "USEC")]
    pub busy_poll_us: Option<u64>,
    /// One JSON object per shape on stdout instead of the table (the header
    /// goes to stderr).
    #[arg(long)]
    pub json: bool,
    /// Also write the JSON lines to this file.
    #[arg(long, value_name = "FILE")]
    pub out_json: Option<PathBuf>,
}
