//! Where records live: the [`Store`] trait and its implementations (memory, Redis, PostgreSQL).
//!
//! A record moves through two states. A *claim* creates it **in flight**, owned by one
//! [`OwnerToken`], for the length of a lease. Its owner then either *completes* it (it becomes
//! **completed**, holding a payload, for the retention period) or *releases* it (it is deleted).
//! Every transition but the claim is owner-checked, so a request whose lease ran out and whose key
//! was claimed again can never overwrite or delete the newer owner's record.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;

use crate::{Fingerprint, RecordKey};

pub(crate) mod memory;
#[cfg(feature = "postgres")]
pub(crate) mod postgres;
#[cfg(feature = "postgres")]
mod postgres_connections;
#[cfg(feature = "redis")]
pub(crate) mod redis;
#[cfg(feature = "redis")]
mod redis_coalesce;
#[cfg(feature = "redis")]
mod redis_liveness;
#[cfg(feature = "redis")]
mod redis_notices;
#[cfg(feature = "redis")]
pub(crate) mod replica_acks;
#[cfg(feature = "redis")]
mod sentinel_watch;

/// The future a [`Store`] method returns: boxed, so `Store` can be used as `dyn Store`.
///
/// ```
/// use tower_idempotency::{StoreError, StoreFuture};
/// fn answer<'a>() -> StoreFuture<'a, bool> {
///     Box::pin(async { Ok::<_, StoreError>(true) })
/// }
/// # let _ = answer();
/// ```
pub type StoreFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, StoreError>> + Send + 'a>>;

/// The version of the record layout. A record in a newer layout (written by a newer release,
/// during a rolling upgrade) is answered like one in flight, to be retried, for the first 15
/// minutes after its claim (the age its owner token carries); after that, or when its age is
/// unknown, it is reported as [`StoreError::Corrupt`] (500 `UnreadableRecord`, an error
/// logged): that is no longer an upgrade under way but a rollback, and retries would otherwise
/// be told "in flight" until the record's retention ends. One in an unknown layout is reported
/// as [`StoreError::Corrupt`], never read as if it were ours. Within a record, the stored
/// response has a layout version of its own, read the same way: this release reads the
/// previous release's responses.
///
/// Every later layout keeps the first bytes of this one (Redis: `TIR`, the version, the owner's
/// length and the owner; PostgreSQL: the `version` and `owner` columns), so that this release
/// can read a newer record's age; a release that changes the stored response's layout changes
/// this version too.
///
/// ```
/// assert_eq!(tower_idempotency::RECORD_VERSION, 2);
/// ```
pub const RECORD_VERSION: u32 = 2;

