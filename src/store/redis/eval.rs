//! Running a script on its keys, by SHA1 and whole when the server lacks it, every operation
//! bounded by the store's timeout; and whether a script may take two keys here.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::time::Duration;
use std::time::Instant;

use redis::{Cmd, ErrorKind, FromRedisValue, ServerErrorKind};

use super::RedisStore;
use super::connection::Connection;
use super::scripts::Lua;
use crate::store::{LeaseToken, RecordKey, StoreError};

impl RedisStore {
    /// Runs `script` on the record `key` (its only key, `KEYS[1]`) with the arguments `args` adds,
    /// within the timeout: by SHA1, and whole when the server does not have it (see [`RedisStore`]).
    pub(super) async fn eval<T: FromRedisValue>(
        &self,
        what: &'static str,
        script: &Lua,
        key: &RecordKey,
        args: impl Fn(&mut Cmd),
    ) -> Result<T, StoreError> {
        self.eval_on(what, script, &self.redis_key(key), self.timeout, args)
            .await
    }

    /// Runs `script` on `key` (a record's or an index's Redis key, its only key), within `limit`.
    pub(super) async fn eval_on<T: FromRedisValue>(
        &self,
        what: &'static str,
        script: &Lua,
        key: &str,
        limit: Duration,
        args: impl Fn(&mut Cmd),
    ) -> Result<T, StoreError> {
        self.eval_keys(what, script, &[key], limit, args).await
    }

    /// Runs `script` on `keys` (`KEYS[1]`, ...), within `limit`.
    async fn eval_keys<T: FromRedisValue>(
        &self,
        what: &'static str,
        script: &Lua,
        keys: &[&str],
        limit: Duration,
        args: impl Fn(&mut Cmd),
    ) -> Result<T, StoreError> {
        self.timed(what, limit, self.run(script, keys, &args)).await
    }

    /// Runs `script` on `key` and, where scripts may take two keys (see [`Self::keys_together`]),
    /// on `joined` too (its `KEYS[2]`), within the timeout; says whether `joined` was one of its
    /// keys. A server (or proxy) that answers the two-key script with an error of its own
    /// (`CROSSSLOT` from a proxy in front of a cluster, `NOPERM` from an ACL that allows only some
    /// keys, or any other) gets it again on `key` alone, with the same arguments. That is safe
    /// whether or not the first one ran: the scripts' second keys are written last and best
    /// effort, a claim sent again under its own lease is granted again as its own (claimed, or
    /// retaken), and a completion sent again by the lease that made it counts as done. If the
    /// second one is answered, this store (and its clones) takes one key until its next probe.
    pub(super) async fn eval_joined<T: FromRedisValue>(
        &self,
        what: &'static str,
        script: &Lua,
        key: &str,
        joined: Option<&str>,
        args: impl Fn(&mut Cmd),
    ) -> Result<(T, bool), StoreError> {
        let run = async {
            let joined = joined.filter(|_| self.keys_together());
            let mut refused = false;
            if let Some(joined) = joined {
                match self.run(script, &[key, joined], &args).await {
                    Err(e) if answered(&e) => {
                        tracing::debug!(error = %e, "a script on two keys was refused");
                        refused = true;
                    }
                    answer => return answer.map(|answer| (answer, true)),
                }
            }
            let answer = self.run(script, &[key], &args).await?;
            if refused {
                tracing::info!(
                    "this Redis refused a script on two keys: the store sends each subject's \
                     index and account commands of their own until it probes the server again"
                );
                self.joined.decide(false);
            }
            Ok((answer, false))
        };
        self.timed(what, self.timeout, run).await
    }

