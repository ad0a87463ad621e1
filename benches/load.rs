//! The HTTP load harness of BENCHMARKS.md: every figure is a ratio against a baseline measured in the
//! same run, on the same machine, over loopback.
//!
//! `cargo bench --bench load --features postgres` (PostgreSQL at `DATABASE_URL`, default
//! `postgres://postgres@127.0.0.1:5432/test`; `LOAD_SCALE=0.2` for a quick run). With the `mysql`
//! feature, the part `mysql` measures the MySQL store too (`MYSQL_URL`, default
//! `mysql://root@127.0.0.1:3306/test`):
//! `cargo bench --bench load --features postgres,mysql -- mysql`. With the `sqlite` feature,
//! `-- sqlite` runs the SQLite store against its floor, on a file in the temporary directory, with
//! no PostgreSQL needed. Every loop is bounded by a request count; the servers listen on 127.0.0.1
//! only and stop with the process.

#[path = "load/cpu.rs"]
mod cpu;
#[cfg(feature = "mysql")]
#[path = "load/mysql.rs"]
mod mysql;
mod support;
#[path = "load/together.rs"]
mod together;
#[path = "load/wait.rs"]
mod wait;

use std::net::SocketAddr;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use support::{auth, created};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode};
use axum::middleware;
use axum::response::Response;
use axum::routing::post;
use axum_idempotency::store::{
    CachedStore, ClaimOutcome, ClaimRequest, Finished, IdempotencyStore, LeaseToken, PostgresStore,
    RecordKey, StoredResponse,
};
use axum_idempotency::{Fingerprint, IdempotencyLayer, MemoryStore};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tokio::net::TcpStream;

// ---------------------------------------------------------------- measurement

#[derive(Clone, Copy)]
struct Stats {
    rps: f64,
    p50: Duration,
    p99: Duration,
}

impl Stats {
    fn of(mut latencies: Vec<Duration>, elapsed: Duration) -> Stats {
        latencies.sort();
        let at = |q: f64| latencies[((latencies.len() as f64 - 1.0) * q).round() as usize];
        Stats {
            rps: latencies.len() as f64 / elapsed.as_secs_f64(),
            p50: at(0.50),
            p99: at(0.99),
        }
    }
}

fn scale(n: usize) -> usize {
    let factor: f64 = std::env::var("LOAD_SCALE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1.0);
    ((n as f64 * factor) as usize).max(50)
}

/// The request body: the 1 KiB JSON order, or, with `LOAD_BODY=small`, a 150-byte one.
fn request_body() -> Bytes {
    support::body_from_env()
}

/// What one request of a load run looks like: path, subject, key.
type MakeRequest = Arc<dyn Fn(usize) -> (String, String, String) + Send + Sync>;

/// `requests` requests from `concurrency` keep-alive connections; request `i` is `make(i)`.
async fn load(addr: SocketAddr, concurrency: usize, requests: usize, make: MakeRequest) -> Stats {
    let body = request_body();
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..concurrency {
        let (next, make, body) = (next.clone(), make.clone(), body.clone());
        workers.spawn(async move {
            let mut client = Client::connect(addr).await;
            let mut latencies = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= requests {
                    return latencies;
                }
                let (path, subject, key) = make(i);
                let t = Instant::now();
                let status = client.post(&path, &subject, &key, body.clone()).await;
                latencies.push(t.elapsed());
                assert!(status.is_success(), "request {i}: {status}");
            }
        });
    }
    let mut all = Vec::with_capacity(requests);
    while let Some(latencies) = workers.join_next().await {
        all.extend(latencies.expect("worker"));
    }
    Stats::of(all, started.elapsed())
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

    async fn post(&mut self, path: &str, subject: &str, key: &str, body: Bytes) -> StatusCode {
        self.sender.ready().await.expect("ready");
        let request = http::Request::post(path)
            .header("host", self.host.clone())
            .header("authorization", subject)
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .body(Full::new(body))
            .expect("request");
        let response = self.sender.send_request(request).await.expect("response");
        let status = response.status();
        response.into_body().collect().await.expect("body");
        status
    }
}

// ---------------------------------------------------------------- servers

async fn serve(router: Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, router).await });
    addr
}

fn bare() -> Router {
    Router::new()
        .route("/checkout", post(created))
        .layer(middleware::from_fn(auth))
}

