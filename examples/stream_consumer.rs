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
//! A message has the fields `id` (the key) and `amount` (an integer; the fingerprint). The
//! effect is `HINCRBY <STREAM>:ledger <id> 1`, or a row in `ledger (id, amount)`. One line per
//! message on stdout, `<outcome> msg=<entry> id="<id>" …` (`ran`, `replayed`, `in-flight`,
//! `failed`, `unavailable`, `dead-lettered`); with `RUST_LOG=stream_consumer=debug`,
//! `received`, `running`, `effect` and (Redis store) `completed … window_us=` on stderr. SIGTERM
//! or Ctrl-C: the message in hand finishes, exit 0. The guide (docs/queue-consumers.md) has the
//! table of outcomes and what each does to the message. `stream_consumer publish ID AMOUNT`
//! publishes one message (`PRODUCER`, default `publisher`), once on Redis 8.6 however often
//! it is retried, and prints `published msg=<entry> id="<id>" deduplicated=<bool>`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use fred::prelude::*;
use tower_idempotency::{
    ClaimTicket, Coordinator, Failure, RedisStore, StreamConsumer, StreamEvent, StreamMessage, StreamOutcome,
    StreamPublisher,
};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

fn setting<T: std::str::FromStr<Err: std::fmt::Display>>(name: &str, default: T) -> Result<T, BoxError> {
    std::env::var(name).map_or(Ok(default), |v| {
        v.parse().map_err(|e| format!("{name}={v:?}: {e}").into())
    })
}

/// One line per message on stdout (`StreamEvent`'s own format, `amount=` added to `ran`), the
/// rest at debug level on stderr.
fn log(event: &StreamEvent<'_>, applied: &Mutex<HashMap<String, Instant>>) {
    let StreamEvent::Handled { message, outcome, .. } = event else {
        return tracing::debug!("{event}"); // received
    };
    let (entry, id) = (message.entry(), message.id().unwrap_or_default());
    let applied = applied.lock().unwrap_or_else(|p| p.into_inner()).remove(entry);
    match outcome {
        StreamOutcome::Ran { not_stored, .. } => {
            println!("{event} amount={}", message.field("amount").unwrap_or_default());
            // From the effect's reply to the completion's: a crash in between runs it again.
            if let (None, Some(applied)) = (not_stored, applied) {
                let window_us = applied.elapsed().as_micros();
                tracing::debug!("completed msg={entry} id={id:?} window_us={window_us}");
            }
        }
        _ => println!("{event}"),
    }
}

/// The effect: a counter in the stream's Redis, or (`postgres`) a row committed with the record.
async fn apply(
    message: StreamMessage,
    ticket: ClaimTicket,
    ledger: &Ledger,
    pause: Duration,
    work: Duration,
) -> Result<Bytes, Failure> {
    let (entry, id) = (message.entry(), ticket.key().key().as_str());
    let amount = message.field("amount").unwrap_or_default();
    let amount: i64 = amount
        .parse()
        .map_err(|_| Failure::dead_letter(format!("bad amount: {amount:?} is not an integer")))?;
    tracing::debug!(msg = entry, id = ?id, "running");
    tokio::time::sleep(work).await;
    tracing::debug!(msg = entry, id = ?id, "effect");
    match ledger {
        Ledger::Redis { client, key, applied } => {
            let _ = amount; // in the fingerprint, not the counter
            let count: i64 = client.hincrby(key, id, 1).await?;
            applied
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(entry.to_owned(), Instant::now());
            tokio::time::sleep(pause).await;
            Ok(Bytes::from(format!("{id} counted ({count})")))
        }
        #[cfg(feature = "postgres")]
        Ledger::Postgres(store) => {
            let mut transaction = store.pool().begin().await?;
            let insert = sqlx::query("INSERT INTO ledger (id, amount) VALUES ($1, $2)")
                .bind(id)
                .bind(amount);
            insert.execute(&mut *transaction).await?;
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
            Ok(receipt)
        }
    }
}

