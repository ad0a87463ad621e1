//! The in-memory store: the embedded default, for one process.

use crate::store::Fenced;
use std::collections::HashMap;
use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

mod claim;
mod subjects;

use self::subjects::Subjects;
use super::{
    Deleted, IdempotencyStore, ListCursor, ListRequest, ListedRecord, RecordInfo, RecordPage,
    RecordState, StoreError,
};
use crate::store::Fingerprint;
use crate::store::{
    ClaimOutcome, ClaimRequest, Generation, LeaseToken, RecordKey, RecordedStep, StoredResponse,
};

const SHARDS: usize = 16;

/// Records in this process's memory, in 16 independently locked shards.
///
/// Claims are atomic within the process; records do not survive a restart and are not shared between
/// instances (use the Postgres store for that). Expired records are swept out of a shard after as many
/// operations on it as it holds records, so memory stays bounded by what retention keeps alive, at a
/// constant amortised cost per request; [`IdempotencyStore::purge_expired`] sweeps everything at once.
///
/// The store has a capacity in bytes ([`MemoryStore::with_capacity`], 256 MiB by default): the
/// records' keys, scopes, recorded headers and bodies, plus a fixed overhead each. When it is
/// full, a claim of a new key fails (the layer answers `503 idempotency_store_full`) after expired
/// records were swept; no live or unexpired record is ever evicted to make room, since that would
/// let its key run again. A completion is never refused for room (its effect happened): one that
/// would take its subject past its share, or the store past its capacity, is recorded without its
/// body (replayed with `Idempotency-Replay: omitted`), so the store goes over its capacity by
/// headers at most, and no subject fills it through the answers of the claims it holds.
///
/// **Each subject has a share of the capacity that adapts to the subjects present**: a subject
/// whose records hold `h` bytes takes more room only while at least `h` stay free after it. So `n`
/// subjects that all want more hold about `capacity / (n + 1)` each (a lone subject, half the
/// store; a store for one subject alone is `with_capacity_and_share(bytes, bytes)`); the less a
/// subject holds, the nearer to full the store it is let into, so the room freed as records expire
/// goes first to the subjects that hold the least, and the last of it to one that holds nothing:
/// no group of subjects, however many, fills the store for a subject that comes while they each
/// hold some. A subject refused room gets `429 idempotency_quota_exceeded` for new keys until some
/// records expire; the others are served, and its finished records still replay.
/// [`with_capacity_and_share`](Self::with_capacity_and_share) sets a fixed share instead.
///
/// **What it loses on restart: everything.** Records live in this process only: after a restart
/// (a deploy, a crash) every key is new, and a retry of a payment that finished before the restart
/// runs it again. For one instance without a database server, use `SqliteStore` (a file that
/// survives restarts); for several instances, a store they share.
///
/// Clones share the records.
#[derive(Clone)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

impl Default for MemoryStore {
    fn default() -> Self {
        MemoryStore::with_capacity(DEFAULT_MEMORY_CAPACITY)
    }
}

impl std::fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStore")
            .field("bytes", &self.bytes())
            .field("capacity", &self.inner.capacity)
            .finish_non_exhaustive()
    }
}

/// The default capacity of a [`MemoryStore`]: 256 MiB.
pub(crate) const DEFAULT_MEMORY_CAPACITY: usize = 256 * 1024 * 1024;

/// What a record costs besides its strings and response, for the capacity.
const RECORD_OVERHEAD: usize = 160;

struct Inner {
    hasher: RandomState,
    shards: [Mutex<Shard>; SHARDS],
    /// The bytes the records hold, by the capacity's count.
    bytes: AtomicUsize,
    capacity: usize,
    /// The most bytes one subject's records may hold, whatever room is free.
    share: usize,
    /// Whether the share adapts to what the others hold (otherwise it is `share`, fixed).
    adaptive: bool,
    /// What each subject holds.
    subjects: Subjects,
}

#[derive(Default)]
struct Shard {
    records: HashMap<RecordKey, Record>,
    ops_since_sweep: usize,
    /// Operations before the next sweep: as many as the shard held after the last one (at least
    /// 64), so each sweep's cost is paid for by the operations before it.
    sweep_after: usize,
}

struct Record {
    fingerprint: Fingerprint,
    state: State,
    expires_at: Instant,
    /// What the record counts against the capacity.
    size: usize,
    generation: Generation,
    /// When the key was claimed (kept by a retake), for inspection.
    created_at: SystemTime,
    /// The operation's recovery points, in the order recorded: kept with its generation.
    steps: Vec<RecordedStep>,
}

