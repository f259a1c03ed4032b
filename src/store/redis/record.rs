//! The record layout: one Redis string.
//!
//! ```text
//! "TIR" version(u8) | owner length (u16 BE) | owner | state: 'F' in flight, 'C' completed
//!   | deadline (u64 BE, ms since the Unix epoch) | fingerprint (32 bytes)
//!   | policy tag (8 bytes, zeros for none) | payload
//! ```
//!
//! Layout 2, before policy tags, had no tag: this release reads its records (as untagged) and
//! writes none.
//!
//! The head (through the owner) is what the scripts compare, with the state byte after it, to
//! check ownership. The deadline is the lease's end in flight and the retention's end once
//! completed; the state and the deadline are rewritten together. The payload is appended on
//! completion, so a replay is a slice of the bytes `SET … GET` hands back.
//!
//! An in-flight deadline's lowest bit is the *waited* mark: an owner writes its deadline even
//! (the lease's end rounded down to an even millisecond), and a request that waits for the
//! record sets the bit with each of its reads (`wait.lua`, [`Store::claim_waiting`]), so that
//! the record's completion or release tells the waiting requests (`SPUBLISH`, see `notices`)
//! and no other completion pays for the notice. A renewal keeps the mark. A reader of any
//! release sees a marked lease end 1 ms later.
//!
//! [`Store::claim_waiting`]: crate::Store::claim_waiting

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::{BufMut, Bytes, BytesMut};

use crate::fingerprint::{Fingerprint, PolicyTag};
use crate::store::error::StoreError;
use crate::store::record::{OwnerToken, RECORD_VERSION, UNTAGGED_RECORD_VERSION};

const MAGIC: &[u8; 3] = b"TIR";
pub(super) const IN_FLIGHT: u8 = b'F';
pub(super) const COMPLETED: u8 = b'C';

/// The bytes through the owner: what only this claim's record starts with.
pub(super) fn head(owner: &OwnerToken) -> Result<Bytes, StoreError> {
    let owner = owner.as_str().as_bytes();
    let len = u16::try_from(owner.len())
        .map_err(|_| StoreError::Unavailable("an owner token longer than 65 535 bytes".into()))?;
    let mut head = BytesMut::with_capacity(6 + owner.len());
    head.put_slice(MAGIC);
    head.put_u8(RECORD_VERSION as u8);
    head.put_u16(len);
    head.put_slice(owner);
    Ok(head.freeze())
}

/// A state byte and the deadline `from_now` away, as the scripts write them after the head.
pub(super) fn state_until(state: u8, from_now: Duration) -> Bytes {
    state_at(state, SystemTime::now() + from_now)
}

/// A state byte and the deadline `at`, in milliseconds since the Unix epoch; in flight, even
/// (without the [`WAITED`] mark).
fn state_at(state: u8, at: SystemTime) -> Bytes {
    let millis = at.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis());
    let mut millis = u64::try_from(millis).unwrap_or(u64::MAX);
    if state == IN_FLIGHT {
        millis &= !u64::from(WAITED);
    }
    let mut bytes = BytesMut::with_capacity(9);
    bytes.put_u8(state);
    bytes.put_u64(millis);
    bytes.freeze()
}

/// The waited mark: the lowest bit of an in-flight record's deadline (its last byte).
pub(super) const WAITED: u8 = 1;

/// Whether `record`, whose head is `head_len` bytes long, is in flight and marked as waited
/// for: its completion or release is to tell the waiting requests.
#[cfg(any(test, feature = "fuzzing"))]
pub(super) fn is_waited(record: &[u8], head_len: usize) -> bool {
    record.get(head_len) == Some(&IN_FLIGHT)
        && record.get(head_len + 8).is_some_and(|last| last & WAITED != 0)
}

/// `state` (a state byte and a deadline, [`state_until`]) with the waited mark of `record` (in
/// flight, its head `head_len` bytes long) carried over, as `renew.lua` keeps the mark.
#[cfg(any(test, feature = "fuzzing"))]
pub(super) fn keeping_mark(state: &Bytes, record: &[u8], head_len: usize) -> Bytes {
    if !is_waited(record, head_len) || state.len() != 9 {
        return state.clone();
    }
    let mut marked = BytesMut::from(&state[..]);
    marked[8] |= WAITED;
    marked.freeze()
}

