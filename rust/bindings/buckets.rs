//! `GradientBucket`, the numpy views over a bucket's buffer, and `assign_buckets`, for Python.

use std::sync::Mutex;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::args::count;
use super::array::{readable, view};
use crate::bucket::{assign_buckets as layout, GradientBucket};
use crate::sync::lock;
use crate::synchronizer::SharedBucket;

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

/// Keeps a bucket's buffer alive: the base object of the numpy views over it.
#[pyclass(name = "BucketMemory", module = "axonml_distributed", frozen)]
pub(crate) struct BucketMemory {
    _bucket: SharedBucket,
}

/// A writable numpy view of `len` elements at element `offset` of `bucket`, shaped `shape`.
pub(crate) fn entry_view<'py>(
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
