//! Run with: cargo run --example quickstart
//!
//! A payments API made safe to retry. Uses the in-memory store; Redis when `REDIS_URL` is set
//! (any form `RedisStore::connect` takes: standalone, Sentinel, Cluster, with or without TLS);
//! PostgreSQL when `DATABASE_URL` is set and `REDIS_URL` is not (build with `--features
//! postgres`; the record table is created at start). With Redis, `IDEMPOTENCY_WAIT_REPLICAS=N`
//! makes claims and completions wait until N replicas have them
//! (`RedisStore::with_replica_acks`). Listens on `ADDR` (default `127.0.0.1:3000`), and serves
//! the layer's metrics at `GET /metrics` in the Prometheus text format.
//!
//! A retry sent while the first request still runs gets 409; with `Prefer: wait=N` it waits
//! for the first one (up to 10 s here) and gets its answer instead.
//!
//! ```text
//! curl -i -X POST localhost:3000/payments -H 'Idempotency-Key: order-1' \
//!      -H 'Content-Type: application/json' -d '{"amount": 42}'
//! # again: the same 201, the same id, plus `Idempotent-Replayed: true`
//! curl -s localhost:3000/metrics | grep idempotency_requests_total
//! ```

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use serde_json::json;
use tower_idempotency::{IdempotencyLayer, MemoryStore, RedisStore, ReplicaAcks, Store};

#[derive(serde::Deserialize)]
struct NewPayment {
    amount: i64,
    delay_ms: Option<u64>,
}

/// A new id, unique within this process and across restarts.
fn new_id(prefix: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    format!(
        "{prefix}_{nanos:x}{:04x}",
        COUNTER.fetch_add(1, Ordering::Relaxed) & 0xffff
    )
}

async fn create_payment(Json(payment): Json<NewPayment>) -> Response {
    if let Some(ms) = payment.delay_ms {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    if payment.amount > 1000 {
        // A failure that may be retried: 5xx answers are not stored.
        let body = Json(json!({ "error": "amount over the limit of the upstream processor" }));
        return (StatusCode::INTERNAL_SERVER_ERROR, body).into_response();
    }
    let id = new_id("pay");
    let location = format!("/payments/{id}");
    let body = Json(json!({ "id": id, "amount": payment.amount }));
    (StatusCode::CREATED, [(header::LOCATION, location)], body).into_response()
}

async fn create_comment() -> Response {
    (StatusCode::CREATED, Json(json!({ "id": new_id("cmt") }))).into_response()
}

/// The application, kept apart from `main` so tests can drive it without a socket.
fn app(store: Arc<dyn Store>, metrics: PrometheusHandle) -> (Router, IdempotencyLayer) {
    // A retry that asks (`Prefer: wait=N`) waits for a running first request, up to 10 s,
    // instead of getting 409 at once.
    let required = IdempotencyLayer::new(store).with_max_wait(Duration::from_secs(10));
    let optional = required.clone().with_key_required(false);
    let router = Router::new()
        .route("/payments", post(create_payment).layer(required.clone()))
        .route("/comments", post(create_comment).layer(optional))
        .route("/metrics", get(move || std::future::ready(metrics.render())));
    (router, required)
}

/// The process's metrics recorder (the layer records through the `metrics` facade), rendered by
/// `GET /metrics` on the application's own port rather than a listener of the exporter's.
fn install_metrics() -> Result<PrometheusHandle, Box<dyn std::error::Error>> {
    let handle = PrometheusBuilder::new()
        // Store calls take from tens of microseconds (memory) to the store timeout (2 s).
        .set_buckets_for_metric(
            Matcher::Full("idempotency_store_duration_seconds".into()),
            &[0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 2.5],
        )?
        .install_recorder()?;
    // Without the exporter's own listener, nothing else drains its histograms' buffers.
    let upkeep = handle.clone();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_secs(5)).await;
            upkeep.run_upkeep();
        }
    });
    Ok(handle)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let wait_for = wait_replicas()?;
    let store: Arc<dyn Store> = match (std::env::var("REDIS_URL"), std::env::var("DATABASE_URL")) {
        (Ok(url), _) => {
            let store = RedisStore::connect(&url).await?;
            match wait_for {
                Some(replicas) => {
                    let store = store.with_replica_acks(ReplicaAcks::new(replicas)).await?;
                    println!(
                        "store: Redis at {}, claims and completions acknowledged by {replicas} replica(s)",
                        without_credentials(&url)
                    );
                    Arc::new(store)
                }
                None => {
                    println!("store: Redis at {}", without_credentials(&url));
                    Arc::new(store)
                }
            }
        }
        (Err(_), Ok(url)) => postgres(&url).await?,
        (Err(_), Err(_)) => {
            println!("store: in memory (set REDIS_URL to use Redis, or DATABASE_URL for PostgreSQL)");
            Arc::new(MemoryStore::new())
        }
    };
    let (router, layer) = app(store, install_metrics()?);
    let addr = std::env::var("ADDR").unwrap_or_else(|_| "127.0.0.1:3000".into());
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    println!("listening on http://{}", listener.local_addr()?);

    axum::serve(listener, router)
        .with_graceful_shutdown(shutdown_signal())
        .await?;
    // Handlers whose clients hung up still run; let them store their results.
    layer.shutdown_handle().shutdown(Duration::from_secs(10)).await?;
    Ok(())
}

/// `url` for the log: without its user and password, nor its query (a Sentinel URL carries the
/// sentinels' password there).
fn without_credentials(url: &str) -> String {
    let (url, query) = match url.split_once('?') {
        Some((url, _)) => (url, "?…"),
        None => (url, ""),
    };
    match (url.split_once("://"), url.rsplit_once('@')) {
        (Some((scheme, _)), Some((_, rest))) => format!("{scheme}://{rest}{query}"),
        _ => format!("{url}{query}"),
    }
}

/// `IDEMPOTENCY_WAIT_REPLICAS`: how many replicas must acknowledge claims and completions.
fn wait_replicas() -> Result<Option<u32>, String> {
    match std::env::var("IDEMPOTENCY_WAIT_REPLICAS") {
        Err(_) => Ok(None),
        Ok(value) => match value.trim().parse::<u32>() {
            Ok(0) => Ok(None),
            Ok(replicas) => Ok(Some(replicas)),
            Err(_) => Err(format!(
                "IDEMPOTENCY_WAIT_REPLICAS={value:?}: expected a number of replicas (0 turns waiting off)"
            )),
        },
    }
}

/// The PostgreSQL store, its table created if missing. The URL is not printed: it may hold a
/// password.
#[cfg(feature = "postgres")]
async fn postgres(url: &str) -> Result<Arc<dyn Store>, Box<dyn std::error::Error>> {
    let store = tower_idempotency::PostgresStore::connect(url).await?;
    store.migrate().await?;
    println!("store: PostgreSQL, table {}", store.table());
    Ok(Arc::new(store))
}

#[cfg(not(feature = "postgres"))]
async fn postgres(_url: &str) -> Result<Arc<dyn Store>, Box<dyn std::error::Error>> {
    Err("DATABASE_URL is set, but this build has no PostgreSQL store: \
         cargo run --example quickstart --features postgres"
        .into())
}

/// Ctrl-C, or SIGTERM (what `docker stop`, Kubernetes and systemd send).
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut terminate) => {
                terminate.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = terminate => {}
    }
    tracing::info!("shutting down: finishing requests in progress");
}
