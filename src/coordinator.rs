//! The HTTP-free protocol: claim a key, run the operation once, then complete or release.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tracing::Instrument;

use crate::reconciliation::{self, Reconciler, ReconciliationEvent, ReconciliationKind};
use crate::store::{ClaimOutcome, InFlightRecord, OwnerToken, RecordInfo, Store, StoreError};
use crate::telemetry::{self, Named, Outcome, StoreOp, StoreTimer};
use crate::wake_anchor::WakeAnchor;
use crate::{Fingerprint, NotStored, RecordKey};

const DEFAULT_LEASE: Duration = Duration::from_secs(30);
const DEFAULT_RETENTION: Duration = Duration::from_secs(24 * 60 * 60);
const DEFAULT_STORE_TIMEOUT: Duration = Duration::from_secs(2);
const DEFAULT_MAX_IN_FLIGHT: u32 = 10_000;
/// Added to the store timeout before the coordinator gives up on a call itself.
const STORE_TIMEOUT_GRACE: Duration = Duration::from_millis(100);
/// Lease and retention are capped here, far beyond any sane setting, so deadline arithmetic
/// cannot overflow (and Redis accepts the TTL).
const MAX_DURATION: Duration = Duration::from_secs(400 * 24 * 60 * 60);
/// When a background release is tried, counted from the previous try.
const RELEASE_RETRY_DELAYS_MS: [u64; 3] = [0, 500, 1500];
/// How often a completion that failed on a store error is tried in all.
const COMPLETE_ATTEMPTS: u32 = 3;
/// How many callers may wait for running operations at once, by default. Over HTTP each holds
/// its request body (up to the body limit): 1 000 waiters of 1 KiB bodies hold 1 MiB; of
/// bodies at the default 1 MiB limit, up to 1 GiB, so lower it for large bodies.
const DEFAULT_MAX_WAITERS: u32 = 1_000;
/// Waiting on a store that cannot notify: the first re-read after this, then twice as long
/// each time, up to [`POLL_MAX`].
const POLL_FIRST: Duration = Duration::from_millis(50);
const POLL_MAX: Duration = Duration::from_secs(1);
/// A waiter wakes this long after the lease it last read should have ended, so that the
/// record has expired by then (a store's clock and ours may differ by a little).
const LEASE_END_SLACK: Duration = Duration::from_millis(20);

/// Runs operations at most once per key, over any [`Store`], without HTTP.
///
/// [`begin`](Coordinator::begin) claims the key or reports what is there; a [`Claim`] is then
/// [completed](Claim::complete) with the operation's result or [released](Claim::release) so a
/// retry may run it again. While a claim is held its lease is renewed in the background, so a
/// short lease never lets a second caller in beside a slow but live one. A claim dropped without
/// either is released in the background.
///
/// The HTTP layer is built on this type; queue consumers use it directly
/// (see `examples/consumer.rs`). Needs a Tokio runtime.
///
/// ```
/// use bytes::Bytes;
/// use tower_idempotency::{Begin, Coordinator, Fingerprint, IdempotencyKey, MemoryStore, RecordKey};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), tower_idempotency::Error> {
/// let coordinator = Coordinator::new(MemoryStore::new());
/// let key = RecordKey::new(None, IdempotencyKey::parse("message-17").unwrap());
/// let fingerprint = Fingerprint::new([b"payload".as_slice()]);
///
/// match coordinator.begin(&key, &fingerprint).await? {
///     Begin::Claimed(claim) => claim.complete(Bytes::from("done")).await?,
///     Begin::Completed(stored) => assert_eq!(stored, "done"),
///     Begin::InFlight { .. } | Begin::Mismatch => {}
/// }
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Coordinator {
    /// Behind one `Arc`: every keyed request clones its coordinator and every claim keeps one, so
    /// a clone is one count to change, not one per shared part (counts that both worker threads
    /// write, on cache lines that move between their cores each time).
    settings: Arc<Settings>,
}

#[derive(Clone)]
struct Settings {
    store: Arc<dyn Store>,
    lease: Duration,
    retention: Duration,
    store_timeout: Duration,
    tracker: Arc<Tracker>,
    /// The application's reconciliation hook and the metrics name, if either is set.
    reconciler: Option<Reconciler>,
    /// The `name` label of this coordinator's metrics, with its keys, if it has a name.
    named: Option<Arc<Named>>,
    waiters: Arc<Waiters>,
    /// Keeps a timer due while store calls are made, so that theirs wake no parked thread.
    wake_anchor: Arc<WakeAnchor>,
}

impl std::fmt::Debug for Coordinator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Coordinator")
            .field("lease", &self.settings.lease)
            .field("retention", &self.settings.retention)
            .field("store_timeout", &self.settings.store_timeout)
            .field("max_in_flight", &self.settings.tracker.max)
            .field("name", &self.settings.named.as_ref().map(|named| named.name()))
            .field(
                "reconciliation",
                &self
                    .settings
                    .reconciler
                    .as_ref()
                    .is_some_and(Reconciler::has_hook),
            )
            .field("max_waiters", &self.settings.waiters.max)
            .finish_non_exhaustive()
    }
}

/// What [`Coordinator::begin`] found; see [`Coordinator`] for an example.
#[derive(Debug)]
pub enum Begin {
    /// The caller owns the key: run the operation, then complete or release the claim.
    Claimed(Claim),
    /// The operation ran before; this is its stored result.
    Completed(Bytes),
    /// Another caller is running the operation; its lease ends in `lease_left`.
    InFlight {
        /// Time left on the running caller's lease: the earliest a retry can succeed.
        lease_left: Duration,
    },
    /// The key was used before with a different fingerprint.
    Mismatch,
}

/// Why the coordinator could not do what was asked.
///
/// ```
/// use tower_idempotency::Error;
/// assert_eq!(Error::AtCapacity.to_string(), "too many idempotent operations are running");
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The store failed, timed out, or holds an unreadable record.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// [`ShutdownHandle::shutdown`] was called: no new keys are taken.
    #[error("shutting down: no new idempotency keys are taken")]
    ShuttingDown,
    /// The bound on operations running at once is reached.
    #[error("too many idempotent operations are running")]
    AtCapacity,
    /// The claim was lost before completion (its lease ran out, or it was purged), so the result
    /// was not stored: another caller may own the key now.
    #[error("the claim was lost before the result could be stored")]
    ClaimLost,
}

