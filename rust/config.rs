//! Every tunable of the core in one place: timeouts, how waits wait, message-size thresholds,
//! segment sizes, and the environment knobs, which are read here and nowhere else. (Format
//! constants, such as the segment's magic or the layout's limits, stay with their format.)

use std::time::Duration;

/// Default for how long any wait lasts before it fails: finite, and long enough for slow first steps.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// The longest timeout accepted (about 31 years): `Instant + Duration` must never overflow.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(1_000_000_000);

/// Busy-poll budget of a wait when every rank has a core: covers a peer a few microseconds behind.
pub(crate) const SPIN: Duration = Duration::from_micros(60);
/// How long a wait spins on past [`SPIN`] while the ranks it waits for last ran on other cores: there
/// spinning takes nothing from them, and a yield would hand this core to any process sharing it for
/// its whole time slice.
pub(crate) const SPIN_APART: Duration = Duration::from_millis(2);
/// A waiting thread that finds a rank it waits for queued on its own core moves to another core at
/// most this often (`sync::wait::leave_core`): beside a CPU-bound process the scheduler puts
/// the two ranks of a pair that wake each other on one core, and a quarter to a half of the calls
/// of a 256 KiB broadcast took 175 µs instead of 16.
pub(crate) const MOVE_EVERY: Duration = Duration::from_millis(10);
/// Then `sched_yield` for this long when every rank has a core: a competing process gets the core at
/// once, an idle core is burnt. Long enough that a futex wake-up (about 90 µs in this VM) costs under
/// 2% of any wait that reaches sleep: with a CPU-bound process beside 2 ranks, 5 ms instead of 0.4 ms
/// took all_reduce 2 MiB from 0.75x to 1.55x MPICH's speed (MPICH time / ours, bench.procs --busy).
/// MPICH polls with `sched_yield` without end.
pub(crate) const YIELD: Duration = Duration::from_millis(5);
/// The yield budget when ranks outnumber cores: there a yielding rank competes with the ranks it waits
/// for, so it stays at the old 0.4 ms (a caution, not a measured win: 4 ranks on 2 cores vary from 0.65
/// to 2.1 ms for all_gather 2 MiB at either budget; sleeping at once is 2-3x slower).
pub(crate) const YIELD_OVERSUBSCRIBED: Duration = Duration::from_micros(400);
/// `AXONML_WAIT_SPIN_US` / `AXONML_WAIT_YIELD_US`: the spin and yield budgets above, for tuning on a
/// given machine (read once); the yield one also caps the oversubscribed budget.
pub(crate) fn wait_budgets() -> (Duration, Duration) {
    static BUDGETS: std::sync::OnceLock<(Duration, Duration)> = std::sync::OnceLock::new();
    *BUDGETS.get_or_init(|| {
        let us = |name: &str, default: Duration| {
            std::env::var(name).ok().and_then(|v| v.parse().ok()).map_or(default, Duration::from_micros)
        };
        (us("AXONML_WAIT_SPIN_US", SPIN), us("AXONML_WAIT_YIELD_US", YIELD))
    })
}
/// A spinning wait during which its thread lost its core ([`STALL`]) paces its thread down: the next
/// waits spin this many halvings of the budget (60 µs becomes under 1 µs, a few batches of polls),
/// then sleep, with no longer spin and no yields; each wait caught within its short spin takes one
/// halving back (after a long yield, once [`PACE_HOLD`] is over). On a loaded machine, or where the
/// ranks waited for must take a lock such as the GIL first, spinning only holds a core they need: 2
/// in-process ranks beside 4 CPU-bound processes went from 2.3 ms to 26 µs per 8 B all_reduce.
pub(crate) const PACE_MAX_HALVINGS: u32 = 6;
/// A thread paced down after a yield that handed its core to another task stays so for this long,
/// however quick its waits meanwhile: on a loaded machine (2 cores, 7-8 runnable tasks) every wait at
/// the full budget may lose a time slice in its yields, and a paced-down thread, which neither spins
/// long nor yields, sees no sign of the load (a 2-rank thread world's 64 KiB all_reduce, one rank 3 ms
/// late each step, took 240-510 µs a call at load 7-8 without the hold, 16-47 µs with it). A
/// preemption during the spin alone does not hold: at moderate load it is frequent, and there the
/// full budget pays (holding after every lost core, shm all_reduce 64 KiB went from 11.5 to about 20 µs
/// at load 5.6).
pub(crate) const PACE_HOLD: Duration = Duration::from_millis(50);
/// A waiting thread lost its core when a batch of 64 polls, or one `sched_yield`, took longer than
/// this: each takes under 1 µs on a core of its own (0.55 µs median, a few 20-35 µs interrupts per
/// second); any longer and another task ran there. A merely late peer (a skewed step on another core)
/// leaves no such gap. Below a futex wake-up (50-90 µs), the cost the pacing saves.
pub(crate) const STALL: Duration = Duration::from_micros(50);
/// Then sleep in slices this long; between slices the slow checks run (liveness, Ctrl-C).
pub(crate) const SLICE: Duration = Duration::from_millis(50);
/// A rank leaving the world (its `spawn` function returned) waits at most this long for what it queued
/// to run, before its peers are told it left.
pub(crate) const LEAVE_GRACE: Duration = Duration::from_secs(2);

