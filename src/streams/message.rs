//! A stream entry as the consumer hands it to the effect, and the mapping of its fields to the
//! idempotency key and the fingerprint.

use std::sync::Arc;

use bytes::Bytes;
use fred::types::Value;

use crate::fingerprint::{Fingerprint, FingerprintBuilder};
use crate::key::{IdempotencyKey, RecordKey};

/// A field that does not parse: [`StreamMessage::parse_field`]'s error. Its `Display` is the
/// reason, `bad <name>: "<value>" is not <expected>`. It becomes a
/// [`Failure::DeadLetter`](crate::Failure::DeadLetter) with that reason, so `?` in an effect
/// dead-letters the message, and a `String`, so `?` in a
/// [`with_validation`](crate::StreamConsumer::with_validation) check refuses it. It is not a
/// `std::error::Error` on purpose: every error is a [`Failure::Retry`](crate::Failure::Retry)
/// to `?`, and a message that cannot parse will not parse on its next delivery either.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FieldError {
    reason: String,
}

impl std::fmt::Display for FieldError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.reason)
    }
}

impl From<FieldError> for String {
    fn from(error: FieldError) -> Self {
        error.reason
    }
}

/// One stream entry in a consumer's hands: its id, its fields, and how often the group has
/// delivered it. Cheap to clone (the fields are shared).
#[derive(Clone, Debug)]
pub struct StreamMessage {
    entry: Arc<str>,
    /// The field whose value is the key (the consumer's `with_id_field`).
    id_field: Arc<str>,
    fields: Arc<[(String, Bytes)]>,
    deliveries: u64,
    takeover: bool,
}

impl StreamMessage {
    pub(super) fn new(entry: String, fields: Vec<(String, Bytes)>, deliveries: u64, takeover: bool) -> Self {
        Self {
            entry: entry.into(),
            id_field: Arc::from("id"),
            fields: fields.into(),
            deliveries,
            takeover,
        }
    }

    /// The entry id (`1700000000000-0`).
    pub fn entry(&self) -> &str {
        &self.entry
    }

    /// The same message, its key in the field `id_field`.
    pub(super) fn with_id_field(mut self, id_field: &Arc<str>) -> Self {
        self.id_field = id_field.clone();
        self
    }

    /// The value of the id field (the idempotency key, if valid), as text.
    pub fn id(&self) -> Option<&str> {
        self.field(&self.id_field)
    }

    /// The entry's fields, in the order the producer wrote them.
    pub fn fields(&self) -> &[(String, Bytes)] {
        &self.fields
    }

    /// The first value of the field `name`, as text; `None` if the field is missing or its value
    /// is not UTF-8.
    pub fn field(&self, name: &str) -> Option<&str> {
        let (_, value) = self.fields.iter().find(|(field, _)| field == name)?;
        std::str::from_utf8(value).ok()
    }

    /// The field `name` parsed as a `T` (an amount, a count, a flag), or why not, in the words
    /// of the consumer's own dead-letter reasons: `bad <name>: "<value>" is not <expected>`
    /// (`bad amount: "lots" is not an integer`). A field that is missing or not UTF-8 reads as
    /// empty (`bad amount: "" is not an integer`). In an effect, `?` dead-letters the message
    /// with that reason ([`Failure::DeadLetter`](crate::Failure::DeadLetter)); in a
    /// [`with_validation`](crate::StreamConsumer::with_validation) check, `?` refuses it with
    /// the same reason, before its key is claimed.
    ///
    /// ```no_run
    /// # async fn run(consumer: tower_idempotency::StreamConsumer) -> Result<(), Box<dyn std::error::Error>> {
    /// let consumer = consumer.with_validation(|message| {
    ///     Ok(message.parse_field::<i64>("amount", "an integer").map(drop)?)
    /// });
    /// let shutdown = tower_idempotency::shutdown_signal()?;
    /// consumer
    ///     .run(shutdown, |message, _ticket| async move {
    ///         let amount: i64 = message.parse_field("amount", "an integer")?;
    ///         Ok(format!("applied {amount}").into())
    ///     })
    ///     .await?;
    /// # Ok(()) }
    /// ```
    pub fn parse_field<T: std::str::FromStr>(&self, name: &str, expected: &str) -> Result<T, FieldError> {
        let value = self.field(name).unwrap_or_default();
        value.parse().map_err(|_| FieldError {
            reason: format!("bad {name}: {value:?} is not {expected}"),
        })
    }

    /// How many times the group has delivered the entry, this time included (the group's
    /// delivery count: a takeover counts one).
    pub fn deliveries(&self) -> u64 {
        self.deliveries
    }

    /// Whether this consumer took the entry over from another one (`XAUTOCLAIM`) rather than
    /// reading it new.
    pub fn is_takeover(&self) -> bool {
        self.takeover
    }

    /// The record key: the value of the id field, scoped by `scope`. Errs with the reason to
    /// dead-letter the message under.
    pub(super) fn key(&self, scope: Option<&str>) -> Result<RecordKey, String> {
        let id = self
            .id()
            .ok_or_else(|| format!("bad id: no UTF-8 field `{}`", self.id_field))?;
        let key = IdempotencyKey::parse(id).map_err(|error| format!("bad id: {error}"))?;
        Ok(RecordKey::new(scope, key))
    }

