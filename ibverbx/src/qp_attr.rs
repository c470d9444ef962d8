//! Queue-pair states, capabilities and the attributes of each transition.

use std::time::Duration;

use crate::access::AccessFlags;
use crate::device::Mtu;
use crate::endpoint::QpEndpoint;

/// QP state (`enum ibv_qp_state`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum QpState {
    /// Just created, or reset.
    Reset,
    /// Receives may be posted.
    Init,
    /// Ready to receive.
    Rtr,
    /// Ready to send.
    Rts,
    /// Send-queue drained.
    Sqd,
    /// Send-queue error.
    Sqe,
    /// Error: every WR is flushed.
    Err,
}

/// Queue sizes of a QP (`struct ibv_qp_cap`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpCaps {
    /// Most outstanding send WRs.
    pub max_send_wr: u32,
    /// Most outstanding receive WRs.
    pub max_recv_wr: u32,
    /// Most SGEs per send WR.
    pub max_send_sge: u32,
    /// Most SGEs per receive WR.
    pub max_recv_sge: u32,
    /// Most inline bytes per send WR.
    pub max_inline_data: u32,
}

impl Default for QpCaps {
    fn default() -> Self {
        QpCaps { max_send_wr: 256, max_recv_wr: 256, max_send_sge: 4, max_recv_sge: 4, max_inline_data: 256 }
    }
}

/// Creation attributes of an RC QP (`struct ibv_qp_init_attr`; the CQs are
/// passed separately).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct QpInitAttr {
    /// Queue sizes.
    pub caps: QpCaps,
    /// Every send WR produces a completion, whatever its `signaled` flag.
    pub sq_sig_all: bool,
}

/// RESET → INIT attributes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InitAttr {
    /// Physical port (1-based); 0 (the default) takes the context's default
    /// port: for verbs the first port `RMACOMM_IB_HCA` names for the device,
    /// else 1. The soft provider has no ports and ignores it.
    pub port_num: u8,
    /// P_Key index.
    pub pkey_index: u16,
    /// Which remote operations peers may run on this QP.
    pub access: AccessFlags,
}

impl Default for InitAttr {
    fn default() -> Self {
        InitAttr {
            // Not 1: a device selected as `mlx5_0:2` must get port 2's QPs
            // (and LID/GID) without every caller knowing about ports.
            port_num: 0,
            pkey_index: 0,
            access: AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_ATOMIC,
        }
    }
}

impl InitAttr {
    /// These attributes with port 0 replaced by `default_port` (the
    /// context's default port): what the INIT transition applies.
    pub fn resolved(&self, default_port: u8) -> InitAttr {
        InitAttr { port_num: if self.port_num == 0 { default_port } else { self.port_num }, ..*self }
    }
}

/// INIT → RTR attributes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RtrAttr {
    /// The peer QP (its number, GID/LID, PSN, and for the soft provider its
    /// addresses and token).
    pub remote: QpEndpoint,
    /// Path MTU; `None` takes the smaller of the two ports' active MTUs.
    pub path_mtu: Option<Mtu>,
    /// Most RDMA READs/atomics the peer may have outstanding at this QP.
    pub max_dest_rd_atomic: u8,
    /// RNR NAK timer, IB encoding (see [`rnr_timer_duration`]).
    pub min_rnr_timer: u8,
    /// Local GID index to send from (RoCE).
    pub sgid_index: u8,
    /// Service level.
    pub sl: u8,
    /// Hop limit (RoCE/GRH).
    pub hop_limit: u8,
}

impl RtrAttr {
    /// Attributes with common defaults for the given peer.
    pub fn new(remote: QpEndpoint) -> Self {
        RtrAttr {
            remote,
            path_mtu: None,
            max_dest_rd_atomic: 16,
            min_rnr_timer: 12,
            sgid_index: 0,
            sl: 0,
            hop_limit: 64,
        }
    }
}

/// RTR → RTS attributes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RtsAttr {
    /// Local ACK timeout, IB encoding: 4.096 µs × 2^timeout; 0 waits forever.
    pub timeout: u8,
    /// Transport retries before RETRY_EXC_ERR (0..=7).
    pub retry_cnt: u8,
    /// RNR retries before RNR_RETRY_EXC_ERR (0..=6; 7 retries forever, as in verbs).
    pub rnr_retry: u8,
    /// Most RDMA READs/atomics this QP may have outstanding.
    pub max_rd_atomic: u8,
    /// Initial send PSN.
    pub sq_psn: u32,
}

impl Default for RtsAttr {
    fn default() -> Self {
        RtsAttr { timeout: 16, retry_cnt: 7, rnr_retry: 7, max_rd_atomic: 16, sq_psn: 0 }
    }
}

/// One `ibv_modify_qp` call.
#[derive(Debug, Clone, PartialEq, Eq)]
#[allow(clippy::large_enum_variant)]
pub enum QpTransition {
    /// RESET → INIT.
    Init(InitAttr),
    /// INIT → RTR.
    Rtr(RtrAttr),
    /// RTR → RTS.
    Rts(RtsAttr),
    /// Any → ERR: flushes every outstanding WR.
    Err,
    /// Any → RESET: drops every outstanding WR without completions.
    Reset,
}

impl QpTransition {
    /// The state the QP is in after the transition.
    pub fn target(&self) -> QpState {
        match self {
            QpTransition::Init(_) => QpState::Init,
            QpTransition::Rtr(_) => QpState::Rtr,
            QpTransition::Rts(_) => QpState::Rts,
            QpTransition::Err => QpState::Err,
            QpTransition::Reset => QpState::Reset,
        }
    }

    /// Checks the transition against verbs' state diagram.
    pub fn allowed_from(&self, from: QpState) -> bool {
        match self {
            QpTransition::Init(_) => matches!(from, QpState::Reset | QpState::Init),
            QpTransition::Rtr(_) => from == QpState::Init,
            QpTransition::Rts(_) => matches!(from, QpState::Rtr | QpState::Rts | QpState::Sqd | QpState::Sqe),
            QpTransition::Err | QpTransition::Reset => true,
        }
    }
}

/// The RNR NAK timer value of an IB `min_rnr_timer` encoding (0 = 655.36 ms).
pub fn rnr_timer_duration(code: u8) -> Duration {
    const MICROS: [u64; 32] = [
        655_360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1_280, 1_920, 2_560, 3_840, 5_120, 7_680,
        10_240, 15_360, 20_480, 30_720, 40_960, 61_440, 81_920, 122_880, 163_840, 245_760, 327_680, 491_520,
    ];
    Duration::from_micros(MICROS[(code & 31) as usize])
}

/// The local ACK timeout of an IB `timeout` encoding: 4.096 µs × 2^code, or
/// `None` (wait forever) for 0.
pub fn ack_timeout_duration(code: u8) -> Option<Duration> {
    if code == 0 {
        None
    } else {
        Some(Duration::from_nanos(4096u64 << code.min(31)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn port_zero_resolves_to_the_contexts_default_port() {
        assert_eq!(InitAttr::default().port_num, 0);
        assert_eq!(InitAttr::default().resolved(2).port_num, 2);
        let explicit = InitAttr { port_num: 1, ..InitAttr::default() };
        assert_eq!(explicit.resolved(2), explicit);
    }
}
