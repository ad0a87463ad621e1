//! The claim: a read of the record, without the write lock, that answers a replay, a `422` or a
//! `409` on its own; then, for a fresh key, an insert, and for a record that is expired, released
//! or abandoned, a compare-and-swap on the lease it was read with. A record in progress is
//! abandoned when it was not renewed for the TTL (on the boot clock, see `clock.rs`) and its
//! holder's presence is not shown (see `presence.rs`).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use super::presence::{self, Holder};
use super::statements::RELEASED;
use super::{SqliteStore, db, micros, on_connection, statement};
use crate::store::{
    ClaimOutcome, ClaimRequest, Finished, Generation, Presence, StoreError, StoredResponse,
};

/// How many times a claim reads again after its insert met a row committed since its read (a
/// concurrent claim of the same key won; or that row was then deleted, and the key is new again).
const READS: usize = 3;

/// The record as a claim reads it: status, lease, same fingerprint, renewed (µs), renewed on the
/// boot clock (µs; when written with the last renewal), holder's TTL (µs), expires (µs),
/// generation, response status, headers, body (when the fingerprint matches).
type ClaimRow = (
    String,
    i64,
    bool,
    i64,
    Option<i64>,
    i64,
    i64,
    Vec<u8>,
    Option<i64>,
    Option<Vec<u8>>,
    Option<Vec<u8>>,
);

/// What a claim does after its read.
enum Next {
    Answer(ClaimOutcome),
    /// No record: insert one.
    Insert,
    /// A record to take by compare-and-swap on the lease it was read with.
    Take(i64),
    /// A record in progress that was not renewed for the TTL: taken like [`Next::Take`] unless
    /// its holder's presence is shown.
    TakeStale(i64),
}

impl SqliteStore {
    pub(super) async fn claim_record(
        &self,
        request: &ClaimRequest,
    ) -> Result<ClaimOutcome, StoreError> {
        let scope = request.key.digest();
        for _ in 0..READS {
            let row = self.claim_read(request, &scope).await?;
            let now = (self.clock.wall_us(), self.clock.boot_us());
            match decide(request, row, now)? {
                Next::Answer(outcome) => return Ok(outcome),
                Next::Insert => {
                    if self.insert(request, &scope).await? {
                        return Ok(ClaimOutcome::Claimed {
                            lease: request.lease,
                            generation: Some(request.generation),
                        });
                    }
                    // Another claim's row was committed since the read: read it.
                }
                Next::TakeStale(read_lease) if self.holder_lives(read_lease) => {
                    return Ok(ClaimOutcome::InProgress);
                }
                Next::Take(read_lease) | Next::TakeStale(read_lease) => {
                    return Ok(match self.take(request, &scope, read_lease).await? {
                        Some(generation) => ClaimOutcome::Claimed {
                            lease: request.lease,
                            generation,
                        },
                        // Another claim took it first, or its holder renewed it meanwhile.
                        None => ClaimOutcome::InProgress,
                    });
                }
            }
        }
        // Rows that come and go under this claim: in progress, and the client's retry settles it.
        Ok(ClaimOutcome::InProgress)
    }

    async fn claim_read(
        &self,
        request: &ClaimRequest,
        scope: &[u8; 32],
    ) -> Result<Option<ClaimRow>, StoreError> {
        on_connection!(self, "claim", read, conn => {
            sqlx::query_as(statement(&self.sql.claim_read))
                .bind(&scope[..])
                .bind(&request.fingerprint.as_bytes()[..])
                .fetch_optional(&mut *conn)
        })?
        .map_err(claim_error("claim"))
    }

    /// Whether the holder of the lease `read_lease` shows its presence (see `presence.rs`): then it
    /// lives, whatever delayed its renewals, and its record is not taken.
    fn holder_lives(&self, read_lease: i64) -> bool {
        let Some(presence) = Presence::of(crate::store::LeaseToken(read_lease)) else {
            return false;
        };
        self.presence_folder()
            .is_some_and(|folder| presence::holder(folder, presence) == Holder::Alive)
    }

    /// Inserts the record of a fresh key, alone or together with others (see `batched.rs`);
    /// false when a row was there already.
    async fn insert(&self, request: &ClaimRequest, scope: &[u8; 32]) -> Result<bool, StoreError> {
        self.insert_together(request, scope).await
    }

    /// [`insert`](Self::insert) alone, in a statement (and a commit) of its own.
    pub(super) async fn insert_alone(
        &self,
        request: &ClaimRequest,
        scope: &[u8; 32],
    ) -> Result<bool, StoreError> {
        let done = on_connection!(self, "claim", write, conn => {
            self.insert_query(request, scope).execute(&mut *conn)
        })?
        .map_err(claim_error("claim"))?;
        Ok(done.rows_affected() == 1)
    }

