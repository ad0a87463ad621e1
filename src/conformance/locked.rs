//! A store locked by another program (SPEC 24), for the stores a third party can lock: a backup,
//! another application, a migration holding the store's write lock longer than the in-progress
//! TTL must not make a live holder look dead.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use axum::http::StatusCode;
use tokio::sync::oneshot;

use super::app::{app, post, send, short_ttl};
use crate::IdempotencyLayer;
use crate::store::IdempotencyStore;

/// Holds the store's write lock as another program would: takes it, says so on `held`, keeps it
/// for the duration, then gives it back, and returns. On PostgreSQL `LOCK TABLE ... IN EXCLUSIVE
/// MODE` in a transaction; on MySQL `LOCK TABLES ... WRITE`; on SQLite `BEGIN IMMEDIATE`.
pub type Lock = Box<
    dyn Fn(Duration, oneshot::Sender<()>) -> Pin<Box<dyn Future<Output = ()> + Send>> + Send + Sync,
>;

/// Two instances share `store` (two layers, each with its own lease keeper); a request runs its
/// handler for three in-progress TTLs at the first. Meanwhile another program holds the store's
/// write lock for two TTLs (`lock`), so the holder's renewals wait on it like everyone's; retries
/// of the key go to the second instance one after the other from half a TTL before the lock is
/// given back (so one waits on it, beside the holder's renewal, when it goes) until the handler
/// is done. Twenty runs in a row: every handler runs once, every retry gets
/// `409` (or `503` while the store is locked), never a second run, and the first request gets its
/// own answer (or, when the store just given back was too busy to take its record in time, the
/// `503` saying it ran and is not recorded yet), which the retries then replay.
///
/// Give the store a short operation timeout (`150 ms`), so that the TTL (at least twice it) and
/// the runs stay short.
pub async fn a_locked_store_does_not_make_a_live_holder_look_dead<S: IdempotencyStore>(
    store: S,
    lock: Lock,
) {
    const RUNS: usize = 20;
    let ttl = short_ttl(&store, Duration::from_millis(300));
    let layer = || {
        IdempotencyLayer::builder(store.clone())
            .in_progress_ttl(ttl)
            .build()
            .expect("layer")
    };
    let (first, first_runs) = app(layer());
    let (second, second_runs) = app(layer());
    let runs = || first_runs.started() + second_runs.started();
    let delay = (ttl * 3).as_millis().to_string();
    for run in 0..RUNS {
        let key = format!("locked-{run}");
        let request = || {
            post("/pay")
                .key(&key)
                .user("alice")
                .header("x-delay-ms", &delay)
                .json("{\"amount\":7}")
        };
        let before = runs();
        let started = tokio::time::Instant::now();
        // The first request, sent again should the store be too busy to claim it (a `503` before
        // anything ran: not what this test is about).
        let holder = tokio::spawn({
            let (router, requests, counted) = (
                first.clone(),
                (0..20).map(|_| request()).collect::<Vec<_>>(),
                (first_runs.clone(), second_runs.clone()),
            );
            async move {
                let mut answer = None;
                for request in requests {
                    let sent = send(&router, request).await;
                    let busy = sent.status == StatusCode::SERVICE_UNAVAILABLE
                        && counted.0.started() + counted.1.started() == before;
                    answer = Some(sent);
                    if !busy {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                answer.expect("sent")
            }
        });
        super::app::eventually(|| runs() == before + 1).await;
        let (held, taken) = oneshot::channel();
        let locker = tokio::spawn(lock(ttl * 2, held));
        taken.await.expect("the store was locked");
        // The last half TTL of the lock, when the holder has not renewed for a TTL and more:
        // a retry every twentieth of the TTL, each on its own, so that several wait on the lock
        // when it goes, beside the holder's renewal.
        tokio::time::sleep(ttl * 3 / 2).await;
        let mut retries = tokio::task::JoinSet::new();
        while !locker.is_finished() {
            let (second, request) = (second.clone(), request());
            retries.spawn(async move { send(&second, request).await });
            tokio::time::sleep(ttl / 20).await;
        }
        while let Some(during) = retries.join_next().await {
            let during = during.expect("retry");
            assert!(
                during.status == StatusCode::CONFLICT
                    || during.status == StatusCode::SERVICE_UNAVAILABLE,
                "run {run}: a live holder was retaken around the lock's end, {:?} after its \
                 claim: {during:?}",
                started.elapsed()
            );
        }
        locker.await.expect("the lock was given back");
        // Just after it goes, and on until the handler is done.
        while !holder.is_finished() {
            let retry = send(&second, request()).await;
            assert!(
                retry.status == StatusCode::CONFLICT
                    || retry.status == StatusCode::SERVICE_UNAVAILABLE
                    || retry.replayed(),
                "run {run}: a live holder was retaken after the lock, {:?} after its claim: \
                 {retry:?}",
                started.elapsed()
            );
            tokio::time::sleep(ttl / 6).await;
        }
        let answer = holder.await.expect("holder");
        // Its own answer; or, when the store, just given back, was too busy to take its record
        // in time (its first attempt timed out), the `503` that says it ran and is not recorded
        // yet, never another run's answer.
        let unrecorded = answer.status == StatusCode::SERVICE_UNAVAILABLE
            && String::from_utf8_lossy(&answer.body).contains("could not be recorded yet");
        assert!(
            answer.status == StatusCode::CREATED || unrecorded,
            "run {run}: the first request gets its own answer: {answer:?}"
        );
        assert!(!answer.replayed(), "run {run}: {answer:?}");
        assert_eq!(runs(), before + 1, "run {run}: the handler ran once");
        let replay = super::app::until_not_in_progress(&second, request, 50).await;
        assert!(replay.replayed(), "run {run}: {replay:?}");
        if !unrecorded {
            assert_eq!(replay.body, answer.body, "run {run}");
        }
        assert_eq!(runs(), before + 1, "run {run}: the handler ran once");
    }
}
