//! Running work for Python: blocking calls (the GIL released, after the lane's queued work) and
//! `Work`, the handle of an asynchronous one.

use std::sync::Arc;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::collectives::{Prepared, Source};
use super::flight::caller_stack;
use crate::backend::{abort_if_interrupted, Backend};
use crate::error::Result;
use crate::flight;
use crate::work::{Lane, Work};

/// What a Ctrl-C interrupts here (see [`abort_if_interrupted`]).
const QUEUED: &str = "its queued work";

/// Run `call` on `comm` now, with the GIL released, after the work queued on its lane. When it fails
/// while a peer may still touch the arrays (a stopped process), the arrays are kept alive (leaked,
/// still marked in use) so that memory is never freed or reused under the peer.
pub(crate) fn run_blocking(py: Python<'_>, comm: &Arc<dyn Backend>, call: Prepared<'_>) -> PyResult<()> {
    let Prepared { lane, arrays, job } = call;
    let c = comm.clone();
    let stack = caller_stack(py);
    let r = py.detach(move || {
        abort_if_interrupted(&*c, c.lanes().flush(lane), QUEUED)?;
        flight::with_stack(stack, || job.run(&*c))
    });
    if r.is_err() && comm.buffers_may_be_in_use() {
        std::mem::forget(arrays);
    }
    Ok(r?)
}

/// `call`'s job wrapped for its lane: it keeps the arrays alive until it has run, then lets them go
/// (or keeps them for good, as in [`run_blocking`]). They go without taking the GIL: pyo3 defers the
/// release to the next thread that holds it, so the work completes without waiting for the GIL.
pub(crate) fn queued(
    py: Python<'_>,
    comm: Arc<dyn Backend>,
    call: Prepared<'_>,
) -> (Lane, impl FnOnce() -> Result<()> + Send + 'static) {
    let Prepared { lane, arrays, job } = call;
    let keep: Vec<Py<PyAny>> = arrays.into_iter().map(|a| a.obj.unbind()).collect();
    let stack = caller_stack(py);
    let run = move || {
        let r = flight::with_stack(stack, || job.run(&*comm));
        if r.is_err() && comm.buffers_may_be_in_use() {
            std::mem::forget(keep);
        } else {
            drop(keep);
        }
        r
    };
    (lane, run)
}

/// The handle of an asynchronous collective.
#[pyclass(name = "Work", module = "axonml_distributed", frozen)]
pub(crate) struct PyWork {
    pub(crate) work: Work,
    pub(crate) result: Option<Py<PyAny>>,
    pub(crate) comm: Arc<dyn Backend>,
    /// A receive from any source records its sender here.
    pub(crate) source: Option<Source>,
}

#[pymethods]
impl PyWork {
    /// Block (GIL released, Ctrl-C honoured) until the collective finished; re-raise its error, or
    /// return its result (None for in-place collectives, the new array for the `*_tensor` ones, the
    /// sender's global rank for `recv_any`).
    fn wait(&self, py: Python<'_>) -> PyResult<Option<Py<PyAny>>> {
        match self.work.result() {
            // Finished already (a short call often is by the time it is waited for): no need to let
            // the GIL go and take it back.
            Some(r) => r?,
            None => {
                let (w, comm) = (self.work.clone(), self.comm.clone());
                py.detach(|| abort_if_interrupted(&*comm, w.wait(), QUEUED))?;
            }
        }
        if let Some(src) = self.source.as_ref().and_then(|s| s.get()) {
            return Ok(Some(src.into_pyobject(py)?.into_any().unbind()));
        }
        Ok(self.result.as_ref().map(|r| r.clone_ref(py)))
    }
    /// The sender's global rank of a `recv_any` that completed; a ValueError for any other work, or
    /// before it completed (call `wait()` first).
    fn source_rank(&self) -> PyResult<usize> {
        self.source.as_ref().and_then(|s| s.get().copied()).ok_or_else(|| {
            PyValueError::new_err(
                "source_rank(): not a completed receive from any source (wait() for it first)",
            )
        })
    }
    /// True once the collective has finished (successfully or not).
    fn is_completed(&self) -> bool {
        self.work.is_completed()
    }
}
