//! Virtual QPs end to end in one process on the soft provider: both
//! schemes, fragmenting, mixed opcodes, immediates, error flushing, sizing
//! checks. Two contexts play the two hosts; seeded chaos reorders the
//! physical QPs.

use std::time::Duration;

use ibverbx::soft::{SoftConfig, SoftProvider};
use ibverbx::{
    AccessFlags, AtomicOp, LoadBalancing, MemoryRegion, RecvWr, SendFlags, SendOp, SendWr, VirtualCq, VirtualQp,
    VirtualQpConfig, VirtualQpEndpoint, WcOpcode, WcStatus, WorkCompletion,
};

const HANG: Duration = Duration::from_secs(60);

struct End {
    qp: VirtualQp,
    cq: VirtualCq,
    mr: MemoryRegion,
}

fn provider(chaos: Option<u64>) -> std::sync::Arc<SoftProvider> {
    SoftProvider::new(SoftConfig { chaos_seed: chaos, ..SoftConfig::default() })
}

fn end(p: &std::sync::Arc<SoftProvider>, cfg: &VirtualQpConfig, len: usize) -> End {
    let ctx = p.device().open().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = VirtualCq::new(&ctx, 4096).unwrap();
    let qp = VirtualQp::new(&pd, &cq, cfg).unwrap();
    let mr = MemoryRegion::alloc(&pd, len, AccessFlags::all_remote()).unwrap();
    End { qp, cq, mr }
}

fn pair(cfg: &VirtualQpConfig, len: usize, chaos: Option<u64>) -> (End, End) {
    let p = provider(chaos);
    let (a, b) = (end(&p, cfg, len), end(&p, cfg, len));
    // Through JSON, as two processes would exchange them.
    let ea: VirtualQpEndpoint =
        serde_json::from_str(&serde_json::to_string(&a.qp.endpoint().unwrap()).unwrap()).unwrap();
    let eb = b.qp.endpoint().unwrap();
    a.qp.connect(&eb).unwrap();
    b.qp.connect(&ea).unwrap();
    (a, b)
}

/// Collects exactly `n` completions of `cq` while keeping `other` (the
/// peer) progressing, failing (not hanging) after `HANG`.
fn collect_with(cq: &VirtualCq, n: usize, other: &VirtualCq) -> Vec<WorkCompletion> {
    let mut out = Vec::new();
    let mut buf = [WorkCompletion::empty(); 16];
    let deadline = std::time::Instant::now() + HANG;
    while out.len() < n {
        assert!(std::time::Instant::now() < deadline, "only {} of {n} completions arrived: {out:?}", out.len());
        let k = cq.wait(&mut buf[..(n - out.len()).min(16)], Some(Duration::from_millis(1)), Duration::ZERO).unwrap();
        out.extend_from_slice(&buf[..k]);
        other.progress().unwrap();
    }
    out
}

fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn cfg(qps: u32, lb: LoadBalancing) -> VirtualQpConfig {
    VirtualQpConfig {
        total_qps: qps,
        load_balancing: lb,
        max_msg_size: 4096,
        max_msg_cnt_per_qp: 4,
        ..VirtualQpConfig::default()
    }
}

