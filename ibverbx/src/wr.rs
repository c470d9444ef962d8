//! Work requests: what `post_send` and `post_recv` take.

use crate::access::AccessFlags;

/// One scatter/gather element: `length` bytes at `addr` in the memory region
/// whose local key is `lkey` (`struct ibv_sge`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sge {
    /// Start address (a process virtual address inside the MR).
    pub addr: u64,
    /// Length in bytes.
    pub length: u32,
    /// The MR's local key.
    pub lkey: u32,
}

/// Atomic operation of a send WR.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AtomicOp {
    /// `*remote += compare_add`, returns the old value.
    FetchAdd {
        /// The addend.
        add: u64,
    },
    /// `if *remote == compare { *remote = swap }`, returns the old value.
    CompareSwap {
        /// Expected value.
        compare: u64,
        /// New value.
        swap: u64,
    },
}

/// The opcode of a send WR, with its opcode-specific fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendOp {
    /// Two-sided send: consumes a receive WR at the target.
    Send,
    /// Send with immediate data delivered in the receive completion.
    SendWithImm {
        /// Immediate data (host order; the wire carries it as is).
        imm: u32,
    },
    /// One-sided write to `remote_addr` in the peer MR named by `rkey`.
    RdmaWrite {
        /// Target address in the peer's address space.
        remote_addr: u64,
        /// The peer MR's remote key.
        rkey: u32,
    },
    /// Write that also consumes a receive WR at the target and delivers `imm`.
    RdmaWriteWithImm {
        /// Target address in the peer's address space.
        remote_addr: u64,
        /// The peer MR's remote key.
        rkey: u32,
        /// Immediate data.
        imm: u32,
    },
    /// One-sided read from the peer into the local SGEs.
    RdmaRead {
        /// Source address in the peer's address space.
        remote_addr: u64,
        /// The peer MR's remote key.
        rkey: u32,
    },
    /// 8-byte atomic on an 8-byte-aligned peer address; the old value lands in
    /// the (single, 8-byte) local SGE.
    Atomic {
        /// Target address in the peer's address space (8-byte aligned).
        remote_addr: u64,
        /// The peer MR's remote key.
        rkey: u32,
        /// The operation.
        op: AtomicOp,
    },
}

impl SendOp {
    /// The completion opcode this WR produces at the initiator.
    pub fn wc_opcode(&self) -> crate::WcOpcode {
        use crate::WcOpcode;
        match self {
            SendOp::Send | SendOp::SendWithImm { .. } => WcOpcode::Send,
            SendOp::RdmaWrite { .. } | SendOp::RdmaWriteWithImm { .. } => WcOpcode::RdmaWrite,
            SendOp::RdmaRead { .. } => WcOpcode::RdmaRead,
            SendOp::Atomic { op: AtomicOp::FetchAdd { .. }, .. } => WcOpcode::FetchAdd,
            SendOp::Atomic { op: AtomicOp::CompareSwap { .. }, .. } => WcOpcode::CompareSwap,
        }
    }

    /// The local access the SGEs' MRs need for this opcode.
    pub(crate) fn local_access(&self) -> AccessFlags {
        match self {
            SendOp::RdmaRead { .. } | SendOp::Atomic { .. } => AccessFlags::LOCAL_WRITE,
            _ => AccessFlags::empty(),
        }
    }
}

/// Flags of a send WR (`IBV_SEND_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SendFlags {
    /// Produce a completion when the WR finishes successfully (errors always
    /// produce one).
    pub signaled: bool,
    /// Copy the payload at post time: the buffer may be reused as soon as
    /// `post_send` returns. At most `max_inline_data` bytes. Unlike raw
    /// verbs, the SGEs still need a registered region of the QP's PD and its
    /// lkey: the library reads them, so `post_send` checks them and refuses
    /// an SGE outside its region.
    pub inline: bool,
    /// Wait for earlier RDMA READs and atomics to finish before starting.
    pub fence: bool,
}

impl SendFlags {
    /// Signaled, not inline.
    pub const SIGNALED: SendFlags = SendFlags { signaled: true, inline: false, fence: false };
    /// Unsignaled, not inline.
    pub const UNSIGNALED: SendFlags = SendFlags { signaled: false, inline: false, fence: false };
}

/// A send-queue work request (`struct ibv_send_wr`, one at a time: Rust
/// slices replace the `next` chain).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SendWr<'a> {
    /// Returned in the completion.
    pub wr_id: u64,
    /// Opcode and its fields.
    pub op: SendOp,
    /// Local buffers: gathered for sends/writes, scattered into for reads and
    /// atomics.
    pub sg_list: &'a [Sge],
    /// Flags.
    pub flags: SendFlags,
}

/// A receive-queue work request (`struct ibv_recv_wr`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecvWr<'a> {
    /// Returned in the completion.
    pub wr_id: u64,
    /// Where an incoming SEND's payload is scattered. May be empty for
    /// receives that only catch RDMA_WRITE_WITH_IMM.
    pub sg_list: &'a [Sge],
}