/// Counts the operations running under one in-flight bound (a coordinator and its clones,
/// until one sets its own bound), bounds them, and tells a shutdown of its group when the last
/// one has finished.
struct Tracker {
    running: AtomicUsize,
    /// Woken when `running` drops to zero.
    idle: Notify,
    max: u32,
    /// The shutdown this bound belongs to, shared whatever the bound.
    group: Arc<Group>,
}

impl Tracker {
    /// A new bound of `max` in `group`, which from now on waits for its operations too.
    fn join(group: &Arc<Group>, max: u32) -> Arc<Self> {
        let tracker = Arc::new(Self {
            running: AtomicUsize::new(0),
            idle: Notify::new(),
            max,
            group: group.clone(),
        });
        let mut members = group
            .members
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
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
struct Group {
    closing: AtomicBool,
    /// Weak: a bound lives as long as a coordinator or a running operation uses it.
    members: std::sync::Mutex<Vec<std::sync::Weak<Tracker>>>,
}

impl Group {
    fn members(&self) -> Vec<Arc<Tracker>> {
        let members = self
            .members
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        members.iter().filter_map(std::sync::Weak::upgrade).collect()
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
    fn take(tracker: &Arc<Tracker>, named: Option<&Arc<Named>>) -> Result<Self, Error> {
        // Counted before the shutdown flag is read (both sequentially consistent, as in
        // `ShutdownHandle::shutdown`, which sets the flag before it reads the count): either the
        // shutdown sees this operation and waits for it, or this sees the shutdown and refuses.
        let before = tracker.running.fetch_add(1, Ordering::SeqCst);
        telemetry::running_started(named.map(|named| &**named));
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
        telemetry::running_ended(self.named.as_deref());
        if self.tracker.running.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.tracker.idle.notify_waiters();
        }
    }
}

/// Counts the callers waiting for running operations under one coordinator (and its clones).
struct Waiters {
    waiting: AtomicUsize,
    max: u32,
}

/// One waiter's place under the bound; counted until dropped (a caller that gives up, or whose
/// future is dropped when its client hangs up, frees it).
struct WaiterPlace {
    waiters: Arc<Waiters>,
}

impl WaiterPlace {
    fn take(waiters: &Arc<Waiters>) -> Option<Self> {
        let before = waiters.waiting.fetch_add(1, Ordering::AcqRel);
        let place = Self {
            waiters: waiters.clone(),
        };
        (before < waiters.max as usize).then_some(place)
    }
}

impl Drop for WaiterPlace {
    fn drop(&mut self) {
        self.waiters.waiting.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Coordinator {
    /// A coordinator over `store` with the defaults: lease 30 s, retention 24 h, store timeout 2 s,
    /// at most 10 000 operations running at once.
    pub fn new(store: impl Store) -> Self {
        Self::from_shared_store(Arc::new(store))
    }

    /// Like [`Coordinator::new`], for a store already behind an `Arc`.
    pub fn from_shared_store(store: Arc<dyn Store>) -> Self {
        let settings = Settings {
            store,
            lease: DEFAULT_LEASE,
            retention: DEFAULT_RETENTION,
            store_timeout: DEFAULT_STORE_TIMEOUT,
            tracker: Tracker::join(&Arc::default(), DEFAULT_MAX_IN_FLIGHT),
            reconciler: None,
            named: None,
            waiters: Arc::new(Waiters {
                waiting: AtomicUsize::new(0),
                max: DEFAULT_MAX_WAITERS,
            }),
            wake_anchor: Arc::default(),
        };
        Self {
            settings: Arc::new(settings),
        }
    }

    /// The settings, to change while building (copied first if a clone shares them).
    fn settings_mut(&mut self) -> &mut Settings {
        Arc::make_mut(&mut self.settings)
    }

    /// How long a claim holds a key without renewal (default: 30 s; at least 30 ms). A crashed
    /// caller blocks its key this long at most; a live one renews every third of it, so keep the
    /// store timeout under a third of the lease for a renewal to land in time. Over Redis
    /// Sentinel, keep it above 15 s: during a failover nothing renews a claim until the store is
    /// on the new master (up to 10 s), so two thirds of the lease must outlast that.
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use tower_idempotency::{Coordinator, MemoryStore};
    /// let coordinator = Coordinator::new(MemoryStore::new()).with_lease(Duration::from_secs(5));
    /// # let _ = coordinator;
    /// ```
    pub fn with_lease(mut self, lease: Duration) -> Self {
        self.settings_mut().lease = lease.clamp(Duration::from_millis(30), MAX_DURATION);
        self
    }

    /// How long a completed result is kept for replay (default: 24 h).
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use tower_idempotency::{Coordinator, MemoryStore};
    /// let coordinator = Coordinator::new(MemoryStore::new()).with_retention(Duration::from_secs(3600));
    /// # let _ = coordinator;
    /// ```
    pub fn with_retention(mut self, retention: Duration) -> Self {
        self.settings_mut().retention = retention.clamp(Duration::from_millis(1), MAX_DURATION);
        self
    }

    /// Bounds every store call (default: 2 s). A call that takes longer fails with
    /// [`StoreError::Timeout`].
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use tower_idempotency::{Coordinator, MemoryStore};
    /// let coordinator = Coordinator::new(MemoryStore::new()).with_store_timeout(Duration::from_millis(300));
    /// # let _ = coordinator;
    /// ```
    pub fn with_store_timeout(mut self, timeout: Duration) -> Self {
        self.settings_mut().store_timeout = timeout.min(MAX_DURATION);
        self
    }

    /// Bounds how many claimed operations may run at once (default: 10 000); over it
    /// [`begin`](Coordinator::begin) claims nothing: it still reports a completed, running or
    /// mismatched key (from [`Store::peek`]) and fails with [`Error::AtCapacity`] otherwise.
    /// Setting it starts a new bound, with a count of its own, shared by the coordinators cloned
    /// afterwards; the coordinator stays in its [`ShutdownHandle`]'s group, so one shutdown
    /// still stops and waits for every clone, whatever its bound.
    ///
    /// ```
    /// # use tower_idempotency::{Coordinator, MemoryStore};
    /// let coordinator = Coordinator::new(MemoryStore::new());
    /// let bulk = coordinator.clone().with_max_in_flight(16);
    /// // One shutdown covers both.
    /// assert_eq!(bulk.shutdown_handle(), coordinator.shutdown_handle());
    /// ```
    pub fn with_max_in_flight(mut self, max: u32) -> Self {
        let group = self.settings.tracker.group.clone();
        self.settings_mut().tracker = Tracker::join(&group, max.max(1));
        self
    }

    /// Puts this coordinator in the shutdown group of `handle` (default: a group of its own,
    /// shared by its clones), so that one [`ShutdownHandle::shutdown`] stops and waits for
    /// several coordinators or layers at once: a Redis layer and a PostgreSQL layer in one
    /// service, say. Its in-flight bound and its count are kept apart; only the shutdown is
    /// shared.
    ///
    /// ```
    /// # use tower_idempotency::{Coordinator, MemoryStore, ShutdownHandle};
    /// let shutdown = ShutdownHandle::new();
    /// let orders = Coordinator::new(MemoryStore::new()).with_shutdown_handle(&shutdown);
    /// let emails = Coordinator::new(MemoryStore::new()).with_shutdown_handle(&shutdown);
    /// assert_eq!(orders.shutdown_handle(), shutdown);
    /// # let _ = emails;
    /// ```
    pub fn with_shutdown_handle(mut self, handle: &ShutdownHandle) -> Self {
        let max = self.settings.tracker.max;
        self.settings_mut().tracker = Tracker::join(&handle.group, max);
        self
    }

    /// Names this coordinator in its metrics (default: none): each one it records
    /// (`idempotency_requests_total`, `idempotency_running`, the store timings, ...) carries a
    /// `name` label with this value, so two coordinators or layers (two stores, two routes)
    /// keep apart series that would otherwise merge. The labelled keys are built once, here:
    /// a named coordinator's metrics cost no allocation per call. Without a name, no `name`
    /// label is recorded. Clones made afterwards share the name; give a clone its own to tell
    /// it apart. Metrics need the crate feature `metrics`; without it the name is kept for
    /// `Debug` only.
    ///
    /// ```
    /// # use tower_idempotency::{Coordinator, MemoryStore};
    /// let emails = Coordinator::new(MemoryStore::new()).with_name("emails");
    /// # let _ = emails;
    /// ```
    pub fn with_name(mut self, name: impl Into<Arc<str>>) -> Self {
        let named = Named::new(name.into());
        let settings = self.settings_mut();
        let reconciler = settings.reconciler.take().unwrap_or_default();
        settings.reconciler = Some(reconciler.with_name(named.clone()));
        settings.named = Some(named);
        self
    }

    /// The metrics name and keys, if this coordinator has a name.
    pub(crate) fn named(&self) -> Option<&Named> {
        self.settings.named.as_deref()
    }

    /// Calls `hook` whenever an operation ran but its result is not, or may not stay, in the store
    /// (default: none): the store did not take the completion, the claim was lost before it, the
    /// HTTP layer could not store the response, or `RedisStore`'s replicas never acknowledged
    /// it. Each [`ReconciliationEvent`] carries the key, the owner token, what happened and the
    /// result if there was one, for the application to journal and reconcile. See the README,
    /// "Where the guarantees end".
    ///
    /// The hook runs on the task that found out, often a request's: keep it quick (send the
    /// event to a channel, or spawn). A panic in it is caught and logged. Without a hook nothing
    /// is built nor cloned for it.
    ///
    /// ```
    /// # use tower_idempotency::{Coordinator, MemoryStore};
    /// let (journal, _unreconciled) = std::sync::mpsc::channel();
    /// let coordinator = Coordinator::new(MemoryStore::new())
    ///     .with_reconciliation(move |event| { let _ = journal.send(event.clone()); });
    /// # let _ = coordinator;
    /// ```
    pub fn with_reconciliation<F>(mut self, hook: F) -> Self
    where
        F: Fn(&ReconciliationEvent) + Send + Sync + 'static,
    {
        let settings = self.settings_mut();
        let reconciler = settings.reconciler.take().unwrap_or_default();
        settings.reconciler = Some(reconciler.with_hook(hook));
        self
    }

    /// Bounds how many callers may wait at once for a running operation
    /// ([`begin_or_wait`](Coordinator::begin_or_wait); over HTTP, requests with `Prefer: wait`)
    /// (default: 1 000; 0: nobody waits). Over it a caller does not wait: it gets
    /// [`Begin::InFlight`] at once, as without asking (over HTTP, the usual 409 with
    /// `Retry-After`). Over HTTP every waiter holds
    /// its request body, so size this against the body limit. Setting it starts a new count,
    /// shared by coordinators cloned afterwards.
    ///
    /// ```
    /// # use tower_idempotency::{Coordinator, MemoryStore};
    /// let coordinator = Coordinator::new(MemoryStore::new()).with_max_waiters(100);
    /// # let _ = coordinator;
    /// ```
    pub fn with_max_waiters(mut self, max: u32) -> Self {
        self.settings_mut().waiters = Arc::new(Waiters {
            waiting: AtomicUsize::new(0),
            max,
        });
        self
    }

    /// How many callers wait for a running operation now.
    pub fn waiting(&self) -> usize {
        self.settings
            .waiters
            .waiting
            .load(Ordering::Acquire)
            .min(self.settings.waiters.max as usize)
    }

    /// The lease in force.
    pub fn lease(&self) -> Duration {
        self.settings.lease
    }

    /// The retention in force.
    pub fn retention(&self) -> Duration {
        self.settings.retention
    }

    /// A handle to stop taking new keys and wait for running operations.
    pub fn shutdown_handle(&self) -> ShutdownHandle {
        ShutdownHandle {
            group: self.settings.tracker.group.clone(),
        }
    }

    /// Claims `key` for a new operation, or reports what is there. One store round trip.
    pub async fn begin(&self, key: &RecordKey, fingerprint: &Fingerprint) -> Result<Begin, Error> {
        let begun = self.claim(key, fingerprint, Renewal::Background).await;
        telemetry::outcome(Outcome::of_begin(&begun), self.named());
        begun
    }

    /// Like [`begin`](Coordinator::begin), but when another caller is running the operation,
    /// waits up to `wait` for it to finish instead of answering [`Begin::InFlight`] at once.
    ///
    /// - It completes: its result, [`Begin::Completed`], as soon as the store tells (on Redis
    ///   through pub/sub, in memory in-process; see [`Store::watch`]), whichever instance ran it.
    /// - Its key is released (the operation failed in a way worth retrying, or its lease ran
    ///   out): this caller claims the key itself ([`Begin::Claimed`]: run the operation), unless
    ///   another waiter got there first (then it waits on for that one).
    /// - `wait` runs out, or [`with_max_waiters`](Coordinator::with_max_waiters) callers wait
    ///   already: [`Begin::InFlight`], as without waiting.
    ///
    /// With a `wait` of zero, or a key not in flight, it is [`begin`](Coordinator::begin)
    /// exactly, at the same cost. Dropping the future stops the wait and frees its place.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::{Begin, Coordinator, Fingerprint, IdempotencyKey, MemoryStore, RecordKey};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), tower_idempotency::Error> {
    /// let coordinator = Coordinator::new(MemoryStore::new());
    /// let key = RecordKey::new(None, IdempotencyKey::parse("message-18").unwrap());
    /// let fingerprint = Fingerprint::new([b"payload".as_slice()]);
    /// let Begin::Claimed(first) = coordinator.begin(&key, &fingerprint).await? else { unreachable!() };
    /// let finishing = tokio::spawn(async move {
    ///     tokio::time::sleep(Duration::from_millis(20)).await;
    ///     first.complete("done".into()).await
    /// });
    /// // Without waiting this would be `Begin::InFlight`.
    /// match coordinator.begin_or_wait(&key, &fingerprint, Duration::from_secs(5)).await? {
    ///     Begin::Completed(result) => assert_eq!(result, "done"),
    ///     other => panic!("{other:?}"),
    /// }
    /// # finishing.await.unwrap()?;
    /// # Ok(()) }
    /// ```
    pub async fn begin_or_wait(
        &self,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        wait: Duration,
    ) -> Result<Begin, Error> {
        match self.claim(key, fingerprint, Renewal::Background).await? {
            Begin::InFlight { lease_left } if !wait.is_zero() => {
                let (begun, _waited) = self
                    .wait_in_flight(key, fingerprint, wait, lease_left, Renewal::Background)
                    .await;
                begun
            }
            begun => Ok(begun),
        }
    }

    /// [`begin_or_wait`](Coordinator::begin_or_wait)'s waiting, for a caller whose claim found
    /// the key in flight (`lease_left`), with its lease renewal driven by the holder. Also
    /// answers whether it waited: not when no place was left, nor when the store could not
    /// subscribe.
    pub(crate) async fn wait_driven(
        &self,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        wait: Duration,
        lease_left: Duration,
    ) -> (Result<Begin, Error>, bool) {
        self.wait_in_flight(key, fingerprint, wait, lease_left, Renewal::Driven)
            .await
    }

    /// Waits up to `wait` for the running operation at `key` to settle: subscribes to the key
    /// first, then reads it again (claiming it if it was released), so a completion between the
    /// caller's first read and the subscription is not missed, and again on every notice, at the
    /// lease's end (an owner that died notifies nobody) and, on a store that cannot notify, at
    /// growing intervals.
    async fn wait_in_flight(
        &self,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        wait: Duration,
        mut lease_left: Duration,
        renewal: Renewal,
    ) -> (Result<Begin, Error>, bool) {
        let deadline = tokio::time::Instant::now() + wait.min(MAX_DURATION);
        let Some(_place) = WaiterPlace::take(&self.settings.waiters) else {
            tracing::debug!(?key, "too many callers waiting already; answering in flight");
            return (Ok(Begin::InFlight { lease_left }), false);
        };
        let mut watch = match tokio::time::timeout_at(
            deadline,
            self.bounded(StoreOp::Watch, self.settings.store.watch(key)),
        )
        .await
        {
            Ok(Ok(watch)) => watch,
            Ok(Err(error)) => {
                // Waiting blind would poll a store that is failing anyway.
                tracing::debug!(?key, %error, "cannot subscribe to the key; answering in flight");
                return (Ok(Begin::InFlight { lease_left }), false);
            }
            Err(_) => return (Ok(Begin::InFlight { lease_left }), false),
        };
        let mut poll_every = POLL_FIRST;
        loop {
            match self.claim(key, fingerprint, renewal).await {
                Ok(Begin::InFlight { lease_left: left }) => lease_left = left,
                settled => return (settled, true),
            }
            let now = tokio::time::Instant::now();
            if now >= deadline {
                return (Ok(Begin::InFlight { lease_left }), true);
            }
            let mut wake_at = deadline.min(now + lease_left + LEASE_END_SLACK);
            if watch.is_none() {
                wake_at = wake_at.min(now + poll_every);
                poll_every = (poll_every * 2).min(POLL_MAX);
            }
            let notified = async {
                match watch.as_mut() {
                    Some(watch) => watch.changed().await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                still_notifying = notified => if !still_notifying {
                    tracing::debug!(?key, "the store stopped notifying; reading the key at intervals");
                    watch = None;
                },
                () = tokio::time::sleep_until(wake_at) => {}
            }
        }
    }

    /// Like [`begin`](Coordinator::begin), for a holder that drives its lease renewal itself
    /// through [`Claim::keep_alive`]: no background task per claim. The outcome is not counted
    /// here: the HTTP layer, which calls this, counts it once it knows the answer (a stored
    /// payload may turn out to be a response that was not stored, say).
    pub(crate) async fn begin_driven(
        &self,
        key: &RecordKey,
        fingerprint: &Fingerprint,
    ) -> Result<Begin, Error> {
        self.claim(key, fingerprint, Renewal::Driven).await
    }

    async fn claim(
        &self,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        renewal: Renewal,
    ) -> Result<Begin, Error> {
        // A copy held in this process answers before anything a claim needs (a slot, an owner
        // token, a store call): a replay is not new work, so neither the bound nor shutdown stops it.
        match self.settings.store.cached(key, fingerprint) {
            Some(ClaimOutcome::Completed(payload)) => return Ok(Begin::Completed(payload)),
            Some(ClaimOutcome::Mismatch) => return Ok(Begin::Mismatch),
            Some(ClaimOutcome::Claimed | ClaimOutcome::InFlight { .. }) | None => {}
        }
        let slot = match Slot::take(&self.settings.tracker, self.settings.named.as_ref()) {
            Ok(slot) => slot,
            // Boxed: the rare path at capacity would otherwise size every claim's future.
            Err(refusal) => {
                let answering = self.answer_without_claiming(key, fingerprint, refusal);
                return Box::pin(answering).await;
            }
        };
        let owner = OwnerToken::generate();
        // If this future is dropped while the claim is on its way (the client hung up) or the
        // claim fails in transit, it may still land; a release queued behind it keeps it from
        // blocking the key for a whole lease.
        let mut pending = PendingClaim {
            coordinator: self,
            key,
            owner: &owner,
            armed: true,
        };
        let outcome = self
            .bounded(
                StoreOp::Claim,
                self.settings
                    .store
                    .claim(key, fingerprint, &owner, self.settings.lease),
            )
            .await;
        pending.armed = matches!(&outcome, Err(error) if !matches!(error, StoreError::Corrupt(_)));
        drop(pending);
        match outcome? {
            ClaimOutcome::Claimed => Ok(Begin::Claimed(Claim::start(
                self.clone(),
                key.clone(),
                owner,
                slot,
                renewal,
            ))),
            ClaimOutcome::Completed(payload) => Ok(Begin::Completed(payload)),
            ClaimOutcome::InFlight { lease_left } => Ok(Begin::InFlight { lease_left }),
            ClaimOutcome::Mismatch => Ok(Begin::Mismatch),
        }
    }

    /// Taking no new work (at the bound, or shutting down), still answers a key that is done,
    /// running or used with another request, from one read of the store; anything else, and
    /// a store that cannot say, gets `refusal`.
    async fn answer_without_claiming(
        &self,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        refusal: Error,
    ) -> Result<Begin, Error> {
        match self
            .bounded(StoreOp::Peek, self.settings.store.peek(key, fingerprint))
            .await
        {
            Ok(Some(ClaimOutcome::Completed(payload))) => Ok(Begin::Completed(payload)),
            Ok(Some(ClaimOutcome::InFlight { lease_left })) => Ok(Begin::InFlight { lease_left }),
            Ok(Some(ClaimOutcome::Mismatch)) => Ok(Begin::Mismatch),
            Err(StoreError::Corrupt(reason)) => Err(Error::Store(StoreError::Corrupt(reason))),
            // A store failure here must not become a fail-open run past the bound.
            Ok(Some(ClaimOutcome::Claimed) | None) | Err(_) => Err(refusal),
        }
    }

    /// A counted place for work run outside a claim (a fail-open run), so that the bound and
    /// a shutdown see it.
    pub(crate) fn slot(&self) -> Result<Slot, Error> {
        Slot::take(&self.settings.tracker, self.settings.named.as_ref())
    }

    /// Reads the record at `key` (state, time left, stored payload), for operators.
    pub async fn inspect(&self, key: &RecordKey) -> Result<Option<RecordInfo>, Error> {
        Ok(self
            .bounded(StoreOp::Inspect, self.settings.store.inspect(key))
            .await?)
    }

    /// Deletes the record at `key` whatever its state, so the next request runs the operation
    /// again. Answers whether there was a record.
    pub async fn purge(&self, key: &RecordKey) -> Result<bool, Error> {
        Ok(self
            .bounded(StoreOp::Purge, self.settings.store.purge(key))
            .await?)
    }

    /// Lists the records in flight claimed at least `older_than` ago, the oldest first, at most
    /// `limit` (see [`Store::in_flight`]), for operators looking for stuck or slow operations.
    ///
    /// The listing reads every record of the store in many bounded steps, so it is not bounded
    /// by the store timeout as a whole (each step is, by the store's command timeout); bound it
    /// with `tokio::time::timeout` if it must end by a deadline.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::{Begin, Coordinator, Fingerprint, IdempotencyKey, MemoryStore, RecordKey};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), tower_idempotency::Error> {
    /// let coordinator = Coordinator::new(MemoryStore::new());
    /// let key = RecordKey::new(Some("tenant-7"), IdempotencyKey::parse("order-42").unwrap());
    /// let Begin::Claimed(claim) = coordinator.begin(&key, &Fingerprint::new([b"{}".as_slice()])).await? else {
    ///     unreachable!("a new key");
    /// };
    /// let running = coordinator.in_flight(Duration::ZERO, 10).await?;
    /// assert_eq!(running[0].digest, *key.digest());
    /// assert!(coordinator.in_flight(Duration::from_secs(60), 10).await?.is_empty(), "claimed just now");
    /// # claim.release().await?; Ok(()) }
    /// ```
    pub async fn in_flight(&self, older_than: Duration, limit: usize) -> Result<Vec<InFlightRecord>, Error> {
        Ok(self.settings.store.in_flight(older_than, limit).await?)
    }

    /// Bounds a store call by the store timeout plus a little grace, so a store that enforces the
    /// same timeout itself (as `RedisStore` does) reports it first: `fred` then forgets the
    /// command, where a future dropped from outside would leave it queued to be sent late.
    /// Timed as `op` when anyone reads the times (see `telemetry`).
    async fn bounded<T>(
        &self,
        op: StoreOp,
        call: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        self.settings.wake_anchor.touch();
        let timer = StoreTimer::start(op, self.named());
        let answer = tokio::time::timeout(self.settings.store_timeout + STORE_TIMEOUT_GRACE, call)
            .await
            .unwrap_or(Err(StoreError::Timeout(self.settings.store_timeout)));
        timer.finish();
        answer
    }

    /// Waits while the store holds its owners' writes back on purpose (a Sentinel failover:
    /// [`Store::writes_held`]), outside the store timeout, for at most a lease: a claim the
    /// store took no renewal of for that long is gone anyway. Answers `false` if it stopped
    /// waiting at that limit. Nothing at all (no timer, no allocation) when nothing is held.
    async fn until_store_takes_writes(&self) -> bool {
        let Some(held) = self.settings.store.writes_held() else {
            return true;
        };
        tracing::debug!("the store holds writes back (a failover is under way); waiting until it takes them");
        tokio::time::timeout(self.settings.lease, held).await.is_ok()
    }

    /// Whether the store holds its owners' writes back now (asked after a failed write).
    fn store_holds_writes(&self) -> bool {
        self.settings.store.writes_held().is_some()
    }

    /// Releases `owner`'s claim from a task of its own, for claims whose holder is gone (dropped,
    /// cancelled) or whose outcome is unknown (the claim failed in transit).
    ///
    /// A claim that timed out may still be executed later, and after a reconnect a release sent on
    /// the new connection can overtake it. So a release that finds nothing is tried again a few
    /// times over about two seconds; releases are owner-checked, so a late one never touches
    /// another owner's record.
    fn release_in_background(&self, key: RecordKey, owner: OwnerToken) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::warn!(
                ?key,
                "no Tokio runtime to release a claim; it ends with its lease"
            );
            return;
        };
        let coordinator = self.clone();
        let releasing = async move {
            for delay_ms in RELEASE_RETRY_DELAYS_MS {
                tokio::time::sleep(Duration::from_millis(delay_ms)).await;
                coordinator.until_store_takes_writes().await;
                match coordinator
                    .bounded(StoreOp::Release, coordinator.settings.store.release(&key, &owner))
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

/// Releases, when dropped while armed, a claim whose outcome is unknown.
struct PendingClaim<'a> {
    coordinator: &'a Coordinator,
    key: &'a RecordKey,
    owner: &'a OwnerToken,
    armed: bool,
}

impl Drop for PendingClaim<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.coordinator
                .release_in_background(self.key.clone(), self.owner.clone());
        }
    }
}

/// Ownership of one key while its operation runs. Complete it with the result, or release it.
///
/// Dropping a `Claim` (a panic, a cancelled task) releases it in the background.
///
/// ```
/// use tower_idempotency::{Begin, Coordinator, Fingerprint, IdempotencyKey, MemoryStore, RecordKey};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), tower_idempotency::Error> {
/// let coordinator = Coordinator::new(MemoryStore::new());
/// let key = RecordKey::new(None, IdempotencyKey::parse("job-9").unwrap());
/// let fingerprint = Fingerprint::new([b"job".as_slice()]);
/// if let Begin::Claimed(claim) = coordinator.begin(&key, &fingerprint).await? {
///     // The operation failed in a way worth retrying: give the key up.
///     claim.release().await?;
/// }
/// assert!(matches!(coordinator.begin(&key, &fingerprint).await?, Begin::Claimed(_)));
/// # Ok(()) }
/// ```
pub struct Claim {
    coordinator: Coordinator,
    key: RecordKey,
    owner: OwnerToken,
    /// Shared with the renewal task and any [`ClaimTicket`]: one allocation per claim.
    flags: Arc<ClaimFlags>,
    /// The background renewal task, or `None` when the holder renews through `keep_alive`.
    renewal: Option<JoinHandle<()>>,
    settled: bool,
    _slot: Slot,
}

/// Who renews a claim's lease while its operation runs.
#[derive(Clone, Copy)]
enum Renewal {
    /// A task of the claim's own, for callers that simply hold the claim.
    Background,
    /// The holder, by running its work through [`Claim::keep_alive`].
    Driven,
}

impl std::fmt::Debug for Claim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Claim")
            .field("key", &self.key)
            .field("owner", &self.owner)
            .finish_non_exhaustive()
    }
}

impl Claim {
    fn start(
        coordinator: Coordinator,
        key: RecordKey,
        owner: OwnerToken,
        slot: Slot,
        renewal: Renewal,
    ) -> Self {
        let mut claim = Self {
            coordinator,
            key,
            owner,
            flags: Arc::default(),
            renewal: None,
            settled: false,
            _slot: slot,
        };
        if let Renewal::Background = renewal {
            claim.renew_in_background();
        }
        claim
    }

