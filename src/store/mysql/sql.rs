//! The SQL every statement shares: the released lease, the default table, literals, quoting, and
//! the bounds each batch of statements sets on its session around itself.
//!
//! Every statement is sent as text, several in one round trip (a claim is five), with its values
//! written as literals: a prepared statement holds one statement only. Values are never text
//! from a client: bytes are written in hexadecimal (`X'00ff'`), numbers in decimal, and the only
//! quoted strings are the crate's own constants, so no value can end a literal.

use std::fmt::Write;
use std::time::Duration;

/// The lease token of a released record: no claim holds it (`LeaseToken::generate` never gives 0).
pub(super) const RELEASED: i64 = 0;

/// The table `MySqlStore::new` uses.
pub(super) const DEFAULT_TABLE: &str = "idempotency_records";

/// The time of the statement, as the columns keep it (UTC, microseconds).
pub(super) const NOW: &str = "UTC_TIMESTAMP(6)";

/// `ident` as a quoted SQL identifier (a backquote inside doubled).
pub(super) fn quote_ident(ident: &str) -> String {
    format!("`{}`", ident.replace('`', "``"))
}

/// `bytes` as a hexadecimal literal: `X'…'` (`X''` for none), whatever the session's `sql_mode`.
pub(super) fn hex(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len() * 2 + 3);
    out.push_str("X'");
    crate::util::hex::push(&mut out, bytes);
    out.push('\'');
    out
}

/// `bytes` as a binary string (`_binary X'…'`), for the rows of a derived table: MariaDB cuts a
/// plain hexadecimal literal of a `UNION`'s rows at 65,535 bytes, silently.
pub(super) fn binary(bytes: &[u8]) -> String {
    format!("_binary {}", hex(bytes))
}

/// `bytes` as a literal, or `NULL`.
pub(super) fn hex_or_null(bytes: Option<&[u8]>) -> String {
    bytes.map_or_else(|| "NULL".to_owned(), hex)
}

/// Microseconds of `d`, bounded to a century (a `DATETIME` ends in the year 9999; the layer never
/// asks for more than ten years).
pub(super) fn micros(d: Duration) -> i64 {
    const CENTURY_US: u128 = 100 * 365 * 24 * 3600 * 1_000_000;
    d.as_micros().min(CENTURY_US) as i64
}

/// A `DATETIME(6)` expression: the statement's time plus `d`.
pub(super) fn now_plus(d: Duration) -> String {
    format!("{NOW} + INTERVAL {} MICROSECOND", micros(d))
}

/// A column of `DATETIME(6)` as microseconds since the Unix epoch (the columns hold UTC).
pub(super) fn epoch_micros(column: &str) -> String {
    format!("TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', {column})")
}

/// Which server the store talks to: the two name their statement time limit differently.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Flavor {
    /// MariaDB: `max_statement_time` (seconds) bounds every statement, lock waits included.
    MariaDb,
    /// MySQL: `max_execution_time` (milliseconds) bounds reads; `innodb_lock_wait_timeout`
    /// (whole seconds) bounds the row-lock waits of writes.
    MySql,
}

impl Flavor {
    /// The flavor of a server whose `VERSION()` is `version`.
    pub(super) fn of(version: &str) -> Self {
        if version.to_ascii_lowercase().contains("mariadb") {
            Flavor::MariaDb
        } else {
            Flavor::MySql
        }
    }
}

/// The statements that open and close every batch: the first saves the session's lock wait and
/// statement time limits in user variables and sets the store's (four fifths of the operation
/// timeout, so the server gives up, and answers, before the client does); the last puts them
/// back. Both are one round trip with the batch. A batch that fails part way leaves the store's
/// values on the session: they are put back (else its connection is closed) before the connection
/// goes back to the pool. The last
/// statement changes nothing when the first did not run (its variables are then `NULL`), so it may
/// end any batch of a transaction.
///
/// The store's own batches (not those of a handler's transaction) also turn autocommit on for
/// themselves (`open_own`, `close_own`), and back to the session's value after: every statement of
/// the store must commit on its own, or a claim would be seen by no other connection (and hold
/// its row's lock) on a pool whose connections start with `autocommit = 0`.
#[derive(Debug)]
pub(super) struct Bounds {
    pub(super) open: String,
    pub(super) close: String,
    pub(super) open_own: String,
    pub(super) close_own: String,
}

