//! Encryption at rest of recorded responses: [`EncryptedStore`] wraps any store and seals what it
//! records with AES-256-GCM.
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
//! scope digest ([`RecordKey::digest`]), the status, the outcome and the request's fingerprint (the
//! layer's, before any keying). A ciphertext copied to another record, or onto a later record of the
//! same scope made by another request, or whose status, outcome or omitted flag was edited, fails to
//! open.
//!
//! Format `1`, written before the fingerprint was bound, is still opened (its associated data
//! lacks the fingerprint), so records sealed before an upgrade replay for the rest of their
//! retention; every record sealed now is format `2`.

use crate::store::Fenced;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use aes_gcm::aead::{AeadInPlace, KeyInit};
use aes_gcm::{Aes256Gcm, Nonce, Tag};
use bytes::Bytes;
use http::{HeaderName, HeaderValue};

use super::{FailedCommit, IdempotencyStore, StoreError, TransactionalStore, header_list};
use crate::store::Fingerprint;
use crate::store::{ClaimOutcome, ClaimRequest, Finished, LeaseToken, RecordKey, StoredResponse};

/// The id of an encryption key: a `u32` chosen by the application (a counter, or the date the key
/// was made as `20260301`). It is stored in clear in every sealed record, in 4 bytes, and names the
/// key that opens it; ids must be unique within one [`EncryptionKeys`], and an id must never be
/// reused for other key material while records sealed under it may still be read.
pub type KeyId = u32;

/// Sealed by earlier versions: the associated data does not bind the fingerprint.
const FORMAT_V1: u8 = 1;
/// The associated data binds the request's fingerprint.
const FORMAT_V2: u8 = 2;
const FLAG_BODY_OMITTED: u8 = 1;
const NONCE_LEN: usize = 12;
/// Format, flags, key id, nonce.
const HEAD_LEN: usize = 1 + 1 + 4 + NONCE_LEN;
const TAG_LEN: usize = 16;
/// Labels the associated data, so a ciphertext made for anything else never opens as a record.
const AAD_LABEL_V1: &[u8] = b"axum-idempotency sealed response v1\0";
const AAD_LABEL_V2: &[u8] = b"axum-idempotency sealed response v2\0";

/// The keys an [`EncryptedStore`] seals and opens records with: the newest seals every new record,
/// all of them open the records they sealed.
///
/// Key material never appears in `Debug` output (only the key ids do).
///
/// ```
/// use axum_idempotency::store::EncryptionKeys;
///
/// // Key 2 is the newest: it seals new records. Key 1 still opens the records it sealed.
/// let keys = EncryptionKeys::new([(2, [7u8; 32]), (1, [9u8; 32])]).expect("valid keys");
/// assert_eq!(keys.newest(), 2);
/// assert_eq!(format!("{keys:?}"), "EncryptionKeys { newest: 2, ids: [2, 1] }");
/// ```
///
/// **Rotation.** Put the new key first and keep the old ones after it: new records are sealed under
/// the new key and old ones still open. Once the retention of the layer has passed since the
/// rotation (no record sealed under an old key is still replayed), drop the old key. A record whose
/// key is no longer configured cannot be read: the layer answers
/// `503 idempotency_store_unavailable` for it until it expires (see [`EncryptedStore`]).
///
/// Nonces are random (96 bits): seal at most 2³² records under one key, as NIST SP 800-38D advises,
/// and rotate long before.
pub struct EncryptionKeys {
    /// Newest first.
    keys: Vec<(KeyId, Aes256Gcm)>,
}

