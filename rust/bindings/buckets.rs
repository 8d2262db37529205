//! `GradientBucket`, `GradSyncStrategy`, `GradientSynchronizer` and `assign_buckets` for Python: the
//! engine every DDP averages gradients with (the Python side keeps only the hooks and `.grad` glue).

use std::sync::{Arc, Mutex, MutexGuard};

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::sync::MutexExt;
use pyo3::types::{PyDict, PyList};

use super::args::{count, dtype_arg};
use super::array::{readable, view, writable};
use super::group::PyProcessGroup;
use super::op::PyReduceOp;
use crate::bucket::{assign_buckets as layout, GradientBucket};
use crate::error::{Error, Result};
use crate::sync::lock;
use crate::synchronizer::{
    Averaging, GradSyncStrategy, GradientSynchronizer, Pending, SharedBucket, DEFAULT_BUCKET_SIZE,
};

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

/// Keeps a bucket's buffer alive: the base object of the numpy views over it.
#[pyclass(name = "BucketMemory", module = "axonml_distributed", frozen)]
pub(crate) struct BucketMemory {
    _bucket: SharedBucket,
}

/// A writable numpy view of `len` elements at element `offset` of `bucket`, shaped `shape`.
fn entry_view<'py>(
    py: Python<'py>,
    bucket: &SharedBucket,
    offset: usize,
    shape: &[usize],
) -> PyResult<Bound<'py, PyAny>> {
    let (dtype, ptr) = {
        let b = lock(bucket);
        let data = b.data();
        // SAFETY: `offset` lies within the bucket's elements (an entry's, or 0).
        (data.dtype(), unsafe { data.as_ptr().add(offset * data.dtype().size()) })
    };
    let owner = Bound::new(py, BucketMemory { _bucket: bucket.clone() })?.into_any();
    // SAFETY: the buffer never moves and lives as long as the bucket, which `owner` (the base) holds.
    unsafe { view(owner, dtype, ptr, shape, true) }
}

/// A group written in Python (MPI's, or a wrapper around a native one): buckets are averaged through its
/// own `all_reduce`. Its exceptions are kept here, to be raised as they are.
struct PythonGroup {
    group: Py<PyAny>,
    error: Mutex<Option<PyErr>>,
}

impl PythonGroup {
    /// Run `f` attached; a Python exception is kept and stands in the core's error as a marker.
    fn call<T>(&self, f: impl FnOnce(Python<'_>, &Bound<'_, PyAny>) -> PyResult<T>) -> Result<T> {
        Python::attach(|py| {
            f(py, self.group.bind(py)).map_err(|e| {
                lock(&self.error).get_or_insert(e);
                Error::Usage("the Python group's collective raised".into())
            })
        })
    }
    /// `e` as the Python exception the group raised, when it did.
    fn raised(&self, e: Error) -> PyErr {
        lock(&self.error).take().unwrap_or_else(|| e.into())
    }
}

fn op<'py>(py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyAny>> {
    py.get_type::<PyReduceOp>().getattr(name)
}

impl Averaging for Arc<PythonGroup> {
    fn start(&self, bucket: &SharedBucket) -> Result<Pending> {
        let work = self.call(|py, g| {
            let len = lock(bucket).size();
            let kw = PyDict::new(py);
            kw.set_item("async_op", true)?;
            let v = entry_view(py, bucket, 0, &[len])?;
            Ok(g.call_method("all_reduce", (v, op(py, "AVERAGE")?), Some(&kw))?.unbind())
        })?;
        let me = self.clone();
        Ok(Box::new(move || me.call(|py, _| work.bind(py).call_method0("wait").map(drop))))
    }
    fn run(&self, bucket: &SharedBucket) -> Result<()> {
        self.call(|py, g| {
            let len = lock(bucket).size();
            let v = entry_view(py, bucket, 0, &[len])?;
            g.call_method1("all_reduce", (v, op(py, "AVERAGE")?)).map(drop)
        })
    }
    fn max_flags(&self, flags: &mut [u8]) -> Result<()> {
        self.call(|py, g| {
            let np = py.import("numpy")?;
            let arr = np.call_method1("array", (PyList::new(py, flags.iter())?, np.getattr("uint8")?))?;
            g.call_method1("all_reduce", (&arr, op(py, "MAX")?))?;
            flags.copy_from_slice(&arr.call_method0("tolist")?.extract::<Vec<u8>>()?);
            Ok(())
        })
    }
}

