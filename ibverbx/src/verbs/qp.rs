//! RC queue pairs (`ibv_qp`): creation, transitions with attributes built in
//! `modify.rs`, and posting through the context's ops table (verbs.h's
//! inline `ibv_post_send`/`ibv_post_recv`).

use std::fmt;
use std::io;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use super::cq::{CqShared, VerbsCq};
use super::ffi::*;
use super::modify::{init_attr, rtr_attr, rts_attr, state_attr, Limits, LocalPort};
use super::mr::MrInner;
use super::pd::PdShared;
use super::wr_ring::WrRing;
use crate::endpoint::QpEndpoint;
use crate::provider::{CqOps, QpOps};
use crate::qp_attr::{InitAttr, QpCaps, QpState, QpTransition};
use crate::wc::WcOpcode;
use crate::wr::{AtomicOp, RecvWr, SendOp, SendWr};
use crate::{Error, QpInitAttr, Result};

/// The WR records of one QP; the CQs reach them by QP number when polling.
#[derive(Debug)]
pub(crate) struct QpRings {
    pub(crate) send: Mutex<WrRing<Arc<MrInner>>>,
    pub(crate) recv: Mutex<WrRing<Arc<MrInner>>>,
}

#[derive(Debug, Clone, Copy)]
struct Local {
    state: QpState,
    port: u8,
}

pub(crate) struct VerbsQp {
    pd: Arc<PdShared>,
    qp: NonNull<ibv_qp>,
    qpn: u32,
    scq: Arc<CqShared>,
    rcq: Arc<CqShared>,
    caps: QpCaps,
    sq_sig_all: bool,
    psn: u32,
    rings: Arc<QpRings>,
    local: Mutex<Local>,
    post_send_fn: post_send_fn,
    post_recv_fn: post_recv_fn,
}

// SAFETY: libibverbs QPs may be posted to from any thread (the driver locks
// each queue); the pointer is only passed to libibverbs.
unsafe impl Send for VerbsQp {}
// SAFETY: as above.
unsafe impl Sync for VerbsQp {}

impl fmt::Debug for VerbsQp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VerbsQp").field("qpn", &format_args!("{:#x}", self.qpn)).finish()
    }
}

fn verbs_cq(cq: &Arc<dyn CqOps>) -> Option<&Arc<CqShared>> {
    cq.as_any().downcast_ref::<VerbsCq>().map(|c| &c.shared)
}

fn qp_state(v: u32) -> QpState {
    match v {
        IBV_QPS_RESET => QpState::Reset,
        IBV_QPS_INIT => QpState::Init,
        IBV_QPS_RTR => QpState::Rtr,
        IBV_QPS_RTS => QpState::Rts,
        IBV_QPS_SQD => QpState::Sqd,
        IBV_QPS_SQE => QpState::Sqe,
        _ => QpState::Err,
    }
}

fn raw_state(s: QpState) -> u32 {
    match s {
        QpState::Reset => IBV_QPS_RESET,
        QpState::Init => IBV_QPS_INIT,
        QpState::Rtr => IBV_QPS_RTR,
        QpState::Rts => IBV_QPS_RTS,
        QpState::Sqd => IBV_QPS_SQD,
        QpState::Sqe => IBV_QPS_SQE,
        QpState::Err => IBV_QPS_ERR,
    }
}

