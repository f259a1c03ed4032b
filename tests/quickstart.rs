//! The quickstart demo is a contract others drive: run the built example and check it over HTTP,
//! on the memory store, on Redis (`REDIS_URL`) and on PostgreSQL (`DATABASE_URL`).

mod common;

use std::process::Command;
use std::time::Duration;

use common::demo::{call, connect, fetch, quickstart_binary, send, send_with, start, start_with, Demo};
use http::StatusCode;

async fn check_contract(demo: &Demo) {
    let addr = demo.addr;
    // POST /payments: key required, 201 with Location and {id, amount}.
    let first = call(addr, "/payments", Some("qs-1"), r#"{"amount": 42}"#).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let id = first.json["id"].as_str().expect("an id").to_owned();
    assert_eq!(first.json["amount"], 42);
    assert_eq!(first.headers["location"], format!("/payments/{id}"));
    let retry = call(addr, "/payments", Some("qs-1"), r#"{"amount": 42}"#).await;
    assert_eq!(retry.headers["idempotent-replayed"], "true");
    assert_eq!(retry.json, first.json);
    let other = call(addr, "/payments", Some("qs-2"), r#"{"amount": 42}"#).await;
    assert_ne!(
        other.json["id"], first.json["id"],
        "a new key is a new payment with a new id"
    );
    assert_eq!(
        call(addr, "/payments", None, r#"{"amount": 1}"#).await.status,
        StatusCode::BAD_REQUEST
    );
    // amount > 1000: 500, not stored, so the retry runs again.
    for _ in 0..2 {
        let failed = call(addr, "/payments", Some("qs-big"), r#"{"amount": 1001}"#).await;
        assert_eq!(failed.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert!(failed.headers.get("idempotent-replayed").is_none());
    }
    // delay_ms: a retry while the first runs gets 409 with Retry-After. The first runs for 2 s:
    // the retry, 500 ms after it, lands inside that on a loaded machine.
    let slow = tokio::spawn(call(
        addr,
        "/payments",
        Some("qs-slow"),
        r#"{"amount": 5, "delay_ms": 2000}"#,
    ));
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    let busy = call(
        addr,
        "/payments",
        Some("qs-slow"),
        r#"{"amount": 5, "delay_ms": 2000}"#,
    )
    .await;
    assert_eq!(busy.status, StatusCode::CONFLICT);
    assert!(busy.headers.contains_key("retry-after"));
    assert_eq!(slow.await.unwrap().status, StatusCode::CREATED);
    // Prefer: wait=N: a retry waits for the running first request and gets its answer.
    let slow = tokio::spawn(call(
        addr,
        "/payments",
        Some("qs-wait"),
        r#"{"amount": 6, "delay_ms": 2000}"#,
    ));
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    let waited = send_with(
        &mut connect(addr).await,
        "/payments",
        Some("qs-wait"),
        r#"{"amount": 6, "delay_ms": 2000}"#,
        &[("prefer", "wait=5")],
    )
    .await;
    let slow = slow.await.unwrap();
    assert_eq!(slow.status, StatusCode::CREATED);
    assert_eq!(waited.status, StatusCode::CREATED, "{:?}", waited.json);
    assert_eq!(waited.headers["idempotent-replayed"], "true");
    assert_eq!(waited.headers["preference-applied"], "wait=5");
    assert_eq!(
        waited.body, slow.body,
        "the first request's answer, byte for byte"
    );
    // POST /comments: key optional.
    let a = call(addr, "/comments", None, "{}").await;
    let b = call(addr, "/comments", None, "{}").await;
    assert_eq!((a.status, b.status), (StatusCode::CREATED, StatusCode::CREATED));
    assert_ne!(a.json["id"], b.json["id"]);
    let keyed = call(addr, "/comments", Some("qs-c"), "{}").await;
    assert_eq!(call(addr, "/comments", Some("qs-c"), "{}").await.json, keyed.json);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_quickstart_contract_in_memory() {
    let demo = start(None);
    assert!(demo.store_line.contains("in memory"), "{}", demo.store_line);
    check_contract(&demo).await;
}

/// The value of the sample `name{labels}` in a Prometheus text exposition, 0 if absent.
fn sample(exposition: &str, name_and_labels: &str) -> f64 {
    exposition
        .lines()
        .filter(|line| !line.starts_with('#'))
        .find_map(|line| {
            let (series, value) = line.rsplit_once(' ')?;
            (series == name_and_labels).then(|| value.parse().ok())?
        })
        .unwrap_or(0.0)
}

/// `GET /metrics` serves the layer's counters, in the Prometheus text format, with the values
/// the requests made.
async fn check_metrics(demo: &Demo) {
    let addr = demo.addr;
    let before = fetch(addr, "/metrics").await;
    assert_eq!(before.status, StatusCode::OK);
    let before = String::from_utf8(before.body.to_vec()).expect("text");
    let count = |text: &str, outcome: &str| {
        sample(
            text,
            &format!("idempotency_requests_total{{outcome=\"{outcome}\"}}"),
        )
    };
    let key = "qs-metrics";
    let first = call(addr, "/payments", Some(key), r#"{"amount": 7}"#).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let replay = call(addr, "/payments", Some(key), r#"{"amount": 7}"#).await;
    assert_eq!(replay.headers["idempotent-replayed"], "true");
    let mismatch = call(addr, "/payments", Some(key), r#"{"amount": 8}"#).await;
    assert_eq!(mismatch.status, StatusCode::CONFLICT);
    let after = fetch(addr, "/metrics").await;
    let content_type = after.headers.get("content-type").and_then(|v| v.to_str().ok());
    assert!(
        content_type.is_some_and(|v| v.starts_with("text/plain")),
        "{content_type:?}"
    );
    let after = String::from_utf8(after.body.to_vec()).expect("text");
    for outcome in ["executed", "replayed", "mismatch"] {
        assert_eq!(
            count(&after, outcome) - count(&before, outcome),
            1.0,
            "{outcome}:\n{after}"
        );
    }
    let rejected = |text: &str| sample(text, "idempotency_rejections_total{kind=\"Mismatch\"}");
    assert_eq!(rejected(&after) - rejected(&before), 1.0, "{after}");
    assert!(
        after.contains("# TYPE idempotency_store_duration_seconds histogram")
            && after.contains("idempotency_store_duration_seconds_bucket{op=\"claim\",le=\"0.001\"}"),
        "store timings as a histogram:\n{after}"
    );
    assert_eq!(sample(&after, "idempotency_running"), 0.0, "{after}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_quickstart_serves_its_metrics_in_memory() {
    check_metrics(&start(None)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_quickstart_serves_its_metrics_on_redis() {
    let server = common::RedisServer::start();
    check_metrics(&start(Some(&server.url()))).await;
}

// A store bounded at 10 000 records forgot the demo's first payment after 10 000 other keys, so
// its retry paid twice; the memory store is bounded in bytes now, with room for far more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_memory_store_still_replays_the_first_key_after_12_000_others() {
    const OTHER_KEYS: usize = 12_000;
    const CONNECTIONS: usize = 32;
    let demo = start(None);
    let addr = demo.addr;
    let first = call(addr, "/payments", Some("qs-first"), r#"{"amount": 42}"#).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let senders: Vec<_> = (0..CONNECTIONS)
        .map(|connection| {
            tokio::spawn(async move {
                let mut sender = connect(addr).await;
                for n in (connection..OTHER_KEYS).step_by(CONNECTIONS) {
                    let key = format!("qs-other-{n}");
                    let reply = send(&mut sender, "/payments", Some(&key), r#"{"amount": 1}"#).await;
                    assert_eq!(reply.status, StatusCode::CREATED, "{key}");
                }
            })
        })
        .collect();
    for sender in senders {
        sender.await.unwrap();
    }
    let retry = call(addr, "/payments", Some("qs-first"), r#"{"amount": 42}"#).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(
        retry
            .headers
            .get("idempotent-replayed")
            .and_then(|v| v.to_str().ok()),
        Some("true"),
        "the first key is replayed"
    );
    assert_eq!(
        retry.json, first.json,
        "the same payment id: the handler did not run again"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_quickstart_contract_on_redis() {
    let server = common::RedisServer::start();
    let demo = start(Some(&server.url()));
    assert!(demo.store_line.contains("Redis"), "{}", demo.store_line);
    check_contract(&demo).await;
}

/// `IDEMPOTENCY_WAIT_REPLICAS=1` turns the durability option on: the contract holds, and every
/// claim and completion waits for the replica (`WAIT` runs on the master).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_quickstart_contract_on_redis_with_a_replica_acknowledging() {
    let master = common::RedisServer::start();
    let port = master.port().to_string();
    let _replica = common::RedisServer::start_with(&["--replicaof", "127.0.0.1", &port]);
    let admin = common::client(&master.url()).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let info = common::admin(&admin, &["INFO", "replication"]).await;
        if info.as_str().is_some_and(|info| info.contains("state=online")) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the replica never came online"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // A replica that has just synchronised may acknowledge the first writes up to a second late
    // (seen on Redis 7.0); wait until it acknowledges at once, as it does from then on.
    loop {
        common::admin(&admin, &["SET", "probe", "1"]).await;
        let acked = common::admin(&admin, &["WAIT", "1", "100"]).await;
        if acked.as_i64() == Some(1) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the replica never acknowledged a write"
        );
    }
    let demo = start_with(Some(&master.url()), None, &[("IDEMPOTENCY_WAIT_REPLICAS", "1")]);
    assert!(
        demo.store_line.contains("acknowledged by 1 replica"),
        "{}",
        demo.store_line
    );
    let waits_before = common::command_calls(&admin, "wait").await;
    check_contract(&demo).await;
    assert!(
        common::command_calls(&admin, "wait").await >= waits_before + 2,
        "claims and completions waited for the replica"
    );
}

#[test]
fn a_bad_wait_replicas_value_stops_the_quickstart_with_a_clear_message() {
    let output = Command::new(quickstart_binary())
        .env("ADDR", "127.0.0.1:0")
        .env("REDIS_URL", "redis://127.0.0.1:1")
        .env("IDEMPOTENCY_WAIT_REPLICAS", "two")
        .output()
        .expect("run the quickstart");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("IDEMPOTENCY_WAIT_REPLICAS"), "{stderr}");
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_quickstart_contract_on_postgres() {
    let server = tokio::task::spawn_blocking(common::postgres::PgServer::start)
        .await
        .unwrap();
    let demo = start_with(None, Some(&server.url()), &[]);
    assert!(demo.store_line.contains("PostgreSQL"), "{}", demo.store_line);
    check_contract(&demo).await;
    // A second instance on the same database: the first one's payment replays there.
    let other = start_with(None, Some(&server.url()), &[]);
    let replay = call(other.addr, "/payments", Some("qs-1"), r#"{"amount": 42}"#).await;
    assert_eq!(replay.headers["idempotent-replayed"], "true");
}

// Both set: Redis wins, as the demo's docs say.
#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_both_urls_the_quickstart_uses_redis() {
    let server = common::RedisServer::start();
    let demo = start_with(
        Some(&server.url()),
        Some("postgres://nobody@127.0.0.1:1/none"),
        &[],
    );
    assert!(demo.store_line.contains("Redis"), "{}", demo.store_line);
}

// Containers stop with SIGTERM: the demo finishes the request in progress, then exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_the_request_in_progress_and_exits_0() {
    let mut demo = start(None);
    let addr = demo.addr;
    let slow = tokio::spawn(call(
        addr,
        "/payments",
        Some("qs-term"),
        r#"{"amount": 7, "delay_ms": 1500}"#,
    ));
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    let sent = Command::new("kill")
        .args(["-TERM", &demo.child.id().to_string()])
        .status()
        .expect("run kill");
    assert!(sent.success());
    let answer = slow.await.unwrap();
    assert_eq!(
        answer.status,
        StatusCode::CREATED,
        "the request in progress finished"
    );
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let status = loop {
        if let Some(status) = demo.child.try_wait().expect("wait for the demo") {
            break status;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the demo did not exit after SIGTERM"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    };
    assert_eq!(status.code(), Some(0), "exit status after SIGTERM");
}
