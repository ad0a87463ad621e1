//! The store `REDIS_URL` or `DATABASE_URL` names, and the router on it.

use std::error::Error;
use std::time::Duration;

use axum::Router;
use axum_idempotency::MemoryStore;
use axum_idempotency::store::PostgresStore;
use sqlx::postgres::PgPoolOptions;

#[cfg(feature = "mysql")]
use super::mysql_ledger;
use super::{Ledger, Settings, app, idempotency, store_timeout};

/// The router on the store `REDIS_URL` or `DATABASE_URL` names: Redis, Postgres (migrated on start)
/// or memory.
pub(crate) async fn router_from_env(settings: Settings) -> Result<Router, Box<dyn Error>> {
    if let Ok(url) = std::env::var("REDIS_URL") {
        return redis_router(&url, settings).await;
    }
    match std::env::var("DATABASE_URL") {
        Ok(url) if url.starts_with("sqlite:") => sqlite_router(&url, settings).await,
        #[cfg(feature = "mysql")]
        Ok(url) if url.starts_with("mysql:") || url.starts_with("mariadb:") => {
            mysql_ledger::router(&url, settings).await
        }
        Ok(url) => {
            // Three pools, so none can starve another: the layer's own statements (claims,
            // heartbeats, completions), the handlers' transactions (each held while its checkout
            // runs), and the ledger's and provider's statements (which a handler issues while it
            // holds its transaction). The layer's connections are opened up front and kept open: a
            // cold pool makes the first burst of duplicates wait on connection set-up (20
            // simultaneous duplicates of one key answered their 409s at ~35 ms p50 cold, against
            // ~6.5 ms warm).
            let records = PgPoolOptions::new()
                .min_connections(5)
                .max_connections(10)
                .connect(&url)
                .await?;
            let transactions = PgPoolOptions::new()
                .max_connections(20)
                .connect(&url)
                .await?;
            let ledger = PgPoolOptions::new()
                .max_connections(10)
                .connect(&url)
                .await?;
            // A short TTL (as tests set) needs a store timeout under half of it.
            let store = PostgresStore::new(records)
                .with_transaction_pool(transactions)
                .with_timeout(store_timeout(&settings));
            #[cfg(feature = "test-suite")]
            let store = match settings.batches_held {
                0 => store,
                rows => store.with_batches_held(rows),
            };
            store.migrate().await?;
            axum_idempotency::store::spawn_purge(store.clone(), Duration::from_secs(3600));
            tracing::info!("idempotency records and charges in PostgreSQL");
            let idempotency = idempotency(store, &settings)
                .transactions(settings.transactional)
                .build()?;
            app(idempotency, Ledger::postgres(ledger).await?, settings)
        }
        Err(_) => {
            tracing::info!(
                "idempotency records and charges in memory (set DATABASE_URL for Postgres or SQLite)"
            );
            app(
                idempotency(MemoryStore::new(), &settings).build()?,
                Ledger::memory(),
                settings,
            )
        }
    }
}

/// Records and charges in one SQLite file (`sqlite://PATH`, made when absent): a charge written in
/// the layer's transaction commits with its record, and both survive restarts and crashes.
#[cfg(feature = "sqlite")]
async fn sqlite_router(url: &str, settings: Settings) -> Result<Router, Box<dyn Error>> {
    use axum_idempotency::store::SqliteStore;
    use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};
    use std::str::FromStr;
    // One pool for the records, the handlers' transactions and the ledger: SQLite writes one at a
    // time whatever the pools, and several connections let reads (replays, 409s) go on meanwhile.
    // The busy timeout stays under the store's, so SQLite answers a wait on another writer first.
    let timeout = store_timeout(&settings);
    let options = SqliteStore::connect_options(SqliteConnectOptions::from_str(url)?)
        .busy_timeout(timeout * 4 / 5);
    let pool = SqlitePoolOptions::new()
        .max_connections(8)
        .connect_with(options)
        .await?;
    let store = SqliteStore::new(pool.clone()).with_timeout(timeout);
    store.migrate().await?;
    axum_idempotency::store::spawn_purge(store.clone(), Duration::from_secs(3600));
    tracing::info!("idempotency records and charges in SQLite");
    let idempotency = idempotency(store, &settings)
        .transactions(settings.transactional)
        .build()?;
    app(idempotency, Ledger::sqlite(pool).await?, settings)
}

#[cfg(not(feature = "sqlite"))]
async fn sqlite_router(_: &str, _: Settings) -> Result<Router, Box<dyn Error>> {
    Err("DATABASE_URL names SQLite, but the example was built without the `sqlite` feature".into())
}

/// Idempotency records in the Redis at `url`; charges in Postgres (`DATABASE_URL`) or memory. The
/// layer has no transaction to give on Redis: `Option<IdempotencyTx>` is `None`, and the charge is
/// written on its own, as with `CHECKOUT_TRANSACTIONAL=0` on Postgres.
#[cfg(feature = "redis")]
async fn redis_router(url: &str, settings: Settings) -> Result<Router, Box<dyn Error>> {
    let store = axum_idempotency::store::RedisStore::new(redis::Client::open(url)?)?
        .with_timeout(store_timeout(&settings).min(Duration::from_secs(2)));
    let ledger = match std::env::var("DATABASE_URL") {
        Ok(db) => {
            let pool = PgPoolOptions::new()
                .max_connections(10)
                .connect(&db)
                .await?;
            tracing::info!("idempotency records in Redis, charges in PostgreSQL");
            Ledger::postgres(pool).await?
        }
        Err(_) => {
            tracing::info!("idempotency records in Redis, charges in memory");
            Ledger::memory()
        }
    };
    app(idempotency(store, &settings).build()?, ledger, settings)
}

#[cfg(not(feature = "redis"))]
async fn redis_router(_: &str, _: Settings) -> Result<Router, Box<dyn Error>> {
    Err("REDIS_URL is set, but the example was built without the `redis` feature".into())
}