/// How the synchronizer averages over `pg`: natively, or through the group's Python methods.
fn averaging(pg: &Bound<'_, PyAny>) -> (Arc<dyn Averaging>, Option<Arc<PythonGroup>>) {
    if let Ok(g) = pg.cast::<PyProcessGroup>() {
        return (g.get().inner.clone(), None);
    }
    let p = Arc::new(PythonGroup { group: pg.clone().unbind(), error: Mutex::new(None) });
    (Arc::new(p.clone()), Some(p))
}

struct SyncState {
    sync: GradientSynchronizer,
    /// The arrays added this step, in order: `sync_all` writes the averages back into them.
    grads: Vec<Py<PyAny>>,
    /// The group written in Python the buckets are averaged over, whose exceptions are raised as they are.
    python: Option<Arc<PythonGroup>>,
}

impl SyncState {
    fn raise(&self, e: Error) -> PyErr {
        match &self.python {
            Some(p) => p.raised(e),
            None => e.into(),
        }
    }
}

/// Lock the synchronizer's state without holding the GIL while blocked (its holder may be detached
/// in a collective and need the GIL to return).
fn state<'a>(py: Python<'_>, m: &'a Mutex<SyncState>) -> MutexGuard<'a, SyncState> {
    m.lock_py_attached(py).unwrap_or_else(|e| e.into_inner())
}

