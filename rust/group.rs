//! Process groups and the world.
//!
//! A [`ProcessGroup`] is a set of global ranks with a communicator over them: collectives on it involve
//! only its members, and groups run concurrently without interfering (each has its own rendezvous state
//! and sequence numbers). Group order is ascending global rank; results of a group come in that order.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::Duration;

use crate::backend::Backend;
use crate::dtype::{Buf, BufMut, Element};
use crate::error::{Error, Result};
use crate::reduce::ReduceOp;
use crate::work::{Lane, Work};
use crate::{collective::Collective, signature::CollKind};

/// A group of ranks, as seen from one rank (which may or may not be a member).
pub struct ProcessGroup {
    backend: Arc<dyn Backend>,
    /// The communicator over `ranks`; `None` when this rank is not a member.
    comm: Option<Arc<dyn Backend>>,
    ranks: Vec<usize>,
    /// How long waits on the group last (also known on a non-member, which never waits on it).
    timeout: Duration,
}

impl ProcessGroup {
    /// The group of every rank the backend's communicator spans.
    pub fn new(backend: Arc<dyn Backend>) -> Self {
        let ranks = backend.members().to_vec();
        ProcessGroup { comm: Some(backend.clone()), timeout: backend.timeout(), backend, ranks }
    }

    /// The group of `ranks` (global), whose waits last `timeout` (None: the backend's). Every member
    /// must create it (same ranks, same order of creation); on a non-member it is a handle whose
    /// collectives fail.
    pub fn with_ranks(backend: Arc<dyn Backend>, ranks: &[usize], timeout: Option<Duration>) -> Result<Self> {
        let ranks = crate::call::validate_ranks(ranks, backend.world_size())?;
        // Checked on non-members too, so that a bad timeout fails every rank alike.
        let timeout = crate::call::checked_timeout(timeout.unwrap_or_else(|| backend.timeout()))?;
        // Always a communicator of its own, even over every rank: two groups sharing one would share
        // sequence numbers, and calls on different groups could then match each other.
        let member = ranks.contains(&backend.rank());
        let comm = member.then(|| backend.split(&ranks, Some(timeout))).transpose()?;
        Ok(ProcessGroup { backend, comm, ranks, timeout })
    }

    /// This rank's flight recorder on the group (`crate::flight`): `None` on a non-member, or when its
    /// backend records nothing.
    pub fn recorder(&self) -> Option<&Arc<crate::flight::Recorder>> {
        self.comm.as_ref()?.recorder()
    }

