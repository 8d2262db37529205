//! Validation of one collective call, shared by every backend: checks the caller's buffers and
//! arguments and turns them into a [`Call`] (signature plus the addresses to publish). Bad input fails
//! here, before any peer is involved or any byte is written.

use std::time::Duration;

use crate::algo::Peer;
use crate::dtype::{expect_dtype, Buf, BufMut, DType};
use crate::error::{Error, Result};
use crate::reduce::{ReduceOp, Scale};
use crate::signature::{CollKind, Signature};

/// A validated collective: what this rank publishes and how much data each member contributes.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Call {
    /// The fingerprint every member must agree on (its `seq` is filled in by the transport).
    pub sig: Signature,
    /// This rank's buffers.
    pub mine: Peer,
    /// Group index of the root, for rooted collectives.
    pub root: Option<usize>,
    /// Elements per member part (see [`Signature::count`]).
    pub count: usize,
    /// Element type (`F32`, unused, for barrier).
    pub dtype: DType,
    /// How long this call's waits last, when not the world's timeout (`monitored_barrier`).
    pub timeout: Option<Duration>,
}

/// Check a rank list for a world of `world_size`: not empty, in range, no duplicates. Returns it sorted.
pub(crate) fn validate_ranks(ranks: &[usize], world_size: usize) -> Result<Vec<usize>> {
    if ranks.is_empty() {
        return Err(Error::invalid("a group needs at least one rank"));
    }
    if let Some(bad) = ranks.iter().find(|&&r| r >= world_size) {
        return Err(Error::invalid(format!("rank {bad} is out of range for a world of {world_size} ranks")));
    }
    let mut sorted = ranks.to_vec();
    sorted.sort_unstable();
    if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
        return Err(Error::invalid(format!("rank {} appears twice in the group {ranks:?}", w[0])));
    }
    Ok(sorted)
}

/// Group index of global rank `rank`, or an error naming the group.
pub(crate) fn index_of(members: &[usize], rank: usize, what: &str) -> Result<usize> {
    members
        .iter()
        .position(|&m| m == rank)
        .ok_or_else(|| Error::invalid(format!("{what} rank {rank} is not a member of the group {members:?}")))
}

/// Group index of global rank `rank`, as a group's `group_rank` answers it (in Python).
#[cfg(feature = "python")]
pub(crate) fn group_rank(members: &[usize], rank: usize) -> Result<usize> {
    index_of(members, rank, "global")
}

/// Check the peer of a send or recv: a member of the group, and not the caller (a blocking send to
/// oneself could never complete).
pub(crate) fn peer(members: &[usize], me: usize, peer: usize, what: &str) -> Result<()> {
    index_of(members, peer, what)?;
    if peer == me {
        return Err(Error::invalid(format!("rank {me} cannot {what} itself")));
    }
    Ok(())
}

/// What a send and a receive do to their peer, as [`peer`] errors name it.
pub(crate) const SEND_TO: &str = "send to";
pub(crate) const RECEIVE_FROM: &str = "receive from";

/// A send, as errors name it.
pub(crate) fn send_op(buf: &Buf<'_>, dst: usize, tag: u64) -> String {
    format!("send({} x {} to rank {dst}, tag {tag})", buf.len(), buf.dtype())
}

/// A receive, as errors name it.
pub(crate) fn recv_op(buf: &BufMut<'_>, src: usize, tag: u64) -> String {
    format!("recv({} x {} from rank {src}, tag {tag})", buf.len(), buf.dtype())
}

/// The sender's error when the receiver refused its message.
pub(crate) fn refused(rank: usize, op: &str) -> Error {
    Error::invalid(format!(
        "rank {rank}: {op} was refused by the receiver: dtype or length differ from its recv"
    ))
}

/// The receiver's error for a message of `count` x `dtype` from `src` that its recv cannot take.
pub(crate) fn wrong_message(
    rank: usize,
    op: &str,
    count: u64,
    dtype: &dyn std::fmt::Display,
    src: usize,
) -> Error {
    Error::invalid(format!(
        "rank {rank}: {op} got a message of {count} x {dtype} from rank {src}: dtype or length differ"
    ))
}

/// A send or receive of `rank` whose `peer` never came.
pub(crate) fn p2p_timeout(rank: usize, op: &str, waited: Duration, peer: usize) -> Error {
    Error::timeout(rank, op, waited, vec![peer], vec![rank, peer])
}