impl EncryptionKeys {
    /// Keys from `(id, 32 bytes of key material)` pairs, the newest (the one that seals) first.
    /// Fails when there is no key or when an id is given twice.
    pub fn new(
        keys: impl IntoIterator<Item = (KeyId, [u8; 32])>,
    ) -> Result<Self, EncryptionKeysError> {
        let mut out: Vec<(KeyId, Aes256Gcm)> = Vec::new();
        for (id, mut material) in keys {
            if out.iter().any(|(known, _)| *known == id) {
                zeroize::Zeroize::zeroize(&mut material);
                return Err(EncryptionKeysError::DuplicateId(id));
            }
            out.push((id, Aes256Gcm::new(&material.into())));
            // The cipher holds its own (zeroized on drop) key schedule; this copy goes now.
            zeroize::Zeroize::zeroize(&mut material);
        }
        if out.is_empty() {
            return Err(EncryptionKeysError::Empty);
        }
        Ok(EncryptionKeys { keys: out })
    }

    /// One key, which seals and opens every record.
    pub fn single(id: KeyId, mut key: [u8; 32]) -> Self {
        let keys = vec![(id, Aes256Gcm::new(&key.into()))];
        zeroize::Zeroize::zeroize(&mut key);
        EncryptionKeys { keys }
    }

    /// The id of the key that seals new records.
    pub fn newest(&self) -> KeyId {
        self.keys[0].0
    }

    /// The ids of every configured key, newest first.
    pub fn ids(&self) -> impl Iterator<Item = KeyId> + '_ {
        self.keys.iter().map(|(id, _)| *id)
    }

    fn sealing(&self) -> (KeyId, &Aes256Gcm) {
        let (id, cipher) = &self.keys[0];
        (*id, cipher)
    }

    fn get(&self, id: KeyId) -> Option<&Aes256Gcm> {
        self.keys
            .iter()
            .find(|(known, _)| *known == id)
            .map(|(_, cipher)| cipher)
    }
}

impl fmt::Debug for EncryptionKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EncryptionKeys")
            .field("newest", &self.newest())
            .field("ids", &self.ids().collect::<Vec<_>>())
            .finish()
    }
}

/// Why [`EncryptionKeys::new`] refused its keys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EncryptionKeysError {
    /// No key was given.
    Empty,
    /// This key id was given twice.
    DuplicateId(KeyId),
}

impl fmt::Display for EncryptionKeysError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EncryptionKeysError::Empty => f.write_str("no encryption key was given"),
            EncryptionKeysError::DuplicateId(id) => {
                write!(f, "the encryption key id {id} was given twice")
            }
        }
    }
}

impl std::error::Error for EncryptionKeysError {}

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
/// let layer = IdempotencyLayer::new(EncryptedStore::new(MemoryStore::new(), keys)).expect("valid settings");
/// # let _ = layer;
/// ```
///
/// **What is encrypted:** the recorded response's headers and body, with AES-256-GCM under the
/// newest key and a random 96-bit nonce; a response recorded without its body still has its headers
/// sealed. **What stays in clear:** the status and the outcome (completed or failed), whether the
/// body was omitted, the key id, and everything the inner store keeps to find and fence records:
/// the scope digest, the idempotency key, the subject, the endpoint, the request fingerprint, the
/// lease token and the times. The fingerprint is a plain SHA-256 of the canonical body unless a
/// fingerprint secret is set ([`with_fingerprint_secret`](Self::with_fingerprint_secret)): without
/// it, a leaked table lets low-entropy bodies (an amount alone) be recovered by brute force. The ciphertext is bound to its record (its scope
/// digest) and to its clear fields, so a ciphertext moved to another record, or a record whose
/// status or outcome was edited, does not open.
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
/// **Transactions.** Over a store that has them (the Postgres store), it has them too, so handlers
/// keep their `IdempotencyTx` over an encrypted Postgres store: the record written in the handler's
/// transaction is sealed the same way.
#[derive(Clone)]
pub struct EncryptedStore<S> {
    inner: S,
    keys: Arc<EncryptionKeys>,
    /// The key of keyed fingerprints, if set.
    fingerprints: Option<Arc<FingerprintSecret>>,
    /// Seal in format 1, which earlier versions open (a rolling upgrade's first step).
    seal_format_1: bool,
    /// Open format 1 records (sealed by earlier versions, or under `seal_format_1`).
    open_format_1: bool,
}

