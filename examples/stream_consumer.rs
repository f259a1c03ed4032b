//! Run with: REDIS_URL=redis://127.0.0.1:6379 cargo run --example stream_consumer --features streams
//!
//! A Redis Streams consumer that applies each message's effect once, however often it comes and
//! wherever a consumer dies: `HINCRBY <STREAM>:ledger <id> 1`, or with `DATABASE_URL` (`--features
//! postgres`) a row of `ledger (id, amount)` committed with the record. Stdout, one line per message:
//! `ran msg=<entry> id="<id>" amount=<n> took_ms=<ms>` (`not_stored="…"` after it if not stored),
//! `replayed … took_ms=<ms>`, `in-flight … retry_after_ms=<ms> (left pending)`, `failed`/`unavailable
//! … error="…" (left pending)`, `dead-lettered … reason="…"`. SIGTERM or Ctrl-C: exit 0 once the
//! message in hand is done. `stream_consumer publish ID AMOUNT` publishes one. The settings, stderr's
//! lines, exit codes and reasons: docs/queue-consumers.md, "Two real consumers".

use std::time::Duration;

use tower_idempotency::fred::prelude::*;
use tower_idempotency::{default_consumer_name, shutdown_signal, BoxError, ClaimTicket, Coordinator};
#[cfg(feature = "postgres")]
use tower_idempotency::{sqlx, Failure, PostgresStore};
use tower_idempotency::{RedisStore, StreamConsumer, StreamEvent, StreamMessage, StreamOutcome};
use tracing::debug;

fn setting<T: std::str::FromStr<Err: std::fmt::Display>>(name: &str, default: &str) -> Result<T, BoxError> {
    let value = std::env::var(name).unwrap_or_else(|_| default.to_owned());
    value.parse().map_err(|e| format!("{name}={value:?}: {e}").into())
}

fn amount(message: &StreamMessage) -> Result<i64, String> {
    let amount = message.field("amount").unwrap_or_default();
    let bad = |_| format!("bad amount: {amount:?} is not an integer");
    amount.parse().map_err(bad)
}

/// The outcome line on stdout (`ran` with its amount), the rest at debug level on stderr.
fn log(event: &StreamEvent<'_>, redis_store: bool) {
    let StreamEvent::Handled { message, outcome, .. } = event else {
        return debug!("{event}"); // received
    };
    let StreamOutcome::Ran { stored_in, .. } = outcome else {
        return println!("{event}");
    };
    println!("{}", event.with_fields(&["amount"]));
    if redis_store && matches!(outcome, StreamOutcome::Ran { not_stored: None, .. }) {
        // From the effect's reply to its record's: a crash in between applies it again.
        let (entry, id) = (message.entry(), message.id().unwrap_or_default());
        let us = stored_in.as_micros();
        debug!("completed msg={entry} id={id:?} window_us={us}");
    }
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into());
    let stderr = tracing_subscriber::fmt().with_writer(std::io::stderr);
    stderr.with_ansi(false).with_env_filter(filter).init();
    let url = std::env::var("REDIS_URL").map_err(|_| "set REDIS_URL to the stream's Redis")?;
    let (stream, group): (String, String) = (setting("STREAM", "payments")?, setting("GROUP", "workers")?);
    let lease = Duration::from_millis(setting("LEASE_MS", "30000")?);
    let (shutdown, redis) = (shutdown_signal()?, StreamConsumer::connect_redis(&url).await?);
    if let [_, verb, id, amount] = &std::env::args().collect::<Vec<_>>()[..] {
        if verb == "publish" {
            let producer = setting::<String>("PRODUCER", "publisher")?;
            let publisher = tower_idempotency::StreamPublisher::new(redis, &stream, producer);
            let entry = publisher.publish(id, [("id", id), ("amount", amount)]).await?;
            let deduplicated = publisher.deduplicates().await;
            println!("published msg={entry} id={id:?} deduplicated={deduplicated}");
            return Ok(());
        }
    }
    let work = Duration::from_millis(setting("WORK_MS", "0")?);
    let pause = Duration::from_millis(setting("PAUSE_AFTER_EFFECT_MS", "0")?);
    let postgres = postgres_store().await?;
    let (store, coordinator) = match &postgres {
        #[cfg(feature = "postgres")]
        Some(postgres) => ("PostgreSQL", Coordinator::new(postgres.clone())),
        _ => ("Redis", Coordinator::new(RedisStore::connect(&url).await?)),
    };
    let consumer = StreamConsumer::new(redis.clone(), coordinator.with_lease(lease), &stream, &group)
        .with_consumer_name(setting::<String>("CONSUMER", &default_consumer_name())?)
        .with_fingerprint_fields(["amount"])
        .with_validation(|message| amount(message).map(drop))
        .with_max_deliveries(setting("MAX_DELIVERIES", "5")?)
        .with_observer(move |event| log(event, store == "Redis"));
    consumer.prepare().await?;
    let name = consumer.consumer_name();
    tracing::info!(consumer = name, group, stream, store, "consuming");
    let (redis, ledger) = (&redis, &format!("{stream}:ledger"));
    #[cfg(feature = "postgres")]
    let postgres = postgres.as_ref();
    let effect = |message: StreamMessage, ticket: ClaimTicket| async move {
        let (entry, id) = (message.entry(), ticket.key().key().as_str());
        debug!(msg = %entry, id = ?id, "running");
        tokio::time::sleep(work).await;
        debug!(msg = %entry, id = ?id, "effect");
        #[cfg(feature = "postgres")]
        if let Some(store) = postgres {
            // The row commits with the record, or neither does (a lost claim rolls it back).
            let mut transaction = store.transaction_for(&ticket).await?;
            let insert = sqlx::query("INSERT INTO ledger (id, amount) VALUES ($1, $2)");
            let amount = amount(&message).map_err(Failure::dead_letter)?;
            insert.bind(id).bind(amount).execute(&mut *transaction).await?;
            tokio::time::sleep(pause).await;
            return Ok(transaction.commit(format!("{id} recorded").into()).await?);
        }
        let count: i64 = redis.hincrby(ledger, id, 1).await?;
        tokio::time::sleep(pause).await;
        Ok(format!("{id} counted ({count})").into())
    };
    consumer.run(shutdown, effect).await?;
    tracing::info!("stopped");
    Ok(())
}

/// With `DATABASE_URL`, the PostgreSQL store, migrated, and the table `ledger (id, amount)`: no
/// unique `id`, as the record's transaction keeps it to one row per id (the tests count them).
#[cfg(feature = "postgres")]
async fn postgres_store() -> Result<Option<PostgresStore>, BoxError> {
    let Ok(url) = std::env::var("DATABASE_URL") else {
        return Ok(None);
    };
    let store = PostgresStore::connect(&url).await?;
    store.migrate().await?;
    // Consumers starting together race to create it: the lock orders them.
    let ddl = "SELECT pg_advisory_xact_lock(24); CREATE TABLE IF NOT EXISTS ledger (id text NOT NULL, amount bigint NOT NULL)";
    sqlx::raw_sql(ddl).execute(store.pool()).await?;
    Ok(Some(store))
}

#[cfg(not(feature = "postgres"))]
async fn postgres_store() -> Result<Option<std::convert::Infallible>, BoxError> {
    let needs = "DATABASE_URL needs the example built with --features postgres";
    std::env::var("DATABASE_URL").map_or(Ok(None), |_| Err(needs.into()))
}
