//! A checkout API whose charges happen once, however often the client retries.
//!
//! ```text
//! cargo run --example checkout --features postgres
//! curl -i localhost:3000/checkout -H 'Authorization: Bearer alice' \
//!      -H 'Idempotency-Key: order-1' -H 'Content-Type: application/json' -d '{"amount":1999}'
//! ```
//!
//! Environment: `BIND` (default `127.0.0.1:3000`), `DATABASE_URL` (`postgres://...`;
//! `sqlite://PATH` with the `sqlite` feature: records and charges in that SQLite file, made when
//! absent; `mysql://...` with the `mysql` feature, for MySQL or MariaDB; the memory store when
//! unset), `IDEMPOTENCY_IN_PROGRESS_TTL_SECS` (default 90), `CHECKOUT_DELAY_MS` (simulated payment
//! latency, default 0), `CHECKOUT_HOLD_MS` (a pause after the charge is written, before the answer,
//! to watch a crash at that point; default 0), `CHECKOUT_TRANSACTIONAL` (on the SQL stores, write
//! the charge in the layer's transaction so it commits with its record; default 1, 0 to write it
//! on its own as a handler without `IdempotencyTx` would). A checkout's body may add
//! `"latency_ms"`, the simulated provider latency of that one checkout (at most a minute).
//!
//! ```text
//! cargo run --example checkout --features postgres,sqlite  # DATABASE_URL=sqlite://checkout.db
//! ```
//!
//! `IDEMPOTENCY_WAIT_MS` (default 0): how long a duplicate of a checkout still in progress waits
//! for its answer (the replay) before `409`.
//!
//! `GET /checkout/idempotency/{key}` answers the caller's own checkout with that key:
//! `{"state": "completed" | "failed" | "in_progress", "status": <stored status or null>,
//! "expires_at": "<RFC 3339>"}`, or 404; `DELETE` on the same path forgets a finished one (204; 409
//! while in progress; 404 when there is none), after which the key is new.
//!
//! `REDIS_URL` (feature `redis`) puts the idempotency records in that Redis, whatever
//! `DATABASE_URL` says; the charges stay in Postgres when `DATABASE_URL` is set, in memory
//! otherwise. Redis has no transaction to share with a handler: `IdempotencyTx` is `None` there,
//! and the charge is written on its own.
//!
//! The simulated payment provider deduplicates by the `Idempotency-Key` it is given, as real ones
//! do; the checkout gives it `IdempotencyContext::derived_key()`, so a retake that runs the handler
//! again (its process died) does not charge the card twice at the provider either.
//!
//! With the `metrics` feature, `GET /metrics` (no auth) serves the layer's metrics in Prometheus'
//! text format. With the `openapi` feature, `GET /openapi.json` (no auth) serves the API's OpenAPI
//! document, the idempotency layer's contract on `POST /checkout` and `POST /refund`.
//!
//! Around the API, the tower-http layers a production service has (see `app::around`): a request id
//! (`x-request-id`, kept when the caller sends one, returned on every answer), a trace span per
//! request that the layer's outcome and the `instance` of its problems are logged in, a panic
//! catcher, a timeout (`REQUEST_TIMEOUT_SECS`, default 30: the client gets `408`, the checkout runs
//! on and its retry gets the replay), compression, and a body limit of 64 KiB (`413`).
//!
//! On SIGINT or SIGTERM the server stops accepting, answers the requests it has, and waits for
//! what the idempotency layer still runs on its own (requests whose clients went away, completions
//! being retried, recorders of streamed bodies), all within one deadline from the signal
//! (`SHUTDOWN_GRACE_SECS`, default 20: below Kubernetes' default grace period of 30 s, so the
//! process exits before it is killed). A deploy that stops the process between a charge and its
//! record therefore still records it, and the retry after the restart gets the replay instead of a
//! second charge; a request still running at the deadline ends with the process, and its key is
//! retaken after the in-progress TTL.
//!
//! The example is cut in modules: `settings` (the environment), `stores` (the store it names),
//! `app` (the layer, the routes and the layers around them), `handlers` (the payments),
//! `inspection` (the caller's own records), `ledger` (the charges, with `sqlite_ledger` and
//! `mysql_ledger`), `problem` (its own errors), `openapi` and `prometheus` (features).

// The example's own types are not a library's: they need no `Debug`.
#![allow(missing_debug_implementations)]

use std::error::Error;
use std::time::Duration;

mod app;
mod handlers;
mod inspection;
mod ledger;
mod problem;
mod settings;
#[cfg(feature = "sqlite")]
mod sqlite_ledger;
mod stores;

#[cfg(feature = "metrics")]
mod prometheus;

#[cfg(feature = "openapi")]
mod openapi;

#[cfg(feature = "mysql")]
pub(crate) mod mysql_ledger;

// What the modules share.
use self::app::{app, drain, idempotency, shutdown_signal, store_timeout};
use self::ledger::{Ledger, TxConn};
use self::problem::{error, problem};
use self::settings::Settings;
use self::stores::router_from_env;

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,sqlx=warn".into()),
        )
        .init();
    #[cfg(feature = "metrics")]
    prometheus::install()?;
    let settings = Settings::from_env()?;
    let router = router_from_env(settings).await?;
    let bind = std::env::var("BIND").unwrap_or_else(|_| "127.0.0.1:3000".to_owned());
    let listener = tokio::net::TcpListener::bind(&bind).await?;
    tracing::info!("listening on http://{}", listener.local_addr()?);
    // One deadline for the whole shutdown, from the signal: the graceful phase (the server
    // answers the requests it has) and the drain (what the layer still runs on its own) together.
    let grace = Duration::from_secs(
        std::env::var("SHUTDOWN_GRACE_SECS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(20),
    );
    let (deadline_tx, mut deadline_rx) = tokio::sync::watch::channel(None);
    let server = axum::serve(listener, router).with_graceful_shutdown(async move {
        shutdown_signal().await;
        deadline_tx.send_replace(Some(tokio::time::Instant::now() + grace));
    });
    let deadline = {
        let mut deadline_rx = deadline_rx.clone();
        async move {
            let Ok(deadline) = deadline_rx.wait_for(Option::is_some).await else {
                return std::future::pending().await;
            };
            let deadline = deadline.unwrap_or_else(tokio::time::Instant::now);
            tokio::time::sleep_until(deadline).await;
        }
    };
    tokio::select! {
        served = std::future::IntoFuture::into_future(server) => served?,
        () = deadline => tracing::warn!(
            "the shutdown deadline passed with requests still being answered; they end with the \
             process, their keys retakable after the in-progress TTL"
        ),
    }
    // Every guarded request counts in the drain until it ends, attached to its client or not:
    // what is left (a checkout whose client gave up, a record still being written) gets what is
    // left of the deadline.
    let deadline = deadline_rx
        .borrow_and_update()
        .unwrap_or_else(tokio::time::Instant::now);
    let drain = drain();
    tracing::info!(running = drain.running(), "draining the idempotency layer");
    if drain
        .wait(deadline.saturating_duration_since(tokio::time::Instant::now()))
        .await
    {
        tracing::info!("drained; exiting");
    } else {
        tracing::warn!(
            running = drain.running(),
            "the shutdown deadline passed with idempotent work still running"
        );
    }
    Ok(())
}
