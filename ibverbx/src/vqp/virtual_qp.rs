//! The virtual QP: N physical RC QPs (plus a notify QP) that behave as one.
//! The driver around the sans-IO planner, tracker and aggregators.

use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use super::aggregator::{CompletionAggregator, Part};
use super::config::{LoadBalancing, VirtualQpConfig};
use super::dqplb::{next_seq, DqplbImm, SeqTracker, TrackerError, SEQ_BITS};
use super::endpoint::VirtualQpEndpoint;
use super::planner::{fragments, FragmentPlanner, Lane};
use super::recv_order::RecvSequencer;
use super::virtual_cq::VirtualCq;
use crate::{
    Error, InitAttr, ProtectionDomain, QpCaps, QpInitAttr, QpTransition, QueuePair, RecvWr, Result, SendFlags, SendOp,
    SendWr, Sge, WcOpcode, WcStatus, WorkCompletion,
};

/// A virtual queue pair: one RC connection striped over `total_qps`
/// physical QPs.
///
/// - RDMA WRITE, WRITE_WITH_IMM and READ longer than `max_msg_size` are cut
///   into fragments spread round-robin over the data QPs that have room
///   (`max_msg_cnt_per_qp` outstanding each); the rest waits in a pending
///   queue and is posted as completions free room (in
///   [`VirtualCq::poll`]).
/// - SEND, SEND_WITH_IMM and atomics go unchanged on the *control* QP: the
///   notify QP when there is more than one data QP, else data QP 0. The
///   application's receives ([`post_recv`](Self::post_recv)) live there
///   too; an incoming virtual WRITE_WITH_IMM consumes one, as in verbs.
/// - DQPLB: every fragment is a WRITE_WITH_IMM carrying a sequence number;
///   the application's immediate follows at once as a zero-byte
///   WRITE_WITH_IMM on the notify QP, and the receiver releases it when the
///   message's fragments have all arrived.
/// - Spray: fragments are plain WRITEs; once their send completions are all
///   back, a zero-byte WRITE_WITH_IMM carrying the application's immediate
///   goes on the notify QP. Notifies of several messages may be in flight.
/// - With one data QP, RC ordering already holds: fragments go in order on
///   that QP and the last one carries the immediate.
///
/// Virtual completions (on the [`VirtualCq`]) come in posting order for
/// sends and message order for receives, once each. The first error moves
/// every physical QP to the error state: everything outstanding or queued
/// completes with `WrFlushErr`, the failing WR with its own status.
///
/// Posting never blocks: [`post_send`](Self::post_send) queues what finds no
/// room, so an async driver only needs to wake on the CQ's channel.
pub struct VirtualQp {
    shared: Arc<VqpShared>,
    cq: VirtualCq,
}

pub(crate) struct VqpShared {
    st: Mutex<State>,
    qp_num: u32,
    qpns: Vec<u32>,
    reserved: usize,
}

/// Bytes one `pump` (a post, or the completions that free QPs) may copy
/// in the calling thread on the soft provider's same-host path: one
/// fragment of the default size.
const PUMP_INLINE_BUDGET: usize = 1 << 20;

/// A physical send WR waiting in the planner.
#[derive(Debug)]
struct PhysOp {
    vid: u64,
    part: Part,
    op: SendOp,
    sges: Vec<Sge>,
    inline: bool,
    fence: bool,
}

struct State {
    cfg: VirtualQpConfig,
    qps: Vec<QueuePair>,
    ctrl: usize,
    planner: FragmentPlanner<PhysOp>,
    agg: CompletionAggregator,
    recv: RecvSequencer,
    tracker: Option<SeqTracker>,
    next_seq: u32,
    connected: bool,
    error: Option<(WcStatus, String)>,
    qp_num: u32,
    stats: VirtualQpStats,
    /// The device's largest message (`max_msg_sz`): no physical WR may be
    /// longer.
    device_max_msg: u32,
    /// The smallest `max_inline_data` the physical QPs were granted.
    max_inline: u32,
}

/// Counters of a virtual QP, for tests and tuning.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct VirtualQpStats {
    /// Physical send WRs posted.
    pub physical_posted: u64,
    /// DQPLB fragments received.
    pub fragments_received: u64,
    /// DQPLB fragments that arrived ahead of an earlier missing one.
    pub fragments_out_of_order: u64,
    /// Most fragments the DQPLB tracker held beyond a hole at once.
    pub max_held: usize,
}

