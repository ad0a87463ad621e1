//! One harness for the SQL backends (PostgreSQL, MySQL/MariaDB, SQLite): what each gives the tests
//! ([`SqlBackend`]: a fresh store of its own, and another program's hold on its write lock), and
//! the tests every one of them runs ([`sql_backend_tests!`]): sixteen subjects flooding it, the
//! bytes share, its write lock held by another program past the TTL, and a duplicate meeting a
//! slow commit. What only one backend has stays in that backend's module.

use std::time::Duration;

use axum_idempotency::conformance::app::SUITE_STORE_TIMEOUT;
use axum_idempotency::conformance::locked::{
    Lock, a_locked_store_does_not_make_a_live_holder_look_dead,
};
use axum_idempotency::conformance::tenants::{
    a_flood_of_sixteen_subjects_shuts_out_no_other,
    a_subject_past_its_share_of_bytes_is_refused_new_keys_only,
};
use axum_idempotency::store::TransactionalStore;

/// The stores' default operation timeout, as they are deployed, not the suite's short one (kept
/// short for the tests of failing stores): a flood at the layer's `max_running` queues a
/// newcomer's writes behind the flood's, and on a slow disk SQLite's commits (each flushed to
/// disk) take that queue past half a second.
pub(crate) const DEPLOYED_TIMEOUT: Duration = Duration::from_secs(5);

/// The operation timeout of the stores locked by another program: short, so that the TTL (twice
/// it) and twenty runs stay short.
const LOCKED_STORE_TIMEOUT: Duration = Duration::from_millis(150);

