//! `examples/stream_consumer.rs` run as its users run it: consumer processes in one consumer
//! group on a real `redis-server`, with the Redis store and with PostgreSQL, `kill -9` at random
//! moments and replaced, over messages whose ids come two and three times. Then the effects are
//! counted per id, every message must end acknowledged or dead-lettered, and a message a killed
//! consumer held must be processed about a lease later (tests/common/consumers.rs does the
//! crashing and the counting). Also: poisoned messages are dead-lettered, a message that fails
//! every time is dead-lettered after `MAX_DELIVERIES`, and SIGTERM finishes the message in hand.

mod common;

use std::collections::{BTreeMap, HashMap};
use std::process::Command;
use std::time::{Duration, Instant};

use common::consumers::{self, Broker, Consumer, Log, Message};
use common::RedisServer;
use fred::prelude::*;
use tower_idempotency::{Begin, Coordinator, Fingerprint, IdempotencyKey, RecordKey, RedisStore};

/// A lease short enough for a test: a killed consumer's message waits this long.
const LEASE_MS: u64 = 1000;

/// The example's contract for its log lines (its header lists them), so they cannot drift:
/// every line on stdout has one of these shapes, and so does every line of the example's own
/// on stderr (`RUST_LOG=stream_consumer=debug`), after the time and level. `{entry}` is a
/// stream entry id, `{n}` a number, `{int}` one with an optional sign, `{bool}` `true` or
/// `false`, `{q}` a quoted string (Rust's `{:?}` of a `&str`). Dead-letter reasons are held to
/// their wording by `poisoned_messages_are_dead_lettered`.
const OUTCOME_LINES: &[&str] = &[
    "ran msg={entry} id={q} amount={int} took_ms={n}",
    "ran msg={entry} id={q} amount={int} took_ms={n} not_stored={q}",
    "replayed msg={entry} id={q} took_ms={n}",
    "in-flight msg={entry} id={q} retry_after_ms={n} (left pending)",
    "failed msg={entry} id={q} error={q} (left pending)",
    "unavailable msg={entry} id={q} error={q} (left pending)",
    "dead-lettered msg={entry} id={q} reason={q}",
];
const DEBUG_LINES: &[&str] = &[
    "DEBUG stream_consumer: received msg={entry} id={q} deliveries={n} takeover={bool}",
    "DEBUG stream_consumer: running msg={entry} id={q}",
    "DEBUG stream_consumer: effect msg={entry} id={q}",
    "DEBUG stream_consumer: completed msg={entry} id={q} window_us={n}",
    " INFO stream_consumer: consuming consumer={q} group={q} stream={q} store={q}",
    " INFO stream_consumer: stopped",
];

/// Whether `line` has the shape `shape` (placeholders as in [`OUTCOME_LINES`]).
fn fits(line: &str, shape: &str) -> bool {
    let (mut line, mut shape) = (line, shape);
    while let Some(start) = shape.find('{') {
        let Some(rest) = line.strip_prefix(&shape[..start]) else {
            return false;
        };
        let end = start + shape[start..].find('}').expect("a closed placeholder");
        let taken = match &shape[start + 1..end] {
            "n" => rest.find(|c: char| !c.is_ascii_digit()).unwrap_or(rest.len()),
            "int" => {
                let sign = usize::from(rest.starts_with('-'));
                sign + rest[sign..]
                    .find(|c: char| !c.is_ascii_digit())
                    .unwrap_or(rest.len() - sign)
            }
            "entry" => rest
                .find(|c: char| !c.is_ascii_digit() && c != '-')
                .unwrap_or(rest.len()),
            "bool" if rest.starts_with("true") => 4,
            "bool" if rest.starts_with("false") => 5,
            "q" if rest.starts_with('"') => {
                // To the closing quote, past escaped ones.
                let mut escaped = false;
                match rest[1..].char_indices().find(|&(_, c)| {
                    let closes = c == '"' && !escaped;
                    escaped = c == '\\' && !escaped;
                    closes
                }) {
                    Some((at, _)) => at + 2,
                    None => return false,
                }
            }
            _ => return false,
        };
        if taken == 0 {
            return false;
        }
        line = &rest[taken..];
        shape = &shape[end + 1..];
    }
    line == shape
}

