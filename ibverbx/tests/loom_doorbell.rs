//! Model checking of the doorbell protocol (`src/soft/doorbell_proto.rs`,
//! included here with loom's atomics): every interleaving (and every
//! reordering the memory model allows) of a requester and the owner QP on
//! one slot: publish against claim and retract, publish against close, an
//! old connection's record against a new connection's, and both wake-up
//! handshakes (a sleeper is always either seen or rung).

#![allow(dead_code, unreachable_pub, missing_docs)]

mod atomics {
    pub(crate) use loom::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
}

#[path = "../src/soft/doorbell_proto.rs"]
mod proto;

use loom::sync::atomic::Ordering;
use loom::sync::Arc;
use proto::{Claim, Published, Slot};

fn open_slot() -> Arc<Slot> {
    let s = Slot::default();
    s.open.store(1, Ordering::Relaxed);
    Arc::new(s)
}

fn publish(s: &Slot, imm: u32, gen: u32) -> Published {
    proto::publish(s, imm, 8, gen, |_| true, |_| {})
}

/// A record is either claimed by the owner or retracted by its requester,
/// never both and never neither; a claim carries the record's fields.
#[test]
fn claim_against_retract() {
    loom::model(|| {
        let s = open_slot();
        let o = {
            let s = s.clone();
            loom::thread::spawn(move || match proto::claim(&s, true, || Some(())) {
                Claim::Claimed { imm, len, .. } => Some((imm, len)),
                _ => None,
            })
        };
        let Published::Posted(k) = publish(&s, 7, 0) else { panic!("a fresh open slot refused a record") };
        let r = proto::retract(&s, k);
        let claimed = o.join().unwrap();
        match (claimed, r) {
            (Some(f), Err(true)) => assert_eq!(f, (7, 8), "claimed with another record's fields"),
            (None, Ok(())) => {}
            other => panic!("record {k}: claim and retract disagree: {other:?}"),
        }
    });
}

/// A record published while the owner closes never stays posted: one side
/// voids it, and the requester learns it was not claimed.
#[test]
fn publish_against_close() {
    loom::model(|| {
        let s = open_slot();
        let o = {
            let s = s.clone();
            loom::thread::spawn(move || proto::set_open(&s, false))
        };
        let p = publish(&s, 1, 0);
        o.join().unwrap();
        assert_ne!(s.state.load(Ordering::SeqCst) & 3, proto::POSTED, "a record stayed posted in a closed slot");
        if let Published::Posted(k) | Published::Voided(k) = p {
            assert_eq!(proto::retract(&s, k), Err(false), "a voided record must read as neither ours nor claimed");
        }
    });
}

/// An old connection's record, voided when the owner starts a new life,
/// never reads as claimed, whatever the new connection's records do (record
/// ids are unique per slot).
#[test]
fn an_old_record_never_looks_claimed() {
    loom::model(|| {
        let s = open_slot();
        let Published::Posted(old) = publish(&s, 1, 0) else { panic!("refused") };
        let o = {
            let s = s.clone();
            loom::thread::spawn(move || {
                proto::new_life(&s);
                for _ in 0..2 {
                    let _ = proto::claim(&s, true, || Some(()));
                }
            })
        };
        let b = {
            let s = s.clone();
            loom::thread::spawn(move || match publish(&s, 2, 1) {
                Published::Posted(k) | Published::Voided(k) => Some(k),
                Published::No => None,
            })
        };
        let seen = proto::claimed(&s, old);
        o.join().unwrap();
        let new = b.join().unwrap();
        assert!(!seen && !proto::claimed(&s, old), "the voided record {old} reads as claimed");
        assert_ne!(new, Some(old), "a record id was reused");
    });
}

/// The owner arms its receive CQ and polls once more; the requester
/// publishes and checks the flag: the record is claimed or the owner rung.
#[test]
fn a_sleeping_owner_is_seen_or_rung() {
    loom::model(|| {
        let s = open_slot();
        let o = {
            let s = s.clone();
            loom::thread::spawn(move || {
                proto::arm_rx(&s);
                matches!(proto::claim(&s, true, || Some(())), Claim::Claimed { .. })
            })
        };
        let posted = matches!(publish(&s, 3, 0), Published::Posted(_));
        let rang = posted && proto::ring_rx(&s);
        let claimed = o.join().unwrap();
        assert!(!posted || claimed || rang, "a record was published to a sleeping owner that nobody woke");
    });
}

/// The requester arms its send CQ and checks its record once more; the
/// owner claims and checks the flag: the claim is seen or the requester
/// rung.
#[test]
fn a_sleeping_requester_is_seen_or_rung() {
    loom::model(|| {
        let s = open_slot();
        let Published::Posted(k) = publish(&s, 4, 0) else { panic!("refused") };
        let o = {
            let s = s.clone();
            loom::thread::spawn(move || {
                let c = matches!(proto::claim(&s, true, || Some(())), Claim::Claimed { .. });
                c && proto::ring_tx(&s)
            })
        };
        proto::arm_tx(&s);
        let seen = proto::claimed(&s, k);
        let rang = o.join().unwrap();
        let claimed = proto::claimed(&s, k);
        assert!(!claimed || seen || rang, "record {k} was claimed while its requester slept, and nobody rang it");
    });
}
