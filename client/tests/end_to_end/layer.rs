//! The client against the layer in-process: an axum server on 127.0.0.1:0 with `IdempotencyLayer`
//! on the memory store, the subject set by an auth middleware.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::handler::Handler;
use axum::http::{HeaderMap, HeaderName, StatusCode};
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::post;
use axum_idempotency::{IdempotencyLayer, IdempotencyLayerBuilder, MemoryStore, Subject};
use axum_idempotency_client::{
    ErrorKind, IdempotencyError, IdempotencyInfo, IdempotentRequestExt, IdempotentResponseExt,
};
use serde_json::{Value, json};
use tokio::sync::{Barrier, watch};

use crate::support::{Relay, client, quick};

/// An answer the handler gives instead of charging.
struct Scripted {
    status: u16,
    headers: Vec<(&'static str, String)>,
    content_type: &'static str,
    body: String,
}

impl Scripted {
    fn plain(status: u16) -> Self {
        Scripted {
            status,
            headers: Vec::new(),
            content_type: "application/json",
            body: json!({"error": "scripted"}).to_string(),
        }
    }

    fn problem(status: u16, body: Value) -> Self {
        Scripted {
            content_type: "application/problem+json",
            body: body.to_string(),
            ..Scripted::plain(status)
        }
    }

    fn header(mut self, name: &'static str, value: impl Into<String>) -> Self {
        self.headers.push((name, value.into()));
        self
    }
}

/// What the server saw of one request at its door (before the idempotency layer).
#[derive(Debug, Clone)]
struct Seen {
    key: Option<String>,
    status: u16,
}

#[derive(Default)]
struct Inner {
    /// Handler runs.
    runs: AtomicUsize,
    /// Charges made.
    charges: AtomicUsize,
    /// Answers the next runs give instead of charging, in order.
    script: Mutex<VecDeque<Scripted>>,
    /// Every request at the door, in the order answered.
    seen: Mutex<Vec<Seen>>,
    /// A charge waits until this is true (at most 20 s).
    gate: Option<watch::Sender<bool>>,
    /// Whether a `409` at the door opens the gate.
    open_on_conflict: bool,
}

#[derive(Clone)]
struct Server {
    addr: SocketAddr,
    inner: Arc<Inner>,
}

impl Server {
    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }
    fn runs(&self) -> usize {
        self.inner.runs.load(Ordering::SeqCst)
    }
    fn charges(&self) -> usize {
        self.inner.charges.load(Ordering::SeqCst)
    }
    fn seen(&self) -> Vec<Seen> {
        self.inner.seen.lock().expect("lock").clone()
    }
    fn script(&self, answers: impl IntoIterator<Item = Scripted>) {
        self.inner.script.lock().expect("lock").extend(answers);
    }
    fn open(&self) {
        if let Some(gate) = &self.inner.gate {
            gate.send_replace(true);
        }
    }
    /// Waits (at most 20 s) until the handler has started `n` runs.
    async fn wait_for_runs(&self, n: usize) {
        for _ in 0..1000 {
            if self.runs() >= n {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("the handler never started run {n}");
    }
}

/// How a test's server behaves.
#[derive(Default)]
struct Setup {
    /// Charges wait for [`Server::open`] (or a `409`, with `open_on_conflict`).
    gated: bool,
    open_on_conflict: bool,
}

type Configure = fn(IdempotencyLayerBuilder<MemoryStore>) -> IdempotencyLayerBuilder<MemoryStore>;

/// Serves `POST /charge` behind the layer (configured by `configure`) and `POST /plain` without
/// it, both with the same handler, behind an auth middleware that makes every request alice's and
/// a door that records every request's key and status.
async fn serve_with(setup: Setup, configure: Configure) -> Server {
    let inner = Arc::new(Inner {
        gate: setup.gated.then(|| watch::channel(false).0),
        open_on_conflict: setup.open_on_conflict,
        ..Inner::default()
    });
    let layer: IdempotencyLayer<MemoryStore> =
        configure(IdempotencyLayer::builder(MemoryStore::new()).retry_after_secs(1))
            .build()
            .expect("layer");
    let app = Router::new()
        .route("/charge", post(charge.layer(layer)))
        .route("/plain", post(charge))
        .layer(middleware::from_fn(auth))
        .layer(middleware::from_fn_with_state(inner.clone(), door))
        .with_state(inner.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, app).await });
    Server { addr, inner }
}

