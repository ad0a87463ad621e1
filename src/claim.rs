//! The claim flow of one guarded request: key, subject, body, fingerprint, claim, then replay, refuse,
//! or run the handler and record what it answered.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use axum::body::Body;
use futures_util::FutureExt;
use http::{Request, Response};
use sha2::{Digest, Sha256};
use tower::{BoxError, Service, ServiceExt};
use tracing::Instrument;

use crate::body::{self, RequestBodyError, ResponseBody};
use crate::config::Config;
use crate::fingerprint::Fingerprint;
use crate::key;
use crate::policy::Disposition;
use crate::problem::{ErrorKind, problem};
use crate::record::{ClaimOutcome, ClaimRequest, Finished, LeaseToken, RecordKey};
use crate::replay;
use crate::store::IdempotencyStore;

/// Runs one request through the layer. `inner` is a ready clone of the wrapped service.
pub(crate) async fn guard<S, St, ResBody>(
    config: Arc<Config>,
    store: St,
    inner: S,
    request: Request<Body>,
) -> Result<Response<Body>, S::Error>
where
    S: Service<Request<Body>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    St: IdempotencyStore,
    ResBody: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let (parts, body) = request.into_parts();
    let key = match key::from_headers(&parts.headers) {
        Ok(Some(key)) => key,
        Ok(None) if config.require_key => {
            return Ok(problem(
                ErrorKind::MissingIdempotencyKey,
                "this endpoint requires an Idempotency-Key header",
                None,
            ));
        }
        Ok(None) => return pass_through(inner, Request::from_parts(parts, body)).await,
        Err(e) => return Ok(problem(ErrorKind::InvalidIdempotencyKey, e.detail(), None)),
    };
    let subject = match config.subject.subject(&parts).filter(|s| !s.is_empty()) {
        Some(subject) => subject,
        None if config.allow_anonymous => String::new(),
        None => {
            return Ok(problem(
                ErrorKind::MissingSubject,
                "an idempotent request must come from an authenticated subject",
                None,
            ));
        }
    };
    let endpoint = (config.endpoint)(&parts);
    let span = tracing::info_span!(
        "idempotency",
        key_hash = %key_hash(&key),
        subject = %subject,
        endpoint = %endpoint,
        outcome = tracing::field::Empty,
    );
    async move {
        let bytes = match body::read_request(&parts.headers, body, config.body_limit).await {
            Ok(bytes) => bytes,
            Err(RequestBodyError::TooLarge) => {
                tracing::Span::current().record("outcome", "request_too_large");
                let detail = format!(
                    "the request body is over the limit of {} bytes",
                    config.body_limit
                );
                return Ok(problem(ErrorKind::RequestTooLarge, &detail, None));
            }
            Err(RequestBodyError::Unreadable(reason)) => {
                tracing::Span::current().record("outcome", "unreadable_body");
                let detail = format!("the request body could not be read: {reason}");
                return Ok(problem(ErrorKind::UnreadableBody, &detail, None));
            }
        };
        let claim = ClaimRequest {
            key: RecordKey {
                key,
                subject,
                endpoint,
            },
            fingerprint: Fingerprint::of(parts.uri.query(), &bytes),
            in_progress_ttl: config.in_progress_ttl,
            retention: config.retention,
        };
        let request = Request::from_parts(parts, Body::from(bytes));
        let outcome = store.claim(&claim).await;
        let span = tracing::Span::current();
        let retry_after = config.retry_after_secs;
        match outcome {
            Ok(ClaimOutcome::Claimed { lease, retaken }) => {
                span.record("outcome", if retaken { "retaken" } else { "claimed" });
                tracing::info!(retaken, "claimed; running the handler");
                run(config, store, inner, request, claim.key, lease).await
            }
            Ok(ClaimOutcome::FingerprintMismatch) => {
                span.record("outcome", "key_reuse");
                tracing::info!("key reused for a different request");
                Ok(problem(
                    ErrorKind::IdempotencyKeyReuse,
                    "this Idempotency-Key was used for a request with a different body or query",
                    None,
                ))
            }
            Ok(ClaimOutcome::InProgress) => {
                span.record("outcome", "in_progress");
                tracing::info!("duplicate while in progress");
                Ok(problem(
                    ErrorKind::InProgress,
                    "a request with this Idempotency-Key is still being processed; retry later",
                    Some(retry_after),
                ))
            }
            Ok(ClaimOutcome::Finished(stored)) => {
                span.record("outcome", "replayed");
                tracing::info!(status = stored.status, "replayed");
                Ok(replay::replay(&stored))
            }
            Err(e) if config.fail_open => {
                span.record("outcome", "store_error_fail_open");
                tracing::warn!(error = %e, "idempotency store failed; running unguarded");
                pass_through(inner, request).await
            }
            Err(e) => {
                span.record("outcome", "store_unavailable");
                tracing::error!(error = %e, "idempotency store failed; refusing the request");
                Ok(problem(
                    ErrorKind::StoreUnavailable,
                    "the idempotency store is unavailable; retry later",
                    Some(retry_after),
                ))
            }
        }
    }
    .instrument(span)
    .await
}

