//! The layer's own error responses, as `application/problem+json` (RFC 9457).

use axum::body::Body;
use http::{HeaderValue, Response, StatusCode, header};

/// Declares [`ErrorKind`] from one table: each variant with its status, its stable code, its
/// title and whether an answer of it can be retryable; every method below reads that table.
macro_rules! error_kinds {
    (
        $(#[$meta:meta])*
        pub enum ErrorKind {
            $(
                $(#[$doc:meta])*
                $variant:ident {
                    status: $status:ident,
                    code: $code:literal,
                    title: $title:literal,
                    may_retry: $retry:literal,
                },
            )*
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        #[non_exhaustive]
        pub enum ErrorKind {
            $( $(#[$doc])* $variant, )*
        }

        impl ErrorKind {
            /// The stable `error` field.
            pub fn code(self) -> &'static str {
                match self {
                    $( ErrorKind::$variant => $code, )*
                }
            }

            /// The HTTP status.
            pub fn status(self) -> StatusCode {
                match self {
                    $( ErrorKind::$variant => StatusCode::$status, )*
                }
            }

            /// The name of the variant, as docs.rs anchors it.
            fn variant(self) -> &'static str {
                match self {
                    $( ErrorKind::$variant => stringify!($variant), )*
                }
            }

            /// Every kind, in a fixed order.
            pub const ALL: [ErrorKind; [$( stringify!($variant) ),*].len()] =
                [$( ErrorKind::$variant ),*];

            /// Whether an answer of this kind can be retryable, and so carry `Retry-After`.
            #[cfg(feature = "openapi")]
            pub(crate) fn may_retry(self) -> bool {
                match self {
                    $( ErrorKind::$variant => $retry, )*
                }
            }

            /// The problem's `title`.
            pub(crate) fn title(self) -> &'static str {
                match self {
                    $( ErrorKind::$variant => $title, )*
                }
            }
        }
    };
}

error_kinds! {
    /// Every error the layer answers with, by its stable machine code.
    ///
    /// Each answer is `application/problem+json` (RFC 9457) with these members:
    ///
    /// | member | meaning |
    /// |---|---|
    /// | `type` | an absolute URI documenting the error: by default this page, at the variant's anchor (`…/enum.ErrorKind.html#variant.InProgress`); with [`problem_type_base`](crate::IdempotencyLayerBuilder::problem_type_base), the base followed by the `error` code |
    /// | `title`, `status`, `detail` | as RFC 9457 defines them |
    /// | `error` | the stable code, e.g. `in_progress` |
    /// | `instance` | `urn:uuid:<version 4 UUID>`, unique to this occurrence; the layer logs it with the answer (at WARN for 5xx, DEBUG otherwise), so a client's report can be matched to the server's log |
    /// | `retryable` | whether sending **the same request with the same key** again can succeed; when true the answer also has `Retry-After` (seconds) |
    /// | `retryAfterSeconds` | on `in_progress` only: the `Retry-After` value |
    ///
    /// **The client contract.** When `retryable` is true, retry the same request with the same
    /// `Idempotency-Key` after `Retry-After` seconds (with backoff and a bound): it is never run twice.
    /// When false, do not retry as is: fix the request (the 400s, 401, 413), use the key only for
    /// the request it was first used for (422), or treat the answer as final (a replayed 504). A new
    /// key is a new operation: use one only for a new operation, never to get past an error of an
    /// operation that may have happened.
    pub enum ErrorKind {
        /// `400 missing_idempotency_key`: the route requires an `Idempotency-Key` and the request has
        /// none. Not retryable: send a key (a new one for a new operation).
        MissingIdempotencyKey {
            status: BAD_REQUEST,
            code: "missing_idempotency_key",
            title: "Idempotency-Key header required",
            may_retry: false,
        },
        /// `400 invalid_idempotency_key`: the `Idempotency-Key` header is empty, too long, not visible
        /// ASCII, badly quoted or repeated. Not retryable: send one valid key.
        InvalidIdempotencyKey {
            status: BAD_REQUEST,
            code: "invalid_idempotency_key",
            title: "Invalid Idempotency-Key header",
            may_retry: false,
        },
        /// `400 unreadable_request_body`: the request body could not be read to its end; nothing was
        /// claimed. Not retryable as is: the client sent an incomplete body; send it whole.
        UnreadableBody {
            status: BAD_REQUEST,
            code: "unreadable_request_body",
            title: "Request body could not be read",
            may_retry: false,
        },
        /// `401 missing_subject`: no authenticated subject, and anonymous scope is not enabled. Not
        /// retryable: authenticate first.
        MissingSubject {
            status: UNAUTHORIZED,
            code: "missing_subject",
            title: "Authentication required",
            may_retry: false,
        },
        /// `413 request_too_large`: the request body is over the layer's limit, or over one set
        /// outside the layer (such as tower-http's `RequestBodyLimitLayer`) that cut it while the
        /// layer read it; nothing was claimed and nothing ran. Not retryable: send a smaller body.
        RequestTooLarge {
            status: PAYLOAD_TOO_LARGE,
            code: "request_too_large",
            title: "Request body too large",
            may_retry: false,
        },
        /// `400 subject_too_long`: the authenticated subject is longer than 1024 bytes; nothing was
        /// claimed. Not retryable: the application's authentication gives subjects the layer does
        /// not take.
        SubjectTooLong {
            status: BAD_REQUEST,
            code: "subject_too_long",
            title: "Subject too long",
            may_retry: false,
        },
        /// `414 endpoint_too_long`: the request's method and path are longer than 4096 bytes; nothing
        /// was claimed. Not retryable: use a shorter path.
        EndpointTooLong {
            status: URI_TOO_LONG,
            code: "endpoint_too_long",
            title: "Request path too long",
            may_retry: false,
        },
        /// `408 request_timeout`: the request body did not arrive within the layer's deadline
        /// ([`body_timeout`](crate::IdempotencyLayerBuilder::body_timeout)); nothing was claimed.
        /// Retryable: send the same request, with the same key, again.
        RequestTimeout {
            status: REQUEST_TIMEOUT,
            code: "request_timeout",
            title: "Request body too slow",
            may_retry: true,
        },
        /// `422 idempotency_key_reuse`: the key was already used for a request with another
        /// fingerprint (body or query); nothing ran. Not retryable: this key belongs to the first
        /// request; a different operation needs a new key.
        KeyReuse {
            status: UNPROCESSABLE_ENTITY,
            code: "idempotency_key_reuse",
            title: "Idempotency-Key reused for a different request",
            may_retry: false,
        },
        /// `409 in_progress`: a request with this key is still being processed. Retryable: retry the
        /// same request with the same key after `Retry-After`; you get its answer once it is done.
        InProgress {
            status: CONFLICT,
            code: "in_progress",
            title: "Request with this Idempotency-Key is in progress",
            may_retry: true,
        },
        /// `503 idempotency_store_unavailable`: the store could not be reached or failed (or a
        /// record could not be decrypted); the handler did not run, or its effect was rolled back,
        /// or it ran and its answer is not recorded yet (the detail says which; an answer is never
        /// sent before its record). Retryable: same request, same key, after `Retry-After`: the
        /// retry gets the recorded answer, or runs when nothing ran.
        StoreUnavailable {
            status: SERVICE_UNAVAILABLE,
            code: "idempotency_store_unavailable",
            title: "Idempotency store unavailable",
            may_retry: true,
        },
        /// `503 idempotency_overloaded`: the instance holds as many guarded requests in flight as it
        /// may ([`max_running`](crate::IdempotencyLayerBuilder::max_running)); nothing was claimed.
        /// Retryable: same request, same key, after `Retry-After`.
        Overloaded {
            status: SERVICE_UNAVAILABLE,
            code: "idempotency_overloaded",
            title: "Too many idempotent requests running",
            may_retry: true,
        },
        /// `503 idempotency_store_full`: the store has no room for a new record (a memory store at
        /// its capacity, a Redis out of memory, a database whose disk is full); nothing ran.
        /// Retryable: same request, same key, after `Retry-After` (records expire and make room).
        StoreFull {
            status: SERVICE_UNAVAILABLE,
            code: "idempotency_store_full",
            title: "Idempotency store full",
            may_retry: true,
        },
        /// `410 idempotency_key_expired`: the key's record expired within the layer's
        /// [`tombstones`](crate::IdempotencyLayerBuilder::tombstones) time; nothing ran. Not
        /// retryable: the operation this key named was done, and its answer is gone; a new
        /// operation needs a new key.
        KeyExpired {
            status: GONE,
            code: "idempotency_key_expired",
            title: "Idempotency-Key expired",
            may_retry: false,
        },
        /// `429 idempotency_quota_exceeded`: this subject's records hold its share of the store, so
        /// no new key is taken for it until some expire; its finished records still replay. Retryable
        /// after `Retry-After`.
        QuotaExceeded {
            status: TOO_MANY_REQUESTS,
            code: "idempotency_quota_exceeded",
            title: "Share of the idempotency store used up",
            may_retry: true,
        },
        /// `504 idempotency_handler_timeout`: the handler was still running at the maximum hold
        /// ([`max_hold`](crate::IdempotencyLayerBuilder::max_hold)) and was cancelled. Its effect may
        /// have happened, so this is recorded and replayed for the key: not retryable, the answer is
        /// final for that key (find out from the service what happened). On the transactional path
        /// the effect was rolled back and the key released: then it is retryable (same key, after
        /// `Retry-After`).
        HandlerTimeout {
            status: GATEWAY_TIMEOUT,
            code: "idempotency_handler_timeout",
            title: "The operation did not finish in time",
            may_retry: true,
        },
        /// `500 internal_error`: the handler panicked, or the route is misconfigured; the record was
        /// released. Not retryable by contract: report it, with its `instance`.
        InternalError {
            status: INTERNAL_SERVER_ERROR,
            code: "internal_error",
            title: "Internal error",
            may_retry: false,
        },
    }
}

/// Where the `type` URIs of a layer's errors point.
#[derive(Clone, Default)]
pub(crate) struct ProblemTypes {
    /// The application's own base, followed by the error code; `None`: this crate's docs.
    base: Option<std::sync::Arc<str>>,
    /// The application's rendering of the layer's errors; `None`: problem+json.
    renderer: Option<std::sync::Arc<RenderFn>>,
    /// The answers are gRPC statuses (the gRPC mode), whatever renders them otherwise.
    #[cfg(feature = "grpc")]
    grpc: bool,
}

impl std::fmt::Debug for ProblemTypes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProblemTypes")
            .field("base", &self.base)
            .field("rendered", &self.renderer.is_some())
            .finish()
    }
}

