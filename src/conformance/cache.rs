//! The cache of finished records ([`CachedStore`]) in front of a real store: replays skip the store,
//! entries never outlive their record, a different body is still `422`, in-progress records are never
//! cached. `cache_suite!` instantiates these tests, and the whole behavioural suite, for a store.

use std::time::Duration;

use crate::IdempotencyLayer;
use crate::store::{CachedStore, IdempotencyStore};
use axum::http::StatusCode;

use super::app::{Counting, app, post, send};

/// Instantiates the behavioural suite over `CachedStore::new($make)` and the cache's own tests over
/// `$make`.
#[macro_export]
macro_rules! cache_suite {
    ($make:expr, purged = $purged:expr) => {
        mod cached {
            use super::*;
            $crate::store_suite!(
                async { $crate::store::CachedStore::new($make.await) },
                purged = $purged
            );

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn cached_replays_skip_the_store() {
                $crate::conformance::cache::cached_replays_skip_the_store($make.await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn cache_entry_expires_with_its_record() {
                $crate::conformance::cache::cache_entry_expires_with_its_record($make.await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn in_progress_records_are_never_cached() {
                $crate::conformance::cache::in_progress_records_are_never_cached($make.await).await;
            }
        }
    };
}

/// The first replay reads the store and fills the cache; the next ones, and a request with another
/// body (`422`), are answered from it without a claim reaching the store.
pub async fn cached_replays_skip_the_store<S: IdempotencyStore>(store: S) {
    let counting = Counting::new(store);
    let cached = CachedStore::new(counting.clone());
    let (router, counters) = app(IdempotencyLayer::new(cached.clone()).expect("valid settings"));
    let req = || post("/pay").key("k").user("alice").json(r#"{"amount":5}"#);
    let first = send(&router, req()).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(counting.claims(), 1);
    assert!(cached.is_empty(), "a completion does not fill the cache");
    let replay = send(&router, req()).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
    assert_eq!(counting.claims(), 2, "the first replay reads the store");
    assert_eq!(cached.len(), 1);
    for _ in 0..5 {
        let again = send(&router, req()).await;
        assert_eq!(again.status, StatusCode::CREATED);
        assert!(again.replayed());
        assert_eq!(again.body, first.body);
        assert_eq!(again.header("location"), first.header("location"));
    }
    let reused = send(
        &router,
        post("/pay").key("k").user("alice").json(r#"{"amount":6}"#),
    )
    .await;
    assert_eq!(reused.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(reused.problem(), "idempotency_key_reuse");
    assert_eq!(
        counting.claims(),
        2,
        "replays and the 422 came from the cache"
    );
    // Another subject's key of the same name is another record: it reaches the store.
    let other = send(
        &router,
        post("/pay").key("k").user("bob").json(r#"{"amount":5}"#),
    )
    .await;
    assert_eq!(other.status, StatusCode::CREATED);
    assert!(!other.replayed());
    assert_eq!(counting.claims(), 3);
    assert_eq!(counters.started(), 2);
}

/// An entry lives no longer than its record: once retention has passed, the key runs again, on this
/// instance as on any other.
pub async fn cache_entry_expires_with_its_record<S: IdempotencyStore>(store: S) {
    let cached = CachedStore::new(store);
    let layer = IdempotencyLayer::builder(cached.clone())
        .retention(Duration::from_millis(600))
        .build()
        .expect("layer");
    let (router, counters) = app(layer);
    let req = || post("/pay").key("k").user("alice").json("{}");
    send(&router, req()).await;
    assert!(send(&router, req()).await.replayed());
    assert_eq!(cached.len(), 1, "the replay filled the cache");
    assert!(send(&router, req()).await.replayed());
    tokio::time::sleep(Duration::from_millis(700)).await;
    let after = send(&router, req()).await;
    assert_eq!(after.status, StatusCode::CREATED);
    assert!(!after.replayed(), "the record expired, so did its entry");
    assert_eq!(counters.started(), 2);
}

/// Nothing is cached while a record is in progress (duplicates get `409`, at this instance and at
/// another), and once it is finished each instance replays it.
pub async fn in_progress_records_are_never_cached<S: IdempotencyStore>(store: S) {
    let counting = Counting::new(store);
    let cached = CachedStore::new(counting.clone());
    let (router, counters) = app(IdempotencyLayer::new(cached.clone()).expect("valid settings"));
    let req = || post("/pay").key("k").user("alice").json("{}");
    let slow = tokio::spawn({
        let router = router.clone();
        async move { send(&router, req().header("x-delay-ms", "600")).await }
    });
    super::app::eventually(|| counters.started() == 1).await;
    // Another instance: its own cache in front of the same store.
    let elsewhere = CachedStore::new(counting.clone());
    let (other_router, other_counters) =
        app(IdempotencyLayer::new(elsewhere.clone()).expect("valid settings"));
    for _ in 0..3 {
        assert_eq!(send(&router, req()).await.status, StatusCode::CONFLICT);
        assert_eq!(
            send(&other_router, req()).await.status,
            StatusCode::CONFLICT
        );
        assert!(cached.is_empty() && elsewhere.is_empty());
    }
    let first = slow.await.expect("slow request");
    assert_eq!(first.status, StatusCode::CREATED);
    let replay = send(&router, req()).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
    assert_eq!(cached.len(), 1);
    assert!(send(&other_router, req()).await.replayed());
    assert_eq!(elsewhere.len(), 1);
    assert_eq!(counters.started(), 1);
    assert_eq!(other_counters.started(), 0);
}

/// A store that does not say how long its records have left (the memory store) is never cached.
pub async fn records_without_an_expiry_are_not_cached<S: IdempotencyStore>(store: S) {
    let counting = Counting::new(store);
    let cached = CachedStore::new(counting.clone());
    let (router, _) = app(IdempotencyLayer::new(cached.clone()).expect("valid settings"));
    let req = || post("/pay").key("k").user("alice").json("{}");
    send(&router, req()).await;
    for _ in 0..3 {
        assert!(send(&router, req()).await.replayed());
    }
    assert!(cached.is_empty());
    assert_eq!(counting.claims(), 4);
}
