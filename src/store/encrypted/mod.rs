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
    /// came, the response sealed or not bound to the fingerprint): every claim first looks its
    /// scope up in clear (one more read for each request) and answers from a record found there
    /// (its replay, `409` while it runs, `422` for another body); a record there whose holder died
    /// is retaken, and the operation runs again under its hidden record, as a retake. Lookups and
    /// deletes look there too. Turn it on for one retention after the change, then off.
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

    /// The answer of a record kept in clear for `request`'s scope, if there is one (see
    /// [`with_records_in_clear`](Self::with_records_in_clear)). A record in clear whose holder
    /// died is retaken and released at once (it is then found no more), answered as `Claimed`
    /// with its generation: the operation runs again under its hidden record, as a retake. A
    /// record looked for in clear is never written in clear for good: a released record is not
    /// found again.
    async fn answer_in_clear(
        &self,
        request: &ClaimRequest,
    ) -> Result<Option<ClaimOutcome>, StoreError> {
        if self.inner.lookup(&request.key).await?.is_none() {
            return Ok(None);
        }
        // Its answer is read by a claim, as earlier versions asked for it: with the plain
        // fingerprint, then with the keyed one (a store that kept fingerprints keyed).
        for fingerprint in [
            request.fingerprint,
            self.secret.fingerprint(&request.fingerprint),
        ] {
            let asked = ClaimRequest {
                fingerprint,
                lease: LeaseToken::generate(),
                generation: Generation::generate(),
                ..request.clone()
            };
            match self.inner.claim(&asked).await? {
                ClaimOutcome::KeyReuse => continue,
                ClaimOutcome::Claimed { generation, .. } => {
                    // Not answered in clear: it vanished meanwhile (expired or deleted), or its
                    // holder died and the operation runs again under the hidden record.
                    let _ = self.inner.release(&asked.key, asked.lease).await;
                    if generation == Some(asked.generation) {
                        return Ok(None);
                    }
                    return Ok(Some(ClaimOutcome::Claimed {
                        lease: asked.lease,
                        generation,
                    }));
                }
                answer => return self.opened(request, answer, true).map(Some),
            }
        }
        Ok(Some(ClaimOutcome::KeyReuse))
    }
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
        let clear_retake = if self.in_clear {
            match self.answer_in_clear(request).await? {
                None => None,
                Some(ClaimOutcome::Claimed { generation, .. }) => Some(generation),
                Some(answer) => return Ok(answer),
            }
        } else {
            None
        };
        let outcome = self.inner.claim(&self.hidden(request)).await?;
        match (outcome, clear_retake) {
            // The record in clear was retaken from a holder that died: an earlier run held the
            // operation, so this run is a retake.
            (ClaimOutcome::Claimed { lease, .. }, Some(generation)) => {
                Ok(ClaimOutcome::Claimed { lease, generation })
            }
            (outcome, _) => self.opened(request, outcome, false),
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

    async fn count_records(&self, subject: &str, up_to: u64) -> Result<Option<u64>, StoreError> {
        self.inner
            .count_records(&self.secret.subject(subject), up_to)
            .await
    }

    fn operation_timeout(&self) -> Option<Duration> {
        self.inner.operation_timeout()
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
    ) -> Result<Fenced, StoreError> {
        let sealed = Arc::new(envelope::seal(
            &self.keys,
            key,
            Some(fingerprint),
            &response,
        )?);
        self.inner
            .complete_in(
                tx,
                &self.secret.scope(key),
                lease,
                &self.secret.fingerprint(fingerprint),
                sealed,
                retention,
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
