//! The test app the suite drives: a counting handler steered by request headers, a test auth, and
//! request and answer helpers.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use crate::store::{
    ClaimOutcome, ClaimRequest, Fenced, Fingerprint, IdempotencyStore, LeaseToken, RecordKey,
    StoredResponse,
};
use crate::{IdempotencyLayer, Subject};
use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing;
use http_body::Frame;
use http_body_util::BodyExt;
use tower::ServiceExt;

/// Counts of handler runs: `started` when a run begins, `finished` when it is about to answer,
/// `streamed` when a streamed body (`x-stream`) has produced its last frame.
#[derive(Clone, Debug, Default)]
pub struct Counters {
    /// Runs begun.
    pub started: Arc<AtomicUsize>,
    /// Runs about to answer.
    pub finished: Arc<AtomicUsize>,
    /// Streamed bodies that produced their last frame.
    pub streamed: Arc<AtomicUsize>,
}

impl Counters {
    /// Runs begun.
    pub fn started(&self) -> usize {
        self.started.load(Ordering::SeqCst)
    }
    /// Runs about to answer.
    pub fn finished(&self) -> usize {
        self.finished.load(Ordering::SeqCst)
    }
    /// Streamed bodies that produced their last frame.
    pub fn streamed(&self) -> usize {
        self.streamed.load(Ordering::SeqCst)
    }
}

/// A streamed body: `part1;` at once, then by `kind`: `slow` (`part2` after 500 ms), `endless`
/// (100-byte chunks every 10 ms, for ever), `fail` (the stream fails), `trailers` (trailers),
/// `stall` (nothing more, for ever), `panic` (a panic at once), `late-panic` (a panic after 50 ms).
fn streamed(kind: String, counters: Counters) -> Body {
    let frames = futures_util::stream::unfold(0u32, move |n| {
        let (kind, counters) = (kind.clone(), counters.clone());
        async move {
            let frame: Result<Frame<Bytes>, std::io::Error> = match (kind.as_str(), n) {
                (_, 0) => Ok(Frame::data(Bytes::from_static(b"part1;"))),
                ("slow", 1) => {
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    counters.streamed.fetch_add(1, Ordering::SeqCst);
                    Ok(Frame::data(Bytes::from_static(b"part2")))
                }
                ("endless", _) => {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    Ok(Frame::data(Bytes::from(vec![b'x'; 100])))
                }
                ("fail", 1) => Err(std::io::Error::other("the body stream failed")),
                ("stall", 1) => std::future::pending().await,
                ("panic", 1) => panic!("the body panicked on purpose"),
                ("late-panic", 1) => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    panic!("the body panicked on purpose")
                }
                ("trailers", 1) => {
                    let mut trailers = HeaderMap::new();
                    trailers.insert("x-checksum", HeaderValue::from_static("abc"));
                    Ok(Frame::trailers(trailers))
                }
                _ => return None,
            };
            Some((frame, n + 1))
        }
    });
    Body::new(http_body_util::StreamBody::new(frames))
}

/// The handler behind every test route. Request headers steer it: `x-delay-ms` (sleep first),
/// `x-block-ms` (block the thread first),
/// `x-status` (answer with that status), `x-panic` (panic), `x-big` (a body of that many bytes),
/// `x-stream` (a streamed body, see [`streamed`]).
async fn handler(State(counters): State<Counters>, headers: HeaderMap, body: Bytes) -> Response {
    let attempt = counters.started.fetch_add(1, Ordering::SeqCst) + 1;
    let num = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok())
    };
    if let Some(ms) = num("x-delay-ms") {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    if let Some(ms) = num("x-block-ms") {
        // A handler that blocks its thread, as a synchronous SDK call or a CPU loop does.
        std::thread::sleep(Duration::from_millis(ms));
    }
    if headers.contains_key("x-panic") {
        panic!("the handler panicked on purpose");
    }
    let status = num("x-status").map_or(StatusCode::CREATED, |s| {
        StatusCode::from_u16(s as u16).expect("test status")
    });
    let stream = headers.get("x-stream").and_then(|v| v.to_str().ok());
    let payload = match (num("x-big"), stream) {
        (_, Some(kind)) => streamed(kind.to_owned(), counters.clone()),
        (Some(n), None) => Body::from("x".repeat(n as usize)),
        (None, None) => Body::from(
            serde_json::json!({
                "attempt": attempt,
                "body": String::from_utf8_lossy(&body),
            })
            .to_string(),
        ),
    };
    counters.finished.fetch_add(1, Ordering::SeqCst);
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "application/json")
        .header(header::LOCATION, format!("/charges/{attempt}"))
        .header(header::SET_COOKIE, "session=secret")
        .header(header::LINK, "<a>")
        .header(header::LINK, "<b>")
        .header("x-not-stored", "1")
        .body(payload)
        .expect("valid response")
}

