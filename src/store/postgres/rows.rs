//! What the statements answer: a record as a row, a completion's verdict, and how a database
//! error becomes a [`StoreError`].

use std::time::Duration;

use bytes::Bytes;
use sqlx::postgres::PgRow;
use sqlx::Row;

use super::sql::{COMPLETED, IN_FLIGHT};
use crate::fingerprint::{Fingerprint, PolicyTag};
use crate::key::RecordKey;
use crate::store::error::StoreError;
use crate::store::record::{newer_record, ClaimOutcome, OwnerToken, RECORD_VERSION, UNTAGGED_RECORD_VERSION};

/// The `fingerprint` column of a row this release writes: the digest, then the policy tag
/// (eight zeros for none). Layout 2's rows hold the digest alone.
pub(super) fn fingerprint_column(fingerprint: &Fingerprint) -> [u8; 40] {
    let mut column = [0; 40];
    column[..32].copy_from_slice(fingerprint.as_bytes());
    column[32..].copy_from_slice(&PolicyTag::stored(fingerprint.policy()));
    column
}

/// How often a statement that lost a race to a concurrent one (see [`Sql::claim`](super::sql::Sql::claim)) is sent again.
pub(super) const RACE_ATTEMPTS: usize = 3;

/// A statement found the row changed after its snapshot; sent again.
#[derive(Debug, thiserror::Error)]
#[error("a concurrent statement changed the record {RACE_ATTEMPTS} times in a row")]
pub(super) struct Race;

impl From<Race> for StoreError {
    fn from(race: Race) -> Self {
        StoreError::Unavailable(Box::new(race))
    }
}

/// Whether a completion's row says the claim is completed: by this statement, or already by
/// the same owner (a completion sent twice, or one committed in the handler's transaction).
pub(super) fn completed(row: &PgRow) -> Result<bool, StoreError> {
    let completed: bool = column(row, "completed")?;
    let seen: Option<String> = column(row, "seen")?;
    Ok(match seen.as_deref() {
        _ if completed => true,
        Some(COMPLETED) => true,
        Some(IN_FLIGHT) => return Err(Race.into()),
        _ => false,
    })
}

pub(super) fn is_race(error: &StoreError) -> bool {
    matches!(error, StoreError::Unavailable(source) if source.is::<Race>())
}

/// The record table does not exist, or is not the table this release expects.
#[derive(Debug, thiserror::Error)]
#[error(
    "the idempotency table {table} is missing or has another layout ({source}): run \
     PostgresStore::migrate() or migrations/postgres.sql"
)]
pub(super) struct NotMigrated {
    table: String,
    #[source]
    source: sqlx::Error,
}

pub(super) fn failed(error: sqlx::Error, timeout: Duration, table: &str) -> StoreError {
    use sqlx::Error;
    match &error {
        Error::PoolTimedOut => StoreError::Timeout(timeout),
        // 57014: query_canceled, as `statement_timeout` cancels a statement.
        Error::Database(db) if db.code().as_deref() == Some("57014") => StoreError::Timeout(timeout),
        // 42P01 undefined_table, 42703 undefined_column.
        Error::Database(db) if matches!(db.code().as_deref(), Some("42P01" | "42703")) => {
            StoreError::Unavailable(Box::new(NotMigrated {
                table: table.to_owned(),
                source: error,
            }))
        }
        Error::ColumnDecode { .. } | Error::ColumnNotFound(_) | Error::Decode(_) => {
            StoreError::Corrupt(format!("a record row this release cannot read: {error}"))
        }
        _ => unavailable(error),
    }
}

/// `duration` as an SQL interval, to the microsecond (PostgreSQL's precision; `sqlx` refuses a
/// `Duration` with nanoseconds in it).
pub(super) fn interval(duration: Duration) -> sqlx::postgres::types::PgInterval {
    sqlx::postgres::types::PgInterval {
        months: 0,
        days: 0,
        microseconds: i64::try_from(duration.as_micros()).unwrap_or(i64::MAX),
    }
}

