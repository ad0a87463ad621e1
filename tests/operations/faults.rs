//! Fault injection on the Postgres store: a TCP proxy between the store and PostgreSQL cuts or
//! stalls the database connection before the claim, between claim and complete, and during complete.
//! In every case the handler runs at most once per key, nothing stays stuck, and the client gets a
//! clear answer (replay, 409 or 503).
#![cfg(feature = "postgres")]

use crate::common;

use std::net::SocketAddr;
use std::str::FromStr;
use std::time::Duration;

use axum::http::StatusCode;
use axum_idempotency::store::PostgresStore;
use axum_idempotency::{IdempotencyLayer, Outcome, OutcomeCounters};
use common::proxy::{Mode, Proxy};
use common::{Answer, Counters, app, eventually, post, send};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

fn database_url() -> String {
    common::servers::database_url()
}

struct Setup {
    proxy: Proxy,
    router: axum::Router,
    counters: Counters,
    outcomes: OutcomeCounters,
}

/// A store in a schema of its own, reached through a proxy; short timeouts so faults show quickly.
async fn setup() -> Setup {
    setup_with(Duration::from_secs(30), 4).await
}

async fn setup_with(in_progress_ttl: Duration, connections: u32) -> Setup {
    let (options, upstream, schema) = upstream_and_schema("faults").await;
    let proxy = Proxy::start(upstream).await;
    let through_proxy = options
        .host("127.0.0.1")
        .port(proxy.port())
        .options([("search_path", schema.as_str())]);
    let pool = PgPoolOptions::new()
        .max_connections(connections)
        .acquire_timeout(Duration::from_millis(800))
        .connect_with(through_proxy)
        .await
        .expect("pool through the proxy");
    let store = PostgresStore::new(pool).with_timeout(Duration::from_millis(800));
    store.migrate().await.expect("migrate");
    let outcomes = OutcomeCounters::new();
    let layer = IdempotencyLayer::builder(store)
        .in_progress_ttl(in_progress_ttl)
        .on_outcome(outcomes.hook())
        .build()
        .expect("layer");
    let (router, counters) = app(layer);
    Setup {
        proxy,
        router,
        counters,
        outcomes,
    }
}

/// The database's connect options and address, and a schema no other test uses (named as the
/// other tests name theirs, so stale ones are dropped by them).
async fn upstream_and_schema(tag: &str) -> (PgConnectOptions, SocketAddr, String) {
    let options = PgConnectOptions::from_str(&database_url()).expect("url");
    let upstream: SocketAddr = tokio::net::lookup_host((options.get_host(), options.get_port()))
        .await
        .expect("resolve")
        .next()
        .expect("an address");
    let admin = sqlx::PgPool::connect(&database_url())
        .await
        .expect("PostgreSQL");
    let schema = format!(
        "idem_t_{}_{}_{tag}{}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_secs(),
        std::process::id(),
        next()
    );
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
        .execute(&admin)
        .await
        .expect("schema");
    (options, upstream, schema)
}

fn next() -> usize {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static N: AtomicUsize = AtomicUsize::new(0);
    N.fetch_add(1, Ordering::SeqCst)
}

