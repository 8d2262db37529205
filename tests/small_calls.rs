//! What a small all_reduce costs beyond moving its bytes: in either world, a one-shot call whose
//! peers are there allocates nothing on the calling thread (no call name formatted, no list of pages
//! or copies), and every rank still gets the rank-order reference, bit for bit. Its own test binary:
//! the counting allocator below serves every test in it.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use axonml_distributed::config::INLINE;
use axonml_distributed::ReduceOp;

use common::{bits, input, reference, Shm, Threads, Worlds, LONG};

/// The system allocator, counting the allocations each thread makes.
struct Counting;

thread_local! {
    static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
}

// SAFETY: forwards to the system allocator; the count is a const-initialised thread-local `Cell`
// (no lazy registration, no allocation).
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.set(ALLOCATIONS.get() + 1);
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.set(ALLOCATIONS.get() + 1);
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Per rank of a world of 2: the fewest allocations any of 50 all_reduces (`op`) of `len` floats
/// made, and the last result. The fewest: a wait that outlasts its spin and yields (a loaded
/// machine) checks its peers' liveness, which may allocate; a cost on every call shows in every call.
fn fewest_allocations(w: &impl Worlds, len: usize, op: ReduceOp) -> Vec<(u64, Vec<f32>)> {
    w.run(2, LONG, move |pg| {
        let mut x = vec![];
        let fewest = (0..50)
            .map(|_| {
                x = input(pg.rank(), len);
                let before = ALLOCATIONS.get();
                pg.all_reduce(&mut x, op).unwrap();
                ALLOCATIONS.get() - before
            })
            .min();
        (fewest.unwrap_or(u64::MAX), x)
    })
}

#[test]
fn a_small_all_reduce_allocates_nothing_and_matches_the_reference() {
    // The one-shot sizes of each world: up to `config::INLINE` bytes in-process, 64 KiB through the
    // segment.
    let floats = |bytes: usize| bytes / 4;
    let threads = [(1, ReduceOp::Sum), (floats(INLINE), ReduceOp::Average)];
    let shm = [
        (1, ReduceOp::Sum),
        (1024, ReduceOp::Sum),
        (1024, ReduceOp::Average),
        (floats(64 << 10), ReduceOp::Max),
    ];
    for (world, cases) in [("threads", &threads[..]), ("shm", &shm[..])] {
        for &(len, op) in cases {
            let got = match world {
                "shm" => fewest_allocations(&Shm, len, op),
                _ => fewest_allocations(&Threads, len, op),
            };
            let want = bits(&reference(2, len, op));
            for (r, (fewest, x)) in got.iter().enumerate() {
                assert_eq!(*fewest, 0, "{world} len={len} {op}: every call of rank {r} allocated");
                assert_eq!(bits(x), want, "{world} len={len} {op}: rank {r}");
            }
        }
    }
}
