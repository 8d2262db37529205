//! The in-process world's state and its engine store: communicators' control blocks in ordinary
//! memory, buffer addresses published as they are, a private futex per communicator.

use std::cell::UnsafeCell;
use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::mailbox::Mailbox;
use crate::algo::route::Place;
use crate::config::INLINE;
use crate::dtype::{Buf, BufMut};
use crate::engine::{Cause, Ctrl, Published, Splits, Store};
use crate::error::{Error, Result};
use crate::signature::Signature;
use crate::sync::lock;
use crate::sync::wait::{Event, Wait};

/// Two one-shot buffers of a member (call k uses `k % 2`).
type OneShot = [UnsafeCell<[u64; INLINE / 8]>; 2];

/// Two layout buffers of a member (call k uses `k % 2`), of `2 * n` words each.
type Layouts = [Box<[UnsafeCell<u64>]>; 2];

/// The shared state of one communicator (the world, or one subgroup).
struct Comm {
    members: Vec<usize>,
    ctrls: Box<[Ctrl]>,
    oneshot: Box<[OneShot]>,
    layouts: Box<[Layouts]>,
    event: Event,
}

// SAFETY: one-shot and layout buffers are written only by their member and read by peers only between that
// member's release store of `arrive` and the buffer's reuse two calls later (engine module docs).
unsafe impl Sync for Comm {}

impl Comm {
    fn new(members: Vec<usize>) -> Self {
        let n = members.len();
        let oneshot = (0..n).map(|_| [UnsafeCell::new([0; INLINE / 8]), UnsafeCell::new([0; INLINE / 8])]);
        let words = || (0..2 * n).map(|_| UnsafeCell::new(0)).collect();
        Comm {
            ctrls: (0..n).map(|_| Ctrl::default()).collect(),
            oneshot: oneshot.collect(),
            layouts: (0..n).map(|_| [words(), words()]).collect(),
            members,
            event: Event::default(),
        }
    }
}

/// A communicator's members and which of their splits over that rank set made it (0: the world).
type CommKey = (Vec<usize>, u32);

/// Who aborted the world, why, and the ranks that never arrived when the cause was a timeout.
type Reason = (usize, String, Vec<usize>);

/// The state of one in-process world, shared by every rank's handles.
pub(crate) struct Shared {
    size: usize,
    timeout: Duration,
    aborted: AtomicBool,
    reason: Mutex<Option<Reason>>,
    comms: Mutex<HashMap<CommKey, Arc<Comm>>>,
    /// Per rank: its splits of each rank set.
    splits: Vec<Splits>,
    /// Per rank: it said it will make no more calls (its thread is ending), so nobody should wait for it.
    departed: Vec<AtomicBool>,
    mailbox: Mailbox,
}

impl Shared {
    pub(crate) fn new(size: usize, timeout: Duration) -> Self {
        Shared {
            size,
            timeout,
            aborted: AtomicBool::new(false),
            reason: Mutex::new(None),
            comms: Mutex::new(HashMap::new()),
            splits: (0..size).map(|_| Splits::default()).collect(),
            departed: (0..size).map(|_| AtomicBool::new(false)).collect(),
            mailbox: Mailbox::default(),
        }
    }

    fn comm(&self, members: Vec<usize>, occurrence: u32) -> Arc<Comm> {
        let mut comms = lock(&self.comms);
        comms.entry((members.clone(), occurrence)).or_insert_with(|| Arc::new(Comm::new(members))).clone()
    }

    /// Fails with who aborted the world and why, once it is aborted.
    pub(crate) fn check_abort(&self) -> Result<()> {
        if !self.aborted.load(SeqCst) {
            return Ok(());
        }
        let (by, reason, _) = lock(&self.reason).clone().unwrap_or((usize::MAX, String::new(), Vec::new()));
        Err(Error::aborted(by, reason))
    }

    /// Abort the world on behalf of rank `by`, recording the ranks whose absence caused it; the first
    /// reason wins. Wakes every sleeper.
    fn abort(&self, by: usize, reason: &str, missing: &[usize]) {
        {
            let mut r = lock(&self.reason);
            if r.is_none() {
                *r = Some((by, reason.to_string(), missing.to_vec()));
            }
            self.aborted.store(true, SeqCst);
        }
        self.wake_all();
    }

    fn wake_all(&self) {
        for comm in lock(&self.comms).values() {
            comm.event.notify(false);
        }
        self.mailbox.wake_all();
    }

    /// Fails when `rank` has left the world, naming it: a wait for it could only time out.
    pub(crate) fn check_present(&self, rank: usize, op: &str) -> Result<()> {
        if self.departed[rank].load(SeqCst) {
            return Err(Error::PeerDied {
                peer: rank,
                op: op.to_string(),
                detail: Some("its thread left the world (e.g. its spawn function returned)".into()),
                progress: String::new(),
            });
        }
        Ok(())
    }
}

