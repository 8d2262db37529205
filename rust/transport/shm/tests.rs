//! Checks that need two ranks' views of one segment inside this process (each thread joins through rank 0's TCP store
//! and maps the segment on its own, as a process would): protections, and what a corrupt peer can
//! make a rank do.

use std::net::TcpListener;
use std::time::{Duration, Instant};

use super::layout::NOT_SHARED;
use super::shared::Shared;
use super::{join_over_tcp, p2p, ShmOptions};
use crate::dtype::{BufMut, DType};
use crate::error::Error;

/// Both ranks of a fresh 2-rank world.
fn pair(timeout: Duration) -> [Shared; 2] {
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let join = move |r: usize| {
        std::thread::spawn(move || {
            let mut o = ShmOptions::new(r, 2, "127.0.0.1", port);
            o.timeout = timeout;
            o.arena_bytes = 1 << 20;
            Shared::new(join_over_tcp(&o).unwrap(), r, timeout).unwrap()
        })
    };
    let (a, b) = (join(0), join(1));
    [a.join().unwrap(), b.join().unwrap()]
}

/// The permissions (e.g. "r--s") of the mapping holding `addr`, from /proc/self/maps.
fn perms(addr: *const u8) -> String {
    let a = addr as usize;
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    maps.lines()
        .find_map(|l| {
            let (range, rest) = l.split_once(' ')?;
            let (lo, hi) = range.split_once('-')?;
            let (lo, hi) = (usize::from_str_radix(lo, 16).ok()?, usize::from_str_radix(hi, 16).ok()?);
            (lo <= a && a < hi).then(|| rest[..4].to_string())
        })
        .unwrap_or_else(|| panic!("{a:#x} is not mapped"))
}

#[test]
fn each_rank_maps_what_only_its_peers_write_read_only() {
    let [r0, r1] = pair(Duration::from_secs(20));
    for (me, w) in [(0, &r0), (1, &r1)] {
        let peer = 1 - me;
        let at = |off: usize| w.map.base().wrapping_add(off).cast_const();
        let l = w.layout;
        // Its own staging block and the cells it sends through: writable; its peer's: read-only,
        // from the first byte to the last.
        for (range, want) in [
            (l.block(me), "rw-s"),
            (l.block(peer), "r--s"),
            (l.cells(me, peer), "rw-s"),
            (l.cells(peer, me), "r--s"),
            (l.block(2), "r--s"), // a subgroup block no group uses yet
        ] {
            assert_eq!(perms(at(range.start)), want, "rank {me} {range:?}");
            assert_eq!(perms(at(range.end - 1)), want, "rank {me} {range:?}");
        }
        // The control lines both sides of a channel write, the header and the arenas stay writable.
        for off in [0, l.comms, l.chan(peer, me), w.arena(peer).start] {
            assert_eq!(perms(at(off)), "rw-s", "rank {me} offset {off}");
        }
        // A subgroup member's block is writable while it is the member, read-only again after.
        w.own_block(3, true).unwrap();
        assert_eq!(perms(at(l.block(3).start)), "rw-s");
        w.own_block(3, false).unwrap();
        assert_eq!(perms(at(l.block(3).start)), "r--s");
    }
}

#[test]
fn peer_offsets_must_lie_in_its_arena_and_be_aligned_to_the_dtype() {
    let [r0, _r1] = pair(Duration::from_secs(20));
    let arena = r0.arena(1);
    assert!(r0.resolve(1, arena.start as u64 + 8, 64, 8).is_ok());
    let e = r0.resolve(1, arena.start as u64 + 2, 64, 4).unwrap_err();
    assert!(e.contains("not aligned to its 4-byte elements"), "{e}");
    let e = r0.resolve(1, arena.end as u64 - 4, 8, 4).unwrap_err();
    assert!(e.contains("outside its arena"), "{e}");
    assert!(r0.resolve(1, NOT_SHARED - 1, 8, 1).unwrap_err().contains("outside"));
    assert!(r0.resolve(0, arena.start as u64, 8, 1).unwrap_err().contains("outside"), "rank 0's arena");
}

