//! The notification ring (sans-IO): where a peer's notification messages
//! land in this agent's memory, how a slot is laid out, and the sender's
//! credit arithmetic.
//!
//! Each connection has one ring per direction, in the receiver's registered
//! memory: a 64-byte head whose first word counts the notifications the
//! receiving agent has taken off the ring (`consumed`), then `slots` slots.
//! Notification `seq` (0, 1, 2, … per connection and direction) goes into
//! slot `seq % slots` as one notifying write of header + message: the
//! receiver's `wait_for_write` counts it only once all of it is placed.
//! The sender posts notifications one at a time, each after the previous
//! completed, so the k-th count the receiver sees is notification k: it
//! reads slot `k % slots` and finds `seq == k` there. Before reusing a slot
//! the sender makes sure the receiver has consumed what was in it, reading
//! `consumed` (one aligned 8-byte RDMA READ; only the receiver writes the
//! word, with plain atomic stores) when its cached copy says the ring is
//! full. Not a fetch-and-add of 0: on hardware whose atomics are not
//! atomic with the CPU's, its write-back could undo a newer store of the
//! receiver, and the sender would wait forever on a stale count.

/// The longest notification message, in bytes.
pub const MAX_MESSAGE: usize = 4096;
/// Slot header: seq (u64), message length (u32), magic (u32), little-endian.
pub(crate) const HEADER: usize = 16;
/// Bytes between slots: header + message, rounded to 64.
pub(crate) const SLOT: usize = MAX_MESSAGE + 64;
/// Bytes before the first slot (the `consumed` word lives at 0).
pub(crate) const HEAD: usize = 64;
/// Most slots a ring may have.
pub(crate) const MAX_SLOTS: u32 = 4096;

const MAGIC: u32 = u32::from_le_bytes(*b"RMAN");

/// Bytes of a ring of `slots` slots.
pub(crate) fn ring_len(slots: u32) -> usize {
    HEAD + slots as usize * SLOT
}

/// Where notification `seq` lands.
pub(crate) fn slot_offset(seq: u64, slots: u32) -> usize {
    HEAD + (seq % u64::from(slots)) as usize * SLOT
}

/// Header and message of notification `seq`, as written into its slot.
pub(crate) fn encode(seq: u64, msg: &[u8]) -> Vec<u8> {
    debug_assert!(msg.len() <= MAX_MESSAGE);
    let mut v = Vec::with_capacity(HEADER + msg.len());
    v.extend_from_slice(&seq.to_le_bytes());
    v.extend_from_slice(&(msg.len() as u32).to_le_bytes());
    v.extend_from_slice(&MAGIC.to_le_bytes());
    v.extend_from_slice(msg);
    v
}

/// The message length in a slot's header, which must be notification
/// `expect`'s; else why not (a protocol violation: the connection is
/// dropped).
pub(crate) fn decode_header(h: &[u8; HEADER], expect: u64) -> Result<usize, String> {
    let seq = u64::from_le_bytes(h[0..8].try_into().expect("8 bytes"));
    let len = u32::from_le_bytes(h[8..12].try_into().expect("4 bytes")) as usize;
    let magic = u32::from_le_bytes(h[12..16].try_into().expect("4 bytes"));
    if magic != MAGIC {
        return Err(format!("notification slot of #{expect} holds no notification (magic {magic:#x})"));
    }
    if seq != expect {
        return Err(format!("notification slot of #{expect} holds #{seq}"));
    }
    if len > MAX_MESSAGE {
        return Err(format!("notification #{expect} claims {len} bytes (at most {MAX_MESSAGE})"));
    }
    Ok(len)
}

/// The sender's view of one peer's ring: the next seq, and how many the
/// receiver had consumed when last asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Credit {
    slots: u32,
    next: u64,
    consumed: u64,
}

impl Credit {
    pub(crate) fn new(slots: u32) -> Self {
        Credit { slots, next: 0, consumed: 0 }
    }

    /// The seq the next notification gets.
    pub(crate) fn next(&self) -> u64 {
        self.next
    }

    /// Whether slot `next % slots` is free (its previous notification was
    /// consumed).
    pub(crate) fn has_room(&self) -> bool {
        self.next - self.consumed < u64::from(self.slots)
    }

    /// Records a `consumed` value read from the receiver. A value below
    /// the one known, or above what was sent, is ignored: a counter only
    /// grows, and cannot count what never arrived.
    pub(crate) fn update(&mut self, consumed: u64) {
        if consumed > self.consumed && consumed <= self.next {
            self.consumed = consumed;
        }
    }

    /// Notification `next` landed.
    pub(crate) fn sent(&mut self) {
        self.next += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_round_trip_and_reject_what_is_not_the_expected_notification() {
        let msg = b"request 7 of prefill-1".to_vec();
        let bytes = encode(41, &msg);
        let h: [u8; HEADER] = bytes[..HEADER].try_into().unwrap();
        assert_eq!(decode_header(&h, 41), Ok(msg.len()));
        assert_eq!(&bytes[HEADER..], &msg[..]);
        assert!(decode_header(&h, 40).unwrap_err().contains("holds #41"));
        assert!(decode_header(&[0; HEADER], 0).unwrap_err().contains("magic"));
        let long: [u8; HEADER] = encode(3, &[0; MAX_MESSAGE])[..HEADER].try_into().unwrap();
        assert_eq!(decode_header(&long, 3), Ok(MAX_MESSAGE));
        let mut over = long;
        over[8..12].copy_from_slice(&(MAX_MESSAGE as u32 + 1).to_le_bytes());
        assert!(decode_header(&over, 3).is_err());
    }

    #[test]
    fn layout_keeps_slots_apart_and_aligned() {
        assert_eq!(ring_len(4), 64 + 4 * SLOT);
        assert_eq!(slot_offset(0, 4), HEAD);
        assert_eq!(slot_offset(5, 4), HEAD + SLOT);
        assert!(HEADER + MAX_MESSAGE <= SLOT && SLOT.is_multiple_of(64));
    }

    #[test]
    fn credit_waits_for_consumption_and_ignores_impossible_counters() {
        let mut c = Credit::new(2);
        assert!(c.has_room());
        c.sent();
        c.sent();
        assert!(!c.has_room(), "both slots hold unconsumed notifications");
        c.update(5);
        assert!(!c.has_room(), "a counter above what was sent is ignored");
        c.update(1);
        assert!(c.has_room());
        assert_eq!(c.next(), 2);
        c.sent();
        c.update(0);
        assert!(!c.has_room(), "a stale (smaller) counter changes nothing");
    }
}
