//! Collectives on private buffers of processes, copied straight between them with Linux's cross-memory
//! attach (`process_vm_readv` / `process_vm_writev`, as MPICH's and Open MPI's CMA paths do): each byte
//! moves once, by the kernel, from the owner's memory to the reader's, with no staging copy and no
//! pipeline sync. Members touch disjoint memory, so the engine's done-sync (its drain) is the only wait.
//!
//! Members share the work in tiles they claim one at a time ([`Claims`]), so a member whose core is
//! taken by another process does less of it instead of holding every member back:
//! * broadcast: the root writes a tile it claims into every other member's buffer; any other member
//!   reads it from the root, then writes it on to the rest (at 2 ranks each copies about half);
//! * all_gather: a member copies each tile of its own part into its own slot and writes it to its
//!   peers, then helps with parts whose owners are behind; gather: each member writes its part into
//!   the root's buffer; scatter: each member reads its part from the root;
//! * all_reduce, reduce, reduce_scatter: for each tile it claims, a member reads the tile of every
//!   peer's input into local scratch, reduces in rank order (own input read in place), then writes the
//!   result into every peer's output (all_reduce), the root's (reduce) or the block owner's
//!   (reduce_scatter, where members take their own blocks first). Tiles keep the scratch in cache
//!   between the read and the reduction. Whoever computes a tile, the order of the reduction is the
//!   same, so results are bitwise identical.
//!
//! Addresses come from peers: a bad one makes the kernel fail the copy (EFAULT, or a short count),
//! which is an error here, never a crash; the lengths are this member's own (the agreed signature).

use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering::*};

use super::layout::Plan;
use super::stream;
use crate::call::Call;
use crate::config::{CMA_TILE, STEAL_SPARE};
use crate::error::{Error, Result};
use crate::reduce::{reduce_raw, ReduceOp};
use crate::signature::CollKind;

/// Where a member's buffer is: in this process (`pid` None), or at `addr` in process `pid`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Loc {
    pub pid: Option<i32>,
    pub addr: usize,
    /// The member's global rank, for errors.
    pub rank: usize,
}

impl Loc {
    fn at(self, off: usize) -> Loc {
        Loc { addr: self.addr.wrapping_add(off), ..self }
    }
}

/// A member's send and receive buffers.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Member {
    pub send: Loc,
    pub recv: Loc,
}

/// Whether this route runs `kind` (the others, reduce_scatter_v, go through staging).
pub(crate) fn handles(kind: CollKind) -> bool {
    !matches!(kind, CollKind::ReduceScatterV)
}

#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct Line([u8; 64]);

thread_local! {
    /// Scratch tiles of the reductions, kept across calls (a fresh allocation per call would fault
    /// its pages in every time).
    static SCRATCH: RefCell<Vec<Line>> = const { RefCell::new(Vec::new()) };
}

/// One cross-process copy of `len` bytes; `read` from `remote` into `local`, else the other way.
fn transfer(remote: Loc, local: *mut u8, len: usize, read: bool, op: &str) -> Result<()> {
    let Some(pid) = remote.pid else {
        let (from, to) = if read {
            (remote.addr as *const u8, local)
        } else {
            (local.cast_const(), remote.addr as *mut u8)
        };
        // SAFETY: the caller guarantees both ranges; `copy` tolerates all_gather's in-place overlap.
        unsafe { stream::copy(from, to, len, stream::worth(len)) };
        return Ok(());
    };
    let mut done = 0;
    while done < len {
        let l = libc::iovec { iov_base: local.wrapping_add(done).cast(), iov_len: len - done };
        let r = libc::iovec {
            iov_base: remote.addr.wrapping_add(done) as *mut libc::c_void,
            iov_len: len - done,
        };
        // SAFETY: `l` is this process's memory, valid for `len` bytes (caller); the kernel checks `r`
        // against the peer's address space and fails the call instead of faulting.
        let got = unsafe {
            if read {
                libc::process_vm_readv(pid, &l, 1, &r, 1, 0)
            } else {
                libc::process_vm_writev(pid, &l, 1, &r, 1, 0)
            }
        };
        match got {
            n if n > 0 => done += n as usize,
            _ => {
                // 0 bytes moved sets no errno: the peer's mapping ends there.
                let errno = if got == 0 {
                    "no bytes moved".to_string()
                } else {
                    std::io::Error::last_os_error().to_string()
                };
                let what = if read { "reading from" } else { "writing to" };
                return Err(Error::invalid(format!(
                    "{op}: {what} rank {}'s buffer ({} bytes at {:#x}, pid {pid}) failed after {done} bytes: \
                     {errno} (a peer published an address it does not own, or exited)",
                    remote.rank,
                    len,
                    remote.addr,
                )));
            }
        }
    }
    Ok(())
}

