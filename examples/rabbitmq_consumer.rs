//! Run with: AMQP_URL=amqp://guest:guest@127.0.0.1:5672/%2f REDIS_URL=redis://127.0.0.1:6379 cargo run --example rabbitmq_consumer
//!
//! A RabbitMQ consumer that applies each message's effect once, however often the message is
//! delivered and wherever a consumer dies. Run several at once; `kill -9` any of them: RabbitMQ
//! gives the message it held to another at once, which waits for the dead one's lease to end
//! and then processes it.
//!
//! In another shell, with the same `AMQP_URL` (and `QUEUE`, if set), publish with the example
//! itself (`publish ID AMOUNT [MESSAGE_ID]`, a persistent message, confirmed by the broker):
//!
//! ```text
//! cargo run --example rabbitmq_consumer -- publish pay-1 40   # {"id":"pay-1","amount":40}
//! cargo run --example rabbitmq_consumer -- publish pay-1 40   # a duplicate: acknowledged, not applied
//! cargo run --example rabbitmq_consumer -- publish pay-1 41   # the same id, another amount: dead-lettered
//! redis-cli HGETALL payments:ledger                            # pay-1 -> 1
//! ```
//!
//! With the PostgreSQL store (the effect and the record commit in one transaction):
//! `DATABASE_URL=postgres://… AMQP_URL=amqp://… cargo run --example rabbitmq_consumer --features postgres`.
//!
//! # Contract
//!
//! Environment:
//! - `AMQP_URL`: the broker (required);
//! - `REDIS_URL`: the store and the ledger, unless `DATABASE_URL` is set;
//! - `DATABASE_URL` (built with `--features postgres`): the store and the ledger are in
//!   PostgreSQL, and `REDIS_URL` is not used;
//! - `QUEUE` (default `payments`): a durable quorum queue, declared if missing, with
//!   `<QUEUE>.dead` beside it;
//! - `CONSUMER` (default host name and pid): the consumer tag;
//! - `WORK_MS`: simulated work before the effect (default 0);
//! - `LEASE_MS`: the claim's lease, which is also how long a message redelivered after its
//!   consumer died waits for that consumer's claim (default 30000);
//! - `MAX_DELIVERIES`: a message delivered more times than this is dead-lettered without being
//!   run (default 5): a message that fails every time, or kills its consumer. Each failure
//!   costs a delivery (500 ms apart); a store outage costs none, since the message is held
//!   and tried again in hand until the store answers;
//! - `PAUSE_AFTER_EFFECT_MS`: a pause right after the effect, before its record is completed
//!   (before the commit, with PostgreSQL), to `kill -9` the consumer there and watch what a
//!   redelivery does (default 0; the tests set it).
//!
//! Each message's body is JSON, `{"id": "pay-1", "amount": 40}`: `id` the idempotency key,
//! `amount` an integer; other fields are ignored. The record's fingerprint covers `id` and
//! `amount`, so the same `id` with another `amount` is dead-lettered. The message's `message_id`
//! property, when set, names it in the log (else its delivery tag does). The effect:
//! `HINCRBY <QUEUE>:ledger <id> 1` on `REDIS_URL`; with `DATABASE_URL`, one row in the table
//! `ledger (id text, amount bigint)` (created if missing), inserted in the transaction that
//! completes the record.
//!
//! What happens to a message, from what [`Coordinator::once`] answered:
//!
//! | answer                               | log line        | the message                                 |
//! |--------------------------------------|-----------------|---------------------------------------------|
//! | ran (also ran but not stored)        | `ran`           | `basic.ack`                                 |
//! | replayed (a duplicate)               | `replayed`      | `basic.ack`                                 |
//! | in flight on another consumer, a lease later | `in-flight` | `basic.nack`, requeued                  |
//! | the operation failed                 | `failed`        | `basic.reject`, requeued, after 500 ms      |
//! | store unavailable                    | (a warning)     | held, and tried again after 0.5, 1, 2, 4, 5, 5… s until the store answers; on `SIGTERM`, `unavailable` and `basic.reject`, requeued |
//! | mismatch, bad body, too many deliveries, unreadable record, operation past its timeout | `dead-lettered` | published to `<QUEUE>.dead` (confirmed), then `basic.ack` |
//! | the same, but the broker refuses the dead letter (`<QUEUE>.dead` full, no quorum) | `unavailable` | `basic.nack`, requeued, after 500 ms |
//!
//! Every call waits up to a lease for a key another consumer holds (`.wait(lease)`): a message
//! redelivered because its consumer died runs as soon as that consumer's lease ends, and a
//! duplicate of a message in progress gets its result as soon as it is stored, rather than going
//! round the queue meanwhile.
//!
//! It logs one line per message on stdout, `<outcome> msg=<message id> id="<id>" …`, written
//! before the acknowledgement. On `SIGTERM` (or Ctrl-C) it finishes the message in hand and
//! exits 0. With `RUST_LOG=rabbitmq_consumer=debug` it also logs on stderr when it takes a message
//! (`received`), right before the effect (`effect`), and, on the Redis store, how long after
//! the effect its record was completed (`completed … window_us=`): a crash inside that window
//! applies the effect again on redelivery, the limit of a store apart from the business data.
//! It exits with an error when the connection to RabbitMQ is lost: run it under a supervisor
//! that restarts it (the messages it held are redelivered meanwhile).
//!
//! # Why this way
//!
//! - **Manual acknowledgements, prefetch 1.** A message is acknowledged only once its record is
//!   completed or replayed, so a consumer that dies before that leaves it to be redelivered.
//!   Prefetch 1 because messages run one at a time here: more would sit in this consumer's
//!   buffer, unavailable to the others, each `kill -9` would send all of them back (raising
//!   their delivery counts towards `MAX_DELIVERIES`), and a `SIGTERM` would return them too.
//! - **A quorum queue.** It counts deliveries in the `x-delivery-count` header (absent on the
//!   first), including the ones that ended with the consumer's channel, which is what bounds a
//!   poison message that crashes its consumer every time. RabbitMQ 4.3 and later count only the
//!   returns that signal a failure: `basic.reject`, as here for a failure, not `basic.nack`,
//!   as here for a key in flight elsewhere, which is no failure of the message.
//! - **Dead-lettering by the consumer**, not by the broker's `x-delivery-limit`: the dead letter
//!   carries why (`x-dead-reason`: a mismatch, a bad body, too many deliveries), a mismatch is
//!   dead-lettered at its first delivery, a message whose stored result is found is acknowledged
//!   whatever its count, and `MAX_DELIVERIES` can change without redeclaring the queue (a queue's
//!   arguments cannot change). The copy is published with a publisher confirmation before the
//!   original is acknowledged: a crash in between dead-letters it twice, never loses it. The queue
//!   also names `<QUEUE>.dead` as its dead-letter route, so a message the broker gives up on by
//!   itself (RabbitMQ 4 applies a delivery limit of 20 to quorum queues by default) lands there
//!   too rather than being dropped.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use fred::prelude::{Builder, Client, ClientLike, Config, HashesInterface, ReconnectPolicy};
use futures_util::StreamExt;
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicPublishOptions, BasicQosOptions,
    BasicRejectOptions, ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use tokio::signal::unix::{signal, SignalKind};
