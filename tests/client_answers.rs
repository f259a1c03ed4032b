//! Answers a client (or an agent) can act on without reading prose, and the outcome of each
//! request for the layers outside: the problem documents' `key_state`, `retryable` and
//! `retry_after` members, `RequestOutcome` in the response's extensions as an outer layer sees
//! it, and the outcome as a default `fmt` subscriber prints it.

use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use tower::{Service, ServiceBuilder, ServiceExt};
use tower_idempotency::{
    IdempotencyKey, IdempotencyLayer, MemoryStore, RecordKey, RequestBody, RequestOutcome,
};

type Body = RequestBody<Full<Bytes>>;

/// A handler that answers 201 after `delay`.
async fn handler(delay: Duration) -> Result<Response<Full<Bytes>>, Infallible> {
    tokio::time::sleep(delay).await;
    let mut response = Response::new(Full::from("{\"id\":1}"));
    *response.status_mut() = StatusCode::CREATED;
    Ok(response)
}

fn request(key: Option<&str>, body: &'static str) -> Request<Full<Bytes>> {
    let mut builder = Request::post("/orders");
    if let Some(key) = key {
        builder = builder.header("idempotency-key", key);
    }
    builder.body(Full::from(body)).unwrap()
}

struct Answer {
    status: StatusCode,
    retry_after_header: Option<u64>,
    problem: serde_json::Value,
    body: Bytes,
}

async fn answer<S>(service: &mut S, request: Request<Full<Bytes>>) -> Answer
where
    S: Service<Request<Full<Bytes>>, Response = Response<tower_idempotency::ResponseBody<Full<Bytes>>>>,
    S::Error: std::fmt::Debug,
{
    let response = service.ready().await.unwrap().call(request).await.unwrap();
    let status = response.status();
    let retry_after_header = response
        .headers()
        .get("retry-after")
        .map(|value| value.to_str().unwrap().parse().unwrap());
    let body = response.into_body().collect().await.unwrap().to_bytes();
    let problem = serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null);
    Answer {
        status,
        retry_after_header,
        problem,
        body,
    }
}

/// The members a client acts on, as (key_state, retryable, retry_after).
fn members(answer: &Answer) -> (&str, bool, Option<u64>) {
    let problem = &answer.problem;
    (
        problem["key_state"].as_str().unwrap_or("<none>"),
        problem["retryable"].as_bool().expect("a boolean `retryable`"),
        problem
            .get("retry_after")
            .map(|seconds| seconds.as_u64().expect("whole seconds")),
    )
}

#[tokio::test]
async fn every_rejection_says_the_keys_state_whether_to_retry_and_when() {
    let mut service = ServiceBuilder::new()
        .layer(IdempotencyLayer::new(MemoryStore::new()).with_handler_timeout(Duration::from_millis(100)))
        .service_fn(|request: Request<Body>| {
            let slow = request.headers().contains_key("x-slow");
            handler(if slow {
                Duration::from_millis(600)
            } else {
                Duration::ZERO
            })
        });

    let missing = answer(&mut service, request(None, "{}")).await;
    assert_eq!(missing.status, StatusCode::BAD_REQUEST);
    assert_eq!(members(&missing), ("absent", false, None));

    // A request in flight: 409, retry the same key, when `Retry-After` (and the member) say.
    let slow = |key: &'static str| {
        let mut request = request(Some(key), "{}");
        request.headers_mut().insert("x-slow", "1".parse().unwrap());
        request
    };
    let mut running = service.clone();
    let first = tokio::spawn(async move { answer(&mut running, slow("slow-key")).await });
    tokio::time::sleep(Duration::from_millis(30)).await;
    let in_flight = answer(&mut service, request(Some("slow-key"), "{}")).await;
    assert_eq!(in_flight.status, StatusCode::CONFLICT);
    let (state, retryable, retry_after) = members(&in_flight);
    assert_eq!((state, retryable), ("in_flight", true));
    assert!(
        retry_after.is_some_and(|seconds| seconds >= 1),
        "{:?}",
        in_flight.problem
    );
    assert_eq!(
        retry_after, in_flight.retry_after_header,
        "the member and the header agree"
    );

    // The handler timed out: its key is kept as not replayable, and says so on every retry.
    let timed_out = first.await.unwrap();
    assert_eq!(timed_out.status, StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(members(&timed_out), ("not_replayable", false, None));
    let kept = answer(&mut service, request(Some("slow-key"), "{}")).await;
    assert_eq!(kept.status, StatusCode::CONFLICT);
    assert_eq!(members(&kept), ("not_replayable", false, None));

    // Done, then reused with another body: a mismatch, never retryable.
    assert_eq!(
        answer(&mut service, request(Some("done"), "{}")).await.status,
        StatusCode::CREATED
    );
    let mismatch = answer(&mut service, request(Some("done"), "{\"other\":1}")).await;
    assert_eq!(members(&mismatch), ("mismatch", false, None));

    // The members come after RFC 9457's own, which keep their bytes.
    let body = String::from_utf8(kept.body.to_vec()).unwrap();
    let detail_ends = body.find(",\"key_state\":").expect("a key_state member");
    assert!(
        body.starts_with("{\"type\":") && body[..detail_ends].contains(",\"detail\":"),
        "{body}"
    );
    assert_eq!(
        &body[detail_ends..],
        ",\"key_state\":\"not_replayable\",\"retryable\":false}"
    );
}

