//! The SQLite store under faults: another process holding the file's write lock (busy writers), a
//! full database, the file reopened as by a restarted process, and operations dropped while they
//! wait on a lock. In every case the handler runs at most once per key and the client gets a clear
//! answer (replay, 409 or 503).

use std::collections::HashMap;
use std::time::Duration;

use axum::http::StatusCode;
use axum_idempotency::IdempotencyLayer;
use axum_idempotency::store::{
    ClaimOutcome, IdempotencyStore, RecordState, SqliteStore, TransactionalStore,
};
use sqlx::sqlite::SqlitePoolOptions;

use super::{claim_request, created, fresh_path, pool_on};
use crate::common::{self, Answer, app, post, send};

/// Another process (a second pool on the file) holds SQLite's write lock while requests arrive:
/// a duplicate of a request in progress still gets 409 at once and a finished request its replay
/// (neither needs to write); fresh keys wait for the lock within the store's timeout and get 503,
/// and their handlers do not run. Then the lock is held again only briefly while as many requests
/// arrive: some wait and get through, some get 503. Clients retrying until they get an answer
/// leave every key run exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn busy_writers_answer_errors_or_wait_and_never_run_twice() {
    let path = fresh_path();
    let store = SqliteStore::new(pool_on(&path, 8).await).with_timeout(Duration::from_millis(400));
    store.migrate().await.expect("migrate");
    let layer = IdempotencyLayer::builder(store.clone())
        .in_progress_ttl(Duration::from_secs(30))
        .build()
        .expect("layer");
    let (router, counters) = app(layer);
    // Another instance on the same store, for duplicates that reach the store.
    let (instance, others) = app(IdempotencyLayer::new(store).expect("layer"));
    let req = |key: &str| post("/pay").key(key).user("alice").json("{}");
    assert_eq!(send(&router, req("done")).await.status, StatusCode::CREATED);
    let held = tokio::spawn({
        let router = router.clone();
        async move { send(&router, req("held").header("x-delay-ms", "1500")).await }
    });
    let c = counters.clone();
    common::eventually(move || c.started() == 2).await;

    let other = pool_on(&path, 1).await;
    let mut lock = other
        .begin_with("BEGIN IMMEDIATE")
        .await
        .expect("the write lock");
    let duplicate = send(&instance, req("held")).await;
    assert_eq!(duplicate.status, StatusCode::CONFLICT, "{duplicate:?}");
    assert!(send(&instance, req("done")).await.replayed());
    let mut fresh = tokio::task::JoinSet::new();
    for i in 0..3 {
        let router = router.clone();
        fresh.spawn(async move { send(&router, req(&format!("fresh-{i}"))).await });
    }
    while let Some(answer) = fresh.join_next().await {
        let answer = answer.expect("client");
        assert_eq!(
            answer.status,
            StatusCode::SERVICE_UNAVAILABLE,
            "no write while another process holds the lock: {answer:?}"
        );
        assert_eq!(answer.problem(), "idempotency_store_unavailable");
    }
    assert_eq!(counters.started(), 2, "no handler ran without its claim");
    assert_eq!(others.started(), 0);
    sqlx::query("CREATE TABLE IF NOT EXISTS other_writes (n INTEGER)")
        .execute(&mut *lock)
        .await
        .expect("the other process writes");
    lock.rollback().await.expect("release the lock");

    // The lock held briefly, again and again, while requests arrive.
    let hammer = tokio::spawn({
        let other = other.clone();
        async move {
            for _ in 0..10 {
                let lock = other.begin_with("BEGIN IMMEDIATE").await.expect("lock");
                tokio::time::sleep(Duration::from_millis(60)).await;
                lock.rollback().await.expect("release");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    });
    let mut clients = tokio::task::JoinSet::new();
    for i in 0..16 {
        let router = router.clone();
        clients.spawn(async move {
            let key = format!("k-{}", i % 8);
            (key.clone(), until_answered(&router, || req(&key)).await)
        });
    }
    let mut bodies: HashMap<String, Vec<Answer>> = HashMap::new();
    while let Some(done) = clients.join_next().await {
        let (key, answer) = done.expect("client");
        bodies.entry(key).or_default().push(answer);
    }
    hammer.await.expect("the other process");
    for i in 0..3 {
        let answer = until_answered(&router, || req(&format!("fresh-{i}"))).await;
        bodies.entry(format!("fresh-{i}")).or_default().push(answer);
    }
    assert_eq!(held.await.expect("held").status, StatusCode::CREATED);
    for (key, answers) in &bodies {
        assert!(
            answers.iter().all(|a| a.body == answers[0].body),
            "{key}: one run, one answer: {answers:?}"
        );
    }
    assert_eq!(bodies.len(), 11);
    assert_eq!(
        counters.started(),
        2 + 11,
        "every key ran exactly once: done, held, 8 keys and 3 fresh ones"
    );
}

/// Sends `request()` until the answer is neither 409 nor 503 (the client's retries).
async fn until_answered(router: &axum::Router, request: impl Fn() -> common::Req) -> Answer {
    for _ in 0..200 {
        let answer = send(router, request()).await;
        if answer.status != StatusCode::CONFLICT && answer.status != StatusCode::SERVICE_UNAVAILABLE
        {
            assert_eq!(answer.status, StatusCode::CREATED, "{answer:?}");
            return answer;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("no answer after 200 tries");
}

/// A database with no room left (`max_page_count` reached, as a full disk would) refuses new
/// claims as full (`503 idempotency_store_full`, never a run unguarded, even with `fail_open`),
/// while finished records still replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_full_database_refuses_claims_as_full() {
    let path = fresh_path();
    let options =
        SqliteStore::connect_options(sqlx::sqlite::SqliteConnectOptions::new().filename(&path))
            .pragma("max_page_count", "40");
    let pool = SqlitePoolOptions::new()
        .max_connections(4)
        .connect_with(options)
        .await
        .expect("open");
    let store = SqliteStore::new(pool).with_timeout(Duration::from_secs(2));
    store.migrate().await.expect("migrate");
    let layer = IdempotencyLayer::builder(store.clone())
        .fail_open(true)
        .build()
        .expect("layer");
    let (router, counters) = app(layer);
    let first = send(&router, post("/pay").key("first").user("alice").json("{}")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    // Fill the file with claims of long subjects until it refuses one, then with short ones.
    let mut full = None;
    for (round, length) in [(0, 2000), (1, 0)] {
        for i in 0..10_000 {
            let mut claim = claim_request(&format!("fill-{round}-{i}"), b"{}");
            claim.key.subject = format!("{i}-{}", "s".repeat(length));
            if let Err(e) = store.claim(&claim).await {
                full = Some(e);
                break;
            }
        }
    }
    let full = full.expect("the file fills up");
    assert!(full.is_store_full(), "{full:?}");
    let refused = send(&router, post("/pay").key("new").user("alice").json("{}")).await;
    assert_eq!(
        refused.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{refused:?}"
    );
    assert_eq!(refused.problem(), "idempotency_store_full");
    assert_eq!(counters.started(), 1, "nothing ran unguarded");
    let replay = send(&router, post("/pay").key("first").user("alice").json("{}")).await;
    assert!(replay.replayed(), "{replay:?}");
}

/// A restarted process reopens the file: finished records replay, a claim in progress is still
/// held (and its holder's lease still fences it), inspection shows both.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn records_survive_the_file_being_reopened() {
    let path = fresh_path();
    let before = SqliteStore::open(&path).await.expect("open");
    before.migrate().await.expect("migrate");
    let done = claim_request("done", b"{}");
    let ClaimOutcome::Claimed { lease, .. } = before.claim(&done).await.expect("claim") else {
        panic!("claimed");
    };
    let completed = before
        .complete(
            &done.key,
            lease,
            &done.fingerprint,
            created(b"charged"),
            Duration::from_secs(3600),
        )
        .await
        .expect("complete");
    assert!(completed.is_done());
    let running = claim_request("running", b"{}");
    assert!(matches!(
        before.claim(&running).await.expect("claim"),
        ClaimOutcome::Claimed { .. }
    ));
    before.pool().close().await;
    drop(before);

    let after = SqliteStore::open(&path).await.expect("reopen");
    after.migrate().await.expect("migrate again");
    let mut again = claim_request("done", b"{}");
    again.key = done.key.clone();
    let ClaimOutcome::Finished(stored) = after.claim(&again).await.expect("claim") else {
        panic!("the replay survives");
    };
    assert_eq!(&stored.body[..], b"charged");
    let mut duplicate = claim_request("running", b"{}");
    duplicate.key = running.key.clone();
    assert_eq!(
        after.claim(&duplicate).await.expect("claim"),
        ClaimOutcome::InProgress
    );
    assert!(
        after
            .renew(&running.key, running.lease, Duration::from_secs(60))
            .await
            .expect("renew")
            .is_done(),
        "the holder's lease still holds"
    );
    let info = after
        .lookup(&done.key)
        .await
        .expect("lookup")
        .expect("found");
    assert!(info.state.is_finished());
    let info = after
        .lookup(&running.key)
        .await
        .expect("lookup")
        .expect("found");
    assert_eq!(info.state, RecordState::InProgress);
}

/// An operation dropped while it waits on another process's lock (as a heartbeat's bound on its
/// renewal drops it) gives its place in the pool back at once, not when SQLite's busy timeout
/// (4 s) ends the statement.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_operation_dropped_mid_statement_frees_its_place_in_the_pool_at_once() {
    let path = fresh_path();
    let one = pool_on(&path, 1).await;
    let store = SqliteStore::new(one.clone()).with_timeout(Duration::from_secs(10));
    store.migrate().await.expect("migrate");
    let claim = claim_request("dropped", b"{}");
    assert!(matches!(
        store.claim(&claim).await.expect("claim"),
        ClaimOutcome::Claimed { .. }
    ));
    let other = pool_on(&path, 1).await;
    let lock = other.begin_with("BEGIN IMMEDIATE").await.expect("lock");
    let renewal = store.renew(&claim.key, claim.lease, Duration::from_secs(60));
    let cut = tokio::time::timeout(Duration::from_millis(300), renewal).await;
    assert!(cut.is_err(), "the renewal waited on the lock: {cut:?}");
    let again = tokio::time::timeout(Duration::from_secs(2), one.acquire()).await;
    assert!(
        matches!(again, Ok(Ok(_))),
        "a connection is to be had at once: {again:?}"
    );
    lock.rollback().await.expect("release");
}

/// A handler's transaction that cannot begin while another process holds the lock is an error
/// within the store's timeout, and leaves the pool able to begin once the lock is free.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_transaction_that_cannot_begin_is_an_error_within_the_timeout() {
    let path = fresh_path();
    let store = SqliteStore::new(pool_on(&path, 2).await).with_timeout(Duration::from_millis(300));
    store.migrate().await.expect("migrate");
    let other = pool_on(&path, 1).await;
    let lock = other.begin_with("BEGIN IMMEDIATE").await.expect("lock");
    let refused =
        tokio::time::timeout(Duration::from_secs(3), store.begin(Duration::from_secs(60)))
            .await
            .expect("answered within the timeout");
    assert!(refused.is_err());
    lock.rollback().await.expect("release");
    let tx = store.begin(Duration::from_secs(60)).await.expect("begin");
    store.rollback(tx).await.expect("rollback");
}
