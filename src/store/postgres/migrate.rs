//! `migrate()`: the table, its index, the generation column, the claim function and the listing's
//! index (`migrations/`), applied under an advisory lock, and the store pinned to the table's
//! schema.

use super::sql::{DEFAULT_TABLE, quote_ident};
use super::statements::Statements;
use super::{PostgresStore, db};
use crate::store::StoreError;
use crate::store::sql::MIN_MIGRATE_TIMEOUT;
use crate::util::lock::lock;

/// The migration, with `idempotency_records` as the table name.
const MIGRATION: &str = include_str!("../../../migrations/0001_idempotency_records.sql");
/// The generation column and the claim function that keeps it (the one claims use), with
/// `idempotency_records` as the table name. (0002's claim function, without generations, is what
/// earlier versions call; claims of this version do not.)
const GENERATION_MIGRATION: &str =
    include_str!("../../../migrations/0003_idempotency_generation.sql");
/// The claim function's name for the default table; for another table, `<table>_claim_v1`.
const DEFAULT_FUNCTION: &str = "idempotency_records_claim_v2";
/// The claim function's argument types, as `to_regprocedure` and `ALTER FUNCTION` name them.
const CLAIM_V2_ARGUMENTS: &str =
    "(bytea,text,text,text,bytea,bigint,double precision,double precision,bytea)";
/// Fixes the claim function's search path (the table's schema in place of `public`).
const SEARCH_PATH_MIGRATION: &str =
    include_str!("../../../migrations/0004_idempotency_claim_search_path.sql");
/// The holder's in-progress TTL column and the claim function that reads it, with
/// `idempotency_records` as the table name.
const HOLDER_TTL_MIGRATION: &str =
    include_str!("../../../migrations/0006_idempotency_holder_ttl.sql");
/// The column that marks a record whose holder a claim found silent, with `idempotency_records`
/// as the table name.
const SUSPECTED_MIGRATION: &str =
    include_str!("../../../migrations/0007_idempotency_suspected.sql");
/// The columns of the operation's steps (recovery points), with `idempotency_records` as the
/// table name.
const STEPS_MIGRATION: &str = include_str!("../../../migrations/0009_idempotency_steps.sql");
/// The function that claims many keys in one statement, with `idempotency_records` as the table
/// name.
const CLAIM_MANY_MIGRATION: &str =
    include_str!("../../../migrations/0008_idempotency_claim_many.sql");
/// That function's name for the default table; for another table, `<table>_claim_many`.
const DEFAULT_MANY_FUNCTION: &str = "idempotency_records_claim_many";
/// That function's argument types, as `to_regprocedure` names them.
const CLAIM_MANY_ARGUMENTS: &str =
    "(bytea[],text[],text[],text[],bytea[],bigint[],double precision[],double precision[],bytea[])";
/// The index that lists a subject's records, with `idempotency_records` as the table name.
const SUBJECT_INDEX_MIGRATION: &str =
    include_str!("../../../migrations/0005_idempotency_subject_index.sql");
/// The subject index's name for the default table; for another table, `<table>_subject_idx`.
const DEFAULT_SUBJECT_INDEX: &str = "idempotency_records_subject_idx";
/// Serialises concurrent `migrate()` calls across instances (`pg_advisory_xact_lock` key).
const MIGRATE_LOCK: i64 = 0x6178_6964_656d_0001; // "axidem" + 1

