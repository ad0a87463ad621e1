//! The work's effects and the record of its answer committed together, on a
//! [`TransactionalStore`]: the completion is written in the transaction that holds the effects,
//! fenced by the lease, then committed. Shared by the layer's transactional recording and
//! `RunOnce::run_in_transaction`.

use std::sync::Arc;

use super::lease::{Lease, Settled};
use crate::store::{
    FailedCommit, Fenced, RecordedStep, StoreError, StoredResponse, TransactionalStore,
};
use crate::util::metrics::timed;

/// What writing a record in the transaction of its effects, and committing, came to.
pub(crate) enum InTransaction<St: TransactionalStore> {
    /// Committed with the record; the lease is settled as recorded.
    Committed,
    /// The lease was lost before the commit (the record was retaken): rolled back, settled.
    Lost,
    /// The completion failed in the transaction: rolled back; the lease is the caller's to
    /// settle.
    NotWritten(Lease<St>, StoreError),
    /// The commit failed and did not land: the record was released, settled.
    CommitFailed(StoreError),
    /// The commit failed and whether it landed is unknown: released by its token in the
    /// background if it did not, settled.
    Unknown(StoreError),
}

/// Writes `stored` as the record of `lease` in `tx`, with the steps the work took in it, fenced by
/// the lease, and commits: the effects in `tx` and their record commit together or not at all.
pub(crate) async fn commit_with_record<St: TransactionalStore>(
    lease: Lease<St>,
    mut tx: St::Transaction,
    stored: Arc<StoredResponse>,
    steps: &[RecordedStep],
) -> InTransaction<St> {
    let engine = lease.engine().clone();
    let store = engine.store();
    let retention = engine.settings().retention;
    let completed = timed(
        "complete",
        store.complete_in(
            &mut tx,
            lease.key(),
            lease.token(),
            lease.fingerprint(),
            stored.clone(),
            retention,
            steps,
        ),
    )
    .await;
    match completed {
        Ok(Fenced::Done) => {}
        Ok(Fenced::LeaseLost) => {
            rollback(store, tx).await;
            lease.settled_outside(Settled::Lost);
            tracing::warn!(
                "the lease was lost before the commit (the record was retaken): the transaction \
                 was rolled back"
            );
            return InTransaction::Lost;
        }
        Err(e) => {
            rollback(store, tx).await;
            return InTransaction::NotWritten(lease, e);
        }
    }
    if let Err(e) = store.commit(tx).await {
        tracing::error!(error = %e, "the commit of the transaction failed");
        // Did it land? Releasing waits for the transaction's row lock, so it deletes the record
        // only if the commit did not happen; if the record is finished by this lease instead, the
        // commit landed and its answer was lost on the way.
        let settled = timed(
            "release",
            store.settle_failed_commit(lease.key(), lease.token()),
        );
        match settled.await {
            Ok(FailedCommit::Released) => {
                lease.settled_outside(Settled::Released);
                return InTransaction::CommitFailed(e);
            }
            Ok(FailedCommit::Landed) => {}
            Err(unknown) => {
                tracing::error!(error = %unknown, "whether the transaction committed is unknown");
                lease.settled_outside(Settled::Unknown);
                return InTransaction::Unknown(unknown);
            }
        }
    }
    let steps: usize = steps.iter().map(|s| s.name.len() + s.result.len()).sum();
    engine.recorded(&lease.key().subject, stored.body.len() + steps);
    let key = engine.keeps_tombstones().then(|| lease.key().clone());
    lease.settled_outside(Settled::Recorded {
        status: stored.status,
    });
    if let Some(key) = key {
        engine.entomb(&key).await;
    }
    InTransaction::Committed
}

/// Rolls back a transaction, or leaves it to be rolled back when its connection closes.
pub(crate) async fn rollback<St: TransactionalStore>(store: &St, tx: St::Transaction) {
    if let Err(e) = store.rollback(tx).await {
        tracing::warn!(error = %e, "rollback failed; the connection is dropped instead");
    }
}
