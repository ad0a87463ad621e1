//! The load generator: `clients` keep-alive HTTP/1.1 connections over loopback TCP (hyper's
//! client), each sending its next request as soon as the last one is answered, until a fixed count
//! is reached. It runs on the main runtime, never on the server's thread.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderValue, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

/// Request `i` of a run: its subject (the `authorization` header) and its `Idempotency-Key`.
pub(crate) type MakeRequest = Arc<dyn Fn(usize) -> (String, String) + Send + Sync>;

/// What a run measured from the client's side.
#[derive(Clone, Copy, Default)]
pub(crate) struct Stats {
    pub(crate) rps: f64,
    pub(crate) p50: Duration,
    /// Answers marked as replays (`Idempotent-Replayed: true`, or footing's
    /// `Idempotency-Replayed: true`).
    pub(crate) replayed: usize,
}

/// A 150-byte JSON checkout body (compact, padded with spaces), the same for every configuration.
pub(crate) fn body() -> Bytes {
    let mut body = br#"{"amount":1999,"currency":"EUR","customer":{"email":"alice@example.com","id":42},"items":[{"price":1999,"qty":1,"sku":"SKU-0001"}],"note":"x"}"#.to_vec();
    body.resize(150, b' ');
    Bytes::from(body)
}

/// `requests` requests from `clients` connections; request `i` is `make(i)`. Every answer must be
/// `201 Created`: anything else stops the harness with the answer's body.
pub(crate) async fn load(
    addr: SocketAddr,
    clients: usize,
    requests: usize,
    make: MakeRequest,
) -> Stats {
    let body = body();
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..clients {
        let (next, make, body) = (next.clone(), make.clone(), body.clone());
        workers.spawn(async move {
            let mut client = Client::connect(addr).await;
            let mut latencies = Vec::new();
            let mut replayed = 0;
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= requests {
                    return (latencies, replayed);
                }
                let (subject, key) = make(i);
                let t = Instant::now();
                let was_replay = client.post(&subject, &key, body.clone()).await;
                latencies.push(t.elapsed());
                replayed += usize::from(was_replay);
            }
        });
    }
    let mut all = Vec::with_capacity(requests);
    let mut replayed = 0;
    while let Some(done) = workers.join_next().await {
        let (latencies, replays) = done.expect("client");
        all.extend(latencies);
        replayed += replays;
    }
    let elapsed = started.elapsed();
    all.sort();
    Stats {
        rps: all.len() as f64 / elapsed.as_secs_f64(),
        p50: all[all.len() / 2],
        replayed,
    }
}

struct Client {
    sender: hyper::client::conn::http1::SendRequest<Full<Bytes>>,
    host: HeaderValue,
}

impl Client {
    async fn connect(addr: SocketAddr) -> Client {
        let stream = TcpStream::connect(addr).await.expect("connect");
        stream.set_nodelay(true).expect("nodelay");
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .expect("handshake");
        tokio::spawn(conn);
        Client {
            sender,
            host: HeaderValue::from_str(&addr.to_string()).expect("host"),
        }
    }

    /// Sends one POST; whether its answer says it is a replay.
    async fn post(&mut self, subject: &str, key: &str, body: Bytes) -> bool {
        self.sender.ready().await.expect("ready");
        let request = http::Request::post("/checkout")
            .header("host", self.host.clone())
            .header("authorization", subject)
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .body(Full::new(body))
            .expect("request");
        let response = self.sender.send_request(request).await.expect("response");
        let status = response.status();
        let replayed = ["idempotent-replayed", "idempotency-replayed"]
            .iter()
            .any(|name| response.headers().get(*name).is_some_and(|v| v == "true"));
        let answer = response
            .into_body()
            .collect()
            .await
            .expect("body")
            .to_bytes();
        assert_eq!(
            status,
            StatusCode::CREATED,
            "key {key}: {}",
            String::from_utf8_lossy(&answer)
        );
        replayed
    }
}
