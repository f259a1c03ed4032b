//! What the layer tells an operator about itself, without flooding the logs: an unscoped layer
//! whose requests carry credentials warns once (a replay is answered before the handler
//! authenticates), a store outage is logged once per interval rather than once per request, and
//! no log line carries a raw key or scope.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use axum::body::Body;
use bytes::Bytes;
use common::app::{payment, payment_with, router, send};
use http::StatusCode;
use tower_idempotency::{
    ClaimOutcome, Fingerprint, IdempotencyKey, IdempotencyLayer, MemoryStore, OwnerToken, RecordInfo,
    RecordKey, Scope, Store, StoreError, StoreFuture,
};
use tracing_subscriber::layer::{Context, SubscriberExt};

/// Every event logged, as its fields (`message` included), in order.
type Events = Arc<Mutex<Vec<HashMap<String, String>>>>;

struct Capture(Events);

struct Fields(HashMap<String, String>);

impl tracing::field::Visit for Fields {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        self.0.insert(field.name().to_owned(), format!("{value:?}"));
    }
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }
    fn record_u64(&mut self, field: &tracing::field::Field, value: u64) {
        self.0.insert(field.name().to_owned(), value.to_string());
    }
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Capture {
    fn on_event(&self, event: &tracing::Event<'_>, _: Context<'_, S>) {
        let mut fields = Fields(HashMap::new());
        event.record(&mut fields);
        fields
            .0
            .insert("level".to_owned(), event.metadata().level().to_string());
        self.0.lock().unwrap().push(fields.0);
    }
}

/// The subscriber and the metrics recorder are global to this binary: its tests take turns, and
/// each looks only at what was logged and counted during its turn.
static TURN: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

struct Observed {
    events: Events,
    snapshotter: metrics_util::debugging::Snapshotter,
}

fn observed() -> &'static Observed {
    static OBSERVED: OnceLock<Observed> = OnceLock::new();
    OBSERVED.get_or_init(|| {
        let events = Events::default();
        let subscriber = tracing_subscriber::registry().with(Capture(events.clone()));
        tracing::subscriber::set_global_default(subscriber).expect("the only subscriber");
        let recorder = metrics_util::debugging::DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        recorder.install().expect("the only recorder of this binary");
        Observed { events, snapshotter }
    })
}

/// Takes this test's turn and forgets what earlier tests logged and counted.
async fn turn() -> tokio::sync::MutexGuard<'static, ()> {
    let guard = TURN.lock().await;
    let observed = observed();
    observed.events.lock().unwrap().clear();
    observed.snapshotter.snapshot();
    guard
}

/// The events logged since the turn began whose message contains `needle`.
fn logged(needle: &str) -> Vec<HashMap<String, String>> {
    let events = observed().events.lock().unwrap();
    events
        .iter()
        .filter(|fields| fields.get("message").is_some_and(|m| m.contains(needle)))
        .cloned()
        .collect()
}

/// How much the counter `name` with label `kind=value` grew since the last look.
fn counted(name: &str, kind: &str) -> u64 {
    use metrics_util::debugging::DebugValue;
    observed()
        .snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .filter(|(key, ..)| {
            key.key().name() == name && key.key().labels().any(|l| l.key() == "kind" && l.value() == kind)
        })
        .map(|(.., value)| match value {
            DebugValue::Counter(n) => n,
            _ => 0,
        })
        .sum()
}

const CREDENTIALS_WARNING: &str = "without a scope sees requests with credentials";
const SETUP_WARNINGS: &str = "idempotency_setup_warnings_total";

fn with_header(key: &str, name: &str, value: &str) -> http::Request<Body> {
    payment_with(key, &[(name, value)])
}

