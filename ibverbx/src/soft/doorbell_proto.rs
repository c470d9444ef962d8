//! The doorbell protocol on one slot, as plain functions over its atomics:
//! every transition the requester and the owner make (publish, claim,
//! retract, void on close or reset, both wake-up handshakes), and nothing
//! else — no sockets, no CQs, no clocks. `doorbell.rs` places slots in
//! shared memory; `requester/` and `qp/` drive these functions;
//! `tests/loom_doorbell.rs` model-checks them with loom by including this
//! file with loom's atomics in place of std's (`super::atomics`).
//!
//! States of [`Slot::state`]: `seq << 2 | st`, `st` one of [`POSTED`],
//! [`CLAIMED`], [`RETRACTED`]; 0 is a slot never used. Record ids (`seq`)
//! come from the slot's own counter, so they are unique across every
//! requester that ever wrote the slot (an old connection's and a new one's
//! alike): a record voided for one requester can never look claimed to it
//! because another requester's record with the same id was claimed.

use super::atomics::{fence, AtomicU32, AtomicU64, Ordering};

/// A record is published and not yet taken.
pub(crate) const POSTED: u64 = 1;
/// The owner took it (pushed its receive completion).
pub(crate) const CLAIMED: u64 = 2;
/// The requester took it back (it goes through the connection), or it was
/// voided (the owner left service, or it was written for an earlier life).
pub(crate) const RETRACTED: u64 = 3;

/// The state word of record `seq` in state `st`.
pub(crate) fn word(seq: u64, st: u64) -> u64 {
    (seq << 2) | st
}

/// Whether a requester may take the slot for a new record: never used, or
/// its last record claimed or retracted.
pub(crate) fn is_free(state: u64) -> bool {
    state == 0 || state & 3 == CLAIMED || state & 3 == RETRACTED
}

/// One QP's doorbell. Written by two processes: atomics only.
#[repr(C)]
#[derive(Debug, Default)]
pub(crate) struct Slot {
    // First cache line: what a polling receiver reads on every poll.
    /// `seq << 2 | POSTED/CLAIMED/RETRACTED` (0: never used).
    pub(crate) state: AtomicU64,
    /// Receives the owner has posted (a requester posts only when one is
    /// there, so that a record never waits for a receive).
    pub(crate) rq_len: AtomicU32,
    /// 1 while the owner accepts records (QP in RTR or RTS).
    pub(crate) open: AtomicU32,
    /// The owner's receive CQ is armed: ring its event fd after publishing.
    pub(crate) rx_armed: AtomicU32,
    /// The requester's send CQ is armed: ring its event fd after claiming.
    pub(crate) tx_armed: AtomicU32,
    _pad: [AtomicU32; 10],
    // Second cache line: the record and the rarely changing rest.
    /// Held by the requester writing a record (a requester of an earlier
    /// connection to the same QP may still try), so that the fields of two
    /// records never mix; apart from the line `state` is on, so that taking
    /// it does not disturb a polling receiver.
    pub(crate) wlock: AtomicU32,
    /// The record: immediate and byte count (written before `state`).
    pub(crate) imm: AtomicU32,
    pub(crate) len: AtomicU32,
    /// The owner QP's life (bumped at every reset); a record is claimed
    /// only in the life it was written for (`rec_gen`).
    pub(crate) rec_gen: AtomicU32,
    pub(crate) gen: AtomicU32,
    /// The owner cannot ring the requester (it was not given the
    /// requester's send CQ event fd): the requester stops using the slot.
    pub(crate) no_tx_wake: AtomicU32,
    _reserved: AtomicU32,
    /// The last record id handed out (ids are unique per slot, whoever
    /// the requester).
    pub(crate) last_seq: AtomicU64,
    /// Unique ids of the owner's receive CQ and the requester's send CQ.
    pub(crate) rx_cq: AtomicU64,
    pub(crate) tx_cq: AtomicU64,
}

/// What [`publish`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Published {
    /// Record `k` is posted; the caller rings the owner if [`ring_rx`] says.
    Posted(u64),
    /// Record `k` went out but the owner had closed meanwhile: it is void
    /// (the caller's WR fails, as a request to a vanished QP does).
    Voided(u64),
    /// Not published (another writer holds the slot, the slot is not free,
    /// or `enqueue` declined): the WR goes through the connection.
    No,
}

/// Requester: publishes a record (`imm`, `len`) for the owner's life `gen`.
/// `enqueue(k)` runs before the record becomes visible (so that a claim
/// finds the WR it completes) and may decline; `dequeue(k)` undoes it if
/// the record could not be made visible after all.
pub(crate) fn publish(
    s: &Slot,
    imm: u32,
    len: u32,
    gen: u32,
    enqueue: impl FnOnce(u64) -> bool,
    dequeue: impl FnOnce(u64),
) -> Published {
    if s.wlock.compare_exchange(0, 1, Ordering::Acquire, Ordering::Relaxed).is_err() {
        return Published::No;
    }
    let cur = s.state.load(Ordering::Acquire);
    if !is_free(cur) {
        s.wlock.store(0, Ordering::Release);
        return Published::No;
    }
    let k = s.last_seq.fetch_add(1, Ordering::AcqRel) + 1;
    if !enqueue(k) {
        s.wlock.store(0, Ordering::Release);
        return Published::No;
    }
    s.imm.store(imm, Ordering::Relaxed);
    s.len.store(len, Ordering::Relaxed);
    s.rec_gen.store(gen, Ordering::Relaxed);
    if s.state.compare_exchange(cur, word(k, POSTED), Ordering::SeqCst, Ordering::Acquire).is_err() {
        // Only the owner changes a free state, and it does not: defensive.
        dequeue(k);
        s.wlock.store(0, Ordering::Release);
        return Published::No;
    }
    s.wlock.store(0, Ordering::Release);
    // Paired with `close`: either the owner sees the record and voids it,
    // or we see the slot closed and void it ourselves.
    fence(Ordering::SeqCst);
    if s.open.load(Ordering::SeqCst) == 0 {
        let _ = s.state.compare_exchange(word(k, POSTED), word(k, RETRACTED), Ordering::AcqRel, Ordering::Acquire);
        return Published::Voided(k);
    }
    Published::Posted(k)
}

