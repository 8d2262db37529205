//! The in-process world: every rank is a thread of one process, and buffers are exchanged by address.
//!
//! Protocol for the k-th collective of a communicator (each member keeps its own count, so k agrees as
//! long as members call the same collectives):
//! 1. publish: write the call's signature and buffer addresses into page `k % 2` of this member's slot,
//!    then store `arrive = k` (release) and bump the communicator's event;
//! 2. wait until every member's `arrive >= k`, then compare signatures: any difference aborts the world
//!    and every member fails with the same mismatch error, before a byte is written;
//! 3. move data with the `algo` functions, each member doing its disjoint share on the peers' buffers;
//! 4. store `done = k`, wait until every member's `done >= k` (peers may still read our buffers until then).
//!
//! A member does not leave a call while a peer may still touch its buffers. Every way out of a call it
//! arrived at stores `done = k`; a member that fails in step 2 (abort, timeout, interrupt) first makes
//! sure the world is aborted, then drains: waits for `done` of every peer that arrived; and a member
//! that saw every arrival re-checks the abort flag (all of this `SeqCst`) before step 3, so a peer
//! that failed meanwhile is never written to. Peers past step 2 never block before step 4, so drains
//! end at once in practice; they are still bounded (Ctrl-C, the timeout), and a drain that gives up
//! marks the handle (`buffers_may_be_in_use`) so the bindings keep the buffers alive for good.
//!
//! Pages alternate so that a member publishing call k+1 never overwrites what a slower peer still reads
//! for call k: to reach k+2 every peer must have arrived at k+1, which it does only after finishing k.
//! All-reduces of at most [`INLINE`] bytes copy their data into the page itself; each member then reduces
//! all pages in rank order into its own buffer, and step 4 is skipped (one sync, a few microseconds).

use std::cell::UnsafeCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering::*};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam_utils::CachePadded;

use super::mailbox::Mailbox;
use super::wait::{may_spin, Event, Stop, Wait};
use crate::algo::{copy, owner, Peer};
use crate::backend::Backend;
use crate::call::{self, Call};
use crate::config::{DEFAULT_TIMEOUT, INLINE, MAX_TIMEOUT};
use crate::dtype::{Buf, BufMut};
use crate::error::{Error, Result};
use crate::reduce::{reduce_raw, ReduceOp};
use crate::signature::{describe_mismatch, describe_progress, CollKind, Progress, Signature};
use crate::work::Lanes;

#[derive(Clone, Copy)]
struct Page {
    sig: Signature,
    peer: Peer,
    inline: [u64; INLINE / 8],
}

struct Slot {
    arrive: AtomicU64,
    done: AtomicU64,
    /// The last call this member completed successfully (timeout reports).
    completed: AtomicU64,
    /// The kind of call k in `kinds[k % 2]` (for timeout reports, read without the page).
    kinds: [AtomicU8; 2],
    pages: [UnsafeCell<Page>; 2],
}

/// The shared state of one communicator (the world, or one subgroup).
struct Comm {
    members: Vec<usize>,
    slots: Box<[CachePadded<Slot>]>,
    event: Event,
}

// SAFETY: pages are written only by their owning member and read by peers only between that member's
// release store of `arrive` and the next reuse of the page, which the protocol above orders.
unsafe impl Sync for Comm {}
// SAFETY: the raw pointers inside pages are addresses published for peers, not owned data.
unsafe impl Send for Comm {}

impl Comm {
    fn new(members: Vec<usize>) -> Self {
        let page = Page {
            sig: Signature::new(CollKind::Barrier, 0, 0),
            peer: Peer { send: std::ptr::null(), recv: std::ptr::null_mut() },
            inline: [0; INLINE / 8],
        };
        let slots = members
            .iter()
            .map(|_| {
                CachePadded::new(Slot {
                    arrive: AtomicU64::new(0),
                    done: AtomicU64::new(0),
                    completed: AtomicU64::new(0),
                    kinds: [AtomicU8::new(0), AtomicU8::new(0)],
                    pages: [UnsafeCell::new(page), UnsafeCell::new(page)],
                })
            })
            .collect();
        Comm { members, slots, event: Event::default() }
    }

