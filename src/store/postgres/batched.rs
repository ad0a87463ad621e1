//! Claims, completions and releases sent together (SPEC 26): what arrives while a statement of its
//! kind is in flight goes in the next one (see `store::sql::batch`). Alone, each goes through the
//! statement it always had. Retakes, renewals (the keeper already sends them together) and
//! completions in a handler's transaction are not batched.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;

use sqlx::Row;
use sqlx::postgres::PgRow;

use super::{PostgresStore, db, micros, on_connection, pg_millis};
use crate::store::sql::batch::{Batcher, Mode, Rows, release_orphan};
use crate::util::lock::lock;

use super::claim::{FUNCTION_PROBE, LOCK_NOT_AVAILABLE};
use crate::store::{ClaimRequest, LeaseToken, StoreError, StoredResponse};

/// The store's batchers, shared by its clones with the same settings.
#[derive(Debug)]
pub(super) struct Batches {
    pub(super) claims: Arc<Batcher<Claims>>,
    pub(super) completions: Arc<Batcher<Completions>>,
    pub(super) releases: Arc<Batcher<Releases>>,
    pub(super) mode: Mode,
}

impl Batches {
    pub(super) fn new(mode: Mode) -> Self {
        Batches {
            claims: mode.batcher(),
            completions: mode.batcher(),
            releases: mode.batcher(),
            mode,
        }
    }
}

impl Default for Batches {
    fn default() -> Self {
        Batches::new(Mode::default())
    }
}

/// A claim, as the batch needs it.
pub(super) struct Claim {
    pub(super) request: ClaimRequest,
    pub(super) scope: [u8; 32],
}

/// Claims: the claim function's first query, for many. The answer is what `claim_row` answers.
#[derive(Debug)]
pub(super) struct Claims;

impl Rows for Claims {
    type Store = PostgresStore;
    type Item = Claim;
    type Answer = Result<Option<PgRow>, StoreError>;

    fn scope(item: &Claim) -> &[u8; 32] {
        &item.scope
    }

    /// As a claim alone: the statement of many with one row (a row that is there is read as
    /// last committed, not waited for), then the single claim if that gave no answer.
    async fn one(store: &PostgresStore, item: &Claim) -> Self::Answer {
        store.claim_alone(&item.request, &item.scope).await
    }

    async fn many(store: &PostgresStore, items: &[&Claim]) -> Option<Vec<Option<Self::Answer>>> {
        let items: Vec<(&ClaimRequest, &[u8; 32])> =
            items.iter().map(|c| (&c.request, &c.scope)).collect();
        claim_rows(store, &items).await
    }

    /// A claim whose request left while it was in flight: released by its lease (see
    /// `release_orphan`), unless its answer says nothing was written.
    async fn orphaned(store: PostgresStore, item: Claim, answer: Self::Answer) {
        match &answer {
            Ok(None) => return,
            Err(e) if !e.may_have_claimed() => return,
            _ => {}
        }
        release_orphan(&store, &item.request).await;
    }
}

