//! Ties the model of `tests/model/` to the code: seeded random walks of the model (one store
//! node, two servers, four clients on two scopes, crashes, handler failures, leases that run out
//! under dead and live owners) are replayed against `MemoryStore`, `RedisStore` on a real
//! `redis-server` and `PostgresStore` on a real PostgreSQL, through the `Store` trait, and every
//! answer (claim outcome, complete, release, renew) is compared with the model's.
//!
//! A lease that runs out in the model is a real one here: the claims (and renewals) of a record
//! the walk later lets expire take a short lease, and the replay sleeps past it at that step. The
//! walks run side by side, so those sleeps overlap.
//!
//! What the walks cannot show, since they make one call at a time, is tested below them:
//! concurrent calls on one record, accepted when some order of them gives the model's answers
//! (`model::linearize`); and the durability option's walks on a real master and replica, the
//! model's replication and acknowledgement steps made real by stopping and resuming the replica.

mod common;
mod model;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use model::linearize::{explaining_orders, Answer, Op};
use model::store::{Mutation, Node, Rec, RecState};
use model::{Action, Call, Config, Outcome, Payload, State, System, Token};
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
        replicas: 1,
        acks: None,
        hang_ups: 2,
        // Calls that land late or twice reach the store as the model says, in that order.
        call_faults: 2,
        reconnects: 0,
        give_ups: 1,
        late_announcements: 0,
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
            // A lease running out is the replay's to make; a call the model may add, the replay's to learn.
            other => panic!("not a store call this replay makes: {other:?}"),
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_store_answers_as_the_model() {
    let server = common::RedisServer::start();
    let store = common::connect(&server.url()).await.expect("connect");
    answers_as_the_model(common::Backend {
        name: "redis",
        store: Arc::new(store),
        memory: None,
        redis: None,
    })
    .await;
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
// calls are not put in order by one socket), on PostgreSQL a store whose pool has a connection
// for every call in flight, in memory one store shared by tasks on two threads. The calls are spawned
// and released together by a barrier. The round is accepted if some order of them (and of the
// lease running out, where it does), applied one at a time to the model's `Node`, gives exactly
// the answers the store gave.

const RACE_SEED: u64 = 36;
const ROUNDS: usize = 144;
/// Rounds in flight at once (each on its own record): more overlap, and the expiring rounds'
/// waits run side by side.
const ROUNDS_AT_ONCE: usize = 12;
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
    let url = tokio::task::spawn_blocking(|| common::postgres::shared().url())
        .await
        .expect("start the shared PostgreSQL server");
    // A connection for every call in flight (`ROUNDS_AT_ONCE` rounds of at most 5), so that none waits for
    // one and the calls race in the server, not in the pool's queue.
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections((ROUNDS_AT_ONCE * 5) as u32)
        .connect(&url)
        .await
        .expect("connect to the shared PostgreSQL server");
    let store = tower_idempotency::PostgresStore::new(pool).with_table(&common::postgres::unique_table());
    store.migrate().await.expect("create the record table");
    races_as_the_model("postgres", vec![Arc::new(store)]).await;
}

// A replicated pair with `WAIT`.
//
// Walks of the model with the durability option (`replica_acks: true`, no failover) replayed on
// a real master and replica through `RedisStore::with_replica_acks`: the model's replication and
// acknowledgement steps are made real. While the replica runs, the model replicates every record
// at once (a running replica is caught up within milliseconds), and a claim or completion is
// acknowledged (`ClaimAcked`, `CompleteAcked`); while it is stopped (`SIGSTOP`), the model
// replicates nothing, a claim is not acknowledged (`ClaimNotAcked`: the store releases it and
// answers `StoreError::NotReplicated`, the layer's 503) and a completion times out
// (`CompleteTimedOut`: answered, and completed again in the background until the replica,
// resumed, has it). After every step the record each node holds is read (`GET`, on the master,
// and on the replica while it runs, once caught up) and compared with the model's primary and
// replica.
//
// `SIGSTOP`, rather than `CLIENT PAUSE` or `DEBUG SLEEP` on the replica: the master keeps its
// link to the stopped replica open, so its `WAIT` waits out the timeout as it does for a replica
// that is slow or cut off by a partition, rather than answering at once for a replica it knows
// is gone; `CLIENT PAUSE` holds the replica's clients, not (by its documentation) the stream
// from its master; `DEBUG SLEEP` blocks the connection that sends it for the sleep.
//
// No lease runs out in these walks (the model's `Expire` steps are left out: an expiry while
// the replica is stopped happens on the master alone and reaches the replica when it resumes,
// which the model's step of the primary alone already says, and each would cost a lease's sleep).

