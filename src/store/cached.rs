//! A local cache of finished records in front of any store, so that replays skip the round trip.

use std::collections::hash_map::RandomState;
use std::collections::{HashMap, VecDeque};
use std::hash::BuildHasher;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::{
    ClaimOutcome, ClaimRequest, Deleted, FailedCommit, Fenced, Fingerprint, IdempotencyStore,
    LeaseToken, ListRequest, RecordInfo, RecordKey, RecordPage, StoreError, StoredResponse,
    TransactionalStore,
};
use crate::util::lock::lock;

/// The default bound on the bytes a [`CachedStore`] keeps: 32 MiB.
pub(crate) const DEFAULT_CACHE_BYTES: usize = 32 << 20;

/// The default longest time a [`CachedStore`] keeps a record: 5 minutes.
pub(crate) const DEFAULT_CACHE_MAX_AGE: Duration = Duration::from_secs(300);

const SHARDS: usize = 16;

/// What an entry costs beyond its body and headers: the map slot, the queue slot, the `Arc`.
const ENTRY_OVERHEAD: usize = 160;

/// A store wrapper that keeps finished records in this process's memory, so a replay is answered
/// without a round trip to the store behind it.
///
/// - **Only finished records** are cached (`completed` or `failed`, which never change until
///   they expire). `in_progress` records, claims, completions, renewals and releases always go to
///   the store.
/// - **Filled by reads.** An entry is made when a claim reads a finished record from the store
///   and the store says how long the record has left ([`StoredResponse::expires_in`]; the memory,
///   Postgres and Redis stores do). So the first replay of a record on each instance reads the store, and the
///   next ones do not.
/// - **Never outlives its record.** An entry expires when its record does (counted from before the
///   read, so never later), or after `max_age` (5 minutes by default), whichever is first. The
///   age bound limits how long a record that vanished early is still replayed here: deleted by
///   hand (to let a key run again), or lost by a Redis that evicts keys under memory pressure
///   (`maxmemory-policy` other than `noeviction`) or restarts without persistence.
/// - **Fingerprint checked.** A cached record answers a request with another body `422`, exactly as
///   the store would.
/// - **Bounded by bytes** (bodies, headers and a fixed overhead per entry; 32 MiB by default),
///   in 16 independently locked shards, each evicting its oldest entries first. A record larger than
///   a sixteenth of a shard's share is not cached (so a capacity under about 64 KiB caches
///   nothing).
///
/// Duplicates of a request still in progress at this instance are answered by the layer itself,
/// whatever the store, without a round trip (see [`IdempotencyLayer`](crate::IdempotencyLayer));
/// this cache adds the replays of finished records.
///
/// **Clones share** the cache: clone it into every layer of the process
/// (two `CachedStore::new` over one store are two caches, each answering only what it saw).
/// Migrate the store it wraps before wrapping it (`PostgresStore::migrate`): the cache has no
/// migration of its own.
///
/// ```no_run
/// # #[cfg(feature = "postgres")]
/// # async fn demo(pool: sqlx::PgPool) {
/// use axum_idempotency::{IdempotencyLayer, store::CachedStore};
/// use axum_idempotency::store::PostgresStore;
///
/// let store = CachedStore::new(PostgresStore::new(pool)).with_capacity(64 << 20);
/// let layer = IdempotencyLayer::new(store).expect("valid settings");
/// # let _ = layer;
/// # }
/// ```
#[derive(Clone)]
pub struct CachedStore<S> {
    inner: S,
    cache: Arc<Cache>,
}

impl<S: std::fmt::Debug> std::fmt::Debug for CachedStore<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CachedStore")
            .field("inner", &self.inner)
            .field("max_age", &self.cache.max_age)
            .finish_non_exhaustive()
    }
}

struct Cache {
    hasher: RandomState,
    shards: [Mutex<Shard>; SHARDS],
    shard_bytes: usize,
    max_age: Duration,
}

#[derive(Default)]
struct Shard {
    entries: HashMap<[u8; 32], Entry>,
    /// Scopes in the order they were cached, with the entry's number to tell a replaced entry from
    /// the one queued.
    order: VecDeque<([u8; 32], u64)>,
    bytes: usize,
    next: u64,
    /// Scopes deleted through this cache, with when the delete was answered: a read that began
    /// before then may carry the deleted record, and is not cached.
    deleted: HashMap<[u8; 32], Instant>,
    /// The size of `deleted` at which it is next swept of old entries (amortised: each sweep is
    /// paid for by as many deletes before it).
    sweep_deleted_at: usize,
}

