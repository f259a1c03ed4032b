//! The `Store` contract, run against every store: `MemoryStore` and `RedisStore` on a real
//! `redis-server`.

mod common;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use common::Backend;
use futures_util::StreamExt;
use tower_idempotency::{
    ClaimOutcome, Fingerprint, IdempotencyKey, OwnerToken, RecordKey, RecordState, Store,
};

const LEASE: Duration = Duration::from_secs(30);
const RETENTION: Duration = Duration::from_secs(3600);

fn key(k: &str) -> RecordKey {
    RecordKey::new(None, IdempotencyKey::parse(k).unwrap())
}

fn fp(body: &str) -> Fingerprint {
    Fingerprint::new([body.as_bytes()])
}

async fn claim(
    store: &dyn Store,
    k: &RecordKey,
    f: &Fingerprint,
    owner: &OwnerToken,
    lease: Duration,
) -> ClaimOutcome {
    store.claim(k, f, owner, lease).await.expect("claim")
}

async fn claim_then_in_flight_then_completed(b: Backend) {
    let s = &*b.store;
    let (k, f, a, other) = (
        key("k1"),
        fp("body"),
        OwnerToken::generate(),
        OwnerToken::generate(),
    );
    assert_eq!(claim(s, &k, &f, &a, LEASE).await, ClaimOutcome::Claimed);
    match claim(s, &k, &f, &other, LEASE).await {
        ClaimOutcome::InFlight { lease_left } => {
            assert!(
                lease_left <= LEASE && lease_left > LEASE - Duration::from_secs(5),
                "{lease_left:?}"
            )
        }
        outcome => panic!("expected in flight, got {outcome:?}"),
    }
    assert!(s
        .complete(&k, &a, Bytes::from_static(b"result"), RETENTION)
        .await
        .unwrap());
    assert_eq!(
        claim(s, &k, &f, &other, LEASE).await,
        ClaimOutcome::Completed(Bytes::from_static(b"result"))
    );
}

async fn a_claim_sent_twice_does_not_conflict_with_itself(b: Backend) {
    let s = &*b.store;
    let (k, f, a) = (key("k2"), fp("body"), OwnerToken::generate());
    assert_eq!(claim(s, &k, &f, &a, LEASE).await, ClaimOutcome::Claimed);
    assert_eq!(claim(s, &k, &f, &a, LEASE).await, ClaimOutcome::Claimed);
    // And a completion sent twice succeeds twice.
    assert!(s
        .complete(&k, &a, Bytes::from_static(b"r"), RETENTION)
        .await
        .unwrap());
    assert!(s
        .complete(&k, &a, Bytes::from_static(b"r"), RETENTION)
        .await
        .unwrap());
}

async fn a_different_fingerprint_is_a_mismatch_in_either_state(b: Backend) {
    let s = &*b.store;
    let (k, a, other) = (key("k3"), OwnerToken::generate(), OwnerToken::generate());
    assert_eq!(claim(s, &k, &fp("one"), &a, LEASE).await, ClaimOutcome::Claimed);
    assert_eq!(
        claim(s, &k, &fp("two"), &other, LEASE).await,
        ClaimOutcome::Mismatch
    );
    assert!(s
        .complete(&k, &a, Bytes::from_static(b"r"), RETENTION)
        .await
        .unwrap());
    assert_eq!(
        claim(s, &k, &fp("two"), &other, LEASE).await,
        ClaimOutcome::Mismatch
    );
}

