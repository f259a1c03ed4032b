//! The conformance kit bites: a store of a page, written as a store author would, passes it,
//! and each deliberately broken variant of it (or of `MemoryStore`, for the optional methods)
//! breaks the rule that guards what it got wrong. The built-in stores run through the kit in
//! `tests/store_suite.rs`.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;
use tower_idempotency::testing::{check, Verdict, RULES};
use tower_idempotency::{
    ClaimOutcome, Fingerprint, InFlightRecord, KeyWatch, MemoryStore, OwnerToken, RecordInfo, RecordKey,
    RecordState, Store, StoreError, StoreFuture,
};

/// One thing a store can get wrong.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Flaw {
    /// A sound store.
    None,
    CompleteWithoutOwnerCheck,
    ReleaseWithoutOwnerCheck,
    RenewWithoutOwnerCheck,
    /// Reads, lets other tasks run, then writes: two claims can both find the key free.
    NonAtomicClaim,
    LeaseNeverLapses,
    RetentionNeverEnds,
    /// Keeps the payload as text, as a store with a string column might.
    ReplayChangesBytes,
    FingerprintIgnored,
    /// Keeps the digest but not the policy tag: a policy change reads as another request.
    PolicyTagDropped,
    ClaimConflictsWithItself,
    RenewDoesNotExtend,
    PurgeSparesInFlight,
    /// Addresses records by the client's key alone, without the scope.
    ScopeIgnored,
    /// Answers an error for a key that holds nothing.
    ErrorOnAbsentKey,
    /// Takes any completion of a completed record for its owner's, sent again: answers `true`
    /// to a lapsed owner whose key another owner completed since.
    CompletedRecordNotOwnerChecked,
    /// A completion sent again writes its payload over the one stored.
    CompletionRewritesTheRecord,
}

enum Record {
    InFlight {
        owner: OwnerToken,
        fingerprint: Fingerprint,
        until: Instant,
    },
    Completed {
        owner: OwnerToken,
        fingerprint: Fingerprint,
        payload: Bytes,
        until: Instant,
    },
}

impl Record {
    fn until(&self) -> Instant {
        match self {
            Record::InFlight { until, .. } | Record::Completed { until, .. } => *until,
        }
    }
}

/// A store in a `HashMap`, with only the required methods: what a store author starts from.
struct PageStore {
    flaw: Flaw,
    records: Mutex<HashMap<Vec<u8>, Record>>,
}

impl PageStore {
    fn new(flaw: Flaw) -> Self {
        Self {
            flaw,
            records: Mutex::new(HashMap::new()),
        }
    }

    fn address(&self, key: &RecordKey) -> Vec<u8> {
        if self.flaw == Flaw::ScopeIgnored {
            key.key().as_str().as_bytes().to_vec()
        } else {
            key.digest().to_vec()
        }
    }

    /// The live record at `key`, with the expired ones dropped on the way.
    fn live<T>(&self, key: &RecordKey, then: impl FnOnce(&mut HashMap<Vec<u8>, Record>, Vec<u8>) -> T) -> T {
        let mut records = self.records.lock().unwrap();
        let address = self.address(key);
        let expired = records.get(&address).is_some_and(|record| {
            let never = match record {
                Record::InFlight { .. } => self.flaw == Flaw::LeaseNeverLapses,
                Record::Completed { .. } => self.flaw == Flaw::RetentionNeverEnds,
            };
            !never && record.until() <= Instant::now()
        });
        if expired {
            records.remove(&address);
        }
        then(&mut records, address)
    }

