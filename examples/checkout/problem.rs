//! The example's own error answers, as problem details (RFC 9457) like the layer's: a client of
//! the protocol reads `retryable` (and `Retry-After`) the same way on both. A `503` (the provider
//! or the ledger unavailable) is retryable: the layer released its record.

use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// What each of the example's own errors says (its `detail`).
pub(crate) fn detail(code: &str) -> &'static str {
    match code {
        "unauthenticated" => "send Authorization: Bearer <your user name>",
        "invalid_idempotency_key" => "the key in the path is not a valid Idempotency-Key",
        "not_found" => "no checkout of yours has that key",
        "in_progress" => "the checkout is still in progress; retry later",
        "invalid_amount" => "amount must be a positive whole number of cents",
        "card_declined" => "the card was declined; nothing was charged",
        "account_closed" => "this account was closed: its earlier answers are not sent again",
        "ledger_unavailable" => "the ledger could not be reached; retry later with the same key",
        "provider_unavailable" => {
            "the payment provider could not be reached; retry later with the same key"
        }
        "idempotency_store_unavailable" => "the idempotency store could not be reached",
        _ => "see `error`",
    }
}

/// An error of the example's: retryable when it is a `503`.
pub(crate) fn error(status: StatusCode, code: &str) -> Response {
    problem(status, code, status == StatusCode::SERVICE_UNAVAILABLE)
}

/// The example's own errors, as `application/problem+json` with every member its OpenAPI document
/// (`CheckoutProblem`) says: `type`, `title`, `status`, `detail`, `instance`, `error`, `retryable`.
pub(crate) fn problem(status: StatusCode, code: &str, retryable: bool) -> Response {
    static OCCURRENCES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let occurrence = OCCURRENCES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let started = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let body = json!({
        "type": "about:blank",
        "title": status.canonical_reason().unwrap_or("Error"),
        "status": status.as_u16(),
        "detail": detail(code),
        "instance": format!("/errors/{started}-{occurrence}"),
        "error": code,
        "retryable": retryable,
    });
    let mut response = (
        status,
        [(header::CONTENT_TYPE, "application/problem+json")],
        body.to_string(),
    )
        .into_response();
    if retryable {
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, header::HeaderValue::from_static("2"));
    }
    response
}
