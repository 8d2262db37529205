//! The flight recorder for Python (`crate::flight`): every recorder of this process as plain values
//! (`flight_records`, which the package writes as JSON: `axonml_distributed.trace`), a group's
//! totals (`ProcessGroup.stats`), the timeline's switch and logs (`set_timeline`, `take_timeline`,
//! `wall_ns`), the recorder of a group driven from Python (`FlightRecorder`: the MPI group, the gloo
//! legs across hosts), and the caller's Python stack when the records keep it (`caller_stack`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use pyo3::exceptions::PyValueError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyInt, PyList};

use super::tables::code;
use crate::config;
use crate::dtype::DType;
use crate::flight::{
    self, BucketEvent, Entry, Flight, Frame, Names, P2p, Recorded, Recorder, Route, Stack, Stats,
};
use crate::reduce::{ReduceOp, Scale};
use crate::signature::{CollKind, Signature};
use crate::sync::lock;

/// One recorded call as a dict; `None` for what it does not have.
fn entry<'py>(py: Python<'py>, e: &Entry) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("record_id", e.record_id)?;
    d.set_item("kind", e.call.kind())?;
    d.set_item("call", e.call.to_string())?;
    let dtype = e.call.dtype();
    d.set_item("dtype", dtype.map(|t| t.name()))?;
    d.set_item("count", e.call.count())?;
    // The message's size as the statistics count it (a member's part: count times element size).
    d.set_item("bytes", e.call.count().saturating_mul(dtype.map_or(0, |t| t.size() as u64)))?;
    match &e.call {
        Recorded::Collective(sig) => {
            d.set_item("seq", sig.seq)?;
            d.set_item("root", sig.root)?;
            d.set_item("op", sig.op.map(|o| o.name()))?;
            d.set_item("p2p", false)?;
        }
        Recorded::P2p(p) => {
            d.set_item("seq", p.seq)?;
            d.set_item("root", py.None())?;
            d.set_item("op", py.None())?;
            d.set_item("p2p", true)?;
            d.set_item("peer", p.peer)?;
            d.set_item("any_source", p.any_source)?;
            d.set_item("tag", p.tag)?;
        }
    }
    let frames = e.frames.as_deref().map(|fs| fs.iter().map(|f| frame(py, f)).collect::<PyResult<Vec<_>>>());
    d.set_item("frames", frames.transpose()?)?;
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

/// Totals per kind (only the kinds called: collectives, "send", "recv"): calls, failed calls, bytes of
/// the completed calls' messages, seconds waiting for peers and moving data, and completed calls per
/// route.
pub(crate) fn stats<'py>(py: Python<'py>, stats: &Stats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    for (i, s) in stats.iter().enumerate() {
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
        d.set_item(flight::kind_name(i), k)?;
    }
    Ok(d)
}

/// One stack frame as torch's recorder writes it.
fn frame<'py>(py: Python<'py>, f: &Frame) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("name", &*f.name)?;
    d.set_item("filename", &*f.filename)?;
    d.set_item("line", f.line)?;
    Ok(d)
}

/// What a stack keeps of one code object, read once: its names, and whether its frames are left out.
struct Code {
    /// Held, so that its address stays its own.
    _code: Py<PyAny>,
    name: Arc<str>,
    filename: Arc<str>,
    /// Code of this package or of torch.distributed ([`skipped_dirs`]).
    skipped: bool,
}

/// The code objects stacks were taken in, by the object's address: a frame then costs three attribute
/// reads (two when left out), not two string copies and the directories' comparisons.
type Codes = HashMap<usize, Code>;

