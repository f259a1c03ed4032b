//! The record layout: one Redis string.
//!
//! ```text
//! "TIR" version(u8) | owner length (u16 BE) | owner | state: 'F' in flight, 'C' completed
//!   | deadline (u64 BE, ms since the Unix epoch) | fingerprint (32 bytes) | payload
//! ```
//!
//! The head (through the owner) is what the scripts compare, with the state byte after it, to
//! check ownership. The deadline is the lease's end in flight and the retention's end once
//! completed; the state and the deadline are rewritten together. The payload is appended on
//! completion, so a replay is a slice of the bytes `SET … GET` hands back.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::{BufMut, Bytes, BytesMut};

use crate::fingerprint::Fingerprint;
use crate::store::error::StoreError;
use crate::store::record::{OwnerToken, RECORD_VERSION};

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
    let at = SystemTime::now() + from_now;
    let millis = at.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis());
    let mut bytes = BytesMut::with_capacity(9);
    bytes.put_u8(state);
    bytes.put_u64(u64::try_from(millis).unwrap_or(u64::MAX));
    bytes.freeze()
}

/// A new in-flight record.
pub(super) fn in_flight(
    owner: &OwnerToken,
    fingerprint: &Fingerprint,
    lease: Duration,
) -> Result<Bytes, StoreError> {
    let head = head(owner)?;
    let mut record = BytesMut::with_capacity(head.len() + 9 + 32);
    record.put_slice(&head);
    record.put_slice(&state_until(IN_FLIGHT, lease));
    record.put_slice(fingerprint.as_bytes());
    Ok(record.freeze())
}

/// A record as read back.
pub(super) struct Parsed {
    pub(super) state: u8,
    pub(super) owner: Bytes,
    pub(super) fingerprint: [u8; 32],
    /// Time to the deadline by this instance's clock: lease left (in flight) or retention
    /// left (completed).
    pub(super) time_left: Duration,
    pub(super) payload: Bytes,
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
    let take = |at: usize, len: usize| {
        record
            .get(at..at + len)
            .ok_or_else(|| "a truncated record".to_string())
    };
    if take(0, 3)? != MAGIC {
        return Err("the key holds a string that is not a record".into());
    }
    let version = take(3, 1)?[0];
    if u32::from(version) != RECORD_VERSION {
        return Err(format!(
            "record layout version {version}, this version reads {RECORD_VERSION}"
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
    let time_left = deadline.duration_since(SystemTime::now()).unwrap_or_default();
    Ok(Head {
        state,
        owner,
        time_left,
    })
}

pub(super) fn parse(record: &Bytes) -> Result<Parsed, String> {
    let Head {
        state,
        owner,
        time_left,
    } = parse_head(record)?;
    let at = 6 + owner.len() + 9;
    let mut fingerprint = [0; 32];
    fingerprint.copy_from_slice(
        record
            .get(at..at + 32)
            .ok_or_else(|| "a truncated record".to_string())?,
    );
    let payload = record.slice(at + 32..);
    if state == IN_FLIGHT && !payload.is_empty() {
        return Err("an in-flight record with a payload".into());
    }
    Ok(Parsed {
        state,
        owner,
        fingerprint,
        time_left,
        payload,
    })
}

/// The digest of a record key written in hex (a purge message, a key name after its prefix).
pub(super) fn digest_from_hex(hex: &[u8]) -> Option<[u8; 32]> {
    let mut digest = [0; 32];
    if hex.len() != 64 {
        return None;
    }
    for (byte, pair) in digest.iter_mut().zip(hex.chunks(2)) {
        *byte = u8::from_str_radix(std::str::from_utf8(pair).ok()?, 16).ok()?;
    }
    Some(digest)
}
