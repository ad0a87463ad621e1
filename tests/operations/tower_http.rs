//! The tower-http layers a production service puts around this one keep the contract where the
//! README places them, shown with the real layers, in-process, one test per rule: a timeout
//! outside lets the work finish and the retry replay it; compression outside replays the same
//! bytes under each retry's own `Accept-Encoding` (and inside, a replay never hands out encoded
//! bytes without their `Content-Encoding`); a body over a limit set outside is `413` and claims
//! nothing; a panic caught outside leaves the key free for the retry. A service is composed by
//! trial otherwise, and a wrong place costs a charge or a stuck key.

use std::io::Read as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::http::{StatusCode, header};
use axum::routing::post;
use axum_idempotency::{IdempotencyLayer, MemoryStore};
use tower_http::catch_panic::CatchPanicLayer;
use tower_http::compression::CompressionLayer;
use tower_http::limit::RequestBodyLimitLayer;
use tower_http::timeout::TimeoutLayer;

use crate::common::{Answer, eventually, post as request, send, until_not_in_progress};

/// The idempotency layer of these tests: on the memory store, for anonymous callers.
fn idempotency() -> IdempotencyLayer<MemoryStore> {
    IdempotencyLayer::builder(MemoryStore::new())
        .allow_anonymous(true)
        .build()
        .expect("layer")
}

/// A text long enough for the compression layer's default predicate (over 32 bytes).
const RECEIPT: &str = "charged 1999 cents to the card ending 4242; receipt follows. \
                       charged 1999 cents to the card ending 4242; receipt follows.";

/// The bytes of a gzip body, decoded.
fn gunzip(bytes: &[u8]) -> Vec<u8> {
    let mut plain = Vec::new();
    flate2::read::GzDecoder::new(bytes)
        .read_to_end(&mut plain)
        .expect("a gzip body");
    plain
}

/// Whether `bytes` start like a gzip stream.
fn looks_gzipped(bytes: &[u8]) -> bool {
    bytes.starts_with(&[0x1f, 0x8b])
}

/// A body of `len` bytes in frames of 16, with no length known in advance (sent chunked).
fn chunked(len: usize) -> Body {
    let frames = (0..len.div_ceil(16)).map(move |i| {
        let n = 16.min(len - i * 16);
        Ok::<_, std::io::Error>(http_body::Frame::data(Bytes::from(vec![b' '; n])))
    });
    Body::new(http_body_util::StreamBody::new(futures_util::stream::iter(
        frames,
    )))
}

/// A `TimeoutLayer` outside cuts the client off with its `408`, but the layer detaches the work
/// once the body is read: the handler finishes (once), and the retry replays its answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timeout_outside_lets_the_payment_finish_and_the_retry_replays_it() {
    let started = Arc::new(AtomicUsize::new(0));
    let finished = Arc::new(AtomicUsize::new(0));
    let (s, f) = (started.clone(), finished.clone());
    let handler = move || {
        let (s, f) = (s.clone(), f.clone());
        async move {
            let run = s.fetch_add(1, Ordering::SeqCst) + 1;
            tokio::time::sleep(Duration::from_millis(400)).await;
            f.fetch_add(1, Ordering::SeqCst);
            (StatusCode::CREATED, format!("charged, run {run}"))
        }
    };
    let router = Router::new()
        .route("/pay", post(handler))
        .route_layer(idempotency())
        .layer(TimeoutLayer::with_status_code(
            StatusCode::REQUEST_TIMEOUT,
            Duration::from_millis(100),
        ));
    let pay = || request("/pay").key("timeout-1").json(r#"{"amount":1999}"#);

    let first = send(&router, pay()).await;
    assert_eq!(first.status, StatusCode::REQUEST_TIMEOUT, "{first:?}");
    assert_eq!(started.load(Ordering::SeqCst), 1);
    assert_eq!(
        finished.load(Ordering::SeqCst),
        0,
        "cut before the handler finished"
    );

    // The handler goes on without its client.
    eventually(|| finished.load(Ordering::SeqCst) == 1).await;
    let retry = until_not_in_progress(&router, pay, 100).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    assert_eq!(&retry.body[..], b"charged, run 1");
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(started.load(Ordering::SeqCst), 1, "the handler ran once");
}

