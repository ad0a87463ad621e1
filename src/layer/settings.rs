//! The layer's own settings (what the engine does not need to know: HTTP), and their defaults.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::request::Parts;
use http::{HeaderName, Method, StatusCode};

use super::header_policy;
use super::policy::{Disposition, default_policy};
use super::problem::ProblemTypes;
use super::subject::{SubjectExtension, SubjectExtractor};
use crate::engine::ConfigError;
use crate::fingerprint::json_pointer::Pointer;
use crate::store::{Fingerprint, StoredResponse};

/// Response headers recorded by default.
pub(crate) const DEFAULT_STORED_HEADERS: [HeaderName; 5] = [
    http::header::CONTENT_TYPE,
    http::header::LOCATION,
    http::header::CONTENT_LANGUAGE,
    http::header::ETAG,
    http::header::CACHE_CONTROL,
];

/// The largest `body_limit` and `response_limit`: 64 MiB (the layer buffers a whole request body
/// to fingerprint it, and every store must take a recorded body in one statement).
pub(crate) const MAX_BODY_LIMIT: usize = 64 * 1024 * 1024;

pub(crate) type PolicyFn = dyn Fn(StatusCode) -> Disposition + Send + Sync;
pub(crate) type EndpointFn = dyn Fn(&Parts) -> String + Send + Sync;
pub(crate) type FingerprintFn = dyn Fn(&Parts, &[u8]) -> Fingerprint + Send + Sync;
pub(crate) type ReplayFn =
    dyn Fn(&http::Request<axum::body::Body>, &StoredResponse, &mut http::HeaderMap) + Send + Sync;
pub(crate) type ReplayCheckFn = dyn Fn(
        &Parts,
        &crate::ReplayInfo<'_>,
    ) -> futures_util::future::BoxFuture<'static, Option<http::Response<axum::body::Body>>>
    + Send
    + Sync;

/// How a request's fingerprint is computed.
#[derive(Clone)]
pub(crate) enum FingerprintRule {
    /// The whole canonical body and the query, less the fields these pointers name.
    Canonical(Arc<[Pointer]>),
    /// The application's own function.
    Custom(Arc<FingerprintFn>),
}

impl FingerprintRule {
    pub(crate) fn of(&self, parts: &Parts, body: &[u8]) -> Fingerprint {
        match self {
            FingerprintRule::Canonical(ignored) => {
                Fingerprint::of_selected(parts.uri.query(), body, ignored)
            }
            FingerprintRule::Custom(f) => f(parts, body),
        }
    }
}

/// The layer's own settings, validated by the builder.
pub(crate) struct LayerSettings {
    pub(crate) retry_after_secs: u32,
    pub(crate) body_limit: usize,
    /// The longest the request body may take to arrive.
    pub(crate) body_timeout: Duration,
    pub(crate) response_limit: usize,
    pub(crate) require_key: bool,
    /// Where the key is found.
    pub(crate) key_source: super::key::KeySource,
    /// Whether the engine keeps tombstones (so `410 idempotency_key_expired` may be answered).
    pub(crate) tombstones: bool,
    /// Places for bodies read before admission (a key in the body): as many as the requests the
    /// instance runs (`max_running`); a request waits for one, so that the bodies buffered at once
    /// are bounded even for requests that turn out to hold no key.
    pub(crate) body_reads: Arc<tokio::sync::Semaphore>,
    pub(crate) methods: Vec<Method>,
    pub(crate) stored_headers: Vec<HeaderName>,
    pub(crate) policy: Arc<PolicyFn>,
    pub(crate) subject: Arc<dyn SubjectExtractor>,
    pub(crate) allow_anonymous: bool,
    /// What tells anonymous callers apart for their shares of the instance (not for their
    /// records, which they share): `None`, one share for them all.
    pub(crate) anonymous_shares: Option<Arc<dyn SubjectExtractor>>,
    pub(crate) endpoint: Arc<EndpointFn>,
    pub(crate) replay_header: HeaderName,
    pub(crate) fingerprint: FingerprintRule,
    /// Where the `type` URIs of the layer's errors point, and who renders them.
    pub(crate) problems: ProblemTypes,
    /// The shortest `Idempotency-Key` accepted.
    pub(crate) min_key_length: usize,
    /// The hook on replays.
    pub(crate) on_replay: Option<Arc<ReplayFn>>,
    /// The check run before a replay is sent, which may refuse it.
    pub(crate) replay_check: Option<Arc<ReplayCheckFn>>,
    /// Whether a response marked `Cache-Control: no-store` is released rather than recorded.
    pub(crate) release_no_store: bool,
    /// Whether axum's extractor rejections release the key (the default) rather than follow the
    /// status policy.
    pub(crate) release_rejections: bool,
    /// Whether answers carry the expiry header.
    pub(crate) expiry_header: bool,
    /// The request headers that count as credentials: a request with one of them and no subject
    /// is refused, never put in the shared anonymous scope.
    pub(crate) credential_headers: Vec<HeaderName>,
    /// The gRPC mode: which calls are guarded, the status policy.
    #[cfg(feature = "grpc")]
    pub(crate) grpc: Option<Arc<super::grpc::GrpcSettings>>,
}

