//! The shared-memory world from Rust, with threads standing in for processes: each thread joins over
//! TCP and maps the segment on its own (at its own address), exactly as a process would. Process
//! deaths, permissions and leaks are tested from Python (tests/test_shm.py).

use std::net::TcpListener;
use std::sync::Arc;
use std::time::Duration;

use axonml_distributed::reduce::reduce_slices;
use axonml_distributed::transport::shm::{ShmBackend, ShmOptions};
use axonml_distributed::{Backend, Buf, BufMut, Error, ProcessGroup, ReduceOp, World};

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Run `f(pg)` on one thread per rank of a fresh shm world and return the results in rank order.
fn run<R: Send + 'static>(
    n: usize,
    timeout: Duration,
    f: impl Fn(ProcessGroup) -> R + Send + Sync + 'static,
) -> Vec<R> {
    let f = Arc::new(f);
    let port = free_port();
    let threads: Vec<_> = (0..n)
        .map(|r| {
            let f = f.clone();
            std::thread::spawn(move || {
                let mut o = ShmOptions::new(r, n, "127.0.0.1", port);
                o.timeout = timeout;
                o.arena_bytes = 8 << 20;
                let b = ShmBackend::connect(o).unwrap();
                f(ProcessGroup::new(Arc::new(b)))
            })
        })
        .collect();
    threads.into_iter().map(|t| t.join().unwrap()).collect()
}

const LONG: Duration = Duration::from_secs(30);

fn input(rank: usize, len: usize) -> Vec<f32> {
    (0..len).map(|i| ((rank * 7919 + i * 31) % 1013) as f32 * 0.37 - 100.0).collect()
}

fn reference(n: usize, len: usize, op: ReduceOp) -> Vec<f32> {
    let inputs: Vec<Vec<f32>> = (0..n).map(|r| input(r, len)).collect();
    let refs: Vec<&[f32]> = inputs.iter().map(|v| &v[..]).collect();
    let mut want = vec![0.0; len];
    reduce_slices(op, &refs, &mut want).unwrap();
    want
}

