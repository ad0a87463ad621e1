//! Tenants share nothing one of them can exhaust (SPEC 20): slow bodies shut nobody out, each
//! subject has its share of requests in flight, of waiters and of the store's records, scopes are
//! bounded, credentials never fall into the shared anonymous scope; and the smaller points of the
//! security review (hop-by-hop headers, extension methods, the default replay marker).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, Request, StatusCode};
use axum::routing::{any, post as route_post};
use axum_idempotency::{IdempotencyLayer, MemoryStore, Subject};
use tower::ServiceExt;

use crate::common::{self, app, post, send};

/// A body that announces `announced` bytes, sends `sent`, then stalls for ever.
fn stalled_body(sent: usize) -> Body {
    let first = futures_util::stream::once(async move {
        Ok::<_, std::io::Error>(http_body::Frame::data(Bytes::from(vec![b'{'; sent])))
    });
    let rest = futures_util::stream::pending();
    use futures_util::StreamExt as _;
    Body::new(http_body_util::StreamBody::new(first.chain(rest)))
}

fn slow_post(key: &str, user: &str) -> Request<Body> {
    let mut request = Request::post("/pay")
        .header("idempotency-key", key)
        .header("content-length", "1000")
        .body(stalled_body(10))
        .expect("request");
    request.extensions_mut().insert(Subject(user.into()));
    request
}

/// The reproduction: an outer timeout (as services put one outside the layer) drops many requests
/// of one subject whose bodies never finish arriving. None of them is run on detached (their
/// bodies were not read), so they take none of the places the admission bound counts; while they
/// wait, the subject is held to its share of the instance's places (the rest get `429`); and
/// another subject's request is answered 201.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_bodies_from_one_subject_shut_nobody_out() {
    let layer = IdempotencyLayer::builder(MemoryStore::new())
        .max_running(8)
        .max_in_flight_per_subject(8)
        .build()
        .expect("layer");
    let drain = layer.drain();
    let handler = || async { (StatusCode::CREATED, "charged") };
    let router: Router = Router::new().route("/pay", route_post(handler).layer(layer));
    let mut slow = Vec::new();
    for i in 0..24 {
        let router = router.clone();
        slow.push(tokio::spawn(async move {
            // The outer timeout: 300 ms, then the request's future is dropped.
            tokio::time::timeout(
                Duration::from_millis(300),
                router.oneshot(slow_post(&format!("slow-{i}"), "mallory")),
            )
            .await
        }));
    }
    let mut held = 0;
    for task in slow {
        match task.await.expect("task") {
            // The outer timeout fired.
            Err(_) => held += 1,
            Ok(answer) => assert_eq!(
                answer.expect("answer").status(),
                StatusCode::TOO_MANY_REQUESTS,
                "past its share"
            ),
        }
    }
    assert!(held >= 2, "{held} held until the outer timeout");
    assert_eq!(drain.detached(), 0, "nothing was run on without its body");
    let mut request = Request::post("/pay")
        .header("idempotency-key", "ordinary")
        .body(Body::from("{}"))
        .expect("request");
    request.extensions_mut().insert(Subject("alice".into()));
    let answer = router.clone().oneshot(request).await.expect("answer");
    assert_eq!(answer.status(), StatusCode::CREATED);
    assert!(
        drain.wait(Duration::from_secs(5)).await,
        "nothing left running"
    );
}

/// Reading a body has a deadline: a body that stops arriving gets `408 request_timeout`, and
/// nothing is claimed (the key runs when the request comes whole).
#[tokio::test]
async fn a_body_that_stops_arriving_is_408_and_claims_nothing() {
    let layer = IdempotencyLayer::builder(MemoryStore::new())
        .body_timeout(Duration::from_millis(200))
        .build()
        .expect("layer");
    let (router, counters) = app(layer);
    let stalled = post("/pay").key("k").user("alice").body(stalled_body(10));
    let answer = send(&router, stalled).await;
    assert_eq!(answer.status, StatusCode::REQUEST_TIMEOUT);
    assert_eq!(answer.problem(), "request_timeout");
    assert!(answer.header("retry-after").is_some());
    let whole = send(&router, post("/pay").key("k").user("alice").json("{}")).await;
    assert_eq!(whole.status, StatusCode::CREATED, "nothing was claimed");
    assert_eq!(counters.started(), 1);
}