struct Entry {
    fingerprint: Fingerprint,
    response: Arc<StoredResponse>,
    deadline: Instant,
    /// When the record itself expires (its time left counted from before the read).
    expires: Instant,
    size: usize,
    number: u64,
}

impl<S: IdempotencyStore> CachedStore<S> {
    /// A cache of 32 MiB of records, each kept at most 5 minutes, in front of `inner`.
    pub fn new(inner: S) -> Self {
        Self::build(inner, DEFAULT_CACHE_BYTES, DEFAULT_CACHE_MAX_AGE)
    }

    /// Bounds the bytes cached (0 turns the cache off).
    pub fn with_capacity(self, bytes: usize) -> Self {
        Self::build(self.inner, bytes, self.cache.max_age)
    }

    /// Bounds how long an entry is kept, whatever its record's retention.
    pub fn with_max_age(self, max_age: Duration) -> Self {
        Self::build(self.inner, self.cache.shard_bytes * SHARDS, max_age)
    }

    fn build(inner: S, bytes: usize, max_age: Duration) -> Self {
        CachedStore {
            inner,
            cache: Arc::new(Cache {
                hasher: RandomState::new(),
                shards: Default::default(),
                shard_bytes: bytes / SHARDS,
                max_age,
            }),
        }
    }

    /// The store behind the cache.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// How many records are cached (expired ones not yet dropped included).
    pub fn len(&self) -> usize {
        self.cache
            .shards
            .iter()
            .map(|s| lock(s).entries.len())
            .sum()
    }

    /// True when nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes the cached records count for.
    pub fn bytes(&self) -> usize {
        self.cache.shards.iter().map(|s| lock(s).bytes).sum()
    }
}

impl Cache {
    fn shard(&self, scope: &[u8; 32]) -> MutexGuard<'_, Shard> {
        lock(&self.shards[self.hasher.hash_one(scope) as usize % SHARDS])
    }

    /// The cached answer to a claim, if any: the replay, or a mismatch.
    fn answer(&self, scope: &[u8; 32], fingerprint: &Fingerprint) -> Option<ClaimOutcome> {
        let mut shard = self.shard(scope);
        let entry = shard.entries.get(scope)?;
        if entry.deadline <= Instant::now() {
            let size = entry.size;
            shard.entries.remove(scope);
            shard.bytes -= size;
            return None;
        }
        Some(if entry.fingerprint == *fingerprint {
            // The record's time left as of now, as the store would have said it: it dates the
            // replay's expiry header.
            let left = entry.expires.saturating_duration_since(Instant::now());
            ClaimOutcome::Finished(Arc::new(StoredResponse {
                expires_in: Some(left),
                ..StoredResponse::clone(&entry.response)
            }))
        } else {
            ClaimOutcome::KeyReuse
        })
    }

    fn insert(
        &self,
        scope: [u8; 32],
        fingerprint: Fingerprint,
        response: Arc<StoredResponse>,
        read_at: Instant,
    ) {
        let Some(left) = response.expires_in else {
            return;
        };
        let size = ENTRY_OVERHEAD
            + response.body.len()
            + response
                .headers
                .iter()
                .map(|(n, v)| n.as_str().len() + v.len() + 16)
                .sum::<usize>();
        if size > self.shard_bytes / 16 {
            return;
        }
        let deadline = read_at + left.min(self.max_age);
        let expires = read_at + left;
        let mut shard = self.shard(&scope);
        let shard = &mut *shard;
        if shard
            .deleted
            .get(&scope)
            .is_some_and(|deleted| read_at <= *deleted)
        {
            return;
        }
        shard.next += 1;
        let number = shard.next;
        let entry = Entry {
            fingerprint,
            response,
            deadline,
            expires,
            size,
            number,
        };
        if let Some(old) = shard.entries.insert(scope, entry) {
            shard.bytes -= old.size;
        }
        shard.bytes += size;
        shard.order.push_back((scope, number));
        while shard.bytes > self.shard_bytes {
            let Some((oldest, number)) = shard.order.pop_front() else {
                break;
            };
            if shard
                .entries
                .get(&oldest)
                .is_some_and(|e| e.number == number)
                && let Some(evicted) = shard.entries.remove(&oldest)
            {
                shard.bytes -= evicted.size;
            }
        }
        // Replaced and expired entries leave stale numbers in the queue; keep it from growing past
        // twice the entries by rebuilding it when it does.
        if shard.order.len() > 2 * shard.entries.len() + 64 {
            let entries = &shard.entries;
            shard
                .order
                .retain(|(scope, number)| entries.get(scope).is_some_and(|e| e.number == *number));
        }
    }

    /// Forgets the entry of `scope`, whose record was deleted, and keeps reads that began before
    /// now from caching it again (for as long as a read can take: the longer of `max_age` and a
    /// minute). Deletes of the last while are swept as they go.
    fn deleted(&self, scope: &[u8; 32]) {
        let now = Instant::now();
        let keep = self.max_age.max(Duration::from_secs(60));
        let mut shard = self.shard(scope);
        if let Some(entry) = shard.entries.remove(scope) {
            shard.bytes -= entry.size;
        }
        if shard.deleted.len() >= shard.sweep_deleted_at.max(64) {
            shard
                .deleted
                .retain(|_, at| now.saturating_duration_since(*at) < keep);
            shard.sweep_deleted_at = 2 * shard.deleted.len();
        }
        shard.deleted.insert(*scope, now);
    }

    fn sweep(&self) {
        let now = Instant::now();
        for shard in &self.shards {
            let mut shard = lock(shard);
            let shard = &mut *shard;
            let mut freed = 0;
            shard.entries.retain(|_, e| {
                let keep = e.deadline > now;
                if !keep {
                    freed += e.size;
                }
                keep
            });
            shard.bytes -= freed;
            let keep = self.max_age.max(Duration::from_secs(60));
            shard
                .deleted
                .retain(|_, at| now.saturating_duration_since(*at) < keep);
            let entries = &shard.entries;
            shard
                .order
                .retain(|(scope, number)| entries.get(scope).is_some_and(|e| e.number == *number));
        }
    }
}