use tower_idempotency::bytes::Bytes;
use tower_idempotency::{
    Coordinator, Disposition, Error, Fingerprint, IdempotencyKey, Once, RecordKey, RedisStore,
};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A failure or a store that did not answer: wait this long before returning the message, so a
/// dependency that is down is not hammered by the same message going round.
const RETRY_PAUSE: Duration = Duration::from_millis(500);

struct Settings {
    queue: String,
    consumer: String,
    work: Duration,
    lease: Duration,
    max_deliveries: u64,
    pause_after_effect: Duration,
}

/// Where the effect goes, and so which store keeps the records.
enum Ledger {
    /// `HINCRBY <QUEUE>:ledger <id> 1`; records in the same Redis.
    Redis(Client),
    /// A row in `ledger`, in the transaction that completes the record.
    #[cfg(feature = "postgres")]
    Postgres(tower_idempotency::PostgresStore),
}

/// A message's body.
#[derive(serde::Deserialize)]
struct Payment {
    id: String,
    amount: i64,
}

struct Consumer {
    /// Turns true on SIGTERM or Ctrl-C.
    stopping: tokio::sync::watch::Receiver<bool>,
    channel: Channel,
    coordinator: Coordinator,
    ledger: Ledger,
    settings: Settings,
    ledger_key: String,
    dead_queue: String,
}

