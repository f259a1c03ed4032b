//! The client's idempotency key and the server-side address built from it.

use std::fmt;
use std::sync::Arc;

use sha2::{Digest, Sha256};

/// The longest key accepted, in characters (the IETF draft and Stripe both use 255).
///
/// ```
/// use tower_idempotency::{IdempotencyKey, MAX_KEY_LEN};
/// assert!(IdempotencyKey::parse(&"k".repeat(MAX_KEY_LEN)).is_ok());
/// assert!(IdempotencyKey::parse(&"k".repeat(MAX_KEY_LEN + 1)).is_err());
/// ```
pub const MAX_KEY_LEN: usize = 255;

/// A validated idempotency key, as sent by a client.
///
/// A key is 1 to [`MAX_KEY_LEN`] visible ASCII characters (`0x21..=0x7E`). It may be written bare
/// (`abc`) or in the Structured Field string form of the IETF draft (`"abc"`); both name the same key.
///
/// ```
/// use tower_idempotency::IdempotencyKey;
///
/// let bare = IdempotencyKey::parse("order-42").unwrap();
/// let quoted = IdempotencyKey::parse("\"order-42\"").unwrap();
/// assert_eq!(bare, quoted);
/// assert!(IdempotencyKey::parse("").is_err());
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(Arc<str>);

impl IdempotencyKey {
    /// Parses a key from a header value: bare, or a Structured Field string (`"abc"`).
    ///
    /// Parameters on a Structured Field string (`"abc";x=1`) are ignored, as RFC 9651 asks of
    /// unknown parameters.
    pub fn parse(value: &str) -> Result<Self, KeyError> {
        Self::parse_bytes(value.as_bytes())
    }

    /// Parses a key from raw header bytes; see [`IdempotencyKey::parse`].
    pub fn parse_bytes(value: &[u8]) -> Result<Self, KeyError> {
        if value.first() == Some(&b'"') {
            let item: sfv::Item = sfv::Parser::new(value)
                .parse_item()
                .map_err(|_| KeyError::MalformedStructuredField)?;
            let text = item
                .bare_item
                .as_string()
                .ok_or(KeyError::MalformedStructuredField)?;
            Self::validate(text.as_str().as_bytes())
        } else {
            Self::validate(value)
        }
    }

    fn validate(bytes: &[u8]) -> Result<Self, KeyError> {
        if bytes.is_empty() {
            return Err(KeyError::Empty);
        }
        if bytes.len() > MAX_KEY_LEN {
            return Err(KeyError::TooLong { len: bytes.len() });
        }
        if let Some(position) = bytes.iter().position(|b| !(0x21..=0x7e).contains(b)) {
            return Err(KeyError::InvalidCharacter { position });
        }
        // Only visible ASCII is left, so this conversion cannot fail; map the error anyway
        // rather than unwrap on client input.
        let text = std::str::from_utf8(bytes).map_err(|_| KeyError::InvalidCharacter { position: 0 })?;
        Ok(Self(Arc::from(text)))
    }

    /// The key's text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("IdempotencyKey").field(&self.as_str()).finish()
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why an idempotency key was refused. The layer answers each with 400
/// ([`Rejection::InvalidKey`](crate::Rejection::InvalidKey)).
///
/// ```
/// use tower_idempotency::{IdempotencyKey, KeyError};
/// assert_eq!(IdempotencyKey::parse(""), Err(KeyError::Empty));
/// assert!(matches!(IdempotencyKey::parse("a b"), Err(KeyError::InvalidCharacter { position: 1 })));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The key is empty.
    #[error("the idempotency key is empty")]
    Empty,
    /// The key is longer than [`MAX_KEY_LEN`].
    #[error("the idempotency key is {len} characters long; at most {MAX_KEY_LEN} are allowed")]
    TooLong {
        /// The key's length.
        len: usize,
    },
    /// The key holds a character other than visible ASCII.
    #[error("the idempotency key has a character other than visible ASCII at position {position}")]
    InvalidCharacter {
        /// Zero-based position of the first offending byte.
        position: usize,
    },
    /// The value starts with `"` but is not a valid Structured Field string.
    #[error("the idempotency key starts with '\"' but is not a valid Structured Field string")]
    MalformedStructuredField,
    /// The header field was sent more than once.
    #[error("the Idempotency-Key header field was sent more than once")]
    Repeated,
}

