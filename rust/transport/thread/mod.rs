//! The in-process world: every rank is a thread of one process, and buffers are exchanged by address.
//!
//! The engine (`crate::engine`) runs the protocol; this world's store (`store`) keeps each
//! communicator's control blocks in ordinary memory, publishes buffer addresses, and waits on private
//! futexes. All-reduces of at most [`INLINE`](crate::config::INLINE) bytes go one-shot; every other
//! collective moves data straight between the callers' buffers (owner-computes). Point-to-point
//! messages go through the world's `mailbox`.

mod mailbox;
pub(crate) mod store;

use std::sync::Arc;
use std::time::Duration;

use crate::config::{DEFAULT_TIMEOUT, MAX_TIMEOUT};
use crate::engine::{backend_type, Engine};
use store::{Shared, ThreadStore};

/// One rank's handle on the in-process world (or one of its subgroups): collectives block until every
/// member arrives and exchange data through the callers' own buffers. A [`Backend`](crate::Backend).
pub struct ThreadBackend(Engine<ThreadStore>);

impl ThreadBackend {
    /// A world of `n` ranks with the default timeout; hand one backend to each thread.
    pub fn create_world(n: usize) -> Vec<ThreadBackend> {
        Self::create_world_with_timeout(n, DEFAULT_TIMEOUT)
    }

    /// A world of `n` ranks whose waits fail after `timeout` (at most [`MAX_TIMEOUT`]).
    pub fn create_world_with_timeout(n: usize, timeout: Duration) -> Vec<ThreadBackend> {
        let shared = Arc::new(Shared::new(n, timeout.min(MAX_TIMEOUT)));
        let world = crate::flight::next_world();
        (0..n).map(|r| ThreadBackend(Engine::new(ThreadStore::world(&shared, r), world))).collect()
    }

    /// A world of one rank: every collective is a local copy.
    pub fn single() -> ThreadBackend {
        Self::create_world(1).pop().expect("a world of one rank")
    }
}

backend_type!(ThreadBackend, ThreadStore);
