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
//! and a graceful failover answers 503 for at most 2 s (issue 35's goal), with and without the
//! durability option
//! (`RedisStore::with_replica_acks`; those storms run two replicas, one of which must
//! acknowledge).

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::Router;
use bytes::Bytes;
use common::proxy::{Fault, FaultProxy};
use common::sentinel::{data_cli, SentinelTopology, Timing, SERVICE};
use common::storm::{app, Ledger};
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use tower::ServiceExt;
use tower_idempotency::{IdempotencyKey, IdempotencyLayer, RecordKey, RecordState, RedisStore, ReplicaAcks};

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
        let (node, name) = (nodes[attempt % 2].clone(), ["a", "b"][attempt % 2]);
        attempt += 1;
        let request = Request::post("/payments")
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .body(Body::from(format!("{{\"key\":\"{key}\"}}")))
            .unwrap();
        let response = node.oneshot(request).await.unwrap();
        let status = response.status();
        // Read with the store's log (`common::storm::trace_if_asked`); 409s are the bulk.
        match status {
            StatusCode::CONFLICT => tracing::trace!(target: "storm", key, node = name, %status, "answered"),
            _ => tracing::debug!(target: "storm", key, node = name, %status, "answered"),
        }
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
    /// From the first 503 to the last (none: no 503).
    unavailable_for: Option<Duration>,
}

/// Issue 35's goal for a planned failover (`SENTINEL FAILOVER`), with or without the durability
/// option: clients get 503 for at most this long.
const GRACEFUL_UNAVAILABLE_GOAL: Duration = Duration::from_secs(2);

/// A graceful failover's 503s lasted no longer than the goal.
fn assert_short(report: &Report) {
    let unavailable_for = report.unavailable_for.unwrap_or_default();
    assert!(
        unavailable_for <= GRACEFUL_UNAVAILABLE_GOAL,
        "clients got 503 for {unavailable_for:?}, over the goal of {GRACEFUL_UNAVAILABLE_GOAL:?}"
    );
}

/// The durability option of the storms that use it: one replica must acknowledge, of the two
/// the topology then runs (so that losing one does not stop the service).
fn acks() -> ReplicaAcks {
    ReplicaAcks::new(1).timeout(Duration::from_millis(250))
}

async fn storm(failover: Failover, durability: Option<ReplicaAcks>) -> Report {
    storm_through(failover, durability, None).await
}

/// [`storm`], the stores given the URL of every sentinel, or of the `through`th alone.
async fn storm_through(
    failover: Failover,
    durability: Option<ReplicaAcks>,
    through: Option<usize>,
) -> Report {
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
    common::storm::trace_if_asked();
    let _monitors = topology.monitor_if_asked();
    let topology = Arc::new(Mutex::new(topology));
    let url = match through {
        Some(sentinel) => topology.lock().unwrap().url_of(sentinel),
        None => topology.lock().unwrap().url(),
    };
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
    for k in 0..KEYS {
        let key = format!("key-{k}");
        let record = RecordKey::new(None, IdempotencyKey::parse(&key).unwrap());
        tracing::debug!(target: "storm", key, redis_key = stores[0].redis_key(&record), "the storm's key");
    }
    let ledger = Ledger::default();
    let operator = layer(stores[0].clone());
    let nodes = [
        app(layer(stores[0].clone()), ledger.clone(), "a", |_| HANDLER_TIME),
        app(layer(stores[1].clone()), ledger.clone(), "b", |_| HANDLER_TIME),
    ];
    let old_master = topology.lock().unwrap().master_port();
    let tally = Arc::new(Mutex::new(Tally::default()));

    tracing::info!(target: "storm", since_start = ?storm_started.elapsed(), "the clients start");
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
            tracing::info!(target: "storm", old_master, "failing the master over");
            match failover {
                Failover::Graceful => topology.failover(),
                Failover::Forced => topology.node_mut(old_master).kill(),
            }
            tracing::info!(target: "storm", old_master, "failover triggered");
            topology.wait_for_new_master(old_master, Duration::from_secs(15))
        })
        .await
        .unwrap()
    };
    let promoted_at = storm_started.elapsed();
    tracing::info!(target: "storm", promoted, "the sentinels name the new master");

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
        unavailable_for: (tally.unavailable.first)
            .zip(tally.unavailable.last)
            .map(|(first, last)| last - first),
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
    assert_short(&report);
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
    assert_short(&report);
    assert_eq!(
        report.duplicates, 0,
        "keys ran twice despite the replicas' acknowledgements"
    );
}

/// A graceful failover with the durability option, the stores given one sentinel's address (as
/// through a Kubernetes Service in front of the sentinels), not the one that leads the failover
/// (`SENTINEL FAILOVER` goes to the first). Only the leader announces the promotion, so before
/// the watch listened to the sentinels the others know of, the stores were not fenced: claims
/// went to the old master between the promotion and the switch, the other replica (still
/// following it) acknowledged them, and the demotion threw them away: 14 of 40 keys ran twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_failover_through_one_sentinel_address_runs_no_key_twice() {
    let report = storm_through(Failover::Graceful, Some(acks()), Some(1)).await;
    assert_answered(&report, 0);
    assert_short(&report);
    assert_eq!(report.duplicates, 0, "keys ran twice");
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

