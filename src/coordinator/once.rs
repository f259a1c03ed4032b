//! Running an operation once per key for callers without HTTP, queue consumers first: claim the
//! key, run the operation with its lease renewed, complete or release, and say what that means
//! for the message (acknowledge it, deliver it again later, or dead-letter it).

use std::future::{Future, IntoFuture};
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures_util::FutureExt;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tracing::Instrument;

use super::{Begin, Coordinator, Error};
use crate::fingerprint::Fingerprint;
use crate::key::RecordKey;
use crate::reconciliation::{NotStored, ReconciliationKind};
use crate::store::{ClaimTicket, StoreError};

/// What [`Coordinator::once`] did with a message's operation, and so what to do with the message
/// ([`disposition`](Once::disposition) tells, as the README's table does).
///
/// `T` is the operation's result (its bytes, or the type [`Coordinator::once_json`] stores as
/// JSON), `E` its error.
#[derive(Debug)]
#[must_use = "the answer says whether to acknowledge the message"]
pub enum Once<T, E> {
    /// The operation ran here and its result is stored: a redelivery gets it back as
    /// [`Replayed`](Once::Replayed). Acknowledge.
    Ran(T),
    /// The operation ran before, here or on another consumer; this is its stored result. The
    /// message is a duplicate: acknowledge it without running anything.
    Replayed(T),
    /// Another consumer is running the operation now. Deliver the message again later (it may
    /// fail there and be released): its lease ends in `retry_after` at the latest, sooner if it
    /// completes.
    InFlight {
        /// Time left on the running consumer's lease.
        retry_after: Duration,
    },
    /// The key was used before by a message with a different fingerprint: a poisoned or
    /// mislabelled message. Dead-letter it.
    Mismatch,
    /// The operation returned an error: the key was released, so a redelivery runs it again.
    /// Deliver again (with the broker's back-off), up to a bound, then dead-letter.
    Failed(E),
    /// Nothing ran: the store could not be reached or did not answer in time, refused the claim
    /// to protect it from a failover, or the coordinator is shutting down or at capacity (see
    /// the [`Error`]). This fails closed: deliver the message again later. (An effect that may
    /// safely repeat could run unguarded here instead; that is the caller's choice to make.)
    /// An unreadable record ([`StoreError::Corrupt`], or a stored result that no longer
    /// decodes as `T`) is here too, and dead-lettered: delivering it again meets it again.
    /// So is an operation that ran past its timeout ([`Error::OperationTimedOut`], see
    /// [`OnceCall::timeout`]): it was cancelled part way, so whether its effect happened is
    /// unknown; it is dead-lettered for a person to look at, and its key is left to its lease
    /// (not released: a redelivery meanwhile answers [`InFlight`](Once::InFlight), and one
    /// after the lease runs the operation again).
    Unavailable(Error),
    /// The operation ran, but its result could not be stored: the claim's lease ran out under
    /// it ([`Error::ClaimLost`]), the first completion attempt failed ([`Error::Store`]: the
    /// completion goes on in the background until it lands or the lease ends, see
    /// [`Claim::complete`](crate::Claim::complete)), or the result is too large or does not
    /// encode. The effect happened, so acknowledge; a later duplicate of this message gets
    /// [`InFlight`](Once::InFlight) meanwhile, then the result if it landed, or runs it again.
    /// What is finally not stored is reported to the
    /// [reconciliation hook](crate::Coordinator::with_reconciliation).
    NotStored {
        /// What the operation returned.
        result: T,
        /// Why it was not stored.
        error: Error,
    },
}

