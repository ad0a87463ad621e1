//! Statements together (SPEC 26): fresh keys through the layer on Postgres at 8 and 64 clients,
//! with every claim, completion and release alone (as before batching) and together (what
//! queues behind a statement in flight goes in the next), beside `pgbench` running the least a
//! fresh key must commit (`benches/pgbench/minimal.sql`: an INSERT and an UPDATE, each its own
//! transaction) with as many clients, in the same run. Commits per request are read from
//! `pg_stat_database.xact_commit` around each run; a run's pool is closed before the count is read
//! again, so that its backends have reported their commits (they also count the few of connecting).

use std::process::Command;
use std::time::Duration;

use axum_idempotency::store::PostgresStore;
use sqlx::PgPool;

use super::{bench_pool, database_url, fresh_keys, guarded, load, scale, serve};

/// Rounds of each mode, alternating.
const ROUNDS: usize = 2;

/// `pgbench`'s transactions per second for the minimal statements with `clients` clients.
fn pgbench_minimal(schema: &str, clients: usize, seconds: u32) -> Option<f64> {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/pgbench/minimal.sql");
    let output = Command::new("pgbench")
        .env("PGOPTIONS", format!("-c search_path={schema}"))
        .args(["-n", "-c", &clients.to_string(), "-j", "2"])
        .args(["-T", &seconds.to_string(), "-f", script, &database_url()])
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&output.stdout);
    text.lines()
        .find(|l| l.starts_with("tps = "))
        .and_then(|l| l["tps = ".len()..].split_whitespace().next()?.parse().ok())
}

async fn commits(admin: &PgPool) -> i64 {
    // Closed backends report their counts as they exit: give them a moment.
    tokio::time::sleep(Duration::from_millis(300)).await;
    sqlx::query_scalar(
        "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()",
    )
    .fetch_one(admin)
    .await
    .expect("xact_commit")
}

/// One run of `n` fresh keys through the layer with `clients` clients and a pool of as many
/// connections, on `table`: requests/s and commits per request.
async fn run(schema: &str, table: &str, together: bool, clients: usize, n: usize) -> (f64, f64) {
    let store = |pool| {
        let store = PostgresStore::with_table(pool, table).expect("table name");
        if together {
            store
        } else {
            store.without_batches()
        }
    };
    // Warm-up on a pool of its own, closed before the count.
    let warm = store(bench_pool(schema, clients as u32).await);
    warm.migrate().await.expect("migrate");
    let addr = serve(guarded(warm.clone())).await;
    let mode = if together { "t" } else { "a" };
    load(
        addr,
        clients,
        1_000,
        fresh_keys(&format!("warm-{mode}{clients}-{n}")),
    )
    .await;
    warm.pool().close().await;

    let admin = bench_pool(schema, 1).await;
    let store = store(bench_pool(schema, clients as u32).await);
    let addr = serve(guarded(store.clone())).await;
    let before = commits(&admin).await;
    let keys = fresh_keys(&format!("{mode}{clients}-{n}-{before}"));
    let stats = load(addr, clients, n, keys).await;
    store.pool().close().await;
    let after = commits(&admin).await;
    admin.close().await;
    (stats.rps, (after - before) as f64 / n as f64)
}

pub(super) async fn statements_together(schema: &str) {
    let n = scale(20_000);
    let admin = bench_pool(schema, 1).await;
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS pgb_records (k text PRIMARY KEY, status text NOT NULL, \
         fingerprint text, lease text, status_code int, body text, \
         updated_at timestamptz DEFAULT now())",
    )
    .execute(&admin)
    .await
    .expect("pgbench's table");
    admin.close().await;
    println!(
        "\n### Fresh keys on Postgres: statements alone and together, beside pgbench (`-- together`; {n} requests a run, {ROUNDS} alternating runs of each mode, a pool of as many connections as clients)\n"
    );
    println!(
        "| clients | pgbench minimal, pairs/s | mode | layer req/s | vs pgbench | commits per request |"
    );
    println!("|---|---|---|---|---|---|");
    for clients in [8, 64] {
        let pgbench = pgbench_minimal(schema, clients, 10);
        for round in 0..ROUNDS {
            for together in [false, true] {
                let table = if together { "together" } else { "alone" };
                let (rps, commits) = run(schema, table, together, clients, n).await;
                let ratio = pgbench.map_or("-".to_owned(), |p| format!("**{:.2}x**", rps / p));
                println!(
                    "| {clients} | {} | {} (run {}) | {rps:.0} | {ratio} | {commits:.2} |",
                    pgbench.map_or("pgbench did not run".to_owned(), |p| format!("{p:.0}")),
                    if together { "together" } else { "alone" },
                    round + 1,
                );
            }
        }
    }
}

/// SQLite (feature `sqlite`): fresh keys at 8 clients through the layer with writes alone and
/// together, beside the floor: the handler of a bare route sends the store's claim and completion
/// itself, each write a transaction of its own (`without_batches`), on the same file, in the same
/// run (WAL, `synchronous=FULL`: each commit flushed to disk).
#[cfg(feature = "sqlite")]
pub(super) async fn sqlite_together() {
    use axum_idempotency::store::SqliteStore;
    const CLIENTS: usize = 8;
    let n = scale(6_000);
    let path = std::env::temp_dir().join(format!(
        "axum-idempotency-together-{}.db",
        std::process::id()
    ));
    let remove = |path: &std::path::Path| {
        for suffix in ["", "-wal", "-shm"] {
            let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
        }
    };
    remove(&path);
    let store = SqliteStore::open(&path).await.expect("open");
    store.migrate().await.expect("migrate");
    let floor = serve(super::direct_sql(store.clone().without_batches())).await;
    let alone = serve(guarded(store.clone().without_batches())).await;
    let together = serve(guarded(store.clone())).await;
    for (addr, name) in [(floor, "floor"), (alone, "alone"), (together, "together")] {
        load(addr, CLIENTS, 300, fresh_keys(&format!("warm-{name}"))).await;
    }
    println!(
        "\n### SQLite fresh keys, writes alone and together, beside the floor (`-- together` with the `sqlite` feature; {CLIENTS} clients, {n} requests a run, 2 alternating runs)\n"
    );
    println!(
        "| run | floor req/s | layer alone req/s | vs floor | layer together req/s | vs floor |"
    );
    println!("|---|---|---|---|---|---|");
    for round in 0..ROUNDS {
        let f = load(floor, CLIENTS, n, fresh_keys(&format!("f{round}"))).await;
        let a = load(alone, CLIENTS, n, fresh_keys(&format!("a{round}"))).await;
        let t = load(together, CLIENTS, n, fresh_keys(&format!("t{round}"))).await;
        println!(
            "| {} | {:.0} | {:.0} | {:.2}x | {:.0} | **{:.2}x** |",
            round + 1,
            f.rps,
            a.rps,
            a.rps / f.rps,
            t.rps,
            t.rps / f.rps
        );
    }
    store.pool().close().await;
    remove(&path);
}
