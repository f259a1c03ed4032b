//! Failover under a retry storm on Redis Sentinel (1 master, 1 replica, 3 sentinels).
//!
//! Two layer "nodes", each over its own `RedisStore::connect(<redis-sentinel:// URL>)`, take a
//! storm of clients that retry every key until they get an answer other than 409 or 503, while the
//! master fails over: gracefully (`SENTINEL FAILOVER`) or by force (`kill -9` of the master, the
//! replica promoted after `down-after-milliseconds`). A ledger counts the handler's executions per
//! key. Each test prints duplicate executions, keys in flight at the end, keys never answered,
//! the window in which clients got 503, and the NOSCRIPT reloads on the new master.
//!
//! Asserted: every call is answered by the deadline with the handler's 201 (first run or replay),
//! no key is answered with two different bodies, every key is completed at the end (none left in
//! flight), no result is reported not stored (the reconciliation hook), and no key runs twice,
//! with and without the durability option
//! (`RedisStore::with_replica_acks`; those storms run two replicas, one of which must
//! acknowledge).

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::Router;
use bytes::Bytes;
use common::sentinel::{data_cli, SentinelTopology};
use common::storm::{app, Ledger};
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use tower::ServiceExt;
use tower_idempotency::{IdempotencyLayer, RecordState, RedisStore, ReplicaAcks};

const KEYS: usize = 40;
const CLIENTS_PER_KEY: usize = 3;
/// Each client asks this many times, a pause apart (the later calls should be replays).
const CALLS_PER_CLIENT: usize = 3;
const PAUSE_BETWEEN_CALLS: Duration = Duration::from_millis(300);
/// Keys start one after another over this span, so some are running during the failover.
const STAGGER: Duration = Duration::from_millis(3000);
const FAILOVER_AT: Duration = Duration::from_millis(1000);
/// Longer than the whole failover as the store sees it (detection, promotion, the switch, its
/// connections to the new master): with 5 s, three of six storms on a loaded machine ran a key
/// twice, each reported `LostBeforeReplicated` by the reconciliation hook: the claim's lease ran
/// out on the promoted replica before its completion could reach it (the documented limit).
const LEASE: Duration = Duration::from_secs(15);
/// A client that has no answer this long after its first try counts as never answered.
const DEADLINE: Duration = Duration::from_secs(25);
const HANDLER_TIME: Duration = Duration::from_millis(40);

/// When clients got 503s, relative to the start of the storm.
#[derive(Default)]
struct Unavailable {
    count: usize,
    first: Option<Duration>,
    last: Option<Duration>,
}

#[derive(Default)]
struct Tally {
    conflicts: usize,
    unavailable: Unavailable,
}