fn encode_wr_id(vid: u64, part: Part) -> u64 {
    (vid << 1) | u64::from(part == Part::Control)
}

fn decode_wr_id(wr_id: u64) -> (u64, Part) {
    (wr_id >> 1, if wr_id & 1 == 1 { Part::Control } else { Part::Data })
}

/// Whether `op` is cut into fragments (and, with several QPs, striped);
/// the rest goes whole on the control QP.
fn is_striped(op: &SendOp) -> bool {
    matches!(op, SendOp::RdmaWrite { .. } | SendOp::RdmaWriteWithImm { .. } | SendOp::RdmaRead { .. })
}

/// The SGEs that cover `len` bytes at `offset` of the concatenation of `sg`.
fn sub_sges(sg: &[Sge], mut offset: u64, mut len: u64) -> Vec<Sge> {
    let mut out = Vec::with_capacity(1);
    for s in sg {
        if len == 0 {
            break;
        }
        let l = s.length as u64;
        if offset >= l {
            offset -= l;
            continue;
        }
        let take = (l - offset).min(len);
        out.push(Sge { addr: s.addr + offset, length: take as u32, lkey: s.lkey });
        len -= take;
        offset = 0;
    }
    out
}

impl fmt::Debug for VirtualQp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let st = self.shared.lock();
        f.debug_struct("VirtualQp")
            .field("qp_num", &self.shared.qp_num)
            .field("load_balancing", &st.cfg.load_balancing)
            .field("data_qps", &st.cfg.total_qps)
            .field("pending", &st.planner.pending())
            .field("error", &st.error)
            .finish()
    }
}

impl VirtualQp {
    /// Creates the physical QPs on `cq` (all of them complete there), moves
    /// them to INIT and, for DQPLB, pre-posts the data QPs' receives.
    /// Fails if `cq` cannot hold every completion they may have outstanding.
    pub fn new(pd: &ProtectionDomain, cq: &VirtualCq, cfg: &VirtualQpConfig) -> Result<VirtualQp> {
        cfg.validate()?;
        let device_max_msg = pd.context().query_device()?.max_msg_sz;
        let n_data = cfg.total_qps as usize;
        let sep = cfg.has_notify_qp();
        let dqplb_multi = sep && cfg.load_balancing == LoadBalancing::Dqplb;
        let data_recv = if !sep {
            cfg.max_recv_wr
        } else if dqplb_multi {
            cfg.dqplb_recv_depth()
        } else {
            0
        };
        let mut caps = Vec::with_capacity(n_data + 1);
        for _ in 0..n_data {
            caps.push((cfg.max_msg_cnt_per_qp, data_recv));
        }
        if sep {
            caps.push((cfg.max_msg_cnt_per_qp, cfg.max_recv_wr));
        }
        let reserved: usize = caps.iter().map(|&(s, r)| s as usize + r as usize).sum();
        cq.reserve(reserved)?;
        let built = (|| {
            let mut qps = Vec::with_capacity(caps.len());
            for &(send, recv) in &caps {
                let attr = QpInitAttr {
                    caps: QpCaps {
                        // One spare slot: the soft provider makes a send
                        // completion pollable a moment before it frees the
                        // WR's send-queue slot, so a post straight after the
                        // poll could find the queue "full". The planner
                        // still keeps `send` outstanding at most, which is
                        // what the CQ reservation counts.
                        max_send_wr: send + 1,
                        max_recv_wr: recv,
                        max_send_sge: cfg.max_send_sge,
                        max_recv_sge: cfg.max_recv_sge,
                        ..QpCaps::default()
                    },
                    sq_sig_all: false,
                };
                let qp = pd.create_qp(&attr, &cq.inner.cq, &cq.inner.cq)?;
                qp.modify(&QpTransition::Init(InitAttr::default()))?;
                qps.push(qp);
            }
            if dqplb_multi {
                let wrs: Vec<RecvWr<'_>> = (0..data_recv).map(|_| RecvWr { wr_id: 0, sg_list: &[] }).collect();
                for qp in &qps[..n_data] {
                    qp.post_recv(&wrs)?;
                }
            }
            Ok::<_, Error>(qps)
        })();
        let qps = match built {
            Ok(q) => q,
            Err(e) => {
                cq.release(reserved);
                return Err(e);
            }
        };
        let ctrl = if sep { n_data } else { 0 };
        let qp_num = qps[ctrl].qp_num();
        let qpns: Vec<u32> = qps.iter().map(QueuePair::qp_num).collect();
        let max_inline = qps.iter().map(|q| q.caps().max_inline_data).min().unwrap_or(0);
        let st = State {
            cfg: *cfg,
            planner: FragmentPlanner::new(n_data, sep, cfg.max_msg_cnt_per_qp)
                .with_control_window(cfg.control_window()),
            qps,
            ctrl,
            agg: CompletionAggregator::new(qp_num),
            recv: RecvSequencer::new(),
            tracker: None,
            next_seq: cfg.initial_seq,
            connected: false,
            error: None,
            qp_num,
            stats: VirtualQpStats::default(),
            device_max_msg,
            max_inline,
        };
        let shared = Arc::new(VqpShared { st: Mutex::new(st), qp_num, qpns, reserved });
        cq.register(&shared, &shared.qpns);
        Ok(VirtualQp { shared, cq: cq.clone() })
    }

