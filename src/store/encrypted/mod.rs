//! Encryption at rest: [`EncryptedStore`] wraps any store, seals what it records with AES-256-GCM
//! (`envelope.rs`, under [`EncryptionKeys`] rotated by id, `keys.rs`) and keeps nothing about the
//! request in clear: the scope and the fingerprint the inner store gets are keyed hashes
//! (`scope.rs`).
//!
//! A recorded response is written to the inner store as its status and outcome in clear (stores
//! need them), no headers, and as body an envelope:
//!
//! | bytes | what |
//! |---|---|
//! | 1 | format, `2` (`1` for records sealed by earlier versions) |
//! | 1 | flags: bit 0 set when the response was recorded without its body |
//! | 4 | key id, big-endian |
//! | 12 | nonce, random |
//! | rest | ciphertext of the headers and the body, then the 16-byte tag |
//!
//! The plaintext is the header count (4 bytes), each header as a 4-byte length and name then a
//! 4-byte length and value, then the body. The associated data binds the ciphertext to its record
//! and its clear fields: a label, the envelope's first 6 bytes (format, flags, key id), the record's
//! scope digest ([`RecordKey::digest`], of the scope as the layer names it), the status, the
//! outcome and the request's fingerprint (the layer's, before keying). A ciphertext copied to
//! another record, or onto a later record of the same scope made by another request, or whose
//! status, outcome or omitted flag was edited, fails to open. Format `1` (not bound to the
//! fingerprint) is opened only for records kept in clear by earlier versions.

mod envelope;
mod keys;
mod scope;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

pub use self::keys::{EncryptionKeys, EncryptionKeysError, KeyId};
use self::scope::ScopeSecret;
use super::{
    ClaimOutcome, ClaimRequest, Deleted, FailedCommit, Fenced, Fingerprint, Generation,
    IdempotencyStore, LeaseToken, ListRequest, RecordInfo, RecordKey, RecordPage, StoreError,
    StoredResponse, TransactionalStore,
};

/// A store that encrypts the responses it records, over any other store (memory, Postgres, Redis
/// or your own).
///
/// ```
/// use axum_idempotency::{IdempotencyLayer, MemoryStore};
/// use axum_idempotency::store::{EncryptedStore, EncryptionKeys};
///
/// # let key_material = [0u8; 32];
/// // Load the key material from your secret store; never hard-code it.
/// let keys = EncryptionKeys::single(1, key_material);
/// // And a secret of 32 bytes that keys every hash the store writes in clear; keep it as stable as
/// // the records (it is not rotated).
/// # let secret = [1u8; 32];
/// let store = EncryptedStore::new(MemoryStore::new(), keys, secret);
/// let layer = IdempotencyLayer::new(store).expect("valid settings");
/// # let _ = layer;
/// ```
///
/// **What is encrypted:** the recorded response's headers and body, with AES-256-GCM under the
/// newest key and a random 96-bit nonce; a response recorded without its body still has its headers
/// sealed. **What is hashed:** everything else about the request, by construction: the inner store
/// keeps keyed hashes (HMAC-SHA-256 under the store's secret) of the idempotency key, the subject,
/// the endpoint and the request's fingerprint, never the originals; a Redis index is named after
/// the subject's hash. So a leaked table holds no key, user id, path or body hash that could be
/// read or brute-forced (an amount alone) without the secret. **What stays in clear:** the status
/// and the outcome (completed or failed), whether the body was omitted, the key id, the lease
/// token, the generation and the times. The ciphertext is bound to its record (its scope) and to
/// its clear fields, so a ciphertext moved to another record, or a record whose status or outcome
/// was edited, does not open.
///
/// **Inspection** looks records up and deletes them by their scope as before; a listing shows each
/// record's state, status and times, with an empty key and endpoint (they are not kept).
///
/// **A record that cannot be opened is not replayed and not run again.** When its key id is not
/// configured any more, or it fails authentication (tampered with, moved from another record, or
/// written without encryption), [`claim`](IdempotencyStore::claim) fails with a
/// [`StoreError::unreadable_record`]: the layer answers `503 idempotency_store_unavailable`, even
/// with `fail_open(true)`, and logs it at error level with the key id. The record says the operation
/// happened, so running the handler again (as for a key never seen) could charge twice; garbage is
/// never replayed either. The key answers `503` until the record's retention passes. Records
/// written before encryption was turned on are unreadable in the same way: turn it on with a new
/// table (or key prefix), or accept `503` for those keys until they expire.
///
/// **Records written in clear** (by versions that kept the scope and plain fingerprints, or before
/// encryption was turned on over a store) are not found under the hashes: turn on
/// [`with_records_in_clear`](Self::with_records_in_clear) for one retention after such a change,
/// and a key claimed anew is first looked up as it was kept in clear. Naming records by hashes
/// cannot be rolled out beside instances that name them in clear (each would miss the other's):
/// stop the old instances before the new ones start.
///
/// **Transactions.** Over a store that has them (the Postgres store), it has them too, so handlers
/// keep their `IdempotencyTx` over an encrypted Postgres store: the record written in the handler's
/// transaction is sealed the same way.
#[derive(Clone)]
pub struct EncryptedStore<S> {
    inner: S,
    keys: Arc<EncryptionKeys>,
    /// The key of every hash written in clear.
    secret: Arc<ScopeSecret>,
    /// Whether records kept in clear by earlier versions are looked for too.
    in_clear: bool,
}

