//! The shared-memory world for Python: `ShmBackend.connect(...)` (through rank 0's TCP store),
//! `ShmBackend.join(store, ...)` (through a key-value store the job already has: the torch backend's
//! rendezvous), and numpy arrays over segment memory for `ProcessGroup.empty`.

use std::sync::Arc;

use numpy::PyArrayDescr;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::args::timeout_from;
use super::array::{dtype_of, view};
use super::backend::PyBackend;
use super::rendezvous::PyStore;
use crate::backend::{Backend, SharedMem};
use crate::dtype::DType;
use crate::transport::shm::{JobSecret, ShmBackend, ShmOptions, DEFAULT_ARENA};

/// Joins the multi-process world on this host, through a shared-memory segment.
#[pyclass(name = "ShmBackend", module = "axonml_distributed", frozen)]
pub(crate) struct PyShmBackend;

#[pymethods]
impl PyShmBackend {
    /// Join as `rank` of `world_size` processes: rank 0 hosts the rendezvous store on
    /// `master_addr:master_port` and creates the segment, the others connect (retrying until
    /// `timeout`). `job_id` (the launcher's AXONML_JOB_ID) names the segment so the launcher can remove
    /// it after a crash; `arena_bytes` is the room per rank for `ProcessGroup.empty` arrays (rank 0's
    /// value counts). `secret` (AXONML_JOB_SECRET, at least 16 bytes) is what every rank must prove it
    /// knows to join; without it rank 0's store admits any process of its own user. Blocks, with the
    /// GIL released, until every rank has joined.
    #[staticmethod]
    #[pyo3(signature = (rank, world_size, master_addr, master_port, timeout=None, job_id=None, arena_bytes=None, secret=None))]
    #[allow(clippy::too_many_arguments)]
    fn connect(
        py: Python<'_>,
        rank: usize,
        world_size: usize,
        master_addr: String,
        master_port: u16,
        timeout: Option<f64>,
        job_id: Option<String>,
        arena_bytes: Option<usize>,
        secret: Option<Vec<u8>>,
    ) -> PyResult<PyBackend> {
        let opts = options(rank, world_size, master_addr, master_port, timeout, job_id, arena_bytes, secret)?;
        let b = py.detach(move || ShmBackend::connect(opts))?;
        Ok(PyBackend { inner: Arc::new(b) })
    }

    /// Join as `rank` of `world_size` processes through `store`, the job's own key-value store (an
    /// object with torch's `Store` methods: set, get, check, wait, add, delete_key); the other arguments
    /// as `connect`'s. Blocks, with the GIL released but for the store's calls, until every rank has
    /// joined.
    #[staticmethod]
    #[pyo3(signature = (store, rank, world_size, timeout=None, job_id=None, arena_bytes=None, secret=None))]
    #[allow(clippy::too_many_arguments)]
    fn join(
        py: Python<'_>,
        store: &Bound<'_, PyAny>,
        rank: usize,
        world_size: usize,
        timeout: Option<f64>,
        job_id: Option<String>,
        arena_bytes: Option<usize>,
        secret: Option<Vec<u8>>,
    ) -> PyResult<PyBackend> {
        // Every argument is checked before the store is touched.
        let opts = options(rank, world_size, String::new(), 0, timeout, job_id, arena_bytes, secret)?;
        let store = PyStore::new(store)?;
        let b = py.detach(move || ShmBackend::join(&store, opts))?;
        Ok(PyBackend { inner: Arc::new(b) })
    }
}

#[allow(clippy::too_many_arguments)]
fn options(
    rank: usize,
    world_size: usize,
    master_addr: String,
    master_port: u16,
    timeout: Option<f64>,
    job_id: Option<String>,
    arena_bytes: Option<usize>,
    secret: Option<Vec<u8>>,
) -> PyResult<ShmOptions> {
    Ok(ShmOptions {
        rank,
        world_size,
        master_addr,
        master_port,
        timeout: timeout_from(timeout)?,
        job_id,
        arena_bytes: arena_bytes.unwrap_or(DEFAULT_ARENA),
        chunk_bytes: crate::config::shm_chunk_from_env(),
        secret: secret.map(JobSecret::new).transpose()?,
    })
}

/// Keeps a segment allocation (and the segment's mapping) alive: the base object of arrays from
/// `ProcessGroup.empty`.
#[pyclass(name = "SegmentMemory", module = "axonml_distributed", frozen)]
pub(crate) struct SegmentMemory {
    _mem: SharedMem,
}

/// A numpy array of `shape` and `descr` in memory `backend` shares with its peers, or `None` when the
/// backend has none (or none left, or the dtype is not one collectives take): the caller falls back to
/// private memory.
pub(crate) fn segment_array<'py>(
    backend: &Arc<dyn Backend>,
    shape: &[usize],
    descr: &Bound<'py, PyArrayDescr>,
) -> PyResult<Option<Bound<'py, PyAny>>> {
    let Some(dtype) = dtype_of(descr) else {
        return Ok(None);
    };
    let bytes = shape
        .iter()
        .try_fold(dtype.size(), |a, &d| a.checked_mul(d))
        .ok_or_else(|| PyValueError::new_err(format!("shape {shape:?} is too large")))?;
    if bytes == 0 {
        return Ok(None);
    }
    let Some(mem) = backend.alloc(bytes)? else {
        return Ok(None);
    };
    let ptr = mem.as_ptr();
    let owner = Bound::new(descr.py(), SegmentMemory { _mem: mem })?.into_any();
    // SAFETY: `ptr` holds `bytes` = product(shape) * dtype.size() bytes, 64-byte aligned, owned by
    // `owner` alone, which the array keeps as its base (so the memory outlives the array).
    let arr = unsafe { view(owner, dtype, ptr, shape, true) }?;
    // bfloat16's bits are int16 (see `array`): the caller asked for ml_dtypes' type.
    if dtype == DType::BF16 {
        return arr.call_method1("view", (descr,)).map(Some);
    }
    Ok(Some(arr))
}
