//! Transactional completion on a real PostgreSQL: a handler's effects, written through
//! `IdempotencyTx`, commit together with the record of its answer, or not at all.
#![cfg(feature = "postgres")]

use crate::common;

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
use axum_idempotency::store::PostgresStore;
use axum_idempotency::{
    IdempotencyContext, IdempotencyLayer, IdempotencyTx, MemoryStore, Outcome, OutcomeCounters,
    Subject,
};
use http_body_util::BodyExt;
use sqlx::postgres::{PgPool, PgPoolOptions};
use tokio::sync::Semaphore;
use tower::ServiceExt;

fn database_url() -> String {
    common::servers::database_url()
}

/// The handler's world: where it writes its effects, how many times it ran, and a gate a test can
/// hold it at after it wrote its effect.
#[derive(Clone)]
struct World {
    schema: String,
    runs: Arc<AtomicUsize>,
    written: Arc<AtomicUsize>,
    gate: Arc<Semaphore>,
}

/// Writes one effect row through the layer's transaction, then answers as the headers say:
/// `x-hold` (wait at the gate after the write), `x-status`, `x-panic`, `x-defer-violation` (write a
/// row that breaks a deferred constraint, so the commit fails), `x-abort` (run a failing statement
/// afterwards, leaving the transaction aborted), `x-keep` (keep the transaction beyond the answer),
/// `x-before=ms` (wait that long before the first statement, as a provider call would) and
/// `x-between=ms` (wait that long after the effect, then write a second row).
async fn charge(
    State(world): State<World>,
    ctx: IdempotencyContext,
    mut tx: IdempotencyTx<sqlx::Postgres>,
    headers: HeaderMap,
) -> Response {
    let run = world.runs.fetch_add(1, Ordering::SeqCst);
    let effect = format!(
        "INSERT INTO {}.effects (k, note) VALUES ($1, $2)",
        world.schema
    );
    let duplicate = headers.contains_key("x-defer-violation");
    let note = if duplicate {
        "dup".to_owned()
    } else {
        format!("run {run}")
    };
    let millis = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok())
            .map(Duration::from_millis)
    };
    if let Some(before) = millis("x-before") {
        tokio::time::sleep(before).await;
    }
    for _ in 0..if duplicate { 2 } else { 1 } {
        sqlx::query(sqlx::AssertSqlSafe(effect.as_str()))
            .bind(ctx.derived_key())
            .bind(&note)
            .execute(tx.conn().await.expect("begin"))
            .await
            .expect("the effect is written");
    }
    if let Some(between) = millis("x-between") {
        tokio::time::sleep(between).await;
        sqlx::query(sqlx::AssertSqlSafe(effect.as_str()))
            .bind(ctx.derived_key())
            .bind(format!("run {run}, second"))
            .execute(tx.conn().await.expect("begun"))
            .await
            .expect("the second row is written");
    }
    world.written.fetch_add(1, Ordering::SeqCst);
    if headers.contains_key("x-hold") {
        world.gate.acquire().await.expect("gate").forget();
    }
    if headers.contains_key("x-panic") {
        panic!("the handler panicked after its effect");
    }
    if headers.contains_key("x-abort") {
        let failed = sqlx::query("SELECT 1 / 0")
            .execute(tx.conn().await.expect("begun"))
            .await;
        assert!(failed.is_err());
    }
    if headers.contains_key("x-keep") {
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(200)).await;
            drop(tx);
        });
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
    pool: PgPool,
    store: PostgresStore,
    world: World,
    outcomes: OutcomeCounters,
}

