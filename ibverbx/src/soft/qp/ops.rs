//! The verbs a soft QP answers ([`QpOps`]): its endpoint, `modify` (the
//! state machine), `post_send` / `post_recv`, and the checks and copies
//! posting makes before a WR is queued.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use tokio::sync::mpsc;

use super::{RecvEntry, SoftQp, SqEntry};
use crate::endpoint::QpEndpoint;
use crate::provider::QpOps;
use crate::qp_attr::{QpCaps, QpState, QpTransition, RtsAttr};
use crate::soft::address::SoftAddress;
use crate::soft::mr::{LocalSeg, Target};
use crate::wr::{RecvWr, SendOp, SendWr};
use crate::{AccessFlags, Error, Gid, Result};

impl SoftQp {
    fn resolve(&self, sges: &[crate::Sge]) -> Vec<LocalSeg> {
        sges.iter()
            .map(|s| LocalSeg {
                mr: if s.length == 0 { None } else { self.ctx.mr(s.lkey) },
                addr: s.addr,
                len: s.length,
            })
            .collect()
    }

    /// Copies an inline WR's data. Its SGEs must lie in live regions of
    /// this QP's PD named by their lkeys: inline data is read by the
    /// library, so an unchecked address would let safe code read any memory.
    fn copy_inline(&self, sges: &[crate::Sge], len: u64) -> Result<Vec<u8>> {
        let mut data: Vec<u8> = Vec::with_capacity(len as usize);
        for (i, s) in sges.iter().enumerate() {
            if s.length == 0 {
                continue;
            }
            let mr = self.ctx.mr(s.lkey);
            let t = mr.as_ref().and_then(|mr| mr.target(self.pd, s.addr, s.length as u64, AccessFlags::empty()));
            if let Some(Target::Device(dev, a)) = &t {
                let at = data.len();
                data.resize(at + s.length as usize, 0);
                // SAFETY: the SGE was just checked against a live region
                // on `dev`, held by `mr`.
                unsafe { dev.read(*a, &mut data[at..]) }.map_err(|e| {
                    Error::state("post_send", format!("inline SGE {i}: copy from {} failed: {e}", dev.describe()))
                })?;
                continue;
            }
            let Some(Target::Host(p)) = t else {
                return Err(Error::invalid(
                    "post_send",
                    format!(
                        "inline SGE {i} ({:#x}+{} bytes, lkey {:#x}) is not inside a registered region of this \
                         QP's PD with that lkey; inline data must come from registered memory",
                        s.addr, s.length, s.lkey
                    ),
                ));
            };
            let n = s.length as usize;
            let at = data.len();
            // SAFETY: p..p+n was just checked against a live region held by
            // `mr`; the destination has room (capacity is the sum of the
            // SGE lengths). Copied through raw pointers: peers may write the
            // region concurrently, so it is never borrowed as a slice.
            unsafe {
                std::ptr::copy_nonoverlapping(p as *const u8, data.as_mut_ptr().add(at), n);
                data.set_len(at + n);
            }
        }
        Ok(data)
    }

    fn check_send_wr(&self, wr: &SendWr<'_>) -> Result<u64> {
        if wr.sg_list.len() > self.caps.max_send_sge as usize {
            return Err(Error::invalid(
                "post_send",
                format!("{} SGEs exceed max_send_sge {}", wr.sg_list.len(), self.caps.max_send_sge),
            ));
        }
        let len: u64 = wr.sg_list.iter().map(|s| s.length as u64).sum();
        if len > self.ctx.config.max_msg_size as u64 {
            return Err(Error::invalid(
                "post_send",
                format!("message of {len} bytes exceeds max_msg_sz {}", self.ctx.config.max_msg_size),
            ));
        }
        if wr.flags.inline {
            if len > self.caps.max_inline_data as u64 {
                return Err(Error::invalid(
                    "post_send",
                    format!("{len} inline bytes exceed max_inline_data {}", self.caps.max_inline_data),
                ));
            }
            if matches!(wr.op, SendOp::RdmaRead { .. } | SendOp::Atomic { .. }) {
                return Err(Error::invalid("post_send", "RDMA READ and atomics cannot be inline"));
            }
        }
        if let SendOp::Atomic { remote_addr, .. } = wr.op {
            if wr.sg_list.len() != 1 || wr.sg_list[0].length != 8 {
                return Err(Error::invalid("post_send", "an atomic needs exactly one 8-byte SGE"));
            }
            if remote_addr % 8 != 0 {
                return Err(Error::invalid(
                    "post_send",
                    format!("atomic address {remote_addr:#x} is not 8-byte aligned"),
                ));
            }
        }
        Ok(len)
    }
}

