//! A claimed key while its operation runs: completing it, releasing it, and renewing its lease
//! meanwhile.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use bytes::Bytes;
use tokio::task::JoinHandle;
use tracing::Instrument;

use super::error::Error;
use super::running::Slot;
use super::settings::Settings;
use crate::key::RecordKey;
use crate::reconciliation::{self, NotStored, ReconciliationKind};
use crate::store::{ClaimFlags, ClaimTicket, OwnerToken, StoreError};
use crate::telemetry::{Named, StoreOp};

/// The pause before a completion carried on in the background tries again: doubling from the
/// first, up to the last (a store back from an outage is found within a second).
const RETRY_FIRST: Duration = Duration::from_millis(50);
const RETRY_MAX: Duration = Duration::from_secs(1);

/// Ownership of one key while its operation runs. Complete it with the result, or release it.
///
/// Dropping a `Claim` (a panic, a cancelled task) releases it in the background.
///
/// ```
/// use tower_idempotency::{Begin, Coordinator, Fingerprint, IdempotencyKey, MemoryStore, RecordKey};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), tower_idempotency::Error> {
/// let coordinator = Coordinator::new(MemoryStore::new());
/// let key = RecordKey::new(None, IdempotencyKey::parse("job-9").unwrap());
/// let fingerprint = Fingerprint::new([b"job".as_slice()]);
/// if let Begin::Claimed(claim) = coordinator.begin(&key, &fingerprint).await? {
///     // The operation failed in a way worth retrying: give the key up.
///     claim.release().await?;
/// }
/// assert!(matches!(coordinator.begin(&key, &fingerprint).await?, Begin::Claimed(_)));
/// # Ok(()) }
/// ```
pub struct Claim {
    settings: Arc<Settings>,
    key: RecordKey,
    owner: OwnerToken,
    /// Shared with the renewal task and any [`ClaimTicket`]: one allocation per claim.
    flags: Arc<ClaimFlags>,
    /// The background renewal task, or `None` when the holder renews through `keep_alive`.
    renewal: Option<JoinHandle<()>>,
    /// When the claim was taken (its answer came), the origin of `flags.leased_at_ms`.
    started: tokio::time::Instant,
    settled: bool,
    /// Counted under the in-flight bound, so a shutdown waits for the claim: also while its
    /// completion is carried on in the background.
    _slot: Slot,
}

/// Who renews a claim's lease while its operation runs.
#[derive(Clone, Copy)]
pub(super) enum Renewal {
    /// A task of the claim's own, for callers that simply hold the claim.
    Background,
    /// The holder, by running its work through [`Claim::keep_alive`].
    Driven,
}

impl std::fmt::Debug for Claim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Claim")
            .field("key", &self.key)
            .field("owner", &self.owner)
            .finish_non_exhaustive()
    }
}

impl Claim {
    pub(super) fn start(
        settings: Arc<Settings>,
        key: RecordKey,
        owner: OwnerToken,
        slot: Slot,
        renewal: Renewal,
    ) -> Self {
        let mut claim = Self {
            settings,
            key,
            owner,
            flags: Arc::default(),
            renewal: None,
            started: tokio::time::Instant::now(),
            settled: false,
            _slot: slot,
        };
        if let Renewal::Background = renewal {
            claim.renew_in_background();
        }
        claim
    }

    /// Hands the renewal of a claim to a task of its own, for callers that simply hold it.
    /// Does nothing if a task renews it already.
    fn renew_in_background(&mut self) {
        if self.renewal.is_some() {
            return;
        }
        let (settings, key, owner, flags, started) = (
            self.settings.clone(),
            self.key.clone(),
            self.owner.clone(),
            self.flags.clone(),
            self.started,
        );
        let renewing = async move { renew_until_lost(&settings, &key, &owner, &flags, started).await };
        self.renewal = Some(tokio::spawn(renewing.instrument(tracing::Span::current())));
    }

    /// The key this claim holds.
    pub fn key(&self) -> &RecordKey {
        &self.key
    }

    /// This claim's owner token.
    pub fn owner(&self) -> &OwnerToken {
        &self.owner
    }

