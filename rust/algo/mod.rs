//! The collectives' data movement, written against buffers every rank can see (the in-process world, or
//! arrays inside a shared segment), independent of how ranks meet. Each function is what ONE rank does
//! once all members have arrived and published their buffer addresses; ranks touch disjoint memory, and
//! the caller's second sync ("done") keeps buffers alive until every peer has finished with them.

pub(crate) mod copy;
pub(crate) mod owner;

/// A peer's published buffers, as addresses in this process.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Peer {
    /// Input data (for in-place collectives, the same as `recv`).
    pub send: *const u8,
    /// Output data.
    pub recv: *mut u8,
}
