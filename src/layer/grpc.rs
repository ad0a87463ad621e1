//! The gRPC door (feature `grpc`): the layer set with
//! [`IdempotencyLayerBuilder::grpc`](crate::IdempotencyLayerBuilder::grpc) guards unary gRPC
//! calls, on the same engine, claim, lease and recording limits as HTTP requests.
//!
//! - **The key** is the `idempotency-key` metadata (the request header of that name), read and
//!   checked as the HTTP layer reads its header; [`key_header`](crate::IdempotencyLayerBuilder::key_header)
//!   and [`key_from`](crate::IdempotencyLayerBuilder::key_from) still apply.
//!   [`require_key`](crate::IdempotencyLayerBuilder::require_key) decides as for HTTP: a call
//!   without a key passes through, or is refused `INVALID_ARGUMENT`.
//! - **The fingerprint** is the method path and the whole request body as it was sent: the
//!   gRPC length-prefixed frames (their compression flag, their length and the message bytes).
//!   A retry must send the same message the same way (a client that compresses one attempt and
//!   not the other sends other bytes: `FAILED_PRECONDITION`).
//! - **Which calls are guarded.** The wire does not say whether a method streams, so the
//!   application names its unary methods ([`GrpcSettings::unary`]): only those, sent as
//!   `application/grpc`, are guarded. Any other gRPC call with a key (a streaming method, a
//!   method not named) is refused `UNIMPLEMENTED` by default, or passes through unguarded with
//!   [`OtherCalls::PassThrough`]; one without a key always passes through, and so does a request
//!   that is not gRPC (`application/grpc-web` included): put the HTTP layer on HTTP routes.
//! - **The answer is known at its trailers**: the handler's response is read to its end (up to
//!   the [`response_limit`](crate::IdempotencyLayerBuilder::response_limit), within the maximum
//!   hold) before the client gets any of it, and its `grpc-status` (in the trailers, or in the
//!   headers of a trailers-only answer) decides by the [status policy](GrpcSettings::status_policy):
//!   released for a retry, or recorded as completed or failed. A tonic handler, whose error
//!   `Status` carries no extensions, decides over the policy with the metadata
//!   [`DISPOSITION_METADATA`] (`idempotency-disposition: fail`, `complete` or `release`, set with
//!   `Status::with_metadata` or on its response), which the layer takes off the answer: a handler
//!   that failed after its effect happened (charged, then `INTERNAL`) says `fail`, so that its
//!   retry is the replay and not a second charge. A payment API may rather set a stricter
//!   [status policy](GrpcSettings::status_policy) that releases `UNAVAILABLE` alone.
//! - **A replay** is the recorded headers, the body and the recorded trailers (`grpc-status`,
//!   `grpc-message`, `grpc-status-details-bin`) sent as HTTP/2 trailers, or a trailers-only answer
//!   when the original was one; with `idempotent-replayed: true` in its headers.
//! - **The layer's own answers** are gRPC statuses in trailers-only answers (HTTP 200,
//!   `content-type: application/grpc`, `grpc-status` and `grpc-message` in the headers), with the
//!   error in `grpc-status-details-bin`: a `google.rpc.Status` whose details hold a
//!   `google.rpc.ErrorInfo` (`reason`: the error's code such as `in_progress`, `domain`: this
//!   crate's name, `metadata`: its `instance`) and, when it is retryable, a `google.rpc.RetryInfo`
//!   with the delay, also sent as `grpc-retry-pushback-ms`.
//!
//! | the layer's answer | gRPC status |
//! |---|---|
//! | `in_progress` (a duplicate while the first runs) | `ABORTED` (10), pushback |
//! | `idempotency_key_reuse`, `idempotency_key_expired` | `FAILED_PRECONDITION` (9) |
//! | `missing_idempotency_key`, `invalid_idempotency_key`, `unreadable_request_body`, a subject or path too long | `INVALID_ARGUMENT` (3) |
//! | `missing_subject` | `UNAUTHENTICATED` (16) |
//! | `request_too_large`, `idempotency_quota_exceeded` | `RESOURCE_EXHAUSTED` (8) |
//! | `idempotency_store_unavailable`, `idempotency_overloaded`, `idempotency_store_full` | `UNAVAILABLE` (14), pushback |
//! | `request_timeout`, `idempotency_handler_timeout` | `DEADLINE_EXCEEDED` (4) |
//! | `internal_error` | `INTERNAL` (13) |
//! | `response_not_recorded` (the answer was over the response limit, or its stream failed: recorded without it) | `DATA_LOSS` (15) |
//! | a call that is not guarded but has a key, with [`OtherCalls::Refuse`] | `UNIMPLEMENTED` (12) |
//!
//! Every answer that is retryable (one the HTTP layer sends with `Retry-After`) carries
//! `grpc-retry-pushback-ms`, the layer's `retry_after_secs` in milliseconds (2000 by default).
//!
//! **How trailers are kept.** A record has one list of headers (the stored format is the HTTP
//! one, unchanged, in every store); a trailer is kept in it under its name prefixed with
//! `idempotency-trailer-`, which the replay turns back into a trailer. No response can forge one:
//! names with that prefix are dropped from every answer the layer records and from every replay's
//! headers (the header policy denies them), whatever the configuration.

