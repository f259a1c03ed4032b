//! The consumer API (`Coordinator::once`, `once_json`, `once_with_ticket`) on every store: what
//! each answer means for the message, that the operation runs once, that an error or a panic
//! gives the key up and a stored business outcome does not, that the lease is renewed while the
//! operation runs, and that a dead store fails closed.

mod common;

use std::future::IntoFuture;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::Backend;
use serde::{Deserialize, Serialize};
use tower_idempotency::{
    Coordinator, Disposition, Error, Fingerprint, IdempotencyKey, Once, RecordKey, StoreError,
};

fn key(k: &str) -> RecordKey {
    RecordKey::new(None, IdempotencyKey::parse(k).unwrap())
}

fn fp(body: &str) -> Fingerprint {
    Fingerprint::new([body.as_bytes()])
}

/// An operation that counts its runs and answers `receipt`.
fn counted(
    runs: &Arc<AtomicUsize>,
    receipt: &'static str,
) -> impl FnOnce() -> std::future::Ready<Result<Bytes, String>> {
    let runs = runs.clone();
    move || {
        runs.fetch_add(1, Ordering::SeqCst);
        std::future::ready(Ok(Bytes::from_static(receipt.as_bytes())))
    }
}

/// Runs `once` on a task of its own, with an operation that counts its run in `runs`, works
/// `work` (forever if `None`), then answers `receipt`.
fn spawn_working(
    coordinator: &Coordinator,
    k: &RecordKey,
    f: Fingerprint,
    runs: &Arc<AtomicUsize>,
    work: Option<Duration>,
    receipt: &'static str,
) -> tokio::task::JoinHandle<Once<Bytes, String>> {
    let (coordinator, k, runs) = (coordinator.clone(), k.clone(), runs.clone());
    tokio::spawn(async move {
        coordinator
            .once(&k, &f, || async move {
                runs.fetch_add(1, Ordering::SeqCst);
                match work {
                    Some(work) => tokio::time::sleep(work).await,
                    None => std::future::pending().await,
                }
                Ok(Bytes::from(receipt))
            })
            .await
    })
}

