//! Point-to-point messages in the in-process world.
//!
//! A send posts a letter under (source, destination, tag); receives match letters in FIFO order per key.
//! Like MPI: messages up to [`EAGER`] bytes are copied into the letter and the send returns at once (so
//! send-before-receive patterns cannot deadlock on small messages); larger ones carry the address of the
//! sender's buffer, and the send waits until the receiver has copied straight from it (one copy). The
//! receiver checks dtype and length before copying; a mismatch fails the receiver, and the sender too
//! when it is still waiting.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU8, Ordering::*};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::store::Shared;
use crate::call;
use crate::config::{EAGER, SLICE};
use crate::dtype::{Buf, BufMut, DType};
use crate::error::{Error, Result};
use crate::sync::lock;
use crate::sync::wait::interrupted;

const QUEUED: u8 = 0;
const COPYING: u8 = 1;
const DELIVERED: u8 = 2;
const REFUSED: u8 = 3;

struct Letter {
    dtype: DType,
    len: usize,
    /// The sender's buffer (rendezvous), or the start of `_copy` (eager).
    data: *const u8,
    /// Owns the eager copy that `data` points into.
    _copy: Option<Vec<u8>>,
    state: AtomicU8,
}

// SAFETY: `data` points into `_copy`, or into the sender's buffer, which the sender keeps alive (blocked
// in `send`) until the letter leaves the QUEUED/COPYING states.
unsafe impl Send for Letter {}
// SAFETY: as above; the state is atomic and the data only read.
unsafe impl Sync for Letter {}

