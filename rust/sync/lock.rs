//! Locking that survives a poisoned mutex: a panic while holding one of our locks is already turned
//! into an error (see `ProcessGroup::submit`), and the state the locks guard stays consistent.

use std::sync::{Mutex, MutexGuard};

/// Lock `m`, taking the guard of a poisoned mutex as it is.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
