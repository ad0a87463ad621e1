//! Bounded buffering of request bodies.

use axum::body::Body;
use bytes::Bytes;
use http::{HeaderMap, header};
use http_body_util::{BodyExt, LengthLimitError, Limited};

/// Why a request body was not read.
#[derive(Debug)]
pub(crate) enum RequestBodyError {
    /// Over the limit, by `Content-Length` or by what arrived.
    TooLarge,
    /// The body stream failed (for example, the client went away).
    Unreadable(String),
}

/// Reads a whole request body of at most `limit` bytes: a declared `Content-Length` over the limit is
/// refused before anything is read, and the stream itself is cut off at the limit.
pub(crate) async fn read_request(
    headers: &HeaderMap,
    body: Body,
    limit: usize,
) -> Result<Bytes, RequestBodyError> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if declared.is_some_and(|len| len > limit as u64) {
        return Err(RequestBodyError::TooLarge);
    }
    match Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.is::<LengthLimitError>() => Err(RequestBodyError::TooLarge),
        Err(e) => Err(RequestBodyError::Unreadable(e.to_string())),
    }
}