impl Bounds {
    pub(super) fn new(flavor: Flavor, timeout: Duration) -> Self {
        let bound = timeout * 4 / 5;
        // Whole seconds, at least one: InnoDB's unit (0 would mean "do not wait" on MariaDB).
        let lock_wait = bound.as_secs().max(1);
        let (variable, value) = match flavor {
            Flavor::MariaDb => (
                "max_statement_time",
                format!("{:.6}", bound.as_secs_f64().max(0.001)),
            ),
            Flavor::MySql => ("max_execution_time", bound.as_millis().max(1).to_string()),
        };
        let mut open = String::new();
        let mut close = String::new();
        // `lock_wait_timeout` bounds the wait on a table's metadata lock (`LOCK TABLES`, DDL),
        // which MySQL's `max_execution_time` does not bound for writes.
        let _ = write!(
            open,
            "SET @axum_idempotency_lock_wait = @@session.innodb_lock_wait_timeout, \
                 @axum_idempotency_table_wait = @@session.lock_wait_timeout, \
                 @axum_idempotency_time_limit = @@session.{variable}, \
                 @@session.innodb_lock_wait_timeout = {lock_wait}, \
                 @@session.lock_wait_timeout = {lock_wait}, \
                 @@session.{variable} = {value}"
        );
        let _ = write!(
            close,
            "SET @@session.innodb_lock_wait_timeout = \
                   COALESCE(@axum_idempotency_lock_wait, @@session.innodb_lock_wait_timeout), \
                 @@session.lock_wait_timeout = \
                   COALESCE(@axum_idempotency_table_wait, @@session.lock_wait_timeout), \
                 @@session.{variable} = \
                   COALESCE(@axum_idempotency_time_limit, @@session.{variable}), \
                 @axum_idempotency_lock_wait = NULL, @axum_idempotency_table_wait = NULL, \
                 @axum_idempotency_time_limit = NULL"
        );
        let open_own = format!(
            "{open}, @axum_idempotency_autocommit = @@session.autocommit, \
             @@session.autocommit = 1"
        );
        let close_own = format!(
            "{close}, @@session.autocommit = \
               COALESCE(@axum_idempotency_autocommit, @@session.autocommit), \
             @axum_idempotency_autocommit = NULL"
        );
        Bounds {
            open,
            close,
            open_own,
            close_own,
        }
    }
}

/// Whole seconds for a session's `wait_timeout`: at least 1, at most a year (the servers' bound).
pub(super) fn wait_seconds(d: Duration) -> u64 {
    let secs = d.as_secs() + u64::from(d.subsec_nanos() > 0);
    secs.clamp(1, 365 * 24 * 3600)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn literals_hold_any_bytes_and_nothing_else() {
        assert_eq!(hex(b""), "X''");
        assert_eq!(hex(b"'\\\0\xff"), "X'275c00ff'");
        assert_eq!(hex_or_null(None), "NULL");
        assert_eq!(quote_ident("a`b"), "`a``b`");
        assert_eq!(micros(Duration::from_millis(1500)), 1_500_000);
        assert_eq!(
            micros(Duration::MAX),
            100 * 365 * 24 * 3600 * 1_000_000_i64,
            "bounded"
        );
    }

    #[test]
    fn bounds_are_under_the_timeout() {
        let mariadb = Bounds::new(Flavor::MariaDb, Duration::from_millis(500));
        assert!(
            mariadb
                .open
                .contains("@@session.max_statement_time = 0.400000")
        );
        assert!(mariadb.open.contains("innodb_lock_wait_timeout = 1"));
        assert!(mariadb.open.contains("@@session.lock_wait_timeout = 1"));
        let mysql = Bounds::new(Flavor::MySql, Duration::from_secs(5));
        assert!(mysql.open.contains("@@session.max_execution_time = 4000"));
        assert!(mysql.open.contains("innodb_lock_wait_timeout = 4"));
        assert!(mysql.open.contains("@@session.lock_wait_timeout = 4"));
        assert_eq!(Flavor::of("10.11.19-MariaDB-0+deb12u1"), Flavor::MariaDb);
        assert_eq!(Flavor::of("8.0.36"), Flavor::MySql);
        assert_eq!(wait_seconds(Duration::from_millis(1)), 1);
        assert_eq!(wait_seconds(Duration::from_millis(2500)), 3);
    }
}
