//! One guarded request: admitted, its body read (within its limit and its deadline) and
//! fingerprinted, its key claimed through the engine, then the handler run or the engine's answer
//! turned into a response.

use std::sync::Arc;

use axum::body::Body;
use http::{Request, Response};
use tower::{BoxError, Service, ServiceExt};
use tracing::Instrument;

use super::admission::{Admission, admit, checked};
use super::body::{self, RequestBodyError};
use super::handler::{self, Transactions};
use super::key::{Found, KeySource, Refused};
use super::problem::ErrorKind;
use super::replay;
use super::settings::{LayerSettings, ReplayCheckFn};
use crate::engine::{Claim, Engine, Outcome, Stage, Unavailable, span};
use crate::store::{IdempotencyStore, RecordKey, StoredResponse};
use crate::util::metrics::Label;
use futures_util::FutureExt;

/// Runs one request through the layer. `inner` is a ready clone of the wrapped service; `stage`
/// is shared with the request's future (see [`Stage`]).
pub(super) async fn guard<S, St, ResBody>(
    engine: Engine<St>,
    http: Arc<LayerSettings>,
    transactions: Option<Arc<dyn Transactions<St>>>,
    inner: S,
    request: Request<Body>,
    stage: Arc<Stage>,
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
    // A key in the body is read before anything else: only it says whether the request is
    // guarded, and a request without one runs as if the layer were not there.
    let (body, found) = match http.key_source {
        KeySource::Body(..) => {
            let label = super::label::of(&parts);
            // A place among the bodies read before admission, waited for: the request is not
            // refused (it may hold no key), and the bodies buffered at once stay bounded.
            // The wait counts against the body's own deadline.
            let reading =
                match tokio::time::timeout(http.body_timeout, http.body_reads.acquire()).await {
                    Ok(Ok(reading)) => reading,
                    Ok(Err(_)) => return Ok(super::handler::internal_error(&http)),
                    Err(_) => {
                        engine.report(&label, Outcome::Overloaded);
                        return Ok(http.retryable(
                            ErrorKind::Overloaded,
                            "too many request bodies are being read for their keys; retry later",
                        ));
                    }
                };
            let bytes = match read_body(&engine, &http, &label, &parts, body).await {
                Ok(bytes) => bytes,
                Err(refused) => return Ok(refused),
            };
            let found = key_in_body(&engine, &http, &label, &parts, &bytes);
            // Given back before anything runs: the handler of a request without a key holds none.
            drop(reading);
            match found {
                Ok(Some(found)) => (Input::Read(bytes), Some(found)),
                Ok(None) => {
                    let request = Request::from_parts(parts, Body::from(bytes));
                    return pass_through(inner, request).await;
                }
                Err(refused) => return Ok(*refused),
            }
        }
        _ => (Input::Unread(body), None),
    };
    let (key, label, in_flight) = match admit(&engine, &http, &parts, found) {
        Admission::Guarded {
            scope,
            label,
            in_flight,
        } => (scope, label, in_flight),
        Admission::Unguarded => {
            return pass_through(inner, Request::from_parts(parts, body.into_body())).await;
        }
        Admission::Refused(response) => return Ok(response),
    };
    let span = span(engine.settings(), &key);
    async move {
        // The subject's place in flight, held until this request ends (detached or not), and
        // past it by the lease of a claim whose response still streams into its record.
        let mut in_flight = Some(in_flight);
        let bytes = match body {
            Input::Read(bytes) => bytes,
            Input::Unread(body) => match read_body(&engine, &http, &label, &parts, body).await {
                Ok(bytes) => bytes,
                Err(refused) => return Ok(refused),
            },
        };
        // From here on the request runs to its end if its client leaves.
        stage.body_read();
        let fingerprint = http.fingerprint.of(&parts, &bytes);
        // The scope a replay check is shown (kept only when there is one).
        let scope = http.replay_check.as_ref().map(|_| key.clone());
        match engine.claim(label, key, fingerprint, Some(&stage)).await {
            Claim::Held(mut lease, context) => {
                if let Some(share) = in_flight.take() {
                    lease.hold_share(share);
                }
                // Boxed: the handler's part of the state machine is large, and a request future
                // that carried it inline would be moved whole (replays and 409s included).
                Box::pin(handler::run(
                    &http,
                    transactions.as_deref(),
                    inner,
                    Request::from_parts(parts, Body::from(bytes)),
                    lease,
                    context,
                ))
                .await
            }
            Claim::Finished(stored, sent) => {
                if let (Some(check), Some(scope)) = (&http.replay_check, &scope)
                    && let Some(refused) =
                        refused(&http, check.as_ref(), &parts, scope, &stored).await
                {
                    return Ok(refused);
                }
                let request = Request::from_parts(parts, Body::from(bytes));
                Ok(replayed(&http, &request, &stored, sent))
            }
            Claim::InProgress => Ok(http.retryable(
                ErrorKind::InProgress,
                "a request with this Idempotency-Key is still being processed; retry later",
            )),
            Claim::KeyReuse => Ok(http.problem(
                ErrorKind::KeyReuse,
                "this Idempotency-Key was used for a request with a different body or query",
                None,
            )),
            Claim::Reserved => Ok(super::handler::internal_error(&http)),
            Claim::Expired => Ok(http.problem(
                ErrorKind::KeyExpired,
                "this Idempotency-Key named an operation whose record has expired; it is not run \
                 again, and a new operation needs a new key",
                None,
            )),
            Claim::Unguarded => {
                pass_through(inner, Request::from_parts(parts, Body::from(bytes))).await
            }
            Claim::Unavailable(Unavailable::TooLate) => Ok(http.retryable(
                ErrorKind::StoreUnavailable,
                "the idempotency store answered too slowly; retry later",
            )),
            Claim::Unavailable(Unavailable::Store(e)) if e.is_quota_exceeded() => Ok(http
                .retryable(
                    ErrorKind::QuotaExceeded,
                    "this subject holds its share of the idempotency store; retry later",
                )),
            Claim::Unavailable(Unavailable::Store(e)) if e.is_store_full() => Ok(http.retryable(
                ErrorKind::StoreFull,
                "the idempotency store has no room for a new record; retry later",
            )),
            Claim::Unavailable(Unavailable::Store(_)) => Ok(http.retryable(
                ErrorKind::StoreUnavailable,
                "the idempotency store is unavailable; retry later",
            )),
        }
    }
    .instrument(span)
    .await
}