/// The collectives of a [`crate::backend::Backend`] impl, written once for every implementor: each call
/// is checked and built here, then handed to `self.$run(Result<Call>)`.
macro_rules! checked_collectives {
    ($run:ident) => {
        fn all_reduce(
            &self,
            mut buf: $crate::dtype::BufMut<'_>,
            op: $crate::reduce::ReduceOp,
        ) -> $crate::error::Result<()> {
            self.$run($crate::call::all_reduce(None, &mut buf, op, $crate::reduce::Scale::NONE))
        }
        fn all_reduce_into(
            &self,
            send: Option<$crate::dtype::Buf<'_>>,
            mut recv: $crate::dtype::BufMut<'_>,
            op: $crate::reduce::ReduceOp,
            scale: $crate::reduce::Scale,
        ) -> $crate::error::Result<()> {
            self.$run($crate::call::all_reduce(send.as_ref(), &mut recv, op, scale))
        }
        fn broadcast(&self, mut buf: $crate::dtype::BufMut<'_>, root: usize) -> $crate::error::Result<()> {
            self.$run($crate::call::broadcast(self.members(), &mut buf, root))
        }
        fn all_gather(
            &self,
            send: $crate::dtype::Buf<'_>,
            mut recv: $crate::dtype::BufMut<'_>,
        ) -> $crate::error::Result<()> {
            self.$run($crate::call::all_gather(self.members().len(), &send, &mut recv))
        }
        fn reduce_scatter(
            &self,
            send: $crate::dtype::Buf<'_>,
            mut recv: $crate::dtype::BufMut<'_>,
            op: $crate::reduce::ReduceOp,
        ) -> $crate::error::Result<()> {
            self.$run($crate::call::reduce_scatter(self.members().len(), &send, &mut recv, op))
        }
        fn gather(
            &self,
            send: $crate::dtype::Buf<'_>,
            mut recv: Option<$crate::dtype::BufMut<'_>>,
            root: usize,
        ) -> $crate::error::Result<()> {
            self.$run($crate::call::gather(self.members(), self.rank(), &send, recv.as_mut(), root))
        }
        fn scatter(
            &self,
            send: Option<$crate::dtype::Buf<'_>>,
            mut recv: $crate::dtype::BufMut<'_>,
            root: usize,
        ) -> $crate::error::Result<()> {
            self.$run($crate::call::scatter(self.members(), self.rank(), send.as_ref(), &mut recv, root))
        }
        fn reduce(
            &self,
            mut buf: $crate::dtype::BufMut<'_>,
            root: usize,
            op: $crate::reduce::ReduceOp,
        ) -> $crate::error::Result<()> {
            let none = $crate::reduce::Scale::NONE;
            self.$run($crate::call::reduce(self.members(), None, &mut buf, root, op, none))
        }
        fn reduce_into(
            &self,
            send: Option<$crate::dtype::Buf<'_>>,
            mut recv: $crate::dtype::BufMut<'_>,
            root: usize,
            op: $crate::reduce::ReduceOp,
            scale: $crate::reduce::Scale,
        ) -> $crate::error::Result<()> {
            self.$run($crate::call::reduce(self.members(), send.as_ref(), &mut recv, root, op, scale))
        }
        fn barrier(&self) -> $crate::error::Result<()> {
            self.$run(Ok($crate::call::barrier()))
        }
        fn monitored_barrier(&self, timeout: std::time::Duration) -> $crate::error::Result<()> {
            self.$run(Ok($crate::call::Call { timeout: Some(timeout), ..$crate::call::barrier() }))
        }
    };
}
pub(crate) use checked_collectives;

fn call(kind: CollKind, dtype: DType, count: usize, send: *const u8, recv: *mut u8) -> Call {
    Call {
        sig: Signature::new(kind, 0, count).dtype(dtype),
        mine: Peer { send, recv },
        root: None,
        count,
        dtype,
        timeout: None,
    }
}

fn with_root(mut c: Call, members: &[usize], root: usize) -> Result<Call> {
    c.root = Some(index_of(members, root, "root")?);
    c.sig = c.sig.root(root);
    Ok(c)
}

fn need_len(what: &str, got: usize, want: usize, why: &str) -> Result<()> {
    if got == want {
        Ok(())
    } else {
        Err(Error::invalid(format!("{what} has {got} elements but needs {want} ({why})")))
    }
}

