//! A gRPC service behind the layer: `checkout.Checkout` (see `proto/checkout.proto`), written by
//! hand with tonic's server and prost messages, mounted in an axum router and served over
//! HTTP/2 (cleartext).
//!
//! ```text
//! cargo run --example grpc_checkout --features grpc
//! grpcurl -plaintext -import-path examples/proto -proto checkout.proto \
//!     -H 'idempotency-key: order-1' -d '{"order":"book","amount_cents":1200}' \
//!     127.0.0.1:50051 checkout.Checkout/Pay
//! ```
//! Send it twice: the second answer is the replay (`idempotent-replayed: true` in its headers),
//! the same message and the same trailers. The same key with another amount gets
//! `FAILED_PRECONDITION`; an order named `declined` gets a definitive `FAILED_PRECONDITION` of
//! the service's own, replayed too; while the bank is "down" (every third payment) the service
//! answers `UNAVAILABLE`, which releases the key for a retry.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::routing::post;
use axum_idempotency::layer::grpc::{GrpcSettings, OtherCalls};
use axum_idempotency::{IdempotencyLayer, MemoryStore};
use tonic::Status;
use tonic_prost::ProstCodec;

/// `checkout.PayRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct PayRequest {
    #[prost(string, tag = "1")]
    pub order: String,
    #[prost(uint64, tag = "2")]
    pub amount_cents: u64,
}

/// `checkout.PayReply`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct PayReply {
    #[prost(string, tag = "1")]
    pub payment_id: String,
    #[prost(uint64, tag = "2")]
    pub amount_cents: u64,
}

/// `checkout.WatchRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct WatchRequest {
    #[prost(string, tag = "1")]
    pub order: String,
}

#[derive(Clone, Default)]
struct Bank {
    payments: Arc<AtomicU64>,
}

impl Bank {
    /// The effect that must happen once per key: here, only a counter.
    fn charge(&self, request: PayRequest) -> Result<PayReply, Status> {
        if request.order == "declined" {
            // Definitive: recorded as failed and replayed to every retry with the key.
            return Err(Status::failed_precondition("the card was declined"));
        }
        let n = self.payments.fetch_add(1, Ordering::SeqCst) + 1;
        if n.is_multiple_of(3) {
            // Transient, and nothing was charged: released, the retry with the key runs.
            return Err(Status::unavailable("the bank is down; retry"));
        }
        Ok(PayReply {
            payment_id: format!("pay-{n}"),
            amount_cents: request.amount_cents,
        })
    }
}

/// `/checkout.Checkout/Pay`, unary.
async fn pay(State(bank): State<Bank>, request: Request) -> axum::response::Response {
    let mut grpc = tonic::server::Grpc::new(ProstCodec::<PayReply, PayRequest>::default());
    let service = tower::service_fn(move |request: tonic::Request<PayRequest>| {
        let bank = bank.clone();
        async move { bank.charge(request.into_inner()).map(tonic::Response::new) }
    });
    grpc.unary(service, request).await.map(Body::new)
}

/// `/checkout.Checkout/Watch`, server-streaming.
async fn watch(State(bank): State<Bank>, request: Request) -> axum::response::Response {
    let mut grpc = tonic::server::Grpc::new(ProstCodec::<PayReply, WatchRequest>::default());
    let service = tower::service_fn(move |request: tonic::Request<WatchRequest>| {
        let paid = bank.payments.load(Ordering::SeqCst);
        let order = request.into_inner().order;
        let replies: Vec<Result<PayReply, Status>> = (1..=paid)
            .map(|n| {
                Ok(PayReply {
                    payment_id: format!("{order}-pay-{n}"),
                    amount_cents: 0,
                })
            })
            .collect();
        async move { Ok::<_, Status>(tonic::Response::new(futures_util::stream::iter(replies))) }
    });
    grpc.server_streaming(service, request).await.map(Body::new)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let idempotency = IdempotencyLayer::builder(MemoryStore::new())
        // A real service puts its authentication layer outside this one and guards by subject.
        .allow_anonymous(true)
        .min_key_length(8)
        .require_key(true)
        .grpc(
            GrpcSettings::new()
                .unary(["/checkout.Checkout/Pay"])
                .other_calls(OtherCalls::Refuse),
        )
        .build()?;
    let app = Router::new()
        .route("/checkout.Checkout/Pay", post(pay))
        .route("/checkout.Checkout/Watch", post(watch))
        .layer(idempotency)
        .with_state(Bank::default());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:50051").await?;
    println!("gRPC (h2c) on {}", listener.local_addr()?);
    axum::serve(listener, app).await?;
    Ok(())
}
