//! The header policy: which response headers are never recorded nor replayed, whatever the
//! configuration says. The layer applies it when it records a response and again when it replays
//! one (a record may hold anything its store was given); stores keep what they are given.

use http::HeaderName;

/// Response headers never recorded nor replayed, whatever the configuration says: credentials,
/// cookies, headers that describe one transfer or one hop rather than the response (RFC 9110
/// section 7.6.1), and the layer's own markers.
pub const DENIED_HEADERS: [&str; 20] = [
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

/// Whether `name` is never recorded nor replayed.
pub(crate) fn is_denied(name: &HeaderName) -> bool {
    DENIED_HEADERS.contains(&name.as_str())
}