    /// Where every member is, for timeout reports.
    fn progress(&self) -> String {
        let kind = |s: &Slot, k: u64| CollKind::from_code(s.kinds[(k % 2) as usize].load(SeqCst));
        let at: Vec<Progress> = self
            .slots
            .iter()
            .zip(&self.members)
            .map(|(s, &rank)| {
                let (completed, entered) = (s.completed.load(SeqCst), s.arrive.load(SeqCst));
                Progress {
                    rank,
                    completed: (completed, kind(s, completed)),
                    entered: (entered, kind(s, entered)),
                    left: s.done.load(SeqCst) >= entered,
                }
            })
            .collect();
        describe_progress(&at)
    }

    /// A copy of member `j`'s page for call `k`. Only valid after seeing `arrive >= k` for `j`.
    fn page(&self, j: usize, k: u64) -> Page {
        // SAFETY: published before `arrive = k` (acquired by the caller) and not rewritten before k+2.
        unsafe { *self.slots[j].pages[(k % 2) as usize].get() }
    }
}

/// A communicator's members and which of their splits over that rank set made it (0: the world).
type CommKey = (Vec<usize>, usize);

/// State of the whole in-process world, shared by every rank's handles.
pub(crate) struct World {
    size: usize,
    timeout: Duration,
    aborted: AtomicBool,
    /// Who aborted, why, and the ranks that never arrived when the cause was a timeout.
    abort_reason: Mutex<Option<(usize, String, Vec<usize>)>>,
    comms: Mutex<HashMap<CommKey, Arc<Comm>>>,
    /// Per rank: how many times it has split each rank set, so the n-th split of a set on every member
    /// finds the same communicator.
    splits: Vec<Mutex<HashMap<Vec<usize>, usize>>>,
    /// Per rank: it said it will make no more calls (its thread is ending), so nobody should wait for it.
    departed: Vec<AtomicBool>,
    pub(crate) mailbox: Mailbox,
}

impl World {
    fn comm(&self, members: Vec<usize>, occurrence: usize) -> Arc<Comm> {
        let mut comms = self.comms.lock().unwrap_or_else(|e| e.into_inner());
        comms.entry((members.clone(), occurrence)).or_insert_with(|| Arc::new(Comm::new(members))).clone()
    }

    pub(crate) fn check_abort(&self) -> Result<()> {
        if !self.aborted.load(SeqCst) {
            return Ok(());
        }
        let reason = self.abort_reason.lock().unwrap_or_else(|e| e.into_inner());
        let (by, reason, _) = reason.clone().unwrap_or((usize::MAX, String::new(), Vec::new()));
        Err(Error::Aborted { by, reason })
    }

    /// As [`World::check_abort`], for a rank waiting in a collective of `comm`: when the world was
    /// aborted because ranks never arrived, this rank times out naming them too (as in the shm world).
    fn check_abort_waiting(&self, rank: usize, op: &str, comm: &Comm) -> Result<()> {
        let err = match self.check_abort() {
            Ok(()) => return Ok(()),
            Err(e) => e,
        };
        let missing =
            self.abort_reason.lock().unwrap_or_else(|e| e.into_inner()).as_ref().map(|r| r.2.clone());
        match missing {
            Some(missing) if !missing.is_empty() => Err(Error::Timeout {
                rank,
                op: op.to_string(),
                waited: self.timeout,
                missing,
                group: comm.members.clone(),
                progress: comm.progress(),
            }),
            _ => Err(err),
        }
    }

    /// Abort the world on behalf of rank `by`; the first reason wins. Wakes every sleeper.
    pub(crate) fn abort(&self, by: usize, reason: String) {
        self.abort_for(by, reason, Vec::new())
    }

