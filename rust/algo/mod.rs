//! The collectives' data movement, independent of how ranks meet. Each function is what ONE member
//! does once all members have arrived and published their buffers:
//! * `oneshot`: small all-reduces, through a copy of every member's input;
//! * [`direct`]: every buffer addressable by every member (the in-process world, or arrays inside a
//!   shared segment): owner-computes reductions (`owner`) and straight copies (`copy`);
//! * `staged`: private buffers of processes, pipelined through staging buffers;
//! * `cma`: private buffers of processes, copied straight between them by the kernel (`process_vm`,
//!   the system calls), for calls that took less time that way than staged lately, or too large to
//!   time;
//! * `route`: which of those a call takes (the policy, one owner), with `route_times`, what `staged`
//!   and `cma` took lately for each class of calls, on this member;
//! * `claims`: the tiles of a call, claimed by whichever member is free (cma, and direct broadcast);
//! * `stream`: the local copy of large transfers in `copy` and `cma`, and the staged copies out into
//!   large outputs, streaming past the caches (the pairwise copies do not stream);
//! * `pairwise`: all_to_all and the collectives with per-member sizes, both ways, over the byte ranges
//!   of a `layout::Plan`.
//!
//! Members touch disjoint memory; the engine's second sync ("done") keeps buffers alive until every
//! peer has finished with them.

pub(crate) mod claims;
pub(crate) mod cma;
pub(crate) mod copy;
pub(crate) mod layout;
pub(crate) mod oneshot;
pub(crate) mod owner;
pub(crate) mod pairwise;
pub(crate) mod process_vm;
pub(crate) mod route;
pub(crate) mod route_times;
pub(crate) mod staged;
pub(crate) mod stream;

use crate::call::Call;
pub(crate) use crate::call::Peer;
use crate::reduce::ReduceOp;
use crate::signature::{CollKind, Extent, Signature};

/// Bytes spanned by a member's send and receive buffers for `sig` in a group of `n`, given whether it
/// is the root (0 where the collective has no such buffer on it). The collectives with a layout have
/// theirs from its plan (`layout::Plan::spans`).
pub(crate) fn spans(sig: &Signature, n: usize, is_root: bool) -> (usize, usize) {
    part_spans(sig.kind, sig.count as usize * sig.dtype.map_or(0, |d| d.size()), n, is_root)
}

/// As [`spans`], for a collective of `kind` whose part is `part` bytes.
pub(crate) fn part_spans(kind: CollKind, part: usize, n: usize, is_root: bool) -> (usize, usize) {
    if kind.has_layout() {
        return (0, 0);
    }
    let bytes = |e: Extent| match e {
        Extent::Nothing => 0,
        Extent::Part => part,
        Extent::Group => n * part,
        Extent::RootGroup if is_root => n * part,
        Extent::RootGroup => 0,
    };
    let (send, recv) = kind.buffers();
    (bytes(send), bytes(recv))
}

/// Member `index`'s share of `call` (reducing with `op`) on every member's buffers; `plan` for the
/// pairwise collectives.
///
/// # Safety
/// Every member validated its buffers for the same call (and plan), and keeps them alive and untouched
/// by itself until the done-sync.
pub(crate) unsafe fn direct(
    call: &Call,
    op: ReduceOp,
    peers: &[Peer],
    index: usize,
    plan: Option<&layout::Plan>,
    claims: &claims::Claims<'_>,
) {
    if let Some(plan) = plan {
        // SAFETY: forwarded from the caller.
        return unsafe { pairwise::direct(plan, call.dtype, op, peers, index) };
    }
    let (dtype, count, root, scale) = (call.dtype, call.count, call.root, call.sig.scale);
    let (bytes, r) = (count * dtype.size(), root.unwrap_or(0));
    // SAFETY: forwarded from the caller.
    unsafe {
        match call.sig.kind {
            CollKind::AllReduce => owner::reduce_owned(dtype, op, scale, peers, index, count, None),
            CollKind::Reduce => owner::reduce_owned(dtype, op, scale, peers, index, count, root),
            CollKind::ReduceScatter => owner::reduce_scatter(dtype, op, scale, peers, index, count),
            CollKind::Broadcast => copy::broadcast(peers, index, r, bytes, claims),
            CollKind::AllGather => copy::all_gather(peers, index, bytes),
            CollKind::Gather => copy::gather(peers, index, r, bytes),
            CollKind::Scatter => copy::scatter(peers, index, r, bytes),
            // The pairwise kinds always come with their plan (above).
            CollKind::Barrier
            | CollKind::AllToAll
            | CollKind::AllToAllSingle
            | CollKind::AllGatherV
            | CollKind::GatherV
            | CollKind::ScatterV
            | CollKind::ReduceScatterV => {}
        }
    }
}
