//! The behavioural suite every store passes: one test per row of the claim table, plus races,
//! disconnects, panics, retention and lease fencing. `store_suite!` instantiates it for a store.

use crate::store::Fenced;
use std::sync::Arc;
use std::time::Duration;

use crate::IdempotencyLayer;
use crate::store::{
    ClaimOutcome, ClaimRequest, Fingerprint, Finished, IdempotencyStore, LeaseToken, RecordKey,
    StoredResponse,
};
use axum::http::StatusCode;
use bytes::Bytes;
use tokio::task::JoinSet;

pub use super::app::until_not_in_progress;
use super::app::{Answer, Counting, app, eventually, post, send, short_ttl};
pub use super::inspection::{
    delete_racing_claims_never_grants_twice,
    delete_racing_requests_runs_the_handler_at_most_once_more, inspection_forgets_expired_records,
    inspection_shows_every_state, listing_pages_through_one_subjects_records,
};
pub use super::steps::{
    a_retake_resumes_after_the_recorded_steps, inspection_shows_the_recorded_steps,
    steps_are_kept_by_the_operation_and_fenced_by_the_lease, the_largest_steps_are_kept_whole,
};
pub use super::tombstones::an_expired_key_is_answered_gone_until_its_tombstone_expires;
pub use super::waiting::{
    a_released_answer_ends_the_wait_with_409, a_waiter_is_told_the_holders_expiry,
    answers_say_when_their_record_expires, waiters_get_the_replay_and_never_wait_past_the_bound,
    waiters_on_a_dead_holder_get_409_and_a_later_retake_runs_once,
};

/// Instantiates every suite test for a store. `$make` is an async expression giving a fresh store;
/// `purged` is what `purge_expired` reports for five expired records (0 for a store whose backend
/// expires records itself).
#[macro_export]
macro_rules! store_suite {
    ($make:expr) => {
        $crate::store_suite!($make, purged = 5);
    };
    ($make:expr, purged = $purged:expr) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn purge_removes_expired_records() {
            $crate::conformance::suite::purge_removes_expired_records($make.await, $purged).await;
        }
        $crate::store_suite!(@tests $make;
            fresh_key_runs_once_then_replays,
            reordered_json_is_the_same_request,
            different_body_at_any_depth_is_422,
            different_query_is_422,
            definitive_failure_is_replayed,
            retryable_answers_release_the_key,
            duplicate_in_progress_is_409_at_once,
            stale_in_progress_is_retaken,
            late_completion_with_superseded_lease_changes_nothing,
            retention_makes_the_key_new,
            subjects_are_isolated,
            routes_are_isolated,
            panic_releases_the_key,
            disconnect_does_not_cancel_the_effect,
            oversized_response_is_recorded_without_its_body,
            same_key_race_runs_once,
            stale_retake_race_has_one_winner,
            a_claimer_with_a_shorter_ttl_waits_for_the_holders,
            slow_handler_outliving_the_ttl_is_not_retaken,
            heartbeat_keeps_the_claim_until_it_stops,
            completion_by_the_same_lease_is_idempotent,
            streamed_response_reaches_the_client_before_it_ends,
            endless_body_is_recorded_without_holding_the_claim,
            failed_body_stream_is_recorded_without_its_body,
            trailers_are_recorded_without_the_body,
            disconnect_during_the_claim_still_runs_and_records,
            any_scope_the_layer_lets_through_is_stored,
            claim_whose_answer_was_lost_is_released,
            stalled_body_is_recorded_after_the_client_leaves,
            panicking_body_is_recorded_without_its_body,
            a_claim_sent_twice_by_its_lease_is_still_claimed,
            handler_blocking_its_thread_is_not_retaken,
            generation_is_kept_by_retakes_and_new_after_expiry_or_release,
            count_records_counts_a_subjects_records,
            claim_answered_after_the_ttl_does_not_run_twice,
            duplicates_at_the_holding_instance_skip_the_store,
            a_burst_of_duplicates_costs_the_store_one_claim,
            inspection_shows_every_state,
            inspection_forgets_expired_records,
            listing_pages_through_one_subjects_records,
            delete_racing_claims_never_grants_twice,
            delete_racing_requests_runs_the_handler_at_most_once_more,
            waiters_get_the_replay_and_never_wait_past_the_bound,
            waiters_on_a_dead_holder_get_409_and_a_later_retake_runs_once,
            a_released_answer_ends_the_wait_with_409,
            answers_say_when_their_record_expires,
            a_waiter_is_told_the_holders_expiry,
            renew_many_answers_each_lease_on_its_own,
            an_expired_key_is_answered_gone_until_its_tombstone_expires,
            steps_are_kept_by_the_operation_and_fenced_by_the_lease,
            a_retake_resumes_after_the_recorded_steps,
            the_largest_steps_are_kept_whole,
            inspection_shows_the_recorded_steps,
        );
    };
    (@tests $make:expr; $($name:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $name() {
                $crate::conformance::suite::$name($make.await).await;
            }
        )*
    };
}

/// A store counts a subject's live records (for its share of the store): its own and no other
/// subject's, up to the bound it is asked for, with the records of every endpoint; and the bytes of
/// the answers they keep (at least their bodies; an answer sent again after it was recorded may be
/// counted again, an estimate from above). A store that keeps no subjects answers `None`, and is not checked
/// further.
pub async fn count_records_counts_a_subjects_records<S: IdempotencyStore>(store: S) {
    let claim = |key: &str, subject: &str, endpoint: &str| {
        let mut request = claim_request(key, Duration::from_secs(60));
        request.key.subject = subject.into();
        request.key.endpoint = endpoint.into();
        request
    };
    let big = |n: usize| {
        let mut response = (*stored("")).clone();
        response.body = Bytes::from(vec![b'x'; n]);
        Arc::new(response)
    };
    for i in 0..5 {
        let endpoint = if i % 2 == 0 {
            "POST /pay"
        } else {
            "POST /refund"
        };
        let request = claim(&format!("c{i}"), "counted", endpoint);
        let ClaimOutcome::Claimed { lease, .. } = store.claim(&request).await.expect("claim")
        else {
            panic!("claimed");
        };
        // Two of them answered, 1000 and 3000 bytes; the second sent twice.
        if i < 2 {
            let body = big(1000 + 2000 * i);
            for _ in 0..=i {
                let done = store
                    .complete(
                        &request.key,
                        lease,
                        &request.fingerprint,
                        body.clone(),
                        request.retention,
                    )
                    .await
                    .expect("complete");
                assert_eq!(done, Fenced::Done);
            }
        }
    }
    for i in 0..2 {
        let request = claim(&format!("o{i}"), "other", "POST /pay");
        assert!(matches!(
            store.claim(&request).await.expect("claim"),
            ClaimOutcome::Claimed { .. }
        ));
    }
    let Some(counted) = store.count_records("counted", 100).await.expect("count") else {
        return;
    };
    // An estimate from above is allowed (an index that still names records that are gone), but
    // never below the live records.
    assert!((5..=10).contains(&counted.records), "{counted:?}");
    // The bodies, once each; a store may count the rest of each record too (a few hundred bytes).
    assert!(
        (4000..4000 + 5 * 1024).contains(&counted.bytes),
        "{counted:?}"
    );
    let other = store
        .count_records("other", 100)
        .await
        .expect("count")
        .expect("counted");
    assert!((2..=4).contains(&other.records), "{other:?}");
    assert!(other.bytes < 2 * 1024, "no answer recorded: {other:?}");
    let bounded = store
        .count_records("counted", 3)
        .await
        .expect("count")
        .expect("counted");
    assert_eq!(bounded.records, 3, "no further than asked");
    assert_eq!(
        store.count_records("nobody", 100).await.expect("count"),
        Some(crate::store::SubjectUsage::default())
    );
}

/// Whether `outcome` grants `request` a record of its own making (not a retake).
fn is_fresh(outcome: &ClaimOutcome, request: &ClaimRequest) -> bool {
    matches!(outcome, ClaimOutcome::Claimed { .. }) && !outcome.is_retake(request)
}

/// A claim of `request` on a record whose holder has been silent (not renewed) for its TTL, made
/// as retakers make it: again a TTL later if the first answer is `InProgress`. A store whose
/// holders' liveness can end without the store showing it (a failover to a replica, a proxy
/// restarted: the SQL servers and Redis) takes such a record only a TTL after a claim first found
/// its holder silent (SPEC 24); the memory store and SQLite take it at the first claim.
pub(super) async fn claim_past_silence<S: IdempotencyStore>(
    store: &S,
    request: &ClaimRequest,
    ttl: Duration,
) -> ClaimOutcome {
    let first = store.claim(request).await.expect("claim");
    if first != ClaimOutcome::InProgress {
        return first;
    }
    tokio::time::sleep(ttl + Duration::from_millis(100)).await;
    store.claim(request).await.expect("claim")
}