async fn serve() -> Server {
    serve_with(Setup::default(), |b| b).await
}

/// Stands in for the application's auth: every request is alice's.
async fn auth(mut request: Request, next: Next) -> Response {
    request.extensions_mut().insert(Subject("alice".into()));
    next.run(request).await
}

/// Records each request's key and status; opens the gate on a `409` when so set up.
async fn door(State(inner): State<Arc<Inner>>, request: Request, next: Next) -> Response {
    let key = request
        .headers()
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let response = next.run(request).await;
    let status = response.status().as_u16();
    inner.seen.lock().expect("lock").push(Seen { key, status });
    if status == 409
        && inner.open_on_conflict
        && let Some(gate) = &inner.gate
    {
        gate.send_replace(true);
    }
    response
}

/// The handler: a scripted answer if one is queued, else (once the gate is open) a charge, `201`
/// with its number, the key it was sent with and the body.
async fn charge(State(inner): State<Arc<Inner>>, headers: HeaderMap, body: Bytes) -> Response {
    inner.runs.fetch_add(1, Ordering::SeqCst);
    let scripted = inner.script.lock().expect("lock").pop_front();
    if let Some(s) = scripted {
        let mut response = Response::builder()
            .status(s.status)
            .header("content-type", s.content_type);
        for (name, value) in s.headers {
            response = response.header(name, value);
        }
        return response.body(Body::from(s.body)).expect("response");
    }
    if let Some(gate) = &inner.gate {
        let mut open = gate.subscribe();
        let _ = tokio::time::timeout(Duration::from_secs(20), open.wait_for(|o| *o)).await;
    }
    let id = inner.charges.fetch_add(1, Ordering::SeqCst) + 1;
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let body = json!({"charge": id, "key": key, "request": String::from_utf8_lossy(&body)});
    Response::builder()
        .status(StatusCode::CREATED)
        .header("content-type", "application/json")
        .body(Body::from(body.to_string()))
        .expect("response")
}

const ORDER: &str = r#"{"amount":100}"#;

/// The answer's status, idempotency info and JSON body.
async fn read(response: reqwest::Response) -> (StatusCode, IdempotencyInfo, Value) {
    let status = response.status();
    let info = response
        .idempotency()
        .cloned()
        .expect("an idempotent request's answer carries its info");
    let text = response.text().await.expect("body");
    let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
    (status, info, body)
}

