//! The MySQL store's transactions ([`TransactionalStore`]): a handler's effects and the record of
//! its answer in one transaction.
//!
//! MySQL has no idle-in-transaction timeout: the session's `wait_timeout` bounds instead how long
//! the server waits for the next statement of a dead client before it ends the session (and rolls
//! its transaction back). The transaction's connection gets one for its life, and its own back in
//! the same round trip as its `COMMIT` or `ROLLBACK`, so a pooled connection keeps the pool's.

use std::sync::Arc;
use std::time::Duration;

use super::sql::wait_seconds;
use super::{MySqlStore, db, error_number, held_after_completion, run};
use crate::store::step_list;
use crate::store::{
    FailedCommit, Fenced, Fingerprint, IdempotencyStore, LeaseToken, RecordKey, RecordedStep,
    StoreError, StoredResponse, TransactionalStore,
};

/// The savepoint made when the transaction begins: gone once the transaction has ended (a deadlock
/// or a lock wait timeout rolled it back, a statement committed it implicitly), which the
/// completion checks before it writes anything.
const SAVEPOINT: &str = "axum_idempotency_tx";

/// Puts the session's own `wait_timeout` back (saved when the transaction began).
const RESTORE_WAIT: &str = "SET @@session.wait_timeout = \
     COALESCE(@axum_idempotency_wait_timeout, @@session.wait_timeout), \
     @axum_idempotency_wait_timeout = NULL";

impl TransactionalStore for MySqlStore {
    type Transaction = sqlx::Transaction<'static, sqlx::MySql>;

