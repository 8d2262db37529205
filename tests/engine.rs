//! The meeting protocol (`rust/engine`), through both worlds: every check of `common` runs once with
//! threads and once with the shared-memory world (threads standing in for processes, each joining over
//! TCP and mapping the segment on its own, as a process would).

mod common;

use std::time::Duration;

/// `$name` as a test in module `threads` and in module `shm`, each running `$check` on its world.
macro_rules! in_both_worlds {
    ($($name:ident => $check:expr;)*) => {
        mod threads {
            use super::*;
            $(#[test] fn $name() { ($check)(&common::Threads) })*
        }
        mod shm {
            use super::*;
            $(#[test] fn $name() { ($check)(&common::Shm) })*
        }
    };
}

fn ms(ms: u64) -> Duration {
    Duration::from_millis(ms)
}

in_both_worlds! {
    rooted_and_gathering_collectives_deliver_the_right_parts =>
        |w| common::rooted_and_gathering_collectives_deliver_the_right_parts(w, &[1, 5000, 300_007]);
    subgroups_are_independent_and_concurrent => common::subgroups_are_independent_and_concurrent;
    send_recv_match_by_source_and_tag_in_order => common::send_recv_match_by_source_and_tag_in_order;
    both_ranks_may_send_small_messages_before_receiving =>
        common::both_ranks_may_send_small_messages_before_receiving;
    receives_match_tags_out_of_order_in_send_order_per_tag =>
        common::receives_match_tags_out_of_order_in_send_order_per_tag;
    mismatched_calls_fail_on_every_rank_before_touching_buffers_small =>
        |w| common::mismatched_calls_fail_on_every_rank_before_touching_buffers(w, 100);
    mismatched_calls_fail_on_every_rank_before_touching_buffers_large =>
        |w| common::mismatched_calls_fail_on_every_rank_before_touching_buffers(w, 100_000);
    a_rank_that_never_arrives_times_out_naming_it => common::a_rank_that_never_arrives_times_out_naming_it;
    a_monitored_barrier_waits_its_own_timeout_and_names_every_missing_rank =>
        common::a_monitored_barrier_waits_its_own_timeout_and_names_every_missing_rank;
    a_subgroup_waits_its_own_timeout_not_the_worlds => common::a_subgroup_waits_its_own_timeout_not_the_worlds;
    abort_wakes_every_waiter_with_the_aborting_rank => common::abort_wakes_every_waiter_with_the_aborting_rank;
    a_group_over_every_rank_does_not_share_the_world_sequence =>
        common::a_group_over_every_rank_does_not_share_the_world_sequence;
    // Pieces from none up to several pipeline rounds of the shm world.
    pairwise_collectives_deliver_the_right_pieces_small =>
        |w| common::pairwise_collectives_deliver_the_right_pieces(w, 7);
    pairwise_collectives_deliver_the_right_pieces_large =>
        |w| common::pairwise_collectives_deliver_the_right_pieces(w, 100_003);
}

// The drain check at each world's own scale: the shm world's arena holds 8 MiB, the thread world's
// buffers are the callers' own, so it runs more and larger trials.
#[test]
fn no_peer_writes_into_a_buffer_after_its_collective_returned_threads() {
    common::no_peer_writes_into_a_buffer_after_its_collective_returned(&common::Threads, 24, 4 << 20, |t| {
        ms(5 + t * 7 % 30)
    });
}

#[test]
fn no_peer_writes_into_a_buffer_after_its_collective_returned_shm() {
    common::no_peer_writes_into_a_buffer_after_its_collective_returned(&common::Shm, 16, 1 << 20, |t| {
        ms(5 + t * 13 % 60)
    });
}
