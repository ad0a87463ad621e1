-- axum-idempotency: the table of idempotency records, for SQLite (3.37 or later: STRICT tables).
--
-- SqliteStore::migrate() applies this file inside `BEGIN IMMEDIATE` (SQLite's write lock, which
-- serialises it with every other writer of the file, other processes included), with the table
-- name it was configured with in place of `idempotency_records` (the indexes are named after the
-- table); it is safe to run from many processes at once. To manage it with your own migration
-- tool instead, copy this file into your migrations.
--
-- A record is identified by `scope`, the SHA-256 of its key, subject and endpoint (each
-- length-prefixed), so that a subject or endpoint of any length or content fits the primary key.
-- `idempotency_key`, `subject` and `endpoint` are kept whole beside it, NUL bytes included, for
-- inspection and for listing a subject's records.
--
-- Times are microseconds since the Unix epoch. A record in progress whose `updated_us` is older
-- than the longer of its holder's `in_progress_ttl_us` and the claimer's own TTL was abandoned by
-- its holder and may be retaken. A released record (a retry runs it again) is kept in progress
-- under `lease_token` 0 until it expires, with its fingerprint and generation.
--
-- `response_headers` holds the recorded headers as one blob: a 32-bit big-endian count, then each
-- name and value prefixed by its 32-bit big-endian length. A finished record whose
-- `response_body` is NULL was recorded without its body (too large, trailers, or a body stream
-- that failed); its replay has an empty body.

CREATE TABLE IF NOT EXISTS idempotency_records (
    scope BLOB NOT NULL PRIMARY KEY,
    idempotency_key TEXT NOT NULL,
    subject TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    fingerprint BLOB NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('in_progress', 'completed', 'failed')),
    lease_token INTEGER NOT NULL,
    generation BLOB NOT NULL,
    in_progress_ttl_us INTEGER NOT NULL,
    response_status INTEGER,
    response_headers BLOB,
    response_body BLOB,
    created_us INTEGER NOT NULL,
    updated_us INTEGER NOT NULL,
    expires_us INTEGER NOT NULL
) STRICT;

-- purge_expired() deletes by expiry.
CREATE INDEX IF NOT EXISTS idempotency_records_expires_idx
    ON idempotency_records (expires_us);

-- list() pages through one subject's records by creation time, then scope digest;
-- count_records() counts them.
CREATE INDEX IF NOT EXISTS idempotency_records_subject_idx
    ON idempotency_records (subject, created_us, scope);
