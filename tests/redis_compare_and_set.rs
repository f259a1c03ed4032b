//! The owner-checked transitions (complete, renew, release) as native compare-and-set commands
//! (`SET … IFEQ`, `DELEX … IFEQ`, `DELIFEQ`) where the server has them, and as the Lua scripts
//! elsewhere, each on the server it is meant for, whatever `REDIS_SERVER_BIN` says: Redis 7.0 (the
//! system's `redis-server`) and the servers `scripts/newer-servers.sh` fetches (Redis 8.0 and 8.6,
//! Valkey 8.1 and 9.1). A test whose server is missing fails, never skips.
//!
//! What each path costs is read from the server's `INFO commandstats` (a script's inner calls
//! are counted there too, so `evalsha` tells the script path from the native one); the records
//! are read raw (`GET`): `TIR`, a version byte, the owner's length (u16), the owner, the state
//! (`F`, `C`), the deadline (u64, ms), the fingerprint (32 bytes), the payload.

mod common;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::app::{dropping_the_completion_reply, payment, payment_with, reconciled, router, send};
use common::proxy::FaultProxy;
use common::{admin, client, client_with_attempts, command_calls, newer_server, RedisServer};
use fred::clients::Client;
use fred::interfaces::{ClientLike, KeysInterface};
use fred::types::Expiration;
use http::StatusCode;
use tower_idempotency::{
    ClaimOutcome, Fingerprint, IdempotencyKey, IdempotencyLayer, OwnerToken, RecordKey, RedisStore,
    ReplicaAcks, Store,
};

const LEASE: Duration = Duration::from_secs(30);
const RETENTION: Duration = Duration::from_secs(3600);

fn key(name: &str) -> RecordKey {
    RecordKey::new(None, IdempotencyKey::parse(name).unwrap())
}

fn body() -> Fingerprint {
    Fingerprint::new([b"{}".as_slice()])
}

/// A store connected with `RedisStore::connect` (which asks the server what it has before it
/// answers), on the native path when `native` is true (`with_native_transitions(true)`, which
/// keeps what `connect` found), else on the default, the scripts.
async fn store(url: &str, native: bool) -> RedisStore {
    let store = RedisStore::connect(url)
        .await
        .unwrap_or_else(|error| panic!("connect to {url}: {error}"));
    if native {
        store.with_native_transitions(true)
    } else {
        store
    }
}

/// The commands the transitions may take, as `INFO commandstats` counts them.
#[derive(Debug, PartialEq, Eq, Clone, Copy)]
struct Calls {
    /// Claims, native `SET … IFEQ`, and the one `SET` complete.lua writes a completion with.
    set: u64,
    evalsha: u64,
    delex: u64,
    delifeq: u64,
    /// The waiters' notice: sent by the scripts from inside, or by the store beside a native
    /// command.
    spublish: u64,
}

async fn calls(stats: &Client) -> Calls {
    Calls {
        set: command_calls(stats, "set").await,
        evalsha: command_calls(stats, "evalsha").await + command_calls(stats, "eval").await,
        delex: command_calls(stats, "delex").await,
        delifeq: command_calls(stats, "delifeq").await,
        spublish: command_calls(stats, "spublish").await,
    }
}

/// Calls of `command` that failed (`failed_calls` in `INFO commandstats`).
async fn failed_calls(stats: &Client, command: &str) -> u64 {
    let info = admin(stats, &["INFO", "commandstats"]).await;
    let info = info.as_str().expect("INFO answers text").into_owned();
    let prefix = format!("cmdstat_{command}:");
    let line = info
        .lines()
        .find_map(|line| line.strip_prefix(&prefix))
        .unwrap_or_default();
    let failed = line
        .split(',')
        .find_map(|field| field.strip_prefix("failed_calls="));
    failed.and_then(|n| n.parse().ok()).unwrap_or(0)
}

/// Waits until `store` completes natively (it has asked the server what it has, which a store
/// built from a client does in the background): claims and completes keys of its own until
/// one takes no script. Panics after 15 s.
async fn until_native(store: &RedisStore, stats: &Client) {
    let n = std::sync::atomic::AtomicUsize::new(0);
    common::until_async("the store completes natively", || async {
        let before = calls(stats).await.evalsha;
        let (key, owner) = (
            key(&format!("warm-up-{}", n.fetch_add(1, Ordering::Relaxed))),
            OwnerToken::generate(),
        );
        assert_eq!(
            store.claim(&key, &body(), &owner, LEASE).await.unwrap(),
            ClaimOutcome::Claimed
        );
        assert!(store
            .complete(&key, &owner, Bytes::new(), RETENTION)
            .await
            .unwrap());
        calls(stats).await.evalsha == before
    })
    .await;
}

async fn reset_stats(stats: &Client) {
    admin(stats, &["CONFIG", "RESETSTAT"]).await;
}

/// A raw record: its owner, state, deadline (ms), fingerprint, policy tag and payload.
#[derive(Debug, PartialEq, Eq)]
struct Raw {
    owner: Bytes,
    state: u8,
    deadline: u64,
    rest: Bytes,
}

/// The fingerprint and its policy tag: what follows the deadline, before the payload.
const FINGERPRINT_AND_TAG: usize = 32 + 8;

impl Raw {
    fn parse(record: &Bytes) -> Self {
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
    fn deadline_at(record: &Bytes) -> usize {
        6 + usize::from(u16::from_be_bytes([record[4], record[5]])) + 1
    }
}

async fn raw(stats: &Client, store: &RedisStore, key: &RecordKey) -> Option<Bytes> {
    stats.get(store.redis_key(key)).await.expect("GET")
}

fn now_ms() -> u64 {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
    u64::try_from(now.unwrap().as_millis()).unwrap()
}

/// Generates, for each `async fn test(server: &'static str)`, a test per newest server:
/// `test::redis_8_6` and `test::valkey_9_1`.
macro_rules! on_the_newest_servers {
    ($($test:ident),* $(,)?) => {
        $(
            mod $test {
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn redis_8_6() {
                    super::$test("redis-8.6").await
                }
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn valkey_9_1() {
                    super::$test("valkey-9.1").await
                }
            }
        )*
    };
}

mod detection {
    //! Which command each transition takes, per server: one fresh request (claim, complete),
    //! one renewal, one release (a handler that answers 500).
    use super::*;

    /// What a server is expected to do for each transition.
    #[derive(Clone, Copy)]
    enum Path {
        /// Redis 7.0, 8.0, or any server without `with_native_transitions(true)` (the default).
        Scripts,
        /// Valkey 8.1: `SET … IFEQ`, but release by the script.
        SetIfEq,
        /// Redis 8.4+: `SET … IFEQ` and `DELEX … IFEQ`.
        Delex,
        /// Valkey 9: `SET … IFEQ` and `DELIFEQ`.
        DelIfEq,
    }