use std::sync::Arc;

use axum::body::Body;
use bytes::{Bytes, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode};
use http_body::Frame;
use sha2::{Digest, Sha256};

use super::policy::Disposition;
use super::problem::ErrorKind;
use super::recording;
use super::replay;
use super::settings::LayerSettings;
use crate::engine::{ConfigError, Lease};
use crate::store::{Fingerprint, Finished, IdempotencyStore, StoredResponse};

use super::header_policy::TRAILER_PREFIX;

/// The response headers and trailers a gRPC layer records besides the allow-list: the status and
/// what describes the message bytes (`grpc-encoding`).
pub(crate) const GRPC_HEADERS: [HeaderName; 4] = [
    HeaderName::from_static("grpc-status"),
    HeaderName::from_static("grpc-message"),
    HeaderName::from_static("grpc-status-details-bin"),
    HeaderName::from_static("grpc-encoding"),
];

const GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");
const GRPC_MESSAGE: HeaderName = HeaderName::from_static("grpc-message");
const GRPC_DETAILS: HeaderName = HeaderName::from_static("grpc-status-details-bin");
const GRPC_PUSHBACK: HeaderName = HeaderName::from_static("grpc-retry-pushback-ms");
const APPLICATION_GRPC: &str = "application/grpc";

/// The metadata (a header, or a trailer) by which a handler decides what becomes of its answer
/// over the status policy: `fail` (recorded, replayed), `complete` or `release`. The layer takes
/// it off the answer: it is neither recorded nor sent.
pub const DISPOSITION_METADATA: &str = "idempotency-disposition";

/// The disposition `headers` ask for ([`DISPOSITION_METADATA`]), taken off them; an unknown value
/// asks for nothing.
fn disposition_in(headers: &mut HeaderMap) -> Option<Disposition> {
    let said = headers.remove(DISPOSITION_METADATA)?;
    match said.to_str().map(str::trim) {
        Ok("fail") => Some(Disposition::Fail),
        Ok("complete") => Some(Disposition::Complete),
        Ok("release") => Some(Disposition::Release),
        _ => {
            tracing::warn!(value = ?said, "an {DISPOSITION_METADATA} that says nothing known");
            None
        }
    }
}

/// gRPC status codes the layer answers with or decides on.
pub mod code {
    /// `OK`.
    pub const OK: u32 = 0;
    /// `CANCELLED`.
    pub const CANCELLED: u32 = 1;
    /// `UNKNOWN`.
    pub const UNKNOWN: u32 = 2;
    /// `INVALID_ARGUMENT`.
    pub const INVALID_ARGUMENT: u32 = 3;
    /// `DEADLINE_EXCEEDED`.
    pub const DEADLINE_EXCEEDED: u32 = 4;
    /// `NOT_FOUND`.
    pub const NOT_FOUND: u32 = 5;
    /// `ALREADY_EXISTS`.
    pub const ALREADY_EXISTS: u32 = 6;
    /// `PERMISSION_DENIED`.
    pub const PERMISSION_DENIED: u32 = 7;
    /// `RESOURCE_EXHAUSTED`.
    pub const RESOURCE_EXHAUSTED: u32 = 8;
    /// `FAILED_PRECONDITION`.
    pub const FAILED_PRECONDITION: u32 = 9;
    /// `ABORTED`.
    pub const ABORTED: u32 = 10;
    /// `OUT_OF_RANGE`.
    pub const OUT_OF_RANGE: u32 = 11;
    /// `UNIMPLEMENTED`.
    pub const UNIMPLEMENTED: u32 = 12;
    /// `INTERNAL`.
    pub const INTERNAL: u32 = 13;
    /// `UNAVAILABLE`.
    pub const UNAVAILABLE: u32 = 14;
    /// `DATA_LOSS`.
    pub const DATA_LOSS: u32 = 15;
    /// `UNAUTHENTICATED`.
    pub const UNAUTHENTICATED: u32 = 16;
}

