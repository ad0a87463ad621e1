//! The MySQL store in operation, on a real MySQL or MariaDB: a handler's effects written through
//! `IdempotencyTx<sqlx::MySql>` commit with the record of its answer or not at all; connections cut
//! or stalled by a proxy, a transaction frozen before its commit, and a private server restarted
//! under load never run a handler twice, and the store recovers.
#![cfg(feature = "mysql")]

use crate::common;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::post as route_post;
use axum_idempotency::store::{IdempotencyStore, MySqlStore};
use axum_idempotency::{
    IdempotencyContext, IdempotencyLayer, IdempotencyTx, Outcome, OutcomeCounters, Subject,
};
use common::proxy::{Mode, Proxy};
use common::{Answer, app, eventually, post, send};
use sqlx::mysql::{MySqlConnectOptions, MySqlPool, MySqlPoolOptions};
use tokio::sync::Semaphore;

fn mysql_url() -> String {
    common::servers::mysql_url()
}

async fn pool_on(url: &str, connections: u32) -> MySqlPool {
    MySqlPoolOptions::new()
        .max_connections(connections)
        .acquire_timeout(Duration::from_secs(30))
        .connect(url)
        .await
        .expect("MySQL must be running (see .ci/run)")
}

/// A table name no other test uses (stale ones are dropped by the store tests).
fn fresh_table() -> String {
    static N: AtomicUsize = AtomicUsize::new(0);
    format!(
        "idem_t_{}_{}_op{}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_secs(),
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    )
}

/// The server's address, for a proxy in front of it.
async fn upstream(url: &str) -> SocketAddr {
    let options: MySqlConnectOptions = url.parse().expect("url");
    tokio::net::lookup_host((options.get_host(), options.get_port()))
        .await
        .expect("resolve")
        .next()
        .expect("an address")
}

/// `url` with its host and port replaced by the proxy's.
fn through(url: &str, proxy: &Proxy) -> MySqlConnectOptions {
    let options: MySqlConnectOptions = url.parse().expect("url");
    options.host("127.0.0.1").port(proxy.port())
}

