//! The provider seam: the traits a verbs implementation fills in.
//!
//! The safe types ([`Context`](crate::Context), [`ProtectionDomain`](crate::ProtectionDomain),
//! …) wrap these trait objects and keep parents alive; a provider only
//! implements the verbs. The traits map one-to-one onto libibverbs calls so
//! that the hardware provider is a thin FFI layer.
//!
//! Contract every provider keeps:
//! - `post_send`/`post_recv` keep every memory region named by a posted WR
//!   alive (its memory included, when the region owns it) until the WR's
//!   completion is generated or the WR is flushed, so that dropping a
//!   `MemoryRegion` handle while a WR still uses it frees nothing;
//! - a completion is never silently lost: CQ overflow is reported by `poll`;
//! - no call panics on bad input from a peer.

use std::any::Any;
use std::fmt::Debug;
use std::os::fd::{BorrowedFd, RawFd};
use std::sync::Arc;

use crate::access::AccessFlags;
use crate::device::{DeviceAttr, DeviceInfo, Gid, PortAttr};
use crate::endpoint::QpEndpoint;
use crate::qp_attr::{QpCaps, QpInitAttr, QpState, QpTransition};
use crate::wc::WorkCompletion;
use crate::wr::{RecvWr, SendWr};
use crate::{Error, Result};

/// Where the bytes of a memory region travel when a same-host peer targets it.
///
/// The variants name provider-specific mechanisms: a region of the verbs
/// provider is always [`Hardware`](Placement::Hardware); the soft provider
/// reports [`SharedSegment`](Placement::SharedSegment) or
/// [`ProcessVm`](Placement::ProcessVm), and its peers may still fall back to
/// [`Staged`](Placement::Staged). Kept in this generic module because
/// [`MrOps::placement`] and [`MemoryRegion::placement`](crate::MemoryRegion::placement)
/// return it and applications match on it (renaming or moving the variants
/// would break them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Placement {
    /// The region lies in a shared segment: peers on this host map it and
    /// copy directly (one memcpy, no CPU of this process involved).
    SharedSegment,
    /// Peers on this host copy with `process_vm_writev`/`readv` when the
    /// kernel lets them, else it falls back to `Staged`.
    ProcessVm,
    /// The bytes go through the connection and this process's progress
    /// engine places them.
    Staged,
    /// A hardware HCA places the bytes (verbs provider).
    Hardware,
}

/// A verbs implementation.
pub trait Provider: Send + Sync + Debug {
    /// Short name: `"verbs"` or `"soft"`.
    fn name(&self) -> &'static str;
    /// Lists the devices (`ibv_get_device_list`). A machine without RDMA
    /// support has zero devices; that is not an error.
    fn devices(&self) -> Result<Vec<DeviceInfo>>;
    /// Opens a device this provider listed.
    fn open_device(&self, device: &DeviceInfo) -> Result<Arc<dyn ContextOps>>;
}

/// An open device (`struct ibv_context`).
pub trait ContextOps: Send + Sync + Debug {
    /// `ibv_query_device`.
    fn query_device(&self) -> Result<DeviceAttr>;
    /// `ibv_query_port`.
    fn query_port(&self, port: u8) -> Result<PortAttr>;
    /// `ibv_query_gid`.
    fn query_gid(&self, port: u8, index: u32) -> Result<Gid>;
    /// `ibv_alloc_pd`.
    fn alloc_pd(&self) -> Result<Arc<dyn PdOps>>;
    /// `ibv_create_cq` with its own completion channel.
    fn create_cq(&self, cqe: usize) -> Result<Arc<dyn CqOps>>;
    /// For downcasting to the provider's own type.
    fn as_any(&self) -> &dyn Any;
}

/// A protection domain (`struct ibv_pd`).
pub trait PdOps: Send + Sync + Debug {
    /// `ibv_reg_mr`.
    ///
    /// # Safety
    /// `addr..addr+len` must stay valid (allocated, not unmapped) until the
    /// returned region is deregistered and every WR naming it has completed.
    /// `owner`, when given, is kept alive exactly that long, which is how
    /// safe wrappers meet this requirement for memory they own.
    unsafe fn reg_mr(
        &self,
        addr: *mut u8,
        len: usize,
        access: AccessFlags,
        owner: Option<Arc<dyn Any + Send + Sync>>,
    ) -> Result<Arc<dyn MrOps>>;
    /// `ibv_reg_dmabuf_mr`: registers `len` bytes at `offset` of a DMA-BUF
    /// (GPU memory exported by its driver), addressed by peers and SGEs as
    /// `iova..iova+len`. The default refuses it: only a provider whose
    /// hardware can reach device memory implements it.
    ///
    /// # Safety
    /// The DMA-BUF's memory must stay allocated until the returned region is
    /// deregistered and every WR naming it has completed.
    unsafe fn reg_dmabuf(
        &self,
        fd: BorrowedFd<'_>,
        offset: u64,
        len: usize,
        iova: u64,
        access: AccessFlags,
    ) -> Result<Arc<dyn MrOps>> {
        let _ = (fd, offset, len, iova, access);
        Err(Error::invalid(
            "reg_dmabuf_mr",
            "this PD's provider cannot register a DMA-BUF; use a PD of the verbs provider",
        ))
    }
    /// Registers `len` bytes of device memory at `addr` (an address of
    /// `dev`'s, which the host cannot load or store). The default refuses
    /// it, naming the memory.
    ///
    /// # Safety
    /// As for [`reg_mr`](Self::reg_mr): the device range must stay allocated
    /// until the region is deregistered and every WR naming it has
    /// completed (`owner`, when given, is kept alive that long).
    unsafe fn reg_device_mr(
        &self,
        dev: Arc<dyn crate::DeviceMemory>,
        addr: u64,
        len: usize,
        access: AccessFlags,
        owner: Option<Arc<dyn Any + Send + Sync>>,
    ) -> Result<Arc<dyn MrOps>> {
        let _ = (addr, len, access, owner);
        Err(Error::invalid("reg_mr", format!("this PD's provider cannot register device memory ({})", dev.describe())))
    }
    /// `ibv_create_qp` for an RC QP.
    fn create_qp(
        &self,
        attr: &QpInitAttr,
        send_cq: &Arc<dyn CqOps>,
        recv_cq: &Arc<dyn CqOps>,
    ) -> Result<Arc<dyn QpOps>>;
    /// For downcasting to the provider's own type.
    fn as_any(&self) -> &dyn Any;
}

