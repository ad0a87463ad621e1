//! What the SQL stores (PostgreSQL, MySQL/MariaDB, SQLite) share, written once and generic over
//! the sqlx database: their timeouts, the table names they accept, a connection whose statement
//! is under way ([`InFlight`]), connections kept between operations (`Parking`, on the servers),
//! the keeper's pool of its own, and a database error as a store answers it ([`db`], through each
//! database's [`Backend`]).

use std::time::Duration;

use sqlx::{Connection, Database, Pool};

use crate::store::StoreError;

#[cfg(any(feature = "postgres", feature = "sqlite", feature = "mysql"))]
pub(crate) mod batch;
mod in_flight;
mod name;
#[cfg(any(feature = "postgres", feature = "mysql"))]
mod parking;

pub(crate) use in_flight::InFlight;
pub use name::InvalidTableName;
#[cfg(feature = "sqlite")]
pub(crate) use name::plain_table;
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) use name::qualified_table;
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) use parking::Parking;

/// How long one store operation may take before it counts as failed (`503`), by default.
pub(crate) const DEFAULT_OPERATION_TIMEOUT: Duration = Duration::from_secs(5);
/// The shortest operation timeout a store's `with_timeout` sets: shorter ones are raised to it (no
/// database answers faster, and every statement would fail).
pub(crate) const MIN_OPERATION_TIMEOUT: Duration = Duration::from_millis(10);
/// The shortest time `migrate()` is given, whatever the operation timeout: the lock between
/// instances migrating at once, and the statements of the migrations.
pub(crate) const MIN_MIGRATE_TIMEOUT: Duration = Duration::from_secs(30);

/// What the shared code needs to know of one database's errors.
pub(crate) trait Backend {
    /// The name its errors start with (`postgres`, `mysql`, `sqlite`).
    const NAME: &'static str;

    /// Whether `e` refused a write for lack of room (a full disk or table, exhausted memory):
    /// nothing was written, and the layer must not run unguarded for it.
    fn no_room(e: &sqlx::Error) -> bool;

    /// What to say of `e` when it is a lock the statement waited on too long (the statement did
    /// nothing, and a retry settles it).
    fn busy(_e: &sqlx::Error) -> Option<&'static str> {
        None
    }

    /// Whether `e` says the connection itself is gone (its socket, or the server ended the
    /// session) rather than anything about the statement: a kept connection's statement then goes
    /// once more on one from the pool.
    #[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
    fn lost_connection(_e: &sqlx::Error) -> bool {
        false
    }
}

/// A database error as the store of `B` answers it: no room is [`StoreError::store_full`] (the
/// layer then refuses rather than run unguarded), the rest an ordinary failure (`503`).
pub(crate) fn db<B: Backend>(what: &'static str) -> impl Fn(sqlx::Error) -> StoreError {
    move |e| {
        let name = B::NAME;
        if B::no_room(&e) {
            StoreError::store_full(format!("{name} {what}: the database has no room: {e}"))
        } else if let Some(busy) = B::busy(&e) {
            StoreError::new(format!("{name} {what}: {busy}"), e)
        } else {
            StoreError::new(format!("{name} {what}"), e)
        }
    }
}

/// The error of a steps' statement (see `IdempotencyStore::steps`): a table that lacks their
/// columns (`migrate()` has not run since this version) cannot keep steps, and saying so spares the
/// engine its tries again; anything else as [`db`] answers it.
pub(crate) fn steps_error<B: Backend>(what: &'static str) -> impl Fn(sqlx::Error) -> StoreError {
    move |e| {
        if is_undefined_column(&e) {
            StoreError::unsupported(format!(
                "{} {what}: the table has no columns for steps; run migrate() ({e})",
                B::NAME
            ))
        } else {
            db::<B>(what)(e)
        }
    }
}

