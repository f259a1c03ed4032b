//! The `Store` contract, run against every store through the conformance kit
//! (`tower_idempotency::testing`, the call a store author runs): `MemoryStore`, `RedisStore`
//! on a real `redis-server` (standalone, Sentinel and Cluster) and `PostgresStore` on a real
//! PostgreSQL. The kit's own rules, and the broken stores each of them catches, are in
//! `tests/store_kit.rs`.

mod common;

use common::Backend;

async fn passes_the_conformance_kit(b: Backend) {
    let report = tower_idempotency::testing::check(|| {
        let store = b.store.clone();
        async move { store }
    })
    .await;
    assert!(report.passed(), "{}: {report}", b.name);
    // What each built-in store leaves to the trait's defaults: `cached` without a replay
    // cache (only `MemoryStore` answers from local copies by default), `watch` on PostgreSQL
    // (its waiters poll). A store that stopped offering a method would pass the kit unseen
    // otherwise.
    let not_offered: Vec<&str> = report.not_offered().collect();
    let expected: &[&str] = match b.name {
        "memory" => &[],
        "postgres" => &[
            "cached_answers_agree_with_the_record",
            "watch_wakes_on_every_settling",
        ],
        _ => &["cached_answers_agree_with_the_record"],
    };
    assert_eq!(not_offered, expected, "{}: {report}", b.name);
}

on_every_store!(passes_the_conformance_kit);

/// With its replay cache, `RedisStore` answers `cached` too: the kit checks those answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_with_a_replay_cache_passes_the_conformance_kit() {
    let server = common::RedisServer::start();
    let store = common::redis_store(common::client(&server.url()).await)
        .with_replay_cache(1 << 20)
        .await
        .expect("a replay cache");
    let report = tower_idempotency::testing::check(|| {
        let store = store.clone();
        async move { store }
    })
    .await;
    assert!(report.passed(), "{report}");
    assert_eq!(report.not_offered().count(), 0, "{report}");
}
