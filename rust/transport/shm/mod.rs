//! The multi-process world on one host: ranks are processes sharing one /dev/shm segment.
//!
//! Ranks meet through a key-value store (`crate::rendezvous`: the TCP store rank 0 hosts on
//! MASTER_ADDR:MASTER_PORT, or the job's own, such as torch's), where rank 0 admits the ranks that
//! prove they belong to the job and hands out the segment it created (`join`), which is unlinked once
//! everyone attached; then they talk only through the segment (`layout` describes it, `segment` creates and checks it,
//! `shared` is one process's view of it). The engine (`crate::engine`) runs the meeting protocol on
//! the control blocks in the segment, with shared futexes (`store`):
//! * buffers are published as segment offsets; an all_reduce of at most `small` bytes goes one-shot
//!   through the first two buffers of each member's staging block;
//! * when every member's buffers lie in the segment (arrays from `alloc`, the `arena`), the direct
//!   algorithms run on them in place (zero copy), followed by the engine's drain;
//! * otherwise data is pipelined through the staging blocks (`algo::staged`): peers only read
//!   staging, and only the owner writes a private buffer, so no drain is needed.
//!
//! Every wait spins briefly, then sleeps on a shared futex in slices that check the abort word
//! (`abort`), the deadline, and the pidfds of the ranks waited for (`liveness`): a SIGKILLed rank
//! aborts the world within one slice, and every member raises `PeerExited` naming it and, once its
//! parent has reaped it, how it ended.
//!
//! Subgroups live in a fixed table of communicator slots (`comms`), changed only under a lock in the
//! header: the n-th split of a rank set finds the slot bound to (members, n), or, for the first
//! member there, binds a free slot and staging blocks for its members. A member that drops its group
//! marks itself left; once every member has, the slot and its blocks are free again. Every member
//! finds the same slot: a bound key stays bound until all its members have left, and none asks for it
//! again.
//!
//! Each rank maps what only a peer writes (peers' staging blocks, the cells of channels it does not
//! send on) read-only, so a stray write there faults in the writer instead of corrupting a peer.

mod abort;
mod arena;
mod comms;
mod join;
mod layout;
mod liveness;
mod p2p;
pub(crate) mod segment;
mod shared;
mod store;
#[cfg(test)]
mod tests;

/// The parsers of what peers, stores and files say, for the fuzz entry points (`crate::fuzzing`).
#[cfg(any(test, feature = "fuzzing"))]
pub(crate) mod parsers {
    pub(crate) use super::join::{parse as parse_token, token};
    pub(crate) use super::layout::{Header, Layout, Params, MAX_RANKS};
    pub(crate) use super::p2p::Head;
    pub(crate) use super::segment::{plausible_name, validate};
}

use std::sync::Arc;
use std::time::Duration;

pub use crate::rendezvous::JobSecret;
/// What the launcher and the stale-segment cleanup (Python) must know of a segment's header.
#[cfg(feature = "python")]
pub(crate) use layout::Header as SegmentHeader;
pub use layout::{MAGIC, MAX_RANKS, VERSION};
pub use segment::{name_for as segment_name, DIR, PREFIX};

use crate::config::MAX_TIMEOUT;
use crate::engine::{backend_type, Engine};
use crate::rendezvous::{KeyValueStore, MemoryStore, StoreHost, TcpStore};
use join::Joined;
use shared::Shared;
use store::ShmStore;

pub use crate::config::DEFAULT_ARENA;

/// How to join a shared-memory world.
#[derive(Clone, Debug)]
pub struct ShmOptions {
    /// This process's rank.
    pub rank: usize,
    /// Number of ranks.
    pub world_size: usize,
    /// Where rank 0 hosts the rendezvous store (an address of this host); [`ShmBackend::connect`]
    /// only.
    pub master_addr: String,
    /// The rendezvous store's port: a job is identified by it while it starts; `connect` only.
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
    /// they believe only a rank 0 that does (`crate::rendezvous`). Without one, whoever can write the
    /// store may join (rank 0's own TCP store admits only processes of its user).
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

/// One rank's handle on the shared-memory world (or one of its subgroups). A
/// [`Backend`](crate::Backend).
pub struct ShmBackend(Engine<ShmStore>);

impl ShmBackend {
    /// Join the job described by `opts`: rank 0 hosts the rendezvous store on
    /// `master_addr:master_port`, the others connect to it; then as [`ShmBackend::join`].
    pub fn connect(opts: ShmOptions) -> crate::Result<ShmBackend> {
        let opts = ShmOptions { timeout: opts.timeout.min(MAX_TIMEOUT), ..opts };
        let joined = join_over_tcp(&opts)?;
        Self::from_joined(joined, opts.rank, opts.timeout)
    }

    /// Join the job described by `opts` (but for its master address and port) through `store`, the
    /// job's own key-value store: the ranks meet, rank 0 creates the segment, everyone attaches it.
    /// Blocks until every rank has joined.
    pub fn join(store: &dyn KeyValueStore, opts: ShmOptions) -> crate::Result<ShmBackend> {
        let opts = ShmOptions { timeout: opts.timeout.min(MAX_TIMEOUT), ..opts };
        let joined = join::through(store, &opts)?;
        Self::from_joined(joined, opts.rank, opts.timeout)
    }

    /// The world's communicator over a joined segment.
    fn from_joined(joined: Joined, rank: usize, timeout: Duration) -> crate::Result<ShmBackend> {
        let world = Arc::new(Shared::new(joined, rank, timeout)?);
        Ok(ShmBackend(Engine::new(ShmStore::world(world), crate::flight::next_world())))
    }
}

/// Join through the TCP store rank 0 hosts while the world starts (a world of one needs none).
fn join_over_tcp(opts: &ShmOptions) -> crate::Result<Joined> {
    layout::check_member(opts.rank, opts.world_size)?;
    let (addr, port) = (opts.master_addr.as_str(), opts.master_port);
    if opts.world_size == 1 {
        join::through(&MemoryStore::new(), opts)
    } else if opts.rank == 0 {
        let host = StoreHost::start(addr, port, opts.timeout, opts.secret.as_ref())?;
        join::through(&host.store(), opts)
    } else {
        let started = std::time::Instant::now();
        let store =
            TcpStore::connect(addr, port, opts.rank, opts.world_size, opts.timeout, opts.secret.as_ref())?;
        let left = ShmOptions { timeout: opts.timeout.saturating_sub(started.elapsed()), ..opts.clone() };
        join::through(&store, &left)
    }
}

backend_type!(ShmBackend, ShmStore);
