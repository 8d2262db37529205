//! The Python module `axonml_distributed._core`: the only place that names pyo3 or numpy.

mod array;
mod backend;
mod bucket;
mod exceptions;
mod group;
mod shm;
mod store_join;
mod work;
mod world;

use std::sync::OnceLock;
use std::thread::ThreadId;

use pyo3::prelude::*;

/// The thread that imported the module: Python runs signal handlers only there, so only its waits
/// need to look (and take the GIL to do so).
static MAIN_THREAD: OnceLock<ThreadId> = OnceLock::new();

/// Ctrl-C while a rank waits: run Python's signal handlers; a raised KeyboardInterrupt ends the wait.
fn python_interrupted() -> bool {
    MAIN_THREAD.get() == Some(&std::thread::current().id())
        && Python::try_attach(|py| py.check_signals().is_err()).unwrap_or(false)
}

#[pymodule]
mod _core {
    #[pymodule_export]
    use super::backend::{PyBackend, PyMockBackend, PyReduceOp};
    #[pymodule_export]
    use super::bucket::{PyGradSyncStrategy, PyGradientBucket, PyGradientSynchronizer};
    #[pymodule_export]
    use super::exceptions::{
        CollectiveMismatchError, CollectiveTimeoutError, DistributedError, PeerFailureError,
    };
    #[pymodule_export]
    use super::group::PyProcessGroup;
    #[pymodule_export]
    use super::shm::{PyShmBackend, SegmentMemory};
    #[pymodule_export]
    use super::store_join::PyShmSegment;
    #[pymodule_export]
    use super::work::PyWork;
    #[pymodule_export]
    use super::world::PyWorld;

    use pyo3::prelude::*;

    #[pymodule_init]
    fn init(m: &Bound<'_, PyModule>) -> PyResult<()> {
        let _ = super::MAIN_THREAD.set(std::thread::current().id());
        crate::transport::wait::set_interrupt_hook(super::python_interrupted);
        m.add("__version__", env!("CARGO_PKG_VERSION"))?;
        m.add("INLINE_BYTES", crate::transport::thread::INLINE)?;
        Ok(())
    }
}
