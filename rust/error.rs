//! The one error type of the core. Every fallible call returns [`Result`]; the Python bindings map each
//! variant to one exception class (see `bindings/exceptions.rs`).

use std::time::Duration;

mod exit_status;
pub use exit_status::{ExitStatus, Unknown};

/// What went wrong in a collective, a group operation or an argument.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// Bad input from the caller: a dtype, length, rank or option the operation cannot take.
    #[error("{0}")]
    InvalidArgument(String),

    /// An element type the operation does not support (e.g. AVERAGE on integers).
    #[error("{0}")]
    UnsupportedDtype(String),

    /// Ranks entered the same step of a group with different calls. Nothing was written.
    #[error("collective mismatch in group {group:?}: {details}")]
    Mismatch {
        /// Global ranks of the group.
        group: Vec<usize>,
        /// Which rank called what, e.g. "rank 0 called all_reduce(...), rank 1 called broadcast(...)".
        details: String,
        /// Every member's call, in group order, as it prints (`all_reduce(#3, 4 x float32, op=SUM)`):
        /// text, so that this bottom type knows nothing of the call's types (`signature::Signature`).
        calls: Vec<(usize, String)>,
    },

    /// Some members never arrived before the deadline. The world is aborted. The message carries
    /// torch's words (" Timed out "), which torch's tests and users' scripts match timeouts by.
    #[error(
        "rank {rank}: Timed out after {waited:?} in {op}: rank(s) {missing:?} of group {group:?} never arrived \
         (they are hung, dead, or called a different number of collectives){progress}"
    )]
    Timeout {
        /// The rank that gave up.
        rank: usize,
        /// The operation, with its sequence number.
        op: String,
        /// How long it waited.
        waited: Duration,
        /// Global ranks that did not arrive.
        missing: Vec<usize>,
        /// Global ranks of the group.
        group: Vec<usize>,
        /// Where each member is, when known ("; last completed: rank 0 #3 all_reduce, ..."), else empty.
        progress: String,
    },

    /// A peer left the world while this rank was waiting for it, by some other way than its process
    /// ending (see [`Error::PeerExited`]): it closed its rendezvous connection, or its thread left.
    #[error("peer rank {peer} died during {op}{}{progress}", detail.as_deref().map(|d| format!(" ({d})")).unwrap_or_default())]
    PeerDied {
        /// Global rank of the dead peer.
        peer: usize,
        /// The operation this rank was in.
        op: String,
        /// How it left, when known.
        detail: Option<String>,
        /// Where each member is ("; where each rank is: rank 0 completed #2 all_reduce, ..."), when the
        /// engine added it, else empty.
        progress: String,
    },

    /// A peer's process ended while this rank was waiting for it; how it ended, when this rank can
    /// tell. (The same message start as [`Error::PeerDied`]: the launcher's error files find the rank
    /// it blames by it.)
    #[error("peer rank {peer} died during {op} (pid {pid} {status}){progress}")]
    PeerExited {
        /// Global rank of the dead peer.
        peer: usize,
        /// Its process id.
        pid: u32,
        /// The operation this rank was in.
        op: String,
        /// Its exit code or the signal that killed it, or why that is unknown.
        status: ExitStatus,
        /// Where each member is, when the engine added it (as for [`Error::PeerDied`]), else empty.
        progress: String,
    },

    /// The world was aborted by a rank (an error on that rank, a timeout, a mismatch, or an explicit abort).
    #[error("the world was aborted by rank {by}: {reason}{progress}")]
    Aborted {
        /// The rank that aborted the world.
        by: usize,
        /// Why it did.
        reason: String,
        /// Where each member is, when the engine added it (as for [`Error::PeerDied`]), else empty.
        progress: String,
    },

    /// The wait was interrupted by a signal (Ctrl-C); the world is aborted.
    #[error("interrupted while waiting in {op}")]
    Interrupted {
        /// The operation this rank was in.
        op: String,
    },

    /// Memory for a buffer could not be allocated.
    #[error("{0}")]
    OutOfMemory(String),

    /// The group was used wrongly: e.g. a second thread of this rank called while a collective ran.
    /// Nothing was sent and the world is not aborted.
    #[error("{0}")]
    Usage(String),

    /// A bug: a queued job panicked. Its `Work` fails with this and the world is aborted.
    #[error("internal error: {0}")]
    Internal(String),

    /// An operating-system call failed (shared memory, futex, pidfd).
    #[error("{context}: {source}")]
    Os {
        /// What we were doing.
        context: String,
        /// The OS error.
        #[source]
        source: std::sync::Arc<std::io::Error>,
    },
}

impl Error {
    /// An [`Error::InvalidArgument`] from anything printable.
    pub fn invalid(msg: impl Into<String>) -> Self {
        Error::InvalidArgument(msg.into())
    }

    /// An [`Error::Timeout`] with no progress report yet (the transport adds it where it knows it).
    pub fn timeout(
        rank: usize,
        op: impl Into<String>,
        waited: Duration,
        missing: Vec<usize>,
        group: Vec<usize>,
    ) -> Self {
        Error::Timeout { rank, op: op.into(), waited, missing, group, progress: String::new() }
    }

    /// An [`Error::Aborted`] with no progress report yet.
    pub fn aborted(by: usize, reason: impl Into<String>) -> Self {
        Error::Aborted { by, reason: reason.into(), progress: String::new() }
    }

    /// The progress report of the errors that carry one (timeouts, peer failures): where each member
    /// of the group was, which the engine adds where it knows it. A mismatch needs none: it names every
    /// member's call, all at the same sequence number, so each completed the one before.
    pub fn progress_mut(&mut self) -> Option<&mut String> {
        match self {
            Error::Timeout { progress, .. }
            | Error::PeerDied { progress, .. }
            | Error::PeerExited { progress, .. }
            | Error::Aborted { progress, .. } => Some(progress),
            _ => None,
        }
    }

    /// An [`Error::Os`] with what we were doing.
    pub fn os(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Os { context: context.into(), source: std::sync::Arc::new(source) }
    }
}

/// `Result` with the core [`Error`].
pub type Result<T> = std::result::Result<T, Error>;
