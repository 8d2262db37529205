//! The communicator table in the segment: which slot and staging blocks the n-th split of a rank set
//! uses, and giving them back once every member has dropped its group (module docs of `shm`).
//!
//! Every change happens under one lock word in the header, held for a scan of the table and never
//! across a wait; a rank waiting for it watches the holder's liveness, so a holder that dies aborts
//! the world instead of hanging it.

use std::sync::atomic::Ordering::*;

use super::layout::{FREE, IN_USE, MAX_COMMS};
use super::shared::Shared;
use crate::error::{Error, Result};

/// `first_block` of a slot whose members got no staging blocks (each of them fails and leaves).
const NO_BLOCKS: u32 = u32::MAX;

/// The table lock, released when dropped.
struct Locked<'a>(&'a Shared);

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        let h = self.0.header();
        h.table.store(0, Release);
        h.event.notify(true);
    }
}

fn no_blocks() -> Error {
    Error::invalid(
        "new_group: the job's shared segment has no staging space left for another subgroup; \
         drop groups you no longer use, or create fewer",
    )
}

impl Shared {
    fn lock_table(&self, op: &str) -> Result<Locked<'_>> {
        let h = self.header();
        loop {
            let holder = match h.table.compare_exchange(0, self.rank as u32 + 1, Acquire, Acquire) {
                Ok(_) => return Ok(Locked(self)),
                Err(holder) => holder,
            };
            let ranks: Vec<usize> = (holder as usize)
                .checked_sub(1)
                .filter(|&r| r < self.size && r != self.rank)
                .into_iter()
                .collect();
            self.wait(&h.event, &ranks, op, self.timeout, || h.table.load(Acquire) == 0).map_err(|e| {
                e.unwrap_or_else(|| {
                    let op = format!("{op} (waiting for the communicator table)");
                    Error::timeout(self.rank, op, self.timeout, ranks.clone(), (0..self.size).collect())
                })
            })?;
        }
    }

    /// The communicator slot of this rank's next split of `members` (validated, sorted), binding a
    /// free slot and staging blocks for the members if this rank is the first member here.
    /// Returns (slot, first block).
    pub(crate) fn claim(&self, members: &[usize], op: &str) -> Result<(usize, u32)> {
        let (mask, n) = (members.iter().fold(0u64, |m, &r| m | 1 << r), members.len());
        let occurrence = self.splits.next(members);
        let _locked = self.lock_table(op)?;
        // Slot 0 is the world.
        let bound = (1..MAX_COMMS).find(|&s| {
            let c = self.comm_head(s);
            c.state.load(Acquire) == IN_USE
                && c.members.load(Relaxed) == mask
                && c.occurrence.load(Relaxed) == occurrence
        });
        let slot = match bound {
            Some(slot) => slot,
            None => {
                let slot = (1..MAX_COMMS)
                    .find(|&s| self.comm_head(s).state.load(Acquire) == FREE)
                    .ok_or_else(|| {
                        Error::invalid(format!(
                            "{op}: all {} subgroup slots of this job are in use; drop groups you no longer \
                             use, or create fewer",
                            MAX_COMMS - 1
                        ))
                    })?;
                let first = self.free_blocks(n).map_or(NO_BLOCKS, |b| (self.size + b) as u32);
                // A slot's counters are monotonic over one binding: start it from zero.
                for j in 0..n {
                    let c = self.ctrl(slot, j);
                    for counter in [&c.arrive, &c.done, &c.completed, &c.moved, &c.step, &c.claim] {
                        counter.store(0, Relaxed);
                    }
                    // No core known yet (not the last binding's).
                    c.cpu.store(0, Relaxed);
                }
                let c = self.comm_head(slot);
                c.members.store(mask, Relaxed);
                c.occurrence.store(occurrence, Relaxed);
                c.left.store(0, Relaxed);
                c.first_block.store(first, Relaxed);
                c.state.store(IN_USE, Release);
                slot
            }
        };
        let first = self.comm_head(slot).first_block.load(Relaxed);
        if first == NO_BLOCKS {
            self.leave_locked(slot);
            return Err(no_blocks());
        }
        // Written by a peer: check it before addressing staging with it.
        let blocks = self.size..self.size + self.layout.params.pool;
        if !blocks.contains(&(first as usize)) || first as usize + n > blocks.end {
            return Err(Error::invalid(format!(
                "{op}: communicator slot {slot} names staging blocks outside the segment (corrupted?)"
            )));
        }
        Ok((slot, first))
    }

    /// This rank dropped its handle on `slot`. When the table cannot be locked (the world was
    /// aborted, or its holder died) the slot stays bound: harmless in a world that is going down.
    pub(crate) fn leave(&self, slot: usize) {
        if let Ok(_locked) = self.lock_table("dropping a group") {
            self.leave_locked(slot);
        }
    }

    /// Mark this rank left `slot`; free the slot (and its blocks) once every member has.
    fn leave_locked(&self, slot: usize) {
        let c = self.comm_head(slot);
        let me = 1u64 << self.rank;
        let left = c.left.fetch_or(me, Relaxed) | me;
        let members = c.members.load(Relaxed);
        if left & members == members {
            c.state.store(FREE, Release);
        }
    }

    /// The first of `n` consecutive pool blocks no bound slot uses (pool index), if any.
    fn free_blocks(&self, n: usize) -> Option<usize> {
        let mut used: Vec<(usize, usize)> = (1..MAX_COMMS)
            .map(|s| self.comm_head(s))
            .filter(|c| c.state.load(Acquire) == IN_USE)
            .filter_map(|c| {
                let start = (c.first_block.load(Relaxed) as usize).checked_sub(self.size)?;
                Some((start, start.saturating_add(c.members.load(Relaxed).count_ones() as usize)))
            })
            .collect();
        used.sort_unstable();
        let mut at = 0;
        for (start, end) in used {
            if start >= at + n {
                break;
            }
            at = at.max(end);
        }
        (at + n <= self.layout.params.pool).then_some(at)
    }
}