/// What a gRPC layer does with a call it does not guard (a streaming method, a method not named
/// in [`GrpcSettings::unary`], a call not sent as `application/grpc`) that carries a key. A call
/// without a key always passes through.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OtherCalls {
    /// Refused with `UNIMPLEMENTED` (reason `idempotency_not_supported`): a client that sent a key
    /// is told that it is not honoured here, rather than have the call run unguarded.
    #[default]
    Refuse,
    /// Passed to the service unguarded, its key ignored.
    PassThrough,
}

type GrpcPolicyFn = dyn Fn(u32) -> Disposition + Send + Sync;

/// The gRPC mode of the layer (feature `grpc`), given to
/// [`IdempotencyLayerBuilder::grpc`](crate::IdempotencyLayerBuilder::grpc): which methods are
/// unary (the only ones guarded), what happens to the other calls, and the status policy. See
/// the [module](self) for what the layer then does.
///
/// ```
/// use axum_idempotency::layer::grpc::{GrpcSettings, OtherCalls};
/// use axum_idempotency::{IdempotencyLayer, MemoryStore};
///
/// let layer = IdempotencyLayer::builder(MemoryStore::new())
///     .allow_anonymous(true)
///     .grpc(
///         GrpcSettings::new()
///             .unary(["/checkout.Checkout/Pay"])
///             .other_calls(OtherCalls::PassThrough),
///     )
///     .build()
///     .expect("valid settings");
/// # let _ = layer;
/// ```
#[derive(Clone)]
pub struct GrpcSettings {
    unary: Vec<String>,
    others: OtherCalls,
    policy: Arc<GrpcPolicyFn>,
}

impl std::fmt::Debug for GrpcSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrpcSettings")
            .field("unary", &self.unary)
            .field("others", &self.others)
            .finish_non_exhaustive()
    }
}

impl Default for GrpcSettings {
    fn default() -> Self {
        Self::new()
    }
}

impl GrpcSettings {
    /// No unary method yet (name them with [`unary`](Self::unary)), other calls refused,
    /// the [`default_grpc_policy`].
    pub fn new() -> Self {
        GrpcSettings {
            unary: Vec::new(),
            others: OtherCalls::default(),
            policy: Arc::new(default_grpc_policy),
        }
    }

    /// The unary methods guarded, by their paths as gRPC sends them: `/package.Service/Method`.
    /// Added to those named before. Only these are guarded: the layer reads a whole request and a
    /// whole answer, which a streaming call does not have.
    pub fn unary(mut self, paths: impl IntoIterator<Item = impl Into<String>>) -> Self {
        self.unary.extend(paths.into_iter().map(Into::into));
        self
    }

    /// What happens to a call with a key that is not guarded. Default: [`OtherCalls::Refuse`].
    pub fn other_calls(mut self, others: OtherCalls) -> Self {
        self.others = others;
        self
    }

    /// Decides, from the handler's `grpc-status`, whether its answer is recorded as completed,
    /// recorded as failed, or released for another try. Default: [`default_grpc_policy`]. A
    /// [`Disposition`] in the response's extensions decides over it, as for HTTP; an answer with
    /// no `grpc-status` at all is recorded as failed (it may have taken effect).
    pub fn status_policy(
        mut self,
        policy: impl Fn(u32) -> Disposition + Send + Sync + 'static,
    ) -> Self {
        self.policy = Arc::new(policy);
        self
    }

    pub(crate) fn check(&self) -> Result<(), ConfigError> {
        if self.unary.is_empty() {
            return Err(ConfigError::new(
                "grpc",
                "name at least one unary method to guard",
            ));
        }
        for path in &self.unary {
            let well_formed = path
                .strip_prefix('/')
                .and_then(|rest| rest.split_once('/'))
                .is_some_and(|(service, method)| {
                    !service.is_empty() && !method.is_empty() && !method.contains('/')
                });
            if !well_formed {
                return Err(ConfigError::new(
                    "grpc",
                    format!("{path:?} is not a method path such as /package.Service/Method"),
                ));
            }
        }
        Ok(())
    }

