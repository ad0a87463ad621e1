//! `GET` and `DELETE /checkout/idempotency/{key}`: the caller's own checkout record.

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use axum_idempotency::store::{Deleted, IdempotencyStore, RecordKey};
use axum_idempotency::{Subject, tombstone_of};
use serde_json::json;

use super::{error, problem};

/// The caller's own checkout record of `key`, in the scope the layer gives it.
/// `None` for a key the layer would refuse (the same rules as the header's): it is not looked up.
fn checkout_scope(subject: &Subject, key: &str) -> Option<RecordKey> {
    axum_idempotency::layer::key::parse(key.as_bytes())
        .ok()
        .map(|key| RecordKey {
            key,
            subject: subject.0.clone(),
            endpoint: "POST /checkout".into(),
        })
}

fn invalid_key() -> Response {
    error(StatusCode::BAD_REQUEST, "invalid_idempotency_key")
}

fn store_unavailable() -> Response {
    problem(
        StatusCode::SERVICE_UNAVAILABLE,
        "idempotency_store_unavailable",
        true,
    )
}

/// `GET /checkout/idempotency/{key}`: the state of the caller's own checkout with that key.
pub(crate) async fn inspect<S: IdempotencyStore>(
    State(store): State<S>,
    Extension(subject): Extension<Subject>,
    Path(key): Path<String>,
) -> Response {
    let Some(scope) = checkout_scope(&subject, &key) else {
        return invalid_key();
    };
    match store.lookup(&scope).await {
        Ok(Some(info)) => Json(json!({
            "state": info.state.as_str(),
            "status": info.status,
            "expires_at": humantime::format_rfc3339_seconds(info.expires_at).to_string(),
        }))
        .into_response(),
        Ok(None) => error(StatusCode::NOT_FOUND, "not_found"),
        Err(_) => store_unavailable(),
    }
}

/// `DELETE /checkout/idempotency/{key}`: forget the caller's finished checkout with that key, so
/// the key is new; refused while it is in progress.
pub(crate) async fn forget<S: IdempotencyStore>(
    State(store): State<S>,
    Extension(subject): Extension<Subject>,
    Path(key): Path<String>,
) -> Response {
    let Some(scope) = checkout_scope(&subject, &key) else {
        return invalid_key();
    };
    // Deleting says "make the key new": the record, then its tombstone, or the next request with
    // the key would be told it expired. A tombstone still being written is deleted by its writer,
    // which finds the record gone.
    let record = match store.delete(&scope).await {
        Ok(Deleted::InProgress) => return problem(StatusCode::CONFLICT, "in_progress", true),
        Ok(deleted) => deleted,
        Err(_) => return store_unavailable(),
    };
    let tombstone = match store.delete(&tombstone_of(&scope)).await {
        Ok(deleted) => deleted,
        // The record is gone already: the DELETE sent again deletes the tombstone.
        Err(_) => return store_unavailable(),
    };
    if record == Deleted::Deleted || tombstone == Deleted::Deleted {
        StatusCode::NO_CONTENT.into_response()
    } else {
        error(StatusCode::NOT_FOUND, "not_found")
    }
}
