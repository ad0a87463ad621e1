//! The SQLite store's transactions ([`TransactionalStore`]): a handler's effects and the record of
//! its answer in one SQLite transaction.

use std::sync::Arc;
use std::time::Duration;

use sqlx::{AssertSqlSafe, Connection, SqlSafeStr};

use super::{SqliteStore, db, statement};
use crate::store::sql::steps_error;
use crate::store::step_list;
use crate::store::{
    FailedCommit, Fenced, Fingerprint, IdempotencyStore, LeaseToken, RecordKey, RecordedStep,
    StoreError, StoredResponse, TransactionalStore,
};

/// The savepoint a handler's transaction opens inside its `BEGIN IMMEDIATE`: still there at the
/// completion exactly when the transaction is (SQLite rolls a whole transaction back on its own
/// after some errors, a full disk among them, and the connection is then outside any transaction).
const SAVEPOINT: &str = "axum_idempotency_tx";

impl TransactionalStore for SqliteStore {
    type Transaction = sqlx::Transaction<'static, sqlx::Sqlite>;

    /// Begins a transaction for a handler with `BEGIN IMMEDIATE`: it takes the file's write lock
    /// at once (waiting for it, within the operation timeout, behind this store's other writes
    /// and SQLite's busy timeout), so that every statement of the handler's and the completion
    /// commit together without meeting another writer's lock half-way.
    ///
    /// `idle` is not enforced: SQLite has no idle timeout for a transaction. In the process, the
    /// layer's maximum hold bounds how long the handler may keep the transaction (past it the
    /// handler is cancelled and its transaction rolled back); a process that dies releases the
    /// file's locks with its file handles, at once, and SQLite rolls back what it had not
    /// committed.
    async fn begin(&self, _idle: Duration) -> Result<Self::Transaction, StoreError> {
        let begun = async {
            // This store's turn, while the lock is taken: the handler then holds SQLite's lock
            // itself, and this store's other writes wait for it on SQLite's busy timeout.
            let _turn = self
                .writer
                .clone()
                .acquire_owned()
                .await
                .map_err(|e| StoreError::new("sqlite begin", e))?;
            for _ in 0..=self.pool.options().get_max_connections() {
                let connection = self.pool.acquire().await.map_err(db("begin"))?;
                if connection.is_in_transaction() {
                    // sqlx counts a transaction on it that SQLite ended on its own (a commit or a
                    // rollback that failed after SQLite had rolled back): it would refuse to begin
                    // another. Closed, and another taken.
                    drop(connection.detach());
                    continue;
                }
                let begin = AssertSqlSafe(format!("BEGIN IMMEDIATE; SAVEPOINT {SAVEPOINT}"));
                return sqlx::Transaction::begin(connection, Some(begin.into_sql_str()))
                    .await
                    .map_err(db("begin"));
            }
            Err(StoreError::msg(
                "sqlite begin: every connection of the pool is in a transaction",
            ))
        };
        // A `BEGIN` cut short here is rolled back by sqlx's connection worker, which sees that no
        // transaction took it. (`Transaction::begin` is the constructor sqlx's own `Acquire`
        // implementations call: public, if hidden from its docs.)
        match tokio::time::timeout(self.timeout, begun).await {
            Ok(result) => result,
            Err(_) => Err(self.no_answer("begin")),
        }
    }