/// Why graceful storms with replica acks ran a key twice on a loaded machine (key-14 of
/// `graceful_failover_through_one_sentinel_address_runs_no_key_twice`, twice in three runs, the
/// key that starts as `SENTINEL FAILOVER` is sent; nothing reported not stored; the second run
/// when the first's claim lapsed, 15 s later): a completion passed the fence (still down), then
/// reached the old master only after the sentinels had promoted a replica; the other replica,
/// not reconfigured yet, acknowledged it there, and the old master's demotion threw it away. The
/// promoted replica kept the claim in flight until its lease ran out. Here the old master runs
/// no write (`CLIENT PAUSE WRITE`) from before the completion is sent until a replica answers
/// `ROLE` as a master. The store heard the promotion begin meanwhile, so it does not trust the
/// acknowledgement and completes the record again on the new master once it is confirmed
/// there. Before, the completion counted as acknowledged, and the new master held the key in
/// flight for the rest of its lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_the_old_master_takes_after_the_promotion_is_completed_again_on_the_new_master() {
    use common::sentinel::DATA_PASSWORD;
    use fred::types::Value;
    use tower_idempotency::{Begin, Coordinator, Fingerprint, Store};

    let topology = tokio::task::spawn_blocking(|| SentinelTopology::start_with_replicas(2))
        .await
        .unwrap();
    let old_master = topology.master_port();
    let node = |port: u16| format!("redis://:{DATA_PASSWORD}@127.0.0.1:{port}");
    let replicas: Vec<u16> = (topology.nodes.iter().map(|node| node.port()))
        .filter(|&port| port != old_master)
        .collect();
    // Connected before the failover: polled every few milliseconds, so that the old master is
    // released while the other replica still follows it (the sentinels reconfigure it a tick
    // or more after they see the promotion).
    let mut replica_clients = Vec::new();
    for &port in &replicas {
        replica_clients.push(common::client(&node(port)).await);
    }
    let old_master_client = common::client(&node(old_master)).await;
    let store = RedisStore::connect(&topology.url())
        .await
        .expect("connect")
        .with_replica_acks(acks())
        .await
        .expect("the waiting connections");
    let not_stored: Arc<Mutex<Vec<String>>> = Arc::default();
    let reported = not_stored.clone();
    let coordinator = Coordinator::new(store)
        .with_lease(Duration::from_secs(30))
        .with_reconciliation(move |event| reported.lock().unwrap().push(format!("{:?}", event.kind)));
    let key = RecordKey::new(None, IdempotencyKey::parse("landed-after-the-promotion").unwrap());
    let fingerprint = Fingerprint::new([b"{}".as_slice()]);
    let Ok(Begin::Claimed(claim)) = coordinator.begin(&key, &fingerprint).await else {
        panic!("a new key is claimed");
    };

    common::admin(&old_master_client, &["CLIENT", "PAUSE", "10000", "WRITE"]).await;
    let completing = tokio::spawn(claim.complete("the result".into()));
    // On its way: past the fence, held by the old master.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !completing.is_finished(),
        "the old master took the completion while paused"
    );
    topology.failover();
    let role = |answer: Value| match answer {
        Value::Array(fields) => fields.first().and_then(Value::as_string),
        _ => None,
    };
    let promoted = async {
        loop {
            for (client, &port) in replica_clients.iter().zip(&replicas) {
                if role(common::admin(client, &["ROLE"]).await).as_deref() == Some("master") {
                    return port;
                }
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    };
    let promoted = tokio::time::timeout(Duration::from_secs(10), promoted)
        .await
        .expect("a replica promoted");
    common::admin(&old_master_client, &["CLIENT", "UNPAUSE"]).await;
    // The other replica followed the old master when it took the completion: it could
    // acknowledge it there (without that, this test would show nothing).
    let other = (replica_clients.iter().zip(&replicas))
        .find(|(_, &port)| port != promoted)
        .map(|(client, _)| client)
        .expect("two replicas");
    let followed = common::admin(other, &["ROLE"]).await;
    println!("promoted {promoted}; the other replica at the completion's release: {followed:?}");
    let completed = tokio::time::timeout(Duration::from_secs(10), completing)
        .await
        .expect("the completion answers")
        .unwrap();
    assert!(completed.is_ok(), "{completed:?}");

    // On the new master: the record completed, not the claim in flight (a retry would find it
    // in flight for the rest of the lease, then run the operation again).
    let new_master = RedisStore::connect(&node(promoted))
        .await
        .expect("the new master");
    let mut last = None;
    let deadline = Instant::now() + Duration::from_secs(15);
    while Instant::now() < deadline {
        last = Some(
            new_master
                .inspect(&key)
                .await
                .map(|record| record.map(|record| record.state)),
        );
        if matches!(last, Some(Ok(Some(RecordState::Completed)))) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    println!(
        "on the new master {promoted}: {last:?}; not stored: {:?}",
        not_stored.lock().unwrap()
    );
    assert!(
        matches!(last, Some(Ok(Some(RecordState::Completed)))),
        "the new master {promoted} holds {last:?}, not the completed record"
    );
    assert!(
        not_stored.lock().unwrap().is_empty(),
        "{:?}",
        not_stored.lock().unwrap()
    );
}

/// Fresh keys, one every 50 ms, each sent from a task of its own through `node`: when each was
/// sent (from the stream's start), how it was answered, and how long the answer took.
struct Stream {
    started: Instant,
    answers: Arc<Mutex<Vec<(Duration, StatusCode, Duration)>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Stream {
    fn start(node: Router, name: &'static str) -> Self {
        let started = Instant::now();
        let answers: Arc<Mutex<Vec<(Duration, StatusCode, Duration)>>> = Arc::default();
        let task = tokio::spawn({
            let answers = answers.clone();
            async move {
                for n in 0u64.. {
                    let (node, answers) = (node.clone(), answers.clone());
                    tokio::spawn(async move {
                        let sent = started.elapsed();
                        let key = format!("{name}-{n}");
                        let request = Request::post("/payments")
                            .header("idempotency-key", &key)
                            .body(Body::from(format!("{{\"key\":\"{key}\"}}")))
                            .unwrap();
                        let status = node.oneshot(request).await.unwrap().status();
                        answers
                            .lock()
                            .unwrap()
                            .push((sent, status, started.elapsed() - sent));
                    });
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        });
        Self {
            started,
            answers,
            task,
        }
    }

    fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    /// The answers to the requests sent from `from` to `to`.
    fn sent_between(&self, from: Duration, to: Duration) -> Vec<(Duration, StatusCode, Duration)> {
        let answers = self.answers.lock().unwrap();
        (answers.iter().copied())
            .filter(|(sent, _, _)| (from..to).contains(sent))
            .collect()
    }

    /// Waits (at most `timeout`) for a request sent from now on to be answered `status`;
    /// when it was sent.
    async fn until_answered(&self, status: StatusCode, timeout: Duration) -> Duration {
        let from = self.elapsed();
        let deadline = Instant::now() + timeout;
        loop {
            let found = (self.sent_between(from, Duration::MAX).into_iter())
                .filter(|(_, answered, _)| *answered == status)
                .map(|(sent, _, _)| sent)
                .min();
            if let Some(sent) = found {
                return sent;
            }
            assert!(
                Instant::now() < deadline,
                "no request answered {status} within {timeout:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// [`until_answered`](Self::until_answered), `None` past `timeout`.
    async fn answered_within(&self, status: StatusCode, timeout: Duration) -> Option<Duration> {
        tokio::time::timeout(
            timeout,
            self.until_answered(status, timeout + Duration::from_secs(1)),
        )
        .await
        .ok()
    }

    /// Stops sending, waits for the answers in flight, and returns every answer.
    async fn stop(self) -> Vec<(Duration, StatusCode, Duration)> {
        self.task.abort();
        tokio::time::sleep(Duration::from_secs(3)).await;
        let answers = self.answers.lock().unwrap().clone();
        answers
    }
}

/// The connections to the data node on `port` that are neither a sentinel's, a replica's, nor
/// `redis-cli`'s: the store's.
fn store_connections(port: u16) -> Vec<String> {
    let clients = data_cli(port, &["CLIENT", "LIST"]);
    let mut ids: Vec<String> = (clients.lines())
        .filter(|line| {
            !line.contains("name=sentinel-") && !line.contains("flags=S") && !line.contains("cmd=client|list")
        })
        .filter_map(|line| line.split(' ').next().map(str::to_owned))
        .collect();
    ids.sort();
    ids
}

/// Sends `signal` (`-STOP`, `-CONT`) to the process `pid`.
fn signal(pid: u32, signal: &str) {
    let status = std::process::Command::new("kill")
        .args([signal, &pid.to_string()])
        .status()
        .expect("run kill");
    assert!(status.success(), "kill {signal} {pid}");
}

/// Item 2 of issue 35, a sentinel restarted behind one address: with `down-after-milliseconds`
/// 10 s no failover can promote anything in the 3 s the sentinel is away, so the store takes
/// every claim meanwhile, and once it hears the sentinel again it finds the master unchanged and
/// reconnects nothing (a reconnection re-sends the commands in flight). Before, the store went
/// blind at the first missed ping and refused every new key until it heard the sentinel again
/// (measured from outside: 40 of 137 answered 503 over 4 s), then reconnected every client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sentinel_restart_refuses_no_claim_and_reconnects_nothing() {
    let timing = Timing {
        down_after: Duration::from_secs(10),
        failover_timeout: Duration::from_secs(30),
    };
    let topology = tokio::task::spawn_blocking(move || SentinelTopology::start_timed(1, timing))
        .await
        .unwrap();
    let topology = Arc::new(Mutex::new(topology));
    let (url, master, sentinel) = {
        let topology = topology.lock().unwrap();
        (
            topology.url_of(0),
            topology.master_port(),
            topology.sentinels[0].port(),
        )
    };
    let store = RedisStore::connect(&url).await.expect("connect");
    let node = app(IdempotencyLayer::new(store), Ledger::default(), "a", |_| {
        Duration::ZERO
    });
    let stream = Stream::start(node, "restart");
    // The watch has asked the sentinel what it knows of the master.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let connections = store_connections(master);
    assert!(
        !connections.is_empty(),
        "the store is connected to the master {master}"
    );

    let killed = stream.elapsed();
    topology.lock().unwrap().sentinels[0].kill();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let restarted = stream.elapsed();
    tokio::task::spawn_blocking({
        let topology = topology.clone();
        move || topology.lock().unwrap().sentinels[0].restart()
    })
    .await
    .unwrap();
    // The watch has subscribed again (two channels, one pattern), and a few beats more.
    let subscribed = move || {
        let clients = common::sentinel::sentinel_cli(sentinel, &["CLIENT", "LIST"]);
        clients.lines().any(|client| client.contains("sub=2 psub=1"))
    };
    common::until("the watch has subscribed on the restarted sentinel", subscribed).await;
    let heard = stream.elapsed();
    tokio::time::sleep(Duration::from_secs(3)).await;
    // Read while the store is alive: stopping the stream drops it.
    let connections_after = store_connections(master);
    let answers = stream.stop().await;

    let refused: Vec<_> = (answers.iter())
        .filter(|(_, status, _)| *status != StatusCode::CREATED)
        .collect();
    println!(
        "sentinel restart: killed at {killed:?}, restarted at {restarted:?}, subscribed again at {heard:?}; \
         {} of {} keyed requests answered other than 201: {refused:?}",
        refused.len(),
        answers.len()
    );
    assert!(answers.len() > 100, "{} requests", answers.len());
    assert!(
        refused.is_empty(),
        "claims refused though no failover was possible"
    );
    assert_eq!(
        connections_after, connections,
        "the store reconnected though the master did not change"
    );
}

/// `topology`'s URL with each sentinel behind a proxy of its own.
async fn through_sentinel_proxies(topology: &SentinelTopology) -> (String, Vec<FaultProxy>) {
    let mut url = topology.url();
    let mut proxies = Vec::new();
    for port in topology.sentinel_ports() {
        let proxy = FaultProxy::start(([127, 0, 0, 1], port).into()).await;
        url = url.replace(
            &format!("127.0.0.1:{port}"),
            &format!("127.0.0.1:{}", proxy.addr().port()),
        );
        proxies.push(proxy);
    }
    (url, proxies)
}

/// Item 2 of issue 35: the sentinels out of this store's reach (every connection to them cut)
/// longer than a failover could take. The store takes claims for as long as no failover could
/// have promoted a replica (`down-after-milliseconds`, 6 s, after the sentinels last heard the
/// master), then refuses them (503) and runs nothing; meanwhile the sentinels fail the master
/// over (`SENTINEL FAILOVER`). Once they can be reached, the store goes to the new master and
/// takes claims again. Before, it refused claims from the first missed ping.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinels_unheard_longer_than_a_failover_could_take_refuse_claims_then_recover() {
    let timing = Timing {
        down_after: Duration::from_secs(6),
        failover_timeout: Duration::from_secs(10),
    };
    let topology = tokio::task::spawn_blocking(move || SentinelTopology::start_timed(1, timing))
        .await
        .unwrap();
    let (url, proxies) = through_sentinel_proxies(&topology).await;
    let old_master = topology.master_port();
    let store = RedisStore::connect(&url).await.expect("connect");
    let ledger = Ledger::default();
    let node = app(IdempotencyLayer::new(store), ledger.clone(), "a", |_| {
        Duration::ZERO
    });
    let stream = Stream::start(node, "unheard");
    tokio::time::sleep(Duration::from_millis(2500)).await;

    let cut = stream.elapsed();
    proxies.iter().for_each(|proxy| proxy.set(Fault::Drop));
    let refused_from = stream
        .until_answered(StatusCode::SERVICE_UNAVAILABLE, Duration::from_secs(15))
        .await;
    // Every request of the first 3 s is answered (refused or not) by now.
    let first_3_s_answered = cut + Duration::from_millis(3500);
    tokio::time::sleep(first_3_s_answered.saturating_sub(stream.elapsed())).await;
    // No failover can promote before the sentinels have missed the master for 6 s: at least
    // 4 s after the cut (their last answer came up to 1 s before it, about a master they had
    // last heard up to 1 s before that).
    let early = stream.sent_between(cut, cut + Duration::from_secs(3));
    let early_refused: Vec<_> = (early.iter())
        .filter(|(_, status, _)| *status != StatusCode::CREATED)
        .collect();
    println!(
        "sentinels unheard: cut at {cut:?}, claims refused from {refused_from:?} ({:?} after the cut); \
         answers in the first 3 s: {}, of which not 201: {early_refused:?}",
        refused_from - cut,
        early.len()
    );
    assert!(early.len() > 20, "{} requests in the first 3 s", early.len());
    assert!(
        early_refused.is_empty(),
        "claims refused before a failover could promote anything"
    );
    assert!(
        refused_from - cut < timing.down_after + Duration::from_millis(2500),
        "claims were still taken {:?} after the cut, when a failover could have promoted a replica",
        refused_from - cut
    );

    // The sentinels, which this store cannot reach, fail the master over meanwhile.
    let new_master = tokio::task::spawn_blocking(move || {
        topology.failover();
        let new_master = topology.wait_for_new_master(old_master, Duration::from_secs(15));
        (topology, new_master)
    });
    let (topology, new_master) = new_master.await.unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let restored = stream.elapsed();
    let blind = stream.sent_between(refused_from, restored - Duration::from_millis(100));
    let taken: Vec<_> = (blind.iter())
        .filter(|(_, status, _)| *status != StatusCode::SERVICE_UNAVAILABLE)
        .collect();
    assert!(taken.is_empty(), "claims taken while blind: {taken:?}");
    assert!(
        (blind.iter()).all(|(_, _, took)| *took < Duration::from_secs(1)),
        "a refusal waited"
    );
    proxies.iter().for_each(|proxy| proxy.set(Fault::None));
    let recovered = stream
        .until_answered(StatusCode::CREATED, Duration::from_secs(10))
        .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    common::until("the store is connected to the new master", || {
        !store_connections(new_master).is_empty()
    })
    .await;
    let answers = stream.stop().await;
    let after: Vec<_> = (answers.iter())
        .filter(|(sent, status, _)| {
            *sent > recovered + Duration::from_millis(500) && *status != StatusCode::CREATED
        })
        .collect();
    println!(
        "  the sentinels named {new_master} (was {old_master}); reachable again at {restored:?}, claims \
         taken again from {recovered:?} ({:?} later); refused while blind: {}",
        recovered.saturating_sub(restored),
        blind.len()
    );
    assert!(after.is_empty(), "claims refused after the recovery: {after:?}");
    let runs = ledger.runs();
    assert!(runs.values().all(|runs| runs.len() == 1), "a key ran twice");
    drop(topology);
}

/// Item 3 of issue 35: a promotion that takes longer than the fence's old 10 s limit (the
/// promoted replica stopped for 12 s, as one busy loading or resyncing is). The fence stands
/// until the new master is confirmed: claims are answered 503 at once all along, none runs,
/// and once the replica takes the promotion and the sentinels switch, claims go to it. Before,
/// the fence came down after 10 s and claims went to the old master, about to be demoted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fence_stands_until_a_slow_promotion_is_confirmed() {
    let timing = Timing {
        // The sentinels drop their link to a replica that answers nothing after half of it,
        // which must not happen before they send it the promotion.
        down_after: Duration::from_secs(5),
        failover_timeout: Duration::from_secs(40),
    };
    let topology = tokio::task::spawn_blocking(move || SentinelTopology::start_timed(1, timing))
        .await
        .unwrap();
    let old_master = topology.master_port();
    let replica = (topology.nodes.iter())
        .find(|node| node.port() != old_master)
        .map(|node| (node.port(), node.pid().expect("a running replica")))
        .expect("a replica");
    let store = RedisStore::connect(&topology.url()).await.expect("connect");
    let ledger = Ledger::default();
    let node = app(IdempotencyLayer::new(store), ledger.clone(), "a", |_| {
        Duration::ZERO
    });
    let stream = Stream::start(node, "slow");
    tokio::time::sleep(Duration::from_millis(2000)).await;

    // The replica stops before it gets the promotion, and takes it only when it goes on.
    signal(replica.1, "-STOP");
    topology.failover();
    let fenced = stream
        .until_answered(StatusCode::SERVICE_UNAVAILABLE, Duration::from_secs(5))
        .await;
    tokio::time::sleep(Duration::from_secs(12)).await;
    let resumed = stream.elapsed();
    signal(replica.1, "-CONT");
    let recovered = stream
        .until_answered(StatusCode::CREATED, Duration::from_secs(20))
        .await;
    let new_master = tokio::task::spawn_blocking(move || {
        let new_master = topology.wait_for_new_master(old_master, Duration::from_secs(5));
        (topology, new_master)
    });
    let (topology, new_master) = new_master.await.unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let answers = stream.stop().await;

    let during = (answers.iter().copied())
        .filter(|(sent, _, _)| *sent >= fenced && *sent < resumed)
        .collect::<Vec<_>>();
    let taken: Vec<_> = (during.iter())
        .filter(|(_, status, _)| *status != StatusCode::SERVICE_UNAVAILABLE)
        .collect();
    let slowest = during.iter().map(|(_, _, took)| *took).max().unwrap_or_default();
    println!(
        "slow promotion: fenced from {fenced:?}, replica resumed at {resumed:?}, claims taken again from \
         {recovered:?}; {} claims refused while it stood, slowest answer {slowest:?}, taken: {taken:?}",
        during.len()
    );
    assert!(
        during.len() > 100,
        "{} requests while the fence stood",
        during.len()
    );
    assert!(
        taken.is_empty(),
        "claims taken before the new master was confirmed"
    );
    assert!(slowest < Duration::from_secs(1), "a refusal waited {slowest:?}");
    assert_eq!(
        new_master, replica.0,
        "the sentinels promoted the stopped replica"
    );
    let after: Vec<_> = (answers.iter())
        .filter(|(sent, status, _)| {
            *sent > recovered + Duration::from_millis(500) && *status != StatusCode::CREATED
        })
        .collect();
    assert!(after.is_empty(), "claims refused after the switch: {after:?}");
    assert!(
        ledger.runs().values().all(|runs| runs.len() == 1),
        "a key ran twice"
    );
    drop(topology);
}

/// A claim made through a store just built, then which sentinels hold its subscription to the
/// failover announcements. A sentinel takes no `PUBSUB`: its `CLIENT LIST` shows the store's
/// subscriber (two channels, one pattern).
async fn claim_then_subscriptions(
    store: &RedisStore,
    topology: &SentinelTopology,
) -> (
    Result<tower_idempotency::ClaimOutcome, tower_idempotency::StoreError>,
    Vec<bool>,
) {
    use tower_idempotency::{Fingerprint, IdempotencyKey, OwnerToken, RecordKey, Store};

    let key = RecordKey::new(None, IdempotencyKey::parse("first-claim").unwrap());
    let claimed = store
        .claim(
            &key,
            &Fingerprint::new([b"body".as_slice()]),
            &OwnerToken::generate(),
            Duration::from_secs(30),
        )
        .await;
    let subscribed = (topology.sentinel_ports().into_iter())
        .map(|port| {
            (topology.sentinel_cli(port, &["CLIENT", "LIST"]).lines())
                .any(|client| client.contains("sub=2 psub=1"))
        })
        .collect();
    (claimed, subscribed)
}

/// Issue 36, found by the history checker (tests/history.rs, Sentinel topology, seeds 4 and 7): a
/// store started less than about a second before a failover took claims before its
/// subscriptions to the sentinels were made, missed the failover's announcement, and claimed on
/// the old master, where the replica not promoted still acknowledged them: keys ran twice. A
/// store now takes no claim before it listens: with every sentinel 300 ms away each way (so its
/// subscriptions take seconds), a claim made as soon as the store is built returns only once
/// every sentinel holds the store's subscription to the failover announcements. Before, it
/// returned at once with none made.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_takes_no_claim_before_it_listens_for_failovers() {
    let topology = tokio::task::spawn_blocking(SentinelTopology::start)
        .await
        .unwrap();
    let (url, proxies) = through_sentinel_proxies(&topology).await;
    // Every byte to and from a sentinel is late (the store's lookup of the master too; its
    // commands then go to the master directly).
    proxies
        .iter()
        .for_each(|proxy| proxy.set_delay(Duration::from_millis(300)));
    let store = RedisStore::connect(&url).await.expect("connect");
    let started = Instant::now();
    let (claimed, subscribed) = claim_then_subscriptions(&store, &topology).await;
    let took = started.elapsed();
    println!("a claim at the store's start: {claimed:?} after {took:?}; each sentinel has the store's subscription: {subscribed:?}");
    assert!(claimed.is_ok(), "{claimed:?}");
    assert!(
        subscribed.iter().all(|&subscribed| subscribed),
        "the claim was taken before the store listened on every sentinel: {subscribed:?}"
    );
}

/// Looking for why a graceful-failover storm through one sentinel's address ran a key twice on a
/// loaded machine (load average 12; not reproduced since, so not proven to be this): a store
/// whose first question to its sentinel, which others it knows (`SENTINEL SENTINELS`), went
/// unanswered took claims hearing that one sentinel only, until the watch's looks asked again
/// seconds later. Only a failover's leader announces the promotion, so one led
/// by another sentinel in those seconds went unheard until the switch, and claims went to the
/// old master meanwhile. Here the first answer to that question is lost (its connection cut): a
/// claim made as soon as the store is built returns only once every sentinel holds the store's
/// subscription. Before, it returned with only the URL's sentinel subscribed to.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_takes_no_claim_before_it_listens_to_the_sentinels_its_sentinel_knows() {
    let topology = tokio::task::spawn_blocking(SentinelTopology::start)
        .await
        .unwrap();
    let port = topology.sentinel_ports()[1];
    let proxy = FaultProxy::start(([127, 0, 0, 1], port).into()).await;
    // The first `SENTINEL SENTINELS` through the proxy is fred's own, as it connects the store.
    // The watch's asker then sends it three times (fred sends a command again on a new connection
    // after a cut, up to three attempts): all three are cut, and the question fails.
    proxy.cut_instead_of_answering_after(b"SENTINELS", 1, 3);
    let url = topology.url_of(1).replace(
        &format!("127.0.0.1:{port}"),
        &format!("127.0.0.1:{}", proxy.addr().port()),
    );
    let store = RedisStore::connect(&url).await.expect("connect");
    let (claimed, subscribed) = claim_then_subscriptions(&store, &topology).await;
    println!(
        "a claim at the store's start, the watch's first SENTINEL SENTINELS cut ({} cuts): {claimed:?}; each sentinel has the store's subscription: {subscribed:?}",
        proxy.cuts()
    );
    assert_eq!(
        proxy.cuts(),
        3,
        "the watch's first SENTINEL SENTINELS was not cut"
    );
    assert!(claimed.is_ok(), "{claimed:?}");
    assert!(
        subscribed.iter().all(|&subscribed| subscribed),
        "the claim was taken before the store listened on every sentinel: {subscribed:?}"
    );
}

/// A layer node over a store of `url` with no heartbeat: it would replace subscriptions a
/// test holds after 3 s, and what they hold would be lost with them (the late delivery is the
/// fault under test).
async fn node_without_heartbeat(url: &str, ledger: Ledger) -> Router {
    let store = RedisStore::connect(url)
        .await
        .expect("connect")
        .with_heartbeat(None);
    app(IdempotencyLayer::new(store), ledger, "a", |_| Duration::ZERO)
}

/// Issue 36, found by the 30-minute Sentinel run of tests/history.rs: announcements acted on
/// late. Two sentinels' links to the store are held (their announcements arrive, late, once
/// released) while the third runs two failovers in a row; the store follows both through it.
/// Then the held announcements of the first switch arrive: its new master is a replica of the
/// second's by then. The store takes them for what they are, news overtaken, and neither raises
/// its fence (no claim refused) nor moves a connection. Before, it raised the fence and
/// reconnected every client twenty times over to follow each of them, refusing claims and
/// holding its owners' writes meanwhile (in the history run, up to 28 s: leases lapsed under
/// live owners and keys ran twice).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_announcement_of_an_overtaken_switch_neither_fences_nor_moves_the_store() {
    let topology = tokio::task::spawn_blocking(|| SentinelTopology::start_with_replicas(2))
        .await
        .unwrap();
    let (url, proxies) = through_sentinel_proxies(&topology).await;
    let first = topology.master_port();
    let ledger = Ledger::default();
    let node = node_without_heartbeat(&url, ledger.clone()).await;
    let stream = Stream::start(node, "late");
    stream
        .until_answered(StatusCode::CREATED, Duration::from_secs(10))
        .await;
    // `topology.failover()` asks the first sentinel, whose link stays open: it leads both
    // failovers and announces both; the two others' announcements are held.
    for proxy in &proxies[1..] {
        proxy.black_hole_open_connections();
        proxy.keep_received();
    }
    let (topology, second, third) = tokio::task::spawn_blocking(move || {
        topology.failover();
        let second = topology.wait_for_new_master(first, Duration::from_secs(30));
        // Settled: the first master is a replica again, so a second failover is allowed.
        topology.wait_until_settled(Duration::from_secs(30));
        let mut third = None;
        let deadline = Instant::now() + Duration::from_secs(30);
        while third.is_none() && Instant::now() < deadline {
            if topology.try_failover().is_ok() {
                third = topology.try_wait_for_new_master(second, Duration::from_secs(30));
            } else {
                std::thread::sleep(Duration::from_millis(200));
            }
        }
        let third = third.expect("a second failover");
        // Settled again: the second master is a replica of the third now.
        topology.wait_until_settled(Duration::from_secs(30));
        (topology, second, third)
    })
    .await
    .unwrap();
    stream
        .until_answered(StatusCode::CREATED, Duration::from_secs(10))
        .await;
    let role = data_cli(second, &["ROLE"]);
    assert!(
        role.starts_with("slave"),
        "the first switch's master is a replica: {role}"
    );
    let connections = store_connections(third);
    assert!(!connections.is_empty(), "the store is on the third master");

    let released = stream.elapsed();
    for proxy in &proxies[1..] {
        proxy.release_black_holed();
    }
    // The message's text (RESP puts the channel, `+switch-master`, in a bulk string before it).
    let overtaken = format!("mymaster 127.0.0.1 {first} 127.0.0.1 {second}");
    let delivered =
        || (proxies[1..].iter()).any(|proxy| String::from_utf8_lossy(&proxy.received()).contains(&overtaken));
    common::until("a held announcement of the first switch is delivered", delivered).await;
    let delivered_at = stream.elapsed();
    // Time to act on it: before, the fence rose within milliseconds and stood for seconds.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let connections_after = store_connections(third);
    let answers = stream.stop().await;

    let refused: Vec<_> = (answers.iter())
        .filter(|(sent, status, _)| *sent >= released && *status != StatusCode::CREATED)
        .collect();
    println!(
        "late announcement: masters {first} -> {second} -> {third}; held announcements released \
         at {released:?}, the first switch's delivered by {delivered_at:?}; refused after: {refused:?}"
    );
    assert!(
        refused.is_empty(),
        "claims refused after an overtaken switch was announced late"
    );
    assert_eq!(
        connections_after, connections,
        "the store moved its connections for an overtaken switch"
    );
    assert!(
        ledger.runs().values().all(|runs| runs.len() == 1),
        "a key ran twice"
    );
    drop(topology);
}

/// Keeps every event at `INFO` or above, its level, message and fields, for a test that makes
/// it the default subscriber of its own one-threaded runtime (the store's watch runs there too).
#[derive(Clone)]
struct Logs {
    started: Instant,
    lines: Arc<Mutex<Vec<(tracing::Level, String)>>>,
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Logs {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        struct Fields(String);
        impl tracing::field::Visit for Fields {
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                self.0 += &format!(" {}={value:?}", field.name());
            }
        }
        let level = *event.metadata().level();
        let the_stores = event
            .metadata()
            .target()
            .starts_with("tower_idempotency::store::redis");
        if level <= tracing::Level::INFO && the_stores {
            let mut fields = Fields(format!("{:?} {level}", self.started.elapsed()));
            event.record(&mut fields);
            self.lines.lock().unwrap().push((level, fields.0));
        }
    }
}

impl Logs {
    fn new() -> Self {
        Self {
            started: Instant::now(),
            lines: Arc::default(),
        }
    }

    /// How many warnings contain `text`.
    fn warnings(&self, text: &str) -> usize {
        (self.lines.lock().unwrap().iter())
            .filter(|(level, line)| *level == tracing::Level::WARN && line.contains(text))
            .count()
    }

    fn all(&self) -> String {
        (self.lines.lock().unwrap().iter())
            .map(|(_, line)| line.as_str())
            .collect::<Vec<_>>()
            .join("\n")
    }
}

/// When the store hears what its sentinels' held links carried in
/// [`switch_back_after_an_overtaken_one`].
#[derive(Clone, Copy, PartialEq, Eq)]
enum Release {
    /// As soon as A is killed: B to A is heard before the sentinels fail A over back to B.
    BeforeTheSwitchBack,
    /// Once the sentinels name B again: B to A and A to B are heard together.
    AfterTheSwitchBack,
}

/// What [`switch_back_after_an_overtaken_one`] saw.
struct SwitchBack {
    /// When a claim sent after the sentinels named B again was first taken, if within 15 s.
    taken: Option<Duration>,
    on_b: bool,
    /// How many follows failed (B to A, announced by three sentinels).
    tried: usize,
}

/// How a store's URL names the sentinels, each behind a proxy of its own.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Named {
    /// The URL names every sentinel's proxy.
    Every,
    /// The URL names the first sentinel's proxy only, as through a Kubernetes Service, and each
    /// sentinel announces its proxy's address (`announce-port`), where the store discovers the
    /// others (their links to one another go through the proxies too).
    One,
}