fn idempotency_error(error: &reqwest_middleware::Error) -> &IdempotencyError {
    IdempotencyError::from_error(error).expect("an IdempotencyError")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_generated_key_its_attempts_and_its_expiry_are_reported() {
    let server = serve().await;
    let c = client(quick());
    let response = c
        .post(server.url("/charge"))
        .body(ORDER)
        .idempotent()
        .send()
        .await
        .expect("send");
    let (status, info, body) = read(response).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(
        (info.attempts(), info.replayed(), info.gave_up()),
        (1, false, false)
    );
    assert_eq!(
        body["key"],
        info.key().as_str(),
        "the server got the reported key"
    );
    assert_eq!(info.key().as_str().len(), 36, "a UUID: {}", info.key());
    // The layer keeps records 24 h by default.
    let expires = info.expires_at().expect("Idempotency-Expires");
    let now = SystemTime::now();
    assert!(
        expires > now + Duration::from_secs(23 * 3600),
        "{expires:?}"
    );
    assert!(
        expires < now + Duration::from_secs(25 * 3600),
        "{expires:?}"
    );

    // Another send is another operation: another key, another charge.
    let again = c
        .post(server.url("/charge"))
        .body(ORDER)
        .idempotent()
        .send()
        .await
        .expect("send");
    let (_, second, _) = read(again).await;
    assert_ne!(second.key(), info.key());
    assert_eq!(server.charges(), 2);
}

/// The server did the work and the answers were lost on the way back: every retry carries the same
/// key, and the caller gets the first run's answer as a replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_answers_are_retried_with_the_same_key_and_replayed() {
    let server = serve().await;
    let relay = Relay::start(server.addr).await;
    relay.lose_answers(2);
    let response = client(quick())
        .post(relay.url("/charge"))
        .body(ORDER)
        .idempotent()
        .send()
        .await
        .expect("send");
    let (status, info, body) = read(response).await;
    assert_eq!(status, StatusCode::CREATED);
    assert!(info.replayed(), "the answer is the first run's, replayed");
    assert_eq!(relay.lost(), 2);
    assert!(info.attempts() >= 3, "{info:?}");
    assert_eq!(body["charge"], 1, "the first answer: {body}");
    assert_eq!((server.runs(), server.charges()), (1, 1), "charged once");
    let seen = server.seen();
    assert_eq!(seen.len() as u32, info.attempts());
    assert!(
        seen.iter()
            .all(|s| s.key.as_deref() == Some(info.key().as_str())),
        "every attempt carried the same key: {seen:?}"
    );
}

