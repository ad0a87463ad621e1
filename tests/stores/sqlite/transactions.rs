//! Transactional completion on the SQLite store: a handler's effects, written through
//! `IdempotencyTx<sqlx::Sqlite>`, commit together with the record of its answer, or not at all.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum_idempotency::store::SqliteStore;
use axum_idempotency::{
    IdempotencyContext, IdempotencyLayer, IdempotencyTx, Outcome, OutcomeCounters, Subject,
};
use http_body_util::BodyExt;
use sqlx::SqlitePool;
use tokio::sync::Semaphore;
use tower::ServiceExt;

use super::{fresh_path, pool_on};

/// The handler's world: how many times it ran, how many effects it wrote, and gates a test can
/// hold it at.
#[derive(Clone)]
struct World {
    runs: Arc<AtomicUsize>,
    written: Arc<AtomicUsize>,
    /// Passed after the effect (`x-hold`).
    gate: Arc<Semaphore>,
    /// Passed before the transaction's first statement (`x-wait`).
    before: Arc<Semaphore>,
}

/// Writes one effect row through the layer's transaction, then answers as the headers say:
/// `x-wait` (wait at the first gate before the transaction begins), `x-hold` (wait at the gate
/// after the write), `x-status`, `x-panic`, `x-defer-violation` (an effect whose deferred foreign
/// key fails the commit), `x-rollback` (end the transaction with a statement of its own, as SQLite
/// does after a full disk).
async fn charge(
    State(world): State<World>,
    ctx: IdempotencyContext,
    mut tx: IdempotencyTx<sqlx::Sqlite>,
    headers: HeaderMap,
) -> Response {
    let run = world.runs.fetch_add(1, Ordering::SeqCst);
    if headers.contains_key("x-step-first") {
        // A step whose own work begins the transaction: recorded with it, as a step after it.
        let step = ctx.step("ledger", || async {
            let conn = tx.conn().await.map_err(|e| e.to_string())?;
            sqlx::query("INSERT INTO effects (k, note, parent) VALUES ('ledger', ?1, 1)")
                .bind(format!("run {run}"))
                .execute(&mut *conn)
                .await
                .map_err(|e| e.to_string())?;
            Ok::<_, String>(run)
        });
        step.await.expect("the step that begins the transaction");
    }
    if headers.contains_key("x-wait") {
        world.before.acquire().await.expect("gate").forget();
    }
    let parent: i64 = if headers.contains_key("x-defer-violation") {
        999
    } else {
        1
    };
    sqlx::query("INSERT INTO effects (k, note, parent) VALUES (?1, ?2, ?3)")
        .bind(ctx.derived_key())
        .bind(format!("run {run}"))
        .bind(parent)
        .execute(tx.conn().await.expect("begin"))
        .await
        .expect("the effect is written");
    world.written.fetch_add(1, Ordering::SeqCst);
    if headers.contains_key("x-step") {
        // A step in the transaction: its effect and its record commit with the answer.
        let conn = tx.conn().await.expect("begun");
        let step = ctx.step("ledger", || async move {
            sqlx::query("INSERT INTO effects (k, note, parent) VALUES ('ledger', ?1, 1)")
                .bind(format!("run {run}"))
                .execute(&mut *conn)
                .await
                .map_err(|e| e.to_string())?;
            Ok::<_, String>(run)
        });
        step.await.expect("the step in the transaction");
    }
    if headers.contains_key("x-hold") {
        world.gate.acquire().await.expect("gate").forget();
    }
    if headers.contains_key("x-panic") {
        panic!("the handler panicked after its effect");
    }
    if headers.contains_key("x-rollback") {
        sqlx::query("ROLLBACK")
            .execute(tx.conn().await.expect("begun"))
            .await
            .expect("rolled back");
    }
    let status = headers
        .get("x-status")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .and_then(|v| StatusCode::from_u16(v).ok())
        .unwrap_or(StatusCode::CREATED);
    (status, format!("charged {}", ctx.derived_key())).into_response()
}

async fn auth(mut request: Request, next: Next) -> Response {
    request.extensions_mut().insert(Subject("alice".into()));
    next.run(request).await
}

struct Setup {
    pool: SqlitePool,
    store: SqliteStore,
    world: World,
    outcomes: OutcomeCounters,
}