    /// Whether the layer guards `request`: a unary method named here, sent as gRPC.
    pub(crate) fn guards<B>(&self, request: &http::Request<B>) -> bool {
        is_grpc(request.headers()) && self.unary.iter().any(|m| m == path_of(request))
    }

    /// Whether a call that is not guarded but carries a key is refused.
    pub(crate) fn refuses_others(&self) -> bool {
        self.others == OtherCalls::Refuse
    }

    fn disposition(&self, code: u32) -> Disposition {
        // A policy that panics must not release an answer that may have taken effect.
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| (self.policy)(code)))
            .unwrap_or_else(|_| {
                tracing::error!(
                    code,
                    "the gRPC status policy panicked; the answer is recorded, since its effect \
                     may have happened"
                );
                if code == code::OK {
                    Disposition::Complete
                } else {
                    Disposition::Fail
                }
            })
    }
}

/// The default status policy of the gRPC mode, as [`default_policy`](crate::layer::default_policy) is
/// for HTTP, through the statuses gRPC maps its codes to:
///
/// - `OK`: completed, replayed;
/// - `UNAVAILABLE`, `DEADLINE_EXCEEDED`, `INTERNAL`, `UNKNOWN`, `DATA_LOSS`, `UNIMPLEMENTED`
///   (the 5xx of HTTP), `ABORTED` (409) and `RESOURCE_EXHAUSTED` (429), and codes gRPC does not
///   define: released, so that the retry runs (a handler that failed this way must not have
///   taken effect, or must say so with [`Disposition::Fail`] in its response's extensions);
/// - the definitive codes, `INVALID_ARGUMENT`, `NOT_FOUND`, `ALREADY_EXISTS`,
///   `PERMISSION_DENIED`, `FAILED_PRECONDITION`, `OUT_OF_RANGE`, `UNAUTHENTICATED`, `CANCELLED`
///   (the 4xx): failed, replayed.
pub fn default_grpc_policy(status: u32) -> Disposition {
    match status {
        code::OK => Disposition::Complete,
        code::CANCELLED
        | code::INVALID_ARGUMENT
        | code::NOT_FOUND
        | code::ALREADY_EXISTS
        | code::PERMISSION_DENIED
        | code::FAILED_PRECONDITION
        | code::OUT_OF_RANGE
        | code::UNAUTHENTICATED => Disposition::Fail,
        _ => Disposition::Release,
    }
}

/// Whether `headers` say the message is gRPC (`application/grpc`, `application/grpc+proto`, ...;
/// not gRPC-Web, whose trailers travel in the body).
pub(crate) fn is_grpc(headers: &HeaderMap) -> bool {
    headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix(APPLICATION_GRPC))
        .is_some_and(|rest| rest.is_empty() || rest.starts_with('+') || rest.starts_with(';'))
}

/// The method path the client sent (before any `Router::nest` stripped a prefix).
fn path_of<B>(request: &http::Request<B>) -> &str {
    request
        .extensions()
        .get::<axum::extract::OriginalUri>()
        .map_or_else(|| request.uri().path(), |original| original.0.path())
}

/// The fingerprint of a gRPC call: its method path and its body as sent (the length-prefixed
/// frames, compression flag and length included).
pub(crate) fn fingerprint(parts: &http::request::Parts, body: &[u8]) -> Fingerprint {
    let path = parts
        .extensions
        .get::<axum::extract::OriginalUri>()
        .map_or_else(|| parts.uri.path(), |original| original.0.path());
    let mut hasher = Sha256::new();
    hasher.update(b"grpc");
    hasher.update((path.len() as u64).to_be_bytes());
    hasher.update(path.as_bytes());
    hasher.update(body);
    Fingerprint(hasher.finalize().into())
}

/// The gRPC status of each of the layer's errors.
pub(crate) fn code_of(kind: ErrorKind) -> u32 {
    match kind {
        ErrorKind::MissingIdempotencyKey
        | ErrorKind::InvalidIdempotencyKey
        | ErrorKind::UnreadableBody
        | ErrorKind::SubjectTooLong
        | ErrorKind::EndpointTooLong => code::INVALID_ARGUMENT,
        ErrorKind::MissingSubject => code::UNAUTHENTICATED,
        ErrorKind::RequestTooLarge | ErrorKind::QuotaExceeded => code::RESOURCE_EXHAUSTED,
        ErrorKind::RequestTimeout | ErrorKind::HandlerTimeout => code::DEADLINE_EXCEEDED,
        ErrorKind::KeyReuse | ErrorKind::KeyExpired => code::FAILED_PRECONDITION,
        ErrorKind::InProgress => code::ABORTED,
        ErrorKind::StoreUnavailable | ErrorKind::Overloaded | ErrorKind::StoreFull => {
            code::UNAVAILABLE
        }
        ErrorKind::InternalError => code::INTERNAL,
    }
}