/// The directories whose frames a caller's stack leaves out, each ending in a separator: this package's
/// and torch.distributed's, the wrappers a call passes through on its way from the user's code (torch's
/// found without importing it). Worked out once; a failed lookup leaves that directory out.
fn skipped_dirs(py: Python<'_>) -> &'static [String] {
    // Not a PyOnceLock: a finalizer run by the lookups may record a call, and so come back here on this
    // thread; it works them out again, and the first to finish is kept.
    static DIRS: OnceLock<Vec<String>> = OnceLock::new();
    if let Some(dirs) = DIRS.get() {
        return dirs;
    }
    let ours = || -> PyResult<Vec<String>> {
        let path = py.import("os.path")?;
        let init = py.import("axonml_distributed")?.getattr("__file__")?;
        let dir = path.call_method1("dirname", (init,))?;
        Ok(vec![path.call_method1("join", (dir, ""))?.extract()?])
    };
    let torch = || -> PyResult<Vec<String>> {
        let path = py.import("os.path")?;
        let spec = py.import("importlib.util")?.call_method1("find_spec", ("torch",))?;
        let locations = if spec.is_none() { spec } else { spec.getattr("submodule_search_locations")? };
        if locations.is_none() {
            return Ok(Vec::new());
        }
        let join = |dir| path.call_method1("join", (dir, "distributed", ""))?.extract::<String>();
        locations.try_iter()?.map(|dir| join(dir?)).collect()
    };
    let dirs = [ours(), torch()].into_iter().flat_map(|d| d.unwrap_or_default()).collect();
    DIRS.get_or_init(|| dirs)
}

/// The stack of the user's Python code calling now (its innermost `config::FLIGHT_RECORDER_FRAMES`
/// frames, leaving out those of this package and of torch.distributed: [`skipped_dirs`]), when
/// `AXONML_FLIGHT_RECORDER_STACKS` is on; `None` otherwise, or if it cannot be read.
pub(crate) fn caller_stack(py: Python<'_>) -> Option<Stack> {
    if !config::flight_recorder_stacks() {
        return None;
    }
    static GETFRAME: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    // Locked around the map's own lookups and inserts only: an attribute read may run Python (a
    // finalizer, from the collector) that records a call, on this thread or another.
    static CODES: Mutex<Option<Codes>> = Mutex::new(None);
    let walk = || -> PyResult<Stack> {
        let getframe =
            GETFRAME.get_or_try_init(py, || py.import("sys")?.getattr("_getframe").map(Bound::unbind))?;
        let mut at = getframe.bind(py).call0()?;
        let mut frames = Vec::with_capacity(config::FLIGHT_RECORDER_FRAMES);
        while frames.len() < config::FLIGHT_RECORDER_FRAMES && !at.is_none() {
            let code = at.getattr(intern!(py, "f_code"))?;
            let key = code.as_ptr() as usize;
            // Some(None): a frame left out.
            let known = lock(&CODES)
                .as_ref()
                .and_then(|m| m.get(&key))
                .map(|c| (!c.skipped).then(|| (c.name.clone(), c.filename.clone())));
            let names = match known {
                Some(names) => names,
                None => {
                    let name: Arc<str> = code.getattr(intern!(py, "co_name"))?.extract::<String>()?.into();
                    let filename: Arc<str> =
                        code.getattr(intern!(py, "co_filename"))?.extract::<String>()?.into();
                    let skipped = skipped_dirs(py).iter().any(|dir| filename.starts_with(dir.as_str()));
                    let fresh = Code {
                        _code: code.clone().unbind(),
                        name: name.clone(),
                        filename: filename.clone(),
                        skipped,
                    };
                    // Another thread may have put it in meanwhile: then ours is dropped after the lock.
                    let _spare = lock(&CODES).get_or_insert_with(HashMap::new).insert(key, fresh);
                    (!skipped).then_some((name, filename))
                }
            };
            if let Some((name, filename)) = names {
                let line = at.getattr(intern!(py, "f_lineno"))?.extract::<Option<u32>>()?.unwrap_or(0);
                frames.push(Frame { name, filename, line });
            }
            at = at.getattr(intern!(py, "f_back"))?;
        }
        Ok(frames.into())
    };
    walk().ok()
}

/// The element type of a recorded call: the core's code (-1: none), or a name ("float32"; torch's
/// "torch.float32"), `None` for a name the core does not know (torch's float8 types, complex32):
/// recorded without one, since the call itself (gloo's) may carry it.
fn recorded_dtype(dtype: &Bound<'_, PyAny>) -> PyResult<Option<DType>> {
    if dtype.is_instance_of::<PyInt>() {
        return code("dtype", dtype.extract()?, DType::from_code);
    }
    let text = dtype.str()?.to_string();
    let name = text.strip_prefix("torch.").unwrap_or(&text);
    Ok(DType::ALL.into_iter().find(|t| t.name() == name))
}

/// The reduction operator of a recorded call: a ReduceOp, its name, or the core's code (-1: none).
fn recorded_op(op: Option<&Bound<'_, PyAny>>) -> PyResult<Option<ReduceOp>> {
    match op {
        None => Ok(None),
        Some(op) if op.is_instance_of::<PyInt>() => code("op", op.extract()?, ReduceOp::from_code),
        Some(op) => super::op::parse_op(Some(op)).map(Some),
    }
}

/// The flight recorder of a group whose calls Python drives (the MPI group; the gloo legs of a group
/// across hosts): it records them in the engine's own recorder, so that `flight_records`, the timeline,
/// `dump_flight_recorder` and `trace analyze` see them as the native groups' calls.
#[pyclass(name = "FlightRecorder", module = "axonml_distributed", frozen)]
pub(crate) struct PyFlightRecorder {
    inner: Arc<Recorder>,
    names: Arc<Names>,
    world: &'static str,
}

/// The worlds a recorder from Python may name (the records keep a static name).
const PYTHON_WORLDS: [&str; 2] = ["mpi", "hosts"];

#[pymethods]
impl PyFlightRecorder {
    /// The recorder of global rank `rank`'s group over `ranks` (global, sorted), the world's group of a
    /// new world of `world_size` ranks carried by `world` ("mpi" or "hosts"); `new_group` makes the
    /// recorders of its other groups.
    #[new]
    fn new(world: &str, rank: usize, world_size: usize, ranks: Vec<usize>) -> PyResult<Self> {
        let world = PYTHON_WORLDS
            .into_iter()
            .find(|w| *w == world)
            .ok_or_else(|| PyValueError::new_err(format!("world must be one of {PYTHON_WORLDS:?}")))?;
        let names = Arc::new(Names::new(flight::next_world()));
        let inner = Recorder::new(world, rank, world_size, ranks, names.clone());
        Ok(PyFlightRecorder { inner, names, world })
    }

    /// The recorder of this rank's next group over `ranks`, in the same world (every member makes its
    /// groups in the same order, so they name it alike).
    fn new_group(&self, ranks: Vec<usize>) -> Self {
        let r = &self.inner;
        let inner = Recorder::new(self.world, r.rank, r.world_size, ranks, self.names.clone());
        PyFlightRecorder { inner, names: self.names.clone(), world: self.world }
    }

    /// Record collective `kind` number `seq` on the group (the same on every member) as scheduled now:
    /// `count` elements of `dtype` each member's part (as the core's signatures count; this member's
    /// input and output elements follow from the kind and the group size, none for the kinds of
    /// per-member sizes; ValueError when they overflow), `root` a global rank, `op` a code or name;
    /// returns the call, to mark started and ended.
    #[pyo3(signature = (kind, seq, dtype, count, root=None, op=None, prescale=1.0, postscale=1.0))]
    #[allow(clippy::too_many_arguments)]
    fn collective(
        &self,
        py: Python<'_>,
        kind: &str,
        seq: u64,
        dtype: Option<&Bound<'_, PyAny>>,
        count: usize,
        root: Option<usize>,
        op: Option<&Bound<'_, PyAny>>,
        prescale: f64,
        postscale: f64,
    ) -> PyResult<PyFlightCall> {
        let kind = CollKind::ALL
            .into_iter()
            .find(|k| k.name() == kind)
            .ok_or_else(|| PyValueError::new_err(format!("no collective {kind:?}")))?;
        let mut sig = Signature::new(kind, seq, count).scale(Scale { pre: prescale, post: postscale });
        sig.dtype = dtype.map(recorded_dtype).transpose()?.flatten();
        sig.op = recorded_op(op)?;
        sig.root = root
            .map(|r| u32::try_from(r).map_err(|_| PyValueError::new_err(format!("{r} is not a rank"))))
            .transpose()?;
        // The spans in elements: a part of `count` elements (its extent over the group must fit).
        let n = self.inner.members.len();
        count.checked_mul(n).ok_or_else(|| {
            PyValueError::new_err(format!(
                "{} of {count} elements over {n} members is too large",
                kind.name()
            ))
        })?;
        let (send, recv) = crate::algo::part_spans(kind, count, n, root == Some(self.inner.rank));
        Ok(self.begin(py, Recorded::Collective(sig), (send as u64, recv as u64)))
    }

    /// Record a send (`send`) or receive of `count` x `dtype` to or from global rank `peer` (None: a
    /// receive from any source) with `tag` as scheduled now; returns the call.
    #[pyo3(signature = (send, peer, tag, dtype, count))]
    fn p2p(
        &self,
        py: Python<'_>,
        send: bool,
        peer: Option<usize>,
        tag: u64,
        dtype: &Bound<'_, PyAny>,
        count: usize,
    ) -> PyResult<PyFlightCall> {
        let p2p = P2p::new(send, peer, tag, recorded_dtype(dtype)?, count);
        Ok(self.begin(py, Recorded::P2p(p2p), (p2p.count, p2p.count)))
    }

    /// Totals per kind, as `ProcessGroup.stats()`.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        stats(py, &self.inner.stats())
    }
}