/// A function rendering the layer's own error answers ([`Problem`]).
pub(crate) type RenderFn = dyn Fn(&Problem<'_>) -> Response<Body> + Send + Sync;

/// One of the layer's own error answers, as a renderer set with
/// [`render_errors`](crate::IdempotencyLayerBuilder::render_errors) sees it: what the default
/// `application/problem+json` document says, for the renderer to say its own way.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Problem<'a> {
    /// The error, with its stable code ([`ErrorKind::code`]) and status ([`ErrorKind::status`]).
    pub kind: ErrorKind,
    /// What happened, for a person.
    pub detail: &'a str,
    /// For a retryable answer, the seconds to wait before sending the same request with the same
    /// key again; `None` when it is not retryable as it is.
    pub retry_after: Option<u32>,
    /// The unique reference of this occurrence, logged with it.
    pub instance: &'a str,
    /// The `type` URI the default document gives.
    pub type_uri: &'a str,
}

impl Problem<'_> {
    /// The default answer: `application/problem+json` with `Retry-After` when retryable.
    pub fn default_response(&self) -> Response<Body> {
        let body = problem_document(
            self.type_uri,
            self.kind,
            self.detail,
            self.retry_after,
            self.instance,
        );
        let mut response = Response::new(Body::from(body));
        *response.status_mut() = self.kind.status();
        response
            .headers_mut()
            .insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        if let Some(secs) = self.retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        response
    }
}