/// Panics unless every line the example wrote (stdout) and every line of its own on stderr
/// has one of the contract's shapes.
fn assert_lines_keep_their_shape(log: &Log) {
    for event in log.events() {
        let line = event.text.as_str();
        let ok = if !event.debug {
            OUTCOME_LINES.iter().any(|shape| fits(line, shape))
        } else {
            // "<time> LEVEL target: …" (the level padded to 5): the example's own lines are
            // its contract, the crate's and fred's are not.
            let rest = line.split_once(' ').map_or(line, |(_, rest)| rest);
            !rest.contains(" stream_consumer: ") || DEBUG_LINES.iter().any(|shape| fits(rest, shape))
        };
        assert!(
            ok,
            "a line of the example out of its contract's shape: {line:?}\n{}",
            log.dump()
        );
    }
}

#[test]
fn the_shapes_tell_a_line_that_drifted() {
    let ran = "ran msg=1700000000000-0 id=\"pay-1\" amount=40 took_ms=3";
    assert!(fits(ran, OUTCOME_LINES[0]));
    assert!(!fits(
        "ran msg=1700000000000-0 id=\"pay-1\" took_ms=3 amount=40",
        OUTCOME_LINES[0]
    ));
    assert!(!fits(
        "failed msg=1-0 id=\"p\" took_ms=1 error=\"x\" (left pending)",
        OUTCOME_LINES[4]
    ));
    assert!(fits(
        "failed msg=1-0 id=\"p\" error=\"a \\\"b\\\" c\" (left pending)",
        OUTCOME_LINES[4]
    ));
    assert!(fits(
        "dead-lettered msg=1-0 id=\"\" reason=\"bad id: no UTF-8 field `id`\"",
        OUTCOME_LINES[6]
    ));
}

/// A stream on a `redis-server` of the test's own, and how its consumers are started.
struct Streams {
    _server: RedisServer,
    url: String,
    client: Client,
    stream: String,
    env: Vec<(String, String)>,
    /// The PostgreSQL store's database: its URL and a pool to count the ledger's rows.
    #[cfg(feature = "postgres")]
    postgres: Option<(String, sqlx::PgPool)>,
}

impl Streams {
    async fn new(env: &[(&str, &str)]) -> Self {
        let server = RedisServer::start();
        let url = server.url();
        let client = common::client(&url).await;
        Self {
            _server: server,
            url,
            client,
            stream: "payments".into(),
            env: env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            #[cfg(feature = "postgres")]
            postgres: None,
        }
    }

    /// The same, with the PostgreSQL store: a database of its own on the binary's shared server.
    #[cfg(feature = "postgres")]
    async fn with_postgres(env: &[(&str, &str)]) -> Self {
        let (url, pool) = common::postgres::fresh_database("streams").await;
        let mut streams = Self::new(env).await;
        streams.postgres = Some((url, pool));
        streams
    }

    fn transactional(&self) -> bool {
        #[cfg(feature = "postgres")]
        return self.postgres.is_some();
        #[cfg(not(feature = "postgres"))]
        false
    }

    /// Publishes and answers each message beside its entry id.
    async fn publish_all(&self, messages: &[Message]) -> Vec<(Message, String)> {
        let entries = self.publish(messages).await;
        messages.iter().cloned().zip(entries).collect()
    }

    async fn publish_fields(&self, fields: &[(&str, &str)]) -> String {
        let fields: Vec<(&str, &str)> = fields.to_vec();
        self.client
            .xadd(&self.stream, false, None, "*", fields)
            .await
            .unwrap()
    }

    async fn pending(&self) -> u64 {
        let summary: Value = self.client.xpending(&self.stream, "workers", ()).await.unwrap();
        summary.into_array().first().and_then(Value::as_u64).unwrap_or(0)
    }
}

impl Broker for Streams {
    async fn publish(&self, messages: &[Message]) -> Vec<String> {
        let mut entries = Vec::new();
        for message in messages {
            let amount = message.amount.to_string();
            entries.push(
                self.publish_fields(&[("id", &message.id), ("amount", &amount)])
                    .await,
            );
        }
        entries
    }

