//! `migrate()`: WAL mode for the file, then the table and its indexes
//! (`migrations/sqlite/0001_idempotency_records.sql`), the boot clock's column (`0002`, when it is
//! missing) and the steps' columns (`0003`, when they are missing) inside `BEGIN IMMEDIATE`, SQLite's write lock, which serialises concurrent
//! migrations of every process on the file.

use sqlx::Connection;

use super::{SqliteStore, db, statement};
use crate::store::StoreError;
use crate::store::sql::MIN_MIGRATE_TIMEOUT;

/// `PRAGMA synchronous` of FULL: each commit is flushed to disk before it returns.
const SYNCHRONOUS_FULL: i64 = 2;

impl SqliteStore {
    /// Creates the table and its indexes if they do not exist (`migrations/sqlite/0001`), and adds
    /// the column of the boot clock when it is missing (`0002`: run it once after an upgrade from
    /// a version before it; claims refuse, `503`, until it has run), inside
    /// `BEGIN IMMEDIATE`: SQLite's write lock serialises it with every other writer of the file,
    /// so many processes may migrate at once, and a migration that has run already changes
    /// nothing. It touches no migration bookkeeping of the application's (no `_sqlx_migrations`
    /// rows), and no other table. It fails after the operation timeout or 30 s, whichever is
    /// longer, and with a clear error when the table exists in a shape this version cannot use.
    ///
    /// It also puts the file in WAL mode when it is not (`journal_mode` is kept in the file), and
    /// warns when it cannot, or when the connections do not flush each commit to disk
    /// (`synchronous` below FULL) or do not wait for other writers (`busy_timeout` of 0).
    ///
    /// Call it on the `SqliteStore` itself, before wrapping it in a `CachedStore` or an
    /// `EncryptedStore` (they have no `migrate()`).
    pub async fn migrate(&self) -> Result<(), StoreError> {
        let limit = self.timeout.max(MIN_MIGRATE_TIMEOUT);
        let migration = async {
            let mut conn = self.pool.acquire().await.map_err(db("migrate"))?;
            check_settings(&mut conn).await?;
            let mut tx = conn
                .begin_with("BEGIN IMMEDIATE")
                .await
                .map_err(db("migrate: begin"))?;
            let mut created = sqlx::raw_sql(sqlx::AssertSqlSafe(self.sql.migration.as_str()))
                .execute(&mut *tx)
                .await
                .map(drop);
            if created.is_ok() {
                let (has,): (i64,) =
                    sqlx::query_as(sqlx::AssertSqlSafe(self.sql.has_boot_clock.as_str()))
                        .fetch_one(&mut *tx)
                        .await
                        .map_err(db("migrate: the boot clock's column"))?;
                if has == 0 {
                    created =
                        sqlx::raw_sql(sqlx::AssertSqlSafe(self.sql.boot_clock_column.as_str()))
                            .execute(&mut *tx)
                            .await
                            .map(drop);
                }
            }
            for (column, alter) in &self.sql.steps_columns {
                if created.is_err() {
                    break;
                }
                let (has,): (i64,) =
                    sqlx::query_as(sqlx::AssertSqlSafe(self.sql.has_column.as_str()))
                        .bind(column.as_str())
                        .fetch_one(&mut *tx)
                        .await
                        .map_err(db("migrate: the steps' columns"))?;
                if has == 0 {
                    created = sqlx::raw_sql(sqlx::AssertSqlSafe(alter.as_str()))
                        .execute(&mut *tx)
                        .await
                        .map(drop);
                }
            }
            // A table of another shape fails the indexes' creation first: say what is wrong.
            sqlx::query(statement(&self.sql.check_shape))
                .execute(&mut *tx)
                .await
                .map_err(|e| {
                    StoreError::new(
                        format!(
                            "sqlite migrate: the table {} exists but lacks the columns this \
                             version needs; rename or drop it, then migrate again",
                            self.sql.table
                        ),
                        e,
                    )
                })?;
            created.map_err(db("migrate: create the table"))?;
            tx.commit().await.map_err(db("migrate: commit"))?;
            // Counts name the steps' column again, now that it is there.
            self.sql
                .counts_steps
                .store(true, std::sync::atomic::Ordering::Relaxed);
            Ok(())
        };
        match tokio::time::timeout(limit, migration).await {
            Ok(result) => result,
            Err(_) => Err(StoreError::msg(format!(
                "sqlite migrate: not done within {limit:?}"
            ))),
        }
    }
}

/// WAL mode for the file (set when it is not), and warnings for connection settings that lose
/// records or fail writers needlessly.
async fn check_settings(conn: &mut sqlx::SqliteConnection) -> Result<(), StoreError> {
    let (mode,): (String,) = sqlx::query_as("PRAGMA journal_mode")
        .fetch_one(&mut *conn)
        .await
        .map_err(db("migrate: journal mode"))?;
    if !mode.eq_ignore_ascii_case("wal") {
        // Changing it needs the file to itself: other connections may keep it from happening.
        let set: Result<(String,), _> = sqlx::query_as("PRAGMA journal_mode = WAL")
            .fetch_one(&mut *conn)
            .await;
        match set {
            Ok((now,)) if now.eq_ignore_ascii_case("wal") => {}
            Ok((now,)) => tracing::warn!(
                journal_mode = %now,
                "sqlite migrate: the database is not in WAL mode (an in-memory database cannot \
                 be): readers and writers wait on each other"
            ),
            Err(e) => tracing::warn!(
                error = %e,
                journal_mode = %mode,
                "sqlite migrate: could not put the database in WAL mode (set \
                 journal_mode=WAL on the pool's connections): readers and writers wait on each \
                 other"
            ),
        }
    }
    let (synchronous,): (i64,) = sqlx::query_as("PRAGMA synchronous")
        .fetch_one(&mut *conn)
        .await
        .map_err(db("migrate: synchronous"))?;
    if synchronous < SYNCHRONOUS_FULL {
        tracing::warn!(
            synchronous,
            "sqlite: the connections do not flush each commit to disk (synchronous below \
             FULL): a loss of power may forget the last records, and their requests run again"
        );
    }
    let (busy,): (i64,) = sqlx::query_as("PRAGMA busy_timeout")
        .fetch_one(&mut *conn)
        .await
        .map_err(db("migrate: busy timeout"))?;
    if busy == 0 {
        tracing::warn!(
            "sqlite: the connections have no busy timeout: a write that meets another \
             process's (or a handler's transaction's) lock fails at once"
        );
    }
    Ok(())
}
