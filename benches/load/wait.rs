//! The bounded wait (`IdempotencyLayerBuilder::wait`): what a duplicate that waits sees, against
//! what the holder's handler takes. A first request runs a handler of a fixed time; a duplicate
//! sent a little later waits and gets the replay. The baseline, measured in the same round, is the
//! time the first request itself took from the duplicate's send to its own answer: the least a
//! waiter could see. The ratio is the waiter's latency over that; its excess is what the wait adds.
//!
//! Three cases: the duplicate at the holding instance (woken by the holder's let-go), and at
//! another instance over the same store (woken by its look-ups of the record), on the memory store
//! and on Postgres.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::http::StatusCode;
use axum::middleware;
use axum::response::Response;
use axum::routing::post;
use axum_idempotency::store::IdempotencyStore;
use axum_idempotency::{IdempotencyLayer, MemoryStore};

use super::{Client, auth, created, fresh_pg_store, ms, scale, serve};

/// The holder's handler time.
const HANDLER: Duration = Duration::from_millis(200);
/// How long after the first request the duplicate is sent.
const OFFSET: Duration = Duration::from_millis(50);

fn waiting_router<S: IdempotencyStore>(store: S) -> Router {
    async fn slow(_body: Bytes) -> Response {
        tokio::time::sleep(HANDLER).await;
        created(Bytes::new()).await
    }
    let layer = IdempotencyLayer::builder(store)
        .wait(Duration::from_secs(2))
        .build()
        .expect("layer");
    Router::new()
        .route("/checkout", post(slow))
        .route_layer(layer)
        .layer(middleware::from_fn(auth))
}

/// Per round: (the holder's time from the duplicate's send to its answer, the waiter's latency).
async fn rounds(
    holder: SocketAddr,
    waiter: SocketAddr,
    label: &str,
    n: usize,
) -> (Vec<Duration>, Vec<Duration>) {
    let (mut base, mut waited) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for round in 0..n {
        let key = format!("wait-{label}-{round}");
        let mut first = Client::connect(holder).await;
        let mut second = Client::connect(waiter).await;
        let started = Instant::now();
        let first_key = key.clone();
        let first = tokio::spawn(async move {
            let status = first
                .post("/checkout", "alice", &first_key, Bytes::new())
                .await;
            (status, Instant::now())
        });
        tokio::time::sleep_until((started + OFFSET).into()).await;
        let sent = Instant::now();
        let status = second.post("/checkout", "alice", &key, Bytes::new()).await;
        let answered = Instant::now();
        let (first_status, first_done) = first.await.expect("first");
        assert_eq!(first_status, StatusCode::CREATED);
        assert_eq!(status, StatusCode::CREATED, "the waiter gets the replay");
        base.push(first_done.saturating_duration_since(sent));
        waited.push(answered - sent);
    }
    (base, waited)
}

fn p(sorted: &[Duration], q: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * q).round() as usize]
}

fn report(case: &str, (mut base, mut waited): (Vec<Duration>, Vec<Duration>)) {
    base.sort();
    waited.sort();
    let (b50, w50, w99) = (p(&base, 0.5), p(&waited, 0.5), p(&waited, 0.99));
    println!(
        "| {case} | {} | {} | {} | {:.2}x | {} |",
        ms(b50),
        ms(w50),
        ms(w99),
        w50.as_secs_f64() / b50.as_secs_f64(),
        ms(w50.saturating_sub(b50)),
    );
}

pub(super) async fn waiting_duplicates(schema: &str) {
    let n = scale(60);
    println!("\n### A duplicate that waits for the holder's answer ({n} rounds a case)\n");
    println!(
        "The holder's handler takes {} ms; the duplicate is sent {} ms after it.\n",
        HANDLER.as_millis(),
        OFFSET.as_millis()
    );
    println!(
        "| case | holder, from the duplicate's send to its answer (p50) | waiter p50 | waiter p99 | p50 ratio | added (p50) |"
    );
    println!("|---|---|---|---|---|---|");
    let memory = MemoryStore::new();
    let one = serve(waiting_router(memory.clone())).await;
    report(
        "memory, same instance (woken by the let-go)",
        rounds(one, one, "m1", n).await,
    );
    let other = serve(waiting_router(memory)).await;
    report(
        "memory, another instance (look-ups)",
        rounds(one, other, "m2", n).await,
    );
    let postgres = fresh_pg_store(schema, 8).await;
    let one = serve(waiting_router(postgres.clone())).await;
    let other = serve(waiting_router(postgres)).await;
    report("Postgres, same instance", rounds(one, one, "p1", n).await);
    report(
        "Postgres, another instance (look-ups)",
        rounds(one, other, "p2", n).await,
    );
}
