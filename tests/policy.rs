//! The policy file: the same policy in YAML, TOML and JSON (the files `examples/policy.rs`
//! ships) drives an axum router alike, each endpoint with its own settings under one layer on
//! the whole router; and a bad file is refused with the place and the field of the mistake.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::routing::{post, put};
use axum::{Extension, Router};
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use tower::ServiceExt;
use tower_idempotency::{IdempotencyLayer, MemoryStore, Policy, PolicyError, PolicyLayer, RecordKey, Scope};

const FORMATS: [&str; 3] = ["yaml", "toml", "json"];

fn example_file(format: &str) -> String {
    format!("{}/examples/idempotency.{format}", env!("CARGO_MANIFEST_DIR"))
}

/// Counts handler runs per route; answers what the payments handler found in its extensions.
fn app(policy: PolicyLayer, runs: Arc<AtomicUsize>) -> Router {
    let count = move |runs: Arc<AtomicUsize>| runs.fetch_add(1, Ordering::SeqCst) + 1;
    let (r1, r2, r3) = (runs.clone(), runs.clone(), runs.clone());
    Router::new()
        .route(
            "/payments",
            post(move |key: Option<Extension<RecordKey>>| async move {
                let n = count(r1);
                let seen = key.map(|Extension(k)| format!("{:?}/{}", k.scope(), k.key()));
                (StatusCode::CREATED, format!("payment {n} {seen:?}"))
            }),
        )
        .route(
            "/posts/{id}/comments",
            post(move || async move { (StatusCode::CREATED, format!("comment {}", count(r2))) }),
        )
        .route(
            "/uploads/{*rest}",
            put(move || async move { (StatusCode::CREATED, format!("upload {}", count(r3))) }),
        )
        .route("/health", post(|| async { "ok" }))
        .layer(policy)
}

#[derive(Debug, PartialEq)]
struct Answer {
    status: StatusCode,
    replayed: bool,
    body: String,
}

