#![cfg(feature = "postgres")]
//! The layer on the Postgres store, against a real PostgreSQL (`DATABASE_URL`, default
//! `postgres://postgres@127.0.0.1:5432/test`). Every test works in a schema of its own, so tests run in
//! parallel and leave each other alone.

use crate::common;
use axum_idempotency::{cache_suite, store_suite};

use std::str::FromStr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::http::StatusCode;
use axum_idempotency::store::{
    ClaimOutcome, ClaimRequest, Finished, IdempotencyStore, LeaseToken, PostgresStore, RecordKey,
};
use axum_idempotency::{Fingerprint, IdempotencyLayer};
use common::{app, post, send};
use sqlx::Connection;
use sqlx::postgres::{PgConnectOptions, PgConnection, PgPool, PgPoolOptions};

pub(crate) fn database_url() -> String {
    common::servers::database_url()
}

pub(crate) async fn pool(connections: u32) -> PgPool {
    PgPoolOptions::new()
        .max_connections(connections)
        .acquire_timeout(Duration::from_secs(30))
        .connect(&database_url())
        .await
        .expect("PostgreSQL must be running (see .ci/run)")
}

/// A schema no other test uses; schemas that earlier runs left behind are dropped after an hour.
pub(crate) async fn fresh_schema(pool: &PgPool) -> String {
    static COUNTER: AtomicUsize = AtomicUsize::new(0);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs();
    let schema = format!(
        "idem_t_{now}_{}_{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::SeqCst)
    );
    let stale: Vec<(String,)> = sqlx::query_as(
        "SELECT nspname::text FROM pg_namespace WHERE nspname LIKE 'idem\\_t\\_%' \
         AND split_part(nspname, '_', 3)::bigint < extract(epoch FROM now()) - 3600",
    )
    .fetch_all(pool)
    .await
    .expect("list schemas");
    for (old,) in stale {
        let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "DROP SCHEMA IF EXISTS {old} CASCADE"
        )))
        .execute(pool)
        .await;
    }
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
        .execute(pool)
        .await
        .expect("create schema");
    schema
}

pub(crate) async fn store() -> PostgresStore {
    let pool = pool(34).await;
    let schema = fresh_schema(&pool).await;
    let store = PostgresStore::with_table(pool, &format!("{schema}.idempotency_records"))
        .expect("valid table name")
        .with_timeout(common::SUITE_STORE_TIMEOUT);
    store.migrate().await.expect("migrate");
    store
}

store_suite!(store());
cache_suite!(store(), purged = 5);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn migrate_is_safe_from_many_instances_at_once() {
    let pool = pool(10).await;
    let schema = fresh_schema(&pool).await;
    let table = format!("{schema}.records");
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..8 {
        let store = PostgresStore::with_table(pool.clone(), &table).expect("table");
        tasks.spawn(async move { store.migrate().await });
    }
    while let Some(result) = tasks.join_next().await {
        result.expect("task").expect("every migrate succeeds");
    }
    // And again, on an existing table.
    let store = PostgresStore::with_table(pool.clone(), &table).expect("table");
    store.migrate().await.expect("migrate again");
    let (indexes,): (i64,) = sqlx::query_as(
        "SELECT count(*) FROM pg_indexes WHERE schemaname = $1 AND indexname = 'records_expires_at_idx'",
    )
    .bind(&schema)
    .fetch_one(&pool)
    .await
    .expect("count");
    assert_eq!(indexes, 1, "the purge index exists");
    // Nothing of the application's own migration bookkeeping was touched.
    let (bookkeeping,): (i64,) = sqlx::query_as(
        "SELECT count(*) FROM pg_tables WHERE schemaname = $1 AND tablename <> 'records'",
    )
    .bind(&schema)
    .fetch_one(&pool)
    .await
    .expect("count");
    assert_eq!(bookkeeping, 0);
}

#[tokio::test]
async fn table_names_are_validated() {
    let pool = PgPoolOptions::new()
        .connect_lazy(&database_url())
        .expect("lazy pool");
    for bad in [
        "",
        "Records",
        "1records",
        "records; DROP TABLE x",
        "a.b.c",
        "rec-ords",
        "\"records\"",
        &"r".repeat(41),
    ] {
        assert!(
            PostgresStore::with_table(pool.clone(), bad).is_err(),
            "{bad:?}"
        );
    }
    assert!(PostgresStore::with_table(pool.clone(), "billing.idempotency_v2").is_ok());
}

#[tokio::test]
async fn unreachable_database_is_503_and_runs_nothing() {
    // Nothing listens on port 1: every connection attempt is refused.
    let pool = PgPoolOptions::new()
        .acquire_timeout(Duration::from_secs(2))
        .connect_lazy("postgres://postgres@127.0.0.1:1/test")
        .expect("lazy pool");
    let (router, counters) =
        app(IdempotencyLayer::new(PostgresStore::new(pool)).expect("valid settings"));
    let answer = send(&router, post("/pay").key("k").user("alice").json("{}")).await;
    assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(answer.problem(), "idempotency_store_unavailable");
    assert!(answer.header("retry-after").is_some());
    assert_eq!(counters.started(), 0);
}

#[tokio::test]
async fn a_missing_table_is_503_not_a_panic() {
    let pool = pool(2).await;
    let schema = fresh_schema(&pool).await;
    let store =
        PostgresStore::with_table(pool, &format!("{schema}.never_migrated")).expect("table");
    let (router, counters) = app(IdempotencyLayer::new(store.clone()).expect("valid settings"));
    let answer = send(&router, post("/pay").key("k").user("alice")).await;
    assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(counters.started(), 0);
    assert!(store.purge_expired().await.is_err());
}

#[tokio::test]
async fn records_are_committed_before_the_handler_runs() {
    // While the handler runs, another connection already sees the claim as in progress.
    let store = store().await;
    let (router, counters) = app(IdempotencyLayer::new(store.clone()).expect("valid settings"));
    let slow = tokio::spawn({
        let router = router.clone();
        async move {
            send(
                &router,
                post("/pay")
                    .key("k")
                    .user("alice")
                    .header("x-delay-ms", "800"),
            )
            .await
        }
    });
    let c = counters.clone();
    common::eventually(move || c.started() == 1).await;
    let other = pool(1).await;
    let (status,): (String,) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT status FROM {} WHERE idempotency_key = 'k'",
        store.table()
    )))
    .fetch_one(&other)
    .await
    .expect("the claim is visible to another connection");
    assert_eq!(status, "in_progress");
    assert_eq!(slow.await.expect("request").status, StatusCode::CREATED);
    let (status,): (String,) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT status FROM {} WHERE idempotency_key = 'k'",
        store.table()
    )))
    .fetch_one(&other)
    .await
    .expect("row");
    assert_eq!(status, "completed");
}

