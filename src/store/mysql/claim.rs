//! The claim: one batch (insert, take, read; see `Statements::claim`), read into an outcome.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use sqlx::Row;
use sqlx::mysql::MySqlRow;

use super::{MySqlStore, db, error_number, subject_digest};
use crate::store::header_list;
use crate::store::{ClaimOutcome, ClaimRequest, Finished, Generation, StoreError, StoredResponse};

impl MySqlStore {
    pub(super) async fn claim_record(
        &self,
        request: &ClaimRequest,
    ) -> Result<ClaimOutcome, StoreError> {
        let scope = request.key.digest();
        let batch = self
            .sql
            .claim(request, &scope, &subject_digest(&request.key.subject));
        let answers = match self.batch_counted("claim", &batch).await? {
            Ok(answers) => answers,
            // The table lacks a column this version writes (made by hand, or by another
            // version): nothing was claimed; never a reason to run unguarded.
            Err((e, _)) if error_number(&e) == Some(1054) => {
                return Err(StoreError::refused_claim(format!(
                    "mysql claim: the table {} lacks a column this version needs; run \
                     MySqlStore::migrate(), or compare it with migrations/mysql: {e}",
                    self.sql.table
                )));
            }
            // A wait on a lock cut short (a row locked by a handler's transaction between the
            // completion it wrote and its commit; a table locked): whether this claim's insert
            // committed before it is read from what is committed now (its first two statements
            // are the isolation level's and the insert's: the insert answered when two had).
            Err((e, answered)) if matches!(error_number(&e), Some(1205 | 1213 | 1969 | 3024)) => {
                return self
                    .after_a_lock_wait(request, &scope, e, answered >= 2)
                    .await;
            }
            Err((e, _)) => return Err(db("claim")(e)),
        };
        match answers.last().and_then(|a| a.rows.first()) {
            Some(row) => {
                let outcome = decide(request, row)?;
                if matches!(outcome, ClaimOutcome::InProgress) {
                    match row.try_get::<i64, _>("unmarked") {
                        Ok(1) => self.mark_silent(request, &scope, row).await,
                        Ok(_) => {}
                        Err(e) => tracing::warn!(
                            error = %e,
                            "mysql claim: whether the record's holder is silent could not be \
                             read; it is not marked, and not retaken"
                        ),
                    }
                }
                Ok(outcome)
            }
            // The row was there a moment ago and is gone again (deleted, purged): `409`, and the
            // client's retry settles it.
            None => Ok(ClaimOutcome::InProgress),
        }
    }

    /// Marks the record the claim's read found held by a silent holder, and unmarked (see
    /// `Statements::mark`). The claim answers `409` whatever the mark does: one not written is
    /// written by the next claim, and only delays the record's retake.
    async fn mark_silent(&self, request: &ClaimRequest, scope: &[u8; 32], row: &MySqlRow) {
        let Ok(lease) = row.try_get::<i64, _>("lease_token") else {
            return;
        };
        let mark = self.sql.mark(scope, lease, request.in_progress_ttl);
        match self.batch("claim", &mark).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "mysql claim: a silent holder's record was not marked")
            }
            Err(e) => {
                tracing::debug!(error = %e, "mysql claim: a silent holder's record was not marked")
            }
        }
    }
}

