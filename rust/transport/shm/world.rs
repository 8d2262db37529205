//! One process's view of the shared world: the mapped segment, typed access to its regions, the abort
//! word, liveness, the communicator table and this rank's arena allocator.

use std::collections::{HashMap, VecDeque};
use std::ops::Range;
use std::sync::atomic::Ordering::*;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::layout::{ChanHead, CommHead, Ctrl, Header, Layout, MAX_COMMS, REASON};
use super::liveness::Liveness;
use super::rendezvous::Joined;
use super::segment::Mapping;
use crate::error::{Error, Result};
use crate::transport::wait::{may_spin, Event, Stop, Wait};

/// Counters of one direction of a point-to-point channel, kept by the side that owns it.
#[derive(Default)]
pub(crate) struct ChanState {
    pub msgs: u64,
    pub chunks: u64,
    /// Receive side: messages taken off the channel before a recv asked for their tag, per tag in
    /// arrival order: (dtype code, count, bytes).
    pub early: HashMap<u64, VecDeque<(u64, u64, Vec<u8>)>>,
}

pub(crate) struct Shared {
    pub map: Mapping,
    pub layout: Layout,
    pub rank: usize,
    pub size: usize,
    pub timeout: Duration,
    liveness: Liveness,
    /// How many times this rank has split each rank set (the n-th split of a set is one communicator).
    splits: Mutex<HashMap<u64, u32>>,
    /// Free ranges of this rank's arena.
    free: Mutex<FreeList>,
    /// Per peer: this rank's send side and receive side of the channels with it.
    pub sends: Vec<Mutex<ChanState>>,
    pub recvs: Vec<Mutex<ChanState>>,
}

/// Lock ignoring poisoning: the guarded counters stay consistent across a panic in a copy.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Why the world is being aborted, as far as the other ranks need to know.
pub(crate) enum Cause<'a> {
    /// An error on the aborting rank, or an explicit abort.
    Other,
    /// This rank's process died.
    Dead(usize),
    /// These ranks never arrived before the deadline.
    Missing(&'a [usize]),
}

const FREE: u32 = 0;
const CLAIMING: u32 = 1;
const READY: u32 = 2;
/// A slot whose members got no staging blocks.
pub(crate) const NO_BLOCKS: u32 = u32::MAX;

impl Shared {
    pub(crate) fn new(j: Joined, rank: usize, timeout: Duration) -> Shared {
        let size = j.layout.params.world;
        let arena = j.layout.params.arena;
        Shared {
            map: j.mapping,
            layout: j.layout,
            rank,
            size,
            timeout,
            liveness: j.liveness,
            splits: Mutex::new(HashMap::new()),
            free: Mutex::new(FreeList::new(arena)),
            sends: (0..size).map(|_| Mutex::default()).collect(),
            recvs: (0..size).map(|_| Mutex::default()).collect(),
        }
    }

    pub(crate) fn header(&self) -> &Header {
        self.map.header()
    }

    fn at<T>(&self, off: usize) -> &T {
        debug_assert!(off + std::mem::size_of::<T>() <= self.map.len());
        // SAFETY: callers pass offsets from the validated layout, which lie inside the mapping and are
        // aligned for T (regions are page or 128-byte aligned, and the structs are repr(C)).
        unsafe { &*self.map.base().add(off).cast::<T>() }
    }

    pub(crate) fn comm_head(&self, slot: usize) -> &CommHead {
        self.at(self.layout.comms + slot * self.layout.comm_stride)
    }

    pub(crate) fn ctrl(&self, slot: usize, index: usize) -> &Ctrl {
        let first = self.layout.comms + slot * self.layout.comm_stride + std::mem::size_of::<CommHead>();
        self.at(first.next_multiple_of(128) + index * std::mem::size_of::<Ctrl>())
    }

    /// The staging block `block` (see the layout): two one-shot slots, then two pipeline buffers.
    pub(crate) fn block(&self, block: usize) -> *mut u8 {
        // SAFETY: block < world + pool (checked when blocks are handed out), inside the staging region.
        unsafe { self.map.base().add(self.layout.staging + block * self.layout.block) }
    }

