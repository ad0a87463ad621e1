//! A live holder is known, not guessed (SPEC 24): a store locked by another program past the
//! in-progress TTL, a runtime whose every worker is blocked by handlers, a pool whose every
//! connection handlers hold, a keepers' runtime that failed; in none of them is a live handler
//! retaken, on real databases. (The SQL backends' stores locked by another program are in
//! `sql_backends`.)

use crate::common;

use std::time::Duration;

use axum::http::StatusCode;
use axum_idempotency::IdempotencyLayer;
use axum_idempotency::store::{IdempotencyStore, MemoryStore};
use common::{app, post, send};

/// The TTL of the starvation tests.
const TTL: Duration = Duration::from_millis(400);

/// Serves `requests` through `layer` on a runtime of two workers of its own, on a thread of its
/// own: handlers that block both workers after an await (synchronous code outside
/// `block_in_place`) stop that runtime's timers and sockets altogether. Returns the statuses.
fn on_a_runtime_of_two_workers<S: IdempotencyStore>(
    layer: IdempotencyLayer<S>,
    requests: Vec<common::Req>,
) -> std::thread::JoinHandle<(Vec<StatusCode>, usize)> {
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        runtime.block_on(async move {
            let (router, counters) = app(layer);
            let mut tasks = tokio::task::JoinSet::new();
            for request in requests {
                let router = router.clone();
                tasks.spawn(async move { send(&router, request).await.status });
            }
            let mut statuses = Vec::new();
            while let Some(status) = tasks.join_next().await {
                statuses.push(status.expect("request task"));
            }
            (statuses, counters.started())
        })
    })
}

/// Two requests whose handlers await, then block their worker for twice the TTL: both workers of
/// their runtime. Another instance sharing the records (`other`: connections of its own, made on
/// this runtime) asks for the first key past the TTL: it is in progress, not retaken; then it is
/// the holder's answer, replayed.
async fn blocked_workers_stop_no_renewal<S: IdempotencyStore>(store: S, other: S) {
    let layer = |store: S| {
        IdempotencyLayer::builder(store)
            .in_progress_ttl(TTL)
            .build()
            .expect("layer")
    };
    let block = (TTL * 2).as_millis().to_string();
    let request = |key: &str| {
        post("/pay")
            .key(key)
            .user("alice")
            .header("x-delay-ms", "20")
            .header("x-block-ms", &block)
    };
    let served = on_a_runtime_of_two_workers(
        layer(store.clone()),
        vec![request("blocked-1"), request("blocked-2")],
    );
    let (other, other_runs) = app(layer(other));
    tokio::time::sleep(TTL * 3 / 2).await;
    for key in ["blocked-1", "blocked-2"] {
        let duplicate = send(&other, request(key)).await;
        assert_eq!(
            duplicate.status,
            StatusCode::CONFLICT,
            "a live handler blocking its runtime's workers was retaken: {duplicate:?}"
        );
    }
    let (statuses, runs) = tokio::task::spawn_blocking(move || served.join().expect("served"))
        .await
        .expect("join");
    assert_eq!(statuses, vec![StatusCode::CREATED; 2]);
    assert_eq!(runs, 2);
    let replay = common::until_not_in_progress(&other, || request("blocked-1"), 50).await;
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(other_runs.started(), 0, "no handler ran twice");
}

/// The memory store has no presences: only renewals keep the holders, from the keeper's own
/// thread.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocked_workers_stop_no_renewal_on_the_memory_store() {
    let store = MemoryStore::new();
    blocked_workers_stop_no_renewal(store.clone(), store).await;
}

#[cfg(feature = "postgres")]
mod postgres_keeper {
    use super::*;
    use axum_idempotency::store::PostgresStore;

    async fn store(connections: u32) -> (PostgresStore, sqlx::PgPool, String) {
        let pool = crate::postgres::pool(connections).await;
        let schema = crate::postgres::fresh_schema(&pool).await;
        let table = format!("{schema}.idempotency_records");
        let store = PostgresStore::with_table(pool.clone(), &table)
            .expect("table")
            .with_timeout(Duration::from_millis(150));
        store.migrate().await.expect("migrate");
        (store, pool, table)
    }

