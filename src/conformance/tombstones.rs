//! Tombstones on a store: a key whose record expired within the tombstones' time is answered
//! `410`, on its own scope only, and runs again once the tombstone has expired too.

use std::time::Duration;

use axum::http::StatusCode;

use super::app::{app, post, send};
use crate::IdempotencyLayer;
use crate::store::{IdempotencyStore, RecordKey};

/// A recorded answer leaves a tombstone that outlives its record: the same key (any body) is then
/// `410 idempotency_key_expired`, not retryable, again and again, and nothing runs; another
/// subject's or another route's same key runs; a released answer leaves none; once the tombstone
/// expires too, the key runs again.
pub async fn an_expired_key_is_answered_gone_until_its_tombstone_expires<S: IdempotencyStore>(
    store: S,
) {
    let retention = Duration::from_millis(800);
    let tombstones = Duration::from_millis(2500);
    let layer = IdempotencyLayer::builder(store.clone())
        .retention(retention)
        .tombstones(tombstones)
        .build()
        .expect("layer");
    let (router, counters) = app(layer);
    let scope = RecordKey {
        key: "tomb-1".into(),
        subject: "alice".into(),
        endpoint: "POST /pay".into(),
    };
    let first = send(
        &router,
        post("/pay").key("tomb-1").user("alice").json(r#"{"a":1}"#),
    )
    .await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    let recorded_at = tokio::time::Instant::now();
    // The tombstone is written in the background once the answer is recorded.
    let tomb = crate::tombstone_of(&scope);
    assert!(crate::is_tombstone(&tomb) && !crate::is_tombstone(&scope));
    let mut written = false;
    for _ in 0..200 {
        if store.lookup(&tomb).await.expect("lookup").is_some() {
            written = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(written, "the tombstone was not written within two seconds");
    // A released answer leaves none.
    let released = send(
        &router,
        post("/pay")
            .key("tomb-2")
            .user("alice")
            .header("x-status", "503"),
    )
    .await;
    assert_eq!(released.status, StatusCode::SERVICE_UNAVAILABLE);

    tokio::time::sleep(
        (retention + Duration::from_millis(200)).saturating_sub(recorded_at.elapsed()),
    )
    .await;
    for body in [r#"{"a":1}"#, r#"{"a":1}"#, r#"{"a":2}"#] {
        let gone = send(&router, post("/pay").key("tomb-1").user("alice").json(body)).await;
        assert_eq!(gone.status, StatusCode::GONE, "{gone:?}");
        assert_eq!(gone.problem(), "idempotency_key_expired");
        assert_eq!(gone.json()["retryable"], false, "{gone:?}");
        assert!(gone.header("retry-after").is_none(), "{gone:?}");
    }
    assert_eq!(counters.started(), 2, "an expired key ran again");
    // The tombstone is the scope's: another subject's, another route's same key run.
    let bob = send(
        &router,
        post("/pay").key("tomb-1").user("bob").json(r#"{"a":1}"#),
    )
    .await;
    assert_eq!(bob.status, StatusCode::CREATED, "{bob:?}");
    let other = send(
        &router,
        post("/other")
            .key("tomb-1")
            .user("alice")
            .json(r#"{"a":1}"#),
    )
    .await;
    assert_eq!(other.status, StatusCode::CREATED, "{other:?}");
    // The released key had no tombstone: it runs.
    let again = send(&router, post("/pay").key("tomb-2").user("alice")).await;
    assert_eq!(again.status, StatusCode::CREATED, "{again:?}");
    assert_eq!(counters.started(), 5);

    // Once the tombstone has expired as well, the key is new.
    let past = retention + tombstones + Duration::from_millis(300);
    tokio::time::sleep(past.saturating_sub(recorded_at.elapsed())).await;
    let fresh = send(
        &router,
        post("/pay").key("tomb-1").user("alice").json(r#"{"a":3}"#),
    )
    .await;
    assert_eq!(fresh.status, StatusCode::CREATED, "{fresh:?}");
    assert!(!fresh.replayed());
    assert_eq!(counters.started(), 6);
}