#[tokio::test]
async fn hostile_keys_and_subjects_are_plain_data() {
    // Keys and subjects are bound as parameters: SQL in them is just text. The store's table and a
    // canary table are reached by the same unqualified names as the injected SQL uses, through the
    // search path of the store's own connections, so interpolating a key or a subject into a
    // statement would drop them (or fail the request).
    let admin = pool(2).await;
    let schema = fresh_schema(&admin).await;
    let options = PgConnectOptions::from_str(&database_url())
        .expect("url")
        .options([("search_path", schema.as_str())]);
    let in_schema = PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(30))
        .connect_with(options)
        .await
        .expect("PostgreSQL");
    let store = PostgresStore::new(in_schema);
    assert_eq!(store.table(), "idempotency_records", "unqualified");
    store.migrate().await.expect("migrate");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE {schema}.canary (n int); INSERT INTO {schema}.canary VALUES (1)"
    )))
    .execute(&admin)
    .await
    .expect("canary");
    let (router, counters) = app(IdempotencyLayer::new(store.clone()).expect("valid settings"));
    let key = "'; DROP TABLE idempotency_records; DROP TABLE canary; --";
    let user = "alice' OR '1'='1'; DROP TABLE canary; --";
    let first = send(&router, post("/pay").key(key).user(user).json("{}")).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    let replay = send(&router, post("/pay").key(key).user(user).json("{}")).await;
    assert!(replay.replayed(), "{replay:?}");
    // Another subject with the same key is not matched by the quote trick.
    let other = send(&router, post("/pay").key(key).user("alice").json("{}")).await;
    assert_eq!(other.status, StatusCode::CREATED, "{other:?}");
    assert!(!other.replayed());
    assert_eq!(counters.started(), 2);
    // Both tables are still there, with their rows, and the hostile strings were stored verbatim.
    let count = |table: &str| rows_in(&admin, format!("{schema}.{table}"));
    assert_eq!(count("canary").await, 1);
    assert_eq!(count("idempotency_records").await, 2);
    let subjects: Vec<(String,)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT subject FROM {schema}.idempotency_records WHERE idempotency_key = $1 \
         ORDER BY subject"
    )))
    .bind(key)
    .fetch_all(&admin)
    .await
    .expect("records");
    assert_eq!(
        subjects,
        vec![("alice".to_owned(),), (user.to_owned(),)],
        "the key and subjects are stored as sent"
    );
}

#[tokio::test]
async fn a_shadowing_table_in_an_earlier_schema_changes_nothing() {
    // The store's connections search `shadow` before `real`. `migrate()` made the table in `real`
    // (`shadow` did not exist yet); then a role that may create in `shadow` puts a table of the
    // same name there. Claims, completions and replays must keep to the table `migrate()` made,
    // and the claim function must resolve names in that schema only.
    let admin = pool(2).await;
    let real = fresh_schema(&admin).await;
    let shadow = fresh_schema(&admin).await;
    let run = |sql: String| {
        let admin = admin.clone();
        async move {
            sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
                .execute(&admin)
                .await
                .expect("setup");
        }
    };
    run(format!("DROP SCHEMA {shadow}")).await;
    let options = PgConnectOptions::from_str(&database_url())
        .expect("url")
        .options([("search_path", format!("{shadow},{real}"))]);
    let on_path = PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(30))
        .connect_with(options)
        .await
        .expect("PostgreSQL");
    let store = PostgresStore::new(on_path).with_timeout(common::SUITE_STORE_TIMEOUT);
    store.migrate().await.expect("migrate");
    run(format!(
        "CREATE SCHEMA {shadow}; \
         CREATE TABLE {shadow}.idempotency_records (LIKE {real}.idempotency_records INCLUDING ALL)"
    ))
    .await;
    let function = format!(
        "{real}.idempotency_records_claim_v2(bytea,text,text,text,bytea,bigint,double precision,\
         double precision,bytea)"
    );
    let settings = |admin: PgPool, function: String| async move {
        let (config,): (Option<Vec<String>>,) =
            sqlx::query_as("SELECT proconfig FROM pg_proc WHERE oid = to_regprocedure($1)")
                .bind(function)
                .fetch_one(&admin)
                .await
                .expect("the claim function");
        config.unwrap_or_default()
    };
    let fixed = |config: &[String]| {
        config
            .iter()
            .any(|c| c.starts_with("search_path=pg_catalog,") && c.contains(&real))
    };
    assert!(fixed(&settings(admin.clone(), function.clone()).await));

    let (router, counters) = app(IdempotencyLayer::new(store.clone()).expect("valid settings"));
    for key in ["a", "b", "c"] {
        let first = send(&router, post("/pay").key(key).user("alice").json("{}")).await;
        assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
        let replay = send(&router, post("/pay").key(key).user("alice").json("{}")).await;
        assert!(replay.replayed(), "{replay:?}");
        let other = send(
            &router,
            post("/pay").key(key).user("alice").json(r#"{"n":1}"#),
        )
        .await;
        assert_eq!(other.status, StatusCode::UNPROCESSABLE_ENTITY, "{other:?}");
    }
    assert_eq!(counters.started(), 3);
    assert_eq!(
        rows_in(&admin, format!("{real}.idempotency_records")).await,
        3
    );
    assert_eq!(
        rows_in(&admin, format!("{shadow}.idempotency_records")).await,
        0,
        "nothing reached the shadowing table"
    );

    // Another process migrating now (a restart, a new replica) would find the shadowing table
    // first on its search path: it refuses to start rather than pin it.
    let options = PgConnectOptions::from_str(&database_url())
        .expect("url")
        .options([("search_path", format!("{shadow},{real}"))]);
    let restarted = PostgresStore::new(
        PgPoolOptions::new()
            .max_connections(2)
            .acquire_timeout(Duration::from_secs(30))
            .connect_with(options)
            .await
            .expect("PostgreSQL"),
    );
    let refused = restarted
        .migrate()
        .await
        .expect_err("two tables on the path");
    assert!(
        refused.to_string().contains(&shadow) && refused.to_string().contains(&real),
        "{refused}"
    );

    // A claim function left without a search path (by an earlier version) is fixed by migrate.
    run(format!("ALTER FUNCTION {function} RESET search_path")).await;
    assert!(!fixed(&settings(admin.clone(), function.clone()).await));
    store.migrate().await.expect("migrate again");
    assert!(fixed(&settings(admin.clone(), function.clone()).await));
}

