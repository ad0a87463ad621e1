#![cfg(feature = "mysql")]
//! The layer on the MySQL store, against a real MySQL or MariaDB (`MYSQL_URL`; else the local one
//! on 127.0.0.1:3306 if it answers; else a private server this process starts). Every test works
//! on a table of its own, so tests run in parallel and leave each other alone.

use crate::common;
use axum_idempotency::{cache_suite, store_suite};

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::http::StatusCode;
use axum_idempotency::store::{
    ClaimOutcome, Deleted, Finished, IdempotencyStore, ListRequest, MySqlStore, StoredResponse,
};
use axum_idempotency::{Fingerprint, IdempotencyLayer};
use common::{app, post, send};
use sqlx::Connection;
use sqlx::mysql::{MySqlConnection, MySqlPool, MySqlPoolOptions};

pub(crate) fn mysql_url() -> String {
    common::servers::mysql_url()
}

pub(crate) async fn pool(connections: u32) -> MySqlPool {
    MySqlPoolOptions::new()
        .max_connections(connections)
        .acquire_timeout(Duration::from_secs(30))
        .connect(&mysql_url())
        .await
        .expect("MySQL must be running (see .ci/run)")
}

/// A table name no other test uses; tables that earlier runs left behind are dropped after an
/// hour.
pub(crate) async fn fresh_table(pool: &MySqlPool) -> String {
    static COUNTER: AtomicUsize = AtomicUsize::new(0);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs();
    let stale: Vec<(String,)> = sqlx::query_as(
        "SELECT CAST(table_name AS CHAR) FROM information_schema.tables \
         WHERE table_schema = DATABASE() AND table_name LIKE 'idem\\_t\\_%'",
    )
    .fetch_all(pool)
    .await
    .expect("list tables");
    for (old,) in stale {
        let made: u64 = old
            .split('_')
            .nth(2)
            .and_then(|s| s.parse().ok())
            .unwrap_or(now);
        if made + 3600 < now {
            let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP TABLE IF EXISTS `{old}`")))
                .execute(pool)
                .await;
        }
    }
    format!(
        "idem_t_{now}_{}_{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::SeqCst)
    )
}

pub(crate) async fn store() -> MySqlStore {
    let pool = pool(16).await;
    let table = fresh_table(&pool).await;
    let store = MySqlStore::with_table(pool, &table)
        .expect("valid table name")
        .with_timeout(common::SUITE_STORE_TIMEOUT);
    store.migrate().await.expect("migrate");
    store
}

store_suite!(store());
cache_suite!(store(), purged = 5);

/// The claim of `POST /pay` by alice with `key` and `body`: the one helper every store's tests
/// build their claims with.
pub(crate) use axum_idempotency::conformance::app::claim_request;

fn stored(body: &'static [u8]) -> Arc<StoredResponse> {
    Arc::new(StoredResponse::new(
        Finished::Completed,
        201,
        vec![(
            axum::http::header::CONTENT_TYPE,
            axum::http::HeaderValue::from_static("text/plain"),
        )],
        Some(axum::body::Bytes::from_static(body)),
    ))
}

async fn count_rows(pool: &MySqlPool, table: &str) -> i64 {
    let (rows,): (i64,) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT COUNT(*) FROM `{table}`"
    )))
    .fetch_one(pool)
    .await
    .unwrap_or_else(|e| panic!("{table} must still exist: {e}"));
    rows
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn migrate_is_safe_from_many_instances_at_once() {
    let pool = pool(10).await;
    let table = fresh_table(&pool).await;
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..8 {
        let store = MySqlStore::with_table(pool.clone(), &table).expect("table");
        tasks.spawn(async move { store.migrate().await });
    }
    while let Some(result) = tasks.join_next().await {
        result.expect("task").expect("every migrate succeeds");
    }
    // And again, on an existing table, after an index went missing.
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DROP INDEX {table}_subject_idx ON `{table}`"
    )))
    .execute(&pool)
    .await
    .expect("drop an index");
    let store = MySqlStore::with_table(pool.clone(), &table).expect("table");
    store.migrate().await.expect("migrate again");
    let indexes: Vec<(String,)> = sqlx::query_as(
        "SELECT DISTINCT CAST(index_name AS CHAR) FROM information_schema.statistics \
         WHERE table_schema = DATABASE() AND table_name = ? ORDER BY 1",
    )
    .bind(&table)
    .fetch_all(&pool)
    .await
    .expect("indexes");
    let mut names: Vec<&str> = indexes.iter().map(|(n,)| n.as_str()).collect();
    names.sort_unstable();
    assert_eq!(
        names,
        [
            "PRIMARY",
            &format!("{table}_expires_at_idx"),
            &format!("{table}_subject_idx"),
        ],
        "the table's indexes, the missing one made again"
    );
    // Nothing of the application's own migration bookkeeping was touched, and the lock is free.
    let (bookkeeping,): (i64,) = sqlx::query_as(
        "SELECT COUNT(*) FROM information_schema.tables \
         WHERE table_schema = DATABASE() AND table_name LIKE '%sqlx%'",
    )
    .fetch_one(&pool)
    .await
    .expect("count");
    assert_eq!(bookkeeping, 0);
    let (free,): (Option<i64>,) = sqlx::query_as("SELECT IS_FREE_LOCK(?)")
        .bind(format!("{table}_migrate"))
        .fetch_one(&pool)
        .await
        .expect("lock");
    assert_eq!(free, Some(1), "the migration lock was released");
}

