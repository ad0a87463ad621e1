-- axum-idempotency: the boot clock of records in progress, for SQLite.
--
-- SqliteStore::migrate() applies this file, inside the same `BEGIN IMMEDIATE` as 0001, when the
-- table lacks the column (SQLite has no ADD COLUMN IF NOT EXISTS), with the table name it was
-- configured with in place of `idempotency_records`. To manage it with your own migration tool,
-- copy this file into your migrations after 0001.
--
-- `renewed_boot_us` is when the record in progress was claimed or last renewed, in microseconds
-- since the machine booted: the clock its staleness is judged by, which a step of the wall clock
-- does not move. `renewed_paired_us` is the `updated_us` written with it: a record whose
-- `updated_us` was written since by a version that does not know these columns (a rolling
-- upgrade), or that has none (written before), is judged by `updated_us`, on the wall clock.

ALTER TABLE idempotency_records ADD COLUMN renewed_boot_us INTEGER;
ALTER TABLE idempotency_records ADD COLUMN renewed_paired_us INTEGER;
