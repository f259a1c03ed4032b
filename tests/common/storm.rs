//! What the storm tests (chaos, failovers) share: a handler that records every execution per key
//! in a ledger, behind a layer, and the count of requests in flight that aims faults at traffic.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use http::{HeaderMap, StatusCode};
use tower_idempotency::IdempotencyLayer;

/// Every handler execution, per key: the body it answered.
#[derive(Clone, Default)]
pub struct Ledger(Arc<Mutex<HashMap<String, Vec<Bytes>>>>);

impl Ledger {
    /// A copy of every key's executions.
    pub fn runs(&self) -> HashMap<String, Vec<Bytes>> {
        self.0.lock().unwrap().clone()
    }
}

/// `POST /payments` behind `layer` on the node named `node`: records the run in `ledger`, takes
/// `handler_time(request headers)`, and answers 201 with a body naming the key, the run and the
/// node.
pub fn app(
    layer: IdempotencyLayer,
    ledger: Ledger,
    node: &'static str,
    handler_time: fn(&HeaderMap) -> Duration,
) -> Router {
    let handler = move |headers: HeaderMap| {
        let ledger = ledger.clone();
        async move {
            let key = headers["idempotency-key"].to_str().unwrap().to_owned();
            let body = {
                let mut ledger = ledger.0.lock().unwrap();
                let runs = ledger.entry(key.clone()).or_default();
                let body = Bytes::from(format!("{key} run {} on {node}", runs.len() + 1));
                runs.push(body.clone());
                body
            };
            // Read with the store's log when a storm runs a key twice (`trace_if_asked`).
            tracing::info!(target: "storm", %key, node, body = %String::from_utf8_lossy(&body), "the handler runs");
            tokio::time::sleep(handler_time(&headers)).await;
            (StatusCode::CREATED, body)
        }
    };
    Router::new().route("/payments", post(handler)).layer(layer)
}

/// With `TEST_TRACE_LOG=<file>`, logs the crate at debug level and the storms' own notes (target
/// `storm`: each handler run, each answer) to `<file>`, timestamped (UTC, microseconds), to read
/// a storm that ran a key twice beside the servers' logs and `MONITOR`s (`TEST_SERVER_LOGS`).
/// Without it nothing is installed, and the notes cost a check each. The first call in a test
/// binary installs it (the binary's tests share the file: filter the one to read).
pub fn trace_if_asked() {
    let Some(path) = std::env::var_os("TEST_TRACE_LOG") else {
        return;
    };
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .expect("the trace log");
    let _ = tracing_subscriber::fmt()
        .with_env_filter("warn,tower_idempotency=debug,storm=debug")
        .with_ansi(false)
        .with_thread_ids(true)
        .with_writer(Mutex::new(file))
        .try_init();
}

/// A request in flight on a node, counted in `count` until dropped (answered, or abandoned by a
/// client that hung up): where a fault would land now.
pub struct InFlight<'a>(&'a AtomicUsize);

impl<'a> InFlight<'a> {
    pub fn new(count: &'a AtomicUsize) -> Self {
        count.fetch_add(1, Ordering::SeqCst);
        Self(count)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}
