//! The embedded store: one process, no dependencies, the same semantics as Redis.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;

use super::{ClaimOutcome, OwnerToken, RecordInfo, RecordState, Store, StoreError, StoreFuture};
use crate::{Fingerprint, RecordKey};

const DEFAULT_MAX_ENTRIES: usize = 10_000;

/// An in-process [`Store`]: records expire like Redis keys, and the number of records is bounded.
///
/// It protects one process only: instances behind a load balancer need a shared store such as
/// `RedisStore`. When it holds `max_entries` records, expired ones are dropped first, then the
/// completed record nearest its expiry (a later retry of that key runs again; a warning is
/// logged the first time). In-flight records are never evicted: when all entries are in flight a new claim fails
/// with [`StoreError::Full`], which the layer answers with 503.
///
/// Clones share the same records.
///
/// ```
/// use tower_idempotency::MemoryStore;
///
/// let store = MemoryStore::new().with_max_entries(50_000);
/// # let _ = store;
/// ```
#[derive(Clone, Debug)]
pub struct MemoryStore {
    shared: Arc<Mutex<Records>>,
}

#[derive(Debug)]
struct Records {
    max_entries: usize,
    by_key: HashMap<[u8; 32], Entry>,
    /// In-flight records in lease order: (expires_at, sequence) → key. Kept apart from the
    /// completed ones so eviction never has to step over a running request's record.
    leases: BTreeMap<(Instant, u64), [u8; 32]>,
    /// Completed records in expiry order, the eviction order once the store is full.
    retained: BTreeMap<(Instant, u64), [u8; 32]>,
    sequence: u64,
    warned_of_eviction: bool,
}

#[derive(Debug)]
struct Entry {
    fingerprint: Fingerprint,
    state: State,
    expires_at: Instant,
    sequence: u64,
}