    async fn effects(&self) -> BTreeMap<String, u64> {
        #[cfg(feature = "postgres")]
        if let Some((_, pool)) = &self.postgres {
            let rows: Vec<(String, i64)> = sqlx::query_as("SELECT id, count(*) FROM ledger GROUP BY id")
                .fetch_all(pool)
                .await
                .unwrap_or_default();
            return rows.into_iter().map(|(id, n)| (id, n as u64)).collect();
        }
        let ledger: HashMap<String, u64> = self
            .client
            .hgetall(format!("{}:ledger", self.stream))
            .await
            .unwrap();
        ledger.into_iter().collect()
    }

    /// Nothing pending in the group, and the group has been handed the stream's last entry.
    async fn settled(&self) -> bool {
        let groups: Vec<HashMap<String, Value>> = self.client.xinfo_groups(&self.stream).await.unwrap();
        let Some(group) = groups
            .iter()
            .find(|g| g["name"].as_str().as_deref() == Some("workers"))
        else {
            return false;
        };
        let last: Vec<(String, HashMap<String, Value>)> = self
            .client
            .xrevrange_values(&self.stream, "+", "-", Some(1))
            .await
            .unwrap();
        let delivered = group["last-delivered-id"].as_string();
        group["pending"].as_u64() == Some(0) && last.first().map(|(id, _)| id.clone()) == delivered
    }

    async fn dead_letters(&self) -> Vec<(String, String)> {
        let dead: Vec<(String, HashMap<String, String>)> = self
            .client
            .xrange_values(format!("{}:dead", self.stream), "-", "+", None)
            .await
            .unwrap();
        dead.into_iter()
            .map(|(_, fields)| (fields["entry"].clone(), fields["reason"].clone()))
            .collect()
    }

    fn consumer(&self) -> Command {
        let mut command = Command::new(common::example_binary("stream_consumer"));
        command
            .env("REDIS_URL", &self.url)
            .env("STREAM", &self.stream)
            .env("LEASE_MS", LEASE_MS.to_string())
            .env("RUST_LOG", "stream_consumer=debug,warn")
            .env_remove("DATABASE_URL")
            .env_remove("GROUP")
            .env_remove("CONSUMER")
            .envs(self.env.iter().map(|(k, v)| (k, v)));
        #[cfg(feature = "postgres")]
        if let Some((url, _)) = &self.postgres {
            command.env("DATABASE_URL", url);
        }
        command
    }
}

