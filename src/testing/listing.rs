//! The rules of the optional methods that look past one call: `watch` (a waiter is woken) and
//! `in_flight` (the operators' listing, which sees every record in flight in the store).

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures_util::StreamExt;

use super::support::{
    answer, claim, complete, completed, ensure, fingerprint, first_claim, Outcome, Run, LEASE, RETENTION,
};
use crate::key::RecordKey;
use crate::store::{ClaimOutcome, InFlightRecord, OwnerToken, Store, StoreError};

/// How long a watch may take to wake after a change. A liveness bound, not a measure of speed:
/// the alternative is never, and a store answers in milliseconds.
const WAKE_BOUND: Duration = Duration::from_secs(5);

pub(super) async fn watch_wakes_on_every_settling(run: Run, store: Arc<dyn Store>) -> Outcome {
    let s = &*store;
    for settling in ["complete", "release", "purge"] {
        let (k, owner) = (run.key(&format!("watched-{settling}")), OwnerToken::generate());
        first_claim(s, &k, "body", &owner, LEASE).await?;
        let Some(mut watch) = answer(s.watch(&k).await, "watch")? else {
            // The trait's default: this store does not notify (waiters poll).
            return Ok(false);
        };
        // As the coordinator does: read the record after subscribing, as a waiter.
        let read = answer(
            s.claim_waiting(&k, &fingerprint("body"), &OwnerToken::generate(), LEASE)
                .await,
            "claim_waiting",
        )?;
        ensure!(
            matches!(read, ClaimOutcome::InFlight { .. }),
            "a waiter's read of a key in flight answered {read:?}"
        );
        let settled = match settling {
            "complete" => complete(s, &k, &owner, b"result", RETENTION).await?,
            "release" => answer(s.release(&k, &owner).await, "release")?,
            _ => answer(s.purge(&k).await, "purge")?,
        };
        ensure!(settled, "the owner's {settling} answered false");
        let woken = tokio::time::timeout(WAKE_BOUND, watch.changed()).await;
        ensure!(
            woken == Ok(true),
            "a watch of the key was not woken within 5 s of its {settling} ({woken:?})"
        );
    }
    Ok(true)
}

/// A token made `ago` before now, as `OwnerToken::generate` makes them (its time after `@`).
fn token_from(ago: Duration, name: &str) -> OwnerToken {
    let made = SystemTime::now().checked_sub(ago).unwrap_or(UNIX_EPOCH);
    let millis = made
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| since.as_millis());
    OwnerToken::from_string(format!("{name}@{millis}"))
}

fn about(age: Option<Duration>, expected: Duration) -> bool {
    age.is_some_and(|age| age >= expected && age < expected + Duration::from_secs(10))
}

/// The store's listing, kept to the records of `ours` (the store may hold others in flight),
/// or `None` if the store does not offer listings.
async fn listed(
    s: &dyn Store,
    older_than: Duration,
    limit: usize,
    ours: &[RecordKey],
) -> Result<Option<Vec<InFlightRecord>>, String> {
    match s.in_flight(older_than, limit).await {
        Err(StoreError::Unsupported(_)) => Ok(None),
        listing => Ok(Some(
            answer(listing, "in_flight")?
                .into_iter()
                .filter(|record| ours.iter().any(|key| key.digest() == &record.digest))
                .collect(),
        )),
    }
}

fn digests(records: &[InFlightRecord]) -> Vec<[u8; 32]> {
    records.iter().map(|record| record.digest).collect()
}