    /// A ticket for completing this claim in a transaction of the caller's, with the business
    /// writes of the operation (see [`ClaimTicket`]). [`complete`](Claim::complete) afterwards
    /// succeeds without overwriting what that transaction stored.
    ///
    /// ```
    /// use tower_idempotency::{Begin, Coordinator, Fingerprint, IdempotencyKey, MemoryStore, RecordKey};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), tower_idempotency::Error> {
    /// let coordinator = Coordinator::new(MemoryStore::new());
    /// let key = RecordKey::new(None, IdempotencyKey::parse("job-10").unwrap());
    /// if let Begin::Claimed(claim) = coordinator.begin(&key, &Fingerprint::new([b"job".as_slice()])).await? {
    ///     let ticket = claim.ticket();
    ///     assert_eq!(ticket.key(), claim.key());
    ///     assert_eq!(ticket.retention(), coordinator.retention());
    ///     claim.release().await?;
    /// }
    /// # Ok(()) }
    /// ```
    pub fn ticket(&self) -> ClaimTicket {
        ClaimTicket {
            key: self.key.clone(),
            owner: self.owner.clone(),
            retention: self.settings.retention,
            flags: self.flags.clone(),
        }
    }

    /// The coordinator's metrics name and keys, if it has a name.
    pub(crate) fn named(&self) -> Option<Arc<Named>> {
        self.settings.named.clone()
    }

    /// Whether a renewal found the claim gone (lease ran out, or purged): completing it will fail.
    pub fn is_lost(&self) -> bool {
        self.flags.lost.load(Ordering::Acquire)
    }

    /// Runs `work` while renewing the lease of a claim from
    /// [`begin_driven`](Coordinator::begin_driven). The renewal timer starts only if `work` is
    /// not done at its first poll, so a quick operation costs no timer at all.
    ///
    /// `work` is pinned by the caller, so it is stored once, in the caller's future: taken by
    /// value and pinned here, it would take its room twice in this future's state (the argument
    /// and the pinned local), and so would every future wrapping it.
    pub(crate) async fn keep_alive<F: Future>(&self, mut work: Pin<&mut F>) -> F::Output {
        if self.renewal.is_some() {
            return work.await;
        }
        let mut renew = std::pin::pin!(renew_until_lost(
            &self.settings,
            &self.key,
            &self.owner,
            &self.flags,
            self.started,
        ));
        let mut renewing = true;
        std::future::poll_fn(|cx| {
            if let Poll::Ready(output) = work.as_mut().poll(cx) {
                return Poll::Ready(output);
            }
            // Renewal ends only when the claim is lost; the work then runs on, to be fenced.
            if renewing && renew.as_mut().poll(cx).is_ready() {
                renewing = false;
            }
            Poll::Pending
        })
        .await
    }

    /// Stores `payload` as the key's result, for the retention period.
    ///
    /// One attempt, bounded by the store timeout, is made here. If the claim was lost, nothing
    /// is written ([`Error::ClaimLost`]) and a warning is logged: a newer owner's record is
    /// never overwritten. If the attempt fails with a store error (but
    /// [`StoreError::TooLarge`], which another attempt would meet again), this answers that
    /// error at once, and the completion goes on in a task of its own: tried again and again
    /// (pauses from 50 ms doubling to 1 s), the lease renewed meanwhile wherever the store
    /// answers, until the record lands, the claim is found lost, or the lease ends: the lease
    /// last renewed, and at most one lease after the first attempt failed. A store back within
    /// the lease so still gets the result, and a retry then replays it (until then a retry finds
    /// the key in flight). A result the store never takes leaves the key to its lease. That
    /// task keeps the claim's place under the in-flight bound, so a
    /// [shutdown](crate::ShutdownHandle::shutdown) waits for it too. If this future is dropped
    /// before the outcome is known, the claim is released in the background (a completion that
    /// landed is not undone: release only removes in-flight records).
    ///
    /// While the store holds its writes back on purpose (`RedisStore` during a Sentinel
    /// failover, see [`Store::writes_held`](crate::Store::writes_held)), the completion waits, outside the store timeout
    /// and for at most a lease, and goes to the store the moment it takes writes again; a wait
    /// there is not a failed attempt.
    ///
    /// A result finally not stored (the claim lost, the store refused it, or the lease ended
    /// before the store took it) is reported to the
    /// [reconciliation hook](crate::Coordinator::with_reconciliation), with the payload, once:
    /// a result the background task stores after all is not reported.
    pub async fn complete(mut self, payload: Bytes) -> Result<(), Error> {
        // Lost already: settled as a completion that found the claim gone.
        let outcome = if self.is_lost() {
            Ok(false)
        } else {
            if self.renewal.is_some() {
                self.flags.completing.store(true, Ordering::Release);
            }
            self.complete_once(&payload).await
        };
        if let Err(error) = &outcome {
            if worth_completing_again(error) {
                tracing::warn!(
                    key = ?self.key, %error,
                    "could not store the result at once; answering, and completing it in the \
                     background until the lease ends"
                );
                let first = error.to_string();
                self.complete_in_background(payload, first);
                return outcome.map(|_| ()).map_err(Error::Store);
            }
        }
        self.stop_renewal();
        // Every other outcome settles the claim: stored, fenced, or refused for good.
        self.settled = true;
        self.settle(outcome, &payload)
    }

