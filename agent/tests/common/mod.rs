//! Agent behaviours between agents of one process, checked on whichever
//! soft link the test binary selects (`RMACOMM_SOFT_LINK`, set by [`link`]
//! before anything opens).

#![allow(dead_code, unreachable_pub)]

use std::time::{Duration, Instant};

use futures::StreamExt;
use rmacomm_agent::{
    AgentConfig, AgentError, Notification, Op, RemoteBlock, TransferAgent, TransferStatus, MAX_MESSAGE,
};
use rmacomm_transport::{RdmaMemory, TransportConfig};

pub fn link(l: &str) {
    std::env::set_var("RMACOMM_PROVIDER", "soft");
    std::env::set_var("RMACOMM_SOFT_LINK", l);
    let _ = tracing_subscriber::fmt().with_env_filter("warn").with_test_writer().try_init();
}

pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
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

pub fn config() -> AgentConfig {
    AgentConfig::default()
        .with_transport(TransportConfig::default().with_timeout(Some(Duration::from_secs(30))))
        .with_connect_timeout(Duration::from_secs(15))
}

/// A decode agent with a registered cache of `cache` bytes, and a prefill
/// agent that knows it.
pub fn pair(cache: usize) -> (TransferAgent, TransferAgent, RdmaMemory, u32) {
    pair_with(config(), config(), cache)
}

pub fn pair_with(cd: AgentConfig, cp: AgentConfig, cache: usize) -> (TransferAgent, TransferAgent, RdmaMemory, u32) {
    let decode = TransferAgent::new("decode", cd).unwrap();
    let prefill = TransferAgent::new("prefill", cp).unwrap();
    let mem = decode.alloc(cache).unwrap();
    let region = decode.register(&mem).unwrap();
    assert_eq!(prefill.add_peer(&decode.metadata()).unwrap(), "decode");
    (decode, prefill, mem, region)
}

pub fn contents(m: &RdmaMemory, off: usize, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    m.read_into(off, &mut v).unwrap();
    v
}

pub async fn next_notification(a: &TransferAgent) -> Notification {
    tokio::time::timeout(Duration::from_secs(20), a.notifications().next())
        .await
        .expect("a notification within 20 s")
        .expect("the stream is open")
}

/// Nothing more arrives within a short while.
pub async fn no_more_notifications(a: &TransferAgent) {
    tokio::time::sleep(Duration::from_millis(200)).await;
    let extra = a.try_notifications();
    assert!(extra.is_empty(), "unexpected notifications: {extra:?}");
}

/// Scattered blocks written in one request land where named, nothing
/// else is touched, and exactly one notification follows.
pub async fn scattered_blocks_land_then_one_notification() {
    const B: usize = 4096;
    let (decode, prefill, cache, region) = pair(128 * B);
    let kv = prefill.alloc(64 * B).unwrap();
    prefill.register(&kv).unwrap();
    kv.write_from(0, &pattern(64 * B, 1)).unwrap();
    let slots: Vec<usize> = (0..64).map(|i| (i * 37 + 11) % 128).collect();
    let pieces: Vec<_> = slots
        .iter()
        .enumerate()
        .map(|(b, &s)| (kv.view(b * B, B).unwrap(), RemoteBlock::new(region, (s * B) as u64, B as u64)))
        .collect();
    let t = prefill.transfer(Op::Write, "decode", &pieces, Some(b"request 1")).unwrap();
    assert_eq!(t.ops(), 64, "scattered slots are not adjacent");
    t.await.unwrap();
    let n = next_notification(&decode).await;
    assert_eq!(n, Notification { peer: "prefill".into(), message: b"request 1".to_vec() });
    let want = pattern(64 * B, 1);
    for (b, &s) in slots.iter().enumerate() {
        assert!(contents(&cache, s * B, B) == want[b * B..(b + 1) * B], "block {b} in slot {s}");
    }
    for s in (0..128).filter(|s| !slots.contains(s)) {
        assert!(contents(&cache, s * B, B).iter().all(|&x| x == 0), "slot {s} was not named and changed");
    }
    no_more_notifications(&decode).await;
    let (sp, sd) = (prefill.stats(), decode.stats());
    assert_eq!((sp.transfers, sp.pieces, sp.ops_posted, sp.bytes), (1, 64, 64, 64 * B as u64));
    assert_eq!((sp.notifications_sent, sd.notifications_received), (1, 1));
    assert_eq!((sp.connections, sd.connections), (1, 1), "one connection, made by prefill's first transfer");
    // The largest message goes through too.
    let big = pattern(MAX_MESSAGE, 9);
    prefill.notify("decode", &big).unwrap().await.unwrap();
    assert_eq!(next_notification(&decode).await.message, big);
}