async fn send(app: &Router, method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> Answer {
    let mut request = Request::builder().method(method).uri(path);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let response = app
        .clone()
        .oneshot(request.body(Body::from(body.to_owned())).unwrap())
        .await
        .unwrap();
    Answer {
        status: response.status(),
        replayed: response.headers().contains_key("idempotent-replayed"),
        body: String::from_utf8(response.into_body().collect().await.unwrap().to_bytes().to_vec()).unwrap(),
    }
}

/// Drives the router through every setting the example policy varies, asserting each answer,
/// and returns the answers so that the three formats can be compared.
async fn scenario(policy: &Policy) -> Vec<Answer> {
    let base = IdempotencyLayer::new(MemoryStore::new());
    let layer = PolicyLayer::from_policy(base.clone(), policy).unwrap();
    let runs = Arc::new(AtomicUsize::new(0));
    let app = app(layer, runs.clone());
    let t1 = ("x-tenant-id", "t1");
    let json = ("content-type", "application/json");
    let mut answers = Vec::new();
    let mut check = |answer: Answer, status: StatusCode, replayed: bool, body: Option<&str>, what: &str| {
        assert_eq!(answer.status, status, "{what}: {answer:?}");
        assert_eq!(answer.replayed, replayed, "{what}: {answer:?}");
        if let Some(body) = body {
            assert_eq!(answer.body, body, "{what}");
        }
        answers.push(answer);
    };

    // /payments: key required; the handler sees its key and tenant; replayed on retry.
    let a = send(&app, "POST", "/payments", &[t1, json], "{}").await;
    check(a, StatusCode::BAD_REQUEST, false, None, "payments without a key");
    let a = send(
        &app,
        "POST",
        "/payments",
        &[t1, json, ("idempotency-key", "p1")],
        "{}",
    )
    .await;
    check(
        a,
        StatusCode::CREATED,
        false,
        Some("payment 1 Some(\"Some(\\\"t1\\\")/p1\")"),
        "first payment",
    );
    let a = send(
        &app,
        "POST",
        "/payments",
        &[t1, json, ("idempotency-key", "p1")],
        "{}",
    )
    .await;
    check(
        a,
        StatusCode::CREATED,
        true,
        Some("payment 1 Some(\"Some(\\\"t1\\\")/p1\")"),
        "payment retry",
    );
    // The body counts as JSON but for `/sent_at`: re-spaced, with a timestamp, the same request;
    // another member, another request.
    let a = send(
        &app,
        "POST",
        "/payments",
        &[t1, json, ("idempotency-key", "p1")],
        "{ \"sent_at\": \"10:00:05\" }",
    )
    .await;
    check(
        a,
        StatusCode::CREATED,
        true,
        Some("payment 1 Some(\"Some(\\\"t1\\\")/p1\")"),
        "payment retry, re-spaced, with a timestamp",
    );
    let a = send(
        &app,
        "POST",
        "/payments",
        &[t1, json, ("idempotency-key", "p1")],
        "{\"amount\": 1}",
    )
    .await;
    check(a, StatusCode::CONFLICT, false, None, "payment with another body");
    // Full Content-Type counts here: a charset makes it another request; 409 (the top's status).
    let charset = ("content-type", "application/json; charset=utf-8");
    let a = send(
        &app,
        "POST",
        "/payments",
        &[t1, charset, ("idempotency-key", "p1")],
        "{}",
    )
    .await;
    check(a, StatusCode::CONFLICT, false, None, "payment with a charset");
    // The same key from another tenant is another record.
    let a = send(
        &app,
        "POST",
        "/payments",
        &[("x-tenant-id", "t2"), json, ("idempotency-key", "p1")],
        "{}",
    )
    .await;
    check(
        a,
        StatusCode::CREATED,
        false,
        Some("payment 2 Some(\"Some(\\\"t2\\\")/p1\")"),
        "payment of t2",
    );
    // No tenant: refused, never run unscoped.
    let a = send(
        &app,
        "POST",
        "/payments",
        &[json, ("idempotency-key", "p9")],
        "{}",
    )
    .await;
    check(
        a,
        StatusCode::INTERNAL_SERVER_ERROR,
        false,
        None,
        "payment without a tenant",
    );

    // /posts/{id}/comments: key optional, media type only, 422 on a mismatch.
    let a = send(&app, "POST", "/posts/7/comments", &[t1, json], "{}").await;
    check(
        a,
        StatusCode::CREATED,
        false,
        Some("comment 3"),
        "comment without a key",
    );
    let a = send(
        &app,
        "POST",
        "/posts/7/comments",
        &[t1, json, ("idempotency-key", "c1")],
        "{}",
    )
    .await;
    check(a, StatusCode::CREATED, false, Some("comment 4"), "first comment");
    let a = send(
        &app,
        "POST",
        "/posts/7/comments",
        &[t1, charset, ("idempotency-key", "c1")],
        "{}",
    )
    .await;
    check(
        a,
        StatusCode::CREATED,
        true,
        Some("comment 4"),
        "comment retry with a charset",
    );
    let a = send(
        &app,
        "POST",
        "/posts/7/comments",
        &[t1, json, ("idempotency-key", "c1")],
        "{\"x\":1}",
    )
    .await;
    check(
        a,
        StatusCode::UNPROCESSABLE_ENTITY,
        false,
        None,
        "comment with another body",
    );
    let a = send(
        &app,
        "POST",
        "/posts/8/comments",
        &[t1, json, ("idempotency-key", "c1")],
        "{}",
    )
    .await;
    check(
        a,
        StatusCode::UNPROCESSABLE_ENTITY,
        false,
        None,
        "the key on another post",
    );
    // PATCH is covered there, GET is not.
    let a = send(
        &app,
        "PATCH",
        "/posts/7/comments",
        &[t1, json, ("idempotency-key", "")],
        "{}",
    )
    .await;
    check(
        a,
        StatusCode::BAD_REQUEST,
        false,
        None,
        "PATCH comment with an empty key",
    );

    // /uploads/*: the body does not count, Content-Digest does.
    let digest = ("content-digest", "sha-256=:abc=:");
    let a = send(
        &app,
        "PUT",
        "/uploads/a/b.bin",
        &[t1, digest, ("idempotency-key", "u1")],
        "chunk-1",
    )
    .await;
    check(a, StatusCode::CREATED, false, Some("upload 5"), "first upload");
    let a = send(
        &app,
        "PUT",
        "/uploads/a/b.bin",
        &[t1, digest, ("idempotency-key", "u1")],
        "chunk-2",
    )
    .await;
    check(
        a,
        StatusCode::CREATED,
        true,
        Some("upload 5"),
        "upload retry, another body",
    );
    let other = ("content-digest", "sha-256=:xyz=:");
    let a = send(
        &app,
        "PUT",
        "/uploads/a/b.bin",
        &[t1, other, ("idempotency-key", "u1")],
        "chunk-1",
    )
    .await;
    check(
        a,
        StatusCode::CONFLICT,
        false,
        None,
        "upload retry, another digest",
    );

    // Not listed: passes through, no key needed, nothing stored.
    let a = send(&app, "POST", "/health", &[], "").await;
    check(a, StatusCode::OK, false, Some("ok"), "unlisted path");
    assert_eq!(runs.load(Ordering::SeqCst), 5);

    // Retention per endpoint: 7 days for payments, 1 hour for comments.
    let payment = base.inspect(Some("t1"), "p1").await.unwrap().unwrap();
    let comment = base.inspect(Some("t1"), "c1").await.unwrap().unwrap();
    assert!(
        payment.expires_in > Duration::from_secs(6 * 86_400),
        "{payment:?}"
    );
    assert!(comment.expires_in <= Duration::from_secs(3_600), "{comment:?}");
    assert!(comment.expires_in > Duration::from_secs(3_500), "{comment:?}");
    answers
}

#[tokio::test]
async fn the_example_policy_in_every_format_drives_a_router_alike() {
    let mut results = Vec::new();
    for format in FORMATS {
        let policy = Policy::from_file(example_file(format)).unwrap_or_else(|e| panic!("{format}: {e}"));
        results.push((format, scenario(&policy).await));
    }
    let (first, expected) = &results[0];
    for (format, answers) in &results[1..] {
        assert_eq!(answers, expected, "{format} behaves unlike {first}");
    }
}

#[tokio::test]
async fn a_router_level_policy_sees_the_full_path_and_the_most_specific_endpoint_wins() {
    let policy = Policy::from_yaml_str(
        r#"
idempotency:
  endpoints:
    - path: /*
      method: POST
      required: false
    - path: /api/{version}/payments
      method: POST
      required: true
"#,
    )
    .unwrap();
    let layer = PolicyLayer::from_policy(IdempotencyLayer::new(MemoryStore::new()), &policy).unwrap();
    let app = Router::new()
        .nest(
            "/api/{version}",
            Router::new().route("/payments", post(|| async { "paid" })),
        )
        .route("/other", post(|| async { "other" }))
        .layer(layer);
    let a = send(&app, "POST", "/api/v1/payments", &[], "{}").await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST, "{a:?}");
    let a = send(&app, "POST", "/other", &[], "{}").await;
    assert_eq!(a.status, StatusCode::OK, "{a:?}");
}

/// `scope: host` and `scope: none` in a file, and an endpoint that names no scope keeping the
/// one set in code on the base layer.
#[tokio::test]
async fn file_scopes_and_the_scope_set_in_code() {
    let policy = Policy::from_yaml_str(
        "idempotency:\n  endpoints:\n    - { path: /by-host, method: POST, scope: host }\n    - { path: /unscoped, method: POST, scope: none }\n    - { path: /inherited, method: POST }\n",
    )
    .unwrap();
    let base = IdempotencyLayer::new(MemoryStore::new()).with_scope(Scope::header("x-tenant-id"));
    let runs = Arc::new(AtomicUsize::new(0));
    let handler = |runs: Arc<AtomicUsize>| {
        post(move || async move { format!("run {}", runs.fetch_add(1, Ordering::SeqCst) + 1) })
    };
    let app = Router::new()
        .route("/by-host", handler(runs.clone()))
        .route("/unscoped", handler(runs.clone()))
        .route("/inherited", handler(runs.clone()))
        .layer(PolicyLayer::from_policy(base, &policy).unwrap());
    let key = ("idempotency-key", "k");
    let replayed = |a: &Answer| a.replayed;
    // By host: another host is another scope, the same host spelled otherwise is not.
    let a = send(&app, "POST", "/by-host", &[key, ("host", "a.example.com")], "").await;
    let b = send(&app, "POST", "/by-host", &[key, ("host", "b.example.com")], "").await;
    let c = send(
        &app,
        "POST",
        "/by-host",
        &[key, ("host", "A.example.com:443")],
        "",
    )
    .await;
    assert!(
        !replayed(&a) && !replayed(&b) && replayed(&c),
        "{a:?} {b:?} {c:?}"
    );
    // Unscoped: the tenant header does not matter.
    let a = send(&app, "POST", "/unscoped", &[key, ("x-tenant-id", "t1")], "").await;
    let b = send(&app, "POST", "/unscoped", &[key, ("x-tenant-id", "t2")], "").await;
    assert!(!replayed(&a) && replayed(&b), "{a:?} {b:?}");
    // Inherited from code: per tenant, and refused without one.
    let a = send(&app, "POST", "/inherited", &[key, ("x-tenant-id", "t1")], "").await;
    let b = send(&app, "POST", "/inherited", &[key, ("x-tenant-id", "t2")], "").await;
    let c = send(&app, "POST", "/inherited", &[key], "").await;
    assert!(!replayed(&a) && !replayed(&b), "{a:?} {b:?}");
    assert_eq!(c.status, StatusCode::INTERNAL_SERVER_ERROR, "{c:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 5);
    // The same forms in TOML and JSON.
    Policy::from_toml_str(
        "[idempotency]\nscope = \"host\"\n[[idempotency.endpoints]]\npath = \"/p\"\nscope = \"none\"\n",
    )
    .unwrap();
    Policy::from_json_str(
        r#"{"idempotency": {"scope": "none", "endpoints": [{"path": "/p", "scope": {"header": "x-t"}}]}}"#,
    )
    .unwrap();
}

/// Every format reports a mistake with its line, column and field.
#[test]
fn a_bad_file_names_the_place_and_the_field() {
    let yaml = "idempotency:\n  endpoints:\n    - path: /payments\n      ttl_override: 24x\n";
    let toml = "[idempotency]\n[[idempotency.endpoints]]\npath = \"/payments\"\nttl_override = \"24x\"\n";
    let json =
        "{\"idempotency\": {\"endpoints\": [\n  {\"path\": \"/payments\",\n   \"ttl_override\": \"24x\"}]}}";
    for (format, error) in [
        ("yaml", Policy::from_yaml_str(yaml)),
        ("toml", Policy::from_toml_str(toml)),
        ("json", Policy::from_json_str(json)),
    ] {
        let error = error.unwrap_err();
        let PolicyError::Parse {
            field,
            line,
            column,
            message,
            ..
        } = &error
        else {
            panic!("{format}: {error:?}");
        };
        assert_eq!(
            field, "idempotency.endpoints[0].ttl_override",
            "{format}: {error}"
        );
        assert!(
            message.contains("invalid duration \"24x\": unknown unit \"x\""),
            "{format}: {error}"
        );
        let expected_line = match format {
            "json" => 3,
            _ => 4,
        };
        assert_eq!(*line, Some(expected_line), "{format}: {error}");
        assert!(column.is_some(), "{format}: {error}");
        assert!(!message.contains("line"), "the place is given once: {error}");
        println!("{format}: {error}");
    }
}

/// The mistakes docs/policy-file.md shows, made in the example file, are reported as it shows them.
#[test]
fn the_readme_error_examples_are_what_the_loader_says() {
    let example = std::fs::read_to_string(example_file("yaml")).unwrap();
    let dir = std::env::temp_dir().join(format!("policy-readme-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("idempotency.yaml");
    for (from, to, expected) in [
        (
            "ttl_override: 7d",
            "ttl_override: 24x",
            ":20:21: idempotency.endpoints[0].ttl_override: invalid duration \"24x\": unknown unit \"x\"; write a number then a unit (ms, s, m, h, d), as \"30s\", \"24h\" or \"1h30m\"",
        ),
        (
            "ttl_override: 7d",
            "ttl_overide: 7d",
            ":20:7: idempotency.endpoints[0].ttl_overide: unknown field `ttl_overide`, expected one of path, method, ttl_override, required, ",
        ),
    ] {
        std::fs::write(&path, example.replacen(from, to, 1)).unwrap();
        let error = Policy::from_file(&path).unwrap_err().to_string();
        assert!(error.starts_with(&format!("{}{expected}", path.display())), "{error}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn unknown_fields_and_bad_values_are_refused_by_name() {
    let cases = [
        (
            "  endpoints:\n    - path: /p\n      ttl_overide: 1h\n",
            "idempotency.endpoints[0]",
            "ttl_overide",
            3,
        ),
        (
            "  endpoints:\n    - path: /p\n      method: PSOT\n",
            "idempotency.endpoints[0].method",
            "unknown HTTP method \"PSOT\"",
            3,
        ),
        (
            "  mismatch_status: 42\n",
            "idempotency.mismatch_status",
            "invalid status 42",
            1,
        ),
        (
            "  mismatch_status: 200\n",
            "idempotency.mismatch_status",
            "status 200 cannot answer a refused request",
            1,
        ),
        (
            "  handler_timeout: 50ms\n",
            "idempotency.handler_timeout",
            "a handler timeout of 50ms is under 100ms",
            1,
        ),
        (
            "  endpoints:\n    - path: /files/*/x\n",
            "idempotency.endpoints[0].path",
            "must be the last segment",
            2,
        ),
        (
            "  scope: { heder: x-tenant-id }\n",
            "idempotency.scope",
            "heder",
            1,
        ),
        (
            "  body_limit: 1MB\n",
            "idempotency.body_limit",
            "unknown unit \"MB\"",
            1,
        ),
        (
            "  key_header: \"x tenant\"\n",
            "idempotency.key_header",
            "invalid header name",
            1,
        ),
        (
            "  fingerprint: { content_type: charset }\n",
            "idempotency.fingerprint.content_type",
            "charset",
            1,
        ),
        (
            "  fingerprint: { json_only: [amount] }\n",
            "idempotency.fingerprint",
            "\"amount\" is not a JSON Pointer (RFC 6901): it must be empty or start with `/`",
            1,
        ),
        (
            "  fingerprint: { json_only: [/amount], json_except: [/sent_at] }\n",
            "idempotency.fingerprint",
            "json_only and json_except cannot both be given",
            1,
        ),
        (
            "  fingerprint: { body: false, json_except: [/sent_at] }\n",
            "idempotency.fingerprint",
            "they need `body: json`",
            1,
        ),
        (
            "  fingerprint: { body: jsno }\n",
            "idempotency.fingerprint.body",
            "expected true, false or json",
            1,
        ),
    ];
    for (body, field, words, line) in cases {
        let yaml = format!("idempotency:\n{body}");
        let error = Policy::from_yaml_str(&yaml).unwrap_err();
        let text = error.to_string();
        assert!(text.contains(field) && text.contains(words), "{body:?}: {text}");
        let PolicyError::Parse { line: found, .. } = error else {
            panic!("{text}")
        };
        assert_eq!(found, Some(line + 1), "{body:?}: {text}");
    }
    // An unknown top-level section is refused too.
    let error = Policy::from_json_str("{\"idempotency\": {}, \"idempotence\": {}}").unwrap_err();
    assert!(error.to_string().contains("idempotence"), "{error}");
}

