//! The keeper session's presences (see `store::Presence`): advisory locks on `(NAMESPACE,
//! presence)`, held by one open transaction on a connection of the session's own.
//!
//! The server releases them when that connection ends, however the process ended; a table lock
//! (`LOCK TABLE`, `VACUUM FULL`, a migration) does not touch them. The keeper holds them *shared*,
//! so that two of its transactions can hold one together while it moves them from one to the
//! other (see below). A retake of a stale record asks for the lock of its holder's presence,
//! exclusive, in its own statement (`pg_try_advisory_xact_lock`): it gets it only when no live
//! keeper holds it; two retakers asking at once leave one of them without it, which answers
//! `409`, the safe way.
//!
//! Transaction-level locks in a transaction kept open, rather than session locks: a pooler in
//! transaction mode (PgBouncer) keeps a transaction on one server connection and ends it when the
//! client goes, where a session lock would stay on the server connection it handed to someone
//! else, and show a dead holder alive for good. The transaction writes nothing and holds no
//! snapshot between its statements (READ COMMITTED), so it holds back no vacuum; it shows as
//! `idle in transaction`, named `idempotency-keeper`, and reads at READ COMMITTED whatever the
//! database's default.
//!
//! The transaction sets its own `idle_in_transaction_session_timeout` to the lapse the keeper
//! gives (its TTL): the keeper sends a statement every third of it, and a keeper that stops (its
//! machine lost power, its network is cut, with no FIN that would end the session at once) has
//! its session ended by the server within the lapse, its presences with it, not after the hours a
//! TCP keepalive takes. Such a lock cannot be let go of alone: a
//! presence no longer needed is dropped by opening a new transaction that takes, shared too, the
//! presences still needed, then ending the old one, at most once a second: every presence still
//! needed is held by one of the two throughout. Should the new one not get them all, the old one
//! goes on and the swap is tried again at the next call.

use std::collections::BTreeSet;
use std::time::Duration;

use sqlx::postgres::PgConnectOptions;
use sqlx::{Connection, PgConnection};
use tokio::time::Instant;

use crate::store::{Presence, StoreError};

/// The first key of every presence's advisory lock, the presence being the second: "IDMP". An
/// application's own two-key advisory locks stay apart from these unless it uses this number.
pub(super) const NAMESPACE: i32 = 0x4944_4d50;

/// How long a transaction showing presences lives before one it no longer needs is dropped.
const MIN_SWAP: Duration = Duration::from_secs(1);

/// The presences a keeper session shows, and the transaction that holds them.
pub(super) struct Presences {
    options: PgConnectOptions,
    timeout: Duration,
    held: tokio::sync::Mutex<Option<Held>>,
}

/// A transaction holding presences.
struct Held {
    conn: PgConnection,
    shown: BTreeSet<Presence>,
    since: Instant,
}

impl Presences {
    pub(super) fn new(options: PgConnectOptions, timeout: Duration) -> Self {
        Presences {
            options,
            timeout,
            held: tokio::sync::Mutex::new(None),
        }
    }

    /// Shows exactly `live` from now on (see `IdempotencyStore::show_presences`), within the
    /// store's timeout for each step. A connection that failed or timed out is dropped (the server
    /// ends its transaction and its locks with it) and made anew at the next call.
    pub(super) async fn show(&self, live: &[Presence], lapse: Duration) -> Result<(), StoreError> {
        let want: BTreeSet<Presence> = live.iter().copied().collect();
        let mut held = self.held.lock().await;
        if want.is_empty() {
            // Every presence let go of at once.
            if let Some(current) = held.take() {
                self.end(current).await;
            }
            return Ok(());
        }
        match held.as_mut() {
            None => {
                // A transaction that got only some of them is kept: the next call takes the rest.
                *held = Some(self.open(&want, lapse).await?);
            }
            Some(current) => {
                // First a statement on the transaction that shows them now, every call: it keeps
                // the transaction within its lapse whatever else fails, and takes what is new. A
                // connection that fails here is dropped (its presences end with it, and the next
                // call shows them anew); one cut by a cancelled call fails the next statement.
                let missing: Vec<Presence> = want.difference(&current.shown).copied().collect();
                let taken = self
                    .bounded(take(&mut current.conn, &missing, &mut current.shown))
                    .await;
                if let Err(e) = taken {
                    *held = None;
                    return Err(e);
                }
                let extra = current.shown.difference(&want).next().is_some();
                if extra && current.since.elapsed() >= MIN_SWAP {
                    // A new transaction takes what is still needed while the old one stays in
                    // its place (a call cut meanwhile leaves it there); only once the new one has
                    // them all does the old one end. Otherwise the old one goes on showing what
                    // it shows, the retired ones too, and the move is tried at the next call.
                    match self.open(&want, lapse).await {
                        Ok(fresh) if fresh.shown == want => {
                            if let Some(old) = held.replace(fresh) {
                                self.end(old).await;
                            }
                        }
                        Ok(_) => {
                            return Err(StoreError::msg(
                                "postgres presences: the new transaction did not get every \
                                 presence; the old one goes on",
                            ));
                        }
                        Err(e) => return Err(e),
                    }
                }
            }
        }
        let refused = held
            .as_ref()
            .map_or(want.len(), |held| want.difference(&held.shown).count());
        if refused > 0 {
            // A retake held the lock a moment: the keeper calls again at its next turn.
            return Err(StoreError::msg(format!(
                "postgres presences: {refused} not shown yet (a retake held the lock a moment)"
            )));
        }
        Ok(())
    }

