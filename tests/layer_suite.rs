//! The behaviour table of README, row by row, against every store.

mod common;

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use bytes::Bytes;
use common::app::{payment, payment_with, post, router, send};
use common::Backend;
use http::{Request, StatusCode};
use tower_idempotency::{IdempotencyLayer, NotStored, Rejection};

fn layer(b: &Backend) -> IdempotencyLayer {
    IdempotencyLayer::new(b.store.clone())
}

fn assert_problem(answer: &common::app::Answer, status: StatusCode, kind: &str) {
    assert_eq!(answer.status, status, "body: {:?}", answer.body);
    assert_eq!(answer.headers["content-type"], "application/problem+json");
    let json: serde_json::Value = serde_json::from_slice(&answer.body).unwrap();
    assert!(
        json["type"]
            .as_str()
            .unwrap()
            .ends_with(&format!("#variant.{kind}")),
        "{json}"
    );
    assert_eq!(json["status"], status.as_u16());
    assert!(!json["title"].as_str().unwrap().is_empty());
    assert!(!json["detail"].as_str().unwrap().is_empty());
    assert!(
        answer.extensions.get::<Rejection>().is_some(),
        "the typed reason is in the extensions"
    );
}

// Row 1
async fn uncovered_methods_pass_through(b: Backend) {
    let (app, runs) = router(layer(&b));
    for method in ["GET", "PUT"] {
        for _ in 0..2 {
            let request = Request::builder()
                .method(method)
                .uri("/payments")
                .header("idempotency-key", "k");
            let answer = send(&app, request.body(Body::empty()).unwrap()).await;
            assert_eq!(answer.status, StatusCode::CREATED);
            assert!(!answer.is_replay());
        }
    }
    assert_eq!(runs.get(), 4);
    // Covered methods are configurable.
    let (app, runs) = router(layer(&b).with_methods([http::Method::PUT]));
    for _ in 0..2 {
        let request = Request::put("/payments")
            .header("idempotency-key", "put-key")
            .body(Body::empty())
            .unwrap();
        send(&app, request).await;
    }
    assert_eq!(runs.get(), 1, "PUT is covered now");
}

// Rows 2 and 3
async fn a_missing_key_passes_when_optional_and_is_refused_when_required(b: Backend) {
    let (app, runs) = router(layer(&b).with_key_required(false));
    let first = send(&app, post(None).body(Body::from("{}")).unwrap()).await;
    let second = send(&app, post(None).body(Body::from("{}")).unwrap()).await;
    assert_eq!(
        (first.status, second.status),
        (StatusCode::CREATED, StatusCode::CREATED)
    );
    assert!(!second.is_replay());
    assert_eq!(runs.get(), 2, "keyless requests are never replayed");
    if let Some(memory) = &b.memory {
        assert!(memory.is_empty(), "nothing stored");
    }

    let (app, runs) = router(layer(&b));
    let answer = send(&app, post(None).body(Body::from("{}")).unwrap()).await;
    assert_problem(&answer, StatusCode::BAD_REQUEST, "MissingKey");
    assert_eq!(runs.get(), 0);
}

// Row 4
async fn invalid_keys_are_refused(b: Backend) {
    let (app, runs) = router(layer(&b));
    let long = "k".repeat(256);
    for key in ["", long.as_str(), "has space", "tab\there", "\"unterminated"] {
        let answer = send(
            &app,
            post(None)
                .header("idempotency-key", key)
                .body(Body::empty())
                .unwrap(),
        )
        .await;
        assert_problem(&answer, StatusCode::BAD_REQUEST, "InvalidKey");
    }
    let non_ascii = http::HeaderValue::from_bytes(b"caf\xe9").unwrap();
    let answer = send(
        &app,
        post(None)
            .header("idempotency-key", non_ascii)
            .body(Body::empty())
            .unwrap(),
    )
    .await;
    assert_problem(&answer, StatusCode::BAD_REQUEST, "InvalidKey");
    let repeated = post(Some("one"))
        .header("idempotency-key", "two")
        .body(Body::empty())
        .unwrap();
    assert_problem(&send(&app, repeated).await, StatusCode::BAD_REQUEST, "InvalidKey");
    assert_eq!(runs.get(), 0);
    // The longest valid key is accepted.
    let answer = send(&app, payment(&"k".repeat(255), "{}")).await;
    assert_eq!(answer.status, StatusCode::CREATED);
}

// Rows 3 and 8 with another header
async fn the_key_header_is_configurable(b: Backend) {
    let (app, runs) = router(layer(&b).with_key_header(http::HeaderName::from_static("x-request-key")));
    let request = || {
        post(None)
            .header("x-request-key", "custom")
            .body(Body::from("{}"))
            .unwrap()
    };
    send(&app, request()).await;
    assert!(send(&app, request()).await.is_replay());
    let ignored = send(&app, payment("idempotency-key-is-not-read-now", "{}")).await;
    assert_problem(&ignored, StatusCode::BAD_REQUEST, "MissingKey");
    let detail = |answer: &common::app::Answer| {
        let json: serde_json::Value = serde_json::from_slice(&answer.body).unwrap();
        json["detail"].as_str().unwrap().to_owned()
    };
    assert!(detail(&ignored).contains("x-request-key"), "{}", detail(&ignored));
    let invalid = send(
        &app,
        post(None)
            .header("x-request-key", "")
            .body(Body::from("{}"))
            .unwrap(),
    )
    .await;
    assert_problem(&invalid, StatusCode::BAD_REQUEST, "InvalidKey");
    assert!(
        detail(&invalid).starts_with("x-request-key: "),
        "{}",
        detail(&invalid)
    );
    assert_eq!(runs.get(), 1);
}

// Row 5
async fn the_structured_field_form_is_the_same_key(b: Backend) {
    let (app, runs) = router(layer(&b));
    let first = send(&app, payment("\"sf-key\"", "{}")).await;
    let retry = send(&app, payment("sf-key", "{}")).await;
    assert_eq!(runs.get(), 1);
    assert!(retry.is_replay());
    assert_eq!(first.body, retry.body);
}

