//! rmacomm transport: async, zero-copy RDMA writes and reads with
//! notification, for Rust services that move KV-cache blocks or parameters
//! between processes and hosts.
//!
//! One [`RdmaTransport`] connects to one peer over one virtual QP (several
//! physical QPs, DQPLB or spray striping) on the verbs provider where an HCA
//! exists and on the soft provider (shared memory / TCP) elsewhere. To a
//! peer on the same host, small writes and reads are copied by the calling
//! thread through a cached, key-checked mapping of the peer's memory, and
//! notifications are counted in a page the peer polls (see
//! [`TransportConfig::direct_copy_max`] and
//! [`RdmaTransport::cached_mapping`]).
//!
//! # Quick start
//! ```
//! use rmacomm_transport::{RdmaMemory, RdmaTransport, TransportConfig};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), rmacomm_transport::TransportError> {
//! // Two transports in one process here; normally one per process, the
//! // URLs travelling through your own channel (HTTP, a KV store, ...).
//! let a = RdmaTransport::new(TransportConfig::default())?;
//! let b = RdmaTransport::new(TransportConfig::default())?;
//! let (ua, ub) = (a.bind()?, b.bind()?);
//! let (ra, rb) = tokio::join!(a.connect(&ub), b.connect(&ua));
//! ra?;
//! rb?;
//!
//! let src = RdmaMemory::alloc(4096)?;
//! let dst = RdmaMemory::alloc(4096)?;
//! src.write_from(0, b"kv block")?;
//! let remote = dst.remote_buffer(); // serde: send it to the writer
//! a.write(src.view(0, 8)?, &remote, true).await?;
//! b.wait_for_write().await?;
//! let mut got = [0u8; 8];
//! dst.read_into(0, &mut got)?;
//! assert_eq!(&got, b"kv block");
//! # Ok(()) }
//! ```
//!
//! # Features
//! - `bind` / `connect` with printable URLs carrying unguessable tokens.
//!   A URL is a credential: log it through [`redact_url`]; `Debug` output
//!   and errors never contain one. One `connect` per transport.
//! - `write` (optionally notifying), `read`, `wait_for_write` (a counting
//!   semaphore), per-call timeouts.
//! - [`RdmaMemory`]: allocation in shared memory, registration of owned
//!   buffers (`Vec<u8>`, `BytesMut`, …) and of raw memory; bounds-checked
//!   views.
//! - GPU memory: [`RdmaMemory::alloc_cuda`] / [`RdmaMemory::register_cuda`]
//!   (the CUDA driver loaded at run time). The soft provider stages it
//!   through pinned host chunks, and same-host peers copy into it device to
//!   device through CUDA IPC; a verbs HCA reaches it through DMA-BUF (else
//!   nvidia-peermem). See `docs/gpu.md`.
//!
//! # Thread safety
//! `RdmaTransport` is `Send + Sync`; share it with an `Arc`. Futures are
//! `Send` and run on multi-threaded runtimes.
//!
//! # Resource cleanup
//! Dropping the transport resolves its pending futures with
//! [`TransportError::Aborted`]; memory named by operations still in flight
//! stays alive until the provider has finished with it. Dropping a write or
//! read future (a cancellation, a timeout) leaves the operation running: it
//! keeps its memory's registration, and one of the transport's
//! `max_in_flight` slots, until it completes. Dropping an [`RdmaMemory`]
//! revokes its key at once when no operation of this process uses it, else
//! when the last one completes.
//! A device (on the soft provider: a context with one progress thread) is
//! shared by the transports and memory that use it and closes with the last
//! of them.
//!
//! # Organization
//! `transport` (the connection and its completion driver), `direct` and
//! `notes` (same-host copies and notifications), `memory`
//! (registrations and views), `cuda` (CUDA memory, its staging and IPC), `remote` (peers' buffers), `url`, `config`,
//! `error`, `domain` (devices shared by every transport in the process).

#![deny(unsafe_op_in_unsafe_fn)]

mod config;
mod cuda;
mod direct;
mod domain;
mod error;
mod mapped;
mod memory;
mod notes;
mod remote;
mod transport;
mod url;

pub use config::{TransportConfig, DEFAULT_ACK_TIMEOUT};
pub use error::TransportError;
pub use mapped::MappedBuffer;
pub use memory::{RdmaMemory, View, ViewMut};
pub use remote::RdmaRemoteBuffer;
pub use transport::RdmaTransport;
pub use url::redact_url;
