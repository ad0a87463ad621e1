//! [`EncryptionKeys`]: the keys an [`EncryptedStore`](super::EncryptedStore) seals and opens
//! records with, by id, for rotation.

use std::fmt;

use aes_gcm::Aes256Gcm;
use aes_gcm::aead::KeyInit;

/// The id of an encryption key: a `u32` chosen by the application (a counter, or the date the key
/// was made as `20260301`). It is stored in clear in every sealed record, in 4 bytes, and names the
/// key that opens it; ids must be unique within one [`EncryptionKeys`], and an id must never be
/// reused for other key material while records sealed under it may still be read.
pub type KeyId = u32;

/// The keys an [`EncryptedStore`](super::EncryptedStore) seals and opens records with: the newest
/// seals every new record, all of them open the records they sealed.
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
/// `503 idempotency_store_unavailable` for it until it expires (see
/// [`EncryptedStore`](super::EncryptedStore)).
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

    pub(super) fn sealing(&self) -> (KeyId, &Aes256Gcm) {
        let (id, cipher) = &self.keys[0];
        (*id, cipher)
    }

    pub(super) fn get(&self, id: KeyId) -> Option<&Aes256Gcm> {
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
