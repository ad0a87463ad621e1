//! Reading a problem body to decide a retry, and giving the caller the response whole.

use std::future::poll_fn;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http_body::{Body as _, Frame, SizeHint};
use reqwest::{Body, Response, ResponseBuilderExt};

use crate::decision::{Problem, is_problem};

/// The largest problem body read to decide a retry. A longer one is not parsed (the status
/// decides) and reaches the caller whole all the same.
pub(crate) const PROBLEM_LIMIT: usize = 64 * 1024;

/// An answer, with its problem body's members when it is `application/problem+json` of an error
/// status.
#[derive(Debug)]
pub(crate) struct Answer {
    pub(crate) response: Response,
    pub(crate) problem: Option<Problem>,
}

/// Reads `response`'s body when it is a problem (an error status with
/// `application/problem+json`), up to [`PROBLEM_LIMIT`], and gives the response back with the same
/// status, version, headers, extensions, URL and body. Other responses are not touched.
///
/// Fails when the body could not be read: the connection broke during the answer.
pub(crate) async fn read_answer(response: Response) -> Result<Answer, reqwest::Error> {
    let status = response.status();
    if !(status.is_client_error() || status.is_server_error()) || !is_problem(response.headers()) {
        return Ok(Answer {
            response,
            problem: None,
        });
    }
    let url = response.url().clone();
    let (parts, mut body) = http::Response::<Body>::from(response).into_parts();
    let mut read = BytesMut::new();
    let mut whole = false;
    while read.len() <= PROBLEM_LIMIT {
        match poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await {
            None => {
                whole = true;
                break;
            }
            Some(Err(e)) => return Err(e),
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data() {
                    read.extend_from_slice(&data);
                }
                // Trailers on a problem body carry nothing to decide on; they are dropped.
            }
        }
    }
    let read = read.freeze();
    let problem = if whole { Problem::parse(&read) } else { None };
    let body = if whole {
        Body::from(read)
    } else {
        Body::wrap(Prefixed {
            prefix: Some(read),
            rest: body,
        })
    };
    Ok(Answer {
        response: rebuild(parts, body, url),
        problem,
    })
}

/// A reqwest response from `parts` and `body`, with `url` as its URL.
fn rebuild(mut parts: http::response::Parts, body: Body, url: reqwest::Url) -> Response {
    // The URL travels in an extension only the response builder can set.
    if let Ok(with_url) = http::Response::builder().url(url).body(()) {
        let (with_url, ()) = with_url.into_parts();
        parts.extensions.extend(with_url.extensions);
    }
    Response::from(http::Response::from_parts(parts, body))
}

/// The part of a body already read, then the rest of it.
struct Prefixed {
    prefix: Option<Bytes>,
    rest: Body,
}

impl http_body::Body for Prefixed {
    type Data = Bytes;
    type Error = reqwest::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, reqwest::Error>>> {
        if let Some(prefix) = self.prefix.take() {
            return Poll::Ready(Some(Ok(Frame::data(prefix))));
        }
        Pin::new(&mut self.rest).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.prefix.is_none() && self.rest.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        let prefix = self.prefix.as_ref().map_or(0, |p| p.len() as u64);
        let rest = self.rest.size_hint();
        let mut hint = SizeHint::new();
        hint.set_lower(rest.lower().saturating_add(prefix));
        if let Some(upper) = rest.upper() {
            hint.set_upper(upper.saturating_add(prefix));
        }
        hint
    }
}