fn guarded<S: IdempotencyStore>(store: S) -> Router {
    Router::new()
        .route("/checkout", post(created))
        .route_layer(IdempotencyLayer::new(store).expect("valid settings"))
        .layer(middleware::from_fn(auth))
}

/// The baseline for a SQL store: a bare route whose handler issues the store's claim and complete
/// statements itself, through sqlx, with no layer (a key it recorded before is replayed from the
/// claim's answer).
fn direct_sql<S: IdempotencyStore>(store: S) -> Router {
    async fn handler<S: IdempotencyStore>(State(store): State<S>, request: Request) -> Response {
        let (parts, body) = request.into_parts();
        let key = parts.headers["idempotency-key"]
            .to_str()
            .unwrap_or("")
            .to_owned();
        let subject = parts.headers["authorization"]
            .to_str()
            .unwrap_or("")
            .to_owned();
        let body = body.collect().await.expect("body").to_bytes();
        let claim = ClaimRequest::new(
            RecordKey {
                key,
                subject,
                endpoint: "POST /checkout".into(),
            },
            Fingerprint::of(None, &body),
            Duration::from_secs(90),
            Duration::from_secs(86_400),
        );
        let lease = match store.claim(&claim).await.expect("claim") {
            ClaimOutcome::Claimed { lease, .. } => lease,
            ClaimOutcome::Finished(stored) => {
                let mut response = Response::new(axum::body::Body::from(stored.body.clone()));
                *response.status_mut() = StatusCode::from_u16(stored.status).expect("status");
                response
                    .headers_mut()
                    .extend(stored.headers.iter().cloned());
                return response;
            }
            other => panic!("fresh keys and recorded ones only: {other:?}"),
        };
        let response = StoredResponse::new(
            Finished::Completed,
            201,
            vec![
                (
                    http::header::CONTENT_TYPE,
                    HeaderValue::from_static("application/json"),
                ),
                (
                    http::header::LOCATION,
                    HeaderValue::from_static("/charges/1"),
                ),
            ],
            Some(Bytes::from_static(br#"{"id":1,"status":"succeeded"}"#)),
        );
        let retention = claim.retention;
        let completed = store
            .complete(
                &claim.key,
                lease,
                &claim.fingerprint,
                Arc::new(response),
                retention,
            )
            .await
            .expect("complete")
            .is_done();
        assert!(completed, "the bench's own claim completes");
        created(body).await
    }
    Router::new()
        .route("/checkout", post(handler::<S>))
        .layer(middleware::from_fn(auth))
        .with_state(store)
}

fn fresh_keys(prefix: &str) -> MakeRequest {
    let prefix = prefix.to_owned();
    Arc::new(move |i| {
        (
            "/checkout".into(),
            format!("user-{}", i % 1000),
            format!("{prefix}-{i}"),
        )
    })
}

// ---------------------------------------------------------------- SQLite

/// Fresh keys and replays through the layer on a `SqliteStore` (a file in the temporary directory,
/// WAL, `synchronous=FULL`, as `SqliteStore::open` makes it), against the same claim and complete
/// statements issued by a bare handler on the same store (the floor).
/// `cargo bench --bench load --features postgres,sqlite -- sqlite`.
#[cfg(feature = "sqlite")]
async fn sqlite_vs_direct_sql() {
    use axum_idempotency::store::SqliteStore;
    const CONCURRENCY: usize = 16;
    let n = scale(4_000);
    let path =
        std::env::temp_dir().join(format!("axum-idempotency-bench-{}.db", std::process::id()));
    let remove = |path: &std::path::Path| {
        for suffix in ["", "-wal", "-shm"] {
            let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
        }
    };
    remove(&path);
    let store = SqliteStore::open(&path).await.expect("open");
    store.migrate().await.expect("migrate");
    let direct_addr = serve(direct_sql(store.clone())).await;
    let layer_addr = serve(guarded(store.clone())).await;
    load(direct_addr, CONCURRENCY, 500, fresh_keys("warm-d")).await;
    load(layer_addr, CONCURRENCY, 500, fresh_keys("warm-l")).await;

    println!(
        "\n### Layer + SQLite store vs the same claim and complete statements issued by the handler (WAL, synchronous=FULL, {CONCURRENCY} connections, 8 pooled SQLite connections, {}-byte JSON, {n} requests a round, median of 3 rounds)\n",
        request_body().len()
    );
    table("direct SQL", "layer");
    let (b, s) = paired(
        3,
        |r| {
            load(
                direct_addr,
                CONCURRENCY,
                n,
                fresh_keys(&format!("direct{r}")),
            )
        },
        |r| load(layer_addr, CONCURRENCY, n, fresh_keys(&format!("layer{r}"))),
    )
    .await;
    row("fresh keys", b, s);
    // Replays of the keys the first round of each recorded.
    let recorded = n.min(2_000);
    let replays = |prefix: &'static str| -> MakeRequest {
        Arc::new(move |i| {
            let k = i % recorded;
            (
                "/checkout".into(),
                format!("user-{}", k % 1000),
                format!("{prefix}-{k}"),
            )
        })
    };
    let (b, s) = paired(
        3,
        |_| load(direct_addr, CONCURRENCY, n, replays("direct0")),
        |_| load(layer_addr, CONCURRENCY, n, replays("layer0")),
    )
    .await;
    row("replays", b, s);
    store.pool().close().await;
    remove(&path);
}

// ---------------------------------------------------------------- Postgres

fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

/// A pool on a schema of this run's own, dropped at the end.
async fn bench_pool(schema: &str, connections: u32) -> PgPool {
    let options = PgConnectOptions::from_str(&database_url())
        .expect("DATABASE_URL")
        .options([("search_path", schema)]);
    PgPoolOptions::new()
        .max_connections(connections)
        .min_connections(connections)
        .connect_with(options)
        .await
        .expect("PostgreSQL must be running")
}

async fn fresh_pg_store(schema: &str, connections: u32) -> PostgresStore {
    let store = PostgresStore::new(bench_pool(schema, connections).await);
    sqlx::raw_sql("DROP TABLE IF EXISTS idempotency_records")
        .execute(store.pool())
        .await
        .expect("drop");
    store.migrate().await.expect("migrate");
    store
}

// ---------------------------------------------------------------- scenarios

/// The header of a baseline-vs-subject table, as `row` fills it.
fn table(base: &str, subject: &str) {
    println!(
        "| case | {base} req/s | {subject} req/s | req/s ratio | p50 {base} / {subject} | p99 {base} / {subject} | p99 ratio |"
    );
    println!("|---|---|---|---|---|---|---|");
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1e3)
}

