//! Real faults on real Redis servers: a TCP proxy that black-holes, delays or drops, `CLIENT
//! PAUSE`, `DEBUG SLEEP`, a node partitioned from Redis while its handler runs.

mod common;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use common::app::{
    assert_failed_closed, dropping_the_completion_reply, payment, payment_with, reconciled, router, send,
    spawn_send, until_stored,
};
use common::proxy::{Fault, FaultProxy};
use common::{admin, client, client_with_attempts, round_trips, RedisServer};
use http::StatusCode;
use tower_idempotency::{IdempotencyLayer, RecordState, RedisStore, Rejection};

const TIMEOUT: Duration = Duration::from_millis(300);

async fn through_proxy(server: &RedisServer) -> (FaultProxy, RedisStore) {
    let proxy = FaultProxy::start(server.addr()).await;
    let store = common::redis_store(client(&proxy.url()).await).with_command_timeout(TIMEOUT);
    (proxy, store)
}

fn slow(key: &str, delay_ms: u64) -> http::Request<Body> {
    payment_with(key, &[("x-delay-ms", &delay_ms.to_string())])
}

async fn eventually_created(app: &axum::Router, key: &str) -> common::app::Answer {
    for _ in 0..100 {
        let answer = send(app, payment(key, "{}")).await;
        if answer.status == StatusCode::CREATED {
            return answer;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let last = send(app, payment(key, "{}")).await;
    panic!("the layer did not recover: {} {:?}", last.status, last.body);
}

// Promise 6: a black hole is bounded by the timeout, fails closed, and recovery is automatic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_black_holed_redis_answers_503_within_the_timeout() {
    let server = RedisServer::start();
    let (proxy, store) = through_proxy(&server).await;
    let (app, runs) = router(IdempotencyLayer::new(store).with_store_timeout(TIMEOUT));
    proxy.set(Fault::BlackHole);
    let started = Instant::now();
    let answer = send(&app, payment("bh", "{}")).await;
    assert!(
        started.elapsed() < TIMEOUT + Duration::from_millis(500),
        "took {:?}",
        started.elapsed()
    );
    assert_eq!(
        answer.extensions.get::<Rejection>(),
        Some(&Rejection::StoreUnavailable)
    );
    assert_eq!(runs.get(), 0);
    proxy.set(Fault::None);
    assert_eq!(eventually_created(&app, "bh").await.status, StatusCode::CREATED);
    assert_eq!(runs.get(), 1);
}

// Promise 6: dropped connections.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_connections_fail_closed_and_reconnect() {
    let server = RedisServer::start();
    let (proxy, store) = through_proxy(&server).await;
    let (app, runs) = router(IdempotencyLayer::new(store).with_store_timeout(TIMEOUT));
    proxy.set(Fault::Drop);
    let answer = send(&app, payment("dropped", "{}")).await;
    assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE);
    proxy.set(Fault::None);
    eventually_created(&app, "dropped").await;
    assert!(send(&app, payment("dropped", "{}")).await.is_replay());
    assert_eq!(runs.get(), 1);
}