enum State {
    InProgress {
        lease: LeaseToken,
        since: Instant,
        /// The holder's in-progress TTL: its heartbeat renews on that schedule, so no claimer
        /// presumes it dead sooner, whatever its own TTL.
        ttl: Duration,
    },
    /// Finished by `lease`, so that a repeated completion by the same lease is recognised.
    Finished {
        response: Arc<StoredResponse>,
        lease: LeaseToken,
    },
    /// Released for another try: no one holds it; the next claim takes it at once.
    Released,
}

impl MemoryStore {
    /// An empty store with the default capacity (256 MiB), shared among the subjects present (see
    /// the type's docs).
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty store that holds at most about `bytes` of records, shared among the subjects
    /// present (see the type's docs).
    pub fn with_capacity(bytes: usize) -> Self {
        let mut store = Self::with_capacity_and_share(bytes, bytes);
        if let Some(inner) = Arc::get_mut(&mut store.inner) {
            inner.adaptive = true;
        }
        store
    }

    /// An empty store that holds at most about `bytes` of records, and at most about `share` bytes
    /// for any one subject (the shared anonymous subject included), a fixed share: past it a
    /// subject's new keys are refused (the layer answers `429 idempotency_quota_exceeded`), and the
    /// other subjects are served. A fixed share does not adapt to the subjects present:
    /// `bytes / share` subjects at their share fill the store for the others, where the default
    /// ([`with_capacity`](Self::with_capacity)) keeps room for a subject that comes. With
    /// `share == bytes`, one subject may fill the whole store (a store for one subject alone).
    pub fn with_capacity_and_share(bytes: usize, share: usize) -> Self {
        MemoryStore {
            inner: Arc::new(Inner {
                hasher: RandomState::default(),
                shards: Default::default(),
                bytes: AtomicUsize::new(0),
                capacity: bytes,
                share,
                adaptive: false,
                subjects: Subjects::default(),
            }),
        }
    }

    /// The bytes the records hold now, by the capacity's count.
    pub fn bytes(&self) -> usize {
        self.inner.bytes.load(Ordering::Relaxed)
    }

    /// Whether a subject whose records hold `held` bytes may hold `more`: never past a fixed
    /// share; with the adaptive one, while at least `held` bytes stay free after it (see the
    /// type's docs).
    fn admits(&self, held: usize, more: usize) -> bool {
        let after = held.saturating_add(more);
        if after > self.inner.share {
            return false;
        }
        if !self.inner.adaptive {
            return true;
        }
        self.bytes().saturating_add(more).saturating_add(held) <= self.inner.capacity
    }

    fn add(&self, bytes: usize) {
        self.inner.bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    fn sub(&self, bytes: usize) {
        self.inner.bytes.fetch_sub(bytes, Ordering::Relaxed);
    }

    /// A record of `subject` that held `old` bytes holds `new` now.
    fn resize(&self, subject: &str, old: usize, new: usize) {
        self.sub(old);
        self.add(new);
        self.inner.subjects.sub(subject, 0, old);
        self.inner.subjects.add(subject, 0, new);
    }

    /// How many records the store holds, expired ones not yet swept included.
    pub fn len(&self) -> usize {
        (0..SHARDS).map(|i| self.shard_at(i).records.len()).sum()
    }

    /// True when the store holds no record.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn shard_at(&self, i: usize) -> MutexGuard<'_, Shard> {
        crate::util::lock::lock(&self.inner.shards[i])
    }

    fn shard(&self, key: &RecordKey) -> MutexGuard<'_, Shard> {
        let i = self.inner.hasher.hash_one(key) as usize % SHARDS;
        let mut shard = self.shard_at(i);
        shard.ops_since_sweep += 1;
        if shard.ops_since_sweep > shard.sweep_after.max(64) {
            let freed = shard.sweep(Instant::now(), &self.inner.subjects);
            self.sub(freed.1);
        }
        shard
    }

    /// Sweeps every shard; returns the records removed.
    fn sweep_all(&self, now: Instant) -> u64 {
        (0..SHARDS)
            .map(|i| {
                let (removed, freed) = self.shard_at(i).sweep(now, &self.inner.subjects);
                self.sub(freed);
                removed
            })
            .sum()
    }
}

impl Shard {
    /// Removes the expired records; returns how many, and the bytes they held.
    fn sweep(&mut self, now: Instant, subjects: &Subjects) -> (u64, usize) {
        let before = self.records.len();
        let mut freed = 0;
        self.records.retain(|key, r| {
            let keep = r.expires_at > now;
            if !keep {
                freed += r.size;
                subjects.sub(&key.subject, 1, r.size);
            }
            keep
        });
        self.ops_since_sweep = 0;
        self.sweep_after = self.records.len();
        ((before - self.records.len()) as u64, freed)
    }
}

