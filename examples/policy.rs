//! Run with: cargo run --example policy --features policy-yaml
//!
//! One layer on the whole router, configured per endpoint by a policy file
//! (`examples/idempotency.yaml`; `POLICY=examples/idempotency.toml` with `--features
//! policy-toml`, or the `.json` one). The file scopes keys by the `X-Tenant-Id` header, which a
//! gateway in front would set; try:
//!
//! ```sh
//! curl -i -X POST localhost:3000/payments -H 'X-Tenant-Id: acme' -H 'Idempotency-Key: k1' -d '{}'
//! ```

use std::time::Duration;

use axum::http::StatusCode;
use axum::routing::{post, put};
use axum::{Extension, Router};
use tower_idempotency::{IdempotencyLayer, MemoryStore, Policy, PolicyLayer, RecordKey};

fn app(policy: PolicyLayer) -> Router {
    Router::new()
        .route(
            "/payments",
            post(|Extension(key): Extension<RecordKey>| async move {
                // The payment provider gets a key unique to this tenant and client key.
                let provider_key = key.digest_hex();
                (
                    StatusCode::CREATED,
                    format!("paid (provider key {provider_key})\n"),
                )
            }),
        )
        .route("/posts/{id}/comments", post(|| async { StatusCode::CREATED }))
        .route("/uploads/{*path}", put(|| async { StatusCode::CREATED }))
        // The policy layer goes on the outer router: it matches the full path.
        .layer(policy)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let file = std::env::var("POLICY")
        .unwrap_or_else(|_| concat!(env!("CARGO_MANIFEST_DIR"), "/examples/idempotency.yaml").to_owned());
    // A mistake in the file stops the start with its place: `file:line:column: field: message`.
    let policy = Policy::from_file(&file)?;
    let layer = PolicyLayer::from_policy(IdempotencyLayer::new(MemoryStore::new()), &policy)?;
    let shutdown = layer.shutdown_handle();

    let addr = std::env::var("ADDR").unwrap_or_else(|_| "127.0.0.1:3000".into());
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    println!("policy {file}; listening on http://{}", listener.local_addr()?);
    axum::serve(listener, app(layer))
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    shutdown.shutdown(Duration::from_secs(10)).await?;
    Ok(())
}
