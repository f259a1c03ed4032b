//! What a coordinator's calls fail with.

use crate::store::StoreError;
use crate::telemetry::RequestOutcome;

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
    /// [`ShutdownHandle::shutdown`](crate::ShutdownHandle::shutdown) was called: no new keys are taken.
    #[error("shutting down: no new idempotency keys are taken")]
    ShuttingDown,
    /// The bound on operations running at once is reached.
    #[error("too many idempotent operations are running")]
    AtCapacity,
    /// The claim was lost before completion (its lease ran out, or it was purged), so the result
    /// was not stored: another caller may own the key now.
    #[error("the claim was lost before the result could be stored")]
    ClaimLost,
    /// The operation's result could not be encoded for the store (a
    /// [`Coordinator::once_json`](crate::Coordinator::once_json) result that serde_json
    /// refuses, such as a map with keys that are not strings), so it was not stored.
    #[error("the result could not be encoded for the store: {0}")]
    Encode(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The operation of a [`Coordinator::once`](crate::Coordinator::once) call ran past its
    /// timeout ([`OnceCall::timeout`](crate::OnceCall::timeout)) and was cancelled: whether its
    /// effect happened is unknown. Nothing was stored; the key is left to its lease.
    #[error("the operation did not finish within {0:?} and was cancelled")]
    OperationTimedOut(std::time::Duration),
}

impl Error {
    /// How a request the coordinator could not begin for this error is counted.
    pub(crate) fn outcome(&self) -> RequestOutcome {
        match self {
            Error::Store(StoreError::Corrupt(_)) => RequestOutcome::Unreadable,
            Error::Store(error) if error.is_fence() => RequestOutcome::Fenced,
            Error::Store(_) | Error::ClaimLost | Error::Encode(_) => RequestOutcome::StoreError,
            Error::OperationTimedOut(_) => RequestOutcome::NotStored,
            Error::ShuttingDown | Error::AtCapacity => RequestOutcome::Overloaded,
        }
    }
}
