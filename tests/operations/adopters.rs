//! What adopters asked for, through the layer on the memory store (none of it involves the store
//! beyond what the conformance kit checks on every store): where the key comes from, the handler's
//! `Disposition`, axum's extractor rejections released, `no-store` released, replays checked
//! again (and `RunOnce`'s), and an expired key told on `RunOnce`.

use crate::common::{Answer, post, send};

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::{Json, Path};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware;
use axum::response::IntoResponse;
use axum::routing::post as route_post;
use axum_idempotency::once::{OnceError, RunOnce};
use axum_idempotency::store::RecordKey;
use axum_idempotency::{
    Disposition, Fingerprint, IdempotencyLayer, IdempotencyLayerBuilder, MemoryStore,
};
use serde::Deserialize;

/// A charge as the handler takes it: an integer amount.
#[derive(Deserialize)]
struct Charge {
    amount: u64,
}

/// An app whose routes count their runs: `/charge` takes `Json<Charge>`, `/path/{n}` a number in its path, `/say` answers as the `x-disposition`, `x-status` and
/// `x-cache-control` headers say.
fn app(layer: IdempotencyLayer<MemoryStore>) -> (Router, Arc<AtomicUsize>) {
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = |runs: &Arc<AtomicUsize>| {
        let runs = runs.clone();
        move || runs.fetch_add(1, Ordering::SeqCst) + 1
    };
    let charge = counted(&runs);
    let path = counted(&runs);
    let say = counted(&runs);
    let router = Router::new()
        .route(
            "/charge",
            route_post(move |Json(c): Json<Charge>| async move {
                let run = charge();
                (
                    StatusCode::CREATED,
                    format!("charged {} (run {run})", c.amount),
                )
            }),
        )
        .route(
            "/path/{n}",
            route_post(move |Path(n): Path<u32>| async move { format!("{n}: run {}", path()) }),
        )
        .route(
            "/say",
            route_post(move |headers: HeaderMap| async move {
                let run = say();
                if let Some(ms) = headers
                    .get("x-delay-ms")
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.parse::<u64>().ok())
                {
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                }
                let text = |name: &str| {
                    headers
                        .get(name)
                        .and_then(|v| v.to_str().ok())
                        .map(str::to_owned)
                };
                let status = text("x-status")
                    .and_then(|s| s.parse::<u16>().ok())
                    .and_then(|s| StatusCode::from_u16(s).ok())
                    .unwrap_or(StatusCode::OK);
                let mut response = (status, format!("run {run}")).into_response();
                if let Some(cc) = text("x-cache-control") {
                    response
                        .headers_mut()
                        .insert(header::CACHE_CONTROL, cc.parse().expect("value"));
                }
                match text("x-disposition").as_deref() {
                    Some("release") => {
                        response.extensions_mut().insert(Disposition::Release);
                    }
                    Some("fail") => {
                        response.extensions_mut().insert(Disposition::Fail);
                    }
                    Some("complete") => {
                        response.extensions_mut().insert(Disposition::Complete);
                    }
                    _ => {}
                }
                response
            }),
        )
        .route_layer(layer)
        .layer(middleware::from_fn(
            axum_idempotency::conformance::app::auth,
        ));
    (router, runs)
}

fn layer() -> IdempotencyLayerBuilder<MemoryStore> {
    IdempotencyLayer::builder(MemoryStore::new())
}

fn text(answer: &Answer) -> String {
    String::from_utf8_lossy(&answer.body).into_owned()
}