/// [`claim_past_silence`] through a router: the request again a TTL later if it was answered `409`.
async fn send_past_silence(
    router: &axum::Router,
    req: impl Fn() -> super::app::Req,
    ttl: Duration,
) -> Answer {
    let first = send(router, req()).await;
    if first.status != StatusCode::CONFLICT {
        return first;
    }
    tokio::time::sleep(ttl + Duration::from_millis(100)).await;
    send(router, req()).await
}

fn default_layer<S: IdempotencyStore>(store: S) -> IdempotencyLayer<S> {
    IdempotencyLayer::new(store).expect("the default settings fit the store")
}

fn record_key(key: &str) -> RecordKey {
    RecordKey {
        key: key.into(),
        subject: "alice".into(),
        endpoint: "POST /pay".into(),
    }
}

pub(super) fn claim_request(key: &str, ttl: Duration) -> ClaimRequest {
    ClaimRequest::new(
        record_key(key),
        Fingerprint::of(None, b"{}"),
        ttl,
        Duration::from_secs(60),
    )
}

pub(super) fn stored(body: &'static str) -> Arc<StoredResponse> {
    Arc::new(StoredResponse {
        outcome: Finished::Completed,
        status: 201,
        headers: vec![(
            axum::http::header::CONTENT_TYPE,
            axum::http::HeaderValue::from_static("text/plain"),
        )],
        body: Bytes::from_static(body.as_bytes()),
        body_omitted: false,
        expires_in: None,
    })
}

