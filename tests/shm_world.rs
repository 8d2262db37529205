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
fn a_message_of_the_wrong_length_fails_both_sides() {
    let got = Shm.run(2, LONG, |pg| {
        if pg.rank() == 0 {
            pg.send_tensor(&[1.0f32; 4], 1, 0).err()
        } else {
            let mut x = [0.0f32; 5];
            let r = pg.recv_tensor(&mut x, 0, 0).err();
            assert_eq!(x, [0.0; 5], "nothing was copied");
            r
        }
    });
    assert!(got.iter().all(|e| e.is_some()), "{got:?}");
    assert!(matches!(&got[1], Some(Error::InvalidArgument(m)) if m.contains("4 x float32")), "{got:?}");
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
