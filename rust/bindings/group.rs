//! `ProcessGroup` for Python.
//!
//! Every collective validates and borrows its arrays while attached, then either runs detached (the GIL
//! released for the whole wait) or, with `async_op=True`, is queued on the group's worker thread and
//! returns a `Work`. Queued jobs hold references to their arrays until they finish. Bad arguments abort
//! the world, so the other ranks fail at once instead of waiting for this one until the timeout. A group
//! in check mode (`ProcessGroup.call_check`, see `check`) returns what the checks found instead.

use std::sync::Arc;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::args::timeout_arg;
use super::array::{as_ndarray, is_tensor, like, readable, writable, zeros};
use super::backend::PyBackend;
use super::check::{checked, CheckWorld};
use super::collectives::{self as c, Obj, Prepared, Source};
use super::exceptions::abort_on_bad_arguments;
use super::op::parse_op;
use super::work::{queued, run_blocking, PyWork};
use crate::group::ProcessGroup;
use crate::reduce::Scale;

/// What every collective method returns: None, a new array, or a `Work` (with `async_op=True`).
type Ret = PyResult<Py<PyAny>>;

/// A group of ranks as seen from this rank: collectives involve only its members.
#[pyclass(name = "ProcessGroup", module = "axonml_distributed", frozen)]
pub(crate) struct PyProcessGroup {
    pub(crate) inner: Arc<ProcessGroup>,
    /// In check mode: calls return what the core's checks found instead of running.
    checks: bool,
}

impl From<Arc<ProcessGroup>> for PyProcessGroup {
    fn from(inner: Arc<ProcessGroup>) -> Self {
        PyProcessGroup { inner, checks: false }
    }
}

impl PyProcessGroup {
    /// Abort the world when `r` is an argument error: a rank that cannot enter a collective must not
    /// leave its peers waiting.
    fn checked<T>(&self, r: PyResult<T>) -> PyResult<T> {
        abort_on_bad_arguments(&**self.inner.backend(), r)
    }

    /// Run `call` now with the GIL released (the borrow guards in its arrays outlive it), after the work
    /// queued on its lane, or queue it there; bad arguments abort the world first. `result` is what the
    /// call (or its `Work.wait()`) returns.
    fn run<'py>(
        &self,
        py: Python<'py>,
        async_op: bool,
        call: PyResult<Prepared<'py>>,
        result: Option<Bound<'py, PyAny>>,
    ) -> Ret {
        self.run_sourced(py, async_op, call, result, None)
    }

    /// [`Self::run`] for a receive from any source, which returns (or its `Work.wait()` does) the
    /// sender that `source` records. In check mode, the call's [`checked`] fields.
    fn run_sourced<'py>(
        &self,
        py: Python<'py>,
        async_op: bool,
        call: PyResult<Prepared<'py>>,
        result: Option<Bound<'py, PyAny>>,
        source: Option<Source>,
    ) -> Ret {
        let call = self.checked(call)?;
        if self.checks {
            let found = checked(call.job, self.inner.ranks(), self.inner.rank())?;
            return Ok(found.into_pyobject(py)?.into_any().unbind());
        }
        let comm = self.checked(self.inner.comm().map_err(PyErr::from))?.clone();
        if !async_op {
            run_blocking(py, &comm, call)?;
            if let Some(src) = source.as_ref().and_then(|s| s.get()) {
                return Ok(src.into_pyobject(py)?.into_any().unbind());
            }
            return Ok(result.map_or_else(|| py.None(), Bound::unbind));
        }
        let (lane, job) = queued(py, comm.clone(), call);
        let work = self.inner.submit(lane, job)?;
        let w = PyWork { work, result: result.map(Bound::unbind), comm, source };
        Ok(Bound::new(py, w)?.into_any().unbind())
    }

    fn root_or_first(&self, root: Option<usize>) -> usize {
        root.unwrap_or(self.inner.ranks()[0])
    }
}

