#![cfg(feature = "sqlite")]
//! `RunOnce::run_in_transaction` on a real SQLite file, whose one write lock makes a transaction
//! held too long visible to every other writer (SPEC 24): the transaction begins at its first use,
//! not before a slow call; at the maximum hold (and after an error or a panic) it is rolled back
//! before the record is released.

use crate::common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum_idempotency::once::{OnceError, OnceTransaction, RunOnce};
use axum_idempotency::store::{
    ClaimOutcome, ClaimRequest, Deleted, FailedCommit, Fenced, Fingerprint, IdempotencyStore,
    LeaseToken, ListRequest, Presence, RecordInfo, RecordKey, RecordPage, SqliteStore, StoreError,
    StoredResponse, TransactionalStore,
};
use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};

/// A migrated store on a file of its own whose writers give up on the lock after 300 ms, and the
/// table of the closures' effects.
async fn store() -> SqliteStore {
    let options = SqliteStore::connect_options(
        SqliteConnectOptions::new().filename(common::sqlite::fresh_path()),
    )
    .busy_timeout(Duration::from_millis(300));
    let pool = SqlitePoolOptions::new()
        .max_connections(4)
        .connect_with(options)
        .await
        .expect("open");
    let store = SqliteStore::new(pool).with_timeout(Duration::from_secs(1));
    store.migrate().await.expect("migrate");
    sqlx::raw_sql("CREATE TABLE effects (message TEXT NOT NULL)")
        .execute(store.pool())
        .await
        .expect("effects table");
    store
}

fn scope(key: &str) -> RecordKey {
    RecordKey {
        key: key.to_owned(),
        subject: "consumer".into(),
        endpoint: "queue orders".into(),
    }
}

async fn effects(store: &SqliteStore, message: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM effects WHERE message = ?1")
        .bind(message)
        .fetch_one(store.pool())
        .await
        .expect("count")
}