    fn expected(path: Path) -> [Calls; 3] {
        let calls = |set, evalsha, delex, delifeq, spublish| Calls {
            set,
            evalsha,
            delex,
            delifeq,
            spublish,
        };
        let native_sets = !matches!(path, Path::Scripts);
        // Nobody waits for these records: no notice (`SPUBLISH`) goes with any transition
        // (the_notice_goes_only_for_a_record_someone_waits_for).
        let complete = if native_sets {
            calls(2, 0, 0, 0, 0) // the claim, then SET … IFEQ
        } else {
            calls(2, 1, 0, 0, 0) // the claim, then complete.lua (which writes with one SET)
        };
        let renew = if native_sets {
            calls(1, 0, 0, 0, 0)
        } else {
            calls(0, 1, 0, 0, 0)
        };
        let release = match path {
            Path::Scripts | Path::SetIfEq => calls(1, 1, 0, 0, 0),
            Path::Delex => calls(1, 0, 1, 0, 0),
            Path::DelIfEq => calls(1, 0, 0, 1, 0),
        };
        [complete, renew, release]
    }

    async fn transitions_take(server: &str, native: bool, path: Path) {
        let server_name = server;
        let server = RedisServer::start_binary(newer_server(server));
        let stats = client(&server.url()).await;
        let store = store(&server.url(), native).await;
        store.load_scripts().await.unwrap();
        let (app, _) = router(IdempotencyLayer::new(store.clone()));
        let [complete, renew, release] = expected(path);

        reset_stats(&stats).await;
        let created = send(&app, payment("fresh", "{}")).await;
        assert_eq!(created.status, StatusCode::CREATED);
        assert_eq!(calls(&stats).await, complete, "{server_name}: a fresh request");
        let (first, replay) = (created.body, send(&app, payment("fresh", "{}")).await);
        assert!(replay.is_replay(), "{server_name}: stored");
        assert_eq!(replay.body, first, "{server_name}: stored as answered");

        let (key, owner) = (key("renewed"), OwnerToken::generate());
        let claimed = store.claim(&key, &body(), &owner, LEASE).await.unwrap();
        assert_eq!(claimed, ClaimOutcome::Claimed);
        reset_stats(&stats).await;
        assert!(store.renew(&key, &owner, LEASE).await.unwrap(), "renewed");
        assert_eq!(calls(&stats).await, renew, "{server_name}: a renewal");
        let renewed = Raw::parse(&raw(&stats, &store, &key).await.unwrap());
        assert_eq!(renewed.state, b'F', "{server_name}");
        assert!(
            renewed.deadline.abs_diff(now_ms() + 30_000) < 5_000,
            "{server_name}"
        );
        let done = store.complete(&key, &owner, Bytes::from_static(b"after"), RETENTION);
        assert!(done.await.unwrap(), "{server_name}: completed after its renewal");

        reset_stats(&stats).await;
        let answer = send(&app, payment_with("released", &[("x-status", "500")])).await;
        assert_eq!(answer.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(calls(&stats).await, release, "{server_name}: a release");
        assert_eq!(
            raw(&stats, &store, &super::key("released")).await,
            None,
            "released"
        );
    }

    /// One test per line: its name, the server, whether native transitions are on, the path.
    macro_rules! transitions {
        ($($test:ident: $server:literal, $native:literal, $path:expr;)*) => {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    transitions_take($server, $native, $path).await;
                }
            )*
        };
    }

    transitions! {
        redis_7_0_runs_the_scripts: "redis-7.0", true, Path::Scripts;
        redis_8_0_runs_the_scripts: "redis-8.0", true, Path::Scripts;
        valkey_8_1_sets_natively_and_releases_by_script: "valkey-8.1", true, Path::SetIfEq;
        redis_8_6_sets_and_deletes_natively: "redis-8.6", true, Path::Delex;
        valkey_9_1_sets_and_deletes_natively: "valkey-9.1", true, Path::DelIfEq;
        redis_8_6_runs_the_scripts_by_default: "redis-8.6", false, Path::Scripts;
        valkey_9_1_runs_the_scripts_by_default: "valkey-9.1", false, Path::Scripts;
    }
}

