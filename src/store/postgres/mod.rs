//! The PostgreSQL store: one table shared by every instance of an application.

use crate::store::Fenced;
use std::borrow::Cow;
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;
use sqlx::pool::PoolConnection;
use tokio::time::Instant;

mod batched;
mod claim;
mod connection;
mod inspect;
mod migrate;
mod presence;
mod sql;
mod statements;
mod transactional;
mod values;

use self::connection::{db, lock_timeout_for, on_connection, pg_millis};
use self::values::{micros, parse_headers, printable};

use sql::DEFAULT_TABLE;
use statements::{PURGE_BATCH, Statements};

use super::{IdempotencyStore, StoreError};
use crate::store::Fingerprint;
use crate::store::{
    ClaimOutcome, ClaimRequest, LeaseToken, RecordKey, RecordedStep, StoredResponse,
};

use crate::store::sql::batch::Mode;
use crate::store::sql::{
    self as shared, DEFAULT_OPERATION_TIMEOUT, InvalidTableName, MIN_OPERATION_TIMEOUT,
};

/// Records in a PostgreSQL table, shared by every instance of the application.
///
/// Every statement runs in its own implicit transaction and commits before it returns, so a claim is
/// visible to every other connection before the handler starts, and no lock or transaction is held
/// while the handler runs. A claim is one call of a function that [`migrate`](Self::migrate)
/// creates (`migrations/0002_idempotency_claim.sql`): one round trip for a fresh key, a replay, a
/// `409` and a `422`, also when many requests with one key arrive at once; two when a stale or
/// expired record is retaken. Without the function (a table made by an earlier version, before
/// `migrate()` runs again), a claim that races a concurrent insert of its key takes two.
///
/// Times are the database's `now()`, so the clocks of application machines do not matter.
///
/// **Connections between operations.** sqlx pings a connection every time it goes back to the
/// pool, and by default every time it hands one out (`PgPoolOptions::test_before_acquire`): a round
/// trip each. The store keeps the connection of an operation that succeeded for its next
/// operation instead, so under load a fresh key costs the database its two statements and little
/// else (BENCHMARKS.md, "Server CPU time per request"):
///
/// - a kept connection goes back to the pool after 100 to 200 ms idle, after its operation once it
///   first came from the pool 30 s ago (so the pool's lifetime rules and hooks still apply), and
///   at once when the pool closes (`Pool::close` completes);
/// - a store and its clones keep at most the pool's size, or half of it when handlers'
///   transactions come from the same pool, so that they find connections; give the records a pool
///   of their own ([`with_transaction_pool`](Self::with_transaction_pool), with another pool) to
///   let it keep them all. Two stores built on one pool keep their shares each;
/// - a kept connection is not pinged: one that died while kept (a database restart, a session
///   ended by the server) fails its statement, which then goes once more on a connection from the
///   pool, so the operation succeeds as it would have after the pool's ping.
///
/// A connection taken from the pool is pinged unless the pool says `.test_before_acquire(false)`.
/// Without that ping, a pooled connection that died while idle fails the statement that uses it: a
/// claim answers `503` (or, with `fail_open`, runs the handler unguarded, as for any store
/// failure), and a completion is retried in the background.
#[derive(Clone)]
pub struct PostgresStore {
    pool: PgPool,
    /// Where handlers' transactions come from, when not `pool`.
    transactions: Option<PgPool>,
    /// The statements on the table as configured.
    configured: Arc<Statements>,
    /// The statements on the table in the schema `migrate()` found it in, once it has run (for a
    /// table configured without a schema): no object created later in a schema earlier on the
    /// search path can stand in for it. Shared by clones.
    pinned: Arc<std::sync::OnceLock<Statements>>,
    timeout: Duration,
    /// The server-side `lock_timeout` of every statement: four fifths of `timeout`, as text.
    lock_timeout: Arc<str>,
    /// Whether the key, subject and endpoint are written in clear beside the scope digest.
    scope_columns: bool,
    /// Connections kept between operations (see `parking.rs`). Shared by clones.
    parking: Arc<shared::Parking<sqlx::Postgres>>,
    /// On a keeper session (`keeper_session`): the presences it shows. Shared by clones.
    presences: Option<Arc<presence::Presences>>,
    /// Claims, completions and releases sent together (see `batched.rs`). Shared by clones.
    batches: Arc<batched::Batches>,
}

