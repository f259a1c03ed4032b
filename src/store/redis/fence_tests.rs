//! The Sentinel fence (`sentinel::Fence`) held longer than the coordinator's bound on a
//! store call, through the real coordinator, HTTP layer and `RedisStore`, against a real
//! `redis-server`. The fence is raised and lowered by the test (a failover whose end comes late,
//! as after a full resync), since the sentinels of a real one lower it within about a second.

use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::sentinel::{self, Fence};
use super::RedisStore;
use crate::{
    Begin, Coordinator, Fingerprint, IdempotencyKey, IdempotencyLayer, ReconciliationKind, RecordKey,
};

/// The coordinator's bound on one store call (its default store timeout, 2 s, plus 100 ms of
/// grace), and how many times it tries a completion.
const STORE_CALL_BOUND: Duration = Duration::from_millis(2100);
const COMPLETE_ATTEMPTS: u32 = 3;

/// A `redis-server` of the test's own on a free loopback port, killed when dropped (the crate's
/// tests against real servers use it: `acknowledged.rs` too).
pub(super) struct Server {
    port: u16,
    child: Child,
}

impl Server {
    pub(super) fn start() -> Self {
        for _ in 0..5 {
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|listener| listener.local_addr())
                .expect("a free port")
                .port();
            assert_ne!(port, 6379, "tests never use the default Redis port");
            let binary = std::env::var("REDIS_SERVER_BIN").unwrap_or_else(|_| "redis-server".into());
            let mut child = Command::new(&binary)
                .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", ""])
                .args(["--appendonly", "no", "--daemonize", "no", "--loglevel", "warning"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap_or_else(|error| panic!("cannot run `{binary}` ({error}): install redis-server"));
            let deadline = Instant::now() + Duration::from_secs(5);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = child.try_wait() {
                    break; // the port was taken meanwhile
                }
                if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                    return Self { port, child };
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        panic!("could not start redis-server on a free port after 5 tries");
    }

    pub(super) fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A store on `server` whose Sentinel fence the test holds.
async fn fenced_store(server: &Server) -> (RedisStore, Arc<Fence>) {
    let mut store = RedisStore::connect(&server.url()).await.expect("connect");
    let (watch, fence) = sentinel::held_by_test();
    store.switch_watch = Some(Arc::new(watch));
    (store, fence)
}

fn key(name: &str) -> RecordKey {
    RecordKey::new(None, IdempotencyKey::parse(name).expect("a valid key"))
}

/// A completion held at a fence that stands longer than the coordinator's attempts at it (3 ×
/// the 2.1 s bound) waits, and stores its result the moment the fence is lowered: nothing is
/// abandoned, nothing reported. Before, each attempt timed out at the fence, and after the third
/// the result was given up (`CompletionFailed`) and the key left to run again after its lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_held_at_a_long_fence_stores_its_result_when_it_is_lowered() {
    let server = Server::start();
    let (store, fence) = fenced_store(&server).await;
    let events = Arc::new(Mutex::new(Vec::new()));
    let journal = events.clone();
    let coordinator = Coordinator::new(store)
        .with_lease(Duration::from_secs(20))
        .with_reconciliation(move |event| journal.lock().expect("the journal").push(event.kind.clone()));
    let (key, fingerprint) = (key("held-completion"), Fingerprint::new([b"{}".as_slice()]));
    let Ok(Begin::Claimed(claim)) = coordinator.begin(&key, &fingerprint).await else {
        panic!("a new key is claimed");
    };

    fence.set_raised_by_test(true);
    let mut completing = tokio::spawn(claim.complete("the result".into()));
    // Longer than every attempt the coordinator makes, with their pauses.
    let fence_stands = STORE_CALL_BOUND * COMPLETE_ATTEMPTS + Duration::from_secs(1);
    let early = tokio::time::timeout(fence_stands, &mut completing).await;
    assert!(
        early.is_err(),
        "the completion ended while the fence stood: {:?}",
        early.map(|joined| joined.map(|completed| completed.map_err(|error| error.to_string())))
    );
    fence.set_raised_by_test(false);
    let completed = tokio::time::timeout(Duration::from_secs(5), completing)
        .await
        .expect("the completion lands once the fence is lowered")
        .expect("the completion task");
    assert!(completed.is_ok(), "{completed:?}");
    match coordinator.begin(&key, &fingerprint).await {
        Ok(Begin::Completed(stored)) => assert_eq!(stored, "the result"),
        other => panic!("the key replays its result, not {other:?}"),
    }
    let reported: Vec<ReconciliationKind> = events.lock().expect("the journal").clone();
    assert!(reported.is_empty(), "nothing is to reconcile: {reported:?}");
}

/// A renewal that comes while the fence stands waits at it and renews the moment it is lowered,
/// so a fence longer than the 2.1 s bound, but shorter than the lease left, costs the claim
/// nothing. Before, the renewal timed out at the fence and the next came a third of the lease
/// later: after the lease had run out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewal_held_at_a_fence_renews_the_moment_it_is_lowered() {
    const LEASE: Duration = Duration::from_secs(6);
    let server = Server::start();
    let (store, fence) = fenced_store(&server).await;
    let coordinator = Coordinator::new(store).with_lease(LEASE);
    let (key, fingerprint) = (key("held-renewal"), Fingerprint::new([b"{}".as_slice()]));
    let Ok(Begin::Claimed(claim)) = coordinator.begin(&key, &fingerprint).await else {
        panic!("a new key is claimed");
    };
    let claimed = Instant::now();

    // Up over the first renewal (a third of the lease in) and its 2.1 s bound.
    fence.set_raised_by_test(true);
    tokio::time::sleep(LEASE / 3 + STORE_CALL_BOUND + Duration::from_millis(400)).await;
    fence.set_raised_by_test(false);
    let lowered = claimed.elapsed();
    // The lease the claim began with has `LEASE - lowered` left; a renewal gives it all again.
    let renewed = async {
        loop {
            let record = coordinator.inspect(&key).await.expect("inspect");
            match record {
                Some(record) if record.expires_in > LEASE - lowered + Duration::from_secs(1) => return,
                Some(_) => tokio::time::sleep(Duration::from_millis(20)).await,
                None => panic!("the claim expired: it was not renewed after the fence"),
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(1), renewed)
        .await
        .expect("renewed within a second of the fence's lowering");
    assert!(!claim.is_lost());
    claim
        .complete("done".into())
        .await
        .expect("the claim is still held");
}

/// A claim refused at the fence is never answered by running the handler unprotected, even with
/// fail-open: the store is up, and the claim could be lost with the old master.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_refused_at_the_fence_is_answered_503_even_with_fail_open() {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use http::{Request, StatusCode};
    use tower::ServiceExt;

    let server = Server::start();
    let (store, fence) = fenced_store(&server).await;
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = runs.clone();
    let app = axum::Router::new()
        .route(
            "/payments",
            axum::routing::post(move || {
                counted.fetch_add(1, Ordering::SeqCst);
                async { (StatusCode::CREATED, "paid") }
            }),
        )
        .layer(IdempotencyLayer::new(store).with_fail_open(true));
    let pay = || {
        Request::post("/payments")
            .header("idempotency-key", "fenced")
            .body(axum::body::Body::from("{}"))
            .expect("a request")
    };

    fence.set_raised_by_test(true);
    let refused = app.clone().oneshot(pay()).await.expect("an answer");
    assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        refused.extensions().get::<crate::Rejection>(),
        Some(&crate::Rejection::StoreUnavailable)
    );
    assert_eq!(
        runs.load(Ordering::SeqCst),
        0,
        "the handler ran unprotected at the fence"
    );

    fence.set_raised_by_test(false);
    let created = app.oneshot(pay()).await.expect("an answer");
    assert_eq!(created.status(), StatusCode::CREATED);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}
