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
use std::sync::{Arc, Mutex};

use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::time::Instant;

use super::{OUTPUT, OnceError, RunOnce, record_output, recorded, serialized, timed_out};
use crate::engine::{IdempotencyContext, InTransaction, Lease, Ran, commit_with_record, rollback};
use crate::store::{Fingerprint, RecordKey, StoreError, TransactionalStore};
use crate::util::lock::lock;

/// The transaction a [`RunOnce::run_in_transaction`] closure writes its effects in, and gives
/// back with its output. It begins at its first use ([`conn`](Self::conn),
/// [`transaction`](Self::transaction)), not before: a closure that calls a slow provider before
/// its first statement holds no connection (and, on SQLite, not the file's write lock)
/// meanwhile. It has no `commit` or `rollback`: the record of the output is written in it and
/// committed with the effects. (Do not send `COMMIT` through it either: effects committed apart
/// from their record would run again.)
pub struct OnceTransaction<St: TransactionalStore> {
    store: St,
    /// The maximum hold: the transaction may stay idle until then.
    deadline: Instant,
    tx: Option<St::Transaction>,
    /// Where the transaction goes when this is dropped (the closure failed, panicked, or was
    /// cancelled at the maximum hold), to be rolled back before the record is released.
    left: Arc<Mutex<Option<St::Transaction>>>,
    /// The run's context, told when the transaction begins (its steps are then recorded in it).
    context: IdempotencyContext,
}

impl<St: TransactionalStore> std::fmt::Debug for OnceTransaction<St> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OnceTransaction")
            .field("begun", &self.tx.is_some())
            .finish_non_exhaustive()
    }
}

impl<St: TransactionalStore> OnceTransaction<St> {
    /// The transaction; the first call begins it (within the store's operation timeout). A
    /// failure to begin is the error, and a later call tries again.
    pub async fn transaction(&mut self) -> Result<&mut St::Transaction, StoreError> {
        let tx = match self.tx.take() {
            Some(tx) => tx,
            None => {
                // Idle for at most what is left of the maximum hold: a live closure is never cut
                // for being slow between its statements.
                let idle = self.deadline.saturating_duration_since(Instant::now());
                let tx = self.store.begin(idle).await?;
                // The run's steps from now on are recorded in it (see `IdempotencyContext::step`).
                self.context.transaction_begun();
                tx
            }
        };
        Ok(self.tx.insert(tx))
    }

    /// The transaction's connection, for queries: `query.execute(tx.conn().await?)`; the first
    /// call begins the transaction (see [`transaction`](Self::transaction)).
    pub async fn conn(
        &mut self,
    ) -> Result<&mut <St::Transaction as std::ops::Deref>::Target, StoreError>
    where
        St::Transaction: std::ops::DerefMut,
    {
        Ok(&mut **self.transaction().await?)
    }
}

impl<St: TransactionalStore> Drop for OnceTransaction<St> {
    fn drop(&mut self) {
        if let Some(tx) = self.tx.take() {
            *lock(&self.left) = Some(tx);
        }
    }
}