async fn a_duplicate_is_replayed_and_acknowledged(backend: Backend) {
    let coordinator = Coordinator::from_shared_store(backend.store.clone());
    let (k, f, runs) = (key("dup-1"), fp("amount=5"), Arc::new(AtomicUsize::new(0)));
    let first = coordinator.once(&k, &f, counted(&runs, "receipt-1")).await;
    assert!(
        matches!(&first, Once::Ran(receipt) if receipt == "receipt-1"),
        "{first:?}"
    );
    assert_eq!(first.disposition(), Disposition::Ack);
    for _ in 0..2 {
        let again = coordinator.once(&k, &f, counted(&runs, "receipt-2")).await;
        assert!(
            matches!(&again, Once::Replayed(receipt) if receipt == "receipt-1"),
            "{again:?}"
        );
        assert_eq!(again.disposition(), Disposition::Ack);
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the operation ran once");
}

async fn a_technical_failure_releases_the_key_for_a_redelivery(backend: Backend) {
    let coordinator = Coordinator::from_shared_store(backend.store.clone());
    let (k, f) = (key("fail-1"), fp("amount=5"));
    let failed = coordinator
        .once(&k, &f, || async { Err::<Bytes, _>("the bank timed out") })
        .await;
    assert!(matches!(failed, Once::Failed("the bank timed out")), "{failed:?}");
    assert_eq!(failed.disposition(), Disposition::Retry { after: None });
    // Released at once: the redelivery runs it, no lease to wait out.
    let runs = Arc::new(AtomicUsize::new(0));
    let redelivered = coordinator.once(&k, &f, counted(&runs, "receipt")).await;
    assert!(matches!(redelivered, Once::Ran(_)), "{redelivered:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[derive(Debug, PartialEq, Serialize, Deserialize)]
enum Charge {
    Accepted { receipt: u64 },
    Declined { reason: String },
}

async fn a_business_rejection_is_stored_and_replayed_as_the_same_type(backend: Backend) {
    let coordinator = Coordinator::from_shared_store(backend.store.clone());
    let (k, f, runs) = (key("json-1"), fp("amount=99999"), Arc::new(AtomicUsize::new(0)));
    let charge = || {
        let runs = runs.clone();
        move || async move {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok::<_, String>(Charge::Declined {
                reason: "over the limit".into(),
            })
        }
    };
    let declined = Charge::Declined {
        reason: "over the limit".into(),
    };
    let first = coordinator.once_json(&k, &f, charge()).await;
    assert!(matches!(&first, Once::Ran(c) if *c == declined), "{first:?}");
    let again = coordinator.once_json(&k, &f, charge()).await;
    assert!(matches!(&again, Once::Replayed(c) if *c == declined), "{again:?}");
    assert_eq!(again.disposition(), Disposition::Ack);
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "a stored rejection is never run again"
    );
    // Stored as JSON: a reader of the raw bytes sees it.
    let raw = coordinator
        .once(&k, &f, || async { Ok::<_, String>(Bytes::new()) })
        .await;
    assert!(
        matches!(&raw, Once::Replayed(bytes) if bytes == r#"{"Declined":{"reason":"over the limit"}}"#),
        "{raw:?}"
    );
}

async fn a_stored_result_of_another_type_is_dead_lettered(backend: Backend) {
    let coordinator = Coordinator::from_shared_store(backend.store.clone());
    let (k, f) = (key("json-2"), fp("amount=1"));
    let stored = coordinator
        .once(&k, &f, || async { Ok::<_, String>(Bytes::from("not json")) })
        .await;
    assert!(matches!(stored, Once::Ran(_)));
    let read = coordinator
        .once_json(&k, &f, || async {
            Ok::<_, String>(Charge::Accepted { receipt: 1 })
        })
        .await;
    assert!(
        matches!(&read, Once::Unavailable(Error::Store(StoreError::Corrupt(why))) if why.contains("Charge")),
        "{read:?}"
    );
    assert_eq!(read.disposition(), Disposition::DeadLetter);
}

async fn a_result_that_does_not_encode_is_not_stored_and_the_key_waits_out_its_lease(backend: Backend) {
    let coordinator =
        Coordinator::from_shared_store(backend.store.clone()).with_lease(Duration::from_secs(30));
    let (k, f) = (key("json-3"), fp("amount=1"));
    // serde_json refuses a map whose keys are not strings.
    let unencodable =
        || async { Ok::<_, String>(std::collections::HashMap::from([((1, 2), "value".to_owned())])) };
    let answer = coordinator.once_json(&k, &f, unencodable).await;
    assert!(
        matches!(
            &answer,
            Once::NotStored {
                error: Error::Encode(_),
                ..
            }
        ),
        "{answer:?}"
    );
    assert_eq!(answer.disposition(), Disposition::Ack, "it ran: acknowledge");
    // The key is left to its lease, not released: a duplicate does not run it again at once.
    let runs = Arc::new(AtomicUsize::new(0));
    let duplicate = coordinator.once(&k, &f, counted(&runs, "r")).await;
    assert!(matches!(duplicate, Once::InFlight { .. }), "{duplicate:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 0);
}

async fn a_panic_releases_the_key_before_it_propagates(backend: Backend) {
    let coordinator = Coordinator::from_shared_store(backend.store.clone());
    let (k, f) = (key("panic-1"), fp("amount=5"));
    let panicking = {
        let (coordinator, k, f) = (coordinator.clone(), k.clone(), f);
        tokio::spawn(async move {
            coordinator
                .once(&k, &f, || async {
                    if true {
                        panic!("the operation panicked");
                    }
                    Ok::<Bytes, String>(Bytes::new())
                })
                .await
        })
    };
    let joined = panicking.await.expect_err("the panic goes on up");
    assert!(joined.is_panic());
    // Released before the panic reached the caller: the very next delivery runs it.
    let runs = Arc::new(AtomicUsize::new(0));
    let redelivered = coordinator.once(&k, &f, counted(&runs, "receipt")).await;
    assert!(matches!(redelivered, Once::Ran(_)), "{redelivered:?}");
}

async fn a_different_message_under_a_used_key_is_a_mismatch_to_dead_letter(backend: Backend) {
    let coordinator = Coordinator::from_shared_store(backend.store.clone());
    let (k, runs) = (key("mismatch-1"), Arc::new(AtomicUsize::new(0)));
    let first = coordinator.once(&k, &fp("amount=5"), counted(&runs, "r")).await;
    assert!(matches!(first, Once::Ran(_)));
    let other = coordinator.once(&k, &fp("amount=6"), counted(&runs, "r")).await;
    assert!(matches!(other, Once::Mismatch), "{other:?}");
    assert!(other.result().is_none(), "nothing ran, no result");
    assert_eq!(other.disposition(), Disposition::DeadLetter);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A lease of 300 ms under an operation of 1.2 s: renewed meanwhile, so a duplicate delivered
/// during it is in flight every time (never run beside it), and is told when to come back.
async fn the_lease_is_renewed_while_the_operation_runs(backend: Backend) {
    let lease = Duration::from_millis(300);
    let coordinator = Coordinator::from_shared_store(backend.store.clone()).with_lease(lease);
    let (k, f, runs) = (key("slow-1"), fp("amount=5"), Arc::new(AtomicUsize::new(0)));
    let slow = spawn_working(
        &coordinator,
        &k,
        f,
        &runs,
        Some(Duration::from_millis(1200)),
        "slow receipt",
    );
    common::until("the slow operation starts", || runs.load(Ordering::SeqCst) == 1).await;
    let started = Instant::now();
    while started.elapsed() < Duration::from_millis(900) {
        let duplicate = coordinator.once(&k, &f, counted(&runs, "r")).await;
        match duplicate {
            Once::InFlight { retry_after } => {
                assert!(retry_after <= lease, "{retry_after:?}");
                assert_eq!(
                    duplicate.disposition(),
                    Disposition::Retry {
                        after: Some(retry_after)
                    }
                );
            }
            other => panic!("a duplicate during the operation got {other:?}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(matches!(slow.await.unwrap(), Once::Ran(_)));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// `.wait(...)`: a duplicate waits for the running operation and gets its result.
async fn a_waiting_duplicate_gets_the_running_operations_result(backend: Backend) {
    let coordinator = Coordinator::from_shared_store(backend.store.clone());
    let (k, f, runs) = (key("wait-1"), fp("amount=5"), Arc::new(AtomicUsize::new(0)));
    let first = spawn_working(
        &coordinator,
        &k,
        f,
        &runs,
        Some(Duration::from_millis(300)),
        "first receipt",
    );
    common::until("the first operation starts", || runs.load(Ordering::SeqCst) == 1).await;
    let waited = coordinator
        .once(&k, &f, counted(&runs, "second receipt"))
        .wait(Duration::from_secs(10))
        .await;
    assert!(
        matches!(&waited, Once::Replayed(r) if r == "first receipt"),
        "{waited:?}"
    );
    assert!(matches!(first.await.unwrap(), Once::Ran(_)));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A consumer killed mid-operation (its future dropped, as a cancelled task's is): the key is
/// given up, and the redelivery runs it.
async fn a_dropped_call_gives_the_key_up(backend: Backend) {
    let coordinator = Coordinator::from_shared_store(backend.store.clone());
    let (k, f, runs) = (key("drop-1"), fp("amount=5"), Arc::new(AtomicUsize::new(0)));
    let hung = spawn_working(&coordinator, &k, f, &runs, None, "never");
    common::until("the operation starts", || runs.load(Ordering::SeqCst) == 1).await;
    hung.abort();
    let _ = hung.await;
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match coordinator.once(&k, &f, counted(&runs, "r")).await {
            Once::Ran(_) => break,
            Once::InFlight { .. } if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(20)).await
            }
            other => panic!("after the drop: {other:?}"),
        }
    }
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

/// The claim lost under the operation (purged here; a lease that lapsed is the same): the
/// operation ran, its result is not stored, and the answer says so.
async fn a_lost_claim_is_not_stored_but_acknowledged(backend: Backend) {
    let coordinator = Coordinator::from_shared_store(backend.store.clone());
    let (k, f) = (key("lost-1"), fp("amount=5"));
    let answer = {
        let (purger, k2) = (coordinator.clone(), k.clone());
        coordinator
            .once(&k, &f, || async move {
                assert!(purger.purge(&k2).await.unwrap(), "the record was there to purge");
                Ok::<_, String>(Bytes::from("receipt"))
            })
            .await
    };
    assert!(
        matches!(&answer, Once::NotStored { result, error: Error::ClaimLost } if result == "receipt"),
        "{answer:?}"
    );
    assert_eq!(answer.disposition(), Disposition::Ack);
    assert_eq!(
        answer.result().map(|r| &r[..]),
        Some(&b"receipt"[..]),
        "it ran: its result is there"
    );
}

/// Every test above, on memory and Redis (`on_both_stores!`) and on PostgreSQL (`on_postgres!`).
macro_rules! on_each_store {
    ($($generate:ident),*) => {
        $($generate!(
            a_duplicate_is_replayed_and_acknowledged,
            a_technical_failure_releases_the_key_for_a_redelivery,
            a_business_rejection_is_stored_and_replayed_as_the_same_type,
            a_stored_result_of_another_type_is_dead_lettered,
            a_result_that_does_not_encode_is_not_stored_and_the_key_waits_out_its_lease,
            a_panic_releases_the_key_before_it_propagates,
            a_different_message_under_a_used_key_is_a_mismatch_to_dead_letter,
            the_lease_is_renewed_while_the_operation_runs,
            a_waiting_duplicate_gets_the_running_operations_result,
            a_dropped_call_gives_the_key_up,
            a_lost_claim_is_not_stored_but_acknowledged,
        );)*
    };
}
on_each_store!(on_both_stores, on_postgres);

/// A dead store: nothing runs, and the message is to be delivered again (fail closed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_redis_fails_closed_and_runs_nothing() {
    let mut server = common::RedisServer::start();
    let store = tower_idempotency::RedisStore::connect(&server.url())
        .await
        .expect("connect");
    let coordinator = Coordinator::new(store).with_store_timeout(Duration::from_millis(300));
    server.kill();
    let runs = Arc::new(AtomicUsize::new(0));
    let answer = coordinator
        .once(&key("dead-1"), &fp("amount=5"), counted(&runs, "r"))
        .await;
    assert!(matches!(answer, Once::Unavailable(Error::Store(_))), "{answer:?}");
    assert_eq!(answer.disposition(), Disposition::Retry { after: None });
    assert_eq!(runs.load(Ordering::SeqCst), 0, "nothing ran without the store");
}

/// `once_with_ticket` on PostgreSQL: the effect and the record commit in one transaction; an
/// operation that rolls back leaves neither, and the redelivery runs it.
#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ticket_commits_the_effect_and_the_record_together() {
    let url = tokio::task::spawn_blocking(|| common::postgres::shared().url())
        .await
        .unwrap();
    let store = common::postgres::store(&url).await;
    let ledger = common::postgres::unique_table();
    sqlx::query(&format!("CREATE TABLE {ledger} (id text, amount bigint)"))
        .execute(store.pool())
        .await
        .unwrap();
    let coordinator = Coordinator::new(store.clone());
    let (k, f) = (key("pay-1"), fp("amount=7"));
    let apply = |commit: bool| {
        let (store, ledger) = (store.clone(), ledger.clone());
        move |ticket: tower_idempotency::ClaimTicket| async move {
            let mut transaction = store.pool().begin().await.map_err(|e| e.to_string())?;
            sqlx::query(&format!("INSERT INTO {ledger} VALUES ('pay-1', 7)"))
                .execute(&mut *transaction)
                .await
                .map_err(|e| e.to_string())?;
            let receipt = Bytes::from("receipt-pay-1");
            if !store
                .complete_in(&mut transaction, &ticket, receipt.clone())
                .await
                .map_err(|e| e.to_string())?
            {
                return Err("claim lost".to_owned());
            }
            if !commit {
                transaction.rollback().await.map_err(|e| e.to_string())?;
                return Err("rolled back".to_owned());
            }
            transaction.commit().await.map_err(|e| e.to_string())?;
            Ok(receipt)
        }
    };
    let rows = || async {
        sqlx::query_scalar::<_, i64>(&format!("SELECT count(*) FROM {ledger}"))
            .fetch_one(store.pool())
            .await
            .unwrap()
    };
    let rolled_back = coordinator.once_with_ticket(&k, &f, apply(false)).await;
    assert!(
        matches!(rolled_back, Once::Failed(ref why) if why == "rolled back"),
        "{rolled_back:?}"
    );
    assert_eq!(rows().await, 0, "a rollback leaves no effect");
    let ran = coordinator.once_with_ticket(&k, &f, apply(true)).await;
    assert!(matches!(&ran, Once::Ran(r) if r == "receipt-pay-1"), "{ran:?}");
    let replayed = coordinator.once_with_ticket(&k, &f, apply(true)).await;
    assert!(
        matches!(&replayed, Once::Replayed(r) if r == "receipt-pay-1"),
        "{replayed:?}"
    );
    assert_eq!(rows().await, 1, "one effect, committed with its record");
}

/// `examples/consumer.rs`, run as README says, in memory and on Redis: each delivery's answer
/// and what it means for the message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_consumer_example_answers_each_delivery_as_documented() {
    let expected = [
        "msg-1 (acme): ran -> receipt for msg-1 of acme; ack",
        "msg-2 (acme): failed: the bank did not answer; deliver again",
        "msg-1 (acme): duplicate -> receipt for msg-1 of acme; ack",
        "msg-2 (acme): ran -> receipt for msg-2 of acme; ack",
        "msg-1 (globex): ran -> receipt for msg-1 of globex; ack",
        "msg-2 (acme): same id, different message; dead-letter",
    ];
    let server = common::RedisServer::start();
    for redis_url in [None, Some(server.url())] {
        let mut command = std::process::Command::new(common::example_binary("consumer"));
        command.env_remove("REDIS_URL");
        if let Some(url) = &redis_url {
            command.env("REDIS_URL", url);
        }
        let output = command.output().expect("run examples/consumer");
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(output.status.success(), "{redis_url:?}: {output:?}");
        assert_eq!(stdout.lines().collect::<Vec<_>>(), expected, "{redis_url:?}");
    }
}

/// A store whose completions take `delay` longer than its inner store's: what a Sentinel
/// failover's hold, a queued batch or a retry costs a completion.
struct SlowCompletions {
    inner: tower_idempotency::MemoryStore,
    delay: Duration,
}

impl tower_idempotency::Store for SlowCompletions {
    fn claim<'a>(
        &'a self,
        key: &'a RecordKey,
        fingerprint: &'a Fingerprint,
        owner: &'a tower_idempotency::OwnerToken,
        lease: Duration,
    ) -> tower_idempotency::StoreFuture<'a, tower_idempotency::ClaimOutcome> {
        self.inner.claim(key, fingerprint, owner, lease)
    }
    fn complete<'a>(
        &'a self,
        key: &'a RecordKey,
        owner: &'a tower_idempotency::OwnerToken,
        payload: Bytes,
        retention: Duration,
    ) -> tower_idempotency::StoreFuture<'a, bool> {
        Box::pin(async move {
            tokio::time::sleep(self.delay).await;
            self.inner.complete(key, owner, payload, retention).await
        })
    }
    fn release<'a>(
        &'a self,
        key: &'a RecordKey,
        owner: &'a tower_idempotency::OwnerToken,
    ) -> tower_idempotency::StoreFuture<'a, bool> {
        self.inner.release(key, owner)
    }
    fn renew<'a>(
        &'a self,
        key: &'a RecordKey,
        owner: &'a tower_idempotency::OwnerToken,
        lease: Duration,
    ) -> tower_idempotency::StoreFuture<'a, bool> {
        self.inner.renew(key, owner, lease)
    }
    fn inspect<'a>(
        &'a self,
        key: &'a RecordKey,
    ) -> tower_idempotency::StoreFuture<'a, Option<tower_idempotency::RecordInfo>> {
        self.inner.inspect(key)
    }
    fn purge<'a>(&'a self, key: &'a RecordKey) -> tower_idempotency::StoreFuture<'a, bool> {
        self.inner.purge(key)
    }
    fn watch<'a>(
        &'a self,
        key: &'a RecordKey,
    ) -> tower_idempotency::StoreFuture<'a, Option<tower_idempotency::KeyWatch>> {
        self.inner.watch(key)
    }
}