    /// What a completion's final `outcome` means for the caller, logged and, if the result is
    /// not stored, reported.
    fn settle(&self, outcome: Result<bool, StoreError>, payload: &Bytes) -> Result<(), Error> {
        match outcome {
            Ok(true) => Ok(()),
            Ok(false) => {
                tracing::warn!(key = ?self.key, "claim lost before completion; the result is not stored");
                self.reconcile(ReconciliationKind::ClaimLost, Some(payload));
                Err(Error::ClaimLost)
            }
            Err(error) => {
                tracing::error!(
                    key = ?self.key, %error,
                    "could not store the result; a retry after the lease ends will run the operation again"
                );
                let failed = ReconciliationKind::CompletionFailed {
                    error: error.to_string(),
                };
                self.reconcile(failed, Some(payload));
                Err(Error::Store(error))
            }
        }
    }

    /// Carries a completion whose first attempt failed with `first` on in a task of its own,
    /// which owns the claim (its place under the in-flight bound, its renewal) until the record
    /// lands, the claim is found lost, or the lease ends; only then does the claim settle, and
    /// only a result finally not stored is reported.
    fn complete_in_background(mut self, payload: Bytes, first: String) {
        self.flags.completing.store(true, Ordering::Release);
        // From here the claim is never released: the operation ran, and a release would let a
        // retry run it again at once. If the task is cut short (the runtime shuts down), the
        // key is left to its lease, as after a completion that never lands.
        self.settled = true;
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::warn!(key = ?self.key, "no Tokio runtime to carry the completion on");
            self.stop_renewal();
            let _ = self.settle(Err(StoreError::Unavailable(first.into())), &payload);
            return;
        };
        let finishing = async move {
            let outcome = {
                let again = std::pin::pin!(self.complete_until_lease_ends(&payload, first));
                self.keep_alive(again).await
            };
            self.stop_renewal();
            if let Ok(true) = outcome {
                tracing::info!(key = ?self.key, "the result is stored after all; nothing to reconcile");
            }
            let _ = self.settle(outcome, &payload);
        };
        runtime.spawn(finishing.instrument(tracing::Span::current()));
    }

    /// One attempt at the completion: after the store's hold, if it holds writes back, then one
    /// call bounded by the store timeout. A call that fails because the store began to hold
    /// writes back while it was under way is made again once it takes them.
    async fn complete_once(&self, payload: &Bytes) -> Result<bool, StoreError> {
        let settings = &self.settings;
        loop {
            let takes_writes = settings.until_store_takes_writes().await;
            let call = settings
                .store
                .complete(&self.key, &self.owner, payload.clone(), settings.retention);
            let call = reconciliation::carrying(settings.reconciler.as_ref(), call);
            let outcome = settings.bounded(StoreOp::Complete, call).await;
            match &outcome {
                Err(error)
                    if takes_writes && worth_completing_again(error) && settings.store_holds_writes() =>
                {
                    tracing::debug!(key = ?self.key, %error, "the store began holding writes back during the completion; completing once it takes them");
                }
                _ => return outcome,
            }
        }
    }

    /// When the last lease that landed ends: the claim's, or its last renewal's, counted from
    /// when it was sent. Past it the store has dropped the record (or soon will), unless a
    /// renewal it took was never answered: a completion then still lands, and one after the
    /// record is gone finds the claim lost and writes nothing.
    fn lease_ends(&self) -> tokio::time::Instant {
        let leased_at = Duration::from_millis(self.flags.leased_at_ms.load(Ordering::Acquire));
        self.started + leased_at + self.settings.lease
    }

    /// The attempts after a first that failed (with the error `first`), a pause apart, until
    /// one lands or finds the claim lost, or the lease ends. A renewal landing meanwhile moves
    /// that end on, up to a lease from now at most: a store that takes renewals but keeps
    /// refusing the completion must not hold the key (and this task) for ever. Answers the last
    /// attempt's outcome.
    async fn complete_until_lease_ends(&self, payload: &Bytes, first: String) -> Result<bool, StoreError> {
        let at_most = tokio::time::Instant::now() + self.settings.lease;
        let mut last = StoreError::Unavailable(first.into());
        let mut pause = RETRY_FIRST;
        let mut attempt = 1u32;
        loop {
            let now = tokio::time::Instant::now();
            let lease_ends = self.lease_ends().min(at_most);
            if now >= lease_ends {
                tracing::debug!(key = ?self.key, attempts = attempt, "the lease ended before the store took the result");
                return Err(last);
            }
            // The last attempt goes as the lease ends, when the record may still be there.
            tokio::time::sleep(pause.min(lease_ends - now)).await;
            pause = (pause * 2).min(RETRY_MAX);
            attempt += 1;
            match self.complete_once(payload).await {
                Err(error) if worth_completing_again(&error) => {
                    tracing::debug!(key = ?self.key, %error, attempt, "completion failed; retrying");
                    last = error;
                }
                outcome => return outcome,
            }
        }
    }

    /// Gives the key up, so a retry runs the operation again. If the store call fails (or this
    /// future is dropped first), the release is retried in the background. While the store
    /// holds its writes back (a Sentinel failover), it waits first, as a completion does.
    pub async fn release(mut self) -> Result<(), Error> {
        self.stop_renewal();
        let settings = &self.settings;
        settings.until_store_takes_writes().await;
        settings
            .bounded(StoreOp::Release, settings.store.release(&self.key, &self.owner))
            .await?;
        self.settled = true;
        Ok(())
    }
}