impl Consumer {
    async fn handle(&self, delivery: Delivery) {
        let msg = match delivery.properties.message_id() {
            Some(id) => id.to_string(),
            None => format!("tag-{}", delivery.delivery_tag),
        };
        let deliveries = delivery_count(&delivery) + 1;
        let payment: Payment = match serde_json::from_slice(&delivery.data) {
            Ok(payment) => payment,
            Err(error) => {
                let reason = format!("bad body: {error}");
                return self.dead_letter(&delivery, &msg, "", deliveries, &reason).await;
            }
        };
        let id = payment.id.as_str();
        tracing::debug!(
            msg,
            id,
            deliveries,
            redelivered = delivery.redelivered,
            "received"
        );
        if deliveries > self.settings.max_deliveries {
            let reason = format!(
                "delivered {deliveries} times, more than MAX_DELIVERIES ({})",
                self.settings.max_deliveries
            );
            return self.dead_letter(&delivery, &msg, id, deliveries, &reason).await;
        }
        let key = match IdempotencyKey::parse(id) {
            Ok(key) => RecordKey::new(None, key),
            Err(error) => {
                let reason = format!("bad id: {error}");
                return self.dead_letter(&delivery, &msg, id, deliveries, &reason).await;
            }
        };
        // What defines the message: the same id with another amount is not a duplicate.
        let amount_text = payment.amount.to_string();
        let fingerprint = Fingerprint::new([id.as_bytes(), amount_text.as_bytes()]);
        let started = Instant::now();
        // While the store does not answer, nothing can run: the message is held in hand and
        // tried again (the crate's `Once::hold_through_outage`), not sent round the queue, where
        // each return counts towards MAX_DELIVERIES and an outage would dead-letter every
        // message it meets. Until SIGTERM, which sends it back.
        let mut stopping = self.stopping.clone();
        let stop = async move {
            let _ = stopping.wait_for(|stop| *stop).await;
        };
        let run = || async {
            match &self.ledger {
                Ledger::Redis(redis) => self.count_in_redis(redis, &msg, &key, &fingerprint).await,
                #[cfg(feature = "postgres")]
                Ledger::Postgres(store) => {
                    (self.insert_row(store, &msg, &key, &fingerprint, payment.amount)).await
                }
            }
        };
        let answer = Once::hold_through_outage(run, stop).await;
        let took_ms = started.elapsed().as_millis();
        let what = format!("msg={msg} id={id:?} deliveries={deliveries}");
        let amount = payment.amount;
        let disposition = answer.disposition();
        // The log line says what happened; the disposition what to do with the message.
        match &answer {
            Once::Ran(_) => println!("ran {what} amount={amount} took_ms={took_ms}"),
            Once::NotStored { error, .. } => println!(
                "ran {what} amount={amount} took_ms={took_ms} not_stored={:?}",
                error.to_string()
            ),
            Once::Replayed(_) => println!("replayed {what} took_ms={took_ms}"),
            Once::InFlight { retry_after } => println!(
                "in-flight {what} retry_after_ms={} (requeued)",
                retry_after.as_millis()
            ),
            Once::Failed(error) => println!("failed {what} error={:?} (requeued)", error.to_string()),
            Once::Unavailable(error) if disposition != Disposition::DeadLetter => {
                println!("unavailable {what} error={:?} (requeued)", error.to_string())
            }
            Once::Unavailable(_) | Once::Mismatch => {} // logged as dead-lettered, with the reason
        }
        match disposition {
            Disposition::Ack => self.settle(&msg, delivery.acker.ack(BasicAckOptions::default()).await),
            // Still in flight after waiting a lease: its consumer is alive and renewing. No
            // failure of this message, so a nack, which RabbitMQ 4.3+ does not count.
            Disposition::Retry { after: Some(_) } => {
                let requeue = BasicNackOptions {
                    requeue: true,
                    ..BasicNackOptions::default()
                };
                self.settle(&msg, delivery.acker.nack(requeue).await)
            }
            Disposition::Retry { after: None } => self.retry_later(&delivery, &msg).await,
            Disposition::DeadLetter => {
                let reason = match &answer {
                    Once::Unavailable(error @ Error::OperationTimedOut(_)) => format!("timed out: {error}"),
                    Once::Unavailable(error) => format!("unreadable record: {error}"),
                    _ => "mismatch: this id came before with another amount".to_owned(),
                };
                self.dead_letter(&delivery, &msg, id, deliveries, &reason).await
            }
        }
    }

