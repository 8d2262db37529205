//! The shared-memory world from Rust, with threads standing in for processes: each thread joins over
//! TCP and maps the segment on its own (at its own address), exactly as a process would. all_reduce on
//! private and segment buffers, what only this world's point-to-point path does, and the subgroup
//! table. (The protocol's checks shared with the in-process world are in `engine.rs`; process deaths,
//! permissions and leaks are tested from Python, tests/test_shm_segment.py and tests/test_shm_faults.py.)

mod common;

use axonml_distributed::{BufMut, Error, ReduceOp};

use common::{bits, float_ops, in_segment, input, reference, Shm, Worlds, LONG};

#[test]
fn all_reduce_matches_the_rank_order_reference_on_private_and_segment_buffers() {
    for n in [1, 2, 3] {
        let lens = [0, 1, 7, 1023, 16 * 1024 + 1, 3 * 4096 + 3, 600_001];
        let got = Shm.run(n, LONG, move |pg| {
            let mut out = vec![];
            for len in lens {
                for op in float_ops() {
                    let mut x = input(pg.rank(), len);
                    pg.all_reduce(&mut x, op).unwrap();
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
                let r = pg.recv(&mut x, 0, 0).err();
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
            pg.recv(&mut d, 0, 11).unwrap();
            let mut large = vec![0i32; big.len()];
            pg.recv(&mut large, 0, 10).unwrap();
            d == [6] && large == big
        }
    });
    assert_eq!(got, [true, true]);
}

#[test]
fn a_subgroup_dropped_by_every_member_frees_its_slot_and_staging() {
    // 31 subgroup slots and a pool of 16 staging blocks: without freeing, the ninth group would fail.
    let sums = Shm.run(2, LONG, |pg| {
        let world = axonml_distributed::World::init(pg.backend().clone());
        (0..100)
            .map(|i| {
                let g = world.new_group(&[0, 1], None).unwrap();
                // Past the one-shot size, so the staged path uses the group's blocks.
                let mut x = vec![(pg.rank() + i) as f32; 70_000];
                g.all_reduce(&mut x, ReduceOp::Sum).unwrap();
                x[69_999]
            })
            .collect::<Vec<f32>>()
    });
    for got in &sums {
        assert_eq!(*got, (0..100).map(|i| (2 * i + 1) as f32).collect::<Vec<_>>());
    }
}