// Promise 6: CLIENT PAUSE and DEBUG SLEEP stall the server itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_or_sleeping_server_fails_closed_then_recovers() {
    let server = RedisServer::start();
    let admin_client = client(&server.url()).await;
    let store = common::redis_store(client(&server.url()).await).with_command_timeout(TIMEOUT);
    let (app, runs) = router(IdempotencyLayer::new(store).with_store_timeout(TIMEOUT));

    admin(&admin_client, &["CLIENT", "PAUSE", "1000", "ALL"]).await;
    let answer = send(&app, payment("paused", "{}")).await;
    assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE);
    tokio::time::sleep(Duration::from_millis(1000)).await;
    eventually_created(&app, "paused").await;

    let sleeper = tokio::spawn(async move { admin(&admin_client, &["DEBUG", "SLEEP", "1"]).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let started = Instant::now();
    let answer = send(&app, payment("sleeping", "{}")).await;
    assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(
        started.elapsed() < Duration::from_millis(900),
        "bounded by the timeout, not the sleep"
    );
    sleeper.await.unwrap();
    eventually_created(&app, "sleeping").await;
    assert_eq!(runs.get(), 2, "nothing ran while the server stalled");
}

// Promise 6: a completion that fails is tried again (in the background, once the client has
// its answer). The handler has the proxy drop the reply to the completion (fred re-sends
// nothing: one attempt per command), so the first attempt fails with its record written; the
// second finds its own completed record and succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_completion_is_retried() {
    let server = RedisServer::start();
    let stats = client(&server.url()).await;
    let proxy = Arc::new(FaultProxy::start(server.addr()).await);
    let store =
        common::redis_store(client_with_attempts(&proxy.url(), 1).await).with_command_timeout(TIMEOUT);
    store.load_scripts().await.unwrap();
    let (layer, events) = reconciled(IdempotencyLayer::new(store).with_store_timeout(TIMEOUT));
    let (app, runs) = dropping_the_completion_reply(layer, &proxy);
    admin(&stats, &["CONFIG", "RESETSTAT"]).await;
    let first = send(&app, payment("retried", "{}")).await;
    assert_eq!((first.status, first.is_replay()), (StatusCode::CREATED, false));
    assert_eq!(proxy.dropped_replies(), 1, "the completion's reply was dropped");
    // The script: once, then again for the attempt after the lost reply, which finds this
    // owner's completed record and restarts its retention.
    let completions = 2;
    let deadline = Instant::now() + Duration::from_secs(5);
    while round_trips(&stats).await - 1 < completions && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Time for a round trip too many to show.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        round_trips(&stats).await - 1,
        completions,
        "the completion ran on Redis, then again for the attempt after the lost reply"
    );
    let retry = send(&app, payment("retried", "{}")).await;
    assert!(retry.is_replay(), "the retried completion stored the response");
    assert_eq!(retry.body, "ran once");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(
        *events.lock().unwrap(),
        Vec::<String>::new(),
        "nothing reported unstored"
    );
}

// Promise 6: a completion that keeps failing still answers the client, in bounded time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_that_keeps_failing_still_answers_the_client() {
    let server = RedisServer::start();
    let (proxy, store) = through_proxy(&server).await;
    let (app, runs) = router(IdempotencyLayer::new(store).with_store_timeout(TIMEOUT));
    let first = spawn_send(&app, slow("unstored", 200));
    common::until("the handler runs", || runs.get() == 1).await;
    proxy.set(Fault::BlackHole);
    let started = Instant::now();
    let answer = first.await.unwrap();
    assert_eq!(answer.status, StatusCode::CREATED, "the client gets its response");
    assert_eq!(answer.body, "run 1; echo {}");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "completion retries are bounded: {:?}",
        started.elapsed()
    );
    proxy.set(Fault::None);
}

// Promise 7: fred re-sends a claim whose answer was lost with the connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_resent_after_a_dropped_connection_does_not_conflict_with_itself() {
    let server = RedisServer::start();
    let stats = client(&server.url()).await;
    let proxy = FaultProxy::start(server.addr()).await;
    // No heartbeat: the reply dropped must be the claim's, not a ping's that happened to go
    // first (which made this test flaky: 2 round trips counted, the claim never re-sent).
    let store = common::redis_store(client(&proxy.url()).await)
        .with_command_timeout(Duration::from_secs(2))
        .with_heartbeat(None);
    store.load_scripts().await.unwrap();
    let (app, runs) = router(IdempotencyLayer::new(store));
    admin(&stats, &["CONFIG", "RESETSTAT"]).await;
    proxy.set(Fault::DropNextReply);
    let answer = send(&app, payment("resent", "{}")).await;
    assert_eq!(
        answer.status,
        StatusCode::CREATED,
        "the re-sent claim found its own claim: {:?}",
        answer.body
    );
    assert!(!answer.is_replay());
    assert_eq!(runs.get(), 1);
    assert_eq!(
        round_trips(&stats).await,
        3,
        "claim, the same claim again, complete"
    );
}

