//! `Backend` and `MockBackend` for Python: the seed's method style, ranks global.

use std::sync::Arc;
use std::time::Duration;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::array::{readable, writable, Array};
use super::exceptions::abort_on_bad_arguments;
use super::op::parse_op;
use super::work::{run_blocking, Job};
use crate::backend::Backend;
use crate::config::{DEFAULT_TIMEOUT, MAX_TIMEOUT};
use crate::transport::thread::MockBackend;
use crate::work::Lane;

/// Seconds (float or None) to a timeout: positive, finite and at most `MAX_TIMEOUT` (about 31 years),
/// so no deadline computed from it can overflow.
pub(crate) fn timeout_from(seconds: Option<f64>) -> PyResult<Duration> {
    match seconds {
        None => Ok(DEFAULT_TIMEOUT),
        Some(s) if s > 0.0 && s <= MAX_TIMEOUT.as_secs_f64() => Ok(Duration::from_secs_f64(s)),
        Some(s) => Err(PyValueError::new_err(format!(
            "timeout must be a positive number of seconds up to {:.0} (about 31 years), got {s}",
            MAX_TIMEOUT.as_secs_f64()
        ))),
    }
}

/// `seconds` checked as every native timeout is (positive, at most about 31 years; None: the default
/// of 300 s), for the backends written in Python (MPI).
#[pyfunction]
#[pyo3(signature = (seconds=None))]
pub(crate) fn checked_timeout(seconds: Option<f64>) -> PyResult<f64> {
    Ok(timeout_from(seconds)?.as_secs_f64())
}

/// One rank's handle on a world (or a subgroup's communicator). Collectives block, with the GIL
/// released, until every member arrives.
#[pyclass(name = "Backend", module = "axonml_distributed", frozen)]
pub(crate) struct PyBackend {
    pub(crate) inner: Arc<dyn Backend>,
}

impl PyBackend {
    fn checked<T>(&self, r: PyResult<T>) -> PyResult<T> {
        abort_on_bad_arguments(&*self.inner, r)
    }

    /// Run `job` now, after the work that groups over this communicator queued on `lane`.
    fn run(&self, py: Python<'_>, lane: Lane, arrays: Vec<Array<'_>>, job: Job) -> PyResult<()> {
        run_blocking(py, &self.inner, lane, arrays, job)
    }
}