impl<S: IdempotencyStore> EncryptedStore<S> {
    /// The steps the inner store keeps for `key`, each result opened.
    fn opened_steps(
        &self,
        key: &RecordKey,
        sealed: Vec<crate::store::RecordedStep>,
    ) -> Result<Vec<crate::store::RecordedStep>, StoreError> {
        sealed
            .into_iter()
            .map(|step| {
                let result = envelope::open_step(&self.keys, key, &step.name, &step.result)
                    .map_err(envelope::Unreadable::into_store_error)?;
                Ok(crate::store::RecordedStep {
                    name: step.name,
                    result,
                })
            })
            .collect()
    }

    /// A step as the inner store keeps it: its result sealed, bound to the record and the step's
    /// name; the name in clear.
    fn sealed_step(
        &self,
        key: &RecordKey,
        step: &crate::store::RecordedStep,
    ) -> Result<crate::store::RecordedStep, StoreError> {
        Ok(crate::store::RecordedStep {
            name: step.name.clone(),
            result: envelope::seal_step(&self.keys, key, &step.name, &step.result)?,
        })
    }

    /// Seals what `inner` records with `keys`, and keys every hash it writes in clear with
    /// `secret` (32 bytes from your secret store; every instance sharing the records must use the
    /// same one for as long as records live: it is not rotated, and a retry under another secret
    /// finds no record).
    pub fn new(inner: S, keys: EncryptionKeys, secret: [u8; 32]) -> Self {
        EncryptedStore {
            inner,
            keys: Arc::new(keys),
            secret: Arc::new(ScopeSecret::new(secret)),
            in_clear: false,
        }
    }

    /// Also finds the records an earlier version kept in clear (scope and fingerprint as they
    /// came, the response sealed or not bound to the fingerprint): every claim first claims its
    /// scope in clear, with a short TTL (a probe: one more write for each request), and answers
    /// from a record found there (its replay, `409` while it runs, `422` for another body). A
    /// record there whose holder died, or that was released, runs again under its hidden record
    /// with its generation (the same derived key at the provider), as a retake. For a new key the
    /// probe makes a record in clear and lets it go at once: a released row with the key, the
    /// subject, the endpoint and the fingerprint in clear, expired within a second and gone at
    /// the next purge. Lookups and deletes look in clear too; listings and counts (the records
    /// share) do not. Turn it on for one retention after the change, then off.
    pub fn with_records_in_clear(mut self) -> Self {
        self.in_clear = true;
        self
    }

