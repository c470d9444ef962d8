//! The posting thread's path ([`FastPath`]): WRs run or sent from the
//! thread that posts them on an idle QP (direct copies to a same-host peer,
//! small requests on the connection, doorbell records), and the send CQ's
//! hooks into those doorbell WRs.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::SoftQp;
use crate::wc::{WcStatus, WorkCompletion};
use crate::wr::{SendOp, SendWr};
use crate::AccessFlags;

/// What the posting thread needs to copy directly to a same-host peer
/// (`peer`), or to write small requests on the connection itself.
#[derive(Debug)]
pub(crate) struct FastPath {
    /// The same-host peer's mapped tables; `None` over TCP.
    pub(crate) peer: Option<Arc<crate::soft::peer::PeerMap>>,
    pub(crate) remote_pd: u32,
    /// Sending notifications from the posting thread (unix-socket links).
    pub(crate) notify: Option<Arc<crate::soft::requester::FastNotify>>,
}

impl SoftQp {
    pub(crate) fn set_fast(&self, f: Option<FastPath>) {
        *self.fast.write().unwrap_or_else(|e| e.into_inner()) = f.map(Arc::new);
    }

    /// Runs a small same-host WRITE/READ/atomic in the calling thread when
    /// nothing else is outstanding (so order is kept). Returns false when
    /// the WR must go through the progress engine instead; errors always do,
    /// so that error handling lives in one place.
    pub(super) fn try_fast(&self, wr: &SendWr<'_>, len: u64) -> bool {
        use crate::soft::peer::Direct;
        use crate::wr::AtomicOp;
        if len as usize > self.ctx.config.inline_copy_max || self.ctx.config.chaos_seed.is_some() {
            return false;
        }
        let (raddr, rkey, need) = match wr.op {
            SendOp::RdmaWrite { remote_addr, rkey } => (remote_addr, rkey, AccessFlags::REMOTE_WRITE),
            SendOp::RdmaRead { remote_addr, rkey } => (remote_addr, rkey, AccessFlags::REMOTE_READ),
            SendOp::Atomic { remote_addr, rkey, .. } => (remote_addr, rkey, AccessFlags::REMOTE_ATOMIC),
            _ => return false,
        };
        if len == 0 || wr.flags.fence {
            return false;
        }
        let Some(fast) = self.fast.read().unwrap_or_else(|e| e.into_inner()).clone() else { return false };
        let local_need = wr.op.local_access();
        // Local pieces, inline ones included: their keys and bounds are
        // checked (and the regions held) before anything reads them.
        let mut local: [(usize, usize); 16] = [(0, 0); 16];
        let mut _keep: [Option<Arc<crate::soft::mr::SoftMr>>; 16] = Default::default();
        for (i, s) in wr.sg_list.iter().enumerate() {
            let Some(mr) = self.ctx.mr(s.lkey) else { return false };
            let Some(p) = mr.check(self.pd, s.addr, s.length as u64, local_need) else { return false };
            local[i] = (p as usize, s.length as usize);
            _keep[i] = Some(mr);
        }
        let local = &local[..wr.sg_list.len()];
        let Some(peer) = &fast.peer else { return false };
        let Ok(Direct::Ptr(p, _map)) = peer.resolve(fast.remote_pd, rkey, raddr, len, need) else { return false };
        if !crate::soft::inline_budget::take(len) {
            return false;
        }
        self.ctx.inline_copied.fetch_add(len, Ordering::Relaxed);
        let mut off = 0;
        match wr.op {
            SendOp::RdmaWrite { .. } => {
                let stream = self.stream.observe(raddr, len);
                for &(l, n) in local {
                    // SAFETY: l..l+n is a checked live local region (or the
                    // caller's inline buffer); p+off..p+off+n lies in the
                    // peer's checked, mapped region.
                    unsafe { crate::soft::copy::copy((p + off) as *mut u8, l as *const u8, n, stream) };
                    off += n;
                }
            }
            SendOp::RdmaRead { .. } => {
                let stream = self.stream.observe(raddr, len);
                for &(l, n) in local {
                    // SAFETY: as above, direction reversed.
                    unsafe { crate::soft::copy::copy(l as *mut u8, (p + off) as *const u8, n, stream) };
                    off += n;
                }
            }
            SendOp::Atomic { op, .. } => {
                // SAFETY: 8-byte aligned (checked at post) inside the mapped
                // peer region; every soft atomic on it uses AtomicU64.
                let cell = unsafe { &*(p as *const std::sync::atomic::AtomicU64) };
                let orig = match op {
                    AtomicOp::FetchAdd { add } => cell.fetch_add(add, Ordering::AcqRel),
                    AtomicOp::CompareSwap { compare, swap } => {
                        match cell.compare_exchange(compare, swap, Ordering::AcqRel, Ordering::Acquire) {
                            Ok(v) | Err(v) => v,
                        }
                    }
                };
                // SAFETY: local[0] is the checked 8-byte result buffer.
                unsafe { std::ptr::write_unaligned(local[0].0 as *mut u64, orig) };
            }
            _ => unreachable!("filtered above"),
        }
        if wr.flags.signaled || self.sq_sig_all {
            self.push_send_wc(WorkCompletion {
                wr_id: wr.wr_id,
                status: WcStatus::Success,
                opcode: wr.op.wc_opcode(),
                byte_len: len as u32,
                imm_data: None,
                qp_num: self.qpn,
                vendor_err: 0,
            });
        }
        true
    }

