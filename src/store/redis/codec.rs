//! A recorded response as bytes, and the small conversions the scripts' replies need.

use std::time::Duration;

use bytes::Bytes;
use redis::Value;

use crate::store::header_list;
use crate::store::{Finished, StoredResponse};

/// The stored response as bytes: outcome, status, headers (length-prefixed), body. The outcome is
/// `c` or `f`, upper case when the body was omitted.
pub(super) fn encode(response: &StoredResponse) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(response.body.len() + 64);
    out.push(match (response.outcome, response.body_omitted) {
        (Finished::Completed, false) => b'c',
        (Finished::Failed, false) => b'f',
        (Finished::Completed, true) => b'C',
        (Finished::Failed, true) => b'F',
    });
    out.extend_from_slice(&response.status.to_be_bytes());
    header_list::write(&response.headers, &mut out)?;
    out.extend_from_slice(&response.body);
    Some(out)
}

/// The inverse of [`encode`]; `None` for bytes it did not write. Headers that are not valid HTTP
/// are dropped (the layer's header policy applies on replay).
pub(super) fn decode(blob: &[u8]) -> Option<StoredResponse> {
    let mut rest = blob;
    let mut take = |n: usize| -> Option<&[u8]> {
        let (head, tail) = rest.split_at_checked(n)?;
        rest = tail;
        Some(head)
    };
    let (outcome, body_omitted) = match take(1)? {
        b"c" => (Finished::Completed, false),
        b"f" => (Finished::Failed, false),
        b"C" => (Finished::Completed, true),
        b"F" => (Finished::Failed, true),
        _ => return None,
    };
    let status = u16::from_be_bytes(take(2)?.try_into().ok()?);
    let headers = header_list::read(&mut rest)?;
    Some(StoredResponse {
        outcome,
        status,
        headers,
        body: Bytes::copy_from_slice(rest),
        body_omitted,
        expires_in: None,
    })
}

/// A script's integer, as an integer reply or as text (a hash field).
pub(super) fn integer(value: &Value) -> Option<i64> {
    match value {
        Value::Int(n) => Some(*n),
        Value::BulkString(bytes) => std::str::from_utf8(bytes).ok()?.parse().ok(),
        Value::SimpleString(s) => s.parse().ok(),
        _ => None,
    }
}

/// The digest an index entry names (64 lower-case hex digits); `None` for anything else.
pub(super) fn parse_digest(hex: &str) -> Option<[u8; 32]> {
    let hex = hex.as_bytes();
    if hex.len() != 64 {
        return None;
    }
    let nibble = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    };
    let mut digest = [0u8; 32];
    for (i, byte) in digest.iter_mut().enumerate() {
        *byte = nibble(hex[2 * i])? << 4 | nibble(hex[2 * i + 1])?;
    }
    Some(digest)
}

pub(super) fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Finished;
    use http::HeaderValue;

    #[test]
    fn responses_round_trip_and_garbage_is_refused() {
        let response = StoredResponse {
            outcome: Finished::Failed,
            status: 402,
            headers: vec![
                (
                    http::header::CONTENT_TYPE,
                    HeaderValue::from_static("application/json"),
                ),
                (http::header::LINK, HeaderValue::from_static("<a>")),
                (http::header::LINK, HeaderValue::from_static("<b>")),
            ],
            body: Bytes::from_static(b"{\"error\":\"card_declined\"}"),
            body_omitted: false,
            expires_in: None,
        };
        let blob = encode(&response).expect("fits");
        assert_eq!(decode(&blob), Some(response.clone()));
        let omitted = StoredResponse {
            body: Bytes::new(),
            body_omitted: true,
            ..response
        };
        assert_eq!(decode(&encode(&omitted).expect("fits")), Some(omitted));
        for cut in 0..7 {
            assert_eq!(decode(&blob[..cut]), None, "cut at {cut}");
        }
        assert_eq!(decode(b"x"), None);
    }

    #[test]
    fn index_entries_name_digests_in_lower_case_hex_only() {
        let digest: [u8; 32] = std::array::from_fn(|i| (i * 37) as u8);
        let hex = crate::util::hex::encode(&digest);
        assert_eq!(parse_digest(&hex), Some(digest));
        assert_eq!(parse_digest(&hex.to_uppercase()), None);
        assert_eq!(parse_digest(&hex[1..]), None);
        assert_eq!(parse_digest(&format!("{}g", &hex[1..])), None);
        assert_eq!(parse_digest(""), None);
    }
}