async fn pass_through<S, ResBody>(
    inner: S,
    request: Request<Body>,
) -> Result<Response<Body>, S::Error>
where
    S: Service<Request<Body>, Response = Response<ResBody>>,
    ResBody: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    Ok(inner.oneshot(request).await?.map(Body::new))
}

/// Runs the handler for a claimed record on a task of its own, so that a client that goes away does
/// not cancel the effect halfway, and records (or releases) what it answered.
async fn run<S, St, ResBody>(
    config: Arc<Config>,
    store: St,
    inner: S,
    request: Request<Body>,
    key: RecordKey,
    lease: LeaseToken,
) -> Result<Response<Body>, S::Error>
where
    S: Service<Request<Body>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    St: IdempotencyStore,
    ResBody: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let task = tokio::spawn(
        async move {
            let claim = Claim::new(store, key, lease);
            match AssertUnwindSafe(inner.oneshot(request))
                .catch_unwind()
                .await
            {
                Ok(Ok(response)) => Ok(record(&config, claim, response.map(Body::new)).await),
                Ok(Err(e)) => {
                    claim.release("the handler returned an error").await;
                    Err(e)
                }
                Err(_panic) => {
                    claim.release("the handler panicked").await;
                    Ok(internal_error())
                }
            }
        }
        .in_current_span(),
    );
    task.await.unwrap_or_else(|e| {
        // The task was cancelled (runtime shutting down); the claim's drop guard released the record.
        tracing::error!(error = %e, "the handler task did not finish");
        Ok(internal_error())
    })
}

fn internal_error() -> Response<Body> {
    problem(
        ErrorKind::InternalError,
        "the request failed; it was not recorded and may be retried",
        None,
    )
}

/// Sorts the handler's response by the policy and records it, or releases the record.
async fn record<St: IdempotencyStore>(
    config: &Config,
    claim: Claim<St>,
    response: Response<Body>,
) -> Response<Body> {
    let span = tracing::Span::current();
    let outcome = match (config.policy)(response.status()) {
        Disposition::Complete => Finished::Completed,
        Disposition::Fail => Finished::Failed,
        Disposition::Release => {
            span.record("outcome", "released");
            claim.release("the response asks for a retry").await;
            return response;
        }
    };
    let (parts, body) = response.into_parts();
    let bytes = match body::read_response(body, config.response_limit).await {
        ResponseBody::Whole(bytes) => bytes,
        ResponseBody::Passed(body) => {
            span.record("outcome", "released");
            claim
                .release("the response body is too large to record, has trailers, or failed")
                .await;
            return Response::from_parts(parts, body);
        }
    };
    let stored = replay::capture(
        outcome,
        parts.status,
        &parts.headers,
        &config.stored_headers,
        bytes.clone(),
    );
    claim.complete(stored, config.retention).await;
    Response::from_parts(parts, Body::from(bytes))
}

/// A held claim: completed or released exactly once, and released on drop if neither happened (the
/// task was cancelled), so a record is never left `in_progress` by this process on purpose.
struct Claim<St: IdempotencyStore> {
    store: St,
    key: RecordKey,
    lease: LeaseToken,
    done: bool,
}

impl<St: IdempotencyStore> Claim<St> {
    fn new(store: St, key: RecordKey, lease: LeaseToken) -> Self {
        Claim {
            store,
            key,
            lease,
            done: false,
        }
    }

    async fn complete(
        mut self,
        stored: crate::record::StoredResponse,
        retention: std::time::Duration,
    ) {
        self.done = true;
        let status = stored.status;
        match self
            .store
            .complete(&self.key, self.lease, stored, retention)
            .await
        {
            Ok(true) => tracing::info!(status, "recorded"),
            Ok(false) => tracing::warn!(
                "the lease was lost (the record was retaken after the in-progress TTL); \
                 this late result was not recorded"
            ),
            Err(e) => {
                tracing::error!(error = %e, "the response could not be recorded; releasing");
                self.release_now().await;
            }
        }
    }

    async fn release(mut self, why: &str) {
        self.done = true;
        tracing::info!(reason = why, "releasing the record");
        self.release_now().await;
    }

    async fn release_now(&self) {
        match self.store.release(&self.key, self.lease).await {
            Ok(true) => {}
            Ok(false) => tracing::warn!("the lease was lost before the release; nothing changed"),
            Err(e) => tracing::error!(
                error = %e,
                "the record could not be released; it can be retaken after the in-progress TTL"
            ),
        }
    }
}

impl<St: IdempotencyStore> Drop for Claim<St> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let store = self.store.clone();
            let key = self.key.clone();
            let lease = self.lease;
            runtime.spawn(async move {
                let _ = store.release(&key, lease).await;
            });
        }
    }
}

/// The first 8 bytes of the key's SHA-256, for logs that should not carry raw keys.
fn key_hash(key: &str) -> String {
    Sha256::digest(key.as_bytes())[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}