/// Whether a completion that failed with `error` may land if tried again: not a result too
/// large for the store, which another attempt would meet again.
fn worth_completing_again(error: &StoreError) -> bool {
    !matches!(error, StoreError::TooLarge { .. })
}

impl Claim {
    /// Reports a response that ran but could not be stored (HTTP: too large, its body failed, the
    /// handler timed out), before the key is settled as not replayable or released.
    pub(crate) fn report_not_stored(&self, why: NotStored) {
        self.reconcile(ReconciliationKind::NotStorable { why }, None);
    }

    /// Gives up on storing a result: reported to the reconciliation hook as `kind`, and the key
    /// left to its lease, as after a completion whose every attempt failed (released, a
    /// redelivery would run the operation again at once). For `once`: a result that does not
    /// encode, or an operation cancelled past its timeout (whose effect may have happened).
    pub(super) fn abandon(mut self, kind: ReconciliationKind) {
        self.stop_renewal();
        self.settled = true;
        self.reconcile(kind, None);
    }

    fn reconcile(&self, kind: ReconciliationKind, payload: Option<&Bytes>) {
        let hook = self.settings.reconciler.as_ref();
        reconciliation::report(hook, kind, &self.key, &self.owner, payload);
    }

    fn stop_renewal(&mut self) {
        if let Some(renewal) = self.renewal.take() {
            renewal.abort();
        }
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        self.stop_renewal();
        if !self.settled {
            self.settings
                .release_in_background(self.key.clone(), self.owner.clone());
        }
    }
}

/// Renews `owner`'s lease every third of it until a renewal finds the claim lost, or completed
/// by a transaction of the caller's (then the claim is not lost, and its completion finds it
/// done).
async fn renew_until_lost(
    settings: &Settings,
    key: &RecordKey,
    owner: &OwnerToken,
    flags: &ClaimFlags,
    started: tokio::time::Instant,
) {
    let every = settings.lease / 3;
    let mut pause = every;
    loop {
        tokio::time::sleep(pause).await;
        pause = every;
        // While the store holds writes back (a Sentinel failover), the renewal waits, outside the
        // store timeout, and goes the moment it takes them again: to the new master, where the
        // lease left from the last renewal that reached it is all that keeps the claim meanwhile.
        settings.until_store_takes_writes().await;
        let sent = tokio::time::Instant::now();
        match settings
            .bounded(StoreOp::Renew, settings.store.renew(key, owner, settings.lease))
            .await
        {
            Ok(true) => {
                // Counted from when it was sent: the store's lease may have begun any time after.
                let at = u64::try_from(sent.duration_since(started).as_millis()).unwrap_or(u64::MAX);
                flags.leased_at_ms.fetch_max(at, Ordering::AcqRel);
                tracing::trace!(?key, "lease renewed");
            }
            Ok(false) if flags.completed_elsewhere.load(Ordering::Acquire) => {
                tracing::trace!(?key, "claim completed in the caller's transaction; renewal ends");
                return;
            }
            Ok(false) if flags.completing.load(Ordering::Acquire) => {
                tracing::trace!(
                    ?key,
                    "claim no longer in flight while it is completed; renewal ends"
                );
                return;
            }
            Ok(false) => {
                flags.lost.store(true, Ordering::Release);
                tracing::warn!(
                    ?key,
                    "claim lost while the operation runs; its result will not be stored"
                );
                return;
            }
            // The store began holding writes back during the call: renewed once it takes them.
            Err(error) if settings.store_holds_writes() => {
                tracing::debug!(?key, %error, "a renewal met a failover; renewing again once it ends");
                pause = Duration::ZERO;
            }
            // The next renewal may get through; the lease is three renewals long.
            Err(error) => tracing::warn!(?key, %error, "could not renew a lease"),
        }
    }
}
