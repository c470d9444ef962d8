//! Transport behaviours between two transports of one process, soft tcp link.

mod common;

macro_rules! t {
    ($name:ident, $body:expr) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            common::link(LINK);
            $body.await;
        }
    };
}

const LINK: &str = "tcp";

t!(write_notify_read_every_size_1qp, common::write_notify_read_every_size(1, ibverbx::LoadBalancing::Dqplb));
t!(write_notify_read_every_size_4qp_spray, common::write_notify_read_every_size(4, ibverbx::LoadBalancing::Spray));
t!(write_notify_read_every_size_4qp_dqplb, common::write_notify_read_every_size(4, ibverbx::LoadBalancing::Dqplb));
t!(partial_views, common::partial_views_touch_only_their_slice());
t!(busy_poll, common::busy_poll_ping_pong());
t!(bounds, common::bounds_are_checked_before_anything_moves());
t!(thousand_concurrent, common::thousand_concurrent_writes_then_thousand_waits());
t!(banked, common::notifications_are_banked());
t!(timeouts, common::timeouts());
t!(revoked_key, common::revoked_key_is_remote_access_then_broken_fails_fast());
t!(wrong_token, common::wrong_token_is_refused());
t!(drop_aborts, common::dropping_the_transport_aborts_pending());
t!(tokens_never_show, common::tokens_never_show_in_debug_or_errors());
t!(concurrent_connects, common::concurrent_connects_one_wins());
t!(connect_retry_rules, common::a_connect_may_be_retried_only_if_it_never_reached_the_peer());

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn map_remote_over_tcp_is_none() {
    common::link(LINK);
    let (a, b) = common::pair().await;
    let dst = rmacomm_transport::RdmaMemory::alloc_for(&b, 8192).unwrap();
    assert!(a.map_remote(&dst.remote_buffer()).await.unwrap().is_none(), "a TCP peer is never mapped");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fetch_add_adds_and_returns_the_old_value() {
    common::link(LINK);
    let (a, b) = common::pair().await;
    let dst = rmacomm_transport::RdmaMemory::alloc_for(&b, 64).unwrap();
    dst.write_from(8, &40u64.to_le_bytes()).unwrap();
    let old = rmacomm_transport::RdmaMemory::alloc_for(&a, 8).unwrap();
    let word = dst.remote_buffer().slice(8, 8).unwrap();
    for (i, add) in [2u64, 5].into_iter().enumerate() {
        a.fetch_add(old.view_mut(0, 8).unwrap(), &word, add, None).await.unwrap();
        let mut v = [0u8; 8];
        old.read_into(0, &mut v).unwrap();
        assert_eq!(u64::from_le_bytes(v), [40, 42][i]);
    }
    assert_eq!(dst.atomic_u64(8).unwrap().load(std::sync::atomic::Ordering::Acquire), 47);
    let unaligned = dst.remote_buffer().slice(4, 8).unwrap();
    assert!(a.fetch_add(old.view_mut(0, 8).unwrap(), &unaligned, 1, None).await.is_err());
}

/// What an agent batching views and running a control plane beside the
/// transport needs: a view names its memory and offset, memory says which
/// transports can move it, and the transport where peers reach it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn views_name_their_memory_and_the_transport_its_tcp_addresses() {
    common::link(LINK);
    let t = rmacomm_transport::RdmaTransport::new(common::config()).unwrap();
    let mem = rmacomm_transport::RdmaMemory::alloc(4096).unwrap();
    let v = mem.view(100, 28).unwrap();
    assert!(std::ptr::eq(v.memory(), &mem) && v.offset() == 100 && v.len() == 28);
    let w = mem.view_mut(7, 9).unwrap();
    assert!(std::ptr::eq(w.memory(), &mem) && w.offset() == 7 && w.len() == 9);
    assert!(mem.is_usable_with(&t));
    let soft =
        ibverbx::soft::SoftConfig { link: ibverbx::soft::SoftLink::Tcp, ..ibverbx::soft::SoftConfig::from_env() };
    let other = rmacomm_transport::RdmaTransport::new(common::config().with_soft(Some(soft))).unwrap();
    assert!(!mem.is_usable_with(&other), "another soft context is another device");
    let addrs = t.tcp_addrs();
    assert!(addrs.iter().any(|a| a.ip().is_loopback()), "{addrs:?}");
    assert!(addrs.iter().all(|a| a.port() != 0), "{addrs:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_direct_copies_over_tcp() {
    common::link(LINK);
    let (a, b) = common::pair().await;
    let dst = rmacomm_transport::RdmaMemory::alloc_for(&b, 8192).unwrap();
    let src = rmacomm_transport::RdmaMemory::alloc_for(&a, 8192).unwrap();
    for _ in 0..20 {
        a.write(src.view(0, 8192).unwrap(), &dst.remote_buffer(), false).await.unwrap();
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
    assert_eq!(a.direct_mappings(), 0, "a TCP peer is never mapped");
}
