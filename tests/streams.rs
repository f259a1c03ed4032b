//! `StreamConsumer` (crate feature `streams`) through its API, on real servers: entries deleted
//! or trimmed while pending are counted, the bound on messages in hand holds, a shutdown
//! acknowledges nothing unfinished, and the consumer works on Sentinel and on a Cluster, where
//! the stream's hash tag keeps its dead-letter stream in its slot (an untagged stream is refused
//! at the start, with the fix in the message). `StreamPublisher` adds a retried publish once on
//! Redis 8.6 (`XADD … IDMP`), falls back on older servers, and errs within its bound on a
//! frozen server.

mod common;

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::cluster::Cluster;
use common::sentinel::SentinelTopology;
use common::RedisServer;
use fred::prelude::*;
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use tokio::sync::oneshot;
use tower_idempotency::{
    Begin, Coordinator, Failure, Fingerprint, IdempotencyKey, RecordKey, RedisStore, StreamConsumer,
    StreamOutcome, StreamPublisher,
};

/// The recorder is global, and every test here counts messages: they take turns.
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

/// The stream counters recorded since the last call: `name{labels}` to its increase.
fn counted() -> BTreeMap<String, u64> {
    let mut counted = BTreeMap::new();
    for (key, _, _, value) in snapshotter().snapshot().into_vec() {
        let (key, DebugValue::Counter(n)) = (key.key(), value) else {
            continue;
        };
        if key.name().starts_with("idempotency_stream") && n > 0 {
            let labels: Vec<String> = key
                .labels()
                .map(|l| format!("{}={}", l.key(), l.value()))
                .collect();
            counted.insert(format!("{}{{{}}}", key.name(), labels.join(",")), n);
        }
    }
    counted
}

/// A consumer on `url`'s stream, its store on the same Redis, with a short lease.
async fn consumer(url: &str, stream: &str, lease: Duration) -> StreamConsumer {
    let store = RedisStore::connect(url).await.expect("connect the store");
    let coordinator = Coordinator::new(store).with_lease(lease);
    StreamConsumer::new(common::client(url).await, coordinator, stream, "workers")
}

/// What each handled message became, by entry id, recorded by the observer.
type Outcomes = Arc<Mutex<HashMap<String, String>>>;

fn observed(consumer: StreamConsumer) -> (StreamConsumer, Outcomes) {
    let outcomes = Outcomes::default();
    let seen = outcomes.clone();
    let consumer = consumer.with_observer(move |event| {
        if let tower_idempotency::StreamEvent::Handled { message, outcome, .. } = event {
            let reason = match outcome {
                StreamOutcome::DeadLettered { reason } => format!(" {reason}"),
                _ => String::new(),
            };
            let line = format!("{}{reason}", outcome.label());
            seen.lock().unwrap().insert(message.entry().to_owned(), line);
        }
    });
    (consumer, outcomes)
}

/// Effects applied, per id.
type Effects = Arc<Mutex<BTreeMap<String, u64>>>;

/// Runs `consumer` in a task until the returned sender fires (or is dropped); counts each
/// effect per id in the returned map.
fn spawn(
    consumer: StreamConsumer,
    work: Duration,
) -> (oneshot::Sender<()>, tokio::task::JoinHandle<()>, Effects) {
    let effects = Arc::new(Mutex::new(BTreeMap::new()));
    let counts = effects.clone();
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        let shutdown = async {
            let _ = stopped.await;
        };
        let effect = |message: tower_idempotency::StreamMessage, _ticket| {
            let counts = counts.clone();
            async move {
                tokio::time::sleep(work).await;
                // An amount that is not an integer dead-letters the message (`?` on a FieldError).
                let _amount: i64 = message.parse_field("amount", "an integer")?;
                let id = message.field("id").unwrap_or_default().to_owned();
                *counts.lock().unwrap().entry(id.clone()).or_insert(0) += 1;
                Ok::<_, Failure>(Bytes::from(id))
            }
        };
        consumer.run(shutdown, effect).await.expect("the consumer runs");
    });
    (stop, task, effects)
}

async fn publish(client: &Client, stream: &str, fields: &[(&str, &str)]) -> String {
    client
        .xadd(stream, false, None, "*", fields.to_vec())
        .await
        .unwrap()
}

async fn pending(client: &Client, stream: &str) -> u64 {
    let summary: Value = client.xpending(stream, "workers", ()).await.unwrap();
    summary.into_array().first().and_then(Value::as_u64).unwrap_or(0)
}

async fn within<T>(what: &str, future: impl Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(20), future)
        .await
        .unwrap_or_else(|_| panic!("never: {what}"))
}

