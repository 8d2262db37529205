//! The flight recorder, always on: every rank's handle on a communicator keeps its last calls (a ring
//! of [`config::flight_recorder_entries`] entries, allocated when the handle is made) and running
//! totals per collective kind ([`Stats`]). The engine records each call once, from its signature, as
//! it meets its peers (`engine::Engine::execute`): scheduled when the call is numbered, started when
//! every member arrived, completed or failed when it returns. After a hang or a failure the records of
//! every rank say who was where (the Python package dumps them as JSON, in the shape of torch's flight
//! recorder dumps, and analyses them: `axonml_distributed.trace`).
//!
//! Point-to-point calls (the engine's sends and receives, `Engine::p2p`) and the calls of groups driven
//! from Python (the MPI group and the gloo legs across hosts, through the bindings' `FlightRecorder`)
//! go to a second ring of the recorder ([`Recorder::begin_shared`]): several threads record there at
//! once (a rank's sends and receives run on lanes of their own), so it takes a lock, which the engine's
//! collectives, one at a time, do without.
//!
//! With `AXONML_FLIGHT_RECORDER_STACKS` on, each call keeps its caller's Python stack: the bindings
//! capture it and run the call under it ([`with_stack`]), and recording takes it from there.
//!
//! Every live recorder of the process is listed ([`all`]), so that one call dumps them all (the thread
//! world has many ranks in one process).
//!
//! While a timeline is on ([`set_timeline`]), each recorder also keeps every finished call, and the
//! gradient buckets its rank's synchronizers reduced, in an unbounded log ([`Log`]) that the timeline
//! takes ([`take_timeline`]) and writes as a trace (`axonml_distributed.trace.timeline_file`). Off, a call
//! pays one relaxed load of the switch, and nothing is allocated.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64, Ordering::*};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use crate::config;
use crate::dtype::DType;
use crate::reduce::{ReduceOp, Scale};
use crate::signature::{CollKind, Signature};
use crate::sync::lock;

/// Where a recorded call is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
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
    /// Carried by MPI (the MPI group).
    Mpi = 6,
    /// Carried by torch's gloo (between hosts).
    Gloo = 7,
}

impl Route {
    /// Every route, in code order.
    pub const ALL: [Route; 8] = [
        Route::Nothing,
        Route::OneShot,
        Route::Direct,
        Route::Cma,
        Route::Staged,
        Route::Pairwise,
        Route::Mpi,
        Route::Gloo,
    ];

    /// Its name in records and statistics.
    pub const fn name(self) -> &'static str {
        match self {
            Route::Nothing => "none",
            Route::OneShot => "oneshot",
            Route::Direct => "direct",
            Route::Cma => "cma",
            Route::Staged => "staged",
            Route::Pairwise => "pairwise",
            Route::Mpi => "mpi",
            Route::Gloo => "gloo",
        }
    }

    /// The route of this name, if any.
    pub fn from_name(name: &str) -> Option<Route> {
        Route::ALL.into_iter().find(|r| r.name() == name)
    }
}

/// A point-to-point call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct P2p {
    /// A send (else a receive).
    pub send: bool,
    /// Global rank of the peer: the receiver of a send, the sender of a receive; `None` for a receive
    /// from any source until its message came.
    pub peer: Option<usize>,
    /// A receive from any source.
    pub any_source: bool,
    /// The message's tag.
    pub tag: u64,
    /// Its element type (`None`: one the core does not know, from a group driven from Python).
    pub dtype: Option<DType>,
    /// Its elements.
    pub count: u64,
    /// Position among the point-to-point calls this rank recorded on the communicator (1 for the
    /// first; [`Recorder::begin_shared`] numbers them), as torch's `p2p_seq_id`.
    pub seq: u64,
}

impl P2p {
    /// A send (else a receive) of `count` x `dtype` to or from `peer` (`None`: from any source), not
    /// numbered yet.
    pub fn new(
        send: bool,
        peer: Option<usize>,
        tag: u64,
        dtype: impl Into<Option<DType>>,
        count: usize,
    ) -> Self {
        let (dtype, count) = (dtype.into(), count as u64);
        P2p { send, peer, any_source: peer.is_none(), tag, dtype, count, seq: 0 }
    }

