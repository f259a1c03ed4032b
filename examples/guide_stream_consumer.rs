//! Run with: REDIS_URL=redis://127.0.0.1:6379 cargo run --example guide_stream_consumer --features streams
//!
//! The Redis Streams consumer of docs/queue-consumers.md, as the guide shows it (a test checks
//! that the two agree, and runs this one through a duplicate, a mismatch, a store outage, a
//! `kill -9` while it holds a message, SIGTERM, and its connections dropped).

use std::time::Duration;

use tower_idempotency::fred::prelude::*;
use tower_idempotency::{shutdown_signal, Coordinator, RedisStore, StreamConsumer};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The stream's Redis, the records' (if not the same), and how long a dead consumer's
    // message waits before another consumer takes it over.
    let url = std::env::var("REDIS_URL")?;
    let store_url = std::env::var("STORE_URL").unwrap_or(url.clone());
    let lease_ms = std::env::var("LEASE_MS").map_or(Ok(30_000), |ms| ms.parse())?;
    // A client that reconnects after a dropped connection (fred's own default does not).
    let redis = StreamConsumer::connect_redis(&url).await?;
    let store = RedisStore::connect(&store_url).await?;
    let coordinator = Coordinator::new(store).with_lease(Duration::from_millis(lease_ms));
    // SIGTERM or Ctrl-C: what is in hand finishes, then `run` returns.
    let shutdown = shutdown_signal()?;
    let ledger = redis.clone();
    // Each message: `XADD payments * id pay-1 amount 40`. The key is `id`; the other fields are
    // the fingerprint (the same id with another amount is dead-lettered to `payments:dead`).
    StreamConsumer::new(redis, coordinator, "payments", "workers")
        .run(shutdown, |message, _ticket| {
            let ledger = ledger.clone();
            async move {
                let id = message.field("id").unwrap_or_default().to_owned();
                // Not an integer: dead-lettered, `bad amount: "lots" is not an integer`.
                let amount: i64 = message.parse_field("amount", "an integer")?;
                // The effect, once per id: `?` on an error leaves the message for a retry.
                let balance: i64 = ledger.incr_by(format!("balance:{id}"), amount).await?;
                Ok(format!("{id} applied, balance {balance}").into())
            }
        })
        .await?;
    Ok(())
}
