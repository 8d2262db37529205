//! The in-process world from Rust alone: every collective against a sequential reference, subgroups,
//! point-to-point, and the failure paths (mismatch, timeout, abort).

mod common;

use std::sync::Arc;

use axonml_distributed::reduce::reduce_slices;
use axonml_distributed::work::Lane;
use axonml_distributed::{Backend, Error, MockBackend, ProcessGroup, ReduceOp};

use common::{input, Threads, Worlds, LONG};

#[test]
fn all_reduce_matches_sequential_reduction_for_every_op_and_size() {
    for n in [1, 2, 3, 4] {
        for len in [0, 1, 7, 64, 1023, 3 * 4096 + 3, 100_000] {
            for op in ReduceOp::ALL {
                let got = Threads.run(n, LONG, move |pg| {
                    let mut x = input(pg.rank(), len);
                    pg.all_reduce_tensor(&mut x, op).unwrap();
                    x
                });
                let inputs: Vec<Vec<f32>> = (0..n).map(|r| input(r, len)).collect();
                let refs: Vec<&[f32]> = inputs.iter().map(|v| &v[..]).collect();
                let mut want = vec![0.0; len];
                reduce_slices(op, &refs, &mut want).unwrap();
                for (r, g) in got.iter().enumerate() {
                    assert!(
                        g.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "n={n} len={len} op={op} rank {r}"
                    );
                }
            }
        }
    }
}

#[test]
fn bad_arguments_are_refused() {
    let pg = ProcessGroup::mock();
    let mut x = [1i32; 4];
    assert!(matches!(pg.all_reduce_tensor(&mut x, ReduceOp::Average), Err(Error::UnsupportedDtype(_))));
    let b = MockBackend::single();
    assert!(ProcessGroup::with_ranks(Arc::new(b), &[0, 0]).is_err());
    let b = MockBackend::single();
    assert!(matches!(b.split(&[3]), Err(Error::InvalidArgument(_))));
}

#[test]
fn async_work_completes_in_issue_order() {
    let got = Threads.run(2, LONG, |pg| {
        let pg = Arc::new(pg);
        let works: Vec<_> = (0..5)
            .map(|i| {
                let p = pg.clone();
                pg.submit(Lane::Collectives, move || {
                    let mut v = vec![i as f64; 10];
                    p.comm()?.all_reduce(axonml_distributed::BufMut::new(&mut v), ReduceOp::Sum)?;
                    assert_eq!(v[0], 2.0 * i as f64);
                    Ok(())
                })
                .unwrap()
            })
            .collect();
        works.iter().all(|w| w.wait().is_ok())
    });
    assert!(got.into_iter().all(|ok| ok));
}

#[test]
fn rooted_and_gathering_collectives_deliver_the_right_parts() {
    common::rooted_and_gathering_collectives_deliver_the_right_parts(&Threads, &[1, 5000, 300_007]);
}

#[test]
fn subgroups_are_independent_and_concurrent() {
    common::subgroups_are_independent_and_concurrent(&Threads);
}

#[test]
fn send_recv_match_by_source_and_tag_in_order() {
    common::send_recv_match_by_source_and_tag_in_order(&Threads);
}

#[test]
fn mismatched_calls_fail_on_every_rank_before_touching_buffers() {
    common::mismatched_calls_fail_on_every_rank_before_touching_buffers(&Threads, 100);
}

#[test]
fn a_rank_that_never_arrives_times_out_naming_it() {
    common::a_rank_that_never_arrives_times_out_naming_it(&Threads);
}

#[test]
fn abort_wakes_every_waiter_with_the_aborting_rank() {
    common::abort_wakes_every_waiter_with_the_aborting_rank(&Threads);
}

#[test]
fn both_ranks_may_send_small_messages_before_receiving() {
    common::both_ranks_may_send_small_messages_before_receiving(&Threads);
}

#[test]
fn receives_match_tags_out_of_order_in_send_order_per_tag() {
    common::receives_match_tags_out_of_order_in_send_order_per_tag(&Threads);
}

/// A member leaving a collective on an abort must not leave while a peer may still write into its
/// buffer: after the error, the buffer stays exactly as the caller leaves it.
#[test]
fn no_peer_writes_into_a_buffer_after_its_collective_returned() {
    let len = 4 << 20;
    for trial in 0..24u64 {
        let mut ws = MockBackend::create_world_with_timeout(3, LONG);
        let (w2, w1, w0) = (ws.pop().unwrap(), ws.pop().unwrap(), ws.pop().unwrap());
        let go = Arc::new(std::sync::Barrier::new(3));
        let member = |w: MockBackend, go: Arc<std::sync::Barrier>| {
            std::thread::spawn(move || {
                let sub = w.split(&[0, 1]).unwrap();
                let mut x = vec![1.0f32; len];
                go.wait();
                loop {
                    if sub.all_reduce(axonml_distributed::BufMut::new(&mut x), ReduceOp::Sum).is_err() {
                        x.iter_mut().for_each(|v| *v = -7.0);
                        std::thread::sleep(std::time::Duration::from_millis(30));
                        return x.iter().filter(|v| **v != -7.0).count();
                    }
                    x.iter_mut().for_each(|v| *v = 1.0);
                }
            })
        };
        let (h0, h1) = (member(w0, go.clone()), member(w1, go.clone()));
        go.wait();
        std::thread::sleep(std::time::Duration::from_millis(5 + trial * 7 % 30));
        w2.abort("a rank outside the subgroup failed");
        assert_eq!((h0.join().unwrap(), h1.join().unwrap()), (0, 0), "trial {trial}");
    }
}

/// A group over every rank is a group of its own: calls on it never match calls on the world.
#[test]
fn a_group_over_every_rank_does_not_share_the_world_sequence() {
    let got = Threads.run(2, std::time::Duration::from_millis(300), |pg| {
        let all = ProcessGroup::with_ranks(pg.backend().clone(), &[0, 1]).unwrap();
        let (mut x, mut y) = (vec![1.0f32; 4], vec![10.0f32; 4]);
        if pg.rank() == 0 {
            (
                pg.all_reduce_tensor(&mut x, ReduceOp::Sum).is_ok(),
                all.all_reduce_tensor(&mut y, ReduceOp::Sum).is_ok(),
            )
        } else {
            (
                all.all_reduce_tensor(&mut y, ReduceOp::Sum).is_ok(),
                pg.all_reduce_tensor(&mut x, ReduceOp::Sum).is_ok(),
            )
        }
    });
    assert_eq!(got, vec![(false, false), (false, false)], "crossed calls on two groups must fail, not match");
}

#[test]
fn a_panicking_queued_job_fails_its_work_and_aborts_the_world_without_killing_the_lane() {
    let mut world = MockBackend::create_world(2).into_iter().map(|b| ProcessGroup::new(Arc::new(b)));
    let (pg0, pg1) = (world.next().unwrap(), world.next().unwrap());
    let w = pg0.submit(Lane::Collectives, || panic!("boom")).unwrap();
    assert!(matches!(w.wait(), Err(Error::Internal(m)) if m.contains("boom")), "the Work reports the panic");
    let later = pg0.submit(Lane::Collectives, || Ok(())).unwrap();
    assert!(later.wait().is_ok(), "the lane's thread survived");
    assert!(matches!(pg1.barrier(), Err(Error::Aborted { by: 0, .. })), "the peer is told");
}
