-- axum-idempotency: the table of idempotency records.
--
-- PostgresStore::migrate() applies this file under an advisory lock, with the table name it was
-- configured with in place of `idempotency_records`; it is safe to run from many instances at once.
-- To manage it with your own migration tool instead, copy this file into your migrations.
--
-- A record is identified by `scope`, the SHA-256 of its key, subject and endpoint (each
-- length-prefixed), so that a subject or endpoint of any length or content fits the primary key.
-- `idempotency_key`, `subject` and `endpoint` are kept for inspection only (a NUL byte in them is
-- stored as U+FFFD). A finished record whose `response_body` is NULL was recorded without its body
-- (too large, trailers, or a body stream that failed); its replay has an empty body.

CREATE TABLE IF NOT EXISTS idempotency_records (
    scope bytea PRIMARY KEY,
    idempotency_key text NOT NULL,
    subject text NOT NULL,
    endpoint text NOT NULL,
    fingerprint bytea NOT NULL,
    status text NOT NULL CHECK (status IN ('in_progress', 'completed', 'failed')),
    lease_token bigint NOT NULL,
    response_status smallint,
    header_names text[],
    header_values bytea[],
    response_body bytea,
    created_at timestamptz NOT NULL DEFAULT now(),
    -- When the record was claimed, renewed by its holder's heartbeat, or finished: an in-progress
    -- record not renewed for the in-progress TTL is presumed abandoned and may be retaken.
    updated_at timestamptz NOT NULL DEFAULT now(),
    expires_at timestamptz NOT NULL
);

-- purge_expired() deletes by expiry.
CREATE INDEX IF NOT EXISTS idempotency_records_expires_at_idx
    ON idempotency_records (expires_at);
