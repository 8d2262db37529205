//! Collectives that only move data: every member copies what it needs straight from the peer that has
//! it (one read and one write per byte delivered, no staging), all members at once.

use super::Peer;

/// broadcast: a non-root member copies the root's buffer into its own.
///
/// # Safety
/// Both buffers hold `bytes` bytes and the root's stays alive until the done-sync.
pub(crate) unsafe fn broadcast(peers: &[Peer], index: usize, root: usize, bytes: usize) {
    if index != root {
        // SAFETY: distinct buffers of `bytes` bytes each (the caller's contract).
        unsafe { std::ptr::copy_nonoverlapping(peers[root].send, peers[index].recv, bytes) };
    }
}

/// all_gather: copy every member's `bytes`-long send buffer into slot j of this member's recv.
///
/// # Safety
/// Each send holds `bytes` bytes, this member's recv `peers.len() * bytes`, and the send buffers stay
/// alive until the done-sync. A send may lie inside the receiver's own recv slot (in-place all_gather).
pub(crate) unsafe fn all_gather(peers: &[Peer], index: usize, bytes: usize) {
    for (j, p) in peers.iter().enumerate() {
        // SAFETY: slot j of recv is `bytes` long; `copy` tolerates the in-place overlap.
        unsafe { std::ptr::copy(p.send, peers[index].recv.add(j * bytes), bytes) };
    }
}

/// gather: copy this member's send into slot `index` of the root's recv.
///
/// # Safety
/// As for [`all_gather`], with only the root's recv written.
pub(crate) unsafe fn gather(peers: &[Peer], index: usize, root: usize, bytes: usize) {
    // SAFETY: slot `index` of the root's recv is `bytes` long and written by this member alone.
    unsafe { std::ptr::copy(peers[index].send, peers[root].recv.add(index * bytes), bytes) };
}

/// scatter: copy slot `index` of the root's send into this member's recv.
///
/// # Safety
/// The root's send holds `peers.len() * bytes` bytes and stays alive until the done-sync.
pub(crate) unsafe fn scatter(peers: &[Peer], index: usize, root: usize, bytes: usize) {
    // SAFETY: slot `index` is within the root's send; this member's recv is `bytes` long.
    unsafe { std::ptr::copy(peers[root].send.add(index * bytes), peers[index].recv, bytes) };
}
