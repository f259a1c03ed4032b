//! The conformance kit for stores (crate feature `testing`): the behaviour suite the built-in
//! stores pass, as one call a store author runs in their own tests.
//!
//! ```
//! use tower_idempotency::MemoryStore;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! // In a `#[tokio::test]` of your own store: `MyStore::connect(..).await` in place of `MemoryStore::new()`.
//! tower_idempotency::testing::conformance(|| async { MemoryStore::new() }).await;
//! # }
//! ```
//!
//! [`conformance`] panics, listing every rule the store broke and why; [`check`] answers the
//! same as a [`Report`], for a caller that wants to look at it. Each rule is named in
//! [`RULES`]; together they cover every transition of the record's two states (claim, complete,
//! release, renew, purge, and the lapse of a lease or of a retention; every transition of the
//! model in the crate's `tests/model/store.rs`, a completion of a completed record included),
//! the owner checks, a mismatch's reason (another request, or another fingerprint policy),
//! concurrent claims, the waiting methods (`claim_waiting`, `watch`), the optional ones
//! (`peek`, `cached`, `in_flight`), and the error contract (a question about a key that holds
//! nothing is answered, not failed).
//!
//! How the kit treats a store:
//!
//! - `make_store` is called once per rule, so a store that is cheap to make can be fresh for
//!   each; a store over a server may hand out clones of one client. Every key the kit writes is
//!   in a scope of its own, made afresh for each run (`tower-idempotency-kit/...`), so records
//!   already in the store are not touched; only the listing rules
//!   (`in_flight_lists_running_records_oldest_first`, `in_flight_pages_through_many_records`)
//!   need a store with no other record in flight claimed over a minute ago, and they run last,
//!   one after the other.
//! - The optional methods keep their meaning: a store that keeps the default of
//!   [`Store::peek`] (`Ok(None)`), [`Store::watch`] (`Ok(None)`), [`Store::cached`] (`None`) or
//!   [`Store::in_flight`] ([`StoreError::Unsupported`](crate::StoreError::Unsupported)) passes their rules, reported as
//!   [not offered](Report::not_offered); a store that answers them must answer right.
//! - Leases and retentions are short (150 ms to 1 s), so a store must honour them to the
//!   millisecond's order (a store whose expiry runs on a sweep every minute fails
//!   `an_expired_lease_frees_the_key_and_fences_the_old_owner` and `retention_ends`). Rules run
//!   side by side, so the whole kit takes about two seconds of waiting, and the listing rules'
//!   1,500 claims.
//! - The kit never panics on a store's answer: a wrong answer or an error fails the rule, and
//!   the other rules still run. A store that panics fails the run with its own panic.
//!
//! The crate's own tests run the kit against [`MemoryStore`](crate::MemoryStore), `RedisStore`
//! (standalone, Sentinel and Cluster) and `PostgresStore` (`tests/store_suite.rs`), and against
//! a set of deliberately broken stores, each caught by at least one rule
//! (`tests/store_kit.rs`).

mod listing;
mod rules;
mod support;

use std::future::Future;
use std::sync::Arc;

use crate::store::Store;

pub use self::rules::RULES;
pub use self::support::Verdict;

/// The verdict of every rule of [`RULES`], from [`check`].
#[derive(Debug, Clone, Default)]
pub struct Report {
    /// Each rule's name and verdict, in the order of [`RULES`].
    pub verdicts: Vec<(&'static str, Verdict)>,
}

impl Report {
    /// Whether the store kept every rule (a rule of a method it does not offer counts as kept).
    pub fn passed(&self) -> bool {
        self.failures().next().is_none()
    }

    /// The rules the store broke, each with what went wrong.
    pub fn failures(&self) -> impl Iterator<Item = (&'static str, &str)> {
        self.verdicts.iter().filter_map(|(rule, verdict)| match verdict {
            Verdict::Failed(reason) => Some((*rule, reason.as_str())),
            _ => None,
        })
    }

    /// The rules of optional methods the store does not offer.
    pub fn not_offered(&self) -> impl Iterator<Item = &'static str> + '_ {
        (self.verdicts.iter())
            .filter_map(|(rule, verdict)| (*verdict == Verdict::NotOffered).then_some(*rule))
    }

    /// The verdict on `rule`, if it is one of [`RULES`].
    pub fn verdict(&self, rule: &str) -> Option<&Verdict> {
        (self.verdicts.iter()).find_map(|(name, verdict)| (*name == rule).then_some(verdict))
    }
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let broken = self.failures().count();
        writeln!(
            f,
            "{broken} of {} store conformance rules broken",
            self.verdicts.len()
        )?;
        for (rule, reason) in self.failures() {
            writeln!(f, "- {rule}: {reason}")?;
        }
        let not_offered: Vec<&str> = self.not_offered().collect();
        if !not_offered.is_empty() {
            writeln!(f, "not offered (optional): {}", not_offered.join(", "))?;
        }
        Ok(())
    }
}

/// Runs every rule of [`RULES`] against stores made by `make_store`, and panics with the list
/// of the rules broken, if any; see the [module](self) for what it checks and how.
///
/// Needs a Tokio runtime (the concurrency rule spawns tasks): call it from `#[tokio::test]`.
pub async fn conformance<S, F, Fut>(make_store: F)
where
    S: Store,
    F: FnMut() -> Fut,
    Fut: Future<Output = S>,
{
    let report = check(make_store).await;
    assert!(report.passed(), "{report}");
}

/// Runs every rule of [`RULES`] against stores made by `make_store` and reports each verdict;
/// [`conformance`] is this with an assertion.
///
/// ```
/// use tower_idempotency::MemoryStore;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let report = tower_idempotency::testing::check(|| async { MemoryStore::new() }).await;
/// assert!(report.passed(), "{report}");
/// assert_eq!(report.not_offered().count(), 0, "the memory store offers every method");
/// # }
/// ```
pub async fn check<S, F, Fut>(mut make_store: F) -> Report
where
    S: Store,
    F: FnMut() -> Fut,
    Fut: Future<Output = S>,
{
    let run = support::Run::new();
    let mut side_by_side = Vec::new();
    let mut last = Vec::new();
    for rule in RULES {
        let store: Arc<dyn Store> = Arc::new(make_store().await);
        if rule.alone {
            last.push((rule, store));
        } else {
            side_by_side.push(async { (rule.name, (rule.check)(run.clone(), store).await) });
        }
    }
    let mut verdicts: Vec<(&'static str, Verdict)> = futures_util::future::join_all(side_by_side).await;
    for (rule, store) in last {
        verdicts.push((rule.name, (rule.check)(run.clone(), store).await));
    }
    verdicts.sort_by_key(|(name, _)| RULES.iter().position(|rule| rule.name == *name));
    Report { verdicts }
}