/// Reads pull scattered remote blocks into local slices (ViewMut or View),
/// and a read request's notification reaches the peer after them.
pub async fn reads_fetch_scattered_blocks() {
    const B: usize = 16 << 10;
    let (decode, prefill, cache, region) = pair(64 * B);
    cache.write_from(0, &pattern(64 * B, 2)).unwrap();
    let back = prefill.alloc(16 * B).unwrap();
    prefill.register(&back).unwrap();
    let slots = [63usize, 0, 17, 5, 40, 41, 42, 9, 30, 31, 12, 50, 1, 2, 60, 33];
    let pieces: Vec<_> = slots
        .iter()
        .enumerate()
        .map(|(i, &s)| (back.view_mut(i * B, B).unwrap(), RemoteBlock::new(region, (s * B) as u64, B as u64)))
        .collect();
    prefill.transfer(Op::Read, "decode", &pieces, Some(b"read done")).unwrap().await.unwrap();
    let all = pattern(64 * B, 2);
    for (i, &s) in slots.iter().enumerate() {
        assert!(contents(&back, i * B, B) == all[s * B..(s + 1) * B], "slot {s} read into block {i}");
    }
    assert_eq!(next_notification(&decode).await.message, b"read done");
    // Slots 40, 41, 42 (local 4, 5, 6) were adjacent on both sides; 30, 31
    // (8, 9) and 1, 2 (12, 13) too: 16 pieces, 12 operations.
    assert_eq!(prefill.stats().ops_posted, 12);
}

/// Adjacent pieces (on both sides) are coalesced whatever their order; a
/// gap on either side keeps them apart.
pub async fn adjacent_pieces_become_one_operation() {
    const B: usize = 16 << 10;
    let (decode, prefill, cache, region) = pair(512 * B);
    let kv = prefill.alloc(256 * B).unwrap();
    prefill.register(&kv).unwrap();
    kv.write_from(0, &pattern(256 * B, 3)).unwrap();
    let piece =
        |b: usize, slot: usize| (kv.view(b * B, B).unwrap(), RemoteBlock::new(region, (slot * B) as u64, B as u64));
    // 256 blocks into slots 100..356, listed in reverse: one write.
    let pieces: Vec<_> = (0..256).rev().map(|b| piece(b, 100 + b)).collect();
    let before = prefill.stats().ops_posted;
    let t = prefill.transfer(Op::Write, "decode", &pieces, None).unwrap();
    assert_eq!(t.ops(), 1);
    t.await.unwrap();
    assert_eq!(prefill.stats().ops_posted - before, 1, "256 adjacent pieces posted as one write");
    assert!(contents(&cache, 100 * B, 256 * B) == pattern(256 * B, 3));
    // Every other slot: 256 writes.
    let pieces: Vec<_> = (0..256).map(|b| piece(b, 2 * b)).collect();
    let t = prefill.transfer(Op::Write, "decode", &pieces, None).unwrap();
    assert_eq!(t.ops(), 256);
    t.await.unwrap();
    // Runs of 4 adjacent blocks, the runs scattered: 64 writes.
    let pieces: Vec<_> = (0..256).map(|b| piece(b, (b / 4) * 7 % 120 * 4 + b % 4)).collect();
    assert_eq!(prefill.transfer(Op::Write, "decode", &pieces, None).unwrap().ops(), 64);
    let _ = decode;
}

/// 10,000 tiny pieces (more than the transport's 4,096 in-flight slots) in
/// one request: all placed, one notification.
pub async fn ten_thousand_tiny_pieces_in_one_request() {
    const N: usize = 10_000;
    let (decode, prefill, cache, region) = pair(N * 16);
    let src = prefill.alloc(N * 8).unwrap();
    prefill.register(&src).unwrap();
    src.write_from(0, &pattern(N * 8, 4)).unwrap();
    // Remote stride 16: no two pieces adjacent there.
    let pieces: Vec<_> = (0..N)
        .map(|i| (src.view(i * 8, 8).unwrap(), RemoteBlock::new(region, (((i * 7919) % N) * 16) as u64, 8)))
        .collect();
    let t0 = Instant::now();
    let t = prefill.transfer(Op::Write, "decode", &pieces, Some(b"10k")).unwrap();
    assert_eq!(t.ops(), N);
    t.await.unwrap();
    let took = t0.elapsed();
    assert_eq!(next_notification(&decode).await.message, b"10k");
    let want = pattern(N * 8, 4);
    let got = contents(&cache, 0, N * 16);
    for i in 0..N {
        let at = ((i * 7919) % N) * 16;
        assert_eq!(&got[at..at + 8], &want[i * 8..i * 8 + 8], "piece {i}");
        assert!(got[at + 8..at + 16].iter().all(|&x| x == 0), "piece {i} spilled");
    }
    eprintln!("10,000 pieces of 8 bytes in one request: {took:?}");
    no_more_notifications(&decode).await;
}