impl<S: IdempotencyStore> IdempotencyStore for CachedStore<S> {
    async fn claim(&self, request: &ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        let scope = request.key.digest();
        if self.cache.shard_bytes > 0
            && let Some(answer) = self.cache.answer(&scope, &request.fingerprint)
        {
            return Ok(answer);
        }
        self.read(request, scope).await
    }

    async fn complete(
        &self,
        key: &RecordKey,
        lease: LeaseToken,
        fingerprint: &Fingerprint,
        response: Arc<StoredResponse>,
        retention: Duration,
    ) -> Result<Fenced, StoreError> {
        self.inner
            .complete(key, lease, fingerprint, response, retention)
            .await
    }

    async fn renew(
        &self,
        key: &RecordKey,
        lease: LeaseToken,
        lifetime: Duration,
    ) -> Result<Fenced, StoreError> {
        self.inner.renew(key, lease, lifetime).await
    }

    async fn renew_many(
        &self,
        leases: &[(&RecordKey, LeaseToken)],
        lifetime: Duration,
    ) -> Vec<Result<Fenced, StoreError>> {
        self.inner.renew_many(leases, lifetime).await
    }

    async fn release(&self, key: &RecordKey, lease: LeaseToken) -> Result<Fenced, StoreError> {
        self.inner.release(key, lease).await
    }

    async fn record_step(
        &self,
        key: &RecordKey,
        lease: LeaseToken,
        step: &crate::store::RecordedStep,
    ) -> Result<Fenced, StoreError> {
        self.inner.record_step(key, lease, step).await
    }

    async fn steps(
        &self,
        key: &RecordKey,
        lease: LeaseToken,
    ) -> Result<Option<Vec<crate::store::RecordedStep>>, StoreError> {
        self.inner.steps(key, lease).await
    }

    /// The inner store's: steps are never cached.
    async fn recorded_steps(
        &self,
        key: &RecordKey,
    ) -> Result<Vec<crate::store::RecordedStep>, StoreError> {
        self.inner.recorded_steps(key).await
    }

    async fn purge_expired(&self) -> Result<u64, StoreError> {
        self.cache.sweep();
        self.inner.purge_expired().await
    }

    async fn count_records(
        &self,
        subject: &str,
        up_to: u64,
    ) -> Result<Option<crate::store::SubjectUsage>, StoreError> {
        self.inner.count_records(subject, up_to).await
    }

    /// The inner store's: the cache changes nothing that is written.
    fn counts_records(&self) -> bool {
        self.inner.counts_records()
    }

    fn operation_timeout(&self) -> Option<Duration> {
        self.inner.operation_timeout()
    }

    /// The inner store's session, behind this cache (the keeper only renews, which changes no
    /// cached answer).
    async fn keeper_session(&self) -> Result<Self, StoreError> {
        Ok(CachedStore {
            inner: self.inner.keeper_session().await?,
            cache: self.cache.clone(),
        })
    }