impl Setup {
    async fn new() -> Setup {
        let pool = PgPoolOptions::new()
            .max_connections(16)
            .connect(&database_url())
            .await
            .expect("PostgreSQL must be running (see .ci/run)");
        static N: AtomicUsize = AtomicUsize::new(0);
        let schema = format!(
            "idem_t_{}_{}_tx{}",
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .expect("clock")
                .as_secs(),
            std::process::id(),
            N.fetch_add(1, Ordering::SeqCst)
        );
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "CREATE SCHEMA {schema}; \
             CREATE TABLE {schema}.effects (k text NOT NULL, note text NOT NULL, \
               CONSTRAINT one_dup UNIQUE (k, note) DEFERRABLE INITIALLY DEFERRED)"
        )))
        .execute(&pool)
        .await
        .expect("schema");
        let store = PostgresStore::with_table(pool.clone(), &format!("{schema}.records"))
            .expect("table name");
        store.migrate().await.expect("migrate");
        Setup {
            pool,
            store,
            world: World {
                schema,
                runs: Arc::default(),
                written: Arc::default(),
                gate: Arc::new(Semaphore::new(0)),
            },
            outcomes: OutcomeCounters::new(),
        }
    }

    /// A router (an instance of the application) on the shared store.
    fn router(&self) -> Router {
        let layer = IdempotencyLayer::builder(self.store.clone())
            .in_progress_ttl(Duration::from_secs(30))
            .on_outcome(self.outcomes.hook())
            .transactions(true)
            .build()
            .expect("layer");
        self.router_on(layer)
    }

    /// The same instance behind a `CachedStore`.
    fn cached_router(&self) -> Router {
        let layer = IdempotencyLayer::builder(axum_idempotency::store::CachedStore::new(
            self.store.clone(),
        ))
        .in_progress_ttl(Duration::from_secs(30))
        .on_outcome(self.outcomes.hook())
        .transactions(true)
        .build()
        .expect("layer");
        self.router_on(layer)
    }

    /// An instance of the application behind `layer`.
    fn router_on<St: axum_idempotency::store::IdempotencyStore>(
        &self,
        layer: IdempotencyLayer<St>,
    ) -> Router {
        Router::new()
            .route("/charge", post(charge))
            .route_layer(layer)
            .layer(middleware::from_fn(auth))
            .with_state(self.world.clone())
    }

    async fn effects(&self) -> i64 {
        let (n,): (i64,) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT count(*) FROM {}.effects",
            self.world.schema
        )))
        .fetch_one(&self.pool)
        .await
        .expect("count effects");
        n
    }

    fn runs(&self) -> usize {
        self.world.runs.load(Ordering::SeqCst)
    }
}

struct Answer {
    status: StatusCode,
    headers: HeaderMap,
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
        headers: parts.headers,
        body: body.collect().await.expect("body").to_bytes(),
    }
}

