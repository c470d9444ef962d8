//! Protection domains and the table that maps local keys back to memory
//! regions, so that posted WRs can keep their regions alive.

use std::any::Any;
use std::collections::HashMap;
use std::fmt;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, Weak};

use super::context::CtxShared;
use super::ffi::*;
use super::mr::{MrInner, VerbsMr};
use super::qp::VerbsQp;
use crate::provider::{CqOps, MrOps, PdOps, QpOps};
use crate::{AccessFlags, Error, QpInitAttr, Result};

pub(crate) struct PdShared {
    pub(crate) ctx: Arc<CtxShared>,
    pub(crate) pd: NonNull<ibv_pd>,
    /// lkey → region, for the keep-alive of posted WRs.
    pub(crate) mrs: Mutex<HashMap<u32, Weak<MrInner>>>,
}

// SAFETY: libibverbs PDs may be used from any thread; the pointer is only
// passed to libibverbs.
unsafe impl Send for PdShared {}
// SAFETY: as above.
unsafe impl Sync for PdShared {}

impl PdShared {
    pub(crate) fn alloc(ctx: Arc<CtxShared>) -> Result<Arc<PdShared>> {
        // SAFETY: ctx is an open context.
        let pd = unsafe { (ctx.lib.alloc_pd)(ctx.ctx.as_ptr()) };
        let pd = NonNull::new(pd).ok_or_else(|| Error::last_os("alloc_pd"))?;
        Ok(Arc::new(PdShared { ctx, pd, mrs: Mutex::new(HashMap::new()) }))
    }
}

impl Drop for PdShared {
    fn drop(&mut self) {
        // SAFETY: every MR and QP of this PD holds an Arc of it, so none is left.
        let r = unsafe { (self.ctx.lib.dealloc_pd)(self.pd.as_ptr()) };
        if r != 0 {
            tracing::warn!("ibv_dealloc_pd failed: {}", io::Error::from_raw_os_error(r));
        }
    }
}

/// The verbs provider's [`PdOps`].
pub struct VerbsPd {
    pub(crate) shared: Arc<PdShared>,
}

impl fmt::Debug for VerbsPd {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VerbsPd").field("device", &self.shared.ctx.name).finish()
    }
}

impl VerbsPd {
    /// Takes a registration `ibv_reg_*` returned (null: the error of
    /// `verb`) and lists it for the keep-alive of posted WRs; `host`: its
    /// addresses are this process's memory (inline data may come from it).
    fn adopt(
        &self,
        mr: *mut ibv_mr,
        verb: &'static str,
        access: AccessFlags,
        owner: Option<Arc<dyn Any + Send + Sync>>,
        host: bool,
    ) -> Result<Arc<MrInner>> {
        let mr = NonNull::new(mr).ok_or_else(|| Error::last_os(verb))?;
        let inner = MrInner::new(self.shared.clone(), mr, access, owner, host);
        self.shared.mrs.lock().unwrap_or_else(|e| e.into_inner()).insert(inner.lkey, Arc::downgrade(&inner));
        Ok(inner)
    }

    fn finish_reg(
        &self,
        mr: *mut ibv_mr,
        verb: &'static str,
        access: AccessFlags,
        owner: Option<Arc<dyn Any + Send + Sync>>,
        host: bool,
    ) -> Result<Arc<dyn MrOps>> {
        Ok(Arc::new(VerbsMr { inner: self.adopt(mr, verb, access, owner, host)?, device: None }))
    }

    /// A registration of device memory: never a source of inline data.
    fn finish_device(
        &self,
        mr: *mut ibv_mr,
        access: AccessFlags,
        owner: Option<Arc<dyn Any + Send + Sync>>,
        dev: Arc<dyn crate::DeviceMemory>,
    ) -> Result<Arc<dyn MrOps>> {
        Ok(Arc::new(VerbsMr { inner: self.adopt(mr, "reg_mr", access, owner, false)?, device: Some(dev) }))
    }

    /// `ibv_reg_dmabuf_mr`: registers `len` bytes at `offset` of a DMA-BUF
    /// (GPU memory exported by CUDA/ROCm), addressed by peers and SGEs as
    /// `iova..iova+len`. Needs rdma-core ≥ 34 and a kernel and HCA driver
    /// with DMA-BUF support.
    ///
    /// # Safety
    /// The DMA-BUF's memory must stay allocated until the returned region is
    /// deregistered and every WR naming it has completed.
    pub unsafe fn reg_dmabuf_mr(
        &self,
        fd: BorrowedFd<'_>,
        offset: u64,
        len: usize,
        iova: u64,
        access: AccessFlags,
    ) -> Result<Arc<dyn MrOps>> {
        let Some(reg) = self.shared.ctx.lib.reg_dmabuf_mr else {
            return Err(Error::Unavailable {
                provider: "verbs",
                reason: "this libibverbs has no ibv_reg_dmabuf_mr (needs rdma-core 34 or newer)".into(),
            });
        };
        if !access.is_consistent() {
            return Err(Error::invalid("reg_dmabuf_mr", "REMOTE_WRITE and REMOTE_ATOMIC need LOCAL_WRITE"));
        }
        // SAFETY: the PD is live; the fd is a borrowed open descriptor; the
        // memory's lifetime is the caller's promise.
        let mr = unsafe { reg(self.shared.pd.as_ptr(), offset, len, iova, fd.as_raw_fd(), access.bits() as i32) };
        // Its addresses are an IOVA, not this process's memory: never a
        // source of inline data.
        self.finish_reg(mr, "reg_dmabuf_mr", access, None, false)
    }
}