impl Setup {
    async fn new() -> Setup {
        let pool = pool_on(&fresh_path(), 8).await;
        sqlx::raw_sql(
            "CREATE TABLE parents (id INTEGER PRIMARY KEY); INSERT INTO parents VALUES (1); \
             CREATE TABLE effects (k TEXT NOT NULL, note TEXT NOT NULL, \
               parent INTEGER NOT NULL REFERENCES parents (id) DEFERRABLE INITIALLY DEFERRED)",
        )
        .execute(&pool)
        .await
        .expect("the effects' tables");
        let store = SqliteStore::new(pool.clone());
        store.migrate().await.expect("migrate");
        Setup {
            pool,
            store,
            world: World {
                runs: Arc::default(),
                written: Arc::default(),
                gate: Arc::new(Semaphore::new(0)),
                before: Arc::new(Semaphore::new(0)),
            },
            outcomes: OutcomeCounters::new(),
        }
    }

    /// An instance of the application on the shared store.
    fn router(&self) -> Router {
        let layer = IdempotencyLayer::builder(self.store.clone())
            .in_progress_ttl(Duration::from_secs(30))
            .on_outcome(self.outcomes.hook())
            .transactions(true)
            .build()
            .expect("layer");
        Router::new()
            .route("/charge", post(charge))
            .route_layer(layer)
            .layer(middleware::from_fn(auth))
            .with_state(self.world.clone())
    }

    async fn effects(&self) -> i64 {
        let (n,): (i64,) = sqlx::query_as("SELECT count(*) FROM effects")
            .fetch_one(&self.pool)
            .await
            .expect("count effects");
        n
    }

    fn runs(&self) -> usize {
        self.world.runs.load(Ordering::SeqCst)
    }

