//! The checkout on MySQL or MariaDB (feature `mysql`, `DATABASE_URL=mysql://...`): the records in a
//! `MySqlStore`, and the ledger (charges, attempts, the provider's payments) in tables of the same
//! database, the charge written in the layer's transaction so that it commits with its record.

use std::error::Error;
use std::time::Duration;

use axum::Router;
use axum_idempotency::store::MySqlStore;
use serde_json::{Value, json};
use sqlx::MySqlPool;
use sqlx::mysql::MySqlPoolOptions;

use super::{Ledger, Settings, app, idempotency, store_timeout};

/// The router on the MySQL database at `url`: records, handlers' transactions and the ledger each
/// in a pool of their own, as on Postgres.
pub(crate) async fn router(url: &str, settings: Settings) -> Result<Router, Box<dyn Error>> {
    let pool = |min: u32, max: u32| {
        MySqlPoolOptions::new()
            .min_connections(min)
            .max_connections(max)
            .connect(url)
    };
    let (records, transactions, ledger) =
        (pool(5, 10).await?, pool(0, 20).await?, pool(0, 10).await?);
    let store = MySqlStore::new(records)
        .with_transaction_pool(transactions)
        .with_timeout(store_timeout(&settings));
    store.migrate().await?;
    axum_idempotency::store::spawn_purge(store.clone(), Duration::from_secs(3600));
    tracing::info!("idempotency records and charges in MySQL");
    let idempotency = idempotency(store, &settings)
        .transactions(settings.transactional)
        .build()?;
    app(idempotency, ledger_in(ledger).await?, settings)
}

/// The ledger in `pool`'s database, its tables created if missing, one instance at a time (a
/// named lock: two concurrent `CREATE TABLE IF NOT EXISTS` are safe on MySQL, the lock keeps the
/// set-up in step with Postgres's).
pub(crate) async fn ledger_in(pool: MySqlPool) -> Result<Ledger, sqlx::Error> {
    let mut conn = pool.acquire().await?;
    sqlx::query("SELECT GET_LOCK('checkout_ledger', 30)")
        .execute(&mut *conn)
        .await?;
    let created = sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS checkout_charges (
             id BIGINT AUTO_INCREMENT PRIMARY KEY, subject VARCHAR(255) NOT NULL,
             kind VARCHAR(16) NOT NULL, amount BIGINT NOT NULL,
             created_at DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6), KEY (subject))
             ENGINE = InnoDB;
         CREATE TABLE IF NOT EXISTS checkout_attempts (
             subject VARCHAR(255) PRIMARY KEY, attempts BIGINT NOT NULL) ENGINE = InnoDB;
         CREATE TABLE IF NOT EXISTS provider_payments (
             id BIGINT AUTO_INCREMENT PRIMARY KEY, idempotency_key VARCHAR(128) NOT NULL UNIQUE,
             subject VARCHAR(255) NOT NULL, amount BIGINT NOT NULL, KEY (subject))
             ENGINE = InnoDB;",
    )
    .execute(&mut *conn)
    .await;
    sqlx::query("SELECT RELEASE_LOCK('checkout_ledger')")
        .execute(&mut *conn)
        .await?;
    created?;
    Ok(Ledger::MySql(pool))
}

pub(crate) async fn count_attempt(pool: &MySqlPool, subject: &str) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO checkout_attempts VALUES (?, 1) \
         ON DUPLICATE KEY UPDATE attempts = attempts + 1",
    )
    .bind(subject)
    .execute(pool)
    .await?;
    Ok(())
}

/// The provider's payment for `key`: made once, its id answered again for a repeated key.
pub(crate) async fn provider_charge(
    pool: &MySqlPool,
    key: &str,
    subject: &str,
    amount: i64,
) -> Result<i64, sqlx::Error> {
    let done = sqlx::query(
        "INSERT INTO provider_payments (idempotency_key, subject, amount) VALUES (?, ?, ?) \
         ON DUPLICATE KEY UPDATE id = LAST_INSERT_ID(id)",
    )
    .bind(key)
    .bind(subject)
    .bind(amount)
    .execute(pool)
    .await?;
    Ok(done.last_insert_id() as i64)
}

/// Records a charge: in `tx` (the layer's transaction, committed with the record) when given.
pub(crate) async fn record(
    pool: &MySqlPool,
    subject: &str,
    kind: &str,
    amount: i64,
    tx: Option<&mut sqlx::MySqlConnection>,
) -> Result<i64, sqlx::Error> {
    let insert =
        sqlx::query("INSERT INTO checkout_charges (subject, kind, amount) VALUES (?, ?, ?)")
            .bind(subject)
            .bind(kind)
            .bind(amount);
    let done = match tx {
        Some(conn) => insert.execute(conn).await?,
        None => insert.execute(pool).await?,
    };
    Ok(done.last_insert_id() as i64)
}

/// The subject's charges, handler runs, and payments at the provider.
pub(crate) async fn list(
    pool: &MySqlPool,
    subject: &str,
) -> Result<(Vec<Value>, i64, i64), sqlx::Error> {
    let rows: Vec<(i64, String, i64)> = sqlx::query_as(
        "SELECT id, kind, amount FROM checkout_charges WHERE subject = ? ORDER BY id",
    )
    .bind(subject)
    .fetch_all(pool)
    .await?;
    let (attempts,): (i64,) = sqlx::query_as(
        "SELECT CAST(COALESCE(SUM(attempts), 0) AS SIGNED) FROM checkout_attempts \
         WHERE subject = ?",
    )
    .bind(subject)
    .fetch_one(pool)
    .await?;
    let (payments,): (i64,) =
        sqlx::query_as("SELECT COUNT(*) FROM provider_payments WHERE subject = ?")
            .bind(subject)
            .fetch_one(pool)
            .await?;
    let charges = rows
        .into_iter()
        .map(|(id, kind, amount)| json!({"id": id, "kind": kind, "amount": amount}))
        .collect();
    Ok((charges, attempts, payments))
}
