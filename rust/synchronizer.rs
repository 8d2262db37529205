//! The gradient synchronizer: the one engine that averages gradients across a group, bucket by bucket.
//!
//! Its buckets are laid out up front from the parameters ([`GradientSynchronizer::for_parameters`]: what
//! the DDPs and the Horovod-style optimizer use, each gradient a view into its bucket) or fill as
//! gradients are added ([`GradientSynchronizer::add_gradient`], buckets in index order). A bucket is
//! complete when every gradient it holds is in; complete buckets start their all-reduce (AVERAGE) in
//! bucket order, on the group's worker, while the caller goes on ([`GradSyncStrategy::Overlapped`]): so
//! every rank issues the same collectives in the same order. [`GradientSynchronizer::finish`] (laid-out
//! buckets) and [`GradientSynchronizer::sync_all`] (filled ones) reduce what is left and wait.
//!
//! Every bucket's reduction is stamped (ready, launched, returned) on the monotonic clock: the timeline
//! logs the stamps, and each step's figures ([`StepStats`]: compute, visible and overlapped sync) are
//! computed from them.

use std::sync::{Arc, Mutex};
use std::time::Instant;

mod averaging;
mod stats;

pub use averaging::{Averaging, Pending, SharedBucket};
pub use stats::{StepRecord, StepStats, STEPS_KEPT};

use crate::bucket::{assign_buckets, Entry, GradientBucket};
use crate::dtype::{Buf, BufMut, DType};
use crate::error::{Error, Result};
use crate::flight::{self, BucketEvent};
use crate::sync::lock;
use stats::Reduction;

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
    bucket: SharedBucket,
    /// Gradients still to come before the bucket is complete (a bucket that fills as gradients are
    /// added counts 1 until it is closed).
    pending: usize,
    /// Its gradients, as positions in `slots`.
    members: Vec<usize>,
    /// Its background all-reduce, once started.
    work: Option<Pending>,
    /// When it became complete and when its all-reduce started, this step.
    ready_at: Option<Instant>,
    launched_at: Option<Instant>,
}

impl BucketState {
    fn new(bucket: SharedBucket, pending: usize, members: Vec<usize>) -> Self {
        BucketState { bucket, pending, members, work: None, ready_at: None, launched_at: None }
    }

    /// No gradient is to come any more: it is ready now (if it was not already).
    fn complete(&mut self) {
        self.pending = 0;
        self.ready_at.get_or_insert_with(Instant::now);
    }

    /// Its all-reduce starts now.
    fn launch(&mut self) {
        self.launched_at = Some(Instant::now());
    }

    /// Its all-reduce returned, if its group did not stamp that already (a group written in Python).
    fn returned(&self) {
        lock(&self.bucket).reduced_at.get_or_insert_with(Instant::now);
    }
}

/// One gradient's place: its bucket and entry there, and whether it is in for this reduction.
struct Slot {
    bucket: usize,
    entry: usize,
    ready: bool,
}

/// Buckets gradients and averages them across a group.
pub struct GradientSynchronizer {
    strategy: GradSyncStrategy,
    bucket_size: usize,
    /// Buckets laid out up front (the DDPs'); else they fill as gradients are added.
    laid_out: bool,
    expected: Option<usize>,
    states: Vec<BucketState>,
    slots: Vec<Slot>,
    /// The first bucket not yet started: buckets start in order, the same on every rank.
    next: usize,
    group: Option<Arc<dyn Averaging>>,
    /// When this step began ([`Self::begin_step`], or its first gradient).
    step_start: Option<Instant>,
    stats: StepStats,
}

impl GradientSynchronizer {
    /// A synchronizer whose buckets fill as gradients are added, `bucket_size` elements each.
    pub fn new(strategy: GradSyncStrategy, bucket_size: usize) -> Self {
        GradientSynchronizer {
            strategy,
            bucket_size: bucket_size.max(1),
            laid_out: false,
            expected: None,
            states: Vec::new(),
            slots: Vec::new(),
            next: 0,
            group: None,
            step_start: None,
            stats: StepStats::default(),
        }
    }