// Row 6
async fn bodies_over_the_limit_are_refused_and_claim_nothing(b: Backend) {
    let (app, runs) = router(layer(&b).with_body_limit(16));
    // Judged by Content-Length before reading.
    let declared = send(&app, payment("big", &"x".repeat(17))).await;
    assert_problem(&declared, StatusCode::PAYLOAD_TOO_LARGE, "BodyTooLarge");
    // A streamed body with no Content-Length is read only up to the limit.
    let chunks = futures_util::stream::iter(
        (0..100).map(|_| Ok::<_, std::io::Error>(Bytes::from_static(b"0123456789"))),
    );
    let streamed = post(Some("big")).body(Body::from_stream(chunks)).unwrap();
    assert_problem(
        &send(&app, streamed).await,
        StatusCode::PAYLOAD_TOO_LARGE,
        "BodyTooLarge",
    );
    assert_eq!(runs.get(), 0);
    // Nothing was claimed: the same key with a small body runs.
    let small = send(&app, payment("big", "{}")).await;
    assert_eq!(small.status, StatusCode::CREATED);
    // Exactly at the limit is accepted.
    let exact = send(&app, payment("exact", &"x".repeat(16))).await;
    assert_eq!(exact.status, StatusCode::CREATED);
}

// A client that disconnects mid-upload: a clear answer, nothing claimed, no panic.
async fn a_body_that_fails_mid_upload_is_refused_and_claims_nothing(b: Backend) {
    let (app, runs) = router(layer(&b));
    let chunks = futures_util::stream::iter([
        Ok(Bytes::from_static(b"{\"amount\":")),
        Err(std::io::Error::new(
            std::io::ErrorKind::ConnectionReset,
            "client went away",
        )),
    ]);
    let broken = post(Some("broken")).body(Body::from_stream(chunks)).unwrap();
    let answer = send(&app, broken).await;
    assert_problem(&answer, StatusCode::BAD_REQUEST, "BodyUnreadable");
    assert_eq!(runs.get(), 0);
    let retry = send(&app, payment("broken", "{}")).await;
    assert_eq!((retry.status, retry.is_replay()), (StatusCode::CREATED, false));
}