async fn transitions_are_owner_checked(b: Backend) {
    let s = &*b.store;
    let (k, f, a, intruder) = (
        key("k4"),
        fp("body"),
        OwnerToken::generate(),
        OwnerToken::generate(),
    );
    assert_eq!(claim(s, &k, &f, &a, LEASE).await, ClaimOutcome::Claimed);
    assert!(!s
        .complete(&k, &intruder, Bytes::from_static(b"evil"), RETENTION)
        .await
        .unwrap());
    assert!(!s.release(&k, &intruder).await.unwrap());
    assert!(!s.renew(&k, &intruder, LEASE).await.unwrap());
    assert!(s.renew(&k, &a, LEASE).await.unwrap());
    assert!(s
        .complete(&k, &a, Bytes::from_static(b"good"), RETENTION)
        .await
        .unwrap());
    // A completed record can be neither released nor renewed, even by its owner.
    assert!(!s.release(&k, &a).await.unwrap());
    assert!(!s.renew(&k, &a, LEASE).await.unwrap());
    assert_eq!(
        claim(s, &k, &f, &intruder, LEASE).await,
        ClaimOutcome::Completed(Bytes::from_static(b"good"))
    );
}

async fn release_lets_the_next_claim_in(b: Backend) {
    let s = &*b.store;
    let (k, f, a, next) = (
        key("k5"),
        fp("body"),
        OwnerToken::generate(),
        OwnerToken::generate(),
    );
    assert_eq!(claim(s, &k, &f, &a, LEASE).await, ClaimOutcome::Claimed);
    assert!(s.release(&k, &a).await.unwrap());
    assert!(s.inspect(&k).await.unwrap().is_none());
    // Released, the key takes any request, even a different one.
    assert_eq!(
        claim(s, &k, &fp("other"), &next, LEASE).await,
        ClaimOutcome::Claimed
    );
}

async fn an_expired_lease_frees_the_key_and_fences_the_old_owner(b: Backend) {
    let s = &*b.store;
    let (k, f, slow, next) = (
        key("k6"),
        fp("body"),
        OwnerToken::generate(),
        OwnerToken::generate(),
    );
    let lease = Duration::from_millis(150);
    assert_eq!(claim(s, &k, &f, &slow, lease).await, ClaimOutcome::Claimed);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(claim(s, &k, &f, &next, LEASE).await, ClaimOutcome::Claimed);
    // The slow owner wakes up: it can neither overwrite nor delete the newer owner's claim.
    assert!(!s
        .complete(&k, &slow, Bytes::from_static(b"late"), RETENTION)
        .await
        .unwrap());
    assert!(!s.release(&k, &slow).await.unwrap());
    assert!(!s.renew(&k, &slow, LEASE).await.unwrap());
    assert_eq!(
        s.inspect(&k).await.unwrap().map(|i| i.state),
        Some(RecordState::InFlight)
    );
    assert!(s
        .complete(&k, &next, Bytes::from_static(b"new"), RETENTION)
        .await
        .unwrap());
    assert_eq!(
        claim(s, &k, &f, &slow, LEASE).await,
        ClaimOutcome::Completed(Bytes::from_static(b"new"))
    );
}

async fn renew_extends_the_lease(b: Backend) {
    let s = &*b.store;
    let (k, f, a, other) = (
        key("k7"),
        fp("body"),
        OwnerToken::generate(),
        OwnerToken::generate(),
    );
    // Renewed every 400 ms, 600 ms before each lease would end: room for a slow machine.
    let lease = Duration::from_millis(1000);
    assert_eq!(claim(s, &k, &f, &a, lease).await, ClaimOutcome::Claimed);
    for _ in 0..4 {
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert!(s.renew(&k, &a, lease).await.unwrap());
    }
    // 1.6 s after a 1 s lease began, the renewed claim still holds.
    assert!(matches!(
        claim(s, &k, &f, &other, LEASE).await,
        ClaimOutcome::InFlight { .. }
    ));
}

async fn retention_ends(b: Backend) {
    let s = &*b.store;
    let (k, f, a, next) = (
        key("k8"),
        fp("body"),
        OwnerToken::generate(),
        OwnerToken::generate(),
    );
    assert_eq!(claim(s, &k, &f, &a, LEASE).await, ClaimOutcome::Claimed);
    assert!(s
        .complete(&k, &a, Bytes::from_static(b"r"), Duration::from_secs(1))
        .await
        .unwrap());
    let info = s.inspect(&k).await.unwrap().expect("a completed record");
    assert_eq!(info.state, RecordState::Completed);
    assert!(info.expires_in <= Duration::from_secs(1));
    tokio::time::sleep(Duration::from_millis(1300)).await;
    assert!(s.inspect(&k).await.unwrap().is_none());
    assert_eq!(claim(s, &k, &f, &next, LEASE).await, ClaimOutcome::Claimed);
}