/// Retries like a client would until the answer is neither 409 nor 503, for at most ten seconds.
async fn settle(router: &Router, req: impl Fn() -> common::Req) -> Answer {
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

// ---- the handler's transaction ----

/// The handler's world: where it writes its effects, how many times it ran, and a gate a test can
/// hold it at after it wrote its effect.
#[derive(Clone)]
struct World {
    effects: String,
    runs: Arc<AtomicUsize>,
    written: Arc<AtomicUsize>,
    gate: Arc<Semaphore>,
}

/// Writes one effect row through the layer's transaction, then answers as the headers say:
/// `x-hold` (wait at the gate after the write), `x-panic`, `x-end` (end the transaction under the
/// layer, as a deadlock's rollback does), `x-fail` (a statement that fails and leaves the
/// transaction going), `x-status`.
async fn charge(
    State(world): State<World>,
    ctx: IdempotencyContext,
    mut tx: IdempotencyTx<sqlx::MySql>,
    headers: HeaderMap,
) -> Response {
    let run = world.runs.fetch_add(1, Ordering::SeqCst);
    let effect = format!("INSERT INTO `{}` (k, note) VALUES (?, ?)", world.effects);
    sqlx::query(sqlx::AssertSqlSafe(effect.as_str()))
        .bind(ctx.derived_key())
        .bind(format!("run {run}"))
        .execute(tx.conn().await.expect("begin"))
        .await
        .expect("the effect is written");
    world.written.fetch_add(1, Ordering::SeqCst);
    if headers.contains_key("x-hold") {
        world.gate.acquire().await.expect("gate").forget();
    }
    if headers.contains_key("x-panic") {
        panic!("the handler panicked after its effect");
    }
    if headers.contains_key("x-end") {
        sqlx::raw_sql("ROLLBACK")
            .execute(tx.conn().await.expect("begun"))
            .await
            .expect("rolled back");
    }
    if headers.contains_key("x-fail") {
        let failed = sqlx::query(sqlx::AssertSqlSafe(effect.as_str()))
            .bind(ctx.derived_key())
            .bind(format!("run {run}"))
            .execute(tx.conn().await.expect("begun"))
            .await;
        assert!(failed.is_err(), "a duplicate effect");
    }
    let status = headers
        .get("x-status")
        .and_then(|v| v.to_str().ok()?.parse().ok())
        .and_then(|v| StatusCode::from_u16(v).ok())
        .unwrap_or(StatusCode::CREATED);
    (status, format!("charged {}", ctx.derived_key())).into_response()
}

async fn auth(mut request: Request, next: Next) -> Response {
    request.extensions_mut().insert(Subject("alice".into()));
    next.run(request).await
}

struct Setup {
    pool: MySqlPool,
    store: MySqlStore,
    world: World,
    outcomes: OutcomeCounters,
}

impl Setup {
    async fn new() -> Setup {
        let pool = pool_on(&mysql_url(), 16).await;
        let table = fresh_table();
        let effects = format!("{table}_effects");
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "CREATE TABLE `{effects}` (k VARCHAR(64) NOT NULL, note VARCHAR(64) NOT NULL, \
               UNIQUE (k, note)) ENGINE = InnoDB"
        )))
        .execute(&pool)
        .await
        .expect("effects");
        let store = MySqlStore::with_table(pool.clone(), &table).expect("table name");
        store.migrate().await.expect("migrate");
        Setup {
            pool,
            store,
            world: World {
                effects,
                runs: Arc::default(),
                written: Arc::default(),
                gate: Arc::new(Semaphore::new(0)),
            },
            outcomes: OutcomeCounters::new(),
        }
    }

    fn router(&self) -> Router {
        self.router_on(self.store.clone())
    }

    fn router_on(&self, store: MySqlStore) -> Router {
        let layer = IdempotencyLayer::builder(store)
            .in_progress_ttl(Duration::from_secs(30))
            .on_outcome(self.outcomes.hook())
            .transactions(true)
            .build()
            .expect("layer");
        Router::new()
            .route("/charge", route_post(charge))
            .route_layer(layer)
            .layer(middleware::from_fn(auth))
            .with_state(self.world.clone())
    }

    async fn effects(&self) -> i64 {
        let (n,): (i64,) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT COUNT(*) FROM `{}`",
            self.world.effects
        )))
        .fetch_one(&self.pool)
        .await
        .expect("count effects");
        n
    }

    fn runs(&self) -> usize {
        self.world.runs.load(Ordering::SeqCst)
    }

    async fn until_written(&self, n: usize) {
        let written = self.world.written.clone();
        eventually(move || written.load(Ordering::SeqCst) >= n).await;
    }
}