/// Eight callers send the same operation at once: the handler runs once, every caller gets its
/// answer, and the duplicates were answered `409` and polled to the replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn racing_duplicates_are_polled_to_the_first_answer() {
    // The charge waits until a duplicate has been answered 409, so the race is certain to have one.
    let setup = Setup {
        gated: true,
        open_on_conflict: true,
    };
    let server = serve_with(setup, |b| b).await;
    let c = client(quick());
    let barrier = Arc::new(Barrier::new(8));
    let mut callers = Vec::new();
    for _ in 0..8 {
        let (c, barrier, url) = (c.clone(), barrier.clone(), server.url("/charge"));
        callers.push(tokio::spawn(async move {
            barrier.wait().await;
            let response = c
                .post(url)
                .body(ORDER)
                .idempotency_key("race-1")
                .send()
                .await
                .expect("send");
            read(response).await
        }));
    }
    let mut answers = Vec::new();
    for caller in callers {
        answers.push(caller.await.expect("caller"));
    }
    assert!(answers.iter().all(|(s, _, _)| *s == StatusCode::CREATED));
    assert!(
        answers.iter().all(|(_, _, b)| *b == answers[0].2),
        "one answer for all"
    );
    assert_eq!(answers.iter().filter(|(_, i, _)| !i.replayed()).count(), 1);
    assert_eq!((server.runs(), server.charges()), (1, 1), "charged once");
    let seen = server.seen();
    assert!(seen.iter().any(|s| s.status == 409), "{seen:?}");
    assert!(answers.iter().any(|(_, i, _)| i.attempts() >= 2));
    assert!(seen.iter().all(|s| s.key.as_deref() == Some("race-1")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_reused_for_another_request_stops_at_once() {
    let server = serve().await;
    let c = client(quick());
    let first = c
        .post(server.url("/charge"))
        .body(ORDER)
        .idempotency_key("reuse-1")
        .send()
        .await
        .expect("send");
    assert_eq!(first.status(), StatusCode::CREATED);
    let other = c
        .post(server.url("/charge"))
        .body(r#"{"amount":5000}"#)
        .idempotency_key("reuse-1")
        .send()
        .await
        .expect("send");
    let (status, info, body) = read(other).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(info.error_code(), Some("idempotency_key_reuse"));
    assert_eq!(body["error"], "idempotency_key_reuse");
    assert_eq!(body["retryable"], false);
    assert_eq!((info.attempts(), info.gave_up()), (1, false));
    assert_eq!(server.seen().len(), 2, "no retry of a key reuse");
    assert_eq!(server.runs(), 1);
}

/// A handler's `503` releases the key on the server; the client waits its `Retry-After` and the
/// retry runs the handler again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_released_503_is_retried_after_its_retry_after() {
    let server = serve().await;
    server.script([Scripted::plain(503).header("retry-after", "1")]);
    let started = Instant::now();
    let response = client(quick())
        .post(server.url("/charge"))
        .body(ORDER)
        .idempotent()
        .send()
        .await
        .expect("send");
    let (status, info, body) = read(response).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!((info.attempts(), info.replayed()), (2, false));
    assert!(
        started.elapsed() >= Duration::from_secs(1),
        "never before Retry-After"
    );
    assert_eq!(body["charge"], 1);
    assert_eq!((server.runs(), server.charges()), (2, 1));
}

/// A handler's plain `500` may have had its effect: final by default, retried only when the caller
/// says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handlers_plain_500_is_final_unless_configured() {
    let server = serve().await;
    server.script((0..4).map(|_| Scripted::plain(500)));
    let c = client(quick());
    let response = c
        .post(server.url("/charge"))
        .body(ORDER)
        .idempotent()
        .send()
        .await
        .expect("send");
    let (status, info, _) = read(response).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!((info.attempts(), info.gave_up()), (1, false));
    assert_eq!(server.runs(), 1);

    let policy = quick()
        .retry_status(StatusCode::INTERNAL_SERVER_ERROR)
        .max_attempts(3);
    let response = c
        .post(server.url("/charge"))
        .body(ORDER)
        .idempotent()
        .retry_policy(policy)
        .send()
        .await
        .expect("send");
    let (status, info, _) = read(response).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(info.attempts(), 3, "the attempt limit");
    assert!(info.gave_up(), "stopped on an answer still retryable");
    assert_eq!(server.runs(), 4);
    assert_eq!(server.charges(), 0);
}

/// The `retryable` member of a problem decides over the status.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_problems_retryable_member_decides() {
    let server = serve().await;
    server.script([
        Scripted::problem(
            502,
            json!({"status": 502, "error": "upstream_unavailable", "retryable": true}),
        )
        .header("retry-after", "0"),
        Scripted::problem(
            503,
            json!({"status": 503, "error": "card_blocked", "retryable": false}),
        ),
    ]);
    let c = client(quick());
    let response = c
        .post(server.url("/charge"))
        .body(ORDER)
        .idempotent()
        .send()
        .await
        .expect("send");
    // The 502 was retried; the 503 that says it is not retryable was not.
    let (status, info, body) = read(response).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(info.attempts(), 2);
    assert_eq!(info.error_code(), Some("card_blocked"));
    assert_eq!(
        body["error"], "card_blocked",
        "the problem body reaches the caller whole"
    );
    assert!(!info.gave_up());
    assert_eq!(server.runs(), 2);
}

/// Polling a request still in progress stops at the deadline with the last answer (`409`), and
/// says it gave up: the operation may still finish.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polling_stops_at_the_deadline_with_the_last_answer() {
    let server = serve_with(
        Setup {
            gated: true,
            ..Setup::default()
        },
        |b| b,
    )
    .await;
    let c = client(quick());
    let first = {
        let (c, url) = (c.clone(), server.url("/charge"));
        tokio::spawn(async move {
            c.post(url)
                .body(ORDER)
                .idempotency_key("slow-1")
                .send()
                .await
        })
    };
    server.wait_for_runs(1).await;
    // Without the deadline, 100 attempts a second apart.
    let policy = quick().deadline(Duration::from_secs(4)).max_attempts(100);
    let started = Instant::now();
    let response = c
        .post(server.url("/charge"))
        .body(ORDER)
        .idempotency_key("slow-1")
        .retry_policy(policy)
        .send()
        .await
        .expect("send");
    let elapsed = started.elapsed();
    let (status, info, body) = read(response).await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert_eq!(body["error"], "in_progress");
    assert_eq!(info.error_code(), Some("in_progress"));
    assert!(info.gave_up());
    assert!(info.attempts() >= 2, "polled: {info:?}");
    assert!(
        elapsed < Duration::from_secs(20),
        "bounded by the deadline: {elapsed:?}"
    );
    server.open();
    let first = first.await.expect("first").expect("send");
    assert_eq!(first.status(), StatusCode::CREATED);
    assert_eq!(server.charges(), 1);
}

