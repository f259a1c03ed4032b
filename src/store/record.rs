//! What a record is: its states and layout version, what reading one answers, the owner token
//! that guards it, and the rule for records a newer release wrote.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;

#[cfg(any(feature = "redis", feature = "postgres"))]
use super::error::StoreError;
use crate::fingerprint::{Fingerprint, PolicyTag};
#[cfg(any(feature = "redis", feature = "postgres"))]
use crate::key::RecordKey;

/// The version of the record layout. A record in a newer layout (written by a newer release,
/// during a rolling upgrade) is answered like one in flight, to be retried, for the first 15
/// minutes after its claim (the age its owner token carries); after that, or when its age is
/// unknown, it is reported as [`StoreError::Corrupt`] (500 `UnreadableRecord`, an error
/// logged): that is no longer an upgrade under way but a rollback, and retries would otherwise
/// be told "in flight" until the record's retention ends. One in an unknown layout is reported
/// as [`StoreError::Corrupt`], never read as if it were ours. Within a record, the stored
/// response has a layout version of its own, read the same way: this release reads the
/// previous release's responses.
///
/// Every later layout keeps the first bytes of this one (Redis: `TIR`, the version, the owner's
/// length and the owner; PostgreSQL: the `version` and `owner` columns), so that this release
/// can read a newer record's age; a release that changes the stored response's layout changes
/// this version too.
///
/// ```
/// assert_eq!(tower_idempotency::RECORD_VERSION, 3);
/// ```
///
/// Layout 3 added the fingerprint's [`PolicyTag`] (8 bytes; Redis: after the fingerprint;
/// PostgreSQL: in the `fingerprint` column, after the digest). This release reads layout 2's
/// records too, as records without a tag.
pub const RECORD_VERSION: u32 = 3;

/// The layout before policy tags, which this release still reads (its records have none).
#[cfg(any(feature = "redis", feature = "postgres"))]
pub(crate) const UNTAGGED_RECORD_VERSION: u32 = 2;

/// What a claim found; see [`Store::claim`](crate::Store::claim) for an example.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimOutcome {
    /// The caller now owns the key and should run the operation.
    Claimed,
    /// The operation ran before; here is its stored payload.
    Completed(Bytes),
    /// Another owner is running the operation; its lease ends in this much time.
    InFlight {
        /// Time left on the current owner's lease.
        lease_left: Duration,
    },
    /// The key was used with a different fingerprint.
    Mismatch,
    /// The key was used with a different fingerprint, made under another fingerprint policy:
    /// both fingerprints carry a [`PolicyTag`] and the tags differ (the endpoint's policy
    /// changed since the record was stored, or the key was used on an endpoint with another
    /// policy). The two requests cannot be compared; the stored one is never replayed.
    PolicyMismatch,
}

impl ClaimOutcome {
    /// What a store answers for a record whose fingerprint differs from `fingerprint`, the
    /// record's kept with the tag `stored`: [`PolicyMismatch`](Self::PolicyMismatch) when both
    /// carry a tag and the tags differ, else [`Mismatch`](Self::Mismatch) (a record stored
    /// without a tag, by an earlier release, stays a plain mismatch).
    ///
    /// ```
    /// use tower_idempotency::{ClaimOutcome, Fingerprint, PolicyTag};
    /// let v1 = PolicyTag::new([b"v1".as_slice()]);
    /// let v2 = PolicyTag::new([b"v2".as_slice()]);
    /// let request = Fingerprint::new([b"body".as_slice()]).with_policy(v2);
    /// assert_eq!(ClaimOutcome::mismatch(&request, Some(v1)), ClaimOutcome::PolicyMismatch);
    /// assert_eq!(ClaimOutcome::mismatch(&request, Some(v2)), ClaimOutcome::Mismatch);
    /// assert_eq!(ClaimOutcome::mismatch(&request, None), ClaimOutcome::Mismatch);
    /// ```
    pub fn mismatch(fingerprint: &Fingerprint, stored: Option<PolicyTag>) -> Self {
        if fingerprint.policy_differs(stored) {
            Self::PolicyMismatch
        } else {
            Self::Mismatch
        }
    }
}

/// The state of a record, for operators.
///
/// ```
/// use tower_idempotency::RecordState;
/// assert_ne!(RecordState::InFlight, RecordState::Completed);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordState {
    /// Claimed, operation running.
    InFlight,
    /// Completed; the payload is kept until retention ends.
    Completed,
}

/// A record as [`Store::inspect`](crate::Store::inspect) sees it.
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::{RecordInfo, RecordState};
/// let info = RecordInfo::new(RecordState::InFlight, Duration::from_secs(12), None);
/// assert_eq!(info.state, RecordState::InFlight);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RecordInfo {
    /// In flight or completed.
    pub state: RecordState,
    /// Lease left (in flight) or retention left (completed).
    pub expires_in: Duration,
    /// The stored payload of a completed record.
    pub payload: Option<Bytes>,
    /// The claim's owner, for a record in flight whose store says (every store of this crate
    /// does): an operator about to purge a running request sees whose it is.
    pub owner: Option<OwnerToken>,
}

