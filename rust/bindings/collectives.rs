//! Each collective's Python arguments, prepared once for `Backend` and `ProcessGroup` (running or in check
//! mode) alike: the op parsed, the arrays validated and borrowed while attached, and the call's description
//! (`Collective`, over the arrays' addresses) that runs on them, detached or queued on its lane.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::array::{readable, writable, Array, RawArray};
use super::op::parse_op;
use crate::backend::Backend;
use crate::collective::Collective;
use crate::error::Result;
use crate::reduce::{ReduceOp, Scale};
use crate::signature::CollKind;
use crate::work::Lane;

/// A call ready to run: its lane, the borrowed arrays (kept until the job has finished), the job.
pub(crate) struct Prepared<'py> {
    pub lane: Lane,
    pub arrays: Vec<Array<'py>>,
    pub job: Job,
}

/// Where a receive from any source records its sender's global rank once it has run.
pub(crate) type Source = Arc<OnceLock<usize>>;

/// A Python argument.
pub(crate) type Obj<'py> = Bound<'py, PyAny>;

/// What a prepared call runs, its arrays as addresses: a collective's description, or a message.
pub(crate) enum Job {
    Collective(RawCollective),
    Send { buf: RawArray, dst: usize, tag: u64 },
    Recv { buf: RawArray, src: usize, tag: u64 },
    RecvAny { buf: RawArray, tag: u64, source: Source },
}

/// A [`Collective`] whose buffers are the addresses of borrowed arrays, so it can wait on a lane.
pub(crate) struct RawCollective {
    kind: CollKind,
    send: Option<RawArray>,
    recv: Option<RawArray>,
    op: ReduceOp,
    scale: Scale,
    root: usize,
    counts: Vec<usize>,
    recv_counts: Vec<usize>,
    timeout: Option<Duration>,
}

impl RawCollective {
    fn of(kind: CollKind) -> Self {
        let c = Collective::of(kind);
        let (op, scale, root, timeout) = (c.op, c.scale, c.root, c.timeout);
        RawCollective {
            kind,
            send: None,
            recv: None,
            op,
            scale,
            root,
            counts: vec![],
            recv_counts: vec![],
            timeout,
        }
    }

    /// The description over the arrays.
    ///
    /// # Safety
    /// The arrays must be alive, and used by nobody else, while the description is.
    pub(crate) unsafe fn collective(&self) -> Collective<'_> {
        Collective {
            kind: self.kind,
            // SAFETY: forwarded.
            send: self.send.map(|s| unsafe { s.buf() }),
            // SAFETY: forwarded.
            recv: self.recv.map(|r| unsafe { r.buf_mut() }),
            op: self.op,
            scale: self.scale,
            root: self.root,
            counts: &self.counts,
            recv_counts: &self.recv_counts,
            timeout: self.timeout,
        }
    }
}

// SAFETY (`Job::run`): the RawArrays come from the `Array`s of the same `Prepared`, whose guards (run
// now) or object references (queued) are kept until the job has finished, and the call is their only
// user.
impl Job {
    /// Run the call on `c`.
    pub(crate) fn run(self, c: &dyn Backend) -> Result<()> {
        match self {
            Job::Collective(r) => c.collective(unsafe { r.collective() }),
            Job::Send { buf, dst, tag } => c.send(unsafe { buf.buf() }, dst, tag),
            Job::Recv { buf, src, tag } => c.recv(unsafe { buf.buf_mut() }, src, tag),
            Job::RecvAny { buf, tag, source } => {
                let src = c.recv_any(unsafe { buf.buf_mut() }, tag)?;
                let _ = source.set(src);
                Ok(())
            }
        }
    }
}

impl<'py> Prepared<'py> {
    /// The collective `raw` on `send` (only read) and `recv` (written), when given.
    fn collective(mut raw: RawCollective, send: Option<Array<'py>>, recv: Option<Array<'py>>) -> Self {
        raw.send = send.as_ref().map(|a| a.raw);
        raw.recv = recv.as_ref().map(|a| a.raw);
        let arrays = send.into_iter().chain(recv).collect();
        Prepared { lane: Lane::Collectives, arrays, job: Job::Collective(raw) }
    }
    /// Out of place when `send` is given.
    pub fn all_reduce(send: Option<Array<'py>>, recv: Array<'py>, op: ReduceOp, scale: Scale) -> Self {
        let raw = RawCollective { op, scale, ..RawCollective::of(CollKind::AllReduce) };
        Self::collective(raw, send, Some(recv))
    }
    pub fn broadcast(buf: Array<'py>, root: usize) -> Self {
        Self::collective(RawCollective { root, ..RawCollective::of(CollKind::Broadcast) }, None, Some(buf))
    }
    pub fn all_gather(send: Array<'py>, recv: Array<'py>) -> Self {
        Self::collective(RawCollective::of(CollKind::AllGather), Some(send), Some(recv))
    }
    pub fn reduce_scatter(send: Array<'py>, recv: Array<'py>, op: ReduceOp) -> Self {
        let raw = RawCollective { op, ..RawCollective::of(CollKind::ReduceScatter) };
        Self::collective(raw, Some(send), Some(recv))
    }
    pub fn recv(buf: Array<'py>, src: usize, tag: u64) -> Self {
        let job = Job::Recv { buf: buf.raw, src, tag };
        Prepared { lane: Lane::Recv { peer: src, tag }, arrays: vec![buf], job }
    }
    pub fn recv_any(buf: Array<'py>, tag: u64, source: Source) -> Self {
        let job = Job::RecvAny { buf: buf.raw, tag, source };
        Prepared { lane: Lane::RecvAny { tag }, arrays: vec![buf], job }
    }
}