/// Every argument error is reported before anything moves: the
/// destination stays untouched, no notification is sent, nothing posted.
pub async fn bad_requests_move_nothing() {
    const B: usize = 4096;
    let (decode, prefill, cache, region) = pair(8 * B);
    let kv = prefill.alloc(4 * B).unwrap();
    prefill.register(&kv).unwrap();
    kv.write_from(0, &[0xAB; 4 * B]).unwrap();
    prefill.connect("decode").await.unwrap();
    let ok = |b: usize| (kv.view(b * B, B).unwrap(), RemoteBlock::new(region, (b * B) as u64, B as u64));
    let posted = prefill.stats().ops_posted;

    // One piece out of bounds among good ones.
    let pieces =
        vec![ok(0), ok(1), (kv.view(2 * B, B).unwrap(), RemoteBlock::new(region, (7 * B + 1) as u64, B as u64))];
    let e = prefill.transfer(Op::Write, "decode", &pieces, Some(b"never")).unwrap_err();
    assert!(matches!(&e, AgentError::OutOfBounds { piece: 2, region: r, .. } if *r == region), "{e:?}");
    assert!(e.to_string().contains("\"decode\"") && e.to_string().contains("nothing was transferred"), "{e}");
    // Lengths that differ.
    let pieces = vec![ok(0), (kv.view(B, B).unwrap(), RemoteBlock::new(region, 0, B as u64 - 1))];
    let e = prefill.transfer(Op::Write, "decode", &pieces, None).unwrap_err();
    assert!(e.to_string().contains("piece 1: the local slice is 4096 bytes, the remote block 4095 bytes"), "{e}");
    assert!(e.to_string().contains("with peer \"decode\""), "the error names the peer: {e}");
    // A region the peer does not publish.
    let pieces = vec![(kv.view(0, B).unwrap(), RemoteBlock::new(region + 5, 0, B as u64))];
    let e = prefill.transfer(Op::Write, "decode", &pieces, None).unwrap_err();
    assert_eq!(e, AgentError::UnknownRegion { peer: "decode".into(), piece: 0, region: region + 5 });
    // Local memory the agent does not register.
    let stray = prefill.alloc(B).unwrap();
    let pieces = vec![ok(0), (stray.view(0, B).unwrap(), RemoteBlock::new(region, B as u64, B as u64))];
    let e = prefill.transfer(Op::Write, "decode", &pieces, None).unwrap_err();
    assert!(e.to_string().contains("piece 1: the local memory is not registered"), "{e}");
    // An unknown peer, a message too long.
    let e = prefill.transfer(Op::Write, "nobody", &[ok(0)], None).unwrap_err();
    assert_eq!(e, AgentError::UnknownPeer { name: "nobody".into() });
    let e = prefill.transfer(Op::Write, "decode", &[ok(0)], Some(&[0; MAX_MESSAGE + 1])).unwrap_err();
    assert!(e.to_string().contains("at most 4096"), "{e}");
    // Memory of another device cannot even be registered.
    let soft = ibverbx::soft::SoftConfig { inline_copy_max: 1, ..ibverbx::soft::SoftConfig::from_env() };
    let other = rmacomm_transport::RdmaTransport::new(TransportConfig::default().with_soft(Some(soft))).unwrap();
    let foreign = RdmaMemory::alloc_for(&other, B).unwrap();
    assert!(prefill.register(&foreign).unwrap_err().to_string().contains("another device"));

    assert_eq!(prefill.stats().ops_posted, posted, "nothing was posted");
    assert!(contents(&cache, 0, 8 * B).iter().all(|&x| x == 0), "nothing was written");
    no_more_notifications(&decode).await;
    // The agent is still fine.
    prefill.transfer(Op::Write, "decode", &[ok(0), ok(1), ok(2), ok(3)], Some(b"ok")).unwrap().await.unwrap();
    assert_eq!(next_notification(&decode).await.message, b"ok");
    assert!(contents(&cache, 0, 4 * B).iter().all(|&x| x == 0xAB));
}

/// Notifications of one peer come in the order its requests completed.
/// On an ordered link (one QP or DQPLB: the default) each request's
/// notification is posted right behind its pieces, which are placed in
/// post order: notifications follow the order requests were made in,
/// whatever order the application awaits them in. Under spray striping the
/// notification is sent when a poll sees the pieces placed: the order the
/// transfers were seen complete (on the same host, where the caller copies
/// a request when it is made: the order made). With a ring of two slots the sender waits
/// for the receiver to consume (credit).
pub async fn notifications_follow_completion_order() {
    for spray in [false, true] {
        notifications_in_order(spray).await;
    }
}