/// A segment array holding `data` (the zero-copy path).
fn in_segment(b: &dyn Backend, data: &[f32]) -> axonml_distributed::backend::SharedMem {
    let m = b.alloc(data.len() * 4).unwrap().expect("arena space");
    // SAFETY: a fresh allocation of data.len() floats.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), m.as_ptr().cast(), data.len()) };
    m
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn all_reduce_matches_the_rank_order_reference_on_private_and_segment_buffers() {
    for n in [1, 2, 3] {
        let lens = [0, 1, 7, 1023, 16 * 1024 + 1, 3 * 4096 + 3, 600_001];
        let got = run(n, LONG, move |pg| {
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
fn rooted_and_gathering_collectives_deliver_the_right_parts() {
    let n = 3;
    for len in [1, 5000, 300_007] {
        let got = run(n, LONG, move |pg| {
            let me = pg.rank();
            let mut b = input(me, len);
            pg.broadcast_tensor(&mut b, 1).unwrap();
            let gathered = pg.all_gather_tensor(&input(me, len)).unwrap();
            let scattered = pg.reduce_scatter_tensor(&input(me, 3 * len), ReduceOp::Max).unwrap();
            let mut red = input(me, len);
            pg.reduce(&mut red, 2, ReduceOp::Sum).unwrap();
            let send = input(me, len);
            let mut g = vec![0.0f32; if me == 0 { n * len } else { 0 }];
            let recv = (me == 0).then(|| BufMut::new(&mut g[..]));
            pg.backend().gather(Buf::new(&send), recv, 0).unwrap();
            let all = input(7, n * len);
            let mut s = vec![0.0f32; len];
            let sent = (me == 2).then(|| Buf::new(&all[..]));
            pg.backend().scatter(sent, BufMut::new(&mut s), 2).unwrap();
            (b, gathered, scattered, red, g, s)
        });
        for (r, (b, gathered, scattered, red, g, s)) in got.into_iter().enumerate() {
            assert_eq!(b, input(1, len));
            let cat: Vec<f32> = (0..n).flat_map(|j| input(j, len)).collect();
            assert_eq!(gathered, cat);
            let full: Vec<Vec<f32>> = (0..n).map(|j| input(j, 3 * len)).collect();
            let want: Vec<f32> = (r * len..(r + 1) * len)
                .map(|i| full.iter().map(|v| v[i]).fold(f32::MIN, f32::max))
                .collect();
            assert_eq!(scattered, want);
            if r == 2 {
                assert_eq!(bits(&red), bits(&reference(n, len, ReduceOp::Sum)));
            } else {
                assert_eq!(red, input(r, len), "non-root buffers stay unchanged");
            }
            if r == 0 {
                assert_eq!(g, cat);
            }
            assert_eq!(s, input(7, n * len)[r * len..(r + 1) * len].to_vec());
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
        let mut x = vec![pg.rank() as i64 + 1; 90_000];
        mine.all_reduce_tensor(&mut x, ReduceOp::Sum).unwrap();
        let again = world.new_group(&[0, 2]).unwrap();
        let mut y = vec![1i32; 10];
        if pg.rank() % 2 == 0 {
            again.all_reduce_tensor(&mut y, ReduceOp::Sum).unwrap();
        }
        pg.barrier().unwrap();
        (x[0], x[89_999], y[0])
    });
    assert_eq!((got[0].0, got[0].1, got[0].2), (4, 4, 2));
    assert_eq!((got[1].0, got[1].2), (6, 1));
}

#[test]
fn send_recv_match_by_source_and_tag_in_order() {
    let got = run(2, LONG, |pg| {
        if pg.rank() == 0 {
            pg.send_tensor(&[1i32, 2], 1, 7).unwrap();
            pg.send_tensor(&[3i32, 4], 1, 7).unwrap();
            pg.send_tensor(&[9i32, 9], 1, 8).unwrap();
            let big: Vec<i32> = (0..100_003).collect();
            pg.send_tensor(&big, 1, 1).unwrap();
            let mut back = vec![0i32; 5];
            pg.recv_tensor(&mut back, 1, 2).unwrap();
            back
        } else {
            let mut a = [0i32; 2];
            let mut b = [0i32; 2];
            let mut c = [0i32; 2];
            pg.recv_tensor(&mut a, 0, 7).unwrap();
            pg.recv_tensor(&mut b, 0, 7).unwrap();
            pg.recv_tensor(&mut c, 0, 8).unwrap();
            let mut big = vec![0i32; 100_003];
            pg.recv_tensor(&mut big, 0, 1).unwrap();
            assert!(big.iter().enumerate().all(|(i, &v)| v == i as i32));
            pg.send_tensor(&[5i32; 5], 0, 2).unwrap();
            [a, b, c].concat()
        }
    });
    assert_eq!(got[1], vec![1, 2, 3, 4, 9, 9]);
    assert_eq!(got[0], vec![5; 5]);
}

#[test]
fn mismatched_calls_fail_on_every_rank_before_touching_buffers() {
    let got = run(3, LONG, |pg| {
        let mut x = vec![pg.rank() as f32; 100_000];
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
    let got = run(3, Duration::from_millis(400), |pg| {
        if pg.rank() == 1 {
            std::thread::sleep(Duration::from_millis(1200));
        }
        pg.barrier().err()
    });
    let named =
        got.iter().flatten().any(|e| matches!(e, Error::Timeout { missing, .. } if missing == &vec![1]));
    assert!(named, "{got:?}");
    assert!(matches!(got[1], Some(Error::Aborted { .. })), "{:?}", got[1]);
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
            matches!(e, Some(Error::Aborted { by: 0, ref reason }) if reason.contains("user code raised")),
            "{e:?}"
        );
    }
}

#[test]
fn a_message_of_the_wrong_length_fails_both_sides() {
    let got = run(2, LONG, |pg| {
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