impl PostgresStore {
    /// Creates the table, its index and the claim function if they do not exist (`migrations/`).
    /// Safe to call from many instances at once: an advisory lock serialises them. It touches no
    /// migration bookkeeping of the application's (no `_sqlx_migrations` rows). It fails, rather
    /// than waiting forever, after
    /// the operation timeout or 30 s, whichever is longer; and it fails with a
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
            apply_holder_ttl(&mut tx, &pinned).await?;
            let suspected = SUSPECTED_MIGRATION.replace(DEFAULT_TABLE, &pinned.quoted);
            add_column(&mut tx, &pinned, "suspected_on", "0007", suspected).await?;
            apply_subject_index(&mut tx, &pinned).await?;
            apply_claim_many(&mut tx, &pinned).await?;
            let steps = STEPS_MIGRATION.replace(DEFAULT_TABLE, &pinned.quoted);
            add_column(&mut tx, &pinned, "step_results", "0009", steps).await?;
            tx.commit().await.map_err(db("migrate: commit"))?;
            *lock(&pinned.many_missing) = None;
            *lock(&configured.many_missing) = None;
            *lock(&self.configured.many_missing) = None;
            *lock(&pinned.function_missing) = None;
            *lock(&configured.function_missing) = None;
            *lock(&self.configured.function_missing) = None;
            // Counts name the steps' columns again, now that they are there.
            for sql in [&pinned, configured, &self.configured] {
                sql.inspection
                    .counts_steps
                    .store(true, std::sync::atomic::Ordering::Relaxed);
            }
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
        add_column(tx, sql, "generation", "0003", column_sql).await?;
        let (function,): (bool,) = sqlx::query_as("SELECT to_regprocedure($1) IS NOT NULL")
            .bind(&signature)
            .fetch_one(&mut *tx)
            .await
            .map_err(db("migrate: look up the claim function"))?;
        if !function {
            // A role that may write the table but not create in its schema: claims work without
            // the function (two statements when they race), as they did before it.
            unless_forbidden(
                tx,
                function_sql,
                "create the claim function",
                "migrate: no privilege to create the claim function; claims that race will take \
                 two round trips (apply migrations/0003 as a role that may)",
            )
            .await?;
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
            // Not the function's owner: it keeps working as it did.
            unless_forbidden(
                tx,
                search_path_sql,
                "fix the claim function's search path",
                "migrate: no privilege to fix the claim function's search path (apply \
                 migrations/0004 as its owner)",
            )
            .await?;
        }
        Ok(())
    }
}

/// The holder's TTL column and the claim function that reads it (migrations/0006), on the table
/// as `sql` names it. The column is needed by claims (their statements write it); a claim function
/// that cannot be replaced (not its owner) keeps working as it did, judging staleness by the
/// claimer's TTL alone, with a warning.
async fn apply_holder_ttl(tx: &mut sqlx::PgConnection, sql: &Statements) -> Result<(), StoreError> {
    let migration = HOLDER_TTL_MIGRATION
        .replace(DEFAULT_FUNCTION, "\u{0}")
        .replace(DEFAULT_TABLE, &sql.quoted)
        .replace('\u{0}', &sql.function_v2)
        .replace(
            "pg_catalog, public, pg_temp",
            &format!(
                "pg_catalog, {}, pg_temp",
                quote_ident(sql.schema.as_deref().unwrap_or("public"))
            ),
        );
    let Some((column_sql, function_sql)) = migration.split_once("CREATE OR REPLACE FUNCTION")
    else {
        return Err(StoreError::msg(
            "migrate: migrations/0006 has no claim function",
        ));
    };
    let function_sql = format!("CREATE OR REPLACE FUNCTION{function_sql}");
    add_column(tx, sql, "in_progress_ttl_us", "0006", column_sql.to_owned()).await?;
    // The claim function, unless it reads the column already (or is missing: claims then use
    // their own statements, which do).
    let signature = format!("{}{CLAIM_V2_ARGUMENTS}", sql.function_v2);
    let current: Option<(bool,)> = sqlx::query_as(
        "SELECT pg_catalog.strpos(p.prosrc, 'in_progress_ttl_us') > 0 \
         FROM pg_catalog.pg_proc p WHERE p.oid = pg_catalog.to_regprocedure($1)",
    )
    .bind(&signature)
    .fetch_optional(&mut *tx)
    .await
    .map_err(db("migrate: look up the claim function"))?;
    if let Some((false,)) = current {
        unless_forbidden(
            tx,
            function_sql,
            "update the claim function",
            "migrate: no privilege to update the claim function (apply migrations/0006 as its \
             owner); until then a claim judges a record abandoned by its own in-progress TTL, \
             not its holder's",
        )
        .await?;
    }
    Ok(())
}