#[tokio::test]
async fn table_names_are_validated() {
    let pool = MySqlPoolOptions::new()
        .connect_lazy(&mysql_url())
        .expect("lazy pool");
    for bad in [
        "",
        "Records",
        "1records",
        "records; DROP TABLE x",
        "a.b.c",
        "rec-ords",
        "`records`",
        &"r".repeat(41),
    ] {
        assert!(
            MySqlStore::with_table(pool.clone(), bad).is_err(),
            "{bad:?}"
        );
    }
    assert!(MySqlStore::with_table(pool.clone(), "billing.idempotency_v2").is_ok());
    assert!(MySqlStore::with_table(pool, "order").is_ok(), "quoted");
}

#[tokio::test]
async fn unreachable_database_is_503_and_runs_nothing() {
    // Nothing listens on port 1: every connection attempt is refused.
    let pool = MySqlPoolOptions::new()
        .acquire_timeout(Duration::from_secs(2))
        .connect_lazy("mysql://root@127.0.0.1:1/test")
        .expect("lazy pool");
    let (router, counters) =
        app(IdempotencyLayer::new(MySqlStore::new(pool)).expect("valid settings"));
    let answer = send(&router, post("/pay").key("k").user("alice").json("{}")).await;
    assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(answer.problem(), "idempotency_store_unavailable");
    assert_eq!(counters.started(), 0);
}

#[tokio::test]
async fn a_missing_table_is_503_not_a_panic() {
    let pool = pool(2).await;
    let table = fresh_table(&pool).await;
    let store = MySqlStore::with_table(pool, &table).expect("table");
    let (router, counters) = app(IdempotencyLayer::new(store.clone()).expect("valid settings"));
    let answer = send(&router, post("/pay").key("k").user("alice")).await;
    assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(counters.started(), 0);
    assert!(store.purge_expired().await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn records_are_committed_before_the_handler_runs() {
    // While the handler runs, another connection already sees the claim as in progress.
    let store = store().await;
    let (router, counters) = app(IdempotencyLayer::new(store.clone()).expect("valid settings"));
    let slow = tokio::spawn({
        let router = router.clone();
        async move {
            let req = post("/pay").key("k").user("alice");
            send(&router, req.header("x-delay-ms", "800")).await
        }
    });
    let c = counters.clone();
    common::eventually(move || c.started() == 1).await;
    let other = pool(1).await;
    let status = |other: MySqlPool, table: String| async move {
        let (status,): (String,) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT status FROM `{table}` WHERE idempotency_key = 'k'"
        )))
        .fetch_one(&other)
        .await
        .expect("the claim is visible to another connection");
        status
    };
    assert_eq!(
        status(other.clone(), store.table().to_owned()).await,
        "in_progress"
    );
    assert_eq!(slow.await.expect("request").status, StatusCode::CREATED);
    assert_eq!(status(other, store.table().to_owned()).await, "completed");
}

#[tokio::test]
async fn hostile_keys_and_subjects_are_plain_data() {
    // Keys and subjects are written as hexadecimal literals: SQL in them is just bytes.
    let store = store().await;
    let admin = pool(2).await;
    let canary = fresh_table(&admin).await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE `{canary}` (n INT); INSERT INTO `{canary}` VALUES (1)"
    )))
    .execute(&admin)
    .await
    .expect("canary");
    let (router, counters) = app(IdempotencyLayer::new(store.clone()).expect("valid settings"));
    let key = format!("'; DROP TABLE {canary}; -- \\' X'00");
    let user = format!("alice' OR '1'='1'; DROP TABLE `{}`; --", store.table());
    let first = send(&router, post("/pay").key(&key).user(&user).json("{}")).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    let replay = send(&router, post("/pay").key(&key).user(&user).json("{}")).await;
    assert!(replay.replayed(), "{replay:?}");
    let other = send(&router, post("/pay").key(&key).user("alice").json("{}")).await;
    assert_eq!(other.status, StatusCode::CREATED, "{other:?}");
    assert!(!other.replayed());
    assert_eq!(counters.started(), 2);
    assert_eq!(count_rows(&admin, &canary).await, 1);
    assert_eq!(count_rows(&admin, store.table()).await, 2);
    let (subject,): (Vec<u8>,) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT subject FROM `{}` WHERE idempotency_key = ? AND subject <> 'alice'",
        store.table()
    )))
    .bind(key.as_bytes())
    .fetch_one(&admin)
    .await
    .expect("the record");
    assert_eq!(subject, user.as_bytes(), "stored as sent");
}

