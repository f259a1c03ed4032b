//! Run with: REDIS_URL=redis://127.0.0.1:6379 cargo run --example stream_consumer --features streams
//!
//! A Redis Streams consumer (`StreamConsumer`) that applies each message's effect once, however
//! often it is delivered and wherever a consumer dies: `kill -9` any of several, and another
//! takes its message over after the lease. Environment: `REDIS_URL`; `STREAM` (`payments`),
//! `GROUP` (`workers`), `CONSUMER` (host-pid); `LEASE_MS` (30000: the claim's lease, and how long
//! a silent consumer's message waits before a takeover); `MAX_DELIVERIES` (5); `WORK_MS` (0:
//! work before the effect); `PAUSE_AFTER_EFFECT_MS` (0: a pause between the effect and its
//! record, for crash tests); `DATABASE_URL` (with `--features postgres`: the store is
//! PostgreSQL, and the effect commits in the record's transaction).
//!
//! A message has the fields `id` (the key) and `amount` (an integer, checked before the key is
//! claimed; the fingerprint). The effect is `HINCRBY <STREAM>:ledger <id> 1`, or a row in
//! `ledger (id, amount)`. One line per message on stdout: `ran msg=<entry> id="<id>"
//! amount=<n> took_ms=<ms>` (`not_stored="…"` after it if the result was not stored),
//! `replayed … took_ms=<ms>`, `in-flight … retry_after_ms=<ms> (left pending)`, `failed …
//! error="…" (left pending)`, `unavailable … error="…" (left pending)`, `dead-lettered …
//! reason="…"` (`bad id: …`, `bad amount: …`, `mismatch: this id came before with another
//! amount`, `unreadable record: …`, `delivered N times, …`); `tests/stream_consumer.rs` holds
//! them to these shapes. With `RUST_LOG=stream_consumer=debug`, `received`, `running`, `effect`
//! and (Redis store) `completed … window_us=` on stderr; the consumer's warnings (a message held
//! through a store outage, a failed read) are the crate's, `RUST_LOG=stream_consumer=debug,warn`
//! keeps them. SIGTERM or Ctrl-C: the message in hand finishes, exit 0; a bad setting or a
//! stream that cannot be consumed: exit 1. The guide (docs/queue-consumers.md) has what each
//! outcome does to the message. `stream_consumer publish ID AMOUNT` publishes one message
//! (`PRODUCER`, default `publisher`), once on Redis 8.6 however often it is retried, and prints
//! `published msg=<entry> id="<id>" deduplicated=<bool>`.

use std::time::Duration;

use tower_idempotency::bytes::Bytes;
use tower_idempotency::fred::prelude::*;
use tower_idempotency::{
    ClaimTicket, Coordinator, Failure, RedisStore, StreamConsumer, StreamEvent, StreamMessage, StreamOutcome,
    StreamPublisher,
};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

fn setting<T: std::str::FromStr<Err: std::fmt::Display>>(name: &str, default: T) -> Result<T, BoxError> {
    let parse = |v: String| v.parse().map_err(|e| format!("{name}={v:?}: {e}").into());
    std::env::var(name).map_or(Ok(default), parse)
}

fn amount(message: &StreamMessage) -> Result<i64, String> {
    let amount = message.field("amount").unwrap_or_default();
    amount
        .parse()
        .map_err(|_| format!("bad amount: {amount:?} is not an integer"))
}

/// The outcome line on stdout (`ran` with its amount), the rest at debug level on stderr.
fn log(event: &StreamEvent<'_>, redis_store: bool) {
    let (message, not_stored, stored_in, took) = match event {
        StreamEvent::Handled {
            message,
            outcome:
                StreamOutcome::Ran {
                    not_stored,
                    stored_in,
                    ..
                },
            took,
        } => (message, not_stored, stored_in, took),
        StreamEvent::Handled { .. } => return println!("{event}"),
        _ => return tracing::debug!("{event}"), // received
    };
    let (entry, id, amount) = (message.entry(), message.id().unwrap_or_default(), amount(message));
    let why = not_stored
        .as_ref()
        .map(|e| format!(" not_stored={:?}", e.to_string()));
    let (amount, took_ms, why) = (
        amount.unwrap_or_default(),
        took.as_millis(),
        why.unwrap_or_default(),
    );
    println!("ran msg={entry} id={id:?} amount={amount} took_ms={took_ms}{why}");
    if redis_store && not_stored.is_none() {
        // From the effect's reply to its record's: a crash in between applies it again.
        tracing::debug!(
            "completed msg={entry} id={id:?} window_us={}",
            stored_in.as_micros()
        );
    }
}

/// The effect: a counter in the stream's Redis, or (`postgres`) a row committed with the record.
async fn apply(message: StreamMessage, ticket: ClaimTicket, ledger: &Ledger) -> Result<Bytes, Failure> {
    let (entry, id) = (message.entry(), ticket.key().key().as_str());
    tracing::debug!(msg = %entry, id = ?id, "running");
    tokio::time::sleep(ledger.work).await;
    tracing::debug!(msg = %entry, id = ?id, "effect");
    let pause = ledger.pause_after_effect;
    #[cfg(feature = "postgres")]
    if let Some(store) = &ledger.postgres {
        let mut transaction = store.pool().begin().await?;
        let insert = tower_idempotency::sqlx::query("INSERT INTO ledger (id, amount) VALUES ($1, $2)");
        insert
            .bind(id)
            .bind(amount(&message).map_err(Failure::dead_letter)?)
            .execute(&mut *transaction)
            .await?;
        tokio::time::sleep(pause).await;
        let receipt = Bytes::from(format!("{id} recorded"));
        if !store
            .complete_in(&mut transaction, &ticket, receipt.clone())
            .await?
        {
            // Lost under us (its lease ran out): dropping the transaction rolls the row back.
            return Err(Failure::retry("the claim was lost before the commit"));
        }
        transaction.commit().await?;
        return Ok(receipt);
    }
    let count: i64 = ledger.redis.hincrby(&ledger.key, id, 1).await?;
    tokio::time::sleep(pause).await;
    Ok(format!("{id} counted ({count})").into())
}