    fn outcome(
        &self,
        record: Option<&Record>,
        fingerprint: &Fingerprint,
        owner: &OwnerToken,
    ) -> Option<ClaimOutcome> {
        let same = |stored: &Fingerprint| stored == fingerprint || self.flaw == Flaw::FingerprintIgnored;
        let mismatch = |stored: &Fingerprint| match self.flaw {
            Flaw::PolicyTagDropped => ClaimOutcome::Mismatch,
            _ => ClaimOutcome::mismatch(fingerprint, stored.policy()),
        };
        match record? {
            Record::InFlight {
                fingerprint: stored, ..
            } if !same(stored) => Some(mismatch(stored)),
            Record::Completed {
                fingerprint: stored, ..
            } if !same(stored) => Some(mismatch(stored)),
            Record::InFlight { owner: holder, .. }
                if holder == owner && self.flaw != Flaw::ClaimConflictsWithItself =>
            {
                None
            }
            Record::InFlight { until, .. } => Some(ClaimOutcome::InFlight {
                lease_left: until.saturating_duration_since(Instant::now()),
            }),
            Record::Completed { payload, .. } => Some(ClaimOutcome::Completed(payload.clone())),
        }
    }

    fn held_by(record: Option<&Record>, owner: &OwnerToken) -> bool {
        matches!(record, Some(Record::InFlight { owner: holder, .. }) if holder == owner)
    }
}

fn ready<'a, T: Send + 'a>(value: Result<T, StoreError>) -> StoreFuture<'a, T> {
    Box::pin(std::future::ready(value))
}

fn absent() -> StoreError {
    StoreError::Unavailable("no such record".into())
}

impl Store for PageStore {
    fn claim<'a>(
        &'a self,
        key: &'a RecordKey,
        fingerprint: &'a Fingerprint,
        owner: &'a OwnerToken,
        lease: Duration,
    ) -> StoreFuture<'a, ClaimOutcome> {
        Box::pin(async move {
            let found = self.live(key, |records, address| {
                self.outcome(records.get(&address), fingerprint, owner)
            });
            if let Some(outcome) = found {
                return Ok(outcome);
            }
            if self.flaw == Flaw::NonAtomicClaim {
                tokio::task::yield_now().await;
            }
            let record = Record::InFlight {
                owner: owner.clone(),
                fingerprint: *fingerprint,
                until: Instant::now() + lease,
            };
            self.live(key, |records, address| records.insert(address, record));
            Ok(ClaimOutcome::Claimed)
        })
    }

    fn complete<'a>(
        &'a self,
        key: &'a RecordKey,
        owner: &'a OwnerToken,
        payload: Bytes,
        retention: Duration,
    ) -> StoreFuture<'a, bool> {
        let payload = if self.flaw == Flaw::ReplayChangesBytes {
            Bytes::from(String::from_utf8_lossy(&payload).into_owned())
        } else {
            payload
        };
        ready(self.live(key, |records, address| {
            let fingerprint = match records.get(&address) {
                Some(Record::Completed {
                    owner: holder,
                    fingerprint,
                    ..
                }) if holder == owner && self.flaw == Flaw::CompletionRewritesTheRecord => *fingerprint,
                Some(Record::Completed { owner: holder, .. })
                    if self.flaw != Flaw::CompleteWithoutOwnerCheck =>
                {
                    // Sent again by its owner: done already, and left as it was.
                    return Ok(holder == owner || self.flaw == Flaw::CompletedRecordNotOwnerChecked);
                }
                Some(Record::InFlight {
                    owner: holder,
                    fingerprint,
                    ..
                }) if holder == owner || self.flaw == Flaw::CompleteWithoutOwnerCheck => *fingerprint,
                Some(Record::Completed { fingerprint, .. }) => *fingerprint,
                None if self.flaw == Flaw::ErrorOnAbsentKey => return Err(absent()),
                _ => return Ok(false),
            };
            records.insert(
                address,
                Record::Completed {
                    owner: owner.clone(),
                    fingerprint,
                    payload,
                    until: Instant::now() + retention,
                },
            );
            Ok(true)
        }))
    }

    fn release<'a>(&'a self, key: &'a RecordKey, owner: &'a OwnerToken) -> StoreFuture<'a, bool> {
        ready(self.live(key, |records, address| {
            let record = records.get(&address);
            let any_in_flight = matches!(record, Some(Record::InFlight { .. }))
                && self.flaw == Flaw::ReleaseWithoutOwnerCheck;
            if record.is_none() && self.flaw == Flaw::ErrorOnAbsentKey {
                return Err(absent());
            }
            if !(Self::held_by(record, owner) || any_in_flight) {
                return Ok(false);
            }
            records.remove(&address);
            Ok(true)
        }))
    }

    fn renew<'a>(
        &'a self,
        key: &'a RecordKey,
        owner: &'a OwnerToken,
        lease: Duration,
    ) -> StoreFuture<'a, bool> {
        ready(
            self.live(key, |records, address| match records.get_mut(&address) {
                Some(Record::InFlight {
                    owner: holder, until, ..
                }) if holder == owner || self.flaw == Flaw::RenewWithoutOwnerCheck => {
                    if self.flaw != Flaw::RenewDoesNotExtend {
                        *until = Instant::now() + lease;
                    }
                    Ok(true)
                }
                _ => Ok(false),
            }),
        )
    }

    fn inspect<'a>(&'a self, key: &'a RecordKey) -> StoreFuture<'a, Option<RecordInfo>> {
        ready(self.live(key, |records, address| {
            Ok(records.get(&address).map(|record| {
                let left = record.until().saturating_duration_since(Instant::now());
                match record {
                    Record::InFlight { owner, .. } => {
                        RecordInfo::new(RecordState::InFlight, left, None).with_owner(owner.clone())
                    }
                    Record::Completed { payload, .. } => {
                        RecordInfo::new(RecordState::Completed, left, Some(payload.clone()))
                    }
                }
            }))
        }))
    }

    fn purge<'a>(&'a self, key: &'a RecordKey) -> StoreFuture<'a, bool> {
        ready(self.live(key, |records, address| {
            if self.flaw == Flaw::PurgeSparesInFlight
                && matches!(records.get(&address), Some(Record::InFlight { .. }))
            {
                return Ok(true);
            }
            Ok(records.remove(&address).is_some())
        }))
    }
}