/// Claims of `items` (distinct scopes) in one statement (the function of migrations/0008), each
/// answered as `claim_row` answers it, or `None` for a claim that must go alone (it met a row
/// inserted since the statement's snapshot: alone, its own statement sees it); `None` for all
/// when the statement failed, or the function is missing. Rows that are there are read as last
/// committed, never waited for; the statement may wait only on claims of the same new scopes in
/// flight elsewhere (and on a table another program locked), each wait bounded by its share of
/// the lock timeout, so that all of them together stay within the one a single claim has.
async fn claim_rows(
    store: &PostgresStore,
    items: &[(&ClaimRequest, &[u8; 32])],
) -> Option<Vec<Option<ClaimAnswer>>> {
    let probing = match *lock(&store.sql().many_missing) {
        None => false,
        Some(since) if since.elapsed() >= FUNCTION_PROBE => true,
        Some(_) => return None,
    };
    let scopes: Vec<&[u8]> = items.iter().map(|(_, scope)| &scope[..]).collect();
    let keys: Vec<&str> = items
        .iter()
        .map(|(r, _)| {
            if store.scope_columns {
                &r.key.key[..]
            } else {
                ""
            }
        })
        .collect();
    let subjects: Vec<Cow<'_, str>> = items
        .iter()
        .map(|(r, _)| store.scope_column(&r.key.subject))
        .collect();
    let endpoints: Vec<Cow<'_, str>> = items
        .iter()
        .map(|(r, _)| store.scope_column(&r.key.endpoint))
        .collect();
    let subjects: Vec<&str> = subjects.iter().map(|s| &s[..]).collect();
    let endpoints: Vec<&str> = endpoints.iter().map(|s| &s[..]).collect();
    let fingerprints: Vec<&[u8]> = items
        .iter()
        .map(|(r, _)| &r.fingerprint.as_bytes()[..])
        .collect();
    let leases: Vec<i64> = items.iter().map(|(r, _)| r.lease.0).collect();
    let lifetimes: Vec<f64> = items
        .iter()
        .map(|(r, _)| micros(r.in_progress_ttl + r.retention))
        .collect();
    let ttls: Vec<f64> = items
        .iter()
        .map(|(r, _)| micros(r.in_progress_ttl))
        .collect();
    let generations: Vec<&[u8]> = items.iter().map(|(r, _)| &r.generation.0[..]).collect();
    let share = lock_timeout_share(store.timeout, items.len());
    let rows = on_connection!(store, "claim", conn => {
        sqlx::query(sqlx::AssertSqlSafe(store.sql().claim_many.as_str()))
            .bind(&scopes)
            .bind(&keys)
            .bind(&subjects)
            .bind(&endpoints)
            .bind(&fingerprints)
            .bind(&leases)
            .bind(&lifetimes)
            .bind(&ttls)
            .bind(&generations)
            .bind(&share)
            .fetch_all(&mut *conn)
    });
    let rows = match rows {
        Ok(Ok(rows)) => {
            if probing {
                *lock(&store.sql().many_missing) = None;
            }
            rows
        }
        Ok(Err(sqlx::Error::Database(e))) if e.code().as_deref() == Some("42883") => {
            tracing::warn!(
                table = %store.sql().table,
                "the function that claims many keys is missing (run PostgresStore::migrate): \
                 every claim is a statement of its own until it is there"
            );
            *lock(&store.sql().many_missing) = Some(std::time::Instant::now());
            return None;
        }
        // A wait on a lock past the statement's lock timeout (a row or the table another
        // transaction holds): nothing was written.
        // Alone, the claim is answered as a single claim that waited is, from a plain read (in
        // progress, or refused), not by waiting again; in a batch, one key's lock must not answer
        // the others, and each goes alone.
        Ok(Err(sqlx::Error::Database(e))) if e.code().as_deref() == Some(LOCK_NOT_AVAILABLE) => {
            if let [(_, scope)] = items {
                return Some(vec![Some(store.locked(scope).await)]);
            }
            return None;
        }
        // The server refused the statement: it was rolled back, nothing was written.
        Ok(Err(e @ sqlx::Error::Database(_))) => {
            tracing::debug!(error = %e, rows = items.len(), "claims together failed; each goes alone");
            return None;
        }
        // The connection failed under the statement (its answer lost, perhaps after it
        // committed): the claims may have been written; each answers so, for its caller to
        // abandon (or, if it left, for `orphaned` to release) by its lease.
        Ok(Err(e)) => {
            let e = db("claim")(e);
            return Some(items.iter().map(|_| Some(Err(e.copy()))).collect());
        }
        // No answer within the operation timeout (or no connection): the claims may have been
        // written. Every claim answers so, for its caller to abandon by its lease; none is sent
        // again for a caller that has likely given up.
        Err(e) => return Some(items.iter().map(|_| Some(Err(e.copy()))).collect()),
    };
    let mut answers: Vec<Option<ClaimAnswer>> = (0..items.len()).map(|_| None).collect();
    for row in rows {
        let place = row
            .try_get::<i64, _>("ord")
            .ok()
            .and_then(|ord| usize::try_from(ord).ok())
            .and_then(|ord| ord.checked_sub(1))
            .filter(|place| *place < items.len());
        match place {
            Some(place) if answers[place].is_none() => answers[place] = Some(Ok(Some(row))),
            // Two answers for one claim, or one for none: not this statement's shape, and it
            // committed; every claim may have been written.
            _ => {
                let e = StoreError::msg("postgres claim: the claims' answer had another shape");
                return Some(items.iter().map(|_| Some(Err(e.copy()))).collect());
            }
        }
    }
    Some(answers)
}

/// A claim's answer, as `claim_row` gives it.
type ClaimAnswer = Result<Option<PgRow>, StoreError>;

/// The lock timeout of each wait of a statement of `rows` claims: the single claim's, shared out
/// (at least a millisecond).
fn lock_timeout_share(timeout: Duration, rows: usize) -> String {
    let whole = timeout * 4 / 5;
    let share = whole / u32::try_from(rows.max(1)).unwrap_or(u32::MAX);
    format!("{}ms", pg_millis(share))
}

/// A completion, as the batch needs it.
pub(super) struct Completion {
    pub(super) scope: [u8; 32],
    pub(super) lease: LeaseToken,
    pub(super) response: Arc<StoredResponse>,
    pub(super) retention: Duration,
}

/// Completions outside a handler's transaction. The answer: whether the lease finished the
/// record (the completion statement's `held`).
#[derive(Debug)]
pub(super) struct Completions;

