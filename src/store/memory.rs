//! The embedded store: one process, no dependencies, the same semantics as Redis.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;

use crate::fingerprint::Fingerprint;
use crate::key::{DigestHashing, RecordKey};
use crate::store::contract::{KeyWatch, Store, StoreFuture};
use crate::store::error::StoreError;
use crate::store::record::{ClaimOutcome, InFlightRecord, Oldest, OwnerToken, RecordInfo, RecordState};
use crate::sync::lock;

/// 64 MiB: about 115 000 records of a small JSON answer (a stored response of ~200 bytes plus
/// [`RECORD_OVERHEAD`]), a day's retention at 1.3 new keys a second, in a share of memory any
/// service can spare; raised with `with_max_bytes` by those who need more.
const DEFAULT_MAX_BYTES: usize = 64 * 1024 * 1024;

/// What one record costs besides its payload: the key digest and the fingerprint (32 bytes
/// each), the owner token (a heap string of ~50 bytes), the expiry and sequence, its slot in the
/// hash table (spare capacity included) and its entry in an expiry index. Measured with a
/// counting allocator (`tests/memory_footprint.rs` checks it): 310 to 350 bytes per record while
/// a store fills, 360 to 390 once a full store evicts, as removals leave the hash table emptier.
/// The allocator's own headers come on top.
const RECORD_OVERHEAD: usize = 384;

/// An in-process [`Store`]: records expire like Redis keys, and the memory they take is bounded.
///
/// It protects one process only: instances behind a load balancer need a shared store such as
/// `RedisStore`.
///
/// Records are bounded in bytes (default 64 MiB, [`with_max_bytes`](MemoryStore::with_max_bytes)):
/// each costs its stored response plus about 384 bytes of bookkeeping, so the default holds about
/// 115 000 small JSON answers; [`with_max_entries`](MemoryStore::with_max_entries) adds a bound
/// on their number, and a record is evicted when either bound would be exceeded. When a new
/// record would not fit, expired records are dropped first, then the completed records nearest
/// their expiry, each in O(log n), without looking at the requests in flight. A retry of an
/// evicted key runs its handler again, so an early eviction is logged once, naming how long
/// records are really kept, and counted by [`evicted_early`](MemoryStore::evicted_early).
/// In-flight records are never evicted: when only they are left, a new claim fails with
/// [`StoreError::Full`], which the layer answers with 503. A response larger than the whole
/// bound is not stored ([`StoreError::TooLarge`]): its client gets it, and a retry of its key is
/// answered 409 until the lease ends, then runs again.
///
/// Clones share the same records.
///
/// ```
/// use tower_idempotency::MemoryStore;
///
/// let store = MemoryStore::new().with_max_bytes(256 * 1024 * 1024);
/// # let _ = store;
/// ```
#[derive(Clone, Debug)]
pub struct MemoryStore {
    /// Taken with [`lock`]: a panic while holding it cannot leave a record half-written (every
    /// update is a single insert or remove).
    shared: Arc<Mutex<Records>>,
}

#[derive(Debug, Default)]
struct Records {
    max_bytes: usize,
    max_entries: usize,
    /// What the records held cost: [`RECORD_OVERHEAD`] each, plus the payloads of completed ones.
    bytes: usize,
    /// Boxed: a hash table keeps spare slots (up to three per record once removals have left
    /// deleted ones behind), and a slot holding a pointer is a quarter the size of one holding
    /// the entry.
    by_key: HashMap<[u8; 32], Box<Entry>, DigestHashing>,
    /// In-flight records in lease order: (expires_at, sequence) → key. Kept apart from the
    /// completed ones so eviction never has to step over a running request's record.
    leases: BTreeMap<(Instant, u64), [u8; 32]>,
    /// Completed records in expiry order, the eviction order once the store is full.
    retained: BTreeMap<(Instant, u64), [u8; 32]>,
    sequence: u64,
    evicted_early: u64,
    warned_of_eviction: bool,
    /// The keys someone waits on ([`Store::watch`]), each with the channel its waiters are woken
    /// through; empty (and never allocated) unless a request waits.
    watched: HashMap<[u8; 32], tokio::sync::watch::Sender<u64>, DigestHashing>,
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
    InFlight {
        owner: OwnerToken,
    },
    Completed {
        owner: OwnerToken,
        payload: Bytes,
        /// Kept so an early eviction can say how much of it the record got.
        retention: Duration,
    },
}

