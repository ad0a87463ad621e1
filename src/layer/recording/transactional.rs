//! Recording in the handler's transaction: the completion is written in the transaction that holds
//! the handler's effects, and committed with them; only then does the client see the answer.

use std::sync::Arc;

use axum::body::Body;
use axum::response::Response;

use super::super::problem::ErrorKind;
use super::super::replay;
use super::super::settings::LayerSettings;
use super::{body_of, head_of, read_up_to, sorted, taken_over, unrecorded};
use crate::engine::{InTransaction, Lease, Outcome, commit_with_record, rollback};
use crate::store::{Finished, RecordedStep, StoredResponse, TransactionalStore};

/// Records a response whose handler wrote its effects through `tx`: reads the body up to the
/// recording limit (heartbeat running), writes the completion in `tx`, commits, and only then
/// returns the response. See `IdempotencyTx` for what each failure answers.
pub(crate) async fn record_in<St: TransactionalStore>(
    http: &LayerSettings,
    lease: Lease<St>,
    tx: St::Transaction,
    response: Response<Body>,
    steps: &[RecordedStep],
) -> Response<Body> {
    let engine = lease.engine().clone();
    // Outcomes reported after the lease is settled carry its endpoint label.
    let label = lease.label().clone();
    let (outcome, response) = sorted(http, response);
    let Some(outcome) = outcome else {
        rollback(engine.store(), tx).await;
        lease.release("the response asks for a retry").await;
        return response;
    };
    let (mut parts, body) = response.into_parts();
    let head = head_of(http, outcome, &parts);
    let settings = engine.settings();
    if http.expiry_header {
        replay::mark_expiry(&mut parts.headers, settings.retention);
    }
    // The body must be read (and the commit made) while the claim may still be held.
    let deadline = lease.deadline();
    let read = read_up_to(body, http.response_limit, deadline).await;
    let stored = Arc::new(StoredResponse {
        body_omitted: read.copy.is_none(),
        body: read.copy.clone().unwrap_or_default(),
        ..head
    });
    match commit_with_record(lease, tx, stored.clone(), steps).await {
        InTransaction::Committed => Response::from_parts(parts, body_of(read)),
        InTransaction::Lost => taken_over(http),
        InTransaction::NotWritten(lease, e)
            if e.is_aborted_transaction() && outcome == Finished::Failed =>
        {
            // The handler's own statement failed and it answered with a definitive failure:
            // nothing of its effect can commit, and its answer is recorded on its own.
            match unrecorded(http, lease.complete(stored).await) {
                Some(instead) => instead,
                None => Response::from_parts(parts, body_of(read)),
            }
        }
        InTransaction::NotWritten(lease, e) if e.is_aborted_transaction() => {
            // A success whose effect cannot commit (one of its statements failed) must not be
            // recorded nor shown: it did not happen.
            tracing::error!(
                "the handler answered a success, but a statement of its transaction had failed: \
                 nothing was committed"
            );
            lease.release("the handler's transaction had failed").await;
            http.problem(
                ErrorKind::InternalError,
                "the request failed; it was not recorded and may be retried",
                None,
            )
        }
        InTransaction::NotWritten(lease, e) => {
            tracing::error!(error = %e, "the record could not be written in the transaction");
            lease
                .release("the transaction could not be completed")
                .await;
            unavailable(http)
        }
        InTransaction::CommitFailed(_) => unavailable(http),
        InTransaction::Unknown(_) => {
            engine.report(&label, Outcome::StoreUnavailable);
            http.retryable(
                ErrorKind::StoreUnavailable,
                "whether the operation happened is not known yet; retry with the same \
                 Idempotency-Key for its answer",
            )
        }
    }
}

/// The answer after the record was released (already reported as such): one outcome per step, so
/// `StoreUnavailable` is not counted again for a request whose handler ran.
fn unavailable(http: &LayerSettings) -> Response<Body> {
    http.retryable(
        ErrorKind::StoreUnavailable,
        "the operation could not be recorded and did not happen; retry later",
    )
}
