//! Same-host doorbells: the notification of an RDMA WRITE_WITH_IMM through
//! shared memory, so that neither side's progress thread sits between a
//! post and the peer's receive completion.
//!
//! Each context owns a table of 64-byte slots in a memfd; each QP owns one
//! slot, for the notifications *to* it. A same-host requester maps its peer
//! QP's slot and, when its send queue is idle (so that order is trivially
//! kept), copies the payload directly, writes the immediate and length into
//! the slot and publishes it (`POSTED`). The receiving process claims it
//! (`CLAIMED`) when it polls its receive CQ — or its progress thread does,
//! before it takes a receive for any later request of that connection —
//! and the requester's next poll of its send CQ completes the WR.
//!
//! Sleepers are woken through each other's CQ event fd (passed over the
//! attach socket, `attach.rs`): a side that arms its CQ raises a flag in the slot, and
//! the other side rings the event fd when it sees it after publishing or
//! claiming (both sides fence between their store and their load, so one
//! of them always sees the other). A record nobody claims within
//! [`STALE`] is retracted (`RETRACTED`) by the requester's progress thread
//! and sent as an ordinary notify on the connection; so is one still
//! pending when the requester sends anything else. The state word makes
//! each record delivered exactly once.

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::shm::ShmSegment;
use crate::Result;

/// Slots per context: one per live QP. A destroyed QP's slot goes to a later
/// QP in a new life (`gen`), so a stale peer can never reach the later QP
/// through it: its records carry the old life and are voided.
pub(crate) const SLOTS: u32 = 1 << 14;
const SLOT_BYTES: usize = 128;
pub(crate) const TABLE_BYTES: usize = SLOTS as usize * SLOT_BYTES;

/// A record unclaimed for this long goes through the connection instead
/// (longer in unit tests, so that they see which path a record took).
pub(crate) const STALE: Duration = if cfg!(test) { Duration::from_millis(300) } else { Duration::from_millis(2) };

#[cfg(test)]
use super::doorbell_proto::word;
pub(crate) use super::doorbell_proto::{is_free, Slot, POSTED};

const _: () = assert!(std::mem::size_of::<Slot>() <= SLOT_BYTES);
const _: () = assert!(std::mem::offset_of!(Slot, wlock) == 64);

/// A slot in our own table or a peer's mapped one, kept mapped.
#[derive(Clone)]
pub(crate) struct SlotRef {
    ptr: *const Slot,
    _keep: Arc<dyn Send + Sync>,
}

// SAFETY: the slot is accessed through atomics only; `_keep` keeps the
// mapping alive.
unsafe impl Send for SlotRef {}
// SAFETY: as above.
unsafe impl Sync for SlotRef {}

impl std::fmt::Debug for SlotRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlotRef").field("ptr", &self.ptr).finish()
    }
}

impl SlotRef {
    /// Slot `index` of a table mapped at `base`.
    ///
    /// # Safety
    /// `base` must be a page-aligned mapping of at least [`TABLE_BYTES`]
    /// that `keep` keeps alive.
    pub(crate) unsafe fn new(base: *const u8, index: u32, keep: Arc<dyn Send + Sync>) -> Option<SlotRef> {
        if index == 0 || index >= SLOTS {
            return None;
        }
        // SAFETY: index < SLOTS, so the slot lies inside the mapping.
        let ptr = unsafe { base.add(index as usize * SLOT_BYTES) } as *const Slot;
        Some(SlotRef { ptr, _keep: keep })
    }

    pub(crate) fn get(&self) -> &Slot {
        // SAFETY: the mapping is alive (`_keep`), aligned, and a Slot is made
        // of atomics, valid for every bit pattern.
        unsafe { &*self.ptr }
    }
}

/// A context's table.
#[derive(Debug)]
pub(crate) struct DoorbellTable {
    seg: Arc<ShmSegment>,
    next: AtomicU32,
    /// Slots of destroyed QPs, to give to new ones.
    free: std::sync::Mutex<Vec<u32>>,
}

impl DoorbellTable {
    pub(crate) fn new() -> Result<DoorbellTable> {
        // Sparse: pages are allocated as slots are used.
        Ok(DoorbellTable { seg: ShmSegment::create(TABLE_BYTES)?, next: AtomicU32::new(1), free: Default::default() })
    }

