//! The statements on the table: written once per store, every name quoted and, once `migrate()`
//! has found the table, qualified by its schema.

use super::sql::{LOCK_BOUND, RELEASED, lock_and_idle_bound_cte, lock_bound_cte, quote_ident};

/// Rows removed per statement by `purge_expired`, so no single statement holds locks for long.
pub(super) const PURGE_BATCH: i64 = 10_000;

/// The statements of one store on its table.
pub(super) struct Statements {
    /// The table's name as configured, for messages.
    pub(super) table: String,
    /// The schema every statement names, if any: the configured one, or the one `migrate()` found
    /// the table in.
    pub(super) schema: Option<String>,
    /// The table name as written in SQL: every part quoted, so reserved words work.
    pub(super) quoted: String,
    /// The expiry index's name, quoted.
    pub(super) index: String,
    /// The expiry index's name, quoted and qualified like the table.
    pub(super) qualified_index: String,
    /// The subject index's name (the listing's, migrations/0005), quoted.
    pub(super) subject_index: String,
    /// The subject index's name, quoted and qualified like the table.
    pub(super) qualified_subject_index: String,
    /// The claim function that keeps generations (migrations/0003), quoted and qualified like the
    /// table.
    pub(super) function_v2: String,
    /// The function that claims many keys (migrations/0008), quoted and qualified like the table.
    pub(super) function_many: String,
    /// Since when that function has been found missing (`migrate()` has not run since this
    /// version): claims then go one statement each, and look for it again a minute later.
    pub(super) many_missing: std::sync::Mutex<Option<std::time::Instant>>,
    /// Since when the claim function has been found missing (the table was made by an earlier
    /// version and `migrate()` has not run since): claims then send its two queries one by one,
    /// and look for the function again a minute later (another instance may have migrated).
    pub(super) function_missing: std::sync::Mutex<Option<std::time::Instant>>,
    /// The claim: one call of the claim function.
    pub(super) claim: String,
    /// The claim function's first query, sent on its own when the function is missing.
    pub(super) claim_direct: String,
    pub(super) retake: String,
    pub(super) renew: String,
    /// The lease keeper's renewal of many leases in one statement.
    pub(super) renew_many: String,
    pub(super) complete: String,
    /// The completion in a handler's transaction: `complete`, bounding the transaction's idle
    /// time from then on by `$10`.
    pub(super) complete_in: String,
    pub(super) finished_by: String,
    pub(super) release: String,
    /// A step recorded by the lease that holds the record in progress (migrations/0009).
    pub(super) record_step: String,
    /// The steps of the operation whose record the lease holds in progress.
    pub(super) steps: String,
    /// Claims, completions and releases of many records in one statement (see `batched.rs`).
    pub(super) claim_many: String,
    pub(super) complete_many: String,
    pub(super) release_many: String,
    pub(super) purge: String,
    pub(super) check_shape: String,
    /// Whether a row of the scope `$1` exists, as last committed: a plain read, which waits on no
    /// row lock.
    pub(super) exists: String,
    /// Lookup, delete and listing (see `inspect.rs`).
    pub(super) inspection: Inspection,
}

impl Statements {
    /// The statements on `table` as configured (`schema.table` or `table`, validated).
    pub(super) fn new(table: &str) -> Self {
        match table.rsplit_once('.') {
            Some((schema, name)) => Self::on(Some(schema), name, table),
            None => Self::on(None, table, table),
        }
    }

