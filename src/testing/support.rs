//! What every rule of the kit shares: the lease and retention it claims with, a run's fresh
//! scope (`Run`), the calls that turn a store's wrong answer into a failed rule (`ensure!`,
//! `answer`), and the verdict a rule comes to. Below both the rules and the listing's rules, so
//! that neither imports the other's helpers.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use crate::fingerprint::Fingerprint;
use crate::key::{IdempotencyKey, RecordKey};
use crate::store::{ClaimOutcome, OwnerToken, Store, StoreError};

pub(super) const LEASE: Duration = Duration::from_secs(30);
pub(super) const RETENTION: Duration = Duration::from_secs(3600);

/// What one rule found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// The store kept the rule.
    Passed,
    /// The store does not offer the optional method the rule checks (it keeps the trait's
    /// default), which the trait allows.
    NotOffered,
    /// The store broke the rule: what it answered, and what the rule expected.
    Failed(String),
}

/// What a rule's body answers: `Ok(true)` kept, `Ok(false)` not offered, `Err` broken.
pub(super) type Outcome = Result<bool, String>;

/// Fails the rule with a message unless `cond` holds.
macro_rules! ensure {
    ($cond:expr, $($message:tt)+) => {
        if !$cond {
            return Err(format!($($message)+));
        }
    };
}
pub(super) use ensure;

/// A store's answer, or the rule's failure naming the call that erred.
pub(super) fn answer<T>(result: Result<T, StoreError>, call: &str) -> Result<T, String> {
    result.map_err(|error| format!("{call} failed: {error}"))
}

/// One run of the kit: the scope every key it writes lives in, fresh for each run, so a run
/// never meets the records of an earlier one (or of anyone else) in a shared store.
#[derive(Clone)]
pub(super) struct Run {
    scope: Arc<str>,
}

impl Run {
    pub(super) fn new() -> Self {
        Self {
            scope: format!("tower-idempotency-kit/{}", OwnerToken::generate().as_str()).into(),
        }
    }

    /// The record of `name` in this run's scope.
    pub(super) fn key(&self, name: &str) -> RecordKey {
        self.key_in("", name)
    }

    /// The record of `name` in this run's sub-scope `within`.
    pub(super) fn key_in(&self, within: &str, name: &str) -> RecordKey {
        let scope = format!("{}/{within}", self.scope);
        // The names are the kit's own, all visible ASCII, so this cannot fail; a fallback
        // key keeps the rule from panicking anyway.
        let key = IdempotencyKey::parse(name).or_else(|_| IdempotencyKey::parse("kit-key"));
        match key {
            Ok(key) => RecordKey::new(Some(&scope), key),
            Err(_) => unreachable!("`kit-key` is a valid key"),
        }
    }
}

/// `N` owner tokens, each new.
pub(super) fn owners<const N: usize>() -> [OwnerToken; N] {
    std::array::from_fn(|_| OwnerToken::generate())
}

pub(super) fn fingerprint(body: &str) -> Fingerprint {
    Fingerprint::new([body.as_bytes()])
}

pub(super) async fn claim(
    store: &dyn Store,
    key: &RecordKey,
    body: &str,
    owner: &OwnerToken,
    lease: Duration,
) -> Result<ClaimOutcome, String> {
    claim_with(store, key, &fingerprint(body), owner, lease).await
}

/// A claim presenting `fingerprint` as it is (a policy tag, say).
pub(super) async fn claim_with(
    store: &dyn Store,
    key: &RecordKey,
    fingerprint: &Fingerprint,
    owner: &OwnerToken,
    lease: Duration,
) -> Result<ClaimOutcome, String> {
    answer(store.claim(key, fingerprint, owner, lease).await, "claim")
}

pub(super) async fn complete(
    store: &dyn Store,
    key: &RecordKey,
    owner: &OwnerToken,
    payload: &'static [u8],
    retention: Duration,
) -> Result<bool, String> {
    let completion = store.complete(key, owner, Bytes::from_static(payload), retention);
    answer(completion.await, "complete")
}

/// The first claim of a key the rule just made up, which must be claimed.
pub(super) async fn first_claim(
    store: &dyn Store,
    key: &RecordKey,
    body: &str,
    owner: &OwnerToken,
    lease: Duration,
) -> Result<(), String> {
    let outcome = claim(store, key, body, owner, lease).await?;
    ensure!(
        outcome == ClaimOutcome::Claimed,
        "the first claim of a free key answered {outcome:?}"
    );
    Ok(())
}

/// The owner's completion of its claim, which must succeed.
pub(super) async fn completed(
    store: &dyn Store,
    key: &RecordKey,
    owner: &OwnerToken,
    payload: &'static [u8],
    retention: Duration,
) -> Result<(), String> {
    ensure!(
        complete(store, key, owner, payload, retention).await?,
        "the owner's completion of its claim answered false"
    );
    Ok(())
}