/// The crash test (`consumers::crash_test`). A message a killed consumer
/// held has been pending since before the kill, so it is taken over a lease after it at the
/// latest, and the consumer that takes it over waits for the claim's lease, which ends at most
/// a lease after the kill; another takeover the taker waits on first can add a lease.
async fn crash(streams: Streams) {
    consumers::crash_test(&streams, streams.transactional(), Duration::from_millis(LEASE_MS)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_with_the_redis_store() {
    let env = consumers::crash_env();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    crash(Streams::new(&env).await).await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_with_the_postgres_store() {
    let env = consumers::crash_env();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    crash(Streams::with_postgres(&env).await).await;
}

/// A consumer killed in the middle of a message, after its claim's lease was renewed: another
/// takes the message over once it has been idle a lease (the dead consumer last reset its idle
/// time with its renewal, a third of a lease after taking it), waits for the claim's lease to
/// end, and runs it then: less than a lease after the kill (about 0.83 lease, plus up to 200 ms
/// until the taker looks), where leaving it pending once more would take two.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_consumers_message_is_processed_a_lease_later() {
    let streams = Streams::new(&[("WORK_MS", "800")]).await;
    let log = Log::default();
    let first = Consumer::start(0, streams.consumer(), &log);
    let second = Consumer::start(1, streams.consumer(), &log);
    let published = streams
        .publish_all(&[Message {
            id: "pay-held".into(),
            amount: 5,
        }])
        .await;
    let entry = published[0].1.clone();
    let taken = log
        .wait_for("a consumer takes the message", Duration::from_secs(10), |e| {
            e.kind == "received" && e.msg == entry
        })
        .await;
    // Past the first renewal (a third of the lease): the claim now ends a lease after that.
    tokio::time::sleep_until((taken.at + Duration::from_millis(500)).into()).await;
    let killed = Instant::now();
    let (victim, survivor) = if taken.consumer == 0 {
        (first, second)
    } else {
        (second, first)
    };
    victim.kill();
    let running = log
        .wait_for("the other consumer runs it", Duration::from_secs(10), |e| {
            e.consumer == survivor.index && e.kind == "running" && e.msg == entry
        })
        .await;
    let done = log
        .wait_for("the other consumer finishes it", Duration::from_secs(10), |e| {
            e.consumer == survivor.index && e.is_final() && e.msg == entry
        })
        .await;
    let (started, finished) = (running.at - killed, done.at - killed);
    eprintln!(
        "run again {} ms after the kill, done {} ms after it (lease {LEASE_MS} ms, work 800 ms)",
        started.as_millis(),
        finished.as_millis()
    );
    assert_eq!(done.kind, "ran", "{}", log.dump());
    // Not before it has been pending a lease (500 ms of which passed before the kill).
    assert!(
        started >= Duration::from_millis(LEASE_MS - 600),
        "taken over {started:?} after the kill, before its lease could end\n{}",
        log.dump()
    );
    assert!(
        started <= Duration::from_millis(LEASE_MS + 300),
        "run again {started:?} after the kill, more than a lease\n{}",
        log.dump()
    );
    assert!(survivor.terminate().success());
    assert_eq!(streams.effects().await.get("pay-held"), Some(&1));
    assert!(streams.settled().await);
    assert_lines_keep_their_shape(&log);
}

/// What cannot succeed is dead-lettered with its fields and a reason, and acknowledged: an id
/// that is not a key, an amount that is not a number, an id reused with another amount. A bad
/// amount is found before its key is claimed: dead-lettered even while another consumer holds
/// that key (claimed first, it would be `in-flight` and left pending).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poisoned_messages_are_dead_lettered() {
    let streams = Streams::new(&[]).await;
    let holder = Coordinator::new(RedisStore::connect(&streams.url).await.unwrap())
        .with_lease(Duration::from_secs(30));
    let key = RecordKey::new(None, IdempotencyKey::parse("pay-2").unwrap());
    let Ok(Begin::Claimed(claim)) = holder.begin(&key, &Fingerprint::new([b"1".as_slice()])).await else {
        panic!("claim the key");
    };
    let good = streams.publish_fields(&[("id", "pay-1"), ("amount", "40")]).await;
    let again = streams.publish_fields(&[("id", "pay-1"), ("amount", "40")]).await;
    let reused = streams.publish_fields(&[("id", "pay-1"), ("amount", "41")]).await;
    let bad_id = streams
        .publish_fields(&[("id", "not a key"), ("amount", "1")])
        .await;
    let bad_amount = streams
        .publish_fields(&[("id", "pay-2"), ("amount", "lots")])
        .await;
    let no_id = streams.publish_fields(&[("amount", "3")]).await;
    let log = Log::default();
    let consumer = Consumer::start(0, streams.consumer(), &log);
    common::until_async("all settled", || streams.settled()).await;
    assert!(consumer.terminate().success());
    let outcomes: BTreeMap<String, String> = (log.events().into_iter())
        .filter(|e| e.is_final())
        .map(|e| (e.msg, e.kind))
        .collect();
    assert_eq!(outcomes[&good], "ran", "{}", log.dump());
    assert_eq!(outcomes[&again], "replayed", "{}", log.dump());
    let dead: BTreeMap<String, String> = streams.dead_letters().await.into_iter().collect();
    assert_eq!(dead.len(), 4, "{dead:?}");
    assert_eq!(dead[&reused], "mismatch: this id came before with another amount");
    assert!(dead[&bad_id].starts_with("bad id: "), "{dead:?}");
    assert_eq!(dead[&bad_amount], "bad amount: \"lots\" is not an integer");
    assert_eq!(dead[&no_id], "bad id: no UTF-8 field `id`");
    // Each dead-lettered line says the reason the dead letter keeps.
    for (entry, reason) in &dead {
        let line = (log.events().into_iter()).find(|e| e.kind == "dead-lettered" && e.msg == *entry);
        assert_eq!(
            line.and_then(|e| e.fields.get("reason").cloned()).as_ref(),
            Some(reason)
        );
    }
    assert_lines_keep_their_shape(&log);
    claim.release().await.unwrap();
    // The dead letter keeps the message's own fields.
    let entries: Vec<(String, HashMap<String, String>)> = streams
        .client
        .xrange_values("payments:dead", "-", "+", None)
        .await
        .unwrap();
    let (_, kept) = entries.iter().find(|(_, f)| f["entry"] == bad_id).unwrap();
    assert_eq!((kept["id"].as_str(), kept["amount"].as_str()), ("not a key", "1"));
    assert_eq!(streams.effects().await, BTreeMap::from([("pay-1".to_owned(), 1)]));
    assert_eq!(streams.pending().await, 0);
}

/// A message whose effect fails every time (the ledger is not a hash) is delivered again after
/// each lease, then dead-lettered once delivered more than `MAX_DELIVERIES` times.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_that_always_fails_is_dead_lettered_after_max_deliveries() {
    let streams = Streams::new(&[("MAX_DELIVERIES", "2"), ("LEASE_MS", "300")]).await;
    let () = streams
        .client
        .set("payments:ledger", "not a hash", None, None, false)
        .await
        .unwrap();
    let entry = streams.publish_fields(&[("id", "pay-9"), ("amount", "9")]).await;
    let log = Log::default();
    let consumer = Consumer::start(0, streams.consumer(), &log);
    common::until_async("dead-lettered", || streams.settled()).await;
    assert!(consumer.terminate().success());
    let kinds: Vec<String> = (log.events().into_iter())
        .filter(|e| e.is_outcome() && e.msg == entry)
        .map(|e| e.kind)
        .collect();
    assert_eq!(kinds, ["failed", "failed", "dead-lettered"], "{}", log.dump());
    let dead = streams.dead_letters().await;
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].0, entry);
    assert_eq!(
        dead[0].1,
        "delivered 3 times, more than the bound on deliveries (2)"
    );
    assert_lines_keep_their_shape(&log);
}

