//! `map_remote`: a same-host peer's buffer mapped here (the UNIFIED path):
//! copies and atomics by the calling thread, every copy checked against the
//! peer's key table, nothing moved once the owner deregistered.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use common::{contents, pattern};
use rmacomm_transport::{RdmaMemory, RdmaRemoteBuffer, RdmaTransport};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_same_host_peers_buffer_is_mapped_and_checked_on_every_copy() {
    common::link("shm");
    let (a, b) = common::pair().await;
    let dst = RdmaMemory::alloc_for(&b, 1 << 20).unwrap();
    let src = RdmaMemory::alloc_for(&a, 1 << 20).unwrap();
    src.write_from(0, &pattern(1 << 20, 7)).unwrap();
    // A slice of the peer's buffer: offsets count from its start.
    let rb = dst.remote_buffer().slice(4096, 64 << 10).unwrap();
    let m = a.map_remote(&rb).await.unwrap().expect("same host, shared segment: mapped");
    assert_eq!(m.len(), 64 << 10);
    assert!(m.is_registered());

    // put (registered source) and plain bytes, then get, all by this thread.
    m.put(src.view(100, 1000).unwrap(), 8).unwrap();
    assert_eq!(contents(&dst, 4096 + 8, 1000), pattern(1 << 20, 7)[100..1100]);
    m.write_from(2000, b"hello").unwrap();
    assert_eq!(contents(&dst, 4096 + 2000, 5), b"hello");
    let back = RdmaMemory::alloc_for(&a, 4096).unwrap();
    m.get(back.view_mut(0, 1000).unwrap(), 8).unwrap();
    assert_eq!(contents(&back, 0, 1000), pattern(1 << 20, 7)[100..1100]);

    // Bounds: the mapped slice, not the peer's whole buffer.
    assert!(m.write_from((64 << 10) - 4, b"12345").is_err());
    assert!(m.put(src.view(0, 16).unwrap(), usize::MAX - 8).is_err());
    assert_eq!(contents(&dst, 4096 + (64 << 10) - 4, 4), [0u8; 4], "a refused copy moved nothing");

    // Atomics are shared with the owner's view of the same word.
    m.atomic_u64(8192).unwrap().fetch_add(5, Ordering::AcqRel);
    assert_eq!(dst.atomic_u64(4096 + 8192).unwrap().load(Ordering::Acquire), 5);
    assert!(m.atomic_u64(3).is_err(), "unaligned");

    // Once the owner drops its memory, copies fail and move nothing.
    drop(dst);
    assert!(!m.is_registered());
    let e = m.write_from(0, b"late").unwrap_err().to_string();
    assert!(e.contains("no longer registers"), "{e}");
    let mut out = [0u8; 4];
    assert!(m.read_into(0, &mut out).is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unregistered_keys_fail_and_private_memory_is_not_mapped() {
    common::link("shm");
    let (a, b) = common::pair().await;
    let dst = RdmaMemory::alloc_for(&b, 8192).unwrap();
    let mut bad = dst.remote_buffer();
    bad.key ^= 0x5a5a_0000;
    let e = a.map_remote(&bad).await.unwrap_err().to_string();
    assert!(e.contains("does not register"), "{e}");
    let beyond = RdmaRemoteBuffer { len: dst.remote_buffer().len + 4096, ..dst.remote_buffer() };
    assert!(a.map_remote(&beyond).await.is_err(), "past the end of the peer's region");
    // Memory outside a shared segment (a registered Vec) has no mapping:
    // the caller uses write/read.
    let private = RdmaMemory::register_for(&b, vec![0u8; 8192]).unwrap();
    assert!(a.map_remote(&private.remote_buffer()).await.unwrap().is_none());
}

/// Waits (at most 10 s) until `t` holds `n` mappings for direct copies.
async fn direct_mappings(t: &rmacomm_transport::RdmaTransport, n: usize) {
    let end = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while t.direct_mappings() != n {
        assert!(std::time::Instant::now() < end, "{} direct mappings, not {n}", t.direct_mappings());
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
}

/// `write` and `read` to a same-host peer: the first operation on a key
/// goes through the QP and maps the region; later ones are copied by the
/// calling thread when called (nothing in flight, the data already there
/// before the future is awaited). The mapping covers the whole region the
/// key registers, so any other slice of it is copied at once too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_host_writes_and_reads_are_copied_when_called() {
    common::link("shm");
    let (a, b) = common::pair().await;
    let dst = RdmaMemory::alloc_for(&b, 1 << 20).unwrap();
    let src = RdmaMemory::alloc_for(&a, 1 << 20).unwrap();
    let rb = dst.remote_buffer();
    let head = rb.slice(0, 4096).unwrap();
    assert_eq!(a.direct_mappings(), 0);
    a.write(src.view(0, 4096).unwrap(), &head, false).await.unwrap();
    direct_mappings(&a, 2).await;

    src.write_from(0, &pattern(4096, 1)).unwrap();
    let f = a.write(src.view(0, 4096).unwrap(), &head, false);
    assert_eq!(a.in_flight(), 0, "copied, not posted");
    assert_eq!(contents(&dst, 0, 4096), pattern(4096, 1), "copied when called");
    f.await.unwrap();

    // Another slice, far from the first: copied at once (one mapping per
    // key, of the whole region).
    let tail = rb.slice((1 << 20) - 100, 100).unwrap();
    src.write_from(0, &pattern(100, 7)).unwrap();
    let f = a.write(src.view(0, 100).unwrap(), &tail, false);
    assert_eq!(a.in_flight(), 0, "a slice the first write did not touch is copied too");
    assert_eq!(contents(&dst, (1 << 20) - 100, 100), pattern(100, 7));
    f.await.unwrap();
    assert_eq!(a.direct_mappings(), 2);
    // The same mapping is there for callers' own copies, with each slice's
    // offset in it.
    let (m, off) = a.cached_mapping(&tail).expect("mapped");
    assert_eq!((m.remote_buffer(), off), (rb, (1 << 20) - 100));
    m.write_from(off, b"mine").unwrap();
    assert_eq!(contents(&dst, (1 << 20) - 100, 4), b"mine");

    // Reads the same way (b maps a's region).
    let back = RdmaMemory::alloc_for(&b, 4096).unwrap();
    let ra = src.remote_buffer().slice(0, 100).unwrap();
    b.read(back.view_mut(0, 100).unwrap(), &ra).await.unwrap();
    direct_mappings(&b, 2).await;
    src.write_from(0, &pattern(100, 99)).unwrap();
    let f = b.read(back.view_mut(0, 100).unwrap(), &ra);
    assert_eq!(b.in_flight(), 0);
    f.await.unwrap();
    assert_eq!(contents(&back, 0, 100), pattern(100, 99));

    // A notifying write still reaches the peer's wait_for_write, behind the
    // copies made before it.
    src.write_from(0, &pattern(4096, 5)).unwrap();
    a.write(src.view(0, 4096).unwrap(), &head, false).await.unwrap();
    a.write(src.view(0, 8).unwrap(), &rb.slice(8192, 8).unwrap(), true).await.unwrap();
    b.wait_for_write().await.unwrap();
    assert_eq!(contents(&dst, 0, 4096), pattern(4096, 5));
    // The page where b counts a's notifications was mapped by the first copy.
    direct_mappings(&a, 2).await;

    // Over the limit (and with the limit at zero) operations take the QP.
    let big = RdmaMemory::alloc_for(&a, 2 << 20).unwrap();
    let dst2 = RdmaMemory::alloc_for(&b, 2 << 20).unwrap();
    for _ in 0..3 {
        a.write(big.view(0, 2 << 20).unwrap(), &dst2.remote_buffer(), false).await.unwrap();
    }
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    assert_eq!(a.direct_mappings(), 2, "a write over direct_copy_max maps nothing");
}

/// A small write behind a large one still in flight (one 8 MiB fragment,
/// over the soft provider's inline-copy budget, so copied by its threads
/// after the post returns) is not copied ahead of it: the later write lands
/// last.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_never_overtakes_an_operation_in_flight() {
    common::link("shm");
    let one_fragment = common::config().with_frag_size(8 << 20);
    let (a, b) = common::pair_with(one_fragment.clone(), one_fragment).await;
    let n = 8 << 20;
    let dst = RdmaMemory::alloc_for(&b, n).unwrap();
    let big = RdmaMemory::alloc_for(&a, n).unwrap();
    let small = RdmaMemory::alloc_for(&a, 4096).unwrap();
    let head = dst.remote_buffer().slice(0, 4096).unwrap();
    a.write(small.view(0, 4096).unwrap(), &head, false).await.unwrap();
    direct_mappings(&a, 2).await;
    big.write_from(0, &vec![0xAA; n]).unwrap();
    for round in 0..20u8 {
        small.write_from(0, &[round; 4096]).unwrap();
        let f1 = a.write(big.view(0, n).unwrap(), &dst.remote_buffer(), false);
        let f2 = a.write(small.view(0, 4096).unwrap(), &head, false);
        assert!(a.in_flight() >= 1);
        f1.await.unwrap();
        f2.await.unwrap();
        assert_eq!(contents(&dst, 0, 4096), vec![round; 4096], "round {round}: the later write must land last");
    }
}

/// The peer deregisters a region mapped for direct copies: the next write
/// moves nothing and fails as through the QP (a remote access error, then
/// the transport is broken), naming the operation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deregistered_mapped_region_fails_like_the_qp() {
    common::link("shm");
    let (a, b) = common::pair().await;
    let dst = RdmaMemory::alloc_for(&b, 8192).unwrap();
    let src = RdmaMemory::alloc_for(&a, 8192).unwrap();
    let rb = dst.remote_buffer();
    a.write(src.view(0, 64).unwrap(), &rb.slice(0, 64).unwrap(), false).await.unwrap();
    direct_mappings(&a, 2).await;
    drop(dst);
    let e = a.write(src.view(0, 64).unwrap(), &rb.slice(0, 64).unwrap(), false).await.unwrap_err();
    assert!(matches!(e, rmacomm_transport::TransportError::RemoteAccess { op: "write", .. }), "{e}");
    assert_eq!(a.direct_mappings(), 1, "the key is given up (the page stays)");
    assert!(!a.connected());
}