/// An entry a consumer took and died with, deleted from the stream before anyone processed it:
/// the takeover's `XAUTOCLAIM` answers its id among the deleted (the typed reply of fred drops
/// that list), and the consumer logs and counts it rather than lose it unseen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_entry_deleted_while_pending_is_counted() {
    let _turn = TURN.lock().await;
    let server = RedisServer::start();
    let client = common::client(&server.url()).await;
    let stream = "deleted";
    let () = client.xgroup_create(stream, "workers", "$", true).await.unwrap();
    let doomed = publish(&client, stream, &[("id", "pay-gone"), ("amount", "1")]).await;
    // A consumer that read it and died: it stays pending on "dead".
    let _: Value = (client
        .xreadgroup("workers", "dead", Some(1), None, false, stream, ">")
        .await)
        .unwrap();
    let deleted: u64 = client.xdel(stream, doomed.as_str()).await.unwrap();
    assert_eq!(deleted, 1);
    assert_eq!(pending(&client, stream).await, 1);
    let kept = publish(&client, stream, &[("id", "pay-kept"), ("amount", "2")]).await;
    counted();
    let (consumer, outcomes) = observed(consumer(&server.url(), stream, Duration::from_millis(300)).await);
    let (stop, task, effects) = spawn(consumer, Duration::ZERO);
    within("the deleted entry leaves the pending list", async {
        while pending(&client, stream).await > 0 || !outcomes.lock().unwrap().contains_key(&kept) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    let _ = stop.send(());
    within("the consumer stops", task).await.unwrap();
    assert_eq!(
        *effects.lock().unwrap(),
        BTreeMap::from([("pay-kept".to_owned(), 1)])
    );
    let counted = counted();
    assert_eq!(
        counted.get("idempotency_stream_entries_deleted_total{}"),
        Some(&1),
        "{counted:?}"
    );
    assert_eq!(
        counted.get("idempotency_stream_messages_total{outcome=ran}"),
        Some(&1),
        "{counted:?}"
    );
}

/// A stream deleted under a running consumer takes its group with it (as a Redis restarted
/// without persistence, or a failover to a replica that never had them, does): the consumer
/// makes the group again from the stream's start and applies what is published next. Before, it
/// logged a failed read (`NOGROUP`) every pause and applied nothing more, for as long as it ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_lost_with_its_stream_is_made_again_and_consumption_goes_on() {
    let _turn = TURN.lock().await;
    let server = RedisServer::start();
    let client = common::client(&server.url()).await;
    let stream = "lost";
    let consumer = consumer(&server.url(), stream, Duration::from_secs(5)).await;
    let (stop, task, effects) = spawn(consumer, Duration::ZERO);
    let applied = |id: &'static str| {
        let effects = effects.clone();
        async move {
            while !effects.lock().unwrap().contains_key(id) {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    publish(&client, stream, &[("id", "pay-before"), ("amount", "1")]).await;
    within("the first message is applied", applied("pay-before")).await;
    let deleted: u64 = client.del(stream).await.unwrap();
    assert_eq!(deleted, 1, "the stream, and its group with it, deleted");
    publish(&client, stream, &[("id", "pay-after"), ("amount", "2")]).await;
    within(
        "a message published after the group was lost is applied",
        applied("pay-after"),
    )
    .await;
    let _ = stop.send(());
    within("the consumer stops", task).await.unwrap();
    assert_eq!(
        *effects.lock().unwrap(),
        BTreeMap::from([("pay-after".to_owned(), 1), ("pay-before".to_owned(), 1)])
    );
}

/// `connect_redis` builds a client that reconnects, forever, and whose sockets the kernel
/// watches (TCP keepalive and, on Linux, `TCP_USER_TIMEOUT`): a flow a load balancer dropped
/// without a word is closed within seconds and the client reconnects, where without them a
/// blocked `XREADGROUP` would wait on the dead socket until the kernel gives up (about 15 min).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_redis_builds_a_client_that_reconnects_and_whose_sockets_are_kept_alive() {
    let server = RedisServer::start();
    let redis = StreamConsumer::connect_redis(&server.url())
        .await
        .expect("connect");
    let tcp = &redis.connection_config().tcp;
    assert!(
        tcp.keepalive.is_some(),
        "no TCP keepalive on the consumer's client"
    );
    #[cfg(target_os = "linux")]
    assert!(
        tcp.user_timeout.is_some(),
        "no TCP_USER_TIMEOUT on the consumer's client"
    );
    let policy = redis.client_reconnect_policy().expect("a reconnect policy");
    assert_eq!(policy.max_attempts(), 0, "reconnects forever: {policy:?}");
}

/// With `with_in_hand(3)`, six slow messages run three at a time, never more; a shutdown in
/// the middle lets those in hand finish and be acknowledged, reads nothing more, and leaves
/// nothing acknowledged whose effect did not run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bound_in_hand_holds_and_a_shutdown_acks_nothing_unfinished() {
    let _turn = TURN.lock().await;
    let server = RedisServer::start();
    let client = common::client(&server.url()).await;
    let stream = "bounded";
    let mut entries = Vec::new();
    for n in 0..6 {
        entries.push(publish(&client, stream, &[("id", &format!("pay-{n}")), ("amount", "1")]).await);
    }
    let running = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let consumer = consumer(&server.url(), stream, Duration::from_secs(5))
        .await
        .with_in_hand(3);
    let (consumer, outcomes) = observed(consumer);
    let (stop, stopped) = oneshot::channel::<()>();
    let (first_running, started) = (running.clone(), most.clone());
    let task = tokio::spawn(async move {
        let effect = |_message, _ticket| {
            let (running, most) = (first_running.clone(), started.clone());
            async move {
                let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(400)).await;
                running.fetch_sub(1, Ordering::SeqCst);
                Ok::<_, Failure>(Bytes::new())
            }
        };
        let shutdown = async {
            let _ = stopped.await;
        };
        consumer.run(shutdown, effect).await.unwrap();
    });
    within("three run at once", async {
        while running.load(Ordering::SeqCst) < 3 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    let _ = stop.send(());
    within("the consumer stops", task).await.unwrap();
    assert_eq!(most.load(Ordering::SeqCst), 3, "the bound in hand");
    assert_eq!(running.load(Ordering::SeqCst), 0, "nothing left running");
    let outcomes = outcomes.lock().unwrap().clone();
    assert_eq!(
        outcomes.len(),
        3,
        "those in hand finished, nothing more was read: {outcomes:?}"
    );
    assert!(outcomes.values().all(|o| o == "ran"), "{outcomes:?}");
    // Acknowledged: exactly those that ran; the three never read are still in the stream,
    // unread by the group (not pending, not acknowledged).
    assert_eq!(pending(&client, stream).await, 0);
    let info: Vec<HashMap<String, Value>> = client.xinfo_groups(stream).await.unwrap();
    assert_eq!(
        info[0]["last-delivered-id"].as_string().as_deref(),
        Some(entries[2].as_str())
    );
    counted();
}

/// Good, duplicate, mismatched and bad messages on `url`'s `stream`, and one whose amount the
/// effect cannot parse: ran, replayed, dead-lettered three times (the last with
/// `parse_field`'s reason), nothing pending, every dead letter in `<stream>:dead`.
async fn one_of_each(url: &str, stream: &str) {
    let client = common::client(url).await;
    let good = publish(&client, stream, &[("id", "pay-1"), ("amount", "40")]).await;
    let again = publish(&client, stream, &[("amount", "40"), ("id", "pay-1")]).await;
    let reused = publish(&client, stream, &[("id", "pay-1"), ("amount", "41")]).await;
    let bad = publish(&client, stream, &[("id", "not a key"), ("amount", "1")]).await;
    let unparsed = publish(&client, stream, &[("id", "pay-2"), ("amount", "lots")]).await;
    let (consumer, outcomes) = observed(consumer(url, stream, Duration::from_secs(5)).await);
    let (stop, task, effects) = spawn(consumer, Duration::ZERO);
    within("all five handled", async {
        while outcomes.lock().unwrap().len() < 5 || pending(&client, stream).await > 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    let _ = stop.send(());
    within("the consumer stops", task).await.unwrap();
    let outcomes = outcomes.lock().unwrap().clone();
    assert_eq!(outcomes[&good], "ran");
    assert_eq!(outcomes[&again], "replayed", "field order does not matter");
    assert!(
        outcomes[&reused].starts_with("dead-lettered mismatch"),
        "{outcomes:?}"
    );
    assert!(outcomes[&bad].starts_with("dead-lettered bad id"), "{outcomes:?}");
    assert_eq!(
        outcomes[&unparsed],
        r#"dead-lettered bad amount: "lots" is not an integer"#
    );
    let dead: Vec<(String, HashMap<String, String>)> = client
        .xrange_values(format!("{stream}:dead"), "-", "+", None)
        .await
        .unwrap();
    let mut dead: Vec<&str> = dead.iter().map(|(_, fields)| fields["entry"].as_str()).collect();
    dead.sort();
    let mut expected = [reused.as_str(), bad.as_str(), unparsed.as_str()];
    expected.sort();
    assert_eq!(dead, expected);
    assert_eq!(
        *effects.lock().unwrap(),
        BTreeMap::from([("pay-1".to_owned(), 1)])
    );
}

/// On a Cluster, a stream named with a hash tag keeps its dead-letter stream in its slot, so
/// dead-lettering (`MULTI` of `XADD <stream>:dead` and `XACK`) works; an untagged stream, whose
/// dead letters would fail with `CROSSSLOT` every time, is refused at the start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_a_tagged_stream_dead_letters_and_an_untagged_one_is_refused() {
    let _turn = TURN.lock().await;
    let cluster = Cluster::shared();
    one_of_each(&cluster.url(), "{streams-cluster}").await;
    let refused = consumer(&cluster.url(), "streams-untagged", Duration::from_secs(5))
        .await
        .run(std::future::pending(), |_, _| async {
            Ok::<_, Failure>(Bytes::new())
        })
        .await
        .expect_err("an untagged stream on a Cluster");
    assert!(refused.to_string().contains("hash tag"), "{refused}");
    counted();
}

/// Over Sentinel: the same messages, the same answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_sentinel_one_of_each() {
    let _turn = TURN.lock().await;
    let topology = tokio::task::spawn_blocking(SentinelTopology::start)
        .await
        .unwrap();
    one_of_each(&topology.url(), "payments").await;
    counted();
}

/// On standalone the same, with the outcomes counted per label.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_standalone_one_of_each_counted_per_outcome() {
    let _turn = TURN.lock().await;
    let server = RedisServer::start();
    counted();
    one_of_each(&server.url(), "payments").await;
    let counted = counted();
    let expected = BTreeMap::from([
        ("idempotency_stream_messages_total{outcome=ran}".to_owned(), 1),
        (
            "idempotency_stream_messages_total{outcome=replayed}".to_owned(),
            1,
        ),
        (
            "idempotency_stream_messages_total{outcome=dead_lettered}".to_owned(),
            3,
        ),
    ]);
    assert_eq!(counted, expected);
}

