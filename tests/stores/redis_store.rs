//! The layer on the Redis store, against a real Redis (`REDIS_URL`, default
//! `redis://127.0.0.1:6379`): the shared behavioural suite, races included, and an unreachable
//! server. Every test uses a key prefix of its own.
#![cfg(feature = "redis")]

use crate::common;
use axum_idempotency::{cache_suite, store_suite};

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::http::StatusCode;
use axum_idempotency::{IdempotencyLayer, IdempotencyStore, RedisStore};
use common::{app, post, send};

fn redis_url() -> String {
    common::servers::redis_url()
}

async fn store() -> RedisStore {
    static N: AtomicUsize = AtomicUsize::new(0);
    let client = redis::Client::open(redis_url()).expect("REDIS_URL");
    let prefix = format!(
        "idem_test:{}:{}:{}:",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_nanos(),
        N.fetch_add(1, Ordering::SeqCst)
    );
    RedisStore::new(client)
        .expect("store")
        .with_prefix(&prefix)
        .with_timeout(common::SUITE_STORE_TIMEOUT)
}

// Redis expires records itself: purge_expired has nothing left to delete.
store_suite!(store(), purged = 0);
cache_suite!(store(), purged = 0);

#[tokio::test]
async fn unreachable_redis_is_503_and_runs_nothing() {
    // Nothing listens on port 1.
    let client = redis::Client::open("redis://127.0.0.1:1").expect("url");
    let store = RedisStore::new(client)
        .expect("a lazy store")
        .with_timeout(Duration::from_secs(2));
    let (router, counters) = app(IdempotencyLayer::new(store.clone()));
    let answer = send(&router, post("/pay").key("k").user("alice").json("{}")).await;
    assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(answer.problem(), "idempotency_store_unavailable");
    assert_eq!(counters.started(), 0);
    assert_eq!(store.purge_expired().await.expect("nothing to purge"), 0);
}

#[tokio::test]
async fn records_expire_with_retention() {
    let store = store().await;
    let layer = IdempotencyLayer::builder(store)
        .retention(Duration::from_millis(300))
        .build()
        .expect("layer");
    let (router, counters) = app(layer);
    send(&router, post("/pay").key("k").user("alice")).await;
    assert!(
        send(&router, post("/pay").key("k").user("alice"))
            .await
            .replayed()
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !send(&router, post("/pay").key("k").user("alice"))
            .await
            .replayed()
    );
    assert_eq!(counters.started(), 2);
}