/// A string of exactly `len` bytes that does not compress: random characters, one, two and
/// three bytes long, NUL and non-ASCII among them.
fn incompressible(len: usize, seed: u64) -> String {
    let mut state = seed;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut out = String::with_capacity(len);
    while out.len() < len {
        let left = len - out.len();
        let c = match next() % 4 {
            _ if left < 3 => char::from((next() % 128) as u8),
            0 => '\0',
            1 => char::from_u32(0x80 + (next() % 0x700) as u32).unwrap_or('é'),
            2 => char::from_u32(0x4e00 + (next() % 0x5000) as u32).unwrap_or('漢'),
            _ => char::from((next() % 128) as u8),
        };
        out.push(c);
    }
    assert_eq!(out.len(), len);
    out
}

/// The longest scope the layer lets through, incompressible, with NUL and non-ASCII bytes, is
/// stored whole: claimed, completed, replayed, looked up, listed and counted; the columns hold its
/// bytes exactly; and a subject that differs in one byte is another.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_longest_scopes_are_stored_whole() {
    let store = store().await;
    let subject = incompressible(1024, 7);
    let endpoint = incompressible(4096, 11);
    assert!(subject.contains('\0') && !subject.is_ascii());
    let mut request = claim_request("long", b"{}");
    request.key.subject = subject.clone();
    request.key.endpoint = endpoint.clone();
    let ClaimOutcome::Claimed { lease, .. } = store.claim(&request).await.expect("claim") else {
        panic!("a fresh key is claimed");
    };
    let done = store
        .complete(
            &request.key,
            lease,
            &request.fingerprint,
            stored(b"whole"),
            Duration::from_secs(60),
        )
        .await
        .expect("complete");
    assert!(done.is_done());
    let mut again = claim_request("long", b"{}");
    again.key = request.key.clone();
    let ClaimOutcome::Finished(replay) = store.claim(&again).await.expect("claim") else {
        panic!("a replay");
    };
    assert_eq!(&replay.body[..], b"whole");
    assert!(store.lookup(&request.key).await.expect("lookup").is_some());
    let page = store
        .list(&subject, ListRequest::first(10))
        .await
        .expect("list");
    assert_eq!(page.records.len(), 1);
    assert_eq!(page.records[0].endpoint, endpoint);
    assert_eq!(
        store
            .count_records(&subject, 10)
            .await
            .expect("count")
            .map(|usage| usage.records),
        Some(1)
    );
    let admin = pool(1).await;
    let (stored_subject, stored_endpoint): (Vec<u8>, Vec<u8>) =
        sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT subject, endpoint FROM `{}` WHERE idempotency_key = 'long'",
            store.table()
        )))
        .fetch_one(&admin)
        .await
        .expect("the row");
    assert_eq!(stored_subject, subject.as_bytes());
    assert_eq!(stored_endpoint, endpoint.as_bytes());
    // One byte apart (its last character, ASCII), another subject: a fresh key.
    let mut near = subject.into_bytes();
    let last = near.len() - 1;
    near[last] = if near[last] == b'a' { b'b' } else { b'a' };
    let mut other = claim_request("long", b"{}");
    other.key.subject = String::from_utf8(near).expect("utf-8");
    other.key.endpoint = endpoint;
    let outcome = store.claim(&other).await.expect("claim");
    assert!(
        matches!(outcome, ClaimOutcome::Claimed { generation, .. } if generation == Some(other.generation)),
        "{outcome:?}"
    );
}

/// A mark as the store writes it, made by this server as long ago as it counts: an hour ago, or
/// two seconds after the server started if that is later (a mark from before its start counts for
/// nothing).
const MARKED_LONG_AGO: &str = "suspected_on = CONCAT(@@hostname, ':', @@port, ':', \
       @@server_id), suspected_at = UTC_TIMESTAMP(6) - INTERVAL LEAST(3600, UNIX_TIMESTAMP() \
       - ((UUID_SHORT() >> 24) & 4294967295) - 2) SECOND";

/// Many tasks on real connections claim one key at once, round after round: a fresh key, then the
/// same record once it is stale, then once it is released. Every round grants it exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn claim_races_on_real_connections_have_one_winner() {
    const TASKS: usize = 12;
    const ROUNDS: usize = 10;
    let store = store().await;
    let admin = pool(1).await;
    for round in 0..ROUNDS {
        let key = format!("race-{round}");
        // Fresh, stale (its holder stopped renewing, and a claim found it so long ago: see
        // `MARKED_LONG_AGO`), released: each raced by every task.
        for phase in ["fresh", "stale", "released"] {
            match phase {
                "stale" => {
                    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                        "UPDATE `{}` SET {MARKED_LONG_AGO}, \
                           updated_at = updated_at - INTERVAL 1 HOUR \
                         WHERE idempotency_key = '{key}'",
                        store.table()
                    )))
                    .execute(&admin)
                    .await
                    .expect("age the record");
                }
                "released" => {
                    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                        "UPDATE `{}` SET lease_token = 0 WHERE idempotency_key = '{key}'",
                        store.table()
                    )))
                    .execute(&admin)
                    .await
                    .expect("release the record");
                }
                _ => {}
            }
            let gate = Arc::new(tokio::sync::Barrier::new(TASKS));
            let mut tasks = tokio::task::JoinSet::new();
            for claim in (0..TASKS).map(|_| claim_request(&key, b"{}")) {
                let (store, gate) = (store.clone(), gate.clone());
                tasks.spawn(async move {
                    gate.wait().await;
                    let outcome = store.claim(&claim).await.expect("claim");
                    (claim, outcome)
                });
            }
            let mut winners = 0;
            while let Some(done) = tasks.join_next().await {
                let (claim, outcome) = done.expect("task");
                match outcome {
                    ClaimOutcome::Claimed { lease, .. } => {
                        assert_eq!(lease, claim.lease);
                        winners += 1;
                    }
                    ClaimOutcome::InProgress => {}
                    other => panic!("round {round}, {phase}: {other:?}"),
                }
            }
            assert_eq!(winners, 1, "round {round}, {phase}: exactly one claim wins");
        }
    }
}