fn row(name: &str, base: Stats, subject: Stats) {
    println!(
        "| {name} | {:.0} | {:.0} | **{:.2}x** | {} / {} | {} / {} | **{:.2}x** |",
        base.rps,
        subject.rps,
        subject.rps / base.rps,
        ms(base.p50),
        ms(subject.p50),
        ms(base.p99),
        ms(subject.p99),
        subject.p99.as_secs_f64() / base.p99.as_secs_f64(),
    );
}

/// Runs baseline and subject alternately `rounds` times and keeps each one's median round by rps.
async fn paired<B, S, FB, FS>(rounds: usize, mut base: FB, mut subject: FS) -> (Stats, Stats)
where
    FB: FnMut(usize) -> B,
    FS: FnMut(usize) -> S,
    B: Future<Output = Stats>,
    S: Future<Output = Stats>,
{
    let mut b = Vec::new();
    let mut s = Vec::new();
    for round in 0..rounds {
        b.push(base(round).await);
        s.push(subject(round).await);
    }
    let median = |mut v: Vec<Stats>| {
        v.sort_by(|x, y| x.rps.total_cmp(&y.rps));
        v[v.len() / 2]
    };
    (median(b), median(s))
}

async fn memory_vs_bare() {
    const CONCURRENCY: usize = 32;
    let n = scale(20_000);
    let bare_addr = serve(bare()).await;
    let store = MemoryStore::new();
    let layer_addr = serve(guarded(store.clone())).await;
    // Warm both up.
    load(bare_addr, CONCURRENCY, 2_000, fresh_keys("warm")).await;
    load(layer_addr, CONCURRENCY, 2_000, fresh_keys("warm")).await;

    println!(
        "\n### Layer + memory store vs the bare route (HTTP/1.1 loopback, {CONCURRENCY} connections, {}-byte JSON, {n} requests a round, median of 3 rounds)\n",
        request_body().len()
    );
    table("bare", "layer");
    let (b, s) = paired(
        3,
        |_| load(bare_addr, CONCURRENCY, n, fresh_keys("bare")),
        |r| load(layer_addr, CONCURRENCY, n, fresh_keys(&format!("fresh{r}"))),
    )
    .await;
    row("fresh keys", b, s);
    // Replays: every key was recorded by the first fresh round (keys fresh0-0 .. fresh0-{n-1}, each
    // with subject user-{k % 1000}), so cycle through the first of them.
    let recorded = n.min(5_000);
    let replays: MakeRequest = Arc::new(move |i| {
        let k = i % recorded;
        (
            "/checkout".into(),
            format!("user-{}", k % 1000),
            format!("fresh0-{k}"),
        )
    });
    let (b, s) = paired(
        3,
        |_| load(bare_addr, CONCURRENCY, n, fresh_keys("bare")),
        |_| load(layer_addr, CONCURRENCY, n, replays.clone()),
    )
    .await;
    row("replays", b, s);
}

