//! The bounded wait for an original's answer, and the expiry header, on every store.

use std::time::{Duration, SystemTime};

use axum::http::StatusCode;
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::app::{app, post, send};
use crate::IdempotencyLayer;
use crate::store::{ClaimOutcome, ClaimRequest, Fingerprint, IdempotencyStore, RecordKey};

/// Many duplicates of a slow request wait on one key: the handler runs once, and each duplicate
/// gets the replay (or `409` when it would have waited past the bound); none waits much past the
/// bound, and more waiters than `max_waiters_per_key` get `409` at once.
pub async fn waiters_get_the_replay_and_never_wait_past_the_bound<S: IdempotencyStore>(store: S) {
    let wait = Duration::from_millis(1500);
    let layer = IdempotencyLayer::builder(store)
        .wait(wait)
        .max_waiters_per_key(8)
        .build()
        .expect("layer");
    let (router, counters) = app(layer);
    let req = |delay: u64| {
        post("/pay")
            .key("waited")
            .user("alice")
            .header("x-delay-ms", &delay.to_string())
            .json(r#"{"amount":1}"#)
    };
    let first = tokio::spawn({
        let router = router.clone();
        async move { send(&router, req(600)).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut duplicates = JoinSet::new();
    for _ in 0..12 {
        let router = router.clone();
        duplicates.spawn(async move {
            let sent = Instant::now();
            let answer = send(&router, req(0)).await;
            (answer, sent.elapsed())
        });
    }
    let first = first.await.expect("task");
    assert_eq!(first.status, StatusCode::CREATED);
    let (mut replays, mut conflicts) = (0, 0);
    while let Some(done) = duplicates.join_next().await {
        let (answer, took) = done.expect("task");
        assert!(
            took < wait + Duration::from_millis(700),
            "a duplicate waited {took:?}, past the bound"
        );
        match answer.status {
            StatusCode::CREATED => {
                assert!(answer.replayed());
                assert_eq!(answer.body, first.body, "the original's answer");
                replays += 1;
            }
            StatusCode::CONFLICT => conflicts += 1,
            other => panic!("unexpected {other}"),
        }
    }
    assert_eq!(counters.started(), 1, "a wait never runs the handler");
    assert!(replays >= 8, "the waiters got the replay ({replays} of 12)");
    assert!(
        conflicts >= 4,
        "past max_waiters_per_key, 409 at once ({conflicts} of 12)"
    );
}

/// A holder that died (its claim never renewed) while duplicates wait: they get `409` at the bound,
/// and once the TTL has passed, one retry retakes the key and runs once.
pub async fn waiters_on_a_dead_holder_get_409_and_a_later_retake_runs_once<S: IdempotencyStore>(
    store: S,
) {
    let ttl = super::app::short_ttl(&store, Duration::from_millis(1500));
    let wait = Duration::from_millis(400);
    // The holder: a claim made in the store and never renewed, as by a process that died.
    let dead = ClaimRequest::new(
        RecordKey {
            key: "dead-holder".into(),
            subject: "alice".into(),
            endpoint: "POST /pay".into(),
        },
        Fingerprint::of(None, b"{}"),
        ttl,
        Duration::from_secs(60),
    );
    assert!(matches!(
        store.claim(&dead).await.expect("claim"),
        ClaimOutcome::Claimed { .. }
    ));
    let layer = IdempotencyLayer::builder(store)
        .in_progress_ttl(ttl)
        .wait(wait)
        .build()
        .expect("layer");
    let (router, counters) = app(layer);
    let req = || post("/pay").key("dead-holder").user("alice").json("{}");
    let mut waiters = JoinSet::new();
    for _ in 0..6 {
        let router = router.clone();
        waiters.spawn(async move {
            let sent = Instant::now();
            (send(&router, req()).await.status, sent.elapsed())
        });
    }
    while let Some(done) = waiters.join_next().await {
        let (status, took) = done.expect("task");
        assert_eq!(status, StatusCode::CONFLICT);
        assert!(took >= wait - Duration::from_millis(50), "waited {took:?}");
        assert!(took < wait + Duration::from_millis(700), "waited {took:?}");
    }
    assert_eq!(counters.started(), 0);
    // Retries a TTL apart: a store that marks a silent holder first takes its record a TTL after
    // the first claim that found it so (one of the waiters', or the first retries').
    for _ in 0..2 {
        tokio::time::sleep(ttl).await;
        let mut retries = JoinSet::new();
        for _ in 0..6 {
            let router = router.clone();
            retries.spawn(async move { send(&router, req()).await.status });
        }
        while let Some(done) = retries.join_next().await {
            let status = done.expect("task");
            assert!(
                status == StatusCode::CREATED || status == StatusCode::CONFLICT,
                "{status}"
            );
        }
        if counters.started() > 0 {
            break;
        }
    }
    assert_eq!(counters.started(), 1, "the retake runs once");
}

/// A released answer (a retryable `503`) ends the wait with `409`, and the retry runs again.
pub async fn a_released_answer_ends_the_wait_with_409<S: IdempotencyStore>(store: S) {
    let layer = IdempotencyLayer::builder(store)
        .wait(Duration::from_secs(2))
        .build()
        .expect("layer");
    let (router, counters) = app(layer);
    let req = |extra: &[(&str, &str)]| {
        let mut r = post("/pay").key("released").user("alice").json("{}");
        for (name, value) in extra {
            r = r.header(name, value);
        }
        r
    };
    let first = tokio::spawn({
        let router = router.clone();
        async move { send(&router, req(&[("x-delay-ms", "300"), ("x-status", "503")])).await }
    });
    tokio::time::sleep(Duration::from_millis(80)).await;
    let sent = Instant::now();
    let waiter = send(&router, req(&[])).await;
    assert_eq!(waiter.status, StatusCode::CONFLICT);
    assert!(
        sent.elapsed() < Duration::from_millis(1500),
        "not held to the bound"
    );
    assert_eq!(
        first.await.expect("task").status,
        StatusCode::SERVICE_UNAVAILABLE
    );
    assert_eq!(counters.started(), 1, "the waiter did not run it");
    let retry = send(&router, req(&[])).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(counters.started(), 2);
}

/// Recorded and replayed answers carry `Idempotency-Expires`, the HTTP date of the record's
/// expiry; an answer whose record was released does not.
pub async fn answers_say_when_their_record_expires<S: IdempotencyStore>(store: S) {
    let retention = Duration::from_secs(3600);
    let layer = IdempotencyLayer::builder(store)
        .retention(retention)
        .build()
        .expect("layer");
    let (router, _) = app(layer);
    let req = || post("/pay").key("expiring").user("alice").json("{}");
    let expected = SystemTime::now() + retention;
    let fresh = send(&router, req()).await;
    let replay = send(&router, req()).await;
    assert!(replay.replayed());
    for answer in [&fresh, &replay] {
        let header = answer
            .header("idempotency-expires")
            .expect("the expiry header");
        let at = parse_http_date(header).expect("an HTTP date");
        let gap = match at.duration_since(expected) {
            Ok(d) => d,
            Err(e) => e.duration(),
        };
        assert!(
            gap < Duration::from_secs(5),
            "{header} is not about {expected:?}"
        );
    }
    let released = send(
        &router,
        post("/pay")
            .key("expiring-released")
            .user("alice")
            .header("x-status", "503")
            .json("{}"),
    )
    .await;
    assert_eq!(released.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(released.header("idempotency-expires"), None);
}

/// A duplicate that waited for its holder's answer is told the same expiry as the holder (to the
/// second), not one earlier by the time it waited.
pub async fn a_waiter_is_told_the_holders_expiry<S: IdempotencyStore>(store: S) {
    let layer = IdempotencyLayer::builder(store)
        .retention(Duration::from_secs(3600))
        .wait(Duration::from_secs(5))
        .build()
        .expect("layer");
    let (router, _) = app(layer);
    let req = || post("/pay").key("waited").user("alice").json("{}");
    let holder = tokio::spawn({
        let router = router.clone();
        async move { send(&router, req().header("x-delay-ms", "2500")).await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let waiter = send(&router, req()).await;
    let holder = holder.await.expect("holder");
    assert_eq!(holder.status, StatusCode::CREATED);
    assert!(waiter.replayed(), "{waiter:?}");
    let expiry = |answer: &super::app::Answer| {
        let header = answer
            .header("idempotency-expires")
            .expect("the expiry header");
        httpdate::parse_http_date(header).expect("an HTTP date")
    };
    let (held, waited) = (expiry(&holder), expiry(&waiter));
    let gap = held
        .duration_since(waited)
        .or_else(|_| waited.duration_since(held))
        .expect("a gap");
    assert!(
        gap <= Duration::from_secs(1),
        "the holder's record expires at {held:?}, the waiter was told {waited:?}"
    );
}

/// The time of an HTTP date.
fn parse_http_date(text: &str) -> Option<SystemTime> {
    httpdate::parse_http_date(text).ok()
}