impl Rows for Completions {
    type Store = PostgresStore;
    type Item = Completion;
    type Answer = Result<bool, StoreError>;

    fn scope(item: &Completion) -> &[u8; 32] {
        &item.scope
    }

    async fn one(store: &PostgresStore, item: &Completion) -> Self::Answer {
        store
            .complete_row(&item.scope, item.lease, &item.response, item.retention)
            .await
    }

    async fn many(
        store: &PostgresStore,
        items: &[&Completion],
    ) -> Option<Vec<Option<Self::Answer>>> {
        let scopes: Vec<&[u8]> = items.iter().map(|c| &c.scope[..]).collect();
        let leases: Vec<i64> = items.iter().map(|c| c.lease.0).collect();
        let statuses: Vec<&str> = items.iter().map(|c| c.response.outcome.as_str()).collect();
        let codes: Vec<i16> = items
            .iter()
            .map(|c| i16::try_from(c.response.status).unwrap_or(500))
            .collect();
        let (mut firsts, mut counts) = (Vec::new(), Vec::new());
        let (mut names, mut values): (Vec<&str>, Vec<&[u8]>) = (Vec::new(), Vec::new());
        for item in items {
            let first = i32::try_from(names.len()).ok()?;
            for (name, value) in item.response.headers.iter() {
                names.push(name.as_str());
                values.push(value.as_bytes());
            }
            firsts.push(first);
            counts.push(i32::try_from(names.len()).ok()? - first);
        }
        let bodies: Vec<Option<&[u8]>> = items
            .iter()
            .map(|c| (!c.response.body_omitted).then_some(&c.response.body[..]))
            .collect();
        let retentions: Vec<f64> = items.iter().map(|c| micros(c.retention)).collect();
        let rows = on_connection!(store, "complete", conn => {
            sqlx::query_as::<_, (i64, bool, bool)>(sqlx::AssertSqlSafe(
                store.sql().complete_many.as_str(),
            ))
            .bind(&scopes)
            .bind(&leases)
            .bind(&statuses)
            .bind(&codes)
            .bind(&firsts)
            .bind(&counts)
            .bind(&names)
            .bind(&values)
            .bind(&bodies)
            .bind(&retentions)
            .bind(&*store.lock_timeout)
            .fetch_all(&mut *conn)
        })
        .and_then(|rows| rows.map_err(db("complete")));
        let rows = match rows {
            Ok(rows) => rows,
            Err(e) => {
                tracing::debug!(error = %e, rows = items.len(), "a batch of completions failed; each goes alone");
                return None;
            }
        };
        let answers = by_place(items.len(), rows)?;
        // A row another transaction held goes alone.
        Some(
            answers
                .into_iter()
                .map(|(held, locked)| (!locked).then_some(Ok(held)))
                .collect(),
        )
    }

    /// A completion is the engine's to retry; a request that left needs nothing undone.
    async fn orphaned(_: PostgresStore, _: Completion, _: Self::Answer) {}
}

/// A release, as the batch needs it.
pub(super) struct Release {
    pub(super) scope: [u8; 32],
    pub(super) lease: LeaseToken,
}

/// Releases. The answer: whether the lease held the record it released.
#[derive(Debug)]
pub(super) struct Releases;

impl Rows for Releases {
    type Store = PostgresStore;
    type Item = Release;
    type Answer = Result<bool, StoreError>;

    fn scope(item: &Release) -> &[u8; 32] {
        &item.scope
    }

    async fn one(store: &PostgresStore, item: &Release) -> Self::Answer {
        store.release_one(&item.scope, item.lease).await
    }

    async fn many(store: &PostgresStore, items: &[&Release]) -> Option<Vec<Option<Self::Answer>>> {
        let scopes: Vec<&[u8]> = items.iter().map(|r| &r.scope[..]).collect();
        let leases: Vec<i64> = items.iter().map(|r| r.lease.0).collect();
        let rows = on_connection!(store, "release", conn => {
            sqlx::query_as::<_, (i64, bool, bool)>(sqlx::AssertSqlSafe(
                store.sql().release_many.as_str(),
            ))
            .bind(&scopes)
            .bind(&leases)
            .bind(&*store.lock_timeout)
            .fetch_all(&mut *conn)
        })
        .and_then(|rows| rows.map_err(db("release")));
        let rows = match rows {
            Ok(rows) => rows,
            Err(e) => {
                tracing::debug!(error = %e, rows = items.len(), "a batch of releases failed; each goes alone");
                return None;
            }
        };
        let answers = by_place(items.len(), rows)?;
        // A row another transaction held goes alone.
        Some(
            answers
                .into_iter()
                .map(|(released, locked)| (!locked).then_some(Ok(released)))
                .collect(),
        )
    }

