//! The in-memory store: the embedded default, for one process.

use std::collections::HashMap;
use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::{IdempotencyStore, StoreError};
use crate::Fingerprint;
use crate::record::{ClaimOutcome, ClaimRequest, LeaseToken, RecordKey, StoredResponse};

const SHARDS: usize = 16;

/// Records in this process's memory, in 16 independently locked shards.
///
/// Claims are atomic within the process; records do not survive a restart and are not shared between
/// instances (use the Postgres store for that). Expired records are swept out of a shard after as many
/// operations on it as it holds records, so memory stays bounded by what retention keeps alive, at a
/// constant amortised cost per request; [`IdempotencyStore::purge_expired`] sweeps everything at once.
#[derive(Clone, Default)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

#[derive(Default)]
struct Inner {
    hasher: RandomState,
    shards: [Mutex<Shard>; SHARDS],
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
}

enum State {
    InProgress {
        lease: LeaseToken,
        since: Instant,
    },
    /// Finished by `lease`, so that a repeated completion by the same lease is recognised.
    Finished {
        response: Arc<StoredResponse>,
        lease: LeaseToken,
    },
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
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
        // A panic while a shard is locked cannot leave a record half-written (every change is one
        // map operation), so a poisoned lock is safe to keep using.
        self.inner.shards[i]
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn shard(&self, key: &RecordKey) -> MutexGuard<'_, Shard> {
        let i = self.inner.hasher.hash_one(key) as usize % SHARDS;
        let mut shard = self.shard_at(i);
        shard.ops_since_sweep += 1;
        if shard.ops_since_sweep > shard.sweep_after.max(64) {
            shard.sweep(Instant::now());
        }
        shard
    }
}

impl Shard {
    fn sweep(&mut self, now: Instant) -> u64 {
        let before = self.records.len();
        self.records.retain(|_, r| r.expires_at > now);
        self.ops_since_sweep = 0;
        self.sweep_after = self.records.len();
        (before - self.records.len()) as u64
    }
}

impl IdempotencyStore for MemoryStore {
    async fn claim(&self, request: &ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        let now = Instant::now();
        let mut shard = self.shard(&request.key);
        let lease = request.lease;
        let fresh = || Record {
            fingerprint: request.fingerprint,
            state: State::InProgress { lease, since: now },
            expires_at: now + request.in_progress_ttl + request.retention,
        };
        // Look up before inserting, so that replays and 409s never copy the key.
        if let Some(record) = shard.records.get_mut(&request.key) {
            if record.expires_at <= now {
                // Past retention: the key is new again. An in-progress record that expired was
                // abandoned by its holder: its effect may have started, so this is a retake.
                let retaken = matches!(record.state, State::InProgress { .. });
                *record = fresh();
                return Ok(ClaimOutcome::Claimed { lease, retaken });
            }
            if record.fingerprint != request.fingerprint {
                return Ok(ClaimOutcome::FingerprintMismatch);
            }
            return Ok(match &record.state {
                State::Finished { response, .. } => ClaimOutcome::Finished(response.clone()),
                // This claim's own record: the same claim, made twice.
                State::InProgress { lease: held, .. } if *held == lease => ClaimOutcome::Claimed {
                    lease,
                    retaken: false,
                },
                State::InProgress { since, .. }
                    if now.duration_since(*since) < request.in_progress_ttl =>
                {
                    ClaimOutcome::InProgress
                }
                State::InProgress { .. } => {
                    // The shard lock makes this compare-and-swap atomic.
                    *record = fresh();
                    ClaimOutcome::Claimed {
                        lease,
                        retaken: true,
                    }
                }
            });
        }
        shard.records.insert(request.key.clone(), fresh());
        Ok(ClaimOutcome::Claimed {
            lease,
            retaken: false,
        })
    }

    async fn complete(
        &self,
        key: &RecordKey,
        lease: LeaseToken,
        response: Arc<StoredResponse>,
        retention: Duration,
    ) -> Result<bool, StoreError> {
        let mut shard = self.shard(key);
        match shard.records.get_mut(key) {
            Some(record) if holds(record, lease) => {
                record.state = State::Finished { response, lease };
                record.expires_at = Instant::now() + retention;
                Ok(true)
            }
            Some(Record {
                state: State::Finished { lease: by, .. },
                ..
            }) => Ok(*by == lease),
            _ => Ok(false),
        }
    }

    async fn renew(
        &self,
        key: &RecordKey,
        lease: LeaseToken,
        lifetime: Duration,
    ) -> Result<bool, StoreError> {
        let mut shard = self.shard(key);
        match shard.records.get_mut(key) {
            Some(record) if holds(record, lease) => {
                let now = Instant::now();
                record.state = State::InProgress { lease, since: now };
                record.expires_at = now + lifetime;
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    async fn release(&self, key: &RecordKey, lease: LeaseToken) -> Result<bool, StoreError> {
        let mut shard = self.shard(key);
        match shard.records.get(key) {
            Some(record) if holds(record, lease) => {
                shard.records.remove(key);
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    async fn purge_expired(&self) -> Result<u64, StoreError> {
        let now = Instant::now();
        Ok((0..SHARDS).map(|i| self.shard_at(i).sweep(now)).sum())
    }
}

fn holds(record: &Record, lease: LeaseToken) -> bool {
    matches!(record.state, State::InProgress { lease: held, .. } if held == lease)
}
