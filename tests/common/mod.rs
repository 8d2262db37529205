//! What the Rust integration tests share: how to run a world of ranks on threads (either world), the
//! inputs and their sequential reference, and the checks of the meeting protocol that every world
//! must pass (run for both worlds by `tests/engine.rs`).
#![allow(dead_code)] // each test crate uses its own subset

use std::net::TcpListener;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axonml_distributed::backend::SharedMem;
use axonml_distributed::reduce::reduce_slices;
use axonml_distributed::transport::shm::{ShmBackend, ShmOptions};
use axonml_distributed::{Backend, Buf, BufMut, DType, Error, ProcessGroup, ReduceOp, ThreadBackend, World};

pub const LONG: Duration = Duration::from_secs(30);

/// A kind of world whose ranks can be played by threads of this process.
pub trait Worlds {
    /// The backend of `rank` in a fresh world of `n` (called on that rank's thread).
    fn connect(&self, n: usize, timeout: Duration) -> Arc<dyn Fn(usize) -> Arc<dyn Backend> + Send + Sync>;

    /// A buffer of `len` floats for collectives of `b`: the world's fastest kind (segment memory where
    /// the world has it).
    fn buffer(&self, b: &dyn Backend, len: usize) -> Buffer;

    /// Run `f(pg)` on one thread per rank of a fresh world; results in rank order.
    fn run<R: Send + 'static>(
        &self,
        n: usize,
        timeout: Duration,
        f: impl Fn(ProcessGroup) -> R + Send + Sync + 'static,
    ) -> Vec<R> {
        let (f, connect) = (Arc::new(f), self.connect(n, timeout));
        let threads: Vec<_> = (0..n)
            .map(|r| {
                let (f, connect) = (f.clone(), connect.clone());
                std::thread::spawn(move || f(ProcessGroup::new(connect(r))))
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    }
}

/// The in-process world.
pub struct Threads;

impl Worlds for Threads {
    fn connect(&self, n: usize, timeout: Duration) -> Arc<dyn Fn(usize) -> Arc<dyn Backend> + Send + Sync> {
        let pool: Mutex<Vec<Option<ThreadBackend>>> =
            Mutex::new(ThreadBackend::create_world_with_timeout(n, timeout).into_iter().map(Some).collect());
        Arc::new(move |r| Arc::new(pool.lock().unwrap()[r].take().unwrap()))
    }

    fn buffer(&self, _: &dyn Backend, len: usize) -> Buffer {
        Buffer::Heap(vec![0.0; len])
    }
}

/// The shared-memory world, each thread joining over TCP and mapping the segment on its own, as a
/// process would.
pub struct Shm;

impl Worlds for Shm {
    fn connect(&self, n: usize, timeout: Duration) -> Arc<dyn Fn(usize) -> Arc<dyn Backend> + Send + Sync> {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        Arc::new(move |r| {
            let mut o = ShmOptions::new(r, n, "127.0.0.1", port);
            o.timeout = timeout;
            o.arena_bytes = 8 << 20;
            Arc::new(ShmBackend::connect(o).unwrap())
        })
    }

    fn buffer(&self, b: &dyn Backend, len: usize) -> Buffer {
        Buffer::Segment(in_segment(b, &vec![0.0; len]), len)
    }
}

/// A segment array holding `data` (the zero-copy path of the shm world).
pub fn in_segment(b: &dyn Backend, data: &[f32]) -> SharedMem {
    let m = b.alloc(data.len() * 4).unwrap().expect("arena space");
    // SAFETY: a fresh allocation of data.len() floats.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), m.as_ptr().cast(), data.len()) };
    m
}

/// Floats in ordinary memory or in a segment.
pub enum Buffer {
    Heap(Vec<f32>),
    Segment(SharedMem, usize),
}

impl Buffer {
    pub fn floats(&mut self) -> &mut [f32] {
        match self {
            Buffer::Heap(v) => v,
            // SAFETY: the allocation holds `len` floats and only this buffer uses it.
            Buffer::Segment(m, len) => unsafe { std::slice::from_raw_parts_mut(m.as_ptr().cast(), *len) },
        }
    }

    pub fn buf(&mut self) -> BufMut<'_> {
        let x = self.floats();
        // SAFETY: the floats of this buffer, borrowed for the call.
        unsafe { BufMut::from_raw(DType::F32, x.as_mut_ptr().cast(), x.len()) }
    }
}