/// A subject's requests in flight are bounded: past its share it gets `429` with `Retry-After`
/// before its body is read, and another subject is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_subject_in_flight_past_its_share_is_429_and_others_are_served() {
    let layer = IdempotencyLayer::builder(MemoryStore::new())
        .max_in_flight_per_subject(2)
        .build()
        .expect("layer");
    let (router, counters) = app(layer);
    let slow = |key: &str| {
        post("/pay")
            .key(key)
            .user("mallory")
            .header("x-delay-ms", "800")
    };
    let held: Vec<_> = (0..2)
        .map(|i| {
            let (router, req) = (router.clone(), slow(&format!("held-{i}")));
            tokio::spawn(async move { send(&router, req).await })
        })
        .collect();
    common::eventually(|| counters.started() == 2).await;
    let third = send(&router, slow("third")).await;
    assert_eq!(third.status, StatusCode::TOO_MANY_REQUESTS, "{third:?}");
    assert_eq!(third.problem(), "idempotency_quota_exceeded");
    assert!(third.header("retry-after").is_some());
    let other = send(&router, post("/pay").key("k").user("alice")).await;
    assert_eq!(other.status, StatusCode::CREATED);
    for task in held {
        assert_eq!(task.await.expect("held").status, StatusCode::CREATED);
    }
    // Its places are given back as its requests end.
    let after = send(&router, post("/pay").key("after").user("mallory")).await;
    assert_eq!(after.status, StatusCode::CREATED);
}

/// A subject with its share of the store's records gets `429` for new keys, its recorded keys
/// still replay, and other subjects are served.
#[tokio::test]
async fn one_subject_past_its_share_of_records_is_refused_new_keys_only() {
    let layer = IdempotencyLayer::builder(MemoryStore::new())
        .max_records_per_subject(Some(10))
        .build()
        .expect("layer");
    let (router, counters) = app(layer);
    let mut refused = 0;
    for i in 0..200 {
        let answer = send(
            &router,
            post("/pay").key(&format!("flood-{i}")).user("mallory"),
        )
        .await;
        match answer.status {
            StatusCode::CREATED => {}
            StatusCode::TOO_MANY_REQUESTS => {
                assert_eq!(answer.problem(), "idempotency_quota_exceeded");
                refused += 1;
            }
            other => panic!("{other}: {answer:?}"),
        }
    }
    // Counted after at most 64 claims, then over its share: the rest are refused.
    assert!(refused >= 100, "{refused} refused");
    let runs = counters.started();
    let replay = send(&router, post("/pay").key("flood-0").user("mallory")).await;
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(counters.started(), runs, "a replay runs nothing");
    for i in 0..5 {
        let answer = send(&router, post("/pay").key(&format!("k{i}")).user("alice")).await;
        assert_eq!(answer.status, StatusCode::CREATED);
    }
}