/// An attempt still in flight at the deadline is abandoned; the error gives the key, and a later
/// send with that key gets the operation's answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_deadline_abandons_an_attempt_in_flight_and_the_key_resumes_it() {
    let server = serve_with(
        Setup {
            gated: true,
            ..Setup::default()
        },
        |b| b,
    )
    .await;
    let c = client(quick());
    let started = Instant::now();
    let error = c
        .post(server.url("/charge"))
        .body(ORDER)
        .idempotency_key("held-1")
        .retry_policy(quick().deadline(Duration::from_secs(1)))
        .send()
        .await
        .expect_err("the deadline passes first");
    assert!(started.elapsed() < Duration::from_secs(15));
    let e = idempotency_error(&error);
    assert_eq!(e.kind(), ErrorKind::GaveUp);
    assert_eq!(e.attempts(), 1);
    assert!(e.outcome_unknown() && e.is_timeout());
    let key = e.key().expect("the key").as_str().to_owned();
    assert_eq!(key, "held-1");

    // The server goes on without the caller; the same key later gets its answer.
    server.open();
    let response = c
        .post(server.url("/charge"))
        .body(ORDER)
        .idempotency_key(key)
        .send()
        .await
        .expect("send");
    let (status, info, body) = read(response).await;
    assert_eq!(status, StatusCode::CREATED);
    assert!(info.replayed());
    assert_eq!(body["charge"], 1);
    assert_eq!((server.runs(), server.charges()), (1, 1));
}

/// A streaming body cannot be sent twice: the request is sent once, with its key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streaming_body_is_sent_once() {
    let server = serve().await;
    server.script([Scripted::plain(503).header("retry-after", "0")]);
    let response = client(quick())
        .post(server.url("/charge"))
        .body(reqwest::Body::wrap(String::from(ORDER)))
        .idempotent()
        .send()
        .await
        .expect("send");
    let (status, info, _) = read(response).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(info.attempts(), 1);
    assert!(info.gave_up(), "retryable, but not sent again");
    let seen = server.seen();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].key.as_deref(), Some(info.key().as_str()));

    // Its answer lost on the way: an error with the key, the outcome unknown.
    let relay = Relay::start(server.addr).await;
    relay.lose_answers(1);
    let error = client(quick())
        .post(relay.url("/charge"))
        .body(reqwest::Body::wrap(String::from(ORDER)))
        .idempotency_key("stream-1")
        .send()
        .await
        .expect_err("the answer was lost");
    let e = idempotency_error(&error);
    assert_eq!((e.kind(), e.attempts()), (ErrorKind::Failed, 1));
    assert!(e.outcome_unknown());
    assert_eq!(e.key().map(|k| k.as_str()), Some("stream-1"));
    assert_eq!(server.charges(), 1, "it did reach the server");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_the_protocol_refuses_are_never_sent() {
    let server = serve().await;
    let c = client(quick());
    for key in [String::new(), "has space".into(), "k".repeat(256)] {
        let error = c
            .post(server.url("/charge"))
            .body(ORDER)
            .idempotency_key(key)
            .send()
            .await
            .expect_err("refused");
        let e = idempotency_error(&error);
        assert_eq!((e.kind(), e.attempts()), (ErrorKind::InvalidKey, 0));
        assert!(!e.outcome_unknown());
    }
    // A header and a given key that differ: which operation is it? Neither is sent.
    let error = c
        .post(server.url("/charge"))
        .header("idempotency-key", "from-header")
        .body(ORDER)
        .idempotency_key("given")
        .send()
        .await
        .expect_err("refused");
    assert_eq!(idempotency_error(&error).kind(), ErrorKind::ConflictingKey);
    assert!(server.seen().is_empty());
}

