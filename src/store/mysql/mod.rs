//! The MySQL and MariaDB store: one InnoDB table shared by every instance of an application.

use std::fmt;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use futures_util::TryStreamExt;
use sqlx::mysql::{MySqlConnection, MySqlRow};
use sqlx::pool::PoolConnection;
use sqlx::{Either, MySql, MySqlPool};
use tokio::time::Instant;

mod batched;
mod claim;
mod errors;
mod inspect;
mod migrate;
mod presence;
mod sql;
mod statements;
mod transactional;

use sql::{Bounds, DEFAULT_TABLE, Flavor};
use statements::{Batch, PURGE_BATCH, Statements};

use self::errors::error_number;
use super::{IdempotencyStore, StoreError};
use crate::store::step_list;
use crate::store::{
    ClaimOutcome, ClaimRequest, Fenced, Fingerprint, LeaseToken, RecordKey, RecordedStep,
    StoredResponse,
};

use crate::store::sql::batch::Mode;
use crate::store::sql::{
    self as shared, Backend, DEFAULT_OPERATION_TIMEOUT, InFlight, InvalidTableName,
    MIN_OPERATION_TIMEOUT,
};

/// Records in a MySQL 8 or MariaDB 10.6+ table (InnoDB), shared by every instance of the
/// application.
///
/// Every statement autocommits, so a claim is visible to every other connection before the
/// handler starts, and no lock or transaction is held while the handler runs. Each operation is
/// one round trip: its statements go together, as text, with their values written as hexadecimal
/// or decimal literals (a prepared statement holds one statement only; no text of a client ever
/// reaches the SQL). A claim inserts the record or leaves the row that is there, takes that row by
/// compare-and-swap when it is there to take (expired, released, or stale), and reads it back:
/// one round trip for a fresh key, a replay, a `409`, a `422` and a retake alike. Its read is a
/// statement of its own, so it sees the row of a claim it raced, committed, whatever the isolation
/// level (REPEATABLE READ by default).
///
/// Times are the database's (`UTC_TIMESTAMP(6)`), so the clocks of application machines do not
/// matter. Requirement of the pool's connections: `max_allowed_packet` at least twice the largest
/// recorded body (it is sent in hexadecimal). Autocommit is turned on for each of the store's own
/// batches and put back after them, so a pool whose connections start with `autocommit = 0` works
/// too (a transaction such a connection was left in by the application is committed by it).
///
/// **Bounds on the server.** Each batch sets, for itself, `innodb_lock_wait_timeout` and
/// `lock_wait_timeout` (a table's lock, as `LOCK TABLES` takes it; whole seconds, at least 1) and
/// the statement time limit (`max_statement_time` on MariaDB, which
/// bounds every statement; `max_execution_time` on MySQL, which bounds reads) to four fifths of the
/// operation timeout, and puts the session's own values back at its end, so connections shared
/// with the application keep theirs. A lock wait timeout (1205) or a deadlock (1213) is a
/// retryable error, never a reason to run a handler twice.
///
/// **Connections between operations.** As the Postgres store does, the store keeps the connection
/// of an operation that succeeded for its next operation (for 100 to 200 ms idle, at most 30 s
/// after it came from the pool, at most the pool's size, or half of it when handlers' transactions
/// come from the same pool), so that under load an operation costs its one round trip and not the
/// pool's pings too. A kept connection that died meanwhile (a restart) fails its statement, which
/// then goes once more on a connection from the pool. A connection whose batch failed or was cut
/// by the timeout is closed rather than given back with the store's session values.
#[derive(Clone)]
pub struct MySqlStore {
    pool: MySqlPool,
    /// Where handlers' transactions come from, when not `pool`.
    transactions: Option<MySqlPool>,
    sql: Arc<Statements>,
    timeout: Duration,
    /// The statements that bound each batch, once the server's flavor is known. Shared by clones.
    bounds: Arc<OnceLock<Bounds>>,
    /// Connections kept between operations (see `parking.rs`). Shared by clones.
    parking: Arc<shared::Parking<sqlx::MySql>>,
    /// On a keeper session (`keeper_session`): the presences it shows. Shared by clones.
    presences: Option<Arc<presence::Presences>>,
    /// Claims and completions sent together (SPEC 26). Shared by clones with the same settings.
    batches: Arc<batched::Batches>,
}

impl fmt::Debug for MySqlStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MySqlStore")
            .field("table", &self.sql.table)
            .field("timeout", &self.timeout)
            .field("transaction_pool", &self.transactions.is_some())
            .finish_non_exhaustive()
    }
}