/// A store outage costs no delivery: the consumer holds the message and tries again until the
/// store answers, keeping it from the other consumer's takeovers meanwhile, so even with
/// `MAX_DELIVERIES=1` the message runs once PostgreSQL is back (frozen here for longer than a
/// lease, with `SIGSTOP`), rather than being taken over and dead-lettered.
#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_outage_holds_the_message_rather_than_dead_lettering_it() {
    let server = tokio::task::spawn_blocking(common::postgres::PgServer::start)
        .await
        .expect("start a PostgreSQL server of this test's own");
    let mut streams = Streams::new(&[("MAX_DELIVERIES", "1"), ("LEASE_MS", "3000")]).await;
    let pool = sqlx::PgPool::connect(&server.url()).await.unwrap();
    streams.postgres = Some((server.url(), pool));
    let log = Log::default();
    let first = Consumer::start(0, streams.consumer(), &log);
    let warm = streams.publish_fields(&[("id", "pay-w"), ("amount", "1")]).await;
    log.wait_for("the first message runs", Duration::from_secs(20), |e| {
        e.is_outcome() && e.msg == warm
    })
    .await;
    // A second consumer, idle, would take the message over after a lease (3 s) if it were not
    // kept: that takeover would be its second delivery, one more than MAX_DELIVERIES. (Started
    // now: a consumer connects to its store at its start.)
    let second = Consumer::start(1, streams.consumer(), &log);
    log.wait_for("the second consumer is up", Duration::from_secs(20), |e| {
        e.consumer == 1 && e.kind == "consuming"
    })
    .await;
    server.pause();
    let entry = streams.publish_fields(&[("id", "pay-o"), ("amount", "2")]).await;
    log.wait_for("a consumer takes the message", Duration::from_secs(10), |e| {
        e.kind == "received" && e.msg == entry
    })
    .await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    server.resume();
    common::until_async("the message is settled", || streams.settled()).await;
    assert!(first.terminate().success());
    let status = second.terminate();
    assert!(status.success(), "second consumer: {status}\n{}", log.dump());
    let kinds: Vec<String> = (log.events().into_iter())
        .filter(|e| e.is_outcome() && e.msg == entry)
        .map(|e| e.kind)
        .collect();
    assert_eq!(kinds, ["ran"], "{}", log.dump());
    assert!(streams.dead_letters().await.is_empty());
    assert_eq!(streams.effects().await.get("pay-o"), Some(&1));
    assert_lines_keep_their_shape(&log);
}

