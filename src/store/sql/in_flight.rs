//! A connection whose statement is under way. Dropped before it lands (the operation's future
//! dropped mid-statement: by a timeout outside the store, such as a heartbeat's bound on its
//! renewal or a waiting duplicate's on its look-up), it is detached from the pool and closed at
//! once instead of going back to it. sqlx would send it back only once the statement had finished
//! and a ping had answered, with no timeout of its own: for a stalled server, a connection that
//! died quietly, or an SQLite statement waiting on another writer's lock, the connection would
//! hold a place in the pool meanwhile, and a few such drops would empty the pool (and with it this
//! instance's renewals). Detached, its place is free at once; the statement ends on its own.

use std::ops::{Deref, DerefMut};

use sqlx::Database;
use sqlx::pool::PoolConnection;

/// A pooled connection whose statement is under way: closed when dropped before it [`landed`](Self::landed).
pub(crate) struct InFlight<DB: Database>(Option<PoolConnection<DB>>);

impl<DB: Database> InFlight<DB> {
    pub(crate) fn new(connection: PoolConnection<DB>) -> Self {
        InFlight(Some(connection))
    }

    /// The statement ended (answered, failed or cut by the store's own timeout): the connection,
    /// for the caller to keep, return or close.
    pub(crate) fn landed(mut self) -> PoolConnection<DB> {
        self.0
            .take()
            .expect("a connection in flight until it lands")
    }
}

impl<DB: Database> Deref for InFlight<DB> {
    type Target = DB::Connection;

    fn deref(&self) -> &DB::Connection {
        self.0
            .as_ref()
            .expect("a connection in flight until it lands")
    }
}

impl<DB: Database> DerefMut for InFlight<DB> {
    fn deref_mut(&mut self) -> &mut DB::Connection {
        self.0
            .as_mut()
            .expect("a connection in flight until it lands")
    }
}

impl<DB: Database> Drop for InFlight<DB> {
    fn drop(&mut self) {
        if let Some(connection) = self.0.take() {
            // Detached: out of the pool's count at once (the pool may open another), and closed
            // as it drops here.
            drop(connection.detach());
        }
    }
}
