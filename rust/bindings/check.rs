//! A `ProcessGroup` in check mode (`ProcessGroup.call_check`), for the backends written in Python (MPI):
//! its calls take the same arguments through the same preparation as a native group's (`collectives`)
//! and the core's checks (`call`), and return what the checks found instead of running, so a mistake
//! raises the same exception with the same message on every backend, and a valid call yields the
//! signature fields (and layout words) the Python backend signs its call with.

use std::sync::Arc;
use std::time::Duration;

use super::collectives::Job;
use crate::backend::Backend;
use crate::call::{self, Call};
use crate::collective::Collective;
use crate::dtype::{Buf, BufMut};
use crate::error::{Error, Result};
use crate::work::Lanes;

/// `(dtype, count, root, op, layout)` of a valid call, by the core's codes: `root` a group index,
/// `count` the elements of each member's part (as in signatures), -1 for a field the call has not
/// (barrier's dtype, a root, an op); `layout` the words of a collective with per-member sizes (counts or
/// split sizes, in elements), `None` for the others.
pub(crate) type Checked = (i64, u64, i64, i64, Option<Vec<u64>>);

/// What `job`, a call of global rank `me` in a group of `members`, is when the core's checks accept it.
pub(crate) fn checked(job: Job, members: &[usize], me: usize) -> Result<Checked> {
    let message = |buf: super::array::RawArray| (i64::from(buf.dtype as u8), buf.len() as u64, -1, -1, None);
    match job {
        Job::Collective(raw) => {
            // SAFETY: as in `Job::run`: the caller holds the arrays' borrows, and a check only reads the
            // description (no byte of the arrays).
            let mut c = unsafe { raw.collective() };
            let c = call::check(&mut c, members, me)?;
            call::supported(&c.sig)?;
            Ok(fields(c))
        }
        Job::Send { buf, dst, .. } => {
            call::peer(members, me, dst, call::SEND_TO)?;
            Ok(message(buf))
        }
        Job::Recv { buf, src, .. } => {
            call::peer(members, me, src, call::RECEIVE_FROM)?;
            Ok(message(buf))
        }
        Job::RecvAny { buf, .. } => {
            call::any_peer(members, me)?;
            Ok(message(buf))
        }
    }
}

fn fields(c: Call) -> Checked {
    let code = |c: Option<u8>| c.map_or(-1, i64::from);
    (
        code(c.sig.dtype.map(|d| d as u8)),
        c.count as u64,
        c.root.map_or(-1, |r| r as i64),
        code(c.sig.op.map(|o| o as u8)),
        c.layout.map(|l| l.words),
    )
}

/// The stand-in world of a group in check mode: who the members are, and no transport. The group's
/// Python methods never reach its calls (they return the check instead); Rust code handed the group (a
/// gradient synchronizer) is refused.
pub(crate) struct CheckWorld {
    rank: usize,
    world_size: usize,
    members: Vec<usize>,
    lanes: Lanes,
}

impl CheckWorld {
    /// Rank `rank`'s view of a group of `ranks` (global) in a world of `world_size`.
    pub(crate) fn new(ranks: &[usize], rank: usize, world_size: usize) -> Result<Self> {
        let members = call::validate_ranks(ranks, world_size)?;
        Ok(CheckWorld { rank, world_size, members, lanes: Lanes::default() })
    }
    fn runs_nothing<T>(&self) -> Result<T> {
        Err(Error::invalid("a group in check mode (ProcessGroup.call_check) checks calls and runs none"))
    }
}

impl Backend for CheckWorld {
    fn name(&self) -> &str {
        "check"
    }
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.world_size
    }
    fn members(&self) -> &[usize] {
        &self.members
    }
    fn collective(&self, _call: Collective<'_>) -> Result<()> {
        self.runs_nothing()
    }
    fn send(&self, _buf: Buf<'_>, _dst: usize, _tag: u64) -> Result<()> {
        self.runs_nothing()
    }
    fn recv(&self, _buf: BufMut<'_>, _src: usize, _tag: u64) -> Result<()> {
        self.runs_nothing()
    }
    fn recv_any(&self, _buf: BufMut<'_>, _tag: u64) -> Result<usize> {
        self.runs_nothing()
    }
    fn sequence_number(&self) -> u64 {
        0 // it makes no call
    }
    fn timeout(&self) -> Duration {
        crate::config::DEFAULT_TIMEOUT // it never waits
    }
    fn split(&self, _ranks: &[usize], _timeout: Option<Duration>) -> Result<Arc<dyn Backend>> {
        self.runs_nothing()
    }
    fn abort(&self, _reason: &str) {}
    fn lanes(&self) -> &Lanes {
        &self.lanes
    }
}