/// SIGTERM in the middle of a message: the consumer finishes it, acknowledges it, and exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_finishes_the_message_in_hand() {
    let streams = Streams::new(&[("WORK_MS", "700")]).await;
    let log = Log::default();
    let consumer = Consumer::start(0, streams.consumer(), &log);
    let entry = streams.publish_fields(&[("id", "pay-7"), ("amount", "7")]).await;
    log.wait_for("the consumer takes the message", Duration::from_secs(10), |e| {
        e.kind == "received" && e.msg == entry
    })
    .await;
    let asked = Instant::now();
    let status = consumer.terminate();
    eprintln!("exited {} ms after SIGTERM", asked.elapsed().as_millis());
    assert!(status.success(), "exit status {status}\n{}", log.dump());
    let ran = log.events().into_iter().find(|e| e.is_final() && e.msg == entry);
    assert_eq!(ran.map(|e| e.kind).as_deref(), Some("ran"), "{}", log.dump());
    assert_eq!(streams.pending().await, 0, "acknowledged before exiting");
    assert_eq!(streams.effects().await.get("pay-7"), Some(&1));
    assert_lines_keep_their_shape(&log);
}

/// A message whose key another consumer holds is left pending (`in-flight`) and taken over by
/// the consumer itself once idle a lease; SIGTERM while that takeover waits for the claim gives
/// it up (`unavailable`, left pending), exit 0, nothing applied. About 3 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_key_is_in_flight_and_a_stop_during_the_takeovers_wait_leaves_it_pending() {
    // A lease of 2 s: the takeover waits up to that for the claim, time enough for SIGTERM.
    let streams = Streams::new(&[("LEASE_MS", "2000")]).await;
    let holder = Coordinator::new(RedisStore::connect(&streams.url).await.unwrap())
        .with_lease(Duration::from_secs(30));
    let key = RecordKey::new(None, IdempotencyKey::parse("pay-h").unwrap());
    // The consumer's fingerprint of `amount=4` (the field named, present, its value), or the
    // message would be a mismatch rather than in flight.
    let fingerprint = Fingerprint::new([b"amount".as_slice(), &[1], b"4"]);
    let Ok(Begin::Claimed(claim)) = holder.begin(&key, &fingerprint).await else {
        panic!("claim the key");
    };
    let log = Log::default();
    let consumer = Consumer::start(0, streams.consumer(), &log);
    let entry = streams.publish_fields(&[("id", "pay-h"), ("amount", "4")]).await;
    log.wait_for("taken over", Duration::from_secs(10), |e| {
        e.kind == "received" && e.msg == entry && e.fields.get("takeover").map(String::as_str) == Some("true")
    })
    .await;
    let status = consumer.terminate();
    assert!(status.success(), "exit status {status}\n{}", log.dump());
    let kinds: Vec<String> = (log.events().into_iter())
        .filter(|e| e.is_outcome() && e.msg == entry)
        .map(|e| e.kind)
        .collect();
    assert_eq!(kinds, ["in-flight", "unavailable"], "{}", log.dump());
    assert_eq!(streams.pending().await, 1, "left pending");
    assert!(streams.effects().await.is_empty());
    assert_lines_keep_their_shape(&log);
    claim.release().await.unwrap();
}

/// The guide's Redis Streams consumer (docs/queue-consumers.md) is `examples/guide_stream_consumer.rs`
/// below its header, so the code that the next test runs is the code a reader copies.
#[test]
fn the_guides_consumer_is_the_example_run_here() {
    let guide = include_str!("../docs/queue-consumers.md");
    let example = include_str!("../examples/guide_stream_consumer.rs");
    let code: Vec<&str> = example
        .lines()
        .skip_while(|l| l.starts_with("//!") || l.is_empty())
        .collect();
    let start = guide
        .find("```rust,no_run\nuse std::time::Duration;")
        .expect("the guide's consumer")
        + 15;
    let block: Vec<&str> = guide[start..].lines().take_while(|l| *l != "```").collect();
    assert_eq!(
        block, code,
        "docs/queue-consumers.md and examples/guide_stream_consumer.rs differ"
    );
}

/// Stops (`SIGSTOP`) or resumes (`SIGCONT`) a server: an outage without a lost connection.
fn signal(server: &RedisServer, signal: &str) {
    let pid = server.pid().expect("the store is running").to_string();
    assert!(Command::new("kill")
        .args([signal, &pid])
        .status()
        .unwrap()
        .success());
}