    /// Bytes of its message (0 for an element type the core does not know).
    pub fn bytes(&self) -> u64 {
        self.count.saturating_mul(self.dtype.map_or(0, |t| t.size() as u64))
    }

    /// "send" or "recv".
    pub const fn kind(&self) -> &'static str {
        if self.send {
            "send"
        } else {
            "recv"
        }
    }
}

/// What a recorded call was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recorded {
    /// A collective, with its sequence number (the same on every member).
    Collective(Signature),
    /// A send or a receive.
    P2p(P2p),
}

impl Recorded {
    /// Its kind's name ("all_reduce", "send", "recv").
    pub const fn kind(&self) -> &'static str {
        match self {
            Recorded::Collective(sig) => sig.kind.name(),
            Recorded::P2p(p) => p.kind(),
        }
    }

    /// Its kind's position in [`Stats`] (see [`KINDS`]).
    const fn kind_index(&self) -> usize {
        match self {
            Recorded::Collective(sig) => sig.kind as usize - 1,
            Recorded::P2p(p) if p.send => CollKind::ALL.len(),
            Recorded::P2p(_) => CollKind::ALL.len() + 1,
        }
    }

    /// Its element type, if it carries data.
    pub const fn dtype(&self) -> Option<DType> {
        match self {
            Recorded::Collective(sig) => sig.dtype,
            Recorded::P2p(p) => p.dtype,
        }
    }

    /// Its message's elements (a member's part, for a collective).
    pub const fn count(&self) -> u64 {
        match self {
            Recorded::Collective(sig) => sig.count,
            Recorded::P2p(p) => p.count,
        }
    }
}

impl std::fmt::Display for Recorded {
    /// A collective as its signature; a send or receive as errors name it ("send(4 x float32 to rank
    /// 1, tag 0)").
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Recorded::Collective(sig) => sig.fmt(f),
            Recorded::P2p(p) => {
                let (kind, dir) = if p.send { ("send", "to") } else { ("recv", "from") };
                match p.dtype {
                    Some(dtype) => write!(f, "{kind}({} x {dtype} {dir} ", p.count)?,
                    None => write!(f, "{kind}({} elements {dir} ", p.count)?,
                }
                match p.peer {
                    Some(peer) if !p.any_source => write!(f, "rank {peer}")?,
                    Some(peer) => write!(f, "any source: rank {peer}")?,
                    None => f.write_str("any source")?,
                }
                write!(f, ", tag {})", p.tag)
            }
        }
    }
}

/// The kinds the statistics count, in [`Stats`] order: the collectives in code order, then "send" and
/// "recv".
pub const KINDS: usize = CollKind::ALL.len() + 2;

/// The name of the kind at position `i` of [`Stats`].
pub fn kind_name(i: usize) -> &'static str {
    match CollKind::ALL.get(i) {
        Some(kind) => kind.name(),
        None if i == CollKind::ALL.len() => "send",
        None => "recv",
    }
}

/// One frame of a caller's Python stack, as torch's recorder lists them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    /// The function's name.
    pub name: Arc<str>,
    /// Its file.
    pub filename: Arc<str>,
    /// The line it was at.
    pub line: u32,
}

/// A caller's Python stack, innermost frame first.
pub type Stack = Arc<[Frame]>;

/// The stack of the call in one slot of a recorder's ring, with the call's record id.
type KeptStack = Mutex<Option<(u64, Stack)>>;

thread_local! {
    /// The stack of the Python caller whose call this thread runs ([`with_stack`]).
    static CALLER: RefCell<Option<Stack>> = const { RefCell::new(None) };
}

/// Run `f` as the call of a Python caller whose stack is `stack` (captured while it held the GIL): the
/// calls recorded meanwhile on this thread keep it.
pub fn with_stack<T>(stack: Option<Stack>, f: impl FnOnce() -> T) -> T {
    /// Puts back the stack `f` ran under, even when `f` panics (the thread may live on and record).
    struct Restore(Option<Stack>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let before = self.0.take();
            CALLER.with(|c| *c.borrow_mut() = before);
        }
    }
    let Some(stack) = stack else { return f() };
    let _restore = Restore(CALLER.with(|c| c.replace(Some(stack))));
    f()
}

