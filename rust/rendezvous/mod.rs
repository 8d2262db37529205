//! How the ranks of a job meet: one protocol (`meet`) against a key-value store
//! ([`KeyValueStore`]: set, get, wait, add, delete, as gloo's and torch's stores), whichever store the
//! job has: torch's (the Python bindings adapt it), or the small TCP store rank 0 hosts on
//! MASTER_ADDR:MASTER_PORT while the job starts ([`StoreHost`], which rank 0 uses in memory; the
//! others reach it as a [`TcpStore`]).
//!
//! The job secret (AXONML_JOB_SECRET) is checked by the protocol, in one way on every store
//! (`secret`): rank 0 publishes a hello with a fresh nonce and its proof; each rank checks it, then
//! knocks with a hello of its own whose proof covers rank 0's nonce; rank 0 admits a rank only on a
//! proof that verifies, and its verdict carries, for each rank, a tag over both hellos, so a rank
//! believes only a rank 0 that knows the secret and a recorded exchange never verifies again. A store
//! is not trusted: every value read from one is bounded and parsed strictly (`hello`), every wait has
//! the job's deadline, waits run in slices that see Ctrl-C, and a timeout names the key it waited
//! for. A stranger's knock is noted and ignored; whatever else a stranger writes into the store can at
//! worst stop a rank, never admit one nor, with a secret, hand it a segment rank 0 did not make.
//! (Rank 0's own store also keeps strangers out of itself: `host`.)
//!
//! The protocol knows nothing of shared memory: rank 0's verdict carries an opaque body (the shm
//! world's segment token), and a caller may run several meetings in one store under other prefixes
//! (the ranks of one host, for a world over several hosts).

mod hello;
mod host;
mod meet;
mod memory;
pub(crate) mod secret;
mod tcp;

use std::time::Duration;

pub use host::StoreHost;
pub use meet::Meeting;
pub use memory::MemoryStore;
pub use secret::JobSecret;
pub use tcp::TcpStore;

#[cfg(any(test, feature = "fuzzing"))]
pub(crate) mod parsers {
    pub(crate) use super::hello::{Hello, Verdict, MAX_HOST};
    #[cfg(test)]
    pub(crate) use super::tcp::Request;
    pub(crate) use super::tcp::{frame, frame_head, parse_request, request, MAX_BODY};
}

use crate::error::Result;

/// Longest value a store may hold for the protocol (a hello or a verdict); longer reads are refused.
pub const MAX_VALUE: usize = 32 << 10;

/// A key-value store the ranks of a job share. Keys are UTF-8, values bytes; implementations must be
/// usable from several threads. A call that cannot reach the store fails (it never blocks past the
/// timeout it is given, or, for calls without one, past the store's own).
pub trait KeyValueStore: Send + Sync {
    /// Set `key` to `value` (replacing what was there).
    fn set(&self, key: &str, value: &[u8]) -> Result<()>;
    /// The value of `key`, `None` while no one has set it. Never waits for the key.
    fn get(&self, key: &str) -> Result<Option<Vec<u8>>>;
    /// Wait until every key of `keys` is set, at most `timeout`: whether they all are.
    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<bool>;
    /// Add `delta` to the integer at `key` (0 when unset) and return the sum.
    fn add(&self, key: &str, delta: i64) -> Result<i64>;
    /// Remove `key` (nothing when it is not set).
    fn delete(&self, key: &str) -> Result<()>;
    /// What the store is, for error messages ("the TCP store of rank 0 at 127.0.0.1:29500").
    fn name(&self) -> String;
}
