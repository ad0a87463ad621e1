//! The checkout example's OpenAPI document, served at `GET /openapi.json` (feature `openapi`): its
//! routes as it documents them itself, then the idempotency layer's contract written into the
//! routes the layer is on by the layer, so the document says what the layer enforces.

use std::error::Error;

use axum_idempotency::IdempotencyLayer;
use axum_idempotency::store::IdempotencyStore;
use axum_idempotency::utoipa::openapi::OpenApi;
use serde_json::json;

/// The routes behind the idempotency layer keyed by the `Idempotency-Key` header.
pub(crate) const GUARDED: [&str; 2] = ["/checkout", "/refund"];

/// The route behind the idempotency layer keyed by the body's `request_id`.
pub(crate) const KEYED_BY_BODY: &str = "/v2/checkout";

/// The document, as JSON.
pub(crate) fn document<S: IdempotencyStore>(
    idempotency: &IdempotencyLayer<S>,
    by_body: &IdempotencyLayer<S>,
) -> Result<String, Box<dyn Error>> {
    let problem = json!({"application/problem+json": {"schema": {"$ref": "#/components/schemas/CheckoutProblem"}}});
    // Every route is behind the example's authentication: without a bearer token, `401`.
    let unauthenticated = json!({"description": "`unauthenticated`: no bearer token.",
        "content": problem});
    let payment = json!({
        "requestBody": {"required": true, "content": {"application/json": {"schema": {
            "type": "object",
            "required": ["amount"],
            "properties": {
                "amount": {"type": "integer", "description": "In cents."},
                "card": {"type": "string", "description": "`declined` or `flaky` to see those."},
                "latency_ms": {"type": "integer", "maximum": 60000},
            },
        }}}},
        "responses": {
            "201": {
                "description": "Charged (or refunded) once.",
                "headers": {"Location": {"schema": {"type": "string"}}},
                "content": {"application/json": {"schema": {"type": "object"}}},
            },
            "400": {"description": "`invalid_amount`.", "content": problem},
            "401": unauthenticated,
            "402": {"description": "`card_declined`.", "content": problem},
            "403": {"description": "`account_closed`: the account was closed since the first \
                request, and its answer is not sent again.", "content": problem},
            "408": {"description": "Also the service's own timeout (`REQUEST_TIMEOUT_SECS`), \
                answered with no body while the payment may go on: retry with the same key, \
                which gets the payment's answer once it is recorded (409 until then)."},
            "413": {"description": "Also the service's own body limit (64 KiB), answered as \
                plain text when the Content-Length says so: send a smaller body."},
        },
    });
    let record = json!({"name": "key", "in": "path", "required": true,
        "schema": {"type": "string"}});
    let not_found =
        json!({"description": "No checkout of yours with that key.", "content": problem});
    let mut openapi: OpenApi = serde_json::from_value(json!({
        "openapi": "3.1.0",
        "info": {"title": "Checkout", "version": "1.0.0"},
        "security": [{"bearer": []}],
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                "description": "The bearer token is the caller's user name (the example's stand-in \
                    for authentication): the subject of its idempotency records."}},
            "schemas": {"CheckoutProblem": {
                "type": "object",
                "description": "The example's own errors (RFC 9457).",
                "required": ["type", "title", "status", "detail", "instance", "error", "retryable"],
                "properties": {
                    "type": {"type": "string"},
                    "title": {"type": "string"},
                    "status": {"type": "integer"},
                    "detail": {"type": "string"},
                    "instance": {"type": "string"},
                    "error": {"type": "string"},
                    "retryable": {"type": "boolean"},
                },
            }},
        },
        "paths": {
            "/checkout": {"post": payment.clone()},
            "/v2/checkout": {"post": payment.clone()},
            "/refund": {"post": payment},
            "/account/close": {"post": {"responses": {
                "204": {"description": "Closed: replays of the account's earlier answers are \
                    refused (`403 account_closed`)."},
                "401": unauthenticated.clone(),
            }}},
            "/checkout/idempotency/{key}": {
                "parameters": [record],
                "get": {"responses": {
                    "200": {"description": "The checkout's state and expiry.",
                        "content": {"application/json": {"schema": {"type": "object"}}}},
                    "400": {"description": "`invalid_idempotency_key`.", "content": problem},
                    "401": unauthenticated,
                    "404": not_found.clone(),
                    "503": {"description": "`idempotency_store_unavailable`.", "content": problem},
                }},
                "delete": {"responses": {
                    "204": {"description": "Forgotten: the key is new."},
                    "400": {"description": "`invalid_idempotency_key`.", "content": problem},
                    "401": unauthenticated,
                    "404": not_found,
                    "409": {"description": "Still in progress.", "content": problem},
                    "503": {"description": "`idempotency_store_unavailable`.", "content": problem},
                }},
            },
            "/charges": {"get": {"responses": {
                "200": {"description": "The caller's charges.",
                    "content": {"application/json": {"schema": {"type": "object"}}}},
                "401": unauthenticated,
                "503": {"description": "`ledger_unavailable`.", "content": problem},
            }}},
        },
    }))?;
    let documented = idempotency.openapi().paths(GUARDED).document(&mut openapi);
    if documented != GUARDED.len() {
        return Err(format!("the layer documented {documented} routes of {GUARDED:?}").into());
    }
    if by_body
        .openapi()
        .paths([KEYED_BY_BODY])
        .document(&mut openapi)
        != 1
    {
        return Err(format!("the layer did not document {KEYED_BY_BODY}").into());
    }
    Ok(openapi.to_json()?)
}
