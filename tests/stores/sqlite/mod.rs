#![cfg(feature = "sqlite")]
//! The layer on the SQLite store, on real SQLite files: every test works in a file of its own
//! (`common::sqlite`), so tests run in parallel and leave each other alone. Several pools on one file stand for several processes: each connection
//! has the file open on its own, and SQLite's locks treat them alike.

use crate::common;
use axum_idempotency::{cache_suite, store_suite};

use std::path::Path;
use std::time::Duration;

use axum::http::StatusCode;
use axum_idempotency::IdempotencyLayer;
use axum_idempotency::store::Deleted;
use axum_idempotency::store::{
    ClaimOutcome, Finished, IdempotencyStore, LeaseToken, ListRequest, RecordKey, SqliteStore,
    StoredResponse,
};
pub(crate) use common::sqlite::fresh_path;
use common::{app, post, send};
use sqlx::sqlite::{SqliteConnectOptions, SqlitePool, SqlitePoolOptions};

mod faults;
mod transactions;

/// A pool of `connections` on the file at `path`, with the store's connection settings.
pub(crate) async fn pool_on(path: &Path, connections: u32) -> SqlitePool {
    SqlitePoolOptions::new()
        .max_connections(connections)
        .connect_with(SqliteStore::connect_options(
            SqliteConnectOptions::new().filename(path),
        ))
        .await
        .expect("open the SQLite file")
}

/// A migrated store on a file of its own, as `SqliteStore::open` makes it.
pub(crate) async fn store() -> SqliteStore {
    let store = SqliteStore::open(fresh_path())
        .await
        .expect("open")
        .with_timeout(common::SUITE_STORE_TIMEOUT);
    store.migrate().await.expect("migrate");
    store
}

store_suite!(store());
cache_suite!(store(), purged = 5);

/// The claim of `POST /pay` by alice with `key` and `body`: the one helper every store's tests
/// build their claims with.
pub(crate) use axum_idempotency::conformance::app::claim_request;

/// A recorded `201` with `body`.
pub(crate) fn created(body: &'static [u8]) -> std::sync::Arc<StoredResponse> {
    std::sync::Arc::new(StoredResponse::new(
        Finished::Completed,
        201,
        vec![(
            axum::http::header::CONTENT_TYPE,
            axum::http::HeaderValue::from_static("text/plain"),
        )],
        Some(axum::body::Bytes::from_static(body)),
    ))
}

/// The names of the file's tables and indexes, in order.
async fn schema_objects(pool: &SqlitePool) -> Vec<(String, String)> {
    sqlx::query_as(
        "SELECT type, name FROM sqlite_master WHERE name NOT LIKE 'sqlite_%' ORDER BY type, name",
    )
    .fetch_all(pool)
    .await
    .expect("sqlite_master")
}

/// Eight processes' worth of pools migrating one new file at once, beside an application's own
/// tables and migration bookkeeping: every migration succeeds, the table and its two indexes are
/// made once, and nothing of the application's is touched; migrating again changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn migrate_is_safe_from_many_processes_at_once() {
    let path = fresh_path();
    let app_pool = pool_on(&path, 1).await;
    sqlx::raw_sql(
        "CREATE TABLE _sqlx_migrations (version INTEGER PRIMARY KEY, description TEXT); \
         INSERT INTO _sqlx_migrations VALUES (1, 'the application''s own'); \
         CREATE TABLE orders (id INTEGER PRIMARY KEY)",
    )
    .execute(&app_pool)
    .await
    .expect("the application's tables");
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..8 {
        let pool = pool_on(&path, 2).await;
        tasks.spawn(async move {
            SqliteStore::with_table(pool, "records")
                .expect("table")
                .migrate()
                .await
        });
    }
    while let Some(result) = tasks.join_next().await {
        result.expect("task").expect("every migrate succeeds");
    }
    let store = SqliteStore::with_table(app_pool.clone(), "records").expect("table");
    store.migrate().await.expect("migrate again");
    let objects = schema_objects(&app_pool).await;
    let names: Vec<&str> = objects.iter().map(|(_, n)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "records_expires_idx",
            "records_subject_idx",
            "_sqlx_migrations",
            "orders",
            "records"
        ],
        "{objects:?}"
    );
    let (rows,): (i64,) = sqlx::query_as("SELECT count(*) FROM _sqlx_migrations")
        .fetch_one(&app_pool)
        .await
        .expect("bookkeeping");
    assert_eq!(rows, 1, "the application's bookkeeping is untouched");
    let (mode,): (String,) = sqlx::query_as("PRAGMA journal_mode")
        .fetch_one(&app_pool)
        .await
        .expect("journal mode");
    assert_eq!(mode, "wal");
}