impl SoftQp {
    /// `len` bytes at `addr` of the peer's region `rkey` mapped here, or
    /// (`None`) the whole region holding `addr`; once connected.
    fn map_peer(&self, rkey: u32, addr: u64, len: Option<u64>) -> crate::provider::MapRemoteFuture {
        let mut rx = self.map_target.subscribe();
        Box::pin(async move {
            let target = loop {
                if let Some(t) = rx.borrow_and_update().clone() {
                    break t;
                }
                if rx.changed().await.is_err() {
                    return Ok(None);
                }
            };
            match target {
                Some(t) => crate::RemoteMapping::map(t, rkey, addr, len).await,
                None => Ok(None),
            }
        })
    }
}

impl QpOps for SoftQp {
    fn qp_num(&self) -> u32 {
        self.qpn
    }

    fn map_remote(&self, rkey: u32, addr: u64, len: u64) -> crate::provider::MapRemoteFuture {
        self.map_peer(rkey, addr, Some(len))
    }

    fn map_remote_region(&self, rkey: u32, addr: u64) -> crate::provider::MapRemoteFuture {
        self.map_peer(rkey, addr, None)
    }

    fn state(&self) -> QpState {
        self.lock().state
    }

    fn caps(&self) -> QpCaps {
        self.caps
    }

    fn endpoint(&self) -> Result<QpEndpoint> {
        let ctx = &self.ctx;
        Ok(QpEndpoint {
            qpn: self.qpn,
            psn: 0,
            lid: 0,
            gid: match ctx.tcp_addrs.first().map(|a| a.ip()) {
                Some(std::net::IpAddr::V4(v4)) => Gid::from_ipv4(v4),
                _ => Gid::default(),
            },
            mtu: 4096,
            soft: Some(SoftAddress {
                host: ctx.host.clone(),
                pid: ctx.pid,
                ctx_uid: ctx.uid,
                tcp: ctx.tcp_addrs.clone(),
                unix: ctx.unix_name.clone(),
                keytable_fd: -1,
                keytable_uid: ctx.keytable.uid(),
                pd: self.pd,
                token: self.token,
                doorbell_fd: -1,
                doorbell_uid: ctx.doorbells.as_ref().map_or(0, |t| t.uid()),
                doorbell_slot: self.db.as_ref().map_or(0, |d| d.index),
                fence_uid: ctx.fences.uid(),
            }),
        })
    }