impl Entry {
    fn cost(&self) -> usize {
        match &self.state {
            State::InFlight { .. } => RECORD_OVERHEAD,
            State::Completed { payload, .. } => RECORD_OVERHEAD + payload.len(),
        }
    }

    /// What another request's claim of this live record finds, presenting `fingerprint`.
    fn found(&self, fingerprint: &Fingerprint, now: Instant) -> ClaimOutcome {
        match &self.state {
            _ if self.fingerprint != *fingerprint => {
                ClaimOutcome::mismatch(fingerprint, self.fingerprint.policy())
            }
            State::InFlight { .. } => ClaimOutcome::InFlight {
                lease_left: self.expires_at - now,
            },
            State::Completed { payload, .. } => ClaimOutcome::Completed(payload.clone()),
        }
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryStore {
    /// An empty store holding at most 64 MiB of records.
    ///
    /// ```
    /// use tower_idempotency::MemoryStore;
    /// assert!(MemoryStore::new().is_empty());
    /// ```
    pub fn new() -> Self {
        Self {
            shared: Arc::new(Mutex::new(Records {
                max_bytes: DEFAULT_MAX_BYTES,
                max_entries: usize::MAX,
                ..Records::default()
            })),
        }
    }

    /// Bounds the memory records take (default: 64 MiB; never less than one record's
    /// bookkeeping). A record costs its stored response (status, headers kept, body) plus about
    /// 384 bytes, so size it as new keys per second × retention × (a typical response + 384 B):
    /// 10 new keys a second of 500-byte answers kept 24 h need about 730 MiB.
    ///
    /// ```
    /// use tower_idempotency::MemoryStore;
    /// let store = MemoryStore::new().with_max_bytes(16 * 1024 * 1024);
    /// # let _ = store;
    /// ```
    pub fn with_max_bytes(self, max_bytes: usize) -> Self {
        lock(&self.shared).max_bytes = max_bytes.max(RECORD_OVERHEAD);
        self
    }

    /// Also bounds the number of records (default: none besides the byte bound, under which at
    /// most 64 MiB / 384 B ≈ 175 000 fit; at least 1). Records are evicted when either bound
    /// would be exceeded.
    ///
    /// ```
    /// use tower_idempotency::MemoryStore;
    /// let store = MemoryStore::new().with_max_entries(100);
    /// # let _ = store;
    /// ```
    pub fn with_max_entries(self, max_entries: usize) -> Self {
        lock(&self.shared).max_entries = max_entries.max(1);
        self
    }

    /// The number of records held, expired ones not yet dropped included.
    ///
    /// ```
    /// use tower_idempotency::MemoryStore;
    /// assert_eq!(MemoryStore::new().len(), 0);
    /// ```
    pub fn len(&self) -> usize {
        lock(&self.shared).by_key.len()
    }

    /// Whether the store holds no records.
    ///
    /// ```
    /// use tower_idempotency::MemoryStore;
    /// assert!(MemoryStore::new().is_empty());
    /// ```
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// How many completed records were evicted before their retention ended, to make room. Each
    /// such key runs its handler again if it is retried; a count that grows means the bound is
    /// too small for the traffic and the retention (the first eviction also logs a warning).
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::{Fingerprint, IdempotencyKey, MemoryStore, OwnerToken, RecordKey, Store};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), tower_idempotency::StoreError> {
    /// let store = MemoryStore::new().with_max_entries(1);
    /// let fingerprint = Fingerprint::new([b"body".as_slice()]);
    /// for key in ["a", "b"] {
    ///     let key = RecordKey::new(None, IdempotencyKey::parse(key).unwrap());
    ///     let owner = OwnerToken::generate();
    ///     store.claim(&key, &fingerprint, &owner, Duration::from_secs(30)).await?;
    ///     store.complete(&key, &owner, "done".into(), Duration::from_secs(3600)).await?;
    /// }
    /// assert_eq!(store.evicted_early(), 1, "a's record made room for b's");
    /// # Ok(()) }
    /// ```
    pub fn evicted_early(&self) -> u64 {
        lock(&self.shared).evicted_early
    }
}

impl Records {
    /// Wakes whoever waits on `digest`: its record was completed, released or purged.
    fn settled(&self, digest: &[u8; 32]) {
        // Checked first: a store nobody waits on pays one length check per transition.
        if self.watched.is_empty() {
            return;
        }
        if let Some(waiters) = self.watched.get(digest) {
            waiters.send_modify(|changes| *changes = changes.wrapping_add(1));
        }
    }

    /// The live entry at `digest`, dropping it first if it has expired. A key with no record (the
    /// claim of every new key) costs one lookup. Not the map's `entry`, which would make it one
    /// lookup for a record too: on a miss it reserves room for an insert, so a read (a release, a
    /// peek) could grow the table, and a claim would grow it before its eviction frees a slot.
    fn live(&mut self, digest: &[u8; 32], now: Instant) -> Option<&mut Entry> {
        if self.by_key.get(digest)?.expires_at <= now {
            self.remove(digest);
            return None;
        }
        self.by_key.get_mut(digest).map(|entry| &mut **entry)
    }

    /// Whether `owner` holds a live in-flight claim at `digest`.
    fn holds_in_flight(&mut self, digest: &[u8; 32], owner: &OwnerToken, now: Instant) -> bool {
        matches!(
            self.live(digest, now),
            Some(Entry { state: State::InFlight { owner: holder }, .. }) if holder == owner
        )
    }

    fn remove(&mut self, digest: &[u8; 32]) -> Option<Entry> {
        let entry = *self.by_key.remove(digest)?;
        let index = match entry.state {
            State::InFlight { .. } => &mut self.leases,
            State::Completed { .. } => &mut self.retained,
        };
        index.remove(&(entry.expires_at, entry.sequence));
        self.bytes -= entry.cost();
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
        self.bytes += entry.cost();
        self.by_key.insert(digest, Box::new(entry));
    }

    /// Turns the in-flight entry at `digest` into a completed one kept for `retention` from `now`.
    fn complete_in_flight(&mut self, digest: &[u8; 32], payload: Bytes, now: Instant, retention: Duration) {
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
        self.bytes += payload.len();
        entry.state = State::Completed {
            owner,
            payload,
            retention,
        };
        entry.expires_at = now + retention;
        entry.sequence = sequence;
        self.retained.insert((entry.expires_at, sequence), *digest);
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

    /// Makes room for `entries` more records taking `bytes` more: expired records go first, then
    /// the completed records nearest their expiry, each in O(log n). Fails, evicting nothing,
    /// when the records in flight leave too little room even with every completed one gone.
    fn make_room(&mut self, now: Instant, entries: usize, bytes: usize) -> Result<(), StoreError> {
        self.drop_expired(now);
        // In-flight records cost exactly the overhead each, so what eviction cannot free is known
        // without looking at them.
        let in_flight = self.leases.len();
        if in_flight + entries > self.max_entries || in_flight * RECORD_OVERHEAD + bytes > self.max_bytes {
            return Err(StoreError::Full);
        }
        loop {
            // The bound an eviction makes room under, as the setting that raises it and its value.
            let bound = if self.by_key.len() + entries > self.max_entries {
                ("with_max_entries", self.max_entries)
            } else if self.bytes + bytes > self.max_bytes {
                ("with_max_bytes", self.max_bytes)
            } else {
                return Ok(());
            };
            // Popped first, so the loop moves on even if the index and the map ever disagreed.
            let Some((_, victim)) = self.retained.pop_first() else {
                return Err(StoreError::Full);
            };
            if let Some(evicted) = self.remove(&victim) {
                self.note_early_eviction(&evicted, now, bound);
            }
        }
    }

    /// Counts an eviction before the record's retention ended. Once the store is full it evicts
    /// on every new key: one warning says so, not one per request (which would cost more than
    /// the request and bury the message).
    fn note_early_eviction(&mut self, evicted: &Entry, now: Instant, (setting, limit): (&str, usize)) {
        let State::Completed { retention, .. } = evicted.state else {
            return;
        };
        self.evicted_early += 1;
        let kept = retention.saturating_sub(evicted.expires_at.saturating_duration_since(now));
        if self.warned_of_eviction {
            tracing::debug!(
                kept_secs = kept.as_secs(),
                "memory store full: evicted a completed record early"
            );
            return;
        }
        self.warned_of_eviction = true;
        tracing::warn!(
            kept_secs = kept.as_secs(),
            retention_secs = retention.as_secs(),
            limit,
            "memory store full: completed records are kept about {} instead of their {} retention, \
             so a retry after that runs its handler again; raise MemoryStore::{setting} (now {limit}). \
             Logged once; MemoryStore::evicted_early counts the evictions",
            approximately(kept),
            approximately(retention),
        );
    }
}

/// `d` in its largest whole unit, for people: "17 min", not "1020.250137s".
fn approximately(d: Duration) -> String {
    match d.as_secs() {
        secs if secs >= 2 * 3600 => format!("{} h", secs / 3600),
        secs if secs >= 2 * 60 => format!("{} min", secs / 60),
        secs if secs >= 2 => format!("{secs} s"),
        _ => format!("{} ms", d.as_millis()),
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
        let mut records = lock(&self.shared);
        let digest = key.digest();
        let outcome = match records.live(digest, now) {
            Some(Entry {
                state: State::InFlight { owner: holder },
                ..
            }) if holder == owner => {
                records.set_expiry(digest, now + lease);
                Ok(ClaimOutcome::Claimed)
            }
            Some(entry) => Ok(entry.found(fingerprint, now)),
            None => records.make_room(now, 1, RECORD_OVERHEAD).map(|()| {
                records.insert_in_flight(*digest, *fingerprint, owner.clone(), now + lease);
                ClaimOutcome::Claimed
            }),
        };
        ready(outcome)
    }

    /// The records are in this process, so a completed one is answered here, before the
    /// coordinator takes an in-flight permit, makes an owner token or times a store call: a
    /// replay or a mismatch costs one look under the lock. Anything else (no record, one in
    /// flight, one expired) goes on to [`claim`](Store::claim).
    fn cached(&self, key: &RecordKey, fingerprint: &Fingerprint) -> Option<ClaimOutcome> {
        let records = lock(&self.shared);
        // A new key (the usual miss) costs one lookup and no clock read; an expired record is
        // left for the claim, which drops it.
        let entry = records.by_key.get(key.digest())?;
        let now = Instant::now();
        let completed = entry.expires_at > now && matches!(entry.state, State::Completed { .. });
        completed.then(|| entry.found(fingerprint, now))
    }

    fn peek<'a>(
        &'a self,
        key: &'a RecordKey,
        fingerprint: &'a Fingerprint,
    ) -> StoreFuture<'a, Option<ClaimOutcome>> {
        let now = Instant::now();
        let mut records = lock(&self.shared);
        let found = records
            .live(key.digest(), now)
            .map(|entry| entry.found(fingerprint, now));
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
        let mut records = lock(&self.shared);
        let digest = key.digest();
        let completed = match records.live(digest, now).map(|entry| &entry.state) {
            Some(State::InFlight { owner: holder }) if holder == owner => {
                let limit = records.max_bytes - RECORD_OVERHEAD;
                if payload.len() > limit {
                    Err(StoreError::TooLarge {
                        size: payload.len(),
                        limit,
                    })
                } else {
                    records.make_room(now, 0, payload.len()).map(|()| {
                        records.complete_in_flight(digest, payload, now, retention);
                        records.settled(digest);
                        true
                    })
                }
            }
            Some(State::Completed { owner: holder, .. }) => Ok(holder == owner),
            Some(State::InFlight { .. }) | None => Ok(false),
        };
        ready(completed)
    }

    fn release<'a>(&'a self, key: &'a RecordKey, owner: &'a OwnerToken) -> StoreFuture<'a, bool> {
        let mut records = lock(&self.shared);
        let owned = records.holds_in_flight(key.digest(), owner, Instant::now());
        if owned {
            records.remove(key.digest());
            records.settled(key.digest());
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
        let mut records = lock(&self.shared);
        let owned = records.holds_in_flight(key.digest(), owner, now);
        if owned {
            records.set_expiry(key.digest(), now + lease);
        }
        ready(Ok(owned))
    }

