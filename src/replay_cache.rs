//! An in-process cache of completed records, so repeats are replayed with no store round trip.
//!
//! A completed record never changes: it is replayed as it is until its retention ends or an
//! operator purges it. So an instance may keep a copy and answer repeats from memory, provided
//! (1) no copy outlives its record's retention, (2) a purge on any instance reaches every copy,
//! and (3) a copy is never served while purges may be missed. The store that owns the cache keeps
//! (2) and (3) with an invalidation feed: it calls [`ReplayCache::invalidate`] for each purge it
//! hears of, and [`ReplayCache::set_live`] when the feed is lost or back.
//!
//! A feed can also die without a word (a connection frozen by the network), and nobody calls
//! `set_live(false)` until that is noticed. So the feed's owner also reports its pulse
//! ([`ReplayCache::heard`]): the time it sent a probe that the feed answered, before which every
//! purge has been delivered. With a [pulse bound](ReplayCache::with_pulse_bound) a copy is served
//! only while the latest pulse is that recent: a purge reaches every copy within the bound, whether
//! or not the feed's death has been noticed yet.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use tokio::time::Instant;

use crate::fingerprint::Fingerprint;
use crate::key::DigestHashing;
use crate::sync::lock;

/// What an entry costs beyond its payload: key, fingerprint, bookkeeping.
const ENTRY_OVERHEAD: usize = 128;

/// A copy of a completed record.
pub(crate) struct Cached {
    /// The record's fingerprint, with its policy tag.
    pub(crate) fingerprint: Fingerprint,
    pub(crate) payload: Bytes,
}

pub(crate) struct ReplayCache {
    max_bytes: usize,
    /// Taken with [`lock`]: every update leaves the map consistent.
    entries: Mutex<Entries>,
    /// Bumped by every invalidation and every change of the feed, so an answer fetched before one
    /// is not cached after it.
    epoch: AtomicU64,
    /// Whether the invalidation feed is listening: copies are served and added only then.
    live: AtomicBool,
    /// Copies are served only while the latest pulse is at most this many milliseconds old
    /// (0: no bound).
    pulse_bound_ms: AtomicU64,
    /// When the cache was made: the origin of `pulse`.
    created: Instant,
    /// The latest pulse, in milliseconds after `created`.
    pulse: AtomicU64,
}

#[derive(Default)]
struct Entries {
    by_digest: HashMap<[u8; 32], Entry, DigestHashing>,
    /// Insertion order, for eviction; a digest whose entry was replaced or removed since is
    /// skipped (its sequence no longer matches).
    order: VecDeque<([u8; 32], u64)>,
    bytes: usize,
    sequence: u64,
}

struct Entry {
    fingerprint: Fingerprint,
    payload: Bytes,
    /// The end of the copy's life by the monotonic clock, which no clock step moves.
    expires_at: Instant,
    /// The same end by the wall clock, which moves on through a VM pause or a suspend that may
    /// stop the monotonic one: the copy dies by whichever ends first.
    expires_at_wall: SystemTime,
    sequence: u64,
}

impl Entry {
    fn cost(&self) -> usize {
        self.payload.len() + ENTRY_OVERHEAD
    }
}

impl ReplayCache {
    /// A cache of at most `max_bytes`, not live until the feed says so.
    pub(crate) fn new(max_bytes: usize) -> Self {
        Self {
            max_bytes,
            entries: Mutex::new(Entries::default()),
            epoch: AtomicU64::new(0),
            live: AtomicBool::new(false),
            pulse_bound_ms: AtomicU64::new(0),
            created: Instant::now(),
            pulse: AtomicU64::new(0),
        }
    }

    /// Serves copies only while the feed's latest [pulse](ReplayCache::heard) is at most `bound`
    /// old (default, and `None`: no bound). Counted from the cache's making until the first pulse.
    pub(crate) fn set_pulse_bound(&self, bound: Option<Duration>) {
        let millis = bound.map_or(0, |bound| {
            u64::try_from(bound.as_millis()).unwrap_or(u64::MAX).max(1)
        });
        self.pulse_bound_ms.store(millis, Ordering::Release);
    }

    /// The feed answered a probe sent at `sent`: every purge published before then was delivered.
    pub(crate) fn heard(&self, sent: Instant) {
        let millis =
            u64::try_from(sent.saturating_duration_since(self.created).as_millis()).unwrap_or(u64::MAX);
        self.pulse.fetch_max(millis, Ordering::AcqRel);
    }

    /// Whether the feed's latest pulse is recent enough, `now`, to serve copies.
    fn pulse_is_recent(&self, now: Instant) -> bool {
        let bound = self.pulse_bound_ms.load(Ordering::Acquire);
        if bound == 0 {
            return true;
        }
        let pulse = self.created + Duration::from_millis(self.pulse.load(Ordering::Acquire));
        now.saturating_duration_since(pulse) <= Duration::from_millis(bound)
    }

