//! Recording the handler's answer while it reaches the client.
//!
//! The response is sorted by the policy. A response to record is copied into the record up to the
//! recording limit while it is passed on:
//!
//! - a body that is whole at once (the usual `Json`, `String` or `Bytes` body) is recorded first and
//!   then answered, so an immediate retry already gets the replay;
//! - any other body is streamed: the client gets the headers at once and each frame as the handler
//!   produces it, while a task of its own (holding the lease, heartbeat running) copies the frames
//!   and records the response when the body ends, before the client sees the end. A client that goes
//!   away does not stop the recording: the rest of the body is read (up to the recording limit, and
//!   for at most the in-progress TTL) without it.
//!
//! A body over the recording limit, one with trailers, or one whose stream fails is recorded as its
//! status and headers with the body omitted; never released, since the effect has happened.
//!
//! An answer is never sent whole before it is recorded ([`unrecorded`]): should the store not take
//! it (the completion goes on in the background) and this process die, a retake would run the
//! work again and answer the retry with another result than the one this client was given.

mod stream;
#[cfg_attr(not(sql), allow(dead_code))]
pub(crate) mod transactional;

use std::collections::VecDeque;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::Body;
use bytes::{Bytes, BytesMut};
use futures_util::FutureExt;
use http::{Response, response::Parts};
use http_body::Frame;
use http_body_util::BodyExt;

use tokio::time::Instant;

use super::policy::Disposition;
use super::problem::{ErrorKind, PROBLEM_JSON};
use super::replay;
use super::settings::LayerSettings;
use crate::engine::{Completed, Lease};
use crate::store::{Finished, IdempotencyStore, StoredResponse};

/// Frames in flight between the recording task and a slow client.
const CHANNEL_FRAMES: usize = 4;

/// Frames read at once before the body is treated as a stream (a body that is always ready must
/// not keep the request in a loop).
const READY_FRAMES: usize = 64;

type Next = Option<Result<Frame<Bytes>, axum::Error>>;

/// Sorts the handler's response by the policy, then records it (or releases the record) and
/// returns what the client gets.
pub(crate) async fn record<St: IdempotencyStore>(
    http: &LayerSettings,
    mut lease: Lease<St>,
    response: Response<Body>,
) -> Response<Body> {
    let (outcome, response) = sorted(http, response);
    let Some(outcome) = outcome else {
        lease.release("the response asks for a retry").await;
        return response;
    };
    let (mut parts, mut body) = response.into_parts();
    let head = head_of(http, outcome, &parts);
    // Dated from now, before the record is written: a little early rather than late.
    if http.expiry_header {
        replay::mark_expiry(&mut parts.headers, lease.engine().settings().retention);
    }
    // From here on the effect has happened: whatever goes wrong, the record is not released.
    lease.answered(&head);
    let mut copy = Copy::new(http.response_limit);
    if http_body::Body::size_hint(&body).lower() > http.response_limit as u64 {
        copy.omit();
    }
    // Read what the body has ready now, up to the limit.
    let mut ready: VecDeque<Frame<Bytes>> = VecDeque::new();
    let mut error = None;
    let ended = loop {
        if (copy.omitted && !ready.is_empty()) || ready.len() >= READY_FRAMES {
            break false; // stream the rest rather than buffer it
        }
        let next = std::panic::catch_unwind(AssertUnwindSafe(|| body.frame().now_or_never()));
        match next.unwrap_or_else(|_| Some(Some(Err(panicked())))) {
            None => break false,
            Some(None) => break true,
            Some(Some(Ok(frame))) => {
                copy.frame(&frame);
                ready.push_back(frame);
            }
            Some(Some(Err(e))) => {
                copy.omit();
                error = Some(e);
                break true;
            }
        }
    };
    if ended {
        let body = copy.finish();
        let completed = lease
            .complete(Arc::new(with_body(head, body.clone())))
            .await;
        if let Some(instead) = unrecorded(http, completed) {
            return instead;
        }
        return match body {
            Some(whole) => Response::from_parts(parts, Body::from(whole)),
            None => Response::from_parts(
                parts,
                Body::new(Prefixed {
                    ready,
                    error,
                    rest: None,
                }),
            ),
        };
    }
    stream::stream(lease, parts, head, copy, ready, body)
}