/// The secret of keyed fingerprints, wiped when dropped.
struct FingerprintSecret([u8; 32]);

impl Drop for FingerprintSecret {
    fn drop(&mut self) {
        zeroize::Zeroize::zeroize(&mut self.0);
    }
}

impl<S: IdempotencyStore> EncryptedStore<S> {
    /// Seals what `inner` records with `keys`.
    pub fn new(inner: S, keys: EncryptionKeys) -> Self {
        EncryptedStore {
            inner,
            keys: Arc::new(keys),
            fingerprints: None,
            seal_format_1: false,
            open_format_1: true,
        }
    }

    /// Seals as versions before the fingerprint was bound did (format 1: bound to the record's
    /// scope and clear fields, not to the request's fingerprint), so that they can open what this
    /// one seals. Earlier versions answer `503` to a record in format 2 until it expires, so a
    /// rolling upgrade (or one you may roll back) goes in two steps: deploy with this set, then,
    /// once no instance of an earlier version is left, deploy without it.
    pub fn with_format_1_sealing(mut self) -> Self {
        self.seal_format_1 = true;
        self
    }

    /// Refuses to open records in format 1 (answered `503`, as any record that does not open).
    /// Format 1 does not bind the request's fingerprint, so someone with write access who kept a
    /// format 1 ciphertext could move it onto a later record of its scope made by another request.
    /// Set it once every instance has sealed in format 2 for a whole retention: no legitimate
    /// format 1 record is left then. It overrides
    /// [`with_format_1_sealing`](Self::with_format_1_sealing): this store then seals format 2.
    pub fn refuse_format_1(mut self) -> Self {
        self.open_format_1 = false;
        self
    }

    /// Keeps request fingerprints keyed: the inner store gets HMAC-SHA-256 of each fingerprint
    /// under `secret` instead of the plain SHA-256 of the canonical body, so a leaked table or dump
    /// cannot be brute-forced for low-entropy bodies (an amount alone). Unlike the encryption keys,
    /// this secret is **not rotated**: every instance must use the same one for as long as records
    /// live, or a retry's fingerprint differs from its record's (`422`).
    ///
    /// Records written before it was set keep their plain fingerprints and keep working: a claim
    /// whose keyed fingerprint does not match is asked again with the plain one, so a retry of an
    /// older record still gets its replay (or `409`). Turn it on on every instance at once (an
    /// instance without it sends plain fingerprints, which a keyed record answers `422`), and
    /// know that a record released before it was set is taken by its retry as another request
    /// (a new generation, so a new derived key for that one retry). A plain fingerprint can still
    /// be written in a race (the record was released between the two claims); after a retention
    /// without such races, none is left.
    pub fn with_fingerprint_secret(mut self, mut secret: [u8; 32]) -> Self {
        self.fingerprints = Some(Arc::new(FingerprintSecret(secret)));
        zeroize::Zeroize::zeroize(&mut secret);
        self
    }

    /// The fingerprint the inner store gets for `request`.
    fn keyed(&self, fingerprint: &Fingerprint) -> Option<Fingerprint> {
        let secret = self.fingerprints.as_ref()?;
        let mac = crate::util::hmac::hmac_sha256(
            &secret.0,
            &[
                b"axum-idempotency keyed fingerprint v1\0",
                fingerprint.as_bytes(),
            ],
        );
        Some(Fingerprint::of_material(&mac))
    }

    /// The store the sealed records are written to.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// The keys.
    pub fn keys(&self) -> &EncryptionKeys {
        &self.keys
    }

    /// `response` as written to the inner store: status and outcome in clear, no headers, the
    /// envelope as body.
    fn seal(
        &self,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        response: &StoredResponse,
    ) -> Result<StoredResponse, StoreError> {
        // Refusing format 1 wins: a store never seals what it would refuse to open.
        let bound = (!self.seal_format_1 || !self.open_format_1).then_some(fingerprint);
        self.seal_as(key, bound, response)
    }

