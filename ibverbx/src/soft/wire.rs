//! The soft provider's wire format, sans-IO: encoding and validating frames.
//!
//! A connection carries one requester QP's traffic to one responder QP.
//! It opens with a [`Hello`] (magic, version, the target QP's token) and a
//! [`HelloStatus`] reply; then requests flow one way and responses the other, each
//! a fixed 48-byte header optionally followed by a payload whose length
//! the header states. Every field is checked here before anything acts on it.
//!
//! Header layout (little-endian): `kind u8 | flags u8 | reserved u16 | psn u32
//! | len u32 | imm u32 | raddr u64 | rkey u32 | reserved u32 | a u64 | b u64`.

use std::fmt;

/// Size of every frame header.
pub const HEADER_LEN: usize = 48;
/// Size of the hello and its reply.
pub const HELLO_LEN: usize = 48;
/// First bytes of every connection.
pub const MAGIC: [u8; 8] = *b"RMACSOFT";
/// Wire protocol version.
pub const VERSION: u16 = 1;

/// The opening message of a connection. `Debug` leaves the token out: it
/// admits a connection and must not reach logs.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Hello {
    /// The connecting (requester) QP.
    pub src_qpn: u32,
    /// The QP being connected to.
    pub dst_qpn: u32,
    /// The target QP's token from its endpoint.
    pub token: [u8; 16],
    /// Requester's RNR retry budget (7 = forever).
    pub rnr_retry: u8,
}

impl std::fmt::Debug for Hello {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Hello { src_qpn, dst_qpn, token: _, rnr_retry } = self;
        f.debug_struct("Hello")
            .field("src_qpn", src_qpn)
            .field("dst_qpn", dst_qpn)
            .field("token", &format_args!("<redacted>"))
            .field("rnr_retry", rnr_retry)
            .finish()
    }
}

/// Why a connection was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HelloStatus {
    /// Accepted.
    Ok,
    /// No such QP, or the token does not match.
    BadToken,
    /// The QP cannot accept a connection (destroyed, in error).
    BadState,
}

/// What a request or response is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Frame {
    /// RDMA WRITE; `len` payload bytes follow.
    Write {
        /// Sequence number.
        psn: u32,
        /// Target address.
        raddr: u64,
        /// Target key.
        rkey: u32,
        /// Payload length.
        len: u32,
        /// Immediate (WRITE_WITH_IMM).
        imm: Option<u32>,
    },
    /// SEND; `len` payload bytes follow.
    Send {
        /// Sequence number.
        psn: u32,
        /// Payload length.
        len: u32,
        /// Immediate (SEND_WITH_IMM).
        imm: Option<u32>,
    },
    /// RDMA READ request.
    ReadReq {
        /// Sequence number.
        psn: u32,
        /// Source address.
        raddr: u64,
        /// Source key.
        rkey: u32,
        /// Bytes to read.
        len: u32,
    },
    /// Atomic request.
    Atomic {
        /// Sequence number.
        psn: u32,
        /// Target address.
        raddr: u64,
        /// Target key.
        rkey: u32,
        /// True: compare-and-swap; false: fetch-and-add.
        cmp_swap: bool,
        /// Addend or compare value.
        a: u64,
        /// Swap value.
        b: u64,
    },
    /// A WRITE_WITH_IMM whose `len` bytes the requester already placed
    /// directly in shared memory: consume a receive and complete it.
    Notify {
        /// Sequence number.
        psn: u32,
        /// Bytes written.
        len: u32,
        /// Immediate.
        imm: u32,
    },
    /// Positive acknowledgement of `psn`.
    Ack {
        /// Sequence number.
        psn: u32,
    },
    /// READ response; `len` payload bytes follow.
    ReadResp {
        /// Sequence number.
        psn: u32,
        /// Payload length.
        len: u32,
    },
    /// Atomic response carrying the original value.
    AtomicResp {
        /// Sequence number.
        psn: u32,
        /// Value before the operation.
        orig: u64,
    },
    /// Negative acknowledgement: the request failed at the responder.
    Nak {
        /// Sequence number.
        psn: u32,
        /// Why.
        syndrome: Syndrome,
    },
    /// Receiver not ready: no receive posted yet for `psn`; sent once per
    /// RNR timer period while the responder waits.
    RnrWait {
        /// Sequence number.
        psn: u32,
    },
}