/// An `ibv_send_wr` for one WR (SGE list and chaining filled in by the caller).
pub(crate) fn send_wr(wr: &SendWr<'_>, hw_wr_id: u64, force_signal: bool) -> ibv_send_wr {
    let mut flags = 0;
    if wr.flags.signaled || force_signal {
        flags |= IBV_SEND_SIGNALED;
    }
    if wr.flags.inline {
        flags |= IBV_SEND_INLINE;
    }
    if wr.flags.fence {
        flags |= IBV_SEND_FENCE;
    }
    let rdma = |remote_addr, rkey| ibv_send_wr_wr { rdma: ibv_send_wr_rdma { remote_addr, rkey } };
    let none = ibv_send_wr_wr { atomic: ibv_send_wr_atomic::default() };
    let (opcode, imm, body) = match wr.op {
        SendOp::Send => (IBV_WR_SEND, 0, none),
        SendOp::SendWithImm { imm } => (IBV_WR_SEND_WITH_IMM, imm.to_be(), none),
        SendOp::RdmaWrite { remote_addr, rkey } => (IBV_WR_RDMA_WRITE, 0, rdma(remote_addr, rkey)),
        SendOp::RdmaWriteWithImm { remote_addr, rkey, imm } => {
            (IBV_WR_RDMA_WRITE_WITH_IMM, imm.to_be(), rdma(remote_addr, rkey))
        }
        SendOp::RdmaRead { remote_addr, rkey } => (IBV_WR_RDMA_READ, 0, rdma(remote_addr, rkey)),
        SendOp::Atomic { remote_addr, rkey, op } => {
            let (opcode, compare_add, swap) = match op {
                AtomicOp::FetchAdd { add } => (IBV_WR_ATOMIC_FETCH_AND_ADD, add, 0),
                AtomicOp::CompareSwap { compare, swap } => (IBV_WR_ATOMIC_CMP_AND_SWP, compare, swap),
            };
            (opcode, 0, ibv_send_wr_wr { atomic: ibv_send_wr_atomic { remote_addr, compare_add, swap, rkey } })
        }
    };
    ibv_send_wr {
        wr_id: hw_wr_id,
        next: std::ptr::null_mut(),
        sg_list: std::ptr::null_mut(),
        num_sge: wr.sg_list.len() as i32,
        opcode,
        send_flags: flags,
        imm_data: imm,
        wr: body,
        qp_type: 0,
        bind_mw: [0; 6],
    }
}

/// Checks a send WR against the QP's capabilities (the HCA would refuse it
/// after earlier WRs of the batch were already posted).
pub(crate) fn check_send_wr(wr: &SendWr<'_>, caps: &QpCaps) -> Result<()> {
    if wr.sg_list.len() > caps.max_send_sge as usize {
        return Err(Error::invalid(
            "post_send",
            format!("{} SGEs exceed max_send_sge {}", wr.sg_list.len(), caps.max_send_sge),
        ));
    }
    let len: u64 = wr.sg_list.iter().map(|s| s.length as u64).sum();
    if wr.flags.inline {
        if matches!(wr.op, SendOp::RdmaRead { .. } | SendOp::Atomic { .. }) {
            return Err(Error::invalid("post_send", "RDMA READ and atomics cannot be inline"));
        }
        if len > caps.max_inline_data as u64 {
            return Err(Error::invalid(
                "post_send",
                format!("{len} inline bytes exceed max_inline_data {}", caps.max_inline_data),
            ));
        }
    }
    if let SendOp::Atomic { remote_addr, .. } = wr.op {
        if wr.sg_list.len() != 1 || wr.sg_list[0].length != 8 {
            return Err(Error::invalid("post_send", "an atomic needs exactly one 8-byte SGE"));
        }
        if remote_addr % 8 != 0 {
            return Err(Error::invalid("post_send", "an atomic's remote address must be 8-byte aligned"));
        }
    }
    Ok(())
}

/// The INIT attributes on a context whose default port is `default_port`:
/// port 0 in `a` means that port (`RMACOMM_IB_HCA=mlx5_0:2` gives 2), so
/// QPs made with default attributes use the port the device was chosen on.
fn init_on(a: &InitAttr, default_port: u8) -> std::result::Result<(ibv_qp_attr, std::os::raw::c_int), String> {
    init_attr(&a.resolved(default_port))
}

/// Chains `n` WRs at `base` (`next`) and points each at its `num_sge` SGEs,
/// taken in order from `sges`.
///
/// # Safety
/// `base` must point to `n` WRs and `sges` to at least the sum of their
/// `num_sge` SGEs; `num_sge`/`set` must read and write fields of the WR they
/// are given.
unsafe fn link<W, S>(
    base: *mut W,
    n: usize,
    sges: *mut S,
    num_sge: impl Fn(*mut W) -> i32,
    set: impl Fn(*mut W, *mut S, *mut W),
) {
    let mut off = 0;
    for i in 0..n {
        // SAFETY: i < n.
        let w = unsafe { base.add(i) };
        let k = num_sge(w).max(0) as usize;
        // SAFETY: off + k <= the number of SGEs; i + 1 < n for a non-null next.
        let (sg, next) = unsafe {
            (
                if k == 0 { std::ptr::null_mut() } else { sges.add(off) },
                if i + 1 < n { base.add(i + 1) } else { std::ptr::null_mut() },
            )
        };
        set(w, sg, next);
        off += k;
    }
}