/// What to do with a message, given what [`Coordinator::once`] did with it: the mapping from
/// [`Once`] to a broker's acknowledgement, the same on every broker.
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::{Disposition, Error, Once};
///
/// let done: Once<&str, ()> = Once::Replayed("receipt-7");
/// assert_eq!(done.disposition(), Disposition::Ack);
/// let busy: Once<&str, ()> = Once::InFlight { retry_after: Duration::from_secs(3) };
/// assert_eq!(busy.disposition(), Disposition::Retry { after: Some(Duration::from_secs(3)) });
/// let down: Once<&str, ()> = Once::Unavailable(Error::AtCapacity);
/// assert_eq!(down.disposition(), Disposition::Retry { after: None });
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Disposition {
    /// Acknowledge the message: its effect happened (here or before).
    Ack,
    /// Leave the message to be delivered again (NACK, or leave it pending), `after` this long
    /// when given (another consumer's lease), else after the broker's own back-off. Count the
    /// deliveries and dead-letter past a bound: an operation that fails every time is a poison.
    Retry {
        /// When a new delivery can succeed at the earliest, when that is known.
        after: Option<Duration>,
    },
    /// Move the message aside for a person to look at: it can never succeed as it is.
    DeadLetter,
}

impl<T, E> Once<T, E> {
    /// What to do with the message: see [`Once`]'s variants and [`Disposition`].
    pub fn disposition(&self) -> Disposition {
        match self {
            Once::Ran(_) | Once::Replayed(_) | Once::NotStored { .. } => Disposition::Ack,
            Once::InFlight { retry_after } => Disposition::Retry {
                after: Some(*retry_after),
            },
            Once::Mismatch
            | Once::Unavailable(Error::Store(StoreError::Corrupt(_)) | Error::OperationTimedOut(_)) => {
                Disposition::DeadLetter
            }
            Once::Failed(_) | Once::Unavailable(_) => Disposition::Retry { after: None },
        }
    }

    /// Makes the call `call` again while nothing ran because the store could not take it
    /// (an [`Unavailable`](Once::Unavailable) to retry: the store down or slow, a failover's
    /// fence, the coordinator at capacity), pausing 0.5 s, then doubling up to 5 s, between
    /// tries, and answers the first other answer: a consumer holds the message in hand through
    /// a store outage instead of returning it to the broker, where each return counts as a
    /// delivery and an outage would dead-letter every message it meets. An
    /// [`InFlight`](Once::InFlight) right after an outage is held the same way: a claim of this
    /// call's that timed out may have landed once the store came back, and its key is in flight
    /// until it is released in the background or its lease ends; returned to the broker, the
    /// message would cost a delivery for nothing. When `stop` is done (a shutdown), or the
    /// coordinator is shutting down ([`Error::ShuttingDown`]), it answers the last answer at
    /// once, for the message to go back; an answer to dead-letter is not held either.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::bytes::Bytes;
    /// use tower_idempotency::{Coordinator, Fingerprint, IdempotencyKey, MemoryStore, Once, RecordKey};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// let coordinator = Coordinator::new(MemoryStore::new());
    /// let key = RecordKey::new(None, IdempotencyKey::parse("payment-44").unwrap());
    /// let fingerprint = Fingerprint::new([b"amount=3".as_slice()]);
    /// let shutdown = tokio::time::sleep(Duration::from_secs(3600)); // a signal, in a consumer
    /// let answer = Once::hold_through_outage(
    ///     || coordinator.once(&key, &fingerprint, || async { Ok::<_, std::io::Error>(Bytes::from("receipt-44")) }),
    ///     shutdown,
    /// )
    /// .await;
    /// assert!(matches!(answer, Once::Ran(_)));
    /// # }
    /// ```
    pub async fn hold_through_outage<Call, Fut>(call: Call, stop: impl Future<Output = ()>) -> Self
    where
        Call: FnMut() -> Fut,
        Fut: IntoFuture<Output = Self>,
    {
        let held = |answer: &Self, pause: Duration| match answer {
            Once::Unavailable(error) => {
                tracing::warn!(%error, ?pause, "the store is unavailable; holding the message and trying again")
            }
            _ => tracing::debug!(?pause, "in flight after the outage; holding the message"),
        };
        Self::hold(call, stop, held).await
    }

