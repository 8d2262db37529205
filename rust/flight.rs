//! The flight recorder, always on: every rank's handle on a communicator keeps its last calls (a ring
//! of [`config::flight_recorder_entries`] entries, allocated when the handle is made) and running
//! totals per collective kind ([`Stats`]). The engine records each call once, from its signature, as
//! it meets its peers (`engine::Engine::execute`): scheduled when the call is numbered, started when
//! every member arrived, completed or failed when it returns. After a hang or a failure the records of
//! every rank say who was where (the Python package dumps them as JSON, in the shape of torch's flight
//! recorder dumps, and analyses them: `axonml_distributed.trace`).
//!
//! Every live recorder of the process is listed ([`all`]), so that one call dumps them all (the thread
//! world has many ranks in one process).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use crate::config;
use crate::signature::{CollKind, Signature};
use crate::sync::lock;

/// Where a recorded call is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// Numbered and published; waiting for its peers.
    Scheduled,
    /// Every member arrived: moving data.
    Started,
    /// Returned successfully.
    Completed,
    /// Returned an error.
    Failed,
}

impl State {
    /// The name torch's flight recorder gives the state (`failed` is ours: torch never records one).
    pub const fn name(self) -> &'static str {
        match self {
            State::Scheduled => "scheduled",
            State::Started => "started",
            State::Completed => "completed",
            State::Failed => "failed",
        }
    }
}

/// Which way a call moved its data, as the engine learnt it (`algo::route` decides).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Route {
    /// Nothing to move (a barrier, an empty call).
    Nothing = 0,
    /// Through the one-shot buffers (small all_reduce).
    OneShot = 1,
    /// Straight between the members' published buffers (one address space).
    Direct = 2,
    /// Straight between processes, copied by the kernel.
    Cma = 3,
    /// Pipelined through staging buffers.
    Staged = 4,
    /// Pipelined through staging buffers in pairs, by the plan of a collective with per-member sizes.
    Pairwise = 5,
}

impl Route {
    /// Every route, in code order.
    pub const ALL: [Route; 6] =
        [Route::Nothing, Route::OneShot, Route::Direct, Route::Cma, Route::Staged, Route::Pairwise];

    /// Its name in records and statistics.
    pub const fn name(self) -> &'static str {
        match self {
            Route::Nothing => "none",
            Route::OneShot => "oneshot",
            Route::Direct => "direct",
            Route::Cma => "cma",
            Route::Staged => "staged",
            Route::Pairwise => "pairwise",
        }
    }
}

/// One recorded call.
#[derive(Debug, Clone, Copy)]
pub struct Entry {
    /// Position among every call this rank recorded, on any communicator (0 for the first), as
    /// torch's recorder numbers its entries.
    pub record_id: u64,
    /// The call's signature, with its sequence number (the same on every member).
    pub sig: Signature,
    /// Elements of this member's input and output buffers.
    pub elems: (u64, u64),
    /// Where the call is.
    pub state: State,
    /// Wall-clock nanoseconds since the Unix epoch (comparable between the processes of a host): when
    /// the call was numbered, when every member had arrived, when it returned.
    pub created_ns: u64,
    /// See `created_ns`.
    pub started_ns: Option<u64>,
    /// See `created_ns`.
    pub completed_ns: Option<u64>,
    /// How its data moved, once known.
    pub route: Option<Route>,
}

/// Totals of one collective kind on one handle.
#[derive(Debug, Clone, Copy, Default)]
pub struct KindStats {
    /// Calls entered (numbered).
    pub calls: u64,
    /// Of those, calls that returned an error.
    pub failed: u64,
    /// Bytes of the completed calls' messages (a member's part: elements times element size).
    pub bytes: u64,
    /// Nanoseconds from numbering until every member had arrived (waiting for peers).
    pub wait_ns: u64,
    /// Nanoseconds from every member's arrival until the call returned (moving data).
    pub move_ns: u64,
    /// Completed calls per route, by [`Route`] code.
    pub routes: [u64; Route::ALL.len()],
}

/// Totals per collective kind, by [`CollKind`] code minus one.
pub type Stats = [KindStats; CollKind::ALL.len()];