fn charge_req(key: &str) -> common::Req {
    post("/charge").key(key)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn effect_and_record_commit_together() {
    let s = Setup::new().await;
    let router = s.router();
    let first = send(&router, charge_req("k")).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    assert_eq!(s.effects().await, 1);
    let replay = send(&router, charge_req("k")).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
    assert_eq!((s.runs(), s.effects().await), (1, 1));
    assert_eq!(s.outcomes.get(Outcome::Recorded), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn client_sees_nothing_before_the_commit() {
    let s = Setup::new().await;
    let router = s.router();
    let first = tokio::spawn({
        let router = router.clone();
        async move { send(&router, charge_req("k").header("x-hold", "1")).await }
    });
    s.until_written(1).await;
    // Written, not committed: nobody else sees it, and duplicates get 409.
    assert_eq!(s.effects().await, 0);
    assert_eq!(
        send(&router, charge_req("k")).await.status,
        StatusCode::CONFLICT
    );
    s.world.gate.add_permits(1);
    assert_eq!(first.await.expect("first").status, StatusCode::CREATED);
    assert_eq!(s.effects().await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn panic_rolls_the_effect_back_and_the_retry_runs_once() {
    let s = Setup::new().await;
    let router = s.router();
    let panicked = send(&router, charge_req("k").header("x-panic", "1")).await;
    assert_eq!(panicked.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(s.effects().await, 0, "the effect was rolled back");
    let retry = send(&router, charge_req("k")).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(!retry.replayed());
    assert_eq!((s.runs(), s.effects().await), (2, 1));
}

/// A worker whose record was retaken (it was presumed dead) and the retaker race to commit: only
/// the lease holder's completion matches, so exactly one effect commits and the late worker's
/// client gets 409.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lost_lease_rolls_back_and_one_effect_commits() {
    let s = Setup::new().await;
    let (late, retaker) = (s.router(), s.router());
    let first = tokio::spawn({
        let late = late.clone();
        async move { send(&late, charge_req("k").header("x-hold", "1")).await }
    });
    s.until_written(1).await;
    // The late worker is cut off past its TTL and past its presence (its session lapsed): the
    // record is aged, marked by a claim that found it silent long ago (an hour, or since the
    // server started), and its lease put under
    // no presence, as the lapse leaves it.
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "UPDATE `{}` SET suspected_on = CONCAT(@@hostname, ':', @@port, ':', @@server_id), \
           suspected_at = UTC_TIMESTAMP(6) - INTERVAL LEAST(3600, UNIX_TIMESTAMP() \
             - ((UUID_SHORT() >> 24) & 4294967295) - 2) SECOND, \
           updated_at = updated_at - INTERVAL 1 HOUR, lease_token = lease_token & 4294967295",
        s.store.table()
    )))
    .execute(&s.pool)
    .await
    .expect("age the record");
    let second = send(&retaker, charge_req("k")).await;
    assert_eq!(second.status, StatusCode::CREATED, "{second:?}");
    s.world.gate.add_permits(1);
    let first = first.await.expect("late worker");
    assert_eq!(first.status, StatusCode::CONFLICT);
    assert_eq!(s.effects().await, 1, "one effect, the retaker's");
    assert_eq!(s.outcomes.get(Outcome::LeaseLost), 1);
    let replay = send(&late, charge_req("k")).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, second.body);
}

/// The server ended the handler's transaction under it (a deadlock rolls back the whole
/// transaction; here the handler's own `ROLLBACK`): its later statements would autocommit, and
/// a completion written now would commit without the effect it records. The completion finds the
/// transaction gone: 500, nothing recorded, and the retry runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_transaction_ended_under_the_handler_is_never_recorded() {
    let s = Setup::new().await;
    let router = s.router();
    let ended = send(&router, charge_req("k").header("x-end", "1")).await;
    assert_eq!(ended.status, StatusCode::INTERNAL_SERVER_ERROR, "{ended:?}");
    assert_eq!(s.effects().await, 0);
    let retry = send(&router, charge_req("k")).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(!retry.replayed());
    assert_eq!((s.runs(), s.effects().await), (2, 1));
    assert!(send(&router, charge_req("k")).await.replayed());
}

/// On MySQL a failed statement does not end the transaction (unlike PostgreSQL's): the handler saw
/// the error and answered; its effect and that answer commit together.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failed_statement_leaves_the_transaction_going() {
    let s = Setup::new().await;
    let router = s.router();
    let first = send(&router, charge_req("k").header("x-fail", "1")).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    assert_eq!(s.effects().await, 1);
    assert!(send(&router, charge_req("k")).await.replayed());
    assert_eq!(s.runs(), 1);
}

/// The store's session values go back with the connection: the transaction's `wait_timeout`, and
/// every batch's lock and statement time bounds, also after a batch that failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn connections_go_back_to_the_pool_with_their_own_session_values() {
    let s = Setup::new().await;
    let one = pool_on(&mysql_url(), 1).await;
    let mark = "SET @@session.wait_timeout = 12345, @@session.innodb_lock_wait_timeout = 77";
    sqlx::raw_sql(mark).execute(&one).await.expect("mark");
    let store = MySqlStore::with_table(one.clone(), s.store.table())
        .expect("table")
        .with_transaction_pool(one.clone());
    let router = s.router_on(store.clone());
    assert_eq!(
        send(&router, charge_req("a")).await.status,
        StatusCode::CREATED
    );
    assert_eq!(
        send(&router, charge_req("b").header("x-end", "1"))
            .await
            .status,
        StatusCode::INTERNAL_SERVER_ERROR
    );
    let missing = MySqlStore::with_table(one.clone(), "never_made").expect("table");
    assert!(missing.purge_expired().await.is_err(), "a failed batch");
    // Kept connections go back to the pool once idle.
    tokio::time::sleep(Duration::from_millis(400)).await;
    let (wait, lock): (u64, u64) =
        sqlx::query_as("SELECT @@session.wait_timeout, @@session.innodb_lock_wait_timeout")
            .fetch_one(&one)
            .await
            .expect("the session's values");
    assert_eq!((wait, lock), (12345, 77));
}

// ---- faults ----