    fn modify(&self, t: &QpTransition) -> Result<()> {
        let mut st = self.lock();
        if !t.allowed_from(st.state) {
            return Err(Error::state(
                "modify_qp",
                format!("{:?} → {:?} is not a valid transition", st.state, t.target()),
            ));
        }
        match t {
            QpTransition::Init(a) => {
                st.access = a.access;
            }
            QpTransition::Rtr(a) => {
                if a.remote.soft.is_none() {
                    return Err(Error::invalid("modify_qp(RTR)", "the remote endpoint is not a soft-provider QP"));
                }
                st.rtr = Some(a.clone());
            }
            QpTransition::Rts(a) => {
                // Verbs' range (a 3-bit field): 7 means retry forever. A
                // larger count was taken as is by the requester, as "7" by
                // the responder it told.
                if a.retry_cnt > 7 || a.rnr_retry > 7 {
                    return Err(Error::invalid(
                        "modify_qp(RTS)",
                        format!(
                            "retry_cnt {} / rnr_retry {} must be 0..=7 (7: retry forever)",
                            a.retry_cnt, a.rnr_retry
                        ),
                    ));
                }
                if st.sq_tx.is_none() {
                    let rtr = st.rtr.clone().expect("RTR precedes RTS");
                    let (tx, rx) = mpsc::unbounded_channel();
                    st.sq_tx = Some(tx);
                    st.sq_backlog = Arc::default();
                    let backlog = st.sq_backlog.clone();
                    let me =
                        self.ctx.qps.lock().unwrap_or_else(|e| e.into_inner()).get(&self.qpn).and_then(|w| w.upgrade());
                    let me = me.ok_or_else(|| Error::state("modify_qp(RTS)", "QP is being destroyed"))?;
                    let rts: RtsAttr = *a;
                    let life = self.epoch();
                    self.ctx.rt.spawn(crate::soft::requester::run(me, rx, backlog, (rtr, rts), life));
                }
            }
            QpTransition::Err => {
                drop(st);
                self.set_error("modify_qp(ERR)");
                return Ok(());
            }
            QpTransition::Reset => {
                self.epoch.fetch_add(1, Ordering::AcqRel);
                // Every outstanding WR is dropped without a completion: the
                // whole send queue is free for the next life (the last
                // life's tasks no longer release slots: `emit`).
                self.sq_outstanding.store(0, Ordering::Release);
                st.sq_tx = None;
                st.rtr = None;
                st.state = QpState::Reset;
                drop(st);
                self.set_fast(None);
                self.map_target.send_replace(None);
                self.db_open(false);
                if let Some(db) = &self.db {
                    crate::soft::doorbell_proto::new_life(db.slot.get());
                }
                self.state_tx.send_replace(QpState::Reset);
                self.rq.lock().unwrap_or_else(|e| e.into_inner()).clear();
                self.db_note_rq(0);
                self.rq_notify.notify_waiters();
                return Ok(());
            }
        }
        st.state = t.target();
        let s = st.state;
        drop(st);
        if matches!(s, QpState::Rtr | QpState::Rts) {
            self.db_open(true);
        }
        self.state_tx.send_replace(s);
        Ok(())
    }

