//! `World` for Python.

use std::sync::Arc;

use pyo3::prelude::*;

use super::args::timeout_arg;
use super::backend::PyBackend;
use super::group::PyProcessGroup;
use crate::group::World;

/// The world: the default group over every rank, and the factory of subgroups.
#[pyclass(name = "World", module = "axonml_distributed", frozen)]
pub(crate) struct PyWorld {
    inner: World,
}

#[pymethods]
impl PyWorld {
    /// The world of `backend`.
    #[new]
    fn new(backend: &PyBackend) -> Self {
        PyWorld { inner: World::init(backend.inner.clone()) }
    }
    /// Same as `World(backend)`.
    #[staticmethod]
    fn init(backend: &PyBackend) -> Self {
        Self::new(backend)
    }
    /// This process's rank.
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    /// Number of ranks.
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    /// The group of every rank.
    fn default_group(&self) -> PyProcessGroup {
        self.inner.default_group().clone().into()
    }
    /// True on rank 0.
    fn is_main(&self) -> bool {
        self.inner.is_main()
    }
    /// Block until every rank arrives.
    fn barrier(&self, py: Python<'_>) -> PyResult<()> {
        let g = self.inner.default_group().clone();
        Ok(py.detach(move || g.barrier())?)
    }
    /// A subgroup of `ranks` (global), whose waits last `timeout` (seconds or a `datetime.timedelta`;
    /// None: the world's). Every member must create it, in the same order as its other groups; on a
    /// non-member it is a handle whose collectives raise ValueError.
    #[pyo3(signature = (ranks, timeout=None))]
    fn new_group(&self, ranks: Vec<usize>, timeout: Option<&Bound<'_, PyAny>>) -> PyResult<PyProcessGroup> {
        let timeout = timeout.map(timeout_arg).transpose()?;
        Ok(Arc::new(self.inner.new_group(&ranks, timeout)?).into())
    }
}
