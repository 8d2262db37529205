//! Small all-reduces in one sync: each member copies its input into its one-shot buffer before it
//! arrives; once all have, each member reduces every member's copy, in rank order, into its own buffer.
//! Peers read only the copies, so nobody waits for anyone to finish.

use crate::dtype::DType;
use crate::reduce::{reduce_raw, ReduceOp, Scale};

/// Copy this member's `bytes` of input into its one-shot buffer.
///
/// # Safety
/// `send` holds `bytes`; `slot` holds at least as many and no peer reads it now.
pub(crate) unsafe fn publish(send: *const u8, slot: *mut u8, bytes: usize) {
    if bytes > 0 {
        // SAFETY: the caller's contract; the buffers are distinct.
        unsafe { std::ptr::copy_nonoverlapping(send, slot, bytes) };
    }
}

/// Reduce every member's one-shot copy (`copies`, in rank order) into this member's `recv`.
///
/// # Safety
/// Every copy holds `count` elements of `dtype` and stays unchanged during the call; `recv` holds
/// `count` and only this member writes it.
pub(crate) unsafe fn reduce(
    dtype: DType,
    op: ReduceOp,
    scale: Scale,
    copies: &[*const u8],
    recv: *mut u8,
    count: usize,
) {
    // SAFETY: forwarded from the caller.
    unsafe { reduce_raw(dtype, op, scale, copies, &[recv], count) };
}
