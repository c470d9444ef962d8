//! rmacomm transport: async zero-copy RDMA write/read with notify for Rust services.
//!
//! It will hold `RdmaTransport` (bind / connect / write / read / wait_for_write as tokio futures on one `ibverbx::VirtualQp` per peer), `RdmaMemory` (RAII registration with bounds-checked views) and the serde-serialisable `RdmaRemoteBuffer`. Nothing is implemented yet: see the transport issue.

#![forbid(unsafe_code)]
