//! The PostgreSQL store: one table shared by every instance of an application.

use std::borrow::Cow;
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderName, HeaderValue};
use sqlx::postgres::PgRow;
use sqlx::{PgPool, Row};

use super::{IdempotencyStore, StoreError};
use crate::Fingerprint;
use crate::lock::lock;
use crate::record::{
    ClaimOutcome, ClaimRequest, Finished, Generation, LeaseToken, RecordKey, StoredResponse,
};

/// The migration, with `idempotency_records` as the table name.
const MIGRATION: &str = include_str!("../../../migrations/0001_idempotency_records.sql");
/// The generation column and the claim function that keeps it (the one claims use), with
/// `idempotency_records` as the table name. (0002's claim function, without generations, is what
/// earlier versions call; claims of this version do not.)
const GENERATION_MIGRATION: &str =
    include_str!("../../../migrations/0003_idempotency_generation.sql");
const DEFAULT_TABLE: &str = "idempotency_records";
/// The claim function's name for the default table; for another table, `<table>_claim_v1`.
const DEFAULT_FUNCTION: &str = "idempotency_records_claim_v2";
/// The claim function's argument types, as `to_regprocedure` and `ALTER FUNCTION` name them.
const CLAIM_V2_ARGUMENTS: &str =
    "(bytea,text,text,text,bytea,bigint,double precision,double precision,bytea)";
/// Fixes the claim function's search path (the table's schema in place of `public`).
const SEARCH_PATH_MIGRATION: &str =
    include_str!("../../../migrations/0004_idempotency_claim_search_path.sql");
/// Serialises concurrent `migrate()` calls across instances (`pg_advisory_xact_lock` key).
const MIGRATE_LOCK: i64 = 0x6178_6964_656d_0001; // "axidem" + 1
/// The shortest time `migrate()` may take (it may wait for another instance's migration).
pub const MIN_MIGRATE_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a store that found the claim function missing waits before looking for it again.
const FUNCTION_PROBE: Duration = Duration::from_secs(60);
/// The lease token of a released record: no claim holds it (`LeaseToken::generate` never gives 0).
const RELEASED: i64 = 0;

/// The condition that makes a statement apply its lock timeout (see [`lock_bound_cte`]) before it
/// touches a row.
const LOCK_BOUND: &str = "(SELECT bound FROM lock_bound) IS NOT NULL";

/// A common table expression that sets `lock_timeout` for the statement's own (implicit)
/// transaction from the text parameter `$n` (`"4000ms"`), evaluated before the statement waits on
/// any row lock (the statement's condition refers to it through [`LOCK_BOUND`]). Every statement on
/// a record carries it, so that no wait on a row lock (a handler's transaction whose connection
/// died between its completion and its commit, say) outlives the client's timeout: the server gives
/// up first and answers, and the connection goes back to the pool instead of being held until the
/// server finishes. A `statement_timeout` cannot be set this way (it is armed when the statement
/// starts); the statements are single-row index lookups, and lock waits are what can last.
fn lock_bound_cte(n: u8) -> String {
    format!(
        "WITH lock_bound AS MATERIALIZED (SELECT set_config('lock_timeout', ${n}, true) AS bound)"
    )
}

/// Rows removed per statement by `purge_expired`, so no single statement holds locks for long.
const PURGE_BATCH: i64 = 10_000;

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

/// How long one store operation may take before it counts as failed (`503`), by default.
pub const DEFAULT_OPERATION_TIMEOUT: Duration = Duration::from_secs(5);
/// The shortest operation timeout [`PostgresStore::with_timeout`] sets: shorter ones are raised to
/// it (no database answers faster, and every statement would fail).
pub const MIN_OPERATION_TIMEOUT: Duration = Duration::from_millis(10);

/// An invalid table name given to [`PostgresStore::with_table`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PostgresStoreError(String);

impl fmt::Display for PostgresStoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for PostgresStoreError {}

struct Statements {
    /// The table's name as configured, for messages.
    table: String,
    /// The schema every statement names, if any: the configured one, or the one `migrate()` found
    /// the table in.
    schema: Option<String>,
    /// The table name as written in SQL: every part quoted, so reserved words work.
    quoted: String,
    /// The expiry index's name, quoted.
    index: String,
    /// The expiry index's name, quoted and qualified like the table.
    qualified_index: String,
    /// The claim function that keeps generations (migrations/0003), quoted and qualified like the
    /// table.
    function_v2: String,
    /// Since when the claim function has been found missing (the table was made by an earlier
    /// version and `migrate()` has not run since): claims then send its two queries one by one,
    /// and look for the function again a minute later (another instance may have migrated).
    function_missing: std::sync::Mutex<Option<std::time::Instant>>,
    /// The claim: one call of the claim function.
    claim: String,
    /// The claim function's first query, sent on its own when the function is missing.
    claim_direct: String,
    retake: String,
    renew: String,
    complete: String,
    finished_by: String,
    release: String,
    purge: String,
    check_shape: String,
}

impl Statements {
    /// The statements on `table` as configured (`schema.table` or `table`, validated).
    fn new(table: &str) -> Self {
        match table.rsplit_once('.') {
            Some((schema, name)) => Self::on(Some(schema), name, table),
            None => Self::on(None, table, table),
        }
    }

