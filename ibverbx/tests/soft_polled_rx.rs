//! Receiving on the polling thread over tcp (`CompletionQueue::drive`):
//! a busy-poller takes small WRITE_WITH_IMMs and ACKs off its QPs'
//! connections itself, and everything it leaves (large payloads, requests
//! with no receive posted) or stops polling for still reaches the
//! provider's thread, so nothing is lost or stuck.

mod conformance;

use std::time::{Duration, Instant};

use conformance::{contents, mr, pattern, post, recv, Mem, Pair};
use ibverbx::soft::{SoftConfig, SoftLink, SoftProvider};
use ibverbx::{AccessFlags, CompletionQueue, SendOp, WcOpcode, WcStatus, WorkCompletion};

fn pair() -> Pair {
    let dev = SoftProvider::new(SoftConfig { link: SoftLink::Tcp, ..SoftConfig::default() }).device();
    Pair::with(&dev, 1024, Default::default(), Default::default(), 1)
}

const LIMIT: Duration = Duration::from_secs(20);

/// Drives `cq` (when `drive`) and polls it until one completion comes;
/// returns it and whether it was there right after a drive that did
/// something (taken by this thread).
fn next(cq: &CompletionQueue, drive: bool) -> (WorkCompletion, bool) {
    let end = Instant::now() + LIMIT;
    let mut wc = [WorkCompletion::empty(); 1];
    loop {
        let drove = drive && cq.drive();
        if cq.poll(&mut wc).unwrap() == 1 {
            return (wc[0], drove);
        }
        assert!(Instant::now() < end, "no completion within {LIMIT:?}");
        std::hint::spin_loop();
    }
}

/// A's WRITE_WITH_IMM of `len` bytes (pattern `seed`) into B's `dst`.
fn write_imm(p: &Pair, src: &ibverbx::MemoryRegion, dst: &ibverbx::MemoryRegion, len: usize, seed: u64) {
    src.write(0, &pattern(len, seed)).unwrap();
    let op = SendOp::RdmaWriteWithImm { remote_addr: dst.addr(), rkey: dst.rkey(), imm: seed as u32 };
    post(&p.a.qp, seed, op, &[src.sge(0, len).unwrap()], true);
}

fn check_recv(wc: WorkCompletion, dst: &ibverbx::MemoryRegion, len: usize, seed: u64) {
    assert_eq!(
        (wc.status, wc.opcode, wc.imm_data, wc.byte_len),
        (WcStatus::Success, WcOpcode::RecvRdmaWithImm, Some(seed as u32), len as u32),
        "{wc:?}"
    );
    assert_eq!(contents(dst, 0, len), pattern(len, seed), "message {seed}");
}

/// A warmed-up pair: the first message through B's thread (which checks
/// the connection), then driven ones; at the end, once B's thread is
/// quiet, B's connection is in its poller's hands.
fn warm(p: &Pair, src: &ibverbx::MemoryRegion, dst: &ibverbx::MemoryRegion) {
    for seed in 0..3 {
        recv(&p.b.qp, seed, &[]);
        write_imm(p, src, dst, 8, seed);
        check_recv(next(&p.b.rcq, true).0, dst, 8, seed);
        assert_eq!(next(&p.a.scq, true).0.status, WcStatus::Success);
    }
    std::thread::sleep(Duration::from_millis(20));
    p.b.rcq.drive();
}

#[test]
fn a_busy_poller_takes_small_writes_and_their_acks_itself() {
    let p = pair();
    let dst = mr(&p.b.pd, Mem::Heap, 8192, AccessFlags::all_remote());
    let src = mr(&p.a.pd, Mem::Heap, 8192, AccessFlags::LOCAL_WRITE);
    warm(&p, &src, &dst);
    let (mut by_poller, mut acks_by_poller) = (0, 0);
    let n = 400u64;
    for seed in 2..2 + n {
        let len = [0, 1, 8, 100, 4096][seed as usize % 5];
        recv(&p.b.qp, seed, &[]);
        write_imm(&p, &src, &dst, len, seed);
        let (wc, polled) = next(&p.b.rcq, true);
        check_recv(wc, &dst, len, seed);
        by_poller += usize::from(polled);
        let (wc, polled) = next(&p.a.scq, true);
        assert_eq!((wc.wr_id, wc.status), (seed, WcStatus::Success));
        acks_by_poller += usize::from(polled);
    }
    // Once the pollers hold the connections, the kernel wakes nobody else
    // for small frames: all of them come through the pollers.
    // (Some may still reach a thread: a poller descheduled for over a
    // millisecond has handed its connection back, a few in a hundred on a
    // loaded 2-core machine. Without the raised mark the threads take most.)
    assert!(by_poller as u64 >= n * 9 / 10, "{by_poller} of {n} requests received by the poller");
    assert!(acks_by_poller as u64 >= n * 9 / 10, "{acks_by_poller} of {n} ACKs received by the poller");
}