    /// The channel from `src` to `dst`: its control lines and its two cells.
    pub(crate) fn chan(&self, src: usize, dst: usize) -> (&ChanHead, *mut u8) {
        let off = self.layout.chans + (src * self.size + dst) * self.layout.chan_stride;
        let cells = self.layout.chan_stride - 2 * self.layout.params.cell;
        // SAFETY: inside the channel region of the validated layout.
        (self.at(off), unsafe { self.map.base().add(off + cells) })
    }

    /// Byte range of `rank`'s arena in the segment.
    pub(crate) fn arena(&self, rank: usize) -> Range<usize> {
        let a = self.layout.params.arena;
        let start = self.layout.arenas + rank * a;
        start..start + a
    }

    /// The segment offset of `bytes` at `ptr` when they lie inside this rank's arena.
    pub(crate) fn offset_of(&self, ptr: *const u8, bytes: usize) -> Option<u64> {
        let addr = (ptr as usize).checked_sub(self.map.base() as usize)?;
        let mine = self.arena(self.rank);
        (bytes > 0 && addr >= mine.start && addr.checked_add(bytes)? <= mine.end).then_some(addr as u64)
    }

    /// The local address of `bytes` at offset `off` of `rank`'s arena, or `None` if out of bounds
    /// (offsets come from peers: never trust them).
    pub(crate) fn resolve(&self, rank: usize, off: u64, bytes: usize) -> Option<*mut u8> {
        let off = usize::try_from(off).ok()?;
        let arena = self.arena(rank);
        (off >= arena.start && off.checked_add(bytes)? <= arena.end)
            // SAFETY: bounds-checked against the arena, which lies inside the mapping.
            .then(|| unsafe { self.map.base().add(off) })
    }

    /// Take `bytes` from this rank's arena: an offset into the segment.
    pub(crate) fn alloc(&self, bytes: usize) -> Option<usize> {
        let start = lock(&self.free).take(bytes)?;
        Some(self.arena(self.rank).start + start)
    }

    /// Give back a range from [`Shared::alloc`].
    pub(crate) fn release(&self, off: usize, bytes: usize) {
        lock(&self.free).give(off - self.arena(self.rank).start, bytes);
    }

    /// Fails when the world was aborted: a dead peer or missing ranks are reported as such to every
    /// rank waiting in a collective (`waiting`: the members it waits for); otherwise who aborted and why.
    pub(crate) fn check_abort(&self, op: &str, waiting: Option<&[usize]>) -> Result<()> {
        let h = self.header();
        if h.abort_state.load(Acquire) == 0 {
            return Ok(());
        }
        // The aborting rank writes its reason between states 1 and 2: a few stores. If it died right
        // there, report what is known after a short grace.
        let start = Instant::now();
        while h.abort_state.load(Acquire) != 2 && start.elapsed() < Duration::from_millis(20) {
            std::thread::yield_now();
        }
        let by = h.abort_by.load(Acquire) as usize;
        let peer = h.abort_peer.load(Acquire);
        let missing = h.abort_missing.load(Acquire);
        let len = (h.abort_len.load(Acquire) as usize).min(REASON);
        // SAFETY: the reason is written once, before state 2 (acquired above); a torn read of a dead
        // writer's bytes is only a garbled message.
        let bytes = unsafe { std::ptr::read_volatile(h.abort_reason.get()) };
        let reason = String::from_utf8_lossy(&bytes[..len]).into_owned();
        if peer != u32::MAX {
            return Err(Error::PeerDied { peer: peer as usize, op: op.to_string(), detail: Some(reason) });
        }
        match waiting {
            Some(group) if missing != 0 => Err(Error::Timeout {
                rank: self.rank,
                op: op.to_string(),
                waited: self.timeout,
                missing: (0..self.size).filter(|r| missing >> r & 1 == 1).collect(),
                group: group.to_vec(),
                progress: String::new(),
            }),
            _ => Err(Error::Aborted { by, reason }),
        }
    }