    /// An overlapped synchronizer over `group` for gradients of `params` ((dtype, shape) in the owner's
    /// order), in buckets of at most `cap_bytes` laid out by [`assign_buckets`] and allocated in the
    /// group's shared memory when it has some. Gradient `i` is then entry `i` of [`Self::bucket_of`].
    pub fn for_parameters(
        group: Arc<dyn Averaging>,
        params: &[(DType, Vec<usize>)],
        cap_bytes: usize,
    ) -> Result<Self> {
        let nbytes: Vec<usize> = params
            .iter()
            .map(|(d, s)| s.iter().try_fold(d.size(), |a, &n| a.checked_mul(n)).unwrap_or(usize::MAX))
            .collect();
        let dtypes: Vec<DType> = params.iter().map(|(d, _)| *d).collect();
        let layout = assign_buckets(&nbytes, &dtypes, cap_bytes);
        let mut slots: Vec<Option<Slot>> = (0..params.len()).map(|_| None).collect();
        let mut states = Vec::with_capacity(layout.len());
        for (b, members) in layout.into_iter().enumerate() {
            let shapes = members.iter().map(|&i| params[i].1.clone()).collect();
            let bucket = GradientBucket::laid_out(params[members[0]].0, shapes, group.backend())?;
            for (entry, &i) in members.iter().enumerate() {
                slots[i] = Some(Slot { bucket: b, entry, ready: false });
            }
            let pending = members.len();
            states.push(BucketState::new(Arc::new(Mutex::new(bucket)), pending, members));
        }
        Ok(GradientSynchronizer {
            strategy: GradSyncStrategy::Overlapped,
            bucket_size: cap_bytes,
            laid_out: true,
            expected: None,
            states,
            slots: slots.into_iter().map(|s| s.expect("assign_buckets places every parameter")).collect(),
            next: 0,
            group: Some(group),
            step_start: None,
            stats: StepStats::default(),
        })
    }

    /// The strategy.
    pub fn strategy(&self) -> GradSyncStrategy {
        self.strategy
    }
    /// Elements per bucket (bytes for laid-out buckets).
    pub fn bucket_size(&self) -> usize {
        self.bucket_size
    }
    /// Number of buckets (used this step, for buckets that fill).
    pub fn num_buckets(&self) -> usize {
        self.states.len()
    }
    /// Bucket `i`, for views over its buffer.
    pub fn bucket(&self, i: usize) -> Option<&SharedBucket> {
        self.states.get(i).map(|s| &s.bucket)
    }
    /// The gradients of each bucket, as their positions (the owner's order), in reduction order.
    pub fn assignment(&self) -> Vec<Vec<usize>> {
        self.states.iter().map(|s| s.members.clone()).collect()
    }
    /// Gradient `i`'s bucket and its entry there.
    pub fn bucket_of(&self, i: usize) -> Result<(usize, Entry)> {
        let s = self.slot(i)?;
        Ok((s.bucket, lock(&self.states[s.bucket].bucket).entries()[s.entry].clone()))
    }
    /// Buckets whose all-reduce was started in the background this step.
    pub fn launched(&self) -> usize {
        self.states.iter().filter(|s| s.work.is_some()).count()
    }
    /// Number of gradients (added this step, for buckets that fill).
    pub fn len(&self) -> usize {
        self.slots.len()
    }
    /// True when there is no gradient.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }
    /// The step begins now (its first training forward), unless it already began: its compute is
    /// counted from here. Without this call a step begins at its first gradient.
    pub fn begin_step(&mut self) {
        self.step_start.get_or_insert_with(Instant::now);
    }
    /// The figures of every step reduced successfully so far (see [`StepRecord`]).
    pub fn stats(&self) -> &StepStats {
        &self.stats
    }

    fn slot(&self, i: usize) -> Result<&Slot> {
        self.slots.get(i).ok_or_else(|| Error::invalid(format!("no gradient {i} in this synchronizer")))
    }

    // -- laid-out buckets: a gradient is ready in its view, then `finish` --------------------------------

    /// Whether gradient `i` is in its bucket for the reduction under way.
    pub fn is_ready(&self, i: usize) -> Result<bool> {
        Ok(self.slot(i)?.ready)
    }
    /// Whether a reduction has started (some gradient is in) and not finished.
    pub fn in_flight(&self) -> bool {
        self.slots.iter().any(|s| s.ready)
    }
    /// The gradients not in yet, in order.
    pub fn waiting(&self) -> Vec<usize> {
        (0..self.slots.len()).filter(|&i| !self.slots[i].ready).collect()
    }

