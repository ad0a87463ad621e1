//! The Redis store: records as Redis hashes, changed only by Lua scripts, expired by Redis itself;
//! on one server or on a Redis Cluster.

use crate::store::Fenced;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::{ClusterClient, ClusterConfig};
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, ErrorKind, FromRedisValue, RedisFuture, Script, ServerErrorKind, Value};

use sha2::{Digest, Sha256};

use super::{
    Deleted, IdempotencyStore, ListCursor, ListRequest, ListedRecord, RecordInfo, RecordPage,
    RecordState, StoreError, from_micros, header_list,
};
use crate::store::Fingerprint;
use crate::store::{
    ClaimOutcome, ClaimRequest, Finished, Generation, LeaseToken, RecordKey, StoredResponse,
};

/// How long one store operation may take before it counts as failed (`503`), by default.
pub(crate) const DEFAULT_REDIS_TIMEOUT: Duration = Duration::from_secs(2);

/// Claim, atomically: insert; or answer mismatch, finished (with the response), in progress; or
/// retake a record whose claim (or last renewal) is older than the in-progress TTL. A record in
/// progress under this very lease is this claim's own, sent twice (a resend after a lost reply):
/// claimed again, or retaken again if the first one retook it (the field `rt` says so). A released
/// record (lease `0`) is claimed at once: by the same request with its generation, by another with
/// the new one. Times are the server's `TIME`. A claimed or retaken
/// answer carries the record's generation (a retake keeps it; a record written before generations
/// has none).
/// A record made by the claim (new, or a released one taken as a new run) gets its creation time
/// (`ct`, kept by retakes) and its scope in clear (`k`, `sub`, `ep`), for inspection. A claimed or
/// retaken answer carries, third, the record's creation time, which the caller files in the
/// subject's index (see [`RedisStore`]).
/// KEYS[1] record; ARGV fingerprint, new lease, in-progress TTL (ms), TTL + retention (ms),
/// generation of a new record, key, subject, endpoint.
const CLAIM: &str = include_str!("claim.lua");

/// Complete, if the lease still holds an in-progress record; a record this lease already finished
/// counts as done. KEYS[1]; ARGV lease, status, response, retention (ms).
const COMPLETE: &str = include_str!("complete.lua");

/// Renew (the heartbeat), if the lease still holds an in-progress record. KEYS[1]; ARGV lease,
/// lifetime (ms).
const RENEW: &str = include_str!("renew.lua");

/// Release, if the lease still holds an in-progress record: not deleted but left under lease `0`
/// (no claim's token), which the next claim takes at once, keeping the record's generation for the
/// same request (the retry of a released run is the same operation to a provider). KEYS[1]; ARGV
/// lease.
const RELEASE: &str = include_str!("release.lua");

/// A live record as inspection shows it, or nil (absent, expired or released): state, creation
/// time (ms, `0` for a record written before creation times were kept), time to live (ms), the
/// server's time (ms), the stored status (`-1` while in progress), key, subject and endpoint.
/// KEYS[1] record.
const INSPECT: &str = include_str!("inspect.lua");

/// Delete a finished record: `{2, creation time}`; a live record in progress is left alone, `{1}`;
/// absent or released, `{0}`. KEYS[1] record.
const DELETE: &str = include_str!("delete.lua");

/// File a record in its subject's index at its creation time (an entry only ever moves later), and
/// keep the index at least as long as the record's lifetime. KEYS[1] the subject's index; ARGV
/// creation time (ms), record digest (hex), lifetime (ms).
const INDEX: &str = include_str!("index.lua");

/// Whether a record is live (neither gone nor released), as a sweep of its index asks: 1 or 0.
/// KEYS[1] the record. Reads two fields, not the stored answer.
const LIVE: &str = include_str!("live.lua");