const REPLICATED_SEED: u64 = 37;
const REPLICATED_WALKS: usize = 12;
const REPLICATED_DEPTH: usize = 30;
/// Times the replica is stopped per walk, at most (each stop costs a `WAIT` timeout per claim
/// and completion made meanwhile).
const STOPS: usize = 2;
/// The `WAIT` timeout of the store the steps take while the replica is stopped: small, so a
/// claim it does not acknowledge costs little.
const WAIT_TIMEOUT: Duration = Duration::from_millis(50);
/// The `WAIT` timeout of the store the steps take while the replica runs: long, so that a
/// machine busy for a moment does not make a claim the model says is acknowledged time out.
const RUNNING_WAIT_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a running replica may take to have the master's writes: a wide margin (it has them
/// within milliseconds), for a busy machine.
const CATCH_UP_MS: &str = "5000";

/// The configuration of the replicated walks: two records in two scopes under one key, three
/// clients (two with different payloads for one record), two servers, a crash, a handler
/// failure, a hang-up; the durability option, no failover.
fn replicated_config() -> Config {
    Config {
        records: vec![(0, 0), (1, 0)],
        clients: vec![(0, 0), (0, 1), (1, 0)],
        crashes: 1,
        failures: 1,
        live_lapses: 0,
        replica_acks: true,
        hang_ups: 1,
        // The real calls here are all answered.
        call_faults: 0,
        give_ups: 0,
        ..config()
    }
}

/// A step of a replicated walk.
#[derive(Clone, Debug)]
enum Step {
    /// A store call answered as the model says, acknowledged or not (a completion the replica
    /// did not acknowledge is answered `true` all the same).
    Call(Call),
    /// A claim the model says was made (`Claimed`) and then, with the replica stopped, not
    /// acknowledged: released by the store, and answered `NotReplicated`.
    ClaimNotAcked(Call),
    /// The replica stops (`false`) or resumes (`true`).
    Replica(bool),
    /// What the model's primary holds, and its replica where the real one can be read (running).
    Holds {
        primary: Vec<Option<Rec>>,
        replica: Option<Vec<Option<Rec>>>,
    },
}

/// Whether the model may take `action` in `state` (read from its actions, not its servers'
/// phases, so that a rewrite of those leaves this alone).
fn may(model: &System, state: &State, action: Action) -> bool {
    let mut actions = Vec::new();
    model.possible(state, &mut actions);
    actions.contains(&action)
}

/// The model's replication with the replica running: every record at once, and the
/// completions waiting for it (in the foreground or the background) acknowledged.
fn catch_up(model: &System, state: &mut State) {
    for slot in 0..model.config.records.len() {
        *state = model
            .step(
                state,
                Action::Replicate {
                    node: 1,
                    slot: slot as u8,
                },
            )
            .0;
    }
    for server in 0..model.config.servers {
        if may(model, state, Action::CompleteAcked { server }) {
            *state = model.step(state, Action::CompleteAcked { server }).0;
        }
    }
}