/// A closure that waits for its go before its first statement (a slow provider call) holds no
/// transaction meanwhile: other writers of the file go on; then its effect commits with its
/// output.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_transaction_begins_at_its_first_use() {
    let store = store().await;
    let once = RunOnce::builder(store.clone())
        .in_progress_ttl(Duration::from_secs(3))
        .build()
        .expect("valid");
    let go = Arc::new(tokio::sync::Notify::new());
    let waiting = go.clone();
    let run = tokio::spawn({
        let once = once.clone();
        async move {
            once.run_in_transaction(
                scope("slow-call"),
                Fingerprint::of(None, b"1"),
                move |_ctx, mut tx: OnceTransaction<SqliteStore>| async move {
                    // The provider's call, before any statement.
                    waiting.notified().await;
                    sqlx::query("INSERT INTO effects (message) VALUES ('slow-call')")
                        .execute(tx.conn().await.map_err(|e| e.to_string())?)
                        .await
                        .map_err(|e| e.to_string())?;
                    Ok::<_, String>(("charged".to_owned(), tx))
                },
            )
            .await
        }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    // Another write of the file while the closure waits: not held back by its transaction.
    let other = ClaimRequest::new(
        scope("another"),
        Fingerprint::of(None, b"2"),
        Duration::from_secs(3),
        Duration::from_secs(60),
    );
    let claimed = store.claim(&other).await;
    assert!(
        matches!(claimed, Ok(ClaimOutcome::Claimed { .. })),
        "another writer waited on a transaction that wrote nothing yet: {claimed:?}"
    );
    go.notify_one();
    let output = run.await.expect("task");
    assert_eq!(output.expect("ran"), "charged");
    assert_eq!(effects(&store, "slow-call").await, 1);
}

/// A step before the run's transaction is recorded at once (on the store's own connection: the
/// file's write lock is free); one taken after its first use is recorded in it, with the output.
/// So a run that fails after both keeps the first (its retry, the same request, does not run it
/// again) and loses the second with the effect it wrote (the retry runs it again, and the effect
/// happens once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_in_the_transaction_commits_with_it() {
    let store = store().await;
    let once = RunOnce::builder(store.clone())
        .in_progress_ttl(Duration::from_secs(3))
        .max_hold(Duration::from_secs(6))
        .build()
        .expect("valid");
    let reserved = Arc::new(AtomicUsize::new(0));
    let stocked = Arc::new(AtomicUsize::new(0));
    for fail in [true, false] {
        let (reserved, stocked) = (reserved.clone(), stocked.clone());
        let output = once
            .run_in_transaction(
                scope("steps"),
                Fingerprint::of(None, b"1"),
                move |ctx, mut tx: OnceTransaction<SqliteStore>| async move {
                    let reservation = ctx
                        .step("reserve", || async move {
                            Ok::<_, String>(reserved.fetch_add(1, Ordering::SeqCst) as u32 + 7)
                        })
                        .await
                        .map_err(|e| e.to_string())?;
                    assert_eq!(reservation, 7, "the first run's reservation, read back");
                    sqlx::query("INSERT INTO effects (message) VALUES ('steps')")
                        .execute(tx.conn().await.map_err(|e| e.to_string())?)
                        .await
                        .map_err(|e| e.to_string())?;
                    let conn = tx.conn().await.map_err(|e| e.to_string())?;
                    let count = stocked.clone();
                    let stock = ctx
                        .step("stock", || async move {
                            sqlx::query("INSERT INTO effects (message) VALUES ('stock')")
                                .execute(&mut *conn)
                                .await
                                .map_err(|e| e.to_string())?;
                            Ok::<_, String>(count.fetch_add(1, Ordering::SeqCst) as u32)
                        })
                        .await
                        .map_err(|e| e.to_string())?;
                    // Taken already in this transaction: read back, not run again.
                    let again = ctx
                        .step("stock", || async { Ok::<_, String>(99u32) })
                        .await
                        .map_err(|e| e.to_string())?;
                    assert_eq!(again, stock, "the step taken in this run's transaction");
                    if fail {
                        return Err("failed after both steps".to_owned());
                    }
                    Ok::<_, String>((stock, tx))
                },
            )
            .await;
        if fail {
            assert!(matches!(output, Err(OnceError::Failed(_))), "{output:?}");
            assert_eq!(
                effects(&store, "stock").await,
                0,
                "rolled back with its step"
            );
        } else {
            assert_eq!(
                output.expect("ran"),
                1,
                "the step in the transaction ran again"
            );
        }
    }
    assert_eq!(
        reserved.load(Ordering::SeqCst),
        1,
        "the step before it ran once"
    );
    assert_eq!(
        stocked.load(Ordering::SeqCst),
        2,
        "the rolled-back step ran again"
    );
    assert_eq!(effects(&store, "stock").await, 1);
    assert_eq!(effects(&store, "steps").await, 1);
    // Committed with the output: the record keeps both steps, in order.
    let steps = store
        .recorded_steps(&scope("steps"))
        .await
        .expect("recorded steps");
    let names: Vec<&str> = steps.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, ["reserve", "stock"]);
    assert_eq!(steps[1].result, b"1");
}

/// What the store was asked, in order.
#[derive(Clone, Default)]
struct Log(Arc<Mutex<Vec<&'static str>>>);

impl Log {
    fn push(&self, what: &'static str) {
        self.0.lock().expect("log").push(what);
    }
    fn taken(&self) -> Vec<&'static str> {
        std::mem::take(&mut *self.0.lock().expect("log"))
    }
}

/// The SQLite store, its releases and rollbacks logged.
#[derive(Clone)]
struct Logged {
    inner: SqliteStore,
    log: Log,
}