/// Direct copies stay right across many transports and domains made and
/// dropped in one process (each round opens a new soft context, with new
/// key tables and segments): every write lands where it was aimed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn direct_copies_stay_right_across_recreated_domains() {
    common::link("shm");
    let mut direct = 0;
    for round in 0..40u64 {
        let (a, b) = common::pair().await;
        let dst = RdmaMemory::alloc_for(&b, 1 << 16).unwrap();
        let src = RdmaMemory::alloc_for(&a, 4096).unwrap();
        let rb = dst.remote_buffer();
        for k in 0..40u64 {
            let data = pattern(4096, round * 1000 + k);
            src.write_from(0, &data).unwrap();
            let off = (k * 4096) % (1 << 16);
            let f = a.write(src.view(0, 4096).unwrap(), &rb.slice(off, 4096).unwrap(), false);
            direct += usize::from(a.in_flight() == 0);
            f.await.unwrap();
            assert_eq!(contents(&dst, off as usize, 4096), data, "round {round}, write {k}");
            if k % 8 == 0 {
                tokio::time::sleep(std::time::Duration::from_micros(200)).await;
            }
        }
    }
    assert!(direct > 400, "only {direct} of 1600 writes were direct copies");
}

/// Calls made outside any runtime (a plain thread blocking on each future,
/// as the Python binding does) get direct copies too: the mapping is made on
/// the runtime `connect` ran on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_from_plain_threads_are_copied_too() {
    common::link("shm");
    let (a, b) = common::pair().await;
    let dst = RdmaMemory::alloc_for(&b, 8192).unwrap();
    let src = RdmaMemory::alloc_for(&a, 8192).unwrap();
    let rb = dst.remote_buffer().slice(0, 4096).unwrap();
    let rt = tokio::runtime::Handle::current();
    let plain = std::thread::spawn(move || {
        assert!(tokio::runtime::Handle::try_current().is_err(), "a plain thread");
        for i in 0..10_000 {
            src.write_from(0, &pattern(4096, i)).unwrap();
            let f = a.write(src.view(0, 4096).unwrap(), &rb, false);
            let direct = a.in_flight() == 0;
            rt.block_on(f).unwrap();
            if direct {
                return Some(i);
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        None
    });
    while !plain.is_finished() {
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
    let i = plain.join().unwrap().expect("no write from the plain thread was a direct copy");
    assert_eq!(contents(&dst, 0, 4096), pattern(4096, i));
}

/// A same-host pair, `b`'s 4 KiB region `rb` and `a`'s source `src`, with
/// notifications already flowing through `b`'s page: the page and the region
/// are mapped lazily, so the first ones (zero-byte writes here) take the QP.
async fn notes_pair() -> (Arc<RdmaTransport>, Arc<RdmaTransport>, RdmaMemory, RdmaMemory, RdmaRemoteBuffer) {
    common::link("shm");
    let (a, b) = common::pair().await;
    let dst = RdmaMemory::alloc_for(&b, 4096).unwrap();
    let src = RdmaMemory::alloc_for(&a, 4096).unwrap();
    let rb = dst.remote_buffer();
    let mut k = 0;
    while b.direct_notifications() == 0 {
        a.write(src.view(0, 0).unwrap(), &rb, true).await.unwrap();
        b.wait_for_write().await.unwrap();
        k += 1;
        assert!(k < 10_000, "no notification ever came through the page");
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
    (a, b, dst, src, rb)
}

/// Notifying writes to a same-host peer: copied by the caller and counted
/// into the peer's notification page (no work request). The peer's waits
/// see the data; every notification satisfies exactly one wait, whether it
/// came through the page or the QP, and whether the waiter spun, slept
/// (woken through the QP) or came later (banked).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_host_notifications_are_counted_in_shared_memory() {
    common::link("shm");
    let spin = common::config().with_busy_poll(std::time::Duration::from_millis(50));
    let (a, b) = common::pair_with(spin.clone(), spin).await;
    let dst = RdmaMemory::alloc_for(&b, 1 << 16).unwrap();
    let src = RdmaMemory::alloc_for(&a, 1 << 16).unwrap();
    let rb = dst.remote_buffer();
    // Until the page and the region are mapped, notifications take the QP.
    let mut k = 0u64;
    while b.direct_notifications() == 0 {
        src.write_from(0, &pattern(64, k)).unwrap();
        a.write(src.view(0, 64).unwrap(), &rb, true).await.unwrap();
        b.wait_for_write().await.unwrap();
        assert_eq!(contents(&dst, 0, 64), pattern(64, k));
        k += 1;
        assert!(k < 10_000, "no notification ever came through the page");
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }

    // Ping-pong with a spinning waiter on the other side: the data is there
    // when the wait returns, and the notifications came through the page.
    let before = b.direct_notifications();
    let b2 = b.clone();
    let dst2 = RdmaMemory::alloc_for(&b, 64).unwrap();
    let echo_to = RdmaMemory::alloc_for(&a, 64).unwrap();
    let back = echo_to.remote_buffer();
    let echo = tokio::spawn(async move {
        for i in 0..2000u64 {
            b2.wait_for_write().await.unwrap();
            dst2.write_from(0, &i.to_le_bytes()).unwrap();
            b2.write(dst2.view(0, 8).unwrap(), &back, true).await.unwrap();
        }
        dst2
    });
    for i in 0..2000u64 {
        src.write_from(0, &pattern(256, i)).unwrap();
        a.write(src.view(0, 256).unwrap(), &rb, true).await.unwrap();
        a.wait_for_write().await.unwrap();
        assert_eq!(contents(&echo_to, 0, 8), i.to_le_bytes(), "echo {i}");
        assert_eq!(contents(&dst, 0, 256), pattern(256, i), "ping {i}");
    }
    echo.await.unwrap();
    assert!(b.direct_notifications() - before > 1000, "{} of 2000 through the page", b.direct_notifications() - before);
    assert_eq!(a.in_flight() + b.in_flight(), 0);

    // Banked: notifications with nobody waiting are kept, one per wait.
    let n0 = b.direct_notifications();
    for _ in 0..10 {
        a.write(src.view(0, 0).unwrap(), &rb, true).await.unwrap();
    }
    for _ in 0..10 {
        b.wait_for_write_with_timeout(Some(std::time::Duration::from_secs(5))).await.unwrap();
    }
    assert_eq!(b.direct_notifications() - n0, 10, "zero-byte notifications through the page too");
    let e = b.wait_for_write_with_timeout(Some(std::time::Duration::from_millis(50))).await.unwrap_err();
    assert!(e.to_string().contains("wait_for_write"), "{e}");
}

/// A waiter asleep (no busy-polling) is woken by a same-host notifying
/// write: the writer counts it into the page and, seeing the waiter parked,
/// wakes it through the QP. Raced many times, a notification is never lost
/// (a lost one times the wait out) nor counted twice (an extra one satisfies
/// the final wait).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sleeping_waiters_are_woken_and_nothing_is_lost() {
    let (a, b, _dst, src, rb) = notes_pair().await;
    let before = b.direct_notifications();
    const N: u64 = 20_000;
    let b2 = b.clone();
    let done = Arc::new(AtomicU64::new(0));
    let done2 = done.clone();
    let waits = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        for i in 0..N {
            rt.block_on(b2.wait_for_write_with_timeout(Some(std::time::Duration::from_secs(10))))
                .unwrap_or_else(|e| panic!("wait {i}: {e}"));
            done2.store(i + 1, Ordering::Release);
        }
    });
    // Each write aimed at the moment the waiter goes to sleep: once the
    // previous wait returned and the next one is in the table, a little
    // later each time. A notification lost there is never made up for by a
    // later write.
    for i in 0..N {
        let end = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while done.load(Ordering::Acquire) < i || b.waiters() == 0 {
            assert!(std::time::Instant::now() < end, "wait {} never returned", i.saturating_sub(1));
            std::hint::spin_loop();
        }
        for _ in 0..(i % 97) * 4 {
            std::hint::spin_loop();
        }
        src.write_from(0, &i.to_le_bytes()).unwrap();
        a.write(src.view(0, 8).unwrap(), &rb, true).await.unwrap();
    }
    while !waits.is_finished() {
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
    waits.join().unwrap();
    assert!(b.direct_notifications() - before > N / 2, "{} of {N} through the page", b.direct_notifications() - before);
    let e = b.wait_for_write_with_timeout(Some(std::time::Duration::from_millis(50))).await.unwrap_err();
    assert!(e.to_string().contains("wait_for_write"), "an extra notification: {e}");
    assert_eq!(b.waiters(), 0);
}

