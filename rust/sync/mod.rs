//! Synchronisation primitives below the engine, used by the engine, the work queue, the stores and the
//! worlds alike: [`lock`] (locking that survives a poisoned mutex) and [`wait`] (the one way a rank
//! waits for its peers).

pub(crate) mod lock;
pub(crate) mod wait;

pub(crate) use lock::lock;
