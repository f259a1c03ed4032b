//! The shared store in PostgreSQL, through `sqlx`: one row per record, every transition one
//! statement, and a completion that can commit with the business rows of the handler.

use std::str::FromStr;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use sqlx::postgres::{PgArguments, PgConnectOptions, PgConnection, PgPool, PgPoolOptions, PgRow};
use sqlx::query::Query;
use sqlx::{Postgres, Row};

use super::postgres_connections::Connections;
use super::{
    ClaimOutcome, InFlightRecord, Oldest, OwnerToken, RecordInfo, RecordState, Store, StoreError,
    StoreFuture, RECORD_VERSION,
};
use crate::coordinator::ClaimTicket;
use crate::{Fingerprint, RecordKey};

const DEFAULT_TABLE: &str = "idempotency_records";
const DEFAULT_COMMAND_TIMEOUT: Duration = Duration::from_secs(2);
const DEFAULT_SWEEP_EVERY: Duration = Duration::from_secs(60);
/// Rows deleted by one sweep statement: small enough to hold its locks for milliseconds.
const SWEEP_BATCH: i64 = 1000;
/// Batches one sweep runs at most; what is left waits for the next sweep.
const SWEEP_MAX_BATCHES: usize = 100;
/// Rows one statement of a listing (`Store::in_flight`) reads.
const LISTING_PAGE: i64 = 1000;
/// How often a statement that lost a race to a concurrent one (see [`Sql::claim`]) is sent again.
const RACE_ATTEMPTS: usize = 3;

const IN_FLIGHT: &str = "F";
const COMPLETED: &str = "C";

/// A [`Store`] in PostgreSQL: one row per record, in a table of its own (default
/// `idempotency_records`), every transition one statement and one round trip.
///
/// Use it when the service already runs on PostgreSQL and has no Redis, or when a handler writes
/// to the same database: it can then store its response in its own transaction
/// ([`complete_in`](PostgresStore::complete_in)), so its business rows and its stored response
/// commit or roll back together, and a crash between the two can no longer run a key twice.
///
/// - Leases and retention are timed by the database's clock (`statement_timestamp()`), never by
///   the clocks of the instances, so instances with skewed clocks agree on every deadline.
/// - The claim is one `INSERT … ON CONFLICT` statement that also reads the row that is there: a
///   replay, a 409 or a mismatch writes nothing (no row lock, no WAL, no commit flush).
/// - Expired rows are deleted by a sweep every minute, in batches of 1000 rows (`FOR UPDATE SKIP
///   LOCKED`, so the instances' sweeps never wait on each other), started by the first claim;
///   an expired row is treated as absent before it is swept.
/// - Every call is bounded by the command timeout (default 2 s), the wait for a pool connection
///   included; [`connect`](PostgresStore::connect) also sets the server's `statement_timeout`.
/// - A connection taken from the pool is held for up to 100 ms, for the store's next statements,
///   then given back: sqlx's pool would test each connection given back to it with one more round
///   trip. A connection that reached the command timeout, or does not answer a test within it, is
///   closed rather than given back, so a server gone silent never holds a place in the pool.
/// - The table is created by [`migrate`](PostgresStore::migrate), or by running
///   `migrations/postgres.sql` yourself.
///
/// ```no_run
/// use tower_idempotency::{IdempotencyLayer, PostgresStore};
///
/// # async fn run() -> Result<(), tower_idempotency::StoreError> {
/// let store = PostgresStore::connect("postgres://app@127.0.0.1/app").await?;
/// store.migrate().await?;
/// let layer = IdempotencyLayer::new(store);
/// # let _ = layer; Ok(()) }
/// ```
#[derive(Clone)]
pub struct PostgresStore {
    connections: Connections,
    table: Arc<str>,
    sql: Arc<Sql>,
    timeout: Duration,
    sweep_every: Option<Duration>,
    /// The sweep task, started by the first claim of any clone and stopped with the last clone.
    sweeper: Arc<OnceLock<Sweeper>>,
}

impl std::fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresStore")
            .field("table", &self.table)
            .field("command_timeout", &self.timeout)
            .field("sweep_every", &self.sweep_every)
            .finish_non_exhaustive()
    }
}

/// Stops the sweep task when the last clone of its store is dropped.
struct Sweeper(tokio::task::JoinHandle<()>);