impl RecordInfo {
    /// A record description; for custom [`Store`](crate::Store) implementations.
    pub fn new(state: RecordState, expires_in: Duration, payload: Option<Bytes>) -> Self {
        Self {
            state,
            expires_in,
            payload,
            owner: None,
        }
    }

    /// The same, naming the claim's owner (default: none).
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::{OwnerToken, RecordInfo, RecordState};
    /// let owner = OwnerToken::generate();
    /// let info = RecordInfo::new(RecordState::InFlight, Duration::from_secs(12), None).with_owner(owner.clone());
    /// assert_eq!(info.owner, Some(owner));
    /// ```
    pub fn with_owner(mut self, owner: OwnerToken) -> Self {
        self.owner = Some(owner);
        self
    }
}

/// A record in flight as [`Store::in_flight`](crate::Store::in_flight) lists it: its address, its owner, how long ago it
/// was claimed and how much of its lease is left. Never the idempotency key or the scope, which
/// may hold personal data: stores keep only their digest.
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::{InFlightRecord, OwnerToken};
/// let record = InFlightRecord::new([7; 32], OwnerToken::generate(), Duration::from_secs(20));
/// assert!(record.age.is_some_and(|age| age < Duration::from_secs(5)), "claimed just now");
/// assert_eq!(record.digest_hex().len(), 64);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct InFlightRecord {
    /// The record's address, the SHA-256 of its scope and key ([`RecordKey::digest`]).
    pub digest: [u8; 32],
    /// The claim's owner. Tokens made by one process share their first 32 characters, so the
    /// records of one stuck or crashed instance can be told apart from the others'.
    pub owner: OwnerToken,
    /// How long ago the record was claimed (from [`OwnerToken::issued_at`]), by the clock of
    /// the instance that claimed it against this process's; `None` when the token carries no
    /// time.
    pub age: Option<Duration>,
    /// Time left on the lease (renewed while the owner runs).
    pub lease_left: Duration,
}

impl InFlightRecord {
    /// A listed record, its age read from `owner`'s token; for custom [`Store`](crate::Store) implementations.
    pub fn new(digest: [u8; 32], owner: OwnerToken, lease_left: Duration) -> Self {
        Self::at(std::time::SystemTime::now(), digest, owner, lease_left)
    }

    /// [`new`](Self::new), its age counted to `now`: one `now` for a whole listing, so that
    /// records claimed together show the same age however long the listing takes.
    pub(crate) fn at(
        now: std::time::SystemTime,
        digest: [u8; 32],
        owner: OwnerToken,
        lease_left: Duration,
    ) -> Self {
        let age = token_age(owner.as_str(), now);
        Self {
            digest,
            owner,
            age,
            lease_left,
        }
    }

    /// The digest in lower-case hex, as `RedisStore` names its keys and an operator reads it.
    pub fn digest_hex(&self) -> String {
        crate::key::hex(&self.digest)
    }

    /// Whether a listing for records at least `older_than` old shows this one: a record of
    /// unknown age is always shown, since it may be the oldest.
    pub(crate) fn is_older_than(&self, older_than: Duration) -> bool {
        self.age.is_none_or(|age| age >= older_than)
    }
}

/// The `limit` oldest of the records gathered so far, for [`Store::in_flight`]: memory stays
/// bounded by twice the limit however many records a store holds.
pub(crate) struct Oldest {
    older_than: Duration,
    limit: usize,
    /// When the listing started: every age is counted to it.
    now: std::time::SystemTime,
    records: Vec<InFlightRecord>,
}

impl Oldest {
    pub(crate) fn new(older_than: Duration, limit: usize) -> Self {
        Self {
            older_than,
            limit,
            now: std::time::SystemTime::now(),
            records: Vec::new(),
        }
    }

    /// Keeps the record of `owner` at `digest` if it is old enough and among the oldest so far.
    pub(crate) fn offer(&mut self, digest: [u8; 32], owner: OwnerToken, lease_left: Duration) {
        let record = InFlightRecord::at(self.now, digest, owner, lease_left);
        if self.limit == 0 || !record.is_older_than(self.older_than) {
            return;
        }
        self.records.push(record);
        if self.records.len() >= self.limit.saturating_mul(2) {
            self.trim();
        }
    }

    fn trim(&mut self) {
        // Unknown ages first (possibly the oldest), then by age; the digest makes the order total.
        self.records.sort_by(|a, b| {
            let age = |r: &InFlightRecord| r.age.unwrap_or(Duration::MAX);
            age(b).cmp(&age(a)).then_with(|| a.digest.cmp(&b.digest))
        });
        self.records.truncate(self.limit);
    }

