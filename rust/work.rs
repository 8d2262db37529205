//! Asynchronous work: per-communicator lanes, each a worker thread that runs its jobs in issue order,
//! and a [`Work`] handle that reports each job's result.
//!
//! A communicator has one lane for collectives and, per peer and tag, one for sends and one for
//! receives (point-to-point messages match by source and tag, in order per tag). So calls issued in
//! the same order on every rank meet in that order whatever object issued them (every group over one
//! communicator shares its lanes), and `isend` / `irecv` patterns complete at any size, as in MPI: a
//! receive never queues behind this rank's own send, which may wait for the peer's receive, and a
//! send with one tag never waits behind a send with another that the peer receives later. Receives
//! from any source have a lane per tag, and receives with one tag start in issue order across it and
//! the per-source lanes ([`Lane::follows`]), so they match messages in the order they were posted.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering::*};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::Instant;

use crate::config::SLICE;
use crate::error::{Error, Result};
use crate::sync::lock;
use crate::sync::wait::interrupted;

type Job = Box<dyn FnOnce() + Send>;

#[derive(Default)]
struct State {
    result: Mutex<Option<Result<()>>>,
    finished: Condvar,
}

/// The handle of one queued job.
#[derive(Clone, Default)]
pub struct Work {
    state: Arc<State>,
}

impl Work {
    /// Block until the job has run; returns its result (every call returns the same). Fails with
    /// [`Error::Interrupted`] when the interrupt hook fires (Ctrl-C) first; the job goes on.
    pub fn wait(&self) -> Result<()> {
        self.result_by(None)
            .unwrap_or_else(|| Err(Error::Interrupted { op: "a wait for queued work".into() }))
    }

    /// The job's result once it has run; None if `deadline` (when given) or Ctrl-C comes first.
    fn result_by(&self, deadline: Option<Instant>) -> Option<Result<()>> {
        let mut r = lock(&self.state.result);
        while r.is_none() {
            let nap = deadline.map_or(SLICE, |d| d.saturating_duration_since(Instant::now()).min(SLICE));
            if nap.is_zero() || interrupted() {
                return None;
            }
            r = self.state.finished.wait_timeout(r, nap).unwrap_or_else(|e| e.into_inner()).0;
        }
        r.clone()
    }

    /// The job's result if it has run, without waiting.
    pub fn result(&self) -> Option<Result<()>> {
        lock(&self.state.result).clone()
    }

    /// True once the job has run.
    pub fn is_completed(&self) -> bool {
        lock(&self.state.result).is_some()
    }

    fn finish(&self, result: Result<()>) {
        *lock(&self.state.result) = Some(result);
        self.state.finished.notify_all();
    }
}

/// Which lane of a communicator a call goes through.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum Lane {
    /// Every collective (they match by sequence number, so they must run in issue order).
    Collectives,
    /// Sends to a global rank with a tag (received in send order).
    Send {
        /// The destination's global rank.
        peer: usize,
        /// The message tag.
        tag: u64,
    },
    /// Receives from a global rank with a tag.
    Recv {
        /// The source's global rank.
        peer: usize,
        /// The message tag.
        tag: u64,
    },
    /// Receives from any source with a tag.
    RecvAny {
        /// The message tag.
        tag: u64,
    },
}

impl Lane {
    /// True when a job on `self` must start after the jobs already queued on `other` too: receives
    /// with one tag match in the order they were issued, from any source or from a given one (as
    /// MPI matches posted receives), while receives from different given sources stay independent.
    fn follows(self, other: Lane) -> bool {
        match (self, other) {
            (Lane::RecvAny { tag }, Lane::Recv { tag: t, .. })
            | (Lane::Recv { tag, .. }, Lane::RecvAny { tag: t }) => tag == t,
            _ => false,
        }
    }
}

/// A lazily started worker thread and the last job given to it.
struct Queue {
    inbox: Arc<Inbox>,
    last: Work,
}

/// The jobs given to a lane's worker thread. Not a channel: std's wakes the worker while the sender
/// still holds the channel's lock, so a worker woken on the sender's core (a busy machine puts it
/// there) preempts the sender, finds the lock taken and sleeps again: a third context switch per call.
/// Here the worker is woken after the lock is released.
struct Inbox {
    state: Mutex<Pending>,
    ready: Condvar,
}

/// An inbox's state, under its lock.
#[derive(Default)]
struct Pending {
    jobs: VecDeque<Job>,
    /// The lane is gone: the worker runs what is left and ends.
    closed: bool,
}

impl Queue {
    fn start() -> Queue {
        Queue { inbox: Inbox::serve(), last: Work::default() }
    }

    fn push(&mut self, job: Job) {
        lock(&self.inbox.state).jobs.push_back(job);
        self.inbox.ready.notify_one();
    }
}

impl Drop for Queue {
    fn drop(&mut self) {
        lock(&self.inbox.state).closed = true;
        self.inbox.ready.notify_one();
    }
}

impl Inbox {
    /// A new inbox, and its worker thread.
    fn serve() -> Arc<Inbox> {
        let inbox = Arc::new(Inbox { state: Mutex::default(), ready: Condvar::new() });
        let serving = inbox.clone();
        std::thread::Builder::new()
            .name("axonml-work".into())
            .spawn(move || serving.run())
            .expect("spawning a work thread");
        inbox
    }