enum Ledger {
    Redis {
        client: Client,
        key: String,
        applied: Arc<Mutex<HashMap<String, Instant>>>,
    },
    #[cfg(feature = "postgres")]
    Postgres(tower_idempotency::PostgresStore),
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
    let (stream, lease) = (
        setting("STREAM", "payments".to_owned())?,
        Duration::from_millis(setting("LEASE_MS", 30_000)?),
    );
    let (work, pause) = (
        Duration::from_millis(setting("WORK_MS", 0)?),
        Duration::from_millis(setting("PAUSE_AFTER_EFFECT_MS", 0)?),
    );
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    // XREADGROUP blocks 200 ms at most, so 5 s without an answer is a dead connection.
    let client = Builder::from_config(Config::from_url(&url)?)
        .with_connection_config(|c| c.connection_timeout = Duration::from_secs(2))
        .with_performance_config(|p| p.default_command_timeout = Duration::from_secs(5))
        .set_policy(ReconnectPolicy::new_exponential(0, 10, 1000, 2))
        .build()?;
    client.init().await?;
    // `stream_consumer publish ID AMOUNT`: one message, added once however often it is retried
    // where the server deduplicates (Redis 8.6's `XADD … IDMP`).
    if let [_, verb, id, amount] = &std::env::args().collect::<Vec<_>>()[..] {
        if verb == "publish" {
            let publisher =
                StreamPublisher::new(client, &stream, setting("PRODUCER", "publisher".to_owned())?);
            let entry = (publisher.publish(id, [("id", id.as_str()), ("amount", amount.as_str())])).await?;
            println!(
                "published msg={entry} id={id:?} deduplicated={}",
                publisher.deduplicates().await
            );
            return Ok(());
        }
    }
    let applied = Arc::new(Mutex::new(HashMap::new()));
    let (coordinator, ledger) = match std::env::var("DATABASE_URL") {
        Err(_) => (
            Coordinator::new(RedisStore::connect(&url).await?),
            Ledger::Redis {
                client: client.clone(),
                key: format!("{stream}:ledger"),
                applied: applied.clone(),
            },
        ),
        #[cfg(feature = "postgres")]
        Ok(url) => {
            let store = tower_idempotency::PostgresStore::connect(&url).await?;
            store.migrate().await?;
            // Consumers starting together race to create it; the advisory lock orders them.
            let ddl = "SELECT pg_advisory_xact_lock(24); CREATE TABLE IF NOT EXISTS ledger (id text NOT NULL, amount bigint NOT NULL)";
            sqlx::raw_sql(ddl).execute(store.pool()).await?;
            (Coordinator::new(store.clone()), Ledger::Postgres(store))
        }
        #[cfg(not(feature = "postgres"))]
        Ok(_) => return Err("DATABASE_URL needs the example built with --features postgres".into()),
    };
    let mut consumer = StreamConsumer::new(
        client,
        coordinator.with_lease(lease),
        &stream,
        setting("GROUP", "workers".to_owned())?,
    )
    .with_max_deliveries(setting("MAX_DELIVERIES", 5)?)
    .with_observer(move |event| log(event, &applied));
    if let Ok(name) = std::env::var("CONSUMER") {
        consumer = consumer.with_consumer_name(name);
    }
    let store = if matches!(ledger, Ledger::Redis { .. }) {
        "Redis"
    } else {
        "PostgreSQL"
    };
    tracing::info!(consumer = consumer.consumer_name(), stream, store, "consuming");
    let shutdown = async {
        tokio::select! { _ = terminate.recv() => {}, _ = tokio::signal::ctrl_c() => {} }
    };
    consumer
        .run(shutdown, |message, ticket| {
            apply(message, ticket, &ledger, pause, work)
        })
        .await?;
    tracing::info!("stopped");
    Ok(())
}
