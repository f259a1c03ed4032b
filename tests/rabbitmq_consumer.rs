//! `examples/rabbitmq_consumer.rs` run as its users run it: consumer processes on one quorum
//! queue of a real RabbitMQ node, with the Redis store and with PostgreSQL, `kill -9` at random
//! moments and replaced, over messages whose ids come two and three times. Then the effects are
//! counted per id, every message must end acknowledged or dead-lettered, and a message a killed
//! consumer held must be processed about a lease later (tests/common/consumers.rs does the
//! crashing and the counting). Also: poisoned messages are dead-lettered, a message that fails
//! every time is dead-lettered after `MAX_DELIVERIES`, and SIGTERM finishes the message in hand.
//!
//! The node (tests/common/rabbitmq.rs) takes seconds to boot, so every test here shares one,
//! each on queues of its own.

mod common;

use std::collections::{BTreeMap, HashMap};
use std::process::Command;
use std::time::{Duration, Instant};

use common::consumers::{self, Broker, Consumer, Log, Message};
use common::rabbitmq::{self, RabbitServer};
use common::RedisServer;
use fred::prelude::*;
use lapin::options::{
    BasicAckOptions, BasicGetOptions, BasicNackOptions, BasicPublishOptions, ConfirmSelectOptions,
    QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};

/// A lease short enough for a test: a killed consumer's message waits this long.
const LEASE_MS: u64 = 1000;

/// The node shared by this binary, started on a blocking thread (it takes seconds).
async fn node() -> &'static RabbitServer {
    tokio::task::spawn_blocking(rabbitmq::shared)
        .await
        .expect("start the shared RabbitMQ node")
}

/// A queue of its own on the shared node, a `redis-server` of its own (the Redis store and its
/// ledger, or only a bystander with PostgreSQL), and how its consumers are started.
struct Rabbit {
    node: &'static RabbitServer,
    connection: Connection,
    channel: Channel,
    queue: String,
    _redis: RedisServer,
    redis_url: String,
    client: Client,
    env: Vec<(String, String)>,
    /// When `settled` last found messages left.
    last_unsettled: std::sync::Mutex<Option<Instant>>,
    /// The PostgreSQL store's database: its URL and a pool to count the ledger's rows.
    #[cfg(feature = "postgres")]
    postgres: Option<(String, sqlx::PgPool)>,
}

impl Rabbit {
    async fn new(env: &[(&str, &str)]) -> Self {
        let node = node().await;
        let connection = Connection::connect(&node.url(), ConnectionProperties::default())
            .await
            .expect("connect to the test RabbitMQ node");
        let channel = connection.create_channel().await.expect("open a channel");
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .expect("publisher confirms");
        let queue = rabbitmq::unique_queue("payments");
        // Declared as the consumer declares it, so messages can be published before any runs.
        let text = |value: &str| AMQPValue::LongString(LongString::from(value));
        let mut arguments = FieldTable::default();
        arguments.insert("x-queue-type".into(), text("quorum"));
        arguments.insert("x-dead-letter-exchange".into(), text(""));
        arguments.insert("x-dead-letter-routing-key".into(), text(&format!("{queue}.dead")));
        let mut dead = FieldTable::default();
        dead.insert("x-queue-type".into(), text("quorum"));
        (channel.queue_declare(
            format!("{queue}.dead").into(),
            QueueDeclareOptions::durable(),
            dead,
        ))
        .await
        .expect("declare the dead-letter queue");
        (channel.queue_declare(queue.as_str().into(), QueueDeclareOptions::durable(), arguments))
            .await
            .expect("declare the queue");
        let redis = RedisServer::start();
        let redis_url = redis.url();
        let client = common::client(&redis_url).await;
        Self {
            node,
            connection,
            channel,
            queue,
            _redis: redis,
            redis_url,
            client,
            env: env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            last_unsettled: std::sync::Mutex::new(None),
            #[cfg(feature = "postgres")]
            postgres: None,
        }
    }

