//! Instructions per request, for valgrind's callgrind, which counts them the same on every run
//! whatever else the machine does: the same router as `benches/layer.rs` (in-process, `oneshot`,
//! 1 KiB JSON body), bare or behind the layer with the memory store, fresh keys or replays.
//!
//! ```sh
//! cargo bench --bench instructions --no-run     # prints the binary's path
//! valgrind --tool=callgrind --callgrind-out-file=/tmp/cg.%p <binary> <bare|fresh|replay> <requests>
//! ```
//!
//! With `LOAD_BODY=small` the body is the 150-byte order of the load harness instead.
//!
//! Over HTTP (`<binary> http <bare|fresh|replay> <requests>`), the router is served by hyper on
//! 127.0.0.1 from a thread of its own (a current-thread runtime), behind the load harness's auth
//! step, and the main thread sends the requests one after another on one kept-alive connection.
//! Run it with `--separate-threads=yes`: the server's thread is callgrind's thread 2 (its file ends
//! in `-02`), and its counts are the server side of each request, HTTP included, as the targets
//! of SPEC 26 mean it.
//!
//! The harness runs `requests` requests after 200 warm-up ones, between two calls of
//! `measured_start` and `measured_end`, so `callgrind_annotate` can attribute the cost, and
//! instructions per request are (total at N2 − total at N1) / (N2 − N1), which cancels start-up.
//! Without arguments (as `cargo bench` runs it) it runs each mode for 1 000 requests and exits.
//!
//! Over gRPC (`<binary> grpc <bare|fresh|replay> <requests>`, feature `grpc`), the same, with a
//! unary tonic method (a hand-written service, a 150-byte-sized order) behind the layer's gRPC
//! mode, called by a tonic client over one HTTP/2 connection.

#[path = "support/in_process.rs"]
mod in_process;
mod support;

use in_process::{call, request};
use support::{auth, body_from_env, created};

use axum::Router;
use axum::middleware;
use axum::routing::post;
use axum_idempotency::{IdempotencyLayer, MemoryStore};
use http_body_util::{BodyExt, Full};

#[inline(never)]
fn measured_start() {
    std::hint::black_box(());
}

#[inline(never)]
fn measured_end() {
    std::hint::black_box(());
}

fn run(mode: &str, requests: usize) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let body = body_from_env();
    let router = match mode {
        "bare" => Router::new().route("/checkout", post(created)),
        "fresh" | "replay" => Router::new()
            .route("/checkout", post(created))
            .route_layer(IdempotencyLayer::new(MemoryStore::new()).expect("valid settings")),
        other => panic!("unknown mode {other}: bare, fresh or replay"),
    };
    let key = |i: usize| match mode {
        "fresh" => format!("fresh-{i}"),
        _ => "replayed".to_owned(),
    };
    runtime.block_on(async {
        for i in 0..200 {
            call(&router, request(&key(1_000_000 + i), &body)).await;
        }
        // Keys are made before the measured part, so that it counts only the requests.
        let keys: Vec<String> = (0..requests).map(key).collect();
        measured_start();
        for k in &keys {
            call(&router, request(k, &body)).await;
        }
        measured_end();
    });
}

/// `requests` requests over HTTP, after 200 warm-up ones: the server on a thread of its own, the
/// client on this one.
fn http(mode: &str, requests: usize) {
    let body = body_from_env();
    let routes = Router::new().route("/checkout", post(created));
    let router = match mode {
        "bare" => routes,
        "fresh" | "replay" => {
            routes.route_layer(IdempotencyLayer::new(MemoryStore::new()).expect("valid settings"))
        }
        other => panic!("unknown mode {other}: bare, fresh or replay"),
    }
    .layer(middleware::from_fn(auth));
    let addr = serve(router);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async move {
        let stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
        stream.set_nodelay(true).expect("nodelay");
        let (mut sender, connection) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                .await
                .expect("handshake");
        tokio::spawn(connection);
        let host = addr.to_string();
        let key = |i: usize| match mode {
            "fresh" => format!("fresh-{i}"),
            _ => "replayed".to_owned(),
        };
        for i in (1_000_000..1_000_200).chain(0..requests) {
            sender.ready().await.expect("ready");
            let request = axum::http::Request::post("/checkout")
                .header("host", &host)
                .header("authorization", "alice")
                .header("idempotency-key", key(i))
                .header("content-type", "application/json")
                .body(Full::new(body.clone()))
                .expect("request");
            let response = sender.send_request(request).await.expect("response");
            assert!(response.status().is_success(), "{}", response.status());
            response.into_body().collect().await.expect("body");
        }
    });
    // The server's thread is still serving: end here, and callgrind writes every thread's counts.
    std::process::exit(0);
}