async fn postgres_vs_direct_sql(schema: &str) {
    const CONCURRENCY: usize = 16;
    let n = scale(6_000);
    let store = fresh_pg_store(schema, CONCURRENCY as u32).await;
    let direct_addr = serve(direct_sql(store.clone())).await;
    let layer_addr = serve(guarded(store.clone())).await;
    load(direct_addr, CONCURRENCY, 500, fresh_keys("warm-d")).await;
    load(layer_addr, CONCURRENCY, 500, fresh_keys("warm-l")).await;

    println!(
        "\n### Layer + Postgres store vs the same claim and complete statements issued by the handler through sqlx (fresh keys, {CONCURRENCY} connections and {CONCURRENCY} pooled database connections, {n} requests a round, median of 3 rounds)\n"
    );
    table("direct SQL", "layer");
    let (b, s) = paired(
        3,
        |r| {
            load(
                direct_addr,
                CONCURRENCY,
                n,
                fresh_keys(&format!("direct{r}")),
            )
        },
        |r| load(layer_addr, CONCURRENCY, n, fresh_keys(&format!("layer{r}"))),
    )
    .await;
    row("fresh keys", b, s);
    store.pool().close().await;
}

/// The duplicate of a request in progress at another instance: the layer's 409 (the store's answer)
/// against one `SELECT 1` round trip, and against a design whose claim shares the handler's transaction, so a duplicate waits on its lock.
async fn duplicate_in_progress(schema: &str) {
    let samples = scale(400);
    let store = fresh_pg_store(schema, 8).await;
    let pool = store.pool().clone();

    // Baseline: one round trip.
    let mut round_trips = Vec::new();
    for _ in 0..samples {
        let t = Instant::now();
        sqlx::query("SELECT 1")
            .execute(&pool)
            .await
            .expect("select 1");
        round_trips.push(t.elapsed());
    }
    let select1 = Stats::of(round_trips, Duration::from_secs(1));

    // The layer: a 2 s handler holds the key; duplicates are answered while it runs.
    async fn slow(_body: Bytes) -> Response {
        tokio::time::sleep(Duration::from_secs(2)).await;
        created(Bytes::new()).await
    }
    let router = || {
        Router::new()
            .route("/checkout", post(slow))
            .route_layer(IdempotencyLayer::new(store.clone()).expect("valid settings"))
            .layer(middleware::from_fn(auth))
    };
    let addr = serve(router()).await;
    // The duplicates go to another instance (another layer over the same store): the instance that
    // holds a key answers its duplicates itself, without the store.
    let other = serve(router()).await;
    let mut conflicts = Vec::new();
    let mut key = 0;
    while conflicts.len() < samples {
        key += 1;
        let k = format!("dup-{key}");
        let first = tokio::spawn({
            let k = k.clone();
            async move {
                Client::connect(addr)
                    .await
                    .post("/checkout", "alice", &k, Bytes::new())
                    .await
            }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        let mut client = Client::connect(other).await;
        // Duplicates for the next 1.5 s, while the first is still in its handler.
        let until = Instant::now() + Duration::from_millis(1500);
        while Instant::now() < until && conflicts.len() < samples {
            let t = Instant::now();
            let status = client.post("/checkout", "alice", &k, Bytes::new()).await;
            conflicts.push(t.elapsed());
            assert_eq!(status, StatusCode::CONFLICT);
        }
        assert_eq!(first.await.expect("first"), StatusCode::CREATED);
    }
    let layer = Stats::of(conflicts, Duration::from_secs(1));

    // Where the 409's time goes: the claim statement alone (no HTTP), for a record in progress, and
    // one HTTP exchange with a no-op route (no database), on the same client.
    let busy = ClaimRequest::new(
        RecordKey {
            key: "busy".into(),
            subject: "alice".into(),
            endpoint: "POST /checkout".into(),
        },
        Fingerprint::of(None, b""),
        Duration::from_secs(90),
        Duration::from_secs(86_400),
    );
    store.claim(&busy).await.expect("claim");
    let mut claims = Vec::new();
    for _ in 0..samples {
        // Another request's claim (its own lease): the same lease's claim sent again is granted.
        let duplicate = ClaimRequest {
            lease: LeaseToken::generate(),
            ..busy.clone()
        };
        let t = Instant::now();
        let outcome = store.claim(&duplicate).await.expect("claim");
        claims.push(t.elapsed());
        assert_eq!(outcome, ClaimOutcome::InProgress);
    }
    let claim_only = Stats::of(claims, Duration::from_secs(1));
    let bare_addr = serve(bare()).await;
    let mut client = Client::connect(bare_addr).await;
    let mut exchanges = Vec::new();
    for i in 0..samples {
        let t = Instant::now();
        let status = client
            .post("/checkout", "alice", &format!("h{i}"), Bytes::new())
            .await;
        exchanges.push(t.elapsed());
        assert_eq!(status, StatusCode::CREATED);
    }
    let http_only = Stats::of(exchanges, Duration::from_secs(1));

    // Lock-waiting design: the claim is an insert inside the handler's transaction; a duplicate's
    // insert blocks on the unique index until the first commits (2 s later), then finds the row.
    sqlx::raw_sql(
        "DROP TABLE IF EXISTS lock_waiting_claims; \
         CREATE TABLE lock_waiting_claims (key text PRIMARY KEY)",
    )
    .execute(&pool)
    .await
    .expect("table");
    let waits = scale(8).min(8);
    let mut waited = Vec::new();
    for i in 0..waits {
        let k = format!("lock-{i}");
        let first = tokio::spawn({
            let (pool, k) = (pool.clone(), k.clone());
            async move {
                let mut tx = pool.begin().await.expect("begin");
                sqlx::query("INSERT INTO lock_waiting_claims VALUES ($1)")
                    .bind(&k)
                    .execute(&mut *tx)
                    .await
                    .expect("claim");
                tokio::time::sleep(Duration::from_secs(2)).await; // the handler
                tx.commit().await.expect("commit");
            }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        let t = Instant::now();
        let inserted =
            sqlx::query("INSERT INTO lock_waiting_claims VALUES ($1) ON CONFLICT DO NOTHING")
                .bind(&k)
                .execute(&pool)
                .await
                .expect("duplicate");
        waited.push(t.elapsed());
        assert_eq!(inserted.rows_affected(), 0);
        first.await.expect("first");
    }
    let locking = Stats::of(waited, Duration::from_secs(1));

    println!(
        "\n### A duplicate while the first request is in progress (Postgres store, 2 s handler, {samples} duplicates)\n"
    );
    println!("| what | p50 | p99 | p50 ratio to `SELECT 1` | p99 ratio to `SELECT 1` |");
    println!("|---|---|---|---|---|");
    let line = |name: &str, s: Stats| {
        println!(
            "| {name} | {} | {} | {:.2}x | {:.2}x |",
            ms(s.p50),
            ms(s.p99),
            s.p50.as_secs_f64() / select1.p50.as_secs_f64(),
            s.p99.as_secs_f64() / select1.p99.as_secs_f64()
        )
    };
    line("one Postgres round trip (`SELECT 1`, sqlx pool)", select1);
    line("**layer: `409 in_progress` over HTTP**", layer);
    line("  of which: the claim statement alone, no HTTP", claim_only);
    line(
        "  of which: one HTTP exchange with a no-op route, no database",
        http_only,
    );
    line(
        &format!("lock-waiting design: duplicate waits for the first ({waits} samples)"),
        locking,
    );
}

/// Requests per second with 50 000 live records against an empty store, for one store.
async fn growth<S: IdempotencyStore>(label: &str, store: S, fill: impl AsyncFnOnce(&S)) {
    const CONCURRENCY: usize = 16;
    let n = scale(4_000);
    let addr = serve(guarded(store.clone())).await;
    load(addr, CONCURRENCY, 500, fresh_keys(&format!("{label}-warm"))).await;
    let empty = load(addr, CONCURRENCY, n, fresh_keys(&format!("{label}-empty"))).await;
    fill(&store).await;
    let many_subjects = load(addr, CONCURRENCY, n, fresh_keys(&format!("{label}-full"))).await;
    let one_subject: MakeRequest = {
        let label = label.to_owned();
        Arc::new(move |i| {
            (
                "/checkout".into(),
                "heavy".into(),
                format!("{label}-heavy-new-{i}"),
            )
        })
    };
    let heavy = load(addr, CONCURRENCY, n, one_subject).await;
    row(
        &format!("{label}: 50 000 records, many subjects"),
        empty,
        many_subjects,
    );
    row(
        &format!("{label}: 50 000 records, 25 000 for the requesting subject"),
        empty,
        heavy,
    );
}

fn filler_claim(i: usize) -> ClaimRequest {
    // 25 000 records over 5 000 subjects, and 25 000 for one subject ("heavy").
    let subject = if i < 25_000 {
        format!("user-x{}", i % 5_000)
    } else {
        "heavy".to_owned()
    };
    ClaimRequest::new(
        RecordKey {
            key: format!("fill-{i}"),
            subject,
            endpoint: "POST /checkout".into(),
        },
        Fingerprint::of(None, b"{}"),
        Duration::from_secs(90),
        Duration::from_secs(86_400),
    )
}

#[tokio::main]
async fn main() {
    println!("## Load harness run\n");
    println!(
        "machine: {} cores, loopback HTTP/1.1 (hyper client and axum server in one process), LOAD_SCALE={}",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        std::env::var("LOAD_SCALE").unwrap_or_else(|_| "1".into())
    );
    // `cargo bench --bench load --features postgres -- memory growth`: only the named parts (memory, sqlite with the
    // `sqlite` feature, postgres, duplicate, growth); all of them by default.
    let parts = [
        "cpu",
        "memory",
        "mysql",
        "sqlite",
        "postgres",
        "replays",
        "burst",
        "duplicate",
        "growth",
        "wait",
        "together",
    ];
    let chosen: Vec<String> = std::env::args()
        .filter(|a| parts.contains(&a.as_str()))
        .collect();
    let run = |part: &str| chosen.is_empty() || chosen.iter().any(|c| c == part);
    if run("memory") {
        memory_vs_bare().await;
    }
    // Feature `mysql`: MySQL or MariaDB at `MYSQL_URL`.
    #[cfg(feature = "mysql")]
    if run("mysql") {
        mysql::mysql_vs_direct_sql().await;
    }
    #[cfg(feature = "sqlite")]
    if run("together") {
        together::sqlite_together().await;
    }
    #[cfg(feature = "mysql")]
    if run("together") {
        mysql::mysql_together().await;
    }
    #[cfg(feature = "sqlite")]
    if run("sqlite") {
        sqlite_vs_direct_sql().await;
    }
    if ![
        "cpu",
        "postgres",
        "replays",
        "burst",
        "duplicate",
        "growth",
        "wait",
        "together",
    ]
    .iter()
    .any(|p| run(p))
    {
        return;
    }
    let admin = PgPool::connect(&database_url())
        .await
        .expect("PostgreSQL must be running");
    let schema = format!("idem_bench_{}", std::process::id());
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DROP SCHEMA IF EXISTS {schema} CASCADE; CREATE SCHEMA {schema}"
    )))
    .execute(&admin)
    .await
    .expect("schema");
    if run("cpu") {
        cpu::server_cpu_per_request(&schema).await;
    }
    if run("postgres") {
        postgres_vs_direct_sql(&schema).await;
    }
    if run("replays") {
        replays_by_store(&schema).await;
    }
    if run("burst") {
        burst_of_duplicates(&schema).await;
    }
    if run("duplicate") {
        duplicate_in_progress(&schema).await;
    }
    if run("growth") {
        growth_all(&schema).await;
    }
    if run("wait") {
        wait::waiting_duplicates(&schema).await;
    }
    if run("together") {
        together::statements_together(&schema).await;
    }
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DROP SCHEMA IF EXISTS {schema} CASCADE"
    )))
    .execute(&admin)
    .await
    .expect("drop schema");
}

