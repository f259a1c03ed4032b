//! The HTTP-free protocol: claim a key, run the operation once, then complete or release.
//!
//! [`Coordinator`] and [`Begin`] are here; below them, each file one concern: `claim.rs` (a
//! held key: completion, release, lease renewal), `waiting.rs` (the bound on callers waiting
//! for a running key), `running.rs` (the in-flight bound and the shutdown that waits for it),
//! `settings.rs` (what a coordinator, its clones and its claims share, and the store calls they
//! all make the same way), `once.rs` (a queue consumer's one call: claim, run, complete or
//! release, and what to do with the message) and `error.rs`.

mod claim;
mod error;
mod once;
mod running;
mod settings;
mod waiting;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

pub use self::claim::Claim;
use self::claim::Renewal;
pub use self::error::Error;
pub use self::once::{default_consumer_name, Disposition, Once, OnceCall};
pub(crate) use self::running::Slot;
pub use self::running::{ShutdownHandle, ShutdownTimedOut};
use self::running::{Tracker, MAX_DURATION};
use self::settings::{
    Settings, DEFAULT_LEASE, DEFAULT_MAX_IN_FLIGHT, DEFAULT_ONCE_TIMEOUT, DEFAULT_RETENTION,
    DEFAULT_STORE_TIMEOUT,
};
use self::waiting::{
    Reader, WaiterPlace, Waiters, DEFAULT_MAX_WAITERS, LEASE_END_SLACK, POLL_FIRST, POLL_MAX,
};
use crate::fingerprint::Fingerprint;
use crate::key::RecordKey;
use crate::reconciliation::{Reconciler, ReconciliationEvent};
use crate::store::{ClaimOutcome, InFlightRecord, OwnerToken, RecordInfo, Store, StoreError};
use crate::telemetry::{self, Named, RequestOutcome, StoreOp};

/// Runs operations at most once per key, over any [`Store`], without HTTP.
///
/// [`begin`](Coordinator::begin) claims the key or reports what is there; a [`Claim`] is then
/// [completed](Claim::complete) with the operation's result or [released](Claim::release) so a
/// retry may run it again. While a claim is held its lease is renewed in the background, so a
/// short lease never lets a second caller in beside a slow but live one. A claim dropped without
/// either is released in the background.
///
/// The HTTP layer is built on this type; queue consumers use it directly, most simply through
/// [`once`](Coordinator::once), which claims, runs, completes or releases in one call and says
/// what to do with the message (see the [queue consumers guide](crate::guide::queue_consumers)).
/// Needs a Tokio runtime.
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
///     Begin::InFlight { .. } | Begin::Mismatch | Begin::PolicyMismatch => {}
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

impl std::fmt::Debug for Coordinator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let settings = &*self.settings;
        let reconciliation = settings.reconciler.as_ref().is_some_and(Reconciler::has_hook);
        f.debug_struct("Coordinator")
            .field("lease", &settings.lease)
            .field("retention", &settings.retention)
            .field("store_timeout", &settings.store_timeout)
            .field("once_timeout", &settings.once_timeout)
            .field("max_in_flight", &settings.tracker.max)
            .field("name", &settings.named.as_ref().map(|named| named.name()))
            .field("reconciliation", &reconciliation)
            .field("max_waiters", &settings.waiters.max)
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
    /// The key was used before with a different fingerprint, made under another fingerprint
    /// policy ([`ClaimOutcome::PolicyMismatch`]): the two cannot be compared.
    PolicyMismatch,
}

impl Begin {
    /// How a [`Coordinator::begin`] that answered `begun` is counted.
    fn outcome(begun: &Result<Begin, Error>) -> RequestOutcome {
        match begun {
            Ok(Begin::Claimed(_)) => RequestOutcome::Executed,
            Ok(Begin::Completed(_)) => RequestOutcome::Replayed,
            Ok(Begin::InFlight { .. }) => RequestOutcome::InFlight,
            Ok(Begin::Mismatch) => RequestOutcome::Mismatch,
            Ok(Begin::PolicyMismatch) => RequestOutcome::PolicyMismatch,
            Err(error) => error.outcome(),
        }
    }
}

impl Coordinator {
    /// A coordinator over `store` with the defaults: lease 30 s, retention 24 h, store timeout 2 s,
    /// at most 10 000 operations running at once, a [`once`](Coordinator::once) operation
    /// cancelled after 60 s.
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
            once_timeout: DEFAULT_ONCE_TIMEOUT,
            tracker: Tracker::join(&Arc::default(), DEFAULT_MAX_IN_FLIGHT),
            reconciler: None,
            named: None,
            waiters: Arc::new(Waiters {
                waiting: AtomicUsize::new(0),
                max: DEFAULT_MAX_WAITERS,
            }),
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

