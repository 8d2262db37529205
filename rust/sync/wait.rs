//! The one way a rank waits for its peers.
//!
//! Spin briefly (only when ranks do not outnumber cores: on an oversubscribed machine spinning starves the
//! rank being waited for), and on for longer while the ranks waited for run on other cores (a yield
//! would hand this core to whatever else runs here, a CPU-bound neighbour, for its whole time slice);
//! then yield (long when every rank has a core, short when a yielding rank would
//! compete with the ones it waits for), then sleep on a futex in slices. Spinning is paced per thread
//! ([`Pace`]): after a wait in which the thread lost its core (a long gap between its polls, or a long
//! yield), the next ones spin a few polls and sleep, until waits caught within their short spin bring
//! the full budget back (after a long yield, not before [`PACE_HOLD`]). A wait that only outlasted its
//! spin (a peer late on another core) changes nothing. Each slice checks the deadline and the caller's
//! slow checks (peer liveness, pending Python signals); the cheap abort check runs on every
//! poll. The waker bumps the event word and issues a futex wake only when someone sleeps, so the fast path
//! writes no shared word and makes no system call; a wait that ends within its first polls reads no
//! clock.

use std::cell::Cell;
use std::fmt;
use std::sync::atomic::{fence, AtomicU32, Ordering::SeqCst};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use rustix::thread::{self, futex};

use crate::config::{
    move_allowed_by_env, wait_budgets, MAX_TIMEOUT, MOVE_EVERY, PACE_HOLD, PACE_MAX_HALVINGS, SLICE,
    SPIN_APART, STALL, YIELD_OVERSUBSCRIBED,
};
use crate::error::{Error, Result};

/// A futex word peers bump when they publish progress, plus a count of sleepers. `repr(C)` so it can
/// live in a shared-memory segment.
#[repr(C)]
#[derive(Default)]
pub(crate) struct Event {
    seq: AtomicU32,
    sleepers: AtomicU32,
}

impl Event {
    /// Wake everyone waiting on this event. Call after publishing the new state.
    ///
    /// With nobody asleep it writes nothing: the event's line stays shared by the ranks' cores instead
    /// of moving to the notifier's on every publish. A sleeper announces itself, then re-checks its
    /// condition (`Wait::sleep`); the fences on both sides order each one's store before its load, so
    /// either the notifier sees the sleeper and wakes it, or the sleeper sees what was published.
    pub(crate) fn notify(&self, shared: bool) {
        fence(SeqCst);
        if self.sleepers.load(SeqCst) > 0 {
            self.seq.fetch_add(1, SeqCst);
            // A failed wake only means nobody was there to wake.
            let _ = futex::wake(&self.seq, flags(shared), u32::MAX);
        }
    }
}

fn flags(shared: bool) -> futex::Flags {
    if shared {
        futex::Flags::empty()
    } else {
        futex::Flags::PRIVATE
    }
}

