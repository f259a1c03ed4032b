//! Run with: REDIS_URL=redis://127.0.0.1:6379 cargo run --example stream_consumer
//!
//! A consumer in a Redis Streams consumer group that applies each message's effect once, however
//! often the message is delivered and wherever a consumer dies. Run several at once; `kill -9`
//! any of them: a message it held is taken over by another after the lease and processed then.
//!
//! ```text
//! redis-cli XADD payments '*' id pay-1 amount 40
//! redis-cli XADD payments '*' id pay-1 amount 40     # a duplicate: acknowledged, not applied
//! redis-cli HGETALL payments:ledger                  # pay-1 -> 1
//! ```
//!
//! With the PostgreSQL store (the effect and the record commit in one transaction):
//! `DATABASE_URL=postgres://… REDIS_URL=redis://… cargo run --example stream_consumer --features postgres`.
//!
//! # Contract
//!
//! Environment:
//! - `REDIS_URL`: the stream's Redis, and the store's unless `DATABASE_URL` is set;
//! - `STREAM` (default `payments`), `GROUP` (default `workers`, created with `MKSTREAM`, reading
//!   from the stream's start, if missing), `CONSUMER` (default host name and pid);
//! - `WORK_MS`: simulated work before the effect (default 0);
//! - `LEASE_MS`: the claim's lease, which is also how long a message stays pending on a consumer
//!   before another takes it over (`XAUTOCLAIM`); default 30000;
//! - `MAX_DELIVERIES`: a message delivered more times than this is dead-lettered without being
//!   run (default 5): a message that fails every time, or kills its consumer. A message left
//!   pending (its key in flight elsewhere, a failure) is delivered again after `LEASE_MS`, so
//!   this bounds its retries to about `MAX_DELIVERIES` leases. A takeover counts as a delivery
//!   even when the consumer it came from is alive and still working, so keep
//!   `MAX_DELIVERIES` × `LEASE_MS` above the longest work. A store outage costs no delivery:
//!   the message is held and tried again in hand (kept from takeovers by `XCLAIM … JUSTID`)
//!   until the store answers;
//! - `DATABASE_URL` (built with `--features postgres`): the store is PostgreSQL;
//! - `PAUSE_AFTER_EFFECT_MS`: a pause right after the effect, before its record is completed
//!   (before the commit, with PostgreSQL), to `kill -9` the consumer there and watch what a
//!   redelivery does (default 0; the tests set it).
//!
//! Each message has the fields `id` (the idempotency key) and `amount` (an integer); the record's
//! fingerprint covers both, so the same `id` with another `amount` is dead-lettered. The effect:
//! `HINCRBY <STREAM>:ledger <id> 1` on the stream's Redis; with `DATABASE_URL`, one row in the
//! table `ledger (id text, amount bigint)` (created if missing), inserted in the transaction
//! that completes the record.
//!
//! What happens to a message, from what [`Coordinator::once`] answered:
//!
//! | answer                                       | log line        | the message                 |
//! |----------------------------------------------|-----------------|-----------------------------|
//! | ran (also ran but not stored)                | `ran`           | `XACK`                      |
//! | replayed (a duplicate)                       | `replayed`      | `XACK`                      |
//! | in flight on another consumer                | `in-flight`     | left pending                |
//! | the operation failed                         | `failed`        | left pending                |
//! | store unavailable                            | (a warning)     | held, tried again after 0.5, 1, 2, 4, 5, 5… s until the store answers; on `SIGTERM`, `unavailable` and left pending |
//! | mismatch, unreadable record; a bad `id` or `amount`, too many deliveries (not run) | `dead-lettered` | dead-lettered |
//!
//! A message left pending is taken over (`XAUTOCLAIM`) by whichever consumer finds it idle for
//! `LEASE_MS`, and that consumer waits up to a lease for the claim it finds (`.wait(lease)`): a
//! dead consumer's message runs as soon as its claim's lease ends, at most about a lease after
//! the kill. Dead-lettering adds the message to `<STREAM>:dead` with its own fields plus
//! `reason` and `entry` (its entry id) and acknowledges it, in one `MULTI`.
//!
//! It logs one line per message on stdout, `<outcome> msg=<entry id> id="<id>" …`, written
//! before the `XACK` or the dead-lettering. On `SIGTERM` (or Ctrl-C) it finishes the message in
//! hand and exits 0. With `RUST_LOG=stream_consumer=debug` it also logs on stderr when it takes
//! a message (`received`), once it holds the message's key and runs it (`running`), right
//! before the effect (`effect`) and, on the Redis store, how long
//! after the effect's reply the record's completion landed (`completed … window_us=`): a crash
//! inside that window applies the effect again on redelivery, the limit of a store apart from
//! the business data (`scripts/stream-window.sh` measures it).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use fred::prelude::*;
use fred::types::streams::{XReadResponse, XReadValue};
use tower_idempotency::{Coordinator, Disposition, Fingerprint, IdempotencyKey, Once, RecordKey, RedisStore};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The first pause before a message held while the store is unavailable is tried again; the
/// pause doubles up to `MAX_RETRY_PAUSE`.
const RETRY_PAUSE: Duration = Duration::from_millis(500);
const MAX_RETRY_PAUSE: Duration = Duration::from_secs(5);

