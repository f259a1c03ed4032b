//! Ties the model of `tests/model/` to the code: seeded random walks of the model (one store
//! node, two servers, four clients on two scopes, crashes, handler failures, leases that run out
//! under dead and live owners) are replayed against `MemoryStore`, `RedisStore` on a real
//! `redis-server` and `PostgresStore` on a real PostgreSQL, through the `Store` trait, and every
//! answer (claim outcome, complete, release, renew) is compared with the model's.
//!
//! A lease that runs out in the model is a real one here: the claims (and renewals) of a record
//! the walk later lets expire take a short lease, and the replay sleeps past it at that step. The
//! walks run side by side, so those sleeps overlap.

mod common;
mod model;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use model::store::Mutation;
use model::{Action, Call, Config, Outcome, Payload, System, Token};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::time::Instant;
use tower_idempotency::{ClaimOutcome, Fingerprint, IdempotencyKey, OwnerToken, RecordKey, Store};

const SEED: u64 = 25;
const WALKS: usize = 60;
const DEPTH: usize = 40;
/// Lease-expiry steps per walk, at most, all of one record: each costs a short lease's sleep,
/// which would let another record's short lease run out too.
const EXPIRIES: usize = 2;
const LONG_LEASE: Duration = Duration::from_secs(120);
const SHORT_LEASE: Duration = Duration::from_secs(1);
/// Past a short lease, before the replay goes on: the store's clock and ours may differ by a
/// few milliseconds (PostgreSQL's `statement_timestamp()`, Redis's own expiry).
const SLACK: Duration = Duration::from_millis(150);
const RETENTION: Duration = Duration::from_secs(3600);

/// One store node, everything else the model has: the configuration the walks come from.
fn config() -> Config {
    Config {
        records: vec![(0, 0), (1, 0), (0, 1)],
        clients: vec![(0, 0), (0, 0), (0, 1), (1, 0), (2, 0)],
        servers: 2,
        crashes: 2,
        failures: 2,
        live_lapses: 2,
        failovers: 0,
        replica_acks: false,
        hang_ups: 2,
        // Calls that land late or twice reach the store as the model says, in that order.
        call_faults: 2,
        reconnects: 0,
        give_ups: 1,
        mutation: None,
    }
}

/// `WALKS` seeded random walks of `model`, as the store calls each made.
fn walks(model: &System) -> Vec<Vec<Call>> {
    let mut rng = StdRng::seed_from_u64(SEED);
    (0..WALKS)
        .map(|_| {
            let mut state = model.initial();
            let (mut calls, mut actions, mut expiries) = (Vec::new(), Vec::new(), 0);
            let mut expiring = None;
            for _ in 0..DEPTH {
                actions.clear();
                model.possible(&state, &mut actions);
                actions.retain(|action| match action {
                    Action::Expire { slot, .. } => {
                        expiries < EXPIRIES && expiring.is_none_or(|record| record == *slot)
                    }
                    _ => true,
                });
                if actions.is_empty() {
                    break;
                }
                let action = actions[rng.random_range(0..actions.len())];
                let (next, call) = model.step(&state, action);
                if let Some(call) = call {
                    if let Call::Expire { record } = call {
                        expiries += 1;
                        expiring = Some(record);
                    }
                    calls.push(call);
                }
                state = next;
            }
            calls
        })
        .collect()
}

fn payload_bytes(payload: Payload) -> Bytes {
    Bytes::from(format!("r{}-run{}", payload.record, payload.run))
}

/// Replays `calls` on `store`, walk `walk`'s records under keys of its own. `Err` names the first
/// call whose answer differs from the model's.
async fn replay(
    store: Arc<dyn Store>,
    config: Config,
    walk: usize,
    calls: Vec<Call>,
) -> Result<usize, String> {
    let key_of = |record: u8| {
        let (scope, key) = config.records[usize::from(record)];
        let key = IdempotencyKey::parse(&format!("walk{walk}-key{key}")).expect("a valid key");
        RecordKey::new(Some(&format!("scope{scope}")), key)
    };
    let fingerprint = |f: u8| Fingerprint::new([format!("body {f}").as_bytes()]);
    // A record whose lease runs out somewhere in the walk is always claimed with a short lease.
    let short: Vec<u8> = calls
        .iter()
        .filter_map(|call| match call {
            Call::Expire { record } => Some(*record),
            _ => None,
        })
        .collect();
    let lease = |record: u8| {
        if short.contains(&record) {
            SHORT_LEASE
        } else {
            LONG_LEASE
        }
    };
    let mut owners: HashMap<Token, OwnerToken> = HashMap::new();
    let mut leased_at: HashMap<u8, Instant> = HashMap::new();
    let mut owner = |token: Token| owners.entry(token).or_insert_with(OwnerToken::generate).clone();
    for (i, call) in calls.iter().enumerate() {
        let differs = |real: String| {
            Err(format!(
                "walk {walk}, call {i} of {}: {call:?}, but the store answered {real}\n  the walk: {:#?}",
                calls.len(),
                &calls[..=i]
            ))
        };
        match *call {
            Call::Claim {
                record,
                fingerprint: f,
                owner: token,
                answer,
            } => {
                let outcome = store
                    .claim(&key_of(record), &fingerprint(f), &owner(token), lease(record))
                    .await
                    .map_err(|e| format!("walk {walk}, call {i}: {e}"))?;
                let same = match (answer, &outcome) {
                    (Outcome::Claimed, ClaimOutcome::Claimed) => true,
                    (Outcome::InFlight, ClaimOutcome::InFlight { .. }) => true,
                    (Outcome::Mismatch, ClaimOutcome::Mismatch) => true,
                    (Outcome::Completed(p), ClaimOutcome::Completed(stored)) => *stored == payload_bytes(p),
                    _ => false,
                };
                if !same {
                    return differs(format!("{outcome:?}"));
                }
                if outcome == ClaimOutcome::Claimed {
                    leased_at.insert(record, Instant::now());
                }
            }
            Call::Complete {
                record,
                owner: token,
                payload,
                answer,
            } => {
                let real = store
                    .complete(&key_of(record), &owner(token), payload_bytes(payload), RETENTION)
                    .await
                    .map_err(|e| format!("walk {walk}, call {i}: {e}"))?;
                if real != answer {
                    return differs(format!("{real}"));
                }
            }
            Call::Release {
                record,
                owner: token,
                answer,
            } => {
                let real = store
                    .release(&key_of(record), &owner(token))
                    .await
                    .map_err(|e| format!("walk {walk}, call {i}: {e}"))?;
                if real != answer {
                    return differs(format!("{real}"));
                }
            }
            Call::Renew {
                record,
                owner: token,
                answer,
            } => {
                let real = store
                    .renew(&key_of(record), &owner(token), lease(record))
                    .await
                    .map_err(|e| format!("walk {walk}, call {i}: {e}"))?;
                if real != answer {
                    return differs(format!("{real}"));
                }
                if real {
                    leased_at.insert(record, Instant::now());
                }
            }
            Call::Expire { record } => {
                if let Some(at) = leased_at.get(&record) {
                    tokio::time::sleep_until(*at + SHORT_LEASE + SLACK).await;
                }
            }
        }
    }
    Ok(calls.len())
}

