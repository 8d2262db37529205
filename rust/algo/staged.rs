//! Collectives on private buffers, pipelined through the members' staging buffers.
//!
//! A message is cut into rounds of at most one pipeline buffer; round g uses buffer `g % 2` of every
//! member and three steps of the member's `step` counter (3g+1 staged, 3g+2 reduced, 3g+3 done with
//! the round). Before staging into buffer `g % 2` a member waits until every member finished round
//! g−2, the last one that read it; nothing else waits, so a member may stage round g+1 while its
//! peers still reduce round g. Rounds count over the communicator's life, so consecutive collectives
//! chain the same way.
//!
//! all_reduce is reduce-scatter + all-gather with owner-computes: in each round member i owns slice i;
//! it stages the N−1 slices it does not own, reduces its own slice from its private input and the N−1
//! staged copies (rank order), writes the result to its private buffer and its staging buffer, and then
//! copies the other owners' results out. Per rank that moves (5 − 2/N)·S bytes, the floor for private
//! buffers.
//!
//! Each piece sits in its staging region at the page offset it would have in a message starting at
//! `STAGE_SKEW` (so copies in and out do not alias, `config::ALIAS_PERIOD`); a region of at least
//! `PLACE_MIN` bytes keeps one period of room for that.

use super::owner::owned;
use super::{part_spans, stream};
use crate::config::{ALIAS_PERIOD, STAGE_SKEW};
use crate::dtype::DType;
use crate::error::Result;
use crate::reduce::{reduce_raw, ReduceOp, Scale};
use crate::signature::CollKind;

/// One staged collective, as seen by member `me`.
pub(crate) struct Staged<'a> {
    pub kind: CollKind,
    pub dtype: DType,
    pub op: ReduceOp,
    pub scale: Scale,
    pub n: usize,
    pub me: usize,
    pub root: usize,
    /// Elements per member part (the whole message for all_reduce, broadcast, reduce).
    pub count: usize,
    pub send: *const u8,
    pub recv: *mut u8,
    /// Every member's two pipeline buffers, in this process's address space.
    pub bufs: &'a [[*mut u8; 2]],
    /// Bytes per pipeline buffer.
    pub chunk: usize,
}

/// Staging spaces at least this large keep one [`ALIAS_PERIOD`] of room for placing pieces, which
/// costs them at most 1/16 of a round; smaller ones (regions in worlds over 8 ranks) place nothing.
const PLACE_MIN: usize = 16 * ALIAS_PERIOD;

/// Room a staging space of `cap` bytes keeps for placing its pieces.
fn slack(cap: usize) -> usize {
    if cap >= PLACE_MIN {
        ALIAS_PERIOD
    } else {
        0
    }
}

/// Where a piece starting `at` bytes into its message goes in the staging space `off` bytes into a
/// page-aligned pipeline buffer at `buf`, the space holding `cap` bytes. From offsets, not addresses:
/// every member computes the same place whatever address its mapping has.
fn place(buf: *mut u8, off: usize, cap: usize, at: usize) -> *mut u8 {
    let pad = if slack(cap) == 0 { 0 } else { STAGE_SKEW.wrapping_add(at).wrapping_sub(off) % ALIAS_PERIOD };
    buf.wrapping_add(off + pad)
}