    /// The statements on `name` in `schema` (or wherever the search path finds it), named
    /// `display` in messages. Every identifier is quoted.
    fn on(schema: Option<&str>, name: &str, display: &str) -> Self {
        let qualify = |object: &str| match schema {
            Some(schema) => format!("{}.{}", quote_ident(schema), quote_ident(object)),
            None => quote_ident(object),
        };
        let quoted = qualify(name);
        let function_v2 = qualify(&format!("{name}_claim_v2"));
        let t = &quoted;
        Statements {
            table: display.to_owned(),
            schema: schema.map(str::to_owned),
            index: quote_ident(&format!("{name}_expires_at_idx")),
            qualified_index: qualify(&format!("{name}_expires_at_idx")),
            function_missing: std::sync::Mutex::new(None),
            // $9: the generation of a new record; $10: the lock timeout (see `LOCK_BOUND`).
            claim: format!(
                "{} SELECT c.* FROM {function_v2}($1, $2, $3, $4, $5, $6, $7, $8, $9) c \
                 WHERE {LOCK_BOUND}",
                lock_bound_cte(10),
            ),
            // The claim function's first query (migrations/0002): insert, or read the record that
            // is there. `same_fp` and the response columns let the caller answer 409, 422 or a
            // replay without another query; the body is only sent back when it can be replayed.
            // $1 scope, $2 key, $3 subject, $4 endpoint, $5 fingerprint, $6 lease, $7 lifetime
            // (µs), $8 in-progress TTL (µs).
            // $9 generation of a new record, $10 lock timeout.
            claim_direct: format!(
                "{}, ins AS ( \
                   INSERT INTO {t} (scope, idempotency_key, subject, endpoint, fingerprint, status, \
                                    lease_token, expires_at, generation) \
                   SELECT $1, $2, $3, $4, $5, 'in_progress', $6, \
                          now() + $7::float8 * interval '1 microsecond', $9 \
                   WHERE {LOCK_BOUND} \
                   ON CONFLICT DO NOTHING \
                   RETURNING lease_token) \
                 SELECT true AS inserted, NULL::text AS status, NULL::bigint AS lease_token, \
                        NULL::bool AS same_fp, NULL::bool AS stale, NULL::bool AS expired, \
                        NULL::smallint AS response_status, NULL::text[] AS header_names, \
                        NULL::bytea[] AS header_values, NULL::bytea AS response_body, \
                        NULL::float8 AS expires_in, $9::bytea AS generation \
                 FROM ins \
                 UNION ALL \
                 SELECT false, status, lease_token, fingerprint = $5, \
                        updated_at <= now() - $8::float8 * interval '1 microsecond', \
                        expires_at <= now(), response_status, header_names, header_values, \
                        CASE WHEN fingerprint = $5 THEN response_body END, \
                        extract(epoch FROM expires_at - now())::float8, generation \
                 FROM {t} WHERE scope = $1 AND NOT EXISTS (SELECT 1 FROM ins)",
                lock_bound_cte(10)
            ),
            // Compare-and-swap on the lease token and the state read: of concurrent retakers only one
            // matches, and a late completion by the presumed-dead worker makes this match nothing.
            // The staleness is checked again against the row as it is now (READ COMMITTED rechecks
            // the newest version), so a heartbeat that landed since the claim read it wins.
            // $1 scope, $2 fingerprint, $3 new lease, $4 lifetime (µs), $5 old lease, $6 old status,
            // $7 in-progress TTL (µs), $8 lock timeout, $9 generation (for an expired record, or
            // a released one taken by another request; a retake of the same operation keeps its
            // own). It answers the generation it left, which is the run's: the row may have been
            // taken and released again since the claim read it (every released row has lease 0).
            retake: format!(
                "{LOCK_BOUND_CTE} UPDATE {t} SET fingerprint = $2, status = 'in_progress', lease_token = $3, \
                   generation = CASE WHEN status = 'in_progress' AND expires_at > now() \
                                       AND fingerprint = $2 THEN generation ELSE $9 END, \
                   response_status = NULL, header_names = NULL, header_values = NULL, \
                   response_body = NULL, created_at = now(), updated_at = now(), \
                   expires_at = now() + $4::float8 * interval '1 microsecond' \
                 WHERE scope = $1 AND lease_token = $5 AND status = $6 \
                   AND (expires_at <= now() \
                        OR (status = 'in_progress' \
                            AND updated_at <= now() - $7::float8 * interval '1 microsecond')) \
                   AND {LOCK_BOUND} \
                 RETURNING generation",
                LOCK_BOUND_CTE = lock_bound_cte(8)
            ),
            // The heartbeat. $1 scope, $2 lease, $3 lifetime (µs), $4 lock timeout.
            renew: format!(
                "{} UPDATE {t} SET updated_at = now(), \
                   expires_at = now() + $3::float8 * interval '1 microsecond' \
                 WHERE scope = $1 AND lease_token = $2 AND lease_token <> {RELEASED} \
                   AND status = 'in_progress' AND {LOCK_BOUND}",
                lock_bound_cte(4)
            ),
            // Finish the record if the lease holds it in progress; a record this lease already
            // finished (an earlier attempt committed but its answer was lost) also counts as done.
            // $1 scope, $2 lease, $3 status, $4 response status, $5 names, $6 values, $7 body,
            // $8 retention (µs), $9 lock timeout. The statement's own clock, not `now()`: inside
            // a handler's transaction `now()` is when the transaction began, which may be long ago.
            complete: format!(
                "{}, done AS ( \
                   UPDATE {t} SET status = $3, response_status = $4, header_names = $5, \
                     header_values = $6, response_body = $7, updated_at = clock_timestamp(), \
                     expires_at = clock_timestamp() + $8::float8 * interval '1 microsecond' \
                   WHERE scope = $1 AND lease_token = $2 AND lease_token <> {RELEASED} \
                     AND status = 'in_progress' AND {LOCK_BOUND} \
                   RETURNING 1) \
                 SELECT EXISTS (SELECT 1 FROM done) \
                     OR EXISTS (SELECT 1 FROM {t} WHERE scope = $1 AND lease_token = $2 \
                                AND status <> 'in_progress') AS held",
                lock_bound_cte(9)
            ),
            // Whether `lease` finished the record: asked again, in a statement of its own, when a
            // completion matched nothing (a concurrent attempt by the same lease may have finished
            // it after the completion's snapshot was taken). $1 scope, $2 lease.
            finished_by: format!(
                "SELECT EXISTS (SELECT 1 FROM {t} WHERE scope = $1 AND lease_token = $2 \
                                AND status <> 'in_progress')"
            ),
            // Not deleted: left in progress under no lease (`RELEASED`) and stale at once, so the
            // next claim retakes it, keeping its generation for the same request (the retry of a
            // released run is the same operation to a provider). $3 lock timeout.
            release: format!(
                "{} UPDATE {t} SET lease_token = {RELEASED}, updated_at = '-infinity' \
                 WHERE scope = $1 AND lease_token = $2 AND lease_token <> {RELEASED} \
                   AND status = 'in_progress' AND {LOCK_BOUND}",
                lock_bound_cte(3)
            ),
            // $1 lock timeout.
            purge: format!(
                "{} DELETE FROM {t} WHERE ctid IN \
                   (SELECT ctid FROM {t} WHERE expires_at <= now() LIMIT {PURGE_BATCH}) \
                   AND {LOCK_BOUND}",
                lock_bound_cte(1)
            ),
            check_shape: format!("SELECT scope, idempotency_key, lease_token FROM {t} LIMIT 0"),
            function_v2,
            quoted,
        }
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
        }
    }

    /// A store on another table: a lower-case identifier (`[a-z_][a-z0-9_]*`, at most 40 characters),
    /// optionally qualified by a schema of the same form (`billing.idempotency`). Names are quoted in
    /// every statement, so reserved words such as `order` work too.
    pub fn with_table(pool: PgPool, table: &str) -> Result<Self, PostgresStoreError> {
        let parts: Vec<&str> = table.split('.').collect();
        let valid = |part: &str| {
            !part.is_empty()
                && part.len() <= 40
                && part.starts_with(|c: char| c.is_ascii_lowercase() || c == '_')
                && part
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        };
        if parts.len() > 2 || !parts.iter().all(|p| valid(p)) {
            return Err(PostgresStoreError(format!(
                "{table:?} is not a valid table name: use [a-z_][a-z0-9_]* (at most 40 characters), \
                 optionally as schema.table"
            )));
        }
        Ok(PostgresStore {
            pool,
            transactions: None,
            configured: Arc::new(Statements::new(table)),
            pinned: Arc::default(),
            timeout: DEFAULT_OPERATION_TIMEOUT,
            lock_timeout: lock_timeout_for(DEFAULT_OPERATION_TIMEOUT),
            scope_columns: true,
        })
    }

    /// How long the wait for a connection, and then one claim, complete, release or purge
    /// statement, may each take
    /// before it fails. Without it, a database that stops answering (a stalled network) would hold
    /// requests forever. Default: [`DEFAULT_OPERATION_TIMEOUT`].
    ///
    /// A claim that times out may still have committed; its record then stays `in_progress` with no
    /// worker and is retaken after the in-progress TTL: the handler still runs at most once.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout.max(MIN_OPERATION_TIMEOUT);
        self.lock_timeout = lock_timeout_for(self.timeout);
        self
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
        self
    }

    /// Writes the `idempotency_key`, `subject` and `endpoint` columns empty: a record is found by
    /// its `scope` digest alone, so nothing of the key or the subject (often personal data) is kept
    /// in clear, at the cost of reading records by hand. With an `EncryptedStore` and a fingerprint
    /// secret, what is left in clear is digests, statuses, times and the sealed answer. Records
    /// written before keep their columns; it changes nothing else.
    pub fn without_scope_columns(mut self) -> Self {
        self.scope_columns = false;
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

    /// Creates the table, its index and the claim function if they do not exist (`migrations/`).
    /// Safe to call from many instances at once: an advisory lock serialises them. It touches no migration bookkeeping of
    /// the application's (no `_sqlx_migrations` rows). It fails, rather than waiting forever, after
    /// the operation timeout or [`MIN_MIGRATE_TIMEOUT`], whichever is longer; and it fails with a
    /// clear error when the table exists in a shape this version cannot use.
    ///
    /// Call it on the `PostgresStore` itself, before wrapping it in a `CachedStore` or an
    /// `EncryptedStore` (they have no `migrate()`), and before this version serves claims: a
    /// table without the generation column (migrations/0003) answers every claim `503`.
    ///
    /// It also pins the store: from then on, this store and its clones name the table in the
    /// schema `migrate()` found it in, and the claim function resolves names there only
    /// (migrations/0004), so an object another role creates later in a schema earlier on the
    /// connections' search path stands in for nothing. A store that is never migrated in the
    /// process resolves an unqualified table name through the search path on every statement:
    /// qualify it ([`with_table`](Self::with_table)) where other roles may create objects.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        // Once pinned (an earlier `migrate()` of this store or a clone), the same table again.
        let configured = self.sql();
        let sql = MIGRATION
            .replace("idempotency_records_expires_at_idx", "\u{0}")
            .replace(DEFAULT_TABLE, &configured.quoted)
            .replace('\u{0}', &configured.index);
        let limit = self.timeout.max(MIN_MIGRATE_TIMEOUT);
        let migration = async {
            let mut tx = self.pool.begin().await.map_err(db("migrate: begin"))?;
            sqlx::query("SELECT pg_advisory_xact_lock($1)")
                .bind(MIGRATE_LOCK)
                .execute(&mut *tx)
                .await
                .map_err(db("migrate: lock"))?;
            let name = configured
                .table
                .rsplit('.')
                .next()
                .unwrap_or(&configured.table);
            if configured.schema.is_none() {
                // An unqualified name resolves to the first table of that name on the search path:
                // with two, a table another role made in an earlier schema would be the one this
                // process pins, while instances migrated before it use the other. Refuse instead.
                let schemas: Vec<String> = sqlx::query_scalar(
                    "SELECT n.nspname::text FROM pg_catalog.pg_class c \
                     JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace \
                     WHERE c.relname = $1 AND n.nspname = ANY (pg_catalog.current_schemas(true)) \
                     ORDER BY pg_catalog.array_position(pg_catalog.current_schemas(true), \
                                                         n.nspname)",
                )
                .bind(name)
                .fetch_all(&mut *tx)
                .await
                .map_err(db("migrate: look for the table on the search path"))?;
                if schemas.len() > 1 {
                    return Err(StoreError::msg(format!(
                        "migrate: the search path holds more than one relation named {name} (in \
                         the schemas {}); the store would not know which is its table. Name it \
                         with its schema (PostgresStore::with_table(pool, \"schema.{name}\")), \
                         and find out who made the other one",
                        schemas.join(", ")
                    )));
                }
            }
            // `CREATE INDEX IF NOT EXISTS` locks the table against writes even when the index
            // exists, so a migration that has been applied already takes no lock at all.
            let (present,): (bool,) = sqlx::query_as(
                "SELECT to_regclass($1) IS NOT NULL AND to_regclass($2) IS NOT NULL",
            )
            .bind(&configured.quoted)
            .bind(&configured.qualified_index)
            .fetch_one(&mut *tx)
            .await
            .map_err(db("migrate: look up the table"))?;
            if !present {
                sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
                    .execute(&mut *tx)
                    .await
                    .map_err(db("migrate: create table"))?;
            }
            // From here on, every object is named in the schema the table is in: nothing created
            // later in a schema earlier on the search path can stand in for it.
            let schema: String = sqlx::query_scalar(
                "SELECT n.nspname::text FROM pg_catalog.pg_class c \
                 JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace \
                 WHERE c.oid = pg_catalog.to_regclass($1)",
            )
            .bind(&configured.quoted)
            .fetch_one(&mut *tx)
            .await
            .map_err(db("migrate: find the table's schema"))?;
            let pinned = Statements::on(Some(&schema), name, &configured.table);
            self.apply_generation(&mut tx, &pinned).await?;
            tx.commit().await.map_err(db("migrate: commit"))?;
            *lock(&pinned.function_missing) = None;
            *lock(&configured.function_missing) = None;
            *lock(&self.configured.function_missing) = None;
            // Clones share it; a second migrate finds the same schema.
            let _ = self.pinned.set(pinned);
            Ok(())
        };
        match tokio::time::timeout(limit, migration).await {
            Ok(result) => result,
            Err(_) => Err(StoreError::msg(format!(
                "postgres migrate: not done within {limit:?}"
            ))),
        }
    }

    /// The table's shape check, its generation column and the claim function (migrations/0003),
    /// with the function's search path fixed (migrations/0004), on the table as `sql` names it.
    async fn apply_generation(
        &self,
        tx: &mut sqlx::PgConnection,
        sql: &Statements,
    ) -> Result<(), StoreError> {
        let generation_sql = GENERATION_MIGRATION
            .replace(DEFAULT_FUNCTION, "\u{0}")
            .replace(DEFAULT_TABLE, &sql.quoted)
            .replace('\u{0}', &sql.function_v2);
        // The column first (claims need it), then the function (claims work without it).
        let (column_sql, function_sql) = generation_sql
            .split_once("CREATE OR REPLACE FUNCTION")
            .map(|(column, function)| {
                (
                    column.to_owned(),
                    format!("CREATE OR REPLACE FUNCTION{function}"),
                )
            })
            .unwrap_or_default();
        let signature = format!("{}{CLAIM_V2_ARGUMENTS}", sql.function_v2);
        let search_path_sql = SEARCH_PATH_MIGRATION
            .replace(
                &format!("{DEFAULT_FUNCTION}{CLAIM_V2_ARGUMENTS}"),
                &signature,
            )
            .replace(
                "pg_catalog, public, pg_temp",
                &format!(
                    "pg_catalog, {}, pg_temp",
                    quote_ident(sql.schema.as_deref().unwrap_or("public"))
                ),
            );
        sqlx::query(sqlx::AssertSqlSafe(sql.check_shape.as_str()))
            .execute(&mut *tx)
            .await
            .map_err(|e| {
                StoreError::new(
                    format!(
                        "migrate: the table {} exists but lacks the columns this version needs \
                             (scope, idempotency_key, lease_token); it was made by an older \
                             version: rename or drop it, then migrate again",
                        sql.table
                    ),
                    e,
                )
            })?;
        // `ADD COLUMN IF NOT EXISTS` locks the table even when the column exists: look first.
        let (column,): (bool,) = sqlx::query_as(
            "SELECT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass($1) \
                 AND attname = 'generation' AND NOT attisdropped)",
        )
        .bind(&sql.quoted)
        .fetch_one(&mut *tx)
        .await
        .map_err(db("migrate: look up the generation column"))?;
        if !column {
            // It takes the table's exclusive lock: wait for it only briefly (claims queue
            // behind a waiting ALTER), and let the caller try again.
            sqlx::query("SET LOCAL lock_timeout = '3s'")
                .execute(&mut *tx)
                .await
                .map_err(db("migrate: lock timeout"))?;
            sqlx::raw_sql(sqlx::AssertSqlSafe(column_sql))
                .execute(&mut *tx)
                .await
                .map_err(|e| {
                    StoreError::new(
                        format!(
                            "migrate: could not add the generation column to {} (it needs the \
                                 table's owner, and no long transaction on it; apply \
                                 migrations/0003 as its owner, or migrate again)",
                            sql.table
                        ),
                        e,
                    )
                })?;
            sqlx::query("SET LOCAL lock_timeout = 0")
                .execute(&mut *tx)
                .await
                .map_err(db("migrate: lock timeout"))?;
        }
        let (function,): (bool,) = sqlx::query_as("SELECT to_regprocedure($1) IS NOT NULL")
            .bind(&signature)
            .fetch_one(&mut *tx)
            .await
            .map_err(db("migrate: look up the claim function"))?;
        if !function {
            sqlx::query("SAVEPOINT claim_function")
                .execute(&mut *tx)
                .await
                .map_err(db("migrate: savepoint"))?;
            match sqlx::raw_sql(sqlx::AssertSqlSafe(function_sql))
                .execute(&mut *tx)
                .await
            {
                Ok(_) => {}
                // A role that may write the table but not create in its schema: claims work
                // without the function (two statements when they race), as they did before it.
                Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42501") => {
                    tracing::warn!(
                        error = %e,
                        "migrate: no privilege to create the claim function; claims that race \
                         will take two round trips (apply migrations/0003 as a role that may)"
                    );
                    sqlx::query("ROLLBACK TO SAVEPOINT claim_function")
                        .execute(&mut *tx)
                        .await
                        .map_err(db("migrate: rollback to savepoint"))?;
                }
                Err(e) => return Err(db("migrate: create the claim function")(e)),
            }
        }
        // A claim function without a fixed search path (made by an earlier version, or by
        // hand from 0003): fix it, so that its statements resolve in the table's schema only.
        let (unfixed,): (bool,) = sqlx::query_as(
            "SELECT NOT EXISTS (SELECT 1 FROM pg_catalog.unnest(p.proconfig) c \
                                    WHERE c LIKE 'search_path=%') \
                 FROM pg_catalog.pg_proc p WHERE p.oid = pg_catalog.to_regprocedure($1)",
        )
        .bind(&signature)
        .fetch_optional(&mut *tx)
        .await
        .map_err(db("migrate: look up the claim function's settings"))?
        .unwrap_or((false,));
        if unfixed {
            sqlx::query("SAVEPOINT claim_function_path")
                .execute(&mut *tx)
                .await
                .map_err(db("migrate: savepoint"))?;
            match sqlx::raw_sql(sqlx::AssertSqlSafe(search_path_sql))
                .execute(&mut *tx)
                .await
            {
                Ok(_) => {}
                // Not the function's owner: it keeps working as it did.
                Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42501") => {
                    tracing::warn!(
                        error = %e,
                        "migrate: no privilege to fix the claim function's search path \
                         (apply migrations/0004 as its owner)"
                    );
                    sqlx::query("ROLLBACK TO SAVEPOINT claim_function_path")
                        .execute(&mut *tx)
                        .await
                        .map_err(db("migrate: rollback to savepoint"))?;
                }
                Err(e) => return Err(db("migrate: fix the claim function's search path")(e)),
            }
        }
        Ok(())
    }

    async fn retake(
        &self,
        request: &ClaimRequest,
        scope: &[u8; 32],
        old_lease: i64,
        old_status: &str,
    ) -> Result<Option<Option<Generation>>, StoreError> {
        let row: Option<(Option<Vec<u8>>,)> = on_connection!(self, "retake", conn => {
            sqlx::query_as(sqlx::AssertSqlSafe(self.sql().retake.as_str()))
                .bind(&scope[..])
                .bind(&request.fingerprint.as_bytes()[..])
                .bind(request.lease.0)
                .bind(micros(request.in_progress_ttl + request.retention))
                .bind(old_lease)
                .bind(old_status)
                .bind(micros(request.in_progress_ttl))
                .bind(&*self.lock_timeout)
                .bind(&request.generation.0[..])
                .fetch_optional(&mut *conn)
        })?
        .map_err(db("retake"))?;
        // `None`: lost the race; otherwise the record's generation as the retake left it.
        Ok(row.map(|(g,)| g.and_then(|g| Generation::from_slice(&g))))
    }

    /// Reads what a claim statement returned into an outcome, retaking the record when it is stale
    /// or expired.
    async fn decide(
        &self,
        request: &ClaimRequest,
        scope: &[u8; 32],
        row: &PgRow,
    ) -> Result<ClaimOutcome, StoreError> {
        let get = |e| StoreError::new("claim: unexpected row", e);
        let lease = request.lease;
        if row.try_get::<bool, _>("inserted").map_err(get)? {
            return Ok(ClaimOutcome::Claimed {
                lease,
                retaken: false,
                generation: Some(request.generation),
            });
        }
        // The record's generation: none for a row written before generations were kept.
        let generation = row
            .try_get::<Option<Vec<u8>>, _>("generation")
            .map_err(get)?
            .and_then(|g| Generation::from_slice(&g));
        let status: String = row.try_get("status").map_err(get)?;
        let old_lease: i64 = row.try_get("lease_token").map_err(get)?;
        let same_fp: bool = row.try_get("same_fp").map_err(get)?;
        let stale: bool = row.try_get("stale").map_err(get)?;
        let expired: bool = row.try_get("expired").map_err(get)?;
        if expired {
            // Past retention: the key is new again, whatever was there. An in-progress record
            // that expired was abandoned by its holder, so taking it is a retake.
            // The key is a new operation: a new generation (as in every store: Redis and a purge
            // delete expired records).
            return Ok(
                match self.retake(request, scope, old_lease, &status).await? {
                    Some(generation) => ClaimOutcome::Claimed {
                        lease,
                        retaken: status == "in_progress" && old_lease != RELEASED,
                        generation,
                    },
                    None => ClaimOutcome::InProgress,
                },
            );
        }
        if status == "in_progress" && old_lease == RELEASED {
            // Released for another try: the same request keeps the record's generation (the same
            // operation again); another request is a new operation.
            return Ok(
                match self.retake(request, scope, old_lease, &status).await? {
                    Some(generation) => ClaimOutcome::Claimed {
                        lease,
                        retaken: false,
                        generation,
                    },
                    None => ClaimOutcome::InProgress,
                },
            );
        }
        if !same_fp {
            return Ok(ClaimOutcome::FingerprintMismatch);
        }
        let outcome = match status.as_str() {
            "completed" => Finished::Completed,
            "failed" => Finished::Failed,
            // This claim's own record: the same claim, made twice (its first answer was lost).
            _ if old_lease == lease.0 => {
                return Ok(ClaimOutcome::Claimed {
                    lease,
                    retaken: false,
                    generation,
                });
            }
            _ if !stale => return Ok(ClaimOutcome::InProgress),
            _ => {
                return Ok(
                    match self.retake(request, scope, old_lease, &status).await? {
                        Some(generation) => ClaimOutcome::Claimed {
                            lease,
                            retaken: true,
                            generation,
                        },
                        None => ClaimOutcome::InProgress,
                    },
                );
            }
        };
        // A finished record that cannot be read (a row edited by hand) is never a reason to run
        // the operation again, even for a layer that fails open.
        let unreadable = |e: sqlx::Error| {
            StoreError::unreadable_record(format!(
                "postgres claim: a finished record is unreadable: {e}"
            ))
        };
        let status: i16 = row.try_get("response_status").map_err(unreadable)?;
        let names: Vec<String> = row.try_get("header_names").map_err(unreadable)?;
        let values: Vec<Vec<u8>> = row.try_get("header_values").map_err(unreadable)?;
        let body: Option<Vec<u8>> = row.try_get("response_body").map_err(get)?;
        let expires_in: Option<f64> = row.try_get("expires_in").map_err(get)?;
        Ok(ClaimOutcome::Finished(Arc::new(StoredResponse {
            outcome,
            status: u16::try_from(status).unwrap_or(500),
            headers: parse_headers(names, values),
            body_omitted: body.is_none(),
            body: body.map(Bytes::from).unwrap_or_default(),
            expires_in: expires_in.and_then(|s| Duration::try_from_secs_f64(s).ok()),
        })))
    }

    /// The claim: one call of the claim function, or, while it is missing, its queries one by one.
    /// `None`: the record was there a moment ago and is gone again (released); the caller answers
    /// `409` and the client's retry settles it.
    async fn claim_row(
        &self,
        request: &ClaimRequest,
        scope: &[u8; 32],
    ) -> Result<Option<PgRow>, StoreError> {
        let (use_function, probing) = match *lock(&self.sql().function_missing) {
            None => (true, false),
            Some(since) => (since.elapsed() >= FUNCTION_PROBE, true),
        };
        if use_function {
            let call = self.claim_statement(&self.sql().claim, request, scope);
            match on_connection!(self, "claim", conn => call.fetch_optional(&mut *conn)) {
                Ok(Err(sqlx::Error::Database(e))) if e.code().as_deref() == Some("42883") => {
                    tracing::warn!(
                        table = %self.sql().table,
                        "the claim function is missing (run PostgresStore::migrate): a claim \
                         that races another takes two round trips until it is there"
                    );
                    *lock(&self.sql().function_missing) = Some(std::time::Instant::now());
                }
                // A serialization failure (the database's default isolation is above READ
                // COMMITTED) means a concurrent claim of this key: nothing was written; in progress.
                Ok(Err(sqlx::Error::Database(e))) if e.code().as_deref() == Some("40001") => {
                    return Ok(None);
                }
                Ok(Ok(row)) => {
                    if probing {
                        *lock(&self.sql().function_missing) = None;
                    }
                    return Ok(row);
                }
                Ok(Err(e)) => return Err(db("claim")(e)),
                Err(e) => return Err(e),
            }
        }
        let direct = || async {
            let row = tokio::time::timeout(
                self.timeout,
                self.claim_statement(&self.sql().claim_direct, request, scope)
                    .fetch_optional(&self.pool),
            )
            .await
            .map_err(|_| self.no_answer("claim"))?;
            match row {
                Ok(row) => Ok(row),
                // The table lacks the generation column: made by an earlier version, and
                // `migrate()` has not run. Nothing was claimed; never a reason to run unguarded.
                Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42703") => {
                    Err(StoreError::refused_claim(format!(
                        "postgres claim: the table {} lacks the generation column; run \
                         PostgresStore::migrate() (or apply migrations/0003): {e}",
                        self.sql().table
                    )))
                }
                Err(e) => Err(db("claim")(e)),
            }
        };
        if let Some(row) = direct().await? {
            return Ok(Some(row));
        }
        // The insert met a row committed after this statement's snapshot was taken, so the read
        // half could not see it. A second statement sees it; that row was inserted a moment ago and
        // cannot be stale. If it needs a retake after all, answer 409 rather than spend a third
        // round trip: the client's retry settles it.
        Ok(direct().await?.filter(|row| !needs_retake(row)))
    }

    /// A claim statement (the function's call or its first query), bound.
    fn claim_statement<'q>(
        &self,
        sql: &'q str,
        request: &'q ClaimRequest,
        scope: &'q [u8; 32],
    ) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
        let key = &request.key;
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(&scope[..])
            .bind(if self.scope_columns { &key.key[..] } else { "" })
            .bind(self.scope_column(&key.subject))
            .bind(self.scope_column(&key.endpoint))
            .bind(&request.fingerprint.as_bytes()[..])
            .bind(request.lease.0)
            .bind(micros(request.in_progress_ttl + request.retention))
            .bind(micros(request.in_progress_ttl))
            .bind(&request.generation.0[..])
            .bind(&*self.lock_timeout)
    }

    /// The completion statement, bound: see [`IdempotencyStore::complete`].
    fn completion<'q>(
        &'q self,
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
        sqlx::query_as(sqlx::AssertSqlSafe(self.sql().complete.as_str()))
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

    /// Begins a transaction for a handler, within the operation timeout.
    /// Begins a transaction for a handler, at READ COMMITTED whatever the database's default (the
    /// completion must see the newest version of its record, which a heartbeat keeps updating).
    ///
    /// A `BEGIN` cut short by a timeout would leave its connection in the pool inside an open
    /// transaction, so it is never cut short: it runs on a task of its own, and if it outlives the
    /// timeout, the transaction it opens is dropped there, which rolls it back.
    ///
    /// The transaction may not stay idle longer than `idle` (the in-progress TTL): a connection
    /// that dies quietly between the completion and the commit holds the record's row lock, and
    /// the server ends its session after that long, so the key is stuck for at most about a TTL.
    pub(crate) async fn begin(
        &self,
        idle: Duration,
    ) -> Result<sqlx::Transaction<'static, sqlx::Postgres>, StoreError> {
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

    /// Completes a record inside the handler's transaction (not committed here).
    pub(crate) async fn complete_in(
        &self,
        tx: &mut sqlx::PgConnection,
        key: &RecordKey,
        lease: LeaseToken,
        response: &StoredResponse,
        retention: Duration,
    ) -> Result<bool, CompleteInError> {
        let scope = key.digest();
        let completion = self.completion(&scope, lease, response, retention);
        match tokio::time::timeout(self.timeout, completion.fetch_one(tx)).await {
            Ok(Ok((held,))) => Ok(held),
            Ok(Err(e)) => Err(CompleteInError {
                aborted_transaction: e
                    .as_database_error()
                    .and_then(|d| d.code())
                    .is_some_and(|code| code == "25P02"),
                error: StoreError::new("postgres complete in transaction", e),
            }),
            Err(_) => Err(CompleteInError {
                aborted_transaction: false,
                error: StoreError::msg(format!(
                    "postgres complete in transaction: no answer within {:?}",
                    self.timeout
                )),
            }),
        }
    }

    /// After a commit of the handler's transaction failed: releases the record if the commit did
    /// not happen (`Ok(false)`), or finds it finished by `lease` if it did (`Ok(true)`).
    pub(crate) async fn settle_failed_commit(
        &self,
        key: &RecordKey,
        lease: LeaseToken,
    ) -> Result<bool, StoreError> {
        if self.release(key, lease).await? {
            return Ok(false);
        }
        self.finished_by(&key.digest(), lease).await
    }

    /// Whether `lease` finished the record (see `Statements::finished_by`).
    async fn finished_by(&self, scope: &[u8; 32], lease: LeaseToken) -> Result<bool, StoreError> {
        let query = sqlx::query_as(sqlx::AssertSqlSafe(self.sql().finished_by.as_str()))
            .bind(&scope[..])
            .bind(lease.0);
        let (finished,): (bool,) =
            on_connection!(self, "complete", conn => query.fetch_one(&mut *conn))?
                .map_err(db("complete"))?;
        Ok(finished)
    }

    pub(crate) async fn commit(
        &self,
        tx: sqlx::Transaction<'static, sqlx::Postgres>,
    ) -> Result<(), StoreError> {
        self.timed("commit", tx.commit()).await
    }

    pub(crate) async fn rollback(
        &self,
        tx: sqlx::Transaction<'static, sqlx::Postgres>,
    ) -> Result<(), StoreError> {
        self.timed("rollback", tx.rollback()).await
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
        match self.claim_row(request, &scope).await? {
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
    ) -> Result<bool, StoreError> {
        let scope = key.digest();
        let completion = self.completion(&scope, lease, &response, retention);
        let (held,): (bool,) =
            on_connection!(self, "complete", conn => completion.fetch_one(&mut *conn))?
                .map_err(db("complete"))?;
        if held {
            return Ok(true);
        }
        self.finished_by(&scope, lease).await
    }

    fn postgres(&self) -> Option<&PostgresStore> {
        Some(self)
    }

    fn operation_timeout(&self) -> Option<Duration> {
        Some(self.timeout)
    }

    async fn renew(
        &self,
        key: &RecordKey,
        lease: LeaseToken,
        lifetime: Duration,
    ) -> Result<bool, StoreError> {
        let scope = key.digest();
        let renewal = self
            .leased(&self.sql().renew, &scope, lease)
            .bind(micros(lifetime))
            .bind(&*self.lock_timeout);
        let done = on_connection!(self, "renew", conn => renewal.execute(&mut *conn))?
            .map_err(db("renew"))?;
        Ok(done.rows_affected() == 1)
    }

    async fn release(&self, key: &RecordKey, lease: LeaseToken) -> Result<bool, StoreError> {
        let scope = key.digest();
        let release = self
            .leased(&self.sql().release, &scope, lease)
            .bind(&*self.lock_timeout);
        let done = on_connection!(self, "release", conn => release.execute(&mut *conn))?
            .map_err(db("release"))?;
        Ok(done.rows_affected() == 1)
    }

    async fn purge_expired(&self) -> Result<u64, StoreError> {
        let mut total = 0;
        loop {
            let purge = sqlx::query(sqlx::AssertSqlSafe(self.sql().purge.as_str()))
                .bind(&*self.lock_timeout);
            let done = on_connection!(self, "purge", conn => purge.execute(&mut *conn))?
                .map_err(db("purge"))?;
            total += done.rows_affected();
            if done.rows_affected() < PURGE_BATCH as u64 {
                return Ok(total);
            }
        }
    }
}