/// Has each sentinel of `topology` announce its proxy's port (`proxies`, in the sentinels'
/// order), and waits (blocking) until each lists the others at their proxies' (hellos go out
/// every 2 s).
fn announce_proxies(topology: &SentinelTopology, proxies: &[u16]) {
    let ports: Vec<(u16, u16)> = (topology.sentinel_ports().into_iter())
        .zip(proxies.iter().copied())
        .collect();
    for (sentinel, proxy) in &ports {
        let answer = topology.sentinel_cli(
            *sentinel,
            &["SENTINEL", "CONFIG", "SET", "announce-port", &proxy.to_string()],
        );
        assert_eq!(answer.trim(), "OK", "announce-port on sentinel {sentinel}");
    }
    let lists_the_others_at_their_proxies = |(sentinel, own): &(u16, u16)| {
        let others = topology.sentinel_cli(*sentinel, &["SENTINEL", "SENTINELS", SERVICE]);
        let lines: Vec<&str> = others.lines().collect();
        let listed =
            |proxy: &u16| (lines.windows(2)).any(|pair| pair[0] == "port" && pair[1] == proxy.to_string());
        (ports.iter())
            .filter(|(_, proxy)| proxy != own)
            .all(|(_, proxy)| listed(proxy))
            && lines.iter().filter(|line| **line == "port").count() == ports.len() - 1
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while !ports.iter().all(lists_the_others_at_their_proxies) {
        assert!(
            Instant::now() < deadline,
            "the sentinels did not list one another at their proxies' ports within 30 s"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A store of a topology started with `timing` (its sentinels behind proxies, named as `named`
/// says, no heartbeat), with a [`Stream`] named `name`, follows A to B; then, its links to the
/// sentinels held (`black_hole_open_connections`, or with [`Named::One`] its subscriptions
/// only, the sentinels' links to one another passing; what they deliver kept), the first
/// sentinel leads B to A (`topology.failover()` asks it), and A is killed once every sentinel
/// names it. The topology, the proxies, the stream, A and B.
async fn b_to_a_unheard_and_a_killed(
    timing: Timing,
    name: &'static str,
    named: Named,
) -> (SentinelTopology, Vec<FaultProxy>, Stream, u16, u16) {
    let topology = tokio::task::spawn_blocking(move || SentinelTopology::start_timed(1, timing))
        .await
        .unwrap();
    let (mut url, proxies) = through_sentinel_proxies(&topology).await;
    let topology = if named == Named::One {
        let ports: Vec<u16> = proxies.iter().map(|proxy| proxy.addr().port()).collect();
        tokio::task::spawn_blocking(move || {
            announce_proxies(&topology, &ports);
            topology
        })
        .await
        .unwrap()
    } else {
        topology
    };
    if named == Named::One {
        url = topology.url_of(0).replace(
            &format!("127.0.0.1:{}", topology.sentinel_ports()[0]),
            &format!("127.0.0.1:{}", proxies[0].addr().port()),
        );
    }
    let a = topology.master_port();
    let node = node_without_heartbeat(&url, Ledger::default()).await;
    let stream = Stream::start(node, name);
    stream
        .until_answered(StatusCode::CREATED, Duration::from_secs(10))
        .await;

    // A to B, followed.
    let (topology, b) = tokio::task::spawn_blocking(move || {
        topology.failover();
        let b = topology.wait_for_new_master(a, Duration::from_secs(30));
        // Settled: A is a replica of B, so B can be failed over back to it.
        topology.wait_until_settled(Duration::from_secs(30));
        (topology, b)
    })
    .await
    .unwrap();
    common::until("the store is on B", || !store_connections(b).is_empty()).await;
    stream
        .until_answered(StatusCode::CREATED, Duration::from_secs(10))
        .await;

    // B to A, unheard; A killed once every sentinel names it.
    for proxy in &proxies {
        match named {
            Named::Every => proxy.black_hole_open_connections(),
            Named::One => proxy.black_hole_open_subscriptions(),
        }
        proxy.keep_received();
    }
    let topology = tokio::task::spawn_blocking(move || {
        let mut topology = topology;
        topology.failover();
        until_every_sentinel_names(&topology, a, Duration::from_secs(30));
        topology.node_mut(a).kill();
        topology
    })
    .await
    .unwrap();
    (topology, proxies, stream, a, b)
}

/// The store follows A to B; B to A is run with the store's links to the sentinels held, A is
/// killed once every sentinel names it, and the sentinels fail it over back to B; the links are
/// released as `release` says. One thread runs the test, the store and its watch, so that the
/// watch's logs are this test's alone.
async fn switch_back_after_an_overtaken_one(release: Release) -> SwitchBack {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;

    let logs = Logs::new();
    let _logging = tracing_subscriber::registry().with(logs.clone()).set_default();
    let timing = Timing {
        down_after: Duration::from_secs(1),
        failover_timeout: Duration::from_secs(10),
    };
    let (topology, proxies, stream, a, b) = b_to_a_unheard_and_a_killed(timing, "back", Named::Every).await;
    let topology = tokio::task::spawn_blocking(move || {
        if release == Release::AfterTheSwitchBack {
            topology.wait_for_new_master(a, Duration::from_secs(30));
        }
        topology
    })
    .await
    .unwrap();
    let released = stream.elapsed();
    for proxy in &proxies {
        proxy.release_black_holed();
    }
    let overtaken = format!("mymaster 127.0.0.1 {b} 127.0.0.1 {a}");
    common::until("every sentinel's announcement of B to A is delivered", || {
        (proxies.iter()).all(|proxy| String::from_utf8_lossy(&proxy.received()).contains(&overtaken))
    })
    .await;
    // Fenced on hearing B to A, which it cannot follow.
    let fenced = stream
        .until_answered(StatusCode::SERVICE_UNAVAILABLE, Duration::from_secs(10))
        .await;
    let (topology, switched_back) = tokio::task::spawn_blocking(move || {
        let back = topology.try_wait_for_new_master(a, Duration::from_secs(30));
        (topology, back)
    })
    .await
    .unwrap();
    assert_eq!(
        switched_back,
        Some(b),
        "the sentinels did not fail A over back to B"
    );
    let named_b = stream.elapsed();
    // Past the twenty reconnections tried for B to A (6.5 s on a loaded machine).
    let taken = stream
        .answered_within(StatusCode::CREATED, Duration::from_secs(15))
        .await;
    let on_b = store_connections(b);
    // Counted once the answers in flight are in (3 s): a late retry counts too.
    let _ = stream.stop().await;
    let tried = logs.warnings("is not confirmed on the announced master");
    println!(
        "switch back: A {a}, B {b}; held announcements released at {released:?}, fenced from {fenced:?}, \
         the sentinels named B again at {named_b:?}, claims taken again from {taken:?}; follows that \
         failed: {tried}; the store's logs:\n{}",
        logs.all()
    );
    drop(topology);
    SwitchBack {
        taken,
        on_b: !on_b.is_empty(),
        tried,
    }
}

/// Issue 36, seen in the 30-minute Sentinel run of tests/history.rs: a double failover back to
/// the master the store followed before. The store follows A to B. Then, its sentinels' links
/// held, B to A is run and A killed; the links are released, and the store hears B to A and
/// cannot follow it (A is gone) while the sentinels fail A over back to B, announcing A to B,
/// of the same text as the switch the store followed first. The store must follow it and take
/// claims again within 15 s of the sentinels naming B; a store that took it for the switch
/// followed before (no `followed.clear()` after a follow that failed) kept its fence until the
/// failover counted as given up, 2 × `failover-timeout` + 5 s = 25 s after it was raised. The
/// bound is a liveness property with a margin, not a benchmark: once A to B is heard it is
/// followed in milliseconds, after the twenty reconnections tried for B to A (2.5 to 6.5 s
/// here, on a loaded machine). Also: B to A, announced by each of the three sentinels, is
/// tried once (`attempted`); before, each announcement ran twenty reconnections of its own,
/// holding the watch (up to 28 s in the history run) while the fence stood. 23 to 25 s.
#[tokio::test(flavor = "current_thread")]
async fn a_switch_back_after_an_overtaken_one_is_followed_and_the_overtaken_one_tried_once() {
    let seen = switch_back_after_an_overtaken_one(Release::BeforeTheSwitchBack).await;
    assert!(
        seen.taken.is_some(),
        "no claim taken within 15 s of the sentinels naming B again: the fence stood"
    );
    assert!(seen.on_b, "the store is not on B");
    assert_eq!(
        seen.tried, 1,
        "B to A, announced by three sentinels, was tried {} times",
        seen.tried
    );
}

/// Issue 36, found while writing the test above: the same failovers, but the store hears B to A
/// and A to B together, once the sentinels name B again. Each listener hands its sentinel's B to
/// A and A to B to the watch back to back, so an announcement of B to A is handled after the
/// store followed A to B. Before, the watch forgot the switch it had tried (`attempted`) when its
/// fence came down, and A is dead, so its `ROLE` proves nothing: B to A was tried three times,
/// the fence raised again twice, for 2.2 and 2.5 s, over a store on the right master, every
/// client reconnected twenty times each. Now a switch tried is tried once. The leader's late
/// promotion of B to A, whose old master B is the master again, raised a fence the looks could
/// not lower until 2 × `failover-timeout` + 5 s; this test does not wait for it (fixed since, and
/// tested alone: `a_fence_raised_by_a_late_promotion_of_a_failover_since_undone_comes_down_at_the_next_look`).
#[tokio::test(flavor = "current_thread")]
async fn stale_announcements_heard_with_the_switch_back_are_not_acted_on_again() {
    let seen = switch_back_after_an_overtaken_one(Release::AfterTheSwitchBack).await;
    assert!(seen.on_b, "the store is not on B");
    assert_eq!(
        seen.tried, 1,
        "B to A, announced by three sentinels, was tried {} times",
        seen.tried
    );
}

/// How many of the store's log lines contain `text`.
fn lines_with(logs: &Logs, text: &str) -> usize {
    logs.all().matches(text).count()
}

/// Waits until every sentinel of `topology` names the data node on `master` (blocking), for at
/// most `timeout`.
fn until_every_sentinel_names(topology: &SentinelTopology, master: u16, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    let every_sentinel_names = || {
        (topology.sentinel_ports().into_iter()).all(|sentinel| {
            let answer = topology.sentinel_cli(sentinel, &["SENTINEL", "get-master-addr-by-name", SERVICE]);
            answer.lines().nth(1) == Some(master.to_string().as_str())
        })
    };
    while !every_sentinel_names() {
        assert!(
            Instant::now() < deadline,
            "the sentinels never all named {master} within {timeout:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Asks the sentinel on `port` to fail the master `from` over (`SENTINEL FAILOVER`), again
/// while it refuses (no replica it judges good yet, a failover under way), until it accepts or
/// the sentinels name another master by themselves (`from` is down, and a sentinel that led no
/// failover of it lately may start one), for at most `timeout`.
fn fail_over_away_from(topology: &SentinelTopology, from: u16, port: u16, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    loop {
        if topology.master_port() != from {
            return;
        }
        let answer = topology.sentinel_cli(port, &["SENTINEL", "FAILOVER", SERVICE]);
        if answer.trim() == "OK" {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the sentinel on {port} refused SENTINEL FAILOVER for {timeout:?}: {answer}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Issue 36: a promotion announced late, of a failover since undone by one back to the master
/// the store is on. The store follows A to B. Then, its links to the sentinels held, the first
/// sentinel leads B to A, A is killed once every sentinel names it, and the second (asked, or
/// the second or third on their own) fails it over back to B at once. The two others' links are
/// released: the store tries B to A (A is dead, so its `ROLE` cannot show the switch
/// overtaken), gives it up as tried, and takes claims on B again. Then the first sentinel's
/// link is released: the store hears its promotion of B to A, late, and raises its fence, whose
/// old master B is the master again. That sentinel's switches, B to A and A to B, come behind:
/// the first was tried, and the second, if the store followed it from the others, is not acted
/// on again, so nothing but a look can lower the fence. It must come down within 10 s: every
/// sentinel answers, after it rose, that it fails nothing over, and the store is on the master
/// they name. (If a look lowered the fence of B to A before the store handled the others' A to
/// B, those were superseded, and the first sentinel's A to B is followed and lowers it at once:
/// a run takes either path, as the watch's tick and its queue race; without the look's rule
/// only the first is possible.) Before, the looks lowered a fence only for a master other than
/// the one fenced, or once the failover counted as given up, 2 × `failover-timeout` + 5 s
/// after the raise: 65 s with this topology's 30 s (six minutes with Redis' default 180 s),
/// every claim refused meanwhile. The 10 s bound is a liveness property with a wide margin, not
/// a benchmark: a look comes once a second and lowers it in milliseconds. 20 to 25 s.
#[tokio::test(flavor = "current_thread")]
async fn a_fence_raised_by_a_late_promotion_of_a_failover_since_undone_comes_down_at_the_next_look() {
    late_promotion_of_a_failover_since_undone(Named::Every).await;
}

/// Issue 36: the same, the URL naming one sentinel's address (as through a Kubernetes Service in
/// front of the sentinels), the two others discovered at the addresses they announce. The fence
/// must come down within 10 s: every sentinel, the URL's and the two discovered, answers after it
/// rose that it fails nothing over. Before, the look trusted quiet answers only where the URL
/// named every sentinel, and here the fence stood 2 × `failover-timeout` + 5 s (65 s), holding
/// owners' renewals past a 30 s lease while Redis was healthy. The same liveness bound, not a
/// benchmark. 25 to 30 s (the sentinels' new addresses take a hello, 2 s, to spread).
#[tokio::test(flavor = "current_thread")]
async fn behind_one_sentinel_address_a_late_promotions_fence_comes_down_at_the_next_look() {
    late_promotion_of_a_failover_since_undone(Named::One).await;
}

/// The scenario of the two tests above, the sentinels named as `named` says; asserts that the
/// late promotion's fence comes down within 10 s, the store on B.
async fn late_promotion_of_a_failover_since_undone(named: Named) {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;

    let logs = Logs::new();
    let _logging = tracing_subscriber::registry().with(logs.clone()).set_default();
    // A failover of the master again (A to B) is asked of a sentinel (`SENTINEL FAILOVER`), so
    // the long `failover-timeout` does not make the test wait: it only sets how long the fence
    // stood before.
    let timing = Timing {
        down_after: Duration::from_secs(1),
        failover_timeout: Duration::from_secs(30),
    };
    let (topology, proxies, stream, a, b) = b_to_a_unheard_and_a_killed(timing, "undone", named).await;
    // A to B, led by the second sentinel (or, if it started one first, by the second or the
    // third on their own: the first led B to A and may not lead another of the same master for
    // 2 × `failover-timeout`), unheard too.
    let topology = tokio::task::spawn_blocking(move || {
        fail_over_away_from(
            &topology,
            a,
            topology.sentinel_ports()[1],
            Duration::from_secs(30),
        );
        until_every_sentinel_names(&topology, b, Duration::from_secs(30));
        topology
    })
    .await
    .unwrap();

    // The second and third sentinels' announcements: B to A tried and given up, A to B followed.
    let tried_before = logs.warnings("is not confirmed on the announced master");
    for proxy in &proxies[1..] {
        proxy.release_black_holed();
    }
    let tried = "is not confirmed on the announced master";
    let deadline = Instant::now() + Duration::from_secs(30);
    while logs.warnings(tried) == tried_before {
        assert!(
            Instant::now() < deadline,
            "the store never tried B to A; its logs:\n{}",
            logs.all()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stream
        .until_answered(StatusCode::CREATED, Duration::from_secs(10))
        .await;
    assert!(!store_connections(b).is_empty(), "the store is not on B");

    // The first sentinel's: its promotion of B to A, late.
    let promoting = "the sentinels are promoting a replica";
    let promotions_before = lines_with(&logs, promoting);
    let released = stream.elapsed();
    proxies[0].release_black_holed();
    let deadline = Instant::now() + Duration::from_secs(10);
    while lines_with(&logs, promoting) == promotions_before {
        assert!(
            Instant::now() < deadline,
            "the late promotion of B to A was not acted on; the store's logs:\n{}",
            logs.all()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let fenced = stream.elapsed();
    let taken = stream
        .answered_within(StatusCode::CREATED, Duration::from_secs(10))
        .await;
    let on_b = store_connections(b);
    let answers = stream.stop().await;
    let refused = (answers.iter())
        .filter(|(sent, status, _)| *sent >= fenced && *status == StatusCode::SERVICE_UNAVAILABLE)
        .count();
    println!(
        "late promotion of a failover since undone: A {a}, B {b}; the first sentinel's link released \
         at {released:?}, its promotion acted on by {fenced:?}, claims taken again from {taken:?} \
         ({refused} refused after); the store's logs:\n{}",
        logs.all()
    );
    drop(topology);
    assert!(
        taken.is_some(),
        "no claim taken within 10 s of the late promotion: the fence stood (until 2 × failover-timeout + 5 s)"
    );
    assert!(!on_b.is_empty(), "the store is not on B");
}