#[derive(Debug)]
enum State {
    InFlight { owner: OwnerToken },
    Completed { owner: OwnerToken, payload: Bytes },
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryStore {
    /// An empty store holding at most 10 000 records.
    pub fn new() -> Self {
        Self {
            shared: Arc::new(Mutex::new(Records {
                max_entries: DEFAULT_MAX_ENTRIES,
                by_key: HashMap::new(),
                leases: BTreeMap::new(),
                retained: BTreeMap::new(),
                sequence: 0,
                warned_of_eviction: false,
            })),
        }
    }

    /// Bounds the number of records kept (default: 10 000; at least 1).
    ///
    /// ```
    /// use tower_idempotency::MemoryStore;
    /// let store = MemoryStore::new().with_max_entries(100);
    /// # let _ = store;
    /// ```
    pub fn with_max_entries(self, max_entries: usize) -> Self {
        self.lock().max_entries = max_entries.max(1);
        self
    }

    /// The number of records held, expired ones not yet dropped included.
    pub fn len(&self) -> usize {
        self.lock().by_key.len()
    }

    /// Whether the store holds no records.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> MutexGuard<'_, Records> {
        // A panic while holding the lock cannot leave a record half-written (every update is a
        // single insert or remove), so the data behind a poisoned lock is still sound.
        self.shared
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl Records {
    /// The live entry at `digest`, dropping it first if it has expired.
    fn live(&mut self, digest: &[u8; 32], now: Instant) -> Option<&mut Entry> {
        let expired = self.by_key.get(digest).is_some_and(|e| e.expires_at <= now);
        if expired {
            self.remove(digest);
        }
        self.by_key.get_mut(digest)
    }

    /// Whether `owner` holds a live in-flight claim at `digest`.
    fn holds_in_flight(&mut self, digest: &[u8; 32], owner: &OwnerToken, now: Instant) -> bool {
        matches!(
            self.live(digest, now),
            Some(Entry { state: State::InFlight { owner: holder }, .. }) if holder == owner
        )
    }

    fn remove(&mut self, digest: &[u8; 32]) -> Option<Entry> {
        let entry = self.by_key.remove(digest)?;
        let index = match entry.state {
            State::InFlight { .. } => &mut self.leases,
            State::Completed { .. } => &mut self.retained,
        };
        index.remove(&(entry.expires_at, entry.sequence));
        Some(entry)
    }

    /// Moves the entry at `digest` to `expires_at` in its state's index.
    fn set_expiry(&mut self, digest: &[u8; 32], expires_at: Instant) {
        self.sequence += 1;
        let sequence = self.sequence;
        if let Some(entry) = self.by_key.get_mut(digest) {
            let index = match entry.state {
                State::InFlight { .. } => &mut self.leases,
                State::Completed { .. } => &mut self.retained,
            };
            index.remove(&(entry.expires_at, entry.sequence));
            entry.expires_at = expires_at;
            entry.sequence = sequence;
            index.insert((expires_at, sequence), *digest);
        }
    }

    /// Inserts a new in-flight record.
    fn insert_in_flight(
        &mut self,
        digest: [u8; 32],
        fingerprint: Fingerprint,
        owner: OwnerToken,
        expires_at: Instant,
    ) {
        self.sequence += 1;
        let entry = Entry {
            fingerprint,
            state: State::InFlight { owner },
            expires_at,
            sequence: self.sequence,
        };
        self.leases.insert((expires_at, self.sequence), digest);
        self.by_key.insert(digest, entry);
    }

    /// Turns the in-flight entry at `digest` into a completed one kept until `expires_at`.
    fn complete_in_flight(&mut self, digest: &[u8; 32], payload: Bytes, expires_at: Instant) {
        self.sequence += 1;
        let sequence = self.sequence;
        let Some(entry) = self.by_key.get_mut(digest) else {
            return;
        };
        let owner = match &entry.state {
            State::InFlight { owner } => owner.clone(),
            State::Completed { .. } => return,
        };
        self.leases.remove(&(entry.expires_at, entry.sequence));
        entry.state = State::Completed { owner, payload };
        entry.expires_at = expires_at;
        entry.sequence = sequence;
        self.retained.insert((expires_at, sequence), *digest);
    }

    /// Drops every record whose expiry has passed, in-flight and completed alike.
    fn drop_expired(&mut self, now: Instant) {
        for in_flight in [true, false] {
            loop {
                let index = if in_flight { &self.leases } else { &self.retained };
                match index.first_key_value() {
                    Some((&(expires_at, _), &digest)) if expires_at <= now => {
                        self.remove(&digest);
                    }
                    _ => break,
                }
            }
        }
    }

    /// Makes room for one more record, in O(log n): expired records go first, then the completed
    /// record nearest its expiry. Fails only when every record is in flight.
    fn make_room(&mut self, now: Instant) -> Result<(), StoreError> {
        self.drop_expired(now);
        if self.by_key.len() < self.max_entries {
            return Ok(());
        }
        let Some((_, &victim)) = self.retained.first_key_value() else {
            return Err(StoreError::Full);
        };
        self.remove(&victim);
        // Once full, a store evicts on every new key: one warning says so, not one per request
        // (which would cost more than the request).
        if !self.warned_of_eviction {
            self.warned_of_eviction = true;
            tracing::warn!(
                max_entries = self.max_entries,
                "memory store full: evicting completed records before their retention ends \
                 (logged once; raise with_max_entries)"
            );
        }
        Ok(())
    }
}

fn ready<'a, T: Send + 'a>(value: Result<T, StoreError>) -> StoreFuture<'a, T> {
    Box::pin(std::future::ready(value))
}

impl Store for MemoryStore {
    fn claim<'a>(
        &'a self,
        key: &'a RecordKey,
        fingerprint: &'a Fingerprint,
        owner: &'a OwnerToken,
        lease: Duration,
    ) -> StoreFuture<'a, ClaimOutcome> {
        let now = Instant::now();
        let mut records = self.lock();
        let digest = key.digest();
        let outcome = match records.live(digest, now) {
            Some(entry) => match &entry.state {
                State::InFlight { owner: holder } if holder == owner => {
                    records.set_expiry(digest, now + lease);
                    Ok(ClaimOutcome::Claimed)
                }
                _ if entry.fingerprint != *fingerprint => Ok(ClaimOutcome::Mismatch),
                State::InFlight { .. } => Ok(ClaimOutcome::InFlight {
                    lease_left: entry.expires_at - now,
                }),
                State::Completed { payload, .. } => Ok(ClaimOutcome::Completed(payload.clone())),
            },
            None => records.make_room(now).map(|()| {
                records.insert_in_flight(*digest, *fingerprint, owner.clone(), now + lease);
                ClaimOutcome::Claimed
            }),
        };
        ready(outcome)
    }

    fn peek<'a>(
        &'a self,
        key: &'a RecordKey,
        fingerprint: &'a Fingerprint,
    ) -> StoreFuture<'a, Option<ClaimOutcome>> {
        let now = Instant::now();
        let mut records = self.lock();
        let found = records.live(key.digest(), now).map(|entry| match &entry.state {
            _ if entry.fingerprint != *fingerprint => ClaimOutcome::Mismatch,
            State::InFlight { .. } => ClaimOutcome::InFlight {
                lease_left: entry.expires_at - now,
            },
            State::Completed { payload, .. } => ClaimOutcome::Completed(payload.clone()),
        });
        ready(Ok(found))
    }

    fn complete<'a>(
        &'a self,
        key: &'a RecordKey,
        owner: &'a OwnerToken,
        payload: Bytes,
        retention: Duration,
    ) -> StoreFuture<'a, bool> {
        let now = Instant::now();
        let mut records = self.lock();
        let digest = key.digest();
        let completed = match records.live(digest, now).map(|entry| &entry.state) {
            Some(State::InFlight { owner: holder }) if holder == owner => {
                records.complete_in_flight(digest, payload, now + retention);
                true
            }
            Some(State::Completed { owner: holder, .. }) => holder == owner,
            Some(State::InFlight { .. }) | None => false,
        };
        ready(Ok(completed))
    }

    fn release<'a>(&'a self, key: &'a RecordKey, owner: &'a OwnerToken) -> StoreFuture<'a, bool> {
        let mut records = self.lock();
        let owned = records.holds_in_flight(key.digest(), owner, Instant::now());
        if owned {
            records.remove(key.digest());
        }
        ready(Ok(owned))
    }

    fn renew<'a>(
        &'a self,
        key: &'a RecordKey,
        owner: &'a OwnerToken,
        lease: Duration,
    ) -> StoreFuture<'a, bool> {
        let now = Instant::now();
        let mut records = self.lock();
        let owned = records.holds_in_flight(key.digest(), owner, now);
        if owned {
            records.set_expiry(key.digest(), now + lease);
        }
        ready(Ok(owned))
    }

    fn inspect<'a>(&'a self, key: &'a RecordKey) -> StoreFuture<'a, Option<RecordInfo>> {
        let now = Instant::now();
        let mut records = self.lock();
        let info = records.live(key.digest(), now).map(|entry| {
            let expires_in = entry.expires_at - now;
            match &entry.state {
                State::InFlight { .. } => RecordInfo::new(RecordState::InFlight, expires_in, None),
                State::Completed { payload, .. } => {
                    RecordInfo::new(RecordState::Completed, expires_in, Some(payload.clone()))
                }
            }
        });
        ready(Ok(info))
    }

    fn purge<'a>(&'a self, key: &'a RecordKey) -> StoreFuture<'a, bool> {
        let now = Instant::now();
        let mut records = self.lock();
        let existed = records.live(key.digest(), now).is_some();
        records.remove(key.digest());
        ready(Ok(existed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::IdempotencyKey;

    fn key(k: &str) -> RecordKey {
        RecordKey::new(None, IdempotencyKey::parse(k).unwrap())
    }

    async fn claim(
        store: &MemoryStore,
        k: &str,
        lease: Duration,
    ) -> (OwnerToken, Result<ClaimOutcome, StoreError>) {
        let owner = OwnerToken::generate();
        let outcome = store
            .claim(&key(k), &Fingerprint::new([k.as_bytes()]), &owner, lease)
            .await;
        (owner, outcome)
    }

    async fn complete(store: &MemoryStore, k: &str, retention: Duration) {
        let (owner, outcome) = claim(store, k, Duration::from_secs(30)).await;
        assert_eq!(outcome.unwrap(), ClaimOutcome::Claimed);
        assert!(store
            .complete(&key(k), &owner, Bytes::from_static(b"r"), retention)
            .await
            .unwrap());
    }

    #[tokio::test]
    async fn at_the_bound_expired_records_go_first_then_the_completed_one_nearest_expiry() {
        let store = MemoryStore::new().with_max_entries(3);
        complete(&store, "expiring", Duration::from_millis(20)).await;
        complete(&store, "soon", Duration::from_secs(60)).await;
        complete(&store, "late", Duration::from_secs(3600)).await;
        tokio::time::sleep(Duration::from_millis(40)).await;
        complete(&store, "new-1", Duration::from_secs(3600)).await;
        assert!(store.inspect(&key("expiring")).await.unwrap().is_none());
        assert!(
            store.inspect(&key("soon")).await.unwrap().is_some(),
            "the expired record made room"
        );
        complete(&store, "new-2", Duration::from_secs(3600)).await;
        assert!(
            store.inspect(&key("soon")).await.unwrap().is_none(),
            "nearest expiry evicted next"
        );
        assert!(store.inspect(&key("late")).await.unwrap().is_some());
        assert_eq!(store.len(), 3);
    }

    #[test]
    fn an_early_eviction_is_logged_once_not_per_request() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use tracing_subscriber::layer::SubscriberExt;

        struct CountWarnings(Arc<AtomicUsize>);
        impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for CountWarnings {
            fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
                if *event.metadata().level() == tracing::Level::WARN {
                    self.0.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        let warnings = Arc::new(AtomicUsize::new(0));
        let subscriber = tracing_subscriber::registry().with(CountWarnings(warnings.clone()));
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        tracing::subscriber::with_default(subscriber, || {
            runtime.block_on(async {
                let store = MemoryStore::new().with_max_entries(2);
                for i in 0..20 {
                    complete(&store, &format!("k{i}"), Duration::from_secs(60)).await;
                }
                assert_eq!(store.len(), 2);
            })
        });
        assert_eq!(warnings.load(Ordering::Relaxed), 1, "18 evictions, one warning");
    }

    #[tokio::test]
    async fn a_completed_record_outlives_the_lease_it_was_claimed_with() {
        let store = MemoryStore::new().with_max_entries(3);
        let (owner, outcome) = claim(&store, "a", Duration::from_millis(30)).await;
        assert_eq!(outcome.unwrap(), ClaimOutcome::Claimed);
        assert!(store
            .complete(
                &key("a"),
                &owner,
                Bytes::from_static(b"r"),
                Duration::from_secs(3600)
            )
            .await
            .unwrap());
        tokio::time::sleep(Duration::from_millis(60)).await;
        // Claims clear expired records first: the old lease must not take the completed record.
        assert_eq!(
            claim(&store, "b", Duration::from_secs(30)).await.1.unwrap(),
            ClaimOutcome::Claimed
        );
        let info = store.inspect(&key("a")).await.unwrap().expect("still retained");
        assert_eq!(info.state, RecordState::Completed);
    }

    #[tokio::test]
    async fn eviction_takes_a_completed_record_even_behind_earlier_leases() {
        let store = MemoryStore::new().with_max_entries(3);
        let short = Duration::from_secs(30);
        assert_eq!(
            claim(&store, "running-1", short).await.1.unwrap(),
            ClaimOutcome::Claimed
        );
        complete(&store, "done", Duration::from_secs(3600)).await;
        assert_eq!(
            claim(&store, "running-2", short).await.1.unwrap(),
            ClaimOutcome::Claimed
        );
        assert_eq!(
            claim(&store, "new", short).await.1.unwrap(),
            ClaimOutcome::Claimed
        );
        assert!(store.inspect(&key("done")).await.unwrap().is_none());
        for running in ["running-1", "running-2", "new"] {
            assert!(
                store.inspect(&key(running)).await.unwrap().is_some(),
                "{running} kept"
            );
        }
    }

    #[tokio::test]
    async fn in_flight_records_are_never_evicted() {
        let store = MemoryStore::new().with_max_entries(2);
        let lease = Duration::from_secs(30);
        assert_eq!(claim(&store, "a", lease).await.1.unwrap(), ClaimOutcome::Claimed);
        assert_eq!(claim(&store, "b", lease).await.1.unwrap(), ClaimOutcome::Claimed);
        assert!(matches!(claim(&store, "c", lease).await.1, Err(StoreError::Full)));
        assert_eq!(store.len(), 2);
        assert!(store.inspect(&key("a")).await.unwrap().is_some());
    }
}
