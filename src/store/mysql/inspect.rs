//! Inspection on the table: the record of a key, the delete of a finished one, a subject's records
//! paged, and their count (see `IdempotencyStore::lookup`, `delete`, `list`, `count_records`).
//!
//! Released records (in progress under no lease, `RELEASED`) and records past their expiry are
//! absent to lookup, delete and list, as in every store.

use sqlx::Row;
use sqlx::mysql::MySqlRow;

use std::sync::atomic::Ordering;

use super::errors::error_number;
use super::{MySqlStore, db, first_integer, subject_digest};

/// `ER_BAD_FIELD_ERROR`: an unknown column.
const ER_BAD_FIELD_ERROR: u16 = 1054;
use crate::store::RecordKey;
use crate::store::{
    Deleted, ListCursor, ListRequest, ListedRecord, RecordInfo, RecordPage, StoreError,
    SubjectUsage, from_micros, row_info,
};

impl MySqlStore {
    /// How many live records `subject` has, counting no further than `up_to` (an index range scan
    /// of at most that many entries).
    pub(super) async fn count_subject(
        &self,
        subject: &str,
        up_to: u64,
    ) -> Result<SubjectUsage, StoreError> {
        let digest = subject_digest(subject);
        // A table not migrated since a column came loses it from the count, and says so, until
        // `migrate()` adds it: the steps' (`0004`, its bytes then not counted), then
        // `body_bytes` (`0002`, the bodies read instead).
        let answers = loop {
            let column = self.sql.body_bytes.load(Ordering::Relaxed);
            let steps = self.sql.counts_steps.load(Ordering::Relaxed);
            let count = self.sql.count(&digest, up_to, column, steps);
            match self.batch("count", &count).await? {
                Ok(found) => break found,
                Err(e) if error_number(&e) == Some(ER_BAD_FIELD_ERROR) && steps => {
                    self.sql.counts_steps.store(false, Ordering::Relaxed);
                    tracing::warn!(
                        table = %self.sql.table,
                        "the idempotency table has no column for steps: a subject's bytes count \
                         its answers alone; run migrate()"
                    );
                }
                Err(e) if error_number(&e) == Some(ER_BAD_FIELD_ERROR) && column => {
                    self.sql.body_bytes.store(false, Ordering::Relaxed);
                    tracing::warn!(
                        table = %self.sql.table,
                        "the idempotency table has no body_bytes column: counting a subject's \
                         bytes reads its bodies; run migrate()"
                    );
                }
                Err(e) => return Err(db("count")(e)),
            }
        };
        let Some(row) = answers.first().and_then(|a| a.rows.first()) else {
            return Ok(SubjectUsage::default());
        };
        let get = |column| {
            row.try_get::<Option<i64>, _>(column)
                .map(|n| n.map_or(0, |n| u64::try_from(n).unwrap_or(0)))
                .map_err(|e| StoreError::new("mysql count: unexpected row", e))
        };
        Ok(SubjectUsage {
            records: get(0)?,
            bytes: get(1)?,
        })
    }

    pub(super) async fn lookup_record(
        &self,
        key: &RecordKey,
    ) -> Result<Option<RecordInfo>, StoreError> {
        let answers = self
            .answers("lookup", &self.sql.lookup(&key.digest()))
            .await?;
        match answers.first().and_then(|a| a.rows.first()) {
            None => Ok(None),
            Some(row) => {
                let get = |e| StoreError::new("mysql lookup: unexpected row", e);
                info(
                    &row.try_get::<String, _>(0).map_err(get)?,
                    row.try_get(1).map_err(get)?,
                    row.try_get(2).map_err(get)?,
                    row.try_get(3).map_err(get)?,
                )
                .map(Some)
            }
        }
    }

    pub(super) async fn delete_record(&self, key: &RecordKey) -> Result<Deleted, StoreError> {
        // Drawn once, before the batch may go twice (see `Statements::delete`).
        let token = crate::store::delete_token();
        let answers = self
            .answers("delete", &self.sql.delete(&key.digest(), &token))
            .await?;
        let deleted_before = first_integer(answers.get(3))?.unwrap_or(0) > 0;
        Ok(
            if answers.get(1).is_some_and(|a| a.affected == 1) || deleted_before {
                Deleted::Deleted
            } else if first_integer(answers.get(2))?.unwrap_or(0) > 0 {
                Deleted::InProgress
            } else {
                Deleted::NotFound
            },
        )
    }

    /// A page of `subject`'s records. The rows are selected by the subject's digest, and each is
    /// kept only when its key and endpoint with `subject` give its own scope digest (a row written
    /// by hand may lie); rows that fail still move the listing on, as in the Postgres store.
    pub(super) async fn list_records(
        &self,
        subject: &str,
        request: ListRequest,
    ) -> Result<RecordPage, StoreError> {
        let limit = request.bounded_limit();
        let after = request.after.map(|c| (c.created_micros(), *c.scope()));
        let batch = self.sql.list(
            &subject_digest(subject),
            after.as_ref().map(|(us, scope)| (*us, scope)),
            limit,
        );
        let answers = self.answers("list", &batch).await?;
        let rows = answers
            .into_iter()
            .next()
            .map(|a| a.rows)
            .unwrap_or_default();
        let read = rows.len();
        let mut last = None;
        let mut records = Vec::with_capacity(read);
        for row in &rows {
            let (record, cursor) = listed(row, subject)?;
            last = Some(cursor);
            records.extend(record);
        }
        let mut page = RecordPage::new(records, limit);
        if read >= limit {
            page.next = last;
        }
        Ok(page)
    }
}

/// A listed row as a record of `subject`, if its scope is that subject's, and its cursor.
fn listed(row: &MySqlRow, subject: &str) -> Result<(Option<ListedRecord>, ListCursor), StoreError> {
    let get = |e| StoreError::new("mysql list: unexpected row", e);
    let scope: Vec<u8> = row.try_get(0).map_err(get)?;
    let scope: [u8; 32] = scope
        .try_into()
        .map_err(|_| StoreError::msg("mysql list: a scope is not 32 bytes"))?;
    let created: i64 = row.try_get(5).map_err(get)?;
    let cursor = ListCursor::new(from_micros(created), scope);
    let key = String::from_utf8(row.try_get(1).map_err(get)?);
    let endpoint = String::from_utf8(row.try_get(2).map_err(get)?);
    let (Ok(key), Ok(endpoint)) = (key, endpoint) else {
        return Ok((None, cursor));
    };
    let record = RecordKey {
        key,
        subject: subject.to_owned(),
        endpoint,
    };
    if record.digest() != scope {
        return Ok((None, cursor));
    }
    let info = info(
        &row.try_get::<String, _>(3).map_err(get)?,
        row.try_get(4).map_err(get)?,
        created,
        row.try_get(6).map_err(get)?,
    )?;
    Ok((
        Some(ListedRecord::new(record.key, record.endpoint, info, cursor)),
        cursor,
    ))
}

/// A row's state, status and times (see `store::inspection::row_info`).
fn info(
    status: &str,
    response: Option<i16>,
    created_us: i64,
    expires_us: i64,
) -> Result<RecordInfo, StoreError> {
    row_info(
        "mysql",
        status,
        response.map(i64::from),
        created_us,
        expires_us,
    )
}
