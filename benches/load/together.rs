//! Statements together (SPEC 26): fresh keys through the layer on Postgres at 8 and 64 clients,
//! with every claim, completion and release alone (as before batching) and together (what
//! queues behind a statement in flight goes in the next), beside `pgbench` running the least a
//! fresh key must commit (`benches/pgbench/minimal.sql`: an INSERT and an UPDATE, each its own
//! transaction) with as many clients, in the same run. Commits per request are read from
//! `pg_stat_database.xact_commit` around each run; a run's pool is closed before the count is read
//! again, so that its backends have reported their commits (they also count the few of connecting).
//! Around each run, and around `pgbench`, the kernel's accounting gives the machine's busy share of
//! its cores and the CPU time per request of this process (the load generator and the server) and
//! of the rest of the machine (PostgreSQL, and `pgbench` when it runs): where the time goes.

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

/// CPU time so far, from the kernel's accounting (Linux `/proc`, in clock ticks of 10 ms): the
/// machine's busy time on all cores, and this process's (the load generator and the server).
#[derive(Clone, Copy)]
struct Cpu {
    machine_busy: u64,
    machine_total: u64,
    process: u64,
}

impl Cpu {
    fn now() -> Cpu {
        let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
        let ticks: Vec<u64> = stat
            .lines()
            .next()
            .unwrap_or_default()
            .split_whitespace()
            .skip(1)
            .filter_map(|t| t.parse().ok())
            .collect();
        // user nice system idle iowait irq softirq steal: idle and iowait are not busy.
        let total: u64 = ticks.iter().take(8).sum();
        let idle = ticks.get(3).copied().unwrap_or(0) + ticks.get(4).copied().unwrap_or(0);
        let own = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
        // Fields after the command's closing parenthesis: utime and stime are the 12th and 13th.
        let process = own
            .rsplit_once(')')
            .map(|(_, rest)| {
                rest.split_whitespace()
                    .skip(11)
                    .take(2)
                    .filter_map(|t| t.parse::<u64>().ok())
                    .sum()
            })
            .unwrap_or(0);
        Cpu {
            machine_busy: total - idle,
            machine_total: total,
            process,
        }
    }

    /// Since `before`, for `n` operations: the machine's busy share of its cores (the cores'
    /// time), µs of this process's CPU per operation, and µs of the rest of the machine's (the
    /// database, and `pgbench` when it runs) per operation.
    fn since(self, before: Cpu, n: usize) -> (f64, f64, f64) {
        const TICK_US: f64 = 10_000.0;
        let busy = (self.machine_busy - before.machine_busy) as f64;
        let total = (self.machine_total - before.machine_total).max(1) as f64;
        let own = (self.process - before.process) as f64;
        let n = n.max(1) as f64;
        (
            busy / total,
            own * TICK_US / n,
            (busy - own).max(0.0) * TICK_US / n,
        )
    }
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
async fn run(
    schema: &str,
    table: &str,
    together: bool,
    clients: usize,
    n: usize,
) -> (f64, f64, (f64, f64, f64)) {
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
    let cpu = Cpu::now();
    let stats = load(addr, clients, n, keys).await;
    let cpu = Cpu::now().since(cpu, n);
    store.pool().close().await;
    let after = commits(&admin).await;
    admin.close().await;
    (stats.rps, (after - before) as f64 / n as f64, cpu)
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
        "| clients | pgbench minimal, pairs/s | mode | layer req/s | vs pgbench | commits per request | machine busy | this process, µs CPU/req | the rest, µs CPU/req |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    const PGBENCH_SECONDS: u32 = 10;
    for clients in [8, 64] {
        let cpu = Cpu::now();
        let pgbench = pgbench_minimal(schema, clients, PGBENCH_SECONDS);
        if let Some(pairs) = pgbench {
            let n = (pairs * f64::from(PGBENCH_SECONDS)) as usize;
            let (busy, _, rest) = Cpu::now().since(cpu, n);
            println!(
                "| {clients} | {pairs:.0} | pgbench itself | - | 1.00x | - | {:.0} % | - | {rest:.0} |",
                busy * 100.0
            );
        }
        for round in 0..ROUNDS {
            for together in [false, true] {
                let table = if together { "together" } else { "alone" };
                let (rps, commits, (busy, own, rest)) =
                    run(schema, table, together, clients, n).await;
                let ratio = pgbench.map_or("-".to_owned(), |p| format!("**{:.2}x**", rps / p));
                println!(
                    "| {clients} | {} | {} (run {}) | {rps:.0} | {ratio} | {commits:.2} | {:.0} % | {own:.0} | {rest:.0} |",
                    pgbench.map_or("pgbench did not run".to_owned(), |p| format!("{p:.0}")),
                    if together { "together" } else { "alone" },
                    round + 1,
                    busy * 100.0,
                );
            }
        }
    }
}

/// CPU ticks so far of this process's threads, summed by the thread's name with its digits left
/// out (`sqlx-sqlite-worker-3` counts as `sqlx-sqlite-worker-`): where this process's time goes.
fn threads() -> std::collections::BTreeMap<String, u64> {
    let mut by_name = std::collections::BTreeMap::new();
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return by_name;
    };
    for task in tasks.flatten() {
        let Ok(stat) = std::fs::read_to_string(task.path().join("stat")) else {
            continue;
        };
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        let name: String = stat[open + 1..close]
            .chars()
            .filter(|c| !c.is_ascii_digit())
            .collect();
        let ticks: u64 = stat[close + 1..]
            .split_whitespace()
            .skip(11)
            .take(2)
            .filter_map(|t| t.parse::<u64>().ok())
            .sum();
        *by_name.entry(name).or_insert(0) += ticks;
    }
    by_name
}

