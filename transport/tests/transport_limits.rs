//! What grows is bounded: operations in flight per transport
//! (`max_in_flight`, with backpressure) and the table of `wait_for_write`
//! calls (timed-out and dropped ones are pruned).

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{contents, pattern};
use rmacomm_transport::{RdmaMemory, TransportError};

const WRITES: usize = 10_000;
const LIMIT: usize = 64;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_writes_at_once_keep_at_most_max_in_flight() {
    common::link("shm");
    let cfg = common::config().with_max_in_flight(LIMIT);
    let (a, b) = common::pair_with(cfg.clone(), cfg).await;
    let src = RdmaMemory::alloc(WRITES * 64).unwrap();
    let dst = RdmaMemory::alloc(WRITES * 64).unwrap();
    for i in 0..WRITES {
        src.write_from(i * 64, &pattern(64, i as u64)).unwrap();
    }
    let rb = dst.remote_buffer();
    // Sample the pending table from another task while the writes run.
    let done = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (a, done) = (a.clone(), done.clone());
        tokio::spawn(async move {
            let (mut max, mut samples) = (0, 0u64);
            while !done.load(Ordering::Acquire) {
                max = max.max(a.in_flight());
                samples += 1;
                tokio::task::yield_now().await;
            }
            (max, samples)
        })
    };
    // All 10,000 calls are made before any is awaited: the first 64 post at
    // once, the rest wait for a slot.
    let writes: Vec<_> = (0..WRITES)
        .map(|i| a.write(src.view(i * 64, 64).unwrap(), &rb.slice(i as u64 * 64, 64).unwrap(), false))
        .collect();
    assert!(a.in_flight() <= LIMIT, "{} in flight right after the calls", a.in_flight());
    for r in futures::future::join_all(writes).await {
        r.unwrap();
    }
    done.store(true, Ordering::Release);
    let (max, samples) = sampler.await.unwrap();
    println!("in flight: at most {max} of {LIMIT} over {samples} samples");
    assert!(max <= LIMIT, "{max} operations were in flight with max_in_flight {LIMIT}");
    assert_eq!(a.in_flight(), 0);
    for i in (0..WRITES).step_by(97) {
        assert_eq!(contents(&dst, i * 64, 64), pattern(64, i as u64), "write {i}");
    }
    assert!(b.connected());
}

/// A call waiting for a slot honours its timeout, and the transport stays usable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_waiting_for_a_slot_times_out_cleanly() {
    common::link("shm");
    let cfg = common::config().with_max_in_flight(1).with_frag_size(8 << 20);
    let (a, b) = common::pair_with(cfg.clone(), cfg).await;
    let src = RdmaMemory::alloc(64 << 20).unwrap();
    let dst = RdmaMemory::alloc(64 << 20).unwrap();
    let big = a.write(src.view(0, 64 << 20).unwrap(), &dst.remote_buffer(), false);
    let small = a.write_with_timeout(src.view(0, 8).unwrap(), &dst.remote_buffer(), false, Some(Duration::ZERO));
    match small.await {
        Ok(()) | Err(TransportError::Timeout { .. }) => {}
        Err(e) => panic!("unexpected {e}"),
    }
    big.await.unwrap();
    src.write_from(0, b"still ok").unwrap();
    a.write(src.view(0, 8).unwrap(), &dst.remote_buffer(), true).await.unwrap();
    b.wait_for_write().await.unwrap();
    assert_eq!(contents(&dst, 0, 8), b"still ok");
    assert!(matches!(
        rmacomm_transport::RdmaTransport::new(common::config().with_max_in_flight(0)),
        Err(TransportError::InvalidArgument { .. })
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timed_out_waits_leave_no_waiters_behind() {
    common::link("shm");
    let (a, b) = common::pair().await;
    // One after the other...
    for _ in 0..WRITES {
        let e = b.wait_for_write_with_timeout(Some(Duration::ZERO)).await.unwrap_err();
        assert!(matches!(e, TransportError::Timeout { .. }), "{e}");
    }
    assert!(b.waiters() <= 1, "{} waiter entries after 10,000 sequential timeouts", b.waiters());
    // ... and all at once.
    let waits: Vec<_> = (0..WRITES).map(|_| b.wait_for_write_with_timeout(Some(Duration::from_millis(20)))).collect();
    for r in futures::future::join_all(waits).await {
        assert!(matches!(r, Err(TransportError::Timeout { .. })), "{r:?}");
    }
    assert_eq!(b.waiters(), 0, "waiter entries left after 10,000 concurrent timeouts");
    // Dropped (never polled to the end) waits are pruned too.
    for _ in 0..WRITES {
        let mut w = Box::pin(b.wait_for_write_with_timeout(None));
        let _ = futures::poll!(w.as_mut());
    }
    assert!(b.waiters() <= 1, "{} waiter entries after 10,000 dropped waits", b.waiters());
    // Even ones dropped before their first poll.
    for _ in 0..WRITES {
        drop(b.wait_for_write_with_timeout(None));
    }
    assert!(b.waiters() <= 1, "{} waiter entries after 10,000 never-polled waits", b.waiters());
    // Notifications still reach the next waiter.
    let (ma, mb) = (RdmaMemory::alloc(4096).unwrap(), RdmaMemory::alloc(4096).unwrap());
    a.write(ma.view(0, 8).unwrap(), &mb.remote_buffer(), true).await.unwrap();
    b.wait_for_write_with_timeout(Some(Duration::from_secs(5))).await.unwrap();
    assert_eq!(b.waiters(), 0);
}
