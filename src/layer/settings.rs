//! The layer's own settings (what the engine does not need to know: HTTP), and their defaults.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::request::Parts;
use http::{HeaderName, Method, StatusCode};

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
    pub(crate) methods: Vec<Method>,
    pub(crate) stored_headers: Vec<HeaderName>,
    pub(crate) policy: Arc<PolicyFn>,
    pub(crate) subject: Arc<dyn SubjectExtractor>,
    pub(crate) allow_anonymous: bool,
    pub(crate) endpoint: Arc<EndpointFn>,
    pub(crate) replay_header: HeaderName,
    pub(crate) fingerprint: FingerprintRule,
    /// Where the `type` URIs of the layer's errors point, and who renders them.
    pub(crate) problems: ProblemTypes,
    /// The shortest `Idempotency-Key` accepted.
    pub(crate) min_key_length: usize,
    /// The hook on replays.
    pub(crate) on_replay: Option<Arc<ReplayFn>>,
    /// Whether answers carry the expiry header.
    pub(crate) expiry_header: bool,
    /// The request headers that count as credentials: a request with one of them and no subject
    /// is refused, never put in the shared anonymous scope.
    pub(crate) credential_headers: Vec<HeaderName>,
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
            methods: vec![Method::POST, Method::PATCH],
            stored_headers: DEFAULT_STORED_HEADERS.to_vec(),
            policy: Arc::new(default_policy),
            subject: Arc::new(SubjectExtension),
            allow_anonymous: false,
            endpoint: Arc::new(default_endpoint),
            replay_header: crate::header::IDEMPOTENT_REPLAYED,
            fingerprint: FingerprintRule::Canonical(Arc::new([])),
            problems: ProblemTypes::default(),
            min_key_length: 1,
            on_replay: None,
            expiry_header: true,
            credential_headers: vec![http::header::AUTHORIZATION, http::header::COOKIE],
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
