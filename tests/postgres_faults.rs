//! Real faults on real PostgreSQL servers: the server killed (`kill -9`) and restarted, paused
//! (`SIGSTOP`), connections dropped or black-holed by a TCP proxy. Each fails closed (503)
//! within the timeout and recovers by itself. Each test has a server of its own.
#![cfg(feature = "postgres")]

mod common;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use common::app::{
    assert_failed_closed, dropping_the_completion_reply, payment, payment_with, reconciled, router, send,
    spawn_send, until_stored,
};
use common::postgres::{self, PgServer};
use common::proxy::{Fault, FaultProxy};
use http::StatusCode;
use tower_idempotency::{IdempotencyLayer, PostgresStore, Rejection};

const TIMEOUT: Duration = Duration::from_millis(300);

async fn server() -> PgServer {
    tokio::task::spawn_blocking(PgServer::start)
        .await
        .expect("start PostgreSQL")
}

/// A store on `url` with the tests' short timeout, in a table of its own.
async fn store(url: &str) -> PostgresStore {
    postgres::store(url).await.with_command_timeout(TIMEOUT)
}

fn layer(store: PostgresStore) -> IdempotencyLayer {
    IdempotencyLayer::new(store).with_store_timeout(TIMEOUT)
}

fn slow(key: &str, delay_ms: u64) -> http::Request<Body> {
    payment_with(key, &[("x-delay-ms", &delay_ms.to_string())])
}

async fn eventually_created(app: &axum::Router, key: &str) -> common::app::Answer {
    for _ in 0..200 {
        let answer = send(app, payment(key, "{}")).await;
        if answer.status == StatusCode::CREATED {
            return answer;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let last = send(app, payment(key, "{}")).await;
    panic!("the layer did not recover: {} {:?}", last.status, last.body);
}

fn assert_store_unavailable(answer: &common::app::Answer, started: Instant) {
    assert_eq!(
        answer.extensions.get::<Rejection>(),
        Some(&Rejection::StoreUnavailable),
        "{} {:?}",
        answer.status,
        answer.body
    );
    assert!(
        started.elapsed() < TIMEOUT + Duration::from_millis(500),
        "answered within the timeout: {:?}",
        started.elapsed()
    );
}

// Promise 6: kill -9 of every server process mid-load: each request that met the dead server is
// answered 503 and ran nothing, each 201 ran once; after the restart (crash recovery) the layer
// recovers by itself, judged by a record stored and replayed. What was committed before the crash
// is still there: a key completed before it replays after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_server_fails_closed_and_recovers_after_its_restart() {
    let mut server = server().await;
    let (app, runs) = router(layer(store(&server.url()).await));
    let before = send(&app, payment("before-crash", "{}")).await;
    assert_eq!(before.status, StatusCode::CREATED);
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
    let server = tokio::task::spawn_blocking(move || {
        server.kill();
        server
    })
    .await
    .unwrap();
    let started = Instant::now();
    let down = send(&app, payment("while-down", "{}")).await;
    assert_store_unavailable(&down, started);
    // Down for longer than the store timeout, so requests meet the dead server.
    tokio::time::sleep(Duration::from_millis(700)).await;
    let mut server = server;
    let server = tokio::task::spawn_blocking(move || {
        server.restart();
        server
    })
    .await
    .unwrap();
    let mut answers = vec![
        ("before-crash".to_owned(), before.status),
        ("while-down".to_owned(), down.status),
    ];
    for task in load {
        answers.push(task.await.unwrap());
    }
    assert_failed_closed(&answers, &runs);
    until_stored(&app, "after-restart").await;
    let replay = send(&app, payment("before-crash", "{}")).await;
    assert!(
        replay.is_replay(),
        "committed before the crash, replayed after it"
    );
    assert_eq!(replay.body, before.body);
    assert_eq!(runs.of("before-crash"), 1);
    drop(server);
}

// Promise 6: a server whose every process is stopped (SIGSTOP) keeps its connections open and
// answers nothing: bounded by the timeout, fail-closed, and recovered from once it goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_server_fails_closed_within_the_timeout_then_recovers() {
    let server = server().await;
    let (app, runs) = router(layer(store(&server.url()).await));
    assert_eq!(
        send(&app, payment("warm", "{}")).await.status,
        StatusCode::CREATED
    );
    server.pause();
    for i in 0..3 {
        let started = Instant::now();
        let answer = send(&app, payment(&format!("paused-{i}"), "{}")).await;
        assert_store_unavailable(&answer, started);
    }
    server.resume();
    eventually_created(&app, "paused-0").await;
    assert!(send(&app, payment("warm", "{}")).await.is_replay());
    assert_eq!(runs.get(), 2, "nothing ran while the server was stopped");
}