impl VerbsQp {
    pub(crate) fn create(
        pd: &Arc<PdShared>,
        attr: &QpInitAttr,
        send_cq: &Arc<dyn CqOps>,
        recv_cq: &Arc<dyn CqOps>,
    ) -> Result<Arc<VerbsQp>> {
        let (Some(scq), Some(rcq)) = (verbs_cq(send_cq), verbs_cq(recv_cq)) else {
            return Err(Error::invalid("create_qp", "the CQs must come from the verbs provider"));
        };
        if !Arc::ptr_eq(&scq.ctx, &pd.ctx) || !Arc::ptr_eq(&rcq.ctx, &pd.ctx) {
            return Err(Error::invalid("create_qp", "the CQs must come from the same context as the PD"));
        }
        let c = attr.caps;
        let mut init = ibv_qp_init_attr {
            qp_context: std::ptr::null_mut(),
            send_cq: scq.cq.as_ptr(),
            recv_cq: rcq.cq.as_ptr(),
            srq: std::ptr::null_mut(),
            cap: ibv_qp_cap {
                max_send_wr: c.max_send_wr,
                max_recv_wr: c.max_recv_wr,
                max_send_sge: c.max_send_sge,
                max_recv_sge: c.max_recv_sge,
                max_inline_data: c.max_inline_data,
            },
            qp_type: IBV_QPT_RC,
            sq_sig_all: attr.sq_sig_all as i32,
        };
        let lib = &pd.ctx.lib;
        // SAFETY: the PD and CQs are live objects of one context; `init` is
        // a valid ibv_qp_init_attr that ibv_create_qp updates with the
        // granted capabilities.
        let qp = unsafe { (lib.create_qp)(pd.pd.as_ptr(), &mut init) };
        let qp = NonNull::new(qp).ok_or_else(|| {
            let e = io::Error::last_os_error();
            Error::os("create_qp", io::Error::new(e.kind(), format!("{e} (asked for {c:?})")))
        })?;
        // SAFETY: ibv_create_qp returned an initialised QP; its context's ops
        // table is filled by the driver at open time.
        let (qpn, ops) = unsafe { ((*qp.as_ptr()).qp_num, &(*pd.ctx.ctx.as_ptr()).ops) };
        let (Some(post_send_fn), Some(post_recv_fn)) = (ops.post_send, ops.post_recv) else {
            // SAFETY: the QP was just created and is unused.
            unsafe { (lib.destroy_qp)(qp.as_ptr()) };
            return Err(Error::Unavailable {
                provider: "verbs",
                reason: "the driver has no post_send/post_recv".into(),
            });
        };
        let g = init.cap;
        let rings = Arc::new(QpRings { send: Mutex::new(WrRing::new(false)), recv: Mutex::new(WrRing::new(true)) });
        for cq in [scq, rcq] {
            cq.qps.lock().unwrap_or_else(|e| e.into_inner()).insert(qpn, rings.clone());
        }
        Ok(Arc::new(VerbsQp {
            pd: pd.clone(),
            qp,
            qpn,
            scq: scq.clone(),
            rcq: rcq.clone(),
            caps: QpCaps {
                // The HCA may grant deeper queues than asked; the caller sized
                // its CQs for what it asked, so that is the limit enforced.
                max_send_wr: c.max_send_wr.min(g.max_send_wr),
                max_recv_wr: c.max_recv_wr.min(g.max_recv_wr),
                max_send_sge: g.max_send_sge,
                max_recv_sge: g.max_recv_sge,
                max_inline_data: g.max_inline_data,
            },
            sq_sig_all: attr.sq_sig_all,
            psn: rand::random::<u32>() & 0x00ff_ffff,
            rings,
            local: Mutex::new(Local { state: QpState::Reset, port: pd.ctx.default_port() }),
            post_send_fn,
            post_recv_fn,
        }))
    }

