//! A streamed answer: the client gets the headers at once and each frame as the handler produces
//! it, while a task of its own (holding the lease, heartbeat running) copies the frames and records
//! the response when the body ends, before the client sees the end.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use bytes::Bytes;
use http::{Response, response::Parts};
use http_body::Frame;
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::{CHANNEL_FRAMES, Copy, Next, next_frame, with_body};
use crate::engine::{Completed, Lease};
use crate::store::{IdempotencyStore, StoredResponse};

/// Answers at once with a body fed by a task that reads the handler's body, copies it and records
/// the response when it ends, before the client sees the end; or, once the record can only be the
/// status and headers (the body went over the limit, or has trailers), at once, streaming the rest
/// without holding the claim.
pub(super) fn stream<St: IdempotencyStore>(
    lease: Lease<St>,
    mut parts: Parts,
    head: StoredResponse,
    mut copy: Copy,
    ready: VecDeque<Frame<Bytes>>,
    mut body: Body,
) -> Response<Body> {
    // The end of the body is the client's sign that it has the whole answer, and it comes only
    // after the record: with a declared length, from the byte that fills it on (see `Held`).
    let mut declared = parts
        .headers
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared == Some(0) {
        // Whole with its head: no byte to hold back. Without the length, its end (the last
        // chunk) comes after the record.
        parts.headers.remove(http::header::CONTENT_LENGTH);
        declared = None;
    }
    let (tx, rx) = mpsc::channel(CHANNEL_FRAMES);
    let finished = Arc::new(AtomicBool::new(false));
    let body_end = finished.clone();
    let patience = lease.engine().settings().in_progress_ttl;
    let deadline = lease.deadline();
    let drain = lease.engine().drain().clone();
    let task = async move {
        let mut client = Some(tx);
        let mut ended = false;
        let mut held = Held {
            declared,
            ..Held::default()
        };
        let drained = async {
            for frame in ready {
                pass(&mut client, Ok(frame), patience, &mut held).await;
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
                if !on_frame(&mut copy, &mut client, next, patience, &mut held).await {
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
        if lease.complete(Arc::new(with_body(head, recorded))).await != Completed::Recorded {
            // Not the record's answer (yet): the client's body ends with an error, not whole, and
            // its retry gets the record's answer.
            client = None;
        }
        for tail in std::mem::take(&mut held.tail) {
            forward(&mut client, Ok(Frame::data(tail)), patience).await;
        }
        if let Some(trailers) = held.trailers.take() {
            forward(&mut client, Ok(trailers), patience).await;
        }
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
    drain.spawn(task);
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
    held: &mut Held,
) -> bool {
    match next {
        None => false,
        Some(Ok(frame)) => {
            copy.frame(&frame);
            pass(client, Ok(frame), patience, held).await;
            true
        }
        Some(Err(e)) => {
            copy.omit();
            pass(client, Err(e), patience, held).await;
            false
        }
    }
}

/// What of the body is held back until its record is written: what would end the client's body.
#[derive(Default)]
struct Held {
    /// The body's declared length (`Content-Length`), if any (never 0).
    declared: Option<u64>,
    /// Data bytes passed on so far.
    sent: u64,
    /// With a declared length, the data from its last byte on: the byte that fills the length
    /// ends the client's body (a server or a hop writes no more than the length, and takes the
    /// answer as whole with it). At most the recording limit and a frame: the record is written
    /// once the copy is over the limit.
    tail: Vec<Bytes>,
    /// Trailers, which end the body.
    trailers: Option<Frame<Bytes>>,
}

/// Sends a frame to the client before the record is written, keeping in `held` what would end
/// the client's body, to be sent after the record.
async fn pass(
    client: &mut Option<mpsc::Sender<Result<Frame<Bytes>, axum::Error>>>,
    frame: Result<Frame<Bytes>, axum::Error>,
    patience: Duration,
    held: &mut Held,
) {
    let frame = match frame {
        Ok(frame) if frame.is_trailers() => {
            held.trailers = Some(frame);
            return;
        }
        Ok(frame) => frame,
        Err(e) => {
            // The body failed: nothing may follow its error.
            held.tail.clear();
            held.trailers = None;
            return forward(client, Err(e), patience).await;
        }
    };
    let mut data = match frame.into_data() {
        Ok(data) => data,
        Err(other) => return forward(client, Ok(other), patience).await,
    };
    if data.is_empty() {
        return;
    }
    if let Some(declared) = held.declared {
        if !held.tail.is_empty() {
            held.tail.push(data);
            return;
        }
        // At most one byte short of the declared length goes before the record.
        let room = declared.saturating_sub(1).saturating_sub(held.sent);
        if data.len() as u64 > room {
            // `room` is below the frame's length, so it fits a `usize`.
            held.tail
                .push(data.split_off(usize::try_from(room).unwrap_or(0)));
        }
    }
    if !data.is_empty() {
        held.sent += data.len() as u64;
        forward(client, Ok(Frame::data(data)), patience).await;
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