/// Remove a record from its subject's index if its entry is still the one seen (same creation
/// time): an entry a new claim of the key just re-filed stays. KEYS[1] the subject's index; ARGV
/// record digest (hex), creation time (ms) as seen.
const UNINDEX: &str = include_str!("unindex.lua");

/// How many index entries one listing reads, per record asked, before it returns what it has
/// (with a cursor to continue from) when entries of records that are gone leave its page short.
const SCAN_PER_RECORD: usize = 10;

/// Every this many records a store files, it sweeps the index it filed into (see [`SWEEP_SAMPLE`]).
const SWEEP_EVERY: u64 = 8;

/// How many random entries of an index one sweep checks, removing those of records that are gone.
/// Two checks per record filed: an index whose subject is never listed holds, in the long run,
/// about as many entries of records that are gone as of live ones (each filing adds an entry that
/// will die, and a sweep removes the dead ones in the proportion it finds them).
const SWEEP_SAMPLE: usize = 16;

/// Records in Redis, shared by every instance connected to the same server or cluster.
///
/// Each record is one hash under `<prefix><sha256 of key, subject and endpoint>`, so client input
/// never shapes Redis key names and every key is 64 hex characters long. Claim, complete, renew,
/// release, lookup and delete are Lua scripts, atomic on the server; retention is the key's expiry,
/// so Redis removes expired records itself and [`IdempotencyStore::purge_expired`] has nothing to
/// do. A record also keeps, for inspection, when it was created and its key, subject and endpoint
/// in clear (records written by earlier versions have none: they show as created at the epoch,
/// with an empty key and endpoint, and are never listed).
///
/// # Listing
///
/// Records are spread by their digest, so [`IdempotencyStore::list`] reads a per-subject index: a
/// sorted set under `<prefix>subject:<sha256 of the subject>` (a digest too: client input never
/// shapes key names), of record digests scored by creation time, which lives as long as the longest
/// lifetime (in-progress TTL and retention) of the claims that filed into it. It lives in another
/// slot than the records, so a claim that creates a record files it with a second command, awaited
/// (one more round trip, on fresh keys only), within a quarter of the operation timeout. The index serves
/// listings only: when that command fails or times out the claim still stands and the record is
/// merely missing from listings; a record kept longer than its claim's lifetime (a handler renewing
/// its lease past the in-progress TTL) may likewise drop out of listings when the index expires
/// before it. Lookups and deletes never read the index. A listing reads the records its index
/// names (each on its own node, on a cluster), skips (and removes from the index) those that are
/// gone, released or expired, and reads at most ten index entries per record asked: a page left
/// short by that bound still carries a cursor to continue from. Listings are not the only clean-up:
/// every eighth record a store files, it checks 16 random entries of that index on a task of its
/// own and drops those of records that are gone, so an index whose subject is never listed holds
/// about as many dead entries as live ones. Listing needs Redis 6.2 or later (`ZRANGE ...
/// BYSCORE`, `ZADD GT`); on an older server claims still work, unfiled. The connection
/// is made lazily and re-made after failures; while Redis is unreachable every operation fails (and
/// the layer answers `503`).
///
/// # One server or a cluster
///
/// [`RedisStore::new`] talks to one server (or whatever a [`redis::Client`] reaches: a primary
/// behind a proxy, say); [`RedisStore::cluster`] talks to a Redis Cluster. Every script reads and
/// writes exactly one key, its `KEYS[1]` (the record's hash, or for the index's scripts a subject's
/// index), and nothing else, so on a cluster each script runs whole on the master that owns that
/// key's slot: no cross-slot access, no hash tags needed, and records spread over the masters by
/// their digest. A prefix given to
/// [`RedisStore::with_prefix`] should not contain a hash tag (`{...}`): it would put every record
/// in one slot, on one master.
///
/// Scripts are called by their SHA1 (`EVALSHA`). A server that does not have a script (`NOSCRIPT`:
/// restarted, failed over to a replica, `SCRIPT FLUSH`) gets it whole with `EVAL`, sent like
/// `EVALSHA` to the node owning `KEYS[1]`, which runs it and caches it for the next call. That needs
/// only the node that owns the record (not a `SCRIPT LOAD` to every node of the cluster, which fails
/// while any one of them is unreachable), and leaves no window between loading and running.
///
/// Every operation, with the cluster's redirects and retries and that fallback, is bounded by
/// [`RedisStore::with_timeout`] on both kinds of connection.
///
/// Without persistence (no AOF or RDB), a Redis restart forgets every record: a retry after the
/// restart runs the handler again. So does an eviction: run Redis with `maxmemory-policy
/// noeviction` (every record has an expiry, so any `volatile-*` or `allkeys-*` policy may evict
/// one). Replication is asynchronous: a claim acknowledged by a primary that fails over before a
/// replica has it is lost, and a retry claims again. Use the Postgres store where that is not
/// acceptable. Claims need Redis 5 or later.
#[derive(Clone)]
pub struct RedisStore {
    connection: Connection,
    prefix: Arc<str>,
    timeout: Duration,
    scripts: Arc<Scripts>,
    /// Whether records keep their key, subject and endpoint in clear, and are filed for listing.
    scope_fields: bool,
    /// Records filed for listing by this store and its clones: every [`SWEEP_EVERY`]th sweeps.
    filed: Arc<AtomicU64>,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

/// The connection the scripts run on: one server through a connection manager (re-connects after
/// failures), or a cluster connection (routes each command by its key, follows `MOVED`/`ASK`,
/// refreshes the slot map and re-connects nodes). Both are cheap handles to shared connections.
#[derive(Clone)]
enum Connection {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl redis::aio::ConnectionLike for Connection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Connection::Single(c) => c.req_packed_command(cmd),
            Connection::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Connection::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Connection::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Connection::Single(c) => c.get_db(),
            Connection::Cluster(c) => c.get_db(),
        }
    }
}