/// The stack of the caller this thread runs a call for, when stacks are kept at all.
fn caller_stack() -> Option<Stack> {
    if !config::flight_recorder_stacks() {
        return None;
    }
    CALLER.with(|c| c.borrow().clone())
}

/// One recorded call.
#[derive(Debug, Clone)]
pub struct Entry {
    /// Position among every call this rank recorded, on any communicator (0 for the first), as
    /// torch's recorder numbers its entries.
    pub record_id: u64,
    /// The call.
    pub call: Recorded,
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
    /// Its caller's Python stack, innermost first, when kept (`AXONML_FLIGHT_RECORDER_STACKS`).
    pub frames: Option<Stack>,
}

/// Totals of one kind on one handle.
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

/// Totals per kind, in [`KINDS`] order ([`kind_name`]).
pub type Stats = [KindStats; KINDS];

/// One gradient bucket's reduction in a step, as its synchronizer saw it (wall-clock nanoseconds, as
/// [`Entry`]'s times).
#[derive(Debug, Clone, Copy)]
pub struct BucketEvent {
    /// The bucket's position in reduction order.
    pub bucket: usize,
    /// Bytes of the bucket.
    pub bytes: u64,
    /// When its last gradient came in.
    pub ready_ns: u64,
    /// When its all-reduce was started: later than ready when an earlier bucket was still filling
    /// (buckets start in order), or, at the end of a step, after the ranks agreed on which gradients
    /// exist.
    pub launched_ns: u64,
    /// When its all-reduce returned.
    pub done_ns: u64,
    /// Whether it returned successfully.
    pub ok: bool,
}

/// What a recorder kept for the timeline since it was last taken: every finished call, oldest first,
/// and the buckets reduced over its communicator.
#[derive(Debug, Default)]
pub struct Log {
    /// The finished calls.
    pub calls: Vec<Entry>,
    /// The reduced buckets.
    pub buckets: Vec<BucketEvent>,
}

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
    /// The last collectives the engine ran: record `id` (of this handle's) sits in slot `id % len`.
    ring: Box<[Slot]>,
    /// Calls recorded so far (the next record's id), stored once its slot is written.
    recorded: AtomicU64,
    /// The stacks of the calls in `ring` (by the same slot, with their record id), when kept.
    stacks: Box<[KeptStack]>,
    /// The last calls recorded by several threads at once (`begin_shared`).
    shared: Mutex<Shared>,
    /// Point-to-point calls recorded so far.
    p2p_calls: AtomicU64,
    totals: [Totals; KINDS],
    /// Kept for the timeline while it is on (written by the thread in a call; taken by the writer).
    log: Mutex<Log>,
}

/// Words of one entry in a ring slot: record id, seq, count, root, codes (kind, dtype, op, state,
/// route: a byte each), prescale and postscale bits, input and output elements, the three times.
const WORDS: usize = 12;
/// A code word's byte, or a root, for a field that has none.
const NO_CODE: u64 = 0xFF;
const NO_ROOT: u64 = u64::MAX;
/// How often a reader tries a slot its writer keeps rewriting before it leaves it out.
const READ_TRIES: usize = 1000;

/// One ring slot: an entry's words and a version that is odd while its writer rewrites them (a
/// seqlock). Only the thread in a call on the communicator writes (the engine's lock of one call at a
/// time), so the recording thread never waits and takes no lock; a reader retries a slot that changed
/// under it. Each slot starts its own pair of cache lines: with unaligned 104-byte slots, small calls
/// of 4 ranks on 2 cores measured slower (the shm bench against a build without the alignment: by
/// 1.14x in the median cell, 8 B to 64 KiB), for reasons not pinned down.
#[derive(Default)]
#[repr(align(128))]
struct Slot {
    version: AtomicU64,
    words: [AtomicU64; WORDS],
}

impl Slot {
    /// Rewrite the words `f` stores to (the writer's own).
    fn write(&self, f: impl FnOnce(&[AtomicU64; WORDS])) {
        let v = self.version.load(Relaxed);
        self.version.store(v.wrapping_add(1), Relaxed);
        fence(Release);
        f(&self.words);
        self.version.store(v.wrapping_add(2), Release);
    }

