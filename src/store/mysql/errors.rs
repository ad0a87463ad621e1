//! The server's error numbers, which the store answers by (lock waits, deadlocks, a full disk, a
//! connection the server ended).

use sqlx::MySql;
use sqlx::mysql::MySqlDatabaseError;

use crate::store::sql::Backend;

/// The server's error number, for a database error.
pub(super) fn error_number(e: &sqlx::Error) -> Option<u16> {
    e.as_database_error()
        .and_then(|d| d.try_downcast_ref::<MySqlDatabaseError>())
        .map(MySqlDatabaseError::number)
}

impl Backend for MySql {
    const NAME: &'static str = "mysql";

    /// The table or the disk full (1114, 1021); the server out of memory (1037, 1041).
    fn no_room(e: &sqlx::Error) -> bool {
        matches!(error_number(e), Some(1114 | 1021 | 1037 | 1041))
    }

    /// A lock wait timeout (1205) or a deadlock (1213). A statement cut by the server's time
    /// limit (1969 on MariaDB, 3024 on MySQL) is a retryable failure like any other.
    fn busy(e: &sqlx::Error) -> Option<&'static str> {
        matches!(error_number(e), Some(1205 | 1213)).then_some("busy, retry")
    }

    fn lost_connection(error: &sqlx::Error) -> bool {
        match error {
            sqlx::Error::Io(_) | sqlx::Error::Protocol(_) => true,
            // The server is shutting down (1053), the session was killed (1927), or ended for
            // being idle (4031, MySQL 8.0.24 and later).
            e => matches!(error_number(e), Some(1053 | 1927 | 4031)),
        }
    }
}
