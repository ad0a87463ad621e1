//! Locking a mutex whatever a panicking holder left: every change the crate makes under a lock is
//! one assignment or one map operation, so a poisoned lock holds nothing half-written and is safe
//! to keep using (refusing it would turn one panic into a failure of every later request).

use std::sync::{Mutex, MutexGuard, PoisonError};

/// The guard of `mutex`, poisoned or not.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}