/// Issue 37: a per-message `tokio::time::timeout` that ends after the effect, while the
/// completion takes 500 ms. The completion goes on without the caller, and the redelivery gets
/// the result. Before, dropping the call released the key: the redelivery got `Ran` and the
/// effect counted twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_goes_on_when_the_caller_gives_up_after_the_effect() {
    let store = SlowCompletions {
        inner: tower_idempotency::MemoryStore::new(),
        delay: Duration::from_millis(500),
    };
    let coordinator = Coordinator::new(store);
    let (k, f, runs) = (key("cancelled-1"), fp("amount=5"), Arc::new(AtomicUsize::new(0)));
    let first = tokio::time::timeout(
        Duration::from_millis(200),
        coordinator.once(&k, &f, counted(&runs, "receipt")),
    )
    .await;
    assert!(first.is_err(), "the completion outlasts the timeout: {first:?}");
    // Waits (a bound far above the completion's 500 ms) for the result rather than answering
    // `InFlight` while the completion is under way.
    let redelivered = coordinator
        .once(&k, &f, counted(&runs, "again"))
        .wait(Duration::from_secs(10))
        .await;
    assert!(
        matches!(&redelivered, Once::Replayed(r) if r == "receipt"),
        "{redelivered:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the effect ran once");
}