    /// The world backend this group was made from.
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }
    /// This process's global rank.
    pub fn rank(&self) -> usize {
        self.backend.rank()
    }
    /// Number of ranks in the world.
    pub fn world_size(&self) -> usize {
        self.backend.world_size()
    }
    /// Number of ranks in this group.
    pub fn size(&self) -> usize {
        self.ranks.len()
    }
    /// Global ranks of the members, ascending.
    pub fn ranks(&self) -> &[usize] {
        &self.ranks
    }
    /// The sequence number of the last collective this rank entered on this group (0 before the first):
    /// the same on every member between calls (torch's `_get_sequence_number_for_group`).
    pub fn sequence_number(&self) -> u64 {
        self.backend.sequence_number()
    }
    /// Whether global rank `rank` is a member.
    pub fn contains(&self, rank: usize) -> bool {
        self.ranks.contains(&rank)
    }
    /// Position of global rank `rank` in the group.
    pub fn group_rank(&self, rank: usize) -> Option<usize> {
        self.ranks.iter().position(|&r| r == rank)
    }
    /// How long a wait on the group (a collective, a send or receive) lasts before it fails.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The communicator, or an error (which aborts the world, so members are not left waiting) when
    /// this rank is not a member.
    pub fn comm(&self) -> Result<&Arc<dyn Backend>> {
        self.comm.as_ref().ok_or_else(|| {
            let e = Error::invalid(format!(
                "rank {} is not a member of the group {:?} and cannot take part in its collectives",
                self.rank(),
                self.ranks
            ));
            self.backend.abort(&e.to_string());
            e
        })
    }

    /// Queue `job` on `lane` of this group's communicator, after every job queued there before it (by
    /// any group over the same communicator). A job that panics fails its `Work` with
    /// [`Error::Internal`] and aborts the world, so no peer waits for what it never finished.
    pub fn submit(&self, lane: Lane, job: impl FnOnce() -> Result<()> + Send + 'static) -> Result<Work> {
        let comm = self.comm()?.clone();
        let guard = comm.clone();
        Ok(comm.lanes().submit(lane, move || {
            catch_unwind(AssertUnwindSafe(job)).unwrap_or_else(|panic| {
                let what = panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "a panic".into());
                let e = Error::Internal(format!(
                    "a queued operation on rank {} panicked ({what}); the world is aborted",
                    guard.rank()
                ));
                guard.abort(&e.to_string());
                Err(e)
            })
        }))
    }

    /// Wait until every job queued on `lane` has finished (so a blocking call keeps issue order).
    /// Fails only when interrupted (Ctrl-C), or when this rank is not a member.
    pub fn flush(&self, lane: Lane) -> Result<()> {
        self.comm()?.lanes().flush(lane)
    }

    /// Run the collective `c` on this group, after the calls queued on it (the typed methods below
    /// describe theirs and come here).
    pub fn collective(&self, c: Collective<'_>) -> Result<()> {
        self.flush(Lane::Collectives)?;
        self.comm()?.collective(c)
    }

    // In place, as torch's `dist.all_reduce(t)`: the plain names write the caller's buffer.

    /// All-reduce `buf` in place.
    pub fn all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.collective(Collective::of(CollKind::AllReduce).recv(BufMut::new(buf)).op(op))
    }
    /// Copy global rank `root`'s `buf` into every member's.
    pub fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        self.collective(Collective::of(CollKind::Broadcast).recv(BufMut::new(buf)).root(root))
    }
    /// Reduce `buf` into global rank `root`'s `buf`.
    pub fn reduce<T: Element>(&self, buf: &mut [T], root: usize, op: ReduceOp) -> Result<()> {
        self.collective(Collective::of(CollKind::Reduce).recv(BufMut::new(buf)).root(root).op(op))
    }
    /// Block until every member arrives.
    pub fn barrier(&self) -> Result<()> {
        self.collective(Collective::of(CollKind::Barrier))
    }
    /// Receive into `buf` from global rank `src`.
    pub fn recv<T: Element>(&self, buf: &mut [T], src: usize, tag: u64) -> Result<()> {
        self.flush(Lane::Recv { peer: src, tag })?;
        self.comm()?.recv(BufMut::new(buf), src, tag)
    }
    /// Receive into `buf` the first message with `tag` from any other member; returns its global rank.
    pub fn recv_any<T: Element>(&self, buf: &mut [T], tag: u64) -> Result<usize> {
        self.flush(Lane::RecvAny { tag })?;
        self.comm()?.recv_any(BufMut::new(buf), tag)
    }

    // The `*_tensor` methods mean what the Python methods of the same names mean, and what torch's
    // functional collectives (`all_gather_tensor`, `reduce_scatter_tensor`) mean: the input is only
    // read and the result comes back as a new buffer (all_gather's and reduce_scatter's one
    // contiguous result, torch's `*_into_tensor` layout).

    /// A new buffer: `t` reduced across the group.
    #[must_use = "the result is the returned buffer; `all_reduce` reduces in place"]
    pub fn all_reduce_tensor<T: Element>(&self, t: &[T], op: ReduceOp) -> Result<Vec<T>> {
        let mut out = t.to_vec();
        self.all_reduce(&mut out, op)?;
        Ok(out)
    }
    /// A new buffer: global rank `root`'s `t` (the others' `t` gives only the length).
    #[must_use = "the result is the returned buffer; `broadcast` works in place"]
    pub fn broadcast_tensor<T: Element>(&self, t: &[T], root: usize) -> Result<Vec<T>> {
        let mut out = t.to_vec();
        self.broadcast(&mut out, root)?;
        Ok(out)
    }
    /// Every member's `send`, concatenated in group order.
    #[must_use = "the result is the returned buffer"]
    pub fn all_gather_tensor<T: Element>(&self, send: &[T]) -> Result<Vec<T>> {
        let mut out = send.repeat(self.size());
        self.collective(
            Collective::of(CollKind::AllGather).send(Buf::new(send)).recv(BufMut::new(&mut out)),
        )?;
        Ok(out)
    }
    /// Reduce `send` across members and return this member's chunk (`send.len() / size()` elements).
    #[must_use = "the result is the returned buffer"]
    pub fn reduce_scatter_tensor<T: Element>(&self, send: &[T], op: ReduceOp) -> Result<Vec<T>> {
        let mut out = send[..send.len() / self.size()].to_vec();
        let c = Collective::of(CollKind::ReduceScatter).send(Buf::new(send)).recv(BufMut::new(&mut out));
        self.collective(c.op(op))?;
        Ok(out)
    }
    /// Send `t` to global rank `dst`.
    pub fn send_tensor<T: Element>(&self, t: &[T], dst: usize, tag: u64) -> Result<()> {
        self.flush(Lane::Send { peer: dst, tag })?;
        self.comm()?.send(Buf::new(t), dst, tag)
    }
    /// A new buffer of `len` elements received from global rank `src`.
    #[must_use = "the result is the returned buffer; `recv` receives in place"]
    pub fn recv_tensor<T: Element + Default>(&self, len: usize, src: usize, tag: u64) -> Result<Vec<T>> {
        let mut out = vec![T::default(); len];
        self.recv(&mut out, src, tag)?;
        Ok(out)
    }
}

/// The world: the default group over every rank, and the factory of subgroups.
pub struct World {
    group: Arc<ProcessGroup>,
}

impl World {
    /// The world of `backend`: the group of every rank, and the subgroups made from it.
    pub fn init(backend: Arc<dyn Backend>) -> Self {
        World { group: Arc::new(ProcessGroup::new(backend)) }
    }
    /// The group of every rank.
    pub fn default_group(&self) -> &Arc<ProcessGroup> {
        &self.group
    }
    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.group.rank()
    }
    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.group.world_size()
    }
    /// True on rank 0.
    pub fn is_main(&self) -> bool {
        self.rank() == 0
    }
    /// Block until every rank arrives.
    pub fn barrier(&self) -> Result<()> {
        self.group.barrier()
    }
    /// A subgroup of `ranks` whose waits last `timeout` (None: the world's; see
    /// [`ProcessGroup::with_ranks`]).
    pub fn new_group(&self, ranks: &[usize], timeout: Option<Duration>) -> Result<ProcessGroup> {
        ProcessGroup::with_ranks(self.group.backend.clone(), ranks, timeout)
    }
}