#[test]
fn an_endpoint_listed_twice_is_refused() {
    let policy = Policy::from_yaml_str(
        "idempotency:\n  endpoints:\n    - { path: '/posts/{id}', method: POST }\n    - { path: '/posts/:post', method: [PATCH, POST] }\n",
    )
    .unwrap();
    let error = PolicyLayer::from_policy(IdempotencyLayer::new(MemoryStore::new()), &policy).unwrap_err();
    assert!(matches!(error, PolicyError::Duplicate { .. }), "{error}");
    assert!(error.to_string().contains("/posts/:post"), "{error}");
}

#[test]
fn a_file_names_its_format_by_extension() {
    let error = Policy::from_file("policy.ini").unwrap_err();
    assert!(matches!(error, PolicyError::Format { .. }), "{error}");
    let error = Policy::from_file("/nonexistent/idempotency.yaml").unwrap_err();
    assert!(matches!(error, PolicyError::Io { .. }), "{error}");
    // A mistake in a file names the file.
    let dir = std::env::temp_dir().join(format!("policy-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("bad.json");
    std::fs::write(&path, "{\"idempotency\": {\"ttl\": 5}}").unwrap();
    let error = Policy::from_file(&path).unwrap_err().to_string();
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(error.starts_with(&format!("{}:1:", path.display())), "{error}");
    assert!(error.contains("idempotency.ttl"), "{error}");
}

/// Captures the warnings logged on this thread until the guard is dropped: each as its message
/// followed by its other fields, `name=value`.
fn capture_warnings() -> (
    tracing::subscriber::DefaultGuard,
    Arc<std::sync::Mutex<Vec<String>>>,
) {
    use tracing_subscriber::layer::SubscriberExt;

    struct Fields(String);
    impl tracing::field::Visit for Fields {
        fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
            if field.name() == "message" {
                self.0.insert_str(0, &format!("{value:?}"));
            } else {
                self.0.push_str(&format!(" {}={value:?}", field.name()));
            }
        }
        fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
            self.0.push_str(&format!(" {}={value}", field.name()));
        }
    }
    struct Capture(Arc<std::sync::Mutex<Vec<String>>>);
    impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Capture {
        fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
            if *event.metadata().level() == tracing::Level::WARN {
                let mut fields = Fields(String::new());
                event.record(&mut fields);
                self.0.lock().unwrap().push(fields.0);
            }
        }
    }
    let warnings = Arc::new(std::sync::Mutex::new(Vec::new()));
    let subscriber = tracing_subscriber::registry().with(Capture(warnings.clone()));
    (tracing::subscriber::set_default(subscriber), warnings)
}