/// What a broken optional method of `MemoryStore` does instead.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum OptionalFlaw {
    PeekClaims,
    WatchNeverWakes,
    CachedAnswersAnyFingerprint,
    ListingIgnoresItsLimit,
    ClaimWaitingNeverMismatches,
}

/// `MemoryStore`, with one optional method broken.
struct Broken {
    inner: MemoryStore,
    flaw: OptionalFlaw,
    /// The senders of watches that are never told anything, kept so the watches stay open.
    silent: Mutex<Vec<tokio::sync::watch::Sender<u64>>>,
}

impl Store for Broken {
    fn claim<'a>(
        &'a self,
        key: &'a RecordKey,
        fingerprint: &'a Fingerprint,
        owner: &'a OwnerToken,
        lease: Duration,
    ) -> StoreFuture<'a, ClaimOutcome> {
        self.inner.claim(key, fingerprint, owner, lease)
    }

    fn claim_waiting<'a>(
        &'a self,
        key: &'a RecordKey,
        fingerprint: &'a Fingerprint,
        owner: &'a OwnerToken,
        lease: Duration,
    ) -> StoreFuture<'a, ClaimOutcome> {
        if self.flaw != OptionalFlaw::ClaimWaitingNeverMismatches {
            return self.inner.claim_waiting(key, fingerprint, owner, lease);
        }
        Box::pin(async move {
            match self.inner.claim_waiting(key, fingerprint, owner, lease).await? {
                ClaimOutcome::Mismatch => Ok(ClaimOutcome::InFlight { lease_left: lease }),
                outcome => Ok(outcome),
            }
        })
    }

    fn cached(&self, key: &RecordKey, fingerprint: &Fingerprint) -> Option<ClaimOutcome> {
        if self.flaw != OptionalFlaw::CachedAnswersAnyFingerprint {
            return self.inner.cached(key, fingerprint);
        }
        let info = self.inner.inspect(key);
        let info = futures_util::FutureExt::now_or_never(info)?.ok()??;
        info.payload.map(ClaimOutcome::Completed)
    }

    fn peek<'a>(
        &'a self,
        key: &'a RecordKey,
        fingerprint: &'a Fingerprint,
    ) -> StoreFuture<'a, Option<ClaimOutcome>> {
        if self.flaw != OptionalFlaw::PeekClaims {
            return self.inner.peek(key, fingerprint);
        }
        Box::pin(async move {
            match self
                .inner
                .claim(key, fingerprint, &OwnerToken::generate(), Duration::from_secs(30))
                .await?
            {
                ClaimOutcome::Claimed => Ok(None),
                outcome => Ok(Some(outcome)),
            }
        })
    }

    fn complete<'a>(
        &'a self,
        key: &'a RecordKey,
        owner: &'a OwnerToken,
        payload: Bytes,
        retention: Duration,
    ) -> StoreFuture<'a, bool> {
        self.inner.complete(key, owner, payload, retention)
    }

    fn release<'a>(&'a self, key: &'a RecordKey, owner: &'a OwnerToken) -> StoreFuture<'a, bool> {
        self.inner.release(key, owner)
    }

    fn renew<'a>(
        &'a self,
        key: &'a RecordKey,
        owner: &'a OwnerToken,
        lease: Duration,
    ) -> StoreFuture<'a, bool> {
        self.inner.renew(key, owner, lease)
    }

    fn inspect<'a>(&'a self, key: &'a RecordKey) -> StoreFuture<'a, Option<RecordInfo>> {
        self.inner.inspect(key)
    }

    fn purge<'a>(&'a self, key: &'a RecordKey) -> StoreFuture<'a, bool> {
        self.inner.purge(key)
    }

    fn in_flight<'a>(&'a self, older_than: Duration, limit: usize) -> StoreFuture<'a, Vec<InFlightRecord>> {
        let limit = if self.flaw == OptionalFlaw::ListingIgnoresItsLimit {
            usize::MAX
        } else {
            limit
        };
        self.inner.in_flight(older_than, limit)
    }

    fn watch<'a>(&'a self, key: &'a RecordKey) -> StoreFuture<'a, Option<KeyWatch>> {
        if self.flaw != OptionalFlaw::WatchNeverWakes {
            return self.inner.watch(key);
        }
        let (sender, changes) = tokio::sync::watch::channel(0);
        self.silent.lock().unwrap().push(sender);
        ready(Ok(Some(KeyWatch::new(changes, ()))))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sound_store_of_a_page_passes_with_its_optional_methods_not_offered() {
    let report = check(|| async { PageStore::new(Flaw::None) }).await;
    assert!(report.passed(), "{report}");
    assert_eq!(report.verdicts.len(), RULES.len());
    let not_offered: Vec<&str> = report.not_offered().collect();
    assert_eq!(
        not_offered,
        [
            "peek_reports_what_a_claim_would_find_and_writes_nothing",
            "cached_answers_agree_with_the_record",
            "watch_wakes_on_every_settling",
            "in_flight_lists_running_records_oldest_first",
            "in_flight_pages_through_many_records",
        ]
    );
}

/// Each broken store, and the rule that must catch it (others may too).
const BROKEN: &[(Flaw, &str)] = &[
    (Flaw::CompleteWithoutOwnerCheck, "transitions_are_owner_checked"),
    (
        Flaw::CompleteWithoutOwnerCheck,
        "an_expired_lease_frees_the_key_and_fences_the_old_owner",
    ),
    (Flaw::ReleaseWithoutOwnerCheck, "transitions_are_owner_checked"),
    (Flaw::RenewWithoutOwnerCheck, "transitions_are_owner_checked"),
    (Flaw::NonAtomicClaim, "concurrent_claims_admit_one_owner"),
    (
        Flaw::LeaseNeverLapses,
        "an_expired_lease_frees_the_key_and_fences_the_old_owner",
    ),
    (Flaw::RetentionNeverEnds, "retention_ends"),
    (Flaw::ReplayChangesBytes, "payloads_are_binary_safe"),
    (
        Flaw::FingerprintIgnored,
        "a_different_fingerprint_is_a_mismatch_in_either_state",
    ),
    (Flaw::PolicyTagDropped, "a_fingerprint_of_another_policy_says_so"),
    (
        Flaw::ClaimConflictsWithItself,
        "a_claim_sent_twice_does_not_conflict_with_itself",
    ),
    (Flaw::RenewDoesNotExtend, "renew_extends_the_lease"),
    (Flaw::PurgeSparesInFlight, "inspect_and_purge"),
    (Flaw::ScopeIgnored, "scopes_are_separate_records"),
    (Flaw::ErrorOnAbsentKey, "absent_keys_are_answered_not_failed"),
    (
        Flaw::CompletedRecordNotOwnerChecked,
        "a_completed_record_never_changes",
    ),
    (
        Flaw::CompletionRewritesTheRecord,
        "a_completed_record_never_changes",
    ),
];

const BROKEN_OPTIONAL: &[(OptionalFlaw, &str)] = &[
    (
        OptionalFlaw::PeekClaims,
        "peek_reports_what_a_claim_would_find_and_writes_nothing",
    ),
    (OptionalFlaw::WatchNeverWakes, "watch_wakes_on_every_settling"),
    (
        OptionalFlaw::CachedAnswersAnyFingerprint,
        "cached_answers_agree_with_the_record",
    ),
    (
        OptionalFlaw::ListingIgnoresItsLimit,
        "in_flight_lists_running_records_oldest_first",
    ),
    (
        OptionalFlaw::ClaimWaitingNeverMismatches,
        "claim_waiting_answers_as_claim",
    ),
];

/// What the kit said of `rule`, unless it failed it as it should.
fn uncaught(flaw: impl std::fmt::Debug, rule: &str, verdict: Option<&Verdict>) -> Option<String> {
    match verdict {
        Some(Verdict::Failed(_)) => None,
        other => Some(format!("{flaw:?}: {rule} answered {other:?}, not failed")),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_broken_store_breaks_the_rule_that_guards_it() {
    // The kits run side by side: each costs its rules' waiting (about 2 s; 5 s for the watch
    // that never wakes, the kit's bound on a wake-up), not their sum.
    let broken = BROKEN.iter().map(|&(flaw, rule)| async move {
        let report = check(|| async move { PageStore::new(flaw) }).await;
        uncaught(flaw, rule, report.verdict(rule))
    });
    let broken_optional = BROKEN_OPTIONAL.iter().map(|&(flaw, rule)| async move {
        let report = check(|| async move {
            Broken {
                inner: MemoryStore::new(),
                flaw,
                silent: Mutex::new(Vec::new()),
            }
        })
        .await;
        uncaught(flaw, rule, report.verdict(rule))
    });
    let (broken, broken_optional) = tokio::join!(
        futures_util::future::join_all(broken),
        futures_util::future::join_all(broken_optional)
    );
    let uncaught: Vec<String> = broken.into_iter().chain(broken_optional).flatten().collect();
    assert!(
        uncaught.is_empty(),
        "broken stores the kit let through:\n{}",
        uncaught.join("\n")
    );
}

#[tokio::test]
async fn conformance_panics_naming_the_rule_and_the_answer() {
    let run = tokio::spawn(tower_idempotency::testing::conformance(|| async {
        PageStore::new(Flaw::FingerprintIgnored)
    }));
    let panic = run.await.expect_err("a broken store fails the kit").into_panic();
    let message = panic.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(
        message.contains("- a_different_fingerprint_is_a_mismatch_in_either_state: "),
        "{message}"
    );
    assert!(
        message.contains("another fingerprint under a key in flight answered InFlight"),
        "{message}"
    );
}

#[test]
fn every_rule_has_a_distinct_name_and_says_what_it_asks() {
    let mut names: Vec<&str> = RULES.iter().map(|rule| rule.name).collect();
    names.sort_unstable();
    names.dedup();
    assert_eq!(names.len(), RULES.len());
    assert!(RULES.iter().all(|rule| !rule.asks.is_empty()));
}
