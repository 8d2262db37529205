//! The layout of the job's shared-memory segment, and the structs that live in it.
//!
//! ```text
//! header page   magic, version, layout params, nonce, abort word, per-rank pids
//! comm table    MAX_COMMS slots: key (members, occurrence), event, one control block (`Ctrl`) per
//!               world rank
//! channels      one send/recv channel per ordered pair of ranks: control lines + 2 cells
//! staging       one block per (communicator, member): 2 one-shot buffers + 2 pipeline buffers
//! arenas        one per rank: memory handed out by `alloc` (segment arrays)
//! ```
//! Everything is offsets from the segment start (peers map it at other addresses), and every rank
//! recomputes the layout from the header's parameters and checks it against the file size before use.
//! A channel's cells and every staging block start on a page and span whole pages, so each rank can
//! map the ones only a peer writes read-only (`world`).

use std::cell::UnsafeCell;
use std::mem::size_of;
use std::ops::Range;
use std::sync::atomic::{AtomicU32, AtomicU64};

use crossbeam_utils::CachePadded;

use crate::config::{SHM_CELL, SHM_CHUNK, SHM_ONESHOT};
use crate::engine::{Ctrl, Page};
use crate::error::{Error, Result};
use crate::sync::wait::Event;

/// The segment header's first word: "AXONSHM" + format generation, little endian.
pub const MAGIC: u64 = u64::from_le_bytes(*b"AXONSHM1");
/// The segment format's version, bumped whenever the layout or protocol changes.
pub const VERSION: u32 = 6;
/// Ranks per world: group membership is a 64-bit mask.
pub const MAX_RANKS: usize = 64;
/// Communicators alive at once per job (the world plus subgroups; a slot is freed once every member
/// has dropped its group).
pub(crate) const MAX_COMMS: usize = 32;
/// Bytes of an abort reason kept in the header.
pub(crate) const REASON: usize = 448;
pub(crate) const PAGE: usize = 4096;

/// The sizes that determine the layout. Chosen by rank 0, stored in the header, checked by everyone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Params {
    /// Ranks in the world.
    pub world: usize,
    /// Bytes per pipeline round of a staged collective (one buffer; two per member).
    pub chunk: usize,
    /// Largest all_reduce sent one-shot (one buffer; two per member).
    pub small: usize,
    /// Bytes of each rank's arena for segment arrays.
    pub arena: usize,
    /// Bytes per send/recv cell (two per ordered pair of ranks).
    pub cell: usize,
    /// Staging blocks for subgroups, handed out as slots are claimed.
    pub pool: usize,
}

impl Params {
    /// Defaults for `world` ranks, with `arena` bytes of segment arrays per rank. Staging grows with
    /// the world (a block per member and communicator, a channel per pair), so large worlds get
    /// smaller buffers to keep the segment within a few hundred MiB.
    pub(crate) fn new(world: usize, arena: usize) -> Params {
        let large = world > 8;
        Params {
            world,
            chunk: if large { (world * 4096).max(SHM_CHUNK / 4) } else { SHM_CHUNK },
            small: if large { SHM_ONESHOT / 4 } else { SHM_ONESHOT },
            // Saturating: an absurd request stays absurd (and `check` refuses it) instead of wrapping.
            arena: arena.checked_next_multiple_of(PAGE).unwrap_or(usize::MAX),
            cell: if large { SHM_CELL / 8 } else { SHM_CELL },
            // Room for several subgroups alive at once (torch users create them freely), each member
            // taking a block; freed when every member dropped its group.
            pool: if large { world } else { (4 * world).max(16) },
        }
    }

    fn check(&self) -> std::result::Result<(), String> {
        let pow2_pages = |x: usize| x >= PAGE && x.is_multiple_of(PAGE);
        if !(1..=MAX_RANKS).contains(&self.world) {
            return Err(format!("world size {} (1..={MAX_RANKS})", self.world));
        }
        if !pow2_pages(self.chunk) || self.chunk > 256 << 20 || self.chunk / self.world < 4096 {
            return Err(format!("pipeline chunk {} bytes", self.chunk));
        }
        if !pow2_pages(self.small) || self.small > self.chunk {
            return Err(format!("one-shot buffer {} bytes", self.small));
        }
        if !pow2_pages(self.cell) || self.cell > 64 << 20 {
            return Err(format!("send/recv cell {} bytes", self.cell));
        }
        if !self.arena.is_multiple_of(PAGE) || self.arena > 1 << 40 || self.pool > 4096 {
            return Err(format!("arena {} / pool {}", self.arena, self.pool));
        }
        Ok(())
    }
}

