//! What the end-to-end tests share: the client under test, a relay that loses answers or has no
//! server behind it, the checkout example as a process, and a fresh PostgreSQL schema.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use axum_idempotency_client::{IdempotencyMiddleware, RetryPolicy};
use reqwest_middleware::{ClientBuilder, ClientWithMiddleware};
use sqlx::postgres::PgPool;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::process::{Child, Command};

#[path = "../../../tests/common/servers.rs"]
mod servers;

/// The client under test, with `policy`. Each attempt may take 20 s: a bound for a broken test,
/// not a timing any test relies on.
pub fn client(policy: RetryPolicy) -> ClientWithMiddleware {
    let inner = reqwest::Client::builder()
        .timeout(Duration::from_secs(20))
        .build()
        .expect("reqwest client");
    ClientBuilder::new(inner)
        .with(IdempotencyMiddleware::new(policy))
        .build()
}

/// A policy with short backoff steps, so that the tests wait on the server's `Retry-After` and not
/// on the default backoff.
pub fn quick() -> RetryPolicy {
    RetryPolicy::new().backoff(Duration::from_millis(20), Duration::from_millis(500))
}

// ---- a relay between client and server ----

/// A loopback TCP relay in front of a server: it can lose answers (forward the request, then close
/// the client's connection when the answer starts to come back, so the server did the work and the
/// client never heard), and its server can be taken away and given back (a restart).
pub struct Relay {
    pub addr: SocketAddr,
    faults: Arc<Faults>,
}

#[derive(Default)]
struct Faults {
    /// The server behind the relay, if any.
    upstream: Mutex<Option<SocketAddr>>,
    /// How many answers are still to be lost.
    lose: AtomicUsize,
    /// How many were.
    lost: AtomicUsize,
    /// Whether losing an answer also takes the server away (until `set_upstream`).
    dark_after_loss: AtomicBool,
}

impl Relay {
    pub async fn start(upstream: SocketAddr) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let faults = Arc::new(Faults {
            upstream: Mutex::new(Some(upstream)),
            ..Faults::default()
        });
        let shared = faults.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let target = *shared.upstream.lock().expect("lock");
                // No server: the client's connection is closed at once.
                let Some(target) = target else { continue };
                let Ok(server) = TcpStream::connect(target).await else {
                    continue;
                };
                tokio::spawn(relay(client, server, shared.clone()));
            }
        });
        Relay { addr, faults }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// The next `n` answers are lost on the way back.
    pub fn lose_answers(&self, n: usize) {
        self.faults.lose.store(n, Ordering::SeqCst);
    }

    /// The next answer is lost, and the server taken away with it: until
    /// [`set_upstream`](Self::set_upstream) gives one back, connections are closed as they come.
    pub fn lose_answer_and_go_dark(&self) {
        self.faults.dark_after_loss.store(true, Ordering::SeqCst);
        self.lose_answers(1);
    }

    /// How many answers were lost.
    pub fn lost(&self) -> usize {
        self.faults.lost.load(Ordering::SeqCst)
    }

    /// Waits (at most 30 s) until `n` answers have been lost.
    pub async fn wait_for_lost(&self, n: usize) {
        for _ in 0..1500 {
            if self.lost() >= n {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("the relay lost {} answers, not {n}", self.lost());
    }

    /// The server behind the relay; `None`: connections are closed as they come.
    pub fn set_upstream(&self, upstream: Option<SocketAddr>) {
        *self.faults.upstream.lock().expect("lock") = upstream;
    }
}

async fn relay(client: TcpStream, server: TcpStream, faults: Arc<Faults>) {
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let requests = tokio::spawn(async move {
        let _ = tokio::io::copy(&mut client_read, &mut server_write).await;
    });
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match server_read.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let lose = faults
            .lose
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if lose {
            if faults.dark_after_loss.swap(false, Ordering::SeqCst) {
                *faults.upstream.lock().expect("lock") = None;
            }
            faults.lost.fetch_add(1, Ordering::SeqCst);
            break;
        }
        if client_write.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    requests.abort();
}

// ---- the checkout example as a process ----

/// The workspace's root.
fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the client crate is in the workspace")
        .to_path_buf()
}