/// The columns a migration file adds, each with the statement that adds it (`ALTER TABLE ...
/// ADD COLUMN name ...`), in the file's order: comments (`--` lines) left out, statements split
/// at `;`. Each is applied where the table lacks its column, so that a migration runs again
/// safely on databases without `ADD COLUMN IF NOT EXISTS`.
#[cfg(any(feature = "sqlite", feature = "mysql"))]
pub(crate) fn added_columns(file: &str) -> Vec<(String, String)> {
    let code: Vec<&str> = file
        .lines()
        .filter(|line| !line.trim_start().starts_with("--"))
        .collect();
    code.join("\n")
        .split(';')
        .filter_map(|statement| {
            let (_, added) = statement.split_once("ADD COLUMN ")?;
            let column = added.split_whitespace().next()?.to_owned();
            Some((column, statement.to_owned()))
        })
        .collect()
}

/// A subject's count (records, bytes) by `count(true)`, whose statement names the steps' columns,
/// while `counts_steps` says the table has them; on a table without them (not migrated since
/// steps came), `count(false)`, the answers' bytes alone, with the flag turned off (and said once)
/// until `migrate()` turns it on again.
#[cfg(any(feature = "postgres", feature = "sqlite"))]
pub(crate) async fn count_with_steps<B: Backend, Fut>(
    counts_steps: &std::sync::atomic::AtomicBool,
    table: &str,
    count: impl Fn(bool) -> Fut,
) -> Result<(i64, i64), StoreError>
where
    Fut: std::future::Future<Output = Result<Result<(i64, i64), sqlx::Error>, StoreError>>,
{
    use std::sync::atomic::Ordering;
    if counts_steps.load(Ordering::Relaxed) {
        match count(true).await? {
            Ok(found) => return Ok(found),
            Err(e) if is_undefined_column(&e) => {
                counts_steps.store(false, Ordering::Relaxed);
                tracing::warn!(
                    table,
                    "the idempotency table has no columns for steps: a subject's bytes count its \
                     answers alone; run migrate()"
                );
            }
            Err(e) => return Err(db::<B>("count")(e)),
        }
    }
    count(false).await?.map_err(db::<B>("count"))
}

/// Whether `e` is the database's refusal of a column the table lacks: PostgreSQL's undefined
/// column, MySQL's unknown column, SQLite's message.
pub(crate) fn is_undefined_column(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(d) => {
            matches!(d.code().as_deref(), Some("42703" | "42S22"))
                || d.message().contains("no such column")
                || d.message().contains("Unknown column")
        }
        _ => false,
    }
}

/// The keeper's pool (see `keeper_session`): one connection of its own with `options`, made on
/// first use (on the keeper's runtime), never pinged nor retired for its age, so that the
/// renewals need nothing of the handlers' pool.
pub(crate) fn keeper_pool<DB: Database>(
    options: <DB::Connection as Connection>::Options,
    timeout: Duration,
) -> Pool<DB> {
    sqlx::pool::PoolOptions::<DB>::new()
        .max_connections(1)
        .min_connections(0)
        .acquire_timeout(timeout)
        .idle_timeout(None)
        .max_lifetime(None)
        .test_before_acquire(false)
        .connect_lazy_with(options)
}

#[cfg(all(test, any(feature = "sqlite", feature = "mysql")))]
mod tests {
    #[test]
    fn a_migration_names_the_columns_it_adds() {
        let file = "-- a comment; with ADD COLUMN nope in it\n\
                    ALTER TABLE t ADD COLUMN steps_generation BLOB;\n\
                    CREATE INDEX i ON t (x);\n\
                    ALTER TABLE t ADD COLUMN steps TEXT;\n";
        let added = super::added_columns(file);
        let columns: Vec<&str> = added.iter().map(|(c, _)| c.as_str()).collect();
        assert_eq!(columns, ["steps_generation", "steps"]);
        assert_eq!(added[1].1.trim(), "ALTER TABLE t ADD COLUMN steps TEXT");
    }
}
