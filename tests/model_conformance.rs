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
use model::linearize::{explaining_orders, Answer, Op};
use model::store::{Mutation, Node};
use model::{Action, Call, Config, Outcome, Payload, System, Token};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::time::Instant;
use tower_idempotency::{
    ClaimOutcome, Fingerprint, IdempotencyKey, OwnerToken, RecordKey, Store, StoreError,
};

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
                    Action::Expire { slot } => {
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

fn fingerprint(f: u8) -> Fingerprint {
    Fingerprint::new([format!("body {f}").as_bytes()])
}

/// Whether a claim's real outcome is the model's.
fn same_outcome(model: Outcome, real: &ClaimOutcome) -> bool {
    match (model, real) {
        (Outcome::Claimed, ClaimOutcome::Claimed) => true,
        (Outcome::InFlight, ClaimOutcome::InFlight { .. }) => true,
        (Outcome::Mismatch, ClaimOutcome::Mismatch) => true,
        (Outcome::Completed(p), ClaimOutcome::Completed(stored)) => *stored == payload_bytes(p),
        _ => false,
    }
}

/// One walk's records under keys of its own, and the real owner token of each model token.
struct Walk {
    config: Config,
    walk: usize,
    owners: HashMap<Token, OwnerToken>,
}

impl Walk {
    fn new(config: Config, walk: usize) -> Self {
        Self {
            config,
            walk,
            owners: HashMap::new(),
        }
    }

    fn key_of(&self, record: u8) -> RecordKey {
        let (scope, key) = self.config.records[usize::from(record)];
        let key = IdempotencyKey::parse(&format!("walk{}-key{key}", self.walk)).expect("a valid key");
        RecordKey::new(Some(&format!("scope{scope}")), key)
    }

    fn owner(&mut self, token: Token) -> OwnerToken {
        self.owners
            .entry(token)
            .or_insert_with(OwnerToken::generate)
            .clone()
    }

    /// Makes `call` (not an expiry) on `store`, its claim or renewal with `lease`, and compares
    /// the answer with the model's: `Ok(true)` if the record's lease started again (claimed,
    /// renewed), `Err` with what the store answered if that differs.
    async fn call(&mut self, store: &dyn Store, call: Call, lease: Duration) -> Result<bool, String> {
        let failed = |e: StoreError| format!("the error {e}");
        match call {
            Call::Claim {
                record,
                fingerprint: f,
                owner: token,
                answer,
            } => {
                let owner = self.owner(token);
                let outcome = (store
                    .claim(&self.key_of(record), &fingerprint(f), &owner, lease)
                    .await)
                    .map_err(failed)?;
                if !same_outcome(answer, &outcome) {
                    return Err(format!("{outcome:?}"));
                }
                Ok(outcome == ClaimOutcome::Claimed)
            }
            Call::Complete {
                record,
                owner: token,
                payload,
                answer,
            } => {
                let owner = self.owner(token);
                let real = (store.complete(&self.key_of(record), &owner, payload_bytes(payload), RETENTION))
                    .await
                    .map_err(failed)?;
                (real == answer).then_some(false).ok_or(format!("{real}"))
            }
            Call::Release {
                record,
                owner: token,
                answer,
            } => {
                let owner = self.owner(token);
                let real = (store.release(&self.key_of(record), &owner).await).map_err(failed)?;
                (real == answer).then_some(false).ok_or(format!("{real}"))
            }
            Call::Renew {
                record,
                owner: token,
                answer,
            } => {
                let owner = self.owner(token);
                let real = (store.renew(&self.key_of(record), &owner, lease).await).map_err(failed)?;
                (real == answer).then_some(real).ok_or(format!("{real}"))
            }
            Call::Expire { .. } => unreachable!("a lease running out is the replay's to make"),
        }
    }
}

/// Replays `calls` on `store`, walk `walk`'s records under keys of its own. `Err` names the first
/// call whose answer differs from the model's.
async fn replay(
    store: Arc<dyn Store>,
    config: Config,
    walk: usize,
    calls: Vec<Call>,
) -> Result<usize, String> {
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
    let mut replayed = Walk::new(config, walk);
    let mut leased_at: HashMap<u8, Instant> = HashMap::new();
    for (i, call) in calls.iter().enumerate() {
        let record = match *call {
            Call::Expire { record } => {
                if let Some(at) = leased_at.get(&record) {
                    tokio::time::sleep_until(*at + SHORT_LEASE + SLACK).await;
                }
                continue;
            }
            Call::Claim { record, .. }
            | Call::Complete { record, .. }
            | Call::Release { record, .. }
            | Call::Renew { record, .. } => record,
        };
        match replayed.call(&*store, *call, lease(record)).await {
            Ok(true) => {
                leased_at.insert(record, Instant::now());
            }
            Ok(false) => {}
            Err(real) => {
                return Err(format!(
                    "walk {walk}, call {i} of {}: {call:?}, but the store answered {real}\n  the walk: {:#?}",
                    calls.len(),
                    &calls[..=i]
                ))
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

/// On Redis, also that the owner-checked transitions took the path the lane names: with
/// `NATIVE_TRANSITIONS=1` on a server that has compare-and-set, the native commands, else the
/// scripts (see [`assert_the_path_taken`]). The store is built by `RedisStore::connect`, which asks
/// the server what it has before the first call, so no call takes a script for not knowing yet.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_store_answers_as_the_model() {
    let server = common::RedisServer::start();
    let store = common::connect(&server.url()).await.expect("connect");
    // Loaded now, or the first script calls made at once are answered NOSCRIPT and made again
    // (`EVAL`), and the script calls counted below are more than the transitions that took one.
    store.load_scripts().await.expect("load the scripts");
    let admin = common::client(&server.url()).await;
    answers_as_the_model(common::Backend {
        name: "redis",
        store: Arc::new(store),
        memory: None,
        redis: None,
    })
    .await;
    let calls: Vec<Call> = walks(&System::new(config())).into_iter().flatten().collect();
    assert_the_path_taken(&admin, &calls).await;
}

/// Whether the server behind `admin` has a conditional delete (`DELEX`: Redis 8.4+;
/// `DELIFEQ`: Valkey 9.0+), as the store asks it (`COMMAND INFO`, `nil` for an unknown command).
async fn has_conditional_delete(admin: &fred::clients::Client) -> bool {
    let info = common::admin(admin, &["COMMAND", "INFO", "DELEX", "DELIFEQ"]).await;
    match info {
        fred::types::Value::Array(found) => found.iter().any(|command| !command.is_null()),
        other => panic!("COMMAND INFO answered {other:?}"),
    }
}

/// Asserts, from the server's `INFO commandstats` after the walks' `calls`, which path the
/// owner-checked transitions (complete, renew, release) took.
///
/// A native `SET … IFEQ` cannot be told from a claim's `SET … NX` in the counts, so the signal
/// is the scripts' `EVALSHA` (and `EVAL`) calls, which nothing else in the walks makes, and the
/// conditional deletes. On the native path a completion and a renewal never take a script (the
/// claim's record is remembered, and the server's commands were known before the first call);
/// a release takes one only where the native delete did not delete (the claim was lost: the
/// script decides), or where the server has no conditional delete (Valkey 8.1). So at most that
/// many script calls, and at least one conditional delete per release that deleted; a lane that
/// fell back to the scripts makes one per renewal too, and fails. On the scripts' path (the
/// default, or a server without compare-and-set): a script call per renewal and release at
/// least (completions made at once may share one), and no conditional delete.
async fn assert_the_path_taken(admin: &fred::clients::Client, calls: &[Call]) {
    let count = |kind: fn(&Call) -> bool| calls.iter().filter(|call| kind(call)).count() as u64;
    let renewals = count(|call| matches!(call, Call::Renew { .. }));
    let deleted = count(|call| matches!(call, Call::Release { answer: true, .. }));
    let not_deleted = count(|call| matches!(call, Call::Release { answer: false, .. }));
    assert!(renewals > 0 && deleted > 0, "the walks renew and release");
    let scripts = common::command_calls(admin, "evalsha").await + common::command_calls(admin, "eval").await;
    let deletes = common::command_calls(admin, "delex").await + common::command_calls(admin, "delifeq").await;
    let compare_and_set = common::has_compare_and_set(admin).await;
    let conditional_delete = has_conditional_delete(admin).await;
    let figures = format!(
        "{scripts} script calls, {deletes} conditional deletes; the walks made {renewals} renewals, \
         {deleted} releases that deleted, {not_deleted} that did not"
    );
    if common::native_transitions() && compare_and_set {
        let scripted_releases = if conditional_delete {
            not_deleted
        } else {
            deleted + not_deleted
        };
        assert!(
            scripts <= scripted_releases,
            "NATIVE_TRANSITIONS=1 on a server with compare-and-set, but the transitions took the \
             scripts: {figures}"
        );
        if conditional_delete {
            assert!(
                deletes >= deleted,
                "the server has a conditional delete, but the releases did not take it: {figures}"
            );
        }
        println!(
            "redis: the native compare-and-set path (conditional delete: {conditional_delete}): {figures}"
        );
    } else {
        assert!(
            scripts >= renewals + deleted + not_deleted && deletes == 0,
            "the scripts' path (NATIVE_TRANSITIONS={}, compare-and-set: {compare_and_set}), but \
             not every transition took a script: {figures}",
            common::native_transitions()
        );
        println!("redis: the scripts' path: {figures}");
    }
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

// Concurrent calls on one record.
//
// Each round sets a record up one call at a time (no record, a claim held by owner 0, its
// completion, or a claim whose short lease runs out as the round starts), then issues 3 to 5
// calls of several owners at once: claims with their own tokens and fingerprints, and
// completions, releases and renewals of owner 0 or of an owner claiming in the same round. Every
// owner calls through a store of its own: on Redis a `RedisStore` on its own connection (so the
// calls are not put in order by one socket), on PostgreSQL the store's pool (a connection per
// call in flight), in memory one store shared by tasks on two threads. The calls are spawned
// and released together by a barrier. The round is accepted if some order of them (and of the
// lease running out, where it does), applied one at a time to the model's `Node`, gives exactly
// the answers the store gave.

const RACE_SEED: u64 = 36;
const ROUNDS: usize = 96;
/// Rounds in flight at once (each on its own record): more overlap, and the expiring rounds'
/// waits run side by side.
const ROUNDS_AT_ONCE: usize = 8;
/// The lease of owner 0's claim in a round where it runs out as the calls are issued.
const ROUND_LEASE: Duration = Duration::from_millis(300);

/// What a round's record holds before its calls race.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Setup {
    Empty,
    /// Owner 0 holds a claim (fingerprint 0).
    Claimed,
    /// Owner 0 claimed and completed it.
    Completed,
    /// Owner 0's claim, whose lease runs out as the calls are issued: [`Op::Expire`] is among them.
    Expiring,
}

#[derive(Clone, Debug)]
struct Round {
    setup: Setup,
    /// In the order they are spawned; [`Op::Expire`] (last, if any) is not a call.
    ops: Vec<Op>,
}

fn token(owner: u8) -> Token {
    Token { server: owner, n: 0 }
}

fn payload_of(owner: u8) -> Payload {
    Payload {
        record: 0,
        run: owner,
    }
}

/// `ROUNDS` seeded rounds.
fn rounds() -> Vec<Round> {
    let mut rng = StdRng::seed_from_u64(RACE_SEED);
    (0..ROUNDS)
        .map(|_| {
            let setup =
                [Setup::Empty, Setup::Claimed, Setup::Completed, Setup::Expiring][rng.random_range(0..4)];
            let calls = rng.random_range(3..=5);
            // Two claims at least, so a round races for the record.
            let mut ops = vec![
                Op::Claim {
                    fingerprint: rng.random_range(0..2),
                    owner: token(1),
                },
                Op::Claim {
                    fingerprint: rng.random_range(0..2),
                    owner: token(2),
                },
            ];
            let mut claimants = 2;
            while ops.len() < calls {
                // Owner 0 (who holds or held the record, if any) or one claiming in this round.
                let holder = if setup != Setup::Empty && rng.random_bool(0.5) {
                    0
                } else {
                    rng.random_range(1..=claimants)
                };
                ops.push(match rng.random_range(0..4) {
                    0 => {
                        claimants += 1;
                        Op::Claim {
                            fingerprint: rng.random_range(0..2),
                            owner: token(claimants),
                        }
                    }
                    1 => Op::Complete {
                        owner: token(holder),
                        payload: payload_of(holder),
                    },
                    2 => Op::Release { owner: token(holder) },
                    _ => Op::Renew { owner: token(holder) },
                });
            }
            // Shuffled, so the first claim spawned is not always owner 1's.
            for i in (1..ops.len()).rev() {
                ops.swap(i, rng.random_range(0..=i));
            }
            if setup == Setup::Expiring {
                ops.push(Op::Expire);
            }
            Round { setup, ops }
        })
        .collect()
}

/// The model's record after `setup`.
fn set_up(setup: Setup) -> Node {
    let mut node = Node::new(1);
    if setup != Setup::Empty {
        node.claim(0, 0, token(0), None);
    }
    if setup == Setup::Completed {
        node.complete(0, token(0), payload_of(0), None);
    }
    node
}

/// What a real call answered.
#[derive(Clone, Debug)]
enum Real {
    Claim(ClaimOutcome),
    Flag(bool),
    /// [`Op::Expire`]: not a call.
    Expiry,
}

fn accepts(real: &Real, model: Option<Answer>) -> bool {
    match (real, model) {
        (Real::Claim(real), Some(Answer::Claim(model))) => same_outcome(model, real),
        (Real::Flag(real), Some(Answer::Flag(model))) => *real == model,
        (Real::Expiry, None) => true,
        _ => false,
    }
}

/// One store per owner (the same one, or one each on a connection of its own).
type Stores = Arc<Vec<Arc<dyn Store>>>;

/// Runs round `n` on `stores`: sets it up, then spawns its calls and releases them at once.
async fn race(stores: Stores, n: usize, round: Round) -> Result<Vec<Real>, String> {
    let key = RecordKey::new(
        Some("races"),
        IdempotencyKey::parse(&format!("race{n}")).expect("a valid key"),
    );
    let owners: Vec<OwnerToken> = (0..6).map(|_| OwnerToken::generate()).collect();
    let failed = |e: StoreError| format!("round {n}: {e}");
    let lease = if round.setup == Setup::Expiring {
        ROUND_LEASE
    } else {
        LONG_LEASE
    };
    let holder = &stores[0];
    let started = Instant::now();
    if round.setup != Setup::Empty {
        let claimed = (holder.claim(&key, &fingerprint(0), &owners[0], lease).await).map_err(failed)?;
        assert_eq!(claimed, ClaimOutcome::Claimed, "round {n}: the setup's claim");
    }
    if round.setup == Setup::Completed {
        let completed = (holder.complete(&key, &owners[0], payload_bytes(payload_of(0)), RETENTION))
            .await
            .map_err(failed)?;
        assert!(completed, "round {n}: the setup's completion");
    }
    if round.setup == Setup::Expiring {
        // Issued as the lease ends: some calls may find it there, others gone.
        tokio::time::sleep_until(started + ROUND_LEASE).await;
    }
    let calls: Vec<Op> = round.ops.iter().copied().filter(|op| *op != Op::Expire).collect();
    let barrier = Arc::new(tokio::sync::Barrier::new(calls.len()));
    let spawned: Vec<_> = calls
        .into_iter()
        .map(|op| {
            let (stores, barrier, key) = (stores.clone(), barrier.clone(), key.clone());
            let owner_of = |token: Token| usize::from(token.server);
            let (index, owner) = match op {
                Op::Claim { owner, .. }
                | Op::Complete { owner, .. }
                | Op::Release { owner }
                | Op::Renew { owner } => (owner_of(owner), owners[owner_of(owner)].clone()),
                Op::Expire => unreachable!("filtered out"),
            };
            tokio::spawn(async move {
                let store = &stores[index % stores.len()];
                barrier.wait().await;
                match op {
                    Op::Claim { fingerprint: f, .. } => {
                        (store.claim(&key, &fingerprint(f), &owner, LONG_LEASE).await).map(Real::Claim)
                    }
                    Op::Complete { payload, .. } => {
                        (store.complete(&key, &owner, payload_bytes(payload), RETENTION))
                            .await
                            .map(Real::Flag)
                    }
                    Op::Release { .. } => store.release(&key, &owner).await.map(Real::Flag),
                    Op::Renew { .. } => store.renew(&key, &owner, LONG_LEASE).await.map(Real::Flag),
                    Op::Expire => unreachable!("filtered out"),
                }
            })
        })
        .collect();
    let mut answers = Vec::with_capacity(round.ops.len());
    for answer in futures_util::future::join_all(spawned).await {
        answers.push(answer.expect("a call panicked").map_err(failed)?);
    }
    if round.setup == Setup::Expiring {
        answers.push(Real::Expiry);
    }
    Ok(answers)
}

/// What the rounds on one store showed.
#[derive(Debug, Default)]
struct Races {
    calls: usize,
    /// Rounds the order the calls were spawned in does not explain (with the lease, if it runs
    /// out, first): they landed in another order.
    reordered: usize,
    /// Rounds a claim won that was not the first claim spawned.
    later_claim_won: usize,
    /// Rounds no order explains: the store is not linearisable there.
    differences: Vec<String>,
}

/// Runs every round on `stores`, `ROUNDS_AT_ONCE` at a time, and checks each against the model.
async fn races(stores: Stores) -> Races {
    let rounds = rounds();
    let mut report = Races::default();
    let mut answered = Vec::with_capacity(rounds.len());
    for (chunk, batch) in rounds.chunks(ROUNDS_AT_ONCE).enumerate() {
        let raced = batch.iter().enumerate().map(|(i, round)| {
            let n = chunk * ROUNDS_AT_ONCE + i;
            tokio::spawn(race(stores.clone(), n, round.clone()))
        });
        for answers in futures_util::future::join_all(raced).await {
            answered.push(answers.expect("a round panicked"));
        }
    }
    for (n, (round, answers)) in rounds.iter().zip(answered).enumerate() {
        let answers = match answers {
            Ok(answers) => answers,
            Err(error) => {
                report.differences.push(error);
                continue;
            }
        };
        report.calls += answers.len();
        let start = set_up(round.setup);
        let orders = explaining_orders(&start, &round.ops, |i, model| accepts(&answers[i], model));
        if orders.is_empty() {
            report.differences.push(format!(
                "round {n}: no order of the calls explains the answers\n  set up: {:?}\n  calls:   {:?}\n  answers: {answers:?}",
                round.setup, round.ops
            ));
            continue;
        }
        let mut spawned: Vec<usize> = (0..round.ops.len()).collect();
        if round.setup == Setup::Expiring {
            spawned.rotate_right(1);
        }
        if !orders.contains(&spawned) {
            report.reordered += 1;
        }
        let claims: Vec<usize> = (0..round.ops.len())
            .filter(|&i| matches!(round.ops[i], Op::Claim { .. }))
            .collect();
        let winner = claims
            .iter()
            .position(|&i| matches!(answers[i], Real::Claim(ClaimOutcome::Claimed)));
        if winner.is_some_and(|winner| winner > 0) {
            report.later_claim_won += 1;
        }
    }
    report
}

/// Races every round on `stores` and fails on a round no order explains, or if nothing raced.
async fn races_as_the_model(name: &str, stores: Vec<Arc<dyn Store>>) {
    let started = std::time::Instant::now();
    println!("{name}: {ROUNDS} rounds of seed {RACE_SEED}");
    let report = races(Arc::new(stores)).await;
    if let Some(first) = report.differences.first() {
        panic!(
            "{name}: {} of {ROUNDS} rounds are explained by no order of their calls; the first:\n{first}",
            report.differences.len()
        );
    }
    println!(
        "{name}: {} calls in {ROUNDS} rounds, each explained by an order of the model's; {} rounds landed in \
         another order than spawned, in {} a later claim won; in {:?}",
        report.calls,
        report.reordered,
        report.later_claim_won,
        started.elapsed()
    );
    // A race test in which nothing raced proves nothing.
    assert!(
        report.reordered > 0 && report.later_claim_won > 0,
        "{name}: the calls never landed in another order than spawned ({report:?}): nothing raced"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_store_races_as_the_model() {
    let store: Arc<dyn Store> = Arc::new(tower_idempotency::MemoryStore::new());
    races_as_the_model("memory", vec![store]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_store_races_as_the_model() {
    let server = common::RedisServer::start();
    let mut stores: Vec<Arc<dyn Store>> = Vec::new();
    // One store, so one connection, per owner.
    for _ in 0..6 {
        let store = common::connect(&server.url()).await.expect("connect");
        stores.push(Arc::new(store));
    }
    races_as_the_model("redis", stores).await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_store_races_as_the_model() {
    let backend = common::Backend::postgres().await;
    races_as_the_model("postgres", vec![backend.store]).await;
}
