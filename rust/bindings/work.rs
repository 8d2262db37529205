//! `Work` for Python: the handle of an asynchronous collective.

use pyo3::prelude::*;

use crate::work::Work;

/// The handle of an asynchronous collective.
#[pyclass(name = "Work", module = "axonml_distributed", frozen)]
pub(crate) struct PyWork {
    pub(crate) work: Work,
    pub(crate) result: Option<Py<PyAny>>,
}

#[pymethods]
impl PyWork {
    /// Block (GIL released) until the collective finished; re-raise its error, or return its result
    /// (None for in-place collectives, the new array for the `*_tensor` ones).
    fn wait(&self, py: Python<'_>) -> PyResult<Option<Py<PyAny>>> {
        let w = self.work.clone();
        py.detach(|| w.wait())?;
        Ok(self.result.as_ref().map(|r| r.clone_ref(py)))
    }
    /// True once the collective has finished (successfully or not).
    fn is_completed(&self) -> bool {
        self.work.is_completed()
    }
}
