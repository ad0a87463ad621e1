//! Per-route settings, their defaults, and the builder that validates them.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::request::Parts;
use http::{HeaderName, Method, StatusCode};

#[cfg(doc)]
use crate::IdempotencyLayerBuilder;
use crate::coalesce::LocalClaims;
use crate::drain::Drain;
use crate::fingerprint::Fingerprint;
pub use crate::header_policy::DENIED_HEADERS;
use crate::json_pointer::Pointer;
use crate::outcome::Outcome;
use crate::policy::{Disposition, default_policy};
use crate::problem::ProblemTypes;
use crate::subject::{SubjectExtension, SubjectExtractor};

/// Response headers recorded by default; [`IdempotencyLayerBuilder::store_header`] adds more.
pub const DEFAULT_STORED_HEADERS: [&str; 5] = [
    "content-type",
    "location",
    "content-language",
    "etag",
    "cache-control",
];

/// The longest in-progress TTL or retention that [`IdempotencyLayerBuilder::build`] accepts: ten
/// years. Longer ones would overflow clocks or the stores' timestamps.
pub const MAX_DURATION: Duration = Duration::from_secs(10 * 365 * 24 * 60 * 60);

/// The shortest in-progress TTL that [`IdempotencyLayerBuilder::build`] accepts. The holder renews
/// its lease every third of the TTL, and no store can promise a round trip much faster than this.
pub const MIN_IN_PROGRESS_TTL: Duration = Duration::from_millis(30);

/// The largest `response_limit` [`IdempotencyLayerBuilder::build`] accepts: 64 MiB. Every store
/// must take a recorded body in one statement within its timeout.
pub const MAX_RESPONSE_LIMIT: usize = 64 * 1024 * 1024;

/// How long a claim may be held by its handler and its body, by default: ten minutes.
pub const DEFAULT_MAX_HOLD: Duration = Duration::from_secs(10 * 60);

/// How many requests whose clients went away a layer's [`Drain`] may run on their own before new
/// guarded requests get `503 idempotency_overloaded`, by default.
pub const DEFAULT_MAX_RUNNING: usize = 1024;

/// How many times the store's operation timeout the in-progress TTL must be at least: a claim
/// answered at the end of its timeout must leave most of the TTL for the handler to prove it holds
/// the record.
pub const TTL_PER_OPERATION_TIMEOUT: u32 = 2;

/// The longest [`wait`](IdempotencyLayerBuilder::wait) a duplicate may be held for its answer.
pub const MAX_WAIT: Duration = Duration::from_secs(5);

/// How many duplicates may wait on one key at one instance, by default
/// ([`max_waiters`](IdempotencyLayerBuilder::max_waiters)).
pub const DEFAULT_MAX_WAITERS: usize = 16;

/// The largest `body_limit` [`IdempotencyLayerBuilder::build`] accepts: 64 MiB (the layer buffers
/// the whole body to fingerprint it).
pub const MAX_BODY_LIMIT: usize = 64 * 1024 * 1024;

/// The shortest retention [`IdempotencyLayerBuilder::build`] accepts: 100 ms, against a retention of
/// zero or a few nanoseconds, which would let a retry that follows the answer at once run the
/// handler again. In production keep it well above your clients' retry horizon (hours).
pub const MIN_RETENTION: Duration = Duration::from_millis(100);

/// The shortest deployment secret [`IdempotencyLayerBuilder::derived_key_secret`] accepts.
pub(crate) const MIN_SECRET_LEN: usize = 16;

/// Why a configuration was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError(pub(crate) String);

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid idempotency configuration: {}", self.0)
    }
}

impl std::error::Error for ConfigError {}

pub(crate) type PolicyFn = dyn Fn(StatusCode) -> Disposition + Send + Sync;
pub(crate) type EndpointFn = dyn Fn(&Parts) -> String + Send + Sync;
pub(crate) type OutcomeFn = dyn Fn(Outcome) + Send + Sync;
pub(crate) type FingerprintFn = dyn Fn(&Parts, &[u8]) -> Fingerprint + Send + Sync;
pub(crate) type ReplayFn = dyn Fn(&http::Request<axum::body::Body>, &crate::StoredResponse, &mut http::HeaderMap)
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