    /// The statements on `name` in `schema` (or wherever the search path finds it), named
    /// `display` in messages. Every identifier is quoted.
    pub(super) fn on(schema: Option<&str>, name: &str, display: &str) -> Self {
        let qualify = |object: &str| match schema {
            Some(schema) => format!("{}.{}", quote_ident(schema), quote_ident(object)),
            None => quote_ident(object),
        };
        let quoted = qualify(name);
        let function_v2 = qualify(&format!("{name}_claim_v2"));
        let function_many = qualify(&format!("{name}_claim_many"));
        let t = &quoted;
        Statements {
            table: display.to_owned(),
            schema: schema.map(str::to_owned),
            index: quote_ident(&format!("{name}_expires_at_idx")),
            qualified_index: qualify(&format!("{name}_expires_at_idx")),
            subject_index: quote_ident(&format!("{name}_subject_idx")),
            qualified_subject_index: qualify(&format!("{name}_subject_idx")),
            function_missing: std::sync::Mutex::new(None),
            many_missing: std::sync::Mutex::new(None),
            // $9: the generation of a new record; $10: the lock timeout (see `LOCK_BOUND`).
            claim: format!(
                "{} SELECT c.* FROM {function_v2}($1, $2, $3, $4, $5, $6, $7, $8, $9) c \
                 WHERE {LOCK_BOUND}",
                lock_bound_cte(10),
            ),
            // The claim function's first query (migrations/0002): insert, or read the record that
            // is there. `same_fp` and the response columns let the caller answer 409, 422 or a
            // replay without another query; the body is only sent back when it can be replayed.
            // $1 scope, $2 key, $3 subject, $4 endpoint, $5 fingerprint, $6 lease, $7 lifetime
            // (µs), $8 in-progress TTL (µs).
            // $9 generation of a new record, $10 lock timeout.
            claim_direct: format!(
                "{}, ins AS ( \
                   INSERT INTO {t} (scope, idempotency_key, subject, endpoint, fingerprint, status, \
                                    lease_token, expires_at, generation, in_progress_ttl_us) \
                   SELECT $1, $2, $3, $4, $5, 'in_progress', $6, \
                          now() + $7::float8 * interval '1 microsecond', $9, $8::float8 \
                   WHERE {LOCK_BOUND} \
                   ON CONFLICT DO NOTHING \
                   RETURNING lease_token) \
                 SELECT true AS inserted, NULL::text AS status, NULL::bigint AS lease_token, \
                        NULL::bool AS same_fp, NULL::bool AS stale, NULL::bool AS expired, \
                        NULL::smallint AS response_status, NULL::text[] AS header_names, \
                        NULL::bytea[] AS header_values, NULL::bytea AS response_body, \
                        NULL::float8 AS expires_in, $9::bytea AS generation \
                 FROM ins \
                 UNION ALL \
                 SELECT false, status, lease_token, fingerprint = $5, \
                        updated_at <= now() - GREATEST($8::float8, coalesce(in_progress_ttl_us, 0)) \
                                              * interval '1 microsecond', \
                        expires_at <= now(), response_status, header_names, header_values, \
                        CASE WHEN fingerprint = $5 THEN response_body END, \
                        extract(epoch FROM expires_at - now())::float8, generation \
                 FROM {t} WHERE scope = $1 AND NOT EXISTS (SELECT 1 FROM ins)",
                lock_bound_cte(10)
            ),
            // Compare-and-swap on the lease token and the state read: of concurrent retakers only one
            // matches, and a late completion by the presumed-dead worker makes this match nothing.
            // The staleness is checked again against the row as it is now (READ COMMITTED rechecks
            // the newest version), so a heartbeat that landed since the claim read it wins.
            // $1 scope, $2 fingerprint, $3 new lease, $4 lifetime (µs), $5 old lease, $6 old status,
            // $7 in-progress TTL (µs; the row keeps it as its holder's, and a holder with a longer
            // one is not stale before it), $8 lock timeout, $9 generation (for an expired record, or
            // a released one taken by another request; a retake of the same operation keeps its
            // own; so does its creation time, as in every store). It answers the generation it
            // left, which is the run's: the row may have been taken and released again since the
            // claim read it (every released row has lease 0).
            // The row already under the new lease matches too: the same retake sent again (its
            // connection was lost after the first one committed) is granted again, not refused as a
            // lost race, which would leave the key in progress with no worker for a TTL.
            // A held record (not released, not expired) is taken only when:
            // - no live keeper shows its lease's presence: the lock of `(NAMESPACE, presence)`,
            //   which keepers hold shared, is free for this statement to take exclusive (see
            //   `presence.rs`). Held for its transaction only;
            // - a claim marked it silent (`suspected_at`) a TTL ago at least, on this very server
            //   process (`suspected_on`, its start time), and it was not renewed since (a renewal
            //   removes the mark). The first claim to find it stale, its presence not shown, only
            //   marks it (`marked`): a failover, a restart, a backend crash, a pooler restarted
            //   end a live holder's presence and stop its renewals, and the mark, a write, starts
            //   the holder's TTL at a time this server took writes (migrations/0007). A mark made
            //   before a restart or a failover does not count after it, even if the renewals that
            //   followed it were lost with the old primary. A record whose presence is shown is
            //   not marked: a mark made while the holder was known alive would let a failover
            //   just after it count the time before it against the holder. The presence's lock is
            //   asked for last (the `CASE`: the planner orders a flat list of conditions by cost),
            //   so that a record found renewed is not locked from its keeper (a renewal that
            //   lands while this statement runs may still find the lock taken, for this
            //   statement's transaction).
            retake: format!(
                "{LOCK_BOUND_CTE}, took AS ( \
                 UPDATE {t} SET fingerprint = $2, status = 'in_progress', lease_token = $3, \
                   generation = CASE WHEN status = 'in_progress' AND expires_at > now() \
                                       AND fingerprint = $2 THEN generation ELSE $9 END, \
                   response_status = NULL, header_names = NULL, header_values = NULL, \
                   response_body = NULL, \
                   created_at = CASE WHEN status = 'in_progress' AND expires_at > now() \
                                       AND lease_token <> 0 THEN created_at ELSE now() END, \
                   updated_at = now(), \
                   expires_at = now() + $4::float8 * interval '1 microsecond', \
                   in_progress_ttl_us = $7::float8, suspected_at = NULL, suspected_on = NULL \
                 WHERE scope = $1 \
                   AND ((lease_token = $5 AND status = $6 \
                         AND (expires_at <= now() \
                              OR (status = 'in_progress' AND updated_at <= now() - {HOLDER_TTL} \
                                  AND (lease_token = {RELEASED} \
                                       OR (suspected_at >= updated_at \
                                           AND suspected_at <= now() - {HOLDER_TTL} \
                                           AND suspected_on = pg_postmaster_start_time() \
                                           AND pg_try_advisory_xact_lock({PRESENCE}, \
                                                (lease_token >> 32)::int4)))))) \
                        OR (lease_token = $3 AND status = 'in_progress')) \
                   AND {LOCK_BOUND} \
                 RETURNING generation), \
                 marked AS ( \
                 UPDATE {t} SET suspected_at = now(), suspected_on = pg_postmaster_start_time() \
                 WHERE scope = $1 AND NOT EXISTS (SELECT 1 FROM took) AND {LOCK_BOUND} \
                   AND CASE WHEN lease_token = $5 AND lease_token <> {RELEASED} \
                                 AND status = 'in_progress' AND expires_at > now() \
                                 AND updated_at <= now() - {HOLDER_TTL} \
                                 AND (suspected_at IS NULL OR suspected_at < updated_at \
                                      OR suspected_on IS DISTINCT FROM pg_postmaster_start_time()) \
                            THEN pg_try_advisory_xact_lock({PRESENCE}, (lease_token >> 32)::int4) \
                            ELSE false END) \
                 SELECT generation FROM took",
                LOCK_BOUND_CTE = lock_bound_cte(8),
                PRESENCE = super::presence::NAMESPACE,
                HOLDER_TTL = "GREATEST($7::float8, coalesce(in_progress_ttl_us, 0)) \
                              * interval '1 microsecond'",
            ),
            // The heartbeat. $1 scope, $2 lease, $3 lifetime (µs), $4 lock timeout.
            renew: format!(
                "{} UPDATE {t} SET updated_at = now(), suspected_at = NULL, \
                   expires_at = now() + $3::float8 * interval '1 microsecond' \
                 WHERE scope = $1 AND lease_token = $2 AND lease_token <> {RELEASED} \
                   AND status = 'in_progress' AND {LOCK_BOUND}",
                lock_bound_cte(4)
            ),
            // The lease keeper's: every pair of `$1` scopes and `$2` leases renewed as `renew`
            // renews one, but a row locked by another transaction (a handler's, holding the
            // record it completed until its commit) is skipped rather than waited for, so that
            // one such row fails no other lease of the batch. Each pair answers whether it was
            // renewed and whether its lease holds the record (as last committed): held and not
            // renewed is a row that was locked. $3 lifetime (µs), $4 lock timeout.
            renew_many: format!(
                "{}, asked AS MATERIALIZED ( \
                   SELECT * FROM unnest($1::bytea[], $2::bigint[]) AS a(scope, lease_token)), \
                 taken AS ( \
                   SELECT r.scope FROM {t} r JOIN asked a \
                     ON r.scope = a.scope AND r.lease_token = a.lease_token \
                   WHERE r.lease_token <> {RELEASED} AND r.status = 'in_progress' \
                     AND {LOCK_BOUND} \
                   FOR UPDATE OF r SKIP LOCKED), \
                 renewed AS ( \
                   UPDATE {t} r SET updated_at = now(), suspected_at = NULL, \
                     expires_at = now() + $3::float8 * interval '1 microsecond' \
                   FROM taken WHERE r.scope = taken.scope \
                   RETURNING r.scope, r.lease_token) \
                 SELECT a.scope, a.lease_token, \
                   EXISTS (SELECT 1 FROM renewed WHERE renewed.scope = a.scope \
                           AND renewed.lease_token = a.lease_token) AS renewed, \
                   EXISTS (SELECT 1 FROM {t} r WHERE r.scope = a.scope \
                           AND r.lease_token = a.lease_token AND r.lease_token <> {RELEASED} \
                           AND r.status = 'in_progress') AS held \
                 FROM asked a",
                lock_bound_cte(4)
            ),
            // Finish the record if the lease holds it in progress; a record this lease already
            // finished (an earlier attempt committed but its answer was lost) also counts as done.
            // $1 scope, $2 lease, $3 status, $4 response status, $5 names, $6 values, $7 body,
            // $8 retention (µs), $9 lock timeout. The statement's own clock, not `now()`: inside
            // a handler's transaction `now()` is when the transaction began, which may be long ago.
            complete: completion(t, &lock_bound_cte(9)),
            complete_in: completion(t, &lock_and_idle_bound_cte(9, 10)),
            // Whether `lease` finished the record: asked again, in a statement of its own, when a
            // completion matched nothing (a concurrent attempt by the same lease may have finished
            // it after the completion's snapshot was taken). $1 scope, $2 lease.
            finished_by: format!(
                "SELECT EXISTS (SELECT 1 FROM {t} WHERE scope = $1 AND lease_token = $2 \
                                AND status <> 'in_progress')"
            ),
            // Not deleted: left in progress under no lease (`RELEASED`) and stale at once, so the
            // next claim retakes it, keeping its generation for the same request (the retry of a
            // released run is the same operation to a provider). $3 lock timeout.
            release: format!(
                "{} UPDATE {t} SET lease_token = {RELEASED}, updated_at = '-infinity' \
                 WHERE scope = $1 AND lease_token = $2 AND lease_token <> {RELEASED} \
                   AND status = 'in_progress' AND {LOCK_BOUND}",
                lock_bound_cte(3)
            ),
            // A step of the operation, appended while the lease holds the record in progress;
            // steps of another generation are the record's earlier operation's, and go. A name
            // recorded already (the same write, sent again after its answer was lost) is kept as
            // it was. $3 name, $4 result, $5 lock timeout.
            record_step: format!(
                "{} UPDATE {t} SET \
                   step_names = CASE \
                     WHEN steps_generation IS DISTINCT FROM generation THEN ARRAY[$3::text] \
                     WHEN $3::text = ANY (step_names) THEN step_names \
                     ELSE array_append(step_names, $3::text) END, \
                   step_results = CASE \
                     WHEN steps_generation IS DISTINCT FROM generation THEN ARRAY[$4::bytea] \
                     WHEN $3::text = ANY (step_names) THEN step_results \
                     ELSE array_append(step_results, $4::bytea) END, \
                   steps_generation = generation \
                 WHERE scope = $1 AND lease_token = $2 AND lease_token <> {RELEASED} \
                   AND status = 'in_progress' AND {LOCK_BOUND}",
                lock_bound_cte(5)
            ),
            // A plain read (it waits on no lock): the row when the lease holds it in progress,
            // with its steps when they are its operation's.
            steps: format!(
                "SELECT CASE WHEN steps_generation IS NOT DISTINCT FROM generation \
                          THEN step_names END, \
                        CASE WHEN steps_generation IS NOT DISTINCT FROM generation \
                          THEN step_results END \
                 FROM {t} WHERE scope = $1 AND lease_token = $2 AND lease_token <> {RELEASED} \
                   AND status = 'in_progress'"
            ),
            // Many claims in one statement (SPEC 26): one call of the function of
            // migrations/0008, one answer row per claim with the columns of `claim_direct` and its
            // input's place (`ord`, from 1). Arrays, one element per claim: $1 scope, $2 key, $3
            // subject, $4 endpoint, $5 fingerprint, $6 lease, $7 lifetime (µs), $8 in-progress TTL
            // (µs), $9 generation; $10 lock timeout. The function's statement is planned (and the
            // table locked) as it runs, after the lock timeout is set: a top-level INSERT would
            // take its lock at planning, before, and wait on a table locked by another program
            // with no bound on the server.
            claim_many: format!(
                "{} SELECT c.* FROM {function_many}($1, $2, $3, $4, $5, $6, $7, $8, $9) c \
                 WHERE {LOCK_BOUND}",
                lock_bound_cte(10),
            ),
            // Many completions in one statement, each as `complete` finishes one. Arrays, one
            // element per completion: $1 scope, $2 lease, $3 status, $4 response status, $5 where
            // its headers start in $7 and $8 (from 0), $6 how many it has, $9 body, $10 retention
            // (µs); $7 every completion's header names, $8 their values, one after another; $11
            // lock timeout. The rows are locked in scope order, and a row another transaction
            // holds is skipped rather than waited for: it answers `locked` and goes again alone,
            // so one such row delays no other completion of the batch. Per input (`ord`, from
            // 1): whether the lease finished the record (now, or before: an earlier attempt whose
            // answer was lost), and whether its row was skipped for a lock.
            complete_many: format!(
                "{}, asked AS MATERIALIZED ( \
                   SELECT * FROM unnest($1::bytea[], $2::int8[], $3::text[], $4::int2[], \
                                        $5::int4[], $6::int4[], $9::bytea[], $10::float8[]) \
                     WITH ORDINALITY AS a(scope, lease_token, status, response_status, \
                                          first_header, headers, response_body, retention_us, \
                                          ord)), \
                 taken AS ( \
                   SELECT r.scope FROM {t} r JOIN asked a \
                     ON r.scope = a.scope AND r.lease_token = a.lease_token \
                   WHERE r.lease_token <> {RELEASED} AND r.status = 'in_progress' AND {LOCK_BOUND} \
                   ORDER BY r.scope \
                   FOR UPDATE OF r SKIP LOCKED), \
                 done AS ( \
                   UPDATE {t} r SET status = a.status, response_status = a.response_status, \
                     header_names = ARRAY(SELECT ($7::text[])[i] FROM generate_series( \
                       a.first_header + 1, a.first_header + a.headers) AS i ORDER BY i), \
                     header_values = ARRAY(SELECT ($8::bytea[])[i] FROM generate_series( \
                       a.first_header + 1, a.first_header + a.headers) AS i ORDER BY i), \
                     response_body = a.response_body, updated_at = clock_timestamp(), \
                     expires_at = clock_timestamp() + a.retention_us * interval '1 microsecond' \
                   FROM asked a \
                   WHERE r.scope = a.scope AND r.scope IN (SELECT scope FROM taken) \
                   RETURNING r.scope) \
                 SELECT a.ord, \
                   EXISTS (SELECT 1 FROM done WHERE done.scope = a.scope) \
                     OR EXISTS (SELECT 1 FROM {t} r WHERE r.scope = a.scope \
                                AND r.lease_token = a.lease_token AND r.status <> 'in_progress') \
                     AS held, \
                   NOT EXISTS (SELECT 1 FROM done WHERE done.scope = a.scope) \
                     AND EXISTS (SELECT 1 FROM {t} r WHERE r.scope = a.scope \
                                 AND r.lease_token = a.lease_token \
                                 AND r.lease_token <> {RELEASED} AND r.status = 'in_progress') \
                     AS locked \
                 FROM asked a",
                lock_bound_cte(11)
            ),
            // Many releases in one statement, each as `release` releases one; a row another
            // transaction holds is skipped (`locked`) and goes again alone. $1 scopes, $2 leases,
            // $3 lock timeout. Per input (`ord`, from 1): released, locked.
            release_many: format!(
                "{}, asked AS MATERIALIZED ( \
                   SELECT * FROM unnest($1::bytea[], $2::int8[]) WITH ORDINALITY \
                     AS a(scope, lease_token, ord)), \
                 taken AS ( \
                   SELECT r.scope FROM {t} r JOIN asked a \
                     ON r.scope = a.scope AND r.lease_token = a.lease_token \
                   WHERE r.lease_token <> {RELEASED} AND r.status = 'in_progress' AND {LOCK_BOUND} \
                   ORDER BY r.scope \
                   FOR UPDATE OF r SKIP LOCKED), \
                 done AS ( \
                   UPDATE {t} r SET lease_token = {RELEASED}, updated_at = '-infinity' \
                   FROM taken WHERE r.scope = taken.scope \
                   RETURNING r.scope) \
                 SELECT a.ord, EXISTS (SELECT 1 FROM done WHERE done.scope = a.scope) AS released, \
                   NOT EXISTS (SELECT 1 FROM done WHERE done.scope = a.scope) \
                     AND EXISTS (SELECT 1 FROM {t} r WHERE r.scope = a.scope \
                                 AND r.lease_token = a.lease_token \
                                 AND r.lease_token <> {RELEASED} AND r.status = 'in_progress') \
                     AS locked \
                 FROM asked a",
                lock_bound_cte(3)
            ),
            // $1 lock timeout.
            purge: format!(
                "{} DELETE FROM {t} WHERE ctid IN \
                   (SELECT ctid FROM {t} WHERE expires_at <= now() LIMIT {PURGE_BATCH}) \
                   AND {LOCK_BOUND}",
                lock_bound_cte(1)
            ),
            check_shape: format!("SELECT scope, idempotency_key, lease_token FROM {t} LIMIT 0"),
            exists: format!("SELECT EXISTS (SELECT 1 FROM {t} WHERE scope = $1)"),
            inspection: Inspection::on(t),
            function_v2,
            function_many,
            quoted,
        }
    }
}

