//! A completion inside the caller's own transaction, with the business rows of the handler.

use std::time::Duration;

use bytes::Bytes;
use sqlx::postgres::{PgArguments, PgConnection};
use sqlx::query::Query;
use sqlx::Postgres;

use super::rows::{completed, interval};
use super::store::PostgresStore;
use crate::key::RecordKey;
use crate::store::error::StoreError;
use crate::store::record::OwnerToken;
use crate::store::ticket::ClaimTicket;

impl PostgresStore {
    /// Completes `ticket`'s claim with `payload` inside the caller's transaction, so the stored
    /// response commits, or rolls back, with the caller's own writes.
    ///
    /// Answers `true` when the record is completed by the ticket's owner (also when it already
    /// was), `false` when the claim is lost (its lease ran out and another request may have
    /// taken the key over, or it was purged): roll the transaction back then, since the
    /// operation may run, or have run, elsewhere. After a commit the layer's own completion of
    /// the claim finds the record completed and leaves it as it is; after a rollback the claim
    /// is still in flight, and the layer stores or releases it as usual.
    ///
    /// From this statement until the commit the record's row is locked. Retries still get 409
    /// at once (a claim reads the row without waiting for its lock), but the claim's lease
    /// cannot be renewed meanwhile: renewals wait for the commit (and then find the record
    /// completed, which is not a lost claim). Should the lease end before the commit, a retry
    /// waits for the transaction and then replays (commit) or runs (rollback). So call this
    /// last, right before the commit. Over HTTP, the ticket and the payload come from
    /// [`TransactionalClaim`](crate::TransactionalClaim) (see
    /// [`IdempotencyLayer::with_transactional_completion`](crate::IdempotencyLayer::with_transactional_completion)).
    /// `connection` may also be a plain connection, whose statement then commits on its own.
    ///
    /// Under REPEATABLE READ or SERIALIZABLE, a lease renewal committed on another connection
    /// after the transaction's snapshot makes this statement fail with SQLSTATE `40001`: retry
    /// the transaction then, as those levels require anyway (READ COMMITTED, the default, needs
    /// nothing).
    ///
    /// ```no_run
    /// use bytes::Bytes;
    /// use tower_idempotency::{ClaimTicket, PostgresStore, StoreError};
    ///
    /// # async fn run(store: PostgresStore, ticket: ClaimTicket) -> Result<(), Box<dyn std::error::Error>> {
    /// let mut transaction = store.pool().begin().await?;
    /// sqlx::query("INSERT INTO orders (amount) VALUES (42)").execute(&mut *transaction).await?;
    /// if store.complete_in(&mut transaction, &ticket, Bytes::from("order 42 placed")).await? {
    ///     transaction.commit().await?;
    /// } // else: dropped, so rolled back; the claim was lost
    /// # Ok(()) }
    /// ```
    pub async fn complete_in(
        &self,
        connection: &mut PgConnection,
        ticket: &ClaimTicket,
        payload: Bytes,
    ) -> Result<bool, StoreError> {
        let statement = self.completion(ticket.key(), ticket.owner(), &payload, ticket.retention());
        let row = self.bounded(statement.fetch_one(connection)).await?;
        let completed = completed(&row)?;
        if completed {
            ticket.note_completed_elsewhere();
        }
        Ok(completed)
    }

    /// The statement that completes `owner`'s claim of `key` with `payload`.
    pub(super) fn completion<'q>(
        &'q self,
        key: &'q RecordKey,
        owner: &'q OwnerToken,
        payload: &'q [u8],
        retention: Duration,
    ) -> Query<'q, Postgres, PgArguments> {
        sqlx::query(&self.sql.complete)
            .bind(&key.digest()[..])
            .bind(owner.as_str())
            .bind(payload)
            .bind(interval(retention))
    }
}