/// `buf` only read and `out` written, or `buf` in place when `out` is None (or `buf` itself).
fn input_and_output<'py>(
    buf: &Obj<'py>,
    out: Option<&Obj<'py>>,
) -> PyResult<(Option<Array<'py>>, Array<'py>)> {
    match out {
        Some(out) if !out.is(buf) => {
            let send = readable(buf, "buf")?;
            Ok((Some(send), writable(out, "out")?))
        }
        _ => Ok((None, writable(buf, "buf")?)),
    }
}

/// `all_reduce(buf, op, out=None, prescale_factor, postscale_factor)`.
pub(crate) fn all_reduce<'py>(
    buf: &Obj<'py>,
    op: Option<&Obj<'py>>,
    out: Option<&Obj<'py>>,
    scale: Scale,
) -> PyResult<Prepared<'py>> {
    let op = parse_op(op)?;
    let (send, recv) = input_and_output(buf, out)?;
    Ok(Prepared::all_reduce(send, recv, op, scale))
}

/// `broadcast(buf, root)`.
pub(crate) fn broadcast<'py>(buf: &Obj<'py>, root: usize) -> PyResult<Prepared<'py>> {
    Ok(Prepared::broadcast(writable(buf, "buf")?, root))
}

/// `all_gather(send, recv)`.
pub(crate) fn all_gather<'py>(send: &Obj<'py>, recv: &Obj<'py>) -> PyResult<Prepared<'py>> {
    let send = readable(send, "send")?;
    Ok(Prepared::all_gather(send, writable(recv, "recv")?))
}

/// `reduce_scatter(send, recv, op)`.
pub(crate) fn reduce_scatter<'py>(
    send: &Obj<'py>,
    recv: &Obj<'py>,
    op: Option<&Obj<'py>>,
) -> PyResult<Prepared<'py>> {
    let op = parse_op(op)?;
    let send = readable(send, "send")?;
    Ok(Prepared::reduce_scatter(send, writable(recv, "recv")?, op))
}

/// `gather(send, recv, dst)`: `recv` only on `dst`.
pub(crate) fn gather<'py>(send: &Obj<'py>, recv: Option<&Obj<'py>>, dst: usize) -> PyResult<Prepared<'py>> {
    let send = readable(send, "send")?;
    let recv = recv.map(|r| writable(r, "recv")).transpose()?;
    Ok(Prepared::collective(
        RawCollective { root: dst, ..RawCollective::of(CollKind::Gather) },
        Some(send),
        recv,
    ))
}

/// `scatter(send, recv, src)`: `send` only on `src`.
pub(crate) fn scatter<'py>(send: Option<&Obj<'py>>, recv: &Obj<'py>, src: usize) -> PyResult<Prepared<'py>> {
    let send = send.map(|s| readable(s, "send")).transpose()?;
    let recv = writable(recv, "recv")?;
    Ok(Prepared::collective(
        RawCollective { root: src, ..RawCollective::of(CollKind::Scatter) },
        send,
        Some(recv),
    ))
}

/// `reduce(buf, dst, op, out=None, prescale_factor, postscale_factor)`.
pub(crate) fn reduce<'py>(
    buf: &Obj<'py>,
    dst: usize,
    op: Option<&Obj<'py>>,
    out: Option<&Obj<'py>>,
    scale: Scale,
) -> PyResult<Prepared<'py>> {
    let op = parse_op(op)?;
    let (send, recv) = input_and_output(buf, out)?;
    let raw = RawCollective { root: dst, op, scale, ..RawCollective::of(CollKind::Reduce) };
    Ok(Prepared::collective(raw, send, Some(recv)))
}

/// `barrier()`.
pub(crate) fn barrier<'py>() -> Prepared<'py> {
    Prepared::collective(RawCollective::of(CollKind::Barrier), None, None)
}

/// `monitored_barrier(timeout)`.
pub(crate) fn monitored_barrier<'py>(timeout: Duration) -> Prepared<'py> {
    let raw = RawCollective { timeout: Some(timeout), ..RawCollective::of(CollKind::Barrier) };
    Prepared::collective(raw, None, None)
}

/// `send(buf, dst, tag)`.
pub(crate) fn send<'py>(buf: &Obj<'py>, dst: usize, tag: u64) -> PyResult<Prepared<'py>> {
    let buf = readable(buf, "buf")?;
    let job = Job::Send { buf: buf.raw, dst, tag };
    Ok(Prepared { lane: Lane::Send { peer: dst, tag }, arrays: vec![buf], job })
}

