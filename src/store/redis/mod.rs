//! The Redis store: records as Redis hashes, changed only by Lua scripts, expired by Redis itself;
//! on one server or on a Redis Cluster.

use crate::record::Fenced;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::{ClusterClient, ClusterConfig};
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, ErrorKind, FromRedisValue, RedisFuture, Script, ServerErrorKind, Value};

use super::{Capabilities, IdempotencyStore, StoreError, header_list};
use crate::Fingerprint;
use crate::record::{
    ClaimOutcome, ClaimRequest, Finished, Generation, LeaseToken, RecordKey, StoredResponse,
};

/// How long one store operation may take before it counts as failed (`503`), by default.
pub const DEFAULT_REDIS_TIMEOUT: Duration = Duration::from_secs(2);

/// Claim, atomically: insert; or answer mismatch, finished (with the response), in progress; or
/// retake a record whose claim (or last renewal) is older than the in-progress TTL. A record in
/// progress under this very lease is this claim's own, sent twice (a resend after a lost reply):
/// claimed. A released record (lease `0`) is claimed at once: by the same request with its
/// generation, by another with the new one. Times are the server's `TIME`. A claimed or retaken
/// answer carries the record's generation (a retake keeps it; a record written before generations
/// has none).
/// KEYS[1] record; ARGV fingerprint, new lease, in-progress TTL (ms), TTL + retention (ms),
/// generation of a new record.
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

/// Records in Redis, shared by every instance connected to the same server or cluster.
///
/// Each record is one hash under `<prefix><sha256 of key, subject and endpoint>`, so client input
/// never shapes Redis key names and every key is 64 hex characters long. Claim, complete, renew and
/// release are Lua scripts, atomic on the server; retention is the key's expiry, so Redis removes
/// expired records itself and [`IdempotencyStore::purge_expired`] has nothing to do. The connection
/// is made lazily and re-made after failures; while Redis is unreachable every operation fails (and
/// the layer answers `503`).
///
/// # One server or a cluster
///
/// [`RedisStore::new`] talks to one server (or whatever a [`redis::Client`] reaches: a primary
/// behind a proxy, say); [`RedisStore::cluster`] talks to a Redis Cluster. Every script reads and
/// writes exactly one key, its `KEYS[1]` (the record's hash), and nothing else, so on a cluster each
/// operation runs whole on the master that owns that key's slot: no cross-slot access, no hash tags
/// needed, and records spread over the masters by their digest. A prefix given to
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
/// restart runs the handler again. Use the Postgres store where that is not acceptable.
#[derive(Clone)]
pub struct RedisStore {
    connection: Connection,
    prefix: Arc<str>,
    timeout: Duration,
    scripts: Arc<Scripts>,
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
    /// made counts as done). A claim resent that way finds its own claim: that request gets `409`
    /// without running the handler, and the key is retaken after the in-progress TTL, as when a
    /// process dies holding a claim; the handler never runs twice because of it.
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// use axum_idempotency::{IdempotencyLayer, RedisStore};
    ///
    /// let client = redis::cluster::ClusterClient::new(vec![
    ///     "redis://127.0.0.1:7000",
    ///     "redis://127.0.0.1:7001",
    ///     "redis://127.0.0.1:7002",
    /// ])?;
    /// let store = RedisStore::cluster(client)?.with_prefix("shop:idem:");
    /// let layer = IdempotencyLayer::new(store);
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
            scripts: Arc::new(Scripts {
                claim: Lua::new(CLAIM),
                complete: Lua::new(COMPLETE),
                renew: Lua::new(RENEW),
                release: Lua::new(RELEASE),
            }),
        }
    }

    /// Puts this store's keys under another prefix (to share one Redis between applications). On a
    /// cluster, keep hash tags (`{...}`) out of it, or every record lands in one slot.
    pub fn with_prefix(mut self, prefix: &str) -> Self {
        self.prefix = Arc::from(prefix);
        self
    }

    /// How long one operation may take before it fails. Default: [`DEFAULT_REDIS_TIMEOUT`].
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        // No server answers in less; a shorter timeout would fail every operation.
        self.timeout = timeout.max(Duration::from_millis(10));
        self
    }

    fn redis_key(&self, key: &RecordKey) -> String {
        let digest = key.digest();
        let mut name = String::with_capacity(self.prefix.len() + 64);
        name.push_str(&self.prefix);
        crate::hex::push(&mut name, &digest);
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
        let key = self.redis_key(key);
        let command = |name: &str, script: &str| {
            let mut cmd = redis::cmd(name);
            cmd.arg(script).arg(1).arg(&key);
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
        self.timed(what, run).await
    }

    async fn timed<T>(
        &self,
        what: &'static str,
        operation: impl Future<Output = redis::RedisResult<T>>,
    ) -> Result<T, StoreError> {
        match tokio::time::timeout(self.timeout, operation).await {
            Ok(result) => result.map_err(|e| StoreError::new(format!("redis {what}"), e)),
            Err(_) => Err(StoreError::msg(format!(
                "redis {what}: no answer within {:?}",
                self.timeout
            ))),
        }
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

impl IdempotencyStore for RedisStore {
    async fn claim(&self, request: &ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        let lease = request.lease;
        let reply: Vec<Value> = self
            .eval("claim", &self.scripts.claim, &request.key, |cmd| {
                cmd.arg(&request.fingerprint.as_bytes()[..])
                    .arg(lease.0)
                    .arg(millis(request.in_progress_ttl))
                    .arg(millis(request.in_progress_ttl + request.retention))
                    .arg(&request.generation.0[..]);
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
            b"mismatch" => ClaimOutcome::FingerprintMismatch,
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

    async fn lookup(&self, _key: &RecordKey) -> Result<Option<super::RecordInfo>, StoreError> {
        Err(StoreError::msg("TODO: inspection"))
    }

    async fn delete(&self, _key: &RecordKey) -> Result<super::Deleted, StoreError> {
        Err(StoreError::msg("TODO: inspection"))
    }

    async fn list(
        &self,
        _subject: &str,
        _request: super::ListRequest,
    ) -> Result<super::RecordPage, StoreError> {
        Err(StoreError::msg("TODO: inspection"))
    }

    fn capabilities(&self) -> Capabilities<'_> {
        Capabilities::none().with_operation_timeout(self.timeout)
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
}
