//! Driving a router in-process, without sockets: what `benches/layer.rs` and
//! `benches/instructions.rs` share.

use axum::Router;
use axum::body::{Body, Bytes};
use axum::http::Request;
use axum_idempotency::Subject;
use http_body_util::BodyExt;
use tower::ServiceExt;

/// `POST /checkout` with `key`, `body` and the subject `alice`.
pub(crate) fn request(key: &str, body: &Bytes) -> Request<Body> {
    let mut request = Request::post("/checkout")
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .header("content-length", body.len())
        .body(Body::from(body.clone()))
        .expect("request");
    request.extensions_mut().insert(Subject("alice".into()));
    request
}

/// Sends `request` and reads the whole answer, which must be a success.
pub(crate) async fn call(router: &Router, request: Request<Body>) {
    let response = router.clone().oneshot(request).await.expect("infallible");
    assert!(response.status().is_success());
    response.into_body().collect().await.expect("body");
}
