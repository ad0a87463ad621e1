//! The claim flow of one guarded request: key, subject, body, fingerprint, claim, then replay, refuse,
//! or run the handler and record what it answered.

use std::fmt;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use axum::body::Body;
use futures_util::FutureExt;
use http::{Request, Response};
use sha2::{Digest, Sha256};
use tower::{BoxError, Service, ServiceExt};
use tracing::Instrument;

use crate::body::{self, RequestBodyError};
use crate::config::Config;
use crate::context::IdempotencyContext;
use crate::key;
use crate::lease::{self, Lease};
use crate::metrics::Label;
use crate::outcome::{Outcome, report};
use crate::problem::{ErrorKind, problem};
use crate::record::{ClaimOutcome, ClaimRequest, LeaseToken, RecordKey};
use crate::recording;
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
            report(&config, &Label::of(&parts), Outcome::Rejected);
            return Ok(problem(
                ErrorKind::MissingIdempotencyKey,
                "this endpoint requires an Idempotency-Key header",
                None,
            ));
        }
        Ok(None) => return pass_through(inner, Request::from_parts(parts, body)).await,
        Err(e) => {
            report(&config, &Label::of(&parts), Outcome::Rejected);
            return Ok(problem(ErrorKind::InvalidIdempotencyKey, e.detail(), None));
        }
    };
    // The endpoint label of this request's metrics (nothing without the `metrics` feature).
    let label = Label::of(&parts);
    let subject = match config.subject.subject(&parts).filter(|s| !s.is_empty()) {
        Some(subject) => subject,
        None if config.allow_anonymous => String::new(),
        None => {
            report(&config, &label, Outcome::Rejected);
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
        key_hash = %KeyHash(&key),
        subject = %subject,
        endpoint = %endpoint,
        outcome = tracing::field::Empty,
    );
    async move {
        let bytes = match body::read_request(&parts.headers, body, config.body_limit).await {
            Ok(bytes) => bytes,
            Err(RequestBodyError::TooLarge) => {
                report(&config, &label, Outcome::Rejected);
                let detail = format!(
                    "the request body is over the limit of {} bytes",
                    config.body_limit
                );
                return Ok(problem(ErrorKind::RequestTooLarge, &detail, None));
            }
            Err(RequestBodyError::Unreadable(reason)) => {
                report(&config, &label, Outcome::Rejected);
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
            fingerprint: config.fingerprint.of(&parts, &bytes),
            lease: LeaseToken::generate(),
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
                    &label,
                    if retaken {
                        Outcome::Retaken
                    } else {
                        Outcome::Claimed
                    },
                );
                tracing::info!(retaken, "claimed; running the handler");
                let claim = ClaimRequest { lease, ..claim };
                run(config, label, store, inner, request, claim, retaken).await
            }
            Ok(ClaimOutcome::FingerprintMismatch) => {
                report(&config, &label, Outcome::KeyReuse);
                tracing::info!("key reused for a different request");
                Ok(problem(
                    ErrorKind::IdempotencyKeyReuse,
                    "this Idempotency-Key was used for a request with a different body or query",
                    None,
                ))
            }
            Ok(ClaimOutcome::InProgress) => {
                report(&config, &label, Outcome::InProgress);
                tracing::info!("duplicate while in progress");
                Ok(problem(
                    ErrorKind::InProgress,
                    "a request with this Idempotency-Key is still being processed; retry later",
                    Some(retry_after),
                ))
            }
            Ok(ClaimOutcome::Finished(stored)) => {
                report(&config, &label, Outcome::Replayed);
                tracing::info!(status = stored.status, "replayed");
                Ok(replay::replay(&stored, &config.replay_header))
            }
            // A record that exists but cannot be read (it does not decrypt) records an operation
            // that happened: running the handler unguarded would repeat it.
            Err(e) if config.fail_open && !e.is_unreadable_record() => {
                lease::abandon(store, claim.key, claim.lease, config.in_progress_ttl);
                report(&config, &label, Outcome::FailedOpen);
                tracing::warn!(error = %e, "idempotency store failed; running unguarded");
                pass_through(inner, request).await
            }
            Err(e) => {
                // An unreadable record was read whole: the store answered, and made no claim that
                // could need cleaning up.
                if !e.is_unreadable_record() {
                    lease::abandon(store, claim.key, claim.lease, config.in_progress_ttl);
                }
                report(&config, &label, Outcome::StoreUnavailable);
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

/// Runs the handler for a claimed record, renewing the lease while it runs, and records (or
/// releases) what it answered. The request future this runs in is detached onto a task of its own
/// if the client goes away (see [`ResponseFuture`](crate::ResponseFuture)), so a disconnect cancels
/// neither the effect nor its recording.
async fn run<S, St, ResBody>(
    config: Arc<Config>,
    label: Label,
    store: St,
    inner: S,
    mut request: Request<Body>,
    claim: ClaimRequest,
    retaken: bool,
) -> Result<Response<Body>, S::Error>
where
    S: Service<Request<Body>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    St: IdempotencyStore,
    ResBody: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    request.extensions_mut().insert(IdempotencyContext::new(
        claim.key.clone(),
        claim.fingerprint,
        retaken,
    ));
    #[cfg(feature = "postgres")]
    let slot = store.postgres().map(|pg| {
        let slot = crate::store::TxSlot::new(pg.clone());
        request.extensions_mut().insert(slot.clone());
        (pg.clone(), slot)
    });
    let lease = Lease::new(store, config.clone(), label, claim.key, claim.lease);
    let answer = lease
        .hold(AssertUnwindSafe(inner.oneshot(request)).catch_unwind())
        .await;
    // A transaction the handler took is rolled back on every path but a recorded answer.
    #[cfg(feature = "postgres")]
    let left = slot.map(|(pg, slot)| (pg, slot.take_back()));
    match answer {
        Ok(Ok(response)) => {
            let response = response.map(Body::new);
            #[cfg(feature = "postgres")]
            match left {
                Some((pg, crate::store::Left::Transaction(tx))) => {
                    return Ok(crate::store::record_in(&config, lease, &pg, tx, response).await);
                }
                Some((_, crate::store::Left::Kept)) => {
                    tracing::error!(
                        "the handler kept its IdempotentTx beyond its answer; it cannot be \
                         committed with the record, so the record is released"
                    );
                    lease.release("the handler kept its transaction").await;
                    return Ok(internal_error());
                }
                _ => {}
            }
            Ok(recording::record(&config, lease, response).await)
        }
        Ok(Err(e)) => {
            lease.release("the handler returned an error").await;
            Err(e)
        }
        Err(_panic) => {
            lease.release("the handler panicked").await;
            Ok(internal_error())
        }
    }
}

fn internal_error() -> Response<Body> {
    problem(
        ErrorKind::InternalError,
        "the request failed; it was not recorded and may be retried",
        None,
    )
}

/// The first 8 bytes of the key's SHA-256 in hex, computed only if a subscriber records the span.
struct KeyHash<'a>(&'a str);

impl fmt::Display for KeyHash<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in &Sha256::digest(self.0.as_bytes())[..8] {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}
