//! What the layer benchmarks share: the request body and the handler.

use axum::body::Bytes;
use axum::extract::Request;
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum_idempotency::Subject;

/// A 1 KiB JSON checkout body (compact, keys already sorted, padded with spaces).
pub(crate) fn json_1k() -> Bytes {
    let items: Vec<_> = (0..12)
        .map(|i| serde_json::json!({"sku": format!("SKU-{i:04}"), "qty": i + 1, "price": 1999 + i}))
        .collect();
    let doc = serde_json::json!({"amount": 123456, "currency": "EUR", "items": items,
        "customer": {"id": 42, "email": "alice@example.com"}});
    let mut bytes = serde_json::to_vec(&doc).expect("json");
    bytes.resize(1024, b' ');
    Bytes::from(bytes)
}

/// A 150-byte JSON checkout body (compact, keys sorted, padded with spaces).
#[allow(dead_code)] // not every bench takes it
pub(crate) fn json_150() -> Bytes {
    let mut body = br#"{"amount":1999,"currency":"EUR","customer":{"email":"alice@example.com","id":42},"items":[{"price":1999,"qty":1,"sku":"SKU-0001"}],"note":"x"}"#.to_vec();
    body.resize(150, b' ');
    Bytes::from(body)
}

/// The body of the harnesses' requests: [`json_1k`], or [`json_150`] with `LOAD_BODY=small`.
#[allow(dead_code)] // not every bench takes it from the environment
pub(crate) fn body_from_env() -> Bytes {
    if std::env::var("LOAD_BODY").is_ok_and(|v| v == "small") {
        json_150()
    } else {
        json_1k()
    }
}

/// The route under test: answers `201` with a small JSON body and a `Location`, doing nothing else.
pub(crate) async fn created(_body: Bytes) -> Response {
    (
        StatusCode::CREATED,
        [
            ("content-type", "application/json"),
            ("location", "/charges/1"),
        ],
        r#"{"id":1,"status":"succeeded"}"#,
    )
        .into_response()
}

/// The same auth step for every server of the HTTP harnesses: the `authorization` header is the
/// subject.
#[allow(dead_code)] // not every bench serves over HTTP
pub(crate) async fn auth(mut request: Request, next: Next) -> Response {
    if let Some(s) = request
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
    {
        let subject = Subject(s.to_owned());
        request.extensions_mut().insert(subject);
    }
    next.run(request).await
}
