//! Lookup and delete: a record as inspection shows it, and the delete of a finished one.

use redis::Value;

use super::RedisStore;
use super::codec::integer;
use crate::store::{Deleted, RecordInfo, RecordKey, RecordState, StoreError, from_micros};

/// A record as inspection reads it.
pub(super) struct Inspected {
    pub(super) info: RecordInfo,
    pub(super) created_ms: i64,
    /// What the record has left to live (`PTTL`, ms).
    pub(super) ttl_ms: i64,
    pub(super) key: String,
    pub(super) subject: String,
    pub(super) endpoint: String,
}

impl RedisStore {
    /// The record under the Redis key `key` as inspection shows it, with its creation time (ms),
    /// key, subject and endpoint; `None` when it is absent, expired or released.
    pub(super) async fn inspect(&self, key: &str) -> Result<Option<Inspected>, StoreError> {
        let reply: Option<Vec<Value>> = self
            .eval_on("inspect", &self.scripts.inspect, key, self.timeout, |_| {})
            .await?;
        let Some(reply) = reply else {
            return Ok(None);
        };
        let bad = || StoreError::msg("redis inspect: unexpected reply");
        let text = |i: usize| -> Result<String, StoreError> {
            match reply.get(i) {
                Some(Value::BulkString(bytes)) => Ok(String::from_utf8_lossy(bytes).into_owned()),
                Some(Value::SimpleString(s)) => Ok(s.clone()),
                Some(Value::Int(n)) => Ok(n.to_string()),
                _ => Err(bad()),
            }
        };
        let int = |i: usize| -> Result<i64, StoreError> {
            match reply.get(i) {
                Some(Value::Int(n)) => Ok(*n),
                _ => text(i)?.parse().map_err(|_| bad()),
            }
        };
        let state = RecordState::from_name(&text(0)?).ok_or_else(bad)?;
        let (created_ms, ttl_ms, now_ms, status) = (int(1)?, int(2)?, int(3)?, int(4)?);
        let expires_at = if ttl_ms >= 0 {
            from_micros(now_ms.saturating_add(ttl_ms).saturating_mul(1000))
        } else {
            // No expiry (a record always has one): it never expires.
            from_micros(i64::MAX)
        };
        let info = RecordInfo::new(
            state,
            u16::try_from(status).ok().filter(|_| state.is_finished()),
            from_micros(created_ms.saturating_mul(1000)),
            expires_at,
        );
        Ok(Some(Inspected {
            info,
            created_ms,
            ttl_ms,
            key: text(5)?,
            subject: text(6)?,
            endpoint: text(7)?,
        }))
    }

    /// See [`IdempotencyStore::lookup`](crate::store::IdempotencyStore::lookup).
    pub(super) async fn lookup_record(
        &self,
        key: &RecordKey,
    ) -> Result<Option<RecordInfo>, StoreError> {
        Ok(self
            .inspect(&self.redis_key(key))
            .await?
            .map(|record| record.info))
    }

    /// See [`IdempotencyStore::delete`](crate::store::IdempotencyStore::delete).
    pub(super) async fn delete_record(&self, key: &RecordKey) -> Result<Deleted, StoreError> {
        let reply: Vec<Value> = self
            .eval("delete", &self.scripts.delete, key, |_| {})
            .await?;
        match reply.first() {
            Some(Value::Int(2)) => {
                // The record is gone; its index entry too, unless a new claim filed it again.
                if let Some(created_ms) = reply.get(1).and_then(integer) {
                    let member = crate::util::hex::encode(&key.digest());
                    self.unindex(&self.index_key(&key.subject), &member, created_ms)
                        .await;
                }
                Ok(Deleted::Deleted)
            }
            Some(Value::Int(1)) => Ok(Deleted::InProgress),
            Some(Value::Int(0)) => Ok(Deleted::NotFound),
            _ => Err(StoreError::msg("redis delete: unexpected reply")),
        }
    }
}