/// What a claim answers when it meets a row that another transaction inserted and has not
/// committed yet: its insert waits on that row, and once the row is committed the claim must read
/// it, although the claim's session is at REPEATABLE READ. `row` is the other transaction's record:
/// (fingerprint body, response).
async fn claim_racing_an_uncommitted_insert(
    row_body: &[u8],
    response: Option<(i16, &[u8])>,
) -> ClaimOutcome {
    // A timeout long enough that the claim is seen waiting before the server gives up.
    let store = store().await.with_timeout(Duration::from_secs(10));
    let request = claim_request("race", b"{}");
    let mut other = MySqlConnection::connect(&mysql_url()).await.expect("MySQL");
    let mut tx = other.begin().await.expect("begin");
    let key = &request.key;
    let headers: Vec<u8> = [
        &1_u32.to_be_bytes()[..],
        &12_u32.to_be_bytes(),
        b"content-type",
        &10_u32.to_be_bytes(),
        b"text/plain",
    ]
    .concat();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO `{}` (scope, idempotency_key, subject, subject_digest, endpoint, \
           fingerprint, status, lease_token, in_progress_ttl_us, response_status, \
           response_headers, response_body, created_at, updated_at, expires_at) \
         VALUES (?, ?, ?, UNHEX(SHA2(?, 256)), ?, ?, ?, 42, 60000000, ?, ?, ?, \
           UTC_TIMESTAMP(6), UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) + INTERVAL 1 HOUR)",
        store.table()
    )))
    .bind(&key.digest()[..])
    .bind(&key.key)
    .bind(&key.subject)
    .bind(&key.subject)
    .bind(&key.endpoint)
    .bind(&Fingerprint::of(None, row_body).as_bytes()[..])
    .bind(if response.is_some() {
        "completed"
    } else {
        "in_progress"
    })
    .bind(response.map(|(status, _)| status))
    .bind(response.map(|_| headers))
    .bind(response.map(|(_, body)| body.to_vec()))
    .execute(&mut *tx)
    .await
    .expect("insert a record");
    let claim = tokio::spawn({
        let (store, request) = (store.clone(), request.clone());
        async move { store.claim(&request).await }
    });
    // Wait until the claim's insert waits on the uncommitted row (the only way it stays in its
    // `update` state, or `sending data` for an insert of rows a query selects, for more than an
    // instant).
    let watcher = pool(1).await;
    let mut blocked = false;
    for _ in 0..200 {
        // The process list, not `innodb_trx`: MariaDB refreshes that one only once nobody has read
        // it for 0.1 s, which concurrent tests polling it never leave.
        let waiting: Vec<(Option<String>,)> = sqlx::query_as(
            "SELECT CAST(info AS CHAR) FROM information_schema.processlist \
             WHERE LOWER(state) IN ('update', 'sending data')",
        )
        .fetch_all(&watcher)
        .await
        .expect("innodb_trx");
        if waiting
            .iter()
            .any(|(query,)| query.as_deref().is_some_and(|q| q.contains(store.table())))
        {
            blocked = true;
            break;
        }
        assert!(!claim.is_finished(), "the claim did not wait: {claim:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(blocked, "the claim never waited on the uncommitted row");
    tx.commit().await.expect("commit");
    tokio::time::timeout(Duration::from_secs(10), claim)
        .await
        .expect("the claim finishes once the row is committed")
        .expect("task")
        .expect("the claim succeeds")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_claim_that_loses_the_race_to_a_completed_record_replays_it() {
    let outcome = claim_racing_an_uncommitted_insert(b"{}", Some((201, b"charged"))).await;
    let ClaimOutcome::Finished(stored) = outcome else {
        panic!("expected a replay, got {outcome:?}");
    };
    assert_eq!((stored.status, &stored.body[..]), (201, &b"charged"[..]));
    assert_eq!(stored.headers.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_claim_that_loses_the_race_to_a_claim_in_progress_is_in_progress() {
    let outcome = claim_racing_an_uncommitted_insert(b"{}", None).await;
    assert_eq!(outcome, ClaimOutcome::InProgress);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_claim_that_loses_the_race_to_another_fingerprint_is_a_mismatch() {
    let outcome = claim_racing_an_uncommitted_insert(b"{\"other\":1}", None).await;
    assert_eq!(outcome, ClaimOutcome::KeyReuse);
}

/// A row lock held elsewhere (a handler's transaction that froze, an operator's session): the
/// claim's wait is bounded on the server, the record is in progress in another transaction's hands
/// (409, the retry settles it), and the handler does not run; once the lock is let go, the request
/// runs, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lock_wait_is_409_and_never_a_second_run() {
    let store = store().await;
    let (router, counters) = app(IdempotencyLayer::new(store.clone()).expect("valid settings"));
    let req = || post("/pay").key("locked").user("alice").json("{}");
    // A record in progress whose holder died, locked by another session.
    let mut claim = claim_request("locked", b"{}");
    claim.in_progress_ttl = Duration::from_millis(200);
    let mut admin = MySqlConnection::connect(&mysql_url()).await.expect("MySQL");
    let ClaimOutcome::Claimed { lease, .. } = store.claim(&claim).await.expect("claim") else {
        panic!("claimed");
    };
    assert!(
        store
            .release(&claim.key, lease)
            .await
            .expect("release")
            .is_done()
    );
    let mut tx = admin.begin().await.expect("begin");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "SELECT * FROM `{}` FOR UPDATE",
        store.table()
    )))
    .execute(&mut *tx)
    .await
    .expect("lock the row");
    let refused = send(&router, req()).await;
    assert_eq!(refused.status, StatusCode::CONFLICT, "{refused:?}");
    assert_eq!(counters.started(), 0);
    tx.rollback().await.expect("let go");
    let charged = common::until_not_in_progress(&router, req, 100).await;
    assert_eq!(charged.status, StatusCode::CREATED, "{charged:?}");
    let replay = send(&router, req()).await;
    assert!(replay.replayed());
    assert_eq!(counters.started(), 1);
}

/// The server's errors as the store answers them, raised by a trigger exactly as the server sends
/// them: a deadlock (1213) and a lock wait timeout (1205) are retryable `503`s that run nothing; a
/// full table (1114) is `503 idempotency_store_full`. Once the error is gone, the request runs
/// once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn deadlocks_and_full_tables_are_errors_and_never_a_second_run() {
    let store = store().await;
    let admin = pool(1).await;
    let (router, counters) = app(IdempotencyLayer::new(store.clone()).expect("valid settings"));
    for (number, problem) in [
        (1213, "idempotency_store_unavailable"),
        (1205, "idempotency_store_unavailable"),
        (1114, "idempotency_store_full"),
    ] {
        let trigger = format!("{}_refuse", store.table());
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "CREATE TRIGGER `{trigger}` BEFORE INSERT ON `{}` FOR EACH ROW \
             SIGNAL SQLSTATE 'HY000' SET MESSAGE_TEXT = 'refused', MYSQL_ERRNO = {number}",
            store.table()
        )))
        .execute(&admin)
        .await
        .expect("trigger");
        let key = format!("e{number}");
        let req = || post("/pay").key(&key).user("alice").json("{}");
        let refused = send(&router, req()).await;
        assert_eq!(
            refused.status,
            StatusCode::SERVICE_UNAVAILABLE,
            "{refused:?}"
        );
        assert_eq!(refused.problem(), problem, "{number}");
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP TRIGGER `{trigger}`")))
            .execute(&admin)
            .await
            .expect("drop trigger");
        let charged = common::until_not_in_progress(&router, req, 100).await;
        assert_eq!(charged.status, StatusCode::CREATED, "{charged:?}");
        assert!(send(&router, req()).await.replayed());
    }
    assert_eq!(counters.started(), 3, "one run per key");
}