/// What one statement of a batch answered: the rows it changed (or matched), and its rows.
struct Answer {
    affected: u64,
    rows: Vec<MySqlRow>,
}

impl MySqlStore {
    /// A store on the `idempotency_records` table of the pool's database.
    pub fn new(pool: MySqlPool) -> Self {
        MySqlStore {
            pool,
            transactions: None,
            sql: Arc::new(Statements::new(DEFAULT_TABLE)),
            timeout: DEFAULT_OPERATION_TIMEOUT,
            bounds: Arc::default(),
            parking: Arc::default(),
            presences: None,
            batches: Arc::default(),
        }
    }

    /// A store on another table: a lower-case identifier (`[a-z_][a-z0-9_]*`, at most 40
    /// characters), optionally in another database of the same form (`billing.idempotency`).
    /// Names are quoted in every statement, so reserved words such as `order` work too.
    pub fn with_table(pool: MySqlPool, table: &str) -> Result<Self, InvalidTableName> {
        let table = shared::qualified_table(table, ", optionally as database.table")?;
        Ok(MySqlStore {
            sql: Arc::new(Statements::new(table)),
            ..MySqlStore::new(pool)
        })
    }

    /// How long the wait for a connection, and then one operation's statements, may each take
    /// before it fails. Without it, a database that stops answering would hold requests forever.
    /// Default: 5 s (at least 10 ms). The server is told four fifths of it (see the type's docs).
    ///
    /// A claim that times out may still have committed; its record then stays `in_progress` with
    /// no worker and is released by its token in the background, or retaken after the in-progress
    /// TTL: the handler still runs at most once.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout.max(MIN_OPERATION_TIMEOUT);
        self.bounds = Arc::default();
        self.batches = Arc::new(batched::Batches::new(self.batches.mode));
        self
    }

    /// Takes the handlers' transactions ([`IdempotencyTx<sqlx::MySql>`](crate::IdempotencyTx))
    /// from `pool` rather than from the store's own pool, so that transactions held while
    /// handlers run can never use up the connections that claims, heartbeats and completions need.
    /// Both pools must reach the same database.
    pub fn with_transaction_pool(mut self, pool: MySqlPool) -> Self {
        self.transactions = Some(pool);
        // Kept connections are bounded by what this store shares: its own set from here on.
        self.parking = Arc::default();
        self.batches = Arc::new(batched::Batches::new(self.batches.mode));
        self
    }

    /// A test setting: hold each batch of claims and completions until it has `rows` rows (or
    /// 5 ms passed), and send every one, even of one row, through the batch statements, so that
    /// tests run those statements everywhere. Not for production: every operation waits.
    #[cfg(any(test, feature = "test-suite"))]
    #[doc(hidden)]
    pub fn with_batches_held(mut self, rows: usize) -> Self {
        self.batches = Arc::new(batched::Batches::new(Mode::Held(
            crate::store::sql::batch::Forced::holding(rows),
        )));
        self
    }

    /// Every claim and completion sent alone, as before statements went together: the baseline
    /// of the benchmark that measures them.
    #[doc(hidden)]
    pub fn without_batches(mut self) -> Self {
        self.batches = Arc::new(batched::Batches::new(Mode::Off));
        self
    }

    /// Batch statements sent and failed (then sent again row by row), claims and completions
    /// together: for tests.
    #[cfg(any(test, feature = "test-suite"))]
    #[doc(hidden)]
    pub fn batch_counts(&self) -> (u64, u64) {
        let (claims, completions) = (
            self.batches.claims.counts(),
            self.batches.completions.counts(),
        );
        (claims.0 + completions.0, claims.1 + completions.1)
    }

    /// The connection pool.
    pub fn pool(&self) -> &MySqlPool {
        &self.pool
    }

    /// The table name, as configured.
    pub fn table(&self) -> &str {
        &self.sql.table
    }

    fn no_answer(&self, what: &str) -> StoreError {
        StoreError::msg(format!("mysql {what}: no answer within {:?}", self.timeout))
    }

    /// A connection for one operation: one kept from an earlier operation (unless `from_pool`), or
    /// one from the pool within the operation timeout; with when it first came from the pool.
    async fn connection(
        &self,
        what: &'static str,
        from_pool: bool,
    ) -> Result<(PoolConnection<MySql>, Option<Instant>), StoreError> {
        if !from_pool && let Some((connection, since)) = self.parking.take(&self.pool) {
            return Ok((connection, Some(since)));
        }
        match tokio::time::timeout(self.timeout, self.pool.acquire()).await {
            Err(_) => Err(self.no_answer(what)),
            Ok(result) => result.map(|c| (c, None)).map_err(db(what)),
        }
    }

    /// Keeps the connection of an operation that succeeded for the next one (see `parking.rs`).
    fn keep(&self, connection: PoolConnection<MySql>, since: Option<Instant>) {
        let size = self.pool.options().get_max_connections() as usize;
        // A keeper session's pool is its own: it keeps its one connection.
        let capacity = if self.transactions.is_some() || self.presences.is_some() {
            size
        } else {
            size / 2
        };
        self.parking.keep(
            connection,
            since.unwrap_or_else(Instant::now),
            &self.pool,
            capacity,
        );
    }

    /// The bounds of a batch on this server, asking it its version the first time.
    async fn bounds(&self, conn: &mut MySqlConnection) -> Result<&Bounds, sqlx::Error> {
        if let Some(bounds) = self.bounds.get() {
            return Ok(bounds);
        }
        let version: String = sqlx::query_scalar("SELECT VERSION()")
            .fetch_one(&mut *conn)
            .await?;
        Ok(self
            .bounds
            .get_or_init(|| Bounds::new(Flavor::of(&version), self.timeout)))
    }

    /// Sends `batch` between the session's bounds, in one round trip within the operation timeout,
    /// on a kept connection or one from the pool, and answers what each of its statements did.
    ///
    /// A connection whose batch failed is given back only once the session's own values are put
    /// back (else closed); one cut by the timeout is closed (sqlx would keep it out of the pool
    /// until the server answered, for a stalled connection hours). A kept connection found dead
    /// is closed and the batch goes once more on one from the pool: every operation is safe to
    /// repeat under its lease (a claim by its own lease is granted again, a completion by it is
    /// done already, a renewal renews again, a release answers the lease lost).
    async fn batch(
        &self,
        what: &'static str,
        batch: &Batch,
    ) -> Result<Result<Vec<Answer>, sqlx::Error>, StoreError> {
        Ok(self.batch_counted(what, batch).await?.map_err(|(e, _)| e))
    }

    /// `batch`, and, when a statement failed, how many of the batch's own statements had
    /// answered before it (each autocommits: those before it are committed, the one that failed
    /// with a lock wait or its time bound was rolled back); `usize::MAX` when the batch was sent
    /// twice (a kept connection found dead), since the first may have written more.
    async fn batch_counted(
        &self,
        what: &'static str,
        batch: &Batch,
    ) -> Result<Result<Vec<Answer>, (sqlx::Error, usize)>, StoreError> {
        let mut from_pool = false;
        loop {
            let (taken, kept) = self.connection(what, from_pool).await?;
            // Closed if this future is dropped mid-statement (see `in_flight.rs`).
            let mut flight = InFlight::new(taken);
            let done = tokio::time::timeout(self.timeout, async {
                let conn: &mut MySqlConnection = &mut flight;
                let bounds = self.bounds(conn).await.map_err(|e| (e, 0))?;
                let sql = format!("{};\n{};\n{}", bounds.open_own, batch.sql, bounds.close_own);
                run(conn, sql).await
            })
            .await;
            let conn = flight.landed();
            match done {
                Ok(Err((e, _))) if kept.is_some() && MySql::lost_connection(&e) => {
                    drop(conn.detach());
                    from_pool = true;
                }
                Ok(Ok(mut answers)) => {
                    if answers.len() != batch.statements + 2 {
                        drop(conn.detach());
                        let e = sqlx::Error::Protocol(format!(
                            "{} answers to {} statements",
                            answers.len(),
                            batch.statements + 2
                        ));
                        let answered = if from_pool {
                            usize::MAX
                        } else {
                            answers.len().saturating_sub(1)
                        };
                        return Ok(Err((e, answered)));
                    }
                    self.keep(conn, kept);
                    answers.pop();
                    answers.remove(0);
                    return Ok(Ok(answers));
                }
                Ok(Err((e, answered))) => {
                    self.settle_failed(conn, &e).await;
                    // The first answer is the bounds' own statement.
                    let answered = if from_pool {
                        usize::MAX
                    } else {
                        answered.saturating_sub(1)
                    };
                    return Ok(Err((e, answered)));
                }
                Err(_) => {
                    drop(conn.detach());
                    return Err(self.no_answer(what));
                }
            }
        }
    }

    /// A connection whose batch failed part way: the session's own bounds put back, then given
    /// back to the pool; closed if that fails too, or if the connection itself failed.
    async fn settle_failed(&self, mut conn: PoolConnection<MySql>, error: &sqlx::Error) {
        let restore = match (error, self.bounds.get()) {
            (sqlx::Error::Database(_), Some(bounds)) => bounds.close_own.clone(),
            _ => {
                drop(conn.detach());
                return;
            }
        };
        let restored = tokio::time::timeout(
            self.timeout,
            sqlx::raw_sql(sqlx::AssertSqlSafe(restore)).execute(&mut *conn),
        )
        .await;
        if !matches!(restored, Ok(Ok(_))) {
            drop(conn.detach());
        }
    }

    /// `batch`, its errors as the store answers them.
    async fn answers(&self, what: &'static str, batch: &Batch) -> Result<Vec<Answer>, StoreError> {
        self.batch(what, batch).await?.map_err(db(what))
    }
}

