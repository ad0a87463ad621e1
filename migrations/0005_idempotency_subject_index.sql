-- axum-idempotency: the index that lists a subject's records.
--
-- PostgresStore::migrate() applies this after 0001 to 0004 when the index is missing, with the
-- table name it was configured with in place of `idempotency_records` (the index is named after
-- the table). To manage it with your own migration tool instead, copy this file into your
-- migrations too. Without it, `IdempotencyStore::list` still answers, reading the whole table.
--
-- `list` pages through one subject's records ordered by creation time, then scope digest: the
-- index serves the subject, the order and where a page starts. Building it on a large table
-- holds writes (claims, heartbeats) until it is done, so `migrate()` builds it only on a table of
-- at most 64 MiB and otherwise logs a warning: build it then with `CREATE INDEX CONCURRENTLY`
-- (outside a transaction) under this name, and `migrate()` finds it.

CREATE INDEX IF NOT EXISTS idempotency_records_subject_idx
    ON idempotency_records (subject, created_at, scope);
