//! What only the PostgreSQL store does: rows it cannot read, rows of a newer release, the
//! sweep of expired rows, its migration, its clock, racing claims from many connections, and the
//! statements a request costs. The shared suites (`store_suite`, `layer_suite`, `faults`) also
//! run on it; its faults are in `tests/postgres_faults.rs`.
#![cfg(feature = "postgres")]

mod common;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::app::{payment, router, send};
use common::postgres;
use http::StatusCode;
use tower_idempotency::{
    ClaimOutcome, Fingerprint, IdempotencyKey, IdempotencyLayer, OwnerToken, PostgresStore, RecordKey,
    Rejection, Store, StoreError, RECORD_VERSION,
};

const LEASE: Duration = Duration::from_secs(30);

fn key(k: &str) -> RecordKey {
    RecordKey::new(None, IdempotencyKey::parse(k).unwrap())
}

fn fp(body: &str) -> Fingerprint {
    Fingerprint::new([body.as_bytes()])
}

async fn shared_store() -> PostgresStore {
    let url = tokio::task::spawn_blocking(|| postgres::shared().url())
        .await
        .unwrap();
    postgres::store(&url).await
}

/// Runs `sql` on the store's table (`{t}` in it), with `key`'s digest as `$1`.
async fn poke(store: &PostgresStore, sql: &str, key: &RecordKey) {
    let sql = sql.replace("{t}", store.table());
    sqlx::query(&sql)
        .bind(&key.digest()[..])
        .execute(store.pool())
        .await
        .unwrap_or_else(|error| panic!("{sql}: {error}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_this_release_cannot_read_are_corrupt_never_a_panic_nor_a_run() {
    let store = shared_store().await;
    let insert = |version: i16, state: &str, fingerprint: &str, payload: &str| {
        format!(
            "INSERT INTO {{t}} VALUES ($1, {version}, 'someone', {fingerprint}, '{state}', now() + interval '1 hour', {payload})"
        )
    };
    // Layout 3's: the digest and the policy tag.
    let good_fp = "decode(repeat('ab', 40), 'hex')";
    let cases = [
        (
            "unknown state",
            insert(RECORD_VERSION as i16, "X", good_fp, "NULL"),
        ),
        (
            "short fingerprint",
            insert(RECORD_VERSION as i16, "F", "'\\x01'", "NULL"),
        ),
        (
            "a fingerprint of layout 2 in layout 3 (no tag)",
            insert(
                RECORD_VERSION as i16,
                "F",
                "decode(repeat('ab', 32), 'hex')",
                "NULL",
            ),
        ),
        (
            "a fingerprint of layout 3 in layout 2",
            insert(2, "F", good_fp, "NULL"),
        ),
        (
            "in flight with a payload",
            insert(RECORD_VERSION as i16, "F", good_fp, "'\\x01'"),
        ),
        (
            "completed without a payload",
            insert(RECORD_VERSION as i16, "C", good_fp, "NULL"),
        ),
        ("layout version 0", insert(0, "C", good_fp, "'\\x01'")),
        ("layout version -3", insert(-3, "F", good_fp, "NULL")),
    ];
    for (why, sql) in cases {
        let k = key(&format!("corrupt-{why}").replace(' ', "-"));
        poke(&store, &sql, &k).await;
        let claim = store.claim(&k, &fp("x"), &OwnerToken::generate(), LEASE).await;
        assert!(matches!(claim, Err(StoreError::Corrupt(_))), "{why}: {claim:?}");
        let peek = store.peek(&k, &fp("x")).await;
        assert!(matches!(peek, Err(StoreError::Corrupt(_))), "{why}: {peek:?}");
        let inspect = store.inspect(&k).await;
        assert!(
            matches!(inspect, Err(StoreError::Corrupt(_))),
            "{why}: {inspect:?}"
        );
        // An operator can still purge it.
        assert!(store.purge(&k).await.unwrap(), "{why}");
    }
    // Over HTTP: 500 UnreadableRecord, the handler not run.
    let (app, runs) = router(IdempotencyLayer::new(store.clone()));
    poke(
        &store,
        &insert(RECORD_VERSION as i16, "X", good_fp, "NULL"),
        &key("garbled-row"),
    )
    .await;
    let answer = send(&app, payment("garbled-row", "{}")).await;
    assert_eq!(answer.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(
        answer.extensions.get::<Rejection>(),
        Some(&Rejection::UnreadableRecord)
    );
    assert_eq!(runs.get(), 0);
}

/// A row as the previous release wrote it (layout 2: the digest alone in `fingerprint`, no
/// policy tag) replays, and another request under its key is the plain mismatch, under any
/// policy: nothing says which policy made it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_of_the_layout_before_policy_tags_replays_and_mismatches_plainly() {
    let store = shared_store().await;
    let (app, runs) = router(IdempotencyLayer::new(store.clone()));
    assert_eq!(
        send(&app, payment("layout-2", "{}")).await.status,
        StatusCode::CREATED
    );
    poke(
        &store,
        "UPDATE {t} SET version = 2, fingerprint = substring(fingerprint FROM 1 FOR 32) WHERE key = $1",
        &key("layout-2"),
    )
    .await;
    assert!(send(&app, payment("layout-2", "{}")).await.is_replay());
    let json = IdempotencyLayer::new(store.clone())
        .with_fingerprint(tower_idempotency::FingerprintPolicy::new().json_body());
    let (json, json_runs) = router(json);
    for app in [&app, &json] {
        let other = send(app, payment("layout-2", "{\"amount\":1}")).await;
        let state = other.extensions.get::<Rejection>().map(Rejection::key_state);
        assert_eq!(state, Some("mismatch"), "{:?}", other.body);
    }
    assert_eq!(runs.get() + json_runs.get(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_of_a_newer_release_is_answered_in_flight_for_a_second() {
    let store = shared_store().await;
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let newer = RECORD_VERSION + 1;
    // Claimed a minute ago: a rolling upgrade under way, retry in a second. Claimed 16 minutes
    // ago, or at an unknown time: a rollback, reported rather than looped on for a day.
    for (name, owner, in_flight) in [
        ("from-the-future", format!("n-1@{}", now_ms - 60_000), true),
        (
            "from-a-rolled-back-release",
            format!("n-1@{}", now_ms - 16 * 60_000),
            false,
        ),
        ("from-an-unknown-time", "new".to_owned(), false),
    ] {
        let k = key(name);
        poke(
            &store,
            &format!(
                "INSERT INTO {{t}} VALUES ($1, {newer}, '{owner}', '\\x00', 'Z', now() + interval '1 hour', '\\x00')"
            ),
            &k,
        )
        .await;
        let claimed = store.claim(&k, &fp("x"), &OwnerToken::generate(), LEASE).await;
        if in_flight {
            assert_eq!(
                claimed.unwrap(),
                ClaimOutcome::InFlight {
                    lease_left: Duration::from_secs(1)
                }
            );
        } else {
            assert!(
                matches!(&claimed, Err(StoreError::Corrupt(why)) if why.contains("roll forward")),
                "{name}: {claimed:?}"
            );
        }
        assert!(
            matches!(store.inspect(&k).await, Err(StoreError::Corrupt(why)) if why.contains("newer release"))
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sweep_deletes_expired_rows_in_batches_and_nothing_live() {
    let store = shared_store().await.with_sweep_every(None);
    let table = store.table().to_owned();
    // 2500 expired rows (more than two batches), 10 live ones.
    let fill = format!(
        "INSERT INTO {table}
         SELECT sha256(n::text::bytea), {RECORD_VERSION}, 'o', sha256(''::bytea) || decode(repeat('00', 8), 'hex'), 'C',
                now() - interval '1 second' * (CASE WHEN n <= 2500 THEN 1 ELSE -3600 END), '\\x00'
           FROM generate_series(1, 2510) AS n"
    );
    sqlx::query(&fill).execute(store.pool()).await.unwrap();
    assert_eq!(store.sweep().await.unwrap(), 2500);
    let left: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {table}"))
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(left, 10, "the live rows stay");
    assert_eq!(store.sweep().await.unwrap(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_sweeps_by_itself_once_it_has_claimed() {
    let store = shared_store()
        .await
        .with_sweep_every(Some(Duration::from_millis(100)));
    let count = format!("SELECT count(*) FROM {}", store.table());
    let k = key("swept");
    let owner = OwnerToken::generate();
    assert_eq!(
        store
            .claim(&k, &fp("x"), &owner, Duration::from_millis(50))
            .await
            .unwrap(),
        ClaimOutcome::Claimed
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let rows: i64 = sqlx::query_scalar(&count).fetch_one(store.pool()).await.unwrap();
        if rows == 0 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the expired claim was never swept"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_is_safe_to_run_again_and_from_instances_starting_together() {
    let url = tokio::task::spawn_blocking(|| postgres::shared().url())
        .await
        .unwrap();
    let table = postgres::unique_table();
    let mut starting = Vec::new();
    for _ in 0..4 {
        let (url, table) = (url.clone(), table.clone());
        starting.push(tokio::spawn(async move {
            let store = PostgresStore::connect(&url).await.unwrap().with_table(&table);
            store.migrate().await.unwrap();
            store.migrate().await.unwrap();
            store
        }));
    }
    for store in starting {
        let store = store.await.unwrap();
        let k = key("migrated");
        store.purge(&k).await.unwrap();
        assert_eq!(
            store
                .claim(&k, &fp("x"), &OwnerToken::generate(), LEASE)
                .await
                .unwrap(),
            ClaimOutcome::Claimed
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_table_is_a_clear_error_that_names_the_migration() {
    let url = tokio::task::spawn_blocking(|| postgres::shared().url())
        .await
        .unwrap();
    let store = PostgresStore::connect(&url)
        .await
        .unwrap()
        .with_table(&postgres::unique_table());
    let error = store
        .claim(&key("k"), &fp("x"), &OwnerToken::generate(), LEASE)
        .await
        .unwrap_err();
    assert!(matches!(error, StoreError::Unavailable(_)), "{error:?}");
    let text = format!(
        "{error}: {}",
        std::error::Error::source(&error)
            .map(|s| s.to_string())
            .unwrap_or_default()
    );
    assert!(text.contains("migrate"), "{text}");
    let (app, runs) = router(IdempotencyLayer::new(store));
    assert_eq!(
        send(&app, payment("k", "{}")).await.status,
        StatusCode::SERVICE_UNAVAILABLE
    );
    assert_eq!(runs.get(), 0, "fail-closed");
}

/// Leases and retention are the database's: a row's deadline is its `statement_timestamp()`
/// plus the duration, whatever this process's clock says.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deadlines_are_set_by_the_database_clock() {
    let store = shared_store().await;
    let k = key("clock");
    let owner = OwnerToken::generate();
    store
        .claim(&k, &fp("x"), &owner, Duration::from_secs(100))
        .await
        .unwrap();
    let sql = format!(
        "SELECT extract(epoch FROM expires_at - now())::float8 FROM {} WHERE key = $1",
        store.table()
    );
    let left: f64 = sqlx::query_scalar(&sql)
        .bind(&k.digest()[..])
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert!((99.0..=100.5).contains(&left), "{left}");
    assert!(store
        .complete(&k, &owner, Bytes::from_static(b"r"), Duration::from_secs(3600))
        .await
        .unwrap());
    let left: f64 = sqlx::query_scalar(&sql)
        .bind(&k.digest()[..])
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert!((3599.0..=3600.5).contains(&left), "{left}");
}

/// Guarantee 1 at the level of the statement: claims of one key sent at once from many
/// connections of several stores (instances) give exactly one `Claimed`, whatever the state
/// they race over: no record, an expired one, or one just released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_claims_from_many_connections_give_one_claim() {
    let first = shared_store().await;
    let url = tokio::task::spawn_blocking(|| postgres::shared().url())
        .await
        .unwrap();
    let mut instances = vec![first.clone()];
    for _ in 0..3 {
        instances.push(
            PostgresStore::connect(&url)
                .await
                .unwrap()
                .with_table(first.table()),
        );
    }
    for round in 0..30 {
        let k = Arc::new(key(&format!("race-{round}")));
        if round % 3 == 1 {
            // An expired claim to take over.
            first
                .claim(&k, &fp("x"), &OwnerToken::generate(), Duration::from_millis(1))
                .await
                .unwrap();
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let barrier = Arc::new(tokio::sync::Barrier::new(40));
        let racers: Vec<_> = (0..40)
            .map(|i| {
                let (store, k, barrier) =
                    (instances[i % instances.len()].clone(), k.clone(), barrier.clone());
                tokio::spawn(async move {
                    barrier.wait().await;
                    store.claim(&k, &fp("x"), &OwnerToken::generate(), LEASE).await
                })
            })
            .collect();
        let mut claimed = 0;
        for racer in racers {
            match racer.await.unwrap().expect("every claim answered") {
                ClaimOutcome::Claimed => claimed += 1,
                ClaimOutcome::InFlight { .. } => {}
                other => panic!("round {round}: {other:?}"),
            }
        }
        assert_eq!(claimed, 1, "round {round}");
    }
}

/// The round trips a request costs, counted by `pg_stat_statements` on the server: a fresh key
/// is the claim and the completion, a replay and a 409 the claim alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_key_costs_two_statements_a_replay_and_a_409_one() {
    // A server of its own: the counts are per server.
    let server = tokio::task::spawn_blocking(postgres::PgServer::start)
        .await
        .unwrap();
    let store = postgres::store(&server.url()).await;
    let stats = sqlx::PgPool::connect(&server.url()).await.unwrap();
    sqlx::query("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        .execute(&stats)
        .await
        .unwrap();
    let table = store.table().to_owned();
    let statements = || {
        let (stats, table) = (stats.clone(), table.clone());
        async move {
            let sql = "SELECT coalesce(sum(calls), 0)::int8 FROM pg_stat_statements
                        WHERE query LIKE '%' || $1 || '%' AND query NOT LIKE '%pg_stat_statements%'
                          AND query NOT LIKE 'CREATE%'";
            sqlx::query_scalar::<_, i64>(sql)
                .bind(&table)
                .fetch_one(&stats)
                .await
                .unwrap()
        }
    };
    let (app, _) = router(IdempotencyLayer::new(store));
    let before = statements().await;
    assert_eq!(
        send(&app, payment("counted", "{}")).await.status,
        StatusCode::CREATED
    );
    assert_eq!(statements().await - before, 2, "a fresh key: claim, complete");
    let before = statements().await;
    assert!(send(&app, payment("counted", "{}")).await.is_replay());
    assert_eq!(statements().await - before, 1, "a replay: the claim");
    let claimed_before = statements().await;
    let slow = tokio::spawn({
        let app = app.clone();
        async move { send(&app, common::app::payment_with("busy", &[("x-delay-ms", "1500")])).await }
    });
    // Once its claim is counted: a fixed 150 ms was outlasted on a loaded machine (the retry
    // below then claimed the key first). The handler's 1.5 s leave the retry time to meet it.
    let asked_since = std::time::Instant::now();
    while statements().await == claimed_before {
        assert!(
            asked_since.elapsed() < Duration::from_secs(5),
            "the slow request's claim"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let before = statements().await;
    assert_eq!(
        send(&app, payment("busy", "{}")).await.status,
        StatusCode::CONFLICT
    );
    assert_eq!(statements().await - before, 1, "a 409: the claim");
    assert_eq!(slow.await.unwrap().status, StatusCode::CREATED);
    drop(server);
}

/// The race the claim statement resolves by sending itself again: its snapshot shows no record,
/// but a transaction that has not committed yet inserted one. The claim's INSERT waits for that
/// transaction; once it commits, the claim writes nothing and answers from the committed row
/// (409); once it rolls back, the claim takes the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_racing_an_uncommitted_insert_waits_for_it_and_answers_from_what_it_became() {
    let store = shared_store().await;
    for commit in [true, false] {
        let k = key(&format!("raced-{commit}"));
        let mut other = store.pool().begin().await.unwrap();
        let insert = format!(
            "INSERT INTO {} VALUES ($1, {RECORD_VERSION}, 'another-owner', $2, 'F', now() + interval '30 seconds', NULL)",
            store.table()
        );
        sqlx::query(&insert)
            .bind(&k.digest()[..])
            .bind([&fp("x").as_bytes()[..], &[0; 8]].concat())
            .execute(&mut *other)
            .await
            .unwrap();
        let claiming = tokio::spawn({
            let (store, k) = (store.clone(), k.clone());
            async move { store.claim(&k, &fp("x"), &OwnerToken::generate(), LEASE).await }
        });
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(
            !claiming.is_finished(),
            "the claim waits for the other transaction"
        );
        if commit {
            other.commit().await.unwrap();
        } else {
            other.rollback().await.unwrap();
        }
        let outcome = claiming.await.unwrap().expect("an answer, not an error");
        if commit {
            assert!(matches!(outcome, ClaimOutcome::InFlight { .. }), "{outcome:?}");
        } else {
            assert_eq!(outcome, ClaimOutcome::Claimed);
        }
    }
}

/// The same race for a completion: the handler's transaction completed the claim and commits
/// while the layer's own completion waits on the row. The completion then succeeds and leaves
/// the committed payload as it is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_racing_the_transaction_that_completed_it_succeeds_without_overwriting() {
    let store = shared_store().await;
    let (k, owner) = (key("completion-race"), OwnerToken::generate());
    assert_eq!(
        store.claim(&k, &fp("x"), &owner, LEASE).await.unwrap(),
        ClaimOutcome::Claimed
    );
    let mut handler = store.pool().begin().await.unwrap();
    let complete = format!(
        "UPDATE {} SET state = 'C', payload = '\\x636f6d6d6974746564', expires_at = now() + interval '1 hour' WHERE key = $1",
        store.table()
    );
    sqlx::query(&complete)
        .bind(&k.digest()[..])
        .execute(&mut *handler)
        .await
        .unwrap();
    let completing = tokio::spawn({
        let (store, k, owner) = (store.clone(), k.clone(), owner.clone());
        async move {
            store
                .complete(&k, &owner, Bytes::from_static(b"layer"), Duration::from_secs(60))
                .await
        }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !completing.is_finished(),
        "the completion waits for the handler's transaction"
    );
    handler.commit().await.unwrap();
    assert!(completing.await.unwrap().expect("an answer, not an error"));
    assert_eq!(
        store
            .claim(&k, &fp("x"), &OwnerToken::generate(), LEASE)
            .await
            .unwrap(),
        ClaimOutcome::Completed(Bytes::from_static(b"committed"))
    );
}
