//! Taking a `std` mutex that a panicking holder may have poisoned, written once for the crate.

use std::sync::{Mutex, MutexGuard, PoisonError};

/// Locks `mutex`, taking over a lock a panicking holder poisoned. Only for data that every
/// holder changes in steps that cannot be left half done (one insert or remove, a swap), so
/// that what a panic left behind is still sound.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}