    fn inspect<'a>(&'a self, key: &'a RecordKey) -> StoreFuture<'a, Option<RecordInfo>> {
        let now = Instant::now();
        let mut records = lock(&self.shared);
        let info = records.live(key.digest(), now).map(|entry| {
            let expires_in = entry.expires_at - now;
            match &entry.state {
                State::InFlight { owner } => {
                    RecordInfo::new(RecordState::InFlight, expires_in, None).with_owner(owner.clone())
                }
                State::Completed { payload, .. } => {
                    RecordInfo::new(RecordState::Completed, expires_in, Some(payload.clone()))
                }
            }
        });
        ready(Ok(info))
    }

    fn purge<'a>(&'a self, key: &'a RecordKey) -> StoreFuture<'a, bool> {
        let now = Instant::now();
        let mut records = lock(&self.shared);
        let existed = records.live(key.digest(), now).is_some();
        records.remove(key.digest());
        if existed {
            records.settled(key.digest());
        }
        ready(Ok(existed))
    }

    /// Walks the lease index, which holds the records in flight and nothing else, under the
    /// lock: O(records in flight), which the claims waiting for the lock meanwhile pay for.
    fn in_flight<'a>(&'a self, older_than: Duration, limit: usize) -> StoreFuture<'a, Vec<InFlightRecord>> {
        let now = Instant::now();
        let records = lock(&self.shared);
        let mut oldest = Oldest::new(older_than, limit);
        let live = records
            .leases
            .range((now, u64::MAX)..)
            .filter(|((at, _), _)| *at > now);
        for (_, digest) in live {
            if let Some(Entry {
                state: State::InFlight { owner },
                expires_at,
                ..
            }) = records.by_key.get(digest).map(|entry| &**entry)
            {
                oldest.offer(*digest, owner.clone(), *expires_at - now);
            }
        }
        ready(Ok(oldest.into_vec()))
    }

    /// In-process: one channel per watched key, shared by its waiters, dropped with the last.
    fn watch<'a>(&'a self, key: &'a RecordKey) -> StoreFuture<'a, Option<KeyWatch>> {
        let mut records = lock(&self.shared);
        let waiters = records
            .watched
            .entry(*key.digest())
            .or_insert_with(|| tokio::sync::watch::channel(0).0);
        let changes = waiters.subscribe();
        let guard = Unwatch {
            shared: self.shared.clone(),
            digest: *key.digest(),
        };
        ready(Ok(Some(KeyWatch::new(changes, guard))))
    }
}