/// Whether spinning is worth it: only when the ranks that wait on each other each have a core.
pub(crate) fn may_spin(ranks: usize) -> bool {
    static CORES: OnceLock<usize> = OnceLock::new();
    ranks <= *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// The core the calling thread runs on. Through glibc, which reads it from rseq or the vDSO without a
/// system call: it runs with every published counter (rustix makes the `getcpu` system call).
fn core() -> Option<usize> {
    // SAFETY: no arguments; reads the calling thread's state.
    usize::try_from(unsafe { libc::sched_getcpu() }).ok()
}

/// The core the calling thread runs on, plus one (so that 0 can mean "not yet known").
pub(crate) fn current_cpu() -> u32 {
    core().and_then(|c| u32::try_from(c + 1).ok()).unwrap_or(0)
}

/// Move the calling thread off its core, within the cores it may use, when a rank it waits for is
/// queued behind it there (at most once per [`MOVE_EVERY`] per thread; never when
/// `AXONML_WAIT_MOVE=0`, and never again on a thread where the kernel refused it once). Rank pairs
/// that wake each other get placed on one core by the scheduler; beside a CPU-bound process they
/// stay there (two tasks against one is balanced to it), and every call then waits for a time slice.
/// Returns whether it moved. The thread's affinity mask is set back as it read it, which pins an
/// inherited cgroup cpuset as the thread's own mask: the knob turns this off where that matters.
pub(crate) fn leave_core() -> bool {
    thread_local! { static LAST: Cell<Option<Instant>> = const { Cell::new(None) } }
    if !move_allowed_by_env() || LAST.get().is_some_and(|t| t.elapsed() < MOVE_EVERY) {
        return false;
    }
    LAST.set(Some(Instant::now()));
    let moved = core().map_or(Ok(false), move_off);
    if moved.is_err() {
        // Refused (a sandbox, a cpuset change): do not try again on this thread.
        LAST.set(Some(Instant::now() + MAX_TIMEOUT));
    }
    moved.unwrap_or(false)
}

/// Leave core `here` for another of the thread's allowed cores, then allow them all again; whether
/// the thread landed elsewhere (false, not an error, when it may use no other core).
fn move_off(here: usize) -> rustix::io::Result<bool> {
    let allowed = thread::sched_getaffinity(None)?;
    if allowed.count() < 2 || !allowed.is_set(here) {
        return Ok(false);
    }
    let mut elsewhere = allowed;
    elsewhere.unset(here);
    // The kernel migrates a running thread as soon as its own core leaves its set.
    thread::sched_setaffinity(None, &elsewhere)?;
    let moved = core() != Some(here);
    // Never leave the narrowed set in place: retry the restore once before giving up.
    thread::sched_setaffinity(None, &allowed).or_else(|_| thread::sched_setaffinity(None, &allowed))?;
    Ok(moved)
}

type InterruptHook = fn() -> bool;
static INTERRUPT: OnceLock<InterruptHook> = OnceLock::new();

/// Install a check, run once per sleep slice, that returns true when the wait should be abandoned
/// (the Python bindings use it for Ctrl-C). Only the first call takes effect.
pub fn set_interrupt_hook(hook: fn() -> bool) {
    let _ = INTERRUPT.set(hook);
}

/// True when the interrupt hook asks waits to stop.
pub(crate) fn interrupted() -> bool {
    INTERRUPT.get().is_some_and(|hook| hook())
}

/// What to wait for, and how.
pub(crate) struct Wait<'a> {
    /// The event peers bump when `ready` may have become true.
    pub event: &'a Event,
    /// True when the event lives in memory shared between processes.
    pub shared: bool,
    /// Whether every rank has a core ([`may_spin`]): then busy-poll first, and yield longer.
    pub spin: bool,
    /// How long until it gives up, from when it first reads the clock (a wait that ends within its
    /// first polls reads none). Every wait has a limit, and every wait on a thread with an interrupt
    /// hook (Python's main thread) ends on Ctrl-C within a slice.
    pub timeout: Duration,
    /// The operation, for error messages (formatted only for one).
    pub op: &'a dyn fmt::Display,
}

/// Why a wait ended without its condition.
pub(crate) enum Stop {
    /// The deadline passed.
    TimedOut,
    /// A check failed (abort, dead peer, interrupt).
    Failed(Error),
}

