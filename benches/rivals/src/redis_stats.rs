//! What Redis itself counts: `INFO commandstats` read before and after a run (calls and
//! microseconds by command), and the removal of this run's keys.
//!
//! Redis counts the commands a Lua script runs (`redis.call`) as well as the commands clients
//! send, each under its own name. The harness's own `INFO` (one per pair of readings) is taken
//! off.

use std::collections::BTreeMap;

use axum_idempotency::redis::{self, AsyncCommands, aio::MultiplexedConnection};

/// Calls and microseconds by command name (`evalsha`, `hset`, ...).
#[derive(Clone, Default)]
pub(crate) struct Commands(pub(crate) BTreeMap<String, (u64, u64)>);

/// The commands the two stores' Lua scripts run inside Redis (`redis.call`): not round trips.
/// Everything else is sent by a client, one round trip each (neither store pipelines).
pub(crate) const IN_SCRIPTS: &[&str] = &[
    "time", "hmget", "hset", "hget", "hgetall", "hdel", "hincrby", "pexpire", "pttl", "zadd",
    "zrem", "zscore", "incr", "info", "exists", "del",
];

impl Commands {
    fn parse(info: &str) -> Commands {
        let mut map = BTreeMap::new();
        for line in info.lines() {
            let Some(rest) = line.strip_prefix("cmdstat_") else {
                continue;
            };
            let Some((name, fields)) = rest.split_once(':') else {
                continue;
            };
            let field = |key: &str| -> u64 {
                fields
                    .split(',')
                    .find_map(|f| f.strip_prefix(key)?.strip_prefix('='))
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0)
            };
            map.insert(name.to_owned(), (field("calls"), field("usec")));
        }
        Commands(map)
    }

    /// What `self` (later) counts past `before`, less the harness's own `INFO`.
    pub(crate) fn since(&self, before: &Commands) -> Commands {
        let mut map = BTreeMap::new();
        for (name, (calls, usec)) in &self.0 {
            let (c0, u0) = before.0.get(name).copied().unwrap_or((0, 0));
            let mut calls = calls - c0;
            if name == "info" {
                calls = calls.saturating_sub(1);
            }
            if calls > 0 {
                map.insert(name.clone(), (calls, usec - u0));
            }
        }
        Commands(map)
    }

    /// The commands clients sent: one round trip each.
    pub(crate) fn round_trips(&self) -> u64 {
        self.0
            .iter()
            .filter(|(name, _)| !IN_SCRIPTS.contains(&name.as_str()))
            .map(|(_, (calls, _))| calls)
            .sum()
    }

    pub(crate) fn add(&mut self, other: &Commands) {
        for (name, (calls, usec)) in &other.0 {
            let entry = self.0.entry(name.clone()).or_default();
            entry.0 += calls;
            entry.1 += usec;
        }
    }
}

pub(crate) struct Stats {
    connection: MultiplexedConnection,
}

impl Stats {
    pub(crate) async fn connect(url: &str) -> Stats {
        let client = redis::Client::open(url).expect("REDIS_URL");
        let connection = client
            .get_multiplexed_async_connection()
            .await
            .expect("Redis must be running at REDIS_URL");
        Stats { connection }
    }

    pub(crate) async fn read(&mut self) -> Commands {
        let info: String = redis::cmd("INFO")
            .arg("commandstats")
            .query_async(&mut self.connection)
            .await
            .expect("INFO commandstats");
        Commands::parse(&info)
    }

    /// The server's version and the clients connected to it now.
    pub(crate) async fn describe(&mut self) -> (String, u64) {
        let info: String = redis::cmd("INFO")
            .arg("everything")
            .query_async(&mut self.connection)
            .await
            .expect("INFO");
        let value = |key: &str| {
            info.lines()
                .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
                .unwrap_or("?")
                .trim()
                .to_owned()
        };
        let clients = value("connected_clients").parse().unwrap_or(0);
        (value("redis_version"), clients)
    }

    /// Removes every key under `prefix` (this harness's own prefix: `SCAN ... MATCH prefix*`).
    pub(crate) async fn remove(&mut self, prefix: &str) -> usize {
        let pattern = format!("{prefix}*");
        let mut cursor: u64 = 0;
        let mut removed = 0;
        loop {
            let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(&pattern)
                .arg("COUNT")
                .arg(1000)
                .query_async(&mut self.connection)
                .await
                .expect("SCAN");
            if !keys.is_empty() {
                let n: usize = self.connection.unlink(&keys).await.expect("UNLINK");
                removed += n;
            }
            cursor = next;
            if cursor == 0 {
                return removed;
            }
        }
    }
}