#[test]
fn an_unexpected_message_larger_than_the_limit_fails_the_receive_without_allocating() {
    let [r0, r1] = pair(Duration::from_secs(20));
    // Rank 1 posts the header of a 1 TiB message with tag 9 (as a corrupt or hostile sender could).
    let (ch, cells) = r1.chan(1, 0);
    let header = [9u64, DType::U8 as u64, 1 << 40, 1];
    // SAFETY: rank 1 owns the cells of its channel to rank 0, and nothing else uses them.
    unsafe {
        std::ptr::copy_nonoverlapping(header.as_ptr().cast::<u8>(), cells.add(r1.layout.params.cell), 32)
    };
    ch.filled.store(1, std::sync::atomic::Ordering::Release);
    let mut x = [0u8; 4];
    let t = Instant::now();
    let e = p2p::recv(&r0, BufMut::new(&mut x[..]), 1, 7, "recv", r0.timeout).unwrap_err();
    let said = |m: &str| m.contains("1099511627776 bytes with tag 9") && m.contains("1024 MiB");
    assert!(matches!(&e, Error::InvalidArgument(m) if said(m)), "{e}");
    assert!(t.elapsed() < Duration::from_secs(10), "failed at once, not at the timeout");
    assert_eq!(r0.early_bytes.load(std::sync::atomic::Ordering::Acquire), 0);
}

#[test]
fn a_peer_publishing_a_misaligned_segment_offset_aborts_the_world_with_a_clear_error() {
    use super::ShmBackend;
    use crate::backend::Backend;
    use crate::engine::{wire, Published};
    use crate::reduce::ReduceOp;
    use crate::signature::{CollKind, Signature};

    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let opts = move |r: usize| {
        let mut o = ShmOptions::new(r, 2, "127.0.0.1", port);
        o.timeout = Duration::from_secs(20);
        o.arena_bytes = 1 << 20;
        o
    };
    // Past the one-shot size, so that segment buffers take the zero-copy path.
    const COUNT: usize = 100_000;
    let honest = std::thread::spawn(move || {
        let b = ShmBackend::connect(opts(0)).unwrap();
        let m = b.alloc(COUNT * 4).unwrap().unwrap();
        // SAFETY: a fresh allocation of COUNT floats, used by this call only.
        let buf = unsafe { BufMut::from_raw(DType::F32, m.as_ptr(), COUNT) };
        b.all_reduce(buf, ReduceOp::Sum).unwrap_err()
    });
    // Rank 1 arrives at the same call, publishing a buffer 2 bytes into its arena.
    let o = opts(1);
    let w = Shared::new(join_over_tcp(&o).unwrap(), 1, o.timeout).unwrap();
    let sig = Signature::new(CollKind::AllReduce, 1, COUNT).dtype(DType::F32).op(ReduceOp::Sum);
    let off = w.arena(1).start as u64 + 2;
    let ctrl = w.ctrl(0, 1);
    // Rank 1's page 1 (call 1), read by rank 0 only after `arrive = 1`.
    ctrl.pages[1].store(&Published { sig: wire::encode(&sig), send: off, recv: off });
    ctrl.arrive.store(1, std::sync::atomic::Ordering::SeqCst);
    w.comm_head(0).event.notify(true);
    let e = honest.join().unwrap();
    assert!(e.to_string().contains("not aligned to its 4-byte elements"), "{e}");
    assert_ne!(w.header().abort_state.load(std::sync::atomic::Ordering::Acquire), 0, "the world is aborted");
}

#[test]
fn every_rank_of_a_world_in_one_process_may_copy_from_its_peers() {
    use crate::algo::route::Policy;
    let [r0, r1] = pair(Duration::from_secs(20));
    assert!(r0.cma() != Policy::Never && r1.cma() != Policy::Never);
}