impl<St: TransactionalStore> RunOnce<St> {
    /// [`run`](Self::run), with the closure's effects and the record of its output committed in
    /// one transaction of the store's database: the closure gets the transaction (begun at its
    /// first use) and returns it with its output, `Ok((output, tx))`; it must not commit it. Both
    /// happen or neither:
    ///
    /// - the closure's `Err`, a panic, or the maximum hold roll the transaction back, then
    ///   release the record, so a later call runs again (never before the rollback: the later
    ///   call never meets the rows of a transaction still open);
    /// - the completion is written in the transaction, fenced by the lease: a lease lost meanwhile
    ///   (the record was retaken) matches nothing, the transaction is rolled back, and the call
    ///   answers [`OnceError::InProgress`];
    /// - a commit that fails releases the record if the commit did not land, and answers the
    ///   output if it did;
    /// - a closure that never used its transaction is recorded as [`run`](Self::run) records it:
    ///   its output, an output that does not serialize, and a cancellation at the maximum hold
    ///   (its effects happened outside the transaction, so it is never run again).
    ///
    /// [`OnceError::TimedOut`] here means the closure was cancelled at the maximum hold: when it
    /// had begun its transaction, that is rolled back, the record released and a later call runs
    /// again; when it had not, the scope is settled as timed out, as `run` settles it.
    pub async fn run_in_transaction<T, E, F, Fut>(
        &self,
        scope: RecordKey,
        fingerprint: Fingerprint,
        f: F,
    ) -> Result<T, OnceError<E>>
    where
        T: Serialize + DeserializeOwned + Send + 'static,
        E: Send + 'static,
        F: FnOnce(IdempotencyContext, OnceTransaction<St>) -> Fut + Send + 'static,
        Fut: Future<Output = Result<(T, OnceTransaction<St>), E>> + Send + 'static,
    {
        self.on_its_own_task(scope, fingerprint, |lease, ctx| {
            Box::pin(async move { held_in_transaction(lease, ctx, f).await })
        })
        .await
    }
}

/// Runs the closure with a transaction begun at its first use, under its lease; then completes
/// the record in that transaction and commits, or rolls back and releases.
async fn held_in_transaction<St, T, E, F, Fut>(
    lease: Lease<St>,
    context: IdempotencyContext,
    f: F,
) -> Result<T, OnceError<E>>
where
    St: TransactionalStore,
    T: Serialize,
    F: FnOnce(IdempotencyContext, OnceTransaction<St>) -> Fut,
    Fut: Future<Output = Result<(T, OnceTransaction<St>), E>>,
{
    let store = lease.engine().store().clone();
    let steps = context.clone();
    let left = Arc::new(Mutex::new(None));
    let tx = OnceTransaction {
        store: store.clone(),
        deadline: lease.deadline(),
        tx: None,
        left: left.clone(),
        context: context.clone(),
    };
    let ended = lease.run(async move { f(context, tx).await }).await;
    // What the closure wrote through and did not give back: rolled back before the record is
    // released, so a later call never runs beside it.
    let undo = || async {
        let written = lock(&left).take();
        if let Some(tx) = written {
            rollback(&store, tx).await;
        }
    };
    let (value, mut given) = match ended {
        Ran::Ended(Ok(done)) => done,
        Ran::TimedOut if lock(&left).is_none() => {
            // It never began its transaction: whatever it did happened outside, and may have
            // happened; settled as timed out, as `run` settles it, never run again.
            tracing::warn!(
                "the closure was still running at the maximum hold; cancelled, and recorded as a \
                 timeout"
            );
            return timed_out(lease).await;
        }
        Ran::TimedOut => {
            tracing::warn!("the closure was still running at the maximum hold; rolled back");
            undo().await;
            lease.release("the closure ran past the maximum hold").await;
            return Err(OnceError::TimedOut);
        }
        Ran::Ended(Err(e)) => {
            undo().await;
            lease.release("the closure returned an error").await;
            return Err(OnceError::Failed(e));
        }
        Ran::Panicked => {
            undo().await;
            lease.release("the closure panicked").await;
            return Err(OnceError::Panicked);
        }
    };
    let Some(tx) = given.tx.take() else {
        // Never begun: nothing to commit the record with; it is recorded as `run` records it.
        drop(given);
        undo().await;
        return record_without_transaction(lease, value).await;
    };
    drop(given);
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
    let steps = steps.take_transaction_steps();
    match commit_with_record(lease, tx, Arc::new(recorded(OUTPUT, body)), &steps).await {
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

/// The output of a closure that wrote nothing through its transaction, recorded by the lease.
async fn record_without_transaction<St, T, E>(lease: Lease<St>, value: T) -> Result<T, OnceError<E>>
where
    St: TransactionalStore,
    T: Serialize,
{
    // Its effects happened outside any transaction of the store: settled as `run` settles it,
    // an output that does not serialize included (never released, never run again).
    record_output(lease, value).await
}