    /// The words as one write left them; `None` if they kept changing.
    fn read(&self) -> Option<[u64; WORDS]> {
        for _ in 0..READ_TRIES {
            let before = self.version.load(Acquire);
            if before.is_multiple_of(2) {
                let words = std::array::from_fn(|i| self.words[i].load(Relaxed));
                fence(Acquire);
                if self.version.load(Relaxed) == before {
                    return Some(words);
                }
            }
            std::thread::yield_now();
        }
        None
    }
}

/// The code word of an entry.
fn codes(sig: &Signature, state: State, route: Option<Route>) -> u64 {
    let code = |c: Option<u8>| c.map_or(NO_CODE, u64::from);
    u64::from(sig.kind as u8)
        | code(sig.dtype.map(|d| d as u8)) << 8
        | code(sig.op.map(|o| o as u8)) << 16
        | (state as u64) << 24
        | code(route.map(|r| r as u8)) << 32
}

/// The code word `word` with `state` and `route`.
fn with_state(word: u64, state: State, route: Option<Route>) -> u64 {
    let route = route.map_or(NO_CODE, |r| r as u64);
    (word & 0xFF_FFFF) | (state as u64) << 24 | route << 32
}

/// The entry a slot's words hold; `None` for words no entry wrote.
fn decode(w: &[u64; WORDS]) -> Option<Entry> {
    let byte = |at: u32| u8::try_from(w[4] >> at & 0xFF).unwrap_or(u8::MAX);
    let sig = Signature {
        seq: w[1],
        count: w[2],
        root: (w[3] != NO_ROOT).then(|| u32::try_from(w[3]).unwrap_or(u32::MAX)),
        kind: CollKind::from_code(byte(0))?,
        dtype: DType::from_code(byte(8)),
        op: ReduceOp::from_code(byte(16)),
        scale: Scale { pre: f64::from_bits(w[5]), post: f64::from_bits(w[6]) },
    };
    let state =
        [State::Scheduled, State::Started, State::Completed, State::Failed].get(usize::from(byte(24)))?;
    let at = |ns: u64| (ns != 0).then_some(ns);
    Some(Entry {
        record_id: w[0],
        call: Recorded::Collective(sig),
        elems: (w[7], w[8]),
        state: *state,
        created_ns: w[9],
        started_ns: at(w[10]),
        completed_ns: at(w[11]),
        route: Route::ALL.get(usize::from(byte(32))).copied(),
        frames: None,
    })
}

/// One kind's totals, written by the one thread in a call (so without read-modify-write atomics).
#[derive(Default)]
struct Totals {
    calls: AtomicU64,
    failed: AtomicU64,
    bytes: AtomicU64,
    wait_ns: AtomicU64,
    move_ns: AtomicU64,
    routes: [AtomicU64; Route::ALL.len()],
}

/// Add `by` to a counter only one thread writes.
fn bump(counter: &AtomicU64, by: u64) {
    counter.store(counter.load(Relaxed).saturating_add(by), Relaxed);
}

/// Add `by` to a counter several threads write.
fn add(counter: &AtomicU64, by: u64) {
    counter.fetch_add(by, Relaxed);
}

/// The ring of calls recorded by several threads: call `id` (of this ring's) sits in slot `id % len`
/// until a later one takes it.
#[derive(Default)]
struct Shared {
    /// Grown as calls come (most groups never send nor receive), up to `capacity`, then reused.
    slots: Vec<Option<Entry>>,
    capacity: usize,
    next: u64,
}

impl Shared {
    /// Record call `id` (the next one).
    fn put(&mut self, id: u64, entry: Entry) {
        if self.slots.len() < self.capacity {
            self.slots.push(Some(entry)); // at index `id`: every call before it has its slot
        } else if let Some(slot) = self.index(id).and_then(|i| self.slots.get_mut(i)) {
            *slot = Some(entry);
        }
    }

    /// The entry of this ring's call `id`, if still there.
    fn get(&mut self, id: u64, record_id: u64) -> Option<&mut Entry> {
        let slot = self.index(id).and_then(|i| self.slots.get_mut(i))?;
        slot.as_mut().filter(|e| e.record_id == record_id)
    }

