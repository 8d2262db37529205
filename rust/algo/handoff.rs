//! How dearly this process pays, right now, for handing data to and from its peers' cores: the cost
//! that decides between the staged pipeline and cross-memory copies for mid-size calls
//! (`cma::offer`).
//!
//! Staging copies every byte twice, into lines a peer's core last read and out of lines it just
//! wrote; the kernel's cross-memory copy moves it once, at its own slower speed. Which wins depends on
//! how far apart the cores are, and on a VM that changes while a job runs: on this machine's kind, for
//! seconds to minutes at a time, a 128 KiB copy into lines another core holds takes 19.8 us instead of
//! 4.9 (out of lines it just wrote: 10.6 against 3.0), while the kernel's copy hardly changes. 2 ranks,
//! 256 KiB: all_reduce staged then takes 80 us against 50 through the kernel (25 against 39 the rest
//! of the time), broadcast 61 against 22 (17 against 16).
//!
//! So the staged pipeline times its copies into its staging and out of its peers' ([`Handoff::record`];
//! calls of at most `HANDOFF_CALL_MAX`, whose data stays in cache), and while every recent sample of
//! either kind is slow, this member asks that calls too small to cross by size cross anyway
//! ([`Handoff::cross`]). A call crosses when any member asks (`cma::offer`): a broadcast's root sees
//! its slow copies in, the others only their reads. Calls whose number is a multiple of
//! [`HANDOFF_PROBE_EVERY`] stage on every member, so the costs are measured again; samples older than
//! `HANDOFF_FRESH` no longer count, so calls too large to report stage by size again.

use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::config::{HANDOFF_FRESH, HANDOFF_PROBE_EVERY, HANDOFF_SAMPLE_MIN, HANDOFF_SLOW_NS_PER_KIB};

/// Nanoseconds since this process first asked (a clock to stamp samples with in an atomic).
fn now() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    u64::try_from(EPOCH.get_or_init(Instant::now).elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// Samples kept of each kind: a kind is slow only when all of them are, so a copy that lost its core
/// for a moment does not switch routes.
const WINDOW: usize = 8;

/// Which copy a sample timed.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Side {
    /// Into this member's staging, whose lines peers read last.
    In,
    /// Out of a peer's staging, lines it just wrote.
    Out,
}

/// The last `WINDOW` samples of one kind, in nanoseconds per KiB (0: none yet, which reads as fast),
/// and when the last one came ([`now`]).
#[derive(Debug, Default)]
struct Window {
    samples: [AtomicU32; WINDOW],
    next: AtomicUsize,
    last: AtomicU64,
}

impl Window {
    fn record(&self, per_kib: u32, at: u64) {
        let slot = self.next.fetch_add(1, Relaxed) % WINDOW;
        self.samples[slot].store(per_kib.max(1), Relaxed);
        self.last.store(at, Relaxed);
    }

    fn slow(&self, at: u64) -> bool {
        let fresh = at.saturating_sub(self.last.load(Relaxed)) < HANDOFF_FRESH.as_nanos() as u64;
        fresh && self.samples.iter().all(|s| s.load(Relaxed) > HANDOFF_SLOW_NS_PER_KIB)
    }
}

/// This process's recent copy costs, shared by its groups in one world.
#[derive(Debug, Default)]
pub(crate) struct Handoff {
    into: Window,
    out: Window,
}

impl Handoff {
    /// A copy of `bytes` that took `took`. Copies too small to time well are ignored.
    pub(crate) fn record(&self, side: Side, bytes: usize, took: Duration) {
        if bytes < HANDOFF_SAMPLE_MIN {
            return;
        }
        let per_kib = u32::try_from(took.as_nanos().saturating_mul(1024) / bytes as u128).unwrap_or(u32::MAX);
        match side {
            Side::In => self.into.record(per_kib, now()),
            Side::Out => self.out.record(per_kib, now()),
        }
    }

    /// Whether every recent copy in, or every recent copy out, was slow (the last of them less than
    /// `HANDOFF_FRESH` ago).
    fn slow(&self) -> bool {
        let at = now();
        self.into.slow(at) || self.out.slow(at)
    }

    /// Whether this member asks call `k`, too small to cross by its size, to cross: while copies are
    /// slow, but not on the calls every member stages to measure again.
    pub(crate) fn cross(&self, k: u64) -> bool {
        k % HANDOFF_PROBE_EVERY != 0 && self.slow()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KIB: usize = 1024;

    fn at(ns_per_kib: u32) -> Duration {
        Duration::from_nanos(u64::from(ns_per_kib) * 128)
    }

    #[test]
    fn crosses_after_a_window_of_slow_copies_of_either_kind_but_on_probe_calls_and_one_fast_copy_ends_it() {
        let limit = HANDOFF_SLOW_NS_PER_KIB;
        for copy in [Side::In, Side::Out] {
            let h = Handoff::default();
            assert!(!h.cross(1), "no samples read as fast");
            for i in 0..WINDOW {
                assert!(!h.slow(), "{copy:?}: {i} slow samples of {WINDOW}");
                h.record(copy, 128 * KIB, at(limit * 2));
            }
            assert!(h.slow() && h.cross(1) && h.cross(HANDOFF_PROBE_EVERY + 1));
            assert!(!h.cross(0) && !h.cross(3 * HANDOFF_PROBE_EVERY), "probe calls stage");
            // A copy that lost its core for a moment does not end it, nor does one too small to time,
            // nor a fast copy of the other kind.
            h.record(copy, 128 * KIB, at(limit * 100));
            h.record(copy, HANDOFF_SAMPLE_MIN - 1, Duration::ZERO);
            let other = if matches!(copy, Side::In) { Side::Out } else { Side::In };
            h.record(other, 128 * KIB, at(1));
            assert!(h.slow());
            h.record(copy, 128 * KIB, at(limit / 2));
            assert!(!h.slow() && !h.cross(1));
            // One slow copy among fast ones does not start it.
            let h = Handoff::default();
            for i in 0..3 * WINDOW {
                h.record(copy, 128 * KIB, at(if i % WINDOW == 3 { limit * 2 } else { 1 }));
                assert!(!h.slow(), "{copy:?} {i}");
            }
        }
        // Samples go stale: with no new ones for HANDOFF_FRESH, copies read as fast again.
        let h = Handoff::default();
        for _ in 0..WINDOW {
            h.record(Side::In, 128 * KIB, at(HANDOFF_SLOW_NS_PER_KIB * 2));
        }
        let later = now() + HANDOFF_FRESH.as_nanos() as u64;
        assert!(h.into.slow(now()) && !h.into.slow(later));
    }
}
