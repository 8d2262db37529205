//! How a synchronizer's buckets are averaged over a group: the [`Averaging`] a native [`ProcessGroup`]
//! gives (each bucket queued on the group's worker lane, or run on the caller's thread after it).

use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::backend::{abort_if_interrupted, Backend};
use crate::bucket::GradientBucket;
use crate::dtype::BufMut;
use crate::error::Result;
use crate::flight::Recorder;
use crate::group::ProcessGroup;
use crate::reduce::ReduceOp;
use crate::sync::lock;
use crate::work::Lane;

/// A bucket shared with the work that reduces it (and with the views handed out over it).
pub type SharedBucket = Arc<Mutex<GradientBucket>>;

/// What a Ctrl-C interrupts here (see [`abort_if_interrupted`]).
const BUCKETS: &str = "its gradient buckets";

/// Waits for a bucket's background reduction; returns its result.
pub type Pending = Box<dyn FnOnce() -> Result<()> + Send>;

/// How buckets are averaged over a group. A native [`ProcessGroup`] queues them on its worker lane; the
/// bindings give groups written in Python (MPI's) their own.
pub trait Averaging: Send + Sync {
    /// Start averaging `bucket` in the background, after everything started on the group before.
    fn start(&self, bucket: &SharedBucket) -> Result<Pending>;
    /// Average `bucket` now, after everything started on the group before.
    fn run(&self, bucket: &SharedBucket) -> Result<()>;
    /// The maximum of `flags` over the group, in place, after everything started before.
    fn max_flags(&self, flags: &mut [u8]) -> Result<()>;
    /// The backend whose shared memory buckets should live in (None: private memory).
    fn backend(&self) -> Option<&dyn Backend> {
        None
    }
    /// The recorder the timeline logs the buckets' reductions in (None: they are not logged).
    fn recorder(&self) -> Option<Arc<Recorder>> {
        None
    }
}

impl Averaging for ProcessGroup {
    fn start(&self, bucket: &SharedBucket) -> Result<Pending> {
        let comm = self.comm()?.clone();
        let (b, waiter) = (bucket.clone(), comm.clone());
        let work = self.submit(Lane::Collectives, move || reduce(&*comm, &b))?;
        Ok(Box::new(move || abort_if_interrupted(&*waiter, work.wait(), BUCKETS)))
    }
    fn run(&self, bucket: &SharedBucket) -> Result<()> {
        let comm = self.comm()?;
        abort_if_interrupted(&**comm, self.flush(Lane::Collectives), BUCKETS)?;
        reduce(&**comm, bucket)
    }
    fn max_flags(&self, flags: &mut [u8]) -> Result<()> {
        let comm = self.comm()?;
        abort_if_interrupted(&**comm, self.flush(Lane::Collectives), BUCKETS)?;
        comm.all_reduce(BufMut::new(flags), ReduceOp::Max)
    }
    fn backend(&self) -> Option<&dyn Backend> {
        Some(&**ProcessGroup::backend(self))
    }
    fn recorder(&self) -> Option<Arc<Recorder>> {
        ProcessGroup::recorder(self).cloned()
    }
}

/// Average `bucket` over `comm`, stamping when it returned. When that fails while a stopped peer may
/// still write the buffer, the bucket is kept for the process's life: never freed or reused under the
/// peer.
fn reduce(comm: &dyn Backend, bucket: &SharedBucket) -> Result<()> {
    let mut b = lock(bucket);
    let r = comm.all_reduce(b.data_mut(), ReduceOp::Average);
    b.reduced_at = Some(Instant::now());
    drop(b);
    if r.is_err() && comm.buffers_may_be_in_use() {
        std::mem::forget(bucket.clone());
    }
    r
}
