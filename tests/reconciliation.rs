//! The reconciliation hook, told of every operation that ran but whose result the store does not
//! hold, on real failures: a response too large to store, a handler past its timeout, a store
//! black-holed while the result is stored, a claim whose lease ran out or that was purged while
//! its handler ran, and replicas that never acknowledged a completion (`ReplicaAcks`).

mod common;

use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::app::{payment, payment_with, router, send, spawn_send};
use common::proxy::{Fault, FaultProxy};
use common::{admin, client, RedisServer};
use http::StatusCode;
use tower_idempotency::{
    Begin, Coordinator, Fingerprint, IdempotencyKey, IdempotencyLayer, MemoryStore, NotStored,
    ReconciliationEvent, ReconciliationKind, RecordKey, RedisStore, ReplicaAcks,
};

/// Every event the hook was given.
#[derive(Clone, Default)]
struct Journal(Arc<Mutex<Vec<ReconciliationEvent>>>);

impl Journal {
    fn hook(&self) -> impl Fn(&ReconciliationEvent) + Send + Sync + 'static {
        let events = self.0.clone();
        move |event| events.lock().unwrap().push(event.clone())
    }

    fn events(&self) -> Vec<ReconciliationEvent> {
        self.0.lock().unwrap().clone()
    }

    /// Waits up to `within` until there are `n` events.
    async fn wait_for(&self, n: usize, within: Duration) -> Vec<ReconciliationEvent> {
        let deadline = Instant::now() + within;
        loop {
            let events = self.events();
            if events.len() >= n || Instant::now() > deadline {
                return events;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

fn record_key(key: &str) -> RecordKey {
    RecordKey::new(None, IdempotencyKey::parse(key).unwrap())
}

#[tokio::test]
async fn nothing_is_reported_when_every_result_is_stored() {
    let journal = Journal::default();
    let layer = IdempotencyLayer::new(MemoryStore::new()).with_reconciliation(journal.hook());
    let (app, _) = router(layer);
    assert_eq!(
        send(&app, payment("fine", "{}")).await.status,
        StatusCode::CREATED
    );
    assert!(send(&app, payment("fine", "{}")).await.is_replay());
    let not_cacheable = payment_with("fine-500", &[("x-status", "500")]);
    assert_eq!(send(&app, not_cacheable).await.status, 500);
    assert!(journal.events().is_empty(), "{:?}", journal.events());
}

#[tokio::test]
async fn a_response_too_large_to_store_is_reported_without_a_payload() {
    let journal = Journal::default();
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .with_response_limit(64)
        .with_reconciliation(journal.hook());
    let (app, _) = router(layer);
    let answer = send(&app, payment_with("large", &[("x-body-size", "1000")])).await;
    assert_eq!(answer.status, StatusCode::CREATED);
    assert_eq!(
        answer.body.len(),
        1000,
        "the client still gets the whole response"
    );
    let events = journal.events();
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0].key, record_key("large"));
    assert_eq!(
        events[0].kind,
        ReconciliationKind::NotStorable {
            why: NotStored::TooLarge
        }
    );
    assert_eq!(events[0].payload, None);
    assert!(!events[0].owner.as_str().is_empty());
}

#[tokio::test]
async fn a_handler_past_its_timeout_is_reported() {
    let journal = Journal::default();
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .with_handler_timeout(Duration::from_millis(100))
        .with_reconciliation(journal.hook());
    let (app, _) = router(layer);
    let answer = send(&app, payment_with("hung", &[("x-delay-ms", "2000")])).await;
    assert_eq!(answer.status, StatusCode::GATEWAY_TIMEOUT);
    let events = journal.events();
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(
        events[0].kind,
        ReconciliationKind::NotStorable {
            why: NotStored::TimedOut
        }
    );
}

/// Redis black-holed after the handler started, for longer than the lease: every attempt to
/// store the result times out. The client gets its response at once; the hook gets it too, to
/// journal, once the lease has ended with the result not stored (not before: it might land).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_the_store_does_not_take_is_reported_with_the_response() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.addr()).await;
    let timeout = Duration::from_millis(200);
    let store = RedisStore::new(client(&proxy.url()).await).with_command_timeout(timeout);
    let journal = Journal::default();
    let layer = IdempotencyLayer::new(store)
        .with_store_timeout(timeout)
        .with_lease(Duration::from_secs(1))
        .with_reconciliation(journal.hook());
    let (app, runs) = router(layer);
    let running = spawn_send(&app, payment_with("unstored", &[("x-delay-ms", "300")]));
    tokio::time::sleep(Duration::from_millis(100)).await;
    proxy.set(Fault::BlackHole);
    let answer = running.await.unwrap();
    assert_eq!(answer.status, StatusCode::CREATED);
    assert_eq!(runs.get(), 1);
    assert!(journal.events().is_empty(), "nothing reported while it may land");
    let events = journal.wait_for(1, Duration::from_secs(5)).await;
    proxy.set(Fault::None);
    assert_eq!(events.len(), 1, "{events:?}");
    let event = &events[0];
    assert_eq!(event.key, record_key("unstored"));
    assert!(
        matches!(&event.kind, ReconciliationKind::CompletionFailed { error } if error.contains("did not answer")),
        "{:?}",
        event.kind
    );
    let payload = event
        .payload
        .as_ref()
        .expect("the response that was to be stored");
    let body = std::str::from_utf8(&answer.body).unwrap();
    assert!(
        payload.windows(body.len()).any(|window| window == answer.body),
        "the payload holds the response body {body:?}"
    );
}

