//! The Postgres store's transactions ([`TransactionalStore`]): a handler's effects and the record of
//! its answer in one transaction.

use std::sync::Arc;
use std::time::Duration;

use super::{PostgresStore, db, pg_millis};
use crate::store::{
    FailedCommit, Fenced, Fingerprint, IdempotencyStore, LeaseToken, RecordKey, RecordedStep,
    StoreError, StoredResponse, TransactionalStore,
};

impl TransactionalStore for PostgresStore {
    type Transaction = sqlx::Transaction<'static, sqlx::Postgres>;

    /// Begins a transaction for a handler, at READ COMMITTED whatever the database's default (the
    /// completion must see the newest version of its record, which a heartbeat keeps updating),
    /// from the transaction pool when one is set.
    ///
    /// A `BEGIN` cut short by a timeout would leave its connection in the pool inside an open
    /// transaction, so it is never cut short: it runs on a task of its own, and if it outlives the
    /// timeout, the transaction it opens is dropped there, which rolls it back.
    ///
    /// The transaction may stay idle (between two statements of the handler's) for at most
    /// `idle`, what is left of the claim's maximum hold: a live handler is never cut for being
    /// slow, and a process that died holding it holds its locks no longer than its hold.
    async fn begin(&self, idle: Duration) -> Result<Self::Transaction, StoreError> {
        let pool = self.transactions.as_ref().unwrap_or(&self.pool).clone();
        let statement = format!(
            "BEGIN ISOLATION LEVEL READ COMMITTED; \
             SET LOCAL idle_in_transaction_session_timeout = '{}ms'",
            pg_millis(idle)
        );
        let mut begun =
            tokio::spawn(async move { pool.begin_with(sqlx::AssertSqlSafe(statement)).await });
        match tokio::time::timeout(self.timeout, &mut begun).await {
            Ok(Ok(result)) => result.map_err(db("begin")),
            Ok(Err(e)) => Err(StoreError::new("postgres begin: the task failed", e)),
            Err(_) => Err(StoreError::msg(format!(
                "postgres begin: no answer within {:?}",
                self.timeout
            ))),
        }
    }

    /// Completes the record inside the handler's transaction (not committed here). From here to
    /// the commit, the transaction holds the record's row: it may stay idle for at most twice the
    /// operation timeout (the in-progress TTL is at least that), so a process that dies between
    /// this and its commit leaves the key retakable within about a TTL.
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
        let idle = format!("{}ms", pg_millis(self.timeout * 2));
        let completion = self
            .completion(&self.sql().complete_in, &scope, lease, &response, retention)
            .bind(idle.as_str());
        let written = async {
            // The steps taken in the transaction, each as `record_step` records one: a lease that
            // no longer holds the record matches nothing, and nothing is completed. The first
            // locks the record's row: the transaction's idle bound shrinks first, as the
            // completion's own does, so that a process that dies from here on leaves the key
            // retakable within about a TTL, not at the end of its maximum hold.
            if !steps.is_empty() {
                sqlx::query("SELECT set_config('idle_in_transaction_session_timeout', $1, true)")
                    .bind(idle.as_str())
                    .execute(&mut **tx)
                    .await?;
            }
            for step in steps {
                let done = self
                    .leased(&self.sql().record_step, &scope, lease)
                    .bind(step.name.as_str())
                    .bind(step.result.as_slice())
                    .bind(&*self.lock_timeout)
                    .execute(&mut **tx)
                    .await?;
                if done.rows_affected() != 1 {
                    return Ok((false,));
                }
            }
            completion.fetch_one(&mut **tx).await
        };
        match tokio::time::timeout(self.timeout, written).await {
            Ok(Ok((held,))) => Ok(Fenced::from_held(held)),
            Ok(Err(e)) if !steps.is_empty() && crate::store::sql::is_undefined_column(&e) => Err(
                crate::store::sql::steps_error::<sqlx::Postgres>("complete in transaction")(e),
            ),
            Ok(Err(e)) => {
                // SQLSTATE 25P02: a statement of the handler's had failed, nothing can commit.
                let aborted = e
                    .as_database_error()
                    .and_then(|d| d.code())
                    .is_some_and(|code| code == "25P02");
                Err(if aborted {
                    StoreError::aborted_transaction("postgres complete in transaction", e)
                } else {
                    StoreError::new("postgres complete in transaction", e)
                })
            }
            Err(_) => Err(StoreError::msg(format!(
                "postgres complete in transaction: no answer within {:?}",
                self.timeout
            ))),
        }
    }

    async fn commit(&self, tx: Self::Transaction) -> Result<(), StoreError> {
        self.timed("commit", tx.commit()).await
    }

    async fn rollback(&self, tx: Self::Transaction) -> Result<(), StoreError> {
        self.timed("rollback", tx.rollback()).await
    }

    /// Releasing waits for the failed transaction's row lock, so it releases the record only if
    /// the commit did not happen; if the record is finished by this lease instead, the commit
    /// landed and its answer was lost on the way.
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
