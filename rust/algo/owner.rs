//! Owner-computes reductions.
//!
//! The element range is split into one slice per member (64-byte aligned, at least 4 KiB so small messages
//! are not cut into crumbs; members past the end own nothing). The owner of a slice reduces it across all
//! members' inputs in rank order, tile by tile, and stores the result wherever the collective wants it
//! (every member's buffer for all_reduce, the root's for reduce). Each byte is read once and written once
//! per destination: 2·S per rank for all_reduce, the memory-traffic floor, and no staging copy.

use std::ops::Range;

use super::Peer;
use crate::config::{OWNER_ALIGN, OWNER_MIN_SLICE};
use crate::dtype::DType;
use crate::reduce::{reduce_raw, ReduceOp, Scale};

/// The element range member `index` of `n` owns in a message of `count` elements.
pub(crate) fn owned(count: usize, elem: usize, n: usize, index: usize) -> Range<usize> {
    let unit = (OWNER_ALIGN / elem).max(1);
    let per = count.div_ceil(n).max(OWNER_MIN_SLICE / elem).div_ceil(unit) * unit;
    let lo = (index * per).min(count);
    lo..((index + 1) * per).min(count)
}

/// Reduce this member's slice of every peer's `send` and store it into every peer's `recv` (all_reduce),
/// or only into `peers[root].recv` when `root` is given (reduce).
///
/// # Safety
/// Every peer's buffers hold `count` elements of `dtype` and stay alive and untouched by their owners
/// until the caller's done-sync; no other member writes this member's slice.
pub(crate) unsafe fn reduce_owned(
    dtype: DType,
    op: ReduceOp,
    scale: Scale,
    peers: &[Peer],
    index: usize,
    count: usize,
    root: Option<usize>,
) {
    let r = owned(count, dtype.size(), peers.len(), index);
    if r.is_empty() {
        return;
    }
    let off = r.start * dtype.size();
    // SAFETY (all adds): `r` lies within `count` elements of every buffer.
    let inputs: Vec<*const u8> = peers.iter().map(|p| unsafe { p.send.add(off) }).collect();
    let outputs: Vec<*mut u8> = match root {
        Some(root) => vec![unsafe { peers[root].recv.add(off) }],
        None => peers.iter().map(|p| unsafe { p.recv.add(off) }).collect(),
    };
    // SAFETY: forwarded from the caller; this member alone touches slice `r`.
    unsafe { reduce_raw(dtype, op, scale, &inputs, &outputs, r.len()) };
}

/// reduce_scatter: member `index` reduces chunk `index` (of `count` elements) of every peer's `send` into
/// its own `recv`.
///
/// # Safety
/// Every `send` holds `peers.len() * count` elements of `dtype`, this member's `recv` holds `count`, and
/// the peers' inputs stay alive until the caller's done-sync.
pub(crate) unsafe fn reduce_scatter(
    dtype: DType,
    op: ReduceOp,
    scale: Scale,
    peers: &[Peer],
    index: usize,
    count: usize,
) {
    let off = index * count * dtype.size();
    // SAFETY: chunk `index` lies within every send buffer.
    let inputs: Vec<*const u8> = peers.iter().map(|p| unsafe { p.send.add(off) }).collect();
    // SAFETY: forwarded from the caller.
    unsafe { reduce_raw(dtype, op, scale, &inputs, &[peers[index].recv], count) };
}

#[cfg(test)]
mod tests {
    use super::owned;

    #[test]
    fn slices_cover_the_range_once_and_stay_aligned() {
        for &(count, elem, n) in &[(0, 4, 3), (1, 4, 2), (1023, 4, 4), (3 * 4096 + 3, 4, 3), (1 << 20, 2, 8)]
        {
            let mut next = 0;
            for i in 0..n {
                let r = owned(count, elem, n, i);
                assert_eq!(r.start, next.min(count));
                assert!((r.start * elem).is_multiple_of(64) || r.is_empty());
                next = r.end.max(next);
            }
            assert_eq!(next, count);
        }
    }
}