    /// The insert of a fresh key's record, bound, timed now.
    pub(super) fn insert_query<'q>(
        &self,
        request: &'q ClaimRequest,
        scope: &'q [u8; 32],
    ) -> sqlx::query::Query<'q, sqlx::Sqlite, sqlx::sqlite::SqliteArguments> {
        let key = &request.key;
        let now = self.clock.wall_us();
        sqlx::query(statement(&self.sql.insert))
            .bind(&scope[..])
            .bind(key.key.as_str())
            .bind(key.subject.as_str())
            .bind(key.endpoint.as_str())
            .bind(&request.fingerprint.as_bytes()[..])
            .bind(request.lease.0)
            .bind(&request.generation.0[..])
            .bind(micros(request.in_progress_ttl))
            .bind(now)
            .bind(now.saturating_add(micros(request.in_progress_ttl + request.retention)))
            .bind(self.clock.boot_us())
    }

    /// Takes the record read under `read_lease` (see `Statements::take`): `None` when another
    /// claim took it first (or its holder renewed it); otherwise the record's generation as the
    /// take left it.
    async fn take(
        &self,
        request: &ClaimRequest,
        scope: &[u8; 32],
        read_lease: i64,
    ) -> Result<Option<Option<Generation>>, StoreError> {
        let row: Result<Option<(Vec<u8>,)>, sqlx::Error> = on_connection!(self, "retake", write, conn => {
        let now = self.clock.wall_us();
        sqlx::query_as(statement(&self.sql.take))
            .bind(&scope[..])
            .bind(&request.fingerprint.as_bytes()[..])
            .bind(request.lease.0)
            .bind(&request.generation.0[..])
            .bind(now)
            .bind(now.saturating_add(micros(request.in_progress_ttl + request.retention)))
            .bind(micros(request.in_progress_ttl))
            .bind(read_lease)
            .bind(self.clock.boot_us())
            .fetch_optional(&mut *conn)
        })?;
        match row {
            Ok(row) => Ok(row.map(|(generation,)| Generation::from_slice(&generation))),
            // Another writer held the file's lock past the busy timeout (a handler's transaction
            // completing this record, a backup): nothing was taken; in progress.
            Err(e) if super::busy(&e) => Ok(None),
            Err(e) => Err(claim_error("retake")(e)),
        }
    }
}

/// A database error of a claim's statement, as the store answers it. Two refuse the claim
/// (`503`), nothing claimed, never a reason to run unguarded nor to release anything: a table that
/// lacks a column this version needs (made by an earlier version, and `migrate()` has not run),
/// and another writer holding the file's lock past the busy timeout (a handler's transaction, a
/// backup: the statement wrote nothing).
pub(super) fn claim_error(what: &'static str) -> impl Fn(sqlx::Error) -> StoreError {
    move |e| {
        let missing = e
            .as_database_error()
            .is_some_and(|d| d.message().contains("no such column"));
        if missing {
            StoreError::refused_claim(format!(
                "sqlite {what}: the table lacks a column this version needs; run \
                 SqliteStore::migrate(): {e}"
            ))
        } else if super::busy(&e) {
            StoreError::refused_claim(format!(
                "sqlite {what}: another writer held the database's lock too long: {e}"
            ))
        } else {
            db(what)(e)
        }
    }
}

/// What the claim does with the record it read (see `IdempotencyStore::claim`), at `now` (the
/// wall clock's, and the boot clock's when it can be read).
fn decide(
    request: &ClaimRequest,
    row: Option<ClaimRow>,
    (now, boot): (i64, Option<i64>),
) -> Result<Next, StoreError> {
    let Some((
        status,
        lease,
        same_fp,
        updated_us,
        renewed_boot_us,
        holder_ttl_us,
        expires_us,
        generation,
        response_status,
        headers,
        body,
    )) = row
    else {
        return Ok(Next::Insert);
    };
    if expires_us <= now {
        // Past retention: the key is new again, whatever was there (a new generation).
        return Ok(Next::Take(lease));
    }
    let in_progress = status == "in_progress";
    if in_progress && lease == RELEASED {
        // Released for another try: the same request keeps the generation, another gets its own.
        return Ok(Next::Take(lease));
    }
    if !same_fp {
        return Ok(Next::Answer(ClaimOutcome::KeyReuse));
    }
    let outcome = match status.as_str() {
        "completed" => Finished::Completed,
        "failed" => Finished::Failed,
        // This claim's own record: the same claim, made twice (its first answer was lost).
        _ if lease == request.lease.0 => {
            return Ok(Next::Answer(ClaimOutcome::Claimed {
                lease: request.lease,
                generation: Generation::from_slice(&generation),
            }));
        }
        _ => {
            // The rule of `STALE` in `statements.rs`.
            let ttl = micros(request.in_progress_ttl).max(holder_ttl_us);
            // `renewed_boot_us` is read only when it was written with `updated_us`.
            let stale = match (boot, renewed_boot_us) {
                (Some(boot), Some(renewed)) => {
                    renewed <= boot.saturating_sub(ttl) || renewed > boot.saturating_add(ttl)
                }
                _ => updated_us <= now.saturating_sub(ttl),
            };
            return Ok(if stale {
                Next::TakeStale(lease)
            } else {
                Next::Answer(ClaimOutcome::InProgress)
            });
        }
    };
    // A finished record that cannot be read (a row edited by hand) is never a reason to run the
    // operation again, even for a layer that fails open.
    let unreadable = |what: &str| {
        StoreError::unreadable_record(format!(
            "sqlite claim: a finished record is unreadable ({what})"
        ))
    };
    let status = response_status
        .and_then(|s| u16::try_from(s).ok())
        .ok_or_else(|| unreadable("its status"))?;
    let headers = headers
        .and_then(|h| {
            let mut rest = &h[..];
            crate::store::header_list::read(&mut rest).filter(|_| rest.is_empty())
        })
        .ok_or_else(|| unreadable("its headers"))?;
    let left = u64::try_from(expires_us.saturating_sub(now)).unwrap_or(0);
    Ok(Next::Answer(ClaimOutcome::Finished(Arc::new(
        StoredResponse::new(outcome, status, headers, body.map(Bytes::from))
            .with_expires_in(Some(Duration::from_micros(left))),
    ))))
}
