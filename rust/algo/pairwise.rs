//! Data movement of the pairwise collectives, for a [`Plan`]: receiver i takes piece (j, i) of every
//! sender j, "member j's send `[src, src + len)` into my recv at `dst`" (or reduces the pieces, for
//! reduce_scatter_v). [`direct`] copies each piece straight from the sender's buffer (each byte copied
//! once); [`Staged`] pipelines the pieces through the senders' staging buffers.

use super::layout::Plan;
use super::Peer;
use crate::dtype::DType;
use crate::error::Result;
use crate::reduce::{reduce_raw, ReduceOp, Scale};

impl Plan {
    /// Receiver `i`'s pieces that hold bytes: `(sender, src, dst, len)`.
    pub(crate) fn pieces(&self, i: usize) -> impl Iterator<Item = (usize, usize, usize, usize)> + '_ {
        let n = self.n;
        (0..n)
            .map(move |j| (j, self.src[j * n + i], self.dst[j * n + i], self.len[j * n + i]))
            .filter(|p| p.3 > 0)
    }
}

/// Member `i`'s share of `plan` on every member's buffers.
///
/// # Safety
/// Every member validated its buffers for the same plan (`plan.spans`), and keeps them alive and
/// untouched by itself until the done-sync. A send may lie inside the receiver's own recv at its
/// piece (in-place all_gather_v).
pub(crate) unsafe fn direct(plan: &Plan, dtype: DType, op: ReduceOp, peers: &[Peer], i: usize) {
    if plan.reduce {
        let (dst, len) = (plan.dst[i], plan.len[i]);
        if len > 0 {
            // SAFETY (all adds): every piece lies within its buffer's span (the plan's construction).
            let inputs: Vec<*const u8> =
                (0..plan.n).map(|j| unsafe { peers[j].send.add(plan.src[j * plan.n + i]) }).collect();
            // SAFETY: forwarded; only this member writes its recv.
            unsafe {
                reduce_raw(dtype, op, Scale::NONE, &inputs, &[peers[i].recv.add(dst)], len / dtype.size())
            };
        }
        return;
    }
    for (j, src, dst, len) in plan.pieces(i) {
        // SAFETY: as above; `copy` tolerates the in-place overlap of a member's own piece.
        unsafe { std::ptr::copy(peers[j].send.add(src), peers[i].recv.add(dst), len) };
    }
}

/// A pairwise collective on private buffers, as seen by member `me`. Round g uses pipeline buffer
/// `g % 2` of every member and the steps of `algo::staged` (3g+1 staged, 3g+3 done with the round):
/// each sender stages the round's window of its piece for each other receiver into that receiver's
/// region of its buffer (n − 1 regions: its own piece is never staged; one region of the whole buffer
/// when the pieces are `shared`), then each receiver copies (or reduces)
/// its window of every sender's piece out.
pub(crate) struct Staged<'a> {
    pub plan: &'a Plan,
    pub dtype: DType,
    pub op: ReduceOp,
    pub me: usize,
    pub send: *const u8,
    pub recv: *mut u8,
    /// Every member's two pipeline buffers, in this process's address space.
    pub bufs: &'a [[*mut u8; 2]],
    /// Bytes per pipeline buffer.
    pub chunk: usize,
}

impl Staged<'_> {
    /// Bytes of one piece's window per round (64-byte aligned, so whole elements).
    fn region(&self) -> usize {
        if self.plan.shared {
            self.chunk
        } else {
            (self.chunk / (self.plan.n - 1).max(1)) & !63
        }
    }

    /// Run every round (see `algo::staged::Staged::run` for `round`, `publish` and `sync`).
    ///
    /// # Safety
    /// `send`/`recv` are this member's buffers validated for the plan (null where it has none), every
    /// member runs the same plan, and `bufs` point at the members' staging.
    pub(crate) unsafe fn run(
        &self,
        round: &mut u64,
        publish: impl Fn(u64),
        sync: impl Fn(u64) -> Result<()>,
    ) -> Result<()> {
        let (plan, me, n) = (self.plan, self.me, self.plan.n);
        let region = self.region();
        // The same count on every member: the plan is.
        for r in 0..plan.longest().div_ceil(region) {
            let g = *round;
            *round += 1;
            if g >= 2 {
                sync(3 * g - 3)?;
            }
            let (b, lo) = ((g % 2) as usize, r * region);
            let window = |at: usize| plan.len[at].saturating_sub(lo).min(region);
            // Sender j's region for receiver i (≠ j): the receivers other than j, in order.
            let slot = |j: usize, i: usize| if plan.shared { 0 } else { (i - usize::from(i > j)) * region };
            // SAFETY: n − 1 regions of `region` bytes fit in a pipeline buffer.
            let stage = |j: usize, i: usize| unsafe { self.bufs[j][b].add(slot(j, i)) };
            // SAFETY (`copy` and the adds below): every window lies within its piece, every piece within
            // its buffer's span, and holds at most `region` bytes; the steps order staging against the
            // peers' reads. Own pieces are taken from `send`, never staged.
            let copy = |from: *const u8, to: *mut u8, len: usize| unsafe { std::ptr::copy(from, to, len) };
            let mut staged_shared = false;
            for i in (0..n).filter(|&i| i != me) {
                let at = me * n + i;
                let w = window(at);
                if w > 0 && !(plan.shared && staged_shared) {
                    copy(unsafe { self.send.add(plan.src[at] + lo) }, stage(me, i), w);
                    staged_shared = true;
                }
            }
            publish(3 * g + 1);
            sync(3 * g + 1)?;
            let from = |j: usize| {
                let at = j * n + me;
                if j == me {
                    unsafe { self.send.add(plan.src[at] + lo) }
                } else {
                    stage(j, me).cast_const()
                }
            };
            if plan.reduce {
                let w = window(me);
                if w > 0 {
                    let inputs: Vec<*const u8> = (0..n).map(from).collect();
                    let out = unsafe { self.recv.add(plan.dst[me] + lo) };
                    // SAFETY: every input holds the round's window, staged before step 3g+1; this member
                    // alone writes its recv.
                    unsafe {
                        reduce_raw(self.dtype, self.op, Scale::NONE, &inputs, &[out], w / self.dtype.size())
                    };
                }
            } else {
                for j in 0..n {
                    let at = j * n + me;
                    let w = window(at);
                    if w > 0 {
                        copy(from(j), unsafe { self.recv.add(plan.dst[at] + lo) }, w);
                    }
                }
            }
            publish(3 * g + 3);
        }
        Ok(())
    }
}
