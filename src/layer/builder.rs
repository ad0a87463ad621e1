//! [`IdempotencyLayerBuilder`]: the settings of a layer, checked when it is built.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::request::Parts;
use http::{Method, StatusCode};

use super::handler::Transactions;
use super::key::KeySpec;
use super::layer::IdempotencyLayer;
use super::policy::Disposition;
#[cfg(doc)]
use super::policy::default_policy;
use super::problem::Problem;
use super::settings::{FingerprintRule, LayerSettings, Unchecked};
use super::subject::SubjectExtractor;
use crate::engine::{ConfigError, Drain, Engine, Settings};
use crate::store::{Fingerprint, IdempotencyStore, StoredResponse};

impl<Store: IdempotencyStore> IdempotencyLayer<Store> {
    /// A layer with the default settings (the table on [`IdempotencyLayerBuilder`]), or why they
    /// do not fit `store` (an in-progress TTL under twice its operation timeout).
    pub fn new(store: Store) -> Result<Self, ConfigError> {
        Self::builder(store).build()
    }

    /// A builder to change the settings; [`IdempotencyLayerBuilder::build`] checks them.
    pub fn builder(store: Store) -> IdempotencyLayerBuilder<Store> {
        IdempotencyLayerBuilder::new(store)
    }
}

/// Builds an [`IdempotencyLayer`]; [`build`](Self::build) checks the settings and says what is
/// wrong ([`ConfigError`]) instead of panicking.
///
/// | setting | default | meaning |
/// |---|---|---|
/// | `in_progress_ttl` | 90 s | an `in_progress` record not renewed by its holder's heartbeat for this long is presumed abandoned and may be retaken; the heartbeat renews every third of it. 30 ms to 10 years, and at least twice the store's operation timeout (Postgres 5 s, Redis 2 s by default) |
/// | `max_hold` | 10 min (or the TTL, if longer) | the longest a claim may be held by its handler and its body; past it a handler is cancelled and the key's record becomes a definitive `504 idempotency_handler_timeout` that replays (on the transactional path: rolled back, key released); a streamed body is cut and its response recorded without the body. From the TTL to 10 years |
/// | `max_running` | 1024 | guarded requests in flight at this instance, attached or running on after their clients went away (counted in the layer's `Drain` then); a subject holding `h` of them takes one more only while `h` stay free; past it, new guarded requests get `503 idempotency_overloaded` before any claim |
/// | `drain` | one per layer | share one `Drain` across layers, to wait for all of them (every guarded request, attached or not, and the background work) at shutdown |
/// | `tombstones` | none (off) | how long a finished record's tombstone outlives it: a request whose key's record expired within that time gets `410 idempotency_key_expired`, not a second run |
/// | `retention` | 24 h | how long completed and failed records are replayed; after that the key is new again. At most 10 years |
/// | `retry_after_secs` | 2 | `Retry-After` of `409 in_progress` and `503` |
/// | `body_limit` | 1 MiB | largest request body read (`Content-Length` checked first); larger is `413` |
/// | `response_limit` | 1 MiB | largest response body recorded; a larger one is passed on whole and recorded without its body (replayed with an empty body and `Idempotency-Replay: omitted`) |
/// | `require_key` | `false` | without a key: pass through (`false`) or `400 missing_idempotency_key` (`true`) |
/// | `key_header` | `Idempotency-Key` | the header the key is read from; the draft's `Idempotency-Key`, if sent too, must name the same key (else `400`), and alone it still keys the request |
/// | `key_from` | none | the key from the request's parts, by the application's extractor; the draft's header as with `key_header` |
/// | `key_from_body` | none | the key from a string field of the JSON body, by JSON pointer (AIP-155's `/request_id`); the draft's header as with `key_header`. The last of the three set wins |
/// | `methods` | `POST`, `PATCH` | methods guarded; others pass through; safe methods are refused |
/// | `store_header` | `content-type`, `location`, `content-language`, `etag`, `cache-control` | response headers recorded (repeated ones in order); `set-cookie`, `authorization` and the like are never stored and refused here |
/// | `response_policy` | `default_policy` | status to `Complete` / `Fail` / `Release`; a [`Disposition`] in a response's extensions overrides it for that response |
/// | `release_rejections` | on | axum's extractor rejections (a JSON, form, query or path that does not parse or fit, a missing content type) release the key: the request failed validation, nothing ran |
/// | `release_no_store` | off | a response marked `Cache-Control: no-store` by the handler is released, not recorded |
/// | `replay_check` | none | an async check before every replay, with the request's parts and the record, that may refuse it with an answer of its own |
/// | `subject_extractor` | the `Subject` extension | where the subject comes from |
/// | `allow_anonymous` | `false` | one shared scope for requests without a subject |
/// | `anonymous_shares_by` | none | what tells anonymous callers apart (their peer address, say) for their shares of requests in flight and running; by default they share one |
/// | `endpoint` | `METHOD /path` | the endpoint part of the scope; the path is the original one (before `Router::nest`), without the query |
/// | `fail_open` | `false` | store failure: `503` (`false`) or run unguarded, logged (`true`) |
/// | `fingerprint_ignore` | none | JSON fields left out of the fingerprint, by JSON pointer (`/client_timestamp`, `/metadata/request_id`); see below |
/// | `fingerprint_fn` | canonical body and query | the application's own fingerprint, `Fn(&Parts, &[u8]) -> Fingerprint` |
/// | `replay_header` | `Idempotent-Replayed` | the header, set to `true`, that marks a replay; names with another meaning (`set-cookie`, `idempotency-key`, ...) or that are recorded are refused |
/// | `wait` | 0 (off) | how long a duplicate of a request in progress waits for its answer (then the replay) before `409`; at most 5 s; waiting holds no connection or lock |
/// | `max_waiters_per_key` | 16 | duplicates that may wait on one key at this instance; the others get `409` at once |
/// | `on_replay` | none | a hook on every replay: the request, the stored answer, and the replay's headers to change |
/// | `render_errors` | problem+json | the layer's own error answers rendered by the application (`Retry-After` kept) |
/// | `expiry_header` | on | `Idempotency-Expires`: the HTTP date when the key's record expires, on recorded and replayed answers |
/// | `body_timeout` | 10 s | how long the request body may take to arrive; past it `408 request_timeout`, nothing claimed. 100 ms to 10 min |
/// | `on_outcome` | none | a hook called with every [`Outcome`](crate::Outcome) (claimed, replayed, 409, 422, recorded, released, ...) |
/// | `derived_key_secret` | none | a deployment secret (16 bytes or more) mixed into [`IdempotencyContext::derived_key`](crate::IdempotencyContext::derived_key) by HMAC |
/// | `log_scope` | `false` | log subjects and endpoints as they are (`true`) or only their keyed hashes (`false`) |
/// | `min_key_length` | 1 | the shortest `Idempotency-Key` accepted, up to 255; raise it where keys must be unguessable (anonymous routes) |
/// | `problem_type_base` | this crate's docs | the base of the `type` URI of the layer's errors, followed by the error code |
/// | `max_waiters_per_subject` | 64 | duplicates of one subject that may wait at this instance; the others get `409` at once |
/// | `max_waiters_total` | 1024 | duplicates that may wait at this instance, all subjects together |
/// | `max_in_flight_per_subject` | 256 | requests of one subject in flight at this instance (attached or detached, and answers still streaming into their records); past it `429 idempotency_quota_exceeded` before the body is read |
/// | `max_records_per_subject` | 100 000 | live records one subject may have in the store, counted by one claim of the subject at a time; past it new keys get `429 idempotency_quota_exceeded` (its records still replay), and a failed count refuses them `503` a second. `None`: no bound; a store that keeps no subjects refuses any other value at `build()` |
/// | `max_bytes_per_subject` | 256 MiB | bytes of recorded answers (their bodies) one subject may have in the store, counted with its records; past it new keys get `429 idempotency_quota_exceeded`. Needs `max_records_per_subject` |
/// | `credential_headers` | `authorization` | request headers that count as credentials: with `allow_anonymous`, a request with one but no subject gets `401`, never the shared anonymous scope; add `cookie` where a session cookie authenticates |
/// | `grpc` | off | with the `grpc` feature, the layer guards unary gRPC calls ([`GrpcSettings`](crate::layer::grpc::GrpcSettings)): the key in the `idempotency-key` metadata, the answer read to its trailers and decided by its `grpc-status`, trailers replayed, the layer's answers as gRPC statuses; other calls with a key refused or passed through |
/// | `transactions` | `false` | offer handlers an [`IdempotencyTx`](crate::IdempotencyTx) that commits with the record (stores with transactions only) |
pub struct IdempotencyLayerBuilder<Store> {
    store: Store,
    engine: Settings,
    drain: Drain,
    http: LayerSettings,
    extra_headers: Vec<String>,
    replay_header_name: Option<String>,
    ignored_fields: Vec<String>,
    problem_type_base: Option<String>,
    credential_headers: Option<Vec<String>>,
    key_source: Option<KeySpec>,
    transactions: Option<Arc<dyn Transactions<Store>>>,
}

