//! One process's view of the shared world: the mapped segment (with what only peers write mapped
//! read-only), typed access to its regions, the abort word, liveness and this rank's arena allocator.
//! The communicator table is `table`.

use std::collections::{HashMap, VecDeque};
use std::ops::Range;
use std::sync::atomic::AtomicUsize;
use std::sync::atomic::Ordering::*;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::layout::{ChanHead, CommHead, Ctrl, Header, Layout, FREE, MAX_COMMS, REASON};
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
    pub(super) splits: Mutex<HashMap<u64, u32>>,
    /// Bytes of unexpected point-to-point messages this rank holds (`p2p`).
    pub early_bytes: AtomicUsize,
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

impl Shared {
    /// This rank's view of a joined world. What only peers write (their staging blocks, the cells of
    /// channels they send on) is mapped read-only here; a subgroup's block becomes writable for its
    /// member while it is in the group (`own_block`).
    pub(crate) fn new(j: Joined, rank: usize, timeout: Duration) -> Result<Shared> {
        let (l, map) = (j.layout, j.mapping);
        let size = l.params.world;
        for src in (0..size).filter(|&s| s != rank) {
            for dst in 0..size {
                map.protect(l.cells(src, dst), false)?;
            }
        }
        let blocks = size + l.params.pool;
        map.protect(l.block(0).start..l.block(rank).start, false)?;
        map.protect(l.block(rank).end..l.block(blocks - 1).end, false)?;
        Ok(Shared {
            map,
            layout: l,
            rank,
            size,
            timeout,
            liveness: j.liveness,
            splits: Mutex::new(HashMap::new()),
            early_bytes: AtomicUsize::new(0),
            free: Mutex::new(FreeList::new(l.params.arena)),
            sends: (0..size).map(|_| Mutex::default()).collect(),
            recvs: (0..size).map(|_| Mutex::default()).collect(),
        })
    }

    /// Make staging block `block` writable (this rank is now its member) or read-only again.
    pub(crate) fn own_block(&self, block: usize, writable: bool) -> Result<()> {
        self.map.protect(self.layout.block(block), writable)
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
        unsafe { self.map.base().add(self.layout.block(block).start) }
    }

    /// The channel from `src` to `dst`: its control lines and its two cells.
    pub(crate) fn chan(&self, src: usize, dst: usize) -> (&ChanHead, *mut u8) {
        // SAFETY: inside the channel region of the validated layout.
        (self.at(self.layout.chan(src, dst)), unsafe {
            self.map.base().add(self.layout.cells(src, dst).start)
        })
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

    /// The local address of `bytes` at offset `off` of `rank`'s arena, aligned to `align` (the
    /// element size), or what is wrong with the offset (offsets come from peers: never trust them).
    pub(crate) fn resolve(
        &self,
        rank: usize,
        off: u64,
        bytes: usize,
        align: usize,
    ) -> std::result::Result<*mut u8, String> {
        let arena = self.arena(rank);
        let inside = usize::try_from(off)
            .ok()
            .filter(|&o| o >= arena.start && o.checked_add(bytes).is_some_and(|e| e <= arena.end));
        let Some(off) = inside else {
            return Err(format!(
                "rank {rank} published a buffer of {bytes} bytes at offset {off}, outside its arena {arena:?}"
            ));
        };
        if off % align != 0 {
            return Err(format!(
                "rank {rank} published a buffer at offset {off}, not aligned to its {align}-byte elements"
            ));
        }
        // SAFETY: bounds-checked against the arena, which lies inside the mapping.
        Ok(unsafe { self.map.base().add(off) })
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