    /// The store the sealed records are written to.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// The keys.
    pub fn keys(&self) -> &EncryptionKeys {
        &self.keys
    }

    /// The scope under which the inner store keeps `key`'s record (each part a keyed hash, 64
    /// hex characters): for an operator who looks for one record in the table or among the Redis
    /// keys. The subject's hash names its listing (`stored_scope(..).subject`).
    pub fn stored_scope(&self, key: &RecordKey) -> RecordKey {
        self.secret.scope(key)
    }

    /// `request` as the inner store gets it: its scope and fingerprint keyed hashes.
    fn hidden(&self, request: &ClaimRequest) -> ClaimRequest {
        ClaimRequest {
            key: self.secret.scope(&request.key),
            fingerprint: self.secret.fingerprint(&request.fingerprint),
            ..request.clone()
        }
    }

    /// A claim's answer, its recorded response opened.
    fn opened(
        &self,
        request: &ClaimRequest,
        outcome: ClaimOutcome,
        format_1: bool,
    ) -> Result<ClaimOutcome, StoreError> {
        match outcome {
            ClaimOutcome::Finished(stored) => {
                match envelope::open(
                    &self.keys,
                    &request.key,
                    &request.fingerprint,
                    &stored,
                    format_1,
                ) {
                    Ok(opened) => Ok(ClaimOutcome::Finished(Arc::new(opened))),
                    Err(unreadable) => Err(unreadable.into_store_error()),
                }
            }
            other => Ok(other),
        }
    }

    /// What a record kept in clear for `request`'s scope says (see
    /// [`with_records_in_clear`](Self::with_records_in_clear)), asked by a claim (a probe) as
    /// earlier versions asked: with the plain fingerprint, then with the keyed one (a store that
    /// kept fingerprints keyed). The probe has a short TTL and retention: a probe that made a record
    /// (none was there) lets it go at once, and one whose answer was lost is stale at once for the
    /// next probe.
    async fn look_in_clear(&self, request: &ClaimRequest) -> Result<InClear, StoreError> {
        for fingerprint in [
            request.fingerprint,
            self.secret.fingerprint(&request.fingerprint),
        ] {
            let probe = ClaimRequest {
                fingerprint,
                lease: LeaseToken::generate(),
                generation: Generation::generate(),
                in_progress_ttl: PROBE_TTL,
                retention: PROBE_RETENTION,
                ..request.clone()
            };
            match self.inner.claim(&probe).await? {
                ClaimOutcome::KeyReuse => continue,
                ClaimOutcome::Claimed { generation, .. }
                    if generation == Some(probe.generation) =>
                {
                    // No record there (or one past its retention, or released by another
                    // request): nothing to answer from.
                    let _ = self.inner.release(&probe.key, probe.lease).await;
                    return Ok(InClear::Nothing);
                }
                // An earlier run of the operation held it: its holder died, or released it.
                ClaimOutcome::Claimed { generation, .. } => {
                    return Ok(InClear::Retake { generation, probe });
                }
                answer => return self.opened(request, answer, true).map(InClear::Answer),
            }
        }
        Ok(InClear::Answer(ClaimOutcome::KeyReuse))
    }
}

/// How long a probe of the records kept in clear holds what it takes, and lives. The TTL is as
/// short as a store takes, so that a record in clear is stale exactly when its own holder's TTL
/// has passed (a claimer waits for the longer of the two), and a probe's own hold is no lock:
/// the hidden record's claim decides who runs.
const PROBE_TTL: Duration = Duration::from_millis(1);
const PROBE_RETENTION: Duration = Duration::from_secs(1);

/// What a look at the records kept in clear found.
enum InClear {
    /// Nothing to answer from: the claim goes to the hidden record.
    Nothing,
    /// Answered from the record in clear (its replay, `409`, `422`).
    Answer(ClaimOutcome),
    /// An earlier run of the operation held the record in clear (its holder died, or it was
    /// released): the operation runs again under its hidden record, with the record's
    /// generation (the same derived key for the provider), as a retake. `probe` holds the record
    /// in clear until the hidden record is claimed, then lets it go.
    Retake {
        generation: Option<Generation>,
        probe: ClaimRequest,
    },
}

