//! The [`Store`] trait: what every store promises, method by method.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use bytes::Bytes;

use super::error::StoreError;
use super::record::{ClaimOutcome, InFlightRecord, OwnerToken, RecordInfo};
use crate::fingerprint::Fingerprint;
use crate::key::RecordKey;

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

///
/// The built-in stores, [`MemoryStore`](crate::MemoryStore), `RedisStore` and `PostgresStore`,
/// pass one shared behaviour suite, the conformance kit; a custom store should pass it too:
/// `tower_idempotency::testing::conformance` (crate feature `testing`) runs it in one call.
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
    /// - a different fingerprint: answer [`ClaimOutcome::Mismatch`], or
    ///   [`ClaimOutcome::PolicyMismatch`] when the record's fingerprint was made under another
    ///   policy: keep the fingerprint's [`policy`](Fingerprint::policy) tag beside it, and answer
    ///   [`ClaimOutcome::mismatch`] (a store that keeps no tag answers the plain mismatch, and its
    ///   clients are not told that a policy change is the cause);
    /// - in flight for another owner: answer [`ClaimOutcome::InFlight`] with the lease left;
    /// - completed: answer [`ClaimOutcome::Completed`] with the payload.
    fn claim<'a>(
        &'a self,
        key: &'a RecordKey,
        fingerprint: &'a Fingerprint,
        owner: &'a OwnerToken,
        lease: Duration,
    ) -> StoreFuture<'a, ClaimOutcome>;

    /// [`claim`](Store::claim), made by a caller that waits for `key` to settle (after a
    /// [`watch`](Store::watch)): the same answers, and a store whose completions tell only the
    /// waiters they know of learns of this one in the same step. The default is `claim`.
    ///
    /// [`RedisStore`](crate::RedisStore) marks another owner's in-flight record it finds as
    /// waited for (the claim and the mark in one script), and publishes the settled notice only
    /// when it completes or releases a marked record: so a completion nobody waits for sends
    /// no notice, and one a waiter has read cannot slip between that read and a separate mark.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::{ClaimOutcome, Fingerprint, IdempotencyKey, MemoryStore, OwnerToken, RecordKey, Store};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), tower_idempotency::StoreError> {
    /// let store = MemoryStore::new();
    /// let key = RecordKey::new(None, IdempotencyKey::parse("k").unwrap());
    /// let body = Fingerprint::new([b"body".as_slice()]);
    /// let lease = Duration::from_secs(30);
    /// let first = OwnerToken::generate();
    /// assert_eq!(store.claim(&key, &body, &first, lease).await?, ClaimOutcome::Claimed);
    /// let mut watch = store.watch(&key).await?.expect("the memory store notifies");
    /// let read = store.claim_waiting(&key, &body, &OwnerToken::generate(), lease).await?;
    /// assert!(matches!(read, ClaimOutcome::InFlight { .. }));
    /// store.complete(&key, &first, "result".into(), Duration::from_secs(60)).await?;
    /// assert!(watch.changed().await, "woken by the completion");
    /// # Ok(()) }
    /// ```
    fn claim_waiting<'a>(
        &'a self,
        key: &'a RecordKey,
        fingerprint: &'a Fingerprint,
        owner: &'a OwnerToken,
        lease: Duration,
    ) -> StoreFuture<'a, ClaimOutcome> {
        self.claim(key, fingerprint, owner, lease)
    }

    /// Answers a claim from a copy this process already holds, with no round trip:
    /// `Some(`[`ClaimOutcome::Completed`]`)` or `Some(`[`ClaimOutcome::Mismatch`]`)` (or
    /// [`PolicyMismatch`](ClaimOutcome::PolicyMismatch)) for a
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
    /// [`ClaimOutcome::InFlight`], [`ClaimOutcome::Mismatch`] or
    /// [`ClaimOutcome::PolicyMismatch`]), or `None` when there is no live
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
    ///   made afterwards wakes [`KeyWatch::changed`] at least once, of a record that the
    ///   watching caller has read since with [`claim_waiting`](Store::claim_waiting). The caller
    ///   reads the record *after* subscribing, and after every wake-up, with `claim_waiting`, so
    ///   a change between its first read and the subscription is not missed, and a record
    ///   claimed afresh (after a release) is read before the caller waits on it;
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

    fn claim_waiting<'a>(
        &'a self,
        key: &'a RecordKey,
        fingerprint: &'a Fingerprint,
        owner: &'a OwnerToken,
        lease: Duration,
    ) -> StoreFuture<'a, ClaimOutcome> {
        (**self).claim_waiting(key, fingerprint, owner, lease)
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