// Promises 4 and 5, and where they end: a node cut off from Redis cannot renew; once its lease
// ends another node runs the key, and the cut-off node's late result is fenced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_node_loses_its_key_at_lease_end_and_is_fenced() {
    let server = RedisServer::start();
    // 1 s: node B's first request must land within it on a loaded machine.
    let lease = Duration::from_secs(1);
    let (proxy, partitioned_store) = through_proxy(&server).await;
    let (node_a, runs_a) = router(
        IdempotencyLayer::new(partitioned_store)
            .with_lease(lease)
            .with_store_timeout(TIMEOUT),
    );
    let direct = common::redis_store(client(&server.url()).await);
    let node_b_layer = IdempotencyLayer::new(direct).with_lease(lease);
    let (node_b, runs_b) = router(node_b_layer.clone());

    // Node A's handler outlasts its lease and node B's takeover by far.
    let on_a = tokio::spawn(async move { send(&node_a, slow("split", 3500)).await });
    common::until("node A runs the key", || runs_a.get() == 1).await;
    proxy.set(Fault::BlackHole);
    let blocked = send(&node_b, payment("split", "{}")).await;
    assert_eq!(blocked.status, StatusCode::CONFLICT, "the live lease holds");
    tokio::time::sleep(lease + Duration::from_millis(300)).await;
    let taken_over = send(&node_b, payment("split", "{}")).await;
    assert_eq!(
        (taken_over.status, taken_over.is_replay()),
        (StatusCode::CREATED, false)
    );
    // Node A finishes and reaches Redis again: its result must not replace node B's.
    proxy.set(Fault::None);
    assert_eq!(on_a.await.unwrap().status, StatusCode::CREATED);
    let replay = send(&node_b, payment("split", "{}")).await;
    assert_eq!(replay.body, taken_over.body, "node B's record stands");
    assert_eq!(
        (runs_a.get(), runs_b.get()),
        (1, 1),
        "the documented limit: two runs across a partition"
    );
    assert_eq!(
        node_b_layer.inspect(None, "split").await.unwrap().unwrap().state,
        RecordState::Completed
    );
}

// Promise 6: a restart mid-load (kill -9 by PID): each request that met the dead server is
// answered 503 and ran nothing, each 201 ran once; then recovery with scripts reloaded, judged by
// a record stored and replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_mid_load_fails_closed_and_recovers() {
    let mut server = RedisServer::start();
    let store = common::redis_store(client(&server.url()).await).with_command_timeout(TIMEOUT);
    let (app, runs) = router(IdempotencyLayer::new(store).with_store_timeout(TIMEOUT));
    let load: Vec<_> = (0..40)
        .map(|i| {
            let app = app.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(i * 10)).await;
                let key = format!("load-{i}");
                let status = send(&app, slow(&key, 50)).await.status;
                (key, status)
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(150)).await;
    server.kill();
    // Down for longer than the store timeout, so requests meet the dead server.
    tokio::time::sleep(Duration::from_millis(700)).await;
    server.restart();
    let mut answers = Vec::new();
    for task in load {
        answers.push(task.await.unwrap());
    }
    assert_failed_closed(&answers, &runs);
    // The restarted server has no scripts (and, without persistence, no records).
    until_stored(&app, "after-restart").await;
}

