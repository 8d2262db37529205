//! What each route took lately, on this member, for each class of calls that could take either: the
//! choice between the staged pipeline and cross-memory copies (`route::offer`) for calls under
//! `ROUTE_TIMED_BELOW`.
//!
//! Which route wins depends on the machine and, on a VM, on the moment: staging copies every byte
//! twice, into lines a peer's core last read and out of lines it just wrote, and the kernel's copy
//! moves it once at its own speed. No size threshold fits every host, nor one host at every moment
//! (the measurements are in the docs of the Python bench, `bench.procs`), so each member times both
//! and asks for the faster.
//!
//! A class is a kind, a group size and the power of two of the call's largest buffer. Every call of a
//! class that took either route reports how long this member took from the end of the arrival wait
//! (`RouteTimes::record`), per KiB of that buffer: to the end of its share when it staged, to the end
//! of every member's share when it crossed (its drain), as a staged call ends for the member that
//! steps last. Each communicator keeps its own timings, so its members count the same calls.
//!
//! Until each route has `ROUTE_LEARN` samples, the class's calls alternate in runs of `ROUTE_RUN`
//! calls, staging first (by the count of calls recorded, the same on every member, which runs the same
//! calls); then a member asks to cross when the best of its last `ROUTE_WINDOW` crossing samples beats
//! the best staged one. The best, not the median: a lost time slice only ever adds time, and so does
//! the first call of a route after the other (its lines sit in the other route's places), which could
//! keep a class on the slower route for a whole run (`bench.procs`). The cost:
//! a route that is now and then much faster than usual wins while such a sample is in its window, even
//! if it is slower on average. Of every `ROUTE_PROBE_EVERY` calls, one run stages on every member and
//! one crosses on every member, so a route that lost keeps being measured. A call crosses when any
//! member asks (`route::offer`), so members that disagree never split.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use super::spans;
use crate::config::{CMA_MIN, ROUTE_LEARN, ROUTE_PROBE_EVERY, ROUTE_RUN, ROUTE_TIMED_BELOW, ROUTE_WINDOW};
use crate::signature::{CollKind, Signature};

/// Calls timed together: same kind, group size and power of two of the largest buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Class {
    kind: CollKind,
    n: usize,
    log2: u32,
}

/// The class of call `sig` in a group of `n`, with the bytes of its largest buffer; `None` for calls
/// chosen by size alone (the pairwise kinds, reduce_scatter_v, calls of `ROUTE_TIMED_BELOW` or more)
/// and for those that always stage (a buffer under `CMA_MIN`).
fn class(sig: &Signature, n: usize) -> Option<(Class, usize)> {
    let timed = matches!(
        sig.kind,
        CollKind::AllReduce
            | CollKind::Reduce
            | CollKind::ReduceScatter
            | CollKind::Broadcast
            | CollKind::AllGather
            | CollKind::Gather
            | CollKind::Scatter
    );
    let (send, recv) = spans(sig, n, true);
    let bytes = send.max(recv);
    // A call some member must stage (a buffer under CMA_MIN, which it withholds) has no choice.
    let (s, r) = spans(sig, n, false);
    let smallest = [send, recv, s, r].into_iter().filter(|&b| b > 0).min().unwrap_or(0);
    (timed && smallest >= CMA_MIN && bytes < ROUTE_TIMED_BELOW)
        .then(|| (Class { kind: sig.kind, n, log2: bytes.ilog2() }, bytes))
}

/// The last `ROUTE_WINDOW` samples of one route, in nanoseconds per KiB, and how many came in all.
#[derive(Debug, Default)]
struct Window {
    samples: [u64; ROUTE_WINDOW],
    seen: u64,
}

impl Window {
    fn push(&mut self, per_kib: u64) {
        self.samples[(self.seen % ROUTE_WINDOW as u64) as usize] = per_kib;
        self.seen += 1;
    }

    /// The fastest of the samples kept (module docs).
    fn best(&self) -> u64 {
        self.samples[..(self.seen as usize).min(ROUTE_WINDOW)].iter().copied().min().unwrap_or(0)
    }
}

/// Both routes' samples of one class.
#[derive(Debug, Default)]
struct Times {
    staged: Window,
    crossed: Window,
}