struct Settings {
    stream: String,
    group: String,
    consumer: String,
    work: Duration,
    lease: Duration,
    max_deliveries: u64,
    pause_after_effect: Duration,
}

/// Where the effect goes, and so which store keeps the records.
enum Ledger {
    /// `HINCRBY <STREAM>:ledger <id> 1`; records in the stream's Redis.
    Redis,
    /// A row in `ledger`, in the transaction that completes the record.
    #[cfg(feature = "postgres")]
    Postgres(tower_idempotency::PostgresStore),
}

/// A message in hand.
struct Entry {
    /// The stream entry id.
    entry: String,
    fields: HashMap<String, Value>,
    /// How many times the group delivered it, this time included.
    deliveries: u64,
    /// Taken over from another consumer (`XAUTOCLAIM`), not read new.
    takeover: bool,
}

struct Consumer {
    /// Set on SIGTERM or Ctrl-C.
    stop: Arc<AtomicBool>,
    redis: Client,
    coordinator: Coordinator,
    ledger: Ledger,
    settings: Settings,
    ledger_key: String,
    dead_key: String,
}

impl Consumer {
    /// The next message: one pending on another consumer longer than the lease first, else a
    /// new one (waiting up to 200 ms, so a SIGTERM is noticed soon).
    async fn next(&self, cursor: &mut String) -> Result<Option<Entry>, Error> {
        let s = &self.settings;
        let (next, claimed): (String, Vec<XReadValue<String, String, Value>>) = self
            .redis
            .xautoclaim_values(
                &s.stream,
                &s.group,
                &s.consumer,
                s.lease.as_millis() as u64,
                cursor.as_str(),
                Some(1),
                false,
            )
            .await?;
        *cursor = next;
        if let Some((entry, fields)) = claimed.into_iter().next() {
            let deliveries = self.deliveries(&entry).await?;
            return Ok(Some(Entry {
                entry,
                fields,
                deliveries,
                takeover: true,
            }));
        }
        let read: Value = self
            .redis
            .xreadgroup(&s.group, &s.consumer, Some(1), Some(200), false, &s.stream, ">")
            .await?;
        if read.is_null() {
            return Ok(None); // nothing new within 200 ms
        }
        let read: XReadResponse<String, String, String, Value> = read.into_xread_response()?;
        Ok(read.into_values().flatten().next().map(|(entry, fields)| Entry {
            entry,
            fields,
            deliveries: 1,
            takeover: false,
        }))
    }

    /// The group's delivery count of `entry` (`XPENDING`), which `XAUTOCLAIM` has just raised.
    async fn deliveries(&self, entry: &str) -> Result<u64, Error> {
        let s = &self.settings;
        let pending: Vec<(String, String, u64, u64)> = self
            .redis
            .xpending(&s.stream, &s.group, (entry, entry, 1))
            .await?;
        Ok(pending.first().map_or(1, |(_, _, _, count)| *count))
    }