/// Issue 37: a closure that panics before it returns its future releases the key before the
/// panic reaches the caller, as a panic inside the future does. A current-thread runtime, so
/// nothing in the background can run between the panic and the look at the record: before,
/// the key was released only by the claim's drop, in a task that had not run yet.
#[tokio::test]
async fn a_closure_that_panics_before_its_future_releases_the_key_first() {
    use futures_util::FutureExt;
    use tower_idempotency::Store;

    let store = tower_idempotency::MemoryStore::new();
    let coordinator = Coordinator::new(store.clone());
    let (k, f) = (key("panic-early-1"), fp("amount=5"));
    let call = coordinator.once(&k, &f, || -> std::future::Ready<Result<Bytes, String>> {
        panic!("the closure panicked before returning its future")
    });
    let panicked = std::panic::AssertUnwindSafe(call.into_future())
        .catch_unwind()
        .await;
    assert!(panicked.is_err(), "the panic goes on up");
    let record = store.inspect(&k).await.unwrap();
    assert!(
        record.is_none(),
        "the key is still held after the panic: {record:?}"
    );
}

/// Issue 37: an operation past its timeout (the call's, then the coordinator's) is cancelled;
/// the answer says to dead-letter, the key is not released (a redelivery is answered
/// `InFlight`, nothing runs twice), and the reconciliation hook hears of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operation_past_its_timeout_is_cancelled_and_its_key_kept() {
    use tower_idempotency::{NotStored, ReconciliationKind};

    let (reported, events) = std::sync::mpsc::channel();
    let coordinator = Coordinator::new(tower_idempotency::MemoryStore::new())
        .with_reconciliation(move |event| reported.send(event.clone()).unwrap());
    let hung = || async {
        std::future::pending::<()>().await;
        Ok::<_, String>(Bytes::new())
    };
    // The bound of this test only turns a hang into a failure: the operation's 200 ms timeout
    // answers long before.
    let bounded = |call| tokio::time::timeout(Duration::from_secs(20), call);
    let by_call = coordinator.clone().with_once_timeout(Duration::MAX);
    let (k, f) = (key("hung-1"), fp("amount=5"));
    let answer = bounded(
        by_call
            .once(&k, &f, hung)
            .timeout(Duration::from_millis(200))
            .into_future(),
    )
    .await
    .expect("answered past the call's timeout");
    assert!(
        matches!(answer, Once::Unavailable(Error::OperationTimedOut(after)) if after == Duration::from_millis(200)),
        "{answer:?}"
    );
    assert_eq!(answer.disposition(), Disposition::DeadLetter);
    let event = events.try_recv().expect("the timeout is reported");
    assert_eq!(event.key, k);
    assert_eq!(
        event.kind,
        ReconciliationKind::NotStorable {
            why: NotStored::TimedOut
        }
    );
    let runs = Arc::new(AtomicUsize::new(0));
    let redelivered = coordinator.once(&k, &f, counted(&runs, "r")).await;
    assert!(matches!(redelivered, Once::InFlight { .. }), "{redelivered:?}");
    assert_eq!(
        runs.load(Ordering::SeqCst),
        0,
        "the key is kept: nothing runs again"
    );

    let by_coordinator = coordinator.with_once_timeout(Duration::from_millis(200));
    let k = key("hung-2");
    let answer = bounded(by_coordinator.once(&k, &f, hung).into_future())
        .await
        .expect("answered past the coordinator's timeout");
    assert!(
        matches!(answer, Once::Unavailable(Error::OperationTimedOut(_))),
        "{answer:?}"
    );
}