#[pymethods]
impl PyBackend {
    /// This rank's global rank.
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    /// Number of ranks in the world.
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    /// The transport's name ("threads", "shm").
    fn name(&self) -> String {
        self.inner.name().to_string()
    }
    /// All-reduce `buf` in place.
    #[pyo3(signature = (buf, op=None))]
    fn all_reduce(
        &self,
        py: Python<'_>,
        buf: &Bound<'_, PyAny>,
        op: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let op = self.checked(parse_op(op))?;
        let a = self.checked(writable(buf, "buf"))?;
        let raw = a.raw;
        // SAFETY (every job here): `run_blocking` keeps the arrays' borrow guards until the job ends.
        self.run(
            py,
            Lane::Collectives,
            vec![a],
            Box::new(move |b| b.all_reduce(unsafe { raw.buf_mut() }, op)),
        )
    }
    /// Copy global rank `src`'s `buf` into every member's `buf`.
    fn broadcast(&self, py: Python<'_>, buf: &Bound<'_, PyAny>, src: usize) -> PyResult<()> {
        let a = self.checked(writable(buf, "buf"))?;
        let raw = a.raw;
        self.run(
            py,
            Lane::Collectives,
            vec![a],
            Box::new(move |b| b.broadcast(unsafe { raw.buf_mut() }, src)),
        )
    }
    /// Concatenate every member's `send` into `recv`.
    fn all_gather(&self, py: Python<'_>, send: &Bound<'_, PyAny>, recv: &Bound<'_, PyAny>) -> PyResult<()> {
        let (s, r) = self.checked(readable(send, "send").and_then(|s| Ok((s, writable(recv, "recv")?))))?;
        let (sr, rr) = (s.raw, r.raw);
        let job: Job = Box::new(move |b| b.all_gather(unsafe { sr.buf() }, unsafe { rr.buf_mut() }));
        self.run(py, Lane::Collectives, vec![s, r], job)
    }
    /// Reduce `send` and keep this member's chunk in `recv`.
    #[pyo3(signature = (send, recv, op=None))]
    fn reduce_scatter(
        &self,
        py: Python<'_>,
        send: &Bound<'_, PyAny>,
        recv: &Bound<'_, PyAny>,
        op: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let op = self.checked(parse_op(op))?;
        let (s, r) = self.checked(readable(send, "send").and_then(|s| Ok((s, writable(recv, "recv")?))))?;
        let (sr, rr) = (s.raw, r.raw);
        let job: Job = Box::new(move |b| b.reduce_scatter(unsafe { sr.buf() }, unsafe { rr.buf_mut() }, op));
        self.run(py, Lane::Collectives, vec![s, r], job)
    }
    /// Concatenate every member's `send` into `dst`'s `recv` (None elsewhere).
    #[pyo3(signature = (send, recv, dst))]
    fn gather(
        &self,
        py: Python<'_>,
        send: &Bound<'_, PyAny>,
        recv: Option<&Bound<'_, PyAny>>,
        dst: usize,
    ) -> PyResult<()> {
        let s = self.checked(readable(send, "send"))?;
        let r = self.checked(recv.map(|r| writable(r, "recv")).transpose())?;
        let (sr, rr) = (s.raw, r.as_ref().map(|r| r.raw));
        let job: Job =
            Box::new(move |b| b.gather(unsafe { sr.buf() }, rr.map(|r| unsafe { r.buf_mut() }), dst));
        self.run(py, Lane::Collectives, std::iter::once(s).chain(r).collect(), job)
    }
    /// Split `src`'s `send` (None elsewhere) into every member's `recv`.
    #[pyo3(signature = (send, recv, src))]
    fn scatter(
        &self,
        py: Python<'_>,
        send: Option<&Bound<'_, PyAny>>,
        recv: &Bound<'_, PyAny>,
        src: usize,
    ) -> PyResult<()> {
        let s = self.checked(send.map(|s| readable(s, "send")).transpose())?;
        let r = self.checked(writable(recv, "recv"))?;
        let (sr, rr) = (s.as_ref().map(|s| s.raw), r.raw);
        let job: Job =
            Box::new(move |b| b.scatter(sr.map(|s| unsafe { s.buf() }), unsafe { rr.buf_mut() }, src));
        self.run(py, Lane::Collectives, s.into_iter().chain(std::iter::once(r)).collect(), job)
    }
    /// Reduce `buf` into `dst`'s `buf`.
    #[pyo3(signature = (buf, dst, op=None))]
    fn reduce(
        &self,
        py: Python<'_>,
        buf: &Bound<'_, PyAny>,
        dst: usize,
        op: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let op = self.checked(parse_op(op))?;
        let a = self.checked(writable(buf, "buf"))?;
        let raw = a.raw;
        self.run(
            py,
            Lane::Collectives,
            vec![a],
            Box::new(move |b| b.reduce(unsafe { raw.buf_mut() }, dst, op)),
        )
    }
    /// Block until every member arrives.
    fn barrier(&self, py: Python<'_>) -> PyResult<()> {
        self.run(py, Lane::Collectives, vec![], Box::new(|b| b.barrier()))
    }
    /// Send `buf` to global rank `dst`.
    #[pyo3(signature = (buf, dst, tag=0))]
    fn send(&self, py: Python<'_>, buf: &Bound<'_, PyAny>, dst: usize, tag: u64) -> PyResult<()> {
        let a = self.checked(readable(buf, "buf"))?;
        let raw = a.raw;
        self.run(
            py,
            Lane::Send { peer: dst, tag },
            vec![a],
            Box::new(move |b| b.send(unsafe { raw.buf() }, dst, tag)),
        )
    }
    /// Receive into `buf` from global rank `src`.
    #[pyo3(signature = (buf, src, tag=0))]
    fn recv(&self, py: Python<'_>, buf: &Bound<'_, PyAny>, src: usize, tag: u64) -> PyResult<()> {
        let a = self.checked(writable(buf, "buf"))?;
        let raw = a.raw;
        self.run(
            py,
            Lane::Recv { peer: src, tag },
            vec![a],
            Box::new(move |b| b.recv(unsafe { raw.buf_mut() }, src, tag)),
        )
    }
    /// Abort the whole world: every rank waiting, or arriving later, raises PeerFailureError.
    fn abort(&self, reason: &str) {
        self.inner.abort(reason)
    }
    /// Say that this rank will make no more calls: peers waiting for it raise PeerFailureError naming
    /// it instead of timing out (`spawn` does this when a rank's function returns).
    fn leave(&self) {
        self.inner.leave()
    }
    fn __repr__(&self) -> String {
        format!(
            "Backend(name={:?}, rank={}, world_size={})",
            self.inner.name(),
            self.inner.rank(),
            self.inner.world_size()
        )
    }
}

/// The in-process world: each rank is a thread, and collectives exchange data through the callers'
/// own arrays.
#[pyclass(name = "MockBackend", module = "axonml_distributed", frozen)]
pub(crate) struct PyMockBackend;

#[pymethods]
impl PyMockBackend {
    /// A world of `n` ranks; give `backends[r]` to the thread that plays rank r. Every wait fails after
    /// `timeout` seconds (default 300).
    #[staticmethod]
    #[pyo3(signature = (n, timeout=None))]
    fn create_world(n: usize, timeout: Option<f64>) -> PyResult<Vec<PyBackend>> {
        if n == 0 {
            return Err(PyValueError::new_err("a world needs at least one rank"));
        }
        let timeout = timeout_from(timeout)?;
        Ok(MockBackend::create_world_with_timeout(n, timeout)
            .into_iter()
            .map(|b| PyBackend { inner: Arc::new(b) })
            .collect())
    }
    /// A world of one rank.
    #[staticmethod]
    #[pyo3(signature = (timeout=None))]
    fn single(timeout: Option<f64>) -> PyResult<PyBackend> {
        Ok(Self::create_world(1, timeout)?.pop().expect("one rank"))
    }
}