/// Inspection's delete leaves a record in progress alone, and a listing pages by creation.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn delete_spares_a_record_in_progress() {
    let store = store().await;
    let claim = claim_request("held", b"{}");
    let ClaimOutcome::Claimed { lease, .. } = store.claim(&claim).await.expect("claim") else {
        panic!("claimed");
    };
    assert_eq!(
        store.delete(&claim.key).await.expect("delete"),
        Deleted::InProgress
    );
    assert!(
        store
            .complete(
                &claim.key,
                lease,
                &claim.fingerprint,
                stored(b"x"),
                Duration::from_secs(60)
            )
            .await
            .expect("complete")
            .is_done()
    );
    assert_eq!(
        store.delete(&claim.key).await.expect("delete"),
        Deleted::Deleted
    );
    assert_eq!(
        store.delete(&claim.key).await.expect("delete"),
        Deleted::NotFound
    );
}

/// A pool whose connections start with `autocommit = 0` (set by the application, or the server's
/// `init_connect`): every statement of the store still commits on its own, so a claim is seen by
/// other connections at once, and the session gets its own value back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_without_autocommit_still_commits_every_claim() {
    let plain = pool(2).await;
    let table = fresh_table(&plain).await;
    MySqlStore::with_table(plain.clone(), &table)
        .expect("table")
        .migrate()
        .await
        .expect("migrate");
    let manual = MySqlPoolOptions::new()
        .max_connections(1)
        .after_connect(|conn, _| {
            Box::pin(async move {
                sqlx::raw_sql("SET autocommit = 0")
                    .execute(&mut *conn)
                    .await?;
                Ok(())
            })
        })
        .connect(&mysql_url())
        .await
        .expect("connect");
    let store = MySqlStore::with_table(manual.clone(), &table)
        .expect("table")
        .with_timeout(Duration::from_secs(2));
    let first = claim_request("manual", b"{}");
    assert!(
        matches!(
            store.claim(&first).await.expect("claim"),
            ClaimOutcome::Claimed { .. }
        ),
        "the claim is made"
    );
    assert_eq!(
        count_rows(&plain, &table).await,
        1,
        "seen by another connection"
    );
    let other = MySqlStore::with_table(plain.clone(), &table)
        .expect("table")
        .with_timeout(Duration::from_secs(2));
    assert_eq!(
        other
            .claim(&claim_request("manual", b"{}"))
            .await
            .expect("claim"),
        ClaimOutcome::InProgress,
        "another instance finds it in progress, without waiting on its row"
    );
    // The session keeps the value it had.
    let (autocommit,): (i64,) = sqlx::query_as("SELECT @@session.autocommit")
        .fetch_one(&manual)
        .await
        .expect("read");
    assert_eq!(autocommit, 0);
}

