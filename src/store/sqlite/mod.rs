//! The SQLite store: records in one SQLite file, for an application on one machine without a
//! database server.

use std::fmt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use sqlx::pool::PoolConnection;
use sqlx::sqlite::{
    Sqlite, SqliteArguments, SqliteConnectOptions, SqliteJournalMode, SqlitePool,
    SqlitePoolOptions, SqliteSynchronous,
};
use sqlx::{AssertSqlSafe, query::Query};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

mod batched;
mod claim;
mod clock;
mod inspect;
mod migrate;
mod presence;
mod renew;
mod statements;
mod transactional;

use statements::{DEFAULT_TABLE, PURGE_BATCH, Statements};

use super::{IdempotencyStore, StoreError};
use crate::store::step_list;
use crate::store::{
    ClaimOutcome, ClaimRequest, Deleted, Fenced, Fingerprint, LeaseToken, ListRequest, RecordInfo,
    RecordKey, RecordPage, RecordedStep, StoredResponse,
};

use crate::store::sql::batch::Mode;
use crate::store::sql::{
    self as shared, Backend, DEFAULT_OPERATION_TIMEOUT, InvalidTableName, MIN_OPERATION_TIMEOUT,
};

/// How long a statement of [`SqliteStore::connect_options`]' connections waits for another
/// writer's lock before it fails with `SQLITE_BUSY`: under the default operation timeout, so that
/// SQLite answers before the store gives up on the statement.
const DEFAULT_BUSY_TIMEOUT: Duration = Duration::from_secs(4);
/// The connections of the pool [`SqliteStore::open`] makes.
const OPEN_CONNECTIONS: u32 = 8;

/// Records in one SQLite file: the store for an application of one instance (or a few processes on
/// one machine) that has no database server. Records survive restarts and crashes of the process,
/// and a handler's effects can commit in the same SQLite transaction as the record of its answer
/// ([`IdempotencyTx<sqlx::Sqlite>`](crate::IdempotencyTx)).
///
/// ```no_run
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// use axum_idempotency::IdempotencyLayer;
/// use axum_idempotency::store::SqliteStore;
///
/// let store = SqliteStore::open("idempotency.db").await?; // made when absent
/// store.migrate().await?;
/// let layer = IdempotencyLayer::builder(store).transactions(true).build()?;
/// # let _ = layer;
/// # Ok(())
/// # }
/// ```
///
/// **Durability.** [`open`](Self::open) (and [`connect_options`](Self::connect_options), for a pool
/// of your own) puts the file in WAL mode with `synchronous=FULL`: every commit (a claim, a
/// completion) is on disk before the store answers, so a record survives a crash of the process
/// and a loss of power. `synchronous=NORMAL` would skip the disk flush of each commit in WAL mode:
/// safe across a crash of the process, but a power loss could forget the last records, and a
/// payment retried after it would run again (with a new derived key). For payments that is the
/// wrong trade, so FULL is what the store asks for.
///
/// **Writers take turns.** SQLite lets one connection of the file write at a time (WAL lets
/// readers go on meanwhile). A claim reads first, without the write lock: a replay, a `422` and a
/// `409` need no write, and answer at once even while another writer holds the lock. A fresh key
/// then inserts, and a stale, expired or released record is taken by a compare-and-swap on the
/// lease it was read with; the write sees the newest committed row, so a claim that loses a race
/// reads the winner's record. The writes of this store and its clones wait for one another in
/// the process (in the order they came), so that they never spin on SQLite's busy handler against
/// each other; against other processes, and against handlers' transactions, a write waits on
/// SQLite's busy timeout. A write that does not get the lock within its timeout fails, and the
/// layer answers `503`: never a second run.
///
/// **A handler's transaction holds the write lock** from its first statement (`BEGIN IMMEDIATE`)
/// to its commit: meanwhile no other write of the file goes through (claims of new keys,
/// heartbeats, completions wait, and fail after the timeout). Keep transactional handlers short,
/// and do slow calls (a payment provider) before the first statement. SQLite has no idle
/// timeout for a transaction: in the process, the layer's maximum hold (`max_hold`) bounds how
/// long one may stay open (past it the handler is cancelled and its transaction rolled back); a
/// process that dies releases its locks with its file handles, at once.
///
/// **Several processes on one file** work (WAL on a local file system): each process's writes take
/// turns with the others' through SQLite's file locks and busy timeout. Not on a network file
/// system, whose locks SQLite cannot trust, and not across machines: use the Postgres store there.
///
/// **Times** are microseconds since the Unix epoch from the clock of the process that writes
/// them; processes on one machine share it.
///
/// **A pool of your own** needs, on every connection: `journal_mode=WAL` (set once in the file;
/// `migrate()` sets it when it can), `synchronous=FULL` (or NORMAL, knowing the trade above), and a
/// `busy_timeout` a little under the store's timeout ([`with_timeout`](Self::with_timeout)): a
/// write that waits on another writer then fails with `SQLITE_BUSY` before the store's timeout
/// cuts it. [`connect_options`](Self::connect_options) sets all three.
#[derive(Clone)]
pub struct SqliteStore {
    pool: SqlitePool,
    sql: Arc<Statements>,
    timeout: Duration,
    /// One write at a time from this store and its clones: the others wait here, in order, rather
    /// than on SQLite's busy handler, which polls.
    writer: Arc<Semaphore>,
    clock: clock::Clock,
    /// The folder of the database's presence files (`None`: an in-memory database), found at
    /// the first claim that needs it. Shared by clones.
    folder: Arc<std::sync::OnceLock<Option<std::path::PathBuf>>>,
    /// On a keeper session (`keeper_session`): the presences it shows.
    presences: Option<Arc<presence::Presences>>,
    /// Inserts and completions written together (see `batched.rs`). Shared by clones.
    batches: Arc<batched::Batches>,
}