/// How long the flood lasts: `FLOOD_SECS`, 20 s by default.
pub(crate) fn flood_secs() -> u64 {
    std::env::var("FLOOD_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20)
}

/// What the shared tests need of an SQL backend.
pub(crate) trait SqlBackend {
    /// Its store.
    type Store: TransactionalStore + Clone;

    /// The operation timeout under which a duplicate meets a slow commit.
    const SLOW_COMMIT_TIMEOUT: Duration;

    /// A migrated store on a table (or file) of its own with the operation timeout `timeout`, and
    /// another program's hold on that store's write lock (a `LOCK TABLE`, `BEGIN IMMEDIATE`).
    async fn fresh(timeout: Duration) -> (Self::Store, Lock);
}

/// The tests every SQL backend runs, in a module `$module` compiled with `$feature`.
macro_rules! sql_backend_tests {
    ($feature:literal, $module:ident, $backend:ty) => {
        #[cfg(feature = $feature)]
        mod $module {
            use super::*;

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn sixteen_subjects_flooding_shut_out_no_other() {
                let (store, _) = <$backend>::fresh(DEPLOYED_TIMEOUT).await;
                a_flood_of_sixteen_subjects_shuts_out_no_other(store, flood_secs()).await;
            }

            #[tokio::test]
            async fn a_subject_past_its_share_of_bytes_is_refused_new_keys_only() {
                let (store, _) = <$backend>::fresh(SUITE_STORE_TIMEOUT).await;
                super::a_subject_past_its_share_of_bytes_is_refused_new_keys_only(store).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn its_write_lock_held_past_the_ttl_does_not_make_a_live_holder_look_dead() {
                let (store, lock) = <$backend>::fresh(LOCKED_STORE_TIMEOUT).await;
                a_locked_store_does_not_make_a_live_holder_look_dead(store, lock).await;
            }

            #[tokio::test]
            async fn steps_in_a_transaction_are_written_with_its_completion() {
                let (store, _) = <$backend>::fresh(SUITE_STORE_TIMEOUT).await;
                super::steps_in_a_transaction_are_written_with_its_completion(store).await;
            }

            #[tokio::test]
            async fn a_subjects_bytes_count_its_steps() {
                let (store, _) = <$backend>::fresh(SUITE_STORE_TIMEOUT).await;
                super::a_subjects_bytes_count_its_steps(store).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_duplicate_meeting_a_slow_commit_is_in_progress() {
                let (store, _) = <$backend>::fresh(<$backend>::SLOW_COMMIT_TIMEOUT).await;
                let first = axum_idempotency::conformance::app::claim_request("slow-commit", b"");
                crate::locked_rows::a_duplicate_meeting_a_slow_commit_is_in_progress(store, first)
                    .await;
            }
        }
    };
}

/// Steps taken in a handler's transaction (SPEC 28) are written in it with the completion, fenced
/// by the lease: rolled back, they are gone with it (a step recorded before stays); under a lease
/// that no longer holds the record, nothing is completed; committed, the record keeps every step
/// in order.
async fn steps_in_a_transaction_are_written_with_its_completion<S: TransactionalStore>(store: S) {
    use axum_idempotency::store::{
        ClaimOutcome, Finished, LeaseToken, RecordState, RecordedStep, StoredResponse,
    };
    let request = axum_idempotency::conformance::app::claim_request("tx-steps", b"");
    let key = &request.key;
    let ClaimOutcome::Claimed { lease, .. } = store.claim(&request).await.expect("claim") else {
        panic!("a fresh key is claimed");
    };
    let step = |name: &str, result: &[u8]| RecordedStep {
        name: name.to_owned(),
        result: result.to_vec(),
    };
    let names =
        |steps: Vec<RecordedStep>| -> Vec<String> { steps.into_iter().map(|s| s.name).collect() };
    let stored = || {
        std::sync::Arc::new(StoredResponse::new(
            Finished::Completed,
            201,
            Vec::new(),
            Some(axum::body::Bytes::from_static(b"{}")),
        ))
    };
    let before = store.record_step(key, lease, &step("reserve", b"7")).await;
    assert!(before.expect("a step before").is_done());
    let idle = Duration::from_secs(30);

    // Rolled back: the completion and its steps are gone; the step before stays.
    let mut tx = store.begin(idle).await.expect("begin");
    let done = store
        .complete_in(
            &mut tx,
            key,
            lease,
            &request.fingerprint,
            stored(),
            request.retention,
            &[step("stock", b"1")],
        )
        .await
        .expect("complete in");
    assert!(done.is_done());
    store.rollback(tx).await.expect("rollback");
    let kept = store.recorded_steps(key).await.expect("steps");
    assert_eq!(names(kept), ["reserve"], "the rolled-back step is gone");
    let info = store.lookup(key).await.expect("lookup").expect("a record");
    assert_eq!(info.state, RecordState::InProgress);

    // Under a lease that does not hold the record: neither a step nor the completion is written.
    let mut tx = store.begin(idle).await.expect("begin");
    let stranger = store
        .complete_in(
            &mut tx,
            key,
            LeaseToken::generate(),
            &request.fingerprint,
            stored(),
            request.retention,
            &[step("stock", b"2")],
        )
        .await
        .expect("complete in");
    assert!(!stranger.is_done(), "a stranger's lease completes nothing");
    store.rollback(tx).await.expect("rollback");

    // Committed: every step, in the order recorded, and the record finished.
    let mut tx = store.begin(idle).await.expect("begin");
    let done = store
        .complete_in(
            &mut tx,
            key,
            lease,
            &request.fingerprint,
            stored(),
            request.retention,
            &[step("stock", b"3"), step("receipt", b"\"sent\"")],
        )
        .await
        .expect("complete in");
    assert!(done.is_done());
    store.commit(tx).await.expect("commit");
    let kept = store.recorded_steps(key).await.expect("steps");
    assert_eq!(
        kept.iter()
            .map(|s| (s.name.as_str(), s.result.as_slice()))
            .collect::<Vec<_>>(),
        [
            ("reserve", &b"7"[..]),
            ("stock", b"3"),
            ("receipt", b"\"sent\"")
        ]
    );
    let info = store.lookup(key).await.expect("lookup").expect("a record");
    assert_eq!(info.state, RecordState::Finished(Finished::Completed));
}

/// The bytes of a subject (its share of bytes, SPEC 20 and 25) count the steps its records keep
/// as they count their answers: 16 steps of 16 KiB take room as a 256 KiB answer does.
async fn a_subjects_bytes_count_its_steps<S: TransactionalStore>(store: S) {
    use axum_idempotency::store::{ClaimOutcome, RecordedStep};
    let request = axum_idempotency::conformance::app::claim_request("counted-steps", b"");
    let ClaimOutcome::Claimed { lease, .. } = store.claim(&request).await.expect("claim") else {
        panic!("a fresh key is claimed");
    };
    let subject = &request.key.subject;
    let before = store.count_records(subject, 10).await.expect("count");
    let before = before.expect("the store counts").bytes;
    for i in 0..3 {
        // Bytes no compression shrinks: PostgreSQL counts steps as it stores them.
        let mut seed = 0x9e37_79b9_u32 ^ i;
        let result = (0..10_000)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 17;
                seed ^= seed << 5;
                seed as u8
            })
            .collect();
        let step = RecordedStep {
            name: format!("step {i}"),
            result,
        };
        let done = store.record_step(&request.key, lease, &step).await;
        assert!(done.expect("recorded").is_done());
    }
    let after = store.count_records(subject, 10).await.expect("count");
    let after = after.expect("the store counts");
    assert_eq!(after.records, 1);
    assert!(
        after.bytes >= before + 30_000,
        "three steps of 10 000 bytes counted: {before} then {}",
        after.bytes
    );
}

sql_backend_tests!("postgres", postgres, Postgres);
sql_backend_tests!("mysql", mysql, MySql);
sql_backend_tests!("sqlite", sqlite, Sqlite);

/// PostgreSQL: a schema of its own; `LOCK TABLE ... IN EXCLUSIVE MODE`, as a non-concurrent
/// `CREATE INDEX` or a migration takes it (renewals, claims and completions wait; the presences,
/// advisory locks, do not).
#[cfg(feature = "postgres")]
pub(crate) struct Postgres;

#[cfg(feature = "postgres")]
impl SqlBackend for Postgres {
    type Store = axum_idempotency::store::PostgresStore;
    const SLOW_COMMIT_TIMEOUT: Duration = Duration::from_secs(1);

    async fn fresh(timeout: Duration) -> (Self::Store, Lock) {
        use sqlx::{Connection, PgConnection};
        let pool = crate::postgres::pool(34).await;
        let schema = crate::postgres::fresh_schema(&pool).await;
        let table = format!("{schema}.idempotency_records");
        let store = Self::Store::with_table(pool, &table)
            .expect("valid table name")
            .with_timeout(timeout);
        store.migrate().await.expect("migrate");
        let url = crate::postgres::database_url();
        let lock: Lock = Box::new(move |hold, held| {
            let (url, table) = (url.clone(), table.clone());
            Box::pin(async move {
                let mut conn = PgConnection::connect(&url).await.expect("connect");
                let mut tx = conn.begin().await.expect("begin");
                sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                    "LOCK TABLE {table} IN EXCLUSIVE MODE"
                )))
                .execute(&mut *tx)
                .await
                .expect("lock the table");
                let _ = held.send(());
                tokio::time::sleep(hold).await;
                tx.rollback().await.expect("unlock");
            })
        });
        (store, lock)
    }
}

