-- axum-idempotency: the record's generation, and the claim function that keeps it.
--
-- PostgresStore::migrate() applies this file after 0001 and 0002, with the table name it was
-- configured with in place of `idempotency_records` (the function is named after the table). To
-- manage it with your own migration tool instead, copy this file into your migrations too, and
-- apply it before this version of the crate serves claims.
--
-- `generation` is 16 random bytes chosen when a key is first claimed, kept by retakes of the record
-- and new when the key is claimed again after its record expired or was deleted; the derived key
-- handed to downstream providers includes it, so it names one operation only. Records written
-- before this column existed have none (NULL) and keep the derived key they had.
--
-- The claim function is the one of 0002 with the generation added: a new record gets
-- `p_generation`, and every answer returns the record's generation.

ALTER TABLE idempotency_records ADD COLUMN IF NOT EXISTS generation bytea;

CREATE OR REPLACE FUNCTION idempotency_records_claim_v2(
    p_scope bytea, p_key text, p_subject text, p_endpoint text, p_fingerprint bytea,
    p_lease bigint, p_lifetime_us double precision, p_ttl_us double precision,
    p_generation bytea)
RETURNS TABLE (inserted boolean, status text, lease_token bigint, same_fp boolean,
               stale boolean, expired boolean, response_status smallint, header_names text[],
               header_values bytea[], response_body bytea, expires_in double precision,
               generation bytea)
LANGUAGE plpgsql VOLATILE AS $claim$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    WITH ins AS (
        INSERT INTO idempotency_records AS r
            (scope, idempotency_key, subject, endpoint, fingerprint, status, lease_token, expires_at,
             generation)
        VALUES (p_scope, p_key, p_subject, p_endpoint, p_fingerprint, 'in_progress', p_lease,
                now() + p_lifetime_us * interval '1 microsecond', p_generation)
        ON CONFLICT DO NOTHING
        RETURNING r.lease_token)
    SELECT true, NULL::text, NULL::bigint, NULL::boolean, NULL::boolean, NULL::boolean,
           NULL::smallint, NULL::text[], NULL::bytea[], NULL::bytea, NULL::double precision,
           p_generation
    FROM ins
    UNION ALL
    SELECT false, r.status, r.lease_token, r.fingerprint = p_fingerprint,
           r.updated_at <= now() - p_ttl_us * interval '1 microsecond', r.expires_at <= now(),
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
               r.updated_at <= now() - p_ttl_us * interval '1 microsecond',
               r.expires_at <= now(), r.response_status, r.header_names, r.header_values,
               CASE WHEN r.fingerprint = p_fingerprint THEN r.response_body END,
               extract(epoch FROM r.expires_at - now())::double precision, r.generation
        FROM idempotency_records r
        WHERE r.scope = p_scope;
    END IF;
END
$claim$;
