//! The recorders over the memory store, under a paused clock.

use std::time::Duration;

use http_body_util::BodyExt;

use super::*;
use crate::engine::Settings;
use crate::engine::tests::{claimed, engine, engine_with};
use crate::store::{ClaimOutcome, ClaimRequest, LeaseToken};

fn response(status: u16, body: Body) -> Response<Body> {
    Response::builder()
        .status(status)
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(body)
        .expect("response")
}

/// What a retry of `claim` finds.
async fn retry<St: IdempotencyStore>(store: &St, claim: &ClaimRequest) -> ClaimOutcome {
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
    let (engine, store) = engine();
    let http = LayerSettings::default();
    let (claim, lease) = claimed(&engine, "whole").await;
    let answer = record(&http, lease, response(201, Body::from("{\"id\":1}"))).await;
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
    let (engine, store) = engine();
    let http = LayerSettings::default();
    let (claim, lease) = claimed(&engine, "stream").await;
    let body = slow_body(&["part1;", "part2;", "part3"], Duration::from_millis(100));
    let answer = record(&http, lease, response(201, body)).await;
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
    let (engine, store) = engine();
    let http = LayerSettings::default();
    store.panic_next_completion();
    let (claim, lease) = claimed(&engine, "panics").await;
    let body = slow_body(&["part1;", "part2"], Duration::from_millis(100));
    let answer = record(&http, lease, response(201, body)).await;
    assert_eq!(&read(answer).await[..], b"part1;part2");
    assert!(engine.drain().wait(Duration::from_secs(5)).await);
    match retry(&store.inner, &claim).await {
        ClaimOutcome::Finished(stored) => assert_eq!(&stored.body[..], b"part1;part2"),
        other => panic!("expected the record, got {other:?}"),
    }
}

