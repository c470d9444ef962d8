//! Work completions: what `poll_cq` returns.

use std::fmt;

/// Completion status, with the values of `enum ibv_wc_status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
#[non_exhaustive]
pub enum WcStatus {
    /// The WR completed successfully.
    Success = 0,
    /// Local length error: a receive was too small for the incoming message.
    LocLenErr = 1,
    /// Local QP operation error.
    LocQpOpErr = 2,
    /// Local EE context error.
    LocEecOpErr = 3,
    /// Local protection error: an SGE's lkey, bounds or access was wrong.
    LocProtErr = 4,
    /// The WR was flushed because the QP is in the error state.
    WrFlushErr = 5,
    /// Memory window bind error.
    MwBindErr = 6,
    /// Bad response from the responder.
    BadRespErr = 7,
    /// Local access error.
    LocAccessErr = 8,
    /// Remote invalid request (bad opcode, message too long for the receive).
    RemInvReqErr = 9,
    /// Remote access error: bad rkey, out-of-bounds address or missing access.
    RemAccessErr = 10,
    /// Remote operation error.
    RemOpErr = 11,
    /// Transport retries exhausted: the peer did not answer in time or the
    /// connection to it was lost.
    RetryExcErr = 12,
    /// RNR retries exhausted: the peer had no receive posted.
    RnrRetryExcErr = 13,
    /// Local RDD violation.
    LocRddViolErr = 14,
    /// Remote invalid RD request.
    RemInvRdReqErr = 15,
    /// Remote aborted.
    RemAbortErr = 16,
    /// Invalid EE context number.
    InvEecnErr = 17,
    /// Invalid EE context state.
    InvEecStateErr = 18,
    /// Fatal error.
    FatalErr = 19,
    /// Response timeout.
    RespTimeoutErr = 20,
    /// General error.
    GeneralErr = 21,
}

impl WcStatus {
    /// Converts a raw `ibv_wc_status` value.
    pub fn from_raw(v: u32) -> WcStatus {
        use WcStatus::*;
        const ALL: [WcStatus; 22] = [
            Success,
            LocLenErr,
            LocQpOpErr,
            LocEecOpErr,
            LocProtErr,
            WrFlushErr,
            MwBindErr,
            BadRespErr,
            LocAccessErr,
            RemInvReqErr,
            RemAccessErr,
            RemOpErr,
            RetryExcErr,
            RnrRetryExcErr,
            LocRddViolErr,
            RemInvRdReqErr,
            RemAbortErr,
            InvEecnErr,
            InvEecStateErr,
            FatalErr,
            RespTimeoutErr,
            GeneralErr,
        ];
        ALL.get(v as usize).copied().unwrap_or(GeneralErr)
    }

    /// `ibv_wc_status_str`.
    pub fn as_str(&self) -> &'static str {
        use WcStatus::*;
        match self {
            Success => "success",
            LocLenErr => "local length error",
            LocQpOpErr => "local QP operation error",
            LocEecOpErr => "local EE context operation error",
            LocProtErr => "local protection error",
            WrFlushErr => "Work Request Flushed Error",
            MwBindErr => "memory management operation error",
            BadRespErr => "bad response error",
            LocAccessErr => "local access error",
            RemInvReqErr => "remote invalid request error",
            RemAccessErr => "remote access error",
            RemOpErr => "remote operation error",
            RetryExcErr => "transport retry counter exceeded",
            RnrRetryExcErr => "RNR retry counter exceeded",
            LocRddViolErr => "local RDD violation error",
            RemInvRdReqErr => "remote invalid RD request",
            RemAbortErr => "aborted error",
            InvEecnErr => "invalid EE context number",
            InvEecStateErr => "invalid EE context state",
            FatalErr => "fatal error",
            RespTimeoutErr => "response timeout error",
            GeneralErr => "general error",
        }
    }
}

impl fmt::Display for WcStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Completion opcode (`enum ibv_wc_opcode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum WcOpcode {
    /// A SEND finished at the initiator.
    Send,
    /// An RDMA WRITE (with or without immediate) finished at the initiator.
    RdmaWrite,
    /// An RDMA READ finished.
    RdmaRead,
    /// A compare-and-swap finished.
    CompareSwap,
    /// A fetch-and-add finished.
    FetchAdd,
    /// A SEND arrived (receive completion).
    Recv,
    /// An RDMA_WRITE_WITH_IMM arrived (receive completion).
    RecvRdmaWithImm,
}

/// One work completion (`struct ibv_wc`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkCompletion {
    /// The WR's `wr_id`.
    pub wr_id: u64,
    /// Outcome.
    pub status: WcStatus,
    /// What finished. Not meaningful when `status` is an error other than on
    /// the receive side.
    pub opcode: WcOpcode,
    /// Bytes received (receive completions) or transferred.
    pub byte_len: u32,
    /// Immediate data, for SEND_WITH_IMM / RDMA_WRITE_WITH_IMM receives.
    pub imm_data: Option<u32>,
    /// The local QP number the completion belongs to.
    pub qp_num: u32,
    /// Vendor error code (0 on the soft provider).
    pub vendor_err: u32,
}

impl WorkCompletion {
    /// True when `status` is `Success`.
    pub fn is_ok(&self) -> bool {
        self.status == WcStatus::Success
    }

    /// A zeroed completion, useful to size poll buffers.
    pub const fn empty() -> Self {
        WorkCompletion {
            wr_id: 0,
            status: WcStatus::Success,
            opcode: WcOpcode::Send,
            byte_len: 0,
            imm_data: None,
            qp_num: 0,
            vendor_err: 0,
        }
    }
}
