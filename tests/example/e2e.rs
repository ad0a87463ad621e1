//! End to end: the checkout example started as the process it is (its binary, as `cargo run`
//! builds it), talked to over real HTTP, on each store; killed and restarted, on Postgres.
#![cfg(feature = "postgres")]

use crate::common;

use std::net::SocketAddr;
use std::str::FromStr;
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use common::Answer;
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::process::Child;

use common::example::{self, database_url};

/// A fresh schema, and a pool whose connections use it.
pub(crate) async fn schema_pool() -> (String, PgPool) {
    let admin = PgPool::connect(&database_url()).await.expect("PostgreSQL");
    let schema = format!(
        "idem_t_{}_{}_e2e{}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_secs(),
        std::process::id(),
        rand_suffix()
    );
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
        .execute(&admin)
        .await
        .expect("schema");
    let options = PgConnectOptions::from_str(&database_url())
        .expect("url")
        .options([("search_path", schema.as_str())]);
    let pool = PgPoolOptions::new()
        .max_connections(30)
        .connect_with(options)
        .await
        .expect("pool");
    (schema, pool)
}

fn rand_suffix() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::SeqCst)
}

/// The example running as a process of its own, and its address: killed when dropped.
pub(crate) struct Served {
    _process: Child,
    pub(crate) addr: SocketAddr,
}