    fn index(&self, id: u64) -> Option<usize> {
        let len = u64::try_from(self.capacity).ok().filter(|&n| n > 0)?;
        usize::try_from(id % len).ok()
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

/// Whether a timeline is on: calls numbered while it is are logged when they finish.
static TIMELINE: AtomicBool = AtomicBool::new(false);

/// The recorders a timeline takes its logs from: every recorder live when it was turned on or made
/// since, held so that a communicator destroyed before the timeline is written keeps its calls in it.
fn kept() -> &'static Mutex<Vec<Arc<Recorder>>> {
    static KEPT: OnceLock<Mutex<Vec<Arc<Recorder>>>> = OnceLock::new();
    KEPT.get_or_init(Mutex::default)
}

/// Whether a timeline is on ([`set_timeline`]).
pub fn timeline_on() -> bool {
    TIMELINE.load(Relaxed)
}

/// Turn the timeline on (every recorder logs each call it finishes from now on) or off (no call
/// numbered from now on is logged; what was logged stays until [`take_timeline`]).
pub fn set_timeline(on: bool) {
    let mut kept = lock(kept());
    if on && !timeline_on() {
        let mut now = all();
        now.retain(|r| !kept.iter().any(|k| Arc::ptr_eq(k, r)));
        kept.extend(now);
    }
    TIMELINE.store(on, Relaxed);
}

/// Every recorder's log since the last take, with the recorder (those with nothing logged are left
/// out); once the timeline is off, the recorders are no longer held.
pub fn take_timeline() -> Vec<(Arc<Recorder>, Log)> {
    let mut kept = lock(kept());
    let logs = kept
        .iter()
        .filter_map(|r| {
            let log = std::mem::take(&mut *lock(&r.log));
            (!log.calls.is_empty() || !log.buckets.is_empty()).then(|| (r.clone(), log))
        })
        .collect();
    if !timeline_on() {
        kept.clear();
    }
    logs
}

/// A call in flight, as its recorder's caller holds it between [`Recorder::begin`] (or
/// [`Recorder::begin_shared`]) and [`Recorder::end`].
pub struct Flight {
    /// Its position in its ring.
    id: u64,
    record_id: u64,
    /// In the ring of `begin_shared`.
    shared: bool,
    call: Recorded,
    elems: (u64, u64),
    frames: Option<Stack>,
    created: Instant,
    started: Option<Instant>,
    /// The timeline was on when the call was numbered: it is logged when it ends.
    logged: bool,
}

impl Flight {
    /// A receive from any source got its message from global rank `peer`.
    pub fn received_from(&mut self, peer: usize) {
        if let Recorded::P2p(p) = &mut self.call {
            p.peer = Some(peer);
        }
    }
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
        let len = config::flight_recorder_entries();
        let ring = (0..len).map(|_| Slot::default()).collect();
        let stacks_len = if config::flight_recorder_stacks() { len } else { 0 };
        let stacks = (0..stacks_len).map(|_| Mutex::default()).collect();
        let shared = Mutex::new(Shared { slots: Vec::new(), capacity: len, next: 0 });
        let recorder = Arc::new(Recorder {
            rank,
            world_size,
            members,
            occurrence,
            index,
            world_ordinal,
            world,
            names,
            ring,
            recorded: AtomicU64::new(0),
            stacks,
            shared,
            p2p_calls: AtomicU64::new(0),
            totals: Default::default(),
            log: Mutex::default(),
        });
        // Under the kept lock, so that a timeline turned on meanwhile sees it in one place or the other.
        let mut kept = lock(kept());
        let mut listed = lock(registry());
        listed.retain(|w| w.strong_count() > 0);
        listed.push(Arc::downgrade(&recorder));
        if timeline_on() {
            kept.push(recorder.clone());
        }
        recorder
    }

    /// The slot of this handle's record `id`; none when the ring has no room at all.
    fn slot(&self, id: u64) -> Option<&Slot> {
        let len = u64::try_from(self.ring.len()).ok().filter(|&n| n > 0)?;
        self.ring.get(usize::try_from(id % len).ok()?)
    }

