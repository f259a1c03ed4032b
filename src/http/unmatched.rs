//! The paths of keyed requests that matched no endpoint of a [`PolicyLayer`](crate::PolicyLayer),
//! remembered so that each is logged once: a bounded set of their hashes.
//!
//! A request that matches an endpoint never comes here. One that does not, and carries a key,
//! costs one hash of its path and a lookup under a lock, allocation-free once the set has grown.
//! The set holds at most [`CAP`] paths; past that, new paths are counted by the caller but not
//! logged, and one warning says so.

use std::collections::HashSet;
use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;

use http::Method;

use crate::sync::lock;

/// The most paths remembered (and so logged one by one): 1 024. Enough for every route of a
/// real service spelled a few ways; an attacker who sends many distinct paths fills it, and then
/// gets nothing more into the logs.
pub(crate) const CAP: usize = 1024;

/// The set of the paths' hashes (under a random key per set, so that nobody can choose paths
/// that collide); paths are never removed.
#[derive(Default)]
pub(crate) struct UnmatchedPaths {
    hasher: RandomState,
    hashes: Mutex<HashSet<u64>>,
    /// How many are remembered, for the tests.
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
        let hash = self.hasher.hash_one(path);
        // Every update leaves the set whole, so a poisoned lock's data is still sound.
        let mut hashes = lock(&self.hashes);
        if hashes.contains(&hash) {
            return Remembered::Known;
        }
        if hashes.len() >= CAP {
            let first = !self.full_logged.swap(true, Ordering::Relaxed);
            return Remembered::Full { first };
        }
        hashes.insert(hash);
        self.len.store(hashes.len(), Ordering::Relaxed);
        Remembered::New
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
