//! Transactional completion on PostgreSQL: a handler stores its response in the transaction of
//! its business rows. In process: what is committed is what retries get, a rollback leaves the
//! layer to store or release as usual, a lost claim makes the handler roll back, a transaction
//! held open past several lease renewals is not taken for a lost claim; `ClaimTransaction` (a
//! consumer's effect) commits its row with the record, and rolls it back when the claim was
//! lost. Then with a real process
//! (`examples/postgres_transactional.rs`) killed with `kill -9` after the commit (the retry
//! replays; one order) and before it (the key runs again once its lease ends; one order).
#![cfg(feature = "postgres")]

mod common;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::Extension;
use axum::response::IntoResponse;
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use common::app::{send, Answer};
use common::postgres::{self, PgServer};
use http::{Request, StatusCode};
use tower_idempotency::{IdempotencyLayer, PostgresStore, RecordState, TransactionalClaim};

/// What the test handler does after inserting its business row.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Ending {
    /// Completes the claim in the transaction and commits.
    Commit,
    /// Completes the claim in the transaction, then rolls back and answers `status`.
    RollBack(u16),
    /// Completes in the transaction, waits `ms`, commits, and waits `ms` again before answering.
    CommitAfter(u64),
}

struct Orders {
    store: PostgresStore,
    table: String,
    layer: IdempotencyLayer,
    router: Router,
    /// What `complete_in` answered, per run.
    completions: Arc<Mutex<Vec<bool>>>,
}

async fn orders(store: PostgresStore, lease: Duration) -> Orders {
    let table = format!("{}_orders", store.table());
    sqlx::query(&format!(
        "CREATE TABLE {table} (id bigserial PRIMARY KEY, note text NOT NULL)"
    ))
    .execute(store.pool())
    .await
    .unwrap();
    let layer = IdempotencyLayer::new(store.clone())
        .with_lease(lease)
        .with_transactional_completion(true);
    let completions = Arc::new(Mutex::new(Vec::new()));
    let handler = {
        let (store, table, completions) = (store.clone(), table.clone(), completions.clone());
        move |Extension(claim): Extension<TransactionalClaim>, headers: http::HeaderMap| {
            let (store, table, completions) = (store.clone(), table.clone(), completions.clone());
            async move {
                let ending = match headers.get("x-ending").and_then(|v| v.to_str().ok()) {
                    Some("rollback-201") => Ending::RollBack(201),
                    Some("rollback-500") => Ending::RollBack(500),
                    Some(wait) if wait.starts_with("commit-after-") => {
                        Ending::CommitAfter(wait["commit-after-".len()..].parse().unwrap())
                    }
                    _ => Ending::Commit,
                };
                if let Some(ms) = headers.get("x-delay-ms").and_then(|v| v.to_str().ok()) {
                    tokio::time::sleep(Duration::from_millis(ms.parse().unwrap())).await;
                }
                let mut transaction = store.pool().begin().await.unwrap();
                let id: i64 =
                    sqlx::query_scalar(&format!("INSERT INTO {table} (note) VALUES ('x') RETURNING id"))
                        .fetch_one(&mut *transaction)
                        .await
                        .unwrap_or_else(|_| panic!("insert into {table}"));
                // The response committed with the row says so; the one answered live says
                // "live", so a test can tell which one a replay is.
                let committed = (StatusCode::CREATED, format!("order {id} (committed)")).into_response();
                let (_, payload) = claim.encode_response(committed).await.unwrap();
                let payload = payload.expect("a 201 is stored");
                let completed = store
                    .complete_in(&mut transaction, claim.ticket(), payload)
                    .await
                    .unwrap();
                completions.lock().unwrap().push(completed);
                if !completed {
                    transaction.rollback().await.unwrap();
                    return (StatusCode::CONFLICT, "claim lost").into_response();
                }
                match ending {
                    Ending::Commit => transaction.commit().await.unwrap(),
                    Ending::CommitAfter(ms) => {
                        tokio::time::sleep(Duration::from_millis(ms)).await;
                        transaction.commit().await.unwrap();
                        tokio::time::sleep(Duration::from_millis(ms)).await;
                    }
                    Ending::RollBack(status) => {
                        transaction.rollback().await.unwrap();
                        let status = StatusCode::from_u16(status).unwrap();
                        return (status, format!("order {id} (rolled back)")).into_response();
                    }
                }
                (StatusCode::CREATED, format!("order {id} (live)")).into_response()
            }
        }
    };
    let router = Router::new().route("/orders", post(handler).layer(layer.clone()));
    Orders {
        store,
        table,
        layer,
        router,
        completions,
    }
}

