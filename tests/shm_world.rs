//! The shared-memory world from Rust, with threads standing in for processes: each thread joins over
//! TCP and maps the segment on its own (at its own address), exactly as a process would. Process
//! deaths, permissions and leaks are tested from Python (tests/test_shm.py).

mod common;

use axonml_distributed::{Backend, BufMut, Error, ReduceOp};

use common::{bits, input, reference, Shm, Worlds, LONG};

/// A segment array holding `data` (the zero-copy path).
fn in_segment(b: &dyn Backend, data: &[f32]) -> axonml_distributed::backend::SharedMem {
    let m = b.alloc(data.len() * 4).unwrap().expect("arena space");
    // SAFETY: a fresh allocation of data.len() floats.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), m.as_ptr().cast(), data.len()) };
    m
}

#[test]
fn all_reduce_matches_the_rank_order_reference_on_private_and_segment_buffers() {
    for n in [1, 2, 3] {
        let lens = [0, 1, 7, 1023, 16 * 1024 + 1, 3 * 4096 + 3, 600_001];
        let got = Shm.run(n, LONG, move |pg| {
            let mut out = vec![];
            for len in lens {
                for op in ReduceOp::ALL {
                    let mut x = input(pg.rank(), len);
                    pg.all_reduce_tensor(&mut x, op).unwrap();
                    let m = in_segment(&**pg.backend(), &input(pg.rank(), len));
                    // SAFETY: `m` holds len floats and only this call uses it.
                    let seg = unsafe { BufMut::from_raw(axonml_distributed::DType::F32, m.as_ptr(), len) };
                    pg.backend().all_reduce(seg, op).unwrap();
                    // SAFETY: as above, after the call.
                    let y = unsafe { std::slice::from_raw_parts(m.as_ptr().cast::<f32>(), len) }.to_vec();
                    out.push((len, op, x, y));
                }
            }
            out
        });
        for (r, results) in got.iter().enumerate() {
            for (len, op, x, y) in results {
                let want = bits(&reference(n, *len, *op));
                assert_eq!(bits(x), want, "n={n} len={len} op={op} rank {r} private");
                assert_eq!(bits(y), want, "n={n} len={len} op={op} rank {r} segment");
            }
        }
    }
}

#[test]
fn a_message_of_the_wrong_length_fails_the_receiver_and_a_waiting_sender() {
    // Small: sent eagerly, so only the receiver fails (as in the in-process world). Large: the sender
    // waits for the receiver and fails too.
    for len in [4usize, 100_000] {
        let got = Shm.run(2, LONG, move |pg| {
            if pg.rank() == 0 {
                pg.send_tensor(&vec![1.0f32; len], 1, 0).err()
            } else {
                let mut x = vec![0.0f32; len + 1];
                let r = pg.recv_tensor(&mut x, 0, 0).err();
                assert!(x.iter().all(|&v| v == 0.0), "nothing was copied");
                r
            }
        });
        let want = format!("{len} x float32");
        assert!(matches!(&got[1], Some(Error::InvalidArgument(m)) if m.contains(&want)), "{got:?}");
        assert_eq!(got[0].is_some(), len > 4, "len {len}: {got:?}");
    }
}

#[test]
fn both_ranks_may_send_small_messages_before_receiving() {
    common::both_ranks_may_send_small_messages_before_receiving(&Shm);
}

#[test]
fn receives_match_tags_out_of_order_in_send_order_per_tag() {
    common::receives_match_tags_out_of_order_in_send_order_per_tag(&Shm);
}

#[test]
fn a_large_message_of_another_tag_is_buffered_by_the_receiver() {
    // shm only: a receiver looking for tag 11 takes the large tag-10 message ahead of it off the
    // channel into its own memory, so that send completes (the in-process world would wait for a
    // recv of tag 10 and deadlock here; MPI allows both).
    let big: Vec<i32> = (0..300_007).collect();
    let got = Shm.run(2, LONG, move |pg| {
        if pg.rank() == 0 {
            pg.send_tensor(&big, 1, 10).unwrap();
            pg.send_tensor(&[6i32], 1, 11).unwrap();
            true
        } else {
            let mut d = [0i32; 1];
            pg.recv_tensor(&mut d, 0, 11).unwrap();
            let mut large = vec![0i32; big.len()];
            pg.recv_tensor(&mut large, 0, 10).unwrap();
            d == [6] && large == big
        }
    });
    assert_eq!(got, [true, true]);
}