    fn post_send(&self, wrs: &[SendWr<'_>]) -> Result<()> {
        /// Outstanding WRs behind which the posting thread still writes a
        /// small request itself (a put, then its signal); deeper pipelines
        /// go through the engine, which sends while the poster posts.
        const FAST_BEHIND: u32 = 4;
        let mut lens = Vec::with_capacity(wrs.len());
        for wr in wrs {
            lens.push(self.check_send_wr(wr)?);
        }
        let st = self.lock();
        let st_is_rts = st.state == QpState::Rts;
        let tx = match (st.state, &st.sq_tx) {
            (QpState::Rts | QpState::Err, Some(tx)) => tx.clone(),
            (s, _) => {
                return Err(Error::state("post_send", format!("QP {:#x} is in {s:?}; it must be in RTS", self.qpn)))
            }
        };
        let backlog = st.sq_backlog.clone();
        drop(st);
        let n = wrs.len() as u32;
        // A doorbell WR the peer has claimed but nobody has polled for yet
        // finishes here, so that this WR finds the QP idle.
        if n == 1 && st_is_rts && self.db_tx_pending.load(Ordering::Acquire) > 0 {
            self.db_check_tx();
        }
        if n == 1 && st_is_rts && self.sq_outstanding.load(Ordering::Acquire) == 0 {
            if self.try_fast(&wrs[0], lens[0]) {
                return Ok(());
            }
            // Claim the only slot, then try to send the notification here.
            if self.sq_outstanding.compare_exchange(0, 1, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                if self.try_doorbell(&wrs[0], lens[0]) || self.try_fast_notify(&wrs[0], lens[0], true) {
                    return Ok(());
                }
                self.sq_release(1);
            }
        } else if n == 1
            && st_is_rts
            && self.sq_outstanding.load(Ordering::Acquire) < FAST_BEHIND
            && backlog.load(Ordering::Acquire) == 0
        {
            // The few earlier WRs are all on the wire (awaiting their
            // responses): over tcp the next small request may follow them
            // from here.
            let before = self.sq_outstanding.fetch_add(1, Ordering::AcqRel);
            if before < self.caps.max_send_wr && self.try_fast_notify(&wrs[0], lens[0], false) {
                return Ok(());
            }
            self.sq_release(1);
        }
        let before = self.sq_outstanding.fetch_add(n, Ordering::AcqRel);
        if before + n > self.caps.max_send_wr {
            self.sq_release(n);
            return Err(Error::exhausted(
                "post_send",
                format!("send queue full: {before} outstanding, max_send_wr {}", self.caps.max_send_wr),
            ));
        }
        // Every entry is built (inline data copied out of checked regions)
        // before the first is queued, so that a bad inline SGE posts nothing.
        let mut entries = Vec::with_capacity(wrs.len());
        for (wr, len) in wrs.iter().zip(lens) {
            let (segs, inline) = if wr.flags.inline {
                match self.copy_inline(wr.sg_list, len) {
                    Ok(data) => (Vec::new(), Some(data)),
                    Err(e) => {
                        self.sq_release(n);
                        return Err(e);
                    }
                }
            } else {
                (self.resolve(wr.sg_list), None)
            };
            entries.push(SqEntry {
                wr_id: wr.wr_id,
                op: wr.op,
                segs,
                inline,
                signaled: wr.flags.signaled || self.sq_sig_all,
                fence: wr.flags.fence,
                len,
            });
        }
        for e in entries {
            backlog.fetch_add(1, Ordering::AcqRel);
            if let Err(mpsc::error::SendError(e)) = tx.send(e) {
                // The engine is gone (context shutting down): flush.
                backlog.fetch_sub(1, Ordering::AcqRel);
                self.sq_release(1);
                self.push_send_wc(self.flush_wc(e.wr_id, e.op.wc_opcode()));
            }
        }
        Ok(())
    }

    fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<()> {
        // The state and the life (the epoch moves under the same lock).
        let (state, life) = {
            let st = self.lock();
            (st.state, self.epoch())
        };
        if state == QpState::Reset {
            return Err(Error::state("post_recv", format!("QP {:#x} is in RESET; move it to INIT first", self.qpn)));
        }
        for wr in wrs {
            if wr.sg_list.len() > self.caps.max_recv_sge as usize {
                return Err(Error::invalid(
                    "post_recv",
                    format!("{} SGEs exceed max_recv_sge {}", wr.sg_list.len(), self.caps.max_recv_sge),
                ));
            }
        }
        let mut rq = self.rq.lock().unwrap_or_else(|e| e.into_inner());
        if self.epoch() != life {
            // A reset came since the check above (and cleared the queue
            // under this lock): these would be a later life's receives.
            return Err(Error::state(
                "post_recv",
                format!("QP {:#x} was reset while these receives were posted; none was posted", self.qpn),
            ));
        }
        if rq.len() + wrs.len() > self.caps.max_recv_wr as usize {
            return Err(Error::exhausted(
                "post_recv",
                format!("receive queue full: {} posted, max_recv_wr {}", rq.len(), self.caps.max_recv_wr),
            ));
        }
        for wr in wrs {
            rq.push_back(RecvEntry { wr_id: wr.wr_id, segs: self.resolve(wr.sg_list) });
        }
        self.db_note_rq(rq.len());
        // The state as of now, under the RQ lock: an error published since
        // the check above flushed the queue before these were in it
        // (flush_rq_in takes this lock after publishing), so they are
        // flushed here.
        let err = *self.state_tx.borrow() == QpState::Err;
        drop(rq);
        if err {
            self.flush_rq();
        } else {
            self.rq_notify.notify_waiters();
        }
        Ok(())
    }
}
