//! The claim: one call of the claim function (or its first query, while the function is missing),
//! read into an outcome, with the compare-and-swap retake of a stale or expired record.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use sqlx::Row;
use sqlx::postgres::PgRow;

use super::sql::RELEASED;
use super::{PostgresStore, db, micros, on_connection, parse_headers};
use crate::store::StoreError;
use crate::store::{ClaimOutcome, ClaimRequest, Finished, Generation, StoredResponse};
use crate::util::lock::lock;

/// How long a store that found the claim function missing waits before looking for it again.
pub(super) const FUNCTION_PROBE: Duration = Duration::from_secs(60);

impl PostgresStore {
    async fn retake(
        &self,
        request: &ClaimRequest,
        scope: &[u8; 32],
        old_lease: i64,
        old_status: &str,
    ) -> Result<Option<Option<Generation>>, StoreError> {
        let row: Result<Option<(Option<Vec<u8>>,)>, sqlx::Error> = on_connection!(self, "retake", conn => {
        sqlx::query_as(sqlx::AssertSqlSafe(self.sql().retake.as_str()))
            .bind(&scope[..])
            .bind(&request.fingerprint.as_bytes()[..])
            .bind(request.lease.0)
            .bind(micros(request.in_progress_ttl + request.retention))
            .bind(old_lease)
            .bind(old_status)
            .bind(micros(request.in_progress_ttl))
            .bind(&*self.lock_timeout)
            .bind(&request.generation.0[..])
            .fetch_optional(&mut *conn)
        })?;
        let row = match row {
            Ok(row) => row,
            // The row is locked by another transaction (a handler's, between the completion it
            // wrote and its commit; another retake): nothing was retaken, and it is in progress
            // until that transaction ends.
            Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some(LOCK_NOT_AVAILABLE) => {
                return Ok(None);
            }
            // A serialization failure (the database's default isolation is above READ
            // COMMITTED): a concurrent retake or mark of this record; nothing was written.
            Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("40001") => {
                return Ok(None);
            }
            // The table lacks the holder's TTL column or the mark's: made by an earlier version,
            // and `migrate()` has not run. Nothing was retaken; never a reason to run unguarded.
            Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42703") => {
                return Err(StoreError::refused_claim(format!(
                    "postgres claim: the table {} lacks a column this version needs; run \
                     PostgresStore::migrate() (or apply migrations/0003, 0006 and 0007): {e}",
                    self.sql().table
                )));
            }
            Err(e) => return Err(db("retake")(e)),
        };
        // `None`: lost the race; otherwise the record's generation as the retake left it.
        Ok(row.map(|(g,)| g.and_then(|g| Generation::from_slice(&g))))
    }

    /// Reads what a claim statement returned into an outcome, retaking the record when it is stale
    /// or expired.
    pub(super) async fn decide(
        &self,
        request: &ClaimRequest,
        scope: &[u8; 32],
        row: &PgRow,
    ) -> Result<ClaimOutcome, StoreError> {
        let get = |e| StoreError::new("claim: unexpected row", e);
        let lease = request.lease;
        if row.try_get::<bool, _>("inserted").map_err(get)? {
            return Ok(ClaimOutcome::Claimed {
                lease,
                generation: Some(request.generation),
            });
        }
        // The record's generation: none for a row written before generations were kept.
        let generation = row
            .try_get::<Option<Vec<u8>>, _>("generation")
            .map_err(get)?
            .and_then(|g| Generation::from_slice(&g));
        let status: String = row.try_get("status").map_err(get)?;
        let old_lease: i64 = row.try_get("lease_token").map_err(get)?;
        let same_fp: bool = row.try_get("same_fp").map_err(get)?;
        let stale: bool = row.try_get("stale").map_err(get)?;
        let expired: bool = row.try_get("expired").map_err(get)?;
        if expired {
            // Past retention: the key is new again, whatever was there. An in-progress record
            // that expired was abandoned by its holder, so taking it is a retake.
            // The key is a new operation: a new generation (as in every store: Redis and a purge
            // delete expired records).
            return Ok(
                match self.retake(request, scope, old_lease, &status).await? {
                    Some(generation) => ClaimOutcome::Claimed { lease, generation },
                    None => ClaimOutcome::InProgress,
                },
            );
        }
        if status == "in_progress" && old_lease == RELEASED {
            // Released for another try: the same request keeps the record's generation (the same
            // operation again); another request is a new operation.
            return Ok(
                match self.retake(request, scope, old_lease, &status).await? {
                    Some(generation) => ClaimOutcome::Claimed { lease, generation },
                    None => ClaimOutcome::InProgress,
                },
            );
        }
        if !same_fp {
            return Ok(ClaimOutcome::KeyReuse);
        }
        let outcome = match status.as_str() {
            "completed" => Finished::Completed,
            "failed" => Finished::Failed,
            // This claim's own record: the same claim, made twice (its first answer was lost).
            _ if old_lease == lease.0 => {
                return Ok(ClaimOutcome::Claimed { lease, generation });
            }
            _ if !stale => return Ok(ClaimOutcome::InProgress),
            _ => {
                return Ok(
                    match self.retake(request, scope, old_lease, &status).await? {
                        Some(generation) => ClaimOutcome::Claimed { lease, generation },
                        None => ClaimOutcome::InProgress,
                    },
                );
            }
        };
        // A finished record that cannot be read (a row edited by hand) is never a reason to run
        // the operation again, even for a layer that fails open.
        let unreadable = |e: sqlx::Error| {
            StoreError::unreadable_record(format!(
                "postgres claim: a finished record is unreadable: {e}"
            ))
        };
        let status: i16 = row.try_get("response_status").map_err(unreadable)?;
        let names: Vec<String> = row.try_get("header_names").map_err(unreadable)?;
        let values: Vec<Vec<u8>> = row.try_get("header_values").map_err(unreadable)?;
        let body: Option<Vec<u8>> = row.try_get("response_body").map_err(get)?;
        let expires_in: Option<f64> = row.try_get("expires_in").map_err(get)?;
        Ok(ClaimOutcome::Finished(Arc::new(StoredResponse {
            outcome,
            status: u16::try_from(status).unwrap_or(500),
            headers: parse_headers(names, values),
            body_omitted: body.is_none(),
            body: body.map(Bytes::from).unwrap_or_default(),
            expires_in: expires_in.and_then(|s| Duration::try_from_secs_f64(s).ok()),
        })))
    }

    /// The claim: one call of the claim function, or, while it is missing, its queries one by one.
    /// `None`: the record was there a moment ago and is gone again (released); the caller answers
    /// `409` and the client's retry settles it.
    pub(super) async fn claim_row(
        &self,
        request: &ClaimRequest,
        scope: &[u8; 32],
    ) -> Result<Option<PgRow>, StoreError> {
        let (use_function, probing) = match *lock(&self.sql().function_missing) {
            None => (true, false),
            Some(since) => (since.elapsed() >= FUNCTION_PROBE, true),
        };
        if use_function {
            let claimed = on_connection!(self, "claim", conn => {
                self.claim_statement(&self.sql().claim, request, scope)
                    .fetch_optional(&mut *conn)
            });
            match claimed {
                Ok(Err(sqlx::Error::Database(e))) if e.code().as_deref() == Some("42883") => {
                    tracing::warn!(
                        table = %self.sql().table,
                        "the claim function is missing (run PostgresStore::migrate): a claim \
                         that races another takes two round trips until it is there"
                    );
                    *lock(&self.sql().function_missing) = Some(std::time::Instant::now());
                }
                // A serialization failure (the database's default isolation is above READ
                // COMMITTED) means a concurrent claim of this key: nothing was written; in progress.
                Ok(Err(sqlx::Error::Database(e))) if e.code().as_deref() == Some("40001") => {
                    return Ok(None);
                }
                Ok(Err(sqlx::Error::Database(e)))
                    if e.code().as_deref() == Some(LOCK_NOT_AVAILABLE) =>
                {
                    return self.locked(scope).await;
                }
                Ok(Ok(row)) => {
                    if probing {
                        *lock(&self.sql().function_missing) = None;
                    }
                    return Ok(row);
                }
                Ok(Err(e)) => return Err(db("claim")(e)),
                Err(e) => return Err(e),
            }
        }
        let direct = || async {
            let row = on_connection!(self, "claim", conn => {
                self.claim_statement(&self.sql().claim_direct, request, scope)
                    .fetch_optional(&mut *conn)
            })?;
            match row {
                Ok(row) => Ok(Direct::Row(row)),
                Err(sqlx::Error::Database(e))
                    if e.code().as_deref() == Some(LOCK_NOT_AVAILABLE) =>
                {
                    Ok(Direct::Locked)
                }
                // The table lacks a column this version writes: made by an earlier version,
                // and `migrate()` has not run. Nothing was claimed; never a reason to run unguarded.
                Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42703") => {
                    Err(StoreError::refused_claim(format!(
                        "postgres claim: the table {} lacks a column this version needs \
                         (generation, in_progress_ttl_us); run PostgresStore::migrate() (or apply \
                         migrations/0003 and 0006): {e}",
                        self.sql().table
                    )))
                }
                Err(e) => Err(db("claim")(e)),
            }
        };
        match direct().await? {
            Direct::Row(Some(row)) => return Ok(Some(row)),
            Direct::Locked => return self.locked(scope).await,
            Direct::Row(None) => {}
        }
        // The insert met a row committed after this statement's snapshot was taken, so the read
        // half could not see it. A second statement sees it; that row was inserted a moment ago and
        // cannot be stale. If it needs a retake after all, answer 409 rather than spend a third
        // round trip: the client's retry settles it.
        match direct().await? {
            Direct::Row(row) => Ok(row.filter(|row| !needs_retake(row))),
            Direct::Locked => self.locked(scope).await,
        }
    }

    /// The answer to a claim whose statement waited on a lock past its lock timeout (and was
    /// rolled back: nothing was claimed). A row of the key locked by another transaction (a
    /// handler's, between the completion it wrote and its commit; a retake in flight) is in
    /// progress: `None`, a `409` (or the wait, with `wait`), never an error the layer could run
    /// unguarded for. Without a row, the table itself is locked (a migration, `VACUUM FULL`): the
    /// claim is refused (`503`), never run unguarded either.
    pub(super) async fn locked(&self, scope: &[u8; 32]) -> Result<Option<PgRow>, StoreError> {
        let exists = on_connection!(self, "claim", conn => {
            sqlx::query_scalar::<_, bool>(sqlx::AssertSqlSafe(self.sql().exists.as_str()))
                .bind(&scope[..])
                .fetch_one(&mut *conn)
        });
        match exists {
            Ok(Ok(true)) => Ok(None),
            Ok(Ok(false)) => Err(StoreError::refused_claim(
                "postgres claim: the table is locked by another transaction",
            )),
            Ok(Err(e)) => Err(StoreError::refused_claim(format!(
                "postgres claim: the key's row is locked, and could not be read: {e}"
            ))),
            Err(e) => Err(StoreError::refused_claim(format!(
                "postgres claim: the key's row is locked, and could not be read: {e}"
            ))),
        }
    }

    /// A claim statement (the function's call or its first query), bound.
    fn claim_statement<'q>(
        &self,
        sql: &'q str,
        request: &'q ClaimRequest,
        scope: &'q [u8; 32],
    ) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
        let key = &request.key;
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(&scope[..])
            .bind(if self.scope_columns { &key.key[..] } else { "" })
            .bind(self.scope_column(&key.subject))
            .bind(self.scope_column(&key.endpoint))
            .bind(&request.fingerprint.as_bytes()[..])
            .bind(request.lease.0)
            .bind(micros(request.in_progress_ttl + request.retention))
            .bind(micros(request.in_progress_ttl))
            .bind(&request.generation.0[..])
            .bind(&*self.lock_timeout)
    }
}

/// What the claim function's first query gave: its row (if any), or a wait on a lock cut short.
enum Direct {
    Row(Option<PgRow>),
    Locked,
}

/// SQLSTATE `lock_not_available`: a statement waited on a lock past its `lock_timeout`.
pub(super) const LOCK_NOT_AVAILABLE: &str = "55P03";

/// True when a claim row shows an existing record that only a retake could claim.
fn needs_retake(row: &PgRow) -> bool {
    let flag = |name: &str| {
        row.try_get::<Option<bool>, _>(name)
            .ok()
            .flatten()
            .unwrap_or(false)
    };
    let in_progress = row
        .try_get::<Option<String>, _>("status")
        .ok()
        .flatten()
        .as_deref()
        == Some("in_progress");
    !flag("inserted") && (flag("expired") || (in_progress && flag("stale")))
}