/// Two instances of a fleet mid-upgrade on one server: `a` on the native path, `b` on the
/// scripts. Whatever one wrote, the other reads, waits on and answers as its own would.
async fn a_mixed_fleet_shares_one_server(server: &'static str) {
    let redis = RedisServer::start_binary(newer_server(server));
    let stats = client(&redis.url()).await;
    let (native, scripted) = (store(&redis.url(), true).await, store(&redis.url(), false).await);
    let layer =
        |store: &RedisStore| IdempotencyLayer::new(store.clone()).with_max_wait(Duration::from_secs(5));
    let ((a, runs_a), (b, runs_b)) = (router(layer(&native)), router(layer(&scripted)));
    let ran = |key: &str| runs_a.of(key) + runs_b.of(key);

    // One claims and completes, the other replays; both ways.
    for (first, then, key) in [(&a, &b, "a-then-b"), (&b, &a, "b-then-a")] {
        let created = send(first, payment(key, "{}")).await;
        assert_eq!(created.status, StatusCode::CREATED, "{server} {key}");
        let replay = send(then, payment(key, "{}")).await;
        assert!(replay.is_replay(), "{server} {key}: {}", replay.status);
        assert_eq!(replay.body, created.body, "{server} {key}");
        // The same key with another body is a mismatch, on either instance.
        for app in [&a, &b] {
            let other = send(app, payment(key, "{\"other\":1}")).await;
            assert_eq!(other.status, StatusCode::CONFLICT, "{server} {key}");
            assert!(
                other.problem_type().ends_with("#variant.Mismatch"),
                "{server} {key}"
            );
        }
        assert_eq!(ran(key), 1, "{server} {key}");
    }

    // A key running on one instance is in flight on the other; both ways.
    for (first, runs, then, key) in [(&a, &runs_a, &b, "busy-on-a"), (&b, &runs_b, &a, "busy-on-b")] {
        let slow = {
            let first = first.clone();
            tokio::spawn(async move { send(&first, payment_with(key, &[("x-delay-ms", "400")])).await })
        };
        common::until("the slow request runs", || runs.of(key) == 1).await;
        let busy = send(then, payment(key, "{}")).await;
        assert_eq!(busy.status, StatusCode::CONFLICT, "{server} {key}");
        assert!(
            busy.problem_type().ends_with("#variant.InFlight"),
            "{server} {key}"
        );
        assert_eq!(slow.await.unwrap().status, StatusCode::CREATED);
    }

    // The records both paths write are alike but for the owner and the deadline: claimed,
    // renewed, then completed with the same payload.
    let payload = Bytes::from_static(b"the same payload");
    let mut records = Vec::new();
    for (store, name) in [(&native, "written-by-a"), (&scripted, "written-by-b")] {
        let (key, owner) = (key(name), OwnerToken::generate());
        assert_eq!(
            store.claim(&key, &body(), &owner, LEASE).await.unwrap(),
            ClaimOutcome::Claimed
        );
        let claimed = Raw::parse(&raw(&stats, store, &key).await.unwrap());
        assert!(store.renew(&key, &owner, LEASE * 2).await.unwrap());
        let renewed = Raw::parse(&raw(&stats, store, &key).await.unwrap());
        assert!(store
            .complete(&key, &owner, payload.clone(), RETENTION)
            .await
            .unwrap());
        let completed = Raw::parse(&raw(&stats, store, &key).await.unwrap());
        assert_eq!(completed.owner, owner.as_str().as_bytes(), "{server} {name}");
        records.push([claimed, renewed, completed]);
    }
    let [ref by_a, ref by_b] = records[..] else {
        unreachable!()
    };
    for (step, (a, b)) in ["claimed", "renewed", "completed"]
        .iter()
        .zip(by_a.iter().zip(by_b))
    {
        assert_eq!((a.state, &a.rest), (b.state, &b.rest), "{server}: {step}");
        // The deadlines are the same lease or retention from a few milliseconds apart.
        assert!(a.deadline.abs_diff(b.deadline) < 2_000, "{server}: {step}");
    }
    assert_eq!(by_a[1].state, b'F');
    assert!(
        by_a[1].deadline > by_a[0].deadline + 20_000,
        "{server}: renewed for 60 s"
    );
    assert_eq!(by_a[2].state, b'C');
    assert!(
        by_a[2].rest.ends_with(&payload),
        "{server}: the payload after the fingerprint"
    );
    let after = Raw::parse(&raw(&stats, &native, &key("written-by-a")).await.unwrap()).deadline;
    assert!(
        after.abs_diff(now_ms() + 3_600_000) < 5_000,
        "{server}: the retention's deadline"
    );

    // A waiter on the scripted instance is woken by the native completion, and by the native
    // release, at once: its lease (30 s) and wait (5 s) are far off, only the notice answers.
    for (status, key) in [("201", "woken-by-completion"), ("503", "woken-by-release")] {
        let deletes = command_calls(&stats, "delex").await + command_calls(&stats, "delifeq").await;
        let first = {
            let a = a.clone();
            let request = payment_with(key, &[("x-delay-ms", "400"), ("x-status", status)]);
            tokio::spawn(async move {
                let answer = send(&a, request).await;
                (answer, Instant::now())
            })
        };
        common::until("the first request runs", || runs_a.of(key) == 1).await;
        let retry = send(&b, payment_with(key, &[("prefer", "wait=5")])).await;
        let answered = Instant::now();
        let (first, done) = first.await.unwrap();
        let late = answered.saturating_duration_since(done);
        assert!(
            late < Duration::from_secs(1),
            "{server} {key}: {late:?} after the first"
        );
        assert_eq!(retry.status, StatusCode::CREATED, "{server} {key}");
        if status == "201" {
            assert!(retry.is_replay(), "{server} {key}");
            assert_eq!(retry.body, first.body);
            assert_eq!(ran(key), 1);
        } else {
            assert!(
                !retry.is_replay(),
                "{server} {key}: the waiter ran the key itself"
            );
            assert_eq!((runs_a.of(key), runs_b.of(key)), (1, 1));
            let deleted = command_calls(&stats, "delex").await + command_calls(&stats, "delifeq").await;
            assert_eq!(deleted, deletes + 1, "{server}: released natively");
        }
    }

    // Retries of the same keys from both instances at once: each key runs once.
    const KEYS: usize = 6;
    const RETRIES: usize = 8;
    let mut tasks = Vec::new();
    for k in 0..KEYS {
        for r in 0..RETRIES {
            let app = if r % 2 == 0 { a.clone() } else { b.clone() };
            let key = format!("retried-{k}");
            tasks.push(tokio::spawn(async move {
                loop {
                    let answer = send(&app, payment_with(&key, &[("x-delay-ms", "30")])).await;
                    if answer.status != StatusCode::CONFLICT {
                        return (key, answer);
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }));
        }
    }
    let mut bodies = std::collections::HashMap::new();
    for task in tasks {
        let (key, answer) = task.await.unwrap();
        assert_eq!(answer.status, StatusCode::CREATED, "{server} {key}");
        let first = bodies.entry(key.clone()).or_insert_with(|| answer.body.clone());
        assert_eq!(
            *first, answer.body,
            "{server} {key}: every answer is the one run's"
        );
    }
    for k in 0..KEYS {
        assert_eq!(ran(&format!("retried-{k}")), 1, "{server}: retried-{k}");
    }
}

/// A completion whose answer was lost with its connection still succeeds, whether the client
/// re-sends the command (fred does, `RedisStore::connect`) or the layer makes its completion
/// again (a client that sends each command once): the record is already the one written, or is
/// this owner's completed record, and either is recognised as done.
async fn a_completion_resent_after_a_dropped_connection_succeeds(server: &'static str) {
    let redis = RedisServer::start_binary(newer_server(server));
    let stats = client(&redis.url()).await;
    for resent_by in ["by-the-client", "by-the-layer"] {
        let proxy = Arc::new(FaultProxy::start(redis.addr()).await);
        let store = match resent_by {
            "by-the-client" => store(&proxy.url(), true).await,
            _ => {
                reset_stats(&stats).await;
                let store = RedisStore::new(client_with_attempts(&proxy.url(), 1).await)
                    .with_native_transitions(true);
                // Built from a client, the store asks the server what it has in the background.
                until_native(&store, &stats).await;
                store
            }
        }
        .with_heartbeat(None);
        let (layer, events) =
            reconciled(IdempotencyLayer::new(store).with_store_timeout(Duration::from_secs(1)));
        let (app, runs) = dropping_the_completion_reply(layer, &proxy);
        reset_stats(&stats).await;
        let first = send(&app, payment(resent_by, "{}")).await;
        assert_eq!((first.status, first.is_replay()), (StatusCode::CREATED, false));
        assert_eq!(
            proxy.dropped_replies(),
            1,
            "{server} {resent_by}: the completion's reply was dropped"
        );
        let expected_sets = match resent_by {
            // The claim, then the same SET … IFEQ twice: the second finds the record it wrote.
            "by-the-client" => 3,
            // The claim; the first attempt; the second, which finds this owner's completed
            // record (another deadline), then writes it again with its retention restarted, as
            // complete.lua does. The client was answered after the first attempt failed: the
            // second comes from the completion carried on in the background.
            _ => 4,
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        let mut completion = calls(&stats).await;
        while completion.set < expected_sets && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
            completion = calls(&stats).await;
        }
        let retry = send(&app, payment(resent_by, "{}")).await;
        assert!(
            retry.is_replay(),
            "{server} {resent_by}: the completion was stored"
        );
        assert_eq!(retry.body, "ran once");
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        assert_eq!(
            *events.lock().unwrap(),
            Vec::<String>::new(),
            "nothing reported unstored"
        );
        assert_eq!(
            (completion.set, completion.evalsha),
            (expected_sets, 0),
            "{server} {resent_by}: natively, {completion:?}"
        );
    }
}

/// A claim that was lost (purged, or its lease ran out) is never written over by its first
/// owner: not by its completion, its renewal nor its release, whether another owner claimed the
/// key since or nobody did.
async fn a_lost_claim_is_never_overwritten(server: &'static str) {
    let redis = RedisServer::start_binary(newer_server(server));
    let stats = client(&redis.url()).await;
    let (native, scripted) = (store(&redis.url(), true).await, store(&redis.url(), false).await);
    for (how, taken_by) in [
        ("purged", Some(&scripted)),
        ("expired", Some(&native)),
        ("expired", None),
    ] {
        let name = format!("lost-{how}-{}", taken_by.is_some());
        let (key, first, second) = (key(&name), OwnerToken::generate(), OwnerToken::generate());
        let lease = Duration::from_millis(200);
        assert_eq!(
            native.claim(&key, &body(), &first, lease).await.unwrap(),
            ClaimOutcome::Claimed
        );
        match how {
            "purged" => assert!(native.purge(&key).await.unwrap()),
            _ => {
                tokio::time::sleep(lease + Duration::from_millis(100)).await;
                assert_eq!(raw(&stats, &native, &key).await, None, "{server} {name}: expired");
            }
        }
        if let Some(store) = taken_by {
            let claimed = store.claim(&key, &body(), &second, LEASE).await.unwrap();
            assert_eq!(claimed, ClaimOutcome::Claimed, "{server} {name}");
        }
        let before = raw(&stats, &native, &key).await;
        reset_stats(&stats).await;
        let completed = native.complete(&key, &first, Bytes::from_static(b"late"), RETENTION);
        assert!(
            !completed.await.unwrap(),
            "{server} {name}: the late completion is refused"
        );
        let completion = calls(&stats).await;
        assert_eq!(
            (completion.set, completion.evalsha),
            (1, 0),
            "{server} {name}: natively"
        );
        assert!(
            !native.renew(&key, &first, LEASE).await.unwrap(),
            "{server} {name}"
        );
        assert!(!native.release(&key, &first).await.unwrap(), "{server} {name}");
        assert_eq!(
            raw(&stats, &native, &key).await,
            before,
            "{server} {name}: left as it was"
        );
        if let Some(store) = taken_by {
            let record = Raw::parse(&before.unwrap());
            assert_eq!(
                (record.owner, record.state),
                (Bytes::from(second.as_str().to_owned()), b'F')
            );
            assert!(store
                .complete(&key, &second, Bytes::from_static(b"ok"), RETENTION)
                .await
                .unwrap());
        }
    }
}

/// A renewal that was applied but whose answer was lost leaves the record this owner's, with
/// another deadline than the one the store remembers: the compare-and-set finds it, and the
/// completion, renewal or release still goes through. (Made here by rewriting the deadline
/// behind the store's back.)
async fn a_renewal_whose_answer_was_lost_does_not_lose_the_claim(server: &'static str) {
    let redis = RedisServer::start_binary(newer_server(server));
    let stats = client(&redis.url()).await;
    let store = store(&redis.url(), true).await;
    store.load_scripts().await.unwrap();
    for transition in ["complete", "renew", "release"] {
        let (key, owner) = (key(transition), OwnerToken::generate());
        assert_eq!(
            store.claim(&key, &body(), &owner, LEASE).await.unwrap(),
            ClaimOutcome::Claimed
        );
        let record = raw(&stats, &store, &key).await.unwrap();
        let at = Raw::deadline_at(&record);
        let later = (Raw::parse(&record).deadline + 5_000).to_be_bytes();
        let redis_key = store.redis_key(&key);
        let _: i64 = stats
            .setrange(&redis_key, at as u32, later.to_vec())
            .await
            .unwrap();
        reset_stats(&stats).await;
        let done = match transition {
            "complete" => {
                store
                    .complete(&key, &owner, Bytes::from_static(b"done"), RETENTION)
                    .await
            }
            "renew" => store.renew(&key, &owner, LEASE).await,
            _ => store.release(&key, &owner).await,
        };
        assert!(
            done.unwrap(),
            "{server}: {transition} after a renewal the store did not see"
        );
        let spent = calls(&stats).await;
        let after = raw(&stats, &store, &key).await;
        match transition {
            "complete" => {
                // Compared with the remembered record, then with the one found.
                assert_eq!((spent.set, spent.evalsha), (2, 0), "{server}: {spent:?}");
                let completed = Raw::parse(&after.unwrap());
                assert_eq!(completed.state, b'C');
                assert!(completed.rest.ends_with(b"done"));
            }
            "renew" => {
                assert_eq!((spent.set, spent.evalsha), (2, 0), "{server}: {spent:?}");
                let renewed = Raw::parse(&after.unwrap());
                assert_eq!(renewed.state, b'F');
                assert!(renewed.deadline.abs_diff(now_ms() + 30_000) < 5_000);
                // The store follows its own renewal: the completion compares once.
                reset_stats(&stats).await;
                assert!(store
                    .complete(&key, &owner, Bytes::from_static(b"x"), RETENTION)
                    .await
                    .unwrap());
                assert_eq!(calls(&stats).await.set, 1, "{server}: after the renewal");
            }
            _ => {
                // The conditional delete compares the whole record; the script decides.
                assert_eq!(spent.evalsha, 1, "{server}: {spent:?}");
                assert_eq!(after, None, "{server}: released");
            }
        }
    }
}

/// `bytes` as RESP writes a bulk string: how a command carries each argument.
fn bulk(bytes: &[u8]) -> Vec<u8> {
    let mut out = format!("${}\r\n", bytes.len()).into_bytes();
    out.extend_from_slice(bytes);
    out.extend_from_slice(b"\r\n");
    out
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|window| window == needle)
}

/// complete.lua, the default path, is given the in-flight record the store remembers (its
/// claim's, or its last renewal's) and the completed record the store built from it: Redis
/// compares two strings and writes one. Every other case still decides as before: a record
/// renewed or marked behind the store's back, one this owner completed already, one the owner
/// lost, and a claim the completing store does not remember (another instance's).
async fn complete_lua_is_given_the_record_the_store_remembers(server: &'static str) {
    let redis = RedisServer::start_binary(newer_server(server));
    let stats = client(&redis.url()).await;
    let proxy = FaultProxy::start(redis.addr()).await;
    let store = store(&proxy.url(), false).await;
    store.load_scripts().await.unwrap();
    // Another instance: it remembers none of `store`'s claims.
    let elsewhere = self::store(&redis.url(), false).await;
    let payload = Bytes::from_static(b"the stored answer");
    let claim = |name: &str| {
        let (key, owner) = (key(name), OwnerToken::generate());
        let store = store.clone();
        async move {
            let claimed = store.claim(&key, &body(), &owner, LEASE).await.unwrap();
            assert_eq!(claimed, ClaimOutcome::Claimed);
            (key, owner)
        }
    };
    // Completed, with the payload after the in-flight record's fingerprint.
    let assert_completed = |completed: &Bytes, in_flight: &Bytes, owner: &OwnerToken, payload: &[u8]| {
        let (completed, in_flight) = (Raw::parse(completed), Raw::parse(in_flight));
        assert_eq!(completed.state, b'C', "{server}");
        assert_eq!(
            completed.owner,
            Bytes::from(owner.as_str().to_owned()),
            "{server}"
        );
        assert!(
            completed.deadline.abs_diff(now_ms() + 3_600_000) < 60_000,
            "{server}"
        );
        assert_eq!(
            completed.rest[..FINGERPRINT_AND_TAG],
            in_flight.rest[..],
            "{server}: the claim's fingerprint"
        );
        assert_eq!(&completed.rest[FINGERPRINT_AND_TAG..], payload, "{server}");
    };

    // Remembered and untouched since: both records go with the call.
    let (remembered, owner) = claim("remembered").await;
    let in_flight = raw(&stats, &store, &remembered).await.unwrap();
    proxy.keep_sent();
    reset_stats(&stats).await;
    let done = store.complete(&remembered, &owner, payload.clone(), RETENTION);
    assert!(done.await.unwrap(), "{server}");
    let completed = raw(&stats, &store, &remembered).await.unwrap();
    assert_completed(&completed, &in_flight, &owner, &payload);
    let sent = proxy.sent();
    assert!(
        contains(&sent, &bulk(&in_flight)) && contains(&sent, &bulk(&completed)),
        "{server}: the script is given the claim's record and the completed one: {}",
        String::from_utf8_lossy(&sent)
    );
    let spent = calls(&stats).await;
    assert_eq!(
        (spent.evalsha, spent.set, spent.spublish),
        (1, 1, 0),
        "{server}: one script call, its one SET, no notice: {spent:?}"
    );

    // Re-sent once completed: done, the payload as the first completion left it.
    let again = store.complete(&remembered, &owner, Bytes::from_static(b"another"), RETENTION);
    assert!(again.await.unwrap(), "{server}: a completion made again succeeds");
    let kept = Raw::parse(&raw(&stats, &store, &remembered).await.unwrap());
    assert_eq!(
        kept.rest,
        Raw::parse(&completed).rest,
        "{server}: the payload kept"
    );

    // The store's own renewal: it follows it, so the renewed record goes with the call.
    let (renewed, owner) = claim("renewed").await;
    assert!(store.renew(&renewed, &owner, LEASE * 2).await.unwrap());
    let in_flight = raw(&stats, &store, &renewed).await.unwrap();
    proxy.keep_sent();
    assert!(store
        .complete(&renewed, &owner, payload.clone(), RETENTION)
        .await
        .unwrap());
    assert!(
        contains(&proxy.sent(), &bulk(&in_flight)),
        "{server}: the renewed record goes with the completion"
    );
    let completed = raw(&stats, &store, &renewed).await.unwrap();
    assert_completed(&completed, &in_flight, &owner, &payload);

    // Changed behind the store's back: a renewal whose answer was lost (a later deadline), and
    // a waiter's mark (the deadline's lowest bit, which asks for the notice). The record is
    // still this owner's: completed all the same.
    for (name, notices) in [("renewed-unseen", 0), ("marked", 1)] {
        let (key, owner) = claim(name).await;
        let record = raw(&stats, &store, &key).await.unwrap();
        let at = Raw::deadline_at(&record);
        let deadline = Raw::parse(&record).deadline;
        let changed = if notices == 0 {
            deadline + 5_000
        } else {
            deadline | 1
        };
        let _: i64 = stats
            .setrange(store.redis_key(&key), at as u32, changed.to_be_bytes().to_vec())
            .await
            .unwrap();
        reset_stats(&stats).await;
        assert!(
            store
                .complete(&key, &owner, payload.clone(), RETENTION)
                .await
                .unwrap(),
            "{server}: {name}"
        );
        let completed = raw(&stats, &store, &key).await.unwrap();
        assert_completed(&completed, &record, &owner, &payload);
        assert_eq!(calls(&stats).await.spublish, notices, "{server}: {name}");
    }

    // Not remembered by the store that completes it: the script builds the record itself.
    let (unknown, owner) = claim("not-remembered").await;
    let in_flight = raw(&stats, &store, &unknown).await.unwrap();
    let done = elsewhere.complete(&unknown, &owner, payload.clone(), RETENTION);
    assert!(done.await.unwrap(), "{server}: completed by another instance");
    let completed = raw(&stats, &store, &unknown).await.unwrap();
    assert_completed(&completed, &in_flight, &owner, &payload);

    // Lost (purged, then claimed by another owner): refused, the newer record left as it was.
    let (lost, owner) = claim("lost").await;
    assert!(store.purge(&lost).await.unwrap());
    let newer = OwnerToken::generate();
    let claimed = elsewhere.claim(&lost, &body(), &newer, LEASE).await.unwrap();
    assert_eq!(claimed, ClaimOutcome::Claimed);
    let before = raw(&stats, &store, &lost).await;
    let late = store.complete(&lost, &owner, payload.clone(), RETENTION);
    assert!(
        !late.await.unwrap(),
        "{server}: the lost claim's completion is refused"
    );
    assert_eq!(
        raw(&stats, &store, &lost).await,
        before,
        "{server}: left as it was"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn complete_lua_on_redis_7_0_is_given_the_record_the_store_remembers() {
    complete_lua_is_given_the_record_the_store_remembers("redis-7.0").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn complete_lua_on_redis_8_6_is_given_the_record_the_store_remembers() {
    complete_lua_is_given_the_record_the_store_remembers("redis-8.6").await;
}

/// A master and its replica of `server`, and a client of the master, once the replica
/// acknowledges writes.
async fn master_and_replica(server: &str) -> (RedisServer, RedisServer, Client) {
    let binary = newer_server(server);
    let master = RedisServer::start_binary_with(&binary, &["--repl-diskless-sync-delay", "0"]);
    let port = master.port().to_string();
    let replica = RedisServer::start_binary_with(&binary, &["--replicaof", "127.0.0.1", &port]);
    let stats = client(&master.url()).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        admin(&stats, &["SET", "probe", "1"]).await;
        if admin(&stats, &["WAIT", "1", "100"]).await.as_i64() == Some(1) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{server}: the replica never acknowledged a write"
        );
    }
    (master, replica, stats)
}

/// With the durability option, the native completion and its `WAIT` go in one round trip, and
/// the `WAIT` counts the completion's write: the replica has it when the client has the answer,
/// and nothing is completed again.
async fn the_durability_option_counts_the_native_write(server: &'static str) {
    let (master, replica, stats) = master_and_replica(server).await;
    let replica_stats = client(&replica.url()).await;
    let store = store(&master.url(), true)
        .await
        .with_replica_acks(ReplicaAcks::new(1).timeout(Duration::from_secs(2)))
        .await
        .expect("the durability option's connections");
    let (layer, events) = reconciled(IdempotencyLayer::new(store.clone()));
    let (app, runs) = router(layer);
    reset_stats(&stats).await;
    let answer = send(&app, payment("durable", "{}")).await;
    assert_eq!(answer.status, StatusCode::CREATED);
    let on_replica = raw(&replica_stats, &store, &key("durable"))
        .await
        .map(|r| Raw::parse(&r));
    assert_eq!(
        on_replica.map(|r| r.state),
        Some(b'C'),
        "{server}: the replica has the completion"
    );
    // A completion the WAIT did not count would be answered all the same, and made again in
    // the background (by the script: the store no longer remembers the claim's record).
    tokio::time::sleep(Duration::from_millis(300)).await;
    let spent = calls(&stats).await;
    assert_eq!(
        (spent.set, spent.evalsha),
        (2, 0),
        "{server}: the claim, then SET … IFEQ"
    );
    assert_eq!(
        command_calls(&stats, "wait").await,
        2,
        "{server}: one WAIT for each"
    );
    assert_eq!(
        *events.lock().unwrap(),
        Vec::<String>::new(),
        "acknowledged the first time"
    );
    assert!(send(&app, payment("durable", "{}")).await.is_replay());
    assert_eq!(runs.get(), 1);
}

/// Redis 8.6 replaced by Redis 7.0 on the same address (a failover onto an older replica, a
/// downgrade): once the store has reconnected it makes every transition with the scripts, and
/// no client is answered an error for it. Twice: with 7.0 as it is (the store asks it again
/// after the reconnect), and with 7.0 refusing `COMMAND` (an ACL), so the store still takes it
/// for 8.6 and finds out by a refused command, which it then makes again with its script.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_replaced_by_an_older_one_turns_the_store_to_the_scripts() {
    for command_refused in [false, true] {
        let mut redis = RedisServer::start_binary(newer_server("redis-8.6"));
        let store = store(&redis.url(), true).await;
        let (app, runs) = router(IdempotencyLayer::new(store.clone()));
        let stats = client(&redis.url()).await;
        assert_eq!(
            send(&app, payment("on-8.6", "{}")).await.status,
            StatusCode::CREATED
        );
        assert_eq!(calls(&stats).await.evalsha, 0, "natively on 8.6");
        stats.quit().await.unwrap();
        let acl: &[&str] = if command_refused {
            &[
                "--user", "default", "on", "nopass", "~*", "&*", "+@all", "-command",
            ]
        } else {
            &[]
        };
        redis.restart_as_with(newer_server("redis-7.0"), acl);
        let stats = client(&redis.url()).await;
        // Until the store has reconnected, its requests are answered 503: the server is away.
        common::until_async("the store reconnects", || async {
            let clients = admin(&stats, &["CLIENT", "LIST"]).await;
            clients.as_str().map_or(0, |list| list.lines().count()) > 1
        })
        .await;
        let case = if command_refused {
            "COMMAND refused"
        } else {
            "asked again"
        };
        reset_stats(&stats).await;
        // First a release (DELEX, unknown to 7.0), then completions (SET … IFEQ, refused).
        let released = send(&app, payment_with("released-on-7.0", &[("x-status", "500")])).await;
        assert_eq!(released.status, StatusCode::INTERNAL_SERVER_ERROR, "{case}");
        for i in 0..3 {
            let answer = send(&app, payment(&format!("on-7.0-{i}"), "{}")).await;
            assert_eq!(answer.status, StatusCode::CREATED, "{case}: {:?}", answer.body);
        }
        // A SET … IFEQ refused for its syntax, or an EVALSHA for NOSCRIPT (the new server has
        // no scripts loaded), is counted among the calls, as failed.
        let mut ran = Vec::new();
        for command in ["set", "evalsha", "eval"] {
            ran.push(command_calls(&stats, command).await - failed_calls(&stats, command).await);
        }
        assert_eq!(
            (ran[0], ran[1] + ran[2]),
            (7, 4),
            "{case}: the claims and complete.lua's SET for each completion, and a script for \
             each transition"
        );
        let again = send(&app, payment_with("released-on-7.0", &[])).await;
        assert_eq!(
            again.status,
            StatusCode::CREATED,
            "{case}: the release went through"
        );
        assert!(send(&app, payment("on-7.0-0", "{}")).await.is_replay(), "{case}");
        let errors = admin(&stats, &["INFO", "errorstats"]).await;
        let errors = errors.as_str().unwrap().into_owned();
        if command_refused {
            // DELEX, unknown to 7.0; after it, no native command was tried.
            assert!(
                errors.contains("errorstat_ERR:count=1"),
                "{case}: one refusal: {errors}"
            );
            assert_eq!(
                failed_calls(&stats, "set").await,
                0,
                "{case}: no SET … IFEQ after it"
            );
        }
        assert_eq!(runs.get(), 6, "{case}");
    }
}

/// A server replaced by another on the same address (an upgrade, or a failover onto a node of
/// another version): once the store has reconnected, it asks the new server what it has and
/// takes its path, with no command refused on the way.
async fn replaced(from: &str, to: &str, deletes_natively: bool) {
    let mut redis = RedisServer::start_binary(newer_server(from));
    let store = store(&redis.url(), true).await;
    store.load_scripts().await.unwrap();
    let (app, runs) = router(IdempotencyLayer::new(store.clone()));
    assert_eq!(
        send(&app, payment("before", "{}")).await.status,
        StatusCode::CREATED
    );
    redis.restart_as(newer_server(to));
    let stats = client(&redis.url()).await;
    store.load_scripts().await.unwrap();
    if deletes_natively {
        until_native(&store, &stats).await;
    } else {
        // Valkey 8.1 completes natively too: only the release tells it was asked again.
        common::until_async("the store asks the new server what it has", || async {
            command_calls(&stats, "command|docs").await > 0
        })
        .await;
        // Its answer reaches the store a moment after the server counted the command.
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    reset_stats(&stats).await;
    for i in 0..2 {
        let answer = send(&app, payment(&format!("after-{i}"), "{}")).await;
        assert_eq!(answer.status, StatusCode::CREATED, "{from} → {to}");
    }
    let released = send(&app, payment_with("released", &[("x-status", "500")])).await;
    assert_eq!(released.status, StatusCode::INTERNAL_SERVER_ERROR);
    let spent = calls(&stats).await;
    let deletes = spent.delex + spent.delifeq;
    let expected = if deletes_natively { (5, 0, 1) } else { (5, 1, 0) };
    assert_eq!(
        (spent.set, spent.evalsha, deletes),
        expected,
        "{from} → {to}: two claims and completions by SET … IFEQ, a claim and a release ({spent:?})"
    );
    let errors = admin(&stats, &["INFO", "errorstats"]).await;
    let errors = errors.as_str().unwrap().into_owned();
    assert!(
        !errors.contains("errorstat_ERR"),
        "{from} → {to}: nothing refused: {errors}"
    );
    assert_eq!(runs.get(), 4);
}

/// Redis 7.0 replaced by 8.6: from the scripts to `SET … IFEQ` and `DELEX`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_7_0_replaced_by_8_6_is_asked_again_what_it_has() {
    replaced("redis-7.0", "redis-8.6", true).await;
}

/// Valkey 9.1 replaced by 8.1: `SET … IFEQ` still, but releases by the script (8.1 has no
/// `DELIFEQ`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn valkey_9_1_replaced_by_8_1_is_asked_again_what_it_has() {
    replaced("valkey-9.1", "valkey-8.1", false).await;
}

