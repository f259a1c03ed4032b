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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_follows_the_typical_duration_within_one_second_and_the_lease() {
        let s = Duration::from_secs;
        let ms = Duration::from_millis;
        assert_eq!(retry_after(None, s(25)), s(1), "no history yet");
        assert_eq!(retry_after(Some(ms(300)), s(25)), s(1), "at least 1 s");
        assert_eq!(retry_after(Some(ms(2_200)), s(25)), s(3), "rounded up");
        assert_eq!(
            retry_after(Some(s(40)), ms(4_100)),
            s(5),
            "never past the lease left"
        );
        assert_eq!(retry_after(Some(s(40)), ms(10)), s(1));
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
}