impl Wait<'_> {
    /// Wait until `ready()` holds. `quick` runs on every poll (cheap: an abort flag), `slow` once per sleep
    /// slice (liveness). `ready` is checked before either, so a condition already met always wins.
    pub(crate) fn until(
        &self,
        ready: impl FnMut() -> bool,
        quick: impl FnMut() -> Result<()>,
        slow: impl FnMut() -> Result<()>,
    ) -> std::result::Result<(), Stop> {
        self.until_apart(ready, quick, slow, || false)
    }

    /// [`Wait::until`], spinning on past the short budget (up to [`SPIN_APART`]) while `apart()` says
    /// that every rank waited for runs on another core than this thread's.
    pub(crate) fn until_apart(
        &self,
        mut ready: impl FnMut() -> bool,
        mut quick: impl FnMut() -> Result<()>,
        slow: impl FnMut() -> Result<()>,
        mut apart: impl FnMut() -> bool,
    ) -> std::result::Result<(), Stop> {
        let (spin, yields) = wait_budgets();
        if !self.spin {
            return self
                .sleep(Instant::now(), yields.min(YIELD_OVERSUBSCRIBED), ready, quick, slow)
                .map(drop);
        }
        // `AXONML_WAIT_SPIN_US=0` turns all spinning off, the longer spin and the probe too.
        if spin.is_zero() {
            return self.sleep(Instant::now(), yields, ready, quick, slow).map(drop);
        }
        // A calm thread spins its full budget, on while `apart`, then yields; a paced-down one (a recent
        // wait found this core contended) spins a fraction and goes to sleep, which on a loaded machine
        // hands the core to the ranks it waits for at once. The first batch of polls always runs: it is
        // how a paced-down thread sees its peers keep up again.
        let pace = Pace::get();
        let (short, yields) = if pace.calm() { (spin, yields) } else { (pace.scale(spin), Duration::ZERO) };
        let long = if pace.calm() { SPIN_APART.max(spin) } else { Duration::ZERO };
        // A calm thread reads the clock only once its first batch of polls failed: most waits of a
        // busy job end within it. A paced-down one counts its short spin (maybe under one batch) from
        // the start.
        let mut started = (!pace.calm()).then(Instant::now);
        // The longest this thread went between two batches of polls (from the first clock read): how
        // long it lost its core.
        let mut gap = Duration::ZERO;
        let mut last = started;
        let mut first = true;
        let start = loop {
            for _ in 0..64 {
                if ready() {
                    // The first batch reads no clock: the fast path.
                    let within = first || {
                        let now = Instant::now();
                        gap = gap.max(last.map_or(Duration::ZERO, |l| now - l));
                        started.is_some_and(|s| now - s <= short)
                    };
                    pace.record(Outcome::of(within, gap, Duration::ZERO));
                    return Ok(());
                }
                std::hint::spin_loop();
            }
            first = false;
            quick().map_err(Stop::Failed)?;
            let now = Instant::now();
            let start = *started.get_or_insert(now);
            gap = gap.max(last.map_or(Duration::ZERO, |l| now - l));
            last = Some(now);
            let t = now - start;
            if t >= short {
                if !(t < long && apart()) {
                    break start;
                }
                // `apart` may move this thread to another core: its own work, not a lost core.
                last = Some(Instant::now());
            }
        };
        let longest_yield = self.sleep(start, yields, ready, quick, slow)?;
        pace.record(Outcome::of(false, gap, longest_yield));
        Ok(())
    }

    /// The rest of a wait after its spin: yield until `yields` after `start`, then sleep on the event
    /// in slices, until the timeout after `start`. Returns the longest yield (another task had this
    /// core meanwhile).
    fn sleep(
        &self,
        start: Instant,
        yields: Duration,
        mut ready: impl FnMut() -> bool,
        mut quick: impl FnMut() -> Result<()>,
        mut slow: impl FnMut() -> Result<()>,
    ) -> std::result::Result<Duration, Stop> {
        let deadline = start + self.timeout;
        // Yields check only the cheap abort flag; a deadline inside the budget still ends them.
        let yield_end = (start + yields).min(deadline);
        let mut longest = Duration::ZERO;
        let mut last = Instant::now();
        while last < yield_end {
            if ready() {
                return Ok(longest);
            }
            quick().map_err(Stop::Failed)?;
            std::thread::yield_now();
            let now = Instant::now();
            longest = longest.max(now - last);
            last = now;
        }
        // The slow checks (a syscall, or taking the GIL for signals) run once per slice, not on every
        // wake-up: with many ranks every counter bump wakes every sleeper.
        let mut next_slow = Instant::now();
        loop {
            let seen = self.event.seq.load(SeqCst);
            if ready() {
                return Ok(longest);
            }
            quick().map_err(Stop::Failed)?;
            let now = Instant::now();
            if now >= next_slow {
                slow().map_err(Stop::Failed)?;
                if interrupted() {
                    return Err(Stop::Failed(Error::Interrupted { op: self.op.to_string() }));
                }
                next_slow = now + SLICE;
            }
            if now >= deadline {
                return Err(Stop::TimedOut);
            }
            let nap = SLICE.min(deadline - now);
            let ts = futex::Timespec { tv_sec: nap.as_secs() as _, tv_nsec: nap.subsec_nanos() as _ };
            self.event.sleepers.fetch_add(1, SeqCst);
            // Re-check after announcing ourselves (`Event::notify`): a notify that saw no sleeper did
            // not wake us, but what it published shows here. One that saw us changed `seq`, so the
            // futex returns at once if that was since `seen`.
            fence(SeqCst);
            if !ready() && quick().is_ok() {
                let _ = futex::wait(&self.event.seq, flags(self.shared), seen, Some(&ts));
            }
            self.event.sleepers.fetch_sub(1, SeqCst);
        }
    }
}