async fn notifications_in_order(spray: bool) {
    const B: usize = 64 << 10;
    let both = if spray {
        let t = TransportConfig::default()
            .with_timeout(Some(Duration::from_secs(30)))
            .with_qps(4)
            .with_load_balancing(ibverbx::LoadBalancing::Spray);
        config().with_transport(t)
    } else {
        config()
    };
    // Decode takes notifications into a ring of two slots.
    let small = both.clone().with_notification_slots(2);
    let (decode, prefill, _cache, region) = pair_with(small, both, 64 * B);
    let kv = prefill.alloc(64 * B).unwrap();
    prefill.register(&kv).unwrap();
    let req = |i: usize| {
        let p = [(kv.view(i * B, B).unwrap(), RemoteBlock::new(region, (i * B) as u64, B as u64))];
        prefill.transfer(Op::Write, "decode", &p, Some(format!("req {i}").as_bytes())).unwrap()
    };
    prefill.connect("decode").await.unwrap();
    // A same-host peer's region is mapped in the background after the
    // first request into it; from then on the calling thread copies a
    // request whole when it is made, so it is complete (and notifies) in
    // the order made. Map it first, so that the three below take one path
    // (else a request made before the mapping notifies after ones made
    // behind it: the order they completed in, but not this test's).
    let same_host = prefill.peer_same_host("decode").await.unwrap();
    if same_host {
        for _ in 0..3 {
            let p = [(kv.view(63 * B, B).unwrap(), RemoteBlock::new(region, (63 * B) as u64, B as u64))];
            prefill.transfer(Op::Write, "decode", &p, None).unwrap().await.unwrap();
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    // Made 0, 1, 2; awaited 2, 0, 1.
    let (t0, t1, t2) = (req(0), req(1), req(2));
    t2.await.unwrap();
    t0.await.unwrap();
    t1.await.unwrap();
    // Under spray over a QP a request completes when a poll sees its
    // pieces placed (here: when awaited); copied by the caller, when made.
    let want = if spray && !same_host { ["req 2", "req 0", "req 1"] } else { ["req 0", "req 1", "req 2"] };
    for want in want {
        assert_eq!(next_notification(&decode).await.message, want.as_bytes(), "spray: {spray}");
    }
    // 200 more through a ring of 2 slots: each in order, none lost.
    let mut stream = decode.notifications();
    let mut got = Vec::new();
    for i in 0..200 {
        req(i % 64).await.unwrap();
        if i % 50 == 49 {
            // Let a backlog form, then drain.
            while got.len() <= i {
                got.push(tokio::time::timeout(Duration::from_secs(20), stream.next()).await.unwrap().unwrap());
            }
        }
    }
    let want: Vec<Vec<u8>> = (0..200).map(|i| format!("req {}", i % 64).into_bytes()).collect();
    assert_eq!(got.into_iter().map(|n| n.message).collect::<Vec<_>>(), want);
    assert_eq!(decode.stats().notifications_received, 203);
    // Eight requests made back to back, none awaited until all are made:
    // more than the ring holds, so some wait for credit at the notifier
    // while later ones are made; still in order, each once.
    let ts: Vec<_> = (0..8).map(req).collect();
    for t in ts {
        t.await.unwrap();
    }
    for i in 0..8 {
        let n = tokio::time::timeout(Duration::from_secs(20), stream.next()).await.unwrap().unwrap();
        if !spray {
            assert_eq!(n.message, format!("req {i}").into_bytes());
        }
    }
    assert_eq!(decode.stats().notifications_received, 211);
}

/// Polling `status()` alone completes a transfer and sends its notification.
pub async fn status_completes_a_transfer_without_await() {
    const B: usize = 1 << 20;
    let (decode, prefill, cache, region) = pair(8 * B);
    let kv = prefill.alloc(8 * B).unwrap();
    prefill.register(&kv).unwrap();
    kv.write_from(0, &pattern(8 * B, 5)).unwrap();
    let pieces: Vec<_> = (0..8)
        .map(|b| (kv.view(b * B, B).unwrap(), RemoteBlock::new(region, ((7 - b) * B) as u64, B as u64)))
        .collect();
    // Not connected yet: the first polls make the connection, then post.
    let mut t = prefill.transfer(Op::Write, "decode", &pieces, Some(b"polled")).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut polls = 0;
    loop {
        polls += 1;
        match t.status() {
            TransferStatus::Done => break,
            TransferStatus::InProgress => assert!(Instant::now() < deadline, "{t:?} still in progress"),
            TransferStatus::Failed(e) => panic!("{e}"),
        }
        tokio::time::sleep(Duration::from_micros(200)).await;
    }
    assert_eq!(t.status(), TransferStatus::Done, "a finished transfer stays done");
    assert_eq!(next_notification(&decode).await.message, b"polled");
    let want = pattern(8 * B, 5);
    for b in 0..8 {
        assert!(contents(&cache, (7 - b) * B, B) == want[b * B..(b + 1) * B]);
    }
    eprintln!("status() polls: {polls}");
}

/// Dropped transfers: one dropped at once still lands (nothing posted is
/// cancelled) and, on an ordered link where its notification was posted
/// right behind its pieces, still notifies, once; one dropped after a poll
/// saw its pieces placed still notifies, once; later requests are
/// unaffected.
pub async fn dropped_transfers_leave_the_agent_consistent() {
    const B: usize = 1 << 20;
    let (decode, prefill, cache, region) = pair(64 * B);
    let kv = prefill.alloc(32 * B).unwrap();
    prefill.register(&kv).unwrap();
    kv.write_from(0, &pattern(32 * B, 6)).unwrap();
    prefill.connect("decode").await.unwrap();
    let pieces: Vec<_> =
        (0..32).map(|b| (kv.view(b * B, B).unwrap(), RemoteBlock::new(region, (b * 2 * B) as u64, B as u64))).collect();
    drop(prefill.transfer(Op::Write, "decode", &pieces, Some(b"dropped early")).unwrap());
    // Dropped once it is handing over or has handed over its notification.
    let one = [(kv.view(0, 4096).unwrap(), RemoteBlock::new(region, B as u64, 4096))];
    let mut t = prefill.transfer(Op::Write, "decode", &one, Some(b"dropped late")).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !matches!(t.status(), TransferStatus::Done) && !format!("{t:?}").contains("notifying") {
        assert!(Instant::now() < deadline);
        tokio::time::sleep(Duration::from_micros(50)).await;
    }
    drop(t);
    prefill.transfer(Op::Write, "decode", &one, Some(b"after")).unwrap().await.unwrap();
    assert_eq!(next_notification(&decode).await.message, b"dropped early");
    assert_eq!(next_notification(&decode).await.message, b"dropped late");
    assert_eq!(next_notification(&decode).await.message, b"after");
    no_more_notifications(&decode).await;
    // The early-dropped request's data still landed.
    let want = pattern(32 * B, 6);
    let deadline = Instant::now() + Duration::from_secs(20);
    for b in 0..32 {
        while contents(&cache, b * 2 * B, B) != want[b * B..(b + 1) * B] {
            assert!(Instant::now() < deadline, "block {b} of the dropped request never landed");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

/// Both agents transfer to each other first, at once (or b a little
/// later, so that its attempt meets a's at every stage): one connection,
/// both requests land, each side's notification arrives.
pub async fn both_sides_transfer_first_at_once() {
    for round in 0..12 {
        let delay = Duration::from_micros([0, 0, 0, 50, 100, 200, 400, 700, 1000, 1500, 2500, 4000][round]);
        let a = TransferAgent::new(&format!("a{round}"), config()).unwrap();
        let b = TransferAgent::new(&format!("b{round}"), config()).unwrap();
        let (ma, mb) = (a.alloc(4096).unwrap(), b.alloc(4096).unwrap());
        let (ra, rb) = (a.register(&ma).unwrap(), b.register(&mb).unwrap());
        ma.write_from(0, &[1; 4096]).unwrap();
        mb.write_from(0, &[2; 4096]).unwrap();
        a.add_peer(&b.metadata()).unwrap();
        b.add_peer(&a.metadata()).unwrap();
        let pa = [(ma.view(0, 64).unwrap(), RemoteBlock::new(rb, 1024, 64))];
        let pb = [(mb.view(0, 64).unwrap(), RemoteBlock::new(ra, 2048, 64))];
        let ta = a.transfer(Op::Write, &format!("b{round}"), &pa, Some(b"from a")).unwrap();
        let tb = b.transfer(Op::Write, &format!("a{round}"), &pb, Some(b"from b")).unwrap();
        let tb = async move {
            tokio::time::sleep(delay).await;
            tb.await
        };
        let (x, y) = tokio::join!(ta, tb);
        x.unwrap();
        y.unwrap();
        assert_eq!(next_notification(&b).await.message, b"from a");
        assert_eq!(next_notification(&a).await.message, b"from b");
        assert_eq!(contents(&mb, 1024, 64), [1; 64]);
        assert_eq!(contents(&ma, 2048, 64), [2; 64]);
        assert_eq!((a.stats().connections, b.stats().connections), (1, 1), "round {round}: one connection per side");
    }
}

/// A peer whose agent is gone: the transfer fails naming it, quickly, and
/// moves nothing; so does a peer that goes away under a stream of
/// requests.
pub async fn a_gone_peer_is_named() {
    const B: usize = 1 << 20;
    let (decode, prefill, cache, region) = pair(16 * B);
    let kv = prefill.alloc(16 * B).unwrap();
    prefill.register(&kv).unwrap();
    let pieces: Vec<_> =
        (0..16).map(|b| (kv.view(b * B, B).unwrap(), RemoteBlock::new(region, (b * B) as u64, B as u64))).collect();
    // Gone before the first transfer.
    drop(decode);
    let t0 = Instant::now();
    let e = prefill.transfer(Op::Write, "decode", &pieces, Some(b"x")).unwrap().await.unwrap_err();
    assert!(matches!(&e, AgentError::Unreachable { peer, .. } if peer == "decode"), "{e:?}");
    assert!(e.to_string().contains("\"decode\""), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(5), "found in {:?}", t0.elapsed());
    drop(cache);

    // Gone mid-stream.
    let (decode, prefill, _cache, region) = pair(16 * B);
    let kv = prefill.alloc(16 * B).unwrap();
    prefill.register(&kv).unwrap();
    prefill.connect("decode").await.unwrap();
    let pieces: Vec<_> =
        (0..16).map(|b| (kv.view(b * B, B).unwrap(), RemoteBlock::new(region, (b * B) as u64, B as u64))).collect();
    let killer = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(100)).await;
        drop(decode);
    });
    let t0 = Instant::now();
    let e = loop {
        match prefill.transfer(Op::Write, "decode", &pieces, Some(b"more")).unwrap().await {
            Ok(()) => assert!(t0.elapsed() < Duration::from_secs(30), "the peer's loss was never noticed"),
            Err(e) => break e,
        }
    };
    killer.await.unwrap();
    assert_eq!(e.peer(), Some("decode"), "{e:?}");
    assert!(matches!(e, AgentError::PeerLost { .. } | AgentError::Unreachable { .. }), "{e:?}");
    eprintln!("lost peer: {e}");
}

/// remove_peer forgets the peer and closes the connection; the peer can
/// connect back (which adds it again); a restarted peer (new incarnation,
/// same name) is reached through its new metadata.
pub async fn removed_and_restarted_peers() {
    let (decode, prefill, cache, region) = pair(4096);
    let src = prefill.alloc(4096).unwrap();
    let src_region = prefill.register(&src).unwrap();
    let one = [(src.view(0, 8).unwrap(), RemoteBlock::new(region, 0, 8))];
    prefill.transfer(Op::Write, "decode", &one, None).unwrap().await.unwrap();
    assert!(prefill.is_connected("decode"));
    // decode's side settles once its own transport's connect returns, which
    // may be a moment after prefill's first write completed.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !decode.is_connected("prefill") {
        assert!(Instant::now() < deadline, "decode never saw the connection");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    assert!(prefill.remove_peer("decode"));
    assert!(!prefill.remove_peer("decode"));
    assert_eq!(prefill.peers(), Vec::<String>::new());
    assert_eq!(
        prefill.transfer(Op::Write, "decode", &one, None).unwrap_err(),
        AgentError::UnknownPeer { name: "decode".into() }
    );
    // decode still knows prefill (from its handshake) and, once it has
    // seen the connection close, reconnects.
    let deadline = Instant::now() + Duration::from_secs(10);
    while decode.is_connected("prefill") {
        assert!(Instant::now() < deadline, "decode never saw the connection close");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let back = decode.alloc(4096).unwrap();
    decode.register(&back).unwrap();
    assert_eq!(decode.peer_regions("prefill").unwrap()[0].id, src_region);
    let read = [(back.view_mut(0, 8).unwrap(), RemoteBlock::new(src_region, 0, 8))];
    decode.transfer(Op::Read, "prefill", &read, Some(b"hello again")).unwrap().await.unwrap();
    assert_eq!(prefill.peers(), ["decode"]);
    assert_eq!(next_notification(&prefill).await.message, b"hello again");

    // decode restarts: same name, new incarnation.
    drop(decode);
    drop(cache);
    let decode2 = TransferAgent::new("decode", config()).unwrap();
    let cache2 = decode2.alloc(4096).unwrap();
    let region2 = decode2.register(&cache2).unwrap();
    prefill.add_peer(&decode2.metadata()).unwrap();
    src.write_from(0, b"restart!").unwrap();
    let one = [(src.view(0, 8).unwrap(), RemoteBlock::new(region2, 8, 8))];
    prefill.transfer(Op::Write, "decode", &one, Some(b"to the new one")).unwrap().await.unwrap();
    assert_eq!(next_notification(&decode2).await.message, b"to the new one");
    assert_eq!(contents(&cache2, 8, 8), b"restart!");
}

/// A request planned against a peer that then restarts (same name, new
/// metadata) while the request waits for its connection is not sent on the
/// new incarnation's connection: its regions' addresses and keys are the
/// old one's. (It was: the write reached the new agent with a stale key, or
/// into whatever the new agent registered there.) The old agent's port is
/// held by a listener that never answers, so that the request's own
/// connection attempt is still waiting when the new agent connects.
pub async fn a_request_waiting_for_a_restarted_peer_sends_nothing_to_the_new_one() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let at: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let decode = TransferAgent::new("decode", config().with_listen_addr(Some(at))).unwrap();
    let cache = decode.alloc(4096).unwrap();
    let region = decode.register(&cache).unwrap();
    let prefill = TransferAgent::new("prefill", config()).unwrap();
    prefill.add_peer(&decode.metadata()).unwrap();
    let src = prefill.alloc(4096).unwrap();
    prefill.register(&src).unwrap();
    src.write_from(0, b"old plan").unwrap();
    drop(decode);
    drop(cache);
    let deadline = Instant::now() + Duration::from_secs(10);
    let _silent = loop {
        match std::net::TcpListener::bind(at) {
            Ok(l) => break l,
            Err(e) => assert!(Instant::now() < deadline, "the old agent's port stayed taken: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let one = [(src.view(0, 8).unwrap(), RemoteBlock::new(region, 0, 8))];
    let mut t = prefill.transfer(Op::Write, "decode", &one, Some(b"old")).unwrap();
    // Polled once: its connection attempt starts (and waits on the silent
    // listener).
    assert!(matches!(t.status(), rmacomm_agent::TransferStatus::InProgress));
    let decode2 = TransferAgent::new("decode", config()).unwrap();
    let cache2 = decode2.alloc(4096).unwrap();
    let region2 = decode2.register(&cache2).unwrap();
    decode2.add_peer(&prefill.metadata()).unwrap();
    decode2.connect("prefill").await.unwrap();
    let e = tokio::time::timeout(Duration::from_secs(20), t).await.expect("the request ends").unwrap_err();
    assert_eq!(e, AgentError::PeerRemoved { peer: "decode".into() });
    assert!(contents(&cache2, 0, 8) != b"old plan");
    // The new incarnation's connection is whole: a request planned for it
    // lands, and its notification is the first decode2 gets.
    src.write_from(0, b"new plan").unwrap();
    let one = [(src.view(0, 8).unwrap(), RemoteBlock::new(region2, 0, 8))];
    prefill.transfer(Op::Write, "decode", &one, Some(b"new")).unwrap().await.unwrap();
    assert_eq!(next_notification(&decode2).await.message, b"new");
    assert_eq!(contents(&cache2, 0, 8), b"new plan");
    no_more_notifications(&decode2).await;
}

/// Metadata travels through a bootstrap Store.
pub async fn metadata_through_a_store() {
    let store = std::sync::Arc::new(rmacomm_window::HashStore::new());
    let decode = TransferAgent::new("decode", config()).unwrap();
    let cache = decode.alloc(4096).unwrap();
    let region = decode.register(&cache).unwrap();
    rmacomm_agent::publish_metadata(store.as_ref(), &decode).unwrap();
    let s = store.clone();
    let meta = tokio::task::spawn_blocking(move || {
        rmacomm_agent::fetch_metadata(s.as_ref(), "decode", Duration::from_secs(5))
    })
    .await
    .unwrap()
    .unwrap();
    let prefill = TransferAgent::new("prefill", config()).unwrap();
    assert_eq!(prefill.add_peer(&meta).unwrap(), "decode");
    let published = rmacomm_agent::PeerRegion { id: region, addr: cache.as_ptr() as u64, len: 4096 };
    assert_eq!(prefill.peer_regions("decode").unwrap(), [published]);
    let src = prefill.alloc(4096).unwrap();
    prefill.register(&src).unwrap();
    src.write_from(0, b"via store").unwrap();
    prefill
        .transfer(Op::Write, "decode", &[(src.view(0, 9).unwrap(), RemoteBlock::new(region, 0, 9))], None)
        .unwrap()
        .await
        .unwrap();
    assert_eq!(contents(&cache, 0, 9), b"via store");
}

/// Whether the connection takes the same-host (mapped memory) path.
pub async fn same_host_path(expect: bool) {
    let (_decode, prefill, _cache, _region) = pair(4096);
    assert_eq!(prefill.peer_same_host("decode").await.unwrap(), expect);
}

/// Debug output and errors never show a token.
pub async fn tokens_never_show() {
    let (decode, prefill, _cache, _region) = pair(4096);
    let meta = decode.metadata();
    let payload = meta.split(':').nth(1).unwrap();
    let shown = format!("{decode:?} {prefill:?}");
    assert!(!shown.contains(payload) && shown.contains("decode"), "{shown}");
    let mut bad = meta.clone();
    bad.push('!');
    let e = prefill.add_peer(&bad).unwrap_err();
    assert!(!e.to_string().contains(payload), "{e}");
}

/// A region the peer dropped: a request into it fails naming the peer (on
/// the same host the caller's copy through the mapped region finds its key
/// revoked and copies nothing; over tcp the peer refuses the write), and
/// requests into the peer's other regions still work.
pub async fn a_dropped_peer_region_fails_the_request() {
    const B: usize = 64 << 10;
    let (decode, prefill, cache, region) = pair(4 * B);
    let other = decode.alloc(4 * B).unwrap();
    let other_id = decode.register(&other).unwrap();
    prefill.add_peer(&decode.metadata()).unwrap();
    let kv = prefill.alloc(B).unwrap();
    prefill.register(&kv).unwrap();
    kv.write_from(0, &pattern(B, 9)).unwrap();
    let piece = |r: u32| [(kv.view(0, B).unwrap(), RemoteBlock::new(r, 0, B as u64))];
    // The first requests map the region (in the background) on the same host.
    for _ in 0..3 {
        prefill.transfer(Op::Write, "decode", &piece(region), None).unwrap().await.unwrap();
        prefill.transfer(Op::Write, "decode", &piece(other_id), None).unwrap().await.unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(decode.deregister(&cache));
    drop(cache);
    let r = match prefill.transfer(Op::Write, "decode", &piece(region), Some(b"never")) {
        Ok(t) => tokio::time::timeout(Duration::from_secs(20), t).await.expect("the request ends"),
        Err(e) => Err(e),
    };
    let e = r.expect_err("a write into a dropped region fails");
    eprintln!("request into a dropped region: {e}");
    assert_eq!(e.peer(), Some("decode"), "{e}");
    // Refused, on either path: not the connection's loss, which the failure
    // of the notification posted behind the write once reported instead.
    assert!(matches!(e, AgentError::Refused { op: "write", .. }), "{e:?}");
    if prefill.peer_same_host("decode").await.unwrap() {
        // The mapped path was taken (the region was mapped by the first
        // requests) and refused the copy.
        assert!(e.to_string().contains("nothing was copied"), "{e}");
    }
    // A request into a live region and the dropped one: the call returns
    // (the first piece may be placed: an error from the call would say
    // nothing moved), the request fails.
    let both = [
        (kv.view(0, B).unwrap(), RemoteBlock::new(other_id, 0, B as u64)),
        (kv.view(0, B).unwrap(), RemoteBlock::new(region, 0, B as u64)),
    ];
    let t = prefill.transfer(Op::Write, "decode", &both, Some(b"never")).expect("the call itself succeeds");
    let e = tokio::time::timeout(Duration::from_secs(20), t).await.expect("the request ends").unwrap_err();
    assert!(matches!(e, AgentError::Refused { op: "write", .. }), "{e:?}");
    prefill.transfer(Op::Write, "decode", &piece(other_id), Some(b"other")).unwrap().await.unwrap();
    assert_eq!(next_notification(&decode).await.message, b"other");
    no_more_notifications(&decode).await;
    assert!(contents(&other, 0, B) == pattern(B, 9));
}

/// Requests on memory held by an `Arc` ([`rmacomm_agent::OwnedBlock`]) are
/// `Transfer<'static>`: spawned onto other tasks, outliving the caller's
/// handles on the memory, writes and reads land.
pub async fn owned_transfers_are_static() {
    use std::sync::Arc;

    use rmacomm_agent::OwnedBlock;
    const B: usize = 16 << 10;
    let (decode, prefill, cache, region) = pair(16 * B);
    let kv = Arc::new(prefill.alloc(16 * B).unwrap());
    prefill.register(&kv).unwrap();
    kv.write_from(0, &pattern(16 * B, 11)).unwrap();
    let remote = |b: usize| RemoteBlock::new(region, ((15 - b) * B) as u64, B as u64);
    let pieces: Vec<_> = (0..16).map(|b| (OwnedBlock::new(kv.clone(), b * B, B).unwrap(), remote(b))).collect();
    let t: rmacomm_agent::Transfer<'static> = prefill.transfer(Op::Write, "decode", &pieces, Some(b"owned")).unwrap();
    drop(pieces);
    tokio::spawn(t).await.unwrap().unwrap();
    assert_eq!(next_notification(&decode).await.message, b"owned");
    let want = pattern(16 * B, 11);
    for b in 0..16 {
        assert!(contents(&cache, (15 - b) * B, B) == want[b * B..(b + 1) * B], "block {b}");
    }
    // A read into owned memory; the pieces (and their Arcs) dropped before
    // it runs.
    let back = Arc::new(prefill.alloc(16 * B).unwrap());
    prefill.register(&back).unwrap();
    let pieces: Vec<_> = (0..16).map(|b| (OwnedBlock::new(back.clone(), b * B, B).unwrap(), remote(b))).collect();
    let t = prefill.transfer(Op::Read, "decode", &pieces, None).unwrap();
    drop(pieces);
    tokio::spawn(t).await.unwrap().unwrap();
    assert!(contents(&back, 0, 16 * B) == want);
    // Bounds are checked when the block is made.
    assert!(OwnedBlock::new(back.clone(), 16 * B - 8, 16).is_err());
}

/// A notification made while every in-flight slot is taken, and dropped
/// before its future ran: it still reaches the peer, in its place, and the
/// ones after it too. (Its ring seq used to be claimed before its write
/// was posted, which then never happened: the next notification landed in
/// the next slot, the peer found none in the one it expected and dropped
/// the connection.)
pub async fn a_notification_dropped_while_the_slots_are_taken_still_arrives() {
    const B: usize = 1 << 20;
    let few = config()
        .with_transport(TransportConfig::default().with_timeout(Some(Duration::from_secs(30))).with_max_in_flight(4));
    let (decode, prefill, _cache, region) = pair_with(config(), few, 128 * B);
    let kv = prefill.alloc(64 * B).unwrap();
    prefill.register(&kv).unwrap();
    prefill.connect("decode").await.unwrap();
    let pieces: Vec<_> =
        (0..64).map(|b| (kv.view(b * B, B).unwrap(), RemoteBlock::new(region, (b * 2 * B) as u64, B as u64))).collect();
    // Takes the four slots; the rest of its pieces wait to be polled.
    let big = prefill.transfer(Op::Write, "decode", &pieces, None).unwrap();
    let mut b = prefill.notify("decode", b"B").unwrap();
    let _ = b.status();
    drop(b);
    big.await.unwrap();
    prefill.notify("decode", b"C").unwrap().await.unwrap();
    assert_eq!(next_notification(&decode).await.message, b"B");
    assert_eq!(next_notification(&decode).await.message, b"C");
    no_more_notifications(&decode).await;
}

/// A request whose notification goes right behind its pieces, while
/// another task's requests take in-flight slots at the same time: the
/// notification never arrives before the data it announces. (Pieces that
/// lost their slot to the other task were posted later, behind the
/// notification, which the peer then saw first.)
pub async fn a_notification_never_overtakes_its_pieces() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    const B: usize = 4096;
    let few = config()
        .with_transport(TransportConfig::default().with_timeout(Some(Duration::from_secs(30))).with_max_in_flight(16));
    let (decode, prefill, cache, region) = pair_with(config(), few, 64 * B);
    let prefill = Arc::new(prefill);
    let kv = Arc::new(prefill.alloc(64 * B).unwrap());
    prefill.register(&kv).unwrap();
    prefill.connect("decode").await.unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    // Task A: 12-piece writes without a notification into blocks 32..44.
    let noise = tokio::spawn({
        let (prefill, kv, stop) = (prefill.clone(), kv.clone(), stop.clone());
        async move {
            while !stop.load(Ordering::Relaxed) {
                let pieces: Vec<_> = (0..12)
                    .map(|b| {
                        (
                            kv.view((32 + b) * B, B).unwrap(),
                            RemoteBlock::new(region, ((32 + 2 * b) * B) as u64, B as u64),
                        )
                    })
                    .collect();
                prefill.transfer(Op::Write, "decode", &pieces, None).unwrap().await.unwrap();
            }
        }
    });
    // Task B (here): 8-piece writes of round r's pattern into blocks 0..8,
    // each announcing r; decode checks the blocks when r arrives.
    let mut stream = decode.notifications();
    for r in 0..600u64 {
        let want = pattern(8 * B, r);
        kv.write_from(0, &want).unwrap();
        let pieces: Vec<_> =
            (0..8).map(|b| (kv.view(b * B, B).unwrap(), RemoteBlock::new(region, (b * B) as u64, B as u64))).collect();
        let t = prefill.transfer(Op::Write, "decode", &pieces, Some(&r.to_le_bytes())).unwrap();
        // The transfer is polled meanwhile: a notification not sent right
        // behind the pieces is sent once a poll sees them placed.
        let check = async {
            let n = tokio::time::timeout(Duration::from_secs(20), stream.next()).await.unwrap().unwrap();
            (n, contents(&cache, 0, 8 * B))
        };
        let ((n, got), sent) = tokio::join!(check, t);
        sent.unwrap();
        assert_eq!(n.message, r.to_le_bytes());
        assert!(got == want, "round {r}: the notification arrived before its data");
    }
    stop.store(true, Ordering::Relaxed);
    noise.await.unwrap();
}