    /// Abort the world on behalf of this rank (the first abort wins) and wake every waiter.
    pub(crate) fn abort(&self, reason: &str, cause: Cause) {
        let h = self.header();
        if h.abort_state.compare_exchange(0, 1, SeqCst, SeqCst).is_ok() {
            let bytes = reason.as_bytes();
            let len = bytes.len().min(REASON);
            // SAFETY: only the CAS winner writes the reason, once, before publishing state 2.
            unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), h.abort_reason.get().cast::<u8>(), len) };
            h.abort_by.store(self.rank as u32, Relaxed);
            if let Cause::Dead(peer) = cause {
                h.abort_peer.store(peer as u32, Relaxed);
            }
            if let Cause::Missing(ranks) = cause {
                h.abort_missing.store(ranks.iter().fold(0, |m, r| m | 1 << r), Relaxed);
            }
            h.abort_len.store(len as u32, Relaxed);
            h.abort_state.store(2, Release);
        }
        h.event.notify(true);
        for slot in 0..MAX_COMMS {
            let c = self.comm_head(slot);
            if c.state.load(Acquire) != FREE {
                c.event.notify(true);
            }
        }
        for src in 0..self.size {
            for dst in 0..self.size {
                self.chan(src, dst).0.event.notify(true);
            }
        }
    }

    /// Fails (and aborts the world) when one of `ranks` has died.
    pub(crate) fn check_alive(&self, ranks: &[usize], op: &str) -> Result<()> {
        match self.liveness.first_dead(ranks) {
            None => Ok(()),
            Some((peer, pid)) => {
                let detail = format!("rank {peer} (pid {pid}) exited during {op}");
                self.abort(&detail, Cause::Dead(peer));
                Err(Error::PeerDied { peer, op: op.to_string(), detail: Some(format!("pid {pid} exited")) })
            }
        }
    }

    /// Wait on `event` until `ready`, checking abort and the liveness of `ranks`. `Err(None)` means
    /// the deadline passed.
    pub(crate) fn wait(
        &self,
        event: &Event,
        ranks: &[usize],
        op: &str,
        ready: impl FnMut() -> bool,
    ) -> std::result::Result<(), Option<Error>> {
        let w = Wait {
            event,
            shared: true,
            // Every rank of the world is a process on this host competing for its cores.
            spin: may_spin(self.size),
            deadline: Instant::now() + self.timeout,
            op,
        };
        match w.until(ready, || self.check_abort(op, Some(ranks)), || self.check_alive(ranks, op)) {
            Ok(()) => Ok(()),
            Err(Stop::Failed(e)) => Err(Some(e)),
            Err(Stop::TimedOut) => Err(None),
        }
    }

    /// The communicator slot for the `occurrence`-th split of `members` (a bitmask), claiming a free
    /// slot (and staging blocks for its `n` members) if no member has yet. Returns (slot, first block).
    pub(crate) fn claim(&self, mask: u64, n: usize, op: &str) -> Result<(usize, u32)> {
        let occurrence = {
            let mut s = lock(&self.splits);
            let c = s.entry(mask).or_insert(0);
            *c += 1;
            *c
        };
        // Slot 0 is the world. Slots are claimed lowest-first and never freed, so every member scanning
        // for the same key either finds it or claims the same first free slot (module docs of `shm`).
        for slot in 1..MAX_COMMS {
            let c = self.comm_head(slot);
            if c.state.compare_exchange(FREE, CLAIMING, AcqRel, Acquire).is_ok() {
                c.members.store(mask, Relaxed);
                c.occurrence.store(occurrence, Relaxed);
                let pool = self.layout.params.pool as u32;
                let first = self.header().pool_next.fetch_add(n as u32, AcqRel);
                let first = if first + n as u32 <= pool { self.size as u32 + first } else { NO_BLOCKS };
                c.first_block.store(first, Relaxed);
                c.state.store(READY, Release);
                self.header().event.notify(true);
                if first == NO_BLOCKS {
                    return Err(no_blocks());
                }
                return Ok((slot, first));
            }
            let members: Vec<usize> = (0..self.size).filter(|r| mask >> r & 1 == 1).collect();
            let ready = || c.state.load(Acquire) == READY;
            if let Err(e) = self.wait(&self.header().event, &members, op, ready) {
                return Err(e.unwrap_or_else(|| Error::Timeout {
                    rank: self.rank,
                    op: op.to_string(),
                    waited: self.timeout,
                    missing: vec![],
                    group: members,
                    progress: String::new(),
                }));
            }
            if c.members.load(Relaxed) == mask && c.occurrence.load(Relaxed) == occurrence {
                let first = c.first_block.load(Relaxed);
                if first == NO_BLOCKS {
                    return Err(no_blocks());
                }
                // Written by a peer: check it before addressing staging with it.
                if (first as usize).checked_add(n).is_none_or(|end| end > self.size + self.layout.params.pool)
                {
                    return Err(Error::invalid(format!(
                        "{op}: communicator slot {slot} names staging blocks outside the segment (corrupted?)"
                    )));
                }
                return Ok((slot, first));
            }
        }
        Err(Error::invalid(format!(
            "{op}: all {MAX_COMMS} communicator slots of this job are in use; create fewer groups"
        )))
    }
}

