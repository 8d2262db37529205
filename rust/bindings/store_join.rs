//! `ShmSegment`: the shared-memory world joined through a key-value store the job already has (the
//! torch backend's rendezvous; see `transport::shm::store_join`).

use std::sync::{Arc, Mutex};

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::backend::{timeout_from, PyBackend};
use crate::transport::shm::{SegmentToken, ShmBackend, DEFAULT_ARENA};

/// A segment rank 0 created, until every rank has joined it. `token` is what the others need;
/// `close()` (or garbage collection) removes its name, which the join does anyway once everyone is in.
#[pyclass(name = "ShmSegment", module = "axonml_distributed", frozen)]
pub(crate) struct PyShmSegment {
    token: String,
    segment: Mutex<Option<SegmentToken>>,
}

#[pymethods]
impl PyShmSegment {
    /// Create a segment for `world_size` ranks with `arena_bytes` of segment arrays per rank.
    #[new]
    #[pyo3(signature = (world_size, arena_bytes=None))]
    fn new(py: Python<'_>, world_size: usize, arena_bytes: Option<usize>) -> PyResult<Self> {
        let seg = py.detach(|| SegmentToken::create(world_size, arena_bytes.unwrap_or(DEFAULT_ARENA)))?;
        Ok(PyShmSegment { token: seg.token(), segment: Mutex::new(Some(seg)) })
    }
    /// The segment's name, session nonce and world size, for the store.
    #[getter]
    fn token(&self) -> String {
        self.token.clone()
    }
    /// Remove the segment's name now (ranks that attached keep it).
    fn close(&self) {
        drop(self.segment.lock().unwrap_or_else(|e| e.into_inner()).take());
    }
    /// Join as `rank` of `world_size` with rank 0's `token`; blocks, with the GIL released, until every
    /// rank has joined (or `timeout` seconds, default 300, pass, or a rank that joined dies).
    #[staticmethod]
    #[pyo3(signature = (token, rank, world_size, timeout=None))]
    fn join(
        py: Python<'_>,
        token: String,
        rank: usize,
        world_size: usize,
        timeout: Option<f64>,
    ) -> PyResult<PyBackend> {
        if token.len() > 512 {
            return Err(PyValueError::new_err("the shared-memory token is too long to be one"));
        }
        let timeout = timeout_from(timeout)?;
        let b = py.detach(move || ShmBackend::join_token(&token, rank, world_size, timeout))?;
        Ok(PyBackend { inner: Arc::new(b) })
    }
}
