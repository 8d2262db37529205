//! The shared-memory world for Python: `ShmBackend.connect(...)`, and numpy arrays over segment memory
//! for `ProcessGroup.empty`.

use std::sync::Arc;

use half::f16;
use numpy::ndarray::{ArrayViewMut, IxDyn};
use numpy::{PyArray, PyArrayDescr, PyArrayDescrMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::backend::{timeout_from, PyBackend};
use crate::backend::{Backend, SharedMem};
use crate::dtype::DType;
use crate::transport::shm::{JobSecret, ShmBackend, ShmOptions, DEFAULT_ARENA};

/// Joins the multi-process world on this host, through a shared-memory segment.
#[pyclass(name = "ShmBackend", module = "axonml_distributed", frozen)]
pub(crate) struct PyShmBackend;

#[pymethods]
impl PyShmBackend {
    /// Join as `rank` of `world_size` processes: rank 0 listens on `master_addr:master_port` and
    /// creates the segment, the others connect (retrying until `timeout`). `job_id` (the launcher's
    /// AXONML_JOB_ID) names the segment so the launcher can remove it after a crash; `arena_bytes`
    /// is the room per rank for `ProcessGroup.empty` arrays (rank 0's value counts). `secret` (the
    /// launcher's AXONML_JOB_SECRET, at least 16 bytes) is what every rank must prove it knows to join;
    /// without it rank 0 admits any process of its own user. Blocks, with the GIL released, until every
    /// rank has joined.
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
        let secret = secret.map(JobSecret::new).transpose()?;
        let opts = ShmOptions {
            rank,
            world_size,
            master_addr,
            master_port,
            timeout: timeout_from(timeout)?,
            job_id,
            arena_bytes: arena_bytes.unwrap_or(DEFAULT_ARENA),
            chunk_bytes: crate::config::shm_chunk_from_env(),
            secret,
        };
        let b = py.detach(move || ShmBackend::connect(opts))?;
        Ok(PyBackend { inner: Arc::new(b) })
    }
}

/// Keeps a segment allocation (and the segment's mapping) alive: the base object of arrays from
/// `ProcessGroup.empty`.
#[pyclass(name = "SegmentMemory", module = "axonml_distributed", frozen)]
pub(crate) struct SegmentMemory {
    _mem: SharedMem,
}

/// The collective dtype of a numpy dtype (numpy has no bfloat16, so never that one).
fn dtype_of(descr: &Bound<'_, PyArrayDescr>) -> Option<DType> {
    let py = descr.py();
    DType::ALL.into_iter().find(|d| {
        let want = match d {
            DType::BF16 => return false,
            DType::Bool => numpy::dtype::<bool>(py),
            DType::F16 => numpy::dtype::<f16>(py),
            DType::F32 => numpy::dtype::<f32>(py),
            DType::F64 => numpy::dtype::<f64>(py),
            DType::I8 => numpy::dtype::<i8>(py),
            DType::U8 => numpy::dtype::<u8>(py),
            DType::I32 => numpy::dtype::<i32>(py),
            DType::I64 => numpy::dtype::<i64>(py),
        };
        descr.is_equiv_to(&want)
    })
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
    let py = descr.py();
    let owner = Bound::new(py, SegmentMemory { _mem: mem })?.into_any();
    macro_rules! view {
        ($t:ty) => {{
            // SAFETY: `ptr` holds `bytes` = product(shape) * size_of::<$t>() bytes, 64-byte aligned, owned
            // by `owner` alone, which the array keeps as its base (so the memory outlives the array).
            let v = unsafe { ArrayViewMut::from_shape_ptr(IxDyn(shape), ptr.cast::<$t>()) };
            // SAFETY: as above.
            unsafe { PyArray::<$t, IxDyn>::borrow_from_array(&v, owner) }.into_any()
        }};
    }
    Ok(Some(match dtype {
        DType::F16 => view!(f16),
        DType::F32 => view!(f32),
        DType::F64 => view!(f64),
        DType::I8 => view!(i8),
        DType::U8 => view!(u8),
        DType::I32 => view!(i32),
        DType::I64 => view!(i64),
        DType::Bool => view!(bool),
        DType::BF16 => return Ok(None),
    }))
}