#[tokio::test]
async fn an_unscoped_layer_that_sees_credentials_warns_once_and_counts_it() {
    let _turn = turn().await;
    let layer = IdempotencyLayer::new(MemoryStore::new());
    let (app, _) = router(layer.clone());
    // Nothing to say while requests carry no credentials.
    send(&app, payment("plain", "{}")).await;
    assert!(logged(CREDENTIALS_WARNING).is_empty());
    for n in 0..20 {
        let header = if n % 2 == 0 { "authorization" } else { "cookie" };
        let answer = send(&app, with_header(&format!("k{n}"), header, "Bearer alice")).await;
        assert_eq!(
            answer.status,
            StatusCode::CREATED,
            "the request itself is served as before"
        );
    }
    let warnings = logged(CREDENTIALS_WARNING);
    assert_eq!(warnings.len(), 1, "once per layer, not per request: {warnings:?}");
    assert_eq!(warnings[0]["header"], "authorization");
    assert_eq!(warnings[0]["path"], "/payments");
    assert!(
        !format!("{warnings:?}").contains("alice"),
        "never the credentials themselves"
    );
    assert_eq!(counted(SETUP_WARNINGS, "unscoped_credentials"), 1);

    // A clone shares the layer's warning; a reconfigured layer is another layer, and warns on its own.
    let (clone, _) = router(layer.clone());
    send(&clone, with_header("c1", "authorization", "Bearer bob")).await;
    assert_eq!(logged(CREDENTIALS_WARNING).len(), 1);
    let (other, _) = router(
        layer
            .with_retention(Duration::from_secs(60))
            .with_key_required(false),
    );
    send(&other, with_header("o1", "cookie", "session=bob")).await;
    send(&other, with_header("o2", "cookie", "session=bob")).await;
    assert_eq!(logged(CREDENTIALS_WARNING).len(), 2);
    assert_eq!(counted(SETUP_WARNINGS, "unscoped_credentials"), 1);
}

/// A named layer labels its setup warning with its name, as every metric it records (issue 38).
#[tokio::test]
async fn a_named_layer_counts_its_setup_warning_under_its_name() {
    use metrics_util::debugging::DebugValue;
    let _turn = turn().await;
    let (app, _) = router(IdempotencyLayer::new(MemoryStore::new()).with_name("payments"));
    send(&app, with_header("n1", "authorization", "Bearer alice")).await;
    let named: Vec<_> = observed()
        .snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .filter(|(key, ..)| key.key().name() == SETUP_WARNINGS)
        .map(|(key, .., value)| {
            let labels: Vec<_> = key
                .key()
                .labels()
                .map(|l| (l.key().to_owned(), l.value().to_owned()))
                .collect();
            (labels, matches!(value, DebugValue::Counter(1)))
        })
        .collect();
    assert_eq!(
        named,
        [(
            vec![
                ("kind".to_owned(), "unscoped_credentials".to_owned()),
                ("name".to_owned(), "payments".to_owned())
            ],
            true
        )],
        "one warning, labelled with the layer's name"
    );
}

#[tokio::test]
async fn a_scoped_or_declared_unscoped_layer_never_warns_of_credentials() {
    let _turn = turn().await;
    let scoped = IdempotencyLayer::new(MemoryStore::new()).with_scope(Scope::header("x-tenant-id"));
    let declared = IdempotencyLayer::new(MemoryStore::new()).without_scope();
    let rescoped = IdempotencyLayer::new(MemoryStore::new())
        .without_scope()
        .with_scope(Scope::host());
    for layer in [scoped, declared, rescoped] {
        let (app, _) = router(layer);
        for n in 0..3 {
            let request = payment_with(
                &format!("k{n}"),
                &[
                    ("authorization", "Bearer alice"),
                    ("x-tenant-id", "t1"),
                    ("host", "a.example"),
                ],
            );
            assert_eq!(send(&app, request).await.status, StatusCode::CREATED);
        }
    }
    assert!(logged(CREDENTIALS_WARNING).is_empty());
    assert_eq!(counted(SETUP_WARNINGS, "unscoped_credentials"), 0);
}

