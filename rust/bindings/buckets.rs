//! `GradientBucket`, `GradSyncStrategy` and `GradientSynchronizer` for Python.

use std::sync::{Arc, Mutex, MutexGuard};

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::sync::MutexExt;
use pyo3::types::PyList;

use super::args::count;
use super::array::{readable, view, writable};
use super::group::PyProcessGroup;
use super::op::PyReduceOp;
use crate::bucket::GradientBucket;
use crate::reduce::ReduceOp;
use crate::sync::lock;
use crate::synchronizer::{GradSyncStrategy, GradientSynchronizer, DEFAULT_BUCKET_SIZE};

/// Lock the synchronizer's state without holding the GIL while blocked (its holder may be detached
/// in a collective and need the GIL to return).
fn state<'a>(py: Python<'_>, m: &'a Mutex<SyncState>) -> MutexGuard<'a, SyncState> {
    m.lock_py_attached(py).unwrap_or_else(|e| e.into_inner())
}

/// A numpy view of the used part of a bucket's flat buffer.
fn bucket_view<'py>(
    owner: Bound<'py, PyAny>,
    b: &GradientBucket,
    writable: bool,
) -> PyResult<Bound<'py, PyAny>> {
    let data = b.data();
    // SAFETY: the buffer is allocated once and never moves while the bucket (the view's base) lives.
    unsafe { view(owner, data.dtype(), data.as_ptr(), &[data.len()], writable) }
}

/// A fixed-capacity flat buffer of gradients of one dtype; `data_mut()` is a zero-copy view of it.
#[pyclass(name = "GradientBucket", module = "axonml_distributed", frozen)]
pub(crate) struct PyGradientBucket {
    inner: Mutex<GradientBucket>,
}

#[pymethods]
impl PyGradientBucket {
    /// A bucket for up to `capacity` elements.
    #[new]
    fn new(capacity: &Bound<'_, PyAny>) -> PyResult<Self> {
        Ok(PyGradientBucket { inner: Mutex::new(GradientBucket::new(count(capacity, "capacity")?)) })
    }
    /// Copy `grad` in; False (nothing added) when it does not fit. Mixing dtypes is a ValueError.
    fn add(&self, grad: &Bound<'_, PyAny>) -> PyResult<bool> {
        let a = readable(grad, "grad")?;
        // SAFETY: the borrow guard in `a` lives across the copy.
        Ok(lock(&self.inner).add_buf(unsafe { a.raw.buf() }, &a.shape)?)
    }
    /// True when not one more element fits.
    fn is_full(&self) -> bool {
        lock(&self.inner).is_full()
    }
    /// True when no gradient is in the bucket.
    fn is_empty(&self) -> bool {
        lock(&self.inner).is_empty()
    }
    /// Elements in use.
    fn size(&self) -> usize {
        lock(&self.inner).size()
    }
    /// Capacity in elements.
    fn capacity(&self) -> usize {
        lock(&self.inner).capacity()
    }
    /// A read-only view of the used part of the flat buffer.
    fn data<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        let b = lock(&slf.get().inner);
        bucket_view(slf.clone().into_any(), &b, false)
    }
    /// A writable view of the used part of the flat buffer (zero-copy: reduce it in place).
    fn data_mut<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        let b = lock(&slf.get().inner);
        bucket_view(slf.clone().into_any(), &b, true)
    }
    /// The gradients, as new arrays with their original shapes and dtype, in the order added.
    fn extract<'py>(slf: &Bound<'py, Self>) -> PyResult<Vec<Bound<'py, PyAny>>> {
        let flat = Self::data(slf)?;
        let b = lock(&slf.get().inner);
        b.entries()
            .iter()
            .map(|e| {
                let part = flat.get_item(pyo3::types::PySlice::new(
                    slf.py(),
                    e.offset as isize,
                    (e.offset + e.len()) as isize,
                    1,
                ))?;
                part.call_method1("reshape", (e.shape.clone(),))?.call_method0("copy")
            })
            .collect()
    }
    /// Forget every gradient (views stay valid; the dtype stays).
    fn clear(&self) {
        lock(&self.inner).clear()
    }
}