/// In the in-process world, all-reduces up to this many bytes go one-shot.
pub const INLINE: usize = 256;

/// Owner-computes slices are multiples of this many bytes, so owners never share a cache line.
pub(crate) const OWNER_ALIGN: usize = 64;
/// No owned slice is smaller than this (unless the message is), so small messages are not cut into
/// crumbs.
pub(crate) const OWNER_MIN_SLICE: usize = 4096;

/// Point-to-point messages up to this size are sent eagerly (copied; the send returns at once).
pub const EAGER: usize = 64 * 1024;

/// Most bytes of unexpected point-to-point messages a rank of the shm world holds at once, from all
/// peers together (their sizes come from the senders: larger ones fail the receive).
pub(crate) const EARLY_MAX: usize = 1 << 30;

/// Default bytes of segment arrays (`alloc`, `ProcessGroup.empty`) per rank in the shm world.
pub const DEFAULT_ARENA: usize = 64 << 20;

/// Copies whose destination sits 1 to 63 bytes past their source modulo this many bytes run up to 12x
/// slower (4K aliasing: the CPU matches loads against earlier stores by their low 12 address bits).
pub(crate) const ALIAS_PERIOD: usize = 4096;
/// Staged pieces are placed as if their message started at this offset modulo [`ALIAS_PERIOD`], away
/// from where allocators put arrays (glibc's large blocks at 16, aligned ones at 0 or 64), so neither
/// the copy in nor the copy out aliases (numpy copy of 256 KiB here: 9.6 µs, 126 µs at 16 bytes).
pub(crate) const STAGE_SKEW: usize = 2048;
/// The shm world's pipeline round (bytes of one staging buffer), for worlds of up to 8 ranks.
pub(crate) const SHM_CHUNK: usize = 1 << 20;
/// The shm world's largest one-shot all_reduce, for worlds of up to 8 ranks.
pub(crate) const SHM_ONESHOT: usize = 64 << 10;
/// Collectives on private arrays of the shm world copy straight between processes (`algo::cma`) when
/// the kernel allows it, every member's every buffer has at least this many bytes (each buffer is
/// judged alone, so a small part of a large call stages the whole call) and a member asks
/// (`algo::route::offer`: under `ROUTE_TIMED_BELOW` when crossing took it less time than staging lately,
/// above by kind).
pub(crate) const CMA_MIN: usize = 64 << 10;
/// The smallest all_reduce, reduce or reduce_scatter (bytes of its largest buffer) that copies straight
/// between processes when ranks outnumber cores, where calls are not timed (`algo::route::offer`):
/// about where the two routes cross over on the hosts measured (`bench.procs` in the Python package).
pub(crate) const CMA_REDUCE_CROWDED: usize = 2 << 20;
/// Largest tile members claim in the cross-memory collectives (`algo::claims::Claims`): a reduction reads
/// each peer's tile into scratch it keeps in cache, and a copied tile is read once for every member
/// it goes to.
pub(crate) const CMA_TILE: usize = 128 << 10;
/// In the cross-memory collectives whose parts have owners (all_gather, reduce_scatter), a member that
/// finished its own part helps with another's only while more than this many of its tiles are left:
/// a helper's tile costs a second cross-process copy, worth it when a busy core holds the owner back
/// (all_gather 64 MiB beside a CPU-bound process: 15.5 -> 10.9 ms), not when members are in step.
pub(crate) const STEAL_SPARE: usize = 2;
/// Calls whose largest buffer is under this pick their route by what each took lately on this machine
/// (`algo::route_times`), instead of by size alone: they are frequent enough to time both routes.
/// (The bench runs 12 calls of 8 MiB per launch, too few to learn on.)
pub(crate) const ROUTE_TIMED_BELOW: usize = 8 << 20;
/// Samples kept per route and class (`algo::route_times`): a member compares the best of each.
pub(crate) const ROUTE_WINDOW: usize = 6;
/// Samples of each route a class takes, in alternating runs, before the faster route wins
/// (`algo::route_times`).
pub(crate) const ROUTE_LEARN: u64 = 6;
/// Calls in a run of one route while learning or probing (`algo::route_times`): the first call after
/// the other route is slower for that alone.
pub(crate) const ROUTE_RUN: u64 = 2;
/// Of this many calls of a class, one run stages and one crosses on every member, so a route that
/// lost is measured again (`algo::route_times`).
pub(crate) const ROUTE_PROBE_EVERY: u64 = 32;
/// Local copies of transfers this large stream past the caches (`algo::stream`): 8 MiB copies here
/// ran at 22 GB/s streamed against 12 GB/s with `memcpy`, 4 MiB ones at 23 against 28 GB/s.
pub(crate) const STREAM_MIN: usize = 6 << 20;
/// How long a failed cross-memory copy waits for its peer's death to show (the kernel may tear a
/// killed process's memory down before its exit is visible) before it blames the published address.
pub(crate) const CMA_DEATH_GRACE: Duration = Duration::from_millis(500);
/// A rank that finds a peer dead waits at most this long for the peer's parent to reap it, which is
/// when the kernel tells the exit status to the holders of its pidfd: `axonml-run` reaps a worker as
/// it exits, torchrun's agent polls every 100 ms by default; a second leaves room for a loaded host, and
/// is spent only on the way to an error, after the world was aborted.
pub(crate) const EXIT_STATUS_GRACE: Duration = Duration::from_secs(1);
/// Bytes per send/recv cell of the shm world (two per ordered pair of ranks), up to 8 ranks.
pub(crate) const SHM_CELL: usize = 64 << 10;

