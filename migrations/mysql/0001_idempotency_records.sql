-- axum-idempotency: the table of idempotency records, for MySQL 8 and MariaDB 10.6 or later.
--
-- MySqlStore::migrate() applies this file under GET_LOCK('<table>_migrate'), with the table name it
-- was configured with in place of `idempotency_records` (and the index names after it); it is safe
-- to run from many instances at once. To manage it with your own migration tool instead, copy this
-- file into your migrations.
--
-- A record is identified by `scope`, the SHA-256 of its key, subject and endpoint (each
-- length-prefixed), so that a subject or endpoint of any length or content fits the primary key.
-- The key, subject and endpoint are kept whole beside it (any bytes, NUL included), and the subject
-- index is on `subject_digest`, the SHA-256 of the subject, which fits InnoDB's key length
-- whatever the subject's. Times are UTC. A finished record whose `response_body` is NULL was
-- recorded without its body (too large, trailers, or a body stream that failed); its replay has an
-- empty body. `response_headers` holds the recorded headers: a 32-bit big-endian count, then each
-- name and value prefixed by its 32-bit big-endian length.

CREATE TABLE IF NOT EXISTS idempotency_records (
    scope BINARY(32) NOT NULL,
    idempotency_key VARBINARY(255) NOT NULL,
    subject MEDIUMBLOB NOT NULL,
    subject_digest BINARY(32) NOT NULL,
    endpoint MEDIUMBLOB NOT NULL,
    fingerprint BINARY(32) NOT NULL,
    status VARCHAR(11) CHARACTER SET ascii NOT NULL,
    -- 0: released, held by no claim (taken at once by the next claim).
    lease_token BIGINT NOT NULL,
    generation BINARY(16) NULL,
    -- The holder's in-progress TTL: a claimer waits for the longer of its own and this one.
    in_progress_ttl_us BIGINT NOT NULL,
    response_status SMALLINT NULL,
    response_headers MEDIUMBLOB NULL,
    response_body LONGBLOB NULL,
    created_at DATETIME(6) NOT NULL,
    -- When the record was claimed, renewed by its holder's heartbeat, or finished: an in-progress
    -- record not renewed for the in-progress TTL is presumed abandoned and may be retaken.
    updated_at DATETIME(6) NOT NULL,
    expires_at DATETIME(6) NOT NULL,
    PRIMARY KEY (scope),
    -- purge_expired() deletes by expiry.
    KEY idempotency_records_expires_at_idx (expires_at),
    -- list() pages through a subject's records by creation; count_records() counts them.
    KEY idempotency_records_subject_idx (subject_digest, created_at, scope),
    CONSTRAINT idempotency_records_status_check
        CHECK (status IN ('in_progress', 'completed', 'failed'))
) ENGINE = InnoDB;
