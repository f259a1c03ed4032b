//! What every benchmark server shares, benches/http_server.rs (this crate's modes) and
//! bench/peers (the other layers), so that only the layer differs between them: the handler,
//! and serving until SIGTERM or SIGINT.

use std::future::IntoFuture;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::body::Bytes;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;

/// `POST /payments` answers `201` with `{"id":"pay_<n>","bytes":<request body length>}`, after
/// sleeping N ms when the request carries `x-bench-sleep-ms: N` (to hold a key in flight).
pub fn payments() -> Router {
    Router::new().route("/payments", post(create_payment))
}

async fn create_payment(headers: HeaderMap, body: Bytes) -> Response {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let sleep_ms = headers
        .get("x-bench-sleep-ms")
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.parse::<u64>().ok());
    if let Some(ms) = sleep_ms {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    let id = COUNTER.fetch_add(1, Ordering::Relaxed);
    let json = format!("{{\"id\":\"pay_{id}\",\"bytes\":{}}}", body.len());
    (
        StatusCode::CREATED,
        [(header::CONTENT_TYPE, "application/json")],
        json,
    )
        .into_response()
}

/// How long connections and handlers may take to finish after a signal before the server exits
/// anyway (a request the bench holds in flight sleeps far longer).
pub const GRACE: Duration = Duration::from_millis(250);

/// Serves `router` (request bodies up to 2 MiB get past axum) on `addr` until SIGTERM or SIGINT,
/// then for at most [`GRACE`] while connections finish. Prints `bench_server: listening on
/// http://<addr> (mode <mode>)` once it listens, which scripts/bench.py waits for.
pub async fn serve(addr: &str, mode: &str, router: Router) -> std::io::Result<()> {
    let router = router.layer(axum::extract::DefaultBodyLimit::max(2 * 1024 * 1024));
    // Before the server says it listens: a SIGTERM sent at once (a bench cell that failed early)
    // must end it cleanly, not kill it, or its exit status hides the cell's own error.
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let listener = tokio::net::TcpListener::bind(addr).await?;
    println!(
        "bench_server: listening on http://{} (mode {mode})",
        listener.local_addr()?
    );
    let (stop, stopped) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = terminate.recv() => {}
        }
        let _ = stop.send(true);
    });
    let mut on_signal = stopped.clone();
    let serve = axum::serve(listener, router).with_graceful_shutdown(async move {
        let _ = on_signal.wait_for(|stop| *stop).await;
    });
    let mut after_grace = stopped;
    tokio::select! {
        served = serve.into_future() => served,
        _ = async {
            let _ = after_grace.wait_for(|stop| *stop).await;
            tokio::time::sleep(GRACE).await;
        } => Ok(()),
    }
}
