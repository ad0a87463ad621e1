//! Running a script on one key, by SHA1 and whole when the server lacks it, every operation
//! bounded by the store's timeout.

use std::future::Future;
use std::time::Duration;

use redis::{Cmd, ErrorKind, FromRedisValue, ServerErrorKind};

use super::RedisStore;
use super::scripts::Lua;
use crate::store::{RecordKey, StoreError};

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
        let command = |name: &str, script: &str| {
            let mut cmd = redis::cmd(name);
            cmd.arg(script).arg(1).arg(key);
            args(&mut cmd);
            cmd
        };
        let mut connection = self.connection.clone();
        let run = async move {
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
        };
        self.timed(what, limit, run).await
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
