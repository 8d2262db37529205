//! The one [`Backend`] implementation: every public backend type that wraps an [`Engine`] (see
//! [`backend_type`]) forwards the trait to it.

use std::sync::atomic::Ordering::{Acquire, SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{Cause, Engine, Store};
use crate::backend::{Backend, SharedMem};
use crate::call;
use crate::collective::Collective;
use crate::config::LEAVE_GRACE;
use crate::dtype::{Buf, BufMut};
use crate::error::Result;
use crate::flight::{P2p, Recorder};
use crate::work::Lanes;

/// A public backend type that is an [`Engine`] over its world's store; every such type is a
/// [`Backend`] through the one implementation below.
pub(crate) trait AsEngine: Send + Sync + Sized + 'static {
    /// The world's store.
    type Store: Store;
    /// The engine inside.
    fn engine(&self) -> &Engine<Self::Store>;
    /// Wrap an engine (a new subgroup's handle).
    fn wrap(engine: Engine<Self::Store>) -> Self;
}

/// Make `$name`, a public tuple struct around an `Engine<$store>`, an [`AsEngine`] (so a
/// [`Backend`]).
macro_rules! backend_type {
    ($name:ident, $store:ty) => {
        impl $crate::engine::AsEngine for $name {
            type Store = $store;
            fn engine(&self) -> &$crate::engine::Engine<$store> {
                &self.0
            }
            fn wrap(engine: $crate::engine::Engine<$store>) -> Self {
                $name(engine)
            }
        }
    };
}
pub(crate) use backend_type;

impl<T: AsEngine> Backend for T {
    fn name(&self) -> &str {
        T::Store::NAME
    }
    fn rank(&self) -> usize {
        self.engine().store.rank()
    }
    fn world_size(&self) -> usize {
        self.engine().store.world_size()
    }
    fn members(&self) -> &[usize] {
        self.engine().store.members()
    }
    fn timeout(&self) -> Duration {
        self.engine().store.timeout()
    }
    fn lanes(&self) -> &Lanes {
        &self.engine().lanes
    }
    fn buffers_may_be_in_use(&self) -> bool {
        self.engine().undrained.load(SeqCst)
    }

    fn collective(&self, mut c: Collective<'_>) -> Result<()> {
        let s = &self.engine().store;
        self.engine().execute(call::check(&mut c, s.members(), s.rank()))
    }

    fn send(&self, buf: Buf<'_>, dst: usize, tag: u64) -> Result<()> {
        let op = call::send_op(&buf, dst, tag);
        let e = self.engine();
        let p2p = P2p::new(true, Some(dst), tag, buf.dtype(), buf.len());
        e.p2p(p2p, call::SEND_TO, op, |op| e.store.send(buf, dst, tag, op))
    }
    fn recv(&self, buf: BufMut<'_>, src: usize, tag: u64) -> Result<()> {
        let op = call::recv_op(&buf, src, tag);
        let e = self.engine();
        let p2p = P2p::new(false, Some(src), tag, buf.dtype(), buf.len());
        e.p2p(p2p, call::RECEIVE_FROM, op, |op| e.store.recv(buf, src, tag, op))
    }
    fn recv_any(&self, buf: BufMut<'_>, tag: u64) -> Result<usize> {
        let op = call::recv_any_op(&buf, tag);
        let p2p = P2p::new(false, None, tag, buf.dtype(), buf.len());
        self.engine().recv_any(p2p, op, |from, op| self.engine().store.recv_any(buf, from, tag, op))
    }

    fn sequence_number(&self) -> u64 {
        let s = &self.engine().store;
        s.ctrl(s.index()).arrive.load(Acquire)
    }

    fn split(&self, ranks: &[usize], timeout: Option<Duration>) -> Result<Arc<dyn Backend>> {
        Ok(Arc::new(T::wrap(self.engine().split(ranks, timeout)?)))
    }
    fn abort(&self, reason: &str) {
        self.engine().store.abort(reason, Cause::Other);
    }
    fn leave(&self) {
        // What this rank queued (an isend it never waited for) gets a moment to run first, so that its
        // peers find it, as MPI_Finalize completes it; but a job that waits for a peer that waits for
        // this rank must not hold that peer for its whole timeout.
        self.engine().lanes.finish_queued(Instant::now() + LEAVE_GRACE);
        self.engine().store.leave();
    }
    fn alloc(&self, bytes: usize) -> Result<Option<SharedMem>> {
        self.engine().store.alloc(bytes)
    }
    fn recorder(&self) -> Option<&Arc<Recorder>> {
        Some(self.engine().recorder())
    }
}
