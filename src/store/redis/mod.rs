//! The Redis store: records as Redis hashes, changed only by Lua scripts, expired by Redis itself;
//! on one server or on a Redis Cluster.
//!
//! | file | what it does |
//! |---|---|
//! | `mod.rs` | [`RedisStore`], its settings, and the store trait's operations |
//! | `connection.rs` | one server or a cluster |
//! | `eval.rs` | a script run on its keys, by SHA1, every operation bounded by the timeout |
//! | `scripts.rs`, `*.lua` | the Lua scripts, each on one key (two for the claim and the completion on one server) |
//! | `claim.rs` | the claim and its answer |
//! | `inspect.rs` | lookup and delete |
//! | `index.rs` | each subject's listing index: filing, listing, sweeping |
//! | `codec.rs` | a recorded response as bytes |

mod claim;
mod codec;
mod connection;
mod eval;
mod index;
mod inspect;
mod scripts;

use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::{ClusterClient, ClusterConfig};
use sha2::{Digest, Sha256};

use self::codec::{encode, millis};
use self::connection::{Connection, Reconnect};
use self::eval::Joined;
use self::index::ACCOUNT_GRANULE;
use self::scripts::Scripts;
use super::{
    ClaimOutcome, ClaimRequest, Deleted, Fenced, Fingerprint, IdempotencyStore, LeaseToken,
    ListRequest, RecordInfo, RecordKey, RecordPage, StoreError, StoredResponse,
};

