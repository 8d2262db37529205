//! The backend trait: one rank's handle on a communicator (the whole world or a subgroup).
//!
//! Ranks are global everywhere: `rank()`, roots, sources and destinations. The trait is object-safe, so
//! buffers cross it type-erased ([`Buf`], [`BufMut`]). Its one collective entry point,
//! [`Backend::collective`], takes a call's description ([`Collective`]); the typed methods are thin
//! constructors of one, and [`crate::ProcessGroup`] adds the slice-typed API.

use std::any::Any;
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::Duration;

use crate::collective::Collective;
use crate::dtype::{Buf, BufMut};
use crate::error::Result;
use crate::reduce::{ReduceOp, Scale};
use crate::signature::CollKind;
use crate::work::Lanes;

/// A communication backend, as seen by one rank. Every collective blocks until all members of the
/// communicator arrive (or fails for all of them), and leaves every member with bitwise-identical results.
pub trait Backend: Send + Sync {
    /// Short name of the transport ("threads", "shm", ...).
    fn name(&self) -> &str;
    /// This rank's global rank.
    fn rank(&self) -> usize;
    /// Number of ranks in the whole world.
    fn world_size(&self) -> usize;
    /// Global ranks of this communicator's members, in group order (ascending).
    fn members(&self) -> &[usize];