/// One of the layer's own answers as a gRPC status, trailers-only.
pub(crate) fn status_answer(
    kind: ErrorKind,
    detail: &str,
    retry_after: Option<u32>,
    instance: &str,
) -> Response<Body> {
    let headers = status_headers(code_of(kind), kind.code(), detail, retry_after, instance);
    trailers_only(headers)
}

/// The headers of a trailers-only status: `content-type`, `grpc-status`, `grpc-message`,
/// `grpc-status-details-bin` and, when it is retryable, `grpc-retry-pushback-ms`.
fn status_headers(
    status: u32,
    reason: &str,
    detail: &str,
    retry_after: Option<u32>,
    instance: &str,
) -> Vec<(HeaderName, HeaderValue)> {
    let mut headers = vec![
        (
            http::header::CONTENT_TYPE,
            HeaderValue::from_static(APPLICATION_GRPC),
        ),
        (GRPC_STATUS, HeaderValue::from(status)),
    ];
    if let Ok(message) = HeaderValue::try_from(percent_encode(detail)) {
        headers.push((GRPC_MESSAGE, message));
    }
    let details = status_details(status, detail, reason, instance, retry_after);
    if let Ok(details) = HeaderValue::try_from(base64(&details)) {
        headers.push((GRPC_DETAILS, details));
    }
    if let Some(secs) = retry_after {
        headers.push((GRPC_PUSHBACK, HeaderValue::from(u64::from(secs) * 1000)));
    }
    headers
}

fn trailers_only(headers: Vec<(HeaderName, HeaderValue)>) -> Response<Body> {
    let mut response = Response::new(Body::empty());
    for (name, value) in headers {
        response.headers_mut().append(name, value);
    }
    response
}

/// The reason of the refusal of a call that is not guarded but carries a key.
const NOT_SUPPORTED: &str = "idempotency_not_supported";

/// The refusal of a call with a key that the layer does not guard ([`OtherCalls::Refuse`]):
/// `UNIMPLEMENTED`.
pub(crate) fn unguarded_call() -> Response<Body> {
    let instance = super::problem::instance();
    tracing::debug!(error = NOT_SUPPORTED, %instance, "a call the layer does not guard sent a key");
    trailers_only(status_headers(
        code::UNIMPLEMENTED,
        NOT_SUPPORTED,
        "this method is not guarded by idempotency keys (a streaming method, or one not named \
         unary); send it without a key",
        None,
        &instance,
    ))
}

/// The record of a handler cancelled at the maximum hold: a definitive `DEADLINE_EXCEEDED`
/// (reason `idempotency_handler_timeout`), trailers-only, replayed for the key.
pub(crate) fn handler_timeout() -> StoredResponse {
    let kind = ErrorKind::HandlerTimeout;
    let instance = super::problem::instance();
    tracing::warn!(error = kind.code(), %instance, "answered with a gRPC status (recorded)");
    stored_status(
        code_of(kind),
        kind.code(),
        "the operation did not finish within the time allowed and was cancelled; it may have \
         taken effect, so it is not run again for this idempotency key",
        &instance,
    )
}

/// The reason of the status recorded for an answer that could not be recorded.
const NOT_RECORDED: &str = "response_not_recorded";

/// The record of an answer whose status could not be read (over the response limit, or its
/// stream failed): a definitive `DATA_LOSS`, trailers-only, body omitted.
fn not_recorded() -> StoredResponse {
    let instance = super::problem::instance();
    let mut stored = stored_status(
        code::DATA_LOSS,
        NOT_RECORDED,
        "the answer to this idempotency key could not be recorded (over the response limit, or \
         its stream failed); it may have taken effect, so it is not run again for this key",
        &instance,
    );
    stored.body_omitted = true;
    stored
}

fn stored_status(status: u32, reason: &str, detail: &str, instance: &str) -> StoredResponse {
    StoredResponse {
        outcome: Finished::Failed,
        status: StatusCode::OK.as_u16(),
        headers: status_headers(status, reason, detail, None, instance),
        body: Bytes::new(),
        body_omitted: false,
        expires_in: None,
    }
}

