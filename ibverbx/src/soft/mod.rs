//! The soft provider: reliable-connected verbs in user space.
//!
//! Same host (same boot id, IPC and network namespace): the requester
//! copies directly into or out of the peer's memory, through a mapping of
//! the peer's shared segment (memory from [`ShmBuffer`](crate::ShmBuffer) /
//! [`MemoryRegion::alloc`](crate::MemoryRegion::alloc)), else with
//! `process_vm_writev`/`readv`, else through the connection (staged: the
//! peer's progress engine places the bytes). Control messages (immediate
//! data, SEND payloads, acknowledgements) use an abstract unix socket, except
//! that an idle QP's WRITE_WITH_IMM notification goes through the target
//! QP's doorbell in shared memory, picked up by the target's CQ poll
//! (`RMACOMM_SOFT_DOORBELL=0` turns that off; [`stats`] counts it).
//!
//! Other hosts: one TCP connection per QP direction; the payload is written
//! from the registered memory and read straight into the target's.
//!
//! # Organization
//! - `address`: the soft part of a QP's endpoint (`SoftAddress`, `HostId`)
//! - `wire`: frame format and validation (sans-IO)
//! - `keytable`: the shared table of a context's regions
//! - `context`: progress engine, listeners, PDs, registration
//! - `qp/`: the QP (state, its verbs, the posting thread's fast path, the
//!   receiving side of its doorbell); `requester/` (connection, in-flight
//!   WRs, execution, responses, watchdog, the requesting side of the
//!   doorbell) / `responder`: the engine tasks; `peer`: direct access to a
//!   same-host peer
//! - `doorbell`: same-host WRITE_WITH_IMM notifications through shared
//!   memory (the slot table; `doorbell_proto`: the protocol on one slot);
//!   `copy`: direct copies, streaming for long runs
//! - `cq`, `mr`: completion queues and regions
//! - `raw_io`: payloads between sockets and registered memory through raw
//!   pointers (a region peers write is never a Rust slice)

/// The atomics the doorbell protocol uses (loom's, in its model tests).
mod atomics {
    pub(crate) use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
}
mod address;
mod attach;
mod config;
mod context;
mod copy;
mod cq;
mod device_io;
mod doorbell;
mod doorbell_proto;
mod fence;
mod host;
mod ifname;
pub(crate) mod inline_budget;
mod keytable;
mod mr;
mod peer;
mod polled_rx;
mod qp;
mod raw_io;
pub(crate) mod remote;
mod requester;
mod responder;
pub mod wire;

use std::sync::{Arc, Mutex};

pub use address::{HostId, SoftAddress};
pub use config::{SoftConfig, SoftLink};

/// Counters of a soft context (diagnostics; they only grow).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct SoftStats {
    /// Doorbell records (same-host WRITE_WITH_IMM notifications) this
    /// context's QPs claimed as receivers.
    pub doorbell_claimed: u64,
    /// Doorbell records of this context's QPs that nobody claimed in time
    /// (or that a later WR overtook) and went through the connection.
    pub doorbell_retracted: u64,
    /// Sleeping peers this context woke by ringing their CQ event fd.
    pub doorbell_rings: u64,
    /// Same-host peers' shared segments this context mapped (each obtained
    /// over the peer's attach socket, `SCM_RIGHTS`).
    pub peer_segments_mapped: u64,
    /// Mappings of peer segments dropped because the peer no longer
    /// publishes a region in them.
    pub peer_segments_unmapped: u64,
    /// Bytes of same-host WRITEs and READs copied by the posting threads
    /// themselves (not the progress thread).
    pub inline_copied_bytes: u64,
    /// Request frames (WRITE, notify, SEND, READ, atomic) that posting
    /// threads wrote on their QPs' connections themselves: small requests
    /// on an idle QP, and over tcp behind a few outstanding ones.
    pub requests_by_posters: u64,
    /// Request frames the progress engine's threads wrote.
    pub requests_by_engine: u64,
    /// Attach requests this context refused (unknown QP, wrong token,
    /// malformed request, another user).
    pub attach_refused: u64,
    /// Unauthenticated connections (no hello yet) this context closed to
    /// stay under its cap of pending handshakes.
    pub handshakes_evicted: u64,
    /// Bytes this context's QPs copied into and out of same-host peers'
    /// device memory themselves (opened through the peer's IPC export),
    /// not through the connection.
    pub peer_device_bytes: u64,
    /// Device-to-device copies with same-host peers' device memory this
    /// context's QPs made (a run of WRs whose copies continue each other,
    /// such as a fragmented message, is one copy).
    pub device_copies: u64,
    /// Waits for those copies: one per run of consecutive such WRs on a
    /// QP (and one per device segment of a WR copied alone).
    pub device_copy_waits: u64,
}