    /// The oldest first.
    pub(crate) fn into_vec(mut self) -> Vec<InFlightRecord> {
        self.trim();
        self.records
    }
}

/// A unique token naming one claim's owner. Completion, release and renewal must present it.
///
/// Tokens are a per-process random prefix, a counter and the time they were made:
/// `<32 hex digits>-<counter in hex>@<milliseconds since the Unix epoch>`. The prefix and the
/// counter make them unique across processes; the time, stored with the claim as part of the
/// token, tells operators how long a record has been in flight ([`Store::in_flight`](crate::Store::in_flight)) without
/// a field of its own in any store's record layout, so records stay readable by the previous
/// release. Making one reads the wall clock (no system call where the clock is in the vDSO).
///
/// ```
/// use tower_idempotency::OwnerToken;
/// assert_ne!(OwnerToken::generate(), OwnerToken::generate());
/// assert!(OwnerToken::generate().issued_at().is_some());
/// ```
// An `Arc`: the memory store keeps a clone in the record it claims for the token's holder, and
// the coordinator hands clones to releases and renewals; each is then a count, not a copy.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub struct OwnerToken(Arc<str>);

impl OwnerToken {
    /// A new token, different from every other token of this and any other process.
    pub fn generate() -> Self {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let millis = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        Self(token_text(process_nonce(), n, millis))
    }

    /// Wraps an existing token, for custom stores and tests. A token ending in `@` and a number
    /// is read as made at that many milliseconds since the Unix epoch ([`issued_at`](Self::issued_at)).
    ///
    /// ```
    /// use std::time::{Duration, UNIX_EPOCH};
    /// use tower_idempotency::OwnerToken;
    /// let token = OwnerToken::from_string("worker-1@1700000000000");
    /// assert_eq!(token.issued_at(), Some(UNIX_EPOCH + Duration::from_secs(1_700_000_000)));
    /// assert_eq!(OwnerToken::from_string("worker-1").issued_at(), None);
    /// ```
    pub fn from_string(token: impl Into<String>) -> Self {
        Self(Arc::from(token.into()))
    }

    /// The token's text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// When the token was made, by the clock of the process that made it: the claim's start,
    /// for a token from [`generate`](Self::generate). `None` for a token that does not end in
    /// `@<milliseconds since the Unix epoch>`.
    pub fn issued_at(&self) -> Option<std::time::SystemTime> {
        token_issued_at(&self.0)
    }
}

/// When the owner token `token` was made, if it says.
fn token_issued_at(token: &str) -> Option<std::time::SystemTime> {
    let (_, millis) = token.rsplit_once('@')?;
    if millis.is_empty() || !millis.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let millis: u64 = millis.parse().ok()?;
    std::time::UNIX_EPOCH.checked_add(std::time::Duration::from_millis(millis))
}

/// How long before `now` the owner token `token` was made, if it says (zero if after `now`).
fn token_age(token: &str, now: std::time::SystemTime) -> Option<Duration> {
    Some(now.duration_since(token_issued_at(token)?).unwrap_or_default())
}

/// How long after its claim a record in a newer layout is taken for a rolling upgrade under way,
/// and answered "in flight, retry in a second" (an instance of the newer release can replay it).
/// Past it, the newer release is taken to be gone (rolled back), and the record is reported
/// unreadable: a client retrying it would otherwise loop on 409 until its retention ends.
#[cfg(any(feature = "redis", feature = "postgres"))]
pub(crate) const NEWER_RECORD_WINDOW: Duration = Duration::from_secs(15 * 60);

/// What a claim (or a peek) answers for a record in layout `version`, newer than this release's,
/// whose owner token is `owner`: see [`RECORD_VERSION`].
#[cfg(any(feature = "redis", feature = "postgres"))]
pub(crate) fn newer_record(
    key: &RecordKey,
    version: u32,
    owner: &[u8],
    lease: Duration,
) -> Result<ClaimOutcome, StoreError> {
    let age = std::str::from_utf8(owner)
        .ok()
        .and_then(|owner| token_age(owner, std::time::SystemTime::now()));
    match age {
        Some(age) if age < NEWER_RECORD_WINDOW => {
            // A rolling upgrade is under way: retry later (on an instance of that release, or
            // once this one is upgraded), never "corrupt".
            tracing::info!(
                ?key,
                version,
                "record written by a newer release; answering as if in flight"
            );
            Ok(ClaimOutcome::InFlight {
                lease_left: Duration::from_secs(1).min(lease),
            })
        }
        _ => Err(StoreError::Corrupt(format!(
            "a record in layout version {version}, claimed by a newer release {}; past the 15 minutes \
             of a rolling upgrade this release no longer answers it as in flight: roll forward to \
             that release, or purge the key (docs/guarantees.md, \"Rolling back\")",
            match age {
                Some(age) => format!("{} s ago", age.as_secs()),
                None => "at an unknown time".to_owned(),
            }
        ))),
    }
}