    /// The table's descriptor, to pass to a same-host peer.
    pub(crate) fn borrow_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.seg.borrow_fd()
    }

    pub(crate) fn uid(&self) -> u64 {
        self.seg.uid()
    }

    /// A slot for a new QP (a destroyed QP's, or one never used), or
    /// `None` when all are in use (the QP then notifies through its
    /// connection only). A reused slot starts a new life: a requester of the
    /// old QP that still maps it finds its life gone (it stops using the
    /// slot), and a record it still publishes is void (`doorbell_proto`).
    pub(crate) fn alloc(&self) -> Option<(u32, SlotRef)> {
        let reused = self.free.lock().unwrap_or_else(|e| e.into_inner()).pop();
        let i = match reused {
            Some(i) => i,
            None => self.next.fetch_add(1, Ordering::Relaxed),
        };
        let keep: Arc<dyn Send + Sync> = self.seg.clone();
        // SAFETY: the segment is TABLE_BYTES long, page aligned, kept by `keep`.
        let s = unsafe { SlotRef::new(self.seg.ptr(), i, keep) }?;
        if reused.is_some() {
            let slot = s.get();
            super::doorbell_proto::new_life(slot);
            slot.rq_len.store(0, Ordering::Release);
            slot.rx_armed.store(0, Ordering::Release);
            slot.tx_armed.store(0, Ordering::Release);
            slot.no_tx_wake.store(0, Ordering::Release);
            slot.tx_cq.store(0, Ordering::Release);
        }
        Some((i, s))
    }

    /// Gives a destroyed QP's slot back (the QP closed it first).
    pub(crate) fn release(&self, index: u32) {
        self.free.lock().unwrap_or_else(|e| e.into_inner()).push(index);
    }
}

/// Duplicates of peers' CQ event fds, shared by every QP of a context that
/// rings the same CQ (a virtual QP's physical QPs share one): one
/// descriptor per peer CQ instead of one per QP. Entries die with their
/// last user.
#[derive(Debug, Default)]
pub(crate) struct Wakers {
    map: std::sync::Mutex<std::collections::HashMap<(u32, u64), std::sync::Weak<OwnedFd>>>,
}

impl Wakers {
    /// The event fd of process `pid`'s CQ with unique id `cq`, if some QP
    /// of ours already holds it.
    pub(crate) fn lookup(&self, pid: u32, cq: u64) -> Option<Arc<OwnedFd>> {
        self.map.lock().unwrap_or_else(|e| e.into_inner()).get(&(pid, cq)).and_then(std::sync::Weak::upgrade)
    }

    /// Records `fd` as process `pid`'s event fd of CQ `cq`; returns the one
    /// already held if there is one (`fd` is then closed).
    pub(crate) fn insert(&self, pid: u32, cq: u64, fd: OwnedFd) -> Arc<OwnedFd> {
        let mut m = self.map.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(w) = m.get(&(pid, cq)).and_then(std::sync::Weak::upgrade) {
            return w;
        }
        let w = Arc::new(fd);
        m.retain(|_, v| v.strong_count() > 0);
        m.insert((pid, cq), Arc::downgrade(&w));
        w
    }
}

