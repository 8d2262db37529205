//! The protocol against a hand-played peer: one real member (an engine over the in-process world's
//! store) and one whose steps the test takes itself, at chosen moments.

use std::sync::atomic::Ordering::*;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{wire, AsEngine, Cause, Engine, Published, Store};
use crate::backend::Backend;
use crate::dtype::{BufMut, DType};
use crate::error::{Error, Result};
use crate::reduce::ReduceOp;
use crate::signature::{CollKind, Signature};
use crate::transport::thread::store::{Shared, ThreadStore};
use crate::transport::thread::ThreadBackend;

/// Past one-shot, and each of the two members owns half.
const COUNT: usize = 4096;

/// A world of two: member 0 a real engine, member 1 played by hand, which has published an all_reduce
/// of `theirs` (call 1) and arrived.
fn member1_arrived(theirs: &mut [f32]) -> (ThreadBackend, ThreadStore) {
    let shared = Arc::new(Shared::new(2, Duration::from_secs(20)));
    let s1 = ThreadStore::world(&shared, 1);
    let mine = ThreadBackend::wrap(Engine::new(ThreadStore::world(&shared, 0), crate::flight::next_world()));
    let sig = Signature::new(CollKind::AllReduce, 1, COUNT).dtype(DType::F32).op(ReduceOp::Sum);
    let at = s1.share(theirs.as_mut_ptr().cast(), COUNT * 4, &sig);
    s1.ctrl(1).pages[1].store(&Published { sig: wire::encode(&sig), send: at, recv: at });
    s1.ctrl(1).arrive.store(1, SeqCst);
    s1.notify();
    (mine, s1)
}

/// Member 0's all_reduce (SUM) of ones: its outcome and its buffer.
fn member0_reduces(mine: &ThreadBackend) -> (Result<()>, Vec<f32>) {
    let mut x = vec![1.0f32; COUNT];
    let r = mine.all_reduce(BufMut::new(&mut x[..]), ReduceOp::Sum);
    (r, x)
}

/// Wait (as member 1) until member 0 has done its share of call 1 and waits for ours.
fn member0_did_its_share(s1: &ThreadStore) {
    let t = Instant::now();
    while s1.ctrl(0).done.load(SeqCst) < 1 {
        assert!(t.elapsed() < Duration::from_secs(10), "member 0 never finished its share");
        std::thread::yield_now();
    }
}

/// Member 1 adds its input `theirs` into its half of member 0's buffer (member 0's page gives its
/// address), its share of call 1, and records that it moved it.
fn member1_does_its_half(s1: &ThreadStore, theirs: &[f32]) {
    let x0 = s1.ctrl(0).pages[1].load().recv as usize as *mut f32;
    for (i, v) in theirs.iter().enumerate().skip(COUNT / 2) {
        // SAFETY: member 0 published COUNT floats at this address and waits for our done.
        unsafe { *x0.add(i) += v };
    }
    s1.ctrl(1).moved.store(1, SeqCst);
}

/// A peer that saw every arrival and did its share, whose peer then failed its own arrival wait
/// without doing its share (the arrival it missed came a moment too late), must not report success:
/// its buffer lacks that peer's part of the result.
#[test]
fn a_member_whose_peer_failed_without_doing_its_share_fails_too() {
    let mut theirs = vec![2.0f32; COUNT];
    let (mine, s1) = member1_arrived(&mut theirs);
    std::thread::scope(|s| {
        let member0 = s.spawn(|| member0_reduces(&mine));
        // Member 0 did its share and waits for member 1's done; member 1 now fails as a member whose
        // arrival wait timed out would: it aborts the world and leaves without doing its share.
        member0_did_its_share(&s1);
        s1.abort("rank 1 timed out", Cause::Other);
        s1.ctrl(1).done.store(1, SeqCst);
        s1.notify();
        let (r, x) = member0.join().unwrap();
        assert!(matches!(r, Err(Error::Aborted { by: 1, .. })), "{r:?}");
        assert!(x[COUNT - 1] == 1.0, "member 1's half was never reduced");
    });
    assert!(theirs[..COUNT / 2].iter().all(|&v| v == 3.0), "member 0 did its half of member 1's buffer");
}