/// Builds the server's checkout example and this crate's client example once, and returns the
/// directory of examples. The build asks for what the README's test command (`cargo test
/// --workspace --all-features`) has already built, so under it nothing is compiled again.
fn examples() -> PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
            let status = std::process::Command::new(cargo)
                .args(["build", "--quiet", "--workspace", "--all-features"])
                .args(["--example", "checkout", "--example", "checkout_client"])
                .current_dir(workspace())
                .status()
                .expect("run cargo build");
            assert!(status.success(), "building the examples failed");
            let exe = std::env::current_exe().expect("test binary");
            // target/<profile>/deps/<test>-<hash> -> target/<profile>/examples
            exe.parent()
                .and_then(|d| d.parent())
                .expect("target dir")
                .join("examples")
        })
        .clone()
}

pub fn example_binary(name: &str) -> PathBuf {
    examples().join(name)
}

/// The checkout example, running as a process of its own.
pub struct Checkout {
    pub child: Child,
    pub addr: SocketAddr,
}

impl Checkout {
    /// Starts the example on a free port with `env` (`DATABASE_URL` for Postgres; the memory
    /// store without), and waits until it listens.
    pub async fn start(env: &[(&str, String)]) -> Checkout {
        let mut command = Command::new(example_binary("checkout"));
        command
            .env_remove("DATABASE_URL")
            .env_remove("REDIS_URL")
            .env("BIND", "127.0.0.1:0")
            .env("NO_COLOR", "1")
            .env("RUST_LOG", "warn,checkout=info")
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .kill_on_drop(true);
        let mut child = command.spawn().expect("start the checkout example");
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
            panic!("the checkout example did not start listening within 60 s");
        };
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Checkout { child, addr }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// `GET /charges` for `subject`, straight to the server: its charges and its handler runs.
    pub async fn charges(&self, subject: &str) -> (Vec<serde_json::Value>, i64) {
        let body: serde_json::Value = reqwest::Client::new()
            .get(self.url("/charges"))
            .bearer_auth(subject)
            .send()
            .await
            .expect("GET /charges")
            .text()
            .await
            .map(|text| serde_json::from_str(&text).expect("JSON"))
            .expect("body");
        let charges = body["charges"].as_array().cloned().expect("charges");
        (charges, body["attempts"].as_i64().expect("attempts"))
    }

    /// `GET /checkout/idempotency/{key}` for `subject`: the record's state, if any.
    pub async fn record_state(&self, subject: &str, key: &str) -> Option<String> {
        let response = reqwest::Client::new()
            .get(self.url(&format!("/checkout/idempotency/{key}")))
            .bearer_auth(subject)
            .send()
            .await
            .ok()?;
        if !response.status().is_success() {
            return None;
        }
        let body: serde_json::Value = serde_json::from_str(&response.text().await.ok()?).ok()?;
        body["state"].as_str().map(str::to_owned)
    }

    /// Waits (at most 30 s) until the record of `key` is in `state`.
    pub async fn wait_for_state(&self, subject: &str, key: &str, state: &str) {
        for _ in 0..1500 {
            if self.record_state(subject, key).await.as_deref() == Some(state) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("the record of {key} never reached {state}");
    }
}

/// A fresh schema on the tests' PostgreSQL, and the `DATABASE_URL` of a server using it.
pub async fn fresh_schema(name: &str) -> String {
    let database = servers::database_url();
    let admin = PgPool::connect(&database).await.expect("PostgreSQL");
    let schema = format!(
        "idem_client_{name}_{}_{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_millis()
    );
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
        .execute(&admin)
        .await
        .expect("create the schema");
    admin.close().await;
    format!("{database}?options[search_path]={schema}")
}