/// A subject's bytes are read from `body_bytes`, the length the server keeps with each row
/// (`migrations/mysql/0002`), and counted the same from the bodies on a table not migrated since,
/// until `migrate()` adds the column back.
#[tokio::test]
async fn bytes_are_counted_from_the_kept_length_and_without_it() {
    let pool = pool(4).await;
    let table = fresh_table(&pool).await;
    let store = MySqlStore::with_table(pool.clone(), &table)
        .expect("valid table name")
        .with_timeout(common::SUITE_STORE_TIMEOUT);
    store.migrate().await.expect("migrate");
    for (i, body) in [&b"12345"[..], &[b'x'; 70_000][..]].into_iter().enumerate() {
        let request = claim_request(&format!("k{i}"), b"{}");
        let ClaimOutcome::Claimed { lease, .. } = store.claim(&request).await.expect("claim")
        else {
            panic!("claimed");
        };
        let mut response = (*stored(b"")).clone();
        response.body = axum::body::Bytes::copy_from_slice(body);
        let done = store
            .complete(
                &request.key,
                lease,
                &request.fingerprint,
                Arc::new(response),
                request.retention,
            )
            .await
            .expect("complete");
        assert_eq!(done, axum_idempotency::store::Fenced::Done);
    }
    let counted = |store: MySqlStore| async move {
        store
            .count_records("alice", 100)
            .await
            .expect("count")
            .expect("counted")
    };
    let kept: (i64,) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT CAST(SUM(body_bytes) AS SIGNED) FROM `{table}`"
    )))
    .fetch_one(&pool)
    .await
    .expect("the column is there");
    assert_eq!(kept.0, 70_005);
    assert_eq!(counted(store.clone()).await.bytes, 70_005);
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "ALTER TABLE `{table}` DROP COLUMN body_bytes"
    )))
    .execute(&pool)
    .await
    .expect("drop the column");
    let usage = counted(store.clone()).await;
    assert_eq!(
        (usage.records, usage.bytes),
        (2, 70_005),
        "read from the bodies"
    );
    store.migrate().await.expect("migrate again");
    assert_eq!(counted(store).await.bytes, 70_005, "the column back");
}

/// The suite again with every claim and completion sent through the batch statements (SPEC 26),
/// each batch held until it has four rows or 5 ms passed: the statements that carry many keep
/// every promise the single ones keep.
mod batched {
    use super::*;
    use axum_idempotency::store::{ClaimRequest, LeaseToken, RecordKey};

    store_suite!(async { store().await.with_batches_held(4) });