/// Writes messages of several sizes back to back (all in flight at once),
/// half of them with immediates, then reads everything back.
fn writes_reads(qps: u32, lb: LoadBalancing, chaos: Option<u64>) {
    let sizes = [0usize, 1, 4095, 4096, 4097, 3 * 4096 + 5, 64 << 10, 1 << 20];
    let total: usize = sizes.iter().sum();
    let (a, b) = pair(&cfg(qps, lb), 2 * total + 4096, chaos);
    for i in 0..sizes.len() {
        b.qp.post_recv(&[RecvWr { wr_id: 100 + i as u64, sg_list: &[] }]).unwrap();
    }
    let mut off = 0;
    let mut imms = 0;
    for (i, &n) in sizes.iter().enumerate() {
        a.mr.write(off, &pattern(n, i as u64)).unwrap();
        let sge = [a.mr.sge(off, n).unwrap()];
        let (remote_addr, rkey) = (b.mr.addr() + off as u64, b.mr.rkey());
        let op = if i % 2 == 0 {
            imms += 1;
            SendOp::RdmaWriteWithImm { remote_addr, rkey, imm: 0xabc0_0000 | i as u32 }
        } else {
            SendOp::RdmaWrite { remote_addr, rkey }
        };
        a.qp.post_send(&[SendWr { wr_id: i as u64, op, sg_list: &sge, flags: SendFlags::SIGNALED }]).unwrap();
        off += n;
    }
    let wcs = collect_with(&a.cq, sizes.len(), &b.cq);
    for (i, wc) in wcs.iter().enumerate() {
        assert_eq!(
            (wc.wr_id, wc.status, wc.opcode),
            (i as u64, WcStatus::Success, WcOpcode::RdmaWrite),
            "{:?}",
            a.qp.error()
        );
        assert_eq!(wc.byte_len as usize, sizes[i]);
        assert_eq!(wc.qp_num, a.qp.qp_num());
    }
    let rx = collect_with(&b.cq, imms, &a.cq);
    let want: Vec<u32> = (0..sizes.len() as u32).filter(|i| i % 2 == 0).map(|i| 0xabc0_0000 | i).collect();
    assert_eq!(rx.iter().map(|w| w.imm_data.unwrap()).collect::<Vec<_>>(), want, "{rx:?}");
    assert!(rx.iter().all(|w| w.is_ok() && w.opcode == WcOpcode::RecvRdmaWithImm && w.qp_num == b.qp.qp_num()));
    assert_eq!(rx.iter().map(|w| w.wr_id).collect::<Vec<_>>(), (100..100 + imms as u64).collect::<Vec<_>>());
    let mut got = vec![0u8; total];
    b.mr.read(0, &mut got).unwrap();
    let mut off = 0;
    for (i, &n) in sizes.iter().enumerate() {
        assert!(got[off..off + n] == pattern(n, i as u64)[..], "message {i} ({n} bytes) differs");
        off += n;
    }
    // Read it all back into the second half in one fragmented READ.
    let sge = [a.mr.sge(total, total).unwrap()];
    let op = SendOp::RdmaRead { remote_addr: b.mr.addr(), rkey: b.mr.rkey() };
    a.qp.post_send(&[SendWr { wr_id: 77, op, sg_list: &sge, flags: SendFlags::SIGNALED }]).unwrap();
    let wc = collect_with(&a.cq, 1, &b.cq)[0];
    assert_eq!(
        (wc.wr_id, wc.status, wc.opcode, wc.byte_len as usize),
        (77, WcStatus::Success, WcOpcode::RdmaRead, total)
    );
    let mut back = vec![0u8; total];
    a.mr.read(total, &mut back).unwrap();
    assert!(back == got);
    assert_eq!(a.qp.outstanding(), 0);
    assert_eq!(a.qp.pending(), 0);
}

#[test]
fn dqplb_one_qp() {
    writes_reads(1, LoadBalancing::Dqplb, None);
}

#[test]
fn dqplb_four_qps_chaos() {
    for seed in [1, 2] {
        writes_reads(4, LoadBalancing::Dqplb, Some(seed));
    }
}

#[test]
fn spray_four_qps_chaos() {
    for seed in [3, 4] {
        writes_reads(4, LoadBalancing::Spray, Some(seed));
    }
}

#[test]
fn sixteen_qps_both_schemes() {
    writes_reads(16, LoadBalancing::Dqplb, Some(5));
    writes_reads(16, LoadBalancing::Spray, Some(6));
}

#[test]
fn dqplb_sequence_wraps_end_to_end() {
    let c = VirtualQpConfig { initial_seq: (1 << 24) - 5, ..cfg(4, LoadBalancing::Dqplb) };
    let (a, b) = pair(&c, 64 << 10, Some(9));
    b.qp.post_recv(&[RecvWr { wr_id: 1, sg_list: &[] }, RecvWr { wr_id: 2, sg_list: &[] }]).unwrap();
    let data = pattern(32 << 10, 1);
    a.mr.write(0, &data).unwrap();
    for (k, half) in [(0u64, 0usize), (1, 16 << 10)] {
        let sge = [a.mr.sge(half, 16 << 10).unwrap()];
        let op = SendOp::RdmaWriteWithImm { remote_addr: b.mr.addr() + half as u64, rkey: b.mr.rkey(), imm: k as u32 };
        a.qp.post_send(&[SendWr { wr_id: k, op, sg_list: &sge, flags: SendFlags::SIGNALED }]).unwrap();
    }
    assert!(collect_with(&a.cq, 2, &b.cq).iter().all(|w| w.is_ok()));
    let rx = collect_with(&b.cq, 2, &a.cq);
    assert_eq!(rx.iter().map(|w| (w.wr_id, w.imm_data)).collect::<Vec<_>>(), vec![(1, Some(0)), (2, Some(1))]);
    let mut got = vec![0u8; 32 << 10];
    b.mr.read(0, &mut got).unwrap();
    assert!(got == data);
}