    /// [`World::abort`], recording the ranks whose absence caused it.
    fn abort_for(&self, by: usize, reason: String, missing: Vec<usize>) {
        {
            let mut r = self.abort_reason.lock().unwrap_or_else(|e| e.into_inner());
            if r.is_none() {
                *r = Some((by, reason, missing));
            }
            self.aborted.store(true, SeqCst);
        }
        for comm in self.comms.lock().unwrap_or_else(|e| e.into_inner()).values() {
            comm.event.notify(false);
        }
        self.mailbox.wake_all();
    }

    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Fails when `rank` has left the world, naming it: a wait for it could only time out.
    pub(crate) fn check_present(&self, rank: usize, op: &str) -> Result<()> {
        if self.departed[rank].load(SeqCst) {
            return Err(Error::PeerDied {
                peer: rank,
                op: op.to_string(),
                detail: Some("its thread left the world (e.g. its spawn function returned)".into()),
            });
        }
        Ok(())
    }
}

/// One rank's handle on the in-process world (the seed's `MockBackend`, made real): collectives block
/// until every member arrives and exchange data through the callers' own buffers.
pub struct MockBackend {
    world: Arc<World>,
    comm: Arc<Comm>,
    index: usize,
    rank: usize,
    seq: AtomicU64,
    busy: AtomicBool,
    /// A drain gave up: a peer may still touch buffers of a call that returned.
    undrained: AtomicBool,
    lanes: Lanes,
}

/// Clears the busy flag when a collective returns, however it returns.
struct Busy<'a>(&'a AtomicBool);
impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.0.store(false, Release);
    }
}

impl MockBackend {
    /// A world of `n` ranks with the default timeout; hand one backend to each thread.
    pub fn create_world(n: usize) -> Vec<MockBackend> {
        Self::create_world_with_timeout(n, DEFAULT_TIMEOUT)
    }

    /// A world of `n` ranks whose waits fail after `timeout` (at most [`MAX_TIMEOUT`]).
    pub fn create_world_with_timeout(n: usize, timeout: Duration) -> Vec<MockBackend> {
        let world = Arc::new(World {
            size: n,
            timeout: timeout.min(MAX_TIMEOUT),
            aborted: AtomicBool::new(false),
            abort_reason: Mutex::new(None),
            comms: Mutex::new(HashMap::new()),
            splits: (0..n).map(|_| Mutex::new(HashMap::new())).collect(),
            departed: (0..n).map(|_| AtomicBool::new(false)).collect(),
            mailbox: Mailbox::default(),
        });
        let comm = world.comm((0..n).collect(), 0);
        (0..n).map(|r| MockBackend::handle(&world, &comm, r, r)).collect()
    }

    /// A world of one rank: every collective is a local copy.
    pub fn single() -> MockBackend {
        Self::create_world(1).pop().expect("a world of one rank")
    }

    fn handle(world: &Arc<World>, comm: &Arc<Comm>, index: usize, rank: usize) -> MockBackend {
        MockBackend {
            world: world.clone(),
            comm: comm.clone(),
            index,
            rank,
            seq: AtomicU64::new(0),
            busy: AtomicBool::new(false),
            undrained: AtomicBool::new(false),
            lanes: Lanes::default(),
        }
    }

    /// How long a wait lasts before it fails.
    pub fn timeout(&self) -> Duration {
        self.world.timeout
    }