/// `ident` as a quoted SQL identifier (a `"` inside doubled).
fn quote_ident(ident: &str) -> String {
    format!("\"{}\"", ident.replace('"', "\"\""))
}

/// A subject or endpoint for the columns kept for inspection: PostgreSQL's `text` cannot hold NUL,
/// so NUL is written as U+FFFD there (the record's identity is its `scope` digest, which is exact).
fn printable(s: &str) -> Cow<'_, str> {
    if s.contains('\0') {
        Cow::Owned(s.replace('\0', "\u{FFFD}"))
    } else {
        Cow::Borrowed(s)
    }
}

/// Why a completion inside the handler's transaction failed.
pub(crate) struct CompleteInError {
    pub(crate) error: StoreError,
    /// The handler's own statements had already failed (SQLSTATE 25P02): nothing in the
    /// transaction can commit.
    pub(crate) aborted_transaction: bool,
}

/// Stored headers back into HTTP types. The table may have been written by anyone: a name or value
/// that is not valid HTTP is dropped rather than trusted (the layer's header policy applies on
/// replay).
fn parse_headers(names: Vec<String>, values: Vec<Vec<u8>>) -> Vec<(HeaderName, HeaderValue)> {
    names
        .into_iter()
        .zip(values)
        .filter_map(|(name, value)| {
            let name = HeaderName::from_bytes(name.as_bytes()).ok()?;
            let value = HeaderValue::from_bytes(&value).ok()?;
            Some((name, value))
        })
        .collect()
}

