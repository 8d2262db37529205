//! The one [`Backend`] implementation: every public backend type that wraps an [`Engine`] (see
//! [`backend_type`]) forwards the trait to it.

use std::sync::atomic::Ordering::SeqCst;
use std::sync::Arc;

use super::{Cause, Engine, Store};
use crate::backend::{Backend, SharedMem};
use crate::call;
use crate::dtype::{Buf, BufMut};
use crate::error::Result;
use crate::reduce::ReduceOp;
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
/// [`Backend`]), with a `timeout` method.
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

        impl $name {
            /// How long a wait lasts before it fails.
            pub fn timeout(&self) -> std::time::Duration {
                $crate::engine::Store::timeout(self.0.store())
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
    fn lanes(&self) -> &Lanes {
        &self.engine().lanes
    }
    fn buffers_may_be_in_use(&self) -> bool {
        self.engine().undrained.load(SeqCst)
    }

    fn all_reduce(&self, mut buf: BufMut<'_>, op: ReduceOp) -> Result<()> {
        self.engine().execute(call::all_reduce(&mut buf, op))
    }
    fn broadcast(&self, mut buf: BufMut<'_>, root: usize) -> Result<()> {
        self.engine().execute(call::broadcast(self.members(), &mut buf, root))
    }
    fn all_gather(&self, send: Buf<'_>, mut recv: BufMut<'_>) -> Result<()> {
        self.engine().execute(call::all_gather(self.members().len(), &send, &mut recv))
    }
    fn reduce_scatter(&self, send: Buf<'_>, mut recv: BufMut<'_>, op: ReduceOp) -> Result<()> {
        self.engine().execute(call::reduce_scatter(self.members().len(), &send, &mut recv, op))
    }
    fn gather(&self, send: Buf<'_>, mut recv: Option<BufMut<'_>>, root: usize) -> Result<()> {
        self.engine().execute(call::gather(self.members(), self.rank(), &send, recv.as_mut(), root))
    }
    fn scatter(&self, send: Option<Buf<'_>>, mut recv: BufMut<'_>, root: usize) -> Result<()> {
        self.engine().execute(call::scatter(self.members(), self.rank(), send.as_ref(), &mut recv, root))
    }
    fn reduce(&self, mut buf: BufMut<'_>, root: usize, op: ReduceOp) -> Result<()> {
        self.engine().execute(call::reduce(self.members(), &mut buf, root, op))
    }
    fn barrier(&self) -> Result<()> {
        self.engine().execute(Ok(call::barrier()))
    }

    fn send(&self, buf: Buf<'_>, dst: usize, tag: u64) -> Result<()> {
        let op = call::send_op(&buf, dst, tag);
        let e = self.engine();
        e.p2p(dst, "send to", op, |op| e.store.send(buf, dst, tag, op))
    }
    fn recv(&self, buf: BufMut<'_>, src: usize, tag: u64) -> Result<()> {
        let op = call::recv_op(&buf, src, tag);
        let e = self.engine();
        e.p2p(src, "receive from", op, |op| e.store.recv(buf, src, tag, op))
    }

    fn split(&self, ranks: &[usize]) -> Result<Arc<dyn Backend>> {
        Ok(Arc::new(T::wrap(self.engine().split(ranks)?)))
    }
    fn abort(&self, reason: &str) {
        self.engine().store.abort(reason, Cause::Other);
    }
    fn leave(&self) {
        self.engine().store.leave();
    }
    fn alloc(&self, bytes: usize) -> Result<Option<SharedMem>> {
        self.engine().store.alloc(bytes)
    }
}
