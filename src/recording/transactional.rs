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
use crate::store::{IdempotencyStore, PostgresStore};

/// Records a response whose handler wrote its effects through `tx`: reads the body up to the
/// recording limit (heartbeat running), writes the completion in `tx`, commits, and only then
/// returns the response. See [`IdempotencyTx`] for what each failure answers.
pub(crate) async fn record_in<St: IdempotencyStore>(
    config: &Arc<Config>,
    lease: Lease<St>,
    store: &PostgresStore,
    mut tx: Transaction<'static, Postgres>,
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
            tracing::error!(error = %e, "the record could not be prepared for the transaction");
            lease.release("the record could not be prepared").await;
            return unavailable(config);
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
                "the lease was lost before the commit (the record was retaken): the handler's \
                 transaction was rolled back"
            );
            return config.problem(
                ErrorKind::InProgress,
                "this request was taken over by another attempt; retry later for its answer",
                Some(config.retry_after_secs),
            );
        }
        Err(e) if e.aborted_transaction && outcome == Finished::Failed => {
            // The handler's own statement failed and it answered with a definitive failure: nothing
            // of its effect can commit, and its answer is recorded on its own.
            rollback(store, tx).await;
            lease.complete(stored).await;
            return Response::from_parts(parts, recording::body_of(read));
        }
        Err(e) if e.aborted_transaction => {
            // A success whose effect cannot commit (one of its statements failed) must not be
            // recorded nor shown: it did not happen.
            rollback(store, tx).await;
            tracing::error!(
                "the handler answered a success, but a statement of its transaction had failed: \
                 nothing was committed"
            );
            lease.release("the handler's transaction had failed").await;
            return config.problem(
                ErrorKind::InternalError,
                "the request failed; it was not recorded and may be retried",
                None,
            );
        }
        Err(e) => {
            rollback(store, tx).await;
            tracing::error!(error = %e.error, "the record could not be written in the transaction");
            lease
                .release("the transaction could not be completed")
                .await;
            return unavailable(config);
        }
    }
    if let Err(e) = store.commit(tx).await {
        tracing::error!(error = %e, "the commit of the handler's transaction failed");
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
                return unavailable(config);
            }
            Ok(true) => {}
            Err(e) => {
                tracing::error!(error = %e, "whether the transaction committed is unknown");
                lease.settled_outside(Settled::Unknown);
                report(config, &label, Outcome::StoreUnavailable);
                return config.problem(
                    ErrorKind::StoreUnavailable,
                    "whether the operation happened is not known yet; retry with the same \
                     Idempotency-Key for its answer",
                    Some(config.retry_after_secs),
                );
            }
        }
    }
    lease.settled_outside(Settled::Recorded {
        status: stored.status,
    });
    Response::from_parts(parts, recording::body_of(read))
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
