//! The server's CPU time per request: the server runs on a thread of its own (a current-thread
//! runtime, one core's worth, as a server pinned to one core), the load generator on the main
//! runtime, and the server thread's CPU time is read from the kernel's accounting of that thread
//! (`/proc/self/task/<tid>/schedstat`, nanoseconds on the CPU) before and after each run. Every
//! task the server starts (connections, handlers, heartbeats, the Postgres pool's connections) runs
//! on that thread, so its time is the server's whole cost; the load generator's is not in it.
//!
//! Beside it, what PostgreSQL itself sustains for the store's two statements of a fresh key
//! (`benches/pgbench/claim_complete.sql`, run by `pgbench` with as many clients), so the Postgres
//! route's rate reads as a fraction of it.

use std::process::Command;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum_idempotency::MemoryStore;
use axum_idempotency::store::{CachedStore, PostgresStore};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tokio::runtime::Handle;

use super::{MakeRequest, Stats, bare, database_url, fresh_keys, guarded, load, ms, scale};

/// Clients of the load generator, and connections of the Postgres pool.
const CLIENTS: usize = 8;

/// Rounds of the bare route and the memory store's rows, alternating; each row is their median.
const MEMORY_ROUNDS: usize = 3;

/// A current-thread runtime on a thread of its own, and that thread's id.
struct ServerThread {
    handle: Handle,
    tid: u32,
}

impl ServerThread {
    fn start() -> ServerThread {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name("server".into())
            .spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("server runtime");
                let tid = std::fs::read_link("/proc/thread-self")
                    .ok()
                    .and_then(|p| p.file_name()?.to_str()?.parse().ok())
                    .expect("this thread's id (Linux /proc)");
                tx.send((runtime.handle().clone(), tid)).expect("send");
                runtime.block_on(std::future::pending::<()>());
            })
            .expect("server thread");
        let (handle, tid) = rx.recv().expect("server thread started");
        ServerThread { handle, tid }
    }

    /// CPU time the server thread has used so far.
    fn cpu(&self) -> Duration {
        let stat = std::fs::read_to_string(format!("/proc/self/task/{}/schedstat", self.tid))
            .expect("schedstat");
        let ns: u64 = stat
            .split_whitespace()
            .next()
            .and_then(|n| n.parse().ok())
            .expect("time on the CPU");
        Duration::from_nanos(ns)
    }

    /// Serves `router` on the server thread.
    async fn serve(&self, router: Router) -> std::net::SocketAddr {
        self.handle
            .spawn(super::serve(router))
            .await
            .expect("serve")
    }

    /// A Postgres store made on the server thread (its connections' I/O is driven there), on a
    /// fresh table, a records pool of `CLIENTS` connections pinging every connection it hands out or
    /// not, and handlers' transactions from another pool.
    async fn postgres(&self, schema: &str, test_before_acquire: bool) -> PostgresStore {
        let options = PgConnectOptions::from_str(&database_url())
            .expect("DATABASE_URL")
            .options([("search_path", schema)]);
        self.handle
            .spawn(async move {
                let pool = PgPoolOptions::new()
                    .max_connections(CLIENTS as u32)
                    .min_connections(CLIENTS as u32)
                    .test_before_acquire(test_before_acquire)
                    .connect_with(options.clone())
                    .await
                    .expect("PostgreSQL must be running");
                // Handlers' transactions from a pool of their own, as the README recommends (none
                // is taken here; the pool opens no connection until one is).
                let transactions = PgPoolOptions::new()
                    .max_connections(1)
                    .connect_lazy_with(options.clone());
                let store = PostgresStore::new(pool).with_transaction_pool(transactions);
                sqlx::raw_sql("DROP TABLE IF EXISTS idempotency_records CASCADE")
                    .execute(store.pool())
                    .await
                    .expect("drop");
                store.migrate().await.expect("migrate");
                store
            })
            .await
            .expect("store")
    }

    /// `n` requests made by `make` against `router`, after a warm-up of `warm` made by `warm_make`:
    /// the load's figures and the server's CPU time per request.
    async fn measure(
        &self,
        router: Router,
        warm: usize,
        warm_make: MakeRequest,
        n: usize,
        make: MakeRequest,
    ) -> (Stats, Duration) {
        let addr = self.serve(router).await;
        load(addr, CLIENTS, warm, warm_make).await;
        let before = self.cpu();
        let stats = load(addr, CLIENTS, n, make).await;
        let used = self.cpu() - before;
        (stats, used / n as u32)
    }
}

/// Replays of `recorded` keys made with `prefix` by [`fresh_keys`].
fn replays(prefix: &str, recorded: usize) -> MakeRequest {
    let fresh = fresh_keys(prefix);
    Arc::new(move |i| fresh(i % recorded))
}

/// pgbench's transactions per second (one claim and one completion each) with `CLIENTS` clients,
/// in `schema`, for `seconds`.
fn pgbench(schema: &str, seconds: u32) -> Option<f64> {
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/benches/pgbench/claim_complete.sql"
    );
    let output = Command::new("pgbench")
        .env("PGOPTIONS", format!("-c search_path={schema}"))
        .args([
            "-n",
            "-M",
            "prepared",
            "-c",
            &CLIENTS.to_string(),
            "-j",
            "2",
        ])
        .args(["-T", &seconds.to_string(), "-f", script, &database_url()])
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&output.stdout);
    text.lines()
        .find(|l| l.starts_with("tps = "))
        .and_then(|l| l["tps = ".len()..].split_whitespace().next()?.parse().ok())
}