pub(super) fn unavailable(error: impl std::error::Error + Send + Sync + 'static) -> StoreError {
    StoreError::Unavailable(Box::new(error))
}

pub(super) fn column<'r, T>(row: &'r PgRow, name: &str) -> Result<T, StoreError>
where
    T: sqlx::Decode<'r, sqlx::Postgres> + sqlx::Type<sqlx::Postgres>,
{
    row.try_get(name)
        .map_err(|error| StoreError::Corrupt(format!("a record row this release cannot read: {error}")))
}

/// A live record as a statement read it.
#[derive(Debug)]
pub(super) struct Found {
    pub(super) version: i16,
    pub(super) owner: String,
    pub(super) state: String,
    pub(super) fingerprint: Vec<u8>,
    pub(super) payload: Option<Vec<u8>>,
    pub(super) left: Duration,
}

impl Found {
    /// The record in `row`, `None` when the row holds none (the columns are NULL).
    pub(super) fn read(row: &PgRow) -> Result<Option<Self>, StoreError> {
        let Some(version) = column::<Option<i16>>(row, "version")? else {
            return Ok(None);
        };
        let left_ms: i64 = column(row, "left_ms")?;
        Ok(Some(Self {
            version,
            owner: column(row, "owner")?,
            state: column(row, "state")?,
            fingerprint: column(row, "fingerprint")?,
            payload: column(row, "payload")?,
            left: Duration::from_millis(left_ms.max(0) as u64),
        }))
    }

    /// The row's fields checked for what this release writes.
    pub(super) fn checked(&self) -> Result<(), StoreError> {
        let corrupt = |why: &str| Err(StoreError::Corrupt(why.to_owned()));
        let fingerprint_len = match u32::try_from(self.version) {
            Ok(RECORD_VERSION) => 40,
            Ok(UNTAGGED_RECORD_VERSION) => 32,
            _ => {
                return corrupt(&format!(
                "record layout version {}, this release reads {UNTAGGED_RECORD_VERSION} and {RECORD_VERSION}",
                self.version
            ))
            }
        };
        if self.fingerprint.len() != fingerprint_len {
            return corrupt(&format!(
                "a fingerprint of {} bytes in layout {}, which has {fingerprint_len}",
                self.fingerprint.len(),
                self.version
            ));
        }
        match (self.state.as_str(), &self.payload) {
            (IN_FLIGHT, None) | (COMPLETED, Some(_)) => Ok(()),
            (IN_FLIGHT, Some(_)) => corrupt("an in-flight record with a payload"),
            (COMPLETED, None) => corrupt("a completed record without a payload"),
            _ => corrupt("unknown record state"),
        }
    }

    /// The policy tag kept after the digest, if the row has one (layout 2's have none).
    fn policy(&self) -> Option<PolicyTag> {
        let tag: [u8; 8] = self.fingerprint.get(32..40)?.try_into().ok()?;
        PolicyTag::from_bytes(tag)
    }

    pub(super) fn is_newer(&self) -> bool {
        i32::from(self.version) > RECORD_VERSION as i32
    }

