//! The shared store in PostgreSQL, through `sqlx`: one row per record, every transition one
//! statement, and a completion that can commit with the business rows of the handler.

use std::str::FromStr;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use sqlx::postgres::{PgArguments, PgConnectOptions, PgPool, PgPoolOptions, PgRow};
use sqlx::query::Query;
use sqlx::Postgres;

use super::connections::Connections;
use super::rows::{
    column, completed, failed, fingerprint_column, interval, is_race, unavailable, Found, Race, RACE_ATTEMPTS,
};
use super::sql::{migration_sql, valid_table_name, Sql, IN_FLIGHT};
use crate::fingerprint::Fingerprint;
use crate::key::RecordKey;
use crate::store::contract::{Store, StoreFuture};
use crate::store::error::StoreError;
use crate::store::record::{
    ClaimOutcome, InFlightRecord, Oldest, OwnerToken, RecordInfo, RecordState, RECORD_VERSION,
    UNTAGGED_RECORD_VERSION,
};

const DEFAULT_TABLE: &str = "idempotency_records";
const DEFAULT_COMMAND_TIMEOUT: Duration = Duration::from_secs(2);
const DEFAULT_SWEEP_EVERY: Duration = Duration::from_secs(60);
/// Rows deleted by one sweep statement: small enough to hold its locks for milliseconds.
const SWEEP_BATCH: i64 = 1000;
/// Batches one sweep runs at most; what is left waits for the next sweep.
const SWEEP_MAX_BATCHES: usize = 100;
/// Rows one statement of a listing (`Store::in_flight`) reads.
const LISTING_PAGE: i64 = 1000;

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
    pub(super) connections: Connections,
    pub(super) table: Arc<str>,
    pub(super) sql: Arc<Sql>,
    pub(super) timeout: Duration,
    pub(super) sweep_every: Option<Duration>,
    /// The sweep task, started by the first claim of any clone and stopped with the last clone.
    pub(super) sweeper: Arc<OnceLock<Sweeper>>,
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
pub(super) struct Sweeper(tokio::task::JoinHandle<()>);

impl Drop for Sweeper {
    fn drop(&mut self) {
        self.0.abort();
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
    /// [`new`](PostgresStore::new) ([PostgreSQL](crate::guide::postgresql)).
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

    /// Runs `call` within the command timeout; a database error becomes a store error.
    pub(super) async fn bounded<T>(
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
        (self.fetch_optional(statement).await?).ok_or_else(|| self.failed(sqlx::Error::RowNotFound))
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
        let stored_fingerprint = fingerprint_column(fingerprint);
        let statement = sqlx::query(&self.sql.claim)
            .bind(&key.digest()[..])
            .bind(RECORD_VERSION as i16)
            .bind(owner.as_str())
            .bind(&stored_fingerprint[..])
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
        (self.fetch_optional(statement).await?).map_or(Ok(None), |row| Found::read(&row))
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

pub(super) async fn sweep(pool: &PgPool, sql: &Sql, timeout: Duration) -> Result<u64, StoreError> {
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
            let found = self.peek_row(key).await?;
            (found.map(|found| found.outcome(key, fingerprint, None, Duration::MAX))).transpose()
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
                    if version != RECORD_VERSION as i16 && version != UNTAGGED_RECORD_VERSION as i16 {
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
        let file = include_str!("../../../migrations/postgres.sql");
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