    /// Hands the renewal of a claim to a task of its own, for callers that simply hold it.
    /// Does nothing if a task renews it already.
    fn renew_in_background(&mut self) {
        if self.renewal.is_some() {
            return;
        }
        let (coordinator, key, owner, flags) = (
            self.coordinator.clone(),
            self.key.clone(),
            self.owner.clone(),
            self.flags.clone(),
        );
        let renewing = async move { renew_until_lost(&coordinator, &key, &owner, &flags).await };
        self.renewal = Some(tokio::spawn(renewing.instrument(tracing::Span::current())));
    }

    /// The key this claim holds.
    pub fn key(&self) -> &RecordKey {
        &self.key
    }

    /// This claim's owner token.
    pub fn owner(&self) -> &OwnerToken {
        &self.owner
    }

    /// A ticket for completing this claim in a transaction of the caller's, with the business
    /// writes of the operation (see [`ClaimTicket`]). [`complete`](Claim::complete) afterwards
    /// succeeds without overwriting what that transaction stored.
    ///
    /// ```
    /// use tower_idempotency::{Begin, Coordinator, Fingerprint, IdempotencyKey, MemoryStore, RecordKey};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), tower_idempotency::Error> {
    /// let coordinator = Coordinator::new(MemoryStore::new());
    /// let key = RecordKey::new(None, IdempotencyKey::parse("job-10").unwrap());
    /// if let Begin::Claimed(claim) = coordinator.begin(&key, &Fingerprint::new([b"job".as_slice()])).await? {
    ///     let ticket = claim.ticket();
    ///     assert_eq!(ticket.key(), claim.key());
    ///     assert_eq!(ticket.retention(), coordinator.retention());
    ///     claim.release().await?;
    /// }
    /// # Ok(()) }
    /// ```
    pub fn ticket(&self) -> ClaimTicket {
        ClaimTicket {
            key: self.key.clone(),
            owner: self.owner.clone(),
            retention: self.coordinator.settings.retention,
            flags: self.flags.clone(),
        }
    }

