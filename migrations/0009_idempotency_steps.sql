-- axum-idempotency: the recovery points of an operation (SPEC 28), kept with its record.
--
-- PostgresStore::migrate() applies this file after 0008, with the table name it was configured
-- with in place of `idempotency_records`. To manage it with your own migration tool instead, copy
-- this file into your migrations too; until it is applied, a step answers an error before its
-- work runs, and nothing else changes.
--
-- A step's name and its result (JSON, as the engine encoded it) are appended by the run that
-- holds the record in progress, in the order recorded. They belong to the operation: they count
-- only while `steps_generation` is the record's `generation`, so a record that gets a generation
-- of its own (another request takes a released record, or the key is claimed again after its
-- retention) has none, with no change to the claim. Nullable columns with no default: adding them
-- rewrites nothing.

ALTER TABLE idempotency_records
    ADD COLUMN IF NOT EXISTS steps_generation bytea,
    ADD COLUMN IF NOT EXISTS step_names text[],
    ADD COLUMN IF NOT EXISTS step_results bytea[];