impl Drop for Sweeper {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The statements, written once per table name.
///
/// Every deadline is `statement_timestamp()` plus a duration: the database's clock, and stable
/// within a statement, so an expiry index can serve the comparisons (`clock_timestamp()` is
/// volatile and could not). A record whose `expires_at` has passed is treated as absent by every
/// statement, whether or not the sweep has deleted it yet.
struct Sql {
    claim: String,
    peek: String,
    complete: String,
    release: String,
    renew: String,
    purge: String,
    sweep: String,
    in_flight_page: String,
}

impl Sql {
    fn new(table: &str) -> Self {
        // `live` reads the record as the statement's snapshot shows it. Only when it shows none,
        // or this owner's own claim, does `taken` try to write: a replay, a 409 or a mismatch is
        // answered from `live` and writes nothing, so it takes no row lock and needs no commit
        // flush.
        //
        // The write is an INSERT whose conflict on the key becomes an UPDATE only for a record
        // that has expired or is this owner's in-flight claim (a claim re-sent after a dropped
        // connection). PostgreSQL locks the conflicting row, waiting for any transaction that
        // holds it, and evaluates that WHERE against the row's latest committed version, not the
        // snapshot: of two concurrent claims, the second waits for the first and then finds the
        // row live and someone else's, so it writes nothing. Two claims never both succeed.
        //
        // `claimed` is whether `taken` wrote. When it did not and `live` shows no record (or
        // still this owner's claim), a concurrent statement changed the row after this one's
        // snapshot was taken: the answer is unknown, and the statement is sent again with a new
        // snapshot (`RACE_ATTEMPTS`). That takes two claims of one key within a millisecond.
        let claim = format!(
            "WITH live AS (
                 SELECT version, owner, state, fingerprint, payload,
                        (extract(epoch FROM expires_at - statement_timestamp()) * 1000)::int8 AS left_ms
                   FROM {table}
                  WHERE key = $1 AND expires_at > statement_timestamp()
             ),
             taken AS (
                 INSERT INTO {table} AS r (key, version, owner, fingerprint, state, expires_at, payload)
                 SELECT $1, $2, $3, $4, '{IN_FLIGHT}', statement_timestamp() + $5::interval, NULL
                  WHERE NOT EXISTS (SELECT FROM live WHERE NOT (live.owner = $3 AND live.state = '{IN_FLIGHT}'))
                 ON CONFLICT (key) DO UPDATE
                    SET version = excluded.version, owner = excluded.owner,
                        fingerprint = excluded.fingerprint, state = '{IN_FLIGHT}',
                        expires_at = excluded.expires_at, payload = NULL
                  WHERE r.expires_at <= statement_timestamp()
                     OR (r.owner = excluded.owner AND r.state = '{IN_FLIGHT}')
                 RETURNING true
             )
             SELECT EXISTS (SELECT FROM taken) AS claimed, live.version, live.owner, live.state,
                    live.fingerprint, live.payload, live.left_ms
               FROM (VALUES (1)) AS always LEFT JOIN live ON true"
        );
        let peek = format!(
            "SELECT version, owner, state, fingerprint, payload,
                    (extract(epoch FROM expires_at - statement_timestamp()) * 1000)::int8 AS left_ms
               FROM {table}
              WHERE key = $1 AND expires_at > statement_timestamp()"
        );
        // `done` completes this owner's live claim. Otherwise `seen` tells the other answers
        // apart, from the statement's snapshot: already completed by this owner (a completion
        // sent twice, or one committed by the handler's own transaction) is a success that
        // leaves the stored payload as it is; still this owner's claim in the snapshot while the
        // UPDATE, which reads the latest version, found it changed, is a race to send again.
        let complete = format!(
            "WITH done AS (
                 UPDATE {table}
                    SET state = '{COMPLETED}', payload = $3, expires_at = statement_timestamp() + $4::interval
                  WHERE key = $1 AND owner = $2 AND state = '{IN_FLIGHT}' AND expires_at > statement_timestamp()
                 RETURNING true
             )
             SELECT EXISTS (SELECT FROM done) AS completed,
                    (SELECT state FROM {table}
                      WHERE key = $1 AND owner = $2 AND expires_at > statement_timestamp()) AS seen"
        );
        let release = format!(
            "DELETE FROM {table}
              WHERE key = $1 AND owner = $2 AND state = '{IN_FLIGHT}' AND expires_at > statement_timestamp()
             RETURNING true"
        );
        let renew = format!(
            "UPDATE {table} SET expires_at = statement_timestamp() + $3::interval
              WHERE key = $1 AND owner = $2 AND state = '{IN_FLIGHT}' AND expires_at > statement_timestamp()
             RETURNING true"
        );
        // Deletes expired rows too, but answers whether a live one was there.
        let purge = format!(
            "WITH gone AS (
                 DELETE FROM {table} WHERE key = $1
                 RETURNING expires_at > statement_timestamp() AS live
             )
             SELECT coalesce(bool_or(live), false) AS live FROM gone"
        );
        // SKIP LOCKED: the sweeps of several instances, and claims taking an expired row over,
        // never wait for each other. FOR UPDATE re-checks the expiry on the latest version, so a
        // row claimed again meanwhile is left alone.
        let sweep = format!(
            "DELETE FROM {table} WHERE key IN (
                 SELECT key FROM {table} WHERE expires_at <= statement_timestamp()
                  ORDER BY expires_at LIMIT $1 FOR UPDATE SKIP LOCKED)"
        );
        // One page of the listing (`Store::in_flight`): the next `$2` keys after `$1` in the
        // primary key's order, an index range scan whatever the table's size, so no statement
        // of a listing runs long or holds an old snapshot. Every key of the page comes back (the
        // last one is where the next page starts), the owner only for a live in-flight record.
        let in_flight_page = format!(
            "SELECT key, version,
                    CASE WHEN state = '{IN_FLIGHT}' AND expires_at > statement_timestamp() THEN owner END AS owner,
                    (extract(epoch FROM expires_at - statement_timestamp()) * 1000)::int8 AS left_ms
               FROM {table} WHERE key > $1 ORDER BY key LIMIT $2"
        );
        Self {
            claim,
            peek,
            complete,
            release,
            renew,
            purge,
            sweep,
            in_flight_page,
        }
    }
}