/// The whole request body, within its limit and its deadline, or the answer refusing it.
async fn read_body<St: IdempotencyStore>(
    engine: &Engine<St>,
    http: &LayerSettings,
    label: &Label,
    parts: &http::request::Parts,
    body: Body,
) -> Result<bytes::Bytes, Response<Body>> {
    let mut read = std::pin::pin!(body::read_request(&parts.headers, body, http.body_limit));
    // A body that is whole already (the usual small JSON) needs no timer.
    let read = match futures_util::FutureExt::now_or_never(read.as_mut()) {
        Some(read) => Ok(read),
        None => tokio::time::timeout(http.body_timeout, read).await,
    };
    let refused = match read {
        Ok(Ok(bytes)) => return Ok(bytes),
        Ok(Err(RequestBodyError::TooLarge)) => {
            let detail = format!(
                "the request body is over the limit of {} bytes",
                http.body_limit
            );
            http.problem(ErrorKind::RequestTooLarge, &detail, None)
        }
        Ok(Err(RequestBodyError::OverOuterLimit)) => http.problem(
            ErrorKind::RequestTooLarge,
            "the request body is over the limit this service sets",
            None,
        ),
        Ok(Err(RequestBodyError::Unreadable(reason))) => {
            // The reason stays in the log: internal error text is not sent to clients.
            tracing::debug!(%reason, "the request body could not be read");
            http.problem(
                ErrorKind::UnreadableBody,
                "the request body could not be read to its end",
                None,
            )
        }
        Err(_) => {
            tracing::debug!("the request body did not arrive within its deadline");
            let detail = format!(
                "the request body did not arrive within {} ms",
                http.body_timeout.as_millis()
            );
            http.retryable(ErrorKind::RequestTimeout, &detail)
        }
    };
    engine.report(label, Outcome::Rejected);
    Err(refused)
}

/// The request's body, before or after it was read.
enum Input {
    Unread(Body),
    Read(bytes::Bytes),
}

