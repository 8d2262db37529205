//! Validation of one collective call, shared by every backend: [`check`] checks a call's description
//! ([`Collective`]: the caller's buffers and arguments) and turns it into a [`Call`] (signature plus the
//! addresses to publish). Bad input fails here, before any peer is involved or any byte is written, and
//! aborts the world; only a reduction its dtype does not take is refused without an abort, so that
//! members asking it alike all go on ([`supported`]).

use std::time::Duration;

use crate::collective::Collective;
use crate::config::MAX_TIMEOUT;
use crate::dtype::{expect_dtype, Buf, BufMut, DType};
use crate::error::{Error, Result};
use crate::reduce::{ReduceOp, Scale};
use crate::signature::{CollKind, Signature};

/// A member's buffers, as addresses in this process.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Peer {
    /// Input data (for in-place collectives, the same as `recv`).
    pub send: *const u8,
    /// Output data.
    pub recv: *mut u8,
}

/// A validated collective: what this rank publishes and how much data each member contributes.
#[derive(Clone, Debug)]
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
    /// How long this call's waits last, when not the communicator's timeout (`monitored_barrier`).
    pub timeout: Option<Duration>,
    /// The collectives with per-member sizes: this member's layout (`algo::layout`).
    pub layout: Option<Layout>,
}