/// How long one store operation may take before it counts as failed (`503`), by default.
pub(crate) const DEFAULT_REDIS_TIMEOUT: Duration = Duration::from_secs(2);

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
/// lifetime (in-progress TTL and retention) of the claims that filed into it. On one server, the
/// claim script files the record it creates in the same round trip. On a cluster, the index lives
/// in another slot than the records, so a claim that creates a record files it with a second
/// command, awaited (one more round trip, on fresh keys only), within a quarter of the operation
/// timeout. The index serves listings only: when the filing fails or times out the claim still
/// stands (the failure is logged) and the record is merely missing from listings; a record kept longer than its claim's lifetime (a handler renewing
/// its lease past the in-progress TTL) may likewise drop out of listings when the index expires
/// before it. Lookups and deletes never read the index. A listing reads the records its index
/// names (each on its own node, on a cluster), skips (and removes from the index) those that are
/// gone, released or expired, and reads at most ten index entries per record asked: a page left
/// short by that bound still carries a cursor to continue from. Listings are not the only clean-up:
/// every eighth record a store files, it checks 16 random entries of that index on a task of its
/// own (their records read in one round trip on one server, one each on a cluster) and drops those
/// of records that are gone, so an index whose subject is never listed holds
/// about as many dead entries as live ones. Listing needs Redis 6.2 or later (`ZRANGE ...
/// BYSCORE`, `ZADD GT`); on an older server claims still work, unfiled. The connection
/// is made lazily and re-made after failures; while Redis is unreachable every operation fails (and
/// the layer answers `503`).
///
/// # One server or a cluster
///
/// [`RedisStore::new`] talks to one server (or whatever a [`redis::Client`] reaches: a primary
/// behind a proxy, say); [`RedisStore::cluster`] talks to a Redis Cluster. On a cluster, every
/// script reads and writes exactly one key, its `KEYS[1]` (the record's hash, or for the index's
/// and the account's scripts a subject's index or account of bytes), and nothing else, so each
/// script runs whole on the master that owns that key's slot: no cross-slot access, no hash tags
/// needed, and records spread over the masters by their digest. On one server, where no slot
/// divides keys, the claim's script also files its record in the subject's index, and the
/// completion's script also counts the answer's bytes in the subject's account: a fresh key is two
/// round trips there, four on a cluster. That an address is one server is not assumed: the first
/// claim starts a probe, on a task of its own, that writes keys with a script and reads them back
/// by themselves, and a claim starts it again every ten minutes. Until it answers, and while it
/// finds a proxy that spreads keys over several servers (twemproxy, Envoy's Redis proxy) or one
/// that refuses a script's second key (`CROSSSLOT`, an ACL allowing only some keys), every script
/// takes one key, as on a cluster. A prefix given to
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
    /// How to open another connection like `connection`: for the lease keeper's session.
    client: Reconnect,
    prefix: Arc<str>,
    timeout: Duration,
    scripts: Arc<Scripts>,
    /// Whether records keep their key, subject and endpoint in clear, and are filed for listing.
    scope_fields: bool,
    /// Records filed for listing by this store and its clones: every eighth sweeps.
    filed: Arc<AtomicU64>,
    /// Whether a server with one address holds every key a script names, as last probed (see
    /// `RedisStore::keys_together`).
    joined: Arc<Joined>,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
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
        let connection = ConnectionManager::new_lazy_with_config(client.clone(), config.clone())
            .map_err(|e| StoreError::new("redis: connection manager", e))?;
        Ok(Self::on(
            Connection::Single(connection),
            Reconnect::Single(client, config),
        ))
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
        Ok(Self::on(
            Connection::Cluster(connection),
            Reconnect::Cluster(client),
        ))
    }

    fn on(connection: Connection, client: Reconnect) -> Self {
        RedisStore {
            connection,
            client,
            prefix: Arc::from("idempotency:"),
            timeout: DEFAULT_REDIS_TIMEOUT,
            scope_fields: true,
            filed: Arc::new(AtomicU64::new(0)),
            joined: Arc::new(Joined::new()),
            scripts: Arc::new(Scripts::new()),
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
    /// [`delete`](IdempotencyStore::delete) work as before (they show an empty key). On a cluster it
    /// also saves two round trips of a fresh key (the filing and the count of its answer's bytes);
    /// on one server those are part of the claim's and the completion's scripts.
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

    pub(super) fn redis_key(&self, key: &RecordKey) -> String {
        self.record_key(&key.digest())
    }

    /// The Redis key of the record whose scope has the digest `digest`: `<prefix><digest hex>`.
    pub(super) fn record_key(&self, digest: &[u8; 32]) -> String {
        let mut name = String::with_capacity(self.prefix.len() + 64);
        name.push_str(&self.prefix);
        crate::util::hex::push(&mut name, digest);
        name
    }

    /// Whether the store talks to one address (not a cluster), where a pipeline goes whole.
    pub(super) fn one_server(&self) -> bool {
        matches!(self.connection, Connection::Single(_))
    }

    /// This store (and its clones) as if a probe had just found one server: its scripts take two
    /// keys until a server refuses them or the next probe, ten minutes on. For tests.
    #[doc(hidden)]
    pub fn assume_keys_together(self) -> Self {
        self.joined.decide(true);
        self
    }

    /// Whether this store's claims file their records in the subjects' indexes, and completions
    /// count the answers' bytes, in the same script (`None`: not probed yet; asking starts a probe
    /// when one is due). For tests.
    #[doc(hidden)]
    pub fn keys_together_now(&self) -> Option<bool> {
        if !self.one_server() {
            return Some(false);
        }
        self.keys_together();
        self.joined.now().0
    }

    /// The key of `subject`'s index: `<prefix>subject:<sha256 of the subject>`.
    pub(super) fn index_key(&self, subject: &str) -> String {
        self.subject_key("subject:", subject)
    }

    /// The key of `subject`'s account of bytes (see [`RedisStore::account`]).
    pub(super) fn account_key(&self, subject: &str) -> String {
        self.subject_key("bytes:", subject)
    }

    fn subject_key(&self, kind: &str, subject: &str) -> String {
        let digest: [u8; 32] = Sha256::digest(subject.as_bytes()).into();
        let mut name = String::with_capacity(self.prefix.len() + kind.len() + 64);
        name.push_str(&self.prefix);
        name.push_str(kind);
        crate::util::hex::push(&mut name, &digest);
        name
    }
}

impl IdempotencyStore for RedisStore {
    async fn claim(&self, request: &ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        self.claim_record(request).await
    }

    async fn lookup(&self, key: &RecordKey) -> Result<Option<RecordInfo>, StoreError> {
        self.lookup_record(key).await
    }

    async fn delete(&self, key: &RecordKey) -> Result<Deleted, StoreError> {
        self.delete_record(key).await
    }

    async fn list(&self, subject: &str, request: ListRequest) -> Result<RecordPage, StoreError> {
        self.list_records(subject, request).await
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
        let counted = self.scope_fields;
        // On one server, the completion script counts the answer's bytes (and its steps')
        // itself, once, when it writes the answer (see `scripts`); on a cluster, the account is
        // on another slot.
        let account = counted.then(|| self.account_key(&key.subject));
        let ((done, steps), joined): ((i64, i64), bool) = self
            .eval_joined(
                "complete",
                &self.scripts.complete,
                &self.redis_key(key),
                account.as_deref(),
                |cmd| {
                    cmd.arg(lease.0)
                        .arg(response.outcome.as_str())
                        .arg(&blob[..])
                        .arg(millis(retention))
                        // Read only with the account, `KEYS[2]`.
                        .arg(response.body.len())
                        .arg(millis(ACCOUNT_GRANULE));
                },
            )
            .await?;
        // Otherwise its body counts in its subject's bytes apart: an answer sent again after its
        // reply was lost (its first write may have landed) is counted again, an estimate from
        // above, rather than not at all.
        if done == 2 {
            tracing::warn!(
                "an idempotency answer was recorded but not counted in its subject's bytes"
            );
        }
        let bytes = response
            .body
            .len()
            .saturating_add(usize::try_from(steps).unwrap_or(0));
        if done == 1 && counted && !joined && bytes > 0 {
            self.account(&key.subject, bytes, retention).await;
        }
        Ok(Fenced::from_held(done >= 1))
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

    async fn record_step(
        &self,
        key: &RecordKey,
        lease: LeaseToken,
        step: &crate::store::RecordedStep,
    ) -> Result<Fenced, StoreError> {
        let bytes = crate::store::step_list::encode(step)
            .ok_or_else(|| StoreError::msg("redis record_step: the step is too large"))?;
        let done: i64 = self
            .eval("record_step", &self.scripts.step, key, |cmd| {
                cmd.arg(lease.0).arg(bytes.as_slice());
            })
            .await?;
        Ok(Fenced::from_held(done == 1))
    }

    async fn steps(
        &self,
        key: &RecordKey,
        lease: LeaseToken,
    ) -> Result<Option<Vec<crate::store::RecordedStep>>, StoreError> {
        let answer: Vec<u8> = self
            .eval("steps", &self.scripts.steps, key, |cmd| {
                cmd.arg(lease.0);
            })
            .await?;
        match answer.split_first() {
            None => Ok(None),
            Some((b'h', list)) => crate::store::step_list::decode(list)
                .map(Some)
                .ok_or_else(|| StoreError::unreadable_record("redis steps: unreadable")),
            Some(_) => Err(StoreError::msg("redis steps: an unexpected answer")),
        }
    }

    async fn recorded_steps(
        &self,
        key: &RecordKey,
    ) -> Result<Vec<crate::store::RecordedStep>, StoreError> {
        let list: Vec<u8> = self
            .eval("recorded_steps", &self.scripts.recorded_steps, key, |_| {})
            .await?;
        crate::store::step_list::decode(&list)
            .ok_or_else(|| StoreError::unreadable_record("redis recorded_steps: unreadable"))
    }

    /// Redis expires records itself; there is nothing to purge.
    async fn purge_expired(&self) -> Result<u64, StoreError> {
        Ok(0)
    }

    /// The size of the subject's listing index: its live records and, until a sweep or a listing
    /// drops them, entries of records that are gone (about as many), an estimate from above.
    /// `None` without scope fields (no index is kept).
    async fn count_records(
        &self,
        subject: &str,
        up_to: u64,
    ) -> Result<Option<crate::store::SubjectUsage>, StoreError> {
        if !self.scope_fields {
            return Ok(None);
        }
        let (records, bytes) = futures_util::future::join(
            self.count_indexed(subject, up_to),
            self.account_usage(subject),
        )
        .await;
        Ok(Some(crate::store::SubjectUsage {
            records: records?,
            bytes: bytes?,
        }))
    }

    fn counts_records(&self) -> bool {
        self.scope_fields
    }

    fn operation_timeout(&self) -> Option<Duration> {
        Some(self.timeout)
    }

    /// The same store on a connection of its own, made now on the keeper's runtime (which then
    /// drives it): a runtime whose workers are all blocked by handlers no longer carries the
    /// keeper's renewals.
    async fn keeper_session(&self) -> Result<Self, StoreError> {
        let connection = match &self.client {
            Reconnect::Single(client, config) => Connection::Single(
                ConnectionManager::new_lazy_with_config(client.clone(), config.clone())
                    .map_err(|e| StoreError::new("redis: connection manager", e))?,
            ),
            Reconnect::Cluster(client) => Connection::Cluster(
                client.get_pending_async_connection_with_config(ClusterConfig::new()),
            ),
        };
        Ok(RedisStore {
            connection,
            ..self.clone()
        })
    }

    /// Nothing to show: Redis judges a holder by the in-progress TTL, on the server's clock
    /// (`TIME`). Its writes pause together (`CLIENT PAUSE WRITE`, as a failover pauses them), the
    /// holder's queued renewals with the retakes, and key expiry pauses with them.
    async fn show_presences(
        &self,
        _live: &[crate::store::Presence],
        _lapse: Duration,
    ) -> Result<(), StoreError> {
        Ok(())
    }
}
