//! The operations a coordinator runs: the bound on how many run at once, and the shutdown that
//! stops new ones and waits for those running.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;

use super::error::Error;
use crate::sync::lock;
use crate::telemetry::{self, Named};

/// Lease, retention and every wait are capped here, far beyond any sane setting, so deadline arithmetic
/// cannot overflow (and Redis accepts the TTL).
pub(super) const MAX_DURATION: Duration = Duration::from_secs(400 * 24 * 60 * 60);

/// Counts the operations running under one in-flight bound (a coordinator and its clones,
/// until one sets its own bound), bounds them, and tells a shutdown of its group when the last
/// one has finished.
pub(super) struct Tracker {
    running: AtomicUsize,
    /// Woken when `running` drops to zero.
    idle: Notify,
    pub(super) max: u32,
    /// The shutdown this bound belongs to, shared whatever the bound.
    pub(super) group: Arc<Group>,
}

impl Tracker {
    /// A new bound of `max` in `group`, which from now on waits for its operations too.
    pub(super) fn join(group: &Arc<Group>, max: u32) -> Arc<Self> {
        let tracker = Arc::new(Self {
            running: AtomicUsize::new(0),
            idle: Notify::new(),
            max,
            group: group.clone(),
        });
        // Every change is one push or one retain: the list behind a poisoned lock is sound.
        let mut members = lock(&group.members);
        // A bound no coordinator uses any more has nothing running: forget it.
        members.retain(|member| member.strong_count() > 0);
        members.push(Arc::downgrade(&tracker));
        drop(members);
        tracker
    }
}

/// What one shutdown stops and waits for: every bound that joined it (a coordinator, its
/// clones whatever their settings, and any other coordinator or layer given the same
/// [`ShutdownHandle`]).
#[derive(Default)]
pub(super) struct Group {
    closing: AtomicBool,
    /// Weak: a bound lives as long as a coordinator or a running operation uses it.
    members: std::sync::Mutex<Vec<std::sync::Weak<Tracker>>>,
}

impl Group {
    fn members(&self) -> Vec<Arc<Tracker>> {
        lock(&self.members)
            .iter()
            .filter_map(std::sync::Weak::upgrade)
            .collect()
    }
}

/// One running operation's place under the bound; counted until dropped.
pub(crate) struct Slot {
    tracker: Arc<Tracker>,
    /// The coordinator's metrics name, for the `idempotency_running` gauge.
    named: Option<Arc<Named>>,
}

impl Slot {
    /// A place for new work, unless shutting down or at the bound.
    pub(super) fn take(tracker: &Arc<Tracker>, named: Option<&Arc<Named>>) -> Result<Self, Error> {
        // Counted before the shutdown flag is read (both sequentially consistent, as in
        // `ShutdownHandle::shutdown`, which sets the flag before it reads the count): either the
        // shutdown sees this operation and waits for it, or this sees the shutdown and refuses.
        let before = tracker.running.fetch_add(1, Ordering::SeqCst);
        telemetry::running(1.0, named.map(|named| &**named));
        // Built first, so a refusal is undone by its drop.
        let slot = Self {
            tracker: tracker.clone(),
            named: named.cloned(),
        };
        if tracker.group.closing.load(Ordering::SeqCst) {
            return Err(Error::ShuttingDown);
        }
        if before >= tracker.max as usize {
            return Err(Error::AtCapacity);
        }
        Ok(slot)
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        telemetry::running(-1.0, self.named.as_deref());
        if self.tracker.running.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.tracker.idle.notify_waiters();
        }
    }
}