impl Times {
    /// Whether this member asks the next call of the class to cross.
    fn ask(&self) -> bool {
        let (s, c) = (&self.staged, &self.crossed);
        let calls = s.seen + c.seen;
        if s.seen < ROUTE_LEARN || c.seen < ROUTE_LEARN {
            // Learning: runs of each route in turn, staging first.
            return (calls / ROUTE_RUN) % 2 == 1;
        }
        match calls % ROUTE_PROBE_EVERY {
            p if p < ROUTE_RUN => false,
            p if (ROUTE_PROBE_EVERY / 2..ROUTE_PROBE_EVERY / 2 + ROUTE_RUN).contains(&p) => true,
            _ => c.best() < s.best(),
        }
    }
}

/// One communicator's route timings on this member.
#[derive(Debug, Default)]
pub(crate) struct RouteTimes {
    classes: Mutex<HashMap<Class, Times>>,
}

impl RouteTimes {
    fn classes(&self) -> std::sync::MutexGuard<'_, HashMap<Class, Times>> {
        // The map holds plain numbers: a panic elsewhere cannot leave it half-updated.
        self.classes.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether this member asks call `sig` (in a group of `n`) to cross; `None` when the call is not
    /// timed, and its size decides.
    pub(crate) fn ask(&self, sig: &Signature, n: usize) -> Option<bool> {
        let (c, _) = class(sig, n)?;
        Some(self.classes().get(&c).is_some_and(Times::ask))
    }