/// The function that claims many keys (migrations/0008), on the table as `sql` names it, unless
/// it is there. A role that may not create it leaves claims one statement each, with a warning.
async fn apply_claim_many(tx: &mut sqlx::PgConnection, sql: &Statements) -> Result<(), StoreError> {
    let signature = format!("{}{CLAIM_MANY_ARGUMENTS}", sql.function_many);
    let (present,): (bool,) = sqlx::query_as("SELECT to_regprocedure($1) IS NOT NULL")
        .bind(&signature)
        .fetch_one(&mut *tx)
        .await
        .map_err(db("migrate: look up the function that claims many keys"))?;
    if present {
        return Ok(());
    }
    let function_sql = CLAIM_MANY_MIGRATION
        .replace(DEFAULT_MANY_FUNCTION, "\u{0}")
        .replace(DEFAULT_TABLE, &sql.quoted)
        .replace('\u{0}', &sql.function_many)
        .replace(
            "pg_catalog, public, pg_temp",
            &format!(
                "pg_catalog, {}, pg_temp",
                quote_ident(sql.schema.as_deref().unwrap_or("public"))
            ),
        );
    unless_forbidden(
        tx,
        function_sql,
        "create the function that claims many keys",
        "migrate: no privilege to create the function that claims many keys (apply \
         migrations/0008 as a role that may); until then every claim is a statement of its own",
    )
    .await
}

/// Adds the column `name` to the table as `sql` names it with `column_sql` (from
/// `migrations/<migration>`), unless it is there: `ADD COLUMN IF NOT EXISTS` locks the table even
/// when the column exists. The lock is waited for only briefly (claims queue behind a waiting
/// `ALTER`); the caller may try again.
async fn add_column(
    tx: &mut sqlx::PgConnection,
    sql: &Statements,
    name: &str,
    migration: &str,
    column_sql: String,
) -> Result<(), StoreError> {
    let (present,): (bool,) = sqlx::query_as(
        "SELECT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass($1) \
             AND attname = $2 AND NOT attisdropped)",
    )
    .bind(&sql.quoted)
    .bind(name)
    .fetch_one(&mut *tx)
    .await
    .map_err(|e| StoreError::new(format!("migrate: look up the {name} column"), e))?;
    if present {
        return Ok(());
    }
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
                    "migrate: could not add the {name} column to {} (it needs the table's owner, \
                     and no long transaction on it; apply migrations/{migration} as its owner, or \
                     migrate again)",
                    sql.table
                ),
                e,
            )
        })?;
    sqlx::query("SET LOCAL lock_timeout = 0")
        .execute(&mut *tx)
        .await
        .map_err(db("migrate: lock timeout"))?;
    Ok(())
}

/// The index that lists a subject's records (migrations/0005), on the table as `sql` names it,
/// unless it exists: `CREATE INDEX IF NOT EXISTS` would lock the table against writes even then.
/// It is not needed for claims, so a role that does not own the table, or a table whose lock is
/// not had within 3 s (claims would queue behind the waiting build), leaves it out with a
/// warning; the next `migrate()` tries again.
/// The largest table (its heap, in bytes) on which `migrate()` builds the subject index itself.
const SUBJECT_INDEX_MAX_TABLE_BYTES: i64 = 64 * 1024 * 1024;

async fn apply_subject_index(
    tx: &mut sqlx::PgConnection,
    sql: &Statements,
) -> Result<(), StoreError> {
    let (present,): (bool,) = sqlx::query_as("SELECT to_regclass($1) IS NOT NULL")
        .bind(&sql.qualified_subject_index)
        .fetch_one(&mut *tx)
        .await
        .map_err(db("migrate: look up the subject index"))?;
    if present {
        return Ok(());
    }
    // Built here only on a table small enough to index in about a second: the build holds off
    // every write on the table (claims, heartbeats, completions) until this transaction ends, and
    // a long stall of heartbeats would let records of live handlers be retaken. A larger table is
    // left to the operator (`CREATE INDEX CONCURRENTLY`, see migrations/0005); listings read the
    // whole table meanwhile.
    let (bytes,): (i64,) =
        sqlx::query_as("SELECT coalesce(pg_relation_size(to_regclass($1)), 0)::int8")
            .bind(&sql.quoted)
            .fetch_one(&mut *tx)
            .await
            .map_err(db("migrate: the table's size"))?;
    if bytes > SUBJECT_INDEX_MAX_TABLE_BYTES {
        tracing::warn!(
            table_bytes = bytes,
            "migrate: the table is too large to build the index that lists a subject's records              while it takes writes; create it with CREATE INDEX CONCURRENTLY (migrations/0005)              for listings that do not read the whole table"
        );
        return Ok(());
    }
    let index_sql = SUBJECT_INDEX_MIGRATION
        .replace(DEFAULT_SUBJECT_INDEX, "\u{0}")
        .replace(DEFAULT_TABLE, &sql.quoted)
        .replace('\u{0}', &sql.subject_index);
    sqlx::query("SET LOCAL lock_timeout = '3s'")
        .execute(&mut *tx)
        .await
        .map_err(db("migrate: lock timeout"))?;
    unless_refused(
        tx,
        index_sql,
        "create the subject index",
        "migrate: could not create the index that lists a subject's records (it needs the \
         table's owner, and no long transaction on it); listings read the whole table until it \
         is there (apply migrations/0005 as the table's owner, or migrate again)",
        &["42501", "55P03"],
    )
    .await?;
    sqlx::query("SET LOCAL lock_timeout = 0")
        .execute(&mut *tx)
        .await
        .map_err(db("migrate: lock timeout"))?;
    Ok(())
}