/// Replays through the Postgres store, with and without the cache of finished records, against
/// replays through the memory store. Every key is recorded first, then replayed over and over.
async fn replays_by_store(schema: &str) {
    const CONCURRENCY: usize = 16;
    let n = scale(10_000);
    let recorded = 2_000.min(n);
    let replays: MakeRequest = Arc::new(move |i| {
        let k = i % recorded;
        (
            "/checkout".into(),
            format!("user-{}", k % 1000),
            format!("rec-{k}"),
        )
    });
    let memory_addr = serve(guarded(MemoryStore::new())).await;
    let store = fresh_pg_store(schema, CONCURRENCY as u32).await;
    let pg_addr = serve(guarded(store.clone())).await;
    let cached_addr = serve(guarded(CachedStore::new(store.clone()))).await;
    // Record every key once in each store (the Postgres table is shared by both Postgres servers).
    load(memory_addr, CONCURRENCY, recorded, fresh_keys("rec")).await;
    load(pg_addr, CONCURRENCY, recorded, fresh_keys("rec")).await;
    // Warm-up: the cache fills on a record's first replay.
    load(cached_addr, CONCURRENCY, recorded, replays.clone()).await;
    load(pg_addr, CONCURRENCY, recorded, replays.clone()).await;

    println!(
        "\n### Replays: Postgres store, with and without `CachedStore`, vs the memory store ({CONCURRENCY} connections, {recorded} recorded keys, {n} replays a round, median of 3 rounds)\n"
    );
    table("memory", "subject");
    let (b, s) = paired(
        3,
        |_| load(memory_addr, CONCURRENCY, n, replays.clone()),
        |_| load(pg_addr, CONCURRENCY, n, replays.clone()),
    )
    .await;
    row("Postgres, no cache", b, s);
    let (b, s) = paired(
        3,
        |_| load(memory_addr, CONCURRENCY, n, replays.clone()),
        |_| load(cached_addr, CONCURRENCY, n, replays.clone()),
    )
    .await;
    row("Postgres + CachedStore", b, s);
    store.pool().close().await;
}

