//! The layer on the memory store: the shared behavioural suite, the request checks of SPEC 1 and 4,
//! and the store's own bounds.

use crate::common;
use axum_idempotency::store_suite;

use std::time::Duration;

use axum::body::Body;
use axum::http::StatusCode;
use axum_idempotency::store::{
    ClaimOutcome, ClaimRequest, IdempotencyStore, LeaseToken, RecordKey, StoreError, StoredResponse,
};
use axum_idempotency::{Fingerprint, IdempotencyLayer, MemoryStore};
use common::{app, post, send};

store_suite!(async { MemoryStore::new() });

/// The memory store says how long a finished record has left (it dates the replay's expiry
/// header), so a cache in front of it keeps its records and answers their replays.
#[tokio::test]
async fn memory_records_say_their_time_left_and_are_cached() {
    let store = MemoryStore::new();
    let cached = axum_idempotency::store::CachedStore::new(store.clone());
    let (router, _) = app(IdempotencyLayer::new(cached.clone()).expect("valid settings"));
    let req = || post("/pay").key("k").user("alice").json("{}");
    assert!(!send(&router, req()).await.replayed());
    for _ in 0..3 {
        assert!(send(&router, req()).await.replayed());
    }
    assert_eq!(cached.len(), 1);
}

fn layer() -> IdempotencyLayer<MemoryStore> {
    IdempotencyLayer::new(MemoryStore::new()).expect("valid settings")
}

#[tokio::test]
async fn missing_key_passes_through_by_default() {
    let (router, counters) = app(layer());
    for _ in 0..2 {
        let answer = send(&router, post("/pay").user("alice")).await;
        assert_eq!(answer.status, StatusCode::CREATED);
        assert!(!answer.replayed());
    }
    assert_eq!(counters.started(), 2, "no key, no guard");
}

#[tokio::test]
async fn missing_key_is_400_when_required() {
    let layer = IdempotencyLayer::builder(MemoryStore::new())
        .require_key(true)
        .build()
        .expect("layer");
    let (router, counters) = app(layer);
    let answer = send(&router, post("/pay").user("alice")).await;
    assert_eq!(answer.status, StatusCode::BAD_REQUEST);
    assert_eq!(answer.problem(), "missing_idempotency_key");
    assert_eq!(counters.started(), 0);
}

#[tokio::test]
async fn invalid_keys_are_400() {
    let (router, counters) = app(layer());
    let too_long = "k".repeat(256);
    // Control characters cannot reach a handler through HTTP/1 (the parser refuses them); the key
    // parser's unit tests cover them.
    let bad: [&[u8]; 4] = [b"", b"   ", too_long.as_bytes(), "clé".as_bytes()];
    for key in bad {
        let answer = send(
            &router,
            post("/pay")
                .user("alice")
                .raw_header("idempotency-key", key),
        )
        .await;
        assert_eq!(answer.status, StatusCode::BAD_REQUEST, "{key:?}");
        assert_eq!(answer.problem(), "invalid_idempotency_key");
    }
    let twice = send(&router, post("/pay").user("alice").key("a").key("a")).await;
    assert_eq!(twice.status, StatusCode::BAD_REQUEST);
    assert_eq!(twice.problem(), "invalid_idempotency_key");
    assert_eq!(counters.started(), 0);
}

#[tokio::test]
async fn quoted_trimmed_and_bare_keys_are_one_key() {
    let (router, counters) = app(layer());
    let first = send(&router, post("/pay").user("alice").key("abc")).await;
    for same in ["\"abc\"", "  abc  "] {
        let answer = send(&router, post("/pay").user("alice").key(same)).await;
        assert!(answer.replayed(), "{same}");
        assert_eq!(answer.body, first.body);
    }
    assert_eq!(counters.started(), 1);
}