/// `REPLICATED_WALKS` seeded walks of `model` with the replica stopped and resumed at random.
fn replicated_walks(model: &System) -> Vec<Vec<Step>> {
    let mut rng = StdRng::seed_from_u64(REPLICATED_SEED);
    (0..REPLICATED_WALKS)
        .map(|_| {
            let mut state = model.initial();
            let (mut steps, mut actions) = (Vec::new(), Vec::new());
            let (mut running, mut stops) = (true, 0);
            for _ in 0..REPLICATED_DEPTH {
                actions.clear();
                model.possible(&state, &mut actions);
                // The steps of the servers and clients; replication and acknowledgements are
                // this driver's (below), and no lease runs out. Steps the model may add later
                // are left out until the replay can make them real.
                actions.retain(|action| {
                    matches!(
                        action,
                        Action::Serve { .. }
                            | Action::Renew { .. }
                            | Action::Run { .. }
                            | Action::Fail { .. }
                            | Action::Complete { .. }
                            | Action::Crash { .. }
                            | Action::HangUp { .. }
                    )
                });
                let may_toggle = !running || stops < STOPS;
                if actions.is_empty() && !may_toggle {
                    break;
                }
                // One chance in six, when it may, that the replica stops, one in three that it
                // resumes: short stops, as each claim meanwhile costs a `WAIT` timeout.
                let odds = if running { 6 } else { 3 };
                if may_toggle && (actions.is_empty() || rng.random_range(0..odds) == 0) {
                    running = !running;
                    stops += usize::from(!running);
                    steps.push(Step::Replica(running));
                } else {
                    let action = actions[rng.random_range(0..actions.len())];
                    let (next, call) = model.step(&state, action);
                    state = next;
                    let server = match action {
                        Action::Serve { server, .. } | Action::Complete { server, .. } => Some(server),
                        _ => None,
                    };
                    match (server, call) {
                        // A claim that waits for the replica.
                        (Some(server), Some(call))
                            if may(model, &state, Action::ClaimNotAcked { server }) =>
                        {
                            if running {
                                catch_up(model, &mut state);
                                let acked = Action::ClaimAcked { server };
                                assert!(may(model, &state, acked), "the replica has the claim");
                                state = model.step(&state, acked).0;
                                steps.push(Step::Call(call));
                            } else {
                                // The model's release (`ClaimNotAcked`) is the store's own.
                                state = model.step(&state, Action::ClaimNotAcked { server }).0;
                                steps.push(Step::ClaimNotAcked(call));
                            }
                        }
                        // A completion that waits for the replica.
                        (Some(server), Some(call))
                            if may(model, &state, Action::CompleteTimedOut { server }) =>
                        {
                            if !running {
                                state = model.step(&state, Action::CompleteTimedOut { server }).0;
                            }
                            steps.push(Step::Call(call));
                        }
                        (_, Some(call)) => steps.push(Step::Call(call)),
                        (_, None) => {}
                    }
                }
                if running {
                    catch_up(model, &mut state);
                }
                steps.push(holds(&state, running));
            }
            if !running {
                steps.push(Step::Replica(true));
                catch_up(model, &mut state);
                steps.push(holds(&state, true));
            }
            steps
        })
        .collect()
}

fn holds(state: &State, running: bool) -> Step {
    Step::Holds {
        primary: state.nodes[0].records.clone(),
        replica: running.then(|| state.nodes.get(1).expect("a replica").records.clone()),
    }
}

/// A record as read from a node: owner, fingerprint, state byte and payload. The layout
/// (`src/store/redis/record.rs`): `TIR`, a version byte, the owner's length (u16, big-endian),
/// the owner, the state (`F` or `C`), the deadline (8 bytes), the fingerprint (32), its policy
/// tag (8), the payload.
type Stored = (String, [u8; 32], u8, Bytes);

fn parse_stored(record: &Bytes) -> Stored {
    let owner_len = usize::from(u16::from_be_bytes([record[4], record[5]]));
    let state_at = 6 + owner_len;
    let fingerprint: [u8; 32] = record[state_at + 9..state_at + 41].try_into().expect("32 bytes");
    (
        String::from_utf8_lossy(&record[6..state_at]).into_owned(),
        fingerprint,
        record[state_at],
        record.slice(state_at + 49..),
    )
}

