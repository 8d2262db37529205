//! The tiles of one call, claimed one at a time by whichever member is free, so that a member whose
//! core is taken by another process does less of the work instead of holding every member back with
//! a fixed share. Each member's `claim` word (`engine::Ctrl`) counts the claimed tiles of one part:
//! its own part of an all_gather or block of a reduce_scatter; member 0's counts the whole message of
//! the other kinds. The word's high 32 bits hold the call's sequence number (its low 32 bits), so a
//! member still in an older call never takes a tile of a newer one, nor uses one up.

use std::sync::atomic::{AtomicU64, Ordering::*};

use crate::config::{CMA_TILE, STEAL_SPARE};
use crate::error::Result;

/// The claim words of one call, one per member.
pub(crate) struct Claims<'a> {
    /// Member j's claim word (read through the store: no per-call list of them).
    word: &'a dyn Fn(usize) -> &'a AtomicU64,
    /// Members of the call.
    n: usize,
    call: u64,
    /// Whether members help each other: only when every rank has a core. Ranks that outnumber the
    /// cores keep them all busy anyway, and a helper's tiles cost more (a second copy, more calls).
    helping: bool,
}

impl<'a> Claims<'a> {
    /// The claims of call `k` over the words of its `n` members; each member [`Claims::open`]s its own
    /// before it publishes its arrival, so whoever sees the arrival sees the word opened.
    pub(crate) fn new(word: &'a dyn Fn(usize) -> &'a AtomicU64, n: usize, k: u64, helping: bool) -> Self {
        Claims { word, n, call: k & 0xffff_ffff, helping }
    }

    /// Start call `k`'s tiles of a member's word at 0.
    pub(crate) fn open(word: &AtomicU64, k: u64) {
        word.store((k & 0xffff_ffff) << 32, Release);
    }

    /// Bytes of a tile of a `bytes`-long message (or part) among `n` members, at most [`CMA_TILE`]:
    /// about one per member for the tiles any member may take ([`Claims::share`]), where each tile
    /// costs a system call on the cross-memory route and a member held back before it claims one
    /// leaves it to the others anyway (2 ranks, broadcast 256 KiB crossing took 10.5 us in tiles of
    /// 64 KiB, 7.2 us in tiles of 128 KiB); for parts with owners ([`Claims::owned_first`]) about two
    /// per member when members help each other, so that a helper finds tiles to take.
    pub(crate) fn unit(&self, bytes: usize, n: usize, owned: bool) -> usize {
        let per = if owned && self.helping { 2 * n } else { n };
        bytes.div_ceil(per).next_multiple_of(4096).clamp(4096, CMA_TILE)
    }

    /// Offset and length of tile `t` of a `bytes`-long message cut in tiles of `unit` bytes.
    pub(crate) fn tile(t: usize, unit: usize, bytes: usize) -> (usize, usize) {
        (t * unit, unit.min(bytes - t * unit))
    }

    /// The next unclaimed tile below `tiles` of part `j`, if any.
    fn next(&self, j: usize, tiles: usize) -> Option<usize> {
        let word = (self.word)(j);
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
    pub(crate) fn each(
        &self,
        j: usize,
        tiles: usize,
        mut work: impl FnMut(usize) -> Result<()>,
    ) -> Result<()> {
        while let Some(t) = self.next(j, tiles) {
            work(t)?;
        }
        Ok(())
    }

    /// Member `me`'s share of `tiles` that any member may do equally well (broadcast, the reductions):
    /// those it claims from member 0's word when members help each other; else the `me`-th of n
    /// equal runs of them (when ranks outnumber cores, claiming only moves all the work onto the
    /// ranks that happen to hold a core, which made 256 KiB calls up to twice as slow at 4 ranks).
    pub(crate) fn share(
        &self,
        me: usize,
        tiles: usize,
        mut work: impl FnMut(usize) -> Result<()>,
    ) -> Result<()> {
        if self.helping {
            return self.each(0, tiles, work);
        }
        let n = self.n;
        (tiles * me / n..tiles * (me + 1) / n).try_for_each(&mut work)
    }

    /// Member `me`'s share of parts that each have an owner, which does its own tiles more cheaply than
    /// a helper would: its own part first, then (when helping) the tiles of other parts whose owners
    /// are behind by more than [`STEAL_SPARE`] tiles; members in step take none of each other's.
    pub(crate) fn owned_first(
        &self,
        me: usize,
        tiles: usize,
        mut work: impl FnMut(usize, usize) -> Result<()>,
    ) -> Result<()> {
        let n = if self.helping { self.n } else { 1 };
        self.each(me, tiles, |t| work(me, t))?;
        (1..n)
            .map(|d| (me + d) % n)
            .try_for_each(|j| self.each(j, tiles.saturating_sub(STEAL_SPARE), |t| work(j, t)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_member_in_an_older_call_takes_no_tile_and_uses_none_up() {
        let word = AtomicU64::new(0);
        Claims::open(&word, 5);
        let only = |_: usize| &word;
        let (old, new) = (Claims::new(&only, 1, 4, true), Claims::new(&only, 1, 5, true));
        assert_eq!(old.next(0, 10), None);
        assert_eq!(new.next(0, 10), Some(0));
        assert_eq!(old.next(0, 10), None);
        assert_eq!((new.next(0, 2), new.next(0, 2)), (Some(1), None));
    }

    #[test]
    fn without_help_members_take_equal_runs_that_cover_every_tile_once() {
        let words: Vec<AtomicU64> = (0..3).map(|_| AtomicU64::new(0)).collect();
        let word = |j: usize| &words[j];
        let claims = Claims::new(&word, 3, 1, false);
        let mut seen = Vec::new();
        for me in 0..3 {
            claims
                .share(me, 7, |t| {
                    seen.push(t);
                    Ok(())
                })
                .unwrap();
        }
        assert_eq!(seen, (0..7).collect::<Vec<_>>());
    }

    #[test]
    fn helpers_leave_an_owner_its_last_tiles_and_do_not_help_when_cores_are_short() {
        let words: Vec<AtomicU64> = (0..2).map(|_| AtomicU64::new(0)).collect();
        for helping in [true, false] {
            words.iter().for_each(|w| Claims::open(w, 1));
            let word = |j: usize| &words[j];
            let claims = Claims::new(&word, 2, 1, helping);
            let taken_by = |me| {
                let mut taken = Vec::new();
                claims
                    .owned_first(me, 5, |j, t| {
                        taken.push((j, t));
                        Ok(())
                    })
                    .unwrap();
                taken
            };
            let helped = if helping { 5 - STEAL_SPARE } else { 0 };
            let want: Vec<_> = (0..5).map(|t| (0, t)).chain((0..helped).map(|t| (1, t))).collect();
            assert_eq!(taken_by(0), want, "helping {helping}");
            // The owner still gets exactly the rest.
            let rest = taken_by(1);
            assert_eq!(rest, (helped..5).map(|t| (1, t)).collect::<Vec<_>>());
        }
    }
}
