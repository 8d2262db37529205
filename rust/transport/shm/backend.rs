//! `ShmBackend`: one rank's handle on a communicator of the shared-memory world.

use std::any::Any;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering::*};
use std::sync::{Arc, Mutex, TryLockError};
use std::time::Duration;

use super::layout::{Ctrl, Page, NOT_SHARED};
use super::rendezvous::Joined;
use super::staged::Staged;
use super::world::{Cause, Shared};
use super::{rendezvous, store_join, wire, ShmOptions};
use crate::algo::{copy, owner, Peer};
use crate::backend::{Backend, SharedMem};
use crate::call::{self, Call};
use crate::config::MAX_TIMEOUT;
use crate::dtype::{Buf, BufMut};
use crate::error::{Error, Result};
use crate::reduce::{reduce_raw, ReduceOp};
use crate::signature::{describe_mismatch, describe_progress, CollKind, Progress, Signature};
use crate::transport::wait::{may_spin, Stop, Wait};
use crate::work::Lanes;

/// A buffer the collective does not have on this member (gather's receive buffer off the root, ...).
const NO_BUFFER: u64 = NOT_SHARED - 1;

/// Per-handle counters, behind a lock that doubles as the "one collective at a time" check.
#[derive(Default)]
struct Local {
    /// Collectives entered on this communicator.
    seq: u64,
    /// Pipeline rounds run on this communicator (see `staged`).
    round: u64,
}

/// One rank's handle on the shared-memory world (or one of its subgroups).
pub struct ShmBackend {
    world: Arc<Shared>,
    slot: usize,
    members: Vec<usize>,
    index: usize,
    first_block: usize,
    local: Mutex<Local>,
    /// A drain gave up: a peer may still touch segment arrays of a call that returned.
    undrained: AtomicBool,
    lanes: Lanes,
}