    /// The virtual QP number (that of the control QP); virtual completions
    /// carry it.
    pub fn qp_num(&self) -> u32 {
        self.shared.qp_num
    }

    /// The settings it was created with.
    pub fn config(&self) -> VirtualQpConfig {
        self.shared.lock().cfg
    }

    /// The virtual CQ.
    pub fn cq(&self) -> &VirtualCq {
        &self.cq
    }

    /// Numbers of the physical QPs: data QPs in order, then the notify QP.
    pub fn physical_qp_nums(&self) -> &[u32] {
        &self.shared.qpns
    }

    /// What the peer needs to connect: serialise it and send it.
    pub fn endpoint(&self) -> Result<VirtualQpEndpoint> {
        let st = self.shared.lock();
        let n = st.cfg.total_qps as usize;
        let data = st.qps[..n].iter().map(QueuePair::endpoint).collect::<Result<Vec<_>>>()?;
        let notify = if st.cfg.has_notify_qp() { Some(st.qps[n].endpoint()?) } else { None };
        Ok(VirtualQpEndpoint {
            load_balancing: st.cfg.load_balancing,
            max_msg_cnt_per_qp: st.cfg.max_msg_cnt_per_qp,
            initial_seq: st.cfg.initial_seq,
            data,
            notify,
        })
    }

    /// Connects data QP i to the peer's data QP i and the notify QPs to each
    /// other, moving all to RTS.
    pub fn connect(&self, peer: &VirtualQpEndpoint) -> Result<()> {
        let mut st = self.shared.lock();
        if st.connected {
            return Err(Error::InvalidState { verb: "connect_virtual_qp", reason: "already connected".into() });
        }
        let c = st.cfg;
        Self::check_endpoint_against(&c, peer)?;
        let rts = crate::RtsAttr { timeout: c.ack_timeout, retry_cnt: c.retry_cnt, ..crate::RtsAttr::default() };
        for (qp, ep) in st.qps.iter().zip(peer.data.iter().chain(peer.notify.iter())) {
            qp.connect_with(crate::InitAttr::default(), crate::RtrAttr::new(ep.clone()), rts)?;
        }
        if c.has_notify_qp() && c.load_balancing == LoadBalancing::Dqplb {
            // Fragments on the other QPs keep completing (and the sender keeps
            // posting) while one QP is slow, so how far ahead an arrival may
            // be has no bound but the sequence space: half of it keeps
            // "ahead" and "behind" apart.
            let window = 1 << (SEQ_BITS - 1);
            st.tracker = Some(SeqTracker::new(peer.initial_seq, window, c.reorder_timeout));
        }
        st.connected = true;
        Ok(())
    }

    /// Whether [`connect`](Self::connect) would take the peer's endpoint
    /// (same QP count, load balancing and message count): checked without
    /// touching a QP, so that a caller can refuse a mismatched peer and
    /// still connect to another.
    pub fn check_endpoint(&self, peer: &VirtualQpEndpoint) -> Result<()> {
        let c = self.shared.lock().cfg;
        Self::check_endpoint_against(&c, peer)
    }