impl fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresStore")
            .field("table", &self.sql().table)
            .field("timeout", &self.timeout)
            .field("transaction_pool", &self.transactions.is_some())
            .finish_non_exhaustive()
    }
}

impl PostgresStore {
    /// A store on the `idempotency_records` table.
    pub fn new(pool: PgPool) -> Self {
        PostgresStore {
            pool,
            transactions: None,
            configured: Arc::new(Statements::new(DEFAULT_TABLE)),
            pinned: Arc::default(),
            timeout: DEFAULT_OPERATION_TIMEOUT,
            lock_timeout: lock_timeout_for(DEFAULT_OPERATION_TIMEOUT),
            scope_columns: true,
            parking: Arc::default(),
            presences: None,
            batches: Arc::default(),
        }
    }

    /// A store on another table: a lower-case identifier (`[a-z_][a-z0-9_]*`, at most 40 characters),
    /// optionally qualified by a schema of the same form (`billing.idempotency`). Names are quoted in
    /// every statement, so reserved words such as `order` work too.
    pub fn with_table(pool: PgPool, table: &str) -> Result<Self, InvalidTableName> {
        let table = shared::qualified_table(table, ", optionally as schema.table")?;
        Ok(PostgresStore {
            pool,
            transactions: None,
            configured: Arc::new(Statements::new(table)),
            pinned: Arc::default(),
            timeout: DEFAULT_OPERATION_TIMEOUT,
            lock_timeout: lock_timeout_for(DEFAULT_OPERATION_TIMEOUT),
            scope_columns: true,
            parking: Arc::default(),
            presences: None,
            batches: Arc::default(),
        })
    }