impl ProblemTypes {
    pub(crate) fn with_base(self, base: &str) -> Self {
        ProblemTypes {
            base: Some(base.into()),
            ..self
        }
    }

    pub(crate) fn rendered_by(self, renderer: std::sync::Arc<RenderFn>) -> Self {
        ProblemTypes {
            renderer: Some(renderer),
            ..self
        }
    }

    /// The layer's errors answered as gRPC statuses.
    #[cfg(feature = "grpc")]
    pub(crate) fn grpc(self) -> Self {
        ProblemTypes { grpc: true, ..self }
    }

    /// Whether the application renders the layer's errors itself (not as problem+json).
    #[cfg(feature = "openapi")]
    pub(crate) fn is_rendered(&self) -> bool {
        self.renderer.is_some()
    }

    fn uri(&self, kind: ErrorKind) -> String {
        match &self.base {
            Some(base) => format!("{base}{}", kind.code()),
            None => format!("{DOCS}#variant.{}", kind.variant()),
        }
    }

    /// The problem details response for `kind`. With `retry_after`, the answer is retryable: it
    /// carries `Retry-After`, `retryable: true`, and for `in_progress` `retryAfterSeconds`.
    pub(crate) fn problem(
        &self,
        kind: ErrorKind,
        detail: &str,
        retry_after: Option<u32>,
    ) -> Response<Body> {
        let instance = instance();
        let type_uri = self.uri(kind);
        let problem = Problem {
            kind,
            detail,
            retry_after,
            instance: &instance,
            type_uri: &type_uri,
        };
        let response = match &self.renderer {
            #[cfg(feature = "grpc")]
            _ if self.grpc => super::grpc::status_answer(kind, detail, retry_after, &instance),
            None => problem.default_response(),
            Some(render) => {
                // A renderer that panics must not take the request down with it: the default
                // answer stands in.
                let rendered =
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| render(&problem)));
                let mut response = rendered.unwrap_or_else(|_| {
                    tracing::error!("the error renderer panicked; answered with problem+json");
                    problem.default_response()
                });
                // The retry contract is the layer's: a retryable answer keeps its status (a client
                // that retries by status must not take a 409 or a 503 for a final answer) and its
                // Retry-After.
                if retry_after.is_some() || kind.status().is_server_error() {
                    *response.status_mut() = kind.status();
                }
                if let Some(secs) = retry_after
                    && !response.headers().contains_key(header::RETRY_AFTER)
                {
                    response
                        .headers_mut()
                        .insert(header::RETRY_AFTER, HeaderValue::from(secs));
                }
                response
            }
        };
        if kind.status().is_server_error() {
            tracing::warn!(error = kind.code(), %instance, detail, "answered with a problem");
        } else {
            tracing::debug!(error = kind.code(), %instance, detail, "answered with a problem");
        }
        response
    }

    /// The problem details document for `kind`.
    pub(crate) fn body(
        &self,
        kind: ErrorKind,
        detail: &str,
        retry_after: Option<u32>,
        instance: &str,
    ) -> String {
        problem_document(&self.uri(kind), kind, detail, retry_after, instance)
    }
}