    /// What makes two deliveries of one key the same message: by default every field but the
    /// id field, sorted by name, each name and value a part; or the fields named, in that order
    /// (a missing one counts as empty, so it still differs from a present empty one).
    pub(super) fn fingerprint(&self, only: Option<&[String]>) -> Fingerprint {
        let mut builder = FingerprintBuilder::default();
        match only {
            Some(names) => {
                for name in names {
                    builder.part(name.as_bytes());
                    match self.fields.iter().find(|(field, _)| field == name) {
                        Some((_, value)) => {
                            builder.part(&[1]);
                            builder.part(value);
                        }
                        None => builder.part(&[0]),
                    }
                }
            }
            None => {
                let mut fields: Vec<&(String, Bytes)> = self
                    .fields
                    .iter()
                    .filter(|(name, _)| **name != *self.id_field)
                    .collect();
                fields.sort();
                for (name, value) in fields {
                    builder.part(name.as_bytes());
                    builder.part(value);
                }
            }
        }
        builder.finish()
    }
}

/// The entries of an `XREADGROUP` or `XAUTOCLAIM` reply's list: `[[id, [field, value, …]], …]`.
/// An entry deleted since it was delivered comes back as `[id, nil]` (or `nil`) on some
/// servers: it is skipped here, and `XAUTOCLAIM`'s list of deleted ids counts it.
pub(super) fn entries(list: Value) -> Vec<(String, Vec<(String, Bytes)>)> {
    let read = |entry: Value| {
        let mut parts = entry.into_array().into_iter();
        let id = parts.next().and_then(Value::into_string)?;
        Some((id, pairs(parts.next().filter(|fields| !fields.is_null())?)))
    };
    list.into_array().into_iter().filter_map(read).collect()
}

/// `[field, value, …]` (or a RESP3 map) as pairs; a field name that is not UTF-8 is kept lossily.
fn pairs(fields: Value) -> Vec<(String, Bytes)> {
    let flat: Vec<Value> = match fields {
        Value::Map(map) => map
            .inner()
            .into_iter()
            .flat_map(|(key, value)| [Value::from(key), value])
            .collect(),
        other => other.into_array(),
    };
    let mut pairs = Vec::with_capacity(flat.len() / 2);
    let mut flat = flat.into_iter();
    while let (Some(name), Some(value)) = (flat.next(), flat.next()) {
        let name = match name.as_bytes() {
            Some(bytes) => String::from_utf8_lossy(bytes).into_owned(),
            None => name.as_string().unwrap_or_default(),
        };
        let value = value
            .as_bytes()
            .map(Bytes::copy_from_slice)
            .or_else(|| value.as_string().map(Bytes::from))
            .unwrap_or_default();
        pairs.push((name, value));
    }
    pairs
}

#[cfg(test)]
impl StreamMessage {
    /// A message of text `fields`, entry `1-0`, delivered once, read new: for unit tests.
    pub(super) fn of_text(fields: &[(&str, &str)]) -> Self {
        let fields = fields
            .iter()
            .map(|(name, value)| (name.to_string(), Bytes::copy_from_slice(value.as_bytes())))
            .collect();
        StreamMessage::new("1-0".into(), fields, 1, false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(fields: &[(&str, &str)]) -> StreamMessage {
        StreamMessage::of_text(fields)
    }

    /// In any order, another value: tests/streams.rs, `one_of_each` (replayed, a mismatch).
    #[test]
    fn the_default_fingerprint_counts_the_field_names() {
        let a = message(&[("id", "p1"), ("amount", "40"), ("currency", "EUR")]);
        let renamed = message(&[("id", "p1"), ("amount", "40"), ("currencY", "EUR")]);
        assert_ne!(a.fingerprint(None), renamed.fingerprint(None));
    }

    #[test]
    fn named_fingerprint_fields_ignore_the_others_and_tell_missing_from_empty() {
        let only = ["amount".to_owned()];
        let a = message(&[("id", "p1"), ("amount", "40"), ("trace", "x")]);
        let b = message(&[("id", "p1"), ("amount", "40"), ("trace", "y")]);
        assert_eq!(a.fingerprint(Some(&only)), b.fingerprint(Some(&only)));
        let empty = message(&[("id", "p1"), ("amount", "")]);
        let missing = message(&[("id", "p1")]);
        assert_ne!(empty.fingerprint(Some(&only)), missing.fingerprint(Some(&only)));
    }

    /// A bad one says why: tests/stream_consumer.rs, `poisoned_messages_are_dead_lettered`.
    #[test]
    fn the_key_is_the_id_field() {
        assert_eq!(message(&[("id", "p1")]).key(None).unwrap().key().as_str(), "p1");
    }

    #[test]
    fn a_field_that_does_not_parse_says_why_in_the_dead_letter_words() {
        let m = message(&[("id", "p1"), ("amount", "-40"), ("bad", "lots"), ("spaced", " 4")]);
        assert_eq!(m.parse_field::<i64>("amount", "an integer"), Ok(-40));
        let reason = |name| String::from(m.parse_field::<i64>(name, "an integer").unwrap_err());
        assert_eq!(reason("bad"), r#"bad bad: "lots" is not an integer"#);
        assert_eq!(reason("spaced"), r#"bad spaced: " 4" is not an integer"#);
        assert_eq!(reason("missing"), r#"bad missing: "" is not an integer"#);
        let error = m.parse_field::<u8>("amount", "a byte").unwrap_err();
        assert_eq!(error.to_string(), r#"bad amount: "-40" is not a byte"#);
    }

    #[test]
    fn deleted_entries_in_a_reply_are_skipped() {
        let reply = Value::Array(vec![
            Value::Array(vec!["1-0".into(), Value::Array(vec!["id".into(), "p1".into()])]),
            Value::Array(vec!["2-0".into(), Value::Null]),
            Value::Null,
        ]);
        let entries = entries(reply);
        assert_eq!(entries.len(), 1);
        assert_eq!(entries[0].0, "1-0");
        assert_eq!(entries[0].1, vec![("id".to_owned(), Bytes::from("p1"))]);
    }
}
