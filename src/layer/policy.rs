//! Which responses are recorded for replay, and which release the key for another try: the
//! handler's own say, `no-store`, the extractors' rejections, and the status policy.

use std::collections::VecDeque;

use axum::body::Body;
use bytes::Bytes;
use futures_util::FutureExt;
use http::{HeaderMap, Response, StatusCode};
use http_body::Frame;
use http_body_util::BodyExt;

/// What happens to a claimed record once the handler has answered.
///
/// The layer's [`response_policy`](crate::IdempotencyLayerBuilder::response_policy) decides from
/// the status. A handler that knows better puts a `Disposition` in its response's extensions, and
/// it decides for that response:
///
/// - a provider answered "charged" but the handler's own write failed, and it answers `500`: the
///   charge happened, so the answer is recorded, not released for a retry that would charge again
///   (`Disposition::Fail`);
/// - a validation error found before any effect, answered `400` or `422`: nothing happened, so
///   the key is released and the corrected request runs (`Disposition::Release`).
///
/// ```
/// use axum::response::IntoResponse;
/// use axum_idempotency::Disposition;
/// use http::StatusCode;
///
/// async fn checkout() -> axum::response::Response {
///     // Refused before any effect: released, so the corrected request runs with the same key.
///     (
///         Disposition::Release,
///         (StatusCode::UNPROCESSABLE_ENTITY, "amount must be positive"),
///     )
///         .into_response()
/// }
/// # let _ = checkout;
/// ```
///
/// (`Disposition` is an [`IntoResponseParts`](axum::response::IntoResponseParts); elsewhere,
/// `response.extensions_mut().insert(Disposition::Release)`.)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Disposition {
    /// Record the response as `completed` and replay it to every retry.
    Complete,
    /// Record the response as `failed` (a definitive error) and replay it to every retry.
    Fail,
    /// Delete the record, so that a retry runs the handler again.
    Release,
}

impl axum::response::IntoResponseParts for Disposition {
    type Error = std::convert::Infallible;

    fn into_response_parts(
        self,
        mut res: axum::response::ResponseParts,
    ) -> Result<axum::response::ResponseParts, Self::Error> {
        res.extensions_mut().insert(self);
        Ok(res)
    }
}

/// Whether `headers` say `Cache-Control: no-store` (a directive of any of its values, in any
/// case).
pub(crate) fn says_no_store(headers: &HeaderMap) -> bool {
    headers
        .get_all(http::header::CACHE_CONTROL)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .any(|directive| {
            let name = directive.split('=').next().unwrap_or_default();
            name.trim().eq_ignore_ascii_case("no-store")
        })
}

/// The start of every answer axum's extractors give when they refuse a request (axum 0.8): a
/// JSON, form or query body or string that does not parse or fit its type, a missing content
/// type, a body that could not be read or is over axum's limit, a path that does not parse.
const REJECTIONS: [&str; 10] = [
    "Failed to deserialize the JSON body into the target type",
    "Failed to parse the request body as JSON",
    "Expected request with `Content-Type: application/json`",
    "Form requests must have `Content-Type: application/x-www-form-urlencoded`",
    "Failed to deserialize form",
    "Failed to deserialize query string",
    "Failed to buffer the request body",
    "Request body didn't contain valid UTF-8",
    "Invalid URL: ",
    "Invalid UTF-8 in `",
];

/// The longest body an extractor's rejection has (its text and the parser's message).
const MAX_REJECTION_LEN: u64 = 4096;

