//! The payment handlers: a checkout or a refund, its charge written in the layer's transaction
//! on the SQL stores (or on its own), the simulated provider called with the derived key.

use std::time::Duration;

use axum::extract::{FromRequestParts, OptionalFromRequestParts, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use axum_idempotency::layer::IdempotencyRejection;
use axum_idempotency::{Disposition, IdempotencyContext, IdempotencyTx, StepError, Subject};
use serde_json::{Value, json};

use super::app::AppState;
use super::{TxConn, error};

/// The layer's transaction on the records' database: PostgreSQL's, SQLite's or MySQL's, none on
/// the memory and Redis stores (or with `CHECKOUT_TRANSACTIONAL=0`).
pub(crate) enum HandlerTx {
    None,
    Postgres(IdempotencyTx<sqlx::Postgres>),
    #[cfg(feature = "sqlite")]
    Sqlite(IdempotencyTx<sqlx::Sqlite>),
    #[cfg(feature = "mysql")]
    MySql(IdempotencyTx<sqlx::MySql>),
}

impl HandlerTx {
    /// The transaction's connection (begun at the first call), if there is a transaction.
    async fn conn(&mut self) -> Result<Option<TxConn<'_>>, sqlx::Error> {
        Ok(match self {
            HandlerTx::None => None,
            HandlerTx::Postgres(tx) => Some(TxConn::Postgres(tx.conn().await?)),
            #[cfg(feature = "sqlite")]
            HandlerTx::Sqlite(tx) => Some(TxConn::Sqlite(tx.conn().await?)),
            #[cfg(feature = "mysql")]
            HandlerTx::MySql(tx) => Some(TxConn::MySql(tx.conn().await?)),
        })
    }
}

impl<S: Send + Sync> FromRequestParts<S> for HandlerTx {
    type Rejection = IdempotencyRejection;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &S,
    ) -> Result<Self, Self::Rejection> {
        let postgres =
            <IdempotencyTx<sqlx::Postgres> as OptionalFromRequestParts<S>>::from_request_parts(
                parts, state,
            );
        if let Some(tx) = postgres.await? {
            return Ok(HandlerTx::Postgres(tx));
        }
        #[cfg(feature = "sqlite")]
        {
            let sqlite =
                <IdempotencyTx<sqlx::Sqlite> as OptionalFromRequestParts<S>>::from_request_parts(
                    parts, state,
                );
            if let Some(tx) = sqlite.await? {
                return Ok(HandlerTx::Sqlite(tx));
            }
        }
        #[cfg(feature = "mysql")]
        {
            let mysql =
                <IdempotencyTx<sqlx::MySql> as OptionalFromRequestParts<S>>::from_request_parts(
                    parts, state,
                );
            if let Some(tx) = mysql.await? {
                return Ok(HandlerTx::MySql(tx));
            }
        }
        Ok(HandlerTx::None)
    }
}

/// `POST /checkout`. There is no transaction on the memory and Redis stores.
pub(crate) async fn checkout(
    State(state): State<AppState>,
    Extension(subject): Extension<Subject>,
    context: IdempotencyContext,
    tx: HandlerTx,
    body: axum::body::Bytes,
) -> Response {
    pay(&state, &subject.0, "charge", &context, tx, &body).await
}

pub(crate) async fn refund(
    State(state): State<AppState>,
    Extension(subject): Extension<Subject>,
    context: IdempotencyContext,
    tx: HandlerTx,
    body: axum::body::Bytes,
) -> Response {
    pay(&state, &subject.0, "refund", &context, tx, &body).await
}

pub(crate) async fn checkout_separately(
    State(state): State<AppState>,
    Extension(subject): Extension<Subject>,
    context: IdempotencyContext,
    body: axum::body::Bytes,
) -> Response {
    pay(
        &state,
        &subject.0,
        "charge",
        &context,
        HandlerTx::None,
        &body,
    )
    .await
}

pub(crate) async fn refund_separately(
    State(state): State<AppState>,
    Extension(subject): Extension<Subject>,
    context: IdempotencyContext,
    body: axum::body::Bytes,
) -> Response {
    pay(
        &state,
        &subject.0,
        "refund",
        &context,
        HandlerTx::None,
        &body,
    )
    .await
}