async fn inspect_and_purge(b: Backend) {
    let s = &*b.store;
    let (k, f, a) = (key("k9"), fp("body"), OwnerToken::generate());
    assert!(s.inspect(&k).await.unwrap().is_none());
    assert!(!s.purge(&k).await.unwrap());
    assert_eq!(claim(s, &k, &f, &a, LEASE).await, ClaimOutcome::Claimed);
    let info = s.inspect(&k).await.unwrap().unwrap();
    assert_eq!((info.state, info.payload), (RecordState::InFlight, None));
    assert!(info.expires_in > LEASE - Duration::from_secs(5));
    assert!(s
        .complete(&k, &a, Bytes::from_static(b"payload"), RETENTION)
        .await
        .unwrap());
    let info = s.inspect(&k).await.unwrap().unwrap();
    assert_eq!(info.state, RecordState::Completed);
    assert_eq!(info.payload.as_deref(), Some(&b"payload"[..]));
    assert!(info.expires_in > RETENTION - Duration::from_secs(5));
    assert!(s.purge(&k).await.unwrap());
    assert!(s.inspect(&k).await.unwrap().is_none());
    // A purged key runs again.
    assert_eq!(
        claim(s, &k, &f, &OwnerToken::generate(), LEASE).await,
        ClaimOutcome::Claimed
    );
}

async fn payloads_are_binary_safe(b: Backend) {
    let s = &*b.store;
    let (k, f, a) = (key("k10"), fp("body"), OwnerToken::generate());
    let payload: Bytes = (0..=255u8).chain((0..=255u8).rev()).collect::<Vec<_>>().into();
    assert_eq!(claim(s, &k, &f, &a, LEASE).await, ClaimOutcome::Claimed);
    assert!(s.complete(&k, &a, payload.clone(), RETENTION).await.unwrap());
    assert_eq!(
        claim(s, &k, &f, &OwnerToken::generate(), LEASE).await,
        ClaimOutcome::Completed(payload)
    );
    // The empty payload too.
    let (k, a) = (key("k10-empty"), OwnerToken::generate());
    assert_eq!(claim(s, &k, &f, &a, LEASE).await, ClaimOutcome::Claimed);
    assert!(s.complete(&k, &a, Bytes::new(), RETENTION).await.unwrap());
    assert_eq!(
        claim(s, &k, &f, &OwnerToken::generate(), LEASE).await,
        ClaimOutcome::Completed(Bytes::new())
    );
}

async fn scopes_are_separate_records(b: Backend) {
    let s = &*b.store;
    let k = IdempotencyKey::parse("shared-key").unwrap();
    let (alice, bob) = (
        RecordKey::new(Some("alice"), k.clone()),
        RecordKey::new(Some("bob"), k),
    );
    let f = fp("body");
    let a = OwnerToken::generate();
    assert_eq!(claim(s, &alice, &f, &a, LEASE).await, ClaimOutcome::Claimed);
    assert!(s
        .complete(&alice, &a, Bytes::from_static(b"alice's"), RETENTION)
        .await
        .unwrap());
    assert_eq!(
        claim(s, &bob, &f, &OwnerToken::generate(), LEASE).await,
        ClaimOutcome::Claimed
    );
}