    /// The coordinator's metrics name and keys, if it has a name.
    pub(crate) fn named(&self) -> Option<Arc<Named>> {
        self.coordinator.settings.named.clone()
    }

    /// Whether a renewal found the claim gone (lease ran out, or purged): completing it will fail.
    pub fn is_lost(&self) -> bool {
        self.flags.lost.load(Ordering::Acquire)
    }

    /// Runs `work` while renewing the lease of a claim from
    /// [`begin_driven`](Coordinator::begin_driven). The renewal timer starts only if `work` is
    /// not done at its first poll, so a quick operation costs no timer at all.
    ///
    /// `work` is pinned by the caller, so it is stored once, in the caller's future: taken by
    /// value and pinned here, it would take its room twice in this future's state (the argument
    /// and the pinned local), and so would every future wrapping it.
    pub(crate) async fn keep_alive<F: Future>(&self, mut work: Pin<&mut F>) -> F::Output {
        if self.renewal.is_some() {
            return work.await;
        }
        let mut renew = std::pin::pin!(renew_until_lost(
            &self.coordinator,
            &self.key,
            &self.owner,
            &self.flags
        ));
        let mut renewing = true;
        std::future::poll_fn(|cx| {
            if let Poll::Ready(output) = work.as_mut().poll(cx) {
                return Poll::Ready(output);
            }
            // Renewal ends only when the claim is lost; the work then runs on, to be fenced.
            if renewing && renew.as_mut().poll(cx).is_ready() {
                renewing = false;
            }
            Poll::Pending
        })
        .await
    }

