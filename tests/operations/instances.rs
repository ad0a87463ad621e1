//! Several instances of the checkout example binary started at the same moment on one fresh
//! database: each sets up its tables without tripping over the others, stays up and serves, and
//! duplicates of one key spread across them still make exactly one charge.
#![cfg(feature = "postgres")]

use crate::common;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use axum::http::{Request, StatusCode};
use bytes::Bytes;
use common::example::{self, database_url};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use sqlx::PgPool;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};
use tokio::net::TcpStream;
use tokio::process::{Child, Command};
use tokio::sync::Barrier;
use tokio::task::JoinSet;

/// Instances started together on each fresh schema.
const INSTANCES: usize = 4;
/// Fresh schemas tried in turn: the set-up race is timing-dependent, and one start can miss it.
const ROUNDS: usize = 5;
/// Clients sending one key at once, spread round-robin over the instances.
const DUPLICATES: usize = 12;
/// How long an instance may take to start listening, or a request to be answered.
const PATIENCE: Duration = Duration::from_secs(30);

/// A fresh, empty schema: to an example whose `search_path` names it, a fresh database.
async fn fresh_schema(admin: &PgPool, round: usize) -> String {
    let schema = format!(
        "idem_t_{}_{}_inst{round}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_secs(),
        std::process::id(),
    );
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
        .execute(admin)
        .await
        .expect("create the schema");
    schema
}

/// A private copy of the example binary, removed when dropped.
///
/// The copy, not the built file itself: a target directory shared with other checkouts of the
/// project can have its `examples/checkout` rebuilt from other sources while the test runs, and
/// every instance of every round must run this checkout's example.
struct ExampleBinary(PathBuf);

impl ExampleBinary {
    fn build() -> Self {
        let built = example::binary();
        let exe = std::env::current_exe().expect("test binary");
        let copy = exe.with_file_name(format!("checkout-instances-{}", std::process::id()));
        std::fs::copy(&built, &copy).expect("copy the example binary");
        ExampleBinary(copy)
    }
}

impl Drop for ExampleBinary {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// The example as a process of its own, on Postgres in `schema`. Killed when dropped, so a failing
/// assertion leaves no instance behind.
fn spawn_example(binary: &ExampleBinary, schema: &str, delay_ms: u64) -> Child {
    let url = format!("{}?options[search_path]={schema}", database_url());
    Command::new(&binary.0)
        .env("DATABASE_URL", url)
        // Records in Postgres, not in a Redis that the environment names (`.ci/run` exports one).
        .env_remove("REDIS_URL")
        .env("BIND", "127.0.0.1:0")
        .env("CHECKOUT_DELAY_MS", delay_ms.to_string())
        .env("NO_COLOR", "1")
        .env("RUST_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("start the example")
}

/// The address `child` listens on, or, if it exits first, why it died (its stderr and exit status).
async fn listening(child: &mut Child) -> Result<SocketAddr, String> {
    let stdout = child.stdout.take().expect("stdout");
    let mut stderr = child.stderr.take().expect("stderr");
    // Drain stderr all along so the child never blocks on a full pipe; keep it for the report.
    let errors = tokio::spawn(async move {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text).await;
        text
    });
    let mut lines = BufReader::new(stdout).lines();
    let mut log = Vec::new();
    let found = tokio::time::timeout(PATIENCE, async {
        while let Ok(Some(line)) = lines.next_line().await {
            if let Some(rest) = line.split("listening on http://").nth(1) {
                let addr: String = rest
                    .chars()
                    .take_while(|c| !c.is_whitespace() && *c != '\u{1b}')
                    .collect();
                return addr.parse::<SocketAddr>().ok();
            }
            log.push(line);
        }
        None
    })
    .await;
    match found {
        Ok(Some(addr)) => {
            // Keep draining its logs so it never blocks on a full pipe.
            tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
            Ok(addr)
        }
        Ok(None) => {
            let status = match tokio::time::timeout(PATIENCE, child.wait()).await {
                Ok(Ok(status)) => status.to_string(),
                other => format!("{other:?}"),
            };
            let errors = match tokio::time::timeout(PATIENCE, errors).await {
                Ok(Ok(text)) => text,
                other => format!("{other:?}"),
            };
            Err(format!(
                "exited ({status}) before listening: {}",
                errors.trim()
            ))
        }
        Err(_) => Err(format!("not listening after {PATIENCE:?}; stdout: {log:?}")),
    }
}

struct Answer {
    status: StatusCode,
    replayed: bool,
    body: serde_json::Value,
}

/// One HTTP/1.1 request on a connection of its own.
async fn http(addr: SocketAddr, method: &str, path: &str, user: &str, key: Option<&str>) -> Answer {
    let exchange = async {
        let stream = TcpStream::connect(addr).await.expect("connect");
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .expect("handshake");
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
        let body = if method == "POST" {
            r#"{"amount":2500}"#
        } else {
            ""
        };
        let request = request.body(Full::new(Bytes::from(body))).expect("request");
        let response = sender.send_request(request).await.expect("response");
        let (parts, body) = response.into_parts();
        let body = body.collect().await.expect("body").to_bytes();
        Answer {
            status: parts.status,
            replayed: parts
                .headers
                .get("idempotent-replayed")
                .is_some_and(|v| v == "true"),
            body: serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null),
        }
    };
    tokio::time::timeout(PATIENCE, exchange)
        .await
        .unwrap_or_else(|_| panic!("{method} {path} on {addr} answered within {PATIENCE:?}"))
}

