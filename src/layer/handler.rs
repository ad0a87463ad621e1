//! The handler run under its lease: its context in the request, the handler's transaction offered
//! where the layer has them, the handler bounded by the maximum hold, and its answer recorded (or
//! the record released).

use std::sync::Arc;

use axum::body::Body;
use futures_util::future::BoxFuture;
use http::{Request, Response};
use tower::{BoxError, Service, ServiceExt};

use super::problem::ErrorKind;
use super::recording;
use super::replay;
use super::settings::LayerSettings;
use crate::engine::{IdempotencyContext, Lease, Ran};
use crate::header::IDEMPOTENCY_REPLAY;
use crate::store::IdempotencyStore;

/// How the layer offers handlers a transaction that their effects and the record of their answer
/// commit in (see `IdempotencyLayerBuilder::transactions`).
pub(crate) trait Transactions<St: IdempotencyStore>: Send + Sync {
    /// Puts the handler's end of a transaction into `request`; gives the layer's end.
    fn offer(
        &self,
        lease: &Lease<St>,
        http: &LayerSettings,
        request: &mut Request<Body>,
    ) -> Box<dyn Offered<St>>;
}

/// The layer's end of an offered transaction.
pub(crate) trait Offered<St: IdempotencyStore>: Send {
    /// What the handler left, once it answered (or was cancelled).
    fn take_back(self: Box<Self>) -> Left<St>;
}

/// What a handler left of the transaction it was offered (only stores with transactions offer
/// one).
#[cfg_attr(not(sql), allow(dead_code))]
pub(crate) enum Left<St: IdempotencyStore> {
    /// It wrote nothing through one: record as usual.
    Nothing,
    /// It kept the transaction beyond its answer (moved it into a task): it cannot be committed
    /// with the record.
    Kept,
    /// It wrote through this one, uncommitted.
    Written(Box<dyn Written<St>>),
}

/// A transaction a handler wrote its effects through, to commit with its record or roll back.
pub(crate) trait Written<St: IdempotencyStore>: Send {
    /// Rolls it back.
    fn rollback(self: Box<Self>) -> BoxFuture<'static, ()>;

    /// Records `response` in it and commits, then answers with what the client gets.
    fn record(
        self: Box<Self>,
        http: Arc<LayerSettings>,
        lease: Lease<St>,
        response: Response<Body>,
    ) -> BoxFuture<'static, Response<Body>>;
}

/// Runs the handler for a held claim, renewing the lease while it runs, and records (or releases)
/// what it answered. The request future this runs in is detached onto a task of its own if the
/// client goes away (see [`ResponseFuture`](super::ResponseFuture)), so a disconnect cancels
/// neither the effect nor its recording.
pub(super) async fn run<S, St, ResBody>(
    http: &Arc<LayerSettings>,
    transactions: Option<&dyn Transactions<St>>,
    inner: S,
    mut request: Request<Body>,
    lease: Lease<St>,
    context: IdempotencyContext,
) -> Result<Response<Body>, S::Error>
where
    S: Service<Request<Body>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    St: IdempotencyStore,
    ResBody: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    request.extensions_mut().insert(context);
    let offered = transactions.map(|t| t.offer(&lease, http, &mut request));
    // The handler runs until it answers or the maximum hold; the heartbeat runs on a task of its
    // own meanwhile.
    let answer = lease.run(inner.oneshot(request)).await;
    // A transaction the handler wrote through is rolled back on every path but a recorded answer.
    let left = offered.map_or(Left::Nothing, |offered| offered.take_back());
    match answer {
        Ran::TimedOut => {
            // Cancelled at the maximum hold. A transaction it wrote through was never committed:
            // it is rolled back, then the key released. Otherwise (or when the handler moved its
            // transaction into a task that may still commit it) its effect may have happened: the
            // timeout is recorded as the key's definitive answer.
            if let Left::Written(tx) = left {
                tracing::warn!("the handler was still running at the maximum hold; rolled back");
                tx.rollback().await;
                lease.release("the handler ran past the maximum hold").await;
                return Ok(http.retryable(
                    ErrorKind::HandlerTimeout,
                    "the operation did not finish in time and was rolled back; retry later",
                ));
            }
            tracing::warn!(
                "the handler was still running at the maximum hold; cancelled, and recorded as a \
                 timeout"
            );
            let timeout = Arc::new(recording::handler_timeout(http));
            let mut response = replay::fresh(&timeout);
            if http.expiry_header {
                replay::mark_expiry(response.headers_mut(), lease.engine().settings().retention);
            }
            let completed = lease.complete(timeout).await;
            Ok(recording::unrecorded(http, completed).unwrap_or(response))
        }
        Ran::Ended(Ok(response)) => {
            let mut response = response.map(Body::new);
            // A fresh answer never says it is a replay: a client told so would take a new charge
            // for an old one. The default marker goes too when another one is set.
            let headers = response.headers_mut();
            headers.remove(&http.replay_header);
            if http.replay_header != crate::header::IDEMPOTENT_REPLAYED {
                headers.remove(&crate::header::IDEMPOTENT_REPLAYED);
            }
            headers.remove(&IDEMPOTENCY_REPLAY);
            match left {
                // Boxed inside: its commit's futures are the largest part of this state machine,
                // and only requests that took a transaction need them.
                Left::Written(tx) => Ok(tx.record(http.clone(), lease, response).await),
                Left::Kept => {
                    tracing::error!(
                        "the handler kept its IdempotencyTx beyond its answer; it cannot be \
                         committed with the record, so the record is released"
                    );
                    lease.release("the handler kept its transaction").await;
                    Ok(internal_error(http))
                }
                Left::Nothing => {
                    #[cfg(feature = "grpc")]
                    if let Some(grpc) = &http.grpc {
                        return Ok(Box::pin(super::grpc::record(http, grpc, lease, response)).await);
                    }
                    Ok(recording::record(http, lease, response).await)
                }
            }
        }
        Ran::Ended(Err(e)) => {
            if let Left::Written(tx) = left {
                tx.rollback().await;
            }
            lease.release("the handler returned an error").await;
            Err(e)
        }
        Ran::Panicked => {
            if let Left::Written(tx) = left {
                tx.rollback().await;
            }
            lease.release("the handler panicked").await;
            Ok(internal_error(http))
        }
    }
}

/// The answer to a request whose handler failed without an answer to record.
pub(super) fn internal_error(http: &LayerSettings) -> Response<Body> {
    http.problem(
        ErrorKind::InternalError,
        "the request failed; it was not recorded and may be retried",
        None,
    )
}