#[tokio::test]
async fn migrate_without_the_privilege_for_the_claim_function_warns_and_claims_still_work() {
    // A role that may write the table but neither create in its schema nor own the function:
    // migrate() must not fail (it warns), and claims work through the fallback statements.
    let admin = pool(2).await;
    let schema = fresh_schema(&admin).await;
    let table = format!("{schema}.idempotency_records");
    let owner = PostgresStore::with_table(admin.clone(), &table).expect("table");
    owner.migrate().await.expect("migrate as the owner");
    let role = format!("{schema}_writer");
    let function = format!(
        "{schema}.idempotency_records_claim_v2(bytea,text,text,text,bytea,bigint,\
         double precision,double precision,bytea)"
    );
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE ROLE {role} LOGIN; GRANT USAGE ON SCHEMA {schema} TO {role}; \
         GRANT SELECT, INSERT, UPDATE, DELETE ON {table} TO {role}; \
         ALTER FUNCTION {function} RESET search_path"
    )))
    .execute(&admin)
    .await
    .expect("a role without privileges on the schema");
    let as_writer = PgConnectOptions::from_str(&database_url())
        .expect("url")
        .username(&role);
    let writer_pool = PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(30))
        .connect_with(as_writer)
        .await
        .expect("connect as the writer");
    let writer = PostgresStore::with_table(writer_pool.clone(), &table)
        .expect("table")
        .with_timeout(common::SUITE_STORE_TIMEOUT);
    // Not the function's owner: its search path cannot be fixed; migrate goes on.
    writer
        .migrate()
        .await
        .expect("migrate without owning the function");
    // No CREATE on the schema: the function cannot be made again; migrate goes on.
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP FUNCTION {function}")))
        .execute(&admin)
        .await
        .expect("drop the function");
    writer.migrate().await.expect("migrate without CREATE");
    let (router, counters) = app(IdempotencyLayer::new(writer).expect("valid settings"));
    let first = send(&router, post("/pay").key("k").user("alice").json("{}")).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    let replay = send(&router, post("/pay").key("k").user("alice").json("{}")).await;
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(counters.started(), 1);
    writer_pool.close().await;
    let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DROP SCHEMA {schema} CASCADE; DROP ROLE {role}"
    )))
    .execute(&admin)
    .await;
}

/// The number of rows in `table`; panics when the table is gone.
async fn rows_in(pool: &PgPool, table: String) -> i64 {
    let (rows,): (i64,) =
        sqlx::query_as(sqlx::AssertSqlSafe(format!("SELECT count(*) FROM {table}")))
            .fetch_one(pool)
            .await
            .unwrap_or_else(|e| panic!("{table} must still exist: {e}"));
    rows
}

/// The claim of `POST /pay` by alice with `key` and `body`: the one helper every store's tests
/// build their claims with.
pub(crate) use axum_idempotency::conformance::app::claim_request;

/// Writes a record into `table` the way the store lays it out (migrations/0001): `in_progress`, or
/// `completed` with `response` (status, body). Every row this file writes by hand is written here.
async fn insert_record(
    conn: &mut PgConnection,
    table: &str,
    key: &RecordKey,
    fingerprint: &Fingerprint,
    response: Option<(i16, &[u8])>,
) {
    let status = if response.is_some() {
        "completed"
    } else {
        "in_progress"
    };
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {table} (scope, idempotency_key, subject, endpoint, fingerprint, status, \
           lease_token, response_status, header_names, header_values, response_body, expires_at) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, now() + interval '1 hour')"
    )))
    .bind(&key.digest()[..])
    .bind(&key.key)
    .bind(&key.subject)
    .bind(&key.endpoint)
    .bind(&fingerprint.as_bytes()[..])
    .bind(status)
    .bind(42_i64)
    .bind(response.map(|(status, _)| status))
    .bind(response.map(|_| vec!["content-type".to_owned()]))
    .bind(response.map(|_| vec![b"text/plain".to_vec()]))
    .bind(response.map(|(_, body)| body.to_vec()))
    .execute(conn)
    .await
    .expect("insert a record");
}