    /// Stores `payload` as the key's result, for the retention period.
    ///
    /// A store error is retried (3 attempts in all, each bounded by the store timeout), except
    /// [`StoreError::TooLarge`], which another attempt would meet again; the lease is renewed
    /// meanwhile, until the record lands. If the claim was lost, nothing is written
    /// ([`Error::ClaimLost`]) and a warning is logged: a newer owner's record is never
    /// overwritten. If every attempt fails, the claim is left to expire with its lease and an
    /// error is logged. If this future is dropped before the outcome is known, the claim is
    /// released in the background (a completion that landed is not undone: release only removes
    /// in-flight records).
    ///
    /// While the store holds its writes back on purpose (`RedisStore` during a Sentinel
    /// failover, see [`Store::writes_held`]), the completion waits, outside the store timeout
    /// and for at most a lease, and goes to the store the moment it takes writes again; a wait
    /// there is not a failed attempt.
    ///
    /// A result not stored (claim lost, every attempt failed) is reported to the
    /// [reconciliation hook](Coordinator::with_reconciliation), with the payload.
    pub async fn complete(mut self, payload: Bytes) -> Result<(), Error> {
        if self.is_lost() {
            self.stop_renewal();
            self.settled = true;
            tracing::warn!(key = ?self.key, "claim lost before completion; the result is not stored");
            self.reconcile(ReconciliationKind::ClaimLost, Some(&payload));
            return Err(Error::ClaimLost);
        }
        if self.renewal.is_some() {
            self.flags.completing.store(true, Ordering::Release);
        }
        let outcome = match self.complete_once(&payload).await {
            // A renewal task, if the claim has one, goes on until the record lands; a claim
            // renewed by its holder is renewed here from the first failure on (the first attempt
            // almost always lands, and needs no timer).
            Err(error) if worth_completing_again(&error) => {
                self.flags.completing.store(true, Ordering::Release);
                let again = std::pin::pin!(self.complete_again(&payload, error));
                self.keep_alive(again).await
            }
            first => first,
        };
        self.stop_renewal();
        // Every outcome settles the claim: stored, fenced, or left to its lease.
        self.settled = true;
        match outcome {
            Ok(true) => Ok(()),
            Ok(false) => {
                tracing::warn!(key = ?self.key, "claim lost before completion; the result is not stored");
                self.reconcile(ReconciliationKind::ClaimLost, Some(&payload));
                Err(Error::ClaimLost)
            }
            Err(error) => {
                tracing::error!(
                    key = ?self.key, %error,
                    "could not store the result; a retry after the lease ends will run the operation again"
                );
                let failed = ReconciliationKind::CompletionFailed {
                    error: error.to_string(),
                };
                self.reconcile(failed, Some(&payload));
                Err(Error::Store(error))
            }
        }
    }

