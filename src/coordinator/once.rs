//! Running an operation once per key for callers without HTTP, queue consumers first: claim the
//! key, run the operation with its lease renewed, complete or release, and say what that means
//! for the message (acknowledge it, deliver it again later, or dead-letter it).

use std::future::{Future, IntoFuture};
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::time::Duration;

use bytes::Bytes;
use futures_util::FutureExt;
use serde::de::DeserializeOwned;
use serde::Serialize;

use super::{Begin, Coordinator, Error};
use crate::fingerprint::Fingerprint;
use crate::key::RecordKey;
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
            Once::Mismatch | Once::Unavailable(Error::Store(StoreError::Corrupt(_))) => {
                Disposition::DeadLetter
            }
            Once::Failed(_) | Once::Unavailable(_) => Disposition::Retry { after: None },
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
/// or set [`wait`](OnceCall::wait) first.
#[must_use = "a OnceCall does nothing until it is awaited"]
pub struct OnceCall<'a, T, Op> {
    coordinator: &'a Coordinator,
    key: &'a RecordKey,
    fingerprint: &'a Fingerprint,
    operation: Op,
    codec: Codec<T>,
    wait: Duration,
}

impl<T, Op> std::fmt::Debug for OnceCall<'_, T, Op> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OnceCall")
            .field("key", self.key)
            .field("wait", &self.wait)
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
        } = self;
        let claim = match coordinator.begin_or_wait(key, fingerprint, wait).await {
            Ok(Begin::Claimed(claim)) => claim,
            Ok(Begin::Completed(stored)) => {
                return match (codec.decode)(stored) {
                    Ok(result) => Once::Replayed(result),
                    Err(error) => Once::Unavailable(error),
                }
            }
            Ok(Begin::InFlight { lease_left }) => {
                return Once::InFlight {
                    retry_after: lease_left,
                }
            }
            Ok(Begin::Mismatch) => return Once::Mismatch,
            Err(error) => return Once::Unavailable(error),
        };
        // A panic in the operation gives the key up before it goes on up, so a redelivery finds
        // the key free at once (the claim's drop would release it too, but in the background,
        // after the panic has been seen).
        let ran = AssertUnwindSafe(operation(claim.ticket())).catch_unwind().await;
        let result = match ran {
            Ok(Ok(result)) => result,
            Ok(Err(error)) => {
                if let Err(release) = claim.release().await {
                    // Retried in the background; the lease ends it at the latest.
                    tracing::warn!(key = ?key, error = %release, "could not release a failed operation's key at once");
                }
                return Once::Failed(error);
            }
            Err(panic) => {
                let _ = claim.release().await;
                std::panic::resume_unwind(panic);
            }
        };
        let encoded = match (codec.encode)(&result) {
            Ok(encoded) => encoded,
            Err(error) => {
                tracing::error!(key = ?key, %error, "the result does not encode; it is not stored, and the key is left to its lease");
                claim.abandon_unencodable(&error);
                return Once::NotStored { result, error };
            }
        };
        match claim.complete(encoded).await {
            Ok(()) => Once::Ran(result),
            Err(error) => Once::NotStored { result, error },
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
    /// - A panic releases the key, then goes on up.
    ///
    /// Dropping the returned future releases the key in the background if the operation has not
    /// finished. Set [`OnceCall::wait`] to wait for a key another consumer is running.
    ///
    /// ```
    /// use bytes::Bytes;
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
    /// use bytes::Bytes;
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
        }
    }
}