/// How a thread's recent spinning waits went, which sets how long its next one busy-waits: the number
/// of halvings of its spin budget (0: calm, the full budgets), and until when a long yield holds them.
/// A wait during which the thread lost its core goes all the way down at once (spinning there may have
/// cost a time slice); each quick wait takes one halving back, once the hold is over.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Pace {
    halvings: u32,
    held_until: Option<Instant>,
}

/// How a spinning wait that ended well went, for its thread's [`Pace`].
#[derive(Clone, Copy, Debug, PartialEq)]
enum Outcome {
    /// Within the short spin, the thread keeping its core.
    Quick,
    /// After the short spin, the thread keeping its core: the ranks waited for were late (busy
    /// elsewhere, or computing a skewed step), which says nothing of this core.
    Late,
    /// The thread lost its core for longer than [`STALL`] between two batches of polls (preempted):
    /// the core is contended, and spinning there takes time from whatever else must run.
    Preempted,
    /// A yield handed the core to another task for longer than [`STALL`]: the core has other work
    /// ready to run, so every yield there may cost a whole time slice.
    Crowded,
}

impl Outcome {
    /// A wait caught `within` its short spin or not, in which the thread went at most `gap` between
    /// two batches of polls and at most `yielded` in one yield.
    fn of(within: bool, gap: Duration, yielded: Duration) -> Outcome {
        if yielded > STALL {
            Outcome::Crowded
        } else if gap > STALL {
            Outcome::Preempted
        } else if within {
            Outcome::Quick
        } else {
            Outcome::Late
        }
    }
}

const CALM: Pace = Pace { halvings: 0, held_until: None };

thread_local! {
    static PACE: Cell<Pace> = const { Cell::new(CALM) };
}

impl Pace {
    fn get() -> Pace {
        PACE.get()
    }

    fn calm(self) -> bool {
        self.halvings == 0
    }

    fn scale(self, budget: Duration) -> Duration {
        budget / (1u32 << self.halvings)
    }

    /// The pace after a wait that went as `outcome`, `now` read only when it matters.
    fn after(self, outcome: Outcome, now: impl Fn() -> Instant) -> Pace {
        match outcome {
            // The calm fast path reads no clock.
            Outcome::Quick if self.calm() => self,
            Outcome::Quick if self.held_until.is_some_and(|t| now() < t) => self,
            Outcome::Quick => Pace { halvings: self.halvings - 1, held_until: None },
            Outcome::Late => self,
            Outcome::Preempted => Pace { halvings: PACE_MAX_HALVINGS, ..self },
            Outcome::Crowded => Pace { halvings: PACE_MAX_HALVINGS, held_until: Some(now() + PACE_HOLD) },
        }
    }

