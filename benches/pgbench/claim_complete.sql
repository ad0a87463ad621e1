-- What PostgreSQL itself sustains for the two statements of a fresh-key request, as the Postgres
-- store sends them, each in its own transaction (autocommit): the claim (one call of the claim
-- function) and the completion of the record it made. The baseline of the `cpu` part of
-- benches/load.rs, which runs it as
--
--   PGOPTIONS='-c search_path=<schema>' pgbench -n -M prepared -c 8 -j 2 -T 10 \
--       -f benches/pgbench/claim_complete.sql <DATABASE_URL>
--
-- in a schema that `PostgresStore::migrate` set up. Keys are random (a clash in 9e15 is not seen).
\set n random(1, 9000000000000000)
WITH lock_bound AS MATERIALIZED (SELECT set_config('lock_timeout', '4000ms', true) AS bound) SELECT c.* FROM idempotency_records_claim_v2(sha256(('pgbench-' || :n)::bytea), 'pgbench-' || :n, 'user-' || :client_id, 'POST /checkout', sha256('{}'::bytea), :n, 86490000000.0, 90000000.0, substring(sha256((:n)::text::bytea) for 16)) c WHERE (SELECT bound FROM lock_bound) IS NOT NULL;
WITH lock_bound AS MATERIALIZED (SELECT set_config('lock_timeout', '4000ms', true) AS bound), done AS (UPDATE idempotency_records SET status = 'completed', response_status = 201, header_names = ARRAY['content-type', 'location'], header_values = ARRAY['application/json'::bytea, '/charges/1'::bytea], response_body = '{"id":1,"status":"succeeded"}'::bytea, updated_at = clock_timestamp(), expires_at = clock_timestamp() + 86400000000.0 * interval '1 microsecond' WHERE scope = sha256(('pgbench-' || :n)::bytea) AND lease_token = :n AND lease_token <> 0 AND status = 'in_progress' AND (SELECT bound FROM lock_bound) IS NOT NULL RETURNING 1) SELECT EXISTS (SELECT 1 FROM done) OR EXISTS (SELECT 1 FROM idempotency_records WHERE scope = sha256(('pgbench-' || :n)::bytea) AND lease_token = :n AND status <> 'in_progress') AS held;
