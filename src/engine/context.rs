//! [`IdempotencyContext`]: what the work under a claim (a handler, a `RunOnce` closure) knows about
//! the operation it runs.

use std::fmt;
use std::sync::Arc;

use sha2::{Digest, Sha256};

use super::steps::{StepError, StepLog, Steps};
use crate::store::{Fingerprint, Generation, RecordKey, StoreError};
use crate::util::hmac::hmac_sha256;

/// The idempotent operation a guarded handler is running, in its request extensions whenever the
/// layer claimed a record for the request.
///
/// Take it as an extractor (`ctx: IdempotencyContext`, or `Option<IdempotencyContext>` on routes
/// where a key is optional) or read it with `Extension<IdempotencyContext>`.
///
/// Forward [`derived_key`](Self::derived_key) to the providers your handler calls (a payment
/// provider's own `Idempotency-Key`, say): when the handler runs again after its process died (a
/// retake, [`is_retake`](Self::is_retake)), the provider sees the same key and does not charge twice.
#[derive(Clone)]
pub struct IdempotencyContext {
    scope: Arc<RecordKey>,
    fingerprint: Fingerprint,
    retake: bool,
    generation: Option<Generation>,
    secret: Option<Arc<crate::util::secret::Secret>>,
    /// The run's recovery points; none in a context made without a held record (tests).
    steps: Option<Arc<Steps>>,
}

impl IdempotencyContext {
    pub(crate) fn new(
        scope: Arc<RecordKey>,
        fingerprint: Fingerprint,
        retake: bool,
        generation: Option<Generation>,
        secret: Option<Arc<crate::util::secret::Secret>>,
    ) -> Self {
        IdempotencyContext {
            scope,
            fingerprint,
            retake,
            generation,
            secret,
            steps: None,
        }
    }

    /// The run's own transaction has begun: its steps from now on are recorded in it, with its
    /// completion.
    pub(crate) fn transaction_begun(&self) {
        if let Some(steps) = &self.steps {
            steps.transaction_begun();
        }
    }

    /// The steps the run took in its transaction, for the completion written in it; none are
    /// left.
    pub(crate) fn take_transaction_steps(&self) -> Vec<crate::store::RecordedStep> {
        self.steps
            .as_ref()
            .map(|steps| steps.take_in_transaction())
            .unwrap_or_default()
    }

    /// The same context, whose steps go to `log` (the record this run holds).
    pub(super) fn with_steps(mut self, log: impl StepLog + 'static) -> Self {
        let steps: Arc<Steps> = Arc::new(Steps::new(log));
        self.steps = Some(steps);
        self
    }

    /// Runs `f` as the step `name` of this operation, once (a recovery point, SPEC 28): its
    /// result is recorded with the record (as JSON) before this returns it; in a run that took the
    /// record over after its holder died ([`is_retake`](Self::is_retake)), a step the dead run
    /// recorded returns its recorded result without running `f`, so only what is left runs.
    ///
    /// ```no_run
    /// # use axum_idempotency::{IdempotencyContext, StepError};
    /// # async fn reserve() -> Result<u64, std::io::Error> { Ok(1) }
    /// # async fn charge(_: u64) -> Result<String, std::io::Error> { Ok(String::new()) }
    /// async fn checkout(ctx: IdempotencyContext) -> Result<String, StepError<std::io::Error>> {
    ///     let reservation = ctx.step("reserve", || reserve()).await?;
    ///     let charge = ctx.step("charge", || charge(reservation)).await?;
    ///     Ok(charge)
    /// }
    /// ```
    ///
    /// - A step whose `f` fails is not recorded ([`StepError::Failed`]): a later run of the
    ///   operation runs it again.
    /// - Fenced by the lease: a run presumed dead and retaken runs no further step before its
    ///   transaction, and no write of its records anything after the retake
    ///   ([`StepError::LeaseLost`]); it should stop. A step in the transaction goes by the steps
    ///   the run knows: its effects there are fenced by the completion, and roll back.
    /// - Steps of one run go one after another, and do not nest ([`StepError::Concurrent`]);
    ///   names are 1 to 64 bytes without NUL, an operation records at most 16 steps, and a result
    ///   at most 16 KiB of JSON.
    /// - With the run's own transaction ([`IdempotencyTx`](crate::IdempotencyTx),
    ///   [`OnceTransaction`](crate::once::OnceTransaction)): a step taken after its first use is
    ///   recorded in it, with the completion, so the step and the effects it wrote through the
    ///   transaction commit together or not at all (a run that dies before the commit leaves
    ///   neither, and the retake runs the step again). Such a step is for effects in the
    ///   transaction: an external call belongs in a step before it, which is recorded at once.
    /// - Do not cancel a step once its work may have run (a `timeout` around it): it is then not
    ///   recorded, and the next run does the work again.
    /// - A step costs a read of the steps recorded (by the lease: a run whose record was retaken
    ///   learns it there, before the work runs) and, when it runs, one write; a write the store
    ///   fails is tried again until it is taken, the lease is lost, or the maximum hold. Every store of the crate keeps steps;
    ///   on a store that keeps none (one of your own that does not implement
    ///   [`record_step`](crate::store::IdempotencyStore::record_step)), a step fails
    ///   ([`StepError::Store`]) before its work runs.
    ///
    /// What steps do not give: an effect whose call was cut after the provider acted and before
    /// its step was recorded (the process died in between) runs again on the retake. Forward
    /// [`derived_key`](Self::derived_key) to a provider that deduplicates for that.
    pub async fn step<T, E, F, Fut>(&self, name: &str, f: F) -> Result<T, StepError<E>>
    where
        T: serde::Serialize + serde::de::DeserializeOwned,
        F: FnOnce() -> Fut,
        Fut: std::future::Future<Output = Result<T, E>>,
    {
        match &self.steps {
            Some(steps) => steps.step(name, f).await,
            None => Err(StepError::Store(StoreError::msg(
                "this context holds no record to keep steps in",
            ))),
        }
    }

