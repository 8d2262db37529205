//! The gradient synchronizer: gradients are packed into buckets as they become ready, and each bucket is
//! averaged across the group with one all-reduce.
//!
//! Buckets fill in index order (as DDP fills them in backward). A bucket is complete when it is full, when
//! a gradient goes to a later bucket, or when the number of gradients announced by `prepare` has arrived.
//! With [`GradSyncStrategy::Overlapped`] a complete bucket's all-reduce starts at once on the group's
//! worker thread, while the caller keeps computing; `sync_all` launches what is left and waits. The
//! averaged values are then read back per gradient (`averaged`), in the order gradients were added.

use std::sync::{Arc, Mutex};

use crate::bucket::{Entry, GradientBucket};
use crate::dtype::{Buf, BufMut};
use crate::error::{Error, Result};
use crate::group::ProcessGroup;
use crate::reduce::ReduceOp;
use crate::sync::lock;
use crate::work::{Lane, Work};

/// The default bucket size: 25M elements (~100 MB of f32).
pub const DEFAULT_BUCKET_SIZE: usize = 25_000_000;

/// When buckets are reduced.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GradSyncStrategy {
    /// Every bucket is reduced inside `sync_all`.
    Synchronous,
    /// A bucket is reduced in the background as soon as it is complete.
    Overlapped,
    /// Nothing is reduced (local gradient accumulation).
    NoSync,
}

/// One bucket of the step, and its reduction.
struct BucketState {
    bucket: Arc<Mutex<GradientBucket>>,
    /// Set once the bucket is complete: nothing more may be added to it.
    closed: bool,
    /// Its background all-reduce, once launched.
    work: Option<Work>,
}

/// Buckets gradients and averages them across a group.
pub struct GradientSynchronizer {
    strategy: GradSyncStrategy,
    bucket_size: usize,
    expected: Option<usize>,
    added: usize,
    states: Vec<BucketState>,
    /// (bucket, entry index) of each gradient, in the order added.
    order: Vec<(usize, usize)>,
    group: Option<Arc<ProcessGroup>>,
}

impl GradientSynchronizer {
    /// A synchronizer whose buckets hold `bucket_size` elements each.
    pub fn new(strategy: GradSyncStrategy, bucket_size: usize) -> Self {
        GradientSynchronizer {
            strategy,
            bucket_size: bucket_size.max(1),
            expected: None,
            added: 0,
            states: Vec::new(),
            order: Vec::new(),
            group: None,
        }
    }

    /// The strategy.
    pub fn strategy(&self) -> GradSyncStrategy {
        self.strategy
    }
    /// Elements per bucket.
    pub fn bucket_size(&self) -> usize {
        self.bucket_size
    }
    /// Number of buckets used this step.
    pub fn num_buckets(&self) -> usize {
        self.states.len()
    }

    /// Start a step of `num_gradients` gradients; with `group`, overlapped buckets launch as they complete
    /// (without one, they launch in `sync_all`).
    pub fn prepare(&mut self, num_gradients: usize, group: Option<Arc<ProcessGroup>>) {
        self.clear();
        self.expected = Some(num_gradients);
        self.group = group;
    }

    /// Add `grad` (of `shape`) to bucket `bucket`; returns its position in the order of gradients.
    pub fn add_gradient(&mut self, bucket: usize, grad: Buf<'_>, shape: &[usize]) -> Result<usize> {
        if self.expected.is_some_and(|n| self.added >= n) {
            return Err(Error::invalid(format!(
                "prepare() announced {} gradients for this step and all have been added",
                self.added
            )));
        }
        if bucket >= self.states.len() {
            self.states.resize_with(bucket + 1, || BucketState {
                bucket: Arc::new(Mutex::new(GradientBucket::new(self.bucket_size))),
                closed: false,
                work: None,
            });
        }
        if self.states[bucket].closed {
            return Err(Error::invalid(format!(
                "bucket {bucket} is already complete (buckets fill in index order); use a later bucket"
            )));
        }
        {
            // A gradient larger than a whole bucket gets a bucket of its own size (as in torch's DDP).
            let mut b = lock(&self.states[bucket].bucket);
            if b.is_empty() && grad.len() > b.capacity() {
                *b = GradientBucket::new(grad.len());
            }
        }
        let added = lock(&self.states[bucket].bucket).add_buf(grad, shape)?;
        if !added {
            let b = lock(&self.states[bucket].bucket);
            return Err(Error::invalid(format!(
                "bucket {bucket} is full: {} of {} elements used, the gradient has {}; use another bucket",
                b.size(),
                b.capacity(),
                grad.len()
            )));
        }
        let entry = lock(&self.states[bucket].bucket).entries().len() - 1;
        self.order.push((bucket, entry));
        self.added += 1;
        for earlier in 0..bucket {
            self.complete(earlier)?;
        }
        if lock(&self.states[bucket].bucket).is_full() || self.expected == Some(self.added) {
            self.complete(bucket)?;
        }
        Ok(self.order.len() - 1)
    }