/// True when a claim row shows an existing record that only a retake could claim.
fn needs_retake(row: &PgRow) -> bool {
    let flag = |name: &str| {
        row.try_get::<Option<bool>, _>(name)
            .ok()
            .flatten()
            .unwrap_or(false)
    };
    let in_progress = row
        .try_get::<Option<String>, _>("status")
        .ok()
        .flatten()
        .as_deref()
        == Some("in_progress");
    !flag("inserted") && (flag("expired") || (in_progress && flag("stale")))
}

/// Runs `$op` (an expression using the connection `$conn`) on a connection of `$store`'s pool,
/// the pool wait and the statement each within the operation timeout; gives `Result<Result<T, sqlx::Error>,
/// StoreError>`, the outer error for a timeout or a failed acquire. A connection whose statement
/// was cut short by the timeout is closed rather than returned: sqlx would keep it out of the pool
/// until the server finished the statement, which for a connection that died quietly is hours, so
/// a few such timeouts would empty the pool.
macro_rules! on_connection {
    ($store:expr, $what:expr, $conn:ident => $op:expr) => {{
        let store = $store;
        match tokio::time::timeout(store.timeout, store.pool.acquire()).await {
            Err(_) => Err(store.no_answer($what)),
            Ok(Err(e)) => Err(db($what)(e)),
            Ok(Ok(mut $conn)) => {
                // The statement has a whole timeout of its own: one that waited long for its
                // connection must not cut a healthy statement short (and close its connection).
                let done = tokio::time::timeout(store.timeout, $op).await;
                match done {
                    Ok(result) => Ok(result),
                    Err(_) => {
                        drop($conn.detach());
                        Err(store.no_answer($what))
                    }
                }
            }
        }
    }};
}
use on_connection;

/// The server-side lock timeout for a client timeout: four fifths of it, so the server gives up
/// (and answers) before the client does.
fn lock_timeout_for(timeout: Duration) -> Arc<str> {
    format!("{}ms", pg_millis(timeout * 4 / 5)).into()
}

/// Milliseconds for a PostgreSQL time setting: at least 1 (0 turns the setting off), at most what
/// an `int` setting holds (about 24 days).
fn pg_millis(d: Duration) -> u128 {
    d.as_millis().clamp(1, i32::MAX as u128)
}

fn micros(d: Duration) -> f64 {
    d.as_micros() as f64
}

fn db(what: &'static str) -> impl Fn(sqlx::Error) -> StoreError {
    move |e| StoreError::new(format!("postgres {what}"), e)
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_generation_migration_splits_into_its_column_and_its_function() {
        let (column, function) = super::GENERATION_MIGRATION
            .split_once("CREATE OR REPLACE FUNCTION")
            .expect("the function");
        assert!(column.contains("ADD COLUMN IF NOT EXISTS generation bytea"));
        assert!(function.contains(super::DEFAULT_FUNCTION));
        assert!(!function.contains("CREATE OR REPLACE FUNCTION"));
    }
}
