//! Run with: cargo run --example consumer
//!
//! The idempotency core without HTTP: a queue consumer that may receive a message more than once
//! (at-least-once delivery, a redelivery after a crash) processes each message id once. Uses the
//! in-memory store, or Redis when `REDIS_URL` is set.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tower_idempotency::{
    Begin, Coordinator, Error, Fingerprint, IdempotencyKey, MemoryStore, RecordKey, RedisStore, Store,
};

struct Message {
    id: &'static str,
    tenant: &'static str,
    payload: &'static [u8],
}

/// The side effect to run once per message; its result is what redeliveries get back.
async fn charge(message: &Message) -> Bytes {
    println!("  charging for {} ({} bytes)", message.id, message.payload.len());
    tokio::time::sleep(Duration::from_millis(20)).await;
    Bytes::from(format!("receipt-for-{}", message.id))
}

async fn handle(coordinator: &Coordinator, message: &Message) -> Result<(), Error> {
    let Ok(key) = IdempotencyKey::parse(message.id) else {
        println!("{}: not a valid key; dead-lettering", message.id);
        return Ok(());
    };
    // Scope by tenant: two tenants may use the same message id.
    let key = RecordKey::new(Some(message.tenant), key);
    let fingerprint = Fingerprint::new([message.payload]);
    match coordinator.begin(&key, &fingerprint).await? {
        Begin::Claimed(claim) => {
            let receipt = charge(message).await;
            claim.complete(receipt.clone()).await?;
            println!(
                "{}: processed -> {}",
                message.id,
                String::from_utf8_lossy(&receipt)
            );
        }
        Begin::Completed(receipt) => {
            println!(
                "{}: duplicate delivery, already done -> {}",
                message.id,
                String::from_utf8_lossy(&receipt)
            );
        }
        Begin::InFlight { lease_left } => {
            println!(
                "{}: another consumer is on it; redeliver in {lease_left:?}",
                message.id
            );
        }
        Begin::Mismatch => println!("{}: same id, different payload; dead-lettering", message.id),
    }
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let store: Arc<dyn Store> = match std::env::var("REDIS_URL") {
        Ok(url) => Arc::new(RedisStore::connect(&url).await?),
        Err(_) => Arc::new(MemoryStore::new()),
    };
    let coordinator = Coordinator::from_shared_store(store).with_lease(Duration::from_secs(10));
    let deliveries = [
        Message {
            id: "msg-1",
            tenant: "acme",
            payload: b"{\"amount\":10}",
        },
        Message {
            id: "msg-2",
            tenant: "acme",
            payload: b"{\"amount\":20}",
        },
        Message {
            id: "msg-1",
            tenant: "acme",
            payload: b"{\"amount\":10}",
        }, // redelivered
        Message {
            id: "msg-1",
            tenant: "globex",
            payload: b"{\"amount\":10}",
        }, // another tenant
        Message {
            id: "msg-2",
            tenant: "acme",
            payload: b"{\"amount\":99}",
        }, // id reused
    ];
    for message in &deliveries {
        handle(&coordinator, message).await?;
    }
    Ok(())
}