    /// Mark bucket `i` complete; overlapped buckets start reducing now when the group is known.
    fn complete(&mut self, i: usize) -> Result<()> {
        let state = &mut self.states[i];
        if state.closed {
            return Ok(());
        }
        state.closed = true;
        if let (GradSyncStrategy::Overlapped, Some(group)) = (self.strategy, &self.group) {
            state.work = Some(launch(group, &state.bucket)?);
        }
        Ok(())
    }

    /// Average every bucket across `group` (nothing with `NoSync`), waiting for background work.
    /// Returns the first error; the averaged values are then available through [`Self::averaged`].
    pub fn sync_all(&mut self, group: &Arc<ProcessGroup>) -> Result<()> {
        if self.strategy == GradSyncStrategy::NoSync {
            return Ok(());
        }
        for state in &mut self.states {
            state.closed = true;
            let empty = lock(&state.bucket).is_empty();
            if state.work.is_none() && !empty {
                match self.strategy {
                    GradSyncStrategy::Overlapped => state.work = Some(launch(group, &state.bucket)?),
                    _ => {
                        let comm = group.comm()?;
                        group.flush(Lane::Collectives)?;
                        comm.all_reduce(lock(&state.bucket).data_mut(), ReduceOp::Average)?;
                    }
                }
            }
        }
        let mut first = Ok(());
        for state in &self.states {
            if let Some(w) = &state.work {
                if let (Err(e), Ok(())) = (w.wait(), &first) {
                    first = Err(e);
                }
            }
        }
        first
    }

    /// Copy gradient `i` (in the order added) out of its bucket into `out` (same dtype and length).
    pub fn averaged(&self, i: usize, mut out: BufMut<'_>) -> Result<()> {
        let &(b, e) =
            self.order.get(i).ok_or_else(|| Error::invalid(format!("no gradient {i} in this step")))?;
        let bucket = lock(&self.states[b].bucket);
        let Entry { offset, .. } = &bucket.entries()[e];
        let len = bucket.entries()[e].len();
        let data = bucket.data();
        if out.dtype() != data.dtype() || out.len() != len {
            return Err(Error::invalid("averaged: the output must match the gradient's dtype and size"));
        }
        let size = data.dtype().size();
        out.bytes_mut().copy_from_slice(&data.bytes()[offset * size..(offset + len) * size]);
        Ok(())
    }

    /// Buckets whose all-reduce was started in the background this step.
    pub fn launched(&self) -> usize {
        self.states.iter().filter(|s| s.work.is_some()).count()
    }

    /// Bucket `i` of this step (for backends that reduce it themselves).
    pub fn bucket(&self, i: usize) -> Option<&Arc<Mutex<GradientBucket>>> {
        self.states.get(i).map(|s| &s.bucket)
    }

    /// Number of gradients added this step.
    pub fn len(&self) -> usize {
        self.order.len()
    }
    /// True when no gradient was added this step.
    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    /// Forget every gradient and bucket (waiting for background work first).
    pub fn clear(&mut self) {
        for state in &self.states {
            if let Some(w) = &state.work {
                let _ = w.wait();
            }
        }
        self.states.clear();
        self.order.clear();
        self.added = 0;
        self.expected = None;
    }
}

fn launch(group: &Arc<ProcessGroup>, bucket: &Arc<Mutex<GradientBucket>>) -> Result<Work> {
    let comm = group.comm()?.clone();
    let bucket = bucket.clone();
    group.submit(Lane::Collectives, move || comm.all_reduce(lock(&bucket).data_mut(), ReduceOp::Average))
}