/// What a claim answers when it meets a conflicting row that another transaction inserted but had
/// not committed yet: the claim's INSERT waits on that row, and once it is committed the read half
/// of the claim statement (whose snapshot predates the commit) sees nothing, so the store must
/// issue the statement again. `row` is the other transaction's record: (fingerprint body, response).
async fn claim_racing_an_uncommitted_insert(
    row_body: &[u8],
    response: Option<(i16, &[u8])>,
) -> ClaimOutcome {
    let store = store().await;
    let request = claim_request("race", b"{}");
    let mut other = PgConnection::connect(&database_url())
        .await
        .expect("PostgreSQL");
    let mut tx = other.begin().await.expect("begin");
    insert_record(
        &mut tx,
        store.table(),
        &request.key,
        &Fingerprint::of(None, row_body),
        response,
    )
    .await;
    let claim = tokio::spawn({
        let (store, request) = (store.clone(), request.clone());
        async move { store.claim(&request).await }
    });
    // Wait until the claim's INSERT is blocked on the uncommitted row.
    let watcher = pool(1).await;
    let mut blocked = false;
    for _ in 0..200 {
        let (waiting,): (i64,) = sqlx::query_as(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' \
             AND datname = current_database() AND position($1 IN query) > 0",
        )
        // The statement names the table quoted ("schema"."table"): look for its schema.
        .bind(store.table().split('.').next().unwrap_or_default())
        .fetch_one(&watcher)
        .await
        .expect("pg_stat_activity");
        if waiting > 0 {
            blocked = true;
            break;
        }
        assert!(!claim.is_finished(), "the claim did not wait: {claim:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(blocked, "the claim never waited on the uncommitted row");
    assert!(!claim.is_finished());
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
    assert_eq!(stored.outcome, Finished::Completed);
    assert_eq!(stored.status, 201);
    assert_eq!(&stored.body[..], b"charged");
    assert_eq!(
        stored.headers,
        vec![(
            axum::http::header::CONTENT_TYPE,
            axum::http::HeaderValue::from_static("text/plain")
        )]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_claim_that_loses_the_race_to_a_claim_in_progress_is_in_progress() {
    let outcome = claim_racing_an_uncommitted_insert(b"{}", None).await;
    assert_eq!(outcome, ClaimOutcome::InProgress);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_claim_that_loses_the_race_to_another_fingerprint_is_a_mismatch() {
    let outcome =
        claim_racing_an_uncommitted_insert(b"{\"amount\":2}", Some((201, b"charged"))).await;
    assert_eq!(outcome, ClaimOutcome::KeyReuse);
}

/// Once the table and its index exist, `migrate()` takes no lock on the table: an instance that
/// starts while a write is open neither waits for it nor blocks other writes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn migrate_again_does_not_lock_the_table() {
    let store = store().await;
    let mut writer = store.pool().begin().await.expect("begin");
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE {} SET lease_token = lease_token",
        store.table()
    )))
    .execute(&mut *writer)
    .await
    .expect("an open write");
    tokio::time::timeout(Duration::from_secs(3), store.migrate())
        .await
        .expect("migrate does not wait for the open write")
        .expect("migrate");
    writer.rollback().await.expect("rollback");
}

/// A heartbeat that lands between a claim's read of a stale record and its compare-and-swap wins:
/// the retake rechecks staleness against the newest row, so a live holder is not retaken. Made
/// deterministic with the renewal held uncommitted while the retake waits on its row lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_renewal_between_read_and_retake_keeps_the_holder() {
    let store = store().await;
    let mut holder = claim_request("renewed", b"{}");
    holder.in_progress_ttl = Duration::from_millis(300);
    assert!(matches!(
        store.claim(&holder).await.expect("claim"),
        ClaimOutcome::Claimed { .. }
    ));
    tokio::time::sleep(Duration::from_millis(400)).await; // stale now
    // The holder's renewal, begun but not committed: it holds the row.
    let mut other = PgConnection::connect(&database_url())
        .await
        .expect("PostgreSQL");
    let mut tx = other.begin().await.expect("begin");
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE {} SET updated_at = now() WHERE scope = $1 AND lease_token = $2",
        store.table()
    )))
    .bind(&holder.key.digest()[..])
    .bind(holder.lease.0)
    .execute(&mut *tx)
    .await
    .expect("renew");
    let mut retaker = claim_request("renewed", b"{}");
    retaker.in_progress_ttl = Duration::from_millis(300);
    let claim = tokio::spawn({
        let store = store.clone();
        async move { store.claim(&retaker).await }
    });
    // The claim read the row as stale; its compare-and-swap now waits on the renewal's lock.
    let watcher = pool(1).await;
    let schema = store
        .table()
        .split('.')
        .next()
        .unwrap_or_default()
        .to_owned();
    let mut blocked = false;
    for _ in 0..200 {
        let (waiting,): (i64,) = sqlx::query_as(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' \
             AND datname = current_database() AND position($1 IN query) > 0",
        )
        .bind(&schema)
        .fetch_one(&watcher)
        .await
        .expect("pg_stat_activity");
        if waiting > 0 {
            blocked = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(blocked, "the retake never waited on the renewal");
    tx.commit().await.expect("commit the renewal");
    let outcome = claim.await.expect("task").expect("claim");
    assert_eq!(
        outcome,
        ClaimOutcome::InProgress,
        "a renewed holder must not be retaken"
    );
    assert!(
        store
            .renew(&holder.key, holder.lease, Duration::from_secs(60))
            .await
            .expect("renew")
            .is_done(),
        "the holder still holds its record"
    );
}

/// A table made before the claim function existed: claims still work (two statements when they
/// race), and `migrate()` adds the function without touching the records.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn claims_work_without_the_claim_function_until_migrate_adds_it() {
    let store = store().await;
    let table = store.table().to_owned();
    let (schema, _) = table.split_once('.').expect("qualified");
    let function = format!("{schema}.idempotency_records_claim_v2");
    let exists = |pool: PgPool, function: String| async move {
        let (present,): (bool,) = sqlx::query_as("SELECT to_regproc($1) IS NOT NULL")
            .bind(function)
            .fetch_one(&pool)
            .await
            .expect("look up");
        present
    };
    assert!(exists(store.pool().clone(), function.clone()).await);
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP FUNCTION {function}")))
        .execute(store.pool())
        .await
        .expect("drop");
    let (router, counters) = app(IdempotencyLayer::new(store.clone()).expect("valid settings"));
    let req = || post("/pay").key("k").user("alice").json("{}");
    assert_eq!(send(&router, req()).await.status, StatusCode::CREATED);
    assert!(send(&router, req()).await.replayed());
    store.migrate().await.expect("migrate");
    assert!(exists(store.pool().clone(), function).await);
    assert!(send(&router, req()).await.replayed());
    let other = send(&router, post("/pay").key("k2").user("alice").json("{}")).await;
    assert_eq!(other.status, StatusCode::CREATED);
    assert_eq!(counters.started(), 2);
}

/// migrations/0001 (the table as the first version made it) on the table `quoted`.
fn first_table_sql(quoted: &str) -> String {
    include_str!("../../migrations/0001_idempotency_records.sql")
        .replace("idempotency_records_expires_at_idx", "\u{0}")
        .replace("idempotency_records", quoted)
        .replace('\u{0}', "\"idempotency_records_expires_at_idx\"")
}

