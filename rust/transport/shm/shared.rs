//! One process's view of the shared-memory world: the mapped segment (with what only peers write
//! mapped read-only) and typed access to its regions. The abort word and liveness are `abort`, this
//! rank's arena `arena`, the communicator table `comms`.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::AtomicUsize;
use std::sync::atomic::Ordering::SeqCst;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use super::arena::FreeList;
use super::join::Joined;
use super::layout::{ChanHead, CommHead, Header, Layout};
use super::liveness::Liveness;
use super::segment::Mapping;
use crate::algo::route::Policy;
use crate::dtype::DType;
use crate::engine::{Ctrl, Splits};
use crate::error::Result;

/// Counters of one direction of a point-to-point channel, kept by the side that owns it.
#[derive(Default)]
pub(crate) struct ChanState {
    pub msgs: u64,
    pub chunks: u64,
    /// Receive side: messages taken off the channel before a recv asked for their tag, per tag in
    /// arrival order: (dtype, count, bytes).
    pub early: HashMap<u64, VecDeque<(DType, u64, Vec<u8>)>>,
}

/// The shared-memory world as one rank's process sees it, shared by all of this rank's handles.
pub(crate) struct Shared {
    pub map: Mapping,
    pub layout: Layout,
    pub rank: usize,
    pub size: usize,
    pub timeout: Duration,
    pub(super) liveness: Liveness,
    /// This rank's splits of each rank set (the n-th split of a set is one communicator).
    pub(super) splits: Splits,
    /// Bytes of unexpected point-to-point messages this rank holds (`p2p`).
    pub early_bytes: AtomicUsize,
    /// Free ranges of this rank's arena.
    pub(super) free: Mutex<FreeList>,
    /// Per peer: this rank's send side and receive side of the channels with it.
    pub sends: Vec<Mutex<ChanState>>,
    pub recvs: Vec<Mutex<ChanState>>,
    /// When this process lets peers copy straight to and from its memory (`algo::cma`): probed on
    /// first need, `Never` when the environment forbids it or a peer cannot be reached.
    cma: OnceLock<Policy>,
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
            splits: Splits::default(),
            early_bytes: AtomicUsize::new(0),
            free: Mutex::new(FreeList::new(l.params.arena)),
            sends: (0..size).map(|_| Mutex::default()).collect(),
            recvs: (0..size).map(|_| Mutex::default()).collect(),
            cma: OnceLock::new(),
        })
    }

    /// When this rank copies straight between its memory and every peer's (`algo::route::Policy`). Each
    /// rank decides for itself and says so in what it publishes, so the members of a call agree on the
    /// route.
    pub(crate) fn cma(&self) -> Policy {
        *self.cma.get_or_init(|| {
            let h = self.header();
            let policy = Policy::from_env();
            let reach = |r: usize| {
                let (pid, addr) = (self.liveness.pid(r), h.probes[r].load(SeqCst));
                i32::try_from(pid).is_ok_and(|pid| crate::algo::process_vm::probe(pid, addr as usize))
            };
            if policy == Policy::Never || !(0..self.size).filter(|&r| r != self.rank).all(reach) {
                Policy::Never
            } else {
                policy
            }
        })
    }

    /// The pid of `rank`'s process.
    pub(crate) fn pid(&self, rank: usize) -> u32 {
        self.liveness.pid(rank)
    }

    /// Make staging block `block` writable (this rank is now its member) or read-only again.
    pub(crate) fn own_block(&self, block: usize, writable: bool) -> Result<()> {
        self.map.protect(self.layout.block(block), writable)
    }

    pub(crate) fn header(&self) -> &Header {
        self.map.header()
    }

    pub(super) fn at<T>(&self, off: usize) -> &T {
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

    /// The staging block `block` (see the layout): two one-shot buffers, then two pipeline buffers.
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
}