    /// One attempt at the completion: after the store's hold, if it holds writes back, then one
    /// call bounded by the store timeout. A call that fails because the store began to hold
    /// writes back while it was under way is made again once it takes them.
    async fn complete_once(&self, payload: &Bytes) -> Result<bool, StoreError> {
        let coordinator = &self.coordinator;
        loop {
            let takes_writes = coordinator.until_store_takes_writes().await;
            let call = coordinator.settings.store.complete(
                &self.key,
                &self.owner,
                payload.clone(),
                coordinator.settings.retention,
            );
            let call = reconciliation::carrying(coordinator.settings.reconciler.as_ref(), call);
            let outcome = coordinator.bounded(StoreOp::Complete, call).await;
            match &outcome {
                Err(error)
                    if takes_writes && worth_completing_again(error) && coordinator.store_holds_writes() =>
                {
                    tracing::debug!(key = ?self.key, %error, "the store began holding writes back during the completion; completing once it takes them");
                }
                _ => return outcome,
            }
        }
    }

    /// The attempts after a first that failed with `error`, a pause apart.
    async fn complete_again(&self, payload: &Bytes, mut error: StoreError) -> Result<bool, StoreError> {
        let mut attempt = 1;
        loop {
            tracing::debug!(key = ?self.key, %error, attempt, "completion failed; retrying");
            tokio::time::sleep(Duration::from_millis(50 * u64::from(attempt))).await;
            attempt += 1;
            match self.complete_once(payload).await {
                Err(failed) if attempt < COMPLETE_ATTEMPTS && worth_completing_again(&failed) => {
                    error = failed
                }
                outcome => return outcome,
            }
        }
    }