/// Forgets a watched key's channel once its last waiter is gone.
struct Unwatch {
    shared: Arc<Mutex<Records>>,
    digest: [u8; 32],
}

impl Drop for Unwatch {
    fn drop(&mut self) {
        let mut records = lock(&self.shared);
        // The watch's receiver is dropped before its guard, and receivers are only made under
        // this lock: no receiver left means no waiter left.
        let unwatched = records
            .watched
            .get(&self.digest)
            .is_some_and(|waiters| waiters.receiver_count() == 0);
        if unwatched {
            records.watched.remove(&self.digest);
        }
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
        complete_sized(store, k, 1, retention).await;
    }

    /// Claims and completes `k` with a payload of `size` bytes.
    async fn complete_sized(store: &MemoryStore, k: &str, size: usize, retention: Duration) {
        let (owner, outcome) = claim(store, k, Duration::from_secs(30)).await;
        assert_eq!(outcome.unwrap(), ClaimOutcome::Claimed);
        assert!(store
            .complete(&key(k), &owner, Bytes::from(vec![b'r'; size]), retention)
            .await
            .unwrap());
        assert_accounted(store);
    }

    async fn held(store: &MemoryStore, k: &str) -> Option<RecordState> {
        store.inspect(&key(k)).await.unwrap().map(|info| info.state)
    }