    /// How long the wait for a connection, and then one claim, complete, release or purge
    /// statement, may each take
    /// before it fails. Without it, a database that stops answering (a stalled network) would hold
    /// requests forever. Default: 5 s (at least 10 ms).
    ///
    /// A claim that times out may still have committed; its record then stays `in_progress` with no
    /// worker and is retaken after the in-progress TTL: the handler still runs at most once.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout.max(MIN_OPERATION_TIMEOUT);
        self.lock_timeout = lock_timeout_for(self.timeout);
        self.batches = Arc::new(batched::Batches::new(self.batches.mode));
        self
    }

    /// A test setting: hold each batch of claims, completions and releases until it has `rows`
    /// rows (or 5 ms passed), and send every one, even of one row, through the batch statements, so
    /// that tests run those statements everywhere. Not for production: every operation waits.
    #[cfg(any(test, feature = "test-suite"))]
    #[doc(hidden)]
    pub fn with_batches_held(mut self, rows: usize) -> Self {
        self.batches = Arc::new(batched::Batches::new(Mode::Held(
            crate::store::sql::batch::Forced::holding(rows),
        )));
        self
    }

    /// Every claim, completion and release sent alone, each its own statement and commit, as
    /// before statements went together: the baseline of the benchmark that measures them.
    #[doc(hidden)]
    pub fn without_batches(mut self) -> Self {
        self.batches = Arc::new(batched::Batches::new(Mode::Off));
        self
    }

    /// Batch statements sent and failed (then sent again row by row), claims, completions and
    /// releases together: for tests.
    #[cfg(any(test, feature = "test-suite"))]
    #[doc(hidden)]
    pub fn batch_counts(&self) -> (u64, u64) {
        let counts = [
            self.batches.claims.counts(),
            self.batches.completions.counts(),
            self.batches.releases.counts(),
        ];
        counts
            .iter()
            .fold((0, 0), |(sent, failed), (s, f)| (sent + s, failed + f))
    }

    async fn timed<T>(
        &self,
        what: &'static str,
        operation: impl Future<Output = Result<T, sqlx::Error>>,
    ) -> Result<T, StoreError> {
        match tokio::time::timeout(self.timeout, operation).await {
            Ok(result) => result.map_err(db(what)),
            Err(_) => Err(self.no_answer(what)),
        }
    }

    /// A connection for one operation: one kept from an earlier operation (unless `from_pool`), or
    /// one from the pool within the operation timeout; with when it first came from the pool
    /// (`None` for one taken from the pool now).
    async fn connection(
        &self,
        what: &'static str,
        from_pool: bool,
    ) -> Result<(PoolConnection<sqlx::Postgres>, Option<Instant>), StoreError> {
        if !from_pool && let Some((connection, since)) = self.parking.take(&self.pool) {
            return Ok((connection, Some(since)));
        }
        match tokio::time::timeout(self.timeout, self.pool.acquire()).await {
            Err(_) => Err(self.no_answer(what)),
            Ok(result) => result.map(|c| (c, None)).map_err(db(what)),
        }
    }

    /// Keeps the connection of an operation that succeeded for the next one (see `parking.rs`).
    fn keep(&self, connection: PoolConnection<sqlx::Postgres>, since: Option<Instant>) {
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

    fn no_answer(&self, what: &str) -> StoreError {
        StoreError::msg(format!(
            "postgres {what}: no answer within {:?}",
            self.timeout
        ))
    }

    /// Takes the handlers' transactions ([`IdempotencyTx`](crate::IdempotencyTx)) from `pool` rather than from the store's
    /// own pool, so that transactions held while handlers run can never use up the connections that
    /// claims, heartbeats and completions need (with one pool, as many slow transactional requests
    /// as the pool has connections stop every other request of the instance, and the heartbeats of
    /// their own claims). Both pools must reach the same database.
    pub fn with_transaction_pool(mut self, pool: PgPool) -> Self {
        self.transactions = Some(pool);
        // Kept connections are bounded by what this store shares: its own set from here on.
        self.parking = Arc::default();
        self.batches = Arc::new(batched::Batches::new(self.batches.mode));
        self
    }

    /// Writes the `idempotency_key`, `subject` and `endpoint` columns empty: a record is found by
    /// its `scope` digest alone, so nothing of the key or the subject (often personal data) is kept
    /// in clear, at the cost of reading records by hand. With an `EncryptedStore` and a fingerprint
    /// secret, what is left in clear is digests, statuses, times and the sealed answer. Records
    /// written before keep their columns; it changes nothing else.
    pub fn without_scope_columns(mut self) -> Self {
        self.scope_columns = false;
        self.batches = Arc::new(batched::Batches::new(self.batches.mode));
        self
    }

    /// The connection pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The table name, as configured.
    pub fn table(&self) -> &str {
        &self.configured.table
    }

    /// The statements to send: on the table in the schema `migrate()` found it in, once it has
    /// run, else as configured.
    fn sql(&self) -> &Statements {
        self.pinned.get().unwrap_or(&self.configured)
    }

    /// The completion statement `sql` (`complete` or `complete_in`), bound: see
    /// [`IdempotencyStore::complete`].
    fn completion<'q>(
        &'q self,
        sql: &'q str,
        scope: &'q [u8; 32],
        lease: LeaseToken,
        response: &'q StoredResponse,
        retention: Duration,
    ) -> sqlx::query::QueryAs<'q, sqlx::Postgres, (bool,), sqlx::postgres::PgArguments> {
        let (names, values): (Vec<&str>, Vec<&[u8]>) = response
            .headers
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_bytes()))
            .unzip();
        let body = (!response.body_omitted).then_some(&response.body[..]);
        sqlx::query_as(sqlx::AssertSqlSafe(sql))
            .bind(&scope[..])
            .bind(lease.0)
            .bind(response.outcome.as_str())
            .bind(i16::try_from(response.status).unwrap_or(500))
            .bind(names)
            .bind(values)
            .bind(body)
            .bind(micros(retention))
            .bind(&*self.lock_timeout)
    }

    /// Whether `lease` finished the record (see `Statements::finished_by`).
    async fn finished_by(&self, scope: &[u8; 32], lease: LeaseToken) -> Result<bool, StoreError> {
        let (finished,): (bool,) = on_connection!(self, "complete", conn => {
            sqlx::query_as(sqlx::AssertSqlSafe(self.sql().finished_by.as_str()))
                .bind(&scope[..])
                .bind(lease.0)
                .fetch_one(&mut *conn)
        })?
        .map_err(db("complete"))?;
        Ok(finished)
    }

    /// A subject or endpoint as its column keeps it: printable, or empty without scope columns.
    fn scope_column<'a>(&self, part: &'a str) -> Cow<'a, str> {
        if self.scope_columns {
            printable(part)
        } else {
            Cow::Borrowed("")
        }
    }

    /// A statement on one record held by `lease`: binds its scope as `$1` and the lease as `$2`.
    fn leased<'q>(
        &'q self,
        sql: &'q str,
        scope: &'q [u8; 32],
        lease: LeaseToken,
    ) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(&scope[..])
            .bind(lease.0)
    }
}