/// The schema of the record table `table` (a name checked by [`valid_table_name`]), as
/// `migrations/postgres.sql` holds it for the default name.
fn migration_sql(table: &str) -> String {
    let bare = table.rsplit('.').next().unwrap_or(table);
    format!(
        "-- The table of tower-idempotency's PostgresStore. PostgresStore::migrate() runs this (for its
-- table name); it can be run by hand or from a migration tool instead.
CREATE TABLE IF NOT EXISTS {table} (
    -- SHA-256 of the scope and the Idempotency-Key (RecordKey::digest).
    key         bytea PRIMARY KEY,
    -- The record layout: rows of a newer release are answered as in flight, never misread.
    version     smallint NOT NULL,
    -- The claim's owner token: every transition but the claim checks it.
    owner       text NOT NULL,
    -- SHA-256 of the request (method, authority, path and query, content type, body).
    fingerprint bytea NOT NULL,
    -- 'F' in flight, 'C' completed.
    state       text NOT NULL,
    -- The lease's end in flight, the retention's end once completed (the database's clock).
    expires_at  timestamptz NOT NULL,
    -- The stored response, once completed.
    payload     bytea
);
-- For the sweep of expired rows.
CREATE INDEX IF NOT EXISTS {bare}_expires_at ON {table} (expires_at);
"
    )
}

/// A table name the statements can carry unquoted: `name` or `schema.name`, each part a
/// lower-case letter or `_` then lower-case letters, digits or `_`, at most 48 bytes (so the
/// index name fits PostgreSQL's 63).
fn valid_table_name(table: &str) -> bool {
    let part = |p: &str| {
        let mut chars = p.chars();
        matches!(chars.next(), Some('a'..='z' | '_'))
            && chars.all(|c| matches!(c, 'a'..='z' | '0'..='9' | '_'))
            && p.len() <= 48
    };
    match table.split_once('.') {
        Some((schema, name)) => part(schema) && part(name),
        None => part(table),
    }
}

impl PostgresStore {
    /// A store over an existing `sqlx` pool, such as the one the application already has.
    ///
    /// Every call takes a connection from `pool` for one statement, and the store holds it for
    /// up to 100 ms after that for its next ones; a transaction of the application's own waits
    /// at most about that long for a connection the store holds when the pool has no other.
    /// Two settings of the pool matter: its `acquire_timeout` should not exceed the command
    /// timeout (the call fails at the command timeout either way), and `test_before_acquire`
    /// (on by default in `sqlx`) costs a round trip before every statement taken from the pool,
    /// which [`connect`](PostgresStore::connect) turns off. The server's `statement_timeout` is
    /// the pool's own affair here; every call is still bounded by the command timeout.
    ///
    /// ```no_run
    /// use tower_idempotency::PostgresStore;
    ///
    /// # async fn run() -> Result<(), sqlx::Error> {
    /// let pool = sqlx::postgres::PgPoolOptions::new()
    ///     .test_before_acquire(false)
    ///     .connect("postgres://app@127.0.0.1/app")
    ///     .await?;
    /// let store = PostgresStore::new(pool);
    /// # let _ = store; Ok(()) }
    /// ```
    pub fn new(pool: PgPool) -> Self {
        Self {
            connections: Connections::new(pool, DEFAULT_COMMAND_TIMEOUT),
            table: Arc::from(DEFAULT_TABLE),
            sql: Arc::new(Sql::new(DEFAULT_TABLE)),
            timeout: DEFAULT_COMMAND_TIMEOUT,
            sweep_every: Some(DEFAULT_SWEEP_EVERY),
            sweeper: Arc::new(OnceLock::new()),
        }
    }

