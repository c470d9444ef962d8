//! Settings of a virtual QP: how many physical QPs, fragment size, window
//! per QP and the load-balancing scheme.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// How a virtual QP tells the receiver that a striped message has landed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LoadBalancing {
    /// Every fragment is an RDMA_WRITE_WITH_IMM whose immediate carries a
    /// 24-bit sequence number (bit 31: last fragment of a message); the
    /// receiver reassembles the order. No extra round trip.
    #[default]
    Dqplb,
    /// Fragments are plain RDMA_WRITEs; once all of a message's fragments
    /// have completed at the sender, one zero-byte RDMA_WRITE_WITH_IMM on the
    /// notify QP tells the receiver.
    Spray,
}

impl LoadBalancing {
    /// Parses `dqplb` or `spray`.
    pub fn parse(s: &str) -> Option<LoadBalancing> {
        match s.trim().to_ascii_lowercase().as_str() {
            "dqplb" => Some(LoadBalancing::Dqplb),
            "spray" => Some(LoadBalancing::Spray),
            _ => None,
        }
    }
}

/// Creation settings of a [`VirtualQp`](crate::VirtualQp). Both ends of a
/// connection must use the same `total_qps`, `load_balancing` and
/// `max_msg_cnt_per_qp` (checked at connect).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VirtualQpConfig {
    /// Physical data QPs the messages are striped over (1..=256). With more
    /// than one, an extra notify QP carries notifications, SENDs and atomics.
    pub total_qps: u32,
    /// Most WRs outstanding on each physical QP; the rest waits in the
    /// virtual QP's pending queue.
    pub max_msg_cnt_per_qp: u32,
    /// Largest fragment, in bytes: longer RDMA WRITEs and READs are cut.
    pub max_msg_size: u32,
    /// The scheme.
    pub load_balancing: LoadBalancing,
    /// Receive WRs the application may have posted at once
    /// ([`VirtualQp::post_recv`](crate::VirtualQp::post_recv)).
    pub max_recv_wr: u32,
    /// Most SGEs per send WR.
    pub max_send_sge: u32,
    /// Most SGEs per receive WR.
    pub max_recv_sge: u32,
    /// A DQPLB receiver that holds later fragments while an earlier one has
    /// not arrived for this long reports the message as lost
    /// (`RespTimeoutErr`) instead of waiting forever.
    pub reorder_timeout: Duration,
    /// First DQPLB sequence number this end sends (the peer learns it from
    /// the endpoint). Tests start near 2^24 to cross the wrap.
    pub initial_seq: u32,
    /// Most operations outstanding on the control (notify) QP: notifies,
    /// SENDs, atomics. 0 (the default) means `max_msg_cnt_per_qp`; 1
    /// reproduces ctran, whose spray notifies go one at a time.
    pub max_notify_in_flight: u32,
    /// The physical QPs' local ACK timeout (`ibv_qp_attr::timeout`, 1..=31):
    /// a request the peer answers nothing to for 4.096 µs × 2^`ack_timeout`
    /// × (`retry_cnt` + 1) fails with RETRY_EXC_ERR and breaks the
    /// connection. Default 16 (about 2.1 s in all), verbs' usual value.
    pub ack_timeout: u8,
    /// The physical QPs' `retry_cnt` (0..=7, default 7).
    pub retry_cnt: u8,
}

impl Default for VirtualQpConfig {
    fn default() -> Self {
        VirtualQpConfig {
            total_qps: 4,
            max_msg_cnt_per_qp: 16,
            max_msg_size: 1 << 20,
            load_balancing: LoadBalancing::Dqplb,
            max_recv_wr: 256,
            max_send_sge: 4,
            max_recv_sge: 4,
            reorder_timeout: Duration::from_secs(30),
            initial_seq: 0,
            max_notify_in_flight: 0,
            ack_timeout: crate::RtsAttr::default().timeout,
            retry_cnt: crate::RtsAttr::default().retry_cnt,
        }
    }
}

impl VirtualQpConfig {
    /// Checks the ranges; the error says which field to change.
    pub fn validate(&self) -> Result<()> {
        let bad = |r: &str| Err(Error::InvalidArgument { verb: "create_virtual_qp", reason: r.to_string() });
        if self.total_qps == 0 || self.total_qps > 256 {
            return bad("total_qps must be 1..=256");
        }
        if self.max_msg_cnt_per_qp == 0 || self.max_msg_cnt_per_qp > 16384 {
            return bad("max_msg_cnt_per_qp must be 1..=16384");
        }
        if self.max_msg_size == 0 {
            return bad("max_msg_size must be at least 1 byte");
        }
        if self.max_send_sge == 0 || self.max_send_sge > 16 || self.max_recv_sge > 16 {
            return bad("max_send_sge must be 1..=16 and max_recv_sge at most 16");
        }
        if self.max_recv_wr > 65536 {
            return bad("max_recv_wr must be at most 65536");
        }
        if self.initial_seq > super::dqplb::SEQ_MASK {
            return bad("initial_seq must fit in 24 bits");
        }
        if !(1..=31).contains(&self.ack_timeout) || self.retry_cnt > 7 {
            return bad("ack_timeout must be 1..=31 and retry_cnt at most 7");
        }
        Ok(())
    }

    /// The control QP's window (see `max_notify_in_flight`).
    pub(crate) fn control_window(&self) -> u32 {
        match self.max_notify_in_flight {
            0 => self.max_msg_cnt_per_qp,
            n => n.min(self.max_msg_cnt_per_qp),
        }
    }

    /// Whether a separate notify QP exists (more than one data QP).
    pub fn has_notify_qp(&self) -> bool {
        self.total_qps > 1
    }

    /// Receives a DQPLB receiver keeps posted on each data QP: twice the
    /// sender's window, so that a receiver that polls a little late does not
    /// make the sender wait for RNR retries.
    pub(crate) fn dqplb_recv_depth(&self) -> u32 {
        (self.max_msg_cnt_per_qp * 2).min(65536)
    }
}