/// Waiters are bounded per subject: past its share a duplicate gets `409` at once instead of
/// waiting; another subject's duplicate still waits and gets the replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_subject_cannot_take_every_waiting_place() {
    let layer = IdempotencyLayer::builder(MemoryStore::new())
        .wait(Duration::from_secs(3))
        .max_waiters_per_subject(1)
        .build()
        .expect("layer");
    let (router, _) = app(layer);
    let slow = |user: &str| {
        post("/pay")
            .key("k")
            .user(user)
            .header("x-delay-ms", "1000")
    };
    let holders: Vec<_> = ["mallory", "alice"]
        .into_iter()
        .map(|user| {
            let (router, req) = (router.clone(), slow(user));
            tokio::spawn(async move { send(&router, req).await })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let waiter = tokio::spawn({
        let router = router.clone();
        async move { send(&router, post("/pay").key("k").user("mallory")).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let started = std::time::Instant::now();
    let refused = send(&router, post("/pay").key("k").user("mallory")).await;
    assert_eq!(refused.status, StatusCode::CONFLICT, "{refused:?}");
    assert!(
        started.elapsed() < Duration::from_millis(800),
        "it did not wait"
    );
    let alice = send(&router, post("/pay").key("k").user("alice")).await;
    assert!(alice.replayed(), "alice's duplicate waited: {alice:?}");
    assert!(waiter.await.expect("waiter").replayed());
    for holder in holders {
        assert_eq!(holder.await.expect("holder").status, StatusCode::CREATED);
    }
}

/// Subjects and endpoints longer than every store keeps whole are refused before any claim.
#[tokio::test]
async fn scopes_past_their_bounds_are_refused_before_any_claim() {
    let (router, counters) = app(IdempotencyLayer::new(MemoryStore::new()).expect("layer"));
    let long = "s".repeat(1025);
    let subject = send(&router, post("/pay").key("k").user(&long)).await;
    assert_eq!(subject.status, StatusCode::BAD_REQUEST);
    assert_eq!(subject.problem(), "subject_too_long");
    let at_bound = send(&router, post("/pay").key("k").user(&long[..1024])).await;
    assert_eq!(at_bound.status, StatusCode::CREATED);
    let path = format!("/pay/{}", "p".repeat(4100));
    let layer = IdempotencyLayer::new(MemoryStore::new()).expect("layer");
    let router: Router =
        Router::new().route("/pay/{rest}", route_post(|| async { "ok" }).layer(layer));
    let mut request = Request::post(path.as_str())
        .header("idempotency-key", "k")
        .body(Body::empty())
        .expect("request");
    request.extensions_mut().insert(Subject("alice".into()));
    let answer = router.oneshot(request).await.expect("answer");
    assert_eq!(answer.status(), StatusCode::URI_TOO_LONG);
    assert_eq!(counters.started(), 1);
}

/// With anonymous requests allowed, a request that carries credentials but no subject is refused
/// (`401`), never put in the scope every anonymous caller shares; one without credentials is. A
/// cookie is not a credential by default (browsers send cookies of every kind to anonymous
/// routes); where a session cookie authenticates, it is one by setting.
#[tokio::test]
async fn credentials_without_a_subject_never_fall_into_the_anonymous_scope() {
    let layer = IdempotencyLayer::builder(MemoryStore::new())
        .allow_anonymous(true)
        .build()
        .expect("layer");
    let (router, counters) = app(layer);
    let answer = send(
        &router,
        post("/pay").key("k").header("authorization", "Bearer x"),
    )
    .await;
    assert_eq!(answer.status, StatusCode::UNAUTHORIZED);
    assert_eq!(answer.problem(), "missing_subject");
    let anonymous = send(&router, post("/pay").key("k")).await;
    assert_eq!(anonymous.status, StatusCode::CREATED);
    assert_eq!(counters.started(), 1);
    // A consent cookie on an anonymous route is anonymous.
    let consent = send(&router, post("/pay").key("c").header("cookie", "consent=1")).await;
    assert_eq!(consent.status, StatusCode::CREATED);
    // A session cookie counts where it is said to.
    let layer = IdempotencyLayer::builder(MemoryStore::new())
        .allow_anonymous(true)
        .credential_headers(["authorization", "cookie"])
        .build()
        .expect("layer");
    let (router, _) = app(layer);
    let answer = send(&router, post("/pay").key("k").header("cookie", "session=1")).await;
    assert_eq!(answer.status, StatusCode::UNAUTHORIZED);
    // Which headers count is a setting.
    let layer = IdempotencyLayer::builder(MemoryStore::new())
        .allow_anonymous(true)
        .credential_headers(["x-api-key"])
        .build()
        .expect("layer");
    let (router, _) = app(layer);
    let answer = send(&router, post("/pay").key("k").header("x-api-key", "1")).await;
    assert_eq!(answer.status, StatusCode::UNAUTHORIZED);
    let answer = send(&router, post("/pay").key("k2").header("cookie", "a=1")).await;
    assert_eq!(answer.status, StatusCode::CREATED);
}

/// An extension method (a lower-case `post`, on a route that takes any method) is guarded: its
/// meaning is unknown, so it is not taken for safe, and its retry replays.
#[tokio::test]
async fn an_extension_method_is_guarded() {
    let runs = Arc::new(AtomicUsize::new(0));
    let handler = {
        let runs = runs.clone();
        move || {
            let runs = runs.clone();
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                (StatusCode::CREATED, "charged")
            }
        }
    };
    let layer = IdempotencyLayer::new(MemoryStore::new()).expect("layer");
    let router: Router = Router::new().route("/pay", any(handler).layer(layer));
    let request = || {
        let mut request = Request::builder()
            .method("post")
            .uri("/pay")
            .header("idempotency-key", "k")
            .body(Body::empty())
            .expect("request");
        request.extensions_mut().insert(Subject("alice".into()));
        request
    };
    let first = router.clone().oneshot(request()).await.expect("first");
    assert_eq!(first.status(), StatusCode::CREATED);
    let second = router.clone().oneshot(request()).await.expect("second");
    assert_eq!(second.headers()["idempotent-replayed"], "true");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// Hop-by-hop headers are never recorded nor replayed: every `proxy-*` header and the headers a
/// response's `Connection` names; a fresh answer never carries a replay marker, the default one
/// included when another is set.
#[tokio::test]
async fn hop_by_hop_headers_and_replay_markers_never_pass() {
    let handler = || async {
        let mut headers = HeaderMap::new();
        headers.insert("connection", "x-hop".parse().expect("value"));
        headers.insert("x-hop", "1".parse().expect("value"));
        headers.insert("x-kept", "1".parse().expect("value"));
        headers.insert("proxy-status", "cache".parse().expect("value"));
        headers.insert("idempotent-replayed", "true".parse().expect("value"));
        headers.insert("x-replayed", "true".parse().expect("value"));
        (StatusCode::CREATED, headers, "charged")
    };
    let layer = IdempotencyLayer::builder(MemoryStore::new())
        .store_header("x-hop")
        .store_header("x-kept")
        .replay_header("x-replayed")
        .build()
        .expect("layer");
    let router: Router = Router::new().route("/pay", route_post(handler).layer(layer));
    assert!(
        IdempotencyLayer::builder(MemoryStore::new())
            .store_header("proxy-status")
            .build()
            .is_err(),
        "a proxy-* header is never stored"
    );
    let request = || {
        let mut request = Request::post("/pay")
            .header("idempotency-key", "k")
            .body(Body::empty())
            .expect("request");
        request.extensions_mut().insert(Subject("alice".into()));
        request
    };
    let fresh = router.clone().oneshot(request()).await.expect("fresh");
    assert!(fresh.headers().get("x-replayed").is_none());
    assert!(fresh.headers().get("idempotent-replayed").is_none());
    let replay = router.clone().oneshot(request()).await.expect("replay");
    assert_eq!(replay.headers()["x-replayed"], "true");
    assert_eq!(replay.headers()["x-kept"], "1");
    assert!(
        replay.headers().get("x-hop").is_none(),
        "named by Connection"
    );
    assert!(replay.headers().get("proxy-status").is_none());
    assert!(replay.headers().get("idempotent-replayed").is_none());
}

/// A response that streams into its record after the request's future ended (the client holds its
/// head, the body still coming) keeps its subject's place in flight until its record is written:
/// a subject cannot pass its share by answers that stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_still_streaming_keeps_its_subjects_place_in_flight() {
    use futures_util::StreamExt as _;
    let layer = IdempotencyLayer::builder(MemoryStore::new())
        .max_in_flight_per_subject(1)
        .build()
        .expect("layer");
    let go_on = Arc::new(tokio::sync::Notify::new());
    let router = Router::new()
        .route(
            "/pay",
            route_post({
                let go_on = go_on.clone();
                move || {
                    let go_on = go_on.clone();
                    async move {
                        let first = futures_util::stream::once(async {
                            Ok::<_, std::convert::Infallible>(Bytes::from_static(b"{\"charged\":"))
                        });
                        let rest = futures_util::stream::once(async move {
                            go_on.notified().await;
                            Ok(Bytes::from_static(b"true}"))
                        });
                        (StatusCode::CREATED, Body::from_stream(first.chain(rest)))
                    }
                }
            }),
        )
        .route("/plain", route_post(|| async { StatusCode::CREATED }))
        .layer(layer);
    let request = |key: &str, user: &str| {
        let path = if user == "alice" { "/plain" } else { "/pay" };
        let mut request = Request::post(path)
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .body(Body::from("{}"))
            .expect("request");
        request.extensions_mut().insert(Subject(user.into()));
        request
    };
    let streaming = router
        .clone()
        .oneshot(request("streams", "mallory"))
        .await
        .expect("answer");
    assert_eq!(streaming.status(), StatusCode::CREATED);
    // Its request's future has ended; its response is still streaming into the record.
    let second = router
        .clone()
        .oneshot(request("second", "mallory"))
        .await
        .expect("answer");
    assert_eq!(second.status(), StatusCode::TOO_MANY_REQUESTS);
    let other = router
        .clone()
        .oneshot(request("other", "alice"))
        .await
        .expect("answer");
    assert_eq!(other.status(), StatusCode::CREATED);
    go_on.notify_one();
    let body = http_body_util::BodyExt::collect(streaming.into_body())
        .await
        .expect("body")
        .to_bytes();
    assert_eq!(&body[..], b"{\"charged\":true}");
    // Recorded: its place is given back.
    let after = router
        .clone()
        .oneshot(request("after", "mallory"))
        .await
        .expect("answer");
    assert_ne!(after.status(), StatusCode::TOO_MANY_REQUESTS);
}

/// Anonymous callers share their records' scope, but their shares of the instance are told apart
/// when the application says how (here by a header standing for the peer address): one anonymous
/// caller at its bound in flight does not take the others' places. Without it, they share one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anonymous_callers_have_shares_of_their_own_when_told_apart() {
    let layer = |split: bool| {
        let builder = IdempotencyLayer::builder(MemoryStore::new())
            .allow_anonymous(true)
            .max_in_flight_per_subject(1);
        let builder = if split {
            builder.anonymous_shares_by(|parts: &axum::http::request::Parts| {
                Some(parts.headers.get("x-peer")?.to_str().ok()?.to_owned())
            })
        } else {
            builder
        };
        builder.build().expect("layer")
    };
    for split in [true, false] {
        let (router, _) = app(layer(split));
        let slow = tokio::spawn({
            let router = router.clone();
            async move {
                send(
                    &router,
                    post("/pay")
                        .key("slow")
                        .header("x-peer", "a")
                        .header("x-delay-ms", "800"),
                )
                .await
            }
        });
        tokio::time::sleep(Duration::from_millis(200)).await;
        let again = send(&router, post("/pay").key("a2").header("x-peer", "a")).await;
        assert_eq!(again.status, StatusCode::TOO_MANY_REQUESTS, "{again:?}");
        let other = send(&router, post("/pay").key("b1").header("x-peer", "b")).await;
        if split {
            assert_eq!(other.status, StatusCode::CREATED, "{other:?}");
        } else {
            assert_eq!(
                other.status,
                StatusCode::TOO_MANY_REQUESTS,
                "one share for all"
            );
        }
        assert_eq!(slow.await.expect("slow").status, StatusCode::CREATED);
    }
}