    /// Connects to `url` (`postgres://user:password@host:port/database?…`, libpq's URL form)
    /// with a pool suited to this store: at most 16 connections, none opened before they are
    /// needed but the first (which checks the URL), no test query before each statement, the
    /// server's `statement_timeout` at 2 s (the default command timeout; a statement is then
    /// not left running on the server after the store gave up on it), and `application_name`
    /// `tower-idempotency`. A connection broken by a restart is dropped on its first failure
    /// and replaced on demand, so the store recovers by itself.
    ///
    /// TLS (`sslmode=require`, `verify-ca`, `verify-full` in the URL) needs the crate feature
    /// `postgres-tls`; without it such a URL fails to connect, never falls back to plain text.
    /// As in libpq, `verify-full` checks the server's certificate (against the platform's
    /// roots, or `sslrootcert`) and its name, `require` only encrypts, and the default,
    /// `prefer`, uses TLS when both sides can and plain text otherwise: name `verify-full`.
    ///
    /// The `statement_timeout` goes in the `options` startup parameter, which PgBouncer refuses
    /// (or, with `options` in its `ignore_startup_parameters`, drops): behind PgBouncer, set
    /// the timeout on the store's role and build the pool yourself for
    /// [`new`](PostgresStore::new) (README, "PostgreSQL").
    ///
    /// ```no_run
    /// use tower_idempotency::PostgresStore;
    /// # async fn run() -> Result<(), tower_idempotency::StoreError> {
    /// let store = PostgresStore::connect("postgres://app:secret@db.internal/app").await?;
    /// # let _ = store; Ok(()) }
    /// ```
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        let options = PgConnectOptions::from_str(url)
            .map_err(unavailable)?
            .application_name("tower-idempotency")
            .options([(
                "statement_timeout",
                DEFAULT_COMMAND_TIMEOUT.as_millis().to_string(),
            )]);
        let pool = PgPoolOptions::new()
            .max_connections(16)
            .min_connections(0)
            .acquire_timeout(DEFAULT_COMMAND_TIMEOUT)
            .test_before_acquire(false)
            .connect_with(options)
            .await
            .map_err(unavailable)?;
        Ok(Self::new(pool))
    }

    /// The table of records (default: `idempotency_records`): `name` or `schema.name`, in
    /// lower-case letters, digits and `_` (no quoting needed). Several services, or tenants kept
    /// apart, can share a database with a table each.
    ///
    /// # Panics
    ///
    /// If `table` is not such a name: it is written into every statement, so it must never
    /// come from outside the program.
    ///
    /// ```no_run
    /// # use tower_idempotency::PostgresStore;
    /// # fn run(pool: sqlx::PgPool) {
    /// let store = PostgresStore::new(pool).with_table("payments.idempotency");
    /// # }
    /// ```
    pub fn with_table(mut self, table: &str) -> Self {
        assert!(
            valid_table_name(table),
            "PostgresStore::with_table: {table:?} is not a table name this store accepts \
             (name or schema.name; lower-case letters, digits, _; at most 48 bytes each)"
        );
        self.table = Arc::from(table);
        self.sql = Arc::new(Sql::new(table));
        self.sweeper = Arc::new(OnceLock::new());
        self
    }

    /// Bounds every call (default: 2 s), including the wait for a pool connection. Keep it at or
    /// below the layer's store timeout (also 2 s by default), which waits a little longer
    /// before giving up.
    ///
    /// ```no_run
    /// # use std::time::Duration;
    /// # use tower_idempotency::PostgresStore;
    /// # fn run(pool: sqlx::PgPool) {
    /// let store = PostgresStore::new(pool).with_command_timeout(Duration::from_millis(500));
    /// # }
    /// ```
    pub fn with_command_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self.connections = Connections::new(self.connections.pool().clone(), timeout);
        self
    }

    /// How often expired rows are deleted (default: every 60 s; `None`: never, when a job of
    /// your own calls [`sweep`](PostgresStore::sweep)). Each sweep deletes at most 100 000 rows,
    /// 1000 per statement; an expired row is treated as absent whether or not it has been
    /// swept, so the sweep only bounds the table's size.
    ///
    /// ```no_run
    /// # use std::time::Duration;
    /// # use tower_idempotency::PostgresStore;
    /// # fn run(pool: sqlx::PgPool) {
    /// let store = PostgresStore::new(pool).with_sweep_every(Some(Duration::from_secs(10)));
    /// # }
    /// ```
    pub fn with_sweep_every(mut self, every: Option<Duration>) -> Self {
        self.sweep_every = every.map(|every| every.max(Duration::from_millis(10)));
        self.sweeper = Arc::new(OnceLock::new());
        self
    }

    /// The table this store keeps its records in.
    ///
    /// ```no_run
    /// # fn run(pool: sqlx::PgPool) {
    /// assert_eq!(tower_idempotency::PostgresStore::new(pool).table(), "idempotency_records");
    /// # }
    /// ```
    pub fn table(&self) -> &str {
        &self.table
    }

    /// The pool this store takes its connections from.
    ///
    /// ```no_run
    /// # async fn run(store: tower_idempotency::PostgresStore) -> Result<(), sqlx::Error> {
    /// let mut transaction = store.pool().begin().await?;
    /// # transaction.commit().await }
    /// ```
    pub fn pool(&self) -> &PgPool {
        self.connections.pool()
    }

    /// Creates the record table and its expiry index if they do not exist (the SQL of
    /// `migrations/postgres.sql`, for this store's table name), in one transaction that holds
    /// an advisory lock, so instances starting together do not trip over each other. Safe to
    /// run at every start. Needs the right to create tables; without it, run the SQL once as a
    /// user who has it.
    ///
    /// ```no_run
    /// # async fn run(store: tower_idempotency::PostgresStore) -> Result<(), tower_idempotency::StoreError> {
    /// store.migrate().await?;
    /// # Ok(()) }
    /// ```
    pub async fn migrate(&self) -> Result<(), StoreError> {
        // One simple-protocol message: PostgreSQL runs its statements as one transaction, so
        // the advisory lock is held until the table and the index exist. Any fixed number will
        // do for the lock: it only orders this crate's own migrations.
        let sql = format!(
            "SELECT pg_advisory_xact_lock(7215448731906532221);\n{}",
            migration_sql(&self.table)
        );
        let migration = sqlx::raw_sql(&sql).execute(self.pool());
        // Creating a table may wait on locks: give it longer than a record's statement.
        match tokio::time::timeout(self.timeout.max(Duration::from_secs(10)), migration).await {
            Ok(result) => result.map(drop).map_err(|error| self.failed(error)),
            Err(_) => Err(StoreError::Timeout(self.timeout.max(Duration::from_secs(10)))),
        }
    }

    /// Deletes expired rows now: batches of 1000 until none is left or 100 batches ran.
    /// Answers how many rows were deleted. The store does this by itself every minute (see
    /// [`with_sweep_every`](PostgresStore::with_sweep_every)).
    ///
    /// ```no_run
    /// # async fn run(store: tower_idempotency::PostgresStore) -> Result<(), tower_idempotency::StoreError> {
    /// let deleted = store.sweep().await?;
    /// # let _ = deleted; Ok(()) }
    /// ```
    pub async fn sweep(&self) -> Result<u64, StoreError> {
        sweep(self.pool(), &self.sql, self.timeout).await
    }

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
    fn completion<'q>(
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

    /// Runs `call` within the command timeout; a database error becomes a store error.
    async fn bounded<T>(
        &self,
        call: impl std::future::Future<Output = Result<T, sqlx::Error>>,
    ) -> Result<T, StoreError> {
        match tokio::time::timeout(self.timeout, call).await {
            Ok(result) => result.map_err(|error| self.failed(error)),
            Err(_) => Err(StoreError::Timeout(self.timeout)),
        }
    }

    /// Runs `statement` within the command timeout on one of the store's connections
    /// ([`Connections`]): its one row, if any.
    async fn fetch_optional(
        &self,
        statement: Query<'_, Postgres, PgArguments>,
    ) -> Result<Option<PgRow>, StoreError> {
        let mut lent = self.connections.lend();
        let fetched = tokio::time::timeout(self.timeout, async {
            statement.fetch_optional(lent.connection().await?).await
        })
        .await;
        match fetched {
            Ok(Ok(row)) => {
                lent.done();
                Ok(row)
            }
            Ok(Err(error)) => Err(self.failed(error)), // `lent` tests its connection as it drops
            Err(_) => {
                lent.timed_out();
                Err(StoreError::Timeout(self.timeout))
            }
        }
    }

    /// As [`fetch_optional`](Self::fetch_optional), for a statement that always answers a row.
    async fn fetch_one(&self, statement: Query<'_, Postgres, PgArguments>) -> Result<PgRow, StoreError> {
        match self.fetch_optional(statement).await? {
            Some(row) => Ok(row),
            None => Err(self.failed(sqlx::Error::RowNotFound)),
        }
    }

    fn failed(&self, error: sqlx::Error) -> StoreError {
        failed(error, self.timeout, &self.table)
    }

    /// Starts the sweep task, once per store (and its clones), if sweeping is on.
    fn start_sweeper(&self) {
        let Some(every) = self.sweep_every else {
            return;
        };
        if self.sweeper.get().is_some() {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        self.sweeper.get_or_init(|| {
            let (pool, sql, timeout) = (self.pool().clone(), self.sql.clone(), self.timeout);
            Sweeper(runtime.spawn(async move {
                loop {
                    tokio::time::sleep(every).await;
                    match sweep(&pool, &sql, timeout).await {
                        Ok(0) => {}
                        Ok(deleted) => tracing::debug!(deleted, "swept expired idempotency records"),
                        Err(error) => tracing::warn!(%error, "could not sweep expired idempotency records"),
                    }
                }
            }))
        });
    }

    /// Claims once: `None` when the statement lost a race and must be sent again.
    async fn claim_once(
        &self,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        owner: &OwnerToken,
        lease: Duration,
    ) -> Result<Option<ClaimOutcome>, StoreError> {
        let statement = sqlx::query(&self.sql.claim)
            .bind(&key.digest()[..])
            .bind(RECORD_VERSION as i16)
            .bind(owner.as_str())
            .bind(&fingerprint.as_bytes()[..])
            .bind(interval(lease));
        let row = self.fetch_one(statement).await?;
        if column::<bool>(&row, "claimed")? {
            return Ok(Some(ClaimOutcome::Claimed));
        }
        match Found::read(&row)? {
            None => Ok(None),
            Some(found) => match found.outcome(key, fingerprint, Some(owner), lease)? {
                // The snapshot still showed this owner's claim, yet the claim did not write.
                ClaimOutcome::Claimed => Ok(None),
                outcome => Ok(Some(outcome)),
            },
        }
    }

    async fn peek_row(&self, key: &RecordKey) -> Result<Option<Found>, StoreError> {
        let statement = sqlx::query(&self.sql.peek).bind(&key.digest()[..]);
        match self.fetch_optional(statement).await? {
            Some(row) => Found::read(&row),
            None => Ok(None),
        }
    }

    /// Runs an owner-checked statement that answers a row when it changed one.
    async fn owner_checked(
        &self,
        sql: &str,
        key: &RecordKey,
        owner: &OwnerToken,
        lease: Option<Duration>,
    ) -> Result<bool, StoreError> {
        let mut statement = sqlx::query(sql).bind(&key.digest()[..]).bind(owner.as_str());
        if let Some(lease) = lease {
            statement = statement.bind(interval(lease));
        }
        Ok(self.fetch_optional(statement).await?.is_some())
    }
}