/// A record store. Implementations must make each method atomic with respect to the others.
///
/// The built-in stores, [`MemoryStore`](crate::MemoryStore), `RedisStore` and `PostgresStore`,
/// pass one shared behaviour suite (`tests/store_suite.rs`); a custom store should pass it too.
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::{ClaimOutcome, Fingerprint, IdempotencyKey, MemoryStore, OwnerToken, RecordKey, Store};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), tower_idempotency::StoreError> {
/// let store = MemoryStore::new();
/// let key = RecordKey::new(None, IdempotencyKey::parse("k").unwrap());
/// let (fingerprint, owner) = (Fingerprint::new([b"body".as_slice()]), OwnerToken::generate());
/// assert_eq!(store.claim(&key, &fingerprint, &owner, Duration::from_secs(30)).await?, ClaimOutcome::Claimed);
/// assert!(store.complete(&key, &owner, "result".into(), Duration::from_secs(60)).await?);
/// let someone_else = OwnerToken::generate();
/// assert_eq!(
///     store.claim(&key, &fingerprint, &someone_else, Duration::from_secs(30)).await?,
///     ClaimOutcome::Completed("result".into())
/// );
/// # Ok(()) }
/// ```
pub trait Store: Send + Sync + 'static {
    /// Claims `key` for `owner`, or reports what is there.
    ///
    /// - no record (or an expired one): create it in flight for `owner`, expiring after `lease`;
    ///   answer [`ClaimOutcome::Claimed`];
    /// - in flight for `owner` itself (a claim sent twice): renew the lease and answer `Claimed`,
    ///   so a claim re-sent after a dropped connection never conflicts with itself;
    /// - a different fingerprint: answer [`ClaimOutcome::Mismatch`];
    /// - in flight for another owner: answer [`ClaimOutcome::InFlight`] with the lease left;
    /// - completed: answer [`ClaimOutcome::Completed`] with the payload.
    fn claim<'a>(
        &'a self,
        key: &'a RecordKey,
        fingerprint: &'a Fingerprint,
        owner: &'a OwnerToken,
        lease: Duration,
    ) -> StoreFuture<'a, ClaimOutcome>;

    /// Answers a claim from a copy this process already holds, with no round trip:
    /// `Some(`[`ClaimOutcome::Completed`]`)` or `Some(`[`ClaimOutcome::Mismatch`]`)` for a
    /// completed record held in a local cache, `None` to ask the store with
    /// [`claim`](Store::claim) (which does not look in the cache again).
    ///
    /// [`Coordinator`](crate::Coordinator) asks this first, before it takes an in-flight permit
    /// or makes an owner token, so a cached replay costs neither; any other answer is ignored.
    /// The default holds no copies; [`MemoryStore`](crate::MemoryStore) answers from its
    /// records.
    fn cached(&self, key: &RecordKey, fingerprint: &Fingerprint) -> Option<ClaimOutcome> {
        let _ = (key, fingerprint);
        None
    }

    /// Reports what [`claim`](Store::claim) would find at `key`, without claiming it: the answer
    /// a claim would give for the record there ([`ClaimOutcome::Completed`],
    /// [`ClaimOutcome::InFlight`] or [`ClaimOutcome::Mismatch`]), or `None` when there is no live
    /// record. One round trip, and nothing written.
    ///
    /// [`Coordinator`](crate::Coordinator) asks this instead of `claim` when it may not take new
    /// work (at its bound on running operations, or shutting down), so that a retry of a key
    /// already done or running still gets its replay or its 409 there. The default knows nothing
    /// (`Ok(None)`), so such retries get 503 like new work.
    fn peek<'a>(
        &'a self,
        key: &'a RecordKey,
        fingerprint: &'a Fingerprint,
    ) -> StoreFuture<'a, Option<ClaimOutcome>> {
        let _ = (key, fingerprint);
        Box::pin(std::future::ready(Ok(None)))
    }

    /// Completes `owner`'s claim with `payload`, kept for `retention`.
    ///
    /// Answers `true` if the record is now completed by `owner` (also when it already was: a
    /// completion sent twice succeeds twice), `false` if `owner` no longer holds the claim.
    fn complete<'a>(
        &'a self,
        key: &'a RecordKey,
        owner: &'a OwnerToken,
        payload: Bytes,
        retention: Duration,
    ) -> StoreFuture<'a, bool>;

    /// Deletes `owner`'s in-flight claim. Answers `false` if `owner` does not hold it.
    fn release<'a>(&'a self, key: &'a RecordKey, owner: &'a OwnerToken) -> StoreFuture<'a, bool>;

    /// Extends `owner`'s in-flight claim to `lease` from now. Answers `false` if `owner` does not
    /// hold it (its lease ran out, or it was purged or taken over).
    fn renew<'a>(
        &'a self,
        key: &'a RecordKey,
        owner: &'a OwnerToken,
        lease: Duration,
    ) -> StoreFuture<'a, bool>;

    /// Reads the record at `key` without changing it, for operators.
    fn inspect<'a>(&'a self, key: &'a RecordKey) -> StoreFuture<'a, Option<RecordInfo>>;

    /// Deletes the record at `key`, whatever its state. Answers whether there was one.
    fn purge<'a>(&'a self, key: &'a RecordKey) -> StoreFuture<'a, bool>;

    /// Lists the records in flight whose claim is at least `older_than` old, for operators
    /// looking for stuck or slow operations: the oldest first, at most `limit` of them.
    ///
    /// A record's age comes from its owner token, which carries the time it was made
    /// ([`OwnerToken::issued_at`]); a record whose token carries none (one claimed by an earlier
    /// release of this crate, or under a custom token) is listed whatever `older_than`, before
    /// the others, with an unknown age. Completed records are never listed, and a listing never
    /// shows an idempotency key: records are addressed by digest only
    /// ([`InFlightRecord::digest`]).
    ///
    /// This reads every record of the store, in bounded steps (Redis: `SCAN` pages on every
    /// master; PostgreSQL: pages of the primary key), so it is meant for operators, not for
    /// requests. The default answers [`StoreError::Unsupported`].
    fn in_flight<'a>(&'a self, older_than: Duration, limit: usize) -> StoreFuture<'a, Vec<InFlightRecord>> {
        let _ = (older_than, limit);
        Box::pin(std::future::ready(Err(StoreError::Unsupported(
            "this store cannot list its records in flight",
        ))))
    }

    /// Subscribes to the settling of the record at `key`: its completion, release or purge,
    /// by any instance sharing the store. Used only for a caller that asked to wait for a
    /// running operation ([`Coordinator::begin_or_wait`](crate::Coordinator::begin_or_wait)),
    /// never on the path of one that did not.
    ///
    /// Semantics, for implementers:
    ///
    /// - once the future answers `Some(watch)`, every completion, release or purge of `key`
    ///   made afterwards wakes [`KeyWatch::changed`] at least once. The caller reads the record
    ///   *after* subscribing, so a change between its first read and the subscription is not
    ///   missed;
    /// - wake-ups may be spurious (the caller reads the record again and waits on if it is still
    ///   in flight): a store that loses its notification channel for a while should wake every
    ///   watch once it is back;
    /// - a lease that simply runs out need not be notified: the caller also wakes when the lease
    ///   it last read ends;
    /// - dropping the watch ends the subscription; many watches of one key should share one
    ///   subscription, and all watches one connection (never one per waiter).
    ///
    /// The default, `Ok(None)`, means the store cannot notify: the coordinator then reads the
    /// record again at growing intervals (50 ms doubling to 1 s, and at the lease's end) until
    /// it settles or the wait ends. That costs a read per interval per waiter; stores that can
    /// notify should.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::{Fingerprint, IdempotencyKey, MemoryStore, OwnerToken, RecordKey, Store};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), tower_idempotency::StoreError> {
    /// let store = MemoryStore::new();
    /// let key = RecordKey::new(None, IdempotencyKey::parse("k").unwrap());
    /// let owner = OwnerToken::generate();
    /// store.claim(&key, &Fingerprint::new([b"body".as_slice()]), &owner, Duration::from_secs(30)).await?;
    /// let mut watch = store.watch(&key).await?.expect("the memory store notifies");
    /// store.complete(&key, &owner, "result".into(), Duration::from_secs(60)).await?;
    /// assert!(watch.changed().await, "woken by the completion");
    /// # Ok(()) }
    /// ```
    fn watch<'a>(&'a self, key: &'a RecordKey) -> StoreFuture<'a, Option<KeyWatch>> {
        let _ = key;
        Box::pin(std::future::ready(Ok(None)))
    }

    /// While the store holds its owners' writes back on purpose (`RedisStore` during a Sentinel
    /// failover, from the promotion of a replica until the store is on the new master), a
    /// future that ends when they may go again; `None` otherwise, which is almost always and
    /// costs nothing.
    ///
    /// [`Coordinator`](crate::Coordinator) waits on it before it completes, renews or releases a
    /// claim, outside its store timeout: a result held back for longer than the timeout is then
    /// stored once the store takes writes again, not abandoned. It waits at most a lease (a
    /// claim cannot outlive that on a store that took no renewal meanwhile). The store's own
    /// methods should still hold a write that comes while it holds them (the hold may begin
    /// between this call and the write). The default holds nothing.
    ///
    /// ```
    /// use tower_idempotency::{MemoryStore, Store};
    /// assert!(MemoryStore::new().writes_held().is_none());
    /// ```
    fn writes_held(&self) -> Option<StoreFuture<'_, ()>> {
        None
    }
}