/// Issue 37, on Redis Sentinel: the operation returns while a failover begins, so its completion
/// waits at the store's fence; the consumer gives up on the call there (a per-message timeout,
/// a shutdown). The completion goes on without it, to the new master, and the redelivery gets
/// the result. Before, dropping the call released the key (the release too waited out the
/// fence, then went to the new master): the redelivery ran the effect again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_held_at_a_failovers_fence_goes_on_when_the_caller_gives_up() {
    use common::sentinel::SentinelTopology;
    use tower_idempotency::{RedisStore, Store};

    let topology = tokio::task::spawn_blocking(SentinelTopology::start)
        .await
        .unwrap();
    let store = Arc::new(RedisStore::connect(&topology.url()).await.expect("connect"));
    // A lease long enough for the claim to outlast the failover without a renewal.
    let coordinator = Coordinator::from_shared_store(store.clone()).with_lease(Duration::from_secs(30));
    let (k, f, runs) = (key("fenced-1"), fp("amount=5"), Arc::new(AtomicUsize::new(0)));
    let topology = Arc::new(topology);
    let (returned, has_returned) = tokio::sync::oneshot::channel();
    let first = {
        let (coordinator, k, f, runs, topology, store) = (
            coordinator.clone(),
            k.clone(),
            f,
            runs.clone(),
            topology.clone(),
            store.clone(),
        );
        tokio::spawn(async move {
            coordinator
                .once(&k, &f, || async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    // The effect is done; the master fails over before its completion is sent.
                    tokio::task::spawn_blocking(move || topology.failover())
                        .await
                        .unwrap();
                    common::until("the store raises its fence", || store.writes_held().is_some()).await;
                    let _ = returned.send(());
                    Ok::<_, String>(Bytes::from("receipt"))
                })
                .await
        })
    };
    has_returned.await.expect("the operation returned");
    // Give the call a moment to reach the fence with its completion, then drop it there.
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(
        store.writes_held().is_some(),
        "the fence came down before the call was dropped"
    );
    first.abort();
    assert!(
        first.await.unwrap_err().is_cancelled(),
        "dropped before it answered"
    );
    // Delivered again until the store takes claims again (refused while the fence stands).
    let deadline = Instant::now() + Duration::from_secs(30);
    let redelivered = loop {
        let answer = coordinator
            .once(&k, &f, counted(&runs, "again"))
            .wait(Duration::from_secs(30))
            .await;
        match answer {
            Once::Unavailable(Error::Store(error)) if error.is_fence() && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            answer => break answer,
        }
    };
    assert!(
        matches!(&redelivered, Once::Replayed(r) if r == "receipt"),
        "{redelivered:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the effect ran once");
}

