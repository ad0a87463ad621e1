//! Turning a response into a stored record, and a stored record back into a response.

use axum::body::Body;
use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode};

use super::header_policy;
use crate::header::{IDEMPOTENCY_EXPIRES, IDEMPOTENCY_REPLAY};
use crate::store::{Finished, StoredResponse};

/// Sets the expiry header to `left` from now (a date a little early rather than late: the record
/// is written after the answer's head is sent).
pub(crate) fn mark_expiry(headers: &mut HeaderMap, left: std::time::Duration) {
    mark_expiry_from(headers, std::time::SystemTime::now(), left);
}

/// Sets the expiry header to `left` after `base`.
pub(crate) fn mark_expiry_from(
    headers: &mut HeaderMap,
    base: std::time::SystemTime,
    left: std::time::Duration,
) {
    let at = base + left;
    if let Some(value) = expiry_value(at) {
        let _ = headers.try_insert(IDEMPOTENCY_EXPIRES, value);
    }
}

/// The header value of `at`, formatted once per second per thread: fresh answers all expire a
/// retention from now, so consecutive ones share it (as hyper does for `Date`).
fn expiry_value(at: std::time::SystemTime) -> Option<HeaderValue> {
    use std::cell::RefCell;
    thread_local! {
        static LAST: RefCell<Option<(u64, HeaderValue)>> = const { RefCell::new(None) };
    }
    let second = at
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    LAST.with(|last| {
        let mut last = last.try_borrow_mut().ok()?;
        if let Some((cached, value)) = last.as_ref()
            && *cached == second
        {
            return Some(value.clone());
        }
        let value = HeaderValue::try_from(httpdate::fmt_http_date(at)).ok()?;
        *last = Some((second, value.clone()));
        Some(value)
    })
}

/// The record of a response: its status, the headers on the allow-list and those that describe the
/// body's bytes (repeated ones in order), and its body (`None`: omitted).
pub(crate) fn capture(
    outcome: Finished,
    status: StatusCode,
    headers: &HeaderMap,
    allowed: &[HeaderName],
    body: Option<Bytes>,
) -> StoredResponse {
    // Headers the response's `Connection` names are hop-by-hop for it: never recorded.
    let hop_by_hop = header_policy::named_by_connection(headers);
    let headers = headers
        .iter()
        .filter(|(name, _)| {
            (allowed.contains(name) || header_policy::describes_body(name))
                && !header_policy::is_denied(name)
                && !hop_by_hop.contains(name)
        })
        .map(|(name, value)| (name.clone(), value.clone()))
        .collect();
    StoredResponse {
        outcome,
        status: status.as_u16(),
        headers,
        body_omitted: body.is_none(),
        body: body.unwrap_or_default(),
        expires_in: None,
    }
}

/// The response a replay sends: the stored status, headers and body, and `marker: true` (by default
/// `Idempotent-Replayed`). A stored status that is not a valid HTTP status (a store the layer does not
/// own may hold anything) becomes 500; denied headers and the marker are never sent back from the
/// record.
pub(crate) fn replay(
    stored: &StoredResponse,
    marker: &HeaderName,
    allowed: &[HeaderName],
) -> Response<Body> {
    let mut response = fresh_with(stored, Some(marker), Some(allowed));
    let headers = response.headers_mut();
    // `try_insert`: a map that is full (a record that holds tens of thousands of headers) is
    // answered without the marker rather than with a panic.
    let _ = headers.try_insert(marker.clone(), HeaderValue::from_static("true"));
    if stored.body_omitted {
        let _ = headers.try_insert(IDEMPOTENCY_REPLAY, HeaderValue::from_static("omitted"));
    }
    response
}

/// The response a record describes, as a fresh answer (no replay marker): for answers the layer
/// records itself, such as a handler cancelled at the maximum hold.
pub(crate) fn fresh(stored: &StoredResponse) -> Response<Body> {
    fresh_with(stored, None, None)
}