    /// The effect on the Redis store: a counter beside the records, not in their transaction.
    async fn count_in_redis(
        &self,
        redis: &Client,
        msg: &str,
        key: &RecordKey,
        fingerprint: &Fingerprint,
    ) -> Once<Bytes, BoxError> {
        let id = key.key().as_str();
        let applied = Mutex::new(None);
        let answer = self
            .coordinator
            .once(key, fingerprint, || async {
                tokio::time::sleep(self.settings.work).await;
                tracing::debug!(msg, id, "effect");
                let count: i64 = redis.hincrby(&self.ledger_key, id, 1).await?;
                *applied.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
                tokio::time::sleep(self.settings.pause_after_effect).await;
                Ok::<_, BoxError>(Bytes::from(format!("{id} counted ({count})")))
            })
            .wait(self.settings.lease)
            .await;
        if let (Once::Ran(_), Some(applied)) = (&answer, *applied.lock().unwrap_or_else(|p| p.into_inner())) {
            // From the effect's reply to the completion's: a crash in between applies the
            // effect again on redelivery.
            let window_us = applied.elapsed().as_micros();
            tracing::debug!(msg, id, window_us, "completed");
        }
        answer
    }

    /// The effect on the PostgreSQL store: a row, committed with the record's completion.
    #[cfg(feature = "postgres")]
    async fn insert_row(
        &self,
        store: &tower_idempotency::PostgresStore,
        msg: &str,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        amount: i64,
    ) -> Once<Bytes, BoxError> {
        let id = key.key().as_str();
        self.coordinator
            .once_with_ticket(key, fingerprint, |ticket| async move {
                tokio::time::sleep(self.settings.work).await;
                tracing::debug!(msg, id, "effect");
                // The row commits with the record, or neither does: a claim lost meanwhile (its
                // lease ran out, so another consumer may run it) rolls the row back.
                let mut transaction = store.transaction_for(&ticket).await?;
                sqlx::query("INSERT INTO ledger (id, amount) VALUES ($1, $2)")
                    .bind(id)
                    .bind(amount)
                    .execute(&mut *transaction)
                    .await?;
                tokio::time::sleep(self.settings.pause_after_effect).await;
                let receipt = Bytes::from(format!("{id} recorded"));
                Ok::<Bytes, BoxError>(transaction.commit(receipt).await?)
            })
            .wait(self.settings.lease)
            .await
    }

    /// Returns the message to the queue after a pause, as a failed delivery (`basic.reject`,
    /// which every RabbitMQ version counts in `x-delivery-count`).
    async fn retry_later(&self, delivery: &Delivery, msg: &str) {
        tokio::time::sleep(RETRY_PAUSE).await;
        let requeue = BasicRejectOptions { requeue: true };
        self.settle(msg, delivery.acker.reject(requeue).await);
    }

    /// Publishes a copy of the message to `<QUEUE>.dead` with the reason, waits for the broker
    /// to confirm it, then acknowledges the original. A crash in between leaves the original to
    /// be delivered, and dead-lettered, again: two copies, none lost. A copy the broker refuses
    /// (`<QUEUE>.dead` full at `x-overflow: reject-publish`, or without a quorum) leaves the
    /// original to be delivered again after a pause (`basic.nack`, requeued): left unsettled,
    /// it would hold this consumer's only prefetch place until the broker's `consumer_timeout`
    /// (30 min by default) closed the channel.
    async fn dead_letter(&self, delivery: &Delivery, msg: &str, id: &str, deliveries: u64, reason: &str) {
        let mut headers = delivery.properties.headers().clone().unwrap_or_default();
        headers.insert(
            "x-dead-reason".into(),
            AMQPValue::LongString(LongString::from(reason)),
        );
        headers.insert(
            "x-dead-queue".into(),
            AMQPValue::LongString(LongString::from(self.settings.queue.as_str())),
        );
        let properties = delivery
            .properties
            .clone()
            .with_headers(headers)
            .with_delivery_mode(2);
        let published = async {
            let confirm = self
                .channel
                .basic_publish(
                    ShortString::from(""),
                    ShortString::from(self.dead_queue.as_str()),
                    BasicPublishOptions::default(),
                    &delivery.data,
                    properties,
                )
                .await?;
            Ok::<_, lapin::Error>(confirm.await?.is_ack())
        };
        let refused = match published.await {
            Ok(true) => {
                println!("dead-lettered msg={msg} id={id:?} deliveries={deliveries} reason={reason:?}");
                return self.settle(msg, delivery.acker.ack(BasicAckOptions::default()).await);
            }
            Ok(false) => format!("the broker refused the dead letter to {}", self.dead_queue),
            Err(error) => format!("could not dead-letter: {error}"),
        };
        println!("unavailable msg={msg} id={id:?} deliveries={deliveries} error={refused:?} (requeued)");
        tokio::time::sleep(RETRY_PAUSE).await;
        // No failure of the message: a nack, which RabbitMQ 4.3+ does not count as a delivery.
        let requeue = BasicNackOptions {
            requeue: true,
            ..BasicNackOptions::default()
        };
        self.settle(msg, delivery.acker.nack(requeue).await);
    }

