//! Claims, completions and releases sent together (SPEC 26): what arrives while a statement of its
//! kind is in flight goes in the next one (see `store::sql::batch`). Alone, each goes through the
//! statement it always had. Retakes, renewals (the keeper already sends them together) and
//! completions in a handler's transaction are not batched.

use std::sync::Arc;
use std::time::Duration;

use futures_util::future::join_all;
use sqlx::Row;
use sqlx::postgres::PgRow;

use super::{PostgresStore, db, micros, on_connection};
use crate::store::sql::batch::{Batcher, Forced, Rows};
use crate::store::{ClaimRequest, LeaseToken, StoreError, StoredResponse};

/// The store's batchers, shared by its clones.
#[derive(Debug)]
pub(super) struct Batches {
    pub(super) claims: Arc<Batcher<Claims>>,
    pub(super) completions: Arc<Batcher<Completions>>,
    pub(super) releases: Arc<Batcher<Releases>>,
}

impl Batches {
    pub(super) fn new(forced: Option<Forced>) -> Self {
        Batches {
            claims: Arc::new(Batcher::new(forced)),
            completions: Arc::new(Batcher::new(forced)),
            releases: Arc::new(Batcher::new(forced)),
        }
    }
}

impl Default for Batches {
    fn default() -> Self {
        Batches::new(None)
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

    async fn one(store: &PostgresStore, item: &Claim) -> Self::Answer {
        store.claim_row(&item.request, &item.scope).await
    }

    async fn many(store: &PostgresStore, items: &[&Claim]) -> Option<Vec<Self::Answer>> {
        let column = |f: &dyn Fn(&Claim) -> String| items.iter().map(|c| f(c)).collect::<Vec<_>>();
        let scopes: Vec<&[u8]> = items.iter().map(|c| &c.scope[..]).collect();
        let keys = column(&|c| {
            if store.scope_columns {
                c.request.key.key.clone()
            } else {
                String::new()
            }
        });
        let subjects = column(&|c| store.scope_column(&c.request.key.subject).into_owned());
        let endpoints = column(&|c| store.scope_column(&c.request.key.endpoint).into_owned());
        let fingerprints: Vec<&[u8]> = items
            .iter()
            .map(|c| &c.request.fingerprint.as_bytes()[..])
            .collect();
        let leases: Vec<i64> = items.iter().map(|c| c.request.lease.0).collect();
        let lifetimes: Vec<f64> = items
            .iter()
            .map(|c| micros(c.request.in_progress_ttl + c.request.retention))
            .collect();
        let ttls: Vec<f64> = items
            .iter()
            .map(|c| micros(c.request.in_progress_ttl))
            .collect();
        let generations: Vec<&[u8]> = items.iter().map(|c| &c.request.generation.0[..]).collect();
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
                .bind(&*store.lock_timeout)
                .fetch_all(&mut *conn)
        })
        .and_then(|rows| rows.map_err(db("claim")));
        let rows = match rows {
            Ok(rows) => rows,
            Err(e) => {
                tracing::debug!(error = %e, rows = items.len(), "a batch of claims failed; each goes alone");
                return None;
            }
        };
        let mut answers: Vec<Option<PgRow>> = (0..items.len()).map(|_| None).collect();
        for row in rows {
            let place = row
                .try_get::<i64, _>("ord")
                .ok()
                .and_then(|ord| usize::try_from(ord).ok())
                .and_then(|ord| ord.checked_sub(1))
                .filter(|place| *place < items.len());
            match place {
                Some(place) if answers[place].is_none() => answers[place] = Some(row),
                // Two answers for one claim, or one for none: not this statement's shape.
                _ => return None,
            }
        }
        // A claim without an answer met a row inserted since the statement's snapshot: alone,
        // its own statement sees that row.
        let alone = join_all(
            answers
                .iter()
                .zip(items)
                .filter(|(answer, _)| answer.is_none())
                .map(|(_, item)| Self::one(store, item)),
        )
        .await;
        let mut alone = alone.into_iter();
        Some(
            answers
                .into_iter()
                .map(|answer| match answer {
                    Some(row) => Ok(Some(row)),
                    None => alone.next().unwrap_or(Ok(None)),
                })
                .collect(),
        )
    }

    /// A claim whose request left while it was in flight: released by its lease (which matches
    /// nothing unless the claim was granted).
    async fn orphaned(store: PostgresStore, item: Claim, answer: Self::Answer) {
        if matches!(answer, Ok(None)) {
            return;
        }
        if let Err(e) = store.release_row(&item.scope, item.request.lease).await {
            tracing::warn!(
                error = %e,
                "a claim granted to a request that left could not be released; the record is \
                 retaken once its in-progress TTL has passed"
            );
        }
    }
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

    async fn many(store: &PostgresStore, items: &[&Completion]) -> Option<Vec<Self::Answer>> {
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
        Some(
            join_all(
                answers
                    .into_iter()
                    .zip(items)
                    .map(|((held, locked), item)| async move {
                        if locked {
                            Self::one(store, item).await
                        } else {
                            Ok(held)
                        }
                    }),
            )
            .await,
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

    async fn many(store: &PostgresStore, items: &[&Release]) -> Option<Vec<Self::Answer>> {
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
        Some(
            join_all(
                answers
                    .into_iter()
                    .zip(items)
                    .map(|((released, locked), item)| async move {
                        if locked {
                            Self::one(store, item).await
                        } else {
                            Ok(released)
                        }
                    }),
            )
            .await,
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
            .unwrap_or_else(|| Err(self.no_answer("release")))
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

    /// A claim's row, alone or together with others (see `claim_row`).
    pub(super) async fn claim_together(
        &self,
        request: &ClaimRequest,
        scope: &[u8; 32],
    ) -> Result<Option<PgRow>, StoreError> {
        self.batches
            .claims
            .send(
                self,
                self.claim_row(request, scope),
                || Claim {
                    request: request.clone(),
                    scope: *scope,
                },
                self.timeout,
            )
            .await
            .unwrap_or_else(|| Err(self.no_answer("claim")))
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
            .unwrap_or_else(|| Err(self.no_answer("complete")))
    }
}
