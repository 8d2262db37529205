//! What differs per world, each implementing the engine's store (`crate::engine::Store`): the
//! in-process world (threads) and the multi-process world (shared memory), plus the waiting primitive
//! both use.

pub mod shm;
pub mod thread;
pub(crate) mod wait;
