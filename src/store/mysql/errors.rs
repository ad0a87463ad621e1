//! The server's error numbers, which the store answers by (lock waits, deadlocks, a full disk, a
//! connection the server ended).

use sqlx::mysql::MySqlDatabaseError;

/// The server's error number, for a database error.
pub(super) fn error_number(e: &sqlx::Error) -> Option<u16> {
    e.as_database_error()
        .and_then(|d| d.try_downcast_ref::<MySqlDatabaseError>())
        .map(MySqlDatabaseError::number)
}
