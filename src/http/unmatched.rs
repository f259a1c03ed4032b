//! The paths of keyed requests that matched no endpoint of a [`PolicyLayer`](crate::PolicyLayer),
//! remembered so that each is logged once: a bounded, lock-free set of their hashes.
//!
//! A request that matches an endpoint never comes here. One that does not, and carries a key,
//! costs one hash of its path and a probe of a table, allocation-free once the table exists
//! (it is allocated at the first such request). The table holds at most [`CAP`] paths; past
//! that, new paths are counted by the caller but not logged, and one warning says so.

use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::OnceLock;

use http::Method;

/// The most paths remembered (and so logged one by one): 1 024, 16 KiB of table. Enough for
/// every route of a real service spelled a few ways; an attacker who sends many distinct paths
/// fills it, and then gets nothing more into the logs.
pub(crate) const CAP: usize = 1024;

/// The set: open addressing with linear probing over twice [`CAP`] slots, so a probe always
/// meets an empty slot. A slot holds a path's hash with its low bit set (0 is empty); paths are
/// never removed.
#[derive(Default)]
pub(crate) struct UnmatchedPaths {
    /// A random key per set, so that nobody can choose paths that collide.
    hasher: RandomState,
    slots: OnceLock<Box<[AtomicU64]>>,
    len: AtomicUsize,
    full_logged: AtomicBool,
}

/// What [`UnmatchedPaths::remember`] found.
#[derive(Debug, PartialEq, Eq)]
enum Remembered {
    /// The path was not known: it is now.
    New,
    /// Logged before.
    Known,
    /// Not known, and the set is full: `first` for the first path turned away.
    Full { first: bool },
}

impl UnmatchedPaths {
    /// Logs the path of an unmatched keyed request, if this set has not seen it before.
    pub(crate) fn notice(&self, method: &Method, path: &str, refused: bool) {
        let what = if refused {
            "refused (NoEndpoint)"
        } else {
            "passed through unprotected"
        };
        match self.remember(path) {
            Remembered::New => tracing::warn!(
                %method,
                path,
                "a request with an idempotency key matches no endpoint of the PolicyLayer: {what}. \
                 Is the path spelled otherwise than its pattern (a trailing slash, a nest prefix)? \
                 Logged once per path"
            ),
            Remembered::Full { first: true } => tracing::warn!(
                %method,
                path,
                "a request with an idempotency key matches no endpoint of the PolicyLayer: {what}. \
                 {CAP} such paths are logged already: further ones are counted \
                 (idempotency_unmatched_requests_total) but not logged"
            ),
            Remembered::Known | Remembered::Full { first: false } => {}
        }
    }

    fn remember(&self, path: &str) -> Remembered {
        let slots = self
            .slots
            .get_or_init(|| (0..2 * CAP).map(|_| AtomicU64::new(0)).collect());
        let hash = self.hasher.hash_one(path) | 1;
        let mask = slots.len() - 1;
        // Truncating the hash on a 32-bit target still spreads the start.
        let mut i = hash as usize & mask;
        loop {
            let slot = &slots[i];
            let mut found = slot.load(Ordering::Acquire);
            if found == 0 {
                // A place is reserved before it is taken, so no more than `CAP` are ever taken.
                if self.len.fetch_add(1, Ordering::Relaxed) >= CAP {
                    self.len.fetch_sub(1, Ordering::Relaxed);
                    let first = !self.full_logged.swap(true, Ordering::Relaxed);
                    return Remembered::Full { first };
                }
                match slot.compare_exchange(0, hash, Ordering::AcqRel, Ordering::Acquire) {
                    Ok(_) => return Remembered::New,
                    Err(taken) => {
                        // Another thread took the slot first, maybe for this very path.
                        self.len.fetch_sub(1, Ordering::Relaxed);
                        found = taken;
                    }
                }
            }
            if found == hash {
                return Remembered::Known;
            }
            i = (i + 1) & mask;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_path_is_new_once_and_the_set_stops_at_its_cap() {
        let paths = UnmatchedPaths::default();
        assert_eq!(paths.remember("/payments/"), Remembered::New);
        assert_eq!(paths.remember("/payments/"), Remembered::Known);
        assert_eq!(paths.remember("/payments"), Remembered::New);
        for n in 2..CAP {
            assert_eq!(paths.remember(&format!("/p/{n}")), Remembered::New, "{n}");
        }
        assert_eq!(paths.len.load(Ordering::Relaxed), CAP);
        assert_eq!(paths.remember("/one-too-many"), Remembered::Full { first: true });
        assert_eq!(paths.remember("/two-too-many"), Remembered::Full { first: false });
        // Those remembered are still found, and only they.
        assert_eq!(paths.remember("/p/7"), Remembered::Known);
        assert_eq!(paths.remember("/payments/"), Remembered::Known);
        assert_eq!(paths.remember("/one-too-many"), Remembered::Full { first: false });
        assert_eq!(paths.len.load(Ordering::Relaxed), CAP);
    }

    #[test]
    fn threads_racing_on_one_path_see_it_new_once() {
        let paths = std::sync::Arc::new(UnmatchedPaths::default());
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let paths = paths.clone();
                std::thread::spawn(move || {
                    (0..200)
                        .filter(|n| paths.remember(&format!("/race/{}", n % 50)) == Remembered::New)
                        .count()
                })
            })
            .collect();
        let new: usize = threads.into_iter().map(|t| t.join().unwrap()).sum();
        assert_eq!(new, 50);
        assert_eq!(paths.len.load(Ordering::Relaxed), 50);
    }
}
