-- axum-idempotency: the claims of many keys in one statement (statements together).
--
-- PostgresStore::migrate() applies this file after 0007, with the table name it was configured
-- with in place of `idempotency_records` (the function is named after the table) and the table's
-- schema in place of `public` in the function's search path. To manage it with your own
-- migration tool instead, copy this file into your migrations too (naming the function and the
-- schema as your table's). Without the function, claims go one statement each, as before.
--
-- One call claims many keys, each as the claim function (migrations/0006) claims one, and
-- answers one row per key, in input order (`ord`, from 1), with that function's columns. Its
-- statement is planned when the function runs, after the caller's statement has set its lock
-- timeout: a table locked by another program (a migration, `VACUUM FULL`) makes the call wait
-- within that timeout, never longer than the client waits for its answer.
--
-- A key whose record is there as the statement's snapshot shows it is not inserted, only read:
-- the call never waits on the lock of a row that is there (a handler's transaction holding the
-- record it completed); such a record is answered as last committed. The insert can still meet
-- a row inserted since the snapshot was taken: it waits for that claim's commit, inserts nothing,
-- and the snapshot has no row to read, so that key gets no answer row and the caller claims it
-- again on its own. Keys are inserted in the order of their scopes, so that two calls inserting
-- the same keys wait on each other in one order, never in a cycle.

CREATE OR REPLACE FUNCTION idempotency_records_claim_many(
    p_scope bytea[], p_key text[], p_subject text[], p_endpoint text[], p_fingerprint bytea[],
    p_lease bigint[], p_lifetime_us double precision[], p_ttl_us double precision[],
    p_generation bytea[])
RETURNS TABLE (ord bigint, inserted boolean, status text, lease_token bigint, same_fp boolean,
               stale boolean, expired boolean, response_status smallint, header_names text[],
               header_values bytea[], response_body bytea, expires_in double precision,
               generation bytea)
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, public, pg_temp
AS $claim$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    WITH asked AS MATERIALIZED (
        SELECT * FROM unnest(p_scope, p_key, p_subject, p_endpoint, p_fingerprint, p_lease,
                             p_lifetime_us, p_ttl_us, p_generation) WITH ORDINALITY
            AS a(a_scope, a_key, a_subject, a_endpoint, a_fingerprint, a_lease, a_lifetime_us,
                 a_ttl_us, a_generation, a_ord)),
    ins AS (
        INSERT INTO idempotency_records AS r
            (scope, idempotency_key, subject, endpoint, fingerprint, status, lease_token, expires_at,
             generation, in_progress_ttl_us)
        SELECT a.a_scope, a.a_key, a.a_subject, a.a_endpoint, a.a_fingerprint, 'in_progress',
               a.a_lease, now() + a.a_lifetime_us * interval '1 microsecond', a.a_generation,
               a.a_ttl_us
        FROM asked a
        WHERE NOT EXISTS (SELECT 1 FROM idempotency_records x WHERE x.scope = a.a_scope)
        ORDER BY a.a_scope
        ON CONFLICT DO NOTHING
        RETURNING r.scope AS i_scope)
    SELECT a.a_ord, true, NULL::text, NULL::bigint, NULL::boolean, NULL::boolean, NULL::boolean,
           NULL::smallint, NULL::text[], NULL::bytea[], NULL::bytea, NULL::double precision,
           a.a_generation
    FROM asked a WHERE EXISTS (SELECT 1 FROM ins WHERE ins.i_scope = a.a_scope)
    UNION ALL
    SELECT a.a_ord, false, r.status, r.lease_token, r.fingerprint = a.a_fingerprint,
           r.updated_at <= now() - GREATEST(a.a_ttl_us, coalesce(r.in_progress_ttl_us, 0))
                                   * interval '1 microsecond',
           r.expires_at <= now(), r.response_status, r.header_names, r.header_values,
           CASE WHEN r.fingerprint = a.a_fingerprint THEN r.response_body END,
           extract(epoch FROM r.expires_at - now())::double precision, r.generation
    FROM asked a JOIN idempotency_records r ON r.scope = a.a_scope
    WHERE NOT EXISTS (SELECT 1 FROM ins WHERE ins.i_scope = a.a_scope);
END
$claim$;
