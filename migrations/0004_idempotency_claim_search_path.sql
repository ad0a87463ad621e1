-- axum-idempotency: the claim function resolves names in the table's schema only.
--
-- PostgresStore::migrate() applies this after 0003 when the function has no search path of its
-- own, with the function named in the table's schema and that schema in place of `public` below.
-- To manage it with your own migration tool, copy this file, naming the function and the schema
-- as your table's (`billing.idempotency_records_claim_v2` and `billing`, say).
--
-- Without it, the function's statements resolve `idempotency_records` through the caller's
-- search path: a role that may create objects in a schema earlier on that path could put a table
-- of that name there and receive every claim. `pg_catalog` first keeps built-in functions and
-- operators from being shadowed; `pg_temp` last keeps temporary tables out.

ALTER FUNCTION idempotency_records_claim_v2(bytea,text,text,text,bytea,bigint,double precision,double precision,bytea)
    SET search_path = pg_catalog, public, pg_temp;