    fn check_endpoint_against(c: &VirtualQpConfig, peer: &VirtualQpEndpoint) -> Result<()> {
        let bad = |r: String| Err(Error::InvalidArgument { verb: "connect_virtual_qp", reason: r });
        if peer.data.len() != c.total_qps as usize || peer.notify.is_some() != c.has_notify_qp() {
            return bad(format!(
                "the peer has {} data QPs{}, this end {}; both ends need the same total_qps",
                peer.data.len(),
                if peer.notify.is_some() { " and a notify QP" } else { "" },
                c.total_qps
            ));
        }
        if peer.load_balancing != c.load_balancing || peer.max_msg_cnt_per_qp != c.max_msg_cnt_per_qp {
            return bad(format!(
                "the peer uses {:?} with max_msg_cnt_per_qp {}, this end {:?} with {}; both ends must agree",
                peer.load_balancing, peer.max_msg_cnt_per_qp, c.load_balancing, c.max_msg_cnt_per_qp
            ));
        }
        Ok(())
    }

    /// Posts virtual send WRs. Nothing blocks: what finds no room on the
    /// physical QPs is queued and posted by [`VirtualCq::poll`]. The memory
    /// the SGEs name must stay registered until the WR's virtual completion
    /// (a region dropped earlier makes the fragments fail with a local
    /// protection error, never touch freed memory).
    ///
    /// A WR that fails validation fails the call with `InvalidArgument`
    /// and nothing of it is queued; the WRs before it were posted (as with
    /// `ibv_post_send`'s `bad_wr`). Validation covers what a physical QP
    /// would refuse: SGE count, a physical WR (fragment, or a whole SEND)
    /// above the device's `max_msg_sz`, inline data above the physical
    /// QPs' `max_inline_data` or one fragment, inline READs and atomics, an
    /// atomic without one 8-byte SGE or at an unaligned address. An inline
    /// WR must also find room at once, once the WRs queued ahead of it (this
    /// call's earlier ones) went out (`Exhausted` otherwise), since its
    /// bytes are copied at post time. On a virtual QP in the error state,
    /// valid WRs complete at once with `WrFlushErr`.
    pub fn post_send(&self, wrs: &[SendWr<'_>]) -> Result<()> {
        let mut st = self.shared.lock();
        if !st.connected {
            return Err(Error::InvalidState {
                verb: "post_send(virtual)",
                reason: "the virtual QP is not connected; call connect first".into(),
            });
        }
        let mut res = Ok(());
        for (i, wr) in wrs.iter().enumerate() {
            if let Err(e) = st.enqueue(wr) {
                // Which WR, and how many before it were posted (as
                // ibv_post_send's bad_wr tells).
                let at = format!("WR {i} of {} (wr_id {:#x}; the {i} before it were posted): ", wrs.len(), wr.wr_id);
                res = Err(match e {
                    Error::InvalidArgument { verb, reason } => Error::InvalidArgument { verb, reason: at + &reason },
                    Error::Exhausted { verb, reason } => Error::Exhausted { verb, reason: at + &reason },
                    other => other,
                });
                break;
            }
        }
        st.pump();
        res
    }

    /// Posts receive WRs on the control QP. SENDs and the virtual QP's
    /// incoming WRITE_WITH_IMMs consume them in order, as on one RC QP.
    pub fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<()> {
        let st = self.shared.lock();
        st.qps[st.ctrl].post_recv(wrs)
    }

    /// Maps `len` bytes at `addr` of the peer's region `rkey` into this
    /// process ([`QueuePair::map_remote`] on the first data QP: every
    /// physical QP reaches the same peer).
    pub fn map_remote(&self, rkey: u32, addr: u64, len: u64) -> crate::provider::MapRemoteFuture {
        let st = self.shared.lock();
        st.qps[0].map_remote(rkey, addr, len)
    }

    /// [`QueuePair::map_remote_region`] on the first data QP.
    pub fn map_remote_region(&self, rkey: u32, addr: u64) -> crate::provider::MapRemoteFuture {
        let st = self.shared.lock();
        st.qps[0].map_remote_region(rkey, addr)
    }

    /// The first error, with what caused it, once the virtual QP failed.
    pub fn error(&self) -> Option<(WcStatus, String)> {
        self.shared.lock().error.clone()
    }

    /// Moves the virtual QP to the error state: everything outstanding and
    /// queued completes with `WrFlushErr`.
    pub fn fail(&self) {
        self.shared.lock().enter_error(
            WcStatus::WrFlushErr,
            "moved to the error state by the application".into(),
            false,
        );
    }

    /// Virtual send WRs posted and not yet completed.
    pub fn outstanding(&self) -> usize {
        self.shared.lock().agg.outstanding()
    }

    /// Counters.
    pub fn stats(&self) -> VirtualQpStats {
        self.shared.lock().stats
    }

    /// Physical WRs waiting for room.
    pub fn pending(&self) -> usize {
        self.shared.lock().planner.pending()
    }
}

impl Drop for VirtualQp {
    fn drop(&mut self) {
        self.cq.unregister(&self.shared, &self.shared.qpns, self.shared.reserved);
    }
}

impl State {
    fn multi(&self) -> bool {
        self.cfg.has_notify_qp()
    }

