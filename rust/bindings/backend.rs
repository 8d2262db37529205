//! `Backend` (one rank's handle on a world, ranks global) and `ThreadBackend` (the in-process world)
//! for Python.

use std::sync::Arc;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::args::timeout_from;
use super::collectives::{self as c, Obj, Prepared, Source};
use super::exceptions::abort_on_bad_arguments;
use super::work::run_blocking;
use crate::backend::Backend;
use crate::reduce::Scale;
use crate::transport::thread::ThreadBackend;

/// One rank's handle on a world (or a subgroup's communicator). Its calls block, with the GIL released,
/// until every member arrives. Python reaches every collective through `ProcessGroup` (a group over
/// this world: `ProcessGroup(backend)`); the handle keeps the calls Python code makes on it directly,
/// all_reduce of a bucket's flat buffer and barrier, and the point-to-point ones.
#[pyclass(name = "Backend", module = "axonml_distributed", frozen)]
pub(crate) struct PyBackend {
    pub(crate) inner: Arc<dyn Backend>,
}

impl PyBackend {
    /// Run `call` now (after the work that groups over this communicator queued on its lane); bad
    /// arguments abort the world, as in `ProcessGroup`.
    fn run(&self, py: Python<'_>, call: PyResult<Prepared<'_>>) -> PyResult<()> {
        run_blocking(py, &self.inner, abort_on_bad_arguments(&*self.inner, call)?)
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
    fn all_reduce(&self, py: Python<'_>, buf: &Obj, op: Option<&Obj>) -> PyResult<()> {
        self.run(py, c::all_reduce(buf, op, None, Scale::NONE))
    }
    /// Block until every member arrives.
    fn barrier(&self, py: Python<'_>) -> PyResult<()> {
        self.run(py, Ok(c::barrier()))
    }
    /// Send `buf` to global rank `dst`.
    #[pyo3(signature = (buf, dst, tag=0))]
    fn send(&self, py: Python<'_>, buf: &Obj, dst: usize, tag: u64) -> PyResult<()> {
        self.run(py, c::send(buf, dst, tag))
    }
    /// Receive into `buf` from global rank `src`.
    #[pyo3(signature = (buf, src, tag=0))]
    fn recv(&self, py: Python<'_>, buf: &Obj, src: usize, tag: u64) -> PyResult<()> {
        self.run(py, c::recv(buf, src, tag))
    }
    /// Receive into `buf` the first message with `tag` from any other member; returns its global rank.
    #[pyo3(signature = (buf, tag=0))]
    fn recv_any(&self, py: Python<'_>, buf: &Obj, tag: u64) -> PyResult<usize> {
        let source = Source::default();
        self.run(py, c::recv_any(buf, tag, source.clone()))?;
        // Set by the call that just succeeded.
        Ok(source.get().copied().unwrap_or(usize::MAX))
    }
    /// Abort the whole world: every rank waiting, or arriving later, raises PeerFailureError.
    fn abort(&self, reason: &str) {
        self.inner.abort(reason)
    }
    /// Say that this rank will make no more calls, once what it queued (`async_op=True`) has run:
    /// peers waiting for it then raise PeerFailureError naming it instead of timing out (`spawn` does
    /// this when a rank's function returns).
    fn leave(&self, py: Python<'_>) {
        let inner = &self.inner;
        py.detach(|| inner.leave())
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
#[pyclass(name = "ThreadBackend", module = "axonml_distributed", frozen)]
pub(crate) struct PyThreadBackend;

#[pymethods]
impl PyThreadBackend {
    /// A world of `n` ranks; give `backends[r]` to the thread that plays rank r. Every wait fails after
    /// `timeout` seconds (default 300).
    #[staticmethod]
    #[pyo3(signature = (n, timeout=None))]
    fn create_world(n: usize, timeout: Option<f64>) -> PyResult<Vec<PyBackend>> {
        if n == 0 {
            return Err(PyValueError::new_err("a world needs at least one rank"));
        }
        let timeout = timeout_from(timeout)?;
        Ok(ThreadBackend::create_world_with_timeout(n, timeout)
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