    /// Gives the key up, so a retry runs the operation again. If the store call fails (or this
    /// future is dropped first), the release is retried in the background. While the store
    /// holds its writes back (a Sentinel failover), it waits first, as a completion does.
    pub async fn release(mut self) -> Result<(), Error> {
        self.stop_renewal();
        let coordinator = &self.coordinator;
        coordinator.until_store_takes_writes().await;
        coordinator
            .bounded(
                StoreOp::Release,
                coordinator.settings.store.release(&self.key, &self.owner),
            )
            .await?;
        self.settled = true;
        Ok(())
    }
}

/// Whether a completion that failed with `error` may land if tried again: not a result too
/// large for the store, which another attempt would meet again.
fn worth_completing_again(error: &StoreError) -> bool {
    !matches!(error, StoreError::TooLarge { .. })
}

impl Claim {
    /// Reports a response that ran but could not be stored (HTTP: too large, its body failed, the
    /// handler timed out), before the key is settled as not replayable or released.
    pub(crate) fn report_not_stored(&self, why: NotStored) {
        self.reconcile(ReconciliationKind::NotStorable { why }, None);
    }

    fn reconcile(&self, kind: ReconciliationKind, payload: Option<&Bytes>) {
        let hook = self.coordinator.settings.reconciler.as_ref();
        reconciliation::report(hook, kind, &self.key, &self.owner, payload);
    }

