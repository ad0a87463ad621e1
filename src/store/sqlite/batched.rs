//! Writes together (SPEC 26): the inserts of fresh keys' claims, and completions, that queue
//! behind the write in flight go in one `BEGIN IMMEDIATE` transaction, one commit (and one
//! flush to disk) for many, each statement with its own answer (see `store::sql::batch`). SQLite
//! takes one writer at a time, so one write of a kind is in flight at a time; alone, a write goes
//! at once, in a transaction of its own, as before. Retakes, renewals (the keeper already sends
//! them together) and completions in a handler's transaction are not batched.

use std::sync::Arc;
use std::time::Duration;

use sqlx::Connection;

use super::claim::claim_error;
use super::{SqliteStore, db, on_connection};
use crate::store::sql::batch::{Batcher, Mode, Rows, release_orphan};
use crate::store::{ClaimRequest, LeaseToken, StoreError, StoredResponse};

/// The store's batchers, shared by its clones with the same settings.
#[derive(Debug)]
pub(super) struct Batches {
    pub(super) inserts: Arc<Batcher<Inserts>>,
    pub(super) completions: Arc<Batcher<Completions>>,
    pub(super) mode: Mode,
}

impl Batches {
    pub(super) fn new(mode: Mode) -> Self {
        Batches {
            inserts: mode.one_at_a_time(),
            completions: mode.one_at_a_time(),
            mode,
        }
    }
}

impl Default for Batches {
    fn default() -> Self {
        Batches::new(Mode::default())
    }
}

/// A fresh key's insert, as the batch needs it.
pub(super) struct Insert {
    pub(super) request: ClaimRequest,
    pub(super) scope: [u8; 32],
}

/// Inserts of fresh keys' records. The answer: whether the row was inserted (false: a row was
/// there already).
#[derive(Debug)]
pub(super) struct Inserts;

impl Rows for Inserts {
    type Store = SqliteStore;
    type Item = Insert;
    type Answer = Result<bool, StoreError>;

    fn scope(item: &Insert) -> &[u8; 32] {
        &item.scope
    }

    async fn one(store: &SqliteStore, item: &Insert) -> Self::Answer {
        store.insert_alone(&item.request, &item.scope).await
    }

    async fn many(store: &SqliteStore, items: &[&Insert]) -> Option<Vec<Option<Self::Answer>>> {
        let done = on_connection!(store, "claim", write, conn => async {
            let mut tx = conn.begin_with("BEGIN IMMEDIATE").await?;
            let mut answers = Vec::with_capacity(items.len());
            for item in items {
                let done = store
                    .insert_query(&item.request, &item.scope)
                    .execute(&mut *tx)
                    .await?;
                answers.push(Some(Ok(done.rows_affected() == 1)));
            }
            tx.commit().await?;
            Ok::<_, sqlx::Error>(answers)
        });
        match done {
            Ok(Ok(answers)) => Some(answers),
            // Another writer held the database past the busy timeout: nothing was written, and
            // each row is refused as a single insert would be, not sent again to wait as long.
            Ok(Err(e)) if super::busy(&e) => {
                let refused = claim_error("claim")(e);
                Some(items.iter().map(|_| Some(Err(refused.copy()))).collect())
            }
            // SQLite refused a statement: the transaction was rolled back, nothing written.
            Ok(Err(e @ sqlx::Error::Database(_))) => {
                tracing::debug!(error = %e, rows = items.len(), "inserts together failed; each goes alone");
                None
            }
            // The connection failed under the transaction: the rows may have been written.
            Ok(Err(e)) => {
                let e = claim_error("claim")(e);
                Some(items.iter().map(|_| Some(Err(e.copy()))).collect())
            }
            // No answer in time: the rows may have been written; each answers so.
            Err(e) => Some(items.iter().map(|_| Some(Err(e.copy()))).collect()),
        }
    }

    /// A claim whose request left while it was in flight: released by its lease (see
    /// `release_orphan`), unless its answer says nothing was written.
    async fn orphaned(store: SqliteStore, item: Insert, answer: Self::Answer) {
        match &answer {
            Ok(false) => return,
            Err(e) if !e.may_have_claimed() => return,
            _ => {}
        }
        release_orphan(&store, &item.request).await;
    }
}