/// What a claimed record of `key` counts against the capacity.
fn key_size(key: &RecordKey) -> usize {
    RECORD_OVERHEAD + 2 * (key.key.len() + key.subject.len() + key.endpoint.len())
}

/// What a recorded step adds to its record.
fn step_size(step: &RecordedStep) -> usize {
    step.name.len() + step.result.len() + 32
}

/// What a recorded response adds to its record.
fn response_size(response: &StoredResponse) -> usize {
    response.body.len()
        + response
            .headers
            .iter()
            .map(|(n, v)| n.as_str().len() + v.len() + 32)
            .sum::<usize>()
}

impl IdempotencyStore for MemoryStore {
    async fn claim(&self, request: &ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        self.claim_now(request)
    }

    async fn complete(
        &self,
        key: &RecordKey,
        lease: LeaseToken,
        _fingerprint: &Fingerprint,
        response: Arc<StoredResponse>,
        retention: Duration,
    ) -> Result<Fenced, StoreError> {
        let mut shard = self.shard(key);
        match shard.records.get_mut(key) {
            Some(record) if holds(record, lease) => {
                let mut response = response;
                let mut grown = response_size(&response);
                let usage = self.inner.subjects.usage(&key.subject);
                if !response.body_omitted
                    && (!self.admits(usage.bytes, grown)
                        || self.bytes() + grown > self.inner.capacity)
                {
                    // Past the subject's share or the store's capacity: the answer is kept
                    // without its body (replayed as omitted), so no subject fills the store
                    // through the answers of the claims it holds.
                    response = Arc::new(StoredResponse {
                        body: bytes::Bytes::new(),
                        body_omitted: true,
                        ..StoredResponse::clone(&response)
                    });
                    grown = response_size(&response);
                }
                record.state = State::Finished { response, lease };
                record.expires_at = Instant::now() + retention;
                record.size += grown;
                self.add(grown);
                self.inner.subjects.add(&key.subject, 0, grown);
                Ok(Fenced::Done)
            }
            Some(Record {
                state: State::Finished { lease: by, .. },
                ..
            }) => Ok(Fenced::from_held(*by == lease)),
            _ => Ok(Fenced::LeaseLost),
        }
    }

    async fn renew(
        &self,
        key: &RecordKey,
        lease: LeaseToken,
        lifetime: Duration,
    ) -> Result<Fenced, StoreError> {
        let mut shard = self.shard(key);
        match shard.records.get_mut(key) {
            Some(record) if holds(record, lease) => {
                let now = Instant::now();
                if let State::InProgress { since, .. } = &mut record.state {
                    *since = now;
                }
                record.expires_at = now + lifetime;
                Ok(Fenced::Done)
            }
            _ => Ok(Fenced::LeaseLost),
        }
    }

    async fn release(&self, key: &RecordKey, lease: LeaseToken) -> Result<Fenced, StoreError> {
        let mut shard = self.shard(key);
        match shard.records.get_mut(key) {
            Some(record) if holds(record, lease) => {
                // Kept as a tombstone until its expiry, so that the retry keeps the record's
                // generation (and its derived key: a provider the released run called sees one
                // operation).
                record.state = State::Released;
                Ok(Fenced::Done)
            }
            _ => Ok(Fenced::LeaseLost),
        }
    }

    /// Counted against the capacity like an answer, and never refused for room: the step's
    /// effect happened (the engine bounds what one operation records).
    async fn record_step(
        &self,
        key: &RecordKey,
        lease: LeaseToken,
        step: &RecordedStep,
    ) -> Result<Fenced, StoreError> {
        let mut shard = self.shard(key);
        match shard.records.get_mut(key) {
            Some(record) if holds(record, lease) => {
                if record.steps.iter().all(|s| s.name != step.name) {
                    let grown = step_size(step);
                    record.steps.push(step.clone());
                    record.size += grown;
                    self.add(grown);
                    self.inner.subjects.add(&key.subject, 0, grown);
                }
                Ok(Fenced::Done)
            }
            _ => Ok(Fenced::LeaseLost),
        }
    }

    async fn steps(
        &self,
        key: &RecordKey,
        lease: LeaseToken,
    ) -> Result<Option<Vec<RecordedStep>>, StoreError> {
        let shard = self.shard(key);
        Ok(match shard.records.get(key) {
            Some(record) if holds(record, lease) => Some(record.steps.clone()),
            _ => None,
        })
    }