/// What the client gets instead of an answer whose record is not written (`None` once it is): the
/// retry of the same request with the same key gets the record's answer, whatever it turns out to
/// be.
/// - The completion is still being retried: `503`, retryable (`409 in_progress` follows until the
///   record is written, then the replay).
/// - The lease was lost (another attempt retook the record): `409 in_progress`; the record's
///   answer is the retaker's.
pub(crate) fn unrecorded(http: &LayerSettings, completed: Completed) -> Option<Response<Body>> {
    match completed {
        Completed::Recorded => None,
        Completed::Retrying => Some(http.retryable(
            ErrorKind::StoreUnavailable,
            "the operation ran, but its answer could not be recorded yet; retry with the same \
             Idempotency-Key for it",
        )),
        Completed::Lost => Some(taken_over(http)),
    }
}

/// The answer to a request whose lease was lost while it ran: another attempt retook the record,
/// and the record's answer is that attempt's.
pub(crate) fn taken_over(http: &LayerSettings) -> Response<Body> {
    http.retryable(
        ErrorKind::InProgress,
        "this request was taken over by another attempt; retry later for its answer",
    )
}

/// How `response` is recorded: completed or failed, or `None` to release the record; and the
/// response itself (whose body may have been read, whole, to tell an extractor's rejection).
///
/// The first that speaks decides:
/// 1. a [`Disposition`] the handler put in the response's extensions;
/// 2. `Cache-Control: no-store` on the response, where the layer is set to release those;
/// 3. one of axum's extractor rejections (the request failed validation before the handler ran),
///    released unless the layer is set to record them;
/// 4. the status policy.
pub(crate) fn sorted(
    http: &LayerSettings,
    mut response: Response<Body>,
) -> (Option<Finished>, Response<Body>) {
    if let Some(disposition) = response.extensions_mut().remove::<Disposition>() {
        return (finished(disposition), response);
    }
    if http.release_no_store && super::policy::says_no_store(response.headers()) {
        return (None, response);
    }
    if http.release_rejections {
        let (rejection, peeked) = super::policy::is_rejection(response);
        response = peeked;
        if rejection {
            return (None, response);
        }
    }
    (recorded_as(http, &response), response)
}

fn finished(disposition: Disposition) -> Option<Finished> {
    match disposition {
        Disposition::Complete => Some(Finished::Completed),
        Disposition::Fail => Some(Finished::Failed),
        Disposition::Release => None,
    }
}

/// How the status policy records `response`: completed or failed, or `None` to release the record.
///
/// The handler has answered, so its effect may have happened: a policy that panics must not
/// release the record (a retry would run the handler again). Its answer is then recorded, as
/// completed for a 2xx and failed otherwise.
fn recorded_as(http: &LayerSettings, response: &Response<Body>) -> Option<Finished> {
    let status = response.status();
    let disposition = std::panic::catch_unwind(AssertUnwindSafe(|| (http.policy)(status)));
    match disposition {
        Ok(disposition) => finished(disposition),
        Err(_) => {
            tracing::error!(
                status = status.as_u16(),
                "the response policy panicked; the answer is recorded, since its effect may have \
                 happened"
            );
            Some(if status.is_success() {
                Finished::Completed
            } else {
                Finished::Failed
            })
        }
    }
}

/// The record of a handler (or a streamed body) cancelled at the maximum hold: a definitive
/// `504 idempotency_handler_timeout`, replayed for the key, since its effect may have happened.
pub(crate) fn handler_timeout(http: &LayerSettings) -> StoredResponse {
    #[cfg(feature = "grpc")]
    if http.grpc.is_some() {
        return super::grpc::handler_timeout();
    }
    let kind = ErrorKind::HandlerTimeout;
    let instance = super::problem::instance();
    tracing::warn!(error = kind.code(), %instance, "answered with a problem (recorded)");
    let body = http.problems.body(
        kind,
        "the operation did not finish within the time allowed and was cancelled; it may have \
         taken effect, so it is not run again for this Idempotency-Key",
        None,
        &instance,
    );
    StoredResponse {
        outcome: Finished::Failed,
        status: kind.status().as_u16(),
        headers: vec![(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static(PROBLEM_JSON),
        )],
        body: Bytes::from(body),
        body_omitted: false,
        expires_in: None,
    }
}

/// The record of a response's status and allowed headers, its body still to come.
pub(crate) fn head_of(http: &LayerSettings, outcome: Finished, parts: &Parts) -> StoredResponse {
    replay::capture(
        outcome,
        parts.status,
        &parts.headers,
        &http.stored_headers,
        None,
    )
}

/// The error a client sees when the handler's body panicked.
fn panicked() -> axum::Error {
    axum::Error::new("the response body panicked")
}

