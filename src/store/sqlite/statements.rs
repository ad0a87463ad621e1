//! The statements on the table: written once per store, every name quoted. Calendar times are
//! bound as microseconds since the Unix epoch, read from the clock of the process that sends them
//! (every process on one SQLite file shares the machine's clock); the age of a record in progress
//! is the boot clock's (`renewed_boot_us`, see `clock.rs`), the wall clock's only for records that
//! have none.

use std::sync::Arc;

/// The lease token of a released record: no claim holds it (`LeaseToken::generate` never gives 0).
pub(super) const RELEASED: i64 = 0;

/// The table `SqliteStore::new` uses.
pub(super) const DEFAULT_TABLE: &str = "idempotency_records";

/// Rows removed per statement by `purge_expired`: each batch holds the file's write lock, so other
/// writers get it between batches.
pub(super) const PURGE_BATCH: u64 = 1_000;

/// A record inspection shows: not past its expiry (`?2`, now), not released.
const LIVE: &str = "expires_us > ?2 AND NOT (status = 'in_progress' AND lease_token = 0)";

/// The statements of one store on its table.
pub(super) struct Statements {
    /// The table's name as configured, for messages.
    pub(super) table: String,
    /// The migration (`migrations/sqlite/0001`) on this table.
    pub(super) migration: String,
    /// `migrations/sqlite/0002` on this table: the boot clock's column, added when missing.
    pub(super) boot_clock_column: String,
    /// Whether the table has the boot clock's column: one row, 0 or 1.
    pub(super) has_boot_clock: String,
    /// `migrations/sqlite/0003` on this table, statement by statement: each adds the column
    /// named first, when it is missing.
    pub(super) steps_columns: Vec<(String, String)>,
    /// Whether the table has the column `?1`: one row, 0 or 1.
    pub(super) has_column: String,
    /// A step appended while the lease holds the record in progress. ?1 scope, ?2 lease, ?3 the
    /// step's bytes in hexadecimal (see `migrations/sqlite/0003`).
    pub(super) record_step: Arc<str>,
    /// The steps of the record the lease holds in progress (NULL when another generation's).
    /// ?1 scope, ?2 lease.
    pub(super) steps: Arc<str>,
    /// The steps of the live record's operation, as `lookup` finds it live (NULL when another
    /// generation's); no row without a live record. ?1 scope, ?2 now.
    pub(super) recorded_steps: Arc<str>,
    /// ?1 scope, ?2 fingerprint: what a claim needs to decide (the body only when it can be
    /// replayed).
    pub(super) claim_read: Arc<str>,
    pub(super) insert: Arc<str>,
    pub(super) take: Arc<str>,
    pub(super) complete: Arc<str>,
    pub(super) finished_by: Arc<str>,
    pub(super) renew: Arc<str>,
    pub(super) release: Arc<str>,
    pub(super) purge: Arc<str>,
    pub(super) check_shape: Arc<str>,
    pub(super) lookup: Arc<str>,
    /// A subject's live records and the bytes of their answers and steps (`0003`).
    pub(super) count: Arc<str>,
    /// `count` on a table without the steps' column: the answers' bytes alone.
    pub(super) count_without_steps: Arc<str>,
    /// Whether `count` may name the steps' column: until a count finds it missing.
    pub(super) counts_steps: std::sync::atomic::AtomicBool,
    pub(super) delete: Arc<str>,
    pub(super) held: Arc<str>,
    /// The keeper's renewal of many leases, up to its list of `(scope, lease)` pairs: ?1 now,
    /// ?2 expiry, ?3 now on the boot clock, then the pairs from ?4 (`renew.rs` writes them and
    /// the end).
    pub(super) renew_many_head: Arc<str>,
    pub(super) list_first: Arc<str>,
    pub(super) list_after: Arc<str>,
}

