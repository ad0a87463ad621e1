//! A connection whose statement is under way. Dropped before it lands (the operation's future
//! dropped mid-statement: by a timeout outside the store, such as a heartbeat's bound on its
//! renewal or a waiting duplicate's on its look-up), it is closed at once instead of going back to
//! the pool. sqlx pings a connection on its return, with no timeout of its own, so a connection
//! dropped mid-statement would stay out of the pool, and hold a place of its size, until the server
//! finished that statement and answered the ping: for a stalled database or a connection that died
//! quietly, long enough that a few such drops empty the pool, and with it this instance's
//! renewals.

use std::ops::{Deref, DerefMut};

use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnection, Postgres};

pub(super) struct InFlight(Option<PoolConnection<Postgres>>);

impl InFlight {
    pub(super) fn new(connection: PoolConnection<Postgres>) -> Self {
        InFlight(Some(connection))
    }

    /// The statement ended (answered, failed or cut by the store's own timeout): the connection,
    /// for the caller to keep, return or close.
    pub(super) fn landed(mut self) -> PoolConnection<Postgres> {
        self.0
            .take()
            .expect("a connection in flight until it lands")
    }
}

impl Deref for InFlight {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        self.0
            .as_ref()
            .expect("a connection in flight until it lands")
    }
}

impl DerefMut for InFlight {
    fn deref_mut(&mut self) -> &mut PgConnection {
        self.0
            .as_mut()
            .expect("a connection in flight until it lands")
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
