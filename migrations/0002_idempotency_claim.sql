-- axum-idempotency: the claim, as one function, so that every claim is one round trip.
--
-- PostgresStore::migrate() applies this file after 0001, with the table name it was configured with
-- in place of `idempotency_records` (the function is named after the table). To manage it with your
-- own migration tool instead, copy this file into your migrations too. Without it, the store falls
-- back to sending the two statements below one by one (it logs a warning).
--
-- The claim inserts the record in state `in_progress`, or reads the record that is there (`same_fp`,
-- `stale` and `expired` let the caller answer 409, 422, a replay or a retake). When many requests
-- with one key arrive at once, the insert of all but one waits for the winner's insert to commit,
-- then does nothing; the read in that same query cannot see the winner's row (its snapshot is
-- older). A function marked VOLATILE takes a new snapshot for each query, so the second query below
-- sees it, without another round trip from the application.
--
-- Parameters: scope, key, subject, endpoint, fingerprint, lease token, lifetime (microseconds), and
-- in-progress TTL (microseconds).

CREATE OR REPLACE FUNCTION idempotency_records_claim_v1(
    p_scope bytea, p_key text, p_subject text, p_endpoint text, p_fingerprint bytea,
    p_lease bigint, p_lifetime_us double precision, p_ttl_us double precision)
RETURNS TABLE (inserted boolean, status text, lease_token bigint, same_fp boolean,
               stale boolean, expired boolean, response_status smallint, header_names text[],
               header_values bytea[], response_body bytea, expires_in double precision)
LANGUAGE plpgsql VOLATILE AS $claim$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    WITH ins AS (
        INSERT INTO idempotency_records AS r
            (scope, idempotency_key, subject, endpoint, fingerprint, status, lease_token, expires_at)
        VALUES (p_scope, p_key, p_subject, p_endpoint, p_fingerprint, 'in_progress', p_lease,
                now() + p_lifetime_us * interval '1 microsecond')
        ON CONFLICT DO NOTHING
        RETURNING r.lease_token)
    SELECT true, NULL::text, NULL::bigint, NULL::boolean, NULL::boolean, NULL::boolean,
           NULL::smallint, NULL::text[], NULL::bytea[], NULL::bytea, NULL::double precision
    FROM ins
    UNION ALL
    SELECT false, r.status, r.lease_token, r.fingerprint = p_fingerprint,
           r.updated_at <= now() - p_ttl_us * interval '1 microsecond', r.expires_at <= now(),
           r.response_status, r.header_names, r.header_values,
           CASE WHEN r.fingerprint = p_fingerprint THEN r.response_body END,
           extract(epoch FROM r.expires_at - now())::double precision
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
               extract(epoch FROM r.expires_at - now())::double precision
        FROM idempotency_records r
        WHERE r.scope = p_scope;
    END IF;
END
$claim$;