/// A table made by the previous version (migrations 0001 and 0002 only: no generation column)
/// holding a claim of that version whose holder died. `migrate()` adds the column without touching
/// the record; the retake answers no generation, so the handler's derived key is the one the
/// previous version gave the first run (a provider still sees one operation across the upgrade).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn records_of_the_previous_version_keep_their_derived_key_after_migrate() {
    let pool = pool(4).await;
    let schema = fresh_schema(&pool).await;
    let table = format!("{schema}.idempotency_records");
    let quoted = format!("\"{schema}\".\"idempotency_records\"");
    sqlx::raw_sql(sqlx::AssertSqlSafe(first_table_sql(&quoted)))
        .execute(&pool)
        .await
        .expect("the previous version's table");
    let dead = claim_request("old", b"{}");
    // The previous version's claim: no generation column to write.
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {quoted} (scope, idempotency_key, subject, endpoint, fingerprint, status, \
           lease_token, updated_at, expires_at) \
         VALUES ($1, 'old', 'alice', 'POST /pay', $2, 'in_progress', $3, now() - interval '1 hour', \
           now() + interval '1 day')"
    )))
    .bind(&dead.key.digest()[..])
    .bind(&dead.fingerprint.as_bytes()[..])
    .bind(dead.lease.0)
    .execute(&pool)
    .await
    .expect("an old claim");
    let store = PostgresStore::with_table(pool.clone(), &table).expect("table");
    store
        .migrate()
        .await
        .expect("migrate adds the generation column");
    let mut retake = claim_request("old", b"{}");
    retake.key = dead.key.clone();
    // The record keeps no TTL of its holder's: the claimer's decides. The first claim finds its
    // holder silent and marks it; a claim a TTL later takes it.
    retake.in_progress_ttl = Duration::from_millis(300);
    let marked = store.claim(&retake).await.expect("mark");
    assert_eq!(marked, ClaimOutcome::InProgress);
    tokio::time::sleep(Duration::from_millis(400)).await;
    let outcome = store.claim(&retake).await.expect("retake");
    assert!(
        matches!(
            outcome,
            ClaimOutcome::Claimed {
                generation: None,
                ..
            }
        ) && outcome.is_retake(&retake),
        "{outcome:?}"
    );
    // New claims get a generation.
    let fresh = claim_request("new", b"{}");
    assert!(matches!(
        store.claim(&fresh).await.expect("claim"),
        ClaimOutcome::Claimed { generation: Some(g), .. } if g == fresh.generation
    ));
    // The claim function was brought up to migrations/0006 (it reads the holder's TTL), with its
    // search path still fixed to the table's schema; new records keep their holder's TTL, the
    // old one (written without it) none.
    let (current, search_path): (bool, Option<String>) = sqlx::query_as(
        "SELECT strpos(p.prosrc, 'in_progress_ttl_us') > 0, \
                (SELECT c FROM unnest(p.proconfig) c WHERE c LIKE 'search_path=%') \
         FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace \
         WHERE n.nspname = $1 AND p.proname = 'idempotency_records_claim_v2'",
    )
    .bind(&schema)
    .fetch_one(&pool)
    .await
    .expect("the claim function");
    assert!(current, "the claim function reads the holder's TTL");
    assert_eq!(
        search_path.as_deref(),
        Some(format!("search_path=pg_catalog, {schema}, pg_temp").as_str())
    );
    let ttls: Vec<(String, Option<f64>)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT idempotency_key, in_progress_ttl_us FROM {quoted} ORDER BY idempotency_key"
    )))
    .fetch_all(&pool)
    .await
    .expect("records");
    let ttl_us = fresh.in_progress_ttl.as_micros() as f64;
    assert_eq!(
        ttls,
        vec![
            ("new".to_owned(), Some(ttl_us)),
            (
                "old".to_owned(),
                Some(retake.in_progress_ttl.as_micros() as f64)
            )
        ],
        "the retake writes its TTL as the holder's"
    );
}

/// A table of the previous version (0001, 0003 and 0004: no holder's TTL column) that `migrate()`
/// has not reached yet: fresh keys are claimed through the previous claim function, but a claim
/// that would take an existing record (released, here) is refused, never granted or run
/// unguarded; after `migrate()` it is taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_table_without_the_holders_ttl_refuses_retakes_until_migrated() {
    let pool = pool(4).await;
    let schema = fresh_schema(&pool).await;
    let table = format!("{schema}.idempotency_records");
    let quoted = format!("\"{schema}\".\"idempotency_records\"");
    let old_sql = first_table_sql(&quoted);
    // The generation column and the previous version's claim function, its search path fixed.
    let function = format!("\"{schema}\".\"idempotency_records_claim_v2\"");
    let generation_sql = include_str!("../../migrations/0003_idempotency_generation.sql")
        .replace("idempotency_records_claim_v2", "\u{0}")
        .replace("idempotency_records", &quoted)
        .replace('\u{0}', &function);
    let search_path_sql = include_str!("../../migrations/0004_idempotency_claim_search_path.sql")
        .replace("idempotency_records_claim_v2", &function)
        .replace(
            "pg_catalog, public, pg_temp",
            &format!("pg_catalog, \"{schema}\", pg_temp"),
        );
    for sql in [old_sql, generation_sql, search_path_sql] {
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
            .execute(&pool)
            .await
            .expect("the previous version's table");
    }
    let released = claim_request("released", b"{}");
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {quoted} (scope, idempotency_key, subject, endpoint, fingerprint, status, \
           lease_token, updated_at, expires_at) \
         VALUES ($1, 'released', 'alice', 'POST /pay', $2, 'in_progress', 0, '-infinity', \
           now() + interval '1 day')"
    )))
    .bind(&released.key.digest()[..])
    .bind(&released.fingerprint.as_bytes()[..])
    .execute(&pool)
    .await
    .expect("a released record");
    let store = PostgresStore::with_table(pool.clone(), &table).expect("table");
    // Fresh keys go through the previous version's function, which needs no new column.
    let fresh = claim_request("fresh", b"{}");
    assert!(matches!(
        store.claim(&fresh).await.expect("claim"),
        ClaimOutcome::Claimed { .. }
    ));
    let mut again = claim_request("released", b"{}");
    again.key = released.key.clone();
    let refused = store
        .claim(&again)
        .await
        .expect_err("refused before migrate");
    assert!(refused.is_refused_claim(), "{refused:?}");
    store.migrate().await.expect("migrate");
    // The same operation as the released run: its generation (none, written before generations
    // were kept), so a retake.
    let claimed = store.claim(&again).await.expect("claim");
    assert!(claimed.is_retake(&again), "{claimed:?}");
}

/// An operation dropped mid-statement from outside the store (as a heartbeat's bound on its
/// renewal does) gives its connection's place in the pool back at once: sqlx would otherwise ping
/// the connection on its return, with no timeout, and keep it out of the pool until the server
/// finished the statement (here, until its lock timeout; on a stalled database or a connection that
/// died quietly, far longer), so that a few such drops would leave no connection for renewals.
#[tokio::test]
async fn an_operation_dropped_mid_statement_frees_its_place_in_the_pool_at_once() {
    let admin = pool(2).await;
    let schema = fresh_schema(&admin).await;
    let table = format!("{schema}.idempotency_records");
    let one = pool(1).await;
    let store = PostgresStore::with_table(one.clone(), &table)
        .expect("valid table name")
        .with_timeout(Duration::from_secs(10));
    store.migrate().await.expect("migrate");
    let claim = claim_request("dropped-mid-statement", b"{}");
    let outcome = store.claim(&claim).await.expect("claim");
    assert!(
        matches!(outcome, ClaimOutcome::Claimed { .. }),
        "{outcome:?}"
    );

    // Another session holds the record's row: the renewal waits for it (up to the store's lock
    // timeout, 8 s), and its caller gives up first.
    let mut locker = admin.begin().await.expect("begin");
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT 1 FROM {table} FOR UPDATE"
    )))
    .execute(&mut *locker)
    .await
    .expect("lock the row");
    let renewal = store.renew(&claim.key, claim.lease, Duration::from_secs(60));
    let cut = tokio::time::timeout(Duration::from_millis(300), renewal).await;
    assert!(cut.is_err(), "the renewal waited on the row: {cut:?}");

    // The pool's one place is free while the server still runs the dropped statement.
    let again = tokio::time::timeout(Duration::from_secs(3), one.acquire()).await;
    assert!(
        matches!(again, Ok(Ok(_))),
        "a connection is to be had at once: {again:?}"
    );
    locker.rollback().await.expect("rollback");
}