impl fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqliteStore")
            .field("table", &self.sql.table)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl SqliteStore {
    /// A store on the `idempotency_records` table of `pool`'s database. See the type's docs for
    /// the settings the pool's connections need ([`connect_options`](Self::connect_options) has
    /// them).
    pub fn new(pool: SqlitePool) -> Self {
        Self::on(pool, DEFAULT_TABLE)
    }

    /// A store on another table: a lower-case identifier (`[a-z_][a-z0-9_]*`, at most 40
    /// characters, not starting with `sqlite_`), of the database the pool opens (not an attached
    /// one). Names are quoted in every statement, so reserved words such as `order` work too.
    pub fn with_table(pool: SqlitePool, table: &str) -> Result<Self, InvalidTableName> {
        Ok(Self::on(pool, shared::plain_table(table)?))
    }

    fn on(pool: SqlitePool, table: &str) -> Self {
        SqliteStore {
            pool,
            sql: Arc::new(Statements::new(table)),
            timeout: DEFAULT_OPERATION_TIMEOUT,
            writer: Arc::new(Semaphore::new(1)),
            clock: clock::Clock::default(),
            folder: Arc::default(),
            presences: None,
            batches: Arc::default(),
        }
    }

    /// A store on the SQLite file at `path`, made when absent, through a pool of its own (8
    /// connections) with the connection settings [`connect_options`](Self::connect_options) gives. Call
    /// [`migrate`](Self::migrate) before it serves claims.
    pub async fn open(path: impl AsRef<Path>) -> Result<Self, StoreError> {
        let options = Self::connect_options(SqliteConnectOptions::new().filename(path));
        let pool = SqlitePoolOptions::new()
            .max_connections(OPEN_CONNECTIONS)
            // A connection to a local file does not die while idle: no ping before each use.
            .test_before_acquire(false)
            .connect_with(options)
            .await
            .map_err(|e| StoreError::new("sqlite: could not open the database", e))?;
        Ok(Self::new(pool))
    }

    /// `options` with what the store needs of every connection: the file made when absent, WAL
    /// mode, `synchronous=FULL` (each commit on disk before it returns), and a busy timeout of 4 s
    /// (under the default operation timeout of 5 s; with a shorter
    /// [`with_timeout`](Self::with_timeout), set a shorter one after this). For a pool of your own,
    /// from a path or a URL:
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// use std::str::FromStr;
    /// use axum_idempotency::sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};
    /// use axum_idempotency::store::SqliteStore;
    ///
    /// let options = SqliteStore::connect_options(SqliteConnectOptions::from_str("sqlite://app.db")?);
    /// let pool = SqlitePoolOptions::new().max_connections(8).connect_with(options).await?;
    /// let store = SqliteStore::new(pool);
    /// # let _ = store;
    /// # Ok(())
    /// # }
    /// ```
    pub fn connect_options(options: SqliteConnectOptions) -> SqliteConnectOptions {
        options
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Full)
            .busy_timeout(DEFAULT_BUSY_TIMEOUT)
    }

    /// How long the wait for the write turn and a connection, and then one statement, may each
    /// take before it fails. Default: 5 s (at least 10 ms). Give the pool's connections a busy
    /// timeout under it (see [`connect_options`](Self::connect_options)).
    ///
    /// A claim that times out may still have committed; its record then stays `in_progress` with no
    /// worker, is released by its token in the background, or retaken after the in-progress TTL:
    /// the handler still runs at most once.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout.max(MIN_OPERATION_TIMEOUT);
        self.batches = Arc::new(batched::Batches::new(self.batches.mode));
        self
    }

    /// A test setting: hold each batch of inserts and completions until it has `rows` rows (or
    /// 5 ms passed), and write every one, even of one row, in a transaction of the batch, so that
    /// tests run that path everywhere. Not for production: every write waits.
    #[cfg(any(test, feature = "test-suite"))]
    #[doc(hidden)]
    pub fn with_batches_held(mut self, rows: usize) -> Self {
        self.batches = Arc::new(batched::Batches::new(Mode::Held(
            crate::store::sql::batch::Forced::holding(rows),
        )));
        self
    }

    /// Every insert and completion written alone, each in a transaction of its own, as before
    /// writes went together: the baseline of the benchmark that measures them.
    #[doc(hidden)]
    pub fn without_batches(mut self) -> Self {
        self.batches = Arc::new(batched::Batches::new(Mode::Off));
        self
    }

    /// Batch transactions written and failed (then written again row by row): for tests.
    #[cfg(any(test, feature = "test-suite"))]
    #[doc(hidden)]
    pub fn batch_counts(&self) -> (u64, u64) {
        let (a, b) = (
            self.batches.inserts.counts(),
            self.batches.completions.counts(),
        );
        (a.0 + b.0, a.1 + b.1)
    }

    /// The connection pool.
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    /// This store with its wall clock stepped by `step` (back when `back`), as an operator or NTP
    /// steps the machine's: for tests of the store's staleness, which the boot clock keeps.
    #[cfg(feature = "test-suite")]
    #[doc(hidden)]
    pub fn with_wall_clock_stepped(mut self, step: Duration, back: bool) -> Self {
        self.clock = self.clock.stepped(step, back);
        self
    }

    /// The folder of the database's presence files; `None` for an in-memory database.
    fn presence_folder(&self) -> Option<&std::path::Path> {
        self.folder
            .get_or_init(|| presence::folder(self.pool.connect_options().get_filename()))
            .as_deref()
    }

    /// The table name.
    pub fn table(&self) -> &str {
        &self.sql.table
    }

    /// A connection from the pool, after this store's turn to write when `write`, both within the
    /// operation timeout.
    async fn connection(
        &self,
        what: &'static str,
        write: bool,
    ) -> Result<(PoolConnection<Sqlite>, Option<OwnedSemaphorePermit>), StoreError> {
        let taken = async {
            let turn = if write {
                let turn = self.writer.clone().acquire_owned().await;
                Some(turn.map_err(|e| StoreError::new(format!("sqlite {what}"), e))?)
            } else {
                None
            };
            let connection = self.pool.acquire().await.map_err(db(what))?;
            Ok((connection, turn))
        };
        match tokio::time::timeout(self.timeout, taken).await {
            Ok(result) => result,
            Err(_) => Err(self.no_answer(what)),
        }
    }

    fn no_answer(&self, what: &str) -> StoreError {
        StoreError::msg(format!(
            "sqlite {what}: no answer within {:?}",
            self.timeout
        ))
    }

    /// Whether `lease` finished the record (an earlier completion whose answer was lost).
    async fn finished_by(&self, scope: &[u8; 32], lease: LeaseToken) -> Result<bool, StoreError> {
        let (finished,): (bool,) = on_connection!(self, "complete", read, conn => {
            sqlx::query_as(statement(&self.sql.finished_by))
                .bind(&scope[..])
                .bind(lease.0)
                .fetch_one(&mut *conn)
        })?
        .map_err(db("complete"))?;
        Ok(finished)
    }

    /// The completion of the record held by `lease`, bound (see `Statements::complete`).
    fn completion(
        &self,
        scope: &[u8; 32],
        lease: LeaseToken,
        response: &StoredResponse,
        retention: Duration,
    ) -> Result<Query<'static, Sqlite, SqliteArguments>, StoreError> {
        let mut headers = Vec::new();
        crate::store::header_list::write(&response.headers, &mut headers)
            .ok_or_else(|| StoreError::msg("sqlite complete: too many or too long headers"))?;
        let body = (!response.body_omitted).then(|| response.body.to_vec());
        let now = self.clock.wall_us();
        Ok(sqlx::query(statement(&self.sql.complete))
            .bind(scope.to_vec())
            .bind(lease.0)
            .bind(response.outcome.as_str())
            .bind(i64::from(response.status))
            .bind(headers)
            .bind(body)
            .bind(now)
            .bind(now.saturating_add(micros(retention))))
    }
}

