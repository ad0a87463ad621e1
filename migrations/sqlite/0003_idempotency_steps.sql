-- axum-idempotency: the recovery points of an operation (SPEC 28), kept with its record, for
-- SQLite.
--
-- SqliteStore::migrate() applies this file, inside the same `BEGIN IMMEDIATE` as 0001, when the
-- table lacks the columns, with the table name it was configured with in place of
-- `idempotency_records`. To manage it with your own migration tool, copy this file into your
-- migrations after 0002; until it is applied, a step answers an error before its work runs, and
-- nothing else changes.
--
-- `steps` holds the operation's steps, each appended as it is recorded (its name and its result,
-- each prefixed by its length, 32-bit big-endian), in hexadecimal: SQLite's `||` makes text of
-- what it joins, and hexadecimal text joins exactly in every database encoding. They count only
-- while `steps_generation` is the record's `generation`: a record that gets a generation of its
-- own has none.

ALTER TABLE idempotency_records ADD COLUMN steps_generation BLOB;
ALTER TABLE idempotency_records ADD COLUMN steps TEXT;