/// Twenty requests with one key released at once on their own connections, the first one's
/// handler taking 300 ms: the other nineteen get `409`. The Postgres pool is warm (every connection
/// open and its statements prepared). At one instance (one layer: duplicates wait for the claim in
/// flight, or meet the layer's hold on the key, instead of each sending their own), also through
/// `CachedStore`; at twenty instances (twenty layers over one store, each racer on its own: every
/// duplicate asks the store), with the claim function and without it (dropped: the claim's two
/// statements sent one by one, as before the function existed); and on the memory store for what
/// HTTP and the two cores cost alone.
async fn burst_of_duplicates(schema: &str) {
    const RACERS: usize = 20;
    let rounds = scale(40).max(5);
    async fn slow(_body: Bytes) -> Response {
        tokio::time::sleep(Duration::from_millis(300)).await;
        created(Bytes::new()).await
    }
    fn router<S: IdempotencyStore>(store: S) -> Router {
        Router::new()
            .route("/checkout", post(slow))
            .route_layer(IdempotencyLayer::new(store).expect("valid settings"))
            .layer(middleware::from_fn(auth))
    }
    /// Racer `i` sends to `addrs[i % addrs.len()]`.
    async fn bursts(addrs: &[SocketAddr], label: &str, rounds: usize) -> Stats {
        let mut clients = Vec::new();
        for i in 0..RACERS {
            clients.push(Client::connect(addrs[i % addrs.len()]).await);
        }
        let mut conflicts = Vec::new();
        // Round 0 warms up every connection and is not counted.
        for round in 0..=rounds {
            let key = format!("burst-{label}-{round}");
            let barrier = Arc::new(tokio::sync::Barrier::new(RACERS));
            let mut tasks = tokio::task::JoinSet::new();
            for mut client in clients.drain(..) {
                let (barrier, key) = (barrier.clone(), key.clone());
                tasks.spawn(async move {
                    barrier.wait().await;
                    let t = Instant::now();
                    let status = client.post("/checkout", "alice", &key, Bytes::new()).await;
                    (client, status, t.elapsed())
                });
            }
            let mut created = 0;
            while let Some(done) = tasks.join_next().await {
                let (client, status, took) = done.expect("racer");
                clients.push(client);
                match status {
                    StatusCode::CREATED => created += 1,
                    StatusCode::CONFLICT if round > 0 => conflicts.push(took),
                    StatusCode::CONFLICT => {}
                    other => panic!("unexpected {other}"),
                }
            }
            assert_eq!(created, 1, "one racer runs the handler");
        }
        Stats::of(conflicts, Duration::from_secs(1))
    }

    async fn instances<S: IdempotencyStore>(store: &S, count: usize) -> Vec<SocketAddr> {
        let mut addrs = Vec::new();
        for _ in 0..count {
            addrs.push(serve(router(store.clone())).await);
        }
        addrs
    }
    let memory = bursts(&instances(&MemoryStore::new(), 1).await, "memory", rounds).await;
    // One pool for the Postgres runs (the database allows only so many connections).
    let store = fresh_pg_store(schema, RACERS as u32 + 4).await;
    let one = bursts(&instances(&store, 1).await, "one", rounds).await;
    let cached = bursts(
        &instances(&CachedStore::new(store.clone()), 1).await,
        "cached",
        rounds,
    )
    .await;
    let spread = instances(&store, RACERS).await;
    let with_function = bursts(&spread, "function", rounds).await;
    sqlx::raw_sql("DROP FUNCTION idempotency_records_claim_v2")
        .execute(store.pool())
        .await
        .expect("drop the claim function");
    let two_statements = bursts(&spread, "direct", rounds).await;
    store.pool().close().await;

    println!(
        "\n### {RACERS} simultaneous duplicates, warm Postgres pool ({rounds} bursts, {} `409`s each)\n",
        RACERS - 1
    );
    println!("| store | 409 p50 | 409 p99 |");
    println!("|---|---|---|");
    for (name, stats) in [
        ("memory, one instance (HTTP and scheduling alone)", memory),
        (
            "Postgres, one instance (one claim per burst; the rest wait for it)",
            one,
        ),
        ("Postgres + `CachedStore`, one instance", cached),
        (
            "Postgres, twenty instances, claim function (every duplicate asks the store)",
            with_function,
        ),
        (
            "Postgres, twenty instances, two statements (the earlier claim)",
            two_statements,
        ),
    ] {
        println!("| {name} | {} | {} |", ms(stats.p50), ms(stats.p99));
    }
}