/// Once the peer's transport is gone, a notifying write is not counted into
/// its (dead) page: it fails the way the QP reports the peer's end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_notifying_write_to_a_dropped_peer_fails() {
    let (a, b, _dst, src, rb) = notes_pair().await;
    // A future of b's outlives b and keeps its state (and notification
    // page) alive: the writes must fail all the same.
    let kept = b.wait_for_write();
    drop(b);
    // At once, before this side's driver has seen the connection go: the
    // dropped side's page says so (its wake-ups go through the QP).
    let first = a.write(src.view(0, 0).unwrap(), &rb, true).await;
    assert!(first.is_err(), "the first notifying write after the drop succeeded");
    let mut failed = None;
    for _ in 0..100 {
        if let Err(e) = a.write(src.view(0, 0).unwrap(), &rb, true).await {
            failed = Some(e);
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    let e = failed.expect("notifying writes to a dropped peer kept succeeding");
    assert!(!a.connected(), "{e}");
    drop(kept);
}

/// A busy-polling wait spins before it joins the waiter table; dropping the
/// transport meanwhile ends it with `Aborted`, as it ends the waits in the
/// table, well before its spin would have ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spinning_wait_ends_aborted_when_the_transport_is_dropped() {
    common::link("shm");
    let spin = common::config().with_busy_poll(std::time::Duration::from_secs(20));
    let (a, b) = common::pair_with(spin.clone(), spin).await;
    let w = a.wait_for_write();
    let t = std::time::Instant::now();
    let waiting = std::thread::spawn(move || futures::executor::block_on(w));
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    drop(a);
    let r = waiting.join().unwrap();
    assert!(matches!(r, Err(rmacomm_transport::TransportError::Aborted { op: "wait_for_write" })), "{r:?}");
    assert!(t.elapsed() < std::time::Duration::from_secs(10), "it spun on for {:?}", t.elapsed());
    drop(b);
}

