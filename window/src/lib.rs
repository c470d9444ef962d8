//! rmacomm window: groups, bootstrap stores and the one-sided Window.
//!
//! It will hold the `Store` trait with `TcpStore`/`FileStore`, launcher environment detection (torchrun, Open MPI, Slurm), `Group` and the `Window` (put / signal / wait_signal / get / map_remote_tensor) with torchcomms' semantics, built on the transport crate. Nothing is implemented yet.

#![forbid(unsafe_code)]