    /// Seals in format 2 binding `fingerprint`, or (`None`, as earlier versions did) in format 1.
    fn seal_as(
        &self,
        key: &RecordKey,
        fingerprint: Option<&Fingerprint>,
        response: &StoredResponse,
    ) -> Result<StoredResponse, StoreError> {
        let (key_id, cipher) = self.keys.sealing();
        let too_large = || StoreError::msg("encrypt: the response is too large to seal");
        let mut out = Vec::with_capacity(
            HEAD_LEN
                + 4
                + response
                    .headers
                    .iter()
                    .map(|(n, v)| 8 + n.as_str().len() + v.len())
                    .sum::<usize>()
                + response.body.len()
                + TAG_LEN,
        );
        out.push(if fingerprint.is_some() {
            FORMAT_V2
        } else {
            FORMAT_V1
        });
        out.push(if response.body_omitted {
            FLAG_BODY_OMITTED
        } else {
            0
        });
        out.extend_from_slice(&key_id.to_be_bytes());
        let mut nonce = [0u8; NONCE_LEN];
        getrandom::fill(&mut nonce)
            .map_err(|e| StoreError::msg(format!("encrypt: no randomness for the nonce: {e}")))?;
        out.extend_from_slice(&nonce);
        header_list::write(&response.headers, &mut out).ok_or_else(too_large)?;
        if !response.body_omitted {
            out.extend_from_slice(&response.body);
        }
        let aad = associated_data(
            &out[..6],
            key,
            response.status,
            response.outcome,
            fingerprint,
        );
        let tag = cipher
            .encrypt_in_place_detached(Nonce::from_slice(&nonce), &aad, &mut out[HEAD_LEN..])
            .map_err(|_| too_large())?;
        out.extend_from_slice(&tag);
        Ok(StoredResponse {
            headers: Vec::new(),
            body: Bytes::from(out),
            body_omitted: false,
            ..response.clone()
        })
    }

    /// The response a sealed record holds.
    fn open(
        &self,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        stored: &StoredResponse,
    ) -> Result<StoredResponse, Unreadable> {
        let fail = |key_id, reason| Unreadable { key_id, reason };
        if stored.body_omitted || !stored.headers.is_empty() {
            return Err(fail(
                None,
                "it holds no sealed response (written without encryption?)",
            ));
        }
        let envelope = &stored.body[..];
        if envelope.len() < HEAD_LEN + TAG_LEN {
            return Err(fail(None, "its sealed response is too short"));
        }
        let bound = match envelope[0] {
            FORMAT_V2 => Some(fingerprint),
            FORMAT_V1 if self.open_format_1 => None,
            FORMAT_V1 => {
                return Err(fail(
                    None,
                    "it is sealed in format 1, which this store is set to refuse",
                ));
            }
            _ => return Err(fail(None, "its sealed response has an unknown format")),
        };
        let flags = envelope[1];
        let key_id = KeyId::from_be_bytes([envelope[2], envelope[3], envelope[4], envelope[5]]);
        if flags & !FLAG_BODY_OMITTED != 0 {
            return Err(fail(Some(key_id), "its sealed response has unknown flags"));
        }
        let Some(cipher) = self.keys.get(key_id) else {
            return Err(fail(Some(key_id), "its key id is not configured"));
        };
        let (sealed, tag) = envelope[HEAD_LEN..].split_at(envelope.len() - HEAD_LEN - TAG_LEN);
        let mut plain = sealed.to_vec();
        let aad = associated_data(&envelope[..6], key, stored.status, stored.outcome, bound);
        cipher
            .decrypt_in_place_detached(
                Nonce::from_slice(&envelope[6..HEAD_LEN]),
                &aad,
                &mut plain,
                Tag::from_slice(tag),
            )
            .map_err(|_| {
                fail(
                    Some(key_id),
                    "it fails authentication (altered, moved from another record or request, or \
                     sealed under other key material with this id)",
                )
            })?;
        let body_omitted = flags & FLAG_BODY_OMITTED != 0;
        let (headers, body_at) = parse_plaintext(&plain)
            .ok_or_else(|| fail(Some(key_id), "its plaintext is malformed"))?;
        if body_omitted && body_at != plain.len() {
            return Err(fail(Some(key_id), "its plaintext is malformed"));
        }
        Ok(StoredResponse {
            headers,
            // The body is the plaintext's tail: no second copy.
            body: Bytes::from(plain).slice(body_at..),
            body_omitted,
            ..stored.clone()
        })
    }
}

