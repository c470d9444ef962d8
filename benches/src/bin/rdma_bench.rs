//! `rdma_bench`: perftest-style bandwidth and latency of rmacomm's transport
//! and raw virtual QP. See the `rmacomm_bench` crate docs.

#![forbid(unsafe_code)]

use clap::Parser;

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("RMACOMM_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("error")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = rmacomm_bench::Cli::parse();
    std::process::exit(rmacomm_bench::main_with(cli));
}
