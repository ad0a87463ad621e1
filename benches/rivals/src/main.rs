//! The rivals harness: the server CPU per request of one trivial handler, bare and behind this
//! crate's layer and its rivals', measured side by side in one run.
//!
//! ```sh
//! cd benches/rivals && cargo run --release
//! ```
//!
//! Needs Redis at `REDIS_URL` (default `redis://127.0.0.1:6379`); its keys go under a prefix of
//! the run's own (`rivalsbench<pid>`), removed at the end. The toolchain is pinned by
//! `rust-toolchain.toml` (footing 0.6 needs Rust 1.99.1). `RIVALS_REQUESTS` sets the requests of
//! each measured run (default 6 000); a run takes about a minute. The servers listen on
//! 127.0.0.1 only, every loop is bounded by a request count, and the process ends by itself.
//!
//! **Configurations** (the same route, handler, 150-byte JSON body and authentication step):
//! the bare route; this crate's layer on its `MemoryStore` and on its `RedisStore`; aklanti's
//! `idempotent` 1.0 on its memory store and on its Valkey/Redis store; footing 0.6 on its memory
//! store; and, to explain the Redis rows, this crate's `RedisStore` without its listing index and
//! the subjects' shares. Every layer runs with its default settings, keys scoped by the subject.
//!
//! **Method** (as `benches/load/cpu.rs`): the server runs on a current-thread runtime on a thread
//! of its own; the load generator (8 keep-alive HTTP/1.1 clients over loopback TCP) on the main
//! runtime. The server thread's time on the CPU is read from `/proc/self/task/<tid>/schedstat`
//! before and after each run, and divided by the requests; beside it, the time of the process's
//! other threads, the load generator's left out (this crate's lease keeper runs on a thread of
//! its own). Each configuration has a row of fresh keys (every request a new key) and a row of
//! replays (the first 500 keys of its first round's fresh row, sent again and again); the rows
//! run in five rounds, alternating, each round in another order, and each row's figure is the
//! median of its five. Each run is preceded by a warm-up of 500 requests (fresh keys of their
//! own, or each replayed key once), and the server is left 200 ms to finish what a run started
//! (records written after the answer) on both sides of the readings. Every answer must be `201`;
//! the handler's calls are counted, and a replay row must not reach it.
//!
//! **Redis**: `INFO commandstats` is read around each Redis run, giving the commands per request
//! by name, the round trips (the commands clients send; those the stores' Lua scripts run are
//! counted apart) and Redis's own microseconds.

mod client;
mod redis_stats;
mod routes;
mod server;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use client::{MakeRequest, Stats};
use redis_stats::Commands;
use routes::{Calls, Kind, RedisPlace};
use server::{CpuUsed, ServerThread};

const CLIENTS: usize = 8;
const ROUNDS: usize = 5;
const WARM: usize = 500;
/// Replays cycle over the first this many keys of a configuration's first fresh row.
const REPLAY_KEYS: usize = 500;
/// Subjects the requests are spread over (`user-0` .. `user-999`).
const SUBJECTS: usize = 1000;
/// How long the server is left to finish what a run started, before and after the readings.
const SETTLE: Duration = Duration::from_millis(200);

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Phase {
    Fresh,
    Replay,
}

/// One measured run.
#[derive(Clone)]
struct Run {
    stats: Stats,
    cpu: CpuUsed,
    requests: usize,
    handler_calls: u64,
    commands: Option<Commands>,
}

impl Run {
    fn server_us(&self) -> f64 {
        self.cpu.server.as_secs_f64() * 1e6 / self.requests as f64
    }

    fn others_us(&self) -> f64 {
        self.cpu.others.as_secs_f64() * 1e6 / self.requests as f64
    }
}

struct Row {
    kind: Kind,
    phase: Phase,
    runs: Vec<Run>,
}

impl Row {
    /// The run of median server CPU.
    fn median(&self) -> &Run {
        let mut runs: Vec<&Run> = self.runs.iter().collect();
        runs.sort_by(|a, b| a.server_us().total_cmp(&b.server_us()));
        runs[runs.len() / 2]
    }

    fn range(&self) -> (f64, f64) {
        let us = self.runs.iter().map(Run::server_us);
        let min = us.clone().fold(f64::INFINITY, f64::min);
        let max = us.fold(0.0, f64::max);
        (min, max)
    }