/// Runs `sql` (several statements) and answers what each did: a statement's rows come before its
/// result. When one fails: its error, and how many statements had answered before it.
async fn run(conn: &mut MySqlConnection, sql: String) -> Result<Vec<Answer>, (sqlx::Error, usize)> {
    let mut answers = Vec::new();
    let mut rows = Vec::new();
    let mut stream = sqlx::raw_sql(sqlx::AssertSqlSafe(sql)).fetch_many(conn);
    loop {
        let item = match stream.try_next().await {
            Ok(Some(item)) => item,
            Ok(None) => break,
            Err(e) => return Err((e, answers.len())),
        };
        match item {
            Either::Right(row) => rows.push(row),
            Either::Left(done) => answers.push(Answer {
                affected: done.rows_affected(),
                rows: std::mem::take(&mut rows),
            }),
        }
    }
    Ok(answers)
}

/// The first column of the first row of `answer` as an integer, if any.
fn first_integer(answer: Option<&Answer>) -> Result<Option<i64>, StoreError> {
    use sqlx::Row;
    match answer.and_then(|a| a.rows.first()) {
        None => Ok(None),
        Some(row) => row
            .try_get::<Option<i64>, _>(0)
            .map_err(|e| StoreError::new("mysql: unexpected row", e)),
    }
}