#[test]
fn sends_and_atomics_go_on_the_control_qp() {
    for (qps, lb) in [(1, LoadBalancing::Dqplb), (4, LoadBalancing::Dqplb), (4, LoadBalancing::Spray)] {
        let (a, b) = pair(&cfg(qps, lb), 1 << 16, None);
        let rsge = [b.mr.sge(0, 64).unwrap()];
        b.qp.post_recv(&[RecvWr { wr_id: 5, sg_list: &[] }, RecvWr { wr_id: 6, sg_list: &rsge }]).unwrap();
        // A striped WRITE_WITH_IMM, then a SEND behind it: the receiver sees
        // them in that order.
        a.mr.write(1024, &pattern(20000, 3)).unwrap();
        let wsge = [a.mr.sge(1024, 20000).unwrap()];
        let op = SendOp::RdmaWriteWithImm { remote_addr: b.mr.addr() + 1024, rkey: b.mr.rkey(), imm: 42 };
        a.mr.write(0, b"hello").unwrap();
        let ssge = [a.mr.sge(0, 5).unwrap()];
        a.qp.post_send(&[
            SendWr { wr_id: 1, op, sg_list: &wsge, flags: SendFlags::SIGNALED },
            SendWr { wr_id: 2, op: SendOp::SendWithImm { imm: 7 }, sg_list: &ssge, flags: SendFlags::SIGNALED },
        ])
        .unwrap();
        let rx = collect_with(&b.cq, 2, &a.cq);
        assert_eq!(
            rx.iter().map(|w| (w.wr_id, w.opcode, w.imm_data)).collect::<Vec<_>>(),
            vec![(5, WcOpcode::RecvRdmaWithImm, Some(42)), (6, WcOpcode::Recv, Some(7))],
            "{qps} QPs {lb:?}"
        );
        assert_eq!(rx[1].byte_len, 5);
        let mut hello = [0u8; 5];
        b.mr.read(0, &mut hello).unwrap();
        assert_eq!(&hello, b"hello");
        let mut got = vec![0u8; 20000];
        b.mr.read(1024, &mut got).unwrap();
        assert!(got == pattern(20000, 3));
        assert!(collect_with(&a.cq, 2, &b.cq).iter().all(|w| w.is_ok()));
        // Atomics.
        let word = b.mr.addr() + 60000;
        let asge = [a.mr.sge(40000, 8).unwrap()];
        for k in 0..5u64 {
            let op = SendOp::Atomic { remote_addr: word, rkey: b.mr.rkey(), op: AtomicOp::FetchAdd { add: 3 } };
            a.qp.post_send(&[SendWr { wr_id: 10 + k, op, sg_list: &asge, flags: SendFlags::SIGNALED }]).unwrap();
            let wc = collect_with(&a.cq, 1, &b.cq)[0];
            assert_eq!((wc.wr_id, wc.status, wc.opcode), (10 + k, WcStatus::Success, WcOpcode::FetchAdd));
            let mut v = [0u8; 8];
            a.mr.read(40000, &mut v).unwrap();
            assert_eq!(u64::from_ne_bytes(v), 3 * k);
        }
    }
}