/// Each native transition is one round trip: the notice for waiters (`SPUBLISH`) goes behind
/// the completion's or release's command without waiting for its answer. Counted at a proxy
/// that delivers answers 50 ms late (a command sent only once the one before it is answered
/// takes a turn more).
async fn each_native_transition_is_one_round_trip(server: &'static str) {
    let redis = RedisServer::start_binary(newer_server(server));
    let stats = client(&redis.url()).await;
    let proxy = FaultProxy::start(redis.addr()).await;
    // The heartbeat's pings would be turns of their own.
    let store = store(&proxy.url(), true).await.with_heartbeat(None);
    for transition in ["complete", "renew", "release"] {
        let (key, owner) = (key(transition), OwnerToken::generate());
        assert_eq!(
            store.claim(&key, &body(), &owner, LEASE).await.unwrap(),
            ClaimOutcome::Claimed
        );
        reset_stats(&stats).await;
        proxy.set_latency(Duration::from_millis(50));
        let before = proxy.turns();
        let done = match transition {
            "complete" => {
                store
                    .complete(&key, &owner, Bytes::from_static(b"done"), RETENTION)
                    .await
            }
            "renew" => store.renew(&key, &owner, LEASE).await,
            _ => store.release(&key, &owner).await,
        };
        let turns = proxy.turns() - before;
        proxy.set_latency(Duration::ZERO);
        assert!(done.unwrap(), "{server}: {transition}");
        assert_eq!(turns, 1, "{server}: {transition} in one round trip");
        assert_eq!(calls(&stats).await.evalsha, 0, "{server}: {transition} natively");
    }
}