/// SHA-256 of a subject: the subject index's key, whatever the subject's length.
fn subject_digest(subject: &str) -> [u8; 32] {
    use sha2::{Digest, Sha256};
    Sha256::digest(subject.as_bytes()).into()
}

impl IdempotencyStore for MySqlStore {
    async fn claim(&self, request: &ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        self.claim_together(request).await
    }

    async fn complete(
        &self,
        key: &RecordKey,
        lease: LeaseToken,
        _fingerprint: &Fingerprint,
        response: Arc<StoredResponse>,
        retention: Duration,
    ) -> Result<Fenced, StoreError> {
        let held = self
            .complete_together(&key.digest(), lease, response, retention)
            .await?;
        Ok(Fenced::from_held(held))
    }

    async fn renew(
        &self,
        key: &RecordKey,
        lease: LeaseToken,
        lifetime: Duration,
    ) -> Result<Fenced, StoreError> {
        let batch = self.sql.renew(&key.digest(), lease, lifetime);
        let answers = self.answers("renew", &batch).await?;
        Ok(Fenced::from_held(
            answers.first().is_some_and(|a| a.affected == 1),
        ))
    }

    async fn release(&self, key: &RecordKey, lease: LeaseToken) -> Result<Fenced, StoreError> {
        let batch = self.sql.release(&key.digest(), lease);
        let answers = self.answers("release", &batch).await?;
        Ok(Fenced::from_held(
            answers.first().is_some_and(|a| a.affected == 1),
        ))
    }

    async fn record_step(
        &self,
        key: &RecordKey,
        lease: LeaseToken,
        step: &RecordedStep,
    ) -> Result<Fenced, StoreError> {
        let bytes = step_list::encode(step)
            .ok_or_else(|| StoreError::msg("mysql record_step: the step is too large"))?;
        let batch = self.sql.record_step(&key.digest(), lease, &bytes);
        let answers = self
            .batch("record_step", &batch)
            .await?
            .map_err(shared::steps_error::<MySql>("record_step"))?;
        Ok(Fenced::from_held(
            answers.first().is_some_and(|a| a.affected == 1),
        ))
    }

    async fn steps(
        &self,
        key: &RecordKey,
        lease: LeaseToken,
    ) -> Result<Option<Vec<RecordedStep>>, StoreError> {
        let batch = self.sql.steps(&key.digest(), lease);
        let answers = self
            .batch("steps", &batch)
            .await?
            .map_err(shared::steps_error::<MySql>("steps"))?;
        let Some(row) = answers.first().and_then(|a| a.rows.first()) else {
            return Ok(None);
        };
        decode_steps(row).map(Some)
    }