    fn local(&self) -> std::sync::MutexGuard<'_, Local> {
        self.local.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn limits(&self) -> Limits {
        let a = &self.pd.ctx.attr;
        Limits {
            max_qp_rd_atom: a.max_qp_rd_atom.clamp(0, 255) as u8,
            max_qp_init_rd_atom: a.max_qp_init_rd_atom.clamp(0, 255) as u8,
        }
    }

    fn drop_outstanding(&self) {
        let s = self.rings.send.lock().unwrap_or_else(|e| e.into_inner()).clear();
        self.scq.release(s);
        let r = self.rings.recv.lock().unwrap_or_else(|e| e.into_inner()).clear();
        self.rcq.release(r);
    }

    /// The registrations an inline WR's SGEs lie in, or the error that
    /// refuses the WR.
    fn inline_sources(&self, sges: &[crate::wr::Sge]) -> Result<Vec<Arc<MrInner>>> {
        let table = self.pd.mrs.lock().unwrap_or_else(|e| e.into_inner());
        let mut keep = Vec::with_capacity(sges.len());
        for (i, s) in sges.iter().enumerate().filter(|(_, s)| s.length > 0) {
            match table.get(&s.lkey).and_then(|w| w.upgrade()) {
                Some(mr) if mr.covers(s.addr, s.length) => keep.push(mr),
                _ => {
                    return Err(Error::invalid(
                        "post_send",
                        format!(
                            "inline SGE {i} ({:#x}+{} bytes, lkey {:#x}) is not inside a registered host-memory \
                             region of this QP's PD with that lkey; inline data must come from registered memory",
                            s.addr, s.length, s.lkey
                        ),
                    ))
                }
            }
        }
        Ok(keep)
    }

    fn keepalive(&self, sges: &[crate::wr::Sge]) -> Vec<Arc<MrInner>> {
        let table = self.pd.mrs.lock().unwrap_or_else(|e| e.into_inner());
        sges.iter().filter(|s| s.length > 0).filter_map(|s| table.get(&s.lkey).and_then(|w| w.upgrade())).collect()
    }
}

impl Drop for VerbsQp {
    fn drop(&mut self) {
        // SAFETY: the QP is live and nobody else holds it (QpOps is behind
        // this value's Arc); destroying it stops its completions.
        let r = unsafe { (self.pd.ctx.lib.destroy_qp)(self.qp.as_ptr()) };
        if r != 0 {
            tracing::warn!(qpn = self.qpn, "ibv_destroy_qp failed: {}", io::Error::from_raw_os_error(r));
        }
        for cq in [&self.scq, &self.rcq] {
            let mut m = cq.qps.lock().unwrap_or_else(|e| e.into_inner());
            if m.get(&self.qpn).is_some_and(|r| Arc::ptr_eq(r, &self.rings)) {
                m.remove(&self.qpn);
            }
        }
        self.drop_outstanding();
    }
}

impl QpOps for VerbsQp {
    fn qp_num(&self) -> u32 {
        self.qpn
    }

    fn state(&self) -> QpState {
        let mut attr = ibv_qp_attr::default();
        // SAFETY: ibv_qp_init_attr is plain data; zero is valid.
        let mut init: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        // SAFETY: the QP is live; both out-pointers are valid.
        let r = unsafe { (self.pd.ctx.lib.query_qp)(self.qp.as_ptr(), &mut attr, IBV_QP_STATE, &mut init) };
        let mut l = self.local();
        if r == 0 {
            // The HCA moves a QP to ERR on its own (retry exhaustion, …).
            l.state = qp_state(attr.qp_state);
        }
        l.state
    }

    fn caps(&self) -> QpCaps {
        self.caps
    }

    fn endpoint(&self) -> Result<QpEndpoint> {
        let port = self.local().port;
        let ctx = &self.pd.ctx;
        let a = ctx.raw_port(port)?;
        let (_, gid) = ctx.source_gid(port)?;
        Ok(QpEndpoint {
            qpn: self.qpn,
            psn: self.psn,
            lid: a.lid,
            gid,
            mtu: 128u32 << a.active_mtu.clamp(1, 5),
            soft: None,
        })
    }