impl IdempotencyStore for SqliteStore {
    async fn claim(&self, request: &ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        self.claim_record(request).await
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
        let done = self
            .complete_together(&scope, lease, response, retention)
            .await?;
        if done {
            return Ok(Fenced::Done);
        }
        self.finished_by(&scope, lease).await.map(Fenced::from_held)
    }

    async fn renew(
        &self,
        key: &RecordKey,
        lease: LeaseToken,
        lifetime: Duration,
    ) -> Result<Fenced, StoreError> {
        let scope = key.digest();
        let done = on_connection!(self, "renew", write, conn => {
            let now = self.clock.wall_us();
            sqlx::query(statement(&self.sql.renew))
                .bind(&scope[..])
                .bind(lease.0)
                .bind(now)
                .bind(now.saturating_add(micros(lifetime)))
                .bind(self.clock.boot_us())
                .execute(&mut *conn)
        })?
        .map_err(db("renew"))?;
        Ok(Fenced::from_held(done.rows_affected() == 1))
    }

    /// One `UPDATE` for the leases due together (see `renew.rs`): one write, one flush.
    async fn renew_many(
        &self,
        leases: &[(&RecordKey, LeaseToken)],
        lifetime: Duration,
    ) -> Vec<Result<Fenced, StoreError>> {
        self.renew_together(leases, lifetime).await
    }