    /// How long ago the record of `key` was last renewed, as the database says.
    async fn renewed_ago(pool: &sqlx::PgPool, table: &str, key: &str) -> Duration {
        let (ago,): (f64,) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT extract(epoch FROM now() - updated_at)::float8 FROM {table} \
             WHERE idempotency_key = $1"
        )))
        .bind(key)
        .fetch_one(pool)
        .await
        .expect("the record");
        Duration::from_secs_f64(ago.max(0.0))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn blocked_workers_stop_no_renewal_on_postgres() {
        let (store, _, table) = store(8).await;
        // A pool of its own: the holder's pool may hand out connections its blocked runtime
        // drives.
        let (watch_pool, watch_table) = (crate::postgres::pool(1).await, table.clone());
        let watched = tokio::spawn(async move {
            tokio::time::sleep(TTL * 3 / 2).await;
            renewed_ago(&watch_pool, &watch_table, "blocked-1").await
        });
        let other = PostgresStore::with_table(crate::postgres::pool(2).await, &table)
            .expect("table")
            .with_timeout(Duration::from_millis(150));
        blocked_workers_stop_no_renewal(store, other).await;
        let ago = watched.await.expect("watch");
        // Renewed through the keeper's own connection, on its own runtime, while the holder's
        // runtime stood still: not only kept by its presence.
        assert!(
            ago < TTL,
            "the record was last renewed {ago:?} before, past the TTL"
        );
    }

    /// Handlers hold every connection of the pool the store uses for twice the TTL: the keeper
    /// renews through a connection of its own, and another instance (its own pool) finds the
    /// records renewed and in progress.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn handlers_holding_every_pooled_connection_stop_no_renewal() {
        const CONNECTIONS: u32 = 3;
        let (store, pool, table) = store(CONNECTIONS).await;
        let layer = IdempotencyLayer::builder(store)
            .in_progress_ttl(TTL)
            .build()
            .expect("layer");
        let holding = pool.clone();
        let router = axum::Router::new()
            .route(
                "/pay",
                axum::routing::post(move || {
                    let pool = holding.clone();
                    async move {
                        let held = pool.acquire().await.expect("a pooled connection");
                        tokio::time::sleep(TTL * 2).await;
                        drop(held);
                        StatusCode::CREATED
                    }
                }),
            )
            .layer(layer)
            .layer(axum::middleware::from_fn(
                |mut request: axum::extract::Request, next: axum::middleware::Next| async move {
                    request
                        .extensions_mut()
                        .insert(axum_idempotency::Subject("alice".into()));
                    next.run(request).await
                },
            ));
        let mut served = tokio::task::JoinSet::new();
        for n in 0..CONNECTIONS {
            let router = router.clone();
            served.spawn(async move {
                send(
                    &router,
                    post("/pay").key(&format!("pooled-{n}")).user("alice"),
                )
                .await
                .status
            });
        }
        // The other instance: a pool of its own on the same table.
        let other = PostgresStore::with_table(crate::postgres::pool(2).await, &table)
            .expect("table")
            .with_timeout(Duration::from_millis(150));
        let (other, other_runs) = app(IdempotencyLayer::builder(other)
            .in_progress_ttl(TTL)
            .build()
            .expect("layer"));
        tokio::time::sleep(TTL * 3 / 2).await;
        let watcher = crate::postgres::pool(1).await;
        for n in 0..CONNECTIONS {
            let key = format!("pooled-{n}");
            let ago = renewed_ago(&watcher, &table, &key).await;
            assert!(
                ago < TTL,
                "{key} was last renewed {ago:?} before, past the TTL"
            );
            let duplicate = send(&other, post("/pay").key(&key).user("alice")).await;
            assert_eq!(duplicate.status, StatusCode::CONFLICT, "{duplicate:?}");
        }
        while let Some(status) = served.join_next().await {
            assert_eq!(status.expect("served"), StatusCode::CREATED);
        }
        assert_eq!(other_runs.started(), 0);
    }
}

/// The keepers' runtime fails while a handler runs: its thread starts another and the keeper on
/// it, with no new claim, and the holder is never retaken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_keeper_starts_again_by_itself_when_its_runtime_fails() {
    let store = MemoryStore::new();
    let layer = || {
        IdempotencyLayer::builder(store.clone())
            .in_progress_ttl(TTL)
            .build()
            .expect("layer")
    };
    let (holder, runs) = app(layer());
    let (other, other_runs) = app(layer());
    let delay = (TTL * 4).as_millis().to_string();
    let request = || {
        post("/pay")
            .key("restarted")
            .user("alice")
            .header("x-delay-ms", &delay)
    };
    let first = tokio::spawn({
        let (holder, request) = (holder.clone(), request());
        async move { send(&holder, request).await }
    });
    let r = runs.clone();
    common::eventually(move || r.started() == 1).await;
    assert!(
        axum_idempotency::conformance::fail_the_keepers_runtime(),
        "the keepers' runtime runs"
    );
    for _ in 0..6 {
        tokio::time::sleep(TTL / 2).await;
        let duplicate = send(&other, request()).await;
        assert!(
            duplicate.status == StatusCode::CONFLICT || duplicate.replayed(),
            "the holder was retaken after its keeper's runtime failed: {duplicate:?}"
        );
    }
    let first = first.await.expect("first");
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(!first.replayed());
    assert_eq!(other_runs.started(), 0);
    assert_eq!(runs.started(), 1);
}

