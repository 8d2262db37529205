//! This rank's arena: segment memory handed out by `alloc` (segment arrays), and the bounds checks
//! that turn a peer's published offsets into addresses.

use std::any::Any;
use std::ops::Range;
use std::ptr::NonNull;
use std::sync::Arc;

use super::shared::Shared;
use crate::backend::SharedMem;
use crate::sync::lock;

impl Shared {
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
    fn alloc(&self, bytes: usize) -> Option<usize> {
        let start = lock(&self.free).take(bytes)?;
        Some(self.arena(self.rank).start + start)
    }

    /// Give back a range from [`Shared::alloc`].
    fn release(&self, off: usize, bytes: usize) {
        lock(&self.free).give(off - self.arena(self.rank).start, bytes);
    }

    /// `bytes` of this rank's arena as memory every member can address, returned when dropped.
    pub(crate) fn shared_mem(self: &Arc<Self>, bytes: usize) -> Option<SharedMem> {
        let off = self.alloc(bytes)?;
        // SAFETY: `off` starts `bytes` (rounded up) inside this rank's arena, within the mapping.
        let ptr = unsafe { self.map.base().add(off) };
        let lease = Lease { world: self.clone(), off, bytes };
        let owner: Box<dyn Any + Send + Sync> = Box::new(lease);
        // SAFETY: the range is this allocation's alone until the lease returns it, and the lease keeps
        // the mapping alive (it holds the world).
        Some(unsafe { SharedMem::new(NonNull::new(ptr).expect("inside a mapping"), bytes, owner) })
    }
}

/// Returns a segment range to this rank's arena when the array using it is dropped.
struct Lease {
    world: Arc<Shared>,
    off: usize,
    bytes: usize,
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.world.release(self.off, self.bytes);
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
