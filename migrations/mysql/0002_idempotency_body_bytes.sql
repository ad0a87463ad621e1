-- The length of each record's recorded body, kept by the server with the row (a stored generated
-- column), so that counting a subject's bytes (its share of the store, `max_bytes_per_subject`)
-- reads the row, not the body: `LENGTH()` of a `LONGBLOB` stored off the page reads the whole blob.
-- Applied by `migrate()` when the column is missing; on a large table it rebuilds the table once.
ALTER TABLE idempotency_records
    ADD COLUMN body_bytes BIGINT AS (COALESCE(LENGTH(response_body), 0)) STORED;
