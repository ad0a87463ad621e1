//! Connections kept between an SQL store's operations (Postgres, MySQL). sqlx pings a connection
//! every time it goes back to the pool (and, by default, every time it is handed out), a round trip
//! each: kept here for a moment instead, a connection goes from one operation to the next without
//! either ping, so a fresh key costs the database its statements and little else while requests
//! keep coming.
//!
//! - Only a connection whose statement succeeded is kept (one that failed or timed out goes back to
//!   the pool, or is closed, as before).
//! - A connection is kept idle for [`PARK_IDLE`] to twice that; a task that lives while any is
//!   kept gives the idle ones back, and all of them once the pool is closed, so `Pool::close`
//!   completes. A connection first taken from the pool more than [`KEEP_AT_MOST`] ago goes back
//!   after its operation, so the pool's lifetime rules and hooks still apply to it.
//! - At most `capacity` are kept by one store (and its clones): the pool's size, or half of it
//!   when handlers' transactions come from the same pool, so that they find connections.
//! - A kept connection is not pinged. One that died meanwhile (a database restart) fails its
//!   statement, which then goes once more on a connection from the pool (each backend's
//!   `lost_connection` says which errors mean that).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqlx::pool::PoolConnection;
use sqlx::{Database, Pool};
use tokio::time::Instant;

use crate::util::lock::lock;

/// How long a connection is kept without being used before it goes back to the pool (checked this
/// often, so up to twice this).
pub(crate) const PARK_IDLE: Duration = Duration::from_millis(100);

/// How long after it first came from the pool a connection may be kept.
pub(crate) const KEEP_AT_MOST: Duration = Duration::from_secs(30);

/// A kept connection: when it was last used, and when it first came from the pool.
struct Kept<DB: Database> {
    connection: PoolConnection<DB>,
    idle_since: Instant,
    since: Instant,
}

/// The connections one store (and its clones) keeps.
pub(crate) struct Parking<DB: Database> {
    kept: Mutex<Vec<Kept<DB>>>,
    /// A task gives idle connections back while any is kept.
    sweeping: AtomicBool,
}

impl<DB: Database> Default for Parking<DB> {
    fn default() -> Self {
        Parking {
            kept: Mutex::new(Vec::new()),
            sweeping: AtomicBool::new(false),
        }
    }
}

impl<DB: Database> Parking<DB> {
    /// The connection kept last, if any, with when it first came from the pool; none once the pool
    /// is closed (every kept one then goes back).
    pub(crate) fn take(&self, pool: &Pool<DB>) -> Option<(PoolConnection<DB>, Instant)> {
        let mut kept = lock(&self.kept);
        if pool.is_closed() {
            let all = std::mem::take(&mut *kept);
            drop(kept);
            drop(all);
            return None;
        }
        kept.pop().map(|k| (k.connection, k.since))
    }

    /// Keeps `connection` (first taken from the pool at `since`) for the next operation, unless
    /// `capacity` are kept, it is older than [`KEEP_AT_MOST`], or the pool is closed: it then goes
    /// back to the pool.
    pub(crate) fn keep(
        self: &Arc<Self>,
        connection: PoolConnection<DB>,
        since: Instant,
        pool: &Pool<DB>,
        capacity: usize,
    ) {
        if pool.is_closed() || since.elapsed() >= KEEP_AT_MOST {
            return;
        }
        {
            let mut kept = lock(&self.kept);
            if kept.len() >= capacity {
                drop(kept);
                drop(connection);
                return;
            }
            kept.push(Kept {
                connection,
                idle_since: Instant::now(),
                since,
            });
        }
        if !self.sweeping.swap(true, Ordering::SeqCst) {
            tokio::spawn(sweep(Sweeping(self.clone()), pool.clone()));
        }
    }
}

/// The sweeper's hold on the parking: when the task ends, also by being dropped with its runtime,
/// a connection kept after that starts a new one.
struct Sweeping<DB: Database>(Arc<Parking<DB>>);

impl<DB: Database> Drop for Sweeping<DB> {
    fn drop(&mut self) {
        self.0.sweeping.store(false, Ordering::SeqCst);
    }
}

/// Gives back, every [`PARK_IDLE`], the connections idle longer than that (all of them once the pool
/// is closed); ends when none is kept.
async fn sweep<DB: Database>(parking: Sweeping<DB>, pool: Pool<DB>) {
    loop {
        tokio::time::sleep(PARK_IDLE).await;
        let closed = pool.is_closed();
        let (stale, done) = {
            let mut kept = lock(&parking.0.kept);
            let (stale, fresh): (Vec<_>, Vec<_>) = kept
                .drain(..)
                .partition(|k| closed || k.idle_since.elapsed() >= PARK_IDLE);
            *kept = fresh;
            let done = kept.is_empty();
            if done {
                // Under the lock: a connection kept after this starts a new sweeper.
                parking.0.sweeping.store(false, Ordering::SeqCst);
            }
            (stale, done)
        };
        drop(stale);
        if done {
            // The flag is cleared already; the guard clears it again, so a second sweeper may
            // briefly run beside one started meanwhile: they share the lock, and cost a wake-up.
            return;
        }
    }
}