/// The layout's magic and version, the first 4 bytes of every record this release writes:
/// what `wait.lua` checks before it reads a record's owner length.
pub(super) const LAYOUT_PREFIX: [u8; 4] = [MAGIC[0], MAGIC[1], MAGIC[2], RECORD_VERSION as u8];

/// The first 4 bytes of a record of layout 2 (an earlier release's, without a policy tag), whose
/// head, state and deadline are where this layout has them: a waiter marks it too, and a purge
/// reads its owner.
pub(super) const UNTAGGED_LAYOUT_PREFIX: [u8; 4] =
    [MAGIC[0], MAGIC[1], MAGIC[2], UNTAGGED_RECORD_VERSION as u8];

/// What follows the deadline in every record this release writes, before the payload: the
/// fingerprint and its policy tag.
pub(super) const FINGERPRINT_LEN: usize = 32 + 8;

/// The bytes after the deadline, before the payload, in a record of layout `version` (2 or 3).
fn fingerprint_len(version: u8) -> usize {
    if u32::from(version) == UNTAGGED_RECORD_VERSION {
        32
    } else {
        FINGERPRINT_LEN
    }
}

/// A new in-flight record.
pub(super) fn in_flight(
    owner: &OwnerToken,
    fingerprint: &Fingerprint,
    lease: Duration,
) -> Result<Bytes, StoreError> {
    in_flight_until(owner, fingerprint, SystemTime::now() + lease)
}

/// A new in-flight record whose lease ends at `deadline`.
fn in_flight_until(
    owner: &OwnerToken,
    fingerprint: &Fingerprint,
    deadline: SystemTime,
) -> Result<Bytes, StoreError> {
    let head = head(owner)?;
    let mut record = BytesMut::with_capacity(head.len() + 9 + FINGERPRINT_LEN);
    record.put_slice(&head);
    record.put_slice(&state_at(IN_FLIGHT, deadline));
    record.put_slice(fingerprint.as_bytes());
    record.put_slice(&PolicyTag::stored(fingerprint.policy()));
    Ok(record.freeze())
}

/// A record as read back.
pub(super) struct Parsed {
    pub(super) state: u8,
    pub(super) owner: Bytes,
    pub(super) fingerprint: [u8; 32],
    /// The policy the fingerprint was made under, if the record says.
    pub(super) policy: Option<PolicyTag>,
    /// Time to the deadline by this instance's clock: lease left (in flight) or retention
    /// left (completed).
    pub(super) time_left: Duration,
    pub(super) payload: Bytes,
}

impl Parsed {
    /// The stored fingerprint, with its policy tag if the record has one.
    pub(super) fn stored_fingerprint(&self) -> Fingerprint {
        let digest = Fingerprint::from_digest(self.fingerprint);
        self.policy.map_or(digest, |policy| digest.with_policy(policy))
    }
}

/// The layout version of a record written by a newer release than this one, if it is one.
pub(super) fn newer_version(record: &Bytes) -> Option<u8> {
    let version = *record.strip_prefix(MAGIC)?.first()?;
    (u32::from(version) > RECORD_VERSION).then_some(version)
}

/// The owner of a record of any layout (every layout starts as this one does), if the
/// record holds one.
pub(super) fn owner(record: &Bytes) -> Option<&[u8]> {
    let len = usize::from(u16::from_be_bytes([*record.get(4)?, *record.get(5)?]));
    record.get(6..6 + len)
}

/// The state, owner and deadline of a record: what a listing needs, readable from the
/// record's first [`head_len`] bytes.
pub(super) struct Head {
    pub(super) version: u8,
    pub(super) state: u8,
    pub(super) owner: Bytes,
    /// Time to the deadline by this instance's clock.
    pub(super) time_left: Duration,
}

/// How many bytes of a record [`parse_head`] needs, read from its first 6 (`None` when
/// `start` is shorter than that).
pub(super) fn head_len(start: &[u8]) -> Option<usize> {
    let owner_len = usize::from(u16::from_be_bytes([*start.get(4)?, *start.get(5)?]));
    Some(6 + owner_len + 9)
}

pub(super) fn parse_head(record: &Bytes) -> Result<Head, String> {
    parse_head_at(record, SystemTime::now())
}