/// Where a record lives: the key together with the scope (tenant, user, ...) it belongs to.
///
/// Stores address records by a SHA-256 digest of scope and key, so the same key from two scopes
/// names two records and no choice of characters lets one scope reach another's records.
///
/// ```
/// use tower_idempotency::{IdempotencyKey, RecordKey};
///
/// let key = IdempotencyKey::parse("order-42").unwrap();
/// let alice = RecordKey::new(Some("alice"), key.clone());
/// let bob = RecordKey::new(Some("bob"), key);
/// assert_ne!(alice.digest(), bob.digest());
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct RecordKey {
    scope: Option<Arc<str>>,
    key: IdempotencyKey,
    digest: [u8; 32],
}

impl RecordKey {
    /// The address of `key` within `scope` (`None`: the unscoped namespace, distinct from every scope).
    pub fn new(scope: Option<&str>, key: IdempotencyKey) -> Self {
        let mut hasher = Sha256::new();
        hasher.update(b"tower-idempotency/record-key/v1\0");
        match scope {
            // The length prefix keeps ("ab", "c") apart from ("a", "bc").
            Some(scope) => {
                hasher.update([1]);
                hasher.update((scope.len() as u64).to_be_bytes());
                hasher.update(scope.as_bytes());
            }
            None => hasher.update([0]),
        }
        hasher.update(key.as_str().as_bytes());
        Self {
            scope: scope.map(Arc::from),
            key,
            digest: hasher.finalize().into(),
        }
    }

    /// The scope, if any.
    pub fn scope(&self) -> Option<&str> {
        self.scope.as_deref()
    }

    /// The client's key.
    pub fn key(&self) -> &IdempotencyKey {
        &self.key
    }

    /// The SHA-256 digest stores use as the record's address.
    pub fn digest(&self) -> &[u8; 32] {
        &self.digest
    }

    /// The digest in lower-case hex.
    pub fn digest_hex(&self) -> String {
        hex(&self.digest)
    }
}

/// What logs show of a record key, as the request span does: `key`, the first 16 hex digits of
/// the record's digest (which names the record in the store), and `scope`, those of a hash of
/// the scope alone, so a tenant's lines can be grouped. Never the raw key or scope: a key may
/// be guessable, a scope may name a tenant. [`key`](Self::key) and [`scope`](Self::scope)
/// give them to code that needs them.
///
/// ```
/// use tower_idempotency::{IdempotencyKey, RecordKey};
///
/// let key = RecordKey::new(Some("tenant-7"), IdempotencyKey::parse("order-42").unwrap());
/// let logged = format!("{key:?}");
/// assert!(logged.contains(&key.digest_hex()[..16]));
/// assert!(!logged.contains("order-42") && !logged.contains("tenant-7"));
/// ```
impl fmt::Debug for RecordKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (mut key, mut scope) = ([0u8; 16], [0u8; 16]);
        let mut debug = f.debug_struct("RecordKey");
        debug.field("key", &short_hex(&self.digest, &mut key));
        match self.scope() {
            Some(name) => debug.field("scope", &short_hex(&scope_digest(name), &mut scope)),
            None => debug.field("scope", &None::<&str>),
        };
        debug.finish()
    }
}

/// A SHA-256 of a scope alone, to group one tenant's log lines without naming the tenant.
pub(crate) fn scope_digest(scope: &str) -> [u8; 32] {
    Sha256::new()
        .chain_update(b"tower-idempotency/scope/v1\0")
        .chain_update(scope.as_bytes())
        .finalize()
        .into()
}

/// The first 8 bytes of `digest` in lower-case hex, written into `out`: what logs show of a
/// digest.
pub(crate) fn short_hex<'a>(digest: &[u8], out: &'a mut [u8; 16]) -> &'a str {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for (pair, byte) in out.chunks_exact_mut(2).zip(digest) {
        pair[0] = DIGITS[usize::from(byte >> 4)];
        pair[1] = DIGITS[usize::from(byte & 0xf)];
    }
    std::str::from_utf8(out).unwrap_or_default()
}