/// One rank's view of one communicator of the in-process world.
pub(crate) struct ThreadStore {
    shared: Arc<Shared>,
    comm: Arc<Comm>,
    index: usize,
    rank: usize,
    /// How long waits on this communicator last (`Store::timeout`).
    timeout: Duration,
}

impl ThreadStore {
    /// Rank `rank`'s view of the world's own communicator.
    pub(crate) fn world(shared: &Arc<Shared>, rank: usize) -> Self {
        let comm = shared.comm((0..shared.size).collect(), 0);
        ThreadStore { shared: shared.clone(), comm, index: rank, rank, timeout: shared.timeout }
    }
}

impl Store for ThreadStore {
    const NAME: &'static str = "threads";

    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.shared.size
    }
    fn members(&self) -> &[usize] {
        &self.comm.members
    }
    fn index(&self) -> usize {
        self.index
    }
    fn timeout(&self) -> Duration {
        self.timeout
    }

    fn ctrl(&self, j: usize) -> &Ctrl {
        &self.comm.ctrls[j]
    }
    fn wait<'a>(&'a self, op: &'a dyn fmt::Display) -> Wait<'a> {
        Wait { event: &self.comm.event, shared: false, spin: self.spins(), timeout: self.timeout, op }
    }
    fn notify(&self) {
        self.comm.event.notify(false);
    }

    fn oneshot_bytes(&self) -> usize {
        INLINE
    }
    fn oneshot(&self, j: usize, k: u64) -> *mut u8 {
        self.comm.oneshot[j][(k % 2) as usize].get().cast()
    }

    fn layout(&self, j: usize, k: u64) -> *mut u64 {
        UnsafeCell::raw_get(self.comm.layouts[j][(k % 2) as usize].as_ptr())
    }

    fn share(&self, ptr: *const u8, _bytes: usize, _sig: &Signature) -> u64 {
        ptr.expose_provenance() as u64
    }
    fn places(
        &self,
        pages: &[Published],
        _sig: &Signature,
        _spans: &[(usize, usize)],
    ) -> Result<Vec<[Place; 2]>> {
        let here = |a: u64| Place::Here(std::ptr::with_exposed_provenance_mut::<u8>(a as usize));
        Ok(pages.iter().map(|p| [here(p.send), here(p.recv)]).collect())
    }

    fn aborted(&self) -> bool {
        self.shared.aborted.load(SeqCst)
    }
    fn abort_error(&self, op: &str, waiting: bool) -> Error {
        let err = self.shared.check_abort().err().unwrap_or_else(|| Error::aborted(usize::MAX, ""));
        let missing = lock(&self.shared.reason).as_ref().map(|r| r.2.clone()).unwrap_or_default();
        if waiting && !missing.is_empty() {
            return Error::timeout(self.rank, op, self.timeout, missing, self.comm.members.clone());
        }
        err
    }
    fn abort(&self, reason: &str, cause: Cause<'_>) {
        let missing = match cause {
            Cause::Missing(ranks) => ranks,
            Cause::Other | Cause::Dead(_) => &[],
        };
        self.shared.abort(self.rank, reason, missing);
    }
    fn check_alive(&self, ranks: &[usize], op: &str) -> Result<()> {
        ranks.iter().try_for_each(|&r| self.shared.check_present(r, op))
    }
    fn vanished(&self, _rank: usize, _op: &str) -> bool {
        // A rank thread cannot die without the process; one that left may still run queued work.
        false
    }

    fn send(&self, buf: Buf<'_>, dst: usize, tag: u64, op: &str) -> Result<()> {
        self.shared.mailbox.send(&self.shared, (self.rank, dst, tag), buf, op, self.timeout)
    }
    fn recv(&self, buf: BufMut<'_>, src: usize, tag: u64, op: &str) -> Result<()> {
        self.shared.mailbox.recv(&self.shared, (src, self.rank, tag), buf, op, self.timeout)
    }
    fn recv_any(&self, buf: BufMut<'_>, from: &[usize], tag: u64, op: &str) -> Result<usize> {
        self.shared.mailbox.recv_any(&self.shared, from, (self.rank, tag), buf, op, self.timeout)
    }

    fn split(&self, members: Vec<usize>, index: usize, timeout: Duration) -> Result<Self> {
        let occurrence = self.shared.splits[self.rank].next(&members);
        let comm = self.shared.comm(members, occurrence);
        Ok(ThreadStore { shared: self.shared.clone(), comm, index, rank: self.rank, timeout })
    }
    fn leave(&self) {
        self.shared.departed[self.rank].store(true, SeqCst);
        self.shared.wake_all();
    }
}