    /// Refuses a WR that a physical QP would refuse. The physical WRs are
    /// posted later (from [`pump`](Self::pump), possibly in another call),
    /// where a refusal can no longer fail this call and would take the
    /// whole virtual QP down instead; so every check a provider makes on
    /// the WR alone is made here, before anything is queued.
    fn check_wr(&self, wr: &SendWr<'_>, len: u64) -> Result<()> {
        /// Most fragments one WR is cut into (16 GiB of 16 KiB ones).
        const MAX_FRAGMENTS_PER_WR: u64 = 1 << 20;
        let bad = |reason: String| Err(Error::InvalidArgument { verb: "post_send(virtual)", reason });
        if wr.sg_list.len() > self.cfg.max_send_sge as usize {
            return bad(format!("{} SGEs exceed max_send_sge {}", wr.sg_list.len(), self.cfg.max_send_sge));
        }
        if len > u32::MAX as u64 {
            return bad(format!("a {len}-byte message exceeds 4 GiB - 1"));
        }
        let max = self.cfg.max_msg_size as u64;
        let striped = is_striped(&wr.op);
        let physical_len = if striped { len.min(max) } else { len };
        if physical_len > self.device_max_msg as u64 {
            return bad(format!(
                "a {physical_len}-byte {} exceeds the device's max_msg_sz {}; lower VirtualQpConfig::max_msg_size \
                 (fragments) or send less at once",
                if striped { "fragment" } else { "message" },
                self.device_max_msg
            ));
        }
        if wr.flags.inline {
            if matches!(wr.op, SendOp::RdmaRead { .. } | SendOp::Atomic { .. }) {
                return bad("RDMA READ and atomics cannot be inline".into());
            }
            if len > max {
                return bad(format!(
                    "an inline WR must fit one fragment: {len} bytes exceed max_msg_size {max}; register the buffer"
                ));
            }
            if len > self.max_inline as u64 {
                return bad(format!(
                    "{len} inline bytes exceed the physical QPs' max_inline_data {}; register the buffer",
                    self.max_inline
                ));
            }
        }
        // Every fragment is a physical WR built at post time: a 4 GiB WRITE
        // cut into 1-byte fragments made 4 billion (and overflowed the
        // aggregator's part count).
        if striped && len.div_ceil(max.max(1)) > MAX_FRAGMENTS_PER_WR {
            return bad(format!(
                "a {len}-byte message in fragments of {max} bytes is more than {MAX_FRAGMENTS_PER_WR} fragments; \
                 raise VirtualQpConfig::max_msg_size or send less at once"
            ));
        }
        // Ranges that wrap past 2^64 (fragment addresses are computed from
        // them: a debug build panicked, a release one wrapped).
        if let Some(s) = wr.sg_list.iter().find(|s| s.addr.checked_add(s.length as u64).is_none()) {
            return bad(format!("SGE {:#x}+{} wraps past the end of the address space", s.addr, s.length));
        }
        let remote = match wr.op {
            SendOp::RdmaWrite { remote_addr, .. }
            | SendOp::RdmaWriteWithImm { remote_addr, .. }
            | SendOp::RdmaRead { remote_addr, .. } => Some(remote_addr),
            _ => None,
        };
        if let Some(r) = remote.filter(|r| r.checked_add(len).is_none()) {
            return bad(format!("remote range {r:#x}+{len} wraps past the end of the address space"));
        }
        if let SendOp::Atomic { remote_addr, .. } = wr.op {
            if wr.sg_list.len() != 1 || wr.sg_list[0].length != 8 {
                return bad("an atomic needs exactly one 8-byte SGE".into());
            }
            if remote_addr % 8 != 0 {
                return bad(format!("atomic address {remote_addr:#x} is not 8-byte aligned"));
            }
        }
        Ok(())
    }

