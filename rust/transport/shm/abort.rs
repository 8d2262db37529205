//! The world's abort word (in the header) and peer liveness: how a failing rank stops every other
//! rank, and how waits find dead peers.

use std::sync::atomic::Ordering::*;
use std::time::{Duration, Instant};

use super::layout::{FREE, MAX_COMMS, REASON};
use super::shared::Shared;
use crate::engine::Cause;
use crate::error::{Error, Result};
use crate::sync::wait::{may_spin, Event, Stop, Wait};

impl Shared {
    /// Fails when the world was aborted: a dead peer or missing ranks are reported as such to every
    /// rank waiting in a collective (`waiting`: the members it waits for); otherwise who aborted and why.
    pub(crate) fn check_abort(&self, op: &str, waiting: Option<&[usize]>) -> Result<()> {
        let h = self.header();
        if h.abort_state.load(Acquire) == 0 {
            return Ok(());
        }
        // The aborting rank writes its reason between states 1 and 2: a few stores. If it died right
        // there, report what is known after a short grace.
        let start = Instant::now();
        while h.abort_state.load(Acquire) != 2 && start.elapsed() < Duration::from_millis(20) {
            std::thread::yield_now();
        }
        let by = h.abort_by.load(Acquire) as usize;
        let peer = h.abort_peer.load(Acquire);
        let missing = h.abort_missing.load(Acquire);
        let len = (h.abort_len.load(Acquire) as usize).min(REASON);
        // SAFETY: the reason is written once, before state 2 (acquired above); a torn read of a dead
        // writer's bytes is only a garbled message.
        let bytes = unsafe { std::ptr::read_volatile(h.abort_reason.get()) };
        let reason = String::from_utf8_lossy(&bytes[..len]).into_owned();
        if (peer as usize) < self.size {
            // The rank that found it dead named it (`check_alive`); this rank watches it too, and asks
            // how it ended itself.
            return Err(self.liveness.exited(peer as usize, op));
        }
        match waiting {
            Some(group) if missing != 0 => Err(Error::Timeout {
                rank: self.rank,
                op: op.to_string(),
                waited: self.timeout,
                missing: (0..self.size).filter(|r| missing >> r & 1 == 1).collect(),
                group: group.to_vec(),
                progress: String::new(),
            }),
            _ => Err(Error::aborted(by, reason)),
        }
    }

    /// Abort the world on behalf of this rank (the first abort wins) and wake every waiter.
    pub(crate) fn abort(&self, reason: &str, cause: Cause) {
        let h = self.header();
        if h.abort_state.compare_exchange(0, 1, SeqCst, SeqCst).is_ok() {
            let bytes = reason.as_bytes();
            let len = bytes.len().min(REASON);
            // SAFETY: only the CAS winner writes the reason, once, before publishing state 2.
            unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), h.abort_reason.get().cast::<u8>(), len) };
            h.abort_by.store(self.rank as u32, Relaxed);
            if let Cause::Dead(peer) = cause {
                h.abort_peer.store(peer as u32, Relaxed);
            }
            if let Cause::Missing(ranks) = cause {
                h.abort_missing.store(ranks.iter().fold(0, |m, r| m | 1 << r), Relaxed);
            }
            h.abort_len.store(len as u32, Relaxed);
            h.abort_state.store(2, Release);
        }
        h.event.notify(true);
        for slot in 0..MAX_COMMS {
            let c = self.comm_head(slot);
            if c.state.load(Acquire) != FREE {
                c.event.notify(true);
            }
        }
        for src in 0..self.size {
            h.inbox[src].notify(true);
            for dst in 0..self.size {
                self.chan(src, dst).0.event.notify(true);
            }
        }
    }

    /// Fails (and aborts the world) when one of `ranks` has died.
    pub(crate) fn check_alive(&self, ranks: &[usize], op: &str) -> Result<()> {
        match self.liveness.first_dead(ranks) {
            None => Ok(()),
            Some(peer) => {
                let pid = self.liveness.pid(peer);
                // Abort first: the other ranks must not wait while this one learns the exit status.
                self.abort(&format!("rank {peer} (pid {pid}) exited during {op}"), Cause::Dead(peer));
                Err(self.liveness.exited(peer, op))
            }
        }
    }

    /// Wait on `event` until `ready`, for at most `timeout`, checking abort and the liveness of `ranks`.
    /// `Err(None)` means the deadline passed.
    pub(crate) fn wait(
        &self,
        event: &Event,
        ranks: &[usize],
        op: &str,
        timeout: Duration,
        ready: impl FnMut() -> bool,
    ) -> std::result::Result<(), Option<Error>> {
        let w = Wait {
            event,
            shared: true,
            // Every rank of the world is a process on this host competing for its cores.
            spin: may_spin(self.size),
            timeout,
            op: &op,
        };
        match w.until(ready, || self.check_abort(op, Some(ranks)), || self.check_alive(ranks, op)) {
            Ok(()) => Ok(()),
            Err(Stop::Failed(e)) => Err(Some(e)),
            Err(Stop::TimedOut) => Err(None),
        }
    }
}