    /// A connection with a transaction holding what of `want` it could take.
    async fn open(&self, want: &BTreeSet<Presence>, lapse: Duration) -> Result<Held, StoreError> {
        let mut conn = self
            .bounded(async {
                PgConnection::connect_with(&self.options)
                    .await
                    .map_err(|e| StoreError::new("postgres presences: connect", e))
            })
            .await?;
        let mut shown = BTreeSet::new();
        let want: Vec<Presence> = want.iter().copied().collect();
        self.bounded(async {
            sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                "BEGIN ISOLATION LEVEL READ COMMITTED; \
                 SET LOCAL idle_in_transaction_session_timeout = '{}ms'; \
                 SET LOCAL application_name = 'idempotency-keeper'",
                super::connection::pg_millis(lapse)
            )))
            .execute(&mut conn)
            .await
            .map_err(|e| StoreError::new("postgres presences: begin", e))?;
            take(&mut conn, &want, &mut shown).await
        })
        .await?;
        Ok(Held {
            conn,
            shown,
            since: Instant::now(),
        })
    }

    /// Ends the transaction of `held` (its locks go when the server answers the rollback), then
    /// its connection; a connection that does not answer in time is dropped, and the server ends
    /// it when it notices.
    async fn end(&self, mut held: Held) {
        let ended = tokio::time::timeout(self.timeout, async {
            sqlx::raw_sql("ROLLBACK").execute(&mut held.conn).await?;
            held.conn.close().await
        })
        .await;
        if !matches!(ended, Ok(Ok(()))) {
            tracing::debug!("a presences' connection was dropped without its rollback");
        }
    }

    async fn bounded<T>(
        &self,
        step: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        match tokio::time::timeout(self.timeout, step).await {
            Ok(done) => done,
            Err(_) => Err(StoreError::msg(format!(
                "postgres presences: no answer within {:?}",
                self.timeout
            ))),
        }
    }
}

/// Takes the locks of `presences`, shared, in the open transaction of `conn` (a statement also when
/// there is none to take: it proves the connection alive), adding to `shown` those it got. One a
/// retake holds a moment is tried again at the next call.
async fn take(
    conn: &mut PgConnection,
    presences: &[Presence],
    shown: &mut BTreeSet<Presence>,
) -> Result<(), StoreError> {
    let keys: Vec<i32> = presences.iter().map(|p| p.as_i32()).collect();
    let refused: Vec<i32> = sqlx::query_scalar(
        "SELECT p FROM unnest($1::int4[]) p WHERE NOT pg_try_advisory_xact_lock_shared($2, p)",
    )
    .bind(&keys)
    .bind(NAMESPACE)
    .fetch_all(&mut *conn)
    .await
    .map_err(|e| StoreError::new("postgres presences: lock", e))?;
    for presence in presences {
        if !refused.contains(&presence.as_i32()) {
            shown.insert(*presence);
        }
    }
    if !refused.is_empty() {
        tracing::debug!(
            refused = refused.len(),
            "a presence's lock is held elsewhere a moment; tried again at the next call"
        );
    }
    Ok(())
}
