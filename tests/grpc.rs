//! The gRPC mode against a real tonic client and a real tonic service, mounted in an axum router
//! behind the layer and served over HTTP/2 on a local TCP port. The behaviours that involve the
//! store (`behaviours!`) run on every store compiled in: memory, PostgreSQL, MySQL, SQLite and
//! Redis.

#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::routing::post;
use axum_idempotency::layer::grpc::{GrpcSettings, OtherCalls};
use axum_idempotency::{IdempotencyLayer, MemoryStore};
use http::uri::PathAndQuery;
use tokio::sync::Notify;
use tonic::transport::Channel;
use tonic::{Code, Status};
use tonic_prost::ProstCodec;

const PAY: &str = "/checkout.Checkout/Pay";
const WATCH: &str = "/checkout.Checkout/Watch";

#[derive(Clone, PartialEq, prost::Message)]
struct PayRequest {
    #[prost(string, tag = "1")]
    order: String,
    #[prost(uint64, tag = "2")]
    amount_cents: u64,
}

#[derive(Clone, PartialEq, prost::Message)]
struct PayReply {
    #[prost(string, tag = "1")]
    payment_id: String,
    #[prost(uint32, tag = "2")]
    run: u32,
}

/// `google.rpc.Status`, `google.protobuf.Any` and `google.rpc.ErrorInfo`, to read the layer's
/// status details with a protobuf library of its own.
#[derive(Clone, PartialEq, prost::Message)]
struct RpcStatus {
    #[prost(int32, tag = "1")]
    code: i32,
    #[prost(string, tag = "2")]
    message: String,
    #[prost(message, repeated, tag = "3")]
    details: Vec<Any>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct Any {
    #[prost(string, tag = "1")]
    type_url: String,
    #[prost(bytes = "vec", tag = "2")]
    value: Vec<u8>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct ErrorInfo {
    #[prost(string, tag = "1")]
    reason: String,
    #[prost(string, tag = "2")]
    domain: String,
    #[prost(map = "string, string", tag = "3")]
    metadata: HashMap<String, String>,
}

/// The service's state: how many times each order ran, and the gate of the slow one.
#[derive(Clone, Default)]
struct Shop {
    runs: Arc<Mutex<HashMap<String, u32>>>,
    started: Arc<Notify>,
    go_on: Arc<Notify>,
}

impl Shop {
    fn runs(&self, order: &str) -> u32 {
        self.runs.lock().unwrap().get(order).copied().unwrap_or(0)
    }

    /// The payment: by the order's name, a success, a slow success, a transient failure on the
    /// first run, or a definitive refusal with details.
    async fn pay(&self, request: PayRequest) -> Result<PayReply, Status> {
        let run = {
            let mut runs = self.runs.lock().unwrap();
            let run = runs.entry(request.order.clone()).or_default();
            *run += 1;
            *run
        };
        if request.order.starts_with("slow") {
            self.started.notify_one();
            self.go_on.notified().await;
        }
        if request.order.starts_with("flaky") && run == 1 {
            return Err(Status::unavailable("the bank is down"));
        }
        if request.order.starts_with("charged") {
            // Charged, then failed: the handler says its answer is final.
            let mut metadata = tonic::metadata::MetadataMap::new();
            metadata.insert("idempotency-disposition", "fail".parse().unwrap());
            return Err(Status::with_metadata(
                Code::Internal,
                "charged, then the ledger failed",
                metadata,
            ));
        }
        if request.order.starts_with("missing") {
            return Err(Status::with_details(
                Code::NotFound,
                "no such order",
                b"\x08\x05".to_vec().into(),
            ));
        }
        Ok(PayReply {
            payment_id: format!("pay-{}-{}", request.order, request.amount_cents),
            run,
        })
    }
}

async fn pay(State(shop): State<Shop>, request: Request) -> axum::response::Response {
    let mut grpc = tonic::server::Grpc::new(ProstCodec::<PayReply, PayRequest>::default());
    let service = tower::service_fn(move |request: tonic::Request<PayRequest>| {
        let shop = shop.clone();
        async move {
            let reply = shop.pay(request.into_inner()).await?;
            Ok::<_, Status>(tonic::Response::new(reply))
        }
    });
    grpc.unary(service, request).await.map(Body::new)
}

/// A server-streaming method: two replies per call, each counted.
async fn watch(State(shop): State<Shop>, request: Request) -> axum::response::Response {
    let mut grpc = tonic::server::Grpc::new(ProstCodec::<PayReply, PayRequest>::default());
    let service = tower::service_fn(move |request: tonic::Request<PayRequest>| {
        let shop = shop.clone();
        async move {
            let order = request.into_inner().order;
            let run = {
                let mut runs = shop.runs.lock().unwrap();
                let run = runs.entry(order.clone()).or_default();
                *run += 1;
                *run
            };
            let replies = (0..2).map(move |i| {
                Ok(PayReply {
                    payment_id: format!("{order}-{i}"),
                    run,
                })
            });
            Ok::<_, Status>(tonic::Response::new(futures_util::stream::iter(
                replies.collect::<Vec<_>>(),
            )))
        }
    });
    grpc.server_streaming(service, request).await.map(Body::new)
}

/// The service behind a gRPC layer set by `settings`, served on a local port: its state and a
/// client channel to it.
/// The shop behind a layer on the memory store (see `serve_on`).
async fn serve(
    settings: GrpcSettings,
    tune: impl FnOnce(
        axum_idempotency::IdempotencyLayerBuilder<MemoryStore>,
    ) -> axum_idempotency::IdempotencyLayerBuilder<MemoryStore>,
) -> (Shop, Channel, std::net::SocketAddr) {
    serve_on(MemoryStore::new(), settings, tune).await
}

/// The shop's service in an axum router behind a gRPC layer on `store` (tuned by `tune`), served
/// over HTTP/2 on a local port, and a tonic channel to it.
async fn serve_on<St>(
    store: St,
    settings: GrpcSettings,
    tune: impl FnOnce(
        axum_idempotency::IdempotencyLayerBuilder<St>,
    ) -> axum_idempotency::IdempotencyLayerBuilder<St>,
) -> (Shop, Channel, std::net::SocketAddr)
where
    St: axum_idempotency::store::IdempotencyStore + Clone + Send + Sync + 'static,
{
    let layer = tune(
        IdempotencyLayer::builder(store)
            .allow_anonymous(true)
            .require_key(true),
    )
    .grpc(settings)
    .build()
    .unwrap();
    let shop = Shop::default();
    let app = Router::new()
        .route(PAY, post(pay))
        .route(WATCH, post(watch))
        .layer(layer)
        .with_state(shop.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    (shop, channel, addr)
}

fn unary_settings() -> GrpcSettings {
    GrpcSettings::new().unary([PAY])
}

async fn call(
    channel: &Channel,
    key: Option<&str>,
    order: &str,
    amount_cents: u64,
) -> Result<tonic::Response<PayReply>, Status> {
    let mut client = tonic::client::Grpc::new(channel.clone());
    client.ready().await.unwrap();
    let mut request = tonic::Request::new(PayRequest {
        order: order.to_owned(),
        amount_cents,
    });
    if let Some(key) = key {
        request
            .metadata_mut()
            .insert("idempotency-key", key.parse().unwrap());
    }
    client
        .unary(
            request,
            PathAndQuery::from_static(PAY),
            ProstCodec::<PayRequest, PayReply>::default(),
        )
        .await
}

/// The `ErrorInfo` of a status the layer answered.
fn error_info(status: &Status) -> ErrorInfo {
    use prost::Message;
    let details = RpcStatus::decode(status.details()).unwrap();
    assert_eq!(details.code, status.code() as i32);
    assert_eq!(details.message, status.message());
    let info = details
        .details
        .iter()
        .find(|any| any.type_url == "type.googleapis.com/google.rpc.ErrorInfo")
        .unwrap();
    let info = ErrorInfo::decode(info.value.as_slice()).unwrap();
    assert_eq!(info.domain, "axum-idempotency");
    assert!(info.metadata["instance"].starts_with("urn:uuid:"));
    info
}

fn replayed<T>(response: &tonic::Response<T>) -> bool {
    response
        .metadata()
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true")
}

#[tokio::test]
async fn a_message_over_the_body_limit_exhausts_a_resource() {
    let (shop, channel, _) = serve(unary_settings(), |b| b.body_limit(64)).await;
    let order = "x".repeat(100);
    let refused = call(&channel, Some("k"), &order, 1).await.unwrap_err();
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
    assert_eq!(error_info(&refused).reason, "request_too_large");
    assert_eq!(shop.runs(&order), 0);
}

async fn watch_call(channel: &Channel, key: Option<&str>) -> Result<Vec<PayReply>, Status> {
    let mut client = tonic::client::Grpc::new(channel.clone());
    client.ready().await.unwrap();
    let mut request = tonic::Request::new(PayRequest {
        order: "stream".into(),
        amount_cents: 1,
    });
    if let Some(key) = key {
        request
            .metadata_mut()
            .insert("idempotency-key", key.parse().unwrap());
    }
    let mut stream = client
        .server_streaming(
            request,
            PathAndQuery::from_static(WATCH),
            ProstCodec::<PayRequest, PayReply>::default(),
        )
        .await?
        .into_inner();
    let mut replies = Vec::new();
    while let Some(reply) = stream.message().await? {
        replies.push(reply);
    }
    Ok(replies)
}

#[tokio::test]
async fn a_streaming_call_with_a_key_is_refused_by_default() {
    let (shop, channel, _) = serve(unary_settings(), |b| b).await;
    let refused = watch_call(&channel, Some("k")).await.unwrap_err();
    assert_eq!(refused.code(), Code::Unimplemented, "{refused:?}");
    assert_eq!(error_info(&refused).reason, "idempotency_not_supported");
    assert_eq!(shop.runs("stream"), 0);
    // Without a key it is not the layer's business, whatever require_key says.
    assert_eq!(watch_call(&channel, None).await.unwrap().len(), 2);
    assert_eq!(shop.runs("stream"), 1);
    // Nor where the application reads the key itself and finds none.
    let (shop, channel, _) = serve(unary_settings(), |b| {
        b.key_from(|parts| {
            let key = parts.headers.get("x-operation-id")?.to_str().ok()?;
            Some(key.to_owned())
        })
    })
    .await;
    assert_eq!(watch_call(&channel, None).await.unwrap().len(), 2);
    assert_eq!(shop.runs("stream"), 1);
}

#[tokio::test]
async fn a_streaming_call_passes_through_unguarded_where_set_so() {
    let settings = unary_settings().other_calls(OtherCalls::PassThrough);
    let (shop, channel, _) = serve(settings, |b| b).await;
    let first = watch_call(&channel, Some("k")).await.unwrap();
    let second = watch_call(&channel, Some("k")).await.unwrap();
    assert_eq!(first.len(), 2);
    assert_eq!(second[0].run, 2, "not guarded: it runs again");
    assert_eq!(shop.runs("stream"), 2);
}

/// One call over a raw HTTP/2 connection: the answer's status, headers, body and trailers as
/// they are on the wire.
async fn raw_call(
    addr: std::net::SocketAddr,
    key: &str,
    message: &PayRequest,
) -> (http::response::Parts, bytes::Bytes, Option<http::HeaderMap>) {
    use http_body_util::BodyExt;
    use prost::Message;
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut sender, connection) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(stream),
    )
    .await
    .unwrap();
    tokio::spawn(connection);
    let encoded = message.encode_to_vec();
    let mut frame = vec![0u8];
    frame.extend_from_slice(&(encoded.len() as u32).to_be_bytes());
    frame.extend_from_slice(&encoded);
    let request = http::Request::post(format!("http://{addr}{PAY}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("idempotency-key", key)
        .body(http_body_util::Full::new(bytes::Bytes::from(frame)))
        .unwrap();
    let response = sender.send_request(request).await.unwrap();
    let (parts, body) = response.into_parts();
    let collected = body.collect().await.unwrap();
    let trailers = collected.trailers().cloned();
    (parts, collected.to_bytes(), trailers)
}

#[tokio::test]
async fn a_replay_sends_the_recorded_headers_body_and_trailers_on_the_wire() {
    let (shop, _, addr) = serve(unary_settings(), |b| b).await;
    // A success: headers, the message, then the status in trailers. A refusal from tonic:
    // trailers-only, the status in the headers.
    for (order, status, trailers_only) in [("wire", "0", false), ("missing-wire", "5", true)] {
        let message = PayRequest {
            order: order.into(),
            amount_cents: 42,
        };
        let (first, first_body, first_trailers) = raw_call(addr, order, &message).await;
        let (replay, replay_body, replay_trailers) = raw_call(addr, order, &message).await;
        assert_eq!(shop.runs(order), 1);
        assert_eq!(replay.status, http::StatusCode::OK);
        assert_eq!(
            replay.headers["content-type"],
            first.headers["content-type"]
        );
        assert_eq!(replay.headers["idempotent-replayed"], "true");
        assert!(
            replay
                .headers
                .keys()
                .all(|name| !name.as_str().starts_with("idempotency-trailer-")),
            "{:?}",
            replay.headers
        );
        assert_eq!(replay_body, first_body);
        let (first_status, replay_status) = if trailers_only {
            assert!(first_trailers.is_none() && replay_trailers.is_none());
            assert!(first_body.is_empty());
            (first.headers, replay.headers)
        } else {
            assert!(
                replay.headers.get("grpc-status").is_none(),
                "in the trailers"
            );
            assert!(!first_body.is_empty());
            (first_trailers.unwrap(), replay_trailers.unwrap())
        };
        assert_eq!(first_status["grpc-status"], status);
        for name in ["grpc-status", "grpc-message", "grpc-status-details-bin"] {
            assert_eq!(
                replay_status.get(name),
                first_status.get(name),
                "{order}: {name}"
            );
        }
    }
}

#[tokio::test]
async fn the_layers_answers_are_trailers_only() {
    let (shop, channel, addr) = serve(unary_settings(), |b| b).await;
    call(&channel, Some("k"), "desk", 1).await.unwrap();
    let other = PayRequest {
        order: "desk".into(),
        amount_cents: 2,
    };
    let (parts, body, trailers) = raw_call(addr, "k", &other).await;
    assert_eq!(parts.status, http::StatusCode::OK);
    assert_eq!(parts.headers["content-type"], "application/grpc");
    assert_eq!(parts.headers["grpc-status"], "9");
    assert!(parts.headers.contains_key("grpc-message"));
    assert!(parts.headers.contains_key("grpc-status-details-bin"));
    assert!(body.is_empty());
    assert!(trailers.is_none());
    assert_eq!(shop.runs("desk"), 1);
}

/// A TCP proxy to `upstream` that cuts its first connection once the server has answered a call
/// whole (the end of a stream's answer: the server has recorded it), without passing that answer
/// on; later connections go through untouched. Answers how many answers it dropped.
async fn dropping_proxy(upstream: std::net::SocketAddr) -> (std::net::SocketAddr, Arc<Mutex<u32>>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let dropped = Arc::new(Mutex::new(0u32));
    let counted = dropped.clone();
    tokio::spawn(async move {
        let mut first = true;
        loop {
            let (client, _) = listener.accept().await.unwrap();
            let server = tokio::net::TcpStream::connect(upstream).await.unwrap();
            let cut = std::mem::replace(&mut first, false);
            let dropped = counted.clone();
            tokio::spawn(async move {
                let (mut client_read, mut client_write) = client.into_split();
                let (mut server_read, mut server_write) = server.into_split();
                let up = tokio::spawn(async move {
                    let _ = tokio::io::copy(&mut client_read, &mut server_write).await;
                });
                if !cut {
                    let _ = tokio::io::copy(&mut server_read, &mut client_write).await;
                    return;
                }
                // HTTP/2 frames from the server: those of the connection (stream 0) pass, those
                // of a call are held back; at the end of a call's answer the connection is cut.
                let mut pending = Vec::new();
                let mut chunk = [0u8; 16 * 1024];
                loop {
                    let n = server_read.read(&mut chunk).await.unwrap_or(0);
                    if n == 0 {
                        return;
                    }
                    pending.extend_from_slice(&chunk[..n]);
                    while pending.len() >= 9 {
                        let len = (usize::from(pending[0]) << 16)
                            | (usize::from(pending[1]) << 8)
                            | usize::from(pending[2]);
                        if pending.len() < 9 + len {
                            break;
                        }
                        let frame: Vec<u8> = pending.drain(..9 + len).collect();
                        let (kind, flags) = (frame[3], frame[4]);
                        let stream = u32::from_be_bytes([frame[5], frame[6], frame[7], frame[8]])
                            & 0x7fff_ffff;
                        if stream == 0 {
                            client_write.write_all(&frame).await.unwrap();
                        } else if kind <= 1 && flags & 1 == 1 {
                            // DATA or HEADERS with END_STREAM: the answer is whole, and dropped.
                            *dropped.lock().unwrap() += 1;
                            up.abort();
                            return;
                        }
                    }
                }
            });
        }
    });
    (addr, dropped)
}

#[tokio::test]
async fn a_grpcio_client_whose_answer_was_lost_gets_the_replay_of_its_retry() {
    // The test sets up what it needs, as the others start their servers: grpcio, installed
    // (per user where the system Python refuses installs outside a virtual environment) when
    // python3 lacks it.
    let has_grpc = || async {
        tokio::process::Command::new("python3")
            .args(["-c", "import grpc"])
            .status()
            .await
            .is_ok_and(|status| status.success())
    };
    if !has_grpc().await {
        for extra in [&[][..], &["--user", "--break-system-packages"][..]] {
            let _ = tokio::process::Command::new("python3")
                .args(["-m", "pip", "install", "--quiet", "grpcio>=1.60"])
                .args(extra)
                .status()
                .await;
            if has_grpc().await {
                break;
            }
        }
    }
    assert!(
        has_grpc().await,
        "this test needs python3 with grpcio, which `python3 -m pip install grpcio` did not install"
    );
    let (shop, _, addr) = serve(unary_settings(), |b| b).await;
    let (proxy, dropped) = dropping_proxy(addr).await;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/grpc_python/client.py");
    let output = tokio::process::Command::new("python3")
        .arg(script)
        .arg(proxy.to_string())
        .args(["py-key-1", "chair", "4500"])
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let result: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(*dropped.lock().unwrap(), 1, "the first answer was dropped");
    assert_eq!(result["code"], "OK", "{result}");
    assert!(result["attempts"].as_u64().unwrap() >= 2, "{result}");
    assert_eq!(result["replayed"], true, "{result}");
    assert_eq!(result["payment_id"], "pay-chair-4500");
    assert_eq!(result["run"], 1);
    assert_eq!(shop.runs("chair"), 1, "the handler ran once");
}

/// The behaviours that involve the store, run on each store (`stores!`): a module that defines
/// `serve` on its store expands them.
macro_rules! behaviours {
    () => {
        #[tokio::test]
        async fn a_unary_call_runs_once_and_its_retry_replays_the_answer() {
            let (shop, channel, _) = serve(unary_settings(), |b| b).await;
            let first = call(&channel, Some("k-1"), "book", 1200).await.unwrap();
            assert!(!replayed(&first));
            let retry = call(&channel, Some("k-1"), "book", 1200).await.unwrap();
            assert!(replayed(&retry));
            assert_eq!(retry.get_ref(), first.get_ref());
            assert_eq!(retry.get_ref().payment_id, "pay-book-1200");
            assert_eq!(shop.runs("book"), 1);
            // Another key is another operation.
            let other = call(&channel, Some("k-2"), "book", 1200).await.unwrap();
            assert_eq!(other.get_ref().run, 2);
            assert_eq!(shop.runs("book"), 2);
        }

        #[tokio::test]
        async fn a_retry_with_another_message_under_the_same_key_fails_its_precondition() {
            let (shop, channel, _) = serve(unary_settings(), |b| b).await;
            call(&channel, Some("k"), "lamp", 100).await.unwrap();
            let reused = call(&channel, Some("k"), "lamp", 999).await.unwrap_err();
            assert_eq!(reused.code(), Code::FailedPrecondition, "{reused:?}");
            assert_eq!(error_info(&reused).reason, "idempotency_key_reuse");
            assert_eq!(shop.runs("lamp"), 1);
        }

        #[tokio::test]
        async fn a_duplicate_while_the_first_runs_is_aborted_with_a_pushback() {
            let (shop, channel, _) = serve(unary_settings(), |b| b).await;
            let first = {
                let channel = channel.clone();
                tokio::spawn(async move { call(&channel, Some("k"), "slow", 5).await })
            };
            shop.started.notified().await;
            let duplicate = call(&channel, Some("k"), "slow", 5).await.unwrap_err();
            assert_eq!(duplicate.code(), Code::Aborted, "{duplicate:?}");
            assert_eq!(
                duplicate.metadata().get("grpc-retry-pushback-ms").unwrap(),
                "2000"
            );
            assert_eq!(error_info(&duplicate).reason, "in_progress");
            shop.go_on.notify_one();
            let first = first.await.unwrap().unwrap();
            let retry = call(&channel, Some("k"), "slow", 5).await.unwrap();
            assert!(replayed(&retry));
            assert_eq!(retry.get_ref(), first.get_ref());
            assert_eq!(shop.runs("slow"), 1);
        }

        #[tokio::test]
        async fn a_call_without_a_key_is_an_invalid_argument_where_keys_are_required() {
            let (shop, channel, _) = serve(unary_settings(), |b| b).await;
            let missing = call(&channel, None, "rug", 1).await.unwrap_err();
            assert_eq!(missing.code(), Code::InvalidArgument, "{missing:?}");
            assert_eq!(error_info(&missing).reason, "missing_idempotency_key");
            assert_eq!(shop.runs("rug"), 0);
            // Where keys are optional (the HTTP layer's default), it passes through unguarded.
            let (shop, channel, _) = serve(unary_settings(), |b| b.require_key(false)).await;
            call(&channel, None, "rug", 1).await.unwrap();
            call(&channel, None, "rug", 1).await.unwrap();
            assert_eq!(shop.runs("rug"), 2);
        }

        #[tokio::test]
        async fn a_handlers_unavailable_releases_the_key_and_the_retry_runs() {
            let (shop, channel, _) = serve(unary_settings(), |b| b).await;
            let failed = call(&channel, Some("k"), "flaky", 7).await.unwrap_err();
            assert_eq!(failed.code(), Code::Unavailable);
            assert_eq!(failed.message(), "the bank is down");
            let retry = call(&channel, Some("k"), "flaky", 7).await.unwrap();
            assert!(!replayed(&retry));
            assert_eq!(retry.get_ref().run, 2);
            // Recorded now: the next retry replays.
            let again = call(&channel, Some("k"), "flaky", 7).await.unwrap();
            assert!(replayed(&again));
            assert_eq!(again.get_ref().run, 2);
            assert_eq!(shop.runs("flaky"), 2);
        }

        /// An `INTERNAL` whose handler says `idempotency-disposition: fail` (its effect happened) is
        /// recorded and replayed, not released: the retry does not charge again. The metadata is taken
        /// off the answer.
        #[tokio::test]
        async fn a_handler_that_says_its_failure_is_final_is_replayed_not_run_again() {
            let (shop, channel, _) = serve(unary_settings(), |b| b).await;
            let first = call(&channel, Some("k"), "charged", 5).await.unwrap_err();
            assert_eq!(first.code(), Code::Internal);
            assert!(first.metadata().get("idempotency-disposition").is_none());
            let retry = call(&channel, Some("k"), "charged", 5).await.unwrap_err();
            assert_eq!(retry.code(), Code::Internal);
            assert_eq!(retry.message(), "charged, then the ledger failed");
            assert_eq!(retry.metadata().get("idempotent-replayed").unwrap(), "true");
            assert!(retry.metadata().get("idempotency-disposition").is_none());
            assert_eq!(shop.runs("charged"), 1);
        }

        #[tokio::test]
        async fn a_definitive_error_is_recorded_and_replayed_with_its_details() {
            let (shop, channel, _) = serve(unary_settings(), |b| b).await;
            let first = call(&channel, Some("k"), "missing", 3).await.unwrap_err();
            assert_eq!(first.code(), Code::NotFound);
            let retry = call(&channel, Some("k"), "missing", 3).await.unwrap_err();
            assert_eq!(retry.code(), Code::NotFound);
            assert_eq!(retry.message(), "no such order");
            assert_eq!(retry.details(), b"\x08\x05");
            assert_eq!(retry.details(), first.details());
            assert_eq!(retry.metadata().get("idempotent-replayed").unwrap(), "true");
            assert_eq!(shop.runs("missing"), 1);
        }

        #[tokio::test]
        async fn an_answer_over_the_response_limit_reaches_its_client_and_is_recorded_as_lost() {
            let (shop, channel, _) = serve(unary_settings(), |b| b.response_limit(8)).await;
            let first = call(&channel, Some("k"), "sofa", 90_000).await.unwrap();
            assert_eq!(first.get_ref().payment_id, "pay-sofa-90000");
            let retry = call(&channel, Some("k"), "sofa", 90_000).await.unwrap_err();
            assert_eq!(retry.code(), Code::DataLoss, "{retry:?}");
            assert_eq!(error_info(&retry).reason, "response_not_recorded");
            assert_eq!(retry.metadata().get("idempotent-replayed").unwrap(), "true");
            assert_eq!(shop.runs("sofa"), 1, "never run twice");
        }
    };
}

/// `behaviours!` on one store: the module's `serve` is `serve_on` a fresh store of its kind.
macro_rules! on_store {
    ($module:ident, $feature:literal, $store:ty, $fresh:expr) => {
        #[cfg(feature = $feature)]
        mod $module {
            #[allow(unused_imports)]
            use super::*;

            async fn serve<F>(
                settings: GrpcSettings,
                tune: F,
            ) -> (Shop, Channel, std::net::SocketAddr)
            where
                F: FnOnce(
                    axum_idempotency::IdempotencyLayerBuilder<$store>,
                ) -> axum_idempotency::IdempotencyLayerBuilder<$store>,
            {
                serve_on($fresh.await, settings, tune).await
            }

            behaviours!();
        }
    };
}

on_store!(memory, "grpc", MemoryStore, async { MemoryStore::new() });
on_store!(
    postgres,
    "postgres",
    axum_idempotency::store::PostgresStore,
    stores::postgres()
);
on_store!(
    sqlite,
    "sqlite",
    axum_idempotency::store::SqliteStore,
    stores::sqlite()
);
on_store!(
    mysql,
    "mysql",
    axum_idempotency::store::MySqlStore,
    stores::mysql()
);
on_store!(
    redis,
    "redis",
    axum_idempotency::store::RedisStore,
    stores::redis()
);

/// Fresh stores of each kind, on the servers the other tests use (the same variables, the same
/// defaults), each on a table, file or key prefix of its own.
#[allow(dead_code)]
mod stores {
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// `<seconds since the epoch>_<process>_<counter>`: unique, and dated, so that a later run
    /// drops what an earlier one left (an hour old).
    fn unique() -> String {
        static N: AtomicUsize = AtomicUsize::new(0);
        let secs = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs();
        format!(
            "{secs}_{}_{}",
            std::process::id(),
            N.fetch_add(1, Ordering::SeqCst)
        )
    }

    #[cfg(feature = "postgres")]
    pub(super) async fn postgres() -> axum_idempotency::store::PostgresStore {
        let url = std::env::var("DATABASE_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
        let pool = axum_idempotency::sqlx::PgPool::connect(&url).await.unwrap();
        let stale: Vec<(String,)> = axum_idempotency::sqlx::query_as(
            "SELECT tablename::text FROM pg_tables WHERE schemaname = current_schema() \
             AND tablename LIKE 'grpc\\_test\\_%' \
             AND split_part(tablename, '_', 3)::bigint < extract(epoch FROM now()) - 3600",
        )
        .fetch_all(&pool)
        .await
        .unwrap();
        for (table,) in stale {
            let drop = format!("DROP TABLE IF EXISTS \"{table}\"");
            let _ = axum_idempotency::sqlx::raw_sql(axum_idempotency::sqlx::AssertSqlSafe(drop))
                .execute(&pool)
                .await;
        }
        let store = axum_idempotency::store::PostgresStore::with_table(
            pool,
            &format!("grpc_test_{}", unique()),
        )
        .unwrap();
        store.migrate().await.unwrap();
        store
    }

    #[cfg(feature = "mysql")]
    pub(super) async fn mysql() -> axum_idempotency::store::MySqlStore {
        let url = std::env::var("MYSQL_URL")
            .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into());
        let pool = axum_idempotency::sqlx::MySqlPool::connect(&url)
            .await
            .unwrap();
        let stale: Vec<(String,)> = axum_idempotency::sqlx::query_as(
            "SELECT CAST(table_name AS CHAR) FROM information_schema.tables \
             WHERE table_schema = DATABASE() AND table_name LIKE 'grpc\\_test\\_%' \
             AND CAST(SUBSTRING_INDEX(SUBSTRING_INDEX(table_name, '_', 3), '_', -1) AS UNSIGNED) \
                 < UNIX_TIMESTAMP() - 3600",
        )
        .fetch_all(&pool)
        .await
        .unwrap();
        for (table,) in stale {
            let drop = format!("DROP TABLE IF EXISTS `{table}`");
            let _ = axum_idempotency::sqlx::raw_sql(axum_idempotency::sqlx::AssertSqlSafe(drop))
                .execute(&pool)
                .await;
        }
        let store = axum_idempotency::store::MySqlStore::with_table(
            pool,
            &format!("grpc_test_{}", unique()),
        )
        .unwrap();
        store.migrate().await.unwrap();
        store
    }

    #[cfg(feature = "sqlite")]
    pub(super) async fn sqlite() -> axum_idempotency::store::SqliteStore {
        let path = std::env::temp_dir().join(format!("axum_idempotency_grpc_{}.db", unique()));
        let options = axum_idempotency::store::SqliteStore::connect_options(
            axum_idempotency::sqlx::sqlite::SqliteConnectOptions::new().filename(path),
        );
        let pool = axum_idempotency::sqlx::sqlite::SqlitePoolOptions::new()
            .max_connections(4)
            .connect_with(options)
            .await
            .unwrap();
        let store = axum_idempotency::store::SqliteStore::new(pool);
        store.migrate().await.unwrap();
        store
    }

    #[cfg(feature = "redis")]
    pub(super) async fn redis() -> axum_idempotency::store::RedisStore {
        let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
        let client = axum_idempotency::redis::Client::open(url).unwrap();
        axum_idempotency::store::RedisStore::new(client)
            .unwrap()
            .with_prefix(&format!("grpc_test:{}:", unique()))
    }
}