    /// Requests sent by the posting thread on an idle QP: same host,
    /// WRITE_WITH_IMM (data copied directly, then the notify); over TCP,
    /// small WRITEs and WRITE_WITH_IMMs with their payload; on both, small
    /// SENDs. False when the WR must go through the engine (nothing has
    /// been sent then; a direct copy already made is simply made again).
    ///
    /// Not `idle` (earlier WRs await their responses, all of them on the
    /// wire): over tcp only, and only requests that carry their payload in
    /// the frame (so that they are placed after the earlier ones, in wire
    /// order), never a direct copy.
    pub(super) fn try_fast_notify(&self, wr: &SendWr<'_>, len: u64, idle: bool) -> bool {
        use crate::soft::requester::FastWr;
        use crate::soft::wire::Frame;
        if self.ctx.config.chaos_seed.is_some() || wr.flags.fence {
            return false;
        }
        let Some(fast) = self.fast.read().unwrap_or_else(|e| e.into_inner()).clone() else { return false };
        // Same host, earlier WRs may be direct copies or doorbell records
        // still to settle, which a frame written here would overtake.
        if !idle && fast.peer.is_some() {
            return false;
        }
        let Some(notify) = fast.notify.clone() else { return false };
        let mut local: [(usize, usize); 16] = [(0, 0); 16];
        let mut _keep: [Option<Arc<crate::soft::mr::SoftMr>>; 16] = Default::default();
        if !self.local_pieces(wr, &mut local, &mut _keep) {
            return false;
        }
        let local = &local[..wr.sg_list.len()];
        let (frame, payload): (Frame, &[(usize, usize)]) = match wr.op {
            SendOp::RdmaWrite { remote_addr, rkey } | SendOp::RdmaWriteWithImm { remote_addr, rkey, .. }
                if fast.peer.is_none() && len <= 4096 =>
            {
                let imm = match wr.op {
                    SendOp::RdmaWriteWithImm { imm, .. } => Some(imm),
                    _ => None,
                };
                (Frame::Write { psn: 0, raddr: remote_addr, rkey, len: len as u32, imm }, local)
            }
            SendOp::RdmaWriteWithImm { remote_addr, rkey, imm } => {
                if !idle
                    || len as usize > self.ctx.config.inline_copy_max
                    || !copy_direct(&fast, local, remote_addr, rkey, len, &self.stream)
                {
                    return false;
                }
                (Frame::Notify { psn: 0, len: len as u32, imm }, &[])
            }
            SendOp::Send | SendOp::SendWithImm { .. } if len <= 4096 => {
                let imm = match wr.op {
                    SendOp::SendWithImm { imm } => Some(imm),
                    _ => None,
                };
                (Frame::Send { psn: 0, len: len as u32, imm }, local)
            }
            _ => return false,
        };
        notify.try_send(FastWr {
            wr_id: wr.wr_id,
            opcode: wr.op.wc_opcode(),
            signaled: wr.flags.signaled || self.sq_sig_all,
            byte_len: len as u32,
            frame,
            payload,
        })
    }

