//! The client against the server crate's checkout example, run as a process of its own: slow,
//! answered twice at once, cut off after the commit, and restarted mid-operation. Each scenario
//! charges once, and the caller gets the first answer.

use std::time::Duration;

use axum_idempotency_client::{IdempotentRequestExt, IdempotentResponseExt, RetryPolicy};
use reqwest::StatusCode;
use reqwest_middleware::{ClientBuilder, ClientWithMiddleware};
use serde_json::Value;

use crate::support::{Checkout, Relay, client, example_binary, fresh_schema, quick};

const ORDER: &str = r#"{"amount":100}"#;

/// `POST /checkout` for `subject` with `key` (a generated one when `None`).
async fn checkout(
    client: &ClientWithMiddleware,
    url: String,
    subject: &str,
    key: Option<&str>,
) -> (StatusCode, axum_idempotency_client::IdempotencyInfo, Value) {
    let request = client
        .post(url)
        .bearer_auth(subject)
        .header("content-type", "application/json")
        .body(ORDER);
    let request = match key {
        Some(key) => request.idempotency_key(key),
        None => request.idempotent(),
    };
    let response = request.send().await.expect("checkout");
    let status = response.status();
    let info = response.idempotency().cloned().expect("idempotency info");
    let text = response.text().await.expect("body");
    let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
    (status, info, body)
}

/// One charge for `subject`, the one `answer` names, and one handler run.
async fn charged_once(server: &Checkout, subject: &str, answer: &Value) {
    let (charges, runs) = server.charges(subject).await;
    assert_eq!(charges.len(), 1, "one charge: {charges:?}");
    assert_eq!(answer["id"], charges[0]["id"], "the first answer: {answer}");
    assert_eq!(answer["status"], "succeeded");
    assert_eq!(runs, 1, "the handler ran once");
}

/// The first attempt times out on a slow checkout; the retry, with the same key, finds it in
/// progress and polls until its answer is replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_first_request_is_polled_to_its_answer() {
    let server = Checkout::start(&[("CHECKOUT_DELAY_MS", "3000".into())]).await;
    // Each attempt gives up after 1 s; the checkout takes 3 s.
    let impatient = ClientBuilder::new(
        reqwest::Client::builder()
            .timeout(Duration::from_secs(1))
            .build()
            .expect("client"),
    )
    .with(axum_idempotency_client::IdempotencyMiddleware::new(quick()))
    .build();
    let (status, info, body) = checkout(&impatient, server.url("/checkout"), "sam", None).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    assert!(
        info.replayed(),
        "the answer of the run the first attempt started"
    );
    assert!(info.attempts() >= 2, "{info:?}");
    charged_once(&server, "sam", &body).await;
}

/// A second send of the same operation while the first runs (a double click): `409 in_progress`,
/// polled after its `Retry-After`, then the first answer as a replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_is_answered_409_then_replayed() {
    let server = Checkout::start(&[("CHECKOUT_DELAY_MS", "3000".into())]).await;
    let c = client(quick());
    let first = {
        let (c, url) = (c.clone(), server.url("/checkout"));
        tokio::spawn(async move { checkout(&c, url, "dana", Some("double-click")).await })
    };
    server
        .wait_for_state("dana", "double-click", "in_progress")
        .await;
    let (status, second, body) =
        checkout(&c, server.url("/checkout"), "dana", Some("double-click")).await;
    let (first_status, first, first_body) = first.await.expect("first");
    assert_eq!(
        (first_status, status),
        (StatusCode::CREATED, StatusCode::CREATED)
    );
    assert!(!first.replayed() && second.replayed());
    assert!(second.attempts() >= 2, "answered 409 first: {second:?}");
    assert_eq!(first.attempts(), 1);
    assert_eq!(body, first_body, "the duplicate gets the first answer");
    charged_once(&server, "dana", &first_body).await;
}

/// The server charges and commits (on PostgreSQL, the charge with its record), and the answer is
/// lost on the way back: the retry gets it as a replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_lost_after_the_commit_is_replayed() {
    let database = fresh_schema("cut").await;
    let server = Checkout::start(&[("DATABASE_URL", database)]).await;
    let relay = Relay::start(server.addr).await;
    relay.lose_answers(1);
    let (status, info, body) =
        checkout(&client(quick()), relay.url("/checkout"), "cleo", None).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    assert_eq!(relay.lost(), 1);
    assert!(info.replayed() && info.attempts() >= 2, "{info:?}");
    assert!(info.expires_at().is_some());
    charged_once(&server, "cleo", &body).await;
}

