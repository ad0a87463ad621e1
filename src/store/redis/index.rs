//! Each subject's listing index: a sorted set of record digests by creation time, filed by
//! claims, read by listings, and swept now and then so that an index never listed stays bounded.

use std::sync::atomic::Ordering;
use std::time::Duration;

use super::RedisStore;
use super::codec::{millis, parse_digest};
use crate::store::{ListCursor, ListRequest, ListedRecord, RecordPage, StoreError, from_micros};

/// How many index entries one listing reads, per record asked, before it returns what it has
/// (with a cursor to continue from) when entries of records that are gone leave its page short.
const SCAN_PER_RECORD: usize = 10;

/// The span of time whose expiring answers one entry of a subject's account of bytes sums: 144
/// entries a day of retention.
pub(super) const ACCOUNT_GRANULE: Duration = Duration::from_secs(600);

/// Every this many records a store files, it sweeps the index it filed into (see [`SWEEP_SAMPLE`]).
const SWEEP_EVERY: u64 = 8;

/// How many random entries of an index one sweep checks, removing those of records that are gone.
/// Two checks per record filed: an index whose subject is never listed holds, in the long run,
/// about as many entries of records that are gone as of live ones (each filing adds an entry that
/// will die, and a sweep removes the dead ones in the proportion it finds them).
const SWEEP_SAMPLE: usize = 16;

impl RedisStore {
    /// Files the record `digest`, created at `created_ms`, in `subject`'s index, within `limit`.
    pub(super) async fn index(
        &self,
        subject: &str,
        digest: &[u8; 32],
        created_ms: i64,
        lifetime: Duration,
        limit: Duration,
    ) -> Result<(), StoreError> {
        let member = crate::util::hex::encode(digest);
        let _: i64 = self
            .eval_on(
                "index",
                &self.scripts.index,
                &self.index_key(subject),
                limit,
                |cmd| {
                    cmd.arg(created_ms).arg(&member).arg(millis(lifetime));
                },
            )
            .await?;
        Ok(())
    }