/// Hashes record digests (the keys of the memory store's and the replay cache's maps) by their
/// first 8 bytes, with the same randomly keyed SipHash as `HashMap`'s default. A digest is
/// uniformly spread already, so 8 of its bytes place it as well as all 32 do, at one SipHash
/// block instead of five (the default also hashes the length): on the memory store's fresh keys
/// that was 3% of the request's instructions. Keyed still, so a client choosing its keys cannot
/// aim them at one bucket: it would need many keys whose digests share their first 8 bytes,
/// 2^64 work per key.
#[derive(Clone, Debug, Default)]
pub(crate) struct DigestHashing(std::hash::RandomState);

impl std::hash::BuildHasher for DigestHashing {
    type Hasher = DigestHasher;

    fn build_hasher(&self) -> DigestHasher {
        DigestHasher(self.0.build_hasher())
    }
}

pub(crate) struct DigestHasher(std::hash::DefaultHasher);

impl std::hash::Hasher for DigestHasher {
    /// A `[u8; 32]` hashes as its length, then its bytes: the length is the same for every key.
    fn write_usize(&mut self, _length: usize) {}

    fn write(&mut self, bytes: &[u8]) {
        self.0.write(&bytes[..bytes.len().min(8)]);
    }

    fn finish(&self) -> u64 {
        self.0.finish()
    }
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len() * 2);
    push_hex(&mut out, bytes);
    out
}