/// `allowed`: the allow-list applied again on the way out, so a record written by anyone with
/// access to the store carries no header the layer would not have recorded. The headers that
/// describe the body's bytes go with the body, and only with it.
fn fresh_with(
    stored: &StoredResponse,
    marker: Option<&HeaderName>,
    allowed: Option<&[HeaderName]>,
) -> Response<Body> {
    let mut response = Response::new(Body::from(stored.body.clone()));
    *response.status_mut() =
        StatusCode::from_u16(stored.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let headers = response.headers_mut();
    // A record may hold anything a store was given: no count makes `reserve` or `append` panic.
    let _ = headers.try_reserve(stored.headers.len().min(MAX_RESERVED_HEADERS) + 2);
    for (name, value) in &stored.headers {
        let with_body = header_policy::describes_body(name);
        if !header_policy::is_denied(name)
            && Some(name) != marker
            && allowed.is_none_or(|allowed| allowed.contains(name) || with_body)
            && !(with_body && stored.body_omitted)
            && headers.try_append(name.clone(), value.clone()).is_err()
        {
            tracing::warn!("a stored response holds more headers than a response can carry");
            break;
        }
    }
    response
}

/// Header entries reserved at once for a replay; a record with more grows the map as it goes.
const MAX_RESERVED_HEADERS: usize = 64;

#[cfg(test)]
mod tests {
    use super::*;
    use http::header;

    #[test]
    fn keeps_allowed_headers_in_order_and_never_cookies() {
        let mut headers = HeaderMap::new();
        headers.append(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
        headers.append(
            header::SET_COOKIE,
            HeaderValue::from_static("session=secret"),
        );
        headers.append(header::LINK, HeaderValue::from_static("<a>"));
        headers.append(header::LINK, HeaderValue::from_static("<b>"));
        headers.append(header::LINK, HeaderValue::from_static("<c>"));
        headers.append(header::SERVER, HeaderValue::from_static("x"));
        let allowed = [header::CONTENT_TYPE, header::LINK, header::SET_COOKIE];
        let stored = capture(
            Finished::Completed,
            StatusCode::CREATED,
            &headers,
            &allowed,
            Some(Bytes::from_static(b"hi")),
        );
        let names: Vec<_> = stored.headers.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["content-type", "link", "link", "link"]);
        let links: Vec<_> = stored.headers[1..]
            .iter()
            .map(|(_, v)| v.as_bytes())
            .collect();
        assert_eq!(links, [b"<a>", b"<b>", b"<c>"]);

        let response = replay(&stored, &crate::header::IDEMPOTENT_REPLAYED, &allowed);
        assert_eq!(response.status(), StatusCode::CREATED);
        let replayed: Vec<_> = response.headers().get_all(header::LINK).iter().collect();
        assert_eq!(replayed, ["<a>", "<b>", "<c>"]);
        assert!(response.headers().get(header::SET_COOKIE).is_none());
        assert_eq!(
            response.headers()[crate::header::IDEMPOTENT_REPLAYED],
            "true"
        );
    }

    #[test]
    fn replay_turns_a_bad_status_into_500_and_drops_denied_headers() {
        let stored = StoredResponse {
            outcome: Finished::Failed,
            status: 1000,
            headers: vec![
                (header::SET_COOKIE, HeaderValue::from_static("a=b")),
                (header::ETAG, HeaderValue::from_static("\"1\"")),
            ],
            body: Bytes::new(),
            body_omitted: false,
            expires_in: None,
        };
        let response = replay(
            &stored,
            &crate::header::IDEMPOTENT_REPLAYED,
            &[header::ETAG],
        );
        assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(response.headers().len(), 2); // etag and idempotent-replayed
        assert_eq!(response.headers()["etag"], "\"1\"");
    }

    #[test]
    fn a_replay_carries_only_headers_on_the_allow_list_whatever_the_record_holds() {
        // A record written by someone with access to the store, not by the layer.
        let stored = StoredResponse {
            outcome: Finished::Completed,
            status: 200,
            headers: vec![
                (header::CONTENT_TYPE, HeaderValue::from_static("text/plain")),
                (
                    header::REFRESH,
                    HeaderValue::from_static("0; url=https://evil.example"),
                ),
                (header::UPGRADE, HeaderValue::from_static("h2c")),
            ],
            body: Bytes::new(),
            body_omitted: false,
            expires_in: None,
        };
        let marker = crate::header::IDEMPOTENT_REPLAYED;
        let response = replay(&stored, &marker, &[header::CONTENT_TYPE, header::UPGRADE]);
        assert_eq!(response.headers()[header::CONTENT_TYPE], "text/plain");
        assert!(
            response.headers().get(header::REFRESH).is_none(),
            "not on the allow-list"
        );
        assert!(
            response.headers().get(header::UPGRADE).is_none(),
            "hop-by-hop: never"
        );
    }

    #[test]
    fn the_content_encoding_goes_with_the_bytes_it_describes_and_only_with_them() {
        // A compression layer inside this one: gzip bytes, and an allow-list that does not name
        // `content-encoding`.
        let mut headers = HeaderMap::new();
        headers.append(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
        headers.append(header::CONTENT_ENCODING, HeaderValue::from_static("gzip"));
        let allowed = [header::CONTENT_TYPE];
        let gzip = Bytes::from_static(b"\x1f\x8b...");
        let mut stored = capture(
            Finished::Completed,
            StatusCode::OK,
            &headers,
            &allowed,
            Some(gzip),
        );
        let marker = crate::header::IDEMPOTENT_REPLAYED;
        let response = replay(&stored, &marker, &allowed);
        assert_eq!(response.headers()[header::CONTENT_ENCODING], "gzip");
        // The same record with its body left out: nothing for the header to describe.
        stored.body = Bytes::new();
        stored.body_omitted = true;
        let response = replay(&stored, &marker, &allowed);
        assert!(response.headers().get(header::CONTENT_ENCODING).is_none());
    }

    #[test]
    fn a_record_with_more_headers_than_a_response_can_carry_replays_without_panicking() {
        let stored = StoredResponse {
            outcome: Finished::Completed,
            status: 200,
            headers: (0..40_000)
                .map(|i| (header::LINK, HeaderValue::from(i)))
                .collect(),
            body: Bytes::from_static(b"ok"),
            body_omitted: false,
            expires_in: None,
        };
        let response = replay(
            &stored,
            &crate::header::IDEMPOTENT_REPLAYED,
            &[header::LINK],
        );
        assert_eq!(response.status(), StatusCode::OK);
        assert!(response.headers().len() > 1000);
    }

    proptest::proptest! {
        #[test]
        fn replay_keeps_repeated_allowed_headers_in_order(
            sent in proptest::collection::vec((0usize..4, "[a-z0-9]{0,8}"), 0..16)
        ) {
            let names = [header::CONTENT_TYPE, header::LINK, header::SET_COOKIE, header::SERVER];
            let allowed = [header::CONTENT_TYPE, header::LINK];
            let mut headers = HeaderMap::new();
            for (n, value) in &sent {
                headers.append(names[*n].clone(), HeaderValue::from_str(value).expect("value"));
            }
            let stored = capture(Finished::Completed, StatusCode::OK, &headers, &allowed, Some(Bytes::new()));
            let response = replay(&stored, &crate::header::IDEMPOTENT_REPLAYED, &allowed);
            for (n, name) in names.iter().enumerate() {
                let expected: Vec<&str> = if n < 2 {
                    sent.iter().filter(|(i, _)| *i == n).map(|(_, v)| v.as_str()).collect()
                } else {
                    Vec::new()
                };
                let got: Vec<&str> = response
                    .headers()
                    .get_all(name)
                    .iter()
                    .map(|v| v.to_str().expect("ascii"))
                    .collect();
                proptest::prop_assert_eq!(got, expected, "{}", name);
            }
        }
    }
}