impl PdOps for VerbsPd {
    unsafe fn reg_mr(
        &self,
        addr: *mut u8,
        len: usize,
        access: AccessFlags,
        owner: Option<Arc<dyn Any + Send + Sync>>,
    ) -> Result<Arc<dyn MrOps>> {
        if !access.is_consistent() {
            return Err(Error::invalid("reg_mr", "REMOTE_WRITE and REMOTE_ATOMIC need LOCAL_WRITE"));
        }
        // SAFETY: the PD is live; validity of addr..addr+len until
        // deregistration is the caller's contract (`owner` keeps it).
        let mr =
            unsafe { (self.shared.ctx.lib.reg_mr)(self.shared.pd.as_ptr(), addr.cast(), len, access.bits() as i32) };
        self.finish_reg(mr, "reg_mr", access, owner, true)
    }

    unsafe fn reg_dmabuf(
        &self,
        fd: BorrowedFd<'_>,
        offset: u64,
        len: usize,
        iova: u64,
        access: AccessFlags,
    ) -> Result<Arc<dyn MrOps>> {
        // SAFETY: forwarded to the caller (the same contract).
        unsafe { self.reg_dmabuf_mr(fd, offset, len, iova, access) }
    }

    /// DMA-BUF first (`dev`'s export, `ibv_reg_dmabuf_mr` with the device
    /// address as the IOVA); where either side lacks it, registration by
    /// address, which needs a peer-memory module (nvidia-peermem). The error
    /// names both attempts.
    unsafe fn reg_device_mr(
        &self,
        dev: Arc<dyn crate::DeviceMemory>,
        addr: u64,
        len: usize,
        access: AccessFlags,
        owner: Option<Arc<dyn Any + Send + Sync>>,
    ) -> Result<Arc<dyn MrOps>> {
        if !access.is_consistent() {
            return Err(Error::invalid("reg_mr", "REMOTE_WRITE and REMOTE_ATOMIC need LOCAL_WRITE"));
        }
        let why: String = match (dev.dmabuf(addr, len), self.shared.ctx.lib.reg_dmabuf_mr) {
            (None, _) => format!("{} exports no DMA-BUF", dev.describe()),
            (Some(Err(e)), _) => format!("DMA-BUF export failed: {e}"),
            (Some(Ok(_)), None) => "this libibverbs has no ibv_reg_dmabuf_mr (rdma-core < 34)".to_string(),
            (Some(Ok((fd, off))), Some(reg)) => {
                // SAFETY: the PD is live, the fd open (the registration
                // holds the DMA-BUF; ours closes after); the memory's
                // lifetime is the caller's promise.
                let mr = unsafe { reg(self.shared.pd.as_ptr(), off, len, addr, fd.as_raw_fd(), access.bits() as i32) };
                if mr.is_null() {
                    format!("ibv_reg_dmabuf_mr: {}", io::Error::last_os_error())
                } else {
                    return self.finish_device(mr, access, owner, dev);
                }
            }
        };
        // SAFETY: the PD is live; the range's lifetime is the caller's
        // promise; the HCA driver resolves a device address only through a
        // peer-memory client, else it fails (EFAULT) and nothing is
        // registered.
        let mr = unsafe {
            (self.shared.ctx.lib.reg_mr)(
                self.shared.pd.as_ptr(),
                addr as usize as *mut std::ffi::c_void,
                len,
                access.bits() as i32,
            )
        };
        if mr.is_null() {
            return Err(Error::invalid(
                "reg_mr",
                format!(
                    "cannot register {len} bytes of {} at {addr:#x}: DMA-BUF: {why}; by address (nvidia-peermem): {}",
                    dev.describe(),
                    io::Error::last_os_error()
                ),
            ));
        }
        tracing::debug!("device memory registered by address (peer memory), not DMA-BUF: {why}");
        self.finish_device(mr, access, owner, dev)
    }

    fn create_qp(
        &self,
        attr: &QpInitAttr,
        send_cq: &Arc<dyn CqOps>,
        recv_cq: &Arc<dyn CqOps>,
    ) -> Result<Arc<dyn QpOps>> {
        Ok(VerbsQp::create(&self.shared, attr, send_cq, recv_cq)?)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}