pub(super) async fn in_flight_lists_running_records_oldest_first(run: Run, store: Arc<dyn Store>) -> Outcome {
    let s = &*store;
    let names = ["timeless", "ten-min", "five-min", "two-min", "ten-sec", "fresh"];
    let keys: Vec<RecordKey> = names.iter().map(|name| run.key(name)).collect();
    // Claims made 10 min, 5 min, 2 min and 10 s ago (their tokens say so), one just now, and
    // one under a token that carries no time.
    let owners = [
        OwnerToken::from_string("custom-token-without-a-time"),
        token_from(Duration::from_secs(600), "ten-min"),
        token_from(Duration::from_secs(300), "five-min"),
        token_from(Duration::from_secs(120), "two-min"),
        token_from(Duration::from_secs(10), "ten-sec"),
        OwnerToken::generate(),
    ];
    for (key, owner) in keys.iter().zip(&owners) {
        first_claim(s, key, "body", owner, LEASE).await?;
    }
    // Never listed: a completed record (claimed long ago), a released one, a lapsed lease.
    let mut never = Vec::new();
    for (name, lease) in [
        ("done", LEASE),
        ("released", LEASE),
        ("lapsed", Duration::from_millis(100)),
    ] {
        let (key, owner) = (run.key(name), token_from(Duration::from_secs(1200), name));
        first_claim(s, &key, "body", &owner, lease).await?;
        match name {
            "done" => completed(s, &key, &owner, b"r", RETENTION).await?,
            "released" => ensure!(
                answer(s.release(&key, &owner).await, "release")?,
                "the owner's release answered false"
            ),
            _ => {}
        }
        never.push(key);
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let all_ours: Vec<RecordKey> = keys.iter().chain(&never).cloned().collect();
    let expected: Vec<[u8; 32]> = keys.iter().map(|key| *key.digest()).collect();

    let Some(listing) = listed(s, Duration::ZERO, 100, &all_ours).await? else {
        return Ok(false);
    };
    ensure!(
        digests(&listing) == expected,
        "the listing is not {names:?} (unknown age first, then the oldest): {listing:#?}"
    );
    ensure!(
        listing[0].age.is_none() && listing[0].owner == owners[0],
        "the record under a token without a time lists as {:?}",
        listing[0]
    );
    ensure!(
        about(listing[1].age, Duration::from_secs(600)),
        "a claim made 10 min ago lists as {:?}",
        listing[1]
    );
    ensure!(
        about(listing[4].age, Duration::from_secs(10)),
        "a claim made 10 s ago lists as {:?}",
        listing[4]
    );
    let fresh = &listing[5];
    ensure!(
        fresh.age.is_some_and(|age| age < Duration::from_secs(10)) && fresh.owner == owners[5],
        "a claim made now lists as {fresh:?}"
    );
    for record in &listing {
        let fits = record.lease_left <= LEASE && record.lease_left > LEASE - Duration::from_secs(10);
        ensure!(
            fits,
            "a record under a 30 s lease lists with {:?} left",
            record.lease_left
        );
    }
    let older = listed(s, Duration::from_secs(180), 100, &all_ours)
        .await?
        .unwrap_or_default();
    ensure!(
        digests(&older) == expected[..3],
        "older than 3 min, the listing is not timeless, ten-min, five-min: {older:#?}"
    );
    let two = listed(s, Duration::from_secs(60), 2, &all_ours)
        .await?
        .unwrap_or_default();
    ensure!(
        digests(&two) == expected[..2],
        "a limit of 2 did not keep timeless, ten-min: {two:#?}"
    );
    let none = answer(s.in_flight(Duration::ZERO, 0).await, "in_flight")?;
    ensure!(none.is_empty(), "a limit of 0 listed {none:#?}");

    // A completion takes a record off the list; so does a purge.
    completed(s, &keys[1], &owners[1], b"r", RETENTION).await?;
    ensure!(
        answer(s.purge(&keys[0]).await, "purge")?,
        "the purge of a record in flight answered false"
    );
    let left = listed(s, Duration::from_secs(180), 100, &all_ours)
        .await?
        .unwrap_or_default();
    ensure!(
        digests(&left) == expected[2..3],
        "after a completion and a purge, older than 3 min is not five-min alone: {left:#?}"
    );
    // Leave nothing old in flight behind for a later listing.
    for key in &keys {
        answer(s.purge(key).await, "purge")?;
    }
    Ok(true)
}

/// More records than one page of a listing holds (Redis: a `SCAN` step of 1000; PostgreSQL:
/// 1000 rows a statement), among completed ones: all are found, and the limit keeps the oldest.
pub(super) async fn in_flight_pages_through_many_records(run: Run, store: Arc<dyn Store>) -> Outcome {
    let s = &*store;
    if let Err(StoreError::Unsupported(_)) = s.in_flight(Duration::ZERO, 1).await {
        return Ok(false);
    }
    let keys: Vec<RecordKey> = (0..1500u64).map(|i| run.key(&format!("many-{i}"))).collect();
    // Record i was claimed 60 + i seconds ago; every third one is completed.
    let claims = keys.iter().cloned().enumerate().map(|(i, key)| {
        let store = store.clone();
        async move {
            let owner = token_from(Duration::from_secs(60 + i as u64), &format!("owner-{i}"));
            let claimed = claim(&*store, &key, "body", &owner, LEASE).await?;
            ensure!(
                claimed == ClaimOutcome::Claimed,
                "the first claim of record {i} answered {claimed:?}"
            );
            if i % 3 == 0 {
                completed(&*store, &key, &owner, b"r", RETENTION).await?;
            }
            Ok(())
        }
    });
    let made: Vec<Result<(), String>> = futures_util::stream::iter(claims)
        .buffer_unordered(50)
        .collect()
        .await;
    made.into_iter().collect::<Result<Vec<()>, String>>()?;
    let verdict = async {
        let all = listed(s, Duration::ZERO, 5000, &keys).await?.unwrap_or_default();
        ensure!(
            all.len() == 1000,
            "of 1,500 records, 1,000 in flight, the listing found {}",
            all.len()
        );
        let ten = listed(s, Duration::ZERO, 10, &keys).await?.unwrap_or_default();
        let oldest: Vec<[u8; 32]> = (0..keys.len())
            .rev()
            .filter(|i| i % 3 != 0)
            .take(10)
            .map(|i| *keys[i].digest())
            .collect();
        ensure!(
            digests(&ten) == oldest,
            "a limit of 10 did not keep the 10 oldest: {ten:#?}"
        );
        Ok(true)
    }
    .await;
    // Leave nothing old in flight behind for a later listing.
    let purges = keys.into_iter().map(|key| {
        let store = store.clone();
        async move { store.purge(&key).await.is_ok() }
    });
    let _: Vec<_> = futures_util::stream::iter(purges)
        .buffer_unordered(50)
        .collect()
        .await;
    verdict
}