    /// The live record's steps, as [`lookup`](IdempotencyStore::lookup) finds it live.
    async fn recorded_steps(&self, key: &RecordKey) -> Result<Vec<RecordedStep>, StoreError> {
        let now = Instant::now();
        Ok(match self.shard(key).records.get(key) {
            Some(record) if live(record, now) => record.steps.clone(),
            _ => Vec::new(),
        })
    }

    async fn purge_expired(&self) -> Result<u64, StoreError> {
        Ok(self.sweep_all(Instant::now()))
    }

    fn counts_records(&self) -> bool {
        true
    }

    fn operation_timeout(&self) -> Option<Duration> {
        None
    }

    /// The store itself: it has no connection to keep apart, and lives in the process.
    async fn keeper_session(&self) -> Result<Self, StoreError> {
        Ok(self.clone())
    }

    /// Nothing to show: every holder of a memory store lives in its process, whose keeper runs on
    /// a thread of its own, and no other program can lock it.
    async fn show_presences(
        &self,
        _live: &[crate::store::Presence],
        _lapse: Duration,
    ) -> Result<(), StoreError> {
        Ok(())
    }

    /// Exact: the store keeps every subject's count (expired records not yet swept included).
    async fn count_records(
        &self,
        subject: &str,
        up_to: u64,
    ) -> Result<Option<crate::store::SubjectUsage>, StoreError> {
        let usage = self.inner.subjects.usage(subject);
        Ok(Some(crate::store::SubjectUsage {
            records: usage.records.min(up_to),
            bytes: u64::try_from(usage.bytes).unwrap_or(u64::MAX),
        }))
    }

    async fn lookup(&self, key: &RecordKey) -> Result<Option<RecordInfo>, StoreError> {
        let now = Instant::now();
        let wall = SystemTime::now();
        Ok(self
            .shard(key)
            .records
            .get(key)
            .and_then(|record| info(record, now, wall)))
    }

    async fn delete(&self, key: &RecordKey) -> Result<Deleted, StoreError> {
        let now = Instant::now();
        let mut shard = self.shard(key);
        let Some(record) = shard.records.get(key) else {
            return Ok(Deleted::NotFound);
        };
        if record.expires_at <= now {
            return Ok(Deleted::NotFound);
        }
        match record.state {
            State::InProgress { .. } => Ok(Deleted::InProgress),
            State::Released => Ok(Deleted::NotFound),
            State::Finished { .. } => {
                if let Some(removed) = shard.records.remove(key) {
                    self.sub(removed.size);
                    self.inner.subjects.sub(&key.subject, 1, removed.size);
                }
                Ok(Deleted::Deleted)
            }
        }
    }

    async fn list(&self, subject: &str, request: ListRequest) -> Result<RecordPage, StoreError> {
        let (now, wall) = (Instant::now(), SystemTime::now());
        let limit = request.bounded_limit();
        // Every shard is scanned: the store keeps no index by subject. A listing is an operator's
        // or a client's occasional request, and the store is bounded by its capacity.
        let mut found = Vec::new();
        for i in 0..SHARDS {
            let shard = self.shard_at(i);
            for (key, record) in &shard.records {
                if key.subject != subject {
                    continue;
                }
                let Some(info) = info(record, now, wall) else {
                    continue;
                };
                let cursor = ListCursor::new(info.created_at, key.digest());
                if request.after.is_some_and(|after| cursor <= after) {
                    continue;
                }
                found.push(ListedRecord::new(
                    key.key.clone(),
                    key.endpoint.clone(),
                    info,
                    cursor,
                ));
            }
        }
        found.sort_unstable_by_key(|r| r.cursor);
        found.truncate(limit);
        Ok(RecordPage::new(found, limit))
    }
}

/// Whether inspection shows the record: not past its expiry, not released.
fn live(record: &Record, now: Instant) -> bool {
    record.expires_at > now && !matches!(record.state, State::Released)
}

/// A live record as inspection shows it; `None` for one past its expiry or released.
fn info(record: &Record, now: Instant, wall: SystemTime) -> Option<RecordInfo> {
    if !live(record, now) {
        return None;
    }
    let (state, status) = match &record.state {
        State::Released => return None,
        State::InProgress { .. } => (RecordState::InProgress, None),
        State::Finished { response, .. } => (
            RecordState::Finished(response.outcome),
            Some(response.status),
        ),
    };
    Some(RecordInfo::new(
        state,
        status,
        record.created_at,
        wall + record.expires_at.duration_since(now),
    ))
}

fn holds(record: &Record, lease: LeaseToken) -> bool {
    matches!(record.state, State::InProgress { lease: held, .. } if held == lease)
}
