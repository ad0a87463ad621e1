//! Inspection on the table: the record of a key, the delete of a finished one, a subject's records
//! paged, and their bounded count (see `IdempotencyStore::lookup`, `delete`, `list` and
//! `count_records`).
//!
//! Released records (in progress under no lease) and records past their expiry are absent to
//! lookup, delete and list, as in every store.

use std::sync::Arc;

use super::{SqliteStore, db, on_connection, statement};
use crate::store::{
    Deleted, ListCursor, ListRequest, ListedRecord, RecordInfo, RecordKey, RecordPage, StoreError,
    SubjectUsage, from_micros, row_info,
};

/// A listed row: scope, key, endpoint, status, response status, created and expires (µs).
type ListedRow = (Vec<u8>, String, String, String, Option<i64>, i64, i64);

impl SqliteStore {
    /// How many live records `subject` has, counting no further than `up_to` (an index range
    /// scan of at most that many entries).
    pub(super) async fn count_subject(
        &self,
        subject: &str,
        up_to: u64,
    ) -> Result<SubjectUsage, StoreError> {
        let limit = i64::try_from(up_to).unwrap_or(i64::MAX);
        let (count, bytes) = crate::store::sql::count_with_steps::<sqlx::Sqlite, _>(
            &self.sql.counts_steps,
            &self.sql.table,
            |with_steps| {
                let sql = if with_steps {
                    &self.sql.count
                } else {
                    &self.sql.count_without_steps
                };
                self.count_on(sql, subject, limit)
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
        sql: &Arc<str>,
        subject: &str,
        limit: i64,
    ) -> Result<Result<(i64, i64), sqlx::Error>, StoreError> {
        on_connection!(self, "count", read, conn => {
            sqlx::query_as(statement(sql))
                .bind(subject)
                .bind(self.clock.wall_us())
                .bind(limit)
                .fetch_one(&mut *conn)
        })
    }

    pub(super) async fn lookup_record(
        &self,
        key: &RecordKey,
    ) -> Result<Option<RecordInfo>, StoreError> {
        let scope = key.digest();
        let row: Option<(String, Option<i64>, i64, i64)> =
            on_connection!(self, "lookup", read, conn => {
                sqlx::query_as(statement(&self.sql.lookup))
                    .bind(&scope[..])
                    .bind(self.clock.wall_us())
                    .fetch_optional(&mut *conn)
            })?
            .map_err(db("lookup"))?;
        row.map(|(status, response, created, expires)| info(&status, response, created, expires))
            .transpose()
    }

    /// The delete is one statement, so it is atomic: a record taken back in progress before it
    /// ran is not deleted. Whether a claim holds the record is read after it, for the answer only.
    pub(super) async fn delete_record(&self, key: &RecordKey) -> Result<Deleted, StoreError> {
        let scope = key.digest();
        let done = on_connection!(self, "delete", write, conn => {
            sqlx::query(statement(&self.sql.delete))
                .bind(&scope[..])
                .bind(self.clock.wall_us())
                .execute(&mut *conn)
        })?
        .map_err(db("delete"))?;
        if done.rows_affected() > 0 {
            return Ok(Deleted::Deleted);
        }
        let (held,): (bool,) = on_connection!(self, "delete", read, conn => {
            sqlx::query_as(statement(&self.sql.held))
                .bind(&scope[..])
                .bind(self.clock.wall_us())
                .fetch_one(&mut *conn)
        })?
        .map_err(db("delete"))?;
        Ok(if held {
            Deleted::InProgress
        } else {
            Deleted::NotFound
        })
    }

    /// The `subject` column holds the subject whole, so every row it selects is the subject's; a
    /// row whose key and endpoint do not give its own scope digest with it (a row written by hand)
    /// is left out, and still moves the listing on.
    pub(super) async fn list_records(
        &self,
        subject: &str,
        request: ListRequest,
    ) -> Result<RecordPage, StoreError> {
        let limit = request.bounded_limit();
        let rows: Vec<ListedRow> = on_connection!(self, "list", read, conn => {
            let query = match &request.after {
                None => sqlx::query_as(statement(&self.sql.list_first))
                    .bind(subject)
                    .bind(self.clock.wall_us())
                    .bind(limit as i64),
                Some(cursor) => sqlx::query_as(statement(&self.sql.list_after))
                    .bind(subject)
                    .bind(self.clock.wall_us())
                    .bind(limit as i64)
                    .bind(cursor.created_micros())
                    .bind(&cursor.scope()[..]),
            };
            query.fetch_all(&mut *conn)
        })?
        .map_err(db("list"))?;
        let read = rows.len();
        let mut last = None;
        let mut records = Vec::with_capacity(read);
        for (scope, key, endpoint, status, response, created, expires) in rows {
            let scope: [u8; 32] = scope
                .try_into()
                .map_err(|_| StoreError::msg("sqlite list: a scope is not 32 bytes"))?;
            let cursor = ListCursor::new(from_micros(created), scope);
            last = Some(cursor);
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
        let mut page = RecordPage::new(records, limit);
        // A full read has a next page, even when a row of it was left out.
        page.next = if read >= limit { last } else { None };
        Ok(page)
    }
}

/// A row's state, status and times (see `store::inspection::row_info`).
fn info(
    status: &str,
    response: Option<i64>,
    created_us: i64,
    expires_us: i64,
) -> Result<RecordInfo, StoreError> {
    row_info("sqlite", status, response, created_us, expires_us)
}