    /// Another session holding `key`'s record locked, as a handler's transaction does: its row
    /// alone (READ COMMITTED, so no gap of the index), until [`let_go`].
    async fn hold_row(store: &MySqlStore, key: &RecordKey) -> MySqlConnection {
        let mut held = MySqlConnection::connect(&mysql_url()).await.expect("MySQL");
        sqlx::raw_sql("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
            .execute(&mut held)
            .await
            .expect("read committed");
        sqlx::raw_sql("BEGIN")
            .execute(&mut held)
            .await
            .expect("begin");
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT * FROM `{}` WHERE scope = ? FOR UPDATE",
            store.table()
        )))
        .bind(&key.digest()[..])
        .execute(&mut held)
        .await
        .expect("lock the row");
        held
    }

    /// Ends [`hold_row`]'s transaction.
    async fn let_go(held: &mut MySqlConnection) {
        sqlx::raw_sql("ROLLBACK")
            .execute(held)
            .await
            .expect("let go");
    }

    /// A record another session holds locked delays no other claim of its batch: its duplicate is
    /// answered from the record as last committed (in progress) beside seven fresh keys, each
    /// granted, and no batch statement failed (a wait past the lock timeout would have failed it).
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_locked_record_delays_no_other_claim_of_its_batch() {
        let store = store().await.with_batches_held(8);
        let first = claim_request("held", b"{}");
        let ClaimOutcome::Claimed { .. } = store.claim(&first).await.expect("claim") else {
            panic!("the first claim wins");
        };
        let (sent_before, _) = store.batch_counts();
        // The record's row alone, as a handler's transaction holds it (no gap of the index).
        let mut held = hold_row(&store, &first.key).await;
        let mut requests = vec![ClaimRequest {
            lease: LeaseToken::generate(),
            ..first.clone()
        }];
        requests.extend((0..7).map(|k| claim_request(&format!("fresh {k}"), b"{}")));
        let claims: Vec<_> = requests
            .into_iter()
            .map(|request| {
                let store = store.clone();
                tokio::spawn(async move { store.claim(&request).await })
            })
            .collect();
        let mut answers = Vec::new();
        for claim in claims {
            answers.push(claim.await.expect("task").expect("claim"));
        }
        let_go(&mut held).await;
        assert_eq!(answers[0], ClaimOutcome::InProgress, "the held record");
        for answer in &answers[1..] {
            assert!(matches!(answer, ClaimOutcome::Claimed { .. }), "{answer:?}");
        }
        let (sent, failed) = store.batch_counts();
        assert!(sent > sent_before, "the claims went in a batch");
        assert_eq!(failed, 0, "a batch statement failed");
    }

    /// Completions together keep every byte of large answers (a plain hexadecimal literal in the
    /// rows of a `UNION` is cut at 64 KiB by MariaDB), and a record another session holds locked
    /// on a table as small as the batch delays none of them (the batch finds each record by its
    /// key rather than scanning the table).
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn completions_together_keep_large_answers_whole_beside_a_locked_record() {
        let store = store().await.with_batches_held(3);
        let held = claim_request("locked", b"{}");
        let ClaimOutcome::Claimed { .. } = store.claim(&held).await.expect("claim") else {
            panic!("claimed");
        };
        let requests: Vec<_> = (0..3)
            .map(|k| claim_request(&format!("large {k}"), b"{}"))
            .collect();
        let mut leases = Vec::new();
        for request in &requests {
            let ClaimOutcome::Claimed { lease, .. } = store.claim(request).await.expect("claim")
            else {
                panic!("claimed");
            };
            leases.push(lease);
        }
        let mut locked = hold_row(&store, &held.key).await;
        let (sent_before, _) = store.batch_counts();
        let body = |k: usize| -> Vec<u8> {
            (0..70_000 + k * 1_000)
                .map(|i| (i * 31 + k) as u8)
                .collect()
        };
        let completions: Vec<_> = requests
            .iter()
            .zip(&leases)
            .enumerate()
            .map(|(k, (request, lease))| {
                let (store, request, lease) = (store.clone(), request.clone(), *lease);
                let response = Arc::new(StoredResponse::new(
                    Finished::Completed,
                    201,
                    Vec::new(),
                    Some(body(k).into()),
                ));
                tokio::spawn(async move {
                    store
                        .complete(
                            &request.key,
                            lease,
                            &request.fingerprint,
                            response,
                            request.retention,
                        )
                        .await
                })
            })
            .collect();
        for completion in completions {
            let done = completion.await.expect("task").expect("complete");
            assert!(done.is_done(), "a completion together was fenced");
        }
        let_go(&mut locked).await;
        let (sent, failed) = store.batch_counts();
        assert!(sent > sent_before, "the completions went in a batch");
        assert_eq!(failed, 0, "a batch statement failed");
        for (k, request) in requests.iter().enumerate() {
            let again = ClaimRequest {
                lease: LeaseToken::generate(),
                ..request.clone()
            };
            let ClaimOutcome::Finished(stored) = store.claim(&again).await.expect("claim") else {
                panic!("a replay of key {k}");
            };
            assert_eq!(stored.body.len(), body(k).len(), "key {k}'s body length");
            assert!(stored.body[..] == body(k)[..], "key {k}'s body");
        }
    }

    /// A completion whose record another session holds locked, in a batch with two others: the
    /// batch waits a second at most on it, then each completion goes alone, and the two others
    /// are done.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_locked_record_in_a_completion_batch_fails_no_other_completion() {
        let store = store().await.with_batches_held(3);
        let requests: Vec<_> = (0..3)
            .map(|k| claim_request(&format!("complete {k}"), b"{}"))
            .collect();
        let mut leases = Vec::new();
        for request in &requests {
            let ClaimOutcome::Claimed { lease, .. } = store.claim(request).await.expect("claim")
            else {
                panic!("claimed");
            };
            leases.push(lease);
        }
        let mut held = hold_row(&store, &requests[0].key).await;
        let completions: Vec<_> = requests
            .iter()
            .zip(&leases)
            .map(|(request, lease)| {
                let (store, request, lease) = (store.clone(), request.clone(), *lease);
                tokio::spawn(async move {
                    store
                        .complete(
                            &request.key,
                            lease,
                            &request.fingerprint,
                            stored(b"{}"),
                            request.retention,
                        )
                        .await
                })
            })
            .collect();
        let mut answers = Vec::new();
        for completion in completions {
            answers.push(completion.await.expect("task"));
        }
        let_go(&mut held).await;
        for (k, answer) in answers.iter().enumerate().skip(1) {
            assert!(
                answer.as_ref().is_ok_and(|done| done.is_done()),
                "completion {k}: {answer:?}"
            );
        }
    }

    /// A table another session locks (`LOCK TABLES ... WRITE`: every statement on it waits,
    /// reads too) while claims of fresh keys are made alone and in batches: each is refused
    /// within the store's bound as a claim that wrote nothing (so that a layer that fails open
    /// never runs it unguarded), and none is written once the lock goes.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn claims_under_a_table_lock_are_refused_and_never_land_later() {
        for held in [None, Some(8)] {
            let store = match held {
                Some(rows) => store().await.with_batches_held(rows),
                None => store().await,
            };
            let mut locker = MySqlConnection::connect(&mysql_url()).await.expect("MySQL");
            sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                "LOCK TABLES `{}` WRITE",
                store.table()
            )))
            .execute(&mut locker)
            .await
            .expect("lock the table");
            let claims: Vec<_> = (0..8)
                .map(|k| {
                    let store = store.clone();
                    let request = claim_request(&format!("locked {k}"), b"{}");
                    tokio::spawn(async move { store.claim(&request).await })
                })
                .collect();
            for claim in claims {
                match claim.await.expect("task") {
                    Err(e) => assert!(
                        e.is_refused_claim() && !e.may_have_claimed(),
                        "a claim under the table lock ({held:?}): {e}"
                    ),
                    Ok(outcome) => panic!("a claim under the table lock ({held:?}): {outcome:?}"),
                }
            }
            tokio::time::sleep(common::SUITE_STORE_TIMEOUT).await;
            sqlx::raw_sql("UNLOCK TABLES")
                .execute(&mut locker)
                .await
                .expect("unlock");
            tokio::time::sleep(common::SUITE_STORE_TIMEOUT).await;
            let admin = pool(1).await;
            assert_eq!(
                count_rows(&admin, store.table()).await,
                0,
                "a claim landed after its client gave up ({held:?})"
            );
        }
    }

    /// Racing requests, with batches as they come (what queues behind the statements in flight)
    /// and held until they have eight rows: each gets its own answer (see
    /// `racing_requests_each_get_their_own_answer`), and no batch statement failed over to the
    /// single ones.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn racing_requests_in_batches_each_get_their_own_answer() {
        for held in [None, Some(8)] {
            let store = match held {
                Some(rows) => store().await.with_batches_held(rows),
                None => store().await,
            };
            crate::together::racing_requests_each_get_their_own_answer(store.clone()).await;
            let (sent, failed) = store.batch_counts();
            assert!(sent > 0, "no batch statement was sent ({held:?})");
            assert_eq!(
                failed, 0,
                "{failed} of {sent} batch statements failed ({held:?})"
            );
        }
    }
}

