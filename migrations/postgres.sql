-- The table of tower-idempotency's PostgresStore. PostgresStore::migrate() runs this (for its
-- table name); it can be run by hand or from a migration tool instead.
CREATE TABLE IF NOT EXISTS idempotency_records (
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
CREATE INDEX IF NOT EXISTS idempotency_records_expires_at ON idempotency_records (expires_at);