/// A Lua script: its source, for `EVAL`, and its SHA1, for `EVALSHA`.
struct Lua {
    code: &'static str,
    sha1: String,
}

impl Lua {
    fn new(code: &'static str) -> Self {
        Lua {
            code,
            sha1: Script::new(code).get_hash().to_owned(),
        }
    }
}

struct Scripts {
    claim: Lua,
    complete: Lua,
    renew: Lua,
    release: Lua,
    inspect: Lua,
    delete: Lua,
    index: Lua,
    unindex: Lua,
    live: Lua,
}

impl RedisStore {
    /// A store on one Redis server, `client`, with keys under `idempotency:`; connects on first use.
    pub fn new(client: redis::Client) -> Result<Self, StoreError> {
        // Responses are bounded by `timeout` around each operation (see `with_timeout`), so the
        // manager sets no response timeout of its own that would cut a longer one short.
        let config = ConnectionManagerConfig::new()
            .set_number_of_retries(1)
            .set_connection_timeout(Some(DEFAULT_REDIS_TIMEOUT))
            .set_response_timeout(None);
        let connection = ConnectionManager::new_lazy_with_config(client, config)
            .map_err(|e| StoreError::new("redis: connection manager", e))?;
        Ok(Self::on(Connection::Single(connection)))
    }