impl<S> fmt::Debug for EncryptedStore<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EncryptedStore")
            .field("keys", &self.keys)
            .finish_non_exhaustive()
    }
}

impl<S: IdempotencyStore> IdempotencyStore for EncryptedStore<S> {
    async fn claim(&self, request: &ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        let mut hidden = self.hidden(request);
        let mut found_in_clear = None;
        if self.in_clear {
            match self.look_in_clear(request).await? {
                InClear::Nothing => {}
                InClear::Answer(answer) => return Ok(answer),
                InClear::Retake { generation, probe } => {
                    // The hidden record is made with the operation's generation: a retake.
                    if let Some(generation) = generation {
                        hidden.generation = generation;
                    }
                    found_in_clear = Some((generation, probe));
                }
            }
        }
        let outcome = self.inner.claim(&hidden).await;
        let Some((generation, probe)) = found_in_clear else {
            return self.opened(request, outcome?, false);
        };
        // The record in clear is let go only now that the hidden one is claimed (or known to be
        // held): no moment in which neither is held. Released, it keeps the operation's
        // generation for a retry that finds it.
        let _ = self.inner.release(&probe.key, probe.lease).await;
        match outcome? {
            // A record in clear from before generations were kept: its derived key is the one
            // it had then.
            ClaimOutcome::Claimed { lease, .. } if generation.is_none() => {
                Ok(ClaimOutcome::Claimed {
                    lease,
                    generation: None,
                })
            }
            outcome => self.opened(request, outcome, false),
        }
    }

    async fn complete(
        &self,
        key: &RecordKey,
        lease: LeaseToken,
        fingerprint: &Fingerprint,
        response: Arc<StoredResponse>,
        retention: Duration,
    ) -> Result<Fenced, StoreError> {
        let sealed = Arc::new(envelope::seal(
            &self.keys,
            key,
            Some(fingerprint),
            &response,
        )?);
        self.inner
            .complete(
                &self.secret.scope(key),
                lease,
                &self.secret.fingerprint(fingerprint),
                sealed,
                retention,
            )
            .await
    }

    async fn renew(
        &self,
        key: &RecordKey,
        lease: LeaseToken,
        lifetime: Duration,
    ) -> Result<Fenced, StoreError> {
        self.inner
            .renew(&self.secret.scope(key), lease, lifetime)
            .await
    }

    async fn renew_many(
        &self,
        leases: &[(&RecordKey, LeaseToken)],
        lifetime: Duration,
    ) -> Vec<Result<Fenced, StoreError>> {
        let scopes: Vec<RecordKey> = leases
            .iter()
            .map(|(key, _)| self.secret.scope(key))
            .collect();
        let hidden: Vec<(&RecordKey, LeaseToken)> = scopes
            .iter()
            .zip(leases)
            .map(|(scope, (_, lease))| (scope, *lease))
            .collect();
        self.inner.renew_many(&hidden, lifetime).await
    }

    async fn release(&self, key: &RecordKey, lease: LeaseToken) -> Result<Fenced, StoreError> {
        self.inner.release(&self.secret.scope(key), lease).await
    }

    /// The result sealed, bound to the record and the step's name; the name in clear.
    async fn record_step(
        &self,
        key: &RecordKey,
        lease: LeaseToken,
        step: &crate::store::RecordedStep,
    ) -> Result<Fenced, StoreError> {
        let sealed = self.sealed_step(key, step)?;
        self.inner
            .record_step(&self.secret.scope(key), lease, &sealed)
            .await
    }

    async fn steps(
        &self,
        key: &RecordKey,
        lease: LeaseToken,
    ) -> Result<Option<Vec<crate::store::RecordedStep>>, StoreError> {
        let Some(sealed) = self.inner.steps(&self.secret.scope(key), lease).await? else {
            return Ok(None);
        };
        self.opened_steps(key, sealed).map(Some)
    }