/// The store keeps an operation's connection for the next one, which skips the pings sqlx sends
/// when a connection goes back to the pool and when it is handed out; a kept connection goes back to
/// the pool once idle, and `Pool::close` still completes. Many claims at once on a small pool shared
/// with handlers' transactions leave it able to hand out a connection (at most half is kept).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kept_connections_go_back_to_the_pool_and_let_it_close() {
    let pool = pool(4).await;
    let schema = fresh_schema(&pool).await;
    let store = PostgresStore::with_table(pool.clone(), &format!("{schema}.idempotency_records"))
        .expect("valid table name");
    store.migrate().await.expect("migrate");
    let all_idle = |pool: &PgPool| pool.num_idle() == pool.size() as usize;

    // Kept: some time after an operation, but well within the idle bound, its connection is still
    // out of the pool (a connection given back would be idle again after its ping). Tried a few
    // times, against a machine that stalls longer than the bound now and then.
    let mut seen_kept = false;
    for i in 0..20 {
        let claim = claim_request(&format!("kept-{i}"), b"{}");
        let outcome = store.claim(&claim).await.expect("claim");
        assert!(matches!(outcome, ClaimOutcome::Claimed { .. }));
        tokio::time::sleep(Duration::from_millis(20)).await;
        if !all_idle(&pool) {
            seen_kept = true;
            break;
        }
    }
    assert!(
        seen_kept,
        "an operation's connection is kept for the next one"
    );

    // Many at once: every claim answered; a transaction can still begin meanwhile.
    let mut claims = tokio::task::JoinSet::new();
    for i in 0..32 {
        let store = store.clone();
        claims.spawn(async move {
            let claim = claim_request(&format!("many-{i}"), b"{}");
            store.claim(&claim).await.expect("claim")
        });
    }
    let mut tx = pool
        .begin()
        .await
        .expect("a transaction finds a connection");
    sqlx::query("SELECT 1")
        .execute(&mut *tx)
        .await
        .expect("select");
    tx.rollback().await.expect("rollback");
    while let Some(outcome) = claims.join_next().await {
        assert!(matches!(
            outcome.expect("task"),
            ClaimOutcome::Claimed { .. }
        ));
    }

    // Given back once idle.
    let mut waited = 0;
    while !all_idle(&pool) {
        assert!(
            waited < 500,
            "kept connections go back to the pool once idle"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
        waited += 1;
    }
    // Kept again, then the pool closes: the kept connection does not hold it up.
    store
        .claim(&claim_request("last", b"{}"))
        .await
        .expect("claim");
    tokio::time::timeout(Duration::from_secs(10), pool.close())
        .await
        .expect("Pool::close completes with a connection kept");
}

/// A kept connection whose session the server ended while it waited (a restart, an administrator's
/// `pg_terminate_backend`) costs nothing: its statement goes again on a connection from the pool,
/// as the pool's ping would have replaced it, and the operation succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_kept_connection_ended_by_the_server_is_replaced() {
    static RUN: AtomicUsize = AtomicUsize::new(0);
    let name = format!(
        "idem-kept-{}-{}",
        std::process::id(),
        RUN.fetch_add(1, Ordering::SeqCst)
    );
    let admin = pool(2).await;
    let schema = fresh_schema(&admin).await;
    let options = PgConnectOptions::from_str(&database_url())
        .expect("DATABASE_URL")
        .application_name(&name);
    let records = PgPoolOptions::new()
        .max_connections(4)
        .connect_with(options)
        .await
        .expect("pool");
    let store = PostgresStore::with_table(records, &format!("{schema}.idempotency_records"))
        .expect("valid table name")
        .with_transaction_pool(admin.clone());
    store.migrate().await.expect("migrate");
    for round in 0..5 {
        let claim = claim_request(&format!("ended-{round}"), b"{}");
        let ClaimOutcome::Claimed { lease, .. } = store.claim(&claim).await.expect("claim") else {
            panic!("a fresh key is claimed");
        };
        // The claim's connection is kept; the server ends every session of the store's pool.
        sqlx::query(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1",
        )
        .bind(&name)
        .execute(&admin)
        .await
        .expect("terminate");
        let response = std::sync::Arc::new(axum_idempotency::store::StoredResponse::new(
            Finished::Completed,
            201,
            Vec::new(),
            Some(axum::body::Bytes::from_static(b"{}")),
        ));
        let done = store
            .complete(
                &claim.key,
                lease,
                &claim.fingerprint,
                response,
                Duration::from_secs(60),
            )
            .await
            .expect("the completion goes again on a live connection");
        assert!(done.is_done(), "round {round}");
    }
}

/// A store that keeps no scope in clear cannot tell whose a record is from its columns: it lists
/// none of them (not even for the empty subject, which its rows' empty columns match), and still
/// finds, shows and deletes a record by its key.
#[tokio::test]
async fn without_scope_columns_lists_nothing_but_looks_up_and_deletes() {
    use axum_idempotency::store::{Deleted, ListRequest, RecordState};
    let store = store().await.without_scope_columns();
    let claim = claim_request("hidden", b"{}");
    let ClaimOutcome::Claimed { lease, .. } = store.claim(&claim).await.expect("claim") else {
        panic!("a fresh key is claimed");
    };
    let anonymous = ClaimRequest {
        key: RecordKey {
            subject: String::new(),
            ..claim.key.clone()
        },
        ..claim_request("hidden", b"{}")
    };
    store.claim(&anonymous).await.expect("claim");
    let response = std::sync::Arc::new(axum_idempotency::store::StoredResponse::new(
        Finished::Completed,
        201,
        Vec::new(),
        Some(axum::body::Bytes::from_static(b"{}")),
    ));
    let done = store
        .complete(
            &claim.key,
            lease,
            &claim.fingerprint,
            response,
            Duration::from_secs(60),
        )
        .await
        .expect("complete");
    assert!(done.is_done());
    for subject in ["alice", ""] {
        let page = store
            .list(subject, ListRequest::first(10))
            .await
            .expect("list");
        assert!(page.records.is_empty(), "{subject:?}: {page:?}");
    }
    let info = store
        .lookup(&claim.key)
        .await
        .expect("lookup")
        .expect("the record");
    assert_eq!(
        (info.state, info.status),
        (RecordState::Finished(Finished::Completed), Some(201))
    );
    assert_eq!(
        store.delete(&anonymous.key).await.expect("delete"),
        Deleted::InProgress
    );
    assert_eq!(
        store.delete(&claim.key).await.expect("delete"),
        Deleted::Deleted
    );
    assert_eq!(store.lookup(&claim.key).await.expect("lookup"), None);
}