impl Staged<'_> {
    /// Bytes of the per-owner region of a pipeline buffer (64-byte aligned).
    fn region(&self) -> usize {
        (self.chunk / self.n) & !63
    }

    /// Elements moved per round.
    fn per_round(&self) -> usize {
        let e = self.dtype.size();
        let room = |cap: usize| (cap - slack(cap)) / e;
        match self.kind {
            CollKind::AllReduce | CollKind::Reduce => self.n * room(self.region()),
            CollKind::ReduceScatter | CollKind::Scatter => room(self.region()),
            _ => room(self.chunk),
        }
    }

    /// Bytes of this call's send and receive buffers on a member that has them (the root's).
    fn spans(&self) -> (usize, usize) {
        part_spans(self.kind, self.count * self.dtype.size(), self.n, true)
    }

    /// Run every round. `round` is the communicator's round counter; `publish(s)` stores this member's
    /// step, `sync(s)` waits until every member's step reaches `s`.
    ///
    /// # Safety
    /// `send`/`recv` are this member's validated buffers for the call (null where the collective has
    /// none on this member), every member runs the same call, and `bufs` point at the members' staging.
    pub(crate) unsafe fn run(
        &self,
        round: &mut u64,
        publish: impl Fn(u64),
        sync: impl Fn(u64) -> Result<()>,
    ) -> Result<()> {
        let per = self.per_round();
        let mut lo = 0;
        while lo < self.count {
            let hi = (lo + per).min(self.count);
            let g = *round;
            *round += 1;
            if g >= 2 {
                sync(3 * g - 3)?;
            }
            // SAFETY: forwarded; the waits order every access (module docs).
            unsafe { self.round(g, lo, hi, &publish, &sync)? };
            lo = hi;
        }
        Ok(())
    }

    /// # Safety
    /// As for [`Staged::run`].
    unsafe fn round(
        &self,
        g: u64,
        lo: usize,
        hi: usize,
        publish: &impl Fn(u64),
        sync: &impl Fn(u64) -> Result<()>,
    ) -> Result<()> {
        let (e, n, me, root) = (self.dtype.size(), self.n, self.me, self.root);
        let b = (g % 2) as usize;
        let region = self.region();
        let len = hi - lo;
        // Member j's staging for owner o's piece, which starts at element `at` of its message; the
        // whole-buffer kinds use owner 0's region, the whole buffer.
        let cap = match self.kind {
            CollKind::AllReduce | CollKind::Reduce | CollKind::ReduceScatter | CollKind::Scatter => region,
            _ => self.chunk,
        };
        // o < n regions of `region` bytes fit in a pipeline buffer (page-aligned: the segment's layout),
        // and a piece placed in one still fits (`per_round` left the placement's room).
        let stage = |j: usize, o: usize, at: usize| place(self.bufs[j][b], o * region, cap, at * e);
        // SAFETY: called only on members that have the buffer, with element offsets below the
        // buffer's length for this call (the round's range of the part or message).
        let src = |el: usize| unsafe { self.send.add(el * e) };
        // SAFETY: as for `src`.
        let dst = |el: usize| unsafe { self.recv.add(el * e) };
        // SAFETY: every copy below moves at most the round's elements between a staging region (which
        // holds a placed piece of up to (cap - slack(cap)) / e elements, `per_round`) and the
        // matching range of a private buffer; the steps order it against peers' accesses. `copy` and
        // `out` tolerate the in-place overlap of all_gather's own part (`stream::copy` does not
        // stream overlapping ranges).
        let copy =
            |from: *const u8, to: *mut u8, elems: usize| unsafe { std::ptr::copy(from, to, elems * e) };
        // Copies out of staging into the private output stream when the whole output is large
        // (`stream::worth`): pieces of it are never read again in this call.
        let streams = stream::worth(self.spans().1);
        // SAFETY: as for `copy`.
        let out = |from: *const u8, to: *mut u8, elems: usize| unsafe {
            stream::copy(from, to, elems * e, streams)
        };
        let slice = |o: usize| owned(len, e, n, o);
        match self.kind {
            CollKind::AllReduce | CollKind::Reduce => {
                for o in (0..n).filter(|&o| o != me) {
                    let s = slice(o);
                    copy(src(lo + s.start), stage(me, o, lo + s.start), s.len());
                }
                publish(3 * g + 1);
                sync(3 * g + 1)?;
                let s = slice(me);
                if !s.is_empty() {
                    let inputs: Vec<*const u8> = (0..n)
                        .map(|j| {
                            if j == me {
                                src(lo + s.start)
                            } else {
                                stage(j, me, lo + s.start).cast_const()
                            }
                        })
                        .collect();
                    let mut outputs = vec![stage(me, me, lo + s.start)];
                    if self.kind == CollKind::AllReduce || me == root {
                        outputs.push(dst(lo + s.start));
                    }
                    // SAFETY: every input holds s.len() elements staged before step 3g+1; this member
                    // alone writes its slice of its private buffer and its own staging region.
                    unsafe { reduce_raw(self.dtype, self.op, self.scale, &inputs, &outputs, s.len()) };
                }
                publish(3 * g + 2);
                sync(3 * g + 2)?;
                if self.kind == CollKind::AllReduce || me == root {
                    for o in (0..n).filter(|&o| o != me) {
                        let s = slice(o);
                        out(stage(o, o, lo + s.start), dst(lo + s.start), s.len());
                    }
                }
            }
            CollKind::ReduceScatter => {
                for o in (0..n).filter(|&o| o != me) {
                    copy(src(o * self.count + lo), stage(me, o, o * self.count + lo), len);
                }
                publish(3 * g + 1);
                sync(3 * g + 1)?;
                let inputs: Vec<*const u8> = (0..n)
                    .map(|j| {
                        if j == me {
                            src(me * self.count + lo)
                        } else {
                            stage(j, me, me * self.count + lo).cast_const()
                        }
                    })
                    .collect();
                // SAFETY: as above; the output is this member's own receive buffer.
                unsafe { reduce_raw(self.dtype, self.op, self.scale, &inputs, &[dst(lo)], len) };
            }
            CollKind::Scatter => {
                if me == root {
                    for o in (0..n).filter(|&o| o != me) {
                        copy(src(o * self.count + lo), stage(me, o, o * self.count + lo), len);
                    }
                }
                publish(3 * g + 1);
                sync(3 * g + 1)?;
                if me == root {
                    copy(src(me * self.count + lo), dst(lo), len);
                } else {
                    copy(stage(root, me, me * self.count + lo), dst(lo), len);
                }
            }
            CollKind::Broadcast => {
                if me == root {
                    copy(src(lo), stage(me, 0, lo), len);
                }
                publish(3 * g + 1);
                sync(3 * g + 1)?;
                if me != root {
                    out(stage(root, 0, lo), dst(lo), len);
                }
            }
            CollKind::AllGather | CollKind::Gather => {
                copy(src(lo), stage(me, 0, lo), len);
                publish(3 * g + 1);
                sync(3 * g + 1)?;
                if self.kind == CollKind::AllGather || me == root {
                    out(src(lo), dst(me * self.count + lo), len);
                    for j in (0..n).filter(|&j| j != me) {
                        out(stage(j, 0, lo), dst(j * self.count + lo), len);
                    }
                }
            }
            // The pairwise kinds run `pairwise::Staged`.
            CollKind::Barrier
            | CollKind::AllToAll
            | CollKind::AllToAllSingle
            | CollKind::AllGatherV
            | CollKind::GatherV
            | CollKind::ScatterV
            | CollKind::ReduceScatterV => {}
        }
        publish(3 * g + 3);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placed_pieces_keep_their_skewed_page_offset_and_fit_their_region() {
        let buf = 0x10_0000usize as *mut u8;
        for (chunk, n) in
            [(64 << 10, 3), (1 << 20, 3), (1 << 20, 2), (1 << 20, 8), (256 << 10, 9), (256 << 10, 64)]
        {
            let region = (chunk / n) & !63;
            for (cap, offs) in [(region, (0..n).map(|o| o * region).collect::<Vec<_>>()), (chunk, vec![0])] {
                let room = cap - slack(cap);
                assert!(room > 0 && room * 16 >= cap * 15, "chunk {chunk} n {n}: room {room} of {cap}");
                for &off in &offs {
                    for at in [0, 8, 64, 4096 - 8, 123_456 * 8] {
                        let pad = place(buf, off, cap, at) as usize - buf as usize - off;
                        assert!(pad + room <= cap, "chunk {chunk} n {n} off {off} at {at}");
                        if slack(cap) > 0 {
                            assert_eq!((off + pad) % ALIAS_PERIOD, (STAGE_SKEW + at) % ALIAS_PERIOD);
                        } else {
                            assert_eq!(pad, 0);
                        }
                    }
                }
            }
        }
    }
}