fn no_blocks() -> Error {
    Error::invalid(
        "new_group: the job's shared segment has no staging space left for another subgroup; \
         create fewer groups",
    )
}

/// First-fit allocator over an arena of `len` bytes: free ranges sorted by offset and coalesced, so
/// large arrays fit again once the small ones around them are dropped. Sizes round up to 64 bytes,
/// which keeps every allocation cache-line aligned.
#[derive(Debug)]
pub(crate) struct FreeList(Vec<Range<usize>>);

impl FreeList {
    pub(crate) fn new(len: usize) -> FreeList {
        FreeList(std::iter::once(0..len).filter(|r| !r.is_empty()).collect())
    }

    fn size(bytes: usize) -> Option<usize> {
        Some(bytes.checked_next_multiple_of(64)?.max(64))
    }

    /// The start of `bytes` of free space, now taken.
    pub(crate) fn take(&mut self, bytes: usize) -> Option<usize> {
        let want = Self::size(bytes)?;
        let i = self.0.iter().position(|r| r.len() >= want)?;
        let start = self.0[i].start;
        self.0[i].start += want;
        if self.0[i].is_empty() {
            self.0.remove(i);
        }
        Some(start)
    }

    /// Return what [`FreeList::take`] gave for `bytes` at `start`.
    pub(crate) fn give(&mut self, start: usize, bytes: usize) {
        let Some(len) = Self::size(bytes) else { return };
        let free = &mut self.0;
        let i = free.partition_point(|r| r.start < start);
        free.insert(i, start..start + len);
        if i + 1 < free.len() && free[i].end == free[i + 1].start {
            free[i].end = free.remove(i + 1).end;
        }
        if i > 0 && free[i - 1].end == free[i].start {
            free[i - 1].end = free.remove(i).end;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::FreeList;

    #[test]
    fn the_arena_allocator_reuses_and_coalesces_freed_space() {
        let mut f = FreeList::new(1024);
        let a = f.take(100).unwrap();
        let b = f.take(64).unwrap();
        let c = f.take(1).unwrap();
        assert_eq!((a, b, c), (0, 128, 192));
        assert_eq!(f.take(1024), None, "full");
        f.give(b, 64);
        assert_eq!(f.take(65), Some(256), "a freed 64-byte hole does not fit 128");
        assert_eq!(f.take(64), Some(128), "but fits 64");
        f.give(128, 64);
        f.give(a, 100);
        f.give(c, 1);
        f.give(256, 65);
        assert_eq!(f.0, vec![0..1024], "everything coalesced");
        assert_eq!(f.take(1024), Some(0));
        assert_eq!(FreeList::new(0).take(1), None);
        assert_eq!(FreeList::new(4096).take(usize::MAX), None);
    }
}
