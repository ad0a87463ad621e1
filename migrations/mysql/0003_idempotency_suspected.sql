-- When a claim first found the record's holder silent (not renewed for the in-progress TTL, its
-- presence not shown). Such a record is not taken at once: the first claim to find it so only
-- marks it, here, and it is taken by a claim a TTL after that mark if no renewal came in between.
-- The mark is a write, so the TTL it starts is measured from a time the server took writes: a
-- failover to a replica or a proxy restarted between the application and the server ends a live
-- holder's named lock and stops its renewals without the server's start time showing it, and the
-- holder gets a whole TTL, once the server answers again, to renew. The mark names the server
-- process that made it (`suspected_on`: host, port, server id and start time), and counts only on
-- that process: a mark made before a restart, or on the primary before a failover, does not count
-- after it, even when the holder's renewals after the mark were lost with the old primary.
-- Applied by `migrate()`, each statement when its column is missing (a claim on a table without
-- them answers `503`).
ALTER TABLE idempotency_records ADD COLUMN suspected_at DATETIME(6) NULL;
ALTER TABLE idempotency_records ADD COLUMN suspected_on VARBINARY(255) NULL;