/// `CompressionLayer` outside: the record holds the identity bytes, and each answer is encoded
/// for the request it answers, the replay included.
#[tokio::test]
async fn compression_outside_encodes_each_answer_for_its_own_request() {
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = runs.clone();
    let handler = move || {
        counted.fetch_add(1, Ordering::SeqCst);
        async {
            (
                StatusCode::CREATED,
                [(header::CONTENT_TYPE, "text/plain")],
                RECEIPT,
            )
        }
    };
    let router = Router::new()
        .route("/pay", post(handler))
        .route_layer(idempotency())
        .layer(CompressionLayer::new());
    let pay = || {
        request("/pay")
            .key("compress-out")
            .json(r#"{"amount":1999}"#)
    };

    let first = send(&router, pay().header("accept-encoding", "gzip")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(first.header("content-encoding"), Some("gzip"), "{first:?}");
    assert_eq!(gunzip(&first.body), RECEIPT.as_bytes());

    // No Accept-Encoding, then one the service does not offer: the plain bytes, as a replay.
    for accept in [None, Some("br")] {
        let retry = match accept {
            Some(accept) => send(&router, pay().header("accept-encoding", accept)).await,
            None => send(&router, pay()).await,
        };
        assert_eq!(retry.status, StatusCode::CREATED, "{accept:?}");
        assert!(retry.replayed(), "{accept:?}: {retry:?}");
        assert_eq!(retry.header("content-encoding"), None, "{accept:?}");
        assert_eq!(&retry.body[..], RECEIPT.as_bytes(), "{accept:?}");
    }
    // And gzip again for a retry that asks for it.
    let gzip = send(&router, pay().header("accept-encoding", "gzip")).await;
    assert!(gzip.replayed());
    assert_eq!(gzip.header("content-encoding"), Some("gzip"));
    assert_eq!(gunzip(&gzip.body), RECEIPT.as_bytes());
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// The wrong place, `CompressionLayer` inside: the record holds the gzip bytes of the first
/// request, and the layer keeps their `Content-Encoding` with them, so a replay is never encoded
/// bytes passed off as plain ones (though a retry that did not ask for gzip gets gzip: the reason
/// compression goes outside).
#[tokio::test]
async fn compression_inside_never_replays_encoded_bytes_without_their_encoding() {
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = runs.clone();
    let handler = move || {
        counted.fetch_add(1, Ordering::SeqCst);
        async {
            (
                StatusCode::CREATED,
                [(header::CONTENT_TYPE, "text/plain")],
                RECEIPT,
            )
        }
    };
    // The later layer is the outer one: compression runs between the layer and the handler.
    let router = Router::new()
        .route("/pay", post(handler))
        .route_layer(CompressionLayer::new())
        .route_layer(idempotency());
    let pay = || {
        request("/pay")
            .key("compress-in")
            .json(r#"{"amount":1999}"#)
    };

    let first = send(&router, pay().header("accept-encoding", "gzip")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(first.header("content-encoding"), Some("gzip"), "{first:?}");
    assert_eq!(gunzip(&first.body), RECEIPT.as_bytes());

    let retry = send(&router, pay()).await;
    assert!(retry.replayed(), "{retry:?}");
    assert!(
        looks_gzipped(&retry.body),
        "the record holds the gzip bytes"
    );
    assert_eq!(
        retry.header("content-encoding"),
        Some("gzip"),
        "gzip bytes replayed without their Content-Encoding: {retry:?}"
    );
    assert_eq!(gunzip(&retry.body), RECEIPT.as_bytes());
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// The refusal of a body over `RequestBodyLimitLayer`'s limit.
fn assert_too_large(answer: &Answer, what: &str) {
    assert_eq!(
        answer.status,
        StatusCode::PAYLOAD_TOO_LARGE,
        "{what}: {answer:?}"
    );
}

/// A body over the limit of a `RequestBodyLimitLayer` outside is `413`, whether its length is
/// declared (refused by that layer) or it comes chunked (cut while the idempotency layer reads it,
/// and answered with the layer's `request_too_large` problem); the handler never runs and nothing
/// is claimed: the same key with a small body is then processed as new.
#[tokio::test]
async fn a_body_over_a_limit_set_outside_is_413_and_claims_nothing() {
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = runs.clone();
    let handler = move || {
        counted.fetch_add(1, Ordering::SeqCst);
        async { (StatusCode::CREATED, "charged") }
    };
    let router = Router::new()
        .route("/pay", post(handler))
        .route_layer(idempotency())
        .layer(RequestBodyLimitLayer::new(64));

    let declared = request("/pay")
        .key("limit-declared")
        .header("content-length", "200")
        .body(Body::from(vec![b' '; 200]));
    let declared = send(&router, declared).await;
    assert_too_large(&declared, "with Content-Length");

    let streamed = request("/pay").key("limit-chunked").body(chunked(200));
    let streamed = send(&router, streamed).await;
    assert_too_large(&streamed, "chunked");
    assert_eq!(streamed.problem(), "request_too_large", "{streamed:?}");
    let detail = streamed.json()["detail"].to_string();
    assert!(
        !detail.contains("1048576"),
        "the limit is not the layer's own: {detail}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 0, "the handler never ran");

    for key in ["limit-declared", "limit-chunked"] {
        let small = send(&router, request("/pay").key(key).json("{}")).await;
        assert_eq!(small.status, StatusCode::CREATED, "{key}: {small:?}");
        assert!(!small.replayed(), "{key}: nothing was recorded for the key");
    }
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

/// `CatchPanicLayer` outside, and a handler that panics on its first run: the client gets a `500`
/// and the key is free again (the layer caught the panic under its lease and released the record
/// before anything reached the outer layer), so the retry runs the handler and gets its answer,
/// not `409 in_progress` until the TTL.
#[tokio::test]
async fn a_panic_under_catch_panic_outside_leaves_the_key_to_the_retry() {
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = runs.clone();
    let handler = move || {
        let run = counted.fetch_add(1, Ordering::SeqCst) + 1;
        async move {
            assert!(run > 1, "the first run panics");
            (StatusCode::CREATED, format!("charged, run {run}"))
        }
    };
    let router = Router::new()
        .route("/pay", post(handler))
        .route_layer(idempotency())
        .layer(CatchPanicLayer::new());
    let pay = || {
        request("/pay")
            .key("panics-once")
            .json(r#"{"amount":1999}"#)
    };

    let first = send(&router, pay()).await;
    assert_eq!(first.status, StatusCode::INTERNAL_SERVER_ERROR, "{first:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    let retry = send(&router, pay()).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    assert_eq!(&retry.body[..], b"charged, run 2");
    assert!(!retry.replayed());
    assert_eq!(
        runs.load(Ordering::SeqCst),
        2,
        "the retry ran the handler again"
    );
}