/// The guide's consumer, as a new user would run it (records in a Redis of their own, so an
/// outage of the store leaves the stream up): a duplicate is acknowledged without a second
/// effect and a mismatch dead-lettered; a message that arrives while the store is stopped
/// (`SIGSTOP`, for longer than a lease) is held and applied once the store is back; a consumer
/// killed with `kill -9` while it holds a message leaves it to another consumer, which takes it
/// over after the lease and applies it once; and SIGTERM while a message is held stops the
/// consumer at once, exit 0, the message left pending, not acknowledged and not applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_guides_consumer_handles_duplicates_mismatches_outages_kills_and_sigterm() {
    let streams = Streams::new(&[]).await;
    let store = RedisServer::start();
    let command = || {
        let mut command = Command::new(common::example_binary("guide_stream_consumer"));
        command
            .env("REDIS_URL", &streams.url)
            .env("STORE_URL", store.url())
            .env("LEASE_MS", LEASE_MS.to_string());
        command
    };
    let client = &streams.client;
    let balance = |id: &'static str| async move {
        let balance: Option<i64> = client.get(format!("balance:{id}")).await.unwrap();
        balance
    };
    let held = || async { streams.pending().await == 1 };
    let log = Log::default();
    let first = Consumer::start(0, command(), &log);

    streams.publish_fields(&[("id", "pay-1"), ("amount", "40")]).await;
    streams.publish_fields(&[("id", "pay-1"), ("amount", "40")]).await;
    let reused = streams.publish_fields(&[("id", "pay-1"), ("amount", "41")]).await;
    common::until_async("duplicate and mismatch settled", || streams.settled()).await;
    assert_eq!(balance("pay-1").await, Some(40), "one effect for the duplicate");
    let dead = streams.dead_letters().await;
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert!(
        dead[0].0 == reused && dead[0].1.starts_with("mismatch"),
        "{dead:?}"
    );

    // An outage of the store longer than a lease: held, then applied once.
    signal(&store, "-STOP");
    streams.publish_fields(&[("id", "pay-2"), ("amount", "5")]).await;
    common::until_async("the consumer holds pay-2", held).await;
    tokio::time::sleep(Duration::from_millis(LEASE_MS * 3)).await;
    // Held in hand, not left to a takeover (by itself, or any consumer): still one delivery.
    let pending: Vec<(String, String, u64, u64)> = client
        .xpending(&streams.stream, "workers", ("-", "+", 10))
        .await
        .unwrap();
    assert_eq!(
        pending.iter().map(|p| p.3).collect::<Vec<_>>(),
        [1],
        "deliveries of the held message"
    );
    signal(&store, "-CONT");
    common::until_async("pay-2 settled after the outage", || streams.settled()).await;
    assert_eq!(balance("pay-2").await, Some(5));

    // kill -9 while it holds pay-3: taken over by a new consumer after the lease.
    signal(&store, "-STOP");
    streams.publish_fields(&[("id", "pay-3"), ("amount", "7")]).await;
    common::until_async("the consumer holds pay-3", held).await;
    first.kill();
    signal(&store, "-CONT");
    let killed = Instant::now();
    let second = Consumer::start(1, command(), &log);
    common::until_async("pay-3 taken over and settled", || streams.settled()).await;
    eprintln!("pay-3 settled {} ms after the kill", killed.elapsed().as_millis());
    assert_eq!(balance("pay-3").await, Some(7));

    // SIGTERM while it holds pay-4: exits 0 without acknowledging or applying it.
    signal(&store, "-STOP");
    streams.publish_fields(&[("id", "pay-4"), ("amount", "9")]).await;
    common::until_async("the consumer holds pay-4", held).await;
    let asked = Instant::now();
    let status = second.terminate();
    signal(&store, "-CONT");
    eprintln!("exited {} ms after SIGTERM", asked.elapsed().as_millis());
    assert!(status.success(), "exit status {status}\n{}", log.dump());
    assert_eq!(streams.pending().await, 1, "left pending, not acknowledged");
    assert_eq!(balance("pay-4").await, None, "not applied");
    assert_eq!(streams.dead_letters().await.len(), 1);
}