/// `recv(buf, src, tag)`.
pub(crate) fn recv<'py>(buf: &Obj<'py>, src: usize, tag: u64) -> PyResult<Prepared<'py>> {
    Ok(Prepared::recv(writable(buf, "buf")?, src, tag))
}

/// `recv_any(buf, tag)`: `source` gets the sender.
pub(crate) fn recv_any<'py>(buf: &Obj<'py>, tag: u64, source: Source) -> PyResult<Prepared<'py>> {
    Ok(Prepared::recv_any(writable(buf, "buf")?, tag, source))
}

/// `all_to_all(send, recv)`.
pub(crate) fn all_to_all<'py>(send: &Obj<'py>, recv: &Obj<'py>) -> PyResult<Prepared<'py>> {
    let (send, recv) = (readable(send, "send")?, writable(recv, "recv")?);
    Ok(Prepared::collective(RawCollective::of(CollKind::AllToAll), Some(send), Some(recv)))
}

/// torch's split sizes of `a` (rows along its first axis; None: `n` equal parts) in elements.
fn split_elements(a: &Array<'_>, splits: Option<Vec<usize>>, n: usize, what: &str) -> PyResult<Vec<usize>> {
    let rows = a.shape.first().copied().unwrap_or(1);
    let row: usize = a.shape.iter().skip(1).product();
    let splits = match splits {
        Some(s) => s,
        None if rows % n == 0 => vec![rows / n; n],
        None => {
            return Err(PyValueError::new_err(format!(
                "all_to_all_single: {what} has {rows} rows along its first axis, which the group size {n} \
                 does not divide: pass the split sizes"
            )))
        }
    };
    splits
        .iter()
        .map(|&s| s.checked_mul(row))
        .collect::<Option<Vec<_>>>()
        .ok_or_else(|| PyValueError::new_err(format!("all_to_all_single: split sizes {splits:?} overflow")))
}

/// `all_to_all_single(send, recv, output_split_sizes, input_split_sizes)` in a group of `n`.
pub(crate) fn all_to_all_single<'py>(
    send: &Obj<'py>,
    recv: &Obj<'py>,
    output_split_sizes: Option<Vec<usize>>,
    input_split_sizes: Option<Vec<usize>>,
    n: usize,
) -> PyResult<Prepared<'py>> {
    let (send, recv) = (readable(send, "send")?, writable(recv, "recv")?);
    let ins = split_elements(&send, input_split_sizes, n, "send")?;
    let outs = split_elements(&recv, output_split_sizes, n, "recv")?;
    let raw = RawCollective { counts: ins, recv_counts: outs, ..RawCollective::of(CollKind::AllToAllSingle) };
    Ok(Prepared::collective(raw, Some(send), Some(recv)))
}

/// `all_gather_v(send, recv, counts)`.
pub(crate) fn all_gather_v<'py>(
    send: &Obj<'py>,
    recv: &Obj<'py>,
    counts: Vec<usize>,
) -> PyResult<Prepared<'py>> {
    let (send, recv) = (readable(send, "send")?, writable(recv, "recv")?);
    Ok(Prepared::collective(
        RawCollective { counts, ..RawCollective::of(CollKind::AllGatherV) },
        Some(send),
        Some(recv),
    ))
}

/// `gather_v(send, recv, counts, dst)`: `recv` only on `dst`.
pub(crate) fn gather_v<'py>(
    send: &Obj<'py>,
    recv: Option<&Obj<'py>>,
    counts: Vec<usize>,
    dst: usize,
) -> PyResult<Prepared<'py>> {
    let send = readable(send, "send")?;
    let recv = recv.map(|r| writable(r, "recv")).transpose()?;
    let raw = RawCollective { counts, root: dst, ..RawCollective::of(CollKind::GatherV) };
    Ok(Prepared::collective(raw, Some(send), recv))
}

/// `scatter_v(send, recv, counts, src)`: `send` only on `src`.
pub(crate) fn scatter_v<'py>(
    send: Option<&Obj<'py>>,
    recv: &Obj<'py>,
    counts: Vec<usize>,
    src: usize,
) -> PyResult<Prepared<'py>> {
    let send = send.map(|s| readable(s, "send")).transpose()?;
    let recv = writable(recv, "recv")?;
    let raw = RawCollective { counts, root: src, ..RawCollective::of(CollKind::ScatterV) };
    Ok(Prepared::collective(raw, send, Some(recv)))
}

/// `reduce_scatter_v(send, recv, counts, op)`.
pub(crate) fn reduce_scatter_v<'py>(
    send: &Obj<'py>,
    recv: &Obj<'py>,
    counts: Vec<usize>,
    op: Option<&Obj<'py>>,
) -> PyResult<Prepared<'py>> {
    let op = parse_op(op)?;
    let (send, recv) = (readable(send, "send")?, writable(recv, "recv")?);
    let raw = RawCollective { counts, op, ..RawCollective::of(CollKind::ReduceScatterV) };
    Ok(Prepared::collective(raw, Some(send), Some(recv)))
}
