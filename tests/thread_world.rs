//! The in-process world from Rust alone: every collective against a sequential reference, subgroups,
//! point-to-point, and the failure paths (mismatch, timeout, abort).

use std::sync::Arc;
use std::time::{Duration, Instant};

use axonml_distributed::reduce::reduce_slices;
use axonml_distributed::{Backend, Error, MockBackend, ProcessGroup, ReduceOp, World};

/// Run `f(pg)` on one thread per rank of a fresh world and return the results in rank order.
fn run<R: Send + 'static>(
    n: usize,
    timeout: Duration,
    f: impl Fn(ProcessGroup) -> R + Send + Sync + 'static,
) -> Vec<R> {
    let f = Arc::new(f);
    let threads: Vec<_> = MockBackend::create_world_with_timeout(n, timeout)
        .into_iter()
        .map(|b| {
            let f = f.clone();
            std::thread::spawn(move || f(ProcessGroup::new(Arc::new(b))))
        })
        .collect();
    threads.into_iter().map(|t| t.join().unwrap()).collect()
}

const LONG: Duration = Duration::from_secs(30);

fn input(rank: usize, len: usize) -> Vec<f32> {
    (0..len).map(|i| ((rank * 7919 + i * 31) % 1013) as f32 * 0.37 - 100.0).collect()
}