    async fn release(&self, key: &RecordKey, lease: LeaseToken) -> Result<Fenced, StoreError> {
        let scope = key.digest();
        let done = on_connection!(self, "release", write, conn => {
            sqlx::query(statement(&self.sql.release))
                .bind(&scope[..])
                .bind(lease.0)
                .execute(&mut *conn)
        })?
        .map_err(db("release"))?;
        Ok(Fenced::from_held(done.rows_affected() == 1))
    }

    async fn record_step(
        &self,
        key: &RecordKey,
        lease: LeaseToken,
        step: &RecordedStep,
    ) -> Result<Fenced, StoreError> {
        let scope = key.digest();
        let bytes = step_list::encode(step)
            .ok_or_else(|| StoreError::msg("sqlite record_step: the step is too large"))?;
        let hex = crate::util::hex::encode(&bytes);
        let done = on_connection!(self, "record_step", write, conn => {
            sqlx::query(statement(&self.sql.record_step))
                .bind(&scope[..])
                .bind(lease.0)
                .bind(hex.as_str())
                .execute(&mut *conn)
        })?
        .map_err(shared::steps_error::<Sqlite>("record_step"))?;
        Ok(Fenced::from_held(done.rows_affected() == 1))
    }

    async fn steps(
        &self,
        key: &RecordKey,
        lease: LeaseToken,
    ) -> Result<Option<Vec<RecordedStep>>, StoreError> {
        let scope = key.digest();
        let row: Option<(Option<String>,)> = on_connection!(self, "steps", read, conn => {
            sqlx::query_as(statement(&self.sql.steps))
                .bind(&scope[..])
                .bind(lease.0)
                .fetch_optional(&mut *conn)
        })?
        .map_err(shared::steps_error::<Sqlite>("steps"))?;
        match row {
            None => Ok(None),
            Some((list,)) => decode_steps(list.as_deref()).map(Some),
        }
    }