/// Reason of a NAK.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Syndrome {
    /// Bad key, bounds or access.
    RemoteAccess = 1,
    /// Invalid request (message longer than the receive, misaligned atomic).
    InvalidRequest = 2,
    /// Operation failed at the responder (local protection error there).
    RemoteOp = 3,
}

const K_WRITE: u8 = 1;
const K_SEND: u8 = 2;
const K_READ_REQ: u8 = 3;
const K_ATOMIC: u8 = 4;
const K_NOTIFY: u8 = 5;
const K_ACK: u8 = 0x81;
const K_READ_RESP: u8 = 0x82;
const K_ATOMIC_RESP: u8 = 0x83;
const K_NAK: u8 = 0x84;
const K_RNR_WAIT: u8 = 0x85;

const F_IMM: u8 = 1;
const F_CMP_SWAP: u8 = 2;

/// A header that failed validation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WireError(pub String);

impl fmt::Display for WireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for WireError {}

fn err(s: impl Into<String>) -> WireError {
    WireError(s.into())
}

struct Raw {
    kind: u8,
    flags: u8,
    reserved: u16,
    psn: u32,
    len: u32,
    imm: u32,
    raddr: u64,
    rkey: u32,
    reserved2: u32,
    a: u64,
    b: u64,
}

fn u16_at(b: &[u8], o: usize) -> u16 {
    u16::from_le_bytes([b[o], b[o + 1]])
}
fn u32_at(b: &[u8], o: usize) -> u32 {
    u32::from_le_bytes(b[o..o + 4].try_into().expect("4 bytes"))
}
fn u64_at(b: &[u8], o: usize) -> u64 {
    u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"))
}

impl Raw {
    fn parse(b: &[u8; HEADER_LEN]) -> Raw {
        Raw {
            kind: b[0],
            flags: b[1],
            reserved: u16_at(b, 2),
            psn: u32_at(b, 4),
            len: u32_at(b, 8),
            imm: u32_at(b, 12),
            raddr: u64_at(b, 16),
            rkey: u32_at(b, 24),
            reserved2: u32_at(b, 28),
            a: u64_at(b, 32),
            b: u64_at(b, 40),
        }
    }

    fn write(&self) -> [u8; HEADER_LEN] {
        let mut o = [0u8; HEADER_LEN];
        o[0] = self.kind;
        o[1] = self.flags;
        o[2..4].copy_from_slice(&self.reserved.to_le_bytes());
        o[4..8].copy_from_slice(&self.psn.to_le_bytes());
        o[8..12].copy_from_slice(&self.len.to_le_bytes());
        o[12..16].copy_from_slice(&self.imm.to_le_bytes());
        o[16..24].copy_from_slice(&self.raddr.to_le_bytes());
        o[24..28].copy_from_slice(&self.rkey.to_le_bytes());
        o[28..32].copy_from_slice(&self.reserved2.to_le_bytes());
        o[32..40].copy_from_slice(&self.a.to_le_bytes());
        o[40..48].copy_from_slice(&self.b.to_le_bytes());
        o
    }

    fn zero(kind: u8, psn: u32) -> Raw {
        Raw { kind, flags: 0, reserved: 0, psn, len: 0, imm: 0, raddr: 0, rkey: 0, reserved2: 0, a: 0, b: 0 }
    }
}

impl Frame {
    /// Bytes of payload that follow the header on the wire.
    pub fn payload_len(&self) -> usize {
        match *self {
            Frame::Write { len, .. } | Frame::Send { len, .. } | Frame::ReadResp { len, .. } => len as usize,
            _ => 0,
        }
    }

    /// True for frames a requester sends; false for responses.
    pub fn is_request(&self) -> bool {
        matches!(
            self,
            Frame::Write { .. }
                | Frame::Send { .. }
                | Frame::ReadReq { .. }
                | Frame::Atomic { .. }
                | Frame::Notify { .. }
        )
    }

    /// The frame's sequence number.
    pub fn psn(&self) -> u32 {
        match *self {
            Frame::Write { psn, .. }
            | Frame::Send { psn, .. }
            | Frame::ReadReq { psn, .. }
            | Frame::Atomic { psn, .. }
            | Frame::Notify { psn, .. }
            | Frame::Ack { psn }
            | Frame::ReadResp { psn, .. }
            | Frame::AtomicResp { psn, .. }
            | Frame::Nak { psn, .. }
            | Frame::RnrWait { psn } => psn,
        }
    }

