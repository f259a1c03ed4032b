//! The metrics (crate feature `metrics`) through a real recorder installed for this test binary:
//! each outcome of a keyed request moves exactly the counters it should, with the labels it
//! should, on the memory store and on a real Redis; store calls are timed per operation; the
//! running gauge follows a request that runs. Queue consumers on the `Coordinator` are counted
//! too.
#![cfg(feature = "metrics")]

mod common;

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use axum::body::Body;
use common::app::{payment, payment_with, post, router, send, spawn_send};
use common::{client, RedisServer};
use fred::interfaces::KeysInterface;
use http::StatusCode;
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use metrics_util::MetricKind;
use tower_idempotency::{
    Begin, Coordinator, Fingerprint, IdempotencyKey, IdempotencyLayer, MemoryStore, PolicyLayer, RecordKey,
    RedisStore, ReplicaAcks, Store,
};

/// The recorder is global; the tests of this binary take turns with it.
static TURN: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn snapshotter() -> &'static Snapshotter {
    static SNAPSHOTTER: OnceLock<Snapshotter> = OnceLock::new();
    SNAPSHOTTER.get_or_init(|| {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        recorder.install().expect("the only recorder of this binary");
        snapshotter
    })
}

/// What was recorded since the last call (the debugging recorder hands counters and gauges over
/// as deltas): `name{label=value}` to a counter's increase or a gauge's change, and, for
/// histograms, to how many values were recorded.
fn recorded() -> BTreeMap<String, f64> {
    let mut recorded = BTreeMap::new();
    for (key, _, _, value) in snapshotter().snapshot().into_vec() {
        let labels: Vec<String> = key
            .key()
            .labels()
            .map(|l| format!("{}={}", l.key(), l.value()))
            .collect();
        let name = format!("{}{{{}}}", key.key().name(), labels.join(","));
        let value = match (key.kind(), value) {
            (MetricKind::Counter, DebugValue::Counter(n)) => n as f64,
            (MetricKind::Gauge, DebugValue::Gauge(g)) => g.into_inner(),
            (MetricKind::Histogram, DebugValue::Histogram(values)) => values.len() as f64,
            _ => continue,
        };
        if value != 0.0 {
            recorded.insert(name, value);
        }
    }
    recorded
}

/// The counters that moved since the last call (requests, rejections, reconciliation events).
fn counted() -> BTreeMap<String, f64> {
    recorded()
        .into_iter()
        .filter(|(name, _)| name.contains("_total{"))
        .collect()
}

fn expect(counts: &[(&str, f64)]) -> BTreeMap<String, f64> {
    counts.iter().map(|(name, n)| (name.to_string(), *n)).collect()
}

const EXECUTED: &str = "idempotency_requests_total{outcome=executed}";

