//! rmacomm benchmarks.
//!
//! This package will hold the `rdma_bench` binary (perftest-style bandwidth and latency tables, JSON, plots, peer comparison) and criterion micro-benchmarks. Until then the soft-provider bandwidth tool is `ibverbx`'s `soft_bw` example.

#![forbid(unsafe_code)]