    /// Encodes the header.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let raw = match *self {
            Frame::Write { psn, raddr, rkey, len, imm } => Raw {
                flags: if imm.is_some() { F_IMM } else { 0 },
                len,
                imm: imm.unwrap_or(0),
                raddr,
                rkey,
                ..Raw::zero(K_WRITE, psn)
            },
            Frame::Send { psn, len, imm } => Raw {
                flags: if imm.is_some() { F_IMM } else { 0 },
                len,
                imm: imm.unwrap_or(0),
                ..Raw::zero(K_SEND, psn)
            },
            Frame::ReadReq { psn, raddr, rkey, len } => Raw { len, raddr, rkey, ..Raw::zero(K_READ_REQ, psn) },
            Frame::Atomic { psn, raddr, rkey, cmp_swap, a, b } => Raw {
                flags: if cmp_swap { F_CMP_SWAP } else { 0 },
                len: 8,
                raddr,
                rkey,
                a,
                b,
                ..Raw::zero(K_ATOMIC, psn)
            },
            Frame::Notify { psn, len, imm } => Raw { flags: F_IMM, len, imm, ..Raw::zero(K_NOTIFY, psn) },
            Frame::Ack { psn } => Raw::zero(K_ACK, psn),
            Frame::ReadResp { psn, len } => Raw { len, ..Raw::zero(K_READ_RESP, psn) },
            Frame::AtomicResp { psn, orig } => Raw { len: 8, a: orig, ..Raw::zero(K_ATOMIC_RESP, psn) },
            Frame::Nak { psn, syndrome } => Raw { imm: syndrome as u32, ..Raw::zero(K_NAK, psn) },
            Frame::RnrWait { psn } => Raw::zero(K_RNR_WAIT, psn),
        };
        raw.write()
    }

    /// Decodes and validates a header. `max_msg` bounds every length.
    /// Fields a frame kind does not use must be zero.
    pub fn decode(b: &[u8; HEADER_LEN], max_msg: u32) -> Result<Frame, WireError> {
        let r = Raw::parse(b);
        if r.reserved != 0 || r.reserved2 != 0 {
            return Err(err(format!("reserved header fields are not zero (kind {:#x})", r.kind)));
        }
        let check_len = |len: u32| {
            if len > max_msg {
                Err(err(format!("length {len} exceeds the maximum message size {max_msg}")))
            } else {
                Ok(len)
            }
        };
        let check_range = |raddr: u64, len: u32| {
            if raddr.checked_add(len as u64).is_none() {
                Err(err(format!("address range {raddr:#x}+{len} wraps around")))
            } else {
                Ok(())
            }
        };
        let only_flags = |allowed: u8| {
            if r.flags & !allowed != 0 {
                Err(err(format!("unknown flags {:#x} for kind {:#x}", r.flags, r.kind)))
            } else {
                Ok(())
            }
        };
        let unused_zero = |ok: bool| {
            if ok {
                Ok(())
            } else {
                Err(err(format!("unused fields set in kind {:#x}", r.kind)))
            }
        };
        let f = match r.kind {
            K_WRITE => {
                only_flags(F_IMM)?;
                let len = check_len(r.len)?;
                check_range(r.raddr, len)?;
                unused_zero(r.a == 0 && r.b == 0 && (r.flags & F_IMM != 0 || r.imm == 0))?;
                Frame::Write {
                    psn: r.psn,
                    raddr: r.raddr,
                    rkey: r.rkey,
                    len,
                    imm: (r.flags & F_IMM != 0).then_some(r.imm),
                }
            }
            K_SEND => {
                only_flags(F_IMM)?;
                let len = check_len(r.len)?;
                unused_zero(
                    r.raddr == 0 && r.rkey == 0 && r.a == 0 && r.b == 0 && (r.flags & F_IMM != 0 || r.imm == 0),
                )?;
                Frame::Send { psn: r.psn, len, imm: (r.flags & F_IMM != 0).then_some(r.imm) }
            }
            K_READ_REQ => {
                only_flags(0)?;
                let len = check_len(r.len)?;
                check_range(r.raddr, len)?;
                unused_zero(r.imm == 0 && r.a == 0 && r.b == 0)?;
                Frame::ReadReq { psn: r.psn, raddr: r.raddr, rkey: r.rkey, len }
            }
            K_ATOMIC => {
                only_flags(F_CMP_SWAP)?;
                if r.len != 8 {
                    return Err(err(format!("atomic length {} is not 8", r.len)));
                }
                check_range(r.raddr, 8)?;
                let cmp_swap = r.flags & F_CMP_SWAP != 0;
                unused_zero(r.imm == 0 && (cmp_swap || r.b == 0))?;
                Frame::Atomic { psn: r.psn, raddr: r.raddr, rkey: r.rkey, cmp_swap, a: r.a, b: r.b }
            }
            K_NOTIFY => {
                only_flags(F_IMM)?;
                if r.flags != F_IMM {
                    return Err(err("notify without the immediate flag"));
                }
                let len = check_len(r.len)?;
                unused_zero(r.raddr == 0 && r.rkey == 0 && r.a == 0 && r.b == 0)?;
                Frame::Notify { psn: r.psn, len, imm: r.imm }
            }
            K_ACK | K_RNR_WAIT => {
                only_flags(0)?;
                unused_zero(r.len == 0 && r.imm == 0 && r.raddr == 0 && r.rkey == 0 && r.a == 0 && r.b == 0)?;
                if r.kind == K_ACK {
                    Frame::Ack { psn: r.psn }
                } else {
                    Frame::RnrWait { psn: r.psn }
                }
            }
            K_READ_RESP => {
                only_flags(0)?;
                let len = check_len(r.len)?;
                unused_zero(r.imm == 0 && r.raddr == 0 && r.rkey == 0 && r.a == 0 && r.b == 0)?;
                Frame::ReadResp { psn: r.psn, len }
            }
            K_ATOMIC_RESP => {
                only_flags(0)?;
                unused_zero(r.len == 8 && r.imm == 0 && r.raddr == 0 && r.rkey == 0 && r.b == 0)?;
                Frame::AtomicResp { psn: r.psn, orig: r.a }
            }
            K_NAK => {
                only_flags(0)?;
                unused_zero(r.len == 0 && r.raddr == 0 && r.rkey == 0 && r.a == 0 && r.b == 0)?;
                let syndrome = match r.imm {
                    1 => Syndrome::RemoteAccess,
                    2 => Syndrome::InvalidRequest,
                    3 => Syndrome::RemoteOp,
                    s => return Err(err(format!("unknown NAK syndrome {s}"))),
                };
                Frame::Nak { psn: r.psn, syndrome }
            }
            k => return Err(err(format!("unknown frame kind {k:#x}"))),
        };
        Ok(f)
    }
}