/// What the warning is about: with no scope, a replay goes to whoever reproduces the key and the
/// body, credentials or none, because it is answered before the handler could check them.
#[tokio::test]
async fn without_a_scope_a_replay_goes_to_whoever_sends_the_same_key_and_body() {
    let _turn = turn().await;
    let (app, runs) = router(IdempotencyLayer::new(MemoryStore::new()));
    let alice = send(&app, with_header("order-1", "authorization", "Bearer alice")).await;
    let mallory = send(&app, with_header("order-1", "authorization", "Bearer mallory")).await;
    assert_eq!(runs.get(), 1);
    assert!(mallory.is_replay());
    assert_eq!(mallory.body, alice.body);
    // Scoped by who is calling, the same key names two records.
    let scoped = IdempotencyLayer::new(MemoryStore::new()).with_scope(Scope::header("authorization"));
    let (app, runs) = router(scoped);
    send(&app, with_header("order-1", "authorization", "Bearer alice")).await;
    let mallory = send(&app, with_header("order-1", "authorization", "Bearer mallory")).await;
    assert_eq!(runs.get(), 2);
    assert!(!mallory.is_replay());
}

/// A store that is down: every call fails at once.
struct DownStore;

fn down<'a, T: Send + 'a>() -> StoreFuture<'a, T> {
    Box::pin(std::future::ready(Err(StoreError::Unavailable(
        "the store is down".into(),
    ))))
}

impl Store for DownStore {
    fn claim<'a>(
        &'a self,
        _: &'a RecordKey,
        _: &'a Fingerprint,
        _: &'a OwnerToken,
        _: Duration,
    ) -> StoreFuture<'a, ClaimOutcome> {
        down()
    }
    fn complete<'a>(
        &'a self,
        _: &'a RecordKey,
        _: &'a OwnerToken,
        _: Bytes,
        _: Duration,
    ) -> StoreFuture<'a, bool> {
        down()
    }
    fn release<'a>(&'a self, _: &'a RecordKey, _: &'a OwnerToken) -> StoreFuture<'a, bool> {
        down()
    }
    fn renew<'a>(&'a self, _: &'a RecordKey, _: &'a OwnerToken, _: Duration) -> StoreFuture<'a, bool> {
        down()
    }
    fn inspect<'a>(&'a self, _: &'a RecordKey) -> StoreFuture<'a, Option<RecordInfo>> {
        down()
    }
    fn purge<'a>(&'a self, _: &'a RecordKey) -> StoreFuture<'a, bool> {
        down()
    }
}

const OUTAGE: &str = "idempotency store unavailable";

#[tokio::test(start_paused = true)]
async fn a_store_outage_is_logged_once_per_interval_with_the_count_held_back() {
    let _turn = turn().await;
    for fail_open in [false, true] {
        observed().events.lock().unwrap().clear();
        let layer = IdempotencyLayer::new(DownStore).with_fail_open(fail_open);
        let (app, runs) = router(layer);
        for n in 0..30 {
            send(&app, payment(&format!("k{n}"), "{}")).await;
        }
        assert_eq!(runs.get(), if fail_open { 30 } else { 0 });
        let logs = logged(OUTAGE);
        assert_eq!(logs.len(), 1, "one warning for 30 failed requests: {logs:?}");
        assert_eq!(logs[0]["held_back"], "0");
        tokio::time::advance(Duration::from_secs(9)).await;
        send(&app, payment("k-9s", "{}")).await;
        assert_eq!(logged(OUTAGE).len(), 1, "still within the interval");
        tokio::time::advance(Duration::from_millis(1_001)).await;
        send(&app, payment("k-10s", "{}")).await;
        let logs = logged(OUTAGE);
        assert_eq!(logs.len(), 2, "the next interval logs again: {logs:?}");
        assert_eq!(logs[1]["held_back"], "30", "with how many it held back");
    }
}

/// README, Behaviour row 13: the outage warning is logged "once per 10 s per layer": a second
/// layer's outage is not held back by the first layer's warning.
#[tokio::test(start_paused = true)]
async fn each_layer_logs_its_own_store_outage() {
    let _turn = turn().await;
    let (first, _) = router(IdempotencyLayer::new(DownStore));
    let (second, _) = router(IdempotencyLayer::new(DownStore));
    for n in 0..3 {
        send(&first, payment(&format!("a{n}"), "{}")).await;
        send(&second, payment(&format!("b{n}"), "{}")).await;
    }
    let logs = logged(OUTAGE);
    assert_eq!(logs.len(), 2, "one warning per layer: {logs:?}");
}