/// Connections rank 0's rendezvous store serves at once; more are closed at once.
pub(crate) const MAX_PENDING: usize = 64;
/// How long a write to a rendezvous socket may block: a peer that stops reading is given up on.
pub(crate) const RENDEZVOUS_WRITE: Duration = Duration::from_secs(5);
/// Rendezvous reads wait in slices this long, so Ctrl-C is seen.
pub(crate) const RENDEZVOUS_SLICE: Duration = Duration::from_millis(100);

/// `AXONML_SHM_CHUNK_KIB`: the shm world's pipeline round size for large messages on private arrays,
/// a tuning knob for benchmarks (rank 0's value counts; the others learn it from the segment header).
pub fn shm_chunk_from_env() -> Option<usize> {
    std::env::var("AXONML_SHM_CHUNK_KIB").ok()?.parse::<usize>().ok()?.checked_mul(1024)
}

/// `AXONML_WAIT_MOVE=0`: a waiting thread never changes its core (`sync::wait::leave_core`), for
/// jobs pinned by their launcher or run in a cpuset they expect to follow (read once).
pub(crate) fn move_allowed_by_env() -> bool {
    static ALLOWED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ALLOWED.get_or_init(|| std::env::var("AXONML_WAIT_MOVE").map_or(true, |v| v.trim() != "0"))
}