    fn name(&self) -> String {
        match (self.kind, self.phase) {
            (Kind::Bare, _) => self.kind.label().to_owned(),
            (_, Phase::Fresh) => format!("{}, fresh keys", self.kind.label()),
            (_, Phase::Replay) => format!("{}, replays", self.kind.label()),
        }
    }

    /// Whether every run saw what its workload must: the handler run once per fresh key and
    /// never on a replay, every replay marked as one.
    fn faithful(&self) -> bool {
        self.runs.iter().all(|r| match (self.kind, self.phase) {
            (Kind::Bare, _) => r.handler_calls == r.requests as u64,
            (_, Phase::Fresh) => r.handler_calls == r.requests as u64 && r.stats.replayed == 0,
            (_, Phase::Replay) => r.handler_calls == 0 && r.stats.replayed == r.requests,
        })
    }
}

/// Fresh keys: request `i` of the run tagged `tag` has a key no other run has, UUID-shaped.
fn fresh(tag: u32) -> MakeRequest {
    Arc::new(move |i| {
        (
            format!("user-{}", i % SUBJECTS),
            format!("{tag:08x}-0000-4000-8000-{i:012x}"),
        )
    })
}

/// Replays of the first `keys` requests of the run tagged `tag` (same subject, key and body).
fn replays(tag: u32, keys: usize) -> MakeRequest {
    let fresh = fresh(tag);
    Arc::new(move |i| fresh(i % keys))
}

/// The tag of round `round`'s warm-up (`warm`) or measured fresh run.
fn tag(round: usize, warm: bool) -> u32 {
    (round as u32 + 1) * 16 + u32::from(warm)
}

struct Target {
    kind: Kind,
    addr: SocketAddr,
    calls: Calls,
}

struct Harness {
    server: ServerThread,
    redis: redis_stats::Stats,
    requests: usize,
}

impl Harness {
    /// A warm-up of `warm_make`, then `self.requests` requests of `make`, measured.
    async fn measure(
        &mut self,
        target: &Target,
        warm: usize,
        warm_make: MakeRequest,
        make: MakeRequest,
    ) -> Run {
        client::load(target.addr, CLIENTS, warm, warm_make).await;
        tokio::time::sleep(SETTLE).await;
        let redis_before = if target.kind.redis() {
            Some(self.redis.read().await)
        } else {
            None
        };
        let calls_before = target.calls.load(Ordering::SeqCst);
        let cpu_before = self.server.snapshot();
        let stats = client::load(target.addr, CLIENTS, self.requests, make).await;
        // What the requests started and the answers did not wait for (a record written after
        // its answer went out) is theirs too.
        tokio::time::sleep(SETTLE).await;
        let cpu = self.server.used_since(&cpu_before);
        let handler_calls = target.calls.load(Ordering::SeqCst) - calls_before;
        let commands = match redis_before {
            Some(before) => Some(self.redis.read().await.since(&before)),
            None => None,
        };
        Run {
            stats,
            cpu,
            requests: self.requests,
            handler_calls,
            commands,
        }
    }
}

fn main() {
    server::mark_load_thread();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .on_thread_start(server::mark_load_thread)
        .build()
        .expect("load generator runtime");
    let faithful = runtime.block_on(run());
    if !faithful {
        eprintln!("\nA row's handler calls or replay marks were not what its workload must give.");
        std::process::exit(1);
    }
}

