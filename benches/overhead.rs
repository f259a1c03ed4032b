//! Run with: cargo bench --bench overhead
//!
//! What the layer costs, as ratios against baselines measured in the same run:
//! - in memory: a bare axum handler, then the layer with fresh keys (claim + complete) and with
//!   replays;
//! - on Redis (a `redis-server` of the bench's own on a free loopback port): the same handler
//!   plus two PINGs on the same client (the two round trips a fresh request cannot avoid), then
//!   the layer with fresh keys and with replays. Round trips per request (claims, script calls) are counted too.
//!
//! Set `BENCH_REQUESTS` (default 20 000) and `BENCH_CONCURRENCY` (default 64).

#[path = "../tests/common/mod.rs"]
#[allow(unused_imports)]
mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::routing::post;
use axum::Router;
use fred::prelude::*;
use http::{Request, StatusCode};
use tower::ServiceExt;
use tower_idempotency::{IdempotencyLayer, MemoryStore, RedisStore};

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

async fn create() -> (StatusCode, &'static str) {
    (StatusCode::CREATED, "{\"id\":\"pay_1\",\"amount\":42}")
}

/// Sends `total` requests from `concurrency` tasks; `key(i)` names request i's key.
async fn measure(
    app: Router,
    total: usize,
    concurrency: usize,
    key: impl Fn(usize) -> String + Send + Sync + 'static,
) -> f64 {
    let next = Arc::new(AtomicUsize::new(0));
    let key = Arc::new(key);
    let started = Instant::now();
    let workers: Vec<_> = (0..concurrency)
        .map(|_| {
            let (app, next, key) = (app.clone(), next.clone(), key.clone());
            tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= total {
                        return;
                    }
                    let request = Request::post("/payments")
                        .header("idempotency-key", key(i))
                        .header("content-type", "application/json")
                        .body(Body::from("{\"amount\":42}"))
                        .unwrap();
                    let response = app.clone().oneshot(request).await.unwrap();
                    assert_eq!(response.status(), StatusCode::CREATED);
                }
            })
        })
        .collect();
    for worker in workers {
        worker.await.unwrap();
    }
    total as f64 / started.elapsed().as_secs_f64()
}

fn report(name: &str, rate: f64, baseline: f64) {
    println!(
        "{name:<44} {rate:>10.0} req/s   {:>5.2}x baseline",
        rate / baseline
    );
}

fn main() {
    let total = env("BENCH_REQUESTS", 20_000);
    let concurrency = env("BENCH_CONCURRENCY", 64);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        println!("{total} requests, {concurrency} concurrent, 2 worker threads\n");
        let bare = Router::new().route("/payments", post(create));
        let warm = measure(bare.clone(), total / 10, concurrency, |i| format!("warm-{i}")).await;
        let baseline = measure(bare.clone(), total, concurrency, |i| format!("b-{i}")).await;
        let _ = warm;
        report("memory baseline: bare handler", baseline, baseline);
        let with_memory = |store: MemoryStore| {
            Router::new()
                .route("/payments", post(create))
                .layer(IdempotencyLayer::new(store))
        };
        // Unbounded, so however many requests are asked for, the run measures claims, not evictions.
        let fresh = measure(
            with_memory(MemoryStore::new().with_max_bytes(usize::MAX)),
            total,
            concurrency,
            |i| format!("m-{i}"),
        )
        .await;
        report("layer + memory, fresh keys", fresh, baseline);
        let app = with_memory(MemoryStore::new());
        measure(app.clone(), 1, 1, |_| "same".into()).await;
        let replays = measure(app, total, concurrency, |_| "same".into()).await;
        report("layer + memory, replays", replays, baseline);

        let server = common::RedisServer::start();
        let client = common::client(&server.url()).await;
        let store = RedisStore::new(client.clone());
        store.load_scripts().await.unwrap();
        let pinging = {
            let client = client.clone();
            Router::new().route(
                "/payments",
                post(move || {
                    let client = client.clone();
                    async move {
                        let _: String = client.ping(None).await.unwrap();
                        let _: String = client.ping(None).await.unwrap();
                        create().await
                    }
                }),
            )
        };
        let redis_baseline = measure(pinging, total, concurrency, |i| format!("p-{i}")).await;
        println!();
        report(
            "redis baseline: handler + 2 PINGs",
            redis_baseline,
            redis_baseline,
        );
        let app = Router::new()
            .route("/payments", post(create))
            .layer(IdempotencyLayer::new(store));
        common::admin(&client, &["CONFIG", "RESETSTAT"]).await;
        let fresh = measure(app.clone(), total, concurrency, |i| format!("r-{i}")).await;
        let per_fresh = common::round_trips(&client).await as f64 / total as f64;
        report("layer + redis, fresh keys", fresh, redis_baseline);
        measure(app.clone(), 1, 1, |_| "same".into()).await;
        common::admin(&client, &["CONFIG", "RESETSTAT"]).await;
        let replays = measure(app, total, concurrency, |_| "same".into()).await;
        let per_replay = common::round_trips(&client).await as f64 / total as f64;
        report("layer + redis, replays", replays, redis_baseline);
        println!("\nround trips per request: fresh {per_fresh:.2}, replay {per_replay:.2}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    });
}
