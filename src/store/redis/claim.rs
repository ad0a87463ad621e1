//! The claim: one script on the record, then, for a record it made, its filing in the subject's
//! listing index.

use std::sync::Arc;
use std::time::Duration;

use redis::Value;

use super::RedisStore;
use super::codec::{decode, integer, millis};
use crate::store::{ClaimOutcome, ClaimRequest, Generation, StoreError};

impl RedisStore {
    /// See [`IdempotencyStore::claim`](crate::store::IdempotencyStore::claim).
    pub(super) async fn claim_record(
        &self,
        request: &ClaimRequest,
    ) -> Result<ClaimOutcome, StoreError> {
        let started = tokio::time::Instant::now();
        let lease = request.lease;
        let lifetime = request.in_progress_ttl + request.retention;
        let digest = request.key.digest();
        // On one server, the claim script files the record in its subject's index itself, in the
        // same round trip (see `scripts`); on a cluster, the index is on another slot.
        let index = self
            .scope_fields
            .then(|| self.index_key(&request.key.subject));
        let (reply, filed): (Vec<Value>, bool) = self
            .eval_joined(
                "claim",
                &self.scripts.claim,
                &self.record_key(&digest),
                index.as_deref(),
                |cmd| {
                    cmd.arg(&request.fingerprint.as_bytes()[..])
                        .arg(lease.0)
                        .arg(millis(request.in_progress_ttl))
                        .arg(millis(lifetime))
                        .arg(&request.generation.0[..]);
                    if self.scope_fields {
                        cmd.arg(&request.key.key)
                            .arg(&request.key.subject)
                            .arg(&request.key.endpoint)
                            // Read only with the index, `KEYS[2]`.
                            .arg(crate::util::hex::encode(&digest));
                    } else {
                        cmd.arg("").arg("").arg("");
                    }
                },
            )
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
        if filed
            && matches!(tag, b"claimed" | b"retaken")
            && reply.get(2).and_then(integer).is_some()
        {
            // Filed by the script; a fourth element says the filing failed.
            match reply.get(3) {
                None => self.sweep_now_and_then(&request.key.subject),
                Some(_) => {
                    tracing::warn!("an idempotency record was claimed but not filed for listing")
                }
            }
        } else if self.scope_fields
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
            b"claimed" => ClaimOutcome::Claimed { lease, generation },
            b"retaken" => ClaimOutcome::Claimed { lease, generation },
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
}