    /// Run one collective: the one entry point every collective goes through (the typed methods
    /// below only describe their call). Every member must describe the same call (kind, dtype, counts,
    /// root, op, scaling), or every one of them fails with a mismatch.
    fn collective(&self, call: Collective<'_>) -> Result<()>;

    /// Reduce `buf` across members in place.
    fn all_reduce(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<()> {
        self.collective(Collective::of(CollKind::AllReduce).recv(buf).op(op))
    }
    /// Reduce every member's `send` (or, when `None`, its `recv` itself) into `recv`, each input
    /// multiplied by `scale.pre` and the result by `scale.post`. Out of place, `send` is only read and
    /// must have `recv`'s dtype and length.
    fn all_reduce_into(
        &self,
        send: Option<Buf<'_>>,
        recv: BufMut<'_>,
        op: ReduceOp,
        scale: Scale,
    ) -> Result<()> {
        self.collective(Collective::of(CollKind::AllReduce).io(send, Some(recv)).op(op).scale(scale))
    }
    /// Copy `root`'s `buf` into every member's `buf`.
    fn broadcast(&self, buf: BufMut<'_>, root: usize) -> Result<()> {
        self.collective(Collective::of(CollKind::Broadcast).recv(buf).root(root))
    }
    /// Concatenate every member's `send` into `recv` (`members().len() * send.len()` elements).
    fn all_gather(&self, send: Buf<'_>, recv: BufMut<'_>) -> Result<()> {
        self.collective(Collective::of(CollKind::AllGather).send(send).recv(recv))
    }
    /// Reduce `send` (`members().len() * recv.len()` elements) and keep chunk i on the i-th member.
    fn reduce_scatter(&self, send: Buf<'_>, recv: BufMut<'_>, op: ReduceOp) -> Result<()> {
        self.collective(Collective::of(CollKind::ReduceScatter).send(send).recv(recv).op(op))
    }
    /// Concatenate every member's `send` into `root`'s `recv` (`None` on the others).
    fn gather(&self, send: Buf<'_>, recv: Option<BufMut<'_>>, root: usize) -> Result<()> {
        self.collective(Collective::of(CollKind::Gather).io(Some(send), recv).root(root))
    }
    /// Split `root`'s `send` (`None` on the others) into one chunk per member's `recv`.
    fn scatter(&self, send: Option<Buf<'_>>, recv: BufMut<'_>, root: usize) -> Result<()> {
        self.collective(Collective::of(CollKind::Scatter).io(send, Some(recv)).root(root))
    }
    /// Reduce `buf` into `root`'s `buf`; the others' buffers are left unchanged.
    fn reduce(&self, buf: BufMut<'_>, root: usize, op: ReduceOp) -> Result<()> {
        self.collective(Collective::of(CollKind::Reduce).recv(buf).root(root).op(op))
    }
    /// [`Backend::reduce`] with the options of [`Backend::all_reduce_into`]: only `root`'s `recv` is
    /// written.
    fn reduce_into(
        &self,
        send: Option<Buf<'_>>,
        recv: BufMut<'_>,
        root: usize,
        op: ReduceOp,
        scale: Scale,
    ) -> Result<()> {
        self.collective(Collective::of(CollKind::Reduce).io(send, Some(recv)).root(root).op(op).scale(scale))
    }
    /// Block until every member arrives.
    fn barrier(&self) -> Result<()> {
        self.collective(Collective::of(CollKind::Barrier))
    }
    /// A barrier that waits at most `timeout` instead of the communicator's: when members do not
    /// arrive in time, every member that did fails with a timeout naming all the missing ones, and the
    /// world is aborted (as by any timeout). It matches `barrier` calls of other members.
    fn monitored_barrier(&self, timeout: Duration) -> Result<()> {
        self.collective(Collective::of(CollKind::Barrier).timeout(timeout))
    }
    /// Part j of `send` (`members().len()` equal parts) to the j-th member; part i of `recv` (as long
    /// as `send`) from the i-th.
    fn all_to_all(&self, send: Buf<'_>, recv: BufMut<'_>) -> Result<()> {
        self.collective(Collective::of(CollKind::AllToAll).send(send).recv(recv))
    }
    /// all_to_all with sizes: `send_splits[j]` elements (in order) to the j-th member, `recv_splits[i]`
    /// from the i-th; member j's `send_splits[i]` must equal member i's `recv_splits[j]`.
    fn all_to_all_single(
        &self,
        send: Buf<'_>,
        recv: BufMut<'_>,
        send_splits: &[usize],
        recv_splits: &[usize],
    ) -> Result<()> {
        self.collective(
            Collective::of(CollKind::AllToAllSingle).send(send).recv(recv).splits(send_splits, recv_splits),
        )
    }
    /// all_gather of `counts[i]` elements from the i-th member (`recv` holds their sum).
    fn all_gather_v(&self, send: Buf<'_>, recv: BufMut<'_>, counts: &[usize]) -> Result<()> {
        self.collective(Collective::of(CollKind::AllGatherV).send(send).recv(recv).counts(counts))
    }
    /// gather of `counts[i]` elements from the i-th member into `root`'s `recv` (`None` elsewhere).
    fn gather_v(&self, send: Buf<'_>, recv: Option<BufMut<'_>>, counts: &[usize], root: usize) -> Result<()> {
        self.collective(Collective::of(CollKind::GatherV).io(Some(send), recv).counts(counts).root(root))
    }
    /// scatter of `counts[i]` elements of `root`'s `send` (`None` elsewhere) to the i-th member.
    fn scatter_v(
        &self,
        send: Option<Buf<'_>>,
        recv: BufMut<'_>,
        counts: &[usize],
        root: usize,
    ) -> Result<()> {
        self.collective(Collective::of(CollKind::ScatterV).io(send, Some(recv)).counts(counts).root(root))
    }
    /// Reduce `send` (the sum of `counts` elements) and keep the i-th piece (`counts[i]`) on the i-th
    /// member.
    fn reduce_scatter_v(
        &self,
        send: Buf<'_>,
        recv: BufMut<'_>,
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()> {
        self.collective(Collective::of(CollKind::ReduceScatterV).send(send).recv(recv).counts(counts).op(op))
    }
    /// Send `buf` to global rank `dst`; returns once the receiver has it. Matched by (source, tag), in order.
    fn send(&self, buf: Buf<'_>, dst: usize, tag: u64) -> Result<()>;
    /// Receive into `buf` from global rank `src` with `tag`; dtype and length must match the send.
    fn recv(&self, buf: BufMut<'_>, src: usize, tag: u64) -> Result<()>;
    /// Receive into `buf` the first message with `tag` from any other member; returns the sender's
    /// global rank. Each message is taken once (by this or by a [`Backend::recv`]), in order per
    /// (source, tag); when several members have one ready, the member after the previous any-source
    /// receive's sender (in group order, round robin) goes first, so no sender starves.
    fn recv_any(&self, buf: BufMut<'_>, tag: u64) -> Result<usize>;

    /// The sequence number of the last collective this rank entered on this communicator (0 before the
    /// first): members number the same calls alike, so between calls every member reads the same.
    fn sequence_number(&self) -> u64;

    /// How long a wait on this communicator lasts before it fails: the world's timeout, or the one
    /// its `split` gave it.
    fn timeout(&self) -> Duration;

    /// A communicator over `ranks` (global, must include this rank) whose waits (collectives, sends
    /// and receives on it) last `timeout` (None: this communicator's; positive, at most
    /// [`crate::config::MAX_TIMEOUT`]). Every member must call it with the same ranks, in the same
    /// order relative to its other `split` calls. Aborts and dead peers still end its waits at once.
    fn split(&self, ranks: &[usize], timeout: Option<Duration>) -> Result<Arc<dyn Backend>>;
    /// Abort the whole world: every rank waiting, or arriving later, fails with an error naming this rank.
    fn abort(&self, reason: &str);

    /// This communicator's lanes of queued work, shared by every group over it (see [`crate::work`]).
    fn lanes(&self) -> &Lanes;

    /// True once a call on this communicator returned an error while a peer that may still read or
    /// write its buffers (a stopped process) never said it was done: those buffers must then be kept
    /// alive, never freed or reused (the bindings keep the arrays for the process's life).
    fn buffers_may_be_in_use(&self) -> bool {
        false
    }

    /// Say that this rank will make no more calls (its thread or process is ending), once what it
    /// queued has run: peers waiting for it then fail at once, naming it, instead of timing out.
    /// Worlds that detect dead peers themselves (processes) need not do anything.
    fn leave(&self) {}

    /// This handle's flight recorder (its last calls and totals, `crate::flight`); `None` for a backend
    /// that records nothing.
    fn recorder(&self) -> Option<&Arc<crate::flight::Recorder>> {
        None
    }

    /// `bytes` of memory every member can address (a shared segment), for buffers whose collectives
    /// then move no staging copies. `None` when the backend has no such memory (or none left).
    fn alloc(&self, bytes: usize) -> Result<Option<SharedMem>> {
        let _ = bytes;
        Ok(None)
    }
}

/// Memory handed out by [`Backend::alloc`]: 64-byte aligned, uninitialised, returned to the backend
/// (and kept mapped until then) when dropped.
pub struct SharedMem {
    ptr: NonNull<u8>,
    len: usize,
    _owner: Box<dyn Any + Send + Sync>,
}

// SAFETY: the memory belongs to this value alone until it is dropped; `owner` is Send + Sync.
unsafe impl Send for SharedMem {}
// SAFETY: as above; shared references only expose the address.
unsafe impl Sync for SharedMem {}

impl SharedMem {
    /// Wrap `len` bytes at `ptr`, which stay valid until `owner` is dropped.
    ///
    /// # Safety
    /// `ptr` must be valid for reads and writes of `len` bytes, used by nobody else, until `owner` drops.
    pub unsafe fn new(ptr: NonNull<u8>, len: usize, owner: Box<dyn Any + Send + Sync>) -> Self {
        SharedMem { ptr, len, _owner: owner }
    }
    /// Start of the memory.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// True when the allocation is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// A Ctrl-C while this rank waits for `what` (its queued work, its gradient buckets) ends the wait and
/// aborts the world: what was queued goes on in the background, and the peers must not wait for the rest
/// of this rank.
pub(crate) fn abort_if_interrupted(comm: &dyn Backend, r: Result<()>, what: &str) -> Result<()> {
    if let Err(crate::error::Error::Interrupted { .. }) = &r {
        comm.abort(&format!("rank {} was interrupted (Ctrl-C) while waiting for {what}", comm.rank()));
    }
    r
}