impl IdempotencyStore for Logged {
    async fn claim(&self, request: &ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        self.inner.claim(request).await
    }
    async fn complete(
        &self,
        key: &RecordKey,
        lease: LeaseToken,
        fingerprint: &Fingerprint,
        response: Arc<StoredResponse>,
        retention: Duration,
    ) -> Result<Fenced, StoreError> {
        self.inner
            .complete(key, lease, fingerprint, response, retention)
            .await
    }
    async fn renew(
        &self,
        key: &RecordKey,
        lease: LeaseToken,
        lifetime: Duration,
    ) -> Result<Fenced, StoreError> {
        self.inner.renew(key, lease, lifetime).await
    }
    async fn release(&self, key: &RecordKey, lease: LeaseToken) -> Result<Fenced, StoreError> {
        self.log.push("release");
        self.inner.release(key, lease).await
    }
    async fn purge_expired(&self) -> Result<u64, StoreError> {
        self.inner.purge_expired().await
    }
    async fn lookup(&self, key: &RecordKey) -> Result<Option<RecordInfo>, StoreError> {
        self.inner.lookup(key).await
    }
    async fn delete(&self, key: &RecordKey) -> Result<Deleted, StoreError> {
        self.inner.delete(key).await
    }
    async fn list(&self, subject: &str, page: ListRequest) -> Result<RecordPage, StoreError> {
        self.inner.list(subject, page).await
    }
    async fn count_records(
        &self,
        subject: &str,
        up_to: u64,
    ) -> Result<Option<axum_idempotency::store::SubjectUsage>, StoreError> {
        self.inner.count_records(subject, up_to).await
    }
    fn counts_records(&self) -> bool {
        self.inner.counts_records()
    }

    fn operation_timeout(&self) -> Option<Duration> {
        self.inner.operation_timeout()
    }
    async fn keeper_session(&self) -> Result<Self, StoreError> {
        Ok(Logged {
            inner: self.inner.keeper_session().await?,
            log: self.log.clone(),
        })
    }
    async fn show_presences(&self, live: &[Presence], lapse: Duration) -> Result<(), StoreError> {
        self.inner.show_presences(live, lapse).await
    }
}

impl TransactionalStore for Logged {
    type Transaction = <SqliteStore as TransactionalStore>::Transaction;

    async fn begin(&self, idle: Duration) -> Result<Self::Transaction, StoreError> {
        self.inner.begin(idle).await
    }
    async fn complete_in(
        &self,
        tx: &mut Self::Transaction,
        key: &RecordKey,
        lease: LeaseToken,
        fingerprint: &Fingerprint,
        response: Arc<StoredResponse>,
        retention: Duration,
        steps: &[axum_idempotency::store::RecordedStep],
    ) -> Result<Fenced, StoreError> {
        self.inner
            .complete_in(tx, key, lease, fingerprint, response, retention, steps)
            .await
    }
    async fn commit(&self, tx: Self::Transaction) -> Result<(), StoreError> {
        self.inner.commit(tx).await
    }
    async fn rollback(&self, tx: Self::Transaction) -> Result<(), StoreError> {
        self.log.push("rollback");
        self.inner.rollback(tx).await
    }
    async fn settle_failed_commit(
        &self,
        key: &RecordKey,
        lease: LeaseToken,
    ) -> Result<FailedCommit, StoreError> {
        self.inner.settle_failed_commit(key, lease).await
    }
}

/// A closure that wrote its effect, then ran past the maximum hold (or failed, or panicked): its
/// transaction is rolled back before its record is released, and a later call runs once,
/// alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_transaction_is_rolled_back_before_the_record_is_released() {
    let store = store().await;
    let log = Log::default();
    let logged = Logged {
        inner: store.clone(),
        log: log.clone(),
    };
    // Long enough that a claim answered within a tenth of it (500 ms) is trusted at once on a
    // loaded machine; the hung closures are cut at it (the maximum hold is at least the TTL).
    let ttl = Duration::from_secs(5);
    let once = RunOnce::builder(logged)
        .in_progress_ttl(ttl)
        .max_hold(ttl)
        .build()
        .expect("valid");
    type Tx = OnceTransaction<Logged>;
    let write = |key: &'static str, then: &'static str| {
        move |_ctx, mut tx: Tx| async move {
            sqlx::query("INSERT INTO effects (message) VALUES (?1)")
                .bind(key)
                .execute(tx.conn().await.map_err(|e| e.to_string())?)
                .await
                .map_err(|e| e.to_string())?;
            match then {
                "hang" => tokio::time::sleep(Duration::from_secs(60)).await,
                "fail" => return Err("declined".to_owned()),
                "panic" => panic!("the closure panicked on purpose"),
                _ => {}
            }
            Ok(("charged".to_owned(), tx))
        }
    };
    for (key, then) in [("hung", "hang"), ("failed", "fail"), ("panicked", "panic")] {
        let ended: Result<String, OnceError<String>> = once
            .run_in_transaction(scope(key), Fingerprint::of(None, b"1"), write(key, then))
            .await;
        assert!(ended.is_err(), "{key}: {ended:?}");
        assert_eq!(
            log.taken(),
            vec!["rollback", "release"],
            "{key}: the transaction is rolled back before the record is released"
        );
        assert_eq!(effects(&store, key).await, 0, "{key}: rolled back");
        // The next call runs at once, alone, and commits its effect with its output.
        let again: Result<String, OnceError<String>> = once
            .run_in_transaction(scope(key), Fingerprint::of(None, b"1"), write(key, "done"))
            .await;
        assert_eq!(again.expect("ran again"), "charged", "{key}");
        assert_eq!(effects(&store, key).await, 1, "{key}");
        log.taken();
    }
}