// Promise 6: a black hole between the layer and the server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_black_holed_server_answers_503_within_the_timeout() {
    let server = server().await;
    let proxy = FaultProxy::start(server.addr()).await;
    let (app, runs) = router(layer(store(&postgres::url_for(proxy.addr())).await));
    // The first request opens the pool's connection, which a loaded machine may take longer
    // than the timeout to do: tried again until answered.
    eventually_created(&app, "before").await;
    proxy.set(Fault::BlackHole);
    let started = Instant::now();
    let answer = send(&app, payment("bh", "{}")).await;
    assert_store_unavailable(&answer, started);
    proxy.set(Fault::None);
    eventually_created(&app, "bh").await;
    assert_eq!(runs.get(), 2);
}

// Promise 6: every connection dropped, and new ones refused, then traffic let through again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_connections_fail_closed_and_reconnect() {
    let server = server().await;
    let proxy = FaultProxy::start(server.addr()).await;
    let (app, runs) = router(layer(store(&postgres::url_for(proxy.addr())).await));
    // The first request opens the pool's connection, which a loaded machine may take longer
    // than the timeout to do: tried again until answered.
    eventually_created(&app, "before").await;
    proxy.set(Fault::Drop);
    for i in 0..3 {
        let started = Instant::now();
        let answer = send(&app, payment(&format!("dropped-{i}"), "{}")).await;
        assert_store_unavailable(&answer, started);
    }
    proxy.set(Fault::None);
    eventually_created(&app, "dropped-0").await;
    assert!(send(&app, payment("dropped-0", "{}")).await.is_replay());
    assert_eq!(runs.get(), 2);
}

// Promise 6: a completion that fails is tried again (in the background, once the client has
// its answer). The handler has the proxy drop the reply to the completion, so the first attempt
// fails with its statement committed; the second finds its own completed record and succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_completion_is_retried() {
    let server = server().await;
    let proxy = Arc::new(FaultProxy::start(server.addr()).await);
    let (layer, events) = reconciled(layer(store(&postgres::url_for(proxy.addr())).await));
    let (app, runs) = dropping_the_completion_reply(layer, &proxy);
    let first = send(&app, payment("retried", "{}")).await;
    assert_eq!((first.status, first.is_replay()), (StatusCode::CREATED, false));
    assert_eq!(proxy.dropped_replies(), 1, "the completion's reply was dropped");
    // In flight until the attempt after the lost reply lands. (A 503 is a retry's own claim
    // outlasting the 300 ms timeout on a loaded machine: asked again too.)
    let deadline = Instant::now() + Duration::from_secs(5);
    let retry = loop {
        let retry = send(&app, payment("retried", "{}")).await;
        let unanswered = [StatusCode::CONFLICT, StatusCode::SERVICE_UNAVAILABLE].contains(&retry.status);
        if !unanswered || Instant::now() > deadline {
            break retry;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
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
    let server = server().await;
    let proxy = FaultProxy::start(server.addr()).await;
    let (app, runs) = router(layer(store(&postgres::url_for(proxy.addr())).await));
    let first = spawn_send(&app, slow("unstored", 200));
    common::until("the handler runs", || runs.get() == 1).await;
    proxy.set(Fault::BlackHole);
    let started = Instant::now();
    let answer = first.await.unwrap();
    assert_eq!(answer.status, StatusCode::CREATED, "the client gets its response");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "completion retries are bounded: {:?}",
        started.elapsed()
    );
    proxy.set(Fault::None);
}

// Promises 4 and 5 across a partition: a node cut off from the database cannot renew; once its
// lease ends another node runs the key, and the cut-off node's late result is fenced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_node_loses_its_key_at_lease_end_and_is_fenced() {
    let server = server().await;
    // 1 s: node B's first request must land within it on a loaded machine.
    let lease = Duration::from_secs(1);
    let proxy = FaultProxy::start(server.addr()).await;
    let partitioned = store(&postgres::url_for(proxy.addr())).await;
    let direct = PostgresStore::connect(&server.url())
        .await
        .unwrap()
        .with_table(partitioned.table());
    let (node_a, runs_a) = router(layer(partitioned).with_lease(lease));
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
    proxy.set(Fault::None);
    assert_eq!(on_a.await.unwrap().status, StatusCode::CREATED);
    let replay = send(&node_b, payment("split", "{}")).await;
    assert_eq!(replay.body, taken_over.body, "node B's record stands");
    assert_eq!((runs_a.get(), runs_b.get()), (1, 1));
}
