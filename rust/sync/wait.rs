//! The one way a rank waits for its peers.
//!
//! Spin briefly (only when ranks do not outnumber cores: on an oversubscribed machine spinning starves the
//! rank being waited for), and on for longer while the ranks waited for run on other cores (a yield
//! would hand this core to whatever else runs here, a CPU-bound neighbour, for its whole time slice);
//! then yield (long when every rank has a core, short when a yielding rank would
//! compete with the ones it waits for), then sleep on a futex in slices. Spinning is paced per thread
//! ([`Pace`]): after a wait that outlasted its spin, the next ones spin a few polls and sleep, until
//! waits caught within their short spin bring the full budget back. Each slice checks the deadline and
//! the caller's slow checks (peer liveness, pending Python signals); the cheap abort check runs on every
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
    move_allowed_by_env, wait_budgets, MAX_TIMEOUT, MOVE_EVERY, PACE_MAX_HALVINGS, SLICE, SPIN_APART,
    YIELD_OVERSUBSCRIBED,
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
            return self.sleep(Instant::now(), yields.min(YIELD_OVERSUBSCRIBED), ready, quick, slow);
        }
        // `AXONML_WAIT_SPIN_US=0` turns all spinning off, the longer spin and the probe too.
        if spin.is_zero() {
            return self.sleep(Instant::now(), yields, ready, quick, slow);
        }
        // A calm thread spins its full budget, on while `apart`, then yields; a paced-down one (its
        // recent waits outlasted the spin) spins a fraction and goes to sleep, which on a loaded
        // machine hands the core to the ranks it waits for at once. The first batch of polls always
        // runs: it is how a paced-down thread sees its peers keep up again.
        let pace = Pace::get();
        let (short, yields) = if pace.calm() { (spin, yields) } else { (pace.scale(spin), Duration::ZERO) };
        let long = if pace.calm() { SPIN_APART.max(spin) } else { Duration::ZERO };
        // A calm thread reads the clock only once its first batch of polls failed: most waits of a
        // busy job end within it. A paced-down one counts its short spin (maybe under one batch) from
        // the start.
        let mut started = (!pace.calm()).then(Instant::now);
        let mut first = true;
        let start = loop {
            for _ in 0..64 {
                if ready() {
                    // Caught after the short spin, in the longer one: the ranks waited for run on other
                    // cores, busy, so this says nothing of the machine.
                    if first || started.is_some_and(|s| s.elapsed() <= short) {
                        pace.record(Outcome::Quick);
                    }
                    return Ok(());
                }
                std::hint::spin_loop();
            }
            first = false;
            quick().map_err(Stop::Failed)?;
            let start = *started.get_or_insert_with(Instant::now);
            let t = start.elapsed();
            if t >= short && !(t < long && apart()) {
                break start;
            }
        };
        // Anything later means the ranks waited for were not running while this thread spun
        // (descheduled, or waiting for a wake-up or a lock such as the GIL).
        let ended = self.sleep(start, yields, ready, quick, slow);
        if ended.is_ok() {
            pace.record(Outcome::Slow);
        }
        ended
    }

    /// The rest of a wait after its spin: yield until `yields` after `start`, then sleep on the event
    /// in slices, until the timeout after `start`.
    fn sleep(
        &self,
        start: Instant,
        yields: Duration,
        mut ready: impl FnMut() -> bool,
        mut quick: impl FnMut() -> Result<()>,
        mut slow: impl FnMut() -> Result<()>,
    ) -> std::result::Result<(), Stop> {
        let deadline = start + self.timeout;
        // Yields check only the cheap abort flag; a deadline inside the budget still ends them.
        let yield_end = (start + yields).min(deadline);
        while Instant::now() < yield_end {
            if ready() {
                return Ok(());
            }
            quick().map_err(Stop::Failed)?;
            std::thread::yield_now();
        }
        // The slow checks (a syscall, or taking the GIL for signals) run once per slice, not on every
        // wake-up: with many ranks every counter bump wakes every sleeper.
        let mut next_slow = Instant::now();
        loop {
            let seen = self.event.seq.load(SeqCst);
            if ready() {
                return Ok(());
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
/// of halvings of its spin budget (0: calm, the full budgets). A quick wait takes one back; a wait that
/// outlasted its spins goes all the way down at once (it may have cost a time slice), so a thread
/// comes back to the full budget only after several quick waits in a row.
#[derive(Clone, Copy)]
struct Pace(u32);

/// How a spinning wait that ended well went, for its thread's [`Pace`].
enum Outcome {
    /// Within the short spin.
    Quick,
    /// After the spins, in the yields or asleep.
    Slow,
}

thread_local! {
    static PACE: Cell<Pace> = const { Cell::new(Pace(0)) };
}

impl Pace {
    fn get() -> Pace {
        PACE.get()
    }

    fn calm(self) -> bool {
        self.0 == 0
    }

    fn scale(self, budget: Duration) -> Duration {
        budget / (1u32 << self.0)
    }

    fn record(self, outcome: Outcome) {
        let halvings = match outcome {
            Outcome::Quick => self.0.saturating_sub(1),
            Outcome::Slow => PACE_MAX_HALVINGS,
        };
        // The calm fast path writes nothing.
        if halvings != self.0 {
            PACE.set(Pace(halvings));
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

    /// Waits on a fresh thread, each ready only once the waiter sleeps (a peer that never runs
    /// while it spins), and returns how many times each polled its condition before that.
    fn polls_of_waits_that_sleep(waits: usize) -> Vec<usize> {
        let (event, go, returned) = (Event::default(), AtomicU32::new(0), AtomicU32::new(0));
        std::thread::scope(|s| {
            let waiter = s.spawn(|| {
                (1..=waits as u32)
                    .map(|k| {
                        let mut polls = 0;
                        let w = Wait {
                            event: &event,
                            shared: false,
                            spin: true,
                            timeout: Duration::from_secs(60),
                            op: &"test",
                        };
                        let ready = || {
                            // Only the polls before the wait announced its sleep: asleep, it re-checks
                            // at each wake-up, as often as a loaded machine keeps the releasing thread
                            // from running.
                            if event.sleepers.load(SeqCst) == 0 {
                                polls += 1;
                            }
                            go.load(SeqCst) >= k
                        };
                        assert!(w.until(ready, || Ok(()), || Ok(())).is_ok());
                        returned.store(k, SeqCst);
                        polls
                    })
                    .collect()
            });
            for k in 1..=waits as u32 {
                // Released only once asleep: `sleepers` is raised just before the futex wait.
                while event.sleepers.load(SeqCst) == 0 {
                    std::thread::yield_now();
                }
                go.store(k, SeqCst);
                event.notify(false);
                // Not until `sleepers` is 0 again: by then the waiter may sleep in its next wait, and
                // this thread would have to catch the instants between its slices.
                while returned.load(SeqCst) < k {
                    std::thread::yield_now();
                }
            }
            waiter.join().unwrap()
        })
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

    #[test]
    fn a_thread_whose_wait_slept_polls_briefly_before_sleeping_again() {
        let polls = polls_of_waits_that_sleep(3);
        // The first spins its full budget and yields (thousands of polls); the later ones, paced down
        // after it, run a probe of a few batches of 64 and sleep.
        assert!(polls[1..].iter().all(|&p| p < 1000), "{polls:?}");
    }

    #[test]
    fn quick_waits_bring_a_paced_thread_back_to_its_full_budget() {
        std::thread::spawn(|| {
            Pace(0).record(Outcome::Slow);
            assert_eq!(Pace::get().0, PACE_MAX_HALVINGS);
            assert_eq!(Pace::get().scale(Duration::from_micros(64)), Duration::from_micros(1));
            for _ in 0..PACE_MAX_HALVINGS {
                assert!(!Pace::get().calm());
                Pace::get().record(Outcome::Quick);
            }
            assert!(Pace::get().calm());
            Pace::get().record(Outcome::Quick);
            assert!(Pace::get().calm());
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