#[test]
fn first_error_wins_and_the_rest_flushes() {
    for lb in [LoadBalancing::Dqplb, LoadBalancing::Spray] {
        let (a, b) = pair(&cfg(4, lb), 1 << 20, Some(11));
        let sge = [a.mr.sge(0, 64 << 10).unwrap()];
        let mut wrs = Vec::new();
        for i in 0..10u64 {
            // WR 3 names a bad rkey.
            let rkey = if i == 3 { b.mr.rkey() ^ 0x5a5a } else { b.mr.rkey() };
            let op = SendOp::RdmaWriteWithImm { remote_addr: b.mr.addr(), rkey, imm: i as u32 };
            wrs.push(SendWr { wr_id: i, op, sg_list: &sge, flags: SendFlags::SIGNALED });
        }
        b.qp.post_recv(&(0..10).map(|i| RecvWr { wr_id: i, sg_list: &[] }).collect::<Vec<_>>()).unwrap();
        a.qp.post_send(&wrs).unwrap();
        let wcs = collect_with(&a.cq, 10, &b.cq);
        assert_eq!(wcs.iter().map(|w| w.wr_id).collect::<Vec<_>>(), (0..10).collect::<Vec<_>>(), "{lb:?}: {wcs:?}");
        assert_eq!(wcs[3].status, WcStatus::RemAccessErr, "{lb:?}: {wcs:?}");
        assert!(wcs[4..].iter().all(|w| w.status == WcStatus::WrFlushErr), "{lb:?}: {wcs:?}");
        // An earlier WR succeeded, was flushed, or lost a fragment in
        // flight on another physical QP when the receiver's virtual QP took
        // all its QPs to ERR on seeing the error (RETRY_EXC_ERR, as an RC
        // requester whose peer QP left service gets on hardware): never a
        // remote error of its own.
        assert!(
            wcs[..3]
                .iter()
                .all(|w| matches!(w.status, WcStatus::Success | WcStatus::WrFlushErr | WcStatus::RetryExcErr)),
            "{wcs:?}"
        );
        assert_eq!(a.qp.error().map(|e| e.0), Some(WcStatus::RemAccessErr));
        // Later posts flush at once; nothing hangs.
        a.qp.post_send(&wrs[..1]).unwrap();
        assert_eq!(collect_with(&a.cq, 1, &b.cq)[0].status, WcStatus::WrFlushErr);
        // The receiver learns too: its physical QPs went to ERR with the
        // peer's, or it is still waiting; moving it to ERR flushes its receives.
        b.qp.fail();
        let mut buf = [WorkCompletion::empty(); 16];
        let mut seen = 0;
        while let Ok(k @ 1..) = b.cq.wait(&mut buf, Some(Duration::from_millis(300)), Duration::ZERO) {
            seen += k;
        }
        assert_eq!(seen, 10, "every receive completes exactly once ({lb:?})");
    }
}

#[test]
fn application_failure_flushes_queued_fragments() {
    // A window of 1 and many fragments: most of the message is still queued
    // when the QP is failed; every WR still completes exactly once.
    let c = VirtualQpConfig { max_msg_cnt_per_qp: 1, max_msg_size: 1024, ..cfg(2, LoadBalancing::Spray) };
    let (a, b) = pair(&c, 1 << 20, Some(12));
    let sge = [a.mr.sge(0, 1 << 20).unwrap()];
    let op = SendOp::RdmaWrite { remote_addr: b.mr.addr(), rkey: b.mr.rkey() };
    a.qp.post_send(&[
        SendWr { wr_id: 1, op, sg_list: &sge, flags: SendFlags::SIGNALED },
        SendWr { wr_id: 2, op, sg_list: &sge, flags: SendFlags::UNSIGNALED },
    ])
    .unwrap();
    assert!(a.qp.pending() > 0);
    a.qp.fail();
    let wcs = collect_with(&a.cq, 2, &b.cq);
    assert_eq!(
        wcs.iter().map(|w| (w.wr_id, w.status)).collect::<Vec<_>>(),
        vec![(1, WcStatus::WrFlushErr), (2, WcStatus::WrFlushErr)]
    );
    assert_eq!(a.qp.pending(), 0);
}

#[test]
fn unsignaled_successes_are_silent() {
    let (a, b) = pair(&cfg(4, LoadBalancing::Dqplb), 1 << 16, None);
    let sge = [a.mr.sge(0, 10000).unwrap()];
    let op = SendOp::RdmaWrite { remote_addr: b.mr.addr(), rkey: b.mr.rkey() };
    a.qp.post_send(&[
        SendWr { wr_id: 1, op, sg_list: &sge, flags: SendFlags::UNSIGNALED },
        SendWr { wr_id: 2, op, sg_list: &sge, flags: SendFlags::SIGNALED },
    ])
    .unwrap();
    let wcs = collect_with(&a.cq, 1, &b.cq);
    assert_eq!(wcs[0].wr_id, 2);
    let mut buf = [WorkCompletion::empty(); 4];
    assert_eq!(a.cq.poll(&mut buf).unwrap(), 0);
}