    /// Every [`SWEEP_EVERY`]th record filed: [`RedisStore::sweep`] of `subject`'s index, on a task
    /// of its own (the claim that filed does not wait for it).
    ///
    /// Listings drop the entries of records that are gone, but a subject that is never listed (the
    /// shared anonymous subject, above all) would otherwise keep one entry for every key it ever
    /// claimed, for as long as it keeps claiming.
    pub(super) fn sweep_now_and_then(&self, subject: &str) {
        if !self
            .filed
            .fetch_add(1, Ordering::Relaxed)
            .is_multiple_of(SWEEP_EVERY)
        {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (store, index) = (self.clone(), self.index_key(subject));
        runtime.spawn(async move { store.sweep(&index).await });
    }

    /// Checks [`SWEEP_SAMPLE`] random entries of the index `index` and removes those of records
    /// that are gone, released or expired, as a listing does; best effort. An entry whose key a new
    /// claim filed again meanwhile stays (the removal is conditional on the entry seen).
    async fn sweep(&self, index: &str) {
        let mut cmd = redis::cmd("ZRANDMEMBER");
        cmd.arg(index).arg(SWEEP_SAMPLE).arg("WITHSCORES");
        let mut connection = self.connection.clone();
        let sampled: Result<Vec<(String, f64)>, _> = self
            .timed("sweep", self.timeout, async move {
                cmd.query_async(&mut connection).await
            })
            .await;
        let sampled = match sampled {
            Ok(sampled) => sampled,
            Err(e) => {
                tracing::debug!(error = %e, "sampling an idempotency listing index failed");
                return;
            }
        };
        // Scores are whole milliseconds, well within an f64's exact integers.
        let entries: Vec<(String, i64)> = sampled
            .into_iter()
            .filter(|(member, _)| parse_digest(member).is_some())
            .map(|(member, score)| (member, score as i64))
            .collect();
        let live = self.live(&entries).await;
        let gone = entries
            .iter()
            .zip(live)
            .filter(|(_, live)| *live == Some(false))
            .map(|((member, created_ms), _)| self.unindex(index, member, *created_ms));
        futures_util::future::join_all(gone).await;
    }

    /// Whether the record of each index entry of `entries` is live (neither gone nor released;
    /// `None`: not read). Two fields of each record: on one server all in one round trip (a
    /// pipeline), on a cluster one read per record, on its slot's master.
    async fn live(&self, entries: &[(String, i64)]) -> Vec<Option<bool>> {
        /// A record's state and lease, `None` where it has none (a record that is gone).
        type Fields = (Option<Vec<u8>>, Option<Vec<u8>>);
        fn live((state, lease): &Fields) -> bool {
            match state {
                None => false,
                Some(state) => !(state == b"in_progress" && lease.as_deref() == Some(b"0")),
            }
        }
        let read = |member: &str| {
            let mut cmd = redis::cmd("HMGET");
            cmd.arg(format!("{}{member}", self.prefix))
                .arg("st")
                .arg("lease");
            cmd
        };
        if self.one_server() {
            let mut pipeline = redis::pipe();
            for (member, _) in entries {
                pipeline.add_command(read(member));
            }
            let mut connection = self.connection.clone();
            let read: Result<Vec<Fields>, _> = self
                .timed("sweep", self.timeout, async move {
                    pipeline.query_async(&mut connection).await
                })
                .await;
            match read {
                Ok(fields) if fields.len() == entries.len() => {
                    fields.iter().map(|fields| Some(live(fields))).collect()
                }
                _ => vec![None; entries.len()],
            }
        } else {
            let reads = entries.iter().map(|(member, _)| {
                let (cmd, mut connection) = (read(member), self.connection.clone());
                async move {
                    let fields: Result<Fields, _> = self
                        .timed("sweep", self.timeout, async move {
                            cmd.query_async(&mut connection).await
                        })
                        .await;
                    fields.ok().map(|fields| live(&fields))
                }
            });
            futures_util::future::join_all(reads).await
        }
    }

    /// Removes `member` from the index `index` if it is still filed at `created_ms`; best effort (a
    /// stale entry costs a later listing one more read).
    pub(super) async fn unindex(&self, index: &str, member: &str, created_ms: i64) {
        let removed: Result<i64, _> = self
            .eval_on(
                "unindex",
                &self.scripts.unindex,
                index,
                self.timeout,
                |cmd| {
                    cmd.arg(member).arg(created_ms);
                },
            )
            .await;
        if let Err(e) = removed {
            tracing::debug!(error = %e, "removing a stale entry of an idempotency listing index failed");
        }
    }

    /// Up to `count` entries of the index `index` from `from_ms` (inclusive; from the first when
    /// `None`), skipping the first `offset` of them: (digest hex, creation time ms), in index order.
    async fn index_entries(
        &self,
        index: &str,
        from_ms: Option<i64>,
        offset: usize,
        count: usize,
    ) -> Result<Vec<(String, i64)>, StoreError> {
        let mut cmd = redis::cmd("ZRANGE");
        cmd.arg(index);
        match from_ms {
            Some(ms) => cmd.arg(ms),
            None => cmd.arg("-inf"),
        };
        cmd.arg("+inf")
            .arg("BYSCORE")
            .arg("LIMIT")
            .arg(offset)
            .arg(count)
            .arg("WITHSCORES");
        let mut connection = self.connection.clone();
        let entries: Vec<(String, f64)> = self
            .timed("list", self.timeout, async move {
                cmd.query_async(&mut connection).await
            })
            .await?;
        // Scores are whole milliseconds, well within an f64's exact integers.
        Ok(entries
            .into_iter()
            .map(|(member, score)| (member, score as i64))
            .collect())
    }
    /// The entries of `subject`'s index, at most `up_to` (`ZCARD`: one command, whatever the
    /// size).
    pub(super) async fn count_indexed(&self, subject: &str, up_to: u64) -> Result<u64, StoreError> {
        let mut cmd = redis::cmd("ZCARD");
        cmd.arg(self.index_key(subject));
        let mut connection = self.connection.clone();
        let entries: u64 = self
            .timed("count", self.timeout, async move {
                cmd.query_async(&mut connection).await
            })
            .await?;
        Ok(entries.min(up_to))
    }

    /// Adds `bytes` of an answer recorded now, kept `retention`, to `subject`'s account: a hash
    /// of bytes by the [`ACCOUNT_GRANULE`] in which they expire, so a count drops them when their
    /// records do (at most a granule late: an estimate from above). A record deleted before its
    /// expiry stays counted until then. Best effort: a failure is logged, and the answer, already
    /// recorded, is not counted.
    pub(super) async fn account(&self, subject: &str, bytes: usize, retention: Duration) {
        let accounted: Result<i64, _> = self
            .eval_on(
                "account",
                &self.scripts.account,
                &self.account_key(subject),
                self.timeout,
                |cmd| {
                    cmd.arg(bytes)
                        .arg(millis(retention))
                        .arg(millis(ACCOUNT_GRANULE));
                },
            )
            .await;
        if let Err(e) = accounted {
            tracing::warn!(error = %e, "an idempotency answer was recorded but not counted in its subject's bytes");
        }
    }

    /// The bytes of `subject`'s recorded answers that have not expired (see
    /// [`RedisStore::account`]).
    pub(super) async fn account_usage(&self, subject: &str) -> Result<u64, StoreError> {
        let bytes: i64 = self
            .eval_on(
                "count",
                &self.scripts.usage,
                &self.account_key(subject),
                self.timeout,
                |cmd| {
                    cmd.arg(millis(ACCOUNT_GRANULE));
                },
            )
            .await?;
        Ok(u64::try_from(bytes).unwrap_or(0))
    }

    /// See [`IdempotencyStore::list`](crate::store::IdempotencyStore::list).
    pub(super) async fn list_records(
        &self,
        subject: &str,
        request: ListRequest,
    ) -> Result<RecordPage, StoreError> {
        let limit = request.bounded_limit();
        let budget = limit * SCAN_PER_RECORD;
        let index = self.index_key(subject);
        // The last entry read, as (creation ms, digest): the index's own order.
        let mut last = request
            .after
            .map(|after| (after.created_micros().div_euclid(1000), *after.scope()));
        let mut from_ms = last.map(|(ms, _)| ms);
        let mut offset = 0;
        let mut scanned = 0;
        let mut records = Vec::with_capacity(limit);
        let mut exhausted = false;
        // Entries of records that are gone, and entries behind their record's creation time: put
        // right once the page is read, best effort.
        let (mut stale, mut moved) = (Vec::new(), Vec::new());
        'scan: while records.len() < limit && scanned < budget {
            let want = limit.min(budget - scanned);
            let entries = self.index_entries(&index, from_ms, offset, want).await?;
            let fetched = entries.len();
            let entries: Vec<(String, i64, [u8; 32])> = entries
                .into_iter()
                .filter_map(|(member, ms)| {
                    let digest = parse_digest(&member)?;
                    let after_last = last.is_none_or(|l| (ms, digest) > l);
                    after_last.then_some((member, ms, digest))
                })
                .collect();
            if entries.is_empty() {
                if fetched < want {
                    exhausted = true;
                    break;
                }
                // As many entries as asked, all at or before the last one read: that many share
                // its creation time; read on past them.
                offset += fetched;
                continue;
            }
            offset = 0;
            // Read the batch's records together (on a cluster, each on its own node).
            let read = futures_util::future::join_all(entries.iter().map(|(member, _, _)| {
                let key = format!("{}{member}", self.prefix);
                async move { self.inspect(&key).await }
            }))
            .await;
            for ((member, ms, digest), record) in entries.into_iter().zip(read) {
                scanned += 1;
                last = Some((ms, digest));
                from_ms = Some(ms);
                match record? {
                    None => stale.push((member, ms)),
                    Some(record) if record.subject != subject => {}
                    Some(record) if record.created_ms > ms => {
                        // Filed before a new run of its key took the record (a released one, or
                        // gone and claimed again): its entry moves later, where it is read.
                        moved.push((digest, record.created_ms, record.ttl_ms));
                    }
                    Some(record) => {
                        // Listed at its place in the index (its creation time, unless the
                        // server's clock went back since the entry was filed).
                        let cursor = ListCursor::new(from_micros(ms.saturating_mul(1000)), digest);
                        records.push(ListedRecord {
                            key: record.key,
                            endpoint: record.endpoint,
                            info: record.info,
                            cursor,
                        });
                        if records.len() == limit {
                            break 'scan;
                        }
                    }
                }
                if scanned >= budget {
                    break 'scan;
                }
            }
            if fetched < want {
                exhausted = true;
                break;
            }
        }
        let unindexed = futures_util::future::join_all(
            stale
                .iter()
                .map(|(member, ms)| self.unindex(&index, member, *ms)),
        );
        // Each refiled with its record's remaining life, so that an index the refile makes anew
        // (it expired meanwhile) lives as long as the record, not a millisecond.
        let refiled =
            futures_util::future::join_all(moved.iter().map(|(digest, created_ms, ttl_ms)| {
                let lifetime = Duration::from_millis(u64::try_from(*ttl_ms).unwrap_or(0));
                self.index(subject, digest, *created_ms, lifetime, self.timeout)
            }));
        let (_, refiled) = tokio::join!(unindexed, refiled);
        if let Some(Err(e)) = refiled.into_iter().find(Result::is_err) {
            tracing::debug!(error = %e, "moving an idempotency listing entry failed");
        }
        if records.len() < limit && !exhausted {
            // Stopped by the scan bound: the client continues from the last entry read.
            let next = last
                .map(|(ms, digest)| ListCursor::new(from_micros(ms.saturating_mul(1000)), digest));
            return Ok(RecordPage { records, next });
        }
        Ok(RecordPage::new(records, limit))
    }
}