impl PyFlightRecorder {
    fn begin(&self, py: Python<'_>, call: Recorded, elems: (u64, u64)) -> PyFlightCall {
        let flight = flight::with_stack(caller_stack(py), || self.inner.begin_shared(call, elems));
        let bytes = call.count().saturating_mul(call.dtype().map_or(0, |t| t.size() as u64));
        PyFlightCall { recorder: self.inner.clone(), flight: Mutex::new(Some(flight)), bytes }
    }
}

/// A call a `FlightRecorder` recorded: mark it started (every member arrived) and ended.
#[pyclass(name = "FlightCall", module = "axonml_distributed", frozen)]
pub(crate) struct PyFlightCall {
    recorder: Arc<Recorder>,
    /// Until it ended.
    flight: Mutex<Option<Flight>>,
    bytes: u64,
}

#[pymethods]
impl PyFlightCall {
    /// Every member arrived: it moves data from now on.
    fn started(&self) {
        if let Some(f) = lock(&self.flight).as_mut() {
            self.recorder.started(f);
        }
    }

    /// It returned, successfully (`ok`) or not, its data carried by `route` ("mpi", "gloo"); `source`:
    /// the sender of a receive from any source. A second end is ignored.
    #[pyo3(signature = (ok, route=None, source=None))]
    fn end(&self, ok: bool, route: Option<&str>, source: Option<usize>) -> PyResult<()> {
        let route = route
            .map(|name| {
                Route::from_name(name).ok_or_else(|| PyValueError::new_err(format!("no route {name:?}")))
            })
            .transpose()?;
        if let Some(mut f) = lock(&self.flight).take() {
            if let Some(src) = source {
                f.received_from(src);
            }
            self.recorder.end(f, ok, route, self.bytes);
        }
        Ok(())
    }
}
