//! The keeper session's presences (see `store::Presence`): named locks (`GET_LOCK`), one per
//! presence, held by a connection of the session's own.
//!
//! The server releases a named lock when the connection that holds it ends, however its process
//! ended; a table lock (`LOCK TABLES ... WRITE`, an `ALTER TABLE`) does not touch it. A retake of
//! a stale record asks `IS_FREE_LOCK` of its holder's presence in the same statement: free means no
//! live keeper holds it. Named locks are the server's, not a database's: the name carries a prefix
//! of this crate's, and presences are random, so two applications on one server stay apart.
//!
//! The connection's `wait_timeout` is the lapse the keeper gives (its TTL): the keeper sends a
//! statement every third of it, and a keeper that stops without closing its connection (its
//! machine lost power) has its session ended, and its locks let go of, within the lapse.

use std::collections::BTreeSet;
use std::time::Duration;

use sqlx::mysql::MySqlConnectOptions;
use sqlx::{Connection, MySqlConnection};

use crate::store::{Presence, StoreError};

/// The named lock of a presence, as SQL builds it from a lease token (`lease_token >> 32` is
/// unsigned in MySQL: the presence's 32 bits).
pub(super) fn lock_name_sql(lease_token: &str) -> String {
    format!("CONCAT('{PREFIX}', {lease_token} >> 32)")
}

/// The prefix of every presence's lock name, followed by the presence in decimal.
const PREFIX: &str = "axum-idempotency-presence:";

fn lock_name(presence: Presence) -> String {
    format!("{PREFIX}{}", presence.get())
}

/// The presences a keeper session shows, and the connection that holds their locks.
pub(super) struct Presences {
    options: MySqlConnectOptions,
    timeout: Duration,
    held: tokio::sync::Mutex<Option<Held>>,
}

struct Held {
    conn: MySqlConnection,
    shown: BTreeSet<Presence>,
}

impl Presences {
    pub(super) fn new(options: MySqlConnectOptions, timeout: Duration) -> Self {
        Presences {
            options,
            timeout,
            held: tokio::sync::Mutex::new(None),
        }
    }

    /// Shows exactly `live` from now on (see `IdempotencyStore::show_presences`), within the
    /// store's timeout. A connection that failed or timed out is dropped (its locks go with it on
    /// the server) and made anew at the next call.
    pub(super) async fn show(&self, live: &[Presence], lapse: Duration) -> Result<(), StoreError> {
        let want: BTreeSet<Presence> = live.iter().copied().collect();
        let mut held = self.held.lock().await;
        let current = match held.take() {
            Some(current) => current,
            None if want.is_empty() => return Ok(()),
            None => {
                let conn = self
                    .bounded(async {
                        let mut conn = MySqlConnection::connect_with(&self.options)
                            .await
                            .map_err(|e| StoreError::new("mysql presences: connect", e))?;
                        // A keeper that stops sending (its machine lost power, its network was
                        // cut) has its session ended by the server, and its locks let go of,
                        // once idle for the lapse, not after the server's default of hours.
                        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                            "SET SESSION wait_timeout = {}",
                            super::sql::wait_seconds(lapse)
                        )))
                        .execute(&mut conn)
                        .await
                        .map_err(|e| StoreError::new("mysql presences: wait_timeout", e))?;
                        Ok(conn)
                    })
                    .await?;
                Held {
                    conn,
                    shown: BTreeSet::new(),
                }
            }
        };
        let mut current = current;
        if want.is_empty() {
            // Every presence let go of at once: released by statement, so they are free when this
            // returns (a closed connection's locks go only once the server has seen it close), then
            // the connection closes. Should the release fail, the close lets them go anyway.
            let _ = self.bounded(current.update(&want)).await;
            return Ok(());
        }
        // A connection that fails here is dropped with `current`: its locks go with it, and the
        // next call shows them anew.
        let refused = self.bounded(current.update(&want)).await?;
        *held = Some(current);
        if refused > 0 {
            // Held elsewhere a moment: the keeper calls again at once.
            return Err(StoreError::msg(format!(
                "mysql presences: {refused} not shown yet (held elsewhere a moment)"
            )));
        }
        Ok(())
    }

    async fn bounded<T>(
        &self,
        step: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        match tokio::time::timeout(self.timeout, step).await {
            Ok(done) => done,
            Err(_) => Err(StoreError::msg(format!(
                "mysql presences: no answer within {:?}",
                self.timeout
            ))),
        }
    }
}

impl Held {
    /// Takes the locks of what `want` has and `shown` has not, and lets go of the others, in one
    /// statement (also when nothing changes: it proves the connection alive). A lock held by
    /// another connection a moment is tried again at the next call. Answers how many of `want`
    /// are not shown.
    async fn update(&mut self, want: &BTreeSet<Presence>) -> Result<usize, StoreError> {
        let take: Vec<Presence> = want.difference(&self.shown).copied().collect();
        let drop: Vec<Presence> = self.shown.difference(want).copied().collect();
        let mut columns = vec!["1".to_owned()];
        for presence in &take {
            columns.push(format!("GET_LOCK('{}', 0)", lock_name(*presence)));
        }
        for presence in &drop {
            columns.push(format!("RELEASE_LOCK('{}')", lock_name(*presence)));
        }
        // Names made of this crate's prefix and a number: nothing of a client's reaches the SQL.
        let sql = format!("SELECT {}", columns.join(", "));
        let row = sqlx::query(sqlx::AssertSqlSafe(sql))
            .fetch_one(&mut self.conn)
            .await
            .map_err(|e| StoreError::new("mysql presences: lock", e))?;
        for (at, presence) in take.iter().enumerate() {
            let got: Option<i64> = sqlx::Row::try_get(&row, at + 1)
                .map_err(|e| StoreError::new("mysql presences: lock", e))?;
            if got == Some(1) {
                self.shown.insert(*presence);
            } else {
                tracing::debug!("a presence's lock is held elsewhere a moment; tried next time");
            }
        }
        for presence in &drop {
            self.shown.remove(presence);
        }
        Ok(want.difference(&self.shown).count())
    }
}