    async fn handle(&self, message: Entry) {
        let entry = message.entry.as_str();
        let field = |name: &str| message.fields.get(name).and_then(Value::as_string);
        let id = field("id").unwrap_or_default();
        tracing::debug!(msg = %entry, id = ?id, deliveries = message.deliveries, takeover = message.takeover, "received");
        if message.deliveries > self.settings.max_deliveries {
            let reason = format!(
                "delivered {} times, more than MAX_DELIVERIES ({})",
                message.deliveries, self.settings.max_deliveries
            );
            return self.dead_letter(&message, &id, &reason).await;
        }
        let key = match IdempotencyKey::parse(&id) {
            Ok(key) => RecordKey::new(None, key),
            Err(error) => return self.dead_letter(&message, &id, &format!("bad id: {error}")).await,
        };
        let amount_text = field("amount").unwrap_or_default();
        let Ok(amount) = amount_text.parse::<i64>() else {
            let reason = format!("bad amount: {amount_text:?} is not an integer");
            return self.dead_letter(&message, &id, &reason).await;
        };
        // The fields that define the message: the same id with another amount is not a duplicate.
        let fingerprint = Fingerprint::new([id.as_bytes(), amount_text.as_bytes()]);
        // A message taken over from a consumer that may have died: wait for its claim's lease
        // rather than leave the message for another lease.
        let wait = if message.takeover {
            self.settings.lease
        } else {
            Duration::ZERO
        };
        let started = Instant::now();
        // While the store does not answer, nothing can run: hold the message and try again,
        // with a growing pause, rather than leave it pending, where each takeover counts
        // towards MAX_DELIVERIES and an outage would dead-letter every message it meets.
        let mut pause = RETRY_PAUSE.min(self.settings.lease / 3);
        let mut held = false;
        let answer = loop {
            let answer = match &self.ledger {
                Ledger::Redis => self.count_in_redis(entry, &key, &fingerprint, wait).await,
                #[cfg(feature = "postgres")]
                Ledger::Postgres(store) => {
                    self.insert_row(store, entry, &key, &fingerprint, amount, wait)
                        .await
                }
            };
            let stopping = self.stop.load(Ordering::SeqCst);
            match &answer {
                Once::Unavailable(error) if answer.disposition() != Disposition::DeadLetter && !stopping => {
                    tracing::warn!(msg = %entry, id = ?id, %error, ?pause, "the store is unavailable; holding the message and trying again");
                    held = true;
                }
                // A claim of ours that timed out may have landed once the store came back: its
                // key is in flight until it is released in the background or its lease ends.
                Once::InFlight { .. } if held && !stopping => {
                    tracing::debug!(msg = %entry, id = ?id, "in flight after the outage; holding the message");
                }
                _ => break answer,
            }
            // The entry's idle time is reset before and after each pause, so that no other
            // consumer takes it over while it is held (a pause stays under a third of a lease).
            self.keep(entry).await;
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(MAX_RETRY_PAUSE).min(self.settings.lease / 3);
            self.keep(entry).await;
        };
        let took_ms = started.elapsed().as_millis();
        let what = format!("msg={entry} id={id:?}");
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
                "in-flight {what} retry_after_ms={} (left pending)",
                retry_after.as_millis()
            ),
            Once::Failed(error) => println!("failed {what} error={:?} (left pending)", error.to_string()),
            Once::Unavailable(error) if disposition != Disposition::DeadLetter => {
                println!("unavailable {what} error={:?} (left pending)", error.to_string())
            }
            Once::Unavailable(_) | Once::Mismatch => {} // logged as dead-lettered, with the reason
        }
        match disposition {
            Disposition::Ack => self.ack(entry).await,
            // A stream has no delayed redelivery: left pending, the message goes to whichever
            // consumer finds it idle for a lease (XAUTOCLAIM), which is when the claim that
            // made it wait has ended at the latest.
            Disposition::Retry { .. } => {}
            Disposition::DeadLetter => {
                let reason = match &answer {
                    Once::Unavailable(error) => format!("unreadable record: {error}"),
                    _ => "mismatch: this id came before with another amount".to_owned(),
                };
                self.dead_letter(&message, &id, &reason).await
            }
        }
    }

    /// The effect on the Redis store: a counter in the stream's Redis, beside the records but
    /// not in their transaction.
    async fn count_in_redis(
        &self,
        entry: &str,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        wait: Duration,
    ) -> Once<Bytes, BoxError> {
        let id = key.key().as_str();
        let applied = Mutex::new(None);
        let answer = self
            .coordinator
            .once(key, fingerprint, || async {
                tracing::debug!(msg = %entry, id = ?id, "running");
                tokio::time::sleep(self.settings.work).await;
                tracing::debug!(msg = %entry, id = ?id, "effect");
                let count: i64 = self.redis.hincrby(&self.ledger_key, id, 1).await?;
                *applied.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(Instant::now());
                tokio::time::sleep(self.settings.pause_after_effect).await;
                Ok::<_, BoxError>(Bytes::from(format!("{id} counted ({count})")))
            })
            .wait(wait)
            .await;
        if let (Once::Ran(_), Some(applied)) = (&answer, *applied.lock().unwrap_or_else(|p| p.into_inner())) {
            // From the effect's reply to the completion's: a crash in between applies the
            // effect again on redelivery.
            let window_us = applied.elapsed().as_micros();
            tracing::debug!(msg = %entry, id = ?id, window_us, "completed");
        }
        answer
    }

    /// The effect on the PostgreSQL store: a row, committed with the record's completion.
    #[cfg(feature = "postgres")]
    async fn insert_row(
        &self,
        store: &tower_idempotency::PostgresStore,
        entry: &str,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        amount: i64,
        wait: Duration,
    ) -> Once<Bytes, BoxError> {
        let id = key.key().as_str();
        self.coordinator
            .once_with_ticket(key, fingerprint, |ticket| async move {
                tracing::debug!(msg = %entry, id = ?id, "running");
                tokio::time::sleep(self.settings.work).await;
                tracing::debug!(msg = %entry, id = ?id, "effect");
                let mut transaction = store.pool().begin().await?;
                sqlx::query("INSERT INTO ledger (id, amount) VALUES ($1, $2)")
                    .bind(id)
                    .bind(amount)
                    .execute(&mut *transaction)
                    .await?;
                tokio::time::sleep(self.settings.pause_after_effect).await;
                let receipt = Bytes::from(format!("{id} recorded"));
                if !store
                    .complete_in(&mut transaction, &ticket, receipt.clone())
                    .await?
                {
                    // The lease ran out under us: another consumer may run it. Dropping the
                    // transaction rolls the row back.
                    return Err::<Bytes, BoxError>("the claim was lost before the commit".into());
                }
                transaction.commit().await?;
                Ok(receipt)
            })
            .wait(wait)
            .await
    }

    /// Keeps `entry` on this consumer while it is held: `XCLAIM … JUSTID` to itself resets the
    /// entry's idle time without counting a delivery, so no other consumer takes it over
    /// meanwhile. If the stream's Redis is down too, nobody can take it over anyway.
    async fn keep(&self, entry: &str) {
        let s = &self.settings;
        let kept: Result<Value, Error> = (self.redis)
            .xclaim(
                &s.stream,
                &s.group,
                &s.consumer,
                0,
                entry,
                None,
                None,
                None,
                false,
                true,
            )
            .await;
        if let Err(error) = kept {
            tracing::debug!(msg = %entry, %error, "could not keep the held message (XCLAIM)");
        }
    }

    async fn ack(&self, entry: &str) {
        let s = &self.settings;
        if let Err(error) = self.redis.xack::<i64, _, _, _>(&s.stream, &s.group, entry).await {
            // Left pending: another consumer takes it over and gets the stored result.
            tracing::warn!(msg = %entry, %error, "XACK failed; the message will be delivered again");
        }
    }

    /// Moves the message to `<STREAM>:dead` with its fields, the reason and its entry id, and
    /// acknowledges it, in one transaction: a crash leaves it either pending or dead-lettered,
    /// never both.
    async fn dead_letter(&self, message: &Entry, id: &str, reason: &str) {
        let s = &self.settings;
        println!("dead-lettered msg={} id={id:?} reason={reason:?}", message.entry);
        let mut fields: Vec<(String, Value)> = (message.fields.iter())
            .map(|(name, value)| (name.clone(), value.clone()))
            .collect();
        fields.push(("reason".into(), reason.into()));
        fields.push(("entry".into(), message.entry.as_str().into()));
        let transaction = self.redis.multi();
        let queued = async {
            let () = transaction.xadd(&self.dead_key, false, None, "*", fields).await?;
            let () = transaction
                .xack(&s.stream, &s.group, message.entry.as_str())
                .await?;
            transaction.exec::<Value>(true).await
        };
        if let Err(error) = queued.await {
            tracing::warn!(msg = %message.entry, %error, "could not dead-letter; the message will be delivered again");
        }
    }
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

