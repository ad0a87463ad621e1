//! A connection whose statement is under way. Dropped before it lands (the operation's future
//! dropped mid-statement: by a timeout outside the store, such as a heartbeat's bound on its
//! renewal or a waiting duplicate's on its look-up), it is closed at once instead of going back to
//! the pool. sqlx pings a connection on its return, with no timeout of its own, so a connection
//! dropped mid-statement would stay out of the pool, and hold a place of its size, until the server
//! finished that statement and answered the ping: for a stalled database or a connection that died
//! quietly, long enough that a few such drops empty the pool, and with it this instance's
//! renewals.

use sqlx::mysql::{MySql, MySqlConnection};
use sqlx::pool::PoolConnection;

pub(super) struct InFlight(Option<PoolConnection<MySql>>);

impl InFlight {
    pub(super) fn new(connection: PoolConnection<MySql>) -> Self {
        InFlight(Some(connection))
    }

    /// The connection, for the statement.
    pub(super) fn connection(&mut self) -> Result<&mut MySqlConnection, sqlx::Error> {
        match self.0.as_mut() {
            Some(connection) => Ok(&mut **connection),
            None => Err(sqlx::Error::PoolClosed),
        }
    }

    /// The statement ended (answered, failed or cut by the store's own timeout): the connection,
    /// for the caller to keep, return or close.
    pub(super) fn landed(mut self) -> Option<PoolConnection<MySql>> {
        self.0.take()
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if let Some(connection) = self.0.take() {
            // Detached: out of the pool's count at once (the pool may open another), and its
            // socket closed as it drops here.
            drop(connection.detach());
        }
    }
}