/// The answer is lost, and the server restarts before the retry reaches it: the record committed
/// on PostgreSQL outlives the process, and the new one replays it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_after_the_commit_replays_from_the_database() {
    let database = fresh_schema("restart_done").await;
    let env = [("DATABASE_URL", database)];
    let mut first = Checkout::start(&env).await;
    let relay = Relay::start(first.addr).await;
    relay.lose_answer_and_go_dark();
    // Retries until the new process answers, within the policy's deadline (60 s): how many that
    // takes depends on how long the machine takes to kill and start.
    let c = client(quick().max_attempts(1000));
    let call = {
        let (c, url) = (c.clone(), relay.url("/checkout"));
        tokio::spawn(async move { checkout(&c, url, "remy", Some("restart-after")).await })
    };
    // The answer is lost and the server out of reach, the charge committed with its record; then
    // the process is killed, and until the new one is up every retry finds no server. The kill
    // waits for the loss, not only for the commit: killed between its commit and its answer, the
    // first process would send nothing to lose, and the relay would lose the new process's
    // replay instead, and stay dark.
    relay.wait_for_lost(1).await;
    first
        .wait_for_state("remy", "restart-after", "completed")
        .await;
    first.child.kill().await.expect("kill -9");
    let second = Checkout::start(&env).await;
    relay.set_upstream(Some(second.addr));
    let (status, info, body) = call.await.expect("caller");
    assert_eq!(status, StatusCode::CREATED, "{body}");
    assert!(info.replayed(), "{info:?}");
    assert_eq!(relay.lost(), 1);
    charged_once(&second, "remy", &body).await;
}

/// The server is killed while the checkout runs (nothing committed), and restarted: the caller
/// retries through the outage, polls the claim the dead process left until its TTL passes, and
/// the retaken run charges once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_mid_operation_is_retaken_and_charges_once() {
    let database = fresh_schema("restart_mid").await;
    let ttl = ("IDEMPOTENCY_IN_PROGRESS_TTL_SECS", "3".to_owned());
    let db = ("DATABASE_URL", database);
    let mut first = Checkout::start(&[
        db.clone(),
        ttl.clone(),
        ("CHECKOUT_DELAY_MS", "60000".into()),
    ])
    .await;
    let relay = Relay::start(first.addr).await;
    let policy = RetryPolicy::new()
        .backoff(Duration::from_millis(50), Duration::from_millis(500))
        .deadline(Duration::from_secs(90))
        .max_attempts(1000);
    let c = client(policy);
    let call = {
        let (c, url) = (c.clone(), relay.url("/checkout"));
        tokio::spawn(async move { checkout(&c, url, "mia", Some("restart-mid")).await })
    };
    first
        .wait_for_state("mia", "restart-mid", "in_progress")
        .await;
    relay.set_upstream(None);
    first.child.kill().await.expect("kill -9 mid-checkout");
    let second = Checkout::start(&[db, ttl]).await;
    relay.set_upstream(Some(second.addr));
    let (status, info, body) = call.await.expect("caller");
    assert_eq!(status, StatusCode::CREATED, "{body}");
    assert!(
        !info.replayed(),
        "the first run never answered: this is the retaken run's"
    );
    assert!(info.attempts() >= 2, "{info:?}");
    assert_eq!(info.key().as_str(), "restart-mid");
    charged_once(&second, "mia", &body).await;

    // And it is the operation's answer from now on.
    let (status, again, replayed) =
        checkout(&c, relay.url("/checkout"), "mia", Some("restart-mid")).await;
    assert_eq!(status, StatusCode::CREATED);
    assert!(again.replayed());
    assert_eq!(replayed, body);
}

/// The runnable example, against the checkout example: it loses its first two answers and still
/// charges once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_example_caller_survives_its_flaky_network() {
    let server = Checkout::start(&[]).await;
    let run = tokio::time::timeout(
        Duration::from_secs(60),
        tokio::process::Command::new(example_binary("checkout_client"))
            .env("CHECKOUT_URL", format!("http://{}", server.addr))
            .env("LOST_ANSWERS", "2")
            .env("SUBJECT", "exa")
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("the example ends within 60 s")
    .expect("run the example");
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&run.stderr)
    );
    assert!(stdout.contains("status: 201 Created"), "{stdout}");
    assert!(stdout.contains("replayed: true"), "{stdout}");
    assert!(stdout.contains("answers lost on the way: 2"), "{stdout}");
    let (charges, runs) = server.charges("exa").await;
    assert_eq!((charges.len(), runs), (1, 1), "{stdout}");
}