/// A table not migrated for steps (made by an earlier version, `migrate()` not run since): showing
/// or recording a step answers at once that the store cannot keep them, the rest of the store
/// works as before, and `migrate()` adds the columns back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_without_the_steps_columns_refuses_steps_at_once() {
    let pool = pool(4).await;
    let table = fresh_table(&pool).await;
    let store = MySqlStore::with_table(pool.clone(), &table)
        .expect("valid table name")
        .with_timeout(common::SUITE_STORE_TIMEOUT);
    store.migrate().await.expect("migrate");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "ALTER TABLE `{table}` DROP COLUMN steps, DROP COLUMN steps_generation"
    )))
    .execute(&pool)
    .await
    .expect("the columns of an earlier version");
    let request = claim_request("unmigrated", b"{}");
    let ClaimOutcome::Claimed { lease, .. } = store.claim(&request).await.expect("claim") else {
        panic!("claimed");
    };
    let shown = store.recorded_steps(&request.key).await;
    assert!(
        shown.as_ref().is_err_and(|e| e.is_unsupported()),
        "{shown:?}"
    );
    let read = store.steps(&request.key, lease).await;
    assert!(read.as_ref().is_err_and(|e| e.is_unsupported()), "{read:?}");
    let step = axum_idempotency::store::RecordedStep {
        name: "reserve".into(),
        result: b"1".to_vec(),
    };
    let write = store.record_step(&request.key, lease, &step).await;
    assert!(
        write.as_ref().is_err_and(|e| e.is_unsupported()),
        "{write:?}"
    );
    let renewed = store
        .renew(&request.key, lease, Duration::from_secs(60))
        .await;
    assert!(renewed.expect("renew").is_done());
    let usage = store.count_records(&request.key.subject, 10).await;
    let usage = usage.expect("counted without the steps");
    assert_eq!(usage.map(|u| u.records), Some(1));
    store.migrate().await.expect("migrate again");
    let written = store.record_step(&request.key, lease, &step).await;
    assert!(written.expect("record").is_done());
    let usage = store.count_records(&request.key.subject, 10).await;
    let usage = usage
        .expect("counted with the steps")
        .expect("the store counts");
    assert!(usage.bytes >= 1, "the step counts once migrated: {usage:?}");
    assert_eq!(
        store
            .recorded_steps(&request.key)
            .await
            .expect("recorded steps"),
        vec![step]
    );
}
