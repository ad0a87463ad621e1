//! The ledger in a SQLite file (feature `sqlite`): the file of the idempotency records, so that a
//! charge written in the layer's transaction commits with its record.

use serde_json::{Value, json};
use sqlx::SqlitePool;

use super::{Ledger, TxConn};

impl Ledger {
    /// The ledger in `pool`'s file, its tables created if missing (SQLite runs one writer at a
    /// time: instances setting it up at once take turns).
    pub(crate) async fn sqlite(pool: SqlitePool) -> Result<Self, sqlx::Error> {
        sqlx::raw_sql(
            "CREATE TABLE IF NOT EXISTS checkout_charges (
                 id INTEGER PRIMARY KEY AUTOINCREMENT, subject TEXT NOT NULL,
                 kind TEXT NOT NULL, amount INTEGER NOT NULL,
                 created_at TEXT NOT NULL DEFAULT CURRENT_TIMESTAMP);
             CREATE TABLE IF NOT EXISTS checkout_attempts (
                 subject TEXT PRIMARY KEY, attempts INTEGER NOT NULL);
             CREATE TABLE IF NOT EXISTS provider_payments (
                 id INTEGER PRIMARY KEY AUTOINCREMENT, idempotency_key TEXT NOT NULL UNIQUE,
                 subject TEXT NOT NULL, amount INTEGER NOT NULL);",
        )
        .execute(&pool)
        .await?;
        Ok(Ledger::Sqlite(pool))
    }
}

pub(super) async fn count_attempt(pool: &SqlitePool, subject: &str) -> sqlx::Result<()> {
    sqlx::query(
        "INSERT INTO checkout_attempts VALUES (?1, 1) \
         ON CONFLICT (subject) DO UPDATE SET attempts = attempts + 1",
    )
    .bind(subject)
    .execute(pool)
    .await?;
    Ok(())
}

pub(super) async fn provider_charge(
    pool: &SqlitePool,
    key: &str,
    subject: &str,
    amount: i64,
) -> sqlx::Result<i64> {
    let (id,): (i64,) = sqlx::query_as(
        "INSERT INTO provider_payments (idempotency_key, subject, amount) VALUES (?1, ?2, ?3) \
         ON CONFLICT (idempotency_key) DO UPDATE SET amount = amount RETURNING id",
    )
    .bind(key)
    .bind(subject)
    .bind(amount)
    .fetch_one(pool)
    .await?;
    Ok(id)
}

/// In the layer's transaction when given, else on its own.
pub(super) async fn record(
    pool: &SqlitePool,
    subject: &str,
    kind: &str,
    amount: i64,
    tx: Option<TxConn<'_>>,
) -> sqlx::Result<i64> {
    let insert = sqlx::query_as(
        "INSERT INTO checkout_charges (subject, kind, amount) VALUES (?1, ?2, ?3) RETURNING id",
    )
    .bind(subject)
    .bind(kind)
    .bind(amount);
    let (id,): (i64,) = match tx {
        Some(TxConn::Sqlite(tx)) => insert.fetch_one(tx).await?,
        _ => insert.fetch_one(pool).await?,
    };
    Ok(id)
}

pub(super) async fn list(pool: &SqlitePool, subject: &str) -> sqlx::Result<(Vec<Value>, i64, i64)> {
    let rows: Vec<(i64, String, i64)> = sqlx::query_as(
        "SELECT id, kind, amount FROM checkout_charges WHERE subject = ?1 ORDER BY id",
    )
    .bind(subject)
    .fetch_all(pool)
    .await?;
    let (attempts,): (i64,) = sqlx::query_as(
        "SELECT coalesce(sum(attempts), 0) FROM checkout_attempts WHERE subject = ?1",
    )
    .bind(subject)
    .fetch_one(pool)
    .await?;
    let (payments,): (i64,) =
        sqlx::query_as("SELECT count(*) FROM provider_payments WHERE subject = ?1")
            .bind(subject)
            .fetch_one(pool)
            .await?;
    let charges = rows
        .into_iter()
        .map(|(id, kind, amount)| json!({"id": id, "kind": kind, "amount": amount}))
        .collect();
    Ok((charges, attempts, payments))
}