    /// Record call `sig` (numbered), whose buffers hold `elems` elements, as scheduled now. The
    /// recording methods are called by the thread in the call only (the engine's one call at a time).
    pub(crate) fn begin(&self, sig: &Signature, elems: (u64, u64)) -> Flight {
        let created = Instant::now();
        let record_id = self.names.calls.fetch_add(1, Relaxed);
        let id = self.recorded.load(Relaxed);
        let frames = caller_stack();
        if let (Some(stack), Some(kept)) = (&frames, self.stack_slot(id)) {
            *lock(kept) = Some((record_id, stack.clone()));
        }
        if let Some(slot) = self.slot(id) {
            let created_ns = wall_ns(created);
            slot.write(|w| {
                let root = sig.root.map_or(NO_ROOT, u64::from);
                let words = [record_id, sig.seq, sig.count, root, codes(sig, State::Scheduled, None)];
                for (word, value) in w.iter().zip(words) {
                    word.store(value, Relaxed);
                }
                w[5].store(sig.scale.pre.to_bits(), Relaxed);
                w[6].store(sig.scale.post.to_bits(), Relaxed);
                w[7].store(elems.0, Relaxed);
                w[8].store(elems.1, Relaxed);
                w[9].store(created_ns, Relaxed);
                w[10].store(0, Relaxed);
                w[11].store(0, Relaxed);
            });
        }
        self.recorded.store(id + 1, Release);
        bump(&self.totals[sig.kind as usize - 1].calls, 1);
        let call = Recorded::Collective(*sig);
        let logged = timeline_on();
        Flight { id, record_id, shared: false, call, elems, frames, created, started: None, logged }
    }

    /// The slot of the stack of this handle's record `id`, when stacks are kept.
    fn stack_slot(&self, id: u64) -> Option<&KeptStack> {
        let len = u64::try_from(self.stacks.len()).ok().filter(|&n| n > 0)?;
        self.stacks.get(usize::try_from(id % len).ok()?)
    }

    /// Record `call`, whose buffers hold `elems` elements, as scheduled now, in the ring that several
    /// threads may write at once: a send or receive (numbered here among this handle's), or a call of
    /// a group driven from Python (a collective numbered by its group).
    pub fn begin_shared(&self, mut call: Recorded, elems: (u64, u64)) -> Flight {
        let created = Instant::now();
        if let Recorded::P2p(p) = &mut call {
            p.seq = self.p2p_calls.fetch_add(1, Relaxed) + 1;
        }
        let frames = caller_stack();
        let record_id = self.names.calls.fetch_add(1, Relaxed);
        let entry = Entry {
            record_id,
            call,
            elems,
            state: State::Scheduled,
            created_ns: wall_ns(created),
            started_ns: None,
            completed_ns: None,
            route: None,
            frames: frames.clone(),
        };
        let id = {
            let mut shared = lock(&self.shared);
            let id = shared.next;
            shared.next += 1;
            shared.put(id, entry);
            id
        };
        add(&self.totals[call.kind_index()].calls, 1);
        let logged = timeline_on();
        Flight { id, record_id, shared: true, call, elems, frames, created, started: None, logged }
    }

    /// Every member arrived at the call in `flight`, now (returned).
    pub fn started(&self, flight: &mut Flight) -> Instant {
        let now = Instant::now();
        flight.started = Some(now);
        if flight.shared {
            if let Some(e) = lock(&self.shared).get(flight.id, flight.record_id) {
                e.state = State::Started;
                e.started_ns = Some(wall_ns(now));
            }
        } else if let Some(slot) = self.slot(flight.id) {
            slot.write(|w| {
                w[4].store(with_state(w[4].load(Relaxed), State::Started, None), Relaxed);
                w[10].store(wall_ns(now), Relaxed);
            });
        }
        now
    }

    /// The call in flight returned (`ok`: successfully), its data moved by `route` (when it got that
    /// far), `bytes` its message's size.
    /// A call that never started (a send or receive: the engine cannot tell when its peer came) counts
    /// its whole time as waiting.
    pub fn end(&self, flight: Flight, ok: bool, route: Option<Route>, bytes: u64) {
        let now = Instant::now();
        let state = if ok { State::Completed } else { State::Failed };
        if flight.shared {
            if let Some(e) = lock(&self.shared).get(flight.id, flight.record_id) {
                (e.state, e.route, e.completed_ns, e.call) = (state, route, Some(wall_ns(now)), flight.call);
            }
        } else if let Some(slot) = self.slot(flight.id) {
            slot.write(|w| {
                w[4].store(with_state(w[4].load(Relaxed), state, route), Relaxed);
                w[11].store(wall_ns(now), Relaxed);
            });
        }
        if flight.logged {
            lock(&self.log).calls.push(Entry {
                record_id: flight.record_id,
                call: flight.call,
                elems: flight.elems,
                state,
                created_ns: wall_ns(flight.created),
                started_ns: flight.started.map(wall_ns),
                completed_ns: Some(wall_ns(now)),
                route,
                frames: flight.frames,
            });
        }
        // The engine's collectives run one at a time: their totals have one writer.
        let count = if flight.shared { add } else { bump };
        let totals = &self.totals[flight.call.kind_index()];
        if !ok {
            count(&totals.failed, 1);
            return;
        }
        count(&totals.bytes, bytes);
        let started = flight.started.unwrap_or(now);
        count(&totals.wait_ns, ns(flight.created, started));
        count(&totals.move_ns, ns(started, now));
        if let Some(r) = route {
            count(&totals.routes[r as usize], 1);
        }
    }