impl<S> fmt::Debug for EncryptedStore<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EncryptedStore")
            .field("keys", &self.keys)
            .finish_non_exhaustive()
    }
}

/// Why a record does not open.
struct Unreadable {
    key_id: Option<KeyId>,
    reason: &'static str,
}

impl Unreadable {
    /// Logs it and makes the error the layer answers `503` for.
    fn into_store_error(self) -> StoreError {
        match self.key_id {
            Some(key_id) => {
                tracing::error!(
                    key_id,
                    reason = self.reason,
                    "an idempotency record cannot be decrypted; answering 503, the handler is not \
                     run again"
                );
                StoreError::unreadable_record(format!(
                    "the record cannot be read: {} (key id {key_id})",
                    self.reason
                ))
            }
            None => {
                tracing::error!(
                    reason = self.reason,
                    "an idempotency record cannot be decrypted; answering 503, the handler is not \
                     run again"
                );
                StoreError::unreadable_record(format!("the record cannot be read: {}", self.reason))
            }
        }
    }
}

/// Label, envelope head (format, flags, key id), scope digest, status, outcome, then (format 2)
/// the request's fingerprint.
fn associated_data(
    head: &[u8],
    key: &RecordKey,
    status: u16,
    outcome: Finished,
    fingerprint: Option<&Fingerprint>,
) -> Vec<u8> {
    let label = match fingerprint {
        Some(_) => AAD_LABEL_V2,
        None => AAD_LABEL_V1,
    };
    let mut aad = Vec::with_capacity(label.len() + head.len() + 32 + 3 + 32);
    aad.extend_from_slice(label);
    aad.extend_from_slice(head);
    aad.extend_from_slice(&key.digest());
    aad.extend_from_slice(&status.to_be_bytes());
    aad.push(match outcome {
        Finished::Completed => b'c',
        Finished::Failed => b'f',
    });
    if let Some(fingerprint) = fingerprint {
        aad.extend_from_slice(fingerprint.as_bytes());
    }
    aad
}

/// The headers of an opened plaintext, and where its body starts; `None` when the lengths do not
/// add up.
fn parse_plaintext(plain: &[u8]) -> Option<(Vec<(HeaderName, HeaderValue)>, usize)> {
    let mut rest = plain;
    let headers = header_list::read(&mut rest)?;
    Some((headers, plain.len() - rest.len()))
}

