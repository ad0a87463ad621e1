//! Recording in the handler's transaction: the completion is written in the transaction that holds
//! the handler's effects, and committed with them (see [`IdempotencyTx`](crate::IdempotencyTx)).

use std::sync::Arc;

use axum::body::Body;
use axum::response::Response;
use sqlx::{Postgres, Transaction};

use crate::config::Config;
use crate::lease::{Lease, Settled};
use crate::metrics;
use crate::outcome::Outcome;
use crate::problem::ErrorKind;
use crate::record::{Finished, StoredResponse};
use crate::recording;
use crate::report::report;
use crate::store::{CompleteInError, IdempotencyStore, PostgresStore, StoreError};

/// Records a response whose handler wrote its effects through `tx`: reads the body up to the
/// recording limit (heartbeat running), writes the completion in `tx`, commits, and only then
/// returns the response. See [`IdempotencyTx`] for what each failure answers.
pub(crate) async fn record_in<St: IdempotencyStore>(
    config: &Arc<Config>,
    lease: Lease<St>,
    store: &PostgresStore,
    tx: Transaction<'static, Postgres>,
    response: Response<Body>,
) -> Response<Body> {
    // Outcomes reported after the lease is settled carry its endpoint label.
    let label = lease.label().clone();
    let Some(outcome) = recording::recorded_as(config, &response) else {
        rollback(store, tx).await;
        lease.release("the response asks for a retry").await;
        return response;
    };
    let (mut parts, body) = response.into_parts();
    let head = recording::head_of(config, outcome, &parts);
    if config.expiry_header {
        crate::replay::mark_expiry(&mut parts.headers, config.retention);
    }
    // Half a TTL at most: the transaction may stay idle for one TTL (the server ends it after
    // that), and the completion and commit must come before.
    let deadline = lease
        .deadline()
        .min(tokio::time::Instant::now() + config.in_progress_ttl / 2);
    let read = recording::read_up_to(body, config.response_limit, deadline).await;
    let stored = Arc::new(StoredResponse {
        body_omitted: read.copy.is_none(),
        body: read.copy.clone().unwrap_or_default(),
        ..head
    });
    match commit_with_record(config, lease, store, tx, &stored).await {
        InTransaction::Committed => Response::from_parts(parts, recording::body_of(read)),
        InTransaction::Lost => config.problem(
            ErrorKind::InProgress,
            "this request was taken over by another attempt; retry later for its answer",
            Some(config.retry_after_secs),
        ),
        InTransaction::NotWritten(lease, e)
            if e.aborted_transaction && outcome == Finished::Failed =>
        {
            // The handler's own statement failed and it answered with a definitive failure:
            // nothing of its effect can commit, and its answer is recorded on its own.
            lease.complete(stored).await;
            Response::from_parts(parts, recording::body_of(read))
        }
        InTransaction::NotWritten(lease, e) if e.aborted_transaction => {
            // A success whose effect cannot commit (one of its statements failed) must not be
            // recorded nor shown: it did not happen.
            tracing::error!(
                "the handler answered a success, but a statement of its transaction had failed: \
                 nothing was committed"
            );
            lease.release("the handler's transaction had failed").await;
            config.problem(
                ErrorKind::InternalError,
                "the request failed; it was not recorded and may be retried",
                None,
            )
        }
        InTransaction::NotWritten(lease, e) => {
            tracing::error!(error = %e.error, "the record could not be written in the transaction");
            lease
                .release("the transaction could not be completed")
                .await;
            unavailable(config)
        }
        InTransaction::NotPrepared(lease, e) => {
            tracing::error!(error = %e, "the record could not be prepared for the transaction");
            lease.release("the record could not be prepared").await;
            unavailable(config)
        }
        InTransaction::CommitFailed(_) => unavailable(config),
        InTransaction::Unknown(_) => {
            report(config, &label, Outcome::StoreUnavailable);
            config.problem(
                ErrorKind::StoreUnavailable,
                "whether the operation happened is not known yet; retry with the same \
                 Idempotency-Key for its answer",
                Some(config.retry_after_secs),
            )
        }
    }
}

/// What writing a record in the transaction of its effects, and committing, came to.
pub(crate) enum InTransaction<St: IdempotencyStore> {
    /// Committed with the record; the lease is settled as recorded.
    Committed,
    /// The lease was lost before the commit (the record was retaken): rolled back, settled.
    Lost,
    /// The record could not be prepared (a wrapper's transform failed): rolled back; the lease
    /// is the caller's to release.
    NotPrepared(Lease<St>, StoreError),
    /// The completion failed in the transaction: rolled back; the lease is the caller's.
    NotWritten(Lease<St>, CompleteInError),
    /// The commit failed and did not land: the record was released, settled.
    CommitFailed(StoreError),
    /// The commit failed and whether it landed is unknown: released by its token in the
    /// background if it did not, settled.
    Unknown(StoreError),
}

/// Writes `stored` (as the store's wrappers transform it) as the record of `lease` in `tx`, fenced
/// by the lease, and commits: the effects in `tx` and their record commit together or not at all.
/// Shared by the layer's transactional recording and `RunOnce::run_in_transaction`.
pub(crate) async fn commit_with_record<St: IdempotencyStore>(
    config: &Config,
    lease: Lease<St>,
    store: &PostgresStore,
    mut tx: Transaction<'static, Postgres>,
    stored: &Arc<StoredResponse>,
) -> InTransaction<St> {
    // What the layer's store writes for this response (sealed, when it encrypts): the record
    // written in the transaction must be the one `complete` would write.
    let written = match lease.store().capabilities().transform(
        lease.key(),
        lease.fingerprint(),
        stored.clone(),
    ) {
        Ok(written) => written,
        Err(e) => {
            rollback(store, tx).await;
            return InTransaction::NotPrepared(lease, e);
        }
    };
    let completed = metrics::timed(
        "complete",
        store.complete_in(
            &mut tx,
            lease.key(),
            lease.token(),
            &written,
            config.retention,
        ),
    )
    .await;
    match completed {
        Ok(true) => {}
        Ok(false) => {
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
        let settled = metrics::timed(
            "release",
            store.settle_failed_commit(lease.key(), lease.token()),
        );
        match settled.await {
            Ok(false) => {
                lease.settled_outside(Settled::Released);
                return InTransaction::CommitFailed(e);
            }
            Ok(true) => {}
            Err(unknown) => {
                tracing::error!(error = %unknown, "whether the transaction committed is unknown");
                lease.settled_outside(Settled::Unknown);
                return InTransaction::Unknown(unknown);
            }
        }
    }
    lease.settled_outside(Settled::Recorded {
        status: stored.status,
    });
    InTransaction::Committed
}

/// Rolls back the handler's transaction, or leaves it to be rolled back when its connection closes.
pub(crate) async fn rollback(store: &PostgresStore, tx: Transaction<'static, Postgres>) {
    if let Err(e) = store.rollback(tx).await {
        tracing::warn!(error = %e, "rollback failed; the connection is dropped instead");
    }
}

/// The answer after the record was released (already reported as such): one outcome per step, so
/// `StoreUnavailable` is not counted again for a request whose handler ran.
fn unavailable(config: &Config) -> Response<Body> {
    config.problem(
        ErrorKind::StoreUnavailable,
        "the operation could not be recorded and did not happen; retry later",
        Some(config.retry_after_secs),
    )
}
