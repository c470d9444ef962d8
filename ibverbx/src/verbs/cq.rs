//! Completion queues (`ibv_cq`) with their own completion channel, polled
//! through the context's ops table as verbs.h's inline `ibv_poll_cq` does.
//!
//! Polling maps each hardware completion back to its WR through the QP's
//! [`WrRing`](super::wr_ring::WrRing), which restores the caller's `wr_id`
//! and opcode and lets go of the regions the WR kept alive. Overflow: the CQ
//! counts the completions its QPs can still produce; once a post makes that
//! exceed the size the CQ was created with, `poll` reports
//! [`Error::CqOverflow`] from then on (the HCA may have rounded the CQ up and
//! absorbed it, but the caller broke the sizing contract either way).

use std::any::Any;
use std::collections::HashMap;
use std::fmt;
use std::io;
use std::os::fd::RawFd;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use super::context::CtxShared;
use super::ffi::*;
use super::qp::QpRings;
use super::wr_ring::RECV_BIT;
use crate::provider::CqOps;
use crate::wc::{WcOpcode, WcStatus, WorkCompletion};
use crate::{Error, Result};

#[derive(Debug, Default)]
struct Budget {
    /// Completions the attached QPs may still produce.
    outstanding: usize,
    /// Completions beyond the capacity.
    dropped: u64,
}

pub(crate) struct CqShared {
    pub(crate) ctx: Arc<CtxShared>,
    pub(crate) cq: NonNull<ibv_cq>,
    channel: NonNull<ibv_comp_channel>,
    cap: usize,
    budget: Mutex<Budget>,
    /// QPs whose completions land here, by QP number.
    pub(crate) qps: Mutex<HashMap<u32, Arc<QpRings>>>,
    poll_cq: poll_cq_fn,
    req_notify_cq: req_notify_cq_fn,
}

// SAFETY: libibverbs CQs and channels may be used from any thread (the
// provider locks internally); the pointers are only passed to libibverbs.
unsafe impl Send for CqShared {}
// SAFETY: as above.
unsafe impl Sync for CqShared {}

impl CqShared {
    pub(crate) fn create(ctx: Arc<CtxShared>, cqe: usize) -> Result<Arc<CqShared>> {
        let max = ctx.attr.max_cqe.max(1) as usize;
        if cqe == 0 || cqe > max {
            return Err(Error::invalid("create_cq", format!("cqe must be 1..={max} on {}", ctx.name)));
        }
        let lib = &ctx.lib;
        // SAFETY: ctx is an open context.
        let ch = unsafe { (lib.create_comp_channel)(ctx.ctx.as_ptr()) };
        let channel = NonNull::new(ch).ok_or_else(|| Error::last_os("create_comp_channel"))?;
        // SAFETY: channel is live; fd is its descriptor.
        let fd = unsafe { channel.as_ref().fd };
        // SAFETY: plain fcntl calls on a descriptor the channel owns.
        let nb = unsafe {
            let fl = libc::fcntl(fd, libc::F_GETFL);
            fl >= 0 && libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK) == 0
        };
        let destroy_channel = || {
            // SAFETY: the channel has no CQ attached (yet/any more).
            unsafe { (lib.destroy_comp_channel)(channel.as_ptr()) };
        };
        if !nb {
            let e = Error::last_os("fcntl(O_NONBLOCK) on the completion channel");
            destroy_channel();
            return Err(e);
        }
        // SAFETY: ctx and channel are live; cq_context is unused (null).
        let cq = unsafe { (lib.create_cq)(ctx.ctx.as_ptr(), cqe as i32, std::ptr::null_mut(), channel.as_ptr(), 0) };
        let Some(cq) = NonNull::new(cq) else {
            let e = Error::last_os("create_cq");
            destroy_channel();
            return Err(e);
        };
        // SAFETY: the context is open; its ops table is filled in by the
        // driver at open time and never changes.
        let ops = unsafe { &(*ctx.ctx.as_ptr()).ops };
        let (Some(poll_cq), Some(req_notify_cq)) = (ops.poll_cq, ops.req_notify_cq) else {
            // SAFETY: cq was just created and is unused.
            unsafe { (lib.destroy_cq)(cq.as_ptr()) };
            destroy_channel();
            return Err(Error::Unavailable {
                provider: "verbs",
                reason: "the driver has no poll_cq/req_notify_cq".into(),
            });
        };
        Ok(Arc::new(CqShared {
            ctx,
            cq,
            channel,
            cap: cqe,
            budget: Mutex::new(Budget::default()),
            qps: Mutex::new(HashMap::new()),
            poll_cq,
            req_notify_cq,
        }))
    }

    /// Counts `n` completions that posted WRs will produce.
    pub(crate) fn reserve(&self, n: usize) {
        if n == 0 {
            return;
        }
        let mut b = self.budget.lock().unwrap_or_else(|e| e.into_inner());
        b.outstanding += n;
        if b.outstanding > self.cap {
            let over = b.outstanding - self.cap;
            if b.dropped == 0 {
                tracing::error!(capacity = self.cap, "verbs CQ overflow: more completions pending than the CQ holds");
            }
            b.dropped += over as u64;
            b.outstanding = self.cap;
        }
    }

    /// Gives back `n` counted completions (polled, or dropped with their QP).
    pub(crate) fn release(&self, n: usize) {
        if n == 0 {
            return;
        }
        let mut b = self.budget.lock().unwrap_or_else(|e| e.into_inner());
        b.outstanding = b.outstanding.saturating_sub(n);
    }

    fn translate(&self, w: &ibv_wc, rings: &QpRings) -> Option<WorkCompletion> {
        let recv = w.wr_id & RECV_BIT != 0;
        let ring = if recv { &rings.recv } else { &rings.send };
        let (slot, counted) = ring.lock().unwrap_or_else(|e| e.into_inner()).complete(w.wr_id)?;
        self.release(counted);
        let status = WcStatus::from_raw(w.status);
        let opcode = if status == WcStatus::Success {
            match w.opcode {
                IBV_WC_SEND => WcOpcode::Send,
                IBV_WC_RDMA_WRITE => WcOpcode::RdmaWrite,
                IBV_WC_RDMA_READ => WcOpcode::RdmaRead,
                IBV_WC_COMP_SWAP => WcOpcode::CompareSwap,
                IBV_WC_FETCH_ADD => WcOpcode::FetchAdd,
                IBV_WC_RECV_RDMA_WITH_IMM => WcOpcode::RecvRdmaWithImm,
                IBV_WC_RECV => WcOpcode::Recv,
                _ => slot.opcode,
            }
        } else {
            slot.opcode
        };
        Some(WorkCompletion {
            wr_id: slot.wr_id,
            status,
            opcode,
            byte_len: w.byte_len,
            imm_data: (w.wc_flags & IBV_WC_WITH_IMM != 0).then(|| u32::from_be(w.imm_data)),
            qp_num: w.qp_num,
            vendor_err: w.vendor_err,
        })
        // `slot` drops here: its regions are let go.
    }
}

