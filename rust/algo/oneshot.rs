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

/// Reduce every member's one-shot copy (`copy(j)` for member j of `n`, in rank order) into this
/// member's `recv`. The copies' addresses stay on the stack for up to [`ON_STACK`] members: a small
/// call allocates nothing.
///
/// # Safety
/// Every copy holds `count` elements of `dtype` and stays unchanged during the call; `recv` holds
/// `count` and only this member writes it.
pub(crate) unsafe fn reduce(
    dtype: DType,
    op: ReduceOp,
    scale: Scale,
    n: usize,
    copy: impl Fn(usize) -> *const u8,
    recv: *mut u8,
    count: usize,
) {
    let mut stack = [std::ptr::null(); ON_STACK];
    let heap: Vec<*const u8>;
    let copies: &[*const u8] = if n <= ON_STACK {
        stack.iter_mut().zip(0..n).for_each(|(c, j)| *c = copy(j));
        &stack[..n]
    } else {
        heap = (0..n).map(copy).collect();
        &heap
    };
    // SAFETY: forwarded from the caller.
    unsafe { reduce_raw(dtype, op, scale, copies, &[recv], count) };
}

/// Members whose copies' addresses [`reduce`] keeps on the stack.
const ON_STACK: usize = 16;