/// The recorder of one rank's handle on one communicator.
pub struct Recorder {
    /// Global rank of the recording member.
    pub rank: usize,
    /// Ranks in the whole world.
    pub world_size: usize,
    /// Global ranks of the communicator's members.
    pub members: Vec<usize>,
    /// How many communicators over these same members this rank made before this one, plus one: with
    /// `members`, names the communicator alike on every member (they must make them in the same order).
    pub occurrence: u32,
    /// How many communicators this rank made before this one (0: the world's).
    pub index: u32,
    /// The ordinal of its world among those this process made ([`next_world`]).
    pub world_ordinal: u32,
    /// The world's transport ("threads", "shm").
    pub world: &'static str,
    /// This rank's names and call count, shared by all its communicators.
    names: Arc<Names>,
    ring: Mutex<Ring>,
}

struct Ring {
    /// At most `capacity` entries; record `id` sits at `id % capacity`.
    entries: Vec<Entry>,
    capacity: usize,
    /// Calls recorded so far (the next record id).
    recorded: u64,
    stats: Stats,
}

impl Ring {
    /// The entry of record `id`, when the ring holds one (not with no room at all).
    fn slot(&mut self, id: u64) -> Option<&mut Entry> {
        let at = usize::try_from(id % u64::try_from(self.capacity).ok()?.max(1)).ok()?;
        self.entries.get_mut(at)
    }
}

/// The wall clock at one instant, read once: later instants convert to wall-clock time by difference,
/// so recording reads only the monotonic clock.
fn anchor() -> &'static (Instant, u64) {
    static ANCHOR: OnceLock<(Instant, u64)> = OnceLock::new();
    ANCHOR.get_or_init(|| {
        let wall = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
        (Instant::now(), u64::try_from(wall.as_nanos()).unwrap_or(u64::MAX))
    })
}

/// `at` as wall-clock nanoseconds since the Unix epoch.
pub fn wall_ns(at: Instant) -> u64 {
    let (base, wall) = *anchor();
    let since = u64::try_from(at.saturating_duration_since(base).as_nanos()).unwrap_or(u64::MAX);
    wall.saturating_add(since)
}

fn ns(from: Instant, to: Instant) -> u64 {
    u64::try_from(to.saturating_duration_since(from).as_nanos()).unwrap_or(u64::MAX)
}

/// Every live recorder of this process.
fn registry() -> &'static Mutex<Vec<Weak<Recorder>>> {
    static RECORDERS: OnceLock<Mutex<Vec<Weak<Recorder>>>> = OnceLock::new();
    RECORDERS.get_or_init(Mutex::default)
}

/// Every live recorder of this process, in the order they were made.
pub fn all() -> Vec<Arc<Recorder>> {
    lock(registry()).iter().filter_map(Weak::upgrade).collect()
}

/// A call in flight, as the engine holds it between [`Recorder::begin`] and [`Recorder::end`].
pub(crate) struct Flight {
    id: u64,
    kind: CollKind,
    created: Instant,
    started: Option<Instant>,
}

impl Recorder {
    /// A recorder for `rank`'s handle on the communicator over `members`, listed for [`all`].
    pub(crate) fn new(
        world: &'static str,
        rank: usize,
        world_size: usize,
        members: Vec<usize>,
        names: Arc<Names>,
    ) -> Arc<Self> {
        anchor();
        let (occurrence, index) = names.next(&members);
        let world_ordinal = names.world;
        let capacity = config::flight_recorder_entries();
        let ring =
            Ring { entries: Vec::with_capacity(capacity), capacity, recorded: 0, stats: Stats::default() };
        let recorder = Arc::new(Recorder {
            rank,
            world_size,
            members,
            occurrence,
            index,
            world_ordinal,
            world,
            names,
            ring: Mutex::new(ring),
        });
        let mut listed = lock(registry());
        listed.retain(|w| w.strong_count() > 0);
        listed.push(Arc::downgrade(&recorder));
        recorder
    }

