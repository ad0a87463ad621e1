//! The store's values as the table keeps them, and back: inspection's printable text, stored
//! headers, durations in microseconds.

use std::borrow::Cow;
use std::time::Duration;

use http::{HeaderName, HeaderValue};

/// A subject or endpoint for the columns kept for inspection: PostgreSQL's `text` cannot hold NUL,
/// so NUL is written as U+FFFD there (the record's identity is its `scope` digest, which is exact).
pub(super) fn printable(s: &str) -> Cow<'_, str> {
    if s.contains('\0') {
        Cow::Owned(s.replace('\0', "\u{FFFD}"))
    } else {
        Cow::Borrowed(s)
    }
}

/// Stored headers back into HTTP types. The table may have been written by anyone: a name or value
/// that is not valid HTTP is dropped rather than trusted (the layer's header policy applies on
/// replay).
pub(super) fn parse_headers(
    names: Vec<String>,
    values: Vec<Vec<u8>>,
) -> Vec<(HeaderName, HeaderValue)> {
    names
        .into_iter()
        .zip(values)
        .filter_map(|(name, value)| {
            let name = HeaderName::from_bytes(name.as_bytes()).ok()?;
            let value = HeaderValue::from_bytes(&value).ok()?;
            Some((name, value))
        })
        .collect()
}

/// A duration in microseconds, as the statements take it.
pub(super) fn micros(d: Duration) -> f64 {
    d.as_micros() as f64
}