/// [`parse_head`], its time left counted from `now`.
fn parse_head_at(record: &Bytes, now: SystemTime) -> Result<Head, String> {
    let take = |at: usize, len: usize| {
        record
            .get(at..at + len)
            .ok_or_else(|| "a truncated record".to_string())
    };
    if take(0, 3)? != MAGIC {
        return Err("the key holds a string that is not a record".into());
    }
    let version = take(3, 1)?[0];
    if u32::from(version) != RECORD_VERSION && u32::from(version) != UNTAGGED_RECORD_VERSION {
        return Err(format!(
            "record layout version {version}, this version reads {UNTAGGED_RECORD_VERSION} and {RECORD_VERSION}"
        ));
    }
    let owner_len = usize::from(u16::from_be_bytes([take(4, 1)?[0], take(5, 1)?[0]]));
    take(6, owner_len)?;
    let owner = record.slice(6..6 + owner_len);
    let at = 6 + owner_len;
    let state = take(at, 1)?[0];
    if state != IN_FLIGHT && state != COMPLETED {
        return Err("unknown record state".into());
    }
    let mut deadline = [0; 8];
    deadline.copy_from_slice(take(at + 1, 8)?);
    let deadline = UNIX_EPOCH + Duration::from_millis(u64::from_be_bytes(deadline));
    // Another instance's clock set the deadline: a skew shifts `Retry-After` and how long a
    // replay cache keeps a copy, never the record's own expiry (Redis's TTL).
    let time_left = deadline.duration_since(now).unwrap_or_default();
    Ok(Head {
        version,
        state,
        owner,
        time_left,
    })
}

pub(super) fn parse(record: &Bytes) -> Result<Parsed, String> {
    parse_at(record, SystemTime::now())
}

/// [`parse`], its time left counted from `now`.
fn parse_at(record: &Bytes, now: SystemTime) -> Result<Parsed, String> {
    let Head {
        version,
        state,
        owner,
        time_left,
    } = parse_head_at(record, now)?;
    let at = 6 + owner.len() + 9;
    let len = fingerprint_len(version);
    let fixed = record
        .get(at..at + len)
        .ok_or_else(|| "a truncated record".to_string())?;
    let mut fingerprint = [0; 32];
    fingerprint.copy_from_slice(&fixed[..32]);
    let policy = (fixed.get(32..))
        .and_then(|tag| <[u8; 8]>::try_from(tag).ok())
        .and_then(PolicyTag::from_bytes);
    let payload = record.slice(at + len..);
    if state == IN_FLIGHT && !payload.is_empty() {
        return Err("an in-flight record with a payload".into());
    }
    Ok(Parsed {
        state,
        owner,
        fingerprint,
        policy,
        time_left,
        payload,
    })
}

/// The digest of a record key written in hex (a purge message, a key name after its prefix).
pub(super) fn digest_from_hex(hex: &[u8]) -> Option<[u8; 32]> {
    let mut digest = [0; 32];
    // `from_str_radix` takes a sign: without this, `+f` read as `0f`, and a key name that is
    // not a record's (`…:{+f+f…}`) was listed, and purged, as the record `0f0f…`.
    if hex.len() != 64 || !hex.iter().all(u8::is_ascii_hexdigit) {
        return None;
    }
    for (byte, pair) in digest.iter_mut().zip(hex.chunks(2)) {
        *byte = u8::from_str_radix(std::str::from_utf8(pair).ok()?, 16).ok()?;
    }
    Some(digest)
}

