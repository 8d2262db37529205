//! What differs per world, each implementing the engine's store (`crate::engine::Store`): the
//! in-process world (threads) and the multi-process world (shared memory).

pub mod shm;
pub mod thread;
