//! What an [`EncryptedStore`](super::EncryptedStore) writes in clear instead of the request: keyed
//! hashes (HMAC-SHA-256 under the store's secret) of the fingerprint, the key, the subject and the
//! endpoint. The inner store finds, fences, lists and counts records by them as it would by the
//! originals; a leaked table or dump gives away none of them, and cannot be brute-forced for a
//! low-entropy body (an amount alone) without the secret.

use zeroize::Zeroize;

use crate::store::{Fingerprint, RecordKey};
use crate::util::hmac::hmac_sha256;

/// The secret of the keyed hashes, wiped when dropped.
pub(super) struct ScopeSecret([u8; 32]);

impl Drop for ScopeSecret {
    fn drop(&mut self) {
        self.0.zeroize();
    }
}

impl ScopeSecret {
    pub(super) fn new(mut secret: [u8; 32]) -> Self {
        let kept = ScopeSecret(secret);
        secret.zeroize();
        kept
    }

    /// The keyed hash of `part` under `label`, in lower-case hex.
    fn hash(&self, label: &[u8], part: &[u8]) -> String {
        crate::util::hex::encode(&hmac_sha256(&self.0, &[label, part]))
    }

    /// The scope the inner store keeps: every part a keyed hash (64 hex characters each, within
    /// every store's bounds whatever the original's length).
    pub(super) fn scope(&self, key: &RecordKey) -> RecordKey {
        RecordKey {
            key: self.hash(b"axum-idempotency keyed key v1\0", key.key.as_bytes()),
            subject: self.subject(&key.subject),
            endpoint: self.hash(
                b"axum-idempotency keyed endpoint v1\0",
                key.endpoint.as_bytes(),
            ),
        }
    }

    /// The subject the inner store keeps (and lists and counts records by). The anonymous
    /// subject (empty) has its own hash, as any other.
    pub(super) fn subject(&self, subject: &str) -> String {
        self.hash(b"axum-idempotency keyed subject v1\0", subject.as_bytes())
    }

    /// The fingerprint the inner store keeps.
    pub(super) fn fingerprint(&self, fingerprint: &Fingerprint) -> Fingerprint {
        let mac = hmac_sha256(
            &self.0,
            &[
                b"axum-idempotency keyed fingerprint v1\0",
                fingerprint.as_bytes(),
            ],
        );
        Fingerprint::of_material(&mac)
    }
}