/// A server that has a conditional delete its ACL does not let the store run (a user given the
/// commands the store needed before: `-delex`, `-delifeq`): releases fall back to the script, so
/// a key is free again at once, not only once its lease runs out.
async fn a_conditional_delete_the_acl_refuses_falls_back_to_the_script(server: &'static str) {
    let delete = if server.starts_with("redis") {
        "-delex"
    } else {
        "-delifeq"
    };
    let acl = ["--user", "default", "on", "nopass", "~*", "&*", "+@all", delete];
    let redis = RedisServer::start_binary_with(newer_server(server), &acl);
    let stats = client(&redis.url()).await;
    let store = store(&redis.url(), true).await;
    store.load_scripts().await.unwrap();
    let (app, runs) = router(IdempotencyLayer::new(store.clone()));
    for attempt in 0..2 {
        let released = send(&app, payment_with("refused-delete", &[("x-status", "500")])).await;
        assert_eq!(
            released.status,
            StatusCode::INTERNAL_SERVER_ERROR,
            "{server}: attempt {attempt}"
        );
        assert_eq!(
            raw(&stats, &store, &key("refused-delete")).await,
            None,
            "{server}: released"
        );
    }
    assert_eq!(
        runs.get(),
        2,
        "{server}: the retry ran at once, not answered in flight"
    );
}