/// Appends `bytes` in lower-case hex, for callers that build a larger string in one allocation.
pub(crate) fn push_hex(out: &mut String, bytes: &[u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for byte in bytes {
        out.push(DIGITS[usize::from(byte >> 4)] as char);
        out.push(DIGITS[usize::from(byte & 0xf)] as char);
    }
}

/// The fuzz target's check of one header value as a key (`fuzz/fuzz_targets/key.rs`, and
/// `tests/fuzz_corpora.rs` on every checked-in input): a key accepted is 1 to [`MAX_KEY_LEN`]
/// visible ASCII characters; a bare value is accepted exactly when it is such a string, and
/// then is the key as sent; the key written as a Structured Field string names the same key,
/// and, if it does not start with `"`, so does its bare form.
#[cfg(any(test, feature = "fuzzing"))]
pub(crate) fn check(data: &[u8]) {
    let visible = |bytes: &[u8]| {
        (1..=MAX_KEY_LEN).contains(&bytes.len()) && bytes.iter().all(|b| (0x21..=0x7e).contains(b))
    };
    let parsed = IdempotencyKey::parse_bytes(data);
    if data.first() != Some(&b'"') {
        assert_eq!(parsed.is_ok(), visible(data), "a bare key {data:?}: {parsed:?}");
    }
    let Ok(key) = parsed else {
        return;
    };
    let text = key.as_str().as_bytes();
    assert!(visible(text));
    if data.first() != Some(&b'"') {
        assert_eq!(text, data);
    }
    if text[0] != b'"' {
        assert_eq!(IdempotencyKey::parse_bytes(text).as_ref(), Ok(&key));
    }
    let mut quoted = vec![b'"'];
    for &byte in text {
        if byte == b'"' || byte == b'\\' {
            quoted.push(b'\\');
        }
        quoted.push(byte);
    }
    quoted.push(b'"');
    assert_eq!(IdempotencyKey::parse_bytes(&quoted), Ok(key));
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Digests are told apart by all 32 bytes, though placed by their first 8; keys placed
    /// alike (the case no client can bring about on purpose) are still found, each as itself.
    #[test]
    fn digests_are_hashed_by_their_first_bytes_and_compared_whole() {
        use std::hash::BuildHasher;
        let hashing = DigestHashing::default();
        let digest = |first: u8, last: u8| {
            let mut digest = [7u8; 32];
            digest[0] = first;
            digest[31] = last;
            digest
        };
        assert_eq!(hashing.hash_one(digest(1, 1)), hashing.hash_one(digest(1, 2)));
        assert_ne!(hashing.hash_one(digest(1, 1)), hashing.hash_one(digest(2, 1)));
        assert_ne!(
            hashing.hash_one(digest(1, 1)),
            DigestHashing::default().hash_one(digest(1, 1)),
            "keyed per map"
        );
        let mut map: std::collections::HashMap<[u8; 32], usize, DigestHashing> = Default::default();
        for last in 0..=255u8 {
            map.insert(digest(1, last), usize::from(last));
        }
        for last in 0..=255u8 {
            map.insert(digest(last, 0), 1000 + usize::from(last));
        }
        assert_eq!(map.len(), 511);
        assert_eq!(map.get(&digest(1, 200)), Some(&200));
        assert_eq!(map.get(&digest(200, 0)), Some(&1200));
        assert_eq!(map.get(&digest(1, 0)), Some(&1001));
        assert_eq!(map.get(&[0u8; 32]), None);
    }

    #[test]
    fn invalid_keys_are_refused() {
        // A bad byte, or one too many: `other_keys_are_refused_where_they_go_wrong`; here, what
        // the property does not draw.
        assert_eq!(IdempotencyKey::parse(""), Err(KeyError::Empty));
        assert_eq!(IdempotencyKey::parse("\"\""), Err(KeyError::Empty));
        assert!(matches!(
            IdempotencyKey::parse("\"a b\""),
            Err(KeyError::InvalidCharacter { .. })
        ));
        assert_eq!(
            IdempotencyKey::parse("\"abc"),
            Err(KeyError::MalformedStructuredField)
        );
        assert_eq!(
            IdempotencyKey::parse("\"abc\" trailing"),
            Err(KeyError::MalformedStructuredField)
        );
    }

    use proptest::prelude::*;

    /// A key's text written as a Structured Field string.
    fn quoted(text: &str) -> String {
        format!("\"{}\"", text.replace('\\', "\\\\").replace('"', "\\\""))
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Every string of 1 to 255 visible ASCII characters is a key, as sent (but for a
        /// leading `"`, which starts a Structured Field string); quoted (with parameters or
        /// not) it names the same key.
        #[test]
        fn visible_ascii_keys_round_trip(text in "[!-~&&[^\"]][!-~]{0,254}", params in "(;[a-z][a-z0-9]{0,4}=[0-9]{1,3}){0,2}") {
            let key = IdempotencyKey::parse(&text).unwrap();
            prop_assert_eq!(key.as_str(), text.as_str());
            prop_assert_eq!(IdempotencyKey::parse(&format!("{}{params}", quoted(&text))), Ok(key));
            check(text.as_bytes());
        }

        /// A byte outside visible ASCII is refused at its first position, bare or quoted; too
        /// long is refused with its length; never a key that differs from what was sent.
        #[test]
        fn other_keys_are_refused_where_they_go_wrong(
            before in "[!-~&&[^\"]][!-~]{0,20}",
            bad in prop_oneof![0u8..0x21, 0x7fu8..=0xff],
            after in "[!-~]{0,20}",
            long in 256usize..400,
        ) {
            let mut value = before.clone().into_bytes();
            value.push(bad);
            value.extend_from_slice(after.as_bytes());
            prop_assert_eq!(
                IdempotencyKey::parse_bytes(&value),
                Err(KeyError::InvalidCharacter { position: before.len() })
            );
            prop_assert_eq!(IdempotencyKey::parse(&"k".repeat(long)), Err(KeyError::TooLong { len: long }));
            prop_assert_eq!(IdempotencyKey::parse(&quoted(&"k".repeat(long))), Err(KeyError::TooLong { len: long }));
            check(&value);
        }

        /// Any bytes at all, and any bytes quoted: the fuzz check (no panic; an accepted key
        /// is visible ASCII, bare as sent, quoted the same key).
        #[test]
        fn any_bytes_pass_the_fuzz_check(data in proptest::collection::vec(any::<u8>(), 0..300), text in "\"[ -~]{0,30}\"(;[a-z]=[0-9?])?") {
            check(&data);
            check(text.as_bytes());
        }

        /// Two record keys share a digest only if scope and key are the same: no choice of
        /// characters moves a record from one scope to another.
        #[test]
        fn record_keys_share_a_digest_only_when_equal(
            a in proptest::option::of("[a-c]{0,3}"), b in proptest::option::of("[a-c]{0,3}"),
            k in "[a-c]{1,3}", l in "[a-c]{1,3}",
        ) {
            let one = RecordKey::new(a.as_deref(), IdempotencyKey::parse(&k).unwrap());
            let two = RecordKey::new(b.as_deref(), IdempotencyKey::parse(&l).unwrap());
            prop_assert_eq!(one.digest() == two.digest(), (a, k) == (b, l));
            prop_assert_eq!(one.digest_hex().len(), 64);
        }
    }
}
