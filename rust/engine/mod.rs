//! The meeting protocol, written once for every world (`store` is what a world provides).
//!
//! For the k-th collective of a communicator (each member keeps its own count, so k agrees as long as
//! members call the same collectives):
//! 1. publish: write the call's signature and buffers into page `k % 2` of this member's control block
//!    (for a one-shot all_reduce, also copy the data into one-shot buffer `k % 2`; for a collective
//!    with per-member sizes, its layout into layout buffer `k % 2`), open its tile counter for call k
//!    (`algo::claims`), store `arrive = k` (with the core it runs on) and wake the communicator's event;
//! 2. wait until every member's `arrive >= k`, then compare the signatures (and the layouts, which
//!    make the plan of a pairwise collective, `algo::layout`): any difference aborts the world and
//!    every member fails with the same mismatch, before any buffer is touched;
//! 3. move data (`algo`): one-shot (every member reduces all one-shot buffers in rank order into its
//!    own buffer), direct (owner-computes and copies straight between the published buffers), cma
//!    (the same between processes, copied by the kernel, for calls that took less time that way
//!    lately or too large to time: `algo::route::offer`),
//!    or staged (pipelined through staging buffers, otherwise);
//! 4. store `moved = k` if this member moved its data in full, then `done = k` on every way out of a
//!    call this member arrived at; after the direct and cma paths, wait until every member's
//!    `done >= k` (peers may still touch our buffers until then): the call succeeded when every
//!    member's `moved >= k`.
//!
//! A call that every member finished succeeds on every member, even if the world was aborted by the
//! time a member looks (a peer that left may have failed its next call at once): the next call
//! reports the abort. After a drain, a member decides from the `moved` words, not the abort flag: a
//! member that failed before moving its share aborted the world before its done, so every drain
//! reads its missing `moved` and fails alike; when every member moved, every member succeeds. A wait
//! whose counters all got there (arrivals, pipeline steps) succeeds whatever the abort flag says: the
//! flag is read first, then the counters, so the counters a member saw before it aborted are seen
//! too. Aborts do reach a member still waiting for a counter, and the direct and cma paths below.
//!
//! A member does not leave a call while a peer may still touch its buffers. A member whose arrival
//! wait fails (abort, timeout, interrupt, dead peer) first makes sure the world is aborted, then waits
//! for the `done` of every peer it sees arrived; a member that saw every arrival re-checks the abort
//! flag before the direct and cma paths (no member leaves those before our done, so the flag cannot
//! come from a later call there). Both sides order their store and their load with `SeqCst` fences, so
//! one always sees the other: either the failed member waits for us, or we touch none of its buffers.
//! Peers past step 2 never block before step 4, so these drains end at once in practice; they are
//! still bounded (Ctrl-C, the timeout, dead peers), and a drain that gives up marks the handle
//! (`buffers_may_be_in_use`) so the bindings keep the buffers alive for good. The one-shot and staged
//! paths need no drain: peers read only one-shot and staging buffers, which outlive the call.
//!
//! Every numbered call is recorded once, here, in the handle's flight recorder (`flight`): scheduled
//! when numbered, started when every member arrived, completed or failed when it returns, with the
//! route its data took; the same record keeps each kind's totals (`ProcessGroup::stats`). Sends and
//! receives are recorded here too, once their peer is checked: scheduled, then completed or failed.
//!
//! Pages and one-shot buffers alternate so that a member publishing call k+1 never overwrites what a
//! slower peer still reads for call k: to reach k+2 every peer must have arrived at k+1, which it does
//! only after finishing k.

mod backend;
mod op_name;
mod store;
#[cfg(test)]
mod tests;
pub(crate) mod wire;

use std::cell::RefCell;
use std::fmt;
use std::sync::atomic::{fence, AtomicBool, AtomicU64, AtomicUsize, Ordering, Ordering::*};
use std::sync::Arc;
use std::sync::{Mutex, MutexGuard, TryLockError};
use std::time::{Duration, Instant};

pub(crate) use backend::{backend_type, AsEngine};
pub(crate) use store::{Cause, Ctrl, Page, Published, Splits, Store};