/// Fails unless `rank` can be a rank of a world of `world` ranks.
pub(crate) fn check_member(rank: usize, world: usize) -> Result<()> {
    if world == 0 || world > MAX_RANKS {
        return Err(Error::invalid(format!("world_size must be 1..={MAX_RANKS}, got {world}")));
    }
    if rank >= world {
        return Err(Error::invalid(format!("rank {rank} is out of range for a world of {world} ranks")));
    }
    Ok(())
}

/// Where everything is, in bytes from the segment start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Layout {
    pub params: Params,
    pub comms: usize,
    pub comm_stride: usize,
    pub chans: usize,
    pub chan_stride: usize,
    pub staging: usize,
    pub block: usize,
    pub arenas: usize,
    pub total: usize,
}

fn up(x: usize, to: usize) -> usize {
    x.div_ceil(to) * to
}

impl Layout {
    /// The layout for `params`, or why they are unusable.
    pub(crate) fn new(params: Params) -> std::result::Result<Layout, String> {
        params.check()?;
        let w = params.world;
        let comms = up(size_of::<Header>(), PAGE);
        let comm_stride = up(size_of::<CommHead>() + w * size_of::<Ctrl>(), 128);
        let chans = up(comms + MAX_COMMS * comm_stride, PAGE);
        let chan_stride = up(size_of::<ChanHead>(), PAGE) + 2 * params.cell;
        let staging = chans + w * w * chan_stride;
        let block = 2 * params.small + 2 * params.chunk;
        let arenas = staging + (w + params.pool) * block;
        let total = arenas + w * params.arena;
        Ok(Layout { params, comms, comm_stride, chans, chan_stride, staging, block, arenas, total })
    }

    /// [`Layout::new`] for a segment this rank creates: unusable parameters are the caller's error.
    pub(crate) fn checked(params: Params) -> Result<Layout> {
        Layout::new(params)
            .map_err(|p| Error::invalid(format!("unusable shared-memory layout parameter: {p}")))
    }

    /// Offset of the control lines of the channel from `src` to `dst`.
    pub(crate) fn chan(&self, src: usize, dst: usize) -> usize {
        self.chans + (src * self.params.world + dst) * self.chan_stride
    }

    /// Byte range of the two cells of the channel from `src` to `dst` (whole pages: only `src`
    /// writes them).
    pub(crate) fn cells(&self, src: usize, dst: usize) -> Range<usize> {
        let end = self.chan(src, dst) + self.chan_stride;
        end - 2 * self.params.cell..end
    }

    /// Byte range of staging block `b` (whole pages: only its member writes it).
    pub(crate) fn block(&self, b: usize) -> Range<usize> {
        let start = self.staging + b * self.block;
        start..start + self.block
    }

    /// A number that changes whenever the shape of the shared structs does, so two builds that
    /// disagree on them refuse each other's segments.
    pub(crate) fn shape_hash() -> u64 {
        [
            size_of::<Header>(),
            size_of::<CommHead>(),
            size_of::<Ctrl>(),
            size_of::<ChanHead>(),
            size_of::<Page>(),
        ]
        .iter()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, &s| (h ^ s as u64).wrapping_mul(0x100_0000_01b3))
    }
}

/// The first bytes of the segment. Fields above `attached` are written once by the creator before
/// anyone else can open the segment; the rest are atomics (or, for the abort reason, written once by
/// the rank that wins the abort, before it publishes `abort_state = 2`).
#[repr(C)]
pub(crate) struct Header {
    pub magic: u64,
    pub version: u32,
    pub world: u32,
    pub uid: u32,
    pub creator: u32,
    pub nonce: [u8; 16],
    pub total: u64,
    pub shape: u64,
    pub chunk: u64,
    pub small: u64,
    pub arena: u64,
    pub cell: u64,
    pub pool: u64,
    /// Ranks that have attached (the creator counts).
    pub attached: AtomicU32,
    /// 0: running; 1: an abort is being recorded; 2: aborted (reason readable).
    pub abort_state: AtomicU32,
    pub abort_by: AtomicU32,
    /// The dead peer when the abort reports one, else `u32::MAX`.
    pub abort_peer: AtomicU32,
    pub abort_len: AtomicU32,
    /// The lock of the comm table and the staging pool: 0, or 1 + the rank holding it (`world`).
    pub table: AtomicU32,
    /// When a timeout aborted the world: the ranks that never arrived (bitmask), else 0.
    pub abort_missing: AtomicU64,
    pub abort_reason: UnsafeCell<[u8; REASON]>,
    pub event: Event,
    pub pids: [AtomicU32; MAX_RANKS],
    /// Where each rank's process holds `algo::process_vm::PROBE` (an address in that process).
    pub probes: [AtomicU64; MAX_RANKS],
    /// Bumped for rank r whenever a message to it starts on any channel: what a receive from any
    /// source sleeps on (`p2p`).
    pub inbox: [Event; MAX_RANKS],
}

