//! When a client is told to retry a key in flight: the handlers' typical duration, and the
//! `Retry-After` it gives.

use std::time::Duration;

/// Seconds for `Retry-After` on a key in flight: how long this layer's handlers typically take,
/// rounded up, at least 1 and never more than the lease left (rounded up); 1 before there is any
/// history. The lease left alone would tell clients to wait 20-30 s for a handler that takes
/// 300 ms; a fixed 1 s makes clients of a slow handler loop hot.
pub(crate) fn retry_after(typical: Option<Duration>, lease_left: Duration) -> Duration {
    let whole_seconds = |d: Duration| d.as_millis().div_ceil(1000).max(1);
    let seconds = whole_seconds(typical.unwrap_or(Duration::ZERO)).min(whole_seconds(lease_left));
    Duration::from_secs(u64::try_from(seconds).unwrap_or(u64::MAX))
}

/// How long the handlers behind one layer typically take, from claim to response: an
/// exponentially weighted moving average (weight 1/8) of recent runs, in microseconds.
#[derive(Debug, Default)]
pub(crate) struct TypicalDuration {
    micros: std::sync::atomic::AtomicU64,
}

impl TypicalDuration {
    pub(crate) fn record(&self, took: Duration) {
        use std::sync::atomic::Ordering;
        let sample = u64::try_from(took.as_micros()).unwrap_or(u64::MAX).max(1);
        // Two runs finishing at once may each move the average from the same old value; one
        // sample lost now and then does not matter to a hint.
        let old = self.micros.load(Ordering::Relaxed);
        let new = if old == 0 {
            sample
        } else {
            old - old / 8 + sample / 8
        };
        self.micros.store(new.max(1), Ordering::Relaxed);
    }

    /// `None` until a run has been recorded.
    pub(crate) fn get(&self) -> Option<Duration> {
        match self.micros.load(std::sync::atomic::Ordering::Relaxed) {
            0 => None,
            micros => Some(Duration::from_micros(micros)),
        }
    }
}

/// The fuzz target's check of `Retry-After` (`fuzz/fuzz_targets/prefer.rs`, and
/// `tests/fuzz_corpora.rs`): the first 16 bytes are the typical duration and the lease left,
/// in milliseconds. The answer is whole seconds, at least 1, never past the lease left rounded
/// up (unless that is under 1 s), at least the typical duration rounded up when the lease
/// allows it, and never shorter for a longer typical duration or lease.
#[cfg(any(test, feature = "fuzzing"))]
pub(crate) fn check(data: &[u8]) {
    let (Some(typical), Some(lease)) = (data.get(..8), data.get(8..16)) else {
        return;
    };
    let millis = |b: &[u8]| Duration::from_millis(u64::from_be_bytes(b.try_into().unwrap_or_default()));
    let (typical, lease) = (millis(typical), millis(lease));
    let up = |d: Duration| d.as_millis().div_ceil(1000);
    for typical in [None, Some(typical)] {
        let answer = retry_after(typical, lease);
        assert_eq!(answer.subsec_nanos(), 0);
        let seconds = u128::from(answer.as_secs());
        assert!(seconds >= 1);
        assert!(seconds <= up(lease).max(1));
        let typical_up = typical.map_or(1, up);
        assert!(seconds >= typical_up.min(up(lease)));
        let longer = Duration::from_millis(1);
        assert!(retry_after(typical.map(|t| t.saturating_add(longer)), lease) >= answer);
        assert!(retry_after(typical, lease.saturating_add(longer)) >= answer);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_without_history_is_one_second() {
        // With a typical duration: `retry_after_is_bounded_by_the_lease_and_follows_the_typical_duration`.
        assert_eq!(retry_after(None, Duration::from_secs(25)), Duration::from_secs(1));
    }

    #[test]
    fn the_typical_duration_moves_towards_recent_runs() {
        let typical = TypicalDuration::default();
        assert_eq!(typical.get(), None);
        typical.record(Duration::from_millis(800));
        assert_eq!(typical.get(), Some(Duration::from_millis(800)));
        for _ in 0..40 {
            typical.record(Duration::from_millis(200));
        }
        let now = typical.get().unwrap();
        assert!(
            now < Duration::from_millis(210) && now >= Duration::from_millis(200),
            "{now:?}"
        );
    }

    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// `Retry-After` is whole seconds, at least 1, never past the lease left (rounded up),
        /// at least the typical duration when the lease allows, and monotone in both (the fuzz
        /// check), over small, second-boundary and huge durations alike.
        #[test]
        fn retry_after_is_bounded_by_the_lease_and_follows_the_typical_duration(
            typical in prop_oneof![0u64..5_000, (0u64..100).prop_map(|s| s * 1000), any::<u64>()],
            lease in prop_oneof![0u64..5_000, (0u64..100).prop_map(|s| s * 1000), any::<u64>()],
        ) {
            let data = [typical.to_be_bytes(), lease.to_be_bytes()].concat();
            check(&data);
            let answer = retry_after(Some(Duration::from_millis(typical)), Duration::from_millis(lease));
            let up = |ms: u64| ms.div_ceil(1000).max(1);
            prop_assert_eq!(answer.as_secs(), up(typical).min(up(lease)));
        }
    }
}