    /// The running byte count and the indexes agree with the records themselves.
    fn assert_accounted(store: &MemoryStore) {
        let records = lock(&store.shared);
        let recounted: usize = records.by_key.values().map(|entry| entry.cost()).sum();
        assert_eq!(records.bytes, recounted, "bytes accounted");
        let in_flight = records
            .by_key
            .values()
            .filter(|entry| matches!(entry.state, State::InFlight { .. }))
            .count();
        assert_eq!(records.leases.len(), in_flight, "lease index");
        assert_eq!(
            records.retained.len(),
            records.by_key.len() - in_flight,
            "retained index"
        );
    }

    /// Runs `test` on a runtime of its own and returns the messages of the warnings it logged.
    fn warnings_logged_by(test: impl std::future::Future<Output = ()>) -> Vec<String> {
        use tracing_subscriber::layer::SubscriberExt;

        struct CaptureWarnings(Arc<Mutex<Vec<String>>>);
        impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for CaptureWarnings {
            fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
                struct Message(String);
                impl tracing::field::Visit for Message {
                    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                        if field.name() == "message" {
                            self.0 = format!("{value:?}");
                        }
                    }
                }
                if *event.metadata().level() == tracing::Level::WARN {
                    let mut message = Message(String::new());
                    event.record(&mut message);
                    self.0.lock().unwrap().push(message.0);
                }
            }
        }
        let warnings = Arc::new(Mutex::new(Vec::new()));
        let subscriber = tracing_subscriber::registry().with(CaptureWarnings(warnings.clone()));
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        tracing::subscriber::with_default(subscriber, || runtime.block_on(test));
        let logged = warnings.lock().unwrap().clone();
        logged
    }

    /// The bound that holds `records` completed records of `payload` bytes each, exactly.
    fn bytes_for(records: usize, payload: usize) -> usize {
        records * (RECORD_OVERHEAD + payload)
    }

    #[tokio::test]
    async fn over_the_byte_bound_the_completed_records_nearest_expiry_go_first() {
        let store = MemoryStore::new().with_max_bytes(bytes_for(3, 100));
        complete_sized(&store, "soon", 100, Duration::from_secs(60)).await;
        complete_sized(&store, "late", 100, Duration::from_secs(3600)).await;
        complete_sized(&store, "middle", 100, Duration::from_secs(1800)).await;
        complete_sized(&store, "new", 100, Duration::from_secs(3600)).await;
        assert_eq!(held(&store, "soon").await, None, "nearest expiry evicted");
        for kept in ["late", "middle", "new"] {
            assert_eq!(held(&store, kept).await, Some(RecordState::Completed), "{kept}");
        }
        // A larger result evicts as many records as it needs room for, nearest expiry first.
        complete_sized(&store, "large", 300, Duration::from_secs(3600)).await;
        assert_eq!(held(&store, "middle").await, None);
        assert_eq!(held(&store, "late").await, None);
        assert_eq!(held(&store, "new").await, Some(RecordState::Completed));
        assert_eq!(held(&store, "large").await, Some(RecordState::Completed));
        assert_eq!(store.evicted_early(), 3);
        assert!(lock(&store.shared).bytes <= bytes_for(3, 100));
    }

    #[tokio::test]
    async fn in_flight_records_are_never_evicted_for_a_completion() {
        let store = MemoryStore::new().with_max_bytes(bytes_for(2, 0) + 50);
        let lease = Duration::from_secs(30);
        let (owner, outcome) = claim(&store, "running", lease).await;
        assert_eq!(outcome.unwrap(), ClaimOutcome::Claimed);
        let (other, outcome) = claim(&store, "other", lease).await;
        assert_eq!(outcome.unwrap(), ClaimOutcome::Claimed);
        let result = Bytes::from(vec![b'r'; 60]);
        assert!(matches!(
            store
                .complete(&key("running"), &owner, result.clone(), lease)
                .await,
            Err(StoreError::Full)
        ));
        assert_eq!(held(&store, "other").await, Some(RecordState::InFlight));
        assert_eq!(
            held(&store, "running").await,
            Some(RecordState::InFlight),
            "left to its lease"
        );
        assert_accounted(&store);
        // Full is not final: once the other request is done, the same completion fits.
        assert!(store.release(&key("other"), &other).await.unwrap());
        assert!(store
            .complete(&key("running"), &owner, result, lease)
            .await
            .unwrap());
        assert_eq!(store.evicted_early(), 0);
        assert_accounted(&store);
    }

    #[tokio::test]
    async fn a_result_larger_than_the_whole_bound_is_refused_without_evicting_anything() {
        let store = MemoryStore::new().with_max_bytes(bytes_for(4, 100));
        complete_sized(&store, "done", 100, Duration::from_secs(60)).await;
        let (owner, outcome) = claim(&store, "huge", Duration::from_secs(30)).await;
        assert_eq!(outcome.unwrap(), ClaimOutcome::Claimed);
        let huge = Bytes::from(vec![b'r'; bytes_for(4, 100)]);
        match store
            .complete(&key("huge"), &owner, huge, Duration::from_secs(60))
            .await
        {
            Err(StoreError::TooLarge { size, limit }) => {
                assert_eq!(
                    (size, limit),
                    (bytes_for(4, 100), bytes_for(4, 100) - RECORD_OVERHEAD)
                );
            }
            other => panic!("expected TooLarge, got {other:?}"),
        }
        assert_eq!(held(&store, "done").await, Some(RecordState::Completed));
        assert_eq!(
            held(&store, "huge").await,
            Some(RecordState::InFlight),
            "left to its lease"
        );
        assert_eq!(store.evicted_early(), 0);
        assert_accounted(&store);
    }

    // The layer answers the client whatever the completion did; the coordinator must not make it
    // wait for retries that cannot succeed.
    #[tokio::test(start_paused = true)]
    async fn the_coordinator_does_not_retry_a_result_too_large_to_store() {
        let store = MemoryStore::new().with_max_bytes(bytes_for(1, 100));
        let coordinator = crate::Coordinator::new(store.clone());
        let (record_key, fingerprint) = (key("huge"), Fingerprint::new([b"huge".as_slice()]));
        let crate::Begin::Claimed(claim) = coordinator.begin(&record_key, &fingerprint).await.unwrap() else {
            panic!("expected a claim");
        };
        let started = Instant::now();
        let outcome = claim.complete(Bytes::from(vec![b'r'; 1000])).await;
        assert!(
            matches!(outcome, Err(crate::Error::Store(StoreError::TooLarge { .. }))),
            "{outcome:?}"
        );
        // Time is paused: only the coordinator's pauses between attempts can move it.
        assert!(
            started.elapsed() < Duration::from_millis(50),
            "retried: {:?}",
            started.elapsed()
        );
        assert_eq!(
            held(&store, "huge").await,
            Some(RecordState::InFlight),
            "left to its lease"
        );
    }

    #[tokio::test]
    async fn the_byte_count_stays_exact_through_every_transition() {
        let store = MemoryStore::new().with_max_bytes(bytes_for(3, 10));
        let (lease, short) = (Duration::from_secs(30), Duration::from_millis(20));
        let (owner, _) = claim(&store, "a", lease).await;
        assert_accounted(&store);
        let again = store
            .claim(&key("a"), &Fingerprint::new([b"a".as_slice()]), &owner, lease)
            .await;
        assert_eq!(again.unwrap(), ClaimOutcome::Claimed, "a claim sent twice");
        assert!(store.renew(&key("a"), &owner, lease).await.unwrap());
        assert_accounted(&store);
        let payload = Bytes::from_static(b"0123456789");
        for _ in 0..2 {
            assert!(store
                .complete(&key("a"), &owner, payload.clone(), lease)
                .await
                .unwrap());
            assert_accounted(&store);
        }
        let (released, _) = claim(&store, "b", lease).await;
        assert!(store.release(&key("b"), &released).await.unwrap());
        assert_accounted(&store);
        assert!(store.purge(&key("a")).await.unwrap());
        assert_accounted(&store);
        assert_eq!(
            claim(&store, "lease-ends", short).await.1.unwrap(),
            ClaimOutcome::Claimed
        );
        complete_sized(&store, "retention-ends", 10, short).await;
        tokio::time::sleep(short * 2).await;
        assert_eq!(held(&store, "lease-ends").await, None, "dropped when read");
        assert_accounted(&store);
        for k in ["c", "d", "e", "f"] {
            complete_sized(&store, k, 10, lease).await;
        }
        assert_eq!(
            lock(&store.shared).bytes,
            bytes_for(3, 10),
            "expired dropped, then one evicted"
        );
        assert_eq!(store.evicted_early(), 1);
        assert_eq!(store.len(), 3);
    }

    #[test]
    fn an_early_eviction_is_warned_of_once_and_counted_every_time() {
        let store = MemoryStore::new().with_max_bytes(bytes_for(2, 1));
        let warnings = warnings_logged_by(async {
            for i in 0..20 {
                complete(&store, &format!("k{i}"), Duration::from_secs(3600)).await;
            }
        });
        assert_eq!(store.len(), 2);
        assert_eq!(store.evicted_early(), 18);
        assert_eq!(warnings.len(), 1, "18 evictions, one warning: {warnings:?}");
        let warning = &warnings[0];
        for names in ["instead of their 60 min retention", "MemoryStore::with_max_bytes"] {
            assert!(warning.contains(names), "{warning}");
        }
        // Another store warns on its own account, naming its bound: tests/setup_warnings.rs.
    }

    #[test]
    fn durations_are_told_in_their_largest_whole_unit() {
        let told = |secs| approximately(Duration::from_secs(secs));
        assert_eq!(told(86_400), "24 h");
        assert_eq!(told(1_020), "17 min");
        assert_eq!(told(59), "59 s");
        assert_eq!(approximately(Duration::from_millis(1_500)), "1500 ms");
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

    #[tokio::test]
    async fn completed_records_are_answered_without_a_claim_and_nothing_else_is() {
        let store = MemoryStore::new();
        let same = Fingerprint::new([b"a".as_slice()]);
        let other = Fingerprint::new([b"other".as_slice()]);
        assert_eq!(store.cached(&key("a"), &same), None, "no record");
        let (owner, outcome) = claim(&store, "a", Duration::from_secs(30)).await;
        assert_eq!(outcome.unwrap(), ClaimOutcome::Claimed);
        assert_eq!(
            store.cached(&key("a"), &same),
            None,
            "in flight: the claim answers"
        );
        assert_eq!(
            store.cached(&key("a"), &other),
            None,
            "in flight: the claim answers"
        );
        let retention = Duration::from_millis(50);
        let payload = Bytes::from_static(b"stored");
        assert!(store
            .complete(&key("a"), &owner, payload.clone(), retention)
            .await
            .unwrap());
        assert_eq!(
            store.cached(&key("a"), &same),
            Some(ClaimOutcome::Completed(payload))
        );
        assert_eq!(store.cached(&key("a"), &other), Some(ClaimOutcome::Mismatch));
        tokio::time::sleep(retention * 2).await;
        assert_eq!(store.cached(&key("a"), &same), None, "expired");
        let (_, outcome) = claim(&store, "a", Duration::from_secs(30)).await;
        assert_eq!(
            outcome.unwrap(),
            ClaimOutcome::Claimed,
            "the claim takes the expired key"
        );
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

    /// Only an insert may grow the record table: looking up a key with no record (a release or a
    /// peek of it, the claim of a new key before its eviction frees a slot) must not, or the
    /// table could double beyond what the byte bound's per-record overhead was measured with.
    #[tokio::test]
    async fn looking_up_a_key_without_a_record_never_grows_the_table() {
        let store = MemoryStore::new();
        complete(&store, "first", Duration::from_secs(3600)).await;
        let capacity = lock(&store.shared).by_key.capacity();
        assert!(capacity > 1);
        let mut filled = 0;
        while lock(&store.shared).by_key.len() < capacity {
            complete(&store, &format!("k{filled}"), Duration::from_secs(3600)).await;
            filled += 1;
        }
        assert_eq!(
            lock(&store.shared).by_key.capacity(),
            capacity,
            "filled to the brim, not past it"
        );
        let absent = key("absent");
        assert!(!store.release(&absent, &OwnerToken::generate()).await.unwrap());
        assert_eq!(
            store
                .peek(&absent, &Fingerprint::new([b"x".as_slice()]))
                .await
                .unwrap(),
            None
        );
        assert!(store.inspect(&absent).await.unwrap().is_none());
        assert!(lock(&store.shared)
            .live(absent.digest(), Instant::now())
            .is_none());
        assert_eq!(lock(&store.shared).by_key.capacity(), capacity);
    }

    #[tokio::test]
    async fn eviction_takes_a_completed_record_even_behind_earlier_leases_and_never_one_in_flight() {
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
        // In-flight records are never evicted: with only them left, a new claim is refused.
        assert!(matches!(
            claim(&store, "more", short).await.1,
            Err(StoreError::Full)
        ));
        assert_eq!(store.len(), 3);
        for running in ["running-1", "running-2", "new"] {
            assert!(
                store.inspect(&key(running)).await.unwrap().is_some(),
                "{running} kept"
            );
        }
    }
}