/// Two instances migrating one new table at once both succeed, and the listing's index is made
/// once; a third migrate, with the index there, succeeds too.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_migrations_make_the_subject_index_once() {
    let pool = pool(4).await;
    let schema = fresh_schema(&pool).await;
    let table = format!("{schema}.records");
    let first = PostgresStore::with_table(pool.clone(), &table).expect("table");
    let second = PostgresStore::with_table(pool.clone(), &table).expect("table");
    let (a, b) = tokio::join!(first.migrate(), second.migrate());
    a.expect("the first migrate");
    b.expect("the second migrate");
    first.migrate().await.expect("migrate again");
    let (definition,): (String,) = sqlx::query_as(
        "SELECT indexdef FROM pg_indexes WHERE schemaname = $1 AND indexname = 'records_subject_idx'",
    )
    .bind(&schema)
    .fetch_one(&pool)
    .await
    .expect("the subject index exists");
    assert!(
        definition.ends_with("(subject, created_at, scope)"),
        "{definition}"
    );
}

/// The lease keeper renews a batch in one statement; a record whose row another transaction holds
/// locked (a handler's transaction that wrote its completion and has not committed) is skipped,
/// not waited for: that lease alone gets an error (retried), the others are renewed at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_locked_row_fails_only_its_own_lease_of_a_renewal_batch() {
    use axum_idempotency::store::Fenced;
    let store = store().await.with_timeout(Duration::from_secs(2));
    let request = |key: &str| {
        ClaimRequest::new(
            RecordKey {
                key: key.into(),
                subject: "alice".into(),
                endpoint: "POST /pay".into(),
            },
            Fingerprint::of(None, b"{}"),
            Duration::from_secs(30),
            Duration::from_secs(600),
        )
    };
    let (a, b) = (request("locked"), request("free"));
    for claim in [&a, &b] {
        let outcome = store.claim(claim).await.expect("claim");
        assert!(
            matches!(outcome, ClaimOutcome::Claimed { .. }),
            "{outcome:?}"
        );
    }
    // Another transaction holds a's row.
    let mut holder = store.pool().begin().await.expect("begin");
    let digest = a.key.digest();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT 1 FROM {} WHERE scope = $1 FOR UPDATE",
        store.table()
    )))
    .bind(&digest[..])
    .execute(&mut *holder)
    .await
    .expect("lock a's row");
    let started = std::time::Instant::now();
    let lifetime = Duration::from_secs(630);
    let answers = store
        .renew_many(&[(&a.key, a.lease), (&b.key, b.lease)], lifetime)
        .await;
    assert!(
        started.elapsed() < Duration::from_millis(1500),
        "the locked row was waited for: {:?}",
        started.elapsed()
    );
    assert!(answers[0].is_err(), "{answers:?}");
    assert_eq!(answers[1].as_ref().ok(), Some(&Fenced::Done), "{answers:?}");
    holder.rollback().await.expect("rollback");
    // Free again, both renew; a lease that does not hold its record is lost, not an error.
    let answers = store
        .renew_many(
            &[
                (&a.key, a.lease),
                (&b.key, b.lease),
                (&a.key, LeaseToken::generate()),
            ],
            lifetime,
        )
        .await;
    let answers: Vec<Fenced> = answers
        .into_iter()
        .map(|answer| answer.expect("renewed or lost"))
        .collect();
    assert_eq!(answers, vec![Fenced::Done, Fenced::Done, Fenced::LeaseLost]);
}

/// A restart does not count against a live holder (see `common::restart`), on a private server of
/// this test process's own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_of_the_server_does_not_count_against_a_holder() {
    let server = common::servers::private_postgres();
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect(&server.url)
        .await
        .expect("the private PostgreSQL");
    let schema = fresh_schema(&pool).await;
    let store = PostgresStore::with_table(pool.clone(), &format!("{schema}.idempotency_records"))
        .expect("valid table name")
        .with_timeout(Duration::from_secs(2));
    store.migrate().await.expect("migrate");
    common::restart::a_restart_does_not_count_against_a_holder(
        &store,
        Duration::from_secs(3),
        || common::servers::private_postgres().restart(),
    )
    .await;
}

/// The suite again with every claim, completion and release sent through the batch statements
/// (SPEC 26), each batch held until it has four rows or 5 ms passed: the statements that carry
/// many keep every promise the single ones keep.
mod batched {
    use super::*;

    store_suite!(async { store().await.with_batches_held(4) });

