//! The core's codes, checks and segment facts, for the parts written in Python: the MPI backend signs,
//! checks and describes its calls (and checks its timeouts) with these, so a mistake reads the same on
//! every backend; the launcher and the stale-segment cleanup name and recognise segments with them.

use std::mem::{offset_of, size_of};

use pyo3::exceptions::{PyBaseException, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::args::{dtype_arg, timeout_arg, timeout_from};
use super::op::parse_op;
use crate::dtype::DType;
use crate::reduce::{ReduceOp, Scale};
use crate::signature::{mismatch, CollKind, Signature};
use crate::transport::shm::{SegmentHeader, DIR, MAGIC, PREFIX, VERSION};

/// `(name, code)` of every entry of a core table, as a dict.
fn codes<'py>(
    py: Python<'py>,
    table: impl IntoIterator<Item = (&'static str, u8)>,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    for (name, code) in table {
        d.set_item(name, code)?;
    }
    Ok(d)
}

/// Bytes of the field `_f` picks, for the header table below.
fn field_size<F>(_f: fn(&SegmentHeader) -> &F) -> usize {
    size_of::<F>()
}

/// Add the tables and constants to the module.
pub(crate) fn add_to(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("DTYPE_CODES", codes(py, DType::ALL.map(|d| (d.name(), d as u8)))?)?;
    m.add("OP_CODES", codes(py, ReduceOp::ALL.map(|o| (o.name(), o as u8)))?)?;
    m.add("KIND_CODES", codes(py, CollKind::ALL.map(|k| (k.name(), k as u8)))?)?;
    m.add("SEGMENT_PREFIX", PREFIX)?;
    m.add("SEGMENT_DIR", DIR)?;
    m.add("SEGMENT_MAGIC", MAGIC)?;
    m.add("SEGMENT_VERSION", VERSION)?;
    let header = PyDict::new(py);
    macro_rules! field {
        ($($f:ident),*) => {$(
            header.set_item(stringify!($f), (offset_of!(SegmentHeader, $f), field_size(|h| &h.$f)))?;
        )*};
    }
    field!(magic, version, world, uid, creator);
    m.add("SEGMENT_HEADER", header)
}

/// The name of job `job_id`'s segment, as the shared-memory world names it.
#[pyfunction]
pub(crate) fn segment_name(job_id: &str) -> String {
    crate::transport::shm::segment_name(job_id)
}

/// `seconds` (a number or a `datetime.timedelta`) checked as every native timeout is (positive, at
/// most about 31 years; None: the default of 300 s), in seconds.
#[pyfunction]
#[pyo3(signature = (seconds=None))]
pub(crate) fn checked_timeout(seconds: Option<&Bound<'_, PyAny>>) -> PyResult<f64> {
    Ok(seconds.map_or_else(|| timeout_from(None), timeout_arg)?.as_secs_f64())
}

/// The code of `op` once the core's rule allows it on `dtype`, else the TypeError a collective raises.
#[pyfunction]
pub(crate) fn check_op(op: &Bound<'_, PyAny>, dtype: &Bound<'_, PyAny>) -> PyResult<u8> {
    let op = parse_op(Some(op))?;
    op.check(dtype_arg(dtype)?)?;
    Ok(op as u8)
}

/// `ranks` sorted, once the core's member check accepts them for a world of `world_size`, else the
/// ValueError a group raises.
#[pyfunction]
pub(crate) fn validate_ranks(ranks: Vec<usize>, world_size: usize) -> PyResult<Vec<usize>> {
    Ok(crate::call::validate_ranks(&ranks, world_size)?)
}

/// The `what` of `code` (-1: none), or a ValueError for a code the core does not have.
pub(crate) fn code<T>(what: &str, code: i64, from: impl Fn(u8) -> Option<T>) -> PyResult<Option<T>> {
    if code == -1 {
        return Ok(None);
    }
    let found = u8::try_from(code).ok().and_then(from);
    found.map(Some).ok_or_else(|| PyValueError::new_err(format!("{code} is not a {what} code")))
}

/// A signature as `(seq, kind, dtype, count, root, op, prescale, postscale)`, -1 for a code not set
/// (factors 1.0 when not scaled).
type SigTuple = (u64, u8, i64, u64, i64, i64, f64, f64);

fn signature_of((seq, kind, dtype, count, root, op, pre, post): SigTuple) -> PyResult<Signature> {
    let kind = code("kind", kind.into(), CollKind::from_code)?.expect("not -1");
    let root = match root {
        -1 => None,
        r => Some(u32::try_from(r).map_err(|_| PyValueError::new_err(format!("{r} is not a rank")))?),
    };
    let (dtype, op) = (code("dtype", dtype, DType::from_code)?, code("op", op, ReduceOp::from_code)?);
    Ok(Signature { seq, count, root, kind, dtype, op, scale: Scale { pre, post } })
}

/// The CollectiveMismatchError the native worlds raise (with its facts) when the members of a call whose
/// signature (every member's) is `signature` published `layouts` (in group order; see
/// `ProcessGroup.call_check`), or None when they make one plan.
#[pyfunction]
pub(crate) fn layout_mismatch_error(
    py: Python<'_>,
    signature: SigTuple,
    layouts: Vec<Vec<u64>>,
    members: Vec<usize>,
) -> PyResult<Option<Py<PyBaseException>>> {
    use crate::algo::layout::{words, Fault, Plan};
    let sig = signature_of(signature)?;
    if !sig.kind.has_layout() || members.is_empty() {
        let e = format!("{} has no per-member layout, or the group no members", sig.kind.name());
        return Err(PyValueError::new_err(e));
    }
    let w = words(sig.kind, members.len());
    if layouts.len() != members.len() || layouts.iter().any(|l| l.len() != w) {
        return Err(PyValueError::new_err(format!("give {} layouts of {w} words", members.len())));
    }
    let root = sig.root.map(|r| crate::call::index_of(&members, r as usize, "root")).transpose()?;
    let elem = sig.dtype.map_or(1, DType::size);
    let views: Vec<&[u64]> = layouts.iter().map(Vec::as_slice).collect();
    let details = match Plan::new(&sig, elem, root, &views, &members) {
        Ok(_) => return Ok(None),
        Err(Fault::Disagree(details)) => details,
        Err(Fault::Overflow) => format!("{sig}: the members' sizes overflow"),
    };
    let calls: Vec<_> = members.iter().map(|&r| (r, sig)).collect();
    Ok(Some(PyErr::from(crate::signature::mismatch_error(&members, details, &calls)).into_value(py)))
}

/// The CollectiveMismatchError the native worlds raise (with its facts) for members whose calls are
/// `signatures` (in group order; None for a member that has not entered the call), or None when they
/// all agree.
#[pyfunction]
pub(crate) fn mismatch_error(
    py: Python<'_>,
    signatures: Vec<Option<SigTuple>>,
    members: Vec<usize>,
) -> PyResult<Option<Py<PyBaseException>>> {
    if signatures.len() != members.len() {
        return Err(PyValueError::new_err(format!(
            "{} signatures for {} members: give one (or None) per member",
            signatures.len(),
            members.len()
        )));
    }
    let calls =
        signatures.into_iter().map(|s| s.map(signature_of).transpose()).collect::<PyResult<Vec<_>>>()?;
    Ok(mismatch(&members, &calls).map(|e| PyErr::from(e).into_value(py)))
}
