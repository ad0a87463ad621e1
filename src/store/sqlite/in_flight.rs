//! A connection whose statement is under way. Dropped before it lands (the operation's future
//! dropped mid-statement: by the store's own timeout, or by one outside the store, such as a
//! heartbeat's bound on its renewal), it is detached from the pool at once instead of going back to
//! it. sqlx would send the connection back only once its worker thread had finished the statement
//! and answered a ping: for a statement waiting on another writer's lock, up to the busy timeout,
//! while the connection holds a place in the pool. Detached, the place is free at once; the
//! statement ends on its own (SQLite gives up at the busy timeout), and the connection closes.

use std::ops::{Deref, DerefMut};

use sqlx::pool::PoolConnection;
use sqlx::sqlite::{Sqlite, SqliteConnection};

pub(super) struct InFlight(Option<PoolConnection<Sqlite>>);

impl InFlight {
    pub(super) fn new(connection: PoolConnection<Sqlite>) -> Self {
        InFlight(Some(connection))
    }

    /// The statement ended (answered, failed or cut by the store's own timeout): the connection,
    /// for the caller to return or detach.
    pub(super) fn landed(mut self) -> PoolConnection<Sqlite> {
        self.0
            .take()
            .expect("a connection in flight until it lands")
    }
}

impl Deref for InFlight {
    type Target = SqliteConnection;

    fn deref(&self) -> &SqliteConnection {
        self.0
            .as_ref()
            .expect("a connection in flight until it lands")
    }
}

impl DerefMut for InFlight {
    fn deref_mut(&mut self) -> &mut SqliteConnection {
        self.0
            .as_mut()
            .expect("a connection in flight until it lands")
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if let Some(connection) = self.0.take() {
            drop(connection.detach());
        }
    }
}