fn taken(warnings: &std::sync::Mutex<Vec<String>>) -> Vec<String> {
    std::mem::take(&mut *warnings.lock().unwrap())
}

/// The routes a policy can miss: a trailing slash the pattern does not have, and a layer inside
/// a `nest`, which sees the path without the nest's prefix. A keyed request there passes
/// unprotected, but never silently: each path is logged once (and counted: tests/metrics.rs).
#[tokio::test]
async fn a_keyed_request_that_matches_no_endpoint_is_logged_once_per_path() {
    let (_guard, warnings) = capture_warnings();
    let policy = Policy::from_yaml_str(
        "idempotency:\n  endpoints:\n    - { path: /payments, method: POST }\n    - { path: /api/payments, method: POST }\n",
    )
    .unwrap();
    let layer = PolicyLayer::from_policy(IdempotencyLayer::new(MemoryStore::new()), &policy).unwrap();
    let runs = Arc::new(AtomicUsize::new(0));
    let handler = |runs: Arc<AtomicUsize>| {
        post(move || async move { format!("run {}", runs.fetch_add(1, Ordering::SeqCst) + 1) })
            .get(|| async { "read" })
    };
    let app = Router::new()
        .route("/payments", handler(runs.clone()))
        .route("/payments/", handler(runs.clone()))
        .nest(
            "/api",
            Router::new()
                .route("/payments", handler(runs.clone()))
                .layer(layer.clone()),
        )
        .layer(layer);
    let key = |k| ("idempotency-key", k);
    assert!(taken(&warnings).is_empty());

    // Matched: protected, nothing logged.
    let a = send(&app, "POST", "/payments", &[key("k1")], "{}").await;
    assert_eq!((a.status, a.body.as_str()), (StatusCode::OK, "run 1"));
    assert!(taken(&warnings).is_empty());

    // A trailing slash: passes unprotected (a retry runs again), logged the first time only.
    for (k, run) in [("k2", "run 2"), ("k2", "run 3"), ("k3", "run 4")] {
        let a = send(&app, "POST", "/payments/", &[key(k)], "{}").await;
        assert_eq!(
            (a.status, a.replayed, a.body.as_str()),
            (StatusCode::OK, false, run)
        );
    }
    let logged = taken(&warnings);
    assert_eq!(logged.len(), 1, "{logged:?}");
    assert!(
        logged[0].contains("matches no endpoint")
            && logged[0].contains("passed through unprotected")
            && logged[0].contains("path=/payments/")
            && logged[0].contains("method=POST"),
        "{logged:?}"
    );
    // No key, or a safe method: the request asked for no protection; nothing logged.
    send(&app, "POST", "/payments/", &[], "{}").await;
    let a = send(&app, "GET", "/payments/", &[key("k4")], "").await;
    assert_eq!(a.body, "read");
    assert!(taken(&warnings).is_empty());

    // Inside a nest: the layer sees `/payments`, not `/api/payments`. The outer layer matched
    // `/api/payments` here, so the request is protected and the inner one does not count it...
    let a = send(&app, "POST", "/api/payments", &[key("k5")], "{}").await;
    assert_eq!(a.status, StatusCode::OK);
    let b = send(&app, "POST", "/api/payments", &[key("k5")], "{}").await;
    assert!(b.replayed, "{b:?}");
    assert!(taken(&warnings).is_empty());
    // ...but a nested router with the policy alone runs it unprotected, and says so.
    let api_only =
        Policy::from_yaml_str("idempotency:\n  endpoints:\n    - { path: /api/payments, method: POST }\n")
            .unwrap();
    let only_nested = PolicyLayer::from_policy(IdempotencyLayer::new(MemoryStore::new()), &api_only).unwrap();
    let nested = Router::new().nest(
        "/api",
        Router::new()
            .route("/payments", handler(runs.clone()))
            .layer(only_nested),
    );
    for _ in 0..2 {
        let a = send(&nested, "POST", "/api/payments", &[key("k6")], "{}").await;
        assert!(!a.replayed, "{a:?}");
    }
    let logged = taken(&warnings);
    assert_eq!(logged.len(), 1, "{logged:?}");
    assert!(
        logged[0].ends_with("path=/payments"),
        "the path the layer saw: {logged:?}"
    );
}