async fn peek_reports_what_a_claim_would_find_and_writes_nothing(b: Backend) {
    let s = &*b.store;
    let (k, f, owner) = (key("peeked"), fp("body"), OwnerToken::generate());
    assert_eq!(s.peek(&k, &f).await.unwrap(), None, "no record");
    assert_eq!(
        claim(s, &k, &f, &owner, LEASE).await,
        ClaimOutcome::Claimed,
        "the peek claimed nothing"
    );
    assert!(matches!(
        s.peek(&k, &f).await.unwrap(),
        Some(ClaimOutcome::InFlight { lease_left }) if lease_left <= LEASE && lease_left > LEASE - Duration::from_secs(5)
    ));
    assert_eq!(
        s.peek(&k, &fp("other")).await.unwrap(),
        Some(ClaimOutcome::Mismatch)
    );
    assert!(s
        .complete(&k, &owner, Bytes::from_static(b"result"), RETENTION)
        .await
        .unwrap());
    assert_eq!(
        s.peek(&k, &f).await.unwrap(),
        Some(ClaimOutcome::Completed(Bytes::from_static(b"result")))
    );
    assert_eq!(
        s.peek(&k, &fp("other")).await.unwrap(),
        Some(ClaimOutcome::Mismatch)
    );
}

/// A token made `ago` before now, as `OwnerToken::generate` makes them (its time after `@`).
fn token_from(ago: Duration, name: &str) -> OwnerToken {
    let made = SystemTime::now() - ago;
    let millis = made.duration_since(UNIX_EPOCH).unwrap().as_millis();
    OwnerToken::from_string(format!("{name}@{millis}"))
}

fn about(age: Option<Duration>, expected: Duration) -> bool {
    age.is_some_and(|age| age >= expected && age < expected + Duration::from_secs(10))
}

async fn in_flight_lists_running_records_oldest_first(b: Backend) {
    let s = &*b.store;
    let f = fp("body");
    // Claims made 10 min, 5 min, 2 min and 10 s ago (their tokens say so), one just now, and
    // one under a token that carries no time.
    let aged = [
        ("ten-min", Duration::from_secs(600)),
        ("five-min", Duration::from_secs(300)),
        ("two-min", Duration::from_secs(120)),
        ("ten-sec", Duration::from_secs(10)),
    ];
    let mut owners = Vec::new();
    for (name, ago) in aged {
        let owner = token_from(ago, name);
        assert_eq!(
            claim(s, &key(name), &f, &owner, LEASE).await,
            ClaimOutcome::Claimed
        );
        owners.push(owner);
    }
    let fresh = OwnerToken::generate();
    assert_eq!(
        claim(s, &key("fresh"), &f, &fresh, LEASE).await,
        ClaimOutcome::Claimed
    );
    let timeless = OwnerToken::from_string("custom-token-without-a-time");
    assert_eq!(
        claim(s, &key("timeless"), &f, &timeless, LEASE).await,
        ClaimOutcome::Claimed
    );
    // Never listed: a completed record (claimed long ago), a released one, an expired lease.
    let done = token_from(Duration::from_secs(1200), "done");
    assert_eq!(
        claim(s, &key("done"), &f, &done, LEASE).await,
        ClaimOutcome::Claimed
    );
    assert!(s
        .complete(&key("done"), &done, Bytes::from_static(b"r"), RETENTION)
        .await
        .unwrap());
    let released = token_from(Duration::from_secs(1200), "released");
    assert_eq!(
        claim(s, &key("released"), &f, &released, LEASE).await,
        ClaimOutcome::Claimed
    );
    assert!(s.release(&key("released"), &released).await.unwrap());
    let expired = token_from(Duration::from_secs(1200), "expired");
    let short = Duration::from_millis(100);
    assert_eq!(
        claim(s, &key("expired"), &f, &expired, short).await,
        ClaimOutcome::Claimed
    );
    tokio::time::sleep(Duration::from_millis(300)).await;

    let listed = s.in_flight(Duration::ZERO, 100).await.expect("in_flight");
    let digests: Vec<[u8; 32]> = listed.iter().map(|r| r.digest).collect();
    let expected: Vec<[u8; 32]> = ["timeless", "ten-min", "five-min", "two-min", "ten-sec", "fresh"]
        .map(|name| *key(name).digest())
        .to_vec();
    assert_eq!(
        digests, expected,
        "{}: unknown age first, then the oldest: {listed:#?}",
        b.name
    );
    assert_eq!(listed[0].age, None);
    assert_eq!(listed[0].owner, timeless);
    assert!(about(listed[1].age, Duration::from_secs(600)), "{:?}", listed[1]);
    assert!(about(listed[4].age, Duration::from_secs(10)), "{:?}", listed[4]);
    assert!(
        listed[5].age.is_some_and(|age| age < Duration::from_secs(10)),
        "{:?}",
        listed[5]
    );
    assert_eq!(listed[5].owner, fresh);
    for record in &listed {
        assert!(
            record.lease_left <= LEASE && record.lease_left > LEASE - Duration::from_secs(10),
            "{record:?}"
        );
    }

    let older = s.in_flight(Duration::from_secs(180), 100).await.unwrap();
    let names: Vec<[u8; 32]> = older.iter().map(|r| r.digest).collect();
    assert_eq!(names, expected[..3].to_vec(), "older than 3 min: {older:#?}");
    let two = s.in_flight(Duration::from_secs(60), 2).await.unwrap();
    assert_eq!(
        two.iter().map(|r| r.digest).collect::<Vec<_>>(),
        expected[..2].to_vec()
    );
    assert!(s.in_flight(Duration::ZERO, 0).await.unwrap().is_empty());

    // A completion takes a record off the list; so does a purge.
    assert!(s
        .complete(&key("ten-min"), &owners[0], Bytes::from_static(b"r"), RETENTION)
        .await
        .unwrap());
    assert!(s.purge(&key("timeless")).await.unwrap());
    let left = s.in_flight(Duration::from_secs(180), 100).await.unwrap();
    assert_eq!(
        left.iter().map(|r| r.digest).collect::<Vec<_>>(),
        vec![expected[2]]
    );
}