/// The server on a thread of its own (spawned first, so that callgrind numbers it thread 2), on a
/// current-thread runtime; its address.
fn serve(router: Router) -> std::net::SocketAddr {
    let (bound, address) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("server".to_owned())
        .spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            runtime.block_on(async move {
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                    .await
                    .expect("bind");
                bound
                    .send(listener.local_addr().expect("addr"))
                    .expect("send");
                axum::serve(listener, router).await.expect("serve");
            });
        })
        .expect("server thread");
    address.recv().expect("the server's address")
}

/// A unary gRPC method, bare or behind the layer's gRPC mode, over HTTP/2.
#[cfg(feature = "grpc")]
mod grpc {
    use axum::Router;
    use axum::body::Body;
    use axum::extract::Request;
    use axum::middleware;
    use axum::routing::post;
    use axum_idempotency::layer::grpc::GrpcSettings;
    use axum_idempotency::{IdempotencyLayer, MemoryStore};
    use tonic_prost::ProstCodec;

    const PAY: &str = "/checkout.Checkout/Pay";

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
    }

    async fn pay(request: Request) -> axum::response::Response {
        let mut grpc = tonic::server::Grpc::new(ProstCodec::<PayReply, PayRequest>::default());
        let service = tower::service_fn(|request: tonic::Request<PayRequest>| async move {
            let order = request.into_inner();
            let payment_id = format!("pay-{}-{}", order.order, order.amount_cents);
            Ok::<_, tonic::Status>(tonic::Response::new(PayReply { payment_id }))
        });
        grpc.unary(service, request).await.map(Body::new)
    }

    pub(super) fn run(mode: &str, requests: usize) {
        let routes = Router::new().route(PAY, post(pay));
        let router = match mode {
            "bare" => routes,
            "fresh" | "replay" => routes.layer(
                IdempotencyLayer::builder(MemoryStore::new())
                    .grpc(GrpcSettings::new().unary([PAY]))
                    .build()
                    .expect("valid settings"),
            ),
            other => panic!("unknown mode {other}: bare, fresh or replay"),
        }
        .layer(middleware::from_fn(super::auth));
        let addr = super::serve(router);
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        runtime.block_on(async move {
            let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
                .expect("endpoint")
                .tcp_nodelay(true)
                .connect()
                .await
                .expect("connect");
            let mut client = tonic::client::Grpc::new(channel);
            let key = |i: usize| match mode {
                "fresh" => format!("fresh-{i}"),
                _ => "replayed".to_owned(),
            };
            // An order of about the load harness's small body.
            let order = "x".repeat(120);
            for i in (1_000_000..1_000_200).chain(0..requests) {
                client.ready().await.expect("ready");
                let mut request = tonic::Request::new(PayRequest {
                    order: order.clone(),
                    amount_cents: 4200,
                });
                let metadata = request.metadata_mut();
                metadata.insert("idempotency-key", key(i).parse().expect("key"));
                metadata.insert("authorization", "alice".parse().expect("subject"));
                let path = http::uri::PathAndQuery::from_static(PAY);
                let codec = ProstCodec::<PayRequest, PayReply>::default();
                client.unary(request, path, codec).await.expect("answered");
            }
        });
        // The server's thread is still serving: end here, and callgrind writes every thread's
        // counts.
        std::process::exit(0);
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.as_slice() {
        #[cfg(feature = "grpc")]
        [grpc_mode, mode, n] if grpc_mode == "grpc" => {
            grpc::run(mode, n.parse().expect("a request count"))
        }
        [http_mode, mode, n] if http_mode == "http" => {
            http(mode, n.parse().expect("a request count"))
        }
        [mode, n] if !mode.starts_with('-') => run(mode, n.parse().expect("a request count")),
        _ => {
            for mode in ["bare", "fresh", "replay"] {
                run(mode, 1_000);
            }
        }
    }
}
