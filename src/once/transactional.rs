//! [`RunOnce::run_in_transaction`]: the closure writes its effects in a Postgres transaction that
//! the record of its output is completed in, and committed with, as a handler's effects are with
//! `IdempotencyTx`: both happen or neither.
//!
//! - The closure gets the transaction and gives it back with its output. Its `Err`, a panic, or
//!   the maximum hold drop the transaction (rolled back: none of its effects happened) and release
//!   the record, so a later call runs again.
//! - The completion is written in the transaction, fenced by the lease: a lease lost meanwhile
//!   (the record was retaken) matches nothing, the transaction is rolled back, and the call
//!   answers [`OnceError::InProgress`] (the retaker's output is the one that counts).
//! - A commit that fails is settled as the layer settles it: the record is released if the commit
//!   did not land (the effects did not happen), and the output is answered if it did.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use futures_util::FutureExt;
use serde::Serialize;
use serde::de::DeserializeOwned;
use sqlx::{Postgres, Transaction};

use super::{OUTPUT, OnceError, RunOnce, recorded};
use crate::config::Config;
use crate::context::IdempotencyContext;
use crate::fingerprint::Fingerprint;
use crate::lease::Lease;
use crate::record::RecordKey;
use crate::recording::transactional::{InTransaction, commit_with_record, rollback};
use crate::store::{IdempotencyStore, StoreError};

/// The transaction a [`RunOnce::run_in_transaction`] closure writes its effects in (it derefs to a
/// `PgConnection`: `query.execute(&mut *tx)`), and gives back with its output. It has no `commit`
/// or `rollback`: the record of the output is written in it and committed with the effects. (Do not
/// send `COMMIT` through it either: effects committed apart from their record would run again.)
pub struct OnceTransaction {
    tx: Transaction<'static, Postgres>,
}

impl std::fmt::Debug for OnceTransaction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OnceTransaction").finish_non_exhaustive()
    }
}

impl std::ops::Deref for OnceTransaction {
    type Target = sqlx::PgConnection;

    fn deref(&self) -> &sqlx::PgConnection {
        &self.tx
    }
}

impl std::ops::DerefMut for OnceTransaction {
    fn deref_mut(&mut self) -> &mut sqlx::PgConnection {
        &mut self.tx
    }
}

impl<St: IdempotencyStore> RunOnce<St> {
    /// [`run`](Self::run), with the closure's effects and the record of its output committed in
    /// one Postgres transaction: the closure gets the transaction and returns it with its output,
    /// `Ok((output, tx))`; it must not commit it. Both happen or neither:
    ///
    /// - the closure's `Err`, a panic, or the maximum hold drop the transaction (rolled back) and
    ///   release the record, so a later call runs again;
    /// - the completion is written in the transaction, fenced by the lease: a lease lost meanwhile
    ///   (the record was retaken) matches nothing, the transaction is rolled back, and the call
    ///   answers [`OnceError::InProgress`];
    /// - a commit that fails releases the record if the commit did not land, and answers the
    ///   output if it did.
    ///
    /// Needs a store whose capabilities include a `PostgresStore` (a `PostgresStore`, or a wrapper
    /// of one): on another, the call answers [`OnceError::Store`] without running `f`.
    /// [`OnceError::TimedOut`] here means the closure was cancelled at the maximum hold and its
    /// transaction rolled back: the record is released and a later call runs again.
    pub async fn run_in_transaction<T, E, F, Fut>(
        &self,
        scope: RecordKey,
        fingerprint: Fingerprint,
        f: F,
    ) -> Result<T, OnceError<E>>
    where
        T: Serialize + DeserializeOwned + Send + 'static,
        E: Send + 'static,
        F: FnOnce(IdempotencyContext, OnceTransaction) -> Fut + Send + 'static,
        Fut: Future<Output = Result<(T, OnceTransaction), E>> + Send + 'static,
    {
        if self.store.capabilities().postgres().is_none() {
            return Err(OnceError::Store(StoreError::msg(
                "run_in_transaction needs a PostgresStore (or a wrapper of one)",
            )));
        }
        self.on_its_own_task(scope, fingerprint, |config, lease, ctx| {
            Box::pin(async move { held_in_transaction(&config, lease, ctx, f).await })
        })
        .await
    }
}

/// Runs the closure in a transaction under its lease, then completes the record in that
/// transaction and commits; or rolls back and releases.
async fn held_in_transaction<St, T, E, F, Fut>(
    config: &Config,
    lease: Lease<St>,
    context: IdempotencyContext,
    f: F,
) -> Result<T, OnceError<E>>
where
    St: IdempotencyStore,
    T: Serialize,
    F: FnOnce(IdempotencyContext, OnceTransaction) -> Fut,
    Fut: Future<Output = Result<(T, OnceTransaction), E>>,
{
    let Some(pg) = lease.store().capabilities().postgres().cloned() else {
        lease
            .release("the store has no Postgres transactions")
            .await;
        return Err(OnceError::Store(StoreError::msg(
            "run_in_transaction needs a PostgresStore",
        )));
    };
    let tx = match pg.begin(config.in_progress_ttl).await {
        Ok(tx) => tx,
        Err(e) => {
            lease.release("the transaction could not begin").await;
            return Err(OnceError::Store(e));
        }
    };
    let run =
        AssertUnwindSafe(async move { f(context, OnceTransaction { tx }).await }).catch_unwind();
    let Ok(ended) = tokio::time::timeout_at(lease.deadline(), run).await else {
        // Cancelled with its transaction, which rolls back: nothing of it happened.
        lease.timed_out();
        tracing::warn!("the closure was still running at the maximum hold; rolled back");
        lease.release("the closure ran past the maximum hold").await;
        return Err(OnceError::TimedOut);
    };
    let (value, tx) = match ended {
        Ok(Ok((value, OnceTransaction { tx }))) => (value, tx),
        Ok(Err(e)) => {
            lease.release("the closure returned an error").await;
            return Err(OnceError::Failed(e));
        }
        Err(_panic) => {
            lease.release("the closure panicked").await;
            return Err(OnceError::Panicked);
        }
    };
    // A `Serialize` that panics is an output that does not serialize: nothing is committed.
    let serialized = std::panic::catch_unwind(AssertUnwindSafe(|| serde_json::to_vec(&value)))
        .unwrap_or_else(|_| {
            Err(<serde_json::Error as serde::ser::Error>::custom(
                "the output's Serialize panicked",
            ))
        });
    let body = match serialized {
        Ok(body) => body,
        Err(e) => {
            // Nothing is committed: the effects roll back with the transaction, so the record is
            // released rather than settled as failed.
            rollback(&pg, tx).await;
            lease.release("the output did not serialize").await;
            return Err(OnceError::Encode(e));
        }
    };
    let stored = Arc::new(recorded(OUTPUT, body));
    match commit_with_record(config, lease, &pg, tx, &stored).await {
        InTransaction::Committed => Ok(value),
        // The retaker's output is the one that counts.
        InTransaction::Lost => Err(OnceError::InProgress),
        InTransaction::NotPrepared(lease, e) => {
            lease.release("the record could not be prepared").await;
            Err(OnceError::Store(e))
        }
        InTransaction::NotWritten(lease, e) => {
            lease.release("the output could not be recorded").await;
            Err(OnceError::Store(e.error))
        }
        // Not committed (released), or not known (released in the background if it did not land):
        // either way the caller is told the store failed; a later call gets the output if it
        // landed, or runs again.
        InTransaction::CommitFailed(e) | InTransaction::Unknown(e) => Err(OnceError::Store(e)),
    }
}