    fn enqueue(&mut self, wr: &SendWr<'_>) -> Result<()> {
        let len: u64 = wr.sg_list.iter().map(|s| s.length as u64).sum();
        // Checked in the error state too: as with ibv_post_send, a
        // malformed WR is refused rather than flushed.
        self.check_wr(wr, len)?;
        let opcode = wr.op.wc_opcode();
        if self.error.is_some() {
            let vid = self.agg.begin(wr.wr_id, opcode, 0, wr.flags.signaled, 1, 0);
            self.agg.complete(vid, Part::Data, WcStatus::WrFlushErr);
            return Ok(());
        }
        let max = self.cfg.max_msg_size;
        let striped = is_striped(&wr.op);
        let lane = if striped && self.multi() { Lane::Data } else { Lane::Control };
        // WRs queued ahead (this call's earlier ones) go out first if they
        // can: two inline WRs in one call found the first still queued.
        if wr.flags.inline && !self.planner.can_post_now(lane) {
            self.pump();
        }
        if wr.flags.inline && !self.planner.can_post_now(lane) {
            return Err(Error::Exhausted {
                verb: "post_send(virtual)",
                reason: "an inline WR must find room at once (its bytes are copied at post time); post it later or \
                         register the buffer"
                    .into(),
            });
        }
        let signaled = wr.flags.signaled;
        let op = |vid: u64, part: Part, op: SendOp, sges: Vec<Sge>| PhysOp {
            vid,
            part,
            op,
            sges,
            inline: wr.flags.inline,
            fence: wr.flags.fence,
        };
        if !striped {
            let vid = self.agg.begin(wr.wr_id, opcode, len as u32, signaled, 1, 0);
            self.planner.push_control(op(vid, Part::Data, wr.op, wr.sg_list.to_vec()), None);
            return Ok(());
        }
        let (remote_addr, rkey, user_imm) = match wr.op {
            SendOp::RdmaWrite { remote_addr, rkey } | SendOp::RdmaRead { remote_addr, rkey } => {
                (remote_addr, rkey, None)
            }
            SendOp::RdmaWriteWithImm { remote_addr, rkey, imm } => (remote_addr, rkey, Some(imm)),
            _ => unreachable!("striped opcodes only"),
        };
        let is_read = matches!(wr.op, SendOp::RdmaRead { .. });
        let nfrag = if len == 0 { 1 } else { len.div_ceil(max as u64) } as u32;
        if !self.multi() {
            // One QP: RC order does the work; the last fragment carries the immediate.
            let vid = self.agg.begin(wr.wr_id, opcode, len as u32, signaled, nfrag, 0);
            for f in fragments(len, max) {
                let raddr = remote_addr + f.offset;
                let last = f.offset + f.len as u64 == len;
                let pop = match (is_read, user_imm) {
                    (true, _) => SendOp::RdmaRead { remote_addr: raddr, rkey },
                    (false, Some(imm)) if last => SendOp::RdmaWriteWithImm { remote_addr: raddr, rkey, imm },
                    (false, _) => SendOp::RdmaWrite { remote_addr: raddr, rkey },
                };
                self.planner.push_control(op(vid, Part::Data, pop, sub_sges(wr.sg_list, f.offset, f.len as u64)), None);
            }
            return Ok(());
        }
        let ctrl_parts = u32::from(user_imm.is_some());
        let vid = self.agg.begin(wr.wr_id, opcode, len as u32, signaled, nfrag, ctrl_parts);
        let dqplb = self.cfg.load_balancing == LoadBalancing::Dqplb;
        for f in fragments(len, max) {
            let raddr = remote_addr + f.offset;
            let last = f.offset + f.len as u64 == len;
            let pop = if is_read {
                SendOp::RdmaRead { remote_addr: raddr, rkey }
            } else if dqplb {
                let imm = DqplbImm { seq: self.next_seq, last, user: user_imm.is_some() }.encode();
                self.next_seq = next_seq(self.next_seq);
                SendOp::RdmaWriteWithImm { remote_addr: raddr, rkey, imm }
            } else {
                SendOp::RdmaWrite { remote_addr: raddr, rkey }
            };
            self.planner.push_data(op(vid, Part::Data, pop, sub_sges(wr.sg_list, f.offset, f.len as u64)));
        }
        if let Some(imm) = user_imm {
            // DQPLB: the immediate goes at once and waits at the receiver;
            // spray: it goes once the fragments have completed (the gate).
            let gate = if dqplb { None } else { Some(vid) };
            let notify = PhysOp {
                vid,
                part: Part::Control,
                op: SendOp::RdmaWriteWithImm { remote_addr, rkey, imm },
                sges: Vec::new(),
                inline: false,
                fence: false,
            };
            self.planner.push_control(notify, gate);
        }
        Ok(())
    }