    /// Record call `sig` (numbered), whose buffers hold `elems` elements, as scheduled now.
    pub(crate) fn begin(&self, sig: &Signature, elems: (u64, u64)) -> Flight {
        let created = Instant::now();
        let record_id = self.names.calls.fetch_add(1, Relaxed);
        let mut ring = lock(&self.ring);
        let id = ring.recorded;
        ring.recorded += 1;
        ring.stats[sig.kind as usize - 1].calls += 1;
        let entry = Entry {
            record_id,
            sig: *sig,
            elems,
            state: State::Scheduled,
            created_ns: wall_ns(created),
            started_ns: None,
            completed_ns: None,
            route: None,
        };
        if ring.entries.len() < ring.capacity {
            ring.entries.push(entry);
        } else if let Some(slot) = ring.slot(id) {
            *slot = entry;
        }
        Flight { id, kind: sig.kind, created, started: None }
    }

    /// Every member arrived at the call in `flight`, now (returned).
    pub(crate) fn started(&self, flight: &mut Flight) -> Instant {
        let now = Instant::now();
        flight.started = Some(now);
        self.update(flight.id, |e| {
            e.state = State::Started;
            e.started_ns = Some(wall_ns(now));
        });
        now
    }

    /// The call in flight returned (`ok`: successfully), its data moved by `route` (when it got that
    /// far), `bytes` its message's size.
    pub(crate) fn end(&self, flight: Flight, ok: bool, route: Option<Route>, bytes: u64) {
        let now = Instant::now();
        let mut ring = lock(&self.ring);
        if let Some(slot) = ring.slot(flight.id) {
            slot.state = if ok { State::Completed } else { State::Failed };
            slot.completed_ns = Some(wall_ns(now));
            slot.route = route;
        }
        let stats = &mut ring.stats[flight.kind as usize - 1];
        if !ok {
            stats.failed += 1;
            return;
        }
        stats.bytes = stats.bytes.saturating_add(bytes);
        let started = flight.started.unwrap_or(now);
        stats.wait_ns = stats.wait_ns.saturating_add(ns(flight.created, started));
        stats.move_ns = stats.move_ns.saturating_add(ns(started, now));
        if let Some(r) = route {
            stats.routes[r as usize] += 1;
        }
    }

    fn update(&self, id: u64, f: impl FnOnce(&mut Entry)) {
        if let Some(slot) = lock(&self.ring).slot(id) {
            f(slot);
        }
    }

    /// The recorded calls still in the ring, oldest first.
    pub fn entries(&self) -> Vec<Entry> {
        let ring = lock(&self.ring);
        let mut entries = ring.entries.clone();
        entries.sort_by_key(|e| e.record_id);
        entries
    }

    /// The totals per collective kind.
    pub fn stats(&self) -> Stats {
        lock(&self.ring).stats
    }
}

/// The ordinal of a new world in this process (1 for the first): the ranks of a thread world share
/// one; the processes of an shm world each count their own, alike while they make the same worlds in
/// the same order (one world per process, usually). It tells apart the communicators of worlds that
/// live in one process at once.
pub(crate) fn next_world() -> u32 {
    static WORLDS: AtomicU32 = AtomicU32::new(0);
    WORLDS.fetch_add(1, Relaxed) + 1
}

/// How one rank names its communicators for the records (every member makes the communicators over a
/// given set of ranks in the same order, so the n-th over that set is the same communicator on each),
/// and numbers its calls on all of them.
pub struct Names {
    /// The world's ordinal ([`next_world`]).
    world: u32,
    made: Mutex<(u32, HashMap<Vec<usize>, u32>)>,
    calls: AtomicU64,
}

impl Names {
    /// The names of a rank of world `world` ([`next_world`]).
    pub(crate) fn new(world: u32) -> Self {
        Names { world, made: Mutex::default(), calls: AtomicU64::new(0) }
    }

    /// The next communicator over `members`: its occurrence among those over the same ranks (1 for the
    /// first) and how many this rank made before it.
    pub(crate) fn next(&self, members: &[usize]) -> (u32, u32) {
        let mut names = lock(&self.made);
        let index = names.0;
        names.0 += 1;
        let occurrence = names.1.entry(members.to_vec()).or_insert(0);
        *occurrence += 1;
        (*occurrence, index)
    }
}
