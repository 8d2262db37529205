//! Collectives that only move data: every member copies what it needs straight from the peer that has
//! it (one read and one write per byte delivered, no staging), all members at once. Large copies
//! stream past the caches (`stream`).

use super::claims::Claims;
use super::stream::{copy, worth};
use super::Peer;

/// broadcast: every member copies the tiles it claims from the root's buffer into every other
/// member's, so the root's core works too and a member a busy core holds back does less.
///
/// # Safety
/// Every buffer holds `bytes` bytes and stays alive until the done-sync; every member claims from the
/// same `claims`.
pub(crate) unsafe fn broadcast(peers: &[Peer], index: usize, root: usize, bytes: usize, claims: &Claims<'_>) {
    let (n, unit, stream) = (peers.len(), claims.unit(bytes, peers.len(), false), worth(bytes));
    // The work never fails: the Result is the claims' general signature.
    let _ = claims.share(index, bytes.div_ceil(unit), |t| {
        let (off, len) = Claims::tile(t, unit, bytes);
        for j in (0..n).map(|d| (index + d) % n).filter(|&j| j != root) {
            // SAFETY: tile t lies within `bytes`; only its claimer writes it, into buffers other than
            // the root's (which it reads).
            unsafe { copy(peers[root].send.add(off), peers[j].recv.add(off), len, stream) };
        }
        Ok(())
    });
}

/// all_gather: copy every member's `bytes`-long send buffer into slot j of this member's recv.
///
/// # Safety
/// Each send holds `bytes` bytes, this member's recv `peers.len() * bytes`, and the send buffers stay
/// alive until the done-sync. A send may lie inside the receiver's own recv slot (in-place all_gather).
pub(crate) unsafe fn all_gather(peers: &[Peer], index: usize, bytes: usize) {
    for (j, p) in peers.iter().enumerate() {
        // SAFETY: slot j of recv is `bytes` long; `copy` tolerates the in-place overlap.
        unsafe { copy(p.send, peers[index].recv.add(j * bytes), bytes, worth(bytes)) };
    }
}

/// gather: copy this member's send into slot `index` of the root's recv.
///
/// # Safety
/// As for [`all_gather`], with only the root's recv written.
pub(crate) unsafe fn gather(peers: &[Peer], index: usize, root: usize, bytes: usize) {
    // SAFETY: slot `index` of the root's recv is `bytes` long and written by this member alone.
    unsafe { copy(peers[index].send, peers[root].recv.add(index * bytes), bytes, worth(bytes)) };
}

/// scatter: copy slot `index` of the root's send into this member's recv.
///
/// # Safety
/// The root's send holds `peers.len() * bytes` bytes and stays alive until the done-sync.
pub(crate) unsafe fn scatter(peers: &[Peer], index: usize, root: usize, bytes: usize) {
    // SAFETY: slot `index` is within the root's send; this member's recv is `bytes` long.
    unsafe { copy(peers[root].send.add(index * bytes), peers[index].recv, bytes, worth(bytes)) };
}