impl Drop for CqShared {
    fn drop(&mut self) {
        let lib = &self.ctx.lib;
        // SAFETY: every QP using this CQ holds an Arc of it, so none is
        // left; every event was acknowledged in `take_event`.
        let r = unsafe { (lib.destroy_cq)(self.cq.as_ptr()) };
        if r != 0 {
            tracing::warn!("ibv_destroy_cq failed: {}", io::Error::from_raw_os_error(r));
        }
        // SAFETY: its only CQ is gone.
        unsafe { (lib.destroy_comp_channel)(self.channel.as_ptr()) };
    }
}

/// The verbs provider's [`CqOps`].
pub(crate) struct VerbsCq {
    pub(crate) shared: Arc<CqShared>,
}

impl fmt::Debug for VerbsCq {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VerbsCq").field("capacity", &self.shared.cap).finish()
    }
}

const POLL_BATCH: usize = 32;

impl CqOps for VerbsCq {
    fn capacity(&self) -> usize {
        self.shared.cap
    }

    fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize> {
        let s = &*self.shared;
        {
            let b = s.budget.lock().unwrap_or_else(|e| e.into_inner());
            if b.dropped > 0 {
                return Err(Error::CqOverflow { capacity: s.cap, dropped: b.dropped });
            }
        }
        let mut raw = [ibv_wc::default(); POLL_BATCH];
        let mut n = 0;
        while n < out.len() {
            let want = (out.len() - n).min(POLL_BATCH);
            // SAFETY: the CQ is live; `raw` has room for `want` entries; the
            // driver's poll_cq is what ibv_poll_cq calls.
            let got = unsafe { (s.poll_cq)(s.cq.as_ptr(), want as i32, raw.as_mut_ptr()) };
            if got < 0 {
                return Err(Error::os("poll_cq", io::Error::from_raw_os_error(-got)));
            }
            let got = got as usize;
            if got == 0 {
                break;
            }
            let qps = s.qps.lock().unwrap_or_else(|e| e.into_inner());
            for w in &raw[..got] {
                // A completion of a QP that is gone or was reset is dropped,
                // as verbs drops the WRs of a destroyed QP.
                if let Some(wc) = qps.get(&w.qp_num).and_then(|r| s.translate(w, r)) {
                    out[n] = wc;
                    n += 1;
                }
            }
            if got < want {
                break;
            }
        }
        Ok(n)
    }

    fn req_notify(&self, solicited_only: bool) -> Result<()> {
        let s = &*self.shared;
        // SAFETY: the CQ is live; this is what ibv_req_notify_cq calls.
        let r = unsafe { (s.req_notify_cq)(s.cq.as_ptr(), solicited_only as i32) };
        if r != 0 {
            return Err(Error::os("req_notify_cq", io::Error::from_raw_os_error(r.abs())));
        }
        Ok(())
    }

    fn channel_fd(&self) -> RawFd {
        // SAFETY: the channel lives as long as the CQ.
        unsafe { self.shared.channel.as_ref().fd }
    }

    fn take_event(&self) -> Result<bool> {
        let s = &*self.shared;
        let mut cq: *mut ibv_cq = std::ptr::null_mut();
        let mut cq_ctx: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: the channel is live and non-blocking; out-pointers are valid.
        let r = unsafe { (s.ctx.lib.get_cq_event)(s.channel.as_ptr(), &mut cq, &mut cq_ctx) };
        if r != 0 {
            let e = io::Error::last_os_error();
            return if e.kind() == io::ErrorKind::WouldBlock { Ok(false) } else { Err(Error::os("get_cq_event", e)) };
        }
        // SAFETY: one event of this CQ (the channel's only one) was taken.
        unsafe { (s.ctx.lib.ack_cq_events)(s.cq.as_ptr(), 1) };
        Ok(true)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}