    /// The same, with the PostgreSQL store: a database of its own on the binary's shared server.
    #[cfg(feature = "postgres")]
    async fn with_postgres(env: &[(&str, &str)]) -> Self {
        let (url, pool) = common::postgres::fresh_database("rabbit").await;
        let mut rabbit = Self::new(env).await;
        rabbit.postgres = Some((url, pool));
        rabbit
    }

    fn transactional(&self) -> bool {
        #[cfg(feature = "postgres")]
        return self.postgres.is_some();
        #[cfg(not(feature = "postgres"))]
        false
    }

    /// Whether `id`'s effect is applied and its record not yet completed, as a consumer held
    /// by `PAUSE_AFTER_EFFECT_MS` leaves it: counted in Redis; in PostgreSQL, the row inserted
    /// by a transaction still open.
    async fn effect_pending(&self, id: &str) -> bool {
        #[cfg(feature = "postgres")]
        if let Some((_, pool)) = &self.postgres {
            let open: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity \
                 WHERE state = 'idle in transaction' AND query LIKE 'INSERT INTO ledger%'",
            )
            .fetch_one(pool)
            .await
            .unwrap();
            return open == 1;
        }
        self.effects().await.get(id) == Some(&1)
    }

    /// Publishes and answers each message beside its reference (its `message_id`).
    async fn publish_all(&self, messages: &[Message]) -> Vec<(Message, String)> {
        let references = self.publish(messages).await;
        messages.iter().cloned().zip(references).collect()
    }

    /// Publishes `body` as it is, persistent, with a `message_id` of its own, which it answers.
    async fn publish_body(&self, body: &[u8]) -> String {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static MESSAGES: AtomicUsize = AtomicUsize::new(0);
        let message_id = format!("m{}", MESSAGES.fetch_add(1, Ordering::Relaxed));
        let properties = BasicProperties::default()
            .with_message_id(message_id.as_str().into())
            .with_delivery_mode(2);
        let confirm = self
            .channel
            .basic_publish(
                "".into(),
                self.queue.as_str().into(),
                BasicPublishOptions::default(),
                body,
                properties,
            )
            .await
            .expect("publish")
            .await
            .expect("the broker's confirmation");
        assert!(confirm.is_ack(), "the broker refused a message");
        message_id
    }

    /// The queue's (ready, delivered and unacknowledged) messages. The queue applies what its
    /// channels send a moment later: an acknowledgement just sent may not be counted yet.
    async fn counts(&self) -> (u64, u64) {
        let (node, queue) = (self.node, self.queue.clone());
        tokio::task::spawn_blocking(move || node.queue_counts(&queue))
            .await
            .expect("count the queue's messages")
    }

    /// The dead letters, each as its `message_id`, its headers and its body; they stay in the
    /// queue (fetched unacknowledged on a channel that is then closed).
    async fn dead(&self) -> Vec<(String, FieldTable, Vec<u8>)> {
        let channel = self.connection.create_channel().await.expect("open a channel");
        let mut dead = Vec::new();
        let queue = format!("{}.dead", self.queue);
        while let Some(message) = channel
            .basic_get(queue.as_str().into(), BasicGetOptions::default())
            .await
            .expect("basic.get")
        {
            let delivery = message.delivery;
            let properties = delivery.properties;
            dead.push((
                properties
                    .message_id()
                    .as_ref()
                    .map(ToString::to_string)
                    .unwrap_or_default(),
                properties.headers().clone().unwrap_or_default(),
                delivery.data,
            ));
        }
        let _ = channel.close(200, "read".into()).await;
        dead
    }
}

/// A header's text, if it is a string.
fn header(headers: &FieldTable, name: &str) -> String {
    match headers.inner().get(name) {
        Some(AMQPValue::LongString(text)) => String::from_utf8_lossy(text.as_bytes()).into_owned(),
        Some(AMQPValue::ShortString(text)) => text.to_string(),
        _ => String::new(),
    }
}

impl Broker for Rabbit {
    async fn publish(&self, messages: &[Message]) -> Vec<String> {
        let mut references = Vec::new();
        for message in messages {
            let body = serde_json::json!({ "id": message.id, "amount": message.amount });
            references.push(self.publish_body(body.to_string().as_bytes()).await);
        }
        references
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
            .hgetall(format!("{}:ledger", self.queue))
            .await
            .unwrap();
        ledger.into_iter().collect()
    }

