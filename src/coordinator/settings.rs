//! What a coordinator, its clones and its claims share: the store, the settings, and the calls
//! to the store that every part makes the same way (bounded by the store timeout, held during a
//! failover, released in the background).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tracing::Instrument;

use super::running::Tracker;
use super::waiting::Waiters;
use crate::key::RecordKey;
use crate::reconciliation::Reconciler;
use crate::store::{OwnerToken, Store, StoreError};
use crate::telemetry::{Named, StoreOp, StoreTimer};

pub(super) const DEFAULT_LEASE: Duration = Duration::from_secs(30);
pub(super) const DEFAULT_RETENTION: Duration = Duration::from_secs(24 * 60 * 60);
pub(super) const DEFAULT_STORE_TIMEOUT: Duration = Duration::from_secs(2);
pub(super) const DEFAULT_MAX_IN_FLIGHT: u32 = 10_000;
/// A minute, as the HTTP layer's handler timeout: far above what a consumer's operation
/// normally takes (a charge, an email, a few queries), far below what a broker waits for an
/// unacknowledged message (RabbitMQ's `consumer_timeout` is 30 min), so a hung operation gives
/// its message back long before the broker takes it away.
pub(super) const DEFAULT_ONCE_TIMEOUT: Duration = Duration::from_secs(60);
/// Added to the store timeout before the coordinator gives up on a call itself.
pub(super) const STORE_TIMEOUT_GRACE: Duration = Duration::from_millis(100);
/// When a background release is tried, counted from the previous try.
pub(super) const RELEASE_RETRY_DELAYS_MS: [u64; 3] = [0, 500, 1500];

/// A coordinator's settings and parts, shared by its clones and its claims behind one `Arc`.
#[derive(Clone)]
pub(super) struct Settings {
    pub(super) store: Arc<dyn Store>,
    pub(super) lease: Duration,
    pub(super) retention: Duration,
    pub(super) store_timeout: Duration,
    /// How long the operation of a `once` call may run before it is cancelled.
    pub(super) once_timeout: Duration,
    pub(super) tracker: Arc<Tracker>,
    /// The application's reconciliation hook and the metrics name, if either is set.
    pub(super) reconciler: Option<Reconciler>,
    /// The `name` label of this coordinator's metrics, with its keys, if it has a name.
    pub(super) named: Option<Arc<Named>>,
    pub(super) waiters: Arc<Waiters>,
}

impl Settings {
    /// Bounds a store call by the store timeout plus a little grace, so a store that enforces the
    /// same timeout itself (as `RedisStore` does) reports it first: `fred` then forgets the
    /// command, where a future dropped from outside would leave it queued to be sent late.
    /// Timed as `op` when anyone reads the times (see `telemetry`).
    pub(super) async fn bounded<T>(
        &self,
        op: StoreOp,
        call: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let timer = StoreTimer::start(op, self.named.as_deref());
        let answer = tokio::time::timeout(self.store_timeout + STORE_TIMEOUT_GRACE, call)
            .await
            .unwrap_or(Err(StoreError::Timeout(self.store_timeout)));
        timer.finish();
        answer
    }

    /// Waits while the store holds its owners' writes back on purpose (a Sentinel failover:
    /// [`Store::writes_held`]), outside the store timeout, for at most a lease: a claim the
    /// store took no renewal of for that long is gone anyway. Answers `false` if it stopped
    /// waiting at that limit. Nothing at all (no timer, no allocation) when nothing is held.
    pub(super) async fn until_store_takes_writes(&self) -> bool {
        let Some(held) = self.store.writes_held() else {
            return true;
        };
        tracing::debug!("the store holds writes back (a failover is under way); waiting until it takes them");
        tokio::time::timeout(self.lease, held).await.is_ok()
    }

    /// Whether the store holds its owners' writes back now (asked after a failed write).
    pub(super) fn store_holds_writes(&self) -> bool {
        self.store.writes_held().is_some()
    }

    /// Releases `owner`'s claim from a task of its own, for claims whose holder is gone (dropped,
    /// cancelled) or whose outcome is unknown (the claim failed in transit).
    ///
    /// A claim that timed out may still be executed later, and after a reconnect a release sent on
    /// the new connection can overtake it. So a release that finds nothing is tried again a few
    /// times over about two seconds; releases are owner-checked, so a late one never touches
    /// another owner's record.
    pub(super) fn release_in_background(self: &Arc<Self>, key: RecordKey, owner: OwnerToken) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::warn!(
                ?key,
                "no Tokio runtime to release a claim; it ends with its lease"
            );
            return;
        };
        let settings = self.clone();
        let releasing = async move {
            for delay_ms in RELEASE_RETRY_DELAYS_MS {
                tokio::time::sleep(Duration::from_millis(delay_ms)).await;
                settings.until_store_takes_writes().await;
                match settings
                    .bounded(StoreOp::Release, settings.store.release(&key, &owner))
                    .await
                {
                    Ok(true) => return,
                    Ok(false) => tracing::trace!(?key, "nothing to release yet"),
                    Err(error) => tracing::debug!(?key, %error, "could not release a claim; trying again"),
                }
            }
        };
        runtime.spawn(releasing.instrument(tracing::Span::current()));
    }
}
