//! What production throws at the layer: database and Redis connections cut or stalled at every
//! step, the handler's transaction committed with its record (or not at all), several instances
//! of the example started at once on one database, and the tower-http layers put around this one.
//!
//! One test binary for the group (each binary links the whole crate once); every module is one
//! former test file.

#[path = "../common/mod.rs"]
mod common;

mod adopters;
mod faults;
mod instances;
mod mysql;
mod once;
mod once_transactions;
mod redis_faults;
mod tenants;
mod tower_http;
mod transactions;

/// Checks that `answer` is the layer's `503` for a handler that ran and whose answer the store had
/// not taken yet: retryable, and never the handler's own answer (which a retry could not be sure
/// to get again).
fn not_recorded_yet(answer: &common::Answer) {
    assert_eq!(
        answer.status,
        axum::http::StatusCode::SERVICE_UNAVAILABLE,
        "{answer:?}"
    );
    assert_eq!(answer.problem(), "idempotency_store_unavailable");
    assert_eq!(answer.json()["retryable"], true, "{answer:?}");
    assert!(answer.header("retry-after").is_some(), "{answer:?}");
}