/// (source, destination, tag).
pub(crate) type Key = (usize, usize, u64);
type Guard<'a> = MutexGuard<'a, HashMap<Key, VecDeque<Arc<Letter>>>>;
/// A nap's outcome: the guard back, or why it ended (`None`: the deadline) with the guard.
type Nap<'a> = std::result::Result<Guard<'a>, (Option<Box<Error>>, Guard<'a>)>;

/// Every pending message of a world.
#[derive(Default)]
pub(crate) struct Mailbox {
    queues: Mutex<HashMap<Key, VecDeque<Arc<Letter>>>>,
    changed: Condvar,
}

impl Mailbox {
    fn lock(&self) -> Guard<'_> {
        lock(&self.queues)
    }

    pub(crate) fn wake_all(&self) {
        drop(self.lock());
        self.changed.notify_all();
    }

    /// Sleep one slice on the condition variable. Fails with the reason (`None`: the deadline passed)
    /// and gives the guard back; a departed peer fails it only once every one of `peers` has left (a
    /// receive from any source may still get a message from the others).
    fn nap<'a>(
        &'a self,
        world: &Shared,
        peers: &[usize],
        guard: Guard<'a>,
        deadline: Instant,
        op: &str,
    ) -> Nap<'a> {
        let all_gone = || match peers.iter().all(|&p| world.check_present(p, op).is_err()) {
            true => world.check_present(peers[0], op),
            false => Ok(()),
        };
        if let Err(e) = world.check_abort().and_then(|()| all_gone()) {
            return Err((Some(Box::new(e)), guard));
        }
        if interrupted() {
            return Err((Some(Box::new(Error::Interrupted { op: op.to_string() })), guard));
        }
        let now = Instant::now();
        if now >= deadline {
            return Err((None, guard));
        }
        let (g, _) =
            self.changed.wait_timeout(guard, SLICE.min(deadline - now)).unwrap_or_else(|e| e.into_inner());
        Ok(g)
    }

    /// Post `buf` under `(src, dst, tag)`; a large one waits (at most `timeout`) until it is received.
    pub(crate) fn send(
        &self,
        world: &Shared,
        (src, dst, tag): Key,
        buf: Buf<'_>,
        op: &str,
        timeout: Duration,
    ) -> Result<()> {
        let eager = buf.byte_len() <= EAGER;
        let copy = eager.then(|| buf.bytes().to_vec());
        let data = copy.as_ref().map_or(buf.as_ptr(), |c| c.as_ptr());
        let letter = Arc::new(Letter {
            dtype: buf.dtype(),
            len: buf.len(),
            data,
            _copy: copy,
            state: AtomicU8::new(QUEUED),
        });
        let deadline = Instant::now() + timeout;
        let mut q = self.lock();
        q.entry((src, dst, tag)).or_default().push_back(letter.clone());
        self.changed.notify_all();
        if eager {
            return Ok(());
        }
        loop {
            match letter.state.load(Acquire) {
                DELIVERED => return Ok(()),
                REFUSED => {
                    return Err(call::refused(src, op));
                }
                COPYING => {
                    // The receiver is copying from our buffer right now: wait it out, whatever the deadline.
                    q = self.changed.wait_timeout(q, SLICE).unwrap_or_else(|e| e.into_inner()).0;
                    continue;
                }
                _ => {}
            }
            q = match self.nap(world, &[dst], q, deadline, op) {
                Ok(g) => g,
                Err((e, mut g)) => {
                    if letter.state.load(Acquire) != QUEUED {
                        q = g;
                        continue;
                    }
                    if let Some(queue) = g.get_mut(&(src, dst, tag)) {
                        queue.retain(|l| !Arc::ptr_eq(l, &letter));
                    }
                    return Err(e.map_or_else(|| call::p2p_timeout(src, op, timeout, dst), |e| *e));
                }
            };
        }
    }

    /// Receive the first letter under `(src, dst, tag)` into `buf`, waiting at most `timeout`.
    pub(crate) fn recv(
        &self,
        world: &Shared,
        (src, dst, tag): Key,
        buf: BufMut<'_>,
        op: &str,
        timeout: Duration,
    ) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let mut q = self.lock();
        let letter = loop {
            if let Some(l) = q.get_mut(&(src, dst, tag)).and_then(VecDeque::pop_front) {
                l.state.store(COPYING, Release);
                break l;
            }
            q = match self.nap(world, &[src], q, deadline, op) {
                Ok(g) => g,
                Err((e, _)) => return Err(e.map_or_else(|| call::p2p_timeout(dst, op, timeout, src), |e| *e)),
            };
        };
        drop(q);
        self.take(&letter, buf, src, dst, op)
    }

    /// Receive into `buf` the first letter with `tag` to `dst` from one of `from` (the earliest in
    /// `from` that has one), waiting at most `timeout`; returns its sender.
    pub(crate) fn recv_any(
        &self,
        world: &Shared,
        from: &[usize],
        (dst, tag): (usize, u64),
        buf: BufMut<'_>,
        op: &str,
        timeout: Duration,
    ) -> Result<usize> {
        let deadline = Instant::now() + timeout;
        let mut q = self.lock();
        let (src, letter) = loop {
            let next = from.iter().find_map(|&s| Some((s, q.get_mut(&(s, dst, tag))?.pop_front()?)));
            if let Some((s, l)) = next {
                l.state.store(COPYING, Release);
                break (s, l);
            }
            q = match self.nap(world, from, q, deadline, op) {
                Ok(g) => g,
                Err((e, _)) => {
                    return Err(e.map_or_else(|| call::any_source_timeout(dst, op, timeout, from), |e| *e))
                }
            };
        };
        drop(q);
        self.take(&letter, buf, src, dst, op).map(|()| src)
    }

    /// Copy `letter` (from `src`, taken off its queue and marked COPYING) into `buf` when dtype and
    /// length match, else refuse it; the sender learns which either way.
    fn take(&self, letter: &Letter, mut buf: BufMut<'_>, src: usize, dst: usize, op: &str) -> Result<()> {
        let result = if letter.dtype != buf.dtype() || letter.len != buf.len() {
            letter.state.store(REFUSED, Release);
            Err(call::wrong_message(dst, op, letter.len as u64, &letter.dtype, src))
        } else {
            // SAFETY: same dtype and length, checked above; the sender is blocked until DELIVERED.
            unsafe { std::ptr::copy_nonoverlapping(letter.data, buf.as_mut_ptr(), buf.byte_len()) };
            letter.state.store(DELIVERED, Release);
            Ok(())
        };
        self.wake_all();
        result
    }
}