fn read(from: Loc, to: *mut u8, len: usize, op: &str) -> Result<()> {
    transfer(from, to, len, true, op)
}

fn write(from: *const u8, to: Loc, len: usize, op: &str) -> Result<()> {
    transfer(to, from.cast_mut(), len, false, op)
}

/// The tiles of one call, claimed one at a time by whichever member is free: a member that a busy
/// core slows down takes fewer, where fixed shares would make every member wait for its share. Each
/// member's `claim` word counts the claimed tiles of one part (its own part of an all_gather, its
/// block of a reduce_scatter; member 0's counts the whole message of the other kinds) below the
/// call's sequence number (low 32 bits), so a member still in an older call never takes a tile of a
/// newer one, nor uses one up.
pub(crate) struct Claims<'a> {
    words: Vec<&'a AtomicU64>,
    call: u64,
}

impl<'a> Claims<'a> {
    /// The claims of call `k` over every member's word; each member [`Claims::open`]s its own before
    /// it arrives at the call, so whoever sees the arrival sees the word opened.
    pub(crate) fn new(words: Vec<&'a AtomicU64>, k: u64) -> Self {
        Claims { words, call: k & 0xffff_ffff }
    }

    /// Start call `k`'s tiles of this member's word at 0.
    pub(crate) fn open(word: &AtomicU64, k: u64) {
        word.store((k & 0xffff_ffff) << 32, Release);
    }

    /// The next unclaimed tile below `tiles` of part `j`, if any.
    fn next(&self, j: usize, tiles: usize) -> Option<usize> {
        let word = self.words[j];
        let mut old = word.load(Acquire);
        loop {
            let t = (old & 0xffff_ffff) as usize;
            if old >> 32 != self.call || t >= tiles {
                return None;
            }
            match word.compare_exchange_weak(old, old + 1, AcqRel, Acquire) {
                Ok(_) => return Some(t),
                Err(now) => old = now,
            }
        }
    }

    /// Run `work` on every tile of part `j` below `tiles` this member claims, until none is left.
    fn each(&self, j: usize, tiles: usize, mut work: impl FnMut(usize) -> Result<()>) -> Result<()> {
        while let Some(t) = self.next(j, tiles) {
            work(t)?;
        }
        Ok(())
    }

    /// Member `me`'s share of parts that each have an owner, which does its own tiles more cheaply than
    /// a helper would: its own part first, then the tiles of other parts whose owners are behind by more
    /// than [`STEAL_SPARE`] tiles (in step, members take none of each other's).
    fn owned_first(
        &self,
        me: usize,
        tiles: usize,
        mut work: impl FnMut(usize, usize) -> Result<()>,
    ) -> Result<()> {
        let n = self.words.len();
        self.each(me, tiles, |t| work(me, t))?;
        (1..n)
            .map(|d| (me + d) % n)
            .try_for_each(|j| self.each(j, tiles.saturating_sub(STEAL_SPARE), |t| work(j, t)))
    }
}

