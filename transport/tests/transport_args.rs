//! Settings and arguments that are refused (or honoured) rather than
//! panicking, hanging or breaking the connection (found by review).

mod common;

use std::time::{Duration, Instant};

use common::{config, pair, pair_with};
use rmacomm_transport::{RdmaMemory, RdmaRemoteBuffer, RdmaTransport, TransportError};

/// `busy_poll = Duration::MAX` ("spin as long as it takes") panicked adding
/// it to the clock in connect's first wait; it spins to the call's
/// deadline instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_poll_of_duration_max_spins_to_the_deadline() {
    common::link("shm");
    let cfg = config().with_busy_poll(Duration::MAX).with_timeout(Some(Duration::from_secs(20)));
    let (_a, b) = pair_with(cfg.clone(), cfg).await;
    let e = b.wait_for_write_with_timeout(Some(Duration::from_millis(100))).await.unwrap_err();
    assert!(matches!(e, TransportError::Timeout { op: "wait_for_write", .. }), "{e}");
}

/// A call's timeout shorter than `busy_poll` ends the spin: before, the
/// call spun for all of `busy_poll` (30 s here), then reported "timed out
/// after 200ms". (The bound checked is ten times the timeout's slack, not
/// a speed.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timeout_shorter_than_busy_poll_ends_the_spin() {
    common::link("shm");
    let cfg = config().with_busy_poll(Duration::from_secs(30));
    let (_a, b) = pair_with(cfg.clone(), cfg).await;
    let t = Instant::now();
    let e = b.wait_for_write_with_timeout(Some(Duration::from_millis(200))).await.unwrap_err();
    assert!(matches!(e, TransportError::Timeout { op: "wait_for_write", .. }), "{e}");
    assert!(t.elapsed() < Duration::from_secs(10), "a 200 ms timeout returned after {:?}", t.elapsed());
}

/// `recv_depth` 0 posts no receive: the peer's notifying writes would be
/// retried forever (receiver not ready). Refused at `new`.
#[test]
fn a_recv_depth_of_zero_is_refused() {
    common::link("shm");
    let e = RdmaTransport::new(config().with_recv_depth(0)).unwrap_err();
    assert!(matches!(e, TransportError::InvalidArgument { .. }) && e.to_string().contains("recv_depth"), "{e}");
}

/// A remote buffer that ends past the top of the address space (a valid
/// key, a confused address) is an argument error before anything is
/// posted; it broke the connection as a remote access error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unaddressable_remote_buffer_is_refused_and_the_connection_stays() {
    common::link("shm");
    let (a, b) = pair().await;
    let src = RdmaMemory::alloc_for(&a, 4096).unwrap();
    let dst = RdmaMemory::alloc_for(&b, 4096).unwrap();
    let rb = dst.remote_buffer();
    let bad = RdmaRemoteBuffer { addr: u64::MAX - 10, len: 100, ..rb };
    let e = a.write(src.view(0, 64).unwrap(), &bad, false).await.unwrap_err();
    assert!(matches!(e, TransportError::InvalidArgument { op: "write", .. }), "{e}");
    assert!(e.to_string().contains("past the top of the address space"), "{e}");
    let e = a.read(src.view_mut(0, 64).unwrap(), &bad).await.unwrap_err();
    assert!(matches!(e, TransportError::InvalidArgument { op: "read", .. }), "{e}");
    assert!(a.connected());
    a.write(src.view(0, 64).unwrap(), &rb, false).await.unwrap();
}

/// A peer whose URL does not match (another QP count) is refused before
/// any QP is touched, naming `connect`; the transport then connects to a
/// matching peer (it said "an earlier connect of this transport failed").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connect_refused_for_a_mismatched_peer_may_be_retried() {
    common::link("shm");
    let a = RdmaTransport::new(config()).unwrap();
    let b2 = RdmaTransport::new(config().with_qps(2)).unwrap();
    let e = a.connect(&b2.bind().unwrap()).await.unwrap_err();
    assert!(matches!(e, TransportError::InvalidArgument { op: "connect", .. }), "{e}");
    assert!(e.to_string().contains("the peer has 2 data QPs"), "{e}");
    let c = RdmaTransport::new(config()).unwrap();
    let (ua, uc) = (a.bind().unwrap(), c.bind().unwrap());
    let (ra, rc) = tokio::join!(a.connect(&uc), c.connect(&ua));
    ra.unwrap();
    rc.unwrap();
    let src = RdmaMemory::alloc_for(&a, 4096).unwrap();
    let dst = RdmaMemory::alloc_for(&c, 4096).unwrap();
    a.write(src.view(0, 64).unwrap(), &dst.remote_buffer(), false).await.unwrap();
    // Notifying writes wake the peer it connected to: the refused peer's
    // notification page (b2's) was kept, and counted them there.
    for _ in 0..20 {
        a.write(src.view(0, 64).unwrap(), &dst.remote_buffer(), true).await.unwrap();
        c.wait_for_write_with_timeout(Some(Duration::from_secs(10))).await.unwrap();
    }
    assert!(b2.wait_for_write_with_timeout(Some(Duration::from_millis(50))).await.is_err());
}

/// A `wait_for_write` future dropped before its first poll (the losing
/// branch of a `select!`, a caller that failed before awaiting it) while a
/// notification was waiting gives it back: it took it when made.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_dropped_unpolled_loses_no_notification() {
    common::link("shm");
    let (a, b) = pair().await;
    let src = RdmaMemory::alloc_for(&a, 4096).unwrap();
    let dst = RdmaMemory::alloc_for(&b, 4096).unwrap();
    a.write(src.view(0, 64).unwrap(), &dst.remote_buffer(), true).await.unwrap();
    // Arrived: a wait made now has it at once.
    b.wait_for_write_with_timeout(Some(Duration::from_secs(10))).await.unwrap();
    a.write(src.view(0, 64).unwrap(), &dst.remote_buffer(), true).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    drop(b.wait_for_write());
    b.wait_for_write_with_timeout(Some(Duration::from_secs(5))).await.unwrap();
}

/// A long busy poll yields to the runtime between slices: a timeout
/// around the call (how Python's waits look for Ctrl-C) ends it. It spun
/// inside one poll for all of `busy_poll` (30 s here), and held a runtime
/// worker meanwhile. (The bound is ten times the slack, not a speed.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_busy_poll_yields_to_a_timeout_around_it() {
    common::link("shm");
    let cfg = config().with_busy_poll(Duration::from_secs(30)).with_timeout(None);
    let (_a, b) = pair_with(cfg.clone(), cfg).await;
    let t = Instant::now();
    let r = tokio::time::timeout(Duration::from_millis(200), b.wait_for_write()).await;
    assert!(r.is_err(), "nothing was written: {r:?}");
    assert!(t.elapsed() < Duration::from_secs(10), "a 200 ms timeout around the wait returned after {:?}", t.elapsed());
}
