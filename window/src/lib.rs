//! rmacomm window: groups, bootstrap stores and the one-sided [`Window`].
//!
//! The bootstrap part gets the ranks of a job to know each other: a
//! [`Store`] they all reach, launcher detection, and a [`Group`] with rank,
//! size, host locality, `barrier`, `exchange` (all-gather of small blobs) and
//! `split`. The [`Window`] is built on it: torchcomms' one-sided window
//! (`put`, `signal`, `wait_signal`, `get`, `tensor_register`), over one
//! transport per peer. [`nccl_rma::NcclRma`] gives the same signal rule
//! over NCCL 2.29+'s own one-sided calls, on device memory.
//!
//! # Quick start: a window
//!
//! The ring of torchcomms' window test, under `rmacomm-run --nproc-per-node 4`:
//!
//! ```no_run
//! use rmacomm_window::{Group, Window, WindowOptions};
//!
//! # fn main() -> Result<(), rmacomm_window::Error> {
//! let group = Group::from_env()?;
//! let (rank, size) = (group.rank(), group.size());
//! let (right, left) = ((rank + 1) % size, (rank + size - 1) % size);
//! let mut win = Window::new(&group, WindowOptions::new())?;      // collective
//! const COUNT: usize = 1024;
//! win.tensor_register(win.alloc(size * COUNT * 4)?, 4)?;          // collective; f32 elements
//! let src = win.alloc(COUNT * 4)?;
//! src.write_from(0, &(rank as f32).to_le_bytes().repeat(COUNT)).unwrap();
//! let put = win.put(src.view(0, COUNT * 4).unwrap(), right, rank * COUNT, true)?; // async
//! win.signal(right, false)?;          // delivered after the put's data is placed
//! win.wait_signal(left, None)?;       // left's data is in my buffer now
//! let mut got = vec![0u8; COUNT * 4];
//! win.local_tensor().unwrap().read_into(left * COUNT * 4, &mut got).unwrap();
//! put.wait(None)?;
//! drop(put);
//! group.barrier(None)?;
//! let _mem = win.tensor_deregister()?;                           // collective
//! # Ok(()) }
//! ```
//!
//! # Quick start: a group
//!
//! Under `rmacomm-run --nproc-per-node 4 ./prog`, torchrun, mpirun or srun:
//!
//! ```no_run
//! use rmacomm_window::Group;
//!
//! # fn main() -> Result<(), rmacomm_window::Error> {
//! let group = Group::from_env()?;                       // rank 0 hosts the TcpStore
//! let urls = group.exchange("urls", b"my transport url")?; // urls[r] from rank r
//! assert_eq!(urls.len(), group.size());
//! group.barrier(None)?;                                  // group timeout
//! if let Some(evens) = group.split(&(0..group.size()).step_by(2).collect::<Vec<_>>())? {
//!     evens.barrier(None)?;
//! }
//! # Ok(()) }
//! ```
//!
//! With an explicit store, e.g. ranks that are threads of one process:
//!
//! ```
//! use std::sync::Arc;
//! use rmacomm_window::{Group, HashStore, Store};
//!
//! let store: Arc<dyn Store> = Arc::new(HashStore::new());
//! let handles: Vec<_> = (0..3)
//!     .map(|rank| {
//!         let store = store.clone();
//!         std::thread::spawn(move || {
//!             let g = Group::new(rank, 3, store).unwrap();
//!             g.exchange("who", &[rank as u8]).unwrap()
//!         })
//!     })
//!     .collect();
//! for h in handles {
//!     assert_eq!(h.join().unwrap(), vec![vec![0], vec![1], vec![2]]);
//! }
//! ```
//!
//! # Features
//!
//! - [`Store`]: set / try_get / multi_get (waits) / wait / check / add /
//!   compare_set / delete, blocking with explicit timeouts. Implementations:
//!   [`TcpStore`] (hosted by rank 0 like torch's `TCPStore`, or by a standalone
//!   [`TcpStoreServer`]), [`FileStore`] (a shared directory), [`HashStore`] (in
//!   process) and [`PrefixStore`] (a key space inside another store).
//! - [`LaunchEnv::detect`]: torchrun / rmacomm-run (`RANK`, `WORLD_SIZE`,
//!   `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`), Open MPI
//!   (`OMPI_COMM_WORLD_*` plus `MASTER_ADDR`/`MASTER_PORT`) and Slurm
//!   (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`, the store on the first
//!   host of the node list unless `MASTER_ADDR` says otherwise). A missing or
//!   contradictory variable is an error naming it.
//! - [`Group`]: `rank`, `size`, `local_rank`, `local_size`, `same_host`
//!   (boot id + IPC and network namespaces, as DESIGN.md defines a host),
//!   `barrier`, `exchange`, `split`.
//! - Timeouts: `RMACOMM_TIMEOUT_SECONDS` (default 600) unless code sets one
//!   ([`GroupOptions::timeout`]).
//! - The `rmacomm-run` binary: a one-host launcher with torchrun's variables.
//! - [`Window`] (torchcomms' semantics): `new`, `tensor_register` /
//!   `tensor_deregister` (collective; sizes and element sizes may differ per
//!   rank), `put` (bounds-checked against the peer's registered size before
//!   anything moves), `put_bytes` (unregistered memory), `signal` /
//!   `wait_signal` (the n-th signal from s satisfies the n-th wait on d,
//!   delivered after every earlier put from s to d is placed; early signals
//!   are banked), `get`, `get_attr`, `map_remote_tensor` (a [`MappedTensor`]
//!   aliasing a same-host peer's buffer), and [`Work`] (`is_completed`,
//!   `wait`). The ctran form: [`Window::allocate`], value signals
//!   ([`SignalOp`] SET / ADD), `wait_signal_until` ([`Cmp`]), `get_tensor`,
//!   `get_size`, `get_device`.
//! - Two data paths: same-host peers are UNIFIED (their buffers and signal
//!   slots mapped here: a put is a copy by the calling thread, a signal an
//!   atomic, a wait spins then sleeps on a futex), other hosts SEPARATE
//!   (RDMA WRITE / READ and notifications on the transport).
//!
//! Why blocking: bootstrap runs a few times per job, mostly from code that is
//! not async (a `main`, Python with the GIL released, a test), and every call
//! waits on *other processes*; a blocking call with a timeout is the simplest
//! thing that is right there. From async code use `spawn_blocking`.
//!
//! # Thread safety
//!
//! Stores, groups and windows are `Send + Sync`. A window's operations may
//! be issued from several threads; its blocking calls (`wait_signal`,
//! `Work::wait`, synchronous operations) must not run inside a tokio
//! runtime (the window has its own; use `spawn_blocking`). A `TcpStore`
//! client runs one request at a time on its connection (others queue on a
//! mutex), so a long wait
//! delays other calls through the same store. Group operations are
//! collective and numbered in call order: issue them from one thread per rank
//! (or otherwise in the same order on every rank).
//!
//! # Resource cleanup
//!
//! A hosting `TcpStore` (rank 0's), when dropped, keeps serving until the
//! other ranks have connected and hung up, for at most 30 s
//! ([`TcpStore::set_linger`]), so that rank 0 finishing first does not cut
//! the replies the others wait for; then it stops its threads and closes
//! every connection. Group keys are deleted by the rank that wrote them after
//! the next barrier. A `FileStore` directory is left in place: give each job
//! its own.
//!
//! A [`Work`] borrows its window and local memory; dropping it unfinished
//! detaches the operation, which goes on holding its memory's registration.
//! `tensor_deregister` waits for this rank's operations in flight, detached
//! ones included, then for every rank, and hands the memory back. Dropping a
//! window drops its transports (peers' later operations to this rank fail
//! with "the peer closed the connection") and then its runtime.