/// When a `GradientSynchronizer` reduces its buckets.
#[pyclass(name = "GradSyncStrategy", module = "axonml_distributed", eq, eq_int, hash, frozen, from_py_object)]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum PyGradSyncStrategy {
    /// Every bucket is reduced inside `sync_all`.
    #[pyo3(name = "SYNCHRONOUS")]
    Synchronous,
    /// A bucket is reduced in the background as soon as it is complete.
    #[pyo3(name = "OVERLAPPED")]
    Overlapped,
    /// Nothing is reduced (local accumulation).
    #[pyo3(name = "NO_SYNC")]
    NoSync,
}

impl From<PyGradSyncStrategy> for GradSyncStrategy {
    fn from(s: PyGradSyncStrategy) -> Self {
        match s {
            PyGradSyncStrategy::Synchronous => GradSyncStrategy::Synchronous,
            PyGradSyncStrategy::Overlapped => GradSyncStrategy::Overlapped,
            PyGradSyncStrategy::NoSync => GradSyncStrategy::NoSync,
        }
    }
}

struct SyncState {
    sync: GradientSynchronizer,
    /// The arrays added this step, in order: `sync_all` writes the averages back into them.
    grads: Vec<Py<PyAny>>,
}

/// Buckets gradients and averages them across a group, in place.
#[pyclass(name = "GradientSynchronizer", module = "axonml_distributed", frozen)]
pub(crate) struct PyGradientSynchronizer {
    strategy: PyGradSyncStrategy,
    state: Mutex<SyncState>,
}

/// A native group, or None for groups implemented in Python (e.g. MPI).
fn native(pg: &Bound<'_, PyAny>) -> Option<Arc<crate::group::ProcessGroup>> {
    pg.cast::<PyProcessGroup>().ok().map(|g| g.get().inner.clone())
}

/// Where `sync_all()` without a group finds one: the Python package's `get_default_group`, handed
/// down on import (the native module never imports the package).
static DEFAULT_GROUP: Mutex<Option<Py<PyAny>>> = Mutex::new(None);

/// Make `get_default_group` (a callable returning the calling thread's default group) what
/// `GradientSynchronizer.sync_all()` uses when given no group. The package calls it on import.
#[pyfunction]
pub(crate) fn set_default_group_source(get_default_group: Py<PyAny>) {
    *lock(&DEFAULT_GROUP) = Some(get_default_group);
}

fn default_group(py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
    let source = lock(&DEFAULT_GROUP).as_ref().map(|s| s.clone_ref(py)).ok_or_else(|| {
        PyValueError::new_err("sync_all: pass a process group (no default group source is set)")
    })?;
    source.into_bound(py).call0()
}