    /// Logs an acknowledgement that did not reach the broker: the channel is gone, so the
    /// message is delivered again (and gets the stored result), and the consumer stream ends.
    fn settle(&self, msg: &str, sent: Result<bool, lapin::Error>) {
        if let Err(error) = sent {
            tracing::warn!(msg, %error, "the acknowledgement failed; the message will be delivered again");
        }
    }
}

/// How many times the queue delivered the message before this delivery: the quorum queue's
/// `x-delivery-count` header, absent on a first delivery.
fn delivery_count(delivery: &Delivery) -> u64 {
    let count = (delivery.properties.headers().as_ref())
        .and_then(|headers| headers.inner().get("x-delivery-count"))
        .and_then(|value| match value {
            AMQPValue::LongLongInt(n) => u64::try_from(*n).ok(),
            AMQPValue::LongInt(n) => u64::try_from(*n).ok(),
            AMQPValue::LongUInt(n) => Some(u64::from(*n)),
            AMQPValue::ShortInt(n) => u64::try_from(*n).ok(),
            AMQPValue::ShortShortInt(n) => u64::try_from(*n).ok(),
            _ => None,
        });
    count.unwrap_or(0)
}

/// Declares the quorum queue and its dead-letter queue (both durable; a no-op when they exist
/// with the same arguments).
async fn declare(channel: &Channel, queue: &str, dead_queue: &str) -> Result<(), lapin::Error> {
    let text = |value: &str| AMQPValue::LongString(LongString::from(value));
    let mut arguments = FieldTable::default();
    arguments.insert("x-queue-type".into(), text("quorum"));
    arguments.insert("x-dead-letter-exchange".into(), text(""));
    arguments.insert("x-dead-letter-routing-key".into(), text(dead_queue));
    let mut dead_arguments = FieldTable::default();
    dead_arguments.insert("x-queue-type".into(), text("quorum"));
    channel
        .queue_declare(dead_queue.into(), QueueDeclareOptions::durable(), dead_arguments)
        .await?;
    channel
        .queue_declare(queue.into(), QueueDeclareOptions::durable(), arguments)
        .await?;
    Ok(())
}

fn setting<T: std::str::FromStr>(name: &str, default: T) -> Result<T, BoxError>
where
    T::Err: std::fmt::Display,
{
    match std::env::var(name) {
        Ok(value) => value
            .parse()
            .map_err(|error| format!("{name}={value:?}: {error}").into()),
        Err(_) => Ok(default),
    }
}

