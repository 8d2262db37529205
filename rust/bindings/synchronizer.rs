//! `GradSyncStrategy` and `GradientSynchronizer` for Python: the engine every DDP averages gradients
//! with (the Python side keeps only the hooks and the `.grad` glue).

use std::sync::{Arc, Mutex, MutexGuard};

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::sync::MutexExt;
use pyo3::types::{PyDict, PyList};

use super::args::{count, dtype_arg};
use super::array::writable;
use super::buckets::entry_view;
use super::python_group::{averaging, PythonGroup};
use crate::error::Error;
use crate::sync::lock;
use crate::synchronizer::{GradSyncStrategy, GradientSynchronizer, StepRecord, DEFAULT_BUCKET_SIZE};

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

/// One step's figures (or the totals: `step` is then the number of steps) as a dict, times in seconds.
fn step_dict<'py>(py: Python<'py>, r: &StepRecord) -> PyResult<Bound<'py, PyDict>> {
    let s = |ns: u64| ns as f64 * 1e-9;
    let d = PyDict::new(py);
    d.set_item("step", r.step)?;
    d.set_item("start_ns", r.start_ns)?;
    d.set_item("compute_s", s(r.compute_ns))?;
    d.set_item("visible_sync_s", s(r.visible_ns))?;
    d.set_item("overlapped_sync_s", s(r.overlapped_ns))?;
    d.set_item("comm_s", s(r.comm_ns))?;
    d.set_item("bytes", r.bytes)?;
    d.set_item("buckets", r.buckets)?;
    Ok(d)
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
    /// The step begins now (its first training forward) unless it already began; without this call a
    /// step begins at its first gradient.
    fn begin_step(&self, py: Python<'_>) {
        state(py, &self.state).sync.begin_step();
    }
    /// Where the steps reduced so far spent their time: {"totals": the sums over every step (its
    /// "step" is the number of steps), "last": the last steps, oldest first}, each with "step",
    /// "start_ns", "compute_s", "visible_sync_s", "overlapped_sync_s", "comm_s", "bytes", "buckets".
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let st = state(py, &self.state);
        let stats = st.sync.stats();
        let d = PyDict::new(py);
        d.set_item("totals", step_dict(py, &stats.totals)?)?;
        let last = stats.last.iter().map(|r| step_dict(py, r)).collect::<PyResult<Vec<_>>>()?;
        d.set_item("last", PyList::new(py, last)?)?;
        Ok(d)
    }
    /// Forget every gradient and bucket.
    fn clear(&self, py: Python<'_>) {
        let mut st = state(py, &self.state);
        let sync = &mut st.sync;
        py.detach(|| sync.clear());
        st.grads.clear();
    }
}