struct Ledger {
    redis: Client,
    key: String,
    work: Duration,
    pause_after_effect: Duration,
    postgres: Option<Postgres>,
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into());
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .with_env_filter(filter)
        .init();
    let url = std::env::var("REDIS_URL").map_err(|_| "set REDIS_URL to the stream's Redis")?;
    let (stream, group) = (
        setting("STREAM", "payments".to_owned())?,
        setting("GROUP", "workers".to_owned())?,
    );
    let lease = Duration::from_millis(setting("LEASE_MS", 30_000)?);
    let shutdown = shutdown_signal()?;
    // XREADGROUP blocks 200 ms at most, so 5 s without an answer is a dead connection.
    let redis = Builder::from_config(Config::from_url(&url)?)
        .with_connection_config(|c| c.connection_timeout = Duration::from_secs(2))
        .with_performance_config(|p| p.default_command_timeout = Duration::from_secs(5))
        .set_policy(ReconnectPolicy::new_exponential(0, 10, 1000, 2))
        .build()?;
    redis.init().await?;
    if let [_, verb, id, amount] = &std::env::args().collect::<Vec<_>>()[..] {
        if verb == "publish" {
            let publisher =
                StreamPublisher::new(redis, &stream, setting("PRODUCER", "publisher".to_owned())?);
            let entry = publisher.publish(id, [("id", id), ("amount", amount)]).await?;
            let deduplicated = publisher.deduplicates().await;
            println!("published msg={entry} id={id:?} deduplicated={deduplicated}");
            return Ok(());
        }
    }
    let work = Duration::from_millis(setting("WORK_MS", 0)?);
    let pause_after_effect = Duration::from_millis(setting("PAUSE_AFTER_EFFECT_MS", 0)?);
    let (redis_client, key, postgres) = (redis.clone(), format!("{stream}:ledger"), postgres_store().await?);
    let ledger = Ledger {
        redis: redis_client,
        key,
        work,
        pause_after_effect,
        postgres,
    };
    let (coordinator, store) = match &ledger.postgres {
        #[cfg(feature = "postgres")]
        Some(postgres) => (Coordinator::new(postgres.clone()), "PostgreSQL"),
        _ => (Coordinator::new(RedisStore::connect(&url).await?), "Redis"),
    };
    let mut consumer = StreamConsumer::new(redis, coordinator.with_lease(lease), &stream, &group)
        .with_fingerprint_fields(["amount"])
        .with_validation(|message| amount(message).map(drop))
        .with_max_deliveries(setting("MAX_DELIVERIES", 5)?)
        .with_observer(move |event| log(event, store == "Redis"));
    if let Ok(name) = std::env::var("CONSUMER") {
        consumer = consumer.with_consumer_name(name);
    }
    consumer.prepare().await?;
    tracing::info!(
        consumer = consumer.consumer_name(),
        group,
        stream,
        store,
        "consuming"
    );
    consumer
        .run(shutdown, |message, ticket| apply(message, ticket, &ledger))
        .await?;
    tracing::info!("stopped");
    Ok(())
}

/// SIGTERM or Ctrl-C.
fn shutdown_signal() -> Result<impl std::future::Future<Output = ()>, BoxError> {
    #[cfg(unix)]
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    Ok(async move {
        #[cfg(unix)]
        tokio::select! { _ = terminate.recv() => {}, _ = tokio::signal::ctrl_c() => {} }
        #[cfg(not(unix))]
        let _ = tokio::signal::ctrl_c().await;
    })
}

#[cfg(feature = "postgres")]
type Postgres = tower_idempotency::PostgresStore;
#[cfg(not(feature = "postgres"))]
type Postgres = std::convert::Infallible;

/// With `DATABASE_URL`, the PostgreSQL store, migrated, and the table `ledger (id, amount)`.
#[cfg(feature = "postgres")]
async fn postgres_store() -> Result<Option<Postgres>, BoxError> {
    let Ok(url) = std::env::var("DATABASE_URL") else {
        return Ok(None);
    };
    let store = Postgres::connect(&url).await?;
    store.migrate().await?;
    // No unique constraint on `id`: the record's transaction keeps it to one row per id (the
    // tests count them). Consumers starting together race to create it: the lock orders them.
    let ddl = "SELECT pg_advisory_xact_lock(24); CREATE TABLE IF NOT EXISTS ledger (id text NOT NULL, amount bigint NOT NULL)";
    tower_idempotency::sqlx::raw_sql(ddl)
        .execute(store.pool())
        .await?;
    Ok(Some(store))
}

#[cfg(not(feature = "postgres"))]
async fn postgres_store() -> Result<Option<Postgres>, BoxError> {
    match std::env::var("DATABASE_URL") {
        Ok(_) => Err("DATABASE_URL needs the example built with --features postgres".into()),
        Err(_) => Ok(None),
    }
}
