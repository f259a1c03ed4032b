//! Run with: DATABASE_URL=postgres://user:password@127.0.0.1/db cargo run --example postgres_transactional --features postgres
//!
//! An orders API whose handler stores its idempotent response in the same transaction as the
//! order it creates: the order row and the stored response commit, or roll back, together. A
//! crash after the commit gives the retry the stored response (one order); a crash before it
//! leaves no order and no response, and the key runs again once its lease ends (one order).
//! With Redis, a crash between the order's commit and the response's storage would run the
//! key twice.
//!
//! Listens on `ADDR` (default `127.0.0.1:3000`); `LEASE_MS` sets the lease (default 30 000).
//! Creates its tables (`orders`, `idempotency_records`) at start.
//!
//! ```text
//! curl -i -X POST localhost:3000/orders -H 'Idempotency-Key: order-1' \
//!      -H 'Content-Type: application/json' -d '{"amount": 42}'
//! # again: the same 201, the same order id, plus `Idempotent-Replayed: true`
//! ```
//!
//! `pause_before_commit_ms` and `pause_after_commit_ms` in the request make the handler wait
//! there, to kill the process at either point and watch what a retry gets
//! (`tests/postgres_transactional.rs` does).

use std::time::Duration;

use axum::extract::{Extension, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use serde_json::json;
use tower_idempotency::{IdempotencyLayer, PostgresStore, TransactionalClaim};

#[derive(serde::Deserialize)]
struct NewOrder {
    amount: i64,
    pause_before_commit_ms: Option<u64>,
    pause_after_commit_ms: Option<u64>,
}

/// Any failure: 500, which the layer does not store, so the key is released and a retry runs
/// again; the transaction, dropped uncommitted, rolls back the order. The error is logged, never
/// sent: a database error names tables, constraints and values, none of which the client can
/// act on (docs/postgresql.md shows the same pattern).
struct Failed(Box<dyn std::error::Error + Send + Sync>);

impl<E: std::error::Error + Send + Sync + 'static> From<E> for Failed {
    fn from(error: E) -> Self {
        Self(Box::new(error))
    }
}

impl IntoResponse for Failed {
    fn into_response(self) -> Response {
        tracing::error!(error = %self.0, "order not placed");
        let body = Json(json!({ "error": "the order could not be placed; retry with the same key" }));
        (StatusCode::INTERNAL_SERVER_ERROR, body).into_response()
    }
}

async fn create_order(
    State(store): State<PostgresStore>,
    Extension(claim): Extension<TransactionalClaim>,
    Json(order): Json<NewOrder>,
) -> Result<Response, Failed> {
    let mut transaction = store.pool().begin().await?;
    let id: i64 = sqlx::query_scalar("INSERT INTO orders (amount) VALUES ($1) RETURNING id")
        .bind(order.amount)
        .fetch_one(&mut *transaction)
        .await?;
    let body = Json(json!({ "id": id, "amount": order.amount }));
    let location = [(header::LOCATION, format!("/orders/{id}"))];
    let response = (StatusCode::CREATED, location, body).into_response();
    // The response as the layer stores it, and the same response back, to return.
    let (response, payload) = claim.encode_response(response).await.map_err(Failed)?;
    // Last, right before the commit: from here to the commit a retry waits for this transaction.
    if let Some(payload) = payload {
        if !store
            .complete_in(&mut transaction, claim.ticket(), payload)
            .await?
        {
            // The lease ran out and another request may have taken the key: this order must
            // not be placed. Dropping the transaction rolls it back.
            let body = Json(json!({ "error": "this request took too long; retry with the same key" }));
            return Ok((StatusCode::CONFLICT, body).into_response());
        }
    }
    pause(order.pause_before_commit_ms).await;
    transaction.commit().await?;
    pause(order.pause_after_commit_ms).await;
    Ok(response)
}

async fn pause(ms: Option<u64>) {
    if let Some(ms) = ms {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
}

/// The application, kept apart from `main` so tests can drive it without a socket.
fn app(store: PostgresStore, lease: Duration) -> (Router, IdempotencyLayer) {
    let layer = IdempotencyLayer::new(store.clone())
        .with_lease(lease)
        .with_transactional_completion(true);
    let router = Router::new()
        .route("/orders", post(create_order).layer(layer.clone()))
        .with_state(store);
    (router, layer)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let url = std::env::var("DATABASE_URL").map_err(|_| "set DATABASE_URL to a PostgreSQL database")?;
    let store = PostgresStore::connect(&url).await?;
    store.migrate().await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS orders (
             id         bigserial PRIMARY KEY,
             amount     bigint NOT NULL,
             created_at timestamptz NOT NULL DEFAULT now()
         )",
    )
    .execute(store.pool())
    .await?;
    let lease = match std::env::var("LEASE_MS") {
        Ok(ms) => Duration::from_millis(ms.parse()?),
        Err(_) => Duration::from_secs(30),
    };
    println!(
        "store: PostgreSQL, table {}; orders in table orders",
        store.table()
    );
    let (router, layer) = app(store, lease);
    let addr = std::env::var("ADDR").unwrap_or_else(|_| "127.0.0.1:3000".into());
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    println!("listening on http://{}", listener.local_addr()?);
    axum::serve(listener, router)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    layer.shutdown_handle().shutdown(Duration::from_secs(10)).await?;
    Ok(())
}