    async fn recorded_steps(&self, key: &RecordKey) -> Result<Vec<RecordedStep>, StoreError> {
        let scope = key.digest();
        let row: Option<(Option<String>,)> = on_connection!(self, "recorded_steps", read, conn => {
            sqlx::query_as(statement(&self.sql.recorded_steps))
                .bind(&scope[..])
                .bind(self.clock.wall_us())
                .fetch_optional(&mut *conn)
        })?
        .map_err(shared::steps_error::<Sqlite>("recorded_steps"))?;
        match row {
            None => Ok(Vec::new()),
            Some((list,)) => decode_steps(list.as_deref()),
        }
    }

    async fn purge_expired(&self) -> Result<u64, StoreError> {
        let mut total = 0;
        loop {
            let done = on_connection!(self, "purge", write, conn => {
                sqlx::query(statement(&self.sql.purge))
                    .bind(self.clock.wall_us())
                    .execute(&mut *conn)
            })?
            .map_err(db("purge"))?;
            total += done.rows_affected();
            if done.rows_affected() < PURGE_BATCH {
                return Ok(total);
            }
        }
    }

    async fn lookup(&self, key: &RecordKey) -> Result<Option<RecordInfo>, StoreError> {
        self.lookup_record(key).await
    }

    async fn delete(&self, key: &RecordKey) -> Result<Deleted, StoreError> {
        self.delete_record(key).await
    }