    /// The hidden record's, each result opened; with
    /// [`with_records_in_clear`](Self::with_records_in_clear), those of the record in clear when
    /// the hidden one shows none, as [`lookup`](IdempotencyStore::lookup) looks there when it
    /// finds no hidden record.
    async fn recorded_steps(
        &self,
        key: &RecordKey,
    ) -> Result<Vec<crate::store::RecordedStep>, StoreError> {
        let hidden = self.secret.scope(key);
        let mut sealed = self.inner.recorded_steps(&hidden).await?;
        // The record in clear, only where `lookup` shows it: when there is no hidden record.
        if sealed.is_empty() && self.in_clear && self.inner.lookup(&hidden).await?.is_none() {
            sealed = self.inner.recorded_steps(key).await?;
        }
        self.opened_steps(key, sealed)
    }

    async fn purge_expired(&self) -> Result<u64, StoreError> {
        self.inner.purge_expired().await
    }

    /// State, status and times are kept in clear by the inner store, under the hidden scope (and,
    /// with [`with_records_in_clear`](Self::with_records_in_clear), under the scope in clear).
    async fn lookup(&self, key: &RecordKey) -> Result<Option<RecordInfo>, StoreError> {
        match self.inner.lookup(&self.secret.scope(key)).await? {
            None if self.in_clear => self.inner.lookup(key).await,
            found => Ok(found),
        }
    }

    async fn delete(&self, key: &RecordKey) -> Result<Deleted, StoreError> {
        match self.inner.delete(&self.secret.scope(key)).await? {
            Deleted::NotFound if self.in_clear => self.inner.delete(key).await,
            deleted => Ok(deleted),
        }
    }

    /// The subject's records under the hidden scope, with an empty key and endpoint (neither is
    /// kept).
    async fn list(&self, subject: &str, request: ListRequest) -> Result<RecordPage, StoreError> {
        let mut page = self
            .inner
            .list(&self.secret.subject(subject), request)
            .await?;
        for record in &mut page.records {
            record.key.clear();
            record.endpoint.clear();
        }
        Ok(page)
    }

    async fn count_records(
        &self,
        subject: &str,
        up_to: u64,
    ) -> Result<Option<crate::store::SubjectUsage>, StoreError> {
        self.inner
            .count_records(&self.secret.subject(subject), up_to)
            .await
    }

    fn counts_records(&self) -> bool {
        self.inner.counts_records()
    }

    fn operation_timeout(&self) -> Option<Duration> {
        self.inner.operation_timeout()
    }

    async fn keeper_session(&self) -> Result<Self, StoreError> {
        Ok(EncryptedStore {
            inner: self.inner.keeper_session().await?,
            keys: self.keys.clone(),
            secret: self.secret.clone(),
            in_clear: self.in_clear,
        })
    }

    async fn show_presences(
        &self,
        live: &[crate::store::Presence],
        lapse: Duration,
    ) -> Result<(), StoreError> {
        self.inner.show_presences(live, lapse).await
    }
}

/// A wrapper of a store with transactions has them too: the record written in a handler's
/// transaction is sealed (its scope and fingerprint keyed) as
/// [`complete`](IdempotencyStore::complete) seals it.
impl<S: TransactionalStore> TransactionalStore for EncryptedStore<S> {
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
        let sealed = Arc::new(envelope::seal(
            &self.keys,
            key,
            Some(fingerprint),
            &response,
        )?);
        let steps = steps
            .iter()
            .map(|step| self.sealed_step(key, step))
            .collect::<Result<Vec<_>, StoreError>>()?;
        self.inner
            .complete_in(
                tx,
                &self.secret.scope(key),
                lease,
                &self.secret.fingerprint(fingerprint),
                sealed,
                retention,
                &steps,
            )
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
        self.inner
            .settle_failed_commit(&self.secret.scope(key), lease)
            .await
    }
}

#[cfg(test)]
mod tests;