#[tokio::test]
async fn a_timed_out_key_the_layer_releases_is_retryable() {
    let mut service = ServiceBuilder::new()
        .layer(
            IdempotencyLayer::new(MemoryStore::new())
                .with_handler_timeout(Duration::from_millis(100))
                .with_release_not_stored(true),
        )
        .service_fn(|_: Request<Body>| handler(Duration::from_millis(400)));
    let timed_out = answer(&mut service, request(Some("k"), "{}")).await;
    assert_eq!(timed_out.status, StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(members(&timed_out), ("released", true, None));
}

#[tokio::test]
async fn a_store_that_cannot_take_the_claim_says_retry_the_same_key_in_a_second() {
    // A memory store of one record, held by a request in flight: the next key's claim fails
    // (the store is full), which the layer answers as any store failure.
    let mut service = ServiceBuilder::new()
        .layer(IdempotencyLayer::new(MemoryStore::new().with_max_entries(1)))
        .service_fn(|_: Request<Body>| handler(Duration::from_millis(300)));
    let mut running = service.clone();
    let first = tokio::spawn(async move { answer(&mut running, request(Some("first"), "{}")).await });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let unavailable = answer(&mut service, request(Some("second"), "{}")).await;
    assert_eq!(unavailable.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(members(&unavailable), ("store_unavailable", true, Some(1)));
    assert_eq!(unavailable.retry_after_header, Some(1));
    assert_eq!(first.await.unwrap().status, StatusCode::CREATED);
}

#[tokio::test]
async fn a_layer_outside_reads_each_requests_outcome_from_the_extensions() {
    // What a user's metrics or `TraceLayer` would do: label each response by the outcome.
    let seen: Arc<Mutex<Vec<Option<RequestOutcome>>>> = Arc::default();
    let labels = seen.clone();
    let mut service = ServiceBuilder::new()
        .map_response(move |response: Response<_>| {
            labels
                .lock()
                .unwrap()
                .push(response.extensions().get::<RequestOutcome>().copied());
            response
        })
        .layer(IdempotencyLayer::new(MemoryStore::new()))
        .service_fn(|_: Request<Body>| handler(Duration::ZERO));
    for (key, body) in [
        (Some("a"), "{}"),
        (Some("a"), "{}"),
        (Some("a"), "[]"),
        (None, "{}"),
    ] {
        answer(&mut service, request(key, body)).await;
    }
    let mut get = Request::get("/orders").body(Full::from("")).unwrap();
    get.headers_mut().insert("idempotency-key", "b".parse().unwrap());
    service.ready().await.unwrap().call(get).await.unwrap();
    assert_eq!(
        *seen.lock().unwrap(),
        [
            Some(RequestOutcome::Executed),
            Some(RequestOutcome::Replayed),
            Some(RequestOutcome::Mismatch),
            Some(RequestOutcome::Rejected),
            // A GET is not guarded: the layer let it pass, and says nothing of it.
            None,
        ]
    );
    assert_eq!(RequestOutcome::Replayed.as_str(), "replayed");
}

/// Everything a subscriber writes, for the test to read.
#[derive(Clone, Default)]
struct Written(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Written {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test]
async fn a_default_fmt_subscriber_prints_each_requests_outcome() {
    let written = Written::default();
    let sink = written.clone();
    // The default format, no span events (no `FmtSpan::CLOSE`): what a user gets from
    // `tracing_subscriber::fmt()` with the crate's target at debug.
    let subscriber = tracing_subscriber::fmt()
        .with_env_filter("tower_idempotency=debug")
        .with_ansi(false)
        .with_writer(move || sink.clone())
        .finish();
    // Global, not scoped to this thread: a scoped subscriber loses events to the callsite
    // interest other tests' threads cache meanwhile. The other tests of this binary log into it
    // too, so the lines are picked by this test's key, which spans name by its digest.
    tracing::subscriber::set_global_default(subscriber).expect("the only subscriber of this binary");
    let mut service = ServiceBuilder::new()
        .layer(IdempotencyLayer::new(MemoryStore::new()))
        .service_fn(|_: Request<Body>| handler(Duration::ZERO));
    answer(&mut service, request(Some("fmt-key"), "{}")).await;
    answer(&mut service, request(Some("fmt-key"), "{}")).await;
    answer(&mut service, request(Some("fmt-key"), "[]")).await;
    let key = RecordKey::new(None, IdempotencyKey::parse("fmt-key").unwrap());
    let span = format!("idempotency{{key=\"{}\"", &key.digest_hex()[..16]);
    let log = String::from_utf8(written.0.lock().unwrap().clone()).unwrap();
    for outcome in ["executed", "replayed", "mismatch"] {
        let line = log.lines().find(|line| {
            line.contains(&span) && line.ends_with(&format!("idempotency outcome outcome={outcome}"))
        });
        assert!(line.is_some(), "no line names outcome={outcome}:\n{log}");
    }
}
