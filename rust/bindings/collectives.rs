//! Each collective's Python arguments, prepared once for `Backend` and `ProcessGroup` alike: the op
//! parsed, the arrays validated and borrowed while attached, and the job that runs the call on them
//! (detached, or queued on its lane).

use std::sync::{Arc, OnceLock};

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::array::{readable, writable, Array};
use super::op::parse_op;
use super::work::Job;
use crate::reduce::{ReduceOp, Scale};
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

// SAFETY (every `unsafe { raw.buf*() }` below): the RawArray comes from an `Array` of the same
// `Prepared`, whose guard (run now) or object reference (queued) is kept until the job has finished,
// and the call is its only user.
impl<'py> Prepared<'py> {
    fn collective(arrays: Vec<Array<'py>>, job: Job) -> Self {
        Prepared { lane: Lane::Collectives, arrays, job }
    }
    /// Out of place when `send` is given.
    pub fn all_reduce(send: Option<Array<'py>>, recv: Array<'py>, op: ReduceOp, scale: Scale) -> Self {
        let (s, r) = (send.as_ref().map(|s| s.raw), recv.raw);
        let job: Job = Box::new(move |c| {
            c.all_reduce_into(s.map(|s| unsafe { s.buf() }), unsafe { r.buf_mut() }, op, scale)
        });
        Self::collective(send.into_iter().chain([recv]).collect(), job)
    }
    pub fn broadcast(buf: Array<'py>, root: usize) -> Self {
        let raw = buf.raw;
        Self::collective(vec![buf], Box::new(move |c| c.broadcast(unsafe { raw.buf_mut() }, root)))
    }
    pub fn all_gather(send: Array<'py>, recv: Array<'py>) -> Self {
        let (s, r) = (send.raw, recv.raw);
        Self::collective(
            vec![send, recv],
            Box::new(move |c| c.all_gather(unsafe { s.buf() }, unsafe { r.buf_mut() })),
        )
    }
    pub fn reduce_scatter(send: Array<'py>, recv: Array<'py>, op: ReduceOp) -> Self {
        let (s, r) = (send.raw, recv.raw);
        let job: Job = Box::new(move |c| c.reduce_scatter(unsafe { s.buf() }, unsafe { r.buf_mut() }, op));
        Self::collective(vec![send, recv], job)
    }
    pub fn recv(buf: Array<'py>, src: usize, tag: u64) -> Self {
        let raw = buf.raw;
        let job: Job = Box::new(move |c| c.recv(unsafe { raw.buf_mut() }, src, tag));
        Prepared { lane: Lane::Recv { peer: src, tag }, arrays: vec![buf], job }
    }
    pub fn recv_any(buf: Array<'py>, tag: u64, source: Source) -> Self {
        let raw = buf.raw;
        let job: Job = Box::new(move |c| {
            let src = c.recv_any(unsafe { raw.buf_mut() }, tag)?;
            let _ = source.set(src);
            Ok(())
        });
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
    let (s, r) = (send.raw, recv.as_ref().map(|r| r.raw));
    let job: Job = Box::new(move |c| c.gather(unsafe { s.buf() }, r.map(|r| unsafe { r.buf_mut() }), dst));
    Ok(Prepared::collective(std::iter::once(send).chain(recv).collect(), job))
}

/// `scatter(send, recv, src)`: `send` only on `src`.
pub(crate) fn scatter<'py>(send: Option<&Obj<'py>>, recv: &Obj<'py>, src: usize) -> PyResult<Prepared<'py>> {
    let send = send.map(|s| readable(s, "send")).transpose()?;
    let recv = writable(recv, "recv")?;
    let (s, r) = (send.as_ref().map(|s| s.raw), recv.raw);
    let job: Job = Box::new(move |c| c.scatter(s.map(|s| unsafe { s.buf() }), unsafe { r.buf_mut() }, src));
    Ok(Prepared::collective(send.into_iter().chain(std::iter::once(recv)).collect(), job))
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
    let (s, r) = (send.as_ref().map(|s| s.raw), recv.raw);
    let job: Job = Box::new(move |c| {
        c.reduce_into(s.map(|s| unsafe { s.buf() }), unsafe { r.buf_mut() }, dst, op, scale)
    });
    Ok(Prepared::collective(send.into_iter().chain([recv]).collect(), job))
}

/// `barrier()`.
pub(crate) fn barrier<'py>() -> Prepared<'py> {
    Prepared::collective(vec![], Box::new(|c| c.barrier()))
}

/// `monitored_barrier(timeout)`.
pub(crate) fn monitored_barrier<'py>(timeout: std::time::Duration) -> Prepared<'py> {
    Prepared::collective(vec![], Box::new(move |c| c.monitored_barrier(timeout)))
}

/// `send(buf, dst, tag)`.
pub(crate) fn send<'py>(buf: &Obj<'py>, dst: usize, tag: u64) -> PyResult<Prepared<'py>> {
    let buf = readable(buf, "buf")?;
    let raw = buf.raw;
    let job: Job = Box::new(move |c| c.send(unsafe { raw.buf() }, dst, tag));
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
    let (s, r) = (send.raw, recv.raw);
    let job: Job = Box::new(move |c| c.all_to_all(unsafe { s.buf() }, unsafe { r.buf_mut() }));
    Ok(Prepared::collective(vec![send, recv], job))
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
    let (s, r) = (send.raw, recv.raw);
    let job: Job =
        Box::new(move |c| c.all_to_all_single(unsafe { s.buf() }, unsafe { r.buf_mut() }, &ins, &outs));
    Ok(Prepared::collective(vec![send, recv], job))
}

/// `all_gather_v(send, recv, counts)`.
pub(crate) fn all_gather_v<'py>(
    send: &Obj<'py>,
    recv: &Obj<'py>,
    counts: Vec<usize>,
) -> PyResult<Prepared<'py>> {
    let (send, recv) = (readable(send, "send")?, writable(recv, "recv")?);
    let (s, r) = (send.raw, recv.raw);
    let job: Job = Box::new(move |c| c.all_gather_v(unsafe { s.buf() }, unsafe { r.buf_mut() }, &counts));
    Ok(Prepared::collective(vec![send, recv], job))
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
    let (s, r) = (send.raw, recv.as_ref().map(|r| r.raw));
    let job: Job =
        Box::new(move |c| c.gather_v(unsafe { s.buf() }, r.map(|r| unsafe { r.buf_mut() }), &counts, dst));
    Ok(Prepared::collective(std::iter::once(send).chain(recv).collect(), job))
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
    let (s, r) = (send.as_ref().map(|s| s.raw), recv.raw);
    let job: Job =
        Box::new(move |c| c.scatter_v(s.map(|s| unsafe { s.buf() }), unsafe { r.buf_mut() }, &counts, src));
    Ok(Prepared::collective(send.into_iter().chain(std::iter::once(recv)).collect(), job))
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
    let (s, r) = (send.raw, recv.raw);
    let job: Job =
        Box::new(move |c| c.reduce_scatter_v(unsafe { s.buf() }, unsafe { r.buf_mut() }, &counts, op));
    Ok(Prepared::collective(vec![send, recv], job))
}
