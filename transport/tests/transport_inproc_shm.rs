//! Transport behaviours between two transports of one process, soft shm link.

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

/// The same behaviours with same-host copies by the caller turned off: every
/// operation goes through the QP.
macro_rules! qp {
    ($name:ident, $body:expr) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            std::env::set_var("RMACOMM_DIRECT_COPY_MAX", "0");
            common::link(LINK);
            $body.await;
        }
    };
}

const LINK: &str = "shm";

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
qp!(
    write_notify_read_every_size_1qp_through_the_qp,
    common::write_notify_read_every_size(1, ibverbx::LoadBalancing::Dqplb)
);
qp!(partial_views_through_the_qp, common::partial_views_touch_only_their_slice());
qp!(bounds_through_the_qp, common::bounds_are_checked_before_anything_moves());
qp!(revoked_key_through_the_qp, common::revoked_key_is_remote_access_then_broken_fails_fast());