/// Charges and attempts of `user`, as `addr` sees them.
async fn charges(addr: SocketAddr, user: &str) -> (usize, i64) {
    let answer = http(addr, "GET", "/charges", user, None).await;
    assert_eq!(answer.status, StatusCode::OK, "{:?}", answer.body);
    let charges = answer.body["charges"].as_array().expect("charges").len();
    (charges, answer.body["attempts"].as_i64().expect("attempts"))
}

/// One round: `INSTANCES` processes started at once on a fresh schema. Returns why it failed, if
/// some instance did not come up.
async fn round(binary: &ExampleBinary, admin: &PgPool, round: usize) -> Result<(), String> {
    let schema = fresh_schema(admin, round).await;
    // All spawned back to back, before any is waited on: the set-ups run at the same moment.
    let mut children: Vec<Child> = (0..INSTANCES)
        .map(|_| spawn_example(binary, &schema, 300))
        .collect();
    let outcome = serve_together(&mut children)
        .await
        .map_err(|why| format!("round {round} ({schema}): {why}"));
    for child in &mut children {
        let _ = child.kill().await;
    }
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
        .execute(admin)
        .await
        .expect("drop the schema");
    outcome
}

/// Every instance of `children` comes up, serves, and shares one ledger with the others.
async fn serve_together(children: &mut [Child]) -> Result<(), String> {
    let mut addrs = Vec::new();
    let mut deaths = Vec::new();
    for (i, child) in children.iter_mut().enumerate() {
        match listening(child).await {
            Ok(addr) => addrs.push(addr),
            Err(why) => deaths.push(format!("instance {i} {why}")),
        }
    }
    if !deaths.is_empty() {
        return Err(format!(
            "{} of {INSTANCES} instances died: {deaths:#?}",
            deaths.len()
        ));
    }

    // Every instance serves a checkout of its own, all at once.
    let mut own = JoinSet::new();
    for (i, addr) in addrs.iter().copied().enumerate() {
        own.spawn(async move {
            let user = format!("buyer-{i}");
            let answer = http(addr, "POST", "/checkout", &user, Some("own")).await;
            assert_eq!(
                answer.status,
                StatusCode::CREATED,
                "instance {i}: {:?}",
                answer.body
            );
            assert!(!answer.replayed, "instance {i}");
            assert_eq!(charges(addr, &user).await, (1, 1), "instance {i}");
        });
    }
    while let Some(done) = own.join_next().await {
        done.expect("an instance served its checkout");
    }

    // Duplicates of one key, spread over every instance at once, make one charge.
    let gate = Arc::new(Barrier::new(DUPLICATES));
    let mut clients = JoinSet::new();
    for c in 0..DUPLICATES {
        let (gate, addr) = (gate.clone(), addrs[c % addrs.len()]);
        clients.spawn(async move {
            gate.wait().await;
            http(addr, "POST", "/checkout", "shared", Some("order-1")).await
        });
    }
    let mut fresh = Vec::new();
    while let Some(answer) = clients.join_next().await {
        let answer = answer.expect("client");
        match answer.status {
            StatusCode::CREATED if !answer.replayed => fresh.push(answer.body),
            StatusCode::CREATED | StatusCode::CONFLICT => {}
            other => panic!("a duplicate got {other}: {:?}", answer.body),
        }
    }
    assert_eq!(fresh.len(), 1, "exactly one duplicate ran the checkout");
    for addr in &addrs {
        assert_eq!(
            charges(*addr, "shared").await,
            (1, 1),
            "one charge, seen from {addr}"
        );
    }

    // And every instance is still up.
    for (i, child) in children.iter_mut().enumerate() {
        let status = child.try_wait().expect("child status");
        assert!(status.is_none(), "instance {i} exited: {status:?}");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn instances_started_at_once_on_a_fresh_database_all_serve() {
    // Built before the first round, so no instance waits on the build.
    let binary = ExampleBinary::build();
    let admin = PgPool::connect(&database_url()).await.expect("PostgreSQL");
    let mut failures = Vec::new();
    for r in 0..ROUNDS {
        if let Err(why) = round(&binary, &admin, r).await {
            failures.push(why);
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {ROUNDS} rounds lost an instance:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