/// `Once::hold_through_outage`: the call is made again while the store is unavailable, 0.5 s
/// then 1 s apart, until another answer; an answer to dead-letter and a coordinator shutting
/// down are not held; a done `stop` ends the hold with the last `Unavailable`; an `InFlight`
/// is held after an outage, not before one. (Paused time: the pauses cost nothing.)
#[tokio::test(start_paused = true)]
async fn a_consumer_holds_a_message_through_a_store_outage() {
    let calls = std::cell::Cell::new(0);
    let outage_then_ran = || {
        calls.set(calls.get() + 1);
        std::future::ready(if calls.get() <= 2 {
            Once::Unavailable(Error::AtCapacity)
        } else {
            Once::<Bytes, String>::Ran(Bytes::from("receipt"))
        })
    };
    let started = tokio::time::Instant::now();
    let answer = Once::hold_through_outage(outage_then_ran, std::future::pending()).await;
    assert!(matches!(&answer, Once::Ran(r) if r == "receipt"), "{answer:?}");
    assert_eq!(calls.get(), 3);
    assert_eq!(started.elapsed(), Duration::from_millis(1500), "0.5 s, then 1 s");

    calls.set(0);
    let answer = Once::hold_through_outage(outage_then_ran, std::future::ready(())).await;
    assert!(
        matches!(answer, Once::Unavailable(Error::AtCapacity)),
        "{answer:?}"
    );
    assert_eq!(calls.get(), 1, "a shutdown ends the hold at once");

    let timed_out = || {
        std::future::ready(Once::<Bytes, String>::Unavailable(Error::OperationTimedOut(
            Duration::from_secs(1),
        )))
    };
    let answer = Once::hold_through_outage(timed_out, std::future::pending()).await;
    assert_eq!(
        answer.disposition(),
        Disposition::DeadLetter,
        "not held: {answer:?}"
    );
    let shutting_down = || std::future::ready(Once::<Bytes, String>::Unavailable(Error::ShuttingDown));
    // Bounded, so a hold that never ends fails (in paused time, an hour costs nothing).
    let held = Once::hold_through_outage(shutting_down, std::future::pending());
    let answer = tokio::time::timeout(Duration::from_secs(3600), held)
        .await
        .expect("a shutdown is not held");
    assert!(
        matches!(answer, Once::Unavailable(Error::ShuttingDown)),
        "not held: {answer:?}"
    );

    // An `InFlight` right after an outage is held (it may be the call's own claim, which timed
    // out and landed once the store came back); one with no outage before it is answered.
    calls.set(0);
    let outage_then_in_flight = || {
        calls.set(calls.get() + 1);
        std::future::ready(match calls.get() {
            1 => Once::Unavailable(Error::AtCapacity),
            2 => Once::InFlight {
                retry_after: Duration::from_secs(1),
            },
            _ => Once::<Bytes, String>::Replayed(Bytes::from("receipt")),
        })
    };
    let answer = Once::hold_through_outage(outage_then_in_flight, std::future::pending()).await;
    assert!(
        matches!(&answer, Once::Replayed(r) if r == "receipt"),
        "{answer:?}"
    );
    assert_eq!(calls.get(), 3);
    calls.set(0);
    let in_flight = || {
        calls.set(calls.get() + 1);
        std::future::ready(Once::<Bytes, String>::InFlight {
            retry_after: Duration::from_secs(1),
        })
    };
    let answer = Once::hold_through_outage(in_flight, std::future::pending()).await;
    assert!(matches!(answer, Once::InFlight { .. }), "{answer:?}");
    assert_eq!(calls.get(), 1, "not held without an outage");
}