/// The next frame of `body`, a panic in it turned into an error.
pub(crate) async fn next_frame(body: &mut Body) -> Next {
    AssertUnwindSafe(body.frame())
        .catch_unwind()
        .await
        .unwrap_or_else(|_| Some(Err(panicked())))
}

fn with_body(head: StoredResponse, body: Option<Bytes>) -> StoredResponse {
    StoredResponse {
        body_omitted: body.is_none(),
        body: body.unwrap_or_default(),
        ..head
    }
}

/// The copy of a body kept for the record: its data up to `limit` bytes, or nothing once it is over
/// the limit or has trailers.
struct Copy {
    chunks: Vec<Bytes>,
    len: usize,
    limit: usize,
    omitted: bool,
}

impl Copy {
    fn new(limit: usize) -> Self {
        Copy {
            chunks: Vec::new(),
            len: 0,
            limit,
            omitted: false,
        }
    }

    fn frame(&mut self, frame: &Frame<Bytes>) {
        if self.omitted {
            return;
        }
        match frame.data_ref() {
            Some(data) => {
                self.len += data.len();
                if self.len > self.limit {
                    self.omit();
                } else if !data.is_empty() {
                    self.chunks.push(data.clone());
                }
            }
            None => self.omit(), // trailers are not recorded
        }
    }

    fn omit(&mut self) {
        self.omitted = true;
        self.chunks = Vec::new();
    }

    /// The whole body, or `None` when it is omitted.
    fn finish(self) -> Option<Bytes> {
        if self.omitted {
            return None;
        }
        Some(match self.chunks.len() {
            0 => Bytes::new(),
            1 => self.chunks.into_iter().next().unwrap_or_default(),
            _ => {
                let mut whole = BytesMut::with_capacity(self.len);
                for chunk in &self.chunks {
                    whole.extend_from_slice(chunk);
                }
                whole.freeze()
            }
        })
    }
}

/// Frames already read, then maybe the error that ended them, then the rest of the body.
struct Prefixed {
    ready: VecDeque<Frame<Bytes>>,
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
        if let Some(frame) = self.ready.pop_front() {
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
        self.ready.is_empty()
            && self.error.is_none()
            && self
                .rest
                .as_ref()
                .is_none_or(http_body::Body::is_end_stream)
    }
}

#[cfg_attr(not(sql), allow(dead_code))]
/// A body read for a record that must be written before the client sees anything.
pub(crate) struct Read {
    /// The whole body, or `None` when it is omitted from the record.
    pub(crate) copy: Option<Bytes>,
    frames: VecDeque<Frame<Bytes>>,
    error: Option<axum::Error>,
    rest: Option<Body>,
}

#[cfg_attr(not(sql), allow(dead_code))]
/// Reads `body` until it ends or is over `limit` (or has trailers, fails, panics, or is still
/// going at `deadline`); what is left is unread, to be streamed to the client afterwards.
pub(crate) async fn read_up_to(mut body: Body, limit: usize, deadline: Instant) -> Read {
    let mut copy = Copy::new(limit);
    let mut frames = VecDeque::new();
    // What the client gets past a body left out of the record: what was read, then the rest.
    let unfinished = |frames, body| Read {
        copy: None,
        frames,
        error: None,
        rest: Some(body),
    };
    if http_body::Body::size_hint(&body).lower() > limit as u64 {
        return unfinished(frames, body);
    }
    loop {
        let Ok(next) = tokio::time::timeout_at(deadline, next_frame(&mut body)).await else {
            // A body that does not end (events, a stall) is recorded without it.
            return unfinished(frames, body);
        };
        match next {
            None => break,
            Some(Ok(frame)) => {
                copy.frame(&frame);
                frames.push_back(frame);
                if copy.omitted {
                    return unfinished(frames, body);
                }
            }
            Some(Err(e)) => {
                copy.omit();
                return Read {
                    copy: None,
                    frames,
                    error: Some(e),
                    rest: None,
                };
            }
        }
    }
    Read {
        copy: copy.finish(),
        frames,
        error: None,
        rest: None,
    }
}

#[cfg_attr(not(sql), allow(dead_code))]
/// The body the client gets for what [`read_up_to`] read: the whole body, or what was read followed
/// by the rest of the stream.
pub(crate) fn body_of(read: Read) -> Body {
    match read.copy {
        Some(whole) => Body::from(whole),
        None => Body::new(Prefixed {
            ready: read.frames,
            error: read.error,
            rest: read.rest,
        }),
    }
}

#[cfg(test)]
mod tests;