    /// A store on the Redis Cluster that `client` reaches, with keys under `idempotency:`.
    ///
    /// Lazy, like [`RedisStore::new`]: this returns at once, without contacting the cluster; the
    /// connection to the initial nodes, the slot map and the connections to every master are made
    /// in the background, and re-made as the cluster changes (failover, resharding) or after
    /// failures. While the cluster cannot be reached, operations fail (`503` from the layer) and
    /// the next ones try again. To fail at start-up instead, send a request of your own (`PING`)
    /// through a connection of `client` first.
    ///
    /// Each record is one key and every script touches only that key, so each operation runs on
    /// the master owning the record's slot (see [`RedisStore`]). The connection settings of
    /// `client` (connection timeout, retries, TLS, credentials) are kept, except its per-request
    /// response timeout: as on one server, each operation is bounded by
    /// [`RedisStore::with_timeout`] instead, including the cluster's redirects and retries.
    ///
    /// The cluster client resends a command whose connection dropped before its answer came.
    /// Complete, renew and release may run twice harmlessly (a completion the same lease already
    /// made counts as done). A claim resent that way finds its own claim (the same lease token)
    /// and is granted again: the request runs its handler once, under the claim it already made
    /// (told a retake if that claim retook the record).
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// use axum_idempotency::IdempotencyLayer;
    /// use axum_idempotency::store::RedisStore;
    ///
    /// let client = redis::cluster::ClusterClient::new(vec![
    ///     "redis://127.0.0.1:7000",
    ///     "redis://127.0.0.1:7001",
    ///     "redis://127.0.0.1:7002",
    /// ])?;
    /// let store = RedisStore::cluster(client)?.with_prefix("shop:idem:");
    /// let layer = IdempotencyLayer::new(store).expect("valid settings");
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// When called outside a Tokio runtime: the cluster connection is driven by a task spawned
    /// here.
    pub fn cluster(client: ClusterClient) -> Result<Self, StoreError> {
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(StoreError::msg(
                "redis cluster: RedisStore::cluster must be called within a Tokio runtime",
            ));
        }
        // The cluster keeps the client's connection timeout; the response timeout is cleared, and
        // `timed` bounds each whole operation instead.
        let connection = client.get_pending_async_connection_with_config(ClusterConfig::new());
        Ok(Self::on(Connection::Cluster(connection)))
    }

    fn on(connection: Connection) -> Self {
        RedisStore {
            connection,
            prefix: Arc::from("idempotency:"),
            timeout: DEFAULT_REDIS_TIMEOUT,
            scope_fields: true,
            filed: Arc::new(AtomicU64::new(0)),
            scripts: Arc::new(Scripts {
                claim: Lua::new(CLAIM),
                complete: Lua::new(COMPLETE),
                renew: Lua::new(RENEW),
                release: Lua::new(RELEASE),
                inspect: Lua::new(INSPECT),
                delete: Lua::new(DELETE),
                index: Lua::new(INDEX),
                unindex: Lua::new(UNINDEX),
                live: Lua::new(LIVE),
            }),
        }
    }

    /// Puts this store's keys under another prefix (to share one Redis between applications). On a
    /// cluster, keep hash tags (`{...}`) out of it, or every record lands in one slot.
    pub fn with_prefix(mut self, prefix: &str) -> Self {
        self.prefix = Arc::from(prefix);
        self
    }

    /// Keeps nothing of a record's key, subject or endpoint in clear (only the digest that names
    /// it), as `PostgresStore::without_scope_columns` does: a Redis whose keys leak reveals no
    /// idempotency key, user id or path. Records are then not filed for listing, so
    /// [`IdempotencyStore::list`] finds none; [`lookup`](IdempotencyStore::lookup) and
    /// [`delete`](IdempotencyStore::delete) work as before (they show an empty key). It also saves
    /// the second round trip of a fresh claim.
    pub fn without_scope_fields(mut self) -> Self {
        self.scope_fields = false;
        self
    }

    /// How long one operation may take before it fails. Default: 2 s.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        // No server answers in less; a shorter timeout would fail every operation.
        self.timeout = timeout.max(Duration::from_millis(10));
        self
    }

    fn redis_key(&self, key: &RecordKey) -> String {
        let digest = key.digest();
        let mut name = String::with_capacity(self.prefix.len() + 64);
        name.push_str(&self.prefix);
        crate::util::hex::push(&mut name, &digest);
        name
    }

    /// The key of `subject`'s index: `<prefix>subject:<sha256 of the subject>`.
    fn index_key(&self, subject: &str) -> String {
        let digest: [u8; 32] = Sha256::digest(subject.as_bytes()).into();
        let mut name = String::with_capacity(self.prefix.len() + 8 + 64);
        name.push_str(&self.prefix);
        name.push_str("subject:");
        crate::util::hex::push(&mut name, &digest);
        name
    }

    /// Runs `script` on the record `key` (its only key, `KEYS[1]`) with the arguments `args` adds,
    /// within the timeout: by SHA1, and whole when the server does not have it (see [`RedisStore`]).
    async fn eval<T: FromRedisValue>(
        &self,
        what: &'static str,
        script: &Lua,
        key: &RecordKey,
        args: impl Fn(&mut Cmd),
    ) -> Result<T, StoreError> {
        self.eval_on(what, script, &self.redis_key(key), self.timeout, args)
            .await
    }

    /// Runs `script` on `key` (a record's or an index's Redis key, its only key), within `limit`.
    async fn eval_on<T: FromRedisValue>(
        &self,
        what: &'static str,
        script: &Lua,
        key: &str,
        limit: Duration,
        args: impl Fn(&mut Cmd),
    ) -> Result<T, StoreError> {
        let command = |name: &str, script: &str| {
            let mut cmd = redis::cmd(name);
            cmd.arg(script).arg(1).arg(key);
            args(&mut cmd);
            cmd
        };
        let mut connection = self.connection.clone();
        let run = async move {
            match command("EVALSHA", &script.sha1)
                .query_async(&mut connection)
                .await
            {
                Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                    command("EVAL", script.code)
                        .query_async(&mut connection)
                        .await
                }
                answer => answer,
            }
        };
        self.timed(what, limit, run).await
    }

    /// Files the record `digest`, created at `created_ms`, in `subject`'s index, within `limit`.
    async fn index(
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
    fn sweep_now_and_then(&self, subject: &str) {
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
        let checks = sampled.into_iter().filter_map(|(member, score)| {
            parse_digest(&member)?;
            Some(async move {
                let key = format!("{}{member}", self.prefix);
                let live: Result<i64, _> = self
                    .eval_on("sweep", &self.scripts.live, &key, self.timeout, |_| {})
                    .await;
                // Scores are whole milliseconds, well within an f64's exact integers.
                if let Ok(0) = live {
                    self.unindex(index, &member, score as i64).await;
                }
            })
        });
        futures_util::future::join_all(checks).await;
    }

    /// Removes `member` from the index `index` if it is still filed at `created_ms`; best effort (a
    /// stale entry costs a later listing one more read).
    async fn unindex(&self, index: &str, member: &str, created_ms: i64) {
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

    /// The record under the Redis key `key` as inspection shows it, with its creation time (ms),
    /// key, subject and endpoint; `None` when it is absent, expired or released.
    async fn inspect(&self, key: &str) -> Result<Option<Inspected>, StoreError> {
        let reply: Option<Vec<Value>> = self
            .eval_on("inspect", &self.scripts.inspect, key, self.timeout, |_| {})
            .await?;
        let Some(reply) = reply else {
            return Ok(None);
        };
        let bad = || StoreError::msg("redis inspect: unexpected reply");
        let text = |i: usize| -> Result<String, StoreError> {
            match reply.get(i) {
                Some(Value::BulkString(bytes)) => Ok(String::from_utf8_lossy(bytes).into_owned()),
                Some(Value::SimpleString(s)) => Ok(s.clone()),
                Some(Value::Int(n)) => Ok(n.to_string()),
                _ => Err(bad()),
            }
        };
        let int = |i: usize| -> Result<i64, StoreError> {
            match reply.get(i) {
                Some(Value::Int(n)) => Ok(*n),
                _ => text(i)?.parse().map_err(|_| bad()),
            }
        };
        let state = match text(0)?.as_str() {
            "in_progress" => RecordState::InProgress,
            "completed" => RecordState::Completed,
            "failed" => RecordState::Failed,
            _ => return Err(bad()),
        };
        let (created_ms, ttl_ms, now_ms, status) = (int(1)?, int(2)?, int(3)?, int(4)?);
        let expires_at = if ttl_ms >= 0 {
            from_micros(now_ms.saturating_add(ttl_ms).saturating_mul(1000))
        } else {
            // No expiry (a record always has one): it never expires.
            from_micros(i64::MAX)
        };
        let info = RecordInfo::new(
            state,
            u16::try_from(status).ok().filter(|_| state.is_finished()),
            from_micros(created_ms.saturating_mul(1000)),
            expires_at,
        );
        Ok(Some(Inspected {
            info,
            created_ms,
            ttl_ms,
            key: text(5)?,
            subject: text(6)?,
            endpoint: text(7)?,
        }))
    }

    async fn timed<T>(
        &self,
        what: &'static str,
        limit: Duration,
        operation: impl Future<Output = redis::RedisResult<T>>,
    ) -> Result<T, StoreError> {
        match tokio::time::timeout(limit, operation).await {
            Ok(result) => result.map_err(|e| StoreError::new(format!("redis {what}"), e)),
            Err(_) => Err(StoreError::msg(format!(
                "redis {what}: no answer within {limit:?}"
            ))),
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
}

/// A record as inspection reads it.
struct Inspected {
    info: RecordInfo,
    created_ms: i64,
    /// What the record has left to live (`PTTL`, ms).
    ttl_ms: i64,
    key: String,
    subject: String,
    endpoint: String,
}

/// A script's integer, as an integer reply or as text (a hash field).
fn integer(value: &Value) -> Option<i64> {
    match value {
        Value::Int(n) => Some(*n),
        Value::BulkString(bytes) => std::str::from_utf8(bytes).ok()?.parse().ok(),
        Value::SimpleString(s) => s.parse().ok(),
        _ => None,
    }
}

/// The digest an index entry names (64 lower-case hex digits); `None` for anything else.
fn parse_digest(hex: &str) -> Option<[u8; 32]> {
    let hex = hex.as_bytes();
    if hex.len() != 64 {
        return None;
    }
    let nibble = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    };
    let mut digest = [0u8; 32];
    for (i, byte) in digest.iter_mut().enumerate() {
        *byte = nibble(hex[2 * i])? << 4 | nibble(hex[2 * i + 1])?;
    }
    Some(digest)
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

impl IdempotencyStore for RedisStore {
    async fn claim(&self, request: &ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        let started = tokio::time::Instant::now();
        let lease = request.lease;
        let lifetime = request.in_progress_ttl + request.retention;
        let reply: Vec<Value> = self
            .eval("claim", &self.scripts.claim, &request.key, |cmd| {
                cmd.arg(&request.fingerprint.as_bytes()[..])
                    .arg(lease.0)
                    .arg(millis(request.in_progress_ttl))
                    .arg(millis(lifetime))
                    .arg(&request.generation.0[..]);
                if self.scope_fields {
                    cmd.arg(&request.key.key)
                        .arg(&request.key.subject)
                        .arg(&request.key.endpoint);
                } else {
                    cmd.arg("").arg("").arg("");
                }
            })
            .await?;
        let generation = match reply.get(1) {
            Some(Value::BulkString(bytes)) => Generation::from_slice(bytes),
            _ => None,
        };
        let tag = match reply.first() {
            Some(Value::BulkString(tag)) => tag.as_slice(),
            Some(Value::SimpleString(tag)) => tag.as_bytes(),
            _ => return Err(StoreError::msg("redis claim: unexpected reply")),
        };
        if self.scope_fields
            && matches!(tag, b"claimed" | b"retaken")
            && let Some(created_ms) = reply.get(2).and_then(integer)
        {
            // The record is claimed whatever becomes of its index entry, which only listings
            // read: a failure here is logged, not answered. The claim's operation timeout bounds
            // both commands together.
            // At most a quarter of the timeout: a slow index node must not slow every fresh claim
            // by a whole timeout.
            let left = self
                .timeout
                .saturating_sub(started.elapsed())
                .min(self.timeout / 4);
            let digest = request.key.digest();
            let filed = self
                .index(&request.key.subject, &digest, created_ms, lifetime, left)
                .await;
            match filed {
                Ok(()) => self.sweep_now_and_then(&request.key.subject),
                Err(e) => tracing::warn!(
                    error = %e,
                    "an idempotency record was claimed but not filed for listing"
                ),
            }
        }
        Ok(match tag {
            b"claimed" => ClaimOutcome::Claimed {
                lease,
                retaken: false,
                generation,
            },
            b"retaken" => ClaimOutcome::Claimed {
                lease,
                retaken: true,
                generation,
            },
            b"mismatch" => ClaimOutcome::KeyReuse,
            b"in_progress" => ClaimOutcome::InProgress,
            b"finished" => match reply.get(1) {
                Some(Value::BulkString(blob)) => {
                    let mut stored = decode(blob).ok_or_else(|| {
                        // A finished record, unreadable: never a reason to run it again.
                        StoreError::unreadable_record("redis claim: corrupt response")
                    })?;
                    // The key's remaining time to live (negative: none, which a record never lacks).
                    stored.expires_in = match reply.get(2) {
                        Some(Value::Int(ms)) if *ms > 0 => Some(Duration::from_millis(*ms as u64)),
                        _ => None,
                    };
                    ClaimOutcome::Finished(Arc::new(stored))
                }
                _ => {
                    return Err(StoreError::unreadable_record(
                        "redis claim: finished without a response",
                    ));
                }
            },
            _ => return Err(StoreError::msg("redis claim: unknown reply")),
        })
    }

    async fn complete(
        &self,
        key: &RecordKey,
        lease: LeaseToken,
        _fingerprint: &Fingerprint,
        response: Arc<StoredResponse>,
        retention: Duration,
    ) -> Result<Fenced, StoreError> {
        let blob = encode(&response)
            .ok_or_else(|| StoreError::msg("redis complete: the response is too large to store"))?;
        let done: i64 = self
            .eval("complete", &self.scripts.complete, key, |cmd| {
                cmd.arg(lease.0)
                    .arg(response.outcome.as_str())
                    .arg(&blob[..])
                    .arg(millis(retention));
            })
            .await?;
        Ok(Fenced::from_held(done == 1))
    }

    async fn renew(
        &self,
        key: &RecordKey,
        lease: LeaseToken,
        lifetime: Duration,
    ) -> Result<Fenced, StoreError> {
        let done: i64 = self
            .eval("renew", &self.scripts.renew, key, |cmd| {
                cmd.arg(lease.0).arg(millis(lifetime));
            })
            .await?;
        Ok(Fenced::from_held(done == 1))
    }

    async fn release(&self, key: &RecordKey, lease: LeaseToken) -> Result<Fenced, StoreError> {
        let done: i64 = self
            .eval("release", &self.scripts.release, key, |cmd| {
                cmd.arg(lease.0);
            })
            .await?;
        Ok(Fenced::from_held(done == 1))
    }

    /// Redis expires records itself; there is nothing to purge.
    async fn purge_expired(&self) -> Result<u64, StoreError> {
        Ok(0)
    }

    async fn lookup(&self, key: &RecordKey) -> Result<Option<RecordInfo>, StoreError> {
        Ok(self
            .inspect(&self.redis_key(key))
            .await?
            .map(|record| record.info))
    }

    async fn delete(&self, key: &RecordKey) -> Result<Deleted, StoreError> {
        let reply: Vec<Value> = self
            .eval("delete", &self.scripts.delete, key, |_| {})
            .await?;
        match reply.first() {
            Some(Value::Int(2)) => {
                // The record is gone; its index entry too, unless a new claim filed it again.
                if let Some(created_ms) = reply.get(1).and_then(integer) {
                    let member = crate::util::hex::encode(&key.digest());
                    self.unindex(&self.index_key(&key.subject), &member, created_ms)
                        .await;
                }
                Ok(Deleted::Deleted)
            }
            Some(Value::Int(1)) => Ok(Deleted::InProgress),
            Some(Value::Int(0)) => Ok(Deleted::NotFound),
            _ => Err(StoreError::msg("redis delete: unexpected reply")),
        }
    }

    async fn list(&self, subject: &str, request: ListRequest) -> Result<RecordPage, StoreError> {
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

    fn operation_timeout(&self) -> Option<Duration> {
        Some(self.timeout)
    }
}

/// The stored response as bytes: outcome, status, headers (length-prefixed), body. The outcome is
/// `c` or `f`, upper case when the body was omitted.
fn encode(response: &StoredResponse) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(response.body.len() + 64);
    out.push(match (response.outcome, response.body_omitted) {
        (Finished::Completed, false) => b'c',
        (Finished::Failed, false) => b'f',
        (Finished::Completed, true) => b'C',
        (Finished::Failed, true) => b'F',
    });
    out.extend_from_slice(&response.status.to_be_bytes());
    header_list::write(&response.headers, &mut out)?;
    out.extend_from_slice(&response.body);
    Some(out)
}

/// The inverse of [`encode`]; `None` for bytes it did not write. Headers that are not valid HTTP
/// are dropped (the layer's header policy applies on replay).
fn decode(blob: &[u8]) -> Option<StoredResponse> {
    let mut rest = blob;
    let mut take = |n: usize| -> Option<&[u8]> {
        let (head, tail) = rest.split_at_checked(n)?;
        rest = tail;
        Some(head)
    };
    let (outcome, body_omitted) = match take(1)? {
        b"c" => (Finished::Completed, false),
        b"f" => (Finished::Failed, false),
        b"C" => (Finished::Completed, true),
        b"F" => (Finished::Failed, true),
        _ => return None,
    };
    let status = u16::from_be_bytes(take(2)?.try_into().ok()?);
    let headers = header_list::read(&mut rest)?;
    Some(StoredResponse {
        outcome,
        status,
        headers,
        body: Bytes::copy_from_slice(rest),
        body_omitted,
        expires_in: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    #[test]
    fn responses_round_trip_and_garbage_is_refused() {
        let response = StoredResponse {
            outcome: Finished::Failed,
            status: 402,
            headers: vec![
                (
                    http::header::CONTENT_TYPE,
                    HeaderValue::from_static("application/json"),
                ),
                (http::header::LINK, HeaderValue::from_static("<a>")),
                (http::header::LINK, HeaderValue::from_static("<b>")),
            ],
            body: Bytes::from_static(b"{\"error\":\"card_declined\"}"),
            body_omitted: false,
            expires_in: None,
        };
        let blob = encode(&response).expect("fits");
        assert_eq!(decode(&blob), Some(response.clone()));
        let omitted = StoredResponse {
            body: Bytes::new(),
            body_omitted: true,
            ..response
        };
        assert_eq!(decode(&encode(&omitted).expect("fits")), Some(omitted));
        for cut in 0..7 {
            assert_eq!(decode(&blob[..cut]), None, "cut at {cut}");
        }
        assert_eq!(decode(b"x"), None);
    }

    #[test]
    fn index_entries_name_digests_in_lower_case_hex_only() {
        let digest: [u8; 32] = std::array::from_fn(|i| (i * 37) as u8);
        let hex = crate::util::hex::encode(&digest);
        assert_eq!(parse_digest(&hex), Some(digest));
        assert_eq!(parse_digest(&hex.to_uppercase()), None);
        assert_eq!(parse_digest(&hex[1..]), None);
        assert_eq!(parse_digest(&format!("{}g", &hex[1..])), None);
        assert_eq!(parse_digest(""), None);
    }
}