// Rows 7, 8 and 16
async fn the_first_response_is_unchanged_and_retries_replay_it_byte_for_byte(b: Backend) {
    let (app, runs) = router(layer(&b));
    let first = send(&app, payment("pay-1", "{\"amount\":10}")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(!first.is_replay());
    assert_eq!(
        first.headers["set-cookie"], "session=secret",
        "the first response is unchanged"
    );
    assert_eq!(first.body, "run 1; echo {\"amount\":10}");

    for _ in 0..3 {
        let retry = send(&app, payment("pay-1", "{\"amount\":10}")).await;
        assert_eq!(runs.get(), 1, "the handler runs once");
        assert!(retry.is_replay());
        assert_eq!(retry.status, first.status);
        assert_eq!(retry.body, first.body);
        assert_eq!(retry.headers["content-type"], "application/json; charset=utf-8");
        let multi: Vec<_> = retry.headers.get_all("x-multi").iter().collect();
        assert_eq!(multi, ["first", "second"]);
        assert_eq!(retry.headers["x-latin1"].as_bytes(), b"caf\xe9");
        assert!(
            retry.headers.get("set-cookie").is_none(),
            "Set-Cookie is never replayed"
        );
        let mut expected = first.headers.clone();
        expected.remove("set-cookie");
        let mut replayed = retry.headers.clone();
        replayed.remove("idempotent-replayed");
        assert_eq!(replayed, expected, "every other header is replayed as it was");
    }
}

// Row 16, configurable
async fn stored_headers_are_configurable(b: Backend) {
    let (app, _) = router(layer(&b).with_extra_unstored_headers([http::HeaderName::from_static("x-multi")]));
    send(&app, payment("cfg-1", "{}")).await;
    let retry = send(&app, payment("cfg-1", "{}")).await;
    assert!(retry.is_replay());
    assert!(
        retry.headers.get("set-cookie").is_none(),
        "added to the defaults, not replacing them"
    );
    assert!(retry.headers.get("x-multi").is_none());
    assert_eq!(retry.headers["x-latin1"].as_bytes(), b"caf\xe9");
}

// Row 9: Retry-After follows how long this layer's handlers take, not the lease.
async fn a_running_request_answers_409_with_a_retry_after_that_fits_the_handler(b: Backend) {
    let (app, runs) = router(layer(&b).with_lease(Duration::from_secs(20)));
    let busy_while_running = |key: &'static str, delay_ms: &'static str, run: usize| {
        let (app, runs) = (app.clone(), runs.clone());
        async move {
            let slow = {
                let app = app.clone();
                tokio::spawn(async move { send(&app, payment_with(key, &[("x-delay-ms", delay_ms)])).await })
            };
            common::until(key, || runs.get() == run).await;
            let busy = send(&app, payment(key, "{}")).await;
            assert_problem(&busy, StatusCode::CONFLICT, "InFlight");
            assert_eq!(slow.await.unwrap().status, StatusCode::CREATED);
            assert!(send(&app, payment(key, "{}")).await.is_replay());
            busy.headers["retry-after"]
                .to_str()
                .unwrap()
                .parse::<u64>()
                .unwrap()
        }
    };
    // No history yet: 1 s, not the 20 s left on the lease.
    assert_eq!(busy_while_running("busy-1", "1300", 1).await, 1);
    // The handler took about 1.3 s (up to 2 on a slow machine): the next 409 says 2.
    assert_eq!(busy_while_running("busy-2", "700", 2).await, 2);
    assert_eq!(runs.get(), 2);
}

// Row 10
async fn a_different_request_with_the_same_key_is_a_mismatch(b: Backend) {
    let (app, runs) = router(layer(&b));
    send(&app, payment("mm", "{\"amount\":1}")).await;
    let variants = [
        payment("mm", "{\"amount\":2}"),
        Request::post("/payments?x=1")
            .header("idempotency-key", "mm")
            .header("content-type", "application/json")
            .body(Body::from("{\"amount\":1}"))
            .unwrap(),
        Request::post("/payments")
            .header("idempotency-key", "mm")
            .header("content-type", "text/plain")
            .body(Body::from("{\"amount\":1}"))
            .unwrap(),
        Request::post("/payments")
            .header("idempotency-key", "mm")
            .header("host", "tenant-b.example.com")
            .header("content-type", "application/json")
            .body(Body::from("{\"amount\":1}"))
            .unwrap(),
        Request::patch("/payments")
            .header("idempotency-key", "mm")
            .header("content-type", "application/json")
            .body(Body::from("{\"amount\":1}"))
            .unwrap(),
    ];
    for request in variants {
        let answer = send(&app, request).await;
        assert_problem(&answer, StatusCode::CONFLICT, "Mismatch");
        assert_ne!(
            answer.problem_type(),
            Rejection::InFlight {
                retry_after: Duration::ZERO
            }
            .problem_type()
        );
        assert!(
            answer.headers.get("retry-after").is_none(),
            "a mismatch is not to be retried"
        );
    }
    assert_eq!(runs.get(), 1);
    // The status is configurable (422 per the IETF draft).
    let (app, _) = router(layer(&b).with_mismatch_status(StatusCode::UNPROCESSABLE_ENTITY));
    let answer = send(&app, payment("mm", "{\"amount\":3}")).await;
    assert_problem(&answer, StatusCode::UNPROCESSABLE_ENTITY, "Mismatch");
}

// Row 10: a record stored under another fingerprint policy (a policy rolled out, say) is a
// mismatch that says so, never a replay nor a second run; another request under the same
// policy stays the plain one. A few requests: milliseconds per store.
async fn a_record_stored_under_another_fingerprint_policy_says_so(b: Backend) {
    let (old, old_runs) = router(layer(&b));
    let json = tower_idempotency::FingerprintPolicy::new().json_body();
    let (new, new_runs) = router(layer(&b).with_fingerprint(json));
    assert_eq!(
        send(&old, payment("pol", "{\"amount\":1}")).await.status,
        StatusCode::CREATED
    );
    // The same request re-spelt, and another one: the new policy cannot compare either with
    // what the old one stored.
    for body in ["{ \"amount\": 1 }", "{\"amount\":2}"] {
        let answer = send(&new, payment("pol", body)).await;
        assert_problem(&answer, StatusCode::CONFLICT, "PolicyMismatch");
        let json: serde_json::Value = serde_json::from_slice(&answer.body).unwrap();
        assert_eq!(json["key_state"], "policy_mismatch", "{json}");
        assert_eq!(json["retryable"], false, "{json}");
        assert!(
            json["detail"]
                .as_str()
                .unwrap()
                .contains("another fingerprint policy"),
            "{json}"
        );
        assert!(answer.headers.get("retry-after").is_none());
        assert_eq!(
            answer
                .extensions
                .get::<tower_idempotency::RequestOutcome>()
                .map(|o| o.as_str()),
            Some("policy_mismatch")
        );
    }
    // Under the policy that stored it, another request is the plain mismatch.
    let answer = send(&old, payment("pol", "{\"amount\":2}")).await;
    assert_problem(&answer, StatusCode::CONFLICT, "Mismatch");
    assert!(send(&old, payment("pol", "{\"amount\":1}")).await.is_replay());
    assert_eq!(old_runs.get() + new_runs.get(), 1);
}

// Row 10: the host is compared as DNS and HTTP compare it.
async fn a_host_spelled_another_way_is_the_same_request(b: Backend) {
    let (app, runs) = router(layer(&b));
    let with_host = |host: &str| {
        Request::post("/payments")
            .header("idempotency-key", "host")
            .header("host", host)
            .header("content-type", "application/json")
            .body(Body::from("{}"))
            .unwrap()
    };
    assert_eq!(
        send(&app, with_host("Shop.Example.com")).await.status,
        StatusCode::CREATED
    );
    for same in [
        "shop.example.com",
        "shop.example.com.",
        "SHOP.example.com:443",
        "shop.example.com:80",
    ] {
        assert!(
            send(&app, with_host(same)).await.is_replay(),
            "{same} is the same host"
        );
    }
    for other in ["shop.example.com:8443", "other.example.com"] {
        let answer = send(&app, with_host(other)).await;
        assert_problem(&answer, StatusCode::CONFLICT, "Mismatch");
    }
    assert_eq!(runs.get(), 1);
}

// Row 11
async fn answers_that_are_not_cacheable_release_the_key(b: Backend) {
    let (app, runs) = router(layer(&b));
    let mut expected_runs = 0;
    for (status, cache_control) in [
        ("500", None),
        ("503", None),
        ("408", None),
        ("409", None),
        ("425", None),
        ("429", None),
        ("401", None),
        ("403", None),
        ("200", Some("private, no-store")),
    ] {
        let key = format!("transient-{status}");
        for _ in 0..2 {
            let mut request = post(Some(&key)).header("x-status", status);
            if let Some(cc) = cache_control {
                request = request.header("x-cache-control", cc);
            }
            let answer = send(&app, request.body(Body::from("{}")).unwrap()).await;
            expected_runs += 1;
            assert_eq!(answer.status.as_str(), status, "returned unchanged");
            assert!(!answer.is_replay());
            assert_eq!(answer.headers["set-cookie"], "session=secret");
        }
    }
    assert_eq!(runs.get(), expected_runs, "each retry ran the handler again");
    // 4xx other than those are stored.
    send(&app, payment_with("bad-request", &[("x-status", "400")])).await;
    let retry = send(&app, payment_with("bad-request", &[("x-status", "400")])).await;
    assert!(retry.is_replay());
    assert_eq!(retry.status, StatusCode::BAD_REQUEST);
    // The predicate is configurable.
    let (app, runs) = router(layer(&b).with_cacheable(|parts| parts.status == StatusCode::CREATED));
    for _ in 0..2 {
        send(&app, payment_with("only-201", &[("x-status", "202")])).await;
    }
    assert_eq!(runs.get(), 2);
}

// Row 12: a response over the storage cap goes to the client unchanged; its key is kept as not
// replayable, so a retry is told so and never runs the handler again (unless configured).
async fn responses_over_the_storage_cap_are_kept_as_not_replayable(b: Backend) {
    let layer = layer(&b).with_response_limit(1000);
    let (app, runs) = router(layer.clone());
    let huge = || payment_with("huge", &[("x-body-size", "5000")]);
    let first = send(&app, huge()).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(first.body.len(), 5000, "returned unchanged");
    assert!(first.body.iter().all(|&b| b == b'x'));
    assert!(!first.is_replay());
    let retry = send(&app, huge()).await;
    assert_problem(&retry, StatusCode::CONFLICT, "ResponseNotStored");
    assert_eq!(
        retry.extensions.get::<Rejection>(),
        Some(&Rejection::ResponseNotStored {
            status: StatusCode::CONFLICT,
            why: NotStored::TooLarge
        })
    );
    assert_eq!(runs.get(), 1, "never run twice");
    let seen = layer.inspect(None, "huge").await.unwrap().expect("a record");
    assert_eq!(seen.state, tower_idempotency::RecordState::Completed);
    assert_eq!(
        seen.status,
        Some(StatusCode::CREATED),
        "what the first client got"
    );
    assert_eq!(seen.not_stored, Some(NotStored::TooLarge));
    assert!(
        seen.expires_in > Duration::from_secs(23 * 3600),
        "for the retention"
    );
    // Exactly at the cap is stored.
    send(&app, payment_with("at-cap", &[("x-body-size", "1000")])).await;
    let retry = send(&app, payment_with("at-cap", &[("x-body-size", "1000")])).await;
    assert!(retry.is_replay());
    assert_eq!(retry.body.len(), 1000);
    // The status is configurable, and releasing is an opt-in.
    let (app, _) = router(
        layer
            .clone()
            .with_not_stored_status(StatusCode::UNPROCESSABLE_ENTITY),
    );
    send(&app, payment_with("huge-422", &[("x-body-size", "5000")])).await;
    let retry = send(&app, payment_with("huge-422", &[("x-body-size", "5000")])).await;
    assert_problem(&retry, StatusCode::UNPROCESSABLE_ENTITY, "ResponseNotStored");
    let (app, runs) = router(layer.with_release_not_stored(true));
    for _ in 0..2 {
        let answer = send(&app, payment_with("huge-released", &[("x-body-size", "5000")])).await;
        assert_eq!((answer.status, answer.body.len()), (StatusCode::CREATED, 5000));
    }
    assert_eq!(runs.get(), 2, "released: the retry ran again");
}

// Row 7: a response of unknown length (a compression layer inside this one, a proxied chunked
// upstream, `Body::from_stream`) goes to the client as it comes and is stored as it passes; the
// key completes when the body ends.
async fn a_response_of_unknown_length_streams_on_and_is_stored_as_it_passes(b: Backend) {
    use axum::routing::post as route_post;
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let runs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let (opened, counter) = (gate.clone(), runs.clone());
    let app = axum::Router::new()
        .route(
            "/payments",
            route_post(move || {
                counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                // The first chunk at once; the second only once the test has seen the first.
                let gate = opened.clone();
                let chunks = futures_util::stream::unfold(0u8, move |n| {
                    let gate = gate.clone();
                    async move {
                        match n {
                            0 => {}
                            1 => gate.acquire().await.ok()?.forget(),
                            _ => return None,
                        }
                        Some((Ok::<_, std::io::Error>(Bytes::from(format!("part {n};"))), n + 1))
                    }
                });
                async move { ([("content-type", "text/plain")], Body::from_stream(chunks)) }
            }),
        )
        .layer(layer(&b));
    let response = tower::ServiceExt::oneshot(app.clone(), payment("stream", "{}"))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let mut body = response.into_body();
    let first = http_body_util::BodyExt::frame(&mut body).await.unwrap().unwrap();
    assert_eq!(
        first.into_data().unwrap(),
        "part 0;",
        "sent before the body ended"
    );
    // Still streaming: the key is in flight.
    let retry = send(&app, payment("stream", "{}")).await;
    assert_problem(&retry, StatusCode::CONFLICT, "InFlight");
    gate.add_permits(1);
    let rest = http_body_util::BodyExt::collect(body).await.unwrap().to_bytes();
    assert_eq!(rest, "part 1;");
    // The end of the body reached the client only once the record was stored.
    let retry = send(&app, payment("stream", "{}")).await;
    assert!(retry.is_replay(), "{:?}", retry.body);
    assert_eq!(retry.body, "part 0;part 1;");
    assert_eq!(retry.headers["content-type"], "text/plain");
    assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 1);
}