#[test]
fn cq_sizing_is_checked() {
    let p = provider(None);
    let ctx = p.device().open().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let c = cfg(4, LoadBalancing::Dqplb);
    // 4 data QPs × (4 sends + 8 receives) + notify (4 + 256) = 308.
    let cq = VirtualCq::new(&ctx, 307).unwrap();
    match VirtualQp::new(&pd, &cq, &c) {
        Err(ibverbx::Error::InvalidArgument { reason, .. }) => assert!(reason.contains("at least 308"), "{reason}"),
        other => panic!("expected a sizing error, got {other:?}"),
    }
    assert_eq!(cq.reserved(), 0);
    let cq = VirtualCq::new(&ctx, 308).unwrap();
    let q = VirtualQp::new(&pd, &cq, &c).unwrap();
    assert_eq!(cq.reserved(), 308);
    assert!(VirtualQp::new(&pd, &cq, &c).is_err(), "a second QP does not fit");
    drop(q);
    assert_eq!(cq.reserved(), 0);
    VirtualQp::new(&pd, &cq, &c).unwrap();
}

#[test]
fn mismatched_peers_are_refused() {
    let p = provider(None);
    let a = end(&p, &cfg(4, LoadBalancing::Dqplb), 4096);
    let b = end(&p, &cfg(4, LoadBalancing::Spray), 4096);
    let c = end(&p, &cfg(2, LoadBalancing::Dqplb), 4096);
    assert!(matches!(a.qp.connect(&b.qp.endpoint().unwrap()), Err(ibverbx::Error::InvalidArgument { .. })));
    assert!(matches!(a.qp.connect(&c.qp.endpoint().unwrap()), Err(ibverbx::Error::InvalidArgument { .. })));
    let sge = [a.mr.sge(0, 8).unwrap()];
    let op = SendOp::RdmaWrite { remote_addr: b.mr.addr(), rkey: b.mr.rkey() };
    assert!(matches!(
        a.qp.post_send(&[SendWr { wr_id: 1, op, sg_list: &sge, flags: SendFlags::SIGNALED }]),
        Err(ibverbx::Error::InvalidState { .. })
    ));
    let ep = a.qp.endpoint().unwrap();
    assert_eq!(ep.data.len(), 4);
    assert!(ep.notify.is_some());
    assert_eq!(a.qp.physical_qp_nums().len(), 5);
}

/// A thread blocked in `VirtualCq::wait` must not make a concurrent
/// `poll` (the non-blocking call async drivers make) wait for it.
#[test]
fn poll_does_not_block_behind_a_waiter() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let (a, _b) = pair(&cfg(2, LoadBalancing::Dqplb), 4096, None);
    let waiting_done = AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| {
            let mut wc = [WorkCompletion::empty(); 4];
            let n = a.cq.wait(&mut wc, Some(Duration::from_secs(5)), Duration::ZERO).unwrap();
            assert_eq!(n, 0);
            waiting_done.store(true, Ordering::SeqCst);
        });
        std::thread::sleep(Duration::from_millis(200));
        let mut wc = [WorkCompletion::empty(); 4];
        let t = std::time::Instant::now();
        for _ in 0..10 {
            assert_eq!(a.cq.poll(&mut wc).unwrap(), 0);
        }
        // Not a performance bound: the waiter sleeps for 5 s; a poll that
        // waited for it takes that long.
        assert!(
            t.elapsed() < Duration::from_secs(2) && !waiting_done.load(Ordering::SeqCst),
            "poll returned after {:?}: it blocked behind the concurrent wait",
            t.elapsed()
        );
    });
}