/// The validated settings of one layer.
pub(crate) struct Config {
    pub in_progress_ttl: Duration,
    pub retention: Duration,
    pub retry_after_secs: u32,
    pub body_limit: usize,
    pub response_limit: usize,
    pub require_key: bool,
    pub methods: Vec<Method>,
    pub stored_headers: Vec<HeaderName>,
    pub policy: Arc<PolicyFn>,
    pub subject: Arc<dyn SubjectExtractor>,
    pub allow_anonymous: bool,
    pub endpoint: Arc<EndpointFn>,
    pub fail_open: bool,
    pub on_outcome: Option<Arc<OutcomeFn>>,
    pub replay_header: HeaderName,
    pub fingerprint: FingerprintRule,
    /// The longest a claim may be held by its handler and its body.
    pub max_hold: Duration,
    /// The most tasks of this layer's drain that may run before new requests get `503`.
    pub max_running: usize,
    /// Counts the work the layer runs on tasks of its own.
    pub drain: Drain,
    /// The deployment secret mixed into derived keys (HMAC), if any.
    pub derived_key_secret: Option<Arc<crate::secret::Secret>>,
    /// Where the `type` URIs of the layer's errors point.
    pub problems: ProblemTypes,
    /// Whether subjects and endpoints are logged as they are (otherwise hashed).
    pub log_scope: bool,
    /// The shortest `Idempotency-Key` accepted.
    pub min_key_length: usize,
    /// This layer's own claims and leases, answering duplicates that reach it (shared by the
    /// layer's clones and services).
    pub local: Arc<LocalClaims>,
    /// How long a duplicate of a request in progress waits for its answer; zero: not at all.
    pub wait: Duration,
    /// How many duplicates may wait on one key at this instance.
    pub max_waiters: usize,
    /// The duplicates waiting now, by scope (shared by the layer's clones and services).
    pub waiters: Arc<crate::wait::Waiters>,
    /// The hook on replays.
    pub on_replay: Option<Arc<ReplayFn>>,
    /// Whether answers carry the expiry header.
    pub expiry_header: bool,
}

impl fmt::Debug for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The settings an operator reads; functions and the secret are left out.
        f.debug_struct("Config")
            .field("in_progress_ttl", &self.in_progress_ttl)
            .field("retention", &self.retention)
            .field("max_hold", &self.max_hold)
            .field("max_running", &self.max_running)
            .field("body_limit", &self.body_limit)
            .field("response_limit", &self.response_limit)
            .field("require_key", &self.require_key)
            .field("methods", &self.methods)
            .field("stored_headers", &self.stored_headers)
            .field("allow_anonymous", &self.allow_anonymous)
            .field("fail_open", &self.fail_open)
            .field("replay_header", &self.replay_header)
            .field("wait", &self.wait)
            .field("max_waiters", &self.max_waiters)
            .field("expiry_header", &self.expiry_header)
            .finish_non_exhaustive()
    }
}

impl Config {
    /// One of the layer's error answers (see [`ErrorKind`](crate::ErrorKind)).
    pub(crate) fn problem(
        &self,
        kind: crate::ErrorKind,
        detail: &str,
        retry_after: Option<u32>,
    ) -> http::Response<axum::body::Body> {
        self.problems.problem(kind, detail, retry_after)
    }
}

impl Default for Config {
    fn default() -> Self {
        Config {
            in_progress_ttl: Duration::from_secs(90),
            retention: Duration::from_secs(24 * 60 * 60),
            retry_after_secs: 2,
            body_limit: 1024 * 1024,
            response_limit: 1024 * 1024,
            require_key: false,
            methods: vec![Method::POST, Method::PATCH],
            stored_headers: DEFAULT_STORED_HEADERS
                .iter()
                .map(|h| HeaderName::from_static(h))
                .collect(),
            policy: Arc::new(default_policy),
            subject: Arc::new(SubjectExtension),
            allow_anonymous: false,
            endpoint: Arc::new(default_endpoint),
            fail_open: false,
            on_outcome: None,
            replay_header: HeaderName::from_static(crate::replay::IDEMPOTENT_REPLAYED),
            fingerprint: FingerprintRule::Canonical(Arc::new([])),
            max_hold: DEFAULT_MAX_HOLD,
            max_running: DEFAULT_MAX_RUNNING,
            drain: Drain::new(),
            derived_key_secret: None,
            problems: ProblemTypes::default(),
            log_scope: false,
            min_key_length: 1,
            local: Arc::default(),
            wait: Duration::ZERO,
            max_waiters: DEFAULT_MAX_WAITERS,
            waiters: Arc::default(),
            on_replay: None,
            expiry_header: true,
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
