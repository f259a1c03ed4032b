//! What a claim hands a store that completes it inside the caller's own transaction.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::record::OwnerToken;
use crate::key::RecordKey;

/// A claim's address and owner, for completing it in a transaction of the caller's: the
/// operation's own writes and its stored result then commit, or roll back, together, so a crash
/// between the two can no longer run the key twice. Made by [`Claim::ticket`](crate::Claim::ticket); over HTTP, the
/// layer hands it to the handler (`IdempotencyLayer::with_transactional_completion`).
///
/// A store that keeps its records in the caller's database completes a ticket in the caller's
/// transaction (`PostgresStore::complete_in`); the claim's own completion afterwards finds the
/// record completed by its owner and succeeds without overwriting it. A ticket carries no
/// connection and no lease renewal: the [`Claim`](crate::Claim) it came from keeps the lease until then.
///
/// ```
/// use tower_idempotency::{Begin, Coordinator, Fingerprint, IdempotencyKey, MemoryStore, RecordKey};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), tower_idempotency::Error> {
/// let coordinator = Coordinator::new(MemoryStore::new());
/// let key = RecordKey::new(None, IdempotencyKey::parse("transfer-3").unwrap());
/// if let Begin::Claimed(claim) = coordinator.begin(&key, &Fingerprint::new([b"transfer".as_slice()])).await? {
///     let ticket = claim.ticket();
///     assert_eq!(ticket.owner(), claim.owner());
///     // ... a PostgresStore would complete `ticket` in the transaction here ...
///     claim.complete("done".into()).await?;
/// }
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct ClaimTicket {
    pub(crate) key: RecordKey,
    pub(crate) owner: OwnerToken,
    pub(crate) retention: Duration,
    /// Shared with the claim it was made from.
    pub(crate) flags: Arc<ClaimFlags>,
}

impl std::fmt::Debug for ClaimTicket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClaimTicket")
            .field("key", &self.key)
            .field("owner", &self.owner)
            .field("retention", &self.retention)
            .finish_non_exhaustive()
    }
}

impl ClaimTicket {
    /// The claimed key.
    pub fn key(&self) -> &RecordKey {
        &self.key
    }

    /// The claim's owner token, which the completion must present.
    pub fn owner(&self) -> &OwnerToken {
        &self.owner
    }

    /// How long the result is to be kept (the coordinator's, or the layer's, retention).
    pub fn retention(&self) -> Duration {
        self.retention
    }

    /// Tells the claim that a store completed it in the caller's transaction, so its lease
    /// renewal, finding the record no longer in flight, does not report the claim lost.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) fn note_completed_elsewhere(&self) {
        self.flags.completed_elsewhere.store(true, Ordering::Release);
    }
}

/// What a claim's renewal and a transaction completing it tell each other.
#[derive(Default)]
pub(crate) struct ClaimFlags {
    /// A renewal found the claim gone (lease ran out, or purged).
    pub(crate) lost: AtomicBool,
    /// A store completed the claim in a transaction of the caller's (through a [`ClaimTicket`]),
    /// so a renewal that then finds it no longer in flight does not take it for lost.
    pub(crate) completed_elsewhere: AtomicBool,
    /// The claim's completion is under way, with a renewal beside it: a renewal that finds the
    /// claim no longer in flight leaves the verdict to the completion (which may have landed).
    pub(crate) completing: AtomicBool,
    /// When the last lease write that landed (the claim, or a renewal) was sent, in milliseconds
    /// after the claim began: a completion carried on in the background tries until that lease
    /// ends.
    pub(crate) leased_at_ms: AtomicU64,
}