    /// [`Once::hold_through_outage`], telling `held` of each answer held and the pause before
    /// the next try (so that a consumer's log names the message): the one hold loop of the
    /// crate, the streams consumer's too.
    pub(crate) async fn hold<Call, Fut>(
        mut call: Call,
        stop: impl Future<Output = ()>,
        mut held: impl FnMut(&Self, Duration),
    ) -> Self
    where
        Call: FnMut() -> Fut,
        Fut: IntoFuture<Output = Self>,
    {
        let mut stop = std::pin::pin!(stop);
        let mut pause = HOLD_FIRST;
        let mut outage = false;
        loop {
            let answer = call().await;
            match &answer {
                // A shutdown of the coordinator would refuse every try: the message goes back.
                Once::Unavailable(Error::ShuttingDown) => return answer,
                Once::Unavailable(_) if answer.disposition() != Disposition::DeadLetter => outage = true,
                Once::InFlight { .. } if outage => {}
                _ => return answer,
            }
            held(&answer, pause);
            tokio::select! {
                biased;
                () = &mut stop => return answer,
                () = tokio::time::sleep(pause) => {}
            }
            pause = (pause * 2).min(HOLD_MAX);
        }
    }

    /// The operation's result, whether it ran now, before, or ran without being stored.
    pub fn result(&self) -> Option<&T> {
        match self {
            Once::Ran(result) | Once::Replayed(result) | Once::NotStored { result, .. } => Some(result),
            _ => None,
        }
    }
}

/// The pauses of [`Once::hold_through_outage`] between tries: doubling from the first up to the
/// last, so a store back from an outage is found within seconds without a message hammering it.
const HOLD_FIRST: Duration = Duration::from_millis(500);
const HOLD_MAX: Duration = Duration::from_secs(5);

/// A name for a queue consumer that no other live consumer shares: the host name and the
/// process id (`worker-3-4711`), `consumer-4711` where no host name can be read. What a
/// [`StreamConsumer`](crate::StreamConsumer) names itself in its group unless told otherwise,
/// and what `examples/rabbitmq_consumer.rs` tags its consumer with.
///
/// ```
/// let name = tower_idempotency::default_consumer_name();
/// assert!(name.ends_with(&format!("-{}", std::process::id())));
/// ```
pub fn default_consumer_name() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|host| host.trim().to_owned())
        .filter(|host| !host.is_empty())
        .unwrap_or_else(|| "consumer".into());
    format!("{host}-{}", std::process::id())
}

/// How a result is stored and read back: as its bytes, or as JSON.
struct Codec<T> {
    encode: fn(&T) -> Result<Bytes, Error>,
    decode: fn(Bytes) -> Result<T, Error>,
}

fn raw() -> Codec<Bytes> {
    Codec {
        encode: |bytes| Ok(bytes.clone()),
        decode: Ok,
    }
}

fn json<T: Serialize + DeserializeOwned>() -> Codec<T> {
    Codec {
        encode: |value| match serde_json::to_vec(value) {
            Ok(encoded) => Ok(Bytes::from(encoded)),
            Err(error) => Err(Error::Encode(Box::new(error))),
        },
        decode: |stored| {
            serde_json::from_slice(&stored).map_err(|error| {
                Error::Store(StoreError::Corrupt(format!(
                    "the stored result is not the JSON of a {}: {error}",
                    std::any::type_name::<T>()
                )))
            })
        },
    }
}

/// A call to [`Coordinator::once`] (or `once_json`, `once_with_ticket`): `.await` it to run it,
/// or set [`wait`](OnceCall::wait) or [`timeout`](OnceCall::timeout) first.
#[must_use = "a OnceCall does nothing until it is awaited"]
pub struct OnceCall<'a, T, Op> {
    coordinator: &'a Coordinator,
    key: &'a RecordKey,
    fingerprint: &'a Fingerprint,
    operation: Op,
    codec: Codec<T>,
    wait: Duration,
    /// `None`: the coordinator's ([`Coordinator::with_once_timeout`]).
    timeout: Option<Duration>,
}