/// `publish ID AMOUNT [MESSAGE_ID]`: one message, persistent, confirmed by the broker.
async fn publish(channel: &Channel, queue: &str, args: &[String]) -> Result<(), BoxError> {
    let [id, amount, rest @ ..] = args else {
        return Err("usage: rabbitmq_consumer publish ID AMOUNT [MESSAGE_ID]".into());
    };
    let amount: i64 = amount
        .parse()
        .map_err(|error| format!("AMOUNT {amount:?}: {error}"))?;
    let body = serde_json::to_vec(&serde_json::json!({ "id": id, "amount": amount }))?;
    let mut properties = BasicProperties::default()
        .with_content_type("application/json".into())
        .with_delivery_mode(2);
    if let Some(message_id) = rest.first() {
        properties = properties.with_message_id(message_id.as_str().into());
    }
    let confirm = channel
        .basic_publish(
            "".into(),
            queue.into(),
            BasicPublishOptions::default(),
            &body,
            properties,
        )
        .await?
        .await?;
    if !confirm.is_ack() {
        return Err("the broker refused the message".into());
    }
    println!("published {}", String::from_utf8_lossy(&body));
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    // Listening from the start: a SIGTERM before the first message is not lost either.
    let mut terminate = signal(SignalKind::terminate())?;
    let mut interrupt = signal(SignalKind::interrupt())?;
    let (stop, mut stopping) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        tokio::select! {
            _ = terminate.recv() => {}
            _ = interrupt.recv() => {}
        }
        let _ = stop.send(true);
    });
    let amqp_url = std::env::var("AMQP_URL").map_err(|_| "set AMQP_URL to the broker (amqp://…)")?;
    let settings = Settings {
        queue: setting("QUEUE", "payments".to_owned())?,
        consumer: setting("CONSUMER", tower_idempotency::default_consumer_name())?,
        work: Duration::from_millis(setting("WORK_MS", 0)?),
        lease: Duration::from_millis(setting("LEASE_MS", 30_000)?),
        max_deliveries: setting("MAX_DELIVERIES", 5)?,
        pause_after_effect: Duration::from_millis(setting("PAUSE_AFTER_EFFECT_MS", 0)?),
    };
    let dead_queue = format!("{}.dead", settings.queue);

    let connection = Connection::connect(&amqp_url, ConnectionProperties::default()).await?;
    let channel = connection.create_channel().await?;
    // Every publish (dead letters, `publish`) is confirmed by the broker before it counts.
    channel.confirm_select(ConfirmSelectOptions::default()).await?;
    declare(&channel, &settings.queue, &dead_queue).await?;
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("publish") {
        return publish(&channel, &settings.queue, &args[1..]).await;
    }

    let (coordinator, ledger) = match std::env::var("DATABASE_URL") {
        Err(_) => {
            let url = std::env::var("REDIS_URL").map_err(|_| "set REDIS_URL (or DATABASE_URL)")?;
            // The ledger's client, reconnecting as the store does: an outage of the Redis the
            // records and the ledger share is ridden out in hand (see `handle`), not failed.
            let redis = Builder::from_config(Config::from_url(&url)?)
                .with_connection_config(|c| c.connection_timeout = Duration::from_secs(2))
                .with_performance_config(|p| p.default_command_timeout = Duration::from_secs(5))
                .set_policy(ReconnectPolicy::new_exponential(0, 10, 1000, 2))
                .build()?;
            redis.init().await?;
            (
                Coordinator::new(RedisStore::connect(&url).await?),
                Ledger::Redis(redis),
            )
        }
        #[cfg(feature = "postgres")]
        Ok(url) => {
            let store = tower_idempotency::PostgresStore::connect(&url).await?;
            store.migrate().await?;
            create_ledger(&store).await?;
            (Coordinator::new(store.clone()), Ledger::Postgres(store))
        }
        #[cfg(not(feature = "postgres"))]
        Ok(_) => return Err("DATABASE_URL needs the example built with --features postgres".into()),
    };
    let consumer = Consumer {
        stopping: stopping.clone(),
        coordinator: coordinator.with_lease(settings.lease),
        ledger_key: format!("{}:ledger", settings.queue),
        dead_queue,
        channel,
        ledger,
        settings,
    };

    consumer.channel.basic_qos(1, BasicQosOptions::default()).await?;
    let mut deliveries = consumer
        .channel
        .basic_consume(
            consumer.settings.queue.as_str().into(),
            consumer.settings.consumer.as_str().into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    tracing::info!(
        consumer = consumer.settings.consumer,
        queue = consumer.settings.queue,
        store = if matches!(consumer.ledger, Ledger::Redis(_)) {
            "Redis"
        } else {
            "PostgreSQL"
        },
        "consuming"
    );
    loop {
        // `biased`: a signal that came while a message was handled wins over the next message,
        // which goes back to the queue when the channel closes.
        let delivery = tokio::select! {
            biased;
            _ = stopping.wait_for(|stop| *stop) => break,
            delivery = deliveries.next() => delivery,
        };
        match delivery {
            Some(Ok(delivery)) => consumer.handle(delivery).await,
            Some(Err(error)) => return Err(format!("the channel failed: {error}").into()),
            None => return Err("the broker cancelled the consumer".into()),
        }
    }
    let _ = consumer.channel.close(200, "shutting down".into()).await;
    let _ = connection.close(200, "shutting down".into()).await;
    tracing::info!("stopped");
    Ok(())
}

/// `ledger (id text, amount bigint)`, if missing. No unique constraint on `id`: the record's
/// transaction is what keeps it to one row per id, and the tests count the rows to check that.
#[cfg(feature = "postgres")]
async fn create_ledger(store: &tower_idempotency::PostgresStore) -> Result<(), BoxError> {
    // Consumers starting together race to create it; the advisory lock orders them.
    sqlx::raw_sql(
        "SELECT pg_advisory_xact_lock(24); CREATE TABLE IF NOT EXISTS ledger (id text NOT NULL, amount bigint NOT NULL)",
    )
    .execute(store.pool())
    .await?;
    Ok(())
}
