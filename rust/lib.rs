//! Data-parallel training collectives on CPUs: an in-process world (ranks are threads) and a
//! shared-memory world (ranks are processes of one host), with process groups and gradient buckets.
//!
//! The floors, top down. Data flows down one way: each floor knows only the ones below it (modules
//! side by side on one floor know nothing of each other).
//!
//! ```text
//! bindings            PyO3 (behind the `python` feature): the only code that names Python types
//! synchronizer        bucketed gradient averaging over a group
//! group    bucket     ProcessGroup, World, subgroups; gradient buckets
//! transport           the worlds, each implementing engine::Store: thread (ThreadBackend) and shm
//!                     (segment, join, liveness, and the pages' wire format of where buffers are)
//! engine              the meeting protocol, once: publish, wait for arrivals, compare signatures,
//!                     move data, done, drain; Engine<S: Store> implements Backend
//! backend  algo       the Backend trait every world offers (with work: Work handles, the lanes that
//!                     queue calls); data movement per collective (oneshot, direct, staged, pairwise,
//!                     cma over process_vm) and the route choice, one owner: route (with route_times)
//! work     call       queued calls; one call's checks, turned into a Call (its signature and buffers)
//! signature  flight   a call's fingerprint and the mismatch and progress reports built from it; the
//!                     flight recorder (each handle's last calls and totals, recorded by the engine)
//! reduce              operators, their dtype rules, Horovod's scaling, the kernels
//! dtype               element types and type-erased buffer views
//! rendezvous          how a job's ranks meet through a key-value store and prove they belong to it
//!                     (one protocol on every store; the job secret, checked once)
//! sync                locking that survives poisoning; wait, the one way a rank waits for its peers
//! config  error       every tunable and environment knob; the one error type (knowing nothing above)
//! ```
//!
//! No arrow climbs (tests reach anywhere: the engine's run in the thread world).
//!
//! Where to start: [`ProcessGroup`] and [`World`] ([`group`]), the [`Backend`] trait, the worlds
//! [`ThreadBackend`] and [`transport::shm`], [`GradientSynchronizer`] ([`synchronizer`]), the
//! [`Error`] every call returns.
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
//!         pg.all_reduce(&mut x, ReduceOp::Sum).unwrap();
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
pub mod collective;
pub mod config;
pub mod dtype;
mod engine;
pub mod error;
pub mod flight;
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
pub use collective::Collective;
pub use dtype::{Buf, BufMut, DType, Element};
pub use error::{Error, Result};
pub use group::{ProcessGroup, World};
pub use reduce::ReduceOp;
pub use sync::wait::set_interrupt_hook;
pub use synchronizer::{GradSyncStrategy, GradientSynchronizer};
pub use transport::thread::ThreadBackend;
pub use work::{Lane, Work};