/// MySQL/MariaDB: a table of its own; `LOCK TABLES ... WRITE` from another session (every
/// statement on the table waits, reads too; the presences, named locks, do not).
#[cfg(feature = "mysql")]
pub(crate) struct MySql;

#[cfg(feature = "mysql")]
impl SqlBackend for MySql {
    type Store = axum_idempotency::store::MySqlStore;
    // InnoDB waits on a row lock for whole seconds, at least one.
    const SLOW_COMMIT_TIMEOUT: Duration = Duration::from_secs(2);

    async fn fresh(timeout: Duration) -> (Self::Store, Lock) {
        use sqlx::{Connection, MySqlConnection};
        let pool = crate::mysql::pool(16).await;
        let table = crate::mysql::fresh_table(&pool).await;
        let store = Self::Store::with_table(pool, &table)
            .expect("valid table name")
            .with_timeout(timeout);
        store.migrate().await.expect("migrate");
        let url = crate::mysql::mysql_url();
        let lock: Lock = Box::new(move |hold, held| {
            let (url, table) = (url.clone(), table.clone());
            Box::pin(async move {
                let mut conn = MySqlConnection::connect(&url).await.expect("connect");
                sqlx::raw_sql(sqlx::AssertSqlSafe(format!("LOCK TABLES `{table}` WRITE")))
                    .execute(&mut conn)
                    .await
                    .expect("lock the table");
                let _ = held.send(());
                tokio::time::sleep(hold).await;
                sqlx::raw_sql("UNLOCK TABLES")
                    .execute(&mut conn)
                    .await
                    .expect("unlock");
                conn.close().await.expect("close");
            })
        });
        (store, lock)
    }
}

/// SQLite: a file of its own, its pool as `SqliteStore::open` makes it (8 connections, not pinged,
/// as `connect_options` sets them) with a busy timeout of four fifths of the operation timeout, as
/// `open` sets 4 s under 5 s (writers give up on the lock before the store's timeout cuts them); `BEGIN IMMEDIATE` from another connection of the file, as a backup, another
/// application or a `sqlite3` shell takes it (the presences, locked files, are the kernel's).
#[cfg(feature = "sqlite")]
pub(crate) struct Sqlite;

#[cfg(feature = "sqlite")]
impl SqlBackend for Sqlite {
    type Store = axum_idempotency::store::SqliteStore;
    const SLOW_COMMIT_TIMEOUT: Duration = SUITE_STORE_TIMEOUT;

    async fn fresh(timeout: Duration) -> (Self::Store, Lock) {
        use sqlx::Connection;
        use sqlx::sqlite::{SqliteConnectOptions, SqliteConnection, SqlitePoolOptions};
        let path = crate::common::sqlite::fresh_path();
        let options = Self::Store::connect_options(SqliteConnectOptions::new().filename(&path))
            .busy_timeout(timeout * 4 / 5);
        let pool = SqlitePoolOptions::new()
            .max_connections(8)
            .test_before_acquire(false)
            .connect_with(options.clone())
            .await
            .expect("open");
        let store = Self::Store::new(pool).with_timeout(timeout);
        store.migrate().await.expect("migrate");
        let lock: Lock = Box::new(move |hold, held| {
            let options = options.clone();
            Box::pin(async move {
                let mut conn = SqliteConnection::connect_with(&options)
                    .await
                    .expect("open");
                sqlx::raw_sql("BEGIN IMMEDIATE")
                    .execute(&mut conn)
                    .await
                    .expect("take the write lock");
                let _ = held.send(());
                tokio::time::sleep(hold).await;
                sqlx::raw_sql("ROLLBACK")
                    .execute(&mut conn)
                    .await
                    .expect("give it back");
                conn.close().await.expect("close");
            })
        });
        (store, lock)
    }
}