// Row 7: trailers are stored and replayed with the response, whether its length is known or not.
async fn trailers_are_stored_and_replayed(b: Backend) {
    let (app, runs) = router(layer(&b));
    for (key, length) in [("trailers-streamed", None), ("trailers-sized", Some("16"))] {
        let mut headers = vec![("x-stream", "2,0"), ("x-trailer", "sum-42")];
        headers.extend(length.map(|length| ("x-stream-length", length)));
        let first = send(&app, payment_with(key, &headers)).await;
        assert_eq!(first.body, "chunk 0\nchunk 1\n");
        let trailers = first.trailers.clone().expect("trailers");
        assert_eq!(trailers["x-checksum"], "sum-42");
        let retry = send(&app, payment_with(key, &headers)).await;
        assert!(retry.is_replay(), "{key}");
        assert_eq!(retry.body, first.body);
        assert_eq!(retry.trailers, Some(trailers), "{key}");
    }
    assert_eq!(runs.get(), 2);
}

// Row 7: a client that leaves mid-stream: the rest is still read and stored for its retry, unless
// the layer cancels on disconnect (the key is then released).
async fn a_client_that_leaves_mid_stream_still_gets_its_response_stored(b: Backend) {
    let layer = layer(&b);
    for cancel in [false, true] {
        let key = format!("left-mid-stream-{cancel}");
        let (app, runs) = router(layer.clone().with_cancel_on_disconnect(cancel));
        let request = || payment_with(&key, &[("x-stream", "4,30")]);
        let response = tower::ServiceExt::oneshot(app.clone(), request()).await.unwrap();
        let mut body = response.into_body();
        let first = http_body_util::BodyExt::frame(&mut body).await.unwrap().unwrap();
        assert_eq!(first.into_data().unwrap(), "chunk 0\n");
        drop(body);
        // Wait for the key to settle: stored, or released.
        let started = std::time::Instant::now();
        let retry = loop {
            let retry = send(&app, request()).await;
            if retry.status != StatusCode::CONFLICT {
                break retry;
            }
            assert!(started.elapsed() < Duration::from_secs(3), "the key settles");
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        if cancel {
            assert!(!retry.is_replay(), "released: the retry ran");
            assert_eq!(runs.get(), 2);
        } else {
            assert!(retry.is_replay());
            assert_eq!(retry.body, "chunk 0\nchunk 1\nchunk 2\nchunk 3\n", "all of it");
            assert_eq!(runs.get(), 1);
        }
    }
}

// Row 7: a response body that fails part way reaches the client as an error; its key is kept as
// not replayable.
async fn a_response_body_that_fails_is_kept_as_not_replayable(b: Backend) {
    let layer = layer(&b);
    let (app, runs) = router(layer.clone());
    for (key, length) in [("fails-streamed", None), ("fails-sized", Some("100"))] {
        let mut headers = vec![("x-stream", "2,0,fail")];
        headers.extend(length.map(|length| ("x-stream-length", length)));
        let response = tower::ServiceExt::oneshot(app.clone(), payment_with(key, &headers))
            .await
            .unwrap();
        assert!(
            http_body_util::BodyExt::collect(response.into_body())
                .await
                .is_err(),
            "the client sees the failure"
        );
        let retry = send(&app, payment_with(key, &headers)).await;
        assert_problem(&retry, StatusCode::CONFLICT, "ResponseNotStored");
        let seen = layer.inspect(None, key).await.unwrap().expect("a record");
        assert_eq!(seen.not_stored, Some(NotStored::BodyFailed), "{key}");
    }
    assert_eq!(runs.get(), 2, "never run twice");
}

// Row 7: an endless stream holds its key only until its copy passes the storage cap; it then
// streams on, and the key is kept as not replayable.
async fn an_endless_stream_holds_its_key_only_up_to_the_cap(b: Backend) {
    use axum::routing::post as route_post;
    let layer = layer(&b).with_response_limit(100);
    let app = axum::Router::new()
        .route(
            "/payments",
            route_post(|| async {
                let events = futures_util::stream::unfold(0u64, |n| async move {
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    Some((
                        Ok::<_, std::io::Error>(Bytes::from(format!("data: {n}\n\n"))),
                        n + 1,
                    ))
                });
                ([("content-type", "text/event-stream")], Body::from_stream(events))
            }),
        )
        .layer(layer.clone());
    let response = tower::ServiceExt::oneshot(app.clone(), payment("sse", "{}"))
        .await
        .unwrap();
    let mut body = response.into_body();
    let mut received = 0;
    while received < 200 {
        let frame = http_body_util::BodyExt::frame(&mut body).await.unwrap().unwrap();
        received += frame.into_data().unwrap().len();
    }
    assert_eq!(
        layer.shutdown_handle().running(),
        0,
        "the stream no longer holds a slot"
    );
    let retry = send(&app, payment("sse", "{}")).await;
    assert_problem(&retry, StatusCode::CONFLICT, "ResponseNotStored");
    let more = http_body_util::BodyExt::frame(&mut body).await.unwrap().unwrap();
    assert!(more.is_data(), "and it streams on");
}

/// `POST /payments` behind `layer`, answering with `body()` (of unknown length), counting runs.
fn streaming_router(
    layer: IdempotencyLayer,
    body: impl Fn() -> Body + Clone + Send + Sync + 'static,
) -> (axum::Router, Arc<std::sync::atomic::AtomicUsize>) {
    let runs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = runs.clone();
    let route = axum::routing::post(move || {
        counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let body = body();
        async move { ([("content-type", "text/event-stream")], body) }
    });
    (axum::Router::new().route("/payments", route).layer(layer), runs)
}

/// Retries `request` until its key is no longer in flight (at most 5 s), and answers that retry.
async fn once_settled(app: &axum::Router, request: impl Fn() -> Request<Body>) -> common::app::Answer {
    let started = std::time::Instant::now();
    loop {
        let response = tower::ServiceExt::oneshot(app.clone(), request()).await.unwrap();
        let in_flight = response.status() == StatusCode::CONFLICT
            && response
                .extensions()
                .get::<Rejection>()
                .is_some_and(|r| matches!(r, Rejection::InFlight { .. }));
        if !in_flight {
            let (parts, body) = response.into_parts();
            // A retry that ran streams without end: its head is what counts.
            let body = match tokio::time::timeout(
                Duration::from_millis(200),
                http_body_util::BodyExt::collect(body),
            )
            .await
            {
                Ok(collected) => collected.unwrap().to_bytes(),
                Err(_) => Bytes::new(),
            };
            return common::app::Answer {
                status: parts.status,
                headers: parts.headers,
                body,
                trailers: None,
                extensions: parts.extensions,
            };
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "the key is still in flight after 5 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

// Row 7: a response of unknown length that sends a chunk and then stalls (an upstream that
// hangs, a client that stops reading) holds its key no longer than the stream timeout: the key
// is then kept as not replayable (or released), its slot is free, and the client's response is
// not cut.
async fn a_stalled_stream_holds_its_key_no_longer_than_the_stream_timeout(b: Backend) {
    let stalled = || {
        let chunks = futures_util::stream::iter([Ok::<_, std::io::Error>(Bytes::from("data: 0\n\n"))])
            .chain(futures_util::stream::pending());
        Body::from_stream(chunks)
    };
    use futures_util::StreamExt;
    let layer = layer(&b).with_stream_timeout(Duration::from_millis(300));
    for release in [false, true] {
        let key = format!("stalled-{release}");
        let (app, runs) = streaming_router(layer.clone().with_release_not_stored(release), stalled);
        let response = tower::ServiceExt::oneshot(app.clone(), payment(&key, "{}"))
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        let mut body = response.into_body();
        let first = http_body_util::BodyExt::frame(&mut body).await.unwrap().unwrap();
        assert_eq!(first.into_data().unwrap(), "data: 0\n\n");
        // The client holds its response and reads no more; the upstream sends no more.
        let retry = once_settled(&app, || payment(&key, "{}")).await;
        if release {
            assert_eq!(retry.status, StatusCode::OK, "released: the retry runs");
            assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 2);
        } else {
            assert_problem(&retry, StatusCode::CONFLICT, "ResponseNotStored");
            let seen = layer.inspect(None, &key).await.unwrap().expect("a record");
            assert_eq!(seen.not_stored, Some(NotStored::TimedOut));
            assert_eq!(seen.status, Some(StatusCode::OK), "the status its client got");
            assert_eq!(layer.shutdown_handle().running(), 0, "its slot is free");
            assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 1);
        }
        assert!(
            !http_body::Body::is_end_stream(&body),
            "the client's response is not cut"
        );
    }
}

/// An endless event stream (a chunk every millisecond) that says, through `dropped`, when the
/// layer stops reading it.
fn endless(dropped: Arc<std::sync::Mutex<Option<tokio::sync::oneshot::Sender<()>>>>) -> Body {
    let told = dropped.lock().unwrap().take();
    let events = futures_util::stream::unfold((0u64, told), |(n, told)| async move {
        tokio::time::sleep(Duration::from_millis(1)).await;
        let event = Bytes::from(format!("data: {n}\n\n"));
        Some((Ok::<_, std::io::Error>(event), (n + 1, told)))
    });
    Body::from_stream(events)
}

// Row 7: an endless stream whose client leaves is read only until its claim is settled (at the
// storage cap, or at the stream timeout), never to an end that does not come; its key is then
// released (with `with_release_not_stored`) or kept as not replayable.
async fn an_endless_stream_whose_client_left_is_read_no_further_than_its_claim(b: Backend) {
    let cases = [
        ("endless-over-cap", layer(&b).with_response_limit(100)),
        (
            "endless-timed-out",
            layer(&b).with_stream_timeout(Duration::from_millis(300)),
        ),
    ];
    for (key, layer) in cases {
        let (told, dropped) = tokio::sync::oneshot::channel();
        let told = Arc::new(std::sync::Mutex::new(Some(told)));
        let (app, runs) =
            streaming_router(layer.with_release_not_stored(true), move || endless(told.clone()));
        let response = tower::ServiceExt::oneshot(app.clone(), payment(key, "{}"))
            .await
            .unwrap();
        let mut body = response.into_body();
        let first = http_body_util::BodyExt::frame(&mut body).await.unwrap().unwrap();
        assert!(first.is_data());
        drop(body);
        tokio::time::timeout(Duration::from_secs(5), dropped)
            .await
            .unwrap_or_else(|_| panic!("{key}: the layer still reads the stream its client left after 5 s"))
            .expect_err("the stream is dropped, never ends");
        let retry = once_settled(&app, || payment(key, "{}")).await;
        assert_eq!(retry.status, StatusCode::OK, "{key}: released, the retry runs");
        assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 2, "{key}");
    }
}

/// README row 17: "the handler gives no response head within the handler timeout (default 60 s;
/// `with_handler_timeout`) | the handler is cancelled; 504 problem+json `HandlerTimedOut`; the key
/// is kept as not replayable (a retry gets `ResponseNotStored`), unless
/// `with_release_not_stored(true)`". Cancelled means its future is dropped at the timeout, before
/// the 504 leaves (its drop is recorded), so it never reaches its end; its sleep (1.5 s) is
/// short enough that a layer that let it run on would answer late and fail this test rather
/// than hang it.
async fn a_hung_handler_is_cancelled_at_its_timeout(b: Backend) {
    const SLEEP: Duration = Duration::from_millis(1500);
    let timeout = Duration::from_millis(200);
    let layer = layer(&b).with_handler_timeout(timeout);
    let (app, runs) = router(layer.clone());
    let hung = |key: &str| payment_with(key, &[("x-delay-ms", "1500")]);
    let started = std::time::Instant::now();
    let first = send(&app, hung("hung")).await;
    let answered = started.elapsed();
    assert_problem(&first, StatusCode::GATEWAY_TIMEOUT, "HandlerTimedOut");
    assert!(
        answered < SLEEP / 2,
        "answered at the timeout, not when the handler would end: {answered:?}"
    );
    let stopped = runs.stopped();
    assert_eq!(stopped.len(), 1, "the run was stopped before the 504 left");
    let at = stopped[0] - started;
    assert!(
        at >= timeout && at < SLEEP / 2,
        "stopped at about the timeout: {at:?}"
    );
    assert_eq!((runs.get(), runs.finished()), (1, 0), "the hung run never ended");
    assert_eq!(layer.shutdown_handle().running(), 0, "its slot is free");
    let retry = send(&app, payment("hung", "{}")).await;
    assert_problem(&retry, StatusCode::CONFLICT, "ResponseNotStored");
    let seen = layer.inspect(None, "hung").await.unwrap().expect("a record");
    assert_eq!(seen.not_stored, Some(NotStored::TimedOut));
    assert_eq!(runs.get(), 1);
    // Released instead, on request: the retry runs.
    let (released, released_runs) = router(layer.with_release_not_stored(true));
    let first = send(&released, hung("hung-released")).await;
    assert_eq!(first.status, StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(released_runs.stopped().len(), 1, "cancelled too");
    let retry = send(&released, payment("hung-released", "{}")).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!((released_runs.get(), released_runs.finished()), (2, 1));
}

/// README row 17 and the notes on the table: "The handler timeout covers the handler and the
/// reading of a response body of known length". A handler that gives its head at once with a
/// `Content-Length` but whose body comes slowly is cut at the handler timeout: 504
/// `HandlerTimedOut`, the key kept as not replayable (`NotStored::TimedOut`), or released with
/// `with_release_not_stored(true)`.
async fn the_handler_timeout_covers_a_body_of_known_length(b: Backend) {
    let timeout = Duration::from_millis(200);
    let layer = layer(&b).with_handler_timeout(timeout);
    let (app, runs) = router(layer.clone());
    // Ten chunks of 8 bytes, 100 ms apart: the body would end at about 900 ms.
    let slow_body = |key: &str| payment_with(key, &[("x-stream", "10,100"), ("x-stream-length", "80")]);
    let started = std::time::Instant::now();
    let first = send(&app, slow_body("slow-sized")).await;
    let answered = started.elapsed();
    assert_problem(&first, StatusCode::GATEWAY_TIMEOUT, "HandlerTimedOut");
    assert!(
        answered < Duration::from_millis(700),
        "cut at the timeout, not when the body ends: {answered:?}"
    );
    assert_eq!(runs.finished(), 1, "the handler gave its head; its body was cut");
    let seen = layer
        .inspect(None, "slow-sized")
        .await
        .unwrap()
        .expect("a record");
    assert_eq!(seen.state, tower_idempotency::RecordState::Completed);
    assert_eq!(seen.not_stored, Some(NotStored::TimedOut));
    assert_eq!(seen.status, None, "no status was sent but the 504");
    let retry = send(&app, slow_body("slow-sized")).await;
    assert_problem(&retry, StatusCode::CONFLICT, "ResponseNotStored");
    assert_eq!(runs.get(), 1, "never run twice");
    // Released instead, on request: the retry runs (and is cut again).
    let (app, runs) = router(layer.with_release_not_stored(true));
    assert_eq!(
        send(&app, slow_body("slow-sized-released")).await.status,
        StatusCode::GATEWAY_TIMEOUT
    );
    let retry = send(&app, payment("slow-sized-released", "{}")).await;
    assert_eq!((retry.status, retry.is_replay()), (StatusCode::CREATED, false));
    assert_eq!(runs.get(), 2);
}

/// README row 7: "A body of unknown length [...] goes to the client as it comes, a copy is kept
/// as it passes, and the key completes when the body ends, before the client sees the end (the
/// lease is renewed meanwhile)". With a 300 ms lease and a stream of about 850 ms (near three
/// leases), every request for the key meanwhile gets 409 `InFlight`, never a second run, also
/// after two leases would have run out; the record completes at the end and replays
/// byte-exact.
async fn the_lease_is_renewed_while_a_response_of_unknown_length_streams(b: Backend) {
    let lease = Duration::from_millis(300);
    let (app, runs) = router(layer(&b).with_lease(lease));
    let key = "long-stream";
    let started = std::time::Instant::now();
    let first = common::app::spawn_send(&app, payment_with(key, &[("x-stream", "8,120")]));
    common::until("the handler runs", || runs.get() == 1).await;
    let (mut in_flight, mut in_flight_after_two_leases) = (0, 0);
    while !first.is_finished() {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let retry = send(&app, payment(key, "{}")).await;
        if retry.is_replay() {
            break; // the stream ended meanwhile
        }
        assert_problem(&retry, StatusCode::CONFLICT, "InFlight");
        in_flight += 1;
        if started.elapsed() > 2 * lease {
            in_flight_after_two_leases += 1;
        }
    }
    assert!(
        in_flight >= 4 && in_flight_after_two_leases >= 1,
        "the key was seen in flight {in_flight} times, {in_flight_after_two_leases} past two leases"
    );
    let first = first.await.unwrap();
    let expected: String = (0..8).map(|n| format!("chunk {n}\n")).collect();
    assert_eq!(
        (first.status, first.body.clone()),
        (StatusCode::CREATED, Bytes::from(expected))
    );
    let replay = send(&app, payment(key, "{}")).await;
    assert!(replay.is_replay(), "{:?}", replay.body);
    assert_eq!(replay.status, first.status);
    assert_eq!(replay.body, first.body, "byte-exact");
    assert_eq!(runs.get(), 1, "never a second run beside the stream");
}

/// The 4xx statuses named in the doc comment just above `item` in `source`.
fn statuses_documented_above(source: &str, item: &str) -> std::collections::BTreeSet<u16> {
    let at = source.find(item).unwrap_or_else(|| panic!("{item} not found"));
    let doc: Vec<&str> = source[..at]
        .lines()
        .rev()
        .skip(1)
        .map(str::trim)
        .take_while(|line| line.starts_with("///") || line.starts_with("#["))
        .collect();
    four_xx_in(&doc.join(" "))
}

fn four_xx_in(text: &str) -> std::collections::BTreeSet<u16> {
    text.split(|c: char| !c.is_ascii_digit())
        .filter(|word| word.len() == 3 && word.starts_with('4'))
        .filter_map(|word| word.parse().ok())
        .collect()
}

// Row 11, as documented: every place that lists the 4xx answers not stored by default (the
// rustdoc of `default_cacheable` and `with_cacheable`, README's table and notes) lists exactly
// those `default_cacheable` refuses.
#[test]
fn every_place_lists_the_4xx_answers_the_default_does_not_store() {
    let refused: std::collections::BTreeSet<u16> = (400..500)
        .filter(|&code| {
            let (parts, ()) = http::Response::builder()
                .status(code)
                .body(())
                .unwrap()
                .into_parts();
            !tower_idempotency::default_cacheable(&parts)
        })
        .collect();
    assert_eq!(refused, [401, 403, 408, 409, 425, 429].into(), "the behaviour");
    let config = include_str!("../src/http/config.rs");
    let layer = include_str!("../src/http/layer.rs");
    let readme = include_str!("../README.md");
    let row = readme
        .lines()
        .find(|line| line.starts_with("| 11 |"))
        .expect("README's row 11");
    let notes = readme
        .split("The default `default_cacheable` stores every 4xx but")
        .nth(1)
        .and_then(|rest| rest.split(':').next())
        .expect("README's note on default_cacheable");
    let places = [
        (
            "default_cacheable",
            statuses_documented_above(config, "pub fn default_cacheable"),
        ),
        (
            "with_cacheable",
            statuses_documented_above(layer, "pub fn with_cacheable"),
        ),
        ("README, row 11", four_xx_in(row)),
        ("README, notes", four_xx_in(notes)),
    ];
    for (place, listed) in places {
        assert_eq!(listed, refused, "{place}");
    }
}

// Row 13
async fn a_store_slower_than_its_timeout_fails_closed_or_open(b: Backend) {
    let slow = Arc::new(common::FaultyStore::new(b.store.clone()).with_answer_delay(Duration::from_secs(5)));
    let timeout = Duration::from_millis(100);
    let (app, runs) = router(IdempotencyLayer::new(slow.clone()).with_store_timeout(timeout));
    let started = std::time::Instant::now();
    let answer = send(&app, payment("slow", "{}")).await;
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "bounded by the timeout"
    );
    assert_problem(&answer, StatusCode::SERVICE_UNAVAILABLE, "StoreUnavailable");
    assert_eq!(answer.headers["retry-after"], "1");
    assert_eq!(runs.get(), 0, "fail-closed: the handler does not run");

    let (app, runs) = router(
        IdempotencyLayer::new(slow)
            .with_store_timeout(timeout)
            .with_fail_open(true),
    );
    let answer = send(&app, payment("slow", "{}")).await;
    assert_eq!(answer.status, StatusCode::CREATED);
    assert_eq!(runs.get(), 1, "fail-open: the handler runs unprotected");
}

// Row 14
async fn scoped_keys_never_replay_across_scopes(b: Backend) {
    let scoped =
        layer(&b).with_scope(|parts| parts.headers.get("x-tenant")?.to_str().ok().map(str::to_owned));
    let (app, runs) = router(scoped);
    let as_tenant = |tenant: &str| payment_with("same-key", &[("x-tenant", tenant)]);
    let alice = send(&app, as_tenant("alice")).await;
    let bob = send(&app, as_tenant("bob")).await;
    assert_eq!(runs.get(), 2, "each tenant ran its own request");
    assert!(!bob.is_replay());
    assert_ne!(alice.body, bob.body);
    let alice_again = send(&app, as_tenant("alice")).await;
    assert!(alice_again.is_replay());
    assert_eq!(alice_again.body, alice.body);
    // A request the scope function cannot place is refused, not run unscoped.
    let answer = send(&app, payment("same-key", "{}")).await;
    assert_problem(&answer, StatusCode::INTERNAL_SERVER_ERROR, "MissingScope");
    assert_eq!(runs.get(), 2);
}

// Row 15
async fn retention_is_configurable(b: Backend) {
    let (app, runs) = router(layer(&b).with_retention(Duration::from_secs(1)));
    send(&app, payment("short", "{}")).await;
    assert!(send(&app, payment("short", "{}")).await.is_replay());
    tokio::time::sleep(Duration::from_millis(1300)).await;
    assert!(!send(&app, payment("short", "{}")).await.is_replay());
    assert_eq!(runs.get(), 2);
}

// Operators
async fn operators_can_inspect_and_purge_a_key(b: Backend) {
    let layer = layer(&b).with_scope(|parts| parts.headers.get("x-tenant")?.to_str().ok().map(str::to_owned));
    let (app, runs) = router(layer.clone());
    let request = || payment_with("op-key", &[("x-tenant", "t1"), ("x-status", "202")]);
    send(&app, request()).await;
    let seen = layer
        .inspect(Some("t1"), "op-key")
        .await
        .unwrap()
        .expect("a record");
    assert_eq!(seen.state, tower_idempotency::RecordState::Completed);
    assert_eq!(seen.status, Some(StatusCode::ACCEPTED));
    assert!(seen.expires_in > Duration::from_secs(23 * 3600));
    assert!(
        layer.inspect(Some("t2"), "op-key").await.unwrap().is_none(),
        "addressed by scope"
    );
    assert!(layer.purge(Some("t1"), "op-key").await.unwrap());
    assert!(layer.inspect(Some("t1"), "op-key").await.unwrap().is_none());
    assert!(!send(&app, request()).await.is_replay());
    assert_eq!(runs.get(), 2);
}

on_every_store!(
    uncovered_methods_pass_through,
    a_missing_key_passes_when_optional_and_is_refused_when_required,
    invalid_keys_are_refused,
    the_key_header_is_configurable,
    the_structured_field_form_is_the_same_key,
    bodies_over_the_limit_are_refused_and_claim_nothing,
    a_body_that_fails_mid_upload_is_refused_and_claims_nothing,
    the_first_response_is_unchanged_and_retries_replay_it_byte_for_byte,
    stored_headers_are_configurable,
    a_running_request_answers_409_with_a_retry_after_that_fits_the_handler,
    a_different_request_with_the_same_key_is_a_mismatch,
    a_record_stored_under_another_fingerprint_policy_says_so,
    a_host_spelled_another_way_is_the_same_request,
    answers_that_are_not_cacheable_release_the_key,
    responses_over_the_storage_cap_are_kept_as_not_replayable,
    a_response_of_unknown_length_streams_on_and_is_stored_as_it_passes,
    trailers_are_stored_and_replayed,
    a_client_that_leaves_mid_stream_still_gets_its_response_stored,
    a_response_body_that_fails_is_kept_as_not_replayable,
    an_endless_stream_holds_its_key_only_up_to_the_cap,
    a_stalled_stream_holds_its_key_no_longer_than_the_stream_timeout,
    an_endless_stream_whose_client_left_is_read_no_further_than_its_claim,
    a_hung_handler_is_cancelled_at_its_timeout,
    the_handler_timeout_covers_a_body_of_known_length,
    the_lease_is_renewed_while_a_response_of_unknown_length_streams,
    a_store_slower_than_its_timeout_fails_closed_or_open,
    scoped_keys_never_replay_across_scopes,
    retention_is_configurable,
    operators_can_inspect_and_purge_a_key,
);