    /// Posts whatever the planner lets go now. The posting thread copies
    /// at most [`PUMP_INLINE_BUDGET`] bytes itself per call (same-host soft
    /// QPs); the rest goes to the provider's thread.
    fn pump(&mut self) {
        if self.error.is_some() {
            return;
        }
        crate::soft::inline_budget::scope(PUMP_INLINE_BUDGET, || self.pump_all());
    }

    fn pump_all(&mut self) {
        while let Some((qp, op)) = self.planner.next(|vid| self.agg.data_done(vid)) {
            let wr = SendWr {
                wr_id: encode_wr_id(op.vid, op.part),
                op: op.op,
                sg_list: &op.sges,
                flags: SendFlags { signaled: true, inline: op.inline, fence: op.fence },
            };
            self.stats.physical_posted += 1;
            // `check_wr` refused what the WR alone makes invalid; what is
            // left (an inline SGE outside its registration, a QP the
            // provider took down) fails the virtual QP, since the call that
            // posted the WR may have returned long ago.
            if let Err(e) = self.qps[qp].post_send(&[wr]) {
                self.planner.complete(qp);
                self.agg.complete(op.vid, op.part, WcStatus::LocQpOpErr);
                self.enter_error(WcStatus::LocQpOpErr, format!("posting on physical QP {qp} failed: {e}"), false);
                return;
            }
        }
    }

    fn enter_error(&mut self, status: WcStatus, why: String, recv_side: bool) {
        if self.error.is_some() {
            return;
        }
        if status == WcStatus::WrFlushErr {
            // Asked for by the application (fail/drop): not news.
            tracing::debug!(qp_num = self.qp_num, "virtual QP enters the error state: {why}");
        } else {
            tracing::warn!(qp_num = self.qp_num, "virtual QP enters the error state: {why}");
        }
        self.error = Some((status, why));
        for qp in &self.qps {
            let _ = qp.modify(&QpTransition::Err);
        }
        for op in self.planner.drain() {
            self.agg.complete(op.vid, op.part, WcStatus::WrFlushErr);
        }
        let s = if recv_side { status } else { WcStatus::WrFlushErr };
        self.recv.fail(s, self.qp_num, recv_side);
    }

    fn on_physical(&mut self, idx: usize, wc: WorkCompletion, now: Instant) {
        let is_recv = matches!(wc.opcode, WcOpcode::Recv | WcOpcode::RecvRdmaWithImm);
        if !is_recv {
            self.planner.complete(idx);
            let (vid, part) = decode_wr_id(wc.wr_id);
            self.agg.complete(vid, part, wc.status);
            if !wc.is_ok() {
                self.enter_error(
                    wc.status,
                    format!("a WR on physical QP {idx} ({:#x}) failed: {}", wc.qp_num, wc.status),
                    false,
                );
            }
        } else if idx == self.ctrl {
            let mut v = wc;
            v.qp_num = self.qp_num;
            let needs = self.tracker.is_some() && wc.opcode == WcOpcode::RecvRdmaWithImm;
            self.recv.on_arrival(v, needs);
            if !wc.is_ok() && wc.status != WcStatus::WrFlushErr {
                self.enter_error(wc.status, format!("a receive on the control QP failed: {}", wc.status), false);
            }
        } else if wc.is_ok() {
            self.on_fragment(idx, wc, now);
        } else if wc.status != WcStatus::WrFlushErr {
            self.enter_error(wc.status, format!("a receive on data QP {idx} failed: {}", wc.status), true);
        }
        self.pump();
    }