/// The replay of `stored` (`response`, made by the HTTP replay: its status, its headers, its
/// body) with the recorded trailers sent as trailers again: those on the allow-list.
pub(crate) fn with_trailers(
    allowed: &[HeaderName],
    stored: &StoredResponse,
    response: Response<Body>,
) -> Response<Body> {
    let trailers = trailers_of(allowed, stored);
    if trailers.is_empty() {
        return response;
    }
    let (parts, _) = response.into_parts();
    let body = if stored.body_omitted {
        Bytes::new()
    } else {
        stored.body.clone()
    };
    Response::from_parts(parts, with_trailer_frame(body, trailers))
}

/// The trailers a record keeps under [`TRAILER_PREFIX`], on the allow-list and not denied.
fn trailers_of(allowed: &[HeaderName], stored: &StoredResponse) -> HeaderMap {
    let mut trailers = HeaderMap::new();
    for (name, value) in &stored.headers {
        let Some(name) = name
            .as_str()
            .strip_prefix(TRAILER_PREFIX)
            .and_then(|n| HeaderName::try_from(n).ok())
        else {
            continue;
        };
        if allowed.contains(&name)
            && !super::header_policy::is_denied(&name)
            && trailers.try_append(name, value.clone()).is_err()
        {
            break;
        }
    }
    trailers
}

/// A body of `data` (if any) then `trailers`.
fn with_trailer_frame(data: Bytes, trailers: HeaderMap) -> Body {
    let mut frames = Vec::with_capacity(2);
    if !data.is_empty() {
        frames.push(Ok::<_, std::convert::Infallible>(Frame::data(data)));
    }
    frames.push(Ok(Frame::trailers(trailers)));
    Body::new(http_body_util::StreamBody::new(futures_util::stream::iter(
        frames,
    )))
}

/// How a gRPC answer's body was read.
enum Read {
    /// To its end: its data and its trailers, if any.
    Whole(Bytes, Option<HeaderMap>),
    /// Over the limit: the data read so far, then the rest of the body, unread.
    Over(Vec<Bytes>, Body),
    /// Its stream failed.
    Failed,
}

/// Reads the body of a gRPC answer to its end, keeping at most `limit` bytes.
async fn read(mut body: Body, limit: usize) -> Read {
    let mut chunks = Vec::new();
    let mut len = 0usize;
    let mut trailers: Option<HeaderMap> = None;
    if http_body::Body::size_hint(&body).lower() > limit as u64 {
        return Read::Over(chunks, body);
    }
    loop {
        match recording::next_frame(&mut body).await {
            None => break,
            Some(Err(_)) => return Read::Failed,
            Some(Ok(frame)) => match frame.into_data() {
                Ok(data) => {
                    len = len.saturating_add(data.len());
                    if !data.is_empty() {
                        chunks.push(data);
                    }
                    if len > limit {
                        return Read::Over(chunks, body);
                    }
                }
                Err(frame) => {
                    if let Ok(more) = frame.into_trailers() {
                        match trailers.as_mut() {
                            Some(all) => {
                                for (name, value) in &more {
                                    if all.try_append(name, value.clone()).is_err() {
                                        return Read::Failed;
                                    }
                                }
                            }
                            None => trailers = Some(more),
                        }
                    }
                }
            },
        }
    }
    let data = match chunks.len() {
        0 => Bytes::new(),
        1 => chunks.into_iter().next().unwrap_or_default(),
        _ => {
            let mut whole = BytesMut::with_capacity(len);
            for chunk in &chunks {
                whole.extend_from_slice(chunk);
            }
            whole.freeze()
        }
    };
    Read::Whole(data, trailers)
}

/// The `grpc-status` in `headers`, if it has one that reads as a gRPC client reads it: ASCII
/// digits alone.
fn status_in(headers: &HeaderMap) -> Option<u32> {
    headers
        .get(&GRPC_STATUS)
        .map(HeaderValue::as_bytes)
        .filter(|v| !v.is_empty() && v.len() <= 9 && v.iter().all(u8::is_ascii_digit))
        .and_then(|v| std::str::from_utf8(v).ok())
        .and_then(|v| v.parse().ok())
}

