//! Where a synchronizer's steps spent their time (`ddp.stats()`): each step's compute, the sync the
//! caller waited for, and the bucket communication that ran under the compute, from the stamps the
//! synchronizer takes for its buckets (the same stamps the timeline logs), on one monotonic clock.
//!
//! A step is one reduction: it starts when the owner says its first training forward began
//! ([`super::GradientSynchronizer::begin_step`], else at the first gradient handed in), its compute ends
//! when `finish` (or `sync_all`) is called, and it ends when that returns. Its communication is the time
//! at least one of its buckets' all-reduces was in flight: the union of each bucket's interval from its
//! launch to its return (a bucket queued behind an earlier one on the group's worker is in flight).

use std::collections::VecDeque;
use std::time::Instant;

use crate::flight;

/// Steps whose figures are kept one by one (older ones count only in the totals).
pub const STEPS_KEPT: usize = 100;

/// One step's figures (nanoseconds of the monotonic clock the bucket stamps use).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepRecord {
    /// Its position among the synchronizer's steps (0 for the first).
    pub step: u64,
    /// When it started, as wall-clock nanoseconds since the Unix epoch (the timeline's clock).
    pub start_ns: u64,
    /// From its start until `finish` was called: forward and backward, and the buckets started during
    /// backward.
    pub compute_ns: u64,
    /// From the call of `finish` until it returned: what the caller waited for after its compute.
    pub visible_ns: u64,
    /// Of `comm_ns`, the part before `finish` was called: communication hidden under compute.
    pub overlapped_ns: u64,
    /// Time at least one of its buckets' all-reduces was in flight.
    pub comm_ns: u64,
    /// Bytes of the buckets reduced (this rank's buffers: elements times element size).
    pub bytes: u64,
    /// Buckets reduced.
    pub buckets: u64,
}

/// One bucket's reduction in a step: launched, returned, its bytes.
#[derive(Debug, Clone, Copy)]
pub struct Reduction {
    /// When its all-reduce was started.
    pub launched: Instant,
    /// When it returned.
    pub done: Instant,
    /// Bytes of the bucket.
    pub bytes: u64,
}

fn ns(from: Instant, to: Instant) -> u64 {
    u64::try_from(to.saturating_duration_since(from).as_nanos()).unwrap_or(u64::MAX)
}

/// Nanoseconds of the union of `intervals` (`(from, to)`, each clipped to `[lo, hi]`).
fn union_ns(intervals: &mut [(Instant, Instant)], lo: Instant, hi: Instant) -> u64 {
    intervals.sort_unstable_by_key(|&(from, _)| from);
    let (mut total, mut reached) = (0u64, lo);
    for &(from, to) in intervals.iter() {
        let (from, to) = (from.max(reached), to.min(hi));
        if to > from {
            total = total.saturating_add(ns(from, to));
            reached = to;
        }
    }
    total
}

impl StepRecord {
    /// The figures of step `step`, begun at `start`, whose `finish` was called at `called` and returned
    /// at `returned`, with its buckets' `reductions`.
    pub fn new(
        step: u64,
        start: Instant,
        called: Instant,
        returned: Instant,
        reductions: &[Reduction],
    ) -> Self {
        let mut spans: Vec<(Instant, Instant)> = reductions.iter().map(|r| (r.launched, r.done)).collect();
        let first = spans.iter().map(|s| s.0).min().map_or(start, |f| f.min(start));
        let comm_ns = union_ns(&mut spans, first, returned.max(called));
        let overlapped_ns = union_ns(&mut spans, start, called);
        StepRecord {
            step,
            start_ns: flight::wall_ns(start),
            compute_ns: ns(start, called),
            visible_ns: ns(called, returned),
            overlapped_ns,
            comm_ns,
            bytes: reductions.iter().fold(0u64, |a, r| a.saturating_add(r.bytes)),
            buckets: reductions.len() as u64,
        }
    }
}

/// Every step's figures summed, and the last [`STEPS_KEPT`] one by one.
#[derive(Debug, Clone, Default)]
pub struct StepStats {
    /// The sums over every step (`step` holds the number of steps, `start_ns` the first one's start).
    pub totals: StepRecord,
    /// The last steps, oldest first.
    pub last: VecDeque<StepRecord>,
}

impl StepStats {
    /// The number the next step gets.
    pub fn next_step(&self) -> u64 {
        self.totals.step
    }

    /// Count `r` in.
    pub fn push(&mut self, r: StepRecord) {
        let t = &mut self.totals;
        if t.step == 0 {
            t.start_ns = r.start_ns;
        }
        t.step += 1;
        t.compute_ns = t.compute_ns.saturating_add(r.compute_ns);
        t.visible_ns = t.visible_ns.saturating_add(r.visible_ns);
        t.overlapped_ns = t.overlapped_ns.saturating_add(r.overlapped_ns);
        t.comm_ns = t.comm_ns.saturating_add(r.comm_ns);
        t.bytes = t.bytes.saturating_add(r.bytes);
        t.buckets = t.buckets.saturating_add(r.buckets);
        if self.last.len() == STEPS_KEPT {
            self.last.pop_front();
        }
        self.last.push_back(r);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn communication_is_the_union_of_the_buckets_and_overlap_its_part_before_finish() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        // Bucket 0 runs 2..6, bucket 1 was queued behind it at 4 and returns at 9, bucket 2 runs 12..15;
        // finish is called at 8 and returns at 15.
        let reductions = [
            Reduction { launched: at(2), done: at(6), bytes: 100 },
            Reduction { launched: at(4), done: at(9), bytes: 20 },
            Reduction { launched: at(12), done: at(15), bytes: 3 },
        ];
        let r = StepRecord::new(7, at(1), at(8), at(15), &reductions);
        let ms = |n: u64| n * 1_000_000;
        assert_eq!(
            (r.step, r.compute_ns, r.visible_ns, r.overlapped_ns, r.comm_ns),
            (7, ms(7), ms(7), ms(6), ms(10))
        );
        assert_eq!((r.bytes, r.buckets), (123, 3));
        assert_eq!(r.start_ns, flight::wall_ns(at(1)));

        let mut stats = StepStats::default();
        for _ in 0..STEPS_KEPT + 2 {
            let step = stats.next_step();
            stats.push(StepRecord { step, ..r });
        }
        let n = STEPS_KEPT as u64 + 2;
        assert_eq!((stats.totals.step, stats.totals.comm_ns, stats.totals.bytes), (n, n * ms(10), n * 123));
        assert_eq!(stats.last.len(), STEPS_KEPT);
        assert_eq!(stats.last.front().map(|r| r.step), Some(2));
    }

    #[test]
    fn a_step_without_buckets_is_all_compute_and_visible_time() {
        let t0 = Instant::now();
        let r = StepRecord::new(0, t0, t0 + Duration::from_micros(5), t0 + Duration::from_micros(7), &[]);
        assert_eq!(
            (r.compute_ns, r.visible_ns, r.overlapped_ns, r.comm_ns, r.buckets),
            (5000, 2000, 0, 0, 0)
        );
    }
}