async fn growth_all(schema: &str) {
    println!(
        "\n### Growth: fresh-key requests/s with 50 000 live records vs an empty store (16 connections)\n"
    );
    table("empty", "full");
    growth("memory", MemoryStore::new(), async |store: &MemoryStore| {
        for i in 0..50_000 {
            store.claim(&filler_claim(i)).await.expect("fill");
        }
    })
    .await;
    let store = fresh_pg_store(schema, 16).await;
    growth("postgres", store.clone(), async |store: &PostgresStore| {
        // Each fill row is claimed through the store, in parallel.
        let mut tasks = tokio::task::JoinSet::new();
        for chunk in 0..16 {
            let store = store.clone();
            tasks.spawn(async move {
                for i in (chunk..50_000).step_by(16) {
                    store.claim(&filler_claim(i)).await.expect("fill");
                }
            });
        }
        while tasks.join_next().await.is_some() {}
        sqlx::raw_sql("ANALYZE idempotency_records")
            .execute(store.pool())
            .await
            .expect("analyze");
    })
    .await;
    // With the cache: 50 000 finished records, each read once so that the cache holds them all.
    let store = CachedStore::new(fresh_pg_store(schema, 16).await);
    growth(
        "postgres + cache",
        store,
        async |store: &CachedStore<PostgresStore>| {
            let mut tasks = tokio::task::JoinSet::new();
            for chunk in 0..16 {
                let store = store.clone();
                tasks.spawn(async move {
                    for i in (chunk..50_000).step_by(16) {
                        let claim = filler_claim(i);
                        let ClaimOutcome::Claimed { lease, .. } =
                            store.claim(&claim).await.expect("fill")
                        else {
                            panic!("fresh fill key");
                        };
                        let response = Arc::new(StoredResponse::new(
                            Finished::Completed,
                            201,
                            Vec::new(),
                            Some(Bytes::from_static(br#"{"id":1,"status":"succeeded"}"#)),
                        ));
                        let completed = store
                            .complete(
                                &claim.key,
                                lease,
                                &claim.fingerprint,
                                response,
                                claim.retention,
                            )
                            .await
                            .expect("complete")
                            .is_done();
                        assert!(completed, "the bench's own claim completes");
                        store.claim(&claim).await.expect("read");
                    }
                });
            }
            while tasks.join_next().await.is_some() {}
            assert_eq!(store.len(), 50_000, "every record is cached");
            sqlx::raw_sql("ANALYZE idempotency_records")
                .execute(store.inner().pool())
                .await
                .expect("analyze");
        },
    )
    .await;
}