impl<S: IdempotencyStore> IdempotencyStore for EncryptedStore<S> {
    async fn claim(&self, request: &ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        let outcome = match self.keyed(&request.fingerprint) {
            None => self.inner.claim(request).await?,
            Some(keyed) => {
                let keyed_request = ClaimRequest {
                    fingerprint: keyed,
                    ..request.clone()
                };
                match self.inner.claim(&keyed_request).await? {
                    // A record from before the secret was set has the plain fingerprint.
                    ClaimOutcome::KeyReuse => self.inner.claim(request).await?,
                    outcome => outcome,
                }
            }
        };
        match outcome {
            ClaimOutcome::Finished(stored) => {
                match self.open(&request.key, &request.fingerprint, &stored) {
                    Ok(opened) => Ok(ClaimOutcome::Finished(Arc::new(opened))),
                    Err(unreadable) => Err(unreadable.into_store_error()),
                }
            }
            other => Ok(other),
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
        let sealed = Arc::new(self.seal(key, fingerprint, &response)?);
        let stored = self.keyed(fingerprint).unwrap_or(*fingerprint);
        self.inner
            .complete(key, lease, &stored, sealed, retention)
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

    async fn release(&self, key: &RecordKey, lease: LeaseToken) -> Result<Fenced, StoreError> {
        self.inner.release(key, lease).await
    }

    async fn purge_expired(&self) -> Result<u64, StoreError> {
        self.inner.purge_expired().await
    }

    /// Status, state and times are kept in clear by the inner store: forwarded.
    async fn lookup(&self, key: &RecordKey) -> Result<Option<super::RecordInfo>, StoreError> {
        self.inner.lookup(key).await
    }

    async fn delete(&self, key: &RecordKey) -> Result<super::Deleted, StoreError> {
        self.inner.delete(key).await
    }

    async fn list(
        &self,
        subject: &str,
        request: super::ListRequest,
    ) -> Result<super::RecordPage, StoreError> {
        self.inner.list(subject, request).await
    }

    async fn count_records(&self, subject: &str, up_to: u64) -> Result<Option<u64>, StoreError> {
        self.inner.count_records(subject, up_to).await
    }

    fn operation_timeout(&self) -> Option<Duration> {
        self.inner.operation_timeout()
    }
}

/// A wrapper of a store with transactions has them too: the record written in a handler's
/// transaction is sealed (and its fingerprint keyed) as [`complete`](IdempotencyStore::complete)
/// seals it.
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
        let sealed = Arc::new(self.seal(key, fingerprint, &response)?);
        let stored = self.keyed(fingerprint).unwrap_or(*fingerprint);
        self.inner
            .complete_in(tx, key, lease, &stored, sealed, retention)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemoryStore;

    fn key(k: &str) -> RecordKey {
        RecordKey {
            key: k.into(),
            subject: "alice".into(),
            endpoint: "POST /pay".into(),
        }
    }

    fn response(body_omitted: bool) -> StoredResponse {
        StoredResponse {
            outcome: Finished::Completed,
            status: 201,
            headers: vec![
                (
                    http::header::CONTENT_TYPE,
                    HeaderValue::from_static("application/json"),
                ),
                (http::header::LINK, HeaderValue::from_static("<a>")),
                (http::header::LINK, HeaderValue::from_static("<b>")),
            ],
            body: if body_omitted {
                Bytes::new()
            } else {
                Bytes::from_static(b"{\"card\":\"4242\"}")
            },
            body_omitted,
            // As a store fills it on a read: kept through sealing and opening.
            expires_in: Some(Duration::from_secs(60)),
        }
    }

    fn fp(body: &str) -> Fingerprint {
        Fingerprint::of_material(body.as_bytes())
    }

    fn store(keys: &[(KeyId, [u8; 32])]) -> EncryptedStore<MemoryStore> {
        EncryptedStore::new(
            MemoryStore::new(),
            EncryptionKeys::new(keys.iter().copied()).expect("keys"),
        )
    }

    fn reason(result: Result<StoredResponse, Unreadable>) -> &'static str {
        match result {
            Ok(_) => panic!("opened"),
            Err(e) => e.reason,
        }
    }

    #[test]
    fn sealed_responses_open_and_hide_headers_and_body() {
        let s = store(&[(1, [1; 32])]);
        for omitted in [false, true] {
            let plain = response(omitted);
            let sealed = s.seal(&key("k"), &fp("a"), &plain).expect("seal");
            assert!(sealed.headers.is_empty());
            assert!(!sealed.body_omitted);
            assert_eq!((sealed.status, sealed.outcome), (201, Finished::Completed));
            for needle in [&b"4242"[..], b"application/json", b"<a>"] {
                assert!(!sealed.body.windows(needle.len()).any(|w| w == needle));
            }
            assert_eq!(sealed.body[0], FORMAT_V2);
            assert_eq!(sealed.body[1], u8::from(omitted));
            assert_eq!(&sealed.body[2..6], &1u32.to_be_bytes());
            let opened = s.open(&key("k"), &fp("a"), &sealed).map_err(|e| e.reason);
            assert_eq!(opened, Ok(plain));
        }
    }