    /// A row locked by another transaction delays no other row of its batch: a duplicate of a
    /// record whose handler's transaction holds it is answered from the row as last committed (in
    /// progress) beside seven fresh keys, and a completion whose row is locked is skipped by the
    /// batch, goes alone and waits (then fails, for the engine to retry) while the seven others of
    /// its batch are done. No batch statement failed (a wait past the lock timeout would have).
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_locked_row_delays_no_other_row_of_its_batch() {
        use axum_idempotency::store::{Fenced, StoredResponse, TransactionalStore};
        use std::sync::Arc;

        let pool = pool(34).await;
        let schema = fresh_schema(&pool).await;
        let table = format!("{schema}.idempotency_records");
        let store = PostgresStore::with_table(pool.clone(), &table)
            .expect("valid table name")
            .with_timeout(common::SUITE_STORE_TIMEOUT)
            .with_batches_held(8);
        store.migrate().await.expect("migrate");
        let response = || {
            Arc::new(StoredResponse::new(
                Finished::Completed,
                201,
                Vec::new(),
                Some(b"{}".to_vec().into()),
            ))
        };

        let first = claim_request("held", b"{}");
        let ClaimOutcome::Claimed { lease, .. } = store.claim(&first).await.expect("claim") else {
            panic!("the first claim wins");
        };
        let mut tx = store.begin(Duration::from_secs(30)).await.expect("begin");
        let done = store
            .complete_in(
                &mut tx,
                &first.key,
                lease,
                &first.fingerprint,
                response(),
                first.retention,
                &[],
            )
            .await
            .expect("complete in the transaction");
        assert!(done.is_done());
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
        assert_eq!(
            answers[0],
            ClaimOutcome::InProgress,
            "the held record is in progress"
        );
        for answer in &answers[1..] {
            assert!(matches!(answer, ClaimOutcome::Claimed { .. }), "{answer:?}");
        }
        drop(tx);

        let requests: Vec<ClaimRequest> = (0..8)
            .map(|k| claim_request(&format!("done {k}"), b"{}"))
            .collect();
        for request in &requests {
            let granted = store.claim(request).await.expect("claim");
            assert!(matches!(granted, ClaimOutcome::Claimed { .. }));
        }
        let mut locker = pool.begin().await.expect("begin");
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT 1 FROM {table} WHERE idempotency_key = 'done 0' FOR UPDATE"
        )))
        .execute(&mut *locker)
        .await
        .expect("lock the row");
        let completions: Vec<_> = requests
            .iter()
            .map(|request| {
                let (store, request, response) = (store.clone(), request.clone(), response());
                tokio::spawn(async move {
                    store
                        .complete(
                            &request.key,
                            request.lease,
                            &request.fingerprint,
                            response,
                            request.retention,
                        )
                        .await
                })
            })
            .collect();
        let mut done = Vec::new();
        for completion in completions {
            done.push(completion.await.expect("task"));
        }
        assert!(
            done[0].is_err(),
            "the locked row waited alone: {:?}",
            done[0]
        );
        for answer in &done[1..] {
            assert_eq!(answer.as_ref().expect("done"), &Fenced::Done);
        }
        locker.rollback().await.expect("rollback");
        let again = store
            .complete(
                &requests[0].key,
                requests[0].lease,
                &requests[0].fingerprint,
                response(),
                requests[0].retention,
            )
            .await
            .expect("complete once the lock is gone");
        assert_eq!(again, Fenced::Done);
        let (sent, failed) = store.batch_counts();
        assert!(sent > 0);
        assert_eq!(failed, 0, "{failed} of {sent} batch statements failed");
    }

    /// A table another program locks (`LOCK TABLE ... IN EXCLUSIVE MODE`, as a migration or a
    /// `VACUUM FULL` does) while claims of fresh keys are made alone and in batches: each is
    /// refused within the store's bound (never granted, never run unguarded), and none is written
    /// once the lock goes, because no statement outlived its client on the server.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn claims_under_a_table_lock_are_refused_in_time_and_never_land_later() {
        let pool = pool(34).await;
        let schema = fresh_schema(&pool).await;
        let table = format!("{schema}.idempotency_records");
        for held in [None, Some(8)] {
            let store = PostgresStore::with_table(pool.clone(), &table)
                .expect("valid table name")
                .with_timeout(common::SUITE_STORE_TIMEOUT);
            let store = match held {
                Some(rows) => store.with_batches_held(rows),
                None => store,
            };
            store.migrate().await.expect("migrate");
            let mut locker = pool.begin().await.expect("begin");
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "LOCK TABLE {table} IN EXCLUSIVE MODE"
            )))
            .execute(&mut *locker)
            .await
            .expect("lock the table");
            let requests: Vec<ClaimRequest> = (0..8)
                .map(|k| claim_request(&format!("locked {held:?} {k}"), b"{}"))
                .collect();
            let claims: Vec<_> = requests
                .iter()
                .map(|request| {
                    let (store, request) = (store.clone(), request.clone());
                    tokio::spawn(async move { store.claim(&request).await })
                })
                .collect();
            for claim in claims {
                let answer = claim.await.expect("task");
                assert!(
                    answer.is_err(),
                    "a claim under the table lock was answered {answer:?}"
                );
            }
            // Past the bound, with the lock still held: a statement still waiting on the server
            // would now take it.
            tokio::time::sleep(common::SUITE_STORE_TIMEOUT * 2).await;
            locker.rollback().await.expect("unlock");
            tokio::time::sleep(common::SUITE_STORE_TIMEOUT).await;
            let (rows,): (i64,) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
                "SELECT count(*) FROM {table} WHERE idempotency_key LIKE 'locked {held:?} %'"
            )))
            .fetch_one(&pool)
            .await
            .expect("count");
            assert_eq!(
                rows, 0,
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

/// A table not migrated for steps (made by an earlier version, `migrate()` not run since): a step
/// answers at once that the store cannot keep them (the engine then fails the step before its
/// work, with no tries again), and the rest of the store works as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_without_the_steps_columns_refuses_steps_at_once() {
    let pool = pool(4).await;
    let schema = fresh_schema(&pool).await;
    let table = format!("{schema}.idempotency_records");
    let store = PostgresStore::with_table(pool.clone(), &table)
        .expect("valid table name")
        .with_timeout(common::SUITE_STORE_TIMEOUT);
    store.migrate().await.expect("migrate");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "ALTER TABLE {table} DROP COLUMN step_results, DROP COLUMN step_names, \
         DROP COLUMN steps_generation"
    )))
    .execute(&pool)
    .await
    .expect("the columns of an earlier version");
    let request = ClaimRequest::new(
        RecordKey {
            key: "unmigrated".into(),
            subject: "alice".into(),
            endpoint: "POST /pay".into(),
        },
        Fingerprint::of(None, b"{}"),
        Duration::from_secs(30),
        Duration::from_secs(60),
    );
    let ClaimOutcome::Claimed { lease, .. } = store.claim(&request).await.expect("claim") else {
        panic!("claimed");
    };
    let read = store.steps(&request.key, lease).await;
    assert!(read.as_ref().is_err_and(|e| e.is_unsupported()), "{read:?}");
    let shown = store.recorded_steps(&request.key).await;
    assert!(
        shown.as_ref().is_err_and(|e| e.is_unsupported()),
        "{shown:?}"
    );
    let step = axum_idempotency::store::RecordedStep {
        name: "reserve".into(),
        result: b"1".to_vec(),
    };
    let write = store.record_step(&request.key, lease, &step).await;
    assert!(
        write.as_ref().is_err_and(|e| e.is_unsupported()),
        "{write:?}"
    );
    // Renewed, counted and completed as before.
    let renewed = store
        .renew(&request.key, lease, Duration::from_secs(60))
        .await;
    assert!(renewed.expect("renew").is_done());
    let usage = store.count_records("alice", 10).await.expect("counted");
    assert_eq!(
        usage.map(|u| u.records),
        Some(1),
        "counted without the steps"
    );
    // And `migrate()` adds them back.
    store.migrate().await.expect("migrate again");
    assert_eq!(
        store.steps(&request.key, lease).await.expect("steps"),
        Some(vec![])
    );
    assert_eq!(
        store
            .recorded_steps(&request.key)
            .await
            .expect("recorded steps"),
        vec![]
    );
    let written = store.record_step(&request.key, lease, &step).await;
    assert!(written.expect("record").is_done());
    let usage = store.count_records("alice", 10).await;
    let usage = usage
        .expect("counted with the steps")
        .expect("the store counts");
    assert!(usage.bytes >= 1, "the step counts once migrated: {usage:?}");
}