/// Whether `response` is one of axum's extractor rejections: a `400`, `413`, `415` or `422` in
/// `text/plain`, whole at once, whose text starts as axum's do. Answers the response too, its body
/// as it was (read here only when it might be one, and then whole and ready).
pub(crate) fn is_rejection(response: Response<Body>) -> (bool, Response<Body>) {
    let might_be = matches!(response.status().as_u16(), 400 | 413 | 415 | 422)
        && response
            .headers()
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/plain"))
        && http_body::Body::size_hint(response.body())
            .exact()
            .is_some_and(|len| len <= MAX_REJECTION_LEN);
    if !might_be {
        return (false, response);
    }
    let (parts, mut body) = response.into_parts();
    // The body's frames that are ready now; a body that is not whole at once is no rejection's.
    let mut frames = VecDeque::new();
    let mut error = None;
    let mut text = Vec::new();
    let whole = loop {
        let next =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| body.frame().now_or_never()));
        match next {
            Ok(Some(Some(Ok(frame)))) => {
                if let Some(data) = frame.data_ref() {
                    text.extend_from_slice(data);
                }
                frames.push_back(frame);
            }
            Ok(Some(None)) => break true,
            Ok(None) => break false,
            Ok(Some(Some(Err(e)))) => {
                error = Some(e);
                break false;
            }
            Err(_) => {
                error = Some(axum::Error::new("the response body panicked"));
                break false;
            }
        }
        if text.len() as u64 > MAX_REJECTION_LEN {
            break false;
        }
    };
    let rejection = whole
        && std::str::from_utf8(&text)
            .is_ok_and(|text| REJECTIONS.iter().any(|start| text.starts_with(start)));
    let rest = (!whole && error.is_none()).then_some(body);
    let body = Body::new(ReadAhead {
        frames,
        error,
        rest,
    });
    (rejection, Response::from_parts(parts, body))
}

/// The frames read ahead of a body (and the error that ended it, if one did), then the rest of it.
struct ReadAhead {
    frames: VecDeque<Frame<Bytes>>,
    error: Option<axum::Error>,
    rest: Option<Body>,
}

impl http_body::Body for ReadAhead {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if let Some(frame) = self.frames.pop_front() {
            return std::task::Poll::Ready(Some(Ok(frame)));
        }
        if let Some(e) = self.error.take() {
            return std::task::Poll::Ready(Some(Err(e)));
        }
        match self.rest.as_mut() {
            Some(rest) => std::pin::Pin::new(rest).poll_frame(cx),
            None => std::task::Poll::Ready(None),
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

    fn size_hint(&self) -> http_body::SizeHint {
        let ahead: u64 = self
            .frames
            .iter()
            .filter_map(|f| f.data_ref().map(|d| d.len() as u64))
            .sum();
        let rest = self.rest.as_ref().map_or_else(
            || http_body::SizeHint::with_exact(0),
            http_body::Body::size_hint,
        );
        // What follows is told by its own hint, which a body may not keep exact as it is read:
        // only a lower bound is claimed for it.
        let mut hint = http_body::SizeHint::new();
        if self.rest.is_none() {
            hint.set_upper(ahead);
        }
        hint.set_lower(rest.lower().saturating_add(ahead));
        hint
    }
}

/// The default response policy.
///
/// - 2xx and 3xx: [`Disposition::Complete`] (a redirect such as `303 See Other` is a final answer);
/// - 4xx: [`Disposition::Fail`], except `408`, `409`, `425` and `429`, which say "try again" and so
///   [`Disposition::Release`];
/// - 5xx, and the informational 1xx that a handler should never return: [`Disposition::Release`].
pub fn default_policy(status: StatusCode) -> Disposition {
    match status.as_u16() {
        200..=399 => Disposition::Complete,
        408 | 409 | 425 | 429 => Disposition::Release,
        400..=499 => Disposition::Fail,
        _ => Disposition::Release,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn of(code: u16) -> Disposition {
        default_policy(StatusCode::from_u16(code).expect("valid status"))
    }

    #[test]
    fn default_policy_follows_the_spec() {
        for code in [200, 201, 202, 204, 299, 303] {
            assert_eq!(of(code), Disposition::Complete, "{code}");
        }
        for code in [400, 401, 402, 403, 404, 410, 422, 499] {
            assert_eq!(of(code), Disposition::Fail, "{code}");
        }
        for code in [408, 409, 425, 429, 500, 502, 503, 504, 599, 102] {
            assert_eq!(of(code), Disposition::Release, "{code}");
        }
    }
}