/// A file left in rollback-journal mode by whoever made it: `migrate()` puts it in WAL mode.
#[tokio::test]
async fn migrate_puts_the_file_in_wal_mode() {
    let path = fresh_path();
    let options = SqliteConnectOptions::new()
        .filename(&path)
        .create_if_missing(true)
        .journal_mode(sqlx::sqlite::SqliteJournalMode::Delete);
    let pool = SqlitePoolOptions::new()
        .max_connections(1)
        .connect_with(options)
        .await
        .expect("open");
    SqliteStore::new(pool.clone())
        .migrate()
        .await
        .expect("migrate");
    let (mode,): (String,) = sqlx::query_as("PRAGMA journal_mode")
        .fetch_one(&pool)
        .await
        .expect("journal mode");
    assert_eq!(mode, "wal");
}

#[tokio::test]
async fn table_names_are_validated() {
    let pool = SqlitePoolOptions::new()
        .connect_lazy_with(SqliteConnectOptions::new().filename(fresh_path()));
    for bad in [
        "",
        "Records",
        "1records",
        "records; DROP TABLE x",
        "main.records",
        "rec-ords",
        "\"records\"",
        "sqlite_records",
        &"r".repeat(41),
    ] {
        assert!(
            SqliteStore::with_table(pool.clone(), bad).is_err(),
            "{bad:?}"
        );
    }
    assert!(SqliteStore::with_table(pool, "order").is_ok());
}

/// A table of another shape under the store's name: `migrate()` says so, and never serves it.
#[tokio::test]
async fn a_table_of_another_shape_is_refused_by_migrate() {
    let path = fresh_path();
    let pool = pool_on(&path, 1).await;
    sqlx::query("CREATE TABLE idempotency_records (key TEXT PRIMARY KEY)")
        .execute(&pool)
        .await
        .expect("another table");
    let refused = SqliteStore::new(pool).migrate().await.expect_err("refused");
    assert!(
        refused.to_string().contains("lacks the columns"),
        "{refused}"
    );
}

/// Subjects and endpoints as long as the layer lets through (1024 and 4096 bytes), random and
/// incompressible, with NUL and non-ASCII characters, are stored whole: claimed, replayed, looked
/// up, listed with their endpoint as sent, and kept apart from a subject one byte away.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_longest_scopes_are_stored_whole() {
    let store = store().await;
    let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
    let mut random = |bytes: usize| {
        let mut text = String::from("\0é漢");
        while text.len() < bytes {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let c = char::from_u32((seed % 0x3000) as u32).unwrap_or('\u{FFFD}');
            if text.len() + c.len_utf8() <= bytes {
                text.push(c);
            } else {
                text.push('x');
            }
        }
        text
    };
    let subject = random(1024);
    let endpoint = format!("POST /{}", random(4090));
    assert_eq!((subject.len(), endpoint.len()), (1024, 4096));
    let mut claim = claim_request("long", b"{}");
    claim.key.subject = subject.clone();
    claim.key.endpoint = endpoint.clone();
    let ClaimOutcome::Claimed { lease, .. } = store.claim(&claim).await.expect("claim") else {
        panic!("a fresh key is claimed");
    };
    let done = store
        .complete(
            &claim.key,
            lease,
            &claim.fingerprint,
            created(b"stored"),
            Duration::from_secs(60),
        )
        .await
        .expect("complete");
    assert!(done.is_done());
    let mut again = claim_request("long", b"{}");
    again.key = claim.key.clone();
    let ClaimOutcome::Finished(stored) = store.claim(&again).await.expect("claim") else {
        panic!("the replay");
    };
    assert_eq!(&stored.body[..], b"stored");
    // A subject one byte away (the NUL made another character) is another scope.
    let mut near = claim_request("long", b"{}");
    near.key.subject = subject.replacen('\0', "\u{1}", 1);
    near.key.endpoint = endpoint.clone();
    assert!(matches!(
        store.claim(&near).await.expect("claim"),
        ClaimOutcome::Claimed { .. }
    ));
    assert!(store.lookup(&claim.key).await.expect("lookup").is_some());
    let page = store
        .list(&subject, ListRequest::first(10))
        .await
        .expect("list");
    assert_eq!(page.records.len(), 1, "{page:?}");
    assert_eq!(page.records[0].endpoint, endpoint);
    assert_eq!(page.records[0].key, "long");
    let (stored_subject,): (String,) =
        sqlx::query_as("SELECT subject FROM idempotency_records WHERE scope = ?1")
            .bind(&claim.key.digest()[..])
            .fetch_one(store.pool())
            .await
            .expect("the row");
    assert_eq!(stored_subject, subject, "kept whole, NUL included");
    assert_eq!(
        store.delete(&claim.key).await.expect("delete"),
        Deleted::Deleted
    );
}