/// A subscription to the settling of one record, from [`Store::watch`]: woken when the record
/// may have changed; dropping it ends the subscription.
///
/// A store makes one from the receiving end of a `tokio::sync::watch` channel whose sender it
/// bumps on every change of the key, and a guard that it keeps alive as long as the watch (to
/// end the subscription when the last watch of a key is dropped).
///
/// ```
/// use tower_idempotency::KeyWatch;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let (notify, changes) = tokio::sync::watch::channel(0u64);
/// let mut watch = KeyWatch::new(changes, ());
/// notify.send_modify(|n| *n += 1);
/// assert!(watch.changed().await);
/// drop(notify);
/// assert!(!watch.changed().await, "the store stopped notifying");
/// # }
/// ```
pub struct KeyWatch {
    changes: tokio::sync::watch::Receiver<u64>,
    _guard: Box<dyn std::any::Any + Send + Sync>,
}

impl KeyWatch {
    /// A watch woken by every change `changes` sees after this call, holding `guard` until it
    /// is dropped.
    pub fn new(mut changes: tokio::sync::watch::Receiver<u64>, guard: impl Send + Sync + 'static) -> Self {
        changes.mark_unchanged();
        Self {
            changes,
            _guard: Box::new(guard),
        }
    }

    /// Waits for the next change. Answers `false`, at once, if the store can no longer notify
    /// (the sending side is gone): the caller should stop relying on this watch.
    pub async fn changed(&mut self) -> bool {
        self.changes.changed().await.is_ok()
    }
}

impl std::fmt::Debug for KeyWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyWatch").finish_non_exhaustive()
    }
}

