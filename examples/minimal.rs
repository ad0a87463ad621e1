//! The smallest useful setup: one route, the memory store, a stand-in for your auth layer.
//!
//! ```text
//! cargo run --example minimal
//! curl -i localhost:3000/orders -H 'Authorization: Bearer alice' \
//!      -H 'Idempotency-Key: order-1' -H 'Content-Type: application/json' -d '{"item":"book"}'
//! ```
//! Send it twice: the second answer is the replay (`Idempotent-Replayed: true`).

use axum::extract::Request;
use axum::handler::Handler;
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::post;
use axum::{Json, Router};
use axum_idempotency::{IdempotencyLayer, MemoryStore, Subject};
use serde_json::{Value, json};

async fn create_order(Json(order): Json<Value>) -> (axum::http::StatusCode, Json<Value>) {
    // The effect that must happen once: here, only a counter.
    static ORDERS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let id = ORDERS.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
    (
        axum::http::StatusCode::CREATED,
        Json(json!({ "id": id, "order": order })),
    )
}

/// Stands in for your auth layer: the bearer token is the subject.
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
    let idempotency = IdempotencyLayer::builder(MemoryStore::new())
        .require_key(true)
        .build()?;
    let app = Router::new()
        .route("/orders", post(create_order.layer(idempotency)))
        .layer(middleware::from_fn(auth));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
    println!("listening on http://{}", listener.local_addr()?);
    axum::serve(listener, app).await?;
    Ok(())
}