/// The outcomes every store can produce, through the HTTP layer and the coordinator.
async fn common_outcomes(store: Arc<dyn Store>) {
    let layer = IdempotencyLayer::new(store.clone()).with_response_limit(256);
    let (app, _) = router(layer.clone());
    recorded();

    let fresh = send(&app, payment("m-1", "{}")).await;
    assert_eq!(fresh.status, StatusCode::CREATED);
    let after_fresh = recorded();
    assert_eq!(after_fresh.get(EXECUTED), Some(&1.0), "{after_fresh:?}");
    for op in ["claim", "complete"] {
        let timed = format!("idempotency_store_duration_seconds{{op={op}}}");
        assert_eq!(
            after_fresh.get(&timed),
            Some(&1.0),
            "{op} timed once: {after_fresh:?}"
        );
    }
    assert_eq!(
        after_fresh.get("idempotency_running{}"),
        None,
        "up one and down one: {after_fresh:?}"
    );

    assert!(send(&app, payment("m-1", "{}")).await.is_replay());
    assert_eq!(
        counted(),
        expect(&[("idempotency_requests_total{outcome=replayed}", 1.0)])
    );

    let other = send(&app, payment("m-1", r#"{"other":1}"#)).await;
    assert_eq!(other.status, StatusCode::CONFLICT);
    assert_eq!(
        counted(),
        expect(&[
            ("idempotency_requests_total{outcome=mismatch}", 1.0),
            ("idempotency_rejections_total{kind=Mismatch}", 1.0),
        ])
    );

    let slow = spawn_send(&app, payment_with("m-slow", &[("x-delay-ms", "800")]));
    tokio::time::sleep(Duration::from_millis(150)).await;
    let running = recorded();
    assert_eq!(running.get("idempotency_running{}"), Some(&1.0), "{running:?}");
    assert_eq!(running.get(EXECUTED), Some(&1.0), "{running:?}");
    let busy = send(&app, payment_with("m-slow", &[("x-delay-ms", "800")])).await;
    assert_eq!(busy.status, StatusCode::CONFLICT);
    assert_eq!(
        counted(),
        expect(&[
            ("idempotency_requests_total{outcome=in_flight}", 1.0),
            ("idempotency_rejections_total{kind=InFlight}", 1.0),
        ])
    );
    assert_eq!(slow.await.unwrap().status, StatusCode::CREATED);
    assert_eq!(recorded().get("idempotency_running{}"), Some(&-1.0));

    let keyless = send(&app, post(None).body(Body::from("{}")).unwrap()).await;
    assert_eq!(keyless.status, StatusCode::BAD_REQUEST);
    assert_eq!(
        counted(),
        expect(&[
            ("idempotency_requests_total{outcome=rejected}", 1.0),
            ("idempotency_rejections_total{kind=MissingKey}", 1.0),
        ])
    );

    let large = send(&app, payment_with("m-large", &[("x-body-size", "1000")])).await;
    assert_eq!(large.status, StatusCode::CREATED);
    assert_eq!(
        counted(),
        expect(&[
            (EXECUTED, 1.0),
            ("idempotency_reconciliation_events_total{kind=not_storable}", 1.0),
        ])
    );
    let retry = send(&app, payment_with("m-large", &[("x-body-size", "1000")])).await;
    assert_eq!(retry.status, StatusCode::CONFLICT);
    assert_eq!(
        counted(),
        expect(&[
            ("idempotency_requests_total{outcome=not_stored}", 1.0),
            ("idempotency_rejections_total{kind=ResponseNotStored}", 1.0),
        ])
    );

    let bounded = router(layer.clone().with_max_in_flight(1)).0;
    let holder = spawn_send(&bounded, payment_with("m-holder", &[("x-delay-ms", "600")]));
    tokio::time::sleep(Duration::from_millis(100)).await;
    let refused = send(&bounded, payment("m-refused", "{}")).await;
    assert_eq!(refused.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(holder.await.unwrap().status, StatusCode::CREATED);
    assert_eq!(
        counted(),
        expect(&[
            (EXECUTED, 1.0),
            ("idempotency_requests_total{outcome=overloaded}", 1.0),
            ("idempotency_rejections_total{kind=Overloaded}", 1.0),
        ])
    );

    // A queue consumer on the coordinator is counted alike.
    let coordinator = Coordinator::from_shared_store(store);
    let key = RecordKey::new(None, IdempotencyKey::parse("m-job").unwrap());
    let fingerprint = Fingerprint::new([b"job".as_slice()]);
    let Ok(Begin::Claimed(claim)) = coordinator.begin(&key, &fingerprint).await else {
        panic!("a fresh job is claimed");
    };
    assert!(matches!(
        coordinator.begin(&key, &fingerprint).await,
        Ok(Begin::InFlight { .. })
    ));
    claim.complete("done".into()).await.unwrap();
    assert!(matches!(
        coordinator.begin(&key, &fingerprint).await,
        Ok(Begin::Completed(_))
    ));
    let other = Fingerprint::new([b"other".as_slice()]);
    assert!(matches!(
        coordinator.begin(&key, &other).await,
        Ok(Begin::Mismatch)
    ));
    assert_eq!(
        counted(),
        expect(&[
            (EXECUTED, 1.0),
            ("idempotency_requests_total{outcome=in_flight}", 1.0),
            ("idempotency_requests_total{outcome=replayed}", 1.0),
            ("idempotency_requests_total{outcome=mismatch}", 1.0),
        ])
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_outcome_moves_its_counter_on_the_memory_store() {
    let _turn = TURN.lock().await;
    common_outcomes(Arc::new(MemoryStore::new())).await;

    // A store full of running claims fails the claim: closed, then open.
    let full = MemoryStore::new().with_max_entries(1);
    let (closed, _) = router(IdempotencyLayer::new(full.clone()));
    let (open, runs) = router(IdempotencyLayer::new(full).with_fail_open(true));
    let holder = spawn_send(&closed, payment_with("f-holder", &[("x-delay-ms", "600")]));
    tokio::time::sleep(Duration::from_millis(100)).await;
    recorded();
    assert_eq!(send(&closed, payment("f-other", "{}")).await.status, 503);
    assert_eq!(
        counted(),
        expect(&[
            ("idempotency_requests_total{outcome=store_error}", 1.0),
            ("idempotency_rejections_total{kind=StoreUnavailable}", 1.0),
        ])
    );
    assert_eq!(send(&open, payment("f-open", "{}")).await.status, 201);
    assert_eq!(runs.get(), 1, "ran unprotected");
    assert_eq!(
        counted(),
        expect(&[("idempotency_requests_total{outcome=fail_open}", 1.0)])
    );
    holder.await.unwrap();

    // A retry that waits for the request in flight (`Prefer: wait`) is counted as waited,
    // besides the replay it ends with.
    let layer = IdempotencyLayer::new(MemoryStore::new()).with_max_wait(Duration::from_secs(5));
    let (app, _) = router(layer);
    let first = spawn_send(&app, payment_with("w-slow", &[("x-delay-ms", "400")]));
    tokio::time::sleep(Duration::from_millis(100)).await;
    recorded();
    let retry = send(&app, payment_with("w-slow", &[("prefer", "wait=5")])).await;
    assert_eq!(retry.status, 201, "the retry waited for the first answer");
    assert_eq!(
        counted(),
        expect(&[
            ("idempotency_requests_total{outcome=replayed}", 1.0),
            ("idempotency_requests_total{outcome=waited}", 1.0),
        ])
    );
    first.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_outcome_moves_its_counter_on_redis() {
    let _turn = TURN.lock().await;
    let mut server = RedisServer::start();
    let store = RedisStore::connect(&server.url()).await.expect("connect");
    common_outcomes(Arc::new(store.clone())).await;

    // Timings of Redis calls are real ones.
    let (app, _) = router(IdempotencyLayer::new(store.clone()));
    recorded();
    send(&app, payment("r-timed", "{}")).await;
    let timings = snapshotter().snapshot().into_vec();
    let claim_seconds = timings
        .iter()
        .find_map(|(key, _, _, value)| match value {
            DebugValue::Histogram(values)
                if key.key().name() == "idempotency_store_duration_seconds"
                    && key.key().labels().any(|l| l.value() == "claim") =>
            {
                values.first().map(|v| v.into_inner())
            }
            _ => None,
        })
        .expect("the claim was timed");
    assert!(claim_seconds > 0.0 && claim_seconds < 2.0, "{claim_seconds}");

    // Something other than a record at a key.
    let admin_client = client(&server.url()).await;
    let key = RecordKey::new(None, IdempotencyKey::parse("r-garbage").unwrap());
    let _: () = admin_client
        .set(store.redis_key(&key), "garbage", None, None, false)
        .await
        .unwrap();
    assert_eq!(send(&app, payment("r-garbage", "{}")).await.status, 500);
    assert_eq!(
        counted(),
        expect(&[
            ("idempotency_requests_total{outcome=unreadable}", 1.0),
            ("idempotency_rejections_total{kind=UnreadableRecord}", 1.0),
        ])
    );

    // Replicas required and none there: the claim is refused to protect it from a failover.
    let durable = RedisStore::connect(&server.url())
        .await
        .expect("connect")
        .with_replica_acks(ReplicaAcks::new(1).timeout(Duration::from_millis(50)))
        .await
        .expect("the waiting connections");
    let (fenced, runs) = router(IdempotencyLayer::new(durable));
    assert_eq!(send(&fenced, payment("r-fenced", "{}")).await.status, 503);
    assert_eq!(runs.get(), 0);
    assert_eq!(
        counted(),
        expect(&[
            ("idempotency_requests_total{outcome=fenced}", 1.0),
            ("idempotency_rejections_total{kind=StoreUnavailable}", 1.0),
        ])
    );

    // Redis gone: a store error, closed and open.
    let timeout = Duration::from_millis(200);
    let (closed, _) = router(IdempotencyLayer::new(store.clone()).with_store_timeout(timeout));
    let (open, _) = router(
        IdempotencyLayer::new(store.with_command_timeout(timeout))
            .with_store_timeout(timeout)
            .with_fail_open(true),
    );
    server.kill();
    assert_eq!(send(&closed, payment("r-down", "{}")).await.status, 503);
    assert_eq!(
        counted(),
        expect(&[
            ("idempotency_requests_total{outcome=store_error}", 1.0),
            ("idempotency_rejections_total{kind=StoreUnavailable}", 1.0),
        ])
    );
    assert_eq!(send(&open, payment("r-down", "{}")).await.status, 201);
    assert_eq!(
        counted(),
        expect(&[("idempotency_requests_total{outcome=fail_open}", 1.0)])
    );
}

/// A keyed request that matches no endpoint of a `PolicyLayer` is counted every time (it is
/// logged once per path), passed through or refused; a matched one and a keyless one are not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyed_request_no_endpoint_matches_is_counted() {
    let _turn = TURN.lock().await;
    let base = IdempotencyLayer::new(MemoryStore::new());
    let policy = PolicyLayer::new(base)
        .endpoint([http::Method::POST], "/payments", |layer| layer)
        .unwrap();
    let app = |policy: PolicyLayer| {
        axum::Router::new()
            .route("/payments", axum::routing::post(|| async { "paid" }))
            .route(
                "/payments/",
                axum::routing::post(|| async { "paid with a slash" }),
            )
            .layer(policy)
    };
    let passing = app(policy.clone());
    let refusing = app(policy.with_refuse_unmatched(true));
    let request = |path: &str, key: Option<&str>| {
        let builder = http::Request::post(path);
        let builder = match key {
            Some(key) => builder.header("idempotency-key", key),
            None => builder,
        };
        builder.body(Body::from("{}")).unwrap()
    };
    recorded();

    assert_eq!(
        send(&passing, request("/payments", Some("u-1"))).await.status,
        200
    );
    assert_eq!(send(&passing, request("/payments/", None)).await.status, 200);
    assert_eq!(counted(), expect(&[(EXECUTED, 1.0)]), "matched, or without a key");

    for key in ["u-2", "u-3"] {
        assert_eq!(send(&passing, request("/payments/", Some(key))).await.status, 200);
    }
    assert_eq!(
        counted(),
        expect(&[("idempotency_unmatched_requests_total{}", 2.0)])
    );

    assert_eq!(
        send(&refusing, request("/payments/", Some("u-4"))).await.status,
        501
    );
    assert_eq!(
        counted(),
        expect(&[
            ("idempotency_unmatched_requests_total{}", 1.0),
            ("idempotency_requests_total{outcome=rejected}", 1.0),
            ("idempotency_rejections_total{kind=NoEndpoint}", 1.0),
        ])
    );
}

/// Two layers (over two stores) and a coordinator, each named: their series stay apart, each
/// under its `name` label, and an unnamed layer's keep no `name` label at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn named_layers_keep_their_series_apart() {
    let _turn = TURN.lock().await;
    let (payments, _) = router(IdempotencyLayer::new(MemoryStore::new()).with_name("payments"));
    let (refunds, _) = router(IdempotencyLayer::new(MemoryStore::new()).with_name("refunds"));
    let (unnamed, _) = router(IdempotencyLayer::new(MemoryStore::new()));
    let consumer = Coordinator::new(MemoryStore::new()).with_name("consumer");
    recorded();
    assert_eq!(send(&payments, payment("n1", "{}")).await.status, 201);
    assert!(send(&payments, payment("n1", "{}")).await.is_replay());
    assert_eq!(send(&refunds, payment("n1", "{}")).await.status, 201);
    let keyless = post(None).body(Body::from("{}")).unwrap();
    assert_eq!(send(&refunds, keyless).await.status, 400);
    assert_eq!(send(&unnamed, payment("n1", "{}")).await.status, 201);
    let key = RecordKey::new(None, IdempotencyKey::parse("n1").unwrap());
    let Ok(Begin::Claimed(claim)) = consumer.begin(&key, &Fingerprint::new([b"job".as_slice()])).await else {
        panic!("a new key")
    };
    let all = recorded();
    assert_eq!(
        all.get("idempotency_running{name=consumer}"),
        Some(&1.0),
        "{all:?}"
    );
    claim.release().await.unwrap();
    let counters: BTreeMap<String, f64> = all
        .iter()
        .filter(|(name, _)| name.contains("_total{"))
        .map(|(name, n)| (name.clone(), *n))
        .collect();
    assert_eq!(
        counters,
        expect(&[
            ("idempotency_requests_total{outcome=executed,name=payments}", 1.0),
            ("idempotency_requests_total{outcome=replayed,name=payments}", 1.0),
            ("idempotency_requests_total{outcome=executed,name=refunds}", 1.0),
            ("idempotency_requests_total{outcome=rejected,name=refunds}", 1.0),
            ("idempotency_rejections_total{kind=MissingKey,name=refunds}", 1.0),
            (EXECUTED, 1.0),
            ("idempotency_requests_total{outcome=executed,name=consumer}", 1.0),
        ])
    );
    for name in ["payments", "refunds"] {
        let claims = format!("idempotency_store_duration_seconds{{op=claim,name={name}}}");
        assert!(all.contains_key(&claims), "{claims} in {all:?}");
    }
    assert_eq!(
        recorded().get("idempotency_running{name=consumer}"),
        Some(&-1.0),
        "the named gauge comes down with its own label"
    );
}