use op_name::OpName;

use crate::algo::claims::Claims;
use crate::algo::layout::{self, Fault, Plan};
use crate::algo::route::{self, Route};
use crate::algo::{self, pairwise, spans, staged::Staged};
use crate::call::{self, Call};
use crate::config::{CMA_DEATH_GRACE, MAX_TIMEOUT};
use crate::error::{Error, Result};
use crate::flight::{self, Names, P2p, Recorded, Recorder};
use crate::reduce::ReduceOp;
use crate::signature::{describe_mismatch, describe_progress, mismatch_error, CollKind, Progress, Signature};
use crate::sync::wait::{current_cpu, leave_core, Stop};
use crate::work::Lanes;

/// Where the members a wait waits for last published from, seen from the waiting thread's core.
#[derive(Debug, PartialEq)]
enum Placement {
    /// Every one of them on another core.
    Apart,
    /// One of them on this thread's core (queued behind it, since this thread runs).
    Shared,
    /// Not known (a member that never published yet).
    Unknown,
}

/// What a member does once it moved a call's data (`Engine::run`).
#[derive(Clone, Copy)]
enum After {
    /// Leave: no peer touches its buffers any more.
    Leave,
    /// Drain: peers may still touch its buffers until they store their done.
    Drain,
    /// Drain, then report that the call crossed, taking from the instant given until the drain ended
    /// (`algo::route_times`): a crossing call ends when every member's share is done, as a staged
    /// one ends for the member that steps last.
    DrainTimed(Instant),
}

/// Per-handle counters, behind a lock that doubles as the "one collective at a time" check.
#[derive(Default)]
struct Local {
    /// Collectives entered on this communicator.
    seq: u64,
    /// Pipeline rounds run on this communicator (`algo::staged`).
    round: u64,
    /// How the current call moved its data, once `Engine::run` knows (for the flight recorder).
    route: Option<flight::Route>,
}

/// One rank's handle on one communicator of a world: the protocol above, over the world's store.
pub(crate) struct Engine<S> {
    store: S,
    local: Mutex<Local>,
    /// A drain gave up: a peer may still touch buffers of a call that returned.
    undrained: AtomicBool,
    lanes: Lanes,
    /// Group index of the member an any-source receive tries first (round robin).
    any_next: AtomicUsize,
    /// This handle's flight recorder (`flight`).
    flight: Arc<Recorder>,
    /// How this rank names its communicators in the records, shared by the world's and its splits.
    names: Arc<Names>,
}

impl<S: Store> Engine<S> {
    /// The handle of a rank on the world's communicator, in the process's world `world`
    /// (`flight::next_world`: the records tell worlds apart by it).
    pub(crate) fn new(store: S, world: u32) -> Self {
        Engine::with_lanes(store, Lanes::default(), Arc::new(Names::new(world)))
    }

    fn with_lanes(store: S, lanes: Lanes, names: Arc<Names>) -> Self {
        let any_next = AtomicUsize::new(0);
        let members = store.members().to_vec();
        let flight = Recorder::new(S::NAME, store.rank(), store.world_size(), members, names.clone());
        let undrained = AtomicBool::new(false);
        Engine { store, local: Mutex::default(), undrained, lanes, any_next, flight, names }
    }

    /// This handle's flight recorder.
    pub(crate) fn recorder(&self) -> &Arc<Recorder> {
        &self.flight
    }

    fn check_abort(&self, op: &dyn fmt::Display, waiting: bool) -> Result<()> {
        if self.store.aborted() {
            return Err(self.store.abort_error(&op.to_string(), waiting));
        }
        Ok(())
    }

    /// Abort on behalf of this rank and return `err`: a failing rank must not leave its peers waiting.
    fn fail(&self, err: Error) -> Error {
        match &err {
            Error::Aborted { .. } => {}
            Error::Timeout { missing, .. } => self.store.abort(&err.to_string(), Cause::Missing(missing)),
            _ => self.store.abort(&err.to_string(), Cause::Other),
        }
        err
    }

