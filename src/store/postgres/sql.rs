//! The SQL: the record table's schema (its migration) and every statement, written once per
//! table name.

pub(super) const IN_FLIGHT: &str = "F";
pub(super) const COMPLETED: &str = "C";

/// The statements, written once per table name.
///
/// Every deadline is `statement_timestamp()` plus a duration: the database's clock, and stable
/// within a statement, so an expiry index can serve the comparisons (`clock_timestamp()` is
/// volatile and could not). A record whose `expires_at` has passed is treated as absent by every
/// statement, whether or not the sweep has deleted it yet.
pub(super) struct Sql {
    pub(super) claim: String,
    pub(super) peek: String,
    pub(super) complete: String,
    pub(super) release: String,
    pub(super) renew: String,
    pub(super) purge: String,
    pub(super) sweep: String,
    pub(super) in_flight_page: String,
}

impl Sql {
    pub(super) fn new(table: &str) -> Self {
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
pub(super) fn migration_sql(table: &str) -> String {
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
    -- SHA-256 of the request (method, authority, path and query, content type, body), then
    -- (layout 3) the 8-byte tag of the fingerprint policy it was made under, zeros for none.
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
pub(super) fn valid_table_name(table: &str) -> bool {
    let part = |p: &str| {
        let mut chars = p.chars();
        matches!(chars.next(), Some('a'..='z' | '_'))
            && chars.all(|c| matches!(c, 'a'..='z' | '0'..='9' | '_'))
            && p.len() <= 48
    };
    (table.split_once('.')).map_or_else(|| part(table), |(schema, name)| part(schema) && part(name))
}