/// Runs `sql` under a savepoint; a refusal for want of privilege (SQLSTATE 42501) is logged with
/// `warning` and rolled back to the savepoint, so the migration goes on without it.
async fn unless_forbidden(
    tx: &mut sqlx::PgConnection,
    sql: String,
    what: &'static str,
    warning: &'static str,
) -> Result<(), StoreError> {
    unless_refused(tx, sql, what, warning, &["42501"]).await
}

/// Runs `sql` under a savepoint; an error with one of the SQLSTATE `codes` is logged with
/// `warning` and rolled back to the savepoint, so the migration goes on without it.
async fn unless_refused(
    tx: &mut sqlx::PgConnection,
    sql: String,
    what: &'static str,
    warning: &'static str,
    codes: &[&str],
) -> Result<(), StoreError> {
    sqlx::query("SAVEPOINT migrate_step")
        .execute(&mut *tx)
        .await
        .map_err(db("migrate: savepoint"))?;
    match sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
        .execute(&mut *tx)
        .await
    {
        Ok(_) => Ok(()),
        Err(sqlx::Error::Database(e)) if e.code().is_some_and(|c| codes.contains(&&*c)) => {
            tracing::warn!(error = %e, "{warning}");
            sqlx::query("ROLLBACK TO SAVEPOINT migrate_step")
                .execute(&mut *tx)
                .await
                .map_err(db("migrate: rollback to savepoint"))?;
            Ok(())
        }
        Err(e) => Err(StoreError::new(format!("postgres migrate: {what}"), e)),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_holder_ttl_migration_splits_into_its_column_and_its_function() {
        let (column, function) = super::HOLDER_TTL_MIGRATION
            .split_once("CREATE OR REPLACE FUNCTION")
            .expect("the function");
        assert!(column.contains("ADD COLUMN IF NOT EXISTS in_progress_ttl_us double precision"));
        assert!(function.contains(super::DEFAULT_FUNCTION));
        assert!(function.contains("SET search_path = pg_catalog, public, pg_temp"));
        assert!(function.contains("coalesce(r.in_progress_ttl_us, 0)"));
        assert!(!function.contains("CREATE OR REPLACE FUNCTION"));
    }

    #[test]
    fn the_generation_migration_splits_into_its_column_and_its_function() {
        let (column, function) = super::GENERATION_MIGRATION
            .split_once("CREATE OR REPLACE FUNCTION")
            .expect("the function");
        assert!(column.contains("ADD COLUMN IF NOT EXISTS generation bytea"));
        assert!(function.contains(super::DEFAULT_FUNCTION));
        assert!(!function.contains("CREATE OR REPLACE FUNCTION"));
    }

    #[test]
    fn the_subject_index_migration_names_the_index_and_the_table() {
        let sql = super::SUBJECT_INDEX_MIGRATION;
        assert!(sql.contains(&format!(
            "CREATE INDEX IF NOT EXISTS {}\n    ON {} (subject, created_at, scope)",
            super::DEFAULT_SUBJECT_INDEX,
            super::DEFAULT_TABLE
        )));
    }
}
