//! The envelope a recorded response is sealed in: AES-256-GCM under the newest key, bound to its
//! record and to the request's fingerprint.

use aes_gcm::aead::AeadInPlace;
use aes_gcm::{Nonce, Tag};
use bytes::Bytes;
use http::{HeaderName, HeaderValue};

use super::keys::{EncryptionKeys, KeyId};
use crate::store::{Fingerprint, Finished, RecordKey, StoreError, StoredResponse, header_list};

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

/// `response` as written to the inner store: status and outcome in clear, no headers, the
/// envelope as body, sealed under the newest key (format 2, binding `fingerprint`; format 1,
/// `None`, only as earlier versions sealed it, for tests of opening it).
pub(super) fn seal(
    keys: &EncryptionKeys,
    key: &RecordKey,
    fingerprint: Option<&Fingerprint>,
    response: &StoredResponse,
) -> Result<StoredResponse, StoreError> {
    let (key_id, cipher) = keys.sealing();
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

/// The response a sealed record holds. Format 1 (sealed by earlier versions, not bound to the
/// request's fingerprint) opens only when `format_1` says so: for records read in clear.
pub(super) fn open(
    keys: &EncryptionKeys,
    key: &RecordKey,
    fingerprint: &Fingerprint,
    stored: &StoredResponse,
    format_1: bool,
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
        FORMAT_V1 if format_1 => None,
        FORMAT_V1 => {
            return Err(fail(
                None,
                "it is sealed in format 1, which only records kept in clear may be",
            ));
        }
        _ => return Err(fail(None, "its sealed response has an unknown format")),
    };
    let flags = envelope[1];
    let key_id = KeyId::from_be_bytes([envelope[2], envelope[3], envelope[4], envelope[5]]);
    if flags & !FLAG_BODY_OMITTED != 0 {
        return Err(fail(Some(key_id), "its sealed response has unknown flags"));
    }
    let Some(cipher) = keys.get(key_id) else {
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
    let (headers, body_at) =
        parse_plaintext(&plain).ok_or_else(|| fail(Some(key_id), "its plaintext is malformed"))?;
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

/// Labels a sealed step's associated data.
const AAD_LABEL_STEP: &[u8] = b"axum-idempotency sealed step v1\0";
/// The format of a sealed step.
const FORMAT_STEP: u8 = 3;
/// Format, key id, nonce.
const STEP_HEAD_LEN: usize = 1 + 4 + NONCE_LEN;

/// A step's result as written to the inner store: sealed under the newest key, bound to its
/// record (the scope in clear) and to its name, so that it opens neither on another record nor
/// as another step.
pub(super) fn seal_step(
    keys: &EncryptionKeys,
    key: &RecordKey,
    name: &str,
    result: &[u8],
) -> Result<Vec<u8>, StoreError> {
    let (key_id, cipher) = keys.sealing();
    let mut out = Vec::with_capacity(STEP_HEAD_LEN + result.len() + TAG_LEN);
    out.push(FORMAT_STEP);
    out.extend_from_slice(&key_id.to_be_bytes());
    let mut nonce = [0u8; NONCE_LEN];
    getrandom::fill(&mut nonce)
        .map_err(|e| StoreError::msg(format!("encrypt: no randomness for the nonce: {e}")))?;
    out.extend_from_slice(&nonce);
    out.extend_from_slice(result);
    let aad = step_associated_data(&out[..5], key, name);
    let tag = cipher
        .encrypt_in_place_detached(Nonce::from_slice(&nonce), &aad, &mut out[STEP_HEAD_LEN..])
        .map_err(|_| StoreError::msg("encrypt: the step's result is too large to seal"))?;
    out.extend_from_slice(&tag);
    Ok(out)
}

/// The result a sealed step holds.
pub(super) fn open_step(
    keys: &EncryptionKeys,
    key: &RecordKey,
    name: &str,
    sealed: &[u8],
) -> Result<Vec<u8>, Unreadable> {
    let fail = |key_id, reason| Unreadable { key_id, reason };
    if sealed.len() < STEP_HEAD_LEN + TAG_LEN || sealed[0] != FORMAT_STEP {
        return Err(fail(None, "a step it holds is not sealed"));
    }
    let key_id = KeyId::from_be_bytes([sealed[1], sealed[2], sealed[3], sealed[4]]);
    let Some(cipher) = keys.get(key_id) else {
        return Err(fail(Some(key_id), "its key id is not configured"));
    };
    let (body, tag) = sealed[STEP_HEAD_LEN..].split_at(sealed.len() - STEP_HEAD_LEN - TAG_LEN);
    let mut plain = body.to_vec();
    let aad = step_associated_data(&sealed[..5], key, name);
    cipher
        .decrypt_in_place_detached(
            Nonce::from_slice(&sealed[5..STEP_HEAD_LEN]),
            &aad,
            &mut plain,
            Tag::from_slice(tag),
        )
        .map_err(|_| {
            fail(
                Some(key_id),
                "a step it holds fails authentication (altered, moved from another record or \
                 step, or sealed under other key material with this id)",
            )
        })?;
    Ok(plain)
}

/// Label, head (format, key id), scope digest, the name's length and the name.
fn step_associated_data(head: &[u8], key: &RecordKey, name: &str) -> Vec<u8> {
    let mut aad = Vec::with_capacity(AAD_LABEL_STEP.len() + head.len() + 32 + 8 + name.len());
    aad.extend_from_slice(AAD_LABEL_STEP);
    aad.extend_from_slice(head);
    aad.extend_from_slice(&key.digest());
    aad.extend_from_slice(&(name.len() as u64).to_be_bytes());
    aad.extend_from_slice(name.as_bytes());
    aad
}

/// Why a record does not open.
pub(super) struct Unreadable {
    pub(super) key_id: Option<KeyId>,
    pub(super) reason: &'static str,
}

impl Unreadable {
    /// Logs it and makes the error the layer answers `503` for.
    pub(super) fn into_store_error(self) -> StoreError {
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::store::encrypted::EncryptionKeysError;

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

    fn store(keys: &[(KeyId, [u8; 32])]) -> EncryptionKeys {
        EncryptionKeys::new(keys.iter().copied()).expect("keys")
    }

    fn reason(result: Result<StoredResponse, Unreadable>) -> &'static str {
        match result {
            Ok(_) => panic!("opened"),
            Err(e) => e.reason,
        }
    }

    #[test]
    fn sealed_steps_open_only_on_their_record_and_name() {
        let keys = store(&[(1, [7; 32])]);
        let sealed = seal_step(&keys, &key("k1"), "charge", b"{\"id\":\"ch_1\"}").expect("seal");
        assert!(
            !sealed.windows(4).any(|w| w == b"ch_1"),
            "the result is hidden"
        );
        let opened = open_step(&keys, &key("k1"), "charge", &sealed).ok();
        assert_eq!(opened.as_deref(), Some(&b"{\"id\":\"ch_1\"}"[..]));
        assert!(
            open_step(&keys, &key("k2"), "charge", &sealed).is_err(),
            "another record"
        );
        assert!(
            open_step(&keys, &key("k1"), "refund", &sealed).is_err(),
            "another step"
        );
        assert!(open_step(&store(&[(2, [7; 32])]), &key("k1"), "charge", &sealed).is_err());
        let mut altered = sealed.clone();
        let last = altered.len() - 1;
        altered[last] ^= 1;
        assert!(
            open_step(&keys, &key("k1"), "charge", &altered).is_err(),
            "altered"
        );
    }

    #[test]
    fn sealed_responses_open_and_hide_headers_and_body() {
        let s = store(&[(1, [1; 32])]);
        for omitted in [false, true] {
            let plain = response(omitted);
            let sealed = seal(&s, &key("k"), Some(&fp("a")), &plain).expect("seal");
            assert!(sealed.headers.is_empty());
            assert!(!sealed.body_omitted);
            assert_eq!((sealed.status, sealed.outcome), (201, Finished::Completed));
            for needle in [&b"4242"[..], b"application/json", b"<a>"] {
                assert!(!sealed.body.windows(needle.len()).any(|w| w == needle));
            }
            assert_eq!(sealed.body[0], FORMAT_V2);
            assert_eq!(sealed.body[1], u8::from(omitted));
            assert_eq!(&sealed.body[2..6], &1u32.to_be_bytes());
            let opened = open(&s, &key("k"), &fp("a"), &sealed, false).map_err(|e| e.reason);
            assert_eq!(opened, Ok(plain));
        }
    }

    #[test]
    fn a_ciphertext_moved_onto_another_request_does_not_open() {
        let s = store(&[(1, [1; 32])]);
        let sealed = seal(&s, &key("k"), Some(&fp("a")), &response(false)).expect("seal");
        // The same scope (the key reused after retention, say) but another request's body.
        assert!(reason(open(&s, &key("k"), &fp("b"), &sealed, false)).contains("authentication"));
        assert_eq!(
            open(&s, &key("k"), &fp("a"), &sealed, false).map_err(|e| e.reason),
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
                reason(open(&s, &key("k"), &fp(request), &downgraded, true))
                    .contains("authentication")
            );
        }
    }

    #[test]
    fn records_sealed_before_the_fingerprint_was_bound_still_open() {
        let s = store(&[(1, [1; 32])]);
        let old = seal(&s, &key("k"), None, &response(false)).expect("seal");
        assert_eq!(old.body[0], FORMAT_V1);
        for request in ["a", "b"] {
            assert_eq!(
                open(&s, &key("k"), &fp(request), &old, true).map_err(|e| e.reason),
                Ok(response(false))
            );
        }
        // Still bound to the scope and its clear fields.
        assert!(reason(open(&s, &key("other"), &fp("a"), &old, true)).contains("authentication"));
        // Only records read in clear may be in format 1.
        assert!(reason(open(&s, &key("k"), &fp("a"), &old, false)).contains("format 1"));
        // Relabelled as format 2, it does not open: the format is authenticated.
        let mut bytes = old.body.to_vec();
        bytes[0] = FORMAT_V2;
        let relabelled = StoredResponse {
            body: Bytes::from(bytes),
            ..old.clone()
        };
        assert!(
            reason(open(&s, &key("k"), &fp("a"), &relabelled, false)).contains("authentication")
        );
    }

    #[test]
    fn nonces_differ_between_seals() {
        let s = store(&[(1, [1; 32])]);
        let a = seal(&s, &key("k"), Some(&fp("a")), &response(false)).expect("seal");
        let b = seal(&s, &key("k"), Some(&fp("a")), &response(false)).expect("seal");
        assert_ne!(a.body[6..HEAD_LEN], b.body[6..HEAD_LEN]);
        assert_ne!(a.body, b.body);
    }

    #[test]
    fn anything_altered_or_moved_does_not_open() {
        let s = store(&[(1, [1; 32])]);
        let sealed = seal(&s, &key("k"), Some(&fp("a")), &response(false)).expect("seal");
        assert!(
            reason(open(&s, &key("other"), &fp("a"), &sealed, false)).contains("authentication")
        );
        let edited = StoredResponse {
            status: 200,
            ..sealed.clone()
        };
        assert!(reason(open(&s, &key("k"), &fp("a"), &edited, false)).contains("authentication"));
        let edited = StoredResponse {
            outcome: Finished::Failed,
            ..sealed.clone()
        };
        assert!(reason(open(&s, &key("k"), &fp("a"), &edited, false)).contains("authentication"));
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
                reason(open(&s, &key("k"), &fp("a"), &flipped, false)).contains("authentication"),
                "byte {at}"
            );
        }
        let cut = StoredResponse {
            body: sealed.body.slice(..HEAD_LEN + TAG_LEN - 1),
            ..sealed.clone()
        };
        assert!(reason(open(&s, &key("k"), &fp("a"), &cut, false)).contains("too short"));
        let plain = response(false);
        assert!(
            reason(open(&s, &key("k"), &fp("a"), &plain, false)).contains("without encryption")
        );
    }

    #[test]
    fn rotation_opens_old_records_and_seals_under_the_newest() {
        let old = store(&[(1, [1; 32])]);
        let sealed = seal(&old, &key("k"), Some(&fp("a")), &response(false)).expect("seal");
        let rotated = store(&[(2, [2; 32]), (1, [1; 32])]);
        assert!(open(&rotated, &key("k"), &fp("a"), &sealed, false).is_ok());
        let new = seal(&rotated, &key("k"), Some(&fp("a")), &response(false)).expect("seal");
        assert_eq!(&new.body[2..6], &2u32.to_be_bytes());
        let only_new = store(&[(2, [2; 32])]);
        let Err(unreadable) = open(&only_new, &key("k"), &fp("a"), &sealed, false) else {
            panic!("opened without its key");
        };
        assert_eq!(unreadable.key_id, Some(1));
        assert!(unreadable.reason.contains("not configured"));
        let error = unreadable.into_store_error();
        assert!(error.is_unreadable_record());
        assert!(error.to_string().contains("key id 1"), "{error}");
        // Other key material under the same id fails authentication.
        let impostor = store(&[(1, [3; 32])]);
        assert!(
            reason(open(&impostor, &key("k"), &fp("a"), &sealed, false)).contains("authentication")
        );
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
    }
}