impl fmt::Debug for LayerSettings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The settings an operator reads; functions are left out.
        f.debug_struct("LayerSettings")
            .field("retry_after_secs", &self.retry_after_secs)
            .field("body_limit", &self.body_limit)
            .field("body_timeout", &self.body_timeout)
            .field("response_limit", &self.response_limit)
            .field("require_key", &self.require_key)
            .field("methods", &self.methods)
            .field("stored_headers", &self.stored_headers)
            .field("allow_anonymous", &self.allow_anonymous)
            .field("replay_header", &self.replay_header)
            .field("min_key_length", &self.min_key_length)
            .field("expiry_header", &self.expiry_header)
            .field("release_no_store", &self.release_no_store)
            .field("release_rejections", &self.release_rejections)
            .finish_non_exhaustive()
    }
}

impl LayerSettings {
    /// One of the layer's error answers (see [`ErrorKind`](crate::ErrorKind)).
    pub(crate) fn problem(
        &self,
        kind: crate::ErrorKind,
        detail: &str,
        retry_after: Option<u32>,
    ) -> http::Response<axum::body::Body> {
        self.problems.problem(kind, detail, retry_after)
    }

    /// A retryable error answer, with the layer's `Retry-After`.
    pub(crate) fn retryable(
        &self,
        kind: crate::ErrorKind,
        detail: &str,
    ) -> http::Response<axum::body::Body> {
        self.problems
            .problem(kind, detail, Some(self.retry_after_secs))
    }
}

impl LayerSettings {
    /// The checks of the layer's own settings (the engine checks its own).
    pub(crate) fn check(&self) -> Result<(), ConfigError> {
        if self.retry_after_secs == 0 {
            return Err(ConfigError::new("retry_after_secs", "must be at least 1"));
        }
        if self.body_limit == 0 || self.body_limit > MAX_BODY_LIMIT {
            return Err(ConfigError::new(
                "body_limit",
                "must be from 1 byte to 64 MiB",
            ));
        }
        if self.body_timeout < Duration::from_millis(100)
            || self.body_timeout > Duration::from_secs(600)
        {
            return Err(ConfigError::new(
                "body_timeout",
                "must be from 100 ms to 10 minutes",
            ));
        }
        if self.min_key_length == 0 || self.min_key_length > super::key::MAX_KEY_LEN {
            return Err(ConfigError::new("min_key_length", "must be from 1 to 255"));
        }
        if self.response_limit == 0 || self.response_limit > MAX_BODY_LIMIT {
            return Err(ConfigError::new(
                "response_limit",
                "must be from 1 byte to 64 MiB",
            ));
        }
        if self.methods.is_empty() {
            return Err(ConfigError::new(
                "methods",
                "at least one method must be guarded",
            ));
        }
        if let Some(safe) = self.methods.iter().find(|m| m.is_safe()) {
            return Err(ConfigError::new(
                "methods",
                format!("{safe} is a safe method and cannot be guarded"),
            ));
        }
        Ok(())
    }
}

impl Default for LayerSettings {
    fn default() -> Self {
        LayerSettings {
            retry_after_secs: 2,
            body_limit: 1024 * 1024,
            body_timeout: Duration::from_secs(10),
            response_limit: 1024 * 1024,
            require_key: false,
            key_source: super::key::KeySource::default(),
            tombstones: false,
            body_reads: Arc::new(tokio::sync::Semaphore::new(1024)),
            methods: vec![Method::POST, Method::PATCH],
            stored_headers: DEFAULT_STORED_HEADERS.to_vec(),
            policy: Arc::new(default_policy),
            subject: Arc::new(SubjectExtension),
            allow_anonymous: false,
            anonymous_shares: None,
            endpoint: Arc::new(default_endpoint),
            replay_header: crate::header::IDEMPOTENT_REPLAYED,
            fingerprint: FingerprintRule::Canonical(Arc::new([])),
            problems: ProblemTypes::default(),
            min_key_length: 1,
            on_replay: None,
            replay_check: None,
            release_no_store: false,
            release_rejections: true,
            expiry_header: true,
            credential_headers: vec![http::header::AUTHORIZATION],
            #[cfg(feature = "grpc")]
            grpc: None,
        }
    }
}

/// `METHOD /path` of the request as the client sent it (before any `Router::nest` stripped a prefix),
/// without the query.
pub(crate) fn default_endpoint(parts: &Parts) -> String {
    let path = parts
        .extensions
        .get::<axum::extract::OriginalUri>()
        .map_or_else(|| parts.uri.path(), |original| original.0.path());
    let method = parts.method.as_str();
    let mut endpoint = String::with_capacity(method.len() + 1 + path.len());
    endpoint.push_str(method);
    endpoint.push(' ');
    endpoint.push_str(path);
    endpoint
}

