//! `ReduceOp`, `Backend` and `MockBackend` for Python: the seed's method style, ranks global.

use std::sync::Arc;
use std::time::Duration;

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyString;

use super::array::{readable, writable};
use super::exceptions::abort_on_bad_arguments;
use crate::backend::Backend;
use crate::reduce::ReduceOp;
use crate::transport::thread::{MockBackend, DEFAULT_TIMEOUT};

/// How values from the ranks are combined.
#[pyclass(name = "ReduceOp", module = "axonml_distributed", eq, eq_int, hash, frozen, from_py_object)]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum PyReduceOp {
    /// Elementwise sum.
    #[pyo3(name = "SUM")]
    Sum,
    /// Elementwise product.
    #[pyo3(name = "PRODUCT")]
    Product,
    /// Elementwise minimum (NaN propagates).
    #[pyo3(name = "MIN")]
    Min,
    /// Elementwise maximum (NaN propagates).
    #[pyo3(name = "MAX")]
    Max,
    /// Sum divided by the number of ranks (floating-point dtypes only).
    #[pyo3(name = "AVERAGE")]
    Average,
}

impl From<PyReduceOp> for ReduceOp {
    fn from(op: PyReduceOp) -> ReduceOp {
        match op {
            PyReduceOp::Sum => ReduceOp::Sum,
            PyReduceOp::Product => ReduceOp::Product,
            PyReduceOp::Min => ReduceOp::Min,
            PyReduceOp::Max => ReduceOp::Max,
            PyReduceOp::Average => ReduceOp::Average,
        }
    }
}

/// A `ReduceOp`, or its name in any case ("sum", "AVERAGE"); `None` means SUM.
pub(crate) fn parse_op(op: Option<&Bound<'_, PyAny>>) -> PyResult<ReduceOp> {
    let Some(op) = op else {
        return Ok(ReduceOp::Sum);
    };
    if let Ok(op) = op.extract::<PyReduceOp>() {
        return Ok(op.into());
    }
    if let Ok(s) = op.cast::<PyString>() {
        let name = s.to_str()?.to_ascii_uppercase();
        return ReduceOp::ALL
            .into_iter()
            .find(|o| o.name() == name || (name == "MEAN" && *o == ReduceOp::Average))
            .ok_or_else(|| {
                PyValueError::new_err(format!("unknown reduce op {name:?}; use a ReduceOp member"))
            });
    }
    Err(PyTypeError::new_err("op must be a ReduceOp (or its name)"))
}

/// Seconds (float or None) to a timeout.
pub(crate) fn timeout_from(seconds: Option<f64>) -> PyResult<Duration> {
    match seconds {
        None => Ok(DEFAULT_TIMEOUT),
        Some(s) if s.is_finite() && s > 0.0 => Ok(Duration::from_secs_f64(s)),
        Some(s) => {
            Err(PyValueError::new_err(format!("timeout must be a positive number of seconds, got {s}")))
        }
    }
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
        let b = self.inner.clone();
        // SAFETY (every detached closure here): the borrow guard in `a` outlives the call.
        Ok(py.detach(|| b.all_reduce(unsafe { a.raw.buf_mut() }, op))?)
    }
    /// Copy global rank `src`'s `buf` into every member's `buf`.
    fn broadcast(&self, py: Python<'_>, buf: &Bound<'_, PyAny>, src: usize) -> PyResult<()> {
        let a = self.checked(writable(buf, "buf"))?;
        let b = self.inner.clone();
        Ok(py.detach(|| b.broadcast(unsafe { a.raw.buf_mut() }, src))?)
    }
    /// Concatenate every member's `send` into `recv`.
    fn all_gather(&self, py: Python<'_>, send: &Bound<'_, PyAny>, recv: &Bound<'_, PyAny>) -> PyResult<()> {
        let (s, r) = self.checked(readable(send, "send").and_then(|s| Ok((s, writable(recv, "recv")?))))?;
        let b = self.inner.clone();
        Ok(py.detach(|| b.all_gather(unsafe { s.raw.buf() }, unsafe { r.raw.buf_mut() }))?)
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
        let b = self.inner.clone();
        Ok(py.detach(|| b.reduce_scatter(unsafe { s.raw.buf() }, unsafe { r.raw.buf_mut() }, op))?)
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
        let raw = r.as_ref().map(|r| r.raw);
        let b = self.inner.clone();
        Ok(py.detach(|| b.gather(unsafe { s.raw.buf() }, raw.map(|r| unsafe { r.buf_mut() }), dst))?)
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
        let raw = s.as_ref().map(|s| s.raw);
        let r = self.checked(writable(recv, "recv"))?;
        let b = self.inner.clone();
        Ok(py.detach(|| b.scatter(raw.map(|s| unsafe { s.buf() }), unsafe { r.raw.buf_mut() }, src))?)
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
        let b = self.inner.clone();
        Ok(py.detach(|| b.reduce(unsafe { a.raw.buf_mut() }, dst, op))?)
    }
    /// Block until every member arrives.
    fn barrier(&self, py: Python<'_>) -> PyResult<()> {
        let b = self.inner.clone();
        Ok(py.detach(|| b.barrier())?)
    }
    /// Send `buf` to global rank `dst`.
    #[pyo3(signature = (buf, dst, tag=0))]
    fn send(&self, py: Python<'_>, buf: &Bound<'_, PyAny>, dst: usize, tag: u64) -> PyResult<()> {
        let a = self.checked(readable(buf, "buf"))?;
        let b = self.inner.clone();
        Ok(py.detach(|| b.send(unsafe { a.raw.buf() }, dst, tag))?)
    }
    /// Receive into `buf` from global rank `src`.
    #[pyo3(signature = (buf, src, tag=0))]
    fn recv(&self, py: Python<'_>, buf: &Bound<'_, PyAny>, src: usize, tag: u64) -> PyResult<()> {
        let a = self.checked(writable(buf, "buf"))?;
        let b = self.inner.clone();
        Ok(py.detach(|| b.recv(unsafe { a.raw.buf_mut() }, src, tag))?)
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