impl Drop for ShmBackend {
    /// A subgroup's handle gives back its share of the slot (freed once every member has).
    fn drop(&mut self) {
        if self.slot != 0 {
            // The block may be a peer's in the next group that gets it: read-only again first.
            let _ = self.world.own_block(self.first_block + self.index, false);
            self.world.leave(self.slot);
        }
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

/// Bytes spanned by a member's send and receive buffers for `sig`, given whether it is the root.
fn spans(sig: &Signature, n: usize, is_root: bool) -> (usize, usize) {
    let part = sig.count as usize * sig.dtype.map_or(0, |d| d.size());
    match sig.kind {
        CollKind::AllReduce | CollKind::Broadcast | CollKind::Reduce => (part, part),
        CollKind::AllGather => (part, n * part),
        CollKind::ReduceScatter => (n * part, part),
        CollKind::Gather => (part, if is_root { n * part } else { 0 }),
        CollKind::Scatter => (if is_root { n * part } else { 0 }, part),
        CollKind::Barrier => (0, 0),
    }
}

impl ShmBackend {
    /// Join the job described by `opts`: rendezvous, attach the segment, open peers' pidfds.
    pub fn connect(mut opts: ShmOptions) -> Result<ShmBackend> {
        opts.timeout = opts.timeout.min(MAX_TIMEOUT);
        let joined = rendezvous::join(&opts)?;
        Self::from_joined(joined, opts.rank, opts.timeout)
    }

    /// Join as `rank` of `world_size` with a token rank 0 made (`SegmentToken::token`) and passed
    /// through the job's own key-value store (see `store_join`). Blocks until every rank has joined.
    pub fn join_token(token: &str, rank: usize, world_size: usize, timeout: Duration) -> Result<ShmBackend> {
        let timeout = timeout.min(MAX_TIMEOUT);
        let joined = store_join::join(token, rank, world_size, timeout)?;
        Self::from_joined(joined, rank, timeout)
    }

    /// The world's communicator over a joined segment.
    fn from_joined(joined: Joined, rank: usize, timeout: Duration) -> Result<ShmBackend> {
        let world = Arc::new(Shared::new(joined, rank, timeout)?);
        let n = world.size;
        // Slot 0 is the world's communicator; marking it in use lets `abort` wake its waiters.
        let head = world.comm_head(0);
        head.members.store(if n == 64 { u64::MAX } else { (1 << n) - 1 }, Relaxed);
        head.state.store(2, Release);
        Ok(ShmBackend {
            world,
            slot: 0,
            members: (0..n).collect(),
            index: rank,
            first_block: 0,
            local: Mutex::default(),
            undrained: AtomicBool::new(false),
            lanes: Lanes::default(),
        })
    }

    /// How long a wait lasts before it fails.
    pub fn timeout(&self) -> std::time::Duration {
        self.world.timeout
    }

    fn ctrl(&self, j: usize) -> &Ctrl {
        self.world.ctrl(self.slot, j)
    }

    /// Member `j`'s staging block.
    fn block(&self, j: usize) -> *mut u8 {
        self.world.block(self.first_block + j)
    }

    /// Abort on behalf of this rank and return `err`: a failing rank must not leave its peers waiting.
    fn fail(&self, err: Error) -> Error {
        let cause = match &err {
            Error::Aborted { .. } | Error::PeerDied { .. } => return err,
            Error::Timeout { missing, .. } => Cause::Missing(missing),
            _ => Cause::Other,
        };
        self.world.abort(&err.to_string(), cause);
        err
    }

    /// Where every member is, for timeout reports: its `done` and `arrive` counts, with the kinds read
    /// from its pages (peers' bytes: an unreadable page only shows as an unknown call).
    fn progress(&self) -> String {
        let at: Vec<Progress> = (0..self.members.len())
            .map(|j| {
                let c = self.ctrl(j);
                let kind = |k: u64| {
                    // SAFETY: plain words in the segment; a torn read only decodes to garbage or None.
                    let page = unsafe { std::ptr::read_volatile(c.pages[(k % 2) as usize].get()) };
                    wire::decode(page.sig).filter(|s| s.seq == k).map(|s| s.kind)
                };
                let (completed, entered) = (c.completed.load(Acquire), c.arrive.load(Acquire));
                Progress {
                    rank: self.members[j],
                    completed: (completed, kind(completed)),
                    entered: (entered, kind(entered)),
                    left: c.done.load(Acquire) >= entered,
                }
            })
            .collect();
        describe_progress(&at)
    }

    /// Add where each member is to a timeout that does not say it yet.
    fn with_progress(&self, mut e: Error) -> Error {
        if let Error::Timeout { progress, .. } = &mut e {
            if progress.is_empty() {
                *progress = self.progress();
            }
        }
        e
    }

    /// Wait until every member's counter (picked by `which`) reaches `k`.
    fn wait_all(&self, which: fn(&Ctrl) -> &std::sync::atomic::AtomicU64, k: u64, op: &str) -> Result<()> {
        let n = self.members.len();
        let ready = || (0..n).all(|j| which(self.ctrl(j)).load(Acquire) >= k);
        let event = &self.world.comm_head(self.slot).event;
        self.world.wait(event, &self.members, op, ready).map_err(|e| {
            let e = e.unwrap_or_else(|| {
                let missing = (0..n)
                    .filter(|&j| which(self.ctrl(j)).load(Acquire) < k)
                    .map(|j| self.members[j])
                    .collect();
                Error::timeout(self.world.rank, op, self.world.timeout, missing, self.members.clone())
            });
            self.with_progress(self.fail(e))
        })
    }

    /// This member's buffer as published: its segment offset, or why peers cannot address it.
    fn share(&self, ptr: *const u8, bytes: usize) -> u64 {
        if ptr.is_null() || bytes == 0 {
            NO_BUFFER
        } else {
            self.world.offset_of(ptr, bytes).unwrap_or(NOT_SHARED)
        }
    }

    /// Every member's buffers as local addresses, when all of them live in the segment (the zero-copy
    /// path); `None` if any member has a private buffer. An offset no correct peer publishes (outside
    /// its arena, or misaligned for the dtype) aborts the world: every member reads the same pages and
    /// fails alike, and the staged path then stops at its first wait.
    fn direct(&self, pages: &[Page], sig: &Signature, root: Option<usize>) -> Option<Vec<Peer>> {
        let n = self.members.len();
        let align = sig.dtype.map_or(1, |d| d.size());
        let resolve = |j: usize, off: u64, bytes: usize| -> Option<*mut u8> {
            match (bytes, off) {
                (0, _) => Some(std::ptr::null_mut()),
                (_, NO_BUFFER | NOT_SHARED) => None,
                (b, off) => self
                    .world
                    .resolve(self.members[j], off, b, align)
                    .map_err(|why| {
                        self.fail(Error::invalid(format!("{sig}: {why} (corrupted segment?)")));
                    })
                    .ok(),
            }
        };
        (0..n)
            .map(|j| {
                let (s, r) = spans(sig, n, root == Some(j));
                Some(Peer {
                    send: resolve(j, pages[j].send, s)?.cast_const(),
                    recv: resolve(j, pages[j].recv, r)?,
                })
            })
            .collect()
    }

    /// Run one validated collective: publish, meet, compare, move data (module docs of `shm`).
    fn execute(&self, call: Result<Call>) -> Result<()> {
        let call = call.map_err(|e| self.fail(e))?;
        let mut local = match self.local.try_lock() {
            Ok(l) => l,
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            Err(TryLockError::WouldBlock) => {
                return Err(Error::Usage(format!(
                    "rank {}: another collective is already running on this group from another thread; \
                     use one thread per rank (or async_op=True, which queues in order)",
                    self.world.rank
                )))
            }
        };
        let k = local.seq + 1;
        let mut sig = call.sig;
        sig.seq = k;
        let op = sig.to_string();
        self.world.check_abort(&op, None)?;
        local.seq = k;
        let (n, me, p) = (self.members.len(), self.index, &self.world.layout.params);
        let bytes = call.count * call.dtype.size();
        let (sb, rb) = spans(&sig, n, call.root == Some(me));
        let page = Page {
            sig: wire::encode(&sig),
            send: self.share(call.mine.send, sb),
            recv: self.share(call.mine.recv, rb),
        };
        let oneshot = sig.kind == CollKind::AllReduce && bytes <= p.small;
        let slot = (k % 2) as usize;
        let ctrl = self.ctrl(me);
        // SAFETY: our one-shot slot and page `k % 2` were last read by peers for call k − 2, and every
        // peer has since arrived at k − 1 (we waited for that in call k − 1).
        unsafe {
            if oneshot && bytes > 0 {
                std::ptr::copy_nonoverlapping(call.mine.send, self.block(me).add(slot * p.small), bytes);
            }
            std::ptr::write_volatile(ctrl.pages[slot].get(), page);
        }
        ctrl.arrive.store(k, SeqCst);
        self.world.comm_head(self.slot).event.notify(true);
        let arrived = self.wait_all(|c| &c.arrive, k, &op);
        let everyone = arrived.is_ok();
        let (result, drain) = match arrived {
            Ok(()) => self.run(&mut local, &call, &sig, &pages_of(self, slot), k, &op),
            // `wait_all` aborted the world (or found it aborted): a peer that sees every arrival now
            // re-checks the abort word before touching our buffers, or else we see its arrival below.
            Err(e) => (Err(e), true),
        };
        // From here on we touch nothing of this call: peers waiting for us may go.
        if !drain && result.is_ok() {
            ctrl.completed.store(k, Release);
        }
        ctrl.done.store(k, Release);
        self.world.comm_head(self.slot).event.notify(true);
        if !drain {
            return result;
        }
        // Wait (bounded: see `drain`) for every member that may still read or write our buffers: all of
        // them when everyone arrived, else those whose arrival we can see now (pairs with their re-check
        // of the abort word: one of the two sides sees the other's store).
        std::sync::atomic::fence(SeqCst);
        let busy: Vec<usize> =
            (0..n).filter(|&j| j != me && (everyone || self.ctrl(j).arrive.load(SeqCst) >= k)).collect();
        let drained = self.drain(&busy, k, &op);
        let result = match (result, drained) {
            // An interrupted drain reports the interrupt: the signal it consumed must reach Python.
            (_, Err(e @ Error::Interrupted { .. })) | (Ok(()), Err(e)) => Err(e),
            (Ok(()), Ok(())) => self.world.check_abort(&op, Some(&self.members)),
            (err, _) => err,
        };
        if result.is_ok() {
            ctrl.completed.store(k, Release);
        }
        result.map_err(|e| self.with_progress(e))
    }

    /// Wait until every member of `busy` (indices) has stored `done >= k`, or died (a dead peer touches
    /// nothing). Aborts do not end it: peers past their arrival wait never block before storing
    /// `done`. A stopped peer (SIGSTOP) would hold it forever, so it is bounded by the timeout and by
    /// Ctrl-C; when it gives up, the handle is marked so the bindings keep the arrays alive for good
    /// (segment arrays a peer may still write never return to the arena), and the error names the
    /// peers that never finished.
    fn drain(&self, busy: &[usize], k: u64, op: &str) -> Result<()> {
        let dead = std::cell::Cell::new(0u64);
        let gone = |j: usize| dead.get() >> self.members[j] & 1 == 1;
        let pending = || busy.iter().copied().filter(|&j| self.ctrl(j).done.load(Acquire) < k && !gone(j));
        let w = Wait {
            event: &self.world.comm_head(self.slot).event,
            shared: true,
            spin: may_spin(self.world.size),
            deadline: std::time::Instant::now() + self.world.timeout,
            op,
        };
        let slow = || {
            let ranks: Vec<usize> = pending().map(|j| self.members[j]).collect();
            for r in ranks {
                if self.world.check_alive(&[r], op).is_err() {
                    dead.set(dead.get() | 1 << r);
                }
            }
            Ok(())
        };
        match w.until(|| pending().next().is_none(), || Ok(()), slow) {
            Ok(()) => Ok(()),
            Err(stop) => {
                self.undrained.store(true, SeqCst);
                let stuck: Vec<usize> = pending().map(|j| self.members[j]).collect();
                Err(match stop {
                    Stop::Failed(e) => e,
                    Stop::TimedOut => {
                        Error::timeout(self.world.rank, op, self.world.timeout, stuck, self.members.clone())
                    }
                })
            }
        }
    }

    /// Steps 2 and 3 for a call every member arrived at: compare, re-check the abort word, move data.
    /// Returns the outcome and whether peers may still touch our buffers (then the caller drains).
    fn run(
        &self,
        local: &mut Local,
        call: &Call,
        sig: &Signature,
        pages: &[Page],
        k: u64,
        op: &str,
    ) -> (Result<()>, bool) {
        let (n, me, p) = (self.members.len(), self.index, &self.world.layout.params);
        let bytes = call.count * call.dtype.size();
        let oneshot = sig.kind == CollKind::AllReduce && bytes <= p.small;
        let slot = (k % 2) as usize;
        let mut calls = Vec::with_capacity(n);
        for (j, pg) in pages.iter().enumerate() {
            let Some(s) = wire::decode(pg.sig).filter(|s| s.seq == k) else {
                let e = Error::invalid(format!(
                    "rank {} published an unreadable call in the shared segment (corrupted?)",
                    self.members[j]
                ));
                return (Err(self.fail(e)), true);
            };
            calls.push((self.members[j], s));
        }
        if let Some(details) = describe_mismatch(&calls) {
            return (Err(self.fail(Error::Mismatch { group: self.members.clone(), details, calls })), true);
        }
        let (dt, red) = (call.dtype, sig.op.unwrap_or(ReduceOp::Sum));
        if sig.kind == CollKind::Barrier || bytes == 0 {
            return (Ok(()), false);
        }
        if oneshot {
            let inputs: Vec<*const u8> = (0..n)
                // SAFETY: inside each member's staging block.
                .map(|j| unsafe { self.block(j).add(slot * p.small).cast_const() })
                .collect();
            // SAFETY: every member copied `bytes` into its slot before arriving; they stay until call
            // k + 2, which no member starts before we arrive at k + 1. Only we write our buffer.
            unsafe { reduce_raw(dt, red, &inputs, &[call.mine.recv], call.count) };
            return (Ok(()), false);
        }
        if let Some(peers) = self.direct(pages, sig, call.root) {
            // The zero-copy path writes peers' arrays. A rank that left its arrival wait on failure aborted
            // the world before looking at our arrival: either it sees us arrived (and waits for our done) or
            // we see its abort here. (The other paths write only our own buffers: no check needed.)
            std::sync::atomic::fence(SeqCst);
            if self.world.header().abort_state.load(SeqCst) != 0 {
                return (self.world.check_abort(op, Some(&self.members)), true);
            }
            let (i, c, root) = (me, call.count, call.root.unwrap_or(0));
            // SAFETY: every buffer was bounds-checked against its owner's arena, all members agree on
            // the signature, and each keeps its buffers until every member stored its done (drain).
            unsafe {
                match sig.kind {
                    CollKind::AllReduce => owner::reduce_owned(dt, red, &peers, i, c, None),
                    CollKind::Reduce => owner::reduce_owned(dt, red, &peers, i, c, call.root),
                    CollKind::ReduceScatter => owner::reduce_scatter(dt, red, &peers, i, c),
                    CollKind::Broadcast => copy::broadcast(&peers, i, root, bytes),
                    CollKind::AllGather => copy::all_gather(&peers, i, bytes),
                    CollKind::Gather => copy::gather(&peers, i, root, bytes),
                    CollKind::Scatter => copy::scatter(&peers, i, root, bytes),
                    CollKind::Barrier => {}
                }
            }
            return (Ok(()), true);
        }
        let bufs: Vec<[*mut u8; 2]> = (0..n)
            .map(|j| {
                let b = self.block(j);
                // SAFETY: both pipeline buffers lie inside the member's staging block.
                unsafe { [b.add(2 * p.small), b.add(2 * p.small + p.chunk)] }
            })
            .collect();
        let staged = Staged {
            kind: sig.kind,
            dtype: dt,
            op: red,
            n,
            me,
            root: call.root.unwrap_or(0),
            count: call.count,
            send: call.mine.send,
            recv: call.mine.recv,
            bufs: &bufs,
            chunk: p.chunk,
        };
        let ctrl = self.ctrl(me);
        let event = &self.world.comm_head(self.slot).event;
        let publish = |s: u64| {
            ctrl.step.store(s, Release);
            event.notify(true);
        };
        let sync = |s: u64| self.wait_all(|c| &c.step, s, op);
        // SAFETY: the buffers were validated for this signature, which every member shares. Only their
        // owner touches private buffers (peers read staging, which lives in the segment and outlives
        // the call), so a member may leave the pipeline without waiting for the others.
        (unsafe { staged.run(&mut local.round, publish, sync) }, false)
    }
}

/// Every member's page `slot`, read after its arrival was acquired.
fn pages_of(b: &ShmBackend, slot: usize) -> Vec<Page> {
    // SAFETY: every member published page `slot` before its `arrive = k`, acquired by the caller.
    (0..b.members.len()).map(|j| unsafe { std::ptr::read_volatile(b.ctrl(j).pages[slot].get()) }).collect()
}

impl Backend for ShmBackend {
    fn name(&self) -> &str {
        "shm"
    }
    fn rank(&self) -> usize {
        self.world.rank
    }
    fn world_size(&self) -> usize {
        self.world.size
    }
    fn members(&self) -> &[usize] {
        &self.members
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
        self.execute(call::broadcast(&self.members, &mut buf, root))
    }
    fn all_gather(&self, send: Buf<'_>, mut recv: BufMut<'_>) -> Result<()> {
        self.execute(call::all_gather(self.members.len(), &send, &mut recv))
    }
    fn reduce_scatter(&self, send: Buf<'_>, mut recv: BufMut<'_>, op: ReduceOp) -> Result<()> {
        self.execute(call::reduce_scatter(self.members.len(), &send, &mut recv, op))
    }
    fn gather(&self, send: Buf<'_>, mut recv: Option<BufMut<'_>>, root: usize) -> Result<()> {
        self.execute(call::gather(&self.members, self.world.rank, &send, recv.as_mut(), root))
    }
    fn scatter(&self, send: Option<Buf<'_>>, mut recv: BufMut<'_>, root: usize) -> Result<()> {
        self.execute(call::scatter(&self.members, self.world.rank, send.as_ref(), &mut recv, root))
    }
    fn reduce(&self, mut buf: BufMut<'_>, root: usize, op: ReduceOp) -> Result<()> {
        self.execute(call::reduce(&self.members, &mut buf, root, op))
    }
    fn barrier(&self) -> Result<()> {
        self.execute(Ok(call::barrier()))
    }

    fn send(&self, buf: Buf<'_>, dst: usize, tag: u64) -> Result<()> {
        call::peer(&self.members, self.world.rank, dst, "send to").map_err(|e| self.fail(e))?;
        self.world.check_abort("send", None)?;
        super::p2p::send(&self.world, buf, dst, tag).map_err(|e| self.fail(e))
    }
    fn recv(&self, buf: BufMut<'_>, src: usize, tag: u64) -> Result<()> {
        call::peer(&self.members, self.world.rank, src, "receive from").map_err(|e| self.fail(e))?;
        self.world.check_abort("recv", None)?;
        super::p2p::recv(&self.world, buf, src, tag).map_err(|e| self.fail(e))
    }

    fn split(&self, ranks: &[usize]) -> Result<Arc<dyn Backend>> {
        let members = call::validate_ranks(ranks, self.world.size)?;
        let index = call::index_of(&members, self.world.rank, "the calling")?;
        let mask = members.iter().fold(0u64, |m, &r| m | 1 << r);
        let (slot, first) = self.world.claim(mask, members.len(), "new_group")?;
        // From here on dropping the handle leaves the slot.
        let group = ShmBackend {
            world: self.world.clone(),
            slot,
            members,
            index,
            first_block: first as usize,
            local: Mutex::default(),
            undrained: AtomicBool::new(false),
            lanes: Lanes::default(),
        };
        self.world.own_block(group.first_block + index, true)?;
        Ok(Arc::new(group))
    }

    fn abort(&self, reason: &str) {
        self.world.abort(reason, Cause::Other);
    }

    fn alloc(&self, bytes: usize) -> Result<Option<SharedMem>> {
        let Some(off) = self.world.alloc(bytes) else {
            return Ok(None);
        };
        // SAFETY: `off` starts `bytes` (rounded up) inside this rank's arena, within the mapping.
        let ptr = unsafe { self.world.map.base().add(off) };
        let lease = Lease { world: self.world.clone(), off, bytes };
        let owner: Box<dyn Any + Send + Sync> = Box::new(lease);
        // SAFETY: the range is this allocation's alone until the lease returns it, and the lease keeps
        // the mapping alive (it holds the world).
        Ok(Some(unsafe { SharedMem::new(NonNull::new(ptr).expect("inside a mapping"), bytes, owner) }))
    }
}
