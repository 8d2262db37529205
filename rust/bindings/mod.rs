//! The Python module `axonml_distributed._core`: the only place that names pyo3 or numpy.

mod array;
mod backend;
mod exceptions;
mod group;
mod shm;

use pyo3::prelude::*;

/// Ctrl-C while a rank waits: run Python's signal handlers; a raised KeyboardInterrupt ends the wait.
fn python_interrupted() -> bool {
    Python::try_attach(|py| py.check_signals().is_err()).unwrap_or(false)
}

#[pymodule]
mod _core {
    #[pymodule_export]
    use super::backend::{PyBackend, PyMockBackend, PyReduceOp};
    #[pymodule_export]
    use super::exceptions::{
        CollectiveMismatchError, CollectiveTimeoutError, DistributedError, PeerFailureError,
    };
    #[pymodule_export]
    use super::group::{PyProcessGroup, PyWork, PyWorld};
    #[pymodule_export]
    use super::shm::{PyShmBackend, SegmentMemory};

    use pyo3::prelude::*;

    #[pymodule_init]
    fn init(m: &Bound<'_, PyModule>) -> PyResult<()> {
        crate::transport::wait::set_interrupt_hook(super::python_interrupted);
        m.add("__version__", env!("CARGO_PKG_VERSION"))?;
        m.add("INLINE_BYTES", crate::transport::thread::INLINE)?;
        Ok(())
    }
}
