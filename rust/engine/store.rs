//! What the engine needs from a world: the [`Store`] trait, and the per-member state both worlds keep
//! in the same shape (a [`Ctrl`] block of counters and two [`Page`]s per member of a communicator).

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::Duration;

use crossbeam_utils::CachePadded;

use super::wire;
use crate::algo::route::{Place, Staging};
use crate::algo::route_times::RouteTimes;
use crate::backend::SharedMem;
use crate::dtype::{Buf, BufMut};
use crate::error::{Error, Result};
use crate::signature::Signature;
use crate::sync::lock;
use crate::sync::wait::{may_spin, Wait};

/// One member's control block in a communicator. Counters are monotonic over the communicator's life
/// and written only by their member. `repr(C)`: in the shm world it lives in the segment.
#[repr(C)]
#[derive(Default)]
pub(crate) struct Ctrl {
    /// Sequence number of the last collective this member entered (its page is published).
    pub arrive: CachePadded<AtomicU64>,
    /// Sequence number of the last collective whose buffers this member no longer touches.
    pub done: CachePadded<AtomicU64>,
    /// Sequence number of the last collective this member completed successfully (timeout reports).
    pub completed: CachePadded<AtomicU64>,
    /// Sequence number of the last collective whose data this member moved in full, its share of
    /// every member's buffers included; stored before its `done`, so a member that drained it reads
    /// whether the call succeeded there (`Engine::execute`).
    pub moved: CachePadded<AtomicU64>,
    /// Pipeline steps completed (three per staged round, see `algo::staged`).
    pub step: CachePadded<AtomicU64>,
    /// The core this member ran on when it last published progress, plus one (0: not yet; see
    /// `sync::wait::current_cpu`): waiters spin past their short budget only while the members
    /// they wait for sit on other cores.
    pub cpu: CachePadded<AtomicU32>,
    /// How many tiles of this member's part of the current call members have claimed
    /// (`algo::claims::Claims`).
    pub claim: CachePadded<AtomicU64>,
    /// Page `k % 2` describes call k.
    pub pages: [CachePadded<Page>; 2],
}

/// What a member publishes for one collective: its encoded signature (`engine::wire`) and where its
/// send and receive buffers are, as the world expresses them (addresses in the in-process world,
/// segment offsets in the shm world). Plain numbers only: peers decode and check them, never trust them.
#[derive(Clone, Copy, Default, Debug)]
pub(crate) struct Published {
    pub sig: [u64; wire::WORDS],
    pub send: u64,
    pub recv: u64,
}

/// The words of a [`Published`] value. Atomic (relaxed) so that timeout reports may read a page while
/// its member rewrites it; the `arrive` counter orders the words for the protocol.
#[repr(C)]
#[derive(Default)]
pub(crate) struct Page([AtomicU64; wire::WORDS + 2]);

impl Page {
    pub(crate) fn store(&self, p: &Published) {
        let words = p.sig.iter().chain([&p.send, &p.recv]);
        for (w, v) in self.0.iter().zip(words) {
            w.store(*v, Relaxed);
        }
    }

    /// The encoded signature alone (`engine::wire`).
    pub(crate) fn sig(&self) -> [u64; wire::WORDS] {
        std::array::from_fn(|i| self.0[i].load(Relaxed))
    }

    pub(crate) fn load(&self) -> Published {
        let w = |i: usize| self.0[i].load(Relaxed);
        Published { sig: std::array::from_fn(w), send: w(wire::WORDS), recv: w(wire::WORDS + 1) }
    }
}

/// Why the world is being aborted, as far as the other ranks need to know.
pub(crate) enum Cause<'a> {
    /// An error on the aborting rank, or an explicit abort.
    Other,
    /// This rank's process died.
    Dead(usize),
    /// These ranks never arrived before the deadline.
    Missing(&'a [usize]),
}

/// How many times one rank has split each rank set, so that the n-th split of a set on every member
/// finds the same communicator.
#[derive(Default)]
pub(crate) struct Splits(Mutex<HashMap<Vec<usize>, u32>>);

impl Splits {
    /// Count one more split of `members`; returns its occurrence (1 for the first).
    pub(crate) fn next(&self, members: &[usize]) -> u32 {
        let mut counts = lock(&self.0);
        let c = counts.entry(members.to_vec()).or_insert(0);
        *c += 1;
        *c
    }
}

