//! [`Fingerprint`]: the digest that tells whether a retry is the same request. The store keeps it
//! with the record and compares it; how it is computed from a request is the `fingerprint`
//! module's business.

use std::fmt;

use sha2::{Digest, Sha256};

/// SHA-256 of what identifies a request (by default its query string and its body, canonicalised
/// when the body is JSON; see `Fingerprint::of`).
///
/// Two requests that differ anywhere in their JSON, at any depth, have different fingerprints;
/// reordered object keys and whitespace do not count as differences.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint(pub(crate) [u8; 32]);

impl Fingerprint {
    /// The fingerprint of what a custom fingerprint function chose to identify a request by (see
    /// [`IdempotencyLayerBuilder::fingerprint_fn`](crate::IdempotencyLayerBuilder::fingerprint_fn)):
    /// SHA-256 of `material`, domain-separated from `Fingerprint::of`.
    pub fn of_material(material: &[u8]) -> Self {
        let mut hasher = Sha256::new();
        hasher.update(b"custom");
        hasher.update(material);
        Fingerprint(hasher.finalize().into())
    }

    /// The 32 bytes of the digest.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// Lower-case hex, as shown in logs.
    pub fn to_hex(&self) -> String {
        crate::util::hex::encode(&self.0)
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({})", self.to_hex())
    }
}
