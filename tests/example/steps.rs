//! Recovery points in the checkout example: its checkout is three steps (reserve stock at the
//! warehouse, charge at the provider, send the receipt), each an external call to a simulated
//! service that takes no idempotency key and counts every call. The example's process is killed
//! (SIGKILL) after each step in turn, on Postgres, SQLite and MySQL; a retry after the restart and
//! the TTL takes the record over and runs only the steps left: every service is called once, the
//! ledger is charged once, and the answer is recorded once (the next retry replays it).
#![cfg(feature = "postgres")]

use std::time::{Duration, Instant};

use axum::http::StatusCode;
use serde_json::Value;

use super::e2e::{charges, checkout_past_silence, checkout_req, http, try_http};
use crate::common::example;

/// The in-progress TTL of the killed process and of its successor.
const TTL: Duration = Duration::from_secs(4);

/// How many times `user`'s checkouts called each simulated service (warehouse, provider, mail),
/// and how many times a run paused after its step (the test setting).
async fn calls(addr: std::net::SocketAddr, user: &str) -> ([i64; 3], i64) {
    let answer = http(addr, "GET", "/charges", user, None, "").await;
    assert_eq!(answer.status, StatusCode::OK);
    let json: Value = answer.json();
    let count = |s: &str| json["calls"][s].as_i64().expect("calls");
    (["warehouse", "provider", "mail"].map(count), count("pause"))
}

/// The example on the database at `url`, killed while it pauses after the step `after` (1
/// reserve, 2 charge, 3 receipt: the pause is counted once that step is recorded), then
/// restarted: the retry past the TTL resumes.
async fn killed_after(url: &str, after: usize) {
    let user = "steps";
    let body = r#"{"amount":1200}"#;
    let ttl = TTL.as_secs().to_string();
    let paused = [
        ("IDEMPOTENCY_IN_PROGRESS_TTL_SECS", ttl.clone()),
        ("CHECKOUT_PAUSE_AFTER_STEP", after.to_string()),
        ("CHECKOUT_STEP_PAUSE_MS", "30000".to_owned()),
    ];
    let (mut first, addr) = example::start_with_url(url, &paused).await;
    let in_flight =
        tokio::spawn(
            async move { try_http(addr, "POST", "/checkout", user, Some("st-1"), body).await },
        );
    // The first run recorded the step `after` and paused: its services were called up to it.
    let deadline = Instant::now() + Duration::from_secs(25);
    while calls(addr, user).await.1 == 0 {
        assert!(
            Instant::now() < deadline,
            "the first run never paused after step {after}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut want = [0; 3];
    want[..after].fill(1);
    assert_eq!(
        calls(addr, user).await.0,
        want,
        "the steps up to {after} ran"
    );
    first.kill().await.expect("kill -9 between two steps");
    let killed_at = Instant::now();
    assert!(
        in_flight.await.expect("client").is_err(),
        "its client lost the answer"
    );

    let env = [("IDEMPOTENCY_IN_PROGRESS_TTL_SECS", ttl)];
    let (_second, addr) = example::start_with_url(url, &env).await;
    tokio::time::sleep(TTL.saturating_sub(killed_at.elapsed()) + Duration::from_millis(500)).await;
    let resumed = checkout_past_silence(addr, user, "st-1", body, TTL).await;
    assert_eq!(resumed.status, StatusCode::CREATED, "{resumed:?}");
    assert!(!resumed.replayed());
    assert_eq!(
        calls(addr, user).await.0,
        [1, 1, 1],
        "each service called once"
    );
    let replay = checkout_req(addr, user, "st-1", body).await;
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(replay.body, resumed.body, "recorded once");
    let (charged, attempts) = charges(addr, user).await;
    assert_eq!(
        (charged, attempts),
        (1, 2),
        "charged once; the handler ran twice"
    );
    assert_eq!(calls(addr, user).await, ([1, 1, 1], 1));
}

mod postgres {
    use super::*;

    async fn url() -> String {
        let (schema, _) = crate::e2e::schema_pool().await;
        format!("{}?options[search_path]={schema}", example::database_url())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn killed_after_reserving_resumes_with_the_charge() {
        killed_after(&url().await, 1).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn killed_after_charging_resumes_with_the_receipt() {
        killed_after(&url().await, 2).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn killed_after_the_receipt_only_records() {
        killed_after(&url().await, 3).await;
    }
}

#[cfg(feature = "sqlite")]
mod sqlite {
    use super::*;

    fn url() -> String {
        format!("sqlite://{}", crate::common::sqlite::fresh_path().display())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn killed_after_reserving_resumes_with_the_charge() {
        killed_after(&url(), 1).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn killed_after_charging_resumes_with_the_receipt() {
        killed_after(&url(), 2).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn killed_after_the_receipt_only_records() {
        killed_after(&url(), 3).await;
    }
}

#[cfg(feature = "mysql")]
mod mysql {
    use super::*;

    async fn url() -> String {
        crate::e2e::mysql::database().await.0
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn killed_after_reserving_resumes_with_the_charge() {
        killed_after(&url().await, 1).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn killed_after_charging_resumes_with_the_receipt() {
        killed_after(&url().await, 2).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn killed_after_the_receipt_only_records() {
        killed_after(&url().await, 3).await;
    }
}