/// A request that already carries an `Idempotency-Key` header is idempotent with that key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_header_set_by_the_caller_is_kept_across_retries() {
    let server = serve().await;
    let relay = Relay::start(server.addr).await;
    relay.lose_answers(1);
    let response = client(quick())
        .post(relay.url("/charge"))
        .header("idempotency-key", "mine-1")
        .body(ORDER)
        .send()
        .await
        .expect("send");
    let (status, info, _) = read(response).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(info.key().as_str(), "mine-1");
    assert!(info.replayed() && info.attempts() >= 2);
    assert!(
        server
            .seen()
            .iter()
            .all(|s| s.key.as_deref() == Some("mine-1"))
    );
    assert_eq!(server.charges(), 1);
}

/// Requests not marked idempotent are not the middleware's: no key, no retry, no info.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_not_marked_pass_through_untouched() {
    let server = serve().await;
    server.script([Scripted::plain(503).header("retry-after", "0")]);
    let response = client(quick())
        .post(server.url("/plain"))
        .body(ORDER)
        .send()
        .await
        .expect("send");
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(response.idempotency().is_none());
    let seen = server.seen();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].key, None);
}

/// A server that names its replay header otherwise is understood once the client is told.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_replay_header_name_is_configurable() {
    let server = serve_with(Setup::default(), |b| b.replay_header("x-replayed")).await;
    let policy = quick().replayed_header(HeaderName::from_static("x-replayed"));
    let c = client(policy);
    for expect_replay in [false, true] {
        let response = c
            .post(server.url("/charge"))
            .body(ORDER)
            .idempotency_key("named-1")
            .send()
            .await
            .expect("send");
        assert!(response.headers().contains_key("x-replayed") == expect_replay);
        let (status, info, _) = read(response).await;
        assert_eq!(status, StatusCode::CREATED);
        assert_eq!(info.replayed(), expect_replay);
    }
    assert_eq!(server.charges(), 1);
}

/// `Retry-After` in seconds and as an HTTP date: the client never comes back earlier.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_after_in_seconds_and_as_a_date_is_waited_for() {
    let server = serve().await;
    let at = httpdate::fmt_http_date(SystemTime::now() + Duration::from_secs(3));
    server.script([
        Scripted::plain(429).header("retry-after", "1"),
        Scripted::plain(503).header("retry-after", at.clone()),
    ]);
    let started = Instant::now();
    let response = client(quick())
        .post(server.url("/plain"))
        .body(ORDER)
        .idempotent()
        .send()
        .await
        .expect("send");
    let (status, info, _) = read(response).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(info.attempts(), 3);
    // The last attempt was not sent before the date (whole seconds: up to 1 s early on the clock).
    let date = httpdate::parse_http_date(&at).expect("date");
    assert!(SystemTime::now() >= date, "came back before {at}");
    assert!(started.elapsed() >= Duration::from_secs(2));
}

/// Nothing listening: every attempt fails on the way, and the error says how often and with which
/// key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_never_answers_gives_up_with_the_key() {
    let port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        listener.local_addr().expect("addr").port()
    };
    let error = client(quick().max_attempts(3))
        .post(format!("http://127.0.0.1:{port}/charge"))
        .body(ORDER)
        .idempotency_key("nobody-1")
        .send()
        .await
        .expect_err("nobody answers");
    let e = idempotency_error(&error);
    assert_eq!(e.kind(), ErrorKind::GaveUp);
    assert_eq!(e.attempts(), 3);
    assert_eq!(e.key().map(|k| k.as_str()), Some("nobody-1"));
    assert!(e.outcome_unknown());
    assert!(
        std::error::Error::source(e).is_some(),
        "the last attempt's error"
    );
}
