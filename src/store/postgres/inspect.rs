//! Inspection on the table: the record of a key, the delete of a finished one, and a subject's
//! records paged (see `IdempotencyStore::lookup`, `delete` and `list`).
//!
//! Released records (in progress under no lease, `RELEASED`) and records past their expiry are
//! absent to all three, as in every store.

use super::{PostgresStore, db, on_connection, printable};
use crate::store::RecordKey;
use crate::store::{
    Deleted, ListCursor, ListRequest, ListedRecord, RecordInfo, RecordPage, StoreError,
    SubjectUsage, from_micros, row_info,
};

/// How many statements one listing sends at most when rows it cannot verify as the subject's fill
/// its pages (see `PostgresStore::list_records`); it then answers a short page with a next one.
const LIST_ROUNDS: usize = 4;
/// A cursor's time is bound as a `float8` count of microseconds, exact within ±2^53 (the years
/// 1685 to 2255): the database's `now()` dated every record, so only a forged cursor lies
/// outside, and clamped it lists what it would have.
const CURSOR_MICROS: i64 = 1 << 53;

/// A listed row: scope, key, endpoint, status, response status, created and expires (µs).
type ListedRow = (Vec<u8>, String, String, String, Option<i16>, i64, i64);

impl PostgresStore {
    /// How many live records `subject` has, counting no further than `up_to` (an index range
    /// scan of at most that many entries).
    pub(super) async fn count_subject(
        &self,
        subject: &str,
        up_to: u64,
    ) -> Result<SubjectUsage, StoreError> {
        let subject = printable(subject);
        let limit = i64::try_from(up_to).unwrap_or(i64::MAX);
        let inspection = &self.sql().inspection;
        let (count, bytes) = crate::store::sql::count_with_steps::<sqlx::Postgres, _>(
            &inspection.counts_steps,
            &self.sql().table,
            |with_steps| {
                let sql = if with_steps {
                    &inspection.count
                } else {
                    &inspection.count_without_steps
                };
                self.count_on(sql, &subject, limit)
            },
        )
        .await?;
        Ok(SubjectUsage {
            records: u64::try_from(count).unwrap_or(0),
            bytes: u64::try_from(bytes).unwrap_or(0),
        })
    }

    /// The count statement `sql` for `subject`, up to `limit`: records and bytes.
    async fn count_on(
        &self,
        sql: &str,
        subject: &str,
        limit: i64,
    ) -> Result<Result<(i64, i64), sqlx::Error>, StoreError> {
        on_connection!(self, "count", conn => {
            sqlx::query_as(sqlx::AssertSqlSafe(sql))
                .bind(subject)
                .bind(limit)
                .fetch_one(&mut *conn)
        })
    }

    pub(super) async fn lookup_record(
        &self,
        key: &RecordKey,
    ) -> Result<Option<RecordInfo>, StoreError> {
        let scope = key.digest();
        let row: Option<(String, Option<i16>, i64, i64)> = on_connection!(self, "lookup", conn => {
            sqlx::query_as(sqlx::AssertSqlSafe(self.sql().inspection.lookup.as_str()))
                .bind(&scope[..])
                .fetch_optional(&mut *conn)
        })?
        .map_err(db("lookup"))?;
        row.map(|(status, response, created, expires)| info(&status, response, created, expires))
            .transpose()
    }

    pub(super) async fn delete_record(&self, key: &RecordKey) -> Result<Deleted, StoreError> {
        let scope = key.digest();
        // Drawn once, before the statement may go twice (see `Inspection::delete`).
        let token = crate::store::delete_token();
        let (deleted, in_progress): (bool, bool) = on_connection!(self, "delete", conn => {
            sqlx::query_as(sqlx::AssertSqlSafe(self.sql().inspection.delete.as_str()))
                .bind(&scope[..])
                .bind(&*self.lock_timeout)
                .bind(&token[..])
                .fetch_one(&mut *conn)
        })?
        .map_err(db("delete"))?;
        Ok(if deleted {
            Deleted::Deleted
        } else if in_progress {
            Deleted::InProgress
        } else {
            Deleted::NotFound
        })
    }

    /// The `subject` column is lossy (NUL written as U+FFFD) and empty in records written
    /// `without_scope_columns`, so a row it selects may be another subject's: each row is kept only
    /// when its key and endpoint with `subject` give its own scope digest. Rows that fail (another
    /// subject's, or ones with no scope in clear) still move the listing on: when they leave a page
    /// short, the next rows are read, up to [`LIST_ROUNDS`] statements, and a page still short then
    /// carries the cursor of the last row read.
    pub(super) async fn list_records(
        &self,
        subject: &str,
        request: ListRequest,
    ) -> Result<RecordPage, StoreError> {
        let limit = request.bounded_limit();
        let column = printable(subject);
        let mut after = request.after;
        let mut records = Vec::with_capacity(limit);
        for _ in 0..LIST_ROUNDS {
            let asked = limit - records.len();
            let rows: Vec<ListedRow> = on_connection!(self, "list", conn => {
                let sql = &self.sql().inspection;
                let query = match &after {
                    None => sqlx::query_as(sqlx::AssertSqlSafe(sql.list_first.as_str()))
                        .bind(&*column)
                        .bind(asked as i64),
                    Some(cursor) => sqlx::query_as(sqlx::AssertSqlSafe(sql.list_after.as_str()))
                        .bind(&*column)
                        .bind(asked as i64)
                        .bind(
                            cursor
                                .created_micros()
                                .clamp(-CURSOR_MICROS, CURSOR_MICROS) as f64,
                        )
                        .bind(&cursor.scope()[..]),
                };
                query.fetch_all(&mut *conn)
            })?
            .map_err(db("list"))?;
            let read = rows.len();
            for (scope, key, endpoint, status, response, created, expires) in rows {
                let scope: [u8; 32] = scope
                    .try_into()
                    .map_err(|_| StoreError::msg("postgres list: a scope is not 32 bytes"))?;
                let cursor = ListCursor::new(from_micros(created), scope);
                after = Some(cursor);
                let record = RecordKey {
                    key,
                    subject: subject.to_owned(),
                    endpoint,
                };
                if record.digest() != scope {
                    continue;
                }
                let info = info(&status, response, created, expires)?;
                records.push(ListedRecord::new(record.key, record.endpoint, info, cursor));
            }
            if read < asked {
                // The subject's last records: no next page.
                return Ok(RecordPage::new(records, limit));
            }
            if records.len() >= limit {
                break;
            }
        }
        let mut page = RecordPage::new(records, limit);
        page.next = after;
        Ok(page)
    }
}

/// A row's state, status and times (see `store::inspection::row_info`).
fn info(
    status: &str,
    response: Option<i16>,
    created_us: i64,
    expires_us: i64,
) -> Result<RecordInfo, StoreError> {
    row_info(
        "postgres",
        status,
        response.map(i64::from),
        created_us,
        expires_us,
    )
}