/// Requester, after [`publish`]: whether the owner sleeps on its CQ and
/// must be rung (true once per arming).
pub(crate) fn ring_rx(s: &Slot) -> bool {
    fence(Ordering::SeqCst);
    s.rx_armed.load(Ordering::Relaxed) != 0 && s.rx_armed.swap(0, Ordering::AcqRel) != 0
}

/// Owner: its receive CQ is about to sleep; the caller polls (claims) once
/// more after this, so that a record published before the flag was seen is
/// not missed.
pub(crate) fn arm_rx(s: &Slot) {
    s.rx_armed.store(1, Ordering::SeqCst);
    fence(Ordering::SeqCst);
}

/// What [`claim`] found.
#[derive(Debug)]
pub(crate) enum Claim<G> {
    /// Nothing to take now.
    Nothing,
    /// A record of an earlier life of the QP: voided.
    Stale,
    /// Taken: the caller completes a receive with `imm`/`len` while it still
    /// holds `guard` (its receive queue).
    Claimed { imm: u32, len: u32, guard: G },
}

/// Owner: takes a posted record if `in_service` (RTR/RTS) and a receive is
/// there. `take_rq` locks the receive queue and returns its guard when it is
/// not empty; the claim is made while the guard is held.
pub(crate) fn claim<G>(s: &Slot, in_service: bool, take_rq: impl FnOnce() -> Option<G>) -> Claim<G> {
    let cur = s.state.load(Ordering::Acquire);
    if cur & 3 != POSTED || !in_service {
        return Claim::Nothing;
    }
    let (imm, len) = (s.imm.load(Ordering::Relaxed), s.len.load(Ordering::Relaxed));
    if s.rec_gen.load(Ordering::Relaxed) != s.gen.load(Ordering::Acquire) {
        let _ = s.state.compare_exchange(cur, cur - POSTED + RETRACTED, Ordering::AcqRel, Ordering::Acquire);
        return Claim::Stale;
    }
    let Some(guard) = take_rq() else { return Claim::Nothing };
    // The fields read above belong to this record only if the word is
    // unchanged (a record retracted and another posted fails here).
    if s.state.compare_exchange(cur, cur - POSTED + CLAIMED, Ordering::AcqRel, Ordering::Acquire).is_err() {
        return Claim::Nothing;
    }
    Claim::Claimed { imm, len, guard }
}

/// Owner, after a claim: whether the requester sleeps on its send CQ and
/// must be rung (true once per arming).
pub(crate) fn ring_tx(s: &Slot) -> bool {
    fence(Ordering::SeqCst);
    s.tx_armed.load(Ordering::Relaxed) != 0 && s.tx_armed.swap(0, Ordering::AcqRel) != 0
}

/// Requester: its send CQ is about to sleep; it checks [`claimed`] once
/// more after this.
pub(crate) fn arm_tx(s: &Slot) {
    s.tx_armed.store(1, Ordering::SeqCst);
    fence(Ordering::SeqCst);
}

/// Requester: whether its record `k` was claimed.
pub(crate) fn claimed(s: &Slot, k: u64) -> bool {
    s.state.load(Ordering::Acquire) == word(k, CLAIMED)
}

/// Requester: takes record `k` back if the owner has not claimed it. `Ok`
/// when retracted; `Err(true)` when it was claimed; `Err(false)` when it
/// was voided (or is not ours).
pub(crate) fn retract(s: &Slot, k: u64) -> Result<(), bool> {
    match s.state.compare_exchange(word(k, POSTED), word(k, RETRACTED), Ordering::AcqRel, Ordering::Acquire) {
        Ok(_) => Ok(()),
        Err(cur) => Err(cur == word(k, CLAIMED)),
    }
}

/// Owner: accepts records (RTR/RTS) or stops; stopping voids a record
/// still posted, so that no later life of the QP claims it.
pub(crate) fn set_open(s: &Slot, open: bool) {
    s.open.store(u32::from(open), Ordering::SeqCst);
    if !open {
        // Paired with the requester's check of `open` after it publishes.
        fence(Ordering::SeqCst);
        let cur = s.state.load(Ordering::SeqCst);
        if cur & 3 == POSTED {
            let _ = s.state.compare_exchange(cur, cur - POSTED + RETRACTED, Ordering::AcqRel, Ordering::Acquire);
        }
    }
}

/// Owner: a reset starts a new life; records of the old one are stale.
pub(crate) fn new_life(s: &Slot) {
    s.gen.fetch_add(1, Ordering::AcqRel);
}