/// A fresh key runs the handler once; its retry is a replay of the same answer.
pub async fn fresh_key_runs_once_then_replays<S: IdempotencyStore>(store: S) {
    let layer = IdempotencyLayer::builder(store)
        .store_header("link")
        .build()
        .expect("layer");
    let (router, counters) = app(layer);
    let req = || {
        post("/pay")
            .key("k1")
            .user("alice")
            .json(r#"{"amount":100}"#)
    };
    let first = send(&router, req()).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(!first.replayed());
    assert_eq!(first.json()["attempt"], 1);
    // The handler got the buffered body unchanged.
    assert_eq!(first.json()["body"], r#"{"amount":100}"#);
    assert_eq!(first.header("set-cookie"), Some("session=secret"));

    let second = send(&router, req()).await;
    assert_eq!(second.status, StatusCode::CREATED);
    assert!(second.replayed());
    assert_eq!(second.body, first.body);
    assert_eq!(second.header("location"), Some("/charges/1"));
    assert_eq!(second.header("content-type"), Some("application/json"));
    let links: Vec<_> = second.headers.get_all("link").iter().collect();
    assert_eq!(links, ["<a>", "<b>"]);
    assert_eq!(
        second.header("set-cookie"),
        None,
        "cookies are never stored"
    );
    assert_eq!(second.header("x-not-stored"), None);
    assert_eq!(counters.started(), 1);
}

/// Reordered JSON keys and other whitespace are the same request: a replay.
pub async fn reordered_json_is_the_same_request<S: IdempotencyStore>(store: S) {
    let (router, counters) = app(default_layer(store));
    let first = send(
        &router,
        post("/pay")
            .key("k")
            .user("alice")
            .json(r#"{"amount":100,"cart":{"items":[{"sku":"a","qty":1}],"total":100}}"#),
    )
    .await;
    assert_eq!(first.status, StatusCode::CREATED);
    let again = send(
        &router,
        post("/pay").key("k").user("alice").json(
            r#"{ "cart": { "total": 100, "items": [ { "qty": 1, "sku": "a" } ] }, "amount": 100 }"#,
        ),
    )
    .await;
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
    assert_eq!(counters.started(), 1);
}

/// A retry whose body differs anywhere, at any depth, is `422 idempotency_key_reuse`.
pub async fn different_body_at_any_depth_is_422<S: IdempotencyStore>(store: S) {
    let (router, counters) = app(default_layer(store));
    let req = |body: &str| post("/pay").key("k").user("alice").json(body);
    let first = send(&router, req(r#"{"cart":{"total":100}}"#)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let reuse = send(&router, req(r#"{"cart":{"total":999}}"#)).await;
    assert_eq!(reuse.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(reuse.problem(), "idempotency_key_reuse");
    let reuse = send(&router, req(r#"{"cart":{"total":100},"extra":1}"#)).await;
    assert_eq!(reuse.status, StatusCode::UNPROCESSABLE_ENTITY);
    // Nothing changed: the original request still replays.
    let replay = send(&router, req(r#"{"cart":{"total":100}}"#)).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
    assert_eq!(counters.started(), 1);
}

/// A retry with another query string is `422`.
pub async fn different_query_is_422<S: IdempotencyStore>(store: S) {
    let (router, counters) = app(default_layer(store));
    let first = send(&router, post("/pay?currency=eur").key("k").user("alice")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let reuse = send(&router, post("/pay?currency=usd").key("k").user("alice")).await;
    assert_eq!(reuse.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(reuse.problem(), "idempotency_key_reuse");
    assert_eq!(counters.started(), 1);
}

/// A definitive failure (a 4xx) is recorded as failed and replayed.
pub async fn definitive_failure_is_replayed<S: IdempotencyStore>(store: S) {
    let (router, counters) = app(default_layer(store));
    let req = || {
        post("/pay")
            .key("k")
            .user("alice")
            .header("x-status", "402")
    };
    let first = send(&router, req()).await;
    assert_eq!(first.status, StatusCode::PAYMENT_REQUIRED);
    let second = send(&router, req()).await;
    assert_eq!(second.status, StatusCode::PAYMENT_REQUIRED);
    assert!(second.replayed());
    assert_eq!(second.body, first.body);
    assert_eq!(counters.started(), 1);
}

/// Retryable answers (5xx, 408, 409, 425, 429) release the key: the retry runs again.
pub async fn retryable_answers_release_the_key<S: IdempotencyStore>(store: S) {
    let (router, counters) = app(default_layer(store));
    for (i, status) in ["500", "503", "408", "409", "425", "429"]
        .iter()
        .enumerate()
    {
        let key = format!("k{i}");
        let failing = send(
            &router,
            post("/pay")
                .key(&key)
                .user("alice")
                .header("x-status", status),
        )
        .await;
        assert_eq!(failing.status.as_str(), *status);
        assert!(!failing.replayed());
        let retry = send(&router, post("/pay").key(&key).user("alice")).await;
        assert_eq!(retry.status, StatusCode::CREATED, "after {status}");
        assert!(!retry.replayed(), "after {status} the retry runs again");
    }
    assert_eq!(counters.started(), 12);
}

/// A duplicate of a request in progress gets `409` with `Retry-After` at once, without waiting.
pub async fn duplicate_in_progress_is_409_at_once<S: IdempotencyStore>(store: S) {
    let (router, counters) = app(default_layer(store));
    let slow = || {
        post("/pay")
            .key("k")
            .user("alice")
            .header("x-delay-ms", "1500")
    };
    let first = tokio::spawn({
        let router = router.clone();
        async move { send(&router, slow()).await }
    });
    let c = counters.clone();
    eventually(move || c.started() == 1).await;
    let duplicate = send(&router, slow()).await;
    // Answered while the first request is still running: the duplicate did not wait for it.
    assert_eq!(
        counters.finished(),
        0,
        "the 409 came before the first finished"
    );
    assert_eq!(duplicate.status, StatusCode::CONFLICT);
    assert_eq!(duplicate.problem(), "in_progress");
    assert_eq!(duplicate.header("retry-after"), Some("2"));
    assert_eq!(duplicate.json()["retryAfterSeconds"], 2);

    let first = first.await.expect("first request");
    assert_eq!(first.status, StatusCode::CREATED);
    let retry = send(&router, slow()).await;
    assert!(retry.replayed());
    assert_eq!(retry.body, first.body);
    assert_eq!(counters.started(), 1);
}

/// A claim whose holder stopped renewing it is retaken after the in-progress TTL, and runs once.
pub async fn stale_in_progress_is_retaken<S: IdempotencyStore>(store: S) {
    let ttl = short_ttl(&store, Duration::from_millis(400));
    let layer = IdempotencyLayer::builder(store.clone())
        .in_progress_ttl(ttl)
        .build()
        .expect("layer");
    let (router, counters) = app(layer);
    // A worker claims the record and dies: it never completes nor releases.
    let mut dead = claim_request("k", ttl);
    dead.fingerprint = Fingerprint::of(None, b"");
    let claimed = store.claim(&dead).await.expect("claim");
    assert!(is_fresh(&claimed, &dead), "{claimed:?}");

    let early = send(&router, post("/pay").key("k").user("alice")).await;
    assert_eq!(early.status, StatusCode::CONFLICT);
    tokio::time::sleep(ttl + Duration::from_millis(200)).await;
    let retaken = send_past_silence(&router, || post("/pay").key("k").user("alice"), ttl).await;
    assert_eq!(retaken.status, StatusCode::CREATED);
    assert!(!retaken.replayed());
    let replay = send(&router, post("/pay").key("k").user("alice")).await;
    assert!(replay.replayed());
    assert_eq!(counters.started(), 1);
}

/// A claimer configured with a shorter in-progress TTL than the holder's (a rolling deploy that
/// lowers it) does not presume the holder dead before the holder's own TTL: the holder renews on its
/// schedule, not the claimer's.
pub async fn a_claimer_with_a_shorter_ttl_waits_for_the_holders<S: IdempotencyStore>(store: S) {
    let short = short_ttl(&store, Duration::from_millis(300));
    let long = short * 4;
    let holder = claim_request("ttls", long);
    let claimed_at = tokio::time::Instant::now();
    let claimed = store.claim(&holder).await.expect("claim");
    assert!(is_fresh(&claimed, &holder), "{claimed:?}");
    let claimer = || ClaimRequest {
        lease: LeaseToken::generate(),
        ..claim_request("ttls", short)
    };
    // Past the claimer's TTL, well within the holder's.
    tokio::time::sleep(short * 2).await;
    assert!(
        matches!(
            store.claim(&claimer()).await.expect("claim"),
            ClaimOutcome::InProgress
        ),
        "a live holder's claim was taken by a claimer with a shorter TTL"
    );
    // A renewal restarts the holder's TTL, not the claimer's.
    assert_eq!(
        store
            .renew(&holder.key, holder.lease, long + holder.retention)
            .await
            .expect("renew"),
        Fenced::Done
    );
    tokio::time::sleep(short * 2).await;
    assert!(matches!(
        store.claim(&claimer()).await.expect("claim"),
        ClaimOutcome::InProgress
    ));
    // Past the holder's TTL since its renewal: it is presumed dead, and one claimer retakes it.
    tokio::time::sleep_until(claimed_at + short * 2 + long + Duration::from_millis(200)).await;
    let retaker = claimer();
    let retaken = claim_past_silence(&store, &retaker, long).await;
    assert!(retaken.is_retake(&retaker), "{retaken:?}");
}

/// A completion or release by a lease that was retaken changes nothing; the retaker's answer stands.
pub async fn late_completion_with_superseded_lease_changes_nothing<S: IdempotencyStore>(store: S) {
    let ttl = Duration::from_millis(200);
    let request = claim_request("k", ttl);
    let ClaimOutcome::Claimed { lease: old, .. } = store.claim(&request).await.expect("claim")
    else {
        panic!("first claim must win");
    };
    tokio::time::sleep(ttl + Duration::from_millis(100)).await;
    // Another request's claim: its own lease and generation, as every claim draws them.
    let mut retry = request.clone();
    retry.lease = LeaseToken::generate();
    retry.generation = crate::store::Generation::generate();
    let outcome = claim_past_silence(&store, &retry, ttl).await;
    let ClaimOutcome::Claimed { lease: new, .. } = outcome.clone() else {
        panic!("a stale claim must be retaken");
    };
    let true = outcome.is_retake(&retry) else {
        panic!("a stale claim must be retaken");
    };
    assert_ne!(old, new);
    let retention = Duration::from_secs(60);
    let key = record_key("k");
    // The worker presumed dead finishes late: neither its completion nor its release counts.
    assert!(
        !store
            .complete(&key, old, &request.fingerprint, stored("late"), retention)
            .await
            .expect("complete")
            .is_done()
    );
    assert!(!store.release(&key, old).await.expect("release").is_done());
    assert!(
        !store
            .renew(&key, old, Duration::from_secs(60))
            .await
            .expect("renew")
            .is_done()
    );
    assert!(
        store
            .complete(&key, new, &request.fingerprint, stored("winner"), retention)
            .await
            .expect("complete")
            .is_done()
    );
    // Once finished, the record cannot be released nor renewed, and the old lease still has nothing.
    assert!(!store.release(&key, new).await.expect("release").is_done());
    assert!(
        !store
            .renew(&key, new, Duration::from_secs(60))
            .await
            .expect("renew")
            .is_done()
    );
    assert!(
        !store
            .complete(&key, old, &request.fingerprint, stored("late"), retention)
            .await
            .expect("complete")
            .is_done()
    );
    match store.claim(&request).await.expect("claim") {
        ClaimOutcome::Finished(response) => assert_eq!(&response.body[..], b"winner"),
        other => panic!("expected the winner's response, got {other:?}"),
    }
}

/// After its retention, a key is new: the handler runs again.
pub async fn retention_makes_the_key_new<S: IdempotencyStore>(store: S) {
    let layer = IdempotencyLayer::builder(store)
        .retention(Duration::from_millis(300))
        .build()
        .expect("layer");
    let (router, counters) = app(layer);
    let first = send(
        &router,
        post("/pay").key("k").user("alice").json("{\"a\":1}"),
    )
    .await;
    assert_eq!(first.status, StatusCode::CREATED);
    let replay = send(
        &router,
        post("/pay").key("k").user("alice").json("{\"a\":1}"),
    )
    .await;
    assert!(replay.replayed());
    tokio::time::sleep(Duration::from_millis(500)).await;
    // After retention the key is new, even for another body.
    let fresh = send(
        &router,
        post("/pay").key("k").user("alice").json("{\"a\":2}"),
    )
    .await;
    assert_eq!(fresh.status, StatusCode::CREATED);
    assert!(!fresh.replayed());
    assert_eq!(fresh.json()["attempt"], 2);
    assert_eq!(counters.started(), 2);
}

/// `purge_expired` removes expired records and reports `purged` of five (0 for a backend that expires records itself).
pub async fn purge_removes_expired_records<S: IdempotencyStore>(store: S, purged: u64) {
    let retention = Duration::from_millis(100);
    for i in 0..5 {
        let mut request = claim_request(&format!("k{i}"), Duration::from_secs(60));
        request.retention = retention;
        let ClaimOutcome::Claimed { lease, .. } = store.claim(&request).await.expect("claim")
        else {
            panic!("fresh key");
        };
        let done = store
            .complete(
                &request.key,
                lease,
                &request.fingerprint,
                stored("x"),
                retention,
            )
            .await
            .expect("complete")
            .is_done();
        assert!(done);
    }
    // One record that does not expire yet.
    let keep = claim_request("keep", Duration::from_secs(60));
    store.claim(&keep).await.expect("claim");
    tokio::time::sleep(Duration::from_millis(250)).await;
    assert_eq!(store.purge_expired().await.expect("purge"), purged);
    assert_eq!(store.purge_expired().await.expect("purge"), 0);
    let another = keep.from_another_request();
    assert_eq!(
        store.claim(&another).await.expect("claim"),
        ClaimOutcome::InProgress
    );
    // The expired keys are new again, with any body.
    for i in 0..5 {
        let mut request = claim_request(&format!("k{i}"), Duration::from_secs(60));
        request.fingerprint = Fingerprint::of(None, b"another body");
        let claimed = store.claim(&request).await.expect("claim");
        assert!(is_fresh(&claimed, &request), "{claimed:?}");
    }
}

/// The same key from another subject is another operation.
pub async fn subjects_are_isolated<S: IdempotencyStore>(store: S) {
    let (router, counters) = app(default_layer(store));
    let alice = send(&router, post("/pay").key("k").user("alice").json("{}")).await;
    let bob = send(&router, post("/pay").key("k").user("bob").json("{\"x\":1}")).await;
    assert_eq!(bob.status, StatusCode::CREATED);
    assert!(!bob.replayed(), "bob must never get alice's replay");
    assert_ne!(alice.body, bob.body);
    let bob_again = send(&router, post("/pay").key("k").user("bob").json("{\"x\":1}")).await;
    assert_eq!(bob_again.body, bob.body);
    assert_eq!(counters.started(), 2);
}

/// The same key on another route is another operation.
pub async fn routes_are_isolated<S: IdempotencyStore>(store: S) {
    let (router, counters) = app(default_layer(store));
    let pay = send(&router, post("/pay").key("k").user("alice")).await;
    let other = send(&router, post("/other").key("k").user("alice")).await;
    assert_eq!(other.status, StatusCode::CREATED);
    assert!(!other.replayed());
    assert_ne!(pay.body, other.body);
    assert_eq!(counters.started(), 2);
}

/// A handler that panics releases the key: the retry runs.
pub async fn panic_releases_the_key<S: IdempotencyStore>(store: S) {
    let (router, counters) = app(default_layer(store));
    let panicked = send(
        &router,
        post("/pay").key("k").user("alice").header("x-panic", "1"),
    )
    .await;
    assert_eq!(panicked.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(panicked.problem(), "internal_error");
    let retry = send(&router, post("/pay").key("k").user("alice")).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(!retry.replayed());
    assert_eq!(counters.started(), 2);
}

/// A client that disconnects cancels neither the handler nor its recording: the retry gets the replay.
pub async fn disconnect_does_not_cancel_the_effect<S: IdempotencyStore>(store: S) {
    let (router, counters) = app(default_layer(store));
    let slow = || {
        post("/pay")
            .key("k")
            .user("alice")
            .header("x-delay-ms", "400")
    };
    let client = tokio::spawn({
        let router = router.clone();
        async move { send(&router, slow()).await }
    });
    let c = counters.clone();
    eventually(move || c.started() == 1).await;
    // The client goes away mid-checkout: its response future is dropped.
    client.abort();
    assert!(client.await.expect_err("aborted").is_cancelled());
    let c = counters.clone();
    eventually(move || c.finished() == 1).await;
    // The handler ran to the end and its answer was recorded: the retry gets the replay.
    let retry = until_not_in_progress(&router, slow, 100).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(retry.replayed());
    assert_eq!(retry.json()["attempt"], 1);
    assert_eq!(counters.started(), 1);
}

/// A response over the recording limit happened: it is recorded without its body, never released.
pub async fn oversized_response_is_recorded_without_its_body<S: IdempotencyStore>(store: S) {
    let layer = IdempotencyLayer::builder(store)
        .response_limit(1000)
        .build()
        .expect("layer");
    let (router, counters) = app(layer);
    let req = || post("/pay").key("k").user("alice").header("x-big", "1001");
    let first = send(&router, req()).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(first.body.len(), 1001, "the client gets the whole body");
    assert_eq!(first.header("idempotency-replay"), None);
    let retry = send(&router, req()).await;
    assert_omitted_replay(&retry, StatusCode::CREATED);
    assert_eq!(counters.started(), 1, "the handler ran once");
    // At the limit exactly, the body is recorded.
    let whole = || post("/pay").key("k2").user("alice").header("x-big", "1000");
    assert_eq!(send(&router, whole()).await.body.len(), 1000);
    let replay = send(&router, whole()).await;
    assert!(replay.replayed());
    assert_eq!(replay.body.len(), 1000);
    assert_eq!(replay.header("idempotency-replay"), None);
}

/// A replay of a record whose body was omitted: status and headers, empty body, the marker header.
fn assert_omitted_replay(answer: &Answer, status: StatusCode) {
    assert_eq!(answer.status, status, "{answer:?}");
    assert!(answer.replayed(), "{answer:?}");
    assert_eq!(answer.header("idempotency-replay"), Some("omitted"));
    assert!(answer.body.is_empty());
    assert!(
        answer
            .header("location")
            .is_some_and(|l| l.starts_with("/charges/")),
        "{answer:?}"
    );
    assert_eq!(answer.header("content-type"), Some("application/json"));
}

/// Many clients send the same key at once, round after round: exactly one handler run per round, and
/// every other client gets 409 or the replay.
pub async fn same_key_race_runs_once<S: IdempotencyStore>(store: S) {
    const TASKS: usize = 32;
    let rounds: usize = std::env::var("RACE_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200);
    let (router, counters) = app(default_layer(store));
    let gate = Arc::new(tokio::sync::Barrier::new(TASKS));
    for round in 0..rounds {
        let before = counters.started();
        let key = format!("race-{round}");
        let mut tasks = JoinSet::new();
        for _ in 0..TASKS {
            let (router, gate, key) = (router.clone(), gate.clone(), key.clone());
            tasks.spawn(async move {
                gate.wait().await;
                send(
                    &router,
                    post("/pay")
                        .key(&key)
                        .user("alice")
                        .header("x-delay-ms", "5"),
                )
                .await
            });
        }
        let mut created = 0;
        while let Some(answer) = tasks.join_next().await {
            let answer = answer.expect("task");
            match answer.status {
                StatusCode::CREATED => created += 1,
                StatusCode::CONFLICT => assert_eq!(answer.problem(), "in_progress"),
                other => panic!("round {round}: unexpected {other}"),
            }
        }
        assert!(created >= 1, "round {round}: someone must get the charge");
        assert_eq!(
            counters.started() - before,
            1,
            "round {round}: exactly one handler run"
        );
    }
}

/// Many retakers of one stale record at once: exactly one wins, every round.
pub async fn stale_retake_race_has_one_winner<S: IdempotencyStore>(store: S) {
    const RETAKERS: usize = 16;
    // The winner's fresh claim must stay younger than the TTL while the others arrive: a wide margin
    // keeps a slow machine from letting a late retaker win a second time.
    let ttl = Duration::from_millis(200);
    for round in 0..20 {
        let request = claim_request(&format!("stale-{round}"), ttl);
        assert!(matches!(
            store.claim(&request).await.expect("claim"),
            ClaimOutcome::Claimed { .. }
        ));
        tokio::time::sleep(ttl + Duration::from_millis(50)).await;
        // On a store that marks a silent holder first (see `claim_past_silence`), the first
        // race only marks it: nobody wins it, and the race a TTL later has the one winner.
        let mut winners = 0;
        for race in 0..2 {
            if race > 0 {
                tokio::time::sleep(ttl + Duration::from_millis(50)).await;
            }
            let gate = Arc::new(tokio::sync::Barrier::new(RETAKERS));
            let mut tasks = JoinSet::new();
            for _ in 0..RETAKERS {
                let (store, gate, mut request) = (store.clone(), gate.clone(), request.clone());
                request.lease = LeaseToken::generate();
                request.generation = crate::store::Generation::generate();
                tasks.spawn(async move {
                    gate.wait().await;
                    let outcome = store.claim(&request).await.expect("claim");
                    (outcome.is_retake(&request), outcome)
                });
            }
            while let Some(outcome) = tasks.join_next().await {
                match outcome.expect("task") {
                    (true, ClaimOutcome::Claimed { .. }) => winners += 1,
                    (_, ClaimOutcome::InProgress) => {}
                    other => panic!("round {round}: unexpected {other:?}"),
                }
            }
            if winners > 0 {
                break;
            }
        }
        assert_eq!(winners, 1, "round {round}: exactly one retaker wins");
    }
}

/// A live handler slower than the in-progress TTL keeps its claim through the heartbeat: duplicates
/// get 409 all along, never a second run.
pub async fn slow_handler_outliving_the_ttl_is_not_retaken<S: IdempotencyStore>(store: S) {
    let ttl = short_ttl(&store, Duration::from_millis(300));
    let layer = IdempotencyLayer::builder(store)
        .in_progress_ttl(ttl)
        .build()
        .expect("layer");
    let (router, counters) = app(layer);
    let delay = (ttl * 5).as_millis().to_string();
    let slow = || {
        post("/pay")
            .key("k")
            .user("alice")
            .header("x-delay-ms", &delay)
    };
    let first = tokio::spawn({
        let router = router.clone();
        let req = slow();
        async move { send(&router, req).await }
    });
    let c = counters.clone();
    eventually(move || c.started() == 1).await;
    // Duplicates over five TTLs while the handler still runs.
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        if counters.finished() == 1 {
            break;
        }
        let duplicate = send(&router, slow()).await;
        assert!(
            duplicate.status == StatusCode::CONFLICT || duplicate.replayed(),
            "{duplicate:?}"
        );
    }
    let first = first.await.expect("first");
    assert_eq!(first.status, StatusCode::CREATED);
    let replay = send(&router, slow()).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
    assert_eq!(counters.started(), 1, "a live handler is never retaken");
}

/// Renewal is the heartbeat: a renewed claim stays in progress past its TTL; one left unrenewed for
/// a TTL is retaken, and its old lease can renew nothing after that.
pub async fn heartbeat_keeps_the_claim_until_it_stops<S: IdempotencyStore>(store: S) {
    let ttl = Duration::from_millis(300);
    let request = claim_request("k", ttl);
    let lease = request.lease;
    let claimed = store.claim(&request).await.expect("claim");
    assert!(is_fresh(&claimed, &request), "{claimed:?}");
    let lifetime = ttl + request.retention;
    for _ in 0..8 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(
            store
                .renew(&request.key, lease, lifetime)
                .await
                .expect("renew")
                .is_done()
        );
    }
    // 800 ms after the claim, over two TTLs: still held.
    let mut other = claim_request("k", ttl);
    assert_eq!(
        store.claim(&other).await.expect("claim"),
        ClaimOutcome::InProgress
    );
    tokio::time::sleep(ttl + Duration::from_millis(100)).await;
    other.lease = LeaseToken::generate();
    let retaken = claim_past_silence(&store, &other, ttl).await;
    assert!(retaken.is_retake(&other), "{retaken:?}");
    assert!(
        !store
            .renew(&request.key, lease, lifetime)
            .await
            .expect("renew")
            .is_done()
    );
    assert!(
        store
            .renew(&request.key, other.lease, lifetime)
            .await
            .expect("renew")
            .is_done()
    );
}

/// A completion whose answer was lost (it committed, then timed out) is retried by the same lease:
/// that counts as done, and changes nothing.
pub async fn completion_by_the_same_lease_is_idempotent<S: IdempotencyStore>(store: S) {
    let request = claim_request("k", Duration::from_secs(30));
    assert!(matches!(
        store.claim(&request).await.expect("claim"),
        ClaimOutcome::Claimed { .. }
    ));
    let (key, lease, retention) = (&request.key, request.lease, Duration::from_secs(60));
    assert!(
        store
            .complete(key, lease, &request.fingerprint, stored("first"), retention)
            .await
            .expect("complete")
            .is_done()
    );
    assert!(
        store
            .complete(key, lease, &request.fingerprint, stored("first"), retention)
            .await
            .expect("complete again")
            .is_done()
    );
    assert!(
        store
            .complete(key, lease, &request.fingerprint, stored("other"), retention)
            .await
            .expect("complete again")
            .is_done()
    );
    assert!(!store.release(key, lease).await.expect("release").is_done());
    match store.claim(&request).await.expect("claim") {
        ClaimOutcome::Finished(response) => {
            assert_eq!(&response.body[..], b"first");
            assert!(!response.body_omitted);
        }
        other => panic!("expected the first response, got {other:?}"),
    }
}

/// The client gets the headers and the first frames while the handler is still producing the body;
/// the record is written when the body ends, and replays the whole body.
pub async fn streamed_response_reaches_the_client_before_it_ends<S: IdempotencyStore>(store: S) {
    use http_body_util::BodyExt;
    use tower::ServiceExt;
    let (router, counters) = app(default_layer(store));
    let req = || {
        post("/pay")
            .key("k")
            .user("alice")
            .header("x-stream", "slow")
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
    assert_eq!(
        counters.streamed(),
        0,
        "the first frame arrived before the handler produced the last"
    );
    // A duplicate while the body streams: the claim is still held.
    let duplicate = send(&router, req()).await;
    assert_eq!(duplicate.status, StatusCode::CONFLICT);
    let rest = body.collect().await.expect("body").to_bytes();
    assert_eq!(rest, "part2");
    let replay = send(&router, req()).await;
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(replay.body, "part1;part2");
    assert_eq!(replay.header("idempotency-replay"), None);
    assert_eq!(counters.started(), 1);
}

/// An endless body (server-sent events) streams while the client reads; once it is over the
/// recording limit the response is recorded without its body and replayed as such, while the
/// stream goes on.
pub async fn endless_body_is_recorded_without_holding_the_claim<S: IdempotencyStore>(store: S) {
    use http_body_util::BodyExt;
    use tower::ServiceExt;
    let layer = IdempotencyLayer::builder(store)
        .response_limit(1000)
        .build()
        .expect("layer");
    let (router, counters) = app(layer);
    let req = || {
        post("/pay")
            .key("k")
            .user("alice")
            .header("x-stream", "endless")
    };
    let response = router
        .clone()
        .oneshot(req().build())
        .await
        .expect("response");
    assert_eq!(response.status(), StatusCode::CREATED);
    let mut body = response.into_body();
    // Read well past the recording limit: the stream goes on.
    let mut read = 0;
    while read < 3000 {
        let frame = body.frame().await.expect("a frame").expect("data");
        read += frame.into_data().map(|d| d.len()).unwrap_or(0);
    }
    // Over the recording limit, the record can only be status and headers: it is written at once,
    // and the rest streams without holding the claim. A duplicate meanwhile gets that replay.
    let duplicate = send(&router, req()).await;
    assert_omitted_replay(&duplicate, StatusCode::CREATED);
    let more = body.frame().await.expect("a frame").expect("data");
    assert!(more.is_data(), "the stream goes on after the record");
    drop(body); // the client goes away
    let retry = send(&router, req()).await;
    assert_omitted_replay(&retry, StatusCode::CREATED);
    assert_eq!(counters.started(), 1);
}

/// A body stream that fails after the handler answered: the effect happened, so the response is
/// recorded without its body.
pub async fn failed_body_stream_is_recorded_without_its_body<S: IdempotencyStore>(store: S) {
    use http_body_util::BodyExt;
    use tower::ServiceExt;
    let (router, counters) = app(default_layer(store));
    let req = || {
        post("/pay")
            .key("k")
            .user("alice")
            .header("x-stream", "fail")
    };
    let response = router
        .clone()
        .oneshot(req().build())
        .await
        .expect("response");
    assert_eq!(response.status(), StatusCode::CREATED);
    assert!(
        response.into_body().collect().await.is_err(),
        "the client sees the failure"
    );
    let retry = send(&router, req()).await;
    assert_omitted_replay(&retry, StatusCode::CREATED);
    assert_eq!(counters.started(), 1);
}

/// Trailers are not recorded: the response is recorded without its body.
pub async fn trailers_are_recorded_without_the_body<S: IdempotencyStore>(store: S) {
    use http_body_util::BodyExt;
    use tower::ServiceExt;
    let (router, counters) = app(default_layer(store));
    let req = || {
        post("/pay")
            .key("k")
            .user("alice")
            .header("x-stream", "trailers")
    };
    let response = router
        .clone()
        .oneshot(req().build())
        .await
        .expect("response");
    let collected = response.into_body().collect().await.expect("body");
    assert_eq!(
        collected.trailers().and_then(|t| t.get("x-checksum")),
        Some(&axum::http::HeaderValue::from_static("abc")),
        "the client gets the trailers"
    );
    assert_eq!(collected.to_bytes(), "part1;");
    let retry = send(&router, req()).await;
    assert_omitted_replay(&retry, StatusCode::CREATED);
    assert_eq!(counters.started(), 1);
}

/// What goes wrong with a wrapped store's claims.
#[derive(Clone, Copy)]
enum ClaimFault {
    /// Claims commit at once, but their answers arrive 300 ms later, as over a slow network.
    LateAnswer,
    /// The first claim commits, then fails, as a claim that timed out after the database committed.
    FirstAnswerLost,
}

/// A store whose claims go wrong as `fault` says; everything else passes through.
#[derive(Clone)]
struct Faulty<S> {
    store: S,
    fault: ClaimFault,
    lost: Arc<std::sync::atomic::AtomicBool>,
}

impl<S> Faulty<S> {
    fn new(store: S, fault: ClaimFault) -> Self {
        Faulty {
            store,
            fault,
            lost: Arc::default(),
        }
    }
}

impl<S: IdempotencyStore> IdempotencyStore for Faulty<S> {
    async fn claim(
        &self,
        request: &ClaimRequest,
    ) -> Result<ClaimOutcome, crate::store::StoreError> {
        let outcome = self.store.claim(request).await;
        match self.fault {
            ClaimFault::LateAnswer => tokio::time::sleep(Duration::from_millis(300)).await,
            ClaimFault::FirstAnswerLost => {
                if !self.lost.swap(true, std::sync::atomic::Ordering::SeqCst) {
                    return Err(crate::store::StoreError::msg("no answer within 5s"));
                }
            }
        }
        outcome
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

    fn operation_timeout(&self) -> Option<Duration> {
        self.store.operation_timeout()
    }

    async fn keeper_session(&self) -> Result<Self, crate::store::StoreError> {
        Ok(Faulty {
            store: self.store.keeper_session().await?,
            fault: self.fault,
            lost: self.lost.clone(),
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

/// The client goes away while the claim is on its way back: the claim has committed, so the request
/// goes on without the client (handler, record), and the retry gets the replay rather than 409 for
/// a whole TTL.
pub async fn disconnect_during_the_claim_still_runs_and_records<S: IdempotencyStore>(store: S) {
    let (router, counters) = app(default_layer(Faulty::new(store, ClaimFault::LateAnswer)));
    let req = || post("/pay").key("k").user("alice").json("{\"amount\":1}");
    let client = tokio::spawn({
        let router = router.clone();
        async move { send(&router, req()).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(counters.started(), 0, "still claiming");
    client.abort();
    assert!(client.await.expect_err("aborted").is_cancelled());
    let c = counters.clone();
    eventually(move || c.finished() == 1).await;
    let retry = until_not_in_progress(&router, req, 100).await;
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(retry.json()["attempt"], 1);
    assert_eq!(counters.started(), 1);
}

/// Every store accepts every scope the layer lets through: an endpoint and a subject of the
/// longest lengths the layer takes (4096 and 1024 bytes), the subject with NUL and non-ASCII
/// characters; scopes that differ only in such characters stay apart; one byte more is refused
/// before any claim.
pub async fn any_scope_the_layer_lets_through_is_stored<S: IdempotencyStore>(store: S) {
    const SUBJECT: usize = 1024;
    const ENDPOINT: usize = 4096;
    let layer = IdempotencyLayer::builder(store)
        .subject_extractor(|parts: &axum::http::request::Parts| {
            let user = parts.headers.get("x-user")?.to_str().ok()?;
            let user = user.replace("NUL", "\0").replace("FFFD", "\u{FFFD}");
            let prefix = format!("{user}-é-漢-");
            let longer = usize::from(parts.headers.contains_key("x-longer"));
            Some(prefix.clone() + &"s".repeat(SUBJECT - prefix.len() + longer))
        })
        .endpoint(|parts: &axum::http::request::Parts| {
            let base = format!("{} {}", parts.method, parts.uri.path());
            base.clone() + &"x".repeat(ENDPOINT - base.len())
        })
        .build()
        .expect("layer");
    let (router, counters) = app(layer);
    for user in ["aNULb", "aFFFDb", "plain"] {
        let req = || post("/pay").key("k").user(user).json("{\"amount\":1}");
        let first = send(&router, req()).await;
        assert_eq!(first.status, StatusCode::CREATED, "{user}: {first:?}");
        assert!(!first.replayed(), "{user}: another subject's record");
        let replay = send(&router, req()).await;
        assert!(replay.replayed(), "{user}: {replay:?}");
        assert_eq!(replay.body, first.body);
    }
    let longer = post("/pay")
        .key("k2")
        .user("plain")
        .header("x-longer", "1")
        .json("{\"amount\":1}");
    let refused = send(&router, longer).await;
    assert_eq!(refused.status, StatusCode::BAD_REQUEST, "{refused:?}");
    assert_eq!(refused.problem(), "subject_too_long");
    assert_eq!(counters.started(), 3);
}

/// A claim that committed but whose answer was lost is answered 503 and released by its token in
/// the background: the retry runs within moments, not after a whole in-progress TTL of 409s.
pub async fn claim_whose_answer_was_lost_is_released<S: IdempotencyStore>(store: S) {
    let store = Faulty::new(store, ClaimFault::FirstAnswerLost);
    let (router, counters) = app(default_layer(store));
    let req = || post("/pay").key("k").user("alice").json("{\"amount\":1}");
    let lost = send(&router, req()).await;
    assert_eq!(lost.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(lost.problem(), "idempotency_store_unavailable");
    assert_eq!(counters.started(), 0);
    let retry = until_not_in_progress(&router, req, 100).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    assert!(!retry.replayed());
    assert_eq!(counters.started(), 1);
}

/// A body that stops producing (it waits for an event that never comes) after the client left: the
/// response is recorded without its body once the in-progress TTL has passed, not held for ever.
pub async fn stalled_body_is_recorded_after_the_client_leaves<S: IdempotencyStore>(store: S) {
    use http_body_util::BodyExt;
    use tower::ServiceExt;
    let ttl = short_ttl(&store, Duration::from_millis(300));
    let layer = IdempotencyLayer::builder(store)
        .in_progress_ttl(ttl)
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
    let mut body = response.into_body();
    let first = body.frame().await.expect("a frame").expect("data");
    assert_eq!(first.into_data().expect("data"), "part1;");
    drop(body); // the client goes away; the handler's body never ends
    let retry = until_not_in_progress(&router, req, 150).await;
    assert_omitted_replay(&retry, StatusCode::CREATED);
    assert_eq!(counters.started(), 1);
}

/// A body that panics after the handler answered: the effect happened, so the response is recorded
/// without its body (never released), whether the panic comes at once or while streaming.
pub async fn panicking_body_is_recorded_without_its_body<S: IdempotencyStore>(store: S) {
    use http_body_util::BodyExt;
    use tower::ServiceExt;
    let (router, counters) = app(default_layer(store));
    for (i, kind) in ["panic", "late-panic"].into_iter().enumerate() {
        let key = format!("k{i}");
        let req = || {
            post("/pay")
                .key(&key)
                .user("alice")
                .header("x-stream", kind)
        };
        let response = router
            .clone()
            .oneshot(req().build())
            .await
            .expect("response");
        assert_eq!(response.status(), StatusCode::CREATED);
        assert!(
            response.into_body().collect().await.is_err(),
            "{kind}: the client sees the body fail"
        );
        let retry = until_not_in_progress(&router, req, 100).await;
        assert_omitted_replay(&retry, StatusCode::CREATED);
        assert_eq!(counters.started(), i + 1, "{kind}: the handler ran once");
    }
}

/// A claim sent twice with one lease (a client library that resends a command whose reply was lost)
/// finds its own record: it is claimed, not "in progress" until the TTL; another lease still gets
/// `InProgress`, and a finished record is replayed.
pub async fn a_claim_sent_twice_by_its_lease_is_still_claimed<S: IdempotencyStore>(store: S) {
    let request = claim_request("twice", Duration::from_secs(60));
    let first = store.claim(&request).await.expect("claim");
    assert!(is_fresh(&first, &request), "{first:?}");
    assert_eq!(
        store.claim(&request).await.expect("claim again"),
        ClaimOutcome::Claimed {
            lease: request.lease,
            generation: Some(request.generation),
        }
    );
    let other = request.from_another_request();
    assert_eq!(
        store.claim(&other).await.expect("claim"),
        ClaimOutcome::InProgress
    );
    assert!(
        store
            .complete(
                &request.key,
                request.lease,
                &request.fingerprint,
                stored("done"),
                request.retention
            )
            .await
            .expect("complete")
            .is_done()
    );
    assert!(matches!(
        store.claim(&request).await.expect("claim after"),
        ClaimOutcome::Finished(_)
    ));
}

/// A handler that blocks its thread (a synchronous SDK, a CPU loop) for three TTLs from its first
/// poll: the heartbeat runs on a thread of its own, so a duplicate gets 409 all along, and the
/// handler runs once.
pub async fn handler_blocking_its_thread_is_not_retaken<S: IdempotencyStore>(store: S) {
    let ttl = short_ttl(&store, Duration::from_millis(300));
    let layer = IdempotencyLayer::builder(store)
        .in_progress_ttl(ttl)
        .build()
        .expect("layer");
    let (router, counters) = app(layer);
    let block = (ttl * 3).as_millis().to_string();
    let req = || {
        post("/pay")
            .key("k")
            .user("alice")
            .header("x-block-ms", &block)
    };
    let first = tokio::spawn({
        let router = router.clone();
        let req = req();
        async move { send(&router, req).await }
    });
    let c = counters.clone();
    eventually(move || c.started() == 1).await;
    // Past the TTL, while the handler still blocks its thread.
    tokio::time::sleep(ttl * 3 / 2).await;
    let duplicate = send(&router, req()).await;
    assert_eq!(
        duplicate.status,
        StatusCode::CONFLICT,
        "a blocked but live handler is not retaken: {duplicate:?}"
    );
    let first = first.await.expect("first");
    assert_eq!(first.status, StatusCode::CREATED);
    let replay = until_not_in_progress(&router, req, 100).await;
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(counters.started(), 1);
}

/// A store whose claim answers arrive late (a slow commit, a lost packet, a throttled process):
/// the claim is made at once, its answer delivered `delay` later.
#[derive(Clone)]
struct LateClaims<S> {
    inner: S,
    delay: Duration,
}

impl<S: IdempotencyStore> IdempotencyStore for LateClaims<S> {
    async fn claim(
        &self,
        request: &ClaimRequest,
    ) -> Result<ClaimOutcome, crate::store::StoreError> {
        let outcome = self.inner.claim(request).await;
        tokio::time::sleep(self.delay).await;
        outcome
    }

    fn complete(
        &self,
        key: &RecordKey,
        lease: LeaseToken,
        fingerprint: &Fingerprint,
        response: Arc<StoredResponse>,
        retention: Duration,
    ) -> impl std::future::Future<Output = Result<Fenced, crate::store::StoreError>> + Send {
        self.inner
            .complete(key, lease, fingerprint, response, retention)
    }

    fn renew(
        &self,
        key: &RecordKey,
        lease: LeaseToken,
        lifetime: Duration,
    ) -> impl std::future::Future<Output = Result<Fenced, crate::store::StoreError>> + Send {
        self.inner.renew(key, lease, lifetime)
    }

    fn release(
        &self,
        key: &RecordKey,
        lease: LeaseToken,
    ) -> impl std::future::Future<Output = Result<Fenced, crate::store::StoreError>> + Send {
        self.inner.release(key, lease)
    }

    fn purge_expired(
        &self,
    ) -> impl std::future::Future<Output = Result<u64, crate::store::StoreError>> + Send {
        self.inner.purge_expired()
    }

    async fn lookup(
        &self,
        key: &crate::store::RecordKey,
    ) -> Result<Option<crate::store::RecordInfo>, crate::store::StoreError> {
        self.inner.lookup(key).await
    }
    async fn delete(
        &self,
        key: &crate::store::RecordKey,
    ) -> Result<crate::store::Deleted, crate::store::StoreError> {
        self.inner.delete(key).await
    }
    async fn list(
        &self,
        subject: &str,
        request: crate::store::ListRequest,
    ) -> Result<crate::store::RecordPage, crate::store::StoreError> {
        self.inner.list(subject, request).await
    }
    async fn count_records(
        &self,
        subject: &str,
        up_to: u64,
    ) -> Result<Option<crate::store::SubjectUsage>, crate::store::StoreError> {
        self.inner.count_records(subject, up_to).await
    }

    fn counts_records(&self) -> bool {
        self.inner.counts_records()
    }

    fn operation_timeout(&self) -> Option<Duration> {
        self.inner.operation_timeout()
    }

    async fn keeper_session(&self) -> Result<Self, crate::store::StoreError> {
        Ok(LateClaims {
            inner: self.inner.keeper_session().await?,
            delay: self.delay,
        })
    }

    async fn show_presences(
        &self,
        live: &[crate::store::Presence],
        lapse: Duration,
    ) -> Result<(), crate::store::StoreError> {
        self.inner.show_presences(live, lapse).await
    }
}

/// A claim whose answer reaches its instance only after the in-progress TTL: meanwhile another
/// instance found the record stale and retook it. The late instance must not trust its answer: it
/// proves the lease with a guarded renewal, which fails, and answers 503 without running the
/// handler. One run.
pub async fn claim_answered_after_the_ttl_does_not_run_twice<S: IdempotencyStore>(store: S) {
    let ttl = short_ttl(&store, Duration::from_millis(300));
    // Its answer comes back after the other instance's retake: past the TTL, and a TTL after
    // the other's first try found the holder silent (see `claim_past_silence`).
    let late = IdempotencyLayer::builder(LateClaims {
        inner: store.clone(),
        delay: ttl * 4,
    })
    .in_progress_ttl(ttl)
    .build()
    .expect("layer");
    let prompt = IdempotencyLayer::builder(store)
        .in_progress_ttl(ttl)
        .build()
        .expect("layer");
    let (late_router, late_counters) = app(late);
    let (router, counters) = app(prompt);
    let req = || post("/pay").key("k").user("alice");
    let slow = tokio::spawn({
        let late_router = late_router.clone();
        let req = req();
        async move { send(&late_router, req).await }
    });
    // The late instance's claim is in the store, never renewed: stale after the TTL.
    tokio::time::sleep(ttl + ttl / 3).await;
    // Tries 20 ms apart for two TTLs and a second: the first finds the holder silent, and a
    // store that marks it first takes it a TTL later.
    let tries = usize::try_from((ttl * 2 + Duration::from_secs(1)).as_millis() / 20).unwrap_or(500);
    let retaken = until_not_in_progress(&router, req, tries).await;
    assert_eq!(retaken.status, StatusCode::CREATED, "{retaken:?}");
    assert!(!retaken.replayed(), "{retaken:?}");
    let slow = slow.await.expect("late instance");
    assert_eq!(
        slow.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "a claim answered too late is not used: {slow:?}"
    );
    assert_eq!(
        late_counters.started() + counters.started(),
        1,
        "the handler ran once"
    );
    let replay = send(&router, req()).await;
    assert!(replay.replayed());
}

fn generation_of(outcome: ClaimOutcome) -> crate::store::Generation {
    match outcome {
        ClaimOutcome::Claimed {
            generation: Some(generation),
            ..
        } => generation,
        other => panic!("expected a claim with a generation, got {other:?}"),
    }
}

/// The record's generation (what the derived key names): a retake of a record whose holder died
/// keeps it, and so does the retry of a released record with the same request (the provider must
/// see the same operation: the released run may have called it); another request after a release,
/// and a key claimed again after its record expired, get the new claim's (another operation).
///
/// It is also the one rule of [`ClaimOutcome::is_retake`] on every store: a run is a retake exactly
/// when an earlier run of the operation held the record (a stale one, a released one taken by the
/// same request, either sent twice), never for a record the claim made.
pub async fn generation_is_kept_by_retakes_and_new_after_expiry_or_release<S: IdempotencyStore>(
    store: S,
) {
    let ttl = Duration::from_millis(200);
    // Claimed, holder dies, retaken after the TTL: the same generation.
    let first = claim_request("g", ttl);
    let g1 = generation_of(store.claim(&first).await.expect("claim"));
    assert_eq!(g1, first.generation);
    tokio::time::sleep(ttl + Duration::from_millis(100)).await;
    let mut retaker = claim_request("g", ttl);
    assert_ne!(retaker.generation, g1);
    retaker.generation = crate::store::Generation::generate();
    let outcome = claim_past_silence(&store, &retaker, ttl).await;
    assert!(outcome.is_retake(&retaker), "{outcome:?}");
    assert_eq!(generation_of(outcome), g1, "a retake is the same operation");
    // The same claim sent twice answers its record's generation: a retake again.
    let again = store.claim(&retaker).await.expect("again");
    assert!(again.is_retake(&retaker), "{again:?}");
    assert_eq!(generation_of(again), g1);
    // Released, then retried: the same operation, at once (no 409, no TTL to wait).
    assert!(
        store
            .release(&retaker.key, retaker.lease)
            .await
            .expect("release")
            .is_done()
    );
    let retry = claim_request("g", ttl);
    let outcome = store.claim(&retry).await.expect("claim after release");
    // The retry of a released run is the same operation: its generation, so a retake (an
    // earlier run may have started the effect).
    assert!(outcome.is_retake(&retry), "{outcome:?}");
    assert_eq!(generation_of(outcome), g1, "the retry of a released run");
    // The old lease holds nothing any more.
    assert!(
        !store
            .renew(&retaker.key, retaker.lease, Duration::from_secs(60))
            .await
            .expect("renew")
            .is_done()
    );
    // A released record is held by no lease: lease 0 (which marks it in some stores) finishes
    // and renews nothing.
    assert!(
        store
            .release(&retry.key, retry.lease)
            .await
            .expect("release")
            .is_done()
    );
    let nobody = LeaseToken(0);
    assert!(
        !store
            .complete(
                &retry.key,
                nobody,
                &retry.fingerprint,
                stored("forged"),
                Duration::from_secs(60)
            )
            .await
            .expect("complete")
            .is_done()
    );
    assert!(
        !store
            .renew(&retry.key, nobody, Duration::from_secs(60))
            .await
            .expect("renew")
            .is_done()
    );
    assert!(
        !store
            .release(&retry.key, nobody)
            .await
            .expect("release")
            .is_done()
    );
    let again = claim_request("g", ttl);
    assert_eq!(generation_of(store.claim(&again).await.expect("claim")), g1);
    let retry = again;
    // Released, then another request with the key: a new operation, not a 422.
    assert!(
        store
            .release(&retry.key, retry.lease)
            .await
            .expect("release")
            .is_done()
    );
    let mut other = claim_request("g", ttl);
    other.fingerprint = Fingerprint::of(None, b"{\"other\":1}");
    let g2 = generation_of(
        store
            .claim(&other)
            .await
            .expect("another request after release"),
    );
    assert_eq!(g2, other.generation);
    assert_ne!(g2, g1);
    // Finished, then past its retention: the key claimed again is a new operation too.
    let mut short = claim_request("h", ttl);
    short.retention = Duration::from_millis(300);
    let g3 = generation_of(store.claim(&short).await.expect("claim"));
    assert!(
        store
            .complete(
                &short.key,
                short.lease,
                &short.fingerprint,
                stored("done"),
                short.retention,
            )
            .await
            .expect("complete")
            .is_done()
    );
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let mut reuse = claim_request("h", ttl);
    reuse.retention = short.retention;
    let outcome = store.claim(&reuse).await.expect("claim after retention");
    assert!(is_fresh(&outcome, &reuse), "{outcome:?}");
    let g4 = generation_of(outcome);
    assert_eq!(g4, reuse.generation);
    assert_ne!(g4, g3, "a key reused after retention is another operation");
    // In progress, its holder gone, and then past its whole lifetime (TTL and retention): the
    // record is gone as a finished one is, and the key claimed again is a new operation, not a
    // retake, on every store (Redis has expired it; the others must answer the same).
    let mut lost = claim_request("i", ttl);
    lost.retention = Duration::from_millis(300);
    let lost_generation = generation_of(store.claim(&lost).await.expect("claim"));
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let mut after = claim_request("i", ttl);
    after.retention = lost.retention;
    let outcome = store.claim(&after).await.expect("claim after expiry");
    assert!(is_fresh(&outcome, &after), "{outcome:?}");
    assert_ne!(generation_of(outcome), lost_generation);
}

/// While this instance holds a key, a duplicate here gets `409` (or `422` for another body) from the
/// layer's own hold, with no claim reaching the store; another instance (another layer) asks the
/// store and gets `409` too. Once the record is finished, claims reach the store again.
pub async fn duplicates_at_the_holding_instance_skip_the_store<S: IdempotencyStore>(store: S) {
    let counting = Counting::new(store);
    let (router, counters) = app(IdempotencyLayer::new(counting.clone()).expect("valid settings"));
    let (other, other_counters) =
        app(IdempotencyLayer::new(counting.clone()).expect("valid settings"));
    let req = || post("/pay").key("k").user("alice").json("{}");
    let slow = tokio::spawn({
        let router = router.clone();
        async move { send(&router, req().header("x-delay-ms", "600")).await }
    });
    eventually(|| counters.started() == 1).await;
    for n in 0..3 {
        let duplicate = send(&router, req()).await;
        assert_eq!(duplicate.status, StatusCode::CONFLICT);
        assert_eq!(duplicate.problem(), "in_progress");
        let reused = send(&router, post("/pay").key("k").user("alice").json("[]")).await;
        assert_eq!(reused.status, StatusCode::UNPROCESSABLE_ENTITY);
        assert_eq!(counting.claims(), 1 + n, "answered by this instance's hold");
        assert_eq!(send(&other, req()).await.status, StatusCode::CONFLICT);
        assert_eq!(
            counting.claims(),
            2 + n,
            "the other instance asked the store"
        );
    }
    let first = slow.await.expect("slow request");
    assert_eq!(first.status, StatusCode::CREATED);
    let before = counting.claims();
    let replay = send(&router, req()).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
    assert_eq!(counting.claims(), before + 1, "no hold left once recorded");
    assert!(send(&other, req()).await.replayed());
    assert_eq!((counters.started(), other_counters.started()), (1, 0));
}

/// Twenty duplicates at once at one instance, over rounds: one claim reaches the store, the
/// handler runs once, and the other nineteen get `409`.
pub async fn a_burst_of_duplicates_costs_the_store_one_claim<S: IdempotencyStore>(store: S) {
    let counting = Counting::new(store);
    let (router, counters) = app(IdempotencyLayer::new(counting.clone()).expect("valid settings"));
    for round in 0..3 {
        let before = counting.claims();
        let key = format!("burst-{round}");
        let barrier = Arc::new(tokio::sync::Barrier::new(20));
        let mut racers = JoinSet::new();
        for _ in 0..20 {
            let (router, barrier, key) = (router.clone(), barrier.clone(), key.clone());
            racers.spawn(async move {
                barrier.wait().await;
                let req = post("/pay").key(&key).user("alice").json("{}");
                send(&router, req.header("x-delay-ms", "300")).await.status
            });
        }
        let mut statuses = Vec::new();
        while let Some(status) = racers.join_next().await {
            statuses.push(status.expect("racer"));
        }
        let count = |wanted| statuses.iter().filter(|s| **s == wanted).count();
        assert_eq!(
            (count(StatusCode::CREATED), count(StatusCode::CONFLICT)),
            (1, 19),
            "{statuses:?}"
        );
        assert_eq!(counting.claims() - before, 1, "one claim reached the store");
    }
    assert_eq!(counters.started(), 3);
}

/// `renew_many` renews each lease as `renew` would, each with its own answer in the order asked:
/// a held lease is renewed (its record not stale a TTL after its claim), a released, finished,
/// superseded or unknown one answers `LeaseLost` and changes nothing.
pub async fn renew_many_answers_each_lease_on_its_own<S: IdempotencyStore>(store: S) {
    let ttl = Duration::from_millis(400);
    let lifetime = ttl + Duration::from_secs(60);
    let claimed = |key: &'static str| {
        let request = claim_request(key, ttl);
        let store = &store;
        async move {
            let outcome = store.claim(&request).await.expect("claim");
            assert!(
                matches!(outcome, ClaimOutcome::Claimed { .. }),
                "{outcome:?}"
            );
            request
        }
    };
    assert!(store.renew_many(&[], lifetime).await.is_empty());
    let held = claimed("rm-held").await;
    let released = claimed("rm-released").await;
    let done = store.release(&released.key, released.lease).await;
    assert_eq!(done.expect("release"), Fenced::Done);
    let finished = claimed("rm-finished").await;
    let done = store
        .complete(
            &finished.key,
            finished.lease,
            &finished.fingerprint,
            stored("{}"),
            Duration::from_secs(60),
        )
        .await;
    assert_eq!(done.expect("complete"), Fenced::Done);
    let other = claimed("rm-other").await;
    let also_held = claimed("rm-also-held").await;
    let unknown = record_key("rm-never-claimed");
    tokio::time::sleep(ttl * 3 / 4).await;
    let answers = store
        .renew_many(
            &[
                (&held.key, held.lease),
                (&released.key, released.lease),
                (&finished.key, finished.lease),
                (&other.key, LeaseToken::generate()),
                (&unknown, LeaseToken::generate()),
                (&also_held.key, also_held.lease),
            ],
            lifetime,
        )
        .await;
    let answers: Vec<Fenced> = answers
        .into_iter()
        .map(|answer| answer.expect("renewed or lost"))
        .collect();
    use Fenced::{Done, LeaseLost};
    assert_eq!(
        answers,
        vec![Done, LeaseLost, LeaseLost, LeaseLost, LeaseLost, Done]
    );
    // Past the TTL from the claims: the renewed records are not stale, the other one is.
    tokio::time::sleep(ttl / 2).await;
    for request in [&held, &also_held] {
        let duplicate = claim_request(&request.key.key, ttl);
        let outcome = store.claim(&duplicate).await.expect("claim");
        assert_eq!(outcome, ClaimOutcome::InProgress, "{}", request.key.key);
    }
    let retaker = claim_request("rm-other", ttl);
    let outcome = claim_past_silence(&store, &retaker, ttl).await;
    assert!(outcome.is_retake(&retaker), "not renewed: {outcome:?}");
    // The finished record is still finished; the released one still taken at once.
    let replay = store.claim(&claim_request("rm-finished", ttl)).await;
    assert!(matches!(replay.expect("claim"), ClaimOutcome::Finished(_)));
}