    /// Log a gradient bucket's reduction over this communicator (the timeline is on).
    pub(crate) fn bucket(&self, event: BucketEvent) {
        lock(&self.log).buckets.push(event);
    }

    /// The recorded calls still in the ring, oldest first (a slot rewritten all the while it was read
    /// is left out).
    pub fn entries(&self) -> Vec<Entry> {
        let recorded = usize::try_from(self.recorded.load(Acquire)).unwrap_or(usize::MAX);
        let mut entries: Vec<Entry> = (self.ring.iter().enumerate().take(recorded))
            .filter_map(|(i, slot)| {
                let mut e = decode(&slot.read()?)?;
                if let Some((id, stack)) = self.stacks.get(i).and_then(|kept| lock(kept).clone()) {
                    e.frames = (id == e.record_id).then_some(stack);
                }
                Some(e)
            })
            .collect();
        entries.extend(lock(&self.shared).slots.iter().flatten().cloned());
        entries.sort_by_key(|e| e.record_id);
        entries
    }

    /// The totals per collective kind.
    pub fn stats(&self) -> Stats {
        let mut stats = Stats::default();
        for (s, t) in stats.iter_mut().zip(&self.totals) {
            *s = KindStats {
                calls: t.calls.load(Relaxed),
                failed: t.failed.load(Relaxed),
                bytes: t.bytes.load(Relaxed),
                wait_ns: t.wait_ns.load(Relaxed),
                move_ns: t.move_ns.load(Relaxed),
                routes: std::array::from_fn(|i| t.routes[i].load(Relaxed)),
            };
        }
        stats
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_in_a_call_under_a_stack_leaves_no_stack_set_on_its_thread() {
        let frame = Frame { name: "caller".into(), filename: "job.py".into(), line: 3 };
        let stack: Stack = vec![frame].into();
        let inner = with_stack(Some(stack.clone()), || CALLER.with(|c| c.borrow().clone()));
        assert_eq!(inner.as_deref(), Some(&*stack));
        let caught = std::panic::catch_unwind(|| with_stack(Some(stack), || panic!("the call failed")));
        assert!(caught.is_err());
        assert!(CALLER.with(|c| c.borrow().is_none()), "the panicking call's stack stayed set");
    }

    #[test]
    fn a_slot_gives_back_the_entry_written_and_the_ring_keeps_the_last_calls() {
        let names = Arc::new(Names::new(next_world()));
        let r = Recorder::new("test", 0, 2, vec![0, 1], names);
        let n = r.ring.len() as u64 + 3;
        for seq in 1..=n {
            let sig = Signature::new(CollKind::Reduce, seq, 5).dtype(DType::F64).op(ReduceOp::Max).root(1);
            let mut f = r.begin(&sig, (5, 5));
            r.started(&mut f);
            r.end(f, seq % 2 == 0, Some(Route::Staged), 40);
        }
        let got = r.entries();
        assert_eq!(got.len(), r.ring.len());
        let oldest = n - r.ring.len() as u64 + 1;
        for (e, seq) in got.iter().zip(oldest..) {
            let want = Signature::new(CollKind::Reduce, seq, 5).dtype(DType::F64).op(ReduceOp::Max).root(1);
            assert_eq!((e.record_id, e.call, e.elems), (seq - 1, Recorded::Collective(want), (5, 5)));
            let state = if seq % 2 == 0 { State::Completed } else { State::Failed };
            assert_eq!((e.state, e.route), (state, Some(Route::Staged)));
            assert!(e.created_ns <= e.started_ns.unwrap() && e.started_ns <= e.completed_ns);
        }
        let s = r.stats()[CollKind::Reduce as usize - 1];
        assert_eq!((s.calls, s.failed, s.bytes), (n, n - n / 2, 40 * (n / 2)));
        assert_eq!(s.routes[Route::Staged as usize], n / 2);
    }

    #[test]
    fn the_timeline_logs_every_call_numbered_while_it_is_on_even_of_a_dropped_recorder() {
        let names = Arc::new(Names::new(next_world()));
        let r = Recorder::new("test", 1, 2, vec![0, 1], names);
        let call = |seq| {
            let mut f = r.begin(&Signature::new(CollKind::Barrier, seq, 0), (0, 0));
            r.started(&mut f);
            r.end(f, true, Some(Route::Nothing), 0);
        };
        call(1);
        set_timeline(true);
        let n = r.ring.len() as u64 * 2;
        for seq in 2..n + 2 {
            call(seq);
        }
        set_timeline(false);
        call(n + 2);
        let weak = Arc::downgrade(&r);
        drop(r);
        let taken = take_timeline();
        let (recorder, log) = taken.iter().find(|(k, _)| Arc::as_ptr(k) == weak.as_ptr()).unwrap();
        assert_eq!(recorder.rank, 1);
        let seqs: Vec<u64> = (log.calls.iter())
            .map(|e| match e.call {
                Recorded::Collective(sig) => sig.seq,
                Recorded::P2p(_) => 0,
            })
            .collect();
        assert_eq!(seqs, (2..n + 2).collect::<Vec<_>>());
        for e in &log.calls {
            assert!(e.created_ns <= e.started_ns.unwrap() && e.started_ns <= e.completed_ns);
        }
        drop(taken);
        assert!(weak.upgrade().is_none(), "no longer held once taken with the timeline off");
    }

    #[test]
    fn sends_and_receives_from_many_threads_keep_the_last_calls_and_every_total() {
        let names = Arc::new(Names::new(next_world()));
        let r = Recorder::new("test", 0, 3, vec![0, 1, 2], names);
        let len = r.ring.len();
        // A receive that outlives a whole ring of later calls: its end must not touch their entries.
        let slow = r.begin_shared(Recorded::P2p(P2p::new(false, None, 9, DType::U8, 1)), (1, 1));
        let (threads, each) = (4, len);
        std::thread::scope(|s| {
            for t in 0..threads {
                let r = &r;
                s.spawn(move || {
                    for _ in 0..each {
                        let p2p = P2p::new(t % 2 == 0, Some(1 + t % 2), t as u64, DType::F32, 3);
                        let f = r.begin_shared(Recorded::P2p(p2p), (3, 3));
                        r.end(f, true, None, p2p.bytes());
                    }
                });
            }
        });
        let mut slow = slow;
        slow.received_from(2);
        r.end(slow, false, None, 1);
        let got = r.entries();
        assert_eq!(got.len(), len);
        assert!(got.windows(2).all(|w| w[0].record_id < w[1].record_id));
        for e in &got {
            let Recorded::P2p(p) = e.call else { panic!("{e:?}") };
            assert_eq!((p.tag < threads as u64, p.count, e.state), (true, 3, State::Completed), "{e:?}");
        }
        // Numbered 1.. in the order they were recorded, one number each.
        let mut seqs: Vec<u64> = (got.iter())
            .map(|e| match e.call {
                Recorded::P2p(p) => p.seq,
                Recorded::Collective(_) => 0,
            })
            .collect();
        seqs.sort_unstable();
        seqs.dedup();
        assert_eq!(seqs.len(), len);
        let stats = r.stats();
        let (send, recv) = (stats[KINDS - 2], stats[KINDS - 1]);
        let sends = (threads / 2 * each) as u64;
        assert_eq!((send.calls, send.bytes, send.failed), (sends, 12 * sends, 0));
        assert_eq!((recv.calls, recv.bytes, recv.failed), (sends + 1, 12 * sends, 1));
        assert_eq!((kind_name(KINDS - 2), kind_name(KINDS - 1)), ("send", "recv"));
    }
}
