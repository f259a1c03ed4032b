//! Scopes from the `Scope` helpers, the key handed to the handler, and each fingerprint option:
//! a difference in a part that does not count replays, one in a counted part is a mismatch; and
//! the default fingerprint is the one earlier releases stored.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::body::Body;
use axum::routing::post;
use axum::{Extension, Router};
use http::{HeaderName, Request, StatusCode};
use http_body_util::BodyExt;
use tower::ServiceExt;
use tower_idempotency::{
    Begin, Coordinator, Fingerprint, FingerprintPolicy, IdempotencyKey, IdempotencyLayer, JsonPointer,
    MemoryStore, RecordKey, Rejection, Scope,
};

#[derive(Debug)]
struct Answer {
    status: StatusCode,
    replayed: bool,
    rejection: Option<&'static str>,
    body: String,
}

/// A router whose one handler counts its runs and echoes the `RecordKey` it finds.
fn app(layer: IdempotencyLayer) -> (Router, Arc<AtomicUsize>) {
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = runs.clone();
    let router = Router::new()
        .route(
            "/payments",
            post(move |key: Option<Extension<RecordKey>>| async move {
                let n = counted.fetch_add(1, Ordering::SeqCst) + 1;
                let seen = key.map(|Extension(k)| {
                    format!("{}|{}|{}", k.scope().unwrap_or("-"), k.key(), k.digest_hex())
                });
                (
                    StatusCode::CREATED,
                    format!("run {n} {}", seen.unwrap_or_default()),
                )
            }),
        )
        .layer(layer);
    (router, runs)
}

async fn send(app: &Router, uri: &str, headers: &[(&str, &str)], body: &str) -> Answer {
    let mut request = Request::post(uri).header("idempotency-key", "k1");
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let response = app
        .clone()
        .oneshot(request.body(Body::from(body.to_owned())).unwrap())
        .await
        .unwrap();
    let rejection = response.extensions().get::<Rejection>().map(|r| match r {
        Rejection::Mismatch { .. } => "Mismatch",
        Rejection::PolicyMismatch { .. } => "PolicyMismatch",
        Rejection::InFlight { .. } => "InFlight",
        Rejection::MissingScope => "MissingScope",
        _ => "other",
    });
    Answer {
        status: response.status(),
        replayed: response.headers().contains_key("idempotent-replayed"),
        rejection,
        body: String::from_utf8(response.into_body().collect().await.unwrap().to_bytes().to_vec()).unwrap(),
    }
}