    /// No message waits for a consumer, none is delivered and unacknowledged. (Every message
    /// is published before the consumers start.) Asked of the node at most every 100 ms:
    /// the harness asks every 10 ms, and each answer is a distribution connection to the node.
    async fn settled(&self) -> bool {
        let unsettled = |at: Option<Instant>| {
            *self.last_unsettled.lock().unwrap_or_else(|p| p.into_inner()) = at;
        };
        let last = *self.last_unsettled.lock().unwrap_or_else(|p| p.into_inner());
        if last.is_some_and(|last| last.elapsed() < Duration::from_millis(100)) {
            return false;
        }
        let settled = self.counts().await == (0, 0);
        unsettled((!settled).then(Instant::now));
        settled
    }

    async fn dead_letters(&self) -> Vec<(String, String)> {
        (self.dead().await.into_iter())
            .map(|(message_id, headers, _)| (message_id, header(&headers, "x-dead-reason")))
            .collect()
    }

    fn consumer(&self) -> Command {
        let mut command = Command::new(common::example_binary("rabbitmq_consumer"));
        command
            .env("AMQP_URL", self.node.url())
            .env("REDIS_URL", &self.redis_url)
            .env("QUEUE", &self.queue)
            .env("LEASE_MS", LEASE_MS.to_string())
            .env("RUST_LOG", "rabbitmq_consumer=debug,warn")
            .env_remove("DATABASE_URL")
            .env_remove("CONSUMER")
            .envs(self.env.iter().map(|(k, v)| (k, v)));
        #[cfg(feature = "postgres")]
        if let Some((url, _)) = &self.postgres {
            command.env("DATABASE_URL", url);
        }
        command
    }
}