    /// The copy of the record at `digest`, if there is a live one.
    pub(crate) fn get(&self, digest: &[u8; 32]) -> Option<Cached> {
        if !self.live.load(Ordering::Acquire) {
            return None;
        }
        let now = Instant::now();
        if !self.pulse_is_recent(now) {
            return None;
        }
        let mut entries = lock(&self.entries);
        let entry = entries.by_digest.get(digest)?;
        if entry.expires_at <= now || entry.expires_at_wall <= SystemTime::now() {
            entries.remove(digest);
            return None;
        }
        Some(Cached {
            fingerprint: entry.fingerprint,
            payload: entry.payload.clone(),
        })
    }

    /// The epoch to pass to [`insert`](ReplayCache::insert) for an answer about to be fetched.
    pub(crate) fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }

    /// Keeps a copy of a completed record for `retention_left` at most, unless an invalidation
    /// (or a change of the feed) happened since `epoch` was read: the answer may predate a purge.
    pub(crate) fn insert(
        &self,
        epoch: u64,
        digest: [u8; 32],
        fingerprint: Fingerprint,
        payload: Bytes,
        retention_left: Duration,
    ) {
        let expires_at = Instant::now() + retention_left;
        let cost = payload.len() + ENTRY_OVERHEAD;
        if retention_left.is_zero() || cost > self.max_bytes || !self.live.load(Ordering::Acquire) {
            return;
        }
        let mut entries = lock(&self.entries);
        // Read under the lock: `invalidate` bumps the epoch under it too.
        if self.epoch.load(Ordering::Acquire) != epoch {
            return;
        }
        entries.remove(&digest);
        while entries.bytes + cost > self.max_bytes {
            let Some((oldest, sequence)) = entries.order.pop_front() else {
                break;
            };
            if entries
                .by_digest
                .get(&oldest)
                .is_some_and(|e| e.sequence == sequence)
            {
                entries.remove(&oldest);
            }
        }
        entries.sequence += 1;
        let sequence = entries.sequence;
        entries.order.push_back((digest, sequence));
        entries.bytes += cost;
        entries.by_digest.insert(
            digest,
            Entry {
                fingerprint,
                payload,
                expires_at,
                expires_at_wall: SystemTime::now() + retention_left,
                sequence,
            },
        );
    }

    /// Ends the copy at `digest` no later than `left` after `measured` (the record's life left in
    /// the store, as read at `measured`), or at once when `left` is `None` (the record is gone,
    /// or its life could not be read).
    pub(crate) fn shorten(&self, digest: &[u8; 32], left: Option<Duration>, measured: Instant) {
        let mut entries = lock(&self.entries);
        let Some(left) = left else {
            entries.remove(digest);
            return;
        };
        if let Some(entry) = entries.by_digest.get_mut(digest) {
            let end = measured + left;
            if end < entry.expires_at {
                let wall_left = end.saturating_duration_since(Instant::now());
                entry.expires_at = end;
                entry.expires_at_wall = entry.expires_at_wall.min(SystemTime::now() + wall_left);
            }
        }
    }

    /// Drops the copy at `digest`: its record was purged.
    pub(crate) fn invalidate(&self, digest: &[u8; 32]) {
        let mut entries = lock(&self.entries);
        self.epoch.fetch_add(1, Ordering::AcqRel);
        entries.remove(digest);
    }

    /// Drops every copy and serves again only once `live`: the feed was lost (purges may have been
    /// missed) or is back.
    pub(crate) fn set_live(&self, live: bool) {
        let mut entries = lock(&self.entries);
        self.epoch.fetch_add(1, Ordering::AcqRel);
        *entries = Entries::default();
        self.live.store(live, Ordering::Release);
    }

    /// Bytes held, by the cache's own accounting.
    #[cfg(test)]
    fn bytes(&self) -> usize {
        lock(&self.entries).bytes
    }
}