/// Rank `rank`'s input.
/// The operators that reduce float32 (every one but the bitwise ones).
pub fn float_ops() -> impl Iterator<Item = ReduceOp> {
    ReduceOp::ALL.into_iter().filter(|op| op.check(DType::F32).is_ok())
}

pub fn input(rank: usize, len: usize) -> Vec<f32> {
    (0..len).map(|i| ((rank * 7919 + i * 31) % 1013) as f32 * 0.37 - 100.0).collect()
}

/// The inputs of `n` ranks reduced sequentially, in rank order.
pub fn reference(n: usize, len: usize, op: ReduceOp) -> Vec<f32> {
    let inputs: Vec<Vec<f32>> = (0..n).map(|r| input(r, len)).collect();
    let refs: Vec<&[f32]> = inputs.iter().map(|v| &v[..]).collect();
    let mut want = vec![0.0; len];
    reduce_slices(op, &refs, &mut want).unwrap();
    want
}

/// Bit patterns, for exact comparisons.
pub fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

pub fn rooted_and_gathering_collectives_deliver_the_right_parts(w: &impl Worlds, lens: &[usize]) {
    let n = 3;
    for &len in lens {
        let got = w.run(n, LONG, move |pg| {
            let me = pg.rank();
            let mut b = input(me, len);
            pg.broadcast(&mut b, 1).unwrap();
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

pub fn subgroups_are_independent_and_concurrent(w: &impl Worlds) {
    let got = w.run(4, LONG, |pg| {
        let world = World::init(pg.backend().clone());
        let evens = world.new_group(&[0, 2], None).unwrap();
        let odds = world.new_group(&[3, 1], None).unwrap();
        let mine = if pg.rank() % 2 == 0 { &evens } else { &odds };
        let mut x = vec![pg.rank() as i64 + 1; 90_000];
        mine.all_reduce(&mut x, ReduceOp::Sum).unwrap();
        let again = world.new_group(&[0, 2], None).unwrap();
        let mut y = vec![1i32; 10];
        if pg.rank() % 2 == 0 {
            again.all_reduce(&mut y, ReduceOp::Sum).unwrap();
        }
        // A non-member's call fails and aborts the world, so only try it once everyone is done.
        pg.barrier().unwrap();
        let other = if pg.rank() % 2 == 0 { &odds } else { &evens };
        let err = other.barrier().unwrap_err();
        (x[0], x[89_999], y[0], mine.ranks().to_vec(), err)
    });
    assert_eq!((got[0].0, got[0].1, got[0].2), (4, 4, 2));
    assert_eq!((got[1].0, got[1].2), (6, 1));
    assert_eq!(got[1].3, vec![1, 3]);
    assert!(matches!(got[0].4, Error::InvalidArgument(_) | Error::Aborted { .. }));
}

pub fn send_recv_match_by_source_and_tag_in_order(w: &impl Worlds) {
    let got = w.run(2, LONG, |pg| {
        if pg.rank() == 0 {
            pg.send_tensor(&[1i32, 2], 1, 7).unwrap();
            pg.send_tensor(&[3i32, 4], 1, 7).unwrap();
            pg.send_tensor(&[9i32, 9], 1, 8).unwrap();
            let big: Vec<i32> = (0..100_003).collect();
            pg.send_tensor(&big, 1, 1).unwrap();
            let mut back = vec![0i32; 5];
            pg.recv(&mut back, 1, 2).unwrap();
            back
        } else {
            let (mut a, mut b, mut c) = ([0i32; 2], [0i32; 2], [0i32; 2]);
            pg.recv(&mut a, 0, 7).unwrap();
            pg.recv(&mut b, 0, 7).unwrap();
            pg.recv(&mut c, 0, 8).unwrap();
            let mut big = vec![0i32; 100_003];
            pg.recv(&mut big, 0, 1).unwrap();
            assert!(big.iter().enumerate().all(|(i, &v)| v == i as i32));
            pg.send_tensor(&[5i32; 5], 0, 2).unwrap();
            [a, b, c].concat()
        }
    });
    assert_eq!(got[1], vec![1, 2, 3, 4, 9, 9]);
    assert_eq!(got[0], vec![5; 5]);
}

/// The exchange pattern: both ranks send first, then receive. Messages up to 64 KiB are eager, so it
/// cannot deadlock.
pub fn both_ranks_may_send_small_messages_before_receiving(w: &impl Worlds) {
    let got = w.run(2, Duration::from_secs(5), |pg| {
        let other = 1 - pg.rank();
        let mut out = vec![];
        for len in [0usize, 4, 16 * 1024] {
            pg.send_tensor(&vec![pg.rank() as i32 + 1; len], other, 3).unwrap();
            let mut got = vec![0i32; len];
            pg.recv(&mut got, other, 3).unwrap();
            out.push(got);
        }
        out
    });
    for (r, results) in got.iter().enumerate() {
        for v in results {
            assert!(v.iter().all(|&x| x == 2 - r as i32), "rank {r}");
        }
    }
}

/// A recv takes the first message of its (source, tag), even behind messages of other tags;
/// messages of one tag arrive in send order.
pub fn receives_match_tags_out_of_order_in_send_order_per_tag(w: &impl Worlds) {
    let big: Vec<i32> = (0..300_007).collect();
    let got = w.run(2, Duration::from_secs(10), move |pg| {
        if pg.rank() == 0 {
            pg.send_tensor(&[1i32, 2], 1, 7).unwrap();
            pg.send_tensor(&[3i32], 1, 8).unwrap();
            pg.send_tensor(&[4i32, 5], 1, 7).unwrap();
            pg.send_tensor(&big, 1, 10).unwrap();
            vec![]
        } else {
            let (mut a, mut b, mut c) = ([0i32; 1], [0i32; 2], [0i32; 2]);
            pg.recv(&mut a, 0, 8).unwrap();
            let mut large = vec![0i32; big.len()];
            pg.recv(&mut large, 0, 10).unwrap();
            assert!(large == big, "the large message arrived intact");
            pg.recv(&mut b, 0, 7).unwrap();
            pg.recv(&mut c, 0, 7).unwrap();
            [&a[..], &b, &c].concat()
        }
    });
    assert_eq!(got[1], vec![3, 1, 2, 4, 5]);
}

pub fn mismatched_calls_fail_on_every_rank_before_touching_buffers(w: &impl Worlds, len: usize) {
    let got = w.run(3, LONG, move |pg| {
        let mut x = vec![pg.rank() as f32; len];
        let op = if pg.rank() == 2 { ReduceOp::Max } else { ReduceOp::Sum };
        (pg.all_reduce(&mut x, op), x)
    });
    for (r, (res, x)) in got.into_iter().enumerate() {
        match res {
            Err(Error::Mismatch { details, .. }) => assert!(details.contains("rank 2"), "{details}"),
            other => panic!("rank {r}: expected a mismatch, got {other:?}"),
        }
        assert!(x.iter().all(|&v| v == r as f32), "buffers untouched");
    }
}

pub fn a_rank_that_never_arrives_times_out_naming_it(w: &impl Worlds) {
    let got = w.run(3, Duration::from_millis(400), |pg| {
        if pg.rank() == 1 {
            std::thread::sleep(Duration::from_millis(1200));
        }
        pg.barrier().err()
    });
    let named =
        got.iter().flatten().any(|e| matches!(e, Error::Timeout { missing, .. } if missing == &vec![1]));
    assert!(named, "{got:?}");
    assert!(matches!(got[1], Some(Error::Aborted { .. })), "the late rank fails at once: {:?}", got[1]);
}

pub fn a_monitored_barrier_waits_its_own_timeout_and_names_every_missing_rank(w: &impl Worlds) {
    let within = Duration::from_millis(300);
    let got = w.run(4, LONG, move |pg| {
        let comm = pg.comm().unwrap().clone();
        if pg.rank() % 2 == 1 {
            std::thread::sleep(Duration::from_millis(1500));
            return comm.barrier().err();
        }
        comm.monitored_barrier(within).err()
    });
    for r in [0, 2] {
        // Both report the call's own timeout, also the one that learned of it from the other's abort.
        let ok = matches!(&got[r], Some(Error::Timeout { missing, waited, .. }) if missing == &vec![1, 3] && *waited == within);
        assert!(ok, "rank {r}: {:?}", got[r]);
    }
    for r in [1, 3] {
        assert!(matches!(got[r], Some(Error::Aborted { .. })), "the late rank fails at once: {:?}", got[r]);
    }
}

pub fn a_subgroup_waits_its_own_timeout_not_the_worlds(w: &impl Worlds) {
    let within = Duration::from_millis(300);
    let got = w.run(3, LONG, move |pg| {
        let world = World::init(pg.backend().clone());
        let sub = world.new_group(&[0, 1], Some(within)).unwrap();
        assert_eq!((pg.timeout(), sub.timeout()), (LONG, within));
        match pg.rank() {
            0 => sub.barrier().err(),
            // Alive but late (one that left would be reported at once), then told of the abort.
            1 => {
                std::thread::sleep(Duration::from_millis(1500));
                sub.barrier().err()
            }
            _ => None,
        }
    });
    let ok = matches!(&got[0], Some(Error::Timeout { missing, waited, .. }) if missing == &vec![1] && *waited == within);
    assert!(ok, "rank 0 gives up after the group's timeout: {:?}", got[0]);
    assert!(matches!(got[1], Some(Error::Aborted { .. })), "the late rank fails at once: {:?}", got[1]);
}

pub fn abort_wakes_every_waiter_with_the_aborting_rank(w: &impl Worlds) {
    let got = w.run(3, LONG, |pg| {
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
            matches!(e, Some(Error::Aborted { by: 0, ref reason, .. }) if reason.contains("user code raised")),
            "{e:?}"
        );
    }
}

/// A member leaving a collective on an abort must not leave while a peer may still write into its
/// buffer: ranks 0 and 1 loop an all_reduce on a subgroup while rank 2 aborts the world at a varying
/// moment (`abort_after(trial)`); once a call fails, nothing may write the failing rank's buffer.
pub fn no_peer_writes_into_a_buffer_after_its_collective_returned(
    w: &(impl Worlds + Sync),
    trials: u64,
    len: usize,
    abort_after: fn(u64) -> Duration,
) {
    for trial in 0..trials {
        let connect = w.connect(3, LONG);
        let go = Arc::new(std::sync::Barrier::new(3));
        let written: Vec<usize> = std::thread::scope(|s| {
            let threads: Vec<_> = (0..3)
                .map(|r| {
                    let (connect, go) = (connect.clone(), go.clone());
                    s.spawn(move || {
                        let b = connect(r);
                        if r == 2 {
                            go.wait();
                            std::thread::sleep(abort_after(trial));
                            b.abort("a rank outside the subgroup failed");
                            return 0;
                        }
                        let sub = b.split(&[0, 1], None).unwrap();
                        let mut x = w.buffer(&*b, len);
                        go.wait();
                        loop {
                            x.floats().fill(1.0);
                            if sub.all_reduce(x.buf(), ReduceOp::Sum).is_err() {
                                x.floats().fill(-7.0);
                                std::thread::sleep(Duration::from_millis(100));
                                return x.floats().iter().filter(|&&v| v != -7.0).count();
                            }
                        }
                    })
                })
                .collect();
            threads.into_iter().map(|t| t.join().unwrap()).collect()
        });
        assert_eq!(written, [0, 0, 0], "trial {trial}: elements written after the call returned");
    }
}

/// A group over every rank is a group of its own: calls on it never match calls on the world.
pub fn a_group_over_every_rank_does_not_share_the_world_sequence(w: &impl Worlds) {
    let got = w.run(2, Duration::from_millis(300), |pg| {
        let all = ProcessGroup::with_ranks(pg.backend().clone(), &[0, 1], None).unwrap();
        let (mut x, mut y) = (vec![1.0f32; 4], vec![10.0f32; 4]);
        if pg.rank() == 0 {
            (pg.all_reduce(&mut x, ReduceOp::Sum).is_ok(), all.all_reduce(&mut y, ReduceOp::Sum).is_ok())
        } else {
            (all.all_reduce(&mut y, ReduceOp::Sum).is_ok(), pg.all_reduce(&mut x, ReduceOp::Sum).is_ok())
        }
    });
    assert_eq!(got, vec![(false, false), (false, false)], "crossed calls on two groups must fail, not match");
}

/// all_to_all_single with uneven splits (member j sends (j + i) * unit elements to member i: member 0
/// sends itself none), all_gather_v and reduce_scatter_v (member i's piece (i + 1) * unit long),
/// against slices of every member's input and the sequential reduction.
pub fn pairwise_collectives_deliver_the_right_pieces(w: &impl Worlds, unit: usize) {
    let n = 3;
    let split = move |j: usize, i: usize| (j + i) * unit;
    let counts: Vec<usize> = (0..n).map(|i| (i + 1) * unit).collect();
    let total: usize = counts.iter().sum();
    let c = counts.clone();
    let got = w.run(n, LONG, move |pg| {
        let (me, b) = (pg.rank(), pg.backend());
        let ins: Vec<usize> = (0..n).map(|i| split(me, i)).collect();
        let outs: Vec<usize> = (0..n).map(|j| split(j, me)).collect();
        let send = input(me, ins.iter().sum());
        let mut a2a = vec![0.0f32; outs.iter().sum()];
        b.all_to_all_single(Buf::new(&send), BufMut::new(&mut a2a), &ins, &outs).unwrap();
        let mut agv = vec![0.0f32; total];
        b.all_gather_v(Buf::new(&input(me, c[me])), BufMut::new(&mut agv), &c).unwrap();
        let mut rsv = vec![0.0f32; c[me]];
        b.reduce_scatter_v(Buf::new(&input(me, total)), BufMut::new(&mut rsv), &c, ReduceOp::Sum).unwrap();
        (a2a, agv, rsv)
    });
    let at = |i: usize| counts[..i].iter().sum::<usize>();
    for (r, (a2a, agv, rsv)) in got.into_iter().enumerate() {
        let want: Vec<f32> = (0..n)
            .flat_map(|j| {
                let start: usize = (0..r).map(|i| split(j, i)).sum();
                input(j, (0..n).map(|i| split(j, i)).sum())[start..start + split(j, r)].to_vec()
            })
            .collect();
        assert_eq!(bits(&a2a), bits(&want), "all_to_all_single on rank {r}");
        let cat: Vec<f32> = (0..n).flat_map(|j| input(j, counts[j])).collect();
        assert_eq!(bits(&agv), bits(&cat), "all_gather_v on rank {r}");
        let full = reference(n, total, ReduceOp::Sum);
        assert_eq!(bits(&rsv), bits(&full[at(r)..at(r) + counts[r]]), "reduce_scatter_v on rank {r}");
    }
}
