//! How a statement reaches the database: on a kept or pooled connection within the operation
//! timeout (`on_connection!`), the server-side lock timeout that matches it, and a database error
//! as the store answers it.

use std::sync::Arc;
use std::time::Duration;

use crate::store::StoreError;
use crate::store::sql::Backend;

/// Runs `$op` (an expression using the connection `$conn`, evaluated again if the statement goes
/// twice) on a connection kept from an earlier operation or taken from `$store`'s pool, the pool
/// wait and the statement each within the operation timeout; gives `Result<Result<T, sqlx::Error>,
/// StoreError>`, the outer error for a timeout or a failed acquire. A connection whose statement
/// succeeded is kept for the next operation; one whose statement failed goes back to the pool; a
/// kept one found dead is closed and the statement goes once more on one from the pool. A
/// connection whose statement was cut short by the timeout is closed rather than returned: sqlx
/// would keep it out of the pool until the server finished the statement, which for a connection
/// that died quietly is hours, so a few such timeouts would empty the pool.
macro_rules! on_connection {
    ($store:expr, $what:expr, $conn:ident => $op:expr) => {{
        let store = $store;
        let mut from_pool = false;
        loop {
            let (taken, kept) = match store.connection($what, from_pool).await {
                Ok(taken) => taken,
                Err(e) => break Err(e),
            };
            // Closed if this future is dropped mid-statement (see `in_flight.rs`).
            let mut $conn = $crate::store::sql::InFlight::new(taken);
            // The statement has a whole timeout of its own: one that waited long for its
            // connection must not cut a healthy statement short (and close its connection).
            let done = tokio::time::timeout(store.timeout, $op).await;
            let $conn = $conn.landed();
            match done {
                // A kept connection that died while it waited (the database restarted, or ended
                // the session): the statement goes once more, on a connection from the pool, as
                // the pool's own ping would have replaced it. Every operation is safe to repeat
                // under its lease, also when the first one committed before the connection was
                // lost: a claim or a retake by its own lease is granted again, a completion by it
                // is done already, a renewal renews again, a release answers the lease lost.
                Ok(Err(e))
                    if kept.is_some()
                        && <sqlx::Postgres as $crate::store::sql::Backend>::lost_connection(&e) =>
                {
                    drop($conn.detach());
                    from_pool = true;
                    continue;
                }
                Ok(result) => {
                    if result.is_ok() {
                        store.keep($conn, kept);
                    }
                    break Ok(result);
                }
                Err(_) => {
                    drop($conn.detach());
                    break Err(store.no_answer($what));
                }
            }
        }
    }};
}
pub(super) use on_connection;

/// The server-side lock timeout for a client timeout: four fifths of it, so the server gives up
/// (and answers) before the client does.
pub(super) fn lock_timeout_for(timeout: Duration) -> Arc<str> {
    format!("{}ms", pg_millis(timeout * 4 / 5)).into()
}

/// Milliseconds for a PostgreSQL time setting: at least 1 (0 turns the setting off), at most what
/// an `int` setting holds (about 24 days).
pub(super) fn pg_millis(d: Duration) -> u128 {
    d.as_millis().clamp(1, i32::MAX as u128)
}

/// A database error as the store answers it (see [`Backend`]).
pub(super) fn db(what: &'static str) -> impl Fn(sqlx::Error) -> StoreError {
    crate::store::sql::db::<sqlx::Postgres>(what)
}

impl Backend for sqlx::Postgres {
    const NAME: &'static str = "postgres";

    /// A full disk or exhausted memory (SQLSTATE 53000, 53100, 53200).
    fn no_room(e: &sqlx::Error) -> bool {
        e.as_database_error()
            .and_then(|d| d.code())
            .is_some_and(|code| matches!(&*code, "53000" | "53100" | "53200"))
    }

    fn lost_connection(error: &sqlx::Error) -> bool {
        match error {
            sqlx::Error::Io(_) | sqlx::Error::Protocol(_) => true,
            sqlx::Error::Database(e) => e.code().is_some_and(|code| {
                // Operator intervention (shutdown, crash, database dropped, session timeouts) and
                // the connection exception class: the server ended the session.
                code.starts_with("57P") || code.starts_with("08")
            }),
            _ => false,
        }
    }
}