/// Records a gRPC handler's answer (or releases the record) and returns what the client gets.
/// The answer is read whole before the client gets any of it: only its trailers say what it is.
/// An answer that is not gRPC (another HTTP status, another content type: the router's own `404`,
/// say) is recorded as an HTTP one.
pub(crate) async fn record<St: IdempotencyStore>(
    http: &LayerSettings,
    grpc: &GrpcSettings,
    mut lease: Lease<St>,
    response: Response<Body>,
) -> Response<Body> {
    if response.status() != StatusCode::OK || !is_grpc(response.headers()) {
        return recording::record(http, lease, response).await;
    }
    let (mut parts, body) = response.into_parts();
    let said = parts.extensions.remove::<Disposition>();
    let said = disposition_in(&mut parts.headers).or(said);
    // From here on the effect may have happened: should this be cut short, the record is the
    // answer's loss, never a release.
    let lost = not_recorded();
    lease.answered(&lost);
    let deadline = lease.deadline();
    let read = match tokio::time::timeout_at(deadline, read(body, http.response_limit)).await {
        Ok(read) => read,
        Err(_) => {
            tracing::warn!(
                "the gRPC answer was still streaming at the maximum hold; cut, and recorded as \
                 a timeout"
            );
            lease.timed_out();
            let timeout = Arc::new(handler_timeout());
            let answer = replay::fresh(&timeout);
            let completed = lease.complete(timeout).await;
            return recording::unrecorded(http, completed).unwrap_or(answer);
        }
    };
    let (data, mut trailers) = match read {
        Read::Whole(data, trailers) => (data, trailers),
        Read::Over(ready, rest) => {
            if said == Some(Disposition::Release) {
                // The handler asked for a retry: nothing to record.
                lease.release("the handler asks for a retry").await;
            } else {
                // The client gets the answer as it is, after the record of its loss; a retry
                // gets that record.
                tracing::warn!(
                    error = NOT_RECORDED,
                    "a gRPC answer over the response limit, recorded without it"
                );
                let completed = lease.complete(Arc::new(lost)).await;
                if let Some(instead) = recording::unrecorded(http, completed) {
                    return instead;
                }
            }
            let ready = futures_util::stream::iter(
                ready
                    .into_iter()
                    .map(|chunk| Ok::<_, axum::Error>(Frame::data(chunk))),
            );
            let rest = http_body_util::BodyStream::new(rest);
            let body = Body::new(http_body_util::StreamBody::new(
                futures_util::StreamExt::chain(ready, rest),
            ));
            return Response::from_parts(parts, body);
        }
        Read::Failed => {
            // The client would get a broken stream: it gets what the retry will, the record.
            tracing::warn!(
                error = NOT_RECORDED,
                "a gRPC answer whose stream failed, recorded without it"
            );
            let lost = Arc::new(lost);
            let answer = replay::fresh(&lost);
            let completed = lease.complete(lost).await;
            return recording::unrecorded(http, completed).unwrap_or(answer);
        }
    };
    // A fresh answer never says it is a replay, in its trailers either.
    if let Some(trailers) = trailers.as_mut() {
        trailers.remove(&http.replay_header);
        trailers.remove(&crate::header::IDEMPOTENT_REPLAYED);
        trailers.remove(&crate::header::IDEMPOTENCY_REPLAY);
    }
    let said = trailers.as_mut().and_then(disposition_in).or(said);
    let in_trailers = trailers.as_ref().and_then(status_in);
    let in_headers = status_in(&parts.headers);
    let disposition = match (said, in_trailers, in_headers) {
        (Some(said), _, _) => said,
        // Two statuses that differ: a client reads the headers' and stops there; what it was
        // is not clear, and it may have taken effect: recorded, never released.
        (None, Some(a), Some(b)) if a != b => Disposition::Fail,
        (None, Some(status), _) | (None, None, Some(status)) => grpc.disposition(status),
        // No status at all: a broken answer, which may have taken effect.
        (None, None, None) => Disposition::Fail,
    };
    let body = |data: Bytes, trailers: Option<HeaderMap>| match trailers {
        Some(trailers) => with_trailer_frame(data, trailers),
        None => Body::from(data),
    };
    let outcome = match disposition {
        Disposition::Release => {
            lease.release("the gRPC status asks for a retry").await;
            return Response::from_parts(parts, body(data, trailers));
        }
        Disposition::Complete => Finished::Completed,
        Disposition::Fail => Finished::Failed,
    };
    let mut stored = replay::capture(
        outcome,
        parts.status,
        &parts.headers,
        &http.stored_headers,
        Some(data.clone()),
    );
    if let Some(trailers) = &trailers {
        keep_trailers(&mut stored, trailers, &http.stored_headers);
    }
    if http.expiry_header {
        replay::mark_expiry(&mut parts.headers, lease.engine().settings().retention);
    }
    let completed = lease.complete(Arc::new(stored)).await;
    if let Some(instead) = recording::unrecorded(http, completed) {
        return instead;
    }
    Response::from_parts(parts, body(data, trailers))
}