/// A closure that never began its transaction did its work outside it (a provider's call), and
/// that may have happened: cancelled at the maximum hold, or with an output that does not
/// serialize, its scope is settled as `run` settles it, never released to run again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closure_that_never_began_its_transaction_is_never_run_again() {
    let store = store().await;
    // Long enough that a claim answered within a tenth of it (500 ms) is trusted at once on a
    // loaded machine; the hung closures are cut at it (the maximum hold is at least the TTL).
    let ttl = Duration::from_secs(5);
    let once = RunOnce::builder(store.clone())
        .in_progress_ttl(ttl)
        .max_hold(ttl)
        .build()
        .expect("valid");
    let runs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    type Tx = OnceTransaction<SqliteStore>;
    let hang = |runs: Arc<std::sync::atomic::AtomicUsize>| {
        move |_ctx, tx: Tx| async move {
            runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            tokio::time::sleep(Duration::from_secs(60)).await;
            Ok::<_, String>(("charged".to_owned(), tx))
        }
    };
    for call in 0..2 {
        let ended: Result<String, OnceError<String>> = once
            .run_in_transaction(
                scope("hung"),
                Fingerprint::of(None, b"1"),
                hang(runs.clone()),
            )
            .await;
        // Settled as timed out. On a loaded machine the write of that settlement may fail at
        // first and still be going again when the call returns (`NotRecorded`); once it lands,
        // the next call gets it.
        match (call, &ended) {
            (0, Err(OnceError::TimedOut | OnceError::NotRecorded))
            | (1, Err(OnceError::TimedOut)) => {}
            _ => panic!("call {call}: {ended:?}"),
        }
        assert!(
            once.drain().wait(Duration::from_secs(10)).await,
            "the settlement is written"
        );
    }
    assert_eq!(
        runs.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "ran once"
    );

    /// An output that refuses to serialize.
    struct Unserializable;
    impl serde::Serialize for Unserializable {
        fn serialize<S: serde::Serializer>(&self, _: S) -> Result<S::Ok, S::Error> {
            Err(serde::ser::Error::custom("not today"))
        }
    }
    impl<'de> serde::Deserialize<'de> for Unserializable {
        fn deserialize<D: serde::Deserializer<'de>>(_: D) -> Result<Self, D::Error> {
            Err(serde::de::Error::custom("never recorded"))
        }
    }
    let runs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    for call in 0..2 {
        let counted = runs.clone();
        let ended: Result<Unserializable, OnceError<String>> = once
            .run_in_transaction(
                scope("unserializable"),
                Fingerprint::of(None, b"1"),
                move |_ctx, tx: Tx| async move {
                    counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    Ok((Unserializable, tx))
                },
            )
            .await;
        // As above: the first call's settlement (failed) may still be going when it returns.
        match (call, ended) {
            (0, Err(OnceError::Encode(_) | OnceError::NotRecorded))
            | (1, Err(OnceError::Decode(_))) => {}
            (_, other) => panic!("call {call}: {:?}", other.err()),
        }
        assert!(
            once.drain().wait(Duration::from_secs(10)).await,
            "the settlement is written"
        );
    }
    assert_eq!(
        runs.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "ran once"
    );
}