/// A reduction's call: `op` and `scale` checked for the dtype, `send` (when given: out of place) of
/// the same dtype and length as `recv`, which it is read from instead of `recv`.
fn reduction(
    kind: CollKind,
    send: Option<&Buf<'_>>,
    recv: &mut BufMut<'_>,
    op: ReduceOp,
    scale: Scale,
) -> Result<Call> {
    op.check(recv.dtype())?;
    scale.check(recv.dtype())?;
    let input = match send {
        None => recv.as_mut_ptr().cast_const(),
        Some(send) => {
            expect_dtype("the output buffer", recv.dtype(), send.dtype())?;
            need_len("the output buffer", recv.len(), send.len(), "the input's elements")?;
            send.as_ptr()
        }
    };
    let mut c = call(kind, recv.dtype(), recv.len(), input, recv.as_mut_ptr());
    c.sig = c.sig.op(op).scale(scale);
    Ok(c)
}

pub(crate) fn all_reduce(
    send: Option<&Buf<'_>>,
    recv: &mut BufMut<'_>,
    op: ReduceOp,
    scale: Scale,
) -> Result<Call> {
    reduction(CollKind::AllReduce, send, recv, op, scale)
}

pub(crate) fn broadcast(members: &[usize], buf: &mut BufMut<'_>, root: usize) -> Result<Call> {
    let c = call(CollKind::Broadcast, buf.dtype(), buf.len(), buf.as_mut_ptr(), buf.as_mut_ptr());
    with_root(c, members, root)
}

pub(crate) fn reduce(
    members: &[usize],
    send: Option<&Buf<'_>>,
    recv: &mut BufMut<'_>,
    root: usize,
    op: ReduceOp,
    scale: Scale,
) -> Result<Call> {
    with_root(reduction(CollKind::Reduce, send, recv, op, scale)?, members, root)
}

pub(crate) fn all_gather(n: usize, send: &Buf<'_>, recv: &mut BufMut<'_>) -> Result<Call> {
    expect_dtype("the receive buffer", recv.dtype(), send.dtype())?;
    need_len("the receive buffer", recv.len(), n * send.len(), "group size x send elements")?;
    Ok(call(CollKind::AllGather, send.dtype(), send.len(), send.as_ptr(), recv.as_mut_ptr()))
}

pub(crate) fn reduce_scatter(n: usize, send: &Buf<'_>, recv: &mut BufMut<'_>, op: ReduceOp) -> Result<Call> {
    op.check(send.dtype())?;
    expect_dtype("the receive buffer", recv.dtype(), send.dtype())?;
    if send.len() % n != 0 {
        return Err(Error::invalid(format!(
            "reduce_scatter: the send buffer has {} elements, which the group size {n} does not divide",
            send.len()
        )));
    }
    need_len("the receive buffer", recv.len(), send.len() / n, "send elements / group size")?;
    let mut c = call(CollKind::ReduceScatter, send.dtype(), recv.len(), send.as_ptr(), recv.as_mut_ptr());
    c.sig = c.sig.op(op);
    Ok(c)
}

pub(crate) fn gather(
    members: &[usize],
    me: usize,
    send: &Buf<'_>,
    recv: Option<&mut BufMut<'_>>,
    root: usize,
) -> Result<Call> {
    let n = members.len();
    let mut out = std::ptr::null_mut();
    if me == root {
        let recv = recv.ok_or_else(|| Error::invalid("gather: the root must pass a receive buffer"))?;
        expect_dtype("the receive buffer", recv.dtype(), send.dtype())?;
        need_len("the receive buffer", recv.len(), n * send.len(), "group size x send elements")?;
        out = recv.as_mut_ptr();
    }
    let c = call(CollKind::Gather, send.dtype(), send.len(), send.as_ptr(), out);
    with_root(c, members, root)
}

pub(crate) fn scatter(
    members: &[usize],
    me: usize,
    send: Option<&Buf<'_>>,
    recv: &mut BufMut<'_>,
    root: usize,
) -> Result<Call> {
    let n = members.len();
    let mut input = std::ptr::null();
    if me == root {
        let send = send.ok_or_else(|| Error::invalid("scatter: the root must pass a send buffer"))?;
        expect_dtype("the send buffer", send.dtype(), recv.dtype())?;
        need_len("the send buffer", send.len(), n * recv.len(), "group size x receive elements")?;
        input = send.as_ptr();
    }
    let c = call(CollKind::Scatter, recv.dtype(), recv.len(), input, recv.as_mut_ptr());
    with_root(c, members, root)
}

pub(crate) fn barrier() -> Call {
    let mut c = call(CollKind::Barrier, DType::F32, 0, std::ptr::null(), std::ptr::null_mut());
    c.sig.dtype = None;
    c
}