/// A member whose peers all did their share succeeds even when the world is aborted before it looks
/// (a peer that finished may fail its next call at once): the call is done everywhere, and its next
/// call reports the abort.
#[test]
fn a_call_every_member_finished_succeeds_though_the_world_was_aborted_meanwhile() {
    let mut theirs = vec![2.0f32; COUNT];
    let (mine, s1) = member1_arrived(&mut theirs);
    std::thread::scope(|s| {
        let member0 = s.spawn(|| member0_reduces(&mine));
        member0_did_its_share(&s1);
        member1_does_its_half(&s1, &theirs);
        s1.abort("rank 1's next call was refused", Cause::Other);
        s1.ctrl(1).done.store(1, SeqCst);
        s1.notify();
        let (r, x) = member0.join().unwrap();
        assert!(r.is_ok(), "{r:?}");
        assert!(x.iter().all(|&v| v == 3.0), "both halves reduced");
        assert!(matches!(mine.barrier(), Err(Error::Aborted { by: 1, .. })), "the next call reports it");
    });
}

/// A member whose peer left the world (its spawn function returned) while the peer's queued call still
/// runs must wait for that call to finish with its buffers: a thread that left is not a dead process.
#[test]
fn a_member_waits_for_a_peer_that_left_while_its_call_still_runs() {
    let mut theirs = vec![2.0f32; COUNT];
    let (mine, s1) = member1_arrived(&mut theirs);
    std::thread::scope(|s| {
        let member0 = s.spawn(|| member0_reduces(&mine));
        member0_did_its_share(&s1);
        // Member 1 leaves with its share still to do; member 0 must not return meanwhile.
        s1.leave();
        std::thread::sleep(Duration::from_millis(300));
        assert!(!member0.is_finished(), "member 0 returned while member 1 still owed it its half");
        member1_does_its_half(&s1, &theirs);
        s1.ctrl(1).done.store(1, SeqCst);
        s1.notify();
        let (r, x) = member0.join().unwrap();
        assert!(r.is_ok(), "{r:?}");
        assert!(x.iter().all(|&v| v == 3.0), "member 1's half is in member 0's buffer");
    });
}

/// A member records the core it ran on whenever it publishes progress, and a waiter reads where the
/// members it waits for are from those records: queued on its own core, on others, or not yet known.
#[test]
fn members_publish_their_core_and_waiters_read_where_peers_are() {
    use super::Placement;
    use crate::sync::wait::current_cpu;
    let mut theirs = vec![2.0f32; COUNT];
    let (mine, s1) = member1_arrived(&mut theirs);
    std::thread::scope(|s| {
        let member0 = s.spawn(|| mine.all_reduce(BufMut::new(&mut vec![1.0f32; COUNT][..]), ReduceOp::Sum));
        member0_did_its_share(&s1);
        let core = s1.ctrl(0).cpu.load(SeqCst);
        assert!(core >= 1 && rustix::thread::sched_getaffinity(None).unwrap().is_set(core as usize - 1));
        member1_does_its_half(&s1, &theirs);
        s1.ctrl(1).done.store(1, SeqCst);
        s1.notify();
        member0.join().unwrap().unwrap();
    });
    let shared = Arc::new(Shared::new(2, Duration::from_secs(20)));
    let engine = Engine::new(ThreadStore::world(&shared, 0), crate::flight::next_world());
    let peer = &engine.store.ctrl(1).cpu;
    let at = |cpu: u32| {
        peer.store(cpu, SeqCst);
        engine.placement(std::iter::once(1))
    };
    // The test thread may move between the two reads of its core; retry until one pair agrees.
    let here = (0..100).find_map(|_| {
        let c = current_cpu();
        matches!(at(c), Placement::Shared).then_some(c)
    });
    assert!(here.is_some(), "a peer recorded on this thread's core is never seen as sharing it");
    assert!(matches!(at(0), Placement::Unknown));
    assert!(matches!(at(u32::MAX), Placement::Apart));
    assert!(matches!(engine.placement(std::iter::empty()), Placement::Apart));
}