impl Hello {
    /// Encodes the hello.
    pub fn encode(&self) -> [u8; HELLO_LEN] {
        let mut o = [0u8; HELLO_LEN];
        o[0..8].copy_from_slice(&MAGIC);
        o[8..10].copy_from_slice(&VERSION.to_le_bytes());
        o[10] = self.rnr_retry;
        o[12..16].copy_from_slice(&self.src_qpn.to_le_bytes());
        o[16..20].copy_from_slice(&self.dst_qpn.to_le_bytes());
        o[20..36].copy_from_slice(&self.token);
        o
    }

    /// Decodes and validates a hello.
    pub fn decode(b: &[u8; HELLO_LEN]) -> Result<Hello, WireError> {
        if b[0..8] != MAGIC {
            return Err(err("bad magic: not an rmacomm soft-provider connection"));
        }
        let v = u16_at(b, 8);
        if v != VERSION {
            return Err(err(format!("protocol version {v} is not supported (this side speaks {VERSION})")));
        }
        if b[10] > 7 || b[11] != 0 || b[36..].iter().any(|&x| x != 0) {
            return Err(err("malformed hello"));
        }
        Ok(Hello {
            rnr_retry: b[10],
            src_qpn: u32_at(b, 12),
            dst_qpn: u32_at(b, 16),
            token: b[20..36].try_into().expect("16 bytes"),
        })
    }
}

impl HelloStatus {
    /// Encodes the reply to a hello.
    pub fn encode(self) -> [u8; HELLO_LEN] {
        let mut o = [0u8; HELLO_LEN];
        o[0..8].copy_from_slice(&MAGIC);
        o[8..10].copy_from_slice(&VERSION.to_le_bytes());
        o[12] = match self {
            HelloStatus::Ok => 0,
            HelloStatus::BadToken => 1,
            HelloStatus::BadState => 2,
        };
        o
    }