#[test]
fn rooted_and_gathering_collectives_deliver_the_right_parts() {
    common::rooted_and_gathering_collectives_deliver_the_right_parts(&Shm, &[1, 5000, 300_007]);
}

#[test]
fn subgroups_are_independent_and_concurrent() {
    common::subgroups_are_independent_and_concurrent(&Shm);
}

#[test]
fn send_recv_match_by_source_and_tag_in_order() {
    common::send_recv_match_by_source_and_tag_in_order(&Shm);
}

#[test]
fn mismatched_calls_fail_on_every_rank_before_touching_buffers() {
    common::mismatched_calls_fail_on_every_rank_before_touching_buffers(&Shm, 100000);
}

#[test]
fn a_rank_that_never_arrives_times_out_naming_it() {
    common::a_rank_that_never_arrives_times_out_naming_it(&Shm);
}

#[test]
fn abort_wakes_every_waiter_with_the_aborting_rank() {
    common::abort_wakes_every_waiter_with_the_aborting_rank(&Shm);
}

#[test]
fn a_rank_never_returns_while_peers_still_write_its_segment_array() {
    // Ranks 0 and 1 loop a zero-copy all_reduce on segment arrays while rank 2 aborts the world at a
    // varying moment; once a call fails, nothing may write the failing rank's array any more.
    let len = 1 << 20;
    for trial in 0..12u64 {
        let connect = Shm.connect(3, LONG);
        let go = std::sync::Arc::new(std::sync::Barrier::new(3));
        let threads: Vec<_> = (0..3)
            .map(|r| {
                let (connect, go) = (connect.clone(), go.clone());
                std::thread::spawn(move || {
                    let w = connect(r);
                    if r == 2 {
                        go.wait();
                        std::thread::sleep(std::time::Duration::from_millis(20 + trial * 13 % 60));
                        w.abort("test");
                        return 0;
                    }
                    let sub = w.split(&[0, 1]).unwrap();
                    let m = w.alloc(len * 4).unwrap().expect("arena space");
                    // SAFETY: `m` holds len floats; only this thread and the collectives touch it.
                    let x = unsafe { std::slice::from_raw_parts_mut(m.as_ptr().cast::<f32>(), len) };
                    go.wait();
                    loop {
                        x.fill(1.0);
                        // SAFETY: as above.
                        let buf =
                            unsafe { BufMut::from_raw(axonml_distributed::DType::F32, m.as_ptr(), len) };
                        if sub.all_reduce(buf, ReduceOp::Sum).is_err() {
                            x.fill(-7.0);
                            std::thread::sleep(std::time::Duration::from_millis(100));
                            return x.iter().filter(|&&v| v != -7.0).count();
                        }
                    }
                })
            })
            .collect();
        let written: Vec<usize> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        assert_eq!(written, [0, 0, 0], "trial {trial}: elements written after the call returned");
    }
}

#[test]
fn a_subgroup_dropped_by_every_member_frees_its_slot_and_staging() {
    // 31 subgroup slots and a pool of 16 staging blocks: without freeing, the ninth group would fail.
    let sums = Shm.run(2, LONG, |pg| {
        let world = axonml_distributed::World::init(pg.backend().clone());
        (0..100)
            .map(|i| {
                let g = world.new_group(&[0, 1]).unwrap();
                // Past the one-shot size, so the staged path uses the group's blocks.
                let mut x = vec![(pg.rank() + i) as f32; 70_000];
                g.all_reduce_tensor(&mut x, ReduceOp::Sum).unwrap();
                x[69_999]
            })
            .collect::<Vec<f32>>()
    });
    for got in &sums {
        assert_eq!(*got, (0..100).map(|i| (2 * i + 1) as f32).collect::<Vec<_>>());
    }
}