#[tokio::test]
async fn a_json_rejection_releases_the_key_and_the_corrected_retry_runs() {
    let (router, runs) = app(layer().build().expect("layer"));
    // `7.0` does not fit the integer field: axum's `Json` refuses it with 422 before the handler.
    let refused = send(
        &router,
        post("/charge")
            .key("k1")
            .user("alice")
            .json(r#"{"amount":7.0}"#),
    )
    .await;
    assert_eq!(
        refused.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "{refused:?}"
    );
    assert!(text(&refused).starts_with("Failed to deserialize the JSON body"));
    assert!(!refused.replayed());
    // The corrected retry (the same number to the canonical fingerprint) runs, not a replay.
    let ran = send(
        &router,
        post("/charge")
            .key("k1")
            .user("alice")
            .json(r#"{"amount":7}"#),
    )
    .await;
    assert_eq!(ran.status, StatusCode::CREATED, "{ran:?}");
    assert_eq!(text(&ran), "charged 7 (run 1)");
    assert!(!ran.replayed());
    let replay = send(
        &router,
        post("/charge")
            .key("k1")
            .user("alice")
            .json(r#"{"amount":7}"#),
    )
    .await;
    assert!(replay.replayed());
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    // A body that is not JSON (400), a missing content type (415), a bad path (400): each
    // released, so each key's corrected request runs.
    let bad = [
        (
            post("/charge")
                .key("k2")
                .user("alice")
                .json(r#"{"amount":"#),
            StatusCode::BAD_REQUEST,
        ),
        (
            post("/charge")
                .key("k3")
                .user("alice")
                .body(axum::body::Body::from(r#"{"amount":1}"#)),
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
        ),
        (
            post("/path/abc").key("k5").user("alice"),
            StatusCode::BAD_REQUEST,
        ),
    ];
    for (request, status) in bad {
        let refused = send(&router, request).await;
        assert_eq!(refused.status, status, "{refused:?}");
    }
    let good = [
        post("/charge")
            .key("k2")
            .user("alice")
            .json(r#"{"amount":2}"#),
        post("/charge")
            .key("k3")
            .user("alice")
            .json(r#"{"amount":3}"#),
        post("/path/5").key("k5").user("alice"),
    ];
    for request in good {
        let ran = send(&router, request).await;
        assert!(ran.status.is_success(), "{ran:?}");
        assert!(!ran.replayed(), "{ran:?}");
    }
    assert_eq!(runs.load(Ordering::SeqCst), 4);
}

#[tokio::test]
async fn rejections_follow_the_status_policy_when_told_to() {
    let (router, runs) = app(layer().release_rejections(false).build().expect("layer"));
    let refused = send(
        &router,
        post("/charge")
            .key("k")
            .user("alice")
            .json(r#"{"amount":7.0}"#),
    )
    .await;
    assert_eq!(refused.status, StatusCode::UNPROCESSABLE_ENTITY);
    // Recorded as failed: the same request replays the refusal.
    let again = send(
        &router,
        post("/charge")
            .key("k")
            .user("alice")
            .json(r#"{"amount":7.0}"#),
    )
    .await;
    assert!(again.replayed(), "{again:?}");
    assert_eq!(again.body, refused.body);
    assert_eq!(runs.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn a_handlers_own_text_answer_is_no_rejection() {
    // A 400 in text/plain that is not axum's: recorded as failed, as the policy says.
    let (router, runs) = app(layer().build().expect("layer"));
    let first = send(
        &router,
        post("/say")
            .key("k")
            .user("alice")
            .header("x-status", "400"),
    )
    .await;
    assert_eq!(first.status, StatusCode::BAD_REQUEST);
    let again = send(
        &router,
        post("/say")
            .key("k")
            .user("alice")
            .header("x-status", "400"),
    )
    .await;
    assert!(again.replayed(), "{again:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn the_handlers_disposition_overrides_the_status_policy() {
    let (router, runs) = app(layer().build().expect("layer"));
    let say = |key: &str, status: &str, disposition: &str| {
        post("/say")
            .key(key)
            .user("alice")
            .header("x-status", status)
            .header("x-disposition", disposition)
    };
    // A 500 after an effect that committed: recorded as failed and replayed.
    let first = send(&router, say("charged", "500", "fail")).await;
    assert_eq!(first.status, StatusCode::INTERNAL_SERVER_ERROR);
    let again = send(&router, say("charged", "500", "fail")).await;
    assert!(again.replayed(), "{again:?}");
    assert_eq!(text(&again), "run 1");
    // A 422 after which nothing happened: released, the retry runs.
    let refused = send(&router, say("refused", "422", "release")).await;
    assert_eq!(refused.status, StatusCode::UNPROCESSABLE_ENTITY);
    let retried = send(&router, say("refused", "422", "release")).await;
    assert!(!retried.replayed(), "{retried:?}");
    assert_eq!(text(&retried), "run 3");
    // A 200 the handler says to release: released too.
    send(&router, say("ok", "200", "release")).await;
    let ok = send(&router, say("ok", "200", "release")).await;
    assert!(!ok.replayed());
    assert_eq!(runs.load(Ordering::SeqCst), 5);
}

#[tokio::test]
async fn no_store_releases_only_when_asked() {
    let no_store = |key: &str| {
        post("/say")
            .key(key)
            .user("alice")
            .header("x-cache-control", "private, No-Store")
    };
    // Off by default: recorded (and its cache-control replayed).
    let (router, runs) = app(layer().build().expect("layer"));
    send(&router, no_store("k")).await;
    let replay = send(&router, no_store("k")).await;
    assert!(replay.replayed());
    assert_eq!(replay.header("cache-control"), Some("private, No-Store"));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    // On: released, the retry runs; an answer without it is recorded; a Disposition decides.
    let (router, runs) = app(layer().release_no_store(true).build().expect("layer"));
    send(&router, no_store("k")).await;
    let again = send(&router, no_store("k")).await;
    assert!(!again.replayed());
    assert_eq!(text(&again), "run 2");
    let plain = |key: &str| post("/say").key(key).user("alice");
    send(&router, plain("p")).await;
    assert!(send(&router, plain("p")).await.replayed());
    send(&router, no_store("d").header("x-disposition", "complete")).await;
    assert!(
        send(&router, no_store("d").header("x-disposition", "complete"))
            .await
            .replayed()
    );
    assert_eq!(runs.load(Ordering::SeqCst), 4);
}

#[tokio::test]
async fn the_key_comes_from_where_the_layer_is_told() {
    // Another header; the draft's header alone still keys; both must agree.
    let (router, runs) = app(layer().key_header("X-Request-Id").build().expect("layer"));
    let by = |name: &str, key: &str| post("/say").user("alice").header(name, key);
    send(&router, by("x-request-id", "a")).await;
    assert!(send(&router, by("x-request-id", "a")).await.replayed());
    assert!(send(&router, by("idempotency-key", "a")).await.replayed());
    let both = send(&router, by("x-request-id", "a").key("b")).await;
    assert_eq!(both.status, StatusCode::BAD_REQUEST, "{both:?}");
    assert_eq!(both.problem(), "invalid_idempotency_key");
    assert!(
        both.json()["detail"]
            .as_str()
            .expect("detail")
            .contains("different keys")
    );
    let agreeing = send(&router, by("x-request-id", "a").key("a")).await;
    assert!(agreeing.replayed());
    let bad = send(&router, by("x-request-id", "caf\u{e9}")).await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST, "{bad:?}");
    // No key anywhere: unguarded, runs every time.
    send(&router, post("/say").user("alice")).await;
    send(&router, post("/say").user("alice")).await;
    assert_eq!(runs.load(Ordering::SeqCst), 3);

    // The application's extractor, from the parts.
    let (router, runs) = app(layer()
        .key_from(|parts| {
            parts
                .uri
                .query()
                .and_then(|q| q.strip_prefix("op="))
                .map(str::to_owned)
        })
        .build()
        .expect("layer"));
    send(&router, post("/say?op=x1").user("alice")).await;
    assert!(
        send(&router, post("/say?op=x1").user("alice"))
            .await
            .replayed()
    );
    let long = format!("/say?op={}", "k".repeat(256));
    let refused = send(&router, post(&long).user("alice")).await;
    assert_eq!(refused.status, StatusCode::BAD_REQUEST);
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    // A field of the JSON body, as AIP-155's request_id.
    let (router, runs) = app(layer().key_from_body("/request_id").build().expect("layer"));
    let body = |json: &str| post("/say").user("alice").json(json);
    send(&router, body(r#"{"request_id":"r1","amount":5}"#)).await;
    let replay = send(&router, body(r#"{"amount":5,"request_id":"r1"}"#)).await;
    assert!(replay.replayed(), "{replay:?}");
    // Another body under the same key is the layer's 422.
    let reuse = send(&router, body(r#"{"request_id":"r1","amount":6}"#)).await;
    assert_eq!(reuse.problem(), "idempotency_key_reuse");
    // The field and the draft's header must agree.
    let both = send(&router, body(r#"{"request_id":"r1"}"#).key("other")).await;
    assert_eq!(both.problem(), "invalid_idempotency_key");
    // A field that is not a string is refused; no field, no key: unguarded.
    let number = send(&router, body(r#"{"request_id":7}"#)).await;
    assert_eq!(number.problem(), "invalid_idempotency_key");
    send(&router, body(r#"{"amount":1}"#)).await;
    send(&router, body(r#"{"amount":1}"#)).await;
    assert_eq!(runs.load(Ordering::SeqCst), 3);
    // Only a key makes a request the layer's: without one, an anonymous caller (no subject, which
    // a guarded request needs) runs, and a body that is not JSON is not read at all, however
    // large.
    let anonymous = send(&router, post("/say").json(r#"{"amount":1}"#)).await;
    assert_eq!(anonymous.status, StatusCode::OK, "{anonymous:?}");
    let upload = post("/say")
        .user("alice")
        .header("content-type", "application/octet-stream")
        .body(axum::body::Body::from(vec![b'x'; 2 * 1024 * 1024]));
    let upload = send(&router, upload).await;
    assert_eq!(upload.status, StatusCode::OK, "{upload:?}");
    // JSON sent as text (a browser's `fetch` with a string body) is read: it is keyed.
    let as_text = || {
        post("/say")
            .user("alice")
            .header("content-type", "text/plain;charset=UTF-8")
            .body(axum::body::Body::from(r#"{"request_id":"t1"}"#))
    };
    assert!(!send(&router, as_text()).await.replayed());
    assert!(send(&router, as_text()).await.replayed());
    let keyed_anonymous = send(&router, post("/say").json(r#"{"request_id":"r9"}"#)).await;
    assert_eq!(keyed_anonymous.problem(), "missing_subject");
    assert_eq!(runs.load(Ordering::SeqCst), 6);
    // Required: a body without the field is 400, naming the field.
    let (router, _) = app(layer()
        .key_from_body("/request_id")
        .require_key(true)
        .build()
        .expect("layer"));
    let missing = send(&router, body(r#"{"amount":1}"#)).await;
    assert_eq!(missing.problem(), "missing_idempotency_key");
    assert!(
        missing.json()["detail"]
            .as_str()
            .expect("detail")
            .contains("/request_id")
    );
    // A pointer that is none is refused when the layer is built.
    assert!(layer().key_from_body("request_id").build().is_err());
    assert!(layer().key_header("bad header").build().is_err());
}

#[tokio::test]
async fn a_replay_check_may_refuse_the_replay() {
    let checked = Arc::new(AtomicUsize::new(0));
    let seen = checked.clone();
    let (router, runs) = app(layer()
        .replay_check(move |parts, info| {
            seen.fetch_add(1, Ordering::SeqCst);
            let revoked = parts.headers.contains_key("x-revoked");
            let scope_ok = info.scope.subject == "alice" && info.record.status == 200;
            async move {
                assert!(scope_ok);
                revoked.then(|| (StatusCode::FORBIDDEN, "access revoked").into_response())
            }
        })
        .build()
        .expect("layer"));
    let first = send(&router, post("/say").key("k").user("alice")).await;
    assert_eq!(first.status, StatusCode::OK);
    assert_eq!(
        checked.load(Ordering::SeqCst),
        0,
        "a fresh answer is not checked"
    );
    let replay = send(&router, post("/say").key("k").user("alice")).await;
    assert!(replay.replayed());
    let refused = send(
        &router,
        post("/say").key("k").user("alice").header("x-revoked", "1"),
    )
    .await;
    assert_eq!(refused.status, StatusCode::FORBIDDEN);
    assert_eq!(text(&refused), "access revoked");
    assert!(!refused.replayed());
    assert!(refused.header("idempotency-expires").is_none());
    assert_eq!(checked.load(Ordering::SeqCst), 2);
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    // A check that panics refuses with 500, and nothing of the record.
    let (router, _) = app(layer()
        .replay_check(|_, _| async { panic!("the check failed") })
        .build()
        .expect("layer"));
    send(&router, post("/say").key("k").user("alice")).await;
    let refused = send(&router, post("/say").key("k").user("alice")).await;
    assert_eq!(refused.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(refused.problem(), "internal_error");
}

#[tokio::test]
async fn a_waiting_duplicates_replay_is_checked_too() {
    let (router, _) = app(layer()
        .wait(Duration::from_secs(3))
        .replay_check(|parts, _| {
            let revoked = parts.headers.contains_key("x-revoked");
            async move { revoked.then(|| StatusCode::FORBIDDEN.into_response()) }
        })
        .build()
        .expect("layer"));
    let slow = router.clone();
    let request = |revoked: bool| {
        let request = post("/say")
            .key("w")
            .user("alice")
            .header("x-status", "201")
            .header("x-delay-ms", "300");
        if revoked {
            request.header("x-revoked", "1")
        } else {
            request
        }
    };
    let holder = tokio::spawn(async move { send(&slow, request(false)).await });
    // Let the holder claim, then wait, while it runs, as a duplicate whose access was revoked.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let started = tokio::time::Instant::now();
    let waited = send(&router, request(true)).await;
    assert!(
        started.elapsed() >= Duration::from_millis(150),
        "the duplicate did not wait for the holder"
    );
    let first = holder.await.expect("holder");
    assert_eq!(first.status, StatusCode::CREATED);
    // The replay it waited for is checked, and refused: never sent.
    assert_eq!(waited.status, StatusCode::FORBIDDEN, "{waited:?}");
}

fn once_scope(key: &str) -> RecordKey {
    RecordKey {
        key: key.into(),
        subject: "consumer".into(),
        endpoint: "queue orders".into(),
    }
}

#[tokio::test]
async fn run_once_checks_its_replays_and_tells_an_expired_scope() {
    let allowed = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let flag = allowed.clone();
    let once = RunOnce::builder(MemoryStore::new())
        .retention(Duration::from_millis(300))
        .tombstones(Duration::from_secs(30))
        .replay_check(move |info| {
            let allow = flag.load(Ordering::SeqCst);
            let key = info.scope.key.clone();
            async move { (!allow).then(|| format!("{key} is no longer ours")) }
        })
        .build()
        .expect("valid settings");
    let fp = Fingerprint::of_material(b"input");
    let run = |n: u32| {
        let once = once.clone();
        async move {
            once.run(
                once_scope("m1"),
                fp,
                move |_| async move { Ok::<_, String>(n) },
            )
            .await
        }
    };
    assert_eq!(run(1).await.expect("ran"), 1);
    assert_eq!(run(2).await.expect("replayed"), 1);
    allowed.store(false, Ordering::SeqCst);
    match run(3).await {
        Err(OnceError::ReplayRefused(reason)) => assert_eq!(reason, "m1 is no longer ours"),
        other => panic!("{other:?}"),
    }
    allowed.store(true, Ordering::SeqCst);
    // Past the retention, within the tombstones' time: expired, and it does not run.
    tokio::time::sleep(Duration::from_millis(500)).await;
    for n in [4, 5] {
        match run(n).await {
            Err(OnceError::Expired) => {}
            other => panic!("{other:?}"),
        }
    }
    // A scope that names a tombstone's is refused: nothing may plant one.
    let planted = axum_idempotency::tombstone_of(&once_scope("m2"));
    match once
        .run(planted, fp, |_| async { Ok::<_, String>(0u32) })
        .await
    {
        Err(OnceError::Store(_)) => {}
        other => panic!("{other:?}"),
    }
    // And through the layer: a custom endpoint that names one is the application's fault, 500.
    let (router, runs) = app(layer()
        .endpoint(|_| " tombstone POST /say".to_owned())
        .build()
        .expect("layer"));
    let refused = send(&router, post("/say").key("k").user("alice")).await;
    assert_eq!(refused.problem(), "internal_error");
    assert_eq!(runs.load(Ordering::SeqCst), 0);
}