// Item 7.2: whatever client the user hands in, a Redis restart is ridden out. These clients are
// built as fred's defaults build them: no reconnect policy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_without_a_reconnect_policy_still_rides_out_a_restart() {
    use fred::prelude::{Builder, ClientLike, Config};
    let mut server = RedisServer::start();
    let config = || Config::from_url(&server.url()).unwrap();
    let plain_client = Builder::from_config(config()).build().unwrap();
    plain_client.init().await.unwrap();
    assert!(
        plain_client.client_reconnect_policy().is_none(),
        "fred's default: no policy"
    );
    let pool = Builder::from_config(config()).build_pool(2).unwrap();
    pool.init().await.unwrap();
    // The command timeout at or below the layer's store timeout, as docs/stores.md asks.
    let stores = [
        (
            "new",
            common::redis_store(plain_client).with_command_timeout(TIMEOUT),
        ),
        (
            "from_pool",
            RedisStore::from_pool(pool).with_command_timeout(TIMEOUT),
        ),
    ];
    let apps: Vec<_> = stores
        .into_iter()
        .map(|(name, store)| {
            (
                name,
                router(IdempotencyLayer::new(store).with_store_timeout(TIMEOUT)).0,
            )
        })
        .collect();
    for (name, app) in &apps {
        assert_eq!(
            send(app, payment(&format!("{name}-before"), "{}")).await.status,
            StatusCode::CREATED
        );
    }
    server.kill();
    for (name, app) in &apps {
        let down = send(app, payment(&format!("{name}-down"), "{}")).await;
        assert_eq!(
            down.status,
            StatusCode::SERVICE_UNAVAILABLE,
            "{name}: fail closed while down"
        );
    }
    server.restart();
    for (name, app) in &apps {
        eventually_created(app, &format!("{name}-after")).await;
    }
}

/// Issue 35, item 4: Redis killed 1 s into a 3 s handler and started again 5 s later, with its
/// data (an append-only file, fsynced at every write, so the in-flight record survives). The
/// client is answered as soon as the first completion attempt fails, not after more attempts;
/// the completion goes on in the background, and since the server is back within the lease it
/// lands there: the retry after the restart replays the answer the client got, the handler ran
/// once, and nothing is reported to reconcile. Before, the client waited for three attempts,
/// the result was given up (`CompletionFailed`), and once the lease ended a retry ran the
/// handler again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_back_within_the_lease_still_gets_the_result_and_the_client_is_not_held() {
    const HANDLER: Duration = Duration::from_secs(3);
    const LEASE: Duration = Duration::from_secs(10);
    let mut server = RedisServer::start_with(&["--appendonly", "yes", "--appendfsync", "always"]);
    let store = common::connect(&server.url()).await.expect("connect");
    let (layer, reported) = reconciled(IdempotencyLayer::new(store).with_lease(LEASE));
    let (app, runs) = router(layer.clone());

    let started = Instant::now();
    let running = spawn_send(&app, slow("outage", HANDLER.as_millis() as u64));
    common::until("the handler started", || runs.get() == 1).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    server.kill();
    let killed = Instant::now();
    let answered = running.await.expect("the request task");
    let waited = started.elapsed();
    assert_eq!(answered.status, StatusCode::CREATED, "{:?}", answered.body);
    // One attempt, bounded by the store timeout (2 s, plus 100 ms of grace), and no more.
    assert!(
        waited < HANDLER + Duration::from_millis(2600),
        "the client waited {waited:?} for a {HANDLER:?} handler"
    );

    tokio::time::sleep(Duration::from_secs(5).saturating_sub(killed.elapsed())).await;
    server.restart();
    // The retry after the restart: in flight until the background completion lands, then a
    // replay. Asked until the lease has surely ended, when a claim left to it runs again.
    let deadline = started + LEASE + Duration::from_secs(3);
    let retry = loop {
        let retry = send(&app, payment("outage", "{}")).await;
        if retry.status != StatusCode::CONFLICT || Instant::now() > deadline {
            break retry;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(
        retry.is_replay(),
        "the retry replays: {} {:?}",
        retry.status,
        retry.body
    );
    assert_eq!(retry.body, answered.body, "the answer the client got");
    assert_eq!(runs.get(), 1, "the handler ran once");
    let reported = reported.lock().unwrap().clone();
    assert!(reported.is_empty(), "nothing to reconcile: {reported:?}");
    assert!(
        started.elapsed() < LEASE,
        "replayed within the lease, not after it: {:?}",
        started.elapsed()
    );
}
