//! What a Redis disconnect logs (issue 38, item 4): fred, the client under the store, logs each
//! one at `WARN` itself (`Broadcasting error … from …`, through the `log` crate, target
//! `fred::…`), beside the store's own line. fred has no setting for its log level, so
//! docs/operators.md gives the filter that keeps only the store's line: this test holds that
//! filter to what fred and the store really log.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::app::{payment, router, send};
use common::proxy::{Fault, FaultProxy};
use common::{client, RedisServer};
use http::StatusCode;
use tower_idempotency::IdempotencyLayer;
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

/// The filter docs/operators.md gives, as `RUST_LOG` would.
const DOCUMENTED_FILTER: &str = "warn,fred=error";

/// Keeps the target of each event it is shown.
#[derive(Clone, Default)]
struct Targets(Arc<Mutex<Vec<String>>>);

/// A `log` record's own target (tracing-log puts it in the field `log.target`; the event's
/// metadata says `log`).
struct LogTarget(Option<String>);

impl tracing::field::Visit for LogTarget {
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        if field.name() == "log.target" {
            self.0 = Some(value.to_owned());
        }
    }

    fn record_debug(&mut self, _: &tracing::field::Field, _: &dyn std::fmt::Debug) {}
}

impl<S: tracing::Subscriber> Layer<S> for Targets {
    fn on_event(&self, event: &tracing::Event<'_>, _: Context<'_, S>) {
        let mut target = LogTarget(None);
        event.record(&mut target);
        let target = target.0.unwrap_or_else(|| event.metadata().target().to_owned());
        self.0.lock().unwrap().push(target);
    }
}

impl Targets {
    fn seen(&self) -> Vec<String> {
        self.0.lock().unwrap().clone()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_documented_filter_keeps_the_stores_line_of_a_disconnect_and_drops_freds() {
    let (all, filtered) = (Targets::default(), Targets::default());
    // `init` also routes the `log` crate's records (fred's) into tracing.
    tracing_subscriber::registry()
        .with(
            all.clone()
                .with_filter(tracing_subscriber::filter::LevelFilter::WARN),
        )
        .with(filtered.clone().with_filter(EnvFilter::new(DOCUMENTED_FILTER)))
        .init();

    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.addr()).await;
    let timeout = Duration::from_millis(300);
    let store = common::redis_store(client(&proxy.url()).await).with_command_timeout(timeout);
    let (app, _) = router(IdempotencyLayer::new(store).with_store_timeout(timeout));
    assert_eq!(
        send(&app, payment("before", "{}")).await.status,
        StatusCode::CREATED
    );
    proxy.set(Fault::Drop);
    // The proxy cuts its open connection from its own task: a request sent at once may still
    // get through on it (a 201, seen on a loaded machine), so ask with new keys until one
    // meets the cut.
    let mut statuses = Vec::new();
    for attempt in 0..20 {
        let status = send(&app, payment(&format!("during-{attempt}"), "{}"))
            .await
            .status;
        statuses.push(status);
        if status == StatusCode::SERVICE_UNAVAILABLE {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        statuses.last(),
        Some(&StatusCode::SERVICE_UNAVAILABLE),
        "a request meets the disconnect: {statuses:?}"
    );
    proxy.set(Fault::None);

    let fred = |targets: &[String]| targets.iter().filter(|t| t.starts_with("fred")).count();
    let ours = |targets: &[String]| {
        targets
            .iter()
            .filter(|t| t.starts_with("tower_idempotency"))
            .count()
    };
    let (all, filtered) = (all.seen(), filtered.seen());
    assert!(
        fred(&all) >= 1,
        "fred logs the disconnect at WARN itself: {all:?}"
    );
    assert!(ours(&all) >= 1, "and the store logs its own line: {all:?}");
    assert_eq!(
        fred(&filtered),
        0,
        "{DOCUMENTED_FILTER} leaves none of fred's: {filtered:?}"
    );
    assert_eq!(
        ours(&filtered),
        ours(&all),
        "and every one of the store's: {filtered:?}"
    );
}