/// Sends the request until it gets an answer other than 409 or 503; `None` past the deadline.
async fn call_until_answered(
    nodes: &[Router; 2],
    key: &str,
    turn: usize,
    storm_started: Instant,
    tally: &Mutex<Tally>,
) -> Option<(StatusCode, Bytes)> {
    let deadline = Instant::now() + DEADLINE;
    let mut attempt = turn;
    while Instant::now() < deadline {
        let node = nodes[attempt % 2].clone();
        attempt += 1;
        let request = Request::post("/payments")
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .body(Body::from(format!("{{\"key\":\"{key}\"}}")))
            .unwrap();
        let response = node.oneshot(request).await.unwrap();
        let status = response.status();
        match status {
            StatusCode::CONFLICT => tally.lock().unwrap().conflicts += 1,
            StatusCode::SERVICE_UNAVAILABLE => {
                let at = storm_started.elapsed();
                let unavailable = &mut tally.lock().unwrap().unavailable;
                unavailable.count += 1;
                unavailable.first.get_or_insert(at);
                unavailable.last = Some(at);
            }
            _ => return Some((status, response.into_body().collect().await.unwrap().to_bytes())),
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    None
}

#[derive(Clone, Copy)]
enum Failover {
    /// `SENTINEL FAILOVER`: the master is reachable and demoted by the sentinels.
    Graceful,
    /// `kill -9` of the master; the sentinels promote the replica once it is seen down.
    Forced,
}

struct Report {
    different_bodies: Vec<String>,
    never_answered: usize,
    duplicates: usize,
    /// Answers other than the handler's 201 (a replay answers its status too).
    other_statuses: Vec<String>,
    /// Keys still in flight, or that could not be inspected, once every client has its answer.
    left_in_flight: Vec<String>,
    /// Results the layer reported not stored (key, kind, when).
    not_stored: Vec<(String, String, Duration)>,
}

/// The durability option of the storms that use it: one replica must acknowledge, of the two
/// the topology then runs (so that losing one does not stop the service).
fn acks() -> ReplicaAcks {
    ReplicaAcks::new(1).timeout(Duration::from_millis(250))
}

async fn storm(failover: Failover, durability: Option<ReplicaAcks>) -> Report {
    let name = match (failover, &durability) {
        (Failover::Graceful, None) => "SENTINEL FAILOVER",
        (Failover::Forced, None) => "kill -9 of the master",
        (Failover::Graceful, Some(_)) => "SENTINEL FAILOVER, replica acks",
        (Failover::Forced, Some(_)) => "kill -9 of the master, replica acks",
    };
    let replicas = if durability.is_some() { 2 } else { 1 };
    let topology = tokio::task::spawn_blocking(move || SentinelTopology::start_with_replicas(replicas))
        .await
        .unwrap();
    let topology = Arc::new(Mutex::new(topology));
    let url = topology.lock().unwrap().url();
    // Every result the layer could not store, with when: a key that runs twice after its
    // completion failed is the documented limit; one that runs twice without it is a bug.
    let not_stored: Arc<Mutex<Vec<(String, String, Duration)>>> = Arc::default();
    let storm_started = Instant::now();
    let layer = |store: RedisStore| {
        let not_stored = not_stored.clone();
        IdempotencyLayer::new(store)
            .with_lease(LEASE)
            .with_reconciliation(move |event| {
                let key = event.key.key().as_str().to_owned();
                let entry = (key, format!("{:?}", event.kind), storm_started.elapsed());
                not_stored.lock().unwrap().push(entry);
            })
    };
    let connect = |node: &'static str| {
        let (url, durability) = (url.clone(), durability.clone());
        async move {
            let store = RedisStore::connect(&url).await.expect(node);
            match durability {
                Some(acks) => store.with_replica_acks(acks).await.expect(node),
                None => store,
            }
        }
    };
    let stores = [connect("connect node a").await, connect("connect node b").await];
    let ledger = Ledger::default();
    let operator = layer(stores[0].clone());
    let nodes = [
        app(layer(stores[0].clone()), ledger.clone(), "a", |_| HANDLER_TIME),
        app(layer(stores[1].clone()), ledger.clone(), "b", |_| HANDLER_TIME),
    ];
    let old_master = topology.lock().unwrap().master_port();
    let tally = Arc::new(Mutex::new(Tally::default()));

    let mut clients = Vec::new();
    for k in 0..KEYS {
        let start_at = STAGGER * k as u32 / KEYS as u32;
        for c in 0..CLIENTS_PER_KEY {
            let nodes = nodes.clone();
            let tally = tally.clone();
            let key = format!("key-{k}");
            clients.push(tokio::spawn(async move {
                tokio::time::sleep(start_at).await;
                let mut answers = Vec::new();
                for call in 0..CALLS_PER_CLIENT {
                    let answer = call_until_answered(&nodes, &key, k + c + call, storm_started, &tally).await;
                    answers.push(answer);
                    tokio::time::sleep(PAUSE_BETWEEN_CALLS).await;
                }
                (key, answers)
            }));
        }
    }

    tokio::time::sleep(FAILOVER_AT).await;
    let failover_at = storm_started.elapsed();
    let promoted = {
        let topology = topology.clone();
        tokio::task::spawn_blocking(move || {
            let mut topology = topology.lock().unwrap();
            match failover {
                Failover::Graceful => topology.failover(),
                Failover::Forced => topology.node_mut(old_master).kill(),
            }
            topology.wait_for_new_master(old_master, Duration::from_secs(15))
        })
        .await
        .unwrap()
    };
    let promoted_at = storm_started.elapsed();

    let mut answers_per_key: HashMap<String, Vec<Option<(StatusCode, Bytes)>>> = HashMap::new();
    for client in clients {
        let (key, answers) = client.await.unwrap();
        answers_per_key.entry(key).or_default().extend(answers);
    }
    let storm_took = storm_started.elapsed();

    // A demoted master throws away what it acknowledged since the promotion; a client's late
    // retry then finds its key gone (runs it again) or still in flight. So every key is asked
    // once more after the old master is a replica again (a killed one stays dead).
    if let Failover::Graceful = failover {
        let topology = topology.clone();
        let demoted = tokio::task::spawn_blocking(move || {
            topology
                .lock()
                .unwrap()
                .wait_until_settled(Duration::from_secs(30));
            storm_started.elapsed()
        })
        .await
        .unwrap();
        println!("sentinel storm, {name}: the old master {old_master} is a replica again at {demoted:?}");
    }
    let late_retries: Vec<_> = (answers_per_key.keys().cloned().enumerate())
        .map(|(turn, key)| {
            let nodes = nodes.clone();
            let tally = tally.clone();
            tokio::spawn(async move {
                let answer = call_until_answered(&nodes, &key, turn, storm_started, &tally).await;
                (key, answer)
            })
        })
        .collect();
    for retry in late_retries {
        let (key, answer) = retry.await.unwrap();
        answers_per_key.entry(key).or_default().push(answer);
    }

    let runs = ledger.runs();
    let duplicates: usize = runs.values().map(|runs| runs.len().saturating_sub(1)).sum();
    let keys_run_twice = runs.values().filter(|runs| runs.len() > 1).count();
    let never_answered = (answers_per_key.values())
        .filter(|answers| answers.iter().any(Option::is_none))
        .count();
    let mut different_bodies = Vec::new();
    let mut other_statuses = Vec::new();
    for (key, answers) in &answers_per_key {
        for (status, body) in answers.iter().flatten() {
            if *status != StatusCode::CREATED {
                other_statuses.push(format!("{key}: {status} {body:?}"));
            }
        }
        let mut bodies: Vec<&Bytes> = answers.iter().flatten().map(|(_, body)| body).collect();
        bodies.sort();
        bodies.dedup();
        if bodies.len() > 1 {
            different_bodies.push(format!("{key}: {bodies:?}"));
        }
    }
    // Every client has its answer, so every key is completed: one still in flight was neither
    // completed nor released (an error reading it counts too).
    let mut left_in_flight = Vec::new();
    for key in answers_per_key.keys() {
        match operator.inspect(None, key).await {
            Ok(Some(record)) if record.state == RecordState::Completed => {}
            other => left_in_flight.push(format!("{key}: {other:?}")),
        }
    }
    let in_flight_at_end = left_in_flight.len();
    let reloads = tokio::task::spawn_blocking(move || {
        let stats = data_cli(promoted, &["INFO", "commandstats"]);
        (stats.lines())
            .find_map(|line| line.strip_prefix("cmdstat_eval:calls="))
            .and_then(|rest| rest.split(',').next())
            .and_then(|calls| calls.parse::<u64>().ok())
            .unwrap_or(0)
    })
    .await
    .unwrap();
    let tally = tally.lock().unwrap();
    let window = match (tally.unavailable.first, tally.unavailable.last) {
        (Some(first), Some(last)) => format!("{:?} .. {:?} ({:?})", first, last, last - first),
        _ => "none".to_owned(),
    };
    println!(
        "sentinel storm, {name}: {KEYS} keys x {CLIENTS_PER_KEY} clients x {CALLS_PER_CLIENT} calls; failover \
         triggered at {failover_at:?}, sentinels named {promoted} (was {old_master}) at {promoted_at:?}; storm took \
         {storm_took:?}\n  duplicate executions: {duplicates} (keys run more than once: {keys_run_twice})\n  keys in \
         flight at the end: {in_flight_at_end}\n  keys never answered: {never_answered}\n  keys answered with \
         different bodies: {}\n  503 answers: {} in {window}\n  409 answers: {}\n  NOSCRIPT reloads (EVAL) on the \
         new master: {reloads}",
        different_bodies.len(),
        tally.unavailable.count,
        tally.conflicts,
    );
    let not_stored = not_stored.lock().unwrap().clone();
    println!(
        "  results not stored: {not_stored:?}\n  answers other than 201: {}",
        other_statuses.len()
    );
    Report {
        different_bodies,
        never_answered,
        duplicates,
        other_statuses,
        left_in_flight,
        not_stored,
    }
}

/// Every key answered by the deadline with the handler's 201, none left in flight, every result
/// stored, and at most `lost` keys answered with two bodies.
fn assert_answered(report: &Report, lost: usize) {
    assert_eq!(report.never_answered, 0, "keys never answered by the deadline");
    assert!(
        report.other_statuses.is_empty(),
        "{} answers other than 201, among them: {:?}",
        report.other_statuses.len(),
        &report.other_statuses[..report.other_statuses.len().min(5)]
    );
    assert!(
        report.left_in_flight.is_empty(),
        "keys not completed at the end: {:?}",
        report.left_in_flight
    );
    assert!(
        report.not_stored.is_empty(),
        "results not stored: {:?}",
        report.not_stored
    );
    assert!(
        report.different_bodies.len() <= lost,
        "{} keys answered with different bodies (at most {lost} expected): {:?}",
        report.different_bodies.len(),
        report.different_bodies
    );
}

/// Before the store followed `+switch-master`, it stayed on the old master, which acknowledged
/// writes until it was demoted ~15 s later and threw them away: 24 of 40 keys ran twice.
/// Following the switch left the writes the old master took between the replica's promotion
/// and the announcement (0.2-1.2 s): 1-15 keys ran twice. Now the store refuses claims from the
/// moment the leading sentinel announces the promotion (`+failover-state-send-slaveof-noone`,
/// one sentinel tick before it sends `REPLICAOF NO ONE`) until the switch: none runs twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_failover_under_a_retry_storm() {
    let report = storm(Failover::Graceful, None).await;
    assert_answered(&report, 0);
    assert_eq!(report.duplicates, 0, "keys ran twice");
}

/// A killed master acknowledges nothing more, and what it acknowledged had reached the replica
/// (loopback replication keeps up): no key runs twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forced_failover_under_a_retry_storm() {
    let report = storm(Failover::Forced, None).await;
    assert_answered(&report, 0);
    assert_eq!(report.duplicates, 0, "keys ran twice");
}

/// With the durability option as well: claims wait for a replica, so a failover that is not
/// announced (or announced late) still cannot lose one. Clients get 503 until a replica follows
/// the new master (the two replicas resync), and 409 while completions wait for one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_failover_with_replica_acks_runs_no_key_twice() {
    let report = storm(Failover::Graceful, Some(acks())).await;
    assert_answered(&report, 0);
    assert_eq!(
        report.duplicates, 0,
        "keys ran twice despite the replicas' acknowledgements"
    );
}

/// The same with the master killed: what it acknowledged, a replica had.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forced_failover_with_replica_acks_runs_no_key_twice() {
    let report = storm(Failover::Forced, Some(acks())).await;
    assert_answered(&report, 0);
    assert_eq!(
        report.duplicates, 0,
        "keys ran twice despite the replicas' acknowledgements"
    );
}
