//! Fault injection on the Redis store: a TCP proxy between the store and Redis cuts or stalls the
//! connection before the claim, between claim and complete, and during complete. In every case the
//! handler runs at most once per key, nothing stays stuck, and the client gets a clear answer
//! (replay, 409 or 503).
#![cfg(feature = "redis")]

use crate::common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::http::StatusCode;
use axum_idempotency::store::RedisStore;
use axum_idempotency::{IdempotencyLayer, Outcome, OutcomeCounters};
use common::proxy::{Mode, Proxy};
use common::{Answer, Counters, app, eventually, post, send};

fn redis_url() -> String {
    common::servers::redis_url()
}

struct Setup {
    proxy: Proxy,
    router: axum::Router,
    counters: Counters,
    outcomes: OutcomeCounters,
}

/// A key prefix no other test uses.
fn prefix() -> String {
    static N: AtomicUsize = AtomicUsize::new(0);
    format!(
        "idem_test:faults:{}:{}:{}:",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_nanos(),
        N.fetch_add(1, Ordering::SeqCst)
    )
}

/// A store with a key prefix of its own, reached through a proxy; a short timeout so faults show
/// quickly.
async fn setup() -> Setup {
    let info = redis::Client::open(redis_url())
        .expect("REDIS_URL")
        .get_connection_info()
        .clone();
    let (host, port) = match info.addr() {
        redis::ConnectionAddr::Tcp(host, port) => (host.clone(), *port),
        other => panic!("REDIS_URL must be a plain TCP address, not {other:?}"),
    };
    let upstream: SocketAddr = tokio::net::lookup_host((host.as_str(), port))
        .await
        .expect("resolve")
        .next()
        .expect("an address");
    let proxy = Proxy::start(upstream).await;
    let client =
        redis::Client::open(format!("redis://127.0.0.1:{}", proxy.port())).expect("proxy url");
    let store = RedisStore::new(client)
        .expect("store")
        .with_prefix(&prefix())
        .with_timeout(Duration::from_millis(800));
    let outcomes = OutcomeCounters::new();
    let layer = IdempotencyLayer::builder(store)
        .in_progress_ttl(Duration::from_secs(30))
        .on_outcome(outcomes.hook())
        .build()
        .expect("layer");
    let (router, counters) = app(layer);
    Setup {
        proxy,
        router,
        counters,
        outcomes,
    }
}

/// Retries like a client would until the answer is neither 409 nor 503, for at most ten seconds.
async fn settle(router: &axum::Router, req: impl Fn() -> common::Req) -> Answer {
    for _ in 0..100 {
        let answer = send(router, req()).await;
        if answer.status != StatusCode::CONFLICT && answer.status != StatusCode::SERVICE_UNAVAILABLE
        {
            return answer;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("still 409 or 503 after ten seconds");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cut_before_the_claim_is_503_and_runs_nothing() {
    let s = setup().await;
    let req = || post("/pay").key("k").user("alice").json("{\"amount\":1}");
    s.proxy.set(Mode::Cut);
    let refused = send(&s.router, req()).await;
    assert_eq!(refused.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(refused.problem(), "idempotency_store_unavailable");
    assert_eq!(s.counters.started(), 0);
    assert_eq!(s.outcomes.get(Outcome::StoreUnavailable), 1);
    s.proxy.set(Mode::Pass);
    let charged = settle(&s.router, req).await;
    assert_eq!(charged.status, StatusCode::CREATED);
    assert!(!charged.replayed());
    let replay = send(&s.router, req()).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, charged.body);
    assert_eq!(s.counters.started(), 1, "the handler ran once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cut_between_claim_and_complete_records_later_and_runs_once() {
    let s = setup().await;
    let req = || {
        post("/pay")
            .key("k")
            .user("alice")
            .header("x-delay-ms", "400")
    };
    let first = tokio::spawn({
        let router = s.router.clone();
        async move { send(&router, req()).await }
    });
    let c = s.counters.clone();
    eventually(move || c.started() == 1).await;
    s.proxy.set(Mode::Cut); // Redis goes away while the handler runs
    let answer = first.await.expect("first");
    // The handler ran, its answer is not recorded yet: the client is told so, not given it.
    crate::not_recorded_yet(&answer);
    assert_eq!(s.outcomes.get(Outcome::RecordDeferred), 1);
    assert_eq!(s.outcomes.get(Outcome::Recorded), 0);
    let during = send(&s.router, req()).await;
    assert!(
        during.status == StatusCode::SERVICE_UNAVAILABLE || during.status == StatusCode::CONFLICT,
        "{during:?}"
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    s.proxy.set(Mode::Pass);
    // The background retry records the answer: the retry is a replay, not a second charge.
    let o = s.outcomes.clone();
    eventually(move || o.get(Outcome::Recorded) == 1).await;
    let replay = settle(&s.router, req).await;
    assert_eq!(replay.status, StatusCode::CREATED);
    assert!(replay.replayed());
    assert_eq!(s.counters.started(), 1, "the handler ran once");
    assert_eq!(s.outcomes.get(Outcome::LeaseLost), 0);
}

// The complete that timed out is still delivered when the stall ends and records the answer; the
// background retry by the same lease then counts as done (`Recorded`), not as a lost lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stall_during_complete_times_out_then_records() {
    let s = setup().await;
    let req = || {
        post("/pay")
            .key("k")
            .user("alice")
            .header("x-delay-ms", "300")
    };
    let first = tokio::spawn({
        let router = s.router.clone();
        async move { send(&router, req()).await }
    });
    let c = s.counters.clone();
    eventually(move || c.started() == 1).await;
    s.proxy.set(Mode::Stall); // the complete script will hang
    let answer = tokio::time::timeout(Duration::from_secs(10), first)
        .await
        .expect("the client is answered despite the stall")
        .expect("first");
    crate::not_recorded_yet(&answer);
    assert_eq!(s.outcomes.get(Outcome::RecordDeferred), 1);
    assert_eq!(s.outcomes.get(Outcome::Recorded), 0);
    // A duplicate during the stall is answered too (503 after the store timeout, or 409).
    let during = tokio::time::timeout(Duration::from_secs(10), send(&s.router, req()))
        .await
        .expect("answered during the stall");
    assert!(
        during.status == StatusCode::SERVICE_UNAVAILABLE || during.status == StatusCode::CONFLICT,
        "{during:?}"
    );
    s.proxy.set(Mode::Pass);
    let o = s.outcomes.clone();
    eventually(move || o.get(Outcome::Recorded) == 1).await;
    let replay = settle(&s.router, req).await;
    assert!(replay.replayed());
    assert_eq!(s.counters.started(), 1, "the handler ran once");
    assert_eq!(s.outcomes.get(Outcome::LeaseLost), 0);
}