    fn record(self, outcome: Outcome) {
        let next = self.after(outcome, Instant::now);
        // The calm fast path writes nothing.
        if next != self {
            PACE.set(next);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustix::thread::CpuSet;

    #[test]
    fn a_thread_leaves_its_core_within_its_allowed_set_and_keeps_that_set() {
        let allowed = thread::sched_getaffinity(None).unwrap();
        if thread::sched_setaffinity(None, &allowed).is_err() {
            return; // a sandbox that refuses affinity: leave_core then never moves (checked below)
        }
        // Pinned to one core, there is nowhere to go.
        let here = core().unwrap();
        let mut one = CpuSet::new();
        one.set(here);
        thread::sched_setaffinity(None, &one).unwrap();
        assert!(!move_off(here).unwrap());
        thread::sched_setaffinity(None, &allowed).unwrap();
        // With two cores or more it lands on another one (checked before the set is restored), and
        // the set is restored as it was.
        let here = core().unwrap();
        assert_eq!(move_off(here).unwrap(), allowed.count() >= 2);
        let after = thread::sched_getaffinity(None).unwrap();
        assert!((0..CpuSet::MAX_CPU).all(|c| after.is_set(c) == allowed.is_set(c)));
    }

    #[test]
    fn a_thread_moves_at_most_once_per_interval() {
        // A fresh thread: the interval is per thread.
        std::thread::spawn(|| {
            let t = Instant::now();
            let first = leave_core();
            let again = leave_core();
            // Checked only when a loaded machine did not stall the thread past the interval.
            assert!(!again || t.elapsed() >= MOVE_EVERY, "{first} {again}");
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_notify_writes_the_event_only_when_someone_sleeps() {
        let event = Event::default();
        event.notify(true);
        assert_eq!(event.seq.load(SeqCst), 0, "nobody asleep: the line stays shared");
        event.sleepers.fetch_add(1, SeqCst);
        event.notify(true);
        assert_eq!(event.seq.load(SeqCst), 1, "a sleeper's futex word moved on");
    }

    /// A wait for `go >= k` with the test defaults: spinning allowed, no checks, a minute to go.
    fn wait_for(event: &Event, go: &AtomicU32, k: u32, mut polled: impl FnMut()) {
        let w = Wait { event, shared: false, spin: true, timeout: Duration::from_secs(60), op: &"test" };
        let ready = || {
            polled();
            go.load(SeqCst) >= k
        };
        assert!(w.until(ready, || Ok(()), || Ok(())).is_ok());
    }

    /// Pins the calling thread to `core`; false when the kernel refuses (a sandbox, a cpuset).
    fn pin(core: usize) -> bool {
        let mut one = CpuSet::new();
        one.set(core);
        thread::sched_setaffinity(None, &one).is_ok()
    }

    /// The calling thread's involuntary context switches so far: a preemption, or a yield that handed
    /// the core to another task.
    fn involuntary_switches() -> i64 {
        // SAFETY: getrusage writes the struct it is given.
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        assert_eq!(unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut usage) }, 0);
        usage.ru_nivcsw
    }

    /// Waits on a fresh thread pinned to one core beside a releasing thread pinned there too, which
    /// releases each wait only after running busy on that core for a millisecond once the wait is past
    /// its first batch of polls (so the waiter lost its core meanwhile); how many times each wait
    /// polled its condition. None when threads cannot be pinned.
    fn polls_of_waits_on_a_shared_core(waits: u32) -> Option<Vec<usize>> {
        let allowed = thread::sched_getaffinity(None).ok()?;
        let core = (0..CpuSet::MAX_CPU).find(|&c| allowed.is_set(c))?;
        let (event, go, entered, polls) =
            (Event::default(), AtomicU32::new(0), AtomicU32::new(0), AtomicU32::new(0));
        std::thread::scope(|s| {
            let waiter = s.spawn(|| {
                if !pin(core) {
                    entered.store(u32::MAX, SeqCst);
                    return None;
                }
                let polls_of = |k| {
                    polls.store(0, SeqCst);
                    entered.store(k, SeqCst);
                    wait_for(&event, &go, k, || {
                        polls.fetch_add(1, SeqCst);
                    });
                    polls.load(SeqCst) as usize
                };
                Some((1..=waits).map(polls_of).collect())
            });
            if pin(core) {
                for k in 1..=waits {
                    while !(entered.load(SeqCst) == k && polls.load(SeqCst) > 64) {
                        if entered.load(SeqCst) == u32::MAX {
                            break;
                        }
                        std::thread::yield_now();
                    }
                    let busy = Instant::now();
                    while busy.elapsed() < Duration::from_millis(1) {
                        std::hint::spin_loop();
                    }
                    go.store(k, SeqCst);
                    event.notify(false);
                }
            } else {
                go.store(waits, SeqCst);
                event.notify(false);
            }
            waiter.join().unwrap()
        })
    }

    #[test]
    fn a_thread_whose_wait_lost_its_core_polls_briefly_before_sleeping_again() {
        let Some(polls) = polls_of_waits_on_a_shared_core(3) else {
            eprintln!("skipped: the kernel refused to pin a thread to a core");
            return;
        };
        // The first spins its full budget and yields, handing the core to the busy releaser; the later
        // ones, paced down after it, run a probe of a batch or two of 64 polls and sleep (thousands of
        // polls at the full budget).
        assert!(polls[1..].iter().all(|&p| p < 1000), "{polls:?}");
    }

    #[test]
    fn a_peer_late_on_another_core_leaves_the_waiting_thread_calm() {
        let allowed = thread::sched_getaffinity(None).unwrap();
        let mut cores = (0..CpuSet::MAX_CPU).filter(|&c| allowed.is_set(c));
        let (Some(mine), Some(theirs)) = (cores.next(), cores.next()) else {
            eprintln!("skipped: a single core, so no peer can run on another one");
            return;
        };
        // Each attempt on a fresh (calm) thread: a wait released by a peer on another core that sleeps
        // past the wait's spin, so it ends in the yields. Only attempts whose waiter never lost its
        // core count (a busy machine takes it in most); of those, one staying calm shows a late peer
        // alone does not pace the thread down (before the fix, every one of them did).
        let attempts: Vec<(bool, bool)> = (0..40)
            .map(|_| {
                let (event, go, entered) = (Event::default(), AtomicU32::new(0), AtomicU32::new(0));
                std::thread::scope(|s| {
                    let waiter = s.spawn(|| {
                        let pinned = pin(mine);
                        // Read before the peer may start: a preemption that delays the wait counts.
                        let before = involuntary_switches();
                        entered.store(1, SeqCst);
                        if !pinned {
                            return None;
                        }
                        wait_for(&event, &go, 1, || ());
                        Some((involuntary_switches() == before, Pace::get().calm()))
                    });
                    s.spawn(|| {
                        pin(theirs);
                        // Late from the waiter's start: released after its spin.
                        while entered.load(SeqCst) == 0 {
                            std::thread::yield_now();
                        }
                        std::thread::sleep(Duration::from_micros(500));
                        go.store(1, SeqCst);
                        event.notify(false);
                    });
                    waiter.join().unwrap()
                })
            })
            .collect::<Option<_>>()
            .unwrap_or_default();
        let undisturbed: Vec<bool> = attempts.iter().filter(|a| a.0).map(|a| a.1).collect();
        if undisturbed.is_empty() {
            eprintln!("skipped: no waiter kept its core (a busy machine, or pinning refused): {attempts:?}");
            return;
        }
        assert!(undisturbed.contains(&true), "{attempts:?}");
    }

    #[test]
    fn a_wait_paces_its_thread_down_only_when_it_lost_its_core() {
        let (no, lost) = (Duration::ZERO, STALL + Duration::from_micros(1));
        assert_eq!(Outcome::of(true, no, no), Outcome::Quick);
        assert_eq!(Outcome::of(true, STALL, STALL), Outcome::Quick);
        assert_eq!(Outcome::of(false, STALL, STALL), Outcome::Late);
        assert_eq!(Outcome::of(false, no, no), Outcome::Late);
        assert_eq!(Outcome::of(true, lost, no), Outcome::Preempted);
        assert_eq!(Outcome::of(false, lost, no), Outcome::Preempted);
        assert_eq!(Outcome::of(false, no, lost), Outcome::Crowded);
        assert_eq!(Outcome::of(false, lost, lost), Outcome::Crowded);
        // A late wait leaves a calm thread calm and a paced one as paced as it was.
        let t = Instant::now();
        assert_eq!(CALM.after(Outcome::Late, || t), CALM);
        for lost in [Outcome::Preempted, Outcome::Crowded] {
            let paced = CALM.after(lost, || t);
            assert_eq!(paced.halvings, PACE_MAX_HALVINGS);
            assert_eq!(paced.after(Outcome::Late, || t + PACE_HOLD), paced);
        }
    }

    #[test]
    fn quick_waits_bring_a_paced_thread_back_to_its_full_budget() {
        let t = Instant::now();
        let back = |mut pace: Pace, now: Instant| {
            for _ in 0..PACE_MAX_HALVINGS {
                assert!(!pace.calm());
                pace = pace.after(Outcome::Quick, || now);
            }
            assert!(pace.calm());
            assert_eq!(pace.after(Outcome::Quick, || now), CALM);
        };
        // Preempted: at once.
        let pace = CALM.after(Outcome::Preempted, || t);
        assert_eq!(pace.scale(Duration::from_micros(64)), Duration::from_micros(1));
        back(pace, t);
        // After a long yield, quick waits change nothing until the hold is over; another long yield
        // renews it, a preemption does not end it.
        let mut pace = CALM.after(Outcome::Crowded, || t);
        assert_eq!(pace.after(Outcome::Quick, || t + PACE_HOLD / 2), pace);
        pace = pace.after(Outcome::Crowded, || t + PACE_HOLD / 2);
        pace = pace.after(Outcome::Preempted, || t + PACE_HOLD);
        assert_eq!(pace.after(Outcome::Quick, || t + PACE_HOLD), pace);
        back(pace, t + 2 * PACE_HOLD);
        // The thread's own pace is what its waits recorded.
        std::thread::spawn(|| {
            Pace::get().record(Outcome::Preempted);
            assert_eq!(Pace::get().halvings, PACE_MAX_HALVINGS);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn the_current_core_is_one_of_the_allowed_ones() {
        let c = current_cpu();
        assert!(c >= 1 && thread::sched_getaffinity(None).unwrap().is_set(c as usize - 1));
    }
}
