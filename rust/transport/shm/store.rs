//! The shared-memory world's engine store: one rank's view of one communicator slot of the segment.
//! Buffers are published as segment offsets, or, for private buffers, as the member's address with
//! what it offers for it (`algo::route::offer`) in the tag bits [`PRIVATE`] and [`CROSS`]; the store
//! reads them back as places (`algo::route::Place`), from which `algo::route::choose` takes the route:
//! peers' arrays in place, copies straight between the processes (`algo::cma`), or staging through
//! the members' blocks.

use std::fmt;
use std::sync::atomic::Ordering::*;
use std::sync::Arc;
use std::time::Duration;

use super::layout::NOT_SHARED;
use super::shared::Shared;
use crate::algo::process_vm::Loc;
use crate::algo::route::{self, Offer, Place, Staging};
use crate::algo::route_times::RouteTimes;
use crate::backend::SharedMem;
use crate::dtype::{Buf, BufMut};
use crate::engine::{Cause, Ctrl, Published, Store};
use crate::error::{Error, Result};
use crate::signature::Signature;
use crate::sync::wait::Wait;

/// A buffer the collective does not have on this member (gather's receive buffer off the root, ...).
const NO_BUFFER: u64 = NOT_SHARED - 1;
/// Tags a published private buffer: the rest is its address in the publisher's process, which lets
/// peers copy from and to it (`algo::cma`). Below it, published values are segment offsets.
pub(super) const PRIVATE: u64 = 1 << 62;
/// Tags a published private buffer whose member asks the call to cross (`route::Offer::Cross`); no
/// address has this bit, nor any above it.
pub(super) const CROSS: u64 = 1 << 61;

/// One rank's view of one communicator (slot `slot` of the segment's table).
pub(crate) struct ShmStore {
    world: Arc<Shared>,
    slot: usize,
    members: Vec<usize>,
    index: usize,
    first_block: usize,
    /// What each route took lately for this communicator's calls (`algo::route_times`): per
    /// communicator, so that every member counts the same calls.
    routes: RouteTimes,
    /// How long waits on this communicator last (`Store::timeout`).
    timeout: Duration,
}

impl Drop for ShmStore {
    /// A subgroup's handle gives back its share of the slot (freed once every member has).
    fn drop(&mut self) {
        if self.slot != 0 {
            // The block may be a peer's in the next group that gets it: read-only again first.
            let _ = self.world.own_block(self.first_block + self.index, false);
            self.world.leave(self.slot);
        }
    }
}

impl ShmStore {
    /// This rank's view of the world's own communicator (slot 0).
    pub(crate) fn world(world: Arc<Shared>) -> Self {
        let (n, rank) = (world.size, world.rank);
        // Marking slot 0 in use lets `abort` wake its waiters.
        let head = world.comm_head(0);
        head.members.store(if n == 64 { u64::MAX } else { (1 << n) - 1 }, Relaxed);
        head.state.store(super::layout::IN_USE, Release);
        ShmStore {
            timeout: world.timeout,
            world,
            slot: 0,
            members: (0..n).collect(),
            index: rank,
            first_block: 0,
            routes: RouteTimes::default(),
        }
    }

    /// Member `j`'s staging block.
    fn block(&self, j: usize) -> *mut u8 {
        self.world.block(self.first_block + j)
    }

    /// Where member `j` published a buffer of `bytes` for `sig`, told by `off`: a segment offset, a
    /// private address (tagged [`PRIVATE`], and [`CROSS`] when its member asks the call to cross), or
    /// none. An offset no correct peer publishes (outside its arena, misaligned for the dtype) or an
    /// impossible address (wrapping around, misaligned) is an error.
    fn place(&self, j: usize, off: u64, bytes: usize, sig: &Signature) -> Result<Place> {
        let rank = self.members[j];
        let align = sig.dtype.map_or(1, |d| d.align());
        let bad =
            |why: &str| Error::invalid(format!("{sig}: rank {rank} published {why} (corrupted segment?)"));
        Ok(match (bytes, off) {
            (0, _) => Place::Here(std::ptr::null_mut()),
            (_, NO_BUFFER | NOT_SHARED) => Place::Withheld,
            (_, off) if off & PRIVATE != 0 => {
                let a = off & !(PRIVATE | CROSS);
                let a = usize::try_from(a)
                    .ok()
                    .filter(|_| a < CROSS)
                    .ok_or_else(|| bad("an impossible address"))?;
                if a == 0 || a.checked_add(bytes).is_none() || a % align != 0 {
                    return Err(bad(&format!("a buffer of {bytes} bytes at {a:#x}")));
                }
                let pid = (j != self.index).then(|| self.world.pid(rank) as i32);
                Place::Offered { at: Loc { pid, addr: a, rank }, cross: off & CROSS != 0 }
            }
            (b, off) => Place::Here(self.world.resolve(rank, off, b, align).map_err(|why| bad(&why))?),
        })
    }
}

impl Store for ShmStore {
    const NAME: &'static str = "shm";

    fn rank(&self) -> usize {
        self.world.rank
    }
    fn world_size(&self) -> usize {
        self.world.size
    }
    fn members(&self) -> &[usize] {
        &self.members
    }
    fn index(&self) -> usize {
        self.index
    }
    fn timeout(&self) -> Duration {
        self.timeout
    }

