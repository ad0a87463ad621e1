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

#[cfg(feature = "postgres")]
pub(crate) mod transactional;

use std::collections::VecDeque;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};

use axum::body::Body;
use bytes::{Bytes, BytesMut};
use futures_util::FutureExt;
use http::{Response, response::Parts};
use http_body::Frame;
use http_body_util::BodyExt;
use std::time::Duration;
use tokio::sync::mpsc;

use tokio::time::Instant;

use crate::config::Config;
use crate::lease::Lease;
use crate::policy::Disposition;
use crate::problem::{ErrorKind, PROBLEM_JSON};
use crate::record::{Finished, StoredResponse};
use crate::replay;
use crate::store::IdempotencyStore;

/// Frames in flight between the recording task and a slow client.
const CHANNEL_FRAMES: usize = 4;

/// Frames read at once before the body is treated as a stream (a body that is always ready must
/// not keep the request in a loop).
const READY_FRAMES: usize = 64;

type Next = Option<Result<Frame<Bytes>, axum::Error>>;

/// Sorts the handler's response by the policy, then records it (or releases the record) and
/// returns what the client gets.
pub(crate) async fn record<St: IdempotencyStore>(
    config: &Arc<Config>,
    mut lease: Lease<St>,
    response: Response<Body>,
) -> Response<Body> {
    let Some(outcome) = recorded_as(config, &response) else {
        lease.release("the response asks for a retry").await;
        return response;
    };
    let (mut parts, mut body) = response.into_parts();
    let head = head_of(config, outcome, &parts);
    // Dated from now, before the record is written: a little early rather than late.
    if config.expiry_header {
        crate::replay::mark_expiry(&mut parts.headers, config.retention);
    }
    // From here on the effect has happened: whatever goes wrong, the record is not released.
    lease.answered(&head);
    let mut copy = Copy::new(config.response_limit);
    if http_body::Body::size_hint(&body).lower() > config.response_limit as u64 {
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
        lease
            .complete(Arc::new(with_body(head, body.clone())))
            .await;
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
    stream(config, lease, parts, head, copy, ready, body)
}

/// How the policy records `response`: completed or failed, or `None` to release the record.
///
/// The handler has answered, so its effect may have happened: a policy that panics must not
/// release the record (a retry would run the handler again). Its answer is then recorded, as
/// completed for a 2xx and failed otherwise.
pub(crate) fn recorded_as(config: &Config, response: &Response<Body>) -> Option<Finished> {
    let status = response.status();
    let disposition = std::panic::catch_unwind(AssertUnwindSafe(|| (config.policy)(status)));
    match disposition {
        Ok(Disposition::Complete) => Some(Finished::Completed),
        Ok(Disposition::Fail) => Some(Finished::Failed),
        Ok(Disposition::Release) => None,
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
pub(crate) fn handler_timeout(config: &Config) -> StoredResponse {
    let kind = ErrorKind::HandlerTimeout;
    let instance = crate::problem::instance();
    tracing::warn!(error = kind.code(), %instance, "answered with a problem (recorded)");
    let body = config.problems.body(
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
pub(crate) fn head_of(config: &Config, outcome: Finished, parts: &Parts) -> StoredResponse {
    replay::capture(
        outcome,
        parts.status,
        &parts.headers,
        &config.stored_headers,
        None,
    )
}

/// The error a client sees when the handler's body panicked.
fn panicked() -> axum::Error {
    axum::Error::new("the response body panicked")
}

/// The next frame of `body`, a panic in it turned into an error.
async fn next_frame(body: &mut Body) -> Next {
    AssertUnwindSafe(body.frame())
        .catch_unwind()
        .await
        .unwrap_or_else(|_| Some(Err(panicked())))
}

/// Answers at once with a body fed by a task that reads the handler's body, copies it and records
/// the response when it ends, before the client sees the end; or, once the record can only be the
/// status and headers (the body went over the limit, or has trailers), at once, streaming the rest
/// without holding the claim.
fn stream<St: IdempotencyStore>(
    config: &Arc<Config>,
    lease: Lease<St>,
    parts: Parts,
    head: StoredResponse,
    mut copy: Copy,
    ready: VecDeque<Frame<Bytes>>,
    mut body: Body,
) -> Response<Body> {
    let (tx, rx) = mpsc::channel(CHANNEL_FRAMES);
    let finished = Arc::new(AtomicBool::new(false));
    let body_end = finished.clone();
    let patience = config.in_progress_ttl;
    let deadline = lease.deadline();
    let task = async move {
        let mut client = Some(tx);
        let mut ended = false;
        let drained = async {
            for frame in ready {
                forward(&mut client, Ok(frame), patience).await;
            }
            let mut gone_at: Option<Instant> = None;
            while !copy.omitted {
                let next = match &client {
                    Some(tx) => tokio::select! {
                        next = next_frame(&mut body) => next,
                        () = tx.closed() => {
                            client = None;
                            continue;
                        }
                    },
                    None => {
                        // Without a client, read on only while the body still fits the record,
                        // and not for ever.
                        let since = *gone_at.get_or_insert_with(Instant::now);
                        match tokio::time::timeout_at(since + patience, next_frame(&mut body)).await
                        {
                            Ok(next) => next,
                            Err(_) => {
                                copy.omit();
                                break;
                            }
                        }
                    }
                };
                if !on_frame(&mut copy, &mut client, next, patience).await {
                    ended = true;
                    break;
                }
            }
        };
        // The body, like the handler, must be done by the maximum hold.
        if tokio::time::timeout_at(deadline, drained).await.is_err() {
            // The client has seen the handler's status: that is the answer, recorded without its
            // body (as a body whose stream fails is), never a timeout it was not told.
            tracing::warn!(
                "the response body was still streaming at the maximum hold; cut, and recorded \
                 without its body"
            );
            lease.timed_out();
            // Recorded before the client sees the cut, as a body that ends is: a retry sent on
            // the error gets the replay, not 409.
            lease.complete(Arc::new(with_body(head, None))).await;
            // The client's body ends here with an error (`Channel`), after the frames it holds.
            return;
        }
        let recorded = copy.finish();
        lease.complete(Arc::new(with_body(head, recorded))).await;
        // What is left of a body recorded without it streams to the client, the claim finished.
        while !ended && client.is_some() {
            let next = match &client {
                Some(tx) => tokio::select! {
                    next = next_frame(&mut body) => next,
                    () = tx.closed() => break,
                },
                None => break,
            };
            match next {
                None => ended = true,
                Some(frame) => {
                    ended = frame.is_err();
                    forward(&mut client, frame, patience).await;
                }
            }
        }
        // Dropping the sender here ends the body the client reads: after the record. Only a sender
        // still live here has passed on every frame. One dropped before (a client that stopped
        // reading for the patience, then resumes), and any other end of this task (the cut at the
        // maximum hold, a panic, a runtime that shuts down), ends the client's body with an
        // error, never as a whole body.
        if let Some(tx) = client.take() {
            body_end.store(true, Ordering::Release);
            drop(tx);
        }
    };
    config.drain.spawn(task);
    Response::from_parts(
        parts,
        Body::new(Channel {
            rx,
            finished,
            over: false,
        }),
    )
}

/// Handles one frame read from the handler's body; false once the body has ended.
async fn on_frame(
    copy: &mut Copy,
    client: &mut Option<mpsc::Sender<Result<Frame<Bytes>, axum::Error>>>,
    next: Next,
    patience: Duration,
) -> bool {
    match next {
        None => false,
        Some(Ok(frame)) => {
            copy.frame(&frame);
            forward(client, Ok(frame), patience).await;
            true
        }
        Some(Err(e)) => {
            copy.omit();
            forward(client, Err(e), patience).await;
            false
        }
    }
}

/// Sends a frame to the client, forgetting the client once it has gone away, or once it has not
/// taken a frame for `patience` (it stopped reading: it is treated as gone).
async fn forward(
    client: &mut Option<mpsc::Sender<Result<Frame<Bytes>, axum::Error>>>,
    frame: Result<Frame<Bytes>, axum::Error>,
    patience: Duration,
) {
    if let Some(tx) = client {
        match tokio::time::timeout(patience, tx.send(frame)).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => *client = None,
            Err(_) => {
                tracing::info!("the client stopped reading the response; it is treated as gone");
                *client = None;
            }
        }
    }
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

/// The client's side of a streamed body.
struct Channel {
    rx: mpsc::Receiver<Result<Frame<Bytes>, axum::Error>>,
    /// Set by the recording task once the body has ended as the handler's did.
    finished: Arc<AtomicBool>,
    /// The channel has closed (and its end was reported).
    over: bool,
}

impl http_body::Body for Channel {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        if self.over {
            return Poll::Ready(None);
        }
        match std::task::ready!(self.rx.poll_recv(cx)) {
            Some(frame) => Poll::Ready(Some(frame)),
            None => {
                self.over = true;
                if self.finished.load(Ordering::Acquire) {
                    Poll::Ready(None)
                } else {
                    // The task ended without ending the body: the client must not take what it
                    // got for the whole answer.
                    Poll::Ready(Some(Err(axum::Error::new("the response was cut short"))))
                }
            }
        }
    }
}

#[cfg(feature = "postgres")]
/// A body read for a record that must be written before the client sees anything.
pub(crate) struct Read {
    /// The whole body, or `None` when it is omitted from the record.
    pub(crate) copy: Option<Bytes>,
    frames: VecDeque<Frame<Bytes>>,
    error: Option<axum::Error>,
    rest: Option<Body>,
}

#[cfg(feature = "postgres")]
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

#[cfg(feature = "postgres")]
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
mod tests {
    //! The recorders over the memory store, under a paused clock.

    use super::*;
    use crate::lease::tests::{claimed, config};
    use crate::record::{ClaimOutcome, ClaimRequest, LeaseToken};
    use crate::store::MemoryStore;
    use std::sync::atomic::Ordering as AtomicOrdering;

    fn response(status: u16, body: Body) -> Response<Body> {
        Response::builder()
            .status(status)
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(body)
            .expect("response")
    }

    /// What a retry of `claim` finds.
    async fn retry(store: &MemoryStore, claim: &ClaimRequest) -> ClaimOutcome {
        let again = ClaimRequest {
            lease: LeaseToken::generate(),
            ..claim.clone()
        };
        store.claim(&again).await.expect("claim")
    }

    async fn read(response: Response<Body>) -> Bytes {
        response
            .into_body()
            .collect()
            .await
            .expect("body")
            .to_bytes()
    }

    /// The data the client reads of `answer`, and whether its body ended in an error rather than
    /// as a whole body.
    async fn read_to_the_end(answer: Response<Body>) -> (Vec<u8>, bool) {
        use futures_util::StreamExt as _;
        let mut frames = answer.into_body().into_data_stream();
        let mut got = Vec::new();
        while let Some(frame) = frames.next().await {
            match frame {
                Ok(data) => got.extend_from_slice(&data),
                Err(_) => return (got, true),
            }
        }
        (got, false)
    }

    /// A body of `parts`, each after `pause`.
    fn slow_body(parts: &'static [&'static str], pause: Duration) -> Body {
        use futures_util::StreamExt as _;
        let frames = futures_util::stream::iter(parts.iter()).then(move |part| async move {
            tokio::time::sleep(pause).await;
            Ok::<_, std::io::Error>(Frame::data(Bytes::from_static(part.as_bytes())))
        });
        Body::new(http_body_util::StreamBody::new(frames))
    }

    #[tokio::test(start_paused = true)]
    async fn a_whole_body_is_recorded_before_it_is_answered() {
        let (store, config) = (MemoryStore::new(), config());
        let (claim, lease) = claimed(&store, &config, "whole").await;
        let answer = record(&config, lease, response(201, Body::from("{\"id\":1}"))).await;
        // Recorded already: the client has not read a byte yet.
        match retry(&store, &claim).await {
            ClaimOutcome::Finished(stored) => {
                assert_eq!(stored.status, 201);
                assert_eq!(&stored.body[..], b"{\"id\":1}");
                assert!(!stored.body_omitted);
            }
            other => panic!("expected the record, got {other:?}"),
        }
        assert_eq!(&read(answer).await[..], b"{\"id\":1}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_streamed_body_is_recorded_when_it_ends_and_reaches_the_client_first() {
        use futures_util::StreamExt as _;
        let (store, config) = (MemoryStore::new(), config());
        let (claim, lease) = claimed(&store, &config, "stream").await;
        let body = slow_body(&["part1;", "part2;", "part3"], Duration::from_millis(100));
        let answer = record(&config, lease, response(201, body)).await;
        // The headers are the client's at once; the record waits for the body's end.
        assert_eq!(answer.status(), 201);
        assert!(matches!(
            retry(&store, &claim).await,
            ClaimOutcome::InProgress
        ));
        let mut frames = answer.into_body().into_data_stream();
        let first = frames.next().await.expect("a frame").expect("data");
        assert_eq!(&first[..], b"part1;");
        assert!(matches!(
            retry(&store, &claim).await,
            ClaimOutcome::InProgress
        ));
        let mut rest = Vec::new();
        while let Some(frame) = frames.next().await {
            rest.extend_from_slice(&frame.expect("data"));
        }
        assert_eq!(&rest[..], b"part2;part3");
        match retry(&store, &claim).await {
            ClaimOutcome::Finished(stored) => {
                assert_eq!(&stored.body[..], b"part1;part2;part3");
            }
            other => panic!("expected the record, got {other:?}"),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_streamed_body_whose_completion_panics_still_ends_whole_and_is_recorded() {
        let (store, config) = (crate::lease::tests::store(), config());
        store.complete_panics.store(true, AtomicOrdering::SeqCst);
        let (claim, lease) = claimed(&store, &config, "panics").await;
        let body = slow_body(&["part1;", "part2"], Duration::from_millis(100));
        let answer = record(&config, lease, response(201, body)).await;
        assert_eq!(&read(answer).await[..], b"part1;part2");
        assert!(config.drain.wait(Duration::from_secs(5)).await);
        match retry(&store.inner, &claim).await {
            ClaimOutcome::Finished(stored) => assert_eq!(&stored.body[..], b"part1;part2"),
            other => panic!("expected the record, got {other:?}"),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_cut_at_the_maximum_hold_ends_in_an_error_even_when_its_completion_panics() {
        for panics in [false, true] {
            let store = crate::lease::tests::store();
            store.complete_panics.store(panics, AtomicOrdering::SeqCst);
            let config = Arc::new(Config {
                in_progress_ttl: Duration::from_millis(900),
                max_hold: Duration::from_millis(250),
                ..Config::default()
            });
            let (claim, lease) = claimed(&store, &config, "cut").await;
            let body = slow_body(&["a", "b", "c", "d", "e"], Duration::from_millis(100));
            let answer = record(&config, lease, response(201, body)).await;
            let (got, ended_in_error) = read_to_the_end(answer).await;
            assert!(
                ended_in_error,
                "a cut body must not look whole (panics: {panics})"
            );
            assert_eq!(&got[..], b"ab", "the frames before the hold ran out");
            assert!(config.drain.wait(Duration::from_secs(5)).await);
            match retry(&store.inner, &claim).await {
                ClaimOutcome::Finished(stored) => {
                    assert_eq!(stored.status, 201);
                    assert!(stored.body_omitted);
                }
                other => panic!("expected the record without its body, got {other:?}"),
            }
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_client_that_stopped_reading_past_the_patience_never_sees_a_whole_body() {
        let (store, config) = (MemoryStore::new(), config());
        let (claim, lease) = claimed(&store, &config, "stalled").await;
        let parts = &["0", "1", "2", "3", "4", "5", "6", "7", "8", "9"];
        let body = slow_body(parts, Duration::from_millis(10));
        let answer = record(&config, lease, response(201, body)).await;
        // The client reads nothing for longer than the patience (the in-progress TTL): it is
        // treated as gone, and the body is read and recorded without it.
        tokio::time::sleep(config.in_progress_ttl * 2).await;
        match retry(&store, &claim).await {
            ClaimOutcome::Finished(stored) => assert_eq!(&stored.body[..], b"0123456789"),
            other => panic!("expected the record, got {other:?}"),
        }
        // Then it reads again: what was on its way, then an error, never a clean end.
        let (got, ended_in_error) = read_to_the_end(answer).await;
        assert!(got.len() < parts.len(), "frames were dropped: {got:?}");
        assert!(ended_in_error, "a body missing frames must not end cleanly");
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_over_the_limit_reaches_the_client_whole_and_is_recorded_without_it() {
        let store = MemoryStore::new();
        let config = Arc::new(Config {
            response_limit: 8,
            ..Config::default()
        });
        let (claim, lease) = claimed(&store, &config, "big").await;
        let big = "x".repeat(100);
        let answer = record(&config, lease, response(201, Body::from(big.clone()))).await;
        assert_eq!(read(answer).await, big.as_bytes());
        assert!(config.drain.wait(Duration::from_secs(5)).await);
        match retry(&store, &claim).await {
            ClaimOutcome::Finished(stored) => {
                assert_eq!(stored.status, 201);
                assert!(stored.body_omitted);
                assert!(stored.body.is_empty());
            }
            other => panic!("expected the record, got {other:?}"),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_retryable_answer_releases_the_record() {
        let (store, config) = (MemoryStore::new(), config());
        let (claim, lease) = claimed(&store, &config, "retry").await;
        let answer = record(&config, lease, response(503, Body::from("later"))).await;
        assert_eq!(answer.status(), 503);
        assert!(matches!(
            retry(&store, &claim).await,
            ClaimOutcome::Claimed { .. }
        ));
    }

    #[cfg(feature = "postgres")]
    #[tokio::test(start_paused = true)]
    async fn a_body_still_going_at_the_deadline_is_left_out_and_still_reaches_the_client() {
        let body = slow_body(&["a", "b", "c"], Duration::from_millis(100));
        let read = read_up_to(body, 1024, Instant::now() + Duration::from_millis(150)).await;
        assert!(read.copy.is_none(), "cut at the deadline: not recorded");
        let whole = body_of(read).collect().await.expect("body").to_bytes();
        assert_eq!(&whole[..], b"abc", "what was read, then the rest");
    }
}