    /// Whether this store's scripts may take a second key: on one server, as the last probe found
    /// (see [`Self::probe`]), made on a task of its own when a claim first asks and again every
    /// [`REPROBE`] (a proxy whose servers change shape, a refusal that was passing); until the
    /// first answers, scripts take one key. On a cluster, never (the keys are on other slots).
    pub(super) fn keys_together(&self) -> bool {
        if !matches!(self.connection, Connection::Single(_)) {
            return false;
        }
        let (together, due) = self.joined.now();
        if due && !self.joined.probing.swap(true, Ordering::AcqRel) {
            /// Lets the next probe start when this one ends, however it ends (a runtime shutting
            /// down drops it mid-way).
            struct Probing(Arc<Joined>);
            impl Drop for Probing {
                fn drop(&mut self) {
                    self.0.probing.store(false, Ordering::Release);
                }
            }
            let probing = Probing(self.joined.clone());
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                let store = self.clone();
                runtime.spawn(async move {
                    let _probing = probing;
                    if let Some(found) = store.probe().await {
                        if !found && together != Some(false) {
                            tracing::info!(
                                "this Redis address does not hold every key a script names: the \
                                 store sends each subject's index and account commands of their \
                                 own"
                            );
                        }
                        store.joined.decide(found);
                    }
                });
            }
        }
        together == Some(true)
    }

    /// Whether one server holds every key a script names: [`PROBES`] times, a script on two keys
    /// of their own, shaped as a record's and a subject's index or account (so that a proxy
    /// routing by a hash tag or a prefix sees them as it sees those), writes a short-lived value
    /// under the second, which a plain `GETDEL` of that key alone must then find. A proxy with one
    /// address in front of several servers either refuses the two keys (`CROSSSLOT`) or runs the
    /// script where its first key lives (twemproxy, Envoy's Redis proxy), where the read by the
    /// second key does not find it, unless every pair lands on one server: one chance in 2^32
    /// behind two even servers, 0.2 % at 90 % and 10 %. `None`: no answer (the next claim probes
    /// again); each step is bounded by the operation timeout.
    async fn probe(&self) -> Option<bool> {
        use sha2::{Digest, Sha256};
        let value = LeaseToken::generate().0.to_string();
        for probe in 0..PROBES {
            let shape = |what: &str| -> [u8; 32] {
                Sha256::digest(format!("{value}:{probe}:{what}")).into()
            };
            let first = self.record_key(&shape("record"));
            let kind = if probe % 2 == 0 { "subject:" } else { "bytes:" };
            let mut second = format!("{}{kind}", self.prefix);
            crate::util::hex::push(&mut second, &shape("subject"));
            let written = tokio::time::timeout(
                self.timeout,
                self.run::<i64>(&self.scripts.probe, &[&first, &second], &|cmd| {
                    cmd.arg(&value).arg(10_000);
                }),
            )
            .await;
            match written {
                Ok(Ok(_)) => {}
                Ok(Err(e)) if answered(&e) => return Some(false),
                _ => return None,
            }
            let mut connection = self.connection.clone();
            // Read and removed: a probe leaves nothing behind where it found what it wrote.
            let read = tokio::time::timeout(
                self.timeout,
                redis::cmd("GETDEL")
                    .arg(&second)
                    .query_async::<Option<String>>(&mut connection),
            )
            .await;
            match read {
                Ok(Ok(Some(read))) if read == value => {}
                Ok(Ok(_)) => return Some(false),
                Ok(Err(e)) if answered(&e) => return Some(false),
                _ => return None,
            }
        }
        Some(true)
    }

    /// `script` on `keys` by SHA1, and whole when the server does not have it.
    async fn run<T: FromRedisValue>(
        &self,
        script: &Lua,
        keys: &[&str],
        args: &impl Fn(&mut Cmd),
    ) -> redis::RedisResult<T> {
        let command = |name: &str, script: &str| {
            let mut cmd = redis::cmd(name);
            cmd.arg(script).arg(keys.len());
            for key in keys {
                cmd.arg(*key);
            }
            args(&mut cmd);
            cmd
        };
        let mut connection = self.connection.clone();
        match command("EVALSHA", &script.sha1)
            .query_async(&mut connection)
            .await
        {
            Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                command("EVAL", script.code)
                    .query_async(&mut connection)
                    .await
            }
            answer => answer,
        }
    }

    pub(super) async fn timed<T>(
        &self,
        what: &'static str,
        limit: Duration,
        operation: impl Future<Output = redis::RedisResult<T>>,
    ) -> Result<T, StoreError> {
        match tokio::time::timeout(limit, operation).await {
            Ok(result) => result.map_err(|e| {
                // `OOM`: the server is at `maxmemory` and evicts nothing (`noeviction`): the write
                // was refused, nothing was written.
                if e.code() == Some("OOM") {
                    StoreError::store_full(format!(
                        "redis {what}: the server is out of memory: {e}"
                    ))
                } else if matches!(e.code(), Some("MISCONF" | "READONLY")) {
                    // The server refuses writes (its snapshots fail to save; a replica, after a
                    // failover the client has not followed yet): nothing was written. Unavailable,
                    // never a reason to run unguarded.
                    StoreError::refused_claim(format!(
                        "redis {what}: the server refuses writes: {e}"
                    ))
                } else {
                    StoreError::new(format!("redis {what}"), e)
                }
            }),
            Err(_) => Err(StoreError::msg(format!(
                "redis {what}: no answer within {limit:?}"
            ))),
        }
    }
}

/// Whether `e` is the server's answer (an error reply), not a failure to reach it or to read its
/// answer.
fn answered(e: &redis::RedisError) -> bool {
    matches!(e.kind(), ErrorKind::Server(_) | ErrorKind::Extension) && !e.is_io_error()
}

/// How many pairs of keys a probe writes and reads back (see `RedisStore::probe`).
const PROBES: usize = 32;

/// How long a probe's answer holds before the next claim probes again.
const REPROBE: Duration = Duration::from_secs(600);

/// What a store (and its clones) knows of whether its scripts may take two keys.
pub(super) struct Joined {
    /// 0: not known; 1: together; 2: apart.
    state: AtomicU8,
    /// When `state` was last decided, in ms after `epoch`.
    decided_ms: AtomicU64,
    epoch: Instant,
    /// Whether a probe is under way.
    probing: AtomicBool,
}

impl Joined {
    pub(super) fn new() -> Self {
        Joined {
            state: AtomicU8::new(0),
            decided_ms: AtomicU64::new(0),
            epoch: Instant::now(),
            probing: AtomicBool::new(false),
        }
    }

    /// The last answer (`None`: none yet), and whether a probe is due.
    pub(super) fn now(&self) -> (Option<bool>, bool) {
        let known = match self.state.load(Ordering::Acquire) {
            1 => Some(true),
            2 => Some(false),
            _ => None,
        };
        let age = (self.epoch.elapsed().as_millis() as u64)
            .saturating_sub(self.decided_ms.load(Ordering::Acquire));
        (known, known.is_none() || age >= REPROBE.as_millis() as u64)
    }

    pub(super) fn decide(&self, together: bool) {
        self.decided_ms
            .store(self.epoch.elapsed().as_millis() as u64, Ordering::Release);
        self.state
            .store(if together { 1 } else { 2 }, Ordering::Release);
    }
}