/// Member `me`'s share of `call` (reducing with `op`) over every member's buffers: the tiles it
/// claims (`claims`), or for scatter, gather and the pairwise kinds, its own part.
///
/// # Safety
/// Every member validated its buffers for the same call and keeps them alive and untouched by itself
/// until the done-sync; `members[me]` are this process's own buffers (`pid` None).
pub(crate) unsafe fn run(
    call: &Call,
    op: ReduceOp,
    members: &[Member],
    me: usize,
    plan: Option<&Plan>,
    claims: &Claims<'_>,
    name: &str,
) -> Result<()> {
    if let Some(plan) = plan {
        // The pairwise kinds but reduce_scatter_v (`handles`): read every piece from its sender.
        let to = members[me].recv.addr as *mut u8;
        return plan.pieces(me).try_for_each(|(j, src, dst, len)| {
            read(members[j].send.at(src), to.wrapping_add(dst), len, name)
        });
    }
    let (e, count, n) = (call.dtype.size(), call.count, members.len());
    let (bytes, root) = (count * e, call.root.unwrap_or(0));
    let mine = members[me];
    let local = |l: Loc| l.addr as *mut u8;
    let stream = stream::worth(bytes);
    // Tiles of the message (of each part, for all_gather; of each block, for reduce_scatter): at most
    // CMA_TILE, and small enough that every member gets about two even in small messages.
    let unit = bytes.div_ceil(2 * n).next_multiple_of(4096).clamp(4096, CMA_TILE);
    let tiles = bytes.div_ceil(unit);
    let tile = |t: usize| (t * unit, unit.min(bytes - t * unit));
    // Copy `len` bytes at `from` (in this process) to `to(j)` for every member j but those in `skip`,
    // itself first (that local copy brings the tile into cache for the rest), then its peers from the
    // next one (members do not all write to the same peer at once).
    let deliver = |from: *const u8, to: &dyn Fn(usize) -> Loc, skip: &[usize], len: usize| {
        (0..n).map(|d| (me + d) % n).filter(|j| !skip.contains(j)).try_for_each(|j| {
            let dst = to(j);
            match dst.pid {
                // SAFETY: this member's own buffer; `copy` tolerates an in-place overlap.
                None => unsafe { stream::copy(from, local(dst), len, stream) },
                Some(_) => write(from, dst, len, name)?,
            }
            Ok(())
        })
    };
    let gather_tile = |j: usize, t: usize| {
        let (off, len) = tile(t);
        let slot = j * bytes + off;
        let from = if me == j {
            local(mine.send).wrapping_add(off)
        } else {
            read(members[j].send.at(off), local(mine.recv).wrapping_add(slot), len, name)?;
            local(mine.recv).wrapping_add(slot)
        };
        // Its owner copies it into its own slot too; a member that read it has it already.
        let skip = if me == j { &[][..] } else { std::slice::from_ref(&me) };
        deliver(from.cast_const(), &|d| members[d].recv.at(slot), skip, len)
    };
    match call.sig.kind {
        // Tile t goes to every member: the root writes it from its buffer; any other member reads it
        // from the root into its own, then writes it on from there.
        CollKind::Broadcast => claims.each(0, tiles, |t| {
            let (off, len) = tile(t);
            let from = if me == root {
                local(mine.send).wrapping_add(off)
            } else {
                read(members[root].send.at(off), local(mine.recv).wrapping_add(off), len, name)?;
                local(mine.recv).wrapping_add(off)
            };
            deliver(from.cast_const(), &|j| members[j].recv.at(off), &[me, root], len)
        }),
        // Tile t of member j's part goes into slot j of every member: as for broadcast, with j as root.
        // Each member takes its own part's tiles first (its own slot is a local copy), then helps.
        CollKind::AllGather => claims.owned_first(me, tiles, gather_tile),
        CollKind::Scatter => read(members[root].send.at(me * bytes), local(mine.recv), bytes, name),
        CollKind::Gather if me == root => {
            // SAFETY: this member's own buffers (slot `me` of its output).
            unsafe {
                stream::copy(local(mine.send), local(mine.recv).wrapping_add(me * bytes), bytes, stream)
            };
            Ok(())
        }
        CollKind::Gather => write(local(mine.send), members[root].recv.at(me * bytes), bytes, name),
        CollKind::AllReduce | CollKind::Reduce | CollKind::ReduceScatter => {
            // Tiles of elements: `per` of the message, or of each destination's block (reduce_scatter).
            let et = (unit / e).max(1);
            let per = count.div_ceil(et);
            let blocks = call.sig.kind == CollKind::ReduceScatter;
            SCRATCH.with_borrow_mut(|scratch| {
                let lines = (n * et * e).div_ceil(64);
                if scratch.len() < lines {
                    scratch.resize(lines, Line([0; 64]));
                }
                let buf = scratch.as_mut_ptr().cast::<u8>();
                // Slot j holds member j's tile; slot `me` the result when it is not kept here.
                let slot = |j: usize| buf.wrapping_add(j * et * e);
                let reduce_tile = |d: usize, t: usize| {
                    let (lo, len) = (t * et, et.min(count - t * et));
                    let src = if blocks { d * bytes + lo * e } else { lo * e };
                    let nb = len * e;
                    for j in (1..n).map(|x| (me + x) % n) {
                        read(members[j].send.at(src), slot(j), nb, name)?;
                    }
                    let inputs: Vec<*const u8> = (0..n)
                        .map(|j| {
                            if j == me {
                                local(mine.send).wrapping_add(src).cast_const()
                            } else {
                                slot(j).cast_const()
                            }
                        })
                        .collect();
                    // Who receives the result: every member, the root, or block d's owner.
                    let keep = match call.sig.kind {
                        CollKind::AllReduce => true,
                        CollKind::Reduce => me == root,
                        _ => me == d,
                    };
                    let out = lo * e;
                    let result = if keep { local(mine.recv).wrapping_add(out) } else { slot(me) };
                    // SAFETY: every input holds `len` elements (own input in place, peers' in scratch);
                    // the output is this member's own buffer or its scratch slot, aligned (64-byte lines).
                    unsafe { reduce_raw(call.dtype, op, call.sig.scale, &inputs, &[result], len) };
                    match call.sig.kind {
                        CollKind::AllReduce => {
                            deliver(result.cast_const(), &|j| members[j].recv.at(out), &[me], nb)
                        }
                        CollKind::Reduce if !keep => write(result, members[root].recv.at(out), nb, name),
                        CollKind::ReduceScatter if !keep => write(result, members[d].recv.at(out), nb, name),
                        _ => Ok(()),
                    }
                };
                if blocks {
                    // The result of its own block stays here; a helper writes it to the owner.
                    claims.owned_first(me, per, reduce_tile)
                } else {
                    claims.each(0, per, |t| reduce_tile(usize::MAX, t))
                }
            })
        }
        // The pairwise kinds come with their plan (above).
        CollKind::Barrier
        | CollKind::AllToAll
        | CollKind::AllToAllSingle
        | CollKind::AllGatherV
        | CollKind::GatherV
        | CollKind::ScatterV
        | CollKind::ReduceScatterV => Ok(()),
    }
}