/// With the durability option, a native completion whose answer was lost with its connection,
/// and which the client then sends again on a new one, finds the record it wrote already. The
/// `WAIT` behind it must still count that write: a `WAIT` on a connection that wrote nothing
/// answers at once with every replica, and a completion the replica never received would be
/// taken for durable. Two things make the new connection write before its `WAIT`: the record
/// written again (as complete.lua writes it again) and the waiters' notice (`SPUBLISH` goes to
/// the replicas like a write); the replication stream is one sequence, so a replica that has
/// either has the first write too. Here the replica is paused from before the completion until
/// after the store gave up on it: the store must report the completion unreplicated. (Checked:
/// this fails with neither, and passes with either alone.)
async fn a_resent_completion_is_counted_by_its_own_wait(server: &'static str) {
    let (master, replica, _) = master_and_replica(server).await;
    let proxy = Arc::new(FaultProxy::start(master.addr()).await);
    // A second of WAIT: the claim's, before the replica is paused, must not time out on a
    // loaded machine (at 300 ms it did, a 503, with other suites running beside it).
    let acks = ReplicaAcks::new(1)
        .timeout(Duration::from_secs(1))
        .retry_completions_for(Duration::from_secs(2));
    let store = store(&proxy.url(), true)
        .await
        .with_heartbeat(None)
        .with_replica_acks(acks)
        .await
        .expect("the durability option's connections");
    let (layer, events) = reconciled(IdempotencyLayer::new(store));
    let replica_pid = replica.pid().expect("the replica runs").to_string();
    let handler = {
        let (proxy, replica_pid) = (proxy.clone(), replica_pid.clone());
        move || {
            let (proxy, replica_pid) = (proxy.clone(), replica_pid.clone());
            async move {
                // The claim was acknowledged; from here the replica acknowledges nothing.
                let paused = std::process::Command::new("kill")
                    .args(["-STOP", &replica_pid])
                    .status();
                assert!(paused.is_ok_and(|status| status.success()), "pause the replica");
                tokio::time::sleep(Duration::from_millis(50)).await;
                proxy.set(common::proxy::Fault::DropNextReply);
                (StatusCode::CREATED, "ran once")
            }
        }
    };
    let app = axum::Router::new()
        .route("/payments", axum::routing::post(handler))
        .layer(layer);
    let answer = send(&app, payment("resent-durable", "{}")).await;
    // Answered with its result either way: an unacknowledged completion is completed again in
    // the background, and reported when that gives up.
    assert_eq!(answer.status, StatusCode::CREATED);
    assert_eq!(
        proxy.dropped_replies(),
        1,
        "{server}: the completion's reply was dropped"
    );
    let reported = Instant::now() + Duration::from_secs(10);
    while events.lock().unwrap().is_empty() && Instant::now() < reported {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let resumed = std::process::Command::new("kill")
        .args(["-CONT", &replica_pid])
        .status();
    assert!(resumed.is_ok_and(|status| status.success()), "resume the replica");
    let events = events.lock().unwrap().clone();
    assert!(
        events.iter().any(|event| event.contains("ReplicationAbandoned")),
        "{server}: a completion the paused replica never had was taken for durable: {events:?}"
    );
}

/// A completed record takes the memory one `SET` of its bytes takes, on each path: the native
/// `SET … IFEQ`, and complete.lua, which writes the whole record with one `SET` too (it once
/// appended the payload, and `APPEND` left the string room for as many bytes again: 2.7 KB
/// against 1.4 KB for a 1 KiB answer). Read with `MEMORY USAGE`, against a probe key of the
/// same length written with one `SET`.
async fn a_completed_record_takes_the_memory_of_one_set(server: &'static str, native: bool) {
    let redis = RedisServer::start_binary(newer_server(server));
    let stats = client(&redis.url()).await;
    let store = store(&redis.url(), native).await;
    let memory = |key: String| {
        let stats = stats.clone();
        async move {
            let usage = admin(&stats, &["MEMORY", "USAGE", &key, "SAMPLES", "0"]).await;
            usage
                .as_u64()
                .unwrap_or_else(|| panic!("MEMORY USAGE {key}: {usage:?}"))
        }
    };
    for size in [0, 100, 1000, 20_000] {
        let (key, owner) = (key(&format!("weighed-{size:05}")), OwnerToken::generate());
        let claimed = store.claim(&key, &body(), &owner, LEASE).await.unwrap();
        assert_eq!(claimed, ClaimOutcome::Claimed);
        let payload = Bytes::from(vec![b'p'; size]);
        assert!(store
            .complete(&key, &owner, payload.clone(), RETENTION)
            .await
            .unwrap());
        let record = raw(&stats, &store, &key).await.expect("completed");
        let parsed = Raw::parse(&record);
        assert_eq!(parsed.state, b'C', "{server}");
        assert_eq!(
            parsed.rest.slice(FINGERPRINT_AND_TAG..),
            payload,
            "{server}: the payload after the fingerprint"
        );

        let name = store.redis_key(&key);
        let probe = format!("{}x", &name[..name.len() - 1]);
        let _: () = stats
            .set(
                probe.as_str(),
                record.clone(),
                Some(Expiration::PX(60_000)),
                None,
                false,
            )
            .await
            .expect("SET the probe");
        let (completed, one_set) = (memory(name.clone()).await, memory(probe).await);
        assert_eq!(
            completed,
            one_set,
            "{server} (native {native}), a {size} B payload: the completed record takes {completed} B, \
             one SET of its {} B {one_set} B",
            record.len()
        );
    }
}

/// The waiters' notice (`SPUBLISH <record key>:settled`) goes only for a record someone waits
/// for: a completion or release of a record nobody waits for publishes nothing, one a waiter has
/// read (`Store::claim_waiting`, which marks it: the in-flight deadline's lowest bit, which
/// owners write even) publishes once and wakes the waiter's watch, and a renewal keeps the
/// mark; on either path.
async fn the_notice_goes_only_for_a_record_someone_waits_for(server: &'static str, native: bool) {
    let redis = RedisServer::start_binary(newer_server(server));
    let stats = client(&redis.url()).await;
    let store = store(&redis.url(), native).await;
    let path = if native { "native" } else { "scripts" };
    let deadline = |record: Option<Bytes>| Raw::parse(&record.expect("a record")).deadline;
    for settle in ["complete", "release"] {
        for watched in [false, true] {
            let (key, owner) = (key(&format!("{settle}-{watched}")), OwnerToken::generate());
            let what = format!("{server} {path}: {settle}, watched {watched}");
            assert_eq!(
                store.claim(&key, &body(), &owner, LEASE).await.unwrap(),
                ClaimOutcome::Claimed
            );
            assert_eq!(
                deadline(raw(&stats, &store, &key).await) % 2,
                0,
                "{what}: an owner writes its deadline even"
            );
            let mut watch = None;
            if watched {
                watch = Some(store.watch(&key).await.unwrap().expect("Redis notifies"));
                let read = store
                    .claim_waiting(&key, &body(), &OwnerToken::generate(), LEASE)
                    .await
                    .unwrap();
                assert!(matches!(read, ClaimOutcome::InFlight { .. }), "{what}");
            } else {
                // A plain claim that finds it in flight (a retry answered 409) marks nothing.
                let read = store
                    .claim(&key, &body(), &OwnerToken::generate(), LEASE)
                    .await
                    .unwrap();
                assert!(matches!(read, ClaimOutcome::InFlight { .. }), "{what}");
            }
            let marked = deadline(raw(&stats, &store, &key).await) % 2 == 1;
            assert_eq!(marked, watched, "{what}: marked");
            assert!(store.renew(&key, &owner, LEASE).await.unwrap(), "{what}");
            let renewed = deadline(raw(&stats, &store, &key).await);
            assert_eq!(renewed % 2 == 1, watched, "{what}: the renewal keeps the mark");
            reset_stats(&stats).await;
            let settled = match settle {
                "complete" => store.complete(&key, &owner, Bytes::from_static(b"done"), RETENTION),
                _ => store.release(&key, &owner),
            };
            assert!(settled.await.unwrap(), "{what}");
            assert_eq!(
                calls(&stats).await.spublish,
                u64::from(watched),
                "{what}: notices sent"
            );
            if let Some(watch) = watch.as_mut() {
                let woken = tokio::time::timeout(Duration::from_secs(2), watch.changed()).await;
                assert_eq!(woken.ok(), Some(true), "{what}: the watcher is woken");
            }
        }
    }
    // A waiter's read answers what a claim answers, and marks only another owner's record in
    // flight: a completed record is replayed as it is, a free key is claimed (unmarked).
    let (done, owner) = (key("completed-then-read"), OwnerToken::generate());
    store.claim(&done, &body(), &owner, LEASE).await.unwrap();
    store
        .complete(&done, &owner, Bytes::from_static(b"kept"), RETENTION)
        .await
        .unwrap();
    let before = raw(&stats, &store, &done).await;
    let read = store
        .claim_waiting(&done, &body(), &OwnerToken::generate(), LEASE)
        .await
        .unwrap();
    assert!(
        matches!(read, ClaimOutcome::Completed(payload) if payload == "kept"),
        "{server} {path}"
    );
    assert_eq!(raw(&stats, &store, &done).await, before, "{server} {path}");
    let other = Fingerprint::new([b"other".as_slice()]);
    let read = store
        .claim_waiting(&done, &other, &OwnerToken::generate(), LEASE)
        .await
        .unwrap();
    assert_eq!(read, ClaimOutcome::Mismatch, "{server} {path}");
    let (free, waiter) = (key("free-when-read"), OwnerToken::generate());
    let read = store.claim_waiting(&free, &body(), &waiter, LEASE).await.unwrap();
    assert_eq!(read, ClaimOutcome::Claimed, "{server} {path}");
    assert_eq!(
        deadline(raw(&stats, &store, &free).await) % 2,
        0,
        "{server} {path}"
    );
    assert!(store
        .complete(&free, &waiter, Bytes::from_static(b"the waiter's"), RETENTION)
        .await
        .unwrap());
}

/// One test per line: its name, the server, whether native transitions are on.
macro_rules! noticed {
    ($($test:ident: $server:literal, $native:literal;)*) => {
        mod the_notice_goes_only_for_a_record_someone_waits_for {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    super::the_notice_goes_only_for_a_record_someone_waits_for($server, $native).await;
                }
            )*
        }
    };
}