    /// Gradient `i` is in its view: start every bucket now complete, in order, except the last, whose
    /// gradients come last in backward (so nothing is left to overlap it with): `finish` reduces it.
    pub fn ready(&mut self, i: usize) -> Result<()> {
        if !self.laid_out {
            return Err(Error::invalid("ready(): this synchronizer's buckets fill through add_gradient"));
        }
        let slot = self.slots.get_mut(i).ok_or_else(|| Error::invalid(format!("no gradient {i}")))?;
        if slot.ready {
            return Err(Error::invalid(format!("gradient {i} is already in for this reduction")));
        }
        slot.ready = true;
        let b = slot.bucket;
        self.step_start.get_or_insert_with(Instant::now);
        self.states[b].pending -= 1;
        if self.states[b].pending == 0 {
            self.states[b].complete();
        }
        self.start_complete(false)
    }

    /// End the reduction: gradients not in and not `used` (no backward reached them on this rank) count
    /// as zeros; with `exchange`, which gradients some rank used is agreed on (a MAX over the group, after
    /// the buckets already started); the buckets left start (the last one on this thread); all are
    /// waited for. Returns, with `exchange`, whether some rank used each gradient. Every gradient is out
    /// again afterwards, even on an error.
    pub fn finish(&mut self, used: &[bool], exchange: bool) -> Result<Option<Vec<bool>>> {
        if !self.laid_out {
            return Err(Error::invalid(
                "finish(): this synchronizer's buckets fill through add_gradient; use sync_all",
            ));
        }
        if used.len() != self.slots.len() {
            return Err(Error::invalid(format!(
                "finish: {} use flags for {} gradients",
                used.len(),
                self.slots.len()
            )));
        }
        let called = Instant::now();
        let r = self.finish_inner(used, exchange);
        for s in &mut self.slots {
            s.ready = false;
        }
        for st in &mut self.states {
            st.pending = st.members.len();
            if let Some(w) = st.work.take() {
                let _ = w(); // only after an error: the first one is what the caller hears
            }
        }
        self.end_step(called, r.is_ok());
        self.next = 0;
        r
    }

    fn finish_inner(&mut self, used: &[bool], exchange: bool) -> Result<Option<Vec<bool>>> {
        for (slot, &u) in self.slots.iter().zip(used) {
            if !slot.ready && !u {
                lock(&self.states[slot.bucket].bucket).zero_entry(slot.entry);
            }
        }
        for st in &mut self.states {
            st.complete();
        }
        let group = self.group.clone().ok_or_else(|| Error::invalid("finish: no group"))?;
        let global = if exchange {
            let mut flags: Vec<u8> = used.iter().map(|&u| u8::from(u)).collect();
            group.max_flags(&mut flags)?;
            Some(flags.into_iter().map(|f| f != 0).collect())
        } else {
            None
        };
        self.start_complete(true)?;
        self.wait_all()?;
        Ok(global)
    }

    /// Start the complete buckets, in order, from the first not started. The last laid-out bucket waits
    /// for `last` and then runs on this thread: a hand-off to the worker would only add a thread
    /// wake-up, most of a small model's step.
    fn start_complete(&mut self, last: bool) -> Result<()> {
        if self.strategy != GradSyncStrategy::Overlapped {
            return Ok(());
        }
        let Some(group) = self.group.clone() else { return Ok(()) };
        while self.next < self.states.len() && self.states[self.next].pending == 0 {
            let is_last = self.next + 1 == self.states.len();
            let st = &mut self.states[self.next];
            if !lock(&st.bucket).is_empty() {
                if self.laid_out && is_last {
                    if !last {
                        return Ok(());
                    }
                    st.launch();
                    group.run(&st.bucket)?;
                    st.returned();
                } else {
                    st.launch();
                    st.work = Some(group.start(&st.bucket)?);
                }
            }
            self.next += 1;
        }
        Ok(())
    }