/// Keeps `trailers` on the allow-list in the record's headers, each under [`TRAILER_PREFIX`].
fn keep_trailers(stored: &mut StoredResponse, trailers: &HeaderMap, allowed: &[HeaderName]) {
    for (name, value) in trailers {
        if !allowed.contains(name) || super::header_policy::is_denied(name) {
            continue;
        }
        let kept = format!("{TRAILER_PREFIX}{}", name.as_str());
        if let Ok(kept) = HeaderName::try_from(kept) {
            stored.headers.push((kept, value.clone()));
        }
    }
}

/// `grpc-message` encoding: bytes outside printable ASCII, and `%`, as `%XX`.
fn percent_encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for byte in text.bytes() {
        if (0x20..=0x7e).contains(&byte) && byte != b'%' {
            out.push(char::from(byte));
        } else {
            const DIGITS: &[u8; 16] = b"0123456789ABCDEF";
            out.push('%');
            out.push(char::from(DIGITS[usize::from(byte >> 4)]));
            out.push(char::from(DIGITS[usize::from(byte & 15)]));
        }
    }
    out
}

/// Base64 without padding, as gRPC sends binary metadata.
fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        let digits = chunk.len() + 1;
        for i in 0..digits {
            let index = (n >> (18 - 6 * i)) & 0x3f;
            out.push(char::from(ALPHABET[index as usize]));
        }
    }
    out
}

/// The few protobuf fields of a `google.rpc.Status` the layer writes.
mod proto {
    fn varint(out: &mut Vec<u8>, mut value: u64) {
        while value >= 0x80 {
            out.push((value as u8 & 0x7f) | 0x80);
            value >>= 7;
        }
        out.push(value as u8);
    }

    /// A length-delimited field (wire type 2).
    pub(super) fn bytes(out: &mut Vec<u8>, field: u32, value: &[u8]) {
        varint(out, u64::from(field << 3 | 2));
        varint(out, value.len() as u64);
        out.extend_from_slice(value);
    }

    /// A varint field (wire type 0); nothing for 0, as proto3 writes it.
    pub(super) fn uint(out: &mut Vec<u8>, field: u32, value: u64) {
        if value != 0 {
            varint(out, u64::from(field << 3));
            varint(out, value);
        }
    }
}

/// `google.rpc.Status { code, message, details: [ErrorInfo { reason, domain, metadata:
/// {instance} }, RetryInfo { retry_delay }] }`, the second detail only when retryable.
fn status_details(
    status: u32,
    message: &str,
    reason: &str,
    instance: &str,
    retry_after: Option<u32>,
) -> Vec<u8> {
    let mut info = Vec::new();
    proto::bytes(&mut info, 1, reason.as_bytes());
    proto::bytes(&mut info, 2, env!("CARGO_PKG_NAME").as_bytes());
    let mut entry = Vec::new();
    proto::bytes(&mut entry, 1, b"instance");
    proto::bytes(&mut entry, 2, instance.as_bytes());
    proto::bytes(&mut info, 3, &entry);
    let mut out = Vec::new();
    proto::uint(&mut out, 1, u64::from(status));
    proto::bytes(&mut out, 2, message.as_bytes());
    let mut any = Vec::new();
    proto::bytes(
        &mut any,
        1,
        b"type.googleapis.com/google.rpc.ErrorInfo".as_slice(),
    );
    proto::bytes(&mut any, 2, &info);
    proto::bytes(&mut out, 3, &any);
    if let Some(secs) = retry_after {
        let mut duration = Vec::new();
        proto::uint(&mut duration, 1, u64::from(secs));
        let mut retry = Vec::new();
        proto::bytes(&mut retry, 1, &duration);
        let mut any = Vec::new();
        proto::bytes(
            &mut any,
            1,
            b"type.googleapis.com/google.rpc.RetryInfo".as_slice(),
        );
        proto::bytes(&mut any, 2, &retry);
        proto::bytes(&mut out, 3, &any);
    }
    out
}

#[cfg(test)]
mod tests;