/// The simulated payment: wait, count the attempt (outside any transaction, so handler runs are
/// counted even when rolled back), then decline, fail, or charge at the provider (by the derived
/// key) and record the charge (in `tx` when given).
async fn pay(
    state: &AppState,
    subject: &str,
    kind: &str,
    context: &IdempotencyContext,
    mut tx: HandlerTx,
    body: &[u8],
) -> Response {
    let request: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    let Some(amount) = request.get("amount").and_then(Value::as_i64) else {
        // Refused before any effect: the handler says so, and the layer releases the key, so the
        // corrected request runs with the same key rather than get this refusal replayed.
        return (
            Disposition::Release,
            error(StatusCode::BAD_REQUEST, "invalid_amount"),
        )
            .into_response();
    };
    let latency = request
        .get("latency_ms")
        .and_then(Value::as_u64)
        .map_or(Duration::ZERO, |ms| Duration::from_millis(ms.min(60_000)));
    tokio::time::sleep(state.settings.checkout_delay.saturating_add(latency)).await;
    if let Err(e) = state.ledger.count_attempt(subject).await {
        tracing::error!(error = %e, "could not count the attempt");
        return error(StatusCode::SERVICE_UNAVAILABLE, "ledger_unavailable");
    }
    match request.get("card").and_then(Value::as_str) {
        Some("declined") => return error(StatusCode::PAYMENT_REQUIRED, "card_declined"),
        Some("flaky") => return error(StatusCode::SERVICE_UNAVAILABLE, "provider_unavailable"),
        _ => {}
    }
    // Three external calls, each a step: recorded with the record as it returns, so that a run
    // that takes over the record of a process that died between two of them runs only what is
    // left. The warehouse and the mail service take no idempotency key: the steps alone keep them
    // to one call each. They go before the handler's transaction first writes: a step after that
    // is recorded with the transaction's commit, which is for effects in the transaction.
    let ledger = &state.ledger;
    let reserved = context.step("reserve", || ledger.call("warehouse", subject));
    if let Err(e) = reserved.await {
        return step_failed("reserve", e);
    }
    paused_after(state, 1, subject).await;
    let key = context.derived_key();
    let charged = context.step("charge", || async {
        ledger.call("provider", subject).await?;
        ledger.provider_charge(&key, subject, amount).await
    });
    let payment: i64 = match charged.await {
        Ok(payment) => payment,
        Err(e) => return step_failed("charge", e),
    };
    paused_after(state, 2, subject).await;
    let receipt = context.step("receipt", || ledger.call("mail", subject));
    if let Err(e) = receipt.await {
        return step_failed("receipt", e);
    }
    paused_after(state, 3, subject).await;
    // The layer's transaction begins here, at its first use: the provider call above held none.
    let conn = match tx.conn().await {
        Ok(conn) => conn,
        Err(e) => {
            tracing::error!(error = %e, "could not begin the transaction");
            return error(StatusCode::SERVICE_UNAVAILABLE, "ledger_unavailable");
        }
    };
    let recorded = state.ledger.record(subject, kind, amount, conn).await;
    tokio::time::sleep(state.settings.checkout_hold).await;
    match recorded {
        Ok(id) => (
            StatusCode::CREATED,
            [(header::LOCATION, format!("/charges/{id}"))],
            Json(json!({
                "id": id, "kind": kind, "amount": amount, "status": "succeeded",
                "payment": payment,
            })),
        )
            .into_response(),
        Err(e) => {
            tracing::error!(error = %e, "could not record the charge");
            error(StatusCode::SERVICE_UNAVAILABLE, "ledger_unavailable")
        }
    }
}

/// The tests' pause after step `n` (see `Settings::pause_after_step`), counted as a call to
/// `pause` once the step is recorded, so that a test kills the process at a known point.
async fn paused_after(state: &AppState, n: u64, subject: &str) {
    if state.settings.pause_after_step == n {
        if let Err(e) = state.ledger.call("pause", subject).await {
            tracing::error!(error = %e, "could not count the pause");
        }
        tokio::time::sleep(state.settings.step_pause).await;
    }
}

/// A step that did not give its result: `503`, which releases the key, so the retry runs again
/// from the steps recorded (a run that lost its record to a retaker gets its answer ignored).
fn step_failed(step: &str, e: StepError<sqlx::Error>) -> Response {
    tracing::error!(step, error = %e, "a step of the checkout failed");
    error(StatusCode::SERVICE_UNAVAILABLE, "provider_unavailable")
}

/// `POST /account/close`: the caller's account is closed; replays of its earlier answers are
/// refused from now on (the layer's replay check asks [`is_closed`]).
pub(crate) async fn close_account(Extension(subject): Extension<Subject>) -> Response {
    if let Ok(mut closed) = closed_accounts().lock() {
        closed.insert(subject.0);
    }
    StatusCode::NO_CONTENT.into_response()
}

/// Whether `subject`'s account was closed.
pub(crate) fn is_closed(subject: &str) -> bool {
    closed_accounts()
        .lock()
        .map(|closed| closed.contains(subject))
        .unwrap_or(true)
}

/// The demo's closed accounts (a real API asks its accounts service).
fn closed_accounts() -> &'static std::sync::Mutex<std::collections::HashSet<String>> {
    static CLOSED: std::sync::OnceLock<std::sync::Mutex<std::collections::HashSet<String>>> =
        std::sync::OnceLock::new();
    CLOSED.get_or_init(Default::default)
}

pub(crate) async fn charges(
    State(state): State<AppState>,
    Extension(subject): Extension<Subject>,
) -> Response {
    let listed = async {
        let (charges, attempts, payments) = state.ledger.list(&subject.0).await?;
        let mut calls = serde_json::Map::new();
        for service in ["warehouse", "provider", "mail", "pause"] {
            let n = state.ledger.calls(service, &subject.0).await?;
            calls.insert(service.to_owned(), n.into());
        }
        Ok::<_, sqlx::Error>((charges, attempts, payments, calls))
    };
    match listed.await {
        Ok((charges, attempts, payments, calls)) => Json(json!({
            "charges": charges, "attempts": attempts, "provider_payments": payments,
            "calls": calls,
        }))
        .into_response(),
        Err(e) => {
            tracing::error!(error = %e, "could not list charges");
            error(StatusCode::SERVICE_UNAVAILABLE, "ledger_unavailable")
        }
    }
}