/// `refuse_unmatched`: a request with the configured key header that matches no endpoint is
/// refused with a problem document of its own type, and nothing runs; without a key, or with
/// a header that is not the key's, it passes.
#[tokio::test]
async fn refuse_unmatched_refuses_a_keyed_request_no_endpoint_matches() {
    let policy = Policy::from_yaml_str(
        "idempotency:\n  refuse_unmatched: true\n  key_header: x-request-key\n  endpoints:\n    - { path: /payments, method: POST }\n",
    )
    .unwrap();
    let layer = PolicyLayer::from_policy(IdempotencyLayer::new(MemoryStore::new()), &policy).unwrap();
    let runs = Arc::new(AtomicUsize::new(0));
    let handler = |runs: Arc<AtomicUsize>| {
        post(move || async move { format!("run {}", runs.fetch_add(1, Ordering::SeqCst) + 1) })
            .get(|| async { "read" })
    };
    let app = Router::new()
        .route("/payments", handler(runs.clone()))
        .route("/payments/", handler(runs.clone()))
        .layer(layer);
    let request = Request::post("/payments/")
        .header("x-request-key", "k1")
        .body(Body::from("{}"))
        .unwrap();
    let response = app.clone().oneshot(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::NOT_IMPLEMENTED);
    assert_eq!(response.headers()["content-type"], "application/problem+json");
    assert_eq!(
        response.extensions().get::<tower_idempotency::Rejection>(),
        Some(&tower_idempotency::Rejection::NoEndpoint)
    );
    let body = response.into_body().collect().await.unwrap().to_bytes();
    let problem: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(
        problem["type"],
        "https://docs.rs/tower-idempotency/latest/tower_idempotency/enum.Rejection.html#variant.NoEndpoint"
    );
    assert_eq!(problem["status"], 501);
    assert!(
        problem["detail"].as_str().unwrap().contains("x-request-key"),
        "{problem}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 0, "nothing ran");

    // Matched: protected as usual.
    let a = send(&app, "POST", "/payments", &[("x-request-key", "k1")], "{}").await;
    let b = send(&app, "POST", "/payments", &[("x-request-key", "k1")], "{}").await;
    assert_eq!((a.status, b.replayed), (StatusCode::OK, true), "{a:?} {b:?}");
    // Unmatched but asking for no protection: no key, another header, a safe method.
    let a = send(&app, "POST", "/payments/", &[], "{}").await;
    assert_eq!(a.body, "run 2");
    let a = send(&app, "POST", "/payments/", &[("idempotency-key", "k2")], "{}").await;
    assert_eq!(a.body, "run 3", "not this layer's key header");
    let a = send(&app, "GET", "/payments/", &[("x-request-key", "k3")], "").await;
    assert_eq!(a.body, "read");
}

/// `ignore_trailing_slash`: `/payments/` gets the endpoint `/payments` (and `/files` the
/// endpoint `/files/*`), and is not logged as unmatched; a pattern that matches as sent wins.
#[tokio::test]
async fn ignore_trailing_slash_matches_a_path_with_or_without_one() {
    let (_guard, warnings) = capture_warnings();
    let policy = Policy::from_yaml_str(
        "idempotency:\n  ignore_trailing_slash: true\n  endpoints:\n    - { path: /payments, method: POST }\n    - { path: '/files/*', method: PUT }\n",
    )
    .unwrap();
    let layer = PolicyLayer::from_policy(IdempotencyLayer::new(MemoryStore::new()), &policy).unwrap();
    let runs = Arc::new(AtomicUsize::new(0));
    let count = |runs: Arc<AtomicUsize>| {
        move || async move { format!("run {}", runs.fetch_add(1, Ordering::SeqCst) + 1) }
    };
    let app = Router::new()
        .route("/payments/", post(count(runs.clone())))
        .route("/files", put(count(runs.clone())))
        .layer(layer);
    let a = send(&app, "POST", "/payments/", &[], "{}").await;
    assert_eq!(
        a.status,
        StatusCode::BAD_REQUEST,
        "the key is required there: {a:?}"
    );
    let a = send(&app, "POST", "/payments/", &[("idempotency-key", "p1")], "{}").await;
    let b = send(&app, "POST", "/payments/", &[("idempotency-key", "p1")], "{}").await;
    assert_eq!(
        (a.body.as_str(), b.body.as_str(), b.replayed),
        ("run 1", "run 1", true)
    );
    let a = send(&app, "PUT", "/files", &[("idempotency-key", "f1")], "").await;
    let b = send(&app, "PUT", "/files", &[("idempotency-key", "f1")], "").await;
    assert_eq!((a.body.as_str(), b.replayed), ("run 2", true));
    assert!(taken(&warnings).is_empty());

    // Both spellings listed, with different settings: each gets its own.
    let layer = PolicyLayer::new(IdempotencyLayer::new(MemoryStore::new()))
        .with_ignore_trailing_slash(true)
        .endpoint([http::Method::POST], "/a", |layer| layer)
        .unwrap()
        .endpoint([http::Method::POST], "/a/", |layer| {
            layer.with_key_required(false)
        })
        .unwrap();
    let app = Router::new()
        .route("/a", post(|| async { "a" }))
        .route("/a/", post(|| async { "a/" }))
        .layer(layer);
    assert_eq!(
        send(&app, "POST", "/a", &[], "").await.status,
        StatusCode::BAD_REQUEST
    );
    assert_eq!(send(&app, "POST", "/a/", &[], "").await.status, StatusCode::OK);

    // Off (the default), `/payments/` matches nothing.
    let policy =
        Policy::from_yaml_str("idempotency:\n  endpoints:\n    - { path: /payments, method: POST }\n")
            .unwrap();
    let layer = PolicyLayer::from_policy(IdempotencyLayer::new(MemoryStore::new()), &policy).unwrap();
    let app = Router::new()
        .route("/payments/", post(|| async { "ok" }))
        .layer(layer);
    assert_eq!(
        send(&app, "POST", "/payments/", &[], "{}").await.status,
        StatusCode::OK
    );
}

/// A scope in the file that replaces the one set in code is a warning at load; a file that
/// leaves the code's scope alone, or a base without one, loads quietly.
#[test]
fn a_file_scope_replacing_the_code_scope_is_warned_about_at_load() {
    let (_guard, warnings) = capture_warnings();
    let scoped = || IdempotencyLayer::new(MemoryStore::new()).with_scope(Scope::header("x-tenant-id"));
    let load = |yaml: &str, base: IdempotencyLayer| {
        PolicyLayer::from_policy(base, &Policy::from_yaml_str(yaml).unwrap()).unwrap();
    };

    load(
        "idempotency:\n  scope: none\n  endpoints:\n    - { path: /a, scope: host }\n",
        scoped(),
    );
    let logged = taken(&warnings);
    assert_eq!(logged.len(), 1, "the top level's, once: {logged:?}");
    assert!(
        logged[0].contains("replaces the scope set in code")
            && logged[0].contains("share one namespace")
            && logged[0].contains("field=idempotency.scope"),
        "{logged:?}"
    );

    load(
        "idempotency:\n  endpoints:\n    - { path: /a }\n    - { path: /b, scope: host }\n    - { path: /c, scope: { header: x-user } }\n",
        scoped(),
    );
    let logged = taken(&warnings);
    assert_eq!(logged.len(), 2, "{logged:?}");
    assert!(
        logged[0].contains("endpoint /b") && logged[0].contains("idempotency.endpoints[1].scope"),
        "{logged:?}"
    );
    assert!(logged[1].contains("`header: x-user`"), "{logged:?}");

    load("idempotency:\n  endpoints:\n    - { path: /a }\n", scoped());
    load(
        "idempotency:\n  scope: host\n  endpoints:\n    - { path: /a, scope: none }\n",
        IdempotencyLayer::new(MemoryStore::new()),
    );
    assert!(taken(&warnings).is_empty());
}