impl<T, Op> std::fmt::Debug for OnceCall<'_, T, Op> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OnceCall")
            .field("key", self.key)
            .field("wait", &self.wait)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl<T, Op> OnceCall<'_, T, Op> {
    /// When another consumer is running the key, wait up to `wait` for it instead of answering
    /// [`Once::InFlight`] at once (see [`Coordinator::begin_or_wait`]): its result comes back as
    /// [`Once::Replayed`] as soon as it is stored, and if it gives the key up (it failed, or
    /// died and its lease ran out) the operation runs here. Default: no wait.
    ///
    /// A consumer that took over a dead consumer's message waits about a lease here, so the
    /// message is processed as soon as the dead one's lease ends, not a redelivery later.
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = wait;
        self
    }

    /// The longest the operation may run (default: the coordinator's,
    /// [`with_once_timeout`](Coordinator::with_once_timeout), 60 s unless set). Past it the
    /// operation's future is dropped (cancelled where it waits), and the call answers
    /// [`Once::Unavailable`] with [`Error::OperationTimedOut`]: dead-letter the message, since
    /// whether the effect happened is unknown. The key is not released but left to its lease,
    /// and the timeout is reported to the
    /// [reconciliation hook](Coordinator::with_reconciliation) as
    /// [`NotStorable`](crate::ReconciliationKind::NotStorable) with
    /// [`NotStored::TimedOut`](crate::NotStored::TimedOut), as the HTTP layer reports a handler
    /// past its timeout. Only the operation is timed: the wait and the store calls have bounds
    /// of their own. `Duration::MAX` turns the bound off.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::bytes::Bytes;
    /// use tower_idempotency::{Coordinator, Disposition, Error, Fingerprint, IdempotencyKey, MemoryStore, Once, RecordKey};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// let coordinator = Coordinator::new(MemoryStore::new());
    /// let key = RecordKey::new(None, IdempotencyKey::parse("export-3").unwrap());
    /// let fingerprint = Fingerprint::new([b"export".as_slice()]);
    /// let answer = coordinator
    ///     .once(&key, &fingerprint, || async {
    ///         std::future::pending::<()>().await; // a dependency that never answers
    ///         Ok::<_, std::io::Error>(Bytes::new())
    ///     })
    ///     .timeout(Duration::from_millis(50))
    ///     .await;
    /// assert!(matches!(answer, Once::Unavailable(Error::OperationTimedOut(_))));
    /// assert_eq!(answer.disposition(), Disposition::DeadLetter);
    /// # }
    /// ```
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }
}

impl<'a, T, E, Op, Fut> IntoFuture for OnceCall<'a, T, Op>
where
    T: Send + 'a,
    E: Send + 'a,
    Op: FnOnce(ClaimTicket) -> Fut + Send + 'a,
    Fut: Future<Output = Result<T, E>> + Send + 'a,
{
    type Output = Once<T, E>;
    type IntoFuture = Pin<Box<dyn Future<Output = Once<T, E>> + Send + 'a>>;

    fn into_future(self) -> Self::IntoFuture {
        Box::pin(self.run())
    }
}