/// The fuzz target's check of one input as a record (`fuzz/fuzz_targets/redis_record.rs`, and
/// `tests/fuzz_corpora.rs` on every checked-in input): reading never panics, a record read is
/// exactly the bytes its fields encode to (through this file's encoders, a waiter's mark carried
/// over as a renewal carries it: [`keeping_mark`]), its head alone reads
/// the same, a truncated record never reads with other fields, a newer layout is never read as
/// this one, and a digest in hex reads back to the same hex. Answers the payload of a completed
/// record, for the caller to decode as a stored response.
#[cfg(any(test, feature = "fuzzing"))]
pub(crate) fn check(data: &[u8]) -> Option<Bytes> {
    if let Some(digest) = digest_from_hex(data) {
        assert_eq!(crate::key::hex(&digest).as_bytes(), data.to_ascii_lowercase());
    } else {
        assert!(data.len() != 64 || !data.iter().all(u8::is_ascii_hexdigit));
    }
    let record = Bytes::copy_from_slice(data);
    let parsed = parse_at(&record, UNIX_EPOCH);
    if newer_version(&record).is_some() {
        assert!(parsed.is_err(), "a newer layout read as this one");
    }
    let parsed = parsed.ok()?;
    let deadline = UNIX_EPOCH + parsed.time_left;
    // An owner writes its deadline without the waited mark, and `wait.lua` sets it on a valid
    // record: encoded again, the state keeps the mark the bytes carry (it was cleared here once,
    // and the fuzzer failed on every waited-for record within seconds).
    let state = keeping_mark(&state_at(parsed.state, deadline), data, 6 + parsed.owner.len());
    let tag = PolicyTag::stored(parsed.policy);
    // A record read has its layout's version at its fourth byte: 3, or 2 (no policy tag).
    let version = data[3];
    let tagged = u32::from(version) == RECORD_VERSION;
    let encoded: Vec<u8> = match std::str::from_utf8(&parsed.owner) {
        Ok(owner) if tagged => {
            let owner = OwnerToken::from_string(owner);
            let fresh = in_flight_until(&owner, &parsed.stored_fingerprint(), deadline).ok()?;
            let head_len = head(&owner).ok()?.len();
            // What the completion script makes of it: the state and deadline rewritten in
            // place, the payload appended.
            let mut record = fresh.to_vec();
            record[head_len..head_len + 9].copy_from_slice(&state);
            record.extend_from_slice(&parsed.payload);
            record
        }
        // An owner that is not UTF-8 (no token is), or an earlier release's layout (no tag).
        _ => {
            let owner_len = u16::try_from(parsed.owner.len()).ok()?;
            [
                &MAGIC[..],
                &[version],
                &owner_len.to_be_bytes(),
                &parsed.owner,
                &state,
                &parsed.fingerprint,
                if tagged { &tag[..] } else { &[] },
                &parsed.payload,
            ]
            .concat()
        }
    };
    assert_eq!(encoded, data, "a record read differs from its bytes");
    assert!(parsed.state == COMPLETED || parsed.payload.is_empty());
    assert_eq!(owner(&record), Some(&parsed.owner[..]));
    let needed = head_len(data).expect("a record has a head");
    let head = parse_head_at(&record.slice(..needed), UNIX_EPOCH).expect("its head reads");
    assert_eq!(
        (head.version, head.state, &head.owner, head.time_left),
        (version, parsed.state, &parsed.owner, parsed.time_left)
    );
    let fixed = needed + fingerprint_len(version);
    let fields = |p: &Parsed| (p.state, p.owner.clone(), p.fingerprint, p.policy, p.time_left);
    for cut in 0..data.len() {
        match parse_at(&record.slice(..cut), UNIX_EPOCH) {
            Err(_) => assert!(cut < fixed, "a record cut at {cut} of {} not read", data.len()),
            Ok(shorter) => {
                assert!(cut >= fixed && parsed.state == COMPLETED);
                assert_eq!(fields(&shorter), fields(&parsed));
                assert_eq!(shorter.payload, parsed.payload.slice(..cut - fixed));
            }
        }
    }
    (parsed.state == COMPLETED).then_some(parsed.payload)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn at(millis: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_millis(millis)
    }

    #[test]
    fn an_owner_writes_its_deadline_even_and_a_renewal_keeps_a_waiters_mark() {
        let owner = OwnerToken::generate();
        let fingerprint = Fingerprint::new([b"body".as_slice()]);
        let head_len = head(&owner).unwrap().len();
        for millis in [1_764_115_200_000, 1_764_115_200_001] {
            let record = in_flight_until(&owner, &fingerprint, at(millis)).unwrap();
            assert_eq!(record[head_len + 8] & WAITED, 0, "{millis}: even");
            assert!(!is_waited(&record, head_len));
            let read = parse_at(&record, at(millis - 10)).unwrap();
            assert!(read.time_left <= Duration::from_millis(10));
            // Marked as wait.lua marks it: a reader sees the lease end 1 ms later.
            let mut marked = record.to_vec();
            marked[head_len + 8] |= WAITED;
            assert!(is_waited(&marked, head_len));
            let read = parse_at(&Bytes::from(marked.clone()), at(millis - 10)).unwrap();
            assert_eq!(read.state, IN_FLIGHT);
            // A renewal's new state keeps the mark of a marked record, and only of one.
            let renewal = state_at(IN_FLIGHT, at(millis + 30_000));
            assert_eq!(renewal[8] & WAITED, 0);
            assert_eq!(keeping_mark(&renewal, &marked, head_len)[8] & WAITED, WAITED);
            assert_eq!(keeping_mark(&renewal, &record, head_len), renewal);
        }
        // A completed record's deadline is what it is, and a completed record is never waited.
        let done = state_at(COMPLETED, at(1_764_115_200_001));
        assert_eq!(done[8] & WAITED, WAITED);
        let mut completed = head(&owner).unwrap().to_vec();
        completed.extend_from_slice(&done);
        assert!(!is_waited(&completed, head_len));
    }

    /// A completed record as the completion script leaves it: the in-flight record with its
    /// state and deadline rewritten after the head, the payload after the fingerprint.
    fn completed_until(
        owner: &OwnerToken,
        fingerprint: &Fingerprint,
        deadline: SystemTime,
        payload: &[u8],
    ) -> Bytes {
        let mut record = in_flight_until(owner, fingerprint, at(0)).unwrap().to_vec();
        let head = head(owner).unwrap().len();
        record[head..head + 9].copy_from_slice(&state_at(COMPLETED, deadline));
        record.extend_from_slice(payload);
        record.into()
    }

    // The layout before policy tags (RECORD_VERSION 2), byte for byte: this release must read
    // what the previous one wrote.
    const OWNER: &str = "0123456789abcdef0123456789abcdef-2a@1764115200000";
    const FINGERPRINT: [u8; 32] = *b"\x00\x01\x02\x03\x04\x05\x06\x07\x08\x09\x0a\x0b\x0c\x0d\x0e\x0f\x10\x11\x12\x13\x14\x15\x16\x17\x18\x19\x1a\x1b\x1c\x1d\x1e\x1f";
    /// Claimed by `OWNER`, its lease ending at 1 764 115 230 000 ms (30 s after the claim).
    const IN_FLIGHT_V2: &[u8] = b"TIR\x02\x00\x310123456789abcdef0123456789abcdef-2a@1764115200000\
        F\x00\x00\x01\x9a\xbd\x76\x2d\x30\
        \x00\x01\x02\x03\x04\x05\x06\x07\x08\x09\x0a\x0b\x0c\x0d\x0e\x0f\x10\x11\x12\x13\x14\x15\x16\x17\x18\x19\x1a\x1b\x1c\x1d\x1e\x1f";
    /// The same record completed, kept until 1 764 201 600 000 ms, its payload a stored
    /// response (layout 2: 201, `content-type: application/json`, body `{"id":"pay_1"}`).
    const COMPLETED_V2: &[u8] = b"TIR\x02\x00\x310123456789abcdef0123456789abcdef-2a@1764115200000\
        C\x00\x00\x01\x9a\xc2\x9c\x14\x00\
        \x00\x01\x02\x03\x04\x05\x06\x07\x08\x09\x0a\x0b\x0c\x0d\x0e\x0f\x10\x11\x12\x13\x14\x15\x16\x17\x18\x19\x1a\x1b\x1c\x1d\x1e\x1f\
        TIR\x02R\x00\xc9\x00\x00\x00\x01\x00\x00\x00\x0ccontent-type\x00\x00\x00\x10application/json\
        \x00\x00\x00\x00\x00\x00\x00\x0e{\"id\":\"pay_1\"}\x00\x00\x00\x00";
    const PAYLOAD_AT_V2: usize = 6 + OWNER.len() + 9 + 32;

    // Today's layout (RECORD_VERSION 3), byte for byte: the next release must read these.
    const TAG: [u8; 8] = *b"\xa1\xa2\xa3\xa4\xa5\xa6\xa7\xa8";
    /// As `IN_FLIGHT_V2`, in layout 3, its fingerprint made under the policy `TAG`.
    const IN_FLIGHT_V3: &[u8] = b"TIR\x03\x00\x310123456789abcdef0123456789abcdef-2a@1764115200000\
        F\x00\x00\x01\x9a\xbd\x76\x2d\x30\
        \x00\x01\x02\x03\x04\x05\x06\x07\x08\x09\x0a\x0b\x0c\x0d\x0e\x0f\x10\x11\x12\x13\x14\x15\x16\x17\x18\x19\x1a\x1b\x1c\x1d\x1e\x1f\
        \xa1\xa2\xa3\xa4\xa5\xa6\xa7\xa8";
    /// As `COMPLETED_V2`, in layout 3.
    const COMPLETED_V3: &[u8] = b"TIR\x03\x00\x310123456789abcdef0123456789abcdef-2a@1764115200000\
        C\x00\x00\x01\x9a\xc2\x9c\x14\x00\
        \x00\x01\x02\x03\x04\x05\x06\x07\x08\x09\x0a\x0b\x0c\x0d\x0e\x0f\x10\x11\x12\x13\x14\x15\x16\x17\x18\x19\x1a\x1b\x1c\x1d\x1e\x1f\
        \xa1\xa2\xa3\xa4\xa5\xa6\xa7\xa8\
        TIR\x02R\x00\xc9\x00\x00\x00\x01\x00\x00\x00\x0ccontent-type\x00\x00\x00\x10application/json\
        \x00\x00\x00\x00\x00\x00\x00\x0e{\"id\":\"pay_1\"}\x00\x00\x00\x00";
    const PAYLOAD_AT: usize = 6 + OWNER.len() + 9 + FINGERPRINT_LEN;

    /// The upgrade promise (each release reads the previous release's records) starts from
    /// today's bytes: read field by field, and written back to exactly these bytes. A change of
    /// the layout (a field moved, resized, or the version byte) fails here, not in production.
    #[test]
    fn todays_records_are_pinned_byte_for_byte() {
        let owner = OwnerToken::from_string(OWNER);
        let tag = PolicyTag::from_bytes(TAG).unwrap();
        let fingerprint = Fingerprint::from_digest(FINGERPRINT).with_policy(tag);
        let claimed = at(1_764_115_230_000);
        let kept = at(1_764_201_600_000);

        let record = parse_at(&Bytes::from_static(IN_FLIGHT_V3), UNIX_EPOCH).unwrap();
        assert_eq!(record.state, IN_FLIGHT);
        assert_eq!(&record.owner[..], OWNER.as_bytes());
        assert_eq!((record.fingerprint, record.policy), (FINGERPRINT, Some(tag)));
        assert_eq!(UNIX_EPOCH + record.time_left, claimed);
        assert!(record.payload.is_empty());
        let later = parse_at(&Bytes::from_static(IN_FLIGHT_V3), at(1_764_115_200_000)).unwrap();
        assert_eq!(
            later.time_left,
            Duration::from_secs(30),
            "the lease left, counted from now"
        );
        assert_eq!(
            &in_flight_until(&owner, &fingerprint, claimed).unwrap()[..],
            IN_FLIGHT_V3
        );

        let record = parse_at(&Bytes::from_static(COMPLETED_V3), UNIX_EPOCH).unwrap();
        assert_eq!(record.state, COMPLETED);
        assert_eq!(&record.owner[..], OWNER.as_bytes());
        assert_eq!((record.fingerprint, record.policy), (FINGERPRINT, Some(tag)));
        assert_eq!(UNIX_EPOCH + record.time_left, kept);
        assert_eq!(&record.payload[..], &COMPLETED_V3[PAYLOAD_AT..]);
        // What the completion script is sent (head, then state and deadline), and what it makes.
        assert_eq!(&head(&owner).unwrap()[..], &COMPLETED_V3[..6 + OWNER.len()]);
        assert_eq!(
            &state_at(COMPLETED, kept)[..],
            &COMPLETED_V3[6 + OWNER.len()..6 + OWNER.len() + 9]
        );
        let completed = completed_until(&owner, &fingerprint, kept, &COMPLETED_V3[PAYLOAD_AT..]);
        assert_eq!(&completed[..], COMPLETED_V3);

        let head = parse_head_at(
            &Bytes::from_static(&IN_FLIGHT_V3[..head_len(IN_FLIGHT_V3).unwrap()]),
            UNIX_EPOCH,
        )
        .unwrap();
        assert_eq!((head.state, &head.owner[..]), (IN_FLIGHT, OWNER.as_bytes()));
        assert_eq!(newer_version(&Bytes::from_static(COMPLETED_V3)), None);
        assert_eq!(
            super::owner(&Bytes::from_static(COMPLETED_V3)),
            Some(OWNER.as_bytes())
        );
        check(IN_FLIGHT_V3);
        assert_eq!(check(COMPLETED_V3).as_deref(), Some(&COMPLETED_V3[PAYLOAD_AT..]));
        // Untagged: eight zeros, read as no tag.
        let untagged = Fingerprint::from_digest(FINGERPRINT);
        let record = in_flight_until(&owner, &untagged, claimed).unwrap();
        assert_eq!(&record[PAYLOAD_AT - 8..], &[0; 8]);
        assert_eq!(parse_at(&record, UNIX_EPOCH).unwrap().policy, None);
    }

    /// The previous release's records (layout 2, no tag) read as they were written, untagged:
    /// a mismatch with one of them stays the plain one.
    #[test]
    fn records_of_the_layout_before_tags_read_untagged() {
        let record = parse_at(&Bytes::from_static(IN_FLIGHT_V2), UNIX_EPOCH).unwrap();
        assert_eq!(record.state, IN_FLIGHT);
        assert_eq!(&record.owner[..], OWNER.as_bytes());
        assert_eq!((record.fingerprint, record.policy), (FINGERPRINT, None));
        assert_eq!(UNIX_EPOCH + record.time_left, at(1_764_115_230_000));
        assert!(record.payload.is_empty());
        let record = parse_at(&Bytes::from_static(COMPLETED_V2), UNIX_EPOCH).unwrap();
        assert_eq!(record.state, COMPLETED);
        assert_eq!((record.fingerprint, record.policy), (FINGERPRINT, None));
        assert_eq!(&record.payload[..], &COMPLETED_V2[PAYLOAD_AT_V2..]);
        assert_eq!(newer_version(&Bytes::from_static(COMPLETED_V2)), None);
        assert!(COMPLETED_V2.starts_with(&UNTAGGED_LAYOUT_PREFIX));
        check(IN_FLIGHT_V2);
        assert_eq!(
            check(COMPLETED_V2).as_deref(),
            Some(&COMPLETED_V2[PAYLOAD_AT_V2..])
        );
    }

    /// A sign is not a hex digit: `u8::from_str_radix` took `+f` for `0f`, so a key name
    /// that is no record's (`…:{+f+f…}`) was listed, and purged, as the record `0f0f…`.
    #[test]
    fn a_digest_in_hex_has_no_signs() {
        assert_eq!(digest_from_hex("+f".repeat(32).as_bytes()), None);
        assert_eq!(digest_from_hex("0f".repeat(32).as_bytes()), Some([0x0f; 32]));
        check("+f".repeat(32).as_bytes());
    }

    /// An owner token of any length the head holds, any text.
    fn owners() -> impl Strategy<Value = OwnerToken> {
        prop_oneof![
            "[0-9a-f]{32}-[0-9a-f]{1,16}@[0-9]{1,20}",
            any::<String>(),
            ".{0,300}",
        ]
        .prop_map(OwnerToken::from_string)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Encode then read gives back every field, the deadline to the millisecond (in flight,
        /// rounded down to an even one); the
        /// record is exactly its fields' bytes, and reads the same from its head alone.
        #[test]
        fn records_round_trip(
            owner in owners(),
            fingerprint in any::<[u8; 32]>(),
            tag in any::<[u8; 8]>(),
            deadline in any::<u64>(),
            payload in proptest::collection::vec(any::<u8>(), 0..200),
            completed in any::<bool>(),
        ) {
            let policy = PolicyTag::from_bytes(tag);
            let mut fingerprint = Fingerprint::from_digest(fingerprint);
            if let Some(policy) = policy {
                fingerprint = fingerprint.with_policy(policy);
            }
            let record = if completed {
                completed_until(&owner, &fingerprint, at(deadline), &payload)
            } else {
                in_flight_until(&owner, &fingerprint, at(deadline)).unwrap()
            };
            let read = parse_at(&record, UNIX_EPOCH).unwrap();
            prop_assert_eq!(read.state, if completed { COMPLETED } else { IN_FLIGHT });
            prop_assert_eq!(&read.owner[..], owner.as_str().as_bytes());
            prop_assert_eq!(&read.fingerprint, fingerprint.as_bytes());
            prop_assert_eq!(read.policy, policy);
            // In flight, the owner's deadline is even (the lowest bit is the waiters' mark).
            let written = if completed { deadline } else { deadline & !u64::from(WAITED) };
            prop_assert_eq!(read.time_left, Duration::from_millis(written));
            let expected: &[u8] = if completed { &payload } else { &[] };
            prop_assert_eq!(&read.payload[..], expected);
            prop_assert_eq!(super::owner(&record), Some(owner.as_str().as_bytes()));
            prop_assert_eq!(newer_version(&record), None);
            check(&record);
        }

        /// A record cut anywhere before its payload, or of another version, magic or state, is
        /// an error, never read; one of a newer version is recognised as such.
        #[test]
        fn truncated_or_foreign_records_are_errors(
            owner in owners(),
            cut in any::<prop::sample::Index>(),
            version in any::<u8>(),
            state in any::<u8>(),
            magic in any::<[u8; 3]>(),
        ) {
            let record = in_flight_until(&owner, &Fingerprint::from_digest([7; 32]), at(5)).unwrap();
            prop_assert!(parse(&record.slice(..cut.index(record.len()))).is_err());
            let mut other = record.to_vec();
            other[3] = version;
            let other = Bytes::from(other);
            // Read as layout 2 (8 bytes shorter), this in-flight record has a payload: an error.
            prop_assert_eq!(parse(&other).is_ok(), u32::from(version) == RECORD_VERSION);
            prop_assert_eq!(newer_version(&other).is_some(), u32::from(version) > RECORD_VERSION);
            let mut other = record.to_vec();
            other[6 + owner.as_str().len()] = state;
            prop_assert_eq!(parse(&Bytes::from(other)).is_ok(), state == IN_FLIGHT || state == COMPLETED);
            let mut other = record.to_vec();
            other[..3].copy_from_slice(&magic);
            prop_assert_eq!(parse(&Bytes::from(other)).is_ok(), &magic == MAGIC);
        }

        /// A bit flipped anywhere in a completed record (its stored response included) never
        /// panics, and whatever still reads is exactly the bytes it was read from (the fuzz
        /// check): a flipped body byte replays as stored, nothing is skipped or guessed. A
        /// flip in the magic, version, owner length or state makes the record unreadable, but a
        /// version flipped from 3 to 2 (the layout before tags): read as that layout, the record's
        /// payload then starts with the tag, which no stored response does (the check below
        /// decodes it, and a replay answers the record unreadable).
        #[test]
        fn bit_flips_are_errors_or_read_exactly(owner in "[a-z0-9@-]{0,60}", flip in any::<prop::sample::Index>(), bit in 0..8u8) {
            let owner = OwnerToken::from_string(owner);
            let mut record = completed_until(&owner, &Fingerprint::from_digest([9; 32]), at(77), &COMPLETED_V3[PAYLOAD_AT..]).to_vec();
            let at = flip.index(record.len());
            record[at] ^= 1 << bit;
            let earlier_layout = at == 3 && u32::from(record[3]) == UNTAGGED_RECORD_VERSION;
            let structural = (at < 6 && !earlier_layout) || at == 6 + owner.as_str().len();
            if earlier_layout {
                let read = parse(&Bytes::from(record.clone())).expect("a layout 2 record");
                prop_assert!(crate::http::stored::decode(&read.payload).is_err());
            }
            if structural {
                prop_assert!(parse(&Bytes::from(record.clone())).is_err(), "flip at {}", at);
            }
            if let Some(payload) = check(&record) {
                crate::http::stored::check(&payload);
            }
        }

        /// Any bytes at all: the fuzz target's check (no panic; exact when read; truncation
        /// never reads other fields).
        #[test]
        fn any_bytes_pass_the_fuzz_check(data in proptest::collection::vec(any::<u8>(), 0..120)) {
            check(&data);
            for layout in [IN_FLIGHT_V2, IN_FLIGHT_V3] {
                let mut record = layout.to_vec();
                record.extend_from_slice(&data);
                check(&record);
            }
        }

        /// A digest in hex reads back to the same hex, in either case; anything else is none.
        #[test]
        fn digests_in_hex_round_trip(digest in any::<[u8; 32]>(), upper in any::<bool>(), junk in "[^0-9a-fA-F]{1,2}", at in 0..63usize) {
            let hex = crate::key::hex(&digest);
            let hex = if upper { hex.to_ascii_uppercase() } else { hex };
            prop_assert_eq!(digest_from_hex(hex.as_bytes()), Some(digest));
            let mut bad = hex.into_bytes();
            let junk = junk.as_bytes();
            let end = (at + junk.len()).min(64);
            bad.splice(at..end, junk[..end - at].iter().copied());
            if bad.len() == 64 {
                prop_assert_eq!(digest_from_hex(&bad), None, "{:?}", String::from_utf8_lossy(&bad));
            }
            check(&bad);
        }
    }
}