#[test]
fn what_a_poller_leaves_reaches_the_thread() {
    let p = pair();
    let big = 256 << 10;
    let dst = mr(&p.b.pd, Mem::Heap, big, AccessFlags::all_remote());
    let src = mr(&p.a.pd, Mem::Heap, big, AccessFlags::LOCAL_WRITE);
    warm(&p, &src, &dst);
    // Payloads over the poller's limit, below and above the raised mark.
    for (seed, len) in [(10, 64 << 10), (11, big), (12, 4097)] {
        recv(&p.b.qp, seed, &[]);
        write_imm(&p, &src, &dst, len, seed);
        let (wc, _) = next(&p.b.rcq, true);
        check_recv(wc, &dst, len, seed);
        assert_eq!(next(&p.a.scq, true).0.status, WcStatus::Success);
    }
    // No receive posted: the thread answers with RNR waits until there is.
    write_imm(&p, &src, &dst, 8, 13);
    let until = Instant::now() + Duration::from_millis(30);
    let mut wc = [WorkCompletion::empty(); 1];
    while Instant::now() < until {
        p.b.rcq.drive();
        assert_eq!(p.b.rcq.poll(&mut wc).unwrap(), 0, "a completion with no receive posted");
    }
    recv(&p.b.qp, 13, &[]);
    check_recv(next(&p.b.rcq, true).0, &dst, 8, 13);
    assert_eq!(next(&p.a.scq, true).0.status, WcStatus::Success);
    // Still small messages by the poller afterwards.
    recv(&p.b.qp, 14, &[]);
    write_imm(&p, &src, &dst, 8, 14);
    check_recv(next(&p.b.rcq, true).0, &dst, 8, 14);
}

#[test]
fn a_poller_that_stops_hands_the_connections_back() {
    let p = pair();
    let dst = mr(&p.b.pd, Mem::Heap, 8192, AccessFlags::all_remote());
    let src = mr(&p.a.pd, Mem::Heap, 8192, AccessFlags::LOCAL_WRITE);
    warm(&p, &src, &dst);
    // Gone without a word (polling, not driving): the thread takes the
    // connection back once the mark is stale.
    recv(&p.b.qp, 20, &[]);
    write_imm(&p, &src, &dst, 8, 20);
    let (wc, _) = next(&p.b.rcq, false);
    check_recv(wc, &dst, 8, 20);
    assert_eq!(next(&p.a.scq, false).0.status, WcStatus::Success);
    // Driven again, then stopped to sleep (`wait` after its busy-poll).
    warm(&p, &src, &dst);
    p.b.rcq.drive_stop();
    p.a.scq.drive_stop();
    recv(&p.b.qp, 21, &[]);
    write_imm(&p, &src, &dst, 8, 21);
    let mut wc = [WorkCompletion::empty(); 1];
    assert_eq!(p.b.rcq.wait(&mut wc, Some(LIMIT), Duration::ZERO).unwrap(), 1);
    check_recv(wc[0], &dst, 8, 21);
    assert_eq!(p.a.scq.wait(&mut wc, Some(LIMIT), Duration::ZERO).unwrap(), 1);
    assert_eq!(wc[0].status, WcStatus::Success);
}

/// A put and its signal (a small WRITE, then a WRITE_WITH_IMM posted while
/// the WRITE awaits its ACK) are both written by the posting thread: no
/// hand-off to the progress thread, whose wake-up would cost more than
/// the round trip. A deeper pipeline goes through the progress thread.
#[test]
fn a_small_request_behind_an_outstanding_one_is_sent_by_the_poster() {
    let p = pair();
    let dst = mr(&p.b.pd, Mem::Heap, 8192, AccessFlags::all_remote());
    let src = mr(&p.a.pd, Mem::Heap, 8192, AccessFlags::LOCAL_WRITE);
    warm(&p, &src, &dst);
    let stats = || ibverbx::soft::stats(&p.a.ctx).unwrap();
    let before = stats();
    for round in 0..20u64 {
        let seed = 100 + 2 * round;
        src.write(0, &pattern(64, seed)).unwrap();
        let put = SendOp::RdmaWrite { remote_addr: dst.addr() + 64, rkey: dst.rkey() };
        post(&p.a.qp, seed, put, &[src.sge(0, 64).unwrap()], true);
        recv(&p.b.qp, seed + 1, &[]);
        write_imm(&p, &src, &dst, 8, seed + 1);
        // The signal lands after the put: both are placed when it is seen.
        let (wc, _) = next(&p.b.rcq, true);
        check_recv(wc, &dst, 8, seed + 1);
        assert_eq!(contents(&dst, 64, 64), pattern(64, seed), "round {round}");
        for want in [seed, seed + 1] {
            let (wc, _) = next(&p.a.scq, true);
            assert_eq!((wc.wr_id, wc.status), (want, WcStatus::Success), "{wc:?}");
        }
    }
    let after = stats();
    assert_eq!(after.requests_by_posters - before.requests_by_posters, 40, "{before:?} -> {after:?}");
    assert_eq!(after.requests_by_engine, before.requests_by_engine, "{before:?} -> {after:?}");

    // Sixteen posted at once: the first few by the poster, the rest (with
    // more than a few outstanding) by the progress thread.
    let before = stats();
    for k in 0..16u64 {
        let op = SendOp::RdmaWrite { remote_addr: dst.addr() + 8 * k, rkey: dst.rkey() };
        post(&p.a.qp, 1000 + k, op, &[src.sge(0, 8).unwrap()], true);
    }
    for k in 0..16u64 {
        let (wc, _) = next(&p.a.scq, true);
        assert_eq!((wc.wr_id, wc.status), (1000 + k, WcStatus::Success), "{wc:?}");
    }
    let after = stats();
    let (posters, engine) =
        (after.requests_by_posters - before.requests_by_posters, after.requests_by_engine - before.requests_by_engine);
    assert_eq!(posters + engine, 16);
    assert!(engine > 0, "{posters} by posters, {engine} by the engine");
}