impl Entries {
    fn remove(&mut self, digest: &[u8; 32]) {
        if let Some(entry) = self.by_digest.remove(digest) {
            self.bytes -= entry.cost();
        }
        // Its place in `order` is skipped when reached. Compact when stale places dominate.
        if self.order.len() > 2 * self.by_digest.len() + 64 {
            let by_digest = &self.by_digest;
            self.order
                .retain(|(digest, sequence)| by_digest.get(digest).is_some_and(|e| e.sequence == *sequence));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn digest(n: u8) -> [u8; 32] {
        [n; 32]
    }

    /// Keeps a copy of record `n` with `payload`, as if fetched just now.
    fn keep(cache: &ReplayCache, n: u8, payload: Bytes, retention_left: Duration) {
        cache.insert(
            cache.epoch(),
            digest(n),
            Fingerprint::from_digest([n; 32]),
            payload,
            retention_left,
        );
    }

    fn live(max_bytes: usize) -> ReplayCache {
        let cache = ReplayCache::new(max_bytes);
        cache.set_live(true);
        cache
    }

    #[test]
    fn bounded_in_bytes_oldest_out_first() {
        let cache = live(3 * (100 + ENTRY_OVERHEAD));
        for n in 0..5 {
            keep(&cache, n, Bytes::from(vec![n; 100]), Duration::from_secs(60));
            assert!(cache.bytes() <= 3 * (100 + ENTRY_OVERHEAD));
        }
        assert!(cache.get(&digest(0)).is_none());
        assert!(cache.get(&digest(1)).is_none());
        for n in 2..5 {
            assert_eq!(cache.get(&digest(n)).unwrap().payload, vec![n; 100]);
        }
        // Larger than the whole cache: not kept.
        keep(&cache, 9, Bytes::from(vec![9; 1000]), Duration::from_secs(60));
        assert!(cache.get(&digest(9)).is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn copies_are_served_only_while_the_feed_has_a_recent_pulse() {
        let cache = ReplayCache::new(1 << 20);
        cache.set_pulse_bound(Some(Duration::from_secs(2)));
        cache.set_live(true);
        keep(&cache, 1, Bytes::from_static(b"r"), Duration::from_secs(60));
        assert!(
            cache.get(&digest(1)).is_some(),
            "within the bound of the cache's making"
        );
        tokio::time::advance(Duration::from_millis(1500)).await;
        cache.heard(Instant::now());
        tokio::time::advance(Duration::from_millis(1900)).await;
        assert!(cache.get(&digest(1)).is_some(), "1.9 s after the latest pulse");
        tokio::time::advance(Duration::from_millis(200)).await;
        assert!(
            cache.get(&digest(1)).is_none(),
            "2.1 s after it: purges may be unheard"
        );
        cache.heard(Instant::now() - Duration::from_secs(10)); // an older pulse changes nothing
        assert!(cache.get(&digest(1)).is_none());
        cache.heard(Instant::now());
        assert!(cache.get(&digest(1)).is_some(), "heard again");
    }

    #[tokio::test(start_paused = true)]
    async fn a_copy_is_shortened_to_its_records_life_and_dropped_when_that_is_unknown() {
        let cache = live(1 << 20);
        keep(&cache, 1, Bytes::from_static(b"r"), Duration::from_secs(60));
        let measured = Instant::now();
        tokio::time::advance(Duration::from_millis(10)).await;
        cache.shorten(&digest(1), Some(Duration::from_millis(100)), measured);
        cache.shorten(&digest(1), Some(Duration::from_secs(600)), measured); // never lengthened
        tokio::time::advance(Duration::from_millis(80)).await;
        assert!(cache.get(&digest(1)).is_some());
        tokio::time::advance(Duration::from_millis(20)).await;
        assert!(
            cache.get(&digest(1)).is_none(),
            "100 ms after the measure, not 60 s"
        );
        keep(&cache, 2, Bytes::from_static(b"r"), Duration::from_secs(60));
        cache.shorten(&digest(2), None, Instant::now());
        assert!(cache.get(&digest(2)).is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn never_past_the_retention_left() {
        let cache = live(1 << 20);
        keep(&cache, 1, Bytes::from_static(b"r"), Duration::from_millis(50));
        assert!(cache.get(&digest(1)).is_some());
        tokio::time::advance(Duration::from_millis(51)).await;
        assert!(cache.get(&digest(1)).is_none());
        assert_eq!(cache.bytes(), 0);
    }

    #[test]
    fn an_answer_fetched_before_an_invalidation_is_not_kept() {
        let cache = live(1 << 20);
        let before = cache.epoch();
        cache.invalidate(&digest(1));
        cache.insert(
            before,
            digest(1),
            Fingerprint::from_digest([1; 32]),
            Bytes::from_static(b"stale"),
            Duration::from_secs(60),
        );
        assert!(cache.get(&digest(1)).is_none());
        keep(&cache, 1, Bytes::from_static(b"r"), Duration::from_secs(60));
        cache.invalidate(&digest(1));
        assert!(cache.get(&digest(1)).is_none());
    }

    #[test]
    fn nothing_is_served_or_kept_while_the_feed_is_down() {
        let cache = live(1 << 20);
        keep(&cache, 1, Bytes::from_static(b"r"), Duration::from_secs(60));
        cache.set_live(false);
        assert!(cache.get(&digest(1)).is_none());
        keep(&cache, 2, Bytes::from_static(b"r"), Duration::from_secs(60));
        cache.set_live(true);
        assert!(
            cache.get(&digest(1)).is_none(),
            "copies from before the gap are dropped"
        );
        assert!(cache.get(&digest(2)).is_none());
    }
}