/// A memory region (`struct ibv_mr`). Deregistered by `deregister` or on drop.
pub trait MrOps: Send + Sync + Debug {
    /// Start address.
    fn addr(&self) -> u64;
    /// Length in bytes.
    fn len(&self) -> usize;
    /// True for a zero-length region.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Local key.
    fn lkey(&self) -> u32;
    /// Remote key.
    fn rkey(&self) -> u32;
    /// Access flags it was registered with.
    fn access(&self) -> AccessFlags;
    /// How same-host peers reach it.
    fn placement(&self) -> Placement;
    /// `ibv_dereg_mr`: the keys stop working at once. Idempotent.
    fn deregister(&self) -> Result<()>;
    /// The device memory the region lies in (`None`: host memory).
    fn device(&self) -> Option<&Arc<dyn crate::DeviceMemory>> {
        None
    }
    /// Whether `addr..addr+len` is memory of this process the host may
    /// copy with pointers: not device memory, and not a DMA-BUF
    /// registration (whose address is an IOVA).
    fn host_accessible(&self) -> bool {
        self.device().is_none()
    }
}

/// A completion queue (`struct ibv_cq`) and its completion channel.
pub trait CqOps: Send + Sync + Debug {
    /// Entries the CQ holds.
    fn capacity(&self) -> usize;
    /// `ibv_poll_cq`: moves up to `out.len()` completions into `out`.
    fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize>;
    /// `ibv_req_notify_cq`: the next completion makes the channel readable.
    fn req_notify(&self, solicited_only: bool) -> Result<()>;
    /// The channel's file descriptor (non-blocking, level: readable while an
    /// event is pending).
    fn channel_fd(&self) -> RawFd;
    /// `ibv_get_cq_event` + `ibv_ack_cq_events` without blocking: consumes a
    /// pending event, returns whether there was one.
    fn take_event(&self) -> Result<bool>;
    /// For downcasting to the provider's own type.
    fn as_any(&self) -> &dyn Any;
    /// Progress made by the calling thread, for busy-pollers: a provider
    /// whose completions come from its own threads (the soft provider over
    /// tcp) receives what is waiting on the connections of this CQ's QPs
    /// here instead, saving those threads' wake-up. True when it did
    /// something. Costs system calls: call it from a spin, not every poll.
    fn drive(&self) -> bool {
        false
    }
    /// The busy-poller that called [`drive`](Self::drive) stops polling
    /// (to sleep): the provider's threads take its connections back.
    fn drive_stop(&self) {}
}

/// An RC queue pair (`struct ibv_qp`).
pub trait QpOps: Send + Sync + Debug {
    /// QP number.
    fn qp_num(&self) -> u32;
    /// Current state.
    fn state(&self) -> QpState;
    /// Queue sizes granted at creation.
    fn caps(&self) -> QpCaps;
    /// What the peer needs to connect to this QP.
    fn endpoint(&self) -> Result<QpEndpoint>;
    /// `ibv_modify_qp`.
    fn modify(&self, transition: &QpTransition) -> Result<()>;
    /// `ibv_post_send`: every WR or none is accepted when the call fails on
    /// a malformed WR; local key, bounds and access errors come back as
    /// completions, as on hardware.
    fn post_send(&self, wrs: &[SendWr<'_>]) -> Result<()>;
    /// `ibv_post_recv`.
    fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<()>;
    /// Maps `len` bytes at `addr` of the connected peer's region `rkey`
    /// into this process ([`RemoteMapping`](crate::RemoteMapping)); resolves
    /// once the QP's connection is up. `None` where the provider cannot: a
    /// peer on another host, memory outside a shared segment, hardware.
    fn map_remote(&self, rkey: u32, addr: u64, len: u64) -> MapRemoteFuture {
        let _ = (rkey, addr, len);
        Box::pin(std::future::ready(Ok(None)))
    }
    /// [`map_remote`](Self::map_remote) of the whole region `rkey`
    /// registers, found through `addr`, a byte in it (a holder of the key
    /// may touch all of it anyway): one mapping serves every later slice.
    fn map_remote_region(&self, rkey: u32, addr: u64) -> MapRemoteFuture {
        let _ = (rkey, addr);
        Box::pin(std::future::ready(Ok(None)))
    }
}

/// What [`QpOps::map_remote`] returns.
pub type MapRemoteFuture =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<Option<crate::RemoteMapping>>> + Send>>;