/// The counters of `ctx`, or `None` when it is not a soft-provider context.
pub fn stats(ctx: &crate::Context) -> Option<SoftStats> {
    use std::sync::atomic::Ordering::Relaxed;
    let c = ctx.ops().as_any().downcast_ref::<context::SoftContext>()?;
    let s = &c.shared;
    Some(SoftStats {
        doorbell_claimed: s.db_claimed.load(Relaxed),
        doorbell_retracted: s.db_retracted.load(Relaxed),
        doorbell_rings: s.db_rings.load(Relaxed),
        peer_segments_mapped: s.segs_mapped.load(Relaxed),
        peer_segments_unmapped: s.segs_unmapped.load(Relaxed),
        inline_copied_bytes: s.inline_copied.load(Relaxed),
        requests_by_posters: s.poster_frames.load(Relaxed),
        requests_by_engine: s.engine_frames.load(Relaxed),
        attach_refused: s.attach_refused.load(Relaxed),
        handshakes_evicted: s.handshakes_evicted.load(Relaxed),
        peer_device_bytes: s.peer_device_bytes.load(Relaxed),
        device_copies: s.device_copies.load(Relaxed),
        device_copy_waits: s.device_copy_waits.load(Relaxed),
    })
}

use crate::device::DeviceInfo;
use crate::provider::{ContextOps, Provider};
use crate::{Error, Result};

/// The soft provider: one device, `soft0`.
#[derive(Debug)]
pub struct SoftProvider {
    config: Mutex<SoftConfig>,
}

impl SoftProvider {
    /// A provider whose contexts use `config`.
    pub fn new(config: SoftConfig) -> Arc<SoftProvider> {
        Arc::new(SoftProvider { config: Mutex::new(config) })
    }

    /// A provider configured from the environment (`RMACOMM_SOFT_*`).
    pub fn from_env() -> Arc<SoftProvider> {
        Self::new(SoftConfig::from_env())
    }

    /// The provider's device (`soft0`), ready to open.
    pub fn device(self: &Arc<Self>) -> crate::Device {
        let provider: Arc<dyn Provider> = self.clone();
        let info = self.devices().expect("soft always lists soft0").remove(0);
        crate::Device { info, provider }
    }
}

impl Provider for SoftProvider {
    fn name(&self) -> &'static str {
        "soft"
    }

    fn devices(&self) -> Result<Vec<DeviceInfo>> {
        Ok(vec![DeviceInfo { name: "soft0".into(), provider: "soft", guid: 0, numa_node: None, pci_addr: None }])
    }

    fn open_device(&self, device: &DeviceInfo) -> Result<Arc<dyn ContextOps>> {
        if device.name != "soft0" {
            return Err(Error::invalid("open_device", format!("the soft provider has no device {:?}", device.name)));
        }
        let cfg = self.config.lock().unwrap_or_else(|e| e.into_inner()).clone();
        Ok(Arc::new(context::SoftContext { shared: context::CtxShared::open(cfg)? }))
    }
}
