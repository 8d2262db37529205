//! Groups written in Python (MPI's, or a wrapper around a native group) as the synchronizer's
//! [`Averaging`]: each bucket goes through the group's own `all_reduce`.

use std::sync::{Arc, Mutex};

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use super::buckets::entry_view;
use super::group::PyProcessGroup;
use super::op::PyReduceOp;
use crate::error::{Error, Result};
use crate::sync::lock;
use crate::synchronizer::{Averaging, Pending, SharedBucket};

/// A group written in Python (MPI's, or a wrapper around a native one): buckets are averaged through its
/// own `all_reduce`. Its exceptions are kept here, to be raised as they are.
pub(crate) struct PythonGroup {
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
    pub(crate) fn raised(&self, e: Error) -> PyErr {
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
pub(crate) fn averaging(pg: &Bound<'_, PyAny>) -> (Arc<dyn Averaging>, Option<Arc<PythonGroup>>) {
    if let Ok(g) = pg.cast::<PyProcessGroup>() {
        return (g.get().inner.clone(), None);
    }
    let p = Arc::new(PythonGroup { group: pg.clone().unbind(), error: Mutex::new(None) });
    (Arc::new(p.clone()), Some(p))
}
