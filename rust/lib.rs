//! Data-parallel training collectives on CPUs: an in-process world (ranks are threads) and a
//! shared-memory world (ranks are processes of one host), with process groups and gradient buckets.
//!
//! The layers, top down, each knowing only the ones below it:
//! * groups: [`group`] ([`ProcessGroup`], [`World`], subgroups), [`synchronizer`] (bucketed gradient
//!   averaging), [`work`] (queued asynchronous calls);
//! * the protocol: `engine` (publish, wait for arrivals, compare signatures, move data, done, drain:
//!   written once, against the `engine::Store` that each world implements), which implements the
//!   [`backend`] trait [`Backend`];
//! * data movement: `algo` (one-shot, direct owner-computes and copies, staged pipeline);
//! * worlds: [`transport`], with [`transport::thread`] ([`ThreadBackend`]) and [`transport::shm`]
//!   (segment, joining, liveness), and `transport::wait`, the one way to wait;
//! * meeting: [`rendezvous`] (how the ranks of a job meet through a key-value store and prove they
//!   belong to it: one protocol on every store);
//! * core types: [`config`] (every tunable and environment knob), `call` (argument checks),
//!   [`signature`], [`dtype`], [`reduce`] (the kernels), [`bucket`], [`error`].
//!
//! The Python bindings (`bindings`, behind the `python` feature) sit on top and are the only code that
//! names Python types.
//!
//! ```
//! use std::sync::Arc;
//! use axonml_distributed::{ProcessGroup, ReduceOp, ThreadBackend};
//!
//! let handles: Vec<_> = ThreadBackend::create_world(2)
//!     .into_iter()
//!     .map(|b| std::thread::spawn(move || {
//!         let pg = ProcessGroup::new(Arc::new(b));
//!         let mut x = vec![pg.rank() as f32 + 1.0; 3];
//!         pg.all_reduce_tensor(&mut x, ReduceOp::Sum).unwrap();
//!         x
//!     }))
//!     .collect();
//! for h in handles {
//!     assert_eq!(h.join().unwrap(), vec![3.0; 3]);
//! }
//! ```
#![warn(missing_docs, unsafe_op_in_unsafe_fn)]

mod algo;
pub mod backend;
pub mod bucket;
mod call;
pub mod config;
pub mod dtype;
mod engine;
pub mod error;
#[cfg(any(test, feature = "fuzzing"))]
#[doc(hidden)]
pub mod fuzzing;
pub mod group;
pub mod reduce;
pub mod rendezvous;
pub mod signature;
mod sync;
pub mod synchronizer;
pub mod transport;
pub mod work;

#[cfg(feature = "python")]
mod bindings;

pub use backend::Backend;
pub use bucket::GradientBucket;
pub use dtype::{Buf, BufMut, DType, Element};
pub use error::{Error, Result};
pub use group::{ProcessGroup, World};
pub use reduce::ReduceOp;
pub use synchronizer::{GradSyncStrategy, GradientSynchronizer};
pub use transport::thread::{MockBackend, ThreadBackend};
pub use transport::wait::set_interrupt_hook;
pub use work::{Lane, Work};