/// Several threads post on one tcp QP at once, each a large write (which
/// the progress thread writes) and then a small one (which the posting
/// thread may write itself) on the same bytes: every WR completes once,
/// successfully, and when a small write completes its large one is placed
/// under it (a small write that overtook would be covered by the large
/// one's bytes).
#[test]
fn concurrent_posters_keep_each_threads_order_across_both_paths() {
    use std::sync::atomic::{AtomicBool, Ordering};
    const THREADS: usize = 4;
    const ITERS: usize = 400;
    /// Source slots per thread (a thread keeps at most this many WRs in
    /// flight) and destination areas (one per pair of WRs in flight).
    const SLOTS: usize = 8;
    const AREAS: usize = SLOTS / 2;
    const BIG: usize = 64 << 10;
    let p = pair();
    let dst = mr(&p.b.pd, Mem::Heap, THREADS * AREAS * BIG, AccessFlags::all_remote());
    let src = mr(&p.a.pd, Mem::Heap, THREADS * SLOTS * BIG, AccessFlags::LOCAL_WRITE);
    let done: Vec<AtomicBool> = (0..THREADS * ITERS).map(|_| AtomicBool::new(false)).collect();
    // WR i of a thread: even ones large, odd ones small, pair i / 2 in
    // destination area (i / 2) % AREAS.
    let len = |i: usize| if i.is_multiple_of(2) { BIG } else { 8 + (i * 37) % 4088 };
    let seed = |t: usize, i: usize| (t * ITERS + i) as u64;
    let area = |t: usize, i: usize| (t * AREAS + (i / 2) % AREAS) * BIG;
    let before = ibverbx::soft::stats(&p.a.ctx).unwrap();
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let (p, src, dst, done) = (&p, &src, &dst, &done);
            s.spawn(move || {
                for i in 0..ITERS {
                    // The slot's last WR, and the area's last pair, are done.
                    let wait = if i % 2 == 0 { SLOTS - 1 } else { SLOTS };
                    if i >= wait {
                        let end = Instant::now() + LIMIT;
                        while !done[t * ITERS + i - wait].load(Ordering::Acquire) {
                            assert!(Instant::now() < end, "thread {t}: WR {} not completed", i - wait);
                            std::thread::yield_now();
                        }
                    }
                    let slot = (t * SLOTS + i % SLOTS) * BIG;
                    src.write(slot, &pattern(len(i), seed(t, i))).unwrap();
                    let op = SendOp::RdmaWrite { remote_addr: dst.addr() + area(t, i) as u64, rkey: dst.rkey() };
                    post(&p.a.qp, (t * ITERS + i) as u64, op, &[src.sge(slot, len(i)).unwrap()], true);
                }
            });
        }
        let end = Instant::now() + LIMIT;
        let mut wc = [WorkCompletion::empty(); 16];
        let mut got = 0;
        while got < THREADS * ITERS {
            assert!(Instant::now() < end, "{got} of {} completions", THREADS * ITERS);
            p.a.scq.drive();
            let n = p.a.scq.poll(&mut wc).unwrap();
            for w in &wc[..n] {
                assert_eq!(w.status, WcStatus::Success, "{w:?}");
                let (t, i) = (w.wr_id as usize / ITERS, w.wr_id as usize % ITERS);
                if i % 2 == 1 {
                    // Nothing else writes the area until this is marked done.
                    let at = area(t, i);
                    let small = contents(&dst, at, len(i)) == pattern(len(i), seed(t, i));
                    let big = contents(&dst, at + len(i), BIG - len(i)) == pattern(BIG, seed(t, i - 1))[len(i)..];
                    assert!(
                        small && big,
                        "thread {t}, WRs {} and {i}: small placed {small}, large placed {big}",
                        i - 1
                    );
                }
                let first = !done[w.wr_id as usize].swap(true, Ordering::AcqRel);
                assert!(first, "WR {} completed twice", w.wr_id);
                got += 1;
            }
        }
    });
    let after = ibverbx::soft::stats(&p.a.ctx).unwrap();
    assert!(after.requests_by_posters > before.requests_by_posters, "{before:?} -> {after:?}");
    assert!(after.requests_by_engine > before.requests_by_engine, "{before:?} -> {after:?}");
}