/// Replays every walk of `model` on `store`, side by side; answers how many calls were compared,
/// or every difference found.
async fn conform(store: Arc<dyn Store>, model: &System) -> Result<usize, Vec<String>> {
    let replays = walks(model)
        .into_iter()
        .enumerate()
        .map(|(walk, calls)| tokio::spawn(replay(store.clone(), model.config.clone(), walk, calls)));
    let (mut compared, mut differences) = (0, Vec::new());
    for replayed in futures_util::future::join_all(replays).await {
        match replayed.expect("a replay panicked") {
            Ok(calls) => compared += calls,
            Err(difference) => differences.push(difference),
        }
    }
    if differences.is_empty() {
        Ok(compared)
    } else {
        Err(differences)
    }
}

async fn answers_as_the_model(backend: common::Backend) {
    let started = std::time::Instant::now();
    let model = System::new(config());
    match conform(backend.store.clone(), &model).await {
        Ok(compared) => println!(
            "{}: {compared} store calls of {WALKS} walks answered as the model, in {:?}",
            backend.name,
            started.elapsed()
        ),
        Err(differences) => panic!(
            "{}: {} walks differ from the model; the first:\n{}",
            backend.name,
            differences.len(),
            differences[0]
        ),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_store_answers_as_the_model() {
    answers_as_the_model(common::Backend::memory().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_store_answers_as_the_model() {
    answers_as_the_model(common::Backend::redis().await).await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_store_answers_as_the_model() {
    answers_as_the_model(common::Backend::postgres().await).await;
}

/// The walks exercise every kind of call and answer, so a store that differed in any of them
/// would be seen.
#[test]
fn the_walks_cover_every_kind_of_answer() {
    let calls: Vec<Call> = walks(&System::new(config())).into_iter().flatten().collect();
    let mut seen = std::collections::BTreeSet::new();
    for call in &calls {
        seen.insert(match call {
            Call::Claim {
                answer: Outcome::Claimed,
                ..
            } => "claim: claimed",
            Call::Claim {
                answer: Outcome::InFlight,
                ..
            } => "claim: in flight",
            Call::Claim {
                answer: Outcome::Mismatch,
                ..
            } => "claim: mismatch",
            Call::Claim {
                answer: Outcome::Completed(_),
                ..
            } => "claim: completed",
            Call::Complete { answer: true, .. } => "complete: true",
            Call::Complete { answer: false, .. } => "complete: false",
            Call::Release { answer: true, .. } => "release: true",
            Call::Release { answer: false, .. } => "release: false",
            Call::Renew { answer: true, .. } => "renew: true",
            Call::Renew { answer: false, .. } => "renew: false",
            Call::Expire { .. } => "lease runs out",
        });
    }
    println!("{} calls in {WALKS} walks: {seen:?}", calls.len());
    assert_eq!(seen.len(), 11, "every kind of call and answer: {seen:?}");
}

/// The replay catches a model that differs from the stores: with an owner check missing from the
/// model's completion (or from its release, or the scope missing from its record address), the
/// memory store's answers differ from the model's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_that_differs_from_the_stores_is_caught() {
    let mutations = [
        Mutation::CompleteNotOwnerChecked,
        Mutation::ReleaseNotOwnerChecked,
        Mutation::ScopeNotInDigest,
    ];
    let replays = mutations.map(|mutation| async move {
        let model = System::new(Config {
            mutation: Some(mutation),
            ..config()
        });
        let store: Arc<dyn Store> = Arc::new(tower_idempotency::MemoryStore::new());
        (mutation, conform(store, &model).await)
    });
    for (mutation, replayed) in futures_util::future::join_all(replays).await {
        match replayed {
            Ok(compared) => panic!("{mutation:?}: {compared} calls, and no difference seen"),
            Err(differences) => println!(
                "{mutation:?}: {} of {WALKS} walks differ; the first: {}",
                differences.len(),
                differences[0].lines().next().unwrap_or_default()
            ),
        }
    }
}
