//! Bounded buffering of request and response bodies.

use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll};

use axum::body::Body;
use bytes::{Bytes, BytesMut};
use http::{HeaderMap, header};
use http_body::{Frame, SizeHint};
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

/// A response body read for recording.
pub(crate) enum ResponseBody {
    /// The whole body, within the limit.
    Whole(Bytes),
    /// Over the limit, or the stream failed: the body to pass on to the client as it is.
    Passed(Body),
}

/// Reads a response body if it fits in `limit` bytes. When it does not, when it has trailers (which
/// are not recorded), or when its stream fails, what was read is put back in front of the rest, so the
/// client still gets the response unchanged.
pub(crate) async fn read_response(mut body: Body, limit: usize) -> ResponseBody {
    if http_body::Body::size_hint(&body).lower() > limit as u64 {
        return ResponseBody::Passed(body);
    }
    let mut frames: VecDeque<Frame<Bytes>> = VecDeque::new();
    let mut len = 0usize;
    let pass = |frames, error, rest| {
        ResponseBody::Passed(Body::new(Prefixed {
            frames,
            error,
            rest,
        }))
    };
    loop {
        match body.frame().await {
            None => break,
            Some(Ok(frame)) => {
                let Some(data) = frame.data_ref() else {
                    frames.push_back(frame);
                    return pass(frames, None, Some(body));
                };
                len += data.len();
                frames.push_back(frame);
                if len > limit {
                    return pass(frames, None, Some(body));
                }
            }
            Some(Err(e)) => return pass(frames, Some(e), None),
        }
    }
    let mut data = frames.into_iter().filter_map(|f| f.into_data().ok());
    let whole = match (data.next(), data.next()) {
        (None, _) => Bytes::new(),
        (Some(only), None) => only,
        (Some(first), Some(second)) => {
            let mut whole = BytesMut::with_capacity(len);
            for chunk in [first, second].into_iter().chain(data) {
                whole.extend_from_slice(&chunk);
            }
            whole.freeze()
        }
    };
    ResponseBody::Whole(whole)
}

/// Frames already read, then an error or the rest of the body.
struct Prefixed {
    frames: VecDeque<Frame<Bytes>>,
    error: Option<axum::Error>,
    rest: Option<Body>,
}

impl http_body::Body for Prefixed {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        if let Some(frame) = self.frames.pop_front() {
            return Poll::Ready(Some(Ok(frame)));
        }
        if let Some(e) = self.error.take() {
            return Poll::Ready(Some(Err(e)));
        }
        match self.rest.as_mut() {
            Some(rest) => Pin::new(rest).poll_frame(cx),
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.frames.is_empty()
            && self.error.is_none()
            && self
                .rest
                .as_ref()
                .is_none_or(http_body::Body::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        let buffered: u64 = self
            .frames
            .iter()
            .filter_map(|f| f.data_ref())
            .map(|d| d.len() as u64)
            .sum();
        let rest = self
            .rest
            .as_ref()
            .map_or_else(|| SizeHint::with_exact(0), http_body::Body::size_hint);
        let mut hint = SizeHint::new();
        hint.set_lower(rest.lower() + buffered);
        if let Some(upper) = rest.upper() {
            hint.set_upper(upper + buffered);
        }
        hint
    }
}