    /// The lock of one collective, or a usage error when another thread of this rank is in one.
    fn enter(&self) -> Result<MutexGuard<'_, Local>> {
        match self.local.try_lock() {
            Ok(l) => Ok(l),
            Err(TryLockError::Poisoned(p)) => Ok(p.into_inner()),
            Err(TryLockError::WouldBlock) => Err(Error::Usage(format!(
                "rank {}: another collective is already running on this group from another thread; \
                 use one thread per rank (or async_op=True, which queues in order)",
                self.store.rank()
            ))),
        }
    }

    /// Where every member is, for timeout reports: its counters, with the kinds read from its pages
    /// (a page being rewritten only shows as an unknown call).
    fn progress(&self) -> String {
        let s = &self.store;
        let at: Vec<Progress> = (0..s.members().len())
            .map(|j| {
                let c = s.ctrl(j);
                let kind = |k: u64| {
                    let page = c.pages[(k % 2) as usize].load();
                    wire::decode(page.sig).filter(|s| s.seq == k).map(|s| s.kind)
                };
                let (completed, entered) = (c.completed.load(Acquire), c.arrive.load(Acquire));
                Progress {
                    rank: s.members()[j],
                    completed: (completed, kind(completed)),
                    entered: (entered, kind(entered)),
                    left: c.done.load(Acquire) >= entered,
                }
            })
            .collect();
        describe_progress(&at)
    }

    /// Add where each member is (the last call each completed, and the one it is in) to a timeout or
    /// peer failure that does not say it yet.
    fn with_progress(&self, mut e: Error) -> Error {
        if let Some(progress) = e.progress_mut() {
            if progress.is_empty() {
                *progress = self.progress();
            }
        }
        e
    }

    /// Record the core this member runs on, then store `value` into its counter picked by `which` and
    /// wake the waiters: how a member publishes progress.
    fn publish(&self, which: impl Fn(&Ctrl) -> &AtomicU64, value: u64, order: Ordering) {
        let ctrl = self.store.ctrl(self.store.index());
        ctrl.cpu.store(current_cpu(), Relaxed);
        which(ctrl).store(value, order);
        self.store.notify();
    }

    /// Whether a wait for the members of `waited` (indices) should spin on (`Wait::until_apart`): yes
    /// while they run on other cores; when one of them is queued on this thread's core, this thread
    /// moves to another core (`leave_core`) and records it, so that the peer, once it runs, sees the
    /// two apart and does not move back.
    fn spin_on(&self, waited: impl Iterator<Item = usize>) -> bool {
        match self.placement(waited) {
            Placement::Apart => true,
            Placement::Unknown => false,
            Placement::Shared => {
                let moved = leave_core();
                if moved {
                    self.store.ctrl(self.store.index()).cpu.store(current_cpu(), Relaxed);
                }
                moved
            }
        }
    }

    /// Where the members of `waited` (indices) last published from, seen from this thread's core.
    fn placement(&self, waited: impl Iterator<Item = usize>) -> Placement {
        let mine = current_cpu();
        let mut seen = Placement::Apart;
        for j in waited {
            match self.store.ctrl(j).cpu.load(Relaxed) {
                c if c == mine => return Placement::Shared,
                0 => seen = Placement::Unknown,
                _ => {}
            }
        }
        seen
    }

    /// Wait until every member's counter (picked by `which`) reaches `k`; fails (aborting the world)
    /// on abort, interrupt, a dead peer or the timeout (`within`, else the communicator's), naming the
    /// members that never got there.
    fn wait_all(
        &self,
        which: impl Fn(&Ctrl) -> &AtomicU64 + Copy,
        k: u64,
        op: &OpName<'_>,
        within: Option<Duration>,
    ) -> Result<()> {
        let s = &self.store;
        let n = s.members().len();
        let behind = || (0..n).filter(move |&j| which(s.ctrl(j)).load(Acquire) < k).map(|j| s.members()[j]);
        let ready = || (0..n).all(|j| which(s.ctrl(j)).load(Acquire) >= k);
        let slow = || s.check_alive(&behind().collect::<Vec<_>>(), op.as_str());
        let apart = || self.spin_on((0..n).filter(|&j| which(s.ctrl(j)).load(Acquire) < k));
        let mut wait = s.wait(op);
        if let Some(t) = within {
            // Capped as every timeout from Python is, so the deadline cannot overflow.
            wait.timeout = t.min(MAX_TIMEOUT);
        }
        let timeout = within.unwrap_or_else(|| s.timeout());
        // An abort does not undo a wait whose counters all got there: it may come from a peer that
        // finished this call and failed a later one. The flag is read first, so counters a member saw
        // before it aborted are seen here too.
        let quick = || match self.check_abort(op, true) {
            Err(_) if ready() => Ok(()),
            checked => checked,
        };
        let e = match wait.until_apart(ready, quick, slow, apart) {
            Ok(()) => return Ok(()),
            // A peer's timeout in this same call: it waited as long as this call's, not the world's.
            Err(Stop::Failed(Error::Timeout { rank, op, missing, group, progress, .. })) => {
                Error::Timeout { rank, op, waited: timeout, missing, group, progress }
            }
            Err(Stop::Failed(e)) => e,
            Err(Stop::TimedOut) => {
                Error::timeout(s.rank(), op.as_str(), timeout, behind().collect(), s.members().to_vec())
            }
        };
        Err(self.with_progress(self.fail(e)))
    }

    /// Wait until every other member (or only those of `busy`, indices) has stored `done >= k`, or has
    /// vanished (a dead peer touches nothing). Aborts do not end it: peers past their arrival wait never
    /// block before storing `done`. A stopped peer (SIGSTOP) would hold it forever, so it is bounded
    /// by the timeout and by Ctrl-C; when it gives up, the handle is marked so the bindings keep the
    /// buffers alive for good, and the error names the peers that never finished.
    fn drain(&self, busy: Option<&[usize]>, k: u64, op: &OpName<'_>) -> Result<()> {
        let s = &self.store;
        let (n, me) = (s.members().len(), s.index());
        let gone = RefCell::new(Vec::new());
        let others = move || (0..n).filter(move |&j| j != me);
        let pending = || {
            let gone = gone.borrow().clone();
            let listed = move |j: &usize| busy.is_none_or(|b| b.contains(j));
            others().filter(listed).filter(move |&j| s.ctrl(j).done.load(Acquire) < k && !gone.contains(&j))
        };
        let slow = || {
            for j in pending() {
                if s.vanished(s.members()[j], op.as_str()) {
                    gone.borrow_mut().push(j);
                }
            }
            Ok(())
        };
        match s.wait(op).until_apart(
            || pending().next().is_none(),
            || Ok(()),
            slow,
            || self.spin_on(pending()),
        ) {
            Ok(()) => Ok(()),
            Err(stop) => {
                self.undrained.store(true, SeqCst);
                Err(match stop {
                    Stop::Failed(e) => e,
                    Stop::TimedOut => {
                        let stuck = pending().map(|j| s.members()[j]).collect();
                        Error::timeout(s.rank(), op.as_str(), s.timeout(), stuck, s.members().to_vec())
                    }
                })
            }
        }
    }

    /// Run one validated collective through the protocol in the module docs.
    fn execute(&self, call: Result<Call>) -> Result<()> {
        let call = call.map_err(|e| self.fail(e))?;
        // A reduction its dtype does not take is refused here, before this member arrives and without
        // an abort: every member that asks for it alike is refused alike, at once, and the world goes
        // on (no member counted the call). A member asking alone is refused as well, and its next call
        // meets its peers' call as a mismatch.
        call::supported(&call.sig)?;
        let mut local = self.enter()?;
        let k = local.seq + 1;
        let mut sig = call.sig;
        sig.seq = k;
        let op = OpName::new(&sig);
        self.check_abort(&op, false).map_err(|e| self.with_progress(e))?;
        local.seq = k;
        let s = &self.store;
        let (n, me) = (s.members().len(), s.index());
        let bytes = call.count * call.dtype.size();
        let (sb, rb) = call.layout.as_ref().map_or_else(|| spans(&sig, n, call.root == Some(me)), |l| l.span);
        let size = call.dtype.size().max(1);
        let mut flight = self.flight.begin(&sig, ((sb / size) as u64, (rb / size) as u64));
        local.route = None;
        let result = self.meet(&mut local, &call, &sig, &op, (sb, rb), &mut flight);
        self.flight.end(flight, result.is_ok(), local.route, bytes as u64);
        result.map_err(|e| self.with_progress(e))
    }

    /// Steps 1 to 4 of the module docs for call `sig` (numbered), whose buffers span `(sb, rb)` bytes.
    fn meet(
        &self,
        local: &mut Local,
        call: &Call,
        sig: &Signature,
        op: &OpName<'_>,
        (sb, rb): (usize, usize),
        flight: &mut flight::Flight,
    ) -> Result<()> {
        let (s, k, op) = (&self.store, sig.seq, op);
        let (n, me) = (s.members().len(), s.index());
        let bytes = call.count * call.dtype.size();
        let oneshot = sig.kind == CollKind::AllReduce && bytes > 0 && bytes <= s.oneshot_bytes();
        let ctrl = s.ctrl(me);
        if oneshot {
            // SAFETY: this member's input holds `bytes`; its one-shot buffer `k % 2` was last read by
            // peers for call k − 2, and every peer has since arrived at k − 1.
            unsafe { algo::oneshot::publish(call.mine.send, s.oneshot(me, k), bytes) };
        }
        if let Some(l) = &call.layout {
            // SAFETY: as for the one-shot buffer; the layout has at most 2n words (`layout::words`).
            unsafe { std::ptr::copy_nonoverlapping(l.words.as_ptr(), s.layout(me, k), l.words.len()) };
        }
        // Peers read only a one-shot call's copy: its buffers are neither shared nor offered to cross.
        let (send, recv) = if oneshot {
            (0, 0)
        } else {
            (s.share(call.mine.send, sb, sig), s.share(call.mine.recv, rb, sig))
        };
        let page = Published { sig: wire::encode(sig), send, recv };
        ctrl.pages[(k % 2) as usize].store(&page);
        // Members claim call k's tiles only after seeing this arrival (`Claims`).
        Claims::open(&ctrl.claim, k);
        self.publish(|c| &c.arrive, k, SeqCst);
        let arrived = self.wait_all(|c| &c.arrive, k, op, call.timeout);
        let everyone = arrived.is_ok();
        let (result, after) = match arrived {
            Ok(()) => {
                let started = self.flight.started(flight);
                self.run(local, call, sig, oneshot, op, started)
            }
            // `wait_all` aborted the world (or found it aborted): a peer that sees every arrival now
            // re-checks the abort flag before touching our buffers, or else we see its arrival below.
            Err(e) => (Err(e), After::Drain),
        };
        let drain = !matches!(after, After::Leave);
        if result.is_ok() {
            // Published by the done below: a member that drains us reads it after our done.
            ctrl.moved.store(k, Release);
            if !drain {
                ctrl.completed.store(k, Release);
            }
        }
        // From here on we touch nothing of this call: peers waiting for us may go.
        self.publish(|c| &c.done, k, Release);
        if !drain {
            return result;
        }
        // Wait (bounded: see `drain`) for every member that may still read or write our buffers: all of
        // them when everyone arrived, else those whose arrival we can see now (pairs with their re-check
        // of the abort flag: one of the two sides sees the other's store).
        fence(SeqCst);
        let seen: Option<Vec<usize>> =
            (!everyone).then(|| (0..n).filter(|&j| s.ctrl(j).arrive.load(SeqCst) >= k).collect());
        let drained = self.drain(seen.as_deref(), k, op);
        let result = match (result, drained) {
            // An interrupted drain reports the interrupt: the signal it consumed must reach Python.
            (_, Err(e @ Error::Interrupted { .. })) | (Ok(()), Err(e)) => Err(e),
            // Every member moved its share: the call succeeded, on every member alike, whatever the
            // abort flag says by now (a peer that left may since have failed a later call, which
            // reports that abort).
            (Ok(()), Ok(())) if self.all_moved(k) => Ok(()),
            // A member that failed did not do its share of our buffers; it aborted the world before
            // its done.
            (Ok(()), Ok(())) => Err(self.store.abort_error(op.as_str(), true)),
            (err, _) => err,
        };
        if let After::DrainTimed(started) = after {
            self.took(sig, true, started, &result);
        }
        if result.is_ok() {
            ctrl.completed.store(k, Release);
        }
        result
    }

    /// Whether every member's page for call `k` holds the signature words `mine`: read with the pages
    /// only, no decoding.
    fn agree(&self, k: u64, mine: &[u64; wire::WORDS]) -> bool {
        let s = &self.store;
        (0..s.members().len()).all(|j| s.ctrl(j).pages[(k % 2) as usize].sig() == *mine)
    }

    /// Whether every member stored `moved >= k`: read after their done (`drain`), which publishes it.
    fn all_moved(&self, k: u64) -> bool {
        let s = &self.store;
        (0..s.members().len()).all(|j| s.ctrl(j).moved.load(Acquire) >= k)
    }

    /// Steps 2 and 3 for a call every member arrived at: compare, re-check the abort flag, move data.
    /// Returns the outcome and what the caller does next (drain while peers may still touch our
    /// buffers).
    /// Errors found in the pages need no drain: every member reads the same pages and fails alike.
    /// Every member arrived at `started`: what a route takes counts from there (`algo::route_times`).
    fn run(
        &self,
        local: &mut Local,
        call: &Call,
        sig: &Signature,
        oneshot: bool,
        op: &OpName<'_>,
        started: Instant,
    ) -> (Result<()>, After) {
        let (s, k) = (&self.store, sig.seq);
        let (n, me) = (s.members().len(), s.index());
        // A one-shot all_reduce whose every page holds this member's own signature words: those decode
        // to this very call on every member (`wire::decode` takes exactly the words `encode` writes),
        // so there is no mismatch and no plan to check, and nothing to allocate.
        if oneshot && self.agree(k, &wire::encode(sig)) {
            return self.oneshot(local, call, sig);
        }
        let bytes = call.count * call.dtype.size();
        let red = sig.op.unwrap_or(ReduceOp::Sum);
        let pages: Vec<Published> = (0..n).map(|j| s.ctrl(j).pages[(k % 2) as usize].load()).collect();
        let mut calls = Vec::with_capacity(n);
        for (j, page) in pages.iter().enumerate() {
            let Some(sig) = wire::decode(page.sig).filter(|s| s.seq == k) else {
                let rank = s.members()[j];
                let e =
                    Error::invalid(format!("rank {rank} published an unreadable call (corrupted segment?)"));
                return (Err(self.fail(e)), After::Leave);
            };
            calls.push((s.members()[j], sig));
        }
        if let Some(details) = describe_mismatch(&calls) {
            return (Err(self.fail(mismatch_error(s.members(), details, &calls))), After::Leave);
        }
        let plan = match self.plan(call, sig, k, calls) {
            Ok(plan) => plan,
            Err(e) => return (Err(self.fail(e)), After::Leave),
        };
        if sig.kind == CollKind::Barrier || plan.as_ref().map_or(bytes == 0, Plan::is_empty) {
            local.route = Some(flight::Route::Nothing);
            return (Ok(()), After::Leave);
        }
        if oneshot {
            return self.oneshot(local, call, sig);
        }
        let spans: Vec<(usize, usize)> = match &plan {
            Some(p) => p.spans.clone(),
            None => (0..n).map(|j| spans(sig, n, call.root == Some(j))).collect(),
        };
        let places = s.places(&pages, sig, &spans);
        let route = match places.and_then(|p| route::choose(sig.kind, s.members(), &p, || s.staging())) {
            Ok(route) => route,
            Err(e) => return (Err(self.fail(e)), After::Leave),
        };
        // Members claim tiles (`algo::claims`) on the direct and cma routes; the staged ones step.
        let word = |j: usize| &*s.ctrl(j).claim;
        let claims = Claims::new(&word, n, k, s.spins());
        local.route = Some(match &route {
            Route::Direct(_) => flight::Route::Direct,
            Route::Cma(_) => flight::Route::Cma,
            Route::Staged { .. } if plan.is_some() => flight::Route::Pairwise,
            Route::Staged { .. } => flight::Route::Staged,
        });
        let publish = |step: u64| self.publish(|c| &c.step, step, Release);
        let sync = |step: u64| self.wait_all(|c| &c.step, step, op, None);
        match route {
            Route::Direct(peers) => {
                // Everyone arrived, but a member whose arrival wait failed meanwhile may be gone: then
                // touch none of the peers' buffers (module docs).
                fence(SeqCst);
                if s.aborted() {
                    return (self.check_abort(op, true), After::Drain);
                }
                // SAFETY: every member validated its buffers for this signature, all agree on it, and
                // each keeps its buffers until every member stored its done (drain).
                unsafe { algo::direct(call, red, &peers, me, plan.as_ref(), &claims) };
                (Ok(()), After::Drain)
            }
            Route::Cma(members) => {
                // As for the direct path: touch no peer's buffer once a member's arrival wait failed.
                fence(SeqCst);
                if s.aborted() {
                    return (self.check_abort(op, true), After::Drain);
                }
                // SAFETY: as for the direct path; `members[me]` are this member's own buffers.
                let name = op.as_str();
                let moved = unsafe { algo::cma::run(call, red, &members, me, plan.as_ref(), &claims, name) };
                // A copy fails when its peer has exited: then say that, as every other wait would
                // (its exit may show a moment after its memory is gone).
                let failed = |e| {
                    let until = Instant::now() + CMA_DEATH_GRACE;
                    loop {
                        match s.check_alive(s.members(), op.as_str()) {
                            Err(dead) => break self.fail(dead),
                            Ok(()) if Instant::now() >= until => break self.fail(e),
                            Ok(()) => std::thread::sleep(Duration::from_millis(5)),
                        }
                    }
                };
                (moved.map_err(failed), After::DrainTimed(started))
            }
            Route::Staged { bufs, chunk } if plan.is_some() => {
                let (send, recv) = (call.mine.send, call.mine.recv);
                let plan = plan.as_ref().expect("checked by the guard");
                let staged =
                    pairwise::Staged { plan, dtype: call.dtype, op: red, me, send, recv, bufs: &bufs, chunk };
                // SAFETY: as below, for the plan every member shares.
                (unsafe { staged.run(&mut local.round, publish, sync) }, After::Leave)
            }
            Route::Staged { bufs, chunk } => {
                let staged = Staged {
                    kind: sig.kind,
                    dtype: call.dtype,
                    op: red,
                    scale: sig.scale,
                    n,
                    me,
                    root: call.root.unwrap_or(0),
                    count: call.count,
                    send: call.mine.send,
                    recv: call.mine.recv,
                    bufs: &bufs,
                    chunk,
                };
                // SAFETY: the buffers were validated for this signature, which every member shares. Only
                // their owner touches private buffers (peers read staging, which outlives the call), so
                // a member may leave the pipeline without waiting for the others.
                let moved = unsafe { staged.run(&mut local.round, publish, sync) };
                self.took(sig, false, started, &moved);
                (moved, After::Leave)
            }
        }
    }

    /// Step 3 of a one-shot all_reduce every member arrived at (its signatures agree): reduce every
    /// member's copy, in rank order, into this member's buffer.
    fn oneshot(&self, local: &mut Local, call: &Call, sig: &Signature) -> (Result<()>, After) {
        let (s, k, n) = (&self.store, sig.seq, self.store.members().len());
        local.route = Some(flight::Route::OneShot);
        let copy = |j: usize| s.oneshot(j, k).cast_const();
        let (red, recv) = (sig.op.unwrap_or(ReduceOp::Sum), call.mine.recv);
        // SAFETY: every member copied its input into its one-shot buffer before arriving; they stay
        // until call k + 2, which no member starts before we arrive at k + 1. Only we write our buffer.
        unsafe { algo::oneshot::reduce(call.dtype, red, sig.scale, n, copy, recv, call.count) };
        (Ok(()), After::Leave)
    }

    /// Report to the communicator's route timings (`algo::route_times`) that call `sig`, which `crossed` or
    /// staged, took this member from `started` until now, if it `moved` its data.
    fn took(&self, sig: &Signature, crossed: bool, started: Instant, moved: &Result<()>) {
        if let (Some(routes), Ok(())) = (self.store.routes(), moved) {
            routes.record(sig, self.store.members().len(), crossed, started.elapsed());
        }
    }

    /// The plan of a pairwise collective (`algo::layout`), from the layouts every member published for
    /// call `k`; `None` for the other kinds. Members whose layouts disagree all fail alike, with the
    /// mismatch naming them; `calls` are the (agreeing) signatures.
    fn plan(
        &self,
        call: &Call,
        sig: &Signature,
        k: u64,
        calls: Vec<(usize, Signature)>,
    ) -> Result<Option<Plan>> {
        let s = &self.store;
        if sig.kind != CollKind::AllToAll && !sig.kind.has_layout() {
            return Ok(None);
        }
        let w = layout::words(sig.kind, s.members().len());
        // SAFETY: every member wrote its `w` words (the signatures agree on the kind) before arriving;
        // the buffer is rewritten only for call k + 2 (see the one-shot buffers).
        let layouts: Vec<&[u64]> = (0..s.members().len())
            .map(|j| unsafe { std::slice::from_raw_parts(s.layout(j, k), w) })
            .collect();
        match Plan::new(sig, call.dtype.size(), call.root, &layouts, s.members()) {
            Ok(plan) => Ok(Some(plan)),
            Err(Fault::Disagree(details)) => Err(mismatch_error(s.members(), details, &calls)),
            Err(Fault::Overflow) => Err(Error::invalid(format!(
                "{sig}: a member published sizes that overflow (corrupted segment?)"
            ))),
        }
    }

    /// The communicator over `ranks`, whose waits last `timeout` (None: this communicator's).
    fn split(&self, ranks: &[usize], timeout: Option<Duration>) -> Result<Self> {
        let members = call::validate_ranks(ranks, self.store.world_size())?;
        let index = call::index_of(&members, self.store.rank(), "the calling")?;
        let timeout = call::checked_timeout(timeout.unwrap_or_else(|| self.store.timeout()))?;
        let store = self.store.split(members, index, timeout)?;
        Ok(Engine::with_lanes(store, self.lanes.child(), self.names.clone()))
    }

    /// A send or receive (`p2p`): the peer checked, then the world's own point-to-point path, recorded.
    fn p2p(&self, p2p: P2p, what: &str, op: String, go: impl FnOnce(&str) -> Result<()>) -> Result<()> {
        let peer = p2p.peer.unwrap_or(usize::MAX);
        call::peer(self.store.members(), self.store.rank(), peer, what).map_err(|e| self.fail(e))?;
        self.check_abort(&op, false)?;
        let flight = self.flight.begin_shared(Recorded::P2p(p2p), (p2p.count, p2p.count));
        let result = go(&op).map_err(|e| self.fail(e));
        self.flight.end(flight, result.is_ok(), None, p2p.bytes());
        result
    }

    /// A receive from any other member: `go` gets them in the order to try (round robin from the one
    /// after the previous such receive's sender) and returns the sender.
    /// `p2p` describes it, recorded.
    fn recv_any(
        &self,
        p2p: P2p,
        op: String,
        go: impl FnOnce(&[usize], &str) -> Result<usize>,
    ) -> Result<usize> {
        let (members, me) = (self.store.members(), self.store.rank());
        call::any_peer(members, me).map_err(|e| self.fail(e))?;
        self.check_abort(&op, false)?;
        let start = self.any_next.load(Relaxed) % members.len();
        let from: Vec<usize> =
            members[start..].iter().chain(&members[..start]).copied().filter(|&r| r != me).collect();
        let mut flight = self.flight.begin_shared(Recorded::P2p(p2p), (p2p.count, p2p.count));
        let got = go(&from, &op).map_err(|e| self.fail(e));
        if let Ok(src) = got {
            flight.received_from(src);
        }
        self.flight.end(flight, got.is_ok(), None, p2p.bytes());
        let src = got?;
        let at = members.iter().position(|&r| r == src).unwrap_or(0);
        self.any_next.store(at + 1, Relaxed);
        Ok(src)
    }
}