#[pymethods]
impl PyProcessGroup {
    /// The group of every rank of `backend`'s world (`ranks=None`), or of `ranks` (global; every member
    /// must create it, in the same order as its other groups). With a `timeout` (seconds or a
    /// `datetime.timedelta`; None: the world's) its waits last that long: a group of its own even over
    /// every rank, which every rank must then create.
    #[new]
    #[pyo3(signature = (backend, ranks=None, timeout=None))]
    fn new(backend: &PyBackend, ranks: Option<Vec<usize>>, timeout: Option<&Obj>) -> PyResult<Self> {
        let b = backend.inner.clone();
        let timeout = timeout.map(timeout_arg).transpose()?;
        let inner = match (ranks, timeout) {
            (None, None) => ProcessGroup::new(b),
            (None, Some(t)) => {
                let every = b.members().to_vec();
                ProcessGroup::with_ranks(b, &every, Some(t))?
            }
            (Some(r), t) => ProcessGroup::with_ranks(b, &r, t)?,
        };
        Ok(Arc::new(inner).into())
    }
    /// Same as `ProcessGroup(backend, ranks, timeout)`.
    #[staticmethod]
    #[pyo3(signature = (backend, ranks, timeout=None))]
    fn with_ranks(backend: &PyBackend, ranks: Vec<usize>, timeout: Option<&Obj>) -> PyResult<Self> {
        Self::new(backend, Some(ranks), timeout)
    }
    /// A subgroup of `ranks` (global), made over this group's world as `World.new_group` does: every
    /// member creates it, in the same order as its other groups. Its waits last `timeout` (seconds or a
    /// `datetime.timedelta`; None: the world's). The same call as on the MPI group.
    #[pyo3(signature = (ranks, timeout=None))]
    fn new_group(&self, ranks: Vec<usize>, timeout: Option<&Obj>) -> PyResult<Self> {
        let timeout = timeout.map(timeout_arg).transpose()?;
        let inner = ProcessGroup::with_ranks(self.inner.backend().clone(), &ranks, timeout)?;
        Ok(Arc::new(inner).into())
    }
    /// Global rank `rank`'s group of `ranks` (global) in a world of `world_size`, in check mode, for a
    /// backend written in Python (MPI): each call takes what it takes on any group and raises what it
    /// would for bad arguments, or returns, running nothing, the `(dtype, count, root, op, layout)` of
    /// the call by the core's codes (`root` a group index, -1 for a field the call has not; `layout` the
    /// words of a collective with per-member sizes, else None).
    #[staticmethod]
    fn call_check(ranks: Vec<usize>, rank: usize, world_size: usize) -> PyResult<Self> {
        let world = CheckWorld::new(&ranks, rank, world_size)?;
        Ok(PyProcessGroup { inner: Arc::new(ProcessGroup::new(Arc::new(world))), checks: true })
    }
    /// How long a wait on this group (a collective, a send or receive) lasts before it raises
    /// CollectiveTimeoutError, in seconds.
    fn timeout(&self) -> f64 {
        self.inner.timeout().as_secs_f64()
    }
    /// This rank's totals on the group, per collective kind it called: calls, failed calls, bytes of the
    /// completed calls' messages (a member's part), seconds waiting for peers (from the call until every
    /// member arrived) and moving data (from then until it returned), and completed calls per route
    /// ("oneshot", "direct", "cma", "staged", "pairwise", "none"). Empty on a non-member, and on
    /// groups whose backend records nothing.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        match self.inner.recorder() {
            Some(r) => super::flight::stats(py, &r.stats()),
            None => Ok(PyDict::new(py)),
        }
    }
    /// The world backend this group was made from.
    fn backend(&self) -> PyBackend {
        PyBackend { inner: self.inner.backend().clone() }
    }
    /// This rank's global rank.
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    /// Number of ranks in the world.
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    /// Number of ranks in this group.
    fn size(&self) -> usize {
        self.inner.size()
    }
    /// Global ranks of the members, ascending (the group order).
    fn ranks(&self) -> Vec<usize> {
        self.inner.ranks().to_vec()
    }
    /// The sequence number of the last collective this rank entered on this group (0 before the first):
    /// the same on every member between calls.
    fn sequence_number(&self) -> u64 {
        self.inner.sequence_number()
    }
    /// Whether global rank `rank` is a member.
    fn contains(&self, rank: usize) -> bool {
        self.inner.contains(rank)
    }
    /// Position of global rank `rank` in the group.
    fn group_rank(&self, rank: usize) -> PyResult<usize> {
        Ok(crate::call::group_rank(self.inner.ranks(), rank)?)
    }
    /// An uninitialised array suited for collectives on this group: with the "shm" backend it lives in
    /// the shared segment, so collectives on it copy nothing through staging (private memory when the
    /// segment's arena is full or the backend has none).
    fn empty<'py>(
        &self,
        py: Python<'py>,
        shape: &Bound<'py, PyAny>,
        dtype: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let np = py.import("numpy")?;
        let descr = np.call_method1("dtype", (dtype,))?;
        let dims: Vec<usize> = match shape.extract::<usize>() {
            Ok(n) => vec![n],
            Err(_) => shape.extract()?,
        };
        let descr = descr.cast::<numpy::PyArrayDescr>()?;
        match super::segment::segment_array(self.inner.backend(), &dims, descr)? {
            Some(a) => Ok(a),
            None => np.call_method1("empty", (shape, dtype)),
        }
    }

    /// Reduce `buf` across the group in place, or into `out` (then `buf` is only read); each input
    /// times `prescale_factor`, the result times `postscale_factor` (floating-point dtypes).
    #[pyo3(signature = (buf, op=None, *, out=None, prescale_factor=1.0, postscale_factor=1.0, async_op=false))]
    #[allow(clippy::too_many_arguments)]
    fn all_reduce(
        &self,
        py: Python<'_>,
        buf: &Obj,
        op: Option<&Obj>,
        out: Option<&Obj>,
        prescale_factor: f64,
        postscale_factor: f64,
        async_op: bool,
    ) -> Ret {
        let scale = Scale { pre: prescale_factor, post: postscale_factor };
        self.run(py, async_op, c::all_reduce(buf, op, out, scale), None)
    }
    /// Copy global rank `src`'s `buf` (default: the group's first rank) into every member's.
    #[pyo3(signature = (buf, src=None, *, async_op=false))]
    fn broadcast(&self, py: Python<'_>, buf: &Obj, src: Option<usize>, async_op: bool) -> Ret {
        self.run(py, async_op, c::broadcast(buf, self.root_or_first(src)), None)
    }
    /// Concatenate every member's `send` into `recv` (shape `(size, *send.shape)`).
    #[pyo3(signature = (send, recv, *, async_op=false))]
    fn all_gather(&self, py: Python<'_>, send: &Obj, recv: &Obj, async_op: bool) -> Ret {
        self.run(py, async_op, c::all_gather(send, recv), None)
    }
    /// Reduce `send` across the group; chunk i (of `size` equal chunks) lands in the i-th member's `recv`.
    #[pyo3(signature = (send, recv, op=None, *, async_op=false))]
    fn reduce_scatter(
        &self,
        py: Python<'_>,
        send: &Obj,
        recv: &Obj,
        op: Option<&Obj>,
        async_op: bool,
    ) -> Ret {
        self.run(py, async_op, c::reduce_scatter(send, recv, op), None)
    }
    /// Concatenate every member's `send` into `dst`'s `recv` (pass None elsewhere).
    #[pyo3(signature = (send, recv, dst, *, async_op=false))]
    fn gather(&self, py: Python<'_>, send: &Obj, recv: Option<&Obj>, dst: usize, async_op: bool) -> Ret {
        self.run(py, async_op, c::gather(send, recv, dst), None)
    }
    /// Split `src`'s `send` (None elsewhere) into one chunk per member's `recv`.
    #[pyo3(signature = (send, recv, src, *, async_op=false))]
    fn scatter(&self, py: Python<'_>, send: Option<&Obj>, recv: &Obj, src: usize, async_op: bool) -> Ret {
        self.run(py, async_op, c::scatter(send, recv, src), None)
    }
    /// Reduce `buf` into global rank `dst`'s `buf` (or its `out`, then `buf` is only read); the other
    /// members' buffers are left unchanged. Factors as in `all_reduce`.
    #[pyo3(signature = (buf, dst, op=None, *, out=None, prescale_factor=1.0, postscale_factor=1.0, async_op=false))]
    #[allow(clippy::too_many_arguments)]
    fn reduce(
        &self,
        py: Python<'_>,
        buf: &Obj,
        dst: usize,
        op: Option<&Obj>,
        out: Option<&Obj>,
        prescale_factor: f64,
        postscale_factor: f64,
        async_op: bool,
    ) -> Ret {
        let scale = Scale { pre: prescale_factor, post: postscale_factor };
        self.run(py, async_op, c::reduce(buf, dst, op, out, scale), None)
    }
    /// Block until every member arrives.
    #[pyo3(signature = (*, async_op=false))]
    fn barrier(&self, py: Python<'_>, async_op: bool) -> Ret {
        self.run(py, async_op, Ok(c::barrier()), None)
    }
    /// A barrier that waits at most `timeout` (seconds or a `datetime.timedelta`; None: the group's
    /// timeout). When members do not arrive in time, every member that did raises
    /// CollectiveTimeoutError naming all the missing ones, whatever `wait_all_ranks` (torch's keyword),
    /// and the world is aborted, as by any timeout. Blocking only.
    #[pyo3(signature = (timeout=None, wait_all_ranks=false))]
    fn monitored_barrier(&self, py: Python<'_>, timeout: Option<&Obj>, wait_all_ranks: bool) -> Ret {
        let _ = wait_all_ranks; // the engine knows every missing member at the deadline
        let call =
            timeout.map(timeout_arg).transpose().map(|t| t.map_or_else(c::barrier, c::monitored_barrier));
        self.run(py, false, call, None)
    }
    /// Part j of `send` (`size` equal parts) to the j-th member; part i of `recv` from the i-th.
    #[pyo3(signature = (send, recv, *, async_op=false))]
    fn all_to_all(&self, py: Python<'_>, send: &Obj, recv: &Obj, async_op: bool) -> Ret {
        self.run(py, async_op, c::all_to_all(send, recv), None)
    }
    /// all_to_all with split sizes (rows along the first axis; None: equal), as torch's.
    #[pyo3(signature = (send, recv, output_split_sizes=None, input_split_sizes=None, *, async_op=false))]
    fn all_to_all_single(
        &self,
        py: Python<'_>,
        send: &Obj,
        recv: &Obj,
        output_split_sizes: Option<Vec<usize>>,
        input_split_sizes: Option<Vec<usize>>,
        async_op: bool,
    ) -> Ret {
        let n = self.inner.size();
        let call = c::all_to_all_single(send, recv, output_split_sizes, input_split_sizes, n);
        self.run(py, async_op, call, None)
    }
    /// `counts[i]` elements from the i-th member, concatenated into `recv` (their sum).
    #[pyo3(signature = (send, recv, counts, *, async_op=false))]
    fn all_gather_v(
        &self,
        py: Python<'_>,
        send: &Obj,
        recv: &Obj,
        counts: Vec<usize>,
        async_op: bool,
    ) -> Ret {
        self.run(py, async_op, c::all_gather_v(send, recv, counts), None)
    }
    /// `counts[i]` elements from the i-th member, concatenated into `dst`'s `recv` (None elsewhere).
    #[pyo3(signature = (send, recv, counts, dst, *, async_op=false))]
    fn gather_v(
        &self,
        py: Python<'_>,
        send: &Obj,
        recv: Option<&Obj>,
        counts: Vec<usize>,
        dst: usize,
        async_op: bool,
    ) -> Ret {
        self.run(py, async_op, c::gather_v(send, recv, counts, dst), None)
    }
    /// `counts[i]` elements of `src`'s `send` (None elsewhere) to the i-th member's `recv`.
    #[pyo3(signature = (send, recv, counts, src, *, async_op=false))]
    fn scatter_v(
        &self,
        py: Python<'_>,
        send: Option<&Obj>,
        recv: &Obj,
        counts: Vec<usize>,
        src: usize,
        async_op: bool,
    ) -> Ret {
        self.run(py, async_op, c::scatter_v(send, recv, counts, src), None)
    }
    /// Reduce `send` (the sum of `counts` elements); the i-th piece (`counts[i]`) lands in the i-th
    /// member's `recv`.
    #[pyo3(signature = (send, recv, counts, op=None, *, async_op=false))]
    fn reduce_scatter_v(
        &self,
        py: Python<'_>,
        send: &Obj,
        recv: &Obj,
        counts: Vec<usize>,
        op: Option<&Obj>,
        async_op: bool,
    ) -> Ret {
        self.run(py, async_op, c::reduce_scatter_v(send, recv, counts, op), None)
    }
    /// Send `buf` to global rank `dst`; returns once the receiver has it.
    #[pyo3(signature = (buf, dst, tag=0, *, async_op=false))]
    fn send(&self, py: Python<'_>, buf: &Obj, dst: usize, tag: u64, async_op: bool) -> Ret {
        self.run(py, async_op, c::send(buf, dst, tag), None)
    }
    /// Receive into `buf` from global rank `src` (dtype and size must match the send).
    #[pyo3(signature = (buf, src, tag=0, *, async_op=false))]
    fn recv(&self, py: Python<'_>, buf: &Obj, src: usize, tag: u64, async_op: bool) -> Ret {
        self.run(py, async_op, c::recv(buf, src, tag), None)
    }
    /// Receive into `buf` the first message with `tag` from any other member (dtype and size must
    /// match the send); returns the sender's global rank (with `async_op`, a `Work` whose `wait()`
    /// and `source_rank()` do).
    #[pyo3(signature = (buf, tag=0, *, async_op=false))]
    fn recv_any(&self, py: Python<'_>, buf: &Obj, tag: u64, async_op: bool) -> Ret {
        let source = Source::default();
        self.run_sourced(py, async_op, c::recv_any(buf, tag, source.clone()), None, Some(source))
    }

    /// A new array (or `out`, filled): `t` reduced across the group. Factors as in `all_reduce`.
    #[pyo3(signature = (t, op=None, *, out=None, prescale_factor=1.0, postscale_factor=1.0, async_op=false))]
    #[allow(clippy::too_many_arguments)]
    fn all_reduce_tensor(
        &self,
        py: Python<'_>,
        t: &Obj,
        op: Option<&Obj>,
        out: Option<&Obj>,
        prescale_factor: f64,
        postscale_factor: f64,
        async_op: bool,
    ) -> Ret {
        let scale = Scale { pre: prescale_factor, post: postscale_factor };
        if let Some(out) = out {
            return self.run(py, async_op, c::all_reduce(t, op, Some(out), scale), Some(out.clone()));
        }
        let (op, out) = self.checked(parse_op(op).and_then(|op| Ok((op, copy_of(t)?))))?;
        let call = writable(&out, "t").map(|a| Prepared::all_reduce(None, a, op, scale));
        self.run(py, async_op, call, Some(like(out.clone(), t)?))
    }
    /// A new array: `src`'s `t` (default: the group's first rank).
    #[pyo3(signature = (t, src=None, *, async_op=false))]
    fn broadcast_tensor(&self, py: Python<'_>, t: &Obj, src: Option<usize>, async_op: bool) -> Ret {
        let out = self.checked(copy_of(t))?;
        let root = self.root_or_first(src);
        let call = writable(&out, "t").map(|a| Prepared::broadcast(a, root));
        self.run(py, async_op, call, Some(like(out.clone(), t)?))
    }
    /// A new array of shape `(size, *t.shape)` (or `out`, filled, of as many elements): every
    /// member's `t`, in group order.
    #[pyo3(signature = (t, *, out=None, async_op=false))]
    fn all_gather_tensor(&self, py: Python<'_>, t: &Obj, out: Option<&Obj>, async_op: bool) -> Ret {
        if let Some(out) = out {
            return self.run(py, async_op, c::all_gather(t, out), Some(out.clone()));
        }
        let s = self.checked(readable(t, "t"))?;
        let shape: Vec<usize> = std::iter::once(self.inner.size()).chain(s.shape.iter().copied()).collect();
        let out = self.checked(zeros(py, s.raw.dtype, &shape, t))?;
        let call = Prepared::all_gather(s, writable(&out, "out")?);
        self.run(py, async_op, Ok(call), Some(like(out.clone(), t)?))
    }
    /// A new array (or `out`, filled, of as many elements): this member's chunk of `t` reduced across
    /// the group (dimension 0 split in `size`).
    #[pyo3(signature = (t, op=None, *, out=None, async_op=false))]
    fn reduce_scatter_tensor(
        &self,
        py: Python<'_>,
        t: &Obj,
        op: Option<&Obj>,
        out: Option<&Obj>,
        async_op: bool,
    ) -> Ret {
        if let Some(out) = out {
            return self.run(py, async_op, c::reduce_scatter(t, out, op), Some(out.clone()));
        }
        let (op, s) = self.checked(parse_op(op).and_then(|op| Ok((op, readable(t, "t")?))))?;
        let n = self.inner.size();
        let first = s.shape.first().copied().unwrap_or(0);
        if s.shape.is_empty() || first % n != 0 {
            return self.checked(Err(PyValueError::new_err(format!(
                "reduce_scatter_tensor: dimension 0 of shape {:?} must divide by the group size {n}",
                s.shape
            ))));
        }
        let shape: Vec<usize> = std::iter::once(first / n).chain(s.shape[1..].iter().copied()).collect();
        let out = self.checked(zeros(py, s.raw.dtype, &shape, t))?;
        let call = Prepared::reduce_scatter(s, writable(&out, "out")?, op);
        self.run(py, async_op, Ok(call), Some(like(out.clone(), t)?))
    }
    /// Send `t` to global rank `dst`.
    #[pyo3(signature = (t, dst, tag=0, *, async_op=false))]
    fn send_tensor(&self, py: Python<'_>, t: &Obj, dst: usize, tag: u64, async_op: bool) -> Ret {
        self.send(py, t, dst, tag, async_op)
    }
    /// A new array of `shape` and `dtype` received from global rank `src`.
    #[pyo3(signature = (shape, dtype, src, tag=0, *, async_op=false))]
    fn recv_tensor(
        &self,
        py: Python<'_>,
        shape: &Obj,
        dtype: &Obj,
        src: usize,
        tag: u64,
        async_op: bool,
    ) -> Ret {
        let out = self.checked(py.import("numpy")?.call_method1("empty", (shape, dtype)))?;
        let call = writable(&out, "out").map(|a| Prepared::recv(a, src, tag));
        self.run(py, async_op, call, Some(out.clone()))
    }
    fn __repr__(&self) -> String {
        format!(
            "ProcessGroup(rank={}, ranks={:?}, backend={:?})",
            self.inner.rank(),
            self.inner.ranks(),
            self.inner.backend().name()
        )
    }
}

/// A C-ordered numpy copy of `t` (an array or a CPU tensor), for the `*_tensor` collectives that
/// return new arrays.
fn copy_of<'py>(t: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    if is_tensor(t)? {
        // torch's own copy: it keeps dtypes numpy lacks (bfloat16) and makes any layout contiguous.
        let contiguous = t.py().import("torch")?.getattr("contiguous_format")?;
        let kwargs = PyDict::new(t.py());
        kwargs.set_item("memory_format", contiguous)?;
        return t.call_method0("detach")?.call_method("clone", (), Some(&kwargs));
    }
    let np = t.py().import("numpy")?;
    np.call_method1("array", (as_ndarray(t, "t")?,))?.call_method1("copy", ("C",))
}
