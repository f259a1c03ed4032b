//! The request's tracing span goes with its work: a handler whose client hung up finishes in a
//! task of its own, still inside the span the request's future was instrumented with.

mod common;

use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use axum::body::Body;
use axum::routing::post;
use axum::Router;
use http::Request;
use tower::ServiceExt;
use tower_idempotency::{IdempotencyLayer, MemoryStore};
use tracing::Instrument;
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;

/// Every event's message with the names of the spans it was logged in, innermost first.
type Events = Arc<Mutex<Vec<(String, Vec<String>)>>>;

static EVENTS: OnceLock<Events> = OnceLock::new();

struct Capture(Events);

impl<S: tracing::Subscriber + for<'a> LookupSpan<'a>> tracing_subscriber::Layer<S> for Capture {
    fn on_event(&self, event: &tracing::Event<'_>, ctx: Context<'_, S>) {
        let message = common::event_message(event);
        let spans = ctx
            .event_scope(event)
            .map(|scope| scope.map(|span| span.name().to_owned()).collect())
            .unwrap_or_default();
        self.0.lock().unwrap().push((message, spans));
    }
}

fn events() -> Events {
    EVENTS
        .get_or_init(|| {
            let events = Arc::new(Mutex::new(Vec::new()));
            let subscriber = tracing_subscriber::registry().with(Capture(events.clone()));
            tracing::subscriber::set_global_default(subscriber).expect("the only subscriber");
            events
        })
        .clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_whose_client_left_still_logs_in_the_request_span() {
    let events = events();
    let app = Router::new()
        .route(
            "/payments",
            post(|| async {
                tokio::time::sleep(Duration::from_millis(200)).await;
                tracing::info!("handler finished");
                "done"
            }),
        )
        .layer(IdempotencyLayer::new(MemoryStore::new()));
    let request = Request::post("/payments")
        .header("idempotency-key", "context")
        .body(Body::from("{}"))
        .unwrap();
    let span = tracing::info_span!("request", request_id = 7);
    let hung_up =
        tokio::time::timeout(Duration::from_millis(50), app.oneshot(request).instrument(span)).await;
    assert!(hung_up.is_err(), "the client left while the handler ran");
    tokio::time::sleep(Duration::from_millis(400)).await;
    let logged = events.lock().unwrap().clone();
    let finished = logged
        .iter()
        .find(|(message, _)| message == "handler finished")
        .expect("the handler finished in its own task");
    assert_eq!(
        finished.1.first().map(String::as_str),
        Some("request"),
        "{logged:?}"
    );
}
