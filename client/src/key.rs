//! Idempotency keys: given by the caller, or generated once per operation.

use std::fmt;

use http::HeaderValue;

use crate::error::{ErrorKind, IdempotencyError};

/// The most characters a key may have.
pub const MAX_KEY_LEN: usize = 255;

/// A valid `Idempotency-Key`: 1 to 255 visible ASCII characters (`!` to `~`), as the protocol
/// accepts.
///
/// One key names one operation: send it with every retry of that operation and with no other.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey {
    text: String,
    header: HeaderValue,
}

impl IdempotencyKey {
    /// Checks `key`: 1 to 255 characters, each visible ASCII (no space, no control character).
    pub fn new(key: impl Into<String>) -> Result<Self, InvalidKey> {
        let text = key.into();
        if text.is_empty() {
            return Err(InvalidKey("the key is empty"));
        }
        if text.len() > MAX_KEY_LEN {
            return Err(InvalidKey("the key is longer than 255 characters"));
        }
        if !text.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(InvalidKey(
                "the key has a character that is not visible ASCII",
            ));
        }
        let header = HeaderValue::from_str(&text)
            .map_err(|_| InvalidKey("the key is not a valid header value"))?;
        Ok(IdempotencyKey { text, header })
    }

    /// A new key: a random UUID (version 4, 122 random bits) from the operating system's random
    /// source, such as `1f0c5a0e-8b9e-4c1d-a7f2-3f6f0a9b2c41`.
    ///
    /// Fails only when that source does (it is read, not seeded once).
    pub fn generate() -> Result<Self, IdempotencyError> {
        let mut bytes = [0u8; 16];
        getrandom::fill(&mut bytes).map_err(|e| {
            IdempotencyError::new(ErrorKind::KeyGeneration, None, 0)
                .with_source(Box::new(RandomSourceError(e)))
        })?;
        IdempotencyKey::new(uuid_v4(bytes))
            .map_err(|e| IdempotencyError::new(ErrorKind::KeyGeneration, None, 0).with_source(e))
    }

    /// The key of an `Idempotency-Key` header the caller set on the request.
    pub(crate) fn from_header(value: &HeaderValue) -> Result<Self, InvalidKey> {
        let text = value
            .to_str()
            .map_err(|_| InvalidKey("the key has a character that is not visible ASCII"))?;
        IdempotencyKey::new(text)
    }

    /// The key as sent.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    pub(crate) fn header_value(&self) -> HeaderValue {
        self.header.clone()
    }
}

/// Formats 16 random bytes as a version 4 UUID (RFC 9562): the version and variant bits set, the
/// other 122 kept.
fn uuid_v4(mut bytes: [u8; 16]) -> String {
    bytes[6] = (bytes[6] & 0x0f) | 0x40;
    bytes[8] = (bytes[8] & 0x3f) | 0x80;
    let mut out = String::with_capacity(36);
    for (i, b) in bytes.iter().enumerate() {
        if matches!(i, 4 | 6 | 8 | 10) {
            out.push('-');
        }
        out.push(hex_digit(b >> 4));
        out.push(hex_digit(b & 0x0f));
    }
    out
}

fn hex_digit(n: u8) -> char {
    char::from(b"0123456789abcdef"[usize::from(n & 0x0f)])
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("IdempotencyKey").field(&self.text).finish()
    }
}

impl TryFrom<String> for IdempotencyKey {
    type Error = InvalidKey;

    fn try_from(key: String) -> Result<Self, InvalidKey> {
        IdempotencyKey::new(key)
    }
}

impl TryFrom<&str> for IdempotencyKey {
    type Error = InvalidKey;

    fn try_from(key: &str) -> Result<Self, InvalidKey> {
        IdempotencyKey::new(key)
    }
}

/// A key the protocol would refuse (`400 invalid_idempotency_key`): empty, over 255 characters, or
/// with a character that is not visible ASCII.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InvalidKey(&'static str);

impl fmt::Display for InvalidKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid idempotency key: {}", self.0)
    }
}

impl std::error::Error for InvalidKey {}

/// The operating system's random source failed.
#[derive(Debug)]
struct RandomSourceError(getrandom::Error);

impl fmt::Display for RandomSourceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "the random source failed: {}", self.0)
    }
}

impl std::error::Error for RandomSourceError {}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn keys_the_protocol_accepts() {
        for key in ["a", "order-1", "~!#$%&'*+-.^_`|", &"k".repeat(255)] {
            assert_eq!(IdempotencyKey::new(key).unwrap().as_str(), key);
        }
    }

    #[test]
    fn keys_the_protocol_refuses() {
        for key in ["", "with space", "tab\t", "é", "line\n", &"k".repeat(256)] {
            assert!(IdempotencyKey::new(key).is_err(), "{key:?} was accepted");
        }
    }

    #[test]
    fn generated_keys_are_uuid_v4_and_differ() {
        let a = IdempotencyKey::generate().unwrap();
        let b = IdempotencyKey::generate().unwrap();
        assert_ne!(a, b);
        let s = a.as_str();
        assert_eq!(s.len(), 36);
        let groups: Vec<&str> = s.split('-').collect();
        assert_eq!(
            groups.iter().map(|g| g.len()).collect::<Vec<_>>(),
            [8, 4, 4, 4, 12]
        );
        assert!(groups[2].starts_with('4'), "version 4: {s}");
        assert!(
            matches!(groups[3].as_bytes()[0], b'8' | b'9' | b'a' | b'b'),
            "RFC variant: {s}"
        );
        assert!(
            s.bytes()
                .all(|b| b == b'-' || b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        );
    }

    #[test]
    fn uuid_formatting_keeps_the_random_bits() {
        assert_eq!(uuid_v4([0; 16]), "00000000-0000-4000-8000-000000000000");
        assert_eq!(uuid_v4([0xff; 16]), "ffffffff-ffff-4fff-bfff-ffffffffffff");
    }
}