async fn run() -> bool {
    let started = Instant::now();
    let requests: usize = std::env::var("RIVALS_REQUESTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(6_000);
    let redis_url =
        std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned());
    let prefix = format!("rivalsbench{}", std::process::id());
    // Every key a store is sent in the run, and then some.
    let capacity = ROUNDS * (WARM + requests) * 2;

    let mut redis = redis_stats::Stats::connect(&redis_url).await;
    let (version, clients_before) = redis.describe().await;
    // Keys of an earlier run that did not end normally.
    let stale = redis.remove("rivalsbench").await;

    let machine_before = server::MachineCpu::read();
    let server = ServerThread::start();
    let mut targets = Vec::new();
    for kind in Kind::ALL {
        let (url, prefix) = (redis_url.clone(), prefix.clone());
        let (router, calls) = server
            .handle
            .spawn(async move {
                let place = RedisPlace {
                    url: &url,
                    prefix: &prefix,
                };
                routes::router(kind, &place, capacity).await
            })
            .await
            .expect("router");
        let addr = server.serve(router).await;
        targets.push(Target { kind, addr, calls });
    }

    let mut harness = Harness {
        server,
        redis,
        requests,
    };
    let mut rows: Vec<Row> = Vec::new();
    for kind in Kind::ALL {
        rows.push(Row {
            kind,
            phase: Phase::Fresh,
            runs: Vec::new(),
        });
        if kind != Kind::Bare {
            rows.push(Row {
                kind,
                phase: Phase::Replay,
                runs: Vec::new(),
            });
        }
    }

    for round in 0..ROUNDS {
        // Each round in another order (rotated), a configuration's fresh row before its replays.
        let n = targets.len();
        for step in 0..n {
            let target = &targets[(step + round * 3) % n];
            let fresh_run = harness
                .measure(
                    target,
                    WARM,
                    fresh(tag(round, true)),
                    fresh(tag(round, false)),
                )
                .await;
            row(&mut rows, target.kind, Phase::Fresh).push(fresh_run);
            if target.kind != Kind::Bare {
                let replay_run = harness
                    .measure(
                        target,
                        REPLAY_KEYS,
                        replays(tag(0, false), REPLAY_KEYS),
                        replays(tag(0, false), REPLAY_KEYS),
                    )
                    .await;
                row(&mut rows, target.kind, Phase::Replay).push(replay_run);
            }
        }
        eprintln!(
            "round {} of {ROUNDS} done ({:.0} s)",
            round + 1,
            started.elapsed().as_secs_f64()
        );
    }

    let (busy, own, stolen) = server::MachineCpu::read().since(&machine_before);
    let (_, clients_after) = harness.redis.describe().await;
    let removed = harness.redis.remove(&prefix).await;

    print_cpu(&rows, requests);
    print_rounds(&rows, requests);
    print_versus(&rows);
    print_redis(&rows);
    println!(
        "\nRedis {version}; clients connected before the run: {clients_before}, at its end: \
         {clients_after} (the harness's own included); {removed} keys of this run removed \
         afterwards{}. Each store held {} records at the end (every fresh key of the run). \
         Run time {:.0} s; the machine's CPU (all cores) was {busy:.0} % busy during it, \
         {own:.0} % in this process, and {stolen:.1} % was taken by the hypervisor (steal).",
        if stale > 0 {
            format!(", {stale} of an earlier run before it")
        } else {
            String::new()
        },
        ROUNDS * (WARM + requests),
        started.elapsed().as_secs_f64()
    );
    rows.iter().all(Row::faithful)
}

fn row(rows: &mut [Row], kind: Kind, phase: Phase) -> &mut Vec<Run> {
    &mut rows
        .iter_mut()
        .find(|r| r.kind == kind && (r.phase == phase || kind == Kind::Bare))
        .expect("row")
        .runs
}

fn find(rows: &[Row], kind: Kind, phase: Phase) -> &Row {
    rows.iter()
        .find(|r| r.kind == kind && (r.phase == phase || kind == Kind::Bare))
        .expect("row")
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1e3)
}

fn print_cpu(rows: &[Row], requests: usize) {
    let bare = find(rows, Kind::Bare, Phase::Fresh).median().server_us();
    println!(
        "\n### Server CPU per request ({CLIENTS} clients, server on one thread, {requests} \
         requests a run, 150-byte JSON body; median of {ROUNDS} alternating rounds)\n"
    );
    println!(
        "| configuration | server CPU per request (min–max) | vs bare | other threads | req/s | p50 | handler runs | replays marked |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for row in rows {
        let m = row.median();
        let (min, max) = row.range();
        let calls: u64 = row.runs.iter().map(|r| r.handler_calls).sum();
        let replayed: usize = row.runs.iter().map(|r| r.stats.replayed).sum();
        let total: usize = row.runs.iter().map(|r| r.requests).sum();
        println!(
            "| {} | **{:.1} us** ({min:.1}–{max:.1}) | **{:.2}x** | {:.1} us | {:.0} | {} | {calls} of {total}{} | {replayed} of {total} |",
            row.name(),
            m.server_us(),
            m.server_us() / bare,
            m.others_us(),
            m.stats.rps,
            ms(m.stats.p50),
            if row.faithful() { "" } else { " **(wrong)**" },
        );
    }
}