/// Keys and subjects are bound as parameters: SQL in them is plain data.
#[tokio::test]
async fn hostile_keys_and_subjects_are_plain_data() {
    let store = store().await;
    sqlx::raw_sql("CREATE TABLE canary (n INTEGER); INSERT INTO canary VALUES (1)")
        .execute(store.pool())
        .await
        .expect("canary");
    let (router, counters) = app(IdempotencyLayer::new(store.clone()).expect("valid settings"));
    let key = "'; DROP TABLE idempotency_records; DROP TABLE canary; --";
    let user = "alice' OR '1'='1'; DROP TABLE canary; --";
    let first = send(&router, post("/pay").key(key).user(user).json("{}")).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    assert!(
        send(&router, post("/pay").key(key).user(user).json("{}"))
            .await
            .replayed()
    );
    assert_eq!(counters.started(), 1);
    let (canaries,): (i64,) = sqlx::query_as("SELECT count(*) FROM canary")
        .fetch_one(store.pool())
        .await
        .expect("the canary is still there");
    assert_eq!(canaries, 1);
    let (subject,): (String,) =
        sqlx::query_as("SELECT subject FROM idempotency_records WHERE idempotency_key = ?1")
            .bind(key)
            .fetch_one(store.pool())
            .await
            .expect("the record");
    assert_eq!(subject, user);
}

/// While the handler runs, another pool on the file (another process) sees the claim in
/// progress: it was committed before the handler started.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn records_are_committed_before_the_handler_runs() {
    let path = fresh_path();
    let store = SqliteStore::new(pool_on(&path, 4).await);
    store.migrate().await.expect("migrate");
    let (router, counters) = app(IdempotencyLayer::new(store.clone()).expect("valid settings"));
    let slow = tokio::spawn({
        let router = router.clone();
        async move {
            send(
                &router,
                post("/pay")
                    .key("k")
                    .user("alice")
                    .header("x-delay-ms", "500"),
            )
            .await
        }
    });
    let c = counters.clone();
    common::eventually(move || c.started() == 1).await;
    let other = pool_on(&path, 1).await;
    let status = || async {
        let (status,): (String,) =
            sqlx::query_as("SELECT status FROM idempotency_records WHERE idempotency_key = 'k'")
                .fetch_one(&other)
                .await
                .expect("the claim is visible to another connection");
        status
    };
    assert_eq!(status().await, "in_progress");
    assert_eq!(slow.await.expect("request").status, StatusCode::CREATED);
    assert_eq!(status().await, "completed");
}