/// The same, for a queue consumer on the coordinator: the payload is its own bytes. The
/// completion answers the first attempt's error at once, and goes on in the background.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_coordinator_completion_the_store_does_not_take_is_reported_with_its_payload() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.addr()).await;
    let timeout = Duration::from_millis(200);
    let store = RedisStore::new(client(&proxy.url()).await).with_command_timeout(timeout);
    let journal = Journal::default();
    let coordinator = Coordinator::new(store)
        .with_store_timeout(timeout)
        .with_lease(Duration::from_secs(1))
        .with_reconciliation(journal.hook());
    let key = record_key("job-1");
    let Begin::Claimed(claim) = coordinator
        .begin(&key, &Fingerprint::new([b"job".as_slice()]))
        .await
        .unwrap()
    else {
        panic!("a fresh key is claimed");
    };
    let owner = claim.owner().clone();
    proxy.set(Fault::BlackHole);
    assert!(claim.complete(Bytes::from_static(b"job done")).await.is_err());
    let events = journal.wait_for(1, Duration::from_secs(5)).await;
    proxy.set(Fault::None);
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0].owner, owner);
    assert_eq!(events[0].payload.as_deref(), Some(&b"job done"[..]));
    assert!(matches!(
        events[0].kind,
        ReconciliationKind::CompletionFailed { .. }
    ));
}

/// Redis unreachable for longer than the lease while the handler runs: the lease runs out, so
/// the result is not stored, and a retry runs the handler again. The hook hears of the first run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_whose_lease_ran_out_while_the_handler_ran_is_reported() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.addr()).await;
    let timeout = Duration::from_millis(100);
    let store = RedisStore::new(client(&proxy.url()).await).with_command_timeout(timeout);
    let journal = Journal::default();
    let layer = IdempotencyLayer::new(store)
        .with_store_timeout(timeout)
        .with_lease(Duration::from_millis(300))
        .with_reconciliation(journal.hook());
    let (app, runs) = router(layer);
    let running = spawn_send(&app, payment_with("expired", &[("x-delay-ms", "1500")]));
    tokio::time::sleep(Duration::from_millis(100)).await;
    proxy.set(Fault::BlackHole);
    tokio::time::sleep(Duration::from_millis(800)).await;
    proxy.set(Fault::None);
    assert_eq!(running.await.unwrap().status, StatusCode::CREATED);
    let events = journal.events();
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0].kind, ReconciliationKind::ClaimLost);
    assert_eq!(events[0].key, record_key("expired"));
    assert!(events[0].payload.is_some(), "the response that was not stored");
    // What the event warns of: nothing was stored, so the retry runs the handler again.
    let retry = send(&app, payment("expired", "{}")).await;
    assert!(!retry.is_replay());
    assert_eq!(runs.get(), 2);
}

/// An operator purges a running key and another request takes it over: the first request's
/// result is not stored (the newer owner's record is never overwritten), and that is reported.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_purged_and_taken_over_while_the_handler_ran_is_reported() {
    let journal = Journal::default();
    // A lease far longer than the test: the claim is lost to the purge, never to its lease.
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .with_lease(Duration::from_secs(30))
        .with_reconciliation(journal.hook());
    let (app, runs) = router(layer.clone());
    let first = spawn_send(&app, payment_with("taken", &[("x-delay-ms", "1500")]));
    common::until("the first request runs", || runs.get() == 1).await;
    assert!(layer.purge(None, "taken").await.unwrap());
    let second = send(&app, payment("taken", "{}")).await;
    assert_eq!(second.status, StatusCode::CREATED, "the key was free again");
    assert_eq!(first.await.unwrap().status, StatusCode::CREATED);
    assert_eq!(runs.get(), 2);
    let events = journal.events();
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0].kind, ReconciliationKind::ClaimLost);
    // The second request's response is the one kept.
    let replay = send(&app, payment("taken", "{}")).await;
    assert_eq!(replay.body, second.body);
}

