//! rmacomm transfer agent: moves lists of KV-cache blocks between processes
//! as single requests, each followed by one notification, the way NIXL's
//! agent and Mooncake's Transfer Engine do — one agent per process, many
//! peers, memory registered once.
//!
//! # Quick start
//! ```
//! use futures::StreamExt;
//! use rmacomm_agent::{AgentConfig, Op, RemoteBlock, TransferAgent};
//!
//! # #[tokio::main(flavor = "multi_thread", worker_threads = 2)]
//! # async fn main() -> Result<(), rmacomm_agent::AgentError> {
//! // Two agents in one process here; normally one per process, the
//! // metadata travelling through a Store or your own control plane.
//! let decode = TransferAgent::new("decode", AgentConfig::default())?;
//! let prefill = TransferAgent::new("prefill", AgentConfig::default())?;
//!
//! let cache = decode.alloc(64 << 10)?;           // decode's KV cache: 16 blocks of 4 KiB
//! let region = decode.register(&cache)?;         // once; usable toward every peer
//! let kv = prefill.alloc(8 << 10)?;              // two computed blocks
//! prefill.register(&kv)?;
//! kv.write_from(0, &[7u8; 8192]).unwrap();
//!
//! prefill.add_peer(&decode.metadata())?;         // connects on the first transfer
//! // Block 0 into slot 5, block 1 into slot 2, then one notification.
//! let pieces = [
//!     (kv.view(0, 4096).unwrap(), RemoteBlock::new(region, 5 * 4096, 4096)),
//!     (kv.view(4096, 4096).unwrap(), RemoteBlock::new(region, 2 * 4096, 4096)),
//! ];
//! prefill.transfer(Op::Write, "decode", &pieces, Some(b"req-17"))?.await?;
//!
//! let n = decode.notifications().next().await.unwrap();
//! assert_eq!((n.peer.as_str(), &n.message[..]), ("prefill", &b"req-17"[..]));
//! let mut slot = [0u8; 4096];
//! cache.read_into(5 * 4096, &mut slot).unwrap();
//! assert_eq!(slot, [7u8; 4096]);
//! # Ok(()) }
//! ```
//!
//! # Features
//! - [`TransferAgent::metadata`]: a printable string (name, handshake
//!   listener addresses, registered regions, an unguessable token);
//!   [`add_peer`](TransferAgent::add_peer) / [`remove_peer`](TransferAgent::remove_peer);
//!   [`publish_metadata`] / [`fetch_metadata`] through a
//!   [`Store`](rmacomm_window::Store).
//! - Lazy connections, one [`RdmaTransport`](rmacomm_transport::RdmaTransport)
//!   (one virtual QP) per peer, made by whichever side transfers first;
//!   same-host peers over shared memory on the soft provider.
//! - [`transfer`](TransferAgent::transfer): `Op::Write` or `Op::Read` of
//!   `(local slice, remote block)` pieces as one unit, every piece checked
//!   before anything moves, adjacent pieces coalesced, the rest posted
//!   together; a [`Transfer`] future with a non-blocking
//!   [`status`](Transfer::status).
//! - One notification per request (up to [`MAX_MESSAGE`] bytes), delivered
//!   exactly once after all of its pieces are placed, in completion order
//!   per peer: [`notifications`](TransferAgent::notifications) (a stream)
//!   and [`try_notifications`](TransferAgent::try_notifications).
//! - Errors that name the peer ([`AgentError`]), [`AgentStats`] counters.
//!
//! # How a notification travels
//! Each connection has a ring of [`AgentConfig::notification_slots`] slots
//! in each side's registered memory. Once a transfer sees all of its pieces
//! complete (a completion means the data is placed), the connection's
//! notifier writes header + message into the next slot of the peer's ring
//! as one notifying write, and waits for it to complete before writing the
//! next: so the peer counts them in order, and the k-th count means slot
//! k is whole. The peer's drainer copies the message out, queues it, and
//! bumps the ring's `consumed` word, which the sender reads (an 8-byte
//! RDMA READ) before reusing a slot. The cost: a request with a
//! notification completes one notifying write later than its pieces, and
//! notifications to one peer go one at a time.
//!
//! # Thread safety
//! `TransferAgent` is `Send + Sync` (share it with an `Arc`); [`Transfer`]
//! and [`Notifications`] are `Send`. A `Transfer` borrows the local memory
//! of its pieces; to keep one in a table, `tokio::spawn` an async block
//! that owns that memory (an `Arc<RdmaMemory>`) and awaits it.
//!
//! # Resource cleanup
//! Dropping a [`Transfer`] cancels nothing posted (see its docs).
//! [`remove_peer`](TransferAgent::remove_peer) and dropping the agent close
//! the connections: transfers in flight on them end with
//! [`AgentError::PeerRemoved`], and the peers' with [`AgentError::PeerLost`].
//! Dropping the agent stops its listener and ends the notification streams
//! once they are empty. The agent does not own registered memory; a
//! transport keeps memory that operations in flight use registered until
//! they complete.
//!
//! # Organization
//! `agent` (the agent's public surface), `shared` (its state: regions and
//! the peer table), `dial` (making a connection from this side),
//! `listener` (answering peers' handshakes),
//! `transfer` (the request future), `plan` (checks and coalescing,
//! sans-IO), `connection` (a peer's transport, notifier and drainer),
//! `ring` (the notification ring's layout and credit, sans-IO), `handshake`
//! (its messages and the crossing tie-break), `metadata`, `notifications`,
//! `block`, `config`, `stats`, `store`, `error`.

#![forbid(unsafe_code)]

mod agent;
mod block;
mod config;
mod connection;
mod dial;
mod error;
mod handshake;
mod listener;
mod metadata;
mod notifications;
mod plan;
mod ring;
mod shared;
mod stats;
mod store;
mod transfer;

pub use agent::TransferAgent;
pub use block::{LocalBlock, LocalMem, Op, OwnedBlock, RemoteBlock};
pub use config::{AgentConfig, DEFAULT_NOTIFICATION_SLOTS};
pub use error::AgentError;
pub use metadata::{PeerRegion, MAX_NAME_LEN, MAX_REGIONS};
pub use notifications::{Notification, Notifications};
pub use ring::MAX_MESSAGE;
pub use stats::AgentStats;
pub use store::{fetch_metadata, metadata_key, publish_metadata};
pub use transfer::{Transfer, TransferStatus};