/// `<nonce>-<n in hex>@<millis in decimal>`, built at its exact length: one allocation per claim.
/// The digits are written back to front into a buffer, one division by a constant each: every
/// keyed request that reaches a claim makes a token, a replay from Redis included (a replay
/// answered by [`Store::cached`] makes none).
fn token_text(nonce: &str, n: u64, millis: u64) -> Arc<str> {
    // "-", 16 hex digits, "@", 20 decimal digits.
    let mut tail = [0u8; 38];
    let at = digits_before::<10>(&mut tail, 38, millis, b'@');
    let at = digits_before::<16>(&mut tail, at, n, b'-');
    // The whole token on the stack first (the nonce is 32 digits), so that the `Arc` is the one
    // allocation.
    let mut text = [0u8; NONCE_LEN + 38];
    let len = nonce.len() + tail.len() - at;
    let Some(whole) = text.get_mut(..len) else {
        return Arc::from(format!("{nonce}{}", String::from_utf8_lossy(&tail[at..])));
    };
    let (head, rest) = whole.split_at_mut(nonce.len());
    head.copy_from_slice(nonce.as_bytes());
    rest.copy_from_slice(&tail[at..]);
    // ASCII only, so always UTF-8: this is the check (`from_utf8` takes its ASCII path, where
    // `from_utf8_lossy` walked the bytes in chunks for a third of this function's cost).
    match std::str::from_utf8(whole) {
        Ok(text) => Arc::from(text),
        Err(_) => Arc::from(&*String::from_utf8_lossy(whole)),
    }
}

/// Writes `value`'s digits in base `RADIX` (10 or 16) into `buf` back to front, ending before
/// `at`, then `mark` before them; answers where `mark` is.
fn digits_before<const RADIX: u64>(buf: &mut [u8], mut at: usize, mut value: u64, mark: u8) -> usize {
    loop {
        at -= 1;
        buf[at] = b"0123456789abcdef"[(value % RADIX) as usize];
        value /= RADIX;
        if value == 0 {
            break;
        }
    }
    at -= 1;
    buf[at] = mark;
    at
}

/// The length of [`process_nonce`]: 128 bits in hex.
const NONCE_LEN: usize = 32;

/// 128 bits that differ between processes. `RandomState` is seeded from the operating system's
/// random source, so this needs no extra dependency.
fn process_nonce() -> &'static str {
    static NONCE: OnceLock<String> = OnceLock::new();
    NONCE.get_or_init(|| {
        use std::hash::{BuildHasher, Hasher};
        let half = |salt: u64| {
            let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
            hasher.write_u64(salt);
            hasher.write_u32(std::process::id());
            hasher.finish()
        };
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or_default();
        format!("{:016x}{:016x}", half(nanos), half(!nanos))
    })
}

#[cfg(test)]
mod tests {
    use super::OwnerToken;
    use std::time::{Duration, SystemTime, UNIX_EPOCH};

    #[test]
    fn owner_tokens_are_the_nonce_the_counter_in_hex_and_the_time() {
        // A short nonce, the real one, and one longer than the stack buffer is made for.
        let long = "n".repeat(super::NONCE_LEN + 1);
        for nonce in ["nonce", super::process_nonce(), &long] {
            for n in [0, 9, 0xf, 0x10, 0xabc, u64::MAX] {
                for millis in [0, 7, 10, 1_763_807_554_123, u64::MAX] {
                    let token = super::token_text(nonce, n, millis);
                    assert_eq!(&*token, format!("{nonce}-{n:x}@{millis}"));
                    let issued = OwnerToken::from_string(&*token).issued_at();
                    let expected = UNIX_EPOCH.checked_add(Duration::from_millis(millis));
                    assert_eq!(issued, expected, "{n} {millis}");
                }
            }
        }
        assert_eq!(super::process_nonce().len(), super::NONCE_LEN);
    }

    #[test]
    fn a_generated_token_was_issued_now() {
        let before = SystemTime::now() - Duration::from_millis(1);
        let issued = OwnerToken::generate().issued_at().expect("a time");
        assert!(issued >= before && issued <= SystemTime::now(), "{issued:?}");
    }

    #[test]
    fn tokens_without_a_time_have_none() {
        for token in [
            "",
            "a",
            "a@",
            "a@b",
            "a@-1",
            "a@+5",
            "a@1.5",
            "a@99999999999999999999999",
        ] {
            assert_eq!(OwnerToken::from_string(token).issued_at(), None, "{token}");
        }
    }
}
