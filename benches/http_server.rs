//! Run with: scripts/bench.sh (it builds and starts this server itself)
//!
//! The HTTP server `scripts/bench.py` measures: `POST /payments` (benches/common.rs, the
//! handler bench/peers runs too) answers `201` with
//! `{"id":"pay_<n>","bytes":<request body length>}` (`content-type: application/json`), after
//! sleeping N ms when the request carries `x-bench-sleep-ms: N` (the bench uses it to hold a key
//! in flight). The mode picks what wraps the route:
//!
//! - `plain`: nothing, the baseline;
//! - `memory`: `IdempotencyLayer::new(MemoryStore::new())`, every setting at its default;
//! - `redis`: `IdempotencyLayer::new(store)` over `RedisStore::connect(REDIS_URL)` with its
//!   scripts loaded, every setting at its default;
//! - `redis-cache`: the same as `redis` with `RedisStore::with_replay_cache` (64 MiB), so repeats are replayed
//!   from this process's memory;
//! - `redis-acks`: `redis` with `RedisStore::with_replica_acks(ReplicaAcks::new(1))`, against a
//!   redis-server with one replica (fresh keys only: replays do not wait);
//! - `postgres`: `IdempotencyLayer::new(store)` over `PostgresStore::connect(DATABASE_URL)`, its
//!   table created by `migrate`, every setting at its default (built with `--features postgres`,
//!   as `scripts/bench.sh` does; without it the mode is unknown).
//!
//! ```text
//! bench_server [ADDR] [MODE]     # defaults: 127.0.0.1:3000 plain; REDIS_URL for redis modes,
//!                                # DATABASE_URL for postgres
//! ```
//!
//! An unknown mode exits with status 2 (the bench driver skips stores the server does not know).
//! Request bodies up to 2 MiB get past axum; the layer itself takes at most 1 MiB, so the bench's
//! "1 MiB" body is 1 000 000 bytes. Warnings are counted and only the first few printed, so a
//! warning logged on every request measures the layer rather than the terminal; the count is
//! printed at exit as `bench_server: warnings=<n>`. SIGTERM or SIGINT stops it with status 0.

use std::sync::atomic::{AtomicU64, Ordering};

use tower_idempotency::{IdempotencyLayer, MemoryStore, RedisStore, ReplicaAcks};
use tracing_subscriber::filter::{filter_fn, LevelFilter};
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::Layer;

#[path = "common.rs"]
mod common;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Warnings and errors logged so far; only the first `PRINTED_WARNINGS` reach stderr.
static WARNINGS: AtomicU64 = AtomicU64::new(0);
const PRINTED_WARNINGS: u64 = 10;

struct CountWarnings;

impl<S: tracing::Subscriber> Layer<S> for CountWarnings {
    fn on_event(&self, _event: &tracing::Event<'_>, _ctx: Context<'_, S>) {
        WARNINGS.fetch_add(1, Ordering::Relaxed);
    }
}

/// The replay cache of the `redis-cache` mode: room for every key the bench replays.
const REPLAY_CACHE_BYTES: usize = 64 * 1024 * 1024;

async fn redis_store() -> Result<RedisStore, BoxError> {
    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let store = RedisStore::connect(&url).await?;
    store.load_scripts().await?;
    Ok(store)
}

/// The layer a mode puts in front of the route (`None`: plain), or `Err` for an unknown mode.
/// A new mode is one arm here.
async fn layer_for(mode: &str) -> Result<Option<IdempotencyLayer>, BoxError> {
    Ok(match mode {
        "plain" => None,
        "memory" => Some(IdempotencyLayer::new(MemoryStore::new())),
        "redis" => Some(IdempotencyLayer::new(redis_store().await?)),
        "redis-cache" => {
            let store = redis_store().await?.with_replay_cache(REPLAY_CACHE_BYTES).await?;
            Some(IdempotencyLayer::new(store))
        }
        "redis-acks" => {
            let store = redis_store()
                .await?
                .with_replica_acks(ReplicaAcks::new(1))
                .await?;
            Some(IdempotencyLayer::new(store))
        }
        #[cfg(feature = "postgres")]
        "postgres" => {
            let url = std::env::var("DATABASE_URL").map_err(|_| "set DATABASE_URL for the postgres mode")?;
            let store = tower_idempotency::PostgresStore::connect(&url).await?;
            store.migrate().await?;
            Some(IdempotencyLayer::new(store))
        }
        other => {
            let known = if cfg!(feature = "postgres") {
                "plain, memory, redis, redis-cache, redis-acks, postgres"
            } else {
                "plain, memory, redis, redis-cache, redis-acks"
            };
            eprintln!("bench_server: unknown mode `{other}` (this build knows: {known})");
            std::process::exit(2);
        }
    })
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let printed = filter_fn(|_| WARNINGS.load(Ordering::Relaxed) <= PRINTED_WARNINGS);
    tracing_subscriber::registry()
        .with(LevelFilter::WARN)
        .with(CountWarnings)
        .with(
            tracing_subscriber::fmt::layer()
                .with_writer(std::io::stderr)
                .with_ansi(false)
                .with_filter(printed),
        )
        .init();

    let mut args = std::env::args().skip(1);
    let addr = args.next().unwrap_or_else(|| "127.0.0.1:3000".into());
    let mode = args.next().unwrap_or_else(|| "plain".into());
    let layer = layer_for(&mode).await?;

    let route = common::payments();
    let router = match &layer {
        Some(layer) => route.layer(layer.clone()),
        None => route,
    };
    common::serve(&addr, &mode, router).await?;
    if let Some(layer) = layer {
        // A handler held in flight by the bench sleeps on; do not wait for it.
        let _ = layer.shutdown_handle().shutdown(common::GRACE).await;
    }
    eprintln!("bench_server: warnings={}", WARNINGS.load(Ordering::Relaxed));
    Ok(())
}