/// A large message posted on an idle same-host virtual QP is not copied
/// whole by the posting thread (an async runtime's worker, through the
/// transport): one post copies at most one fragment itself, the progress
/// thread the rest.
#[test]
fn a_large_write_is_not_copied_whole_by_the_posting_thread() {
    const LEN: usize = 16 << 20;
    let p = provider(None);
    let c = VirtualQpConfig { max_msg_size: 1 << 20, max_msg_cnt_per_qp: 64, ..cfg(1, LoadBalancing::Spray) };
    let side = || {
        let ctx = p.device().open().unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let cq = VirtualCq::new(&ctx, 4096).unwrap();
        let qp = VirtualQp::new(&pd, &cq, &c).unwrap();
        let mr = MemoryRegion::alloc(&pd, LEN, AccessFlags::all_remote()).unwrap();
        (ctx, End { qp, cq, mr })
    };
    let ((ctx_a, a), (_ctx_b, b)) = (side(), side());
    a.qp.connect(&b.qp.endpoint().unwrap()).unwrap();
    b.qp.connect(&a.qp.endpoint().unwrap()).unwrap();
    let data = pattern(LEN, 7);
    a.mr.write(0, &data).unwrap();
    let copied = || ibverbx::soft::stats(&ctx_a).unwrap().inline_copied_bytes;
    // Warm up until the same-host link is up (a small write copied by the
    // posting thread itself).
    let deadline = std::time::Instant::now() + HANG;
    while copied() == 0 {
        assert!(std::time::Instant::now() < deadline, "the posting thread never copied a small write");
        let sg = [a.mr.sge(0, 4096).unwrap()];
        let op = SendOp::RdmaWrite { remote_addr: b.mr.addr(), rkey: b.mr.rkey() };
        a.qp.post_send(&[SendWr { wr_id: 0, op, sg_list: &sg, flags: SendFlags::SIGNALED }]).unwrap();
        assert_eq!(collect_with(&a.cq, 1, &b.cq)[0].status, WcStatus::Success);
    }
    let before = copied();
    let sg = [a.mr.sge(0, LEN).unwrap()];
    let op = SendOp::RdmaWrite { remote_addr: b.mr.addr(), rkey: b.mr.rkey() };
    a.qp.post_send(&[SendWr { wr_id: 1, op, sg_list: &sg, flags: SendFlags::SIGNALED }]).unwrap();
    let by_post = copied() - before;
    let wc = collect_with(&a.cq, 1, &b.cq);
    assert_eq!(wc[0].status, WcStatus::Success, "{wc:?}");
    let mut got = vec![0u8; LEN];
    b.mr.read(0, &mut got).unwrap();
    assert!(got == data, "the 16 MiB write did not arrive intact");
    eprintln!("the post copied {by_post} of {LEN} bytes itself");
    assert!(by_post <= 1 << 20, "the posting thread copied {by_post} bytes of a {LEN}-byte write");
}

/// `Duration::MAX` as a wait's timeout ("forever", as callers say it) waits
/// for the completion instead of overflowing the clock.
#[test]
fn a_wait_of_duration_max_waits_for_its_completion() {
    let (a, b) = pair(&cfg(2, LoadBalancing::Dqplb), 4096, None);
    let sg = [a.mr.sge(0, 64).unwrap()];
    let op = SendOp::RdmaWrite { remote_addr: b.mr.addr(), rkey: b.mr.rkey() };
    a.qp.post_send(&[SendWr { wr_id: 7, op, sg_list: &sg, flags: SendFlags::SIGNALED }]).unwrap();
    let mut wc = [WorkCompletion::empty(); 1];
    assert_eq!(a.cq.wait(&mut wc, Some(Duration::MAX), Duration::ZERO).unwrap(), 1);
    assert!(wc[0].is_ok() && wc[0].wr_id == 7, "{:?}", wc[0]);
}

/// A DQPLB immediate still in the receiver's CQ when its virtual QP fails
/// (its fragments unrouted, so its message never finished) must not hold
/// up the receives flushed behind it: every receive completes once.
#[test]
fn a_late_immediate_does_not_hold_up_the_flushed_receives() {
    let (a, b) = pair(&cfg(4, LoadBalancing::Dqplb), 64 << 10, None);
    b.qp.post_recv(&[RecvWr { wr_id: 1, sg_list: &[] }, RecvWr { wr_id: 2, sg_list: &[] }]).unwrap();
    let sge = [a.mr.sge(0, 64 << 10).unwrap()];
    let op = SendOp::RdmaWriteWithImm { remote_addr: b.mr.addr(), rkey: b.mr.rkey(), imm: 5 };
    a.qp.post_send(&[SendWr { wr_id: 9, op, sg_list: &sge, flags: SendFlags::SIGNALED }]).unwrap();
    // Only A progresses: B's physical CQ keeps the fragments and the
    // immediate, none of them routed yet.
    let mut wc = [WorkCompletion::empty(); 1];
    assert_eq!(a.cq.wait(&mut wc, Some(HANG), Duration::ZERO).unwrap(), 1);
    assert_eq!((wc[0].wr_id, wc[0].status), (9, WcStatus::Success));
    b.qp.fail();
    let mut rx = Vec::new();
    let mut buf = [WorkCompletion::empty(); 16];
    while let Ok(k @ 1..) = b.cq.wait(&mut buf, Some(Duration::from_millis(300)), Duration::ZERO) {
        rx.extend_from_slice(&buf[..k]);
    }
    // The message's fragments were never counted, so the receiver cannot
    // vouch for its data: its receive is flushed like the one behind it.
    assert_eq!(
        rx.iter().map(|w| (w.wr_id, w.status)).collect::<Vec<_>>(),
        vec![(1, WcStatus::WrFlushErr), (2, WcStatus::WrFlushErr)],
        "{rx:?}"
    );
}