    /// What a claim by `owner` (or a peek, without one) finds in this record.
    pub(super) fn outcome(
        self,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        owner: Option<&OwnerToken>,
        lease: Duration,
    ) -> Result<ClaimOutcome, StoreError> {
        if self.is_newer() {
            let version = u32::try_from(self.version).unwrap_or(u32::MAX);
            return newer_record(key, version, self.owner.as_bytes(), lease);
        }
        self.checked()?;
        let in_flight = self.state == IN_FLIGHT;
        Ok(
            if in_flight && owner.is_some_and(|owner| owner.as_str() == self.owner) {
                ClaimOutcome::Claimed
            } else if self.fingerprint.get(..32) != Some(&fingerprint.as_bytes()[..]) {
                ClaimOutcome::mismatch(fingerprint, self.policy())
            } else if in_flight {
                ClaimOutcome::InFlight {
                    lease_left: self.left.min(lease),
                }
            } else {
                ClaimOutcome::Completed(Bytes::from(self.payload.unwrap_or_default()))
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::IdempotencyKey;
    use proptest::prelude::*;

    fn found() -> impl Strategy<Value = Found> {
        (
            prop_oneof![
                Just(RECORD_VERSION as i16),
                Just(UNTAGGED_RECORD_VERSION as i16),
                any::<i16>()
            ],
            prop_oneof!["[a-z0-9-]{1,20}@1764115200000", "[a-z]{0,8}"],
            prop_oneof![Just(IN_FLIGHT.to_owned()), Just(COMPLETED.to_owned()), ".{0,2}"],
            prop_oneof![
                Just(vec![7u8; 32]),
                Just([[7u8; 32].as_slice(), b"policy-1"].concat()),
                Just([[7u8; 32].as_slice(), b"policy-2"].concat()),
                Just([[7u8; 32].as_slice(), &[0; 8]].concat()),
                proptest::collection::vec(any::<u8>(), 0..48)
            ],
            proptest::option::of(proptest::collection::vec(any::<u8>(), 0..40)),
            0u64..100_000,
        )
            .prop_map(|(version, owner, state, fingerprint, payload, left)| Found {
                version,
                owner,
                state,
                fingerprint,
                payload,
                left: Duration::from_millis(left),
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// What a claim makes of any row: a row of another layout, fingerprint size, state, or
        /// with a payload where its state has none, is an error (or, newer, another release's
        /// record), never an answer; a replay is the row's own payload, and only for the same
        /// fingerprint; a row in flight is this claim's only for its owner.
        #[test]
        fn a_row_is_answered_as_it_says_or_refused(row in found(), mine in any::<bool>(), same in any::<bool>()) {
            let key = RecordKey::new(None, IdempotencyKey::parse("k").unwrap());
            let request = Fingerprint::from_digest(if same { [7; 32] } else { [8; 32] })
                .with_policy(PolicyTag::from_bytes(*b"policy-1").unwrap());
            let owner = OwnerToken::from_string(if mine { row.owner.clone() } else { "other".to_owned() });
            let lease = Duration::from_secs(30);
            let (version, state, payload) = (row.version, row.state.clone(), row.payload.clone());
            let tagged = version == RECORD_VERSION as i16;
            let valid = (tagged || version == UNTAGGED_RECORD_VERSION as i16)
                && row.fingerprint.len() == if tagged { 40 } else { 32 }
                && matches!((state.as_str(), &payload), (IN_FLIGHT, None) | (COMPLETED, Some(_)));
            let matches = row.fingerprint.get(..32) == Some(&request.as_bytes()[..]);
            // Stored under another policy's tag: eight bytes, not zeros, not the request's.
            let other_policy = tagged && row.fingerprint.get(32..).is_some_and(|tag| tag != b"policy-1" && tag != [0; 8]);
            let owned = mine && row.owner != "other";
            let differs = valid && !matches && !(state == IN_FLIGHT && owned);
            let left = row.left;
            match row.outcome(&key, &request, Some(&owner), lease) {
                Ok(ClaimOutcome::Completed(replayed)) => {
                    prop_assert!(valid && state == COMPLETED && matches);
                    prop_assert_eq!(Some(replayed.to_vec()), payload);
                }
                Ok(ClaimOutcome::Claimed) => prop_assert!(valid && state == IN_FLIGHT && owned),
                Ok(ClaimOutcome::Mismatch) => prop_assert!(differs && !other_policy),
                Ok(ClaimOutcome::PolicyMismatch) => prop_assert!(differs && other_policy),
                Ok(ClaimOutcome::InFlight { lease_left }) => {
                    if version > RECORD_VERSION as i16 {
                        prop_assert_eq!(lease_left, Duration::from_secs(1));
                    } else {
                        prop_assert!(valid && state == IN_FLIGHT && matches && !owned);
                        prop_assert_eq!(lease_left, left.min(lease));
                    }
                }
                Err(StoreError::Corrupt(_)) => prop_assert!(!valid),
                Err(other) => prop_assert!(false, "{other:?}"),
            }
        }
    }
}