/// Issue 37, on the Redis store's coalescer: 200 messages at once, each call dropped as soon as
/// its operation has returned, when its completion has just been queued for the coalescing
/// task's next batch (200 calls keep commands outstanding, so completions queue rather than go
/// at once). Every completion goes on, and every redelivery gets its result.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_queued_in_the_coalescer_go_on_when_their_callers_give_up() {
    const MESSAGES: usize = 200;
    let server = common::RedisServer::start();
    let store = tower_idempotency::RedisStore::connect(&server.url())
        .await
        .expect("connect");
    let coordinator = Coordinator::new(store);
    let runs = Arc::new(AtomicUsize::new(0));
    let mut calls = tokio::task::JoinSet::new();
    for message in 0..MESSAGES {
        let (coordinator, runs) = (coordinator.clone(), runs.clone());
        calls.spawn(async move {
            let (k, f) = (key(&format!("queued-{message}")), fp("amount=1"));
            let (returned, has_returned) = tokio::sync::oneshot::channel();
            let call = coordinator.once(&k, &f, || async move {
                runs.fetch_add(1, Ordering::SeqCst);
                let _ = returned.send(());
                Ok::<_, String>(Bytes::from("receipt"))
            });
            // The call first: it runs the operation and queues the completion; the signal,
            // ready by then, drops the call in the same poll.
            tokio::select! {
                biased;
                answer = call.into_future() => panic!("answered before it could be dropped: {answer:?}"),
                _ = has_returned => {}
            }
        });
    }
    while let Some(joined) = calls.join_next().await {
        joined.expect("a call");
    }
    assert_eq!(runs.load(Ordering::SeqCst), MESSAGES);
    let mut not_replayed = Vec::new();
    for message in 0..MESSAGES {
        let (k, f) = (key(&format!("queued-{message}")), fp("amount=1"));
        let redelivered = coordinator
            .once(&k, &f, counted(&runs, "again"))
            .wait(Duration::from_secs(10))
            .await;
        if !matches!(&redelivered, Once::Replayed(r) if r == "receipt") {
            not_replayed.push((message, redelivered));
        }
    }
    assert!(
        not_replayed.is_empty(),
        "{} of {MESSAGES} redeliveries not replayed: {not_replayed:?}",
        not_replayed.len()
    );
    assert_eq!(runs.load(Ordering::SeqCst), MESSAGES, "every effect ran once");
}
