//! Agent behaviours between agents of one process, soft shm link.

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

const LINK: &str = "shm";

t!(scattered_blocks_land_then_one_notification, common::scattered_blocks_land_then_one_notification());
t!(reads_fetch_scattered_blocks, common::reads_fetch_scattered_blocks());
t!(adjacent_pieces_become_one_operation, common::adjacent_pieces_become_one_operation());
t!(ten_thousand_tiny_pieces_in_one_request, common::ten_thousand_tiny_pieces_in_one_request());
t!(bad_requests_move_nothing, common::bad_requests_move_nothing());
t!(notifications_follow_completion_order, common::notifications_follow_completion_order());
t!(status_completes_a_transfer_without_await, common::status_completes_a_transfer_without_await());
t!(dropped_transfers_leave_the_agent_consistent, common::dropped_transfers_leave_the_agent_consistent());
t!(both_sides_transfer_first_at_once, common::both_sides_transfer_first_at_once());
t!(a_gone_peer_is_named, common::a_gone_peer_is_named());
t!(removed_and_restarted_peers, common::removed_and_restarted_peers());
t!(
    a_request_waiting_for_a_restarted_peer_sends_nothing_to_the_new_one,
    common::a_request_waiting_for_a_restarted_peer_sends_nothing_to_the_new_one()
);
t!(metadata_through_a_store, common::metadata_through_a_store());
t!(same_host_peers_take_the_mapped_path, common::same_host_path(true));
t!(tokens_never_show, common::tokens_never_show());
t!(a_dropped_peer_region_fails_the_request, common::a_dropped_peer_region_fails_the_request());
t!(owned_transfers_are_static, common::owned_transfers_are_static());