#[pymethods]
impl PyGradientSynchronizer {
    /// A synchronizer whose buckets hold `bucket_size` elements (default 25M).
    #[new]
    #[pyo3(signature = (strategy=PyGradSyncStrategy::Synchronous, bucket_size=None))]
    fn new(strategy: PyGradSyncStrategy, bucket_size: Option<&Bound<'_, PyAny>>) -> PyResult<Self> {
        let bucket_size = bucket_size.map_or(Ok(DEFAULT_BUCKET_SIZE), |n| count(n, "bucket_size"))?;
        if bucket_size == 0 {
            return Err(PyValueError::new_err("bucket_size must be at least 1 element"));
        }
        let sync = GradientSynchronizer::new(strategy.into(), bucket_size);
        Ok(PyGradientSynchronizer { strategy, state: Mutex::new(SyncState { sync, grads: Vec::new() }) })
    }
    /// The strategy.
    fn strategy(&self) -> PyGradSyncStrategy {
        self.strategy
    }
    /// Elements per bucket.
    fn bucket_size(&self, py: Python<'_>) -> usize {
        state(py, &self.state).sync.bucket_size()
    }
    /// Buckets used this step.
    fn num_buckets(&self, py: Python<'_>) -> usize {
        state(py, &self.state).sync.num_buckets()
    }
    /// Buckets whose all-reduce already started in the background this step (OVERLAPPED).
    fn launched_buckets(&self, py: Python<'_>) -> usize {
        state(py, &self.state).sync.launched()
    }
    /// Start a step of `num_params` gradients. With a native `process_group`, OVERLAPPED buckets start
    /// reducing as soon as they are complete.
    #[pyo3(signature = (num_params, process_group=None))]
    fn prepare(&self, py: Python<'_>, num_params: usize, process_group: Option<&Bound<'_, PyAny>>) {
        let mut st = state(py, &self.state);
        let group = process_group.and_then(native);
        let sync = &mut st.sync;
        // Waits for last step's background buckets, whose jobs need the GIL to finish.
        py.detach(|| sync.prepare(num_params, group));
        st.grads.clear();
    }
    /// Add `grad` to bucket `bucket_idx` (buckets fill in index order). `sync_all` writes the average
    /// back into this same array.
    fn add_gradient(&self, py: Python<'_>, bucket_idx: usize, grad: &Bound<'_, PyAny>) -> PyResult<()> {
        let a = writable(grad, "grad")?;
        let mut st = state(py, &self.state);
        let sync = &mut st.sync;
        // SAFETY: the borrow guard in `a` lives across the copy.
        py.detach(|| sync.add_gradient(bucket_idx, unsafe { a.raw.buf() }, &a.shape))?;
        st.grads.push(grad.clone().unbind());
        Ok(())
    }
    /// Average every bucket across `process_group` (default: the default group) and write the results
    /// into the added gradients, in place; then start a new step. NO_SYNC leaves the gradients alone.
    #[pyo3(signature = (process_group=None))]
    fn sync_all(&self, py: Python<'_>, process_group: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        let pg = match process_group {
            Some(pg) => pg.clone(),
            None => default_group(py)?,
        };
        let mut st = state(py, &self.state);
        if self.strategy == PyGradSyncStrategy::NoSync {
            let sync = &mut st.sync;
            py.detach(|| sync.clear());
            st.grads.clear();
            return Ok(());
        }
        match native(&pg) {
            Some(group) => {
                let sync = &mut st.sync;
                py.detach(|| sync.sync_all(&group))?
            }
            None => {
                // A group implemented in Python: reduce each bucket through its own all_reduce.
                let op = Py::new(py, PyReduceOp(ReduceOp::Average))?;
                for i in 0..st.sync.num_buckets() {
                    let bucket = st.sync.bucket(i).expect("in range").clone();
                    let b = lock(&bucket);
                    let holder = PyList::empty(py).into_any();
                    let data = b.data();
                    // SAFETY: `b` stays locked (the buffer unmoved) until the view is dropped below.
                    let v = unsafe { view(holder, data.dtype(), data.as_ptr(), &[data.len()], true)? };
                    pg.call_method1("all_reduce", (&v, &op))?;
                }
            }
        }
        let grads = std::mem::take(&mut st.grads);
        for (i, g) in grads.iter().enumerate() {
            let a = writable(g.bind(py), "grad")?;
            // SAFETY: the borrow guard in `a` lives across the copy.
            st.sync.averaged(i, unsafe { a.raw.buf_mut() })?;
        }
        let sync = &mut st.sync;
        py.detach(|| sync.clear());
        Ok(())
    }
    /// Forget every gradient and bucket.
    fn clear(&self, py: Python<'_>) {
        let mut st = state(py, &self.state);
        let sync = &mut st.sync;
        py.detach(|| sync.clear());
        st.grads.clear();
    }
}