/// A live consumer keeps what it runs: an effect that takes four leases is not taken over by
/// the other consumer (its entry's idle time is reset while it runs), so it is delivered once
/// and received once, and the other consumer never meets it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_consumers_slow_message_is_not_taken_over() {
    let _turn = TURN.lock().await;
    let server = RedisServer::start();
    let client = common::client(&server.url()).await;
    let stream = "slow";
    let lease = Duration::from_millis(300);
    let received = Arc::new(Mutex::new(Vec::new()));
    let mut running = Vec::new();
    for name in ["first", "second"] {
        let seen = received.clone();
        let consumer = consumer(&server.url(), stream, lease)
            .await
            .with_consumer_name(name)
            .with_observer(move |event| {
                if let tower_idempotency::StreamEvent::Received(message) = event {
                    seen.lock().unwrap().push((name, message.deliveries()));
                }
            });
        running.push(spawn(consumer, lease * 4));
    }
    publish(&client, stream, &[("id", "pay-slow"), ("amount", "1")]).await;
    within("the slow message is done", async {
        while running
            .iter()
            .all(|(_, _, effects)| effects.lock().unwrap().is_empty())
            || pending(&client, stream).await > 0
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    for (stop, task, _) in running {
        let _ = stop.send(());
        within("a consumer stops", task).await.unwrap();
    }
    let received = received.lock().unwrap().clone();
    assert_eq!(received.len(), 1, "received once, by one consumer: {received:?}");
    assert_eq!(received[0].1, 1, "one delivery");
    counted();
}

/// A stop while a takeover waits for another consumer's claim (up to a lease: 5 s here) gives
/// the message up at once, before its effect starts: `run` returns within a second or so
/// rather than after the wait, the message is left pending, and nothing ran. (A liveness
/// bound with a wide margin, seconds against the lease it would otherwise wait out, not a
/// measure of speed.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_during_a_takeovers_wait_gives_the_message_up_at_once() {
    let _turn = TURN.lock().await;
    let server = RedisServer::start();
    let client = common::client(&server.url()).await;
    let stream = "waiting";
    let () = client.xgroup_create(stream, "workers", "$", true).await.unwrap();
    let entry = publish(&client, stream, &[("id", "pay-w"), ("amount", "1")]).await;
    // A consumer that read it long ago and is gone: pending, idle for 100 s.
    let _: Value = (client
        .xreadgroup("workers", "gone", Some(1), None, false, stream, ">")
        .await)
        .unwrap();
    let _: Value = client
        .xclaim(
            stream,
            "workers",
            "gone",
            0,
            entry.as_str(),
            Some(100_000),
            None,
            None,
            false,
            true,
        )
        .await
        .unwrap();
    // Its key still claimed, by a claim that lives (renewed) for the whole test.
    let holder = Coordinator::new(RedisStore::connect(&server.url()).await.unwrap())
        .with_lease(Duration::from_secs(30));
    let key = RecordKey::new(None, IdempotencyKey::parse("pay-w").unwrap());
    let fingerprint = Fingerprint::new([b"amount".as_slice(), b"1"]);
    let Ok(Begin::Claimed(claim)) = holder.begin(&key, &fingerprint).await else {
        panic!("claim the key");
    };
    let (consumer, outcomes) = observed(consumer(&server.url(), stream, Duration::from_secs(5)).await);
    let (stop, task, effects) = spawn(consumer, Duration::ZERO);
    within("the consumer takes the message over", async {
        loop {
            let pending: Vec<(String, String, u64, u64)> =
                client.xpending(stream, "workers", ("-", "+", 10)).await.unwrap();
            if pending
                .first()
                .is_some_and(|(_, _, _, deliveries)| *deliveries == 2)
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let asked = Instant::now();
    let _ = stop.send(());
    within("the consumer stops", task).await.unwrap();
    let took = asked.elapsed();
    assert!(
        took < Duration::from_secs(2),
        "stopped {took:?} after it was asked, not at once"
    );
    assert_eq!(
        outcomes.lock().unwrap().get(&entry).map(String::as_str),
        Some("unavailable")
    );
    assert!(effects.lock().unwrap().is_empty(), "nothing ran");
    assert_eq!(pending(&client, stream).await, 1, "left pending");
    claim.release().await.unwrap();
    counted();
}

/// A publish to a stream's Redis that stopped answering (every connection black-holed by a
/// proxy, the client with no timeout of its own) errs within the publisher's bound (5 s, the
/// consumer's) instead of hanging: one publisher already past its first publish (its `XADD`
/// bounded), one new (the question whether the server deduplicates bounded too, and not
/// remembered as a "no"). About 5 s, both at once. A liveness bound with a wide margin (15 s
/// against a wait without end), not a measure of speed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publish_to_a_frozen_server_errs_within_the_bound() {
    let server = RedisServer::start();
    let proxy = common::proxy::FaultProxy::start(server.addr()).await;
    let client = Client::new(Config::from_url(&proxy.url()).unwrap(), None, None, None);
    client.init().await.unwrap();
    let warm = StreamPublisher::new(client.clone(), "frozen", "warm");
    warm.publish("pay-1", [("id", "pay-1")]).await.unwrap();
    let cold = StreamPublisher::new(client, "frozen", "cold");
    proxy.set(common::proxy::Fault::BlackHole);
    let asked = Instant::now();
    let (warm, cold) = within("both publishes answer", async {
        tokio::join!(
            warm.publish("pay-2", [("id", "pay-2")]),
            cold.publish("pay-3", [("id", "pay-3")])
        )
    })
    .await;
    let took = asked.elapsed();
    let timed_out = |answer: Result<String, fred::error::Error>| {
        answer.expect_err("no answer from a frozen server").kind() == &fred::error::ErrorKind::Timeout
    };
    assert!(timed_out(warm) && timed_out(cold), "both time out");
    assert!(took < Duration::from_secs(15), "answered after {took:?}");
}

/// Sends `signal` (`-TERM`, `-INT`) to this test process.
fn signal_self(signal: &str) {
    let pid = std::process::id().to_string();
    let status = std::process::Command::new("kill")
        .args([signal, &pid])
        .status()
        .unwrap();
    assert!(status.success(), "kill {signal} {pid}");
}

/// `shutdown_signal()` catches SIGTERM and SIGINT from the call on, not from its future's first
/// poll: each signal is sent before the future is polled, and the future still completes. Were
/// the handlers installed only when polled, the signal's default action would end this whole
/// test binary (`signal: 15, SIGTERM`), which is how this test fails. The 10 s bound is a
/// liveness bound (the future is ready at once, or never), not a measure. About 10 ms.
#[tokio::test]
async fn the_shutdown_signal_catches_sigterm_and_sigint_sent_before_it_is_polled() {
    for signal in ["-TERM", "-INT"] {
        let shutdown = tower_idempotency::shutdown_signal().expect("install the handlers");
        signal_self(signal);
        let caught = tokio::time::timeout(Duration::from_secs(10), shutdown).await;
        assert!(caught.is_ok(), "{signal}: the shutdown future did not complete");
    }
}
