//! What an effect may answer besides its result, and what became of each message.

use std::time::Duration;

use bytes::Bytes;

use super::message::{FieldError, StreamMessage};
use crate::coordinator::Error;
use crate::telemetry::StreamLabel;

/// An effect's error, boxed.
type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Why an effect did not produce a result: a failure worth another delivery, or a message that
/// can never succeed as it is.
///
/// Any error converts into [`Failure::Retry`], so `?` works in an effect on the errors of
/// `fred`, `sqlx`, `std::io` and the like; a [`FieldError`] (a field that does not parse)
/// into [`Failure::DeadLetter`].
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

/// A field that does not parse dead-letters the message, with the field's reason.
impl From<FieldError> for Failure {
    fn from(error: FieldError) -> Self {
        Failure::DeadLetter(error.into())
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

impl<'a> StreamEvent<'a> {
    /// The event's line (as its `Display` writes it) with the message's fields `names` after its
    /// `id`, in that order, each `name=value`: the value bare when it is a plain word
    /// (`amount=40`), quoted as Rust's `{:?}` when it is empty or holds a space, a quote, a
    /// backslash, an `=` or a control character (`note="two words"`), and left out when the
    /// message has no such field or its value is not UTF-8. For log lines that name what a
    /// message is about, not only its id.
    ///
    /// ```
    /// # fn observe(event: &tower_idempotency::StreamEvent<'_>) {
    /// // ran msg=1700000000000-0 id="pay-1" amount=40 took_ms=3
    /// println!("{}", event.with_fields(&["amount"]));
    /// # }
    /// ```
    pub fn with_fields<'s>(&'s self, names: &'s [&'s str]) -> impl std::fmt::Display + 's {
        EventLine { event: self, names }
    }
}

/// An event's line with some of its message's fields: [`StreamEvent::with_fields`].
struct EventLine<'s, 'a> {
    event: &'s StreamEvent<'a>,
    names: &'s [&'s str],
}

impl std::fmt::Display for EventLine<'_, '_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.event.write_line(f, self.names)
    }
}

/// One line per event, the consumer's log as `examples/stream_consumer.rs` writes it:
/// `received msg=<entry> id="<id>" deliveries=<n> takeover=<bool>`, then one of `ran msg=<entry>
/// id="<id>" took_ms=<ms>` (and `not_stored="…"` when it was not stored), `replayed … took_ms=<ms>`,
/// `in-flight … retry_after_ms=<ms> (left pending)`, `failed … error="…" (left pending)`,
/// `unavailable … error="…" (left pending)` or `dead-lettered … reason="…"`.
/// [`StreamEvent::with_fields`] adds fields of the message's own after `id`.
impl std::fmt::Display for StreamEvent<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.write_line(f, &[])
    }
}

impl StreamEvent<'_> {
    /// The event's line, the message's fields `names` after its id.
    fn write_line(&self, f: &mut std::fmt::Formatter<'_>, names: &[&str]) -> std::fmt::Result {
        let (message, outcome, took) = match self {
            StreamEvent::Received(message) => {
                write_head(f, "received", message, names)?;
                return write!(
                    f,
                    " deliveries={} takeover={}",
                    message.deliveries(),
                    message.is_takeover()
                );
            }
            StreamEvent::Handled {
                message,
                outcome,
                took,
            } => (message, outcome, took),
        };
        write_head(f, outcome.label(), message, names)?;
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

/// `<word> msg=<entry> id="<id>"`, then ` name=value` for each of `names` the message has.
fn write_head(
    f: &mut std::fmt::Formatter<'_>,
    word: &str,
    message: &StreamMessage,
    names: &[&str],
) -> std::fmt::Result {
    write!(
        f,
        "{word} msg={} id={:?}",
        message.entry(),
        message.id().unwrap_or_default()
    )?;
    for name in names {
        let Some(value) = message.field(name) else {
            continue;
        };
        let plain = !value.is_empty()
            && !value
                .chars()
                .any(|c| c.is_whitespace() || c.is_control() || matches!(c, '"' | '\\' | '='));
        if plain {
            write!(f, " {name}={value}")?;
        } else {
            write!(f, " {name}={value:?}")?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::*;

    /// A field that does not parse is dead-lettered with its reason (tests/streams.rs,
    /// `one_of_each`); any other error is retried.
    #[test]
    fn any_error_but_a_field_that_does_not_parse_retries() {
        let io = std::io::Error::other("down");
        assert!(matches!(Failure::from(io), Failure::Retry(_)));
    }

    #[test]
    fn a_line_with_fields_names_them_after_the_id_and_quotes_only_what_needs_it() {
        let message = StreamMessage::of_text(&[
            ("id", "p1"),
            ("amount", "-40"),
            ("note", "two words"),
            ("empty", ""),
            ("eq", "a=b"),
        ]);
        let ran = StreamOutcome::Ran {
            result: Bytes::new(),
            not_stored: None,
            stored_in: Duration::ZERO,
        };
        let handled = StreamEvent::Handled {
            message: &message,
            outcome: &ran,
            took: Duration::from_millis(3),
        };
        assert_eq!(
            handled
                .with_fields(&["amount", "missing", "note", "empty", "eq"])
                .to_string(),
            r#"ran msg=1-0 id="p1" amount=-40 note="two words" empty="" eq="a=b" took_ms=3"#
        );
        assert_eq!(handled.with_fields(&[]).to_string(), handled.to_string());
        assert_eq!(handled.to_string(), r#"ran msg=1-0 id="p1" took_ms=3"#);
        assert_eq!(
            StreamEvent::Received(&message)
                .with_fields(&["amount"])
                .to_string(),
            r#"received msg=1-0 id="p1" amount=-40 deliveries=1 takeover=false"#
        );
    }
}