    /// A DQPLB fragment landed on data QP `idx`.
    fn on_fragment(&mut self, idx: usize, wc: WorkCompletion, now: Instant) {
        if self.error.is_some() {
            return;
        }
        let Some(tracker) = self.tracker.as_mut() else {
            self.enter_error(WcStatus::RemInvReqErr, format!("unexpected receive on data QP {idx}"), true);
            return;
        };
        let res = match (wc.opcode, wc.imm_data) {
            (WcOpcode::RecvRdmaWithImm, Some(imm)) => tracker.on_arrival(imm, wc.byte_len, now),
            _ => Err(TrackerError::Malformed { imm: wc.imm_data.unwrap_or(0) }),
        };
        if let Err(e) = res {
            self.enter_error(WcStatus::RemInvReqErr, format!("data QP {idx}: {e}"), true);
            return;
        }
        self.stats.fragments_received += 1;
        if tracker.held() > 0 {
            self.stats.fragments_out_of_order += 1;
            self.stats.max_held = self.stats.max_held.max(tracker.held());
        }
        while let Some(m) = tracker.poll_finished() {
            if m.user {
                self.recv.on_message_finished();
            }
        }
        if let Err(e) = self.qps[idx].post_recv(&[RecvWr { wr_id: 0, sg_list: &[] }]) {
            self.enter_error(WcStatus::LocQpOpErr, format!("replenishing data QP {idx}'s receives failed: {e}"), true);
        }
    }

    fn check_timeout(&mut self, now: Instant) {
        if self.error.is_some() {
            return;
        }
        if let Some(Err(e)) = self.tracker.as_ref().map(|t| t.check(now)) {
            self.enter_error(WcStatus::RespTimeoutErr, e.to_string(), true);
        }
    }

    fn drain_into(&mut self, out: &mut [WorkCompletion]) -> usize {
        if self.tracker.as_ref().is_some_and(|t| t.deadline().is_some()) {
            self.check_timeout(Instant::now());
        }
        let mut n = 0;
        while n < out.len() {
            match self.agg.poll() {
                Some(w) => {
                    out[n] = w;
                    n += 1;
                }
                None => break,
            }
        }
        while n < out.len() {
            match self.recv.poll() {
                Some(w) => {
                    out[n] = w;
                    n += 1;
                }
                None => break,
            }
        }
        n
    }
}

impl VqpShared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.st.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn on_physical(&self, idx: usize, wc: WorkCompletion, now: Instant) {
        self.lock().on_physical(idx, wc, now);
    }

    pub(crate) fn drain_into(&self, out: &mut [WorkCompletion]) -> usize {
        self.lock().drain_into(out)
    }

    pub(crate) fn deadline(&self) -> Option<Instant> {
        let st = self.lock();
        if st.error.is_some() {
            return None;
        }
        st.tracker.as_ref().and_then(SeqTracker::deadline)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sub_sges_cut_across_elements() {
        let sg = [Sge { addr: 100, length: 10, lkey: 1 }, Sge { addr: 500, length: 5, lkey: 2 }];
        assert_eq!(sub_sges(&sg, 0, 15), sg.to_vec());
        assert_eq!(
            sub_sges(&sg, 8, 4),
            vec![Sge { addr: 108, length: 2, lkey: 1 }, Sge { addr: 500, length: 2, lkey: 2 }]
        );
        assert_eq!(sub_sges(&sg, 12, 3), vec![Sge { addr: 502, length: 3, lkey: 2 }]);
        assert_eq!(sub_sges(&sg, 0, 0), vec![]);
    }

    #[test]
    fn wr_ids_round_trip() {
        for (vid, part) in [(0, Part::Data), (5, Part::Control), (u64::MAX >> 1, Part::Data)] {
            assert_eq!(decode_wr_id(encode_wr_id(vid, part)), (vid, part));
        }
    }
}