#[test]
fn all_reduce_matches_sequential_reduction_for_every_op_and_size() {
    for n in [1, 2, 3, 4] {
        for len in [0, 1, 7, 64, 1023, 3 * 4096 + 3, 100_000] {
            for op in ReduceOp::ALL {
                let got = run(n, LONG, move |pg| {
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
fn rooted_and_gathering_collectives_deliver_the_right_parts() {
    let n = 3;
    let len = 5000;
    let got = run(n, LONG, move |pg| {
        let me = pg.rank();
        let mut b = input(me, len);
        pg.broadcast_tensor(&mut b, 1).unwrap();
        let gathered = pg.all_gather_tensor(&input(me, 10)).unwrap();
        let scattered = pg.reduce_scatter_tensor(&input(me, 3 * len), ReduceOp::Max).unwrap();
        let mut red = input(me, len);
        pg.reduce(&mut red, 2, ReduceOp::Sum).unwrap();
        (b, gathered, scattered, red)
    });
    for (r, (b, gathered, scattered, red)) in got.into_iter().enumerate() {
        assert_eq!(b, input(1, len));
        assert_eq!(gathered, (0..n).flat_map(|j| input(j, 10)).collect::<Vec<_>>());
        let full: Vec<Vec<f32>> = (0..n).map(|j| input(j, 3 * len)).collect();
        let want: Vec<f32> =
            (r * len..(r + 1) * len).map(|i| full.iter().map(|v| v[i]).fold(f32::MIN, f32::max)).collect();
        assert_eq!(scattered, want);
        if r == 2 {
            let want: Vec<f32> =
                (0..len).map(|i| (0..n).map(|j| input(j, len)[i]).fold(0.0, |a, b| a + b)).collect();
            assert_eq!(red, want);
        } else {
            assert_eq!(red, input(r, len), "non-root buffers stay unchanged");
        }
    }
}

#[test]
fn subgroups_are_independent_and_concurrent() {
    let got = run(4, LONG, |pg| {
        let world = World::init(pg.backend().clone());
        let evens = world.new_group(&[0, 2]).unwrap();
        let odds = world.new_group(&[3, 1]).unwrap();
        let mine = if pg.rank() % 2 == 0 { &evens } else { &odds };
        let mut x = vec![pg.rank() as i64 + 1; 9000];
        mine.all_reduce_tensor(&mut x, ReduceOp::Sum).unwrap();
        // A non-member's call fails and aborts the world, so only try it once everyone is done.
        pg.barrier().unwrap();
        let other = if pg.rank() % 2 == 0 { &odds } else { &evens };
        let err = other.barrier().unwrap_err();
        (x[0], mine.ranks().to_vec(), err)
    });
    assert_eq!(got[0].0, 1 + 3);
    assert_eq!(got[1].0, 2 + 4);
    assert_eq!(got[1].1, vec![1, 3]);
    assert!(matches!(got[0].2, Error::InvalidArgument(_) | Error::Aborted { .. }));
}

#[test]
fn send_recv_match_by_source_and_tag_in_order() {
    let got = run(2, LONG, |pg| {
        if pg.rank() == 0 {
            pg.send_tensor(&[1i32, 2], 1, 7).unwrap();
            pg.send_tensor(&[3i32, 4], 1, 7).unwrap_or(());
            pg.send_tensor(&[9i32, 9], 1, 8).unwrap();
            vec![]
        } else {
            let mut a = [0i32; 2];
            let mut b = [0i32; 2];
            let mut c = [0i32; 2];
            // tag 8 was sent last but matches independently of tag 7.
            pg.recv_tensor(&mut a, 0, 7).unwrap();
            pg.recv_tensor(&mut b, 0, 7).unwrap();
            pg.recv_tensor(&mut c, 0, 8).unwrap();
            [a, b, c].concat()
        }
    });
    assert_eq!(got[1], vec![1, 2, 3, 4, 9, 9]);
}

#[test]
fn mismatched_calls_fail_on_every_rank_before_touching_buffers() {
    let got = run(3, LONG, |pg| {
        let mut x = vec![pg.rank() as f32; 100];
        let r = if pg.rank() == 2 {
            pg.all_reduce_tensor(&mut x, ReduceOp::Max)
        } else {
            pg.all_reduce_tensor(&mut x, ReduceOp::Sum)
        };
        (r, x)
    });
    for (r, (res, x)) in got.into_iter().enumerate() {
        match res {
            Err(Error::Mismatch { details, .. }) => {
                assert!(details.contains("rank 2"), "{details}")
            }
            other => panic!("rank {r}: expected a mismatch, got {other:?}"),
        }
        assert!(x.iter().all(|&v| v == r as f32), "buffers untouched");
    }
}

#[test]
fn a_rank_that_never_arrives_times_out_naming_it() {
    let start = Instant::now();
    let got = run(3, Duration::from_millis(300), |pg| {
        if pg.rank() == 1 {
            std::thread::sleep(Duration::from_millis(900));
            pg.barrier().err()
        } else {
            pg.barrier().err()
        }
    });
    assert!(start.elapsed() < Duration::from_secs(5));
    let named = got.iter().flatten().any(|e| match e {
        Error::Timeout { missing, .. } => missing == &vec![1],
        Error::Aborted { reason, .. } => reason.contains("[1]"),
        _ => false,
    });
    assert!(named, "{got:?}");
    assert!(matches!(got[1], Some(Error::Aborted { .. })), "the late rank fails at once: {:?}", got[1]);
}

#[test]
fn abort_wakes_every_waiter_with_the_aborting_rank() {
    let got = run(3, LONG, |pg| {
        if pg.rank() == 0 {
            std::thread::sleep(Duration::from_millis(100));
            pg.backend().abort("user code raised");
            None
        } else {
            pg.barrier().err()
        }
    });
    for e in got.into_iter().skip(1) {
        assert!(
            matches!(e, Some(Error::Aborted { by: 0, ref reason }) if reason.contains("user code raised"))
        );
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
    let got = run(2, LONG, |pg| {
        let pg = Arc::new(pg);
        let works: Vec<_> = (0..5)
            .map(|i| {
                let p = pg.clone();
                pg.submit(move || {
                    let mut v = vec![i as f64; 10];
                    p.comm()?.all_reduce(axonml_distributed::BufMut::new(&mut v), ReduceOp::Sum)?;
                    assert_eq!(v[0], 2.0 * i as f64);
                    Ok(())
                })
            })
            .collect();
        works.iter().all(|w| w.wait().is_ok())
    });
    assert!(got.into_iter().all(|ok| ok));
}