/// The presence of tokens numbered `n` (see `store::Presence`).
fn presence(n: u32) -> axum_idempotency::store::Presence {
    axum_idempotency::store::Presence::of(axum_idempotency::store::LeaseToken(
        (i64::from(n) << 32) | 7,
    ))
    .expect("a presence")
}

#[cfg(feature = "postgres")]
mod postgres_presences {
    use super::*;
    use axum_idempotency::store::PostgresStore;

    /// Whether another session could take the presence's lock exclusive now, as a retake does:
    /// true when no live keeper shows it.
    async fn free(pool: &sqlx::PgPool, n: u32) -> bool {
        sqlx::query_scalar("SELECT pg_try_advisory_xact_lock(1229213008, $1)")
            .bind(presence(n).as_i32())
            .fetch_one(pool)
            .await
            .expect("try")
    }

    /// A keeper session shows what it is told, lets go of what it is no longer told, and never
    /// leaves a presence it still shows unshown while it moves its locks to a new transaction;
    /// a keeper that stops calling has its presences let go of by the server within the lapse.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn presences_are_shown_moved_and_lapse() {
        let pool = crate::postgres::pool(2).await;
        let schema = crate::postgres::fresh_schema(&pool).await;
        let store = PostgresStore::with_table(pool.clone(), &format!("{schema}.records"))
            .expect("table")
            .with_timeout(Duration::from_secs(2));
        let session = store.keeper_session().await.expect("session");
        let lapse = Duration::from_secs(60);
        session
            .show_presences(&[presence(1), presence(2)], lapse)
            .await
            .expect("show");
        assert!(!free(&pool, 1).await && !free(&pool, 2).await, "both shown");
        // Past the swap's pause: letting go of one moves the other to a new transaction.
        tokio::time::sleep(Duration::from_millis(1100)).await;
        session
            .show_presences(&[presence(2)], lapse)
            .await
            .expect("show");
        assert!(free(&pool, 1).await, "let go of");
        assert!(!free(&pool, 2).await, "still shown through the move");
        // A keeper that stops calling: the server ends its session within the lapse.
        let short = Duration::from_millis(500);
        let quiet = store.keeper_session().await.expect("session");
        quiet
            .show_presences(&[presence(3)], short)
            .await
            .expect("show");
        assert!(!free(&pool, 3).await, "shown");
        tokio::time::sleep(short * 3).await;
        assert!(free(&pool, 3).await, "lapsed with the silent session");
        session.show_presences(&[], lapse).await.expect("show");
        assert!(free(&pool, 2).await, "all let go of");
    }
}

#[cfg(feature = "mysql")]
mod mysql_presences {
    use super::*;
    use axum_idempotency::store::MySqlStore;

    async fn free(pool: &sqlx::MySqlPool, n: u32) -> bool {
        let name = format!("axum-idempotency-presence:{}", presence(n).get());
        let free: i64 = sqlx::query_scalar("SELECT IS_FREE_LOCK(?)")
            .bind(name)
            .fetch_one(pool)
            .await
            .expect("is free");
        free == 1
    }

    /// As on PostgreSQL: shown, let go of, and lapsed with a silent session (`wait_timeout`).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn presences_are_shown_let_go_of_and_lapse() {
        let pool = crate::mysql::pool(2).await;
        let table = crate::mysql::fresh_table(&pool).await;
        let store = MySqlStore::with_table(pool.clone(), &table)
            .expect("table")
            .with_timeout(Duration::from_secs(2));
        let session = store.keeper_session().await.expect("session");
        let lapse = Duration::from_secs(60);
        session
            .show_presences(&[presence(11), presence(12)], lapse)
            .await
            .expect("show");
        assert!(
            !free(&pool, 11).await && !free(&pool, 12).await,
            "both shown"
        );
        session
            .show_presences(&[presence(12)], lapse)
            .await
            .expect("show");
        assert!(free(&pool, 11).await, "let go of");
        assert!(!free(&pool, 12).await, "still shown");
        let quiet = store.keeper_session().await.expect("session");
        quiet
            .show_presences(&[presence(13)], Duration::from_secs(1))
            .await
            .expect("show");
        assert!(!free(&pool, 13).await, "shown");
        tokio::time::sleep(Duration::from_millis(2500)).await;
        assert!(free(&pool, 13).await, "lapsed with the silent session");
        session.show_presences(&[], lapse).await.expect("show");
        assert!(free(&pool, 12).await, "all let go of");
    }
}