impl Input {
    fn into_body(self) -> Body {
        match self {
            Input::Unread(body) => body,
            Input::Read(bytes) => Body::from(bytes),
        }
    }
}

/// The key in the body's field (or the `Idempotency-Key` header), `None` when there is none and
/// none is required; or the answer refusing the request.
fn key_in_body<St: IdempotencyStore>(
    engine: &Engine<St>,
    http: &LayerSettings,
    label: &Label,
    parts: &http::request::Parts,
    bytes: &[u8],
) -> Result<Option<String>, Box<Response<Body>>> {
    let refused = match http.key_source.in_body(&parts.headers, bytes) {
        Ok(Found::Key(key)) => match checked(http, key) {
            Ok(key) => return Ok(Some(key)),
            Err(detail) => http.problem(ErrorKind::InvalidIdempotencyKey, &detail, None),
        },
        Ok(Found::Absent | Found::InBody) if http.require_key => {
            let detail = format!(
                "this endpoint requires a key in {}",
                http.key_source.describe()
            );
            http.problem(ErrorKind::MissingIdempotencyKey, &detail, None)
        }
        Ok(Found::Absent | Found::InBody) => return Ok(None),
        Err(Refused(detail)) => http.problem(ErrorKind::InvalidIdempotencyKey, &detail, None),
    };
    engine.report(label, Outcome::Rejected);
    Err(Box::new(refused))
}

/// What the replay check answers instead of the replay of `stored`, if it refuses it. A check
/// that panics refuses it with `500`: it did not say the answer may be sent.
async fn refused(
    http: &LayerSettings,
    check: &ReplayCheckFn,
    parts: &http::request::Parts,
    scope: &RecordKey,
    stored: &StoredResponse,
) -> Option<Response<Body>> {
    let info = crate::ReplayInfo::new(scope, stored);
    let checked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| check(parts, &info)));
    let answer = match checked {
        Ok(future) => {
            let checking = std::panic::AssertUnwindSafe(future).catch_unwind();
            match tokio::time::timeout(crate::engine::REPLAY_CHECK_BOUND, checking).await {
                Ok(answer) => answer,
                Err(_) => {
                    tracing::warn!(
                        "the replay check did not answer in time; the replay is refused"
                    );
                    return Some(http.retryable(
                        ErrorKind::StoreUnavailable,
                        "the answer of this Idempotency-Key could not be checked in time; retry \
                         later",
                    ));
                }
            }
        }
        Err(panic) => Err(panic),
    };
    match answer {
        Ok(None) => None,
        Ok(Some(refusal)) => {
            tracing::info!(
                status = refusal.status().as_u16(),
                "the replay check refused a replay"
            );
            Some(refusal)
        }
        Err(_) => {
            tracing::error!("the replay check panicked; the replay is refused");
            Some(super::handler::internal_error(http))
        }
    }
}

/// The replay of a finished record.
fn replayed(
    http: &LayerSettings,
    request: &Request<Body>,
    stored: &StoredResponse,
    sent: tokio::time::Instant,
) -> Response<Body> {
    let mut response = replay::replay(stored, &http.replay_header, &http.stored_headers);
    #[cfg(feature = "grpc")]
    if http.grpc.is_some() {
        response = super::grpc::with_trailers(&http.stored_headers, stored, response);
    }
    // Dated from when the claim was sent: the store counted the time left from a moment after
    // it, so the date is never later than the record's expiry.
    if http.expiry_header
        && let Some(left) = stored.expires_in
    {
        let sent_at = std::time::SystemTime::now() - sent.elapsed();
        replay::mark_expiry_from(response.headers_mut(), sent_at, left);
    }
    if let Some(hook) = &http.on_replay {
        // A hook that panics leaves the replay as it was.
        let headers = response.headers_mut();
        let hooked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let mut changed = headers.clone();
            hook(request, stored, &mut changed);
            changed
        }));
        match hooked {
            Ok(changed) => *headers = changed,
            Err(_) => tracing::error!("the replay hook panicked; replayed without it"),
        }
        let _ = headers.try_insert(
            http.replay_header.clone(),
            http::HeaderValue::from_static("true"),
        );
    }
    response
}

pub(super) async fn pass_through<S, ResBody>(
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
