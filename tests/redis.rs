//! What only Redis can show: round trips, script reloads, TTLs and hash tags, foreign data at a
//! record's key, a server that dies and comes back.

mod common;

use std::time::Duration;

use common::app::{payment, payment_with, router, send};
use common::{admin, client, command_calls, round_trips, RedisServer};
use fred::prelude::*;
use http::StatusCode;
use tower_idempotency::{
    FingerprintPolicy, IdempotencyKey, IdempotencyLayer, RecordKey, RedisStore, Rejection,
};

async fn setup() -> (RedisServer, Client, RedisStore) {
    let server = RedisServer::start();
    let client = client(&server.url()).await;
    let store = common::redis_store(client.clone());
    (server, client, store)
}

async fn reset_stats(client: &Client) {
    admin(client, &["CONFIG", "RESETSTAT"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_request_costs_two_round_trips_and_every_other_answer_one() {
    let (_server, client, store) = setup().await;
    store.load_scripts().await.unwrap();
    let (app, runs) = router(IdempotencyLayer::new(store));

    reset_stats(&client).await;
    assert_eq!(send(&app, payment("rt", "{}")).await.status, StatusCode::CREATED);
    assert_eq!(round_trips(&client).await, 2, "fresh: claim + complete");

    reset_stats(&client).await;
    assert!(send(&app, payment("rt", "{}")).await.is_replay());
    assert_eq!(round_trips(&client).await, 1, "replay: claim only");

    reset_stats(&client).await;
    assert_eq!(
        send(&app, payment("rt", "{\"other\":1}")).await.status,
        StatusCode::CONFLICT
    );
    assert_eq!(round_trips(&client).await, 1, "mismatch: claim only");

    reset_stats(&client).await;
    let answer = send(&app, payment_with("rt-500", &[("x-status", "500")])).await;
    assert_eq!(answer.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(round_trips(&client).await, 2, "not cacheable: claim + release");

    let slow = {
        let app = app.clone();
        tokio::spawn(async move { send(&app, payment_with("rt-busy", &[("x-delay-ms", "600")])).await })
    };
    // Counted from once the slow request runs (its claim made) until its handler ends.
    common::until("the slow request runs", || runs.get() == 3).await;
    reset_stats(&client).await;
    let busy = send(&app, payment("rt-busy", "{}")).await;
    assert_eq!(busy.status, StatusCode::CONFLICT);
    assert_eq!(round_trips(&client).await, 1, "in flight: claim only");
    slow.await.unwrap();

    // The claim is one native command; no other command is sent per request: only the scripts'
    // own inner calls show up besides. No `SPUBLISH`: nobody waits for this record, so its
    // completion tells nobody.
    reset_stats(&client).await;
    send(&app, payment("rt-only", "{}")).await;
    let info = admin(&client, &["INFO", "commandstats"])
        .await
        .as_str()
        .unwrap()
        .into_owned();
    let commands: Vec<&str> = info
        .lines()
        .filter_map(|l| l.strip_prefix("cmdstat_")?.split(':').next())
        .filter(|c| !["info", "config|resetstat"].contains(c))
        .collect();
    for command in &commands {
        assert!(
            ["set", "evalsha", "getrange", "setrange", "pexpire"].contains(command),
            "unexpected {command}: {commands:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scripts_are_reloaded_after_script_flush() {
    let (_server, client, store) = setup().await;
    let (app, runs) = router(IdempotencyLayer::new(store));
    // First use on a fresh server: no script loaded yet.
    assert_eq!(
        send(&app, payment("flush-1", "{}")).await.status,
        StatusCode::CREATED
    );
    admin(&client, &["SCRIPT", "FLUSH"]).await;
    assert!(send(&app, payment("flush-1", "{}")).await.is_replay());
    admin(&client, &["SCRIPT", "FLUSH"]).await;
    assert_eq!(
        send(&app, payment("flush-2", "{}")).await.status,
        StatusCode::CREATED
    );
    assert!(send(&app, payment("flush-2", "{}")).await.is_replay());
    assert_eq!(runs.get(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_key_has_a_ttl_and_a_hash_tag() {
    let (_server, client, store) = setup().await;
    let (app, _) = router(IdempotencyLayer::new(store));
    send(&app, payment("ttl-done", "{}")).await;
    let slow = {
        let app = app.clone();
        tokio::spawn(async move { send(&app, payment_with("ttl-busy", &[("x-delay-ms", "500")])).await })
    };
    tokio::time::sleep(Duration::from_millis(150)).await;
    let keys: Vec<String> = client
        .custom(
            fred::types::CustomCommand::new_static("KEYS", fred::types::ClusterHash::Random, false),
            vec!["*"],
        )
        .await
        .unwrap();
    assert_eq!(keys.len(), 2, "{keys:?}");
    for key in &keys {
        let ttl: i64 = client.pttl(key).await.unwrap();
        assert!(ttl > 0, "{key} has no TTL");
        let tag = key
            .split_once('{')
            .and_then(|(_, rest)| rest.split_once('}'))
            .map(|(tag, _)| tag);
        assert!(tag.is_some_and(|t| t.len() == 64), "{key} has a hash tag");
    }
    slow.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn foreign_or_corrupt_data_is_a_clear_error_never_a_replay() {
    let (_server, client, store) = setup().await;
    let layer = IdempotencyLayer::new(store.clone());
    let (app, runs) = router(layer.clone());
    let redis_key = |k: &str| store.redis_key(&RecordKey::new(None, IdempotencyKey::parse(k).unwrap()));
    let expect_unreadable = |answer: common::app::Answer| {
        assert_eq!(answer.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(
            answer.extensions.get::<Rejection>(),
            Some(&Rejection::UnreadableRecord)
        );
    };

    // A string where a record should be.
    let _: () = client
        .set(redis_key("c-string"), "garbage", None, None, false)
        .await
        .unwrap();
    expect_unreadable(send(&app, payment("c-string", "{}")).await);
    assert!(layer.inspect(None, "c-string").await.is_err());
    // A hash, as an earlier layout stored records.
    let _: () = client.hset(redis_key("c-hash"), ("foo", "bar")).await.unwrap();
    expect_unreadable(send(&app, payment("c-hash", "{}")).await);
    assert!(layer.inspect(None, "c-hash").await.is_err());
    // A record in a layout no release wrote (1 was never released; 0 never existed), and a
    // truncated record. (A newer layout is answered as in flight: see the rolling-upgrade test.)
    send(&app, payment("c-version", "{}")).await;
    let stored: Vec<u8> = client.get(redis_key("c-version")).await.unwrap();
    let mut other_version = stored.clone();
    other_version[3] = 1;
    let _: () = client
        .set(redis_key("c-version"), other_version, None, None, false)
        .await
        .unwrap();
    expect_unreadable(send(&app, payment("c-version", "{}")).await);
    let _: () = client
        .set(redis_key("c-short"), stored[..10].to_vec(), None, None, false)
        .await
        .unwrap();
    expect_unreadable(send(&app, payment("c-short", "{}")).await);
    // A record whose stored response is garbage: the record's own fields intact, the payload
    // (after the owner, the state byte, the 8-byte deadline, the 32-byte fingerprint and the
    // 8-byte policy tag) replaced.
    send(&app, payment("c-payload", "{}")).await;
    let stored: Vec<u8> = client.get(redis_key("c-payload")).await.unwrap();
    let payload_at = 6 + usize::from(u16::from_be_bytes([stored[4], stored[5]])) + 1 + 8 + 32 + 8;
    let garbled = [&stored[..payload_at], b"not a stored response"].concat();
    let _: () = client
        .set(redis_key("c-payload"), garbled, None, None, false)
        .await
        .unwrap();
    expect_unreadable(send(&app, payment("c-payload", "{}")).await);
    assert_eq!(runs.get(), 2, "the handler never ran on a corrupt record");
    // Operators can clear it, and the key works again.
    assert!(layer.purge(None, "c-payload").await.unwrap());
    assert_eq!(
        send(&app, payment("c-payload", "{}")).await.status,
        StatusCode::CREATED
    );
}

/// A stored response exactly as the release before this one wrote it (response layout version 1):
/// status 201, `x-old: 1`, body `old`.
const PREVIOUS_RELEASE_RESPONSE: &[u8] =
    b"TIR\x01\x00\xc9\x00\x00\x00\x01\x00\x00\x00\x05x-old\x00\x00\x00\x011old";

// Rolling upgrades: old and new instances side by side. This release replays what the previous
// one stored, and answers a record from a newer release like one in flight (retry later),
// never as corrupt and never by running the handler.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_of_the_previous_and_of_a_newer_release_are_never_called_corrupt() {
    let (_server, client, store) = setup().await;
    let layer = IdempotencyLayer::new(store.clone());
    let (app, runs) = router(layer.clone());
    let redis_key = |k: &str| store.redis_key(&RecordKey::new(None, IdempotencyKey::parse(k).unwrap()));
    // Completes `key`, then rewrites its record with `edit` applied to (record, payload offset).
    let rewrite = |key: &'static str, edit: fn(&mut Vec<u8>, usize)| {
        let (app, client, redis_key) = (app.clone(), client.clone(), redis_key(key));
        async move {
            assert_eq!(send(&app, payment(key, "{}")).await.status, StatusCode::CREATED);
            let mut stored: Vec<u8> = client.get(&redis_key).await.unwrap();
            let payload_at = 6 + usize::from(u16::from_be_bytes([stored[4], stored[5]])) + 1 + 8 + 32 + 8;
            edit(&mut stored, payload_at);
            let _: () = client.set(&redis_key, stored, None, None, false).await.unwrap();
        }
    };
    let expect_in_flight = |answer: common::app::Answer| {
        assert_eq!(answer.status, StatusCode::CONFLICT, "{:?}", answer.body);
        assert_eq!(answer.headers["retry-after"], "1");
        assert!(matches!(
            answer.extensions.get::<Rejection>(),
            Some(Rejection::InFlight { .. })
        ));
    };

    // The previous release's stored response replays, byte for byte.
    rewrite("from-previous", |record, at| {
        record.truncate(at);
        record.extend_from_slice(PREVIOUS_RELEASE_RESPONSE);
    })
    .await;
    let replay = send(&app, payment("from-previous", "{}")).await;
    assert!(replay.is_replay());
    assert_eq!(replay.status, StatusCode::CREATED);
    assert_eq!(replay.headers["x-old"], "1");
    assert_eq!(replay.body, "old");
    assert_eq!(
        layer
            .inspect(None, "from-previous")
            .await
            .unwrap()
            .unwrap()
            .status,
        Some(StatusCode::CREATED)
    );

    // A record in a newer record layout, and a newer response layout in a record this release
    // reads: both "in flight, retry in 1 s".
    rewrite("from-newer-record", |record, _| record[3] = 4).await;
    expect_in_flight(send(&app, payment("from-newer-record", "{}")).await);
    rewrite("from-newer-response", |record, at| {
        record.truncate(at);
        record.extend_from_slice(b"TIR\x03 a layout this release does not know");
    })
    .await;
    expect_in_flight(send(&app, payment("from-newer-response", "{}")).await);
    assert_eq!(runs.get(), 3, "no handler ran for a record it could not read");

    // The previous release's record layout (2: no policy tag after the fingerprint) replays,
    // and another request under its key is the plain mismatch, under any policy: nothing says
    // which policy made it.
    rewrite("from-layout-2", |record, at| {
        record[3] = 2;
        record.drain(at - 8..at);
    })
    .await;
    assert!(send(&app, payment("from-layout-2", "{}")).await.is_replay());
    let (json, json_runs) =
        router(IdempotencyLayer::new(store.clone()).with_fingerprint(FingerprintPolicy::new().json_body()));
    for app in [&app, &json] {
        let other = send(app, payment("from-layout-2", "{\"amount\":1}")).await;
        assert_eq!(
            other.extensions.get::<Rejection>().map(Rejection::key_state),
            Some("mismatch"),
            "{:?}",
            other.body
        );
    }
    assert_eq!(runs.get() + json_runs.get(), 4);
}

/// After a rollback, a record of the newer release is not "in flight, retry in 1 s" for the rest
/// of its retention: 15 minutes after its claim it is reported unreadable (500, an error logged),
/// so clients stop looping and operators see it. A record whose claim time is unknown too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_newer_release_record_past_the_upgrade_window_is_reported_not_looped_on() {
    let (_server, client, store) = setup().await;
    let (app, runs) = router(IdempotencyLayer::new(store.clone()));
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    for (key, owner, rolled_back) in [
        ("claimed-a-minute-ago", format!("n-1@{}", now_ms - 60_000), false),
        (
            "claimed-16-minutes-ago",
            format!("n-1@{}", now_ms - 16 * 60_000),
            true,
        ),
        ("claimed-at-an-unknown-time", "worker-7".to_owned(), true),
    ] {
        let mut record = b"TIR\x04".to_vec();
        record.extend_from_slice(&(owner.len() as u16).to_be_bytes());
        record.extend_from_slice(owner.as_bytes());
        record.extend_from_slice(b"C and whatever layout 4 holds");
        let redis_key = store.redis_key(&RecordKey::new(None, IdempotencyKey::parse(key).unwrap()));
        let _: () = client
            .set(
                &redis_key,
                record,
                Some(fred::types::Expiration::EX(86_400)),
                None,
                false,
            )
            .await
            .unwrap();
        let answer = send(&app, payment(key, "{}")).await;
        let rejection = answer.extensions.get::<Rejection>().cloned();
        if rolled_back {
            assert_eq!(answer.status, StatusCode::INTERNAL_SERVER_ERROR, "{key}");
            assert_eq!(rejection, Some(Rejection::UnreadableRecord), "{key}");
        } else {
            assert_eq!(answer.status, StatusCode::CONFLICT, "{key}");
            assert_eq!(answer.headers["retry-after"], "1", "{key}");
        }
    }
    assert_eq!(
        runs.get(),
        0,
        "the key ran on the newer release: never again here"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_redis_answers_503_and_the_layer_recovers_when_it_returns() {
    let (mut server, _client, store) = setup().await;
    let (app, runs) = router(IdempotencyLayer::new(store).with_store_timeout(Duration::from_millis(300)));
    assert_eq!(
        send(&app, payment("before", "{}")).await.status,
        StatusCode::CREATED
    );

    server.kill();
    let started = std::time::Instant::now();
    let answer = send(&app, payment("during", "{}")).await;
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "no hang: {:?}",
        started.elapsed()
    );
    assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        answer.extensions.get::<Rejection>(),
        Some(&Rejection::StoreUnavailable)
    );
    assert_eq!(runs.get(), 1, "fail-closed: nothing ran");

    server.restart();
    // The client reconnects by itself and the empty server gets its scripts again.
    let mut status = StatusCode::SERVICE_UNAVAILABLE;
    for _ in 0..50 {
        status = send(&app, payment("after", "{}")).await.status;
        if status != StatusCode::SERVICE_UNAVAILABLE {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(status, StatusCode::CREATED);
    assert!(send(&app, payment("after", "{}")).await.is_replay());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_and_connect_work_like_a_client() {
    let server = RedisServer::start();
    let pool = Builder::from_config(Config::from_url(&server.url()).unwrap())
        .build_pool(3)
        .unwrap();
    pool.init().await.unwrap();
    let (app, runs) = router(IdempotencyLayer::new(
        RedisStore::from_pool(pool).with_prefix("pooled"),
    ));
    for _ in 0..5 {
        send(&app, payment("pooled", "{}")).await;
    }
    assert_eq!(runs.get(), 1);

    let store = common::connect(&server.url()).await.unwrap();
    let (app, runs) = router(IdempotencyLayer::new(store));
    send(&app, payment("connected", "{}")).await;
    assert!(send(&app, payment("connected", "{}")).await.is_replay());
    assert_eq!(runs.get(), 1);
    assert!(common::connect("not a url").await.is_err());
}

// The replay cache: repeats answered from memory, bounded by the record's retention, and a purge
// on one node honoured by every node's cache.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_cache_answers_repeats_without_redis_and_every_node_honours_a_purge() {
    let server = RedisServer::start();
    let stats = client(&server.url()).await;
    let cached_store = || async {
        common::redis_store(client(&server.url()).await)
            .with_replay_cache(1 << 20)
            .await
            .unwrap()
    };
    let layer_a = IdempotencyLayer::new(cached_store().await);
    let layer_b = IdempotencyLayer::new(cached_store().await);
    let (node_a, runs_a) = router(layer_a.clone());
    let (node_b, runs_b) = router(layer_b);

    assert_eq!(
        send(&node_a, payment("cached", "{}")).await.status,
        StatusCode::CREATED
    );
    // Node B's first repeat is answered from Redis and keeps a copy; the next cost no round trip.
    let first = send(&node_b, payment("cached", "{}")).await;
    assert!(first.is_replay());
    reset_stats(&stats).await;
    for _ in 0..5 {
        let again = send(&node_b, payment("cached", "{}")).await;
        assert!(again.is_replay());
        assert_eq!(again.body, first.body, "the same bytes");
    }
    let other = send(&node_b, payment("cached", "{\"other\":1}")).await;
    assert_eq!(
        other.extensions.get::<Rejection>().map(Rejection::status),
        Some(StatusCode::CONFLICT)
    );
    assert_eq!(
        round_trips(&stats).await,
        0,
        "replays and the mismatch came from node B's cache"
    );

    // A purge on node A reaches node B's copy.
    assert!(layer_a.purge(None, "cached").await.unwrap());
    let purged = std::time::Instant::now();
    let honoured = loop {
        let answer = send(&node_b, payment("cached", "{}")).await;
        if !answer.is_replay() {
            assert_eq!(answer.status, StatusCode::CREATED, "the purged key runs again");
            break purged.elapsed();
        }
        assert!(
            purged.elapsed() < Duration::from_millis(100),
            "a purge is honoured within 100 ms"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    };
    println!("node B stopped replaying its copy {honoured:?} after the purge on node A");
    assert_eq!((runs_a.get(), runs_b.get()), (1, 1));

    // If the cache's listening connection drops, its copies go (purges may have been missed), and
    // it listens again once reconnected.
    assert!(send(&node_b, payment("cached", "{}")).await.is_replay());
    // The drop is seen when the client reads the closed socket, a moment after the kill: poll.
    admin(&stats, &["CLIENT", "KILL", "TYPE", "pubsub"]).await;
    let killed = std::time::Instant::now();
    loop {
        reset_stats(&stats).await;
        assert!(send(&node_b, payment("cached", "{}")).await.is_replay());
        if round_trips(&stats).await == 1 {
            break;
        }
        assert!(
            killed.elapsed() < Duration::from_secs(1),
            "the copy was dropped with the connection within 1 s"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    // Once it listens again, repeats are cached again (cost no round trip) and purges reach it.
    loop {
        assert!(send(&node_b, payment("cached", "{}")).await.is_replay());
        reset_stats(&stats).await;
        assert!(send(&node_b, payment("cached", "{}")).await.is_replay());
        if round_trips(&stats).await == 0 {
            break;
        }
        assert!(
            killed.elapsed() < Duration::from_secs(5),
            "the cache listens again within 5 s of losing its connection"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(layer_a.purge(None, "cached").await.unwrap());
    let purged = std::time::Instant::now();
    while send(&node_b, payment("cached", "{}")).await.is_replay() {
        assert!(
            purged.elapsed() < Duration::from_millis(100),
            "purges reach it again"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cached_copy_never_outlives_the_record_retention() {
    let server = RedisServer::start();
    let store = common::redis_store(client(&server.url()).await)
        .with_replay_cache(1 << 20)
        .await
        .unwrap();
    let retention = Duration::from_millis(400);
    let (app, runs) = router(IdempotencyLayer::new(store).with_retention(retention));
    send(&app, payment("short", "{}")).await;
    assert!(send(&app, payment("short", "{}")).await.is_replay());
    assert!(
        send(&app, payment("short", "{}")).await.is_replay(),
        "from the copy"
    );
    tokio::time::sleep(retention + Duration::from_millis(100)).await;
    let after = send(&app, payment("short", "{}")).await;
    assert!(!after.is_replay(), "the record and its copy are gone");
    assert_eq!(runs.get(), 2);
}

// A copy lives as long as Redis keeps its record, by this instance's own clock: not by the
// deadline written in the record by whichever instance completed it, whose clock may be ahead.
// Here the record's TTL is cut to 300 ms while the deadline it carries says a minute (what a
// writer whose clock runs a minute fast would leave).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cached_copy_lives_by_the_records_ttl_not_the_writers_clock() {
    let server = RedisServer::start();
    let admin_client = client(&server.url()).await;
    let store = common::redis_store(client(&server.url()).await)
        .with_replay_cache(1 << 20)
        .await
        .unwrap();
    let (app, runs) = router(IdempotencyLayer::new(store).with_retention(Duration::from_secs(60)));
    send(&app, payment("skewed", "{}")).await;
    let keys = admin(&admin_client, &["KEYS", "idempotency:*"]).await;
    let keys: Vec<String> = keys.convert().unwrap();
    assert_eq!(keys.len(), 1, "{keys:?}");
    admin(&admin_client, &["PEXPIRE", &keys[0], "300"]).await;
    assert!(
        send(&app, payment("skewed", "{}")).await.is_replay(),
        "from Redis; a copy is made"
    );
    reset_stats(&admin_client).await;
    assert!(send(&app, payment("skewed", "{}")).await.is_replay());
    assert_eq!(round_trips(&admin_client).await, 0, "from the copy");
    tokio::time::sleep(Duration::from_millis(400)).await;
    let after = send(&app, payment("skewed", "{}")).await;
    assert!(!after.is_replay(), "the copy outlived its record");
    assert_eq!(runs.get(), 2);
}

// A replay cache belongs to the prefix it was made with: it holds that namespace's records and
// hears that namespace's purges. A later `with_prefix` (on the store or a clone) is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[should_panic(expected = "with_prefix after with_replay_cache")]
async fn a_prefix_set_after_the_replay_cache_is_refused() {
    let server = RedisServer::start();
    let store = common::redis_store(client(&server.url()).await)
        .with_prefix("tenant-a")
        .with_replay_cache(1 << 20)
        .await
        .unwrap();
    let _other_namespace = store.clone().with_prefix("tenant-b");
}

// A cached replay is not new work: it needs no in-flight permit, so it is answered at the bound
// while a new key is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cached_replay_is_answered_at_the_in_flight_bound() {
    use tower_idempotency::{Begin, Coordinator, Error, Fingerprint};
    let server = RedisServer::start();
    let store = common::redis_store(client(&server.url()).await)
        .with_replay_cache(1 << 20)
        .await
        .unwrap();
    let coordinator = Coordinator::new(store).with_max_in_flight(1);
    let key = |k: &str| RecordKey::new(None, IdempotencyKey::parse(k).unwrap());
    let body = Fingerprint::new([b"body".as_slice()]);
    let Begin::Claimed(claim) = coordinator.begin(&key("done"), &body).await.unwrap() else {
        panic!("a new key is claimed");
    };
    claim.complete("stored".into()).await.unwrap();
    // The first repeat comes from Redis and leaves a copy.
    assert!(matches!(
        coordinator.begin(&key("done"), &body).await,
        Ok(Begin::Completed(_))
    ));

    let Begin::Claimed(running) = coordinator.begin(&key("running"), &body).await.unwrap() else {
        panic!("a new key is claimed");
    };
    match coordinator.begin(&key("done"), &body).await {
        Ok(Begin::Completed(stored)) => assert_eq!(stored, "stored"),
        other => panic!("a cached replay at the bound: {other:?}"),
    }
    let other_body = Fingerprint::new([b"other".as_slice()]);
    assert!(matches!(
        coordinator.begin(&key("done"), &other_body).await,
        Ok(Begin::Mismatch)
    ));
    assert!(matches!(
        coordinator.begin(&key("new"), &body).await,
        Err(Error::AtCapacity)
    ));
    running.release().await.unwrap();
}

/// Warnings logged while `run` is polled on this thread.
async fn warnings_logged_by<F: std::future::Future>(run: F) -> (F::Output, Vec<String>) {
    use std::sync::{Arc, Mutex};
    use tracing_subscriber::layer::SubscriberExt;

    struct Capture(Arc<Mutex<Vec<String>>>);
    impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Capture {
        fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
            if *event.metadata().level() == tracing::Level::WARN {
                self.0.lock().unwrap().push(common::event_message(event));
            }
        }
    }
    let warnings = Arc::new(Mutex::new(Vec::new()));
    let subscriber = tracing_subscriber::registry().with(Capture(warnings.clone()));
    let output = {
        let _guard = tracing::subscriber::set_default(subscriber);
        run.await
    };
    let logged = warnings.lock().unwrap().clone();
    (output, logged)
}

// Records all have a TTL, so an evicting policy can drop a running request's record: connecting
// says so, naming the policy.
#[tokio::test(flavor = "current_thread")]
async fn connecting_warns_when_redis_may_evict_records() {
    let evicting = RedisServer::start_with(&["--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru"]);
    let (store, warnings) = warnings_logged_by(common::connect(&evicting.url())).await;
    store.unwrap();
    assert!(
        warnings
            .iter()
            .any(|w| w.contains("maxmemory-policy allkeys-lru")),
        "{warnings:?}"
    );
    let safe = RedisServer::start_with(&["--maxmemory", "64mb", "--maxmemory-policy", "noeviction"]);
    let (store, warnings) = warnings_logged_by(common::connect(&safe.url())).await;
    let store = store.unwrap();
    assert!(warnings.is_empty(), "{warnings:?}");
    // A store built on a client of its own is checked when it loads its scripts.
    let (loaded, warnings) =
        warnings_logged_by(common::redis_store(client(&evicting.url()).await).load_scripts()).await;
    loaded.unwrap();
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    drop(store);
}

// Under noeviction a full Redis refuses writes: a completion that fails so says "out of memory".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_refused_for_memory_says_so() {
    use tower_idempotency::{Begin, Coordinator, Error, Fingerprint};
    let server = RedisServer::start_with(&["--maxmemory-policy", "noeviction"]);
    let admin_client = client(&server.url()).await;
    let coordinator = Coordinator::new(common::redis_store(client(&server.url()).await));
    let key = RecordKey::new(None, IdempotencyKey::parse("oom").unwrap());
    let Begin::Claimed(claim) = coordinator
        .begin(&key, &Fingerprint::new([b"body".as_slice()]))
        .await
        .unwrap()
    else {
        panic!("a new key is claimed");
    };
    // Over maxmemory from here on (the check is made before each write).
    admin(&admin_client, &["CONFIG", "SET", "maxmemory", "1"]).await;
    match claim.complete("stored".into()).await {
        Err(Error::Store(error)) => {
            let text = error.to_string();
            assert!(text.contains("out of memory"), "{text}");
        }
        other => panic!("a completion over maxmemory: {other:?}"),
    }
}

/// A number from `INFO <section>`, e.g. `connected_clients` from `clients`.
async fn info_number(client: &Client, section: &str, field: &str) -> u64 {
    let info = admin(client, &["INFO", section]).await;
    let info = info.as_str().unwrap().into_owned();
    info.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {field} in INFO {section}:\n{info}"))
}

/// The data segments this process has sent to the Redis on `port`, over all its connections
/// there (`tcpi_data_segs_out` of `TCP_INFO`, Linux 4.6 and later).
fn segments_sent_to(port: u16) -> u64 {
    // Where `tcpi_data_segs_out` sits in `struct tcp_info` (include/uapi/linux/tcp.h).
    const DATA_SEGS_OUT: usize = 156;
    let mut total = 0;
    for entry in std::fs::read_dir("/proc/self/fd").expect("list /proc/self/fd") {
        let Some(fd) = entry
            .ok()
            .and_then(|e| e.file_name().to_str()?.parse::<i32>().ok())
        else {
            continue;
        };
        // SAFETY: both calls only write into the buffers given, of the lengths given; an `fd`
        // closed or reused meanwhile makes them fail or describe another socket, never worse.
        unsafe {
            let mut peer: libc::sockaddr_in = std::mem::zeroed();
            let mut len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
            let peer_ptr = (&mut peer as *mut libc::sockaddr_in).cast();
            if libc::getpeername(fd, peer_ptr, &mut len) != 0
                || peer.sin_family != libc::AF_INET as libc::sa_family_t
                || u16::from_be(peer.sin_port) != port
            {
                continue;
            }
            let mut info = [0u8; 256];
            let mut len = info.len() as libc::socklen_t;
            let info_ptr = info.as_mut_ptr().cast();
            if libc::getsockopt(fd, libc::IPPROTO_TCP, libc::TCP_INFO, info_ptr, &mut len) != 0 {
                continue;
            }
            assert!(
                len as usize >= DATA_SEGS_OUT + 4,
                "TCP_INFO without data_segs_out (Linux < 4.6)"
            );
            let count = &info[DATA_SEGS_OUT..DATA_SEGS_OUT + 4];
            total += u64::from(u32::from_ne_bytes(count.try_into().unwrap()));
        }
    }
    total
}

async fn connected_clients(client: &Client) -> u64 {
    info_number(client, "clients", "connected_clients").await
}

/// Concurrent calls reach Redis in shared socket writes (`src/store/redis/coalesce.rs`), and each caller still
/// gets its own answer: claims, completions and replays of 64 keys at once, each from a task of
/// its own as the requests of separate connections are. One worker thread: it has the LIFO slot
/// that makes fred write each command alone, and unlike two it cannot trickle the tasks to the
/// coalescing task a few at a time, which made the count depend on the machine's load.
#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn concurrent_calls_share_socket_writes_and_each_gets_its_own_answer() {
    use bytes::Bytes;
    use tower_idempotency::{ClaimOutcome, Fingerprint, OwnerToken, Store};

    const KEYS: usize = 64;
    const LEASE: Duration = Duration::from_secs(30);
    let server = RedisServer::start();
    let config = fred::types::config::Config::from_url(&server.url()).unwrap();
    let client = fred::types::Builder::from_config(config)
        .with_connection_config(|c| c.tcp.nodelay = Some(true))
        .build()
        .unwrap();
    client.init().await.unwrap();
    let stats = client.clone();
    // The heartbeat's pings are writes of their own: this counts the claims' alone.
    let store = common::redis_store(client).with_heartbeat(None);
    store.load_scripts().await.unwrap();
    let key = |i: usize| RecordKey::new(None, IdempotencyKey::parse(&format!("co-{i}")).unwrap());
    let body = |i: usize| Fingerprint::new([format!("body {i}").as_bytes()]);
    let owners: Vec<OwnerToken> = (0..KEYS).map(|_| OwnerToken::generate()).collect();
    // Runs `call` for every key, each in a task of its own, all released at once.
    async fn each_in_a_task<T, F>(call: impl Fn(usize) -> F) -> Vec<T>
    where
        F: std::future::Future<Output = T> + Send + 'static,
        T: Send + 'static,
    {
        let start = std::sync::Arc::new(tokio::sync::Barrier::new(KEYS + 1));
        let tasks: Vec<_> = (0..KEYS)
            .map(|i| {
                let (start, call) = (start.clone(), call(i));
                tokio::spawn(async move {
                    start.wait().await;
                    call.await
                })
            })
            .collect();
        start.wait().await;
        let mut answers = Vec::with_capacity(KEYS);
        for task in tasks {
            answers.push(task.await.unwrap());
        }
        answers
    }

    // Rounds of 64 claims, each from a task of its own, counting the TCP segments the store's
    // connection carries to Redis (`TCP_NODELAY` is set, so each socket write is one). Redis's
    // own count of reads is no measure: a busy Redis reads many writes at once. Sent one write
    // each, the 64 claims of a round take 64 segments; coalesced, 3 (the first claim alone, the
    // rest in one or two; Redis 7.0, 8.0 and Valkey 8.1, idle or loaded). The bound is 8 for the
    // median of 20 rounds, so that a round preempted on a busy machine does not decide it.
    const ROUNDS: usize = 20;
    let mut segments = Vec::with_capacity(ROUNDS);
    for round in (0..ROUNDS).rev() {
        let key = move |i: usize| key(round * KEYS + i);
        let before = segments_sent_to(server.port());
        let claims = each_in_a_task(|i| {
            let (store, owner) = (store.clone(), owners[i].clone());
            async move { store.claim(&key(i), &body(i), &owner, LEASE).await }
        })
        .await;
        segments.push(segments_sent_to(server.port()) - before);
        for (i, claim) in claims.into_iter().enumerate() {
            assert_eq!(claim.unwrap(), ClaimOutcome::Claimed, "key {i}");
        }
    }
    segments.sort_unstable();
    assert!(
        segments[ROUNDS / 2] <= 8,
        "rounds of 64 concurrent claims took a median of {} socket writes: {segments:?}",
        segments[ROUNDS / 2]
    );

    // Completions, merged into few calls of the completion script (fred would write each call
    // alone): each record still gets its own payload and its own answer. Two of them lost their
    // claims: key 5's record was purged, key 9's claimed again by another owner.
    assert!(store.purge(&key(5)).await.unwrap());
    assert!(store.purge(&key(9)).await.unwrap());
    let usurper = OwnerToken::generate();
    let claimed_again = store.claim(&key(9), &body(9), &usurper, LEASE).await.unwrap();
    assert_eq!(claimed_again, ClaimOutcome::Claimed);
    admin(&stats, &["CONFIG", "RESETSTAT"]).await;
    let before = segments_sent_to(server.port());
    let completions = each_in_a_task(|i| {
        let (store, owner) = (store.clone(), owners[i].clone());
        // Payloads of different lengths: a record given another's arguments would show.
        let payload = Bytes::from(format!("result of key {i}{}", ".".repeat(i)));
        async move {
            store
                .complete(&key(i), &owner, payload, Duration::from_secs(3600))
                .await
        }
    })
    .await;
    let segments = segments_sent_to(server.port()) - before;
    for (i, completion) in completions.into_iter().enumerate() {
        assert_eq!(completion.unwrap(), ![5, 9].contains(&i), "key {i}");
    }
    // One script call per record would be 64 calls in 64 writes; merged, at most 32 records a
    // call: 3 calls here (the first alone, then the rest), in as many writes.
    let calls = command_calls(&stats, "evalsha").await;
    assert!(calls <= 8, "64 concurrent completions took {calls} script calls");
    assert!(
        segments <= 8,
        "64 concurrent completions took {segments} socket writes"
    );
    let in_flight = store.peek(&key(9), &body(9)).await.unwrap();
    assert!(
        matches!(in_flight, Some(ClaimOutcome::InFlight { .. })),
        "the newer owner's claim is left as it was: {in_flight:?}"
    );
    let usurpers_result = Bytes::from(format!("result of key 9{}", ".".repeat(9)));
    let key_9 = key(9);
    let completed = store.complete(&key_9, &usurper, usurpers_result, Duration::from_secs(3600));
    assert!(completed.await.unwrap(), "the newer owner completes its record");

    // Replays, and a mismatch among them: every answer is its own key's.
    let replays = each_in_a_task(|i| {
        let store = store.clone();
        let sent = if i == 7 {
            Fingerprint::new([b"another body".as_slice()])
        } else {
            body(i)
        };
        async move { store.claim(&key(i), &sent, &OwnerToken::generate(), LEASE).await }
    })
    .await;
    for (i, replay) in replays.into_iter().enumerate() {
        let expected = match i {
            7 => ClaimOutcome::Mismatch,
            // Purged before its completion, so nothing was stored: the key is claimed afresh.
            5 => ClaimOutcome::Claimed,
            _ => ClaimOutcome::Completed(Bytes::from(format!("result of key {i}{}", ".".repeat(i)))),
        };
        assert_eq!(replay.unwrap(), expected, "key {i}");
    }
}

/// Completions merged into one script call still reach Redis after its script cache was
/// flushed: the merged EVALSHA is refused as a whole (NOSCRIPT), and each completion falls back
/// to EVAL on its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn merged_completions_fall_back_to_eval_after_a_script_flush() {
    use bytes::Bytes;
    use tower_idempotency::{ClaimOutcome, Fingerprint, OwnerToken, Store};

    let (_server, client, store) = setup().await;
    store.load_scripts().await.unwrap();
    let key = |i: usize| RecordKey::new(None, IdempotencyKey::parse(&format!("fl-{i}")).unwrap());
    let body = Fingerprint::new([b"{}".as_slice()]);
    let mut owners = Vec::new();
    for i in 0..16 {
        let owner = OwnerToken::generate();
        let claim = store.claim(&key(i), &body, &owner, Duration::from_secs(30)).await;
        assert_eq!(claim.unwrap(), ClaimOutcome::Claimed);
        owners.push(owner);
    }
    admin(&client, &["SCRIPT", "FLUSH"]).await;
    reset_stats(&client).await;
    // All 16 from one task on the runtime's one worker: the first goes out at once, the other 15
    // are queued before the coalescing task can run, so they are merged whatever the machine's
    // load. (Sixteen tasks woken by a barrier from the test's own thread were merged only if
    // that thread woke them all before the worker ran them: CI's load once sent all 16 alone.)
    let completing = {
        let store = store.clone();
        tokio::spawn(async move {
            let completions = owners.iter().enumerate().map(|(i, owner)| {
                let payload = Bytes::from(format!("result {i}"));
                let (store, key) = (store.clone(), key(i));
                async move {
                    store
                        .complete(&key, owner, payload, Duration::from_secs(60))
                        .await
                }
            });
            futures_util::future::join_all(completions).await
        })
    };
    for (i, completed) in completing.await.unwrap().into_iter().enumerate() {
        assert!(completed.unwrap(), "key {i}");
    }
    let merged = command_calls(&client, "evalsha").await;
    assert!(merged < 16, "the completions were merged: {merged} EVALSHA calls");
    assert!(command_calls(&client, "eval").await >= 1);
    for i in 0..16 {
        let replay = store.peek(&key(i), &body).await.unwrap();
        let expected = ClaimOutcome::Completed(Bytes::from(format!("result {i}")));
        assert_eq!(replay, Some(expected), "key {i}");
    }
}

/// The connections a store opened itself (`connect`, a replay cache's subscriber, the waiting
/// requests' subscriber) close when its last clone is dropped; fred would otherwise keep them
/// open, and reconnecting, for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_a_connected_store_closes_the_connections_it_opened() {
    let (server, client, _) = setup().await;
    let before = connected_clients(&client).await;
    let store = common::connect(&server.url())
        .await
        .unwrap()
        .with_replay_cache(1 << 20)
        .await
        .unwrap();
    let watched = RecordKey::new(None, IdempotencyKey::parse("watched").unwrap());
    let watch = tower_idempotency::Store::watch(&store, &watched).await.unwrap();
    assert!(watch.is_some(), "Redis watches keys on a subscriber of its own");
    drop(watch);
    let clone = store.clone();
    let opened = 3; // the client, the cache's subscriber, the waiting requests' subscriber
    assert_eq!(connected_clients(&client).await, before + opened);
    drop(store);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        connected_clients(&client).await,
        before + opened,
        "a clone still holds them"
    );
    drop(clone);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let now = connected_clients(&client).await;
        if now == before {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{now} clients connected 5 s after the store was dropped, {before} before it"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A raw record, read with `GET`: `TIR`, a version byte, the owner's length (u16), the owner, the
/// state (`F`, `C`), the deadline (u64, ms), the fingerprint and its policy tag, the payload.
#[derive(Debug, PartialEq, Eq)]
struct Raw {
    owner: bytes::Bytes,
    state: u8,
    deadline: u64,
    /// The fingerprint and its policy tag, then the payload.
    rest: bytes::Bytes,
}

/// The fingerprint and its policy tag: what follows the deadline, before the payload.
const FINGERPRINT_AND_TAG: usize = 32 + 8;

impl Raw {
    fn parse(record: &bytes::Bytes) -> Self {
        assert_eq!(&record[..3], b"TIR", "a record: {record:?}");
        let head = 6 + usize::from(u16::from_be_bytes([record[4], record[5]]));
        Self {
            owner: record.slice(6..head),
            state: record[head],
            deadline: u64::from_be_bytes(record[head + 1..head + 9].try_into().unwrap()),
            rest: record.slice(head + 9..),
        }
    }

    /// Where the deadline starts in the record.
    fn deadline_at(record: &[u8]) -> usize {
        6 + usize::from(u16::from_be_bytes([record[4], record[5]])) + 1
    }
}

async fn raw(client: &Client, store: &RedisStore, key: &RecordKey) -> Option<bytes::Bytes> {
    client.get(store.redis_key(key)).await.expect("GET")
}

fn now_ms() -> u64 {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
    u64::try_from(now.unwrap().as_millis()).unwrap()
}

fn record_key(name: &str) -> RecordKey {
    RecordKey::new(None, IdempotencyKey::parse(name).unwrap())
}

const LEASE: Duration = Duration::from_secs(30);
const RETENTION: Duration = Duration::from_secs(3600);

/// complete.lua decides by the record's head (this owner's?) and state, and builds the completed
/// record from the in-flight one it reads: each of its branches. In flight and this owner's:
/// completed with one `SET` (the claim's fingerprint kept, the payload after it), the notice only
/// if a request waits for it. Completed already by this owner (a completion made again): done, its
/// payload kept, its retention restarted. Anything else is a lost claim, left as it is: another
/// owner's record, a key holding another type, this owner's record of another length than an
/// in-flight one has.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn complete_lua_decides_by_the_records_head_and_state() {
    use bytes::Bytes;
    use tower_idempotency::{ClaimOutcome, Fingerprint, OwnerToken, Store};

    let (_server, client, store) = setup().await;
    store.load_scripts().await.unwrap();
    let body = Fingerprint::new([b"{}".as_slice()]);
    let payload = Bytes::from_static(b"the stored answer");
    let claim = |name: &str| {
        let (key, owner, store) = (record_key(name), OwnerToken::generate(), store.clone());
        async move {
            let claimed = store.claim(&key, &body, &owner, LEASE).await.unwrap();
            assert_eq!(claimed, ClaimOutcome::Claimed);
            (key, owner)
        }
    };
    let assert_completed = |completed: &Bytes, in_flight: &Bytes, owner: &OwnerToken, payload: &[u8]| {
        let (completed, in_flight) = (Raw::parse(completed), Raw::parse(in_flight));
        assert_eq!(completed.state, b'C');
        assert_eq!(completed.owner, Bytes::from(owner.as_str().to_owned()));
        assert!(completed.deadline.abs_diff(now_ms() + 3_600_000) < 60_000);
        assert_eq!(
            completed.rest[..FINGERPRINT_AND_TAG],
            in_flight.rest[..],
            "the claim's fingerprint"
        );
        assert_eq!(&completed.rest[FINGERPRINT_AND_TAG..], payload);
    };

    // In flight, untouched since the claim: one script call, its one SET, no notice.
    let (key, owner) = claim("in-flight").await;
    let in_flight = raw(&client, &store, &key).await.unwrap();
    reset_stats(&client).await;
    assert!(store
        .complete(&key, &owner, payload.clone(), RETENTION)
        .await
        .unwrap());
    let completed = raw(&client, &store, &key).await.unwrap();
    assert_completed(&completed, &in_flight, &owner, &payload);
    let spent = (
        command_calls(&client, "evalsha").await,
        command_calls(&client, "set").await,
        command_calls(&client, "spublish").await,
    );
    assert_eq!(spent, (1, 1, 0), "one script call, its one SET, no notice");

    // Completed again by its owner, with a longer retention: done, the payload as the first
    // completion left it, the retention restarted (the deadline and the key's TTL).
    let again = store.complete(&key, &owner, Bytes::from_static(b"another"), RETENTION * 2);
    assert!(again.await.unwrap(), "a completion made again succeeds");
    let kept = Raw::parse(&raw(&client, &store, &key).await.unwrap());
    assert_eq!(kept.rest, Raw::parse(&completed).rest, "the payload kept");
    assert!(
        kept.deadline.abs_diff(now_ms() + 7_200_000) < 60_000,
        "the deadline restarted"
    );
    let ttl: i64 = client.pttl(store.redis_key(&key)).await.unwrap();
    assert!(ttl > 3_600_000, "the TTL restarted: {ttl} ms");

    // Changed since the claim: a renewal whose answer was lost (a later deadline), and a
    // waiter's mark (the deadline's lowest bit, which asks for the notice). Still this owner's
    // in flight: completed all the same, with the notice for the marked one.
    for (name, notices) in [("renewed-unseen", 0), ("marked", 1)] {
        let (key, owner) = claim(name).await;
        let record = raw(&client, &store, &key).await.unwrap();
        let deadline = Raw::parse(&record).deadline;
        let changed = if notices == 0 {
            deadline + 5_000
        } else {
            deadline | 1
        };
        let at = Raw::deadline_at(&record) as u32;
        let _: i64 = client
            .setrange(store.redis_key(&key), at, changed.to_be_bytes().to_vec())
            .await
            .unwrap();
        reset_stats(&client).await;
        assert!(
            store
                .complete(&key, &owner, payload.clone(), RETENTION)
                .await
                .unwrap(),
            "{name}"
        );
        let completed = raw(&client, &store, &key).await.unwrap();
        assert_completed(&completed, &record, &owner, &payload);
        assert_eq!(command_calls(&client, "spublish").await, notices, "{name}");
    }

    // Lost: purged, then claimed by another owner. Refused, the newer record left as it was.
    let (key, owner) = claim("lost").await;
    assert!(store.purge(&key).await.unwrap());
    let claimed = store
        .claim(&key, &body, &OwnerToken::generate(), LEASE)
        .await
        .unwrap();
    assert_eq!(claimed, ClaimOutcome::Claimed);
    let before = raw(&client, &store, &key).await;
    let late = store.complete(&key, &owner, payload.clone(), RETENTION);
    assert!(!late.await.unwrap(), "the lost claim's completion is refused");
    assert_eq!(raw(&client, &store, &key).await, before, "left as it was");

    // This owner's record, in flight, but shorter than an in-flight record (the fingerprint cut):
    // no fingerprint to keep, so no record is built from it.
    let (key, owner) = claim("cut").await;
    let record = raw(&client, &store, &key).await.unwrap();
    let cut = record.slice(..record.len() - 8);
    let _: () = client
        .set(store.redis_key(&key), cut.clone(), None, None, false)
        .await
        .unwrap();
    assert!(!store
        .complete(&key, &owner, payload.clone(), RETENTION)
        .await
        .unwrap());
    assert_eq!(raw(&client, &store, &key).await, Some(cut), "left as it was");

    // A key holding another type than a string: refused, left as it is.
    let (key, owner) = claim("another-type").await;
    let _: () = client.del(store.redis_key(&key)).await.unwrap();
    let _: () = client.hset(store.redis_key(&key), ("foo", "bar")).await.unwrap();
    assert!(!store.complete(&key, &owner, payload, RETENTION).await.unwrap());
    let kind = admin(&client, &["TYPE", &store.redis_key(&key)]).await;
    assert_eq!(kind.as_str().as_deref(), Some("hash"), "left as it is");
}

/// A completed record takes the memory one `SET` of its bytes takes: complete.lua writes the
/// whole record with one `SET` (it once appended the payload, and `APPEND` left the string room
/// for as many bytes again: 2.7 KB against 1.4 KB for a 1 KiB answer). Read with `MEMORY
/// USAGE`, against a probe key of the same length written with one `SET`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completed_record_takes_the_memory_of_one_set() {
    use bytes::Bytes;
    use tower_idempotency::{ClaimOutcome, Fingerprint, OwnerToken, Store};

    let (_server, client, store) = setup().await;
    let memory = |key: String| {
        let client = client.clone();
        async move {
            let usage = admin(&client, &["MEMORY", "USAGE", &key, "SAMPLES", "0"]).await;
            usage
                .as_u64()
                .unwrap_or_else(|| panic!("MEMORY USAGE {key}: {usage:?}"))
        }
    };
    let body = Fingerprint::new([b"{}".as_slice()]);
    for size in [0, 100, 1000, 20_000] {
        let (key, owner) = (record_key(&format!("weighed-{size:05}")), OwnerToken::generate());
        let claimed = store.claim(&key, &body, &owner, LEASE).await.unwrap();
        assert_eq!(claimed, ClaimOutcome::Claimed);
        let payload = Bytes::from(vec![b'p'; size]);
        assert!(store
            .complete(&key, &owner, payload.clone(), RETENTION)
            .await
            .unwrap());
        let record = raw(&client, &store, &key).await.expect("completed");
        let parsed = Raw::parse(&record);
        assert_eq!(parsed.state, b'C');
        assert_eq!(
            parsed.rest.slice(FINGERPRINT_AND_TAG..),
            payload,
            "the payload after the fingerprint"
        );

        let name = store.redis_key(&key);
        let probe = format!("{}x", &name[..name.len() - 1]);
        let expiry = Some(Expiration::PX(60_000));
        let _: () = client
            .set(probe.as_str(), record.clone(), expiry, None, false)
            .await
            .unwrap();
        let (completed, one_set) = (memory(name.clone()).await, memory(probe).await);
        assert_eq!(
            completed,
            one_set,
            "a {size} B payload: the completed record takes {completed} B, one SET of its {} B {one_set} B",
            record.len()
        );
    }
}

/// The waiters' notice (`SPUBLISH <record key>:settled`) goes only for a record someone waits
/// for: a completion or release of a record nobody waits for publishes nothing, one a waiter has
/// read (`Store::claim_waiting`, which marks it: the in-flight deadline's lowest bit, which
/// owners write even) publishes once and wakes the waiter's watch, and a renewal keeps the mark.
/// A waiter's read answers what a claim answers, and marks only another owner's record in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_notice_goes_only_for_a_record_someone_waits_for() {
    use bytes::Bytes;
    use tower_idempotency::{ClaimOutcome, Fingerprint, OwnerToken, Store};

    let (_server, client, store) = setup().await;
    let body = Fingerprint::new([b"{}".as_slice()]);
    let deadline = |record: Option<Bytes>| Raw::parse(&record.expect("a record")).deadline;
    for settle in ["complete", "release"] {
        for watched in [false, true] {
            let (key, owner) = (record_key(&format!("{settle}-{watched}")), OwnerToken::generate());
            let what = format!("{settle}, watched {watched}");
            let claimed = store.claim(&key, &body, &owner, LEASE).await.unwrap();
            assert_eq!(claimed, ClaimOutcome::Claimed);
            let written = deadline(raw(&client, &store, &key).await);
            assert_eq!(written % 2, 0, "{what}: an owner writes its deadline even");
            let mut watch = None;
            let other = OwnerToken::generate();
            let read = if watched {
                watch = Some(store.watch(&key).await.unwrap().expect("Redis notifies"));
                store.claim_waiting(&key, &body, &other, LEASE).await.unwrap()
            } else {
                // A plain claim that finds it in flight (a retry answered 409) marks nothing.
                store.claim(&key, &body, &other, LEASE).await.unwrap()
            };
            assert!(matches!(read, ClaimOutcome::InFlight { .. }), "{what}");
            let marked = deadline(raw(&client, &store, &key).await) % 2 == 1;
            assert_eq!(marked, watched, "{what}: marked");
            assert!(store.renew(&key, &owner, LEASE).await.unwrap(), "{what}");
            let renewed = deadline(raw(&client, &store, &key).await);
            assert_eq!(renewed % 2 == 1, watched, "{what}: the renewal keeps the mark");
            reset_stats(&client).await;
            let settled = match settle {
                "complete" => store.complete(&key, &owner, Bytes::from_static(b"done"), RETENTION),
                _ => store.release(&key, &owner),
            };
            assert!(settled.await.unwrap(), "{what}");
            let notices = command_calls(&client, "spublish").await;
            assert_eq!(notices, u64::from(watched), "{what}: notices sent");
            if let Some(watch) = watch.as_mut() {
                let woken = tokio::time::timeout(Duration::from_secs(2), watch.changed()).await;
                assert_eq!(woken.ok(), Some(true), "{what}: the watcher is woken");
            }
        }
    }
    // A completed record is replayed as it is (or a mismatch), a free key claimed unmarked.
    let (done, owner) = (record_key("completed-then-read"), OwnerToken::generate());
    store.claim(&done, &body, &owner, LEASE).await.unwrap();
    let kept = Bytes::from_static(b"kept");
    assert!(store
        .complete(&done, &owner, kept.clone(), RETENTION)
        .await
        .unwrap());
    let before = raw(&client, &store, &done).await;
    let read = store
        .claim_waiting(&done, &body, &OwnerToken::generate(), LEASE)
        .await
        .unwrap();
    assert_eq!(read, ClaimOutcome::Completed(kept));
    assert_eq!(raw(&client, &store, &done).await, before);
    let other = Fingerprint::new([b"other".as_slice()]);
    let read = store
        .claim_waiting(&done, &other, &OwnerToken::generate(), LEASE)
        .await
        .unwrap();
    assert_eq!(read, ClaimOutcome::Mismatch);
    let (free, waiter) = (record_key("free-when-read"), OwnerToken::generate());
    let read = store.claim_waiting(&free, &body, &waiter, LEASE).await.unwrap();
    assert_eq!(read, ClaimOutcome::Claimed);
    assert_eq!(deadline(raw(&client, &store, &free).await) % 2, 0);
}