    async fn list(&self, subject: &str, request: ListRequest) -> Result<RecordPage, StoreError> {
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

    /// The same file through a pool of one connection of its own, opened (on first use) on the
    /// keeper's runtime with the store pool's connect options, writing in its own turn; and the
    /// presences, shown by files beside the database (see `presence.rs`; none for an in-memory
    /// database).
    async fn keeper_session(&self) -> Result<Self, StoreError> {
        let options = (*self.pool.connect_options()).clone();
        let folder = presence::folder(options.get_filename());
        let pool = shared::keeper_pool(options, self.timeout);
        Ok(SqliteStore {
            pool,
            writer: Arc::new(Semaphore::new(1)),
            presences: folder.map(|folder| Arc::new(presence::Presences::new(folder))),
            batches: Arc::default(),
            ..self.clone()
        })
    }

    async fn show_presences(
        &self,
        live: &[crate::store::Presence],
        _lapse: Duration,
    ) -> Result<(), StoreError> {
        // A lock on a file goes with its process at once: no lapse to set.
        match &self.presences {
            Some(presences) => presences.show(live),
            // An in-memory database: every holder is in this process.
            None => Ok(()),
        }
    }
}

/// Runs `$op` (an expression using the connection `$conn`) on a connection from `$store`'s pool,
/// after the store's turn to write when `write` (not when `read`): the wait and the statement each
/// within the operation timeout. Gives `Result<Result<T, sqlx::Error>, StoreError>`, the outer
/// error for a timeout or a failed acquire. A connection whose statement was cut short (by this
/// timeout, or by the caller dropping the operation) is detached from the pool rather than
/// returned: the pool may open another at once, while SQLite finishes the statement (at most its
/// busy timeout) on the old one, which then closes.
macro_rules! on_connection {
    ($store:expr, $what:expr, write, $conn:ident => $op:expr) => {
        $crate::store::sqlite::on_connection!(@run $store, $what, true, $conn => $op)
    };
    ($store:expr, $what:expr, read, $conn:ident => $op:expr) => {
        $crate::store::sqlite::on_connection!(@run $store, $what, false, $conn => $op)
    };
    (@run $store:expr, $what:expr, $write:expr, $conn:ident => $op:expr) => {{
        let store = $store;
        match store.connection($what, $write).await {
            Err(e) => Err(e),
            Ok((taken, turn)) => {
                let mut $conn = $crate::store::sql::InFlight::new(taken);
                let done = tokio::time::timeout(store.timeout, $op).await;
                let landed = $conn.landed();
                drop(turn);
                match done {
                    Ok(result) => {
                        drop(landed);
                        Ok(result)
                    }
                    Err(_) => {
                        drop(landed.detach());
                        Err(store.no_answer($what))
                    }
                }
            }
        }
    }};
}
use on_connection;

/// A statement's text for sqlx, shared rather than copied.
fn statement(sql: &Arc<str>) -> AssertSqlSafe<Arc<str>> {
    AssertSqlSafe(sql.clone())
}

/// `d` in microseconds, saturating.
fn micros(d: Duration) -> i64 {
    i64::try_from(d.as_micros()).unwrap_or(i64::MAX)
}

/// SQLite's primary result code of a database error (`SQLITE_BUSY` is 5, whatever its extended
/// code).
fn primary_code(e: &sqlx::Error) -> Option<i32> {
    let code = e.as_database_error()?.code()?;
    code.parse::<i32>().ok().map(|c| c & 0xff)
}

/// Whether `e` is `SQLITE_BUSY` or `SQLITE_LOCKED`: another connection held the lock the statement
/// needed past the busy timeout, and the statement did nothing.
fn busy(e: &sqlx::Error) -> bool {
    matches!(primary_code(e), Some(SQLITE_BUSY | SQLITE_LOCKED))
}

/// `SQLITE_FULL`: the disk (or `max_page_count`) has no room for the write.
const SQLITE_FULL: i32 = 13;
/// `SQLITE_NOMEM`: SQLite could not allocate memory.
const SQLITE_NOMEM: i32 = 7;
/// `SQLITE_BUSY` and `SQLITE_LOCKED`: another connection holds the lock the statement needs.
const SQLITE_BUSY: i32 = 5;
const SQLITE_LOCKED: i32 = 6;

/// A database error as the store answers it (see [`Backend`]): a busy database (another writer
/// held the lock past the busy timeout) is an ordinary failure, the layer answers `503` and the
/// client's retry settles it.
fn db(what: &'static str) -> impl Fn(sqlx::Error) -> StoreError {
    shared::db::<Sqlite>(what)
}

impl Backend for Sqlite {
    const NAME: &'static str = "sqlite";

    /// A full disk (or `max_page_count`) or exhausted memory.
    fn no_room(e: &sqlx::Error) -> bool {
        matches!(primary_code(e), Some(SQLITE_FULL | SQLITE_NOMEM))
    }

    fn busy(e: &sqlx::Error) -> Option<&'static str> {
        busy(e).then_some("another writer held the database's lock too long")
    }
}

/// The steps of a record's column (its list's bytes in hexadecimal; NULL: none).
fn decode_steps(list: Option<&str>) -> Result<Vec<RecordedStep>, StoreError> {
    crate::util::hex::decode(list.unwrap_or_default())
        .and_then(|bytes| step_list::decode(&bytes))
        .ok_or_else(|| StoreError::unreadable_record("sqlite steps: unreadable"))
}