fn invalid_reason(r: ibverbx::Result<()>) -> String {
    match r {
        Err(ibverbx::Error::InvalidArgument { verb: "post_send(virtual)", reason }) => reason,
        other => panic!("expected post_send(virtual) to refuse the WR, got {other:?}"),
    }
}

/// A WR that a physical QP would refuse fails `post_send` itself, before
/// anything is queued, and leaves the virtual QP usable (it used to be
/// accepted, refused when its physical WR was posted, and take the whole
/// virtual QP to the error state).
#[test]
fn a_malformed_wr_fails_the_call_not_the_qp() {
    let (a, b) = pair(&VirtualQpConfig::default(), 1 << 20, None);
    let (raddr, rkey) = (b.mr.addr(), b.mr.rkey());
    let post = |wr_id: u64, op: SendOp, sg: &[ibverbx::Sge], inline: bool| {
        a.qp.post_send(&[SendWr { wr_id, op, sg_list: sg, flags: SendFlags { inline, ..SendFlags::SIGNALED } }])
    };
    let kib = [a.mr.sge(0, 1024).unwrap()];
    let word = [a.mr.sge(4096, 8).unwrap()];
    let half_word = [a.mr.sge(4096, 4).unwrap()];
    let write = SendOp::RdmaWrite { remote_addr: raddr, rkey };
    let fetch_add = |remote_addr| SendOp::Atomic { remote_addr, rkey, op: AtomicOp::FetchAdd { add: 1 } };
    // 1 KiB fits a 1 MiB fragment but not the physical QPs' 256 inline bytes.
    let r = invalid_reason(post(1, write, &kib, true));
    assert!(r.contains("max_inline_data"), "{r}");
    let r = invalid_reason(post(2, fetch_add(raddr + 4), &word, false));
    assert!(r.contains("aligned"), "{r}");
    let r = invalid_reason(post(3, fetch_add(raddr), &half_word, false));
    assert!(r.contains("8-byte SGE"), "{r}");
    let r = invalid_reason(post(4, SendOp::RdmaRead { remote_addr: raddr, rkey }, &word, true));
    assert!(r.contains("inline"), "{r}");
    // A remote range that wraps past 2^64 (its fragments' addresses
    // overflowed: a panic in debug builds).
    let r = invalid_reason(post(9, SendOp::RdmaWrite { remote_addr: u64::MAX - 100, rkey }, &kib, false));
    assert!(r.contains("wraps"), "{r}");
    assert_eq!(a.qp.error(), None);
    assert_eq!(a.qp.outstanding(), 0);
    // As with ibv_post_send's bad_wr: the WRs before the bad one are posted,
    // those after it are not.
    let ok = SendWr { wr_id: 5, op: write, sg_list: &kib, flags: SendFlags::SIGNALED };
    let bad = SendWr { wr_id: 6, op: fetch_add(raddr + 4), sg_list: &word, flags: SendFlags::SIGNALED };
    let after = SendWr { wr_id: 7, op: write, sg_list: &kib, flags: SendFlags::SIGNALED };
    let r = invalid_reason(a.qp.post_send(&[ok, bad, after]));
    assert!(r.starts_with("WR 1 of 3 (wr_id 0x6; the 1 before it were posted): "), "{r}");
    post(8, fetch_add(raddr + 8), &word, false).unwrap();
    let wcs = collect_with(&a.cq, 2, &b.cq);
    assert_eq!(
        wcs.iter().map(|w| (w.wr_id, w.status)).collect::<Vec<_>>(),
        vec![(5, WcStatus::Success), (8, WcStatus::Success)],
        "{:?}",
        a.qp.error()
    );
    assert_eq!(a.qp.outstanding(), 0);
}

