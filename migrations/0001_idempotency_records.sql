-- axum-idempotency: the table of idempotency records.
--
-- PostgresStore::migrate() applies this file under an advisory lock, with the table name it was
-- configured with in place of `idempotency_records`; it is safe to run from many instances at once.
-- To manage it with your own migration tool instead, copy this file into your migrations.

CREATE TABLE IF NOT EXISTS idempotency_records (
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
    updated_at timestamptz NOT NULL DEFAULT now(),
    expires_at timestamptz NOT NULL,
    PRIMARY KEY (idempotency_key, subject, endpoint)
);

-- purge_expired() deletes by expiry.
CREATE INDEX IF NOT EXISTS idempotency_records_expires_at_idx
    ON idempotency_records (expires_at);
