//! `renew_many`: the leases the keeper finds due together, renewed in one `UPDATE` (one write
//! transaction, one flush to disk) rather than one each. SQLite has a single writer, so renewals
//! sent one by one would each wait their turn and each flush; together they cost one. The rows
//! renewed come back (`RETURNING`), so each lease gets its own answer: renewed, or no longer held.

use std::collections::HashSet;
use std::time::Duration;

use super::{SqliteStore, db, micros, on_connection};
use crate::store::{Fenced, LeaseToken, RecordKey, StoreError};

/// Leases per statement: two parameters each, well under SQLite's limit on parameters.
const PER_STATEMENT: usize = 200;

impl SqliteStore {
    /// Renews `leases` for `lifetime`, [`PER_STATEMENT`] to a statement; an error of a statement is
    /// the answer of each of its leases, and of no other.
    pub(super) async fn renew_together(
        &self,
        leases: &[(&RecordKey, LeaseToken)],
        lifetime: Duration,
    ) -> Vec<Result<Fenced, StoreError>> {
        let mut answers = Vec::with_capacity(leases.len());
        for chunk in leases.chunks(PER_STATEMENT) {
            answers.extend(self.renew_chunk(chunk, lifetime).await);
        }
        answers
    }

    async fn renew_chunk(
        &self,
        leases: &[(&RecordKey, LeaseToken)],
        lifetime: Duration,
    ) -> Vec<Result<Fenced, StoreError>> {
        let pairs: Vec<([u8; 32], i64)> = leases
            .iter()
            .map(|(key, lease)| (key.digest(), lease.0))
            .collect();
        let mut sql = String::with_capacity(self.sql.renew_many_head.len() + pairs.len() * 16 + 64);
        sql.push_str(&self.sql.renew_many_head);
        for at in 0..pairs.len() {
            if at > 0 {
                sql.push(',');
            }
            // ?1, ?2 and ?3 are the times; each pair follows.
            sql.push_str(&format!("(?{}, ?{})", 4 + 2 * at, 5 + 2 * at));
        }
        sql.push_str(") RETURNING scope, lease_token");
        let renewed = on_connection!(self, "renew", write, conn => {
            let now = self.clock.wall_us();
            let mut query = sqlx::query_as::<_, (Vec<u8>, i64)>(sqlx::AssertSqlSafe(sql.as_str()))
                .bind(now)
                .bind(now.saturating_add(micros(lifetime)))
                .bind(self.clock.boot_us());
            for (scope, lease) in &pairs {
                query = query.bind(&scope[..]).bind(*lease);
            }
            query.fetch_all(&mut *conn)
        })
        .and_then(|done| done.map_err(db("renew")));
        match renewed {
            Ok(rows) => {
                let held: HashSet<(Vec<u8>, i64)> = rows.into_iter().collect();
                pairs
                    .into_iter()
                    .map(|(scope, lease)| {
                        Ok(Fenced::from_held(held.contains(&(scope.to_vec(), lease))))
                    })
                    .collect()
            }
            Err(e) => {
                let message = e.to_string();
                pairs
                    .iter()
                    .map(|_| Err(StoreError::msg(message.clone())))
                    .collect()
            }
        }
    }
}
