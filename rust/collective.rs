//! The description of one collective call, as data: which collective ([`CollKind`]), this rank's
//! buffers and its arguments. Every way into a collective builds one (the typed methods of
//! [`crate::Backend`] and [`crate::ProcessGroup`], the Python bindings, the call check of the MPI
//! backend) and hands it to the one entry point, [`crate::Backend::collective`]; the checks of
//! `call::check` turn it into what the engine runs.
//!
//! A field a collective does not take is ignored (`op` of a broadcast, `root` of an all_gather): the
//! constructors below set only what each one takes.

use std::time::Duration;

use crate::dtype::{Buf, BufMut};
use crate::reduce::{ReduceOp, Scale};
use crate::signature::CollKind;

/// One rank's collective call. Out of place when both `send` and `recv` are given; reductions and
/// broadcast with `send` = `None` work in place on `recv`. A rooted collective's buffer that only the
/// root has (gather's `recv`, scatter's `send`) is `None` on the other members.
pub struct Collective<'a> {
    /// Which collective.
    pub kind: CollKind,
    /// This rank's input, only read.
    pub send: Option<Buf<'a>>,
    /// This rank's output.
    pub recv: Option<BufMut<'a>>,
    /// The reduction operator (reducing collectives).
    pub op: ReduceOp,
    /// Horovod's scaling factors (all_reduce, reduce).
    pub scale: Scale,
    /// Global rank of the root (rooted collectives).
    pub root: usize,
    /// Elements per member (`_v` collectives), or the elements sent to each member
    /// (all_to_all_single).
    pub counts: &'a [usize],
    /// The elements received from each member (all_to_all_single).
    pub recv_counts: &'a [usize],
    /// How long the call waits at most, when not the communicator's timeout (a monitored barrier).
    pub timeout: Option<Duration>,
}

impl<'a> Collective<'a> {
    /// A call of `kind` with no buffer or argument set.
    pub const fn of(kind: CollKind) -> Self {
        Collective {
            kind,
            send: None,
            recv: None,
            op: ReduceOp::Sum,
            scale: Scale::NONE,
            root: 0,
            counts: &[],
            recv_counts: &[],
            timeout: None,
        }
    }
    /// With `send` as input.
    pub fn send(self, send: Buf<'a>) -> Self {
        Collective { send: Some(send), ..self }
    }
    /// With `recv` as output.
    pub fn recv(self, recv: BufMut<'a>) -> Self {
        Collective { recv: Some(recv), ..self }
    }
    /// With the root's buffer: `send` or `recv` when given (`None` off the root).
    pub fn io(self, send: Option<Buf<'a>>, recv: Option<BufMut<'a>>) -> Self {
        Collective { send, recv, ..self }
    }
    /// With a reduction operator.
    pub fn op(self, op: ReduceOp) -> Self {
        Collective { op, ..self }
    }
    /// With scaling factors.
    pub fn scale(self, scale: Scale) -> Self {
        Collective { scale, ..self }
    }
    /// With the root's global rank.
    pub fn root(self, root: usize) -> Self {
        Collective { root, ..self }
    }
    /// With per-member counts.
    pub fn counts(self, counts: &'a [usize]) -> Self {
        Collective { counts, ..self }
    }
    /// With per-member split sizes: elements sent to, and received from, each member.
    pub fn splits(self, send: &'a [usize], recv: &'a [usize]) -> Self {
        Collective { counts: send, recv_counts: recv, ..self }
    }
    /// With its own timeout.
    pub fn timeout(self, timeout: Duration) -> Self {
        Collective { timeout: Some(timeout), ..self }
    }
}