impl<'a, T, Op> OnceCall<'a, T, Op> {
    async fn run<E, Fut>(self) -> Once<T, E>
    where
        Op: FnOnce(ClaimTicket) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let OnceCall {
            coordinator,
            key,
            fingerprint,
            operation,
            codec,
            wait,
            timeout,
        } = self;
        let claim = match coordinator.begin_or_wait(key, fingerprint, wait).await {
            Ok(Begin::Claimed(claim)) => claim,
            Ok(Begin::Completed(stored)) => {
                return (codec.decode)(stored).map_or_else(Once::Unavailable, Once::Replayed)
            }
            Ok(Begin::InFlight { lease_left }) => {
                return Once::InFlight {
                    retry_after: lease_left,
                }
            }
            // A consumer's message under a key stored under another policy is as poisoned as
            // one with another payload: dead-lettered alike.
            Ok(Begin::Mismatch | Begin::PolicyMismatch) => return Once::Mismatch,
            Err(error) => return Once::Unavailable(error),
        };
        // A panic in the operation, or in the closure before it returns the operation's future,
        // gives the key up before it goes on up, so a redelivery finds the key free at once (the
        // claim's drop would release it too, but in the background, after the panic has been
        // seen).
        let ticket = claim.ticket();
        let operation = AssertUnwindSafe(async move { operation(ticket).await }).catch_unwind();
        let timeout = timeout.unwrap_or(coordinator.settings.once_timeout);
        let result = match tokio::time::timeout(timeout, operation).await {
            Ok(Ok(Ok(result))) => result,
            Ok(Ok(Err(error))) => {
                if let Err(release) = claim.release().await {
                    // Retried in the background; the lease ends it at the latest.
                    tracing::warn!(key = ?key, error = %release, "could not release a failed operation's key at once");
                }
                return Once::Failed(error);
            }
            Ok(Err(panic)) => {
                let _ = claim.release().await;
                std::panic::resume_unwind(panic);
            }
            Err(_elapsed) => {
                // Cancelled part way: its effect may have happened, so the key is not released
                // (a redelivery would run it again at once), as the HTTP layer keeps the key of
                // a handler past its timeout.
                tracing::error!(key = ?key, ?timeout, "the operation ran past its timeout and was cancelled; the key is left to its lease");
                claim.abandon(ReconciliationKind::NotStorable {
                    why: NotStored::TimedOut,
                });
                return Once::Unavailable(Error::OperationTimedOut(timeout));
            }
        };
        let encoded = match (codec.encode)(&result) {
            Ok(encoded) => encoded,
            Err(error) => {
                tracing::error!(key = ?key, %error, "the result does not encode; it is not stored, and the key is left to its lease");
                claim.abandon(ReconciliationKind::CompletionFailed {
                    error: error.to_string(),
                });
                return Once::NotStored { result, error };
            }
        };
        // The effect happened: from here the completion is carried to its end even if this
        // future is dropped (a per-message timeout, a shutdown `select!`), where dropping the
        // claim would release the key and let a redelivery run the effect again; in the caller's
        // span wherever it ends, as the HTTP layer's detached runs are.
        let completion = claim.complete(encoded).instrument(tracing::Span::current());
        let carried_on = CarriedOn {
            completion: Some(Box::pin(completion)),
        };
        match carried_on.await {
            Ok(()) => Once::Ran(result),
            Err(error) => Once::NotStored { result, error },
        }
    }
}

/// A completion awaited in place, and handed to a task of its own if the future awaiting it is
/// dropped first: one allocation per completion, and a task only for a caller that left.
struct CarriedOn {
    /// `None` once it has ended.
    completion: Option<Completion>,
}

/// A claim's completion, boxed so it can be moved to a task once the caller has left.
type Completion = Pin<Box<dyn Future<Output = Result<(), Error>> + Send>>;

impl Future for CarriedOn {
    type Output = Result<(), Error>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let Some(completion) = self.completion.as_mut() else {
            return Poll::Pending;
        };
        let outcome = std::task::ready!(completion.as_mut().poll(cx));
        self.completion = None;
        Poll::Ready(outcome)
    }
}

impl Drop for CarriedOn {
    fn drop(&mut self) {
        let Some(completion) = self.completion.take() else {
            return;
        };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                tracing::debug!("the caller left before the completion ended; it goes on in the background");
                // Its outcome is logged and reported by the completion itself.
                runtime.spawn(completion);
            }
            // Dropped with the completion (and the claim): released in the background if a
            // runtime is found there, else left to the lease.
            Err(_) => {
                tracing::warn!("no Tokio runtime to carry a completion on; the key is left to its lease")
            }
        }
    }
}