    fn stop_renewal(&mut self) {
        if let Some(renewal) = self.renewal.take() {
            renewal.abort();
        }
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        self.stop_renewal();
        if !self.settled {
            self.coordinator
                .release_in_background(self.key.clone(), self.owner.clone());
        }
    }
}

/// What a claim's renewal and a transaction completing it tell each other.
#[derive(Default)]
struct ClaimFlags {
    /// A renewal found the claim gone (lease ran out, or purged).
    lost: AtomicBool,
    /// A store completed the claim in a transaction of the caller's (through a [`ClaimTicket`]),
    /// so a renewal that then finds it no longer in flight does not take it for lost.
    completed_elsewhere: AtomicBool,
    /// The claim's completion is under way, with a renewal beside it: a renewal that finds the
    /// claim no longer in flight leaves the verdict to the completion (which may have landed).
    completing: AtomicBool,
}

/// Renews `owner`'s lease every third of it until a renewal finds the claim lost, or completed
/// by a transaction of the caller's (then the claim is not lost, and its completion finds it
/// done).
async fn renew_until_lost(
    coordinator: &Coordinator,
    key: &RecordKey,
    owner: &OwnerToken,
    flags: &ClaimFlags,
) {
    let every = coordinator.settings.lease / 3;
    let mut pause = every;
    loop {
        tokio::time::sleep(pause).await;
        pause = every;
        // While the store holds writes back (a Sentinel failover), the renewal waits, outside the
        // store timeout, and goes the moment it takes them again: to the new master, where the
        // lease left from the last renewal that reached it is all that keeps the claim meanwhile.
        coordinator.until_store_takes_writes().await;
        match coordinator
            .bounded(
                StoreOp::Renew,
                coordinator
                    .settings
                    .store
                    .renew(key, owner, coordinator.settings.lease),
            )
            .await
        {
            Ok(true) => tracing::trace!(?key, "lease renewed"),
            Ok(false) if flags.completed_elsewhere.load(Ordering::Acquire) => {
                tracing::trace!(?key, "claim completed in the caller's transaction; renewal ends");
                return;
            }
            Ok(false) if flags.completing.load(Ordering::Acquire) => {
                tracing::trace!(
                    ?key,
                    "claim no longer in flight while it is completed; renewal ends"
                );
                return;
            }
            Ok(false) => {
                flags.lost.store(true, Ordering::Release);
                tracing::warn!(
                    ?key,
                    "claim lost while the operation runs; its result will not be stored"
                );
                return;
            }
            // The store began holding writes back during the call: renewed once it takes them.
            Err(error) if coordinator.store_holds_writes() => {
                tracing::debug!(?key, %error, "a renewal met a failover; renewing again once it ends");
                pause = Duration::ZERO;
            }
            // The next renewal may get through; the lease is three renewals long.
            Err(error) => tracing::warn!(?key, %error, "could not renew a lease"),
        }
    }
}

/// A claim's address and owner, for completing it in a transaction of the caller's: the
/// operation's own writes and its stored result then commit, or roll back, together, so a crash
/// between the two can no longer run the key twice. Made by [`Claim::ticket`]; over HTTP, the
/// layer hands it to the handler (`IdempotencyLayer::with_transactional_completion`).
///
/// A store that keeps its records in the caller's database completes a ticket in the caller's
/// transaction (`PostgresStore::complete_in`); the claim's own completion afterwards finds the
/// record completed by its owner and succeeds without overwriting it. A ticket carries no
/// connection and no lease renewal: the [`Claim`] it came from keeps the lease until then.
///
/// ```
/// use tower_idempotency::{Begin, Coordinator, Fingerprint, IdempotencyKey, MemoryStore, RecordKey};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), tower_idempotency::Error> {
/// let coordinator = Coordinator::new(MemoryStore::new());
/// let key = RecordKey::new(None, IdempotencyKey::parse("transfer-3").unwrap());
/// if let Begin::Claimed(claim) = coordinator.begin(&key, &Fingerprint::new([b"transfer".as_slice()])).await? {
///     let ticket = claim.ticket();
///     assert_eq!(ticket.owner(), claim.owner());
///     // ... a PostgresStore would complete `ticket` in the transaction here ...
///     claim.complete("done".into()).await?;
/// }
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct ClaimTicket {
    key: RecordKey,
    owner: OwnerToken,
    retention: Duration,
    flags: Arc<ClaimFlags>,
}

impl std::fmt::Debug for ClaimTicket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClaimTicket")
            .field("key", &self.key)
            .field("owner", &self.owner)
            .field("retention", &self.retention)
            .finish_non_exhaustive()
    }
}

impl ClaimTicket {
    /// The claimed key.
    pub fn key(&self) -> &RecordKey {
        &self.key
    }

    /// The claim's owner token, which the completion must present.
    pub fn owner(&self) -> &OwnerToken {
        &self.owner
    }

    /// How long the result is to be kept (the coordinator's, or the layer's, retention).
    pub fn retention(&self) -> Duration {
        self.retention
    }

    /// Tells the claim that a store completed it in the caller's transaction, so its lease
    /// renewal, finding the record no longer in flight, does not report the claim lost.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) fn note_completed_elsewhere(&self) {
        self.flags.completed_elsewhere.store(true, Ordering::Release);
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
    group: Arc<Group>,
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
    /// `with_shutdown_handle` (see [`Coordinator::with_shutdown_handle`]); the same as
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{IdempotencyKey, MemoryStore};

    #[tokio::test]
    async fn a_store_call_keeps_a_timer_due() {
        let coordinator = Coordinator::new(MemoryStore::new());
        assert!(!coordinator.settings.wake_anchor.is_running());
        let key = RecordKey::new(None, IdempotencyKey::parse("anchored").expect("a valid key"));
        let begun = coordinator
            .begin(&key, &Fingerprint::new([b"{}".as_slice()]))
            .await;
        assert!(matches!(begun, Ok(Begin::Claimed(_))));
        assert!(coordinator.settings.wake_anchor.is_running());
    }
}