noticed! {
    redis_7_0_scripts: "redis-7.0", false;
    redis_8_6_scripts: "redis-8.6", false;
    redis_8_6_native: "redis-8.6", true;
    valkey_9_1_native: "valkey-9.1", true;
}

/// One test per line: its name, the server, whether native transitions are on.
macro_rules! weighed {
    ($($test:ident: $server:literal, $native:literal;)*) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $test() {
                a_completed_record_takes_the_memory_of_one_set($server, $native).await;
            }
        )*
    };
}

weighed! {
    a_record_completed_by_script_on_redis_7_0_takes_the_memory_of_one_set: "redis-7.0", false;
    a_record_completed_by_script_on_redis_8_6_takes_the_memory_of_one_set: "redis-8.6", false;
    a_record_completed_natively_on_redis_8_6_takes_the_memory_of_one_set: "redis-8.6", true;
    a_record_completed_natively_on_valkey_9_1_takes_the_memory_of_one_set: "valkey-9.1", true;
}

on_the_newest_servers!(
    a_resent_completion_is_counted_by_its_own_wait,
    a_conditional_delete_the_acl_refuses_falls_back_to_the_script,
    each_native_transition_is_one_round_trip,
    a_mixed_fleet_shares_one_server,
    a_completion_resent_after_a_dropped_connection_succeeds,
    a_lost_claim_is_never_overwritten,
    a_renewal_whose_answer_was_lost_does_not_lose_the_claim,
    the_durability_option_counts_the_native_write,
);