impl Statements {
    /// The statements on `table` (validated: `[a-z_][a-z0-9_]*`).
    pub(super) fn new(table: &str) -> Self {
        let t = &quote_ident(table);
        let list = |after: &str| {
            format!(
                "SELECT scope, idempotency_key, endpoint, status, response_status, created_us, \
                        expires_us \
                 FROM {t} WHERE subject = ?1 AND {LIVE}{after} \
                 ORDER BY created_us, scope LIMIT ?3"
            )
        };
        Statements {
            table: table.to_owned(),
            migration: include_str!("../../../migrations/sqlite/0001_idempotency_records.sql")
                .replace("idempotency_records_expires_idx", "\u{0}e")
                .replace("idempotency_records_subject_idx", "\u{0}s")
                .replace(DEFAULT_TABLE, t)
                .replace("\u{0}e", &quote_ident(&format!("{table}_expires_idx")))
                .replace("\u{0}s", &quote_ident(&format!("{table}_subject_idx"))),
            boot_clock_column: include_str!(
                "../../../migrations/sqlite/0002_idempotency_boot_clock.sql"
            )
            .replace(DEFAULT_TABLE, t),
            has_boot_clock: format!(
                "SELECT count(*) FROM pragma_table_info({}) WHERE name = 'renewed_paired_us'",
                quote_literal(table)
            ),
            steps_columns: crate::store::sql::added_columns(include_str!(
                "../../../migrations/sqlite/0003_idempotency_steps.sql"
            ))
            .into_iter()
            .map(|(column, statement)| (column, statement.replace(DEFAULT_TABLE, t)))
            .collect(),
            has_column: format!(
                "SELECT count(*) FROM pragma_table_info({}) WHERE name = ?1",
                quote_literal(table)
            ),
            // Steps of another generation are the record's earlier operation's, and go.
            record_step: format!(
                "UPDATE {t} SET \
                   steps = CASE WHEN steps_generation IS generation \
                            THEN coalesce(steps, '') || ?3 ELSE ?3 END, \
                   steps_generation = generation \
                 WHERE scope = ?1 AND lease_token = ?2 AND lease_token <> {RELEASED} \
                   AND status = 'in_progress'"
            )
            .into(),
            steps: format!(
                "SELECT CASE WHEN steps_generation IS generation THEN steps END FROM {t} \
                 WHERE scope = ?1 AND lease_token = ?2 AND lease_token <> {RELEASED} \
                   AND status = 'in_progress'"
            )
            .into(),
            recorded_steps: format!(
                "SELECT CASE WHEN steps_generation IS generation THEN steps END FROM {t} \
                 WHERE scope = ?1 AND {LIVE}"
            )
            .into(),
            claim_read: format!(
                "SELECT status, lease_token, fingerprint = ?2 AS same_fp, updated_us, \
                        CASE WHEN renewed_paired_us = updated_us THEN renewed_boot_us END, \
                        in_progress_ttl_us, expires_us, generation, response_status, \
                        response_headers, \
                        CASE WHEN fingerprint = ?2 THEN response_body END AS response_body \
                 FROM {t} WHERE scope = ?1"
            )
            .into(),
            // A fresh key. ?1 scope, ?2 key, ?3 subject, ?4 endpoint, ?5 fingerprint, ?6 lease,
            // ?7 generation, ?8 in-progress TTL (µs), ?9 now, ?10 expiry, ?11 now on the boot
            // clock. A row committed since the claim read none is left alone (the claim reads it
            // then).
            insert: format!(
                "INSERT INTO {t} (scope, idempotency_key, subject, endpoint, fingerprint, status, \
                                 lease_token, generation, in_progress_ttl_us, created_us, \
                                 updated_us, expires_us, renewed_boot_us, renewed_paired_us) \
                 VALUES (?1, ?2, ?3, ?4, ?5, 'in_progress', ?6, ?7, ?8, ?9, ?9, ?10, ?11, ?9) \
                 ON CONFLICT (scope) DO NOTHING"
            )
            .into(),
            // Take a record that is expired, released, or in progress and abandoned (no renewal
            // for the longer of the holder's TTL and the claimer's), by compare-and-swap on the
            // lease the claim read (?8): SQLite runs one writer at a time, and this statement
            // checks its conditions on the row as the last writer left it, so of many claims that
            // read the same row exactly one takes it. The row already under the claim's own lease
            // matches too (the same take, sent again). The generation and the creation time are
            // kept by a retake of the same operation (a live record in progress, same
            // fingerprint; a released one keeps only its generation), as in every store.
            // ?1 scope, ?2 fingerprint, ?3 lease, ?4 generation, ?5 now, ?6 expiry,
            // ?7 in-progress TTL (µs), ?8 the lease read, ?9 now on the boot clock (NULL where
            // it cannot be read). The claim has looked at the holder's presence before (see
            // `presence.rs`): this statement checks its age again, as the row is now.
            take: format!(
                "UPDATE {t} SET fingerprint = ?2, status = 'in_progress', lease_token = ?3, \
                   generation = CASE WHEN status = 'in_progress' AND expires_us > ?5 \
                                      AND fingerprint = ?2 THEN generation ELSE ?4 END, \
                   created_us = CASE WHEN status = 'in_progress' AND expires_us > ?5 \
                                      AND lease_token <> {RELEASED} THEN created_us ELSE ?5 END, \
                   response_status = NULL, response_headers = NULL, response_body = NULL, \
                   updated_us = ?5, expires_us = ?6, renewed_boot_us = ?9, \
                   renewed_paired_us = ?5, \
                   in_progress_ttl_us = ?7 \
                 WHERE scope = ?1 \
                   AND ((lease_token = ?8 \
                         AND (expires_us <= ?5 \
                              OR (status = 'in_progress' AND lease_token = {RELEASED}) \
                              OR (status = 'in_progress' AND fingerprint = ?2 \
                                  AND {STALE}))) \
                        OR (lease_token = ?3 AND status = 'in_progress')) \
                 RETURNING generation"
            )
            .into(),
            // ?1 scope, ?2 lease, ?3 state, ?4 status, ?5 headers, ?6 body, ?7 now, ?8 expiry.
            complete: format!(
                "UPDATE {t} SET status = ?3, response_status = ?4, response_headers = ?5, \
                   response_body = ?6, updated_us = ?7, expires_us = ?8 \
                 WHERE scope = ?1 AND lease_token = ?2 AND lease_token <> {RELEASED} \
                   AND status = 'in_progress'"
            )
            .into(),
            // Whether the lease finished the record (an earlier completion whose answer was lost).
            finished_by: format!(
                "SELECT EXISTS (SELECT 1 FROM {t} WHERE scope = ?1 AND lease_token = ?2 \
                                AND status <> 'in_progress')"
            )
            .into(),
            renew_many_head: format!(
                "UPDATE {t} SET updated_us = ?1, expires_us = ?2, renewed_boot_us = ?3, \
                   renewed_paired_us = ?1 \
                 WHERE lease_token <> {RELEASED} AND status = 'in_progress' \
                   AND (scope, lease_token) IN (VALUES "
            )
            .into(),
            // ?1 scope, ?2 lease, ?3 now, ?4 expiry, ?5 now on the boot clock.
            renew: format!(
                "UPDATE {t} SET updated_us = ?3, expires_us = ?4, renewed_boot_us = ?5, \
                   renewed_paired_us = ?3 \
                 WHERE scope = ?1 AND lease_token = ?2 AND lease_token <> {RELEASED} \
                   AND status = 'in_progress'"
            )
            .into(),
            // Not deleted: left in progress under no lease, and stale at once, so the next claim
            // takes it (keeping its generation for the same request).
            release: format!(
                "UPDATE {t} SET lease_token = {RELEASED}, updated_us = 0 \
                 WHERE scope = ?1 AND lease_token = ?2 AND lease_token <> {RELEASED} \
                   AND status = 'in_progress'"
            )
            .into(),
            // ?1 now.
            purge: format!(
                "DELETE FROM {t} WHERE rowid IN \
                   (SELECT rowid FROM {t} WHERE expires_us <= ?1 LIMIT {PURGE_BATCH})"
            )
            .into(),
            check_shape: format!(
                "SELECT scope, idempotency_key, subject, endpoint, fingerprint, status, \
                        lease_token, generation, in_progress_ttl_us, response_status, \
                        response_headers, response_body, created_us, updated_us, expires_us, \
                        renewed_boot_us, renewed_paired_us \
                 FROM {t} LIMIT 0"
            )
            .into(),
            // ?1 scope, ?2 now.
            lookup: format!(
                "SELECT status, response_status, created_us, expires_us FROM {t} \
                 WHERE scope = ?1 AND {LIVE}"
            )
            .into(),
            // ?1 subject, ?2 now, ?3 limit: live records, released ones included (they are kept
            // until their expiry), counted on the subject index, and the bytes of their bodies.
            // Every step the row keeps counts, whatever its generation (two hex digits a byte;
            // `octet_length` reads the size, where `length` would read the text to count it).
            count: count(
                t,
                "coalesce(length(response_body), 0) + coalesce(octet_length(steps), 0) / 2",
            ),
            count_without_steps: count(t, "coalesce(length(response_body), 0)"),
            counts_steps: std::sync::atomic::AtomicBool::new(true),
            // ?1 scope, ?2 now: only a finished, live record.
            delete: format!(
                "DELETE FROM {t} WHERE scope = ?1 AND status <> 'in_progress' AND expires_us > ?2"
            )
            .into(),
            // ?1 scope, ?2 now: whether a live claim holds the record.
            held: format!(
                "SELECT EXISTS (SELECT 1 FROM {t} WHERE scope = ?1 AND status = 'in_progress' \
                                AND lease_token <> {RELEASED} AND expires_us > ?2)"
            )
            .into(),
            // ?1 subject, ?2 now, ?3 limit; after a cursor, ?4 its time (µs), ?5 its scope. The
            // row comparison on the subject index's columns starts a page where the last one
            // ended in the index.
            list_first: list("").into(),
            list_after: list(" AND (created_us, scope) > (?4, ?5)").into(),
        }
    }
}