    /// Bounds the operation of every [`once`](Coordinator::once) call (and `once_json`,
    /// `once_with_ticket`) unless the call sets its own ([`OnceCall::timeout`]) (default: 60 s,
    /// as the HTTP layer's handler timeout). Past it the operation is cancelled and the call
    /// answers [`Once::Unavailable`] with [`Error::OperationTimedOut`], to dead-letter: whether
    /// its effect happened is unknown. The key is not released (a redelivery would run the
    /// operation again at once) but left to its lease, and the timeout is reported to the
    /// [reconciliation hook](Coordinator::with_reconciliation). `Duration::MAX` turns the bound
    /// off. The HTTP layer has its own, [`with_handler_timeout`](crate::IdempotencyLayer::with_handler_timeout).
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use tower_idempotency::{Coordinator, MemoryStore};
    /// let coordinator = Coordinator::new(MemoryStore::new()).with_once_timeout(Duration::from_secs(10));
    /// # let _ = coordinator;
    /// ```
    pub fn with_once_timeout(mut self, timeout: Duration) -> Self {
        self.settings_mut().once_timeout = timeout;
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
    /// result if there was one, for the application to journal and reconcile. See [the
    /// reconciliation hook](crate::guide::guarantees#knowing-when-it-happened-the-reconciliation-hook).
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
        let waiters = &self.settings.waiters;
        waiters.waiting.load(Ordering::Acquire).min(waiters.max as usize)
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
        let begun = self
            .claim(key, fingerprint, Renewal::Background, Reader::Caller)
            .await;
        telemetry::outcome(Begin::outcome(&begun), self.named());
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
        match self
            .claim(key, fingerprint, Renewal::Background, Reader::Caller)
            .await?
        {
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
    /// growing intervals. Each of those reads is a [`Store::claim_waiting`]: a store whose
    /// completions tell only the waiters they know of (Redis) learns of this one with the read.
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
            self.settings
                .bounded(StoreOp::Watch, self.settings.store.watch(key)),
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
            match self.claim(key, fingerprint, renewal, Reader::Waiter).await {
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
        self.claim(key, fingerprint, Renewal::Driven, Reader::Caller)
            .await
    }

    async fn claim(
        &self,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        renewal: Renewal,
        reader: Reader,
    ) -> Result<Begin, Error> {
        // A copy held in this process answers before anything a claim needs (a slot, an owner
        // token, a store call): a replay is not new work, so neither the bound nor shutdown stops it.
        match self.settings.store.cached(key, fingerprint) {
            Some(ClaimOutcome::Completed(payload)) => return Ok(Begin::Completed(payload)),
            Some(ClaimOutcome::Mismatch) => return Ok(Begin::Mismatch),
            Some(ClaimOutcome::PolicyMismatch) => return Ok(Begin::PolicyMismatch),
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
        let store = &self.settings.store;
        let lease = self.settings.lease;
        let claiming = match reader {
            Reader::Caller => store.claim(key, fingerprint, &owner, lease),
            // A waiter's every read tells the store of it (`Store::claim_waiting`).
            Reader::Waiter => store.claim_waiting(key, fingerprint, &owner, lease),
        };
        let outcome = self.settings.bounded(StoreOp::Claim, claiming).await;
        pending.armed = matches!(&outcome, Err(error) if !matches!(error, StoreError::Corrupt(_)));
        drop(pending);
        match outcome? {
            ClaimOutcome::Claimed => Ok(Begin::Claimed(Claim::start(
                self.settings.clone(),
                key.clone(),
                owner,
                slot,
                renewal,
            ))),
            ClaimOutcome::Completed(payload) => Ok(Begin::Completed(payload)),
            ClaimOutcome::InFlight { lease_left } => Ok(Begin::InFlight { lease_left }),
            ClaimOutcome::Mismatch => Ok(Begin::Mismatch),
            ClaimOutcome::PolicyMismatch => Ok(Begin::PolicyMismatch),
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
            .settings
            .bounded(StoreOp::Peek, self.settings.store.peek(key, fingerprint))
            .await
        {
            Ok(Some(ClaimOutcome::Completed(payload))) => Ok(Begin::Completed(payload)),
            Ok(Some(ClaimOutcome::InFlight { lease_left })) => Ok(Begin::InFlight { lease_left }),
            Ok(Some(ClaimOutcome::Mismatch)) => Ok(Begin::Mismatch),
            Ok(Some(ClaimOutcome::PolicyMismatch)) => Ok(Begin::PolicyMismatch),
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
            .settings
            .bounded(StoreOp::Inspect, self.settings.store.inspect(key))
            .await?)
    }

    /// Deletes the record at `key` whatever its state, so the next request runs the operation
    /// again. Answers whether there was a record.
    pub async fn purge(&self, key: &RecordKey) -> Result<bool, Error> {
        Ok(self
            .settings
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
                .settings
                .release_in_background(self.key.clone(), self.owner.clone());
        }
    }
}
