//! The Python exception hierarchy, and the one place core errors become Python exceptions.

use pyo3::exceptions::{
    PyKeyboardInterrupt, PyMemoryError, PyOSError, PyRuntimeError, PyTypeError, PyValueError,
};
use pyo3::{create_exception, PyErr, PyResult, Python};

use crate::backend::Backend;
use crate::error::Error;

create_exception!(axonml_distributed, DistributedError, PyRuntimeError, "Base of every collective failure.");
create_exception!(
    axonml_distributed,
    CollectiveMismatchError,
    DistributedError,
    "Ranks called different collectives (kind, shape, dtype, op or root). No buffer was changed."
);
create_exception!(
    axonml_distributed,
    CollectiveTimeoutError,
    DistributedError,
    "Some ranks never arrived before the timeout; the message names them. The world is aborted."
);
create_exception!(
    axonml_distributed,
    PeerFailureError,
    DistributedError,
    "A peer died (the message gives its pid and exit code or signal, or why that is unknown), or the \
     world was aborted (by a failing rank, a timeout or a mismatch elsewhere)."
);

impl From<Error> for PyErr {
    fn from(e: Error) -> PyErr {
        let msg = e.to_string();
        match e {
            Error::InvalidArgument(_) => PyValueError::new_err(msg),
            Error::UnsupportedDtype(_) => PyTypeError::new_err(msg),
            Error::Mismatch { .. } => CollectiveMismatchError::new_err(msg),
            Error::Timeout { .. } => CollectiveTimeoutError::new_err(msg),
            Error::PeerDied { .. } | Error::PeerExited { .. } | Error::Aborted { .. } => {
                PeerFailureError::new_err(msg)
            }
            Error::Interrupted { .. } => PyKeyboardInterrupt::new_err(msg),
            Error::OutOfMemory(_) => PyMemoryError::new_err(msg),
            Error::Usage(_) | Error::Internal(_) => DistributedError::new_err(msg),
            Error::Os { source, .. } => PyOSError::new_err((source.raw_os_error().unwrap_or(0), msg)),
        }
    }
}

/// Abort `backend`'s world when `r` is an argument error (TypeError, ValueError): a rank that cannot
/// enter a collective must not leave its peers waiting for it until the timeout.
pub(crate) fn abort_on_bad_arguments<T>(backend: &dyn Backend, r: PyResult<T>) -> PyResult<T> {
    if let Err(e) = &r {
        Python::attach(|py| {
            if e.is_instance_of::<PyTypeError>(py) || e.is_instance_of::<PyValueError>(py) {
                backend.abort(&format!("rank {} passed bad arguments: {e}", backend.rank()));
            }
        });
    }
    r
}
