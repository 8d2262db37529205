//! The call check for backends written in Python (MPI): a collective's arguments go through the same
//! preparation as a native group's (`collectives`) and the core's checks (`call`), without running, so
//! a mistake raises the same exception with the same message on every backend. A valid call yields the
//! signature fields the Python backend signs its call with.

use std::sync::{Arc, OnceLock};

use pyo3::prelude::*;

use super::collectives::{self as c, Obj, Prepared, Source};
use crate::backend::Backend;
use crate::call::{self, Call};
use crate::collective::Collective;
use crate::dtype::{Buf, BufMut, DType};
use crate::error::Result;
use crate::reduce::Scale;
use crate::work::Lanes;

/// `(dtype, count, root, op)` of a valid call, by the core's codes (`root` a group index; `count` the
/// elements of each member's part, as in signatures); -1 for a field the call has not (barrier's
/// dtype, a root, an op).
type Checked = (i64, u64, i64, i64);

/// The checks of one rank's calls on a group.
#[pyclass(name = "CallCheck", module = "axonml_distributed", frozen)]
pub(crate) struct PyCallCheck {
    group: Group,
}

struct Group {
    rank: usize,
    world_size: usize,
    members: Vec<usize>,
    lanes: Lanes,
}

/// A stand-in backend over a group whose every call only runs the core's checks and keeps what they
/// found.
struct Checker<'a> {
    g: &'a Group,
    found: OnceLock<Checked>,
    /// The layout words of a collective with per-member sizes.
    layout: OnceLock<Vec<u64>>,
}

impl Checker<'_> {
    /// A send's or receive's dtype and count.
    fn keep_message(&self, dtype: DType, count: usize) -> Result<()> {
        let _ = self.found.set((i64::from(dtype as u8), count as u64, -1, -1));
        Ok(())
    }
    fn keep(&self, call: Result<Call>) -> Result<()> {
        let c = call?;
        call::supported(&c.sig)?;
        if let Some(l) = c.layout {
            let _ = self.layout.set(l.words);
        }
        let code = |c: Option<u8>| c.map_or(-1, i64::from);
        let root = c.root.map_or(-1, |r| r as i64);
        let _ = self.found.set((
            code(c.sig.dtype.map(|d| d as u8)),
            c.count as u64,
            root,
            code(c.sig.op.map(|o| o as u8)),
        ));
        Ok(())
    }
}

impl Backend for Checker<'_> {
    fn name(&self) -> &str {
        "check"
    }
    fn rank(&self) -> usize {
        self.g.rank
    }
    fn world_size(&self) -> usize {
        self.g.world_size
    }
    fn members(&self) -> &[usize] {
        &self.g.members
    }
    fn collective(&self, mut c: Collective<'_>) -> Result<()> {
        self.keep(call::check(&mut c, &self.g.members, self.g.rank))
    }
    fn send(&self, buf: Buf<'_>, dst: usize, _tag: u64) -> Result<()> {
        call::peer(&self.g.members, self.g.rank, dst, call::SEND_TO)?;
        self.keep_message(buf.dtype(), buf.len())
    }
    fn recv(&self, buf: BufMut<'_>, src: usize, _tag: u64) -> Result<()> {
        call::peer(&self.g.members, self.g.rank, src, call::RECEIVE_FROM)?;
        self.keep_message(buf.dtype(), buf.len())
    }
    fn recv_any(&self, buf: BufMut<'_>, _tag: u64) -> Result<usize> {
        call::any_peer(&self.g.members, self.g.rank)?;
        self.keep_message(buf.dtype(), buf.len())?;
        // A check receives nothing, so it names no sender.
        Ok(self.g.rank)
    }
    fn sequence_number(&self) -> u64 {
        0 // a check makes no call
    }
    fn timeout(&self) -> std::time::Duration {
        // A call check never waits.
        crate::config::DEFAULT_TIMEOUT
    }
    fn split(&self, _ranks: &[usize], _timeout: Option<std::time::Duration>) -> Result<Arc<dyn Backend>> {
        Err(crate::error::Error::Internal("a call check has no subgroups".into()))
    }
    fn abort(&self, _reason: &str) {}
    fn lanes(&self) -> &Lanes {
        &self.g.lanes
    }
}

impl PyCallCheck {
    /// Run the prepared call's core checks; the arrays are released when this returns.
    fn check(&self, call: PyResult<Prepared<'_>>) -> PyResult<Checked> {
        Ok(self.check_layout(call)?.0)
    }

    /// [`PyCallCheck::check`], with the call's layout words (in elements; empty without a layout).
    fn check_layout(&self, call: PyResult<Prepared<'_>>) -> PyResult<(Checked, Vec<u64>)> {
        let Prepared { job, .. } = call?;
        let checker = Checker { g: &self.group, found: OnceLock::new(), layout: OnceLock::new() };
        job.run(&checker)?;
        let found = checker.found.into_inner().unwrap_or((-1, 0, -1, -1));
        Ok((found, checker.layout.into_inner().unwrap_or_default()))
    }
}