/// A completion, as the batch needs it.
pub(super) struct Completion {
    pub(super) scope: [u8; 32],
    pub(super) lease: LeaseToken,
    pub(super) response: Arc<StoredResponse>,
    pub(super) retention: Duration,
}

/// Completions outside a handler's transaction. The answer: whether the statement finished the
/// record (else the caller asks whether the lease had finished it before).
#[derive(Debug)]
pub(super) struct Completions;

impl Rows for Completions {
    type Store = SqliteStore;
    type Item = Completion;
    type Answer = Result<bool, StoreError>;

    fn scope(item: &Completion) -> &[u8; 32] {
        &item.scope
    }

    async fn one(store: &SqliteStore, item: &Completion) -> Self::Answer {
        store
            .complete_alone(&item.scope, item.lease, &item.response, item.retention)
            .await
    }

    async fn many(store: &SqliteStore, items: &[&Completion]) -> Option<Vec<Option<Self::Answer>>> {
        let mut statements = Vec::with_capacity(items.len());
        for item in items {
            // A response whose headers cannot be written fails alone, not the batch.
            match store.completion(&item.scope, item.lease, &item.response, item.retention) {
                Ok(statement) => statements.push(Some(statement)),
                Err(_) => statements.push(None),
            }
        }
        let done = on_connection!(store, "complete", write, conn => async {
            let mut tx = conn.begin_with("BEGIN IMMEDIATE").await?;
            let mut answers = Vec::with_capacity(statements.len());
            for statement in statements {
                answers.push(match statement {
                    Some(statement) => Some(statement.execute(&mut *tx).await?.rows_affected() == 1),
                    None => None,
                });
            }
            tx.commit().await?;
            Ok::<_, sqlx::Error>(answers)
        });
        match done {
            // A response whose headers could not be written goes alone, to fail on its own.
            Ok(Ok(answers)) => Some(answers.into_iter().map(|done| done.map(Ok)).collect()),
            // Busy, as above: nothing was written; each completion fails, for the engine to try
            // again, rather than wait as long once more.
            Ok(Err(e)) if super::busy(&e) => {
                let failed = db("complete")(e);
                Some(items.iter().map(|_| Some(Err(failed.copy()))).collect())
            }
            Ok(Err(e)) => {
                tracing::debug!(error = %e, rows = items.len(), "completions together failed; each goes alone");
                None
            }
            Err(e) => Some(items.iter().map(|_| Some(Err(e.copy()))).collect()),
        }
    }

    /// A completion is the engine's to retry; a request that left needs nothing undone.
    async fn orphaned(_: SqliteStore, _: Completion, _: Self::Answer) {}
}

impl SqliteStore {
    /// A fresh key's insert, alone or together with others.
    pub(super) async fn insert_together(
        &self,
        request: &ClaimRequest,
        scope: &[u8; 32],
    ) -> Result<bool, StoreError> {
        self.batches
            .inserts
            .send(
                self,
                self.insert_alone(request, scope),
                || Insert {
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
                        "sqlite claim: queued behind the write in flight past the operation \
                         timeout; nothing was sent",
                    )
                },
            )
    }

    /// The completion statement alone: whether it finished the record.
    pub(super) async fn complete_alone(
        &self,
        scope: &[u8; 32],
        lease: LeaseToken,
        response: &StoredResponse,
        retention: Duration,
    ) -> Result<bool, StoreError> {
        let completion = self.completion(scope, lease, response, retention)?;
        let done = on_connection!(self, "complete", write, conn => {
            completion.execute(&mut *conn)
        })?
        .map_err(db("complete"))?;
        Ok(done.rows_affected() == 1)
    }

    /// A completion, alone or together with others: whether it finished the record.
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
                self.complete_alone(scope, lease, &response, retention),
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
                || StoreError::msg("sqlite complete: queued past the operation timeout; not sent"),
            )
    }
}