/// The crash test (`consumers::crash_test`). RabbitMQ gives a killed
/// consumer's message to another at once, which waits for the dead one's lease (renewed until
/// the kill, so at most a lease) and runs it; another consumer may get it only once it has
/// finished its own message, which may itself be waiting for a lease.
async fn crash(rabbit: Rabbit) {
    consumers::crash_test(&rabbit, rabbit.transactional(), Duration::from_millis(LEASE_MS)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_with_the_redis_store() {
    let env = consumers::crash_env();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    crash(Rabbit::new(&env).await).await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_with_the_postgres_store() {
    let env = consumers::crash_env();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    crash(Rabbit::with_postgres(&env).await).await;
}

/// A consumer killed in the middle of a message: RabbitMQ hands the message to the other
/// consumer at once (`redelivered`, `x-delivery-count` 1), which waits for the dead one's lease
/// and runs it once the lease has passed, and no later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_consumers_message_is_processed_a_lease_later() {
    let rabbit = Rabbit::new(&[("WORK_MS", "300")]).await;
    let log = Log::default();
    let first = Consumer::start(0, rabbit.consumer(), &log);
    log.wait_for("the first consumer is ready", Duration::from_secs(10), |e| {
        e.consumer == 0 && e.text.contains("consuming")
    })
    .await;
    let second = Consumer::start(1, rabbit.consumer(), &log);
    log.wait_for("the second consumer is ready", Duration::from_secs(10), |e| {
        e.consumer == 1 && e.text.contains("consuming")
    })
    .await;
    let published = rabbit
        .publish_all(&[Message {
            id: "pay-held".into(),
            amount: 5,
        }])
        .await;
    let msg = published[0].1.clone();
    let taken = log
        .wait_for("a consumer takes the message", Duration::from_secs(10), |e| {
            e.kind == "received" && e.msg == msg
        })
        .await;
    let (victim, survivor) = if taken.consumer == 0 {
        (first, second)
    } else {
        (second, first)
    };
    // Into the work (300 ms), after the claim.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let killed = Instant::now();
    victim.kill();
    let redelivered = log
        .wait_for("the survivor gets it again", Duration::from_secs(10), |e| {
            e.consumer == survivor.index && e.kind == "received" && e.msg == msg
        })
        .await;
    let done = log
        .wait_for("the survivor runs it", Duration::from_secs(10), |e| {
            e.consumer == survivor.index && e.is_final() && e.msg == msg
        })
        .await;
    let effect = log
        .wait_for("the survivor's effect", Duration::from_secs(1), |e| {
            e.consumer == survivor.index && e.kind == "effect" && e.msg == msg
        })
        .await;
    let redelivery = redelivered.at.duration_since(killed);
    // The survivor claims the key, then works 300 ms, then logs `effect`.
    let in_flight = effect
        .at
        .duration_since(killed)
        .saturating_sub(Duration::from_millis(300));
    let delay = done.at.duration_since(killed);
    eprintln!(
        "redelivered {} ms after the kill (deliveries={}); the key stayed in flight about {} ms \
         after the kill; processed {} ms after it (lease {LEASE_MS} ms, work 300 ms)",
        redelivery.as_millis(),
        redelivered.fields.get("deliveries").map_or("?", String::as_str),
        in_flight.as_millis(),
        delay.as_millis()
    );
    assert_eq!(done.kind, "ran", "{}", log.dump());
    assert_eq!(
        redelivered.fields.get("deliveries").map(String::as_str),
        Some("2"),
        "{}",
        log.dump()
    );
    assert!(
        redelivery < Duration::from_millis(LEASE_MS / 2),
        "RabbitMQ should redeliver at once when the channel dies: {redelivery:?}\n{}",
        log.dump()
    );
    assert!(
        delay >= Duration::from_millis(LEASE_MS / 2),
        "run again before the dead consumer's lease could end: {delay:?}\n{}",
        log.dump()
    );
    assert!(
        delay <= Duration::from_millis(LEASE_MS + 300 + 700),
        "run {delay:?} after the kill, more than a lease and the work\n{}",
        log.dump()
    );
    assert!(survivor.terminate().success());
    assert_eq!(rabbit.effects().await.get("pay-held"), Some(&1));
    common::until_async("acknowledged", || rabbit.settled()).await;
}

/// A consumer killed right after the effect, before its record is completed (held there by
/// `PAUSE_AFTER_EFFECT_MS`), and another started: answers how many times the effect was applied,
/// and what the second consumer logged for the message.
async fn kill_between_effect_and_completion(rabbit: &Rabbit) -> (u64, String) {
    let log = Log::default();
    let mut paused = rabbit.consumer();
    paused.env("PAUSE_AFTER_EFFECT_MS", "5000");
    let first = Consumer::start(0, paused, &log);
    let msg = rabbit.publish_body(br#"{"id": "pay-w", "amount": 3}"#).await;
    log.wait_for(
        "the first consumer reaches the effect",
        Duration::from_secs(10),
        |e| e.consumer == 0 && e.kind == "effect" && e.msg == msg,
    )
    .await;
    // `effect` is logged right before the effect: wait until it is applied (in Redis), or
    // inserted and waiting for its commit (in PostgreSQL).
    common::until_async("the effect is applied", || rabbit.effect_pending("pay-w")).await;
    first.kill();
    let second = Consumer::start(1, rabbit.consumer(), &log);
    let done = log
        .wait_for("the second consumer settles it", Duration::from_secs(10), |e| {
            e.consumer == 1 && e.is_final() && e.msg == msg
        })
        .await;
    assert!(second.terminate().success(), "{}", log.dump());
    common::until_async("acknowledged", || rabbit.settled()).await;
    let effects = rabbit.effects().await.get("pay-w").copied().unwrap_or(0);
    (effects, done.kind)
}

/// The limit of a store apart from the business data: killed between the effect and the
/// completion of its record, the Redis store's record is still in flight, so once its lease
/// ends the redelivered message runs again, and the effect is applied twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_applies_an_effect_twice_when_killed_between_effect_and_completion() {
    let rabbit = Rabbit::new(&[]).await;
    let (effects, outcome) = kill_between_effect_and_completion(&rabbit).await;
    assert_eq!((effects, outcome.as_str()), (2, "ran"));
}

/// With the effect in the record's PostgreSQL transaction, the same kill rolls both back: the
/// redelivered message runs once more, and there is one row.
#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_applies_an_effect_once_when_killed_between_effect_and_completion() {
    let rabbit = Rabbit::with_postgres(&[]).await;
    let (effects, outcome) = kill_between_effect_and_completion(&rabbit).await;
    assert_eq!((effects, outcome.as_str()), (1, "ran"));
}

/// What cannot succeed is dead-lettered, with its body and properties and a reason, and
/// acknowledged: an id that is not a key, a body without an id or with an amount that is not
/// a number, an id reused with another amount.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poisoned_messages_are_dead_lettered() {
    let rabbit = Rabbit::new(&[]).await;
    let good = rabbit.publish_body(br#"{"id": "pay-1", "amount": 40}"#).await;
    let again = rabbit.publish_body(br#"{"id": "pay-1", "amount": 40}"#).await;
    let reused = rabbit.publish_body(br#"{"id": "pay-1", "amount": 41}"#).await;
    let bad_id = rabbit.publish_body(br#"{"id": "not a key", "amount": 1}"#).await;
    let bad_amount = rabbit.publish_body(br#"{"id": "pay-2", "amount": "lots"}"#).await;
    let no_id = rabbit.publish_body(br#"{"amount": 3}"#).await;
    let not_json = rabbit.publish_body(b"id=pay-3 amount=3").await;
    let log = Log::default();
    let consumer = Consumer::start(0, rabbit.consumer(), &log);
    common::until_async("all settled", || rabbit.settled()).await;
    assert!(consumer.terminate().success());
    let outcomes: BTreeMap<String, String> = (log.events().into_iter())
        .filter(|e| e.is_final())
        .map(|e| (e.msg, e.kind))
        .collect();
    assert_eq!(outcomes[&good], "ran", "{}", log.dump());
    assert_eq!(outcomes[&again], "replayed", "{}", log.dump());
    let dead: BTreeMap<String, String> = rabbit.dead_letters().await.into_iter().collect();
    assert_eq!(dead.len(), 5, "{dead:?}");
    assert!(dead[&reused].starts_with("mismatch"), "{dead:?}");
    assert!(dead[&bad_id].starts_with("bad id"), "{dead:?}");
    assert!(dead[&bad_amount].starts_with("bad body"), "{dead:?}");
    assert!(dead[&no_id].starts_with("bad body"), "{dead:?}");
    assert!(dead[&not_json].starts_with("bad body"), "{dead:?}");
    // The dead letter keeps the message's body, and says where it came from.
    let letters = rabbit.dead().await;
    let (_, headers, body) = letters.iter().find(|(m, _, _)| *m == bad_id).unwrap();
    assert_eq!(body.as_slice(), br#"{"id": "not a key", "amount": 1}"#);
    assert_eq!(header(headers, "x-dead-queue"), rabbit.queue);
    assert_eq!(rabbit.effects().await, BTreeMap::from([("pay-1".to_owned(), 1)]));
}

/// A message whose effect fails every time (the ledger is not a hash) is rejected and
/// delivered again after a pause each time, then dead-lettered once delivered more than
/// `MAX_DELIVERIES` times (counted by the quorum queue's `x-delivery-count`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_that_always_fails_is_dead_lettered_after_max_deliveries() {
    let rabbit = Rabbit::new(&[("MAX_DELIVERIES", "2")]).await;
    let () = rabbit
        .client
        .set(
            format!("{}:ledger", rabbit.queue),
            "not a hash",
            None,
            None,
            false,
        )
        .await
        .unwrap();
    let msg = rabbit.publish_body(br#"{"id": "pay-9", "amount": 9}"#).await;
    let log = Log::default();
    let consumer = Consumer::start(0, rabbit.consumer(), &log);
    common::until_async("dead-lettered", || rabbit.settled()).await;
    assert!(consumer.terminate().success());
    let kinds: Vec<String> = (log.events().into_iter())
        .filter(|e| e.is_outcome() && e.msg == msg)
        .map(|e| e.kind)
        .collect();
    assert_eq!(kinds, ["failed", "failed", "dead-lettered"], "{}", log.dump());
    let dead = rabbit.dead_letters().await;
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].0, msg);
    assert!(dead[0].1.contains("delivered 3 times"), "{dead:?}");
}

/// A store outage costs no delivery: the consumer holds the message and tries again until the
/// store answers, so even with `MAX_DELIVERIES=1` the message runs once Redis is back, rather
/// than going round the queue and into the dead letters.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_outage_holds_the_message_rather_than_dead_lettering_it() {
    let mut rabbit = Rabbit::new(&[("MAX_DELIVERIES", "1")]).await;
    let log = Log::default();
    let consumer = Consumer::start(0, rabbit.consumer(), &log);
    // Up and consuming first (it connects to the store at its start).
    let warm = rabbit.publish_body(br#"{"id": "pay-w", "amount": 1}"#).await;
    log.wait_for("the first message runs", Duration::from_secs(20), |e| {
        e.is_outcome() && e.msg == warm
    })
    .await;
    rabbit._redis.kill();
    let msg = rabbit.publish_body(br#"{"id": "pay-o", "amount": 2}"#).await;
    log.wait_for("the consumer takes the message", Duration::from_secs(10), |e| {
        e.kind == "received" && e.msg == msg
    })
    .await;
    // Past the store timeout (2 s) and a few tries: the old way, each a delivery, would have
    // dead-lettered it by now.
    tokio::time::sleep(Duration::from_secs(4)).await;
    rabbit._redis.restart();
    common::until_async("the message is settled", || rabbit.settled()).await;
    assert!(consumer.terminate().success());
    let kinds: Vec<String> = (log.events().into_iter())
        .filter(|e| e.is_outcome() && e.msg == msg)
        .map(|e| e.kind)
        .collect();
    assert_eq!(kinds, ["ran"], "{}", log.dump());
    assert!(rabbit.dead_letters().await.is_empty());
    assert_eq!(rabbit.effects().await.get("pay-o"), Some(&1));
}

/// SIGTERM in the middle of a message: the consumer finishes it, acknowledges it, and exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_finishes_the_message_in_hand() {
    let rabbit = Rabbit::new(&[("WORK_MS", "700")]).await;
    let log = Log::default();
    let consumer = Consumer::start(0, rabbit.consumer(), &log);
    let msg = rabbit.publish_body(br#"{"id": "pay-7", "amount": 7}"#).await;
    log.wait_for("the consumer takes the message", Duration::from_secs(10), |e| {
        e.kind == "received" && e.msg == msg
    })
    .await;
    let asked = Instant::now();
    let status = consumer.terminate();
    eprintln!("exited {} ms after SIGTERM", asked.elapsed().as_millis());
    assert!(status.success(), "exit status {status}\n{}", log.dump());
    let ran = log.events().into_iter().find(|e| e.is_final() && e.msg == msg);
    assert_eq!(ran.map(|e| e.kind).as_deref(), Some("ran"), "{}", log.dump());
    // The queue applies an acknowledgement a moment after the consumer sent it.
    common::until_async("acknowledged before exiting", || rabbit.settled()).await;
    assert_eq!(rabbit.effects().await.get("pay-7"), Some(&1));
}

/// The node's own measure: how long `rabbitmq-server` took to accept AMQP, and that it runs on
/// the ports and node name of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_node_is_private() {
    let node = node().await;
    eprintln!(
        "RabbitMQ node {} accepted AMQP {:?} after its start",
        node.node(),
        node.started_in()
    );
    assert_ne!(node.addr().port(), 5672);
    let answer = node.eval("node().");
    assert!(answer.contains(node.node()), "{answer}");
}

/// Issue 37: a dead letter the broker refuses (`<QUEUE>.dead` full at `x-overflow:
/// reject-publish`, set by a policy, as an operator would) is not left unsettled: the message is
/// nacked, requeued, 500 ms later, and tried again, so the consumer (prefetch 1) goes on; once
/// the dead queue has room, it is dead-lettered and the message behind it runs. Before, the
/// refused message stayed delivered and unacknowledged, and the consumer stalled until the
/// broker's `consumer_timeout` (30 min).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_dead_letter_is_requeued_and_the_consumer_goes_on() {
    let rabbit = Rabbit::new(&[]).await;
    let dead_queue = format!("{}.dead", rabbit.queue);
    let (node, pattern) = (rabbit.node, format!("^{dead_queue}$"));
    tokio::task::spawn_blocking(move || {
        node.eval(&format!(
            "rabbit_policy:set(<<\"/\">>, <<\"{pattern}\">>, <<\"{pattern}\">>, \
             [{{<<\"max-length\">>, 1}}, {{<<\"overflow\">>, <<\"reject-publish\">>}}], \
             0, <<\"queues\">>, <<\"test\">>)."
        ))
    })
    .await
    .unwrap();
    let publish_dead = |message_id: &'static str| {
        let properties = BasicProperties::default()
            .with_message_id(message_id.into())
            .with_delivery_mode(2);
        let channel = &rabbit.channel;
        let queue = dead_queue.as_str();
        async move {
            (channel.basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions::default(),
                b"filler",
                properties,
            ))
            .await
            .expect("publish")
            .await
            .expect("the broker's confirmation")
            .is_ack()
        }
    };
    // Filled until it refuses one (the policy in force, the queue at or over its length: a
    // quorum queue learns it is over its limit as a publish lands, so it may take one more).
    let deadline = Instant::now() + Duration::from_secs(10);
    while publish_dead("filler").await {
        assert!(
            Instant::now() < deadline,
            "the dead queue never refused a message"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let log = Log::default();
    let consumer = Consumer::start(0, rabbit.consumer(), &log);
    let poison = rabbit.publish_body(b"not json").await;
    let good = rabbit.publish_body(br#"{"id": "pay-5", "amount": 5}"#).await;
    // Refused, requeued and refused again: the consumer did not stall on the first.
    let refusals = || {
        (log.events().into_iter())
            .filter(|e| e.kind == "unavailable" && e.msg == poison)
            .count()
    };
    log.wait_for("the dead letter refused", Duration::from_secs(15), |e| {
        e.kind == "unavailable" && e.msg == poison
    })
    .await;
    common::until("the message requeued and its dead letter refused again", || {
        refusals() >= 2
    })
    .await;
    // Room for one: the next attempt is confirmed.
    // Emptied of its fillers, it takes the next attempt.
    let mut fillers = 0;
    while let Some(taken) = (rabbit.channel)
        .basic_get(dead_queue.as_str().into(), BasicGetOptions::default())
        .await
        .expect("basic.get")
    {
        let acker = &taken.delivery.acker;
        if taken.delivery.data != b"filler" {
            acker
                .nack(BasicNackOptions {
                    requeue: true,
                    ..Default::default()
                })
                .await
                .unwrap();
            break;
        }
        acker.ack(BasicAckOptions::default()).await.unwrap();
        fillers += 1;
    }
    assert!(fillers >= 1, "the dead queue held no filler");
    let deadline = Instant::now() + Duration::from_secs(15);
    while !rabbit.settled().await {
        let counts = rabbit.counts().await;
        assert!(
            Instant::now() < deadline,
            "never settled: {counts:?}\n{}",
            log.dump()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(consumer.terminate().success());
    let outcomes: BTreeMap<String, String> = (log.events().into_iter())
        .filter(|e| e.is_final())
        .map(|e| (e.msg, e.kind))
        .collect();
    assert_eq!(
        outcomes.get(&poison).map(String::as_str),
        Some("dead-lettered"),
        "{}",
        log.dump()
    );
    assert_eq!(
        outcomes.get(&good).map(String::as_str),
        Some("ran"),
        "{}",
        log.dump()
    );
    let dead: BTreeMap<String, String> = rabbit.dead_letters().await.into_iter().collect();
    assert!(dead[&poison].starts_with("bad body"), "{dead:?}");
}
