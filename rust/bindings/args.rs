//! Scalar arguments from Python, checked once for every class that takes them: timeouts, element
//! counts, dtypes given by name.

use std::time::Duration;

use numpy::PyArrayDescr;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyString;

use super::array::{dtype_of, unsupported};
use crate::config::{DEFAULT_TIMEOUT, MAX_TIMEOUT};
use crate::dtype::DType;

/// Seconds (float or None) to a timeout: positive, finite and at most `MAX_TIMEOUT` (about 31 years),
/// so no deadline computed from it can overflow.
pub(crate) fn timeout_from(seconds: Option<f64>) -> PyResult<Duration> {
    match seconds {
        None => Ok(DEFAULT_TIMEOUT),
        Some(s) if s > 0.0 && s <= MAX_TIMEOUT.as_secs_f64() => Ok(Duration::from_secs_f64(s)),
        Some(s) => Err(PyValueError::new_err(format!(
            "timeout must be a positive number of seconds up to {:.0} (about 31 years), got {s}",
            MAX_TIMEOUT.as_secs_f64()
        ))),
    }
}

/// A timeout given as seconds or as a `datetime.timedelta` (torch's type), checked as [`timeout_from`].
pub(crate) fn timeout_arg(t: &Bound<'_, PyAny>) -> PyResult<Duration> {
    let seconds = if t.hasattr("total_seconds")? { t.call_method0("total_seconds")? } else { t.clone() };
    let seconds = seconds.extract::<f64>().map_err(|_| {
        PyTypeError::new_err(format!(
            "timeout must be a number of seconds or a datetime.timedelta, got {}",
            t.get_type().name().map_or_else(|_| "?".into(), |n| n.to_string())
        ))
    })?;
    timeout_from(Some(seconds))
}

/// An element count from Python: a ValueError (not an OverflowError) for one no buffer could hold.
pub(crate) fn count(n: &Bound<'_, PyAny>, what: &str) -> PyResult<usize> {
    n.extract::<usize>().map_err(|_| {
        PyValueError::new_err(format!("{what} must be a non-negative element count below 2**64, got {n}"))
    })
}

/// The core's dtype of `dtype`: a dtype name (including "bfloat16"), or anything `numpy.dtype` takes.
pub(crate) fn dtype_arg(dtype: &Bound<'_, PyAny>) -> PyResult<DType> {
    if let Ok(name) = dtype.cast::<PyString>() {
        let name = name.to_str()?;
        if let Some(d) = DType::ALL.into_iter().find(|d| d.name() == name) {
            return Ok(d);
        }
    }
    let descr = dtype.py().import("numpy")?.call_method1("dtype", (dtype,))?;
    dtype_of(descr.cast::<PyArrayDescr>()?).ok_or_else(|| unsupported("the buffer", &descr))
}
