//! The checkout example as a process of its own with its idempotency records in Redis
//! (`REDIS_URL`, default `redis://127.0.0.1:6379`) and its charges in PostgreSQL (`DATABASE_URL`,
//! in a schema of its own): a checkout and its replay are one charge, the record is in Redis and not
//! in PostgreSQL, and a restarted example still replays it.
#![cfg(all(feature = "postgres", feature = "redis"))]

use crate::common;

use std::time::Duration;

use axum::http::StatusCode;
use axum_idempotency::store::RecordKey;
use common::example::{self, database_url};
use sqlx::PgPool;

fn redis_url() -> String {
    common::servers::redis_url()
}

/// A name no earlier run used: the example's records live under a fixed prefix in a shared Redis.
fn unique() -> String {
    format!(
        "{}_{}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_nanos(),
        std::process::id()
    )
}

/// The Redis key of a record of the example: the store's default prefix, then the scope's digest.
fn record_key(key: &str, subject: &str, endpoint: &str) -> String {
    let digest = RecordKey {
        key: key.into(),
        subject: subject.into(),
        endpoint: endpoint.into(),
    }
    .digest();
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    format!("idempotency:{hex}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checkout_on_redis_then_its_replay_charges_once() {
    let admin = PgPool::connect(&database_url()).await.expect("PostgreSQL");
    let run = unique();
    // `idem_t_<epoch seconds>_...`, as every test schema is named: the Postgres tests drop those
    // older than an hour by that number.
    let schema = format!(
        "idem_t_{}_{}_redis_example",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_secs(),
        std::process::id()
    );
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
        .execute(&admin)
        .await
        .expect("create the schema");
    let env = [("REDIS_URL", redis_url())];
    let (user, key) = (format!("alice-{run}"), format!("order-{run}"));
    let patience = Duration::from_secs(10);
    let checkout = |addr, body: &'static str| {
        let (user, key) = (user.clone(), key.clone());
        async move {
            example::request(addr, "POST", "/checkout", &user, Some(&key), body, patience)
                .await
                .expect("checkout answered")
        }
    };
    let charges = |addr| {
        let user = user.clone();
        async move {
            example::request(addr, "GET", "/charges", &user, None, "", patience)
                .await
                .expect("charges answered")
                .json()
        }
    };

    let (mut first_instance, addr) = example::start(&schema, &env).await;
    let first = checkout(addr, r#"{"amount":1999,"currency":"EUR"}"#).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    assert!(!first.replayed());
    // The same request (keys in another order): the replay, not a second charge.
    let again = checkout(addr, r#"{ "currency": "EUR", "amount": 1999 }"#).await;
    assert_eq!(again.status, StatusCode::CREATED, "{again:?}");
    assert!(again.replayed(), "{again:?}");
    assert_eq!(again.body, first.body);
    let ledger = charges(addr).await;
    assert_eq!(
        ledger["charges"].as_array().map(Vec::len),
        Some(1),
        "{ledger}"
    );
    assert_eq!(ledger["attempts"], 1, "{ledger}");
    assert_eq!(ledger["provider_payments"], 1, "{ledger}");

    // The record is a finished hash in Redis; PostgreSQL has no record table in this schema.
    let mut redis = redis::Client::open(redis_url())
        .expect("REDIS_URL")
        .get_multiplexed_async_connection()
        .await
        .expect("Redis");
    let state: Option<String> = redis::cmd("HGET")
        .arg(record_key(&key, &user, "POST /checkout"))
        .arg("st")
        .query_async(&mut redis)
        .await
        .expect("HGET");
    assert_eq!(state.as_deref(), Some("completed"));
    let (table,): (Option<String>,) = sqlx::query_as("SELECT to_regclass($1)::text")
        .bind(format!("{schema}.idempotency_records"))
        .fetch_one(&admin)
        .await
        .expect("to_regclass");
    assert_eq!(table, None, "the records are not in PostgreSQL");

    // Another process, which remembers nothing of the first: the record in Redis replays.
    first_instance.kill().await.expect("stop the example");
    let (_second_instance, addr) = example::start(&schema, &env).await;
    let replay = checkout(addr, r#"{"amount":1999,"currency":"EUR"}"#).await;
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(replay.body, first.body);
    let ledger = charges(addr).await;
    assert_eq!(
        ledger["charges"].as_array().map(Vec::len),
        Some(1),
        "{ledger}"
    );
    assert_eq!(ledger["attempts"], 1, "{ledger}");
}