/// The CPU of this process's threads between `before` and now, by name, as µs per request for
/// `n` requests, largest first.
fn threads_since(before: &std::collections::BTreeMap<String, u64>, n: usize) -> String {
    let mut spent: Vec<(String, f64)> = threads()
        .into_iter()
        .map(|(name, ticks)| {
            let was = before.get(&name).copied().unwrap_or(0);
            (
                name,
                (ticks.saturating_sub(was)) as f64 * 10_000.0 / n.max(1) as f64,
            )
        })
        .filter(|(_, us)| *us >= 1.0)
        .collect();
    spent.sort_by(|a, b| b.1.total_cmp(&a.1));
    spent
        .iter()
        .map(|(name, us)| format!("{name} {us:.0}"))
        .collect::<Vec<_>>()
        .join(", ")
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
        "| run | floor req/s | layer alone req/s | vs floor | layer together req/s | vs floor | machine busy: floor / alone / together | this process, µs CPU/req: floor / alone / together |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    let mut by_thread = Vec::new();
    let measured = |addr, prefix: String| {
        let (cpu, before) = (Cpu::now(), threads());
        async move {
            let stats = load(addr, CLIENTS, n, fresh_keys(&prefix)).await;
            let since = Cpu::now().since(cpu, n);
            (stats, since, threads_since(&before, n))
        }
    };
    for round in 0..ROUNDS {
        let (f, fc, ft) = measured(floor, format!("f{round}")).await;
        let (a, ac, at) = measured(alone, format!("a{round}")).await;
        let (t, tc, tt) = measured(together, format!("t{round}")).await;
        by_thread.push((round, ft, at, tt));
        println!(
            "| {} | {:.0} | {:.0} | {:.2}x | {:.0} | **{:.2}x** | {:.0} / {:.0} / {:.0} % | {:.0} / {:.0} / {:.0} |",
            round + 1,
            f.rps,
            a.rps,
            a.rps / f.rps,
            t.rps,
            t.rps / f.rps,
            fc.0 * 100.0,
            ac.0 * 100.0,
            tc.0 * 100.0,
            fc.1,
            ac.1,
            tc.1,
        );
    }
    println!("\nThis process's CPU by thread, µs per request:\n");
    for (round, f, a, t) in by_thread {
        println!("- run {}: floor: {f}; alone: {a}; together: {t}", round + 1);
    }
    store.pool().close().await;
    remove(&path);
}
