//! What an effect may answer besides its result, and what became of each message.

use std::time::Duration;

use bytes::Bytes;

use super::message::StreamMessage;
use crate::coordinator::Error;
use crate::telemetry::StreamLabel;

/// An effect's error, boxed.
type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Why an effect did not produce a result: a failure worth another delivery, or a message that
/// can never succeed as it is.
///
/// Any error converts into [`Failure::Retry`], so `?` works in an effect on the errors of
/// `fred`, `sqlx`, `std::io` and the like.
#[derive(Debug)]
pub enum Failure {
    /// A technical failure (a dependency down, a timeout): the key is released and the message
    /// left pending, delivered again after a lease, up to the bound on deliveries.
    Retry(BoxError),
    /// The message can never succeed (a field that does not parse): the key is released and the
    /// message dead-lettered with this reason.
    DeadLetter(String),
}

impl Failure {
    /// A failure worth another delivery, from any error or message.
    pub fn retry(error: impl Into<BoxError>) -> Self {
        Failure::Retry(error.into())
    }

    /// A message to dead-letter, with the reason a person will read.
    pub fn dead_letter(reason: impl Into<String>) -> Self {
        Failure::DeadLetter(reason.into())
    }
}

impl<E: std::error::Error + Send + Sync + 'static> From<E> for Failure {
    fn from(error: E) -> Self {
        Failure::Retry(Box::new(error))
    }
}

/// What the consumer did with one message, told to the observer
/// ([`StreamConsumer::with_observer`](super::StreamConsumer::with_observer)) right before the
/// message is acknowledged, dead-lettered or left pending.
#[derive(Debug)]
#[non_exhaustive]
pub enum StreamOutcome {
    /// The effect ran here; acknowledged. `not_stored` is set when its result could not be
    /// stored (see [`Once::NotStored`](crate::Once::NotStored)).
    Ran {
        /// What the effect returned.
        result: Bytes,
        /// Why the result was not stored, if it was not.
        not_stored: Option<Error>,
        /// From the effect's return to its result stored (or given up): on a store apart
        /// from the effect's data, the window in which a crash applies the effect again on
        /// redelivery (scripts/stream-window.sh measures it).
        stored_in: Duration,
    },
    /// A duplicate: the effect ran before (here or elsewhere); acknowledged without running.
    Replayed(Bytes),
    /// Another consumer holds the key: left pending, taken over after a lease.
    InFlight {
        /// Time left on that consumer's lease.
        retry_after: Duration,
    },
    /// The effect failed ([`Failure::Retry`]): left pending, taken over after a lease.
    Failed(BoxError),
    /// The store did not answer and the consumer is stopping, so the message is no longer held:
    /// left pending, taken over after a lease.
    Unavailable(Error),
    /// Moved to the dead-letter stream with this reason, and acknowledged.
    DeadLettered {
        /// Why: `bad id: …`, `mismatch: …`, `unreadable record: …`, `delivered N times, …`,
        /// or the effect's [`Failure::DeadLetter`].
        reason: String,
    },
}

impl StreamOutcome {
    /// The outcome's name, as the metrics' `outcome` label and a log line's first word take it:
    /// `ran`, `replayed`, `in-flight`, `failed`, `unavailable`, `dead-lettered`.
    pub fn label(&self) -> &'static str {
        match self {
            StreamOutcome::Ran { .. } => "ran",
            StreamOutcome::Replayed(_) => "replayed",
            StreamOutcome::InFlight { .. } => "in-flight",
            StreamOutcome::Failed(_) => "failed",
            StreamOutcome::Unavailable(_) => "unavailable",
            StreamOutcome::DeadLettered { .. } => "dead-lettered",
        }
    }

    /// How the metrics count it.
    pub(super) fn metric(&self) -> StreamLabel {
        match self {
            StreamOutcome::Ran { .. } => StreamLabel::Ran,
            StreamOutcome::Replayed(_) => StreamLabel::Replayed,
            StreamOutcome::InFlight { .. } => StreamLabel::InFlight,
            StreamOutcome::Failed(_) => StreamLabel::Failed,
            StreamOutcome::Unavailable(_) => StreamLabel::Unavailable,
            StreamOutcome::DeadLettered { .. } => StreamLabel::DeadLettered,
        }
    }

    /// Whether the message leaves the group's pending list (acknowledged or dead-lettered).
    pub fn is_final(&self) -> bool {
        matches!(
            self,
            StreamOutcome::Ran { .. } | StreamOutcome::Replayed(_) | StreamOutcome::DeadLettered { .. }
        )
    }
}

/// What the consumer tells its observer, in order for each message.
#[derive(Debug)]
#[non_exhaustive]
pub enum StreamEvent<'a> {
    /// A message was taken in hand: read new, or taken over from another consumer.
    Received(&'a StreamMessage),
    /// What became of it, right before it is acknowledged, dead-lettered or left pending.
    Handled {
        /// The message.
        message: &'a StreamMessage,
        /// What became of it.
        outcome: &'a StreamOutcome,
        /// From taking it in hand to now (holds through outages and waits included).
        took: Duration,
    },
}

/// One line per event, the consumer's log as `examples/stream_consumer.rs` writes it:
/// `received msg=<entry> id="<id>" deliveries=<n> takeover=<bool>`, then one of `ran msg=<entry>
/// id="<id>" took_ms=<ms>` (and `not_stored="…"` when it was not stored), `replayed … took_ms=<ms>`,
/// `in-flight … retry_after_ms=<ms> (left pending)`, `failed … error="…" (left pending)`,
/// `unavailable … error="…" (left pending)` or `dead-lettered … reason="…"`.
impl std::fmt::Display for StreamEvent<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (message, outcome, took) = match self {
            StreamEvent::Received(message) => {
                return write!(
                    f,
                    "received msg={} id={:?} deliveries={} takeover={}",
                    message.entry(),
                    message.id().unwrap_or_default(),
                    message.deliveries(),
                    message.is_takeover()
                )
            }
            StreamEvent::Handled {
                message,
                outcome,
                took,
            } => (message, outcome, took),
        };
        let (entry, id) = (message.entry(), message.id().unwrap_or_default());
        write!(f, "{} msg={entry} id={id:?}", outcome.label())?;
        let took_ms = took.as_millis();
        match outcome {
            StreamOutcome::Ran {
                not_stored: Some(error),
                ..
            } => write!(f, " took_ms={took_ms} not_stored={:?}", error.to_string()),
            StreamOutcome::Ran { .. } | StreamOutcome::Replayed(_) => write!(f, " took_ms={took_ms}"),
            StreamOutcome::InFlight { retry_after } => {
                write!(f, " retry_after_ms={} (left pending)", retry_after.as_millis())
            }
            StreamOutcome::Failed(error) => write!(f, " error={:?} (left pending)", error.to_string()),
            StreamOutcome::Unavailable(error) => write!(f, " error={:?} (left pending)", error.to_string()),
            StreamOutcome::DeadLettered { reason } => write!(f, " reason={reason:?}"),
        }
    }
}