/// Test auth: the `x-user` header becomes the [`Subject`] (a request without it has none). The
/// apps of the suite put it outside the layer; a test's own app may too.
pub async fn auth(mut request: Request, next: Next) -> Response {
    if let Some(user) = request
        .headers()
        .get("x-user")
        .and_then(|v| v.to_str().ok())
    {
        let user = user.to_owned();
        request.extensions_mut().insert(Subject(user));
    }
    next.run(request).await
}

/// The claim of `POST /pay` by `alice` with `key` and `body` (TTL 60 s, retention 1 h), a new
/// request's: the claim the stores' own tests make when they call a store directly.
pub fn claim_request(key: &str, body: &[u8]) -> crate::store::ClaimRequest {
    crate::store::ClaimRequest::new(
        RecordKey {
            key: key.to_owned(),
            subject: "alice".to_owned(),
            endpoint: "POST /pay".to_owned(),
        },
        crate::Fingerprint::of(None, body),
        Duration::from_secs(60),
        Duration::from_secs(3600),
    )
}

/// The operation timeout of the stores the behaviour suite runs on: short, so that the suite's
/// short in-progress TTLs stay above twice it, as `build()` requires.
pub const SUITE_STORE_TIMEOUT: std::time::Duration = std::time::Duration::from_millis(500);

/// An app with `POST /pay` and `POST /other` behind `layer`, and `GET /pay` unguarded by method.
pub fn app<S: IdempotencyStore>(layer: IdempotencyLayer<S>) -> (Router, Counters) {
    let counters = Counters::default();
    let router = Router::new()
        .route("/pay", routing::post(handler).get(handler))
        .route("/other", routing::post(handler))
        .route_layer(layer)
        .layer(middleware::from_fn(auth))
        .with_state(counters.clone());
    (router, counters)
}

/// A request builder for the test app.
#[derive(Debug)]
pub struct Req {
    builder: axum::http::request::Builder,
    body: Body,
}

/// A `POST` to `path`, with no header and an empty body.
pub fn post(path: &str) -> Req {
    Req {
        builder: Request::builder().method("POST").uri(path),
        body: Body::empty(),
    }
}

impl Req {
    /// Another method.
    pub fn method(mut self, method: &str) -> Self {
        self.builder = self.builder.method(method);
        self
    }
    /// The `Idempotency-Key` header.
    pub fn key(self, key: &str) -> Self {
        self.header("idempotency-key", key)
    }
    /// The subject the test auth puts in the request (`x-user`).
    pub fn user(self, user: &str) -> Self {
        self.header("x-user", user)
    }
    /// Any header.
    pub fn header(mut self, name: &str, value: &str) -> Self {
        self.builder = self.builder.header(name, value);
        self
    }
    /// A header whose value is any bytes.
    pub fn raw_header(mut self, name: &str, value: &[u8]) -> Self {
        self.builder = self
            .builder
            .header(name, HeaderValue::from_bytes(value).expect("header value"));
        self
    }
    /// A JSON body, with its content type.
    pub fn json(mut self, body: &str) -> Self {
        self.builder = self
            .builder
            .header(header::CONTENT_TYPE, "application/json");
        self.body = Body::from(body.to_owned());
        self
    }
    /// Any body.
    pub fn body(mut self, body: Body) -> Self {
        self.body = body;
        self
    }
    /// The request.
    pub fn build(self) -> Request {
        self.builder.body(self.body).expect("valid request")
    }
}

/// A response, read whole.
#[derive(Debug)]
pub struct Answer {
    /// The status.
    pub status: StatusCode,
    /// The headers.
    pub headers: HeaderMap,
    /// The whole body.
    pub body: Bytes,
}

impl Answer {
    /// The body as JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).expect("JSON body")
    }
    /// A header's value, if it is text.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
    /// Whether the answer is a replay (`Idempotent-Replayed: true`).
    pub fn replayed(&self) -> bool {
        self.header("idempotent-replayed") == Some("true")
    }
    /// The `error` field of a problem details answer, after checking its content type and status.
    pub fn problem(&self) -> String {
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json"),
            "{self:?}"
        );
        let json = self.json();
        assert_eq!(json["status"], self.status.as_u16(), "{json}");
        assert!(
            json["type"].is_string() && json["title"].is_string() && json["detail"].is_string()
        );
        json["error"].as_str().expect("error field").to_owned()
    }
}

/// Sends `req` through `router` and reads the whole answer.
pub async fn send(router: &Router, req: Req) -> Answer {
    let response = router
        .clone()
        .oneshot(req.build())
        .await
        .expect("infallible");
    let (parts, body) = response.into_parts();
    let body = body.collect().await.expect("body").to_bytes();
    Answer {
        status: parts.status,
        headers: parts.headers,
        body,
    }
}