/// A statement found the row changed after its snapshot; sent again.
#[derive(Debug, thiserror::Error)]
#[error("a concurrent statement changed the record {RACE_ATTEMPTS} times in a row")]
struct Race;

impl From<Race> for StoreError {
    fn from(race: Race) -> Self {
        StoreError::Unavailable(Box::new(race))
    }
}

/// Whether a completion's row says the claim is completed: by this statement, or already by
/// the same owner (a completion sent twice, or one committed in the handler's transaction).
fn completed(row: &PgRow) -> Result<bool, StoreError> {
    let completed: bool = column(row, "completed")?;
    let seen: Option<String> = column(row, "seen")?;
    Ok(match seen.as_deref() {
        _ if completed => true,
        Some(COMPLETED) => true,
        Some(IN_FLIGHT) => return Err(Race.into()),
        _ => false,
    })
}

fn is_race(error: &StoreError) -> bool {
    matches!(error, StoreError::Unavailable(source) if source.is::<Race>())
}

async fn sweep(pool: &PgPool, sql: &Sql, timeout: Duration) -> Result<u64, StoreError> {
    let mut deleted = 0;
    for _ in 0..SWEEP_MAX_BATCHES {
        let statement = sqlx::query(&sql.sweep).bind(SWEEP_BATCH).execute(pool);
        let batch = match tokio::time::timeout(timeout, statement).await {
            Ok(result) => result
                .map_err(|error| failed(error, timeout, ""))?
                .rows_affected(),
            Err(_) => return Err(StoreError::Timeout(timeout)),
        };
        deleted += batch;
        if batch < SWEEP_BATCH as u64 {
            break;
        }
    }
    Ok(deleted)
}