/// A store reached through a proxy, with short timeouts so that faults show quickly.
async fn through_proxy(
    in_progress_ttl: Duration,
) -> (Proxy, Router, common::Counters, OutcomeCounters) {
    let url = mysql_url();
    let proxy = Proxy::start(upstream(&url).await).await;
    let pool = MySqlPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_millis(800))
        .connect_with(through(&url, &proxy))
        .await
        .expect("pool through the proxy");
    let store = MySqlStore::with_table(pool, &fresh_table())
        .expect("table")
        .with_timeout(Duration::from_millis(800));
    store.migrate().await.expect("migrate");
    let outcomes = OutcomeCounters::new();
    let layer = IdempotencyLayer::builder(store)
        .in_progress_ttl(in_progress_ttl)
        .on_outcome(outcomes.hook())
        .build()
        .expect("layer");
    let (router, counters) = app(layer);
    (proxy, router, counters, outcomes)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_connection_cut_mid_request_records_later_and_runs_once() {
    let (proxy, router, counters, outcomes) = through_proxy(Duration::from_secs(30)).await;
    let req = || {
        post("/pay")
            .key("k")
            .user("alice")
            .header("x-delay-ms", "400")
    };
    let first = tokio::spawn({
        let router = router.clone();
        async move { send(&router, req()).await }
    });
    let c = counters.clone();
    eventually(move || c.started() == 1).await;
    proxy.set(Mode::Cut); // the database goes away while the handler runs
    let answer = first.await.expect("first");
    crate::not_recorded_yet(&answer);
    assert_eq!(outcomes.get(Outcome::RecordDeferred), 1);
    tokio::time::sleep(Duration::from_millis(500)).await;
    proxy.set(Mode::Pass);
    let o = outcomes.clone();
    eventually(move || o.get(Outcome::Recorded) == 1).await;
    let replay = settle(&router, req).await;
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(counters.started(), 1, "the handler ran once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stall_mid_statement_times_out_then_records() {
    let (proxy, router, counters, outcomes) = through_proxy(Duration::from_secs(30)).await;
    let req = || {
        post("/pay")
            .key("k")
            .user("alice")
            .header("x-delay-ms", "300")
    };
    let first = tokio::spawn({
        let router = router.clone();
        async move { send(&router, req()).await }
    });
    let c = counters.clone();
    eventually(move || c.started() == 1).await;
    proxy.set(Mode::Stall); // the completion's statements will hang
    let answer = tokio::time::timeout(Duration::from_secs(10), first)
        .await
        .expect("the client is answered despite the stall")
        .expect("first");
    crate::not_recorded_yet(&answer);
    let during = tokio::time::timeout(Duration::from_secs(10), send(&router, req()))
        .await
        .expect("answered during the stall");
    assert!(
        during.status == StatusCode::SERVICE_UNAVAILABLE || during.status == StatusCode::CONFLICT,
        "{during:?}"
    );
    proxy.set(Mode::Pass);
    let o = outcomes.clone();
    eventually(move || o.get(Outcome::Recorded) == 1).await;
    let replay = settle(&router, req).await;
    assert!(replay.replayed());
    assert_eq!(counters.started(), 1, "the handler ran once");
    assert_eq!(outcomes.get(Outcome::LeaseLost), 0);
}

/// A handler transaction whose connection dies quietly between the record's completion (which
/// locks the record's row) and its commit: claims of that key answer within the timeout (the
/// server's lock wait bound) and run nothing; once the server ends the idle session (its
/// `wait_timeout`, twice the operation timeout after the completion), its effect rolled back, the
/// key runs again, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_transaction_frozen_before_its_commit_blocks_its_key_for_a_moment_only() {
    let s = Setup::new().await;
    let url = mysql_url();
    let proxy = Proxy::start(upstream(&url).await).await;
    let transactions = MySqlPoolOptions::new()
        .max_connections(4)
        .connect_with(through(&url, &proxy))
        .await
        .expect("transaction pool");
    let store = MySqlStore::with_table(s.pool.clone(), s.store.table())
        .expect("table")
        .with_transaction_pool(transactions)
        .with_timeout(Duration::from_millis(500));
    let router = s.router_on(store);
    // The commit's round trip: the session's own values, then COMMIT.
    proxy.freeze_at(b";\nCOMMIT");
    let frozen = send(&router, charge_req("k")).await;
    assert_eq!(frozen.status, StatusCode::SERVICE_UNAVAILABLE, "{frozen:?}");
    assert_eq!(s.runs(), 1);
    let again = settle(&router, || charge_req("k")).await;
    assert_eq!(again.status, StatusCode::CREATED, "{again:?}");
    assert!(!again.replayed());
    assert_eq!(
        s.runs(),
        2,
        "the frozen run rolled back, the retry ran once"
    );
    assert_eq!(s.effects().await, 1);
}

