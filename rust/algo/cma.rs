//! Collectives on private buffers of processes, copied straight between them (`process_vm`): each
//! byte moves once, by the kernel, from the owner's memory to the reader's, with no staging copy and
//! no pipeline sync. Members touch disjoint memory, so the engine's done-sync (its drain) is the only
//! wait.
//!
//! Members share the work in tiles they claim one at a time ([`Claims`]), so a member whose core is
//! taken by another process does less of it instead of holding every member back:
//! * broadcast: the root writes a tile it claims into every other member's buffer; any other member
//!   reads it from the root, then writes it on to the rest (at 2 ranks in step, each copies half);
//! * all_gather: a member copies each tile of its own part into its own slot and writes it to its
//!   peers, then helps with parts whose owners are behind; gather: each member writes its part into
//!   the root's buffer; scatter: each member reads its part from the root;
//! * all_reduce, reduce, reduce_scatter: for each tile it claims, a member reads the tile of every
//!   peer's input into local scratch, reduces in rank order (own input read in place), then writes the
//!   result into every peer's output (all_reduce), the root's (reduce) or the block owner's
//!   (reduce_scatter, where members take their own blocks first). Tiles keep the scratch in cache
//!   between the read and the reduction. Whoever computes a tile, the order of the reduction is the
//!   same, so results are bitwise identical.

use std::cell::RefCell;

use super::claims::Claims;
use super::layout::Plan;
use super::process_vm::{read, transfer, write, Loc};
use super::stream;
use crate::call::Call;
use crate::error::Result;
use crate::reduce::{reduce_raw, ReduceOp};
use crate::signature::CollKind;

/// A member's send and receive buffers.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Member {
    pub send: Loc,
    pub recv: Loc,
}

#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct Line([u8; 64]);