    async fn show_presences(
        &self,
        live: &[super::Presence],
        lapse: Duration,
    ) -> Result<(), StoreError> {
        self.inner.show_presences(live, lapse).await
    }

    async fn lookup(&self, key: &RecordKey) -> Result<Option<RecordInfo>, StoreError> {
        self.inner.lookup(key).await
    }

    /// Deleted in the store, and forgotten by this cache: its entry is dropped once the store has
    /// answered, whatever it answered, and a read that began before then (it may carry the
    /// deleted record) is not cached. Other instances' caches still replay the record until their
    /// entry's `max_age` (5 minutes by default) has passed.
    async fn delete(&self, key: &RecordKey) -> Result<Deleted, StoreError> {
        let scope = key.digest();
        let deleted = self.inner.delete(key).await;
        // Forgotten on every answer: an error may hide a delete that landed, and a store of
        // someone else's may answer `NotFound` to a delete it sent again after its first attempt
        // committed. Only the store's answers that cannot be stale are cached, and this one may
        // be.
        self.cache.deleted(&scope);
        deleted
    }

    async fn list(&self, subject: &str, request: ListRequest) -> Result<RecordPage, StoreError> {
        self.inner.list(subject, request).await
    }
}

/// A wrapper of a store with transactions has them too: what is written in a handler's
/// transaction is the inner store's business (the cache keeps only records it read finished).
impl<S: TransactionalStore> TransactionalStore for CachedStore<S> {
    type Transaction = S::Transaction;

    async fn begin(&self, idle: Duration) -> Result<Self::Transaction, StoreError> {
        self.inner.begin(idle).await
    }

    async fn complete_in(
        &self,
        tx: &mut Self::Transaction,
        key: &RecordKey,
        lease: LeaseToken,
        fingerprint: &Fingerprint,
        response: Arc<StoredResponse>,
        retention: Duration,
        steps: &[crate::store::RecordedStep],
    ) -> Result<Fenced, StoreError> {
        self.inner
            .complete_in(tx, key, lease, fingerprint, response, retention, steps)
            .await
    }

    async fn commit(&self, tx: Self::Transaction) -> Result<(), StoreError> {
        self.inner.commit(tx).await
    }

    async fn rollback(&self, tx: Self::Transaction) -> Result<(), StoreError> {
        self.inner.rollback(tx).await
    }

    async fn settle_failed_commit(
        &self,
        key: &RecordKey,
        lease: LeaseToken,
    ) -> Result<FailedCommit, StoreError> {
        self.inner.settle_failed_commit(key, lease).await
    }
}