/// A shared store is a store: `Arc<dyn Store>` and `Arc<MemoryStore>` can be handed to a layer.
impl<S: Store + ?Sized> Store for std::sync::Arc<S> {
    fn claim<'a>(
        &'a self,
        key: &'a RecordKey,
        fingerprint: &'a Fingerprint,
        owner: &'a OwnerToken,
        lease: Duration,
    ) -> StoreFuture<'a, ClaimOutcome> {
        (**self).claim(key, fingerprint, owner, lease)
    }

    fn cached(&self, key: &RecordKey, fingerprint: &Fingerprint) -> Option<ClaimOutcome> {
        (**self).cached(key, fingerprint)
    }

    fn peek<'a>(
        &'a self,
        key: &'a RecordKey,
        fingerprint: &'a Fingerprint,
    ) -> StoreFuture<'a, Option<ClaimOutcome>> {
        (**self).peek(key, fingerprint)
    }

    fn complete<'a>(
        &'a self,
        key: &'a RecordKey,
        owner: &'a OwnerToken,
        payload: Bytes,
        retention: Duration,
    ) -> StoreFuture<'a, bool> {
        (**self).complete(key, owner, payload, retention)
    }

    fn release<'a>(&'a self, key: &'a RecordKey, owner: &'a OwnerToken) -> StoreFuture<'a, bool> {
        (**self).release(key, owner)
    }

    fn renew<'a>(
        &'a self,
        key: &'a RecordKey,
        owner: &'a OwnerToken,
        lease: Duration,
    ) -> StoreFuture<'a, bool> {
        (**self).renew(key, owner, lease)
    }

    fn inspect<'a>(&'a self, key: &'a RecordKey) -> StoreFuture<'a, Option<RecordInfo>> {
        (**self).inspect(key)
    }

    fn purge<'a>(&'a self, key: &'a RecordKey) -> StoreFuture<'a, bool> {
        (**self).purge(key)
    }

    fn in_flight<'a>(&'a self, older_than: Duration, limit: usize) -> StoreFuture<'a, Vec<InFlightRecord>> {
        (**self).in_flight(older_than, limit)
    }

    fn watch<'a>(&'a self, key: &'a RecordKey) -> StoreFuture<'a, Option<KeyWatch>> {
        (**self).watch(key)
    }

    fn writes_held(&self) -> Option<StoreFuture<'_, ()>> {
        (**self).writes_held()
    }
}

/// What a claim found; see [`Store::claim`] for an example.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimOutcome {
    /// The caller now owns the key and should run the operation.
    Claimed,
    /// The operation ran before; here is its stored payload.
    Completed(Bytes),
    /// Another owner is running the operation; its lease ends in this much time.
    InFlight {
        /// Time left on the current owner's lease.
        lease_left: Duration,
    },
    /// The key was used with a different fingerprint.
    Mismatch,
}

/// The state of a record, for operators.
///
/// ```
/// use tower_idempotency::RecordState;
/// assert_ne!(RecordState::InFlight, RecordState::Completed);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordState {
    /// Claimed, operation running.
    InFlight,
    /// Completed; the payload is kept until retention ends.
    Completed,
}

/// A record as [`Store::inspect`] sees it.
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::{RecordInfo, RecordState};
/// let info = RecordInfo::new(RecordState::InFlight, Duration::from_secs(12), None);
/// assert_eq!(info.state, RecordState::InFlight);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RecordInfo {
    /// In flight or completed.
    pub state: RecordState,
    /// Lease left (in flight) or retention left (completed).
    pub expires_in: Duration,
    /// The stored payload of a completed record.
    pub payload: Option<Bytes>,
    /// The claim's owner, for a record in flight whose store says (every store of this crate
    /// does): an operator about to purge a running request sees whose it is.
    pub owner: Option<OwnerToken>,
}

impl RecordInfo {
    /// A record description; for custom [`Store`] implementations.
    pub fn new(state: RecordState, expires_in: Duration, payload: Option<Bytes>) -> Self {
        Self {
            state,
            expires_in,
            payload,
            owner: None,
        }
    }

    /// The same, naming the claim's owner (default: none).
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::{OwnerToken, RecordInfo, RecordState};
    /// let owner = OwnerToken::generate();
    /// let info = RecordInfo::new(RecordState::InFlight, Duration::from_secs(12), None).with_owner(owner.clone());
    /// assert_eq!(info.owner, Some(owner));
    /// ```
    pub fn with_owner(mut self, owner: OwnerToken) -> Self {
        self.owner = Some(owner);
        self
    }
}

/// A record in flight as [`Store::in_flight`] lists it: its address, its owner, how long ago it
/// was claimed and how much of its lease is left. Never the idempotency key or the scope, which
/// may hold personal data: stores keep only their digest.
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::{InFlightRecord, OwnerToken};
/// let record = InFlightRecord::new([7; 32], OwnerToken::generate(), Duration::from_secs(20));
/// assert!(record.age.is_some_and(|age| age < Duration::from_secs(5)), "claimed just now");
/// assert_eq!(record.digest_hex().len(), 64);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct InFlightRecord {
    /// The record's address, the SHA-256 of its scope and key ([`RecordKey::digest`]).
    pub digest: [u8; 32],
    /// The claim's owner. Tokens made by one process share their first 32 characters, so the
    /// records of one stuck or crashed instance can be told apart from the others'.
    pub owner: OwnerToken,
    /// How long ago the record was claimed (from [`OwnerToken::issued_at`]), by the clock of
    /// the instance that claimed it against this process's; `None` when the token carries no
    /// time.
    pub age: Option<Duration>,
    /// Time left on the lease (renewed while the owner runs).
    pub lease_left: Duration,
}

