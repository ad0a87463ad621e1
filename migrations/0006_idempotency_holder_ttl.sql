-- axum-idempotency: the holder's in-progress TTL, kept with the record.
--
-- PostgresStore::migrate() applies this file after 0004 (and before 0005), with the table name it was configured
-- with in place of `idempotency_records` (the function is named after the table) and the table's
-- schema in place of `public` in the function's search path. To manage it with your own migration
-- tool instead, copy this file into your migrations too (naming the function and the schema as
-- your table's), and apply it before this version of the crate serves claims.
--
-- A claim presumes a record in progress abandoned once its holder has not renewed it for an
-- in-progress TTL. The holder renews on its own TTL's schedule (every third of it); a claimer
-- configured with a shorter TTL (a rolling deploy that lowers it, say) would have retaken the
-- record of a live holder and run its handler a second time. The record now keeps its holder's
-- TTL, and a claim waits for the longer of the two. Records written before this column existed
-- have none (NULL): for them the claimer's TTL decides, as before.
--
-- The claim function is the one of 0003 with the holder's TTL added, and its search path set as
-- 0004 sets it (`CREATE OR REPLACE` would otherwise reset it).

ALTER TABLE idempotency_records ADD COLUMN IF NOT EXISTS in_progress_ttl_us double precision;

CREATE OR REPLACE FUNCTION idempotency_records_claim_v2(
    p_scope bytea, p_key text, p_subject text, p_endpoint text, p_fingerprint bytea,
    p_lease bigint, p_lifetime_us double precision, p_ttl_us double precision,
    p_generation bytea)
RETURNS TABLE (inserted boolean, status text, lease_token bigint, same_fp boolean,
               stale boolean, expired boolean, response_status smallint, header_names text[],
               header_values bytea[], response_body bytea, expires_in double precision,
               generation bytea)
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, public, pg_temp
AS $claim$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    WITH ins AS (
        INSERT INTO idempotency_records AS r
            (scope, idempotency_key, subject, endpoint, fingerprint, status, lease_token, expires_at,
             generation, in_progress_ttl_us)
        VALUES (p_scope, p_key, p_subject, p_endpoint, p_fingerprint, 'in_progress', p_lease,
                now() + p_lifetime_us * interval '1 microsecond', p_generation, p_ttl_us)
        ON CONFLICT DO NOTHING
        RETURNING r.lease_token)
    SELECT true, NULL::text, NULL::bigint, NULL::boolean, NULL::boolean, NULL::boolean,
           NULL::smallint, NULL::text[], NULL::bytea[], NULL::bytea, NULL::double precision,
           p_generation
    FROM ins
    UNION ALL
    SELECT false, r.status, r.lease_token, r.fingerprint = p_fingerprint,
           r.updated_at <= now() - GREATEST(p_ttl_us, coalesce(r.in_progress_ttl_us, 0))
                                   * interval '1 microsecond',
           r.expires_at <= now(),
           r.response_status, r.header_names, r.header_values,
           CASE WHEN r.fingerprint = p_fingerprint THEN r.response_body END,
           extract(epoch FROM r.expires_at - now())::double precision, r.generation
    FROM idempotency_records r
    WHERE r.scope = p_scope AND NOT EXISTS (SELECT 1 FROM ins);
    IF NOT FOUND THEN
        -- The insert met a row committed after that query's snapshot was taken: this one sees it.
        -- (No row: it was released in between; the caller answers 409 and the retry settles it.)
        RETURN QUERY
        SELECT false, r.status, r.lease_token, r.fingerprint = p_fingerprint,
               r.updated_at <= now() - GREATEST(p_ttl_us, coalesce(r.in_progress_ttl_us, 0))
                                       * interval '1 microsecond',
               r.expires_at <= now(), r.response_status, r.header_names, r.header_values,
               CASE WHEN r.fingerprint = p_fingerprint THEN r.response_body END,
               extract(epoch FROM r.expires_at - now())::double precision, r.generation
        FROM idempotency_records r
        WHERE r.scope = p_scope;
    END IF;
END
$claim$;