/// Rings an event fd (ours or a peer's duplicate).
pub(crate) fn ring(fd: &OwnedFd) {
    let one: u64 = 1;
    // SAFETY: writing 8 bytes from a valid u64 to an event fd.
    unsafe { libc::write(fd.as_raw_fd(), (&one as *const u64).cast(), 8) };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_fresh_and_bounded() {
        let t = DoorbellTable::new().unwrap();
        let (a, sa) = t.alloc().unwrap();
        let (b, sb) = t.alloc().unwrap();
        assert_eq!((a, b), (1, 2));
        sa.get().state.store(word(5, POSTED), Ordering::Release);
        assert_eq!(sb.get().state.load(Ordering::Acquire), 0);
        t.next.store(SLOTS, Ordering::Relaxed);
        assert!(t.alloc().is_none());
    }

    #[test]
    fn released_slots_are_reused_in_a_new_life() {
        let t = DoorbellTable::new().unwrap();
        let (a, sa) = t.alloc().unwrap();
        sa.get().rx_armed.store(1, Ordering::Release);
        let gen = sa.get().gen.load(Ordering::Acquire);
        t.release(a);
        let (b, sb) = t.alloc().unwrap();
        assert_eq!(b, a, "the released slot is given out again");
        assert_eq!(sb.get().gen.load(Ordering::Acquire), gen + 1, "a reused slot starts a new life");
        assert_eq!(sb.get().rx_armed.load(Ordering::Acquire), 0);
        // A record of the old life published now (the new QP open) is
        // voided, never claimed.
        sb.get().open.store(1, Ordering::Release);
        let k = match super::super::doorbell_proto::publish(sb.get(), 1, 8, gen, |_| true, |_| {}) {
            super::super::doorbell_proto::Published::Posted(k) | super::super::doorbell_proto::Published::Voided(k) => {
                k
            }
            other => panic!("{other:?}"),
        };
        let c = super::super::doorbell_proto::claim(sb.get(), true, || Some(()));
        assert!(matches!(c, super::super::doorbell_proto::Claim::Stale), "{c:?}");
        assert!(!super::super::doorbell_proto::claimed(sb.get(), k));
    }

    #[test]
    fn a_context_outlives_its_slot_count_in_qps() {
        // More QPs created and destroyed over a context's life than it has
        // slots: the last one still gets a doorbell.
        let dev = SoftProvider::new(SoftConfig { link: SoftLink::Shm, ..SoftConfig::default() }).device();
        let ctx = dev.open().unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(16).unwrap();
        for _ in 0..SLOTS + 100 {
            drop(pd.create_qp(&QpInitAttr::default(), &cq, &cq).unwrap());
        }
        let qp = pd.create_qp(&QpInitAttr::default(), &cq, &cq).unwrap();
        assert_ne!(qp.endpoint().unwrap().soft.unwrap().doorbell_slot, 0, "the doorbell slots ran out");
    }

    #[test]
    fn wakers_are_shared_per_cq_and_die_with_their_users() {
        let efd = || rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC).unwrap();
        let w = Wakers::default();
        let pid = std::process::id();
        assert!(w.lookup(pid, 7).is_none());
        let a = w.insert(pid, 7, efd());
        let b = w.insert(pid, 7, efd());
        assert!(Arc::ptr_eq(&a, &b), "one descriptor per CQ");
        assert!(Arc::ptr_eq(&a, &w.lookup(pid, 7).unwrap()));
        let c = w.insert(pid, 8, efd());
        assert!(!Arc::ptr_eq(&a, &c), "another CQ id, another descriptor");
        drop((a, b));
        assert!(w.lookup(pid, 7).is_none(), "the descriptor died with its users");
        ring(&c);
        let mut v = [0u8; 8];
        assert_eq!(rustix::io::read(&*c, &mut v).unwrap(), 8);
        assert_eq!(u64::from_ne_bytes(v), 1);
    }

    // End-to-end, through the public API: two contexts on one host.
    use super::super::context::{CtxShared, SoftContext};
    use crate::soft::{SoftConfig, SoftLink, SoftProvider};
    use crate::{
        AccessFlags, CompletionQueue, Context, MemoryRegion, QpInitAttr, QueuePair, RecvWr, SendFlags, SendOp, SendWr,
        WcOpcode, WcStatus, WorkCompletion,
    };

    struct Pair {
        ca: Context,
        cb: Context,
        a: QueuePair,
        b: QueuePair,
        cq_a: CompletionQueue,
        cq_b: CompletionQueue,
        src: MemoryRegion,
        dst: MemoryRegion,
    }

    fn shared(c: &Context) -> &CtxShared {
        &c.inner.ops.as_any().downcast_ref::<SoftContext>().expect("soft context").shared
    }

    const LONG: Option<Duration> = Some(Duration::from_secs(20));

    fn pair(doorbell: bool) -> Pair {
        let dev = SoftProvider::new(SoftConfig { link: SoftLink::Shm, doorbell, ..SoftConfig::default() }).device();
        let (ca, cb) = (dev.open().unwrap(), dev.open().unwrap());
        let (pa, pb) = (ca.alloc_pd().unwrap(), cb.alloc_pd().unwrap());
        let (cq_a, cq_b) = (ca.create_cq(256).unwrap(), cb.create_cq(256).unwrap());
        let attr = QpInitAttr::default();
        let a = pa.create_qp(&attr, &cq_a, &cq_a).unwrap();
        let b = pb.create_qp(&attr, &cq_b, &cq_b).unwrap();
        a.connect(&b.endpoint().unwrap()).unwrap();
        b.connect(&a.endpoint().unwrap()).unwrap();
        let src = MemoryRegion::alloc(&pa, 4096, AccessFlags::LOCAL_WRITE).unwrap();
        let dst = MemoryRegion::alloc(&pb, 4096, AccessFlags::all_remote()).unwrap();
        let p = Pair { ca, cb, a, b, cq_a, cq_b, src, dst };
        // One notify first, whatever path it takes: the same-host link (and
        // with it the doorbell) is up once it has completed.
        p.b.post_recv(&[RecvWr { wr_id: 1000, sg_list: &[] }]).unwrap();
        p.post(1000, 0);
        assert_eq!(p.one(&p.cq_a, Duration::ZERO).wr_id, 1000);
        assert_eq!(p.one(&p.cq_b, Duration::ZERO).imm_data, Some(0));
        p
    }

    impl Pair {
        /// WRITE_WITH_IMM of 8 bytes carrying `imm` from A into B.
        fn post(&self, wr_id: u64, imm: u32) {
            self.src.write(0, &u64::from(imm).to_le_bytes()).unwrap();
            let sge = [self.src.sge(0, 8).unwrap()];
            let op = SendOp::RdmaWriteWithImm { remote_addr: self.dst.addr(), rkey: self.dst.rkey(), imm };
            self.a.post_send(&[SendWr { wr_id, op, sg_list: &sge, flags: SendFlags::SIGNALED }]).unwrap();
        }

        fn one(&self, cq: &CompletionQueue, spin: Duration) -> WorkCompletion {
            let mut wc = [WorkCompletion::empty(); 1];
            assert_eq!(cq.wait(&mut wc, LONG, spin).unwrap(), 1, "no completion within 20 s");
            assert_eq!(wc[0].status, WcStatus::Success, "{:?}", wc[0]);
            wc[0]
        }

        /// The next completion, whatever its status.
        fn one_any(&self, cq: &CompletionQueue) -> WorkCompletion {
            let mut wc = [WorkCompletion::empty(); 1];
            assert_eq!(cq.wait(&mut wc, LONG, Duration::ZERO).unwrap(), 1, "no completion within 20 s");
            wc[0]
        }

        fn counts(&self) -> (u64, u64) {
            (shared(&self.cb).db_claimed.load(Ordering::Relaxed), shared(&self.ca).db_retracted.load(Ordering::Relaxed))
        }

        fn check_recv(&self, wc: &WorkCompletion, imm: u32) {
            assert_eq!((wc.opcode, wc.imm_data, wc.byte_len), (WcOpcode::RecvRdmaWithImm, Some(imm), 8), "{wc:?}");
            let mut got = [0u8; 8];
            self.dst.read(0, &mut got).unwrap();
            assert_eq!(u64::from_le_bytes(got), u64::from(imm));
        }
    }

    #[test]
    fn a_spinning_receiver_claims_the_record() {
        let p = pair(true);
        let before = p.counts();
        p.b.post_recv(&[RecvWr { wr_id: 1, sg_list: &[] }]).unwrap();
        p.post(7, 42);
        let wc = p.one(&p.cq_b, Duration::from_secs(10));
        p.check_recv(&wc, 42);
        assert_eq!(wc.wr_id, 1);
        assert_eq!(p.one(&p.cq_a, Duration::from_secs(10)).wr_id, 7);
        assert_eq!(p.counts(), (before.0 + 1, before.1), "the record went through the connection");
    }

    fn rings(c: &Context) -> u64 {
        shared(c).db_rings.load(Ordering::Relaxed)
    }

    #[test]
    fn a_sleeping_receiver_is_woken() {
        let p = pair(true);
        let before = p.counts();
        let rung = rings(&p.ca);
        p.b.post_recv(&[RecvWr { wr_id: 2, sg_list: &[] }]).unwrap();
        std::thread::scope(|s| {
            let rx = s.spawn(|| p.one(&p.cq_b, Duration::ZERO));
            // B arms its CQ and sleeps on the event fd before A posts.
            std::thread::sleep(Duration::from_millis(200));
            p.post(8, 43);
            p.check_recv(&rx.join().unwrap(), 43);
        });
        assert_eq!(p.one(&p.cq_a, Duration::from_secs(10)).wr_id, 8);
        assert_eq!(p.counts(), (before.0 + 1, before.1), "the record went through the connection");
        assert_eq!(rings(&p.ca), rung + 1, "A did not ring B's CQ");
    }

    #[test]
    fn a_sleeping_sender_is_woken() {
        let p = pair(true);
        let before = p.counts();
        let rung = rings(&p.cb);
        p.b.post_recv(&[RecvWr { wr_id: 3, sg_list: &[] }]).unwrap();
        std::thread::scope(|s| {
            s.spawn(|| {
                // A is asleep on its CQ by the time B claims.
                std::thread::sleep(Duration::from_millis(200));
                p.check_recv(&p.one(&p.cq_b, Duration::from_secs(10)), 44);
            });
            p.post(9, 44);
            assert_eq!(p.one(&p.cq_a, Duration::ZERO).wr_id, 9);
        });
        assert_eq!(p.counts(), (before.0 + 1, before.1), "the record went through the connection");
        assert_eq!(rings(&p.cb), rung + 1, "B did not ring A's CQ");
    }

    #[test]
    fn an_unpolled_receiver_gets_it_through_the_connection() {
        let p = pair(true);
        let before = p.counts();
        p.b.post_recv(&[RecvWr { wr_id: 4, sg_list: &[] }]).unwrap();
        p.post(10, 45);
        // Nobody polls B: the record is retracted after STALE and sent as a
        // notify, which B's progress thread delivers.
        assert_eq!(p.one(&p.cq_a, Duration::ZERO).wr_id, 10);
        assert_eq!(p.counts(), (before.0, before.1 + 1));
        p.check_recv(&p.one(&p.cq_b, Duration::ZERO), 45);
        let mut wc = [WorkCompletion::empty(); 2];
        assert_eq!(
            p.cq_b.wait(&mut wc, Some(Duration::from_millis(50)), Duration::ZERO).unwrap(),
            0,
            "delivered twice"
        );
    }

    #[test]
    fn without_a_posted_receive_the_connection_is_used() {
        let p = pair(true);
        let before = p.counts();
        p.post(11, 46);
        std::thread::sleep(Duration::from_millis(20));
        p.b.post_recv(&[RecvWr { wr_id: 5, sg_list: &[] }]).unwrap();
        p.check_recv(&p.one(&p.cq_b, Duration::ZERO), 46);
        assert_eq!(p.one(&p.cq_a, Duration::ZERO).wr_id, 11);
        assert_eq!(p.counts(), before);
    }

    #[test]
    fn writes_after_a_record_keep_their_order() {
        let p = pair(true);
        let n = 240u32;
        let recvs: Vec<RecvWr<'_>> = (0..n).map(|i| RecvWr { wr_id: u64::from(i), sg_list: &[] }).collect();
        p.b.post_recv(&recvs).unwrap();
        std::thread::scope(|s| {
            let rx = s.spawn(|| {
                let mut got = Vec::new();
                let mut wc = [WorkCompletion::empty(); 16];
                while got.len() < n as usize {
                    let k = p.cq_b.wait(&mut wc, LONG, Duration::from_secs(1)).unwrap();
                    assert!(k > 0, "receive completions stopped at {}", got.len());
                    got.extend(wc[..k].iter().map(|w| (w.wr_id, w.imm_data)));
                }
                got
            });
            // Bursts of three: the first of each can take the doorbell, the
            // other two follow through the progress thread.
            for burst in 0..n / 3 {
                for j in 0..3 {
                    p.post(u64::from(burst * 3 + j), burst * 3 + j);
                }
                for j in 0..3 {
                    assert_eq!(p.one(&p.cq_a, Duration::from_secs(1)).wr_id, u64::from(burst * 3 + j));
                }
            }
            let got = rx.join().unwrap();
            let want: Vec<(u64, Option<u32>)> = (0..n).map(|i| (u64::from(i), Some(i))).collect();
            assert_eq!(got, want);
        });
        let (claimed, retracted) = p.counts();
        assert!(claimed + retracted > 0, "no record was used");
    }

    /// Two threads posting on one QP (one may take the doorbell while the
    /// other's WRs are on the wire): receive completions still come in the
    /// order the receives were posted, whichever message took which.
    #[test]
    fn two_posting_threads_keep_receive_order() {
        let p = pair(true);
        let per = 120u32;
        let recvs: Vec<RecvWr<'_>> = (0..2 * per).map(|i| RecvWr { wr_id: u64::from(i), sg_list: &[] }).collect();
        p.b.post_recv(&recvs).unwrap();
        std::thread::scope(|s| {
            let rx = s.spawn(|| {
                let mut got = Vec::new();
                let mut wc = [WorkCompletion::empty(); 16];
                while got.len() < 2 * per as usize {
                    let k = p.cq_b.wait(&mut wc, LONG, Duration::from_secs(1)).unwrap();
                    assert!(k > 0, "receive completions stopped at {}", got.len());
                    got.extend(wc[..k].iter().map(|w| w.wr_id));
                }
                got
            });
            for t in 0..2u32 {
                let p = &p;
                s.spawn(move || {
                    for i in 0..per {
                        p.post(u64::from(t << 16 | i), t << 16 | i);
                        if i % 3 == 2 {
                            std::thread::yield_now();
                        }
                    }
                });
            }
            let mut sent = 0;
            let mut wc = [WorkCompletion::empty(); 16];
            while sent < 2 * per as usize {
                let k = p.cq_a.wait(&mut wc, LONG, Duration::from_millis(10)).unwrap();
                assert!(k > 0, "send completions stopped at {sent}");
                assert!(wc[..k].iter().all(|w| w.status == WcStatus::Success), "{:?}", &wc[..k]);
                sent += k;
            }
            let got = rx.join().unwrap();
            let want: Vec<u64> = (0..u64::from(2 * per)).collect();
            assert_eq!(got, want, "receive completions out of posting order");
        });
    }

    #[test]
    fn a_receiver_that_goes_away_fails_the_write_in_time() {
        let p = pair(true);
        p.b.post_recv(&[RecvWr { wr_id: 7, sg_list: &[] }]).unwrap();
        p.post(13, 48);
        // B's QP is destroyed with the record unclaimed: A's WR must end with
        // an error completion (the connection closes), not hang.
        let Pair { ca: _ca, cb, a: _a, b, cq_a, cq_b: _cq_b, src: _src, dst } = p;
        drop(b);
        drop(dst);
        drop(cb);
        let mut wc = [WorkCompletion::empty(); 1];
        assert_eq!(cq_a.wait(&mut wc, LONG, Duration::ZERO).unwrap(), 1, "no completion within 20 s");
        assert_eq!(wc[0].wr_id, 13);
        assert_eq!(wc[0].status, WcStatus::RetryExcErr, "{:?}", wc[0]);
    }

    #[test]
    fn a_reset_receiver_never_claims_an_old_record() {
        let p = pair(true);
        p.b.post_recv(&[RecvWr { wr_id: 8, sg_list: &[] }]).unwrap();
        p.post(14, 49);
        // B is reset and brought back up before anyone polled it: the record
        // of its previous life is void, A's WR fails, B never sees it.
        p.b.modify(&crate::QpTransition::Reset).unwrap();
        p.b.connect(&p.a.endpoint().unwrap()).unwrap();
        p.b.post_recv(&[RecvWr { wr_id: 9, sg_list: &[] }]).unwrap();
        let mut wc = [WorkCompletion::empty(); 4];
        let n = p.cq_b.wait(&mut wc, Some(Duration::from_millis(100)), Duration::from_millis(100)).unwrap();
        assert!(wc[..n].iter().all(|w| w.imm_data != Some(49)), "an old record was claimed: {:?}", &wc[..n]);
        let a = p.one_any(&p.cq_a);
        assert_eq!((a.wr_id, a.status), (14, WcStatus::RetryExcErr), "{a:?}");
    }

    #[test]
    fn the_switch_turns_it_off() {
        let p = pair(false);
        assert_eq!(p.b.endpoint().unwrap().soft.unwrap().doorbell_slot, 0);
        p.b.post_recv(&[RecvWr { wr_id: 6, sg_list: &[] }]).unwrap();
        p.post(12, 47);
        p.check_recv(&p.one(&p.cq_b, Duration::from_secs(1)), 47);
        assert_eq!(p.one(&p.cq_a, Duration::ZERO).wr_id, 12);
        assert_eq!(p.counts(), (0, 0));
    }
}
