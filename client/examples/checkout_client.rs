//! A caller of the checkout example that survives a flaky network: its first answers are lost on
//! the way back, after the server has charged, and the charge still happens once.
//!
//! ```text
//! cargo run --example checkout --features postgres                 # the server, in one terminal
//! cargo run -p axum-idempotency-client --example checkout_client  # this, in another
//! ```
//!
//! Environment: `CHECKOUT_URL` (default `http://127.0.0.1:3000`), `LOST_ANSWERS` (how many answers
//! the flaky network loses, default 2; 0 talks to the server straight), `SUBJECT` (whom to charge;
//! default a fresh name, so `/charges` shows this run only).
//!
//! The network is a relay on a loopback port that forwards each request to the server and, for the
//! first `LOST_ANSWERS` answers, closes the connection as the answer starts to come back: the
//! server did the work, the caller never heard. The client sends the same request with the same
//! `Idempotency-Key` again, and gets the first answer as a replay.

use std::error::Error;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, SystemTime};

use axum_idempotency_client::{
    IdempotencyError, IdempotencyKey, IdempotencyMiddleware, IdempotentRequestExt,
    IdempotentResponseExt, RetryPolicy,
};
use reqwest_middleware::ClientBuilder;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    let server = std::env::var("CHECKOUT_URL").unwrap_or_else(|_| "http://127.0.0.1:3000".into());
    let server = reqwest::Url::parse(&server)?;
    let lost: usize = match std::env::var("LOST_ANSWERS") {
        Ok(n) => n.parse()?,
        Err(_) => 2,
    };
    let subject = match std::env::var("SUBJECT") {
        Ok(subject) => subject,
        Err(_) => format!("caller-{}", &IdempotencyKey::generate()?.as_str()[..8]),
    };

    // The flaky network between this caller and the server.
    let upstream = server
        .socket_addrs(|| None)?
        .into_iter()
        .next()
        .ok_or("CHECKOUT_URL names no address")?;
    let relay = FlakyRelay::start(upstream, lost).await?;
    let mut via = server.clone();
    via.set_ip_host(relay.ip())
        .map_err(|()| "cannot address the relay")?;
    via.set_port(Some(relay.port()))
        .map_err(|()| "cannot address the relay")?;

    let client = ClientBuilder::new(
        reqwest::Client::builder()
            .timeout(Duration::from_secs(10))
            .build()?,
    )
    .with(IdempotencyMiddleware::new(
        RetryPolicy::new()
            .deadline(Duration::from_secs(30))
            .backoff(Duration::from_millis(100), Duration::from_secs(2)),
    ))
    .build();

    println!("charging {subject} 19.99 through a network that loses {lost} answer(s)");
    let sent = client
        .post(via.join("/checkout")?)
        .bearer_auth(&subject)
        .header("content-type", "application/json")
        .body(r#"{"amount":1999,"currency":"EUR"}"#)
        .idempotent()
        .send()
        .await;
    let response = match sent {
        Ok(response) => response,
        Err(e) => {
            // No answer at all: the charge may or may not have happened. The key is how to find
            // out: send the same request with it again (never with a new key).
            if let Some(e) = IdempotencyError::from_error(&e) {
                eprintln!(
                    "no answer after {} attempt(s); retry later with Idempotency-Key {:?}",
                    e.attempts(),
                    e.key().map(|k| k.as_str())
                );
            }
            return Err(e.into());
        }
    };
    let status = response.status();
    let info = response
        .idempotency()
        .cloned()
        .ok_or("an idempotent request's answer carries its IdempotencyInfo")?;
    let body = response.text().await?;
    println!("status: {status}");
    println!("key: {}", info.key());
    println!("attempts: {}", info.attempts());
    println!("replayed: {}", info.replayed());
    if let Some(expires) = info.expires_at() {
        let left = expires
            .duration_since(SystemTime::now())
            .unwrap_or_default();
        println!("key expires in: {} min", left.as_secs() / 60);
    }
    println!("answer: {body}");
    println!("answers lost on the way: {}", relay.cut());

    // What the server charged, asked straight (not through the flaky network).
    let charges = reqwest::Client::new()
        .get(server.join("/charges")?)
        .bearer_auth(&subject)
        .send()
        .await?
        .text()
        .await?;
    println!("charges: {charges}");
    if !status.is_success() {
        return Err(format!("the checkout answered {status}").into());
    }
    Ok(())
}

/// A relay on a loopback port that loses the first `lose` answers: it forwards each request, then
/// closes the caller's connection when the answer starts to come back.
struct FlakyRelay {
    addr: SocketAddr,
    left: Arc<AtomicUsize>,
    lose: usize,
}

impl FlakyRelay {
    async fn start(upstream: SocketAddr, lose: usize) -> std::io::Result<FlakyRelay> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let left = Arc::new(AtomicUsize::new(lose));
        let to_lose = left.clone();
        tokio::spawn(async move {
            while let Ok((caller, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(upstream).await else {
                    continue;
                };
                tokio::spawn(relay(caller, server, to_lose.clone()));
            }
        });
        Ok(FlakyRelay { addr, left, lose })
    }

    fn ip(&self) -> std::net::IpAddr {
        self.addr.ip()
    }

    fn port(&self) -> u16 {
        self.addr.port()
    }

    /// How many answers it lost.
    fn cut(&self) -> usize {
        self.lose - self.left.load(Ordering::SeqCst)
    }
}

async fn relay(caller: TcpStream, server: TcpStream, left: Arc<AtomicUsize>) {
    let (mut caller_read, mut caller_write) = caller.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let requests = tokio::spawn(async move {
        let _ = tokio::io::copy(&mut caller_read, &mut server_write).await;
    });
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match server_read.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let lose = left
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if lose {
            // The server answered; the caller will never hear it.
            break;
        }
        if caller_write.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    requests.abort();
}
