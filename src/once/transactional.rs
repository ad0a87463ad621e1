//! [`RunOnce::run_in_transaction`]: the closure writes its effects in a transaction of the store's
//! database that the record of its output is completed in, and committed with, as a handler's
//! effects are with `IdempotencyTx`: both happen or neither.
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
use std::ops::{Deref, DerefMut};
use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use futures_util::FutureExt;
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::{OUTPUT, OnceError, RunOnce, recorded, serialized};
use crate::engine::{IdempotencyContext, InTransaction, Lease, commit_with_record, rollback};
use crate::store::{Fingerprint, RecordKey, TransactionalStore};

/// The transaction a [`RunOnce::run_in_transaction`] closure writes its effects in (it derefs to
/// the transaction's connection: `query.execute(&mut *tx)`), and gives back with its output. It has
/// no `commit` or `rollback`: the record of the output is written in it and committed with the
/// effects. (Do not send `COMMIT` through it either: effects committed apart from their record
/// would run again.)
pub struct OnceTransaction<T> {
    tx: T,
}

impl<T> std::fmt::Debug for OnceTransaction<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OnceTransaction").finish_non_exhaustive()
    }
}

impl<T: Deref> Deref for OnceTransaction<T> {
    type Target = T::Target;

    fn deref(&self) -> &T::Target {
        &self.tx
    }
}

impl<T: DerefMut> DerefMut for OnceTransaction<T> {
    fn deref_mut(&mut self) -> &mut T::Target {
        &mut self.tx
    }
}

impl<St: TransactionalStore> RunOnce<St> {
    /// [`run`](Self::run), with the closure's effects and the record of its output committed in
    /// one transaction of the store's database: the closure gets the transaction and returns it
    /// with its output, `Ok((output, tx))`; it must not commit it. Both happen or neither:
    ///
    /// - the closure's `Err`, a panic, or the maximum hold drop the transaction (rolled back) and
    ///   release the record, so a later call runs again;
    /// - the completion is written in the transaction, fenced by the lease: a lease lost meanwhile
    ///   (the record was retaken) matches nothing, the transaction is rolled back, and the call
    ///   answers [`OnceError::InProgress`];
    /// - a commit that fails releases the record if the commit did not land, and answers the
    ///   output if it did.
    ///
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
        F: FnOnce(IdempotencyContext, OnceTransaction<St::Transaction>) -> Fut + Send + 'static,
        Fut: Future<Output = Result<(T, OnceTransaction<St::Transaction>), E>> + Send + 'static,
    {
        self.on_its_own_task(scope, fingerprint, |lease, ctx| {
            Box::pin(async move { held_in_transaction(lease, ctx, f).await })
        })
        .await
    }
}

/// Runs the closure in a transaction under its lease, then completes the record in that
/// transaction and commits; or rolls back and releases.
async fn held_in_transaction<St, T, E, F, Fut>(
    lease: Lease<St>,
    context: IdempotencyContext,
    f: F,
) -> Result<T, OnceError<E>>
where
    St: TransactionalStore,
    T: Serialize,
    F: FnOnce(IdempotencyContext, OnceTransaction<St::Transaction>) -> Fut,
    Fut: Future<Output = Result<(T, OnceTransaction<St::Transaction>), E>>,
{
    let store = lease.engine().store().clone();
    // Idle for at most what is left of the maximum hold: a live closure is never cut for being
    // slow between its statements.
    let idle = lease
        .deadline()
        .saturating_duration_since(tokio::time::Instant::now());
    let tx = match store.begin(idle).await {
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
    let body = match serialized(&value) {
        Ok(body) => body,
        Err(e) => {
            // Nothing is committed: the effects roll back with the transaction, so the record is
            // released rather than settled as failed.
            rollback(&store, tx).await;
            lease.release("the output did not serialize").await;
            return Err(OnceError::Encode(e));
        }
    };
    match commit_with_record(lease, tx, Arc::new(recorded(OUTPUT, body))).await {
        InTransaction::Committed => Ok(value),
        // The retaker's output is the one that counts.
        InTransaction::Lost => Err(OnceError::InProgress),
        InTransaction::NotWritten(lease, e) => {
            lease.release("the output could not be recorded").await;
            Err(OnceError::Store(e))
        }
        // Not committed (released), or not known (released in the background if it did not land):
        // either way the caller is told the store failed; a later call gets the output if it
        // landed, or runs again.
        InTransaction::CommitFailed(e) | InTransaction::Unknown(e) => Err(OnceError::Store(e)),
    }
}