    fn enter(&self) -> Result<Busy<'_>> {
        self.world.check_abort()?;
        if self.busy.swap(true, Acquire) {
            return Err(Error::Usage(format!(
                "rank {}: another collective is already running on this group from another thread; \
                 use one thread per rank (or async_op=True, which queues in order)",
                self.rank
            )));
        }
        Ok(Busy(&self.busy))
    }

    /// Abort on behalf of this rank and return `err`: a failing rank must not leave its peers waiting.
    fn fail(&self, err: Error) -> Error {
        match &err {
            Error::Aborted { .. } | Error::Timeout { .. } if self.world.check_abort().is_err() => {}
            Error::Timeout { missing, .. } => {
                self.world.abort_for(self.rank, err.to_string(), missing.clone())
            }
            _ => self.world.abort(self.rank, err.to_string()),
        }
        err
    }

    /// Wait until every member arrived at call `k`; fails (aborting the world) on abort, interrupt or
    /// timeout, naming the members that never arrived.
    fn wait_arrivals(&self, k: u64, sig: &Signature) -> Result<()> {
        let which = |s: &Slot| s.arrive.load(SeqCst);
        let comm = &*self.comm;
        let op = sig.to_string();
        let wait = Wait {
            event: &comm.event,
            shared: false,
            spin: may_spin(comm.members.len()),
            deadline: Instant::now() + self.world.timeout,
            op: &op,
        };
        let ready = || comm.slots.iter().all(|s| which(s) >= k);
        let present = || {
            let mut absent = comm.slots.iter().zip(&comm.members).filter(|(s, _)| which(s) < k);
            absent.try_for_each(|(_, &r)| self.world.check_present(r, &op))
        };
        let aborted = || self.world.check_abort_waiting(self.rank, &op, comm);
        match wait.until(ready, aborted, present) {
            Ok(()) => Ok(()),
            Err(Stop::Failed(e)) => Err(self.fail(e)),
            Err(Stop::TimedOut) => {
                let missing = comm
                    .slots
                    .iter()
                    .zip(&comm.members)
                    .filter(|(s, _)| which(s) < k)
                    .map(|(_, &r)| r)
                    .collect();
                Err(self.fail(Error::Timeout {
                    rank: self.rank,
                    op,
                    waited: self.world.timeout,
                    missing,
                    group: comm.members.clone(),
                    progress: comm.progress(),
                }))
            }
        }
    }

    /// Signal that this member is done with call `k`: it no longer touches any peer's buffers. Every
    /// way out of a call this member arrived at passes here, so peers draining on it never wait forever.
    fn finish(&self, k: u64) {
        self.comm.slots[self.index].done.store(k, SeqCst);
        self.comm.event.notify(false);
    }

    /// Wait until every member that arrived at call `k` is done with it: until then a peer may still
    /// read or write this member's buffers. Peers past their arrival wait never block before
    /// finishing, and the ones that had not arrived see the abort before touching data (the re-check
    /// in `execute`), so this ends at once in practice. It is bounded all the same (by the timeout,
    /// and by Ctrl-C): when it gives up, the handle is marked so the buffers are kept alive for good,
    /// and the error says who never finished.
    fn drain(&self, k: u64) -> Result<()> {
        let comm = &*self.comm;
        let op = format!("the end of call #{k}");
        let wait = Wait {
            event: &comm.event,
            shared: false,
            spin: may_spin(comm.members.len()),
            deadline: Instant::now() + self.world.timeout,
            op: &op,
        };
        let busy = |s: &Slot| s.arrive.load(SeqCst) >= k && s.done.load(SeqCst) < k;
        match wait.until(|| !comm.slots.iter().any(|s| busy(s)), || Ok(()), || Ok(())) {
            Ok(()) => Ok(()),
            Err(stop) => {
                self.undrained.store(true, SeqCst);
                let stuck: Vec<usize> =
                    comm.slots.iter().zip(&comm.members).filter(|(s, _)| busy(s)).map(|(_, &r)| r).collect();
                Err(match stop {
                    Stop::Failed(e) => e,
                    Stop::TimedOut => Error::Timeout {
                        rank: self.rank,
                        op,
                        waited: self.world.timeout,
                        missing: stuck,
                        group: comm.members.clone(),
                        progress: comm.progress(),
                    },
                })
            }
        }
    }

    /// Run one validated collective through the protocol in the module docs.
    fn execute(&self, call: Result<Call>) -> Result<()> {
        let call = call.map_err(|e| self.fail(e))?;
        let _busy = self.enter()?;
        let comm = &*self.comm;
        let k = self.seq.fetch_add(1, Relaxed) + 1;
        let mut sig = call.sig;
        sig.seq = k;
        let bytes = call.count * call.dtype.size();
        let inline = sig.kind == CollKind::AllReduce && bytes <= INLINE;
        let slot = &comm.slots[self.index];
        slot.kinds[(k % 2) as usize].store(sig.kind as u8, SeqCst);
        // SAFETY: only this member writes its pages, and page k % 2 is no longer read (module docs).
        unsafe {
            let page = &mut *slot.pages[(k % 2) as usize].get();
            page.sig = sig;
            page.peer = call.mine;
            if inline {
                std::ptr::copy_nonoverlapping(call.mine.send, page.inline.as_mut_ptr().cast(), bytes);
            }
        }
        slot.arrive.store(k, SeqCst);
        comm.event.notify(false);
        if let Err(e) = self.wait_arrivals(k, &sig) {
            // The world is aborted now; peers that saw every arrival may still be moving data. (An
            // interrupted drain reports the interrupt: the signal it consumed must reach Python.)
            self.finish(k);
            return Err(self.drain(k).err().filter(|d| matches!(d, Error::Interrupted { .. })).unwrap_or(e));
        }
        let pages: Vec<Page> = (0..comm.members.len()).map(|j| comm.page(j, k)).collect();
        let calls: Vec<(usize, Signature)> =
            comm.members.iter().copied().zip(pages.iter().map(|p| p.sig)).collect();
        if let Some(details) = describe_mismatch(&calls) {
            // Every member sees the same signatures and leaves here: nobody touches any buffer.
            let err = self.fail(Error::Mismatch { group: comm.members.clone(), details, calls });
            self.finish(k);
            return Err(err);
        }
        // Everyone arrived, but an abort may have sent a member away meanwhile: then touch none of the
        // peers' buffers. (Inline all-reduces and barriers read only the pages, which stay valid.)
        let touches_peers = !inline && sig.kind != CollKind::Barrier;
        if touches_peers {
            if let Err(e) = self.world.check_abort() {
                self.finish(k);
                return Err(self
                    .drain(k)
                    .err()
                    .filter(|d| matches!(d, Error::Interrupted { .. }))
                    .unwrap_or(e));
            }
        }
        let peers: Vec<Peer> = pages.iter().map(|p| p.peer).collect();
        let (i, n, dt) = (self.index, call.count, call.dtype);
        let op = sig.op.unwrap_or(ReduceOp::Sum);
        // SAFETY: every member validated its buffers for this signature, and all agree on it; peers keep
        // their buffers until they drained (or, inline, read only the pages).
        unsafe {
            match sig.kind {
                CollKind::AllReduce if inline => {
                    let inputs: Vec<*const u8> = pages.iter().map(|p| p.inline.as_ptr().cast()).collect();
                    reduce_raw(dt, op, &inputs, &[call.mine.recv], n);
                }
                CollKind::Barrier => {}
                CollKind::AllReduce => owner::reduce_owned(dt, op, &peers, i, n, None),
                CollKind::Reduce => owner::reduce_owned(dt, op, &peers, i, n, call.root),
                CollKind::ReduceScatter => owner::reduce_scatter(dt, op, &peers, i, n),
                CollKind::Broadcast => copy::broadcast(&peers, i, call.root.unwrap_or(0), bytes),
                CollKind::AllGather => copy::all_gather(&peers, i, bytes),
                CollKind::Gather => copy::gather(&peers, i, call.root.unwrap_or(0), bytes),
                CollKind::Scatter => copy::scatter(&peers, i, call.root.unwrap_or(0), bytes),
            }
        }
        self.finish(k);
        // Wait until no peer touches our buffers any more (even if the world is aborted meanwhile: the
        // call itself completed).
        if touches_peers {
            self.drain(k)?;
        }
        slot.completed.store(k, SeqCst);
        Ok(())
    }
}