/// Buckets gradients and averages them across a group, in place.
#[pyclass(name = "GradientSynchronizer", module = "axonml_distributed", frozen)]
pub(crate) struct PyGradientSynchronizer {
    strategy: PyGradSyncStrategy,
    state: Mutex<SyncState>,
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

/// Group parameters into buckets (positions, in reduction order): `nbytes[i]` and `dtypes[i]` (any
/// values compared with ==) describe parameter i; reverse order, one bucket per dtype at a time, closed
/// before it would pass `cap_bytes`.
#[pyfunction]
pub(crate) fn assign_buckets(
    nbytes: Vec<usize>,
    dtypes: Vec<Bound<'_, PyAny>>,
    cap_bytes: usize,
) -> PyResult<Vec<Vec<usize>>> {
    if nbytes.len() != dtypes.len() {
        return Err(PyValueError::new_err("assign_buckets: one dtype per parameter"));
    }
    // Each dtype as the position of the first equal one: few distinct values, so a scan is cheap.
    let mut keys = Vec::with_capacity(dtypes.len());
    for (i, d) in dtypes.iter().enumerate() {
        let mut key = i;
        for (j, e) in dtypes[..i].iter().enumerate() {
            if e.eq(d)? {
                key = keys[j];
                break;
            }
        }
        keys.push(key);
    }
    Ok(layout(&nbytes, &keys, cap_bytes))
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
        let st = SyncState { sync, grads: Vec::new(), python: None };
        Ok(PyGradientSynchronizer { strategy, state: Mutex::new(st) })
    }
    /// An OVERLAPPED synchronizer over `process_group` for the gradients of `parameters` ((shape, dtype)
    /// pairs, in the owner's order), in buckets of at most `bucket_cap_bytes` (see `assign_buckets`)
    /// laid out now, in the group's shared memory when it has some. Each gradient has a view into its
    /// bucket (`views()`); `ready(i)` says gradient i is in it, `finish` ends the reduction.
    #[staticmethod]
    fn for_parameters(
        py: Python<'_>,
        process_group: &Bound<'_, PyAny>,
        parameters: Vec<(Vec<usize>, Bound<'_, PyAny>)>,
        bucket_cap_bytes: usize,
    ) -> PyResult<Self> {
        let params =
            parameters.iter().map(|(s, d)| Ok((dtype_arg(d)?, s.clone()))).collect::<PyResult<Vec<_>>>()?;
        let (group, python) = averaging(process_group);
        let sync = py.detach(|| GradientSynchronizer::for_parameters(group, &params, bucket_cap_bytes))?;
        let st = SyncState { sync, grads: Vec::new(), python };
        Ok(PyGradientSynchronizer { strategy: PyGradSyncStrategy::Overlapped, state: Mutex::new(st) })
    }
    /// The strategy.
    fn strategy(&self) -> PyGradSyncStrategy {
        self.strategy
    }
    /// Elements per bucket (bytes, for buckets laid out by `for_parameters`).
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
    /// The gradients of each bucket, as positions in the parameters given, in reduction order.
    fn bucket_assignment(&self, py: Python<'_>) -> Vec<Vec<usize>> {
        state(py, &self.state).sync.assignment()
    }
    /// True when every bucket lives in memory the group's members share (no staging copies).
    fn in_shared_memory(&self, py: Python<'_>) -> bool {
        let st = state(py, &self.state);
        (0..st.sync.num_buckets()).all(|i| st.sync.bucket(i).is_some_and(|b| lock(b).is_shared()))
    }
    /// One writable numpy view per gradient, shaped as its parameter, into its bucket.
    fn views<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyAny>>> {
        let st = state(py, &self.state);
        (0..st.sync.len())
            .map(|i| {
                let (b, e) = st.sync.bucket_of(i)?;
                entry_view(py, st.sync.bucket(b).expect("its bucket"), e.offset, &e.shape)
            })
            .collect()
    }
    /// Gradient `i` is in its view: every bucket now complete starts its all-reduce, in bucket order
    /// (the last one waits for `finish`).
    fn ready(&self, py: Python<'_>, i: usize) -> PyResult<()> {
        let mut st = state(py, &self.state);
        let r = st.sync.ready(i);
        r.map_err(|e| st.raise(e))
    }
    /// Whether gradient `i` is in for the reduction under way.
    fn is_ready(&self, py: Python<'_>, i: usize) -> PyResult<bool> {
        Ok(state(py, &self.state).sync.is_ready(i)?)
    }
    /// Whether a reduction has started (some gradient is in) and not finished.
    fn in_flight(&self, py: Python<'_>) -> bool {
        state(py, &self.state).sync.in_flight()
    }
    /// The gradients not in yet, in order.
    fn waiting(&self, py: Python<'_>) -> Vec<usize> {
        state(py, &self.state).sync.waiting()
    }
    /// End the reduction: a gradient neither in nor `used[i]` counts as zeros; with `exchange`, the
    /// ranks agree on which gradients some rank used (returned; else None); the buckets left are reduced
    /// and every bucket waited for (the GIL released). Every gradient is out again afterwards.
    fn finish(&self, py: Python<'_>, used: Vec<bool>, exchange: bool) -> PyResult<Option<Vec<bool>>> {
        let mut st = state(py, &self.state);
        let sync = &mut st.sync;
        let r = py.detach(|| sync.finish(&used, exchange));
        r.map_err(|e| st.raise(e))
    }
    /// Start a step of `num_params` gradients. With a `process_group`, OVERLAPPED buckets start reducing
    /// as soon as they are complete.
    #[pyo3(signature = (num_params, process_group=None))]
    fn prepare(&self, py: Python<'_>, num_params: usize, process_group: Option<&Bound<'_, PyAny>>) {
        let mut st = state(py, &self.state);
        let (group, python) = process_group.map(averaging).unzip();
        let sync = &mut st.sync;
        // Waits for last step's background buckets, whose jobs need the GIL to finish.
        py.detach(|| sync.prepare(num_params, group));
        st.python = python.flatten();
        st.grads.clear();
    }
    /// Add `grad` to bucket `bucket_idx` (buckets fill in index order). `sync_all` writes the average
    /// back into this same array.
    fn add_gradient(&self, py: Python<'_>, bucket_idx: usize, grad: &Bound<'_, PyAny>) -> PyResult<()> {
        let a = writable(grad, "grad")?;
        let mut st = state(py, &self.state);
        let sync = &mut st.sync;
        // SAFETY: the borrow guard in `a` lives across the copy.
        let r = py.detach(|| sync.add_gradient(bucket_idx, unsafe { a.raw.buf() }, &a.shape));
        drop(a);
        r.map_err(|e| st.raise(e))?;
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
        if self.strategy != PyGradSyncStrategy::NoSync {
            let (group, python) = averaging(&pg);
            st.python = python;
            let sync = &mut st.sync;
            let r = py.detach(|| sync.sync_all(group));
            r.map_err(|e| st.raise(e))?;
            let grads = std::mem::take(&mut st.grads);
            for (i, g) in grads.iter().enumerate() {
                let a = writable(g.bind(py), "grad")?;
                // SAFETY: the borrow guard in `a` lives across the copy.
                st.sync.averaged(i, unsafe { a.raw.buf_mut() })?;
            }
        }
        let sync = &mut st.sync;
        py.detach(|| sync.clear());
        st.grads.clear();
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
