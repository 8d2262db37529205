//! `ReduceOp` for Python: the core's operator itself, its members made from the core's table, so their
//! names and codes (`int(ReduceOp.SUM)`) are the core's.

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyString;

use crate::reduce::ReduceOp;

/// How values from the ranks are combined.
#[pyclass(name = "ReduceOp", module = "axonml_distributed", frozen)]
pub(crate) struct PyReduceOp(pub(crate) ReduceOp);

#[pymethods]
impl PyReduceOp {
    fn __int__(&self) -> u8 {
        self.0 as u8
    }
    fn __hash__(&self) -> u64 {
        self.0 as u64
    }
    /// Equal to the same member, and to its code (as an int-valued enum is).
    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        match other.cast::<PyReduceOp>() {
            Ok(o) => o.get().0 == self.0,
            Err(_) => other.extract::<i64>().is_ok_and(|code| code == self.0 as i64),
        }
    }
    fn __repr__(&self) -> String {
        format!("ReduceOp.{}", self.0.name())
    }
}

/// Give the class one member per core operator, and torch's name AVG for AVERAGE.
pub(crate) fn add_members(py: Python<'_>) -> PyResult<()> {
    let ty = py.get_type::<PyReduceOp>();
    for op in ReduceOp::ALL {
        ty.setattr(op.name(), Py::new(py, PyReduceOp(op))?)?;
    }
    ty.setattr("AVG", ty.getattr(ReduceOp::Average.name())?)
}

/// A `ReduceOp`, or its name in any case ("sum", "AVERAGE", and "avg" or "mean" for AVERAGE); `None`
/// means SUM.
pub(crate) fn parse_op(op: Option<&Bound<'_, PyAny>>) -> PyResult<ReduceOp> {
    let Some(op) = op else {
        return Ok(ReduceOp::Sum);
    };
    if let Ok(op) = op.cast::<PyReduceOp>() {
        return Ok(op.get().0);
    }
    if let Ok(s) = op.cast::<PyString>() {
        let name = s.to_str()?.to_ascii_uppercase();
        return ReduceOp::ALL
            .into_iter()
            .find(|o| o.name() == name || (matches!(&*name, "MEAN" | "AVG") && *o == ReduceOp::Average))
            .ok_or_else(|| {
                PyValueError::new_err(format!("unknown reduce op {name:?}; use a ReduceOp member"))
            });
    }
    Err(PyTypeError::new_err("op must be a ReduceOp (or its name)"))
}
