-- The reference of SPEC 23 (kept here so that the benchmark runs from the repository alone).
-- The least a fresh key must commit on PostgreSQL: a claim INSERT before the effect and a completion
-- UPDATE after it, each in its own transaction (autocommit), on a plain table. The reference for
-- "Postgres fresh keys vs pgbench" in SPEC 23. Set up and run (CLIENTS 8, then 64):
--
--   psql "$URL" -c "CREATE TABLE pgb_records (k text PRIMARY KEY, status text NOT NULL, fingerprint text,
--       lease text, status_code int, body text, updated_at timestamptz DEFAULT now())"
--   pgbench -n -c $CLIENTS -j 2 -T 10 -f pgbench_minimal.sql "$URL"
--
-- Run it on the same machine and in the same run as the layer's figures; report the ratio.
\set k random(1, 2000000000)
INSERT INTO pgb_records (k, status, fingerprint, lease) VALUES (:k::text || '-' || :client_id, 'in_progress', 'f', 'l') ON CONFLICT DO NOTHING;
UPDATE pgb_records SET status = 'completed', status_code = 201, body = '{"id":1,"amount":1999}' WHERE k = :k::text || '-' || :client_id AND lease = 'l';