/// Finish the record if the lease holds it in progress; a record this lease already finished (an
/// earlier attempt committed but its answer was lost) also counts as done. $1 scope, $2 lease, $3
/// status, $4 response status, $5 names, $6 values, $7 body, $8 retention (µs), $9 lock timeout
/// (and $10 for `complete_in`). The statement's own clock, not `now()`: inside a handler's
/// transaction `now()` is when the transaction began, which may be long ago.
fn completion(t: &str, cte: &str) -> String {
    format!(
        "{cte}, done AS ( \
           UPDATE {t} SET status = $3, response_status = $4, header_names = $5, \
             header_values = $6, response_body = $7, updated_at = clock_timestamp(), \
             expires_at = clock_timestamp() + $8::float8 * interval '1 microsecond' \
           WHERE scope = $1 AND lease_token = $2 AND lease_token <> {RELEASED} \
             AND status = 'in_progress' AND {LOCK_BOUND} \
           RETURNING 1) \
         SELECT EXISTS (SELECT 1 FROM done) \
             OR EXISTS (SELECT 1 FROM {t} WHERE scope = $1 AND lease_token = $2 \
                        AND status <> 'in_progress') AS held"
    )
}

/// $1 subject, $2 limit: the subject's live records, counted up to the limit, and the sum of
/// `bytes` over them.
fn count(t: &str, bytes: &str) -> String {
    format!(
        "SELECT count(*), coalesce(sum(bytes), 0)::bigint FROM (SELECT {bytes} AS bytes \
         FROM {t} WHERE subject = $1 AND expires_at > now() LIMIT $2) live"
    )
}

