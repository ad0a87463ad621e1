//! The ledger: charges, handler runs and the simulated provider's payments, per subject, in memory
//! or in Postgres tables (SQLite's in `sqlite_ledger`, MySQL's in `mysql_ledger`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use serde_json::{Value, json};
use sqlx::{PgConnection, PgPool};

#[cfg(feature = "mysql")]
use super::mysql_ledger;
#[cfg(feature = "sqlite")]
use super::sqlite_ledger;

/// Serialises the ledger set-up of concurrent instances (`pg_advisory_xact_lock` key). Its own key,
/// not the layer's: the two set-ups need not wait for each other.
const LEDGER_LOCK: i64 = 0x6368_6563_6b6f_7574; // "checkout" in ASCII

/// Charges and handler runs, per subject: in memory, or in Postgres, SQLite or MySQL tables that
/// survive restarts.
#[derive(Clone)]
pub(crate) enum Ledger {
    Memory(Arc<Mutex<MemoryLedger>>),
    Postgres(PgPool),
    #[cfg(feature = "sqlite")]
    Sqlite(sqlx::SqlitePool),
    #[cfg(feature = "mysql")]
    MySql(sqlx::MySqlPool),
}

/// The connection of the layer's transaction, on the ledger's database.
pub(crate) enum TxConn<'a> {
    Postgres(&'a mut PgConnection),
    #[cfg(feature = "sqlite")]
    Sqlite(&'a mut sqlx::SqliteConnection),
    #[cfg(feature = "mysql")]
    MySql(&'a mut sqlx::MySqlConnection),
}

#[derive(Default)]
pub(crate) struct MemoryLedger {
    next_id: i64,
    charges: Vec<(String, Value)>,
    attempts: HashMap<String, i64>,
    /// The simulated provider's payments: its idempotency key to (subject, payment id).
    payments: HashMap<String, (String, i64)>,
}

impl Ledger {
    pub(crate) fn memory() -> Self {
        Ledger::Memory(Arc::default())
    }

    /// The ledger in `pool`'s database, its tables created if missing. Safe to run from many
    /// instances at once: two concurrent `CREATE TABLE IF NOT EXISTS` of one table can both see it
    /// missing, and the loser fails on `pg_type_typname_nsp_index`. So, as
    /// `PostgresStore::migrate` does for its own table, one transaction takes an advisory lock
    /// (held until commit) before creating the tables, and the set-ups run one after another.
    pub(crate) async fn postgres(pool: PgPool) -> Result<Self, sqlx::Error> {
        let mut tx = pool.begin().await?;
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(LEDGER_LOCK)
            .execute(&mut *tx)
            .await?;
        sqlx::raw_sql(
            "CREATE TABLE IF NOT EXISTS checkout_charges (
                 id bigserial PRIMARY KEY, subject text NOT NULL, kind text NOT NULL,
                 amount bigint NOT NULL, created_at timestamptz NOT NULL DEFAULT now());
             CREATE TABLE IF NOT EXISTS checkout_attempts (
                 subject text PRIMARY KEY, attempts bigint NOT NULL);
             CREATE TABLE IF NOT EXISTS provider_payments (
                 id bigserial PRIMARY KEY, idempotency_key text NOT NULL UNIQUE,
                 subject text NOT NULL, amount bigint NOT NULL);",
        )
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(Ledger::Postgres(pool))
    }

    pub(crate) async fn count_attempt(&self, subject: &str) -> Result<(), sqlx::Error> {
        match self {
            Ledger::Memory(m) => {
                *lock(m).attempts.entry(subject.to_owned()).or_default() += 1;
            }
            Ledger::Postgres(pool) => {
                sqlx::query(
                    "INSERT INTO checkout_attempts VALUES ($1, 1) \
                     ON CONFLICT (subject) DO UPDATE SET attempts = checkout_attempts.attempts + 1",
                )
                .bind(subject)
                .execute(pool)
                .await?;
            }
            #[cfg(feature = "mysql")]
            Ledger::MySql(pool) => mysql_ledger::count_attempt(pool, subject).await?,
            #[cfg(feature = "sqlite")]
            Ledger::Sqlite(pool) => sqlite_ledger::count_attempt(pool, subject).await?,
        }
        Ok(())
    }

    /// A call to one of the simulated services that take no idempotency key (the warehouse that
    /// reserves stock, the provider's card network, the mail service that sends receipts): each
    /// call is an effect, counted (in the handler runs' table, under `<service>:<subject>`, outside
    /// any transaction, so it survives the process).
    pub(crate) async fn call(&self, service: &str, subject: &str) -> Result<(), sqlx::Error> {
        self.count_attempt(&format!("{service}:{subject}")).await
    }

    /// How many times `subject`'s checkouts called `service`.
    pub(crate) async fn calls(&self, service: &str, subject: &str) -> Result<i64, sqlx::Error> {
        let (_, calls, _) = self.list(&format!("{service}:{subject}")).await?;
        Ok(calls)
    }

    /// The simulated payment provider: charges the card once per idempotency key, and answers a
    /// repeated key with the first payment (its state is its own: not in the handler's
    /// transaction).
    pub(crate) async fn provider_charge(
        &self,
        key: &str,
        subject: &str,
        amount: i64,
    ) -> Result<i64, sqlx::Error> {
        match self {
            Ledger::Memory(m) => {
                let mut m = lock(m);
                let next = m.payments.len() as i64 + 1;
                let entry = m
                    .payments
                    .entry(key.to_owned())
                    .or_insert_with(|| (subject.to_owned(), next));
                Ok(entry.1)
            }
            Ledger::Postgres(pool) => {
                let (id,): (i64,) = sqlx::query_as(
                    "INSERT INTO provider_payments (idempotency_key, subject, amount) \
                     VALUES ($1, $2, $3) ON CONFLICT (idempotency_key) \
                     DO UPDATE SET amount = provider_payments.amount RETURNING id",
                )
                .bind(key)
                .bind(subject)
                .bind(amount)
                .fetch_one(pool)
                .await?;
                Ok(id)
            }
            #[cfg(feature = "mysql")]
            Ledger::MySql(pool) => mysql_ledger::provider_charge(pool, key, subject, amount).await,
            #[cfg(feature = "sqlite")]
            Ledger::Sqlite(pool) => {
                sqlite_ledger::provider_charge(pool, key, subject, amount).await
            }
        }
    }

    /// Records a charge: in the layer's transaction (committed with the record) when there is one;
    /// the transaction begins here, at its first use.
    pub(crate) async fn record(
        &self,
        subject: &str,
        kind: &str,
        amount: i64,
        tx: Option<TxConn<'_>>,
    ) -> Result<i64, sqlx::Error> {
        let insert = sqlx::query_as(
            "INSERT INTO checkout_charges (subject, kind, amount) VALUES ($1, $2, $3) RETURNING id",
        )
        .bind(subject)
        .bind(kind)
        .bind(amount);
        match (self, tx) {
            (Ledger::Postgres(_), Some(TxConn::Postgres(tx))) => {
                let (id,): (i64,) = insert.fetch_one(tx).await?;
                Ok(id)
            }
            #[cfg(feature = "sqlite")]
            (Ledger::Sqlite(pool), tx) => {
                sqlite_ledger::record(pool, subject, kind, amount, tx).await
            }
            #[cfg(feature = "mysql")]
            (Ledger::MySql(pool), tx) => {
                let tx = match tx {
                    Some(TxConn::MySql(conn)) => Some(conn),
                    _ => None,
                };
                mysql_ledger::record(pool, subject, kind, amount, tx).await
            }
            (Ledger::Memory(m), _) => {
                let mut m = lock(m);
                m.next_id += 1;
                let id = m.next_id;
                let entry = json!({"id": id, "kind": kind, "amount": amount});
                m.charges.push((subject.to_owned(), entry));
                Ok(id)
            }
            (Ledger::Postgres(pool), _) => {
                let (id,): (i64,) = insert.fetch_one(pool).await?;
                Ok(id)
            }
        }
    }

    /// The subject's charges, handler runs, and payments at the provider.
    pub(crate) async fn list(&self, subject: &str) -> Result<(Vec<Value>, i64, i64), sqlx::Error> {
        match self {
            Ledger::Memory(m) => {
                let m = lock(m);
                let charges = m.charges.iter().filter(|(s, _)| s == subject);
                let charges = charges.map(|(_, c)| c.clone()).collect();
                let payments = m.payments.values().filter(|(s, _)| s == subject).count();
                Ok((
                    charges,
                    m.attempts.get(subject).copied().unwrap_or(0),
                    payments as i64,
                ))
            }
            Ledger::Postgres(pool) => {
                let rows: Vec<(i64, String, i64)> = sqlx::query_as(
                    "SELECT id, kind, amount FROM checkout_charges WHERE subject = $1 ORDER BY id",
                )
                .bind(subject)
                .fetch_all(pool)
                .await?;
                let (attempts,): (i64,) = sqlx::query_as(
                    "SELECT coalesce(sum(attempts), 0)::bigint FROM checkout_attempts WHERE subject = $1",
                )
                .bind(subject)
                .fetch_one(pool)
                .await?;
                let (payments,): (i64,) =
                    sqlx::query_as("SELECT count(*) FROM provider_payments WHERE subject = $1")
                        .bind(subject)
                        .fetch_one(pool)
                        .await?;
                let charges = rows
                    .into_iter()
                    .map(|(id, kind, amount)| json!({"id": id, "kind": kind, "amount": amount}))
                    .collect();
                Ok((charges, attempts, payments))
            }
            #[cfg(feature = "mysql")]
            Ledger::MySql(pool) => mysql_ledger::list(pool, subject).await,
            #[cfg(feature = "sqlite")]
            Ledger::Sqlite(pool) => sqlite_ledger::list(pool, subject).await,
        }
    }
}

pub(crate) fn lock(m: &Mutex<MemoryLedger>) -> std::sync::MutexGuard<'_, MemoryLedger> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}