#[tokio::test]
async fn missing_subject_is_401_unless_anonymous_is_allowed() {
    let (router, counters) = app(layer());
    let answer = send(&router, post("/pay").key("k")).await;
    assert_eq!(answer.status, StatusCode::UNAUTHORIZED);
    assert_eq!(answer.problem(), "missing_subject");
    assert_eq!(counters.started(), 0);

    let anonymous = IdempotencyLayer::builder(MemoryStore::new())
        .allow_anonymous(true)
        .build()
        .expect("layer");
    let (router, counters) = app(anonymous);
    let first = send(&router, post("/pay").key("k")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let second = send(&router, post("/pay").key("k")).await;
    assert!(second.replayed());
    // An authenticated subject is not the anonymous scope.
    let alice = send(&router, post("/pay").key("k").user("alice")).await;
    assert!(!alice.replayed());
    assert_eq!(counters.started(), 2);
}

#[tokio::test]
async fn subject_comes_from_a_custom_extractor() {
    let layer = IdempotencyLayer::builder(MemoryStore::new())
        .subject_extractor(|parts: &axum::http::request::Parts| {
            parts
                .headers
                .get("x-tenant")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        })
        .build()
        .expect("layer");
    let (router, counters) = app(layer);
    let a = send(&router, post("/pay").key("k").header("x-tenant", "t1")).await;
    assert_eq!(a.status, StatusCode::CREATED);
    let b = send(&router, post("/pay").key("k").header("x-tenant", "t2")).await;
    assert!(!b.replayed());
    let a2 = send(&router, post("/pay").key("k").header("x-tenant", "t1")).await;
    assert!(a2.replayed());
    assert_eq!(counters.started(), 2);
}

#[tokio::test]
async fn endpoint_can_be_overridden() {
    // Both routes are one operation when the endpoint function says so.
    let layer = IdempotencyLayer::builder(MemoryStore::new())
        .endpoint(|parts| format!("{} payments", parts.method))
        .build()
        .expect("layer");
    let (router, counters) = app(layer);
    send(&router, post("/pay").key("k").user("alice")).await;
    let other = send(&router, post("/other").key("k").user("alice")).await;
    assert!(other.replayed());
    assert_eq!(counters.started(), 1);
}

#[tokio::test]
async fn body_over_the_limit_is_413_before_the_handler() {
    let layer = IdempotencyLayer::builder(MemoryStore::new())
        .body_limit(16)
        .build()
        .expect("layer");
    let (router, counters) = app(layer);
    // Declared too large by Content-Length.
    let declared = send(
        &router,
        post("/pay").key("a").user("alice").json(&"x".repeat(17)),
    )
    .await;
    assert_eq!(declared.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(declared.problem(), "request_too_large");
    // Streamed without a Content-Length.
    let chunks: Vec<Result<&'static str, std::io::Error>> =
        vec![Ok("0123456789"), Ok("0123456789")];
    let streamed = Body::from_stream(futures_util::stream::iter(chunks));
    let answer = send(&router, post("/pay").key("b").user("alice").body(streamed)).await;
    assert_eq!(answer.status, StatusCode::PAYLOAD_TOO_LARGE);
    // Exactly at the limit is fine.
    let ok = send(
        &router,
        post("/pay").key("c").user("alice").json(&"x".repeat(16)),
    )
    .await;
    assert_eq!(ok.status, StatusCode::CREATED);
    assert_eq!(counters.started(), 1);
}

#[tokio::test]
async fn unreadable_body_is_400() {
    let (router, counters) = app(layer());
    let chunks: Vec<Result<&'static str, std::io::Error>> =
        vec![Ok("{\"a\""), Err(std::io::Error::other("connection reset"))];
    let broken = Body::from_stream(futures_util::stream::iter(chunks));
    let answer = send(&router, post("/pay").key("k").user("alice").body(broken)).await;
    assert_eq!(answer.status, StatusCode::BAD_REQUEST);
    assert_eq!(answer.problem(), "unreadable_request_body");
    assert_eq!(counters.started(), 0);
    // Nothing was claimed: the same key works once the body arrives whole.
    let ok = send(&router, post("/pay").key("k").user("alice").json("{}")).await;
    assert_eq!(ok.status, StatusCode::CREATED);
}

#[tokio::test]
async fn safe_and_unguarded_methods_pass_through() {
    let (router, counters) = app(layer());
    for _ in 0..2 {
        let answer = send(&router, post("/pay").method("GET").key("k").user("alice")).await;
        assert!(!answer.replayed());
    }
    assert_eq!(counters.started(), 2);
}

/// A store that fails every call, as a database that is down does.
#[derive(Clone)]
struct DownStore;

impl IdempotencyStore for DownStore {
    async fn claim(&self, _: &ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        Err(StoreError::msg("connection refused"))
    }
    async fn complete(
        &self,
        _: &RecordKey,
        _: LeaseToken,
        _: &axum_idempotency::Fingerprint,
        _: std::sync::Arc<StoredResponse>,
        _: Duration,
    ) -> Result<axum_idempotency::store::Fenced, StoreError> {
        Err(StoreError::msg("connection refused"))
    }
    async fn renew(
        &self,
        _: &RecordKey,
        _: LeaseToken,
        _: Duration,
    ) -> Result<axum_idempotency::store::Fenced, StoreError> {
        Err(StoreError::msg("connection refused"))
    }
    async fn release(
        &self,
        _: &RecordKey,
        _: LeaseToken,
    ) -> Result<axum_idempotency::store::Fenced, StoreError> {
        Err(StoreError::msg("connection refused"))
    }
    async fn purge_expired(&self) -> Result<u64, StoreError> {
        Err(StoreError::msg("connection refused"))
    }
    async fn count_records(
        &self,
        _: &str,
        _: u64,
    ) -> Result<Option<axum_idempotency::store::SubjectUsage>, StoreError> {
        Err(StoreError::msg("connection refused"))
    }
    fn counts_records(&self) -> bool {
        true
    }

    fn operation_timeout(&self) -> Option<Duration> {
        None
    }
    async fn keeper_session(&self) -> Result<Self, StoreError> {
        Err(StoreError::msg("connection refused"))
    }
    async fn show_presences(
        &self,
        _: &[axum_idempotency::store::Presence],
        _lapse: Duration,
    ) -> Result<(), StoreError> {
        Err(StoreError::msg("connection refused"))
    }
    async fn lookup(
        &self,
        _: &RecordKey,
    ) -> Result<Option<axum_idempotency::store::RecordInfo>, StoreError> {
        Err(StoreError::msg("connection refused"))
    }
    async fn delete(&self, _: &RecordKey) -> Result<axum_idempotency::store::Deleted, StoreError> {
        Err(StoreError::msg("connection refused"))
    }
    async fn list(
        &self,
        _: &str,
        _: axum_idempotency::store::ListRequest,
    ) -> Result<axum_idempotency::store::RecordPage, StoreError> {
        Err(StoreError::msg("connection refused"))
    }
}

#[tokio::test]
async fn store_failure_is_503_and_runs_nothing() {
    let (router, counters) = app(IdempotencyLayer::new(DownStore).expect("valid settings"));
    let answer = send(&router, post("/pay").key("k").user("alice")).await;
    assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(answer.problem(), "idempotency_store_unavailable");
    assert_eq!(answer.header("retry-after"), Some("2"));
    assert_eq!(counters.started(), 0);
}

#[tokio::test]
async fn store_failure_runs_unguarded_when_failing_open() {
    let layer = IdempotencyLayer::builder(DownStore)
        .fail_open(true)
        .build()
        .expect("layer");
    let (router, counters) = app(layer);
    let answer = send(&router, post("/pay").key("k").user("alice")).await;
    assert_eq!(answer.status, StatusCode::CREATED);
    assert_eq!(counters.started(), 1);
}

#[tokio::test]
async fn memory_is_bounded_by_retention() {
    let store = MemoryStore::new();
    let claim = |i: usize, retention: Duration| {
        ClaimRequest::new(
            RecordKey {
                key: format!("k{i}"),
                subject: format!("s{}", i % 100),
                endpoint: "POST /pay".into(),
            },
            Fingerprint::of(None, b"{}"),
            Duration::from_millis(10),
            retention,
        )
    };
    // 50 000 live records (many subjects, many keys each), then all expire.
    for i in 0..50_000 {
        store
            .claim(&claim(i, Duration::from_secs(2)))
            .await
            .expect("claim");
    }
    assert_eq!(store.len(), 50_000);
    tokio::time::sleep(Duration::from_millis(2100)).await;
    assert_eq!(store.purge_expired().await.expect("purge"), 50_000);
    assert!(store.is_empty());
    // Without explicit purges, the amortised sweep keeps the store from growing past what
    // retention keeps alive: here, at most the last few thousand records.
    for round in 0..5 {
        for i in 0..10_000 {
            let request = claim(round * 10_000 + i, Duration::from_millis(50));
            store.claim(&request).await.expect("claim");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(store.len() <= 25_000, "store grew to {}", store.len());
}

#[tokio::test]
async fn outcomes_are_reported_to_the_hook() {
    let outcomes = axum_idempotency::OutcomeCounters::new();
    let layer = IdempotencyLayer::builder(MemoryStore::new())
        .on_outcome(outcomes.hook())
        .build()
        .expect("layer");
    let (router, _) = app(layer);
    use axum_idempotency::Outcome;
    send(&router, post("/pay").key("k").user("alice").json("{}")).await;
    send(&router, post("/pay").key("k").user("alice").json("{}")).await;
    send(
        &router,
        post("/pay").key("k").user("alice").json("{\"a\":1}"),
    )
    .await;
    send(&router, post("/pay").key("").user("alice")).await;
    send(
        &router,
        post("/pay")
            .key("r")
            .user("alice")
            .header("x-status", "503"),
    )
    .await;
    let expected = [
        (Outcome::Claimed, 2),
        (Outcome::Recorded, 1),
        (Outcome::Replayed, 1),
        (Outcome::KeyReuse, 1),
        (Outcome::Rejected, 1),
        (Outcome::Released, 1),
        (Outcome::InProgress, 0),
    ];
    for (outcome, count) in expected {
        assert_eq!(outcomes.get(outcome), count, "{outcome:?}");
    }
}

#[tokio::test]
async fn deeply_nested_json_is_handled_without_overflow() {
    // 100 000 levels: too deep to canonicalise, so fingerprinted as bytes; the request still works.
    let (router, counters) = app(layer());
    let deep = "[".repeat(100_000) + &"]".repeat(100_000);
    let first = send(&router, post("/pay").key("deep").user("alice").json(&deep)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let again = send(&router, post("/pay").key("deep").user("alice").json(&deep)).await;
    assert!(again.replayed());
    assert_eq!(counters.started(), 1);
}

/// The runtime shuts down while a guarded request is in flight (a deploy's SIGTERM): the held
/// claim's clean-up must not recurse (a lease dropped unpolled used to spawn another lease, whose
/// drop spawned again, until the stack overflowed and the process aborted).
#[test]
fn runtime_shutdown_mid_request_does_not_crash() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let (router, counters) = app(layer());
    runtime.spawn(async move {
        send(
            &router,
            post("/pay")
                .key("k")
                .user("alice")
                .header("x-delay-ms", "5000"),
        )
        .await
    });
    for _ in 0..100 {
        if counters.started() == 1 {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(counters.started(), 1, "the handler is running");
    drop(runtime); // shuts down with the request, its lease and its heartbeat in flight
    assert_eq!(counters.finished(), 0);
}

#[tokio::test]
async fn replay_header_name_is_configurable() {
    let layer = IdempotencyLayer::builder(MemoryStore::new())
        .replay_header("X-Replayed")
        .build()
        .expect("layer");
    let (router, counters) = app(layer);
    let req = || post("/pay").key("k").user("alice").json("{}");
    let first = send(&router, req()).await;
    assert_eq!(first.header("x-replayed"), None);
    let again = send(&router, req()).await;
    assert_eq!(again.status, StatusCode::CREATED);
    assert_eq!(again.body, first.body);
    assert_eq!(again.header("x-replayed"), Some("true"));
    assert_eq!(again.header("idempotent-replayed"), None);
    assert_eq!(counters.started(), 1);
}

// ---- once through operations (SPEC 13) ----

/// A handler that never returns is cancelled at the maximum hold: its effect may have happened, so
/// the key's record is a definitive `504 idempotency_handler_timeout` that replays, and the handler
/// never runs again for that key.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn handler_past_the_maximum_hold_is_recorded_as_a_timeout() {
    let layer = IdempotencyLayer::builder(MemoryStore::new())
        .in_progress_ttl(Duration::from_millis(100))
        .max_hold(Duration::from_millis(400))
        .build()
        .expect("layer");
    let (router, counters) = app(layer);
    let req = || {
        post("/pay")
            .key("k")
            .user("alice")
            .header("x-delay-ms", "600000")
    };
    let started = std::time::Instant::now();
    let first = send(&router, req()).await;
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(
        {
            assert_eq!(first.status, StatusCode::GATEWAY_TIMEOUT);
            first.problem()
        },
        "idempotency_handler_timeout"
    );
    assert!(!first.replayed());
    let retry = send(&router, req()).await;
    assert_eq!(retry.status, StatusCode::GATEWAY_TIMEOUT);
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(retry.body, first.body);
    assert_eq!(counters.started(), 1);
}

/// A streamed body that stalls with the client still connected is cut at the maximum hold, and
/// the response the client saw (its status) is recorded without its body: the key is usable
/// (replayed) from then on, not in progress for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stalled_stream_with_the_client_connected_ends_at_the_maximum_hold() {
    use http_body_util::BodyExt;
    use tower::ServiceExt;
    let layer = IdempotencyLayer::builder(MemoryStore::new())
        .in_progress_ttl(Duration::from_millis(100))
        .max_hold(Duration::from_millis(500))
        .build()
        .expect("layer");
    let (router, counters) = app(layer);
    let req = || {
        post("/pay")
            .key("k")
            .user("alice")
            .header("x-stream", "stall")
    };
    let response = router
        .clone()
        .oneshot(req().build())
        .await
        .expect("response");
    assert_eq!(response.status(), StatusCode::CREATED);
    let mut body = response.into_body();
    let first = body.frame().await.expect("a frame").expect("data");
    assert_eq!(first.into_data().expect("data"), "part1;");
    // The client keeps reading: the body is cut with an error at the maximum hold.
    let rest = tokio::time::timeout(Duration::from_secs(10), body.frame())
        .await
        .expect("the body ends at the maximum hold");
    assert!(matches!(rest, Some(Err(_)) | None), "{rest:?}");
    let retry = send(&router, req()).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    assert!(retry.replayed());
    assert_eq!(retry.header("idempotency-replay"), Some("omitted"));
    assert_eq!(counters.started(), 1);
}

/// Requests whose clients went away run on, detached, but only up to `max_running` at once: past
/// it, new guarded requests get `503 idempotency_overloaded` before any claim, so a client that
/// sends and resets requests in a loop cannot make the server run unbounded work.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn detached_requests_are_bounded() {
    let layer = IdempotencyLayer::builder(MemoryStore::new())
        .max_running(3)
        .max_in_flight_per_subject(3)
        .build()
        .expect("layer");
    let drain = layer.drain();
    let (router, counters) = app(layer);
    let (mut detached, mut overloaded) = (0, 0);
    for i in 0..20 {
        let req = post("/pay")
            .key(&format!("k{i}"))
            .user(&format!("user-{i}"))
            .header("x-delay-ms", "3000");
        // The client gives up (its future is dropped: a reset stream) before the handler answers.
        match tokio::time::timeout(Duration::from_millis(50), send(&router, req)).await {
            Err(_) => detached += 1,
            Ok(answer) => {
                assert_eq!(
                    {
                        assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE);
                        answer.problem()
                    },
                    "idempotency_overloaded"
                );
                assert!(answer.header("retry-after").is_some());
                overloaded += 1;
            }
        }
        assert!(drain.detached() <= 3, "{} detached", drain.detached());
    }
    assert_eq!((detached, overloaded), (3, 17));
    assert_eq!(
        counters.started(),
        3,
        "refused requests never reached the handler"
    );
    // The detached ones finish and record; then requests are admitted again.
    assert!(drain.wait(Duration::from_secs(20)).await);
    let replay = send(
        &router,
        post("/pay")
            .key("k0")
            .user("user-0")
            .header("x-delay-ms", "3000"),
    )
    .await;
    assert!(replay.replayed(), "{replay:?}");
    let fresh = send(&router, post("/pay").key("new").user("alice")).await;
    assert_eq!(fresh.status, StatusCode::CREATED);
}

/// A full memory store refuses new keys with `503 idempotency_store_full` and evicts nothing: keys
/// recorded before still replay.
#[tokio::test]
async fn a_full_memory_store_refuses_new_keys_and_keeps_the_old() {
    // One subject may take the whole store here: the share is the capacity.
    let store = MemoryStore::with_capacity_and_share(4 * 1024, 4 * 1024);
    let (router, counters) = app(IdempotencyLayer::new(store.clone()).expect("valid settings"));
    let mut stored = Vec::new();
    let refused = loop {
        let key = format!("key-{}", stored.len());
        let answer = send(&router, post("/pay").key(&key).user("alice")).await;
        if answer.status != StatusCode::CREATED {
            break answer;
        }
        stored.push((key, answer.body));
        assert!(stored.len() < 1000, "the capacity is never reached");
    };
    assert_eq!(refused.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(refused.problem(), "idempotency_store_full");
    assert!(refused.header("retry-after").is_some());
    assert!(stored.len() >= 3, "{} records fit", stored.len());
    let runs = counters.started();
    for (key, body) in &stored {
        let replay = send(&router, post("/pay").key(key).user("alice")).await;
        assert!(replay.replayed(), "{key} was evicted");
        assert_eq!(&replay.body, body);
    }
    assert_eq!(counters.started(), runs, "no handler ran again");
    assert!(store.bytes() <= 4 * 1024 + 1024);
}

/// One subject that takes fresh keys without end fills its share of the memory store and no more:
/// its next keys get `429 idempotency_quota_exceeded` (its finished records still replay), and
/// another subject is served from the room left.
#[tokio::test]
async fn one_subject_cannot_fill_the_memory_store_for_the_others() {
    let store = MemoryStore::with_capacity_and_share(64 * 1024, 8 * 1024);
    let (router, counters) = app(IdempotencyLayer::new(store.clone()).expect("valid settings"));
    // A long subject, as the reproduction had: each record costs more of the share.
    let mallory = "m".repeat(1000);
    let mut taken = Vec::new();
    let refused = loop {
        let key = format!("flood-{}", taken.len());
        let answer = send(&router, post("/pay").key(&key).user(&mallory)).await;
        if answer.status != StatusCode::CREATED {
            break answer;
        }
        taken.push(key);
        assert!(taken.len() < 1000, "the share is never reached");
    };
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS, "{refused:?}");
    assert_eq!(refused.problem(), "idempotency_quota_exceeded");
    assert!(refused.header("retry-after").is_some());
    assert!(
        store.bytes() <= 8 * 1024 + 4 * 1024,
        "one subject holds {} bytes",
        store.bytes()
    );
    // Its finished records still replay.
    let replay = send(&router, post("/pay").key(&taken[0]).user(&mallory)).await;
    assert!(replay.replayed(), "{replay:?}");
    // Every other subject is served.
    let runs = counters.started();
    for i in 0..20 {
        let answer = send(&router, post("/pay").key(&format!("k{i}")).user("alice")).await;
        assert_eq!(answer.status, StatusCode::CREATED, "{answer:?}");
    }
    assert_eq!(counters.started(), runs + 20);
}

/// The claims of one subject are small and all pass its share; their answers are not: a completion
/// that would take the subject past its share is recorded without its body, so the subject cannot
/// fill the store through the answers of the claims it holds, and another subject is still served.
#[tokio::test]
async fn answers_past_a_subjects_share_are_kept_without_their_body() {
    use axum_idempotency::store::Finished;
    use std::sync::Arc;
    let store = MemoryStore::with_capacity_and_share(64 * 1024, 8 * 1024);
    let claim = |key: String, subject: &str| {
        ClaimRequest::new(
            RecordKey {
                key,
                subject: subject.into(),
                endpoint: "POST /export".into(),
            },
            Fingerprint::of(None, b"{}"),
            Duration::from_secs(30),
            Duration::from_secs(600),
        )
    };
    // Twenty claims in flight at once, each small.
    let mut held = Vec::new();
    for n in 0..20 {
        let request = claim(format!("k{n}"), "mallory");
        let outcome = store.claim(&request).await.expect("claim");
        assert!(
            matches!(outcome, ClaimOutcome::Claimed { .. }),
            "{outcome:?}"
        );
        held.push(request);
    }
    // Each answers 16 KiB: twice the subject's share, five times the store between them.
    let big = Arc::new(StoredResponse::new(
        Finished::Completed,
        200,
        Vec::new(),
        Some(bytes::Bytes::from(vec![b'x'; 16 * 1024])),
    ));
    for request in &held {
        let done = store
            .complete(
                &request.key,
                request.lease,
                &request.fingerprint,
                big.clone(),
                request.retention,
            )
            .await;
        assert!(done.expect("complete").is_done(), "never refused");
    }
    assert!(
        store.bytes() <= 8 * 1024 + 4 * 1024,
        "one subject holds {} bytes",
        store.bytes()
    );
    // Every answer is recorded; those past the share without their body.
    let mut omitted = 0;
    for request in &held {
        let replay = claim(request.key.key.clone(), "mallory");
        match store.claim(&replay).await.expect("claim") {
            ClaimOutcome::Finished(stored) => omitted += usize::from(stored.body_omitted),
            other => panic!("not recorded: {other:?}"),
        }
    }
    assert!(omitted >= 19, "{omitted} of 20 kept without their body");
    // Another subject is served.
    let outcome = store.claim(&claim("a".into(), "alice")).await;
    assert!(matches!(
        outcome.expect("claim"),
        ClaimOutcome::Claimed { .. }
    ));
}

/// A response policy that panics after the handler answered does not release the record (that
/// would run the handler again on the retry): the answer is recorded and replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_response_policy_does_not_release_an_effect() {
    let layer = IdempotencyLayer::builder(MemoryStore::new())
        .response_policy(|_| panic!("a policy with a bug"))
        .build()
        .expect("layer");
    let (router, counters) = app(layer);
    let req = || post("/pay").key("k").user("alice");
    let first = send(&router, req()).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let retry = common::suite::until_not_in_progress(&router, req, 100).await;
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(retry.body, first.body);
    assert_eq!(counters.started(), 1);
}

/// `build()` refuses an in-progress TTL that is not at least twice the store's operation timeout:
/// a claim answered at the end of its timeout must still leave time to prove it is held.
#[cfg(feature = "postgres")]
#[tokio::test]
async fn a_ttl_below_twice_the_store_timeout_is_refused() {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .connect_lazy("postgres://localhost/none")
        .expect("lazy pool");
    let store =
        axum_idempotency::store::PostgresStore::new(pool).with_timeout(Duration::from_secs(5));
    let refused = IdempotencyLayer::builder(store.clone())
        .in_progress_ttl(Duration::from_secs(9))
        .build()
        .expect_err("refused");
    assert!(
        refused.to_string().contains("operation timeout"),
        "{refused}"
    );
    assert!(
        IdempotencyLayer::builder(store)
            .in_progress_ttl(Duration::from_secs(10))
            .build()
            .is_ok()
    );
}

/// A handler that sets the replay marker (or `Idempotency-Replay`) on a fresh answer: the client
/// must not be told that a new charge is a replay. Hop-by-hop headers are never recorded nor
/// replayed, even when configured.
#[tokio::test]
async fn fresh_answers_never_carry_a_replay_marker_and_hop_headers_are_not_stored() {
    use axum::routing::post as route_post;
    for hop in [
        "keep-alive",
        "upgrade",
        "te",
        "trailer",
        "proxy-connection",
        "authentication-info",
    ] {
        let refused = IdempotencyLayer::builder(MemoryStore::new())
            .store_header(hop)
            .build()
            .expect_err("refused");
        assert!(
            refused.to_string().contains("never stored"),
            "{hop}: {refused}"
        );
    }
    let layer = IdempotencyLayer::new(MemoryStore::new()).expect("valid settings");
    let router = axum::Router::new()
        .route(
            "/pay",
            route_post(|| async {
                (
                    StatusCode::CREATED,
                    [
                        ("idempotent-replayed", "true"),
                        ("idempotency-replay", "omitted"),
                        ("keep-alive", "timeout=5"),
                        ("content-type", "text/plain"),
                    ],
                    "charged",
                )
            })
            .layer(layer),
        )
        .layer(axum::middleware::from_fn(as_alice));
    let fresh = send(&router, post("/pay").key("k")).await;
    assert_eq!(fresh.status, StatusCode::CREATED);
    assert!(fresh.header("idempotent-replayed").is_none(), "{fresh:?}");
    assert!(fresh.header("idempotency-replay").is_none(), "{fresh:?}");
    let replay = send(&router, post("/pay").key("k")).await;
    assert!(replay.replayed());
    assert!(
        replay.header("idempotency-replay").is_none(),
        "the body was recorded: {replay:?}"
    );
    assert!(replay.header("keep-alive").is_none(), "{replay:?}");
    assert_eq!(replay.header("content-type"), Some("text/plain"));
}

/// The derived key a handler forwards to a provider: the same request under two layers with
/// different deployment secrets gets different keys (two deployments sharing a provider account
/// do not collide); the same key reused after its record was deleted (a new operation) gets a new
/// one; a replay runs nothing.
#[tokio::test]
async fn derived_keys_differ_across_deployment_secrets_and_generations() {
    use axum::routing::post as route_post;
    use axum_idempotency::IdempotencyContext;
    fn router(layer: IdempotencyLayer<MemoryStore>) -> axum::Router {
        axum::Router::new()
            .route(
                "/pay",
                route_post(|ctx: IdempotencyContext| async move { ctx.derived_key() }).layer(layer),
            )
            .layer(axum::middleware::from_fn(as_alice))
    }
    let layer = |secret: &str| {
        IdempotencyLayer::builder(MemoryStore::new())
            .derived_key_secret(secret)
            .build()
            .expect("layer")
    };
    let production = router(layer("production-secret-0001"));
    let staging = router(layer("staging-secret-00000001"));
    let req = || post("/pay").key("order-1").json(r#"{"amount":100}"#);
    let a = send(&production, req()).await;
    let b = send(&staging, req()).await;
    assert_eq!((a.status, b.status), (StatusCode::OK, StatusCode::OK));
    assert_eq!(a.body.len(), 64);
    assert_ne!(a.body, b.body, "two deployments, two provider keys");
    assert_eq!(send(&production, req()).await.body, a.body, "the replay");
    let short = IdempotencyLayer::builder(MemoryStore::new())
        .derived_key_secret("too short")
        .build()
        .expect_err("refused");
    assert!(short.to_string().contains("16 bytes"), "{short}");
    // Reused after retention: another operation, another provider key.
    let retention = Duration::from_millis(200);
    let expiring = router(
        IdempotencyLayer::builder(MemoryStore::new())
            .retention(retention)
            .build()
            .expect("layer"),
    );
    let first = send(&expiring, req()).await;
    tokio::time::sleep(retention + Duration::from_millis(100)).await;
    let reused = send(&expiring, req()).await;
    assert!(!reused.replayed());
    assert_ne!(
        first.body, reused.body,
        "a key reused after retention is a new operation"
    );
}

/// Hardening of the settings: a minimum key length (for the shared anonymous scope), bounds on
/// `body_limit` and retention.
#[tokio::test]
async fn short_keys_can_be_refused_and_settings_are_bounded() {
    let layer = IdempotencyLayer::builder(MemoryStore::new())
        .allow_anonymous(true)
        .min_key_length(16)
        .build()
        .expect("layer");
    let (router, counters) = app(layer);
    let short = send(&router, post("/pay").key("order-1")).await;
    assert_eq!(short.status, StatusCode::BAD_REQUEST);
    assert_eq!(short.problem(), "invalid_idempotency_key");
    let long = send(&router, post("/pay").key("5f0c2a0e-8f5e-4c1b-9d3a")).await;
    assert_eq!(long.status, StatusCode::CREATED);
    assert_eq!(counters.started(), 1);
    let refused = |b: axum_idempotency::IdempotencyLayerBuilder<MemoryStore>| {
        b.build().expect_err("refused").to_string()
    };
    assert!(
        refused(IdempotencyLayer::builder(MemoryStore::new()).body_limit(65 * 1024 * 1024))
            .contains("64 MiB")
    );
    assert!(
        refused(IdempotencyLayer::builder(MemoryStore::new()).retention(Duration::from_millis(5)))
            .contains("100 ms")
    );
    assert!(
        refused(IdempotencyLayer::builder(MemoryStore::new()).min_key_length(0))
            .contains("min_key_length")
    );
}

/// Subjects and endpoints are not logged as they are (personal data, forged log lines): the span
/// carries their hashes, unless the application opts in.
#[tokio::test]
async fn subjects_and_endpoints_are_logged_as_hashes_by_default() {
    use std::sync::{Arc, Mutex};
    #[derive(Clone, Default)]
    struct Buffer(Arc<Mutex<Vec<u8>>>);
    impl std::io::Write for Buffer {
        fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
            self.0.lock().expect("buffer").extend_from_slice(data);
            Ok(data.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let logs = |raw: bool, secret: Option<&'static str>| async move {
        let buffer = Buffer::default();
        let writer = buffer.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::DEBUG)
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish();
        let _guard = tracing::subscriber::set_default(subscriber);
        let mut builder = IdempotencyLayer::builder(MemoryStore::new()).log_scope(raw);
        if let Some(secret) = secret {
            builder = builder.derived_key_secret(secret);
        }
        let (router, _) = app(builder.build().expect("layer"));
        send(&router, post("/pay").key("k").user("alice@example.com")).await;
        String::from_utf8(buffer.0.lock().expect("buffer").clone()).expect("utf-8")
    };
    let subject_hash = |logs: &str| -> String {
        let at = logs.find("subject_hash=").expect("a subject hash") + "subject_hash=".len();
        logs[at..at + 16].to_owned()
    };
    let hashed = logs(false, None).await;
    assert!(hashed.contains("subject_hash="), "{hashed}");
    assert!(!hashed.contains("alice@example.com"), "{hashed}");
    assert!(!hashed.contains("/pay"), "{hashed}");
    // Keyed: not the plain SHA-256 of the subject, which anyone could compute from a guess.
    use sha2::Digest;
    let unkeyed: String = sha2::Sha256::digest(b"alice@example.com")[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_ne!(subject_hash(&hashed), unkeyed);
    // Under the deployment secret, every instance logs the same hash; another secret, another.
    let a = subject_hash(&logs(false, Some("a deployment secret, 32 bytes..")).await);
    let b = subject_hash(&logs(false, Some("a deployment secret, 32 bytes..")).await);
    let c = subject_hash(&logs(false, Some("another deployment secret here..")).await);
    assert_eq!(a, b);
    assert_ne!(a, c);
    assert_ne!(a, unkeyed);
    let raw = logs(true, None).await;
    assert!(raw.contains("alice@example.com"), "{raw}");
}

/// Two routes with layers of different settings, each attached to its handler: each route keeps
/// its own (with `Router::route_layer` the first route would get both layers).
#[tokio::test]
async fn two_routes_keep_their_own_layers_settings() {
    use axum::handler::Handler;
    use axum::routing::post as route_post;
    let store = MemoryStore::new();
    let strict = IdempotencyLayer::new(store.clone()).expect("valid settings");
    let lenient = IdempotencyLayer::builder(store)
        .fingerprint_ignore(["/ts"])
        .build()
        .expect("layer");
    async fn ok() -> &'static str {
        "done"
    }
    let router = axum::Router::new()
        .route("/payments", route_post(ok.layer(strict)))
        .route("/refunds", route_post(ok.layer(lenient)))
        .layer(axum::middleware::from_fn(as_alice));
    let first = |path: &str| post(path).key("k").json(r#"{"a":1,"ts":1}"#);
    let later = |path: &str| post(path).key("k").json(r#"{"a":1,"ts":2}"#);
    assert_eq!(
        send(&router, first("/payments")).await.status,
        StatusCode::OK
    );
    let strict_retry = send(&router, later("/payments")).await;
    assert_eq!(
        strict_retry.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "{strict_retry:?}"
    );
    assert_eq!(
        send(&router, first("/refunds")).await.status,
        StatusCode::OK
    );
    let lenient_retry = send(&router, later("/refunds")).await;
    assert!(lenient_retry.replayed(), "{lenient_retry:?}");
}

/// Test auth for routers built here with handlers of their own: every request is alice's.
async fn as_alice(
    mut request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    request
        .extensions_mut()
        .insert(axum_idempotency::Subject("alice".into()));
    next.run(request).await
}

/// The replay hook sees the request and the stored answer, and changes the replay's headers; a
/// hook that panics leaves the replay as it was. Fresh answers never go through it.
#[tokio::test]
async fn the_replay_hook_changes_replayed_headers() {
    let layer = IdempotencyLayer::builder(MemoryStore::new())
        .on_replay(|request, stored, headers| {
            let id = request
                .headers()
                .get("x-request-id")
                .cloned()
                .unwrap_or(axum::http::HeaderValue::from_static("none"));
            headers.insert("x-replay-of", id);
            headers.insert("x-stored-status", stored.status.into());
            if request.headers().contains_key("x-hook-panics") {
                panic!("the hook panicked on purpose");
            }
        })
        .build()
        .expect("layer");
    let (router, counters) = app(layer);
    let req = || {
        post("/pay")
            .key("hooked")
            .user("alice")
            .header("x-request-id", "r-1")
            .json("{}")
    };
    let fresh = send(&router, req()).await;
    assert_eq!(fresh.header("x-replay-of"), None, "not on a fresh answer");
    let replay = send(&router, req()).await;
    assert!(replay.replayed());
    assert_eq!(replay.header("x-replay-of"), Some("r-1"));
    assert_eq!(replay.header("x-stored-status"), Some("201"));
    let panicked = send(&router, req().header("x-hook-panics", "1")).await;
    assert!(panicked.replayed());
    assert_eq!(panicked.body, fresh.body);
    assert_eq!(
        panicked.header("x-replay-of"),
        None,
        "the hook's changes are dropped"
    );
    assert_eq!(counters.started(), 1);
}

/// The application renders the layer's errors its own way; a retryable one keeps `Retry-After`
/// whatever the renderer does, and a renderer that panics gives way to problem+json.
#[tokio::test]
async fn errors_are_rendered_by_the_application() {
    let layer = IdempotencyLayer::builder(MemoryStore::new())
        .require_key(true)
        .render_errors(|problem| {
            if problem.detail.contains("different body") {
                panic!("the renderer panicked on purpose");
            }
            // A renderer that says 200 for everything: a retryable answer keeps its status.
            let status = if problem.retry_after.is_some() {
                StatusCode::OK
            } else {
                problem.kind.status()
            };
            axum::http::Response::builder()
                .status(status)
                .header("content-type", "text/plain")
                .body(axum::body::Body::from(format!(
                    "{}|{}|{}",
                    problem.kind.code(),
                    problem.instance,
                    problem.retry_after.unwrap_or(0)
                )))
                .expect("response")
        })
        .build()
        .expect("layer");
    let (router, _) = app(layer);
    let missing = send(&router, post("/pay").user("alice").json("{}")).await;
    assert_eq!(missing.status, StatusCode::BAD_REQUEST);
    assert_eq!(missing.header("content-type"), Some("text/plain"));
    let text = String::from_utf8_lossy(&missing.body).into_owned();
    assert!(
        text.starts_with("missing_idempotency_key|urn:uuid:"),
        "{text}"
    );
    assert_eq!(missing.header("retry-after"), None);

    let slow = tokio::spawn({
        let router = router.clone();
        async move {
            send(
                &router,
                post("/pay")
                    .key("k")
                    .user("alice")
                    .header("x-delay-ms", "300")
                    .json("{}"),
            )
            .await
        }
    });
    tokio::time::sleep(Duration::from_millis(80)).await;
    let busy = send(&router, post("/pay").key("k").user("alice").json("{}")).await;
    assert_eq!(busy.status, StatusCode::CONFLICT);
    assert!(String::from_utf8_lossy(&busy.body).starts_with("in_progress|"));
    assert_eq!(
        busy.header("retry-after"),
        Some("2"),
        "the retry contract stays"
    );
    slow.await.expect("task");
    let reuse = send(
        &router,
        post("/pay").key("k").user("alice").json("{\"a\":1}"),
    )
    .await;
    assert_eq!(reuse.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(
        reuse.header("content-type"),
        Some("application/problem+json")
    );
}

/// `build()` refuses a wait past the bound, or one with no waiter allowed.
#[test]
fn wait_settings_are_checked() {
    let too_long = IdempotencyLayer::builder(MemoryStore::new())
        .wait(Duration::from_secs(5) + Duration::from_millis(1))
        .build();
    assert!(too_long.is_err());
    let nobody = IdempotencyLayer::builder(MemoryStore::new())
        .wait(Duration::from_secs(1))
        .max_waiters_per_key(0)
        .build();
    assert!(nobody.is_err());
    assert!(
        IdempotencyLayer::builder(MemoryStore::new())
            .wait(Duration::from_secs(5))
            .build()
            .is_ok()
    );
}

/// A duplicate that waits and whose client goes away is dropped, not detached: it takes no place
/// in the layer's admission bound, and the original still records once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_whose_client_left_is_not_detached() {
    let layer = IdempotencyLayer::builder(MemoryStore::new())
        .wait(Duration::from_secs(2))
        .build()
        .expect("layer");
    let drain = layer.drain();
    let (router, counters) = app(layer);
    let req = || {
        post("/pay")
            .key("left")
            .user("alice")
            .header("x-delay-ms", "600")
            .json("{}")
    };
    let first = tokio::spawn({
        let router = router.clone();
        async move { send(&router, req()).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    // The client gives up after 100 ms: its request future is dropped while it waits.
    let gave_up = tokio::time::timeout(Duration::from_millis(100), send(&router, req())).await;
    assert!(gave_up.is_err(), "still waiting when dropped");
    assert_eq!(drain.detached(), 0, "a waiter is not detached");
    assert_eq!(first.await.expect("task").status, StatusCode::CREATED);
    let replay = send(&router, req()).await;
    assert!(replay.replayed());
    assert_eq!(counters.started(), 1);
}

/// The default memory store's share adapts to the subjects present: a lone subject holds up to
/// half the store (the rest kept for subjects to come), and sixteen subjects that flood it
/// together with fresh keys cannot fill it for a seventeenth, which finds room, and leaves room
/// for an eighteenth; the sixteen get `429`.
#[tokio::test]
async fn no_group_of_subjects_fills_the_memory_store_for_another() {
    const CAPACITY: usize = 64 * 1024;
    let take_all = |router: axum::Router, user: String| async move {
        let mut taken = 0;
        loop {
            let key = format!("k-{taken}");
            let answer = send(&router, post("/pay").key(&key).user(&user)).await;
            if answer.status != StatusCode::CREATED {
                // Its share reached, or the store full (the last of it is the seventeenth's).
                assert!(
                    matches!(
                        answer.problem().as_str(),
                        "idempotency_quota_exceeded" | "idempotency_store_full"
                    ),
                    "{answer:?}"
                );
                return taken;
            }
            taken += 1;
            assert!(taken < 10_000, "never refused");
        }
    };
    // Alone, a subject holds half the store, the rest kept for subjects to come; a second then
    // fills what it can, and a third still finds room: two subjects that come in turn do not
    // fill it either.
    let store = MemoryStore::with_capacity(CAPACITY);
    let (router, _) = app(IdempotencyLayer::new(store.clone()).expect("valid settings"));
    take_all(router.clone(), "alone".to_owned()).await;
    assert!(
        store.bytes() > CAPACITY * 2 / 5 && store.bytes() <= CAPACITY / 2,
        "a lone subject holds {} of {CAPACITY} bytes",
        store.bytes()
    );
    assert!(take_all(router.clone(), "second".to_owned()).await >= 3);
    assert!(take_all(router.clone(), "third".to_owned()).await >= 3);
    assert!(store.bytes() <= CAPACITY);
    // Sixteen flood it together, a key each in turn, until every one of them is refused; the
    // seventeenth still finds room.
    let store = MemoryStore::with_capacity(CAPACITY);
    let (router, _) = app(IdempotencyLayer::new(store.clone()).expect("valid settings"));
    let mut refused = [false; 16];
    let mut turn = 0;
    while refused.iter().any(|r| !r) {
        turn += 1;
        assert!(turn < 10_000, "never refused");
        for (n, refused) in refused.iter_mut().enumerate().filter(|(_, r)| !**r) {
            let answer = send(
                &router,
                post("/pay")
                    .key(&format!("k-{turn}"))
                    .user(&format!("flood-{n}")),
            )
            .await;
            if answer.status != StatusCode::CREATED {
                assert_eq!(answer.status, StatusCode::TOO_MANY_REQUESTS, "{answer:?}");
                *refused = true;
            }
        }
    }
    let before = store.bytes();
    // Each of them holds about a seventeenth, and about as much stays free.
    assert!(
        before + CAPACITY / 20 <= CAPACITY,
        "the sixteen left {} of {CAPACITY} bytes free",
        CAPACITY - before
    );
    let taken = take_all(router.clone(), "the-seventeenth".to_owned()).await;
    assert!(taken >= 3, "the seventeenth got {taken} keys");
    let taken = take_all(router.clone(), "the-eighteenth".to_owned()).await;
    assert!(taken >= 1, "the eighteenth got {taken} keys");
    assert!(store.bytes() <= CAPACITY, "{} > {CAPACITY}", store.bytes());
}
