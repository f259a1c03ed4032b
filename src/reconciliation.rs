//! The reconciliation hook: the application hears of every operation that ran but whose result
//! the store does not hold (or may not keep), so it can journal it and reconcile later.
//!
//! It lives on the [`Coordinator`](crate::Coordinator) (`with_reconciliation`; the layer's
//! setter forwards to it), which raises every event it sees itself. One event happens in a store's
//! background task, out of the coordinator's sight: `RedisStore` with `ReplicaAcks` keeps
//! completing a record after the request was answered. To reach it without a parameter on every
//! [`Store`](crate::Store) method, the coordinator runs each completion inside a Tokio task-local
//! holding the hook (and the coordinator's metrics name, so the event is counted under it), and a
//! store that carries a completion on in a task of its own takes them from there when it spawns
//! the task (as it takes the tracing span). Without a hook or a name, a completion runs as
//! before: no task-local, no clone.

use std::future::Future;
use std::sync::Arc;

use bytes::Bytes;

use crate::key::RecordKey;
use crate::store::OwnerToken;
use crate::telemetry::{EventKind, Named};

/// Why a request ran but its response was not stored: its key is then kept completed, as
/// *not replayable*, so a retry is told so instead of running the operation a second time.
///
/// ```
/// use tower_idempotency::NotStored;
/// assert_eq!(NotStored::TooLarge.to_string(), "the response was larger than the storage cap");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NotStored {
    /// The response body was larger than the layer's response limit.
    #[error("the response was larger than the storage cap")]
    TooLarge,
    /// The response body failed part way (an upstream connection broke, say).
    #[error("the response body failed part way")]
    BodyFailed,
    /// The handler gave no response head within the handler timeout and was cancelled, or its
    /// response body of unknown length did not end within the stream timeout (the record then
    /// holds the status the client was sent).
    #[error("the handler did not answer in time")]
    TimedOut,
}

/// An operation ran, but its result is not (or may not stay) in the store: what a
/// [reconciliation hook](crate::Coordinator::with_reconciliation) is told.
///
/// ```
/// use tower_idempotency::{Coordinator, MemoryStore, ReconciliationKind};
///
/// let coordinator = Coordinator::new(MemoryStore::new()).with_reconciliation(|event| {
///     if let ReconciliationKind::ClaimLost = event.kind {
///         eprintln!("{:?} ran, but lost its claim: its result was not stored", event.key);
///     }
/// });
/// # let _ = coordinator;
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ReconciliationEvent {
    /// The key (scope and key, raw: this goes to the application's own callback).
    pub key: RecordKey,
    /// The owner token of the claim under which the operation ran.
    pub owner: OwnerToken,
    /// What happened.
    pub kind: ReconciliationKind,
    /// The result that was to be stored, if there was one: the bytes given to
    /// [`Claim::complete`](crate::Claim::complete); behind the HTTP layer, the response encoded
    /// in the layer's record layout (status, headers, body).
    pub payload: Option<Bytes>,
}

/// What happened to an operation's result; see [`ReconciliationEvent`].
///
/// ```
/// use tower_idempotency::{NotStored, ReconciliationKind};
///
/// let kind = ReconciliationKind::NotStorable { why: NotStored::TooLarge };
/// assert!(matches!(kind, ReconciliationKind::NotStorable { .. }));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ReconciliationKind {
    /// The store did not take the result: the first attempt and every retry in the background
    /// after it failed or timed out until the claim's lease ended, or the store refused it as
    /// too large. Raised when the retries end, not at the first failure. The claim ends with its
    /// lease; a retry after that runs the operation again.
    CompletionFailed {
        /// The last store error.
        error: String,
    },
    /// The response could not be stored: too large, its body failed part way, or the handler
    /// timed out. The key is kept as not replayable (a retry is told so), or released when the
    /// layer is configured to (a retry then runs the handler again). No payload.
    NotStorable {
        /// Why it was not stored.
        why: NotStored,
    },
    /// The claim was lost before the result could be stored: its lease ran out, another caller
    /// took the key over, or it was purged. Nothing was written; another caller may be running
    /// the operation again.
    ClaimLost,
    /// `RedisStore` with `ReplicaAcks`: the result was stored on the master and the client got
    /// its answer, but the replicas did not acknowledge it within `retry_completions_for`, or
    /// before the claim's lease ended (after which a promoted replica holds no claim to
    /// complete). If the master fails over before they have it, a retry runs the operation again.
    ReplicationAbandoned {
        /// The last error, or the replicas' shortfall.
        error: String,
    },
    /// `RedisStore` with `ReplicaAcks`: while the completion was being retried for the replicas,
    /// the claim was found gone (a failover dropped it, or its lease ran out). The client got its
    /// answer; a retry runs the operation again.
    LostBeforeReplicated,
}

