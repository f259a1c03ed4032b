//! Run with: REDIS_URL=redis://127.0.0.1:6379 cargo run --example stream_consumer --features streams,postgres
//!
//! A Redis Streams consumer that applies each message's effect once, however often it comes and wherever
//! a consumer dies. Settings, effects, log lines, exit codes: docs/queue-consumers.md, "Two real consumers".

use tower_idempotency::fred::prelude::*;
use tower_idempotency::{default_consumer_name, shutdown_signal, sqlx, BoxError, ClaimTicket, Coordinator};
use tower_idempotency::{RedisStore, StreamConsumer, StreamEvent, StreamOutcome, StreamPublisher};

/// No unique `id`: the record's transaction keeps one row per id (the tests count them); the lock orders
/// consumers racing to create it.
const LEDGER: &str = "SELECT pg_advisory_xact_lock(24); \
    CREATE TABLE IF NOT EXISTS ledger (id text NOT NULL, amount bigint NOT NULL)";

fn setting<T: std::str::FromStr<Err: std::fmt::Display>>(name: &str, default: &str) -> Result<T, BoxError> {
    let value = std::env::var(name).unwrap_or_else(|_| default.to_owned());
    value.parse().map_err(|e| format!("{name}={value:?}: {e}").into())
}

/// The outcome line on stdout (`ran` with its amount), the rest at debug level on stderr.
fn log(event: &StreamEvent<'_>, redis_store: bool) {
    let StreamEvent::Handled { message, outcome, .. } = event else {
        return tracing::debug!("{event}"); // received
    };
    let StreamOutcome::Ran { stored_in, .. } = outcome else {
        return println!("{event}");
    };
    println!("{}", event.with_fields(&["amount"]));
    if redis_store && matches!(outcome, StreamOutcome::Ran { not_stored: None, .. }) {
        // From the effect's reply to its record's: a crash in between applies it again.
        let (entry, id) = (message.entry(), message.id().unwrap_or_default());
        tracing::debug!(msg = %entry, id = ?id, window_us = stored_in.as_micros(), "completed");
    }
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into());
    let stderr = tracing_subscriber::fmt().with_writer(std::io::stderr);
    stderr.with_ansi(false).with_env_filter(filter).init();
    let url = std::env::var("REDIS_URL").map_err(|_| "set REDIS_URL to the stream's Redis")?;
    let (stream, group): (String, String) = (setting("STREAM", "payments")?, setting("GROUP", "workers")?);
    let lease = std::time::Duration::from_millis(setting("LEASE_MS", "30000")?);
    let (shutdown, redis) = (shutdown_signal()?, StreamConsumer::connect_redis(&url).await?);
    let args: Vec<String> = std::env::args().collect();
    if let [_, "publish", id, amount] = args.iter().map(String::as_str).collect::<Vec<_>>()[..] {
        let publisher = StreamPublisher::new(redis, &stream, setting::<String>("PRODUCER", "publisher")?);
        let entry = publisher.publish(id, [("id", id), ("amount", amount)]).await?;
        let deduplicated = publisher.deduplicates().await;
        println!("published msg={entry} id={id:?} deduplicated={deduplicated}");
        return Ok(());
    }
    let (work, pause): (u64, u64) = (setting("WORK_MS", "0")?, setting("PAUSE_AFTER_EFFECT_MS", "0")?);
    let (store, coordinator, postgres) = match std::env::var("DATABASE_URL") {
        Ok(url) => {
            let postgres = tower_idempotency::PostgresStore::connect(&url).await?;
            postgres.migrate().await?;
            sqlx::raw_sql(LEDGER).execute(postgres.pool()).await?;
            ("PostgreSQL", Coordinator::new(postgres.clone()), Some(postgres))
        }
        Err(_) => ("Redis", Coordinator::new(RedisStore::connect(&url).await?), None),
    };
    let consumer = StreamConsumer::new(redis.clone(), coordinator.with_lease(lease), &stream, &group)
        .with_consumer_name(setting::<String>("CONSUMER", &default_consumer_name())?)
        .with_fingerprint_fields(["amount"])
        .with_validation(|message| Ok(message.parse_field::<i64>("amount", "an integer").map(drop)?))
        .with_max_deliveries(setting("MAX_DELIVERIES", "5")?)
        .with_observer(move |event| log(event, store == "Redis"));
    consumer.prepare().await?;
    let name = consumer.consumer_name();
    tracing::info!(consumer = name, group, stream, store, "consuming");
    let (redis, ledger, postgres) = (&redis, &format!("{stream}:ledger"), postgres.as_ref());
    let effect = |message: tower_idempotency::StreamMessage, ticket: ClaimTicket| async move {
        let (entry, id) = (message.entry(), ticket.key().key().as_str());
        tracing::debug!(msg = %entry, id = ?id, "running");
        tokio::time::sleep(std::time::Duration::from_millis(work)).await;
        tracing::debug!(msg = %entry, id = ?id, "effect");
        if let Some(store) = postgres {
            // The row commits with the record, or neither does (a lost claim rolls it back).
            let mut transaction = store.transaction_for(&ticket).await?;
            let amount: i64 = message.parse_field("amount", "an integer")?;
            let insert = sqlx::query("INSERT INTO ledger (id, amount) VALUES ($1, $2)").bind(id);
            insert.bind(amount).execute(&mut *transaction).await?;
            tokio::time::sleep(std::time::Duration::from_millis(pause)).await;
            return Ok(transaction.commit(format!("{id} recorded").into()).await?);
        }
        let count: i64 = redis.hincrby(ledger, id, 1).await?;
        tokio::time::sleep(std::time::Duration::from_millis(pause)).await;
        Ok(format!("{id} counted ({count})").into())
    };
    consumer.run(shutdown, effect).await?;
    tracing::info!("stopped");
    Ok(())
}
