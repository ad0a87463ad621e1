//! The layer's own error responses, as `application/problem+json` (RFC 9457).

use axum::body::Body;
use http::{HeaderValue, Response, StatusCode, header};

/// Every error the layer answers with, by its stable machine code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// `400`: the route requires an `Idempotency-Key` and the request has none.
    MissingIdempotencyKey,
    /// `400`: the `Idempotency-Key` header is malformed or repeated.
    InvalidIdempotencyKey,
    /// `400`: the request body could not be read to its end.
    UnreadableBody,
    /// `401`: no authenticated subject and anonymous scope is not enabled.
    MissingSubject,
    /// `413`: the request body is over the layer's limit.
    RequestTooLarge,
    /// `422`: the key was already used for a request with another fingerprint.
    IdempotencyKeyReuse,
    /// `409`: a request with this key is still being processed.
    InProgress,
    /// `503`: the store could not be reached or failed.
    StoreUnavailable,
    /// `503`: the layer is running as many requests on tasks of their own as it may
    /// ([`max_running`](crate::IdempotencyLayerBuilder::max_running)); nothing was claimed.
    Overloaded,
    /// `504`: the handler was still running at the maximum hold
    /// ([`max_hold`](crate::IdempotencyLayerBuilder::max_hold)) and was cancelled. Recorded and
    /// replayed for the key (its effect may have happened), except on the transactional path, where
    /// it was rolled back and the key released.
    HandlerTimeout,
    /// `500`: the handler panicked or its task was cancelled; the record was released.
    InternalError,
}

impl ErrorKind {
    /// The stable `error` field.
    pub fn code(self) -> &'static str {
        match self {
            ErrorKind::MissingIdempotencyKey => "missing_idempotency_key",
            ErrorKind::InvalidIdempotencyKey => "invalid_idempotency_key",
            ErrorKind::UnreadableBody => "unreadable_request_body",
            ErrorKind::MissingSubject => "missing_subject",
            ErrorKind::RequestTooLarge => "request_too_large",
            ErrorKind::IdempotencyKeyReuse => "idempotency_key_reuse",
            ErrorKind::InProgress => "in_progress",
            ErrorKind::StoreUnavailable => "idempotency_store_unavailable",
            ErrorKind::InternalError => "internal_error",
            ErrorKind::Overloaded => "idempotency_overloaded",
            ErrorKind::HandlerTimeout => "idempotency_handler_timeout",
        }
    }

    /// The HTTP status.
    pub fn status(self) -> StatusCode {
        match self {
            ErrorKind::MissingIdempotencyKey
            | ErrorKind::InvalidIdempotencyKey
            | ErrorKind::UnreadableBody => StatusCode::BAD_REQUEST,
            ErrorKind::MissingSubject => StatusCode::UNAUTHORIZED,
            ErrorKind::RequestTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ErrorKind::IdempotencyKeyReuse => StatusCode::UNPROCESSABLE_ENTITY,
            ErrorKind::InProgress => StatusCode::CONFLICT,
            ErrorKind::StoreUnavailable | ErrorKind::Overloaded => StatusCode::SERVICE_UNAVAILABLE,
            ErrorKind::HandlerTimeout => StatusCode::GATEWAY_TIMEOUT,
            ErrorKind::InternalError => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    fn title(self) -> &'static str {
        match self {
            ErrorKind::MissingIdempotencyKey => "Idempotency-Key header required",
            ErrorKind::InvalidIdempotencyKey => "Invalid Idempotency-Key header",
            ErrorKind::UnreadableBody => "Request body could not be read",
            ErrorKind::MissingSubject => "Authentication required",
            ErrorKind::RequestTooLarge => "Request body too large",
            ErrorKind::IdempotencyKeyReuse => "Idempotency-Key reused for a different request",
            ErrorKind::InProgress => "Request with this Idempotency-Key is in progress",
            ErrorKind::StoreUnavailable => "Idempotency store unavailable",
            ErrorKind::InternalError => "Internal error",
            ErrorKind::Overloaded => "Too many idempotent requests running",
            ErrorKind::HandlerTimeout => "The operation did not finish in time",
        }
    }
}

/// The problem details response for `kind`. With `retry_after`, the response carries a `Retry-After`
/// header, and for `in_progress` a `retryAfterSeconds` member.
pub fn problem(kind: ErrorKind, detail: &str, retry_after: Option<u32>) -> Response<Body> {
    let mut response = Response::new(Body::from(problem_body(kind, detail, retry_after)));
    *response.status_mut() = kind.status();
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
    if let Some(secs) = retry_after {
        headers.insert(header::RETRY_AFTER, HeaderValue::from(secs));
    }
    response
}

/// The media type of the layer's error answers.
pub(crate) const PROBLEM_JSON: &str = "application/problem+json";

/// The problem details document for `kind`, as [`problem`] sends it.
pub(crate) fn problem_body(kind: ErrorKind, detail: &str, retry_after: Option<u32>) -> String {
    let mut body = serde_json::json!({
        "type": format!("urn:axum-idempotency:error:{}", kind.code()),
        "title": kind.title(),
        "status": kind.status().as_u16(),
        "detail": detail,
        "error": kind.code(),
    });
    if let (ErrorKind::InProgress, Some(secs), Some(map)) =
        (kind, retry_after, body.as_object_mut())
    {
        map.insert("retryAfterSeconds".into(), secs.into());
    }
    body.to_string()
}