    /// Call `sig` (in a group of `n`) took `took` on this member, `crossed` or staged.
    pub(crate) fn record(&self, sig: &Signature, n: usize, crossed: bool, took: Duration) {
        let Some((c, bytes)) = class(sig, n) else { return };
        let per_kib = u64::try_from(took.as_nanos().saturating_mul(1024) / bytes as u128).unwrap_or(u64::MAX);
        let mut classes = self.classes();
        let times = classes.entry(c).or_default();
        if crossed {
            times.crossed.push(per_kib);
        } else {
            times.staged.push(per_kib);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;

    fn all_reduce(bytes: usize) -> Signature {
        Signature::new(CollKind::AllReduce, 1, bytes / 4).dtype(DType::F32)
    }

    #[test]
    fn classes_learn_both_routes_then_keep_the_faster_and_probe_the_other() {
        let r = RouteTimes::default();
        let s = all_reduce(1 << 20);
        // Run `calls` calls, staging taking `staged` us and crossing `crossed`; which ones crossed.
        let run = |calls: u64, staged: u64, crossed: u64| -> Vec<bool> {
            (0..calls)
                .map(|_| {
                    let cross = r.ask(&s, 2).expect("timed");
                    r.record(&s, 2, cross, Duration::from_micros(if cross { crossed } else { staged }));
                    cross
                })
                .collect()
        };
        // Whether call number `t` of the class (counted from 0) is a probe run of staging / crossing.
        let (probe_stage, probe_cross) = (
            |t: u64| t % ROUTE_PROBE_EVERY < ROUTE_RUN,
            |t: u64| {
                (ROUTE_PROBE_EVERY / 2..ROUTE_PROBE_EVERY / 2 + ROUTE_RUN).contains(&(t % ROUTE_PROBE_EVERY))
            },
        );
        let learn = 2 * ROUTE_LEARN;
        let first = run(learn + 2 * ROUTE_PROBE_EVERY, 30, 10);
        let pattern: Vec<bool> = (0..learn).map(|t| (t / ROUTE_RUN) % 2 == 1).collect();
        assert_eq!(first[..learn as usize], pattern[..], "alternates in runs first, staging first");
        assert_eq!(pattern.iter().filter(|&&c| c).count() as u64, ROUTE_LEARN);
        // After learning, crossing wins, but for the staged probe runs.
        for t in learn..first.len() as u64 {
            assert_eq!(first[t as usize], !probe_stage(t), "call {t}");
        }
        // When crossing turns slow, its own calls report it at once: staging wins again once the fast
        // samples left the window, and then only the probe runs cross.
        let start = first.len() as u64;
        let turned = run(2 * ROUTE_PROBE_EVERY, 30, 90);
        let flipped = turned.iter().position(|&c| !c).expect("stages again");
        assert_eq!(flipped, ROUTE_WINDOW, "staged again once the fast samples left the window");
        for (j, &c) in turned.iter().enumerate().skip(ROUTE_WINDOW + ROUTE_RUN as usize) {
            assert_eq!(c, probe_cross(start + j as u64), "call {}", start + j as u64);
        }
    }

    #[test]
    fn slow_samples_do_not_change_the_route() {
        let r = RouteTimes::default();
        let s = all_reduce(256 << 10);
        for i in 0..3 * ROUTE_PROBE_EVERY {
            let cross = r.ask(&s, 2).unwrap();
            if i >= 2 * ROUTE_LEARN && i % ROUTE_PROBE_EVERY >= ROUTE_RUN {
                assert!(cross, "call {i} staged");
            }
            // Crossing usually takes 10 us, staging 30; every 4th call lost its core for 1 ms.
            let us = if i % 4 == 3 {
                1000
            } else if cross {
                10
            } else {
                30
            };
            r.record(&s, 2, cross, Duration::from_micros(us));
        }
    }

    #[test]
    fn the_first_call_after_the_other_route_does_not_count_against_it() {
        // Crossing takes 18 us, staging 30, but the first call of a route after the other takes 20 us
        // more for crossing and 1 us more for staging: the slower first calls must not decide.
        let r = RouteTimes::default();
        let s = all_reduce(256 << 10);
        let mut last = None;
        for t in 0..3 * ROUTE_PROBE_EVERY {
            let cross = r.ask(&s, 2).unwrap();
            if t >= 2 * ROUTE_LEARN && t % ROUTE_PROBE_EVERY >= ROUTE_RUN {
                assert!(cross, "call {t} staged");
            }
            let cold = last.is_some_and(|l| l != cross);
            let us = match (cross, cold) {
                (true, false) => 18,
                (true, true) => 38,
                (false, false) => 30,
                (false, true) => 31,
            };
            r.record(&s, 2, cross, Duration::from_micros(us));
            last = Some(cross);
        }
    }

    #[test]
    fn classes_are_kind_group_and_power_of_two_and_large_or_pairwise_calls_are_not_timed() {
        let r = RouteTimes::default();
        let s = all_reduce(1 << 20);
        for _ in 0..2 * ROUTE_LEARN {
            let cross = r.ask(&s, 2).unwrap();
            r.record(&s, 2, cross, Duration::from_micros(if cross { 10 } else { 30 }));
        }
        assert_eq!(r.ask(&s, 2), Some(true));
        // The same class up to the next power of two; another size, group or kind learns anew.
        assert_eq!(r.ask(&all_reduce((2 << 20) - 4), 2), Some(true));
        assert_eq!(r.ask(&all_reduce(2 << 20), 2), Some(false));
        assert_eq!(r.ask(&s, 3), Some(false));
        let b = Signature::new(CollKind::Broadcast, 1, (1 << 20) / 4).dtype(DType::F32);
        assert_eq!(r.ask(&b, 2), Some(false));
        // all_gather by its output, reduce_scatter by its input: the call's largest buffer.
        let g = Signature::new(CollKind::AllGather, 1, ROUTE_TIMED_BELOW / 4 / 2).dtype(DType::F32);
        assert_eq!(r.ask(&g, 2), None);
        let rs = Signature::new(CollKind::ReduceScatter, 1, ROUTE_TIMED_BELOW / 4 / 2).dtype(DType::F32);
        assert_eq!(r.ask(&rs, 2), None);
        // Calls with a buffer under CMA_MIN always stage: nothing to choose.
        let gather = |part: usize| Signature::new(CollKind::AllGather, 1, part / 4).dtype(DType::F32);
        assert_eq!(r.ask(&gather(CMA_MIN - 4), 2), None);
        assert_eq!(r.ask(&gather(CMA_MIN), 2), Some(false));
        assert_eq!(r.ask(&all_reduce(ROUTE_TIMED_BELOW - 4), 2), Some(false));
        assert_eq!(r.ask(&all_reduce(ROUTE_TIMED_BELOW), 2), None);
        assert_eq!(r.ask(&all_reduce(CMA_MIN - 4), 2), None);
        let a = Signature::new(CollKind::AllToAll, 1, 1 << 20).dtype(DType::F32);
        assert_eq!(r.ask(&a, 2), None);
        // Untimed calls report nothing.
        r.record(&a, 2, true, Duration::from_secs(1));
        assert!(r.classes().keys().all(|c| c.kind == CollKind::AllReduce));
    }
}