pub(super) async fn server_cpu_per_request(schema: &str) {
    let n = scale(20_000);
    let warm = 1_000.min(n);
    let server = ServerThread::start();
    let fresh = |p: &str| fresh_keys(p);
    let mut rows: Vec<(&str, Stats, Duration)> = Vec::new();

    // The bare route and the memory store's two rows, in alternating rounds: the median of each
    // row, so that a slower or faster spell of this shared machine does not fall on one row alone.
    let memory = MemoryStore::new();
    let mut runs: [Vec<(Stats, Duration)>; 3] = Default::default();
    for round in 0..MEMORY_ROUNDS {
        let [bare_runs, fresh_runs, replay_runs] = &mut runs;
        let keys = |p: &str| fresh(&format!("{p}{round}"));
        bare_runs.push(server.measure(bare(), warm, keys("bw"), n, keys("b")).await);
        fresh_runs.push(
            server
                .measure(guarded(memory.clone()), warm, keys("mw"), n, keys("m"))
                .await,
        );
        // The first `warm` keys of the first round's fresh run are recorded: replay them over
        // and over (the warm-up replays each once, so a cache in front of the store has read
        // them all).
        replay_runs.push(
            server
                .measure(
                    guarded(memory.clone()),
                    warm,
                    replays("m0", warm),
                    n,
                    replays("m0", warm),
                )
                .await,
        );
    }
    let names = [
        "bare route",
        "layer + memory, fresh keys",
        "layer + memory, replays",
    ];
    for (name, mut row) in names.into_iter().zip(runs) {
        row.sort_by_key(|(_, cpu)| *cpu);
        let (s, cpu) = row[row.len() / 2];
        rows.push((name, s, cpu));
    }

    // `LOAD_CPU=memory` stops here: the bare route and the memory store alone (for a profile).
    if std::env::var("LOAD_CPU").is_ok_and(|v| v == "memory") {
        print_rows(&rows);
        return;
    }
    let pinging = server.postgres(schema, true).await;
    let (s, cpu) = server
        .measure(guarded(pinging.clone()), warm, fresh("pw"), n, fresh("p"))
        .await;
    let postgres_default = s;
    rows.push((
        "layer + Postgres, fresh keys, pool pings on acquire (sqlx default)",
        s,
        cpu,
    ));
    pinging.pool().close().await;
    let store = server.postgres(schema, false).await;
    let (s, cpu) = server
        .measure(guarded(store.clone()), warm, fresh("qw"), n, fresh("q"))
        .await;
    let postgres_unpinged = s;
    rows.push((
        "layer + Postgres, fresh keys, `test_before_acquire(false)`",
        s,
        cpu,
    ));
    // The floor under the two rows above: the handler itself sends the store's two statements of
    // a fresh key (claim, then complete) through the same store and pool, without the layer.
    let (s, cpu) = server
        .measure(
            super::direct_sql(store.clone()),
            warm,
            fresh("dw"),
            n,
            fresh("d"),
        )
        .await;
    rows.push((
        "no layer: the handler sends the same claim and completion through the store",
        s,
        cpu,
    ));
    let cached = CachedStore::new(store.clone());
    let (s, cpu) = server
        .measure(
            guarded(cached),
            warm,
            replays("q", warm),
            n,
            replays("q", warm),
        )
        .await;
    rows.push(("layer + `CachedStore` over Postgres, replays", s, cpu));

    // 10 s at LOAD_SCALE=1, 3 s at least.
    let seconds = (scale(10_000) as u32 / 1_000).clamp(3, 20);
    let pgbench = pgbench(schema, seconds);
    store.pool().close().await;

    print_rows(&rows);
    match pgbench {
        Some(tps) => println!(
            "\npgbench, the same two statements, {CLIENTS} clients, {seconds} s: **{tps:.0} pairs/s**; \
             the layer on Postgres, fresh keys, reaches **{:.2}x** of it with a default pool and \
             **{:.2}x** with `test_before_acquire(false)`.",
            postgres_default.rps / tps,
            postgres_unpinged.rps / tps
        ),
        None => println!("\npgbench did not run (is it installed?)."),
    }
}

/// The table of routes: requests/s, p50, the server's CPU time per request and its ratio to the
/// bare route's (the first row).
fn print_rows(rows: &[(&str, Stats, Duration)]) {
    println!(
        "\n### Server CPU time per request ({CLIENTS} clients, server on one thread, {} requests a route, body {} bytes; the first three rows the median of {MEMORY_ROUNDS} alternating rounds)\n",
        scale(20_000),
        super::request_body().len()
    );
    println!("| route | req/s | p50 | server CPU per request | vs bare |");
    println!("|---|---|---|---|---|");
    let bare_cpu = rows[0].2;
    for (name, stats, cpu) in rows {
        println!(
            "| {name} | {:.0} | {} | {:.1} us | **{:.2}x** |",
            stats.rps,
            ms(stats.p50),
            cpu.as_secs_f64() * 1e6,
            cpu.as_secs_f64() / bare_cpu.as_secs_f64(),
        );
    }
}