impl InFlightRecord {
    /// A listed record, its age read from `owner`'s token; for custom [`Store`] implementations.
    pub fn new(digest: [u8; 32], owner: OwnerToken, lease_left: Duration) -> Self {
        Self::at(std::time::SystemTime::now(), digest, owner, lease_left)
    }

    /// [`new`](Self::new), its age counted to `now`: one `now` for a whole listing, so that
    /// records claimed together show the same age however long the listing takes.
    pub(crate) fn at(
        now: std::time::SystemTime,
        digest: [u8; 32],
        owner: OwnerToken,
        lease_left: Duration,
    ) -> Self {
        let age = owner
            .issued_at()
            .map(|issued| now.duration_since(issued).unwrap_or_default());
        Self {
            digest,
            owner,
            age,
            lease_left,
        }
    }

    /// The digest in lower-case hex, as `RedisStore` names its keys and an operator reads it.
    pub fn digest_hex(&self) -> String {
        crate::key::hex(&self.digest)
    }

    /// Whether a listing for records at least `older_than` old shows this one: a record of
    /// unknown age is always shown, since it may be the oldest.
    pub(crate) fn is_older_than(&self, older_than: Duration) -> bool {
        match self.age {
            Some(age) => age >= older_than,
            None => true,
        }
    }
}

/// The `limit` oldest of the records gathered so far, for [`Store::in_flight`]: memory stays
/// bounded by twice the limit however many records a store holds.
pub(crate) struct Oldest {
    older_than: Duration,
    limit: usize,
    /// When the listing started: every age is counted to it.
    now: std::time::SystemTime,
    records: Vec<InFlightRecord>,
}

impl Oldest {
    pub(crate) fn new(older_than: Duration, limit: usize) -> Self {
        Self {
            older_than,
            limit,
            now: std::time::SystemTime::now(),
            records: Vec::new(),
        }
    }

    /// Keeps the record of `owner` at `digest` if it is old enough and among the oldest so far.
    pub(crate) fn offer(&mut self, digest: [u8; 32], owner: OwnerToken, lease_left: Duration) {
        let record = InFlightRecord::at(self.now, digest, owner, lease_left);
        if self.limit == 0 || !record.is_older_than(self.older_than) {
            return;
        }
        self.records.push(record);
        if self.records.len() >= self.limit.saturating_mul(2) {
            self.trim();
        }
    }

    fn trim(&mut self) {
        // Unknown ages first (possibly the oldest), then by age; the digest makes the order total.
        self.records.sort_by(|a, b| {
            let age = |r: &InFlightRecord| r.age.unwrap_or(Duration::MAX);
            age(b).cmp(&age(a)).then_with(|| a.digest.cmp(&b.digest))
        });
        self.records.truncate(self.limit);
    }

    /// The oldest first.
    pub(crate) fn into_vec(mut self) -> Vec<InFlightRecord> {
        self.trim();
        self.records
    }
}