    /// The step's reduction returned (`ok`: successfully; `called`: when `finish` or `sync_all` was
    /// called), every bucket waited for: count its figures in, log its buckets in the group's recorder
    /// with a timeline on, and forget its stamps.
    fn end_step(&mut self, called: Instant, ok: bool) {
        let returned = Instant::now();
        let timeline = flight::timeline_on();
        let mut recorder = None;
        let mut reductions = Vec::new();
        for (b, st) in self.states.iter_mut().enumerate() {
            let (ready, launched) = (st.ready_at.take(), st.launched_at.take());
            let mut bucket = lock(&st.bucket);
            let reduced = bucket.reduced_at.take();
            let Some(launched) = launched else { continue };
            let bytes = (bucket.size() as u64).saturating_mul(bucket.dtype().map_or(0, |d| d.size() as u64));
            let done = reduced.unwrap_or(returned);
            reductions.push(Reduction { launched, done, bytes });
            if !timeline {
                continue;
            }
            let Some(r) = recorder.get_or_insert_with(|| self.group.as_ref().and_then(|g| g.recorder()))
            else {
                continue;
            };
            r.bucket(BucketEvent {
                bucket: b,
                bytes,
                ready_ns: flight::wall_ns(ready.unwrap_or(launched)),
                launched_ns: flight::wall_ns(launched),
                done_ns: flight::wall_ns(done),
                ok,
            });
        }
        let start = self.step_start.take().unwrap_or(called);
        if ok {
            let step = self.stats.next_step();
            self.stats.push(StepRecord::new(step, start.min(called), called, returned, &reductions));
        }
    }

    /// Wait for every background bucket; the first error.
    fn wait_all(&mut self) -> Result<()> {
        let mut first = Ok(());
        for st in &mut self.states {
            if let Some(w) = st.work.take() {
                match (w(), &first) {
                    (Ok(()), _) => st.returned(),
                    (Err(e), Ok(())) => first = Err(e),
                    (Err(_), Err(_)) => {}
                }
            }
        }
        first
    }

    // -- buckets that fill as gradients are added ---------------------------------------------------------

    /// Start a step of `num_gradients` gradients; with `group`, overlapped buckets start as they complete
    /// (without one, they start in `sync_all`).
    pub fn prepare(&mut self, num_gradients: usize, group: Option<Arc<dyn Averaging>>) {
        self.clear();
        self.expected = Some(num_gradients);
        self.group = group;
    }

    /// Copy `grad` (of `shape`) into bucket `bucket`; returns its position in the order of gradients.
    pub fn add_gradient(&mut self, bucket: usize, grad: Buf<'_>, shape: &[usize]) -> Result<usize> {
        if self.laid_out {
            return Err(Error::invalid(
                "add_gradient: this synchronizer's buckets are laid out; use ready()",
            ));
        }
        if self.expected.is_some_and(|n| self.slots.len() >= n) {
            return Err(Error::invalid(format!(
                "prepare() announced {} gradients for this step and all have been added",
                self.slots.len()
            )));
        }
        if bucket >= self.states.len() {
            self.states.resize_with(bucket + 1, || {
                BucketState::new(Arc::new(Mutex::new(GradientBucket::new(self.bucket_size))), 1, Vec::new())
            });
        }
        if self.states[bucket].pending == 0 {
            return Err(Error::invalid(format!(
                "bucket {bucket} is already complete (buckets fill in index order); use a later bucket"
            )));
        }
        let (entry, full) = {
            let mut b = lock(&self.states[bucket].bucket);
            // A gradient larger than a whole bucket gets a bucket of its own size (as in torch's DDP).
            if b.is_empty() && grad.len() > b.capacity() {
                *b = GradientBucket::new(grad.len());
            }
            if !b.add_buf(grad, shape)? {
                return Err(Error::invalid(format!(
                    "bucket {bucket} is full: {} of {} elements used, the gradient has {}; use another bucket",
                    b.size(),
                    b.capacity(),
                    grad.len()
                )));
            }
            (b.entries().len() - 1, b.is_full())
        };
        self.step_start.get_or_insert_with(Instant::now);
        let i = self.slots.len();
        self.slots.push(Slot { bucket, entry, ready: true });
        self.states[bucket].members.push(i);
        for st in &mut self.states[..bucket] {
            st.complete();
        }
        if full || self.expected == Some(self.slots.len()) {
            self.states[bucket].complete();
        }
        self.start_complete(false)?;
        Ok(i)
    }

