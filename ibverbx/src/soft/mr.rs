//! Soft memory regions and the checks every access goes through.

use std::any::Any;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::context::CtxShared;
use crate::provider::{MrOps, Placement};
use crate::shm::ShmSegment;
use crate::{AccessFlags, Result, WcStatus};

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
        SoftMr { key, pd, addr, len, access, placement, valid: AtomicBool::new(true), seg, _owner: owner }
    }

    /// Checks an access of `len` bytes at `addr` by a QP of `pd` needing
    /// `need`; returns the pointer to use.
    pub(crate) fn check(&self, pd: u32, addr: u64, len: u64, need: AccessFlags) -> Option<*mut u8> {
        if !self.valid.load(Ordering::Acquire) || self.pd != pd || !self.access.contains(need) {
            return None;
        }
        let end = addr.checked_add(len)?;
        if addr < self.addr || end > self.addr + self.len as u64 {
            return None;
        }
        Some(addr as usize as *mut u8)
    }
}

/// A local buffer of a posted WR, resolved at post time.
#[derive(Debug, Clone)]
pub(crate) struct LocalSeg {
    pub(crate) mr: Option<Arc<SoftMr>>,
    pub(crate) addr: u64,
    pub(crate) len: u32,
}

impl LocalSeg {
    /// The pointer for this segment, if its key, bounds and access hold.
    pub(crate) fn ptr(&self, pd: u32, need: AccessFlags) -> Result<*mut u8, WcStatus> {
        if self.len == 0 {
            return Ok(std::ptr::null_mut());
        }
        self.mr.as_ref().and_then(|mr| mr.check(pd, self.addr, self.len as u64, need)).ok_or(WcStatus::LocProtErr)
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