/// A store failure. Every variant but `Corrupt` and `TooLarge` means "the answer is unknown": the
/// layer fails closed on it (503), or open if configured. `Corrupt` is answered 500 and never
/// failed open. `TooLarge` comes only from a completion, which is then not retried.
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::StoreError;
/// let error = StoreError::Timeout(Duration::from_secs(2));
/// assert_eq!(error.to_string(), "the idempotency store did not answer within 2s");
/// let refused = StoreError::TooLarge { size: 2_000_000, limit: 1_000_000 };
/// assert!(refused.to_string().contains("(2000000 bytes)"));
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The store could not be reached or answered with an error.
    #[error("the idempotency store is unavailable: {0}")]
    Unavailable(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The store did not answer in time.
    #[error("the idempotency store did not answer within {0:?}")]
    Timeout(Duration),
    /// The data at the record's address is not a record this version can read.
    #[error("the record at this key is unreadable: {0}")]
    Corrupt(String),
    /// The store is full of in-flight claims and cannot take another.
    #[error("the idempotency store is full")]
    Full,
    /// A result is larger than the store will ever hold, so it was not stored.
    #[error("the result ({size} bytes) is larger than the idempotency store holds ({limit} bytes at most)")]
    TooLarge {
        /// The result's size in bytes.
        size: usize,
        /// The largest result the store holds, in bytes.
        limit: usize,
    },
    /// The store does not offer this operation (a custom store without
    /// [`Store::in_flight`], say). Never returned on a request's path.
    #[error("not supported: {0}")]
    Unsupported(&'static str),
    /// Fewer replicas than required acknowledged a write in time (the durability option,
    /// `RedisStore::with_replica_acks`). A claim answered so was released again.
    #[error("only {acknowledged} of the {wanted} replicas required acknowledged the write in time")]
    NotReplicated {
        /// How many replicas acknowledged it.
        acknowledged: u32,
        /// How many were required.
        wanted: u32,
    },
    /// The master did not write a claim or a completion to its append-only file in time (the
    /// durability option with `ReplicaAcks::fsync`). A claim answered so was released again.
    #[error("the master did not write the record to its append-only file in time")]
    NotFsynced,
}

impl StoreError {
    /// Whether the store refused the write on purpose, to protect it from a failover, rather
    /// than because it failed: a claim refused at the Sentinel fence, or one the replicas (or the
    /// master's disk) did not acknowledge in time (`ReplicaAcks`). The layer answers it 503 and
    /// counts it apart (`fenced`); it never runs the handler unprotected for it, fail-open or not:
    /// the store is up, and a claim written during a failover may be lost. A
    /// [`Coordinator`](crate::Coordinator) user with a fail-open of its own should do the same.
    ///
    /// ```
    /// use tower_idempotency::StoreError;
    /// assert!(StoreError::NotReplicated { acknowledged: 0, wanted: 1 }.is_fence());
    /// assert!(!StoreError::Timeout(std::time::Duration::from_secs(2)).is_fence());
    /// ```
    pub fn is_fence(&self) -> bool {
        match self {
            StoreError::NotReplicated { .. } | StoreError::NotFsynced => true,
            #[cfg(feature = "redis")]
            StoreError::Unavailable(source) => {
                source.is::<sentinel_watch::FailingOver>()
                    || source.is::<sentinel_watch::SentinelsUnheard>()
                    || source.is::<replica_acks::Unacknowledged>()
            }
            _ => false,
        }
    }
}

/// A unique token naming one claim's owner. Completion, release and renewal must present it.
///
/// Tokens are a per-process random prefix, a counter and the time they were made:
/// `<32 hex digits>-<counter in hex>@<milliseconds since the Unix epoch>`. The prefix and the
/// counter make them unique across processes; the time, stored with the claim as part of the
/// token, tells operators how long a record has been in flight ([`Store::in_flight`]) without
/// a field of its own in any store's record layout, so records stay readable by the previous
/// release. Making one reads the wall clock (no system call where the clock is in the vDSO).
///
/// ```
/// use tower_idempotency::OwnerToken;
/// assert_ne!(OwnerToken::generate(), OwnerToken::generate());
/// assert!(OwnerToken::generate().issued_at().is_some());
/// ```
// An `Arc`: the memory store keeps a clone in the record it claims for the token's holder, and
// the coordinator hands clones to releases and renewals; each is then a count, not a copy.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub struct OwnerToken(Arc<str>);

impl OwnerToken {
    /// A new token, different from every other token of this and any other process.
    pub fn generate() -> Self {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let millis = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        Self(token_text(process_nonce(), n, millis))
    }

    /// Wraps an existing token, for custom stores and tests. A token ending in `@` and a number
    /// is read as made at that many milliseconds since the Unix epoch ([`issued_at`](Self::issued_at)).
    ///
    /// ```
    /// use std::time::{Duration, UNIX_EPOCH};
    /// use tower_idempotency::OwnerToken;
    /// let token = OwnerToken::from_string("worker-1@1700000000000");
    /// assert_eq!(token.issued_at(), Some(UNIX_EPOCH + Duration::from_secs(1_700_000_000)));
    /// assert_eq!(OwnerToken::from_string("worker-1").issued_at(), None);
    /// ```
    pub fn from_string(token: impl Into<String>) -> Self {
        Self(Arc::from(token.into()))
    }

    /// The token's text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// When the token was made, by the clock of the process that made it: the claim's start,
    /// for a token from [`generate`](Self::generate). `None` for a token that does not end in
    /// `@<milliseconds since the Unix epoch>`.
    pub fn issued_at(&self) -> Option<std::time::SystemTime> {
        token_issued_at(&self.0)
    }
}

/// When the owner token `token` was made, if it says.
fn token_issued_at(token: &str) -> Option<std::time::SystemTime> {
    let (_, millis) = token.rsplit_once('@')?;
    if millis.is_empty() || !millis.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let millis: u64 = millis.parse().ok()?;
    std::time::UNIX_EPOCH.checked_add(std::time::Duration::from_millis(millis))
}

/// How long after its claim a record in a newer layout is taken for a rolling upgrade under way,
/// and answered "in flight, retry in a second" (an instance of the newer release can replay it).
/// Past it, the newer release is taken to be gone (rolled back), and the record is reported
/// unreadable: a client retrying it would otherwise loop on 409 until its retention ends.
#[cfg(any(feature = "redis", feature = "postgres"))]
pub(crate) const NEWER_RECORD_WINDOW: Duration = Duration::from_secs(15 * 60);

/// What a claim (or a peek) answers for a record in layout `version`, newer than this release's,
/// whose owner token is `owner`: see [`RECORD_VERSION`].
#[cfg(any(feature = "redis", feature = "postgres"))]
pub(crate) fn newer_record(
    key: &RecordKey,
    version: u32,
    owner: &[u8],
    lease: Duration,
) -> Result<ClaimOutcome, StoreError> {
    let age = std::str::from_utf8(owner)
        .ok()
        .and_then(token_issued_at)
        .map(|at| {
            std::time::SystemTime::now()
                .duration_since(at)
                .unwrap_or_default()
        });
    match age {
        Some(age) if age < NEWER_RECORD_WINDOW => {
            // A rolling upgrade is under way: retry later (on an instance of that release, or
            // once this one is upgraded), never "corrupt".
            tracing::info!(
                ?key,
                version,
                "record written by a newer release; answering as if in flight"
            );
            Ok(ClaimOutcome::InFlight {
                lease_left: Duration::from_secs(1).min(lease),
            })
        }
        _ => Err(StoreError::Corrupt(format!(
            "a record in layout version {version}, claimed by a newer release {}; past the 15 minutes \
             of a rolling upgrade this release no longer answers it as in flight: roll forward to \
             that release, or purge the key (README, \"Rolling back\")",
            match age {
                Some(age) => format!("{} s ago", age.as_secs()),
                None => "at an unknown time".to_owned(),
            }
        ))),
    }
}

/// `<nonce>-<n in hex>@<millis in decimal>`, built at its exact length: one allocation per claim.
/// The digits are written back to front into a buffer, one division by a constant each: every
/// keyed request that reaches a claim makes a token, a replay from Redis included (a replay
/// answered by [`Store::cached`] makes none).
fn token_text(nonce: &str, n: u64, millis: u64) -> Arc<str> {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    // "-", 16 hex digits, "@", 20 decimal digits.
    let mut tail = [0u8; 38];
    let mut at = tail.len();
    let mut rest = millis;
    loop {
        at -= 1;
        tail[at] = b'0' + (rest % 10) as u8;
        rest /= 10;
        if rest == 0 {
            break;
        }
    }
    at -= 1;
    tail[at] = b'@';
    let mut rest = n;
    loop {
        at -= 1;
        tail[at] = HEX[(rest & 0xf) as usize];
        rest >>= 4;
        if rest == 0 {
            break;
        }
    }
    at -= 1;
    tail[at] = b'-';
    // The whole token on the stack first (the nonce is 32 digits), so that the `Arc` is the one
    // allocation.
    let mut text = [0u8; NONCE_LEN + 38];
    let len = nonce.len() + tail.len() - at;
    let Some(whole) = text.get_mut(..len) else {
        return Arc::from(format!("{nonce}{}", String::from_utf8_lossy(&tail[at..])));
    };
    let (head, rest) = whole.split_at_mut(nonce.len());
    head.copy_from_slice(nonce.as_bytes());
    rest.copy_from_slice(&tail[at..]);
    // ASCII only, so always UTF-8: this is the check (`from_utf8` takes its ASCII path, where
    // `from_utf8_lossy` walked the bytes in chunks for a third of this function's cost).
    match std::str::from_utf8(whole) {
        Ok(text) => Arc::from(text),
        Err(_) => Arc::from(&*String::from_utf8_lossy(whole)),
    }
}

/// The length of [`process_nonce`]: 128 bits in hex.
const NONCE_LEN: usize = 32;

/// 128 bits that differ between processes. `RandomState` is seeded from the operating system's
/// random source, so this needs no extra dependency.
fn process_nonce() -> &'static str {
    static NONCE: OnceLock<String> = OnceLock::new();
    NONCE.get_or_init(|| {
        use std::hash::{BuildHasher, Hasher};
        let half = |salt: u64| {
            let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
            hasher.write_u64(salt);
            hasher.write_u32(std::process::id());
            hasher.finish()
        };
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or_default();
        format!("{:016x}{:016x}", half(nanos), half(!nanos))
    })
}