impl<Store> fmt::Debug for IdempotencyLayerBuilder<Store> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyLayerBuilder")
            .field("engine", &self.engine)
            .field("http", &self.http)
            .finish_non_exhaustive()
    }
}

impl<Store: IdempotencyStore> IdempotencyLayerBuilder<Store> {
    pub(crate) fn new(store: Store) -> Self {
        IdempotencyLayerBuilder {
            store,
            engine: Settings::default(),
            drain: Drain::new(),
            http: LayerSettings::default(),
            extra_headers: Vec::new(),
            replay_header_name: None,
            ignored_fields: Vec::new(),
            problem_type_base: None,
            credential_headers: None,
            key_source: None,
            transactions: None,
        }
    }

    crate::engine::engine_setters!(engine);

    /// The `Retry-After` seconds sent with `409 in_progress` and `503`. Default: 2.
    pub fn retry_after_secs(mut self, secs: u32) -> Self {
        self.http.retry_after_secs = secs;
        self
    }

    /// The largest request body read, in bytes; larger ones get `413`. Default: 1 MiB.
    pub fn body_limit(mut self, bytes: usize) -> Self {
        self.http.body_limit = bytes;
        self
    }

    /// The largest response body recorded, in bytes, at most 64 MiB; a larger
    /// response is passed to the client whole and recorded without its body (its replay has the
    /// status and headers, an empty body and `Idempotency-Replay: omitted`). Default: 1 MiB.
    pub fn response_limit(mut self, bytes: usize) -> Self {
        self.http.response_limit = bytes;
        self
    }