impl ReconciliationKind {
    /// The `kind` label this event is counted under.
    pub(crate) fn event_kind(&self) -> EventKind {
        match self {
            ReconciliationKind::CompletionFailed { .. } => EventKind::CompletionFailed,
            ReconciliationKind::NotStorable { .. } => EventKind::NotStorable,
            ReconciliationKind::ClaimLost => EventKind::ClaimLost,
            ReconciliationKind::ReplicationAbandoned { .. } => EventKind::ReplicationAbandoned,
            ReconciliationKind::LostBeforeReplicated => EventKind::LostBeforeReplicated,
        }
    }
}

/// The application's hook.
type Hook = Arc<dyn Fn(&ReconciliationEvent) + Send + Sync>;

/// A hook and a name, as the coordinator holds them: what an event raised out of its sight (in
/// a store's background task) needs to be reported and counted as its own.
#[derive(Clone, Default)]
pub(crate) struct Reconciler {
    hook: Option<Hook>,
    /// The coordinator's metrics name, for the event's count.
    named: Option<Arc<Named>>,
}

impl Reconciler {
    /// With `hook`, keeping the name.
    pub(crate) fn with_hook<F>(mut self, hook: F) -> Self
    where
        F: Fn(&ReconciliationEvent) + Send + Sync + 'static,
    {
        self.hook = Some(Arc::new(hook));
        self
    }

    /// With `named`, keeping the hook.
    pub(crate) fn with_name(mut self, named: Arc<Named>) -> Self {
        self.named = Some(named);
        self
    }

    pub(crate) fn has_hook(&self) -> bool {
        self.hook.is_some()
    }
}

/// Counts `kind` and, if there is a hook, tells it. Key, owner and payload are cloned only for a
/// hook.
pub(crate) fn report(
    reconciler: Option<&Reconciler>,
    kind: ReconciliationKind,
    key: &RecordKey,
    owner: &OwnerToken,
    payload: Option<&Bytes>,
) {
    let named = reconciler.and_then(|r| r.named.as_deref());
    crate::telemetry::reconciliation(kind.event_kind(), named);
    if let Some(hook) = reconciler.and_then(|r| r.hook.as_deref()) {
        let event = ReconciliationEvent {
            key: key.clone(),
            owner: owner.clone(),
            kind,
            payload: payload.cloned(),
        };
        // A panic in the hook is logged and goes no further: it must not unwind through a claim
        // half settled, nor kill a store's background task.
        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| hook(&event))).is_err() {
            tracing::error!(kind = ?event.kind, "the reconciliation hook panicked");
        }
    }
}

tokio::task_local! {
    /// The hook of the coordinator whose completion is being polled.
    static IN_FORCE: Reconciler;
}

/// Runs `call` (a store's completion) with `hook` in force, for a store that carries the
/// completion on in a task of its own; without a hook, just runs it.
pub(crate) async fn carrying<F: Future>(hook: Option<&Reconciler>, call: F) -> F::Output {
    match hook {
        Some(hook) => IN_FORCE.scope(hook.clone(), call).await,
        None => call.await,
    }
}

/// The hook in force for the completion being polled, if any: for a store's background task.
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
pub(crate) fn in_force() -> Option<Reconciler> {
    IN_FORCE.try_with(Reconciler::clone).ok()
}