/// `ident` as a quoted SQL identifier (a `"` inside doubled).
fn quote_ident(ident: &str) -> String {
    format!("\"{}\"", ident.replace('"', "\"\""))
}

/// `text` as an SQL string literal (a `'` inside doubled).
fn quote_literal(text: &str) -> String {
    format!("'{}'", text.replace('\'', "''"))
}

/// Whether a record in progress is stale, in the take (`?5` now, `?7` the claimer's TTL, `?9` now
/// on the boot clock): not renewed for the longer of the two TTLs, on the boot clock when the
/// record and the claimer have it, and it was written with the record's last `updated_us` (not by
/// a version that does not keep it); on the wall clock otherwise. A renewal more than a TTL in the
/// future on the boot clock is an earlier boot's: stale. (Less than that is a renewal that won the
/// file's lock while this take waited for it, after its times were read.) `decide` in `claim.rs`
/// reads the same rule.
const STALE: &str = "(CASE WHEN ?9 IS NOT NULL AND renewed_boot_us IS NOT NULL \
                            AND renewed_paired_us = updated_us \
                       THEN renewed_boot_us <= ?9 - max(?7, in_progress_ttl_us) \
                            OR renewed_boot_us > ?9 + max(?7, in_progress_ttl_us) \
                       ELSE updated_us <= ?5 - max(?7, in_progress_ttl_us) END)";

/// ?1 subject, ?2 now, ?3 limit: the subject's live records, counted up to the limit, and the sum
/// of `bytes` over them.
fn count(t: &str, bytes: &str) -> Arc<str> {
    format!(
        "SELECT count(*), coalesce(sum(bytes), 0) FROM (SELECT {bytes} AS bytes FROM {t} \
         WHERE subject = ?1 AND expires_us > ?2 LIMIT ?3)"
    )
    .into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_migration_names_the_table_and_its_indexes() {
        let sql = Statements::new("billing").migration;
        assert!(sql.contains("CREATE TABLE IF NOT EXISTS \"billing\" ("));
        assert!(sql.contains(
            "CREATE INDEX IF NOT EXISTS \"billing_expires_idx\"\n    ON \"billing\" (expires_us)"
        ));
        assert!(sql.contains(
            "CREATE INDEX IF NOT EXISTS \"billing_subject_idx\"\n    ON \"billing\" (subject, created_us, scope)"
        ));
        assert!(!sql.contains(DEFAULT_TABLE));
    }
}