// Unsafe code only in `window/device.rs` (raw device addresses: CUDA
// IPC, stream value writes and waits); everything else is safe Rust.
#![deny(unsafe_code)]
#![deny(unsafe_op_in_unsafe_fn)]

mod error;
mod file_store;
mod group;
mod hash_store;
mod host_id;
mod launch_env;
pub mod nccl_rma;
mod nodelist;
mod prefix_store;
mod store;
mod tcp_server;
mod tcp_store;
mod unified;
mod window;
mod wire;
mod work;

pub use error::{Error, Result};
pub use file_store::FileStore;
pub use group::{Group, GroupOptions, MAX_GROUP_SIZE};
pub use hash_store::HashStore;
pub use host_id::host_id;
pub use launch_env::{default_timeout, timeout_from, LaunchEnv, Launcher, DEFAULT_TIMEOUT};
pub use nodelist::first_host;
pub use prefix_store::PrefixStore;
pub use store::{Store, MAX_KEYS, MAX_KEYS_BYTES, MAX_KEY_LEN, MAX_VALUE_LEN};
pub use tcp_server::{TcpStoreServer, MAX_CLIENTS};
pub use tcp_store::TcpStore;
pub use window::{
    stream_proxy_blocks, AccessType, Cmp, MappedTensor, MissingFn, PeerWatch, ProgressFn, SignalOp, Stall, Stalled,
    StreamRelease, StreamWatch, Window, WindowAttr, WindowOptions, BOUNCE_CHUNK, DEFAULT_SPIN, KERNEL_WAIT,
};
pub use work::Work;

/// The CUDA driver, loaded at run time (device memory, streams) for
/// windows on device memory: `rmacomm_cuda`, re-exported.
pub use rmacomm_cuda as cuda;