#[tokio::test]
async fn scope_header_keeps_tenants_apart_and_refuses_a_request_without_one() {
    let (app, runs) = app(IdempotencyLayer::new(MemoryStore::new()).with_scope(Scope::header("x-tenant-id")));
    let first = send(&app, "/payments", &[("x-tenant-id", "t1")], "{}").await;
    let retry = send(&app, "/payments", &[("x-tenant-id", "t1")], "{}").await;
    let other = send(&app, "/payments", &[("x-tenant-id", "t2")], "{}").await;
    let none = send(&app, "/payments", &[], "{}").await;
    assert!(
        !first.replayed && retry.replayed && !other.replayed,
        "{first:?} {retry:?} {other:?}"
    );
    assert_eq!(retry.body, first.body);
    assert_eq!(none.rejection, Some("MissingScope"), "{none:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn scope_host_is_the_normalised_host() {
    let (app, runs) = app(IdempotencyLayer::new(MemoryStore::new()).with_scope(Scope::host()));
    let first = send(&app, "/payments", &[("host", "acme.example.com")], "{}").await;
    let spelled = send(&app, "/payments", &[("host", "ACME.example.com.:443")], "{}").await;
    let other = send(&app, "/payments", &[("host", "globex.example.com")], "{}").await;
    let port = send(&app, "/payments", &[("host", "acme.example.com:8443")], "{}").await;
    assert!(!first.replayed && spelled.replayed, "{first:?} {spelled:?}");
    assert!(!other.replayed && !port.replayed, "{other:?} {port:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 3);
}

#[derive(Clone)]
struct Tenant(String);

/// An authentication middleware's stand-in: the tenant from a bearer token.
async fn authenticate(
    mut request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let tenant = request
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(|token| Tenant(format!("tenant-of-{token}")));
    if let Some(tenant) = tenant {
        request.extensions_mut().insert(tenant);
    }
    next.run(request).await
}

#[tokio::test]
async fn scope_extension_reads_what_authentication_left_and_the_handler_reads_its_key() {
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .with_scope(Scope::extension::<Tenant>(|tenant| tenant.0.clone()))
        .with_key_in_extensions(true);
    let (app, runs) = app(layer);
    // Authentication runs first (outermost), then the idempotency layer.
    let app = app.layer(axum::middleware::from_fn(authenticate));
    let alice = send(&app, "/payments", &[("authorization", "Bearer a")], "{}").await;
    let expected = RecordKey::new(Some("tenant-of-a"), IdempotencyKey::parse("k1").unwrap());
    assert_eq!(
        alice.body,
        format!("run 1 tenant-of-a|k1|{}", expected.digest_hex())
    );
    let bob = send(&app, "/payments", &[("authorization", "Bearer b")], "{}").await;
    assert!(bob.body.starts_with("run 2 tenant-of-b|k1|"), "{bob:?}");
    let anonymous = send(&app, "/payments", &[], "{}").await;
    assert_eq!(anonymous.rejection, Some("MissingScope"));
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn the_key_is_not_in_the_extensions_unless_asked_for() {
    let (app, _) = app(IdempotencyLayer::new(MemoryStore::new()));
    let answer = send(&app, "/payments", &[], "{}").await;
    assert_eq!(answer.body, "run 1 ");
}

/// For one fingerprint policy: the first request, then a retry differing only in a part that
/// does not count (replayed), then one differing in a part that counts (mismatch).
async fn check_policy(
    policy: FingerprintPolicy,
    first: (&str, &[(&str, &str)], &str),
    ignored: (&str, &[(&str, &str)], &str),
    counted: (&str, &[(&str, &str)], &str),
) {
    let what = format!("{policy:?}");
    let (app, runs) = app(IdempotencyLayer::new(MemoryStore::new()).with_fingerprint(policy));
    let a = send(&app, first.0, first.1, first.2).await;
    assert_eq!(a.status, StatusCode::CREATED, "{what}: {a:?}");
    let b = send(&app, ignored.0, ignored.1, ignored.2).await;
    assert!(
        b.replayed,
        "{what}: a difference that does not count must replay: {b:?}"
    );
    assert_eq!(b.body, a.body, "{what}");
    let c = send(&app, counted.0, counted.1, counted.2).await;
    assert_eq!(
        c.rejection,
        Some("Mismatch"),
        "{what}: a difference that counts must mismatch: {c:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1, "{what}");
}

#[tokio::test]
async fn each_fingerprint_option_counts_what_it_says() {
    let json = ("content-type", "application/json");
    let json_utf8 = ("content-type", "Application/JSON; charset=utf-8");
    let text = ("content-type", "text/plain");
    // The default: all of Content-Type counts, as sent.
    let (app, _) = app(IdempotencyLayer::new(MemoryStore::new()));
    send(&app, "/payments", &[json], "{}").await;
    let charset = send(&app, "/payments", &[json_utf8], "{}").await;
    assert_eq!(charset.rejection, Some("Mismatch"), "{charset:?}");

    check_policy(
        FingerprintPolicy::new().media_type_only(),
        ("/payments", &[json], "{}"),
        ("/payments", &[json_utf8], "{}"),
        ("/payments", &[text], "{}"),
    )
    .await;
    check_policy(
        FingerprintPolicy::new().without_content_type(),
        ("/payments", &[json], "{}"),
        ("/payments", &[text], "{}"),
        ("/payments", &[json], "{\"a\":1}"),
    )
    .await;
    check_policy(
        FingerprintPolicy::new().with_header(HeaderName::from_static("x-account-id")),
        ("/payments", &[("x-account-id", "1"), ("x-trace", "a")], "{}"),
        ("/payments", &[("x-account-id", "1"), ("x-trace", "b")], "{}"),
        ("/payments", &[("x-account-id", "2"), ("x-trace", "a")], "{}"),
    )
    .await;
    check_policy(
        FingerprintPolicy::new().with_header(HeaderName::from_static("x-account-id")),
        ("/payments", &[("x-account-id", "1")], "{}"),
        ("/payments", &[("x-account-id", "1")], "{}"),
        ("/payments", &[], "{}"),
    )
    .await;
    check_policy(
        FingerprintPolicy::new().without_body(),
        ("/payments", &[json], "{\"signed_at\":1}"),
        ("/payments", &[json], "{\"signed_at\":2}"),
        ("/payments?amount=2", &[json], "{\"signed_at\":1}"),
    )
    .await;
}

/// The issue's newcomer: `{"amount":42}` and `{"amount": 42}` under one key are one request
/// when the body counts as JSON, and members chosen or left out count as they say.
#[tokio::test]
async fn json_fingerprints_count_the_meaning_and_the_chosen_members() {
    let json = ("content-type", "application/json");
    let pointer = |p: &str| JsonPointer::parse(p).unwrap();
    check_policy(
        FingerprintPolicy::new().json_body(),
        ("/payments", &[json], r#"{"amount":42,"currency":"EUR"}"#),
        (
            "/payments",
            &[json],
            "{ \"currency\": \"\\u0045UR\",\n  \"amount\": 42.0 }",
        ),
        ("/payments", &[json], r#"{"amount":43,"currency":"EUR"}"#),
    )
    .await;
    check_policy(
        FingerprintPolicy::new().json_body_except([pointer("/sent_at")]),
        ("/payments", &[json], r#"{"amount":42,"sent_at":"10:00:00"}"#),
        ("/payments", &[json], r#"{"sent_at":"10:00:05","amount":42}"#),
        (
            "/payments",
            &[json],
            r#"{"amount":42,"sent_at":"10:00:00","memo":"x"}"#,
        ),
    )
    .await;
    check_policy(
        FingerprintPolicy::new().json_body_only([pointer("/amount"), pointer("/to/iban")]),
        (
            "/payments",
            &[json],
            r#"{"amount":42,"to":{"iban":"DE1","name":"A"},"trace":1}"#,
        ),
        (
            "/payments",
            &[json],
            r#"{"to":{"name":"B","iban":"DE1"},"amount":4.2e1,"trace":2}"#,
        ),
        (
            "/payments",
            &[json],
            r#"{"amount":42,"to":{"iban":"DE2","name":"A"},"trace":1}"#,
        ),
    )
    .await;
    // Not JSON by its Content-Type: the bytes count, so a re-spaced body is another request.
    check_policy(
        FingerprintPolicy::new().json_body(),
        ("/payments", &[("content-type", "text/plain")], r#"{"amount":42}"#),
        ("/payments", &[("content-type", "text/plain")], r#"{"amount":42}"#),
        (
            "/payments",
            &[("content-type", "text/plain")],
            r#"{"amount": 42}"#,
        ),
    )
    .await;
}

/// Instances of one fleet in the middle of a deploy that changes the fingerprint policy share a
/// store: a record stored under one policy, read under another, is a mismatch (the policy is in
/// the fingerprint), never a replay of a response to what may be another request, and never a
/// second run.
#[tokio::test]
async fn a_record_stored_under_one_policy_is_a_mismatch_under_another() {
    let json = ("content-type", "application/json");
    let pointer = |p: &str| JsonPointer::parse(p).unwrap();
    let policies = [
        FingerprintPolicy::new(),
        FingerprintPolicy::new().json_body(),
        FingerprintPolicy::new().json_body_except([pointer("/sent_at")]),
        FingerprintPolicy::new().json_body_only([pointer("/amount")]),
    ];
    for (i, stored_under) in policies.iter().enumerate() {
        for (j, read_under) in policies.iter().enumerate() {
            let store = MemoryStore::new();
            let (old, old_runs) =
                app(IdempotencyLayer::new(store.clone()).with_fingerprint(stored_under.clone()));
            let (new, new_runs) = app(IdempotencyLayer::new(store).with_fingerprint(read_under.clone()));
            let body = r#"{"amount":42,"sent_at":1}"#;
            let first = send(&old, "/payments", &[json], body).await;
            assert_eq!(first.status, StatusCode::CREATED);
            let retry = send(&new, "/payments", &[json], body).await;
            if i == j {
                assert!(retry.replayed, "{read_under:?}: {retry:?}");
            } else {
                assert_eq!(
                    retry.rejection,
                    Some("PolicyMismatch"),
                    "stored under {stored_under:?}, read under {read_under:?}: {retry:?}"
                );
            }
            assert_eq!(
                old_runs.load(Ordering::SeqCst) + new_runs.load(Ordering::SeqCst),
                1
            );
        }
    }
}

/// A record claimed with the fingerprint earlier releases computed (the five parts, in order,
/// by `Fingerprint::new`) is this release's default fingerprint: a retry finds it in flight,
/// not a mismatch. (The unit test in `src/http/fingerprint.rs` pins the digest itself.)
#[tokio::test]
async fn records_of_earlier_releases_match_the_default_fingerprint() {
    let coordinator = Coordinator::new(MemoryStore::new());
    let key = RecordKey::new(None, IdempotencyKey::parse("k1").unwrap());
    let earlier = Fingerprint::new([
        b"POST".as_slice(),
        b"api.example.com",
        b"/payments?x=1",
        b"application/json; charset=utf-8",
        b"{\"amount\":42}",
    ]);
    let Begin::Claimed(_claim) = coordinator.begin(&key, &earlier).await.unwrap() else {
        panic!("a fresh key is claimed");
    };
    let (app, runs) = app(IdempotencyLayer::from_coordinator(coordinator));
    let headers = [
        ("host", "API.example.com:443"),
        ("content-type", "application/json; charset=utf-8"),
    ];
    let same = send(&app, "/payments?x=1", &headers, "{\"amount\":42}").await;
    assert_eq!(same.rejection, Some("InFlight"), "{same:?}");
    let other = send(&app, "/payments?x=2", &headers, "{\"amount\":42}").await;
    assert_eq!(other.rejection, Some("Mismatch"), "{other:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 0);
}