/// Rank 0 all-reduces `count` float32 of its own, while rank 1 (played by hand in this process)
/// arrives at the same call publishing `published` for both its buffers, and touches nothing of rank
/// 0's; rank 0 gives up after `timeout`. Returns rank 0's error, how long it took to fail, and rank
/// 1's view of the world.
fn all_reduce_beside(count: usize, published: u64, timeout: Duration) -> (Error, Duration, Shared) {
    use super::ShmBackend;
    use crate::backend::Backend;
    use crate::engine::{wire, Published};
    use crate::reduce::ReduceOp;
    use crate::signature::{CollKind, Signature};

    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let opts = move |r: usize| {
        let mut o = ShmOptions::new(r, 2, "127.0.0.1", port);
        o.timeout = timeout;
        o.arena_bytes = 1 << 20;
        o
    };
    let honest = std::thread::spawn(move || {
        let b = ShmBackend::connect(opts(0)).unwrap();
        let mut data = vec![1.0f32; count];
        let t = Instant::now();
        let e = b.all_reduce(BufMut::new(&mut data[..]), ReduceOp::Sum).unwrap_err();
        (e, t.elapsed())
    });
    let o = opts(1);
    let w = Shared::new(join_over_tcp(&o).unwrap(), 1, o.timeout).unwrap();
    let sig = Signature::new(CollKind::AllReduce, 1, count).dtype(DType::F32).op(ReduceOp::Sum);
    let ctrl = w.ctrl(0, 1);
    ctrl.pages[1].store(&Published { sig: wire::encode(&sig), send: published, recv: published });
    ctrl.arrive.store(1, std::sync::atomic::Ordering::SeqCst);
    // It touches nothing of rank 0's: done at once, so rank 0's drain ends.
    ctrl.done.store(1, std::sync::atomic::Ordering::SeqCst);
    w.comm_head(0).event.notify(true);
    let (e, took) = honest.join().unwrap();
    (e, took, w)
}

#[test]
fn a_peer_publishing_a_private_address_it_does_not_own_aborts_the_world_with_a_clear_error() {
    use super::store::PRIVATE;
    // Too large to time, so rank 0 asks it to cross; the page-aligned address maps nothing.
    let (e, took, w) =
        all_reduce_beside(crate::config::ROUTE_TIMED_BELOW / 4, PRIVATE | 0x1000, Duration::from_secs(20));
    let m = e.to_string();
    assert!(m.contains("reading from rank 1's buffer") && m.contains("0x1000"), "{m}");
    assert!(took < Duration::from_secs(10), "failed at once, not at the timeout");
    assert_ne!(w.header().abort_state.load(std::sync::atomic::Ordering::Acquire), 0, "the world is aborted");
}

#[test]
fn a_timed_call_crosses_when_a_peer_asks() {
    use super::store::{CROSS, PRIVATE};
    // 256 KiB: rank 0 alone would stage it (the first call of its class, `algo::route_times`), and
    // only offers its address; rank 1 asks the call to cross (as a rank does whose crossing calls took
    // it less time), so rank 0 reads from the address rank 1 published.
    let (e, _, _) = all_reduce_beside(64 << 10, PRIVATE | CROSS | 0x1000, Duration::from_secs(20));
    let m = e.to_string();
    assert!(m.contains("reading from rank 1's buffer") && m.contains("0x1000"), "{m}");
}

#[test]
fn a_timed_call_stages_when_no_member_asks() {
    use super::store::PRIVATE;
    // Rank 1 only offers its address: the call stages, so rank 0 never reads it, and waits in vain
    // for rank 1's steps.
    let (e, _, _) = all_reduce_beside(64 << 10, PRIVATE | 0x1000, Duration::from_secs(2));
    assert!(matches!(e, Error::Timeout { .. }), "{e}");
}

/// Every counter of member `j`'s control block in `slot`.
fn counters(s: &Shared, slot: usize, j: usize) -> [&std::sync::atomic::AtomicU64; 6] {
    let c = s.ctrl(slot, j);
    [&*c.arrive, &*c.done, &*c.completed, &*c.moved, &*c.step, &*c.claim]
}

/// A slot bound again starts every counter of its members from zero, the `moved` words included: a
/// previous binding's count must not pass for a member's share of the new communicator's calls.
#[test]
fn a_slot_bound_again_starts_every_counter_from_zero() {
    use std::sync::atomic::Ordering::SeqCst;
    let [a, b] = pair(Duration::from_secs(10));
    let (slot, _) = a.claim(&[0, 1], "new_group").unwrap();
    assert_eq!(b.claim(&[0, 1], "new_group").unwrap().0, slot);
    for j in 0..2 {
        counters(&a, slot, j).iter().for_each(|w| w.store(7, SeqCst));
    }
    a.leave(slot);
    b.leave(slot);
    let (again, _) = a.claim(&[0, 1], "new_group").unwrap();
    assert_eq!(again, slot, "the freed slot is bound again");
    for j in 0..2 {
        assert!(counters(&a, slot, j).iter().all(|w| w.load(SeqCst) == 0), "member {j}");
    }
}
