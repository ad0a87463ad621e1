//! The claim flow of one guarded request: key, subject, body, fingerprint, claim, then replay, refuse,
//! or run the handler and record what it answered.

mod run;

use std::fmt;
use std::sync::Arc;

use axum::body::Body;
use http::{Request, Response};
use sha2::{Digest, Sha256};
use tokio::time::Instant;
use tower::{BoxError, Service, ServiceExt};
use tracing::Instrument;

use self::run::Granted;
pub(crate) use self::run::fresh;
use crate::body::{self, RequestBodyError};
use crate::config::Config;
use crate::key;
use crate::lease;
use crate::metrics::Label;
use crate::outcome::Outcome;
use crate::problem::ErrorKind;
use crate::record::{ClaimOutcome, ClaimRequest, RecordKey};
use crate::replay;
use crate::report::report;
use crate::store::IdempotencyStore;

/// Runs one request through the layer. `inner` is a ready clone of the wrapped service.
///
/// `waiting` is set while a duplicate only waits for its original's answer (see [`crate::wait`]).
pub(crate) async fn guard<S, St, ResBody>(
    config: Arc<Config>,
    store: St,
    inner: S,
    request: Request<Body>,
    waiting: Option<Arc<crate::wait::WaitState>>,
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
    let (key, subject, label) = match admit(&config, &parts) {
        Admission::Guarded {
            key,
            subject,
            label,
        } => (key, subject, label),
        Admission::Unguarded => return pass_through(inner, Request::from_parts(parts, body)).await,
        Admission::Refused(response) => return Ok(response),
    };
    let endpoint = (config.endpoint)(&parts);
    let span = span(&config, &key, &subject, &endpoint);
    async move {
        let bytes = match read_body(&config, &label, &parts, body).await {
            Ok(bytes) => bytes,
            Err(refused) => return Ok(refused),
        };
        let (lease, generation) = crate::record::claim_ids();
        let claim = ClaimRequest {
            key: RecordKey {
                key,
                subject,
                endpoint,
            },
            fingerprint: config.fingerprint.of(&parts, &bytes),
            lease,
            generation,
            in_progress_ttl: config.in_progress_ttl,
            retention: config.retention,
        };
        let request = Request::from_parts(parts, Body::from(bytes));
        let sent = Instant::now();
        let outcome = store.claim(&claim).await;
        let retry_after = config.retry_after_secs;
        match outcome {
            Ok(ClaimOutcome::Claimed {
                lease,
                retaken,
                generation,
            }) => {
                let claim = ClaimRequest { lease, ..claim };
                let granted = Granted {
                    sent,
                    retaken,
                    generation,
                };
                // Boxed: the handler's part of the state machine is large, and a request future
                // that carried it inline would be moved whole (replays and 409s included).
                Box::pin(run::claimed(
                    config, label, store, inner, request, claim, granted,
                ))
                .await
            }
            // A duplicate of a request in progress waits for its answer, when the layer says so.
            Ok(ClaimOutcome::InProgress) if !config.wait.is_zero() => {
                let answered =
                    crate::wait::for_answer(&config, &store, &claim, waiting.as_deref()).await;
                Ok(answer(&config, &label, &request, sent, answered))
            }
            Ok(answered) => Ok(answer(&config, &label, &request, sent, answered)),
            // A record that exists but cannot be read (it does not decrypt) records an operation
            // that happened: running the handler unguarded would repeat it.
            Err(e) if config.fail_open && !e.is_unreadable_record() && !e.is_refused_claim() => {
                lease::abandon(&config, store, claim.key, claim.lease);
                report(&config, &label, Outcome::FailedOpen);
                tracing::warn!(error = %e, "idempotency store failed; running unguarded");
                pass_through(inner, request).await
            }
            Err(e) => {
                // An unreadable record was read whole: the store answered, and made no claim that
                // could need cleaning up.
                if !e.is_unreadable_record() && !e.is_refused_claim() {
                    lease::abandon(&config, store, claim.key, claim.lease);
                }
                report(&config, &label, Outcome::StoreUnavailable);
                tracing::error!(error = %e, "idempotency store failed; refusing the request");
                Ok(config.problem(
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

/// What the layer does with a request, from its headers and the authenticated subject.
enum Admission {
    /// Claimed under this key, for this subject.
    Guarded {
        key: String,
        subject: String,
        label: Label,
    },
    /// No key, where none is required: the request runs as if the layer were not there.
    Unguarded,
    /// Answered at once, without its body read or anything claimed.
    Refused(Response<Body>),
}

fn admit(config: &Config, parts: &http::request::Parts) -> Admission {
    let refuse = |kind, detail: &str, retry_after| {
        report(config, &Label::of(parts), Outcome::Rejected);
        Admission::Refused(config.problem(kind, detail, retry_after))
    };
    let key = match key::from_headers(&parts.headers) {
        Ok(Some(key)) if key.len() < config.min_key_length => {
            let detail = format!(
                "the Idempotency-Key must be at least {} characters long here",
                config.min_key_length
            );
            return refuse(ErrorKind::InvalidIdempotencyKey, &detail, None);
        }
        Ok(Some(key)) => key,
        Ok(None) if config.require_key => {
            return refuse(
                ErrorKind::MissingIdempotencyKey,
                "this endpoint requires an Idempotency-Key header",
                None,
            );
        }
        Ok(None) => return Admission::Unguarded,
        Err(e) => return refuse(ErrorKind::InvalidIdempotencyKey, e.detail(), None),
    };
    let subject = match config.subject.subject(parts).filter(|s| !s.is_empty()) {
        Some(subject) => subject,
        None if config.allow_anonymous => String::new(),
        None => {
            return refuse(
                ErrorKind::MissingSubject,
                "an idempotent request must come from an authenticated subject",
                None,
            );
        }
    };
    // The endpoint label of this request's metrics (nothing without the `metrics` feature).
    let label = Label::of(parts);
    // Admission: what runs detached is bounded, so a client that resets requests in a loop cannot
    // make the server run unbounded work. Refused before the body is read or anything claimed.
    if config.drain.detached() >= config.max_running {
        report(config, &label, Outcome::Overloaded);
        tracing::warn!(
            detached = config.drain.detached(),
            "too many idempotent requests running on their own; refusing a new one"
        );
        return Admission::Refused(config.problem(
            ErrorKind::Overloaded,
            "too many idempotent requests are running; retry later",
            Some(config.retry_after_secs),
        ));
    }
    Admission::Guarded {
        key,
        subject,
        label,
    }
}

/// The request's span. Subjects and endpoints are personal data, and a forged one could fake log
/// lines: only their hashes are logged, unless the application opts in (`log_scope`).
pub(crate) fn span(config: &Config, key: &str, subject: &str, endpoint: &str) -> tracing::Span {
    if config.log_scope {
        tracing::info_span!(
            "idempotency",
            key_hash = %KeyHash(key),
            subject = ?subject,
            endpoint = ?endpoint,
        )
    } else {
        tracing::info_span!(
            "idempotency",
            key_hash = %KeyHash(key),
            subject_hash = %KeyHash(subject),
            endpoint_hash = %KeyHash(endpoint),
        )
    }
}

/// The whole request body, within the limit, or the answer refusing it.
async fn read_body(
    config: &Config,
    label: &Label,
    parts: &http::request::Parts,
    body: Body,
) -> Result<bytes::Bytes, Response<Body>> {
    match body::read_request(&parts.headers, body, config.body_limit).await {
        Ok(bytes) => Ok(bytes),
        Err(RequestBodyError::TooLarge) => {
            report(config, label, Outcome::Rejected);
            let detail = format!(
                "the request body is over the limit of {} bytes",
                config.body_limit
            );
            Err(config.problem(ErrorKind::RequestTooLarge, &detail, None))
        }
        Err(RequestBodyError::Unreadable(reason)) => {
            report(config, label, Outcome::Rejected);
            // The reason stays in the log: internal error text is not sent to clients.
            tracing::debug!(%reason, "the request body could not be read");
            Err(config.problem(
                ErrorKind::UnreadableBody,
                "the request body could not be read to its end",
                None,
            ))
        }
    }
}

/// The answer to a claim that lost to a record: `422`, `409`, or the replay.
fn answer(
    config: &Config,
    label: &Label,
    request: &Request<Body>,
    sent: Instant,
    outcome: ClaimOutcome,
) -> Response<Body> {
    match outcome {
        ClaimOutcome::FingerprintMismatch => {
            report(config, label, Outcome::KeyReuse);
            tracing::debug!("key reused for a different request");
            config.problem(
                ErrorKind::IdempotencyKeyReuse,
                "this Idempotency-Key was used for a request with a different body or query",
                None,
            )
        }
        ClaimOutcome::InProgress => {
            report(config, label, Outcome::InProgress);
            tracing::debug!("duplicate while in progress");
            config.problem(
                ErrorKind::InProgress,
                "a request with this Idempotency-Key is still being processed; retry later",
                Some(config.retry_after_secs),
            )
        }
        ClaimOutcome::Finished(stored) => {
            report(config, label, Outcome::Replayed);
            tracing::debug!(status = stored.status, "replayed");
            let mut response =
                replay::replay(&stored, &config.replay_header, &config.stored_headers);
            // Dated from when the claim was sent: the store counted the time left from a moment
            // after it, so the date is never later than the record's expiry.
            if config.expiry_header
                && let Some(left) = stored.expires_in
            {
                let sent_at = std::time::SystemTime::now() - sent.elapsed();
                replay::mark_expiry_from(response.headers_mut(), sent_at, left);
            }
            if let Some(hook) = &config.on_replay {
                // A hook that panics leaves the replay as it was.
                let headers = response.headers_mut();
                let hooked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    let mut changed = headers.clone();
                    hook(request, &stored, &mut changed);
                    changed
                }));
                match hooked {
                    Ok(changed) => *headers = changed,
                    Err(_) => tracing::error!("the replay hook panicked; replayed without it"),
                }
                let _ = headers.try_insert(
                    config.replay_header.clone(),
                    http::HeaderValue::from_static("true"),
                );
            }
            response
        }
        // Handled by the caller; never reached.
        ClaimOutcome::Claimed { .. } => internal_error(config),
    }
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

fn internal_error(config: &Config) -> Response<Body> {
    config.problem(
        ErrorKind::InternalError,
        "the request failed; it was not recorded and may be retried",
        None,
    )
}

/// The first 8 bytes of the key's SHA-256 in hex, computed only if a subscriber records the span.
struct KeyHash<'a>(&'a str);

impl fmt::Display for KeyHash<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        crate::hex::write(f, &Sha256::digest(self.0.as_bytes())[..8])
    }
}