    /// Completes the record inside the handler's transaction (not committed here). The
    /// transaction already holds the file's write lock, so this waits on nobody; the layer
    /// commits right after. A transaction that SQLite rolled back on its own (after an error such
    /// as a full disk) is found here, and answered [`StoreError::aborted_transaction`]: the
    /// completion is never written outside the handler's transaction.
    ///
    /// Unlike PostgreSQL, SQLite does not abort a transaction for a statement that failed (a
    /// constraint violated, say): the handler's other statements stand, and a handler that
    /// answers a success after such a failure is recorded and committed with what it wrote.
    async fn complete_in(
        &self,
        tx: &mut Self::Transaction,
        key: &RecordKey,
        lease: LeaseToken,
        _fingerprint: &Fingerprint,
        response: Arc<StoredResponse>,
        retention: Duration,
        steps: &[RecordedStep],
    ) -> Result<Fenced, StoreError> {
        let scope = key.digest();
        let completion = self.completion(&scope, lease, &response, retention)?;
        let steps = steps
            .iter()
            .map(|step| {
                step_list::encode(step)
                    .map(|bytes| crate::util::hex::encode(&bytes))
                    .ok_or_else(|| {
                        StoreError::msg("sqlite complete in transaction: a step too large")
                    })
            })
            .collect::<Result<Vec<_>, StoreError>>()?;
        let done = async {
            if let Err(e) = sqlx::query(sqlx::AssertSqlSafe(format!("RELEASE {SAVEPOINT}")))
                .execute(&mut **tx)
                .await
            {
                return Err(StoreError::aborted_transaction(
                    "sqlite complete in transaction: the transaction was rolled back before the \
                     completion",
                    e,
                ));
            }
            // The steps taken in the transaction, each as `record_step` records one: a lease that
            // no longer holds the record matches nothing, and nothing is completed.
            for hex in &steps {
                let done = sqlx::query(statement(&self.sql.record_step))
                    .bind(&scope[..])
                    .bind(lease.0)
                    .bind(hex.as_str())
                    .execute(&mut **tx)
                    .await
                    .map_err(steps_error::<sqlx::Sqlite>("complete in transaction"))?;
                if done.rows_affected() != 1 {
                    return Ok(Fenced::LeaseLost);
                }
            }
            let done = completion
                .execute(&mut **tx)
                .await
                .map_err(db("complete in transaction"))?;
            if done.rows_affected() == 1 {
                return Ok(Fenced::Done);
            }
            let (finished,): (bool,) = sqlx::query_as(statement(&self.sql.finished_by))
                .bind(&scope[..])
                .bind(lease.0)
                .fetch_one(&mut **tx)
                .await
                .map_err(db("complete in transaction"))?;
            Ok(Fenced::from_held(finished))
        };
        match tokio::time::timeout(self.timeout, done).await {
            Ok(result) => result,
            Err(_) => Err(self.no_answer("complete in transaction")),
        }
    }

    async fn commit(&self, tx: Self::Transaction) -> Result<(), StoreError> {
        match tokio::time::timeout(self.timeout, tx.commit()).await {
            Ok(result) => result.map_err(db("commit")),
            Err(_) => Err(self.no_answer("commit")),
        }
    }

    /// When SQLite ended the transaction on its own (after a full disk, say), sqlx's `ROLLBACK`
    /// would fail and leave sqlx counting a transaction on the connection; a `BEGIN` first gives
    /// it an empty one to end (inside a transaction, that `BEGIN` fails and changes nothing).
    async fn rollback(&self, mut tx: Self::Transaction) -> Result<(), StoreError> {
        let rollback = async {
            let _ = sqlx::query("BEGIN").execute(&mut *tx).await;
            tx.rollback().await
        };
        match tokio::time::timeout(self.timeout, rollback).await {
            Ok(result) => result.map_err(db("rollback")),
            Err(_) => Err(self.no_answer("rollback")),
        }
    }

    /// A failed commit released SQLite's lock (sqlx rolls the transaction back), so the release
    /// finds the record as the commit left it: still held by the lease (released now) when the
    /// commit did not land, finished by it when it did.
    async fn settle_failed_commit(
        &self,
        key: &RecordKey,
        lease: LeaseToken,
    ) -> Result<FailedCommit, StoreError> {
        if self.release(key, lease).await?.is_done() {
            return Ok(FailedCommit::Released);
        }
        Ok(if self.finished_by(&key.digest(), lease).await? {
            FailedCommit::Landed
        } else {
            FailedCommit::Released
        })
    }
}
