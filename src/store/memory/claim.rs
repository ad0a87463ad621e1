//! The memory store's claim: one lock of the key's shard, nothing in it waits.

use std::sync::Arc;
use std::time::{Instant, SystemTime};

use super::{MemoryStore, Record, State, key_size};
use crate::store::{ClaimOutcome, ClaimRequest, StoreError, StoredResponse};

impl MemoryStore {
    /// The claim; nothing in it waits.
    pub(super) fn claim_now(&self, request: &ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        let now = Instant::now();
        let mut shard = self.shard(&request.key);
        let lease = request.lease;
        let size = key_size(&request.key);
        let fresh = || Record {
            fingerprint: request.fingerprint,
            state: State::InProgress {
                lease,
                since: now,
                ttl: request.in_progress_ttl,
            },
            expires_at: now + request.in_progress_ttl + request.retention,
            size,
            generation: request.generation,
            created_at: SystemTime::now(),
            steps: Vec::new(),
        };
        let generation = Some(request.generation);
        // Look up before inserting, so that replays and 409s never copy the key.
        if let Some(record) = shard.records.get_mut(&request.key) {
            if record.expires_at <= now {
                // Past retention: the key is new again, a new operation with a generation of its
                // own, as in every store (Redis and a purge delete expired records).
                let old = std::mem::replace(record, fresh());
                self.resize(&request.key.subject, old.size, size);
                return Ok(ClaimOutcome::Claimed {
                    lease,
                    generation: Some(record.generation),
                });
            }
            if let State::Released = record.state {
                // Released for another try: the same request is the same operation again (its
                // generation, so the same derived key); another request is a new one.
                let same = record.fingerprint == request.fingerprint;
                let kept = record.generation;
                let old = std::mem::replace(record, fresh());
                if same {
                    // The same operation: its recovery points too.
                    record.generation = kept;
                    record.size += old.steps.iter().map(super::step_size).sum::<usize>();
                    record.steps = old.steps;
                }
                self.resize(&request.key.subject, old.size, record.size);
                return Ok(ClaimOutcome::Claimed {
                    lease,
                    generation: Some(record.generation),
                });
            }
            if record.fingerprint != request.fingerprint {
                return Ok(ClaimOutcome::KeyReuse);
            }
            return Ok(match &record.state {
                State::Released => ClaimOutcome::InProgress, // handled above
                // With the time it has left, which dates the replay's expiry header.
                State::Finished { response, .. } => {
                    ClaimOutcome::Finished(Arc::new(StoredResponse {
                        expires_in: Some(record.expires_at.duration_since(now)),
                        ..StoredResponse::clone(response)
                    }))
                }
                // This claim's own record: the same claim, made twice.
                State::InProgress { lease: held, .. } if *held == lease => ClaimOutcome::Claimed {
                    lease,
                    generation: Some(record.generation),
                },
                State::InProgress { since, ttl, .. }
                    if now.duration_since(*since) < request.in_progress_ttl.max(*ttl) =>
                {
                    ClaimOutcome::InProgress
                }
                State::InProgress { .. } => {
                    // The shard lock makes this compare-and-swap atomic. The operation is the same
                    // one: the retake keeps its generation.
                    let kept = record.generation;
                    let old = std::mem::replace(record, fresh());
                    record.generation = kept;
                    record.created_at = old.created_at;
                    // The steps the dead holder recorded are what the retake resumes from.
                    record.size += old.steps.iter().map(super::step_size).sum::<usize>();
                    record.steps = old.steps;
                    self.resize(&request.key.subject, old.size, record.size);
                    ClaimOutcome::Claimed {
                        lease,
                        generation: Some(kept),
                    }
                }
            });
        }
        if self.bytes() + size > self.inner.capacity {
            // Full: make room from expired records only, everywhere, then refuse if still full.
            drop(shard);
            self.sweep_all(now);
            if self.bytes() + size > self.inner.capacity {
                return Err(StoreError::store_full(format!(
                    "the memory store is full ({} of {} bytes); no live record is evicted",
                    self.bytes(),
                    self.inner.capacity
                )));
            }
            shard = self.shard(&request.key);
            // Claimed by someone else while the shard was unlocked: answer as the store now is.
            if shard.records.contains_key(&request.key) {
                drop(shard);
                return self.claim_now(request);
            }
        }
        let usage = self.inner.subjects.usage(&request.key.subject);
        if !self.admits(usage.bytes, size) {
            return Err(StoreError::quota_exceeded(format!(
                "this subject's records hold {} bytes, its share of the memory store",
                usage.bytes
            )));
        }
        self.add(size);
        self.inner.subjects.add(&request.key.subject, 1, size);
        shard.records.insert(request.key.clone(), fresh());
        Ok(ClaimOutcome::Claimed { lease, generation })
    }
}
