//! The cache of finished records ([`CachedStore`]) in front of a real store: replays skip the store,
//! entries never outlive their record, a different body is still `422`, in-progress records are never
//! cached. `cache_suite!` instantiates these tests, and the whole behavioural suite, for a store.

use crate::Fenced;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use crate::{
    CachedStore, ClaimOutcome, ClaimRequest, Fingerprint, IdempotencyLayer, IdempotencyStore,
    LeaseToken, RecordKey, StoredResponse,
};
use axum::http::StatusCode;

use super::app::{app, post, send};

/// Instantiates the behavioural suite over `CachedStore::new($make)` and the cache's own tests over
/// `$make`.
#[macro_export]
macro_rules! cache_suite {
    ($make:expr, purged = $purged:expr) => {
        mod cached {
            use super::*;
            $crate::store_suite!(
                async { $crate::CachedStore::new($make.await) },
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
            async fn a_burst_of_duplicates_costs_the_store_one_claim() {
                $crate::conformance::cache::a_burst_of_duplicates_costs_the_store_one_claim(
                    $make.await,
                )
                .await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn in_progress_records_are_never_cached() {
                $crate::conformance::cache::in_progress_records_are_never_cached($make.await).await;
            }
        }
    };
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
    async fn claim(&self, request: &ClaimRequest) -> Result<ClaimOutcome, crate::StoreError> {
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
    ) -> Result<Fenced, crate::StoreError> {
        self.store
            .complete(key, lease, fingerprint, response, retention)
            .await
    }
    async fn renew(
        &self,
        key: &RecordKey,
        lease: LeaseToken,
        lifetime: Duration,
    ) -> Result<Fenced, crate::StoreError> {
        self.store.renew(key, lease, lifetime).await
    }
    async fn release(
        &self,
        key: &RecordKey,
        lease: LeaseToken,
    ) -> Result<Fenced, crate::StoreError> {
        self.store.release(key, lease).await
    }
    async fn purge_expired(&self) -> Result<u64, crate::StoreError> {
        self.store.purge_expired().await
    }
    fn capabilities(&self) -> crate::store::Capabilities<'_> {
        self.store.capabilities()
    }
}

/// The first replay reads the store and fills the cache; the next ones, and a request with another
/// body (`422`), are answered from it without a claim reaching the store.
pub async fn cached_replays_skip_the_store<S: IdempotencyStore>(store: S) {
    let counting = Counting::new(store);
    let cached = CachedStore::new(counting.clone());
    let (router, counters) = app(IdempotencyLayer::new(cached.clone()));
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

/// A duplicate of a request in progress gets `409`, from this instance's hold on the key without a
/// claim reaching the store, and from the store at another instance; nothing is cached until the
/// record is finished.
pub async fn in_progress_records_are_never_cached<S: IdempotencyStore>(store: S) {
    let counting = Counting::new(store);
    let cached = CachedStore::new(counting.clone());
    let (router, counters) = app(IdempotencyLayer::new(cached.clone()));
    let req = || post("/pay").key("k").user("alice").json("{}");
    let slow = tokio::spawn({
        let router = router.clone();
        async move { send(&router, req().header("x-delay-ms", "600")).await }
    });
    super::app::eventually(|| counters.started() == 1).await;
    // Another instance: its own cache in front of the same store.
    let elsewhere = CachedStore::new(counting.clone());
    let (other_router, other_counters) = app(IdempotencyLayer::new(elsewhere.clone()));
    for n in 0..3 {
        let duplicate = send(&router, req()).await;
        assert_eq!(duplicate.status, StatusCode::CONFLICT);
        assert_eq!(duplicate.problem(), "in_progress");
        let reused = send(&router, post("/pay").key("k").user("alice").json("[]")).await;
        assert_eq!(reused.status, StatusCode::UNPROCESSABLE_ENTITY);
        assert_eq!(counting.claims(), 1 + n, "answered by this instance's hold");
        let there = send(&other_router, req()).await;
        assert_eq!(there.status, StatusCode::CONFLICT);
        assert_eq!(
            counting.claims(),
            2 + n,
            "the other instance asked the store"
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
    assert_eq!(counters.started(), 1);
    assert_eq!(other_counters.started(), 0);
}

/// Twenty duplicates at once at one instance: one claim reaches the store, the handler runs once,
/// and the other nineteen get `409`.
pub async fn a_burst_of_duplicates_costs_the_store_one_claim<S: IdempotencyStore>(store: S) {
    let counting = Counting::new(store);
    let cached = CachedStore::new(counting.clone());
    let (router, counters) = app(IdempotencyLayer::new(cached));
    for round in 0..5 {
        let before = counting.claims();
        let key = format!("burst-{round}");
        let barrier = Arc::new(tokio::sync::Barrier::new(20));
        let mut racers = tokio::task::JoinSet::new();
        for _ in 0..20 {
            let (router, barrier, key) = (router.clone(), barrier.clone(), key.clone());
            racers.spawn(async move {
                barrier.wait().await;
                send(
                    &router,
                    post("/pay")
                        .key(&key)
                        .user("alice")
                        .json("{}")
                        .header("x-delay-ms", "300"),
                )
                .await
                .status
            });
        }
        let mut statuses = Vec::new();
        while let Some(status) = racers.join_next().await {
            statuses.push(status.expect("racer"));
        }
        let created = statuses
            .iter()
            .filter(|s| **s == StatusCode::CREATED)
            .count();
        let conflicts = statuses
            .iter()
            .filter(|s| **s == StatusCode::CONFLICT)
            .count();
        assert_eq!((created, conflicts), (1, 19), "{statuses:?}");
        assert_eq!(counting.claims() - before, 1, "one claim reached the store");
    }
    assert_eq!(counters.started(), 5);
}

/// A store that does not say how long its records have left (the memory store) is never cached.
pub async fn records_without_an_expiry_are_not_cached<S: IdempotencyStore>(store: S) {
    let counting = Counting::new(store);
    let cached = CachedStore::new(counting.clone());
    let (router, _) = app(IdempotencyLayer::new(cached.clone()));
    let req = || post("/pay").key("k").user("alice").json("{}");
    send(&router, req()).await;
    for _ in 0..3 {
        assert!(send(&router, req()).await.replayed());
    }
    assert!(cached.is_empty());
    assert_eq!(counting.claims(), 4);
}

/// Over the memory store too, duplicates at one instance are answered by its hold on the key.
pub async fn memory_bursts_are_answered_locally<S: IdempotencyStore>(store: S) {
    a_burst_of_duplicates_costs_the_store_one_claim(store).await;
}