/// The guide's consumer as a new user runs it, one Redis for the stream and the records: when
/// the server drops every connection (a restart, a failover, a load balancer's idle timeout
/// look the same to the client), the consumer reconnects and goes on reading, rather than
/// warning about failed reads for good. The 15 s bound is a liveness bound, not a measure: the
/// consumer reads again within about a second, or never. About 0.5 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_guides_consumer_reads_on_after_its_connections_are_dropped() {
    let streams = Streams::new(&[]).await;
    let mut command = Command::new(common::example_binary("guide_stream_consumer"));
    command
        .env("REDIS_URL", &streams.url)
        .env_remove("STORE_URL")
        .env("LEASE_MS", LEASE_MS.to_string());
    let log = Log::default();
    let consumer = Consumer::start(0, command, &log);
    let client = &streams.client;
    let balance = |id: &'static str| async move {
        let balance: Option<i64> = client.get(format!("balance:{id}")).await.unwrap();
        balance
    };
    streams.publish_fields(&[("id", "pay-1"), ("amount", "40")]).await;
    common::until_async("pay-1 settled", || streams.settled()).await;
    // Every connection but this test's own (`SKIPME yes`, the default): the consumer's reads
    // and its store's.
    let killed = common::admin(&streams.client, &["CLIENT", "KILL", "TYPE", "normal"]).await;
    assert!(
        killed.as_u64().is_some_and(|n| n >= 2),
        "connections killed: {killed:?}"
    );
    streams.publish_fields(&[("id", "pay-2"), ("amount", "5")]).await;
    common::until_async("pay-2 settled after the connections dropped", || {
        streams.settled()
    })
    .await;
    assert_eq!(
        (balance("pay-1").await, balance("pay-2").await),
        (Some(40), Some(5))
    );
    assert!(consumer.terminate().success(), "{}", log.dump());
}

/// Runs `stream_consumer publish <id> <amount>` against `url` and answers the entry id it
/// printed and whether it said the server deduplicates.
fn publish_with_the_example(url: &str, id: &str, amount: &str) -> (String, String) {
    let output = Command::new(common::example_binary("stream_consumer"))
        .args(["publish", id, amount])
        .env("REDIS_URL", url)
        .env("STREAM", "payments")
        .env_remove("PRODUCER")
        .output()
        .expect("run the example's publisher");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let field = |name: &str| {
        let start = stdout
            .find(&format!("{name}="))
            .unwrap_or_else(|| panic!("{name}= in {stdout}"));
        stdout[start + name.len() + 1..]
            .split_whitespace()
            .next()
            .unwrap_or_default()
            .to_owned()
    };
    (field("msg"), field("deduplicated"))
}

/// A publish retried (the example's publisher run twice with one id, as a producer does after a
/// timeout): on Redis 8.6 (`XADD … IDMP`) the retry answers the first entry and adds nothing; on
/// the 7.0 of the other tests it adds a second entry, which the consumer acknowledges as a
/// replay: one effect either way, end to end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_publish_is_added_once_on_redis_8_6_and_applied_once_on_older_servers() {
    let newer = tokio::task::spawn_blocking(|| RedisServer::start_binary(common::newer_server("redis-8.6")))
        .await
        .unwrap();
    let first = publish_with_the_example(&newer.url(), "pay-r", "3");
    let retry = publish_with_the_example(&newer.url(), "pay-r", "3");
    assert_eq!(first.1, "true", "Redis 8.6 deduplicates");
    assert_eq!(retry.0, first.0, "the retry answers the first entry");
    let length: u64 = common::client(&newer.url()).await.xlen("payments").await.unwrap();
    assert_eq!(length, 1);

    let streams = Streams::new(&[]).await;
    let first = publish_with_the_example(&streams.url, "pay-r", "3");
    let retry = publish_with_the_example(&streams.url, "pay-r", "3");
    assert_eq!(first.1, "false", "Redis 7.0 does not");
    assert_ne!(retry.0, first.0, "a second entry");
    let log = Log::default();
    let consumer = Consumer::start(0, streams.consumer(), &log);
    common::until_async("both settled", || streams.settled()).await;
    assert!(consumer.terminate().success());
    let kinds: Vec<String> = (log.events().into_iter())
        .filter(|e| e.is_final())
        .map(|e| e.kind)
        .collect();
    assert_eq!(kinds, ["ran", "replayed"], "{}", log.dump());
    assert_eq!(streams.effects().await.get("pay-r"), Some(&1));
    assert_lines_keep_their_shape(&log);
}