/// The notification page a transport's URL names (where a same-host peer
/// counts its notifications).
fn notes_page(url: &str) -> RdmaRemoteBuffer {
    use base64::Engine;
    let (_, payload) = url.rsplit_once('/').unwrap();
    let json: serde_json::Value =
        serde_json::from_slice(&base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(payload).unwrap()).unwrap();
    serde_json::from_value(json["n"].clone()).expect("a soft transport's URL names its notification page")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_counting_absurdly_many_notifications_does_not_stall_the_waiter() {
    common::link("shm");
    let a = RdmaTransport::new(common::config()).unwrap();
    let b = Arc::new(RdmaTransport::new(common::config()).unwrap());
    let (ua, ub) = (a.bind().unwrap(), b.bind().unwrap());
    let (ra, rb) = tokio::join!(a.connect(&ub), b.connect(&ua));
    ra.unwrap();
    rb.unwrap();
    // A confused (or hostile) peer writes a huge count into the page: the
    // waiter takes what it needs and banks the rest, in bounded work — it
    // used to hand them out one by one under the transport's lock.
    let m = a.map_remote(&notes_page(&ub)).await.unwrap().expect("same host: the page maps");
    m.atomic_u64(0).unwrap().store(1 << 40, Ordering::SeqCst);
    let waits = tokio::spawn({
        let b = b.clone();
        async move {
            for _ in 0..3 {
                b.wait_for_write_with_timeout(Some(std::time::Duration::from_millis(100))).await?;
            }
            Ok::<_, rmacomm_transport::TransportError>(())
        }
    });
    let done = tokio::time::timeout(std::time::Duration::from_secs(20), waits).await;
    done.expect("the waits returned").unwrap().unwrap();
}

/// Plain writes and reads to a same-host peer that dropped its transport
/// fail (through the QP) instead of being copied into, or out of, memory the
/// peer may already use with another connection: they succeeded until this
/// side's driver noticed the connection had gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_writes_and_reads_to_a_dropped_peer_fail() {
    let (a, b, dst, src, rb) = notes_pair().await;
    src.write_from(0, &[7u8; 64]).unwrap();
    // Direct copies happen while b lives.
    a.write(src.view(0, 64).unwrap(), &rb, false).await.unwrap();
    assert_eq!(contents(&dst, 0, 64), vec![7u8; 64]);
    dst.write_from(0, &[0u8; 64]).unwrap();
    drop(b);
    let w = a.write(src.view(0, 64).unwrap(), &rb, false).await;
    assert!(w.is_err(), "a plain write to a dropped peer succeeded");
    assert_eq!(contents(&dst, 0, 64), vec![0u8; 64], "it landed in the dropped peer's memory");
    let back = RdmaMemory::alloc_for(&a, 64).unwrap();
    assert!(a.read(back.view_mut(0, 64).unwrap(), &rb).await.is_err(), "a read from a dropped peer succeeded");
}

