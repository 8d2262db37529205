//! The in-process world from Rust alone: all_reduce against a sequential reference at every size, op
//! and world size, argument checks, and queued work. (The protocol's checks shared with the shm world
//! are in `engine.rs`.)

mod common;

use std::sync::Arc;

use axonml_distributed::reduce::reduce_slices;
use axonml_distributed::signature::CollKind;
use axonml_distributed::work::Lane;
use axonml_distributed::{Backend, Collective, Error, ProcessGroup, ReduceOp, ThreadBackend};

use common::{float_ops, input, Threads, Worlds, LONG};

#[test]
fn all_reduce_matches_sequential_reduction_for_every_op_and_size() {
    for n in [1, 2, 3, 4] {
        for len in [0, 1, 7, 64, 1023, 3 * 4096 + 3, 100_000] {
            for op in float_ops() {
                let got = Threads.run(n, LONG, move |pg| {
                    let mut x = input(pg.rank(), len);
                    pg.all_reduce(&mut x, op).unwrap();
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
    let pg = ProcessGroup::new(Arc::new(ThreadBackend::single()));
    let mut x = [1i32; 4];
    assert!(matches!(pg.all_reduce(&mut x, ReduceOp::Average), Err(Error::UnsupportedDtype(_))));
    let b = ThreadBackend::single();
    assert!(ProcessGroup::with_ranks(Arc::new(b), &[0, 0], None).is_err());
    let b = ThreadBackend::single();
    assert!(matches!(b.split(&[3], None), Err(Error::InvalidArgument(_))));
    assert!(matches!(b.split(&[0], Some(std::time::Duration::ZERO)), Err(Error::InvalidArgument(_))));
    // A description without the buffers its collective needs is refused by its check, naming it.
    let b = ThreadBackend::single();
    match b.collective(Collective::of(CollKind::AllGather)) {
        Err(Error::InvalidArgument(m)) => {
            assert!(m.contains("all_gather: the call has no send buffer"), "{m}")
        }
        other => panic!("{other:?}"),
    }
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
fn a_panicking_queued_job_fails_its_work_and_aborts_the_world_without_killing_the_lane() {
    let mut world = ThreadBackend::create_world(2).into_iter().map(|b| ProcessGroup::new(Arc::new(b)));
    let (pg0, pg1) = (world.next().unwrap(), world.next().unwrap());
    let w = pg0.submit(Lane::Collectives, || panic!("boom")).unwrap();
    assert!(matches!(w.wait(), Err(Error::Internal(m)) if m.contains("boom")), "the Work reports the panic");
    let later = pg0.submit(Lane::Collectives, || Ok(())).unwrap();
    assert!(later.wait().is_ok(), "the lane's thread survived");
    assert!(matches!(pg1.barrier(), Err(Error::Aborted { by: 0, .. })), "the peer is told");
}

/// The `*_tensor` methods read their input and return the result, as the Python methods of the same
/// names do (and torch's functional collectives); the plain names work in place.
#[test]
fn tensor_methods_return_new_buffers_and_leave_their_input() {
    let len = 5;
    let got = Threads.run(3, LONG, move |pg| {
        let me = pg.rank();
        let t = input(me, len);
        let reduced = pg.all_reduce_tensor(&t, ReduceOp::Sum).unwrap();
        let from_root = pg.broadcast_tensor(&t, 2).unwrap();
        let untouched = t == input(me, len);
        let received = match me {
            0 => pg.send_tensor(&t, 1, 4).map(|()| vec![]).unwrap(),
            1 => pg.recv_tensor::<f32>(len, 0, 4).unwrap(),
            _ => vec![],
        };
        (reduced, from_root, untouched, received)
    });
    let mut sum = vec![0.0f32; len];
    let inputs: Vec<Vec<f32>> = (0..3).map(|r| input(r, len)).collect();
    let refs: Vec<&[f32]> = inputs.iter().map(|v| &v[..]).collect();
    reduce_slices(ReduceOp::Sum, &refs, &mut sum).unwrap();
    for (r, (reduced, from_root, untouched, received)) in got.into_iter().enumerate() {
        assert_eq!(reduced, sum, "rank {r}: all_reduce_tensor's result");
        assert_eq!(from_root, input(2, len), "rank {r}: broadcast_tensor's result");
        assert!(untouched, "rank {r}: the input of a *_tensor call is only read");
        assert_eq!(received, if r == 1 { input(0, len) } else { vec![] }, "rank {r}: recv_tensor");
    }
}