    async fn orphaned(_: PostgresStore, _: Release, _: Self::Answer) {}
}

/// The answer rows `(ord, a, b)` of a batch of `len` in input order; `None` unless every input has
/// exactly one.
fn by_place(len: usize, rows: Vec<(i64, bool, bool)>) -> Option<Vec<(bool, bool)>> {
    let mut answers: Vec<Option<(bool, bool)>> = vec![None; len];
    for (ord, a, b) in rows {
        let place = usize::try_from(ord).ok()?.checked_sub(1)?;
        let slot = answers.get_mut(place)?;
        if slot.replace((a, b)).is_some() {
            return None;
        }
    }
    answers.into_iter().collect()
}

impl PostgresStore {
    /// Whether `lease` held the record it released: `release`'s statement, alone.
    async fn release_one(&self, scope: &[u8; 32], lease: LeaseToken) -> Result<bool, StoreError> {
        let done = on_connection!(self, "release", conn => {
            self.leased(&self.sql().release, scope, lease)
                .bind(&*self.lock_timeout)
                .execute(&mut *conn)
        })?
        .map_err(db("release"))?;
        Ok(done.rows_affected() == 1)
    }

    /// A release, alone or together with others.
    pub(super) async fn release_row(
        &self,
        scope: &[u8; 32],
        lease: LeaseToken,
    ) -> Result<bool, StoreError> {
        let release = Release {
            scope: *scope,
            lease,
        };
        self.batches
            .releases
            .send(
                self,
                self.release_one(scope, lease),
                || release,
                self.timeout,
            )
            .await
            .into_result(
                || self.no_answer("release"),
                || StoreError::msg("postgres release: queued past the operation timeout; not sent"),
            )
    }

    /// `complete`'s statement, alone: whether the lease finished the record.
    pub(super) async fn complete_row(
        &self,
        scope: &[u8; 32],
        lease: LeaseToken,
        response: &StoredResponse,
        retention: Duration,
    ) -> Result<bool, StoreError> {
        let (held,): (bool,) = on_connection!(self, "complete", conn => {
            self.completion(&self.sql().complete, scope, lease, response, retention)
                .fetch_one(&mut *conn)
        })?
        .map_err(db("complete"))?;
        Ok(held)
    }

    /// A claim alone: the statement of many with one row, which reads a row that is there as
    /// last committed rather than wait on its lock (a handler's transaction committing it); the
    /// single claim (`claim_row`) when that gave no answer (a row inserted since its snapshot) or
    /// the function is missing.
    pub(super) async fn claim_alone(
        &self,
        request: &ClaimRequest,
        scope: &[u8; 32],
    ) -> Result<Option<PgRow>, StoreError> {
        match claim_rows(self, &[(request, scope)]).await {
            Some(mut answers) => match answers.pop().flatten() {
                Some(answer) => answer,
                None => self.claim_row(request, scope).await,
            },
            None => self.claim_row(request, scope).await,
        }
    }

    /// A claim's row, alone or together with others (see `claim_row`). A claim that waited on a
    /// row lock would hold its place in flight, and every claim queued behind it would wait too:
    /// alone, a claim goes as `claim_alone`; while the function of many is missing (a table an
    /// earlier version migrated, or a role that may not create it), every claim goes alone,
    /// outside the batcher, as before statements went together.
    pub(super) async fn claim_together(
        &self,
        request: &ClaimRequest,
        scope: &[u8; 32],
    ) -> Result<Option<PgRow>, StoreError> {
        let missing =
            lock(&self.sql().many_missing).is_some_and(|since| since.elapsed() < FUNCTION_PROBE);
        if missing {
            return self.claim_row(request, scope).await;
        }
        self.batches
            .claims
            .send(
                self,
                self.claim_alone(request, scope),
                || Claim {
                    request: request.clone(),
                    scope: *scope,
                },
                self.timeout,
            )
            .await
            .into_result(
                || self.no_answer("claim"),
                || {
                    StoreError::refused_claim(
                        "postgres claim: queued behind the claims in flight past the operation \
                         timeout; nothing was sent",
                    )
                },
            )
    }

    /// A completion, alone or together with others: whether the lease finished the record.
    pub(super) async fn complete_together(
        &self,
        scope: &[u8; 32],
        lease: LeaseToken,
        response: Arc<StoredResponse>,
        retention: Duration,
    ) -> Result<bool, StoreError> {
        self.batches
            .completions
            .send(
                self,
                self.complete_row(scope, lease, &response, retention),
                || Completion {
                    scope: *scope,
                    lease,
                    response: response.clone(),
                    retention,
                },
                self.timeout,
            )
            .await
            .into_result(
                || self.no_answer("complete"),
                || {
                    StoreError::msg(
                        "postgres complete: queued past the operation timeout; not sent",
                    )
                },
            )
    }
}
