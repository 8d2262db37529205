//! The one place core errors become Python exceptions: the class each [`Error`] variant raises, and the
//! facts it carries as attributes (the classes are defined in `axonml_distributed/exceptions.py`).

use std::collections::BTreeMap;
use std::marker::PhantomData;

use pyo3::exceptions::{PyKeyboardInterrupt, PyMemoryError, PyOSError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString};
use pyo3::{import_exception, PyErrArguments, PyTypeInfo};

use crate::backend::Backend;
use crate::error::{Error, ExitStatus};
use crate::signature::Signature;

import_exception!(axonml_distributed.exceptions, DistributedError);
import_exception!(axonml_distributed.exceptions, CollectiveMismatchError);
import_exception!(axonml_distributed.exceptions, CollectiveTimeoutError);
import_exception!(axonml_distributed.exceptions, PeerFailureError);

/// A fact an exception carries, as a keyword argument of its class.
enum Fact {
    Int(i64),
    Ints(Vec<usize>),
    Seconds(f64),
    Text(String),
    /// Each member's call, by global rank.
    Calls(BTreeMap<usize, String>),
}

/// The facts of one exception, by keyword.
type Facts = Vec<(&'static str, Fact)>;

/// The arguments of a `T(message, **facts)`. PyO3 builds them when Python raises the error (lazily, as
/// for every `new_err`), into the instance itself, which Python then raises as it is.
struct WithFacts<T> {
    message: String,
    facts: Facts,
    class: PhantomData<fn() -> T>,
}

impl<T: PyTypeInfo> PyErrArguments for WithFacts<T> {
    fn arguments(self, py: Python<'_>) -> Py<PyAny> {
        let WithFacts { message, facts, .. } = self;
        let build = |message: &str| -> PyResult<Py<PyAny>> {
            let kwargs = PyDict::new(py);
            for (name, fact) in facts {
                match fact {
                    Fact::Int(v) => kwargs.set_item(name, v)?,
                    Fact::Ints(v) => kwargs.set_item(name, v)?,
                    Fact::Seconds(v) => kwargs.set_item(name, v)?,
                    Fact::Text(v) => kwargs.set_item(name, v)?,
                    Fact::Calls(v) => kwargs.set_item(name, v)?,
                }
            }
            Ok(T::type_object(py).call((message,), Some(&kwargs))?.unbind())
        };
        // Should the class refuse its facts, Python raises it with the message alone.
        build(&message).unwrap_or_else(|_| PyString::new(py, &message).into_any().unbind())
    }
}

/// `T(message, **facts)`, raised lazily.
fn raise<T: PyTypeInfo + 'static>(message: String, facts: Facts) -> PyErr {
    PyErr::new::<T, _>(WithFacts::<T> { message, facts, class: PhantomData })
}

/// `call` and, when it has one, its `seq`.
fn call_facts(call: String) -> Facts {
    let seq = Signature::seq_in(&call).and_then(|s| i64::try_from(s).ok());
    let mut facts = vec![("call", Fact::Text(call))];
    facts.extend(seq.map(|s| ("seq", Fact::Int(s))));
    facts
}

/// A rank as a Python int (ranks are far below `i64::MAX`; an out-of-range one is left out).
fn rank_fact(name: &'static str, rank: usize) -> Option<(&'static str, Fact)> {
    i64::try_from(rank).ok().map(|r| (name, Fact::Int(r)))
}

/// A mismatch's facts: the members whose call differs from the first member's and those that entered
/// none (whom its message names after "but"), every member's call, and the call's sequence number.
fn mismatch_facts(group: Vec<usize>, calls: Vec<(usize, String)>) -> Facts {
    let first = calls.first().map(|(_, s)| s.clone());
    let entered: Vec<usize> = calls.iter().map(|(r, _)| *r).collect();
    let odd = group
        .iter()
        .copied()
        .filter(|r| !entered.contains(r) || calls.iter().any(|(c, s)| c == r && Some(s) != first.as_ref()))
        .collect();
    let mut facts = vec![("ranks", Fact::Ints(odd))];
    let seq = first.as_deref().and_then(Signature::seq_in).and_then(|s| i64::try_from(s).ok());
    facts.extend(seq.map(|s| ("seq", Fact::Int(s))));
    facts.push(("calls", Fact::Calls(calls.into_iter().collect())));
    facts.push(("group", Fact::Ints(group)));
    facts
}

/// Where each member was, when the error says it ("where each rank is: rank 0 completed #2 ...").
fn progress_fact(progress: &str) -> Option<(&'static str, Fact)> {
    let text = progress.trim_start_matches("; ");
    (!text.is_empty()).then(|| ("progress", Fact::Text(text.to_string())))
}

impl From<Error> for PyErr {
    fn from(mut e: Error) -> PyErr {
        let msg = e.to_string();
        let progress = e.progress_mut().and_then(|p| progress_fact(p));
        match e {
            Error::InvalidArgument(_) => PyValueError::new_err(msg),
            Error::UnsupportedDtype(_) => PyTypeError::new_err(msg),
            Error::Mismatch { group, calls, .. } => {
                raise::<CollectiveMismatchError>(msg, mismatch_facts(group, calls))
            }
            Error::Timeout { rank, op, waited, missing, group, .. } => {
                let mut facts: Facts = rank_fact("rank", rank).into_iter().collect();
                facts.extend(call_facts(op));
                facts.push(("ranks", Fact::Ints(missing)));
                facts.push(("group", Fact::Ints(group)));
                facts.push(("waited", Fact::Seconds(waited.as_secs_f64())));
                facts.extend(progress);
                raise::<CollectiveTimeoutError>(msg, facts)
            }
            Error::PeerDied { peer, op, .. } => {
                let mut facts = vec![("ranks", Fact::Ints(vec![peer]))];
                facts.extend(call_facts(op));
                facts.extend(progress);
                raise::<PeerFailureError>(msg, facts)
            }
            Error::PeerExited { peer, pid, op, status, .. } => {
                let mut facts = vec![("ranks", Fact::Ints(vec![peer])), ("pid", Fact::Int(pid.into()))];
                facts.extend(call_facts(op));
                match status {
                    ExitStatus::Exited(code) => facts.push(("exit_code", Fact::Int(code.into()))),
                    ExitStatus::Killed { signal, .. } => facts.push(("signal", Fact::Int(signal.into()))),
                    ExitStatus::Unknown(_) => {}
                }
                facts.extend(progress);
                raise::<PeerFailureError>(msg, facts)
            }
            // `by` is usize::MAX when the aborting rank is unknown.
            Error::Aborted { by, .. } => {
                let by = (by != usize::MAX).then_some(by);
                let mut facts = vec![("ranks", Fact::Ints(by.into_iter().collect()))];
                facts.extend(progress);
                raise::<PeerFailureError>(msg, facts)
            }
            Error::Interrupted { .. } => PyKeyboardInterrupt::new_err(msg),
            Error::OutOfMemory(_) => PyMemoryError::new_err(msg),
            Error::Usage(_) | Error::Internal(_) => raise::<DistributedError>(msg, Vec::new()),
            Error::Os { source, .. } => PyOSError::new_err((source.raw_os_error().unwrap_or(0), msg)),
        }
    }
}

/// The exception classes, on the native module too (the errors its calls raise).
pub(crate) fn add_to(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("DistributedError", py.get_type::<DistributedError>())?;
    m.add("CollectiveMismatchError", py.get_type::<CollectiveMismatchError>())?;
    m.add("CollectiveTimeoutError", py.get_type::<CollectiveTimeoutError>())?;
    m.add("PeerFailureError", py.get_type::<PeerFailureError>())
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