impl LayerSettings {
    /// The settings of a gRPC layer: its checks, the status, message and encoding recorded, its
    /// fingerprint, its answers as gRPC statuses.
    #[cfg(feature = "grpc")]
    pub(crate) fn grpc_mode(
        &mut self,
        grpc: Arc<super::grpc::GrpcSettings>,
    ) -> Result<(), ConfigError> {
        grpc.check()?;
        if matches!(self.key_source, super::key::KeySource::Body(..)) {
            return Err(ConfigError::new(
                "key_from_body",
                "reads a JSON body, which a gRPC call has not: the key is the idempotency-key \
                 metadata",
            ));
        }
        if !self.methods.contains(&Method::POST) {
            return Err(ConfigError::new(
                "grpc",
                "gRPC calls are POST requests: POST must be among the methods guarded",
            ));
        }
        match &self.fingerprint {
            FingerprintRule::Canonical(ignored) if !ignored.is_empty() => {
                return Err(ConfigError::new(
                    "fingerprint_ignore",
                    "names JSON fields, which a gRPC message has none of",
                ));
            }
            FingerprintRule::Canonical(_) => {
                self.fingerprint = FingerprintRule::Custom(Arc::new(super::grpc::fingerprint));
            }
            FingerprintRule::Custom(_) => {}
        }
        for name in super::grpc::GRPC_HEADERS {
            if !self.stored_headers.contains(&name) {
                self.stored_headers.push(name);
            }
        }
        self.problems = self.problems.clone().grpc();
        Ok(())
    }
}

/// What the builder takes as given and checks only when the layer is built: names that must be
/// header names, JSON pointers, a URI.
pub(crate) struct Unchecked {
    pub(crate) problem_type_base: Option<String>,
    pub(crate) extra_headers: Vec<String>,
    pub(crate) replay_header_name: Option<String>,
    pub(crate) ignored_fields: Vec<String>,
    pub(crate) credential_headers: Option<Vec<String>>,
    pub(crate) key_source: Option<super::key::KeySpec>,
}

impl LayerSettings {
    /// The settings with `unchecked` applied, once every part is valid: what `build()` makes.
    pub(crate) fn finished(mut self, unchecked: Unchecked) -> Result<Self, ConfigError> {
        self.check()?;
        if let Some(source) = unchecked.key_source {
            self.key_source = source.checked()?;
        }
        if let Some(base) = unchecked.problem_type_base {
            let absolute = http::Uri::try_from(base.as_str()).is_ok_and(|uri| {
                matches!(uri.scheme_str(), Some("http" | "https")) && uri.authority().is_some()
            });
            if !absolute {
                return Err(ConfigError::new(
                    "problem_type_base",
                    format!("{base:?} is not an absolute http(s) URI"),
                ));
            }
            self.problems = self.problems.clone().with_base(&base);
        }
        for name in unchecked.extra_headers {
            let header = HeaderName::try_from(name.as_str()).map_err(|_| {
                ConfigError::new(
                    "store_header",
                    format!("{name:?} is not a valid header name"),
                )
            })?;
            if header_policy::is_denied(&header) {
                return Err(ConfigError::new(
                    "store_header",
                    format!(
                        "{header} is never stored: it carries credentials or belongs to one \
                         transfer"
                    ),
                ));
            }
            if !self.stored_headers.contains(&header) {
                self.stored_headers.push(header);
            }
        }
        if let Some(name) = unchecked.replay_header_name {
            let header = HeaderName::try_from(name.as_str()).map_err(|_| {
                ConfigError::new(
                    "replay_header",
                    format!("{name:?} is not a valid header name"),
                )
            })?;
            if header != crate::header::IDEMPOTENT_REPLAYED && header_policy::is_denied(&header) {
                return Err(ConfigError::new(
                    "replay_header",
                    format!(
                        "{header} cannot mark replays: the layer or HTTP gives it another meaning"
                    ),
                ));
            }
            self.replay_header = header;
        }
        if !unchecked.ignored_fields.is_empty() {
            if matches!(self.fingerprint, FingerprintRule::Custom(_)) {
                return Err(ConfigError::new(
                    "fingerprint_ignore",
                    "cannot be used together with fingerprint_fn",
                ));
            }
            let pointers = unchecked
                .ignored_fields
                .iter()
                .map(|p| Pointer::parse(p))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| ConfigError::new("fingerprint_ignore", e))?;
            self.fingerprint = FingerprintRule::Canonical(pointers.into());
        }
        if let Some(names) = unchecked.credential_headers {
            self.credential_headers = names
                .iter()
                .map(|name| {
                    HeaderName::try_from(name.as_str()).map_err(|_| {
                        ConfigError::new(
                            "credential_headers",
                            format!("{name:?} is not a valid header name"),
                        )
                    })
                })
                .collect::<Result<_, _>>()?;
        }
        #[cfg(feature = "grpc")]
        if let Some(grpc) = &self.grpc {
            self.grpc_mode(grpc.clone())?;
        }
        if self.stored_headers.contains(&self.replay_header) {
            return Err(ConfigError::new(
                "replay_header",
                format!(
                    "{} cannot both mark replays and be recorded",
                    self.replay_header
                ),
            ));
        }
        Ok(self)
    }
}