/// A master and a replica in sync with it, for the durability option.
async fn master_and_replica() -> (RedisServer, RedisServer) {
    let master = RedisServer::start();
    let port = master.port().to_string();
    let replica = RedisServer::start_with(&["--replicaof", "127.0.0.1", &port]);
    let admin_client = client(&master.url()).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        admin(&admin_client, &["SET", "probe", "1"]).await;
        if admin(&admin_client, &["WAIT", "1", "100"]).await.as_i64() == Some(1) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the replica never acknowledged a write"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    (master, replica)
}

/// Stops (`SIGSTOP`) or resumes (`SIGCONT`) a server.
fn signal(server: &RedisServer, signal: &str) {
    let pid = server.pid().expect("a running server").to_string();
    let status = Command::new("kill")
        .args([signal, &pid])
        .status()
        .expect("run kill");
    assert!(status.success(), "kill {signal} {pid} failed");
}

async fn durable_layer(master: &RedisServer, journal: &Journal) -> IdempotencyLayer {
    let acks = ReplicaAcks::new(1)
        .timeout(Duration::from_millis(100))
        .retry_completions_for(Duration::from_millis(800));
    let store = RedisStore::connect(&master.url())
        .await
        .expect("connect")
        .with_replica_acks(acks)
        .await
        .expect("the waiting connections");
    IdempotencyLayer::new(store).with_reconciliation(journal.hook())
}

/// The replica stops after the claim: the completion is stored on the master and the client
/// answered, but the replica never acknowledges it, and the background retry gives up. The
/// hook, set on the layer, reaches that background task.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_that_never_acknowledge_a_completion_are_reported() {
    let (master, replica) = master_and_replica().await;
    let journal = Journal::default();
    let (app, _) = router(durable_layer(&master, &journal).await);
    let running = spawn_send(&app, payment_with("unreplicated", &[("x-delay-ms", "400")]));
    tokio::time::sleep(Duration::from_millis(150)).await;
    signal(&replica, "-STOP");
    let answer = running.await.unwrap();
    assert_eq!(answer.status, StatusCode::CREATED, "answered from the master");
    assert!(journal.events().is_empty(), "not given up yet");
    let events = journal.wait_for(1, Duration::from_secs(5)).await;
    signal(&replica, "-CONT");
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0].key, record_key("unreplicated"));
    assert!(
        matches!(&events[0].kind, ReconciliationKind::ReplicationAbandoned { error } if error.contains("replicas")),
        "{:?}",
        events[0].kind
    );
    let payload = events[0].payload.as_ref().expect("the stored response");
    assert!(payload
        .windows(answer.body.len())
        .any(|window| window == answer.body));
}

/// While the completion is retried for the replicas, the record vanishes from the master (as
/// after a failover to a replica that lacked it): the retry finds the claim lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_lost_before_the_replicas_had_the_completion_is_reported() {
    let (master, replica) = master_and_replica().await;
    let journal = Journal::default();
    let layer = durable_layer(&master, &journal).await;
    let (app, _) = router(layer.clone());
    let running = spawn_send(&app, payment_with("vanished", &[("x-delay-ms", "400")]));
    tokio::time::sleep(Duration::from_millis(150)).await;
    signal(&replica, "-STOP");
    assert_eq!(running.await.unwrap().status, StatusCode::CREATED);
    assert!(
        layer.purge(None, "vanished").await.unwrap(),
        "the record was on the master"
    );
    let events = journal.wait_for(1, Duration::from_secs(5)).await;
    signal(&replica, "-CONT");
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0].kind, ReconciliationKind::LostBeforeReplicated);
    assert_eq!(events[0].key, record_key("vanished"));
}

/// A panicking hook is contained: the request is answered and the key settled.
#[tokio::test]
async fn a_panicking_hook_does_not_break_the_request() {
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .with_response_limit(8)
        .with_reconciliation(|_| panic!("the journal is down"));
    let (app, runs) = router(layer);
    let first = send(&app, payment_with("panicky", &[("x-body-size", "100")])).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let retry = send(&app, payment_with("panicky", &[("x-body-size", "100")])).await;
    assert_eq!(retry.status, StatusCode::CONFLICT, "kept as not replayable");
    assert_eq!(runs.get(), 1);
}