    #[test]
    fn a_ciphertext_moved_onto_another_request_does_not_open() {
        let s = store(&[(1, [1; 32])]);
        let sealed = s.seal(&key("k"), &fp("a"), &response(false)).expect("seal");
        // The same scope (the key reused after retention, say) but another request's body.
        assert!(reason(s.open(&key("k"), &fp("b"), &sealed)).contains("authentication"));
        assert_eq!(
            s.open(&key("k"), &fp("a"), &sealed).map_err(|e| e.reason),
            Ok(response(false))
        );
        // Downgraded to format 1 (whose associated data has no fingerprint), it does not open.
        let mut bytes = sealed.body.to_vec();
        bytes[0] = FORMAT_V1;
        let downgraded = StoredResponse {
            body: Bytes::from(bytes),
            ..sealed.clone()
        };
        for request in ["a", "b"] {
            assert!(
                reason(s.open(&key("k"), &fp(request), &downgraded)).contains("authentication")
            );
        }
    }

    #[test]
    fn records_sealed_before_the_fingerprint_was_bound_still_open() {
        let s = store(&[(1, [1; 32])]);
        let old = s.seal_as(&key("k"), None, &response(false)).expect("seal");
        assert_eq!(old.body[0], FORMAT_V1);
        for request in ["a", "b"] {
            assert_eq!(
                s.open(&key("k"), &fp(request), &old).map_err(|e| e.reason),
                Ok(response(false))
            );
        }
        // Still bound to the scope and its clear fields.
        assert!(reason(s.open(&key("other"), &fp("a"), &old)).contains("authentication"));
        // Relabelled as format 2, it does not open: the format is authenticated.
        let mut bytes = old.body.to_vec();
        bytes[0] = FORMAT_V2;
        let relabelled = StoredResponse {
            body: Bytes::from(bytes),
            ..old.clone()
        };
        assert!(reason(s.open(&key("k"), &fp("a"), &relabelled)).contains("authentication"));
    }

    #[test]
    fn format_1_can_be_sealed_for_a_rollout_and_refused_after_it() {
        let rollout = store(&[(1, [1; 32])]).with_format_1_sealing();
        let sealed = rollout
            .seal(&key("k"), &fp("a"), &response(false))
            .expect("seal");
        assert_eq!(sealed.body[0], FORMAT_V1);
        let now = store(&[(1, [1; 32])]);
        assert!(now.open(&key("k"), &fp("a"), &sealed).is_ok());
        let strict = store(&[(1, [1; 32])]).refuse_format_1();
        assert!(reason(strict.open(&key("k"), &fp("a"), &sealed)).contains("format 1"));
        // Both set: refusing wins, so the store opens what it seals.
        let both = store(&[(1, [1; 32])])
            .with_format_1_sealing()
            .refuse_format_1();
        let own = both
            .seal(&key("k"), &fp("a"), &response(false))
            .expect("seal");
        assert_eq!(own.body[0], FORMAT_V2);
        assert!(both.open(&key("k"), &fp("a"), &own).is_ok());
        let bound = now
            .seal(&key("k"), &fp("a"), &response(false))
            .expect("seal");
        assert!(strict.open(&key("k"), &fp("a"), &bound).is_ok());
    }

    #[test]
    fn nonces_differ_between_seals() {
        let s = store(&[(1, [1; 32])]);
        let a = s.seal(&key("k"), &fp("a"), &response(false)).expect("seal");
        let b = s.seal(&key("k"), &fp("a"), &response(false)).expect("seal");
        assert_ne!(a.body[6..HEAD_LEN], b.body[6..HEAD_LEN]);
        assert_ne!(a.body, b.body);
    }