/// Waits until `check` holds, for at most five seconds.
pub async fn eventually(mut check: impl FnMut() -> bool) {
    for _ in 0..500 {
        if check() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("condition not reached within five seconds");
}

/// A store that counts the claims that reach it.
#[derive(Clone, Debug)]
pub struct Counting<S> {
    store: S,
    claims: Arc<AtomicUsize>,
}

impl<S> Counting<S> {
    /// Counts the claims that reach `store`.
    pub fn new(store: S) -> Self {
        Counting {
            store,
            claims: Arc::default(),
        }
    }
    /// The claims counted so far.
    pub fn claims(&self) -> usize {
        self.claims.load(Ordering::SeqCst)
    }
}

impl<S: IdempotencyStore> IdempotencyStore for Counting<S> {
    async fn claim(
        &self,
        request: &ClaimRequest,
    ) -> Result<ClaimOutcome, crate::store::StoreError> {
        self.claims.fetch_add(1, Ordering::SeqCst);
        self.store.claim(request).await
    }
    async fn complete(
        &self,
        key: &RecordKey,
        lease: LeaseToken,
        fingerprint: &Fingerprint,
        response: Arc<StoredResponse>,
        retention: Duration,
    ) -> Result<Fenced, crate::store::StoreError> {
        self.store
            .complete(key, lease, fingerprint, response, retention)
            .await
    }
    async fn renew(
        &self,
        key: &RecordKey,
        lease: LeaseToken,
        lifetime: Duration,
    ) -> Result<Fenced, crate::store::StoreError> {
        self.store.renew(key, lease, lifetime).await
    }
    async fn record_step(
        &self,
        key: &RecordKey,
        lease: LeaseToken,
        step: &crate::store::RecordedStep,
    ) -> Result<Fenced, crate::store::StoreError> {
        self.store.record_step(key, lease, step).await
    }
    async fn steps(
        &self,
        key: &RecordKey,
        lease: LeaseToken,
    ) -> Result<Option<Vec<crate::store::RecordedStep>>, crate::store::StoreError> {
        self.store.steps(key, lease).await
    }
    async fn recorded_steps(
        &self,
        key: &RecordKey,
    ) -> Result<Vec<crate::store::RecordedStep>, crate::store::StoreError> {
        self.store.recorded_steps(key).await
    }
    async fn release(
        &self,
        key: &RecordKey,
        lease: LeaseToken,
    ) -> Result<Fenced, crate::store::StoreError> {
        self.store.release(key, lease).await
    }
    async fn purge_expired(&self) -> Result<u64, crate::store::StoreError> {
        self.store.purge_expired().await
    }
    async fn lookup(
        &self,
        key: &crate::store::RecordKey,
    ) -> Result<Option<crate::store::RecordInfo>, crate::store::StoreError> {
        self.store.lookup(key).await
    }
    async fn delete(
        &self,
        key: &crate::store::RecordKey,
    ) -> Result<crate::store::Deleted, crate::store::StoreError> {
        self.store.delete(key).await
    }
    async fn list(
        &self,
        subject: &str,
        request: crate::store::ListRequest,
    ) -> Result<crate::store::RecordPage, crate::store::StoreError> {
        self.store.list(subject, request).await
    }
    async fn count_records(
        &self,
        subject: &str,
        up_to: u64,
    ) -> Result<Option<crate::store::SubjectUsage>, crate::store::StoreError> {
        self.store.count_records(subject, up_to).await
    }

    fn counts_records(&self) -> bool {
        self.store.counts_records()
    }

    fn operation_timeout(&self) -> Option<std::time::Duration> {
        self.store.operation_timeout()
    }

    async fn keeper_session(&self) -> Result<Self, crate::store::StoreError> {
        Ok(Counting {
            store: self.store.keeper_session().await?,
            claims: self.claims.clone(),
        })
    }

    async fn show_presences(
        &self,
        live: &[crate::store::Presence],
        lapse: Duration,
    ) -> Result<(), crate::store::StoreError> {
        self.store.show_presences(live, lapse).await
    }
}

/// Sends `req` until the answer is not `409` (every 20 ms, at most `tries` times), as a client that
/// retries would, and returns the last answer.
pub async fn until_not_in_progress(
    router: &axum::Router,
    req: impl Fn() -> Req,
    tries: usize,
) -> Answer {
    let mut answer = send(router, req()).await;
    for _ in 0..tries {
        if answer.status != StatusCode::CONFLICT {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        answer = send(router, req()).await;
    }
    answer
}

/// A short in-progress TTL for tests of its expiry: `base`, or the shortest the store's operation
/// timeout allows when that is longer.
pub(crate) fn short_ttl<S: IdempotencyStore>(store: &S, base: Duration) -> Duration {
    store.operation_timeout().map_or(base, |t| base.max(t * 2))
}
