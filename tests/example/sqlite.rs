//! The checkout example on SQLite (`DATABASE_URL=sqlite://PATH`): its scenarios, the example
//! started on a file of its own, and the example binary itself on a file, killed and restarted: the
//! records and the ledger survive it, and a charge written in the layer's transaction by a process
//! killed before its commit is charged once.
#![cfg(all(feature = "postgres", feature = "sqlite"))]

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use axum_idempotency::store::SqliteStore;
use sqlx::SqlitePool;
use tokio::process::Child;

use super::e2e::{
    Served, charges, checkout_req, client_closes_mid_checkout, duplicates_during_a_slow_checkout,
    inspection_routes, outcomes_and_isolation, provider_payments, serve_url, try_http,
};
use crate::common::{example, sqlite::fresh_path};

/// The example on a SQLite file of its own, records and ledger in it, checkouts written in the
/// layer's transaction.
async fn serve_sqlite(delay_ms: u64) -> Served {
    serve_url(&format!("sqlite://{}", fresh_path().display()), delay_ms).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_duplicates_during_a_slow_checkout() {
    let served = serve_sqlite(1500).await;
    duplicates_during_a_slow_checkout(served.addr).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_client_closes_mid_checkout() {
    let served = serve_sqlite(800).await;
    client_closes_mid_checkout(served.addr).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_outcomes_and_isolation() {
    let served = serve_sqlite(0).await;
    outcomes_and_isolation(served.addr).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_inspection_routes() {
    let served = serve_sqlite(400).await;
    inspection_routes(served.addr).await;
}

/// The example as a process of its own on the SQLite file at `path`, with `env`.
async fn start(path: &Path, ttl_secs: u64, env: &[(&str, &str)]) -> (Child, SocketAddr) {
    let mut all = vec![("IDEMPOTENCY_IN_PROGRESS_TTL_SECS", ttl_secs.to_string())];
    all.extend(env.iter().map(|(k, v)| (*k, (*v).to_owned())));
    example::start_with_url(&format!("sqlite://{}", path.display()), &all).await
}

/// Polls `sql` (one integer) on the file until it returns `want`, for at most ten seconds.
async fn wait_for(pool: &SqlitePool, sql: &'static str, want: i64) {
    for _ in 0..500 {
        let row: Option<(i64,)> = sqlx::query_as(sql)
            .fetch_optional(pool)
            .await
            .expect("poll");
        if row.is_some_and(|(v,)| v == want) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("{sql} never returned {want}");
}

/// Killed (SIGKILL) after the charge was written in the layer's transaction, before the commit:
/// the charge rolls back with the process (its file locks go with it), the restarted process finds
/// the claim in progress until the TTL, then retakes it and charges once. The provider, called
/// with the derived key, is charged once across both runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_checkout_killed_before_the_commit_charges_once() {
    let path = fresh_path();
    let body = r#"{"amount":700}"#;
    const TTL: Duration = Duration::from_secs(4);
    let (mut first, addr) = start(&path, TTL.as_secs(), &[("CHECKOUT_HOLD_MS", "20000")]).await;
    let in_flight = tokio::spawn(async move {
        try_http(addr, "POST", "/checkout", "hana", Some("tx-1"), body).await
    });
    // Another process's view of the file: the provider was paid, and the charge is written in a
    // transaction not yet committed (the handler pauses while it holds it).
    let reader = SqlitePool::connect_with(SqliteStore::connect_options(
        sqlx::sqlite::SqliteConnectOptions::new().filename(&path),
    ))
    .await
    .expect("open the file");
    wait_for(
        &reader,
        "SELECT count(*) FROM provider_payments WHERE subject = 'hana'",
        1,
    )
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    wait_for(
        &reader,
        "SELECT count(*) FROM checkout_charges WHERE subject = 'hana'",
        0,
    )
    .await;
    first.kill().await.expect("kill -9 before the commit");
    let killed_at = Instant::now();
    assert!(in_flight.await.expect("client").is_err());

    let (_second, addr) = start(&path, TTL.as_secs(), &[]).await;
    let early = checkout_req(addr, "hana", "tx-1", body).await;
    assert_eq!(early.status, StatusCode::CONFLICT, "held until the TTL");
    tokio::time::sleep(TTL.saturating_sub(killed_at.elapsed()) + Duration::from_millis(500)).await;
    let retaken = checkout_req(addr, "hana", "tx-1", body).await;
    assert_eq!(retaken.status, StatusCode::CREATED, "{retaken:?}");
    assert!(!retaken.replayed());
    let replay = checkout_req(addr, "hana", "tx-1", body).await;
    assert!(replay.replayed());
    assert_eq!(
        charges(addr, "hana").await,
        (1, 2),
        "one charge, two runs of the handler"
    );
    assert_eq!(provider_payments(addr, "hana").await, 1);
}

/// A process killed (SIGKILL) right after a checkout, and another started on the same file: the
/// record and the charge survived, and the retry is the replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_replay_survives_a_killed_process() {
    let path = fresh_path();
    let body = r#"{"amount":777}"#;
    let (mut first, addr) = start(&path, 90, &[]).await;
    let charged = checkout_req(addr, "hank", "restart-1", body).await;
    assert_eq!(charged.status, StatusCode::CREATED);
    first.kill().await.expect("kill -9");
    let (_second, addr) = start(&path, 90, &[]).await;
    let replay = checkout_req(addr, "hank", "restart-1", body).await;
    assert_eq!(replay.status, StatusCode::CREATED);
    assert!(replay.replayed());
    assert_eq!(replay.body, charged.body);
    assert_eq!(charges(addr, "hank").await, (1, 1));
}