/// Stops a coordinator (or layer) taking new keys and waits for the operations it runs.
///
/// Operations keep running after their client hangs up; call [`shutdown`](ShutdownHandle::shutdown)
/// before the process exits so their results are stored.
///
/// A handle covers a group: a coordinator or layer and all its clones, whatever settings a clone
/// was given (its own `with_max_in_flight` included), and any other coordinator or layer put in
/// the group with `with_shutdown_handle`. Handles to one group compare equal.
///
/// ```
/// # use std::time::Duration;
/// # use tower_idempotency::{IdempotencyLayer, MemoryStore};
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let layer = IdempotencyLayer::new(MemoryStore::new());
/// let handle = layer.shutdown_handle();
/// // ... serve with `layer`, then on SIGTERM:
/// handle.shutdown(Duration::from_secs(10)).await.expect("handlers finished in time");
/// # }
/// ```
///
/// Several layers, over different stores, shut down with one call:
///
/// ```
/// # use std::time::Duration;
/// # use tower_idempotency::{IdempotencyLayer, MemoryStore, ShutdownHandle};
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let shutdown = ShutdownHandle::new();
/// let payments = IdempotencyLayer::new(MemoryStore::new()).with_shutdown_handle(&shutdown);
/// let emails = IdempotencyLayer::new(MemoryStore::new()).with_shutdown_handle(&shutdown);
/// // ... serve with both, then on SIGTERM:
/// shutdown.shutdown(Duration::from_secs(10)).await.expect("handlers finished in time");
/// assert!(payments.shutdown_handle().is_shutting_down() && emails.shutdown_handle().is_shutting_down());
/// # }
/// ```
#[derive(Clone, Default)]
pub struct ShutdownHandle {
    pub(super) group: Arc<Group>,
}

impl PartialEq for ShutdownHandle {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.group, &other.group)
    }
}

impl Eq for ShutdownHandle {}

impl std::fmt::Debug for ShutdownHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShutdownHandle")
            .field("running", &self.running())
            .field("shutting_down", &self.is_shutting_down())
            .finish()
    }
}

/// Operations were still running when the shutdown deadline passed; see [`ShutdownHandle`].
///
/// ```
/// use tower_idempotency::ShutdownTimedOut;
/// let error = ShutdownTimedOut { running: 2 };
/// assert!(error.to_string().starts_with("2 idempotent operations"));
/// ```
#[derive(Debug, thiserror::Error)]
#[error("{running} idempotent operations were still running at the shutdown deadline")]
pub struct ShutdownTimedOut {
    /// How many were still running.
    pub running: usize,
}

impl ShutdownHandle {
    /// A shutdown group of its own, for coordinators and layers to join with
    /// `with_shutdown_handle` (see [`Coordinator::with_shutdown_handle`](crate::Coordinator::with_shutdown_handle)); the same as
    /// [`ShutdownHandle::default`].
    pub fn new() -> Self {
        Self::default()
    }

    /// How many claimed operations are running now, in the whole group.
    pub fn running(&self) -> usize {
        self.group
            .members()
            .iter()
            .map(|tracker| tracker.running.load(Ordering::Acquire))
            .sum()
    }

    /// Whether [`shutdown`](ShutdownHandle::shutdown) was called.
    pub fn is_shutting_down(&self) -> bool {
        self.group.closing.load(Ordering::Acquire)
    }

    /// Stops taking new keys in the whole group (they get [`Error::ShuttingDown`], over HTTP a
    /// 503; keys already done or running are still answered) and waits up to `deadline` for
    /// the running operations to finish and store their results. [`running`](ShutdownHandle::running)
    /// stays exact meanwhile.
    pub async fn shutdown(&self, deadline: Duration) -> Result<(), ShutdownTimedOut> {
        self.group.closing.store(true, Ordering::SeqCst);
        let deadline = tokio::time::Instant::now() + deadline.min(MAX_DURATION);
        for tracker in self.group.members() {
            loop {
                // Registered before the count is read, so the last operation's wake-up is not missed.
                let idle = tracker.idle.notified();
                let mut idle = std::pin::pin!(idle);
                idle.as_mut().enable();
                if tracker.running.load(Ordering::SeqCst) == 0 {
                    break;
                }
                if tokio::time::timeout_at(deadline, idle).await.is_err() {
                    return Err(ShutdownTimedOut {
                        running: self.running(),
                    });
                }
            }
        }
        Ok(())
    }
}