#[tokio::test]
async fn logs_name_a_key_by_its_digest_never_the_raw_key_or_scope() {
    let _turn = turn().await;
    let key = RecordKey::new(
        Some("tenant-acme"),
        IdempotencyKey::parse("order-secret-42").unwrap(),
    );
    let debug = format!("{key:?}");
    assert!(!debug.contains("acme") && !debug.contains("secret"), "{debug}");
    assert!(
        debug.contains(&key.digest_hex()[..16]),
        "the digest prefix the span shows: {debug}"
    );
    // And in a real log line: the outage warning names the request's key.
    let layer = IdempotencyLayer::new(DownStore).with_scope(Scope::header("x-tenant-id"));
    let (app, _) = router(layer);
    send(
        &app,
        payment_with("order-secret-42", &[("x-tenant-id", "tenant-acme")]),
    )
    .await;
    let logs = logged(OUTAGE);
    assert_eq!(logs.len(), 1);
    let line = format!("{logs:?}");
    assert!(!line.contains("acme") && !line.contains("secret"), "{line}");
    assert!(line.contains(&key.digest_hex()[..16]), "{line}");
}

/// The events logged since the turn began at `level` whose message contains `needle`.
fn logged_at(level: tracing::Level, needle: &str) -> Vec<HashMap<String, String>> {
    let level = level.to_string();
    logged(needle)
        .into_iter()
        .filter(|fields| fields["level"] == level)
        .collect()
}

/// README, Behaviour row 12: a response over the storage cap, or one whose body fails part way,
/// is kept as not replayable (or released) and "a warning is logged": one per such response,
/// naming the key (by digest) and why.
#[tokio::test]
async fn a_response_not_stored_is_warned_about_once_with_why() {
    let _turn = turn().await;
    const NOT_STORED: &str = "response not stored";
    let layer = IdempotencyLayer::new(MemoryStore::new()).with_response_limit(100);
    let (app, _) = router(layer.clone());
    let key = RecordKey::new(None, IdempotencyKey::parse("too-large").unwrap());
    send(&app, payment_with("too-large", &[("x-body-size", "1000")])).await;
    let warnings = logged_at(tracing::Level::WARN, NOT_STORED);
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(
        warnings[0]["message"].contains("kept as not replayable"),
        "{warnings:?}"
    );
    assert!(
        warnings[0]["key"].contains(&key.digest_hex()[..16]),
        "{warnings:?}"
    );
    assert!(!warnings[0]["why"].is_empty());
    let failing = payment_with("body-fails", &[("x-stream", "2,0,fail")]);
    let response = tower::ServiceExt::oneshot(app.clone(), failing).await.unwrap();
    assert!(http_body_util::BodyExt::collect(response.into_body())
        .await
        .is_err());
    let warnings = logged_at(tracing::Level::WARN, NOT_STORED);
    assert_eq!(warnings.len(), 2, "{warnings:?}");
    assert_ne!(warnings[0]["why"], warnings[1]["why"], "each says why");
    // Released instead: the warning says so.
    let (app, _) = router(layer.with_release_not_stored(true));
    send(
        &app,
        payment_with("too-large-released", &[("x-body-size", "1000")]),
    )
    .await;
    let warnings = logged_at(tracing::Level::WARN, NOT_STORED);
    assert_eq!(warnings.len(), 3, "{warnings:?}");
    assert!(warnings[2]["message"].contains("released"), "{warnings:?}");
    // A response that is stored is not warned about.
    let (app, _) = router(IdempotencyLayer::new(MemoryStore::new()));
    send(&app, payment("stored", "{}")).await;
    assert_eq!(logged_at(tracing::Level::WARN, NOT_STORED).len(), 3);
}