fn default_consumer() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|host| host.trim().to_owned())
        .filter(|host| !host.is_empty())
        .unwrap_or_else(|| "consumer".into());
    format!("{host}-{}", std::process::id())
}

/// Set once SIGTERM or Ctrl-C arrives: the loop finishes the message in hand, then stops.
fn stop_on_signal() -> Result<Arc<AtomicBool>, BoxError> {
    let stop = Arc::new(AtomicBool::new(false));
    #[cfg(unix)]
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let flag = stop.clone();
    tokio::spawn(async move {
        #[cfg(unix)]
        tokio::select! {
            _ = terminate.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
        #[cfg(not(unix))]
        let _ = tokio::signal::ctrl_c().await;
        flag.store(true, Ordering::SeqCst);
    });
    Ok(stop)
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
    let stop = stop_on_signal()?;
    let redis_url = std::env::var("REDIS_URL").map_err(|_| "set REDIS_URL to the stream's Redis")?;
    let settings = Settings {
        stream: setting("STREAM", "payments".to_owned())?,
        group: setting("GROUP", "workers".to_owned())?,
        consumer: setting("CONSUMER", default_consumer())?,
        work: Duration::from_millis(setting("WORK_MS", 0)?),
        lease: Duration::from_millis(setting("LEASE_MS", 30_000)?),
        max_deliveries: setting("MAX_DELIVERIES", 5)?,
        pause_after_effect: Duration::from_millis(setting("PAUSE_AFTER_EFFECT_MS", 0)?),
    };

    // The stream's own client: XREADGROUP blocks 200 ms at most, so 5 s is a dead connection.
    let redis = Builder::from_config(Config::from_url(&redis_url)?)
        .with_connection_config(|c| c.connection_timeout = Duration::from_secs(2))
        .with_performance_config(|p| p.default_command_timeout = Duration::from_secs(5))
        .set_policy(ReconnectPolicy::new_exponential(0, 10, 1000, 2))
        .build()?;
    redis.init().await?;
    match redis
        .xgroup_create::<Value, _, _, _>(&settings.stream, &settings.group, "0", true)
        .await
    {
        Err(error) if !error.details().starts_with("BUSYGROUP") => return Err(error.into()),
        _ => {}
    }

    let (coordinator, ledger) = match std::env::var("DATABASE_URL") {
        Err(_) => (
            Coordinator::new(RedisStore::connect(&redis_url).await?),
            Ledger::Redis,
        ),
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
        stop: stop.clone(),
        coordinator: coordinator.with_lease(settings.lease),
        ledger_key: format!("{}:ledger", settings.stream),
        dead_key: format!("{}:dead", settings.stream),
        redis,
        ledger,
        settings,
    };
    tracing::info!(
        consumer = consumer.settings.consumer,
        group = consumer.settings.group,
        stream = consumer.settings.stream,
        store = if matches!(consumer.ledger, Ledger::Redis) {
            "Redis"
        } else {
            "PostgreSQL"
        },
        "consuming"
    );

    let mut cursor = "0-0".to_owned();
    while !stop.load(Ordering::SeqCst) {
        match consumer.next(&mut cursor).await {
            Ok(Some(message)) => consumer.handle(message).await,
            Ok(None) => {}
            Err(error) => {
                tracing::warn!(%error, "reading the stream failed; trying again");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
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
