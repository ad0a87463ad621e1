//! Which errors say a kept connection (see `store/parking.rs`) was lost rather than its statement
//! refused: the statement then goes once more on a connection from the pool.

/// Whether `error` says the connection itself is gone (its socket, or the server ended the session),
/// rather than anything about the statement.
pub(super) fn lost_connection(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Io(_) | sqlx::Error::Protocol(_) => true,
        sqlx::Error::Database(e) => e.code().is_some_and(|code| {
            // Operator intervention (shutdown, crash, database dropped, session timeouts) and the
            // connection exception class: the server ended the session.
            code.starts_with("57P") || code.starts_with("08")
        }),
        _ => false,
    }
}
