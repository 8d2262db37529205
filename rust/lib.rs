//! Data-parallel training collectives on CPUs.
//!
//! * [`ReduceOp`] and typed reductions over [`DType`]s ([`reduce::reduce_slices`]);
//! * the [`Backend`] trait, with [`MockBackend`]: an in-process world where each rank is a thread and
//!   collectives really wait for every member and exchange data through the callers' buffers;
//! * [`ProcessGroup`] and [`World`] with real subgroups;
//! * asynchronous [`Work`].
//!
//! ```
//! use std::sync::Arc;
//! use axonml_distributed::{MockBackend, ProcessGroup, ReduceOp};
//!
//! let handles: Vec<_> = MockBackend::create_world(2)
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
pub mod group;
pub mod reduce;
pub mod signature;
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