    fn modify(&self, t: &QpTransition) -> Result<()> {
        let from = self.state();
        if !t.allowed_from(from) {
            return Err(Error::state("modify_qp", format!("{from:?} → {:?} is not a verbs transition", t.target())));
        }
        let ctx = &self.pd.ctx;
        let bad = |e: String| Error::invalid("modify_qp", e);
        let (mut attr, mask) = match t {
            QpTransition::Init(a) => {
                let r = init_on(a, ctx.default_port()).map_err(bad)?;
                ctx.check_port(r.0.port_num)?;
                self.local().port = r.0.port_num;
                r
            }
            QpTransition::Rtr(a) => {
                let port = self.local().port;
                let p = ctx.raw_port(port)?;
                let sgid_index = if a.sgid_index != 0 { a.sgid_index } else { ctx.source_gid(port)?.0 };
                let local = LocalPort {
                    port_num: port,
                    link_layer: super::context::CtxShared::link_layer(&p),
                    active_mtu: ctx.port_attr(port)?.active_mtu,
                    sgid_index,
                };
                rtr_attr(a, &local, &self.limits()).map_err(bad)?
            }
            QpTransition::Rts(a) => rts_attr(a, self.psn, &self.limits()).map_err(bad)?,
            QpTransition::Err => state_attr(IBV_QPS_ERR),
            QpTransition::Reset => state_attr(IBV_QPS_RESET),
        };
        // SAFETY: the QP is live; attr/mask were built for this transition.
        let r = unsafe { (ctx.lib.modify_qp)(self.qp.as_ptr(), &mut attr, mask) };
        if r != 0 {
            return Err(Error::os("modify_qp", io::Error::from_raw_os_error(r)));
        }
        self.local().state = t.target();
        debug_assert_eq!(raw_state(t.target()), attr.qp_state);
        if matches!(t, QpTransition::Reset) {
            // RESET drops outstanding WRs without completions (the driver
            // also cleans their CQEs out of the CQs).
            self.drop_outstanding();
        }
        Ok(())
    }

