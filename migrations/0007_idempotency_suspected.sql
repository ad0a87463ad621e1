-- axum-idempotency: when a claim first found the record's holder silent, kept with the record.
--
-- PostgresStore::migrate() applies this file after 0006, with the table name it was configured
-- with in place of `idempotency_records`. To manage it with your own migration tool instead, copy
-- this file into your migrations too, and apply it before this version of the crate serves claims
-- (a retake on a table without the column answers `503`, and takes nothing).
--
-- A record in progress whose holder has not renewed it for the in-progress TTL, and whose
-- holder's presence is not shown, is not taken at once: the first claim to find it so only marks
-- it, here, and it is taken by a claim a TTL after that mark if no renewal came in between. The
-- mark is a write, so the TTL it starts is measured from a time the database took writes: a
-- failover to a replica, a backend crash that reinitialised the server, a pooler restarted between
-- the application and the database end a live holder's presence and stop its renewals without
-- the server's start time showing it, and the holder gets a whole TTL, once the database answers
-- again, to renew. The mark keeps the start time of the server process that made it
-- (`suspected_on`, `pg_postmaster_start_time()`), and counts only on that process: a mark made
-- before a restart, or on the primary before a failover (a replica's start is its own), does not
-- count after it, even when the holder's renewals after the mark were lost with the old primary.
-- Records written before these columns existed have none (NULL): unmarked.

ALTER TABLE idempotency_records
    ADD COLUMN IF NOT EXISTS suspected_at timestamptz,
    ADD COLUMN IF NOT EXISTS suspected_on timestamptz;