    /// The worker thread's loop: the jobs in order, until the lane is gone and none is left. Jobs do
    /// not unwind: the one caller, [`crate::ProcessGroup::submit`], catches a panic (it fails the
    /// job's `Work` and aborts the world).
    fn run(&self) {
        loop {
            let job = {
                let mut pending = lock(&self.state);
                loop {
                    if let Some(job) = pending.jobs.pop_front() {
                        break job;
                    }
                    if pending.closed {
                        return;
                    }
                    pending = self.ready.wait(pending).unwrap_or_else(|e| e.into_inner());
                }
            };
            job();
        }
    }
}

/// The lanes of one communicator (see the module docs).
#[derive(Default)]
pub struct Lanes {
    own: Arc<Family>,
    /// The lanes of the world's communicator, where every communicator split from it (and from
    /// those) is listed, so that a rank that leaves can first let what it queued on any of them run.
    /// Empty for the world's own.
    world: Weak<Family>,
}

#[derive(Default)]
struct Family {
    queues: Mutex<HashMap<Lane, Queue>>,
    /// Jobs queued on any lane and not finished: with none, a flush (every blocking call makes one)
    /// has nothing to wait for and takes no lock.
    unfinished: Arc<AtomicUsize>,
    /// Only the world's: the lanes of every communicator split from it, while they exist.
    splits: Mutex<Vec<Weak<Family>>>,
}

impl Lanes {
    /// The lanes of a communicator split from this one.
    pub fn child(&self) -> Lanes {
        let world =
            if self.world.strong_count() > 0 { self.world.clone() } else { Arc::downgrade(&self.own) };
        let child = Lanes { own: Arc::default(), world };
        if let Some(w) = child.world.upgrade() {
            let mut splits = lock(&w.splits);
            splits.retain(|c| c.strong_count() > 0);
            splits.push(Arc::downgrade(&child.own));
        }
        child
    }

    /// Queue `job` on `lane`, after every job queued there before it. `job` must not unwind
    /// ([`crate::ProcessGroup::submit`] catches panics).
    pub fn submit(&self, lane: Lane, job: impl FnOnce() -> Result<()> + Send + 'static) -> Work {
        let work = Work::default();
        let handle = work.clone();
        let mut queues = lock(&self.own.queues);
        let before = Self::before(&queues, lane);
        let unfinished = self.own.unfinished.clone();
        unfinished.fetch_add(1, Relaxed);
        let task: Job = Box::new(move || {
            // Their results belong to their own works; only the order matters here.
            before.iter().for_each(|w| drop(w.result_by(None)));
            handle.finish(job());
            // Publishes the job's effects to a flush that reads none left.
            unfinished.fetch_sub(1, Release);
        });
        let q = queues.entry(lane).or_insert_with(Queue::start);
        q.push(task);
        q.last = work.clone();
        work
    }

    /// Wait for the last job of `lane` (and so for every earlier one). Its result belongs to its own
    /// `Work`; this fails only when interrupted.
    pub fn flush(&self, lane: Lane) -> Result<()> {
        if self.own.unfinished.load(Acquire) == 0 {
            return Ok(());
        }
        let last: Vec<Work> = {
            let queues = lock(&self.own.queues);
            queues.get(&lane).map(|q| q.last.clone()).into_iter().chain(Self::before(&queues, lane)).collect()
        };
        match last.iter().map(Work::wait).find(|r| matches!(r, Err(Error::Interrupted { .. }))) {
            Some(Err(e)) => Err(e),
            _ => Ok(()),
        }
    }

    /// The last jobs of the other lanes that a job on `lane` must follow ([`Lane::follows`]).
    fn before(queues: &HashMap<Lane, Queue>, lane: Lane) -> Vec<Work> {
        queues.iter().filter(|(other, _)| lane.follows(**other)).map(|(_, q)| q.last.clone()).collect()
    }

    /// Wait, until `deadline` at most, for what was queued on these lanes and, for the world's, on
    /// those of every communicator split from it: a rank leaving the world lets its queued sends
    /// reach their peers, without waiting long for a job that waits for a peer that waits for it.
    pub fn finish_queued(&self, deadline: Instant) {
        let splits: Vec<Arc<Family>> = lock(&self.own.splits).iter().filter_map(Weak::upgrade).collect();
        for family in std::iter::once(&self.own).chain(&splits) {
            let last: Vec<Work> = lock(&family.queues).values().map(|q| q.last.clone()).collect();
            if !last.iter().all(|w| w.result_by(Some(deadline)).is_some()) {
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// Every job runs once, in issue order, whether the worker sleeps between them or not.
    #[test]
    fn a_lane_runs_its_jobs_once_in_issue_order() {
        let lanes = Lanes::default();
        let ran = Arc::new(Mutex::new(vec![]));
        let works: Vec<Work> = (0..2000)
            .map(|i| {
                if i % 100 == 0 {
                    std::thread::sleep(Duration::from_millis(1)); // let the worker go to sleep
                }
                let ran = ran.clone();
                lanes.submit(Lane::Collectives, move || {
                    lock(&ran).push(i);
                    Ok(())
                })
            })
            .collect();
        assert!(works.iter().all(|w| w.wait().is_ok()));
        assert_eq!(*lock(&ran), (0..2000).collect::<Vec<_>>());
    }
}