    /// The local pieces of a WR about to be sent by the posting thread:
    /// checked registrations (kept alive in `keep`), for inline WRs too.
    fn local_pieces(
        &self,
        wr: &SendWr<'_>,
        local: &mut [(usize, usize); 16],
        keep: &mut [Option<Arc<crate::soft::mr::SoftMr>>; 16],
    ) -> bool {
        for (i, s) in wr.sg_list.iter().enumerate() {
            if s.length == 0 {
                local[i] = (s.addr as usize, 0);
                continue;
            }
            let Some(mr) = self.ctx.mr(s.lkey) else { return false };
            let Some(p) = mr.check(self.pd, s.addr, s.length as u64, AccessFlags::empty()) else { return false };
            local[i] = (p as usize, s.length as usize);
            keep[i] = Some(mr);
        }
        true
    }

    /// WRITE_WITH_IMM on an idle same-host QP through the peer QP's
    /// doorbell: data copied here, the notification left in shared memory
    /// for the peer's CQ poll (see `doorbell.rs`). False when the WR must
    /// take another path (nothing is published then).
    pub(super) fn try_doorbell(&self, wr: &SendWr<'_>, len: u64) -> bool {
        let SendOp::RdmaWriteWithImm { remote_addr, rkey, imm } = wr.op else { return false };
        if self.ctx.config.chaos_seed.is_some() || wr.flags.fence || len as usize > self.ctx.config.inline_copy_max {
            return false;
        }
        let Some(fast) = self.fast.read().unwrap_or_else(|e| e.into_inner()).clone() else { return false };
        let Some(notify) = fast.notify.clone() else { return false };
        if !notify.doorbell_ready() {
            return false;
        }
        let mut local: [(usize, usize); 16] = [(0, 0); 16];
        let mut _keep: [Option<Arc<crate::soft::mr::SoftMr>>; 16] = Default::default();
        if !self.local_pieces(wr, &mut local, &mut _keep)
            || !copy_direct(&fast, &local[..wr.sg_list.len()], remote_addr, rkey, len, &self.stream)
        {
            return false;
        }
        notify.post_doorbell(wr.wr_id, wr.op.wc_opcode(), wr.flags.signaled || self.sq_sig_all, len as u32, imm)
    }

    fn fast_notify(&self) -> Option<Arc<crate::soft::requester::FastNotify>> {
        self.fast.read().unwrap_or_else(|e| e.into_inner()).as_ref().and_then(|f| f.notify.clone())
    }

    /// Completes this QP's doorbell WRs that the peer has claimed.
    pub(crate) fn db_check_tx(&self) {
        if self.db_tx_pending.load(Ordering::Acquire) == 0 {
            return;
        }
        if let Some(n) = self.fast_notify() {
            n.check_doorbell();
        }
    }

    /// This QP's send CQ is being armed: the peer rings it when it claims.
    pub(crate) fn db_arm_tx(&self) {
        if self.db_tx_pending.load(Ordering::Acquire) == 0 {
            return;
        }
        if let Some(n) = self.fast_notify() {
            n.arm_doorbell();
        }
    }
}

/// Copies the local pieces straight into the peer's memory at
/// `remote_addr` (checked against its key table); false when there is no
/// direct path (nothing copied then).
fn copy_direct(
    fast: &FastPath,
    local: &[(usize, usize)],
    remote_addr: u64,
    rkey: u32,
    len: u64,
    stream: &crate::soft::copy::StreamDetector,
) -> bool {
    use crate::soft::peer::Direct;
    if len == 0 {
        return true;
    }
    let Some(peer) = &fast.peer else { return false };
    let Ok(Direct::Ptr(p, _map)) = peer.resolve(fast.remote_pd, rkey, remote_addr, len, AccessFlags::REMOTE_WRITE)
    else {
        return false;
    };
    if !crate::soft::inline_budget::take(len) {
        return false;
    }
    let stream = stream.observe(remote_addr, len);
    let mut off = 0;
    for &(l, n) in local {
        // SAFETY: l..l+n is a checked live local region (or the caller's
        // inline buffer); p+off.. lies in the peer's checked, mapped region.
        unsafe { crate::soft::copy::copy((p + off) as *mut u8, l as *const u8, n, stream) };
        off += n;
    }
    true
}
