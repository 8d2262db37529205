//! The multi-process world on one host: ranks are processes sharing one /dev/shm segment.
//!
//! Ranks meet through `rendezvous` (rank 0 listens on MASTER_ADDR:MASTER_PORT, creates the segment,
//! hands out its name and nonce to ranks that prove they belong to the job (`auth`), and unlinks it
//! once everyone attached) and then talk only through
//! the segment (`layout` describes it, `segment` creates and checks it). The protocol is the
//! in-process world's (see `transport::thread`) with the control blocks in the segment and shared
//! futexes:
//!
//! 1. publish page `k % 2` (encoded signature + buffer offsets; for a one-shot all_reduce also copy the
//!    data into one-shot slot `k % 2`), store `arrive = k`, wake the communicator's event;
//! 2. wait until every member arrived at k, decode and compare the signatures: any difference aborts
//!    the world and every member raises the same mismatch, before any buffer is touched;
//! 3. move data: a one-shot all_reduce (≤ `small` bytes) reduces every member's slot in rank order
//!    into its own buffer and is done (one sync). When every member's buffers lie in the segment
//!    (arrays from `alloc`), run the thread world's owner-computes / direct-copy algorithms on them
//!    (zero copy) and finish with `done = k` and a wait for every member's `done`. Otherwise pipeline
//!    through the staging buffers (`staged`).
//! 4. every member that arrived stores `done = k` on every way out. Before writing peers' arrays, a
//!    member on the zero-copy path re-checks the abort word (SeqCst, after a fence); a member whose
//!    arrival wait failed first aborts the world and then waits, with no deadline, for the `done` of
//!    every peer it sees arrived (one side always sees the other: the arrival and the abort are both
//!    SeqCst, with fences between).
//!    The zero-copy path, and any member that saw the abort after every arrival, also waits without a
//!    deadline for every member's `done`, so no rank returns while a peer may still touch its arrays.
//!    The one-shot and staged paths need no such wait: peers only read staging (in the segment, reused
//!    two calls later at the earliest) and only the owner writes a private buffer.
//!
//! Every wait spins briefly, then sleeps on a shared futex in slices that check the abort word, the
//! deadline, and the pidfds of the ranks waited for (`liveness`): a SIGKILLed rank aborts the world
//! within one slice, and every member raises `PeerDied` naming it.
//!
//! Subgroups live in a fixed table of communicator slots, changed only under a lock in the header:
//! the n-th split of a rank set finds the slot bound to (members, n), or, for the first member there,
//! binds a free slot and staging blocks for its members. A member that drops its group marks itself
//! left; once every member has, the slot and its blocks are free again. Every member finds the same
//! slot: a bound key stays bound until all its members have left, and none asks for it again.
//!
//! Each rank maps what only a peer writes (peers' staging blocks, the cells of channels it does not
//! send on) read-only, so a stray write there faults in the writer instead of corrupting a peer.

mod auth;
mod backend;
mod layout;
mod liveness;
mod p2p;
mod rendezvous;
pub(crate) mod segment;
mod staged;
mod store_join;
mod table;
#[cfg(test)]
mod tests;
mod wire;
mod world;

use std::time::Duration;

pub use auth::JobSecret;
pub use backend::ShmBackend;
pub use layout::MAX_RANKS;
/// What the launcher and the stale-segment cleanup (Python) must know of a segment's name and header.
pub(crate) use layout::{
    Header as SegmentHeader, MAGIC as SEGMENT_MAGIC, NAME_PREFIX as SEGMENT_PREFIX,
    VERSION as SEGMENT_VERSION,
};
pub use store_join::SegmentToken;

pub use crate::config::DEFAULT_ARENA;

/// How to join a shared-memory world.
#[derive(Clone, Debug)]
pub struct ShmOptions {
    /// This process's rank.
    pub rank: usize,
    /// Number of ranks.
    pub world_size: usize,
    /// Where rank 0 listens for the rendezvous (an address of this host).
    pub master_addr: String,
    /// The rendezvous port: a job is identified by it while it starts.
    pub master_port: u16,
    /// How long rendezvous and every later wait may last.
    pub timeout: Duration,
    /// The launcher's job id: the segment is then named after it, so the launcher can remove it
    /// after a crash during start-up. Without one the name is random.
    pub job_id: Option<String>,
    /// Bytes of segment arrays per rank (rank 0's value is used by everyone).
    pub arena_bytes: usize,
    /// The pipeline round size for large messages on private arrays (rank 0's value counts), when
    /// not the default: a tuning knob.
    pub chunk_bytes: Option<usize>,
    /// The job's secret (AXONML_JOB_SECRET): rank 0 admits only ranks that prove they know it, and
    /// they believe only a rank 0 that does. Without one, rank 0 admits processes of its own user.
    pub secret: Option<JobSecret>,
}

impl ShmOptions {
    /// Options with the default timeout and arena, a random segment name, and the environment's
    /// pipeline round size (`config::shm_chunk_from_env`).
    pub fn new(rank: usize, world_size: usize, master_addr: &str, master_port: u16) -> Self {
        ShmOptions {
            rank,
            world_size,
            master_addr: master_addr.to_string(),
            master_port,
            timeout: crate::config::DEFAULT_TIMEOUT,
            job_id: None,
            arena_bytes: DEFAULT_ARENA,
            chunk_bytes: crate::config::shm_chunk_from_env(),
            secret: None,
        }
    }
}