/// `CHECKOUT_DELAY_MS`, the simulated payment's latency, and `more`.
pub(crate) fn delayed(
    delay_ms: u64,
    more: &[(&'static str, String)],
) -> Vec<(&'static str, String)> {
    let mut env = vec![("CHECKOUT_DELAY_MS", delay_ms.to_string())];
    env.extend(more.iter().cloned());
    env
}

/// The example on the memory store, its payments taking `delay_ms`, with `more` settings.
pub(crate) async fn serve_memory_with(delay_ms: u64, more: &[(&'static str, String)]) -> Served {
    let (process, addr) = example::start_memory(&delayed(delay_ms, more)).await;
    Served {
        _process: process,
        addr,
    }
}

async fn serve_memory(delay_ms: u64) -> Served {
    serve_memory_with(delay_ms, &[]).await
}

/// The example on Postgres, in a schema of its own (it migrates the store and makes its ledger
/// there), checkouts written in the layer's transaction.
async fn serve_postgres(delay_ms: u64) -> Served {
    let (schema, _) = schema_pool().await;
    let (process, addr) = example::start(&schema, &delayed(delay_ms, &[])).await;
    Served {
        _process: process,
        addr,
    }
}

/// The example on the database at `url` (`sqlite://PATH`, `mysql://...`).
pub(crate) async fn serve_url(url: &str, delay_ms: u64) -> Served {
    let (process, addr) = example::start_with_url(url, &delayed(delay_ms, &[])).await;
    Served {
        _process: process,
        addr,
    }
}

/// One HTTP/1.1 request on a connection of its own.
pub(crate) async fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    user: &str,
    key: Option<&str>,
    body: &str,
) -> Answer {
    try_http(addr, method, path, user, key, body)
        .await
        .expect("HTTP exchange")
}

pub(crate) async fn try_http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    user: &str,
    key: Option<&str>,
    body: &str,
) -> Result<Answer, String> {
    example::request(addr, method, path, user, key, body, Duration::from_secs(60)).await
}

pub(crate) async fn checkout_req(addr: SocketAddr, user: &str, key: &str, body: &str) -> Answer {
    http(addr, "POST", "/checkout", user, Some(key), body).await
}

/// The retry of a key whose holder died, sent past its TTL: Postgres and MySQL take a record only
/// a TTL after a claim first found its holder silent (the holder may be alive behind a failover),
/// so the first retry is answered `409` and marks it, and the one a TTL later takes it.
pub(crate) async fn checkout_past_silence(
    addr: SocketAddr,
    user: &str,
    key: &str,
    body: &str,
    ttl: Duration,
) -> Answer {
    let first = checkout_req(addr, user, key, body).await;
    if first.status != StatusCode::CONFLICT {
        return first;
    }
    tokio::time::sleep(ttl + Duration::from_millis(500)).await;
    checkout_req(addr, user, key, body).await
}

/// Payments the example's simulated provider took for `user`.
pub(crate) async fn provider_payments(addr: SocketAddr, user: &str) -> i64 {
    let answer = http(addr, "GET", "/charges", user, None, "").await;
    answer.json()["provider_payments"]
        .as_i64()
        .expect("provider_payments")
}

pub(crate) async fn charges(addr: SocketAddr, user: &str) -> (usize, i64) {
    let answer = http(addr, "GET", "/charges", user, None, "").await;
    assert_eq!(answer.status, StatusCode::OK);
    let json = answer.json();
    (
        json["charges"].as_array().expect("charges").len(),
        json["attempts"].as_i64().expect("attempts"),
    )
}

// ---- scenarios, run on both stores ----

pub(crate) async fn duplicates_during_a_slow_checkout(addr: SocketAddr) {
    const CLIENTS: usize = 21;
    let gate = std::sync::Arc::new(tokio::sync::Barrier::new(CLIENTS));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..CLIENTS {
        let gate = gate.clone();
        tasks.spawn(async move {
            gate.wait().await;
            let answer = checkout_req(addr, "alice", "order-1", r#"{"amount":1999}"#).await;
            (answer, Instant::now())
        });
    }
    let mut created = Vec::new();
    let mut conflicts = Vec::new();
    while let Some(done) = tasks.join_next().await {
        let (answer, at) = done.expect("client");
        match answer.status {
            StatusCode::CREATED => created.push((answer, at)),
            StatusCode::CONFLICT => {
                assert_eq!(answer.header("retry-after"), Some("2"));
                assert_eq!(answer.problem(), "in_progress");
                conflicts.push(at);
            }
            other => panic!("unexpected {other}: {answer:?}"),
        }
    }
    assert_eq!(created.len(), 1, "exactly one client gets the charge");
    assert_eq!(conflicts.len(), CLIENTS - 1);
    let (first, first_at) = created.pop().expect("one");
    // Every duplicate was answered while the checkout was still running.
    assert!(conflicts.iter().all(|at| *at < first_at));
    let retry = checkout_req(addr, "alice", "order-1", r#"{"amount":1999}"#).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(retry.replayed());
    assert_eq!(retry.body, first.body);
    assert_eq!(retry.header("location"), first.header("location"));
    assert_eq!(charges(addr, "alice").await, (1, 1));
}

pub(crate) async fn client_closes_mid_checkout(addr: SocketAddr) {
    let body = r#"{"amount":500}"#;
    let mut socket = TcpStream::connect(addr).await.expect("connect");
    let raw = format!(
        "POST /checkout HTTP/1.1\r\nhost: x\r\nauthorization: Bearer carol\r\n\
         idempotency-key: closed-tab\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    socket.write_all(raw.as_bytes()).await.expect("write");
    tokio::time::sleep(Duration::from_millis(300)).await;
    drop(socket); // the tab is closed mid-checkout
    let mut charged = (0, 0);
    for _ in 0..100 {
        charged = charges(addr, "carol").await;
        if charged.0 == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(charged, (1, 1), "the charge completed without its client");
    let mut retry = checkout_req(addr, "carol", "closed-tab", body).await;
    for _ in 0..50 {
        if retry.status != StatusCode::CONFLICT {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        retry = checkout_req(addr, "carol", "closed-tab", body).await;
    }
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(retry.replayed());
    assert_eq!(charges(addr, "carol").await, (1, 1));
}

pub(crate) async fn outcomes_and_isolation(addr: SocketAddr) {
    // A declined card is a definitive answer: replayed, not retried.
    let declined = r#"{"amount":100,"card":"declined"}"#;
    let first = checkout_req(addr, "dave", "d1", declined).await;
    assert_eq!(first.status, StatusCode::PAYMENT_REQUIRED);
    assert_eq!(first.json()["error"], "card_declined");
    let again = checkout_req(addr, "dave", "d1", declined).await;
    assert_eq!(again.status, StatusCode::PAYMENT_REQUIRED);
    assert!(again.replayed());
    assert_eq!(charges(addr, "dave").await, (0, 1));

    // A flaky provider releases the key: the retry runs again.
    let flaky = r#"{"amount":100,"card":"flaky"}"#;
    for attempt in 2..=3 {
        let answer = checkout_req(addr, "dave", "f1", flaky).await;
        assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(!answer.replayed());
        assert_eq!(charges(addr, "dave").await, (0, attempt));
    }

    // The same key from another subject is another operation.
    let a = checkout_req(addr, "erin", "shared", r#"{"amount":1}"#).await;
    let b = checkout_req(addr, "frank", "shared", r#"{"amount":1}"#).await;
    assert_eq!(
        (a.status, b.status),
        (StatusCode::CREATED, StatusCode::CREATED)
    );
    assert!(!b.replayed());
    assert_ne!(a.header("location"), b.header("location"));
    assert_eq!(charges(addr, "erin").await, (1, 1));
    assert_eq!(charges(addr, "frank").await, (1, 1));

    // And on another route.
    let refund = http(
        addr,
        "POST",
        "/refund",
        "erin",
        Some("shared"),
        r#"{"amount":1}"#,
    )
    .await;
    assert_eq!(refund.status, StatusCode::CREATED);
    assert!(!refund.replayed());
    assert_eq!(charges(addr, "erin").await, (2, 2));

    // The example requires a key, and the layer's errors are problem details.
    let no_key = http(addr, "POST", "/checkout", "erin", None, r#"{"amount":1}"#).await;
    assert_eq!(no_key.status, StatusCode::BAD_REQUEST);
    assert_eq!(no_key.problem(), "missing_idempotency_key");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn memory_duplicates_during_a_slow_checkout() {
    let served = serve_memory(1500).await;
    duplicates_during_a_slow_checkout(served.addr).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_duplicates_during_a_slow_checkout() {
    let served = serve_postgres(1500).await;
    duplicates_during_a_slow_checkout(served.addr).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn memory_client_closes_mid_checkout() {
    let served = serve_memory(800).await;
    client_closes_mid_checkout(served.addr).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_client_closes_mid_checkout() {
    let served = serve_postgres(800).await;
    client_closes_mid_checkout(served.addr).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn memory_outcomes_and_isolation() {
    let served = serve_memory(0).await;
    outcomes_and_isolation(served.addr).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_outcomes_and_isolation() {
    let served = serve_postgres(0).await;
    outcomes_and_isolation(served.addr).await;
}

// ---- the example binary, killed and restarted ----

/// The example as a process of its own, on Postgres in `schema`, and the address it listens on.
async fn start_example(schema: &str, ttl_secs: u64, delay_ms: u64) -> (Child, SocketAddr) {
    start_example_with(schema, ttl_secs, delay_ms, &[]).await
}

/// [`start_example`] with more environment variables.
async fn start_example_with(
    schema: &str,
    ttl_secs: u64,
    delay_ms: u64,
    env: &[(&str, &str)],
) -> (Child, SocketAddr) {
    let mut all = vec![
        ("IDEMPOTENCY_IN_PROGRESS_TTL_SECS", ttl_secs.to_string()),
        ("CHECKOUT_DELAY_MS", delay_ms.to_string()),
    ];
    all.extend(env.iter().map(|(k, v)| (*k, (*v).to_owned())));
    example::start(schema, &all).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn process_killed_mid_checkout_is_retaken_after_the_ttl() {
    let (schema, pool) = schema_pool().await;
    let body = r#"{"amount":4200}"#;
    const TTL: Duration = Duration::from_secs(6);
    let (mut first, addr) = start_example(&schema, TTL.as_secs(), 10_000).await;
    let in_flight = tokio::spawn(async move {
        try_http(addr, "POST", "/checkout", "gina", Some("crash-1"), body).await
    });
    // Wait until the claim is committed and visible to another connection, then a duplicate is
    // refused as in progress.
    let mut claimed = false;
    for _ in 0..250 {
        let row: Option<(String,)> = sqlx::query_as(
            "SELECT status FROM idempotency_records WHERE idempotency_key = 'crash-1'",
        )
        .fetch_optional(&pool)
        .await
        .expect("read the claim");
        if row.is_some_and(|(status,)| status == "in_progress") {
            claimed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(claimed, "the first request's claim was committed");
    let dup = checkout_req(addr, "gina", "crash-1", body).await;
    assert_eq!(dup.status, StatusCode::CONFLICT);
    first.kill().await.expect("kill -9 mid-checkout");
    let claimed_at = Instant::now();
    let lost = in_flight.await.expect("client task");
    assert!(lost.is_err(), "the in-flight client lost its connection");

    let (_second, addr) = start_example(&schema, TTL.as_secs(), 0).await;
    let early = checkout_req(addr, "gina", "crash-1", body).await;
    assert!(
        claimed_at.elapsed() < TTL,
        "the restart took longer than the TTL; the early retry below would prove nothing"
    );
    assert_eq!(
        early.status,
        StatusCode::CONFLICT,
        "before the TTL the key is still held"
    );
    assert_eq!(charges(addr, "gina").await, (0, 0));
    tokio::time::sleep(TTL.saturating_sub(claimed_at.elapsed()) + Duration::from_millis(500)).await;
    let retaken = checkout_past_silence(addr, "gina", "crash-1", body, TTL).await;
    assert_eq!(retaken.status, StatusCode::CREATED, "{retaken:?}");
    assert!(!retaken.replayed());
    let replay = checkout_req(addr, "gina", "crash-1", body).await;
    assert!(replay.replayed());
    assert_eq!(charges(addr, "gina").await, (1, 1), "charged exactly once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replay_survives_a_restart() {
    let (schema, _pool) = schema_pool().await;
    let body = r#"{"amount":777}"#;
    let (mut first, addr) = start_example(&schema, 90, 0).await;
    let charged = checkout_req(addr, "hank", "restart-1", body).await;
    assert_eq!(charged.status, StatusCode::CREATED);
    first.kill().await.expect("stop");
    let (_second, addr) = start_example(&schema, 90, 0).await;
    let replay = checkout_req(addr, "hank", "restart-1", body).await;
    assert_eq!(replay.status, StatusCode::CREATED);
    assert!(replay.replayed());
    assert_eq!(replay.body, charged.body);
    assert_eq!(charges(addr, "hank").await, (1, 1));
}

// ---- transactional completion, with the example binary killed at each point ----

/// Polls `sql` (one text or bool-ish row) until it returns `want`, for at most ten seconds.
async fn wait_for(pool: &PgPool, sql: &str, want: &str) {
    for _ in 0..500 {
        let row: Option<(String,)> = sqlx::query_as(sqlx::AssertSqlSafe(sql))
            .fetch_optional(pool)
            .await
            .expect("poll");
        if row.is_some_and(|(v,)| v == want) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("{sql} never returned {want}");
}

/// Killed after the charge was written in the layer's transaction, before the commit: the charge
/// rolls back with the process, the record is retaken after the TTL, and the retaker charges once.
/// The provider, called with the derived key, is charged once across both runs.
async fn killed_between_charge_and_commit(transactional: bool) -> (usize, i64, i64) {
    let (schema, pool) = schema_pool().await;
    let body = r#"{"amount":700}"#;
    const TTL: Duration = Duration::from_secs(4);
    let mode = if transactional { "1" } else { "0" };
    let hold = [
        ("CHECKOUT_HOLD_MS", "20000"),
        ("CHECKOUT_TRANSACTIONAL", mode),
    ];
    let (mut first, addr) = start_example_with(&schema, TTL.as_secs(), 0, &hold).await;
    let in_flight = tokio::spawn(async move {
        try_http(addr, "POST", "/checkout", "hana", Some("tx-1"), body).await
    });
    // The handler ran up to its pause: its three steps (the last one sends the receipt) and the
    // provider payment are on record, and then its charge (committed on its own when the
    // checkout is not transactional; uncommitted in its transaction otherwise).
    wait_for(
        &pool,
        "SELECT count(*)::text FROM provider_payments WHERE subject = 'hana'",
        "1",
    )
    .await;
    wait_for(
        &pool,
        "SELECT attempts::text FROM checkout_attempts WHERE subject = 'mail:hana'",
        "1",
    )
    .await;
    if transactional {
        tokio::time::sleep(Duration::from_millis(500)).await;
    } else {
        wait_for(
            &pool,
            "SELECT count(*)::text FROM checkout_charges WHERE subject = 'hana'",
            "1",
        )
        .await;
    }
    first.kill().await.expect("kill -9 before the commit");
    let killed_at = Instant::now();
    assert!(in_flight.await.expect("client").is_err());
    let (_second, addr) = start_example_with(
        &schema,
        TTL.as_secs(),
        0,
        &[("CHECKOUT_TRANSACTIONAL", mode)],
    )
    .await;
    let early = checkout_req(addr, "hana", "tx-1", body).await;
    assert_eq!(early.status, StatusCode::CONFLICT, "held until the TTL");
    tokio::time::sleep(TTL.saturating_sub(killed_at.elapsed()) + Duration::from_millis(500)).await;
    let retaken = checkout_past_silence(addr, "hana", "tx-1", body, TTL).await;
    assert_eq!(retaken.status, StatusCode::CREATED, "{retaken:?}");
    let replay = checkout_req(addr, "hana", "tx-1", body).await;
    assert!(replay.replayed());
    let (charges, attempts) = charges(addr, "hana").await;
    (charges, attempts, provider_payments(addr, "hana").await)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn transactional_checkout_killed_before_the_commit_charges_once() {
    let (charges, attempts, payments) = killed_between_charge_and_commit(true).await;
    assert_eq!(charges, 1, "the killed run's charge rolled back");
    assert_eq!(attempts, 2, "the handler ran twice");
    assert_eq!(payments, 1, "the provider deduplicated by the derived key");
}

/// The same crash without the transaction: the killed run's charge had committed on its own, so the
/// retake charges again. Only the provider's own deduplication by the derived key saves the card.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn separate_checkout_killed_before_the_record_charges_twice() {
    let (charges, attempts, payments) = killed_between_charge_and_commit(false).await;
    assert_eq!(
        charges, 2,
        "without the transaction the ledger is charged twice"
    );
    assert_eq!(attempts, 2);
    assert_eq!(payments, 1);
}

/// The database refuses the completion: the charge rolls back with it, the client gets 503, the
/// record is released; after a crash and a restart, the retry charges once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn transactional_completion_refused_by_the_database_charges_once() {
    let (schema, pool) = schema_pool().await;
    let body = r#"{"amount":800}"#;
    let (mut first, addr) = start_example(&schema, 90, 0).await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE FUNCTION {schema}.refuse() RETURNS trigger LANGUAGE plpgsql AS \
           $$ BEGIN RAISE EXCEPTION 'completion refused'; END $$; \
         CREATE TRIGGER refuse BEFORE UPDATE ON {schema}.idempotency_records \
           FOR EACH ROW WHEN (NEW.status <> 'in_progress') EXECUTE FUNCTION {schema}.refuse();"
    )))
    .execute(&pool)
    .await
    .expect("trigger");
    let refused = checkout_req(addr, "ivan", "tx-2", body).await;
    assert_eq!(
        refused.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{refused:?}"
    );
    assert_eq!(refused.json()["error"], "idempotency_store_unavailable");
    assert_eq!(
        charges(addr, "ivan").await,
        (0, 1),
        "the charge rolled back"
    );
    first.kill().await.expect("kill -9");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DROP TRIGGER refuse ON {schema}.idempotency_records"
    )))
    .execute(&pool)
    .await
    .expect("drop trigger");
    let (_second, addr) = start_example(&schema, 90, 0).await;
    let retry = checkout_req(addr, "ivan", "tx-2", body).await;
    assert_eq!(
        retry.status,
        StatusCode::CREATED,
        "the record was released: {retry:?}"
    );
    assert!(!retry.replayed());
    assert_eq!(charges(addr, "ivan").await, (1, 2));
    assert_eq!(provider_payments(addr, "ivan").await, 1);
}

/// Killed after the commit, whether or not the answer reached the client: the retry replays, and
/// the charge is there once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn transactional_checkout_killed_after_the_commit_replays() {
    let (schema, pool) = schema_pool().await;
    let body = r#"{"amount":900}"#;
    let (mut first, addr) = start_example(&schema, 90, 300).await;
    let in_flight = tokio::spawn(async move {
        try_http(addr, "POST", "/checkout", "jack", Some("tx-3"), body).await
    });
    wait_for(
        &pool,
        "SELECT status FROM idempotency_records WHERE idempotency_key = 'tx-3'",
        "completed",
    )
    .await;
    first.kill().await.expect("kill -9 after the commit");
    let _ = in_flight.await;
    let (_second, addr) = start_example(&schema, 90, 0).await;
    let replay = checkout_req(addr, "jack", "tx-3", body).await;
    assert_eq!(replay.status, StatusCode::CREATED);
    assert!(replay.replayed());
    assert_eq!(charges(addr, "jack").await, (1, 1));
}

/// A deploy stops the instance gracefully (SIGTERM) while a separate (non-transactional) checkout
/// has written its charge and not yet its record. The server finishes what it has, then waits for
/// the idempotency layer's drain, so the record is written before the process exits, whether the
/// client is still waiting or gave up already; the retry after the restart replays: one charge.
async fn stopped_gracefully_between_charge_and_record(client_waits: bool) {
    let (schema, pool) = schema_pool().await;
    let body = r#"{"amount":650}"#;
    let user = if client_waits { "kate" } else { "liam" };
    let key = "term-1";
    let hold = [
        ("CHECKOUT_HOLD_MS", "1500"),
        ("CHECKOUT_TRANSACTIONAL", "0"),
    ];
    let (mut first, addr) = start_example_with(&schema, 90, 0, &hold).await;
    let patience = if client_waits {
        Duration::from_secs(60)
    } else {
        Duration::from_millis(400)
    };
    let in_flight = tokio::spawn(async move {
        example::request(addr, "POST", "/checkout", user, Some(key), body, patience).await
    });
    // The charge is written; the handler pauses before answering.
    wait_for(
        &pool,
        &format!("SELECT count(*)::text FROM provider_payments WHERE subject = '{user}'"),
        "1",
    )
    .await;
    if !client_waits {
        assert!(
            in_flight.is_finished()
                || tokio::time::timeout(Duration::from_secs(5), async {
                    while !in_flight.is_finished() {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                })
                .await
                .is_ok()
        );
    } else {
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let pid = first.id().expect("pid").to_string();
    let sent = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("kill -TERM");
    assert!(sent.success());
    let exit = tokio::time::timeout(Duration::from_secs(30), first.wait())
        .await
        .expect("the instance exits after draining")
        .expect("exit status");
    assert!(exit.success(), "{exit:?}");
    let answer = in_flight.await.expect("client");
    if client_waits {
        let answer = answer.expect("the waiting client gets its answer");
        assert_eq!(answer.status, StatusCode::CREATED, "{answer:?}");
    } else {
        assert!(answer.is_err(), "the client gave up: {answer:?}");
    }
    let (_second, addr) =
        start_example_with(&schema, 90, 0, &[("CHECKOUT_TRANSACTIONAL", "0")]).await;
    let retry = checkout_req(addr, user, key, body).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    assert!(
        retry.replayed(),
        "the record was written before the exit: {retry:?}"
    );
    assert_eq!(charges(addr, user).await, (1, 1), "one charge, one run");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn graceful_stop_with_the_client_gone_charges_once() {
    stopped_gracefully_between_charge_and_record(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn graceful_stop_with_the_client_waiting_charges_once() {
    stopped_gracefully_between_charge_and_record(true).await;
}

/// A deploy's SIGTERM with clients attached and one checkout that outlives the shutdown deadline
/// (`SHUTDOWN_GRACE_SECS`): the graceful phase is cut short at the deadline, one deadline for it
/// and the drain together. Every checkout that finished before the deadline answered and is
/// recorded (the retry after the restart replays it); the one cut off was never charged, and its
/// key is retaken after the TTL and runs once. Nothing runs twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigterm_with_clients_attached_keeps_one_deadline_and_runs_nothing_twice() {
    let (schema, pool) = schema_pool().await;
    const GRACE: Duration = Duration::from_secs(3);
    let env = [("SHUTDOWN_GRACE_SECS", "3")];
    let (mut first, addr) = start_example_with(&schema, 2, 0, &env).await;
    let quick = r#"{"amount":100,"latency_ms":800}"#;
    let slow = r#"{"amount":200,"latency_ms":8000}"#;
    let users = ["mia", "noah", "olga", "pia"];
    let mut clients = Vec::new();
    for user in users {
        clients.push(tokio::spawn(async move {
            let patience = Duration::from_secs(60);
            example::request(
                addr,
                "POST",
                "/checkout",
                user,
                Some("t-1"),
                quick,
                patience,
            )
            .await
        }));
    }
    let cut_off = tokio::spawn(async move {
        let patience = Duration::from_secs(60);
        example::request(
            addr,
            "POST",
            "/checkout",
            "quinn",
            Some("t-1"),
            slow,
            patience,
        )
        .await
    });
    // Every checkout is claimed before the signal.
    wait_for(
        &pool,
        &format!("SELECT count(*)::text FROM {schema}.idempotency_records"),
        "5",
    )
    .await;
    let pid = first.id().expect("pid").to_string();
    let signalled = Instant::now();
    let sent = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("kill -TERM");
    assert!(sent.success());
    let exit = tokio::time::timeout(Duration::from_secs(20), first.wait())
        .await
        .expect("the instance exits at its deadline, not with the slow checkout")
        .expect("exit status");
    let stopped_in = signalled.elapsed();
    assert!(exit.success(), "{exit:?}");
    assert!(
        stopped_in >= GRACE - Duration::from_millis(200),
        "the graceful phase waited for its deadline: {stopped_in:?}"
    );
    assert!(
        stopped_in < GRACE + Duration::from_secs(5),
        "one deadline from the signal: {stopped_in:?}"
    );
    for client in clients {
        let answer = client
            .await
            .expect("client")
            .expect("answered before the deadline");
        assert_eq!(answer.status, StatusCode::CREATED, "{answer:?}");
    }
    let cut = cut_off.await.expect("client");
    assert!(cut.is_err(), "cut off at the deadline: {cut:?}");

    let (_second, addr) = start_example_with(&schema, 2, 0, &[]).await;
    for user in users {
        let retry = checkout_req(addr, user, "t-1", quick).await;
        assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
        assert!(retry.replayed(), "recorded before the exit: {retry:?}");
        assert_eq!(
            charges(addr, user).await,
            (1, 1),
            "{user}: one charge, one run"
        );
    }
    // The cut-off checkout's key is held until its TTL passes, then runs once.
    let retry = loop {
        let retry = checkout_req(addr, "quinn", "t-1", slow);
        let retry = tokio::time::timeout(Duration::from_secs(45), retry)
            .await
            .expect("answered");
        if retry.status != StatusCode::CONFLICT {
            break retry;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    assert!(!retry.replayed());
    assert_eq!(charges(addr, "quinn").await.0, 1, "one charge");
}

/// A method the route does not serve reaches the router's own 405, with and without a key: never
/// a key error, never a recorded 405 (the key stays free for the request it is meant for). Every
/// error the layer answers carries a documentation `type`, an `instance` and `retryable`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_unserved_method_gets_the_routers_405_untouched() {
    let served = serve_memory(0).await;
    let addr = served.addr;
    let body = r#"{"amount":300}"#;
    let no_key = http(addr, "PATCH", "/checkout", "mia", None, body).await;
    assert_eq!(no_key.status, StatusCode::METHOD_NOT_ALLOWED, "{no_key:?}");
    for _ in 0..2 {
        let keyed = http(addr, "PATCH", "/checkout", "mia", Some("m-1"), body).await;
        assert_eq!(keyed.status, StatusCode::METHOD_NOT_ALLOWED, "{keyed:?}");
        assert!(!keyed.replayed(), "a 405 is never recorded: {keyed:?}");
    }
    let charged = checkout_req(addr, "mia", "m-1", body).await;
    assert_eq!(charged.status, StatusCode::CREATED, "{charged:?}");
    assert!(!charged.replayed());
    // The layer's own errors: what a client acts on.
    let missing = http(addr, "POST", "/checkout", "mia", None, body).await;
    let reuse = checkout_req(addr, "mia", "m-1", r#"{"amount":301}"#).await;
    for (answer, code, retryable) in [
        (&missing, "missing_idempotency_key", false),
        (&reuse, "idempotency_key_reuse", false),
    ] {
        let json = answer.json();
        assert_eq!(json["error"], code);
        assert_eq!(json["retryable"], retryable);
        assert!(
            json["type"]
                .as_str()
                .is_some_and(|t| t.starts_with("https://")),
            "{json}"
        );
        assert!(
            json["instance"]
                .as_str()
                .is_some_and(|i| i.starts_with("urn:uuid:")),
            "{json}"
        );
    }
}

/// The example's inspection routes, on both stores: a checkout's state and expiry for its own
/// subject only, 409 for a delete while it runs, 204 then a new key after a delete of a finished
/// one; and with `IDEMPOTENCY_WAIT_MS`, a duplicate gets the replay instead of 409.
/// The example's inspection routes on a server whose checkouts take 400 ms: a checkout's state
/// and expiry for its own subject only, 409 for a delete while it runs, 204 then a new key after a
/// delete of a finished one.
pub(crate) async fn inspection_routes(addr: SocketAddr) {
    let path = "/checkout/idempotency/order-9";
    let none = http(addr, "GET", path, "alice", None, "").await;
    assert_eq!(none.status, StatusCode::NOT_FOUND);
    let body = r#"{"amount":500}"#;
    let first = tokio::spawn(async move { checkout_req(addr, "alice", "order-9", body).await });
    tokio::time::sleep(Duration::from_millis(150)).await;
    let running = http(addr, "GET", path, "alice", None, "").await;
    assert_eq!(running.status, StatusCode::OK);
    assert_eq!(running.json()["state"], "in_progress");
    assert_eq!(running.json()["status"], serde_json::Value::Null);
    let refused = http(addr, "DELETE", path, "alice", None, "").await;
    assert_eq!(refused.status, StatusCode::CONFLICT);
    assert_eq!(first.await.expect("task").status, StatusCode::CREATED);

    let done = http(addr, "GET", path, "alice", None, "").await;
    assert_eq!(done.json()["state"], "completed");
    assert_eq!(done.json()["status"], 201);
    let expires = done.json()["expires_at"]
        .as_str()
        .expect("expires_at")
        .to_owned();
    assert!(expires.ends_with('Z') && expires.len() == 20, "{expires}");
    // Another subject sees nothing of alice's, and cannot delete it.
    let theirs = http(addr, "GET", path, "mallory", None, "").await;
    assert_eq!(theirs.status, StatusCode::NOT_FOUND);
    let theirs = http(addr, "DELETE", path, "mallory", None, "").await;
    assert_eq!(theirs.status, StatusCode::NOT_FOUND);

    let deleted = http(addr, "DELETE", path, "alice", None, "").await;
    assert_eq!(deleted.status, StatusCode::NO_CONTENT);
    let gone = http(addr, "GET", path, "alice", None, "").await;
    assert_eq!(gone.status, StatusCode::NOT_FOUND);
    // The key is new: the same request runs again.
    let again = checkout_req(addr, "alice", "order-9", body).await;
    assert_eq!(again.status, StatusCode::CREATED);
    assert_ne!(again.header("idempotent-replayed"), Some("true"));
    let bad = http(addr, "GET", "/checkout/idempotency/%20", "alice", None, "").await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST);
}

/// What the example shows of what adopters asked for: a refusal before any effect releases its
/// key (the corrected request runs), a route keyed by the body's `request_id`, and replays refused
/// to an account closed since.
pub(crate) async fn what_adopters_asked_for(addr: SocketAddr) {
    let refused = checkout_req(addr, "carol", "fix-1", r#"{"amount":"ten"}"#).await;
    assert_eq!(refused.status, StatusCode::BAD_REQUEST, "{refused:?}");
    assert_eq!(refused.json()["error"], "invalid_amount");
    let corrected = checkout_req(addr, "carol", "fix-1", r#"{"amount":1000}"#).await;
    assert_eq!(corrected.status, StatusCode::CREATED, "{corrected:?}");
    assert_ne!(corrected.header("idempotent-replayed"), Some("true"));

    let by_body = r#"{"request_id":"req-1","amount":250}"#;
    let first = http(addr, "POST", "/v2/checkout", "carol", None, by_body).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    let reordered = r#"{"amount":250,"request_id":"req-1"}"#;
    let again = http(addr, "POST", "/v2/checkout", "carol", None, reordered).await;
    assert_eq!(
        again.header("idempotent-replayed"),
        Some("true"),
        "{again:?}"
    );
    assert_eq!(again.body, first.body);
    let clash = http(
        addr,
        "POST",
        "/v2/checkout",
        "carol",
        Some("req-2"),
        by_body,
    )
    .await;
    assert_eq!(clash.status, StatusCode::BAD_REQUEST, "{clash:?}");
    let keyless = http(
        addr,
        "POST",
        "/v2/checkout",
        "carol",
        None,
        r#"{"amount":1}"#,
    )
    .await;
    assert_eq!(
        keyless.json()["error"],
        "missing_idempotency_key",
        "{keyless:?}"
    );
    assert_eq!(charges(addr, "carol").await.0, 2);

    let closed = http(addr, "POST", "/account/close", "carol", None, "").await;
    assert_eq!(closed.status, StatusCode::NO_CONTENT);
    let replay = checkout_req(addr, "carol", "fix-1", r#"{"amount":1000}"#).await;
    assert_eq!(replay.status, StatusCode::FORBIDDEN, "{replay:?}");
    assert_eq!(replay.json()["error"], "account_closed");
    assert_ne!(replay.header("idempotent-replayed"), Some("true"));
    // Another caller's replays are still sent.
    checkout_req(addr, "dave", "d-1", r#"{"amount":5}"#).await;
    let theirs = checkout_req(addr, "dave", "d-1", r#"{"amount":5}"#).await;
    assert_eq!(
        theirs.header("idempotent-replayed"),
        Some("true"),
        "{theirs:?}"
    );
    assert_eq!(charges(addr, "carol").await.0, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn what_adopters_asked_for_on_memory_and_postgres() {
    let served = serve_memory(0).await;
    what_adopters_asked_for(served.addr).await;
    let served = serve_postgres(0).await;
    what_adopters_asked_for(served.addr).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn inspection_routes_and_the_wait() {
    let served = serve_memory(400).await;
    inspection_routes(served.addr).await;
    let served = serve_postgres(400).await;
    inspection_routes(served.addr).await;

    // With a wait, a duplicate of a checkout in progress gets its replay.
    let waiting = serve_memory_with(400, &[("IDEMPOTENCY_WAIT_MS", "2000".to_owned())]).await;
    let addr = waiting.addr;
    let body = r#"{"amount":700}"#;
    let first = tokio::spawn(async move { checkout_req(addr, "alice", "order-w", body).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let duplicate = checkout_req(addr, "alice", "order-w", body).await;
    let first = first.await.expect("task");
    assert_eq!(duplicate.status, StatusCode::CREATED);
    assert_eq!(duplicate.header("idempotent-replayed"), Some("true"));
    assert_eq!(duplicate.body, first.body);
    assert!(duplicate.header("idempotency-expires").is_some());
}

// ---- the same scenarios on MySQL (feature `mysql`) ----

#[cfg(feature = "mysql")]
pub(crate) mod mysql {
    use super::*;
    use sqlx::mysql::{MySqlPool, MySqlPoolOptions};

    /// A fresh database, its URL, and a pool on it; databases earlier runs left are dropped after
    /// an hour.
    pub(crate) async fn database() -> (String, MySqlPool) {
        let server = common::servers::mysql_url();
        let admin = MySqlPool::connect(&server).await.expect("MySQL");
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_secs();
        let stale: Vec<(String,)> = sqlx::query_as(
            "SELECT CAST(schema_name AS CHAR) FROM information_schema.schemata \
             WHERE schema_name LIKE 'idem\\_e2e\\_%'",
        )
        .fetch_all(&admin)
        .await
        .expect("databases");
        for (old,) in stale {
            let made: u64 = old
                .split('_')
                .nth(2)
                .and_then(|s| s.parse().ok())
                .unwrap_or(now);
            if made + 3600 < now {
                let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP DATABASE `{old}`")))
                    .execute(&admin)
                    .await;
            }
        }
        let name = format!("idem_e2e_{now}_{}_{}", std::process::id(), rand_suffix());
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE `{name}`")))
            .execute(&admin)
            .await
            .expect("database");
        let (base, _) = server.rsplit_once('/').expect("a URL with a database");
        let url = format!("{base}/{name}");
        let pool = MySqlPoolOptions::new()
            .max_connections(30)
            .connect(&url)
            .await
            .expect("pool");
        (url, pool)
    }

    /// The example on a MySQL database of its own (it migrates the store and makes its ledger
    /// there).
    async fn serve_mysql(delay_ms: u64) -> Served {
        let (url, _) = database().await;
        serve_url(&url, delay_ms).await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn mysql_duplicates_during_a_slow_checkout() {
        let served = serve_mysql(1500).await;
        duplicates_during_a_slow_checkout(served.addr).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn mysql_outcomes_and_isolation() {
        let served = serve_mysql(0).await;
        outcomes_and_isolation(served.addr).await;
    }

    /// The inspection routes on MySQL: a checkout's state while it runs and once finished, 409
    /// for a delete while it runs, 204 then a new key after a delete of a finished one.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn mysql_inspection_routes() {
        let served = serve_mysql(400).await;
        let addr = served.addr;
        let path = "/checkout/idempotency/order-9";
        let none = http(addr, "GET", path, "alice", None, "").await;
        assert_eq!(none.status, StatusCode::NOT_FOUND);
        let body = r#"{"amount":500}"#;
        let first = tokio::spawn(async move { checkout_req(addr, "alice", "order-9", body).await });
        tokio::time::sleep(Duration::from_millis(150)).await;
        let running = http(addr, "GET", path, "alice", None, "").await;
        assert_eq!(running.json()["state"], "in_progress");
        let refused = http(addr, "DELETE", path, "alice", None, "").await;
        assert_eq!(refused.status, StatusCode::CONFLICT);
        assert_eq!(first.await.expect("task").status, StatusCode::CREATED);
        let done = http(addr, "GET", path, "alice", None, "").await;
        assert_eq!(done.json()["state"], "completed");
        assert_eq!(done.json()["status"], 201);
        let theirs = http(addr, "GET", path, "mallory", None, "").await;
        assert_eq!(theirs.status, StatusCode::NOT_FOUND);
        let deleted = http(addr, "DELETE", path, "alice", None, "").await;
        assert_eq!(deleted.status, StatusCode::NO_CONTENT);
        let again = checkout_req(addr, "alice", "order-9", body).await;
        assert_eq!(again.status, StatusCode::CREATED);
        assert!(!again.replayed());
        assert_eq!(charges(addr, "alice").await, (2, 2));
    }

    /// The example process killed after the charge was written in the layer's transaction, before
    /// the commit: the charge rolls back with the process's connection, the record is retaken
    /// after the TTL, and the retaker charges once; the provider is paid once across both runs.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn mysql_transactional_checkout_killed_before_the_commit_charges_once() {
        let (url, pool) = database().await;
        let body = r#"{"amount":700}"#;
        const TTL: Duration = Duration::from_secs(4);
        let env = |hold: &str| {
            vec![
                (
                    "IDEMPOTENCY_IN_PROGRESS_TTL_SECS",
                    TTL.as_secs().to_string(),
                ),
                ("CHECKOUT_HOLD_MS", hold.to_owned()),
                ("CHECKOUT_TRANSACTIONAL", "1".to_owned()),
            ]
        };
        let (mut first, addr) = example::start_url(url.clone(), &env("20000")).await;
        let in_flight = tokio::spawn(async move {
            try_http(addr, "POST", "/checkout", "hana", Some("tx-1"), body).await
        });
        // The handler ran up to its pause: the attempt and the provider payment are on record.
        let mut paid = false;
        for _ in 0..500 {
            let (n,): (i64,) =
                sqlx::query_as("SELECT COUNT(*) FROM provider_payments WHERE subject = 'hana'")
                    .fetch_one(&pool)
                    .await
                    .unwrap_or((0,));
            if n == 1 {
                paid = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(paid, "the provider was paid");
        tokio::time::sleep(Duration::from_millis(200)).await;
        first.kill().await.expect("kill -9 before the commit");
        let killed_at = Instant::now();
        assert!(in_flight.await.expect("client").is_err());
        let (_second, addr) = example::start_url(url, &env("0")).await;
        let early = checkout_req(addr, "hana", "tx-1", body).await;
        assert_eq!(early.status, StatusCode::CONFLICT, "held until the TTL");
        tokio::time::sleep(TTL.saturating_sub(killed_at.elapsed()) + Duration::from_millis(500))
            .await;
        let retaken = checkout_past_silence(addr, "hana", "tx-1", body, TTL).await;
        assert_eq!(retaken.status, StatusCode::CREATED, "{retaken:?}");
        assert!(checkout_req(addr, "hana", "tx-1", body).await.replayed());
        assert_eq!(charges(addr, "hana").await, (1, 2), "one charge, two runs");
        assert_eq!(provider_payments(addr, "hana").await, 1);
    }
}
