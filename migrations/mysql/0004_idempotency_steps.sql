-- The recovery points of an operation (SPEC 28), kept with its record: `steps` holds its steps,
-- each appended as it is recorded (its name and its result, each prefixed by its length, 32-bit
-- big-endian). They count only while `steps_generation` is the record's `generation`: a record
-- that gets a generation of its own has none. Applied by `migrate()`, each statement when its
-- column is missing (until then a step answers an error before its work runs, and nothing else
-- changes).
ALTER TABLE idempotency_records ADD COLUMN steps_generation BINARY(16) NULL;
ALTER TABLE idempotency_records ADD COLUMN steps MEDIUMBLOB NULL;