/// As above with plain writes only (found by review): the peer's page was
/// then mapped by nobody, and the copies went on landing in the dropped
/// peer's memory, reported Ok, for milliseconds (thousands of writes).
/// Every direct copy now needs the page, so the drop is seen at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_writes_to_a_dropped_peer_fail_without_a_notifying_write_first() {
    common::link("shm");
    for round in 0..5 {
        let (a, b) = common::pair().await;
        let dst = RdmaMemory::alloc_for(&b, 4096).unwrap();
        let src = RdmaMemory::alloc_for(&a, 4096).unwrap();
        let rb = dst.remote_buffer();
        src.write_from(0, &[7u8; 64]).unwrap();
        // Plain writes until one is a direct copy (done when the call
        // returns: nothing in flight).
        let mut k = 0;
        loop {
            let f = a.write(src.view(0, 64).unwrap(), &rb, false);
            let direct = a.in_flight() == 0;
            f.await.unwrap();
            if direct {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
            k += 1;
            assert!(k < 5000, "round {round}: no write was copied directly");
        }
        dst.write_from(0, &[0u8; 64]).unwrap();
        drop(b);
        let w = a.write(src.view(0, 64).unwrap(), &rb, false).await;
        assert!(w.is_err(), "round {round}: a plain write to a dropped peer succeeded");
        assert_eq!(contents(&dst, 0, 64), vec![0u8; 64], "round {round}: it landed in the dropped peer's memory");
    }
}

/// A peer that allocates, is written once and frees, over and over: the
/// mappings of its freed regions are dropped as new keys come (each kept
/// the peer's freed memory mapped here, up to 4 096 of them, and then no
/// new key was copied directly for the rest of the connection).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mappings_of_freed_peer_regions_are_dropped() {
    common::link("shm");
    let (a, b) = common::pair().await;
    let src = RdmaMemory::alloc_for(&a, 4096).unwrap();
    for _ in 0..300 {
        let dst = RdmaMemory::alloc_for(&b, 64 << 10).unwrap();
        let rb = dst.remote_buffer();
        // The first write maps the region (through the QP meanwhile); the
        // next ones are copies.
        for _ in 0..3 {
            a.write(src.view(0, 64).unwrap(), &rb, false).await.unwrap();
        }
        drop(dst);
    }
    assert!(a.direct_mappings() <= 2 * 64, "{} mappings kept of 300 freed regions", a.direct_mappings());
}