    /// Average every bucket across `group` (nothing with `NoSync`), waiting for background work.
    /// Returns the first error; the averaged values are then available through [`Self::averaged`].
    pub fn sync_all(&mut self, group: Arc<dyn Averaging>) -> Result<()> {
        if self.strategy == GradSyncStrategy::NoSync {
            return Ok(());
        }
        let called = Instant::now();
        self.group = Some(group.clone());
        for st in &mut self.states {
            st.complete();
        }
        let r = self.reduce_all(&*group);
        self.end_step(called, r.is_ok());
        r
    }

    /// `sync_all`'s reductions: every bucket left, then the wait.
    fn reduce_all(&mut self, group: &dyn Averaging) -> Result<()> {
        if self.strategy == GradSyncStrategy::Synchronous {
            for st in &mut self.states[self.next..] {
                if !lock(&st.bucket).is_empty() {
                    st.launch();
                    group.run(&st.bucket)?;
                    st.returned();
                }
            }
            self.next = self.states.len();
        }
        self.start_complete(true)?;
        self.wait_all()
    }

    /// Copy gradient `i` (in the order added) out of its bucket into `out` (same dtype and length).
    pub fn averaged(&self, i: usize, mut out: BufMut<'_>) -> Result<()> {
        let s = self.slot(i)?;
        let bucket = lock(&self.states[s.bucket].bucket);
        let e = &bucket.entries()[s.entry];
        let (offset, len) = (e.offset, e.len());
        let data = bucket.data();
        if out.dtype() != data.dtype() || out.len() != len {
            return Err(Error::invalid("averaged: the output must match the gradient's dtype and size"));
        }
        let size = data.dtype().size();
        out.bytes_mut().copy_from_slice(&data.bytes()[offset * size..(offset + len) * size]);
        Ok(())
    }

    /// Forget every gradient and bucket that filled (waiting for background work first); laid-out
    /// buckets stay, their reduction waited for and ended.
    pub fn clear(&mut self) {
        let _ = self.wait_all();
        self.step_start = None;
        if self.laid_out {
            for st in &mut self.states {
                st.pending = st.members.len();
                (st.ready_at, st.launched_at) = (None, None);
                lock(&st.bucket).reduced_at = None;
            }
            for s in &mut self.slots {
                s.ready = false;
            }
            self.next = 0;
            return;
        }
        self.states.clear();
        self.slots.clear();
        self.next = 0;
        self.expected = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::group::ProcessGroup;
    use crate::transport::thread::ThreadBackend;

    #[test]
    fn laid_out_buckets_average_in_order_and_agree_on_use() {
        let params = vec![(DType::F32, vec![2]), (DType::F64, vec![3]), (DType::F32, vec![1, 2])];
        let handles: Vec<_> = ThreadBackend::create_world(2)
            .into_iter()
            .map(|b| {
                let params = params.clone();
                std::thread::spawn(move || {
                    let group: Arc<dyn Averaging> = Arc::new(ProcessGroup::new(Arc::new(b)));
                    let r = group.backend().map(|b| b.rank()).unwrap_or(0) as f32;
                    let mut sync = GradientSynchronizer::for_parameters(group, &params, 8).unwrap();
                    assert_eq!(sync.assignment(), vec![vec![2], vec![1], vec![0]]);
                    for i in [2, 0] {
                        let (b, e) = sync.bucket_of(i).unwrap();
                        let mut bucket = lock(sync.bucket(b).unwrap());
                        let mut data = bucket.data_mut();
                        let bytes = &mut data.bytes_mut()[e.offset * 4..(e.offset + e.len()) * 4];
                        bytes.copy_from_slice(&(r + 1.0).to_ne_bytes().repeat(e.len()));
                    }
                    sync.ready(2).unwrap();
                    let global = sync.finish(&[true, r == 0.0, true], true).unwrap().unwrap();
                    assert!(!sync.in_flight());
                    let f32s = |i| {
                        let (b, e) = sync.bucket_of(i).unwrap();
                        let bucket = lock(sync.bucket(b).unwrap());
                        bucket.data().typed::<f32>().unwrap()[e.offset..e.offset + e.len()].to_vec()
                    };
                    (global, f32s(0), f32s(2))
                })
            })
            .collect();
        for h in handles {
            let (global, a, c) = h.join().unwrap();
            assert_eq!(global, vec![true, true, true]);
            assert_eq!((a, c), (vec![1.5, 1.5], vec![1.5, 1.5]));
        }
    }
}