/// No physical WR may exceed the device's `max_msg_sz`: a fragment size
/// above it refuses striped WRs, and a SEND above it is refused whole.
#[test]
fn wrs_longer_than_the_devices_max_msg_sz_are_refused() {
    let p = SoftProvider::new(SoftConfig { max_msg_size: 4096, ..SoftConfig::default() });
    let c = VirtualQpConfig { max_msg_size: 8192, ..cfg(4, LoadBalancing::Dqplb) };
    let (a, b) = (end(&p, &c, 1 << 16), end(&p, &c, 1 << 16));
    a.qp.connect(&b.qp.endpoint().unwrap()).unwrap();
    b.qp.connect(&a.qp.endpoint().unwrap()).unwrap();
    let write = SendOp::RdmaWrite { remote_addr: b.mr.addr(), rkey: b.mr.rkey() };
    let post = |wr_id, op, len| {
        let sg = [a.mr.sge(0, len).unwrap()];
        a.qp.post_send(&[SendWr { wr_id, op, sg_list: &sg, flags: SendFlags::SIGNALED }])
    };
    let r = invalid_reason(post(1, write, 8192));
    assert!(r.contains("max_msg_sz 4096"), "{r}");
    let r = invalid_reason(post(2, SendOp::Send, 5000));
    assert!(r.contains("max_msg_sz 4096"), "{r}");
    post(3, write, 4096).unwrap();
    let wc = collect_with(&a.cq, 1, &b.cq)[0];
    assert_eq!((wc.wr_id, wc.status), (3, WcStatus::Success), "{:?}", a.qp.error());
}

/// Several inline WRs in one `post_send` on an idle virtual QP all go out
/// (the second used to find the first still queued in its lane, behind the
/// call's final pump, and fail with `Exhausted`), on one QP and on four.
#[test]
fn several_inline_wrs_in_one_call_all_go_out() {
    for c in [VirtualQpConfig { total_qps: 1, ..VirtualQpConfig::default() }, VirtualQpConfig::default()] {
        let (a, b) = pair(&c, 1 << 16, None);
        for i in 0..64u8 {
            a.mr.write(i as usize * 8, &[i + 1; 8]).unwrap();
        }
        let sgs: Vec<[ibverbx::Sge; 1]> = (0..4).map(|i| [a.mr.sge(i * 8, 8).unwrap()]).collect();
        let wrs: Vec<SendWr<'_>> = (0..4)
            .map(|i| SendWr {
                wr_id: 100 + i as u64,
                op: SendOp::RdmaWrite { remote_addr: b.mr.addr() + i as u64 * 8, rkey: b.mr.rkey() },
                sg_list: &sgs[i],
                flags: SendFlags { inline: true, ..SendFlags::SIGNALED },
            })
            .collect();
        a.qp.post_send(&wrs).unwrap_or_else(|e| panic!("{} QPs: {e}", c.total_qps));
        let wcs = collect_with(&a.cq, 4, &b.cq);
        let mut got: Vec<_> = wcs.iter().map(|w| (w.wr_id, w.status)).collect();
        got.sort_by_key(|g| g.0);
        assert_eq!(got, (100..104).map(|i| (i, WcStatus::Success)).collect::<Vec<_>>());
        let mut dst = [0u8; 32];
        b.mr.read(0, &mut dst).unwrap();
        assert_eq!(dst.to_vec(), (1..=4u8).flat_map(|i| [i; 8]).collect::<Vec<_>>());
    }
}

/// A WR cut into more than 2^20 fragments is refused at post time (each
/// fragment is a physical WR built then: a 4 GiB WRITE in 1-byte fragments
/// made 4 billion and overflowed the aggregator's count).
#[test]
fn a_wr_of_too_many_fragments_is_refused() {
    let c = VirtualQpConfig { max_msg_size: 1, ..VirtualQpConfig::default() };
    let (a, b) = pair(&c, (1 << 20) + 1, None);
    let write = SendOp::RdmaWrite { remote_addr: b.mr.addr(), rkey: b.mr.rkey() };
    let sg = [a.mr.sge(0, (1 << 20) + 1).unwrap()];
    let r = invalid_reason(a.qp.post_send(&[SendWr { wr_id: 1, op: write, sg_list: &sg, flags: SendFlags::SIGNALED }]));
    assert!(r.contains("fragments") && r.contains("max_msg_size"), "{r}");
    assert_eq!(a.qp.outstanding(), 0);
}