    async fn recorded_steps(&self, key: &RecordKey) -> Result<Vec<RecordedStep>, StoreError> {
        let batch = self.sql.recorded_steps(&key.digest());
        let answers = self
            .batch("recorded_steps", &batch)
            .await?
            .map_err(shared::steps_error::<MySql>("recorded_steps"))?;
        match answers.first().and_then(|a| a.rows.first()) {
            Some(row) => decode_steps(row),
            None => Ok(Vec::new()),
        }
    }

    async fn purge_expired(&self) -> Result<u64, StoreError> {
        let batch = self.sql.purge();
        let mut total = 0;
        loop {
            let answers = self.answers("purge", &batch).await?;
            let deleted = answers.last().map_or(0, |a| a.affected);
            total += deleted;
            if deleted < PURGE_BATCH {
                return Ok(total);
            }
        }
    }

    async fn lookup(&self, key: &RecordKey) -> Result<Option<super::RecordInfo>, StoreError> {
        self.lookup_record(key).await
    }

    async fn delete(&self, key: &RecordKey) -> Result<super::Deleted, StoreError> {
        self.delete_record(key).await
    }

    async fn list(
        &self,
        subject: &str,
        request: super::ListRequest,
    ) -> Result<super::RecordPage, StoreError> {
        self.list_records(subject, request).await
    }

    /// A bounded count on the subject index.
    async fn count_records(
        &self,
        subject: &str,
        up_to: u64,
    ) -> Result<Option<crate::store::SubjectUsage>, StoreError> {
        self.count_subject(subject, up_to).await.map(Some)
    }

    fn counts_records(&self) -> bool {
        true
    }

    fn operation_timeout(&self) -> Option<Duration> {
        Some(self.timeout)
    }

    /// The same table through a pool of one connection of its own, made (on first use) on the
    /// keeper's runtime with the store pool's connect options, and the presences, shown through
    /// another connection (see `presence.rs`).
    async fn keeper_session(&self) -> Result<Self, StoreError> {
        let options = (*self.pool.connect_options()).clone();
        let pool = shared::keeper_pool(options.clone(), self.timeout);
        Ok(MySqlStore {
            pool,
            transactions: None,
            parking: Arc::default(),
            presences: Some(Arc::new(presence::Presences::new(options, self.timeout))),
            batches: Arc::new(batched::Batches::new(self.batches.mode)),
            ..self.clone()
        })
    }

    async fn show_presences(
        &self,
        live: &[crate::store::Presence],
        lapse: Duration,
    ) -> Result<(), StoreError> {
        match &self.presences {
            Some(presences) => presences.show(live, lapse).await,
            None => Err(StoreError::msg(
                "mysql: presences are shown through a keeper session",
            )),
        }
    }
}

impl MySqlStore {
    /// The completion's statements (see `Statements::complete`).
    fn completion(
        &self,
        key: &RecordKey,
        lease: LeaseToken,
        response: &StoredResponse,
        retention: Duration,
    ) -> Result<Batch, StoreError> {
        let mut headers = Vec::new();
        super::header_list::write(&response.headers, &mut headers)
            .ok_or_else(|| StoreError::msg("mysql complete: too many headers"))?;
        Ok(self
            .sql
            .complete(&key.digest(), lease, response, &headers, retention))
    }

    /// Whether `lease` finished the record (see `Statements::finished_by`).
    async fn finished_by(&self, key: &RecordKey, lease: LeaseToken) -> Result<bool, StoreError> {
        let batch = Batch::default().push(&self.sql.finished_by(&key.digest(), lease));
        let answers = self.answers("complete", &batch).await?;
        Ok(first_integer(answers.first())? == Some(1))
    }
}

/// A completion's answers: its update matched, or the lease had finished the record already.
fn held_after_completion(answers: &[Answer]) -> Result<Fenced, StoreError> {
    let updated = answers.first().is_some_and(|a| a.affected == 1);
    let finished = first_integer(answers.get(1))? == Some(1);
    Ok(Fenced::from_held(updated || finished))
}

/// A database error as the store answers it (see [`Backend`]).
fn db(what: &'static str) -> impl Fn(sqlx::Error) -> StoreError {
    shared::db::<MySql>(what)
}

/// The steps of a row whose first column is a record's list of them (NULL: none).
fn decode_steps(row: &sqlx::mysql::MySqlRow) -> Result<Vec<RecordedStep>, StoreError> {
    use sqlx::Row;
    let list: Option<Vec<u8>> = row
        .try_get(0)
        .map_err(|e| StoreError::new("mysql steps: unexpected row", e))?;
    step_list::decode(list.as_deref().unwrap_or_default())
        .ok_or_else(|| StoreError::unreadable_record("mysql steps: unreadable"))
}
