//! Which errors say a kept connection (see `store/parking.rs`) was lost rather than its statement
//! refused: the statement then goes once more on a connection from the pool.

use super::errors::error_number;

/// Whether `error` says the connection itself is gone (its socket, or the server ended the session),
/// rather than anything about the statement.
pub(super) fn lost_connection(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Io(_) | sqlx::Error::Protocol(_) => true,
        // The server is shutting down (1053), the session was killed (1927), or ended for being
        // idle (4031, MySQL 8.0.24 and later).
        e => matches!(error_number(e), Some(1053 | 1927 | 4031)),
    }
}