/// Many claims of one key at once, from two pools on one file (two processes' worth: their writes
/// meet on SQLite's lock, not on one store's turn), round after round: exactly one is claimed,
/// and every other sees the winner's record (in progress). Then the record is made stale (its
/// holder stopped renewing it an hour ago) and as many retakers race for it: exactly one takes it,
/// with the record's generation.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn claim_races_on_real_connections_have_one_winner() {
    let path = fresh_path();
    let stores = [
        SqliteStore::new(pool_on(&path, 4).await),
        SqliteStore::new(pool_on(&path, 4).await),
    ];
    stores[0].migrate().await.expect("migrate");
    const TASKS: usize = 12;
    for round in 0..15 {
        let key = format!("race-{round}");
        let body = format!("{{\"round\":{round}}}");
        let mut claims = tokio::task::JoinSet::new();
        for i in 0..TASKS {
            let store = stores[i % 2].clone();
            let request = claim_request(&key, body.as_bytes());
            claims.spawn(async move { (store.claim(&request).await, request) });
        }
        let mut winners = Vec::new();
        while let Some(done) = claims.join_next().await {
            let (outcome, request) = done.expect("task");
            match outcome.expect("every claim is answered") {
                ClaimOutcome::Claimed { generation, .. } => {
                    assert_eq!(generation, Some(request.generation));
                    winners.push(request);
                }
                ClaimOutcome::InProgress => {}
                other => panic!("round {round}: {other:?}"),
            }
        }
        assert_eq!(winners.len(), 1, "round {round}: exactly one claim wins");
        let first = winners.pop().expect("the winner");

        // Stale once its holder stops renewing: one retaker of many takes it, keeping its
        // generation (a retake of the same operation).
        sqlx::query(
            "UPDATE idempotency_records SET updated_us = updated_us - 3600000000, \
               renewed_boot_us = renewed_boot_us - 3600000000, \
               renewed_paired_us = updated_us - 3600000000",
        )
        .execute(stores[0].pool())
        .await
        .expect("age the record");
        let mut retakes = tokio::task::JoinSet::new();
        for i in 0..TASKS {
            let store = stores[i % 2].clone();
            let mut request = claim_request(&key, body.as_bytes());
            request.key = first.key.clone();
            retakes.spawn(async move { (store.claim(&request).await, request) });
        }
        let mut retakers = 0;
        while let Some(done) = retakes.join_next().await {
            let (outcome, request) = done.expect("task");
            match outcome.expect("every retake is answered") {
                outcome @ ClaimOutcome::Claimed { .. } => {
                    assert!(outcome.is_retake(&request), "{outcome:?}");
                    assert_eq!(
                        outcome,
                        ClaimOutcome::Claimed {
                            lease: request.lease,
                            generation: Some(first.generation)
                        }
                    );
                    retakers += 1;
                }
                ClaimOutcome::InProgress => {}
                other => panic!("round {round}: {other:?}"),
            }
        }
        assert_eq!(retakers, 1, "round {round}: exactly one retaker wins");
    }
}

/// A finished record's row edited by hand into something unreadable is answered as unreadable,
/// never by running the operation again.
#[tokio::test]
async fn an_unreadable_finished_record_is_never_run_again() {
    let store = store().await;
    let claim = claim_request("edited", b"{}");
    let ClaimOutcome::Claimed { lease, .. } = store.claim(&claim).await.expect("claim") else {
        panic!("a fresh key is claimed");
    };
    let done = store
        .complete(
            &claim.key,
            lease,
            &claim.fingerprint,
            created(b"x"),
            Duration::from_secs(60),
        )
        .await
        .expect("complete");
    assert!(done.is_done());
    sqlx::query("UPDATE idempotency_records SET response_headers = x'00ff'")
        .execute(store.pool())
        .await
        .expect("edit by hand");
    let mut again = claim_request("edited", b"{}");
    again.key = claim.key.clone();
    let error = store.claim(&again).await.expect_err("unreadable");
    assert!(error.is_unreadable_record(), "{error:?}");
}

