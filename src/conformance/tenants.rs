//! Tenants share nothing a group of them can exhaust (SPEC 25): sixteen subjects flood a store
//! as fast as they can while a seventeenth sends its checkouts one after another, every one of
//! which is served.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use axum::http::StatusCode;

use super::app::{app, post, send};
use crate::IdempotencyLayer;
use crate::store::IdempotencyStore;

/// Sixteen subjects, each with more requests in flight than its share, every one a new key, for
/// `secs` seconds, many of them left by their clients after the body was sent (run on, detached);
/// meanwhile a seventeenth subject, come once the flood is under way, sends a checkout every
/// 50 ms, and every one is served (`201` at its first send). The flood is held to the subjects' shares: they get `429` (and the
/// instance's `503` when its places are taken, never the seventeenth's), and the store still
/// answers.
///
/// The layer has small shares so that the flood meets them: 8 requests in flight a subject, 64
/// in flight (attached or running on after their clients left) in all, 400 records a subject.
pub async fn a_flood_of_sixteen_subjects_shuts_out_no_other<S: IdempotencyStore>(
    store: S,
    secs: u64,
) {
    const FLOODERS: usize = 16;
    const EACH: usize = 12;
    let layer = IdempotencyLayer::builder(store)
        .max_in_flight_per_subject(8)
        .max_running(64)
        .max_records_per_subject(Some(400))
        .build()
        .expect("layer");
    let (router, _) = app(layer);
    let stop = Arc::new(AtomicBool::new(false));
    let refused = Arc::new(AtomicUsize::new(0));
    let served = Arc::new(AtomicUsize::new(0));
    let mut flood = tokio::task::JoinSet::new();
    for subject in 0..FLOODERS {
        for lane in 0..EACH {
            let (router, stop, refused, served) = (
                router.clone(),
                stop.clone(),
                refused.clone(),
                served.clone(),
            );
            flood.spawn(async move {
                let user = format!("flood-{subject}");
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    n += 1;
                    let key = format!("{lane}-{n}");
                    let request = post("/pay")
                        .key(&key)
                        .user(&user)
                        .header("x-delay-ms", "100")
                        .json("{\"amount\":1}");
                    if n.is_multiple_of(3) {
                        // The client leaves once its request is under way: it runs on.
                        let _ =
                            tokio::time::timeout(Duration::from_millis(20), send(&router, request))
                                .await;
                        continue;
                    }
                    let answer = send(&router, request).await;
                    match answer.status {
                        StatusCode::CREATED => served.fetch_add(1, Ordering::Relaxed),
                        _ => refused.fetch_add(1, Ordering::Relaxed),
                    };
                    // A refusal comes without an await that yields (over a network, reading the
                    // next request would): the task gives its worker a turn, and goes on.
                    tokio::task::yield_now().await;
                }
            });
        }
    }
    // The seventeenth comes while they flood: once the flood meets its shares, and the places
    // its first burst took (every subject new, none marked yet: they may fill every place, as
    // any subjects that all come at once may) have come round, which takes as long as the store
    // is slow: as many served as there are places.
    let started = tokio::time::Instant::now();
    while refused.load(Ordering::Relaxed) == 0 || served.load(Ordering::Relaxed) < 64 {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the flood never met its shares, or was never served"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let end = tokio::time::Instant::now() + Duration::from_secs(secs);
    let mut checkouts = 0;
    while tokio::time::Instant::now() < end {
        checkouts += 1;
        let sent = tokio::time::Instant::now();
        let answer = send(
            &router,
            post("/pay")
                .key(&format!("checkout-{checkouts}"))
                .user("the-seventeenth")
                .json("{\"amount\":7}"),
        )
        .await;
        assert_eq!(
            answer.status,
            StatusCode::CREATED,
            "checkout {checkouts} of the seventeenth subject, during the flood, answered in {:?}: \
             {answer:?}",
            sent.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.store(true, Ordering::Relaxed);
    while let Some(done) = flood.join_next().await {
        done.expect("flood");
    }
    assert!(checkouts >= 10, "{checkouts} checkouts");
    assert!(
        refused.load(Ordering::Relaxed) > 0,
        "the flood met its shares ({} served)",
        served.load(Ordering::Relaxed)
    );
}

/// A subject whose answers are large is held to its share of the store's bytes: its new keys get
/// `429 idempotency_quota_exceeded` once its recorded answers reach the share (passed by at most
/// one answer, its requests coming one at a time at one instance), its recorded answers still
/// replay, and another subject is served.
pub async fn a_subject_past_its_share_of_bytes_is_refused_new_keys_only<S: IdempotencyStore>(
    store: S,
) {
    const SHARE: u64 = 64 * 1024;
    const ANSWER: u64 = 8 * 1024;
    let layer = IdempotencyLayer::builder(store)
        .max_records_per_subject(Some(1000))
        .max_bytes_per_subject(Some(SHARE))
        .build()
        .expect("layer");
    let (router, counters) = app(layer);
    let (mut served, mut refused) = (0u64, 0u64);
    for i in 0..40 {
        let answer = send(
            &router,
            post("/pay")
                .key(&format!("big-{i}"))
                .user("large-answers")
                .header("x-big", &ANSWER.to_string()),
        )
        .await;
        match answer.status {
            StatusCode::CREATED => served += 1,
            StatusCode::TOO_MANY_REQUESTS => {
                assert_eq!(answer.problem(), "idempotency_quota_exceeded");
                refused += 1;
            }
            other => panic!("{other}: {answer:?}"),
        }
    }
    assert!(
        served * ANSWER <= SHARE + ANSWER,
        "{served} answers of {ANSWER} bytes recorded past a share of {SHARE}"
    );
    // Near its share: a store may count each record's key and headers too (the memory store
    // does), a few hundred bytes each.
    assert!(served * ANSWER >= SHARE * 3 / 4, "only {served} served");
    assert_eq!(served + refused, 40);
    let runs = counters.started();
    let replay = send(
        &router,
        post("/pay")
            .key("big-0")
            .user("large-answers")
            .header("x-big", &ANSWER.to_string()),
    )
    .await;
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(replay.body.len() as u64, ANSWER);
    assert_eq!(counters.started(), runs, "a replay runs nothing");
    for i in 0..3 {
        let answer = send(
            &router,
            post("/pay")
                .key(&format!("small-{i}"))
                .user("small-answers"),
        )
        .await;
        assert_eq!(answer.status, StatusCode::CREATED, "{answer:?}");
    }
}