impl IdempotencyStore for PostgresStore {
    async fn claim(&self, request: &ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        let scope = request.key.digest();
        match self.claim_together(request, &scope).await? {
            Some(row) => self.decide(request, &scope, &row).await,
            None => Ok(ClaimOutcome::InProgress),
        }
    }

    async fn complete(
        &self,
        key: &RecordKey,
        lease: LeaseToken,
        _fingerprint: &Fingerprint,
        response: Arc<StoredResponse>,
        retention: Duration,
    ) -> Result<Fenced, StoreError> {
        let scope = key.digest();
        let held = self
            .complete_together(&scope, lease, response, retention)
            .await?;
        if held {
            return Ok(Fenced::Done);
        }
        self.finished_by(&scope, lease).await.map(Fenced::from_held)
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

    /// A bounded count on the subject index; `None` without scope columns (subjects are not
    /// kept).
    async fn count_records(
        &self,
        subject: &str,
        up_to: u64,
    ) -> Result<Option<crate::store::SubjectUsage>, StoreError> {
        if !self.scope_columns {
            return Ok(None);
        }
        self.count_subject(subject, up_to).await.map(Some)
    }

    fn counts_records(&self) -> bool {
        self.scope_columns
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
        Ok(PostgresStore {
            pool,
            transactions: None,
            parking: Arc::default(),
            presences: Some(Arc::new(presence::Presences::new(options, self.timeout))),
            batches: Arc::default(),
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
                "postgres: presences are shown through a keeper session",
            )),
        }
    }

    async fn renew(
        &self,
        key: &RecordKey,
        lease: LeaseToken,
        lifetime: Duration,
    ) -> Result<Fenced, StoreError> {
        let scope = key.digest();
        let done = on_connection!(self, "renew", conn => {
            self.leased(&self.sql().renew, &scope, lease)
                .bind(micros(lifetime))
                .bind(&*self.lock_timeout)
                .execute(&mut *conn)
        })?
        .map_err(db("renew"))?;
        Ok(Fenced::from_held(done.rows_affected() == 1))
    }

    /// One statement for all: the rows it renewed are `Done`, those no longer held `LeaseLost`; a
    /// row another transaction had locked (skipped, not waited for) is an error for its lease
    /// alone, retried by the keeper. An error of the statement is every lease's.
    async fn renew_many(
        &self,
        leases: &[(&RecordKey, LeaseToken)],
        lifetime: Duration,
    ) -> Vec<Result<Fenced, StoreError>> {
        if let [(key, lease)] = leases {
            return vec![self.renew(key, *lease, lifetime).await];
        }
        let scopes: Vec<Vec<u8>> = leases
            .iter()
            .map(|(key, _)| key.digest().to_vec())
            .collect();
        let tokens: Vec<i64> = leases.iter().map(|(_, lease)| lease.0).collect();
        let answered = on_connection!(self, "renew", conn => {
            sqlx::query_as::<_, (Vec<u8>, i64, bool, bool)>(sqlx::AssertSqlSafe(
                self.sql().renew_many.as_str(),
            ))
            .bind(&scopes)
            .bind(&tokens)
            .bind(micros(lifetime))
            .bind(&*self.lock_timeout)
            .fetch_all(&mut *conn)
        })
        .and_then(|done| done.map_err(db("renew")));
        match answered {
            Ok(rows) => {
                let by_pair: std::collections::HashMap<(Vec<u8>, i64), (bool, bool)> = rows
                    .into_iter()
                    .map(|(scope, lease, renewed, held)| ((scope, lease), (renewed, held)))
                    .collect();
                scopes
                    .into_iter()
                    .zip(tokens)
                    .map(|pair| match by_pair.get(&pair) {
                        Some((true, _)) => Ok(Fenced::Done),
                        Some((false, true)) => Err(StoreError::msg(
                            "postgres renew: the record's row is locked by another transaction",
                        )),
                        _ => Ok(Fenced::LeaseLost),
                    })
                    .collect()
            }
            Err(e) => {
                let message = e.to_string();
                leases
                    .iter()
                    .map(|_| Err(StoreError::msg(message.clone())))
                    .collect()
            }
        }
    }