fn replayed(answer: &Answer) -> bool {
    answer
        .headers
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn effect_and_record_commit_together() {
    let s = Setup::new().await;
    let router = s.router();
    let first = send(&router, "k", &[]).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(s.effects().await, 1);
    let replay = send(&router, "k", &[]).await;
    assert!(replayed(&replay));
    assert_eq!(replay.body, first.body);
    assert_eq!(s.runs(), 1);
    assert_eq!(s.effects().await, 1);
    assert_eq!(s.outcomes.get(Outcome::Recorded), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn client_sees_nothing_before_the_commit() {
    let s = Setup::new().await;
    let router = s.router();
    let first = tokio::spawn({
        let router = router.clone();
        async move { send(&router, "k", &["x-hold"]).await }
    });
    for _ in 0..500 {
        if s.world.written.load(Ordering::SeqCst) == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The effect is written but not committed: nobody else sees it, and duplicates get 409.
    assert_eq!(s.effects().await, 0);
    assert_eq!(send(&router, "k", &[]).await.status, StatusCode::CONFLICT);
    assert!(!first.is_finished());
    s.world.gate.add_permits(1);
    let first = first.await.expect("first");
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(s.effects().await, 1);
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
    assert!(!replayed(&retry));
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
    assert_eq!(replay.status, StatusCode::PAYMENT_REQUIRED);
    assert!(replayed(&replay));
    let rerun = send(&router, "r", &[]).await;
    assert_eq!(rerun.status, StatusCode::CREATED);
    assert!(!replayed(&rerun));
    assert_eq!(s.effects().await, 2);
    assert_eq!(s.runs(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn failed_commit_is_503_and_leaves_the_record_retryable() {
    let s = Setup::new().await;
    let router = s.router();
    let refused = send(&router, "k", &["x-defer-violation"]).await;
    assert_eq!(refused.status, StatusCode::SERVICE_UNAVAILABLE);
    let problem: serde_json::Value = serde_json::from_slice(&refused.body).expect("json");
    assert_eq!(problem["error"], "idempotency_store_unavailable");
    assert_eq!(s.effects().await, 0, "the effect did not happen");
    let retry = send(&router, "k", &[]).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(!replayed(&retry));
    assert_eq!(s.effects().await, 1);
}

/// A statement of the handler's transaction failed and the handler answered anyway: a success
/// cannot be recorded (its effect did not happen): 500 and released; a definitive failure is
/// recorded on its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn aborted_transaction_is_never_a_recorded_success() {
    let s = Setup::new().await;
    let router = s.router();
    let first = send(&router, "k", &["x-abort"]).await;
    assert_eq!(first.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(
        s.effects().await,
        0,
        "an aborted transaction commits nothing"
    );
    let retry = send(&router, "k", &[]).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(!replayed(&retry));
    assert_eq!(s.effects().await, 1);
    let declined = send(&router, "d", &["x-abort", "x-status=402"]).await;
    assert_eq!(declined.status, StatusCode::PAYMENT_REQUIRED);
    let replay = send(&router, "d", &[]).await;
    assert_eq!(replay.status, StatusCode::PAYMENT_REQUIRED);
    assert!(replayed(&replay));
    assert_eq!(s.effects().await, 1);
    assert_eq!(s.runs(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kept_transaction_is_500_and_rolled_back() {
    let s = Setup::new().await;
    let router = s.router();
    let kept = send(&router, "k", &["x-keep"]).await;
    assert_eq!(kept.status, StatusCode::INTERNAL_SERVER_ERROR);
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(s.effects().await, 0);
    let retry = send(&router, "k", &[]).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(s.effects().await, 1);
}

/// A worker whose record was retaken (it was presumed dead) and the retaker race to commit: only the
/// lease holder's completion matches, so exactly one effect commits and the late worker's client
/// gets 409.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn retaker_and_late_worker_commit_one_effect() {
    let s = Setup::new().await;
    let (late, retaker) = (s.router(), s.router());
    let first = tokio::spawn({
        let late = late.clone();
        async move { send(&late, "k", &["x-hold"]).await }
    });
    for _ in 0..500 {
        if s.world.written.load(Ordering::SeqCst) == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The late worker is cut off from the store past its TTL and past its presence (its session
    // lapsed): its record looks abandoned. (A live keeper's presence would keep it: the record is
    // aged, marked by a claim that found it silent an hour ago, and its lease put under no
    // presence, as the lapse leaves it.)
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE {} SET updated_at = now() - interval '1 hour', \
           suspected_at = now() - interval '1 hour', suspected_on = pg_postmaster_start_time(), \
           lease_token = lease_token & 4294967295",
        s.store.table()
    )))
    .execute(&s.pool)
    .await
    .expect("age the record");
    let second = send(&retaker, "k", &[]).await;
    assert_eq!(second.status, StatusCode::CREATED);
    assert!(!replayed(&second));
    s.world.gate.add_permits(1);
    let first = first.await.expect("late worker");
    assert_eq!(first.status, StatusCode::CONFLICT);
    assert_eq!(s.effects().await, 1, "one effect, the retaker's");
    assert_eq!(s.runs(), 2);
    assert_eq!(s.outcomes.get(Outcome::LeaseLost), 1);
    let replay = send(&late, "k", &[]).await;
    assert!(replayed(&replay));
    assert_eq!(replay.body, second.body);
}

/// On a layer whose store is not Postgres, a handler that takes the transaction does not run: 500.
#[tokio::test]
async fn transaction_on_another_store_is_500_and_runs_nothing() {
    let world = World {
        schema: "unused".into(),
        runs: Arc::default(),
        written: Arc::default(),
        gate: Arc::new(Semaphore::new(0)),
    };
    let router = Router::new()
        .route("/charge", post(charge))
        .route_layer(IdempotencyLayer::new(MemoryStore::new()).expect("valid settings"))
        .layer(middleware::from_fn(auth))
        .with_state(world.clone());
    let answer = send(&router, "k", &[]).await;
    assert_eq!(answer.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(world.runs.load(Ordering::SeqCst), 0);
}

/// The context: key, subject, endpoint, and a derived key that is stable across runs and retakes
/// and reveals nothing of the scope.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn derived_key_is_stable_and_opaque() {
    let s = Setup::new().await;
    let router = s.router();
    let first = send(&router, "order-1", &["x-status=503"]).await;
    assert_eq!(first.status, StatusCode::SERVICE_UNAVAILABLE);
    let second = send(&router, "order-1", &[]).await;
    assert_eq!(second.status, StatusCode::CREATED);
    assert_eq!(second.body, first.body, "the same derived key on every run");
    let derived = String::from_utf8(second.body.to_vec()).expect("utf-8");
    let derived = derived.trim_start_matches("charged ").to_owned();
    assert_eq!(derived.len(), 64);
    assert!(!derived.contains("order-1") && !derived.contains("alice"));
    let (keys,): (Vec<String>,) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT array_agg(DISTINCT k) FROM {}.effects",
        s.world.schema
    )))
    .fetch_one(&s.pool)
    .await
    .expect("keys");
    assert_eq!(keys, std::slice::from_ref(&derived));
    let other = send(&router, "order-2", &[]).await;
    assert!(!String::from_utf8_lossy(&other.body).contains(&derived));
}

/// Through a `CachedStore`, a duplicate arriving while the transactional request runs gets `409`
/// from the instance's hold on the key; once the transaction has committed the record, the next one
/// gets the replay at once, not `409` until the hold times out (the completion bypassed the wrapper's
/// own `complete`).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cached_store_lets_go_of_a_key_recorded_in_the_transaction() {
    let setup = Setup::new().await;
    let router = setup.cached_router();
    let first = tokio::spawn({
        let router = router.clone();
        async move { send(&router, "k", &["x-hold"]).await }
    });
    while setup.world.written.load(Ordering::SeqCst) == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(send(&router, "k", &[]).await.status, StatusCode::CONFLICT);
    setup.world.gate.add_permits(1);
    let first = first.await.expect("first");
    assert_eq!(first.status, StatusCode::CREATED);
    let again = send(&router, "k", &[]).await;
    assert_eq!(again.status, StatusCode::CREATED, "replayed, not held");
    assert_eq!(again.body, first.body);
    assert_eq!(setup.runs(), 1);
    assert_eq!(setup.effects().await, 1);
}

/// The commit fails, and whether it landed cannot be learned (the records' connection is cut at that
/// moment): the client is told to retry with its key, and the record, still in progress under the
/// lease with nothing committed, is released in the background once the database answers again, so
/// the retry runs within seconds instead of getting `409` until the in-progress TTL (30 s here).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn commit_of_unknown_outcome_does_not_leave_the_key_stuck() {
    use common::proxy::{Mode, Proxy};
    use sqlx::postgres::PgConnectOptions;
    use std::str::FromStr;

    let s = Setup::new().await;
    let options = PgConnectOptions::from_str(&database_url()).expect("DATABASE_URL");
    let upstream = tokio::net::lookup_host((options.get_host(), options.get_port()))
        .await
        .expect("resolve")
        .next()
        .expect("an address");
    let proxy = Proxy::start(upstream).await;
    let records = PgPoolOptions::new()
        .max_connections(8)
        .acquire_timeout(Duration::from_millis(500))
        .connect_with(options.host("127.0.0.1").port(proxy.port()))
        .await
        .expect("pool through the proxy");
    // Records through the proxy; the handler's transactions straight to the database.
    let store = PostgresStore::with_table(records, &format!("{}.records", s.world.schema))
        .expect("table name")
        .with_transaction_pool(s.pool.clone())
        .with_timeout(Duration::from_millis(500));
    let layer = IdempotencyLayer::builder(store)
        .in_progress_ttl(Duration::from_secs(30))
        .transactions(true)
        .build()
        .expect("layer");
    let router = s.router_on(layer);

    let first = tokio::spawn({
        let router = router.clone();
        async move { send(&router, "k", &["x-defer-violation", "x-hold"]).await }
    });
    while s.world.written.load(Ordering::SeqCst) == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // The records' database goes away just before the commit fails.
    proxy.set(Mode::Cut);
    s.world.gate.add_permits(1);
    let first = first.await.expect("first");
    assert_eq!(first.status, StatusCode::SERVICE_UNAVAILABLE);
    let problem: serde_json::Value = serde_json::from_slice(&first.body).expect("json");
    assert!(
        problem["detail"]
            .as_str()
            .is_some_and(|d| d.contains("not known")),
        "{problem}"
    );
    assert_eq!(s.effects().await, 0, "the commit failed");
    proxy.set(Mode::Pass);
    let started = std::time::Instant::now();
    let retry = loop {
        let retry = send(&router, "k", &[]).await;
        if retry.status != StatusCode::CONFLICT || started.elapsed() > Duration::from_secs(10) {
            break retry;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(
        retry.status,
        StatusCode::CREATED,
        "the retry runs within seconds, not after the TTL"
    );
    assert!(!replayed(&retry));
    assert_eq!(s.effects().await, 1, "charged once");
    assert_eq!(s.runs(), 2);
}

/// A completion written in the handler's transaction dates the record's expiry from the
/// statement, not from the transaction's start: a handler that held its transaction longer than
/// the retention still leaves a record that replays (with `now()`, it was born expired and the retry
/// ran the handler again).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_long_transaction_still_records_a_replayable_answer() {
    let s = Setup::new().await;
    let layer = IdempotencyLayer::builder(s.store.clone())
        .in_progress_ttl(Duration::from_secs(30))
        .retention(Duration::from_secs(1))
        .transactions(true)
        .build()
        .expect("layer");
    let router = s.router_on(layer);
    let first = tokio::spawn({
        let router = router.clone();
        async move { send(&router, "long", &["x-hold"]).await }
    });
    // The transaction began when the handler took it; it stays open past the retention.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    s.world.gate.add_permits(1);
    let first = first.await.expect("first");
    assert_eq!(first.status, StatusCode::CREATED);
    let retry = send(&router, "long", &[]).await;
    assert!(
        replayed(&retry),
        "the record outlives its transaction's start"
    );
    assert_eq!(s.runs(), 1);
}

/// A live transactional handler is never failed for being slow (SPEC 3): idle 3x the in-progress
/// TTL before its first statement (a provider call) and again between its statements, it
/// completes, commits both rows with its record, and replays; a duplicate meanwhile gets `409`,
/// never a retake. The transaction begins at its first use, and no idle timeout shorter than the
/// maximum hold ends it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_transactional_handler_idle_three_ttls_completes_and_replays() {
    let s = Setup::new().await;
    let ttl = Duration::from_secs(1);
    let store = s.store.clone().with_timeout(Duration::from_millis(400));
    let layer = IdempotencyLayer::builder(store)
        .in_progress_ttl(ttl)
        .transactions(true)
        .build()
        .expect("layer");
    let router = s.router_on(layer);
    let idle = format!("{}", (ttl * 3).as_millis());
    let slow = tokio::spawn({
        let router = router.clone();
        let (before, between) = (format!("x-before={idle}"), format!("x-between={idle}"));
        async move { send(&router, "slow", &[&before, &between]).await }
    });
    // While it idles before its first statement, and again between its statements.
    for wait in [ttl * 2, ttl * 3] {
        tokio::time::sleep(wait).await;
        let duplicate = send(&router, "slow", &[]).await;
        assert_eq!(duplicate.status, StatusCode::CONFLICT, "never retaken");
    }
    let slow = slow.await.expect("slow");
    assert_eq!(
        slow.status,
        StatusCode::CREATED,
        "{}",
        String::from_utf8_lossy(&slow.body)
    );
    assert_eq!(s.effects().await, 2, "both rows committed with the record");
    let retry = send(&router, "slow", &[]).await;
    assert!(replayed(&retry));
    assert_eq!(retry.body, slow.body);
    assert_eq!(s.runs(), 1);
}

/// With tombstones, an answer committed with its effects leaves one too (written once the commit
/// landed, before the answer is sent): past the record's retention the key is `410`, and the
/// handler, whose effect committed, does not run again. A rolled-back answer (released) leaves
/// none.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_committed_answer_leaves_a_tombstone() {
    let s = Setup::new().await;
    let layer = IdempotencyLayer::builder(s.store.clone())
        .in_progress_ttl(Duration::from_secs(30))
        .retention(Duration::from_millis(600))
        .tombstones(Duration::from_secs(30))
        .transactions(true)
        .build()
        .expect("layer");
    let router = s.router_on(layer);
    let first = send(&router, "t", &[]).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let tomb = axum_idempotency::tombstone_of(&axum_idempotency::store::RecordKey {
        key: "t".into(),
        subject: "alice".into(),
        endpoint: "POST /charge".into(),
    });
    use axum_idempotency::store::IdempotencyStore;
    assert!(
        s.store.lookup(&tomb).await.expect("lookup").is_some(),
        "the tombstone is written before the answer is sent"
    );
    let released = send(&router, "r", &["x-status=503"]).await;
    assert_eq!(released.status, StatusCode::SERVICE_UNAVAILABLE);
    tokio::time::sleep(Duration::from_millis(800)).await;
    let gone = send(&router, "t", &[]).await;
    assert_eq!(gone.status, StatusCode::GONE);
    let again = send(&router, "r", &[]).await;
    assert_eq!(
        again.status,
        StatusCode::CREATED,
        "a released key has no tombstone"
    );
    assert_eq!(s.runs(), 3);
    assert_eq!(
        s.effects().await,
        2,
        "the rolled-back effect is not there; two committed"
    );
}
