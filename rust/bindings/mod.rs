//! The Python module `axonml_distributed._core`: the only place that names pyo3 or numpy.

mod args;
mod array;
mod backend;
mod buckets;
mod check;
mod collectives;
mod exceptions;
mod flight;
mod group;
mod op;
mod python_group;
mod rendezvous;
mod segment;
mod synchronizer;
mod tables;
mod work;
mod world;

use std::sync::atomic::{AtomicI32, Ordering::Relaxed};

use pyo3::prelude::*;
use pyo3::types::PyCFunction;

/// The kernel thread id of Python's main thread: Python runs signal handlers only there, so only its
/// waits need to look (and take the GIL to do so). Taken from `threading.main_thread()` (the module
/// may be imported on any thread), and re-taken in a forked child, whose only thread is its main one.
static MAIN_THREAD: AtomicI32 = AtomicI32::new(0);

fn this_thread() -> i32 {
    rustix::thread::gettid().as_raw_nonzero().get()
}

/// Ctrl-C while a rank waits: run Python's signal handlers; a raised KeyboardInterrupt ends the wait.
fn python_interrupted() -> bool {
    MAIN_THREAD.load(Relaxed) == this_thread()
        && Python::try_attach(|py| py.check_signals().is_err()).unwrap_or(false)
}

/// Record Python's main thread, and have every forked child record its own.
fn track_main_thread(py: Python<'_>) -> PyResult<()> {
    let main = py.import("threading")?.call_method0("main_thread")?.getattr("native_id")?.extract::<i32>()?;
    MAIN_THREAD.store(main, Relaxed);
    let after_fork = PyCFunction::new_closure(py, None, None, |_args, _kwargs| {
        MAIN_THREAD.store(this_thread(), Relaxed);
    })?;
    let kwargs = pyo3::types::PyDict::new(py);
    kwargs.set_item("after_in_child", after_fork)?;
    py.import("os")?.call_method("register_at_fork", (), Some(&kwargs))?;
    Ok(())
}

#[pymodule]
mod _core {
    #[pymodule_export]
    use super::backend::{PyBackend, PyThreadBackend};
    #[pymodule_export]
    use super::buckets::{assign_buckets, BucketMemory, PyGradientBucket};
    #[pymodule_export]
    use super::flight::{
        flight_records, set_timeline, take_timeline, wall_ns, PyFlightCall, PyFlightRecorder,
    };
    #[pymodule_export]
    use super::group::PyProcessGroup;
    #[pymodule_export]
    use super::op::PyReduceOp;
    #[pymodule_export]
    use super::rendezvous::check_job_secret;
    #[pymodule_export]
    use super::segment::{PyShmBackend, SegmentMemory};
    #[pymodule_export]
    use super::synchronizer::{set_default_group_source, PyGradSyncStrategy, PyGradientSynchronizer};
    #[pymodule_export]
    use super::tables::{
        check_op, checked_timeout, layout_mismatch_error, mismatch_error, segment_name, validate_ranks,
    };
    #[pymodule_export]
    use super::work::PyWork;
    #[pymodule_export]
    use super::world::PyWorld;

    use pyo3::prelude::*;

    #[pymodule_init]
    fn init(m: &Bound<'_, PyModule>) -> PyResult<()> {
        super::track_main_thread(m.py())?;
        crate::sync::wait::set_interrupt_hook(super::python_interrupted);
        m.add("__version__", env!("CARGO_PKG_VERSION"))?;
        m.add("INLINE_BYTES", crate::config::INLINE)?;
        super::exceptions::add_to(m)?;
        m.add("JOB_SECRET_MIN_BYTES", crate::rendezvous::JobSecret::MIN_BYTES)?;
        super::op::add_members(m.py())?;
        super::tables::add_to(m)
    }
}