    #[test]
    fn anything_altered_or_moved_does_not_open() {
        let s = store(&[(1, [1; 32])]);
        let sealed = s.seal(&key("k"), &fp("a"), &response(false)).expect("seal");
        assert!(reason(s.open(&key("other"), &fp("a"), &sealed)).contains("authentication"));
        let edited = StoredResponse {
            status: 200,
            ..sealed.clone()
        };
        assert!(reason(s.open(&key("k"), &fp("a"), &edited)).contains("authentication"));
        let edited = StoredResponse {
            outcome: Finished::Failed,
            ..sealed.clone()
        };
        assert!(reason(s.open(&key("k"), &fp("a"), &edited)).contains("authentication"));
        for at in [1, HEAD_LEN - 1, HEAD_LEN, sealed.body.len() - 1] {
            // Byte 1 is the flags: set the omitted flag there, flip a bit anywhere else.
            let mut bytes = sealed.body.to_vec();
            bytes[at] = if at == 1 {
                FLAG_BODY_OMITTED
            } else {
                bytes[at] ^ 1
            };
            let flipped = StoredResponse {
                body: Bytes::from(bytes),
                ..sealed.clone()
            };
            assert!(
                reason(s.open(&key("k"), &fp("a"), &flipped)).contains("authentication"),
                "byte {at}"
            );
        }
        let cut = StoredResponse {
            body: sealed.body.slice(..HEAD_LEN + TAG_LEN - 1),
            ..sealed.clone()
        };
        assert!(reason(s.open(&key("k"), &fp("a"), &cut)).contains("too short"));
        let plain = response(false);
        assert!(reason(s.open(&key("k"), &fp("a"), &plain)).contains("without encryption"));
    }

    #[test]
    fn rotation_opens_old_records_and_seals_under_the_newest() {
        let old = store(&[(1, [1; 32])]);
        let sealed = old
            .seal(&key("k"), &fp("a"), &response(false))
            .expect("seal");
        let rotated = store(&[(2, [2; 32]), (1, [1; 32])]);
        assert!(rotated.open(&key("k"), &fp("a"), &sealed).is_ok());
        let new = rotated
            .seal(&key("k"), &fp("a"), &response(false))
            .expect("seal");
        assert_eq!(&new.body[2..6], &2u32.to_be_bytes());
        let only_new = store(&[(2, [2; 32])]);
        let Err(unreadable) = only_new.open(&key("k"), &fp("a"), &sealed) else {
            panic!("opened without its key");
        };
        assert_eq!(unreadable.key_id, Some(1));
        assert!(unreadable.reason.contains("not configured"));
        let error = unreadable.into_store_error();
        assert!(error.is_unreadable_record());
        assert!(error.to_string().contains("key id 1"), "{error}");
        // Other key material under the same id fails authentication.
        let impostor = store(&[(1, [3; 32])]);
        assert!(reason(impostor.open(&key("k"), &fp("a"), &sealed)).contains("authentication"));
    }

    #[test]
    fn keys_are_validated_and_never_printed() {
        assert_eq!(
            EncryptionKeys::new([]).err(),
            Some(EncryptionKeysError::Empty)
        );
        assert_eq!(
            EncryptionKeys::new([(1, [0; 32]), (1, [1; 32])]).err(),
            Some(EncryptionKeysError::DuplicateId(1))
        );
        let keys = EncryptionKeys::new([(7, [0xAB; 32]), (3, [0xCD; 32])]).expect("keys");
        assert_eq!(keys.newest(), 7);
        assert_eq!(keys.ids().collect::<Vec<_>>(), vec![7, 3]);
        let printed = format!("{:?}", EncryptedStore::new(MemoryStore::new(), keys));
        assert!(printed.contains("ids: [7, 3]"), "{printed}");
        for material in ["171", "ab", "AB", "205", "cd", "CD"] {
            assert!(!printed.contains(material), "{printed}");
        }
    }
}