/// The tests that restart the private server, one at a time.
static RESTARTS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A private server restarted while requests keep coming: no key's handler runs twice, and the
/// store serves again once the server is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_database_restarted_under_load_runs_nothing_twice() {
    const CLIENTS: usize = 6;
    const KEYS: usize = 400;
    let _alone = RESTARTS.lock().await;
    let server = common::servers::private_mysql();
    let pool = MySqlPoolOptions::new()
        .max_connections(8)
        .acquire_timeout(Duration::from_secs(2))
        .connect(&server.url)
        .await
        .expect("the private server");
    let store = MySqlStore::with_table(pool, &fresh_table())
        .expect("table")
        .with_timeout(Duration::from_millis(800));
    store.migrate().await.expect("migrate");
    let runs: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
    async fn counted(
        State(runs): State<Arc<Mutex<HashMap<String, usize>>>>,
        ctx: IdempotencyContext,
    ) -> StatusCode {
        *runs
            .lock()
            .expect("lock")
            .entry(ctx.key().to_owned())
            .or_default() += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
        StatusCode::CREATED
    }
    let layer = IdempotencyLayer::builder(store)
        .in_progress_ttl(Duration::from_secs(30))
        .build()
        .expect("layer");
    let router = Router::new()
        .route("/pay", route_post(counted))
        .route_layer(layer)
        .layer(middleware::from_fn(auth))
        .with_state(runs.clone());
    // Every client sends every key, in its own order, until each key has been answered 201 and
    // the restart is over: keys answered already are sent again (replays, which read the store),
    // so that requests meet the restart however long the server takes to stop.
    let refused = Arc::new(AtomicUsize::new(0));
    let restarted = Arc::new(AtomicBool::new(false));
    let load = (0..CLIENTS).map(|client| {
        let (router, refused, restarted) = (router.clone(), refused.clone(), restarted.clone());
        tokio::spawn(async move {
            let mut done = vec![false; KEYS];
            let started = std::time::Instant::now();
            let mut i = client * 7;
            while (done.iter().any(|d| !d) || !restarted.load(Ordering::SeqCst))
                && started.elapsed() < Duration::from_secs(60)
            {
                let k = i % KEYS;
                i += 1;
                let answer = send(&router, post("/pay").key(&format!("k{k}"))).await;
                done[k] |= answer.status == StatusCode::CREATED;
                if answer.status == StatusCode::SERVICE_UNAVAILABLE {
                    refused.fetch_add(1, Ordering::SeqCst);
                }

                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            done.iter().all(|d| *d)
        })
    });
    let load: Vec<_> = load.collect();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let before = runs.lock().expect("lock").len();
    // Down for 3 s: a request caught in its handler or its completion when the server stops is
    // answered once its completion gives up for the background (201), so only the requests sent
    // after those are sure to meet the server down.
    tokio::task::spawn_blocking(|| {
        common::servers::private_mysql().restart(Duration::from_secs(3))
    })
    .await
    .expect("restart");
    restarted.store(true, Ordering::SeqCst);
    for client in load {
        assert!(
            client.await.expect("client"),
            "every key answered in the end"
        );
    }
    let runs = runs.lock().expect("lock");
    assert!(
        before < KEYS,
        "the restart came under load ({before} keys ran before it)"
    );
    assert!(
        refused.load(Ordering::SeqCst) > 0,
        "requests met the restart"
    );
    assert_eq!(runs.len(), KEYS, "every key ran: the store recovered");
    let twice: Vec<_> = runs.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "keys run twice: {twice:?}");
}

/// A restart does not count against a live holder (see `common::restart`), on the private server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_of_the_server_does_not_count_against_a_holder() {
    let _alone = RESTARTS.lock().await;
    let server = common::servers::private_mysql();
    let pool = MySqlPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(10))
        .connect(&server.url)
        .await
        .expect("the private server");
    let store = MySqlStore::with_table(pool, &fresh_table())
        .expect("table")
        .with_timeout(Duration::from_secs(2));
    store.migrate().await.expect("migrate");
    common::restart::a_restart_does_not_count_against_a_holder(
        &store,
        Duration::from_secs(5),
        || common::servers::private_mysql().restart(Duration::from_millis(100)),
    )
    .await;
}
