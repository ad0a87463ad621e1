//! The claim flow of one guarded request: key, subject, body, fingerprint, claim, then replay, refuse,
//! or run the handler and record what it answered.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, Instant};

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
use crate::outcome::Outcome;
use crate::policy::Disposition;
use crate::problem::{ErrorKind, problem};
use crate::record::{ClaimOutcome, ClaimRequest, Finished, LeaseToken, RecordKey, StoredResponse};
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
            report(&config, Outcome::Rejected);
            return Ok(problem(
                ErrorKind::MissingIdempotencyKey,
                "this endpoint requires an Idempotency-Key header",
                None,
            ));
        }
        Ok(None) => return pass_through(inner, Request::from_parts(parts, body)).await,
        Err(e) => {
            report(&config, Outcome::Rejected);
            return Ok(problem(ErrorKind::InvalidIdempotencyKey, e.detail(), None));
        }
    };
    let subject = match config.subject.subject(&parts).filter(|s| !s.is_empty()) {
        Some(subject) => subject,
        None if config.allow_anonymous => String::new(),
        None => {
            report(&config, Outcome::Rejected);
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
                report(&config, Outcome::Rejected);
                let detail = format!(
                    "the request body is over the limit of {} bytes",
                    config.body_limit
                );
                return Ok(problem(ErrorKind::RequestTooLarge, &detail, None));
            }
            Err(RequestBodyError::Unreadable(reason)) => {
                report(&config, Outcome::Rejected);
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
        let retry_after = config.retry_after_secs;
        match outcome {
            Ok(ClaimOutcome::Claimed { lease, retaken }) => {
                report(
                    &config,
                    if retaken {
                        Outcome::Retaken
                    } else {
                        Outcome::Claimed
                    },
                );
                tracing::info!(retaken, "claimed; running the handler");
                run(config, store, inner, request, claim.key, lease).await
            }
            Ok(ClaimOutcome::FingerprintMismatch) => {
                report(&config, Outcome::KeyReuse);
                tracing::info!("key reused for a different request");
                Ok(problem(
                    ErrorKind::IdempotencyKeyReuse,
                    "this Idempotency-Key was used for a request with a different body or query",
                    None,
                ))
            }
            Ok(ClaimOutcome::InProgress) => {
                report(&config, Outcome::InProgress);
                tracing::info!("duplicate while in progress");
                Ok(problem(
                    ErrorKind::InProgress,
                    "a request with this Idempotency-Key is still being processed; retry later",
                    Some(retry_after),
                ))
            }
            Ok(ClaimOutcome::Finished(stored)) => {
                report(&config, Outcome::Replayed);
                tracing::info!(status = stored.status, "replayed");
                Ok(replay::replay(&stored))
            }
            Err(e) if config.fail_open => {
                report(&config, Outcome::FailedOpen);
                tracing::warn!(error = %e, "idempotency store failed; running unguarded");
                pass_through(inner, request).await
            }
            Err(e) => {
                report(&config, Outcome::StoreUnavailable);
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
            let claim = Claim::new(store, config.clone(), key, lease);
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
    let outcome = match (config.policy)(response.status()) {
        Disposition::Complete => Finished::Completed,
        Disposition::Fail => Finished::Failed,
        Disposition::Release => {
            claim.release("the response asks for a retry").await;
            return response;
        }
    };
    let (parts, body) = response.into_parts();
    let bytes = match body::read_response(body, config.response_limit).await {
        ResponseBody::Whole(bytes) => bytes,
        ResponseBody::Passed(body) => {
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
    claim.complete(Arc::new(stored)).await;
    Response::from_parts(parts, Body::from(bytes))
}

/// Reports an outcome to the span and to the configured hook.
fn report(config: &Config, outcome: Outcome) {
    tracing::Span::current().record("outcome", outcome.as_str());
    if let Some(hook) = &config.on_outcome {
        hook(outcome);
    }
}

/// A held claim: completed or released exactly once, and released on drop if neither happened (the
/// task was cancelled), so a record is never left `in_progress` by this process on purpose.
struct Claim<St: IdempotencyStore> {
    store: St,
    config: Arc<Config>,
    key: RecordKey,
    lease: LeaseToken,
    done: bool,
}

impl<St: IdempotencyStore> Claim<St> {
    fn new(store: St, config: Arc<Config>, key: RecordKey, lease: LeaseToken) -> Self {
        Claim {
            store,
            config,
            key,
            lease,
            done: false,
        }
    }

    /// Records the response. When the store fails, the effect has happened, so the record is not
    /// released (a retry would run it again): recording is retried in the background, for up to half
    /// the in-progress TTL, while duplicates get `409`.
    async fn complete(mut self, stored: Arc<StoredResponse>) {
        self.done = true;
        let retention = self.config.retention;
        let first = self
            .store
            .complete(&self.key, self.lease, stored.clone(), retention)
            .await;
        if self.completed(first, stored.status) {
            return;
        }
        report(&self.config, Outcome::RecordDeferred);
        let deadline = Instant::now() + self.config.in_progress_ttl / 2;
        let claim = self; // done: the retries below own it
        let retry = async move {
            let mut pause = Duration::from_millis(100);
            loop {
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(2));
                let attempt = claim
                    .store
                    .complete(&claim.key, claim.lease, stored.clone(), retention)
                    .await;
                if claim.completed(attempt, stored.status) {
                    return;
                }
                if Instant::now() >= deadline {
                    tracing::error!(
                        "gave up recording the response; the record stays in progress and can be \
                         retaken after the in-progress TTL"
                    );
                    return;
                }
            }
        };
        tokio::spawn(retry.in_current_span());
    }

    /// Reports what a completion attempt did; false when the store failed.
    fn completed(&self, attempt: Result<bool, crate::StoreError>, status: u16) -> bool {
        match attempt {
            Ok(true) => {
                report(&self.config, Outcome::Recorded);
                tracing::info!(status, "recorded");
                true
            }
            Ok(false) => {
                report(&self.config, Outcome::LeaseLost);
                tracing::warn!(
                    "the lease was lost (the record was retaken after the in-progress TTL); \
                     this late result was not recorded"
                );
                true
            }
            Err(e) => {
                tracing::error!(error = %e, "the response could not be recorded yet");
                false
            }
        }
    }

    async fn release(mut self, why: &str) {
        self.done = true;
        report(&self.config, Outcome::Released);
        tracing::info!(reason = why, "releasing the record");
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