/// `AXONML_SHM_CMA` (`algo::route::Policy`): `0` (`Some(false)`) never copies straight between processes,
/// always stages (tests of the staged path; sandboxes that log refused `process_vm_readv` calls); `1`
/// (`Some(true)`) copies straight every buffer of at least [`CMA_MIN`] bytes, whatever the call's size
/// (tests of the cross-memory path; CPUs whose kernel copies as fast as `memcpy`); unset (`None`), by
/// the call's size and kind.
pub(crate) fn cma_forced_by_env() -> Option<bool> {
    switch_from_env("AXONML_SHM_CMA")
}

/// A switch in the environment variable `name`, as the core's switches read: `1` (`Some(true)`) or `0`
/// (`Some(false)`), surrounding whitespace ignored; unset or anything else, `None` (the default).
fn switch_from_env(name: &str) -> Option<bool> {
    match std::env::var(name).as_deref().map(str::trim) {
        Ok("0") => Some(false),
        Ok("1") => Some(true),
        _ => None,
    }
}

/// `AXONML_KERNELS`: `baseline`, `avx2` or `avx512` caps the reduction kernels
/// (`reduce::Kernels::active`, which reads it once) at that set, clamped to what the CPU has: to compare
/// the sets, test each on one machine, or rule the vector ones out. Unset or another value: the
/// fastest set the CPU has. Every set gives bitwise the same results.
pub(crate) fn kernels_from_env() -> Option<String> {
    std::env::var("AXONML_KERNELS").ok().map(|v| v.trim().to_ascii_lowercase())
}

/// Calls each rank's flight recorder keeps per communicator (`flight`) unless
/// `AXONML_FLIGHT_RECORDER_ENTRIES` says otherwise: torch's recorder keeps its last calls too, and 64
/// reach back past a few training steps' buckets.
pub const FLIGHT_RECORDER_ENTRIES: usize = 64;
/// The most `AXONML_FLIGHT_RECORDER_ENTRIES` may ask for: every communicator allocates its ring up
/// front (128 bytes an entry: 8 MiB at this cap).
pub const FLIGHT_RECORDER_MAX: usize = 1 << 16;

/// `AXONML_FLIGHT_RECORDER_ENTRIES`: calls each flight recorder keeps (0 keeps none, only the totals;
/// capped at [`FLIGHT_RECORDER_MAX`]; read once).
pub(crate) fn flight_recorder_entries() -> usize {
    static ENTRIES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *ENTRIES.get_or_init(|| {
        std::env::var("AXONML_FLIGHT_RECORDER_ENTRIES")
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .map_or(FLIGHT_RECORDER_ENTRIES, |n| n.min(FLIGHT_RECORDER_MAX))
    })
}

/// Frames of the caller's Python stack a recorded call keeps when `AXONML_FLIGHT_RECORDER_STACKS` is on.
pub const FLIGHT_RECORDER_FRAMES: usize = 8;

/// `AXONML_FLIGHT_RECORDER_STACKS=1`: each recorded call keeps its caller's Python stack (its last
/// [`FLIGHT_RECORDER_FRAMES`] frames), as torch's recorder keeps stacks when asked to; off by default
/// (any other value), since walking the frames costs each call (read once).
pub fn flight_recorder_stacks() -> bool {
    static STACKS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *STACKS.get_or_init(|| switch_from_env("AXONML_FLIGHT_RECORDER_STACKS") == Some(true))
}