/// One member's layout: the words it publishes (counts or split sizes, in elements) and the bytes of
/// its own send and recv buffers they imply.
#[derive(Clone, Debug)]
pub(crate) struct Layout {
    pub words: Vec<u64>,
    pub span: (usize, usize),
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

/// Check a communicator's timeout: positive and at most `MAX_TIMEOUT`, so no deadline computed from it
/// can overflow.
pub(crate) fn checked_timeout(timeout: Duration) -> Result<Duration> {
    if timeout.is_zero() || timeout > MAX_TIMEOUT {
        return Err(Error::invalid(format!(
            "a group's timeout must be positive and at most {} s (about 31 years), got {timeout:?}",
            MAX_TIMEOUT.as_secs()
        )));
    }
    Ok(timeout)
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

/// Fails when `me` is its group's only member, so a receive from any source could never match.
pub(crate) fn any_peer(members: &[usize], me: usize) -> Result<()> {
    if members.iter().all(|&r| r == me) {
        return Err(Error::invalid(format!(
            "rank {me} cannot receive from any source: it is its group's only member"
        )));
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

/// A receive from any source, as errors name it.
pub(crate) fn recv_any_op(buf: &BufMut<'_>, tag: u64) -> String {
    format!("recv({} x {} from any source, tag {tag})", buf.len(), buf.dtype())
}

/// A receive from any of `from` (this `rank`'s group peers) that no message came to.
pub(crate) fn any_source_timeout(rank: usize, op: &str, waited: Duration, from: &[usize]) -> Error {
    let mut group: Vec<usize> = from.iter().copied().chain([rank]).collect();
    group.sort_unstable();
    Error::timeout(rank, op, waited, from.to_vec(), group)
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

/// Check `c`, a call of global rank `me` on a communicator over `members`, into the [`Call`] the engine
/// runs: the one place each collective's description meets its checks (below).
pub(crate) fn check(c: &mut Collective<'_>, members: &[usize], me: usize) -> Result<Call> {
    let (kind, n) = (c.kind, members.len());
    let send = c.send.as_ref();
    let recv = c.recv.as_mut();
    match kind {
        CollKind::AllReduce => all_reduce(send, output(kind, recv)?, c.op, c.scale),
        CollKind::Broadcast => broadcast(members, output(kind, recv)?, c.root),
        CollKind::AllGather => all_gather(n, input(kind, send)?, output(kind, recv)?),
        CollKind::ReduceScatter => reduce_scatter(n, input(kind, send)?, output(kind, recv)?, c.op),
        CollKind::Gather => gather(members, me, input(kind, send)?, recv, c.root),
        CollKind::Scatter => scatter(members, me, send, output(kind, recv)?, c.root),
        CollKind::Reduce => reduce(members, send, output(kind, recv)?, c.root, c.op, c.scale),
        CollKind::Barrier => Ok(Call { timeout: c.timeout, ..barrier() }),
        CollKind::AllToAll => all_to_all(n, input(kind, send)?, output(kind, recv)?),
        CollKind::AllToAllSingle => {
            all_to_all_single(n, input(kind, send)?, output(kind, recv)?, c.counts, c.recv_counts)
        }
        CollKind::AllGatherV => all_gather_v(members, me, input(kind, send)?, output(kind, recv)?, c.counts),
        CollKind::GatherV => gather_v(members, me, input(kind, send)?, recv, c.counts, c.root),
        CollKind::ScatterV => scatter_v(members, me, send, output(kind, recv)?, c.counts, c.root),
        CollKind::ReduceScatterV => {
            reduce_scatter_v(members, me, input(kind, send)?, output(kind, recv)?, c.counts, c.op)
        }
    }
}

/// The input buffer a `kind` call must have.
fn input<'b, 'a>(kind: CollKind, send: Option<&'b Buf<'a>>) -> Result<&'b Buf<'a>> {
    send.ok_or_else(|| Error::invalid(format!("{}: the call has no send buffer", kind.name())))
}

/// The output buffer a `kind` call must have.
fn output<'b, 'a>(kind: CollKind, recv: Option<&'b mut BufMut<'a>>) -> Result<&'b mut BufMut<'a>> {
    recv.ok_or_else(|| Error::invalid(format!("{}: the call has no receive buffer", kind.name())))
}

fn call(kind: CollKind, dtype: DType, count: usize, send: *const u8, recv: *mut u8) -> Call {
    Call {
        sig: Signature::new(kind, 0, count).dtype(dtype),
        mine: Peer { send, recv },
        root: None,
        count,
        dtype,
        timeout: None,
        layout: None,
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

/// Fails when the reduction of `sig` is not defined for its dtype (`ReduceOp::check`, `Scale::check`).
/// Not one of a call's own checks, whose failure aborts the world: the engine applies it before the
/// member arrives and without an abort, so a pair every member asks for alike is refused on every
/// member, at once, and the world goes on; the call check of the Python backends (`bindings::check`)
/// applies it after the call's own checks.
pub(crate) fn supported(sig: &Signature) -> Result<()> {
    match (sig.op, sig.dtype) {
        (Some(op), Some(dtype)) => {
            op.check(dtype)?;
            sig.scale.check(dtype)
        }
        _ => Ok(()),
    }
}

/// A reduction's call: `send` (when given: out of place) of the same dtype and length as `recv`, which
/// it is read from instead of `recv`; `op` and `scale` go into the signature (see [`supported`]).
fn reduction(
    kind: CollKind,
    send: Option<&Buf<'_>>,
    recv: &mut BufMut<'_>,
    op: ReduceOp,
    scale: Scale,
) -> Result<Call> {
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
    expect_dtype("the receive buffer", recv.dtype(), send.dtype())?;
    if !send.len().is_multiple_of(n) {
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

pub(crate) fn all_to_all(n: usize, send: &Buf<'_>, recv: &mut BufMut<'_>) -> Result<Call> {
    expect_dtype("the receive buffer", recv.dtype(), send.dtype())?;
    if !send.len().is_multiple_of(n) {
        return Err(Error::invalid(format!(
            "all_to_all: the send buffer has {} elements, which the group size {n} does not divide",
            send.len()
        )));
    }
    need_len("the receive buffer", recv.len(), send.len(), "as many as the send buffer")?;
    Ok(call(CollKind::AllToAll, send.dtype(), send.len() / n, send.as_ptr(), recv.as_mut_ptr()))
}

/// Elements in `v` (counts or splits), or an error when the sum overflows.
fn total(what: &str, v: &[usize]) -> Result<usize> {
    v.iter()
        .try_fold(0usize, |a, &b| a.checked_add(b))
        .ok_or_else(|| Error::invalid(format!("{what} {v:?} add up to more elements than memory holds")))
}

/// A per-member size vector (`what`) of a group of `n`: one entry per member, adding up to `len` when
/// given. Returns its sum.
fn sizes(kind: CollKind, what: &str, v: &[usize], n: usize) -> Result<usize> {
    if v.len() != n {
        return Err(Error::invalid(format!(
            "{}: {what} has {} entries but the group has {n} members",
            kind.name(),
            v.len()
        )));
    }
    total(what, v)
}

/// Bytes of `count` elements of `dtype` (checked: counts come from the caller).
fn bytes(count: usize, dtype: DType) -> Result<usize> {
    count
        .checked_mul(dtype.size())
        .ok_or_else(|| Error::invalid(format!("{count} x {dtype} is more bytes than memory holds")))
}

/// `c` with the layout `words` and the member's own spans (in elements, converted to bytes).
fn with_layout(mut c: Call, words: impl IntoIterator<Item = usize>, span: (usize, usize)) -> Result<Call> {
    let span = (bytes(span.0, c.dtype)?, bytes(span.1, c.dtype)?);
    c.layout = Some(Layout { words: words.into_iter().map(|w| w as u64).collect(), span });
    Ok(c)
}

pub(crate) fn all_to_all_single(
    n: usize,
    send: &Buf<'_>,
    recv: &mut BufMut<'_>,
    send_splits: &[usize],
    recv_splits: &[usize],
) -> Result<Call> {
    let kind = CollKind::AllToAllSingle;
    expect_dtype("the receive buffer", recv.dtype(), send.dtype())?;
    let sent = sizes(kind, "input_split_sizes", send_splits, n)?;
    let got = sizes(kind, "output_split_sizes", recv_splits, n)?;
    need_len("the send buffer", send.len(), sent, "the sum of input_split_sizes")?;
    need_len("the receive buffer", recv.len(), got, "the sum of output_split_sizes")?;
    let c = call(kind, send.dtype(), 0, send.as_ptr(), recv.as_mut_ptr());
    with_layout(c, send_splits.iter().chain(recv_splits).copied(), (sent, got))
}

/// The counts of a `_v` collective: checked, with this member's group index and their sum.
fn counts_of(kind: CollKind, members: &[usize], me: usize, counts: &[usize]) -> Result<(usize, usize)> {
    let sum = sizes(kind, "counts", counts, members.len())?;
    Ok((index_of(members, me, "the calling")?, sum))
}

pub(crate) fn all_gather_v(
    members: &[usize],
    me: usize,
    send: &Buf<'_>,
    recv: &mut BufMut<'_>,
    counts: &[usize],
) -> Result<Call> {
    let kind = CollKind::AllGatherV;
    let (i, sum) = counts_of(kind, members, me, counts)?;
    expect_dtype("the receive buffer", recv.dtype(), send.dtype())?;
    need_len("the send buffer", send.len(), counts[i], "this member's count")?;
    need_len("the receive buffer", recv.len(), sum, "the sum of the counts")?;
    let c = call(kind, send.dtype(), sum, send.as_ptr(), recv.as_mut_ptr());
    with_layout(c, counts.iter().copied(), (counts[i], sum))
}

pub(crate) fn gather_v(
    members: &[usize],
    me: usize,
    send: &Buf<'_>,
    recv: Option<&mut BufMut<'_>>,
    counts: &[usize],
    root: usize,
) -> Result<Call> {
    let kind = CollKind::GatherV;
    let (i, sum) = counts_of(kind, members, me, counts)?;
    need_len("the send buffer", send.len(), counts[i], "this member's count")?;
    let (mut out, mut got) = (std::ptr::null_mut(), 0);
    if me == root {
        let recv = recv.ok_or_else(|| Error::invalid("gather_v: the root must pass a receive buffer"))?;
        expect_dtype("the receive buffer", recv.dtype(), send.dtype())?;
        need_len("the receive buffer", recv.len(), sum, "the sum of the counts")?;
        (out, got) = (recv.as_mut_ptr(), sum);
    }
    let c = with_root(call(kind, send.dtype(), sum, send.as_ptr(), out), members, root)?;
    with_layout(c, counts.iter().copied(), (counts[i], got))
}

pub(crate) fn scatter_v(
    members: &[usize],
    me: usize,
    send: Option<&Buf<'_>>,
    recv: &mut BufMut<'_>,
    counts: &[usize],
    root: usize,
) -> Result<Call> {
    let kind = CollKind::ScatterV;
    let (i, sum) = counts_of(kind, members, me, counts)?;
    need_len("the receive buffer", recv.len(), counts[i], "this member's count")?;
    let (mut input, mut sent) = (std::ptr::null(), 0);
    if me == root {
        let send = send.ok_or_else(|| Error::invalid("scatter_v: the root must pass a send buffer"))?;
        expect_dtype("the send buffer", send.dtype(), recv.dtype())?;
        need_len("the send buffer", send.len(), sum, "the sum of the counts")?;
        (input, sent) = (send.as_ptr(), sum);
    }
    let c = with_root(call(kind, recv.dtype(), sum, input, recv.as_mut_ptr()), members, root)?;
    with_layout(c, counts.iter().copied(), (sent, counts[i]))
}

pub(crate) fn reduce_scatter_v(
    members: &[usize],
    me: usize,
    send: &Buf<'_>,
    recv: &mut BufMut<'_>,
    counts: &[usize],
    op: ReduceOp,
) -> Result<Call> {
    let kind = CollKind::ReduceScatterV;
    let (i, sum) = counts_of(kind, members, me, counts)?;
    expect_dtype("the receive buffer", recv.dtype(), send.dtype())?;
    need_len("the send buffer", send.len(), sum, "the sum of the counts")?;
    need_len("the receive buffer", recv.len(), counts[i], "this member's count")?;
    let mut c = call(kind, send.dtype(), sum, send.as_ptr(), recv.as_mut_ptr());
    c.sig = c.sig.op(op);
    with_layout(c, counts.iter().copied(), (sum, counts[i]))
}