/// The keeper's renewals go out together, a statement for every 200 leases: each lease, in
/// whichever statement, gets its own answer, renewed or lost.
#[tokio::test]
async fn a_renewal_of_many_leases_answers_each_across_statements() {
    use axum_idempotency::store::Fenced;
    let store = store().await;
    let mut claims = Vec::new();
    for i in 0..450 {
        let claim = claim_request(&format!("many-{i}"), b"{}");
        let outcome = store.claim(&claim).await.expect("claim");
        assert!(
            matches!(outcome, ClaimOutcome::Claimed { .. }),
            "{outcome:?}"
        );
        claims.push(claim);
    }
    // Every seventh lease is not the holder's: lost, wherever it falls.
    let leases: Vec<(&RecordKey, LeaseToken)> = claims
        .iter()
        .enumerate()
        .map(|(i, claim)| {
            let lease = if i % 7 == 3 {
                LeaseToken::generate()
            } else {
                claim.lease
            };
            (&claim.key, lease)
        })
        .collect();
    let answers = store.renew_many(&leases, Duration::from_secs(120)).await;
    assert_eq!(answers.len(), 450);
    for (i, answer) in answers.into_iter().enumerate() {
        let expected = if i % 7 == 3 {
            Fenced::LeaseLost
        } else {
            Fenced::Done
        };
        assert_eq!(answer.expect("answered"), expected, "lease {i}");
    }
}

/// The age of a record in progress is read on the machine's boot clock: a step of the wall clock
/// (an operator's, NTP's) neither makes a live holder look dead (a step forward) nor keeps a dead
/// holder's key past its TTL (a step back). The holder here is one the store cannot see (a lease
/// of no keeper's presence), judged by the TTL alone.
#[tokio::test]
async fn a_step_of_the_wall_clock_moves_no_record_in_progress() {
    let store = store().await;
    let ttl = Duration::from_millis(600);
    let mut holder = claim_request("stepped", b"{}");
    holder.in_progress_ttl = ttl;
    assert!(matches!(
        store.claim(&holder).await.expect("claim"),
        ClaimOutcome::Claimed { .. }
    ));
    let retaker = || holder.from_another_request();
    let hour = Duration::from_secs(3600);
    let forward = store.clone().with_wall_clock_stepped(hour, false);
    assert_eq!(
        forward.claim(&retaker()).await.expect("claim"),
        ClaimOutcome::InProgress,
        "the wall clock an hour ahead makes a holder renewed a moment ago look dead"
    );
    tokio::time::sleep(ttl + Duration::from_millis(100)).await;
    let back = store.clone().with_wall_clock_stepped(hour, true);
    let retake = retaker();
    let taken = back.claim(&retake).await.expect("claim");
    assert!(
        taken.is_retake(&retake),
        "the wall clock an hour behind keeps a dead holder's key: {taken:?}"
    );
}

/// The suite again with every insert and completion written in a transaction of the batch
/// (SPEC 26), each batch held until it has four rows or 5 ms passed.
mod batched {
    use super::*;

    store_suite!(async { store().await.with_batches_held(4) });

    /// Racing requests, with batches as they come and held until they have eight rows: each
    /// gets its own answer, and no batch transaction failed over to the single writes.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn racing_requests_in_batches_each_get_their_own_answer() {
        for held in [None, Some(8)] {
            let store = match held {
                Some(rows) => store().await.with_batches_held(rows),
                None => store().await,
            };
            crate::together::racing_requests_each_get_their_own_answer(store.clone()).await;
            let (sent, failed) = store.batch_counts();
            assert!(sent > 0, "no batch transaction was written ({held:?})");
            assert_eq!(
                failed, 0,
                "{failed} of {sent} batch transactions failed ({held:?})"
            );
        }
    }
}

/// A table not migrated for steps (made by an earlier version, `migrate()` not run since): showing
/// or recording a step answers at once that the store cannot keep them, the rest of the store
/// works as before, and `migrate()` adds the columns back.
#[tokio::test]
async fn a_table_without_the_steps_columns_refuses_steps_at_once() {
    let path = fresh_path();
    let pool = pool_on(&path, 2).await;
    let store = SqliteStore::new(pool.clone()).with_timeout(common::SUITE_STORE_TIMEOUT);
    store.migrate().await.expect("migrate");
    for column in ["steps", "steps_generation"] {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "ALTER TABLE idempotency_records DROP COLUMN {column}"
        )))
        .execute(&pool)
        .await
        .expect("the columns of an earlier version");
    }
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