/// Every round's figure, in the order they ran, and the records each store held when the round
/// began (a store's records only grow during the run: nothing expires within it).
fn print_rounds(rows: &[Row], requests: usize) {
    println!("\n### Each round's server CPU per request (and Redis round trips per request)\n");
    println!(
        "In the order they ran; the records are those each store held when the round began.\n"
    );
    let held: Vec<String> = (0..ROUNDS)
        .map(|r| {
            format!(
                "round {} ({:.1}k records)",
                r + 1,
                (r * (WARM + requests)) as f64 / 1000.0
            )
        })
        .collect();
    println!("| configuration | {} |", held.join(" | "));
    println!("|---|{}", "---|".repeat(ROUNDS));
    for row in rows {
        let cells: Vec<String> = row
            .runs
            .iter()
            .map(|r| match &r.commands {
                Some(c) => format!(
                    "{:.1} us ({:.2} round trips)",
                    r.server_us(),
                    c.round_trips() as f64 / r.requests as f64
                ),
                None => format!("{:.1} us", r.server_us()),
            })
            .collect();
        println!("| {} | {} |", row.name(), cells.join(" | "));
    }
}

fn print_versus(rows: &[Row]) {
    println!("\n### This crate against each rival (server CPU per request, ours / theirs)\n");
    println!("| ours | theirs | fresh keys | replays |");
    println!("|---|---|---|---|");
    let pairs = [
        (Kind::OursMemory, Kind::IdempotentMemory),
        (Kind::OursMemory, Kind::FootingMemory),
        (Kind::OursRedis, Kind::IdempotentValkey),
        (Kind::OursRedisLean, Kind::IdempotentValkey),
    ];
    for (ours, theirs) in pairs {
        let ratio = |phase| {
            find(rows, ours, phase).median().server_us()
                / find(rows, theirs, phase).median().server_us()
        };
        println!(
            "| {} | {} | **{:.2}x** | **{:.2}x** |",
            ours.label(),
            theirs.label(),
            ratio(Phase::Fresh),
            ratio(Phase::Replay)
        );
    }
    // The stores' own share: each Redis row less its layer's memory row.
    println!(
        "\nThe Redis store's share (the Redis row less the same layer's memory row), fresh / replays:"
    );
    for (redis, memory) in [
        (Kind::OursRedis, Kind::OursMemory),
        (Kind::OursRedisLean, Kind::OursMemory),
        (Kind::IdempotentValkey, Kind::IdempotentMemory),
    ] {
        let extra = |phase| {
            find(rows, redis, phase).median().server_us()
                - find(rows, memory, phase).median().server_us()
        };
        println!(
            "- {}: +{:.1} us / +{:.1} us",
            redis.label(),
            extra(Phase::Fresh),
            extra(Phase::Replay)
        );
    }
}

fn print_redis(rows: &[Row]) {
    println!(
        "\n### Redis commands per request (`INFO commandstats` around each run, all rounds)\n"
    );
    println!(
        "| configuration | round trips per request | client commands | commands run in scripts | Redis us per request |"
    );
    println!("|---|---|---|---|---|");
    for row in rows.iter().filter(|r| r.kind.redis()) {
        let mut total = Commands::default();
        let mut requests = 0;
        for run in &row.runs {
            if let Some(c) = &run.commands {
                total.add(c);
                requests += run.requests;
            }
        }
        let per = |calls: u64| calls as f64 / requests as f64;
        let mut sent = Vec::new();
        let mut scripted = Vec::new();
        let (mut trips, mut usec) = (0u64, 0u64);
        let mut commands: Vec<_> = total.0.iter().collect();
        commands.sort_by(|a, b| b.1.0.cmp(&a.1.0));
        for (name, (calls, us)) in commands {
            let text = format!("{name} {:.2}", per(*calls));
            if redis_stats::IN_SCRIPTS.contains(&name.as_str()) {
                scripted.push(text);
            } else {
                trips += calls;
                usec += us;
                sent.push(text);
            }
        }
        println!(
            "| {} | **{:.2}** | {} | {} | {:.1} |",
            row.name(),
            per(trips),
            sent.join(", "),
            scripted.join(", "),
            usec as f64 / requests as f64
        );
    }
}
