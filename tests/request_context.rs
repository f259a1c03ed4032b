//! The request's tracing span goes with its work: a handler whose client hung up finishes in a
//! task of its own, still inside the span the request's future was instrumented with, and inside
//! the layer's own span for the keyed request, which carries its outcome, hashes of its scope and
//! key (never the raw values) and the store's timings.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use axum::body::Body;
use axum::routing::post;
use axum::Router;
use http::Request;
use tower::ServiceExt;
use tower_idempotency::{IdempotencyKey, IdempotencyLayer, MemoryStore, RecordKey};
use tracing::Instrument;
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;

/// Every event's message with the names of the spans it was logged in, innermost first.
type Events = Arc<Mutex<Vec<(String, Vec<String>)>>>;
/// Every `idempotency` span's fields, as recorded by the time it closed, in the order they closed.
type Spans = Arc<Mutex<Vec<HashMap<String, String>>>>;

static CAPTURED: OnceLock<(Events, Spans)> = OnceLock::new();

struct Capture(Events, Spans);

/// A span's fields so far, kept in its extensions.
struct Fields(HashMap<String, String>);

impl tracing::field::Visit for Fields {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        self.0.insert(field.name().to_owned(), format!("{value:?}"));
    }
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }
}

impl<S: tracing::Subscriber + for<'a> LookupSpan<'a>> tracing_subscriber::Layer<S> for Capture {
    fn on_event(&self, event: &tracing::Event<'_>, ctx: Context<'_, S>) {
        let message = common::event_message(event);
        let spans = ctx
            .event_scope(event)
            .map(|scope| scope.map(|span| span.name().to_owned()).collect())
            .unwrap_or_default();
        self.0.lock().unwrap().push((message, spans));
    }

    fn on_new_span(
        &self,
        attrs: &tracing::span::Attributes<'_>,
        id: &tracing::span::Id,
        ctx: Context<'_, S>,
    ) {
        let mut fields = Fields(HashMap::new());
        attrs.record(&mut fields);
        if let Some(span) = ctx.span(id) {
            span.extensions_mut().insert(fields);
        }
    }

    fn on_record(&self, id: &tracing::span::Id, values: &tracing::span::Record<'_>, ctx: Context<'_, S>) {
        if let Some(span) = ctx.span(id) {
            if let Some(fields) = span.extensions_mut().get_mut::<Fields>() {
                values.record(fields);
            }
        }
    }

    fn on_close(&self, id: tracing::span::Id, ctx: Context<'_, S>) {
        if let Some(span) = ctx.span(&id) {
            if span.name() == "idempotency" {
                if let Some(fields) = span.extensions_mut().remove::<Fields>() {
                    self.1.lock().unwrap().push(fields.0);
                }
            }
        }
    }
}

fn captured() -> (Events, Spans) {
    CAPTURED
        .get_or_init(|| {
            let events = Arc::new(Mutex::new(Vec::new()));
            let spans = Arc::new(Mutex::new(Vec::new()));
            let subscriber = tracing_subscriber::registry().with(Capture(events.clone(), spans.clone()));
            tracing::subscriber::set_global_default(subscriber).expect("the only subscriber");
            (events, spans)
        })
        .clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_whose_client_left_still_logs_in_the_request_span() {
    let (events, _) = captured();
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
        finished.1,
        ["idempotency", "request"],
        "in the layer's span, inside the request's: {logged:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_keyed_request_span_has_its_outcome_hashed_scope_and_key_and_store_timings() {
    let (_, spans) = captured();
    let app = Router::new()
        .route("/orders", post(|| async { "created" }))
        .layer(
            IdempotencyLayer::new(MemoryStore::new())
                .with_scope(|parts| parts.headers.get("x-tenant")?.to_str().ok().map(str::to_owned)),
        );
    let send = |body: &'static str| {
        let request = Request::post("/orders")
            .header("idempotency-key", "span-key-raw")
            .header("x-tenant", "tenant-raw")
            .body(Body::from(body))
            .unwrap();
        app.clone().oneshot(request)
    };
    for body in ["{}", "{}", "{\"other\":1}"] {
        send(body).await.unwrap();
    }
    // Spans close when their last handle goes; the detached-run test may close one meanwhile.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let record = RecordKey::new(Some("tenant-raw"), IdempotencyKey::parse("span-key-raw").unwrap());
    let key_hash = &record.digest_hex()[..16];
    let mine: Vec<_> = spans
        .lock()
        .unwrap()
        .iter()
        .filter(|fields| fields.get("key").map(String::as_str) == Some(key_hash))
        .cloned()
        .collect();
    let outcomes: Vec<_> = mine.iter().map(|fields| fields["outcome"].as_str()).collect();
    assert_eq!(outcomes, ["executed", "replayed", "mismatch"], "{mine:?}");
    for fields in &mine {
        assert!(
            fields.values().all(|value| !value.contains("raw")),
            "no raw scope or key in the span: {fields:?}"
        );
        let scope = &fields["scope"];
        assert!(
            scope.len() == 16 && scope.chars().all(|c| c.is_ascii_hexdigit()),
            "{scope}"
        );
    }
    let claim_us: u64 = mine[0]["store_claim_us"]
        .parse()
        .expect("the claim's time, in µs");
    assert!(claim_us < 1_000_000, "{claim_us}");
    for answered in &mine[1..] {
        assert!(
            !answered.contains_key("store_claim_us"),
            "the memory store answers a completed key before any store call: {answered:?}"
        );
    }
    assert!(
        mine[0].contains_key("store_complete_us"),
        "the executed request stored its response: {:?}",
        mine[0]
    );
    assert_eq!(mine[0]["scope"], mine[1]["scope"], "one scope, one hash");
}