impl MySqlStore {
    /// The answer to a claim whose batch waited on a lock past its bound: the record as committed
    /// now decides it (held by this claim's lease: claimed; another's: in progress, `409`, or the
    /// wait with `wait`; finished: its replay). No record: the table is locked, and the claim is
    /// refused (`503`). Never an error the layer could run unguarded for, nor one that leaves a
    /// release looping for a TTL. `inserted`: the claim's insert answered before the wait (it
    /// may have claimed); else it was the statement cut, rolled back, and nothing was written.
    pub(super) async fn after_a_lock_wait(
        &self,
        request: &ClaimRequest,
        scope: &[u8; 32],
        waited: sqlx::Error,
        inserted: bool,
    ) -> Result<ClaimOutcome, StoreError> {
        let read = super::statements::Batch::default()
            .push(&self.sql.claim_read(request, &super::sql::hex(scope)));
        match self.batch("claim", &read).await {
            Ok(Ok(answers)) => match answers.last().and_then(|a| a.rows.first()) {
                Some(row) => decide(request, row),
                None => Err(StoreError::refused_claim(format!(
                    "mysql claim: the table is locked by another session: {waited}"
                ))),
            },
            // The insert was the statement cut (rolled back), and the record cannot be read (the
            // table is still locked): nothing was written; refused, never run unguarded.
            Ok(Err(e)) if !inserted => Err(StoreError::refused_claim(format!(
                "mysql claim: a lock wait ({waited}) cut the insert, then the record could not \
                 be read: {e}"
            ))),
            Err(e) if !inserted => Err(StoreError::refused_claim(format!(
                "mysql claim: a lock wait ({waited}) cut the insert, then the record could not \
                 be read: {e}"
            ))),
            // The insert answered before the wait (a later statement was cut): whether it claimed
            // is not known: an error that may have claimed, which the engine releases by its token.
            Ok(Err(e)) => Err(StoreError::new(
                format!("mysql claim: a lock wait ({waited}), then the record could not be read"),
                e,
            )),
            Err(e) => Err(StoreError::msg(format!(
                "mysql claim: a lock wait ({waited}), then the record could not be read: {e}"
            ))),
        }
    }
}

/// The outcome of a claim from the record as its batch left it: held by this claim's lease (it
/// inserted the record, took it, or had it already: a claim sent twice), or someone else's.
pub(super) fn decide(request: &ClaimRequest, row: &MySqlRow) -> Result<ClaimOutcome, StoreError> {
    let get = |e| StoreError::new("mysql claim: unexpected row", e);
    let status: String = row.try_get("status").map_err(get)?;
    let lease: i64 = row.try_get("lease_token").map_err(get)?;
    let generation = row
        .try_get::<Option<Vec<u8>>, _>("generation")
        .map_err(get)?
        .and_then(|g| Generation::from_slice(&g));
    if lease == request.lease.0 && status == "in_progress" {
        return Ok(ClaimOutcome::Claimed {
            lease: request.lease,
            generation,
        });
    }
    // Released (or deleted: a tombstone under its delete's token) after this batch's take looked,
    // before its read: nobody's operation, not another request's to answer 422 for. In progress:
    // the retry takes it.
    if lease == super::sql::RELEASED && status == "in_progress" {
        return Ok(ClaimOutcome::InProgress);
    }
    let same_fp: i64 = row.try_get("same_fp").map_err(get)?;
    if same_fp != 1 {
        return Ok(ClaimOutcome::KeyReuse);
    }
    let outcome = match status.as_str() {
        "completed" => Finished::Completed,
        "failed" => Finished::Failed,
        // Held by another lease (or released meanwhile, or past its expiry since the batch
        // looked): never granted here.
        _ => return Ok(ClaimOutcome::InProgress),
    };
    // A finished record that cannot be read (a row edited by hand) is never a reason to run the
    // operation again, even for a layer that fails open.
    let unreadable = |what: &str| {
        StoreError::unreadable_record(format!(
            "mysql claim: a finished record is unreadable: {what}"
        ))
    };
    let status: i16 = row
        .try_get::<Option<i16>, _>("response_status")
        .map_err(|e| unreadable(&e.to_string()))?
        .ok_or_else(|| unreadable("no status"))?;
    let headers: Option<Vec<u8>> = row
        .try_get("response_headers")
        .map_err(|e| unreadable(&e.to_string()))?;
    let headers = header_list::read(&mut headers.as_deref().unwrap_or_default())
        .ok_or_else(|| unreadable("its headers"))?;
    let body: Option<Vec<u8>> = row.try_get("response_body").map_err(get)?;
    let expires_in: Option<i64> = row.try_get("expires_in_us").map_err(get)?;
    Ok(ClaimOutcome::Finished(Arc::new(StoredResponse {
        outcome,
        status: u16::try_from(status).unwrap_or(500),
        headers,
        body_omitted: body.is_none(),
        body: body.map(Bytes::from).unwrap_or_default(),
        expires_in: expires_in.map(|us| Duration::from_micros(u64::try_from(us).unwrap_or(0))),
    })))
}