/// Retries like a client would until the answer is neither 409 nor 503, for at most ten seconds.
async fn settle(router: &axum::Router, req: impl Fn() -> common::Req) -> Answer {
    for _ in 0..100 {
        let answer = send(router, req()).await;
        if answer.status != StatusCode::CONFLICT && answer.status != StatusCode::SERVICE_UNAVAILABLE
        {
            return answer;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("still 409 or 503 after ten seconds");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cut_before_the_claim_is_503_and_runs_nothing() {
    let s = setup().await;
    let req = || post("/pay").key("k").user("alice").json("{\"amount\":1}");
    s.proxy.set(Mode::Cut);
    let refused = send(&s.router, req()).await;
    assert_eq!(refused.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(refused.problem(), "idempotency_store_unavailable");
    assert_eq!(s.counters.started(), 0);
    s.proxy.set(Mode::Pass);
    let charged = settle(&s.router, req).await;
    assert_eq!(charged.status, StatusCode::CREATED);
    let replay = send(&s.router, req()).await;
    assert!(replay.replayed());
    assert_eq!(s.counters.started(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cut_between_claim_and_complete_records_later_and_runs_once() {
    let s = setup().await;
    let req = || {
        post("/pay")
            .key("k")
            .user("alice")
            .header("x-delay-ms", "400")
    };
    let first = tokio::spawn({
        let router = s.router.clone();
        async move { send(&router, req()).await }
    });
    let c = s.counters.clone();
    eventually(move || c.started() == 1).await;
    s.proxy.set(Mode::Cut); // the database goes away while the handler runs
    let answer = first.await.expect("first");
    // The handler ran, its answer is not recorded yet: the client is told so, not given it.
    crate::not_recorded_yet(&answer);
    assert_eq!(s.outcomes.get(Outcome::RecordDeferred), 1);
    let during = send(&s.router, req()).await;
    assert!(
        during.status == StatusCode::SERVICE_UNAVAILABLE || during.status == StatusCode::CONFLICT,
        "{during:?}"
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    s.proxy.set(Mode::Pass);
    // The background retry records the answer: the retry is a replay, not a second charge.
    let o = s.outcomes.clone();
    eventually(move || o.get(Outcome::Recorded) == 1).await;
    let replay = settle(&s.router, req).await;
    assert_eq!(replay.status, StatusCode::CREATED);
    assert!(replay.replayed());
    assert_eq!(s.counters.started(), 1, "the handler ran once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stall_during_complete_times_out_then_records() {
    let s = setup().await;
    let req = || {
        post("/pay")
            .key("k")
            .user("alice")
            .header("x-delay-ms", "300")
    };
    let first = tokio::spawn({
        let router = s.router.clone();
        async move { send(&router, req()).await }
    });
    let c = s.counters.clone();
    eventually(move || c.started() == 1).await;
    s.proxy.set(Mode::Stall); // the complete statement will hang
    let answer = tokio::time::timeout(Duration::from_secs(10), first)
        .await
        .expect("the client is answered despite the stall")
        .expect("first");
    crate::not_recorded_yet(&answer);
    assert_eq!(s.outcomes.get(Outcome::RecordDeferred), 1);
    // A duplicate during the stall is answered too (503 after the store timeout, or 409).
    let during = tokio::time::timeout(Duration::from_secs(10), send(&s.router, req()))
        .await
        .expect("answered during the stall");
    assert!(
        during.status == StatusCode::SERVICE_UNAVAILABLE || during.status == StatusCode::CONFLICT,
        "{during:?}"
    );
    s.proxy.set(Mode::Pass);
    let o = s.outcomes.clone();
    eventually(move || o.get(Outcome::Recorded) == 1).await;
    let replay = settle(&s.router, req).await;
    assert!(replay.replayed());
    assert_eq!(s.counters.started(), 1, "the handler ran once");
    // The completion that timed out may have committed before its retry: that retry is a success,
    // not a lost lease.
    assert_eq!(s.outcomes.get(Outcome::LeaseLost), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stall_before_the_claim_is_503_within_the_timeout() {
    // One connection, warmed: the claim statement is prepared on it, so the stalled claim is sent
    // (not stuck in a handshake) and may commit once the network moves again.
    let s = setup_with(Duration::from_secs(30), 1).await;
    let req = || post("/pay").key("k").user("alice");
    let warm = send(&s.router, post("/pay").key("warm").user("alice")).await;
    assert_eq!(warm.status, StatusCode::CREATED);
    s.proxy.set(Mode::Stall);
    let refused = tokio::time::timeout(Duration::from_secs(10), send(&s.router, req()))
        .await
        .expect("answered, not held");
    assert_eq!(refused.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(s.counters.started(), 1, "only the warm-up ran");
    s.proxy.set(Mode::Pass);
    // If the stalled claim committed once the network moved again, nobody holds it: the layer
    // releases it by its lease token, so either way the retry charges within seconds, not after
    // the 30 s in-progress TTL (`claim_whose_answer_was_lost_is_released` in the suite shows the
    // release on every store). The pause lets a stalled claim land first.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let charged = settle(&s.router, req).await;
    assert_eq!(charged.status, StatusCode::CREATED);
    assert!(!charged.replayed());
    assert_eq!(s.counters.started(), 2);
    let replay = send(&s.router, req()).await;
    assert!(replay.replayed());
    assert_eq!(s.counters.started(), 2);
}

/// An outage that starts just before the handler answers and ends after the claim's original
/// in-progress TTL: the heartbeat renewed the claim before the outage, and the recording is retried
/// until it lands, so a retry right after the outage is answered 409 or the replay, never a second
/// run.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn outage_spanning_the_original_ttl_still_records_once() {
    let ttl = Duration::from_secs(3);
    let s = setup_with(ttl, 4).await;
    let req = || {
        post("/pay")
            .key("k")
            .user("alice")
            .header("x-delay-ms", "1500")
    };
    let started = tokio::time::Instant::now();
    let first = tokio::spawn({
        let router = s.router.clone();
        async move { send(&router, req()).await }
    });
    let c = s.counters.clone();
    eventually(move || c.started() == 1).await;
    // The heartbeat at 1 s renews the claim; the database goes away at 1.3 s.
    tokio::time::sleep_until(started + Duration::from_millis(1300)).await;
    s.proxy.set(Mode::Cut);
    let answer = first.await.expect("first");
    crate::not_recorded_yet(&answer);
    assert_eq!(s.outcomes.get(Outcome::RecordDeferred), 1);
    // Back after the original TTL (3 s from the claim) has passed.
    tokio::time::sleep_until(started + ttl + Duration::from_millis(300)).await;
    s.proxy.set(Mode::Pass);
    let replay = settle(&s.router, req).await;
    assert_eq!(replay.status, StatusCode::CREATED);
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(s.counters.started(), 1, "the handler ran once");
    assert_eq!(s.outcomes.get(Outcome::Recorded), 1);
    assert_eq!(s.outcomes.get(Outcome::Retaken), 0);
}

/// A handler transaction whose connection dies quietly between the record's completion (which
/// locks the record's row) and its commit. No server-side wait outlives the client's: claims of
/// that key answer at once (503) instead of waiting on the row lock, the pool keeps serving other
/// keys after three times its size in retries, and once the server ends the idle transaction
/// (twice the operation timeout after the record's write, within the TTL), its effect rolled back,
/// the key runs again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_transaction_frozen_before_its_commit_blocks_its_key_for_about_a_ttl_only() {
    use axum::extract::State;
    use axum::routing::post as route_post;
    use axum_idempotency::{IdempotencyTx, Subject};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    const CONNECTIONS: u32 = 4;
    let ttl = Duration::from_secs(2);
    let (options, upstream, schema) = upstream_and_schema("frozen").await;
    let in_schema = options.clone().options([("search_path", schema.as_str())]);
    let records = PgPoolOptions::new()
        .max_connections(CONNECTIONS)
        .acquire_timeout(Duration::from_secs(5))
        .connect_with(in_schema.clone())
        .await
        .expect("records pool");
    // Handler transactions go through the proxy, which freezes a connection at its COMMIT.
    let proxy = Proxy::start(upstream).await;
    let transactions = PgPoolOptions::new()
        .max_connections(CONNECTIONS)
        .acquire_timeout(Duration::from_secs(5))
        .connect_with(in_schema.host("127.0.0.1").port(proxy.port()))
        .await
        .expect("transaction pool");
    let store = PostgresStore::new(records)
        .with_transaction_pool(transactions)
        .with_timeout(Duration::from_millis(500));
    store.migrate().await.expect("migrate");
    let layer = IdempotencyLayer::builder(store)
        .in_progress_ttl(ttl)
        .transactions(true)
        .build()
        .expect("layer");
    let runs = Arc::new(AtomicUsize::new(0));
    async fn handler(
        State(runs): State<Arc<AtomicUsize>>,
        mut tx: IdempotencyTx<sqlx::Postgres>,
    ) -> StatusCode {
        runs.fetch_add(1, Ordering::SeqCst);
        sqlx::query("SELECT 1")
            .execute(tx.conn().await.expect("begin"))
            .await
            .expect("the handler's statement");
        StatusCode::CREATED
    }
    let router = axum::Router::new()
        .route("/pay", route_post(handler).layer(layer))
        .with_state(runs.clone())
        .layer(axum::middleware::from_fn(
            |mut request: axum::extract::Request, next: axum::middleware::Next| async move {
                request.extensions_mut().insert(Subject("alice".into()));
                next.run(request).await
            },
        ));
    let req = |key: &str| post("/pay").key(key).user("alice");

    proxy.freeze_at_commit();
    let frozen = send(&router, req("k")).await;
    let frozen_at = std::time::Instant::now();
    assert_eq!(frozen.status, StatusCode::SERVICE_UNAVAILABLE, "{frozen:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    // Retries of the stuck key, three times the pool's size: each answers within the operation
    // timeout (the server gives up on the row lock first) and none runs the handler while the
    // frozen transaction holds the row; once the server has ended that session (one TTL idle in
    // its transaction), its effect rolled back, a retry may run the key again.
    for _ in 0..3 * CONNECTIONS {
        let started = std::time::Instant::now();
        let retry = send(&router, req("k")).await;
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "a retry waited {:?}",
            started.elapsed()
        );
        match retry.status {
            StatusCode::SERVICE_UNAVAILABLE | StatusCode::CONFLICT => {}
            // Only once the server ended the frozen session (idle past twice the operation
            // timeout after the record's write), its effect rolled back: the run that follows is
            // the key's second, never beside the first.
            StatusCode::CREATED => assert_eq!(runs.load(Ordering::SeqCst), 2),
            _ => panic!("{retry:?}"),
        }
    }
    // The pool still serves other keys. On a loaded machine a claim (and its confirming renewal)
    // may answer past a tenth of this test's short TTL, which is refused as too late to trust
    // (`503`, "answered too slowly"): sent again then. A pool worn out by the retries would answer
    // another `503`, which fails here.
    let mut other = send(&router, req("other")).await;
    for _ in 0..5 {
        let too_late = String::from_utf8_lossy(&other.body).contains("answered too slowly");
        if other.status != StatusCode::SERVICE_UNAVAILABLE || !too_late {
            break;
        }
        other = send(&router, req("other")).await;
    }
    assert_eq!(other.status, StatusCode::CREATED, "{other:?}");
    // The key runs again, once: its first run rolled back.
    let again = settle(&router, || req("k")).await;
    assert_eq!(again.status, StatusCode::CREATED, "{again:?}");
    assert_eq!(
        runs.load(Ordering::SeqCst),
        3,
        "k, k again after the rollback, other"
    );
    assert!(
        frozen_at.elapsed() < ttl * 4,
        "usable again after {:?}",
        frozen_at.elapsed()
    );
}

/// A delete whose answer is lost after the database committed it: the store sends it again on a
/// new connection (a kept connection found dead), and that second attempt finds the first one's
/// token on the record and answers `Deleted`, as the first would have. The record is gone, and a
/// `CachedStore` in front, which had the finished record cached, forgets it on any answer of a
/// delete: the next claim of the key runs it anew, never a replay of the deleted record.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_delete_whose_answer_is_lost_after_its_commit_leaves_nothing_cached() {
    use std::sync::Arc;

    use axum_idempotency::Fingerprint;
    use axum_idempotency::store::{
        CachedStore, ClaimOutcome, ClaimRequest, Deleted, Finished, IdempotencyStore, RecordKey,
        StoredResponse,
    };
    let (options, upstream, schema) = upstream_and_schema("delete").await;
    let proxy = Proxy::start(upstream).await;
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .connect_with(
            options
                .clone()
                .host("127.0.0.1")
                .port(proxy.port())
                .options([("search_path", schema.as_str())]),
        )
        .await
        .expect("pool through the proxy");
    let store = PostgresStore::new(pool).with_timeout(Duration::from_secs(2));
    store.migrate().await.expect("migrate");
    let direct = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(options.options([("search_path", schema.as_str())]))
        .await
        .expect("direct pool");
    let cached = CachedStore::new(store);
    let key = RecordKey {
        key: "deleted-once".into(),
        subject: "alice".into(),
        endpoint: "POST /pay".into(),
    };
    let request = || {
        ClaimRequest::new(
            key.clone(),
            Fingerprint::of(None, b"{}"),
            Duration::from_secs(30),
            Duration::from_secs(600),
        )
    };
    let first = request();
    let ClaimOutcome::Claimed { lease, .. } = cached.claim(&first).await.expect("claim") else {
        panic!("a fresh key is claimed");
    };
    let answer = Arc::new(StoredResponse::new(
        Finished::Completed,
        201,
        Vec::new(),
        Some(bytes::Bytes::from_static(b"charged")),
    ));
    let done = cached
        .complete(&key, lease, &first.fingerprint, answer, first.retention)
        .await;
    assert!(done.expect("complete").is_done());
    // Read once from the store, then cached.
    for _ in 0..2 {
        let replay = cached.claim(&request()).await.expect("claim");
        assert!(matches!(replay, ClaimOutcome::Finished(_)), "{replay:?}");
    }
    // Records with an answer (a deleted one stays a moment as a released tombstone, which no
    // claim replays and inspection does not show).
    let rows = || async {
        let (n,): (i64,) = sqlx::query_as(
            "SELECT count(*) FROM idempotency_records WHERE status <> 'in_progress'",
        )
        .fetch_one(&direct)
        .await
        .expect("count");
        n
    };
    assert_eq!(rows().await, 1);

    // The delete's answer (one row, then `SELECT 1`) is lost after the database committed it; the
    // store sends it again on another connection, and that one answers as the first would have.
    proxy.cut_reply(b"SELECT 1\0");
    let deleted = cached.delete(&key).await;
    assert_eq!(rows().await, 0, "the first attempt committed: {deleted:?}");
    assert!(
        matches!(deleted, Ok(Deleted::Deleted)),
        "a delete sent again after it committed answers as the first: {deleted:?}"
    );
    // Whatever the answer, nothing of the deleted record is replayed: the key runs anew.
    let again = request();
    let outcome = cached.claim(&again).await.expect("claim");
    assert!(
        matches!(outcome, ClaimOutcome::Claimed { .. }) && !outcome.is_retake(&again),
        "the deleted record was replayed from the cache: {outcome:?}"
    );
}