/// The record table does not exist, or is not the table this release expects.
#[derive(Debug, thiserror::Error)]
#[error(
    "the idempotency table {table} is missing or has another layout ({source}): run \
     PostgresStore::migrate() or migrations/postgres.sql"
)]
struct NotMigrated {
    table: String,
    #[source]
    source: sqlx::Error,
}

fn failed(error: sqlx::Error, timeout: Duration, table: &str) -> StoreError {
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
fn interval(duration: Duration) -> sqlx::postgres::types::PgInterval {
    sqlx::postgres::types::PgInterval {
        months: 0,
        days: 0,
        microseconds: i64::try_from(duration.as_micros()).unwrap_or(i64::MAX),
    }
}

fn unavailable(error: impl std::error::Error + Send + Sync + 'static) -> StoreError {
    StoreError::Unavailable(Box::new(error))
}

fn column<'r, T>(row: &'r PgRow, name: &str) -> Result<T, StoreError>
where
    T: sqlx::Decode<'r, sqlx::Postgres> + sqlx::Type<sqlx::Postgres>,
{
    row.try_get(name)
        .map_err(|error| StoreError::Corrupt(format!("a record row this release cannot read: {error}")))
}

/// A live record as a statement read it.
struct Found {
    version: i16,
    owner: String,
    state: String,
    fingerprint: Vec<u8>,
    payload: Option<Vec<u8>>,
    left: Duration,
}

