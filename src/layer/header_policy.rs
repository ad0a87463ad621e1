//! The header policy: which response headers are never recorded nor replayed, whatever the
//! configuration says. The layer applies it when it records a response and again when it replays
//! one (a record may hold anything its store was given); stores keep what they are given.
//!
//! Never kept: credentials and cookies, every `proxy-*` header, the headers that describe one
//! transfer or one hop rather than the response (RFC 9110 section 7.6.1: `connection` and the
//! headers it names, `keep-alive`, `te`, `trailer`, `transfer-encoding`, `upgrade`), and the
//! layer's own markers (the replay markers, and `idempotency-trailer-*`, under which a record
//! keeps a trailer).
//!
//! Always kept with the body, whatever the configuration says: `content-encoding`. It says what
//! the recorded bytes are (RFC 9110 section 8.4); a compression layer inside this one records
//! gzip bytes, and a replay of them without it would hand the client bytes it reads as something
//! they are not. Left out only when the body is (a replay with no body has nothing it describes).

use http::HeaderName;

/// Response headers never recorded nor replayed, whatever the configuration says: credentials,
/// cookies, headers that describe one transfer or one hop rather than the response (RFC 9110
/// section 7.6.1), and the layer's own markers.
pub(crate) const DENIED_HEADERS: [&str; 20] = [
    "set-cookie",
    "set-cookie2",
    "authorization",
    "proxy-authorization",
    "proxy-authenticate",
    "www-authenticate",
    "authentication-info",
    "proxy-authentication-info",
    "cookie",
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "upgrade",
    "idempotent-replayed",
    "idempotency-replay",
    "idempotency-key",
];

/// The prefix under which a record keeps a trailer among its headers (the gRPC mode records its
/// trailers so). Denied as a header: no answer the layer records can forge a trailer, and a replay
/// never sends one as a header.
pub(crate) const TRAILER_PREFIX: &str = "idempotency-trailer-";

/// Whether `name` is never recorded nor replayed.
pub(crate) fn is_denied(name: &HeaderName) -> bool {
    let name = name.as_str();
    DENIED_HEADERS.contains(&name) || name.starts_with("proxy-") || name.starts_with(TRAILER_PREFIX)
}

/// Whether `name` describes the recorded bytes themselves, so that it is recorded and replayed with
/// them whatever the allow-list says.
pub(crate) fn describes_body(name: &HeaderName) -> bool {
    name == http::header::CONTENT_ENCODING
}

/// The headers a response's `Connection` header names (hop-by-hop for that response: RFC 9110
/// section 7.6.1), lower-cased.
pub(crate) fn named_by_connection(headers: &http::HeaderMap) -> Vec<HeaderName> {
    headers
        .get_all(http::header::CONNECTION)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .filter_map(|token| HeaderName::try_from(token.trim()).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_proxy_header_is_denied() {
        for name in [
            "proxy-connection",
            "proxy-status",
            "proxy-authorization",
            "proxy-x",
        ] {
            assert!(is_denied(&HeaderName::from_static(name)), "{name}");
        }
        assert!(!is_denied(&http::header::CONTENT_TYPE));
    }

    #[test]
    fn no_answer_can_carry_a_recorded_trailer_as_a_header() {
        let forged = HeaderName::from_static("idempotency-trailer-grpc-status");
        assert!(is_denied(&forged));
        assert!(!is_denied(&HeaderName::from_static("grpc-status")));
    }

    #[test]
    fn the_connection_header_names_its_hop_by_hop_headers() {
        let mut headers = http::HeaderMap::new();
        headers.append(
            http::header::CONNECTION,
            "close, X-Hop".parse().expect("value"),
        );
        headers.append(
            http::header::CONNECTION,
            "x-other ,".parse().expect("value"),
        );
        let named: Vec<String> = named_by_connection(&headers)
            .iter()
            .map(|n| n.as_str().to_owned())
            .collect();
        assert_eq!(named, ["close", "x-hop", "x-other"]);
    }
}
