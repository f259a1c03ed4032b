//! Run with: cargo run --example per_route
//!
//! Each route gets its own configuration: a differently configured layer on each. Clones of
//! one layer share its store and its bound on running requests, so one shutdown handle covers
//! them all.

use std::time::Duration;

use axum::http::StatusCode;
use axum::routing::{patch, post};
use axum::Router;
use tower_idempotency::{IdempotencyLayer, MemoryStore};

#[derive(Clone)]
struct TenantId(String);

fn app() -> (Router, IdempotencyLayer) {
    let base = IdempotencyLayer::new(MemoryStore::new());
    // Payments: key required, kept a week, a short lease so a crashed node frees keys quickly
    // (kept above three store timeouts, 3 × 2 s, so a renewal that times out twice still lands
    // in time), and keys scoped per tenant (set by an authentication layer that runs first).
    let payments = base
        .clone()
        .with_retention(Duration::from_secs(7 * 24 * 3600))
        .with_lease(Duration::from_secs(8))
        .with_scope(|parts| parts.extensions.get::<TenantId>().map(|t| t.0.clone()));
    // Comments: key optional, the IETF draft's 422 for a reused key.
    let comments = base
        .clone()
        .with_key_required(false)
        .with_mismatch_status(StatusCode::UNPROCESSABLE_ENTITY);
    // Profiles: PATCH only, small bodies.
    let profiles = base.clone().with_body_limit(16 * 1024);

    let router = Router::new()
        .route(
            "/payments",
            post(|| async { StatusCode::CREATED }).layer(payments),
        )
        .route(
            "/comments",
            post(|| async { StatusCode::CREATED }).layer(comments),
        )
        .route(
            "/profile",
            patch(|| async { StatusCode::NO_CONTENT }).layer(profiles),
        )
        // Stand-in for authentication: every request belongs to tenant "demo".
        .layer(axum::middleware::from_fn(
            |mut request: axum::extract::Request, next: axum::middleware::Next| async {
                request.extensions_mut().insert(TenantId("demo".into()));
                next.run(request).await
            },
        ));
    (router, base)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (router, base) = app();
    let addr = std::env::var("ADDR").unwrap_or_else(|_| "127.0.0.1:3000".into());
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    println!("listening on http://{}", listener.local_addr()?);
    axum::serve(listener, router)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    base.shutdown_handle().shutdown(Duration::from_secs(10)).await?;
    Ok(())
}