/// docs/guarantees.md, promise 6: a completion whose first attempt fails is carried on in the
/// background until the lease ends; "if it never lands, the client still has its response and
/// an error is logged", once, naming the key (and, per "Where the guarantees end", that a retry
/// after the lease runs again). The first failure is a warning only: it may still land.
#[tokio::test]
async fn a_completion_that_fails_every_attempt_logs_one_error() {
    let _turn = turn().await;
    let down = Arc::new(
        common::FaultyStore::new(Arc::new(MemoryStore::new())).with_failing_completions(1000, Duration::ZERO),
    );
    let (app, _) = router(IdempotencyLayer::new(down.clone()).with_lease(Duration::from_millis(300)));
    let answer = send(&app, payment("unstored", "{}")).await;
    assert_eq!(
        answer.status,
        StatusCode::CREATED,
        "the client still gets its response"
    );
    assert!(logged_at(tracing::Level::ERROR, "could not store the result").is_empty());
    assert_eq!(
        logged_at(tracing::Level::WARN, "could not store the result at once").len(),
        1
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let errors = loop {
        let errors = logged_at(tracing::Level::ERROR, "could not store the result");
        if !errors.is_empty() || std::time::Instant::now() > deadline {
            break errors;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert!(down.completions() > 3, "tried until the lease ended");
    assert_eq!(errors.len(), 1, "one error for all the attempts: {errors:?}");
    let key = RecordKey::new(None, IdempotencyKey::parse("unstored").unwrap());
    assert!(errors[0]["key"].contains(&key.digest_hex()[..16]), "{errors:?}");
    assert!(
        errors[0]["message"].contains("run the operation again"),
        "{errors:?}"
    );
    assert!(errors[0]["error"].contains("injected"), "{errors:?}");
}

/// docs/guarantees.md, promise 4: "If a renewal finds the claim lost, the completion is refused
/// (fenced) and a warning is logged".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_claim_is_warned_about() {
    let _turn = turn().await;
    let layer = IdempotencyLayer::new(MemoryStore::new()).with_lease(Duration::from_millis(300));
    let (app, runs) = router(layer.clone());
    let running = common::app::spawn_send(&app, payment_with("lost", &[("x-delay-ms", "500")]));
    common::until("the handler runs", || runs.get() == 1).await;
    assert!(layer.purge(None, "lost").await.unwrap());
    assert_eq!(running.await.unwrap().status, StatusCode::CREATED);
    let warnings = logged_at(tracing::Level::WARN, "claim lost");
    assert!(!warnings.is_empty(), "a warning is logged");
    let key = RecordKey::new(None, IdempotencyKey::parse("lost").unwrap());
    assert!(
        warnings
            .iter()
            .all(|w| w["key"].contains(&key.digest_hex()[..16])),
        "{warnings:?}"
    );
    assert!(
        layer.inspect(None, "lost").await.unwrap().is_none(),
        "fenced: nothing was written"
    );
}

/// README, Behaviour: "the stored record is unreadable [...] | 500 problem+json
/// `UnreadableRecord`, an error logged"; docs/guarantees.md, promise 11.
#[tokio::test]
async fn an_unreadable_record_logs_an_error() {
    let _turn = turn().await;
    let store = MemoryStore::new();
    let key = RecordKey::new(None, IdempotencyKey::parse("garbled").unwrap());
    let owner = OwnerToken::generate();
    let fingerprint = Fingerprint::new([b"POST".as_slice(), b"", b"/payments", b"application/json", b"{}"]);
    store
        .claim(&key, &fingerprint, &owner, Duration::from_secs(30))
        .await
        .unwrap();
    let garbage = Bytes::from_static(b"\x00\x01 not a stored response");
    assert!(store
        .complete(&key, &owner, garbage, Duration::from_secs(60))
        .await
        .unwrap());
    let (app, runs) = router(IdempotencyLayer::new(store));
    let answer = send(&app, payment("garbled", "{}")).await;
    assert_eq!(answer.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(runs.get(), 0);
    let errors = logged_at(tracing::Level::ERROR, "unreadable");
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(errors[0]["key"].contains(&key.digest_hex()[..16]), "{errors:?}");
}

/// docs/guarantees.md, the reconciliation hook: "A panic in it is caught and logged."
#[tokio::test]
async fn a_panicking_reconciliation_hook_is_logged() {
    let _turn = turn().await;
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .with_response_limit(8)
        .with_reconciliation(|_| panic!("the journal is down"));
    let (app, _) = router(layer);
    let answer = send(&app, payment_with("panicky", &[("x-body-size", "100")])).await;
    assert_eq!(answer.status, StatusCode::CREATED);
    let errors = logged_at(tracing::Level::ERROR, "reconciliation hook panicked");
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(errors[0]["kind"].contains("NotStorable"), "{errors:?}");
}

/// docs/guarantees.md, "Where the guarantees end": at its bound the memory store evicts
/// completed records early, and "the first such eviction is logged once per store, naming how
/// long records are really kept, and `MemoryStore::evicted_early()` counts them all".
#[tokio::test]
async fn the_memory_stores_first_early_eviction_is_logged_once_per_store() {
    let _turn = turn().await;
    const EVICTING: &str = "memory store full";
    for round in 0..2 {
        let store = MemoryStore::new().with_max_entries(1);
        let (app, _) = router(IdempotencyLayer::new(store.clone()));
        for n in 0..4 {
            send(&app, payment(&format!("evicted-{n}"), "{}")).await;
        }
        assert_eq!(store.evicted_early(), 3, "every eviction is counted");
        let warnings = logged_at(tracing::Level::WARN, EVICTING);
        assert_eq!(warnings.len(), round + 1, "once per store: {warnings:?}");
        assert!(
            warnings[round]["message"].contains("with_max_entries"),
            "{warnings:?}"
        );
        assert!(warnings[round].contains_key("kept_secs"), "{warnings:?}");
    }
}

/// docs/guarantees.md, "Rolling back": a record of a newer release past its 15 minutes is
/// answered 500 `UnreadableRecord` "with an error log naming the layout and the key's digest"
/// (README, Behaviour: "500 `UnreadableRecord` and an error logged"); within them, no error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_newer_release_record_past_its_window_logs_an_error_naming_the_layout() {
    use fred::interfaces::KeysInterface;
    let _turn = turn().await;
    let server = common::RedisServer::start();
    let client = common::client(&server.url()).await;
    let store = tower_idempotency::RedisStore::new(client.clone());
    let (app, runs) = router(IdempotencyLayer::new(store.clone()));
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    for (key, claimed_ms_ago) in [("newer-recent", 60_000), ("newer-rolled-back", 16 * 60_000)] {
        let owner = format!("n-1@{}", now_ms - claimed_ms_ago);
        // Layout 4's first bytes: `TIR`, the version, the owner's length and the owner.
        let mut record = b"TIR\x04".to_vec();
        record.extend_from_slice(&(owner.len() as u16).to_be_bytes());
        record.extend_from_slice(owner.as_bytes());
        record.extend_from_slice(b"C and whatever layout 4 holds");
        let record_key = RecordKey::new(None, IdempotencyKey::parse(key).unwrap());
        let _: () = client
            .set(
                store.redis_key(&record_key),
                record,
                Some(fred::types::Expiration::EX(3600)),
                None,
                false,
            )
            .await
            .unwrap();
        send(&app, payment(key, "{}")).await;
    }
    assert_eq!(runs.get(), 0);
    let errors = logged_at(tracing::Level::ERROR, "unreadable");
    assert_eq!(errors.len(), 1, "only the record past its window: {errors:?}");
    let digest = RecordKey::new(None, IdempotencyKey::parse("newer-rolled-back").unwrap()).digest_hex();
    assert!(errors[0]["key"].contains(&digest[..16]), "{errors:?}");
    assert!(errors[0]["reason"].contains("layout version 4"), "{errors:?}");
}

// Settings that can only hurt are refused when the layer is configured.

#[test]
#[should_panic(expected = "with_mismatch_status: status 200 cannot answer a refused request")]
fn a_mismatch_status_that_reads_as_success_is_refused() {
    let _ = IdempotencyLayer::new(MemoryStore::new()).with_mismatch_status(StatusCode::OK);
}

#[test]
#[should_panic(expected = "with_not_stored_status: status 302 cannot answer a refused request")]
fn a_not_stored_status_that_reads_as_a_redirect_is_refused() {
    let _ = IdempotencyLayer::new(MemoryStore::new()).with_not_stored_status(StatusCode::FOUND);
}

#[test]
#[should_panic(expected = "with_handler_timeout: a handler timeout of 50ms is under 100ms")]
fn a_handler_timeout_under_100_ms_is_refused() {
    let _ = IdempotencyLayer::new(MemoryStore::new()).with_handler_timeout(Duration::from_millis(50));
}

#[test]
#[should_panic(expected = "the list leaves out Set-Cookie")]
fn an_unstored_header_list_that_drops_set_cookie_is_refused() {
    let _ = IdempotencyLayer::new(MemoryStore::new())
        .with_unstored_headers([http::HeaderName::from_static("x-multi")]);
}

#[test]
fn settings_at_their_bounds_are_taken() {
    let _ = IdempotencyLayer::new(MemoryStore::new())
        .with_mismatch_status(StatusCode::UNPROCESSABLE_ENTITY)
        .with_not_stored_status(StatusCode::SERVICE_UNAVAILABLE)
        .with_handler_timeout(Duration::from_millis(100))
        .with_handler_timeout(Duration::MAX)
        .with_unstored_headers([http::header::SET_COOKIE]);
}

/// A header added to the unstored list after an incident (a leaked token in a stored response)
/// stops being replayed at once, from records stored before the change too.
#[tokio::test]
async fn the_unstored_header_list_applies_to_replays_of_records_stored_before() {
    let store = Arc::new(MemoryStore::new());
    let (before, runs) = router(IdempotencyLayer::new(store.clone()));
    let first = send(&before, payment("incident-1", "{}")).await;
    assert_eq!(first.headers.get_all("x-multi").iter().count(), 2);
    let replay = send(&before, payment("incident-1", "{}")).await;
    assert!(replay.is_replay() && replay.headers.get("x-multi").is_some());

    let after =
        IdempotencyLayer::new(store).with_extra_unstored_headers([http::HeaderName::from_static("x-multi")]);
    let (after, _) = router(after);
    let replay = send(&after, payment("incident-1", "{}")).await;
    assert!(replay.is_replay());
    assert_eq!(runs.get(), 1);
    assert!(replay.headers.get("x-multi").is_none(), "no longer replayed");
    assert_eq!(
        replay.headers["x-latin1"].as_bytes(),
        b"caf\xe9",
        "the others still are"
    );
    assert_eq!(replay.body, first.body);
}

/// A policy file's `scope: none` is a declared choice, as `without_scope`; an endpoint that
/// leaves the scope out is not.
#[cfg(feature = "policy")]
#[tokio::test]
async fn a_policy_files_scope_none_is_declared_and_silences_the_warning() {
    use axum::routing::post;
    use tower_idempotency::{Policy, PolicyLayer};

    let _turn = turn().await;
    let policy = Policy::from_json_str(
        r#"{"idempotency": {"endpoints": [
            {"path": "/declared", "scope": "none"},
            {"path": "/undeclared"}
        ]}}"#,
    )
    .unwrap();
    let layer = PolicyLayer::from_policy(IdempotencyLayer::new(MemoryStore::new()), &policy).unwrap();
    let app = axum::Router::new()
        .route("/declared", post(|| async { "ok" }))
        .route("/undeclared", post(|| async { "ok" }))
        .layer(layer);
    let request = |path: &str, key: &str| {
        http::Request::post(path)
            .header("idempotency-key", key)
            .header("authorization", "Bearer alice")
            .body(Body::empty())
            .unwrap()
    };
    send(&app, request("/declared", "d1")).await;
    assert!(logged(CREDENTIALS_WARNING).is_empty());
    send(&app, request("/undeclared", "u1")).await;
    let warnings = logged(CREDENTIALS_WARNING);
    assert_eq!(warnings.len(), 1);
    assert_eq!(warnings[0]["path"], "/undeclared");
}
