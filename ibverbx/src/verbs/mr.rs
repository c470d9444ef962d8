//! Memory regions (`ibv_mr`): deregistered at once when the handle asks,
//! while the memory they own stays alive as long as a posted WR holds them.

use std::any::Any;
use std::fmt;
use std::io;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use super::ffi::*;
use super::pd::PdShared;
use crate::provider::{MrOps, Placement};
use crate::{AccessFlags, Error, Result};

pub(crate) struct MrInner {
    pd: Arc<PdShared>,
    mr: Mutex<Option<NonNull<ibv_mr>>>,
    pub(crate) addr: u64,
    pub(crate) len: usize,
    pub(crate) lkey: u32,
    pub(crate) rkey: u32,
    access: AccessFlags,
    /// `addr..addr+len` is memory of this process (not a DMA-BUF's IOVA),
    /// so inline sends may read it.
    host: bool,
    _owner: Option<Arc<dyn Any + Send + Sync>>,
}

// SAFETY: the ibv_mr pointer is only passed to ibv_dereg_mr, under the
// mutex; libibverbs MRs may be used from any thread.
unsafe impl Send for MrInner {}
// SAFETY: as above.
unsafe impl Sync for MrInner {}

impl MrInner {
    pub(crate) fn new(
        pd: Arc<PdShared>,
        mr: NonNull<ibv_mr>,
        access: AccessFlags,
        owner: Option<Arc<dyn Any + Send + Sync>>,
        host: bool,
    ) -> Arc<MrInner> {
        // SAFETY: ibv_reg_mr returned this registration, fully initialised.
        let m = unsafe { mr.as_ref() };
        Arc::new(MrInner {
            addr: m.addr as u64,
            len: m.length,
            lkey: m.lkey,
            rkey: m.rkey,
            mr: Mutex::new(Some(mr)),
            pd,
            access,
            host,
            _owner: owner,
        })
    }

    /// Whether an inline send may read `len` bytes at `addr`: inside this
    /// registration of host memory, still registered.
    pub(crate) fn covers(&self, addr: u64, len: u32) -> bool {
        let end = addr.checked_add(len as u64);
        self.host
            && addr >= self.addr
            && end.is_some_and(|e| e <= self.addr + self.len as u64)
            && self.mr.lock().unwrap_or_else(|e| e.into_inner()).is_some()
    }

    fn deregister(self: &Arc<Self>) -> Result<()> {
        let Some(mr) = self.mr.lock().unwrap_or_else(|e| e.into_inner()).take() else { return Ok(()) };
        {
            let mut t = self.pd.mrs.lock().unwrap_or_else(|e| e.into_inner());
            if t.get(&self.lkey).is_some_and(|w| std::ptr::eq(w.as_ptr(), Arc::as_ptr(self))) {
                t.remove(&self.lkey);
            }
        }
        // SAFETY: `mr` is a live registration taken out of the mutex, so it
        // is deregistered exactly once.
        let r = unsafe { (self.pd.ctx.lib.dereg_mr)(mr.as_ptr()) };
        if r != 0 {
            return Err(Error::os("dereg_mr", io::Error::from_raw_os_error(r)));
        }
        Ok(())
    }
}

impl fmt::Debug for MrInner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "MrInner(lkey {:#x})", self.lkey)
    }
}

impl Drop for MrInner {
    fn drop(&mut self) {
        if let Some(mr) = self.mr.get_mut().unwrap_or_else(|e| e.into_inner()).take() {
            // SAFETY: still registered (the handle was never asked to
            // deregister); nobody else can reach it now.
            unsafe { (self.pd.ctx.lib.dereg_mr)(mr.as_ptr()) };
        }
    }
}

/// The verbs provider's [`MrOps`].
pub(crate) struct VerbsMr {
    pub(crate) inner: Arc<MrInner>,
    /// The device memory it registers (through DMA-BUF or by address).
    pub(crate) device: Option<Arc<dyn crate::DeviceMemory>>,
}

impl fmt::Debug for VerbsMr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VerbsMr")
            .field("addr", &format_args!("{:#x}", self.inner.addr))
            .field("len", &self.inner.len)
            .field("lkey", &format_args!("{:#x}", self.inner.lkey))
            .finish()
    }
}

impl MrOps for VerbsMr {
    fn addr(&self) -> u64 {
        self.inner.addr
    }
    fn len(&self) -> usize {
        self.inner.len
    }
    fn lkey(&self) -> u32 {
        self.inner.lkey
    }
    fn rkey(&self) -> u32 {
        self.inner.rkey
    }
    fn access(&self) -> AccessFlags {
        self.inner.access
    }
    fn placement(&self) -> Placement {
        Placement::Hardware
    }
    fn deregister(&self) -> Result<()> {
        self.inner.deregister()
    }
    fn device(&self) -> Option<&Arc<dyn crate::DeviceMemory>> {
        self.device.as_ref()
    }
    fn host_accessible(&self) -> bool {
        self.inner.host && self.device.is_none()
    }
}

impl Drop for VerbsMr {
    fn drop(&mut self) {
        if let Err(e) = self.inner.deregister() {
            tracing::warn!("{e}");
        }
    }
}
