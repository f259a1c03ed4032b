//! The promises of docs/guarantees.md that hold on every store: one execution under
//! contention, cancellation, panics, lease renewal and fencing, crashed owners, shutdown and the
//! in-flight bound, unreadable records.

mod common;

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use bytes::Bytes;
use common::app::{payment, payment_with, router, send, spawn_send, Answer};
use common::{until, Backend};
use http::StatusCode;
use tower::ServiceExt;
use tower_idempotency::{
    ClaimOutcome, Fingerprint, IdempotencyKey, IdempotencyLayer, MemoryStore, OwnerToken, RecordKey,
    RecordState, Rejection, ShutdownHandle,
};

fn layer(b: &Backend) -> IdempotencyLayer {
    IdempotencyLayer::new(b.store.clone())
}

fn slow(key: &str, delay_ms: u64) -> http::Request<Body> {
    payment_with(key, &[("x-delay-ms", &delay_ms.to_string())])
}

fn rejection(answer: &Answer) -> Option<&Rejection> {
    answer.extensions.get::<Rejection>()
}

/// The fingerprint the layer computes for `payment(key, "{}")`: method, authority (none here),
/// path and query, Content-Type, body.
fn fingerprint_of_empty_payment() -> Fingerprint {
    Fingerprint::new([b"POST".as_slice(), b"", b"/payments", b"application/json", b"{}"])
}

// Promise 1
async fn hundreds_of_concurrent_requests_run_the_handler_once(b: Backend) {
    let (app, runs) = router(layer(&b));
    let tasks: Vec<_> = (0..300)
        .map(|_| spawn_send(&app, slow("contended", 300)))
        .collect();
    let mut created = 0;
    let mut replayed = 0;
    let mut in_flight = 0;
    let mut bodies = std::collections::HashSet::new();
    for task in tasks {
        let answer = task.await.unwrap();
        match answer.status {
            StatusCode::CREATED if answer.is_replay() => replayed += 1,
            StatusCode::CREATED => created += 1,
            StatusCode::CONFLICT => {
                assert_eq!(
                    rejection(&answer),
                    Some(&Rejection::InFlight {
                        retry_after: Duration::from_secs(1)
                    }),
                    "no handler has finished yet, so Retry-After is 1 s"
                );
                in_flight += 1;
                continue;
            }
            other => panic!("unexpected {other}: {:?}", answer.body),
        }
        bodies.insert(answer.body);
    }
    assert_eq!(runs.get(), 1, "the handler ran once");
    assert_eq!(created, 1, "one first response");
    assert_eq!(created + replayed + in_flight, 300);
    assert_eq!(bodies.len(), 1, "every 201 carries the same body");
    assert!(send(&app, slow("contended", 0)).await.is_replay());
}

// Promise 2
async fn a_dropped_response_future_does_not_lose_the_work(b: Backend) {
    let (app, runs) = router(layer(&b));
    // The client hangs up (or an outer timeout fires) while the handler runs.
    let dropped = tokio::time::timeout(
        Duration::from_millis(100),
        app.clone().oneshot(slow("hang-up", 400)),
    )
    .await;
    assert!(dropped.is_err(), "the response future was dropped");
    assert_eq!(runs.finished(), 0);
    // Polled, not a fixed 600 ms, which a loaded machine's claim and handler could outlast.
    common::until("the handler ran to completion anyway", || runs.finished() == 1).await;
    // Its completion lands a moment after (a retry meanwhile is answered 409, in flight).
    let replayed = || async { send(&app, slow("hang-up", 400)).await.is_replay() };
    common::until_async("the retry gets the stored result", replayed).await;
    assert_eq!(runs.get(), 1);
    assert_eq!(send(&app, slow("hang-up", 400)).await.body, "run 1; echo {}");
}

