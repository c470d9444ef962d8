//! Soft memory regions and the checks every access goes through.

use std::any::Any;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::context::CtxShared;
use crate::provider::{MrOps, Placement};
use crate::shm::ShmSegment;
use crate::{AccessFlags, DeviceMemory, Result, WcStatus};

/// A registered range. Posted WRs and in-progress remote accesses hold an
/// `Arc` of it, which keeps the memory alive when it is owned here.
pub(crate) struct SoftMr {
    pub(crate) key: u32,
    pub(crate) pd: u32,
    pub(crate) addr: u64,
    pub(crate) len: usize,
    pub(crate) access: AccessFlags,
    pub(crate) placement: Placement,
    pub(crate) valid: AtomicBool,
    /// The shared segment the region lies in (kept alive with it, so that
    /// its descriptor can be handed to a same-host peer).
    pub(crate) seg: Option<Arc<ShmSegment>>,
    /// Device memory (the host cannot load or store it): every byte moves
    /// through its copies, and [`check`](Self::check) refuses it.
    pub(crate) device: Option<Arc<dyn DeviceMemory>>,
    _owner: Option<Arc<dyn Any + Send + Sync>>,
}

impl fmt::Debug for SoftMr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SoftMr")
            .field("key", &format_args!("{:#x}", self.key))
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .finish()
    }
}

impl SoftMr {
    // A record's constructor: every argument is one of its fields.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        key: u32,
        pd: u32,
        addr: u64,
        len: usize,
        access: AccessFlags,
        placement: Placement,
        seg: Option<Arc<ShmSegment>>,
        owner: Option<Arc<dyn Any + Send + Sync>>,
    ) -> Self {
        SoftMr { key, pd, addr, len, access, placement, valid: AtomicBool::new(true), seg, device: None, _owner: owner }
    }

    /// The region of device memory `device` (staged for every peer).
    pub(crate) fn with_device(mut self, device: Arc<dyn DeviceMemory>) -> Self {
        self.device = Some(device);
        self
    }

    /// While the guard lives, the region stays registered (its owner's
    /// deregistration waits for it: see `fence.rs`); `None` once it was
    /// deregistered. `fences` is the owning context's table.
    pub(crate) fn hold<'a>(&self, fences: &'a super::fence::FenceTable) -> Option<super::fence::LocalFence<'a>> {
        // Counted first, then checked (the owner clears `valid`, then waits
        // for the count): SeqCst fence between the two in `enter`.
        let g = fences.enter(self.key);
        self.valid.load(Ordering::Acquire).then_some(g)
    }

    /// Checks an access of `len` bytes at `addr` by a QP of `pd` needing
    /// `need`; returns the pointer to use. Device memory is refused: the
    /// host cannot use its addresses ([`target`](Self::target) names it).
    pub(crate) fn check(&self, pd: u32, addr: u64, len: u64, need: AccessFlags) -> Option<*mut u8> {
        match self.target(pd, addr, len, need)? {
            Target::Host(p) => Some(p as *mut u8),
            Target::Device(..) => None,
        }
    }

    /// The check of [`check`](Self::check), for host or device memory.
    pub(crate) fn target(&self, pd: u32, addr: u64, len: u64, need: AccessFlags) -> Option<Target> {
        if !self.valid.load(Ordering::Acquire) || self.pd != pd || !self.access.contains(need) {
            return None;
        }
        let end = addr.checked_add(len)?;
        if addr < self.addr || end > self.addr + self.len as u64 {
            return None;
        }
        Some(match &self.device {
            Some(d) => Target::Device(d.clone(), addr),
            None => Target::Host(addr as usize),
        })
    }
}

/// Where a checked access goes.
#[derive(Debug, Clone)]
pub(crate) enum Target {
    /// Host memory at this address (an integer: futures holding it stay
    /// `Send`).
    Host(usize),
    /// Device memory at this address, reached through the copies.
    Device(Arc<dyn DeviceMemory>, u64),
}

/// A local buffer of a posted WR, resolved at post time.
#[derive(Debug, Clone)]
pub(crate) struct LocalSeg {
    pub(crate) mr: Option<Arc<SoftMr>>,
    pub(crate) addr: u64,
    pub(crate) len: u32,
}

impl LocalSeg {
    /// Where this segment's bytes are, if its key, bounds and access hold.
    pub(crate) fn target(&self, pd: u32, need: AccessFlags) -> Result<Target, WcStatus> {
        if self.len == 0 {
            return Ok(Target::Host(0));
        }
        self.mr.as_ref().and_then(|mr| mr.target(pd, self.addr, self.len as u64, need)).ok_or(WcStatus::LocProtErr)
    }
}

/// The user-facing handle: deregisters on drop.
pub(crate) struct SoftMrHandle {
    pub(crate) mr: Arc<SoftMr>,
    pub(crate) ctx: Arc<CtxShared>,
}

impl fmt::Debug for SoftMrHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.mr.fmt(f)
    }
}

impl MrOps for SoftMrHandle {
    fn addr(&self) -> u64 {
        self.mr.addr
    }
    fn len(&self) -> usize {
        self.mr.len
    }
    fn lkey(&self) -> u32 {
        self.mr.key
    }
    fn rkey(&self) -> u32 {
        self.mr.key
    }
    fn access(&self) -> AccessFlags {
        self.mr.access
    }
    fn placement(&self) -> Placement {
        self.mr.placement
    }
    fn device(&self) -> Option<&Arc<dyn DeviceMemory>> {
        self.mr.device.as_ref()
    }
    fn deregister(&self) -> Result<()> {
        if self.mr.valid.swap(false, Ordering::AcqRel) {
            self.ctx.deregister(self.mr.key);
        }
        Ok(())
    }
}

impl Drop for SoftMrHandle {
    fn drop(&mut self) {
        let _ = self.deregister();
    }
}