impl<S: IdempotencyStore> CachedStore<S> {
    /// A claim read from the store, its answer cached if it is a finished record.
    async fn read(
        &self,
        request: &ClaimRequest,
        scope: [u8; 32],
    ) -> Result<ClaimOutcome, StoreError> {
        // Taken before the read: the record's time left is counted from no later than the store
        // read it, so the entry cannot outlive the record.
        let read_at = Instant::now();
        let outcome = self.inner.claim(request).await?;
        if let ClaimOutcome::Finished(response) = &outcome
            && self.cache.shard_bytes > 0
        {
            self.cache
                .insert(scope, request.fingerprint, response.clone(), read_at);
        }
        Ok(outcome)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Finished;
    use bytes::Bytes;

    fn response(body: &'static str, left: Option<Duration>) -> Arc<StoredResponse> {
        Arc::new(StoredResponse {
            outcome: Finished::Completed,
            status: 201,
            headers: Vec::new(),
            body: Bytes::from_static(body.as_bytes()),
            body_omitted: false,
            expires_in: left,
        })
    }

    fn cache(bytes: usize, max_age: Duration) -> Cache {
        Cache {
            hasher: RandomState::new(),
            shards: Default::default(),
            shard_bytes: bytes / SHARDS,
            max_age,
        }
    }

    fn fp(byte: u8) -> Fingerprint {
        Fingerprint::of(None, &[byte])
    }

    /// A read that began before a delete was answered may carry the deleted record: it is not
    /// cached; one that began after is.
    #[test]
    fn a_read_from_before_a_delete_is_not_cached() {
        let cache = cache(1 << 20, Duration::from_secs(60));
        let left = Some(Duration::from_secs(60));
        let before = Instant::now();
        cache.insert([1; 32], fp(1), response("old", left), before);
        cache.deleted(&[1; 32]);
        assert!(
            cache.answer(&[1; 32], &fp(1)).is_none(),
            "dropped by the delete"
        );
        cache.insert([1; 32], fp(1), response("old", left), before);
        assert!(
            cache.answer(&[1; 32], &fp(1)).is_none(),
            "a read from before it"
        );
        std::thread::sleep(Duration::from_millis(2));
        cache.insert([1; 32], fp(1), response("new", left), Instant::now());
        assert!(matches!(
            cache.answer(&[1; 32], &fp(1)),
            Some(ClaimOutcome::Finished(r)) if r.body == "new"
        ));
    }

    #[test]
    fn answers_with_the_record_and_checks_the_fingerprint() {
        let cache = cache(1 << 20, Duration::from_secs(60));
        let now = Instant::now();
        cache.insert(
            [1; 32],
            fp(1),
            response("a", Some(Duration::from_secs(10))),
            now,
        );
        assert!(matches!(
            cache.answer(&[1; 32], &fp(1)),
            Some(ClaimOutcome::Finished(r)) if r.body == "a"
        ));
        assert_eq!(cache.answer(&[1; 32], &fp(2)), Some(ClaimOutcome::KeyReuse));
        assert_eq!(cache.answer(&[2; 32], &fp(1)), None);
    }

    #[test]
    fn entries_expire_with_their_record_or_their_age() {
        let cache = cache(1 << 20, Duration::from_secs(60));
        let long_ago = Instant::now() - Duration::from_secs(5);
        // The record had 4 s left when read 5 s ago: gone.
        cache.insert(
            [1; 32],
            fp(1),
            response("a", Some(Duration::from_secs(4))),
            long_ago,
        );
        assert_eq!(cache.answer(&[1; 32], &fp(1)), None);
        // A record with no known expiry is not cached.
        cache.insert([2; 32], fp(1), response("b", None), Instant::now());
        assert_eq!(cache.answer(&[2; 32], &fp(1)), None);
        // The age bound wins over a long retention.
        let short = self::cache(1 << 20, Duration::from_secs(4));
        short.insert(
            [3; 32],
            fp(1),
            response("c", Some(Duration::from_secs(3600))),
            long_ago,
        );
        assert_eq!(short.answer(&[3; 32], &fp(1)), None);
        let total: usize = cache.shards.iter().map(|s| lock(s).bytes).sum();
        assert_eq!(total, 0, "expired entries give their bytes back");
    }

    #[test]
    fn bytes_stay_under_the_bound() {
        let bound = 64 * 1024;
        let cache = cache(bound, Duration::from_secs(60));
        let left = Some(Duration::from_secs(60));
        for i in 0..20_000u32 {
            let mut scope = [0; 32];
            scope[..4].copy_from_slice(&i.to_be_bytes());
            cache.insert(scope, fp(1), response("0123456789", left), Instant::now());
            // Replace some, so that the queue holds stale numbers too.
            if i % 3 == 0 {
                cache.insert(scope, fp(1), response("x", left), Instant::now());
            }
        }
        let (entries, bytes, queued) = cache.shards.iter().fold((0, 0, 0), |acc, s| {
            let s = lock(s);
            let counted: usize = s.entries.values().map(|e| e.size).sum();
            assert_eq!(counted, s.bytes, "a shard's count matches its entries");
            assert!(s.bytes <= bound / SHARDS);
            assert!(s.order.len() <= 2 * s.entries.len() + 64);
            (
                acc.0 + s.entries.len(),
                acc.1 + s.bytes,
                acc.2 + s.order.len(),
            )
        });
        assert!(bytes <= bound);
        assert!(entries > 200, "the cache holds what fits: {entries}");
        assert!(queued >= entries);
        // The newest entries are the ones kept.
        let mut newest = [0; 32];
        newest[..4].copy_from_slice(&19_999u32.to_be_bytes());
        assert!(cache.answer(&newest, &fp(1)).is_some());
        let mut oldest = [0; 32];
        oldest[..4].copy_from_slice(&0u32.to_be_bytes());
        assert_eq!(cache.answer(&oldest, &fp(1)), None);
    }

    #[test]
    fn records_too_large_for_a_shard_are_not_cached() {
        let cache = cache(16 * 1024, Duration::from_secs(60));
        let big: &'static str = Box::leak("x".repeat(2000).into_boxed_str());
        cache.insert(
            [1; 32],
            fp(1),
            response(big, Some(Duration::from_secs(60))),
            Instant::now(),
        );
        assert_eq!(cache.answer(&[1; 32], &fp(1)), None);
    }
}