    async fn until_written(&self, n: usize) {
        for _ in 0..500 {
            if self.world.written.load(Ordering::SeqCst) >= n {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("the handler never wrote its effect");
    }
}

struct Answer {
    status: StatusCode,
    replayed: bool,
    body: bytes::Bytes,
}

/// Sends `POST /charge` with `key` and `headers`, each `name` (value 1) or `name=value`.
async fn send(router: &Router, key: &str, headers: &[&str]) -> Answer {
    let mut request = Request::builder()
        .method("POST")
        .uri("/charge")
        .header("idempotency-key", key);
    for header in headers {
        let (name, value) = header.split_once('=').unwrap_or((header, "1"));
        request = request.header(name, value);
    }
    let response = router
        .clone()
        .oneshot(request.body(Body::empty()).expect("request"))
        .await
        .expect("infallible");
    let (parts, body) = response.into_parts();
    Answer {
        status: parts.status,
        replayed: parts
            .headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true"),
        body: body.collect().await.expect("body").to_bytes(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn effect_and_record_commit_together() {
    let s = Setup::new().await;
    let router = s.router();
    let first = send(&router, "k", &[]).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(s.effects().await, 1);
    let replay = send(&router, "k", &[]).await;
    assert!(replay.replayed);
    assert_eq!(replay.body, first.body);
    assert_eq!(s.runs(), 1);
    assert_eq!(s.effects().await, 1);
    assert_eq!(s.outcomes.get(Outcome::Recorded), 1);
}

/// A step the handler takes in its transaction is rolled back with it when the answer is
/// released (the retry runs it again, and its effect happens once), and committed with the
/// record when the answer is recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_step_in_the_handlers_transaction_commits_with_it() {
    let s = Setup::new().await;
    let router = s.router();
    let released = send(&router, "k", &["x-step", "x-status=503"]).await;
    assert_eq!(released.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        s.effects().await,
        0,
        "the step's effect rolled back with the rest"
    );
    let scope = axum_idempotency::store::RecordKey {
        key: "k".into(),
        subject: "alice".into(),
        endpoint: "POST /charge".into(),
    };
    use axum_idempotency::store::IdempotencyStore;
    let none = s.store.recorded_steps(&scope).await.expect("steps");
    assert!(none.is_empty(), "released: no step is left: {none:?}");
    let done = send(&router, "k", &["x-step"]).await;
    assert_eq!(done.status, StatusCode::CREATED);
    assert_eq!(s.runs(), 2, "the retry ran the handler and its step again");
    // The handler's effect and the step's, once each.
    assert_eq!(s.effects().await, 2);
    let steps = s.store.recorded_steps(&scope).await.expect("steps");
    assert_eq!(steps.len(), 1, "{steps:?}");
    assert_eq!(
        (steps[0].name.as_str(), steps[0].result.as_slice()),
        ("ledger", &b"1"[..])
    );
    let replay = send(&router, "k", &["x-step"]).await;
    assert!(replay.replayed);
    assert_eq!(s.runs(), 2);
}

/// A step whose own work begins the handler's transaction is recorded in it too: rolled back with
/// the effect it wrote when the answer is released (were it written apart, it would stay
/// recorded, and the retry would skip the effect it stands for).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_step_that_begins_the_transaction_commits_with_it() {
    let s = Setup::new().await;
    let router = s.router();
    let released = send(&router, "k", &["x-step-first", "x-status=503"]).await;
    assert_eq!(released.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        s.effects().await,
        0,
        "the step's effect rolled back with the rest"
    );
    let done = send(&router, "k", &["x-step-first"]).await;
    assert_eq!(done.status, StatusCode::CREATED);
    // The retry ran the step again: its effect and the handler's, once each.
    assert_eq!(s.effects().await, 2);
    let scope = axum_idempotency::store::RecordKey {
        key: "k".into(),
        subject: "alice".into(),
        endpoint: "POST /charge".into(),
    };
    use axum_idempotency::store::IdempotencyStore;
    let steps = s.store.recorded_steps(&scope).await.expect("steps");
    assert_eq!(steps.len(), 1, "{steps:?}");
    assert_eq!(
        (steps[0].name.as_str(), steps[0].result.as_slice()),
        ("ledger", &b"1"[..])
    );
}

/// While the handler holds its transaction (and with it the file's write lock), nobody sees its
/// effect, and a duplicate at another instance still gets 409 at once: the claim reads without
/// the lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn client_sees_nothing_before_the_commit_and_duplicates_get_409() {
    let s = Setup::new().await;
    let (router, other) = (s.router(), s.router());
    let first = tokio::spawn({
        let router = router.clone();
        async move { send(&router, "k", &["x-hold"]).await }
    });
    s.until_written(1).await;
    assert_eq!(s.effects().await, 0);
    let duplicate = tokio::time::timeout(Duration::from_secs(2), send(&other, "k", &[]))
        .await
        .expect("answered without waiting for the lock");
    assert_eq!(duplicate.status, StatusCode::CONFLICT);
    assert!(!first.is_finished());
    s.world.gate.add_permits(1);
    let first = first.await.expect("first");
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(s.effects().await, 1);
    assert!(send(&other, "k", &[]).await.replayed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn panic_rolls_the_effect_back_and_the_retry_runs_once() {
    let s = Setup::new().await;
    let router = s.router();
    let panicked = send(&router, "k", &["x-panic"]).await;
    assert_eq!(panicked.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(s.effects().await, 0, "the effect was rolled back");
    let retry = send(&router, "k", &[]).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(!retry.replayed);
    assert_eq!(s.effects().await, 1);
    assert_eq!(s.runs(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn released_status_rolls_back_and_failed_status_commits() {
    let s = Setup::new().await;
    let router = s.router();
    let released = send(&router, "r", &["x-status=503"]).await;
    assert_eq!(released.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(s.effects().await, 0, "a released answer commits nothing");
    let failed = send(&router, "f", &["x-status=402"]).await;
    assert_eq!(failed.status, StatusCode::PAYMENT_REQUIRED);
    assert_eq!(s.effects().await, 1, "a recorded failure commits");
    let replay = send(&router, "f", &["x-status=402"]).await;
    assert!(replay.replayed);
    let rerun = send(&router, "r", &[]).await;
    assert_eq!(rerun.status, StatusCode::CREATED);
    assert!(!rerun.replayed);
    assert_eq!(s.effects().await, 2);
    assert_eq!(s.runs(), 3);
}

/// The commit fails (a deferred foreign key): 503, nothing committed, the record released.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn failed_commit_is_503_and_leaves_the_record_retryable() {
    let s = Setup::new().await;
    let router = s.router();
    let refused = send(&router, "k", &["x-defer-violation"]).await;
    assert_eq!(refused.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(s.effects().await, 0, "the effect did not happen");
    let retry = send(&router, "k", &[]).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(!retry.replayed);
    assert_eq!(s.effects().await, 1);
    // The pool still begins transactions on every connection.
    for i in 0..10 {
        let again = send(&router, &format!("after-{i}"), &[]).await;
        assert_eq!(again.status, StatusCode::CREATED);
    }
}

/// A transaction SQLite ended before the completion (here the handler's own `ROLLBACK`, as SQLite
/// does after a full disk): the completion is never written outside it. A success cannot be
/// recorded (its effect is gone): 500, released, and the retry runs; a definitive failure is
/// recorded on its own. The pool's connections begin transactions again afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_transaction_sqlite_ended_is_never_a_recorded_success() {
    let s = Setup::new().await;
    let router = s.router();
    let ended = send(&router, "k", &["x-rollback"]).await;
    assert_eq!(ended.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(s.effects().await, 0);
    let retry = send(&router, "k", &[]).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(!retry.replayed);
    assert_eq!(s.effects().await, 1);
    let declined = send(&router, "d", &["x-rollback", "x-status=402"]).await;
    assert_eq!(declined.status, StatusCode::PAYMENT_REQUIRED);
    let replay = send(&router, "d", &[]).await;
    assert_eq!(replay.status, StatusCode::PAYMENT_REQUIRED);
    assert!(replay.replayed);
    assert_eq!(s.effects().await, 1);
    for i in 0..10 {
        let again = send(&router, &format!("after-{i}"), &[]).await;
        assert_eq!(again.status, StatusCode::CREATED, "{i}");
    }
    assert_eq!(s.effects().await, 11);
}

/// A worker presumed dead (its record aged past the TTL) before its transaction began, and the
/// retaker that took its record: the retaker commits its effect; the late worker's completion
/// finds the lease lost and its effect rolls back: one effect, and its client gets 409.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lost_lease_rolls_the_late_workers_effect_back() {
    let s = Setup::new().await;
    let (late, retaker) = (s.router(), s.router());
    let first = tokio::spawn({
        let late = late.clone();
        async move { send(&late, "k", &["x-wait"]).await }
    });
    while s.runs() == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // The late worker is cut off past its TTL and its presence (a process frozen: SQLite's
    // presences go with the process): the record is aged on both clocks and its lease put under
    // no presence.
    sqlx::query(
        "UPDATE idempotency_records SET updated_us = updated_us - 3600000000, \
           renewed_boot_us = renewed_boot_us - 3600000000, \
           renewed_paired_us = updated_us - 3600000000, \
           lease_token = lease_token & 4294967295",
    )
    .execute(&s.pool)
    .await
    .expect("age the record");
    let second = send(&retaker, "k", &[]).await;
    assert_eq!(second.status, StatusCode::CREATED);
    assert!(!second.replayed);
    s.world.before.add_permits(1);
    let first = first.await.expect("late worker");
    assert_eq!(first.status, StatusCode::CONFLICT);
    assert_eq!(s.effects().await, 1, "one effect, the retaker's");
    assert_eq!(s.runs(), 2);
    assert_eq!(s.outcomes.get(Outcome::LeaseLost), 1);
    let replay = send(&late, "k", &[]).await;
    assert!(replay.replayed);
    assert_eq!(replay.body, second.body);
}

/// Many transactional requests at once, with duplicates: their transactions take the write lock
/// in turn, and every key commits exactly one effect.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_transactions_commit_one_effect_per_key() {
    let s = Setup::new().await;
    let router = s.router();
    let mut clients = tokio::task::JoinSet::new();
    for i in 0..24 {
        let router = router.clone();
        clients.spawn(async move {
            let key = format!("k-{}", i % 8);
            for _ in 0..200 {
                let answer = send(&router, &key, &[]).await;
                if answer.status == StatusCode::CREATED {
                    return (key, answer.body);
                }
                assert!(
                    [StatusCode::CONFLICT, StatusCode::SERVICE_UNAVAILABLE]
                        .contains(&answer.status),
                    "{}",
                    answer.status
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            panic!("{key} never answered");
        });
    }
    let mut bodies = std::collections::HashMap::new();
    while let Some(done) = clients.join_next().await {
        let (key, body) = done.expect("client");
        let first = bodies.entry(key.clone()).or_insert_with(|| body.clone());
        assert_eq!(*first, body, "{key}: one answer");
    }
    assert_eq!(bodies.len(), 8);
    assert_eq!(s.effects().await, 8, "one effect per key");
    let (keys,): (i64,) = sqlx::query_as("SELECT count(DISTINCT k) FROM effects")
        .fetch_one(&s.pool)
        .await
        .expect("keys");
    assert_eq!(keys, 8);
}

/// A handler that takes the transaction of another database than its route's store (the mistake a
/// bare `IdempotencyTx` used to compile to: PostgreSQL's, on a SQLite route) does not run, and the
/// answer says which mistake it is; the key is released, and the right extractor then runs once.
#[cfg(feature = "postgres")]
#[tokio::test]
async fn a_transaction_of_another_database_is_named_as_such() {
    async fn wrong(_tx: IdempotencyTx<sqlx::Postgres>) -> StatusCode {
        panic!("a handler must not run without the transaction it asked for");
    }
    let s = Setup::new().await;
    let layer = IdempotencyLayer::builder(s.store.clone())
        .transactions(true)
        .build()
        .expect("layer");
    let router = Router::new()
        .route("/charge", post(wrong))
        .route_layer(layer)
        .layer(middleware::from_fn(auth));
    let answer = send(&router, "k", &[]).await;
    assert_eq!(answer.status, StatusCode::INTERNAL_SERVER_ERROR);
    let body = String::from_utf8_lossy(&answer.body);
    assert!(body.contains("another database"), "{body}");
    // Released, not recorded: the route with the right extractor runs it.
    let first = send(&s.router(), "k", &[]).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(!first.replayed);
    assert_eq!(s.runs(), 1);
}