#[cfg(feature = "sqlite")]
mod sqlite_presences {
    use super::*;
    use axum_idempotency::store::SqliteStore;
    use std::fs::File;

    /// Whether the presence's file is there and locked by someone (a live keeper).
    fn shown(folder: &std::path::Path, n: u32) -> bool {
        match File::open(folder.join(format!("{:08x}", presence(n).get()))) {
            Ok(file) => file.try_lock_shared().is_err(),
            Err(_) => false,
        }
    }

    /// A locked file per presence beside the database; let go of (the file removed) when no
    /// longer told; made again when removed under the keeper; and gone with the session.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn presences_are_locked_files_beside_the_database() {
        let path = common::sqlite::fresh_path();
        let store = SqliteStore::open(&path).await.expect("open");
        store.migrate().await.expect("migrate");
        let mut folder = std::fs::canonicalize(&path).expect("path").into_os_string();
        folder.push("-presences");
        let folder = std::path::PathBuf::from(folder);
        let session = store.keeper_session().await.expect("session");
        let lapse = Duration::from_secs(60);
        session
            .show_presences(&[presence(21), presence(22)], lapse)
            .await
            .expect("show");
        assert!(shown(&folder, 21) && shown(&folder, 22), "both shown");
        session
            .show_presences(&[presence(22)], lapse)
            .await
            .expect("show");
        assert!(!shown(&folder, 21), "let go of");
        assert!(shown(&folder, 22), "still shown");
        // A tidier of files removes it: the next call makes it again.
        std::fs::remove_file(folder.join(format!("{:08x}", presence(22).get()))).expect("rm");
        assert!(!shown(&folder, 22));
        session
            .show_presences(&[presence(22)], lapse)
            .await
            .expect("show");
        assert!(shown(&folder, 22), "made again");
        drop(session);
        assert!(!shown(&folder, 22), "gone with the session");
    }
}

/// A holder whose presence ended and whose renewals stopped without the server restarting (a
/// failover to a replica, a proxy restarted between it and the store): the store cannot tell it
/// from a dead one. Its record is not taken at the first claim that finds it silent for a TTL,
/// which only marks it; a renewal within a TTL of the mark keeps the record (the holder was alive,
/// and answers its client); once it is silent again, a new mark, and a TTL later, a claim takes
/// it. The holder here is a lease claimed on the store directly, with no keeper showing its
/// presence.
async fn a_holder_back_within_a_ttl_of_the_mark_keeps_its_record<S: IdempotencyStore>(store: S) {
    use axum_idempotency::store::{ClaimOutcome, ClaimRequest, LeaseToken};
    const TTL: Duration = Duration::from_millis(500);
    let request = |lease: LeaseToken| ClaimRequest {
        lease,
        in_progress_ttl: TTL,
        ..axum_idempotency::conformance::app::claim_request("failover", b"{}")
    };
    let holder = request(LeaseToken::generate());
    let lifetime = TTL + holder.retention;
    assert!(matches!(
        store.claim(&holder).await.expect("claim"),
        ClaimOutcome::Claimed { .. }
    ));
    // Silent for a TTL: the first claim that finds it so marks it, and takes nothing.
    tokio::time::sleep(TTL + Duration::from_millis(100)).await;
    let noticer = request(LeaseToken::generate());
    let first = store.claim(&noticer).await.expect("claim");
    assert_eq!(first, ClaimOutcome::InProgress, "taken at the first look");
    // The holder is back (reconnected) and renews, within a TTL of the mark.
    tokio::time::sleep(TTL / 2).await;
    assert!(
        store
            .renew(&holder.key, holder.lease, lifetime)
            .await
            .expect("renew")
            .is_done(),
        "the holder lost its record while the claimer only marked it"
    );
    // Silent again for a TTL, the old mark more than a TTL old: a renewal came after it, so
    // the mark counts for nothing, and this claim only marks the record again.
    tokio::time::sleep(TTL + Duration::from_millis(100)).await;
    let second = store.claim(&request(LeaseToken::generate())).await;
    assert_eq!(
        second.expect("claim"),
        ClaimOutcome::InProgress,
        "taken on a mark older than the holder's last renewal"
    );
    // A TTL after that mark, with no renewal: the holder is dead, and one claim takes it.
    tokio::time::sleep(TTL + Duration::from_millis(100)).await;
    let retaker = request(LeaseToken::generate());
    let taken = store.claim(&retaker).await.expect("claim");
    assert!(taken.is_retake(&retaker), "{taken:?}");
    assert!(
        !store
            .renew(&holder.key, holder.lease, lifetime)
            .await
            .expect("renew")
            .is_done()
    );
}