impl Orders {
    async fn rows(&self) -> i64 {
        sqlx::query_scalar(&format!("SELECT count(*) FROM {}", self.table))
            .fetch_one(self.store.pool())
            .await
            .unwrap()
    }

    async fn post(&self, key: &str, headers: &[(&str, &str)]) -> Answer {
        send(&self.router, order(key, headers)).await
    }
}

fn order(key: &str, headers: &[(&str, &str)]) -> Request<Body> {
    let mut request = Request::post("/orders").header("idempotency-key", key);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    request.body(Body::from("{}")).unwrap()
}

async fn shared_store() -> PostgresStore {
    let url = tokio::task::spawn_blocking(|| postgres::shared().url())
        .await
        .unwrap();
    postgres::store(&url).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_the_transaction_committed_is_what_retries_get() {
    let orders = orders(shared_store().await, Duration::from_secs(30)).await;
    let first = orders.post("t-commit", &[]).await;
    assert_eq!((first.status, first.is_replay()), (StatusCode::CREATED, false));
    assert!(first.body.ends_with(b"(live)"));
    let retry = orders.post("t-commit", &[]).await;
    assert!(retry.is_replay());
    assert!(
        retry.body.ends_with(b"(committed)"),
        "the layer's own completion did not overwrite the committed response: {:?}",
        retry.body
    );
    assert_eq!(orders.rows().await, 1);
    assert_eq!(*orders.completions.lock().unwrap(), [true]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_rollback_the_layer_stores_or_releases_as_usual() {
    let orders = orders(shared_store().await, Duration::from_secs(30)).await;
    // Rolled back, answered 201: the layer stores the answer itself.
    let first = orders.post("t-rb-201", &[("x-ending", "rollback-201")]).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let retry = orders.post("t-rb-201", &[("x-ending", "rollback-201")]).await;
    assert!(retry.is_replay());
    assert_eq!(retry.body, first.body, "the layer stored what the client got");
    assert!(retry.body.ends_with(b"(rolled back)"));
    // Rolled back, answered 500: released, so the retry runs again.
    let failed = orders.post("t-rb-500", &[("x-ending", "rollback-500")]).await;
    assert_eq!(failed.status, StatusCode::INTERNAL_SERVER_ERROR);
    let again = orders.post("t-rb-500", &[]).await;
    assert_eq!((again.status, again.is_replay()), (StatusCode::CREATED, false));
    assert_eq!(orders.rows().await, 1, "only the committed run left a row");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_claim_is_refused_in_the_transaction_so_the_handler_rolls_back() {
    let orders = orders(shared_store().await, Duration::from_secs(30)).await;
    let slow = tokio::spawn({
        let router = orders.router.clone();
        async move { send(&router, order("t-lost", &[("x-delay-ms", "300")])).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    // An operator purges the key while the handler runs; another request takes it over.
    assert!(orders.layer.purge(None, "t-lost").await.unwrap());
    let newer = orders.post("t-lost", &[]).await;
    assert_eq!((newer.status, newer.is_replay()), (StatusCode::CREATED, false));
    let lost = slow.await.unwrap();
    assert_eq!(lost.status, StatusCode::CONFLICT, "{:?}", lost.body);
    assert_eq!(*orders.completions.lock().unwrap(), [true, false]);
    assert_eq!(orders.rows().await, 1, "the lost run rolled its row back");
    let replay = orders.post("t-lost", &[]).await;
    assert!(replay.is_replay() && replay.body.ends_with(b"(committed)"));
}

/// Without HTTP (a queue consumer): the claim's ticket is completed in the transaction, and the
/// claim's own completion afterwards succeeds and leaves the committed result.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_completed_in_a_transaction_without_http() {
    use tower_idempotency::{Begin, Coordinator, Fingerprint, IdempotencyKey, RecordKey};
    let store = shared_store().await;
    let coordinator = Coordinator::new(store.clone());
    let key = RecordKey::new(None, IdempotencyKey::parse("message-1").unwrap());
    let fingerprint = Fingerprint::new([b"message".as_slice()]);
    let Begin::Claimed(claim) = coordinator.begin(&key, &fingerprint).await.unwrap() else {
        panic!("a new key is claimed");
    };
    let mut transaction = store.pool().begin().await.unwrap();
    let ticket = claim.ticket();
    assert!(store
        .complete_in(
            &mut transaction,
            &ticket,
            Bytes::from_static(b"in the transaction")
        )
        .await
        .unwrap());
    transaction.commit().await.unwrap();
    claim
        .complete(Bytes::from_static(b"after it"))
        .await
        .expect("a success, not ClaimLost");
    match coordinator.begin(&key, &fingerprint).await.unwrap() {
        Begin::Completed(stored) => assert_eq!(stored, "in the transaction"),
        other => panic!("{other:?}"),
    }
}

/// A claim of `key` through `coordinator`, and a `ClaimTransaction` for it that has written the
/// effect: a row in a ledger table of the test's own. Answers the claim, the transaction and
/// how to count the ledger's rows.
async fn effect_in_a_claim_transaction(
    store: &PostgresStore,
    coordinator: &tower_idempotency::Coordinator,
    key: &tower_idempotency::RecordKey,
) -> (
    tower_idempotency::Claim,
    tower_idempotency::ClaimTransaction,
    String,
) {
    let table = postgres::unique_table();
    sqlx::query(&format!("CREATE TABLE {table} (id text NOT NULL)"))
        .execute(store.pool())
        .await
        .unwrap();
    let begin = coordinator.begin(key, &ct_fingerprint()).await.unwrap();
    let tower_idempotency::Begin::Claimed(claim) = begin else {
        panic!("a new key is claimed: {begin:?}");
    };
    let mut transaction = store.transaction_for(&claim.ticket()).await.unwrap();
    sqlx::query(&format!("INSERT INTO {table} VALUES ('{}')", key.key().as_str()))
        .execute(&mut *transaction)
        .await
        .unwrap();
    (claim, transaction, format!("SELECT count(*) FROM {table}"))
}

fn ct_fingerprint() -> tower_idempotency::Fingerprint {
    tower_idempotency::Fingerprint::new([b"ct".as_slice()])
}

/// `ClaimTransaction` (what a queue consumer's effect uses): the effect's row and the record
/// commit together, `commit` answers the payload it stored, and the claim's own completion
/// afterwards leaves the committed result.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_transaction_commits_the_effect_with_the_record() {
    use tower_idempotency::{Begin, Coordinator, IdempotencyKey, RecordKey};
    let store = shared_store().await;
    let coordinator = Coordinator::new(store.clone());
    let key = RecordKey::new(None, IdempotencyKey::parse("ct-commit").unwrap());
    let (claim, transaction, rows) = effect_in_a_claim_transaction(&store, &coordinator, &key).await;
    let stored = transaction
        .commit(Bytes::from_static(b"in the transaction"))
        .await;
    assert_eq!(stored.unwrap(), "in the transaction");
    claim
        .complete(Bytes::from_static(b"after it"))
        .await
        .expect("a success, not ClaimLost");
    match coordinator.begin(&key, &ct_fingerprint()).await.unwrap() {
        Begin::Completed(stored) => assert_eq!(stored, "in the transaction"),
        other => panic!("{other:?}"),
    }
    assert_eq!(count(store.pool(), &rows).await, 1);
}

/// A claim lost before the commit (purged by an operator, as when its lease ran out, and the
/// key claimed by another owner): `ClaimTransaction::commit` refuses with `ClaimLost`, the
/// effect's row is rolled back, and the new owner's claim stands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_transaction_whose_claim_was_lost_rolls_the_effect_back() {
    use tower_idempotency::{Begin, ClaimCommitError, Coordinator, IdempotencyKey, RecordKey, Store};
    let store = shared_store().await;
    let coordinator = Coordinator::new(store.clone());
    let key = RecordKey::new(None, IdempotencyKey::parse("ct-lost").unwrap());
    let (_first, transaction, rows) = effect_in_a_claim_transaction(&store, &coordinator, &key).await;
    assert!(
        store.purge(&key).await.unwrap(),
        "purged while its effect is written"
    );
    let Begin::Claimed(second) = coordinator.begin(&key, &ct_fingerprint()).await.unwrap() else {
        panic!("the purged key is claimed again");
    };
    let refused = transaction.commit(Bytes::from_static(b"too late")).await;
    assert!(matches!(refused, Err(ClaimCommitError::ClaimLost)), "{refused:?}");
    assert_eq!(
        refused.unwrap_err().to_string(),
        "the claim was lost before the commit"
    );
    assert_eq!(
        count(store.pool(), &rows).await,
        0,
        "the lost claim's row was rolled back"
    );
    second
        .complete(Bytes::from_static(b"the new owner's"))
        .await
        .unwrap();
    match coordinator.begin(&key, &ct_fingerprint()).await.unwrap() {
        Begin::Completed(stored) => assert_eq!(stored, "the new owner's"),
        other => panic!("{other:?}"),
    }
}

/// Runs `test` on a current-thread runtime, every task on it, and returns the warnings logged.
fn warnings_during(test: impl std::future::Future<Output = ()>) -> Vec<String> {
    use tracing_subscriber::layer::SubscriberExt;
    struct Capture(Arc<Mutex<Vec<String>>>);
    impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Capture {
        fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
            if *event.metadata().level() <= tracing::Level::WARN {
                self.0.lock().unwrap().push(common::event_message(event));
            }
        }
    }
    let warnings = Arc::new(Mutex::new(Vec::new()));
    let subscriber = tracing_subscriber::registry().with(Capture(warnings.clone()));
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    tracing::subscriber::with_default(subscriber, || runtime.block_on(test));
    let logged = warnings.lock().unwrap().clone();
    logged
}

/// The lease is renewed while the handler's transaction holds the record's row: a renewal waits
/// for the commit and then finds the record completed, which is not a lost claim (the handler
/// goes on after its commit here, so the renewal's answer arrives while it runs). Retries
/// meanwhile get 409 at once (the claim reads the row without waiting for its lock).
#[test]
fn a_transaction_open_across_renewals_is_not_taken_for_a_lost_claim() {
    let warnings = warnings_during(async {
        // Renewals every second: the one at 1 s waits on the row lock until the commit at 2 s.
        // The lease (3 s) outlasts the lock, so a slow machine cannot let it lapse first.
        let orders = orders(shared_store().await, Duration::from_secs(3)).await;
        let running = tokio::spawn({
            let router = orders.router.clone();
            async move { send(&router, order("t-long", &[("x-ending", "commit-after-2000")])).await }
        });
        tokio::time::sleep(Duration::from_millis(200)).await;
        let started = Instant::now();
        let busy = orders.post("t-long", &[]).await;
        assert_eq!(busy.status, StatusCode::CONFLICT);
        // Held up by the lock, it would wait until the commit, about 1.8 s.
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "not held up by the row lock"
        );
        let first = running.await.unwrap();
        assert_eq!((first.status, first.is_replay()), (StatusCode::CREATED, false));
        let replay = orders.post("t-long", &[]).await;
        assert!(replay.is_replay() && replay.body.ends_with(b"(committed)"));
        let record = orders.layer.inspect(None, "t-long").await.unwrap().unwrap();
        assert_eq!(record.state, RecordState::Completed);
        assert_eq!(orders.rows().await, 1);
    });
    assert!(
        warnings.iter().all(|w| !w.contains("lost")),
        "no claim reported lost: {warnings:?}"
    );
}

// --- With a real process, killed ---

struct Example {
    child: Child,
    addr: SocketAddr,
}

impl Drop for Example {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Example {
    fn start(database_url: &str, lease_ms: u64) -> Self {
        // Tests run from target/<profile>/deps; cargo builds examples into target/<profile>/examples.
        let exe = std::env::current_exe().expect("test executable path");
        let binary: PathBuf = exe
            .parent()
            .and_then(|deps| deps.parent())
            .expect("target dir")
            .join("examples")
            .join("postgres_transactional");
        assert!(
            binary.exists(),
            "{} is missing: run the whole suite (cargo test --all-features builds examples)",
            binary.display()
        );
        let mut child = Command::new(binary)
            .env("ADDR", "127.0.0.1:0")
            .env("DATABASE_URL", database_url)
            .env("LEASE_MS", lease_ms.to_string())
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start the postgres_transactional example");
        let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
        let store_line = lines.next().expect("a store line").expect("utf-8");
        assert!(store_line.contains("PostgreSQL"), "{store_line}");
        let listening = lines.next().expect("a listening line").expect("utf-8");
        let addr = listening
            .trim_start_matches("listening on http://")
            .parse()
            .expect("an address");
        Self { child, addr }
    }

    /// `kill -9`: no shutdown, no rollback sent, nothing flushed.
    fn kill(mut self) {
        let status = Command::new("kill")
            .args(["-KILL", &self.child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success());
        let _ = self.child.wait();
    }
}

struct Reply {
    status: StatusCode,
    replayed: bool,
    json: serde_json::Value,
}

async fn call(addr: SocketAddr, key: &str, body: &str) -> Reply {
    use http_body_util::{BodyExt, Full};
    let stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .unwrap();
    tokio::spawn(connection);
    let request = Request::post("/orders")
        .header("content-type", "application/json")
        .header("idempotency-key", key)
        .body(Full::new(Bytes::from(body.to_owned())))
        .unwrap();
    let response = sender.send_request(request).await.expect("an answer");
    let (parts, body) = response.into_parts();
    let bytes = body.collect().await.unwrap().to_bytes();
    Reply {
        status: parts.status,
        replayed: parts
            .headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true"),
        json: serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null),
    }
}

async fn count(pool: &sqlx::PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

/// Waits until `sql` counts `expected`.
async fn until(pool: &sqlx::PgPool, sql: &str, expected: i64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while count(pool, sql).await != expected {
        assert!(Instant::now() < deadline, "{sql} never counted {expected}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

const ORDERS: &str = "SELECT count(*) FROM orders";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_after_the_commit_the_retry_replays_and_there_is_one_order() {
    let server = tokio::task::spawn_blocking(PgServer::start).await.unwrap();
    let db = sqlx::PgPool::connect(&server.url()).await.unwrap();
    let example = Example::start(&server.url(), 30_000);
    let addr = example.addr;
    let first = tokio::spawn(async move {
        call(
            addr,
            "k-after",
            r#"{"amount": 5, "pause_after_commit_ms": 60000}"#,
        )
        .await
    });
    until(&db, ORDERS, 1).await;
    example.kill();
    // The first client never gets its answer: its connection dies with the process.
    let _ = first.await;
    let restarted = Example::start(&server.url(), 30_000);
    let retry = call(
        restarted.addr,
        "k-after",
        r#"{"amount": 5, "pause_after_commit_ms": 60000}"#,
    )
    .await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(
        retry.replayed,
        "the response committed with the order is replayed"
    );
    let id: i64 = sqlx::query_scalar("SELECT id FROM orders")
        .fetch_one(&db)
        .await
        .unwrap();
    assert_eq!(retry.json["id"], id, "the order that was committed");
    assert_eq!(count(&db, ORDERS).await, 1, "one order");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_before_the_commit_the_key_runs_again_after_its_lease_and_there_is_one_order() {
    let server = tokio::task::spawn_blocking(PgServer::start).await.unwrap();
    let db = sqlx::PgPool::connect(&server.url()).await.unwrap();
    let lease_ms = 1500;
    let example = Example::start(&server.url(), lease_ms);
    let addr = example.addr;
    let body = r#"{"amount": 7, "pause_before_commit_ms": 60000}"#;
    let first = tokio::spawn(async move { call(addr, "k-before", body).await });
    // The order and the response are written, uncommitted: the transaction waits to commit.
    until(
        &db,
        "SELECT count(*) FROM pg_stat_activity
          WHERE application_name = 'tower-idempotency' AND state = 'idle in transaction'",
        1,
    )
    .await;
    let killed_at = Instant::now();
    example.kill();
    let _ = first.await;
    // The server sees the connection go and rolls the transaction back: no order, while the
    // claim, committed up front, holds the key until its lease ends.
    until(
        &db,
        "SELECT count(*) FROM pg_stat_activity WHERE state = 'idle in transaction'",
        0,
    )
    .await;
    assert_eq!(
        count(&db, ORDERS).await,
        0,
        "the order rolled back with the response"
    );
    let restarted = Example::start(&server.url(), lease_ms);
    let plain = r#"{"amount": 7}"#;
    let early = call(restarted.addr, "k-before", plain).await;
    // The lease was last renewed at most a third of it before the kill.
    let lease_left_at_least = Duration::from_millis(lease_ms * 2 / 3 - 100);
    if killed_at.elapsed() < lease_left_at_least - Duration::from_millis(100) {
        assert_eq!(
            early.status,
            StatusCode::CONFLICT,
            "the dead claim holds the key until its lease ends"
        );
    }
    // The first answer that is not a 409 is the key's run again: `early` itself where the lease
    // had already ended (a loaded machine takes a while to restart the example).
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut fresh = early;
    while fresh.status == StatusCode::CONFLICT {
        assert!(Instant::now() < deadline, "the key stayed blocked past its lease");
        tokio::time::sleep(Duration::from_millis(100)).await;
        fresh = call(restarted.addr, "k-before", plain).await;
    }
    assert_eq!(fresh.status, StatusCode::CREATED);
    assert!(!fresh.replayed, "nothing was stored: the key ran again");
    assert!(
        killed_at.elapsed() >= lease_left_at_least,
        "not before the lease ended"
    );
    assert_eq!(count(&db, ORDERS).await, 1, "one order");
    let replay = call(restarted.addr, "k-before", plain).await;
    assert!(replay.replayed);
    assert_eq!(replay.json, fresh.json);
}