    /// Decodes a reply to a hello.
    pub fn decode(b: &[u8; HELLO_LEN]) -> Result<HelloStatus, WireError> {
        if b[0..8] != MAGIC || u16_at(b, 8) != VERSION {
            return Err(err("bad hello reply: not an rmacomm soft-provider peer of this version"));
        }
        match b[12] {
            0 => Ok(HelloStatus::Ok),
            1 => Ok(HelloStatus::BadToken),
            2 => Ok(HelloStatus::BadState),
            s => Err(err(format!("unknown hello status {s}"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn all_frames() -> Vec<Frame> {
        vec![
            Frame::Write { psn: 1, raddr: 0x1000, rkey: 9, len: 77, imm: None },
            Frame::Write { psn: 2, raddr: 0x1000, rkey: 9, len: 0, imm: Some(0xdead_beef) },
            Frame::Send { psn: 3, len: 5, imm: None },
            Frame::Send { psn: 3, len: 5, imm: Some(4) },
            Frame::ReadReq { psn: 4, raddr: 8, rkey: 1, len: 4096 },
            Frame::Atomic { psn: 5, raddr: 16, rkey: 2, cmp_swap: true, a: 1, b: 2 },
            Frame::Atomic { psn: 5, raddr: 16, rkey: 2, cmp_swap: false, a: 1, b: 0 },
            Frame::Notify { psn: 6, len: 10, imm: 11 },
            Frame::Ack { psn: 7 },
            Frame::ReadResp { psn: 8, len: 12 },
            Frame::AtomicResp { psn: 9, orig: u64::MAX },
            Frame::Nak { psn: 10, syndrome: Syndrome::RemoteAccess },
            Frame::RnrWait { psn: 11 },
        ]
    }

    #[test]
    fn every_frame_round_trips() {
        for f in all_frames() {
            assert_eq!(Frame::decode(&f.encode(), 1 << 30), Ok(f));
        }
    }

    #[test]
    fn lengths_over_the_limit_are_rejected() {
        let f = Frame::Write { psn: 1, raddr: 0, rkey: 0, len: 1000, imm: None };
        assert!(Frame::decode(&f.encode(), 999).is_err());
        let f = Frame::Write { psn: 1, raddr: u64::MAX - 10, rkey: 0, len: 100, imm: None };
        assert!(Frame::decode(&f.encode(), 1 << 30).is_err());
    }

    #[test]
    fn hello_debug_hides_the_token() {
        let token = [0xde, 0xad, 0xbe, 0xef, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9];
        let d = format!("{:?}", Hello { src_qpn: 1, dst_qpn: 2, token, rnr_retry: 3 });
        assert!(d.contains("<redacted>") && d.contains("dst_qpn: 2"), "{d}");
        // The derived Debug would print the bytes in decimal: 222, 173, ...
        assert!(!d.contains("222") && !d.contains("173"), "the token leaked: {d}");
    }

    #[test]
    fn hello_round_trips_and_rejects_garbage() {
        let h = Hello { src_qpn: 1, dst_qpn: 2, token: [7; 16], rnr_retry: 3 };
        assert_eq!(Hello::decode(&h.encode()), Ok(h));
        let mut bad = h.encode();
        bad[0] = b'X';
        assert!(Hello::decode(&bad).is_err());
        let mut bad = h.encode();
        bad[8] = 99;
        assert!(Hello::decode(&bad).unwrap_err().0.contains("version"));
        for s in [HelloStatus::Ok, HelloStatus::BadToken, HelloStatus::BadState] {
            assert_eq!(HelloStatus::decode(&s.encode()), Ok(s));
        }
    }

    proptest! {
        #[test]
        fn decode_never_panics_and_accepted_frames_reencode(bytes in proptest::array::uniform32(any::<u8>()), tail in proptest::array::uniform16(any::<u8>())) {
            let mut b = [0u8; HEADER_LEN];
            b[..32].copy_from_slice(&bytes);
            b[32..].copy_from_slice(&tail);
            if let Ok(f) = Frame::decode(&b, 1 << 30) {
                prop_assert_eq!(f.encode(), b);
            }
            let mut h = [0u8; HELLO_LEN];
            h[..32].copy_from_slice(&bytes);
            let _ = Hello::decode(&h);
        }

        #[test]
        fn mutated_valid_frames_are_rejected_or_reencode(idx in 0usize..13, pos in 0usize..HEADER_LEN, val in any::<u8>()) {
            let mut b = all_frames()[idx].encode();
            b[pos] = val;
            if let Ok(f) = Frame::decode(&b, 1 << 30) {
                prop_assert_eq!(f.encode(), b);
            }
        }
    }
}