// Promise 2, the option
async fn cancel_on_disconnect_cancels_and_releases(b: Backend) {
    let (app, runs) = router(layer(&b).with_cancel_on_disconnect(true));
    // The client hangs up once the handler runs. (It hung up after a fixed 100 ms, which a claim
    // on a loaded machine outlasted: the handler never started, and the retry was its only run.)
    let mut request = Box::pin(app.clone().oneshot(slow("cancel", 400)));
    let started = async {
        while runs.get() == 0 {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    };
    tokio::select! {
        _ = &mut request => panic!("the request was answered before its client hung up"),
        started = tokio::time::timeout(Duration::from_secs(10), started) => {
            started.expect("the handler started within 10 s");
        }
    }
    drop(request);
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(runs.finished(), 0, "the handler was cancelled");
    let retry = send(&app, slow("cancel", 0)).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(!retry.is_replay(), "the key was released: the retry runs again");
    assert_eq!(runs.get(), 2);
}

// Promise 2: a hang-up before the claim answered leaves no claim behind, with either setting of
// `cancel_on_disconnect`. The handler has not started, so nothing is lost: the claim that lands
// is released again and the retry runs once.
async fn a_hang_up_during_the_claim_leaves_the_key_free(b: Backend) {
    for cancel in [false, true] {
        let name = format!("early-{cancel}");
        // Claims land at once but their answers take 200 ms: the client leaves before the answer.
        let slow_store =
            Arc::new(common::FaultyStore::new(b.store.clone()).with_answer_delay(Duration::from_millis(200)));
        let (app, runs) = router(IdempotencyLayer::new(slow_store).with_cancel_on_disconnect(cancel));
        let dropped =
            tokio::time::timeout(Duration::from_millis(50), app.clone().oneshot(slow(&name, 0))).await;
        assert!(dropped.is_err());
        // The claim has landed by now (at once; its answer took 200 ms); its release is polled
        // for, which a loaded machine could delay past a fixed 300 ms.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let key = RecordKey::new(None, IdempotencyKey::parse(&name).unwrap());
        let released = || async { b.store.inspect(&key).await.unwrap().is_none() };
        common::until_async(
            &format!("the claim landed and was released again (cancel: {cancel})"),
            released,
        )
        .await;
        assert_eq!(runs.get(), 0, "the handler never started");
        let retry = send(&app, slow(&name, 0)).await;
        assert_eq!(retry.status, StatusCode::CREATED);
        assert!(!retry.is_replay());
        assert_eq!(runs.get(), 1, "the retry ran it, once");
        assert!(send(&app, slow(&name, 0)).await.is_replay());
    }
}

// Promise 3: a release that fails is retried in the background, so the key does not stay
// blocked for a whole lease.
async fn a_failed_release_is_retried_in_the_background(b: Backend) {
    let flaky = Arc::new(common::FaultyStore::new(b.store.clone()).with_failing_releases(1));
    let (app, runs) = router(IdempotencyLayer::new(flaky.clone()));
    let failed = send(&app, payment_with("flaky", &[("x-status", "503")])).await;
    assert_eq!(
        failed.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "the handler's own answer"
    );
    assert_eq!(flaky.failed_releases(), 1, "the first release failed");
    tokio::time::sleep(Duration::from_millis(100)).await;
    let retry = send(&app, payment("flaky", "{}")).await;
    assert_eq!(
        (retry.status, retry.is_replay()),
        (StatusCode::CREATED, false),
        "released after all"
    );
    assert_eq!(runs.get(), 2);
}

// Promise 3
async fn a_panicking_handler_answers_500_and_releases_the_key(b: Backend) {
    let (app, runs) = router(layer(&b));
    let panicked = send(&app, payment_with("boom", &[("x-panic", "1")])).await;
    assert_eq!(panicked.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(panicked.headers["content-type"], "application/problem+json");
    assert_eq!(rejection(&panicked), Some(&Rejection::HandlerPanicked));
    // Released before the answer left: the retry runs at once, no 409.
    let retry = send(&app, payment("boom", "{}")).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(runs.get(), 2);
}

// Promise 4
async fn a_long_handler_keeps_its_claim_past_the_lease(b: Backend) {
    let (app, runs) = router(layer(&b).with_lease(Duration::from_millis(300)));
    // Six leases: the retries below end at about 1 s, well before the handler does.
    let first = spawn_send(&app, slow("long", 1800));
    until("the handler runs", || runs.get() == 1).await;
    for _ in 0..4 {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let retry = send(&app, slow("long", 0)).await;
        assert_eq!(
            rejection(&retry),
            Some(&Rejection::InFlight {
                retry_after: Duration::from_secs(1)
            })
        );
    }
    assert_eq!(first.await.unwrap().status, StatusCode::CREATED);
    assert!(send(&app, slow("long", 0)).await.is_replay());
    assert_eq!(runs.get(), 1, "no second run beside the slow but live one");
}

// Promise 4, fencing
async fn a_lost_claim_is_fenced_and_never_overwrites_the_new_owner(b: Backend) {
    // A lease the first request's renewals keep up on a loaded machine: its claim is lost to the
    // purge, not to the lease.
    let layer = layer(&b).with_lease(Duration::from_secs(1));
    let (app, runs) = router(layer.clone());
    let first = spawn_send(&app, slow("fenced", 2000));
    until("the first request runs", || runs.get() == 1).await;
    // An operator purges the key mid-run; a retry takes it over and completes first.
    assert!(layer.purge(None, "fenced").await.unwrap());
    let second = send(&app, slow("fenced", 0)).await;
    assert_eq!((second.status, second.is_replay()), (StatusCode::CREATED, false));
    let first = first.await.unwrap();
    assert_eq!(
        first.status,
        StatusCode::CREATED,
        "the first client still gets its own answer"
    );
    assert_eq!(first.body, "run 1; echo {}");
    let replay = send(&app, slow("fenced", 0)).await;
    assert!(replay.is_replay());
    assert_eq!(replay.body, second.body, "the newer owner's record stands");
    assert_eq!(runs.get(), 2);
}

// Promise 5
async fn a_crashed_owner_blocks_its_key_only_until_its_lease_ends(b: Backend) {
    // Long enough that the claim is still live when the request below arrives on a loaded
    // machine, short enough for a Retry-After of 1 s.
    let lease = Duration::from_secs(1);
    let (app, runs) = router(layer(&b).with_lease(lease));
    // A node claimed the key and died: nobody renews or releases its claim.
    let key = RecordKey::new(None, IdempotencyKey::parse("orphan").unwrap());
    let crashed = OwnerToken::generate();
    let claimed = b
        .store
        .claim(&key, &fingerprint_of_empty_payment(), &crashed, lease)
        .await
        .unwrap();
    assert_eq!(claimed, ClaimOutcome::Claimed);
    let blocked = send(&app, payment("orphan", "{}")).await;
    assert_eq!(blocked.status, StatusCode::CONFLICT);
    assert_eq!(blocked.headers["retry-after"], "1");
    tokio::time::sleep(lease + Duration::from_millis(100)).await;
    let retry = send(&app, payment("orphan", "{}")).await;
    assert_eq!((retry.status, retry.is_replay()), (StatusCode::CREATED, false));
    assert_eq!(runs.get(), 1);
}

// Promise 8
async fn shutdown_refuses_new_keys_and_waits_for_running_handlers(b: Backend) {
    let layer = layer(&b);
    let handle = layer.shutdown_handle();
    let (app, runs) = router(layer.clone());
    let running: Vec<_> = ["s1", "s2"]
        .into_iter()
        .map(|key| spawn_send(&app, slow(key, 800)))
        .collect();
    until("both handlers run", || runs.get() == 2).await;
    assert_eq!(handle.running(), 2);
    // One client hangs up once its handler runs; the handler is still tracked.
    let hangs_up = tokio::spawn(app.clone().oneshot(slow("s3", 800)));
    until("the third handler runs", || runs.get() == 3).await;
    hangs_up.abort();
    assert_eq!(handle.running(), 3);
    let shutdown = {
        let handle = handle.clone();
        tokio::spawn(async move { handle.shutdown(Duration::from_secs(5)).await })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(handle.running(), 3, "exact while the shutdown waits");
    let refused = send(&app, payment("s4", "{}")).await;
    assert_eq!(rejection(&refused), Some(&Rejection::Overloaded));
    assert_eq!(refused.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(
        shutdown.await.unwrap().is_ok(),
        "every running handler finished before the deadline"
    );
    assert_eq!(runs.finished(), 3);
    for task in running {
        assert_eq!(task.await.unwrap().status, StatusCode::CREATED);
    }
    for key in ["s1", "s2", "s3"] {
        let record = layer.inspect(None, key).await.unwrap().expect("stored");
        assert_eq!(record.state, RecordState::Completed, "{key}");
    }
    assert!(
        layer.inspect(None, "s4").await.unwrap().is_none(),
        "nothing claimed while shutting down"
    );
}

// Promise 8, whatever a clone's settings: a clone given bounds of its own (a route's
// `with_max_in_flight`, `with_max_waiters`) is still stopped and waited for by the original's
// shutdown, and takes no new key once it has begun.
async fn a_clone_with_bounds_of_its_own_shuts_down_with_the_original(b: Backend) {
    let base = layer(&b);
    let clones = [
        ("bounded", base.clone().with_max_in_flight(8)),
        ("waiters", base.clone().with_max_waiters(4)),
    ];
    let handle = base.shutdown_handle();
    let mut apps = Vec::new();
    for (name, clone) in clones {
        assert_eq!(clone.shutdown_handle(), handle, "{name}");
        let (app, runs) = router(clone);
        let running = spawn_send(&app, slow(&format!("{name}-running"), 600));
        until("the clone's handler runs", || runs.get() == 1).await;
        apps.push((name, app, runs, running));
    }
    assert_eq!(
        handle.running(),
        2,
        "the original's handle sees the clones' handlers"
    );
    let shutdown = {
        let handle = handle.clone();
        tokio::spawn(async move { handle.shutdown(Duration::from_secs(5)).await })
    };
    until("the shutdown has begun", || handle.is_shutting_down()).await;
    for (name, app, _, _) in &apps {
        let refused = send(app, payment(&format!("{name}-new"), "{}")).await;
        assert_eq!(
            rejection(&refused),
            Some(&Rejection::Overloaded),
            "{name}: no new key"
        );
    }
    assert!(shutdown.await.unwrap().is_ok());
    for (name, _, runs, running) in apps {
        assert_eq!(
            runs.finished(),
            1,
            "{name}: the shutdown returned after its handler finished"
        );
        assert_eq!(running.await.unwrap().status, StatusCode::CREATED, "{name}");
    }
}

// Promise 8, for several layers: a layer over this store and one over another join one
// shutdown group; one call stops both and waits for both.
async fn layers_over_two_stores_shut_down_with_one_call(b: Backend) {
    let shutdown = ShutdownHandle::new();
    let here = layer(&b).with_shutdown_handle(&shutdown);
    // Joined before its bound is set: the bound keeps the group.
    let other = IdempotencyLayer::new(MemoryStore::new())
        .with_shutdown_handle(&shutdown)
        .with_max_in_flight(16);
    assert_eq!(here.shutdown_handle(), shutdown);
    assert_eq!(other.shutdown_handle(), shutdown);
    let mut apps = Vec::new();
    for (name, layer) in [("here", here), ("other", other)] {
        let (app, runs) = router(layer);
        let running = spawn_send(&app, slow(&format!("{name}-running"), 600));
        until("its handler runs", || runs.get() == 1).await;
        apps.push((name, app, runs, running));
    }
    assert_eq!(shutdown.running(), 2);
    let stopping = {
        let shutdown = shutdown.clone();
        tokio::spawn(async move { shutdown.shutdown(Duration::from_secs(5)).await })
    };
    until("the shutdown has begun", || shutdown.is_shutting_down()).await;
    for (name, app, _, _) in &apps {
        let refused = send(app, payment(&format!("{name}-new"), "{}")).await;
        assert_eq!(
            rejection(&refused),
            Some(&Rejection::Overloaded),
            "{name}: no new key"
        );
    }
    assert!(stopping.await.unwrap().is_ok());
    for (name, _, runs, running) in apps {
        assert_eq!(runs.finished(), 1, "{name}: waited for");
        assert_eq!(running.await.unwrap().status, StatusCode::CREATED, "{name}");
    }
}

// Promise 8, the deadline
async fn shutdown_reports_handlers_still_running_at_the_deadline(b: Backend) {
    let layer = layer(&b);
    let (app, runs) = router(layer.clone());
    let running = spawn_send(&app, slow("late", 800));
    until("the handler runs", || runs.get() == 1).await;
    let timed_out = layer
        .shutdown_handle()
        .shutdown(Duration::from_millis(100))
        .await
        .unwrap_err();
    assert_eq!(timed_out.running, 1);
    assert_eq!(running.await.unwrap().status, StatusCode::CREATED);
}

// Promise 8, the bound
async fn over_the_in_flight_bound_answers_503_and_claims_nothing(b: Backend) {
    let (app, runs) = router(layer(&b).with_max_in_flight(2));
    let running: Vec<_> = ["b1", "b2"]
        .into_iter()
        .map(|key| spawn_send(&app, slow(key, 800)))
        .collect();
    until("both handlers run", || runs.get() == 2).await;
    let over = send(&app, payment("b3", "{}")).await;
    assert_eq!(over.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(rejection(&over), Some(&Rejection::Overloaded));
    assert!(over.headers.contains_key("retry-after"));
    for task in running {
        task.await.unwrap();
    }
    let later = send(&app, payment("b3", "{}")).await;
    assert_eq!(
        (later.status, later.is_replay()),
        (StatusCode::CREATED, false),
        "b3 was never claimed"
    );
    assert_eq!(runs.get(), 3);
}

// Promise 8: only new work is refused. At the bound and while shutting down, a key already
// done still replays and one running still gets its 409, from one read of the store; the
// running count is exact while a shutdown waits.
async fn at_the_bound_and_in_shutdown_replays_and_409s_are_still_answered(b: Backend) {
    let layer = layer(&b).with_max_in_flight(1);
    let handle = layer.shutdown_handle();
    let (app, runs) = router(layer.clone());
    assert_eq!(
        send(&app, payment("done", "{}")).await.status,
        StatusCode::CREATED
    );
    // Long enough for both rounds of checks below, however slow the machine.
    let busy = spawn_send(&app, slow("busy", 1500));
    until("busy runs", || runs.get() == 2).await;
    assert_eq!(handle.running(), 1, "at the bound");
    let check = |phase: &'static str| {
        let app = app.clone();
        async move {
            let replay = send(&app, payment("done", "{}")).await;
            assert!(
                replay.is_replay(),
                "{phase}: a done key replays: {} {:?}",
                replay.status,
                replay.body
            );
            let other = send(&app, payment("done", "{\"other\":1}")).await;
            assert!(
                matches!(rejection(&other), Some(Rejection::Mismatch { .. })),
                "{phase}: a mismatch is a mismatch"
            );
            let running = send(&app, payment("busy", "{}")).await;
            assert!(
                matches!(rejection(&running), Some(Rejection::InFlight { .. })),
                "{phase}: a running key answers 409"
            );
            let new = send(&app, payment(&format!("new-{phase}"), "{}")).await;
            assert_eq!(
                rejection(&new),
                Some(&Rejection::Overloaded),
                "{phase}: new work is refused"
            );
        }
    };
    check("bound").await;
    let shutdown = {
        let handle = handle.clone();
        tokio::spawn(async move { handle.shutdown(Duration::from_secs(5)).await })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(handle.is_shutting_down());
    assert_eq!(handle.running(), 1, "exact while the shutdown waits");
    check("shutdown").await;
    assert!(shutdown.await.unwrap().is_ok());
    assert_eq!(handle.running(), 0);
    assert_eq!(busy.await.unwrap().status, StatusCode::CREATED);
    assert_eq!(runs.get(), 2, "only done and busy ran");
    for phase in ["bound", "shutdown"] {
        assert!(
            layer
                .inspect(None, &format!("new-{phase}"))
                .await
                .unwrap()
                .is_none(),
            "nothing new claimed"
        );
    }
}

// Promise 8: a fail-open run (the store down, `with_fail_open`) is counted under the bound and
// waited for at shutdown like a claimed one.
async fn fail_open_runs_are_counted_and_waited_for(b: Backend) {
    let down = Arc::new(common::FaultyStore::new(b.store.clone()).with_answer_delay(Duration::from_secs(5)));
    let layer = IdempotencyLayer::new(down)
        .with_store_timeout(Duration::from_millis(50))
        .with_fail_open(true)
        .with_max_in_flight(1);
    let handle = layer.shutdown_handle();
    let (app, runs) = router(layer);
    let unprotected = spawn_send(&app, slow("open-1", 800));
    until("the unprotected handler runs", || runs.get() == 1).await;
    assert_eq!(handle.running(), 1, "counted");
    let over = send(&app, payment("open-2", "{}")).await;
    assert_eq!(rejection(&over), Some(&Rejection::Overloaded), "the bound holds");
    assert_eq!(runs.finished(), 0, "still running when the shutdown starts");
    assert!(handle.shutdown(Duration::from_secs(5)).await.is_ok());
    assert_eq!(runs.finished(), 1, "waited for it");
    assert_eq!(unprotected.await.unwrap().status, StatusCode::CREATED);
}

// Promise 9: in-flight records too
async fn operators_see_the_lease_left_on_a_running_key(b: Backend) {
    let layer = layer(&b).with_lease(Duration::from_secs(10));
    let (app, runs) = router(layer.clone());
    // Inspected once the handler runs, with a second of it left: after a fixed 100 ms wait, a
    // loaded machine once inspected a 400 ms handler's key only once it had completed.
    let running = spawn_send(&app, slow("op-running", 1000));
    until("the handler runs", || runs.get() == 1).await;
    let seen = layer
        .inspect(None, "op-running")
        .await
        .unwrap()
        .expect("in flight");
    assert_eq!(seen.state, RecordState::InFlight);
    assert_eq!(seen.status, None);
    assert!(seen.expires_in <= Duration::from_secs(10) && seen.expires_in > Duration::from_secs(8));
    running.await.unwrap();
    assert_eq!(
        layer.inspect(None, "op-running").await.unwrap().unwrap().status,
        Some(StatusCode::CREATED)
    );
}

/// README, Behaviour row 15 and Settings: "lease (default 30 s)"; `with_lease` | 30 s. A layer
/// with no `with_lease` gives a running request's record 30 s: `inspect` (the record's PTTL on
/// Redis, its expiry column on PostgreSQL) shows 30 s less the time since the claim.
async fn the_default_lease_is_30_s(b: Backend) {
    let layer = layer(&b);
    let (app, runs) = router(layer.clone());
    let running = spawn_send(&app, slow("default-lease", 500));
    until("the handler runs", || runs.get() == 1).await;
    let seen = layer
        .inspect(None, "default-lease")
        .await
        .unwrap()
        .expect("in flight");
    assert_eq!(seen.state, RecordState::InFlight);
    assert!(
        seen.expires_in <= Duration::from_secs(30) && seen.expires_in > Duration::from_secs(28),
        "the lease left: {:?}",
        seen.expires_in
    );
    assert_eq!(running.await.unwrap().status, StatusCode::CREATED);
}

/// docs/guarantees.md, promise 6: "A completion whose first attempt fails is answered at once
/// and carried on in the background, its lease renewed meanwhile, until it lands or the lease
/// ends; if it never lands, an error is logged" (the log: tests/setup_warnings.rs), and the
/// reconciliation hook gets `CompletionFailed` with the response, only then. Each failing
/// attempt takes 300 ms against a 600 ms lease, so the third attempt starts after the lease
/// taken at the claim has run out: it lands only if the lease was renewed meanwhile.
async fn a_failed_completion_is_carried_on_in_the_background_with_its_lease_renewed(b: Backend) {
    let lease = Duration::from_millis(600);
    let fails_for = Duration::from_millis(300);
    let journal = Arc::new(std::sync::Mutex::new(Vec::new()));
    let hook = {
        let journal = journal.clone();
        move |event: &tower_idempotency::ReconciliationEvent| journal.lock().unwrap().push(event.clone())
    };
    // Two failures, then the third attempt lands: stored, and replayed byte-exact.
    let flaky = Arc::new(common::FaultyStore::new(b.store.clone()).with_failing_completions(2, fails_for));
    let (app, runs) = router(
        IdempotencyLayer::new(flaky.clone())
            .with_lease(lease)
            .with_reconciliation(hook.clone()),
    );
    let started = std::time::Instant::now();
    let first = send(&app, payment("tried-twice", "{}")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    // The third attempt comes at least 450 ms after the first failed (50 ms, a 300 ms failure,
    // 100 ms): the client was answered before it.
    assert!(
        flaky.completions() < 3,
        "answered after the first failed attempt, not after {}",
        flaky.completions()
    );
    let replay = loop {
        let replay = send(&app, payment("tried-twice", "{}")).await;
        if replay.status != StatusCode::CONFLICT {
            break replay;
        }
        assert!(started.elapsed() < Duration::from_secs(5), "never stored");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(replay.is_replay(), "{:?}", replay.body);
    assert_eq!(replay.body, first.body);
    assert!(
        started.elapsed() > lease,
        "the third attempt came after the first lease ended"
    );
    assert_eq!(flaky.completions(), 3, "two failed attempts and one that landed");
    assert!(flaky.renewals() >= 1, "renewed while completing");
    assert_eq!(runs.get(), 1);
    assert!(journal.lock().unwrap().is_empty(), "nothing to reconcile");

    // Every attempt fails: the client has its response at once; the attempts go on until the
    // lease ends (renewed, at most a lease after the first failure), then the hook hears of it.
    let down =
        Arc::new(common::FaultyStore::new(b.store.clone()).with_failing_completions(1000, Duration::ZERO));
    let lease = Duration::from_millis(300);
    let (app, runs) = router(
        IdempotencyLayer::new(down.clone())
            .with_lease(lease)
            .with_reconciliation(hook),
    );
    let started = std::time::Instant::now();
    let answer = send(&app, payment("never-stored", "{}")).await;
    assert_eq!(answer.status, StatusCode::CREATED);
    assert_eq!(answer.body, "run 1; echo {}");
    assert!(
        journal.lock().unwrap().is_empty(),
        "nothing reported while the completion goes on"
    );
    let events = loop {
        let events = journal.lock().unwrap().clone();
        if !events.is_empty() {
            break events;
        }
        assert!(started.elapsed() < Duration::from_secs(5), "never reported");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert!(
        started.elapsed() >= lease,
        "reported once the lease ended, not at {:?}",
        started.elapsed()
    );
    assert!(
        down.completions() > 3,
        "tried until the lease ended: {}",
        down.completions()
    );
    assert_eq!(events.len(), 1, "{events:?}");
    assert!(
        matches!(&events[0].kind, tower_idempotency::ReconciliationKind::CompletionFailed { error } if error.contains("injected")),
        "{:?}",
        events[0].kind
    );
    assert_eq!(
        events[0].key,
        RecordKey::new(None, IdempotencyKey::parse("never-stored").unwrap())
    );
    let payload = events[0].payload.as_ref().expect("the response to be stored");
    assert!(payload.windows(answer.body.len()).any(|w| w == answer.body));
    // The claim is left to its lease; a retry then runs the handler again.
    let retry = loop {
        let retry = send(&app, payment("never-stored", "{}")).await;
        if retry.status != StatusCode::CONFLICT {
            break retry;
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "the claim outlived its lease"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!((retry.status, retry.is_replay()), (StatusCode::CREATED, false));
    assert_eq!(runs.get(), 2);
}

/// Issue 35, item 4: a completion carried on in the background keeps its claim's place under
/// the in-flight bound, so a shutdown waits for it (and reports it, at a deadline it outlives),
/// and the result it stores meanwhile is not lost to the process exiting.
async fn a_shutdown_waits_for_a_completion_carried_on_in_the_background(b: Backend) {
    let flaky = Arc::new(
        common::FaultyStore::new(b.store.clone()).with_failing_completions(2, Duration::from_millis(300)),
    );
    let layer = IdempotencyLayer::new(flaky.clone()).with_lease(Duration::from_secs(5));
    let (app, runs) = router(layer.clone());
    let first = send(&app, payment("shut-down-while-storing", "{}")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let handle = layer.shutdown_handle();
    assert_eq!(handle.running(), 1, "the completion still runs");
    let early = handle.shutdown(Duration::from_millis(50)).await.unwrap_err();
    assert_eq!(early.running, 1);
    handle
        .shutdown(Duration::from_secs(5))
        .await
        .expect("the completion ends within the deadline");
    assert_eq!(flaky.completions(), 3, "it landed at its third attempt");
    // Shutting down, the layer still answers a key that is done.
    let replay = send(&app, payment("shut-down-while-storing", "{}")).await;
    assert!(replay.is_replay(), "{} {:?}", replay.status, replay.body);
    assert_eq!(replay.body, first.body);
    assert_eq!(runs.get(), 1);
}

// Promise 10
async fn an_unreadable_stored_response_is_an_error_never_a_replay(b: Backend) {
    let (app, runs) = router(layer(&b));
    let key = RecordKey::new(None, IdempotencyKey::parse("garbled").unwrap());
    let owner = OwnerToken::generate();
    b.store
        .claim(
            &key,
            &fingerprint_of_empty_payment(),
            &owner,
            Duration::from_secs(30),
        )
        .await
        .unwrap();
    let garbage = Bytes::from_static(b"\x00\x01 definitely not a stored response");
    assert!(b
        .store
        .complete(&key, &owner, garbage, Duration::from_secs(60))
        .await
        .unwrap());
    let answer = send(&app, payment("garbled", "{}")).await;
    assert_eq!(answer.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(rejection(&answer), Some(&Rejection::UnreadableRecord));
    assert!(
        !answer.body.windows(10).any(|w| w == b"definitely"),
        "garbage is never replayed"
    );
    assert_eq!(runs.get(), 0);
}

on_both_stores!(
    hundreds_of_concurrent_requests_run_the_handler_once,
    the_default_lease_is_30_s,
    a_failed_completion_is_carried_on_in_the_background_with_its_lease_renewed,
    a_shutdown_waits_for_a_completion_carried_on_in_the_background,
    a_dropped_response_future_does_not_lose_the_work,
    cancel_on_disconnect_cancels_and_releases,
    a_hang_up_during_the_claim_leaves_the_key_free,
    a_panicking_handler_answers_500_and_releases_the_key,
    a_failed_release_is_retried_in_the_background,
    a_long_handler_keeps_its_claim_past_the_lease,
    a_lost_claim_is_fenced_and_never_overwrites_the_new_owner,
    a_crashed_owner_blocks_its_key_only_until_its_lease_ends,
    shutdown_refuses_new_keys_and_waits_for_running_handlers,
    shutdown_reports_handlers_still_running_at_the_deadline,
    a_clone_with_bounds_of_its_own_shuts_down_with_the_original,
    layers_over_two_stores_shut_down_with_one_call,
    over_the_in_flight_bound_answers_503_and_claims_nothing,
    at_the_bound_and_in_shutdown_replays_and_409s_are_still_answered,
    fail_open_runs_are_counted_and_waited_for,
    operators_see_the_lease_left_on_a_running_key,
    an_unreadable_stored_response_is_an_error_never_a_replay,
);
on_postgres!(
    hundreds_of_concurrent_requests_run_the_handler_once,
    the_default_lease_is_30_s,
    a_failed_completion_is_carried_on_in_the_background_with_its_lease_renewed,
    a_dropped_response_future_does_not_lose_the_work,
    cancel_on_disconnect_cancels_and_releases,
    a_hang_up_during_the_claim_leaves_the_key_free,
    a_panicking_handler_answers_500_and_releases_the_key,
    a_failed_release_is_retried_in_the_background,
    a_long_handler_keeps_its_claim_past_the_lease,
    a_lost_claim_is_fenced_and_never_overwrites_the_new_owner,
    a_crashed_owner_blocks_its_key_only_until_its_lease_ends,
    shutdown_refuses_new_keys_and_waits_for_running_handlers,
    shutdown_reports_handlers_still_running_at_the_deadline,
    a_clone_with_bounds_of_its_own_shuts_down_with_the_original,
    layers_over_two_stores_shut_down_with_one_call,
    over_the_in_flight_bound_answers_503_and_claims_nothing,
    at_the_bound_and_in_shutdown_replays_and_409s_are_still_answered,
    fail_open_runs_are_counted_and_waited_for,
    operators_see_the_lease_left_on_a_running_key,
    an_unreadable_stored_response_is_an_error_never_a_replay,
);