impl Header {
    /// Write what the creator writes once, before anyone else can open the segment, into a zeroed
    /// header.
    pub(crate) fn init(&mut self, layout: &Layout, nonce: [u8; 16]) {
        self.magic = MAGIC;
        self.version = VERSION;
        self.world = layout.params.world as u32;
        self.uid = rustix::process::geteuid().as_raw();
        self.creator = rustix::process::getpid().as_raw_nonzero().get() as u32;
        self.nonce = nonce;
        self.total = layout.total as u64;
        self.shape = Layout::shape_hash();
        self.chunk = layout.params.chunk as u64;
        self.small = layout.params.small as u64;
        self.arena = layout.params.arena as u64;
        self.cell = layout.params.cell as u64;
        self.pool = layout.params.pool as u64;
        self.abort_peer.store(u32::MAX, std::sync::atomic::Ordering::Relaxed);
    }

    /// A header of zeros, off the segment (for tests, and for reading one from bytes).
    #[cfg(any(test, feature = "fuzzing"))]
    pub(crate) fn zeroed() -> Box<Header> {
        // SAFETY: every bit pattern, zeros included, is a valid Header (integers, atomics, byte arrays).
        Box::new(unsafe { std::mem::zeroed() })
    }
}

/// `CommHead::state` of a slot no communicator uses.
pub(crate) const FREE: u32 = 0;
/// `CommHead::state` of a slot bound to a communicator.
pub(crate) const IN_USE: u32 = 2;

/// A communicator slot: free, or bound to (members, occurrence). Changed only under the table lock.
#[repr(C)]
pub(crate) struct CommHead {
    /// [`FREE`] or [`IN_USE`].
    pub state: AtomicU32,
    pub occurrence: AtomicU32,
    pub members: AtomicU64,
    /// Members that dropped their group (bitmask): once it equals `members`, the slot is free again.
    pub left: AtomicU64,
    /// First staging block of its members (block + group index), or `u32::MAX` when none was left.
    pub first_block: AtomicU32,
    pub event: Event,
}

/// A buffer that does not live in the segment.
pub(crate) const NOT_SHARED: u64 = u64::MAX;

/// The control lines of one ordered pair's channel (see `p2p`): chunks move through the two cells
/// that follow; each message's header travels at the front of its first chunk.
#[repr(C)]
pub(crate) struct ChanHead {
    /// `m << 1 | refused` for the receiver's answer to message m.
    pub answer: CachePadded<AtomicU64>,
    pub filled: CachePadded<AtomicU64>,
    pub drained: CachePadded<AtomicU64>,
    pub event: Event,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_regions_are_ordered_aligned_and_disjoint() {
        for w in [1, 2, 3, 4, 8, 64] {
            let l = Layout::new(Params::new(w, 3 << 20)).unwrap();
            assert!(size_of::<Header>() <= l.comms);
            assert!(l.comms + MAX_COMMS * l.comm_stride <= l.chans);
            assert!(l.chans + w * w * l.chan_stride <= l.staging);
            assert_eq!(l.staging + (w + l.params.pool) * l.block, l.arenas);
            assert_eq!(l.arenas + w * l.params.arena, l.total);
            for off in [l.comms, l.chans, l.chan_stride, l.staging, l.block, l.arenas, l.total] {
                assert_eq!(off % PAGE, 0, "w={w}");
            }
            assert_eq!(l.comm_stride % 128, 0);
            for (src, dst) in [(0, 0), (w - 1, 0), (0, w - 1), (w - 1, w - 1)] {
                let c = l.cells(src, dst);
                assert!(
                    c.start.is_multiple_of(PAGE)
                        && c.len() == 2 * l.params.cell
                        && c.start > l.chan(src, dst)
                );
                assert!(c.end <= l.staging);
            }
            let last = l.block(w + l.params.pool - 1);
            assert_eq!((l.block(0).start, last.end, last.start % PAGE), (l.staging, l.arenas, 0));
        }
    }

    #[test]
    fn bad_params_are_refused() {
        assert!(Layout::new(Params::new(0, 0)).is_err());
        assert!(Layout::new(Params::new(MAX_RANKS + 1, 0)).is_err());
        let mut p = Params::new(2, 0);
        p.chunk = 1000;
        assert!(Layout::new(p).is_err());
        let mut p = Params::new(2, 0);
        p.small = p.chunk * 2;
        assert!(Layout::new(p).is_err());
        assert!(
            Layout::new(Params::new(2, usize::MAX)).is_err(),
            "a huge arena must not wrap to a small one"
        );
        assert!(Layout::new(Params::new(2, usize::MAX - 4000)).is_err());
    }
}