impl Walk {
    /// The record the model says a node holds, as it would be read from it.
    fn stored(&mut self, rec: Option<Rec>) -> Option<Stored> {
        let rec = rec?;
        let (state, payload) = match rec.state {
            RecState::InFlight => (b'F', Bytes::new()),
            RecState::Completed(payload) => (b'C', payload_bytes(payload)),
        };
        let owner = self.owner(rec.owner).as_str().to_owned();
        Some((owner, *fingerprint(rec.fingerprint).as_bytes(), state, payload))
    }

    /// Compares what `node` holds for each record with `model`'s records (by slot).
    async fn compare_node(
        &mut self,
        name: &str,
        node: &fred::clients::Client,
        store: &tower_idempotency::RedisStore,
        model: &[Option<Rec>],
    ) -> Result<(), String> {
        use fred::interfaces::KeysInterface;
        for record in 0..self.config.records.len() as u8 {
            let key = store.redis_key(&self.key_of(record));
            let found: Option<Bytes> = node
                .get(&key)
                .await
                .map_err(|e| format!("GET on the {name}: {e}"))?;
            let real = found.as_ref().map(parse_stored);
            let expected = self.stored(model[self.config.slot(record)]);
            if real != expected {
                return Err(format!(
                    "the {name} holds {real:?} for record {record}, the model {expected:?}"
                ));
            }
        }
        Ok(())
    }
}

/// A master and a replica in sync with it.
struct Pair {
    master: common::RedisServer,
    replica: common::RedisServer,
    /// Plain clients of each, to read records and ask the master for the replica's offset.
    on_master: fred::clients::Client,
    on_replica: fred::clients::Client,
}

