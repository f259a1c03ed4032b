//! The one error every store answers with, and the reasons a store refuses a write on purpose.

use std::time::Duration;

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
    /// [`Store::in_flight`](crate::Store::in_flight), say). Never returned on a request's path.
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
                source.is::<FailingOver>() || source.is::<SentinelsUnheard>() || source.is::<Unacknowledged>()
            }
            _ => false,
        }
    }
}

#[cfg(feature = "redis")]
/// What a claim refused at a raised Sentinel fence fails with, inside [`StoreError::Unavailable`]
/// (so it is answered 503 like any unavailable store), told apart for the metrics.
///
/// [`StoreError::Unavailable`]: StoreError::Unavailable
#[derive(Debug, thiserror::Error)]
#[error("the sentinels are failing the master over; retry shortly")]
pub(crate) struct FailingOver;

#[cfg(feature = "redis")]
/// What a claim refused while no sentinel can be heard fails with, inside
/// [`StoreError::Unavailable`] (503, counted `fenced`): a failover could go unseen.
///
/// [`StoreError::Unavailable`]: StoreError::Unavailable
#[derive(Debug, thiserror::Error)]
#[error("no sentinel can be heard, so a failover could go unseen; retry shortly")]
pub(crate) struct SentinelsUnheard;

#[cfg(feature = "redis")]
/// What a claim fails with, inside [`StoreError::Unavailable`], when its `WAIT` failed (the
/// replicas' count could not be read): the claim may be on the master alone, so it was released
/// and is refused like one they did not acknowledge, never run unprotected
/// ([`StoreError::is_fence`]).
#[derive(Debug, thiserror::Error)]
#[error("the replicas' acknowledgement of the claim could not be read: {0}")]
pub(crate) struct Unacknowledged(#[source] pub(crate) StoreError);

#[cfg(test)]
mod tests {
    use super::*;

    /// The metrics count a claim refused at the Sentinel fence, or unacknowledged by replicas or
    /// by the master's disk, as `fenced`, and any other failure as a store error.
    #[test]
    fn fence_refusals_are_told_apart_from_failures() {
        let replicas = StoreError::NotReplicated {
            acknowledged: 0,
            wanted: 1,
        };
        assert!(replicas.is_fence());
        assert!(StoreError::NotFsynced.is_fence());
        #[cfg(feature = "redis")]
        assert!(StoreError::Unavailable(Box::new(FailingOver)).is_fence());
        #[cfg(feature = "redis")]
        {
            let wait_failed = StoreError::Timeout(std::time::Duration::from_secs(2));
            let unacknowledged = Unacknowledged(wait_failed);
            assert!(StoreError::Unavailable(Box::new(unacknowledged)).is_fence());
        }
        let reset = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset");
        assert!(!StoreError::Unavailable(Box::new(reset)).is_fence());
        assert!(!StoreError::Timeout(std::time::Duration::from_secs(2)).is_fence());
    }
}