    async fn release(&self, key: &RecordKey, lease: LeaseToken) -> Result<Fenced, StoreError> {
        let scope = key.digest();
        self.release_row(&scope, lease).await.map(Fenced::from_held)
    }

    async fn record_step(
        &self,
        key: &RecordKey,
        lease: LeaseToken,
        step: &RecordedStep,
    ) -> Result<Fenced, StoreError> {
        let scope = key.digest();
        let done = on_connection!(self, "record_step", conn => {
            self.leased(&self.sql().record_step, &scope, lease)
                .bind(step.name.as_str())
                .bind(step.result.as_slice())
                .bind(&*self.lock_timeout)
                .execute(&mut *conn)
        })?
        .map_err(crate::store::sql::steps_error::<sqlx::Postgres>(
            "record_step",
        ))?;
        Ok(Fenced::from_held(done.rows_affected() == 1))
    }

    async fn steps(
        &self,
        key: &RecordKey,
        lease: LeaseToken,
    ) -> Result<Option<Vec<RecordedStep>>, StoreError> {
        let scope = key.digest();
        type Row = (Option<Vec<String>>, Option<Vec<Vec<u8>>>);
        let row: Option<Row> = on_connection!(self, "steps", conn => {
            sqlx::query_as(sqlx::AssertSqlSafe(self.sql().steps.as_str()))
                .bind(&scope[..])
                .bind(lease.0)
                .fetch_optional(&mut *conn)
        })?
        .map_err(crate::store::sql::steps_error::<sqlx::Postgres>("steps"))?;
        let Some((names, results)) = row else {
            return Ok(None);
        };
        step_list(names, results).map(Some)
    }

    async fn recorded_steps(&self, key: &RecordKey) -> Result<Vec<RecordedStep>, StoreError> {
        let scope = key.digest();
        type Row = (Option<Vec<String>>, Option<Vec<Vec<u8>>>);
        let row: Option<Row> = on_connection!(self, "recorded_steps", conn => {
            sqlx::query_as(sqlx::AssertSqlSafe(
                self.sql().inspection.recorded_steps.as_str(),
            ))
            .bind(&scope[..])
            .fetch_optional(&mut *conn)
        })?
        .map_err(crate::store::sql::steps_error::<sqlx::Postgres>(
            "recorded_steps",
        ))?;
        match row {
            Some((names, results)) => step_list(names, results),
            None => Ok(Vec::new()),
        }
    }

    async fn purge_expired(&self) -> Result<u64, StoreError> {
        let mut total = 0;
        loop {
            let done = on_connection!(self, "purge", conn => {
                sqlx::query(sqlx::AssertSqlSafe(self.sql().purge.as_str()))
                    .bind(&*self.lock_timeout)
                    .execute(&mut *conn)
            })?
            .map_err(db("purge"))?;
            total += done.rows_affected();
            if done.rows_affected() < PURGE_BATCH as u64 {
                return Ok(total);
            }
        }
    }
}

/// The steps of a row's two columns, paired in order (NULL columns: none).
fn step_list(
    names: Option<Vec<String>>,
    results: Option<Vec<Vec<u8>>>,
) -> Result<Vec<RecordedStep>, StoreError> {
    let (names, results) = (names.unwrap_or_default(), results.unwrap_or_default());
    if names.len() != results.len() {
        return Err(StoreError::unreadable_record(
            "postgres steps: as many names as results were expected",
        ));
    }
    Ok(names
        .into_iter()
        .zip(results)
        .map(|(name, result)| RecordedStep { name, result })
        .collect())
}