/// One member's view of one communicator in a world: what differs between worlds. The engine
/// (`engine::Engine`) runs the meeting protocol against it.
pub(crate) trait Store: Send + Sync + Sized + 'static {
    /// Short name of the transport ("threads", "shm").
    const NAME: &'static str;

    /// This rank's global rank.
    fn rank(&self) -> usize;
    /// Ranks in the whole world.
    fn world_size(&self) -> usize;
    /// Global ranks of the communicator's members, ascending.
    fn members(&self) -> &[usize];
    /// This member's index in [`Store::members`].
    fn index(&self) -> usize;
    /// How long any wait on this communicator lasts: its own timeout (`split`), the world's for the
    /// world's communicator.
    fn timeout(&self) -> Duration;

    /// Member `j`'s control block.
    fn ctrl(&self, j: usize) -> &Ctrl;
    /// Whether this world's waits spin before they yield, and its members help each other with
    /// tiles (`algo::claims`): only when its ranks each have a core. Every rank of the world may be
    /// waiting at once (groups run side by side), so the world's size counts, not the group's.
    fn spins(&self) -> bool {
        may_spin(self.world_size())
    }
    /// A wait on the communicator's event, with this world's spin policy ([`Store::spins`]) and a
    /// fresh deadline.
    fn wait<'a>(&'a self, op: &'a dyn fmt::Display) -> Wait<'a>;
    /// Wake the members waiting on the communicator's event (after publishing a counter).
    fn notify(&self);

    /// All-reduces of at most this many bytes go one-shot (`algo::oneshot`).
    fn oneshot_bytes(&self) -> usize;
    /// Member `j`'s one-shot buffer for call `k` ([`Store::oneshot_bytes`] long; buffer `k % 2`).
    fn oneshot(&self, j: usize, k: u64) -> *mut u8;

    /// Member `j`'s layout buffer for call `k` (buffer `k % 2`), of at least
    /// `2 * members().len()` words: the layouts of the pairwise collectives (`algo::layout`), written
    /// and read like one-shot buffers.
    fn layout(&self, j: usize, k: u64) -> *mut u64;

    /// How peers find `bytes` at `ptr`, this member's buffer for `sig` (a number for [`Published`]).
    fn share(&self, ptr: *const u8, bytes: usize, sig: &Signature) -> u64;
    /// Where calls that staged or crossed report what they took (`algo::route_times`); none for
    /// worlds whose calls never choose between the two.
    fn routes(&self) -> Option<&RouteTimes> {
        None
    }
    /// Where every member's send and receive buffers are, read from its page and the bytes they span,
    /// for the route choice (`algo::route::choose`). Fails when a page names a buffer no honest peer
    /// would publish.
    fn places(
        &self,
        pages: &[Published],
        sig: &Signature,
        spans: &[(usize, usize)],
    ) -> Result<Vec<[Place; 2]>>;
    /// Every member's pipeline buffers, for calls that stage (`algo::staged`); none in a world whose
    /// buffers every member addresses.
    fn staging(&self) -> Option<Staging> {
        None
    }

    /// True once the world is aborted (a cheap `SeqCst` load, checked on every poll).
    fn aborted(&self) -> bool;
    /// The error an aborted world gives in `op`: who aborted and why, or, for a member `waiting` in a
    /// collective when the cause was a timeout, that timeout (naming the missing ranks).
    fn abort_error(&self, op: &str, waiting: bool) -> Error;
    /// Abort the whole world on behalf of this rank (the first abort wins) and wake every waiter.
    fn abort(&self, reason: &str, cause: Cause<'_>);
    /// Fails when one of the global `ranks` is gone for good (and will never arrive), naming it.
    fn check_alive(&self, ranks: &[usize], op: &str) -> Result<()>;
    /// True when global `rank` can never again touch a buffer of the current call: its process died
    /// (the shm world also aborts then). The drain stops waiting only for such a member; a rank that
    /// merely left (`leave`) may still be running its queued work, so the thread world says false.
    fn vanished(&self, rank: usize, op: &str) -> bool;

    /// Send `buf` to global rank `dst` (already checked); `op` names the call in errors.
    fn send(&self, buf: Buf<'_>, dst: usize, tag: u64, op: &str) -> Result<()>;
    /// Receive into `buf` from global rank `src` (already checked).
    fn recv(&self, buf: BufMut<'_>, src: usize, tag: u64, op: &str) -> Result<()>;
    /// Receive into `buf` the first message with `tag` from one of the global ranks `from` (checked;
    /// when several have one, the earliest in `from`), returning its sender.
    fn recv_any(&self, buf: BufMut<'_>, from: &[usize], tag: u64, op: &str) -> Result<usize>;

    /// This rank's view of the communicator over `members` (validated, sorted; this rank is
    /// `members[index]`), whose waits last `timeout` (at most `MAX_TIMEOUT`).
    fn split(&self, members: Vec<usize>, index: usize, timeout: Duration) -> Result<Self>;
    /// This rank will make no more calls (see `Backend::leave`).
    fn leave(&self) {}
    /// Memory every member can address (see `Backend::alloc`).
    fn alloc(&self, bytes: usize) -> Result<Option<SharedMem>> {
        let _ = bytes;
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_page_gives_back_what_was_published() {
        let page = Page::default();
        let p = Published { sig: [1, u64::MAX, 3, 4, 7, 8], send: 5, recv: u64::MAX - 1 };
        page.store(&p);
        let got = page.load();
        assert_eq!((got.sig, got.send, got.recv), (p.sig, p.send, p.recv));
    }

    #[test]
    fn splits_count_each_rank_set_on_its_own() {
        let s = Splits::default();
        assert_eq!([s.next(&[0, 1]), s.next(&[0, 2]), s.next(&[0, 1]), s.next(&[0, 1])], [1, 1, 2, 3]);
    }
}