    /// The record's generation (see [`Generation`]); `None` for a record written before
    /// generations were kept.
    pub fn generation(&self) -> Option<Generation> {
        self.generation
    }

    /// The `Idempotency-Key` of the request, as validated (trimmed, unquoted).
    pub fn key(&self) -> &str {
        &self.scope.key
    }

    /// The authenticated subject; empty in the shared anonymous scope.
    pub fn subject(&self) -> &str {
        &self.scope.subject
    }

    /// The endpoint part of the scope, e.g. `POST /checkout`.
    pub fn endpoint(&self) -> &str {
        &self.scope.endpoint
    }

    /// True when an earlier run of this operation held its record: one whose process stopped
    /// renewing it (presumably died), or one that was released (it answered a retryable failure,
    /// returned an error or panicked) and is retried with the same request. Its effect may have
    /// been started before: use [`derived_key`](Self::derived_key) downstream so that it is not
    /// repeated. False for a record this run's claim made (a new key, a key past its retention).
    /// The same rule on every store: an earlier run's record keeps its [`Generation`].
    pub fn is_retake(&self) -> bool {
        self.retake
    }

    /// A key for downstream providers (a payment provider's own `Idempotency-Key`, say): 64
    /// lower-case hex characters naming this one operation.
    ///
    /// **Stable across** every run of this operation: retakes after its process died (the same
    /// record, so the same [`Generation`]), every instance, restarts. So a provider that
    /// deduplicates by it does not repeat an effect a dead run started.
    ///
    /// **Different** whenever any of these differs: the key, the subject, the endpoint, the request
    /// fingerprint, the record's generation (a key claimed again after its retention, or after its
    /// record was deleted, is a new operation, even with the same body, so a provider that
    /// remembers keys longer than this layer does not answer it with the old charge), and the
    /// deployment secret ([`derived_key_secret`](crate::IdempotencyLayerBuilder::derived_key_secret):
    /// two deployments sharing a provider account do not collide).
    ///
    /// It is SHA-256 (HMAC-SHA-256 under the deployment secret, when one is set) of the scope's
    /// digest, the fingerprint and the generation under a fixed label: whoever receives it learns
    /// nothing of them. A record written before generations were kept (an older version of this
    /// crate, retaken after the upgrade) has no generation and keeps the key it had then, so its
    /// retake still matches its first run at the provider.
    pub fn derived_key(&self) -> String {
        let scope = self.scope.digest();
        let (label, generation): (&[u8], &[u8]) = match &self.generation {
            Some(generation) => (b"axum-idempotency derived key v2\0", &generation.0),
            None => (b"axum-idempotency derived key v1\0", &[]),
        };
        let parts: [&[u8]; 4] = [label, &scope, self.fingerprint.as_bytes(), generation];
        // A record without generation was written by an earlier version, which knew no secret:
        // its retake keeps the key that version gave it, whatever the secret now.
        let digest = match &self.secret {
            Some(secret) if self.generation.is_some() => hmac_sha256(secret.bytes(), &parts),
            _ => {
                let mut hasher = Sha256::new();
                for part in parts {
                    hasher.update(part);
                }
                hasher.finalize().into()
            }
        };
        crate::util::hex::encode(&digest)
    }
}

impl fmt::Debug for IdempotencyContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The key is a client secret of sorts, and the subject and the endpoint personal data:
        // none of them goes to logs through this.
        f.debug_struct("IdempotencyContext")
            .field("retake", &self.retake)
            .field("generation", &self.generation)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn context(generation: Option<Generation>, secret: Option<&[u8]>) -> IdempotencyContext {
        IdempotencyContext::new(
            Arc::new(RecordKey {
                key: "order-1".into(),
                subject: "alice".into(),
                endpoint: "POST /checkout".into(),
            }),
            Fingerprint::of(None, br#"{"amount":100}"#),
            false,
            generation,
            secret.map(|s| Arc::new(crate::util::secret::Secret::new(s))),
        )
    }

    #[test]
    fn derived_keys_name_one_operation() {
        let (g1, g2) = (Generation([1; 16]), Generation([2; 16]));
        let key = context(Some(g1), None).derived_key();
        assert_eq!(key.len(), 64);
        assert_eq!(key, context(Some(g1), None).derived_key(), "stable");
        assert_ne!(
            key,
            context(Some(g2), None).derived_key(),
            "another generation"
        );
        assert_ne!(key, context(None, None).derived_key());
        let a = context(Some(g1), Some(b"production-secret-0001")).derived_key();
        let b = context(Some(g1), Some(b"staging-secret-00000001")).derived_key();
        assert_ne!(a, b, "another deployment secret");
        assert_ne!(a, key);
    }

    #[test]
    fn a_record_without_generation_keeps_the_key_of_earlier_versions() {
        // The formula of version 0.1 (label v1, scope digest, fingerprint), pinned.
        let ctx = context(None, None);
        let mut hasher = Sha256::new();
        hasher.update(b"axum-idempotency derived key v1\0");
        hasher.update(ctx.scope.digest());
        hasher.update(ctx.fingerprint.as_bytes());
        let expected: String = hasher
            .finalize()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(ctx.derived_key(), expected);
    }
}