    /// With `true`, a guarded request without a key gets `400 missing_idempotency_key`; by default it
    /// passes through unguarded.
    pub fn require_key(mut self, required: bool) -> Self {
        self.http.require_key = required;
        self
    }

    /// The methods guarded; others pass through. Default: `POST` and `PATCH`. Safe methods (`GET`,
    /// `HEAD`, `OPTIONS`, `TRACE`) are refused. Extension methods (any but the nine of RFC 9110,
    /// such as a lower-case `post` on a route that takes any method) are always guarded: their
    /// meaning is unknown, so they are not taken for safe.
    pub fn methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.http.methods = methods.into_iter().collect();
        self
    }

    /// Records one more response header (on top of `content-type`, `location`,
    /// `content-language`, `etag` and `cache-control`; `content-encoding` is always recorded with
    /// the body it describes). Names that carry credentials or belong to one transfer or hop
    /// (`set-cookie`, `authorization`, `connection`, `proxy-*`, ...) are refused by
    /// [`build`](Self::build).
    pub fn store_header(mut self, name: impl Into<String>) -> Self {
        self.extra_headers.push(name.into());
        self
    }

    /// Decides, from the handler's status, whether a response is recorded as completed, recorded as
    /// failed, or released for another try. Default: [`default_policy`].
    pub fn response_policy(
        mut self,
        policy: impl Fn(StatusCode) -> Disposition + Send + Sync + 'static,
    ) -> Self {
        self.http.policy = Arc::new(policy);
        self
    }

    /// Reads the key from the header `name` instead of `Idempotency-Key` (checked by
    /// [`build`](Self::build)). A request that sends the draft's `Idempotency-Key` too must send
    /// the same key in both (else `400 invalid_idempotency_key`); one that sends only the draft's
    /// header is keyed by it, never run unguarded. The same rules of what a key may hold apply.
    pub fn key_header(mut self, name: impl Into<String>) -> Self {
        self.key_source = Some(KeySpec::Header(name.into()));
        self
    }

    /// Reads the key with `extract`, from the request's parts (its headers, its URI, the
    /// extensions an earlier layer set): `None` when the request has none. The draft's
    /// `Idempotency-Key` header, if sent too, must name the same key, as with
    /// [`key_header`](Self::key_header); the key's rules apply to what `extract` returns.
    pub fn key_from(
        mut self,
        extract: impl Fn(&Parts) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        self.key_source = Some(KeySpec::Parts(Arc::new(extract)));
        self
    }

    /// Reads the key from a string field of the JSON body, named by a JSON pointer (RFC 6901):
    /// `/request_id`, as AIP-155 puts it. The body of a guarded method is read first (up to
    /// [`body_limit`](Self::body_limit), within [`body_timeout`](Self::body_timeout); as many at
    /// once, per layer, as [`max_running`](Self::max_running), the others waiting their turn
    /// within `body_timeout`, then `503`), since only it says whether the request has a key: over
    /// the limit it is `413`, too slow `408`, even without one. An encoded body
    /// (`Content-Encoding`) cannot be read: without the draft's header it is `400`. A body without the field
    /// (or with `null`), or that is not JSON, has no key; one whose `Content-Type` says it is not
    /// JSON (a form, multipart, raw bytes, media, a PDF, an archive) is not read at all, unless the
    /// draft's header is sent. A field that is not a
    /// string is `400 invalid_idempotency_key`. The draft's `Idempotency-Key` header, if sent
    /// too, must name the same key, as with [`key_header`](Self::key_header). The OpenAPI
    /// description documents the field in the request body, not a header.
    pub fn key_from_body(mut self, pointer: impl Into<String>) -> Self {
        self.key_source = Some(KeySpec::Body(pointer.into()));
        self
    }

    /// Whether axum's extractor rejections release the key (default: on). A request that failed
    /// validation is not an operation: `Json`, `Form`, `Query` and `Path` refused it before the
    /// handler ran, so nothing happened, and the corrected retry with the same key must run rather
    /// than get the old refusal replayed. They are told by their answers: a `400`, `413`, `415` or
    /// `422` in `text/plain` whose text starts as axum 0.8's rejections do. Off: they follow the
    /// status policy (a `4xx` is recorded as failed). A handler that wants one recorded says so
    /// with a [`Disposition`] in the response's extensions, which always decides.
    pub fn release_rejections(mut self, on: bool) -> Self {
        self.http.release_rejections = on;
        self
    }

    /// Whether a response the handler marks `Cache-Control: no-store` is released rather than
    /// recorded (default: off). For answers that must not be kept (a one-time secret): the key is
    /// released, and a retry runs the handler again, so mark only answers whose effect may be
    /// repeated (or is deduplicated otherwise). A [`Disposition`] in the response's extensions
    /// still decides over it.
    pub fn release_no_store(mut self, on: bool) -> Self {
        self.http.release_no_store = on;
        self
    }

    /// Runs `check` before every replay (a finished record's answer, including a waiting
    /// duplicate's), with the request's parts and the record ([`ReplayInfo`](crate::ReplayInfo)).
    /// `check` answers a future: `None` lets the replay go; `Some(response)` refuses it, and that
    /// response is sent instead, nothing of the record. For what may change between the first
    /// request and its retry: the caller lost access to the account, the session was revoked.
    ///
    /// `check` reads what it needs from the parts (say, the subject, or a database pool from the
    /// extensions) and returns a `'static` future. A check that panics, or whose future panics,
    /// refuses the replay with `500`: it exists to keep an answer from a caller, and a check that
    /// did not finish has not said it may be sent. One that takes more than 10 seconds refuses it
    /// with `503 idempotency_store_unavailable`, retryable.
    pub fn replay_check<F, Fut>(mut self, check: F) -> Self
    where
        F: Fn(&Parts, &crate::ReplayInfo<'_>) -> Fut + Send + Sync + 'static,
        Fut:
            std::future::Future<Output = Option<http::Response<axum::body::Body>>> + Send + 'static,
    {
        self.http.replay_check = Some(Arc::new(move |parts, info| Box::pin(check(parts, info))));
        self
    }

    /// Where the subject comes from. Default: the [`Subject`](crate::Subject) extension.
    pub fn subject_extractor(mut self, extractor: impl SubjectExtractor) -> Self {
        self.http.subject = Arc::new(extractor);
        self
    }

    /// With `true`, requests without a subject share one anonymous scope instead of getting
    /// `401 missing_subject`. Only for routes that have no authenticated users at all.
    ///
    /// **The anonymous scope is shared by every anonymous caller**: anyone who sends the same
    /// key (and body) gets the same recorded answer, and anyone who sends it with another body
    /// gets `422` for the retention. Require long random keys there
    /// ([`min_key_length`](Self::min_key_length)), and do not return anything private.
    pub fn allow_anonymous(mut self, allow: bool) -> Self {
        self.http.allow_anonymous = allow;
        self
    }

    /// What tells anonymous callers apart for their shares of the instance: requests in flight
    /// and running on after their clients left. By default every anonymous caller shares one
    /// share of each, so one of them that floods takes the others' places (never an
    /// authenticated subject's). `by` names the caller of a request, typically by its
    /// connection's peer address, which the server gives when it is started with
    /// `into_make_service_with_connect_info::<SocketAddr>()`:
    ///
    /// ```
    /// use std::net::SocketAddr;
    /// use axum::extract::ConnectInfo;
    /// use axum_idempotency::{IdempotencyLayer, MemoryStore};
    ///
    /// let layer = IdempotencyLayer::builder(MemoryStore::new())
    ///     .allow_anonymous(true)
    ///     .anonymous_shares_by(|parts: &http::request::Parts| {
    ///         let peer = parts.extensions.get::<ConnectInfo<SocketAddr>>()?;
    ///         Some(peer.0.ip().to_string())
    ///     })
    ///     .build()
    ///     .expect("valid settings");
    /// # let _ = layer;
    /// ```
    ///
    /// Their records stay in the one anonymous scope (a retry from another address finds its
    /// record), so the share of records (`max_records_per_subject`) stays one for them all; so do
    /// the waiting duplicates' places. A request `by` names nobody (`None`) shares the default
    /// share.
    pub fn anonymous_shares_by(mut self, by: impl SubjectExtractor) -> Self {
        self.http.anonymous_shares = Some(Arc::new(by));
        self
    }

    /// How the endpoint part of a record's scope is named. Default: method and original path,
    /// without the query, e.g. `POST /orders/42/pay`.
    pub fn endpoint(mut self, endpoint: impl Fn(&Parts) -> String + Send + Sync + 'static) -> Self {
        self.http.endpoint = Arc::new(endpoint);
        self
    }

    /// With `true`, a failing store lets requests through unguarded (logged) instead of answering
    /// `503 idempotency_store_unavailable`. Default: `false` (fail closed).
    pub fn fail_open(mut self, fail_open: bool) -> Self {
        self.engine.fail_open = fail_open;
        self
    }

    /// Leaves fields of a JSON body out of the fingerprint, named by JSON pointers (RFC 6901), such as
    /// `/client_timestamp` or `/metadata/request_id` (`~1` stands for `/` in a name, `~0` for `~`; a
    /// number names an array element). A retry that differs only in those fields, or lacks them, is
    /// the same request; any other difference still gets `422`. The query and bodies that are not
    /// JSON are fingerprinted whole. Default: none, the whole canonical body and query.
    pub fn fingerprint_ignore(
        mut self,
        pointers: impl IntoIterator<Item = impl Into<String>>,
    ) -> Self {
        self.ignored_fields
            .extend(pointers.into_iter().map(Into::into));
        self
    }

    /// Computes fingerprints with `f` instead, from the request's head and its whole body (at most
    /// `body_limit` bytes); build the result with [`Fingerprint::of`] (on a body you transformed)
    /// or [`Fingerprint::of_material`]. Two requests with one key and different fingerprints get
    /// `422`; equal fingerprints replay each other's answers, so leave out only what does not change
    /// the operation. Not together with [`fingerprint_ignore`](Self::fingerprint_ignore).
    pub fn fingerprint_fn(
        mut self,
        f: impl Fn(&Parts, &[u8]) -> Fingerprint + Send + Sync + 'static,
    ) -> Self {
        self.http.fingerprint = FingerprintRule::Custom(Arc::new(f));
        self
    }

    /// The response header, set to `true`, that marks a replay. Default: `Idempotent-Replayed`
    /// ([`IDEMPOTENT_REPLAYED`](crate::header::IDEMPOTENT_REPLAYED), as Stripe names it). It is never
    /// recorded from a handler's answer, so a replay carries it once. [`build`](Self::build)
    /// refuses a name that carries credentials or another meaning (`set-cookie`,
    /// `idempotency-key`, ...) or one the layer records.
    pub fn replay_header(mut self, name: impl Into<String>) -> Self {
        self.replay_header_name = Some(name.into());
        self
    }

    /// How many guarded requests this layer's instance holds in flight at once, attached to their
    /// clients or running on after they went away ([`Drain::detached`] counts those, with
    /// everything else counted in its drain): past it, new guarded requests get
    /// `503 idempotency_overloaded` with `Retry-After`, before their bodies are read or anything
    /// claimed. Bounds what a client that resets requests in a loop can make the server run. A
    /// subject that holds `h` of these places takes one more only while `h` stay free after it, so
    /// `n` subjects that all want more hold about `max_running / (n + 1)` each. With
    /// [`key_from_body`](Self::key_from_body), it also bounds the bodies read at once for their
    /// keys. At least 1. Default: 1024.
    pub fn max_running(mut self, tasks: usize) -> Self {
        self.engine.max_running = tasks;
        self
    }

    /// Counts this layer's background work in `drain`, shared with other layers (each layer has
    /// one of its own by default; [`IdempotencyLayer::drain`] gives it). The bound of
    /// [`max_running`](Self::max_running) applies to everything counted in it.
    pub fn drain(mut self, drain: Drain) -> Self {
        self.drain = drain;
        self
    }

    /// With `true`, the request's span (`idempotency`) logs the subject and the endpoint as they
    /// are (`subject`, `endpoint`); by default it logs only their keyed hashes (`subject_hash`,
    /// `endpoint_hash`: the first 8 bytes of an HMAC-SHA-256 under
    /// [`derived_key_secret`](Self::derived_key_secret) when it is set, else under a key drawn once
    /// per process), since subjects and paths are personal data and a forged one could fake log
    /// lines. The idempotency key is always hashed (`key_hash`).
    pub fn log_scope(mut self, raw: bool) -> Self {
        self.engine.log_scope = raw;
        self
    }

    /// The shortest `Idempotency-Key` accepted (shorter: `400 invalid_idempotency_key`), at most
    /// 255. Default: 1. Raise it where keys must be unguessable: with
    /// [`allow_anonymous`](Self::allow_anonymous) every anonymous caller shares one scope, so a
    /// guessed key replays another caller's answer or blocks their request with `422`; require
    /// random keys (16 characters or more, a UUID) there.
    pub fn min_key_length(mut self, chars: usize) -> Self {
        self.http.min_key_length = chars;
        self
    }

    /// The base of the `type` URI of the layer's error answers: the application's own
    /// documentation, such as `https://api.example.com/errors/`, followed by the error code
    /// (`…/errors/in_progress`). An absolute `http` or `https` URI. Default: this crate's
    /// documentation of [`ErrorKind`](crate::ErrorKind), at each variant's anchor.
    pub fn problem_type_base(mut self, base: impl Into<String>) -> Self {
        self.problem_type_base = Some(base.into());
        self
    }

    /// How many duplicates may wait on one key at this instance (default
    /// 16); see [`wait`](Self::wait).
    pub fn max_waiters_per_key(mut self, waiters: usize) -> Self {
        self.engine.max_waiters_per_key = waiters;
        self
    }

    /// Calls `hook` on every replay, with the request, the stored answer, and the replay's headers
    /// to add to or change (say, a header naming the original request's id). It runs on the
    /// request's task: keep it quick. A hook that panics leaves the headers as they were. The
    /// replay marker ([`replay_header`](Self::replay_header)) is set again after it: a client must
    /// always be able to tell a replay from a fresh answer.
    pub fn on_replay(
        mut self,
        hook: impl Fn(&http::Request<axum::body::Body>, &StoredResponse, &mut http::HeaderMap)
        + Send
        + Sync
        + 'static,
    ) -> Self {
        self.http.on_replay = Some(Arc::new(hook));
        self
    }

    /// Renders the layer's own error answers ([`Problem`]: its kind, detail, `Retry-After`,
    /// instance and type URI) instead of `application/problem+json`. A retryable answer (`409`,
    /// `503`, a rolled-back `504`) keeps its status and its `Retry-After` header, and every `5xx`
    /// its status, whatever the renderer returns: clients decide by them whether to send the same
    /// request again. A
    /// renderer that panics is replaced by the default answer for that error. Not rendered: the
    /// `504 idempotency_handler_timeout` recorded for a handler cancelled at the maximum hold,
    /// which is the key's stored answer and replays as it was recorded (problem+json).
    pub fn render_errors(
        mut self,
        render: impl Fn(&Problem<'_>) -> http::Response<axum::body::Body> + Send + Sync + 'static,
    ) -> Self {
        self.http.problems = self.http.problems.clone().rendered_by(Arc::new(render));
        self
    }

    /// Whether answers carry [`IDEMPOTENCY_EXPIRES`](crate::header::IDEMPOTENCY_EXPIRES), the HTTP date
    /// when the key's record expires (default: on).
    pub fn expiry_header(mut self, on: bool) -> Self {
        self.http.expiry_header = on;
        self
    }

    /// How many duplicates of one subject may wait for an answer at this instance (default 64);
    /// past it a duplicate gets `409` at once. See [`wait`](Self::wait).
    pub fn max_waiters_per_subject(mut self, waiters: usize) -> Self {
        self.engine.max_waiters_per_subject = waiters;
        self
    }

    /// How many duplicates may wait for an answer at this instance, all subjects together
    /// (default 1024); past it a duplicate gets `409` at once. See [`wait`](Self::wait).
    pub fn max_waiters_total(mut self, waiters: usize) -> Self {
        self.engine.max_waiters_total = waiters;
        self
    }

    /// How many guarded requests of one subject may be in flight at this instance, from their
    /// admission to their end, attached to their clients or running on after they left (default
    /// 256). Past it the subject's next request gets `429 idempotency_quota_exceeded` with
    /// `Retry-After` before its body is read, and other subjects are served.
    pub fn max_in_flight_per_subject(mut self, requests: usize) -> Self {
        self.engine.max_in_flight_per_subject = requests;
        self
    }

    /// How many live records (within their retention) one subject may have in the store (default
    /// 100 000; `None`: no bound). It is counted ([`IdempotencyStore::count_records`]) by one
    /// claim of the subject at a time at this instance, the others waiting for that count, and
    /// this instance lets through a quarter of what is left before it counts again: past the share
    /// the subject's new keys get `429 idempotency_quota_exceeded` with `Retry-After` until some
    /// of its records expire, while its existing records still replay; a count that fails refuses
    /// its new keys a second (`503`); other subjects are served. One instance never lets a subject
    /// pass its share; `n` instances by at most `n * max(left / 4, 1) - left`, where `left` was
    /// free at the last count (about `(n / 4 - 1)` times `left`, `n - 1` when little was left). A
    /// subject is counted at most ten times a second at an instance: new keys that find the budget
    /// spent sooner wait for the next count (a claim that finds no room in eight turns gets
    /// `429`). With `fail_open`, a count that fails lets the claim go on. A store that keeps no
    /// subjects (Postgres without scope columns, Redis without scope fields) cannot count them:
    /// `build()` refuses the bound on it (set `None`). `None` also turns off the default share of
    /// bytes ([`max_bytes_per_subject`](Self::max_bytes_per_subject)), counted with the records.
    pub fn max_records_per_subject(mut self, records: Option<u64>) -> Self {
        self.engine.max_records_per_subject = records;
        if records.is_none()
            && self.engine.max_bytes_per_subject
                == Some(crate::engine::DEFAULT_MAX_BYTES_PER_SUBJECT)
        {
            self.engine.max_bytes_per_subject = None;
        }
        self
    }

    /// How many bytes of recorded answers (their bodies) one subject may have in the store
    /// (default 256 MiB; `None`: no bound), so that no subject fills a shared store (Redis
    /// `maxmemory`, a database's disk) with large answers. Counted with its records (the SQL stores
    /// sum the bodies of the records they count; Redis keeps an account of each subject's bytes
    /// by when they expire; the memory store counts whole records), by the same claims and at the
    /// same times, this instance adding the answers it records meanwhile and counting again once
    /// a quarter of what was left has been recorded: past it, the subject's new keys get `429
    /// idempotency_quota_exceeded` as past its share of records. Its answers in progress are not
    /// counted until recorded, so a subject passes its share by at most its requests in flight
    /// times the response limit, at each instance; with `n` instances, each recording up to a
    /// quarter of what was left before its next count, by up to `(n / 4 - 1)` times what was left
    /// besides. On MySQL, run `migrate()` after upgrading: it adds `body_bytes`, the length of each
    /// body kept with its row, without which a count reads the bodies. Needs
    /// [`max_records_per_subject`](Self::max_records_per_subject): `build()` refuses it alone.
    pub fn max_bytes_per_subject(mut self, bytes: Option<u64>) -> Self {
        self.engine.max_bytes_per_subject = bytes;
        self
    }

    /// The request headers that count as credentials (default: `authorization`). With
    /// [`allow_anonymous`](Self::allow_anonymous), a request that carries one of them but reached
    /// the layer without a subject (an authentication layer misconfigured, or skipped on one
    /// route) is refused with `401 missing_subject`, never put in the scope that every anonymous
    /// caller shares. `cookie` is not among them by default, since browsers send cookies of every
    /// kind (consent, analytics) to anonymous routes too, which would answer them all `401`: add
    /// it (`["authorization", "cookie"]`) where a session cookie is how users authenticate.
    pub fn credential_headers(
        mut self,
        names: impl IntoIterator<Item = impl Into<String>>,
    ) -> Self {
        self.credential_headers = Some(names.into_iter().map(Into::into).collect());
        self
    }

    /// The longest the request body may take to arrive, from when the layer starts reading it;
    /// past it the request gets `408 request_timeout` and nothing is claimed, so a client that
    /// sends its body slowly (or not at all) holds nothing that other requests need. From 100 ms
    /// to 10 minutes. Default: 10 s.
    pub fn body_timeout(mut self, timeout: Duration) -> Self {
        self.http.body_timeout = timeout;
        self
    }

    /// Makes this a gRPC layer (feature `grpc`): it guards the unary methods `settings` names,
    /// reads the key from the `idempotency-key` metadata, fingerprints the method path and the
    /// request's frames, reads the handler's answer to its trailers and decides by its
    /// `grpc-status`, replays the trailers, and answers with gRPC statuses (trailers-only)
    /// instead of problem details ([`render_errors`](Self::render_errors) does not apply). Put it
    /// on the gRPC routes, not on HTTP ones. Not together with `fingerprint_ignore`, nor with
    /// `transactions`. See [`grpc`](crate::layer::grpc).
    #[cfg(feature = "grpc")]
    #[cfg_attr(docsrs, doc(cfg(feature = "grpc")))]
    pub fn grpc(mut self, settings: super::grpc::GrpcSettings) -> Self {
        self.http.grpc = Some(Arc::new(settings));
        self
    }

    /// Checks the settings and builds the layer.
    pub fn build(mut self) -> Result<IdempotencyLayer<Store>, ConfigError> {
        #[cfg(feature = "grpc")]
        if self.http.grpc.is_some() && self.transactions.is_some() {
            return Err(ConfigError::new(
                "grpc",
                "a gRPC layer records its answers itself: not together with transactions",
            ));
        }
        self.http.tombstones = self.engine.tombstones.is_some();
        let reads = self
            .engine
            .max_running
            .min(tokio::sync::Semaphore::MAX_PERMITS);
        self.http.body_reads = Arc::new(tokio::sync::Semaphore::new(reads));
        let http = self.http.finished(Unchecked {
            problem_type_base: self.problem_type_base,
            extra_headers: self.extra_headers,
            replay_header_name: self.replay_header_name,
            ignored_fields: self.ignored_fields,
            credential_headers: self.credential_headers,
            key_source: self.key_source,
        })?;
        let engine = Engine::new(self.store, self.engine, self.drain)?;
        Ok(IdempotencyLayer {
            engine,
            http: Arc::new(http),
            transactions: self.transactions,
        })
    }
}

#[cfg(sql)]
impl<Store, DB> IdempotencyLayerBuilder<Store>
where
    DB: sqlx::Database,
    Store: crate::store::TransactionalStore<Transaction = sqlx::Transaction<'static, DB>>,
{
    /// With `true`, handlers may take an [`IdempotencyTx`](crate::IdempotencyTx): a transaction
    /// of the store's database that their effects and the record of their answer commit in
    /// together. Only for stores that have transactions (the Postgres store, and the wrappers of
    /// one). Default: `false` (a handler that asks for the transaction is answered
    /// `500 internal_error`).
    pub fn transactions(mut self, on: bool) -> Self {
        self.transactions = on.then(|| {
            Arc::new(super::transaction::SqlTransactions::<DB>::new())
                as Arc<dyn Transactions<Store>>
        });
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::MAX_DURATION;
    use crate::layer::settings::MAX_BODY_LIMIT;
    use crate::store::MemoryStore;

    /// The names in the first column of the settings tables of `text` (`| \`name\` | ...`), its
    /// lines read after `prefix`.
    fn table_names(text: &str, prefix: &str) -> std::collections::HashSet<String> {
        text.lines()
            .filter_map(|line| line.trim_start().strip_prefix(prefix)?.strip_prefix("| `"))
            .filter_map(|rest| rest.split('`').next())
            .map(str::to_owned)
            .collect()
    }

    /// Every setter of the builder has a row in the table of its docs and in the README's.
    #[test]
    fn every_setter_is_in_both_settings_tables() {
        let source = include_str!("builder.rs");
        // The engine's setters, written once for both builders (`engine_setters!`).
        let shared = include_str!("../engine/settings.rs")
            .split("macro_rules! engine_setters")
            .nth(1)
            .expect("the engine's setters");
        let setters_of = |source: &'static str| -> Vec<&'static str> {
            source
                .lines()
                .filter_map(|line| line.trim_start().strip_prefix("pub fn "))
                .filter_map(|rest| rest.split(['(', '<']).next())
                .filter(|name| !["build", "new", "builder"].contains(name))
                .collect()
        };
        let shared = setters_of(shared);
        assert_eq!(shared.len(), 7, "{shared:?}");
        let setters: Vec<&str> = setters_of(source)
            .into_iter()
            .chain(shared.clone())
            .collect();
        assert!(setters.len() > 30, "{setters:?}");
        let docs = table_names(source, "/// ");
        let readme = table_names(include_str!("../../README.md"), "");
        for setter in &setters {
            assert!(
                docs.contains(*setter),
                "`{setter}` is missing from the builder's table"
            );
            assert!(
                readme.contains(*setter),
                "`{setter}` is missing from the README's table"
            );
        }
        // `RunOnceBuilder`'s setters are the layer's, by name, each in the README's table and in
        // the README's list of those `RunOnce` takes.
        let once = include_str!("../once/builder.rs");
        let once_setters: Vec<&str> = setters_of(once).into_iter().chain(shared).collect();
        assert!(once_setters.len() >= 8, "{once_setters:?}");
        let readme_text = include_str!("../../README.md");
        let list = readme_text
            .split("`RunOnce::builder(store)` takes these settings")
            .nth(1)
            .and_then(|rest| rest.split("\n\n").next())
            .expect("the README lists the settings RunOnce takes");
        for setter in &once_setters {
            assert!(
                readme.contains(*setter),
                "`{setter}` (RunOnce) is missing from the README's table"
            );
            assert!(
                list.contains(&format!("`{setter}`")),
                "`{setter}` is missing from the README's list of RunOnce's settings"
            );
        }
    }

    fn builder() -> IdempotencyLayerBuilder<MemoryStore> {
        IdempotencyLayerBuilder::new(MemoryStore::new())
    }

    fn refused(b: IdempotencyLayerBuilder<MemoryStore>) -> String {
        match b.build() {
            Ok(_) => panic!("configuration accepted"),
            Err(e) => e.to_string(),
        }
    }

    /// The bytes share needs the records share it is counted with; `None` for records turns
    /// the default bytes share off, not one set on purpose.
    #[test]
    fn the_bytes_share_goes_with_the_records_share() {
        assert!(
            refused(builder().max_bytes_per_subject(Some(0))).contains("max_bytes_per_subject")
        );
        assert!(builder().max_records_per_subject(None).build().is_ok());
        let alone = builder()
            .max_records_per_subject(None)
            .max_bytes_per_subject(Some(1024));
        assert!(refused(alone).contains("max_records_per_subject too"));
        assert!(
            builder()
                .max_records_per_subject(Some(10))
                .max_bytes_per_subject(None)
                .build()
                .is_ok()
        );
    }

    #[test]
    fn a_refusal_names_its_setting() {
        let setting = |b: IdempotencyLayerBuilder<MemoryStore>| match b.build() {
            Ok(_) => panic!("configuration accepted"),
            Err(e) => e.setting().to_owned(),
        };
        assert_eq!(
            setting(builder().in_progress_ttl(Duration::ZERO)),
            "in_progress_ttl"
        );
        assert_eq!(setting(builder().retention(Duration::ZERO)), "retention");
        assert_eq!(
            setting(builder().max_hold(Duration::from_secs(1))),
            "max_hold"
        );
        assert_eq!(
            setting(builder().body_timeout(Duration::ZERO)),
            "body_timeout"
        );
        assert_eq!(setting(builder().store_header("cookie")), "store_header");
        assert_eq!(
            setting(builder().replay_header("location")),
            "replay_header"
        );
        assert_eq!(setting(builder().wait(Duration::from_secs(6))), "wait");
        assert_eq!(
            setting(builder().derived_key_secret(b"short")),
            "derived_key_secret"
        );
        assert_eq!(setting(builder().methods([Method::GET])), "methods");
    }

    #[test]
    fn new_checks_what_build_checks() {
        // A store whose operation timeout leaves the default TTL no room to prove a late claim.
        let store = crate::store::testing::Faulty::default()
            .with_operation_timeout(Duration::from_secs(60));
        let refused = IdempotencyLayer::new(store).expect_err("refused");
        assert_eq!(refused.setting(), "in_progress_ttl");
    }

    #[test]
    fn defaults_build() {
        assert!(builder().build().is_ok());
        assert!(builder().store_header("x-request-id").build().is_ok());
    }

    #[test]
    fn invalid_settings_say_why() {
        assert!(refused(builder().in_progress_ttl(Duration::ZERO)).contains("in_progress_ttl"));
        assert!(refused(builder().in_progress_ttl(Duration::from_millis(29))).contains("30 ms"));
        assert!(refused(builder().retention(Duration::ZERO)).contains("retention"));
        assert!(refused(builder().retention(Duration::MAX)).contains("ten years"));
        assert!(refused(builder().in_progress_ttl(Duration::MAX)).contains("ten years"));
        let centuries = Duration::from_secs(300_000 * 365 * 24 * 3600);
        assert!(refused(builder().retention(centuries)).contains("ten years"));
        assert!(builder().retention(MAX_DURATION).build().is_ok());
        assert!(refused(builder().retry_after_secs(0)).contains("retry_after_secs"));
        assert!(refused(builder().body_limit(0)).contains("body_limit"));
        assert!(refused(builder().response_limit(0)).contains("response_limit"));
        assert!(refused(builder().response_limit(MAX_BODY_LIMIT + 1)).contains("64 MiB"));
        assert!(refused(builder().methods([])).contains("at least one method"));
        assert!(refused(builder().methods([Method::POST, Method::GET])).contains("GET"));
        assert!(refused(builder().store_header("set-cookie")).contains("never stored"));
        assert!(refused(builder().store_header("Authorization")).contains("never stored"));
        assert!(refused(builder().store_header("bad header")).contains("not a valid header"));
        assert!(refused(builder().replay_header("bad header")).contains("not a valid header"));
        assert!(refused(builder().replay_header("Set-Cookie")).contains("another meaning"));
        assert!(refused(builder().replay_header("idempotency-key")).contains("another meaning"));
        assert!(refused(builder().replay_header("location")).contains("be recorded"));
        let both = builder()
            .store_header("x-replayed")
            .replay_header("X-Replayed");
        assert!(refused(both).contains("be recorded"));
        assert!(
            builder()
                .replay_header("Idempotent-Replayed")
                .build()
                .is_ok()
        );
        assert!(
            builder()
                .replay_header("x-idempotent-replay")
                .build()
                .is_ok()
        );
        assert!(refused(builder().fingerprint_ignore(["ts"])).contains("start with '/'"));
        assert!(refused(builder().fingerprint_ignore(["/a~2"])).contains("'~'"));
        assert!(refused(builder().fingerprint_ignore([""])).contains("start with '/'"));
        let both = builder()
            .fingerprint_fn(|_, body| Fingerprint::of_material(body))
            .fingerprint_ignore(["/ts"]);
        assert!(refused(both).contains("together"));
        assert!(
            builder()
                .fingerprint_ignore(["/ts", "/a/0/b"])
                .build()
                .is_ok()
        );
    }
}