thread_local! {
    /// Scratch tiles of the reductions, kept across calls (a fresh allocation per call would fault
    /// its pages in every time).
    static SCRATCH: RefCell<Vec<Line>> = const { RefCell::new(Vec::new()) };
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
    // Tiles of the message (of each part, for all_gather; of each block, for reduce_scatter).
    let owned = matches!(call.sig.kind, CollKind::AllGather | CollKind::ReduceScatter);
    let unit = claims.unit(bytes, n, owned);
    let tiles = bytes.div_ceil(unit);
    let tile = |t: usize| Claims::tile(t, unit, bytes);
    // Copy `len` bytes at `from` (in this process) to `to(j)` for every member j but those in `skip`:
    // itself first (that copy brings the tile into cache for the rest), then its peers from the next
    // one (members do not all write to the same peer at once).
    let deliver = |from: *const u8, to: &dyn Fn(usize) -> Loc, skip: &[usize], len: usize| {
        (0..n)
            .map(|d| (me + d) % n)
            .filter(|j| !skip.contains(j))
            .try_for_each(|j| transfer(to(j), from.cast_mut(), len, false, stream, name))
    };
    // Bring bytes `off..off + len` of member `src`'s input to offset `at` of every member's output:
    // the source copies from its input (into its own output too, unless `kept`: its input is its
    // output); any other member reads them into its own output, then copies them on from there.
    let relay = |src: usize, off: usize, at: usize, len: usize, kept: bool| {
        let from = if me == src {
            local(mine.send).wrapping_add(off).cast_const()
        } else {
            read(members[src].send.at(off), local(mine.recv).wrapping_add(at), len, name)?;
            local(mine.recv).wrapping_add(at).cast_const()
        };
        // Skip who has the bytes already: a reader itself, and a source whose input is its output.
        let both = [me, src];
        let skip = match (me == src, kept) {
            (true, false) => &both[..0],
            (false, true) => &both[..],
            _ => &both[..1],
        };
        deliver(from, &|j| members[j].recv.at(at), skip, len)
    };
    match call.sig.kind {
        CollKind::Broadcast => claims.share(me, tiles, |t| {
            let (off, len) = tile(t);
            relay(root, off, off, len, true)
        }),
        // Tile t of member j's part goes into slot j of every member.
        CollKind::AllGather => claims.owned_first(me, tiles, |j, t| {
            let (off, len) = tile(t);
            relay(j, off, j * bytes + off, len, false)
        }),
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
                    claims.share(me, per, |t| reduce_tile(usize::MAX, t))
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Members of a world of 3 in this process run their shares one after another, each of them first
    /// in turn, so the first takes every tile it may (all of a shared counter; its own part and all but
    /// the spare tiles of the others') and later ones take what is left: every result must still be
    /// the reference, bitwise.
    #[test]
    fn tiles_claimed_by_any_member_give_the_reference_results() {
        use crate::call;
        use crate::dtype::{Buf, BufMut};
        use crate::reduce::Scale;
        use std::sync::atomic::AtomicU64;
        const N: usize = 3;
        let count = 40_000 * N + 3; // many tiles, uneven ones
        let given: Vec<Vec<f32>> =
            (0..N).map(|j| (0..count).map(|i| (i % 977) as f32 * 0.1 + j as f32 * 0.37).collect()).collect();
        let sum = |i: usize| (given[0][i] + given[1][i]) + given[2][i];
        let same = |a: &[f32], b: &[f32]| {
            a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
        };
        // Run every member's share, in the order first, first + 1, ...
        let run_all = |calls: &[Call], members: &[Member], first: usize| {
            let words: Vec<AtomicU64> = (0..N).map(|_| AtomicU64::new(0)).collect();
            words.iter().for_each(|w| Claims::open(w, 7));
            let word = |j: usize| &words[j];
            for me in (0..N).map(|d| (first + d) % N) {
                let claims = Claims::new(&word, N, 7, true);
                // SAFETY: every buffer lives until the end of the test; members run one at a time.
                unsafe { run(&calls[me], ReduceOp::Sum, members, me, None, &claims, "t") }.unwrap();
            }
        };
        let loc = |p: *const f32, rank| Loc { pid: None, addr: p as usize, rank };
        let peers = |send: &[Vec<f32>], recv: &[Vec<f32>]| -> Vec<Member> {
            (0..N)
                .map(|j| Member { send: loc(send[j].as_ptr(), j), recv: loc(recv[j].as_ptr(), j) })
                .collect()
        };
        for first in 0..N {
            // all_reduce, reduce (root 2) and broadcast (root 1), in place.
            for kind in [CollKind::AllReduce, CollKind::Reduce, CollKind::Broadcast] {
                let mut bufs = given.clone();
                let calls: Vec<Call> = bufs
                    .iter_mut()
                    .map(|b| {
                        let mut b = BufMut::new(&mut b[..]);
                        match kind {
                            CollKind::AllReduce => call::all_reduce(None, &mut b, ReduceOp::Sum, Scale::NONE),
                            CollKind::Reduce => {
                                call::reduce(&[0, 1, 2], None, &mut b, 2, ReduceOp::Sum, Scale::NONE)
                            }
                            _ => call::broadcast(&[0, 1, 2], &mut b, 1),
                        }
                    })
                    .collect::<Result<_>>()
                    .unwrap();
                run_all(&calls, &peers(&bufs, &bufs), first);
                let total: Vec<f32> = (0..count).map(sum).collect();
                for (j, b) in bufs.iter().enumerate() {
                    let want = match kind {
                        CollKind::AllReduce => &total,
                        CollKind::Reduce if j == 2 => &total,
                        CollKind::Reduce => &given[j],
                        _ => &given[1],
                    };
                    assert!(same(b, want), "{kind:?} member {j}, member {first} first");
                }
            }
            // all_gather and reduce_scatter, out of place.
            let mut outs: Vec<Vec<f32>> = (0..N).map(|_| vec![0.0; N * count]).collect();
            let calls: Vec<Call> = (0..N)
                .map(|j| call::all_gather(N, &Buf::new(&given[j][..]), &mut BufMut::new(&mut outs[j][..])))
                .collect::<Result<_>>()
                .unwrap();
            run_all(&calls, &peers(&given, &outs), first);
            assert!(outs.iter().all(|o| same(o, &given.concat())), "all_gather, member {first} first");
            let part = count / N;
            let mut blocks: Vec<Vec<f32>> = (0..N).map(|_| vec![0.0; part]).collect();
            let ins: Vec<Vec<f32>> = given.iter().map(|g| g[..N * part].to_vec()).collect();
            let calls: Vec<Call> = (0..N)
                .map(|j| {
                    let (send, mut recv) = (Buf::new(&ins[j][..]), BufMut::new(&mut blocks[j][..]));
                    call::reduce_scatter(N, &send, &mut recv, ReduceOp::Sum)
                })
                .collect::<Result<_>>()
                .unwrap();
            run_all(&calls, &peers(&ins, &blocks), first);
            for (d, b) in blocks.iter().enumerate() {
                let want: Vec<f32> = (d * part..(d + 1) * part).map(sum).collect();
                assert!(same(b, &want), "reduce_scatter block {d}, member {first} first");
            }
        }
    }
}
