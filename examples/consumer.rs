//! Run with: cargo run --example consumer
//!
//! The simplest queue consumer: `Coordinator::once` over a fixed list of deliveries, as an
//! at-least-once broker would hand them over (a redelivery, the same id from another tenant, an
//! id reused for another message, an operation that fails once), and what each answer means for
//! the message (`Once::disposition`: acknowledge, deliver again, dead-letter). In memory, or on
//! Redis when `REDIS_URL` is set. The real consumers, with a broker, redeliveries and crashes,
//! are `examples/stream_consumer.rs` (Redis Streams) and `examples/rabbitmq_consumer.rs`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tower_idempotency::bytes::Bytes;
use tower_idempotency::{
    Coordinator, Disposition, Fingerprint, IdempotencyKey, MemoryStore, Once, RecordKey, RedisStore, Store,
};

struct Delivery {
    id: &'static str,
    tenant: &'static str,
    payload: &'static str,
}

const DELIVERIES: [Delivery; 6] = [
    Delivery {
        id: "msg-1",
        tenant: "acme",
        payload: r#"{"amount":10}"#,
    },
    Delivery {
        id: "msg-2",
        tenant: "acme",
        payload: r#"{"amount":20}"#,
    }, // fails the first time
    Delivery {
        id: "msg-1",
        tenant: "acme",
        payload: r#"{"amount":10}"#,
    }, // redelivered
    Delivery {
        id: "msg-2",
        tenant: "acme",
        payload: r#"{"amount":20}"#,
    }, // redelivered after the failure
    Delivery {
        id: "msg-1",
        tenant: "globex",
        payload: r#"{"amount":10}"#,
    }, // another tenant's msg-1
    Delivery {
        id: "msg-2",
        tenant: "acme",
        payload: r#"{"amount":99}"#,
    }, // id reused: poison
];

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let store: Arc<dyn Store> = match std::env::var("REDIS_URL") {
        Ok(url) => Arc::new(RedisStore::connect(&url).await?),
        Err(_) => Arc::new(MemoryStore::new()),
    };
    let coordinator = Coordinator::from_shared_store(store);
    let bank_down_once = AtomicBool::new(true);
    for delivery in &DELIVERIES {
        // Scope by tenant: two tenants may use the same message id.
        let key = RecordKey::new(Some(delivery.tenant), IdempotencyKey::parse(delivery.id)?);
        let fingerprint = Fingerprint::new([delivery.payload.as_bytes()]);
        let answer = coordinator
            .once(&key, &fingerprint, || async {
                // The effect, run once per key: a technical failure (`Err`) gives the key up
                // for the redelivery; what it returns in `Ok` is stored for the duplicates.
                if delivery.id == "msg-2" && bank_down_once.swap(false, Ordering::SeqCst) {
                    return Err("the bank did not answer");
                }
                Ok(Bytes::from(format!(
                    "receipt for {} of {}",
                    delivery.id, delivery.tenant
                )))
            })
            .await;
        let what = match &answer {
            Once::Ran(receipt) => format!("ran -> {}", String::from_utf8_lossy(receipt)),
            Once::Replayed(receipt) => format!("duplicate -> {}", String::from_utf8_lossy(receipt)),
            Once::InFlight { retry_after } => {
                format!("another consumer is on it (lease ends in {retry_after:?})")
            }
            Once::Mismatch => "same id, different message".to_owned(),
            Once::Failed(error) => format!("failed: {error}"),
            Once::Unavailable(error) => format!("store unavailable: {error}"),
            Once::NotStored { error, .. } => format!("ran, but not stored: {error}"),
        };
        let disposition = match answer.disposition() {
            Disposition::Ack => "ack",
            Disposition::Retry { .. } => "deliver again",
            Disposition::DeadLetter => "dead-letter",
        };
        println!("{} ({}): {what}; {disposition}", delivery.id, delivery.tenant);
    }
    Ok(())
}
