//! Request fingerprints: what makes a retry "the same request". SHA-256 of the request's query
//! string and body, the body canonicalised when it is JSON (object keys sorted at every depth,
//! insignificant whitespace removed, strings and numbers in one form), raw bytes otherwise. The
//! [`Fingerprint`] type lives here whole (the stores keep it and compare it); this module needs
//! nothing of the crate but `util`, and the store builds on it.

pub(crate) mod canonical_json;
pub(crate) mod json_pointer;

use std::fmt;

use sha2::{Digest, Sha256};

pub use self::canonical_json::canonicalize;
use self::json_pointer::Pointer;

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

impl Fingerprint {
    /// Computes the fingerprint of a request body and its query string (`None` when the URI has none).
    ///
    /// A body that parses as JSON (whatever its `Content-Type`) is hashed in its canonical form (see
    /// the `canonical_json` rules in the crate docs); any other body, including JSON that is not I-JSON
    /// (duplicate keys, unpaired surrogates, nesting deeper than 128), is hashed as raw bytes. The two
    /// kinds are domain-separated, so a raw body never collides with a canonical one.
    pub fn of(query: Option<&str>, body: &[u8]) -> Self {
        Self::of_selected(query, body, &[])
    }

    /// [`Fingerprint::of`], leaving out of a JSON body the fields `ignored` names (a body without
    /// those fields has the same fingerprint under both).
    pub(crate) fn of_selected(query: Option<&str>, body: &[u8], ignored: &[Pointer]) -> Self {
        let mut hasher = Sha256::new();
        // Length-prefixed fields: no two (query, body) pairs share an input.
        match query {
            Some(q) => {
                hasher.update(b"q");
                hasher.update((q.len() as u64).to_be_bytes());
                hasher.update(q.as_bytes());
            }
            None => hasher.update(b"-"),
        }
        match canonical_json::canonical(body) {
            Some(canonical) => {
                hasher.update(b"json");
                match ignored {
                    [] => hasher.update(&canonical),
                    _ => match json_pointer::without(&canonical, ignored) {
                        Some(selected) => hasher.update(&selected),
                        None => hasher.update(&canonical),
                    },
                }
            }
            None => {
                hasher.update(b"raw_");
                hasher.update(body);
            }
        }
        Fingerprint(hasher.finalize().into())
    }

    /// The fingerprint of `input` serialized as JSON: [`Fingerprint::of`] its JSON, with no query,
    /// so reordered fields of a map do not count. For operations outside HTTP (see
    /// [`RunOnce::run_json`](crate::once::RunOnce::run_json)). Fails when `input` does not serialize
    /// (a map with keys that are not strings, a `Serialize` impl that fails).
    pub fn of_json<I: serde::Serialize + ?Sized>(input: &I) -> Result<Self, serde_json::Error> {
        Ok(Self::of(None, &serde_json::to_vec(input)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pinned bytes: stores keep fingerprints, so a change to them would answer every retry of an
    /// operation begun before a deploy `422 idempotency_key_reuse`.
    #[test]
    fn fingerprints_are_pinned() {
        let json = Fingerprint::of(Some("a=1"), br#" {"b": [1, {"d": 2, "c": 3}], "a": "x"} "#);
        assert_eq!(
            json.to_hex(),
            "96bd6bbf37e923fdeefd11e7f512010554789dbeb15881039fe6721569d7d7e7"
        );
        assert_eq!(
            Fingerprint::of(None, b"not json").to_hex(),
            "c4d02afcb5234b0590ff2f352c9e400027e8dea974e90b9641dcbb3776a502fb"
        );
        assert_eq!(
            Fingerprint::of_material(b"m").to_hex(),
            "f463bf2a455e3be8f734dfe6ebd70af759fb545686ca4a65c8b5b0815d8b8fd3"
        );
    }

    fn fp(body: &str) -> Fingerprint {
        Fingerprint::of(None, body.as_bytes())
    }

    #[test]
    fn key_order_and_whitespace_do_not_matter() {
        assert_eq!(fp(r#"{"a":1,"b":2}"#), fp(r#"{ "b": 2, "a": 1 }"#));
        assert_eq!(
            fp(r#"{"items":[{"sku":"x","qty":1}]}"#),
            fp(r#"{"items":[{"qty":1,"sku":"x"}]}"#)
        );
    }

    #[test]
    fn nested_differences_matter() {
        assert_ne!(
            fp(r#"{"cart":{"total":100}}"#),
            fp(r#"{"cart":{"total":999}}"#)
        );
        assert_ne!(
            fp(r#"{"items":[{"qty":1}]}"#),
            fp(r#"{"items":[{"qty":2}]}"#)
        );
    }

    #[test]
    fn query_is_part_of_the_fingerprint() {
        assert_ne!(
            Fingerprint::of(Some("a=1"), b"{}"),
            Fingerprint::of(Some("a=2"), b"{}")
        );
        assert_ne!(
            Fingerprint::of(Some(""), b"{}"),
            Fingerprint::of(None, b"{}")
        );
    }

    #[test]
    fn raw_bodies_are_hashed_as_bytes() {
        assert_ne!(fp("amount=1"), fp("amount=2"));
        assert_eq!(fp("amount=1"), fp("amount=1"));
        // A body that is JSON is canonical; the same text with a change in raw spacing is not JSON-equal
        // unless it is JSON.
        assert_ne!(fp("a b"), fp("a  b"));
    }

    #[test]
    fn ignored_fields_do_not_count_and_the_rest_does() {
        let ignored = [Pointer::parse("/ts").expect("pointer")];
        let sel = |body: &str| Fingerprint::of_selected(None, body.as_bytes(), &ignored);
        assert_eq!(sel(r#"{"a":1,"ts":1}"#), sel(r#"{"ts":2,"a":1}"#));
        assert_eq!(
            sel(r#"{"a":1,"ts":1}"#),
            fp(r#"{"a":1}"#),
            "same as a body without it"
        );
        assert_ne!(sel(r#"{"a":1,"ts":1}"#), sel(r#"{"a":2,"ts":1}"#));
        assert_ne!(fp(r#"{"a":1,"ts":1}"#), fp(r#"{"a":1,"ts":2}"#));
        // Raw bodies are hashed whole.
        assert_ne!(sel("ts=1"), sel("ts=2"));
        assert_ne!(Fingerprint::of_material(b"x"), fp("x"));
    }

    #[test]
    fn hex_is_sha256_sized() {
        let hex = fp("{}").to_hex();
        assert_eq!(hex.len(), 64);
        assert!(hex.bytes().all(|b| b.is_ascii_hexdigit()));
    }
}