/// What [`probe`] reads in a peer: a word every process of this library holds at an address it tells
/// its peers (the segment header).
pub(crate) static PROBE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(PROBE_WORD);
const PROBE_WORD: u64 = 0x6178_6f6e_6d6c_434d;

/// Whether this process may read and write the memory of process `pid` (which holds [`PROBE`] at
/// `addr`): false when the kernel or a sandbox refuses (EPERM, ENOSYS, a seccomp filter, Yama).
pub(crate) fn probe(pid: i32, addr: usize) -> bool {
    let remote = Loc { pid: Some(pid), addr, rank: 0 };
    let mut word = 0u64;
    let at = (&raw mut word).cast::<u8>();
    // Writing the word back as it was leaves the peer unchanged.
    read(remote, at, 8, "probe").is_ok() && word == PROBE_WORD && write(at, remote, 8, "probe").is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn me() -> i32 {
        std::process::id() as i32
    }

    #[test]
    fn a_process_may_probe_itself() {
        assert!(probe(me(), PROBE.as_ptr() as usize));
    }

    #[test]
    fn a_bad_address_is_an_error_naming_the_peer() {
        let mut got = [0u8; 16];
        let bad = Loc { pid: Some(me()), addr: 16, rank: 3 };
        let e = read(bad, got.as_mut_ptr(), 16, "all_reduce").unwrap_err().to_string();
        assert!(e.contains("rank 3") && e.contains("after 0 bytes"), "{e}");
        assert!(!probe(me(), 16));
        let e = write(got.as_ptr(), bad, 16, "broadcast").unwrap_err().to_string();
        assert!(e.contains("writing to rank 3"), "{e}");
    }

    /// Members of a world of 3 in this process run their shares one after another, so the first takes
    /// every tile it may (all of a shared counter; its own part and all but the spare tiles of the
    /// others') and later ones take what is left: every result must still be the reference, bitwise.
    #[test]
    fn tiles_claimed_by_any_member_give_the_reference_results() {
        use crate::call;
        use crate::dtype::{Buf, BufMut};
        use crate::reduce::Scale;
        const N: usize = 3;
        let count = 40_000 * N + 3; // many tiles, uneven ones
        let input =
            |j: usize| -> Vec<f32> { (0..count).map(|i| (i % 977) as f32 * 0.1 + j as f32 * 0.37).collect() };
        let given: Vec<Vec<f32>> = (0..N).map(input).collect();
        let sum = |i: usize| (given[0][i] + given[1][i]) + given[2][i];
        // Runs member shares in order 0, 1, 2 over buffers `send[j]`, `recv[j]`.
        let run_all = |calls: &[Call], members: &[Member]| {
            let words: Vec<AtomicU64> = (0..N).map(|_| AtomicU64::new(0)).collect();
            words.iter().for_each(|w| Claims::open(w, 7));
            for (me, c) in calls.iter().enumerate() {
                let claims = Claims::new(words.iter().collect(), 7);
                // SAFETY: every buffer lives until the end of the test; members run one at a time.
                unsafe { run(c, ReduceOp::Sum, members, me, None, &claims, "t") }.unwrap();
            }
        };
        let loc = |p: *const f32, rank| Loc { pid: None, addr: p as usize, rank };
        let peers = |send: &[Vec<f32>], recv: &[Vec<f32>]| -> Vec<Member> {
            (0..N)
                .map(|j| Member { send: loc(send[j].as_ptr(), j), recv: loc(recv[j].as_ptr(), j) })
                .collect()
        };

        // all_reduce and broadcast (root 1), in place.
        for kind in [CollKind::AllReduce, CollKind::Broadcast] {
            let mut bufs = given.clone();
            let calls: Vec<Call> = bufs
                .iter_mut()
                .map(|b| match kind {
                    CollKind::AllReduce => {
                        call::all_reduce(None, &mut BufMut::new(&mut b[..]), ReduceOp::Sum, Scale::NONE)
                    }
                    _ => call::broadcast(&[0, 1, 2], &mut BufMut::new(&mut b[..]), 1),
                })
                .collect::<Result<_>>()
                .unwrap();
            run_all(&calls, &peers(&bufs, &bufs));
            for (j, b) in bufs.iter().enumerate() {
                let want: Vec<f32> =
                    if kind == CollKind::AllReduce { (0..count).map(sum).collect() } else { input(1) };
                assert!(b.iter().zip(&want).all(|(x, y)| x.to_bits() == y.to_bits()), "{kind:?} member {j}");
            }
        }

        // all_gather and reduce_scatter, out of place.
        let sends = given.clone();
        let mut outs: Vec<Vec<f32>> = (0..N).map(|_| vec![0.0; N * count]).collect();
        let calls: Vec<Call> = (0..N)
            .map(|j| call::all_gather(N, &Buf::new(&sends[j][..]), &mut BufMut::new(&mut outs[j][..])))
            .collect::<Result<_>>()
            .unwrap();
        run_all(&calls, &peers(&sends, &outs));
        let want: Vec<f32> = given.concat();
        assert!(outs.iter().all(|o| o == &want), "all_gather");

        let part = count / N;
        let mut blocks: Vec<Vec<f32>> = (0..N).map(|_| vec![0.0; part]).collect();
        let ins: Vec<Vec<f32>> = given.iter().map(|g| g[..N * part].to_vec()).collect();
        let calls: Vec<Call> = (0..N)
            .map(|j| {
                call::reduce_scatter(
                    N,
                    &Buf::new(&ins[j][..]),
                    &mut BufMut::new(&mut blocks[j][..]),
                    ReduceOp::Sum,
                )
            })
            .collect::<Result<_>>()
            .unwrap();
        run_all(&calls, &peers(&ins, &blocks));
        for (d, b) in blocks.iter().enumerate() {
            assert!(
                b.iter().enumerate().all(|(i, x)| x.to_bits() == sum(d * part + i).to_bits()),
                "block {d}"
            );
        }
    }

    #[test]
    fn a_member_in_an_older_call_takes_no_tile_and_uses_none_up() {
        let word = AtomicU64::new(0);
        Claims::open(&word, 5);
        let (old, new) = (Claims::new(vec![&word], 4), Claims::new(vec![&word], 5));
        assert_eq!(old.next(0, 10), None);
        assert_eq!(new.next(0, 10), Some(0));
        assert_eq!(old.next(0, 10), None);
        assert_eq!((new.next(0, 2), new.next(0, 2)), (Some(1), None));
    }

    #[test]
    fn copies_between_processes_move_every_byte() {
        let src: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        let mut dst = vec![0u8; src.len()];
        let from = Loc { pid: Some(me()), addr: src.as_ptr() as usize, rank: 1 };
        read(from, dst.as_mut_ptr(), src.len(), "t").unwrap();
        assert_eq!(src, dst);
    }
}