impl Pair {
    async fn start() -> Self {
        // Redis waits 5 s by default before a diskless full sync, for more replicas to join.
        let master = common::RedisServer::start_with(&["--repl-diskless-sync-delay", "0"]);
        let port = master.port().to_string();
        let replica = common::RedisServer::start_with(&["--replicaof", "127.0.0.1", &port]);
        let on_master = common::client(&master.url()).await;
        let on_replica = common::client(&replica.url()).await;
        let pair = Self {
            master,
            replica,
            on_master,
            on_replica,
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !pair.caught_up("100").await {
            assert!(
                std::time::Instant::now() < deadline,
                "the replica never came online and acknowledged a write"
            );
        }
        pair
    }

    /// Whether the replica has every write the master had a moment ago, within `ms`: a write
    /// of the master's own client, and a `WAIT` for it (which counts that client's writes).
    async fn caught_up(&self, ms: &str) -> bool {
        common::admin(&self.on_master, &["SET", "caught-up-probe", "1"]).await;
        common::admin(&self.on_master, &["WAIT", "1", ms]).await.as_i64() == Some(1)
    }

    /// Stops (`SIGSTOP`) or resumes (`SIGCONT`) the replica; resumed, waits until it has caught up.
    async fn replica_running(&self, running: bool) {
        let pid = self.replica.pid().expect("a running replica").to_string();
        let signal = if running { "-CONT" } else { "-STOP" };
        let status = std::process::Command::new("kill")
            .args([signal, &pid])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill {signal} {pid} failed");
        if running {
            assert!(
                self.caught_up(CATCH_UP_MS).await,
                "the replica did not catch up within {CATCH_UP_MS} ms of resuming"
            );
        }
    }
}

/// Two stores on `pair`'s master with the durability option, alike but for their `WAIT`
/// timeout: the steps take the first while the replica runs, the second while it is stopped.
struct Durable {
    running: tower_idempotency::RedisStore,
    stopped: tower_idempotency::RedisStore,
}

impl Durable {
    async fn on(pair: &Pair) -> Self {
        let store = |timeout| async move {
            let store = common::connect(&pair.master.url())
                .await
                .expect("connect")
                .with_replica_acks(tower_idempotency::ReplicaAcks::new(1).timeout(timeout))
                .await
                .expect("connect the waiting connections");
            store.load_scripts().await.expect("load the scripts");
            store
        };
        Self {
            running: store(RUNNING_WAIT_TIMEOUT).await,
            stopped: store(WAIT_TIMEOUT).await,
        }
    }
}

/// Replays `steps` on `stores` (the pair's master with the durability option). `Err` names the
/// first step whose answer, or whose record on either node, differs from the model's.
async fn replay_replicated(
    pair: &Pair,
    stores: &Durable,
    walk: usize,
    steps: &[Step],
) -> Result<usize, String> {
    let mut replayed = Walk::new(replicated_config(), walk);
    let (mut calls, mut store) = (0, &stores.running);
    for (i, step) in steps.iter().enumerate() {
        let differs = |real: String| {
            let from = steps[..i]
                .iter()
                .rposition(|step| !matches!(step, Step::Holds { .. }))
                .unwrap_or(0);
            format!(
                "replicated walk {walk}, step {i} of {}: {step:?}\n  but {real}\n  the steps before: {:#?}",
                steps.len(),
                &steps[from.saturating_sub(8)..i]
            )
        };
        match step {
            Step::Call(call) => {
                calls += 1;
                replayed
                    .call(store, *call, LONG_LEASE)
                    .await
                    .map_err(|real| differs(format!("the store answered {real}")))?;
            }
            Step::ClaimNotAcked(call) => {
                calls += 1;
                let Call::Claim {
                    record,
                    fingerprint: f,
                    owner: token,
                    ..
                } = *call
                else {
                    panic!("only a claim waits for its acknowledgement: {call:?}")
                };
                let owner = replayed.owner(token);
                let key = replayed.key_of(record);
                match store.claim(&key, &fingerprint(f), &owner, LONG_LEASE).await {
                    Err(StoreError::NotReplicated { .. }) => {}
                    other => {
                        return Err(differs(format!(
                            "the store answered {other:?}, not NotReplicated (503)"
                        )))
                    }
                }
            }
            Step::Replica(running) => {
                pair.replica_running(*running).await;
                store = if *running {
                    &stores.running
                } else {
                    &stores.stopped
                };
            }
            Step::Holds { primary, replica } => {
                replayed
                    .compare_node("master", &pair.on_master, store, primary)
                    .await
                    .map_err(differs)?;
                if let Some(replica) = replica {
                    // Caught up with the master's last write, which came after the step's.
                    if !pair.caught_up(CATCH_UP_MS).await {
                        return Err(differs(format!(
                            "the running replica did not catch up within {CATCH_UP_MS} ms"
                        )));
                    }
                    replayed
                        .compare_node("replica", &pair.on_replica, store, replica)
                        .await
                        .map_err(differs)?;
                }
            }
        }
    }
    Ok(calls)
}

/// The model's walks with the durability option, on a real master and replica, one walk after
/// another (the replica's state is the pair's). No time is asserted: a claim not acknowledged
/// costs the short `WAIT` timeout (50 ms), and the bounds (a 2 s `WAIT` while the replica runs,
/// 5 s to catch up) are wide margins for a busy machine, not measurements.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_store_with_replica_acks_answers_and_replicates_as_the_model() {
    let started = std::time::Instant::now();
    let pair = Pair::start().await;
    let stores = Durable::on(&pair).await;
    let model = System::new(replicated_config());
    let walks = replicated_walks(&model);
    let (mut calls, mut not_acked, mut stops) = (0, 0, 0);
    for (walk, steps) in walks.iter().enumerate() {
        let replayed = replay_replicated(&pair, &stores, walk, steps).await;
        if replayed.is_err() {
            // Resumed, so the pair is stopped cleanly whatever the step.
            pair.replica_running(true).await;
        }
        calls += replayed.unwrap_or_else(|difference| panic!("{difference}"));
        not_acked += steps
            .iter()
            .filter(|step| matches!(step, Step::ClaimNotAcked(_)))
            .count();
        stops += steps
            .iter()
            .filter(|step| matches!(step, Step::Replica(false)))
            .count();
    }
    println!(
        "replicated: {calls} store calls of {REPLICATED_WALKS} walks answered and held as the model, \
         {not_acked} claims not acknowledged, the replica stopped {stops} times; in {:?}",
        started.elapsed()
    );
    assert!(
        not_acked > 0,
        "no walk had a claim the stopped replica did not acknowledge"
    );
}
