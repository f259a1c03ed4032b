//! The `idempotency-admin` tool run as a process, as an operator runs it, against a real Redis
//! (standalone and Cluster) and a real PostgreSQL: records written by a real layer are
//! inspected and purged, records in flight listed; bad arguments and unreachable stores end
//! with their exit codes and a message, never a hang.

mod common;

use std::process::Output;
use std::time::{Duration, Instant};

use axum::Router;
use common::app::{payment, router, send, Runs};
use common::RedisServer;
use http::StatusCode;
use serde_json::Value;
use tower_idempotency::{
    Begin, Coordinator, Fingerprint, IdempotencyKey, IdempotencyLayer, RecordKey, Store,
};

const ADMIN: &str = env!("CARGO_BIN_EXE_idempotency-admin");
/// What the handler's response body carries: the tool must not print it unless asked.
const SECRET: &str = "card-4242-4242-secret";

/// Runs the tool with `args`; fails the test if it takes more than 30 s.
async fn admin(args: &[&str]) -> Output {
    let mut command = tokio::process::Command::new(ADMIN);
    command
        .args(args)
        .env_remove("IDEMPOTENCY_STORE_URL")
        .kill_on_drop(true);
    tokio::time::timeout(Duration::from_secs(30), command.output())
        .await
        .unwrap_or_else(|_| panic!("idempotency-admin {args:?} hung"))
        .expect("run idempotency-admin")
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

fn code(output: &Output) -> i32 {
    output.status.code().expect("an exit code, not a signal")
}

fn json(output: &Output) -> Value {
    serde_json::from_slice(&output.stdout)
        .unwrap_or_else(|error| panic!("not JSON ({error}): {}", stdout(output)))
}

/// A layer scoped by the `x-tenant` header, over `store`.
fn scoped(store: impl Store) -> (Router, Runs) {
    let layer = IdempotencyLayer::new(store).with_scope(|parts| {
        parts
            .headers
            .get("x-tenant")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    });
    router(layer)
}

fn order(key: &str) -> http::Request<axum::body::Body> {
    let mut request = payment(key, &format!("{{\"pay\": \"{SECRET}\"}}"));
    request
        .headers_mut()
        .insert("x-tenant", "tenant-7".parse().unwrap());
    request
}

/// Inspect, purge and list on one store, through the tool; `store_args` name the store
/// (`--url` and `--prefix` or `--table`), `store` is the same store for the layer.
async fn inspect_purge_and_list(store: impl Store + Clone, store_args: &[&str]) {
    let args = |command: &[&str]| -> Vec<String> {
        command.iter().chain(store_args).map(|s| s.to_string()).collect()
    };
    let run = |command: &[&str]| {
        let args = args(command);
        async move { admin(&args.iter().map(String::as_str).collect::<Vec<_>>()).await }
    };
    let (app, runs) = scoped(store.clone());
    let first = send(&app, order("order-42")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(runs.get(), 1);

    // Inspect, human-readable: state, retention, status and size, never the body.
    let inspected = run(&["inspect", "--scope", "tenant-7", "--key", "order-42"]).await;
    let text = stdout(&inspected);
    assert_eq!(code(&inspected), 0, "{text}{}", stderr(&inspected));
    for says in [
        "completed",
        "201 Created",
        "kept for",
        "23h 59m",
        "bytes (body",
        "--show-body",
    ] {
        assert!(text.contains(says), "{says:?} missing:\n{text}");
    }
    assert!(!text.contains(SECRET), "the body was printed unasked:\n{text}");
    // As JSON.
    let inspected = json(&run(&["inspect", "--scope", "tenant-7", "--key", "order-42", "--json"]).await);
    let digest = RecordKey::new(Some("tenant-7"), IdempotencyKey::parse("order-42").unwrap()).digest_hex();
    assert_eq!(inspected["found"], true);
    assert_eq!(inspected["digest"], digest.as_str());
    assert_eq!(inspected["state"], "completed");
    assert_eq!(inspected["status"], 201);
    assert_eq!(inspected["body_bytes"].as_u64(), Some(first.body.len() as u64));
    assert!(inspected["stored_bytes"].as_u64() > inspected["body_bytes"].as_u64());
    let retention_left = inspected["expires_in_ms"].as_u64().unwrap();
    assert!(
        retention_left > 86_000_000 && retention_left <= 86_400_000,
        "{retention_left}"
    );
    assert!(inspected.get("body").is_none(), "{inspected}");
    // The body only when asked.
    let shown = run(&[
        "inspect",
        "--scope",
        "tenant-7",
        "--key",
        "order-42",
        "--show-body",
    ])
    .await;
    assert!(stdout(&shown).contains(SECRET), "{}", stdout(&shown));
    let shown = json(
        &run(&[
            "inspect",
            "--scope",
            "tenant-7",
            "--key",
            "order-42",
            "--show-body",
            "--json",
        ])
        .await,
    );
    assert_eq!(shown["body"].as_str(), std::str::from_utf8(&first.body).ok());

    // Another scope or another key has no record: exit 1.
    let other_scope = run(&["inspect", "--scope", "tenant-8", "--key", "order-42"]).await;
    assert_eq!(code(&other_scope), 1, "{}", stdout(&other_scope));
    assert!(
        stdout(&other_scope).contains("no record"),
        "{}",
        stdout(&other_scope)
    );
    let unscoped = json(&run(&["inspect", "--key", "order-42", "--json"]).await);
    assert_eq!(unscoped["found"], false);

    // Purge: the record goes, the next request runs the handler again.
    let purged = run(&["purge", "--scope", "tenant-7", "--key", "order-42"]).await;
    assert_eq!(code(&purged), 0, "{}{}", stdout(&purged), stderr(&purged));
    assert!(stdout(&purged).contains("purged"), "{}", stdout(&purged));
    let again = run(&["purge", "--scope", "tenant-7", "--key", "order-42", "--json"]).await;
    assert_eq!(code(&again), 1);
    assert_eq!(json(&again)["purged"], false);
    let rerun = send(&app, order("order-42")).await;
    assert_eq!(rerun.status, StatusCode::CREATED);
    assert!(!rerun.is_replay());
    assert_eq!(runs.get(), 2, "the purged key ran again");

    // In flight: one claim held for over a second, one fresh; --older-than 1s lists the first.
    let coordinator = Coordinator::new(store.clone());
    let fingerprint = Fingerprint::new([b"{}".as_slice()]);
    let old_key = RecordKey::new(Some("tenant-7"), IdempotencyKey::parse("slow-order").unwrap());
    let young_key = RecordKey::new(Some("tenant-7"), IdempotencyKey::parse("young-order").unwrap());
    let Begin::Claimed(old) = coordinator.begin(&old_key, &fingerprint).await.unwrap() else {
        panic!("a new key");
    };
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let Begin::Claimed(young) = coordinator.begin(&young_key, &fingerprint).await.unwrap() else {
        panic!("a new key");
    };
    let listed = run(&["in-flight", "--older-than", "1s"]).await;
    let text = stdout(&listed);
    assert_eq!(code(&listed), 0, "{text}{}", stderr(&listed));
    assert!(text.contains(&old_key.digest_hex()), "{text}");
    assert!(!text.contains(&young_key.digest_hex()), "{text}");
    assert!(
        !text.contains("slow-order"),
        "a listing shows digests, never keys:\n{text}"
    );
    let listed = json(&run(&["in-flight", "--json"]).await);
    let records = listed["records"].as_array().expect("records");
    assert_eq!(records.len(), 2, "{listed}");
    assert_eq!(
        records[0]["digest"],
        old_key.digest_hex().as_str(),
        "oldest first"
    );
    assert!(records[0]["age_ms"].as_u64().unwrap() >= 1200, "{listed}");
    assert!(
        records[0]["lease_left_ms"].as_u64().unwrap() <= 30_000,
        "{listed}"
    );
    assert_eq!(records[1]["digest"], young_key.digest_hex().as_str());
    let limited = json(&run(&["in-flight", "--limit", "1", "--json"]).await);
    assert_eq!(limited["records"].as_array().map(Vec::len), Some(1));
    // Nothing that old: exit 1.
    let none = run(&["in-flight", "--older-than", "1h"]).await;
    assert_eq!(code(&none), 1);
    assert!(
        stdout(&none).contains("no records in flight"),
        "{}",
        stdout(&none)
    );
    // A purge of a record in flight is refused without --force, showing its lease and owner;
    // the record stays.
    let refused = run(&["purge", "--scope", "tenant-7", "--key", "slow-order"]).await;
    let text = stdout(&refused);
    assert_eq!(code(&refused), 5, "{text}{}", stderr(&refused));
    for says in [
        "not purged",
        "in flight",
        "lease left",
        old.owner().as_str(),
        "--force",
    ] {
        assert!(text.contains(says), "{says:?} missing:\n{text}");
    }
    let refused = json(&run(&["purge", "--scope", "tenant-7", "--key", "slow-order", "--json"]).await);
    assert_eq!(refused["purged"], false);
    assert_eq!(refused["refused"], "in_flight");
    assert_eq!(refused["owner"], old.owner().as_str());
    assert!(
        refused["lease_left_ms"].as_u64().is_some_and(|ms| ms <= 30_000),
        "{refused}"
    );
    assert!(
        refused["age_ms"].as_u64().is_some_and(|ms| ms >= 1_200),
        "{refused}"
    );
    let still = json(&run(&["inspect", "--scope", "tenant-7", "--key", "slow-order", "--json"]).await);
    assert_eq!(still["state"], "in_flight");
    let forced = run(&["purge", "--scope", "tenant-7", "--key", "slow-order", "--force"]).await;
    assert_eq!(code(&forced), 0, "{}{}", stdout(&forced), stderr(&forced));
    assert!(
        stdout(&forced).contains("purged the record"),
        "{}",
        stdout(&forced)
    );
    assert!(
        store.inspect(&old_key).await.unwrap().is_none(),
        "the record is gone"
    );
    let _ = old.release().await;
    young.release().await.unwrap();

    // A stored body is printed with what a terminal would act on escaped, unless --raw.
    let hostile = "\u{1b}]0;pwned\u{7}\u{1b}[2J";
    let (app, _) = scoped(store.clone());
    let mut request = payment("hostile", hostile);
    request
        .headers_mut()
        .insert("x-tenant", "tenant-7".parse().unwrap());
    assert_eq!(send(&app, request).await.status, StatusCode::CREATED);
    let shown = run(&[
        "inspect",
        "--scope",
        "tenant-7",
        "--key",
        "hostile",
        "--show-body",
    ])
    .await;
    assert_eq!(code(&shown), 0);
    assert!(!shown.stdout.contains(&0x1b), "{}", stdout(&shown));
    assert!(
        stdout(&shown).contains("\\u{001b}]0;pwned\\u{0007}\\u{001b}[2J"),
        "{}",
        stdout(&shown)
    );
    let raw = run(&[
        "inspect",
        "--scope",
        "tenant-7",
        "--key",
        "hostile",
        "--show-body",
        "--raw",
    ])
    .await;
    assert!(stdout(&raw).contains(hostile), "{}", stdout(&raw));
    let none = json(&run(&["in-flight", "--json"]).await);
    assert_eq!(none["records"], Value::Array(Vec::new()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_redis_it_inspects_purges_and_lists() {
    let server = RedisServer::start();
    let url = server.url();
    let store = tower_idempotency::RedisStore::connect(&url)
        .await
        .expect("connect")
        .with_prefix("admin-test");
    inspect_purge_and_list(store, &["--url", &url, "--prefix", "admin-test"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_it_inspects_purges_and_lists() {
    let url = tokio::task::spawn_blocking(|| common::postgres::shared().url())
        .await
        .expect("start PostgreSQL");
    let table = common::postgres::unique_table();
    let store = tower_idempotency::PostgresStore::connect(&url)
        .await
        .expect("connect")
        .with_table(&table);
    store.migrate().await.expect("create the table");
    inspect_purge_and_list(store, &["--url", &url, "--table", &table]).await;
}

/// A `redis-cluster://` URL: the listing reaches the records on every master.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_redis_cluster_it_lists_the_records_of_every_master() {
    let url = tokio::task::spawn_blocking(|| common::cluster::Cluster::shared().url())
        .await
        .expect("start the cluster");
    let store = tower_idempotency::RedisStore::connect(&url)
        .await
        .expect("connect")
        .with_prefix("admin-cluster");
    let coordinator = Coordinator::new(store);
    let fingerprint = Fingerprint::new([b"{}".as_slice()]);
    let mut claims = Vec::new();
    let mut digests = Vec::new();
    for i in 0..30 {
        let key = RecordKey::new(None, IdempotencyKey::parse(&format!("k{i}")).unwrap());
        let Begin::Claimed(claim) = coordinator.begin(&key, &fingerprint).await.unwrap() else {
            panic!("a new key");
        };
        claims.push(claim);
        digests.push(key.digest_hex());
    }
    let listed = json(&admin(&["in-flight", "--url", &url, "--prefix", "admin-cluster", "--json"]).await);
    let mut found: Vec<String> = listed["records"]
        .as_array()
        .expect("records")
        .iter()
        .map(|record| record["digest"].as_str().unwrap().to_owned())
        .collect();
    found.sort();
    digests.sort();
    assert_eq!(found, digests, "30 keys over 3 masters, all listed");
    for claim in claims {
        claim.release().await.unwrap();
    }
}

#[tokio::test]
async fn bad_arguments_exit_2_with_the_usage() {
    for args in [
        &[][..],
        &["frobnicate"],
        &["inspect", "--url", "redis://127.0.0.1:1"],
        &["inspect", "--url", "redis://127.0.0.1:1", "--key"],
        &[
            "in-flight",
            "--url",
            "redis://127.0.0.1:1",
            "--older-than",
            "soon",
        ],
        &["in-flight", "--url", "http://127.0.0.1:1"],
        &["in-flight"],
        &[
            "purge",
            "--url",
            "redis://127.0.0.1:1",
            "--key",
            "k",
            "--limit",
            "3",
        ],
    ] {
        let output = admin(args).await;
        assert_eq!(code(&output), 2, "{args:?}: {}", stderr(&output));
        assert!(
            stderr(&output).contains("Usage:"),
            "{args:?}: {}",
            stderr(&output)
        );
        assert!(output.stdout.is_empty(), "{args:?}");
    }
    let help = admin(&["--help"]).await;
    assert_eq!(code(&help), 0);
    assert!(stdout(&help).contains("Exit codes"), "{}", stdout(&help));
}

/// A port on which nothing listens, and one that accepts connections and never answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_store_exits_3_with_a_message_within_the_timeout() {
    let closed = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    };
    let black_hole = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent = black_hole.local_addr().unwrap().port();
    let holding = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = black_hole.accept().await {
            held.push(socket);
        }
    });
    for url in [
        format!("redis://:secret@127.0.0.1:{closed}"),
        format!("redis://:secret@127.0.0.1:{silent}"),
        format!("postgres://app:secret@127.0.0.1:{closed}/app"),
        format!("postgres://app:secret@127.0.0.1:{silent}/app"),
    ] {
        let started = Instant::now();
        let output = admin(&["inspect", "--url", &url, "--key", "k", "--timeout", "3s"]).await;
        let took = started.elapsed();
        let message = stderr(&output);
        assert_eq!(code(&output), 3, "{url}: {message}");
        assert!(
            message.contains("cannot reach the store") || message.contains("did not answer within"),
            "{url}: {message}"
        );
        let host = url.rsplit_once('@').unwrap().1.split('/').next().unwrap();
        assert!(
            message.contains(&format!("***@{host}")),
            "names the store: {message}"
        );
        assert!(!message.contains("secret"), "the password was printed: {message}");
        assert!(took < Duration::from_secs(6), "{url}: took {took:?}");
    }
    // --timeout bounds the whole run, below the store's own 2 s.
    let started = Instant::now();
    let url = format!("redis://127.0.0.1:{silent}");
    let output = admin(&["in-flight", "--url", &url, "--timeout", "700ms"]).await;
    assert_eq!(code(&output), 3, "{}", stderr(&output));
    assert!(
        stderr(&output).contains("did not answer within 700ms (--timeout)"),
        "{}",
        stderr(&output)
    );
    assert!(
        started.elapsed() < Duration::from_millis(1900),
        "{:?}",
        started.elapsed()
    );
    holding.abort();
}
