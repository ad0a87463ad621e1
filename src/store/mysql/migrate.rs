//! `migrate()`: the table and its indexes (`migrations/mysql/`), applied under a named lock held by
//! one connection.

use sqlx::MySqlConnection;

use super::sql::DEFAULT_TABLE;
use super::{MySqlStore, db};
use crate::store::StoreError;
use crate::store::sql::{InFlight, MIN_MIGRATE_TIMEOUT};

/// The table, with `idempotency_records` as its name (and its indexes' and constraint's names
/// after it).
const TABLE: &str = include_str!("../../../migrations/mysql/0001_idempotency_records.sql");

/// Each record's body length, kept with the row (applied when the column is missing).
const BODY_BYTES: &str = include_str!("../../../migrations/mysql/0002_idempotency_body_bytes.sql");

/// The mark of a record whose holder a claim found silent (applied when the column is missing).
const SUSPECTED: &str = include_str!("../../../migrations/mysql/0003_idempotency_suspected.sql");

/// The columns of an operation's steps (applied when the column is missing).
const STEPS: &str = include_str!("../../../migrations/mysql/0004_idempotency_steps.sql");

/// The indexes the table has (each made by `CREATE TABLE`, and again, if missing, by `migrate()`):
/// the suffix of its name after the table's, and its columns.
const INDEXES: [(&str, &str); 2] = [
    ("_expires_at_idx", "expires_at"),
    ("_subject_idx", "subject_digest, created_at, scope"),
];

impl MySqlStore {
    /// Creates the table and its indexes if they do not exist (`migrations/mysql/`). Safe to call
    /// from many instances at once: they take turns, under `GET_LOCK('<table>_migrate')` held by
    /// the connection that applies it (MySQL commits each DDL statement on its own, so every step
    /// is idempotent: `CREATE TABLE IF NOT EXISTS`, and an index created only when
    /// `information_schema` does not list it). It touches no migration bookkeeping of the
    /// application's (no `_sqlx_migrations` rows). It fails, rather than waiting forever, after
    /// the operation timeout or 30 s, whichever is longer; and it fails with a clear error when
    /// the table exists in a shape this version cannot use.
    ///
    /// Call it on the `MySqlStore` itself, before wrapping it in a `CachedStore` or an
    /// `EncryptedStore` (they have no `migrate()`).
    pub async fn migrate(&self) -> Result<(), StoreError> {
        let limit = self.timeout.max(MIN_MIGRATE_TIMEOUT);
        let connection = tokio::time::timeout(limit, self.pool.acquire())
            .await
            .map_err(|_| StoreError::msg(format!("mysql migrate: no connection within {limit:?}")))?
            .map_err(db("migrate: connect"))?;
        // Closed if the migration is cut short: the server then lets go of the lock with the
        // session.
        let mut flight = InFlight::new(connection);
        let lock = format!("{}_migrate", self.sql.name);
        let done = tokio::time::timeout(limit, async {
            let conn: &mut sqlx::MySqlConnection = &mut flight;
            let (locked,): (Option<i64>,) = sqlx::query_as("SELECT GET_LOCK(?, ?)")
                .bind(&lock)
                .bind(limit.as_secs())
                .fetch_one(&mut *conn)
                .await
                .map_err(db("migrate: lock"))?;
            if locked != Some(1) {
                return Err(StoreError::msg(format!(
                    "mysql migrate: the lock {lock} was not had within {limit:?}"
                )));
            }
            let applied = self.apply(conn).await;
            let released = sqlx::query("SELECT RELEASE_LOCK(?)")
                .bind(&lock)
                .execute(&mut *conn)
                .await
                .map_err(db("migrate: unlock"));
            applied.and(released.map(|_| ()))
        })
        .await;
        match done {
            Ok(Ok(())) => {
                drop(flight.landed());
                Ok(())
            }
            // The connection may still hold the lock: it is closed with `flight`.
            Ok(Err(e)) => Err(e),
            Err(_) => Err(StoreError::msg(format!(
                "mysql migrate: not done within {limit:?}"
            ))),
        }
    }

    /// The table and its indexes, on `conn` holding the migration lock.
    async fn apply(&self, conn: &mut MySqlConnection) -> Result<(), StoreError> {
        // The server's flavor, for the bounds of later statements.
        self.bounds(conn).await.map_err(db("migrate: version"))?;
        let name = &self.sql.name;
        let table = TABLE
            .replace(&format!("{DEFAULT_TABLE}_"), "\u{0}")
            .replace(DEFAULT_TABLE, &self.sql.quoted)
            .replace('\u{0}', &format!("{name}_"));
        sqlx::raw_sql(sqlx::AssertSqlSafe(table))
            .execute(&mut *conn)
            .await
            .map_err(db("migrate: create table"))?;
        sqlx::raw_sql(sqlx::AssertSqlSafe(self.sql.check_shape()))
            .execute(&mut *conn)
            .await
            .map_err(|e| {
                StoreError::new(
                    format!(
                        "mysql migrate: the table {} exists but lacks the columns this version \
                         needs (see migrations/mysql); rename or drop it, then migrate again",
                        self.sql.table
                    ),
                    e,
                )
            })?;
        // Each statement (the files' comments left out) adds one column: applied when its column
        // is missing.
        let columns = [BODY_BYTES, SUSPECTED, STEPS]
            .into_iter()
            .flat_map(crate::store::sql::added_columns);
        for (column, migration) in columns {
            let (present,): (i64,) = sqlx::query_as(
                "SELECT COUNT(*) FROM information_schema.columns \
                 WHERE table_schema = COALESCE(?, DATABASE()) AND table_name = ? \
                   AND column_name = ?",
            )
            .bind(self.sql.database.as_deref())
            .bind(name)
            .bind(column.as_str())
            .fetch_one(&mut *conn)
            .await
            .map_err(db("migrate: look up a column"))?;
            if present == 0 {
                let alter = migration.replace(DEFAULT_TABLE, &self.sql.quoted);
                sqlx::raw_sql(sqlx::AssertSqlSafe(alter))
                    .execute(&mut *conn)
                    .await
                    .map_err(|e| StoreError::new(format!("mysql migrate: add {column}"), e))?;
            }
        }
        // Counts name the columns again, now that they are there.
        for column in [&self.sql.body_bytes, &self.sql.counts_steps] {
            column.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        for (suffix, columns) in INDEXES {
            let index = format!("{name}{suffix}");
            let (present,): (i64,) = sqlx::query_as(
                "SELECT COUNT(*) FROM information_schema.statistics \
                 WHERE table_schema = COALESCE(?, DATABASE()) AND table_name = ? \
                   AND index_name = ?",
            )
            .bind(self.sql.database.as_deref())
            .bind(name)
            .bind(&index)
            .fetch_one(&mut *conn)
            .await
            .map_err(db("migrate: look up an index"))?;
            if present == 0 {
                let create = format!("CREATE INDEX {index} ON {} ({columns})", self.sql.quoted);
                sqlx::raw_sql(sqlx::AssertSqlSafe(create))
                    .execute(&mut *conn)
                    .await
                    .map_err(db("migrate: create an index"))?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_migration_names_the_table_and_its_indexes_after_it() {
        let sql = super::TABLE;
        assert!(sql.contains("CREATE TABLE IF NOT EXISTS idempotency_records ("));
        for (suffix, columns) in super::INDEXES {
            assert!(
                sql.contains(&format!("KEY idempotency_records{suffix} ({columns})")),
                "{suffix}"
            );
        }
    }
}