    fn ctrl(&self, j: usize) -> &Ctrl {
        self.world.ctrl(self.slot, j)
    }
    fn wait<'a>(&'a self, op: &'a dyn fmt::Display) -> Wait<'a> {
        Wait {
            event: &self.world.comm_head(self.slot).event,
            shared: true,
            spin: self.spins(),
            timeout: self.timeout,
            op,
        }
    }
    fn notify(&self) {
        self.world.comm_head(self.slot).event.notify(true);
    }

    fn oneshot_bytes(&self) -> usize {
        self.world.layout.params.small
    }
    fn oneshot(&self, j: usize, k: u64) -> *mut u8 {
        // SAFETY: the two one-shot buffers open the member's staging block.
        unsafe { self.block(j).add((k % 2) as usize * self.world.layout.params.small) }
    }

    fn layout(&self, j: usize, k: u64) -> *mut u64 {
        // The one-shot buffers (at least 16 KiB, page-aligned) hold the 2 x 64 words of the largest
        // world; no call uses both.
        self.oneshot(j, k).cast()
    }

    fn share(&self, ptr: *const u8, bytes: usize, sig: &Signature) -> u64 {
        if ptr.is_null() || bytes == 0 {
            NO_BUFFER
        } else if let Some(off) = self.world.offset_of(ptr, bytes) {
            off
        } else if (ptr as u64) < CROSS {
            match route::offer(|| self.world.cma(), sig, self.members.len(), bytes, self.routes()) {
                Offer::Withheld => NOT_SHARED,
                Offer::Address => PRIVATE | ptr as u64,
                Offer::Cross => PRIVATE | CROSS | ptr as u64,
            }
        } else {
            NOT_SHARED
        }
    }
    fn routes(&self) -> Option<&RouteTimes> {
        // Where ranks outnumber cores no call is timed (`route::offer`).
        self.spins().then_some(&self.routes)
    }
    fn places(
        &self,
        pages: &[Published],
        sig: &Signature,
        spans: &[(usize, usize)],
    ) -> Result<Vec<[Place; 2]>> {
        let place = |j: usize, off: u64, bytes: usize| self.place(j, off, bytes, sig);
        (pages.iter().zip(spans).enumerate())
            .map(|(j, (page, &(s, r)))| Ok([place(j, page.send, s)?, place(j, page.recv, r)?]))
            .collect()
    }
    fn staging(&self) -> Option<Staging> {
        let p = &self.world.layout.params;
        let bufs = (0..self.members.len())
            .map(|j| {
                let b = self.block(j);
                // SAFETY: both pipeline buffers lie inside the member's staging block.
                unsafe { [b.add(2 * p.small), b.add(2 * p.small + p.chunk)] }
            })
            .collect();
        Some((bufs, p.chunk))
    }

    fn aborted(&self) -> bool {
        self.world.header().abort_state.load(SeqCst) != 0
    }
    fn abort_error(&self, op: &str, waiting: bool) -> Error {
        let waiting = waiting.then_some(&self.members[..]);
        match self.world.check_abort(op, waiting).err() {
            // This member waited as long as its communicator's timeout, not the world's.
            Some(Error::Timeout { rank, op, missing, group, progress, .. }) => {
                Error::Timeout { rank, op, waited: self.timeout, missing, group, progress }
            }
            e => e.unwrap_or_else(|| Error::aborted(usize::MAX, "")),
        }
    }
    fn abort(&self, reason: &str, cause: Cause<'_>) {
        self.world.abort(reason, cause);
    }
    fn check_alive(&self, ranks: &[usize], op: &str) -> Result<()> {
        self.world.check_alive(ranks, op)
    }
    fn vanished(&self, rank: usize, op: &str) -> bool {
        self.world.check_alive(&[rank], op).is_err()
    }

    fn send(&self, buf: Buf<'_>, dst: usize, tag: u64, op: &str) -> Result<()> {
        super::p2p::send(&self.world, buf, dst, tag, op, self.timeout)
    }
    fn recv(&self, buf: BufMut<'_>, src: usize, tag: u64, op: &str) -> Result<()> {
        super::p2p::recv(&self.world, buf, src, tag, op, self.timeout)
    }
    fn recv_any(&self, buf: BufMut<'_>, from: &[usize], tag: u64, op: &str) -> Result<usize> {
        super::p2p::recv_any(&self.world, buf, from, tag, op, self.timeout)
    }

    fn split(&self, members: Vec<usize>, index: usize, timeout: Duration) -> Result<Self> {
        let (slot, first) = self.world.claim(&members, "new_group")?;
        // From here on dropping the store leaves the slot.
        let group = ShmStore {
            world: self.world.clone(),
            slot,
            members,
            index,
            first_block: first as usize,
            routes: RouteTimes::default(),
            timeout,
        };
        self.world.own_block(group.first_block + index, true)?;
        Ok(group)
    }
    fn alloc(&self, bytes: usize) -> Result<Option<SharedMem>> {
        Ok(self.world.shared_mem(bytes))
    }
}