#[cfg(feature = "postgres")]
#[tokio::test]
async fn a_holder_back_within_a_ttl_of_the_mark_keeps_its_record_on_postgres() {
    a_holder_back_within_a_ttl_of_the_mark_keeps_its_record(crate::postgres::store().await).await;
}

#[cfg(feature = "mysql")]
#[tokio::test]
async fn a_holder_back_within_a_ttl_of_the_mark_keeps_its_record_on_mysql() {
    a_holder_back_within_a_ttl_of_the_mark_keeps_its_record(crate::mysql::store().await).await;
}

#[cfg(feature = "redis")]
#[tokio::test]
async fn a_holder_back_within_a_ttl_of_the_mark_keeps_its_record_on_redis() {
    a_holder_back_within_a_ttl_of_the_mark_keeps_its_record(crate::redis_store::store().await)
        .await;
}

#[cfg(feature = "redis")]
#[tokio::test]
async fn a_holder_back_within_a_ttl_of_the_mark_keeps_its_record_on_a_redis_cluster() {
    a_holder_back_within_a_ttl_of_the_mark_keeps_its_record(crate::redis_cluster::store().await)
        .await;
}

/// A mark made by another server (the primary before a failover; this server before a restart)
/// counts for nothing: the claim that finds it, a TTL after it, marks the record again and takes
/// nothing; a claim a TTL after that takes it. `rename` makes the record's mark another server's,
/// as the table would hold it after a failover.
async fn a_mark_made_by_another_server_counts_for_nothing<S: IdempotencyStore>(
    store: S,
    rename: impl std::future::Future<Output = ()>,
) {
    use axum_idempotency::store::{ClaimOutcome, ClaimRequest, LeaseToken};
    const TTL: Duration = Duration::from_millis(500);
    let request = |lease: LeaseToken| ClaimRequest {
        lease,
        in_progress_ttl: TTL,
        ..axum_idempotency::conformance::app::claim_request("moved", b"{}")
    };
    let holder = request(LeaseToken::generate());
    assert!(matches!(
        store.claim(&holder).await.expect("claim"),
        ClaimOutcome::Claimed { .. }
    ));
    tokio::time::sleep(TTL + Duration::from_millis(100)).await;
    let first = store.claim(&request(LeaseToken::generate())).await;
    assert_eq!(first.expect("claim"), ClaimOutcome::InProgress, "marks");
    rename.await;
    // The mark is a TTL old, and nothing renewed the record since; but another server made it.
    tokio::time::sleep(TTL + Duration::from_millis(100)).await;
    let second = store.claim(&request(LeaseToken::generate())).await;
    assert_eq!(
        second.expect("claim"),
        ClaimOutcome::InProgress,
        "taken on a mark another server made"
    );
    tokio::time::sleep(TTL + Duration::from_millis(100)).await;
    let retaker = request(LeaseToken::generate());
    let taken = store.claim(&retaker).await.expect("claim");
    assert!(taken.is_retake(&retaker), "{taken:?}");
}

#[cfg(feature = "postgres")]
#[tokio::test]
async fn a_mark_made_by_another_server_counts_for_nothing_on_postgres() {
    let store = crate::postgres::store().await;
    let (pool, table) = (store.pool().clone(), store.table().to_owned());
    // A server started a second earlier.
    let rename = async move {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "UPDATE {table} SET suspected_on = suspected_on - interval '1 second'"
        )))
        .execute(&pool)
        .await
        .expect("rename the mark");
    };
    a_mark_made_by_another_server_counts_for_nothing(store, rename).await;
}

#[cfg(feature = "mysql")]
#[tokio::test]
async fn a_mark_made_by_another_server_counts_for_nothing_on_mysql() {
    let store = crate::mysql::store().await;
    let (pool, table) = (store.pool().clone(), store.table().to_owned());
    let rename = async move {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "UPDATE `{table}` SET suspected_on = X'00'"
        )))
        .execute(&pool)
        .await
        .expect("rename the mark");
    };
    a_mark_made_by_another_server_counts_for_nothing(store, rename).await;
}