impl Coordinator {
    /// Runs `operation` at most once per `key`, for a queue consumer: claims the key, runs the
    /// operation with the claim's lease renewed meanwhile, stores its result, and answers what
    /// happened ([`Once`]), which tells what to do with the message ([`Once::disposition`]).
    /// One store round trip for a duplicate, two for a message that runs (the claim and the
    /// completion).
    ///
    /// What the operation returns decides what a redelivery sees:
    /// - `Ok(result)` is stored and replayed to every redelivery ([`Once::Replayed`]). A business
    ///   rejection (a card declined, an order refused) belongs here, encoded in the result: a
    ///   redelivery must get the same rejection, not a second attempt.
    /// - `Err(error)` is a technical failure (a dependency down, a timeout): the key is released
    ///   and a redelivery runs the operation again ([`Once::Failed`]).
    /// - A panic (in the operation, or in the closure before it returns its future) releases the
    ///   key, then goes on up.
    /// - Past its timeout (60 s unless set, [`OnceCall::timeout`]) the operation is cancelled:
    ///   [`Once::Unavailable`] with [`Error::OperationTimedOut`], to dead-letter; the key is
    ///   left to its lease and the timeout reported to the reconciliation hook.
    ///
    /// The returned future may be dropped (a per-message `tokio::time::timeout`, a shutdown
    /// `select!`): before the operation has finished, that cancels it and releases the key in
    /// the background, so a redelivery runs it; after it returned `Ok`, the completion goes on
    /// in a task of its own to its end (through a Sentinel failover's hold, the store's retries),
    /// so a redelivery gets the result, never a second run. Set [`OnceCall::wait`] to wait for
    /// a key another consumer is running.
    ///
    /// ```
    /// use tower_idempotency::bytes::Bytes;
    /// use tower_idempotency::{Coordinator, Disposition, Fingerprint, IdempotencyKey, MemoryStore, Once, RecordKey};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// let coordinator = Coordinator::new(MemoryStore::new());
    /// let key = RecordKey::new(None, IdempotencyKey::parse("payment-41").unwrap());
    /// let fingerprint = Fingerprint::new([b"amount=40".as_slice()]);
    /// for delivery in 1..=2 {
    ///     let answer = coordinator
    ///         .once(&key, &fingerprint, || async {
    ///             // ... the effect, once ...
    ///             Ok::<_, std::io::Error>(Bytes::from("receipt-41"))
    ///         })
    ///         .await;
    ///     match (delivery, &answer) {
    ///         (1, Once::Ran(receipt)) | (2, Once::Replayed(receipt)) => assert_eq!(receipt, "receipt-41"),
    ///         other => panic!("{other:?}"),
    ///     }
    ///     assert_eq!(answer.disposition(), Disposition::Ack);
    /// }
    /// # }
    /// ```
    pub fn once<'a, E, Op, Fut>(
        &'a self,
        key: &'a RecordKey,
        fingerprint: &'a Fingerprint,
        operation: Op,
    ) -> OnceCall<'a, Bytes, impl FnOnce(ClaimTicket) -> Fut + Send + 'a>
    where
        Op: FnOnce() -> Fut + Send + 'a,
        Fut: Future<Output = Result<Bytes, E>>,
    {
        self.once_call(key, fingerprint, move |_ticket| operation(), raw())
    }

    /// [`once`](Coordinator::once) for a result of any type that serde reads and writes: it is
    /// stored as JSON, and a redelivery gets the same type back. A stored result that no longer
    /// decodes as `T` (the type changed under a record still retained) is answered
    /// [`Once::Unavailable`] with [`StoreError::Corrupt`], and dead-lettered.
    ///
    /// ```
    /// use serde::{Deserialize, Serialize};
    /// use tower_idempotency::{Coordinator, Fingerprint, IdempotencyKey, MemoryStore, Once, RecordKey};
    ///
    /// #[derive(Debug, PartialEq, Serialize, Deserialize)]
    /// enum Charge {
    ///     Accepted { receipt: u64 },
    ///     Declined { reason: String },
    /// }
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// let coordinator = Coordinator::new(MemoryStore::new());
    /// let key = RecordKey::new(None, IdempotencyKey::parse("payment-42").unwrap());
    /// let fingerprint = Fingerprint::new([b"amount=99999".as_slice()]);
    /// let charge = || async {
    ///     // A decline is a business outcome: stored, and the redelivery gets the same decline.
    ///     Ok::<_, std::io::Error>(Charge::Declined { reason: "over the limit".into() })
    /// };
    /// let first = coordinator.once_json(&key, &fingerprint, charge).await;
    /// assert!(matches!(first, Once::Ran(Charge::Declined { .. })));
    /// let again = coordinator.once_json(&key, &fingerprint, charge).await;
    /// assert!(matches!(again, Once::Replayed(Charge::Declined { .. })));
    /// # }
    /// ```
    pub fn once_json<'a, T, E, Op, Fut>(
        &'a self,
        key: &'a RecordKey,
        fingerprint: &'a Fingerprint,
        operation: Op,
    ) -> OnceCall<'a, T, impl FnOnce(ClaimTicket) -> Fut + Send + 'a>
    where
        T: Serialize + DeserializeOwned,
        Op: FnOnce() -> Fut + Send + 'a,
        Fut: Future<Output = Result<T, E>>,
    {
        self.once_call(key, fingerprint, move |_ticket| operation(), json())
    }

    /// [`once`](Coordinator::once) for an operation that completes the record itself, in its
    /// own database transaction with its business writes (`PostgresStore::complete_in`, given
    /// the [`ClaimTicket`] passed in): the effect and the record then commit together, so no
    /// crash anywhere can apply the effect twice. The operation returns the result it
    /// completed with; the completion that follows (one more round trip, which also covers an
    /// operation that returned without completing) finds the record completed and leaves it.
    /// An operation that rolls back (its claim was lost, or its writes failed) returns `Err`.
    ///
    /// ```
    /// use tower_idempotency::bytes::Bytes;
    /// use tower_idempotency::{Coordinator, Fingerprint, IdempotencyKey, MemoryStore, Once, RecordKey};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// let coordinator = Coordinator::new(MemoryStore::new());
    /// let key = RecordKey::new(None, IdempotencyKey::parse("payment-43").unwrap());
    /// let fingerprint = Fingerprint::new([b"amount=7".as_slice()]);
    /// let answer = coordinator
    ///     .once_with_ticket(&key, &fingerprint, |ticket| async move {
    ///         // With a PostgresStore: begin, insert the business rows,
    ///         // `store.complete_in(&mut transaction, &ticket, receipt.clone())`, commit.
    ///         assert_eq!(ticket.key().key().as_str(), "payment-43");
    ///         Ok::<_, std::io::Error>(Bytes::from("receipt-43"))
    ///     })
    ///     .await;
    /// assert!(matches!(answer, Once::Ran(_)));
    /// # }
    /// ```
    pub fn once_with_ticket<'a, E, Op, Fut>(
        &'a self,
        key: &'a RecordKey,
        fingerprint: &'a Fingerprint,
        operation: Op,
    ) -> OnceCall<'a, Bytes, Op>
    where
        Op: FnOnce(ClaimTicket) -> Fut + Send + 'a,
        Fut: Future<Output = Result<Bytes, E>>,
    {
        self.once_call(key, fingerprint, operation, raw())
    }

    fn once_call<'a, T, Op>(
        &'a self,
        key: &'a RecordKey,
        fingerprint: &'a Fingerprint,
        operation: Op,
        codec: Codec<T>,
    ) -> OnceCall<'a, T, Op> {
        OnceCall {
            coordinator: self,
            key,
            fingerprint,
            operation,
            codec,
            wait: Duration::ZERO,
            timeout: None,
        }
    }
}