impl Found {
    /// The record in `row`, `None` when the row holds none (the columns are NULL).
    fn read(row: &PgRow) -> Result<Option<Self>, StoreError> {
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
    fn checked(&self) -> Result<(), StoreError> {
        let corrupt = |why: &str| Err(StoreError::Corrupt(why.to_owned()));
        if self.version != RECORD_VERSION as i16 {
            return corrupt(&format!(
                "record layout version {}, this release reads {RECORD_VERSION}",
                self.version
            ));
        }
        if self.fingerprint.len() != 32 {
            return corrupt("a fingerprint that is not 32 bytes");
        }
        match (self.state.as_str(), &self.payload) {
            (IN_FLIGHT, None) | (COMPLETED, Some(_)) => Ok(()),
            (IN_FLIGHT, Some(_)) => corrupt("an in-flight record with a payload"),
            (COMPLETED, None) => corrupt("a completed record without a payload"),
            _ => corrupt("unknown record state"),
        }
    }

    fn is_newer(&self) -> bool {
        i32::from(self.version) > RECORD_VERSION as i32
    }

    /// What a claim by `owner` (or a peek, without one) finds in this record.
    fn outcome(
        self,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        owner: Option<&OwnerToken>,
        lease: Duration,
    ) -> Result<ClaimOutcome, StoreError> {
        if self.is_newer() {
            let version = u32::try_from(self.version).unwrap_or(u32::MAX);
            return crate::store::newer_record(key, version, self.owner.as_bytes(), lease);
        }
        self.checked()?;
        let in_flight = self.state == IN_FLIGHT;
        Ok(
            if in_flight && owner.is_some_and(|owner| owner.as_str() == self.owner) {
                ClaimOutcome::Claimed
            } else if self.fingerprint != fingerprint.as_bytes() {
                ClaimOutcome::Mismatch
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

impl Store for PostgresStore {
    fn claim<'a>(
        &'a self,
        key: &'a RecordKey,
        fingerprint: &'a Fingerprint,
        owner: &'a OwnerToken,
        lease: Duration,
    ) -> StoreFuture<'a, ClaimOutcome> {
        Box::pin(async move {
            self.start_sweeper();
            for _ in 0..RACE_ATTEMPTS {
                if let Some(outcome) = self.claim_once(key, fingerprint, owner, lease).await? {
                    return Ok(outcome);
                }
                tracing::debug!(?key, "a concurrent statement changed the record; claiming again");
            }
            Err(Race.into())
        })
    }

    fn peek<'a>(
        &'a self,
        key: &'a RecordKey,
        fingerprint: &'a Fingerprint,
    ) -> StoreFuture<'a, Option<ClaimOutcome>> {
        Box::pin(async move {
            match self.peek_row(key).await? {
                Some(found) => Ok(Some(found.outcome(key, fingerprint, None, Duration::MAX)?)),
                None => Ok(None),
            }
        })
    }

    fn complete<'a>(
        &'a self,
        key: &'a RecordKey,
        owner: &'a OwnerToken,
        payload: Bytes,
        retention: Duration,
    ) -> StoreFuture<'a, bool> {
        Box::pin(async move {
            for _ in 0..RACE_ATTEMPTS {
                let statement = self.completion(key, owner, &payload, retention);
                match self.fetch_one(statement).await.and_then(|row| completed(&row)) {
                    Err(error) if is_race(&error) => {
                        tracing::debug!(
                            ?key,
                            "a concurrent statement changed the record; completing again"
                        );
                    }
                    answer => return answer,
                }
            }
            Err(Race.into())
        })
    }

    fn release<'a>(&'a self, key: &'a RecordKey, owner: &'a OwnerToken) -> StoreFuture<'a, bool> {
        Box::pin(self.owner_checked(&self.sql.release, key, owner, None))
    }

    fn renew<'a>(
        &'a self,
        key: &'a RecordKey,
        owner: &'a OwnerToken,
        lease: Duration,
    ) -> StoreFuture<'a, bool> {
        Box::pin(self.owner_checked(&self.sql.renew, key, owner, Some(lease)))
    }

    fn inspect<'a>(&'a self, key: &'a RecordKey) -> StoreFuture<'a, Option<RecordInfo>> {
        Box::pin(async move {
            let Some(found) = self.peek_row(key).await? else {
                return Ok(None);
            };
            if found.is_newer() {
                return Err(StoreError::Corrupt(format!(
                    "a record in layout version {}, written by a newer release: inspect it with that release",
                    found.version
                )));
            }
            found.checked()?;
            Ok(Some(if found.state == IN_FLIGHT {
                RecordInfo::new(RecordState::InFlight, found.left, None)
                    .with_owner(OwnerToken::from_string(found.owner))
            } else {
                let payload = Bytes::from(found.payload.unwrap_or_default());
                RecordInfo::new(RecordState::Completed, found.left, Some(payload))
            }))
        })
    }

    fn purge<'a>(&'a self, key: &'a RecordKey) -> StoreFuture<'a, bool> {
        Box::pin(async move {
            let statement = sqlx::query(&self.sql.purge).bind(&key.digest()[..]);
            column(&self.fetch_one(statement).await?, "live")
        })
    }

    /// Pages through the table in primary-key order, 1000 rows a statement, each bounded by
    /// the command timeout. No index of its own: one would cost every claim a write.
    fn in_flight<'a>(&'a self, older_than: Duration, limit: usize) -> StoreFuture<'a, Vec<InFlightRecord>> {
        Box::pin(async move {
            let mut oldest = Oldest::new(older_than, limit);
            let mut after: Vec<u8> = Vec::new();
            loop {
                let statement = sqlx::query(&self.sql.in_flight_page)
                    .bind(&after[..])
                    .bind(LISTING_PAGE);
                let rows = self.bounded(statement.fetch_all(self.pool())).await?;
                let Some(last) = rows.last() else {
                    break;
                };
                after = column(last, "key")?;
                for row in &rows {
                    let Some(owner) = column::<Option<String>>(row, "owner")? else {
                        continue;
                    };
                    let version: i16 = column(row, "version")?;
                    let key: Vec<u8> = column(row, "key")?;
                    let Ok(digest) = <[u8; 32]>::try_from(key.as_slice()) else {
                        continue;
                    };
                    if version != RECORD_VERSION as i16 {
                        tracing::debug!(version, "not listed: a record in another layout");
                        continue;
                    }
                    let left_ms: i64 = column(row, "left_ms")?;
                    let left = Duration::from_millis(left_ms.max(0) as u64);
                    oldest.offer(digest, OwnerToken::from_string(owner), left);
                }
                if (rows.len() as i64) < LISTING_PAGE {
                    break;
                }
            }
            Ok(oldest.into_vec())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_migration_file_is_the_migration_of_the_default_table() {
        let file = include_str!("../../migrations/postgres.sql");
        assert_eq!(
            file,
            migration_sql(DEFAULT_TABLE),
            "regenerate migrations/postgres.sql"
        );
    }

    /// Built without `postgres-tls`, a URL that requires TLS must fail, never connect in plain
    /// text (`scripts/test.sh` runs this in a build without the feature).
    #[cfg(not(feature = "postgres-tls"))]
    #[tokio::test]
    async fn without_the_tls_feature_a_url_requiring_tls_is_refused() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        // Accepts and holds every connection: a server that would answer, were it asked.
        let accepting = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((socket, _)) = listener.accept().await {
                held.push(socket);
            }
        });
        for mode in ["require", "verify-full"] {
            let url = format!("postgres://app:secret@{addr}/app?sslmode={mode}");
            let error = PostgresStore::connect(&url).await.unwrap_err();
            let text = format!("{error}");
            assert!(text.contains("TLS"), "{mode}: {text}");
        }
        accepting.abort();
    }

    #[test]
    fn table_names_are_plain_identifiers() {
        for good in ["idempotency_records", "payments.idem", "_t1", "a"] {
            assert!(valid_table_name(good), "{good}");
        }
        let long = "t".repeat(49);
        for bad in [
            "",
            "Idem",
            "a.b.c",
            "1t",
            "t-1",
            "t;drop",
            "\"t\"",
            ".t",
            "t.",
            long.as_str(),
        ] {
            assert!(!valid_table_name(bad), "{bad}");
        }
    }
}
