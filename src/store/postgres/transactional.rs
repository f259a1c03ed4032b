//! A completion inside the caller's own transaction, with the business rows of the handler:
//! [`PostgresStore::complete_in`], and [`ClaimTransaction`], a transaction whose commit does it.

use std::ops::{Deref, DerefMut};
use std::time::Duration;

use bytes::Bytes;
use sqlx::postgres::{PgArguments, PgConnection};
use sqlx::query::Query;
use sqlx::{Postgres, Transaction};

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

    /// A transaction for `ticket`'s operation: write its effect through it (it derefs to a
    /// `PgConnection`), then [`commit`](ClaimTransaction::commit) it with the result, which
    /// completes the claim's record in it ([`complete_in`](Self::complete_in)) and commits the
    /// effect and the record together, or, if the claim was lost meanwhile, rolls the effect
    /// back and says so ([`ClaimCommitError::ClaimLost`]). Dropped uncommitted, it rolls back.
    ///
    /// Why together: with the record apart from the effect, a crash between the two leaves the
    /// effect done and the record in flight, and once its lease ends the redelivery (or the
    /// retry) runs the effect again. Committed as one, a crash before the commit leaves
    /// neither, and one after it leaves both: the redelivery runs it once, or replays it. And a
    /// claim lost before the commit (its lease ran out, so another consumer may be running the
    /// same key) commits no effect. A queue consumer's operation
    /// ([`Coordinator::once_with_ticket`](crate::Coordinator::once_with_ticket), a
    /// `StreamConsumer`'s effect) returns the error as a failure worth another delivery; over
    /// HTTP the ticket is [`TransactionalClaim::ticket`](crate::TransactionalClaim::ticket).
    ///
    /// Begun on the store's pool, within its statement timeout.
    ///
    /// ```no_run
    /// use tower_idempotency::{bytes::Bytes, ClaimTicket, PostgresStore};
    ///
    /// async fn pay(store: &PostgresStore, ticket: ClaimTicket) -> Result<Bytes, Box<dyn std::error::Error>> {
    ///     let mut transaction = store.transaction_for(&ticket).await?;
    ///     let insert = sqlx::query("INSERT INTO ledger (id, amount) VALUES ($1, 40)");
    ///     insert.bind(ticket.key().key().as_str()).execute(&mut *transaction).await?;
    ///     // The row and the record, or neither; what it answers is what replays get.
    ///     Ok(transaction.commit(Bytes::from("paid 40")).await?)
    /// }
    /// ```
    pub async fn transaction_for(&self, ticket: &ClaimTicket) -> Result<ClaimTransaction, StoreError> {
        let transaction = self.bounded(self.pool().begin()).await?;
        Ok(ClaimTransaction {
            store: self.clone(),
            ticket: ticket.clone(),
            transaction,
        })
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

/// A transaction in which a claimed operation writes its effect, whose
/// [`commit`](ClaimTransaction::commit) also completes the claim's record: both commit, or
/// neither does. Made by [`PostgresStore::transaction_for`]; run statements on it with
/// `&mut *transaction`, as on a `sqlx` transaction. Dropped uncommitted, it rolls back.
pub struct ClaimTransaction {
    store: PostgresStore,
    ticket: ClaimTicket,
    transaction: Transaction<'static, Postgres>,
}

impl std::fmt::Debug for ClaimTransaction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClaimTransaction")
            .field("ticket", &self.ticket)
            .finish_non_exhaustive()
    }
}

impl ClaimTransaction {
    /// Completes the claim with `payload` in the transaction and commits it: the effect and
    /// the record land together. Answers `payload` back, for the operation to return: what it
    /// returns must be what was stored, or its first delivery and the replays would see two
    /// results. Call it last, once the effect is written: from the completion to the commit
    /// the record's row is locked (see [`PostgresStore::complete_in`]).
    ///
    /// Errs with [`ClaimCommitError::ClaimLost`], after rolling the transaction back, when the
    /// claim was lost before the commit (its lease ran out and the key may be running
    /// elsewhere, or it was purged): the effect must not land. With
    /// [`ClaimCommitError::Store`] when the completion or the commit failed: rolled back, or,
    /// for a commit whose answer was lost, committed or not; the next delivery finds out (a
    /// replay if it was).
    pub async fn commit(mut self, payload: Bytes) -> Result<Bytes, ClaimCommitError> {
        let completed = self
            .store
            .complete_in(&mut self.transaction, &self.ticket, payload.clone());
        if !completed.await? {
            // Rolled back now rather than when the connection goes back to the pool, so the
            // effect's rows stay locked not a moment longer.
            let _ = self.store.bounded(self.transaction.rollback()).await;
            return Err(ClaimCommitError::ClaimLost);
        }
        self.store.bounded(self.transaction.commit()).await?;
        Ok(payload)
    }
}

impl Deref for ClaimTransaction {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        &self.transaction
    }
}

impl DerefMut for ClaimTransaction {
    fn deref_mut(&mut self) -> &mut PgConnection {
        &mut self.transaction
    }
}

/// Why a [`ClaimTransaction`] did not commit. Either way the effect did not land (or, for a
/// commit whose answer was lost, may have): for a queue consumer, a failure worth another
/// delivery, which `?` makes of it in a `StreamConsumer`'s effect.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClaimCommitError {
    /// The claim was lost before the commit (its lease ran out, or the key was purged), so the
    /// transaction was rolled back: another consumer may run, or have run, the operation.
    #[error("the claim was lost before the commit")]
    ClaimLost,
    /// The completion or the commit failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}