/// The problem details document.
fn problem_document(
    type_uri: &str,
    kind: ErrorKind,
    detail: &str,
    retry_after: Option<u32>,
    instance: &str,
) -> String {
    {
        let mut body = serde_json::json!({
            "type": type_uri,
            "title": kind.title(),
            "status": kind.status().as_u16(),
            "detail": detail,
            "error": kind.code(),
            "instance": instance,
            "retryable": retry_after.is_some(),
        });
        if let (ErrorKind::InProgress, Some(secs), Some(map)) =
            (kind, retry_after, body.as_object_mut())
        {
            map.insert("retryAfterSeconds".into(), secs.into());
        }
        body.to_string()
    }
}

/// The page documenting every error, by variant anchor.
const DOCS: &str = "https://docs.rs/axum-idempotency/latest/axum_idempotency/enum.ErrorKind.html";

/// A unique reference to one occurrence of a problem: `urn:uuid:<version 4 UUID>` (RFC 9562), the
/// form clients and test suites of the idempotency-key draft expect for `instance`.
pub(crate) fn instance() -> String {
    let mut bytes = crate::store::Generation::generate().0;
    // Version 4 (random) in the high nibble of byte 6, the RFC variant (0b10) in byte 8.
    bytes[6] = (bytes[6] & 0x0f) | 0x40;
    bytes[8] = (bytes[8] & 0x3f) | 0x80;
    let mut out = String::with_capacity(9 + 36);
    out.push_str("urn:uuid:");
    for (i, group) in [
        &bytes[..4],
        &bytes[4..6],
        &bytes[6..8],
        &bytes[8..10],
        &bytes[10..],
    ]
    .into_iter()
    .enumerate()
    {
        if i > 0 {
            out.push('-');
        }
        crate::util::hex::push(&mut out, group);
    }
    out
}