/// More records than one page of a listing holds (Redis: a `SCAN` step of 1000; PostgreSQL:
/// 1000 rows a statement), among completed ones: all are found, and the limit keeps the oldest.
async fn in_flight_pages_through_many_records(b: Backend) {
    let s = &*b.store;
    let f = fp("body");
    let claims = (0..1500u64).map(|i| {
        let owner = token_from(Duration::from_secs(60 + i), &format!("owner-{i}"));
        async move {
            let k = key(&format!("many-{i}"));
            assert_eq!(claim(s, &k, &f, &owner, LEASE).await, ClaimOutcome::Claimed);
            if i % 3 == 0 {
                assert!(s
                    .complete(&k, &owner, Bytes::from_static(b"r"), RETENTION)
                    .await
                    .unwrap());
            }
        }
    });
    futures_util::stream::iter(claims)
        .buffer_unordered(50)
        .collect::<Vec<()>>()
        .await;
    let all = s.in_flight(Duration::ZERO, 5000).await.unwrap();
    assert_eq!(
        all.len(),
        1000,
        "{}: every record in flight, none completed",
        b.name
    );
    let ten = s.in_flight(Duration::ZERO, 10).await.unwrap();
    // Record i was claimed 60 + i seconds ago; every third one is completed.
    let oldest: Vec<[u8; 32]> = (0..1500u64)
        .rev()
        .filter(|i| i % 3 != 0)
        .take(10)
        .map(|i| *key(&format!("many-{i}")).digest())
        .collect();
    assert_eq!(ten.iter().map(|r| r.digest).collect::<Vec<_>>(), oldest);
}

on_every_store!(
    in_flight_lists_running_records_oldest_first,
    in_flight_pages_through_many_records,
    peek_reports_what_a_claim_would_find_and_writes_nothing,
    claim_then_in_flight_then_completed,
    a_claim_sent_twice_does_not_conflict_with_itself,
    a_different_fingerprint_is_a_mismatch_in_either_state,
    transitions_are_owner_checked,
    release_lets_the_next_claim_in,
    an_expired_lease_frees_the_key_and_fences_the_old_owner,
    renew_extends_the_lease,
    retention_ends,
    inspect_and_purge,
    payloads_are_binary_safe,
    scopes_are_separate_records,
);
