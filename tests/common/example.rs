//! The checkout example as processes of their own, for tests that kill and restart them, and a
//! minimal HTTP client that opens a connection per request.

use std::net::SocketAddr;
use std::process::Stdio;
use std::time::Duration;

use axum::http::Request;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::net::TcpStream;
use tokio::process::{Child, Command};

use super::Answer;

pub fn database_url() -> String {
    super::servers::database_url()
}

/// Builds the example binary once (with this test binary's features, so the library is not built a
/// second time) and returns its path.
pub fn binary() -> std::path::PathBuf {
    static BUILT: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
            // The features this test binary was built with (the example needs postgres): the
            // library is then built once for both.
            let mut features = vec!["postgres"];
            for (on, name) in [
                (cfg!(feature = "sqlite"), "sqlite"),
                (cfg!(feature = "mysql"), "mysql"),
                (cfg!(feature = "redis"), "redis"),
                (cfg!(feature = "encryption"), "encryption"),
                (cfg!(feature = "metrics"), "metrics"),
                (cfg!(feature = "openapi"), "openapi"),
                (cfg!(feature = "test-suite"), "test-suite"),
            ] {
                if on {
                    features.push(name);
                }
            }
            let status = std::process::Command::new(cargo)
                .args(["build", "--quiet", "--example", "checkout", "--features"])
                .arg(features.join(","))
                .current_dir(env!("CARGO_MANIFEST_DIR"))
                .status()
                .expect("run cargo build");
            assert!(status.success(), "building the example failed");
            let exe = std::env::current_exe().expect("test binary");
            // target/<profile>/deps/<test>-<hash> -> target/<profile>/examples/checkout
            let dir = exe.parent().and_then(|d| d.parent()).expect("target dir");
            dir.join("examples").join("checkout")
        })
        .clone()
}

/// Starts the example on Postgres in `schema` with `env`, and returns it with its address. Its
/// records are in Redis only when `env` sets `REDIS_URL` (one inherited from the environment, as
/// `.ci/run` exports it for the Redis tests, is not passed on).
pub async fn start(schema: &str, env: &[(&str, String)]) -> (Child, SocketAddr) {
    start_on(&database_url(), schema, env).await
}

/// [`start`] on the PostgreSQL at `database`.
pub async fn start_on(database: &str, schema: &str, env: &[(&str, String)]) -> (Child, SocketAddr) {
    start_url(format!("{database}?options[search_path]={schema}"), env).await
}

/// Starts the example with `DATABASE_URL` set to `url` (`postgres://...`, `sqlite://PATH`,
/// `mysql://...`) and `env`, and returns it with its address.
pub async fn start_with_url(url: &str, env: &[(&str, String)]) -> (Child, SocketAddr) {
    start_url(url.to_owned(), env).await
}

/// The example on the database at `url` (any `DATABASE_URL` it takes) with `env`.
pub async fn start_url(url: String, env: &[(&str, String)]) -> (Child, SocketAddr) {
    start_process(Some(url), env).await
}

/// The example on the memory store (no `DATABASE_URL`, no `REDIS_URL`) with `env`.
pub async fn start_memory(env: &[(&str, String)]) -> (Child, SocketAddr) {
    start_process(None, env).await
}

/// The example with `DATABASE_URL` set to `url` (unset: the memory store) and `env`.
async fn start_process(url: Option<String>, env: &[(&str, String)]) -> (Child, SocketAddr) {
    let mut command = Command::new(binary());
    match url {
        Some(url) => command.env("DATABASE_URL", url),
        None => command.env_remove("DATABASE_URL"),
    };
    command
        .env_remove("REDIS_URL")
        .env("BIND", "127.0.0.1:0")
        .env("NO_COLOR", "1")
        .env("RUST_LOG", "warn,checkout=info,axum_idempotency=warn")
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true);
    let mut child = command.spawn().expect("start the example");
    let stdout = child.stdout.take().expect("stdout");
    let mut lines = BufReader::new(stdout).lines();
    let addr = tokio::time::timeout(Duration::from_secs(60), async {
        while let Ok(Some(line)) = lines.next_line().await {
            if let Some(rest) = line.split("listening on http://").nth(1) {
                let addr: String = rest
                    .chars()
                    .take_while(|c| !c.is_whitespace() && *c != '\u{1b}')
                    .collect();
                return addr.parse::<SocketAddr>().ok();
            }
        }
        None
    })
    .await
    .ok()
    .flatten();
    let Some(addr) = addr else {
        let _ = child.kill().await;
        panic!("the example did not start listening within 60 s");
    };
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    (child, addr)
}

/// One HTTP/1.1 request on a connection of its own, within `timeout`.
pub async fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    user: &str,
    key: Option<&str>,
    body: &str,
    timeout: Duration,
) -> Result<Answer, String> {
    let exchange = async {
        let stream = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| e.to_string())?;
        tokio::spawn(conn);
        let mut request = Request::builder()
            .method(method)
            .uri(path)
            .header("host", addr.to_string())
            .header("authorization", format!("Bearer {user}"))
            .header("content-type", "application/json");
        if let Some(key) = key {
            request = request.header("idempotency-key", key);
        }
        let request = request
            .body(Full::new(Bytes::from(body.to_owned())))
            .map_err(|e| e.to_string())?;
        let response = sender
            .send_request(request)
            .await
            .map_err(|e| e.to_string())?;
        let (parts, body) = response.into_parts();
        let body = body.collect().await.map_err(|e| e.to_string())?.to_bytes();
        Ok(Answer {
            status: parts.status,
            headers: parts.headers,
            body,
        })
    };
    tokio::time::timeout(timeout, exchange)
        .await
        .map_err(|_| "timed out".to_owned())?
}