    /// Begins a transaction for a handler, at READ COMMITTED whatever the session's level (the
    /// completion must see the newest version of its record, which a heartbeat keeps updating),
    /// from the transaction pool when one is set. Its session's `wait_timeout` is `idle` (what is
    /// left of the claim's maximum hold, in whole seconds): a live handler is never cut for being
    /// slow, and a process that died holding it holds its locks no longer than its hold.
    ///
    /// A begin cut short by the timeout would leave its connection in a transaction: it runs on a
    /// task of its own, which, if it outlives the timeout, ends the transaction it opens.
    async fn begin(&self, idle: Duration) -> Result<Self::Transaction, StoreError> {
        let pool = self.transactions.as_ref().unwrap_or(&self.pool).clone();
        let statement = format!(
            "SET @axum_idempotency_wait_timeout = @@session.wait_timeout, \
                 @@session.wait_timeout = {};\n\
             SET TRANSACTION ISOLATION LEVEL READ COMMITTED;\n\
             START TRANSACTION;\n\
             SAVEPOINT {SAVEPOINT}",
            wait_seconds(idle)
        );
        let (sender, receiver) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            let begun = pool.begin_with(sqlx::AssertSqlSafe(statement)).await;
            if let Err(Ok(tx)) = sender.send(begun) {
                // Nobody waits for it any more.
                let _ = end(tx, "ROLLBACK", None).await;
            }
        });
        match tokio::time::timeout(self.timeout, receiver).await {
            Ok(Ok(result)) => result.map_err(db("begin")),
            Ok(Err(e)) => Err(StoreError::new("mysql begin: the task failed", e)),
            Err(_) => Err(self.no_answer("begin")),
        }
    }

    /// Completes the record inside the handler's transaction (not committed here). From here to
    /// the commit, the transaction holds the record's row: its session's `wait_timeout` becomes
    /// twice the operation timeout (the in-progress TTL is at least that), so a process that dies
    /// between this and its commit leaves the key retakable within about a TTL.
    ///
    /// The transaction must still be the one that began: after a deadlock or a lock wait timeout
    /// that rolled it back (InnoDB rolls back the whole transaction on a deadlock), the handler's
    /// later statements autocommitted on their own, and a completion written now would commit
    /// without the effects it records. Its savepoint is gone then, and the completion answers
    /// [`StoreError::aborted_transaction`].
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
        let completion = self.completion(key, lease, &response, retention)?;
        // The steps taken in the transaction, each as `record_step` records one, after the
        // savepoint's check and before the completion, in the same round trip.
        let scope = key.digest();
        let mut recorded = String::new();
        for step in steps {
            let bytes = step_list::encode(step).ok_or_else(|| {
                StoreError::msg("mysql complete in transaction: a step too large")
            })?;
            recorded.push_str(&self.sql.record_step(&scope, lease, &bytes).sql);
            recorded.push_str(";\n");
        }
        let conn = &mut **tx;
        let done = tokio::time::timeout(self.timeout, async {
            let bounds = self.bounds(conn).await?;
            let sql = format!(
                "RELEASE SAVEPOINT {SAVEPOINT};\n\
                 SET @@session.wait_timeout = {};\n{};\n{recorded}{};\n{}",
                wait_seconds(self.timeout * 2),
                bounds.open,
                completion.sql,
                bounds.close
            );
            run(conn, sql).await.map_err(|(e, _)| e)
        })
        .await;
        let expected = steps.len() + completion.statements + 4;
        match done {
            Ok(Ok(answers)) if answers.len() == expected => {
                // A step that matched nothing: the lease no longer holds the record, and the
                // completion after it matched nothing either.
                if answers[3..3 + steps.len()].iter().any(|a| a.affected != 1) {
                    return Ok(Fenced::LeaseLost);
                }
                held_after_completion(&answers[3 + steps.len()..])
            }
            Ok(Ok(answers)) => Err(StoreError::msg(format!(
                "mysql complete in transaction: {} answers to {expected} statements",
                answers.len(),
            ))),
            Ok(Err(e)) if !steps.is_empty() && crate::store::sql::is_undefined_column(&e) => Err(
                crate::store::sql::steps_error::<sqlx::MySql>("complete in transaction")(e),
            ),
            // 1305: the savepoint does not exist.
            Ok(Err(e)) if error_number(&e) == Some(1305) => Err(StoreError::aborted_transaction(
                "mysql complete in transaction: the transaction had ended (rolled back by the \
                 server, or committed by a statement of the handler's)",
                e,
            )),
            Ok(Err(e)) => Err(db("complete in transaction")(e)),
            Err(_) => Err(self.no_answer("complete in transaction")),
        }
    }

    async fn commit(&self, tx: Self::Transaction) -> Result<(), StoreError> {
        let close = self.bounds.get().map(|b| b.close.as_str());
        match tokio::time::timeout(self.timeout, end(tx, "COMMIT", close)).await {
            Ok(result) => result.map_err(db("commit")),
            Err(_) => Err(self.no_answer("commit")),
        }
    }

    async fn rollback(&self, tx: Self::Transaction) -> Result<(), StoreError> {
        let close = self.bounds.get().map(|b| b.close.as_str());
        match tokio::time::timeout(self.timeout, end(tx, "ROLLBACK", close)).await {
            Ok(result) => result.map_err(db("rollback")),
            Err(_) => Err(self.no_answer("rollback")),
        }
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
        Ok(if self.finished_by(key, lease).await? {
            FailedCommit::Landed
        } else {
            FailedCommit::Released
        })
    }
}

/// Ends `tx` with `end` (`COMMIT` or `ROLLBACK`), its session's own `wait_timeout` (and lock
/// bounds, `close`, which a completion that failed part way may have left) put back in the same
/// round trip, first: a connection that dies before the round trip lands keeps the short one,
/// and the server ends its session (and rolls it back) soon. sqlx still counts the transaction as
/// open; dropped, it sends a `ROLLBACK` when the connection goes back to the pool, which ends
/// nothing any more.
async fn end(
    mut tx: sqlx::Transaction<'static, sqlx::MySql>,
    end: &str,
    close: Option<&str>,
) -> Result<(), sqlx::Error> {
    let sql = match close {
        Some(close) => format!("{close};\n{RESTORE_WAIT};\n{end}"),
        None => format!("{RESTORE_WAIT};\n{end}"),
    };
    run(&mut tx, sql).await.map_err(|(e, _)| e)?;
    drop(tx);
    Ok(())
}
