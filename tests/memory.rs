//! The layer on the memory store: the shared behavioural suite, the request checks of SPEC 1 and 4,
//! and the store's own bounds.

mod common;

use std::time::Duration;

use axum::body::Body;
use axum::http::StatusCode;
use axum_idempotency::{
    ClaimOutcome, ClaimRequest, Fingerprint, IdempotencyLayer, IdempotencyStore, LeaseToken,
    MemoryStore, RecordKey, StoreError, StoredResponse,
};
use common::{app, post, send};

store_suite!(async { MemoryStore::new() });

/// The memory store does not say how long a record has left: a cache in front of it keeps nothing.
#[tokio::test]
async fn memory_records_are_not_cached() {
    common::cache::records_without_an_expiry_are_not_cached(MemoryStore::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cached_store_answers_a_burst_with_one_claim() {
    common::cache::memory_bursts_are_answered_locally(MemoryStore::new()).await;
}

fn layer() -> IdempotencyLayer<MemoryStore> {
    IdempotencyLayer::new(MemoryStore::new())
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
        _: std::sync::Arc<StoredResponse>,
        _: Duration,
    ) -> Result<bool, StoreError> {
        Err(StoreError::msg("connection refused"))
    }
    async fn renew(&self, _: &RecordKey, _: LeaseToken, _: Duration) -> Result<bool, StoreError> {
        Err(StoreError::msg("connection refused"))
    }
    async fn release(&self, _: &RecordKey, _: LeaseToken) -> Result<bool, StoreError> {
        Err(StoreError::msg("connection refused"))
    }
    async fn purge_expired(&self) -> Result<u64, StoreError> {
        Err(StoreError::msg("connection refused"))
    }
}

#[tokio::test]
async fn store_failure_is_503_and_runs_nothing() {
    let (router, counters) = app(IdempotencyLayer::new(DownStore));
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
    let claim = |i: usize, retention: Duration| ClaimRequest {
        key: RecordKey {
            key: format!("k{i}"),
            subject: format!("s{}", i % 100),
            endpoint: "POST /pay".into(),
        },
        fingerprint: Fingerprint::of(None, b"{}"),
        lease: LeaseToken::generate(),
        in_progress_ttl: Duration::from_millis(10),
        retention,
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