impl Backend for MockBackend {
    fn name(&self) -> &str {
        "threads"
    }
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.world.size
    }
    fn members(&self) -> &[usize] {
        &self.comm.members
    }
    fn lanes(&self) -> &Lanes {
        &self.lanes
    }
    fn buffers_may_be_in_use(&self) -> bool {
        self.undrained.load(SeqCst)
    }

    fn all_reduce(&self, mut buf: BufMut<'_>, op: ReduceOp) -> Result<()> {
        self.execute(call::all_reduce(&mut buf, op))
    }
    fn broadcast(&self, mut buf: BufMut<'_>, root: usize) -> Result<()> {
        self.execute(call::broadcast(self.members(), &mut buf, root))
    }
    fn all_gather(&self, send: Buf<'_>, mut recv: BufMut<'_>) -> Result<()> {
        self.execute(call::all_gather(self.members().len(), &send, &mut recv))
    }
    fn reduce_scatter(&self, send: Buf<'_>, mut recv: BufMut<'_>, op: ReduceOp) -> Result<()> {
        self.execute(call::reduce_scatter(self.members().len(), &send, &mut recv, op))
    }
    fn gather(&self, send: Buf<'_>, mut recv: Option<BufMut<'_>>, root: usize) -> Result<()> {
        self.execute(call::gather(self.members(), self.rank, &send, recv.as_mut(), root))
    }
    fn scatter(&self, send: Option<Buf<'_>>, mut recv: BufMut<'_>, root: usize) -> Result<()> {
        self.execute(call::scatter(self.members(), self.rank, send.as_ref(), &mut recv, root))
    }
    fn reduce(&self, mut buf: BufMut<'_>, root: usize, op: ReduceOp) -> Result<()> {
        self.execute(call::reduce(self.members(), &mut buf, root, op))
    }
    fn barrier(&self) -> Result<()> {
        self.execute(Ok(call::barrier()))
    }

    fn send(&self, buf: Buf<'_>, dst: usize, tag: u64) -> Result<()> {
        call::peer(self.members(), self.rank, dst, "send to").map_err(|e| self.fail(e))?;
        self.world.check_abort()?;
        self.world.mailbox.send(&self.world, self.rank, dst, tag, buf).map_err(|e| self.fail(e))
    }
    fn recv(&self, buf: BufMut<'_>, src: usize, tag: u64) -> Result<()> {
        call::peer(self.members(), self.rank, src, "receive from").map_err(|e| self.fail(e))?;
        self.world.check_abort()?;
        self.world.mailbox.recv(&self.world, src, self.rank, tag, buf).map_err(|e| self.fail(e))
    }

    fn split(&self, ranks: &[usize]) -> Result<Arc<dyn Backend>> {
        let members = call::validate_ranks(ranks, self.world.size)?;
        let index = call::index_of(&members, self.rank, "the calling")?;
        let occurrence = {
            let mut counts = self.world.splits[self.rank].lock().unwrap_or_else(|e| e.into_inner());
            let c = counts.entry(members.clone()).or_insert(0);
            *c += 1;
            *c
        };
        let comm = self.world.comm(members, occurrence);
        Ok(Arc::new(MockBackend::handle(&self.world, &comm, index, self.rank)))
    }

    fn abort(&self, reason: &str) {
        self.world.abort(self.rank, reason.to_string());
    }

    fn leave(&self) {
        self.world.departed[self.rank].store(true, SeqCst);
        for comm in self.world.comms.lock().unwrap_or_else(|e| e.into_inner()).values() {
            comm.event.notify(false);
        }
        self.world.mailbox.wake_all();
    }
}
