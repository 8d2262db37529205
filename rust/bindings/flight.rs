//! The flight recorder for Python (`crate::flight`): every recorder of this process as plain values
//! (`flight_records`, which the package writes as JSON: `axonml_distributed.trace`), a group's
//! totals (`ProcessGroup.stats`), and the timeline's switch and logs (`set_timeline`,
//! `take_timeline`, `wall_ns`).

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::flight::{self, BucketEvent, Entry, Recorder, Route, Stats};
use crate::signature::CollKind;

/// One recorded call as a dict; `None` for what it does not have.
fn entry<'py>(py: Python<'py>, e: &Entry) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    let sig = &e.sig;
    d.set_item("record_id", e.record_id)?;
    d.set_item("seq", sig.seq)?;
    d.set_item("kind", sig.kind.name())?;
    d.set_item("call", sig.to_string())?;
    d.set_item("dtype", sig.dtype.map(|t| t.name()))?;
    d.set_item("count", sig.count)?;
    // The message's size as the statistics count it (a member's part: count times element size).
    d.set_item("bytes", sig.count.saturating_mul(sig.dtype.map_or(0, |t| t.size() as u64)))?;
    d.set_item("root", sig.root)?;
    d.set_item("op", sig.op.map(|o| o.name()))?;
    d.set_item("input_elems", e.elems.0)?;
    d.set_item("output_elems", e.elems.1)?;
    d.set_item("state", e.state.name())?;
    d.set_item("created_ns", e.created_ns)?;
    d.set_item("started_ns", e.started_ns)?;
    d.set_item("completed_ns", e.completed_ns)?;
    d.set_item("route", e.route.map(Route::name))?;
    Ok(d)
}

/// One recorder (one rank's handle on one communicator) as a dict, with `entries`.
fn record<'py>(py: Python<'py>, r: &Recorder, entries: &[Entry]) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("rank", r.rank)?;
    d.set_item("world_size", r.world_size)?;
    d.set_item("ranks", r.members.clone())?;
    d.set_item("occurrence", r.occurrence)?;
    d.set_item("index", r.index)?;
    d.set_item("world", r.world)?;
    d.set_item("world_ordinal", r.world_ordinal)?;
    let entries = entries.iter().map(|e| entry(py, e)).collect::<PyResult<Vec<_>>>()?;
    d.set_item("entries", PyList::new(py, entries)?)?;
    Ok(d)
}

/// One reduced bucket as a dict.
fn bucket<'py>(py: Python<'py>, b: &BucketEvent) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("bucket", b.bucket)?;
    d.set_item("bytes", b.bytes)?;
    d.set_item("ready_ns", b.ready_ns)?;
    d.set_item("launched_ns", b.launched_ns)?;
    d.set_item("done_ns", b.done_ns)?;
    d.set_item("ok", b.ok)?;
    Ok(d)
}

/// Every flight recorder of this process (one per rank and communicator it is a member of, in the
/// order they were made): rank, world size, the communicator's ranks, its occurrence among this
/// rank's communicators over the same ranks, its index among all of them, the world's transport, and
/// its last calls, oldest first.
#[pyfunction]
pub(crate) fn flight_records(py: Python<'_>) -> PyResult<Bound<'_, PyList>> {
    let all = flight::all();
    let records = all.iter().map(|r| record(py, r, &r.entries())).collect::<PyResult<Vec<_>>>()?;
    PyList::new(py, records)
}

/// Turn the timeline on or off: while on, every recorder of this process logs each call it finishes
/// (and each gradient bucket reduced), until `take_timeline`.
#[pyfunction]
pub(crate) fn set_timeline(on: bool) {
    flight::set_timeline(on);
}

/// What every recorder logged for the timeline since the last take, as `flight_records` gives them
/// (its finished calls as "entries", oldest first) with "buckets": the gradient buckets reduced over
/// the communicator ("bucket", "bytes", "ready_ns", "launched_ns", "done_ns", "ok").
#[pyfunction]
pub(crate) fn take_timeline(py: Python<'_>) -> PyResult<Bound<'_, PyList>> {
    let logs = flight::take_timeline();
    let records = logs
        .iter()
        .map(|(r, log)| {
            let d = record(py, r, &log.calls)?;
            let buckets = log.buckets.iter().map(|b| bucket(py, b)).collect::<PyResult<Vec<_>>>()?;
            d.set_item("buckets", PyList::new(py, buckets)?)?;
            Ok(d)
        })
        .collect::<PyResult<Vec<_>>>()?;
    PyList::new(py, records)
}

/// Now, on the recorders' clock: wall-clock nanoseconds since the Unix epoch (spans recorded in Python
/// line up with the calls).
#[pyfunction]
pub(crate) fn wall_ns() -> u64 {
    flight::wall_ns(std::time::Instant::now())
}

/// Totals per collective kind (only the kinds called): calls, failed calls, bytes of the completed
/// calls' messages, seconds waiting for peers and moving data, and completed calls per route.
pub(crate) fn stats<'py>(py: Python<'py>, stats: &Stats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    for (kind, s) in CollKind::ALL.iter().zip(stats) {
        if s.calls == 0 {
            continue;
        }
        let k = PyDict::new(py);
        k.set_item("calls", s.calls)?;
        k.set_item("failed", s.failed)?;
        k.set_item("bytes", s.bytes)?;
        k.set_item("wait_s", s.wait_ns as f64 * 1e-9)?;
        k.set_item("move_s", s.move_ns as f64 * 1e-9)?;
        let routes = PyDict::new(py);
        for (route, n) in Route::ALL.iter().zip(s.routes) {
            if n > 0 {
                routes.set_item(route.name(), n)?;
            }
        }
        k.set_item("routes", routes)?;
        d.set_item(kind.name(), k)?;
    }
    Ok(d)
}
