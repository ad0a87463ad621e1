//! The idempotency layer among tower-http's layers: which go outside it, and why none of them
//! may cancel the handler from inside it. On the memory store, no database:
//!
//! ```text
//! cargo run --example tower_http
//! curl -i localhost:3000/orders -H 'Authorization: Bearer alice' \
//!      -H 'Idempotency-Key: order-1' -H 'Content-Type: application/json' -d '{"amount":100}'
//! ```

use std::time::Duration;

use axum::extract::Request;
use axum::handler::Handler;
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::post;
use axum::{Json, Router};
use axum_idempotency::{IdempotencyLayer, MemoryStore, Subject};
use serde_json::{Value, json};
use tower::ServiceBuilder;
use tower_http::catch_panic::CatchPanicLayer;
use tower_http::compression::CompressionLayer;
use tower_http::limit::RequestBodyLimitLayer;
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_http::timeout::TimeoutLayer;
use tower_http::trace::TraceLayer;

async fn create_order(Json(order): Json<Value>) -> (StatusCode, Json<Value>) {
    (StatusCode::CREATED, Json(json!({ "order": order })))
}

/// Stands in for your authentication: the bearer token is the subject.
async fn auth(mut request: Request, next: Next) -> Response {
    let subject = request
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::to_owned);
    if let Some(subject) = subject {
        request.extensions_mut().insert(Subject(subject));
    }
    next.run(request).await
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt().init();
    let idempotency = IdempotencyLayer::builder(MemoryStore::new())
        .require_key(true)
        // Bounds the handler itself: past it the handler is cancelled under its lease and the
        // key settled (a timeout layer inside the idempotency layer must never do this).
        .max_hold(Duration::from_secs(120))
        .build()?;
    let x_request_id = axum::http::HeaderName::from_static("x-request-id");
    // On the handler: the router's own answers (404, 405) stay the router's.
    let app = Router::new()
        .route("/orders", post(create_order.layer(idempotency)))
        .layer(middleware::from_fn(auth))
        .layer(
            ServiceBuilder::new()
                // Outermost: every layer below, the idempotency layer's span included, sees it.
                .layer(SetRequestIdLayer::new(
                    x_request_id.clone(),
                    MakeRequestUuid,
                ))
                .layer(TraceLayer::new_for_http())
                .layer(PropagateRequestIdLayer::new(x_request_id))
                .layer(CatchPanicLayer::new())
                // Outside: the record keeps plain bytes, and each answer, replays included, is
                // encoded for the request it answers.
                .layer(CompressionLayer::new())
                // Outside: a body over it is 413 and nothing is claimed.
                .layer(RequestBodyLimitLayer::new(64 * 1024))
                // Outside: the client gets 408, the handler runs on under its lease and is
                // recorded, and the retry with the same key gets the replay. Inside, it would
                // cancel the handler midway and the layer could not tell its 408 from the
                // handler's.
                .layer(TimeoutLayer::with_status_code(
                    StatusCode::REQUEST_TIMEOUT,
                    Duration::from_secs(30),
                )),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
    println!("listening on http://{}", listener.local_addr()?);
    axum::serve(listener, app).await?;
    Ok(())
}