#[tokio::test(start_paused = true)]
async fn a_body_cut_at_the_maximum_hold_ends_in_an_error_even_when_its_completion_panics() {
    for panics in [false, true] {
        let (engine, store) = engine_with(Settings {
            in_progress_ttl: Duration::from_millis(250),
            max_hold: Some(Duration::from_millis(250)),
            ..Settings::default()
        });
        if panics {
            store.panic_next_completion();
        }
        let http = LayerSettings::default();
        let (claim, lease) = claimed(&engine, "cut").await;
        let body = slow_body(&["a", "b", "c", "d", "e"], Duration::from_millis(100));
        let answer = record(&http, lease, response(201, body)).await;
        let (got, ended_in_error) = read_to_the_end(answer).await;
        assert!(
            ended_in_error,
            "a cut body must not look whole (panics: {panics})"
        );
        assert_eq!(&got[..], b"ab", "the frames before the hold ran out");
        assert!(engine.drain().wait(Duration::from_secs(5)).await);
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
    let (engine, store) = engine();
    let http = LayerSettings::default();
    let (claim, lease) = claimed(&engine, "stalled").await;
    let parts = &["0", "1", "2", "3", "4", "5", "6", "7", "8", "9"];
    let body = slow_body(parts, Duration::from_millis(10));
    let answer = record(&http, lease, response(201, body)).await;
    // The client reads nothing for longer than the patience (the in-progress TTL): it is
    // treated as gone, and the body is read and recorded without it.
    tokio::time::sleep(engine.settings().in_progress_ttl * 2).await;
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
    let (engine, store) = engine();
    let http = LayerSettings {
        response_limit: 8,
        ..LayerSettings::default()
    };
    let (claim, lease) = claimed(&engine, "big").await;
    let big = "x".repeat(100);
    let answer = record(&http, lease, response(201, Body::from(big.clone()))).await;
    assert_eq!(read(answer).await, big.as_bytes());
    assert!(engine.drain().wait(Duration::from_secs(5)).await);
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
    let (engine, store) = engine();
    let http = LayerSettings::default();
    let (claim, lease) = claimed(&engine, "retry").await;
    let answer = record(&http, lease, response(503, Body::from("later"))).await;
    assert_eq!(answer.status(), 503);
    assert!(matches!(
        retry(&store, &claim).await,
        ClaimOutcome::Claimed { .. }
    ));
}

#[cfg(sql)]
#[tokio::test(start_paused = true)]
async fn a_body_still_going_at_the_deadline_is_left_out_and_still_reaches_the_client() {
    let body = slow_body(&["a", "b", "c"], Duration::from_millis(100));
    let read = read_up_to(body, 1024, Instant::now() + Duration::from_millis(150)).await;
    assert!(read.copy.is_none(), "cut at the deadline: not recorded");
    let whole = body_of(read).collect().await.expect("body").to_bytes();
    assert_eq!(&whole[..], b"abc", "what was read, then the rest");
}

/// An answer whose record the store does not take in time is never given whole: a whole body
/// becomes the retryable `503`, a streamed one ends in an error; the record is written later, in
/// the background, and a retry gets it.
#[tokio::test(start_paused = true)]
async fn an_answer_not_recorded_in_time_is_never_given_whole() {
    let (engine, store) = engine();
    let http = LayerSettings::default();
    store.refuse_completions(true);
    let (whole, lease) = claimed(&engine, "whole").await;
    let answer = record(&http, lease, response(201, Body::from("{\"id\":1}"))).await;
    assert_eq!(answer.status(), 503);
    let problem: serde_json::Value =
        serde_json::from_slice(&read(answer).await).expect("problem JSON");
    assert_eq!(problem["error"], "idempotency_store_unavailable");
    assert_eq!(problem["retryable"], true);

    let (streamed, lease) = claimed(&engine, "streamed").await;
    let body = slow_body(&["{\"id\":", "2}"], Duration::from_millis(10));
    let answer = record(&http, lease, response(201, body)).await;
    let (_, cut) = read_to_the_end(answer).await;
    assert!(
        cut,
        "a streamed answer that is not recorded ends in an error"
    );

    store.refuse_completions(false);
    assert!(engine.drain().wait(Duration::from_secs(5)).await);
    for (claim, body) in [(&whole, "{\"id\":1}"), (&streamed, "{\"id\":2}")] {
        match retry(&store, claim).await {
            ClaimOutcome::Finished(stored) => assert_eq!(&stored.body[..], body.as_bytes()),
            other => panic!("expected the record, got {other:?}"),
        }
    }
}

/// A streamed answer never lets the client take it whole before its record: from the byte that
/// fills a declared length on, and trailers (which end the body too), everything is held until the
/// record is written, never sent when it is not; however the body is cut into frames (empty ones,
/// one past the declared length), and a length of 0 is not declared (its head would be the whole
/// answer).
#[tokio::test(start_paused = true)]
async fn a_streamed_answer_ends_for_the_client_only_after_its_record() {
    use futures_util::StreamExt as _;
    let cases: [(&[&str], u64); 5] = [
        (&["{\"id\":1}"], 8),
        (&["{\"id\":", "1}"], 8),
        (&["{\"id\":1}", ""], 8),
        (&["{\"id\":1", "}", ""], 8),
        (&["{\"id\":1}", "!"], 8),
    ];
    for (parts, declared) in cases {
        for recorded in [true, false] {
            let (engine, store) = engine();
            let http = LayerSettings::default();
            store.refuse_completions(!recorded);
            let (_, lease) = claimed(&engine, "trailers").await;
            let frames = parts
                .iter()
                .map(|part| Frame::data(Bytes::from_static(part.as_bytes())))
                .chain([Frame::trailers(http::HeaderMap::new())]);
            let frames = futures_util::stream::iter(frames).then(|frame| async move {
                tokio::time::sleep(Duration::from_millis(10)).await;
                Ok::<_, std::io::Error>(frame)
            });
            let mut handler = response(201, Body::new(http_body_util::StreamBody::new(frames)));
            handler.headers_mut().insert(
                http::header::CONTENT_LENGTH,
                http::HeaderValue::from(declared),
            );
            let answer = record(&http, lease, handler).await;
            assert_eq!(answer.headers()[http::header::CONTENT_LENGTH], "8");
            let mut body = answer.into_body();
            let (mut data, mut trailers, mut cut) = (Vec::new(), false, false);
            while let Some(frame) = body.frame().await {
                match frame {
                    Ok(frame) if frame.is_trailers() => trailers = true,
                    Ok(frame) => data.extend_from_slice(&frame.into_data().expect("data")),
                    Err(_) => cut = true,
                }
            }
            let case = format!("{parts:?}, recorded: {recorded}");
            assert_eq!((trailers, cut), (recorded, !recorded), "{case}");
            let whole = parts.concat();
            if recorded {
                assert_eq!(data, whole.as_bytes(), "{case}");
            } else {
                // Short of its declared length: no server or hop takes it for the whole body.
                assert!((data.len() as u64) < declared, "{case}: {data:?}");
            }
        }
    }
    // A length of 0 is whole with the head: the answer goes chunked, its end after the record.
    let (engine, _) = engine();
    let (_, lease) = claimed(&engine, "empty").await;
    let frames = futures_util::stream::iter([Frame::trailers(http::HeaderMap::new())]).then(
        |frame| async move {
            tokio::time::sleep(Duration::from_millis(10)).await;
            Ok::<_, std::io::Error>(frame)
        },
    );
    let mut handler = response(201, Body::new(http_body_util::StreamBody::new(frames)));
    handler
        .headers_mut()
        .insert(http::header::CONTENT_LENGTH, http::HeaderValue::from(0));
    let answer = record(&LayerSettings::default(), lease, handler).await;
    assert!(answer.headers().get(http::header::CONTENT_LENGTH).is_none());
}

/// A body that fails after what was held back of it (the byte that fills its declared length):
/// the client gets the error, and nothing after it, even once the record (without the body) is
/// written.
#[tokio::test(start_paused = true)]
async fn nothing_follows_the_error_of_a_streamed_body() {
    use futures_util::StreamExt as _;
    let (engine, _) = engine();
    let (_, lease) = claimed(&engine, "fails").await;
    let frames = futures_util::stream::iter([
        Ok(Frame::data(Bytes::from_static(b"{\"id\":"))),
        Ok(Frame::data(Bytes::from_static(b"1}"))),
        Err(std::io::Error::other("the handler's stream failed")),
    ])
    .then(|frame| async move {
        tokio::time::sleep(Duration::from_millis(10)).await;
        frame
    });
    let mut handler = response(201, Body::new(http_body_util::StreamBody::new(frames)));
    handler
        .headers_mut()
        .insert(http::header::CONTENT_LENGTH, http::HeaderValue::from(8));
    let answer = record(&LayerSettings::default(), lease, handler).await;
    let mut body = answer.into_body();
    let mut data = Vec::new();
    let mut after_error = 0;
    let mut failed = false;
    while let Some(frame) = body.frame().await {
        match frame {
            Ok(_) if failed => after_error += 1,
            Ok(frame) => data.extend_from_slice(&frame.into_data().expect("data")),
            Err(_) => failed = true,
        }
    }
    assert!(failed);
    assert_eq!(after_error, 0, "frames after the error");
    assert_eq!(&data[..], b"{\"id\":1", "short of its declared length");
}