#[cfg(test)]
mod tests {
    /// The metrics count a claim refused at the Sentinel fence, or unacknowledged by replicas or
    /// by the master's disk, as `fenced`, and any other failure as a store error.
    #[test]
    fn fence_refusals_are_told_apart_from_failures() {
        use super::StoreError;
        let replicas = StoreError::NotReplicated {
            acknowledged: 0,
            wanted: 1,
        };
        assert!(replicas.is_fence());
        assert!(StoreError::NotFsynced.is_fence());
        #[cfg(feature = "redis")]
        assert!(StoreError::Unavailable(Box::new(super::sentinel_watch::FailingOver)).is_fence());
        #[cfg(feature = "redis")]
        {
            let wait_failed = StoreError::Timeout(std::time::Duration::from_secs(2));
            let unacknowledged = super::replica_acks::Unacknowledged(wait_failed);
            assert!(StoreError::Unavailable(Box::new(unacknowledged)).is_fence());
        }
        let reset = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset");
        assert!(!StoreError::Unavailable(Box::new(reset)).is_fence());
        assert!(!StoreError::Timeout(std::time::Duration::from_secs(2)).is_fence());
    }
    use super::OwnerToken;
    use std::time::{Duration, SystemTime, UNIX_EPOCH};

    #[test]
    fn owner_tokens_are_the_nonce_the_counter_in_hex_and_the_time() {
        // A short nonce, the real one, and one longer than the stack buffer is made for.
        let long = "n".repeat(super::NONCE_LEN + 1);
        for nonce in ["nonce", super::process_nonce(), &long] {
            for n in [0, 9, 0xf, 0x10, 0xabc, u64::MAX] {
                for millis in [0, 7, 10, 1_763_807_554_123, u64::MAX] {
                    let token = super::token_text(nonce, n, millis);
                    assert_eq!(&*token, format!("{nonce}-{n:x}@{millis}"));
                    let issued = OwnerToken::from_string(&*token).issued_at();
                    let expected = UNIX_EPOCH.checked_add(Duration::from_millis(millis));
                    assert_eq!(issued, expected, "{n} {millis}");
                }
            }
        }
        assert_eq!(super::process_nonce().len(), super::NONCE_LEN);
    }

