//! Bounded buffering of request bodies.
//!
//! A body over a length limit is refused with `413` whoever set the limit: the layer's own, or one
//! set outside the layer (tower-http's `RequestBodyLimitLayer` wraps the body in `Limited`, whose
//! error reaches the layer boxed inside the body's own error). Such a client sent too much, not a
//! broken body, and must be told to send less rather than to send the same again.

use std::error::Error;

use axum::body::Body;
use bytes::Bytes;
use http::{HeaderMap, header};
use http_body_util::{BodyExt, LengthLimitError, Limited};

/// Why a request body was not read.
#[derive(Debug)]
pub(crate) enum RequestBodyError {
    /// Over the layer's limit, by `Content-Length` or by what arrived.
    TooLarge,
    /// Over a limit set outside the layer, by what arrived (its size is not known here).
    OverOuterLimit,
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
        Err(e) if over_a_length_limit(e.as_ref()) => Err(RequestBodyError::OverOuterLimit),
        Err(e) => Err(RequestBodyError::Unreadable(e.to_string())),
    }
}

/// Whether `error`, or an error it was caused by, is a [`LengthLimitError`]: a limit set outside
/// the layer reaches it wrapped in the body's error.
fn over_a_length_limit(error: &(dyn Error + 'static)) -> bool {
    // Bounded: a source chain is the body's, and nothing says it ends.
    const MAX_DEPTH: usize = 16;
    std::iter::successors(Some(error), |&e| e.source())
        .take(MAX_DEPTH)
        .any(|e| e.is::<LengthLimitError>())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A body of `len` bytes in frames of 8, with no length known in advance (as a chunked one).
    fn chunked(len: usize) -> Body {
        let frames = (0..len.div_ceil(8)).map(move |i| {
            let n = 8.min(len - i * 8);
            Ok::<_, std::io::Error>(http_body::Frame::data(Bytes::from(vec![b'x'; n])))
        });
        Body::new(http_body_util::StreamBody::new(futures_util::stream::iter(
            frames,
        )))
    }

    #[tokio::test]
    async fn a_body_over_a_limit_set_outside_the_layer_is_too_large() {
        // As tower-http's `RequestBodyLimitLayer` hands it on: limited to 16 bytes, then made an
        // axum body again by the router.
        let outside = Body::new(Limited::new(chunked(64), 16));
        let read = read_request(&HeaderMap::new(), outside, 1024).await;
        assert!(
            matches!(read, Err(RequestBodyError::OverOuterLimit)),
            "{read:?}"
        );
    }

    #[tokio::test]
    async fn a_body_over_the_layers_own_limit_is_too_large() {
        let read = read_request(&HeaderMap::new(), chunked(64), 16).await;
        assert!(matches!(read, Err(RequestBodyError::TooLarge)), "{read:?}");
    }

    #[tokio::test]
    async fn a_body_whose_stream_fails_is_unreadable_not_too_large() {
        let failing = futures_util::stream::iter([Err::<http_body::Frame<Bytes>, _>(
            std::io::Error::other("connection reset"),
        )]);
        let body = Body::new(http_body_util::StreamBody::new(failing));
        let read = read_request(&HeaderMap::new(), Body::new(Limited::new(body, 16)), 1024).await;
        assert!(
            matches!(read, Err(RequestBodyError::Unreadable(_))),
            "{read:?}"
        );
    }

    #[tokio::test]
    async fn a_body_within_both_limits_is_read_whole() {
        let body = Body::new(Limited::new(chunked(20), 32));
        let read = read_request(&HeaderMap::new(), body, 1024).await;
        assert_eq!(read.ok().map(|b| b.len()), Some(20));
    }
}