    fn post_send(&self, wrs: &[SendWr<'_>]) -> Result<()> {
        if wrs.is_empty() {
            return Ok(());
        }
        let state = self.local().state;
        if !matches!(state, QpState::Rts | QpState::Sqd | QpState::Sqe | QpState::Err) {
            return Err(Error::state("post_send", format!("the QP is in {state:?}; connect it (RTS) first")));
        }
        for wr in wrs {
            check_send_wr(wr, &self.caps)?;
        }
        // libibverbs copies inline data from the SGE addresses themselves:
        // they must lie in a registration of this PD, held until the call
        // returns.
        let mut inline_keep = Vec::new();
        for wr in wrs.iter().filter(|w| w.flags.inline) {
            inline_keep.extend(self.inline_sources(wr.sg_list)?);
        }
        let mut ring = self.rings.send.lock().unwrap_or_else(|e| e.into_inner());
        if ring.len() + wrs.len() > self.caps.max_send_wr as usize {
            return Err(Error::exhausted(
                "post_send",
                format!(
                    "{} outstanding + {} new WRs exceed max_send_wr {}; poll the send CQ (and signal periodically)",
                    ring.len(),
                    wrs.len(),
                    self.caps.max_send_wr
                ),
            ));
        }
        let mut sges: Vec<ibv_sge> = Vec::with_capacity(wrs.iter().map(|w| w.sg_list.len()).sum());
        let mut hw: Vec<ibv_send_wr> = Vec::with_capacity(wrs.len());
        let mut counted = 0;
        for wr in wrs {
            let signaled = wr.flags.signaled || self.sq_sig_all;
            counted += signaled as usize;
            let keep = if wr.flags.inline { Vec::new() } else { self.keepalive(wr.sg_list) };
            let id = ring.push(wr.wr_id, wr.op.wc_opcode(), signaled, keep);
            hw.push(send_wr(wr, id, false));
            sges.extend(wr.sg_list.iter().map(|s| ibv_sge { addr: s.addr, length: s.length, lkey: s.lkey }));
        }
        // Chain the WRs and point them at their SGEs, all through one raw
        // pointer per vector (no reallocation or reborrow from here on, so
        // the pointers stay valid through the call).
        let (base, sbase) = (hw.as_mut_ptr(), sges.as_mut_ptr());
        // SAFETY: every index is below the vectors' lengths (`num_sge`s sum
        // to `sges.len()`).
        unsafe { link(base, hw.len(), sbase, |w| (*w).num_sge, |w, sg, next| ((*w).sg_list, (*w).next) = (sg, next)) };
        self.scq.reserve(counted);
        let mut bad: *mut ibv_send_wr = std::ptr::null_mut();
        // SAFETY: the QP is live; `base` is a valid chain whose SGE arrays
        // live in `sges`; inline SGEs were checked against registrations
        // held by `inline_keep`; the driver copies everything it needs
        // before returning.
        let r = unsafe { (self.post_send_fn)(self.qp.as_ptr(), base, &mut bad) };
        drop(inline_keep);
        if r != 0 {
            // SAFETY: the driver sets `bad` to an element of `hw`.
            let posted = if bad.is_null() { 0 } else { unsafe { bad.offset_from(hw.as_ptr()) }.max(0) as usize };
            let first_bad = hw.get(posted).map(|w| w.wr_id);
            if let Some(id) = first_bad {
                let undone = ring.unpost_from(id);
                self.scq.release(undone);
            }
            let e = io::Error::from_raw_os_error(r.abs());
            return Err(Error::os(
                "post_send",
                io::Error::new(e.kind(), format!("{e}; the first {posted} of {} WRs were posted", wrs.len())),
            ));
        }
        Ok(())
    }

    fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<()> {
        if wrs.is_empty() {
            return Ok(());
        }
        let state = self.local().state;
        if state == QpState::Reset {
            return Err(Error::state("post_recv", "the QP is in RESET; move it to INIT first"));
        }
        for wr in wrs {
            if wr.sg_list.len() > self.caps.max_recv_sge as usize {
                return Err(Error::invalid(
                    "post_recv",
                    format!("{} SGEs exceed max_recv_sge {}", wr.sg_list.len(), self.caps.max_recv_sge),
                ));
            }
        }
        let mut ring = self.rings.recv.lock().unwrap_or_else(|e| e.into_inner());
        if ring.len() + wrs.len() > self.caps.max_recv_wr as usize {
            return Err(Error::exhausted(
                "post_recv",
                format!(
                    "{} outstanding + {} new receives exceed max_recv_wr {}",
                    ring.len(),
                    wrs.len(),
                    self.caps.max_recv_wr
                ),
            ));
        }
        let mut sges: Vec<ibv_sge> = Vec::with_capacity(wrs.iter().map(|w| w.sg_list.len()).sum());
        let mut hw: Vec<ibv_recv_wr> = Vec::with_capacity(wrs.len());
        for wr in wrs {
            let id = ring.push(wr.wr_id, WcOpcode::Recv, true, self.keepalive(wr.sg_list));
            hw.push(ibv_recv_wr {
                wr_id: id,
                next: std::ptr::null_mut(),
                sg_list: std::ptr::null_mut(),
                num_sge: wr.sg_list.len() as i32,
            });
            sges.extend(wr.sg_list.iter().map(|s| ibv_sge { addr: s.addr, length: s.length, lkey: s.lkey }));
        }
        let (base, sbase) = (hw.as_mut_ptr(), sges.as_mut_ptr());
        // SAFETY: as in post_send.
        unsafe { link(base, hw.len(), sbase, |w| (*w).num_sge, |w, sg, next| ((*w).sg_list, (*w).next) = (sg, next)) };
        self.rcq.reserve(wrs.len());
        let mut bad: *mut ibv_recv_wr = std::ptr::null_mut();
        // SAFETY: the QP is live; `base` is a valid chain with SGEs in `sges`.
        let r = unsafe { (self.post_recv_fn)(self.qp.as_ptr(), base, &mut bad) };
        if r != 0 {
            // SAFETY: the driver sets `bad` to an element of `hw`.
            let posted = if bad.is_null() { 0 } else { unsafe { bad.offset_from(hw.as_ptr()) }.max(0) as usize };
            if let Some(id) = hw.get(posted).map(|w| w.wr_id) {
                let undone = ring.unpost_from(id);
                self.rcq.release(undone);
            }
            let e = io::Error::from_raw_os_error(r.abs());
            return Err(Error::os(
                "post_recv",
                io::Error::new(e.kind(), format!("{e}; the first {posted} of {} WRs were posted", wrs.len())),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wr::{SendFlags, Sge};

    fn sge(len: u32) -> Sge {
        Sge { addr: 0x1000, length: len, lkey: 7 }
    }

    #[test]
    fn send_wr_encoding() {
        let s = [sge(8)];
        let w = SendWr {
            wr_id: 1,
            op: SendOp::RdmaWriteWithImm { remote_addr: 0xdead_0000, rkey: 0x42, imm: 0x0102_0304 },
            sg_list: &s,
            flags: SendFlags { signaled: true, inline: true, fence: true },
        };
        let h = send_wr(&w, 99, false);
        assert_eq!(h.wr_id, 99);
        assert_eq!(h.opcode, IBV_WR_RDMA_WRITE_WITH_IMM);
        assert_eq!(h.send_flags, IBV_SEND_SIGNALED | IBV_SEND_INLINE | IBV_SEND_FENCE);
        assert_eq!(h.imm_data.to_ne_bytes(), [1, 2, 3, 4], "immediate data goes in network byte order");
        // SAFETY: the rdma member was written.
        let rdma = unsafe { h.wr.rdma };
        assert_eq!((rdma.remote_addr, rdma.rkey), (0xdead_0000, 0x42));
        assert_eq!(h.num_sge, 1);

        let w = SendWr {
            wr_id: 2,
            op: SendOp::Atomic { remote_addr: 8, rkey: 5, op: AtomicOp::CompareSwap { compare: 3, swap: 4 } },
            sg_list: &s,
            flags: SendFlags::UNSIGNALED,
        };
        let h = send_wr(&w, 0, true);
        assert_eq!(h.opcode, IBV_WR_ATOMIC_CMP_AND_SWP);
        assert_eq!(h.send_flags, IBV_SEND_SIGNALED);
        // SAFETY: the atomic member was written.
        let a = unsafe { h.wr.atomic };
        assert_eq!((a.remote_addr, a.compare_add, a.swap, a.rkey), (8, 3, 4, 5));
    }

    #[test]
    fn malformed_wrs_are_refused_before_posting() {
        let caps = QpCaps { max_send_sge: 2, max_inline_data: 16, ..QpCaps::default() };
        let three = [sge(1), sge(1), sge(1)];
        let w = |op, sg: &'static [Sge], inline| SendWr {
            wr_id: 0,
            op,
            sg_list: sg,
            flags: SendFlags { inline, ..SendFlags::SIGNALED },
        };
        let leak = |v: Vec<Sge>| -> &'static [Sge] { Box::leak(v.into_boxed_slice()) };
        assert!(check_send_wr(&w(SendOp::Send, leak(three.to_vec()), false), &caps).is_err());
        assert!(check_send_wr(&w(SendOp::Send, leak(vec![sge(17)]), true), &caps).is_err());
        assert!(check_send_wr(&w(SendOp::Send, leak(vec![sge(16)]), true), &caps).is_ok());
        let read = SendOp::RdmaRead { remote_addr: 0, rkey: 0 };
        assert!(check_send_wr(&w(read, leak(vec![sge(8)]), true), &caps).is_err());
        let fa = |addr| SendOp::Atomic { remote_addr: addr, rkey: 0, op: AtomicOp::FetchAdd { add: 1 } };
        assert!(check_send_wr(&w(fa(8), leak(vec![sge(8)]), false), &caps).is_ok());
        assert!(check_send_wr(&w(fa(8), leak(vec![sge(4)]), false), &caps).is_err());
        assert!(check_send_wr(&w(fa(4), leak(vec![sge(8)]), false), &caps).is_err());
    }

    /// `RMACOMM_IB_HCA=mlx5_0:2` makes 2 the context's default port: a QP
    /// moved to INIT with default attributes must use it, not port 1.
    #[test]
    fn default_init_attributes_use_the_contexts_port() {
        let (a, _) = init_on(&InitAttr::default(), 2).unwrap();
        assert_eq!(a.port_num, 2);
        let (a, _) = init_on(&InitAttr { port_num: 1, ..InitAttr::default() }, 2).unwrap();
        assert_eq!(a.port_num, 1, "an explicit port wins");
    }

    #[test]
    fn states_round_trip() {
        for s in [QpState::Reset, QpState::Init, QpState::Rtr, QpState::Rts, QpState::Sqd, QpState::Sqe, QpState::Err] {
            assert_eq!(qp_state(raw_state(s)), s);
        }
    }
}