    #[test]
    fn a_generated_token_was_issued_now() {
        let before = SystemTime::now() - Duration::from_millis(1);
        let issued = OwnerToken::generate().issued_at().expect("a time");
        assert!(issued >= before && issued <= SystemTime::now(), "{issued:?}");
    }

    /// A store that does not implement `in_flight` says so, rather than listing nothing.
    #[tokio::test]
    async fn a_store_without_a_listing_answers_unsupported() {
        use super::{Store, StoreError, StoreFuture};
        use crate::{Fingerprint, MemoryStore, RecordKey};
        use bytes::Bytes;

        struct Minimal(MemoryStore);
        impl Store for Minimal {
            fn claim<'a>(
                &'a self,
                key: &'a RecordKey,
                fingerprint: &'a Fingerprint,
                owner: &'a OwnerToken,
                lease: Duration,
            ) -> StoreFuture<'a, super::ClaimOutcome> {
                self.0.claim(key, fingerprint, owner, lease)
            }
            fn complete<'a>(
                &'a self,
                key: &'a RecordKey,
                owner: &'a OwnerToken,
                payload: Bytes,
                retention: Duration,
            ) -> StoreFuture<'a, bool> {
                self.0.complete(key, owner, payload, retention)
            }
            fn release<'a>(&'a self, key: &'a RecordKey, owner: &'a OwnerToken) -> StoreFuture<'a, bool> {
                self.0.release(key, owner)
            }
            fn renew<'a>(
                &'a self,
                key: &'a RecordKey,
                owner: &'a OwnerToken,
                lease: Duration,
            ) -> StoreFuture<'a, bool> {
                self.0.renew(key, owner, lease)
            }
            fn inspect<'a>(&'a self, key: &'a RecordKey) -> StoreFuture<'a, Option<super::RecordInfo>> {
                self.0.inspect(key)
            }
            fn purge<'a>(&'a self, key: &'a RecordKey) -> StoreFuture<'a, bool> {
                self.0.purge(key)
            }
        }
        let store = std::sync::Arc::new(Minimal(MemoryStore::new()));
        let listed = store.in_flight(Duration::ZERO, 10).await;
        assert!(matches!(listed, Err(StoreError::Unsupported(_))), "{listed:?}");
        let layer = crate::IdempotencyLayer::new(store);
        let listed = layer.in_flight(Duration::ZERO, 10).await;
        assert!(
            matches!(listed, Err(crate::Error::Store(StoreError::Unsupported(_)))),
            "{listed:?}"
        );
    }

    #[test]
    fn tokens_without_a_time_have_none() {
        for token in [
            "",
            "a",
            "a@",
            "a@b",
            "a@-1",
            "a@+5",
            "a@1.5",
            "a@99999999999999999999999",
        ] {
            assert_eq!(OwnerToken::from_string(token).issued_at(), None, "{token}");
        }
    }
}