/// Why an extractor of this crate ([`IdempotencyContext`](crate::IdempotencyContext),
/// `IdempotencyTx`) refused a request: what kind of error it is, and the problem details answer it
/// turns into (with the layer's `Retry-After` and `type` URIs where the layer's settings reach it).
///
/// ```
/// use axum::response::IntoResponse;
/// use axum_idempotency::{ErrorKind, IdempotencyContext};
/// use axum_idempotency::layer::IdempotencyRejection;
///
/// // A handler that maps the rejection itself.
/// async fn handler(
///     context: Result<IdempotencyContext, IdempotencyRejection>,
/// ) -> axum::response::Response {
///     match context {
///         Ok(context) => context.derived_key().into_response(),
///         Err(rejection) if rejection.kind() == ErrorKind::InternalError => {
///             (axum::http::StatusCode::BAD_REQUEST, "send an Idempotency-Key").into_response()
///         }
///         Err(rejection) => rejection.into_response(),
///     }
/// }
/// # let _ = handler;
/// ```
pub struct IdempotencyRejection {
    kind: ErrorKind,
    detail: &'static str,
    response: Response<Body>,
}

impl IdempotencyRejection {
    pub(crate) fn new(
        types: &ProblemTypes,
        kind: ErrorKind,
        detail: &'static str,
        retry_after: Option<u32>,
    ) -> Self {
        IdempotencyRejection {
            kind,
            detail,
            response: types.problem(kind, detail, retry_after),
        }
    }

    /// A rejection made outside any layer's settings: `type` URIs in this crate's docs.
    pub(crate) fn plain(kind: ErrorKind, detail: &'static str) -> Self {
        Self::new(&ProblemTypes::default(), kind, detail, None)
    }

    /// What kind of error it is.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// What the answer's `detail` says.
    pub fn detail(&self) -> &str {
        self.detail
    }
}

impl std::fmt::Debug for IdempotencyRejection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyRejection")
            .field("kind", &self.kind)
            .field("detail", &self.detail)
            .finish_non_exhaustive()
    }
}

impl std::fmt::Display for IdempotencyRejection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.detail)
    }
}

impl std::error::Error for IdempotencyRejection {}

impl axum::response::IntoResponse for IdempotencyRejection {
    fn into_response(self) -> axum::response::Response {
        self.response
    }
}

/// The media type of the layer's error answers.
pub(crate) const PROBLEM_JSON: &str = "application/problem+json";

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(types: &ProblemTypes, kind: ErrorKind, retry: Option<u32>) -> serde_json::Value {
        let body = types.body(kind, "detail", retry, &instance());
        serde_json::from_str(&body).expect("json")
    }

    #[test]
    fn every_kind_has_the_members_a_client_acts_on() {
        let mut instances = std::collections::HashSet::new();
        for kind in ErrorKind::ALL {
            for retry in [None, Some(3)] {
                let json = parts(&ProblemTypes::default(), kind, retry);
                let uri = json["type"].as_str().expect("type");
                assert!(
                    uri.starts_with("https://docs.rs/axum-idempotency/"),
                    "{uri}"
                );
                assert!(
                    uri.ends_with(&format!("#variant.{}", kind.variant())),
                    "{uri}"
                );
                assert_eq!(json["status"], kind.status().as_u16());
                assert_eq!(json["error"], kind.code());
                assert_eq!(json["retryable"], retry.is_some());
                let instance = json["instance"].as_str().expect("instance").to_owned();
                let uuid = instance.strip_prefix("urn:uuid:").expect("urn:uuid");
                let groups: Vec<usize> = uuid.split('-').map(str::len).collect();
                assert_eq!(groups, [8, 4, 4, 4, 12], "{instance}");
                assert!(
                    uuid.chars()
                        .all(|c| c == '-' || c.is_ascii_digit() || ('a'..='f').contains(&c)),
                    "{instance}"
                );
                assert_eq!(&uuid[14..15], "4", "version 4: {instance}");
                assert!(
                    matches!(&uuid[19..20], "8" | "9" | "a" | "b"),
                    "variant: {instance}"
                );
                assert!(instances.insert(instance), "instances are unique");
                assert_eq!(
                    json.get("retryAfterSeconds").is_some(),
                    kind == ErrorKind::InProgress && retry.is_some()
                );
            }
        }
        let own = ProblemTypes::default().with_base("https://api.example.com/errors/");
        assert_eq!(
            parts(&own, ErrorKind::InProgress, Some(2))["type"],
            "https://api.example.com/errors/in_progress"
        );
    }

    #[test]
    fn retryable_answers_carry_retry_after() {
        let response =
            ProblemTypes::default().problem(ErrorKind::StoreUnavailable, "down", Some(4));
        assert_eq!(response.headers()[header::RETRY_AFTER], "4");
        let response = ProblemTypes::default().problem(ErrorKind::KeyReuse, "reused", None);
        assert!(response.headers().get(header::RETRY_AFTER).is_none());
    }
}