/// The record's times as microseconds since the Unix epoch (exact: `extract` answers `numeric`).
const TIMES: &str = "(extract(epoch FROM created_at) * 1000000)::int8 AS created_us, \
                     (extract(epoch FROM expires_at) * 1000000)::int8 AS expires_us";
/// The inspection statements on one table (`t`, quoted and qualified as the others).
pub(super) struct Inspection {
    pub(super) lookup: String,
    /// $1 scope: the steps of the live record's operation, as `lookup` finds it live (none when
    /// another generation's); no row without a live record. A plain read: it waits on no lock.
    pub(super) recorded_steps: String,
    /// $1 subject (as its column keeps it), $2 limit: its live records, counted up to the limit
    /// on the subject index (released ones count: they are kept until their expiry), and the
    /// bytes of their answers and steps (migrations/0009).
    pub(super) count: String,
    /// `count` on a table without the steps' columns: the answers' bytes alone.
    pub(super) count_without_steps: String,
    /// Whether `count` may name the steps' columns: until a count finds them missing.
    pub(super) counts_steps: std::sync::atomic::AtomicBool,
    pub(super) delete: String,
    pub(super) list_first: String,
    pub(super) list_after: String,
}

impl Inspection {
    pub(super) fn on(t: &str) -> Self {
        // A record inspection shows: not past its expiry, not released.
        let live = format!(
            "expires_at > now() AND NOT (status = 'in_progress' AND lease_token = {RELEASED})"
        );
        // $1 subject (as its column keeps it), $2 limit; after a cursor, $3 its time (µs), $4 its
        // scope. The row comparison on the columns of the subject index lets a page start where
        // the last one ended in the index, not scan the subject's records from the first.
        let list = |after: &str| {
            format!(
                "SELECT scope, idempotency_key, endpoint, status, response_status, {TIMES} \
                 FROM {t} WHERE subject = $1 AND {live}{after} \
                 ORDER BY created_at, scope LIMIT $2"
            )
        };
        Inspection {
            // Every step the row keeps counts, whatever its generation: it takes room until a
            // step of the new one replaces it. As stored (`pg_column_size`, compressed where
            // PostgreSQL compressed them): read from the value's header, where unnesting the
            // results would read and decompress each one.
            count: count(
                t,
                "coalesce(octet_length(response_body), 0) \
                 + coalesce(pg_column_size(step_names), 0) \
                 + coalesce(pg_column_size(step_results), 0)",
            ),
            count_without_steps: count(t, "coalesce(octet_length(response_body), 0)"),
            counts_steps: std::sync::atomic::AtomicBool::new(true),
            // $1 scope. A plain read: it waits on no lock.
            lookup: format!(
                "SELECT status, response_status, {TIMES} FROM {t} WHERE scope = $1 AND {live}"
            ),
            recorded_steps: format!(
                "SELECT CASE WHEN steps_generation IS NOT DISTINCT FROM generation \
                          THEN step_names END, \
                        CASE WHEN steps_generation IS NOT DISTINCT FROM generation \
                          THEN step_results END \
                 FROM {t} WHERE scope = $1 AND {live}"
            ),
            // $1 scope, $2 lock timeout, $3 the delete's token. Only a finished, live record is
            // deleted: its answer goes, and the row stays a minute (at most to its expiry) as a
            // released record under the token in place of a fingerprint, which every claim takes
            // as a new operation and inspection does not show. So the same delete sent again
            // (its answer was lost after it committed, and the store resends it on another
            // connection) finds its own token and answers as the first did. At READ COMMITTED,
            // an UPDATE that waits on the row lock of a concurrent writer (a retake of the record
            // that just expired, another delete) checks its condition again on the row as that
            // writer left it: a row taken back in progress is never deleted, one deleted
            // meanwhile is not counted. The other answers read the statement's snapshot: a record
            // held in progress (released ones are not) as the statement began, which an UPDATE
            // of finished rows never touches, and this token's tombstone, which this statement's
            // own UPDATE cannot have written yet.
            delete: format!(
                "{}, d AS ( \
                   UPDATE {t} SET status = 'in_progress', lease_token = {RELEASED}, \
                     fingerprint = $3, response_status = NULL, header_names = NULL, \
                     header_values = NULL, response_body = NULL, updated_at = '-infinity', \
                     expires_at = LEAST(expires_at, now() + interval '1 minute') \
                   WHERE scope = $1 AND status <> 'in_progress' \
                     AND expires_at > now() AND {LOCK_BOUND} \
                   RETURNING 1) \
                 SELECT EXISTS (SELECT 1 FROM d) \
                          OR EXISTS (SELECT 1 FROM {t} WHERE scope = $1 \
                                     AND lease_token = {RELEASED} AND fingerprint = $3) \
                          AS deleted, \
                        EXISTS (SELECT 1 FROM {t} WHERE scope = $1 AND status = 'in_progress' \
                                AND lease_token <> {RELEASED} AND expires_at > now()) \
                          AS in_progress",
                lock_bound_cte(2)
            ),
            list_first: list(""),
            list_after: list(
                " AND (created_at, scope) > \
                   ('epoch'::timestamptz + $3::float8 * interval '1 microsecond', $4)",
            ),
        }
    }
}