/// Each method takes what the `ProcessGroup` method of the same name takes (roots resolved: global
/// ranks) and returns the call's [`Checked`] fields, or raises what that method would.
#[pymethods]
impl PyCallCheck {
    /// The checks of global rank `rank` in a group of `ranks` (global ranks) of a world of
    /// `world_size`.
    #[new]
    fn new(ranks: Vec<usize>, rank: usize, world_size: usize) -> PyResult<Self> {
        let members = call::validate_ranks(&ranks, world_size)?;
        Ok(PyCallCheck { group: Group { rank, world_size, members, lanes: Lanes::default() } })
    }
    /// Position of global rank `rank` in the group, as `ProcessGroup.group_rank` answers it.
    fn group_rank(&self, rank: usize) -> PyResult<usize> {
        Ok(call::group_rank(&self.group.members, rank)?)
    }
    #[pyo3(signature = (buf, op=None, out=None, prescale_factor=1.0, postscale_factor=1.0))]
    fn all_reduce(
        &self,
        buf: &Obj,
        op: Option<&Obj>,
        out: Option<&Obj>,
        prescale_factor: f64,
        postscale_factor: f64,
    ) -> PyResult<Checked> {
        let scale = Scale { pre: prescale_factor, post: postscale_factor };
        self.check(c::all_reduce(buf, op, out, scale))
    }
    fn broadcast(&self, buf: &Obj, src: usize) -> PyResult<Checked> {
        self.check(c::broadcast(buf, src))
    }
    fn all_gather(&self, send: &Obj, recv: &Obj) -> PyResult<Checked> {
        self.check(c::all_gather(send, recv))
    }
    #[pyo3(signature = (send, recv, op=None))]
    fn reduce_scatter(&self, send: &Obj, recv: &Obj, op: Option<&Obj>) -> PyResult<Checked> {
        self.check(c::reduce_scatter(send, recv, op))
    }
    fn gather(&self, send: &Obj, recv: Option<&Obj>, dst: usize) -> PyResult<Checked> {
        self.check(c::gather(send, recv, dst))
    }
    fn scatter(&self, send: Option<&Obj>, recv: &Obj, src: usize) -> PyResult<Checked> {
        self.check(c::scatter(send, recv, src))
    }
    #[pyo3(signature = (buf, dst, op=None, out=None, prescale_factor=1.0, postscale_factor=1.0))]
    fn reduce(
        &self,
        buf: &Obj,
        dst: usize,
        op: Option<&Obj>,
        out: Option<&Obj>,
        prescale_factor: f64,
        postscale_factor: f64,
    ) -> PyResult<Checked> {
        let scale = Scale { pre: prescale_factor, post: postscale_factor };
        self.check(c::reduce(buf, dst, op, out, scale))
    }
    fn all_to_all(&self, send: &Obj, recv: &Obj) -> PyResult<Checked> {
        self.check(c::all_to_all(send, recv))
    }
    /// The call's fields and its layout (split sizes in elements: input, then output).
    #[pyo3(signature = (send, recv, output_split_sizes=None, input_split_sizes=None))]
    fn all_to_all_single(
        &self,
        send: &Obj,
        recv: &Obj,
        output_split_sizes: Option<Vec<usize>>,
        input_split_sizes: Option<Vec<usize>>,
    ) -> PyResult<(Checked, Vec<u64>)> {
        let n = self.group.members.len();
        self.check_layout(c::all_to_all_single(send, recv, output_split_sizes, input_split_sizes, n))
    }
    fn all_gather_v(&self, send: &Obj, recv: &Obj, counts: Vec<usize>) -> PyResult<(Checked, Vec<u64>)> {
        self.check_layout(c::all_gather_v(send, recv, counts))
    }
    fn gather_v(
        &self,
        send: &Obj,
        recv: Option<&Obj>,
        counts: Vec<usize>,
        dst: usize,
    ) -> PyResult<(Checked, Vec<u64>)> {
        self.check_layout(c::gather_v(send, recv, counts, dst))
    }
    fn scatter_v(
        &self,
        send: Option<&Obj>,
        recv: &Obj,
        counts: Vec<usize>,
        src: usize,
    ) -> PyResult<(Checked, Vec<u64>)> {
        self.check_layout(c::scatter_v(send, recv, counts, src))
    }
    #[pyo3(signature = (send, recv, counts, op=None))]
    fn reduce_scatter_v(
        &self,
        send: &Obj,
        recv: &Obj,
        counts: Vec<usize>,
        op: Option<&Obj>,
    ) -> PyResult<(Checked, Vec<u64>)> {
        self.check_layout(c::reduce_scatter_v(send, recv, counts, op))
    }
    fn send(&self, buf: &Obj, dst: usize) -> PyResult<Checked> {
        self.check(c::send(buf, dst, 0))
    }
    fn recv(&self, buf: &Obj, src: usize) -> PyResult<Checked> {
        self.check(c::recv(buf, src, 0))
    }
    fn recv_any(&self, buf: &Obj) -> PyResult<Checked> {
        self.check(c::recv_any(buf, 0, Source::default()))
    }
}
